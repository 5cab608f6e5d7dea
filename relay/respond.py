"""The relay's own answers: one function (:func:`refuse`) answers every error the relay
makes, in Anthropic's format, and sets the exchange's outcome; :func:`deliver` sends any
complete answer, with none of the backend's credentials in it."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping

import aiohttp
from aiohttp import web

from . import logs
from .errors import RelayError, let_go
from .exchange import Answer, Exchange, Outcome, UpstreamAnswer
from .pools import Exhausted
from .redact import redact, redact_headers, redact_text
from .upstream import PoolFull, Reply, UpstreamTooLarge, redirect_refused

log = logging.getLogger("relay")
access_log = logs.access_log

# How long, and how much, the relay reads on of a body still coming when it answered without
# reading it (a refusal), before it closes the connection.
LINGER_SECONDS = 5.0
LINGER_IDLE = 1.0  # a client that sends nothing for this long is not sending
LINGER_BYTES = 16 * 1024 * 1024


def relay_error(error: RelayError, request_id: str | None = None,
                headers: Mapping[str, str] | None = None, close: bool = False) -> web.Response:
    """The relay's own answer, in Anthropic's format. The id is in the body and, as the API
    sends it, in ``request-id``: the header is where the SDKs read ``request_id``."""
    response = web.Response(status=error.status, body=error.body(request_id),
                            content_type="application/json", headers=headers)
    if request_id:
        response.headers["request-id"] = request_id
    if close:
        response.force_close()
    return response


async def refuse(request: web.Request, exchange: Exchange, error: RelayError,
                 outcome: Outcome | None = None, close: bool = False) -> web.Response:
    """Answer ``exchange`` with an error of the relay's own making, now: the one place that
    sets the outcome of such an exchange (``outcome``, by default ``rejected`` for a 4xx
    and ``relay_error`` for a 5xx) and its ``error``. ``close`` closes the connection after
    it (what is left of a body the relay refused is not worth reading)."""
    if outcome is None:
        exchange.outcome = Outcome.REJECTED if error.status < 500 else Outcome.RELAY_ERROR
    else:
        exchange.outcome = Outcome(outcome)
    exchange.error = error
    return await deliver(request, exchange, relay_error(
        error, exchange.id, exchange.response_headers, close=close))


async def deliver(request: web.Request, exchange: Exchange,
                  response: web.Response) -> web.Response:
    """Send a complete answer now, recording it on the exchange, so that whatever runs after
    (the end hooks) runs once the client has it. None of the backend's credentials go with
    it (see :mod:`relay.redact`)."""
    secrets = exchange.backend.secrets if exchange.backend is not None else ()
    if secrets:
        body = response.body
        if body and isinstance(body, bytes):
            redacted = redact(body, secrets)
            if redacted is not body:
                response.body = redacted
        redact_headers(response.headers, secrets)
    body = response.body
    exchange.answer = Answer(response.status, response.headers,
                             len(body) if isinstance(body, bytes) else 0)
    try:
        await response.prepare(request)
        exchange.timings.first_byte = exchange.elapsed()
        await response.write_eof()
    except ConnectionError:
        # The client hung up first (in the middle of its body, say): no fault of the
        # relay's, and not worth a traceback in the log, which any client could have it
        # write once a request. The exchange still ends as every other does.
        exchange.outcome = Outcome.CLIENT_DISCONNECTED
        return response
    exchange.timings.last_byte = exchange.elapsed()
    if response.keep_alive is False and request.protocol is not None:
        if response.status != 408:  # a body that stalled is not coming
            await linger(request)
        # Closed by the relay, not by aiohttp: it would read on through what is left of a
        # body the relay refused (and trip over it again if it cannot be decoded).
        request.protocol.force_close()
    return response


async def linger(request: web.Request) -> None:
    """Read and throw away what a client is still sending of a body the relay answered
    without reading, for a few seconds and megabytes at most. Closed at once, the
    connection would answer the client's next writes with a reset, which may erase the
    answer before the client reads it, and clients that fail on a write report that instead
    (RFC 9112, section 9.6, "Tear-down": servers close "in stages", reading on after their
    answer). Any fault in what is read (an encoding that cannot be decoded, a broken chunk)
    ends it: nothing of it is kept."""
    if not request.can_read_body:
        return
    content = request.content
    if content.is_eof() or content.exception() is not None:
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + LINGER_SECONDS
    left = LINGER_BYTES
    while left > 0:
        wait = min(LINGER_IDLE, deadline - loop.time())
        if wait <= 0:
            return
        try:
            chunk = await asyncio.wait_for(content.readany(), wait)
        except Exception:  # noqa: BLE001 - a timeout, a reset, a body that cannot be read
            return
        if not chunk:
            return
        left -= len(chunk)


async def refuse_redirect(request: web.Request, exchange: Exchange,
                          upstream: Reply) -> web.Response:
    """Answer an upstream's redirect (:func:`relay.upstream.redirects`) with the relay's 502,
    its ``Location`` kept from the client: the log and the exchange's timeline say where it
    pointed, for the operator."""
    backend = exchange.backend
    location = redact_text(upstream.headers.get("Location", ""), backend.secrets)
    if exchange.upstream_response is None:
        exchange.upstream_response = UpstreamAnswer(upstream.status, upstream.headers)
    exchange.note("relay", "redirect refused", status=upstream.status, location=location)
    log.warning("%s: upstream %s answered HTTP %d, a redirect to %r, not followed",
                exchange.id, backend.name, upstream.status, location)
    exchange.response_headers["x-relay-request-id"] = exchange.id
    return await refuse(request, exchange, redirect_refused(backend, upstream),
                        Outcome.UPSTREAM_ERROR)


async def unreachable(request: web.Request, exchange: Exchange,
                      e: BaseException) -> web.Response:
    """The answer when the upstream could not be reached, went silent or sent more than the
    relay takes: what the library said goes to the log, plain words to the client."""
    if isinstance(e, Exhausted):  # every credential of a pool is cooling or out
        log.info("%s: %s", exchange.id, e.error.message)
        return await refuse(request, exchange, e.error, Outcome.REJECTED if e.error.status < 500
                            else Outcome.UPSTREAM_UNREACHABLE)
    error = upstream_failure(exchange.backend, e)
    log.warning("%s: %s (%s)", exchange.id, error.message, f"{type(e).__name__} {e}".rstrip())
    let_go(e)  # a broken connection or reader keeps it, and its traceback their frames
    return await refuse(request, exchange, error, Outcome.POOL_FULL if isinstance(e, PoolFull)
                        else Outcome.UPSTREAM_UNREACHABLE)


def upstream_failure(backend, e: BaseException) -> RelayError:
    """The relay's own answer when the upstream could not be reached, went silent or sent
    more than the relay takes."""
    if isinstance(e, UpstreamTooLarge):
        return RelayError(502, f"upstream {backend.name} answered with more than the relay's "
                               f"limit of {e.args[0]} bytes (server.max_upstream_body_bytes)",
                          "api_error")
    if isinstance(e, PoolFull):  # the relay is at capacity; the upstream was never asked
        return RelayError(529, f"the relay is at capacity: {e}; request not sent to upstream "
                               f"{backend.name}", "overloaded_error")
    # In plain words; what the library said is in the attempt's record and the log.
    name, timeouts = backend.name, backend.timeouts
    proxy = backend.proxy
    if proxy is not None and isinstance(e, (aiohttp.ClientHttpProxyError,
                                            aiohttp.ClientConnectorError)):
        return RelayError(502, f"upstream {name} is unreachable: {proxy_failure(proxy, e)}",
                          "api_error")
    if isinstance(e, asyncio.TimeoutError):
        if isinstance(e, aiohttp.ConnectionTimeoutError):
            why = f"no connection within {timeouts.connect:g} s (its timeouts.connect)"
        elif isinstance(e, aiohttp.ServerTimeoutError):
            why = f"nothing came for more than {timeouts.read:g} s (its timeouts.read)"
        elif timeouts.total is not None:
            why = f"no answer within {timeouts.total:g} s (its timeouts.total)"
        else:
            why = "no answer in time"
        return RelayError(504, f"upstream {name} timed out: {why}", "timeout_error")
    if isinstance(e, aiohttp.ClientConnectorError):
        code = getattr(e.os_error, "errno", None)  # asyncio's own text names the call
        why = f"could not connect to {e.host}:{e.port}" + (
            f" ({os.strerror(code).lower()})" if code else "")
    elif isinstance(e, aiohttp.ServerDisconnectedError):
        why = "it closed the connection without answering"
    elif isinstance(e, aiohttp.ClientPayloadError):
        why = "it ended its answer before it was complete"
    elif isinstance(e, aiohttp.ClientResponseError):
        said = e.message.splitlines()[0][:200] if e.message else str(e.status)
        why = f"its answer could not be read ({said})"
    else:
        why = "the connection failed"
    return RelayError(502, f"upstream {name} is unreachable: {why}", "api_error")


def proxy_failure(proxy, e: aiohttp.ClientHttpProxyError | aiohttp.ClientConnectorError) -> str:
    """What went wrong between the relay and a backend's egress proxy (``proxy.url`` never
    holds its credentials), or at the backend behind it."""
    if isinstance(e, aiohttp.ClientHttpProxyError):
        why = f"its proxy {proxy.url} refused to forward the request ({e.status} {e.message[:200]})"
        return why + (": check the proxy's user and password" if e.status == 407 else "")
    code = getattr(e.os_error, "errno", None)
    reason = f" ({os.strerror(code).lower()})" if code else ""
    if isinstance(e, aiohttp.ClientProxyConnectionError) \
            or ((e.host or "").lower(), e.port) == (proxy.host.lower(), proxy.port):
        return f"could not connect to its proxy {proxy.url}{reason}"
    return f"could not connect to {e.host}:{e.port}{reason}"


def log_exchange(exchange: Exchange, status: int | None) -> None:
    """One line per exchange (``server.access_log``): what an operator greps for first, the
    id naming any dump; every field escaped and capped (see :mod:`relay.logs`). Off by
    default: a log record costs more than the relay's own work on a small request."""
    if access_log.isEnabledFor(logging.INFO):
        logs.log_access(logs.access_fields(exchange, status))
