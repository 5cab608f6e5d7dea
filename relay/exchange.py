"""The per-exchange object: what the plugins of one request/response share."""

from __future__ import annotations

import itertools
import os
import time
from typing import Any

import msgspec
import orjson

from . import skeleton
from .errors import invalid_request
from .skeleton import Skeleton


# Headers that carry credentials: never written to disk, never replayed as recorded.
CREDENTIAL_HEADERS = frozenset({"x-api-key", "authorization", "proxy-authorization", "cookie",
                                "set-cookie"})

_PROCESS = os.urandom(6).hex()
_SEQUENCE = itertools.count()


def _new_process() -> None:
    global _PROCESS, _SEQUENCE
    _PROCESS = os.urandom(6).hex()
    _SEQUENCE = itertools.count()


# A forked worker is a process of its own: without this its ids (and so its dump file
# names) would repeat its siblings'.
os.register_at_fork(after_in_child=_new_process)


def new_request_id() -> str:
    """Unique across processes (a random prefix per process) without a syscall per request."""
    return f"relay_{_PROCESS}{next(_SEQUENCE):012x}"


class Exchange:
    """One client request and everything the relay did with it.

    Plugins read and change the request through ``messages`` (or ``body``); they share the id
    ``translation`` table and append to ``timeline`` through :meth:`note`. ``state`` holds
    per-plugin scratch data, keyed by plugin name, and dies with the exchange: the relay
    keeps nothing between requests.
    """

    def __init__(self, *, endpoint: str, method: str, path: str, query: str,
                 headers, raw_body: bytes, body: dict | None = None,
                 skeleton: Skeleton | None = None, backend=None):
        self.id = new_request_id()
        self.started = time.time()
        self.endpoint = endpoint  # "messages" or "count_tokens"
        self.method = method
        self.path = path
        self.query = query
        self.client_headers = headers
        self.raw_body = raw_body
        # The request lives in one form at a time: a skeleton (what serving decodes), or the
        # full parse once something asked for ``body``; ``_sent`` once it has gone upstream.
        self._body = body
        self._skeleton = skeleton
        self._sent: bytes | None = None
        self.backend = backend
        if skeleton is not None:  # as the client asked for it
            self.model, self.stream = skeleton.model, skeleton.stream
        else:
            self.model = body.get("model") if body else None
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
    def messages(self) -> list | None:
        """The request's ``messages``, cheap to read and to change in place (then call
        :meth:`mark_changed`). In each content block, ``type``, ``id`` and ``tool_use_id`` are
        Python values; any other value is the client's JSON text as a :class:`msgspec.Raw`
        (see :mod:`relay.skeleton`) until something asks for :attr:`body`, and decoded after
        that: read one with :func:`relay.skeleton.value`. Blocks and messages may be moved,
        copied, dropped or added, with values of either kind.
        """
        if self._body is None:
            if self._skeleton is None and self._sent is not None:
                self._skeleton = skeleton.decode(self._sent)
            if self._skeleton is not None:
                return self._skeleton.messages
        body = self.body
        messages = body.get("messages") if type(body) is dict else None
        return messages if type(messages) is list else None

    @property
    def body(self):
        """The request, fully decoded. The first time a plugin asks, the values
        :attr:`messages` kept raw are decoded in place (its lists and dicts stay the ones
        plugins hold), which on a long history costs several times the skeleton: a plugin
        that needs only the conversation's shape should use ``messages``. After the request
        has gone upstream, the answer is decoded again from the bytes that were sent: a new,
        equal object."""
        if self._body is None:
            if self._skeleton is None and self._sent is not None:
                self._skeleton = skeleton.decode(self._sent)
            try:
                if self._skeleton is not None:
                    self._body = self._skeleton.to_body()
                    self._skeleton = None
                elif self._sent is not None:
                    self._body = orjson.loads(self._sent)
            except (msgspec.MsgspecError, ValueError) as e:
                if self._sent is not None:
                    raise  # the request is gone: a plugin fault now, not the client's 400
                raise invalid_request(f"request body is not valid JSON: {e}") from None
        return self._body

    @body.setter
    def body(self, value) -> None:
        """Replace the request (call :meth:`mark_changed` too, so that it goes up)."""
        self._body = value
        self._skeleton = None

    def release_body(self, sent: bytes) -> None:
        """Drop the decoded request (a large history is several times its size in objects);
        ``sent`` is what went upstream, decoded again if asked for."""
        self._sent = sent
        self._body = None
        self._skeleton = None

    def set_model(self, model: str) -> None:
        """Ask the upstream for ``model`` instead of the model the client named."""
        if self._sent is not None:
            raise RuntimeError("the request has already gone upstream")
        if self._body is not None:
            self._body["model"] = model
        else:
            self._skeleton.set_model(model)
        self._changed = True

    @property
    def quirks(self) -> dict:
        return self.backend.quirks if self.backend else {}

    @property
    def changed(self) -> bool:
        return self._changed

    def mark_changed(self) -> None:
        """Say that the request was changed in place, so it must be re-serialised."""
        self._changed = True

    def upstream_body(self) -> bytes:
        """The bytes to send up: the client's own unless a plugin changed the request."""
        if self._sent is not None:
            return self._sent
        if not self._changed:
            return self.raw_body
        if self._body is not None:
            return skeleton.encode(self._body)
        return self._skeleton.encode()

    def repaired(self, step: str, count: int, **detail) -> None:
        """Record ``count`` repairs ``step`` made to the request (changed in place): it is
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
