"""A stream's first event may take several reads: whatever the upstream's first read holds,
the relay frames the stream as its first whole event says (named or not), and relays it."""

from __future__ import annotations

import asyncio

import orjson
from aiohttp import web

from relay import config as config_module
from relay.chain import Chain, load_plugins
from relay.stream import StreamRelay
from relay.testing import exchange_for
from relay.testing.fixtures import start_relay
from tests.test_server import BODY, Upstream, start_upstream

EVENTS = [
    {"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "content": [],
        "model": "claude-test", "usage": {"input_tokens": 7, "output_tokens": 1}}},
    {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "hi"}},
    {"type": "content_block_stop", "index": 0},
    {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
     "usage": {"output_tokens": 5}},
    {"type": "message_stop"},
]
# Data lines only, the type in the JSON: what the client gets has each event named.
UNTYPED = b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in EVENTS)
NAMED = b"".join(b"event: " + e["type"].encode() + b"\ndata: " + orjson.dumps(e) + b"\n\n"
                 for e in EVENTS)


async def relayed(chunks: list[bytes]):
    config = config_module.parse({"pipeline": ["usage"],
                                  "backends": [{"name": "test", "url": "http://127.0.0.1:9"}]}, {})
    chain = Chain(load_plugins(config.pipeline), config)
    exchange = exchange_for({"model": "claude-test", "max_tokens": 9, "stream": True,
                             "messages": [{"role": "user", "content": "hi"}]})
    out: list[bytes] = []

    async def write(data: bytes) -> None:
        out.append(data)

    stream = StreamRelay(chain, exchange, await chain.stream_plan(exchange), write)
    for chunk in chunks:
        await stream.feed(chunk)
    await stream.finish()
    return b"".join(out), exchange


async def test_an_untyped_stream_is_named_wherever_its_first_read_ends():
    first = UNTYPED.index(b"\n\n") + 2
    for cut in range(1, first + 1):
        sent, exchange = await relayed([UNTYPED[:cut], UNTYPED[cut:]])
        assert sent == NAMED, cut
        used = exchange.usage
        assert (used.input_tokens, used.output_tokens, used.complete) == (7, 5, True), cut


async def test_an_untyped_stream_named_when_it_comes_a_byte_at_a_time():
    sent, exchange = await relayed([UNTYPED[i:i + 1] for i in range(len(UNTYPED))])
    assert sent == NAMED
    assert exchange.usage.output_tokens == 5


async def test_a_named_stream_split_in_its_first_event_is_relayed_as_it_came():
    for cut in (1, 5, 30, NAMED.index(b"\n\n") + 1):
        sent, exchange = await relayed([NAMED[:cut], NAMED[cut:]])
        assert sent == NAMED, cut
        assert exchange.usage.output_tokens == 5, cut


async def test_an_untyped_stream_whose_first_read_is_short_reaches_the_client_named(
        aiohttp_server, aiohttp_client):
    async def reply(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in (UNTYPED[:10], UNTYPED[10:]):
            await resp.write(chunk)
            await asyncio.sleep(0.05)  # the relay reads the two apart
        await resp.write_eof()
        return resp

    upstream = Upstream()
    upstream.reply = reply
    server = await start_upstream(aiohttp_server, upstream)
    client = await start_relay(aiohttp_client, {"pipeline": ["usage"], "backends": [
        {"name": "up", "url": str(server.make_url("")), "models": ["claude-*"]}]})
    resp = await client.post("/v1/messages", json={**BODY, "stream": True})
    assert await resp.read() == NAMED
