"""Upstream pools: several keys (credentials) for one backend, each request sent with one.

A backend with ``credentials:`` in relay.yaml holds a pool. Which credential a request goes
with:

- **a session stays on one credential** while it is healthy: the prompt cache is per
  organization, so a session that hops pays for its whole history again (cache writes
  instead of reads). The session is :meth:`relay.exchange.Exchange.session`, the relay's own
  rule (:mod:`relay.sessions`);
- **a new session** goes to the healthy credential with the least in flight for its
  weight, ties broken by the fewest sessions placed for its weight (so that sessions that
  come one at a time spread exactly by weight);
- **health**: a ``429`` or ``529`` cools the credential down for what ``retry-after`` (or an
  exhausted ``anthropic-ratelimit-*-reset``) says, capped at ``pool.max_cooldown``; a ``401``
  or ``403`` takes it out until its key changes (or ``relay backends --reinstate``); a
  connection failure cools it for ``pool.backoff`` seconds, doubled for each failure in a row;
- a session whose credential is cooling or out **moves** to another, once: it then stays
  there (a move costs a cache miss, so it is noted on the timeline and counted);
- a credential with **limits of its own** (``limits:``, a relay key's shape) is taken from
  like a key (:mod:`relay.limits`): one at them is passed over until its window lets a
  request through, and a session on it moves;
- when **every credential** is cooling (or at its limits), the client gets Anthropic's ``429
  rate_limit_error`` (``529 overloaded_error`` when none cooled for a 429) with the shortest
  ``retry-after``, before anything goes upstream; when every one is out, a ``503``.

Stickiness and health live on the host's state seam (:mod:`relay.state`, namespace
``pools``), so that the workers of one host (SQLite) or replicas (Redis) send a session to one
credential and honour each other's cooldowns. What this process learns itself (a 429 it was
answered) it uses at once and writes through; what other processes learned it reads at most
every ``pool.refresh`` seconds per backend, in the same single read as a session it does not
hold yet. The trade-off: a request of a healthy session this process already placed costs no
round trip, and another process's cooldown reaches this one within ``refresh`` seconds (its
requests in that window may meet the 429 themselves, and then cool the credential here too).
Two processes placing the same new session at the same instant may choose two credentials;
each keeps its choice until that credential cools.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from . import limits as limits_module
from .errors import RelayError
from .headers import seconds_until
from .state import State, Unavailable

log = logging.getLogger("relay.pools")

NAMESPACE = "pools"
# exchange.state: the (pool, credential, held) this exchange holds in flight; held: the plan
# of the credential's own limits and the release tokens of its slots, or None
LEASE = "relay.pools"
SCOPE = "pool"  # the credentials' limits' counters: apart from relay keys' (relay.limits)
OUT_SECONDS = 30 * 86400.0  # how long shared state keeps an out record (until reinstated)
MAX_STICKY = 100_000  # sessions one process remembers per backend
UNAVAILABLE_LOG_SECONDS = 60.0
RECENT = 10  # statuses per credential in health()
COOLING_STATUSES = (429, 529)
OUT_STATUSES = (401, 403)
RATELIMIT_PREFIX = "anthropic-ratelimit-"
DOWN_SECONDS = 5.0  # how long the state is left alone after a round trip to it failed
UNREACHED = "\x00unreached"  # what a read returns when the state could not be reached


@dataclasses.dataclass(slots=True)
class Health:
    """What is known against a credential: ``cooling`` until ``until`` or ``out`` (with the
    fingerprint of the key that was refused: a new key is a new credential)."""

    state: str
    since: float
    reason: str
    until: float | None = None
    status: int | None = None
    failures: int = 0  # connection failures in a row: the backoff's exponent
    key: str | None = None

    def blocks(self, now: float, fingerprint: str | None) -> bool:
        if self.state == "out":
            return self.key is None or fingerprint is None or self.key == fingerprint
        return self.until is not None and self.until > now

    def encode(self) -> bytes:
        return orjson.dumps(dataclasses.asdict(self))

    @classmethod
    def decode(cls, raw: bytes | None) -> Health | None:
        if raw is None:
            return None
        try:
            fields = orjson.loads(raw)
            return cls(**fields)
        except (orjson.JSONDecodeError, TypeError):
            return None


def _rate_limited(health: Health) -> bool:
    """Whether ``health`` is a Messages API rate limit (a 429's cooldown)."""
    return health.state == "cooling" and health.status == 429


def fingerprint(key: str) -> str | None:
    """A short digest naming a key in shared state (never the key); None for no key."""
    if not key:
        return None
    return hashlib.blake2b(key.encode(), digest_size=8, person=b"relay-pools").hexdigest()


def health_key(backend: str, credential: str) -> str:
    return f"h:{backend}:{credential}"


def session_key(backend: str, session: str) -> str:
    return f"s:{backend}:{session}"


def cooldown(headers, options, now: float) -> float:
    """How long a 429 or 529 cools a credential: ``retry-after`` when the upstream sent one;
    else the latest reset among the ``anthropic-ratelimit-*`` limits it says are used up
    (the rule the Anthropic SDKs were asked to follow, anthropic-sdk-typescript#357: the
    credential is usable again once every exhausted limit has reset); else
    ``default_cooldown``. Never more than ``max_cooldown``."""
    from .upstream import retry_after  # the seam imports this module
    asked = retry_after(headers) if headers is not None else None
    if asked is None and headers is not None:
        resets = []
        for name, value in headers.items():
            lower = name.lower()
            if lower.startswith(RATELIMIT_PREFIX) and lower.endswith("-remaining") \
                    and value.strip() == "0":
                reset = headers.get(lower[:-len("-remaining")] + "-reset")
                seconds = seconds_until(reset, now) if reset else None
                if seconds is not None:
                    resets.append(seconds)
        if resets:
            asked = max(resets)
    if asked is None:
        asked = options.default_cooldown
    return min(max(0.0, asked), options.max_cooldown)


def pick(names: Sequence[str], weights: dict[str, float], inflight: dict[str, int],
         placed: dict[str, int]) -> str:
    """The credential a new session goes to: the least in flight for its weight, then the
    fewest sessions placed for its weight, then the first listed."""
    return min(names, key=lambda name: (inflight[name] / weights[name],
                                         placed[name] / weights[name]))


class Exhausted(Exception):
    """No credential of the backend can take the request now: ``error`` is the answer."""

    def __init__(self, error: RelayError, retry: int | None):
        super().__init__(error.message)
        self.error = error
        self.retry = retry


class Pool:
    """One backend's credentials as this process knows them."""

    def __init__(self, backend):
        self.backend = backend.name
        self.options = backend.pool
        self.credentials = {credential.name: credential for credential in backend.credentials}
        self.order = tuple(self.credentials)
        self.weights = {c.name: c.weight for c in backend.credentials}
        self.prints = {c.name: fingerprint(c.key) for c in backend.credentials}
        self.health_keys = [health_key(self.backend, name) for name in self.order]
        self.health: dict[str, Health] = {}
        self.unwritten: set[str] = set()  # records the state did not take: kept here
        self.fetched = -math.inf
        # session -> (credential, when this process last confirmed it with the state)
        self.sticky: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self.inflight = dict.fromkeys(self.order, 0)
        self.placed = dict.fromkeys(self.order, 0)
        self.logged_out: set[tuple[str, str | None]] = set()
        # Each credential's own limits, and until when (epoch) one was last found at them: a
        # request does not ask the state about it again before then.
        self.limits = {c.name: limits_module.Limits.of(c.limits) if c.limits else None
                       for c in backend.credentials}
        self.limited: dict[str, tuple[float, str]] = {}

    def at_limits(self, name: str, now: float) -> bool:
        found = self.limited.get(name)
        return found is not None and now < found[0]

    def blocked(self, name: str, now: float) -> bool:
        health = self.health.get(name)
        return health is not None and health.blocks(now, self.prints[name])

    def remember(self, session: str, name: str, now: float) -> None:
        sticky = self.sticky
        sticky[session] = (name, now)
        sticky.move_to_end(session)
        if len(sticky) > MAX_STICKY:
            sticky.popitem(last=False)

    def refused(self, now: float, tried: set[str]) -> Exhausted:
        """The answer when every credential is cooling, out or at its own limits (or, in
        this request, was answered with a 429 that asked for no wait)."""
        limited = [self.limited[name][0] for name in self.order if self.at_limits(name, now)]
        blocked = [name for name in self.order if name in tried or self.blocked(name, now)]
        cooling = [health for name in self.order
                   if (health := self.health.get(name)) is not None and health.state == "cooling"
                   and (name in tried or health.blocks(now, None))]
        if limited and len(limited) + len(blocked) >= len(self.order):
            # The soonest any credential takes a request again: a cooling one may be back
            # before the limits' window turns (a minute's), and the client may come then.
            soonest = min(limited + [max(now, health.until or now) for health in cooling])
            retry = max(1, math.ceil(soonest - now))
            return Exhausted(RelayError(
                429, f"every credential of backend {self.backend} is at its limits or cooling "
                     f"down; retry after {retry} s", "rate_limit_error"), retry)
        if cooling:
            soonest = min(max(now, health.until or now) for health in cooling)
            retry = max(1, math.ceil(soonest - now))
            rate_limited = any(health.status == 429 for health in cooling)
            status, kind = (429, "rate_limit_error") if rate_limited else (529, "overloaded_error")
            why = "rate limits" if rate_limited else "overload or failures"
            return Exhausted(RelayError(
                status, f"every credential of backend {self.backend} is cooling down after "
                        f"the upstream's {why}; retry after {retry} s", kind), retry)
        return Exhausted(RelayError(
            503, f"every credential of backend {self.backend} is out: the upstream refused "
                 f"their keys (401/403); the operator must replace them (relay backends)",
            "api_error"), None)


class Pools:
    """Every pool of one running relay, over the host's state (a :class:`relay.state.State`;
    None: this process's memory). ``clock`` is for tests."""

    def __init__(self, config, state: State | None = None,
                 clock: Callable[[], float] = time.time):
        if state is None:
            from .state.memory import MemoryState
            state = MemoryState()
        self.state = state
        self.clock = clock
        self.pools = {b.name: Pool(b) for b in config.backends if b.credentials}
        self._unavailable_logged = -math.inf
        # After a round trip failed, the state is left alone for a while: during an outage
        # a request must not wait for its timeout on every read.
        self._down_until = -math.inf

    def pool(self, backend) -> Pool | None:
        return self.pools.get(backend.name) if backend.credentials else None

    def _unreachable(self, e: BaseException) -> None:
        now = time.monotonic()
        self._down_until = now + DOWN_SECONDS
        if now - self._unavailable_logged >= UNAVAILABLE_LOG_SECONDS:
            self._unavailable_logged = now
            log.warning("pools: the shared state is unreachable (%s); choosing credentials "
                        "from what this process knows", type(e).__name__)

    async def _read(self, pool: Pool, session: str | None, now: float) -> str | None:
        """One round trip: the pool's health and the session's credential (when asked);
        returns the session's, None when the state holds none, or :data:`UNREACHED`."""
        keys = list(pool.health_keys)
        if session is not None:
            keys.append(session_key(pool.backend, session))
        if time.monotonic() < self._down_until:
            pool.fetched = now
            return UNREACHED
        try:
            values = await self.state.get(NAMESPACE, keys)
        except (Unavailable, OSError) as e:
            self._unreachable(e)
            pool.fetched = now
            return UNREACHED
        pool.fetched = now
        health = {name: record for name, raw in zip(pool.order, values, strict=False)
                  if (record := Health.decode(raw)) is not None}
        for name in pool.unwritten:
            if name not in health and name in pool.health:
                health[name] = pool.health[name]
        pool.health = health
        if session is None:
            return None
        raw = values[-1]
        if raw is None:
            return None
        try:
            name, placed = orjson.loads(raw)
        except (orjson.JSONDecodeError, TypeError, ValueError):
            return None
        if name not in pool.credentials:
            return None  # a credential since taken out of relay.yaml
        if now - placed >= pool.options.sticky_seconds / 2:
            await self._put(pool, {session_key(pool.backend, session):
                                   orjson.dumps([name, now])}, pool.options.sticky_seconds)
        return name

    async def _put(self, pool: Pool, items: dict[str, bytes], ttl: float) -> bool:
        if time.monotonic() < self._down_until:
            return False
        try:
            await self.state.put(NAMESPACE, items, ttl)
        except (Unavailable, OSError) as e:
            self._unreachable(e)
            return False
        return True

    async def choose(self, exchange, pool: Pool, tried: set[str], holder: str | None = None):
        """The credential ``exchange`` goes with (a :class:`relay.config.Credential`), now
        held in flight until :meth:`release`; raises :class:`Exhausted` when none can take
        it. ``tried``: credentials this request already failed with. ``holder``: the one
        that holds the request's server-held thread, taken before the session's while it
        can take the request (the caller sees when it could not).

        A credential with limits of its own (``limits:``) is taken from like a relay key's
        (:mod:`relay.limits`, counters in the state shared by every process): one at them is
        passed over until its window lets a request through, and the session moves."""
        for _ in range(len(pool.order) + 1):  # each pass finds one more credential at limits
            now = self.clock()
            chosen = await self._place(exchange, pool, tried, now, holder)
            held = None
            # Messages only, as a relay key's limits (docs/accounting.md): the upstream counts
            # token counts apart (Anthropic's token-counting docs give them requests a minute
            # of their own); pass-through routes are left out as a key's are.
            found = pool.limits[chosen] if exchange.endpoint == "messages" else None
            plan = found.plan(f"{pool.backend}/{chosen}", limits_module.upstream_model(
                exchange.backend, exchange.model), SCOPE) if found is not None else None
            if plan is not None:
                taken = await self._take(exchange, plan)
                if taken is not None and not taken.granted:
                    assert taken.blocked is not None  # a refusal names what refused
                    limit = plan.limits[taken.blocked]
                    count = next((c for c in taken.counts if c.name == taken.blocked), None)
                    # A slot frees when a request ends, which nobody can foresee: a second.
                    until = max(float(count.reset) if count is not None else 0.0, now + 1.0)
                    pool.limited[chosen] = (until, limit.name)
                    exchange.note("relay", "credential at its limits", backend=pool.backend,
                                  credential=chosen, limit=limit.name)
                    continue
                if taken is not None:
                    held = (plan, taken.tokens)
            pool.inflight[chosen] += 1
            exchange.state[LEASE] = (pool, chosen, held)
            return pool.credentials[chosen]
        refusal = pool.refused(self.clock(), tried)
        if refusal.retry is not None:
            exchange.response_headers["retry-after"] = str(refusal.retry)
        raise refusal

    async def _take(self, exchange, plan):
        """A take of ``plan`` from the state (in memory when its leases allow); None when
        the state is unreachable and ``state.on_unavailable`` lets the request go on."""
        state = self.state
        taken = state.take_now(plan.counters, plan.slots)
        if taken is not None:
            return taken
        try:
            return await state.take(plan.counters, plan.slots)
        except Unavailable as e:
            if state.on_unavailable == "closed":
                raise RelayError(503, "the relay cannot reach its shared state to check its "
                                      "upstream credentials' limits (state.on_unavailable: "
                                      "closed); the request was not sent", "api_error") from e
            exchange.note("relay", "state unavailable: credential limits not checked")
            self._unreachable(e)
            return None

    async def _place(self, exchange, pool: Pool, tried: set[str], now: float,
                     holder: str | None = None) -> str:
        """Which credential the request goes with, by thread, session and health (limits
        aside)."""
        session = exchange.session() if exchange.endpoint != "passthrough" else None
        entry = pool.sticky.get(session) if session is not None else None
        current = entry[0] if entry is not None else None
        stored = True  # whether the state holds the session where this process has it
        fresh = now - pool.fetched < pool.options.refresh
        if not fresh if session is None else (
                current is None or not fresh or current in tried or pool.blocked(current, now)):
            # Not the hot path (a session this process placed, on a credential it knows
            # healthy, with a view of the others' cooldowns fresh enough): one read, of what
            # other processes know and where they placed (or moved) the session.
            found = await self._read(pool, session, now)
            if session is not None and (placed := pool.sticky.get(session)) is not None \
                    and placed is not entry:
                # Another request of this session placed or moved it while this one read (a
                # client sends its first requests together): the same credential, not a
                # second one. What the read found may be older than that move.
                current = placed[0]
            elif found is UNREACHED:
                pass  # what this process knows is all there is
            elif found is not None:
                current = found
            else:
                stored = False
        if holder is not None and holder != current:
            # Another account would not find the thread: the session goes where it is held.
            current, stored = holder, False
        limited = exchange.endpoint == "messages"  # what a credential's limits count
        # A token count goes with a credential cooling for the Messages API's 429: counting
        # has its own rate limits (Anthropic's token-counting docs), so that 429 says
        # nothing of it, and refusing the count would be the relay's own refusal.
        counting = exchange.endpoint == "count_tokens"
        usable = [name for name in pool.order if name not in tried and (
            not pool.blocked(name, now) or counting and _rate_limited(pool.health[name]))
            and not (limited and pool.at_limits(name, now))]
        if current is not None and current in usable:
            chosen = current
            if not stored and session is not None:  # the state lost it (expired, restarted)
                await self._put(pool, {session_key(pool.backend, session):
                                       orjson.dumps([chosen, now])},
                                pool.options.sticky_seconds)
        elif not usable:
            refusal = pool.refused(now, tried)
            if refusal.retry is not None:
                exchange.response_headers["retry-after"] = str(refusal.retry)
            raise refusal
        else:
            chosen = pick(usable, pool.weights, pool.inflight, pool.placed)
            pool.placed[chosen] += 1
            if session is not None:
                if current is None:
                    exchange.note("relay", "credential placed", backend=pool.backend,
                                  credential=chosen)
                else:
                    health = pool.health.get(current)
                    reason = (health.reason if health is not None
                              else "at its limits" if pool.at_limits(current, now) else "failed")
                    exchange.note("relay", "credential moved", backend=pool.backend,
                                  credential=current, to=chosen, reason=reason)
                pool.remember(session, chosen, now)  # before the write's wait: see above
                await self._put(pool, {session_key(pool.backend, session):
                                       orjson.dumps([chosen, now])},
                                pool.options.sticky_seconds)
        if session is not None:
            pool.remember(session, chosen, now)
        return chosen

    def release(self, exchange) -> None:
        """The exchange no longer holds its credential in flight (its answer is over, or the
        attempt failed): its slots are given back, and what the answer used (``exchange.
        usage``) counts against the credential's limits; twice does nothing."""
        lease = exchange.state.pop(LEASE, None)
        if lease is None:
            return
        pool, name, held = lease
        pool.inflight[name] -= 1
        if held is None:
            return
        plan, tokens = held
        state = self.state
        for slot, token in zip(plan.slots, tokens, strict=True):
            state.release_soon(slot.name, token)
        if tokens and name in pool.limited and pool.limited[name][1] == "concurrent":
            del pool.limited[name]  # a slot is free again
        added = limits_module.spent(plan, getattr(exchange, "usage", None))
        if added:
            state.add_soon(added)

    async def report(self, exchange, pool: Pool, name: str, status: int | None,
                     headers=None) -> bool:
        """What an attempt with credential ``name`` came back with (``status`` None: no
        answer). Returns whether the answer was the credential's fault (cooling, out), so
        that another credential is tried at once."""
        now = self.clock()
        previous = pool.health.get(name)
        options = pool.options
        if status in COOLING_STATUSES and exchange.endpoint == "count_tokens":
            # Token counting has rate limits of its own, apart from the Messages API's
            # (Anthropic's token-counting docs: 100 requests a minute at tier 1): its 429 or
            # 529 says nothing of the messages the credential can take. Cooling it would move
            # its sessions (a prompt-cache miss each) and, with every credential's counting
            # limited, refuse messages the upstream would take. The client gets the answer.
            return False
        if status is not None and status in COOLING_STATUSES:
            seconds = cooldown(headers, options, now)
            record = Health("cooling", now, f"{status} from upstream", until=now + seconds,
                            status=status)
            exchange.note("relay", "credential cooling", backend=pool.backend, credential=name,
                          status=status, seconds=round(seconds, 3))
            await self._record(pool, name, record, max(seconds, 1.0))
            return True
        if status is not None and status in OUT_STATUSES:
            key = pool.prints[name]
            record = Health("out", now, f"{status} from upstream", status=status, key=key)
            exchange.note("relay", "credential out", backend=pool.backend, credential=name,
                          status=status)
            if (name, key) not in pool.logged_out:
                pool.logged_out.add((name, key))
                log.warning("backend %s: credential %s is out: the upstream answered %d; it "
                            "stays out until its key changes or `relay backends --reinstate "
                            "%s/%s`", pool.backend, name, status, pool.backend, name)
            await self._record(pool, name, record, OUT_SECONDS)
            return True
        if status is None:
            failures = (previous.failures if previous is not None else 0) + 1
            seconds = min(options.max_cooldown, options.backoff * 2 ** (failures - 1))
            if previous is not None and previous.status is not None \
                    and previous.blocks(now, pool.prints[name]) \
                    and (previous.until is None or previous.until >= now + seconds):
                # A request still in flight failed after another was answered a 429 or a
                # 401 with this key: the failure says nothing of the key, and must not cut
                # the upstream's wait short or put a refused key back after a backoff.
                return False
            record = Health("cooling", now, "connection failed", until=now + seconds,
                            failures=failures)
            exchange.note("relay", "credential backoff", backend=pool.backend, credential=name,
                          seconds=round(seconds, 3), failures=failures)
            # Kept past its end, so that the next failure in a row doubles the wait.
            await self._record(pool, name, record, seconds + options.max_cooldown)
            return False
        if previous is not None and status < 500 and not previous.blocks(now, pool.prints[name]):
            # Answered again after a backoff: the next failure starts from the first wait.
            pool.health.pop(name, None)
            pool.unwritten.discard(name)
            key = health_key(pool.backend, name)
            try:
                # Only the record this process holds: another process may have written a
                # newer one (a 429 it was answered while this request was in flight), which
                # a blind delete would take from every process.
                stored = Health.decode((await self.state.get(NAMESPACE, [key]))[0])
                if stored is not None and stored != previous:
                    pool.health[name] = stored
                else:
                    await self.state.delete(NAMESPACE, [key])
            except (Unavailable, OSError) as e:
                self._unreachable(e)
        return False

    async def _record(self, pool: Pool, name: str, record: Health, ttl: float) -> None:
        pool.health[name] = record
        if await self._put(pool, {health_key(pool.backend, name): record.encode()}, ttl):
            pool.unwritten.discard(name)
        else:
            pool.unwritten.add(name)


async def health(state: State, config) -> list[dict[str, Any]]:
    """Each pooled credential's state, as every process sharing ``state`` sees it: one dict
    per credential with ``backend``, ``credential``, ``state`` (``healthy``, ``cooling`` or
    ``out``), ``until`` (epoch seconds a cooldown ends, else None), ``since`` (when it began,
    else None), ``reason``, ``recent`` (the statuses of its latest attempts in the ledger,
    newest first, when the ledger holds any) and ``limits`` (for a credential with limits of
    its own, each window's counter: ``limit`` its name, ``models`` the pattern it is for or
    None, ``used``, ``of`` and ``reset``; budgets in micro-dollars)."""
    now = time.time()
    entries = [(backend, credential) for backend in config.backends
               for credential in backend.credentials]
    if not entries:
        return []
    values = await state.get(NAMESPACE, [health_key(b.name, c.name) for b, c in entries])
    recent: dict[tuple[Any, Any], list[int]] = {}
    try:
        rows = await state.rows(since=now - 86400, newest_first=True, limit=1000)
    except (Unavailable, OSError):
        rows = []
    for row in rows:
        for attempt in reversed(row.get("attempts") or ()):
            if not isinstance(attempt, dict) or attempt.get("credential") is None:
                continue
            found = recent.setdefault((attempt.get("backend"), attempt["credential"]), [])
            if len(found) < RECENT and attempt.get("status") is not None:
                found.append(attempt["status"])
    used = await _limits_used(state, entries)
    listed = []
    for (backend, credential), raw in zip(entries, values, strict=True):
        record = Health.decode(raw)
        blocking = record is not None and record.blocks(now, fingerprint(credential.key))
        listed.append({
            "backend": backend.name, "credential": credential.name,
            "state": record.state if blocking and record is not None else "healthy",
            "until": record.until if blocking and record is not None else None,
            "since": record.since if blocking and record is not None else None,
            "reason": record.reason if blocking and record is not None else None,
            "recent": recent.get((backend.name, credential.name), []),
            "limits": used.get((backend.name, credential.name), []),
        })
    return listed


async def _limits_used(state: State, entries) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Where each credential with limits of its own stands against them, in one read."""
    counted = []
    for backend, credential in entries:
        found = limits_module.Limits.of(credential.limits) if credential.limits else None
        if found is None:
            continue
        # Every rule, the model patterns' too: counters are named by rule, not by model.
        plan = limits_module.plan(f"{backend.name}/{credential.name}", found.rules, SCOPE)
        counted += [((backend.name, credential.name), plan.limits[c.name], c)
                    for c in plan.counters]
    if not counted:
        return {}
    try:
        counts = await state.counts([counter for *_, counter in counted])
    except (Unavailable, OSError):
        return {}
    used: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for (where, limit, _), count in zip(counted, counts, strict=True):
        used.setdefault(where, []).append({
            "limit": limit.name, "models": limit.rule.pattern, "used": count.used,
            "of": limit.limit, "reset": count.reset})
    return used


async def reinstate(state: State, config, backend: str, credential: str) -> bool:
    """Forget what is held against one credential (an out key the operator has fixed at
    the provider); False when relay.yaml has no such credential."""
    if not any(b.name == backend and any(c.name == credential for c in b.credentials)
               for b in config.backends):
        return False
    await state.delete(NAMESPACE, [health_key(backend, credential)])
    return True


# --- relay backends -----------------------------------------------------------------------


def _when(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


def described(entry: dict[str, Any], now: float) -> str:
    """One line of ``relay backends`` for a :func:`health` entry."""
    state = entry["state"]
    if state == "cooling":
        left = max(0, math.ceil((entry["until"] or now) - now))
        state = f"cooling until {_when(entry['until'] or now)} ({left} s): {entry['reason']}"
    elif state == "out":
        state = f"out since {_when(entry['since'] or now)}: {entry['reason']}"
    recent = " ".join(str(status) for status in entry["recent"])
    limits = ", ".join(
        f"{limit['limit']}{' for ' + limit['models'] if limit['models'] else ''} "
        + (f"{limits_module.dollars(limit['used'] / 1e6)} of "
           f"{limits_module.dollars(limit['of'] / 1e6)}" if limit["limit"] == "budget"
           else f"{limit['used']} of {limit['of']}")
        for limit in entry.get("limits", ()))
    return f"{entry['backend']}/{entry['credential']}  {state}" + (
        f"  (recent: {recent})" if recent else "") + (f"  (limits: {limits})" if limits else "")


def add_arguments(parser) -> None:
    parser.add_argument("--config", default="relay.yaml", help="path to relay.yaml")
    parser.add_argument("--json", action="store_true", help="one JSON document: the list")
    parser.add_argument("--reinstate", metavar="BACKEND/CREDENTIAL",
                        help="forget a cooldown or an out key (one the provider took back)")


def main(args) -> int:
    """``relay backends``: each pooled credential's state, from the shared state relay.yaml
    names (``state:``)."""
    import asyncio
    import sys

    from . import config as config_module
    from .errors import ConfigError
    from .state import open_state

    try:
        config = config_module.load(args.config, require_keys=False)
    except ConfigError as e:
        print(f"relay: config error: {e}", file=sys.stderr)
        return 2

    async def run() -> int:
        state = await open_state(config.state)
        try:
            return await report(state)
        except Unavailable as e:
            print(f"relay: the shared state ({state.kind}) cannot be reached: {e}",
                  file=sys.stderr)
            return 1
        finally:
            await state.close()

    async def report(state: State) -> int:
        if args.reinstate:
            backend, _, credential = args.reinstate.partition("/")
            if not await reinstate(state, config, backend, credential):
                print(f"relay: --reinstate: {args.reinstate!r} names no credential of "
                      f"relay.yaml (BACKEND/CREDENTIAL)", file=sys.stderr)
                return 2
        listed = await health(state, config)
        if args.json:
            print(orjson.dumps(listed, option=orjson.OPT_INDENT_2).decode())
            return 0
        now = time.time()
        for entry in listed:
            print(described(entry, now))
        for backend in config.backends:
            if not backend.credentials:
                how = "one key (api_key_env)" if backend.api_key_env else "the client's own key"
                print(f"{backend.name}  {how}")
        if state.kind == "memory":
            print("relay: state is each process's own memory (no state.url): a serving "
                  "relay's cooldowns are at its GET /admin/backends", file=sys.stderr)
        return 0

    try:
        return asyncio.run(run())
    except ConfigError as e:  # a state.url this installation cannot open
        print(f"relay: config error: {e}", file=sys.stderr)
        return 2
