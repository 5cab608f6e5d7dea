"""The benchmark's upstream: as fast as aiohttp allows, canned answers, no validation.

    python tests/bench/mock_upstream.py [--port 0]

prints ``mock listening on http://127.0.0.1:PORT``. ``POST /v1/messages`` reads the body and,
by query string only (the body is never parsed):

- ``mock=json`` (default): a canned non-streaming message;
- ``mock=sse&events=N[&per_send=K][&gap_ms=G]``: a canned stream of N events, one send per
  event (or per K events), no delay (or G ms between sends: streams that stay open, for the
  load runner);
- ``mock=idle&hold=S``: the headers and ``message_start``, then nothing until the client
  goes away or S seconds (default 30) have passed;
- ``mock=thinking&seq=N`` (``mock=thinking_sse&seq=N`` streamed): answer N of a kind, a
  thinking block with its own signature, a text and a tool call with its own id;
- ``sha=1`` with any of them: the answer carries ``x-bench-sha256`` and ``x-bench-bytes`` of
  the body exactly as received.

``POST /v1/chat/completions`` gives the same answers as an OpenAI-format server (the relay's
``format: openai`` backends), chosen by the ``x-bench-mock`` header.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import os
import sys
import urllib.parse

from aiohttp import web

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import procs  # noqa: E402
import workloads  # noqa: E402

JSON_HEADERS = {"content-type": "application/json", "request-id": "req_bench_mock"}
SSE_HEADERS = {"content-type": "text/event-stream", "cache-control": "no-cache",
               "request-id": "req_bench_mock"}
MAX_HOLD = 120.0


async def messages(request: web.Request) -> web.StreamResponse:
    raw = await request.read()
    query = request.query
    extra = None
    if "sha" in query:
        extra = {"x-bench-sha256": hashlib.sha256(raw).hexdigest(), "x-bench-bytes": str(len(raw))}
    if query.get("mock", "").startswith("thinking"):
        return await thinking(request, query, workloads.thinking_answer,
                              workloads.thinking_events)
    return await answer(request, query, extra, workloads.ANSWER, framed_stream,
                        workloads.MESSAGE_START,
                        workloads.event("message_stop", {"type": "message_stop"}))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """The same answers in OpenAI's Chat Completions format. The relay sends no query string
    to such a backend, so the answer is chosen by the ``x-bench-mock`` header (the query the
    load generator would have sent)."""
    await request.read()
    query = dict(urllib.parse.parse_qsl(request.headers.get("x-bench-mock", "")))
    if query.get("mock", "").startswith("thinking"):
        return await thinking(request, query, workloads.chat_thinking_answer,
                              workloads.chat_thinking_chunks)
    return await answer(request, query, None, workloads.CHAT_ANSWER, framed_chat_stream,
                        workloads.chat_chunk({"role": "assistant", "content": ""}),
                        b"data: [DONE]\n\n")


async def thinking(request, query, json_answer, events) -> web.StreamResponse:
    seq = int(query.get("seq", "0"))
    mode = "sse" if query["mock"] == "thinking_sse" else "json"
    return await answer(request, {"mock": mode}, None, json_answer(seq),
                        lambda n, per_send: _framed(events(seq), 1), b"", b"")


async def answer(request, query, extra, json_answer: bytes, framed, first_event: bytes,
                 last_event: bytes) -> web.StreamResponse:
    mode = query.get("mock", "json")
    if mode == "json":
        return web.Response(body=json_answer,
                            headers={**JSON_HEADERS, **extra} if extra else JSON_HEADERS)
    response = web.StreamResponse(headers={**SSE_HEADERS, **extra} if extra else SSE_HEADERS)
    await response.prepare(request)
    if mode == "sse":
        first, rest = framed(int(query.get("events", "50")), int(query.get("per_send", "1")))
        await response.write(first)  # the headers and the first event go out together
        # One send per event, already framed as an HTTP chunk: what aiohttp's write() would
        # do, at half the mock's CPU, so that the mock is not what limits a streaming run.
        gap = float(query.get("gap_ms", "0")) / 1000
        transport = request.transport
        for chunk in rest:
            if gap:
                await asyncio.sleep(gap)
            if transport is None or transport.is_closing():
                return response
            transport.write(chunk)
        await response.write_eof()
        return response
    if mode == "idle":
        await response.write(first_event)
        hold = min(float(query.get("hold", "30")), MAX_HOLD)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + hold
        while loop.time() < deadline:
            transport = request.transport
            if transport is None or transport.is_closing():
                return response
            await asyncio.sleep(0.2)
        try:
            await response.write(last_event)
            await response.write_eof()
        except (ConnectionError, RuntimeError):
            pass
        return response
    raise web.HTTPBadRequest(text=f"unknown mock mode {mode!r}")


def _framed(events: tuple, per_send: int) -> tuple[bytes, tuple[bytes, ...]]:
    groups = [b"".join(events[i:i + per_send]) for i in range(1, len(events), per_send)]
    return events[0], tuple(b"%x\r\n%s\r\n" % (len(g), g) for g in groups)


@functools.cache
def framed_stream(n: int, per_send: int = 1) -> tuple[bytes, tuple[bytes, ...]]:
    """The first event, and the others ``per_send`` at a time as HTTP/1.1 chunks."""
    return _framed(workloads.sse_events(n), per_send)


@functools.cache
def framed_chat_stream(n: int, per_send: int = 1) -> tuple[bytes, tuple[bytes, ...]]:
    return _framed(workloads.chat_chunks(n), per_send)


async def count_tokens(request: web.Request) -> web.Response:
    await request.read()
    return web.Response(body=b'{"input_tokens":21}', content_type="application/json")


def make_app() -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    app.router.add_post("/v1/chat/completions", chat_completions)
    return app


async def serve(host: str, port: int) -> None:
    await procs.serve_app(web.AppRunner(make_app(), access_log=None), "mock", host, port)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    # Build the canned streams before the first request is timed.
    for n in (50, 2000):
        framed_stream(n)
        framed_chat_stream(n)
    try:
        asyncio.run(serve(args.host, args.port))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
