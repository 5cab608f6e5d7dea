"""Broken histories through the running relay (pipeline [pairing, ordering]) to the emulator:
refused with the API's wording before the upstream sees a byte, or repaired into a history the
strict emulator accepts."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import urllib.error
import urllib.request

import orjson
import pytest
import yaml
from support import ROOT, assistant, backend, result, text, use, user

pytestmark = pytest.mark.slow  # the relay and `relay validate` as processes

PIPELINE = ["pairing", "ordering"]


def body_of(*messages):
    return {"model": "claude-test", "max_tokens": 64, "messages": [user(text("Look up DEMO-42.")), *messages]}


def post(url: str, path: str, raw: bytes) -> tuple[int, dict, dict]:
    request = urllib.request.Request(url + path, data=raw, method="POST", headers={
        "content-type": "application/json", "x-api-key": "test", "anthropic-version": "2023-06-01"})
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), json.loads(error.read())


def missing(index, *ids):
    return (f"messages.{index}: `tool_use` ids were found without `tool_result` blocks immediately "
            f"after: {', '.join(ids)}. Each `tool_use` block must have a corresponding `tool_result` "
            f"block in the next message.")




BROKEN = {
    "seed: result with the wrong id": (
        body_of(assistant(use("toolu_demo_a")), user(result("toolu_wrong_id"))),
        "messages.2.content.0: unexpected `tool_use_id` found in `tool_result` blocks: toolu_wrong_id. "
        "Each `tool_result` block must have a corresponding `tool_use` block in the previous message."),
    "text before the results": (
        body_of(assistant(use("toolu_a")), user(text("first"), result("toolu_a"))),
        missing(2, "toolu_a")),
    "results split by text": (
        body_of(assistant(use("toolu_a"), use("toolu_b")),
                user(result("toolu_a"), text("between"), result("toolu_b"))),
        missing(2, "toolu_b")),
    "missing result among parallel calls": (
        body_of(assistant(use("toolu_a"), use("toolu_b")), user(result("toolu_b"), text("go on"))),
        missing(2, "toolu_a")),
    "text after the call": (
        body_of(assistant(use("toolu_a"), text("I will check.")), user(result("toolu_a"))),
        missing(2, "toolu_a")),
    "system entry between calls and results": (
        body_of(assistant(use("toolu_a")), {"role": "system", "content": "r"}, user(result("toolu_a"))),
        "messages.2: role 'system' must precede an 'assistant' message or end the array"),
    "duplicate result": (
        body_of(assistant(use("toolu_a")), user(result("toolu_a"), result("toolu_a"))),
        "messages.2.content.1: each tool_use must have a single result. Found multiple "
        "`tool_result` blocks with id: toolu_a"),
    "result in an assistant message": (
        body_of(assistant(use("toolu_a"), result("toolu_a")), user(result("toolu_a"))),
        "messages.1: `tool_result` blocks can only be in `user` messages"),
}


def test_broken_histories_are_refused_before_the_upstream(emulator, relay):
    emu = emulator()
    r = relay({"pipeline": PIPELINE, "backends": [backend(emu.url)]})
    for name, (body, message) in BROKEN.items():
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            sent = dict(body)
            if path.endswith("count_tokens"):
                sent.pop("max_tokens")
            status, _, answer = post(r.url, path, orjson.dumps(sent))
            assert status == 400, (name, path, answer)
            assert answer["type"] == "error", name
            assert answer["error"] == {"type": "invalid_request_error", "message": message}, (name, path)
    assert emu.requests() == []


def test_valid_history_reaches_the_upstream_byte_for_byte(emulator, relay):
    emu = emulator()
    r = relay({"pipeline": PIPELINE, "backends": [backend(emu.url)]})
    # Spacing no serializer of ours would produce: any re-serialisation would show.
    raw = json.dumps(body_of(
        {"role": "system", "content": "a Claude Code reminder"},
        assistant(text("calling"), use("toolu_demo_a")),
        user(result("toolu_demo_a"), text("Explain this status briefly.")),
        {"role": "system", "content": "another, at the end"},
    ), indent=1).encode()
    status, headers, answer = post(r.url, "/v1/messages", raw)
    assert status == 200, answer
    assert "x-relay-repairs" not in {k.lower() for k in headers}
    received = emu.requests()
    assert len(received) == 1
    assert received[0]["body_sha256"] == hashlib.sha256(raw).hexdigest()


def test_repair_mode_sends_a_history_the_upstream_accepts(emulator, relay):
    emu = emulator()
    r = relay({"pipeline": PIPELINE,
               "plugins": {"pairing": {"pairing_mode": "repair"}, "ordering": {"ordering_mode": "repair"}},
               "backends": [backend(emu.url)]})
    body = body_of(assistant(use("toolu_a"), use("toolu_b")),
                   user(text("first"), result("toolu_b")),
                   assistant(use("toolu_c")), assistant(text("moving on")), user(text("and now?")))
    status, headers, answer = post(r.url, "/v1/messages", orjson.dumps(body))
    assert status == 200, answer
    # 2 results added, 2 turns put in order (the split assistant turn merged as it is).
    assert {k.lower(): v for k, v in headers.items()}["x-relay-repairs"] == "4"
    received = emu.requests()
    assert len(received) == 1
    messages = received[0]["body"]["messages"]
    assert [b["type"] for b in messages[2]["content"]] == ["tool_result", "tool_result", "text"]
    assert messages[2]["content"][0]["tool_use_id"] == "toolu_a"
    assert messages[2]["content"][0]["is_error"] is True
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant", "user"]
    assert [b["type"] for b in messages[3]["content"]] == ["text", "tool_use"]
    assert messages[4]["content"][0]["tool_use_id"] == "toolu_c"


@pytest.mark.parametrize("name", ["seed: result with the wrong id", "duplicate result",
                                  "system entry between calls and results"])
def test_repair_mode_still_refuses_what_it_must_not_guess(emulator, relay, name):
    emu = emulator()
    r = relay({"pipeline": PIPELINE,
               "plugins": {"pairing": {"pairing_mode": "repair"}, "ordering": {"ordering_mode": "repair"}},
               "backends": [backend(emu.url)]})
    body, message = BROKEN[name]
    status, _, answer = post(r.url, "/v1/messages", orjson.dumps(body))
    assert (status, answer["error"]["message"]) == (400, message)
    assert emu.requests() == []


# --- `relay validate` on the command line -----------------------------------------------------

DUPLICATE = body_of(assistant(use("toolu_a")), user(result("toolu_a")),
                    assistant(use("toolu_a")), user(result("toolu_a")))
DUPLICATE_MESSAGE = "messages.3.content.0: `tool_use` ids must be unique"


def validate(tmp_path, document, *args) -> subprocess.CompletedProcess:
    path = tmp_path / "request.json"
    path.write_bytes(orjson.dumps(document))
    # From the temporary directory: the shipped relay.yaml's relative dump dir stays there.
    return subprocess.run([sys.executable, "-m", "relay", "validate", *map(str, args), str(path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)


def test_validate_with_the_shipped_pipeline_prints_a_duplicate_id_once(tmp_path):
    run = validate(tmp_path, DUPLICATE, "--config", ROOT / "relay.yaml")
    assert run.returncode == 1, run.stderr
    assert run.stdout.splitlines() == [DUPLICATE_MESSAGE]
    assert not (tmp_path / "dumps").exists()

    run = validate(tmp_path, DUPLICATE, "--config", ROOT / "relay.yaml", "--json")
    assert run.returncode == 1, run.stderr
    assert json.loads(run.stdout) == {"valid": False, "checked": "tool-use faults", "problems": [
        {"location": "messages.3.content.0", "message": DUPLICATE_MESSAGE}], "notes": []}


def test_validate_with_the_shipped_pipeline_names_every_location(tmp_path):
    broken = body_of(assistant(use("toolu_a"), use("toolu_b")),
                     user(text("first"), result("toolu_b")),
                     assistant(use("toolu_a")), user(result("toolu_a"), result("toolu_a")))
    run = validate(tmp_path, broken, "--config", ROOT / "relay.yaml", "--json")
    assert run.returncode == 1, run.stderr
    problems = json.loads(run.stdout)["problems"]
    assert len(problems) == len({(p["location"], p["message"]) for p in problems}) >= 3
    for problem in problems:
        assert problem["message"].startswith(problem["location"] + ": "), problem
    run = validate(tmp_path, broken, "--config", ROOT / "relay.yaml")
    lines = run.stdout.splitlines()
    assert lines == [p["message"] for p in problems]

    run = validate(tmp_path, body_of(assistant(use("toolu_a")), user(result("toolu_a"))),
                   "--config", ROOT / "relay.yaml")
    assert run.returncode == 0, run.stderr
    assert run.stdout.endswith(": no tool-use faults found (3 messages)\n")


def test_validate_repair_by_default_makes_duplicate_ids_unique(tmp_path):
    run = validate(tmp_path, DUPLICATE)
    assert run.returncode == 1 and run.stdout.splitlines() == [DUPLICATE_MESSAGE]
    run = validate(tmp_path, DUPLICATE, "--repair")
    assert run.returncode == 0, run.stdout + run.stderr
    repaired = json.loads(run.stdout)
    assert repaired["messages"][3]["content"][0]["id"] == "toolu_a-2"
    assert repaired["messages"][4]["content"][0]["tool_use_id"] == "toolu_a-2"
    assert "1 repair(s) made" in run.stderr


@pytest.mark.parametrize("config,message", [
    ({"pipeline": ["pairing"], "plugins": {"pairing": {"pairing_mode": "bogus"}}},
     "config error: plugins.pairing.pairing_mode: must be one of reject, repair, off"),
    ({"pipeline": ["dedup", "dump"], "plugins": {"dump": {"statuses": [400]}}},
     "config error: plugins.dump.dir: required"),
    ({"pipeline": ["ordering"],
      "backends": [{"name": "x", "url": "http://127.0.0.1:9", "quirks": {"ordering_mode": 3}}]},
     "config error: backends[0].quirks.ordering_mode: must be one of"),
])
def test_validate_reports_bad_plugin_options_as_config_errors(tmp_path, config, message):
    config.setdefault("backends", [{"name": "x", "url": "http://127.0.0.1:9"}])
    path = tmp_path / "relay.yaml"
    path.write_text(yaml.safe_dump(config))
    run = validate(tmp_path, DUPLICATE, "--config", path)
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.startswith("relay: " + message), run.stderr
    assert run.stdout == ""


def test_problems_from_every_plugin_come_in_message_order(tmp_path):
    broken = body_of(assistant(use("toolu_a")), user(text("first"), result("toolu_a")),
                     assistant(use("toolu_b")), user(result("toolu_x")))
    run = validate(tmp_path, broken)
    assert run.returncode == 1
    assert run.stdout.splitlines() == [
        missing(2, "toolu_a"),  # ordering's
        "messages.4.content.0: unexpected `tool_use_id` found in `tool_result` blocks: toolu_x. "
        "Each `tool_result` block must have a corresponding `tool_use` block in the previous message.",
        missing(4, "toolu_b")]  # pairing's


def test_validate_notes_what_it_is_unsure_of(tmp_path):
    run = validate(tmp_path, body_of(assistant(text("calling"), use("toolu_a"))))
    assert run.returncode == 0, run.stderr
    assert run.stderr.startswith("note: messages.1: the history ends with tool calls")
    run = validate(tmp_path, body_of(assistant(text("calling"), use("toolu_a"))), "--json")
    assert [n["plugin"] for n in json.loads(run.stdout)["notes"]] == ["pairing"]


def test_repair_never_invents_a_failure_for_a_result_in_the_next_message(tmp_path):
    split = body_of(assistant(use("toolu_a"), use("toolu_b")), user(result("toolu_a")),
                    user(result("toolu_b"), text("go on")))
    assert validate(tmp_path, split).returncode == 0
    run = validate(tmp_path, split, "--repair")
    assert run.returncode == 0, run.stderr
    repaired = json.loads(run.stdout)["messages"]
    # Merged into one turn, losslessly: no is_error placeholder anywhere.
    assert repaired[2]["content"] == [result("toolu_a"), result("toolu_b"), text("go on")]
    assert "is_error" not in run.stdout


def test_repair_writes_every_number_as_it_was_written(tmp_path):
    raw = (b'{"model":"m","max_tokens":1E+2,"temperature":0.70,"messages":[{"role":"user","content":'
           b'[{"type":"text","text":"go"}]},{"role":"assistant","content":[{"type":"tool_use","id":'
           b'"toolu_a","name":"x","input":{"n":123456789012345678901234567890,"f":1E+2,"z":-0.0}}]},'
           b'{"role":"user","content":[{"type":"text","text":"\\u00e9 caf\xc3\xa9"}]}]}')
    path = tmp_path / "request.json"
    path.write_bytes(raw)
    run = subprocess.run([sys.executable, "-m", "relay", "validate", "--repair", str(path)],
                         capture_output=True, timeout=60, check=False)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    for literal in (b'"max_tokens":1E+2', b'"temperature":0.70', b"123456789012345678901234567890",
                    b'"f":1E+2', b'"z":-0.0', b'\\u00e9 caf\xc3\xa9'):
        assert literal in out, literal
    assert b'"is_error":true' in out  # the one repair: the call had no result
    bare = tmp_path / "bare.json"
    bare.write_bytes(b'[{"role":"user","content":[{"type":"text","text":"x","n":1.50}]}]')
    run = subprocess.run([sys.executable, "-m", "relay", "validate", "--repair", str(bare)],
                         capture_output=True, timeout=60, check=False)
    assert run.returncode == 0 and run.stdout.strip() == bare.read_bytes(), run.stderr


@pytest.mark.parametrize("raw, message", [
    (b"[" * 100000 + b"]" * 100000, "is not valid JSON"),
    (b'{"messages":' + b"[" * 3000 + b"]" * 3000 + b"}", "is not valid JSON"),
    (b'{"messages": 5}', "expected a request body with a messages list"),
    (b'"just a string"', "expected a request body with a messages list"),
    (b'{"messages": [1, 2', "is not valid JSON"),
])
def test_hostile_files_get_a_message_not_a_traceback(tmp_path, raw, message):
    path = tmp_path / "request.json"
    path.write_bytes(raw)
    for extra in ([], ["--repair"], ["--json"]):
        run = subprocess.run([sys.executable, "-m", "relay", "validate", *extra, str(path)],
                             capture_output=True, text=True, timeout=60, check=False)
        assert run.returncode == 2 and message in run.stderr, run.stderr
        assert "Traceback" not in run.stderr


@pytest.mark.parametrize("messages, message", [
    ([1, "x"], "messages.0: expected an object"),
    ([{"role": 5, "content": "x"}], "messages.0.role: expected a string"),
    ([{"role": "user", "content": "x"}, {"role": "user", "content": {}}],
     "messages.1.content: expected a string or a list of blocks"),
    ([{"role": "user"}], "messages.0.content: expected a string or a list of blocks"),
    ([{"role": "user", "content": [None]}], "messages.0.content.0: expected an object"),
    ([{"role": "user", "content": [{"type": 7}]}], "messages.0.content.0.type: expected a string"),
])
def test_wrong_types_inside_messages_get_a_message_not_a_traceback(tmp_path, messages, message):
    for document in ({"messages": messages}, messages):
        for extra in ([], ["--repair"], ["--json"]):
            run = validate(tmp_path, document, *extra)
            assert run.returncode == 2, run.stdout + run.stderr
            assert run.stderr == f"relay: {tmp_path / 'request.json'}: {message}\n"


def test_odd_values_where_the_checks_look_are_reported_never_a_traceback(tmp_path):
    odd = {"messages": [{"role": "user", "content": [{"type": "text", "text": "go"}]},
                        {"role": "assistant", "content": [{"type": "tool_use", "id": {"a": 1}},
                                                          {"type": "tool_use", "id": None}]},
                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": [1]}]}]}
    for extra in ([], ["--repair"], ["--json"]):
        run = validate(tmp_path, odd, *extra)
        assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
        assert "unexpected `tool_use_id` found in `tool_result` blocks: [1]" in run.stdout + run.stderr
