"""State in one SQLite file (``state.url: sqlite:///PATH``), shared by the workers of one host.

The file is in WAL mode (readers never wait for the writer) and every change is a short
transaction; a transaction that changes something starts with ``BEGIN IMMEDIATE``, so it
holds the file's write lock from its first read and :meth:`SQLiteState.take` is atomic
across every process that opens the file: two workers can never both see the last free
unit of a counter.

The event loop never waits for SQLite. Every statement runs in one thread of this state's
own (``SQLiteState._work``), which takes whatever queued meanwhile into one transaction:
under load, many requests' takes share one commit. What needs no answer (:meth:`add`,
:meth:`release`, :meth:`record`, :meth:`put_soon`) is only queued; the next transaction
carries it, within ``LINGER`` seconds when nothing else wakes the thread (``ROW_LINGER``
while only ledger rows wait: dozens of rows share a commit), and before any later call of
the same process that could read it, so a process always reads its own writes (a key-value
entry still queued is read from the queue). A call that only reads the key-value store or
the keys' version neither waits for nor hurries what is queued: it runs outside any write
transaction. A call that gets no answer within
``timeout`` raises :class:`~relay.state.Unavailable` (and for ``DOWN_SECONDS`` after a
failure every call does so at once, but for the reads that need no write lock when it was a
write that failed); if the thread still grants it later, the take is undone
(its slots released, its amounts taken back). The ledger is read (:meth:`rows`) on another
thread, bounded by ``ROWS_SECONDS``: no request waits for it. The path is looked at every
``LOOK_SECONDS``: a file deleted or replaced meanwhile is let go of for the one the path names
(made again when there is none), which every process starting now would open.

Bounded on disk: counters are deleted once their window ends, slots when their lease runs
out, key-value entries at their expiry, ledger rows after ``retention_days``, in a sweep
every ``SWEEP_SECONDS``; the pages they leave are reused, so the file stays flat. In memory:
at most ``MAX_PENDING`` ledger rows wait for the file (the oldest go first, counted and
logged) and at most ``MAX_PENDING`` slot releases.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import logging
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import orjson

from . import Count, Counter, Seldom, Slot, State, Taken, Unavailable, lost, window

log = logging.getLogger("relay.state")

# What waits with no answer owed is written at most this long after it was queued: counts
# and releases soon (other processes decide by them), ledger rows in fewer, bigger
# transactions.
LINGER = 0.005
ROW_LINGER = 0.05
SWEEP_SECONDS = 60.0
MAX_PENDING = 10_000
# Ledger rows one transaction writes (a backlog after an outage goes in several).
ROW_BATCH = 2000
# Rows one INSERT carries: one step of SQLite's for all of them, so the thread lets go of
# the interpreter's lock once a chunk instead of once a row (the event loop waits for it
# less). 300 variables, under every SQLite's limit.
ROWS_PER_INSERT = 100
# Reading the ledger (``relay usage``, the console) is no request's wait: it gets longer.
ROWS_SECONDS = 10.0
CLOSE_SECONDS = 2.0
# After a failure, calls fail at once for this long instead of each waiting the timeout.
DOWN_SECONDS = 1.0
# How often the worker looks whether the path still names the file it has open.
LOOK_SECONDS = 1.0

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS counters (name TEXT NOT NULL, start INTEGER NOT NULL, "
    "end INTEGER NOT NULL, used INTEGER NOT NULL, PRIMARY KEY (name, start)) WITHOUT ROWID",
    "CREATE TABLE IF NOT EXISTS slots (name TEXT NOT NULL, token TEXT NOT NULL, "
    "until REAL NOT NULL, units INTEGER NOT NULL DEFAULT 1, PRIMARY KEY (name, token)) "
    "WITHOUT ROWID",
    "CREATE TABLE IF NOT EXISTS ledger (id TEXT PRIMARY KEY, time REAL NOT NULL, "
    "row BLOB NOT NULL)",
    "CREATE INDEX IF NOT EXISTS ledger_time ON ledger (time)",
    "CREATE TABLE IF NOT EXISTS keys (name TEXT PRIMARY KEY, record BLOB NOT NULL)",
    "CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL)",
    "CREATE TABLE IF NOT EXISTS kv (namespace TEXT NOT NULL, key TEXT NOT NULL, "
    "until REAL NOT NULL, value BLOB NOT NULL, PRIMARY KEY (namespace, key)) WITHOUT ROWID",
    "CREATE INDEX IF NOT EXISTS kv_until ON kv (until)",
)

ADD = ("INSERT INTO counters (name, start, end, used) VALUES (?, ?, ?, ?) "
       "ON CONFLICT (name, start) DO UPDATE SET used = used + excluded.used")
# What is given back (a lease unused, a take undone) never takes a count below zero: below
# it, the file lost what was given (deleted meanwhile), and the limit would grow.
GIVE_BACK = "UPDATE counters SET used = MAX(used + ?, 0) WHERE name = ? AND start = ?"


def path_of(url: str) -> str:
    """The file ``sqlite:///PATH`` names (``sqlite:///./relay-state.db`` is relative to the
    working directory, ``sqlite:////var/lib/relay/state.db`` absolute)."""
    prefix = "sqlite:///"
    if not url.startswith(prefix) or len(url) == len(prefix):
        raise ValueError(f"state.url: {url!r} must be sqlite:///PATH")
    return url[len(prefix):]


def identity(path: str) -> tuple[int, int] | None:
    """Which file ``path`` names now (None: none)."""
    try:
        found = os.stat(path)
    except FileNotFoundError:
        return None
    return found.st_dev, found.st_ino


def connect(path: str, timeout: float) -> sqlite3.Connection:
    db = sqlite3.connect(path, isolation_level=None, timeout=timeout, check_same_thread=False)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        # In WAL mode a commit without fsync cannot corrupt the file; a power cut may lose
        # the last transactions, which is what the ledger's buffer risks anyway.
        db.execute("PRAGMA synchronous=NORMAL")
        # The WAL file is cut back to this after a checkpoint, should a long read have let
        # it grow.
        db.execute("PRAGMA journal_size_limit=16777216")
    except BaseException:
        db.close()
        raise
    return db


class _Call:
    """One call queued for the worker, and the future its caller awaits."""

    __slots__ = ("run", "args", "future", "loop", "abandoned", "flush", "read")

    def __init__(self, run: Callable, args: tuple, future: asyncio.Future,
                 loop: asyncio.AbstractEventLoop, flush: bool = False, read: bool = False):
        self.run = run
        self.args = args
        self.future = future
        self.loop = loop
        self.abandoned = False  # the caller gave up: not to be run, or to be undone
        self.flush = flush  # the whole ledger backlog goes in before the answer
        self.read = read  # reads nothing this process may have queued: needs no write


class SQLiteState(State):
    kind = "sqlite"

    def __init__(self, path: str, timeout: float = 0.25, retention_days: int = 90):
        self.path = path
        self.timeout = timeout
        self.retention = retention_days * 86400
        self.unavailable_count = 0
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._calls: list[_Call] = []
        self._adds: dict[tuple[str, int], list[int]] = {}  # (name, start) -> [end, amount]
        self._releases: list[tuple[str, str]] = []
        # Key-value entries to write, by (namespace, key): (until, value), the newest last;
        # and those the worker's transaction is writing now (what a read must still see,
        # what goes back to the queue should the transaction fail).
        self._puts: dict[tuple[str, str], tuple[float, bytes]] = {}
        self._inflight: dict[tuple[str, str], tuple[float, bytes]] = {}
        # Ledger rows waiting for the file, by id: (id, time, the row encoded), the values of
        # its INSERT in their order. Encoded at once, so that what waits is three plain values
        # a row, never a tree of objects.
        self._pending: collections.OrderedDict[str, tuple[str, float, bytes]] = \
            collections.OrderedDict()
        self._queued_since: float | None = None  # when work with no answer owed first waited
        self._urgent = False  # and whether it holds more than ledger rows
        self._stopping = False
        self._down_until = 0.0  # monotonic; set by either thread (a float: one store)
        # The same for the calls that only read (read=True): a write that failed (another
        # process holding the write lock past the timeout, a full disk) says nothing of a
        # read, which needs no write lock; only a read that failed stops them.
        self._reads_down_until = 0.0
        self._idle = False  # the worker sleeps until woken (or the next sweep)
        self._prefix = secrets.token_hex(4)  # slot tokens: unique across processes
        self._tokens = itertools.count()
        self._dropped_rows = Seldom(log)
        self._dropped_puts = Seldom(log)
        self._warned = 0.0
        self._quiet = 0
        self._thread: threading.Thread | None = None
        self._reader: sqlite3.Connection | None = None
        self._reader_file: tuple[int, int] | None = None
        self._reader_lock = threading.Lock()
        self._file: tuple[int, int] | None = None  # the file the worker has open

    # --- opening and closing ---

    def create(self) -> None:
        """Create the file and its tables (in the calling thread: at start-up, off the loop)."""
        directory = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(directory):
            raise ValueError(f"state.url: the directory {directory} does not exist")
        # Workers starting together create the file at once, and SQLite answers a change of
        # journal mode under another connection with "database is locked" at once, whatever
        # the busy timeout: so the first steps are tried again for a while.
        deadline = time.monotonic() + max(self.timeout, 5.0)
        while True:
            try:
                self._create_tables()
                break
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) and "busy" not in str(e) \
                        or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self._thread = threading.Thread(target=self._work, name="relay-state-sqlite",
                                        daemon=True)
        self._thread.start()

    def _create_tables(self) -> None:
        db = connect(self.path, max(self.timeout, 5.0))
        try:
            _make_tables(db)
            self._file = identity(self.path)
        finally:
            db.close()

    def _open(self) -> sqlite3.Connection:
        """The worker's connection, to the file the path names now: one deleted (to start
        afresh) or replaced while the relay runs is the one every process starting now
        uses, so it is made or completed as at start-up."""
        db = connect(self.path, self.timeout)
        try:
            found = identity(self.path)
            # A file made again may have the number of the one this process let go of.
            if found != self._file or db.execute(
                    "SELECT 1 FROM sqlite_master WHERE name = 'meta'").fetchone() is None:
                _make_tables(db)
                log.warning("state %s: the file was deleted or replaced while the relay ran; "
                            "opened the one there now (what the other held is not in it)",
                            self.path)
                self._file = found
        except BaseException:
            db.close()
            raise
        return db

    async def close(self) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        with self._wake:
            self._stopping = True
            self._wake.notify()
        await asyncio.get_running_loop().run_in_executor(None, thread.join, CLOSE_SECONDS)
        if not thread.is_alive():
            with self._lock:
                left = len(self._pending), len(self._adds), len(self._puts)
            if any(left):
                lost(self.path, *left)
        with self._reader_lock:
            if self._reader is not None:
                self._reader.close()
                self._reader = None

    # --- what the loop does: queue, and wait for an answer when one is owed ---

    async def _call(self, run: Callable, *args: Any, flush: bool = False,
                    wait: float | None = None, read: bool = False) -> Any:
        if self._thread is None:
            raise Unavailable("the SQLite state is closed")
        if time.monotonic() < (self._reads_down_until if read else self._down_until):
            self._unreachable(1, "unreachable a moment ago")
            raise Unavailable(f"{self.path}: unreachable (a moment ago)")
        loop = asyncio.get_running_loop()
        call = _Call(run, args, loop.create_future(), loop, flush, read)
        with self._wake:
            self._calls.append(call)
            self._wake.notify()
        timer = loop.call_later(self.timeout if wait is None else wait, self._give_up, call,
                                self.timeout if wait is None else wait)
        try:
            return await call.future
        finally:
            timer.cancel()

    def _give_up(self, call: _Call, seconds: float) -> None:
        if not call.future.done():
            call.abandoned = True
            self._down_until = time.monotonic() + DOWN_SECONDS
            if call.read:
                self._reads_down_until = self._down_until
            self._unreachable(1, f"no answer within {seconds} s")
            call.future.set_exception(Unavailable(f"{self.path}: no answer within "
                                                  f"{seconds} s"))

    def _answer(self, answers: list[tuple[_Call, Any, BaseException | None]]) -> None:
        """On the loop: hand each call its result (one wake-up for the whole transaction)."""
        for call, result, error in answers:
            if call.future.done():
                if isinstance(result, Taken) and result.granted:
                    self._undo(call, result)
                continue
            if error is not None:
                call.future.set_exception(error)
            else:
                call.future.set_result(result)

    def _undo(self, call: _Call, taken: Taken) -> None:
        """A take granted after its caller gave up: nobody will release or use it."""
        counters, slots, now = call.args
        for slot, token in zip(slots, taken.tokens, strict=True):
            self.release_soon(slot.name, token)
        self.add_soon([Counter(c.name, c.per, amount=-c.amount) for c in counters if c.amount],
                         now)

    def _queued(self, urgent: bool = True) -> None:
        """Work with no answer owed waits: the worker, woken if it sleeps, lingers for more
        (``LINGER``, or ``ROW_LINGER`` while it is only ledger rows)."""
        if self._queued_since is None:
            self._queued_since = time.monotonic()
            if self._idle:
                self._wake.notify()
        if urgent and not self._urgent:
            self._urgent = True
            self._wake.notify()

    def add_soon(self, counters: Iterable[Counter], now: float | None = None) -> None:
        now = time.time() if now is None else now
        with self._lock:
            adds = self._adds
            for counter in counters:
                if counter.amount:
                    start, end = window(counter.per, now)
                    entry = adds.get((counter.name, start))
                    if entry is None:
                        adds[counter.name, start] = [end, counter.amount]
                    else:
                        entry[1] += counter.amount
            self._queued()

    def release_soon(self, name: str, token: str) -> None:
        with self._lock:
            if len(self._releases) < MAX_PENDING:  # past that the lease gives it back
                self._releases.append((name, token))
            self._queued()

    def _unreachable(self, count: int, why: str) -> None:
        """Counted for the metrics; logged once a minute at most."""
        now = time.monotonic()
        with self._lock:
            self.unavailable_count += count
            if self._warned and now - self._warned < 60.0:
                self._quiet += count
                return
            self._warned, quiet, self._quiet = now, self._quiet, 0
        log.warning("state %s unreachable: %s%s", self.path, why,
                    f"; {quiet} more since the last warning" if quiet else "")

    # --- the interface ---

    async def take(self, counters: Sequence[Counter], slots: Sequence[Slot] = (),
                   now: float | None = None) -> Taken:
        return await self._call(self._take, tuple(counters), tuple(slots),
                                time.time() if now is None else now)

    async def counts(self, counters: Iterable[Counter], now: float | None = None
                     ) -> list[Count]:
        return await self._call(self._counts, tuple(counters),
                                time.time() if now is None else now)

    def record_soon(self, rows: Sequence[dict[str, Any]]) -> None:
        dropped = 0
        encoded = encode_rows(rows)
        # The condition's own lock, taken directly (the condition's ``with`` is two calls of
        # Python's): what every request's row goes through.
        with self._lock:
            pending = self._pending
            for entry in encoded:
                if entry[0] not in pending:
                    pending[entry[0]] = entry
            while len(pending) > MAX_PENDING:
                pending.popitem(last=False)
                dropped += 1
            self._queued(urgent=len(pending) >= ROW_BATCH)
        if dropped:
            self._dropped_rows.warn(dropped, "state %s: %d ledger rows dropped (%d waited for "
                                    "the file already)", self.path, dropped, MAX_PENDING)

    async def rows(self, since: float | None = None, until: float | None = None,
                   where: dict[str, Any] | None = None, limit: int | None = None,
                   newest_first: bool = False) -> list[dict[str, Any]]:
        # What this process recorded lands first, so that it reads its own rows.
        await self._call(_nothing, flush=True, wait=ROWS_SECONDS)
        loop = asyncio.get_running_loop()
        job = loop.run_in_executor(None, self._read_rows, since, until, where, limit,
                                   newest_first)
        try:
            return await asyncio.wait_for(job, ROWS_SECONDS)
        except asyncio.TimeoutError:
            with self._reader_lock:
                if self._reader is not None:
                    self._reader.interrupt()
            raise Unavailable(f"{self.path}: the ledger read took over {ROWS_SECONDS} s"
                              ) from None
        except sqlite3.Error as e:
            raise Unavailable(f"{self.path}: {e}") from None

    async def keys(self) -> tuple[int, list[dict[str, Any]]]:
        return await self._call(self._keys)

    async def keys_version(self) -> int:
        return await self._call(self._keys_version, read=True)

    async def put_key(self, record: dict[str, Any]) -> None:
        await self._call(self._put_key, orjson.dumps(record), record["name"])

    async def get(self, namespace: str, keys: Sequence[str]) -> list[bytes | None]:
        if self._puts or self._inflight:
            queued = self._queued_values(namespace, keys)
            if None not in queued:  # all of them this process's own, not written yet
                return _live(queued, [None] * len(queued))
        return await self._call(self._get, namespace, tuple(keys), read=True)

    def _queued_values(self, namespace: str, keys: Iterable[str]
                       ) -> list[tuple[float, bytes] | None]:
        """The entries of ``keys`` this process queued and the file may not hold yet (None
        for each that has none)."""
        with self._lock:
            puts, inflight = self._puts, self._inflight
            return [puts.get((namespace, key)) or inflight.get((namespace, key))
                    for key in keys]

    def put_soon(self, namespace: str, items: dict[str, bytes], ttl: float) -> None:
        until = time.time() + ttl
        dropped = 0
        with self._lock:
            puts = self._puts
            for key, value in items.items():
                puts.pop((namespace, key), None)  # to the end: the newest go last
                puts[namespace, key] = (until, value)
            while len(puts) > MAX_PENDING:
                del puts[next(iter(puts))]
                dropped += 1
            self._queued()
        if dropped:
            self._dropped_puts.warn(dropped, "state %s: %d key-value entries dropped (%d waited "
                                    "for the file)", self.path, dropped, MAX_PENDING)

    def _unqueue(self, namespace: str, keys: Iterable[str]) -> None:
        """What a later :meth:`put` or :meth:`delete` of the same keys supersedes: never
        written after it (the call runs after a transaction in flight), nor queued again
        should that transaction fail."""
        with self._lock:  # never skipped: a failed transaction may be queueing them again
            for key in keys:
                self._puts.pop((namespace, key), None)
                self._inflight.pop((namespace, key), None)

    async def put(self, namespace: str, items: dict[str, bytes], ttl: float) -> None:
        self._unqueue(namespace, items)
        await self._call(self._put, namespace, dict(items), ttl)

    async def delete(self, namespace: str, keys: Sequence[str]) -> None:
        self._unqueue(namespace, keys)
        await self._call(self._delete, namespace, tuple(keys))

    # --- the worker thread ---

    def _work(self) -> None:
        db: sqlite3.Connection | None = None
        next_sweep = time.monotonic() + SWEEP_SECONDS
        next_look = time.monotonic() + LOOK_SECONDS
        quiet_until = 0.0
        while True:
            with self._wake:
                while not (self._calls or self._stopping):
                    now = time.monotonic()
                    if now >= next_sweep:
                        break
                    if self._queued_since is not None:
                        due = self._queued_since + (LINGER if self._urgent else ROW_LINGER)
                        if now >= due:
                            break
                    elif now < quiet_until:
                        # Just busy: more is likely to come; what owes no answer then
                        # needs no wake-up of its own.
                        due = quiet_until
                    else:
                        self._idle = True
                        due = next_sweep
                    self._wake.wait(min(due, next_sweep) - now)
                    self._idle = False
                calls, self._calls = [c for c in self._calls if not c.abandoned], []
                stopping = self._stopping
                queued_since = self._queued_since
                writing = stopping or not all(c.read for c in calls) or (
                    queued_since is not None and time.monotonic() >= queued_since
                    + (LINGER if self._urgent else ROW_LINGER))
                if writing:
                    adds, self._adds = self._adds, {}
                    releases, self._releases = self._releases, []
                    puts = self._inflight = self._puts
                    self._puts = {}
                    flush = stopping or any(c.flush for c in calls)
                    backlog = list(itertools.islice(self._pending.values(), None,
                                                    None if flush else ROW_BATCH))
                    self._queued_since = None
                    self._urgent = False
                else:  # reads alone: what is queued waits for its own time
                    adds, releases, puts, backlog = {}, [], {}, []
            if db is not None and time.monotonic() >= next_look:
                next_look = time.monotonic() + LOOK_SECONDS
                if identity(self.path) != self._file:
                    db.close()
                    db = None
            if calls or adds or releases or puts or backlog:
                try:
                    if db is None:
                        db = self._open()
                    answers = (self._transaction(db, calls, adds, releases,
                                                 self._writing(puts), backlog)
                               if writing else self._read(db, calls))
                except Exception as e:  # sqlite3's own, or a value it could not take
                    self._failed(db, e, calls, adds, releases, reading=not writing)
                    db = None
                else:
                    self._landed(backlog)
                    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
                    for call, answer in zip(calls, answers, strict=True):
                        by_loop.setdefault(call.loop, []).append((call, *answer))
                    for loop, group in by_loop.items():
                        _soon(loop, self._answer, group)
                quiet_until = time.monotonic() + LINGER
            if stopping:
                break
            if time.monotonic() >= next_sweep:
                next_sweep = time.monotonic() + SWEEP_SECONDS
                try:
                    if db is None:
                        db = self._open()
                    self._sweep(db)
                except sqlite3.Error as e:
                    self._failed(db, e, [], {}, [])
                    db = None
        if db is not None:
            db.close()

    @staticmethod
    def _read(db: sqlite3.Connection, calls: list[_Call]) -> list[tuple[Any, Any]]:
        """The calls' answers; outside a transaction (calls that only read), each in a read
        transaction of its own, without the write lock."""
        answers: list[tuple[Any, Any]] = []
        for call in calls:
            try:
                answers.append((call.run(db, *call.args), None))
            except sqlite3.Error:
                raise
            except Exception as e:  # a value SQLite could not take: that caller's error
                answers.append((None, e))
        return answers

    def _transaction(self, db: sqlite3.Connection, calls: list[_Call],
                     adds: dict[tuple[str, int], list[int]], releases: list[tuple[str, str]],
                     puts: list[tuple[str, str, float, bytes]],
                     backlog: list[tuple[str, float, bytes]]) -> list[tuple[Any, Any]]:
        db.execute("BEGIN IMMEDIATE")
        try:
            if adds:
                db.executemany(ADD, [(name, start, end, amount)
                                     for (name, start), (end, amount) in adds.items()
                                     if amount > 0])
                db.executemany(GIVE_BACK, [(amount, name, start)
                                           for (name, start), (_, amount) in adds.items()
                                           if amount < 0])
            if releases:
                db.executemany("DELETE FROM slots WHERE name = ? AND token = ?", releases)
            for start in range(0, len(backlog), ROWS_PER_INSERT):
                chunk = backlog[start:start + ROWS_PER_INSERT]
                db.execute(_insert_rows(len(chunk)), list(itertools.chain.from_iterable(chunk)))
            answers = self._read(db, calls)
            if puts:  # after the calls: each was made before the entries it would replace
                db.executemany("INSERT OR REPLACE INTO kv (namespace, key, until, value) "
                               "VALUES (?, ?, ?, ?)", puts)
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        return answers

    def _writing(self, puts: dict[tuple[str, str], tuple[float, bytes]]
                 ) -> list[tuple[str, str, float, bytes]]:
        """The rows of the entries a transaction takes (read under the lock: the loop drops
        what a later put or delete supersedes)."""
        with self._lock:
            return [(namespace, key, until, value)
                    for (namespace, key), (until, value) in puts.items()]

    def _failed(self, db: sqlite3.Connection | None, error: Exception, calls: list[_Call],
                adds: dict[tuple[str, int], list[int]], releases: list[tuple[str, str]],
                reading: bool = False) -> None:
        """The file could not be written (locked past the timeout, full, gone), or with
        ``reading`` not even read: the callers hear so, and what owed no answer waits for
        the next transaction."""
        self._down_until = time.monotonic() + DOWN_SECONDS
        if reading:
            self._reads_down_until = self._down_until
        with self._wake:
            for key, (end, amount) in adds.items():
                entry = self._adds.setdefault(key, [end, 0])
                entry[1] += amount
            self._releases[:0] = releases[:max(0, MAX_PENDING - len(self._releases))]
            if self._inflight:  # ahead of what queued since, which is newer where both are
                self._puts = {**self._inflight, **self._puts}
                self._inflight = {}
                while len(self._puts) > MAX_PENDING:
                    del self._puts[next(iter(self._puts))]
            if self._adds or self._releases or self._pending or self._puts:
                self._queued_since = time.monotonic() + 1.0  # try again in a second
        self._unreachable(len(calls), str(error))
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for call in calls:
            by_loop.setdefault(call.loop, []).append(
                (call, None, Unavailable(f"{self.path}: {error}")))
        for loop, group in by_loop.items():
            _soon(loop, self._answer, group)
        if db is not None:
            db.close()  # a file replaced or repaired meanwhile is opened afresh

    def _landed(self, backlog: list[tuple[str, float, bytes]]) -> None:
        if self._inflight:
            with self._wake:
                self._inflight = {}
        if backlog:
            with self._wake:
                pending = self._pending
                for row in backlog:
                    if pending.get(row[0]) is row:
                        del pending[row[0]]
                if self._pending and self._queued_since is None:  # a backlog's next batch
                    self._queued_since = time.monotonic()
                    self._urgent = True

    def _sweep(self, db: sqlite3.Connection) -> None:
        now = time.time()
        db.execute("BEGIN IMMEDIATE")
        try:
            db.execute("DELETE FROM counters WHERE end <= ?", (int(now),))
            db.execute("DELETE FROM slots WHERE until <= ?", (now,))
            db.execute("DELETE FROM kv WHERE until <= ?", (now,))
            db.execute("DELETE FROM ledger WHERE time < ?", (now - self.retention,))
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise

    # Each runs in the worker, inside the transaction.

    def _take(self, db: sqlite3.Connection, counters: tuple[Counter, ...],
              slots: tuple[Slot, ...], now: float) -> Taken:
        looked = _looked(db, counters, now)
        for counter, (_, _, used) in zip(counters, looked, strict=True):
            if counter.limit is not None and (
                    used + counter.amount > counter.limit if counter.amount
                    else used >= counter.limit):
                return Taken(False, _counted(counters, looked), blocked=counter.name)
        for slot in slots:
            # A lease run out is not held (the sweep deletes it later).
            held, oldest = db.execute("SELECT TOTAL(units), MIN(until) FROM slots "
                                      "WHERE name = ? AND until > ?", (slot.name, now)
                                      ).fetchone()
            if held + slot.units > slot.limit:
                return Taken(False, _counted(counters, looked), blocked=slot.name,
                             slot_retry=max(0.0, (oldest or now) - now))
        adding = [(counter.name, start, end, counter.amount)
                  for counter, (start, end, _) in zip(counters, looked, strict=True)
                  if counter.amount]
        if adding:
            db.executemany(ADD, adding)
        tokens = tuple(f"{self._prefix}{next(self._tokens):x}" for _ in slots)
        if slots:
            db.executemany("INSERT INTO slots (name, token, until, units) VALUES (?, ?, ?, ?)",
                           [(slot.name, token, now + slot.lease, slot.units)
                            for slot, token in zip(slots, tokens, strict=True)])
        return Taken(True, tuple(Count(counter.name, used + counter.amount, counter.limit, end)
                                 for counter, (_, end, used)
                                 in zip(counters, looked, strict=True)), tokens)

    @staticmethod
    def _counts(db: sqlite3.Connection, counters: tuple[Counter, ...], now: float
                ) -> list[Count]:
        return list(_counted(counters, _looked(db, counters, now)))

    @staticmethod
    def _keys(db: sqlite3.Connection) -> tuple[int, list[dict[str, Any]]]:
        version = db.execute("SELECT value FROM meta WHERE name = 'keys_version'").fetchone()
        return version[0], [orjson.loads(record) for (record,)
                            in db.execute("SELECT record FROM keys ORDER BY name")]

    @staticmethod
    def _keys_version(db: sqlite3.Connection) -> int:
        return db.execute("SELECT value FROM meta WHERE name = 'keys_version'").fetchone()[0]

    @staticmethod
    def _put_key(db: sqlite3.Connection, record: bytes, name: str) -> None:
        db.execute("INSERT OR REPLACE INTO keys (name, record) VALUES (?, ?)", (name, record))
        db.execute("UPDATE meta SET value = value + 1 WHERE name = 'keys_version'")

    def _get(self, db: sqlite3.Connection, namespace: str, keys: tuple[str, ...]
             ) -> list[bytes | None]:
        now = time.time()
        found: dict[str, bytes] = {}
        for start in range(0, len(keys), 500):
            chunk = keys[start:start + 500]
            found.update(db.execute(
                f"SELECT key, value FROM kv WHERE namespace = ? AND until > ? AND key IN "
                f"({','.join('?' * len(chunk))})", (namespace, now, *chunk)))
        # What this process queued, or a transaction of this batch writes after its calls,
        # or a failed one left queued again: newer than the file.
        return _live(self._queued_values(namespace, keys), [found.get(key) for key in keys])

    @staticmethod
    def _put(db: sqlite3.Connection, namespace: str, items: dict[str, bytes], ttl: float
             ) -> None:
        until = time.time() + ttl
        db.executemany("INSERT OR REPLACE INTO kv (namespace, key, until, value) "
                       "VALUES (?, ?, ?, ?)",
                       [(namespace, key, until, value) for key, value in items.items()])

    @staticmethod
    def _delete(db: sqlite3.Connection, namespace: str, keys: tuple[str, ...]) -> None:
        db.executemany("DELETE FROM kv WHERE namespace = ? AND key = ?",
                       [(namespace, key) for key in keys])

    # --- the ledger's reader (a thread of the default executor) ---

    def _read_rows(self, since: float | None, until: float | None,
                   where: dict[str, Any] | None, limit: int | None, newest_first: bool
                   ) -> list[dict[str, Any]]:
        with self._reader_lock:
            if self._reader is not None and self._reader_file != identity(self.path):
                self._reader.close()  # the file was replaced: what is read is the new one
                self._reader = None
            if self._reader is None:
                self._reader = connect(self.path, self.timeout)
                self._reader_file = identity(self.path)
            reader = self._reader
        found = []
        query = "SELECT row FROM ledger WHERE time >= ? AND time < ? ORDER BY time {}, rowid {}"
        order = "DESC" if newest_first else "ASC"
        cursor = reader.execute(query.format(order, order),
                                (-1e300 if since is None else since,
                                 1e300 if until is None else until))
        for (data,) in cursor:
            row = orjson.loads(data)
            if where and any(row.get(k) != v for k, v in where.items()):
                continue
            found.append(row)
            if limit is not None and len(found) >= limit:
                break
        cursor.close()
        return found


def _make_tables(db: sqlite3.Connection) -> None:
    db.execute("BEGIN IMMEDIATE")
    try:
        for statement in SCHEMA:
            db.execute(statement)
        # A file made before slots were taken in blocks: each of its slots is one.
        if not any(column[1] == "units" for column in db.execute("PRAGMA table_info(slots)")):
            db.execute("ALTER TABLE slots ADD COLUMN units INTEGER NOT NULL DEFAULT 1")
        db.execute("INSERT OR IGNORE INTO meta (name, value) VALUES ('keys_version', 0)")
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise


@functools.lru_cache(maxsize=ROWS_PER_INSERT)
def _insert_rows(count: int) -> str:
    return ("INSERT OR IGNORE INTO ledger (id, time, row) VALUES "
            + ", ".join(["(?, ?, ?)"] * count))


def _nothing(_db: sqlite3.Connection) -> None:
    return None


def _looked(db: sqlite3.Connection, counters: Sequence[Counter], now: float
            ) -> list[tuple[int, int, int]]:
    """Each counter's window (start, end) and its count there."""
    looked = []
    for counter in counters:
        start, end = window(counter.per, now)
        found = db.execute("SELECT used FROM counters WHERE name = ? AND start = ?",
                           (counter.name, start)).fetchone()
        looked.append((start, end, found[0] if found else 0))
    return looked


def _counted(counters: Sequence[Counter], looked: list[tuple[int, int, int]]
             ) -> tuple[Count, ...]:
    return tuple(Count(counter.name, used, counter.limit, end)
                 for counter, (_, end, used) in zip(counters, looked, strict=True))


def encode_rows(rows: Iterable[dict[str, Any]]) -> list[tuple[str, float, bytes]]:
    """Each ledger row as ``(id, time, JSON)``; a row that cannot be encoded is a caller's
    bug: that row alone goes, logged."""
    encoded = []
    for row in rows:
        try:
            encoded.append((row["id"], float(row["time"]), orjson.dumps(row)))
        except (TypeError, ValueError, KeyError) as e:
            log.warning("ledger row %s cannot be stored: %s", row.get("id"), e)
    return encoded


def _live(queued: list[tuple[float, bytes] | None], found: list[bytes | None]
          ) -> list[bytes | None]:
    """What a read answers: the value still queued where there is one (None once it has
    expired), else what the file holds."""
    now = time.time()
    return [f if q is None else q[1] if q[0] > now else None
            for q, f in zip(queued, found, strict=True)]


def _soon(loop: asyncio.AbstractEventLoop, callback: Callable, *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # that loop is closed: nobody waits for the answer
        pass
