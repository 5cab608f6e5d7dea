"""The exchange record: its closed set of outcomes, its typed parts, and its one document form."""

from __future__ import annotations

import ast
import asyncio
import datetime as dt
import json
import time
from pathlib import Path

import orjson
import pytest
from relay_builtins import dump
from support import ROOT
from test_openai_hostile import FORMATS, events_of, exchange_of, relay_to, small_limits  # noqa: F401
from test_replay import handmade_dump

from relay import document as record
from relay import replay
from relay.errors import RelayError
from relay.exchange import Attempt, Outcome, StreamFailure, UpstreamAnswer, UpstreamRequest
from relay.testing import finished_exchange, request, text, user

WHEN = dt.datetime(2025, 3, 7, 9, 5, 2, 123456, tzinfo=dt.timezone.utc)
# What dashboards and log greps have seen: the values must not change.
KNOWN = {"ok", "rejected", "refused", "upstream_error", "upstream_malformed", "stream_error",
         "upstream_unreachable", "pool_full", "client_disconnected", "relay_error"}


# --- the outcome ----------------------------------------------------------------------------

def test_an_outcome_is_the_value_users_know():
    assert {outcome.value for outcome in Outcome} == KNOWN
    for outcome in Outcome:
        assert outcome == outcome.value and str(outcome) == outcome.value
        assert f"{outcome}" == outcome.value and f"{outcome:>3}" == f"{outcome.value:>3}"
        assert orjson.dumps(outcome) == json.dumps(outcome).encode() == \
            f'"{outcome.value}"'.encode()


def _not_a_member(value: ast.expr) -> bool:
    if isinstance(value, ast.IfExp):
        return _not_a_member(value.body) or _not_a_member(value.orelse)
    if isinstance(value, ast.Constant):
        return value.value is not None
    if isinstance(value, ast.Attribute):
        return not (isinstance(value.value, ast.Name) and value.value.id == "Outcome"
                    and value.attr in Outcome.__members__)
    return not (isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
                and value.func.id == "Outcome")


def outcome_assignments(source: str, name: str = "<source>") -> list[str]:
    """Each assignment to an ``outcome`` attribute (or outcome given to ``refuse``, which
    assigns it) whose value is not an Outcome member (or ``Outcome(...)``, or None), as
    ``file:line``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        call = node.value if isinstance(node, ast.Await) else None
        if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "refuse":
            # relay.respond's refuse(request, exchange, error, outcome, close=...) sets it
            given = call.args[3:4] + [k.value for k in call.keywords if k.arg == "outcome"]
            if any(_not_a_member(value) for value in given):
                found.append(f"{name}:{node.lineno}")
            continue
        if isinstance(node, ast.Assign):
            pairs = []
            for target in node.targets:
                if isinstance(target, ast.Tuple):
                    values = node.value.elts if isinstance(node.value, ast.Tuple) else None
                    for i, element in enumerate(target.elts):
                        pairs.append((element, values[i] if values else None))
                else:
                    pairs.append((target, node.value))
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and node.value is not None:
            pairs = [(node.target, node.value)]
        else:
            continue
        for target, value in pairs:
            if isinstance(target, ast.Attribute) and target.attr == "outcome" and (
                    value is None or _not_a_member(value)):
                found.append(f"{name}:{node.lineno}")
    return found


def test_every_outcome_assigned_is_a_member():
    sources = sorted([*(ROOT / "relay").rglob("*.py"), *(ROOT / "plugins").rglob("*.py")])
    assert len(sources) > 20
    wrong = [place for path in sources
             for place in outcome_assignments(path.read_text(), str(path.relative_to(ROOT)))]
    assert wrong == []


@pytest.mark.parametrize("source", [
    'exchange.outcome = "ok"',
    'exchange.outcome, exchange.error = "rejected", error',
    'exchange.outcome = Outcome.OK if ok else "relay_error"',
    'exchange.outcome, message = translator.fault',
    "exchange.outcome = Outcome.NOT_ONE",
    "exchange.outcome = kind",
    'await refuse(request, exchange, error, "upstream_malformed")',
    'await refuse(request, exchange, error, outcome="rejected", close=True)',
])
def test_the_check_finds_an_outcome_that_is_no_member(source):
    assert outcome_assignments(source) == ["<source>:1"]


def test_the_check_passes_the_members():
    assert outcome_assignments("\n".join([
        "exchange.outcome = Outcome.OK", "exchange.outcome = None",
        "exchange.outcome, exchange.error = Outcome.REJECTED, error",
        "exchange.outcome = Outcome.POOL_FULL if full else Outcome.UPSTREAM_UNREACHABLE",
        "exchange.outcome = Outcome(fault)",
        "await refuse(request, exchange, error, Outcome.REFUSED, close=True)",
        "await refuse(request, exchange, error)"])) == []


# --- the typed parts ------------------------------------------------------------------------

def test_a_stream_failure_is_a_field_and_the_timeline_says_it_as_before():
    exchange = finished_exchange(stream=True, outcome=Outcome.STREAM_ERROR)
    exchange.stream_failed("upstream up's stream broke off", detail="ClientPayloadError x")
    exchange.stream_failed("the relay failed", "overloaded_error")
    assert exchange.stream_failure == StreamFailure("the relay failed", "overloaded_error")
    first, second = exchange.timeline[-2:]
    assert {key: first[key] for key in first if key != "t"} == {
        "step": "relay", "action": "stream error", "message": "upstream up's stream broke off",
        "detail": "ClientPayloadError x"}
    assert set(second) == {"t", "step", "action", "message"}


def test_what_a_rule_is_unsure_of_and_what_it_repaired_are_fields():
    exchange = finished_exchange()
    exchange.unsure("pairing", "messages.1", "a system entry comes first")
    exchange.repaired("dedup", 2, rule="repeated_id")
    exchange.repaired("pairing", 1)
    assert [(u.step, u.location, u.reason) for u in exchange.uncertain] == [
        ("pairing", "messages.1", "a system entry comes first")]
    assert [(r.step, r.rule, r.count) for r in exchange.repaired_by] == [
        ("dedup", "repeated_id", 2), ("pairing", "pairing", 1)]
    assert [(e["step"], e["action"]) for e in exchange.timeline] == [
        ("pairing", "unsure"), ("dedup", "repaired"), ("pairing", "repaired")]
    assert exchange.timeline[0]["location"] == "messages.1" and exchange.repairs == 3


@pytest.mark.parametrize("wire", FORMATS)
async def test_a_stream_cut_by_the_relay_records_what_the_client_was_told(relay_to, small_limits,
                                                                          wire):
    client = await relay_to(wire)
    response = await asyncio.wait_for(client.post(
        "/v1/messages", json={"max_tokens": 10, "model": "endless-line", "stream": True,
                              "messages": [{"role": "user", "content": "hi"}]}), 30)
    told = events_of(await asyncio.wait_for(response.read(), 30))[-1]["error"]
    exchange = await exchange_of(client)
    assert exchange.outcome is Outcome.STREAM_ERROR
    assert exchange.stream_failure is not None
    assert (exchange.stream_failure.message, exchange.stream_failure.kind) == (
        told["message"], told["type"])


# --- the kit --------------------------------------------------------------------------------

def test_the_kit_builds_a_finished_exchange():
    exchange = finished_exchange(request(user(text("hello"))), status=529,
                                 outcome="upstream_error",
                                 timeline=[("relay", "upstream error", {"status": 529})])
    assert exchange.outcome is Outcome.UPSTREAM_ERROR
    assert exchange.answer.status == exchange.upstream_response.status == 529
    assert orjson.loads(exchange.upstream_request.body)["messages"][0]["content"][0]["text"] \
        == "hello"
    assert [a.status for a in exchange.attempts] == [529]
    assert exchange.timeline[0]["status"] == 529 and exchange.timings.first_byte is not None

    refused = finished_exchange(error=RelayError(400, "no"), outcome=Outcome.REJECTED)
    assert refused.upstream_request is None and refused.attempts == []
    assert refused.answer.status == 400


# --- the document ---------------------------------------------------------------------------

def test_the_format_version_lives_in_one_place():
    assert record.FORMAT in record.READS
    assert not hasattr(dump, "FORMAT") and not hasattr(replay, "FORMATS")
    for path in [*(ROOT / "relay").rglob("*.py"), *(ROOT / "plugins").rglob("*.py")]:
        if path.name != "document.py":
            assert '"dump_format"' not in path.read_text(), path


def test_a_document_reads_back_as_the_record_it_was_made_from():
    exchange = finished_exchange(
        status=400, headers={"x-api-key": "sk-ant-" + "k" * 40, "anthropic-version": "2023-06-01"},
        outcome=Outcome.UPSTREAM_ERROR, timeline=[("relay", "upstream error", {"status": 400})],
        attempts=[Attempt("test", "http://127.0.0.1:9/v1/messages", status=529),
                  Attempt("test", "http://127.0.0.1:9/v1/messages", status=400)])
    exchange.translation["toolu_a-2"] = {"original": "toolu_a", "direction": "to_upstream"}
    raw = record.encode(record.to_document(exchange, reason="upstream_error", when=WHEN,
                                           config={}))
    document = record.load(raw)
    assert document["dump_format"] == record.FORMAT and document["outcome"] == "upstream_error"
    back = record.from_document(document)
    assert (back.id, back.endpoint, back.method, back.path, back.query, back.raw_body) == (
        exchange.id, exchange.endpoint, exchange.method, exchange.path, exchange.query,
        exchange.raw_body)
    assert back.outcome is Outcome.UPSTREAM_ERROR
    assert dict(back.client_headers) == {"x-api-key": "[redacted]",
                                         "anthropic-version": "2023-06-01"}
    assert back.upstream_request == UpstreamRequest(
        exchange.upstream_request.url, {"content-type": "application/json"}, exchange.raw_body)
    assert back.upstream_response == UpstreamAnswer(
        400, {"content-type": "application/json"}, exchange.upstream_response.body)
    assert back.translation == exchange.translation
    assert back.timeline == exchange.timeline
    assert back.error is None


def test_a_refusal_reads_back_with_its_error():
    exchange = finished_exchange(error=RelayError(400, "messages.1: no"), outcome="rejected")
    back = record.from_document(record.load(record.encode(record.to_document(
        exchange, reason="rejected", when=WHEN, config={}))))
    assert back.upstream_request is None and back.upstream_response is None
    error = back.error
    assert (error.status, error.type, error.message) == (400, "invalid_request_error",
                                                         "messages.1: no")


def test_an_old_dump_reads_as_it_did(tmp_path):
    """Format 1 (the replay tests' hand-made dump) and one with no ``dump_format`` key."""
    back = record.from_document(record.load(handmade_dump(tmp_path).read_bytes()))
    assert orjson.loads(back.raw_body) == orjson.loads(back.upstream_request.body)
    assert back.id == "relay_x" and back.outcome is None and back.translation == {}
    old = orjson.dumps({"client_request": {"path": "/v1/messages", "body": "{}"}})
    assert record.from_document(record.load(old)).raw_body == b"{}"


def test_serving_builds_no_document():
    """The document is made when a dump or a replay asks, never on the request path."""
    for name in ("server.py", "upstream.py", "stream.py", "exchange.py"):
        path = ROOT / "relay" / name
        if path.exists():
            assert "document" not in {
                alias.name.rpartition(".")[2] for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}, name
    assert Path(record.__file__).name == "document.py"


def test_a_fallback_takes_over_the_clock_with_its_notes_on_it(monkeypatch):
    """The exchange prepared for a fallback notes things before it takes over the first one's
    clock; a wall clock stepped in between (here five seconds back) moves none of them."""
    first = finished_exchange()
    first.note("relay", "retrying")
    monkeypatch.setattr(time, "time", lambda: first.received - 5.0)
    following = finished_exchange()
    following.note("portable", "rewrote")
    following.follow(first)
    following.note("relay", "fallback")
    times = [entry["t"] - first.received for entry in following.timeline]
    assert [entry["action"] for entry in following.timeline] == ["retrying", "rewrote",
                                                                  "fallback"]
    assert 0 < times[0] < times[1] < times[2] <= following.elapsed()


def test_a_fallback_counts_its_own_repairs_not_the_first_ones_again():
    """The fallback's chain repairs the same history again: one request with two repairs is
    two in its header, its ledger row and the metrics, not four."""
    first = finished_exchange()
    first.repaired("dedup", 2, rule="repeated_id")
    first.unsure("pairing", "messages[3]", "no record")
    following = finished_exchange()
    following.repaired("dedup", 2, rule="repeated_id")
    following.follow(first)
    assert following.repairs == 2 and following.response_headers["x-relay-repairs"] == "2"
    assert [(r.step, r.rule, r.count) for r in following.repaired_by] == [
        ("dedup", "repeated_id", 2)]
    assert following.uncertain == ()
    assert [e["action"] for e in following.timeline].count("repaired") == 2
