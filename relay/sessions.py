"""Which requests form one conversation: the relay's own rule, in one place, for everything
that keeps something per session (a sticky upstream credential, the session record, cache
health).

In order:

1. Claude Code's ``X-Claude-Code-Session-Id`` header: the CLI sends it on every request of
   a session, the same across ``--resume``;
2. else the request's ``metadata.user_id``, which the API documents as an opaque id of the
   end user and which clients such as Claude Code fill with a per-session value;
3. else a fingerprint of what stays fixed through a conversation: ``system``, ``tools`` and
   the first message, with every ``cache_control`` taken out (clients move their cache
   breakpoints forward each turn, so a fingerprint that held them would change every turn).
   The model is not in it, so a ``/model`` switch stays the same session.

The key is namespaced by the inbound key's name, so two tenants never share a session, and
is a short hex digest: it never holds what the client sent.

Per session the relay keeps a :class:`Record` (turns, backends and models used, repairs,
rewrites, cache figures, and the *lanes*: the last requests' prompt-cache fingerprints, see
:mod:`relay.cache`), in a :class:`Records` store: bounded by count and by bytes, each record
expiring after ``max_age`` seconds unused; in process memory by default, on the host's state
seam (namespace ``sessions``) when the state is shared between processes.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import logging
import time
from typing import Any

import msgspec
import orjson

from . import skeleton
from .cache import Fingerprint

log = logging.getLogger("relay.sessions")

HEADER = "x-claude-code-session-id"
MAX_ID = 256  # longer header or user_id values are hashed like any other


def session_key(exchange) -> str | None:
    """The session this request belongs to, or None for a request without messages."""
    messages = exchange.messages
    if not messages:
        return None
    tenant = (exchange.key_name or "").encode()
    header = exchange.client_headers.get(HEADER)
    if header:
        return _short_digest(b"h", tenant, header.encode()[:MAX_ID])
    metadata = exchange.field("metadata")
    user = metadata.get("user_id") if isinstance(metadata, dict) else None
    if isinstance(user, str) and user:
        return _short_digest(b"u", tenant, user.encode()[:MAX_ID])
    fixed = [_without_cache_control(exchange.field("system")),
             _without_cache_control(exchange.field("tools")),
             _without_cache_control(skeleton.value(messages[0]))]
    return _digest(b"f", tenant, orjson.dumps(fixed, option=orjson.OPT_SORT_KEYS,
                                              default=skeleton.value))


class _Unread(list):
    """A probe's messages before anything asked to read them: the request has some (the
    session rule only asks whether it has any before it looks at the header)."""

    def __init__(self, probe: _Probe):
        super().__init__()
        self.probe = probe

    def __bool__(self) -> bool:
        return True

    def __getitem__(self, index):
        return self.probe.skeleton().messages[index]


class _Probe:
    """What :func:`session_key` reads of a request, decoded only if the rule
    gets that far (a request with Claude Code's session header decodes nothing)."""

    def __init__(self, raw: bytes, headers, key_name: str | None):
        self.raw = raw
        self.client_headers = headers
        self.key_name = key_name
        self.decoded: skeleton.Skeleton | None | bool = False

    def skeleton(self):
        if self.decoded is False:
            self.decoded = skeleton.decode(self.raw)
        if self.decoded is None:
            raise LookupError("no skeleton")
        return self.decoded

    @property
    def messages(self):
        return _Unread(self)

    def field(self, name: str):
        return self.skeleton().field(name)


def session_of(raw: bytes, headers, key_name: str | None) -> tuple[str | None, Any]:
    """The request's session by the relay's rule, and its skeleton when working it out took
    decoding the body (else None)."""
    probe = _Probe(raw, headers, key_name)
    try:
        found = session_key(probe)
    except (LookupError, TypeError, ValueError):
        found = None
    decoded = probe.decoded if isinstance(probe.decoded, skeleton.Skeleton) else None
    return found, decoded


# The same session id comes with every request of a session: its digest is remembered (a
# pure function of short values: at most about 2 MB for the sessions in flight).
@functools.lru_cache(maxsize=4096)
def _short_digest(kind: bytes, tenant: bytes, value: bytes) -> str:
    return _digest(kind, tenant, value)


def _digest(kind: bytes, tenant: bytes, value: bytes) -> str:
    # Each part with its length in front, hashed in one call: the parts joined are the
    # bytes a hasher fed part by part would see.
    return hashlib.blake2b(b"".join((
        len(kind).to_bytes(4, "big"), kind, len(tenant).to_bytes(4, "big"), tenant,
        len(value).to_bytes(4, "big"), value)), digest_size=12).hexdigest()


def _without_cache_control(item):
    kind = item.__class__
    if kind is str or item is None:  # most values: nothing to take out
        return item
    if kind is dict or isinstance(item, dict):
        return {k: _without_cache_control(v) for k, v in item.items() if k != "cache_control"}
    if kind is list or isinstance(item, list):
        return [_without_cache_control(v) for v in item]
    return item


# --- the session record -------------------------------------------------------------------

# Requests of one session that keep prefixes of their own: Claude Code's main loop, its
# subagents and its small-model calls share one session id, and each prefix is cached apart.
MAX_LANES = 4
MAX_SESSIONS = 10_000
MAX_BYTES = 64 * 1024 * 1024
# The longest cache lifetime is an hour (ttl "1h"); a record idle past two has nothing left
# to explain.
MAX_AGE = 7200.0
WARN_EVERY = 60.0  # seconds between warnings that the shared state failed


@dataclasses.dataclass(slots=True)
class Lane:
    """One prefix of a session as its last request sent it: the fingerprint of what went up
    (``upstream``) and of what the client sent (``client``; None when they were the same
    bytes), when (``time``, the request's arrival), where (``backend``, ``credential``), who
    rewrote it (``rewriters``), its input tokens all told (``tokens``: fresh, read and
    written; None when unknown) and whether the upstream cached any of it (``cached``)."""

    upstream: Fingerprint
    client: Fingerprint | None
    time: float
    backend: str | None
    credential: str | None
    rewriters: tuple[str, ...] = ()
    tokens: int | None = None
    cached: bool = False

    def nbytes(self) -> int:
        return 120 + self.upstream.nbytes() + (self.client.nbytes() if self.client else 0)

    def to_tuple(self) -> tuple:
        return (self.upstream.to_bytes(), self.client.to_bytes() if self.client else None,
                self.time, self.backend, self.credential, list(self.rewriters), self.tokens,
                self.cached)

    @classmethod
    def from_tuple(cls, item) -> Lane:
        upstream, client, when, backend, credential, rewriters, tokens, cached = item
        return cls(Fingerprint.from_bytes(upstream),
                   Fingerprint.from_bytes(client) if client else None, when, backend,
                   credential, tuple(rewriters), tokens, cached)


@dataclasses.dataclass(slots=True)
class Record:
    """What the relay knows of one session: ``turns`` answered, by ``backends`` and
    ``models`` (counts), ``repairs`` made, ``rewrites`` (requests each plugin rewrote), the
    cache figures summed over its answers (``read``, ``written``, ``fresh`` input tokens),
    ``breaks`` (cache breaks by cause), ``started`` and ``updated`` (epoch seconds) and its
    ``lanes`` (most recent first)."""

    started: float
    updated: float
    turns: int = 0
    backends: dict[str, int] = dataclasses.field(default_factory=dict)
    models: dict[str, int] = dataclasses.field(default_factory=dict)
    repairs: int = 0
    rewrites: dict[str, int] = dataclasses.field(default_factory=dict)
    read: int = 0
    written: int = 0
    fresh: int = 0
    breaks: dict[str, int] = dataclasses.field(default_factory=dict)
    lanes: list[Lane] = dataclasses.field(default_factory=list)

    def nbytes(self) -> int:
        """Roughly what the record holds in memory."""
        # Measured: about 1 kB of Python objects besides the fingerprints (tracemalloc).
        return 1400 + 80 * (len(self.backends) + len(self.models) + len(self.rewrites)
                           + len(self.breaks)) + sum(lane.nbytes() for lane in self.lanes)

    def summary(self) -> dict:
        """The record without its fingerprints: what a person or a console is shown."""
        return {"started": self.started, "updated": self.updated, "turns": self.turns,
                "backends": dict(self.backends), "models": dict(self.models),
                "repairs": self.repairs, "rewrites": dict(self.rewrites),
                "cache": {"read_input_tokens": self.read, "written_input_tokens": self.written,
                          "fresh_input_tokens": self.fresh, "breaks": dict(self.breaks)}}

    def to_bytes(self) -> bytes:
        return msgspec.msgpack.encode((
            self.started, self.updated, self.turns, self.backends, self.models, self.repairs,
            self.rewrites, self.read, self.written, self.fresh, self.breaks,
            [lane.to_tuple() for lane in self.lanes]))

    @classmethod
    def from_bytes(cls, raw: bytes) -> Record:
        (started, updated, turns, backends, models, repairs, rewrites, read, written, fresh,
         breaks, lanes) = msgspec.msgpack.decode(raw)
        return cls(started, updated, turns, backends, models, repairs, rewrites, read,
                   written, fresh, breaks, [Lane.from_tuple(lane) for lane in lanes])


class Records:
    """Records by key in this process: least recently used out first past ``max_entries``
    or ``max_bytes``, and each gone ``max_age`` seconds after its last use. Values are
    anything with ``nbytes()``. Coroutines, like the shared store's, so callers need not
    know which they hold."""

    shared = False

    def __init__(self, max_entries: int = MAX_SESSIONS, max_bytes: int = MAX_BYTES,
                 max_age: float = MAX_AGE, clock=time.monotonic):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.max_age = max_age
        self.bytes = 0
        self._clock = clock
        self._entries: collections.OrderedDict[str, tuple[float, int, object]] = \
            collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    async def get(self, key: str):
        entry = self._entries.get(key)
        if entry is None:
            return None
        if self._clock() - entry[0] > self.max_age:
            self._drop(key)
            return None
        return entry[2]

    async def put(self, key: str, value) -> None:
        if key in self._entries:
            self._drop(key)
        size = value.nbytes()
        now = self._clock()
        self._entries[key] = (now, size, value)
        self.bytes += size
        entries = self._entries
        while entries and (len(entries) > self.max_entries or self.bytes > self.max_bytes
                           or now - next(iter(entries.values()))[0] > self.max_age):
            self._drop(next(iter(entries)))

    def _drop(self, key: str) -> None:
        _, size, _ = self._entries.pop(key)
        self.bytes -= size


class SharedRecords:
    """Records on the host's state seam (:class:`relay.state.State`), under ``namespace``,
    each expiring ``max_age`` seconds after its last write: what replicas and workers
    share. The state backend bounds what it holds. A state that cannot be reached is a
    record not found (a warning in the log): the cache's account of that request is then
    the one of a session's first."""

    shared = True

    def __init__(self, state, namespace: str, decode, max_age: float = MAX_AGE,
                 behind: bool = False):
        self.state = state
        self.namespace = namespace
        self.decode = decode
        self.max_age = max_age
        # Written behind (State.put_soon): the caller does not wait for the store, and other
        # processes read the record once it lands, milliseconds later.
        self.behind = behind
        self._failures = 0
        self._warned = -WARN_EVERY

    def _failed(self, doing: str, error: Exception) -> None:
        """Log a failure at most once a minute, with how many there were in between."""
        self._failures += 1
        now = time.monotonic()
        if now - self._warned >= WARN_EVERY:
            log.warning("session records (%s): the state could not be %s (%s); %d failure(s) "
                        "since the last warning", self.namespace, doing, error, self._failures)
            self._warned, self._failures = now, 0

    async def get(self, key: str):
        try:
            found = await self.state.get(self.namespace, [key])
        except Exception as e:  # the seam's Unavailable, or a backend's own failure
            self._failed("read", e)
            return None
        raw = found[0] if found else None
        if raw is None:
            return None
        try:
            return self.decode(raw)
        except (msgspec.MsgspecError, ValueError, TypeError):
            return None  # written by another version of the relay: start afresh

    async def put(self, key: str, value) -> None:
        try:
            if self.behind:
                self.state.put_soon(self.namespace, {key: value.to_bytes()}, self.max_age)
            else:
                await self.state.put(self.namespace, {key: value.to_bytes()}, self.max_age)
        except Exception as e:
            self._failed("written", e)
