"""The listening socket: bounded connections, bounded header time, errors in Anthropic's format.

aiohttp answers requests its parser refuses (a bad method, an unknown ``Content-Encoding``, a
broken ``Transfer-Encoding``) with plain-text pages before any handler runs; the relay's
connections use a :class:`RequestHandler` whose ``handle_error`` answers in Anthropic's
error format instead, with credential header values taken out of the parser's excerpt of
the request (:func:`redact_parser_message`). Connections past ``server.max_connections`` get
a complete ``529 overloaded_error`` and are closed before aiohttp sees them.
"""

from __future__ import annotations

import ast
import asyncio
import logging
import re
import resource
import time
from http import HTTPStatus

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMethod
from aiohttp.web_protocol import RequestHandler

from .errors import STATUS_TYPES, error_body
from .exchange import is_credential_header, new_request_id

log = logging.getLogger("relay")

OVERLOADED = error_body("overloaded_error",
                        "the relay has too many open connections; try again shortly")
_OVERLOADED_RESPONSE = (
    b"HTTP/1.1 529 Site Overloaded\r\nContent-Type: application/json\r\n"
    b"Connection: close\r\nContent-Length: " + str(len(OVERLOADED)).encode() + b"\r\n\r\n"
    + OVERLOADED)


# A bytes literal as aiohttp's parser errors quote the request (``{data!r}``).
_LITERAL = re.compile(r"b'(?:[^'\\]|\\.)*'" r'|b"(?:[^"\\]|\\.)*"')
_HEADER_LINE = re.compile(rb"([!#$%&'*+.^_`|~0-9A-Za-z-]+)[ \t]*:")
_REQUEST_LINE = re.compile(rb"[A-Z]+ [^ ?]*")
_LINE_ENDS = re.compile(rb"(\r\n|\n)")
# The caret under the excerpt, which points at the wrong place once it is redacted.
_POINTER = re.compile(r"\n *\^\s*$")
# A request target quoted as text (the pure-Python parser's InvalidURLError).
_QUERY = re.compile(r"(/[^\s?'\"]*)\?[^\s'\"]*")
REDACTED = b"[redacted]"


def redact_parser_message(text: str) -> str:
    """A parser error's text without the secrets in its excerpt of the request: the value of
    a credential header (:func:`relay.exchange.is_credential_header`) is replaced, and so is
    any other fragment that is neither a header line nor a request line (aiohttp quotes some
    header values alone, without their name: ``Got more than 8190 bytes when reading:
    b'...'``), and a request line's query."""
    def literal(match: re.Match) -> str:
        try:
            data = ast.literal_eval(match.group(0))
        except (ValueError, SyntaxError):
            return REDACTED.decode()
        return repr(b"".join(_redact_line(part) for part in _LINE_ENDS.split(data)))

    redacted = _QUERY.sub(r"\1?[redacted]", _LITERAL.sub(literal, text))
    return _POINTER.sub("", redacted) if redacted != text else text


def _redact_line(line: bytes) -> bytes:
    if line in (b"", b"\r\n", b"\n"):
        return line
    header = _HEADER_LINE.match(line)
    if header is not None:
        name = header.group(1).decode("latin-1")
        return header.group(0) + b" " + REDACTED if is_credential_header(name) else line
    request = _REQUEST_LINE.match(line)
    if request is not None:
        return request.group(0) + (b"?" + REDACTED if b"?" in line else line[request.end():])
    return REDACTED


class AnthropicErrors(RequestHandler):
    """aiohttp's connection handler, answering the requests it cannot parse (and handler
    crashes it catches) in Anthropic's error format. ``on_close`` is called once the
    connection is gone."""

    def __init__(self, manager, *, on_close=None, **kwargs):
        super().__init__(manager, **kwargs)
        self._on_close = on_close

    def connection_lost(self, exc) -> None:
        super().connection_lost(exc)
        if self._on_close is not None:
            self._on_close()
            self._on_close = None

    def handle_error(self, request, status: int = 500, exc=None, message=None):
        request_id = new_request_id()
        if status >= 500 or not isinstance(exc, Exception):
            self.log_exception("%s: error handling request", request_id, exc_info=exc)
        text = redact_parser_message(getattr(exc, "message", None) or message
                                     or HTTPStatus(status).phrase)
        if status < 500 and isinstance(exc, Exception) and not isinstance(exc, BadHttpMethod):
            log.info("%s: refused a request aiohttp could not parse: %s", request_id, text)
        if request.writer.output_size > 0:
            raise ConnectionError("the response was already started")
        if status >= 500:
            text = "the relay failed while handling this request"
        response = web.Response(
            status=status, content_type="application/json",
            # request-id as well, as every error of the relay's has it: the SDKs read an
            # error's request_id from that header.
            headers={"x-relay-request-id": request_id, "request-id": request_id},
            body=error_body(STATUS_TYPES.get(status, "api_error"),
                            text.replace("\n", " ")[:500], request_id))
        response.force_close()
        return response


def url_of(address: tuple) -> str:
    """``http://HOST:PORT`` for a bound socket's address, an IPv6 host in brackets."""
    host, port = address[0], address[1]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


# What the configured connections leave for everything else a process opens: its state,
# dumps, the provenance file, the metrics' files, the console's, the interpreter's own.
FILES_BESIDES_CONNECTIONS = 128


def fit_open_files(max_connections: int, upstream_connections: int) -> tuple[bool, str]:
    """Raise this process's soft limit on open files (``ulimit -n``) toward what the
    configured connections need, as far as its hard limit allows: with fewer, the clients past
    the limit wait unanswered in the kernel's queue instead of getting the relay's 529 at
    ``server.max_connections`` (systemd's default soft limit, 1024, is below the defaults'
    1,536 connections). Workers inherit it. Returns whether the need is met, and what to say."""
    need = max_connections + upstream_connections + FILES_BESIDES_CONNECTIONS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return True, f"open files: up to {soft}, for about {need}"
    wanted = need if hard == resource.RLIM_INFINITY else min(need, hard)
    if wanted > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError):
            wanted = soft
    if wanted >= need:
        return True, f"open files: raised the limit from {soft} to {wanted}"
    return False, (
        f"open files: this process may have {wanted} open (ulimit -n), and "
        f"server.max_connections ({max_connections}) with server.upstream_connections "
        f"({upstream_connections}) need about {need}: past the limit, new connections wait "
        f"unanswered instead of getting 529 overloaded_error; raise the limit (systemd: "
        f"LimitNOFILE) or lower server.max_connections")


class AcceptErrors:
    """The event loop's exception handler: a listening socket that cannot accept (out of file
    descriptors) is said once a minute at most, with a count, and without a traceback.

    asyncio logs every failed accept, traceback and all, and goes on trying up to the
    listen backlog (1,024) times per wake-up, each time scheduling another retry
    (python/cpython#151615): a relay at its file limit wrote thousands of lines a second, and
    spent more than half a core on them, while it waited for connections to close.
    Everything else goes to asyncio's own handler."""

    MESSAGE = "socket.accept() out of system resource"

    def __init__(self, every: float = 60.0, clock=time.monotonic):
        self.every = every
        self.clock = clock
        self.said: float | None = None
        self.since = 0  # failures not said since

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        if context.get("message") != self.MESSAGE:
            loop.default_exception_handler(context)
            return
        now = self.clock()
        if self.said is not None and now - self.said < self.every:
            self.since += 1
            return
        error = context.get("exception")
        reason = getattr(error, "strerror", None) or str(error)
        more = f"; {self.since} more since it was last said" if self.since else ""
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        log.error("cannot accept connections: %s (this process may have %s files open, "
                  "ulimit -n): new connections wait until some close%s", reason, limit, more)
        self.said = now
        self.since = 0


class _Refusal(asyncio.Protocol):
    """A connection over the cap: a complete 529 answer, then close."""

    def connection_made(self, transport) -> None:
        transport.write(_OVERLOADED_RESPONSE)
        transport.close()

    def data_received(self, data: bytes) -> None:
        pass


class Listener(web.BaseSite):
    """A TCP site whose connections are capped and handled by :class:`AnthropicErrors`.

    ``header_timeout`` is how long a connection may go without a complete request: from
    accept, and after each answer on a kept-alive connection (aiohttp's keep-alive timer, which
    only closes a connection whose handler waits for headers, so it is the header timeout
    too). Clients keep idle connections for less than that (the Python SDK 5 s, Node's
    fetch 4 s), so a shorter keep-alive costs them nothing.
    """

    def __init__(self, runner: web.BaseRunner, host: str, port: int, *, max_connections: int,
                 header_timeout: float, reuse_port: bool = False, backlog: int = 1024):
        super().__init__(runner, backlog=backlog)
        self._host = host
        self._port = port
        self._max_connections = max_connections
        self._header_timeout = header_timeout
        self._reuse_port = reuse_port
        self.open = 0  # counted from accept, not from aiohttp's bookkeeping, which lags it
        self.refused = 0

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    def _protocol(self) -> asyncio.Protocol:
        if self.open >= self._max_connections:
            self.refused += 1
            if self.refused == 1 or self.refused % 1000 == 0:
                log.warning("refused %d connection(s) over server.max_connections=%d",
                            self.refused, self._max_connections)
            return _Refusal()
        self.open += 1
        return AnthropicErrors(self._runner.server, loop=asyncio.get_running_loop(),
                               access_log=None, keepalive_timeout=self._header_timeout,
                               on_close=self._closed)

    def _closed(self) -> None:
        self.open -= 1

    async def start(self) -> None:
        await super().start()
        self._server = await asyncio.get_running_loop().create_server(
            self._protocol, self._host, self._port, backlog=self._backlog,
            reuse_address=True, reuse_port=self._reuse_port or None)
