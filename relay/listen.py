"""The listening socket: bounded connections, bounded header time, errors in Anthropic's format.

aiohttp answers requests its parser refuses (a bad method, an unknown ``Content-Encoding``, a
broken ``Transfer-Encoding``) with plain-text pages before any handler runs; the relay's
connections use a :class:`RequestHandler` whose ``handle_error`` answers in Anthropic's
error format instead. Connections past ``server.max_connections`` get a complete ``529
overloaded_error`` and are closed before aiohttp sees them.
"""

from __future__ import annotations

import asyncio
import logging
from http import HTTPStatus

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMethod
from aiohttp.web_protocol import RequestHandler

from .errors import STATUS_TYPES, error_body

log = logging.getLogger("relay")

OVERLOADED = error_body("overloaded_error",
                        "the relay has too many open connections; try again shortly")
_OVERLOADED_RESPONSE = (
    b"HTTP/1.1 529 Site Overloaded\r\nContent-Type: application/json\r\n"
    b"Connection: close\r\nContent-Length: " + str(len(OVERLOADED)).encode() + b"\r\n\r\n"
    + OVERLOADED)


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
        if status >= 500 or not isinstance(exc, Exception):
            self.log_exception("Error handling request", exc_info=exc)
        elif not isinstance(exc, BadHttpMethod):
            log.info("refused a request aiohttp could not parse: %s", message or exc)
        if request.writer.output_size > 0:
            raise ConnectionError("the response was already started")
        if status >= 500:
            text = "the relay failed while handling this request"
        else:
            text = (getattr(exc, "message", None) or message
                    or HTTPStatus(status).phrase).replace("\n", " ")[:500]
        response = web.Response(status=status, content_type="application/json",
                                body=error_body(STATUS_TYPES.get(status, "api_error"), text))
        response.force_close()
        return response


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
