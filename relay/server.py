"""The aiohttp server: accept a Messages API request, run the chain, relay the answer."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal

import aiohttp
import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from . import __version__, betas, lifecycle, logs, skeleton, threads
from .chain import Chain
from .config import Backend, InboundKey
from .errors import RelayError, invalid_request
from .exchange import Answer, Exchange, Outcome, UpstreamAnswer, UpstreamResponse
from .formats import openai
from .inbound import (AdminGate, AdminRoute, Gate, check_target, forbidden, host_allowed,
                      is_json, split_target)
from .listen import Listener
from .skeleton import Skeleton
from .redact import StreamRedactor, redact, redact_headers, redacting_writer
from .stream import KeepAlive, StreamBroken, StreamRelay, error_event
from .upstream import PoolFull, Unreachable, Upstream, client_headers

log = logging.getLogger("relay")
access_log = logs.access_log

ENDPOINTS = {"/v1/messages": "messages", "/v1/messages/count_tokens": "count_tokens"}
# Longer than any model name a backend serves; a client's longer name is refused, not routed
# (and not cached).
MAX_MODEL_CHARS = 256

STATE = web.AppKey("relay_state", "RelayState")


class RelayState:
    """What the server needs for every request, built once at start-up."""

    def __init__(self, config, chain: Chain):
        self.config = config
        self.chain = chain
        self.gate = Gate(config.keys) if config.keys is not None else None
        # With auth on, what a client presents is a relay key: it never goes upstream.
        self.upstream = Upstream(config, strip_client_auth=self.gate is not None)
        self.threads = threads.Store()


def relay_error(error: RelayError, request_id: str | None = None, headers=None,
                close: bool = False) -> web.Response:
    """The relay's own answer, in Anthropic's format. The id is in the body and, as the API
    sends it, in ``request-id``: the header is where the SDKs read ``request_id``."""
    response = web.Response(status=error.status, body=error.body(request_id),
                            content_type="application/json", headers=headers)
    if request_id:
        response.headers["request-id"] = request_id
    if close:
        response.force_close()
    return response


async def read_body(request: web.Request, limit: int, timeout: float | None = None) -> bytes:
    """The whole request body, decoded; a body that can't be read is the client's 4xx. A
    declared length over the limit is refused before a byte of the body is read."""
    if request.content_length is not None and request.content_length > limit:
        raise too_large(limit)
    try:
        if timeout is None or request.content.is_eof():  # all here already: no timer needed
            return await request.read()
        return await asyncio.wait_for(request.read(), timeout)
    except web.HTTPRequestEntityTooLarge:
        raise too_large(limit) from None
    except asyncio.TimeoutError:
        raise RelayError(408, f"request body not received within {timeout:g} s",
                         "timeout_error") from None
    except RequestPayloadError as e:
        cause = e.__cause__ or e
        reason = getattr(cause, "message", None) or str(cause).strip()
        raise invalid_request(f"request body could not be read: {reason}") from None


class UpstreamTooLarge(Exception):
    """An upstream answer longer than ``server.max_upstream_body_bytes`` (decoded)."""


async def read_capped(upstream, limit: int) -> bytes:
    """A whole upstream body, decompressed, but never more than ``limit`` bytes of it."""
    if upstream.content_length is not None and upstream.content_length > limit \
            and "Content-Encoding" not in upstream.headers:
        raise UpstreamTooLarge(limit)
    parts = []
    size = 0
    async for chunk in upstream.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise UpstreamTooLarge(limit)
        parts.append(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def upstream_failure(backend, e: BaseException) -> RelayError:
    """The relay's own answer when the upstream could not be reached, went silent or sent
    more than the relay takes."""
    if isinstance(e, UpstreamTooLarge):
        return RelayError(502, f"upstream {backend.name} answered with more than the relay's "
                               f"limit of {e.args[0]} bytes (server.max_upstream_body_bytes)",
                          "api_error")
    if isinstance(e, PoolFull):  # the relay is at capacity; the upstream was never asked
        return RelayError(503, f"the relay is at capacity: {e}; request not sent to upstream "
                               f"{backend.name}", "overloaded_error")
    # In plain words; what the library said is in the attempt's record and the log.
    name, timeouts = backend.name, backend.timeouts
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
    else:
        why = "the connection failed"
    return RelayError(502, f"upstream {name} is unreachable: {why}", "api_error")


def stream_break(backend, e: BaseException) -> str:
    """What a client is told when an upstream stream stops short, in plain words: the
    library's own account (``ClientPayloadError ... TransferEncodingError: 400, message='Not
    enough data ...'``, where the 400 is no HTTP status) is for the log and the dump."""
    if isinstance(e, aiohttp.ServerTimeoutError):
        why = (f"nothing came for more than {backend.timeouts.read:g} s (its timeouts.read), "
               f"so the relay ended it")
    elif isinstance(e, asyncio.TimeoutError) and backend.timeouts.total is not None:
        why = f"it did not finish within {backend.timeouts.total:g} s (its timeouts.total)"
    elif isinstance(e, StreamBroken):
        why = str(e)
    else:
        why = "the upstream ended it before it was complete"
    return f"upstream {backend.name}'s stream broke off: {why}"


def too_large(limit: int) -> RelayError:
    return RelayError(413, f"request body exceeds the relay's limit of {limit} bytes",
                      "request_too_large")


def parse_request(raw: bytes) -> Skeleton | dict:
    """The request body as a skeleton (see :mod:`relay.skeleton`), or when it cannot be one,
    fully parsed, or a 400 that says what is wrong with it."""
    if not raw:
        raise invalid_request("request body is empty: expected a JSON object")
    found = skeleton.decode(raw)
    if found is not None:
        return found
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise invalid_request(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise invalid_request("request body must be a JSON object")
    if "messages" not in body:
        raise invalid_request("messages: Field required")
    if not isinstance(body["messages"], list):
        raise invalid_request("messages: Input should be a valid list")
    if not isinstance(body.get("model"), str):
        raise invalid_request("model: Field required" if "model" not in body
                              else "model: Input should be a valid string")
    return body


def log_exchange(exchange: Exchange, status: int | None) -> None:
    """One line per exchange (``server.access_log``): what an operator greps for first, the
    id naming any dump; every field escaped and capped (see :mod:`relay.logs`). Off by
    default: a log record costs more than the relay's own work on a small request."""
    if access_log.isEnabledFor(logging.INFO):
        logs.log_access(logs.access_fields(exchange, status))


async def prepare_exchange(state: RelayState, *, method: str, path: str, query: str,
                           headers, raw_body: bytes, key: InboundKey | None = None,
                           backend: Backend | None = None) -> Exchange:
    """Parse, route and run the request chain: everything before the upstream is called.

    ``key`` is the inbound key the client authenticated with, if auth is on: a backend or
    model it may not use is refused here. ``backend`` overrides routing (a fallback). Raises
    RelayError for a request the client must be refused; the exchange it was refused in is
    attached as ``error.exchange`` (when one was built) so the end hooks can see it.
    """
    endpoint = ENDPOINTS[path]
    parsed = parse_request(raw_body)
    if type(parsed) is dict:
        exchange = Exchange(endpoint=endpoint, method=method, path=path, query=query,
                            headers=headers, raw_body=raw_body, body=parsed)
    else:
        exchange = Exchange(endpoint=endpoint, method=method, path=path, query=query,
                            headers=headers, raw_body=raw_body, skeleton=parsed)
    exchange.key_name = key.name if key is not None else None
    exchange.response_headers["x-relay-request-id"] = exchange.id

    def refused(error: RelayError) -> RelayError:
        error.exchange = exchange
        return error

    model = exchange.model
    if len(model) > MAX_MODEL_CHARS:
        raise refused(invalid_request(
            f"model: String should have at most {MAX_MODEL_CHARS} characters"))
    if backend is None:
        backend = state.config.backend_for(model)
    exchange.backend = backend
    if backend is None:
        raise refused(RelayError(
            404, f"model: {model} (no backend in the relay's configuration serves it)",
            "not_found_error"))
    if key is not None and not key.may_use(backend, model):
        raise refused(forbidden(key, f"model {model!r} (backend {backend.name})"))
    target = backend.upstream_model(model)
    if target is not None and target != model:
        exchange.set_model(target)
        exchange.note("relay", "renamed model", model=model, upstream_model=target)
    try:
        prepare_history(state, exchange)
        await state.chain.run("relay_request", exchange)
        threads.restore_held_ids(exchange)
        # Encoded here, where a request that cannot be is still answered in Anthropic's
        # format.
        try:
            exchange.release_body(exchange.upstream_body())
        except RecursionError:  # nested deeper than the encoder goes (the parse went deeper)
            raise invalid_request("request body is nested too deeply to be re-encoded") from None
        except Exception:
            log.exception("%s: the changed request could not be encoded", exchange.id)
            raise
    except RelayError as error:
        raise refused(error)
    except Exception as e:  # logged by the chain with the plugin's name, or above
        raise refused(RelayError(500, "the relay failed while preparing this request",
                                 "api_error")) from e
    return exchange


def prepare_history(state: RelayState, exchange: Exchange) -> None:
    """What the history rules must know before they run: the betas and fields they defer to
    the upstream for (:mod:`relay.betas`), and the server-held thread the request belongs
    to (:mod:`relay.threads`; a backend that holds none refuses it here)."""
    deferring = betas.deferring(exchange.client_headers, exchange.other_fields())
    if deferring:
        exchange.rules_defer = deferring
        exchange.note("relay", "history rules defer", reasons=betas.described(deferring))
        exchange.flag("history-rules-deferred")
    if exchange.endpoint == "messages":
        threads.prepare(state.threads, exchange)


async def stream_failed(exchange: Exchange, response: web.StreamResponse, message: str,
                        kind: str = "api_error", detail: str | None = None) -> None:
    """End a stream whose headers are gone with an ``error`` event, so the client knows it is
    cut short. Bounded: a client that does not read cannot hold the relay here. ``detail``
    (what the library said) goes to the timeline, and so the dump, not to the client."""
    exchange.outcome = Outcome.STREAM_ERROR
    exchange.stream_failed(message, kind, detail)
    try:
        await asyncio.wait_for(response.write(error_event(message, kind)), 5)
    except Exception as e:  # the client is gone or stuck; nothing more to tell it
        log.info("%s: could not deliver the stream's error event: %r", exchange.id, e)


def not_allowed(method: str, path: str) -> RelayError:
    return RelayError(405, f"Method {method} is not allowed for {path}",
                      "invalid_request_error")


class Route:
    """Where a checked request goes: its handler, the path and query as the client sent them,
    and the inbound key it authenticated with."""

    __slots__ = ("handler", "path", "query", "key")

    def __init__(self, handler, path: str, query: str, key: InboundKey | None):
        self.handler = handler
        self.path = path
        self.query = query
        self.key = key


ROUTE = web.RequestKey("relay_route", Route)


class Relay:
    """Request handlers. One instance per app; no state survives an exchange."""

    def __init__(self, state: RelayState, plugin_routes: dict | None = None):
        self.state = state
        self.plugin_routes = plugin_routes or {}  # (method, path) -> handler, from relay_routes
        # The operator's routes: authenticated by the admin key, not by the client gate.
        self.admin_routes = {
            spec: (route.handler, AdminGate(route, state.config.admin_key, state.gate))
            for spec, route in self.plugin_routes.items() if isinstance(route, AdminRoute)}

    async def dispatch(self, request: web.Request) -> web.StreamResponse:
        """Every request: check the target, the Host, the key, the method and the body's type,
        then hand over. Only the two Messages endpoints, ``/healthz``, the configured
        pass-through routes and plugins' routes answer; the client's path is never normalised
        into another."""
        try:
            route = self.route(request)
        except RelayError as error:
            return await self.refuse(request, error)
        request[ROUTE] = route
        return await route.handler(request)

    @web.middleware
    async def unrouted(self, request: web.Request, handler) -> web.StreamResponse:
        """Middleware: a target aiohttp's router matches to nothing (``OPTIONS *``, a
        ``CONNECT`` authority, a path that decodes to a line break) is dispatched all the
        same, so that it is answered in Anthropic's format like any other."""
        if request.match_info.http_exception is not None:
            return await self.dispatch(request)
        return await handler(request)

    def route(self, request: web.Request) -> Route:
        config = self.state.config
        path, query = split_target(request.raw_path)
        if request.method == "CONNECT" or (request.method == "OPTIONS" and path == "*"):
            raise not_allowed(request.method, path[:200])  # a server, not a proxy
        segments = check_target(path, query)
        gate = self.state.gate
        if gate is None and not host_allowed(request.headers.get("Host"), config):
            raise RelayError(403, "this relay does not answer to the Host "
                                  f"{request.headers.get('Host', '')[:200]!r} (see "
                                  "server.allowed_hosts)", "permission_error")
        method = request.method
        if path in ("/healthz", "/readyz"):
            if method not in ("GET", "HEAD"):
                raise not_allowed(method, path)
            return Route(self.healthz if path == "/healthz" else self.readyz, path, query, None)
        admin = self.admin_routes.get((method, path))
        if admin is not None:
            key = admin[1].authenticate(request.headers, path)
        else:
            key = gate.authenticate(request.headers) if gate is not None else None
        if admin is not None:
            handler = admin[0]
        elif path in ENDPOINTS:
            if method != "POST":
                raise not_allowed(method, path)
            handler = self.messages
        elif (method, path) in self.plugin_routes:
            handler = self.plugin_routes[method, path]
        elif any(p.matches(method, segments) for p in config.passthrough):
            backend = config.default_backend()
            if key is not None and key.backends is not None and backend.name not in key.backends:
                raise forbidden(key, f"backend {backend.name}")
            handler = self.passthrough
        elif (any(p.matches(p.method, segments) for p in config.passthrough)
              or any(known == path for _, known in self.plugin_routes)):
            raise not_allowed(method, path)
        else:
            raise RelayError(404, f"Not found: {method} {path[:200]}", "not_found_error")
        if request.can_read_body and not is_json(request.headers.get("Content-Type")):
            raise invalid_request("Content-Type must be application/json")
        return Route(handler, path, query, key)

    async def refuse(self, request: web.Request, error: RelayError,
                     close: bool | None = None) -> web.StreamResponse:
        """A request turned away before it was routed still makes an exchange (outcome
        ``refused``), so that the end hooks see it: an auth failure is worth counting."""
        path, query = split_target(request.raw_path)
        exchange = Exchange(endpoint="refused", method=request.method, path=path[:2000],
                            query=query[:2000], headers=request.headers)
        exchange.outcome, exchange.error = Outcome.REFUSED, error
        exchange.note("relay", "refused", status=error.status, message=error.message)
        response = await deliver(request, exchange, relay_error(
            error, exchange.id, {"x-relay-request-id": exchange.id},
            close=request.can_read_body if close is None else close))
        await self.finish(exchange)
        return response

    async def finish(self, exchange: Exchange) -> None:
        """The exchange is over and the client has its answer: log it, run the end hooks."""
        log_exchange(exchange, exchange.answer.status if exchange.answer else None)
        await self.state.chain.end(exchange)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        state = self.state
        route = request[ROUTE]
        try:
            raw = await read_body(request, state.config.max_body_bytes, state.config.body_timeout)
        except RelayError as error:
            # Whatever is left of a body that could not be read is not worth reading: the
            # connection closes rather than trip over it again.
            return await self.refuse(request, error, close=True)
        try:
            exchange = await prepare_exchange(
                state, method=request.method, path=route.path, query=route.query,
                headers=request.headers, raw_body=raw, key=route.key)
        except RelayError as error:
            exchange = getattr(error, "exchange", None)
            close = error.status in (408, 413)  # the rest of the body is not worth reading
            if exchange is None:
                return await self.refuse(request, error)
            exchange.outcome = Outcome.REJECTED if error.status < 500 else Outcome.RELAY_ERROR
            exchange.error = error
            exchange.note("relay", "rejected", status=error.status, message=error.message)
            response = await deliver(request, exchange, relay_error(
                error, exchange.id, exchange.response_headers, close=close))
            await self.finish(exchange)
            return response
        current = [exchange]  # the exchange in flight: a fallback replaces it

        async def rebuild(previous: Exchange, backend) -> Exchange:
            following = await prepare_exchange(
                state, method=request.method, path=route.path, query=route.query,
                headers=request.headers, raw_body=raw, key=route.key, backend=backend)
            following.follow(previous)
            current[0] = following
            return following

        try:
            return await self._forward(request, exchange, rebuild)
        except asyncio.CancelledError:
            if current[0].outcome is None:
                current[0].outcome = Outcome.CLIENT_DISCONNECTED
            raise
        finally:
            exchange = current[0]
            if exchange.outcome is None:
                exchange.outcome = Outcome.OK
            await self.finish(exchange)

    async def _forward(self, request: web.Request, exchange: Exchange, rebuild) -> web.StreamResponse:
        state = self.state
        if exchange.endpoint == "count_tokens" and exchange.backend.format == "openai":
            return await self._estimate(request, exchange)
        try:
            exchange, upstream = await state.upstream.open(exchange, rebuild)
        except Unreachable as e:
            return await self._unreachable(request, e.exchange, e.__cause__ or e)
        except RelayError as error:  # a path the backend's base URL cannot take, or a
            # request its format cannot carry
            exchange.outcome = Outcome.REJECTED if error.status < 500 else Outcome.RELAY_ERROR
            exchange.error = error
            return await deliver(request, exchange, relay_error(error, exchange.id,
                                                                exchange.response_headers))
        async with upstream:
            if upstream.status >= 300:
                return await self._upstream_error(request, exchange, upstream)
            if upstream.content_type == "text/event-stream":
                return await self._stream(request, exchange, upstream)
            try:
                payload = await read_capped(upstream, state.config.max_upstream_body_bytes)
            except (aiohttp.ClientError, asyncio.TimeoutError, UpstreamTooLarge) as e:
                return await self._unreachable(request, exchange, e)
        exchange.upstream_response = UpstreamAnswer(upstream.status, upstream.headers, payload)
        if exchange.backend.format == "openai":
            try:
                payload = openai.answer_bytes(payload, exchange.backend.name, exchange.model)
            except RelayError as error:  # not a chat completion: the record says why
                log.warning("%s: %s", exchange.id, error.message)
                exchange.outcome, exchange.error = Outcome.UPSTREAM_MALFORMED, error
                return await deliver(request, exchange, relay_error(
                    error, exchange.id, exchange.response_headers))
        response = UpstreamResponse(upstream.status, upstream.headers, payload)
        if exchange.endpoint == "messages" and state.chain.impls["relay_response"]:
            try:
                await state.chain.run("relay_response", exchange, response=response)
            except RelayError as error:
                exchange.outcome, exchange.error = Outcome.REJECTED, error
                return await deliver(request, exchange, relay_error(
                    error, exchange.id, exchange.response_headers))
            except Exception:
                # A plugin fault must not cost the client an answer the upstream already gave.
                log.exception("%s: response chain failed; the upstream's answer goes back as is",
                              exchange.id)
                response = UpstreamResponse(upstream.status, upstream.headers, payload)
        try:
            final = response.final_body()
        except Exception:
            log.exception("%s: a plugin left an answer that cannot be encoded; the upstream's "
                          "answer goes back as is", exchange.id)
            final = payload
        delivered = await deliver(request, exchange, web.Response(
            status=upstream.status, body=final,
            headers=client_headers(response.headers, exchange.response_headers)))
        if exchange.thread is not None:
            try:
                threads.record(state.threads, exchange, orjson.loads(final))
            except orjson.JSONDecodeError:
                pass  # not a message: nothing to continue from
        return delivered

    async def _unreachable(self, request, exchange: Exchange, e: BaseException) -> web.Response:
        error = upstream_failure(exchange.backend, e)
        log.warning("%s: %s (%s)", exchange.id, error.message, f"{type(e).__name__} {e}".rstrip())
        exchange.outcome = (Outcome.POOL_FULL if isinstance(e, PoolFull)
                            else Outcome.UPSTREAM_UNREACHABLE)
        exchange.error = error
        return await deliver(request, exchange, relay_error(error, exchange.id,
                                                            exchange.response_headers))

    async def _estimate(self, request, exchange: Exchange) -> web.Response:
        """count_tokens for an OpenAI-format backend, which has no such endpoint: an
        estimate, marked as one (``x-relay-token-count: estimate``)."""
        count = openai.estimate_tokens(exchange.upstream_body())
        exchange.note("relay", "estimated token count", input_tokens=count)
        return await deliver(request, exchange, web.Response(
            body=orjson.dumps({"input_tokens": count}), content_type="application/json",
            headers={**exchange.response_headers, "x-relay-token-count": "estimate"}))

    async def _upstream_error(self, request, exchange: Exchange, upstream) -> web.Response:
        try:
            payload = await read_capped(upstream, self.state.config.max_upstream_body_bytes)
        except (aiohttp.ClientError, asyncio.TimeoutError, UpstreamTooLarge) as e:
            return await self._unreachable(request, exchange, e)
        exchange.outcome = Outcome.UPSTREAM_ERROR
        exchange.upstream_response = UpstreamAnswer(upstream.status, upstream.headers, payload)
        exchange.note("relay", "upstream error", status=upstream.status)
        headers = client_headers(upstream.headers, exchange.response_headers)
        if exchange.backend.format == "openai":  # retry-after and the status stay as sent
            payload = openai.error_bytes(upstream.status, payload, exchange.id)
            headers["Content-Type"] = "application/json"
            headers.setdefault("request-id", exchange.id)  # the error is the relay's making
        response = UpstreamResponse(upstream.status, upstream.headers, payload)
        try:
            await self.state.chain.run("relay_upstream_error", exchange, response=response)
        except Exception:
            pass  # logged by the chain; the client still gets the upstream's own answer
        return await deliver(request, exchange, web.Response(
            status=upstream.status, body=payload, headers=headers))

    async def _stream(self, request: web.Request, exchange: Exchange, upstream) -> web.StreamResponse:
        plan = await self.state.chain.stream_plan(exchange)
        secrets = exchange.backend.credentials
        headers = client_headers(upstream.headers, exchange.response_headers, secrets)
        # What the SDKs report as the request id, when the upstream gave none (OpenAI format).
        headers.setdefault("request-id", exchange.id)
        response = web.StreamResponse(status=upstream.status, headers=headers)
        answer = exchange.answer = Answer(response.status, response.headers, stream=True)
        await response.prepare(request)
        write = redacting_writer(response.write, secrets)
        # A thread's record is what the client received.
        tap = threads.Tap(write) if exchange.thread is not None else None
        stream = StreamRelay(self.state.chain, exchange, plan, tap or write)
        translator = None
        if exchange.backend.format == "openai":
            translator = openai.StreamTranslator(exchange.backend.name, exchange.model)
            exchange.upstream_response = UpstreamAnswer(upstream.status, upstream.headers,
                                                        translator.raw)
        # Started where the ``finally`` below is sure to stop it.
        interval = self.state.config.stream_keepalive
        keepalive = KeepAlive(stream, interval) if interval else None
        try:
            try:
                if translator is None:
                    async for chunk in upstream.content.iter_any():
                        await stream.feed(chunk)
                else:
                    first = True
                    async for chunk in upstream.content.iter_any():
                        if first:
                            # message_start goes out before the rest of the first read is
                            # translated: a burst must not delay the first byte.
                            first = False
                            cut = chunk.find(b"\n\n") + 2
                            if 1 < cut < len(chunk):
                                await stream.feed(translator.feed(chunk[:cut]))
                                chunk = chunk[cut:]
                        chunk = translator.feed(chunk)
                        if chunk:
                            await stream.feed(chunk)
                        if translator.fault is not None:
                            break  # the relay ended the stream: the rest is not read
                    chunk = translator.close()
                    if chunk:
                        await stream.feed(chunk)
                await stream.finish()
            except (aiohttp.ClientError, asyncio.TimeoutError, StreamBroken) as e:
                if request.transport is None or request.transport.is_closing():
                    exchange.outcome = Outcome.CLIENT_DISCONNECTED
                    return response
                if stream.ended:
                    # Everything the client needs arrived; only the connection's own ending
                    # failed.
                    log.info("%s: upstream connection ended uncleanly after the stream: %r",
                             exchange.id, e)
                else:
                    message = stream_break(exchange.backend, e)
                    detail = f"{type(e).__name__} {e}".rstrip()
                    log.warning("%s: %s (%s)", exchange.id, message, detail)
                    await stream_failed(exchange, response, message, detail=detail)
                    return response
            except RelayError as error:  # a stream plugin refused to go on
                exchange.error = error
                await stream_failed(exchange, response, error.message, error.type)
                return response
            except asyncio.CancelledError:
                # The client went away, or the relay is stopping with this stream still open:
                # then the client is told, not cut off.
                if (request.transport is not None and not request.transport.is_closing()
                        and not stream.ended):
                    await stream_failed(exchange, response, lifecycle.SHUTTING_DOWN)
                    # A clean end of the body: a client drops a body cut short, error and all.
                    with contextlib.suppress(Exception):
                        await response.write_eof()
                raise
            except Exception:
                log.exception("%s: the stream loop failed", exchange.id)
                if not stream.ended:
                    await stream_failed(exchange, response,
                                        "the relay failed while relaying this stream")
                    return response
            await response.write_eof()
            if tap is not None:
                threads.record(self.state.threads, exchange, tap.message())
            return response
        finally:
            answer.size, answer.events = stream.written, stream.events
            if keepalive is not None:
                keepalive.stop()
                if keepalive.sent:
                    answer.size += keepalive.bytes
                    answer.events += keepalive.sent
                    exchange.note("relay", "keep-alive", pings=keepalive.sent)
            exchange.timings.last_byte = exchange.elapsed()
            if translator is not None:
                exchange.upstream_response.body = translator.raw.value()
                if translator.fault is not None and exchange.outcome is None:
                    outcome, message = translator.fault
                    exchange.outcome = Outcome(outcome)
                    log.warning("%s: %s", exchange.id, message)
                    exchange.error = RelayError(502, message, "api_error")
                    exchange.stream_failed(message)

    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        """A configured pass-through route (``server.passthrough``) goes to the default backend
        untouched, chain or no chain; it is still an exchange that the end hooks see."""
        state = self.state
        route = request[ROUTE]
        backend = state.config.default_backend()
        exchange = Exchange(endpoint="passthrough", method=request.method, path=route.path,
                            query=route.query, headers=request.headers, backend=backend)
        exchange.key_name = route.key.name if route.key is not None else None
        try:
            return await self._passthrough(request, exchange)
        except asyncio.CancelledError:
            exchange.outcome = Outcome.CLIENT_DISCONNECTED
            raise
        finally:
            if exchange.outcome is None:
                exchange.outcome = Outcome.OK
            await self.finish(exchange)

    async def _passthrough(self, request: web.Request, exchange: Exchange) -> web.StreamResponse:
        state = self.state
        backend = exchange.backend
        try:
            raw = None
            if request.can_read_body:
                raw = exchange.raw_body = await read_body(
                    request, state.config.max_body_bytes, state.config.body_timeout)
            upstream = await state.upstream.send(exchange, backend, body=raw)
        except RelayError as error:
            exchange.outcome, exchange.error = Outcome.REJECTED, error
            return await deliver(request, exchange, relay_error(error, exchange.id, close=True))
        except Unreachable as e:
            return await self._unreachable(request, exchange, e.__cause__ or e)
        async with upstream:
            if backend.format == "openai":
                return await self._translated_passthrough(request, exchange, upstream)
            if upstream.status >= 300:
                exchange.outcome = Outcome.UPSTREAM_ERROR
            secrets = backend.credentials
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
                # Headers are gone already: closing without the final chunk is how HTTP says
                # the body is incomplete.
                log.warning("passthrough %s from %s broke off: %r", exchange.path,
                            backend.name, e)
                exchange.outcome = Outcome.STREAM_ERROR
                request.transport.close()
                return response
            await response.write_eof()
            exchange.timings.last_byte = exchange.elapsed()
            return response

    async def _translated_passthrough(self, request, exchange: Exchange, upstream) -> web.Response:
        """A pass-through route on an OpenAI-format backend: the model list in Anthropic's
        shape, errors in Anthropic's format, anything else as it came."""
        try:
            payload = await read_capped(upstream, self.state.config.max_upstream_body_bytes)
        except (aiohttp.ClientError, asyncio.TimeoutError, UpstreamTooLarge) as e:
            return await self._unreachable(request, exchange, e)
        exchange.upstream_response = UpstreamAnswer(upstream.status, upstream.headers, payload)
        headers = client_headers(upstream.headers)
        if upstream.status >= 300:
            exchange.outcome = Outcome.UPSTREAM_ERROR
            payload = openai.error_bytes(upstream.status, payload, exchange.id)
            headers["Content-Type"] = "application/json"
        elif exchange.path.startswith("/v1/models"):
            try:
                payload = openai.models_bytes(payload, exchange.backend.name)
            except RelayError as error:
                exchange.outcome, exchange.error = Outcome.UPSTREAM_MALFORMED, error
                return await deliver(request, exchange, relay_error(
                    error, exchange.id, {"x-relay-request-id": exchange.id}))
        return await deliver(request, exchange, web.Response(
            status=upstream.status, body=payload, headers=headers))

    async def healthz(self, request: web.Request) -> web.Response:
        body = {"status": "ok", "version": __version__}
        if self.state.gate is None:  # with auth on, unauthenticated callers learn no more
            body.update(pipeline=self.state.chain.pipeline,
                        backends=[b.name for b in self.state.config.backends])
        return web.json_response(body)

    async def readyz(self, request: web.Request) -> web.Response:
        return lifecycle.readiness_response(request)

async def deliver(request: web.Request, exchange: Exchange, response: web.Response) -> web.Response:
    """Send a complete answer now, recording it on the exchange, so that whatever runs after
    (the end hooks) runs once the client has it. None of the backend's credentials go with
    it (see :mod:`relay.redact`)."""
    secrets = exchange.backend.credentials if exchange.backend is not None else ()
    if secrets:
        body = response.body
        if body and isinstance(body, bytes):
            redacted = redact(body, secrets)
            if redacted is not body:
                response.body = redacted
        redact_headers(response.headers, secrets)
    exchange.answer = Answer(response.status, response.headers, len(response.body or b""))
    await response.prepare(request)
    exchange.timings.first_byte = exchange.elapsed()
    await response.write_eof()
    exchange.timings.last_byte = exchange.elapsed()
    if response.keep_alive is False and request.protocol is not None:
        # Closed now, with the answer sent: aiohttp would otherwise read on through what is
        # left of a body the relay refused (and trip over it again if it cannot be decoded).
        request.protocol.force_close()
    return response


def create_app(config, chain: Chain) -> web.Application:
    state = RelayState(config, chain)
    app = web.Application(client_max_size=config.max_body_bytes)
    app[STATE] = state
    relay = Relay(state, chain.routes(config, reserved=("/healthz", "/readyz", *ENDPOINTS)))
    app.router.add_route("*", "/{tail:.*}", relay.dispatch)
    app.middlewares.append(relay.unrouted)

    async def session_context(app):
        await state.upstream.start()
        yield
        await state.upstream.close()

    app.cleanup_ctx.append(session_context)
    return app


async def serve(config, chain: Chain, host: str, port: int, worker=None) -> int:
    """Serve until SIGTERM or SIGINT, then drain (see :mod:`relay.lifecycle`); returns the
    exit status. Alone, prints the listening address once bound (port 0 picks one); as one
    of several workers (``worker``, a :class:`relay.workers.WorkerLink`) it shares the port
    with its siblings and tells the supervisor instead."""
    loop = asyncio.get_running_loop()
    state = lifecycle.Lifecycle(config.workers, worker.serving) if worker else lifecycle.Lifecycle()
    # From the start: a signal during start-up drains (nothing) once listening, not a kill.
    for sig in worker.signals if worker else (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, state.signal)
    await chain.startup(config)
    try:
        app = create_app(config, chain)
        app[lifecycle.LIFECYCLE] = state
        # Outermost: every request the app is working on counts as in flight for the drain.
        app.middlewares.insert(0, state.middleware())
        app.on_response_prepare.append(lifecycle.mark_response_started)
        # Cancelling the handler when the client goes away is what closes the upstream
        # request. The drain is the lifecycle's: by cleanup, nothing is in flight.
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                               shutdown_timeout=1.0)
        await runner.setup()
        try:
            site = Listener(runner, host, port, max_connections=config.max_connections,
                            header_timeout=config.header_timeout, reuse_port=worker is not None)
            await site.start()
            # Everything alive now lives as long as the process: keep it out of the
            # collector's full passes, which otherwise show up as p99 spikes on large
            # requests.
            gc.collect()
            gc.freeze()
            state.listening = True
            if worker:
                worker.started(loop, state.signal)
            else:
                bound = runner.addresses[0]
                logs.announce(f"relay listening on http://{bound[0]}:{bound[1]}")
            await state.stop_requested.wait()
            return await state.drain(runner, config.drain_seconds)
        finally:
            await runner.cleanup()
    finally:
        await chain.shutdown(config)
