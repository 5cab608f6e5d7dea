"""The yardstick: a bare aiohttp pass-through, with no parsing and no plugins.

    python tests/bench/bare_proxy.py --upstream http://127.0.0.1:PORT [--port 0] [--skeleton]

prints ``bare listening on http://127.0.0.1:PORT``. Every request is forwarded to the same
path and query upstream (hop-by-hop headers dropped, the body as read), and the answer is
streamed back chunk by chunk as it arrives. Its client session is configured like the
relay's, so the two differ only in what the relay does on top.

With ``--skeleton`` it also decodes each request body as the relay does
(``relay.skeleton.decode``) and throws the result away: the least any relay that checks a
history pays, measured apart from the plugins.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

import aiohttp
from aiohttp import web

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import procs  # noqa: E402

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
    "te", "trailer", "trailers", "transfer-encoding", "upgrade",
    "host", "content-length", "content-encoding", "accept-encoding",
})
SESSION = web.AppKey("session", aiohttp.ClientSession)


def make_app(upstream: str, decode=None) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)

    async def forward(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        if decode is not None:
            decode(raw)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        async with app[SESSION].request(request.method, upstream + request.path_qs, data=raw,
                                        headers=headers) as answer:
            response = web.StreamResponse(status=answer.status, headers={
                k: v for k, v in answer.headers.items() if k.lower() not in HOP_BY_HOP})
            await response.prepare(request)
            async for chunk in answer.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def session_context(app):
        app[SESSION] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=512, limit_per_host=0),
            cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=True,
            skip_auto_headers=("User-Agent",))
        yield
        await app[SESSION].close()

    app.cleanup_ctx.append(session_context)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


async def serve(upstream: str, host: str, port: int, skeleton: bool) -> None:
    decode = None
    if skeleton:
        from relay.skeleton import decode
    runner = web.AppRunner(make_app(upstream.rstrip("/"), decode), handler_cancellation=True,
                           access_log=None)
    await procs.serve_app(runner, "bare", host, port)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--skeleton", action="store_true",
                        help="also decode each request body as the relay does")
    args = parser.parse_args()
    try:
        asyncio.run(serve(args.upstream, args.host, args.port, args.skeleton))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
