"""The relay in front of a hostile upstream (relay.testing.hostile), in both formats: a line
that never ends and a stream that never ends are cut with ``event: error`` while what the
relay keeps of them stays bounded; a malformed answer is a 502 naming what is malformed,
counted, logged and dumped as one, and never a traceback."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from test_server import start_relay
from test_upstream import Recorder

from relay import bounded, stream
from relay.formats import openai
from relay.sse import SSEDecoder
from relay.testing import hostile

BODY = {"max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
# Small limits, so that what must be cut is cut after a megabyte rather than 64.
LIMIT = 1024 * 1024
# What the record of a stream may hold at most: both ends, and the line between them.
RECORD = bounded.HEAD_BYTES + bounded.TAIL_BYTES + 100
FORMATS = ("anthropic", "openai")


@pytest.fixture
def small_limits(monkeypatch):
    monkeypatch.setattr(stream, "MAX_EVENT_BYTES", LIMIT)
    monkeypatch.setattr(openai.stream, "MAX_EVENT_BYTES", LIMIT)
    monkeypatch.setattr(openai.stream, "MAX_HELD_BYTES", LIMIT)


@pytest.fixture
async def relay_to(aiohttp_server, aiohttp_client):
    started = []

    async def make(wire: str, pipeline=(), plugins=None, **backend_extra):
        upstream = await aiohttp_server(hostile.create_app(
            hostile.HostileOptions(malformed_model_list=backend_extra.pop("bad_list", False))))
        recorder = Recorder()
        url = str(upstream.make_url("/v1" if wire == "openai" else "")).rstrip("/")
        client = await start_relay(aiohttp_client, {
            "pipeline": [*pipeline, "recorder"], "plugins": plugins or {},
            "backends": [{"name": "hostile", "url": url, "models": ["*"], "format": wire,
                          **backend_extra}]}, extra={"recorder": recorder})
        client.recorder = recorder
        started.append(client)
        return client
    yield make
    for client in started:
        await client.chain.shutdown(client.config)


def events_of(raw: bytes) -> list[dict]:
    decoder = SSEDecoder()
    return [e.data for e in decoder.feed(raw) + decoder.close()]


async def exchange_of(client):
    for _ in range(200):  # the end hooks run once the answer is out
        if client.recorder.ended:
            return client.recorder.ended[-1]
        await asyncio.sleep(0.01)
    raise AssertionError("the exchange never ended")


# --- what never ends --------------------------------------------------------------------------

@pytest.mark.parametrize("wire", FORMATS)
async def test_a_line_that_never_ends_is_cut_with_an_error_event(relay_to, small_limits, wire):
    client = await relay_to(wire)
    response = await asyncio.wait_for(client.post(
        "/v1/messages", json={**BODY, "model": "endless-line", "stream": True}), 30)
    raw = await asyncio.wait_for(response.read(), 30)
    events = events_of(raw)
    assert events[0]["type"] == "message_start"
    assert events[-1]["type"] == "error"
    assert f"grew past {LIMIT} bytes without ending" in events[-1]["error"]["message"]
    exchange = await exchange_of(client)
    assert exchange.outcome == "stream_error"
    answer = exchange.upstream_response
    record = (answer.body if answer is not None else None) or b""
    assert len(record) <= RECORD  # a megabyte and more came; a bounded record of it is kept
    if wire == "openai":
        assert b"bytes left out]" in record


@pytest.mark.parametrize("wire", FORMATS)
async def test_a_stream_that_never_ends_keeps_a_bounded_record(relay_to, wire):
    # Every event of it is well-formed: only the client can end it, here once it has read
    # many times what the relay may keep.
    client = await relay_to(wire)
    response = await client.post("/v1/messages", json={**BODY, "model": "endless",
                                                       "stream": True})
    first = await response.content.readuntil(b"\n\n")
    assert first.startswith(b"event: message_start\n")
    read = 0
    while read < 8 * RECORD:
        read += len(await asyncio.wait_for(response.content.readany(), 10))
    response.close()
    exchange = await exchange_of(client)
    assert exchange.outcome == "client_disconnected"
    answer = exchange.upstream_response
    record = (answer.body if answer is not None else None) or b""
    assert len(record) <= RECORD
    if wire == "openai":
        head, _, tail = record.partition(b"\n[relay: ")
        left_out = int(tail.split(b" ", 1)[0])
        assert len(record) + left_out > read  # the count says how much is missing
        assert head.startswith(b"data: ")


@pytest.mark.parametrize("wire", FORMATS)
async def test_an_answer_that_never_ends_is_cut_at_the_relays_limit(relay_to, wire):
    client = await relay_to(wire)
    client.config.max_upstream_body_bytes = LIMIT
    response = await client.post("/v1/messages", json={**BODY, "model": "endless"})
    assert response.status == 502
    assert "server.max_upstream_body_bytes" in (await response.json())["error"]["message"]


# --- malformed answers ------------------------------------------------------------------------

WHERE = {
    "usage-strings": "usage.prompt_tokens is not a token count",
    "float-tokens": "usage.prompt_tokens is not a token count",
    "choices-object": "choices is not a list",
    "tool-calls-number": "tool_calls[0] is not an object",
    "function-string": "tool_calls[0].function is not an object",
    "tool-id-number": "tool_calls[0].id is not a string",
    "tool-name-number": "tool_calls[0].function.name is not a string",
    "part-text-number": "content[0].text is not a string",
    "finish-reason-list": "choices[0].finish_reason is not a string",
    "model-number": "model is not a string",
    "not-json": "not",
}


async def test_a_malformed_answer_is_a_502_counted_and_dumped(relay_to, tmp_path, caplog):
    dumps = tmp_path / "dumps"
    client = await relay_to("openai", pipeline=["metrics", "dump"],
                            plugins={"dump": {"dir": str(dumps)}})
    for kind, where in WHERE.items():
        client.recorder.ended.clear()
        response = await client.post("/v1/messages", json={**BODY, "model": f"malformed-{kind}"})
        assert response.status == 502, kind
        body = await response.json()
        assert body["type"] == "error" and body["error"]["type"] == "api_error"
        assert body["request_id"] == response.headers["x-relay-request-id"]
        message = body["error"]["message"]
        assert message.startswith("upstream hostile answered with a "), message
        assert where in message, (kind, message)
        if kind != "not-json":
            assert "malformed chat completion: " in message
        exchange = await exchange_of(client)
        assert exchange.outcome == "upstream_malformed"
    metrics = await (await client.get("/metrics")).text()
    counted = [line for line in metrics.splitlines() if line.startswith("relay_requests_total{")
               and 'outcome="upstream_malformed"' in line and 'status="502"' in line]
    assert counted and float(counted[0].rsplit(" ", 1)[1]) == len(WHERE)
    for _ in range(200):
        files = list(dumps.rglob("*.json"))
        if len(files) == len(WHERE):
            break
        await asyncio.sleep(0.02)
    assert len(files) == len(WHERE)
    dump = json.loads(files[0].read_text())
    assert dump["reason"] == dump["outcome"] == "upstream_malformed"
    assert dump["relay_error"]["status"] == 502 and dump["upstream_response"]["status"] == 200
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"


@pytest.mark.parametrize("kind", sorted(WHERE))
async def test_a_malformed_stream_chunk_ends_the_stream_with_an_error(relay_to, caplog, kind):
    client = await relay_to("openai")
    response = await client.post("/v1/messages", json={**BODY, "model": f"malformed-{kind}",
                                                       "stream": True})
    assert response.status == 200
    events = events_of(await response.read())
    assert events[0]["type"] == "message_start"
    assert [e["delta"]["text"] for e in events if e["type"] == "content_block_delta"] == [
        "Calling. "]  # what came before the malformed chunk went out; nothing of it did
    assert events[-1]["type"] == "error" and events[-1]["error"]["type"] == "api_error"
    message = events[-1]["error"]["message"]
    assert WHERE[kind] in message, message
    assert not any(e["type"] == "message_stop" for e in events)
    exchange = await exchange_of(client)
    assert exchange.outcome == "upstream_malformed"
    assert exchange.error.message == message
    assert not [r for r in caplog.records if r.exc_info and r.levelno >= logging.ERROR]


async def test_a_malformed_model_list_is_a_502_naming_it(relay_to):
    client = await relay_to("openai", bad_list=True)
    listed = await client.get("/v1/models")
    assert listed.status == 502
    body = await listed.json()
    assert body["error"]["message"] == (
        f"upstream hostile answered with a malformed model list: data[{len(hostile.MODES)}]"
        ".created is not a time")
    assert body["request_id"] == listed.headers["x-relay-request-id"]
    one = await client.get("/v1/models/malformed-created")
    assert one.status == 502 and "(the model).created is not a time" in (
        await one.json())["error"]["message"]
    assert (await client.get("/v1/models/endless")).status == 200
    assert (await exchange_of(client)).outcome == "ok"


# --- the hostile upstream itself --------------------------------------------------------------

@pytest.mark.parametrize("wire", FORMATS)
async def test_the_hostile_upstream_echoes_the_key_it_was_sent(aiohttp_client, wire):
    client = await aiohttp_client(hostile.create_app())
    path = hostile.OpenAI.path if wire == "openai" else hostile.Anthropic.path
    headers = ({"Authorization": "Bearer sk-operator-secret"} if wire == "openai"
               else {"x-api-key": "sk-operator-secret"})
    refused = await client.post(path, json={**BODY, "model": "echo-key"}, headers=headers)
    assert refused.status == 400 and "sk-operator-secret" in await refused.text()
    assert "sk-operator-secret" in refused.headers["x-echoed-key"]
    streamed = await client.post(path, json={**BODY, "model": "echo-key", "stream": True},
                                 headers=headers)
    assert b"sk-operator-secret" in await streamed.read()
    assert "sk-operator-secret" in streamed.headers["x-echoed-key"]
