"""The upstream seam: retries, fallback, and the exchange as the record of every round trip."""

from __future__ import annotations

import asyncio
import logging

import orjson
import pytest
from aiohttp import web
from support import backend
from test_server import ANSWER, BODY, STREAM, Upstream, start_relay, start_upstream, stream_reply

from relay import config as config_module
from relay import logs
from relay import upstream as upstream_module
from relay.config import Retries
from relay.hookspecs import hookimpl
from relay.server import STATE
from relay.upstream import backoff, retry_after


class Recorder:
    """Keeps every exchange the end hook sees, and when it saw it."""

    def __init__(self):
        self.ended = []

    @hookimpl
    def relay_exchange_end(self, exchange):
        self.ended.append(exchange)


def scripted(*statuses, headers=None):
    """An upstream answering with these statuses in turn, then 200s."""
    left = list(statuses)

    async def reply(request):
        status = left.pop(0) if left else 200
        if status == 200:
            return web.json_response(ANSWER)
        body = {"type": "error", "error": {"type": "overloaded_error", "message": f"busy {status}"}}
        return web.json_response(body, status=status, headers=headers or {})
    return reply


async def relay_for(aiohttp_server, aiohttp_client, backends, pipeline=("dedup", "pairing")):
    """A relay over in-process upstreams: ``backends`` is a list of (Upstream, backend extras)."""
    recorder = Recorder()
    entries = []
    for i, (upstream, extra) in enumerate(backends):
        server = await start_upstream(aiohttp_server, upstream)
        entries.append({"name": extra.pop("name", f"b{i}"), "url": str(server.make_url("")),
                        "models": ["claude-*"] if i == 0 else [], **extra})
    client = await start_relay(aiohttp_client, {"pipeline": [*pipeline, "rec"], "backends": entries},
                               extra={"rec": recorder})
    return client, recorder


FAST = {"attempts": 3, "backoff": 0.01, "max_backoff": 0.05, "budget": 5}


async def test_retries_answers_the_backend_marks_retryable(aiohttp_server, aiohttp_client):
    upstream = Upstream()
    upstream.reply = scripted(529, 429)
    client, recorder = await relay_for(aiohttp_server, aiohttp_client,
                                       [(upstream, {"retries": FAST})])
    resp = await client.post("/v1/messages", json=BODY)
    assert resp.status == 200 and await resp.json() == ANSWER
    assert len(upstream.received) == 3
    assert upstream.received[0]["raw"] == upstream.received[2]["raw"]
    exchange = recorder.ended[0]
    assert [(a.backend, a.status) for a in exchange.attempts] == [("b0", 529), ("b0", 429),
                                                                  ("b0", 200)]
    assert exchange.attempts[1].waited > 0
    assert [e["action"] for e in exchange.timeline].count("retrying") == 2


async def test_no_retries_unless_configured_and_never_for_a_4xx(aiohttp_server, aiohttp_client):
    for retries, status, calls in (({}, 529, 1), (FAST, 400, 1), (FAST, 529, 3)):
        upstream = Upstream()
        upstream.reply = scripted(status, status, status, status)
        client, recorder = await relay_for(aiohttp_server, aiohttp_client,
                                           [(upstream, {"retries": retries})])
        resp = await client.post("/v1/messages", json=BODY)
        assert resp.status == status and len(upstream.received) == calls
        # Having retried already, the relay tells the client not to multiply the retries.
        assert (resp.headers.get("x-should-retry") == "false") == (calls > 1)


async def test_a_retry_after_longer_than_the_relay_waits_ends_the_retries(aiohttp_server,
                                                                         aiohttp_client):
    upstream = Upstream()
    upstream.reply = scripted(429, headers={"retry-after": "120"})
    client, _ = await relay_for(aiohttp_server, aiohttp_client, [(upstream, {"retries": FAST})])
    resp = await client.post("/v1/messages", json=BODY)
    assert resp.status == 429 and resp.headers["retry-after"] == "120"
    assert len(upstream.received) == 1


async def test_an_upstream_that_says_not_to_retry_is_not_retried(aiohttp_server, aiohttp_client):
    # The SDKs obey x-should-retry before the status (anthropic/_base_client.py
    # _should_retry); Anthropic sends it with 503s it does not want retried.
    upstream = Upstream()
    upstream.reply = scripted(503, 503, headers={"x-should-retry": "false"})
    client, recorder = await relay_for(aiohttp_server, aiohttp_client,
                                       [(upstream, {"retries": FAST})])
    resp = await client.post("/v1/messages", json=BODY)
    assert resp.status == 503 and resp.headers["x-should-retry"] == "false"
    assert len(upstream.received) == 1
    assert "retrying" not in [step["action"] for step in recorder.ended[0].timeline]


def test_backoff_grows_with_jitter_and_honours_the_upstream():
    retries = Retries(attempts=5, backoff=1, max_backoff=8)
    assert [backoff(retries, n, {}, rng=lambda: 1.0) for n in (1, 2, 3, 4, 5)] == [1, 2, 4, 8, 8]
    assert backoff(retries, 1, {}, rng=lambda: 0.0) == 0.5
    assert backoff(retries, 1, {"retry-after-ms": "250"}) == 0.25
    assert backoff(retries, 1, {"retry-after": "3"}) == 3
    assert backoff(retries, 1, {"retry-after": "30"}) is None
    # No wait asked (zero, or a date gone by) is no wait given, as the SDKs read it: their
    # own backoff, never a retry at once (anthropic/_base_client.py _calculate_retry_timeout,
    # @anthropic-ai/sdk client.js retryRequest).
    for asked in ({"retry-after": "0"}, {"retry-after-ms": "0"},
                  {"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}):
        assert backoff(retries, 2, asked, rng=lambda: 1.0) == 2, asked
    assert retry_after({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}) == 0.0
    assert retry_after({"retry-after": "soon"}) is None


async def test_connection_failures_are_retried_then_502(aiohttp_client, unused_tcp_port_factory):
    recorder = Recorder()
    port = unused_tcp_port_factory()
    client = await start_relay(aiohttp_client, {
        "pipeline": ["rec"],
        "backends": [backend(f"http://127.0.0.1:{port}", retries=FAST)]}, extra={"rec": recorder})
    resp = await client.post("/v1/messages", json=BODY)
    assert resp.status == 502 and (await resp.json())["error"]["type"] == "api_error"
    exchange = recorder.ended[0]
    assert len(exchange.attempts) == 3 and all(a.error and a.status is None
                                               for a in exchange.attempts)
    assert exchange.outcome == "upstream_unreachable"


async def test_fallback_runs_the_chain_again_with_the_fallbacks_quirks(aiohttp_server,
                                                                      aiohttp_client):
    primary, second = Upstream(), Upstream()
    primary.reply = scripted(529)
    # A history whose repeated id the primary wants unique and the fallback wants restored.
    history = {**BODY, "messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_a", "name": "Bash",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_a",
                                      "content": "1"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_a-2", "name": "Bash",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_a-2",
                                      "content": "2"}]}]}
    client, recorder = await relay_for(aiohttp_server, aiohttp_client, [
        (primary, {"name": "main", "fallbacks": ["spare"]}),
        (second, {"name": "spare", "rename": {"claude-*": "spare-model"},
                  "quirks": {"restore_original_ids": True}})])
    resp = await client.post("/v1/messages", json=history)
    assert resp.status == 200 and await resp.json() == ANSWER
    assert "toolu_a-2" in primary.received[0]["raw"].decode()
    sent = orjson.loads(second.received[0]["raw"])
    assert sent["model"] == "spare-model"
    assert sent["messages"][3]["content"][0]["id"] == "toolu_a"  # the fallback's own quirk
    exchange = recorder.ended[0]
    assert len(recorder.ended) == 1 and exchange.backend.name == "spare"
    assert [(a.backend, a.status) for a in exchange.attempts] == [("main", 529), ("spare", 200)]
    assert resp.headers["x-relay-request-id"] == exchange.id
    assert any(e["action"] == "fallback" for e in exchange.timeline)


async def test_a_fallback_the_key_may_not_use_is_skipped(aiohttp_server, aiohttp_client):
    primary, second = Upstream(), Upstream()
    primary.reply = scripted(503)
    a, b = await start_upstream(aiohttp_server, primary), await start_upstream(aiohttp_server, second)
    client = await start_relay(aiohttp_client, {
        "server": {"auth": {"keys": [{"name": "k", "key_env": "K", "backends": ["main"]}]}},
        "backends": [backend(str(a.make_url("")), name="main", fallbacks=["spare"]),
                     backend(str(b.make_url("")), name="spare", models=[])]},
        env={"K": "relay-key-0123456789abcdef"})
    resp = await client.post("/v1/messages", json=BODY,
                             headers={"x-api-key": "relay-key-0123456789abcdef"})
    assert resp.status == 503 and second.received == []


async def test_a_stream_that_breaks_after_its_first_byte_is_never_retried(aiohttp_server,
                                                                          aiohttp_client):
    upstream = Upstream()
    upstream.reply = stream_reply([STREAM[:STREAM.index(b"event: content_block_stop")]])
    client, recorder = await relay_for(aiohttp_server, aiohttp_client,
                                       [(upstream, {"retries": FAST})])
    text = await (await client.post("/v1/messages", json={**BODY, "stream": True})).read()
    assert b"event: error" in text and len(upstream.received) == 1
    assert recorder.ended[0].outcome == "stream_error"


# Anthropic under load: a 200, then this as the stream's first event, before message_start.
OPENING_ERROR = (b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error",'
                 b'"message":"Overloaded"}}\n\n')


def streams(*bodies):
    """An upstream answering each request with a 200 stream: these bodies in turn, then
    STREAM."""
    left = list(bodies)

    async def reply(request):
        return await stream_reply([left.pop(0) if left else STREAM])(request)
    return reply


async def test_a_stream_that_opens_with_overloaded_is_retried_before_any_byte_goes(
        aiohttp_server, aiohttp_client):
    upstream = Upstream()
    upstream.reply = streams(OPENING_ERROR, OPENING_ERROR.replace(b"\n", b"\r\n"))
    client, recorder = await relay_for(aiohttp_server, aiohttp_client,
                                       [(upstream, {"retries": FAST})])
    resp = await client.post("/v1/messages", json={**BODY, "stream": True})
    assert resp.status == 200 and await resp.read() == STREAM
    assert len(upstream.received) == 3
    assert resp.headers["x-should-retry"] == "false"  # the relay retried already
    exchange = recorder.ended[0]
    assert [(a.status, a.error) for a in exchange.attempts] == [
        (200, "the stream opened with overloaded_error")] * 2 + [(200, None)]
    assert [step["stands_for"] for step in exchange.noted("relay", "stream refused")] == [529] * 2
    assert exchange.outcome == "ok"


async def test_a_stream_slow_to_begin_gets_its_headers_before_its_first_event(
        aiohttp_server, aiohttp_client, monkeypatch):
    # Read for a refusal only while one would come (with the headers): the upstream holds
    # its first event until the client has its headers, which it must get meanwhile.
    monkeypatch.setattr(upstream_module, "OPENING_SECONDS", 0.05)
    gate = asyncio.Event()
    upstream = Upstream()
    upstream.reply = stream_reply([STREAM], gate=gate, hold_after=0)
    client, recorder = await relay_for(aiohttp_server, aiohttp_client,
                                       [(upstream, {"retries": FAST})])
    resp = await asyncio.wait_for(client.post("/v1/messages", json={**BODY, "stream": True}),
                                  10)
    assert resp.status == 200
    gate.set()
    assert await resp.read() == STREAM
    assert len(upstream.received) == 1 and recorder.ended[0].outcome == "ok"


async def test_a_stream_that_opens_with_overloaded_goes_to_the_fallback(aiohttp_server,
                                                                       aiohttp_client):
    primary, second = Upstream(), Upstream()
    primary.reply = streams(OPENING_ERROR)
    second.reply = streams()
    client, recorder = await relay_for(aiohttp_server, aiohttp_client, [
        (primary, {"name": "main", "fallbacks": ["spare"]}), (second, {"name": "spare"})])
    resp = await client.post("/v1/messages", json={**BODY, "stream": True})
    assert await resp.read() == STREAM
    exchange = recorder.ended[0]
    assert [(a.backend, a.status) for a in exchange.attempts] == [("main", 200), ("spare", 200)]
    assert exchange.backend.name == "spare" and exchange.outcome == "ok"


async def test_a_refused_stream_with_nothing_left_to_try_reaches_the_client_as_it_came(
        aiohttp_server, aiohttp_client):
    upstream = Upstream()
    upstream.reply = streams(OPENING_ERROR, OPENING_ERROR, OPENING_ERROR)
    client, recorder = await relay_for(aiohttp_server, aiohttp_client,
                                       [(upstream, {"retries": FAST})])
    resp = await client.post("/v1/messages", json={**BODY, "stream": True})
    assert resp.status == 200 and await resp.read() == OPENING_ERROR
    assert len(upstream.received) == 3
    exchange = recorder.ended[0]
    assert exchange.outcome == "stream_error"
    assert exchange.stream_failure.kind == "overloaded_error"


async def test_a_stream_is_never_retried_for_an_error_after_it_began_or_one_of_the_request(
        aiohttp_server, aiohttp_client):
    begun = STREAM[:STREAM.index(b"event: ping")] + OPENING_ERROR
    invalid = OPENING_ERROR.replace(b"overloaded_error", b"invalid_request_error")
    for body in (begun, invalid):
        upstream = Upstream()
        upstream.reply = streams(body)
        client, recorder = await relay_for(aiohttp_server, aiohttp_client,
                                           [(upstream, {"retries": FAST})])
        resp = await client.post("/v1/messages", json={**BODY, "stream": True})
        assert await resp.read() == body and len(upstream.received) == 1
        assert recorder.ended[0].outcome == "stream_error"


async def test_a_stream_that_breaks_before_its_first_event_ends_as_it_did_unread(
        aiohttp_server, aiohttp_client):
    # Read for its first event, the stream breaks off: the client is told as before.
    async def die(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(STREAM[:20])
        request.transport.write(b"400\r\nnot all of it")
        request.transport.close()
        return resp
    upstream = Upstream()
    upstream.reply = die
    client, recorder = await relay_for(aiohttp_server, aiohttp_client,
                                       [(upstream, {"retries": FAST})])
    resp = await client.post("/v1/messages", json={**BODY, "stream": True})
    last = (await resp.read()).rstrip(b"\n").split(b"\n\n")[-1]
    assert orjson.loads(last.split(b"data: ", 1)[1])["error"]["message"] == (
        "upstream b0's stream broke off: the upstream ended it before it was complete")
    assert len(upstream.received) == 1 and recorder.ended[0].outcome == "stream_error"


async def test_a_fallback_that_cannot_carry_the_request_is_the_one_refused(aiohttp_server,
                                                                          aiohttp_client):
    # The primary is overloaded; its fallback speaks OpenAI's format, which has no MCP servers.
    # The 400 is the fallback's, and it is that exchange's record that says so.
    primary, second = Upstream(), Upstream()
    primary.reply = scripted(529)
    client, recorder = await relay_for(aiohttp_server, aiohttp_client, [
        (primary, {"name": "main", "fallbacks": ["spare"]}),
        (second, {"name": "spare", "format": "openai"})])
    body = {**BODY, "mcp_servers": [{"type": "url", "url": "https://mcp.example/sse",
                                     "name": "m"}]}
    resp = await client.post("/v1/messages", json=body)
    error = await resp.json()
    assert resp.status == 400 and error["error"]["type"] == "invalid_request_error"
    assert "backend spare" in error["error"]["message"] and second.received == []
    assert len(recorder.ended) == 1
    exchange = recorder.ended[0]
    assert exchange.backend.name == "spare" and exchange.outcome == "rejected"
    assert resp.headers["x-relay-request-id"] == exchange.id
    assert exchange.answer is not None and exchange.answer.status == 400


async def test_a_count_that_falls_back_to_a_format_without_one_is_its_estimate(
        aiohttp_server, aiohttp_client):
    # The primary is overloaded; its fallback speaks OpenAI's format, which has no count_tokens
    # endpoint: the fallback's answer is the relay's estimate, as it is when asked first.
    primary, second = Upstream(), Upstream()
    primary.reply = scripted(529)
    client, recorder = await relay_for(aiohttp_server, aiohttp_client, [
        (primary, {"name": "main", "fallbacks": ["spare"]}),
        (second, {"name": "spare", "format": "openai"})])
    raw = orjson.dumps(BODY)
    resp = await client.post("/v1/messages/count_tokens", data=raw,
                             headers={"Content-Type": "application/json"})
    assert resp.status == 200 and resp.headers["x-relay-token-count"] == "estimate"
    assert await resp.json() == {"input_tokens": -(-len(raw) // 4)}
    assert len(primary.received) == 1 and second.received == []
    exchange = recorder.ended[-1]
    assert len(recorder.ended) == 1 and exchange.backend.name == "spare"
    assert [(a.backend, a.status) for a in exchange.attempts] == [("main", 529)]
    assert resp.headers["x-relay-request-id"] == exchange.id


class SlowFallback:
    """A plugin whose request hook takes its time for the fallback's exchange: the request's
    task, as serving cancels it when the client goes away, is ``task``."""

    def __init__(self):
        self.task = None

    @hookimpl
    async def relay_request(self, exchange):
        if exchange.backend.name == "spare":
            self.task = asyncio.current_task()
            await asyncio.sleep(30)


async def test_an_answer_a_fallback_was_being_prepared_for_is_let_go_on_a_disconnect(
        aiohttp_server, aiohttp_client):
    # The primary's 529 has come, its body not yet; the client goes away while the chain
    # prepares the fallback: the primary's answer lets its connection go.
    primary, second = Upstream(), Upstream()
    hold = asyncio.Event()

    async def overloaded(request):
        resp = web.StreamResponse(status=529, headers={"Content-Type": "application/json",
                                                       "Content-Length": "100"})
        await resp.prepare(request)
        await resp.write(b'{"type": "error", ')
        await hold.wait()
        return resp
    primary.reply = overloaded
    a, b = await start_upstream(aiohttp_server, primary), await start_upstream(aiohttp_server, second)
    recorder, slow = Recorder(), SlowFallback()
    client = await start_relay(aiohttp_client, {
        "pipeline": ["slow", "rec"],
        "backends": [backend(str(a.make_url("")), name="main", fallbacks=["spare"]),
                     backend(str(b.make_url("")), name="spare", models=[])]},
        extra={"slow": slow, "rec": recorder})
    posted = asyncio.ensure_future(client.post("/v1/messages", json=BODY))
    while slow.task is None:
        await asyncio.sleep(0.01)
    slow.task.cancel()
    while not recorder.ended:
        await asyncio.sleep(0.01)
    posted.cancel()
    assert recorder.ended[0].outcome == "client_disconnected"
    hold.set()
    connections = client.app[STATE].upstream.connections
    assert not connections._busy  # else held until the relay stops, a connection of its limit
    await client.chain.shutdown(client.config)


def test_fallbacks_must_name_other_backends():
    with pytest.raises(config_module.ConfigError, match=r"backends\[0\]\.fallbacks\[0\]"):
        config_module.parse({"backends": [backend("http://127.0.0.1:1", name="a", fallbacks=["a"])]})
    with pytest.raises(config_module.ConfigError, match=r"retries\.statuses\[0\]"):
        config_module.parse({"backends": [backend("http://127.0.0.1:1",
                                                  retries={"statuses": [404]})]})


# --- the exchange record ---------------------------------------------------------------------

async def test_every_path_is_an_exchange_the_end_hooks_see(aiohttp_server, aiohttp_client):
    upstream = Upstream()
    client, recorder = await relay_for(aiohttp_server, aiohttp_client, [(upstream, {})])
    first = await (await client.post("/v1/messages", json=BODY)).read()
    await client.post("/v1/messages", json={**BODY, "messages": []})  # refused by... nobody
    await client.get("/v1/models")
    await client.get("/v1/nothing")
    bad = {**BODY, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_x", "content": "?"}]}]}
    await client.post("/v1/messages", json=bad)
    got = [(e.endpoint, e.outcome, e.answer.status) for e in recorder.ended]
    assert got == [("messages", "ok", 200), ("messages", "ok", 200), ("passthrough", "ok", 200),
                   ("refused", "refused", 404), ("messages", "rejected", 400)]
    ok = recorder.ended[0]
    assert ok.answer.size == len(first) and ok.attempts[0].status == 200
    t = ok.timings
    assert 0 <= t.upstream_headers <= t.first_byte <= t.last_byte


async def test_stream_record_has_size_and_first_byte(aiohttp_server, aiohttp_client):
    upstream = Upstream()
    upstream.reply = stream_reply([STREAM[:100], STREAM[100:]])
    client, recorder = await relay_for(aiohttp_server, aiohttp_client, [(upstream, {})])
    text = await (await client.post("/v1/messages", json={**BODY, "stream": True})).read()
    exchange = recorder.ended[0]
    assert exchange.answer.stream and exchange.answer.size == len(text) == len(STREAM)
    assert exchange.timings.first_byte <= exchange.timings.last_byte


async def test_end_hooks_run_after_the_client_has_its_answer(aiohttp_server, aiohttp_client):
    gate = asyncio.Event()
    answered = []

    class Slow:
        @hookimpl
        async def relay_exchange_end(self, exchange):
            answered.append(exchange.answer.status)
            await gate.wait()

    upstream = Upstream()
    server = await start_upstream(aiohttp_server, upstream)
    client = await start_relay(aiohttp_client, {"pipeline": ["slow"],
                                                "backends": [backend(str(server.make_url("")))]},
                               extra={"slow": Slow()})
    for body in (BODY, {"model": 3}):
        # (A kept-alive connection would wait for the hook before its next request.)
        resp = await asyncio.wait_for(client.post("/v1/messages", json=body,
                                                  headers={"Connection": "close"}), 5)
        assert (await asyncio.wait_for(resp.read(), 5))  # the end hook is still waiting
    assert answered == [200, 400]
    gate.set()


async def test_a_streams_record_counts_its_events_while_the_access_log_is_on(
        aiohttp_server, aiohttp_client):
    upstream = Upstream()
    upstream.reply = stream_reply([STREAM[:70], STREAM[70:300], STREAM[300:]])
    client, recorder = await relay_for(aiohttp_server, aiohttp_client, [(upstream, {})])
    level = logs.access_log.level
    logs.access_log.setLevel(logging.INFO)
    try:
        await (await client.post("/v1/messages", json={**BODY, "stream": True})).read()
    finally:
        logs.access_log.setLevel(level)
    assert recorder.ended[0].answer.events == STREAM.count(b"\n\n")
    # Off, nobody reads the count: the stream's bytes are not scanned for it.
    logs.access_log.setLevel(logging.WARNING)
    try:
        await (await client.post("/v1/messages", json={**BODY, "stream": True})).read()
    finally:
        logs.access_log.setLevel(level)
    assert recorder.ended[1].answer.events is None and recorder.ended[1].answer.size


# --- what a proxy commonly gets wrong -------------------------------------------------------

async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One request as it reached a raw upstream: its head, and its Content-Length body."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    return head, await reader.readexactly(length)


async def answer_raw(writer: asyncio.StreamWriter, extra_headers: bytes = b"") -> None:
    """Answer ANSWER as it is on the wire, with ``extra_headers`` (whole lines), and close."""
    answer = orjson.dumps(ANSWER)
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + extra_headers
                 + b"Content-Length: %d\r\n\r\n%s" % (len(answer), answer))
    await writer.drain()
    writer.close()


async def test_a_clients_expect_100_continue_stays_here(aiohttp_client):
    """aiohttp answered the client's ``Expect: 100-continue`` and the relay holds the whole
    body: sent up, the header made aiohttp's client wait for a 100 that an upstream ignoring
    expectations never sends, the body held back for ever (no timeout covers that wait)."""
    received = []

    async def ignores_expectations(reader, writer):  # an HTTP/1.1 server that may do so
        received.append(await read_request(reader))
        await answer_raw(writer)

    server = await asyncio.start_server(ignores_expectations, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        client = await start_relay(aiohttp_client, {"backends": [
            {"name": "up", "url": f"http://127.0.0.1:{port}", "models": ["claude-*"],
             "timeouts": {"read": 5}}]})
        resp = await asyncio.wait_for(
            client.post("/v1/messages", json=BODY, expect100=True), 10)
        assert resp.status == 200 and await resp.json() == ANSWER
    assert b"expect" not in received[0][0].lower()
    assert orjson.loads(received[0][1]) == BODY


@pytest.mark.parametrize("encoding", ["zstd", "br"])
async def test_an_upstream_encoding_the_relay_cannot_decode_is_a_clean_502(
        aiohttp_server, aiohttp_client, encoding):
    # Neither backports.zstd nor brotli is installed: aiohttp refuses the answer's head.
    upstream = Upstream()

    async def reply(request):
        return web.Response(body=b"\x28\xb5\x2f\xfd...", content_type="application/json",
                            headers={"Content-Encoding": encoding})
    upstream.reply = reply
    server = await start_upstream(aiohttp_server, upstream)
    client = await start_relay(aiohttp_client, {"backends": [
        {"name": "up", "url": str(server.make_url("")), "models": ["claude-*"]}]})
    for resp in (await client.post("/v1/messages", json=BODY),
                 await client.get("/v1/models")):
        assert resp.status == 502 and resp.content_type == "application/json"
        error = (await resp.json())["error"]
        assert error["type"] == "api_error"
        assert error["message"].startswith("upstream up is unreachable: its answer could not "
                                           "be read (Can not decode content-encoding")


async def raw_exchange(client, data: bytes) -> bytes:
    """``data`` sent as it is on one connection, and everything the relay answered on it."""
    reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
    writer.write(data)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


async def test_a_chunked_request_body_goes_up_whole_with_its_length(aiohttp_server,
                                                                     aiohttp_client):
    upstream = Upstream()
    server = await start_upstream(aiohttp_server, upstream)
    client = await start_relay(aiohttp_client, {"backends": [
        {"name": "up", "url": str(server.make_url("")), "models": ["claude-*"]}]})
    body = orjson.dumps(BODY)
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:7], body[7:]))
    answer = await raw_exchange(client, b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                b"Connection: close\r\nContent-Type: application/json\r\n"
                                b"Transfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200 ")
    got = upstream.received[0]
    assert got["raw"] == body and got["headers"]["Content-Length"] == str(len(body))
    assert "Transfer-Encoding" not in got["headers"]


async def test_repeated_and_utf8_headers_pass_both_ways_as_sent(aiohttp_client):
    heads = []

    async def upstream(reader, writer):  # byte for byte: what went up, what comes back
        heads.append((await read_request(reader))[0])
        await answer_raw(writer, b"Set-Cookie: a=1\r\nSet-Cookie: b=2\r\nX-Up: caf\xc3\xa9\r\n")

    server = await asyncio.start_server(upstream, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        client = await start_relay(aiohttp_client, {"backends": [
            {"name": "up", "url": f"http://127.0.0.1:{port}", "models": ["claude-*"]}]})
        body = orjson.dumps(BODY)
        for method, path, sent in (("POST", "/v1/messages", body), ("GET", "/v1/models", b"")):
            answer = await raw_exchange(client, (
                f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(sent)}\r\n"
                f"anthropic-beta: a-1\r\nanthropic-beta: b-2\r\n").encode()
                + b"X-User: Ren\xc3\xa9e\r\n\r\n" + sent)
            head = answer.partition(b"\r\n\r\n")[0]
            assert b"\r\nSet-Cookie: a=1\r\nSet-Cookie: b=2\r\n" in head, path
            assert b"\r\nX-Up: caf\xc3\xa9\r\n" in head, path
            assert b"\r\nanthropic-beta: a-1\r\nanthropic-beta: b-2\r\n" in heads[-1], path
            assert b"\r\nX-User: Ren\xc3\xa9e\r\n" in heads[-1], path


async def test_head_204_and_304_on_pass_through_routes_keep_the_connection_framed(
        aiohttp_server, aiohttp_client):
    """No body, and none promised, after an answer that has none: the next answer on the
    connection is read where it begins."""
    upstream = Upstream()

    async def reply(request):
        if request.path.endswith("/empty"):
            return web.Response(status=204)
        if request.path.endswith("/same"):
            return web.Response(status=304, headers={"ETag": '"v1"'})
        return web.json_response({"data": []})
    upstream.reply = reply
    server = await start_upstream(aiohttp_server, upstream)
    client = await start_relay(aiohttp_client, {
        "server": {"passthrough": ["HEAD /v1/models", "GET /v1/files/*"]},
        "backends": [{"name": "up", "url": str(server.make_url("")), "models": ["claude-*"]}]})
    for method, path, status in (("HEAD", "/v1/models", b"200"),
                                 ("GET", "/v1/files/empty", b"204"),
                                 ("GET", "/v1/files/same", b"304")):
        answer = await raw_exchange(
            client, f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
                    f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
                    .encode())
        first, _, rest = answer.partition(b"\r\n\r\n")
        assert first.startswith(b"HTTP/1.1 " + status), path
        assert b"transfer-encoding" not in first.lower(), path
        assert rest.startswith(b"HTTP/1.1 200 OK\r\n") and b'{"status": "ok"' in rest, path
    assert [r["method"] for r in upstream.received] == ["HEAD", "GET", "GET"]


async def test_a_coding_aiohttp_leaves_encoded_keeps_its_header(aiohttp_server, aiohttp_client):
    """aiohttp decodes gzip, deflate (and br, zstd with their libraries) and nothing else: a
    body in another coding, or in two, comes through as sent, and so must its header."""
    upstream = Upstream()
    encoded = b"\x1f\x8b not decoded by anyone here"

    async def reply(request):
        coding = request.headers["X-Coding"]
        return web.Response(body=encoded, content_type="application/json",
                            headers={"Content-Encoding": coding})
    upstream.reply = reply
    server = await start_upstream(aiohttp_server, upstream)
    client = await start_relay(aiohttp_client, {"backends": [
        {"name": "up", "url": str(server.make_url("")), "models": ["claude-*"]}]})
    for coding in ("x-custom", "gzip, x-custom"):
        for resp in (await client.get("/v1/models", headers={"X-Coding": coding},
                                      auto_decompress=False),
                     await client.post("/v1/messages", json=BODY, headers={"X-Coding": coding},
                                       auto_decompress=False)):
            assert resp.status == 200 and await resp.read() == encoded
            assert resp.headers["Content-Encoding"] == coding
