"""State in this process's memory: the default, for one process (a relay without workers or
replicas), and the reference the other backends are tested against.

Everything is bounded: a counter lives until its window ends, a slot until it is released
or its lease runs out, a key-value entry until its expiry, and the ledger keeps at most
``max_rows`` rows and ``max_row_bytes`` of them as JSON (the oldest go first) within the
retention: this process's memory is no place for months of rows, which the SQLite and Redis
backends keep.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import orjson

from . import Count, Counter, Slot, State, Taken, window

MAX_ROWS = 100_000
MAX_ROW_BYTES = 32 * 1024 * 1024
MAX_ENTRIES = 200_000


class MemoryState(State):
    kind = "memory"

    def __init__(self, max_rows: int = MAX_ROWS, max_entries: int = MAX_ENTRIES,
                 retention_days: int = 90, max_row_bytes: int = MAX_ROW_BYTES):
        self.max_rows = max_rows
        self.max_row_bytes = max_row_bytes
        self._row_bytes = 0
        self.max_entries = max_entries
        self.retention = retention_days * 86400
        self._counts: dict[tuple[str, int], int] = {}
        self._ends: list[tuple[int, str, int]] = []  # (window end, name, start): a heap
        # name -> token -> (lease end, units)
        self._slots: dict[str, dict[str, tuple[float, int]]] = {}
        self._tokens = itertools.count()
        # id -> (time, the row as JSON): up to 100,000 rows as dicts of dicts and lists would
        # be millions of objects for every full pass of the garbage collector to walk; bytes
        # and floats are not walked at all.
        self._rows: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self._keys: dict[str, dict[str, Any]] = {}
        self._version = 0
        self._kv: OrderedDict[tuple[str, str], tuple[float, bytes]] = OrderedDict()

    def _expire(self, now: float) -> None:
        while self._ends and self._ends[0][0] <= now:
            _, name, start = heapq.heappop(self._ends)
            self._counts.pop((name, start), None)

    def _used(self, counter: Counter, now: float) -> tuple[tuple[str, int], int, int]:
        start, end = window(counter.per, now)
        key = (counter.name, start)
        return key, self._counts.get(key, 0), end

    def _bump(self, key: tuple[str, int], end: int, amount: int) -> int:
        if key not in self._counts:
            heapq.heappush(self._ends, (end, key[0], key[1]))
        value = self._counts.get(key, 0) + amount
        self._counts[key] = value
        return value

    def _held(self, name: str, now: float) -> dict[str, tuple[float, int]]:
        held = self._slots.get(name)
        if held is None:
            held = self._slots[name] = {}
        for token in [t for t, (until, _) in held.items() if until <= now]:
            del held[token]
        return held

    async def take(self, counters: Sequence[Counter], slots: Sequence[Slot] = (),
                   now: float | None = None) -> Taken:
        now = time.time() if now is None else now
        self._expire(now)
        looked = [self._used(counter, now) for counter in counters]
        for counter, (_, used, _end) in zip(counters, looked, strict=True):
            if counter.limit is not None and (
                    used + counter.amount > counter.limit if counter.amount
                    else used >= counter.limit):
                return Taken(False, self._counted(counters, looked), blocked=counter.name)
        for slot in slots:
            held = self._held(slot.name, now)
            if sum(units for _, units in held.values()) + slot.units > slot.limit:
                retry = max(0.0, min((until for until, _ in held.values()), default=now) - now)
                return Taken(False, self._counted(counters, looked), blocked=slot.name,
                             slot_retry=retry)
        counts = tuple(Count(counter.name, self._bump(key, end, counter.amount), counter.limit,
                             end)
                       for counter, (key, _, end) in zip(counters, looked, strict=True))
        tokens = []
        for slot in slots:
            token = f"{next(self._tokens):x}"
            self._held(slot.name, now)[token] = (now + slot.lease, slot.units)
            tokens.append(token)
        return Taken(True, counts, tuple(tokens))

    @staticmethod
    def _counted(counters: Sequence[Counter], looked) -> tuple[Count, ...]:
        return tuple(Count(counter.name, used, counter.limit, end)
                     for counter, (_, used, end) in zip(counters, looked, strict=True))

    def add_soon(self, counters: Iterable[Counter], now: float | None = None) -> None:
        now = time.time() if now is None else now
        self._expire(now)
        for counter in counters:
            key, _, end = self._used(counter, now)
            self._bump(key, end, counter.amount)

    async def counts(self, counters: Iterable[Counter], now: float | None = None
                     ) -> list[Count]:
        now = time.time() if now is None else now
        self._expire(now)
        result = []
        for counter in counters:
            _, used, end = self._used(counter, now)
            result.append(Count(counter.name, used, counter.limit, end))
        return result

    def release_soon(self, name: str, token: str) -> None:
        held = self._slots.get(name)
        if held is not None:
            held.pop(token, None)
            if not held:
                del self._slots[name]

    def record_soon(self, rows: Sequence[dict[str, Any]]) -> None:
        for row in rows:
            if row["id"] not in self._rows:
                data = _exact(orjson.dumps(row))
                self._rows[row["id"]] = (row["time"], data)
                self._row_bytes += len(data)
        oldest = time.time() - self.retention
        while self._rows and (len(self._rows) > self.max_rows
                              or self._row_bytes > self.max_row_bytes
                              or next(iter(self._rows.values()))[0] < oldest):
            self._row_bytes -= len(self._rows.popitem(last=False)[1][1])

    async def rows(self, since: float | None = None, until: float | None = None,
                   where: dict[str, Any] | None = None, limit: int | None = None,
                   newest_first: bool = False) -> list[dict[str, Any]]:
        found = []
        ordered = reversed(self._rows.values()) if newest_first else self._rows.values()
        for at, data in ordered:
            if since is not None and at < since:
                continue
            if until is not None and at >= until:
                continue
            row = orjson.loads(data)
            if where and any(row.get(k) != v for k, v in where.items()):
                continue
            found.append(row)
            if limit is not None and len(found) >= limit:
                break
        return found

    async def keys(self) -> tuple[int, list[dict[str, Any]]]:
        return self._version, [dict(record) for record in self._keys.values()]

    async def keys_version(self) -> int:
        return self._version

    async def put_key(self, record: dict[str, Any]) -> None:
        self._keys[record["name"]] = dict(record)
        self._version += 1

    async def get(self, namespace: str, keys: Sequence[str]) -> list[bytes | None]:
        now = time.time()
        found: list[bytes | None] = []
        for key in keys:
            entry = self._kv.get((namespace, key))
            found.append(entry[1] if entry is not None and entry[0] > now else None)
        return found

    def put_soon(self, namespace: str, items: dict[str, bytes], ttl: float) -> None:
        until = time.time() + ttl
        for key, value in items.items():
            self._kv[(namespace, key)] = (until, _exact(value))
            self._kv.move_to_end((namespace, key))
        while len(self._kv) > self.max_entries:
            self._kv.popitem(last=False)

    async def put(self, namespace: str, items: dict[str, bytes], ttl: float) -> None:
        self.put_soon(namespace, items, ttl)

    async def delete(self, namespace: str, keys: Sequence[str]) -> None:
        for key in keys:
            self._kv.pop((namespace, key), None)


def _exact(data: bytes) -> bytes:
    """A copy of ``data`` in a block of its own size, for what is kept. orjson's output keeps
    the buffer it was written into for as long as it lives: about 4 KiB for a 1 KiB ledger
    row, so 32 MiB of rows held 125 MB."""
    return bytes(memoryview(data))
