"""`relay replay`: a dump rebuilt from its client request alone, compared with what it recorded."""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import io
import random
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import orjson
import pytest
import yaml
from relay_builtins import dedup
from support import ROOT, backend

from relay import cli

TOOLS = [{"name": "Bash", "description": "Run a command",
          "input_schema": {"type": "object", "properties": {"command": {"type": "string"}},
                           "required": ["command"]}}]
REUSED = "toolu_01ReusedId00000000000000"  # the emulator's --reuse-ids id for a turn's first call
BODY = {"model": "claude-test", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(autouse=True)
def away_from_the_repository(tmp_path, monkeypatch):
    """`--send` falls back to ./relay.yaml: each test says which config it means."""
    monkeypatch.chdir(tmp_path)


def post(url: str, body: dict, headers: dict | None = None) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(
        url + "/v1/messages", data=orjson.dumps(body), method="POST",
        headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def wait_for_dump(directory: Path, timeout: float = 5.0) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = sorted(directory.glob("*/*.json"))
        if files:
            [path] = files
            return path
        time.sleep(0.02)
    raise AssertionError(f"no dump under {directory}")


def replay(capsys, *args) -> tuple[int, str]:
    status = cli.main(["replay", *map(str, args)])
    out = capsys.readouterr().out
    return status, out


def tool_call(tool_id: str) -> dict:
    return {"type": "tool_use", "id": tool_id, "name": "Bash", "input": {"command": "ls"}}


def tool_result(tool_id: str) -> dict:
    return {"type": "tool_result", "tool_use_id": tool_id, "content": "ok"}


def dump_config(tmp_path: Path, url: str, pipeline=("dedup", "dump"), **backend_extra) -> dict:
    return {"pipeline": list(pipeline), "plugins": {"dump": {"dir": str(tmp_path / "dumps")}},
            "backends": [backend(url, **backend_extra)]}


# --- dedup sessions -----------------------------------------------------------------------

def test_a_dedup_session_replays_identically_until_dedup_changes(emulator, relay, tmp_path,
                                                                  capsys, monkeypatch):
    emu = emulator("--tool-turns", "5", "--reuse-ids", "--fail-status", "400", "--fail-every", "3")
    r = relay(dump_config(tmp_path, emu.url))
    messages = [{"role": "user", "content": "go"}]
    seen_ids = []
    for _ in range(3):  # two tool turns, then the emulator's injected 400
        status, _, payload = post(r.url, {**BODY, "tools": TOOLS, "messages": messages})
        if status != 200:
            break
        content = orjson.loads(payload)["content"]
        calls = [block["id"] for block in content if block["type"] == "tool_use"]
        seen_ids += calls
        messages += [{"role": "assistant", "content": content},
                     {"role": "user", "content": [tool_result(i) for i in calls]}]
    assert status == 400
    assert seen_ids == [REUSED, REUSED + "-2"]  # the session only lives thanks to dedup
    path = wait_for_dump(tmp_path / "dumps")
    recorded = orjson.loads(path.read_bytes())
    assert recorded["translation"] == {REUSED + "-2": {
        "original": REUSED, "occurrence": 2, "message_index": 3, "direction": "history"}}
    # The client's history went up as it was: the dump stores it once.
    assert recorded["upstream_request"]["body_same_as"] == "client_request"
    assert hashlib.sha256(recorded["client_request"]["body"].encode()).hexdigest() == \
        emu.requests()[-1]["body_sha256"]

    status, out = replay(capsys, path)
    assert status == 0, out
    assert "== identical to the dump" in out and REUSED + "-2" in out

    # A dedup that no longer recognises its own suffixes would build another table.
    monkeypatch.setattr(dedup, "split_suffix", lambda tool_id, sep: (tool_id, 1))
    status, out = replay(capsys, path)
    assert status == 1
    assert "--- dump: translation table\n+++ replay: translation table" in out
    assert f'-  "{REUSED}-2": {{' in out
    assert "upstream-bound body" not in out.split("== differences from the dump")[1]


def test_a_rewritten_history_replays_to_the_same_body(emulator, relay, tmp_path, capsys,
                                                      monkeypatch):
    emu = emulator("--fail-status", "400")
    r = relay(dump_config(tmp_path, emu.url))
    history = [{"role": "user", "content": "go"},
               {"role": "assistant", "content": [tool_call("toolu_dup")]},
               {"role": "user", "content": [tool_result("toolu_dup")]},
               # an older client sent the duplicate back:
               {"role": "assistant", "content": [tool_call("toolu_dup")]},
               {"role": "user", "content": [tool_result("toolu_dup")]}]
    status, _, _ = post(r.url, {**BODY, "tools": TOOLS, "messages": history})
    assert status == 400
    path = wait_for_dump(tmp_path / "dumps")
    recorded = orjson.loads(path.read_bytes())
    sent = orjson.loads(recorded["upstream_request"]["body"])
    assert sent["messages"][3]["content"][0]["id"] == "toolu_dup-2"
    assert [m["blocks"] for m in recorded["timeline"]["messages"]][3] == [
        {"type": "tool_use", "id": "toolu_dup-2"}]

    assert replay(capsys, path)[0] == 0

    import dataclasses
    monkeypatch.setattr(dedup, "OPTIONS", tuple(
        dataclasses.replace(option, default="_") if option.name == "dedup_separator" else option
        for option in dedup.OPTIONS))
    status, out = replay(capsys, path)
    assert status == 1
    assert "--- dump: upstream-bound body\n+++ replay: upstream-bound body" in out
    assert '-          "id": "toolu_dup-2",' in out
    assert '+          "id": "toolu_dup_2",' in out
    assert '+  "toolu_dup_2": {' in out


def test_the_dumped_quirks_are_used_unless_a_config_is_given(emulator, relay, tmp_path, capsys):
    emu = emulator("--fail-status", "400", "--id-style", "functions")
    r = relay(dump_config(tmp_path, emu.url, quirks={"restore_original_ids": True}))
    history = [{"role": "user", "content": "go"},
               {"role": "assistant", "content": [tool_call("functions.Bash:0")]},
               {"role": "user", "content": [tool_result("functions.Bash:0")]},
               {"role": "assistant", "content": [tool_call("functions.Bash:0-2")]},
               {"role": "user", "content": [tool_result("functions.Bash:0-2")]}]
    assert post(r.url, {**BODY, "tools": TOOLS, "messages": history})[0] == 400
    path = wait_for_dump(tmp_path / "dumps")
    assert orjson.loads(path.read_bytes())["config"]["quirks"] == {"restore_original_ids": True}

    assert replay(capsys, path)[0] == 0
    assert replay(capsys, path, "--config", r.config_path)[0] == 0

    without = tmp_path / "without-quirks.yaml"
    without.write_text(yaml.safe_dump(dump_config(tmp_path, emu.url)))
    status, out = replay(capsys, path, "--config", without)
    assert status == 1
    assert '-          "id": "functions.Bash:0",' in out
    assert '+          "id": "functions.Bash:0-2",' in out


def test_answer_direction_entries_are_not_compared(emulator, relay, tmp_path, capsys):
    # The upstream repeats the id the client already holds, in a stream that then breaks off:
    # the dump records the to_client rewrite, which a rebuild from the request cannot make.
    emu = emulator("--tool-turns", "3", "--reuse-ids", "--cut-after", "8")
    config = dump_config(tmp_path, emu.url)
    config["plugins"]["dump"]["include_stream_errors"] = True
    r = relay(config)
    history = [{"role": "user", "content": "go"},
               {"role": "assistant", "content": [tool_call(REUSED)]},
               {"role": "user", "content": [tool_result(REUSED)]}]
    status, _, payload = post(r.url, {**BODY, "tools": TOOLS, "messages": history, "stream": True})
    assert status == 200 and b"broke off" in payload and f'"{REUSED}-2"'.encode() in payload
    path = wait_for_dump(tmp_path / "dumps")
    recorded = orjson.loads(path.read_bytes())
    assert recorded["outcome"] == "stream_error"
    assert recorded["translation"] == {REUSED + "-2": {
        "original": REUSED, "occurrence": 2, "message_index": 3, "direction": "to_client"}}
    assert recorded["stream_error"]["error"]["message"].startswith("upstream emu's stream broke off")

    status, out = replay(capsys, path)
    assert status == 0, out
    assert "== identical to the dump" in out


def test_a_handmade_dump_with_answer_entries_replays_identically(tmp_path, capsys):
    translation = {"toolu_x-2": {"original": "toolu_x", "occurrence": 2, "message_index": None,
                                 "direction": "to_client"}}
    assert replay(capsys, handmade_dump(tmp_path, translation=translation))[0] == 0
    # A request-direction entry the rebuild does not make still counts.
    translation["toolu_y-2"] = {"original": "toolu_y", "occurrence": 2, "message_index": 1,
                                "direction": "history"}
    status, out = replay(capsys, handmade_dump(tmp_path, translation=translation))
    assert status == 1 and '-  "toolu_y-2": {' in out and "toolu_x-2" not in out.split(
        "== differences from the dump")[1]


def test_a_config_whose_key_variable_is_unset_rebuilds_but_does_not_send(tmp_path, capsys,
                                                                        monkeypatch):
    monkeypatch.delenv("RELAY_TEST_UNSET_KEY", raising=False)
    path = handmade_dump(tmp_path)
    config = tmp_path / "relay.yaml"
    config.write_text(yaml.safe_dump({"pipeline": ["dedup"], "backends": [
        backend("http://127.0.0.1:9", api_key_env="RELAY_TEST_UNSET_KEY")]}))
    status, out = replay(capsys, path, "--config", config)
    assert status == 0, out
    assert "== identical to the dump" in out

    status = cli.main(["replay", str(path), "--config", str(config), "--send"])
    err = capsys.readouterr().err
    assert status == 2
    assert "config error: backends[0].api_key_env: environment variable RELAY_TEST_UNSET_KEY " \
           "is not set" in err


# --- rejections and the command line -------------------------------------------------------

def test_a_relay_rejection_replays_from_the_command_line(emulator, relay, tmp_path):
    emu = emulator()
    config = dump_config(tmp_path, emu.url, models=["claude-*"])
    config["plugins"]["dump"]["include_relay_rejections"] = True
    r = relay(config)
    assert post(r.url, {**BODY, "model": "gpt-unknown"})[0] == 404
    path = wait_for_dump(tmp_path / "dumps")
    run = subprocess.run([sys.executable, "-m", "relay", "replay", str(path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "== relay error (rebuilt)" in run.stdout and "gpt-unknown" in run.stdout
    assert emu.requests() == []


# --- --send -------------------------------------------------------------------------------

def test_send_uses_the_client_key_from_the_environment(emulator, relay, tmp_path, capsys,
                                                       monkeypatch):
    emu = emulator("--fail-status", "400", "--fail-count", "1", "--api-key", "sk-client-key")
    r = relay(dump_config(tmp_path, emu.url))
    assert post(r.url, BODY, {"x-api-key": "sk-client-key"})[0] == 400
    path = wait_for_dump(tmp_path / "dumps")

    monkeypatch.setenv("RELAY_REPLAY_API_KEY", "sk-client-key")
    status, out = replay(capsys, path, "--config", r.config_path, "--send")
    assert status == 0
    assert "== answer: 200" in out and '"type":"message"' in out
    first, resent = emu.requests()
    assert resent["body_sha256"] == first["body_sha256"]
    assert dict(resent["headers"])["x-api-key"] == "sk-client-key"

    monkeypatch.delenv("RELAY_REPLAY_API_KEY")
    status, out = replay(capsys, path, "--config", r.config_path, "--send")
    assert status == 0 and "== answer: 401" in out  # sent without a key: never "[redacted]"
    assert "x-api-key" not in {name.lower() for name, _ in emu.requests()[-1]["headers"]}


def test_send_uses_the_backend_key_of_the_given_config(emulator, relay, tmp_path, capsys,
                                                       monkeypatch):
    emu = emulator("--fail-status", "400", "--fail-count", "1", "--api-key", "sk-backend-key")
    r = relay(dump_config(tmp_path, emu.url, api_key_env="EMU_KEY"),
              env={"EMU_KEY": "sk-backend-key"})
    assert post(r.url, BODY)[0] == 400
    path = wait_for_dump(tmp_path / "dumps")
    assert b"sk-backend-key" not in path.read_bytes()
    monkeypatch.setenv("EMU_KEY", "sk-backend-key")
    status, out = replay(capsys, path, "--config", r.config_path, "--send")
    assert status == 0 and "== answer: 200" in out


def test_send_to_an_unreachable_backend_is_2(tmp_path, capsys, unused_tcp_port):
    path = handmade_dump(tmp_path)
    config = tmp_path / "relay.yaml"
    config.write_text(yaml.safe_dump({"pipeline": ["dedup"], "backends": [
        backend(f"http://127.0.0.1:{unused_tcp_port}")]}))
    status = cli.main(["replay", str(path), "--config", str(config), "--send"])
    assert status == 2 and "could not reach emu" in capsys.readouterr().err


# --- unusable input -----------------------------------------------------------------------

def handmade_dump(tmp_path: Path, url: str = "http://127.0.0.1:9", **changes) -> Path:
    raw = orjson.dumps(BODY).decode()
    document = {
        "dump_format": 1, "request_id": "relay_x", "time": "2025-03-07T09:05:02.123456+00:00",
        "client_request": {"method": "POST", "path": "/v1/messages", "query": "",
                           "headers": {"content-type": "application/json"}, "body": raw},
        "upstream_request": {"url": url + "/v1/messages", "headers": {}, "body": raw},
        "translation": {}, "relay_error": None,
        "config": {"pipeline": ["dedup"], "plugins": {},
                   "backends": [{"name": "emu", "url": url, "models": ["*"],
                                 "api_key_env": "UNSET"}]},
    }
    document.update(changes)
    path = tmp_path / "dump.json"
    path.write_bytes(orjson.dumps(document))
    return path


def test_a_handmade_dump_replays(tmp_path, capsys):
    assert replay(capsys, handmade_dump(tmp_path))[0] == 0


def test_a_dump_of_a_backend_with_a_password_in_its_url_replays(tmp_path, capsys):
    # The dump holds its URL as redact_url writes it, whose "[redacted]" urlsplit reads as
    # an IPv6 host: the config was refused, in relay replay and on the console's dump page.
    url = "http://relay:[redacted]@127.0.0.1:9"
    status, out = replay(capsys, handmade_dump(tmp_path, url))
    assert status == 0, out


def test_a_recorded_body_that_differs_is_reported(tmp_path, capsys):
    other = orjson.dumps({**BODY, "max_tokens": 11}).decode()
    path = handmade_dump(tmp_path, upstream_request={"url": "u", "headers": {}, "body": other})
    status, out = replay(capsys, path)
    assert status == 1
    assert '-  "max_tokens": 11,\n+  "max_tokens": 10,' in out


@pytest.mark.parametrize("content,message", [
    (None, "cannot read"),
    (b"{not json", "not valid JSON"),
    (b"[]", "not a relay dump"),
    (b'{"client_request": {"path": "/v1/models", "body": "{}"}}', "not a Messages API endpoint"),
    (b'{"client_request": {"path": "/v1/messages", "body_base64": "%%%"}}', "not valid base64"),
    (b'{"client_request": {"path": "/v1/messages", "body": "{}"}}', "config: missing"),
])
def test_unusable_input_is_2(tmp_path, capsys, content, message):
    path = tmp_path / "dump.json"
    if content is not None:
        path.write_bytes(content)
    assert cli.main(["replay", str(path)]) == 2
    assert message in capsys.readouterr().err


def test_an_unknown_plugin_in_the_dump_is_2(tmp_path, capsys):
    config = {"pipeline": ["nosuch"], "plugins": {},
              "backends": [{"name": "emu", "url": "http://127.0.0.1:9"}]}
    path = handmade_dump(tmp_path, config=config)
    assert cli.main(["replay", str(path)]) == 2
    assert "unknown plugin 'nosuch'" in capsys.readouterr().err


# --- --send: only to the current config's backend -----------------------------------------

class Recorder:
    """A loopback HTTP server that records each request (raw target, headers, body) and gives
    one fixed answer."""

    def __init__(self, status: int = 200, headers: dict | None = None,
                 body: bytes = b'{"type": "message"}'):
        self.requests: list[dict] = []
        recorder = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                length = int(self.headers.get("content-length") or 0)
                recorder.requests.append({"target": self.path, "headers": dict(self.headers),
                                          "body": self.rfile.read(length)})
                self.send_response(status)
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def recorder():
    started = []

    def start(**kwargs) -> Recorder:
        started.append(Recorder(**kwargs))
        return started[-1]

    yield start
    for server in started:
        server.close()


def write_config(path: Path, url: str, **backend_extra) -> Path:
    path.write_text(yaml.safe_dump({"pipeline": ["dedup"],
                                    "backends": [backend(url, **backend_extra)]}))
    return path


def test_send_without_a_current_config_sends_nothing(tmp_path, capsys, recorder):
    named = recorder()
    path = handmade_dump(tmp_path, url=named.url)
    assert cli.main(["replay", str(path), "--send"]) == 2
    assert "--send needs the current configuration" in capsys.readouterr().err
    assert named.requests == []


def test_send_goes_to_the_current_configs_backend_never_the_dumps(tmp_path, capsys, recorder,
                                                                 monkeypatch):
    named, configured = recorder(), recorder()
    headers = {"content-type": "application/json", "anthropic-version": "2023-06-01",
               "x-api-key": "[redacted]", "anthropic-api-key": "[redacted]"}
    client = {"method": "POST", "path": "/v1/messages", "query": "beta=true", "headers": headers,
              "body": orjson.dumps(BODY).decode()}
    path = handmade_dump(tmp_path, url=named.url, client_request=client)
    write_config(tmp_path / "relay.yaml", configured.url + "/base/", api_key_env="REPLAY_KEY")
    monkeypatch.setenv("REPLAY_KEY", "sk-current-config-key")
    status, out = replay(capsys, path, "--send")  # ./relay.yaml: the current config
    assert status == 0, out
    assert named.requests == []
    [sent] = configured.requests
    assert sent["target"] == "/base/v1/messages?beta=true"
    assert sent["body"] == orjson.dumps(BODY)
    received = {name.lower(): value for name, value in sent["headers"].items()}
    assert received["x-api-key"] == "sk-current-config-key"
    assert received["anthropic-version"] == "2023-06-01" and "anthropic-api-key" not in received
    assert "[redacted]" not in received.values()
    target = f"== sending to {configured.url}/base/v1/messages?beta=true"
    assert target in out and out.index(target) < out.index("== answer: 200")


@pytest.mark.parametrize("client_header", ["authorization", "x-api-key"])
def test_send_to_a_pool_goes_with_one_of_its_credentials_never_the_environment_key(
        tmp_path, capsys, recorder, monkeypatch, client_header):
    # docs/cli.md: the key comes from the backend's (a pool's: one of its credentials), and
    # $RELAY_REPLAY_API_KEY only for a backend that sends the client's own.
    configured = recorder()
    client = {"method": "POST", "path": "/v1/messages", "query": "",
              "headers": {"content-type": "application/json", client_header: "[redacted]"},
              "body": orjson.dumps(BODY).decode()}
    path = handmade_dump(tmp_path, client_request=client)
    config = write_config(tmp_path / "other.yaml", configured.url,
                          credentials=[{"name": "team", "key_env": "POOL_KEY"}])
    monkeypatch.setenv("POOL_KEY", "sk-pooled-credential-key")
    monkeypatch.setenv("RELAY_REPLAY_API_KEY", "sk-client-key-from-the-environment")
    status, out = replay(capsys, path, "--config", config, "--send")
    assert status == 0, out
    [sent] = configured.requests
    received = {name.lower(): value for name, value in sent["headers"].items()}
    assert received["x-api-key"] == "sk-pooled-credential-key"
    assert "authorization" not in received
    assert "sk-client-key-from-the-environment" not in str(sent["headers"])


def test_send_never_follows_a_redirect(tmp_path, capsys, recorder):
    elsewhere = recorder()
    redirecting = recorder(status=307, headers={"Location": elsewhere.url + "/v1/messages"},
                           body=b"")
    path = handmade_dump(tmp_path)
    config = write_config(tmp_path / "other.yaml", redirecting.url)
    status, out = replay(capsys, path, "--config", config, "--send")
    assert status == 0, out
    assert len(redirecting.requests) == 1 and elsewhere.requests == []
    assert "== answer: 307" in out and "/v1/messages: not followed)" in out


@pytest.mark.parametrize("query", ["a=1#/../../admin", "q=a b\r\nX-Injected: 1", "q=%zz"])
def test_a_query_the_server_would_refuse_is_not_sent(tmp_path, capsys, recorder, query):
    configured = recorder()
    client = {"method": "POST", "path": "/v1/messages", "query": query, "headers": {},
              "body": orjson.dumps(BODY).decode()}
    path = handmade_dump(tmp_path, client_request=client)
    config = write_config(tmp_path / "other.yaml", configured.url + "/base")
    status, out = replay(capsys, path, "--config", config, "--send")
    assert status == 2 and configured.requests == []


def test_the_target_is_joined_under_the_base_path_as_serving_joins_it(tmp_path, capsys, recorder):
    configured = recorder()
    query = "beta=true&x=%2e%2e/%2e%2e/admin?y=/../z"  # dots in a query stay in the query
    client = {"method": "POST", "path": "/v1/messages", "query": query, "headers": {},
              "body": orjson.dumps(BODY).decode()}
    path = handmade_dump(tmp_path, client_request=client)
    config = write_config(tmp_path / "other.yaml", configured.url + "/a/b/")
    status, out = replay(capsys, path, "--config", config, "--send")
    assert status == 0, out
    assert configured.requests[0]["target"] == "/a/b/v1/messages?" + query


# --- hostile dumps --------------------------------------------------------------------------

def good_client(**changes) -> dict:
    return {"method": "POST", "path": "/v1/messages", "query": "",
            "headers": {"content-type": "application/json"}, "body": orjson.dumps(BODY).decode(),
            **changes}


@pytest.mark.parametrize("changes,message", [
    ({"client_request": good_client(headers=[["x-api-key", "k"]])},
     "client_request.headers: must be a mapping of name to value, not a list"),
    ({"client_request": good_client(headers={"x-a": "v\r\nX-Injected: 1"})},
     "client_request.headers.x-a: holds a line break"),
    ({"client_request": good_client(headers={"bad name": "v"})}, "is not a header name"),
    ({"client_request": good_client(headers={"x-a": {"b": 1}})},
     "must be a string or a list of strings, not a mapping"),
    ({"client_request": good_client(path=["/v1/messages"])}, "is not a Messages API endpoint"),
    ({"client_request": good_client(path="/v1/../admin")}, "is not a Messages API endpoint"),
    ({"client_request": good_client(method="GET")}, "takes POST only"),
    ({"client_request": good_client(query=7)}, "client_request.query: must be a string"),
    ({"client_request": good_client(body=12)}, "client_request.body: must be a string"),
    ({"client_request": good_client(body_base64=[1])}, "body_base64: must be a string"),
    ({"client_request": good_client(body_truncated={"kept_bytes": 5, "total_bytes": 9})},
     "client_request.body was truncated when dumped (the first 5 of 9 bytes)"),
    ({"upstream_request": ["x"]}, "upstream_request: must be a mapping, not a list"),
    ({"upstream_request": {"body_same_as": "elsewhere"}}, "body_same_as: must be"),
    ({"upstream_request": {"body": "{}", "body_truncated": True}}, "cannot be replayed"),
    ({"translation": [1, 2]}, "translation: must be a mapping, not a list"),
    ({"upstream_request": None, "relay_error": "boom"}, "relay_error: must be a mapping"),
    ({"dump_format": 99}, "dump_format: 99 is not one this relay reads"),
    ({"config": {"pipeline": ["dedup"], "backends": {"name": "x"}}}, "config.backends: must"),
    ({"config": {"pipeline": ["dedup"], "backends": [{"name": "x", "url": "http://[::1"}]}},
     "config: ValueError"),
    ({"config": {"pipeline": [["dedup"]], "backends": [{"name": "x", "url": "http://h"}]}},
     "config: pipeline[0]: must be a plugin name"),
])
def test_a_hostile_dump_is_2_with_a_message(tmp_path, capsys, changes, message):
    assert cli.main(["replay", str(handmade_dump(tmp_path, **changes))]) == 2
    err = capsys.readouterr().err
    assert message in err, err


HOSTILE_FILES = {
    "deep": b'{"client_request": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5001,
    "not utf-8": b'{"client_request": {"path": "/v1/messages", "body": "\xff\xfe"}}',
    "huge numbers": b'{"dump_format": 1e400, "client_request": {"path": "/v1/messages"}}',
    "huge integer": (b'{"dump_format": 123456789012345678901234567890, '
                     b'"client_request": {"path": "/v1/messages"}}'),
    "headers a list": orjson.dumps({"client_request": good_client(headers=[["a", "b"]])}),
}


@pytest.mark.slow
def test_hostile_files_from_the_command_line_give_2_and_no_traceback(tmp_path):
    for name, content in HOSTILE_FILES.items():
        path = tmp_path / "dump.json"
        path.write_bytes(content)
        run = subprocess.run([sys.executable, "-m", "relay", "replay", str(path)], cwd=tmp_path,
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 2, (name, run.stderr)
        assert run.stderr.startswith("relay: ") and "Traceback" not in run.stderr, name


RAW_VALUES = [b"123456789012345678901234567890", b"-1e400", b"[" * 3000 + b"1" + b"]" * 3000,
              b"[" * 600 + b"]" * 600, b'{"a":' * 300 + b"1" + b"}" * 300]


def mutations(document: dict, rng: random.Random):
    """One hostile variant of ``document``: a value somewhere replaced, a key dropped, or the
    bytes themselves damaged."""
    hostile_values = [None, True, 0, -1, 1.5, "", "\r\n", "x\r\nX-Injected: 1", "\x00",
                      "\u202e", [], {}, [["a", "b"]], {"a": {"b": []}},
                      "[redacted]", "/v1/../admin", "x" * 5000, "%2e%2e/%2fadmin"]
    text = orjson.dumps(document)
    kind = rng.randrange(10)
    if kind == 0:  # damage the bytes
        data = bytearray(text)
        for _ in range(rng.randint(1, 5)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data)
    if kind == 1:
        return text[:rng.randrange(len(text))]
    copy = orjson.loads(text)
    # Walk to a random mapping or list and change one entry.
    node = copy
    for _ in range(rng.randint(0, 4)):
        children = list(node.values()) if isinstance(node, dict) else node
        children = [c for c in children if isinstance(c, (dict, list)) and c]
        if not children:
            break
        node = rng.choice(children)
    if isinstance(node, dict) and node:
        key = rng.choice(list(node))
        if kind == 2:
            del node[key]
            return orjson.dumps(copy)
    elif isinstance(node, list) and node:
        key = rng.randrange(len(node))
    else:
        return orjson.dumps(copy)
    if kind == 3:  # what the encoder here cannot write: huge numbers, deep nesting
        marker = "\u2603raw\u2603"
        node[key] = marker
        return orjson.dumps(copy).replace(orjson.dumps(marker), rng.choice(RAW_VALUES))
    node[key] = rng.choice(hostile_values)
    return orjson.dumps(copy)


def test_a_seeded_mutator_over_a_real_dump_never_raises(emulator, relay, tmp_path, caplog):
    emu = emulator("--fail-status", "400")
    r = relay(dump_config(tmp_path, emu.url, pipeline=("dedup", "pairing", "ordering", "dump")))
    history = [{"role": "user", "content": "go"},
               {"role": "assistant", "content": [tool_call("toolu_dup")]},
               {"role": "user", "content": [tool_result("toolu_dup")]},
               {"role": "assistant", "content": [tool_call("toolu_dup")]},
               {"role": "user", "content": [tool_result("toolu_dup")]}]
    assert post(r.url, {**BODY, "tools": TOOLS, "messages": history},
                {"x-api-key": "sk-mutator-client-key-0123456789"})[0] == 400
    real = orjson.loads(wait_for_dump(tmp_path / "dumps").read_bytes())
    rng = random.Random(11)
    statuses = {0: 0, 1: 0, 2: 0}
    target = tmp_path / "variant.json"
    for i in range(300):
        target.write_bytes(mutations(real, rng))
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            status = cli.main(["replay", str(target)])
        assert status in statuses, (i, status, stderr.getvalue())
        assert "Traceback" not in stderr.getvalue(), (i, stderr.getvalue())
        statuses[status] += 1
    assert not [r for r in caplog.records if r.exc_info], caplog.text
    assert statuses[2] > 50 and statuses[0] + statuses[1] > 50, statuses


def test_control_characters_from_a_dump_never_reach_the_terminal(tmp_path, capsys):
    body = orjson.dumps({**BODY, "messages": [{"role": "user", "content": "a\x9b31mb"}]})
    client = {"method": "POST", "path": "/v1/messages", "query": "", "headers": {},
              "body": body.decode()}
    path = handmade_dump(tmp_path, request_id="\x1b]0;owned\x07", client_request=client)
    status, out = replay(capsys, path)
    assert status == 1  # the handmade upstream body is another one
    assert "\x1b" not in out and "\x07" not in out and "\x9b" not in out
    assert "\\x1b]0;owned\\x07" in out and "a\\x9b31mb" in out


def test_a_dump_from_an_openai_format_backend_replays_to_the_translated_body(
        emulator, relay, tmp_path, capsys):
    emu = emulator("--format", "openai", "--fail-status", "400")
    r = relay(dump_config(tmp_path, emu.url + "/v1", format="openai"))
    history = [{"role": "user", "content": "go"},
               {"role": "assistant", "content": [tool_call("call_0")]},
               {"role": "user", "content": [tool_result("call_0")]},
               {"role": "assistant", "content": [tool_call("call_0")]},
               {"role": "user", "content": [tool_result("call_0")]}]
    status, _, _ = post(r.url, {**BODY, "tools": TOOLS, "messages": history})
    assert status == 400
    path = wait_for_dump(tmp_path / "dumps")
    recorded = orjson.loads(path.read_bytes())
    assert recorded["backend"] is not None and recorded["upstream_request"]["url"].endswith(
        "/chat/completions")
    sent = orjson.loads(recorded["upstream_request"]["body"])
    assert [m["role"] for m in sent["messages"]][:2] == ["user", "assistant"]
    status, out = replay(capsys, path)
    assert status == 0, out
    assert "== identical to the dump" in out


def test_send_never_prints_the_backend_key_an_upstream_echoes(tmp_path, capsys, recorder,
                                                              monkeypatch):
    # What the server redacts from every answer (relay.redact), the replay's output must not
    # show either: an upstream that quotes the key it refused, in its body or a header.
    key = "sk-current-config-key-0123456789"
    echoing = recorder(status=401, headers={"Location": f"http://elsewhere/?key={key}"},
                       body=orjson.dumps({"type": "error", "error": {
                           "type": "authentication_error",
                           "message": f"invalid x-api-key: {key}"}}))
    path = handmade_dump(tmp_path)
    config = write_config(tmp_path / "other.yaml", echoing.url, api_key_env="REPLAY_KEY")
    monkeypatch.setenv("REPLAY_KEY", key)
    status, out = replay(capsys, path, "--config", config, "--send")
    assert status == 0 and "== answer: 401" in out
    assert echoing.requests[0]["headers"]["x-api-key"] == key
    assert key not in out and "invalid x-api-key: [redacted]" in out


def test_send_never_prints_a_password_in_the_backends_url(tmp_path, capsys, recorder):
    configured = recorder()
    password = "basic-auth-password-0123456789"
    path = handmade_dump(tmp_path)
    url = configured.url.replace("http://", f"http://relay:{password}@")
    config = write_config(tmp_path / "other.yaml", url)
    status, out = replay(capsys, path, "--config", config, "--send")
    assert status == 0 and "== answer: 200" in out
    assert configured.requests[0]["headers"]["Authorization"].startswith("Basic ")
    assert password not in out and "relay:[redacted]@" in out
