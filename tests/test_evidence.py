"""The evidence table (docs/evidence/rules.json) and the recorded real exchanges (tests/fixtures/
recorded), played through everything that judges a history: the emulator, `relay validate`,
and a running relay in reject, repair and off modes in front of the emulator. They must agree
with the table, and so with each other.
"""

from __future__ import annotations

import hashlib
import json
import urllib.error
import urllib.request

import orjson
import pytest
from relay_builtins import pairing
from support import ROOT, backend

from relay import cli
from relay.testing.emulator import EmulatorOptions, find_problem

RULES = json.loads((ROOT / "docs" / "evidence" / "rules.json").read_text())["rules"]
RECORDED = sorted((ROOT / "tests" / "fixtures" / "recorded").glob("*.json"))
MODES = ("reject", "repair", "off")
# Rules whose refusal the relay can repair honestly (the others stay refused in repair mode).
REPAIRED = {rule["id"] for rule in RULES if rule["verdict"] == "refuse" and rule["plugin"] in
            ("pairing", "ordering") and rule.get("repair") and "dedup" not in rule["repair"]}
# Repeated ids: the dedup plugin, first in the pipeline, renames them in every mode.
DEDUPED = {rule["id"] for rule in RULES if "dedup" in (rule.get("repair") or "")}


def body(messages) -> dict:
    return {"model": "claude-test", "max_tokens": 64, "messages": json.loads(json.dumps(messages))}


def examples(kind: str) -> list:
    found = []
    for rule in RULES:
        if rule.get(kind):
            found.append(pytest.param(rule, rule[kind]["messages"], id=rule["id"]))
        if kind == "accepted":
            found += [pytest.param(rule, m, id=f"{rule['id']}-{n}")
                      for n, m in enumerate(rule.get("also_accepted", ()))]
    return found


def post(url: str, raw: bytes) -> tuple[int, dict, dict]:
    request = urllib.request.Request(url + "/v1/messages", data=raw, method="POST", headers={
        "content-type": "application/json", "x-api-key": "test", "anthropic-version": "2023-06-01"})
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            return response.status, {k.lower(): v for k, v in response.headers.items()}, \
                json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, {k.lower(): v for k, v in error.headers.items()}, json.loads(error.read())


def validate(tmp_path, capsys, document, *args) -> tuple[int, str, str]:
    path = tmp_path / "request.json"
    path.write_bytes(orjson.dumps(document))
    code = cli.main(["validate", *args, str(path)])
    out, err = capsys.readouterr()
    return code, out, err


# --- the table itself -------------------------------------------------------------------------


def test_every_rule_says_what_it_rests_on():
    for rule in RULES:
        assert rule["id"] and rule["sources"] and rule["wording"], rule["id"]
        assert rule["verdict"] in ("refuse", "accept", "note"), rule["id"]
        assert rule["accepted"], rule["id"]
        if rule["verdict"] == "refuse":
            assert rule["error"] and rule["location"] and rule["refused"]["error"], rule["id"]
            assert rule["refused"]["error"].startswith("messages."), rule["id"]
        elif rule["verdict"] == "note":
            assert rule["uncertain"] and not rule["refused"], rule["id"]
    assert len({rule["id"] for rule in RULES}) == len(RULES)


# --- the emulator and `relay validate`, in process --------------------------------------------


@pytest.mark.parametrize("rule, messages", examples("refused"))
def test_refused_examples_get_the_apis_words_from_emulator_and_validate(rule, messages, tmp_path, capsys):
    expected = rule["refused"]["error"]
    assert find_problem(body(messages), EmulatorOptions()) == expected
    code, out, _ = validate(tmp_path, capsys, body(messages))
    assert code == 1 and out.splitlines()[0] == expected
    code, out, _ = validate(tmp_path, capsys, messages)  # a bare messages array too
    assert code == 1 and out.splitlines()[0] == expected


@pytest.mark.parametrize("rule, messages", examples("accepted"))
def test_accepted_examples_pass_emulator_and_validate(rule, messages, tmp_path, capsys):
    assert find_problem(body(messages), EmulatorOptions()) is None
    code, out, err = validate(tmp_path, capsys, body(messages))
    assert (code, err) == (0, "") and out.endswith(": no tool-use faults found "
                                                   f"({len(messages)} messages)\n")


@pytest.mark.parametrize("rule, messages", examples("uncertain"))
def test_uncertain_examples_are_accepted_with_a_note(rule, messages, tmp_path, capsys):
    assert find_problem(body(messages), EmulatorOptions()) is None
    code, out, err = validate(tmp_path, capsys, body(messages))
    assert code == 0 and "no tool-use faults found" in out
    assert err.startswith("note: ") and "(forwarded as it is)" in err


@pytest.mark.parametrize("fixture", RECORDED, ids=lambda p: p.stem)
def test_recorded_exchanges_get_the_same_verdict_from_emulator_and_validate(fixture, tmp_path, capsys):
    recorded = json.loads(fixture.read_text())
    assert recorded["source"] and recorded["status"] in (200, 400)
    expected = recorded["error"]["error"]["message"] if recorded["error"] else None
    assert find_problem(recorded["request"], EmulatorOptions()) == expected
    code, out, _ = validate(tmp_path, capsys, recorded["request"])
    if expected is None:
        assert code == 0, out
    else:
        assert code == 1 and out.splitlines()[0] == expected


# --- a running relay in each mode, in front of the emulator -----------------------------------


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The emulator, and a relay in each built-in mode in front of it (module-wide: the
    examples are many and each server takes a second to start)."""
    from support import Emulator, Relay
    started = []
    try:
        emu = Emulator(["emulate", "--port", "0"])
        started.append(emu)
        relays = {}
        for mode in MODES:
            directory = tmp_path_factory.mktemp(mode)
            relays[mode] = Relay({"pipeline": ["dedup", "pairing", "ordering"],
                                  "plugins": {"pairing": {"pairing_mode": mode},
                                              "ordering": {"ordering_mode": mode}},
                                  "backends": [backend(emu.url)]}, directory)
            started.append(relays[mode])
        yield emu, relays
    finally:
        for server in started:
            server.stop()


def sent_one(emu) -> dict | None:
    received = emu.requests()
    emu.clear()
    assert len(received) <= 1
    return received[0] if received else None


@pytest.mark.slow
@pytest.mark.parametrize("rule, messages", examples("refused"))
@pytest.mark.parametrize("mode", MODES)
def test_refused_examples_through_the_relay(servers, rule, messages, mode):
    emu, relays = servers
    emu.clear()
    expected = rule["refused"]["error"]
    status, headers, answer = post(relays[mode].url, orjson.dumps(body(messages)))
    upstream = sent_one(emu)
    if rule["id"] in DEDUPED:
        assert status == 200, answer
        assert find_problem(upstream["body"], EmulatorOptions()) is None
        assert upstream["body"]["messages"][3]["content"][0]["id"] == "toolu_a-2"
    elif mode == "off":
        # The relay steps aside; the emulator, standing for the API, refuses in the same words.
        assert (status, answer["error"]["message"]) == (400, expected)
        assert upstream is not None
    elif mode == "repair" and rule["id"] in REPAIRED:
        assert status == 200, answer
        assert int(headers["x-relay-repairs"]) >= 1
        assert find_problem(upstream["body"], EmulatorOptions()) is None
    else:
        assert (status, answer["error"]["message"]) == (400, expected)
        assert upstream is None  # refused before the upstream saw a byte


@pytest.mark.slow
@pytest.mark.parametrize("rule, messages", examples("accepted") + examples("uncertain"))
@pytest.mark.parametrize("mode", MODES)
def test_accepted_and_uncertain_examples_go_up_unchanged(servers, rule, messages, mode):
    emu, relays = servers
    emu.clear()
    # Spacing no serializer of ours would produce: a re-serialisation would show.
    raw = json.dumps(body(messages), indent=1).encode()
    status, headers, answer = post(relays[mode].url, raw)
    assert status == 200, answer
    upstream = sent_one(emu)
    spans = pairing.split_tool_turns(body(messages)["messages"])
    if mode == "off" or not spans:
        assert "x-relay-repairs" not in headers
        assert upstream["body_sha256"] == hashlib.sha256(raw).hexdigest()
    else:
        # A tool turn split over consecutive messages is merged for backends that pair message
        # by message: lossless, counted, and the API reads the two forms alike.
        merged = body(messages)["messages"]
        pairing.merge(merged, spans)
        assert headers["x-relay-repairs"] == str(sum(last - first for first, last in spans))
        assert upstream["body"]["messages"] == merged


@pytest.mark.slow
@pytest.mark.parametrize("fixture", RECORDED, ids=lambda p: p.stem)
@pytest.mark.parametrize("mode", MODES)
def test_recorded_exchanges_through_the_relay(servers, fixture, mode):
    emu, relays = servers
    emu.clear()
    recorded = json.loads(fixture.read_text())
    raw = orjson.dumps(recorded["request"])
    status, _, answer = post(relays[mode].url, raw) if not recorded["request"].get("stream") \
        else post_streamed(relays[mode].url, raw)
    upstream = sent_one(emu)
    if recorded["status"] == 200:
        assert status == 200, answer
        assert upstream["body_sha256"] == hashlib.sha256(raw).hexdigest()
    elif mode == "repair":
        assert status == 200  # the text moved before the call, as the accepted recording has it
        content = upstream["body"]["messages"][0]["content"]
        assert [b["type"] for b in content] == ["text", "tool_use"]
    else:
        assert (status, answer["error"]) == (400, {"type": "invalid_request_error",
                                                   "message": recorded["error"]["error"]["message"]})
        assert (upstream is None) == (mode == "reject")


def post_streamed(url: str, raw: bytes) -> tuple[int, dict, dict]:
    """A streamed request: the status, and the error body when there is one."""
    request = urllib.request.Request(url + "/v1/messages", data=raw, method="POST", headers={
        "content-type": "application/json", "x-api-key": "test", "anthropic-version": "2023-06-01"})
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            events = response.read().decode()
            assert "event: message_stop" in events
            return response.status, {}, {}
    except urllib.error.HTTPError as error:
        return error.code, {}, json.loads(error.read())


def test_the_emulator_keeps_its_own_copy_of_the_rules():
    # A shared mistake would pass every test: the emulator imports nothing from the relay or
    # its plugins, and does not read the evidence table either.
    import ast
    source = (ROOT / "relay" / "testing" / "emulator.py").read_text()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add("." if node.level else node.module.split(".")[0])
    assert not imported & {".", "relay", "plugins", "relay_builtins"}, imported
    assert "open(" not in source and "read_text" not in source
