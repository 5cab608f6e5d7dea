"""What the relay says when it answers for the upstream: a request id the SDKs can read, plain
words for a broken stream, ``x-should-retry`` after its own retries, and a full pool named as
the relay's."""

from __future__ import annotations

import asyncio

import anthropic
import orjson
from aiohttp import web
from support import backend
from test_server import BODY, STREAM, Upstream, start_upstream
from test_upstream import FAST, Recorder

from relay.testing.fixtures import start_relay


async def test_relay_errors_carry_a_request_id_the_sdk_reads(aiohttp_client):
    client = await start_relay(aiohttp_client, {
        "backends": [{"name": "up", "url": "http://127.0.0.1:9", "models": ["claude-*"]}]})
    resp = await client.post("/v1/messages", json={**BODY, "model": "gpt-none"})
    body = await resp.json()
    assert resp.status == 404
    assert resp.headers["request-id"] == body["request_id"] == resp.headers["x-relay-request-id"]
    refused = await client.post("/v1/messages", data=b"{", headers={"Content-Type":
                                                                      "application/json"})
    assert refused.headers["request-id"] == (await refused.json())["request_id"]

    sdk = anthropic.AsyncAnthropic(base_url=str(client.make_url("")), api_key="k" * 20,
                                   max_retries=0)
    try:
        await sdk.messages.create(model="gpt-none", max_tokens=10,
                                  messages=[{"role": "user", "content": "hi"}])
    except anthropic.NotFoundError as e:
        assert e.request_id and e.request_id.startswith("relay_")
    else:
        raise AssertionError("the relay answered a model it has no backend for")
    finally:
        await sdk.close()


async def test_a_broken_stream_is_told_in_plain_words(aiohttp_server, aiohttp_client):
    cut = STREAM.index(b"event: content_block_delta")

    async def die(request):
        # Chunked, and cut in the middle of a chunk: aiohttp's TransferEncodingError.
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(STREAM[:cut + 20])
        request.transport.write(b"400\r\nnot all of it")
        request.transport.close()
        return resp
    upstream = Upstream()
    upstream.reply = die
    server = await start_upstream(aiohttp_server, upstream)
    recorder = Recorder()
    client = await start_relay(aiohttp_client, {
        "pipeline": ["rec"],
        "backends": [{"name": "up", "url": str(server.make_url("")), "models": ["claude-*"]}]},
        extra={"rec": recorder})
    resp = await client.post("/v1/messages", json={**BODY, "stream": True})
    last = (await resp.read()).rstrip(b"\n").split(b"\n\n")[-1]
    error = orjson.loads(last.split(b"data: ", 1)[1])["error"]
    assert error["message"] == ("upstream up's stream broke off: the upstream ended it "
                                "before it was complete")
    note = next(e for e in recorder.ended[0].timeline if e["action"] == "stream error")
    assert "ClientPayloadError" in note["detail"]  # the library's account, kept for the dump


async def test_answers_after_relay_retries_say_not_to_retry(aiohttp_client,
                                                            unused_tcp_port_factory):
    port = unused_tcp_port_factory()
    client = await start_relay(aiohttp_client, {
        "backends": [backend(f"http://127.0.0.1:{port}", retries=FAST)]})
    resp = await client.post("/v1/messages", json=BODY)
    assert resp.status == 502 and resp.headers["x-should-retry"] == "false"
    once = await start_relay(aiohttp_client, {"backends": [backend(f"http://127.0.0.1:{port}")]})
    resp = await once.post("/v1/messages", json=BODY)
    assert resp.status == 502 and "x-should-retry" not in resp.headers


async def test_a_full_connection_pool_is_the_relays_capacity(aiohttp_server, aiohttp_client):
    release = asyncio.Event()

    async def hold(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(STREAM.split(b"\n\n", 1)[0] + b"\n\n")
        await release.wait()
        await resp.write(STREAM.split(b"\n\n", 1)[1])
        await resp.write_eof()
        return resp
    upstream = Upstream()
    upstream.reply = hold
    server = await start_upstream(aiohttp_server, upstream)
    recorder = Recorder()
    client = await start_relay(aiohttp_client, {
        "server": {"upstream_connections": 1},
        "pipeline": ["metrics", "rec"],
        "backends": [{"name": "up", "url": str(server.make_url("")), "models": ["claude-*"],
                      "timeouts": {"connect": 0.3}, "retries": FAST}]},
        extra={"rec": recorder})
    holding = await client.post("/v1/messages", json={**BODY, "stream": True})
    await holding.content.readuntil(b"\n\n")  # the one connection is now taken
    resp = await client.post("/v1/messages", json=BODY)
    body = await resp.json()
    release.set()
    assert await holding.read()
    assert resp.status == 529 and body["error"]["type"] == "overloaded_error"
    assert "the relay is at capacity" in body["error"]["message"]
    assert "server.upstream_connections" in body["error"]["message"]
    assert len(upstream.received) == 1  # never sent, and not retried into the same wait
    full = next(e for e in recorder.ended if e.outcome == "pool_full")
    assert len(full.attempts) == 1 and full.attempts[0].error == "pool full"
    metrics = await (await client.get("/metrics")).text()
    assert 'outcome="pool_full"' in next(line for line in metrics.splitlines()
                                          if line.startswith("relay_requests_total{")
                                          and 'status="529"' in line)



async def test_an_unreachable_upstream_is_told_in_plain_words(aiohttp_client,
                                                              unused_tcp_port_factory):
    port = unused_tcp_port_factory()
    recorder = Recorder()
    client = await start_relay(aiohttp_client, {
        "pipeline": ["rec"], "backends": [backend(f"http://127.0.0.1:{port}")]},
        extra={"rec": recorder})
    resp = await client.post("/v1/messages", json=BODY)
    message = (await resp.json())["error"]["message"]
    assert resp.status == 502
    assert message == (f"upstream emu is unreachable: could not connect to 127.0.0.1:{port} "
                       "(connection refused)")
    assert "ClientConnectorError" in recorder.ended[0].attempts[0].error  # kept for the dump
