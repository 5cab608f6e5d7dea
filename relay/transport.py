"""A lean HTTP/1.1 client for the relay's upstream leg.

aiohttp's ``ClientSession.request`` costs about three times the CPU of a bare asyncio
protocol on a small request (a request object, a response object, a connector, tracing,
cookies, redirects, middlewares), and the relay uses none of what that buys. This client
does the one thing the relay needs: the request written in one ``transport.write`` (a large
body in a second), the answer read by aiohttp's own parser
(:class:`aiohttp.http.HttpResponseParser`: chunked, Content-Length, read-until-close and
decompression exactly as aiohttp's client does them) into an :class:`aiohttp.StreamReader`,
over a pool of keep-alive connections.

It keeps aiohttp's client's contract where the relay depends on it: the same request bytes
(:func:`request_head`), the same TLS trust, the same timeouts (``ClientTimeout``'s
``total``, ``connect`` and ``sock_read``) raising the same exceptions, the same flow
control (the StreamReader's limit pauses the socket), and an answer (:class:`Response`)
with the attributes of ``aiohttp.ClientResponse`` the relay reads. It parts from it in one
place: a request on a kept-alive connection that the server had closed while it was idle is
sent again once on a new connection, when nothing of an answer had arrived (aiohttp
retries only idempotent methods; a POST failed).

It depends on aiohttp internals that are stable across 3.x (``HeadersMixin``, the header
serialiser, ``TimeoutHandle``): setup.cfg pins ``aiohttp<4``.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import ssl
from typing import Any

import aiohappyeyeballs
import aiohttp
from aiohttp import hdrs
from aiohttp.base_protocol import BaseProtocol
from aiohttp.client_reqrep import ConnectionKey
from aiohttp.helpers import (
    EMPTY_BODY_STATUS_CODES,
    BaseTimerContext,
    HeadersMixin,
    TimeoutHandle,
    TimerNoop,
    ceil_timeout,
    set_exception,
)
from aiohttp.http import HttpProcessingError, HttpResponseParser
from aiohttp.http_writer import _serialize_headers
from aiohttp.streams import EMPTY_PAYLOAD, StreamReader
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

# What aiohttp's ClientSession reads with by default (read_bufsize, and the parser's limits).
READ_BUFSIZE = 2**18
MAX_LINE_SIZE = 8190
MAX_FIELD_SIZE = 8190
MAX_HEADERS = 128
# aiohttp's TCPConnector keeps an idle connection this long (its keepalive_timeout).
KEEPALIVE = 15.0
# A TLS connection closed gracefully is aborted after this long if its peer never finished
# the close (aiohttp's enable_cleanup_closed, which the relay turned on, does the same for
# Pythons before 3.12.8: https://github.com/python/cpython/pull/118960).
TLS_CLOSE_GRACE = 2.0
# A body up to this size goes in the head's write; a larger one in a write of its own (a
# copy of a large body costs more than the second send).
COALESCED = 65536
# Methods aiohttp sends without a default Content-Length: 0 when there is no body, and
# methods it gives a default Content-Type (aiohttp.ClientRequest.GET_METHODS/POST_METHODS).
_NO_LENGTH_METHODS = frozenset(aiohttp.ClientRequest.GET_METHODS)
_TYPED_METHODS = frozenset(aiohttp.ClientRequest.POST_METHODS)
# aiohttp's client retries these on a dropped connection, fresh or not (its IDEMPOTENT_METHODS).
_IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})
_DEFAULT_HEADERS = tuple(aiohttp.ClientRequest.DEFAULT_HEADERS.items())
_CONNECTION_CLOSED = aiohttp.ClientConnectionError("Connection closed")
_NO_TIMER = TimerNoop()

_tls_context: asyncio.Future | None = None


def _make_tls_context() -> ssl.SSLContext:
    # What aiohttp's TCPConnector uses for ssl=True (connector._make_ssl_context(True)): the
    # system's trust store, certificate and host name checks, ALPN offering HTTP/1.1 alone.
    context = ssl.create_default_context()
    context.set_alpn_protocols(("http/1.1",))
    return context


async def tls_context() -> ssl.SSLContext:
    """The one TLS context, made on first use in a thread: loading the trust store reads the
    disk, which the event loop must not wait on."""
    global _tls_context
    if _tls_context is None:
        _tls_context = asyncio.ensure_future(asyncio.to_thread(_make_tls_context))
    return await asyncio.shield(_tls_context)


def request_head(method: str, url: URL, target: str, headers, body: bytes | None) -> bytes:
    """The request line and headers as aiohttp's client writes them for ``session.request(
    method, url, data=body, headers=headers, skip_auto_headers=("User-Agent",))``: Host
    first (a Host in ``headers`` takes its place), ``headers`` in order with repeated names
    kept, then Accept and Accept-Encoding unless given, a Content-Length for a body (0 for a
    method that takes one and has none), and application/octet-stream for a method that takes
    a body and names no type. Control characters in a name or value raise ValueError, as
    aiohttp's serialiser does (header injection)."""
    out: CIMultiDict[str] = CIMultiDict()
    out[hdrs.HOST] = url.host_port_subcomponent or ""
    if hdrs.HOST in headers:
        for name, value in headers.items():
            if name.lower() == "host":
                out[name] = value
            else:
                out.add(name, value)
    else:
        out.extend(headers)
    for name, value in _DEFAULT_HEADERS:
        if name not in headers:
            out[name] = value
    if hdrs.CONTENT_LENGTH not in headers:
        if body is not None:
            out[hdrs.CONTENT_LENGTH] = str(len(body))
        elif method not in _NO_LENGTH_METHODS:
            out[hdrs.CONTENT_LENGTH] = "0"
    if hdrs.CONTENT_TYPE not in headers and (body is not None or method in _TYPED_METHODS):
        out[hdrs.CONTENT_TYPE] = "application/octet-stream"
    return _serialize_headers(f"{method} {target} HTTP/1.1", out)


class Response(HeadersMixin):
    """An upstream's answer: what the relay reads of an ``aiohttp.ClientResponse``. The body
    is ``content``, an :class:`aiohttp.StreamReader`; read to its end, the connection goes
    back to the pool; released or closed before, the connection is closed."""

    def __init__(self, method: str, url: URL, message, payload: StreamReader,
                 connection: Connection | None, done) -> None:
        self.method = method
        self.url = url
        self.version = message.version
        self.status: int = message.code
        self.reason: str = message.reason
        self._headers: CIMultiDictProxy[str] = message.headers
        self.raw_headers = message.raw_headers
        self.content = payload
        self._connection = connection
        self._done = done  # the total timeout's timer, cancelled when the exchange ends
        self._body: bytes | None = None
        self._released = False

    @property
    def headers(self) -> CIMultiDictProxy[str]:
        return self._headers

    def _ended(self) -> None:
        """The body's last byte arrived: the connection is the pool's again."""
        self._connection = None
        self._finish()

    def _finish(self) -> None:
        done, self._done = self._done, None
        if done is not None:
            done.cancel()

    async def read(self) -> bytes:
        """The whole body, decoded."""
        if self._body is None:
            try:
                self._body = await self.content.read()
            except BaseException:
                self.close()
                raise
        elif self._released:
            raise aiohttp.ClientConnectionError("Connection closed")
        return self._body

    def release(self) -> None:
        """Done with the answer: the connection goes back to the pool if its body was read
        to the end, else it is closed (what is left of the body would be read as the next
        answer)."""
        self._let_go()
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.abandon()

    def close(self) -> None:
        self.release()

    def _let_go(self) -> None:
        if not self._released:
            # As aiohttp's: a read after the release fails instead of waiting for ever.
            if self.content is not EMPTY_PAYLOAD and self.content.exception() is None:
                set_exception(self.content, _CONNECTION_CLOSED)
            self._released = True
        self._finish()

    async def __aenter__(self) -> Response:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        self.release()


class Connection(BaseProtocol):
    """One connection to an upstream, carrying one exchange at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop, pool: Pool, key: tuple) -> None:
        super().__init__(loop)
        self._pool = pool
        self.key = key
        self.tls = key[0] == "https"
        self.reused = False
        self.idle_since = 0.0
        self.should_close = False
        self.counted = True  # in the pool's count of open connections
        self._lost: asyncio.Future | None = None
        self._gone = False
        self._head: asyncio.Future | None = None
        self._message: Any = None
        self._payload: Any = None
        self._exception: BaseException | None = None
        self._received = 0
        self._read_timeout: float | None = None
        self._read_handle: asyncio.TimerHandle | None = None
        self._write_handle: asyncio.TimerHandle | None = None
        self._unsent = -1  # what was left of the request to write, at the last look
        self._last_read = 0.0
        self._timing = False
        self._plain_parser = False
        self.response: Response | None = None
        self.ended = False

    # The exchange.

    def send(self, method: str, data: bytes, body: bytes | None, timer: BaseTimerContext,
             read_timeout: float | None) -> None:
        plain = timer is _NO_TIMER and method != "HEAD"
        if not (plain and self._plain_parser and self._parser is not None):
            # A parser that read an answer to its end reads the next one on the connection
            # (llhttp reads keep-alive answers in turn); one is made for a timer or a HEAD.
            self._parser = HttpResponseParser(
                self, self._loop, READ_BUFSIZE, timer=timer,
                payload_exception=aiohttp.ClientPayloadError,
                response_with_body=method != "HEAD", read_until_eof=True,
                auto_decompress=True, max_line_size=MAX_LINE_SIZE,
                max_field_size=MAX_FIELD_SIZE, max_headers=MAX_HEADERS)
        self._plain_parser = plain
        self._message = self._payload = self._exception = self.response = None
        self._received = 0
        self.ended = False
        self._read_timeout = read_timeout
        assert self.transport is not None
        self.transport.write(data)
        if body is not None:
            self.transport.write(body)

    @property
    def answered(self) -> bool:
        """Whether any byte of an answer came."""
        return self._received > 0

    async def head(self) -> tuple[Any, Any]:
        """The answer's status and headers, with its body to come; raises what aiohttp's
        client raises when they never come."""
        # What aiohttp does too: sock_read starts once the request is written. An answer
        # that comes before is taken at once: an upstream that refuses a large body (a 413)
        # may never read the rest of it. Until then, sock_read bounds a write that stalls.
        if self._paused and self._message is None and self._exception is None:
            self._unsent = -1
            self._watch_writing()
            try:
                while self._paused and self._message is None and self._exception is None:
                    await self._wait_head()  # or for resume_writing
            finally:
                if self._write_handle is not None:
                    self._write_handle.cancel()
                    self._write_handle = None
        self._reschedule_timeout()
        while self._message is None and self._exception is None:
            await self._wait_head()
        if self._exception is not None:
            raise self._exception
        return self._message, self._payload

    def _watch_writing(self) -> None:
        """While the request is being written, an upstream that takes none of it for
        sock_read is as silent as one that answers nothing (asyncio reports no progress of a
        write but what is left of it, looked at each sock_read)."""
        self._write_handle = None
        transport = self.transport
        if not self._read_timeout or transport is None or not self._paused:
            return
        unsent = transport.get_write_buffer_size()
        if unsent == self._unsent:
            self._fail(aiohttp.SocketTimeoutError("Timeout on writing data to socket"))
            return
        self._unsent = unsent
        self._write_handle = self._loop.call_later(self._read_timeout, self._watch_writing)

    async def _wait_head(self) -> None:
        self._head = self._loop.create_future()
        try:
            await self._head
        finally:
            self._head = None

    def abandon(self) -> None:
        """The answer's reader is done with it before its end."""
        if not self.ended:
            self.should_close = True
            self._pool.put(self)

    def _fail(self, exc: BaseException, cause: BaseException | None = None) -> None:
        self.should_close = True
        self._drop_timeout()
        if self._message is None:
            if self._exception is None:
                self._exception = exc
                if cause is not None:
                    exc.__cause__ = cause
            head = self._head
            if head is not None and not head.done():
                head.set_result(None)
        elif self._payload is not EMPTY_PAYLOAD and not self._payload.is_eof():
            set_exception(self._payload, exc, cause if cause is not None else exc)

    def _body_ended(self) -> None:
        self._drop_timeout()
        self.ended = True
        response = self.response
        if response is not None:  # else the request, still to make it, puts it back
            response._ended()
            self._pool.put(self)

    # asyncio.Protocol.

    def data_received(self, data: bytes) -> None:
        parser = self._parser
        if parser is None or self.ended:
            if not data:
                return  # a reader resuming after the end (StreamReader does on every read)
            # Bytes nobody asked for: the connection cannot frame the next answer.
            self.should_close = True
            if self.transport is not None:
                self.transport.close()
            return
        if data:
            self._received += len(data)
            self._reschedule_timeout()
        try:
            messages, upgraded, _ = parser.feed_data(data)
        except BaseException as e:
            if self.transport is not None:
                self.transport.close()
            if not isinstance(e, Exception):
                raise
            if isinstance(e, HttpProcessingError):
                exc = HttpProcessingError(code=e.code, message=e.message, headers=e.headers)
            else:
                exc = HttpProcessingError()
            if self._message is not None:
                self._fail(aiohttp.ClientPayloadError(
                    f"Response payload is not completed: {e!r}"), e)
            else:
                self._fail(exc, e)
            return
        if upgraded:
            self.should_close = True
        answer = None
        for message, payload in messages:
            code = message.code
            if self._message is not None or answer is not None:  # an answer to no request
                self.should_close = True
            elif not 100 <= code < 200 or code == 101:
                # (100 Continue and 103 Early Hints are interim: the answer follows.)
                answer = message, EMPTY_PAYLOAD if code in EMPTY_BODY_STATUS_CODES else payload
        if answer is None:
            return
        message, payload = self._message, self._payload = answer
        if message.should_close:
            self.should_close = True
        head = self._head
        if head is not None and not head.done():
            head.set_result(None)
        if payload is EMPTY_PAYLOAD:
            self._body_ended()
        else:
            payload.on_eof(self._body_ended)

    def eof_received(self) -> None:
        self._drop_timeout()

    def resume_writing(self) -> None:
        super().resume_writing()
        head = self._head
        if head is not None and not head.done():
            head.set_result(None)

    def pause_reading(self) -> None:
        super().pause_reading()
        self._drop_timeout()  # sock_read measures the upstream, not the relay's reader

    def resume_reading(self, resume_parser: bool = True) -> None:
        if not self._reading_paused:
            # The StreamReader asks on every read below its low mark: reading was not paused,
            # so neither is the parser (it pauses only with it), and there is nothing to do.
            return
        super().resume_reading(resume_parser)
        if not self.ended:
            self._reschedule_timeout()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._gone = True
        self._drop_timeout()
        if self._read_handle is not None:
            self._read_handle.cancel()
            self._read_handle = None
        parser, self._parser = self._parser, None
        uncompleted = None
        if parser is not None and not self.ended:
            try:
                uncompleted = parser.feed_eof()
            except Exception as e:  # a body cut short
                message = f"Response payload is not completed: {e!r}"
                if exc is not None:
                    message = f"{message}. {exc!r}"
                if self._message is not None:
                    self._fail(aiohttp.ClientPayloadError(message), e)
        if self._message is None and self._exception is None:
            if exc is None:
                self._fail(aiohttp.ServerDisconnectedError(uncompleted))
            elif isinstance(exc, OSError):
                self._fail(aiohttp.ClientOSError(*exc.args), exc)
            else:
                self._fail(exc)
        self.should_close = True
        super().connection_lost(exc)
        if self._lost is not None and not self._lost.done():
            self._lost.set_result(None)
        self._pool.lost(self)

    # sock_read, as aiohttp's ResponseHandler keeps it.

    def _reschedule_timeout(self) -> None:
        # One timer for the connection, moved on lazily: each read only notes its time, and
        # the timer, when it fires early, sets itself for the rest; idle, it lapses (a timer
        # cancelled and made again on every read cost more than the parse).
        self._last_read = now = self._loop.time()
        if not self._read_timeout or self._reading_paused or self.ended:
            return
        self._timing = True
        due = now + self._read_timeout
        handle = self._read_handle
        if handle is None or handle.when() > due:  # none, or one set for a longer timeout
            if handle is not None:
                handle.cancel()
            self._read_handle = self._loop.call_at(due, self._timed_out)

    def _drop_timeout(self) -> None:
        self._timing = False

    def _timed_out(self) -> None:
        self._read_handle = None
        if not self._timing or not self._read_timeout:
            return
        due = self._last_read + self._read_timeout
        if self._loop.time() < due:
            self._read_handle = self._loop.call_at(due, self._timed_out)
            return
        self._fail(aiohttp.SocketTimeoutError("Timeout on reading data from socket"))

    # Closing.

    @property
    def usable(self) -> bool:
        # A request still being written when its answer ended (one that came before the
        # upstream read the body) would have the next request's bytes follow the rest of it.
        transport = self.transport
        return not self.should_close and not self._gone and transport is not None \
            and not transport.is_closing() and not transport.get_write_buffer_size()

    def shut(self, abort: bool = False) -> asyncio.Future | None:
        """Close the connection; a future for its end, or None when it has ended."""
        self.should_close = True
        transport = self.transport
        if transport is None or self._gone:
            return None
        if self._lost is None:
            self._lost = self._loop.create_future()
        if abort or transport.get_write_buffer_size():
            # (What is still to be sent of a request whose answer came would otherwise hold
            # the connection open until the upstream read it, which it may never do.)
            transport.abort()
        else:
            transport.close()
            if self.tls:
                self._loop.call_later(TLS_CLOSE_GRACE, transport.abort)
        return self._lost


class Pool:
    """Connections to the upstreams, kept alive and reused per (scheme, host, port), at most
    ``limit`` open in all (in use, idle or being opened). A request that finds every one in
    use waits for one under its connect timeout, as with aiohttp's connector; an idle
    connection to another upstream is closed to make room."""

    def __init__(self, limit: int, keepalive: float = KEEPALIVE) -> None:
        self.limit = limit
        self.keepalive = keepalive
        self._idle: dict[tuple, collections.deque[Connection]] = {}
        self._idle_count = 0
        self._open = 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self._sweeper: asyncio.TimerHandle | None = None
        self._busy: set[Connection] = set()
        self.closed = False

    @property
    def full(self) -> bool:
        """Whether every connection the limit allows is in use: a connect timeout was then
        the wait for a free one."""
        return bool(self.limit) and self._open - self._idle_count >= self.limit

    async def request(self, method: str, url: URL, target: str, headers,
                      body: bytes | None, timeout: aiohttp.ClientTimeout) -> Response:
        """Send one request and return its answer with the body to come. Raises what
        aiohttp's ``ClientSession.request`` raises for the same failures."""
        if self.closed:
            raise RuntimeError("Session is closed")
        loop = asyncio.get_running_loop()
        data = request_head(method, url, target, headers, body)
        if body is not None and len(body) <= COALESCED:
            data, body = data + body, None
        timeouts = handle = None
        timer: BaseTimerContext = _NO_TIMER
        if timeout.total:
            timeouts = TimeoutHandle(loop, timeout.total, ceil_threshold=timeout.ceil_threshold)
            handle = timeouts.start()
            timer = timeouts.timer()
        try:
            with timer:
                fresh = False
                while True:
                    try:
                        connection = await self._acquire(loop, url, timeout, fresh)
                    except asyncio.TimeoutError as exc:
                        raise aiohttp.ConnectionTimeoutError(
                            f"Connection timeout to host {url}") from exc
                    try:
                        connection.send(method, data, body, timer, timeout.sock_read)
                        message, payload = await connection.head()
                    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
                        self.put(connection)
                        if fresh or connection.answered or not (
                                connection.reused or method in _IDEMPOTENT):
                            raise
                        # The server closed the idle connection as the request went out:
                        # nothing of an answer came, so it never saw the request.
                        fresh = True
                        continue
                    except HttpProcessingError as exc:
                        self.put(connection)
                        raise aiohttp.ClientResponseError(
                            aiohttp.RequestInfo(url, method, CIMultiDictProxy(
                                CIMultiDict(headers)), url), (),
                            status=exc.code, message=exc.message, headers=exc.headers,
                        ) from exc
                    except BaseException:
                        connection.should_close = True
                        self.put(connection)
                        raise
                    break
        except BaseException:
            if timeouts is not None:
                timeouts.close()
            if handle is not None:
                handle.cancel()
            raise
        if connection.ended:
            response = Response(method, url, message, payload, None, None)
            if handle is not None:
                handle.cancel()
            self.put(connection)
        else:
            response = Response(method, url, message, payload, connection, handle)
            connection.response = response
        return response

    async def _acquire(self, loop: asyncio.AbstractEventLoop, url: URL,
                       timeout: aiohttp.ClientTimeout, fresh: bool) -> Connection:
        key = (url.scheme, url.raw_host, url.port)
        if not fresh:
            connection = self._take(key, loop.time())
            if connection is not None:
                return connection
        async with ceil_timeout(timeout.connect, timeout.ceil_threshold):
            while True:
                if not fresh:
                    connection = self._take(key, loop.time())
                    if connection is not None:
                        return connection
                if self._open < self.limit or not self.limit:
                    break
                if self._idle_count:
                    self._evict()
                    continue
                waiter = loop.create_future()
                self._waiters.append(waiter)
                try:
                    await waiter
                except BaseException:
                    if waiter.done() and not waiter.cancelled():
                        self._wake()  # the slot it was given goes to the next in line
                    else:
                        self._waiters.remove(waiter)
                    raise
            self._open += 1
            try:
                connection = await self._connect(loop, key, url)
            except BaseException:
                self._open -= 1
                self._wake()
                raise
        if self.closed:
            connection.shut(abort=True)
            raise aiohttp.ClientConnectionError("Connector is closed.")
        self._busy.add(connection)
        return connection

    async def _connect(self, loop: asyncio.AbstractEventLoop, key: tuple,
                       url: URL) -> Connection:
        host = url.raw_host
        port = url.port
        assert host is not None and port is not None
        tls = url.scheme == "https"
        if host.endswith(".."):  # as aiohttp: one trailing dot, for a fully qualified name
            host = host.rstrip(".") + "."
        # What aiohttp's errors are built from (and print as "ssl:default").
        connection_key = ConnectionKey(host, port, tls, True, None, None, None)
        try:
            context = await tls_context() if tls else None
            addresses = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                               flags=socket.AI_ADDRCONFIG)
            # As aiohttp connects: asyncio's own happy eyeballs drops the errno when every
            # address of a name fails (each message names its address), and the relay's 502
            # says "(connection refused)" from it.
            sock = await aiohappyeyeballs.start_connection(
                addresses, happy_eyeballs_delay=0.25, interleave=1, loop=loop)
            _, connection = await loop.create_connection(
                lambda: Connection(loop, self, key), sock=sock, ssl=context,
                server_hostname=host.rstrip(".") if tls else None)
        except ssl.CertificateError as exc:
            raise aiohttp.ClientConnectorCertificateError(connection_key, exc) from exc
        except ssl.SSLError as exc:
            raise aiohttp.ClientConnectorSSLError(connection_key, exc) from exc
        except OSError as exc:
            if exc.errno is None and isinstance(exc, asyncio.TimeoutError):
                raise
            if isinstance(exc, socket.gaierror):
                raise aiohttp.ClientConnectorDNSError(connection_key, exc) from exc
            raise aiohttp.ClientConnectorError(connection_key, exc) from exc
        return connection

    def _take(self, key: tuple, now: float) -> Connection | None:
        idle = self._idle.get(key)
        while idle:
            # The most recently used first: it is the least likely to have been closed by
            # the server, and the others age out.
            connection = idle.pop()
            self._idle_count -= 1
            if connection.usable and now - connection.idle_since <= self.keepalive:
                connection.reused = True
                self._busy.add(connection)
                return connection
            self._drop(connection)
        return None

    def put(self, connection: Connection) -> None:
        """Back from an exchange: kept if it can carry another, else closed."""
        if connection not in self._busy:
            return
        self._busy.discard(connection)
        if self.closed or not connection.usable or not self.keepalive:
            self._drop(connection)
            return
        loop = connection._loop
        connection.idle_since = loop.time()
        self._idle.setdefault(connection.key, collections.deque()).append(connection)
        self._idle_count += 1
        if self._sweeper is None:
            self._sweeper = loop.call_later(self.keepalive, self._sweep)
        self._wake()

    def lost(self, connection: Connection) -> None:
        """The connection ended (either side closed it)."""
        if connection in self._busy:
            return  # its exchange ends it: put() is called then
        idle = self._idle.get(connection.key)
        if idle is not None and connection in idle:
            idle.remove(connection)
            self._idle_count -= 1
            self._uncount(connection)

    def _drop(self, connection: Connection) -> None:
        connection.shut()
        self._uncount(connection)

    def _uncount(self, connection: Connection) -> None:
        if connection.counted:
            connection.counted = False
            self._open -= 1
            self._wake()

    def _evict(self) -> None:
        """Close the connection idle longest, of any upstream."""
        oldest = min((idle[0] for idle in self._idle.values() if idle),
                     key=lambda c: c.idle_since)
        self._idle[oldest.key].popleft()
        self._idle_count -= 1
        self._drop(oldest)

    def _wake(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _sweep(self) -> None:
        self._sweeper = None
        now = asyncio.get_running_loop().time()
        for key, idle in list(self._idle.items()):
            while idle and now - idle[0].idle_since >= self.keepalive:
                connection = idle.popleft()
                self._idle_count -= 1
                self._drop(connection)
            if not idle:
                del self._idle[key]
        if self._idle_count:
            self._sweeper = asyncio.get_running_loop().call_later(self.keepalive, self._sweep)

    async def close(self) -> None:
        """Close every connection, idle or in use (TLS ones aborted, as aiohttp's connector
        does on close), and wait for them to end."""
        self.closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        ending = []
        for idle in self._idle.values():
            for connection in idle:
                ending.append(connection.shut(abort=connection.tls))
                self._uncount(connection)
        self._idle.clear()
        self._idle_count = 0
        for connection in list(self._busy):
            ending.append(connection.shut(abort=True))
        waiting = [future for future in ending if future is not None]
        if waiting:
            await asyncio.wait(waiting, timeout=TLS_CLOSE_GRACE)
