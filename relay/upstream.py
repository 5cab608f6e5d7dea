"""Where a request goes upstream and with which headers.

The client never chooses what the operator's key reaches: the upstream URL is the backend's
base URL with a path the relay has already checked (:func:`relay.inbound.check_target`)
appended as it is, and the result is checked again to stay under the base path.
"""

from __future__ import annotations

import asyncio
import functools
import random
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol, cast
from urllib.parse import urlsplit

import aiohttp
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from . import beta_filter, threads, transport
from .config import Retries
from .errors import RelayError, let_go
from .exchange import Attempt, UpstreamRequest
from .headers import AUTH_HEADERS, end_to_end, keep_undecoded_coding, seconds_until, sendable
from .pools import Exhausted, Pools
from .redact import redact_headers
from .sse import SSEDecoder


@functools.lru_cache(maxsize=256)
def _base_path(url: str) -> str:
    return urlsplit(url).path.rstrip("/")


def upstream_url(backend, path: str, query: str) -> URL:
    """``path`` (checked, still percent-encoded as the client sent it) and ``query`` (the
    client's own bytes) under the backend's base URL, never normalised: what the client sent
    is what goes up. Raises when the result would leave the base path."""
    return upstream_target(backend, path, query)[0]


def upstream_target(backend, path: str, query: str) -> tuple[URL, str]:
    """:func:`upstream_url` and its text (the attempt's record)."""
    found = _joined(backend.url, path, query)
    if found is None:
        raise RelayError(400, f"path {path!r} cannot be sent to backend {backend.name}",
                         "invalid_request_error")
    return found


# Nearly every request goes to one of a few targets (a backend's /v1/messages with the
# client's usual query): parsing the URL again each time costs more than the lookup. The
# cache holds at most this many, each a request target that the server's line limit bounds.
@functools.lru_cache(maxsize=256)
def _joined(base: str, path: str, query: str) -> tuple[URL, str] | None:
    # A base URL's own query (Azure's ?api-version=...) goes first, the client's after it.
    head, _, fixed = base.partition("?")
    query = f"{fixed}&{query}" if fixed and query else fixed or query
    url = URL(head.rstrip("/") + path + ("?" + query if query else ""), encoded=True)
    if url.raw_path != _base_path(base) + path or url.raw_query_string != query:
        return None
    return url, str(url)


def forward_headers(headers, backend, strip_client_auth: bool = False,
                    shaped=None) -> CIMultiDict:
    """The headers that go upstream: the client's end-to-end ones (or ``shaped``, what the
    plugins made of them through ``exchange.upstream_headers``), with the backend's
    credentials: its own key when it has one (a pool's is put on each attempt by
    :meth:`Upstream.send`), else the client's (unless ``strip_client_auth``: with inbound
    auth on, what the client presented is the relay's key and never goes up). Credentials
    are the host's alone: a plugin cannot set or read them."""
    key = backend.api_key
    own = bool(key) or bool(backend.credentials)
    if shaped is None:
        out = end_to_end(headers)
    else:
        out = CIMultiDict(shaped)
        for name in AUTH_HEADERS:
            out.popall(name, None)
        if not own and not strip_client_auth:
            for name in AUTH_HEADERS:
                for value in headers.getall(name, ()):
                    out.add(name, value)
    if own or strip_client_auth:
        for name in AUTH_HEADERS:
            out.popall(name, None)
    if key:
        set_key(out, backend, key)
    return out


def set_key(headers: CIMultiDict, backend, key: str) -> None:
    """Put ``key`` on ``headers`` the way ``backend`` takes it (``auth``)."""
    if backend.auth == "bearer":
        headers["Authorization"] = "Bearer " + key
    else:
        headers["x-api-key"] = key


def _passed_on(upstream_headers) -> CIMultiDict:
    """The upstream's end-to-end headers, each one the relay's server can write."""
    upstream_headers = sendable(upstream_headers)
    out = end_to_end(upstream_headers)
    if "Content-Encoding" in upstream_headers:
        keep_undecoded_coding(out, upstream_headers)
    return out


def client_headers(upstream_headers, extra: dict | None = None, secrets=()) -> CIMultiDict:
    """The upstream's end-to-end headers for the client, with the relay's own (``extra``) and
    none of the backend's ``secrets`` (see :mod:`relay.redact`)."""
    out = _passed_on(upstream_headers)
    if extra:
        out.update(extra)
    return redact_headers(out, secrets) if secrets else out


def answer_headers(exchange, upstream_headers, secrets=()) -> CIMultiDict:
    """:func:`client_headers` for ``exchange``'s answer: without the upstream's headers that
    the relay's own replace (``exchange.replaces_headers``; what they held is kept in
    ``exchange.replaced_headers``), with ``exchange.response_headers``."""
    prefixes = exchange.replaces_headers
    if not prefixes:
        return client_headers(upstream_headers, exchange.response_headers, secrets)
    out = _passed_on(upstream_headers)
    replaced = {}
    for name in {name.lower() for name in out if name.lower().startswith(prefixes)}:
        replaced[name] = ", ".join(out.popall(name))
    exchange.replaced_headers = replaced
    out.update(exchange.response_headers)
    return redact_headers(out, secrets) if secrets else out


class Body(Protocol):
    """An answer's body as the relay reads it (an ``aiohttp.StreamReader``, or
    :class:`Opened`'s)."""

    def iter_any(self) -> AsyncIterator[bytes]: ...

    def at_eof(self) -> bool: ...


class Reply(Protocol):
    """An upstream's answer as the relay reads it: an ``aiohttp.ClientResponse`` (a backend
    behind an egress proxy), a :class:`relay.transport.Response` (any other), or either as
    :class:`Opened`."""

    @property
    def status(self) -> int: ...

    @property
    def reason(self) -> str | None: ...

    @property
    def headers(self) -> CIMultiDictProxy[str]: ...

    @property
    def content(self) -> Body: ...

    @property
    def content_type(self) -> str: ...

    @property
    def content_length(self) -> int | None: ...

    async def read(self) -> bytes: ...

    def release(self) -> Any: ...

    def close(self) -> None: ...

    async def __aenter__(self) -> Any: ...

    async def __aexit__(self, *exc_info: Any) -> Any: ...


# How much of a stream's start is read for its first event, and for how long: Anthropic's
# error events are a line, sent with the headers; an event that has not ended by then is no
# such refusal, and a stream slow to begin is owed its headers (and the keep-alive pings
# that follow them) meanwhile.
OPENING_BYTES = 65536
OPENING_SECONDS = 2.0


class _Resumed:
    """A body whose first bytes were read already: they come again first."""

    __slots__ = ("held", "rest", "failure")

    def __init__(self, held: bytes, rest: Body, failure: BaseException | None):
        self.held = held
        self.rest = rest
        self.failure = failure  # what ended the first read: raised where it would have been

    async def iter_any(self) -> AsyncIterator[bytes]:
        held, self.held = self.held, b""
        if held:
            yield held
        failure, self.failure = self.failure, None
        if failure is not None:
            raise failure
        async for chunk in self.rest.iter_any():
            yield chunk

    def at_eof(self) -> bool:
        return not self.held and self.failure is None and self.rest.at_eof()


class Opened:
    """An upstream stream whose first event was read before it went on, to see whether the
    upstream refused the request in it: the same answer, its body again from its first byte.
    ``refused``: the status that event stands for (the format's ``opening_errors``), and
    ``kind`` its error type; None when the stream began."""

    __slots__ = ("answer", "content", "refused", "kind")

    def __init__(self, answer: Reply, content: _Resumed, refused: int | None,
                 kind: str | None):
        self.answer = answer
        self.content = content
        self.refused = refused
        self.kind = kind

    @property
    def status(self) -> int:
        return self.answer.status

    @property
    def reason(self) -> str | None:
        return self.answer.reason

    @property
    def headers(self) -> CIMultiDictProxy[str]:
        return self.answer.headers

    @property
    def content_type(self) -> str:
        return self.answer.content_type

    @property
    def content_length(self) -> int | None:
        return self.answer.content_length

    async def read(self) -> bytes:
        parts = [chunk async for chunk in self.content.iter_any()]
        return b"".join(parts)

    def release(self) -> Any:
        return self.answer.release()

    def close(self) -> None:
        self.answer.close()

    async def __aenter__(self) -> Opened:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.answer.__aexit__(*exc_info)


async def opened(answer: Reply, errors) -> Opened:
    """``answer`` (a 200 stream) with its first event read: whether it is an ``error`` event
    of a type in ``errors`` (error type -> status). A read that fails is raised later, by the
    body's reader, where the stream's own failures are handled."""
    decoder = SSEDecoder()
    held = bytearray()
    failure: BaseException | None = None
    first = None
    # A fresh answer's body: an aiohttp.StreamReader, read as one (Body is what comes after).
    content = cast(aiohttp.StreamReader, answer.content)
    loop = asyncio.get_running_loop()
    until = loop.time() + OPENING_SECONDS
    try:
        while True:
            chunk = content.read_nowait()  # usually in hand: read with the headers
            if not chunk:
                if content.at_eof() or (left := until - loop.time()) <= 0:
                    break
                try:
                    chunk = await asyncio.wait_for(content.readany(), left)
                except asyncio.TimeoutError as e:
                    if isinstance(e, aiohttp.ClientError):
                        raise  # the read's own timeout, not the wait's
                    break  # slow to begin: no refusal came with its headers
                if not chunk:
                    break
            start = len(held)
            held += chunk
            # Only as far as the first event's end, where that is plain to see: a chunk that
            # holds the whole answer (a short one, a burst) is not split into its every event
            # here, only to be split again on its way to the client.
            cut = _event_end(held, max(start - 3, 0))
            if cut > start:
                events = decoder.feed(bytes(held[start:cut]))
                if not events:  # blank lines before any event: the rest, to stay in step
                    events = decoder.feed(bytes(held[cut:]))
            else:
                events = decoder.feed(chunk)
            if events or len(held) > OPENING_BYTES:
                first = events[0] if events else None
                break
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        failure = e
    except BaseException:
        answer.release()
        raise
    refused = kind = None
    data = first.data if first is not None else None
    name = first.name if first is not None else None
    if type(data) is dict and (name or data.get("type")) == "error":
        error = data.get("error")
        found = error.get("type") if type(error) is dict else None
        if type(found) is str and found in errors:
            refused, kind = errors[found], found
    return Opened(answer, _Resumed(bytes(held), answer.content, failure), refused, kind)


class _AtEnd:
    """A body read to its end."""

    async def iter_any(self) -> AsyncIterator[bytes]:
        return
        yield

    def at_eof(self) -> bool:
        return True


def redirects(status: int) -> bool:
    """Whether an upstream's ``status`` is a redirect, which the relay never relays: every
    3xx but 304 Not Modified (the answer to a conditional GET, which points nowhere)."""
    return 300 <= status < 400 and status != 304


def redirect_refused(backend, answer: Reply) -> RelayError:
    """An upstream's redirect as the relay's own 502. Relayed, it would be followed (the SDKs
    follow redirects, anthropic/_base_client.py ``follow_redirects``) with the client's
    ``x-api-key``, which, unlike ``Authorization``, HTTP clients keep across origins: the key
    (the relay's own, with inbound auth on) and the request would go wherever the upstream
    points, past the relay. The Messages API does not redirect. Where it pointed is the
    operator's to read (the log and the exchange's timeline), not the client's."""
    return RelayError(502, f"upstream {backend.name} answered HTTP {answer.status}, a redirect, "
                      "which the relay does not follow: check the backend's url (the relay's "
                      "log names where it pointed)", "api_error")


def read_again(answer: Reply, payload: bytes) -> Opened:
    """``answer``, whose body was read whole (``payload``) and its connection let go, to be
    read again from its first byte."""
    return Opened(answer, _Resumed(payload, _AtEnd(), None), None, None)


def _event_end(buf: bytearray, since: int) -> int:
    """Where the first blank line at or after ``since`` ends in ``buf`` (0: none found in
    the usual line ends; the decoder then reads the chunk whole)."""
    ends = [found + len(blank) for blank in (b"\n\n", b"\r\n\r\n", b"\r\r")
            if (found := buf.find(blank, since)) >= 0]
    return min(ends, default=0)


def standing(answer: Reply) -> int:
    """The status ``answer`` stands for: its own, or the one its stream opened with."""
    if isinstance(answer, Opened) and answer.refused is not None:
        return answer.refused
    return answer.status


class Fallbacks(Protocol):
    """Where the exchanges for a backend's fallbacks come from (:class:`relay.prepare.
    Fallbacks`): prepared by the layer that prepares requests, handed to the seam."""

    async def next(self) -> Any: ...

    async def moved(self) -> Any: ...


class Unreachable(Exception):
    """No answer came back from the upstream (after any retries); ``__cause__`` says why."""

    exchange: Any = None  # the exchange that was sent last


class UpstreamTooLarge(Exception):
    """An upstream answer longer than ``server.max_upstream_body_bytes`` (decoded)."""


async def read_capped(upstream: Reply, limit: int) -> bytes:
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


class PoolFull(Exception):
    """The relay's own connection pool (``server.upstream_connections``) had no connection
    free within the backend's connect timeout: a capacity signal of the relay's, not a fault
    of the upstream's."""

    def __init__(self, limit: int):
        super().__init__(f"all {limit} of the relay's upstream connections are in use "
                         f"(server.upstream_connections)")
        self.limit = limit


def pool_full(session: aiohttp.ClientSession) -> bool:
    """Whether every connection of the session's pool is taken: then a connect timeout was the
    wait for a free one (aiohttp times both under ``connect`` and raises the same
    ConnectionTimeoutError). aiohttp counts connections in use only privately; without that
    count the answer is no, which is what the relay said before it asked."""
    connector = session.connector
    limit = connector.limit if connector is not None else 0
    return bool(limit) and len(getattr(connector, "_acquired", ())) >= limit


def retry_after(headers) -> float | None:
    """The wait an upstream asks for, in seconds: ``retry-after-ms``, or ``retry-after`` as
    seconds or an HTTP date."""
    value = headers.get("retry-after-ms")
    if value:
        try:
            return max(0.0, float(value) / 1000)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    return seconds_until(value, time.time())


def backoff(retries: Retries, tried: int, headers, rng=random.random) -> float | None:
    """How long to wait before the next try after ``tried`` tries, or None when the upstream
    asks for a longer wait than ``max_backoff``: exponential, with jitter so that clients
    shed together do not come back together, and the upstream's own retry-after honoured."""
    asked = retry_after(headers) if headers is not None else None
    # Zero, or a date gone by, asks for no wait: the SDKs then wait their own backoff
    # (anthropic/_base_client.py _calculate_retry_timeout, @anthropic-ai/sdk retryRequest).
    if asked:
        return asked if asked <= retries.max_backoff else None
    wait = min(retries.max_backoff, retries.backoff * 2 ** (tried - 1))
    return wait * (0.5 + rng() / 2)


def readable(answer: Reply, method: str, url: URL) -> None:
    """Raise, as for an answer whose head cannot be read, when ``answer``'s body is not what
    the parser made of it: a switch of protocols (101) the relay never asks for (it sends no
    ``Upgrade``), or a transfer coding besides chunked, which the parser leaves on the body
    (``Transfer-Encoding: gzip, chunked``: the client got the gzip bytes as the JSON)."""
    if answer.status == 101:
        why = "HTTP 101, a switch of protocols the relay did not ask for"
    else:
        codings = [coding.strip().lower() for field in answer.headers.getall(
            "Transfer-Encoding") for coding in field.split(",") if coding.strip()]
        if all(coding in ("chunked", "identity") for coding in codings) \
                and "chunked" not in codings[:-1]:
            return
        why = f"Transfer-Encoding {', '.join(codings)}, which the relay does not decode"
    answer.release()
    raise aiohttp.ClientResponseError(
        aiohttp.RequestInfo(url, method, CIMultiDictProxy(CIMultiDict()), url), (),
        status=answer.status, message=why)


# No answer the relay can use came back, as when the backend cannot be connected to: an egress
# proxy refused the tunnel (CONNECT) or the relay's proxy credentials (ClientHttpProxyError),
# or the answer's head could not be read (ClientResponseError: an encoding aiohttp cannot
# decode, such as zstd or br without their libraries, a malformed status line, or what
# readable refuses).
RETRYABLE_ERRORS = (aiohttp.ClientConnectionError, asyncio.TimeoutError, OSError,
                    aiohttp.ClientResponseError)


class Upstream:
    """The one place the relay talks to backends: URL, headers and credentials, timeouts, the
    redirect policy (never followed: a redirect would turn a POST into a GET and could carry
    the key to another host), retries and fallback. Serving, pass-through and
    ``relay replay --send`` all go through it."""

    def __init__(self, config, strip_client_auth: bool = False, sleep=asyncio.sleep,
                 state=None):
        self.config = config
        # The backends' pools of credentials, over the host's shared state (relay.pools).
        self.pools = Pools(config, state)
        self.strip_client_auth = strip_client_auth
        self.session: aiohttp.ClientSession | None = None
        # Every backend without an egress proxy goes through the relay's own lean client
        # (relay.transport); the proxied ones, and a backend URL with credentials in it
        # (aiohttp makes them Basic auth), through aiohttp's.
        self.connections: transport.Pool | None = None
        self.lean = {b.name for b in config.backends
                     if b.proxy is None and URL(b.url).raw_user is None
                     and URL(b.url).raw_password is None}
        self.timeouts = {
            b.name: aiohttp.ClientTimeout(total=b.timeouts.total, connect=b.timeouts.connect,
                                          sock_read=b.timeouts.read)
            for b in config.backends}
        # The egress proxies (relay.egress), parsed once: only backends that have one.
        self.proxies = {b.name: URL(b.proxy.url) for b in config.backends if b.proxy is not None}
        self._sleep = sleep

    async def start(self) -> None:
        # No cookie jar: one session serves every client, so a cookie an upstream set on one
        # client's answer would go up with every other client's request. The client's own
        # Cookie header goes up, and the upstream's Set-Cookie comes back, as any end-to-end
        # header does.
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.config.upstream_connections,
                                           limit_per_host=0, enable_cleanup_closed=True),
            cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=True,
            skip_auto_headers=("User-Agent",))
        self.connections = transport.Pool(self.config.upstream_connections)

    async def close(self) -> None:
        if self.connections is not None:
            await self.connections.close()
        if self.session is not None:
            await self.session.close()

    def headers(self, client_headers, backend, shaped=None) -> CIMultiDict:
        return forward_headers(client_headers, backend, self.strip_client_auth, shaped)

    async def send(self, exchange, backend, *, body: bytes | None = None,
                   headers=None) -> Reply:
        """Send ``exchange``'s request to ``backend``, retrying as the backend's ``retries``
        say; every try is recorded in ``exchange.attempts``. Returns the upstream's answer
        (any status: the caller decides what a 4xx means) or raises :class:`Unreachable`.
        ``body`` defaults to ``exchange.upstream_body()``, ``headers`` to the client's. The
        backend's format adapter says where the request goes and translates the body and
        headers (``exchange.upstream_request.body`` is then the translated body), or raises
        a RelayError 400 that says what cannot be translated."""
        adapter = backend.adapter
        url, where = upstream_target(backend,
                                     *adapter.upstream_target(exchange.path, exchange.query))
        out_headers = self.headers(exchange.client_headers if headers is None else headers,
                                   backend, exchange.shaped_headers)
        dropped = beta_filter.filter_header(out_headers, backend.quirks) \
            if beta_filter.configured(backend.quirks) else None
        if body is None:
            body = exchange.upstream_body()
            if dropped:
                body, removed = beta_filter.strip_body(body, dropped)
                exchange.note("relay", "dropped betas", backend=backend.name, betas=dropped,
                              **({"fields": removed} if removed else {}))
            body = adapter.request_body(body, backend, exchange.endpoint)
        elif dropped:
            exchange.note("relay", "dropped betas", backend=backend.name, betas=dropped)
        adapter.request_headers(out_headers)
        exchange.upstream_request = UpstreamRequest(where, out_headers, body)
        retries = backend.retries
        session, connections = self.session, self.connections
        if session is None or connections is None:
            raise RuntimeError("Upstream.send before Upstream.start")
        # What cannot go the lean way: a body that is not bytes (aiohttp streams it).
        lean = backend.name in self.lean and (body is None or body.__class__ is bytes)
        started = time.perf_counter()
        waited = 0.0
        pools = self.pools
        pool = pools.pool(backend)
        tried: set[str] = set()  # credentials this request failed with: not asked again
        # The account of the pool that holds the request's thread, when the relay knows it.
        holder = threads.holder(exchange) if pool is not None else None
        counted = 0  # attempts the retries count (a switch of credential is not one)
        errors = adapter.opening_errors
        # A stream's first event is read before it goes on only where a refusal in it can be
        # acted on: another credential, a retry, a fallback. Elsewhere the client gets the
        # stream at once, as it came.
        opens = bool(errors) and exchange.endpoint == "messages" and (
            pool is not None or retries.attempts > 1 or bool(backend.fallbacks))
        while True:
            credential = None
            if pool is not None:
                try:
                    credential = await pools.choose(exchange, pool, tried, holder)
                except Exhausted as e:
                    raise Unreachable(backend.name) from e
                if holder is not None and credential.name != holder:
                    pools.release(exchange)
                    raise threads.ThreadMoved(backend.name, holder, credential.name)
                set_key(out_headers, backend, credential.key)
                exchange.credential = credential.name
            attempt = Attempt(backend.name, where, waited=waited,
                              credential=credential.name if credential is not None else None)
            exchange.attempts.append(attempt)
            sent = time.perf_counter()
            attempt.sent = exchange.elapsed()
            failure: BaseException | None = None
            answer: Reply | None = None
            try:
                if lean:
                    answer = await connections.request(
                        exchange.method, url, url.raw_path_qs, out_headers, body,
                        self.timeouts[backend.name])
                elif backend.proxy is None:
                    answer = await session.request(
                        exchange.method, url, data=body, headers=out_headers,
                        timeout=self.timeouts[backend.name], allow_redirects=False)
                else:
                    answer = await self._through_proxy(session, exchange.method, url, body,
                                                       out_headers, backend)
                if answer.status == 101 or "Transfer-Encoding" in answer.headers:
                    readable(answer, exchange.method, url)
            except aiohttp.ConnectionTimeoutError as e:
                if not (connections.full if lean else pool_full(session)):
                    failure = e
                    attempt.error = f"{type(e).__name__} {e}".rstrip()
                else:  # waiting again, here or on a fallback (the same pool), helps nobody
                    attempt.seconds = time.perf_counter() - sent
                    attempt.error = "pool full"
                    limit = self.config.upstream_connections
                    exchange.note("relay", "pool full", backend=backend.name, limit=limit)
                    pools.release(exchange)
                    raise Unreachable(backend.name) from PoolFull(limit)
            except RETRYABLE_ERRORS as e:
                failure = e
                answer = None  # one that readable refused (and let go) is no answer
                attempt.error = f"{type(e).__name__} {e}".rstrip()
            attempt.seconds = time.perf_counter() - sent
            status = None
            if answer is not None:
                status = attempt.status = answer.status
                if opens and status == 200 and answer.content_type == "text/event-stream":
                    answer = await opened(answer, errors)
                    if answer.refused is not None:
                        # Nothing has reached the client: the stream counts as the status
                        # its error stands for (a 529 for overloaded_error), for the pool,
                        # the retries and the fallbacks alike.
                        status = answer.refused
                        attempt.error = f"the stream opened with {answer.kind}"
                        exchange.note("relay", "stream refused", backend=backend.name,
                                      error=answer.kind, stands_for=status)
            fault = False
            if pool is not None and credential is not None:
                try:
                    fault = await pools.report(exchange, pool, credential.name, status,
                                               answer.headers if answer is not None else None)
                except BaseException:
                    # The client gone while the state took the credential's health: nobody
                    # will read this answer, whose connection is held until then.
                    if answer is not None:
                        answer.release()
                    raise
            if fault and credential is not None:
                # The credential's own fault (rate limited, overloaded, refused): another
                # one of the pool is asked now, without a wait and without using a retry.
                tried.add(credential.name)
                pools.release(exchange)
                if answer is not None:
                    answer.release()
                exchange.note("relay", "next credential", backend=backend.name,
                              credential=credential.name, status=status)
                waited = 0.0
                continue
            # The upstream's own word ends the retries, as the SDKs obey it before the status
            # (anthropic/_base_client.py, _should_retry); the Claude Code 2.1.332 binary
            # tells a first-party 503 that carries it from one worth retrying. Another
            # credential or a fallback backend may still answer.
            if answer is not None and (status not in retries.statuses
                                       or answer.headers.get("x-should-retry") == "false"):
                exchange.timings.upstream_headers = exchange.elapsed()
                return answer
            counted += 1
            wait = None
            if counted < retries.attempts:
                wait = backoff(retries, counted, answer.headers if answer is not None else None)
            if wait is None or time.perf_counter() - started + wait > retries.budget:
                if answer is not None:
                    exchange.timings.upstream_headers = exchange.elapsed()
                    return answer
                pools.release(exchange)
                raise Unreachable(backend.name) from failure
            if answer is not None:
                answer.release()
            let_go(failure)  # held by the connection it broke, whose frames its traceback holds
            pools.release(exchange)
            exchange.note("relay", "retrying", backend=backend.name,
                          status=status, error=attempt.error, wait=round(wait, 3))
            await self._sleep(wait)
            waited = wait

    async def _through_proxy(self, session: aiohttp.ClientSession, method: str, url: URL,
                             body, headers: CIMultiDict, backend) -> aiohttp.ClientResponse:
        """The request through the backend's egress proxy (:mod:`relay.egress`). Its
        credentials go to the proxy alone: on the CONNECT that opens an ``https://``
        backend's tunnel, or on an ``http://`` request, which the proxy reads and forwards
        without them; ``headers`` (the exchange's record) never holds them. A ``407`` is the
        proxy's refusal, never the backend's answer."""
        proxy = backend.proxy
        options: dict[str, Any] = {}
        if proxy.authorization is not None:
            if url.scheme == "https":
                options["proxy_headers"] = {"Proxy-Authorization": proxy.authorization}
            else:
                headers = CIMultiDict(headers)
                headers["Proxy-Authorization"] = proxy.authorization
        answer = await session.request(
            method, url, data=body, headers=headers, timeout=self.timeouts[backend.name],
            allow_redirects=False, proxy=self.proxies[backend.name], **options)
        if answer.status == 407:
            answer.release()
            raise aiohttp.ClientHttpProxyError(answer.request_info, (), status=407,
                                               message=answer.reason or "",
                                               headers=answer.headers)
        return answer

    async def open(self, exchange, fallbacks: Fallbacks | None = None):
        """:meth:`send`, then each of the backend's ``fallbacks`` in order while the answer
        is one the backend retries (or none came). ``fallbacks`` (a
        :class:`relay.prepare.Fallbacks`) hands over the exchange prepared for the next one,
        or None when none is left, and the exchange prepared again with its thread carried
        when the pooled credential holding the thread cannot take it (``moved``, see
        :class:`relay.threads.ThreadMoved`). Returns ``(exchange, answer)`` with the
        exchange that was sent last, or ``(exchange, None)`` for a count_tokens fallback
        whose format counts tokens itself (its adapter's ``count_tokens``): nothing is sent,
        the caller answers with the estimate. Raises :class:`Unreachable`, with that
        exchange as ``.exchange``."""
        while True:
            failure: Unreachable | None = None
            answer: Reply | None
            try:
                answer = await self.send(exchange, exchange.backend)
            except threads.ThreadMoved as moved:
                if fallbacks is None:  # nothing to prepare it again with: no account has it
                    raise threads.ThreadNotFound(exchange.thread.previous_id) from None
                exchange.note("relay", "thread moved", backend=exchange.backend.name,
                              credential=moved.holder, to=moved.to)
                exchange = await fallbacks.moved()
                continue
            except Unreachable as e:
                if isinstance(e.__cause__, PoolFull):
                    _mark_retried(exchange)
                    e.exchange = exchange
                    raise
                answer, failure = None, e
            if answer is not None and standing(answer) not in exchange.backend.retries.statuses:
                _mark_retried(exchange)
                return exchange, answer
            try:
                following = await fallbacks.next() if fallbacks is not None else None
            except BaseException:
                # The client gone while the chain prepared the fallback: nobody will read
                # this answer, whose connection is held until then.
                if answer is not None:
                    answer.release()
                raise
            if following is None:
                if failure is None or not isinstance(failure.__cause__, Exhausted):
                    # A pool's own refusal says when to come back: the client may.
                    _mark_retried(exchange)
                if answer is None:
                    assert failure is not None  # no answer came: send raised
                    failure.exchange = exchange
                    raise failure
                return exchange, answer
            if answer is not None:
                answer.release()
                # Its credential was held for this answer, which nobody reads now; the end
                # of the request gives back only the fallback's.
                self.pools.release(exchange)
            let_go(failure)  # its traceback holds this frame, which holds it and the exchange
            following.note("relay", "fallback", backend=following.backend.name,
                           after=exchange.backend.name)
            exchange = following
            if exchange.endpoint == "count_tokens" and exchange.backend.adapter.count_tokens(
                    exchange.upstream_body()) is not None:
                # As when it is asked first: a format without the endpoint would be sent a
                # request it cannot read.
                _mark_retried(exchange)
                return exchange, None


def _mark_retried(exchange) -> None:
    """Every answer after relay retries says so, whether an upstream status came back or every
    attempt timed out or could not connect: the SDKs retry on ``x-should-retry`` alone, and
    a client retrying on top of the relay multiplies the attempts. A switch to another
    credential of a pool is no retry (docs/pools.md: the answer was the key's): after one
    alone, the client keeps its own retries of what the next credential answered."""
    attempts = exchange.attempts
    # A retry is an attempt after a backoff (never 0 s: see backoff), or on a fallback.
    if len(attempts) > 1 and (attempts[0].backend != attempts[-1].backend
                              or any(attempt.waited for attempt in attempts)):
        exchange.response_headers["x-should-retry"] = "false"
