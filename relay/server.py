"""The aiohttp server: accept a Messages API request, run the chain, relay the answer."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal

import aiohttp
import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from multidict import CIMultiDict

from . import __version__, lifecycle, logs, skeleton
from .chain import Chain
from .errors import RelayError, invalid_request
from .exchange import Exchange, UpstreamResponse
from .skeleton import Skeleton
from .sse import Event, LazyFramer

log = logging.getLogger("relay")
access_log = logs.access_log

# RFC 9110 hop-by-hop headers, plus the ones the relay recomputes: aiohttp decodes content
# encodings on both sides, so a forwarded content-encoding or content-length would be stale.
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
    "te", "trailer", "trailers", "transfer-encoding", "upgrade",
    "host", "content-length", "content-encoding", "accept-encoding",
})
AUTH_HEADERS = ("x-api-key", "authorization")
ENDPOINTS = {"/v1/messages": "messages", "/v1/messages/count_tokens": "count_tokens"}
STREAM_ENDS = ("message_stop", "error")
# One event larger than this means the upstream stopped framing: give up rather than buffer on.
MAX_EVENT_BYTES = 64 * 1024 * 1024

STATE = web.AppKey("relay_state", "RelayState")


class RelayState:
    """What the server needs for every request, built once at start-up."""

    def __init__(self, config, chain: Chain):
        self.config = config
        self.chain = chain
        self.session: aiohttp.ClientSession | None = None
        self.timeouts = {
            b.name: aiohttp.ClientTimeout(total=b.timeouts.total, connect=b.timeouts.connect,
                                          sock_read=b.timeouts.read)
            for b in config.backends}


def relay_error(error: RelayError, request_id: str | None = None, headers=None) -> web.Response:
    return web.Response(status=error.status, body=error.body(request_id),
                        content_type="application/json", headers=headers)


async def read_body(request: web.Request, limit: int) -> bytes:
    """The whole request body, decoded; a body that can't be read is the client's 4xx."""
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise too_large(limit) from None
    except RequestPayloadError as e:
        cause = e.__cause__ or e
        reason = getattr(cause, "message", None) or str(cause).strip()
        raise invalid_request(f"request body could not be read: {reason}") from None


def upstream_failure(backend, e: BaseException) -> RelayError:
    """The relay's own answer when the upstream could not be reached or went silent."""
    timeout = isinstance(e, asyncio.TimeoutError)
    what = "timed out" if timeout else "is unreachable"
    return RelayError(504 if timeout else 502,
                      f"upstream {backend.name} {what}: {type(e).__name__} {e}".rstrip(),
                      "timeout_error" if timeout else "api_error")


def upstream_url(backend, path: str, query: str) -> str:
    return backend.url + path + ("?" + query if query else "")


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


def _hop_by_hop(headers) -> frozenset:
    """The fixed hop-by-hop set plus whatever the sender's Connection header names."""
    named = headers.get("Connection")
    if not named:
        return HOP_BY_HOP
    return HOP_BY_HOP | {token.strip().lower() for token in named.split(",")}


def end_to_end(headers) -> CIMultiDict:
    """The headers a proxy passes on: all but the hop-by-hop ones."""
    out = CIMultiDict()
    drop = _hop_by_hop(headers)
    for name, value in headers.items():
        if name.lower() not in drop:
            out.add(name, value)
    return out


def forward_headers(headers, backend) -> CIMultiDict:
    out = end_to_end(headers)
    if backend.api_key:
        for name in AUTH_HEADERS:
            out.popall(name, None)
        if backend.auth == "bearer":
            out["Authorization"] = "Bearer " + backend.api_key
        else:
            out["x-api-key"] = backend.api_key
    return out


def client_headers(upstream_headers, extra: dict | None = None) -> CIMultiDict:
    out = end_to_end(upstream_headers)
    if extra:
        out.update(extra)
    return out


def log_exchange(exchange: Exchange, status: int | None) -> None:
    """One line per exchange (``server.access_log``): what an operator greps for first, the
    id naming any dump; every field escaped and capped (see :mod:`relay.logs`). Off by
    default: a log record costs more than the relay's own work on a small request."""
    if access_log.isEnabledFor(logging.INFO):
        logs.log_access(logs.access_fields(exchange, status, lifecycle.response_started()))


async def prepare_exchange(state: RelayState, *, method: str, path: str, query: str,
                           headers, raw_body: bytes) -> Exchange:
    """Parse, route and run the request chain: everything before the upstream is called.

    Raises RelayError for a request the client must be refused; the exchange it was refused
    in is attached as ``error.exchange`` (when one was built) so the end hooks can see it.
    """
    endpoint = ENDPOINTS[path]
    parsed = parse_request(raw_body)
    if type(parsed) is dict:
        exchange = Exchange(endpoint=endpoint, method=method, path=path, query=query,
                            headers=headers, raw_body=raw_body, body=parsed)
    else:
        exchange = Exchange(endpoint=endpoint, method=method, path=path, query=query,
                            headers=headers, raw_body=raw_body, skeleton=parsed)
    model = exchange.model
    backend = exchange.backend = state.config.backend_for(model)
    exchange.response_headers["x-relay-request-id"] = exchange.id

    def refused(error: RelayError) -> RelayError:
        error.exchange = exchange
        return error

    if backend is None:
        raise refused(RelayError(
            404, f"model: {model} (no backend in the relay's configuration serves it)",
            "not_found_error"))
    target = backend.upstream_model(model)
    if target is not None and target != model:
        exchange.set_model(target)
        exchange.note("relay", "renamed model", model=model, upstream_model=target)
    try:
        await state.chain.run("relay_request", exchange)
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


class Relay:
    """Request handlers. One instance per app; no state survives an exchange."""

    def __init__(self, state: RelayState):
        self.state = state

    async def messages(self, request: web.Request) -> web.StreamResponse:
        state = self.state
        try:
            raw = await read_body(request, state.config.max_body_bytes)
            exchange = await prepare_exchange(
                state, method=request.method, path=request.path, query=request.query_string,
                headers=request.headers, raw_body=raw)
        except RelayError as error:
            exchange = getattr(error, "exchange", None)
            if exchange is None:
                return relay_error(error)
            exchange.outcome = "rejected" if error.status < 500 else "relay_error"
            exchange.error = error
            exchange.note("relay", "rejected", status=error.status, message=error.message)
            log_exchange(exchange, error.status)
            await state.chain.end(exchange)
            return relay_error(error, exchange.id, exchange.response_headers)
        response = None
        try:
            response = await self._forward(request, exchange)
            return response
        except asyncio.CancelledError:
            exchange.outcome = "client_disconnected"
            raise
        finally:
            if exchange.outcome is None:
                exchange.outcome = "ok"
            log_exchange(exchange, response.status if response is not None else None)
            await state.chain.end(exchange)

    async def _forward(self, request: web.Request, exchange: Exchange) -> web.StreamResponse:
        state = self.state
        backend = exchange.backend
        url = upstream_url(backend, exchange.path, exchange.query)
        headers = forward_headers(request.headers, backend)
        body = exchange.upstream_body()  # encoded and released by prepare_exchange
        exchange.upstream_request = {"url": url, "headers": headers, "body": body}
        try:
            # A redirect would turn the POST into a GET and carry the key to another host.
            upstream = await state.session.request(
                "POST", url, data=body, headers=headers, timeout=state.timeouts[backend.name],
                allow_redirects=False)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            return self._unreachable(exchange, e)
        async with upstream:
            if upstream.status >= 300:
                return await self._upstream_error(exchange, upstream)
            if upstream.content_type == "text/event-stream":
                return await self._stream(request, exchange, upstream)
            try:
                payload = await upstream.read()
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                return self._unreachable(exchange, e)
        response = UpstreamResponse(upstream.status, upstream.headers, payload)
        if exchange.endpoint == "messages" and state.chain.impls["relay_response"]:
            try:
                await state.chain.run("relay_response", exchange, response=response)
            except RelayError as error:
                exchange.outcome, exchange.error = "rejected", error
                return relay_error(error, exchange.id, exchange.response_headers)
            except Exception:
                # A plugin fault must not cost the client an answer the upstream already gave.
                log.exception("%s: response chain failed; the upstream's answer goes back as is",
                              exchange.id)
                response = UpstreamResponse(upstream.status, upstream.headers, payload)
        return web.Response(status=upstream.status, body=response.final_body(),
                            headers=client_headers(response.headers, exchange.response_headers))

    def _unreachable(self, exchange: Exchange, e: BaseException) -> web.Response:
        error = upstream_failure(exchange.backend, e)
        log.warning("%s: %s", exchange.id, error.message)
        exchange.outcome, exchange.error = "upstream_unreachable", error
        return relay_error(error, exchange.id, exchange.response_headers)

    async def _upstream_error(self, exchange: Exchange, upstream) -> web.Response:
        try:
            payload = await upstream.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return self._unreachable(exchange, e)
        exchange.outcome = "upstream_error"
        exchange.upstream_response = {"status": upstream.status, "headers": upstream.headers,
                                      "body": payload}
        exchange.note("relay", "upstream error", status=upstream.status)
        response = UpstreamResponse(upstream.status, upstream.headers, payload)
        try:
            await self.state.chain.run("relay_upstream_error", exchange, response=response)
        except Exception:
            pass  # logged by the chain; the client still gets the upstream's own answer
        return web.Response(status=upstream.status, body=payload,
                            headers=client_headers(upstream.headers, exchange.response_headers))

    async def _stream(self, request: web.Request, exchange: Exchange, upstream) -> web.StreamResponse:
        chain = self.state.chain
        plan = await chain.stream_plan(exchange)
        response = web.StreamResponse(
            status=upstream.status,
            headers=client_headers(upstream.headers, exchange.response_headers))
        await response.prepare(request)
        framer = LazyFramer(plan.framed_names(), ends=STREAM_ENDS)

        async def relay(parts: list, events: list) -> None:
            if events and plan:
                for event in events:
                    calls = plan.calls_for(event.name)
                    if calls:
                        await chain.stream_event(exchange, event, calls)
            if len(parts) == 1:
                part = parts[0]
                await response.write(part if part.__class__ is bytes else part.encode())
            else:
                await response.write(b"".join(
                    [part if part.__class__ is bytes else part.encode() for part in parts]))

        try:
            first = True
            async for chunk in upstream.content.iter_any():
                if first:
                    first = False
                    # The first event (message_start) goes out before whatever came with it
                    # is scanned: time to first byte must not grow with how much the
                    # upstream managed to send before the relay read.
                    cut = chunk.find(b"\n\n") + 2
                    if 1 < cut < len(chunk):
                        await relay(*framer.feed(chunk[:cut]))
                        chunk = chunk[cut:]
                parts, events = framer.feed(chunk)
                if parts:
                    await relay(parts, events)
                # After a read that let something out, what is held back is part of that
                # read: only a read that let nothing out, or a huge one, can pass the limit.
                if (not parts or len(chunk) > MAX_EVENT_BYTES) and framer.buffered > MAX_EVENT_BYTES:
                    raise aiohttp.ClientPayloadError(
                        f"an event grew past {MAX_EVENT_BYTES} bytes without ending")
            tail = framer.close()
            if tail:
                await relay(tail, tail)
            if not framer.ended:
                raise aiohttp.ClientPayloadError("the stream ended before message_stop")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            if request.transport is None or request.transport.is_closing():
                exchange.outcome = "client_disconnected"
                return response
            # Ended by message_stop or an error event: on the stream's own terms.
            if framer.ended:
                # Everything the client needs arrived; only the connection's own ending failed.
                log.info("%s: upstream connection ended uncleanly after the stream: %r",
                         exchange.id, e)
                await response.write_eof()
                return response
            exchange.outcome = "stream_error"
            message = (f"upstream stream from {exchange.backend.name} broke off: "
                       f"{type(e).__name__} {e}").rstrip()
            log.warning("%s: %s", exchange.id, message)
            error = Event.build("error", {"type": "error",
                                          "error": {"type": "api_error", "message": message}})
            exchange.note("relay", "stream error", message=message)
            await response.write(error.raw)
            return response
        except asyncio.CancelledError:
            # Cancelled with the client still there: the drain at shutdown ran out of time.
            if (request.transport is not None and not request.transport.is_closing()
                    and not framer.ended):
                exchange.note("relay", "stream error", message=lifecycle.SHUTTING_DOWN)
                await response.write(Event.build("error", {
                    "type": "error",
                    "error": {"type": "api_error", "message": lifecycle.SHUTTING_DOWN}}).raw)
                await response.write_eof()
            raise
        await response.write_eof()
        return response

    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        """Any other /v1/ path goes to the default backend untouched, chain or no chain."""
        backend = self.state.config.default_backend()
        url = upstream_url(backend, request.path, request.query_string)
        try:
            raw = None
            if request.can_read_body:
                raw = await read_body(request, self.state.config.max_body_bytes)
            upstream = await self.state.session.request(
                request.method, url, data=raw, headers=forward_headers(request.headers, backend),
                timeout=self.state.timeouts[backend.name], allow_redirects=False)
        except RelayError as error:
            return relay_error(error)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            return relay_error(upstream_failure(backend, e))
        async with upstream:
            response = web.StreamResponse(status=upstream.status,
                                          headers=client_headers(upstream.headers))
            await response.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                # Headers are gone already: closing without the final chunk is how HTTP says
                # the body is incomplete.
                log.warning("passthrough %s from %s broke off: %r", request.path, backend.name, e)
                request.transport.close()
                return response
            await response.write_eof()
            return response

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "version": __version__,
                                  "pipeline": self.state.chain.pipeline,
                                  "backends": [b.name for b in self.state.config.backends]})

    async def readyz(self, request: web.Request) -> web.Response:
        return lifecycle.readiness_response(request)

    async def not_found(self, request: web.Request) -> web.Response:
        return relay_error(RelayError(404, f"Not found: {request.method} {request.path}",
                                      "not_found_error"))


@web.middleware
async def anthropic_errors(request: web.Request, handler):
    """aiohttp's own HTTP errors (405, 413 on the wire, ...) in Anthropic's format."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        if e.status == 413:
            error = too_large(request.app[STATE].config.max_body_bytes)
        else:
            error = RelayError(e.status, e.reason, "not_found_error" if e.status == 404 else None)
        return web.Response(status=e.status, body=error.body(), content_type="application/json")


def create_app(config, chain: Chain) -> web.Application:
    state = RelayState(config, chain)
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[anthropic_errors])
    app[STATE] = state
    relay = Relay(state)
    app.router.add_post("/v1/messages", relay.messages)
    app.router.add_post("/v1/messages/count_tokens", relay.messages)
    app.router.add_get("/healthz", relay.healthz)
    app.router.add_get("/readyz", relay.readyz)
    app.router.add_route("*", "/v1/{tail:.*}", relay.passthrough)
    app.router.add_route("*", "/{tail:.*}", relay.not_found)

    async def session_context(app):
        state.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=config.upstream_connections,
                                           limit_per_host=0, enable_cleanup_closed=True),
            auto_decompress=True, skip_auto_headers=("User-Agent",))
        yield
        await state.session.close()

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
            site = web.TCPSite(runner, host, port, reuse_port=worker is not None)
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
