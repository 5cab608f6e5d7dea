"""The aiohttp server: route a request and hand it off (prepare, upstream, respond, stream).

A Messages request is prepared (:mod:`relay.prepare`: parsing, routing, the request chain),
sent through the upstream seam (:mod:`relay.upstream`, which tries the fallbacks the
preparation layer hands it), and answered: a complete answer here, through the backend's
format adapter (:mod:`relay.formats`), a stream by :mod:`relay.stream`, an error of the
relay's own making by :func:`relay.respond.refuse`. Pass-through routes go to
:mod:`relay.passthrough`.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import os
import signal
from collections.abc import Awaitable
from typing import TYPE_CHECKING

import aiohttp
import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from aiohttp.web_urldispatcher import UrlMappingMatchInfo
from multidict import CIMultiDict

from . import __version__, allocator, keys, lifecycle, logs, pools, threads
from .chain import Chain
from .config import InboundKey
from .errors import UPSTREAM_ERROR, RelayError, invalid_request, let_go
from .exchange import Answer, Exchange, Outcome, UpstreamAnswer, UpstreamResponse
from .inbound import (
    AdminGate,
    AdminRoute,
    Gate,
    check_target,
    forbidden,
    host_allowed,
    is_json,
    split_target,
)
from .listen import AcceptErrors, Listener, url_of
from .passthrough import relay_passthrough
from .prepare import ENDPOINTS, Fallbacks, Preparation, prepare_exchange
from .redact import redact_text
from .respond import deliver, log_exchange, refuse, refuse_redirect, relay_error, unreachable
from .state import Unavailable
from .stream import relay_stream
from .upstream import (
    Unreachable,
    Upstream,
    UpstreamTooLarge,
    answer_headers,
    read_again,
    read_capped,
    redirects,
)

log = logging.getLogger("relay")

if TYPE_CHECKING:
    from .otel import Traces

class RelayState(Preparation):
    """What the server needs for every request, built once at start-up: what preparing one
    needs, the inbound gate and the upstream seam."""

    def __init__(self, config, chain: Chain):
        super().__init__(config, chain)
        # While the app runs, when traces are configured (relay.telemetry).
        self.traces: Traces | None = None
        self.gate = Gate(config.keys) if config.keys is not None else None
        # With auth on, what a client presents is a relay key: it never goes upstream.
        self.upstream = Upstream(config, strip_client_auth=self.gate is not None,
                                 state=chain.state)


STATE = web.AppKey("relay_state", RelayState)
# The collector's first-generation threshold while serving (see serve).
GC_YOUNG = 10000


async def read_body(request: web.Request, limit: int, timeout: float | None = None) -> bytes:
    """The whole request body, decoded; a body that can't be read is the client's 4xx. A
    declared length over the limit is refused before a byte of the body is read."""
    if request.content_length is not None and request.content_length > limit:
        raise too_large(limit)
    try:
        if timeout is None or request.content.is_eof():  # all here already: no timer needed
            return await _read(request.content, limit)
        return await asyncio.wait_for(_read(request.content, limit), timeout)
    except asyncio.TimeoutError:
        raise RelayError(408, f"request body not received within {timeout:g} s",
                         "timeout_error") from None
    except RequestPayloadError as e:
        cause = e.__cause__ or e
        reason = getattr(cause, "message", None) or str(cause).strip()
        raise invalid_request(f"request body could not be read: {reason}") from None
    except ConnectionError:
        # The client hung up in the middle of its body: refused like any body that cannot
        # be read, so that the exchange ends as every other does (its answer finds no one).
        raise invalid_request("request body could not be read: the connection closed "
                              "before it was complete") from None


async def _read(content: aiohttp.StreamReader, limit: int) -> bytes:
    """The body's chunks as they came, joined once (none when it came in one): aiohttp's
    ``request.read()`` copies a body three times on the way (what is buffered joined, into a
    bytearray, into bytes), a megabyte each for a coding agent's history."""
    # As request.read() does: the buffer may hold the whole body without pausing the socket
    # (a pause and a resume are two system calls per read).
    content.set_read_chunk_size(limit)
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk, chunk_end = await content.readchunk()
        if not chunk:
            if chunk_end and not content.at_eof():  # an HTTP chunk's end: the body goes on
                continue
            return b"".join(chunks)
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)


def too_large(limit: int) -> RelayError:
    return RelayError(413, f"request body exceeds the relay's limit of {limit} bytes",
                      "request_too_large")


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

    def __init__(self, state: RelayState, plugin_routes: dict | None = None, console=None,
                 serving: lifecycle.Lifecycle | None = None):
        self.state = state
        self.console = console  # a relay.console.Console when server.console is on
        self.plugin_routes = plugin_routes or {}  # (method, path) -> handler, from relay_routes
        # The operator's routes: authenticated by the admin key, not by the client gate.
        self.admin_routes = {
            spec: (route.handler, AdminGate(route, state.config.admin_key, state.gate))
            for spec, route in self.plugin_routes.items() if isinstance(route, AdminRoute)}
        # Serving under serve(): every request counts as in flight for the drain.
        self.lifecycle = serving

    async def dispatch(self, request: web.Request) -> web.StreamResponse:
        """Every request: check the target, the Host, the key, the method and the body's type,
        then hand over. Only the two Messages endpoints, ``/healthz``, the configured
        pass-through routes and plugins' routes answer; the client's path is never normalised
        into another."""
        if self.lifecycle is not None:
            return await self.lifecycle.serve(request, self._dispatch)
        return await self._dispatch(request)

    def _dispatch(self, request: web.Request) -> Awaitable[web.StreamResponse]:
        # The handler's own coroutine, awaited by the caller: no frame of its own in between.
        try:
            route = self.route(request)
        except RelayError as error:
            return self.refuse(request, error)
        request[ROUTE] = route
        return route.handler(request)

    async def expect(self, request: web.Request) -> None:
        """A client's ``Expect: 100-continue``: it holds its body back until told to send it.
        A request the relay refuses on its headers alone (its target, Host, key, method,
        type or declared size) is answered without the 100, as RFC 9110 (10.1.1) asks of a
        server whose final status its headers decide, so the client never sends a body only
        to have it thrown away. Any other expectation is ignored, as RFC 9110 allows: aiohttp
        would answer it with a plain-text 417, and nothing shows the API refusing one."""
        if (request.version != aiohttp.HttpVersion11
                or request.headers.get("Expect", "").lower() != "100-continue"):
            return
        try:
            route = self.route(request)
        except RelayError:
            return  # the dispatcher answers it with the same refusal
        length = request.content_length
        if (route.handler in (self.messages, self.passthrough) and length is not None
                and length > self.state.config.max_body_bytes):
            return  # read_body answers 413 before reading a byte
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # as aiohttp's own handler: the answer is still to come

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
        if self.console is not None and self.console.serves(path):
            # The console authenticates by its own session cookie and takes forms: it is
            # routed before the client gate and the JSON check.
            return Route(self.console.handle, path, query, None)
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
            assert backend is not None  # a config has backends; the first is the default
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
        exchange = self.refused(request, error)
        response = await refuse(request, exchange, error, Outcome.REFUSED,
                                close=request.can_read_body if close is None else close)
        await self.finish(exchange)
        return response

    @staticmethod
    def refused(request: web.Request, error: RelayError) -> Exchange:
        """The record of a request answered before it became an exchange of its own."""
        path, query = split_target(request.raw_path)
        exchange = Exchange(endpoint="refused", method=request.method, path=path[:2000],
                            query=query[:2000], headers=request.headers)
        exchange.response_headers["x-relay-request-id"] = exchange.id
        exchange.note("relay", "refused", status=error.status, message=error.message)
        return exchange

    async def cut_unprepared(self, request: web.Request) -> None:
        """A Messages request cancelled while its body came or it was prepared: when the
        drain cut it, its 503 is recorded as a refusal's (the client gets the id)."""
        if self.lifecycle is None or not self.lifecycle.cuts(request):
            return
        exchange = self.refused(request, RelayError(503, lifecycle.SHUTTING_DOWN, "api_error"))
        self.cut(request, exchange)
        await self.finish(exchange)

    def cut(self, request: web.Request, exchange: Exchange) -> bool:
        """Whether the drain's deadline (not the client) cancelled ``exchange`` before its
        answer began: then the client gets the 503 recorded here (see relay.lifecycle),
        under the exchange's id."""
        serving = self.lifecycle
        if serving is None or not serving.cuts(request):
            return False
        answer = request[lifecycle.CUT_ANSWER] = lifecycle.shutting_down(exchange.id)
        exchange.outcome = Outcome.RELAY_ERROR
        exchange.error = RelayError(503, lifecycle.SHUTTING_DOWN, "api_error")
        exchange.answer = Answer(answer.status, answer.headers, answer.content_length or 0)
        return True

    async def finish(self, exchange: Exchange) -> None:
        """The exchange is over and the client has its answer: log it, run the end hooks."""
        try:
            self.state.upstream.pools.release(exchange)
            log_exchange(exchange, exchange.answer.status if exchange.answer else None)
            chain = self.state.chain
            if chain.impls["relay_exchange_end"]:  # a pipeline without end hooks pays nothing
                await chain.end(exchange)
            traces = self.state.traces
            if traces is not None:  # after the end hooks: the record is complete
                try:
                    traces.record(exchange)
                except Exception:
                    log.exception("%s: the exchange could not be made a trace", exchange.id)
        finally:
            exchange.close()

    async def messages(self, request: web.Request) -> web.StreamResponse:
        state = self.state
        route = request[ROUTE]
        try:
            raw = await read_body(request, state.config.max_body_bytes, state.config.body_timeout)
        except RelayError as error:
            # Whatever is left of a body that could not be read is not worth reading: the
            # connection closes rather than trip over it again.
            return await self.refuse(request, error, close=True)
        except asyncio.CancelledError:
            await self.cut_unprepared(request)
            raise
        try:
            exchange = await prepare_exchange(
                state, method=request.method, path=route.path, query=route.query,
                headers=request.headers, raw_body=raw, key=route.key)
        except RelayError as error:
            refused = error.exchange
            if refused is None:
                return await self.refuse(request, error)
            refused.note("relay", "rejected", status=error.status, message=error.message)
            # The rest of a body that took too long or was too large is not worth reading.
            response = await refuse(request, refused, error, close=error.status in (408, 413))
            await self.finish(refused)
            return response
        except asyncio.CancelledError:
            await self.cut_unprepared(request)
            raise
        fallbacks = Fallbacks(state, exchange, route.key)  # the exchange in flight: .current
        try:
            return await self._forward(request, exchange, fallbacks)
        except asyncio.CancelledError:
            current = fallbacks.current
            if current.outcome is None and not self.cut(request, current):
                current.outcome = Outcome.CLIENT_DISCONNECTED
            raise
        finally:
            exchange = fallbacks.current
            if exchange.outcome is None:
                exchange.outcome = Outcome.OK
            await self.finish(exchange)

    async def _forward(self, request: web.Request, exchange: Exchange,
                       fallbacks: Fallbacks) -> web.StreamResponse:
        state = self.state
        if exchange.endpoint == "count_tokens":
            count = exchange.backend.adapter.count_tokens(exchange.upstream_body())
            if count is not None:
                return await self._estimate(request, exchange, count)
        try:
            exchange, upstream = await state.upstream.open(exchange, fallbacks)
        except Unreachable as e:
            try:
                return await unreachable(request, e.exchange, e.__cause__ or e)
            finally:
                let_go(e)
        except RelayError as error:  # a path the backend's base URL cannot take, or a
            # request its format cannot carry: maybe a fallback's, whose record it then is
            return await refuse(request, fallbacks.current, error)
        if upstream is None:  # a fallback that answers the count itself
            count = exchange.backend.adapter.count_tokens(exchange.upstream_body())
            assert count is not None  # why open sent nothing
            return await self._estimate(request, exchange, count)
        async with upstream:
            if upstream.status >= 300:
                return await self._upstream_error(request, exchange, upstream)
            adapter = exchange.backend.adapter
            streamed = upstream.content_type == "text/event-stream"
            if streamed and (exchange.stream or not adapter.collects_streams):
                return await relay_stream(state, request, exchange, upstream)
            try:
                payload = await read_capped(upstream, state.config.max_upstream_body_bytes)
            except (aiohttp.ClientError, asyncio.TimeoutError, UpstreamTooLarge) as e:
                return await unreachable(request, exchange, e)
        exchange.upstream_response = UpstreamAnswer(upstream.status, upstream.headers, payload)
        try:
            answer, exchange.unreported_usage = adapter.answer_body(
                payload, exchange.backend.name, exchange.model)
        except RelayError as error:  # not an answer of its format: the record says why
            # Its message may quote the answer, and so a key the upstream echoed.
            error.message = redact_text(error.message, exchange.backend.secrets)
            log.warning("%s: %s", exchange.id, error.message)
            # An error the upstream sent with its 200 is its error, not a malformed answer.
            return await refuse(request, exchange, error,
                                Outcome.UPSTREAM_ERROR if error.rule == UPSTREAM_ERROR
                                else Outcome.UPSTREAM_MALFORMED)
        if exchange.stream and adapter.streams_answers and not streamed:
            # A whole answer to a request for a stream: the adapter's stream_translator makes
            # it the stream the client reads (an error was answered above, with its status).
            return await relay_stream(state, request, exchange, read_again(upstream, payload))
        payload = answer
        headers = upstream.headers
        if streamed:  # collected into one message (Adapter.collects_streams): JSON now
            headers = CIMultiDict(headers)
            headers["Content-Type"] = "application/json"
        response = UpstreamResponse(upstream.status, headers, payload)
        if exchange.endpoint == "messages" and state.chain.impls["relay_response"]:
            try:
                await state.chain.run("relay_response", exchange, response=response)
            except RelayError as error:
                return await refuse(request, exchange, error, Outcome.REJECTED)
            except Exception:
                # A plugin fault must not cost the client an answer the upstream already gave.
                log.exception("%s: response chain failed; the upstream's answer goes back as is",
                              exchange.id)
                response = UpstreamResponse(upstream.status, headers, payload)
        try:
            final = response.final_body()
        except Exception:
            log.exception("%s: a plugin left an answer that cannot be encoded; the upstream's "
                          "answer goes back as is", exchange.id)
            final = payload
        delivered = await deliver(request, exchange, web.Response(
            status=upstream.status, body=final,
            headers=answer_headers(exchange, response.headers)))
        if exchange.thread is not None:
            try:
                threads.record(state.threads, exchange, orjson.loads(final))
            except orjson.JSONDecodeError:
                pass  # not a message: nothing to continue from
        return delivered

    async def _estimate(self, request, exchange: Exchange, count: int) -> web.Response:
        """count_tokens for a backend whose format has no such endpoint: the adapter's
        estimate, marked as one (``x-relay-token-count: estimate``)."""
        exchange.note("relay", "estimated token count", input_tokens=count)
        return await deliver(request, exchange, web.Response(
            body=orjson.dumps({"input_tokens": count}), content_type="application/json",
            headers={**exchange.response_headers, "x-relay-token-count": "estimate"}))

    async def _upstream_error(self, request, exchange: Exchange, upstream) -> web.Response:
        try:
            payload = await read_capped(upstream, self.state.config.max_upstream_body_bytes)
        except (aiohttp.ClientError, asyncio.TimeoutError, UpstreamTooLarge) as e:
            return await unreachable(request, exchange, e)
        exchange.outcome = Outcome.UPSTREAM_ERROR
        exchange.upstream_response = UpstreamAnswer(upstream.status, upstream.headers, payload)
        exchange.note("relay", "upstream error", status=upstream.status)
        if redirects(upstream.status):
            return await refuse_redirect(request, exchange, upstream)
        headers = answer_headers(exchange, upstream.headers)
        # Retry-after and the status stay as sent.
        translated = exchange.backend.adapter.error_body(upstream.status, payload, exchange.id)
        if translated is not None:
            payload = translated
            headers["Content-Type"] = "application/json"
            headers.setdefault("request-id", exchange.id)  # the error is the relay's making
        response = UpstreamResponse(upstream.status, upstream.headers, payload)
        try:
            await self.state.chain.run("relay_upstream_error", exchange, response=response)
        except Exception:
            pass  # logged by the chain; the client still gets the upstream's own answer
        return await deliver(request, exchange, web.Response(
            status=upstream.status, body=payload, headers=headers))

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
            return await relay_passthrough(state, request, exchange, read_body)
        except asyncio.CancelledError:
            if not self.cut(request, exchange):
                exchange.outcome = Outcome.CLIENT_DISCONNECTED
            raise
        finally:
            if exchange.outcome is None:
                exchange.outcome = Outcome.OK
            await self.finish(exchange)

    async def healthz(self, request: web.Request) -> web.Response:
        body: dict[str, object] = {"status": "ok", "version": __version__}
        if self.state.gate is None:  # with auth on, unauthenticated callers learn no more
            body.update(pipeline=self.state.chain.pipeline,
                        backends=[b.name for b in self.state.config.backends])
        return web.json_response(body)

    async def readyz(self, request: web.Request) -> web.Response:
        return lifecycle.readiness_response(request)


BACKENDS = "/admin/backends"  # the operator's: each pooled credential's state


def backends_handler(state: RelayState):
    async def backends(request: web.Request) -> web.Response:
        try:
            listed = await pools.health(state.upstream.pools.state, state.config)
        except Unavailable:
            return relay_error(RelayError(503, "the shared state cannot be reached now",
                                          "api_error"))
        return web.json_response({"credentials": listed})
    return backends


def create_app(config, chain: Chain,
               serving: lifecycle.Lifecycle | None = None) -> web.Application:
    """The relay's aiohttp app; ``serving`` when it serves under :func:`serve` (the
    requests in flight, for the drain)."""
    state = RelayState(config, chain)
    app = web.Application(client_max_size=config.max_body_bytes)
    app[STATE] = state
    console = None
    if config.console:
        from .console import Console  # only a relay that serves the console loads it
        console = Console(config, chain)
    routes = chain.routes(config, reserved=("/healthz", "/readyz", BACKENDS, *ENDPOINTS))
    routes["GET", BACKENDS] = AdminRoute(backends_handler(state))
    relay = Relay(state, routes, console, serving)
    # Served under serve(): straight into the lifecycle's tracking, one frame less a request.
    entry = relay.dispatch if serving is None else functools.partial(
        serving.serve, handler=relay._dispatch)
    everything = app.router.add_route("*", "/{tail:.*}", entry, expect_handler=relay.expect)

    async def resolve(request: web.Request) -> UrlMappingMatchInfo:
        # Every target goes to the dispatcher, which routes it itself, the ones aiohttp's
        # router would match to nothing too (``OPTIONS *``, a ``CONNECT`` authority, a path
        # that decodes to a line break): each is answered in Anthropic's format like any
        # other, and no middleware runs per request for it.
        return UrlMappingMatchInfo({}, everything)

    app.router.resolve = resolve  # type: ignore[method-assign]

    async def session_context(app):
        await state.upstream.start()
        yield
        await state.upstream.close()

    # Before the upstream's session, so that traces are exported after it has closed.
    app.cleanup_ctx.append(traces_context)
    app.cleanup_ctx.append(session_context)
    if state.gate is not None and chain.state is not None:
        app.cleanup_ctx.append(keys.watching(state.gate, chain.state, config.default_limits))
    return app


async def traces_context(app):
    """Traces (relay.yaml's ``telemetry:``) for as long as the app serves, when configured:
    started in the serving process itself (each worker its own, after the fork); at the end,
    what is queued is exported off the loop."""
    from .telemetry import configured, start

    state = app[STATE]
    if not configured(state.config.telemetry):
        yield
        return
    state.traces = start(state.config.telemetry, os.environ)
    yield
    traces, state.traces = state.traces, None
    await asyncio.get_running_loop().run_in_executor(None, traces.close)


async def started(chain: Chain, config, state: lifecycle.Lifecycle) -> bool:
    """The plugins' ``relay_startup``, unless a second stop signal comes first: then what
    started is shut down and the process stops without listening (a plugin's start-up can
    wait on the network for as long as it likes; an operator's second signal should not)."""
    startup = asyncio.ensure_future(chain.startup(config))
    forced = asyncio.ensure_future(state.second_signal.wait())
    try:
        await asyncio.wait({startup, forced}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        forced.cancel()
    if startup.done():
        startup.result()  # a ConfigError stops start-up as it is
        return True
    startup.cancel()
    await asyncio.wait({startup}, timeout=5)
    await chain.shutdown(config)
    return False


def settle(config) -> tuple[bool, str]:
    """What a serving process sets once it listens, for what it serves from then on (the
    benchmarks' in-process figures run under it too): whether freed memory is kept, and what
    :func:`relay.allocator.keep_freed` says of it."""
    # Everything alive now lives as long as the process: keep it out of the collector's full
    # passes, which otherwise show up as p99 spikes on large requests.
    gc.collect()
    gc.freeze()
    # What a request leaves for the collector is a few cycles at most; what it keeps alive
    # while in flight (its exchange, buffers, futures) is thousands of young objects, which
    # the default threshold (700) had the collector walk and promote every few requests
    # under load, for nothing.
    gc.set_threshold(GC_YOUNG, *gc.get_threshold()[1:])
    return allocator.keep_freed(config.keep_freed_bytes)


async def serve(config, chain: Chain, host: str, port: int, worker=None) -> int:
    """Serve until SIGTERM or SIGINT, then drain (see :mod:`relay.lifecycle`); returns the
    exit status. Alone, prints the listening address once bound (port 0 picks one); as one
    of several workers (``worker``, a :class:`relay.workers.WorkerLink`) it shares the port
    with its siblings and tells the supervisor instead."""
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(AcceptErrors())
    state = lifecycle.Lifecycle(config.workers, worker.serving) if worker else lifecycle.Lifecycle()
    # From the start: a signal during start-up drains (nothing) once listening, not a kill;
    # a second one ends the start-up.
    if worker:  # its supervisor's signals, which differ (and SIGHUP, which it ignores)
        worker.handle_signals(loop, state)
    else:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, state.signal)
        loop.add_signal_handler(signal.SIGHUP, lifecycle.hangup)
    if not await started(chain, config, state):
        return 1
    try:
        app = create_app(config, chain, state)
        app[lifecycle.LIFECYCLE] = state
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
            kept, said = settle(config)
            (log.debug if kept else log.warning)("memory: %s", said)
            state.listening = True
            if worker:
                worker.started(loop, state.stop)
            else:
                logs.announce(f"relay listening on {url_of(runner.addresses[0])}")
            await state.stop_requested.wait()
            await state.unready(config.unready_seconds)
            return await state.drain(runner, config.drain_seconds)
        finally:
            await runner.cleanup()
    finally:
        await chain.shutdown(config)
