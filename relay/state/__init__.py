"""The host's shared state: what more than one request (and, with workers or replicas, more
than one process) must agree on.

One :class:`State` per running relay, opened from relay.yaml's ``state:`` section by
:func:`open_state` when the chain starts and closed when it stops. Plugins receive it as the
``state`` argument of ``relay_startup`` and ``relay_routes`` and keep it. It holds:

- **windowed counters** (:meth:`State.take`, :meth:`State.add`): rate limits and budgets.
  Windows are fixed and aligned to UTC (the minute, the day, the ISO week from Monday, the
  calendar month), so every process computes the same window and its end, which is what a
  ``retry-after`` or ``anthropic-ratelimit-*-reset`` names;
- **concurrency slots** (:meth:`State.take` with ``slots``, :meth:`State.release`), leased
  so that a process that dies gives its slots back when the lease runs out;
- **the ledger** (:meth:`State.record`, :meth:`State.rows`): one row per exchange,
  idempotent by the row's ``id``;
- **the relay's own keys** (:meth:`State.keys`, :meth:`State.put_key`), versioned so a
  serving relay notices a change with one cheap read;
- a **key-value store** with expiry, by namespace (:meth:`State.get`, :meth:`State.put`,
  :meth:`State.delete`), for records such as thinking provenance, sticky sessions, cooldowns.

Where the state lives is the backend's business: :class:`relay.state.memory.MemoryState` (one
process; the default), :class:`relay.state.sqlite.SQLiteState` (``sqlite:///PATH``: one file
for the workers of one host), :class:`relay.state.redis.RedisState` (``redis://``: replicas
on several hosts); :func:`open_state` puts :class:`relay.state.lease.LeasedState` in front
of the shared ones, so that what is far from its limits is spent in memory. Each method is
one round trip at most. :meth:`State.add`, :meth:`State.release`, :meth:`State.record` and
:meth:`State.put_soon` owe no answer: the shared backends queue them and send them with the
next call (or within milliseconds), so they cost a request next to nothing; a process
always reads its own writes.

**When the backend cannot be reached** a method raises :class:`Unavailable` after at most
``timeout`` seconds (:meth:`State.rows`, an operator's read that no request waits for, gets
ten; and right after a failure every method raises at once: no request waits for a store
that is out), the backend counts it in :attr:`State.unavailable_count` (the metrics plugin's
``relay_state_unavailable_total``) and logs a warning at most once a minute. What the caller
then does is ``State.on_unavailable``, the operator's choice:

- ``open`` (the default): go on without the state, as if the limit had room: the request
  is served and not counted (a rate limit or budget is not enforced while the store is out);
- ``closed``: refuse what needs the state, with a 503 in Anthropic's error format
  (``RelayError(503, ...)``: a status clients retry), never a traceback.

Only the caller knows what "needs the state" means (a key with limits does; a key without
none may still pass), so the seam raises and the caller decides; nothing here refuses.
:meth:`State.record` never raises: rows that cannot be written are kept (bounded) and
written when the backend is back.
"""

from __future__ import annotations

import asyncio
import calendar
import dataclasses
import datetime
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from ..errors import ConfigError
from ..options import Option

PERIODS = ("minute", "hour", "day", "week", "month")

OPTIONS = (
    Option("url", str, "",
           "Where shared state lives: empty for this process's memory, `sqlite:///PATH` for "
           "one file shared by the workers of one host, `redis://HOST:PORT/DB` (or "
           "`rediss://`) for replicas on several hosts."),
    Option("on_unavailable", str, "open",
           "When the state cannot be reached: `open` lets requests through without it (with "
           "a warning and the `relay_state_unavailable_total` metric), `closed` refuses what "
           "needs it with a 503.", choices=("open", "closed")),
    Option("timeout", float, 0.25,
           "Seconds one round trip to the state may take before it counts as unreachable."),
    Option("retention_days", int, 90, "Days the ledger keeps a row."),
)


class Unavailable(Exception):
    """The state backend could not be reached (or did not answer within ``timeout``)."""


def lost(where: str, rows: int, adds: int, puts: int) -> None:
    """Said when a backend closes with writes it could not make: they were in memory only."""
    logging.getLogger("relay.state").warning(
        "state %s: closed while unreachable: %d ledger rows, %d counters' adds and %d "
        "key-value entries were not written and are lost", where, rows, adds, puts)


class Seldom:
    """A warning logged at most once every ``every`` seconds, then with the count of what
    it held back since: what an outage would otherwise say again for every request."""

    def __init__(self, log: logging.Logger, every: float = 60.0):
        self.log = log
        self.every = every
        self._last: float | None = None
        self._held = 0
        self._lock = threading.Lock()  # SQLite's worker thread warns too

    def warn(self, count: int, message: str, *args: Any) -> None:
        now = time.monotonic()
        with self._lock:
            if self._last is not None and now - self._last < self.every:
                self._held += count
                return
            self._last, held, self._held = now, self._held, 0
        if held:
            message += "; %d more since the last warning"
            args = (*args, held)
        self.log.warning(message, *args)


def window(per: str, now: float) -> tuple[int, int]:
    """The fixed UTC window of kind ``per`` holding the instant ``now``: ``(start, end)`` in
    whole epoch seconds, end exclusive."""
    t = int(now)
    if per == "minute":
        start = t - t % 60
        return start, start + 60
    if per == "hour":
        start = t - t % 3600
        return start, start + 3600
    day = t - t % 86400
    if per == "day":
        return day, day + 86400
    if per == "week":
        start = day - datetime.datetime.fromtimestamp(day, datetime.timezone.utc).weekday() * 86400
        return start, start + 7 * 86400
    if per == "month":
        date = datetime.datetime.fromtimestamp(t, datetime.timezone.utc)
        start = calendar.timegm((date.year, date.month, 1, 0, 0, 0))
        year, month = (date.year + 1, 1) if date.month == 12 else (date.year, date.month + 1)
        return start, calendar.timegm((year, month, 1, 0, 0, 0))
    raise ValueError(f"unknown period {per!r}")


# Counter, Count and Taken are made several times for every request: named tuples, which
# are made in one step, where a frozen dataclass sets each field in turn. On the hottest
# paths they are made with ``made(Kind, (every field, in order))``: tuple's own constructor,
# where a named tuple's is a Python function.
made = tuple.__new__


class Counter(NamedTuple):
    """One windowed count: ``name`` (``"key:team-a:rpm"``, the caller's), its window kind
    (one of :data:`PERIODS`), the ``limit`` it may not pass (None: counted, never refused) and
    the ``amount`` to add (0: only check that the count is under the limit)."""

    name: str
    per: str
    limit: int | None = None
    amount: int = 1


@dataclasses.dataclass(frozen=True, slots=True)
class Slot:
    """A concurrency slot to take: at most ``limit`` held under ``name`` at once; a slot not
    released within ``lease`` seconds is given back by itself. ``units`` slots are taken
    under the one release token (a block, :mod:`relay.state.lease`), when that many are
    free."""

    name: str
    limit: int
    lease: float = 900.0
    units: int = 1


class Count(NamedTuple):
    """A counter as :meth:`State.take` left it: ``used`` in the window (after the take, when
    it was granted), its ``limit``, and ``reset``, the epoch second its window ends."""

    name: str
    used: int
    limit: int | None
    reset: int


class Taken(NamedTuple):
    """What :meth:`State.take` decided. ``granted``: every counter was under its limit and
    every slot free, and all were taken; otherwise nothing was. ``blocked`` names the first
    counter or slot that refused (its ``name``); ``counts`` are the counters in the order
    given; ``tokens`` the slots' release tokens (in the order given) when granted;
    ``slot_retry`` the seconds until the blocking slot's oldest lease runs out."""

    granted: bool
    counts: tuple[Count, ...]
    tokens: tuple[str, ...] = ()
    blocked: str | None = None
    slot_retry: float = 0.0


class State:
    """The interface every state backend implements (all methods are coroutines)."""

    on_unavailable: str = "open"
    timeout: float = 0.25
    kind: str = "memory"  # memory | sqlite | redis: for logs, metrics and docs
    # Calls that found the backend unreachable (raised Unavailable), since it was opened.
    unavailable_count: int = 0

    async def take(self, counters: Sequence[Counter], slots: Sequence[Slot] = (),
                   now: float | None = None) -> Taken:
        """Atomically across every process sharing this state: when each counter with a
        limit has ``used + amount <= limit`` (``used < limit`` for an amount of 0) and each
        slot has fewer than ``limit`` held, add every amount, take every slot and grant;
        otherwise change nothing. Counters without a limit are added in either case only
        when granted."""
        raise NotImplementedError

    async def add(self, counters: Iterable[Counter], now: float | None = None) -> None:
        """Add each counter's amount to its window, unconditionally (usage known only after
        the answer: tokens, spend)."""
        self.add_soon(counters, now)

    async def counts(self, counters: Iterable[Counter], now: float | None = None
                     ) -> list[Count]:
        """Read counters without changing them (their amounts are ignored)."""
        raise NotImplementedError

    # What every request does, without a coroutine each: a take this process can decide in
    # its memory, and what owes no answer (every backend queues it: the coroutines above
    # only call these).

    def take_now(self, counters: Sequence[Counter], slots: Sequence[Slot] = (),
                 now: float | None = None) -> Taken | None:
        """:meth:`take` decided in this process's memory when it can be (what leases hold,
        :mod:`relay.state.lease`), else None: then ask with :meth:`take`."""
        return None

    def add_soon(self, counters: Iterable[Counter], now: float | None = None) -> None:
        """:meth:`add` without a coroutine: queued at once, owing no answer."""
        raise NotImplementedError

    def release_soon(self, name: str, token: str) -> None:
        """:meth:`release` without a coroutine: queued at once, owing no answer."""
        raise NotImplementedError

    def record_soon(self, rows: Sequence[dict[str, Any]]) -> None:
        """:meth:`record` without a coroutine: queued at once, never raising."""
        raise NotImplementedError

    async def release(self, name: str, token: str) -> None:
        """Give back a slot taken under ``name``; releasing twice, or after the lease ran
        out, does nothing."""
        self.release_soon(name, token)

    async def record(self, rows: Sequence[dict[str, Any]]) -> None:
        """Append ledger rows, each a JSON-able mapping with a unique ``id`` (the exchange id)
        and ``time`` (epoch seconds, a float). A row whose id is already there is ignored, so
        a retried write never counts twice. Never raises: when the backend is unreachable the
        rows wait (bounded) and are written when it is back."""
        self.record_soon(rows)

    async def rows(self, since: float | None = None, until: float | None = None,
                   where: dict[str, Any] | None = None, limit: int | None = None,
                   newest_first: bool = False) -> list[dict[str, Any]]:
        """Ledger rows with ``since <= time < until``, optionally only those whose fields
        equal ``where``'s, oldest first (or newest first), at most ``limit``."""
        raise NotImplementedError

    async def keys(self) -> tuple[int, list[dict[str, Any]]]:
        """The relay's own keys (those created with ``relay keys``) and their version: a
        number that changes whenever one does. Each is a mapping with at least ``name`` and
        ``hash`` (the SHA-256 hex of the key, never the key)."""
        raise NotImplementedError

    async def keys_version(self) -> int:
        """The keys' version alone: the cheap read a serving relay polls."""
        raise NotImplementedError

    async def put_key(self, record: dict[str, Any]) -> None:
        """Create or replace the key named ``record["name"]``, bumping the version."""
        raise NotImplementedError

    async def get(self, namespace: str, keys: Sequence[str]) -> list[bytes | None]:
        """The values stored under ``keys`` in ``namespace`` (None where absent or expired)."""
        raise NotImplementedError

    async def put(self, namespace: str, items: dict[str, bytes], ttl: float) -> None:
        """Store each value under its key in ``namespace`` for ``ttl`` seconds."""
        raise NotImplementedError

    def put_soon(self, namespace: str, items: dict[str, bytes], ttl: float) -> None:
        """:meth:`put` without a coroutine: queued at once, owing no answer, written within
        milliseconds (other processes read it from then on; this one at once). For what is
        written on every request (a session's record): no request waits for the store."""
        raise NotImplementedError

    async def delete(self, namespace: str, keys: Sequence[str]) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        """Finish pending writes (within a short time) and let go of connections."""


def check_per_process(config) -> None:
    """At start-up, before the workers fork: with several workers and the state in memory,
    each worker would count for itself (a limit of N would let N times as much through, and
    each worker's ledger would be its own). Refused where relay keys have limits the limits
    plugin keeps (ConfigError): they would not hold; and with the console, whose logout must
    end a session everywhere. Said loudly otherwise: a relay without limits loses only the
    ledger's unity."""
    if config.workers <= 1 or (config.state or {}).get("url"):
        return
    if config.console:
        raise ConfigError(
            f"server.workers is {config.workers} and state.url is empty, but server.console is "
            "on: a logout would end the session in one worker only (a copy of the cookie "
            "would still open the others), and each worker would show and change keys and "
            "traffic of its own; set state.url (sqlite:///./relay-state.db for one host, "
            "redis://... for several)")
    limited = bool(config.default_limits) or any(
        key.limits is not None for key in config.keys or ())
    if limited and "limits" in config.pipeline:
        raise ConfigError(
            f"server.workers is {config.workers} and state.url is empty, but relay keys have "
            f"limits: each worker would count them on its own and let {config.workers} times "
            "as much through; set state.url (sqlite:///./relay-state.db for one host, "
            "redis://... for several)")
    logging.getLogger("relay").warning(
        "server.workers is %d and state.url is empty: each worker keeps its own counters, "
        "concurrency slots, ledger and keys in its memory, so limits and usage are per "
        "worker; set state.url (sqlite:///./relay-state.db for one host, redis://... for "
        "several) to share them", config.workers)


async def open_state(options: dict[str, Any] | None = None) -> State:
    """The state backend ``options`` (relay.yaml's checked ``state:`` section) names."""
    options = options or {}
    url = options.get("url") or ""
    timeout = float(options.get("timeout", 0.25))
    retention_days = int(options.get("retention_days", 90))
    if not url:
        from .memory import MemoryState
        state: State = MemoryState(retention_days=retention_days)
    elif url.startswith("sqlite:"):
        import sqlite3

        from .sqlite import SQLiteState, path_of
        try:
            sqlite = SQLiteState(path_of(url), timeout, retention_days)
            await asyncio.get_running_loop().run_in_executor(None, sqlite.create)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        except sqlite3.Error as e:
            raise ConfigError(f"state.url: {sqlite.path}: {e}") from None
        state = sqlite
    elif url.startswith(("redis://", "rediss://", "unix://")):
        from .redis import RedisState
        try:
            redis = RedisState(url, timeout, retention_days)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        await redis.connect()
        state = redis
    else:
        raise ConfigError(f"state.url: {url!r} names no state backend this relay has "
                          f"(sqlite:///PATH, redis://HOST:PORT/DB, rediss://...)")
    if url:  # a shared store: what is far from its limits is spent in memory
        from .lease import LeasedState
        state = LeasedState(state)
    state.on_unavailable = options.get("on_unavailable", "open")
    state.timeout = timeout
    return state
