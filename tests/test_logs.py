"""Log lines: text and JSON, the access line's fields, and values from clients that try to
forge a line or flood one."""

from __future__ import annotations

import logging
import urllib.error
import urllib.request

import orjson
import pytest
from support import Relay, backend, exchange_for, request, text, user

from relay import logs

SECRET = "sk-ant-api03-planted-secret-0123456789abcdef"
BACKEND_SECRET = "sk-backend-planted-secret-abcdef0123456789"
BASH = {"name": "Bash", "description": "Run a shell command.",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}
FORGED = "INFO relay.access: relay_000000000000000000000000 messages model=forged status=200"


def post(url: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(
        url + "/v1/messages", method="POST", data=orjson.dumps(body),
        headers={"content-type": "application/json", "x-api-key": SECRET, **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()
            return response.status, dict(response.headers)
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers)


def body(model: str, **extra) -> dict:
    return {"model": model, "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}],
            **extra}


def start(tmp_path, url: str, log_format: str, **backend_extra) -> Relay:
    return Relay({"server": {"access_log": True, "log_format": log_format},
                  "pipeline": ["dedup", "pairing", "ordering"],
                  "backends": [backend(url, **backend_extra)]},
                 tmp_path, env={"BACKEND_KEY": BACKEND_SECRET})


def access_line(relay: Relay, request_id: str) -> str:
    assert relay.wait_for_output(request_id, timeout=5)
    (line,) = [line for line in relay.output().splitlines() if request_id in line]
    return line


# --- the pure parts -----------------------------------------------------------------------


@pytest.mark.parametrize("value, expected", [
    ("claude-opus-4", "claude-opus-4"),
    ("", '""'),
    ("two words", '"two words"'),
    ('a"b', '"a\\"b"'),
    ("a=b", '"a=b"'),
    ("back\\slash", '"back\\\\slash"'),
    ("line\nbreak", '"line\\nbreak"'),
    ("cr\rlf", '"cr\\rlf"'),
    ("nul\x00esc\x1b", '"nul\\x00esc\\x1b"'),
    ("next\x85line\u2028sep", '"next\\x85line\\u2028sep"'),
    (True, "true"),
    (12.5, "12.5"),
])
def test_a_logfmt_value_stays_one_token_on_one_line(value, expected):
    assert logs.logfmt_value(value) == expected


def test_a_long_value_is_capped_and_says_how_long_it_was():
    assert logs.logfmt_value("m" * 5000) == '"' + "m" * 200 + '...[5000 chars]"'
    assert logs.cap("x" * 200) == "x" * 200


def test_any_text_record_stays_on_one_line_and_a_traceback_is_indented():
    formatter = logs.TextFormatter(logs.TEXT_FORMAT)
    record = logging.LogRecord("relay", logging.WARNING, __file__, 1,
                               "upstream said %s", ("bad\nINFO forged",), None)
    assert formatter.format(record).count("\n") == 0
    try:
        raise ValueError("boom\nINFO relay: forged")
    except ValueError:
        import sys
        record = logging.LogRecord("relay", logging.ERROR, __file__, 1, "failed", (),
                                   sys.exc_info())
    lines = formatter.format(record).split("\n")
    assert lines[0].endswith("ERROR relay: failed")
    assert all(line.startswith("  ") for line in lines[1:])


def test_a_json_record_is_one_line_even_with_a_lone_surrogate():
    record = logging.LogRecord("relay", logging.INFO, __file__, 1, "%s", ("a\ud800b\nc",), None)
    line = logs.JSONFormatter().format(record)
    assert "\n" not in line
    assert orjson.loads(line)["message"] == "a\\ud800b\nc"


def test_the_access_fields_of_an_exchange():
    exchange = exchange_for(request(user(text("hi")), model="claude-x\n" + "y" * 300,
                                    stream=True))
    exchange.outcome, exchange.repairs = "ok", 2
    exchange.translation = {"a-2": {"direction": "to_client"}, "b-2": {"direction": "to_client"},
                            "c": {"direction": "to_upstream"}, "d": {"direction": "history"}}
    exchange.key_name = "team-a"
    exchange.timings.first_byte = 0.25
    fields = logs.access_fields(exchange, 200)
    assert fields["model"] == "claude-x\n" + "y" * 191 + "...[309 chars]"
    assert fields["ids_rewritten"] == 2 and fields["repairs"] == 2
    assert fields["key"] == "team-a" and fields["ttfb_ms"] == 250.0
    assert fields["status"] == 200 and fields["stream"] is True and fields["backend"] == "test"
    line = logs.access_line(fields)
    assert line.startswith(f"{exchange.id} messages model=\"claude-x\\n")
    assert "\n" not in line and " key=team-a" in line and " ttfb_ms=250.0" in line


def test_a_field_that_does_not_apply_is_left_out():
    exchange = exchange_for(request(user(text("hi"))))
    exchange.backend = None
    fields = logs.access_fields(exchange, None)
    assert not {"backend", "status", "outcome", "ttfb_ms", "key"} & set(fields)


# --- a real relay ---------------------------------------------------------------------------


def test_a_newline_in_model_cannot_forge_a_text_access_line(tmp_path, emulator):
    emu = emulator()
    relay = start(tmp_path, emu.url, "text")
    try:
        status, headers = post(relay.url, body("claude-x\n" + FORGED))
        assert status == 200
        line = access_line(relay, headers["x-relay-request-id"])
        assert 'model="claude-x\\n' + FORGED.replace('"', '\\"') + '"' in line
        assert not any(line.startswith("INFO relay.access") for line in relay.output().splitlines())
    finally:
        relay.stop()


def test_a_flooding_model_name_is_capped(tmp_path, emulator):
    emu = emulator()
    relay = start(tmp_path, emu.url, "json")
    try:
        status, headers = post(relay.url, body("claude-" + "x" * 5000))
        assert status == 400  # longer than any model name: refused, and logged capped
        record = orjson.loads(access_line(relay, headers["x-relay-request-id"]))
        assert record["model"] == "claude-" + "x" * 193 + "...[5007 chars]"
    finally:
        relay.stop()


def test_json_access_line_has_every_field_and_no_secret(tmp_path, emulator):
    emu = emulator("--tool-turns", "1", "--reuse-ids")
    relay = start(tmp_path, emu.url, "json", api_key_env="BACKEND_KEY")
    try:
        status, headers = post(relay.url, body("claude-x\nforged", stream=True),
                               headers={"authorization": "Bearer " + SECRET})
        assert status == 200
        record = orjson.loads(access_line(relay, headers["x-relay-request-id"]))
        assert record["message"] == "exchange" and record["logger"] == "relay.access"
        assert {k: record[k] for k in ("endpoint", "method", "path", "model", "backend",
                                       "status", "outcome", "stream", "ids_rewritten",
                                       "repairs", "request_id")} == {
            "endpoint": "messages", "method": "POST", "path": "/v1/messages",
            "model": "claude-x\nforged", "backend": "emu", "status": 200, "outcome": "ok",
            "stream": True, "ids_rewritten": 0, "repairs": 0,
            "request_id": headers["x-relay-request-id"]}
        assert 0 <= record["ttfb_ms"] <= record["duration_ms"]
        assert record["events"] >= 6  # message_start to message_stop, a block between
        assert "key" not in record  # no inbound auth: no key name
        output = relay.output()
        for line in output.splitlines():
            orjson.loads(line)  # every line, the listening one too, is a JSON object
        assert SECRET not in output and BACKEND_SECRET not in output
        assert "planted" not in output
    finally:
        relay.stop()


def test_ids_rewritten_counts_the_ids_the_client_got_rewritten(tmp_path, emulator):
    emu = emulator("--tool-turns", "3", "--reuse-ids")
    relay = start(tmp_path, emu.url, "json")
    try:
        reused = "toolu_01ReusedId00000000000000"
        history = [{"role": "user", "content": "go"},
                   {"role": "assistant", "content": [{"type": "tool_use", "id": reused,
                                                      "name": "Bash", "input": {}}]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": reused,
                                                 "content": "ok"}]}]
        status, headers = post(relay.url, {"model": "claude-x", "max_tokens": 10,
                                           "messages": history, "stream": True,
                                           "tools": [BASH]})
        assert status == 200
        record = orjson.loads(access_line(relay, headers["x-relay-request-id"]))
        assert record["ids_rewritten"] == 1
    finally:
        relay.stop()


@pytest.mark.slow
def test_a_warning_in_json_is_one_object_per_line(tmp_path):
    relay = start(tmp_path, "http://127.0.0.1:9", "json")  # nothing listens on port 9
    try:
        status, headers = post(relay.url, body("claude-x"))
        assert status == 502
        assert relay.wait_for_output("is unreachable", timeout=5)
        assert relay.wait_for_output('"relay.access"', timeout=5)  # written after the answer
        records = [orjson.loads(line) for line in relay.output().splitlines()]
        warning = next(r for r in records if r["level"] == "WARNING")
        assert warning["logger"] == "relay" and headers["x-relay-request-id"] in warning["message"]
        assert next(r for r in records if r["logger"] == "relay.access")["status"] == 502
    finally:
        relay.stop()


def test_with_workers_each_text_line_names_its_process(tmp_path, emulator):
    emu = emulator()
    relay = Relay({"server": {"access_log": True}, "backends": [backend(emu.url)]}, tmp_path,
                  args=["--workers", "2"])
    try:
        status, headers = post(relay.url, body("claude-x"))
        assert status == 200
        line = access_line(relay, headers["x-relay-request-id"])
        pid = int(line.split("relay.access[", 1)[1].split("]", 1)[0])
        assert pid != relay.pid and pid in worker_pids(relay.pid)
    finally:
        relay.stop()


def worker_pids(parent: int) -> list[int]:
    with open(f"/proc/{parent}/task/{parent}/children") as f:
        return [int(pid) for pid in f.read().split()]
