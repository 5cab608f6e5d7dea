"""What a stream costs beyond the bare pass-through, through a real relay: the writes to the
client's connection (the head goes out with the first bytes and the last bytes with the
body's end, yet nothing waits on the upstream for it, and the first event of a long first
read still goes out first), and the events the shipped plugins are handed (only those they
read). The client receives every byte as the upstream sent it."""

from __future__ import annotations

import asyncio
import collections
import re

import pytest
from aiohttp import web

from relay import config as config_module
from relay.chain import Chain, load_plugins
from relay.server import create_app
from relay.stream import FIRST_READ_WHOLE

BODY = {"model": "claude-test", "max_tokens": 10, "stream": True,
        "messages": [{"role": "user", "content": "hi"}]}
START = (b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1",'
         b'"type":"message","role":"assistant","content":[],"model":"m","stop_reason":null,'
         b'"usage":{"input_tokens":1,"output_tokens":0}}}\n\n')
DELTA = (b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
         b'"delta":{"type":"text_delta","text":"hello"}}\n\n')
END = (b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
       b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn"},'
       b'"usage":{"output_tokens":1}}\n\n'
       b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
BLOCK = (b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
         b'"content_block":{"type":"text","text":""}}\n\n')
STREAM = START + BLOCK + DELTA + END
PING = b'event: ping\ndata: {"type": "ping"}\n\n'
SSE = "text/event-stream"


@pytest.fixture
async def local_relay(aiohttp_server, aiohttp_client):
    """A relay (no plugins, or those named) in front of ``reply``; what it wrote to the
    client's connection, one entry a write, is in ``client.writes``."""
    async def start(reply, pipeline=(), plugins=None):
        upstream = web.Application()
        upstream.router.add_post("/v1/messages", reply)
        server = await aiohttp_server(upstream)
        config = config_module.parse(
            {"pipeline": list(pipeline), "plugins": plugins or {},
             "backends": [{"name": "up", "url": str(server.make_url("")), "models": ["*"]}]}, {})
        chain = Chain(load_plugins(config.pipeline), config)
        await chain.startup(config)
        app = create_app(config, chain)
        writes: list[bytes] = []

        async def record(request, response):
            transport = request.transport
            if getattr(transport, "recorded", False):
                return
            write, writelines = transport.write, transport.writelines

            def recorded_write(data):
                writes.append(bytes(data))
                write(data)

            def recorded_writelines(chunks):
                chunks = list(chunks)
                writes.append(b"".join(chunks))
                writelines(chunks)
            transport.write, transport.writelines = recorded_write, recorded_writelines
            transport.recorded = True
        app.on_response_prepare.append(record)
        client = await aiohttp_client(app)
        client.writes = writes
        return client
    return start


def body(writes: list[bytes]) -> bytes:
    """The events in the client's writes, without the head and the chunked framing."""
    data = b"".join(writes)
    data = data[data.index(b"\r\n\r\n") + 4:]
    out = b""
    while True:
        size, _, data = data.partition(b"\r\n")
        if not int(size, 16):
            return out
        out += data[:int(size, 16)]
        data = data[int(size, 16) + 2:]


async def test_a_stream_read_whole_is_one_write_head_body_and_end(local_relay):
    async def reply(request):  # head and body in one write: the relay reads them in one
        return web.Response(body=STREAM, content_type=SSE)

    client = await local_relay(reply)
    resp = await client.post("/v1/messages", json=BODY)
    assert await resp.read() == STREAM
    assert len(client.writes) == 1
    write = client.writes[0]
    assert write.startswith(b"HTTP/1.1 200 ") and write.endswith(b"\r\n0\r\n\r\n")
    assert body(client.writes) == STREAM


async def test_a_stream_seen_by_plugins_is_one_write_as_well(local_relay):
    async def reply(request):
        return web.Response(body=STREAM, content_type=SSE)

    client = await local_relay(reply, pipeline=["usage", "dedup", "portable"])
    resp = await client.post("/v1/messages", json=BODY)
    assert await resp.read() == STREAM
    assert len(client.writes) == 1


async def test_the_head_does_not_wait_for_the_first_event(local_relay):
    gate = asyncio.Event()

    async def reply(request):
        response = web.StreamResponse(headers={"Content-Type": SSE})
        await response.prepare(request)
        await gate.wait()
        await response.write(STREAM)
        await response.write_eof()
        return response

    client = await local_relay(reply)
    resp = await asyncio.wait_for(client.post("/v1/messages", json=BODY), 5)
    assert resp.status == 200 and resp.headers["Content-Type"].startswith(SSE)
    gate.set()
    assert await resp.read() == STREAM
    assert client.writes[0].startswith(b"HTTP/1.1 200 ") and client.writes[0].endswith(b"\r\n\r\n")


async def test_the_last_event_does_not_wait_for_the_upstreams_end(local_relay):
    gate = asyncio.Event()

    async def reply(request):
        response = web.StreamResponse(headers={"Content-Type": SSE})
        await response.prepare(request)
        await response.write(STREAM)
        await gate.wait()  # the body's end (and one more event) only once the client has all
        await response.write(PING)
        await response.write_eof()
        return response

    client = await local_relay(reply)
    resp = await client.post("/v1/messages", json=BODY)
    got = await asyncio.wait_for(resp.content.readuntil(b'"message_stop"}\n\n'), 5)
    gate.set()
    assert got + await resp.read() == STREAM + PING
    assert body(client.writes) == STREAM + PING


async def test_a_long_first_read_still_sends_its_first_event_first(local_relay):
    deltas = DELTA * (FIRST_READ_WHOLE // len(DELTA) + 1)

    async def reply(request):
        return web.Response(body=START + BLOCK + deltas + END, content_type=SSE)

    client = await local_relay(reply)
    resp = await client.post("/v1/messages", json=BODY)
    assert await resp.read() == START + BLOCK + deltas + END
    first, rest = client.writes
    assert first.startswith(b"HTTP/1.1 200 ") and first.endswith(START + b"\r\n")
    assert rest.startswith(b"%x\r\n" % (len(BLOCK + deltas + END))) and rest.endswith(b"0\r\n\r\n")


async def test_a_stream_without_its_end_still_ends_with_an_error_event(local_relay):
    async def reply(request):
        return web.Response(body=START + BLOCK + DELTA, content_type=SSE)

    client = await local_relay(reply)
    resp = await client.post("/v1/messages", json=BODY)
    out = await resp.read()
    assert out.startswith(START + BLOCK + DELTA)
    assert out[len(START + BLOCK + DELTA):].startswith(b"event: error\n")


TOOL_START = (b'event: content_block_start\ndata: {"type":"content_block_start","index":1,'
              b'"content_block":{"type":"tool_use","id":"toolu_01","name":"Bash","input":{}}}\n\n')
TOOL_DELTA = (b'event: content_block_delta\ndata: {"type":"content_block_delta","index":1,'
              b'"delta":{"type":"input_json_delta","partial_json":"{}"}}\n\n')
TOOL_STOP = b'event: content_block_stop\ndata: {"type":"content_block_stop","index":1}\n\n'


async def test_the_shipped_plugins_are_handed_only_the_events_they_read(local_relay, monkeypatch,
                                                                       caplog, tmp_path):
    monkeypatch.setenv("RELAY_TRACE", "1")  # every hook call logged, by plugin
    stream = (START + BLOCK + DELTA * 20 + PING + TOOL_START + TOOL_DELTA * 5 + TOOL_STOP
              + END)

    async def reply(request):
        return web.Response(body=stream, content_type=SSE)

    pipeline = ["limits", "usage", "metrics", "cache", "dedup", "pairing", "ordering",
                "portable", "dump"]
    client = await local_relay(reply, pipeline=pipeline, plugins={"dump": {"dir": str(tmp_path)}})
    with caplog.at_level("INFO", logger="relay.chain"):
        resp = await client.post("/v1/messages", json=BODY)
        assert await resp.read() == stream
    traced = (re.search(r"^trace \S+ (\w+)\.relay_stream_event -> ", record.getMessage())
              for record in caplog.records)
    handed = collections.Counter(found[1] for found in traced if found)
    # usage: the message_start and the message_delta; dedup and portable: each block's start;
    # metrics, cache (no prefix to judge here), dump (no stream errors asked for): nothing.
    assert handed == {"usage": 2, "dedup": 2, "portable": 2}
    assert len(client.writes) == 1
