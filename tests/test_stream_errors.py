"""A stream the upstream itself ends with an ``error`` event (``overloaded_error`` after the
first events, in either format) reaches the client as it came, and the record says why:
outcome ``stream_error``, the event's message and type in ``stream_failure``, a timeline
step; as for a stream the relay ends."""

from __future__ import annotations

import orjson
import pytest

from relay.hookspecs import hookimpl
from relay.testing.fixtures import start_relay
from tests.test_server import BODY, Upstream, start_upstream, stream_reply

START = (b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1",'
         b'"type":"message","role":"assistant","content":[],"model":"m",'
         b'"usage":{"input_tokens":3,"output_tokens":1}}}\n\n')
BLOCK = (b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
         b'"content_block":{"type":"text","text":""}}\n\n')
ERROR = (b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error",'
         b'"message":"Overloaded"}}\n\n')
STOP = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'


class Seen:
    def __init__(self):
        self.ended = []

    @hookimpl
    def relay_exchange_end(self, exchange):
        self.ended.append(exchange)


async def relayed(aiohttp_server, aiohttp_client, chunks, pipeline=(), wire="anthropic"):
    upstream = Upstream()
    upstream.reply = stream_reply(chunks)
    server = await start_upstream(aiohttp_server, upstream)
    seen = Seen()
    url = str(server.make_url("/v1" if wire == "openai" else "")).rstrip("/")
    client = await start_relay(aiohttp_client, {"pipeline": ["seen", *pipeline], "backends": [
        {"name": "up", "url": url, "models": ["claude-*"], "format": wire}]},
        extra={"seen": seen})
    resp = await client.post("/v1/messages", json={**BODY, "stream": True})
    body = await resp.read()
    [exchange] = seen.ended
    return body, exchange


@pytest.mark.parametrize("pipeline", [(), ("usage", "dedup")])
@pytest.mark.parametrize("framing", ["lf", "crlf", "one read"])
async def test_an_upstream_error_event_is_recorded_as_the_streams_end(
        aiohttp_server, aiohttp_client, pipeline, framing):
    chunks = [START, BLOCK, ERROR]
    if framing == "crlf":
        chunks = [chunk.replace(b"\n", b"\r\n") for chunk in chunks]
    elif framing == "one read":
        chunks = [b"".join(chunks)]
    body, exchange = await relayed(aiohttp_server, aiohttp_client, chunks, pipeline)
    assert body == b"".join(chunks)
    assert exchange.outcome == "stream_error"
    assert (exchange.stream_failure.message, exchange.stream_failure.kind) == (
        "Overloaded", "overloaded_error")
    assert any(step["action"] == "stream error" for step in exchange.timeline)


async def test_a_stream_that_ends_well_is_ok(aiohttp_server, aiohttp_client):
    body, exchange = await relayed(aiohttp_server, aiohttp_client, [START, BLOCK, STOP],
                                   ("usage", "dedup"))
    assert body == START + BLOCK + STOP
    assert exchange.outcome == "ok" and exchange.stream_failure is None


async def test_an_openai_format_error_chunk_is_recorded_too(aiohttp_server, aiohttp_client):
    def chunk(data):
        return b"data: " + orjson.dumps(data) + b"\n\n"
    chunks = [chunk({"id": "c", "model": "gpt", "choices": [
                  {"index": 0, "delta": {"role": "assistant", "content": "Hi"}}]}),
              chunk({"error": {"message": "Overloaded", "code": 529}})]
    body, exchange = await relayed(aiohttp_server, aiohttp_client, chunks, ("usage",),
                                   wire="openai")
    assert body.endswith(b"event: error\ndata: " + orjson.dumps(
        {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})
        + b"\n\n")
    assert exchange.outcome == "stream_error"
    assert exchange.stream_failure.message == "Overloaded"
