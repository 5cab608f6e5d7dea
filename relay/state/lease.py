"""Leases: a shared state's counters and slots spent in this process's memory while a limit is
far away, so that a request far from every limit costs no round trip to the store.

:func:`relay.state.open_state` puts a :class:`LeasedState` in front of the SQLite and Redis
backends (the memory backend is this process's already). For each :meth:`take`:

- **a request counter** (an amount to add, a limit: requests per minute) takes, when it must
  ask the store anyway, a *lease* of further units of its window with it: at most
  ``1/LEASE_SHARE`` of the room the window had left when last seen, at most ``MAX_LEASE``,
  none below ``MIN_LEASE``. Later requests spend the lease in memory. So a window with less
  than ``LEASE_SHARE * MIN_LEASE`` units left is taken one request at a time, exactly as
  without leases: a key with 10 requests per minute gets exactly 10 through across workers
  and replicas, and a key with 10^9 costs nothing per request;
- **a counter checked, not added to** (tokens per minute, a budget: the answer adds to them
  afterwards) is checked against this process's *view* of it: what the store said at most
  ``VIEW_SECONDS`` ago plus what this process added since. While the view shows more than
  ``1/VIEW_MARGIN`` of the limit left, that is the check; within the last ``1/VIEW_MARGIN``,
  or with a view older than ``VIEW_SECONDS``, the request asks the store as it would without
  leases (a view already being read again by a take in flight is checked once that read is
  in, not asked for once more by every request that arrives meanwhile);
- **a concurrency slot** is taken by the *block* (``units`` of the limit held under one
  token, :attr:`relay.state.Slot.units`): at most ``1/LEASE_SHARE`` of the limit, at most
  ``MAX_BLOCK``; the requests of this process occupy a block's units in memory, and give
  them back in memory on every exit (:meth:`release`). A limit below
  ``LEASE_SHARE * MIN_LEASE`` is taken one slot per request, exactly. A block takes new
  requests for ``BLOCK_SECONDS`` (well inside its lease in the store) and goes back to the
  store once its last request has ended.

A take that must ask the store asks once, for everything the request needs (and the lease it
may take with it); when a lease or block was refused, it is asked again without them, so that
a request is never refused for the sake of a lease. What :meth:`add` adds to a counter far
from its limit is summed here and written behind within ``WRITE_SECONDS`` (before any take
or count this process asks the store for, so it reads its own writes); near its limit it
goes to the backend at once. What a process leased and does not use is
given back after ``IDLE_SECONDS`` without a request (and at :meth:`close`); a process that
dies holding some loses the rest of that window (a minute) and its blocks' leases.

What this means for the limits: a limit is never exceeded (every unit spent was granted by
the store); near it (the last ``LEASE_SHARE * MIN_LEASE`` requests of a window, the last
eighth of a budget) every request is decided by the store, as before; far from it, a request
may be refused while another process holds unused leased units, at most ``1/LEASE_SHARE`` of
the room per process and only until that process's ``IDLE_SECONDS`` pass. A budget crossed
by an answer in flight lets it finish; the *next* request refused is the next one of that
process, and of any process whose view is younger than the crossing's usage (its adds land in
the store within the backend's write-behind delay): at most ``VIEW_SECONDS`` later, and only
when the crossing answer spent more than the eighth of the budget the views keep in reserve.
The quota headers show this process's view (the store's count when last seen, less the
units it leased and has not used, plus its adds since).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterable, Sequence
from typing import Any

from . import Count, Counter, Slot, State, Taken, made, window

LEASE_SHARE = 64
MIN_LEASE = 2
MAX_LEASE = 1024
MAX_BLOCK = 64
VIEW_SECONDS = 1.0
VIEW_MARGIN = 8
IDLE_SECONDS = 1.0
# Adds to counters far from their limits reach the store within this (nearer ones at once).
WRITE_SECONDS = 0.05
BLOCK_SECONDS = 60.0
# Windows and blocks this process keeps (keys times models): past that the oldest views go.
MAX_WINDOWS = 10_000


class _Window:
    """One counter's current window as this process sees it."""

    __slots__ = ("name", "per", "start", "end", "used", "seen", "room", "refilling", "last",
                 "viewing")

    def __init__(self, name: str, per: str, start: int, end: int):
        self.name = name
        self.per = per
        self.start = start
        self.end = end
        self.used = 0  # the store's count when last seen (with our lease), plus our adds since
        self.seen = -1e18  # monotonic: when the store last said
        self.room = 0  # units leased from the store and not spent
        self.refilling = False  # a take asking for a lease is in flight
        self.last = 0.0  # monotonic: the last request that spent from it
        self.viewing: asyncio.Future | None = None  # done when a take in flight has read it


class _Block:
    """Concurrency units held in the store under one token, occupied here in memory."""

    __slots__ = ("name", "token", "units", "inflight", "until", "last")

    def __init__(self, name: str, token: str, units: int, until: float):
        self.name = name
        self.token = token  # the store's
        self.units = units
        self.inflight = 0
        self.until = until  # monotonic: takes no new request after this
        self.last = time.monotonic()


def lease_size(left: int) -> int:
    """The units a lease takes from a window (or block from a limit) with ``left`` units."""
    size = min(left // LEASE_SHARE, MAX_LEASE)
    return size if size >= MIN_LEASE else 0


class LeasedState(State):
    """A shared backend with leases in front (see the module's docstring); everything but
    :meth:`take`, :meth:`add` and :meth:`release` goes to the backend as it is."""

    def __init__(self, inner: State):
        self.inner = inner
        self.kind = inner.kind
        self._windows: dict[tuple[str, str], _Window] = {}  # (name, per)
        self._blocks: dict[str, _Block] = {}  # slot name -> the block taking requests
        self._draining: set[_Block] = set()  # blocks past their time with requests left
        self._local: dict[str, _Block] = {}  # a request's token -> its block
        self._refilling: set[str] = set()  # slot names a block is being taken for
        self._tokens = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        # Adds far from their limits, summed here for WRITE_SECONDS: (name, per, start)
        self._adds: dict[tuple[str, str, int], int] = {}
        self._flusher: asyncio.TimerHandle | None = None

    # The operator's choices and the counts live on the backend.
    @property
    def on_unavailable(self) -> str:
        return self.inner.on_unavailable

    @on_unavailable.setter
    def on_unavailable(self, value: str) -> None:
        self.inner.on_unavailable = value

    @property
    def timeout(self) -> float:
        return self.inner.timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        self.inner.timeout = value

    @property
    def unavailable_count(self) -> int:
        return self.inner.unavailable_count

    @unavailable_count.setter
    def unavailable_count(self, value: int) -> None:
        self.inner.unavailable_count = value

    def __getattr__(self, name: str) -> Any:  # the backend's own (path, url, ...)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    # --- a take: in memory when every part of it can be, else one ask of the store ---

    async def take(self, counters: Sequence[Counter], slots: Sequence[Slot] = (),
                   now: float | None = None) -> Taken:
        wall = time.time() if now is None else now
        taken = self.take_now(counters, slots, wall)
        if taken is not None:
            return taken
        viewing = self._viewing(counters, wall)
        if viewing is not None:
            # Views gone stale while a take in flight reads them again: that read (younger
            # than this request) is this request's check too, rather than one more ask each.
            await asyncio.shield(viewing)
            taken = self.take_now(counters, slots, wall)
            if taken is not None:
                return taken
        return await self._ask(counters, slots, time.time() if now is None else now,
                               time.monotonic())

    def _viewing(self, counters: Sequence[Counter], wall: float) -> asyncio.Future | None:
        """The read in flight of a checked counter's view this take found stale, if any."""
        clock = time.monotonic()
        for counter in counters:
            if counter.amount or counter.limit is None:
                continue
            seen = self._windows.get((counter.name, counter.per))
            if seen is not None and seen.viewing is not None and seen.start <= wall < seen.end \
                    and clock - seen.seen > VIEW_SECONDS:
                return seen.viewing
        return None

    def take_now(self, counters: Sequence[Counter], slots: Sequence[Slot] = (),
                 now: float | None = None) -> Taken | None:
        # Every request of a key with limits runs this: written for few steps. Each count is
        # what it will be once taken (``used - room + amount`` after ``room -= amount``), so
        # one pass checks and counts, and the spending waits until everything has passed.
        wall = time.time() if now is None else now
        clock = time.monotonic()
        windows = self._windows
        fresh = clock - VIEW_SECONDS
        counts = []
        spending = []
        counted = None  # amounts without a limit: only added
        for counter in counters:
            name, per, limit, amount = counter
            seen = windows.get((name, per))
            if seen is None or wall >= seen.end or wall < seen.start:
                return None
            if limit is None:
                if amount:
                    counted = [*(counted or ()), counter]
            elif amount:
                if seen.room < amount:
                    return None
                spending.append((seen, amount))
            elif seen.seen < fresh or seen.used * VIEW_MARGIN >= limit * (VIEW_MARGIN - 1):
                return None
            counts.append(made(Count, (name, seen.used - seen.room + amount, limit, seen.end)))
        blocks = []
        for slot in slots:
            block = self._blocks.get(slot.name)
            if block is None or block.inflight >= block.units or clock >= block.until:
                return None
            blocks.append(block)
        for seen, amount in spending:
            seen.room -= amount
            seen.last = clock
        if counted:
            self.add_soon(counted, wall)
        return made(Taken, (True, tuple(counts),
                              tuple([self._occupy(block, clock) for block in blocks]), None, 0.0))

    def _occupy(self, block: _Block, clock: float) -> str:
        block.inflight += 1
        block.last = clock
        token = f"{block.token}/{next(self._tokens):x}"
        self._local[token] = block
        return token

    def _window(self, counter: Counter, wall: float) -> _Window:
        key = (counter.name, counter.per)
        found = self._windows.get(key)
        if found is None or wall >= found.end or wall < found.start:
            start, end = window(counter.per, wall)
            found = self._windows[key] = _Window(counter.name, counter.per, start, end)
            if len(self._windows) > MAX_WINDOWS:
                self._forget()
        return found

    async def _ask(self, counters: Sequence[Counter], slots: Sequence[Slot], wall: float,
                   clock: float) -> Taken:
        windows = [self._window(counter, wall) for counter in counters]
        # What this process holds already is spent here; the store is asked for the rest,
        # and for a lease where the window has room for one.
        spend = []
        leases = []
        asked = []
        for counter, seen in zip(counters, windows, strict=True):
            local = bool(counter.amount and counter.limit is not None
                         and seen.room >= counter.amount)
            lease = 0
            if counter.amount and counter.limit is not None and not local \
                    and not seen.refilling and seen.seen > -1e18:
                lease = lease_size(counter.limit - seen.used)
            if local:
                # Spent now, not once the store has answered: a request arriving meanwhile
                # must not find the same units still there (it would spend them too, and
                # the store, which counted them once, would never know).
                seen.room -= counter.amount
            spend.append(local)
            leases.append(lease)
            asked.append(Counter(counter.name, counter.per, None, 0) if local
                         else Counter(counter.name, counter.per, counter.limit,
                                      counter.amount + lease))
        # A unit of a block this process holds is occupied now, like a leased unit above: a
        # request arriving while this one waits for the store must find it taken.
        held: list[str | None] = []
        wanted = []
        for slot in slots:
            block = self._blocks.get(slot.name)
            if block is not None and block.inflight < block.units and clock < block.until:
                held.append(self._occupy(block, clock))
                continue
            held.append(None)
            size = 1
            if slot.name not in self._refilling:
                size = max(1, min(lease_size(slot.limit), MAX_BLOCK))
            wanted.append(Slot(slot.name, slot.limit, slot.lease, size))
        refilling = [slot.name for slot in wanted if slot.units > 1]
        marked = [seen for seen, lease in zip(windows, leases, strict=True) if lease]
        for seen in marked:
            seen.refilling = True
        self._refilling.update(refilling)
        viewed = [seen for counter, seen in zip(counters, windows, strict=True)
                  if not counter.amount and counter.limit is not None and seen.viewing is None]
        if viewed:
            reading = asyncio.get_running_loop().create_future()
            for seen in viewed:
                seen.viewing = reading
        kept = False  # whether the units spent from leases above stay spent
        try:
            if self._adds:  # the store decides with this process's own adds
                self._flush_adds()
            leasing = {c.name for c, lease in zip(counters, leases, strict=True) if lease}
            leasing.update(refilling)
            if leasing:
                # A lease is worth more than the request: should its caller give up (the
                # client gone), what the store grants is kept here, not lost with it.
                call = asyncio.ensure_future(self.inner.take(asked, wanted, wall))
                try:
                    taken = await asyncio.shield(call)
                except asyncio.CancelledError:
                    call.add_done_callback(lambda done: self._adopt(
                        done, counters, windows, leases, spend, wanted))
                    raise
            else:
                taken = await self.inner.take(asked, wanted, wall)
            if not taken.granted and taken.blocked in leasing:
                # Refused with a lease: asked again for the request alone, so that no
                # request is refused for the sake of a lease.
                self._seen(windows, taken, time.monotonic())
                leases = [0] * len(counters)
                asked = [Counter(c.name, c.per, None, 0) if local else c
                         for c, local in zip(counters, spend, strict=True)]
                wanted = [Slot(s.name, s.limit, s.lease) for s in wanted]
                taken = await self.inner.take(asked, wanted, wall)
            kept = taken.granted
        finally:
            if not kept:  # refused, unreachable or given up: what was spent here comes back
                for counter, seen, local in zip(counters, windows, spend, strict=True):
                    if local:
                        seen.room += counter.amount
                for slot, token in zip(slots, held, strict=True):
                    if token is not None:
                        self.release_soon(slot.name, token)
            for seen in marked:
                seen.refilling = False
            self._refilling.difference_update(refilling)
            if viewed:
                for seen in viewed:
                    seen.viewing = None
                reading.set_result(None)
        clock = time.monotonic()
        self._seen(windows, taken, clock)
        if not taken.granted:
            return taken
        counts = []
        for counter, seen, lease, local in zip(counters, windows, leases, spend, strict=True):
            if lease:
                seen.room += lease
                self._arm()
            if lease or local:
                seen.last = clock
            counts.append(Count(counter.name, seen.used - seen.room, counter.limit, seen.end))
        tokens = []
        given = iter(zip(wanted, taken.tokens, strict=True))
        for token in held:
            if token is not None:
                tokens.append(token)
                continue
            slot, token = next(given)
            if slot.units == 1:
                tokens.append(token)
                continue
            fresh = _Block(slot.name, token, slot.units, clock + BLOCK_SECONDS)
            old = self._blocks.get(slot.name)
            if old is not None:
                self._retire(old)
            self._blocks[slot.name] = fresh
            tokens.append(self._occupy(fresh, clock))
            self._arm()
        return Taken(True, tuple(counts), tuple(tokens))

    def _adopt(self, done: asyncio.Future, counters: Sequence[Counter], windows: list[_Window],
               leases: list[int], spend: list[bool], wanted: list[Slot]) -> None:
        """A take with a lease that its caller gave up on, answered: what it was granted
        (the lease, the request's own units, a block) is this process's to spend."""
        if done.cancelled() or done.exception() is not None:
            return
        taken = done.result()
        clock = time.monotonic()
        self._seen(windows, taken, clock)
        if not taken.granted:
            return
        for counter, seen, lease, local in zip(counters, windows, leases, spend, strict=True):
            if counter.limit is not None and not local and (lease or counter.amount):
                seen.room += lease + counter.amount
                seen.last = clock
        for slot, token in zip(wanted, taken.tokens, strict=True):
            if slot.units == 1:
                self.inner.release_soon(slot.name, token)
                continue
            old = self._blocks.get(slot.name)
            if old is not None:
                self._retire(old)
            self._blocks[slot.name] = _Block(slot.name, token, slot.units,
                                             clock + BLOCK_SECONDS)
        self._arm()

    def _seen(self, windows: list[_Window], taken: Taken, clock: float) -> None:
        """The store's counts, as the views of their windows (less nothing: the store's
        count includes this process's leases)."""
        for seen, count in zip(windows, taken.counts, strict=True):
            if seen.end == count.reset:
                seen.used = count.used
                seen.seen = clock

    # --- what owes no answer ---

    def add_soon(self, counters: Iterable[Counter], now: float | None = None) -> None:
        wall = time.time() if now is None else now
        urgent = []
        windows, adds = self._windows, self._adds
        for counter in counters:
            name, per, limit, amount = counter
            seen = windows.get((name, per))
            if seen is None or not seen.start <= wall < seen.end:
                urgent.append(counter)
                continue
            used = seen.used = seen.used + amount
            if limit is not None and used * VIEW_MARGIN >= limit * (VIEW_MARGIN - 1):
                urgent.append(counter)  # near its limit: the others must know soon
                continue
            key = (name, per, seen.start)
            adds[key] = adds.get(key, 0) + amount
            if self._flusher is None:
                self._flusher = asyncio.get_running_loop().call_later(
                    WRITE_SECONDS, self._flush_soon)
        if urgent:
            self.inner.add_soon(urgent, wall)

    def _flush_soon(self) -> None:
        self._flusher = None
        self._flush_adds()

    def _flush_adds(self) -> None:
        """What this process added far from the limits, to the store (write-behind)."""
        adds, self._adds = self._adds, {}
        for (name, per, start), amount in adds.items():
            if amount:
                self.inner.add_soon([Counter(name, per, amount=amount)], start)

    def release_soon(self, name: str, token: str) -> None:
        block = self._local.pop(token, None)
        if block is None:
            if "/" not in token:  # the store's own; a leased one released twice does nothing
                self.inner.release_soon(name, token)
            return
        block.inflight -= 1
        block.last = time.monotonic()
        if block.inflight == 0 and block in self._draining:
            self._draining.discard(block)
            self.inner.release_soon(block.name, block.token)

    def _retire(self, block: _Block) -> None:
        if self._blocks.get(block.name) is block:
            del self._blocks[block.name]
        if block.inflight:
            self._draining.add(block)
        else:
            self.inner.release_soon(block.name, block.token)

    # --- giving back what is not used ---

    def _arm(self) -> None:
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(IDLE_SECONDS, self._idle)

    def _idle(self) -> None:
        self._timer = None
        self._give_back(time.monotonic() - IDLE_SECONDS)

    def _give_back(self, before: float, everything: bool = False) -> None:
        """Leases and blocks not used since ``before`` go back to the store."""
        wall = time.time()
        returned = []
        for key, seen in list(self._windows.items()):
            if wall >= seen.end:
                del self._windows[key]  # the window is over: what it leased is gone with it
            elif seen.room and (everything or seen.last < before):
                returned.append(Counter(seen.name, seen.per, amount=-seen.room))
                seen.used -= seen.room
                seen.room = 0
        if returned:
            self.inner.add_soon(returned, wall)
        clock = time.monotonic()
        for block in list(self._blocks.values()):
            if everything or clock >= block.until or (block.inflight == 0
                                                      and block.last < before):
                self._retire(block)
        if any(seen.room for seen in self._windows.values()) or self._blocks:
            self._arm()

    def _forget(self) -> None:
        """Too many views: those without a lease go (they are read again when needed)."""
        for key, seen in list(self._windows.items()):
            if not seen.room and not seen.refilling:
                del self._windows[key]
            if len(self._windows) <= MAX_WINDOWS // 2:
                break

    # --- the rest: the backend's ---

    async def counts(self, counters: Iterable[Counter], now: float | None = None
                     ) -> list[Count]:
        self._flush_adds()
        return await self.inner.counts(counters, now)

    def record_soon(self, rows: Sequence[dict[str, Any]]) -> None:
        self.inner.record_soon(rows)

    async def rows(self, since: float | None = None, until: float | None = None,
                   where: dict[str, Any] | None = None, limit: int | None = None,
                   newest_first: bool = False) -> list[dict[str, Any]]:
        return await self.inner.rows(since, until, where, limit, newest_first)

    async def keys(self) -> tuple[int, list[dict[str, Any]]]:
        return await self.inner.keys()

    async def keys_version(self) -> int:
        return await self.inner.keys_version()

    async def put_key(self, record: dict[str, Any]) -> None:
        await self.inner.put_key(record)

    async def get(self, namespace: str, keys: Sequence[str]) -> list[bytes | None]:
        return await self.inner.get(namespace, keys)

    async def put(self, namespace: str, items: dict[str, bytes], ttl: float) -> None:
        await self.inner.put(namespace, items, ttl)

    def put_soon(self, namespace: str, items: dict[str, bytes], ttl: float) -> None:
        self.inner.put_soon(namespace, items, ttl)

    async def delete(self, namespace: str, keys: Sequence[str]) -> None:
        await self.inner.delete(namespace, keys)

    async def close(self) -> None:
        for timer in (self._timer, self._flusher):
            if timer is not None:
                timer.cancel()
        self._timer = self._flusher = None
        try:
            self._flush_adds()
            self._give_back(time.monotonic(), everything=True)
            for block in list(self._draining):
                self._draining.discard(block)
                self.inner.release_soon(block.name, block.token)
        finally:
            await self.inner.close()
