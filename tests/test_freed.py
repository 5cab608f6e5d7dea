"""A finished exchange is freed when its handler returns, whatever its outcome, not at the
garbage collector's next pass: it holds the request's body (up to 32 MB), and a relay that
refuses many large requests (a key past its limits, a model nobody serves) would otherwise
hold every one of them until then (the collector's first generation runs only every
``relay.server.GC_YOUNG`` allocations).

Each case sends its request with the collector off and then counts the exchanges still
alive: any left was kept alive by a reference cycle."""

from __future__ import annotations

import asyncio
import gc
import logging

import aiohttp
import pytest
from aiohttp import web

from relay.errors import RelayError
from relay.exchange import Exchange
from relay.hookspecs import hookimpl
from relay.testing.fixtures import start_relay

BODY = {"model": "claude-test", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
ANSWER = {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-test",
          "content": [{"type": "text", "text": "hello"}], "stop_reason": "end_turn",
          "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}}
STARTED = (b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1",'
           b'"type":"message","role":"assistant","content":[],"model":"m","stop_reason":null,'
           b'"usage":{"input_tokens":1,"output_tokens":0}}}\n\n')


class Refuse:
    @hookimpl
    def relay_request(self, exchange):
        raise RelayError(429, "requests_per_minute: over the key's limit", "rate_limit_error")


class RefuseSecond:
    @hookimpl
    def relay_request(self, exchange):
        if exchange.backend.name == "second":
            raise RelayError(400, "not for this backend")


class EndStream:
    @hookimpl
    def relay_stream_events(self):
        return {"message_start"}

    @hookimpl
    def relay_stream_event(self, event):
        raise RelayError(400, "a stream plugin ends it")


class Crash:
    @hookimpl
    def relay_request(self):
        raise KeyError("bug")


async def answer(request):
    await request.read()
    return web.json_response(ANSWER)


async def overloaded(request):
    await request.read()
    return web.json_response({"type": "error", "error": {"type": "overloaded_error",
                                                         "message": "busy"}}, status=529)


async def cut_stream(request):
    await request.read()
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(STARTED)
    request.transport.close()
    return response


@pytest.fixture
def unlogged():
    """No log records: pytest's capture keeps each one, and with a logged exception its
    traceback and the frames it went through, where serving formats a record and lets it
    go."""
    logging.disable(logging.CRITICAL)
    yield
    logging.disable(logging.NOTSET)


async def stream(request):
    await request.read()
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(STARTED)
    await response.write(b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
    return response


async def refused_stream(request):
    await request.read()
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(b'event: error\ndata: {"type":"error","error":{"type":'
                         b'"overloaded_error","message":"Overloaded"}}\n\n')
    return response


async def cut_before_the_first_event(request):
    await request.read()
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(STARTED[:10])
    request.transport.close()
    return response


async def slow_stream(request):
    await request.read()
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(STARTED)
    await asyncio.sleep(30)
    return response


async def hang_up(request):
    await request.read()
    request.transport.close()
    return web.Response()


def cut_body(status: int):
    """A handler whose answer says it is longer than it is, then hangs up mid-body."""
    async def handle(request):
        await request.read()
        response = web.StreamResponse(status=status, headers={
            "Content-Type": "application/json", "Content-Length": "1000"})
        await response.prepare(request)
        await response.write(b'{"type": "mess')
        request.transport.close()
        return response
    return handle


def every_other(first, then):
    """A handler that hangs up and answers by turns."""
    calls = []

    async def handle(request):
        calls.append(None)
        return await (first if len(calls) % 2 else then)(request)
    return handle


PLUGINS = {"refuse": Refuse, "crash": Crash, "second": RefuseSecond, "end": EndStream}


def alive() -> int:
    return sum(1 for o in gc.get_objects() if type(o) is Exchange)


async def freed(before: int) -> bool:
    """Whether the exchanges alive come back to ``before`` once the end hooks, which run
    after the client has its answer, are done (with the collector off, a cycle never does)."""
    for _ in range(100):
        if alive() == before:
            return True
        await asyncio.sleep(0.02)
    return False


# Each case: the first backend's handler, the pipeline, the body, the status the client
# gets, and the handler of a second backend the first falls back to (or None).
CASES = {
    "answered": (answer, (), BODY, 200, None),
    "a model no backend serves": (answer, (), {**BODY, "model": "gpt-nobody"}, 404, None),
    "refused by a plugin": (answer, ("refuse",), BODY, 429, None),
    "a plugin that fails": (answer, ("crash",), BODY, 500, None),
    "the upstream's error": (overloaded, (), BODY, 529, None),
    "a stream the upstream cut": (cut_stream, (), {**BODY, "stream": True}, 200, None),
    "an upstream that hangs up": (hang_up, (), BODY, 502, None),
    "a retry after a hang-up": (every_other(hang_up, answer), (), BODY, 200, None),
    "a fallback after a hang-up": (hang_up, (), BODY, 200, answer),
    "a fallback the chain refuses": (overloaded, ("second",), BODY, 529, answer),
    "a stream a plugin ends": (stream, ("end",), {**BODY, "stream": True}, 200, None),
    "a retry after a stream refused at its start": (
        every_other(refused_stream, stream), (), {**BODY, "stream": True}, 200, None),
    "a fallback after a stream refused at its start": (
        refused_stream, (), {**BODY, "stream": True}, 200, stream),
    "a stream cut before its first event": (
        cut_before_the_first_event, (), {**BODY, "stream": True}, 200, None),
    "a body over the limit": (answer, (), {**BODY, "pad": "x" * 70_000}, 413, None),
    "an answer cut mid-body": (cut_body(200), (), BODY, 502, None),
    "an error cut mid-body": (cut_body(400), (), BODY, 502, None),
}


async def backend(aiohttp_server, name: str, handler, fallback: str | None = None) -> dict:
    app = web.Application()
    app.router.add_post("/v1/messages", handler)
    server = await aiohttp_server(app)
    return {"name": name, "url": str(server.make_url("")), "models": ["claude-*"],
            "retries": {"attempts": 2, "backoff": 0.001}, **({"fallbacks": [fallback]} if fallback else {})}


@pytest.mark.parametrize("case", CASES)
async def test_a_finished_exchange_is_freed_without_the_collector(case, aiohttp_server,
                                                                   aiohttp_client, unlogged):
    handler, pipeline, body, status, second = CASES[case]
    backends = [await backend(aiohttp_server, "up", handler, "second" if second else None)]
    if second:
        backends.append(await backend(aiohttp_server, "second", second))
    client = await start_relay(aiohttp_client, {
        "pipeline": list(pipeline), "backends": backends,
        "server": {"max_body_bytes": 65_536}}, extra=PLUGINS)
    await (await client.post("/v1/messages", json=body)).read()  # connections made
    gc.collect()
    gc.disable()
    try:
        before = alive()
        response = await client.post("/v1/messages", json=body)
        await response.read()
        assert response.status == status
        assert await freed(before)
    finally:
        gc.enable()
        await client.chain.shutdown(client.config)


MODELS = {"data": [{"type": "model", "id": "claude-test"}], "has_more": False}


async def models(request):
    return web.json_response(MODELS)


# A pass-through route (GET /v1/models): the upstream's handler and the status the client gets
# (a body cut after its headers went out arrives cut: the status is already the upstream's).
PASSED = {
    "answered": (models, 200),
    "an upstream that hangs up": (hang_up, 502),
    "a body cut mid-way": (cut_body(200), 200),
}


@pytest.mark.parametrize("case", PASSED)
async def test_a_passed_through_exchange_is_freed_without_the_collector(
        case, aiohttp_server, aiohttp_client, unlogged):
    handler, status = PASSED[case]
    app = web.Application()
    app.router.add_get("/v1/models", handler)
    server = await aiohttp_server(app)
    client = await start_relay(aiohttp_client, {"pipeline": [], "backends": [{
        "name": "up", "url": str(server.make_url("")), "models": ["claude-*"]}]})
    gc.collect()
    gc.disable()
    try:
        before = alive()
        response = await client.get("/v1/models")
        try:
            await response.read()
        except aiohttp.ClientPayloadError:
            assert case == "a body cut mid-way"
        assert response.status == status
        assert await freed(before)
    finally:
        gc.enable()
        await client.chain.shutdown(client.config)


async def test_a_stream_its_client_walked_away_from_is_freed(aiohttp_server, aiohttp_client,
                                                             unlogged):
    backends = [await backend(aiohttp_server, "up", slow_stream)]
    client = await start_relay(aiohttp_client, {
        "backends": backends, "server": {"stream_keepalive": 0.05}})
    gc.collect()
    gc.disable()
    try:
        before = alive()
        response = await client.post("/v1/messages", json={**BODY, "stream": True})
        assert (await response.content.readany()).startswith(b"event: message_start")
        assert alive() == before + 1  # in flight
        response.close()  # the client goes away mid-stream
        assert await freed(before)  # the next ping finds it gone
    finally:
        gc.enable()
        await client.chain.shutdown(client.config)


SHIPPED = ["limits", "usage", "metrics", "cache", "dedup", "pairing", "ordering", "portable",
           "dump"]
KEY = "sk-relay-freed-0123456789abcdef"


@pytest.mark.parametrize("streamed", [False, True], ids=["answer", "stream"])
async def test_the_shipped_pipeline_with_a_key_leaves_no_exchange_alive(
        streamed, aiohttp_server, aiohttp_client, unlogged, tmp_path):
    backends = [await backend(aiohttp_server, "up", stream if streamed else answer)]
    client = await start_relay(aiohttp_client, {
        "pipeline": SHIPPED, "backends": backends, "plugins": {"dump": {"dir": str(tmp_path)}},
        "server": {"auth": {"keys": [{"name": "team", "key_env": "RELAY_FREED_KEY", "limits": {
            "requests_per_minute": 100, "concurrent": 4, "budget": {"usd": 5, "per": "day"}}}]}}},
        env={"RELAY_FREED_KEY": KEY})
    body = {**BODY, "stream": True} if streamed else BODY
    headers = {"x-api-key": KEY}
    for _ in range(3):  # the session's record, the limits' windows, the metrics' series made
        await (await client.post("/v1/messages", json=body, headers=headers)).read()
    gc.collect()
    assert await freed(0)  # their end hooks done
    gc.disable()
    try:
        before = alive()
        response = await client.post("/v1/messages", json=body, headers=headers)
        await response.read()
        assert response.status == 200
        assert await freed(before)
    finally:
        gc.enable()
        await client.chain.shutdown(client.config)
