"""State in Redis (``state.url: redis://HOST:PORT/DB`` or ``rediss://`` for TLS), shared by
replicas on several hosts, through redis-py's asyncio client (the ``redis`` extra:
``pip install 'messages-relay[redis]'``).

One request costs one round trip: :meth:`RedisState.take` is one Lua script (checked and
taken at once for every counter and slot, so replicas racing for the last unit cannot both
win), and what needs no answer (:meth:`add`, :meth:`release`, :meth:`record`) is queued and
goes in the same script call as the next take (or ahead of the next other call), or in the
background within ``LINGER`` seconds (``ROW_LINGER`` while only ledger rows wait).

Where things live (every key under ``relay:``): a counter is a string per window
(``INCRBY``), expiring at its window's end, and the adds come in numbered batches, the
numbers a process has not heard back about kept in one sorted set of its own (expiring
``BATCH_SECONDS`` after its last use), so that a batch sent again after an unanswered round
trip counts once (a take has a number there too, so that one unanswered is undone once); a
concurrency slot set is a sorted set of release tokens scored by lease end, trimmed as it is
read, expiring with its last lease; a ledger row is a string set only if absent (``SET NX``:
idempotent by id) expiring after the retention, with a sorted set of ids by time trimmed to
the retention; the keys are a hash with a version counter (``INCR``); a key-value entry is a
string with ``PX`` expiry.

Every call is bounded by ``timeout``: one that fails or does not answer in time raises
:class:`~relay.state.Unavailable`, and for a second after that every call does so at once
rather than wait again. :meth:`record` never raises: rows wait in memory (at most
``MAX_PENDING``; the oldest go first, logged) and are written when Redis answers again.
A single Redis (or a primary) is assumed: the script's keys are not kept to one cluster slot.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import secrets
import time
from collections.abc import Iterable, Sequence
from typing import Any

import orjson

from . import Count, Counter, Seldom, Slot, State, Taken, Unavailable, lost, window

log = logging.getLogger("relay.state")

PREFIX = "relay:"
LINGER = 0.005
ROW_LINGER = 0.05  # while only ledger rows wait for the background flush
BATCH_SECONDS = 600
MAX_PENDING = 10_000
# Takes unheard waiting to be undone (a Redis that swallows commands can leave one a request
# every time its outage lets one through): past that the oldest are left to their windows
# and leases, and never crowd out the batches of usage.
MAX_UNDOS = 1_000
# How long the number of a take undone stays in the process's set of batches, below what the
# set is trimmed to: a take whose command was still on its way (on a connection given up,
# which Redis may read late) is refused when it lands, not counted.
UNDO_LINGER = 30.0
# Rows a call carries along; the background flush takes up to ROW_BATCH at a time.
CARRIED_ROWS = 50
ROW_BATCH = 500
MAX_CONNECTIONS = 64
# Connections a burst opened beyond the one in use are closed after this long: at rest the
# relay holds one (redis-py's pool keeps whatever it opened).
IDLE_CONNECTION_SECONDS = 10.0
# After a failure, calls fail at once for this long instead of each waiting the timeout.
DOWN_SECONDS = 1.0
ROWS_SECONDS = 10.0
CLOSE_SECONDS = 2.0
# A count outlives its window a little: a replica whose clock is behind still finds it.
GRACE_SECONDS = 5

# One script for every change, so that a request's writes and its take are one command:
# first what was queued (counter adds, slot releases, ledger rows), then the take. Redis runs
# a script atomically, nothing else meanwhile (https://redis.io/topics/eval-intro): the check
# and the take cannot interleave with another replica's. The script cache does not survive a
# restart: a NOSCRIPT reply loads it again.
# The adds go in batches, each applied once: a batch sent again after a round trip that
# failed without saying whether it ran is recognised by its number, kept in the process's
# sorted set of batches applied until the process knows the answer (every number below the
# lowest it does not know yet is dropped; the set expires BATCH_SECONDS after its last use),
# so that a Redis blip never inflates a counter and one key a process is all the ids cost.
# What is given back (a lease unused, a take undone) never takes a count below zero: below
# it, the store lost what was given (a Redis restarted empty), and the limit would grow.
# A take that adds or holds something has a number from the same count, entered in that set
# when it is granted: a take whose round trip went unheard is undone by a batch naming it,
# which takes back its amounts only if the take's number is there, and otherwise enters it,
# so that a take still on its way (on a connection given up) is refused when it arrives.
# KEYS, in order: per batch the process's set of batches then its counters, each release's
# slot set, each row's key and then the ledger's sorted set (when there are rows), each
# counter to take, each slot set to take from, and the set of batches (when the take has a
# number). ARGV: now, retention (s), the five numbers of those (batches, releases, rows,
# counters, slots), the take's number (0: none), then per batch its number of adds, its
# number, the lowest number not settled, how long the set is kept, the number of the take it
# undoes (0: none), and per add the amount and expiry (epoch s), per release its token, per
# row its id, time and body, per counter its limit (-1: none), amount and expiry, per slot
# its limit, lease end, token and units (a token of several units, a block, ends in
# ``*UNITS``), and with a take's number the lowest number not settled and how long the set
# is kept.
# Returns {granted, blocked (1-based among counters then slots, 0: none, -1: the take was
# undone before it arrived), slot retry (a string), used...}: the counts before the take.
SCRIPT = """
local now, retention = tonumber(ARGV[1]), tonumber(ARGV[2])
local nbatches, nrel, nrows = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local nc, ns, take = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local k, a = 1, 9
for b = 1, nbatches do
  local count = tonumber(ARGV[a])
  local fresh = redis.call('ZADD', KEYS[k], 'NX', ARGV[a + 1], ARGV[a + 1]) == 1
  if fresh and ARGV[a + 4] ~= '0' then
    fresh = redis.call('ZADD', KEYS[k], 'NX', ARGV[a + 4], ARGV[a + 4]) == 0
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[k], '-inf', '(' .. ARGV[a + 2])
  redis.call('EXPIRE', KEYS[k], ARGV[a + 3])
  k, a = k + 1, a + 5
  for i = 1, count do
    if fresh then
      if redis.call('INCRBY', KEYS[k], ARGV[a]) < 0 then
        redis.call('SET', KEYS[k], 0)
      end
      redis.call('EXPIREAT', KEYS[k], ARGV[a + 1])
    end
    k, a = k + 1, a + 2
  end
end
for i = 1, nrel do
  redis.call('ZREM', KEYS[k], ARGV[a])
  k, a = k + 1, a + 1
end
if nrows > 0 then
  local ledger = KEYS[k + nrows]
  for i = 1, nrows do
    if redis.call('SET', KEYS[k], ARGV[a + 2], 'NX', 'EX', retention) then
      redis.call('ZADD', ledger, 'NX', ARGV[a + 1], ARGV[a])
    end
    k, a = k + 1, a + 3
  end
  redis.call('ZREMRANGEBYSCORE', ledger, '-inf', '(' .. tostring(now - retention))
  k = k + 1
end
local used = {}
for c = 0, nc - 1 do
  used[c + 1] = tonumber(redis.call('GET', KEYS[k + c]) or '0')
end
for c = 0, nc - 1 do
  local limit, amount = tonumber(ARGV[a + 3 * c]), tonumber(ARGV[a + 3 * c + 1])
  if limit >= 0 and ((amount ~= 0 and used[c + 1] + amount > limit)
                     or (amount == 0 and used[c + 1] >= limit)) then
    return {0, c + 1, '0', unpack(used)}
  end
end
local sk, sa = k + nc, a + 3 * nc
if take > 0 and redis.call('ZSCORE', KEYS[sk + ns], take) then
  return {0, -1, '0', unpack(used)}
end
for s = 0, ns - 1 do
  local key = KEYS[sk + s]
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  local held = 0
  for _, member in ipairs(redis.call('ZRANGE', key, 0, -1)) do
    local star = string.find(member, '*', 1, true)
    held = held + (star and tonumber(string.sub(member, star + 1)) or 1)
  end
  if held + tonumber(ARGV[sa + 4 * s + 3]) > tonumber(ARGV[sa + 4 * s]) then
    local oldest = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
    return {0, nc + s + 1, tostring(tonumber(oldest[2]) - now), unpack(used)}
  end
end
if take > 0 then
  local batches, ta = KEYS[sk + ns], sa + 4 * ns
  redis.call('ZREMRANGEBYSCORE', batches, '-inf', '(' .. ARGV[ta])
  redis.call('ZADD', batches, take, take)
  redis.call('EXPIRE', batches, ARGV[ta + 1])
end
for c = 0, nc - 1 do
  local amount = tonumber(ARGV[a + 3 * c + 1])
  if amount ~= 0 then
    redis.call('INCRBY', KEYS[k + c], amount)
    redis.call('EXPIREAT', KEYS[k + c], ARGV[a + 3 * c + 2])
  end
end
for s = 0, ns - 1 do
  local key, lease = KEYS[sk + s], tonumber(ARGV[sa + 4 * s + 1])
  redis.call('ZADD', key, lease, ARGV[sa + 4 * s + 2])
  local ttl = math.ceil((lease - now) * 1000)
  if redis.call('PTTL', key) < ttl then
    redis.call('PEXPIRE', key, ttl)
  end
end
return {1, 0, '0', unpack(used)}
"""


def _counter_key(name: str, start: int) -> str:
    return f"{PREFIX}c:{name}:{start}"


def _slot_key(name: str) -> str:
    return f"{PREFIX}s:{name}"


LEDGER = PREFIX + "ledger"  # the sorted set: row id by time
KEYS = PREFIX + "keys"
KEYS_VERSION = PREFIX + "keys:version"


def _row_key(row_id: str) -> str:
    return f"{PREFIX}row:{row_id}"


def _kv_key(namespace: str, key: str) -> str:
    return f"{PREFIX}kv:{namespace}:{key}"


class RedisState(State):
    kind = "redis"

    def __init__(self, url: str, timeout: float = 0.25, retention_days: int = 90):
        try:
            from redis.asyncio import BlockingConnectionPool, Redis
            from redis.asyncio.retry import Retry
            from redis.backoff import NoBackoff
        except ImportError:
            raise ValueError("state.url: Redis needs the redis package: pip install "
                             "'messages-relay[redis]'") from None
        self.url = url
        self.timeout = timeout
        self.retention = retention_days * 86400
        self.unavailable_count = 0
        # No retries of its own: one attempt within the timeout, then the caller decides.
        pool = BlockingConnectionPool.from_url(
            url, max_connections=MAX_CONNECTIONS, timeout=timeout, socket_timeout=timeout,
            socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0))
        self._redis = Redis(connection_pool=pool)
        self._sha = ""
        self._adds: dict[str, list[int]] = {}  # counter key -> [expiry, amount]
        # Batches of adds to send under their number: sent without an answer (to send again),
        # or undoing a take whose answer never came: (number, adds, the take's number or 0).
        self._unsure: list[tuple[int, dict[str, list[int]], int]] = []
        self._batches = itertools.count(1)
        self._applied = f"{PREFIX}batches:{secrets.token_hex(4)}"  # this process's
        self._open: set[int] = set()  # batches and takes sent whose answer is not known yet
        # Takes undone -> until when their numbers stay in the set (UNDO_LINGER), oldest first.
        self._lingering: dict[int, float] = {}
        self._releases: list[tuple[str, str]] = []
        self._pending: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
        # Key-value entries to write, by Redis key: (value, until), the newest last; and
        # those being sent now (what a read must still see, what goes back to the queue
        # should the send fail), with the future that is done once the send is over.
        self._puts: dict[str, tuple[bytes, float]] = {}
        self._inflight: dict[str, tuple[bytes, float]] = {}
        self._sending: asyncio.Future | None = None
        self._flusher: asyncio.Task | None = None
        # Script calls of this turn of the loop: (keys, arguments, reply, seconds to wait).
        self._outgoing: list[tuple[list[str], list[Any], asyncio.Future, float]] = []
        self._senders: set[asyncio.Task] = set()
        self._down_until = 0.0
        self._warned = 0.0
        self._quiet = 0
        self._dropped_rows = Seldom(log)
        self._dropped_puts = Seldom(log)
        self._prefix = secrets.token_hex(4)
        self._tokens = itertools.count()
        self._closing = False
        self._closed = False
        self._trimmer: asyncio.TimerHandle | None = None

    @property
    def where(self) -> str:
        """The URL without its password, for logs."""
        head, at, tail = self.url.rpartition("@")
        return f"{self.url.split('://')[0]}://…@{tail}" if at else self.url

    async def connect(self) -> None:
        """At start-up: load the script. An unreachable Redis is not fatal here (it may come
        up after the relay): it is logged, and the script is loaded on first use."""
        try:
            await self._load()
        except Unavailable as e:
            log.warning("state %s unreachable at start-up: %s", self.where, e)

    async def _load(self) -> None:
        try:
            self._sha = await asyncio.wait_for(self._redis.script_load(SCRIPT), self.timeout)
        except Exception as e:
            raise self._failure(e) from None

    async def close(self) -> None:
        if self._closing:
            return
        self._closing = True  # no background flush from now on; what is queued goes here
        if self._trimmer is not None:
            self._trimmer.cancel()
            self._trimmer = None
        flusher, self._flusher = self._flusher, None
        if flusher is not None:
            flusher.cancel()
            # What a send it cut short carried is queued again once it has stopped (a cancel
            # that came as the send finished is lost: the loop ends as it sees the close).
            await asyncio.wait({flusher}, timeout=CLOSE_SECONDS)
        deadline = time.monotonic() + CLOSE_SECONDS
        if self._senders:
            await asyncio.wait(set(self._senders), timeout=CLOSE_SECONDS)
        # The last chance for what waits: tried even within the second after a failure
        # (Redis may be back), once, within the timeout.
        self._down_until = 0.0
        while self._has_queued() and time.monotonic() < deadline:
            try:
                await self._flush()
            except Unavailable:
                break
        if self._has_queued():
            lost(self.where, len(self._pending),
                 len(self._adds) + sum(len(adds) for _, adds, _ in self._unsure),
                 len(self._puts))
        self._closed = True
        try:
            await self._redis.aclose()
        except Exception as e:  # a connection already broken: nothing left to let go of
            log.debug("state %s: closing: %s", self.where, e)

    # --- failures ---

    def _failure(self, error: BaseException) -> Unavailable:
        """Note a failure (counted, logged once a minute at most) as the error to raise."""
        self._down_until = time.monotonic() + DOWN_SECONDS
        self._unreachable(1, f"{type(error).__name__}: {error}" if str(error)
                          else type(error).__name__)
        return Unavailable(f"{self.where}: {type(error).__name__}: {error}")

    def _unreachable(self, count: int, why: str) -> None:
        now = time.monotonic()
        self.unavailable_count += count
        if self._warned and now - self._warned < 60.0:
            self._quiet += count
            return
        self._warned, quiet, self._quiet = now, self._quiet, 0
        log.warning("state %s unreachable: %s%s", self.where, why,
                    f"; {quiet} more since the last warning" if quiet else "")

    def _check_up(self) -> None:
        if self._closed:
            raise Unavailable("the Redis state is closed")
        if time.monotonic() < self._down_until:
            self.unavailable_count += 1
            raise Unavailable(f"{self.where}: unreachable (a moment ago)")

    # --- one round trip: what is queued, then the call's own commands ---

    def _has_queued(self) -> bool:
        return bool(self._puts) or self._carried()

    def _carried(self) -> bool:
        """Whether the script has something queued to carry."""
        return bool(self._adds or self._unsure or self._releases or self._pending)

    def _queued(self, rows: int) -> tuple[list[str], list[Any], tuple]:
        """Take what is queued off the queues, as the script's first keys and arguments
        (after its eight numbers) and what to put back should the round trip fail."""
        batches, self._unsure = self._unsure, []
        if self._adds:
            number = next(self._batches)
            self._open.add(number)
            batches.append((number, self._adds, 0))
            self._adds = {}
        releases, self._releases = self._releases, []
        # Off the queue while in flight: calls sent at once never carry the same rows.
        pending = self._pending
        backlog = [pending.popitem(last=False) for _ in range(min(rows, len(pending)))]
        keys: list[str] = []
        args: list[Any] = []
        settled = self._settled()
        for number, adds, undoes in batches:
            keys.append(self._applied)
            args += [len(adds), number, settled, BATCH_SECONDS, undoes]
            for key, (expiry, amount) in adds.items():
                keys.append(key)
                args += [amount, expiry]
        for name, token in releases:
            keys.append(_slot_key(name))
            args.append(token)
        written = 0
        for row_id, row in backlog:
            try:
                data = orjson.dumps(row)
                when = repr(float(row["time"]))
            except (TypeError, ValueError, KeyError) as e:  # a caller's bug: that row alone
                log.warning("ledger row %s cannot be stored: %s", row_id, e)
                continue
            keys.append(_row_key(row_id))
            args += [row_id, when, data]
            written += 1
        if written:
            keys.append(LEDGER)
        return keys, args, (batches, releases, backlog, written)

    def _restore(self, carried: tuple) -> None:
        """A round trip that failed: what it carried goes with the next, ahead of what
        queued since. Should it have run all the same, nothing counts twice: rows and
        releases are idempotent, the adds' batches keep their ids."""
        batches, releases, backlog, _written = carried
        pending = self._pending
        for row_id, row in reversed(backlog):
            if row_id not in pending:
                pending[row_id] = row
                pending.move_to_end(row_id, last=False)
        while len(pending) > MAX_PENDING:
            pending.popitem(last=False)
        self._unsure[:0] = batches
        self._bound_batches()
        self._releases[:0] = releases[:max(0, MAX_PENDING - len(self._releases))]
        self._schedule()

    async def _script(self, keys: list[str], args: list[Any], counters: int = 0,
                      slots: int = 0, rows: int = CARRIED_ROWS, wait: float | None = None,
                      now: float | None = None,
                      undo: tuple[dict[str, list[int]], list[tuple[str, str]]] | None = None
                      ) -> list:
        """One ``EVALSHA`` of :data:`SCRIPT`: what is queued, then ``keys``/``args`` (the
        take's counters and slots). ``undo``, for a take that adds or holds something: the
        adds and releases that give it back should its answer never come."""
        self._check_up()
        queued_keys, queued_args, carried = self._queued(rows)
        take = 0
        if undo is not None:
            take = next(self._batches)
            self._open.add(take)
            keys = [*keys, self._applied]
            args = [*args, self._settled(), BATCH_SECONDS]
        head = [time.time() if now is None else now, self.retention, len(carried[0]),
                len(carried[1]), carried[3], counters, slots, take]
        all_keys = queued_keys + keys
        argv = head + queued_args + args
        loop = asyncio.get_running_loop()
        reply = loop.create_future()
        self._outgoing.append((all_keys, argv, reply, self.timeout if wait is None else wait))
        if len(self._outgoing) == 1:
            # Sent once every task that runs in this turn of the loop has put its call in:
            # concurrent requests share a round trip.
            loop.call_soon(self._send_outgoing)
        try:
            result = await reply
        except asyncio.CancelledError:
            self._restore(carried)  # sent again, counted once (the batches keep their ids)
            self._unheard(take, undo)
            raise
        except Exception as e:  # refused, reset, timed out, or an error reply
            self._restore(carried)
            self._unheard(take, undo)
            raise self._failure(e) from None
        for number, _, undoes in carried[0]:
            self._open.discard(number)
            if undoes:
                self._open.discard(undoes)
                self._linger(undoes)
        self._open.discard(take)
        return result

    def _settled(self) -> int:
        """The lowest number still waited for (the set keeps it and every one above; 0:
        none, and nothing is trimmed)."""
        lowest = min(self._open, default=0)
        lingering = self._lingering
        if lingering:
            now = time.monotonic()
            while lingering and next(iter(lingering.values())) <= now:
                del lingering[next(iter(lingering))]
            if lingering:
                held = min(lingering)
                lowest = min(lowest, held) if lowest else held
        return lowest

    def _linger(self, take: int) -> None:
        """An undone take's number stays in the set a while: see UNDO_LINGER."""
        lingering = self._lingering
        lingering[take] = time.monotonic() + UNDO_LINGER
        while len(lingering) > MAX_UNDOS:
            del lingering[next(iter(lingering))]

    def _unheard(self, take: int, undo: tuple[dict[str, list[int]], list[tuple[str, str]]]
                 | None) -> None:
        """A take whose answer never came may have run (its caller heard it failed, so
        nobody will use or release what it took) or may still arrive: a batch of its own
        gives back whichever it did, and refuses it should it arrive later."""
        if undo is None:
            return
        adds, releases = undo
        number = next(self._batches)
        self._open.add(number)
        self._unsure.append((number, adds, take))
        if len(self._unsure) > MAX_UNDOS:
            self._bound_batches()
        for name, token in releases:
            self.release_soon(name, token)
        self._schedule()

    def _bound_batches(self) -> None:
        """The newest MAX_PENDING batches of usage and MAX_UNDOS undoings are kept; the
        others are given up on (no longer waited for)."""
        left = {False: MAX_PENDING, True: MAX_UNDOS}
        kept = []
        for batch in reversed(self._unsure):
            undoing = bool(batch[2])
            if left[undoing]:
                left[undoing] -= 1
                kept.append(batch)
            else:
                self._open.discard(batch[0])
                self._open.discard(batch[2])
        if len(kept) < len(self._unsure):
            kept.reverse()
            self._unsure = kept

    def _send_outgoing(self) -> None:
        calls, self._outgoing = self._outgoing, []
        task = asyncio.get_running_loop().create_task(self._send(calls))
        self._senders.add(task)
        task.add_done_callback(self._senders.discard)

    def _trim_later(self) -> None:
        if self._trimmer is None and not self._closing:
            self._trimmer = asyncio.get_running_loop().call_later(
                IDLE_CONNECTION_SECONDS, self._trim)

    def _trim(self) -> None:
        """Close the idle connections but the one used last (the pool hands out the most
        recently given back first, so the others served only a burst)."""
        self._trimmer = None
        idle = list(getattr(self._redis.connection_pool, "_available_connections", ()))[:-1]
        for connection in idle:
            if connection.is_connected:
                task = asyncio.get_running_loop().create_task(connection.disconnect())
                self._senders.add(task)
                task.add_done_callback(self._senders.discard)

    async def _send(self, calls: list) -> None:
        """The script calls queued in one turn of the loop, in one pipeline; each caller gets
        its reply, or the error."""
        from redis.exceptions import NoScriptError
        self._trim_later()
        wait = max(call[3] for call in calls)
        try:
            if not self._sha:
                self._sha = await asyncio.wait_for(self._redis.script_load(SCRIPT), wait)
            replies = await asyncio.wait_for(self._evalshas(calls), wait)
            again = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
            if again:  # Redis restarted (or was flushed): load the script again
                self._sha = await asyncio.wait_for(self._redis.script_load(SCRIPT), wait)
                resent = await asyncio.wait_for(self._evalshas([calls[i] for i in again]),
                                                wait)
                for i, reply in zip(again, resent, strict=True):
                    replies[i] = reply
        except Exception as e:  # the round trip itself failed: every caller hears it
            for call in calls:
                if not call[2].done():
                    call[2].set_exception(e)
            return
        for call, reply in zip(calls, replies, strict=True):
            if not call[2].done():
                if isinstance(reply, Exception):
                    call[2].set_exception(reply)
                else:
                    call[2].set_result(reply)

    async def _evalshas(self, calls: list) -> list:
        from redis.exceptions import ResponseError
        if len(calls) == 1:
            keys, argv = calls[0][0], calls[0][1]
            try:
                return [await self._redis.evalsha(self._sha, len(keys), *keys, *argv)]
            except ResponseError as e:  # an error reply (NOSCRIPT, say), not a lost Redis
                return [e]
        pipe = self._redis.pipeline(transaction=False)
        for keys, argv, _, _ in calls:
            pipe.evalsha(self._sha, len(keys), *keys, *argv)
        return await pipe.execute(raise_on_error=False)

    async def _commands(self, build, wait: float | None = None, carry: bool = True) -> list:
        """What is queued (when anything is, and ``carry``: for a read of what it changes),
        then the commands ``build`` adds to a pipeline, in one round trip; the results of
        ``build``'s commands."""
        if carry and self._carried():
            await self._script([], [])
        self._check_up()
        self._trim_later()
        pipe = self._redis.pipeline(transaction=False)
        build(pipe)
        try:
            results = await asyncio.wait_for(pipe.execute(raise_on_error=False),
                                             self.timeout if wait is None else wait)
        except Exception as e:  # refused, reset, timed out, or a reply it could not read
            raise self._failure(e) from None
        for result in results:
            if isinstance(result, Exception):
                raise self._failure(result)
        return results

    # --- the interface ---

    async def take(self, counters: Sequence[Counter], slots: Sequence[Slot] = (),
                   now: float | None = None) -> Taken:
        now = time.time() if now is None else now
        keys: list[str] = []
        args: list[Any] = []
        ends: list[int] = []
        for counter in counters:
            start, end = window(counter.per, now)
            keys.append(_counter_key(counter.name, start))
            args += [-1 if counter.limit is None else counter.limit, counter.amount,
                     end + GRACE_SECONDS]
            ends.append(end)
        # A block's units are in its token: what the script adds up.
        tokens = tuple(f"{self._prefix}{next(self._tokens):x}"
                       + (f"*{slot.units}" if slot.units != 1 else "") for slot in slots)
        for slot, token in zip(slots, tokens, strict=True):
            keys.append(_slot_key(slot.name))
            args += [slot.limit, now + slot.lease, token, slot.units]
        undo: tuple[dict[str, list[int]], list[tuple[str, str]]] | None = None
        if slots or any(counter.amount for counter in counters):
            adds: dict[str, list[int]] = {}
            for key, counter, end in zip(keys[:len(counters)], counters, ends, strict=True):
                if counter.amount:
                    adds.setdefault(key, [end + GRACE_SECONDS, 0])[1] -= counter.amount
            undo = adds, [(slot.name, token) for slot, token in zip(slots, tokens, strict=True)]
        # The take's own clock: a caller's ``now`` decides its windows and leases.
        call = asyncio.ensure_future(
            self._script(keys, args, len(counters), len(slots), now=now, undo=undo))
        try:
            # Shielded: a caller that gives up (the client gone) leaves the round trip to
            # finish, and what it granted is given back once the answer says so, the
            # request's counts as well as its slots (nobody will use them).
            reply = await asyncio.shield(call)
        except asyncio.CancelledError:
            call.add_done_callback(lambda done: self._given_up(done, counters, slots, tokens,
                                                               now))
            raise
        granted, blocked, retry = int(reply[0]), int(reply[1]), float(reply[2])
        used = [int(u) for u in reply[3:]]
        if not granted:
            names = [c.name for c in counters] + [s.name for s in slots]
            return Taken(False, tuple(Count(c.name, u, c.limit, end)
                                      for c, u, end in zip(counters, used, ends, strict=True)),
                         blocked=names[blocked - 1], slot_retry=max(0.0, retry))
        return Taken(True, tuple(Count(c.name, u + c.amount, c.limit, end)
                                 for c, u, end in zip(counters, used, ends, strict=True)),
                     tokens)

    def _given_up(self, done: asyncio.Future, counters: Sequence[Counter],
                  slots: Sequence[Slot], tokens: tuple[str, ...], now: float) -> None:
        """A take whose caller gave up, answered: what it was granted goes back (unanswered,
        :meth:`_unheard` gives it back)."""
        if done.cancelled() or done.exception() is not None or not int(done.result()[0]):
            return
        self.add_soon([Counter(c.name, c.per, amount=-c.amount) for c in counters if c.amount],
                      now)
        for slot, token in zip(slots, tokens, strict=True):
            self.release_soon(slot.name, token)

    def add_soon(self, counters: Iterable[Counter], now: float | None = None) -> None:
        now = time.time() if now is None else now
        adds = self._adds
        for counter in counters:
            if counter.amount:
                start, end = window(counter.per, now)
                key = _counter_key(counter.name, start)
                entry = adds.get(key)
                if entry is None:
                    adds[key] = [end + GRACE_SECONDS, counter.amount]
                else:
                    entry[1] += counter.amount
        self._schedule()

    async def counts(self, counters: Iterable[Counter], now: float | None = None
                     ) -> list[Count]:
        now = time.time() if now is None else now
        looked = []
        for counter in counters:
            start, end = window(counter.per, now)
            looked.append((counter, _counter_key(counter.name, start), end))
        if not looked:
            return []
        (values,) = await self._commands(lambda pipe: pipe.mget([key for _, key, _ in looked]))
        return [Count(counter.name, int(value or 0), counter.limit, end)
                for (counter, _, end), value in zip(looked, values, strict=True)]

    def release_soon(self, name: str, token: str) -> None:
        if len(self._releases) < MAX_PENDING:  # past that, the lease gives it back
            self._releases.append((name, token))
        self._schedule()

    def record_soon(self, rows: Sequence[dict[str, Any]]) -> None:
        pending = self._pending
        for row in rows:
            pending.setdefault(row["id"], dict(row))
        dropped = 0
        while len(pending) > MAX_PENDING:
            pending.popitem(last=False)
            dropped += 1
        if dropped:
            self._dropped_rows.warn(dropped, "state %s: %d ledger rows dropped (%d waited for "
                                    "Redis already)", self.where, dropped, MAX_PENDING)
        self._schedule()

    async def rows(self, since: float | None = None, until: float | None = None,
                   where: dict[str, Any] | None = None, limit: int | None = None,
                   newest_first: bool = False) -> list[dict[str, Any]]:
        deadline = time.monotonic() + ROWS_SECONDS
        # What this process recorded lands first, so that it reads its own rows.
        while self._pending:
            await self._script([], [], rows=ROW_BATCH, wait=ROWS_SECONDS)
        if self._senders:  # and what other calls carry now
            await asyncio.wait(set(self._senders), timeout=ROWS_SECONDS)
        low = "-inf" if since is None else repr(float(since))
        high = "+inf" if until is None else f"({float(until)!r}"
        found: list[dict[str, Any]] = []
        offset, page = 0, 500
        while time.monotonic() < deadline:
            if newest_first:
                (ids,) = await self._commands(lambda pipe, at=offset: pipe.zrevrangebyscore(
                    LEDGER, high, low, start=at, num=page), wait=ROWS_SECONDS)
            else:
                (ids,) = await self._commands(lambda pipe, at=offset: pipe.zrangebyscore(
                    LEDGER, low, high, start=at, num=page), wait=ROWS_SECONDS)
            if not ids:
                return found
            names = [_row_key(i.decode()) for i in ids]
            (bodies,) = await self._commands(lambda pipe, names=names: pipe.mget(names),
                                            wait=ROWS_SECONDS)
            for body in bodies:
                if body is None:
                    continue  # expired meanwhile
                row = orjson.loads(body)
                if where and any(row.get(k) != v for k, v in where.items()):
                    continue
                found.append(row)
                if limit is not None and len(found) >= limit:
                    return found
            offset += len(ids)
        raise Unavailable(f"{self.where}: the ledger read took over {ROWS_SECONDS} s")

    async def keys(self) -> tuple[int, list[dict[str, Any]]]:
        version, records = await self._commands(
            lambda pipe: (pipe.get(KEYS_VERSION), pipe.hvals(KEYS)))
        found = sorted((orjson.loads(r) for r in records), key=lambda r: r["name"])
        return int(version or 0), found

    async def keys_version(self) -> int:
        (version,) = await self._commands(lambda pipe: pipe.get(KEYS_VERSION))
        return int(version or 0)

    async def put_key(self, record: dict[str, Any]) -> None:
        data = orjson.dumps(record)
        # The key before the version, on one connection in order: a reader may see the new
        # key under the old version (and reads it again at the next), never the reverse.
        await self._commands(lambda pipe: (pipe.hset(KEYS, record["name"], data),
                                          pipe.incr(KEYS_VERSION)))

    async def get(self, namespace: str, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        names = [_kv_key(namespace, key) for key in keys]
        puts, inflight = self._puts, self._inflight
        queued = [puts.get(name) or inflight.get(name) for name in names] \
            if puts or inflight else None
        if queued is None or None in queued:
            # Nothing queued is a counter, a slot or a row this reads: it need not wait.
            (values,) = await self._commands(lambda pipe: pipe.mget(names), carry=False)
        else:
            values = [None] * len(names)
        if queued is None:
            return list(values)
        now = time.time()
        return [v if q is None else q[0] if q[1] > now else None
                for q, v in zip(queued, values, strict=True)]

    def put_soon(self, namespace: str, items: dict[str, bytes], ttl: float) -> None:
        until = time.time() + ttl
        puts = self._puts
        for key, value in items.items():
            name = _kv_key(namespace, key)
            puts.pop(name, None)  # to the end: the newest go last
            puts[name] = (value, until)
        dropped = 0
        while len(puts) > MAX_PENDING:
            del puts[next(iter(puts))]
            dropped += 1
        if dropped:
            self._dropped_puts.warn(dropped, "state %s: %d key-value entries dropped (%d waited "
                                    "for Redis)", self.where, dropped, MAX_PENDING)
        self._schedule()

    async def _unqueue(self, namespace: str, keys: Iterable[str]) -> None:
        """What a later :meth:`put` or :meth:`delete` of the same keys supersedes: dropped
        from the queue, and where it is being sent, waited for (on another connection, it
        could land after the call's own command) and never queued again."""
        names = [_kv_key(namespace, key) for key in keys]
        for name in names:
            self._puts.pop(name, None)
        inflight = self._inflight
        if any(name in inflight for name in names):
            for name in names:
                inflight.pop(name, None)
            if self._sending is not None:
                await asyncio.shield(self._sending)

    async def put(self, namespace: str, items: dict[str, bytes], ttl: float) -> None:
        if not items:
            return
        await self._unqueue(namespace, items)
        ms = max(1, int(ttl * 1000))
        await self._commands(lambda pipe: [pipe.set(_kv_key(namespace, key), value, px=ms)
                                          for key, value in items.items()])

    async def delete(self, namespace: str, keys: Sequence[str]) -> None:
        if keys:
            await self._unqueue(namespace, keys)
            await self._commands(
                lambda pipe: pipe.delete(*[_kv_key(namespace, key) for key in keys]))

    async def _send_puts(self) -> None:
        """The key-value entries queued, in one pipeline; when the send fails or is
        cancelled (a close), they wait again (behind what was queued since, which is
        newer), but for those a later put or delete superseded meanwhile."""
        inflight = self._inflight = self._puts
        self._puts = {}
        self._sending = done = asyncio.get_running_loop().create_future()
        sent = False
        try:
            now = time.time()
            live = [(name, value, int((until - now) * 1000))
                    for name, (value, until) in inflight.items() if until > now]
            if live:
                self._check_up()
                pipe = self._redis.pipeline(transaction=False)
                for name, value, ms in live:
                    pipe.set(name, value, px=max(1, ms))
                results = await asyncio.wait_for(pipe.execute(raise_on_error=False),
                                                 self.timeout)
                failed = next((r for r in results if isinstance(r, Exception)), None)
                if failed is not None:
                    raise failed
            sent = True
        except Unavailable:
            raise
        except Exception as e:  # refused, reset, timed out, a reply it could not read
            raise self._failure(e) from None
        finally:
            if self._inflight is inflight:
                self._inflight = {}
            if self._sending is done:
                self._sending = None
            if not sent and inflight:
                merged = {**inflight, **self._puts}
                while len(merged) > MAX_PENDING:
                    del merged[next(iter(merged))]
                self._puts = merged
            done.set_result(None)

    # --- the background flush: what is queued, when no call carries it ---

    def _schedule(self) -> None:
        if self._closing:
            return
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush_loop())

    async def _flush_loop(self) -> None:
        pause = DOWN_SECONDS
        waited = 0.0
        while self._has_queued() and not self._closing:
            await asyncio.sleep(LINGER)
            waited += LINGER
            if not self._has_queued():
                break  # a call carried it meanwhile
            if not (self._adds or self._unsure or self._releases or self._puts) \
                    and waited < ROW_LINGER \
                    and len(self._pending) < ROW_BATCH:
                continue  # only ledger rows: more of them share the round trip
            waited = 0.0
            try:
                await self._flush()
                pause = DOWN_SECONDS
            except Unavailable:
                if self._closing:
                    break
                # Catch up when Redis is back: try again, less often the longer it is out.
                await asyncio.sleep(max(pause, self._down_until - time.monotonic()))
                pause = min(pause * 2, 30.0)

    async def _flush(self) -> None:
        if self._puts:
            await self._send_puts()
        if self._carried():
            await self._script([], [], rows=ROW_BATCH)
