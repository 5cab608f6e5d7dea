"""Pass-through routes (``server.passthrough``): a request the relay does not read, sent to
the default backend as it came, its answer relayed as it comes, unless the backend's format
adapter reads pass-through answers whole to translate them (the model list, errors)."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
from aiohttp import web

from .errors import RelayError, let_go
from .exchange import Answer, Exchange, Outcome, UpstreamAnswer
from .redact import StreamRedactor
from .respond import deliver, refuse, refuse_redirect, unreachable
from .upstream import (
    Reply,
    Unreachable,
    UpstreamTooLarge,
    client_headers,
    read_capped,
    redirects,
)

log = logging.getLogger("relay")


async def relay_passthrough(state, request: web.Request, exchange: Exchange,
                            read_body) -> web.StreamResponse:
    """Send ``exchange`` (a pass-through) upstream and answer the client. ``state`` is the
    server's (its config and upstream seam); ``read_body(request, limit, timeout)`` reads
    the client's body the way the server reads every body."""
    backend = exchange.backend
    try:
        raw = None
        if request.can_read_body:
            raw = exchange.raw_body = await read_body(
                request, state.config.max_body_bytes, state.config.body_timeout)
        upstream = await state.upstream.send(exchange, backend, body=raw)
    except RelayError as error:
        return await refuse(request, exchange, error, Outcome.REJECTED, close=True)
    except Unreachable as e:
        try:
            return await unreachable(request, exchange, e.__cause__ or e)
        finally:
            let_go(e)
    async with upstream:
        if redirects(upstream.status):
            return await refuse_redirect(request, exchange, upstream)
        if backend.adapter.reads_passthrough:
            return await _translated(state, request, exchange, upstream)
        if upstream.status >= 300:
            exchange.outcome = Outcome.UPSTREAM_ERROR
        secrets = backend.secrets
        response = web.StreamResponse(status=upstream.status,
                                      headers=client_headers(upstream.headers, None, secrets))
        answer = exchange.answer = Answer(response.status, response.headers)
        await response.prepare(request)
        exchange.timings.first_byte = exchange.elapsed()
        redactor = StreamRedactor(secrets) if secrets else None
        try:
            async for chunk in upstream.content.iter_any():
                if redactor is not None:
                    chunk = redactor.feed(chunk)
                answer.size += len(chunk)
                await response.write(chunk)
            if redactor is not None:
                chunk = redactor.close()
                answer.size += len(chunk)
                await response.write(chunk)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            let_go(e)  # the upstream's reader keeps it, and its traceback this frame
            # Headers are gone already: closing without the final chunk is how HTTP says
            # the body is incomplete.
            log.warning("passthrough %s from %s broke off: %r", exchange.path,
                        backend.name, e)
            exchange.outcome = Outcome.STREAM_ERROR
            if request.transport is not None:
                request.transport.close()
            return response
        await response.write_eof()
        exchange.timings.last_byte = exchange.elapsed()
        return response


async def _translated(state, request: web.Request, exchange: Exchange,
                      upstream: Reply) -> web.Response:
    """A pass-through answer the format adapter translates: the model list in Anthropic's
    shape, errors in Anthropic's format, anything else as it came."""
    try:
        payload = await read_capped(upstream, state.config.max_upstream_body_bytes)
    except (aiohttp.ClientError, asyncio.TimeoutError, UpstreamTooLarge) as e:
        return await unreachable(request, exchange, e)
    exchange.upstream_response = UpstreamAnswer(upstream.status, upstream.headers, payload)
    adapter = exchange.backend.adapter
    headers = client_headers(upstream.headers)
    if upstream.status >= 300:
        exchange.outcome = Outcome.UPSTREAM_ERROR
        translated = adapter.error_body(upstream.status, payload, exchange.id)
        if translated is not None:
            payload = translated
            headers["Content-Type"] = "application/json"
    elif exchange.path.startswith("/v1/models"):
        try:
            payload = adapter.model_list(payload, exchange.backend.name)
        except RelayError as error:
            exchange.response_headers["x-relay-request-id"] = exchange.id
            return await refuse(request, exchange, error, Outcome.UPSTREAM_MALFORMED)
    return await deliver(request, exchange, web.Response(
        status=upstream.status, body=payload, headers=headers))
