"""The per-exchange object: what the plugins of one request/response share."""

from __future__ import annotations

import itertools
import os
import time
from typing import Any

import orjson


# Headers that carry credentials: never written to disk, never replayed as recorded.
CREDENTIAL_HEADERS = frozenset({"x-api-key", "authorization", "proxy-authorization", "cookie",
                                "set-cookie"})

_PROCESS = os.urandom(6).hex()
_SEQUENCE = itertools.count()


def new_request_id() -> str:
    """Unique across processes (a random prefix per process) without a syscall per request."""
    return f"relay_{_PROCESS}{next(_SEQUENCE):012x}"


class Exchange:
    """One client request and everything the relay did with it.

    Plugins read and change the request through ``body``; they share the id
    ``translation`` table and append to ``timeline`` through :meth:`note`. ``state`` holds
    per-plugin scratch data, keyed by plugin name, and dies with the exchange: the relay
    keeps nothing between requests.
    """

    def __init__(self, *, endpoint: str, method: str, path: str, query: str,
                 headers, raw_body: bytes, body: dict | None, backend=None):
        self.id = new_request_id()
        self.started = time.time()
        self.endpoint = endpoint  # "messages" or "count_tokens"
        self.method = method
        self.path = path
        self.query = query
        self.client_headers = headers
        self.raw_body = raw_body
        self._body = body
        self._sent: bytes | None = None  # the bytes sent up, once the body is released
        self.backend = backend
        self.model = body.get("model") if body else None  # as the client asked for it
        self.stream = bool(body.get("stream")) if body else False
        self.translation: dict[str, dict] = {}
        self.timeline: list[dict] = []
        self.state: dict[str, Any] = {}
        self.repairs = 0
        self.response_headers: dict[str, str] = {}
        self.upstream_request: dict | None = None
        self.upstream_response: dict | None = None
        self.outcome: str | None = None
        self.error = None
        self._changed = False

    @property
    def body(self):
        """The parsed request. Once it has gone upstream the relay lets the parsed form go
        (a large history is several times its size in objects); asking for it after that
        parses the bytes that were sent, so the answer is a new, equal object."""
        if self._body is None and self._sent is not None:
            self._body = orjson.loads(self._sent)
        return self._body

    @body.setter
    def body(self, value) -> None:
        self._body = value

    def release_body(self, sent: bytes) -> None:
        """Drop the parsed request; ``sent`` is what went upstream (see :attr:`body`)."""
        self._sent = sent
        self._body = None

    @property
    def quirks(self) -> dict:
        return self.backend.quirks if self.backend else {}

    @property
    def changed(self) -> bool:
        return self._changed

    def mark_changed(self) -> None:
        """Say that ``body`` was changed in place, so it must be re-serialised."""
        self._changed = True

    def upstream_body(self) -> bytes:
        """The bytes to send up: the client's own unless a plugin changed the body."""
        if self._sent is not None:
            return self._sent
        if not self._changed:
            return self.raw_body
        return orjson.dumps(self._body)

    def repaired(self, step: str, count: int, **detail) -> None:
        """Record ``count`` repairs ``step`` made to ``body`` (changed in place): the body is
        re-serialised, the client's answer carries ``x-relay-repairs`` with the running total,
        and the timeline says what was done."""
        self.repairs += count
        self.response_headers["x-relay-repairs"] = str(self.repairs)
        self._changed = True
        self.note(step, "repaired", count=count, **detail)

    def note(self, step: str, action: str, **detail) -> None:
        """Record on the timeline what ``step`` (a plugin name, or "relay") did."""
        entry = {"t": time.time(), "step": step, "action": action}
        if detail:
            entry.update(detail)
        self.timeline.append(entry)


class UpstreamResponse:
    """A complete (non-streaming) upstream answer, as the response hooks see it."""

    __slots__ = ("status", "headers", "body", "_data", "_changed")

    def __init__(self, status: int, headers, body: bytes):
        self.status = status
        self.headers = headers
        self.body = body
        self._data = None
        self._changed = False

    @property
    def data(self):
        if self._data is None:
            self._data = orjson.loads(self.body)
        return self._data

    @property
    def changed(self) -> bool:
        return self._changed

    def mark_changed(self) -> None:
        self._changed = True

    def final_body(self) -> bytes:
        return orjson.dumps(self._data) if self._changed else self.body
