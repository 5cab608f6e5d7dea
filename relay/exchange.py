"""The per-exchange object: what the plugins of one request/response share."""

from __future__ import annotations

import dataclasses
import enum
import itertools
import os
import re
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import orjson

from . import sessions, skeleton
from .errors import RelayError, let_go, not_json
from .headers import AUTH_HEADERS, end_to_end
from .skeleton import Skeleton

# Headers that carry credentials: never written to disk, never replayed as recorded.
CREDENTIAL_HEADERS = frozenset({"x-api-key", "authorization", "proxy-authorization", "cookie",
                                "set-cookie"})
# Any other name that suggests one (``anthropic-api-key``, ``x-goog-api-key``, ``x-auth-token``,
# ``x-amz-security-token``, ``x-hub-signature-256``): gateways and SDKs invent new ones, so the
# words are matched, not a list of names. Whole words, so that ``anthropic-ratelimit-tokens-*``
# (counts, not credentials) stay readable.
CREDENTIAL_WORD = re.compile(
    r"auth|secret|passw|cookie|credential|signature|apikey|accesskey|privatekey"
    r"|.(?:token|key)$|^(?:token|key|keys|sig|jwt|bearer|pass|pwd)$")


def is_credential_header(name: str) -> bool:
    """Whether a header (or query parameter) of this name may carry a credential."""
    name = name.lower()
    return name in CREDENTIAL_HEADERS or any(
        CREDENTIAL_WORD.search(word) for word in re.split(r"[^a-z0-9]+", name) if word)

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


class Outcome(str, enum.Enum):
    """How an exchange ended: the closed set of values ``exchange.outcome`` takes (None while
    it is under way). A member is its value as a string (``Outcome.OK == "ok"``,
    ``str(Outcome.OK) == "ok"``): the metrics' ``outcome`` label, the access log's
    ``outcome=`` and a dump's ``outcome`` show the value."""

    OK = "ok"
    """The upstream's answer (any 2xx) reached the client whole."""
    REFUSED = "refused"
    """Turned away before it was routed: a bad target, Host or key, an unreadable body."""
    REJECTED = "rejected"
    """Refused by the relay or a plugin with a 4xx of its own (a history the API would refuse,
    a model no backend serves)."""
    RELAY_ERROR = "relay_error"
    """The relay failed while preparing the request (a 5xx of its own)."""
    UPSTREAM_ERROR = "upstream_error"
    """The upstream answered with a status of 300 or more, passed on to the client, or with
    an error in a 200 answer (an OpenAI-format server's), answered as that error."""
    UPSTREAM_MALFORMED = "upstream_malformed"
    """An answer or stream chunk of the wrong shape, that the relay could not translate."""
    UPSTREAM_UNREACHABLE = "upstream_unreachable"
    """No answer from the upstream (after any retries and fallbacks), or more than the relay
    takes."""
    POOL_FULL = "pool_full"
    """The relay's own upstream connections were all in use: the upstream was never asked."""
    STREAM_ERROR = "stream_error"
    """A stream that ended in an ``error`` event: see ``exchange.stream_failure``."""
    CLIENT_DISCONNECTED = "client_disconnected"
    """The client went away before its answer was complete."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


@dataclasses.dataclass(slots=True)
class UpstreamRequest:
    """What went upstream on the last attempt, as sent: built once per backend tried (every
    retry sends the same), holding the very objects that were sent, never copies."""

    url: str
    """The full upstream URL, query included."""
    headers: Any
    """The headers as sent (a :class:`multidict.CIMultiDict`), the backend's credentials
    included: a dump redacts them."""
    body: bytes | None
    """The bytes sent: the client's own unless a plugin changed the request or the backend's
    format translated it (then the translated body)."""


@dataclasses.dataclass(slots=True)
class UpstreamAnswer:
    """What came back from the upstream on the last attempt: its status and headers, and its
    body when the relay read one (a complete answer, an error's body, or for a translated
    stream the first and last bytes of the upstream's own)."""

    status: int
    """The upstream's HTTP status."""
    headers: Any
    """The upstream's headers, as received."""
    body: Any = None
    """The bytes received (None for a stream passed through, whose events are not kept)."""


@dataclasses.dataclass(slots=True)
class StreamFailure:
    """Why a stream whose headers had gone to the client ended in an ``error`` event: the
    event's ``error.message`` and ``error.type``, and what the library said (``detail``, for
    the dump and the log, never the client)."""

    message: str
    """The ``error.message`` the client was sent."""
    kind: str = "api_error"
    """The ``error.type`` the client was sent."""
    detail: str | None = None
    """The library's own account of the break (``ClientPayloadError ...``), when there was
    one."""


@dataclasses.dataclass(slots=True)
class Uncertainty:
    """Something a history rule forwarded because the API's answer to it is not on record
    (see the evidence table): where in the request, and why. Also on the timeline, as an
    ``unsure`` entry."""

    step: str
    """The plugin that was unsure."""
    location: str
    """Where in the request (``messages.3.content.1``)."""
    reason: str
    """What the relay does not know, in words."""


@dataclasses.dataclass(slots=True)
class Repair:
    """Repairs one step made to the request (also on the timeline, as ``repaired``)."""

    step: str
    """The plugin that repaired."""
    rule: str
    """Which of its rules (the step's name when it gave none)."""
    count: int
    """How many repairs."""


@dataclasses.dataclass(slots=True)
class Attempt:
    """One try at the upstream: which backend, what came back, how long it took."""

    backend: str
    """The backend's name."""
    url: str
    """Where the request went."""
    status: int | None = None
    """The upstream's status; None when it could not be reached."""
    error: str | None = None
    """Why it could not be reached (``pool full`` when the relay's own pool was), or why a
    ``200`` stream counted as a failure (``the stream opened with overloaded_error``)."""
    seconds: float = 0.0
    """From sending to the upstream's headers (or the failure)."""
    sent: float = 0.0
    """When it was sent, in seconds after the request was received (the exchange's clock):
    where a trace's attempt span begins."""
    waited: float = 0.0
    """The backoff slept before this attempt."""
    credential: str | None = None
    """The name of the backend's credential it went with (None for a backend with one key
    or none: see :mod:`relay.pools`)."""


@dataclasses.dataclass(slots=True)
class Timings:
    """When things happened, in seconds after the request was received (None: never)."""

    upstream_headers: float | None = None
    """The upstream's answer began (the last attempt's headers)."""
    first_byte: float | None = None
    """The first byte of the answer was written to the client."""
    last_byte: float | None = None
    """The answer was complete."""


@dataclasses.dataclass(slots=True)
class Answer:
    """What the client got: status, headers, the bytes of the body written and, for a stream,
    its events."""

    status: int
    """The status the client got."""
    headers: Any
    """The headers the client got."""
    size: int = 0
    """The bytes of the body written."""
    stream: bool = False
    """Whether it was a stream."""
    events: int | None = None
    """A stream's events written to the client (keep-alive pings included), counted while
    the access log is on (``server.access_log``, the record that shows them): counting is a
    scan of every byte of the stream. None otherwise."""


class Exchange:
    """One client request and everything the relay did with it: the complete record of a
    round trip, on every path (answers, streams, pass-through, refusals, disconnects).

    The request: ``method``, ``path``, ``query`` (as the client sent them), ``client_headers``,
    ``raw_body``, and ``endpoint`` (``messages``, ``count_tokens``, ``passthrough``, or
    ``refused`` for a request turned away before it was routed). Routing: ``backend``,
    ``model``, ``stream``, ``key_name`` (the inbound key's name, when auth is on) and ``key``
    (the :class:`relay.config.InboundKey` itself, with its limits). What went up:
    ``attempts`` (one :class:`Attempt` per try, retries and fallbacks included) and
    ``upstream_request`` (an :class:`UpstreamRequest`) / ``upstream_response`` (an
    :class:`UpstreamAnswer`), the last attempt's, and ``credential``, the name of the pooled
    key it went with (:mod:`relay.pools`; None without a pool). What came back: ``answer`` (an
    :class:`Answer`), ``outcome`` (an :class:`Outcome`), ``error`` (a :class:`RelayError` the
    relay answered with), ``stream_failure`` (a :class:`StreamFailure` when a stream ended in
    an error event), ``usage`` (a :class:`relay.usage.Usage`, set by the usage plugin),
    ``unreported_usage`` (the usage counts the upstream's answer did not report, which its
    format's translation gave as 0),
    ``replaced_headers`` (the upstream's answer headers a plugin's own replaced, see
    ``replaces_headers``), and ``received`` (wall-clock time) with ``timings`` (a
    :class:`Timings`).
    What the plugins found: ``repairs`` (their total), ``repaired_by`` (one :class:`Repair`
    per :meth:`repaired`), ``uncertain`` (one :class:`Uncertainty` per :meth:`unsure`),
    ``dump_path`` (the file the dump plugin is writing for it, or None),
    ``cache`` (the ``cache`` plugin's verdict on the prompt cache: None, or a dict with
    ``status`` ``hit`` / ``write`` / ``none`` / ``miss``, its ``cause``, ``where``, ``by``
    and the tokens read, written and sent fresh).

    The record's document form, the one a dump holds and ``relay replay`` reads, is made
    by :mod:`relay.document` (:func:`relay.document.to_document`,
    :func:`relay.document.from_document`), only when one is asked for.

    What the history rules must know before they judge: ``thread`` (a
    :class:`relay.threads.Thread` when the request creates or continues a server-held
    thread, with the held part where the relay saw it) and ``rules_defer`` (the betas and
    fields they defer to the upstream for, :mod:`relay.betas`).

    Plugins read and change the request through ``messages`` (or ``body``); they share the id
    ``translation`` table and append to ``timeline`` through :meth:`note`. ``state`` holds
    per-plugin scratch data, keyed by plugin name, and dies with the exchange: the relay
    keeps nothing between requests.
    """

    # Most exchanges have none of these: the class's values stand until one is recorded, so
    # that serving makes nothing for them.
    repaired_by: tuple[Repair, ...] = ()
    uncertain: tuple[Uncertainty, ...] = ()
    stream_failure: StreamFailure | None = None
    dump_path: str | None = None  # the dump written for it (the dump plugin's)
    key_name: str | None = None  # the inbound key's name, when auth is on
    repairs = 0
    upstream_request: UpstreamRequest | None = None
    upstream_response: UpstreamAnswer | None = None
    outcome: Outcome | None = None
    error: RelayError | None = None
    answer: Answer | None = None
    shaped_headers: Any = None  # what upstream_headers made, once a plugin asked for it
    # A server-held thread this request creates or continues (relay.threads.Thread).
    thread: Any = None
    # ``(kind, name)`` of the betas and fields the history rules defer to the upstream
    # for (relay.betas.deferring): they note instead of refusing.
    rules_defer: tuple = ()
    _changed = False
    _session: str | None | bool = False  # False: not worked out yet
    # Where the request chain may go on from the session's previous request
    # (relay.resume.Resume), for the plugins that can; None: resuming is off.
    resume: Any = None
    # What the answer reported it used and what that cost (a relay.usage.Usage), set by the
    # usage plugin as soon as it is known; None without that plugin, or before an answer.
    usage: Any = None
    # The usage counts (Anthropic's names) the upstream's answer did not report, which its
    # format's translation had to give as 0 (relay.formats.base.Adapter.answer_body, and a
    # translated stream's Translator.unreported, filled in as its message_delta is made).
    unreported_usage: Sequence[str] = ()
    # The inbound key (a relay.config.InboundKey) the client authenticated with, when auth is
    # on: its limits are the limits plugin's.
    key: Any = None
    # Name prefixes (lower case) of upstream answer headers the relay's own replace: a plugin
    # that sets its own in ``response_headers`` in place of a family of the upstream's (the
    # key's quota for the pooled account's) names it here; what the upstream sent of it is
    # kept in ``replaced_headers``.
    replaces_headers: tuple[str, ...] = ()
    replaced_headers: dict[str, str] | None = None
    # The name of the backend credential the last attempt went with (relay.pools); None
    # for a backend with one key or none.
    credential: str | None = None
    # The prompt cache's outcome for this request (the cache plugin's, plugins/cache.py):
    # None, or ``{"status": "hit" | "write" | "none" | "miss", "cause", "where", "by", ...}``.
    cache: dict | None = None

    def __init__(self, *, endpoint: str, method: str, path: str, query: str,
                 headers, raw_body: bytes = b"", body: dict | None = None,
                 skeleton: Skeleton | None = None, backend=None):
        self.id = new_request_id()
        self.received = time.time()
        self._clock = time.perf_counter()
        self.endpoint = endpoint
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
        self.model: str | None
        if skeleton is not None:  # as the client asked for it
            self.model, self.stream = skeleton.model, skeleton.stream
        else:
            self.model = body.get("model") if body else None
            self.stream = bool(body.get("stream")) if body else False
        self.translation: dict[str, dict] = {}
        self.timeline: list[dict] = []
        self.state: dict[str, Any] = {}
        self.response_headers: dict[str, str] = {}
        self.attempts: list[Attempt] = []
        self.timings = Timings()

    def session(self) -> str | None:
        """The conversation this request belongs to (:func:`relay.sessions.session_key`:
        an opaque digest, namespaced by the inbound key), worked out once on first use."""
        if self._session is False:
            found = None
            opening = self.thread.opening(self.raw_body) \
                if self.thread is not None and self.raw_body else None
            if opening is not None:
                # A continuation of a thread the upstream holds: the conversation's session,
                # on the credential that holds it (a pool's keys are accounts of their own).
                found, _ = sessions.session_of(opening, self.client_headers, self.key_name)
            elif self._changed and self.raw_body and self.thread is None:
                # The client's request, not what plugins made of it: a repair of the first
                # message must not move the request into another session than the one the
                # same request resumed (keyed before the chain runs) or not repaired is in.
                # A carried thread's conversation is the exchange's, not its new turn's.
                found, _ = sessions.session_of(self.raw_body, self.client_headers,
                                               self.key_name)
            self._session = found if found is not None else sessions.session_key(self)
        return self._session  # type: ignore[return-value]

    @property
    def upstream_headers(self):
        """The headers the request goes upstream with, for a plugin to add, change or remove
        (in ``relay_request``): the client's end-to-end headers, without credentials. The
        backend's credentials are added by the host after the plugins have run; a plugin can
        neither read nor replace them (an ``x-api-key`` or ``Authorization`` set here is
        dropped)."""
        if self.shaped_headers is None:
            shaped = end_to_end(self.client_headers)
            for name in AUTH_HEADERS:
                shaped.popall(name, None)
            self.shaped_headers = shaped
        return self.shaped_headers

    def follow(self, previous: Exchange) -> None:
        """Take over from ``previous``, whose backend failed: one client request keeps one id,
        one clock, and the record of every attempt and step before this one."""
        self.id = previous.id
        # This exchange's entries so far moved onto the clock it takes over (its wall-clock
        # start may be off from the previous one's clock, should the wall clock have moved).
        shift = previous.received + (self._clock - previous._clock) - self.received
        for entry in self.timeline:
            entry["t"] += shift
        self.received = previous.received
        self._clock = previous._clock
        self.key_name = previous.key_name
        self.key = previous.key
        self.attempts = previous.attempts + self.attempts
        self.timeline = previous.timeline + self.timeline
        # Not the previous exchange's repairs and doubts: the chain ran again over the same
        # request for this backend, and what it found here is what went up (the header, the
        # ledger's count and the metrics then agree; the timeline keeps both).
        self.response_headers["x-relay-request-id"] = self.id

    def elapsed(self) -> float:
        """Seconds since the request was received."""
        return time.perf_counter() - self._clock

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
                raise not_json(e) from None
        return self._body

    @body.setter
    def body(self, value) -> None:
        """Replace the request (call :meth:`mark_changed` too, so that it goes up)."""
        self._body = value
        self._skeleton = None

    def field(self, name: str):
        """A top-level field of the request (``thinking``, ``tools``), decoded, without
        decoding the whole history; None when the request has none."""
        if self._body is None and self._skeleton is not None:
            return self._skeleton.field(name)
        body = self.body
        return body.get(name) if type(body) is dict else None

    def set_field(self, name: str, value) -> None:
        """Set a top-level field of the request (call :meth:`mark_changed` too); ``value``
        may be a :class:`msgspec.Raw`, JSON text sent as it is."""
        if self._body is None and self._skeleton is not None:
            self._skeleton.set_field(name, value)
        elif type(self.body) is dict:
            self.body[name] = skeleton.value(value)

    def drop_field(self, name: str) -> None:
        """Remove a top-level field from the request (call :meth:`mark_changed` too)."""
        if self._body is None and self._skeleton is not None:
            self._skeleton.drop_field(name)
        elif type(self.body) is dict:
            self.body.pop(name, None)

    def other_fields(self):
        """The names of the request's top-level fields outside
        :data:`relay.skeleton.KNOWN_FIELDS`, without decoding the request."""
        if self._body is None and self._skeleton is not None:
            return self._skeleton.other_fields()
        body = self.body
        return [name for name in body if name not in skeleton.KNOWN_NAMES] \
            if type(body) is dict else ()

    def release_body(self, sent: bytes) -> None:
        """Drop the decoded request (a large history is several times its size in objects);
        ``sent`` is what went upstream, decoded again if asked for."""
        self._sent = sent
        self._body = None
        self._skeleton = None

    def close(self) -> None:
        """The exchange is over (its end hooks and trace done): its error lets go of it
        (:func:`relay.errors.let_go`), so that it and its body are freed as its handler
        returns."""
        let_go(self.error)

    def set_model(self, model: str) -> None:
        """Ask the upstream for ``model`` instead of the model the client named."""
        if self._sent is not None:
            raise RuntimeError("the request has already gone upstream")
        if self._body is not None:
            self._body["model"] = model
        elif self._skeleton is not None:
            self._skeleton.set_model(model)
        else:
            raise RuntimeError("the exchange holds no request")
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
        if self._skeleton is None:
            raise RuntimeError("the exchange holds no request")
        return self._skeleton.encode()

    def repaired(self, step: str, count: int, **detail) -> None:
        """Record ``count`` repairs ``step`` made to the request (changed in place): it is
        re-serialised, the client's answer carries ``x-relay-repairs`` with the running total,
        and the timeline says what was done."""
        self.repairs += count
        self.repaired_by += (Repair(step, str(detail.get("rule", step)), count),)
        self.response_headers["x-relay-repairs"] = str(self.repairs)
        self._changed = True
        self.note(step, "repaired", count=count, **detail)

    def unsure(self, step: str, location: str, reason: str) -> None:
        """Record that ``step`` forwarded something at ``location`` whose answer from the API
        is not on record (``reason``): in :attr:`uncertain`, and on the timeline as
        ``unsure``."""
        self.uncertain += (Uncertainty(step, location, reason),)
        self.note(step, "unsure", location=location, reason=reason)

    def stream_failed(self, message: str, kind: str = "api_error",
                      detail: str | None = None) -> None:
        """Record that the stream ended in an ``error`` event saying ``message`` (of type
        ``kind``): in :attr:`stream_failure`, and on the timeline as ``stream error``.
        ``detail`` is what the library said, for the dump and the log."""
        self.stream_failure = StreamFailure(message, kind, detail)
        if detail:
            self.note("relay", "stream error", message=message, detail=detail)
        else:
            self.note("relay", "stream error", message=message)

    def noted(self, step: str, *actions: str) -> list[dict]:
        """The timeline entries ``step`` made with one of ``actions``, in order: how a plugin
        reads what another documents it notes (the dump plugin's ``queued`` and ``dropped``,
        the portable plugin's ``provenance missed``), without either knowing the other."""
        return [entry for entry in self.timeline
                if entry.get("step") == step and entry.get("action") in actions]

    def flag(self, note: str) -> None:
        """Add ``note`` (a short token) to the answer's ``x-relay-notes`` header, once."""
        headers = self.response_headers
        present = headers.get("x-relay-notes")
        if present is None:
            headers["x-relay-notes"] = note
        elif note not in present.split(", "):
            headers["x-relay-notes"] = f"{present}, {note}"

    def note(self, step: str, action: str, **detail) -> None:
        """Record on the timeline what ``step`` (a plugin name, or "relay") did."""
        # Wall-clock time read on the exchange's own clock: the wall clock may be stepped or
        # slewed during an exchange, and a trace puts these beside the attempts' times.
        entry = {"t": self.received + (time.perf_counter() - self._clock), "step": step,
                 "action": action}
        if detail:
            entry.update(detail)
        self.timeline.append(entry)


class UpstreamResponse:
    """A complete (non-streaming) upstream answer, as the response hooks see it."""

    __slots__ = ("status", "headers", "body", "_data", "_parsed", "_changed")

    def __init__(self, status: int, headers, body: bytes):
        self.status = status
        self.headers = headers
        self.body = body
        self._data = None
        self._parsed = False
        self._changed = False

    @property
    def data(self):
        """The parsed body, or None when it is not JSON (an upstream's fault, passed on as it
        came: no plugin has anything to read in it)."""
        if self._data is None and not self._parsed:
            self._parsed = True
            try:
                self._data = orjson.loads(self.body)
            except orjson.JSONDecodeError:
                self._data = None
        return self._data

    @property
    def changed(self) -> bool:
        return self._changed

    def mark_changed(self) -> None:
        self._changed = True

    def final_body(self) -> bytes:
        return orjson.dumps(self._data) if self._changed else self.body
