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
- ``sha=1`` with any of them: the answer carries ``x-bench-sha256`` and ``x-bench-bytes`` of
  the body exactly as received.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import os
import sys

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
    mode = query.get("mock", "json")
    extra = None
    if "sha" in query:
        extra = {"x-bench-sha256": hashlib.sha256(raw).hexdigest(), "x-bench-bytes": str(len(raw))}
    if mode == "json":
        return web.Response(body=workloads.ANSWER,
                            headers={**JSON_HEADERS, **extra} if extra else JSON_HEADERS)
    response = web.StreamResponse(headers={**SSE_HEADERS, **extra} if extra else SSE_HEADERS)
    await response.prepare(request)
    if mode == "sse":
        first, rest = framed_stream(int(query.get("events", "50")), int(query.get("per_send", "1")))
        await response.write(first)  # the headers and message_start go out together
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
        await response.write(workloads.MESSAGE_START)
        hold = min(float(query.get("hold", "30")), MAX_HOLD)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + hold
        while loop.time() < deadline:
            transport = request.transport
            if transport is None or transport.is_closing():
                return response
            await asyncio.sleep(0.2)
        try:
            await response.write(workloads.event("message_stop", {"type": "message_stop"}))
            await response.write_eof()
        except (ConnectionError, RuntimeError):
            pass
        return response
    raise web.HTTPBadRequest(text=f"unknown mock mode {mode!r}")


@functools.lru_cache(maxsize=None)
def framed_stream(n: int, per_send: int = 1) -> tuple[bytes, tuple[bytes, ...]]:
    """The first event, and the others ``per_send`` at a time as HTTP/1.1 chunks."""
    events = workloads.sse_events(n)
    groups = [b"".join(events[i:i + per_send]) for i in range(1, len(events), per_send)]
    return events[0], tuple(b"%x\r\n%s\r\n" % (len(g), g) for g in groups)


async def count_tokens(request: web.Request) -> web.Response:
    await request.read()
    return web.Response(body=b'{"input_tokens":21}', content_type="application/json")


def make_app() -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
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
    try:
        asyncio.run(serve(args.host, args.port))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
