"""The dump plugin: one write-once, secret-free file per failed exchange, never in the way."""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import errno
import hashlib
import logging
import os
import stat
import threading
import time
from pathlib import Path

import aiohttp
import orjson
import pytest
from relay_builtins import dump
from support import backend

from relay import cli
from relay import config as config_module
from relay import document as record
from relay.chain import Chain, available_plugins, load_plugins
from relay.errors import ConfigError, RelayError
from relay.exchange import Exchange, UpstreamAnswer, UpstreamRequest
from relay.hookspecs import hookimpl
from relay.sse import Event
from relay.testing import emulator
from relay.testing.fixtures import start_relay

BODY = {"model": "claude-test", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
CLIENT_KEY = "sk-ant-client-SECRET-5f1e2d3c"
CLIENT_TOKEN = "oauth-TOKEN-SECRET-9a8b7c"
BACKEND_KEY = "sk-backend-SECRET-0a1b2c3d"


REQUIRED_KEYS = {"relay_version", "time", "request_id", "backend", "client_request",
                 "upstream_request", "upstream_response", "translation", "timeline", "config"}


def dump_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob("*/*.json")) if directory.is_dir() else []


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


async def until(condition, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting")
        await asyncio.sleep(0.01)


# --- options ------------------------------------------------------------------------------

def test_defaults(tmp_path):
    settings = dump.parse_options({"dir": str(tmp_path)})
    assert settings.statuses == frozenset(range(400, 500))
    assert not settings.include_relay_rejections and not settings.include_stream_errors
    # Retention is on, each body capped and the write queue bounded, unless said otherwise.
    assert (settings.max_files, settings.max_bytes) == (1000, 1024 ** 3)
    assert settings.max_body_bytes == 8 * 1024 ** 2
    assert (settings.max_pending, settings.max_pending_bytes) == (16, 64 * 1024 ** 2)


def test_relative_dir_is_fixed_at_start_up(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert dump.parse_options({"dir": "dumps"}).dir == str(tmp_path / "dumps")


@pytest.mark.parametrize("statuses,expected", [
    ([400, 404], {400, 404}),
    (["400-403", 429], {400, 401, 402, 403, 429}),
    ("500-502", {500, 501, 502}),
    (418, {418}),
])
def test_statuses(tmp_path, statuses, expected):
    assert dump.parse_options({"dir": str(tmp_path), "statuses": statuses}).statuses == expected


@pytest.mark.parametrize("options,message", [
    ({}, "plugins.dump.dir: required"),
    ({"dir": 3}, "plugins.dump.dir: must be a string"),
    ({"dir": " "}, "plugins.dump.dir: must be a directory path"),
    ({"dir": "d\0"}, "plugins.dump.dir: must not contain a NUL character"),
    ({"dir": "d", "statuse": [400]}, "plugins.dump.statuse: unknown option"),
    ({"dir": "d", "statuses": []}, "plugins.dump.statuses: must name at least one"),
    ({"dir": "d", "statuses": [400, "4xx"]}, "plugins.dump.statuses[1]: must be a status code"),
    ({"dir": "d", "statuses": ["499-400"]}, "plugins.dump.statuses[0]: must lie within"),
    ({"dir": "d", "statuses": [100]}, "plugins.dump.statuses[0]: must lie within"),
    ({"dir": "d", "statuses": [True]}, "plugins.dump.statuses[0]: must be a status code"),
    ({"dir": "d", "include_relay_rejections": "yes"},
     "plugins.dump.include_relay_rejections: must be true or false"),
    ({"dir": "d", "include_stream_errors": 1}, "plugins.dump.include_stream_errors: must be true"),
    ({"dir": "d", "max_files": 0}, "plugins.dump.max_files: must be a positive integer"),
    ({"dir": "d", "max_bytes": "1MB"}, "plugins.dump.max_bytes: must be an integer"),
])
async def test_bad_options(options, message):
    # Checked as at start-up: the declarations (relay.options), then what they cannot say.
    config = config_module.parse({"pipeline": ["dump"], "plugins": {"dump": options},
                                  "backends": [backend("http://127.0.0.1:9")]}, env={})
    with pytest.raises(ConfigError) as error:
        chain = Chain(load_plugins(config.pipeline), config)
        await chain.startup(config)
    assert str(error.value).startswith(message)


async def test_bad_options_stop_start_up():
    config = config_module.parse({"pipeline": ["dump"], "plugins": {"dump": {"statuses": [400]}},
                                  "backends": [backend("http://127.0.0.1:9")]}, env={})
    with pytest.raises(ConfigError, match=r"^plugins\.dump\.dir: required"):
        chain = Chain(load_plugins(config.pipeline), config)
        await chain.startup(config)


def test_dir_is_declared_required():
    # As the plugin's docstring says and start-up holds: so the options reference says
    # "(required)", and a config without it is refused with the other options' mistakes,
    # when the chain is built, not only once the plugins start.
    [option] = [option for option in dump.DECLARED if option.name == "dir"]
    assert option.required
    config = config_module.parse({"pipeline": ["dump"],
                                  "backends": [backend("http://127.0.0.1:9")]}, env={})
    with pytest.raises(ConfigError, match=r"^plugins\.dump\.dir: required$"):
        Chain(load_plugins(config.pipeline), config)


def test_bad_options_stop_the_relay(relay, tmp_path):
    with pytest.raises(RuntimeError) as error:
        relay({"pipeline": ["dump"], "plugins": {"dump": {"dir": str(tmp_path), "max_files": -1}},
               "backends": [backend("http://127.0.0.1:9")]})
    assert "plugins.dump.max_files: must be a positive integer" in str(error.value)


# --- the writer ---------------------------------------------------------------------------

WHEN = dt.datetime(2025, 3, 7, 9, 5, 2, 123456, tzinfo=dt.timezone.utc)


def test_write_once_names_modes_and_clashes(tmp_path):
    base = tmp_path / "dumps"
    first = dump.write_dump(str(base), b'{"n": 1}\n', "relay_abc", WHEN)
    second = dump.write_dump(str(base), b'{"n": 2}\n', "relay_abc", WHEN)
    third = dump.write_dump(str(base), b'{"n": 3}\n', "relay_abc", WHEN)
    day = base / "2025-03-07"
    assert [first, second, third] == [str(day / "090502.123456-relay_abc.json"),
                                      str(day / "090502.123456-relay_abc-1.json"),
                                      str(day / "090502.123456-relay_abc-2.json")]
    assert [Path(p).read_bytes() for p in (first, second, third)] == [
        b'{"n": 1}\n', b'{"n": 2}\n', b'{"n": 3}\n']
    assert sorted(os.listdir(day)) == sorted(Path(p).name for p in (first, second, third))
    assert {mode(Path(p)) for p in (first, second, third)} == {0o600}
    assert mode(base) == mode(day) == 0o700


def test_the_time_is_utc(tmp_path):
    local = WHEN.astimezone(dt.timezone(dt.timedelta(hours=-8)))  # 2025-03-07 01:05 at -08:00
    path = dump.write_dump(str(tmp_path), b"{}", "relay_x", local)
    assert Path(path).relative_to(tmp_path) == Path("2025-03-07/090502.123456-relay_x.json")


@pytest.mark.parametrize("request_id", ["../../../etc/passwd", "a/b\\c\0d", "", "x" * 500])
def test_names_cannot_leave_the_directory(tmp_path, request_id):
    path = Path(dump.write_dump(str(tmp_path / "d"), b"{}", request_id, WHEN))
    assert path.parent == tmp_path / "d" / "2025-03-07"
    assert dump.DUMP_NAME.match(path.name) and len(path.name) < 128


def test_a_file_in_the_way_is_an_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(OSError):
        dump.write_dump(str(blocker / "dumps"), b"{}", "relay_x", WHEN)
    assert blocker.read_text() == "not a directory"


def test_retention_keeps_the_newest_files(tmp_path):
    keep = dump.Retention(str(tmp_path), max_files=3, max_bytes=10 ** 9)
    old = dump.write_dump(str(tmp_path), b"x" * 10, "relay_old", WHEN - dt.timedelta(days=1))
    written = [old]
    for i in range(5):
        when = WHEN + dt.timedelta(seconds=i)
        written.append(dump.write_dump(str(tmp_path), b"x" * 10, f"relay_{i}", when))
        keep.add(written[-1], 10)
    assert [str(p) for p in dump_files(tmp_path)] == written[-3:]
    assert not (tmp_path / "2025-03-06").exists()  # the emptied day went too


def test_retention_by_bytes_counts_files_already_there(tmp_path):
    for i in range(3):
        when = WHEN + dt.timedelta(seconds=i)
        dump.write_dump(str(tmp_path), b"x" * 100, f"relay_before{i}", when)
    keep = dump.Retention(str(tmp_path), max_files=1000, max_bytes=250)
    newest = dump.write_dump(str(tmp_path), b"x" * 100, "relay_new", WHEN + dt.timedelta(seconds=9))
    deleted = keep.add(newest, 100)
    assert len(deleted) == 2
    assert [p.name for p in dump_files(tmp_path)] == ["090504.123456-relay_before2.json",
                                                      "090511.123456-relay_new.json"]
    later = WHEN + dt.timedelta(seconds=10)
    huge = dump.write_dump(str(tmp_path), b"x" * 1000, "relay_huge", later)
    keep.add(huge, 1000)
    assert [str(p) for p in dump_files(tmp_path)] == [huge]  # the newest always stays


# --- the document -------------------------------------------------------------------------

def make_exchange(raw: bytes, headers=None) -> Exchange:
    cfg = config_module.parse({"backends": [backend("http://127.0.0.1:9", name="up",
                                                     api_key_env="K", quirks={"dedup_separator": "_"})]},
                              env={"K": BACKEND_KEY})
    body = orjson.loads(raw) if raw.startswith(b"{") else None
    exchange = Exchange(endpoint="messages", method="POST", path="/v1/messages", query="beta=true",
                        headers=headers or {}, raw_body=raw, body=body, backend=cfg.backends[0])
    return exchange, cfg


def test_secrets_are_redacted_everywhere():
    history = {**BODY, "messages": [
        {"role": "user", "content": f"my key is {CLIENT_KEY} and {BACKEND_KEY}"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Bash",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"}]}]}
    raw = orjson.dumps(history)
    exchange, cfg = make_exchange(raw, {
        "X-Api-Key": CLIENT_KEY, "Authorization": f"Bearer {CLIENT_TOKEN}",
        "Cookie": "session=abc", "anthropic-version": "2023-06-01"})
    exchange.upstream_request = UpstreamRequest("http://up/v1/messages",
                                                {"x-api-key": BACKEND_KEY}, raw)
    exchange.upstream_response = UpstreamAnswer(
        400, {"Set-Cookie": "s=1", "request-id": "r"}, f'{{"echo": "{CLIENT_TOKEN}"}}'.encode())
    exchange.translation["toolu_1"] = {"original": CLIENT_KEY, "seen": f"x{BACKEND_KEY}x"}
    exchange.note("someplugin", "saw", header=f"Bearer {CLIENT_TOKEN}")
    plugin = started_dump(cfg, {"dir": "unused"})
    document = record.to_document(exchange, reason="upstream_error", when=WHEN,
                                config=plugin.config_doc, secrets=plugin.secrets)
    text = record.encode(document)
    for secret in (CLIENT_KEY, CLIENT_TOKEN, BACKEND_KEY, "session=abc"):
        assert secret.encode() not in text
    headers = document["client_request"]["headers"]
    assert headers == {"X-Api-Key": "[redacted]", "Authorization": "[redacted]",
                       "Cookie": "[redacted]", "anthropic-version": "2023-06-01"}
    assert document["upstream_response"]["headers"]["Set-Cookie"] == "[redacted]"
    assert "my key is [redacted] and [redacted]" in document["client_request"]["body"]
    assert document["translation"] == {"toolu_1": {"original": "[redacted]", "seen": "x[redacted]x"}}
    assert document["config"]["quirks"] == {"dedup_separator": "_"}
    assert document["config"]["backends"][0]["api_key_env"] == "K"
    assert document["timeline"]["messages"] == [
        {"index": 0, "role": "user", "blocks": [{"type": "text"}]},
        {"index": 1, "role": "assistant", "blocks": [{"type": "tool_use", "id": "toolu_1"}]},
        {"index": 2, "role": "user", "blocks": [{"type": "tool_result", "tool_use_id": "toolu_1"}]}]
    assert document["timeline"]["steps"][0]["step"] == "someplugin"


def test_a_body_that_is_not_utf8_is_base64_without_its_secrets():
    raw = b"\xff\xfe not utf-8 " + BACKEND_KEY.encode()
    exchange, cfg = make_exchange(raw)
    document = record.to_document(exchange, reason="rejected", when=WHEN, config={},
                                secrets={BACKEND_KEY})
    assert "body" not in document["client_request"]
    stored = base64.b64decode(document["client_request"]["body_base64"])
    assert stored == b"\xff\xfe not utf-8 [redacted]"
    assert document["timeline"]["messages"] == []


def started_dump(cfg, options: dict) -> dump.Dump:
    plugin = dump.Dump()
    plugin.relay_startup(config=cfg, options=options)
    return plugin


def keys_of(value):
    if isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from keys_of(item)
    elif isinstance(value, list):
        for item in value:
            yield from keys_of(item)


@pytest.mark.parametrize("credential", [{"x-api-key": "e"}, {"Authorization": "Bearer a"},
                                        {"Authorization": "a"}, {"Cookie": "t"}])
def test_a_short_credential_is_redacted_by_name_only(tmp_path, capsys, credential):
    history = {**BODY, "messages": [
        {"role": "user", "content": "a tale of e, a and t"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_e", "name": "Bash",
                                           "input": {"command": "date"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_e",
                                      "content": "Tue"}]}]}
    raw = orjson.dumps(history)
    exchange, cfg = make_exchange(raw, {**credential, "anthropic-version": "2023-06-01"})
    exchange.upstream_request = UpstreamRequest("http://up/v1/messages", dict(credential), raw)
    exchange.note("someplugin", "saw", detail="e a t")
    plugin = started_dump(cfg, {"dir": str(tmp_path)})
    document = record.to_document(exchange, reason="upstream_error", when=WHEN,
                                config=plugin.config_doc, secrets=plugin.secrets)
    [name] = credential
    assert document["client_request"]["headers"][name] == "[redacted]"
    assert document["upstream_request"]["headers"][name] == "[redacted]"
    assert document["client_request"]["body"].encode() == raw
    assert document["upstream_request"]["body_same_as"] == "client_request"
    assert document["timeline"]["steps"][0]["detail"] == "e a t"
    assert REQUIRED_KEYS <= set(document)
    assert not [key for key in keys_of(document) if "[redacted]" in str(key)]

    path = tmp_path / "dump.json"
    path.write_bytes(record.encode(document))
    assert cli.main(["replay", str(path)]) == 0, capsys.readouterr()


def test_only_secrets_long_enough_to_be_unambiguous_are_redacted_in_text():
    short = "k" * (record.MIN_SECRET_LENGTH - 1)
    long = "L" * record.MIN_SECRET_LENGTH
    raw = orjson.dumps({**BODY, "messages": [
        {"role": "user", "content": f"{short} / {long}"}]})
    exchange, _ = make_exchange(raw, {"x-api-key": short, "authorization": f"Bearer {long}"})
    document = record.to_document(exchange, reason="rejected", when=WHEN, config={})
    assert orjson.loads(document["client_request"]["body"])["messages"][0]["content"] == \
        f"{short} / [redacted]"
    assert document["client_request"]["headers"] == {"x-api-key": "[redacted]",
                                                     "authorization": "[redacted]"}


def test_a_secret_is_never_redacted_inside_a_key():
    exchange, _ = make_exchange(orjson.dumps(BODY))
    exchange.translation[f"id-{BACKEND_KEY}"] = {"original": BACKEND_KEY}
    document = record.to_document(exchange, reason="rejected", when=WHEN, config={},
                                secrets={BACKEND_KEY})
    assert document["translation"] == {f"id-{BACKEND_KEY}": {"original": "[redacted]"}}


def test_the_entry_point_is_the_class_and_state_lives_on_the_instance():
    assert available_plugins()["dump"].load() is dump.Dump
    assert not hasattr(dump, "_DUMPERS")
    assert not hasattr(dump, "dumper_for")


# --- in a relay (in-process) --------------------------------------------------------------

class Relay:
    def __init__(self, client, config, chain, emulator_url, directory: Path):
        self.client, self.config, self.chain = client, config, chain
        self.emulator_url = emulator_url
        self.dir = directory

    async def received(self) -> list[dict]:
        """What the emulator received, from its own request log."""
        async with aiohttp.ClientSession() as session:
            async with session.get(self.emulator_url + "/_emulator/requests") as response:
                return await response.json()

    async def post(self, body=BODY, **kwargs):
        response = await self.client.post("/v1/messages", json=body, **kwargs)
        return response, await response.read()

    async def stop(self):
        """Stop as serving does: connections drained, then relay_shutdown."""
        await self.client.close()
        await self.chain.shutdown(self.config)


@pytest.fixture
async def start(aiohttp_server, aiohttp_client, tmp_path):
    started = []

    async def make(dump_options=None, pipeline=("dump",), extra=None, **emulator_options):
        emu = emulator.create_app(emulator.EmulatorOptions(**emulator_options))
        server = await aiohttp_server(emu)
        options = {"dir": str(tmp_path / "dumps"), **(dump_options or {})}
        raw = {"pipeline": list(pipeline), "plugins": {"dump": options},
               "backends": [backend(str(server.make_url("")), models=["claude-*"])]}
        client = await start_relay(aiohttp_client, raw, extra)
        relay = Relay(client, client.config, client.chain,
                      str(server.make_url("")).rstrip("/"), Path(options["dir"]))
        started.append(relay)
        return relay

    yield make
    for relay in started:
        await relay.stop()


async def test_upstream_400_is_dumped_in_process(start):
    relay = await start(fail_status=400, fail_count=1)
    response, payload = await relay.post(headers={"x-api-key": CLIENT_KEY})
    assert response.status == 400
    ok, _ = await relay.post()
    assert ok.status == 200
    await relay.stop()
    [path] = dump_files(relay.dir)
    document = orjson.loads(path.read_bytes())
    assert document["reason"] == "upstream_error" and document["outcome"] == "upstream_error"
    assert document["request_id"] == response.headers["x-relay-request-id"]
    assert document["upstream_response"]["status"] == 400
    assert document["upstream_response"]["body"].encode() == payload
    assert document["relay_error"] is None and document["stream_error"] is None
    assert [s["action"] for s in document["timeline"]["steps"]][-2:] == ["upstream error", "queued"]
    assert [a["status"] for a in document["attempts"]] == [400]
    assert document["timings"]["upstream_headers"] is not None
    assert CLIENT_KEY.encode() not in path.read_bytes()


async def test_the_end_hooks_after_dump_know_the_dump_file(start):
    seen: dict = {}

    class Reader:
        @hookimpl
        def relay_exchange_end(self, exchange):
            seen[exchange.id] = exchange.dump_path

    # Listed first, so its end hook runs after dump's (the ledger's place).
    relay = await start(fail_status=400, fail_count=1, pipeline=("reader", "dump"),
                        extra={"reader": Reader()})
    failed, _ = await relay.post()
    ok, _ = await relay.post()
    await relay.stop()
    [path] = dump_files(relay.dir)
    assert seen[failed.headers["x-relay-request-id"]] == str(path)
    assert seen[ok.headers["x-relay-request-id"]] is None


async def test_successful_exchanges_are_dumped_when_asked(start):
    relay = await start(dump_options={"statuses": ["200-299", "400-499"]})
    response, payload = await relay.post()
    assert response.status == 200
    await relay.stop()
    [path] = dump_files(relay.dir)
    document = orjson.loads(path.read_bytes())
    assert document["reason"] == "ok" and document["outcome"] == "ok"
    assert document["upstream_response"]["status"] == 200
    assert document["upstream_response"]["body"].encode() == payload


@pytest.mark.parametrize("statuses,fail_status,dumped", [
    (None, 400, True), (None, 404, True), (None, 429, True), (None, 500, False),
    ([400, 404], 404, True), ([400, 404], 429, False), (["500-599"], 529, True),
    (["500-599"], 400, False)])
async def test_statuses_option(start, statuses, fail_status, dumped):
    relay = await start({"statuses": statuses} if statuses else {}, fail_status=fail_status)
    response, _ = await relay.post()
    assert response.status == fail_status
    await relay.stop()
    assert len(dump_files(relay.dir)) == (1 if dumped else 0)


@pytest.mark.parametrize("include", [False, True])
async def test_relay_rejections(start, include):
    relay = await start({"include_relay_rejections": include})
    response, payload = await relay.post({**BODY, "model": "gpt-unknown"})
    assert response.status == 404
    await relay.stop()
    files = dump_files(relay.dir)
    assert len(files) == (1 if include else 0)
    if include:
        document = orjson.loads(files[0].read_bytes())
        assert document["reason"] == "rejected" and document["backend"] is None
        assert document["upstream_request"] is None and document["upstream_response"] is None
        assert document["relay_error"]["status"] == 404
        assert document["relay_error"]["message"] == orjson.loads(payload)["error"]["message"]


class Refuse:
    @staticmethod
    @hookimpl
    def relay_request(exchange):
        raise RelayError(400, "refused by a plugin")


async def test_a_plugin_rejection_names_the_backend(start):
    relay = await start({"include_relay_rejections": True}, pipeline=("refuse", "dump"),
                        extra={"refuse": Refuse})
    response, _ = await relay.post()
    assert response.status == 400
    await relay.stop()
    [path] = dump_files(relay.dir)
    document = orjson.loads(path.read_bytes())
    assert document["backend"]["name"] == "emu"
    assert document["relay_error"] == {"status": 400, "type": "invalid_request_error",
                                       "message": "refused by a plugin"}
    assert document["config"]["pipeline"] == ["refuse", "dump"]
    assert await relay.received() == []


@pytest.mark.parametrize("include", [False, True])
async def test_upstream_stream_error_event(start, include):
    relay = await start({"include_stream_errors": include}, stream_error_after=2)
    response, payload = await relay.post({**BODY, "stream": True})
    assert response.status == 200 and b"event: error" in payload
    await relay.stop()
    files = dump_files(relay.dir)
    assert len(files) == (1 if include else 0)
    if include:
        document = orjson.loads(files[0].read_bytes())
        assert document["reason"] == "stream_error"
        assert document["stream_error"]["error"]["type"] == "overloaded_error"


async def test_the_relays_own_stream_error(start):
    relay = await start({"include_stream_errors": True}, cut_after=3)
    response, payload = await relay.post({**BODY, "stream": True})
    assert b"broke off" in payload
    await relay.stop()
    [path] = dump_files(relay.dir)
    document = orjson.loads(path.read_bytes())
    assert document["reason"] == document["outcome"] == "stream_error"
    assert [s["action"] for s in document["timeline"]["steps"]][-2:] == ["stream error", "queued"]
    # The error event the client got, as the upstream's own error event would be recorded.
    sent = payload.split(b"event: error\n")[1].split(b"data: ", 1)[1].split(b"\n", 1)[0]
    assert document["stream_error"] == orjson.loads(sent)
    assert document["stream_error"]["error"]["message"].startswith("upstream emu's stream broke off")


async def test_an_unwritable_dir_leaves_relaying_alone(start, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    relay = await start({"dir": str(blocker / "dumps")}, fail_status=400)
    caplog.set_level(logging.ERROR, logger="relay.plugins.dump")
    response, payload = await relay.post()
    await relay.stop()
    assert response.status == 400
    assert len(await relay.received()) == 1
    expected = orjson.dumps({"type": "error", "error": {
        "type": "invalid_request_error", "message": "Emulated invalid request"},
        "request_id": response.headers["request-id"]})
    assert payload == expected
    errors = [r for r in caplog.records if r.name == "relay.plugins.dump"]
    assert len(errors) == 1 and "could not write the upstream_error dump" in errors[0].getMessage()


async def test_the_answer_does_not_wait_for_the_disk(start, monkeypatch):
    relay = await start(fail_status=400)
    released = threading.Event()
    real = dump.write_dump

    def slow_write(*args):
        released.wait(5)
        return real(*args)
    monkeypatch.setattr(dump, "write_dump", slow_write)
    started = time.monotonic()
    response, _ = await relay.post()
    assert response.status == 400 and time.monotonic() - started < 2
    assert dump_files(relay.dir) == []
    released.set()
    await relay.stop()  # relay_shutdown waits for the pending write
    assert len(dump_files(relay.dir)) == 1


async def test_retention_in_a_relay(start):
    relay = await start({"max_files": 2}, fail_status=400)
    for _ in range(4):
        await relay.post()
    await relay.stop()
    files = dump_files(relay.dir)
    assert len(files) == 2


async def test_two_relays_in_one_process_keep_their_own_options(start, tmp_path):
    a = await start({"dir": str(tmp_path / "a")}, fail_status=400)
    b = await start({"dir": str(tmp_path / "b"), "statuses": [404]}, fail_status=400)
    await a.post()
    await b.post()
    await a.stop()
    await b.stop()
    assert len(dump_files(tmp_path / "a")) == 1 and dump_files(tmp_path / "b") == []


async def test_a_rejection_without_a_backend_stays_with_its_own_relay(start, tmp_path):
    a = await start({"dir": str(tmp_path / "a"), "include_relay_rejections": True})
    b = await start({"dir": str(tmp_path / "b")})  # started last, dumps no rejections
    response, _ = await a.post({**BODY, "model": "gpt-unknown"})
    assert response.status == 404
    await a.stop()
    await b.stop()
    assert len(dump_files(tmp_path / "a")) == 1 and dump_files(tmp_path / "b") == []


# --- through the running relay ----------------------------------------------------------

async def test_an_upstream_400_through_the_running_relay(emulator, relay, tmp_path):
    emu = emulator("--fail-status", "400", "--fail-count", "1", "--api-key", BACKEND_KEY)
    dumps = tmp_path / "dumps"
    r = relay({"pipeline": ["dump"], "plugins": {"dump": {"dir": str(dumps)}},
               "backends": [backend(emu.url, api_key_env="EMU_KEY", quirks={"dedup_separator": "_"})]},
              env={"EMU_KEY": BACKEND_KEY})
    raw = (b'{"model": "claude-test",  "max_tokens": 10,\n '
           b'"messages": [{"role": "user", "content": "h\xc3\xa9"}]}')
    headers = {"x-api-key": CLIENT_KEY, "content-type": "application/json",
               "anthropic-version": "2023-06-01", "cookie": "c=SECRETCOOKIE"}
    async with aiohttp.ClientSession() as session:
        url = r.url + "/v1/messages"
        async with session.post(url + "?beta=true", data=raw, headers=headers) as failed:
            failed_body = await failed.read()
        async with session.post(url, data=raw, headers=headers) as ok:
            assert ok.status == 200
    assert failed.status == 400
    await until(lambda: dump_files(dumps))
    r.stop()
    [path] = dump_files(dumps)
    text = path.read_bytes()
    for secret in (CLIENT_KEY, BACKEND_KEY, "SECRETCOOKIE"):
        assert secret.encode() not in text
    assert mode(path) == 0o600 and mode(path.parent) == 0o700 and mode(dumps) == 0o700

    document = orjson.loads(text)
    assert REQUIRED_KEYS <= set(document)
    request_id = failed.headers["x-relay-request-id"]
    assert document["request_id"] == request_id and path.name.endswith(f"-{request_id}.json")
    assert path.parent.name == document["time"][:10]
    assert document["backend"] == {"name": "emu", "url": emu.url}
    client = document["client_request"]
    assert (client["path"], client["query"]) == ("/v1/messages", "beta=true")
    assert client["body"].encode() == raw
    assert client["headers"]["x-api-key"] == "[redacted]"
    sent = document["upstream_request"]
    received = emu.requests()
    # Sent as received: stored once.
    assert "body" not in sent and sent["body_same_as"] == "client_request"
    assert hashlib.sha256(client["body"].encode()).hexdigest() == received[0]["body_sha256"]
    assert text.count(b'\\"messages\\"') == 1  # the body's own key, escaped in the dump
    assert sent["headers"]["x-api-key"] == "[redacted]"
    answer = document["upstream_response"]
    assert answer["status"] == 400 and answer["body"].encode() == failed_body
    assert document["translation"] == {}
    assert document["timeline"]["messages"] == [
        {"index": 0, "role": "user", "blocks": [{"type": "text"}]}]
    assert any(step["action"] == "upstream error" for step in document["timeline"]["steps"])
    assert document["config"]["pipeline"] == ["dump"]
    assert document["config"]["plugins"] == {"dump": {"dir": str(dumps)}}
    assert document["config"]["quirks"] == {"dedup_separator": "_"}


# --- safe to keep: credentials, size, queue, links, unusual JSON -------------------------

@pytest.mark.parametrize("name", [
    "x-api-key", "Authorization", "anthropic-api-key", "x-goog-api-key", "api-key",
    "x-auth-token", "X-Amz-Security-Token", "x-hub-signature-256", "x-access-token",
    "x-client-secret", "x-apikey", "proxy-authorization", "Set-Cookie", "x-password"])
def test_every_credential_header_is_redacted_by_name(name):
    assert record.headers_document({name: "v", "anthropic-version": "2023-06-01"}) == {
        name: "[redacted]", "anthropic-version": "2023-06-01"}


@pytest.mark.parametrize("name", [
    "anthropic-ratelimit-tokens-remaining", "anthropic-ratelimit-input-tokens-limit",
    "anthropic-beta", "x-claude-code-session-id", "x-stainless-retry-count", "request-id"])
def test_ordinary_headers_stay_readable(name):
    assert record.headers_document({name: "12"}) == {name: "12"}


def test_credentials_in_urls_and_queries_are_redacted():
    assert record.redact_query("beta=true&key=AIzaShort&api_key=x") == \
        "beta=true&key=[redacted]&api_key=[redacted]"
    assert record.redact_url("https://user:pa55word@host:8443/base?key=k&q=1") == \
        "https://user:[redacted]@host:8443/base?key=[redacted]&q=1"
    assert record.redact_url("http://user:pw@[::1/x") == "[redacted]"


def test_a_long_stream_error_event_is_cut_too(tmp_path):
    cfg = config_module.parse({"backends": [backend("http://127.0.0.1:9")]}, env={})
    plugin = started_dump(cfg, {"dir": str(tmp_path), "max_body_bytes": 64,
                                "include_stream_errors": True})
    exchange, _ = make_exchange(orjson.dumps(BODY))
    event = Event.build("error", {"type": "error", "error": {"type": "api_error",
                                                             "message": "m" * 1000}})
    plugin.relay_stream_event(exchange=exchange, event=event)
    recorded = exchange.state["dump"]["stream_error"]
    assert recorded["event"] == event.raw[:64].decode()
    assert recorded["event_truncated"]["total_bytes"] == len(event.raw)


PLANTED = {  # header: value; each must be gone from the dump, short or long
    "anthropic-api-key": "planted-anthropic-key-1f2e3d4c",
    "x-goog-api-key": "AIzaPlantedGoogleKey-77aa",
    "x-auth-token": "tok-9z",  # too short to search for: redacted by name only
    "api-key": "planted-azure-key-0099887766",
}


async def test_planted_secrets_never_appear_in_a_dump(start):
    relay = await start(fail_status=400)
    body = {**BODY, "messages": [{"role": "user", "content":
                                  f"echo {PLANTED['anthropic-api-key']} and "
                                  f"{PLANTED['x-goog-api-key']} and {CLIENT_KEY}"}]}
    response = await relay.client.post(
        "/v1/messages?beta=true&key=planted-query-key-5566778899", json=body,
        headers={**PLANTED, "x-api-key": CLIENT_KEY})
    assert response.status == 400
    await relay.stop()
    [path] = dump_files(relay.dir)
    text = path.read_bytes()
    for secret in [*PLANTED.values(), CLIENT_KEY, "planted-query-key-5566778899"]:
        assert secret.encode() not in text, secret
    document = orjson.loads(text)
    headers = document["client_request"]["headers"]
    assert {headers[name] for name in PLANTED} == {"[redacted]"}
    assert document["client_request"]["query"] == "beta=true&key=[redacted]"


def test_an_identical_body_is_stored_once_even_when_a_copy():
    raw = orjson.dumps(BODY)
    exchange, _ = make_exchange(raw)
    exchange.upstream_request = UpstreamRequest("http://up/v1/messages", {},
                                                bytes(bytearray(raw)))
    document = record.to_document(exchange, reason="upstream_error", when=WHEN, config={})
    assert document["upstream_request"] == {"url": "http://up/v1/messages", "headers": {},
                                            "body_same_as": "client_request"}
    exchange.upstream_request.body = raw.replace(b"hi", b"ho")
    document = record.to_document(exchange, reason="upstream_error", when=WHEN, config={})
    assert document["upstream_request"]["body"].encode() == raw.replace(b"hi", b"ho")


def test_a_long_body_keeps_a_prefix_and_the_hash_of_the_whole():
    # The secret straddles the cut: replaced before cutting, none of it is kept.
    head = '{"model":"claude-test","max_tokens":10,"messages":[{"role":"user","content":"'
    filler = "é" * ((990 - len(head)) // 2)
    raw = (head + filler + BACKEND_KEY + "x" * 4000 + '"}]}').encode()
    cut = raw.index(BACKEND_KEY.encode()) + 10
    exchange, _ = make_exchange(raw)
    document = record.to_document(exchange, reason="rejected", when=WHEN, config={},
                                secrets={BACKEND_KEY}, max_body_bytes=cut)
    client = document["client_request"]
    assert client["body_truncated"] == {
        "kept_bytes": len(client["body"].encode()), "total_bytes": len(raw),
        "sha256": hashlib.sha256(raw).hexdigest(), "limit": "plugins.dump.max_body_bytes"}
    assert len(client["body"].encode()) <= cut
    assert client["body"].startswith(head + filler + "[redacted]")
    assert BACKEND_KEY[:10] not in record.encode(document).decode()

    # A cut inside a two-byte character keeps the whole characters before it.
    document = record.to_document(exchange, reason="rejected", when=WHEN, config={},
                                max_body_bytes=len(head) + 3)
    assert document["client_request"]["body"] == head + "é"
    assert document["client_request"]["body_truncated"]["kept_bytes"] == len(head) + 2


def test_a_long_body_that_is_not_utf8_keeps_a_base64_prefix():
    raw = b"\xff\xfe" + b"z" * 100
    exchange, _ = make_exchange(raw)
    document = record.to_document(exchange, reason="rejected", when=WHEN, config={},
                                max_body_bytes=10)
    client = document["client_request"]
    assert base64.b64decode(client["body_base64"]) == raw[:10]
    assert client["body_truncated"]["total_bytes"] == 102


async def test_a_large_failing_request_is_dumped_within_the_cap(start):
    relay = await start({"max_body_bytes": 4096}, fail_status=400)
    big = orjson.dumps({**BODY, "messages": [{"role": "user", "content": "y" * 200_000}]})
    response = await relay.client.post("/v1/messages", data=big,
                                       headers={"content-type": "application/json"})
    assert response.status == 400
    await relay.stop()
    [path] = dump_files(relay.dir)
    assert path.stat().st_size < 3 * 4096 + 8192
    document = orjson.loads(path.read_bytes())
    assert document["client_request"]["body_truncated"]["total_bytes"] == len(big)
    assert document["upstream_request"]["body_same_as"] == "client_request"


def test_retention_is_on_by_default(tmp_path):
    cfg = config_module.parse({"backends": [backend("http://127.0.0.1:9")]}, env={})
    plugin = started_dump(cfg, {"dir": str(tmp_path)})
    assert (plugin.retention.max_files, plugin.retention.max_bytes) == (1000, 1024 ** 3)


def blocked_writes(monkeypatch) -> threading.Event:
    """Make every dump write wait until the returned event is set."""
    released = threading.Event()
    real = dump.write_dump

    def slow_write(*args):
        released.wait(10)
        return real(*args)
    monkeypatch.setattr(dump, "write_dump", slow_write)
    return released


async def test_a_full_write_queue_drops_and_counts(start, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="relay.plugins.dump")
    relay = await start({"max_pending": 2}, fail_status=400)
    plugin = relay.chain.pm.get_plugin("dump")
    released = blocked_writes(monkeypatch)
    for _ in range(5):
        response, _ = await relay.post()
        assert response.status == 400
    assert len(plugin.pending) == 2 and plugin.dropped == 3
    released.set()
    await relay.stop()
    assert len(dump_files(relay.dir)) == 2
    messages = [r.getMessage() for r in caplog.records if r.name == "relay.plugins.dump"]
    assert len([m for m in messages if "dump dropped: the write queue is full" in m]) == 1
    assert "3 dump(s) dropped while the write queue was full (3 since start-up)" in messages


async def test_the_write_queue_is_bounded_by_bytes_too(start, monkeypatch):
    relay = await start({"max_pending_bytes": 1000}, fail_status=400)
    plugin = relay.chain.pm.get_plugin("dump")
    released = blocked_writes(monkeypatch)
    for _ in range(3):
        await relay.post()  # ~100 bytes in, ~150 back: the first is taken, whatever its size
    large = {**BODY, "messages": [{"role": "user", "content": "z" * 2000}]}
    await relay.post(large)
    assert len(plugin.pending) == 3 and plugin.dropped == 1
    released.set()
    await relay.stop()
    assert len(dump_files(relay.dir)) == 3


def test_a_planted_day_link_receives_nothing(tmp_path, caplog):
    base, elsewhere = tmp_path / "dumps", tmp_path / "elsewhere"
    base.mkdir(mode=0o700)
    elsewhere.mkdir()
    (base / "2025-03-07").symlink_to(elsewhere)
    with pytest.raises(OSError, match="2025-03-07 is a symbolic link; dumps never follow one"):
        dump.write_dump(str(base), b"{}", "relay_x", WHEN)
    assert list(elsewhere.iterdir()) == []
    # In the plugin: logged, nothing written anywhere.
    cfg = config_module.parse({"backends": [backend("http://127.0.0.1:9")]}, env={})
    plugin = started_dump(cfg, {"dir": str(base)})
    exchange, _ = make_exchange(orjson.dumps(BODY))
    caplog.set_level(logging.ERROR, logger="relay.plugins.dump")
    assert plugin.write(exchange, "rejected", WHEN) is None
    assert "is a symbolic link" in caplog.text
    assert list(elsewhere.iterdir()) == []


def test_a_planted_file_link_is_never_written_through(tmp_path):
    base = tmp_path / "dumps"
    day = base / "2025-03-07"
    day.mkdir(parents=True)
    target = tmp_path / "target"
    target.write_text("keep me")
    (day / "090502.123456-relay_x.json").symlink_to(target)
    path = dump.write_dump(str(base), b'{"n": 1}', "relay_x", WHEN)
    assert path == str(day / "090502.123456-relay_x-1.json")
    assert target.read_text() == "keep me"


def test_retention_never_follows_a_planted_link(tmp_path):
    base, elsewhere = tmp_path / "dumps", tmp_path / "elsewhere"
    elsewhere.mkdir()
    victim = elsewhere / "000000.000000-relay_old.json"
    victim.write_text("keep me")
    dump.write_dump(str(base), b"x", "relay_a", WHEN)
    (base / "2025-03-01").symlink_to(elsewhere)  # sorts before every real day
    (base / "2025-03-07" / "000000.000000-relay_link.json").symlink_to(victim)
    keep = dump.Retention(str(base), max_files=1, max_bytes=10 ** 9)
    newest = dump.write_dump(str(base), b"y", "relay_b", WHEN + dt.timedelta(seconds=1))
    assert keep.add(newest, 1) == [str(base / "2025-03-07" / "090502.123456-relay_a.json")]
    assert victim.read_text() == "keep me"
    assert (base / "2025-03-07" / "000000.000000-relay_link.json").is_symlink()


def deeply_nested(depth: int):
    value = []
    for _ in range(depth - 1):
        value = [value]
    return value


def test_unusual_records_are_still_dumped():
    exchange, _ = make_exchange(orjson.dumps(BODY))
    exchange.translation["toolu_1"] = {"original": "toolu_1", "occurrence": 2 ** 70}
    exchange.note("someplugin", "saw", deep=deeply_nested(5000))
    document = record.to_document(exchange, reason="rejected", when=WHEN, config={})
    decoded = orjson.loads(record.encode(document))
    assert decoded["translation"]["toolu_1"]["occurrence"] == str(2 ** 70)
    deep, levels = decoded["timeline"]["steps"][0]["deep"], 0
    while isinstance(deep, list):
        [deep] = deep
        levels += 1
    assert deep == record.TOO_DEEP and 90 < levels < record.MAX_DEPTH


@pytest.mark.parametrize("tool_id,recorded", [
    (b"123456789012345678901234567890", b'"123456789012345678901234567890"'),
    (b"[" * 1000 + b"]" * 1000, record.TOO_DEEP.encode())])
async def test_unusual_but_valid_json_is_dumped_as_sent_and_replays(start, tmp_path, capsys,
                                                                    tool_id, recorded):
    relay = await start(fail_status=400)
    raw = (b'{"model": "claude-test", "max_tokens": 10, "messages": ['
           b'{"role": "user", "content": "go"}, {"role": "assistant", "content": ['
           b'{"type": "tool_use", "id": ' + tool_id + b', "name": "Bash", "input": {}}]}]}')
    response = await relay.client.post("/v1/messages", data=raw,
                                       headers={"content-type": "application/json"})
    assert response.status == 400
    await relay.stop()
    [path] = dump_files(relay.dir)
    document = orjson.loads(path.read_bytes())
    assert document["client_request"]["body"].encode() == raw
    assert recorded in orjson.dumps(document["timeline"]["messages"][1]["blocks"][0]["id"])
    status = await asyncio.to_thread(cli.main, ["replay", str(path)])
    assert status == 0, capsys.readouterr()


# --- a full disk, and what writers that died left -------------------------------------------

def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def temporary_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*/.*.tmp")) if directory.is_dir() else []


@pytest.mark.parametrize("failing", ["write", "fsync", "link"])
def test_a_failed_write_leaves_no_temporary_file(tmp_path, monkeypatch, failing):
    monkeypatch.setattr(os, failing, no_space)
    for i in range(20):
        with pytest.raises(OSError) as raised:
            dump.write_dump(str(tmp_path), b"x" * 100, f"relay_{i}", WHEN)
        assert raised.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert temporary_files(tmp_path) == [] and dump_files(tmp_path) == []
    assert (tmp_path / "2025-03-07").is_dir()  # the day directory was made: files were tried


async def test_writes_failing_on_a_full_disk_leave_nothing_behind(start, monkeypatch, caplog):
    real_write = os.write

    def full_for_dumps(fd, data):  # the writer thread's writes only; the loop's go on
        if threading.current_thread().name.startswith("relay-dump"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)
    relay = await start({"max_pending": 100}, fail_status=400)
    monkeypatch.setattr(os, "write", full_for_dumps)
    caplog.set_level(logging.ERROR, logger="relay.plugins.dump")
    for _ in range(20):
        response, _ = await relay.post()
        assert response.status == 400
    await relay.stop()
    monkeypatch.undo()
    # Said once, not once a dump: the next message (a minute on) counts the rest.
    failures = [r for r in caplog.records if "No space left on device" in r.getMessage()]
    assert len(failures) == 1
    assert temporary_files(relay.dir) == [] and dump_files(relay.dir) == []


def test_a_repeated_write_failure_is_logged_again_a_minute_on_with_its_count(monkeypatch,
                                                                              caplog):
    plugin, clock = dump.Dump(), [1000.0]
    monkeypatch.setattr(dump.time, "monotonic", lambda: clock[0])
    caplog.set_level(logging.ERROR, logger="relay.plugins.dump")
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    for _ in range(5):
        plugin.write_failed("relay_x", "rejected", "/d", full)
    plugin.write_failed("relay_x", "rejected", "/d", OSError(errno.EROFS, "read-only"))
    clock[0] += dump.WARN_EVERY
    plugin.write_failed("relay_x", "rejected", "/d", full)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3
    assert "read-only" in messages[1]
    assert messages[2].endswith("(4 more dumps failed alike since the last such message)")


def plant_temporary(directory: Path, day: str, name: str, age: float, size: int = 10) -> Path:
    (directory / day).mkdir(parents=True, exist_ok=True)
    path = directory / day / name
    path.write_bytes(b"x" * size)
    when = time.time() - age
    os.utime(path, (when, when))
    return path


def test_retention_deletes_stale_temporary_files_and_counts_fresh_ones(tmp_path, caplog):
    for i in range(2):
        dump.write_dump(str(tmp_path), b"x" * 10, f"relay_{i}", WHEN + dt.timedelta(seconds=i))
    stale = plant_temporary(tmp_path, "2025-03-07", ".090503.123456-relay_dead.0123456789ab.tmp",
                            age=dump.STALE_SECONDS + 60)
    fresh = plant_temporary(tmp_path, "2025-03-07", ".090510.123456-relay_busy.ba9876543210.tmp",
                            age=1, size=30)
    other = plant_temporary(tmp_path, "2025-03-07", ".not-ours.tmp", age=10 ** 6)
    keep = dump.Retention(str(tmp_path), max_files=3, max_bytes=10 ** 9)
    caplog.set_level(logging.WARNING, logger="relay.plugins.dump")
    keep.prepare()
    assert not stale.exists() and keep.stale == 1
    assert "deleted 1 temporary file(s)" in caplog.text
    assert fresh.exists() and other.exists()  # young, or not a name the writer makes
    assert len(keep.entries) == 3 and keep.total == 50  # the fresh one counts
    newest = dump.write_dump(str(tmp_path), b"x" * 10, "relay_new", WHEN + dt.timedelta(seconds=9))
    deleted = keep.add(newest, 10)
    assert [os.path.basename(p) for p in deleted] == [fresh.name]  # oldest name of its day
    assert len(dump_files(tmp_path)) == 3


def test_retention_at_start_up_of_a_directory_not_made_yet(tmp_path):
    keep = dump.Retention(str(tmp_path / "not-yet"), max_files=3, max_bytes=10 ** 9)
    keep.prepare()
    assert list(keep.entries) == [] and not (tmp_path / "not-yet").exists()


async def test_a_relay_cleans_what_dead_writers_left_at_start_up(start, tmp_path):
    directory = tmp_path / "dumps"
    stale = plant_temporary(directory, "2025-03-07", ".090503.123456-relay_dead.0123456789ab.tmp",
                            age=dump.STALE_SECONDS + 60)
    for i in range(3):
        dump.write_dump(str(directory), b"x" * 10, f"relay_{i}", WHEN + dt.timedelta(seconds=i))
    await start({"max_files": 2})  # no request: start-up alone
    deadline = time.monotonic() + 5
    while (stale.exists() or len(dump_files(directory)) > 2) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert not stale.exists()
    assert [p.name for p in dump_files(directory)] == ["090503.123456-relay_1.json",
                                                       "090504.123456-relay_2.json"]
