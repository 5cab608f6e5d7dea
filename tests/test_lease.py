"""Leases in front of a shared state (relay.state.lease): far from a limit a take is spent in
memory, near it every take is the store's, and across processes a limit is never passed nor
left unspent; what is leased and not used goes back; with Redis, a request that must ask the
store asks in one round trip."""

from __future__ import annotations

import asyncio
import time

import pytest

from relay import limits
from relay.state import Count, Counter, Slot, Taken, lease, open_state, window
from relay.state.lease import LeasedState

BASE = window("minute", time.time())[1] + 3600


class Counting:
    """Counts the takes that reach the backend behind a LeasedState."""

    def __init__(self, state: LeasedState):
        self.takes = 0
        inner_take = state.inner.take

        async def take(*args, **kwargs):
            self.takes += 1
            return await inner_take(*args, **kwargs)

        state.inner.take = take  # type: ignore[method-assign]


@pytest.fixture(params=["sqlite", pytest.param("redis", marks=pytest.mark.slow)])
async def url(request, tmp_path):
    if request.param == "redis":
        return request.getfixturevalue("redis_server").url
    return f"sqlite:///{tmp_path}/state.db"


async def test_far_from_its_limits_a_take_asks_the_store_rarely(url):
    state = await open_state({"url": url})
    try:
        assert isinstance(state, LeasedState)
        counting = Counting(state)
        rpm = Counter("k:rpm", "minute", limit=10**9)
        budget = Counter("k:usd", "day", limit=10**12, amount=0)
        slot = Slot("k:slots", 10**6)
        every = Counter("k:requests", "day")  # counted, never refused
        for _ in range(200):
            taken = await state.take([budget, rpm, every], [slot], now=BASE + 1)
            assert taken.granted
            await state.release(slot.name, taken.tokens[0])
            await state.add([Counter("k:usd", "day", amount=5)], now=BASE + 1)
        assert counting.takes <= 3
        # What the client is told counts every request and every add of this process.
        assert taken.counts[1].used == 200
        assert taken.counts[0].used == 5 * 199
        assert [c.used for c in await state.counts([every], now=BASE + 1)] == [200]
    finally:
        await state.close()


async def test_near_a_limit_every_take_is_the_stores(url):
    state = await open_state({"url": url})
    try:
        counting = Counting(state)
        rpm = Counter("k:rpm", "minute", limit=10)
        granted = [(await state.take([rpm], now=BASE + 1)).granted for _ in range(12)]
        assert granted == [True] * 10 + [False] * 2
        assert counting.takes == 12
    finally:
        await state.close()


@pytest.mark.parametrize("limit", [10, 300])
async def test_two_processes_together_get_exactly_the_limit(url, limit):
    """Leased or not, two processes sharing a store get exactly ``limit`` requests through:
    never more, and none left unspent in a lease once both are refused."""
    one, two = await open_state({"url": url}), await open_state({"url": url})
    try:
        rpm = Counter("k:rpm", "minute", limit=limit)
        granted = 0
        refused = {0: False, 1: False}
        turn = 0
        while not all(refused.values()):
            taken = await (one, two)[turn].take([rpm], now=BASE + 1)
            if taken.granted:
                granted += 1
                assert granted <= limit
            else:
                refused[turn] = True
            turn = 1 - turn
        assert granted == limit
    finally:
        await one.close()
        await two.close()


async def test_requests_asking_together_never_spend_one_leased_unit_twice(url):
    """Requests that must ask the store for something else (a slot of a concurrency limit
    too small for blocks) while their request is spent from this process's lease: each
    leased unit goes to one of them, and the limit is never passed."""
    state = await open_state({"url": url})
    try:
        rpm = Counter("k:rpm", "minute", limit=200)
        slot = Slot("k:slots", 100)
        granted = 0

        async def one():
            nonlocal granted
            taken = await state.take([rpm], [slot], now=BASE + 1)
            if taken.granted:
                granted += 1
                await asyncio.sleep(0.001)
                await state.release(slot.name, taken.tokens[0])

        for _ in range(10):
            await asyncio.gather(*(one() for _ in range(50)))
        assert granted == 200
    finally:
        await state.close()


async def test_concurrency_blocks_never_pass_the_limit_and_all_come_back(url):
    one, two = await open_state({"url": url}), await open_state({"url": url})
    try:
        slot = Slot("k:slots", 256)
        held = []
        for n in range(300):
            state = (one, two)[n % 2]
            taken = await state.take([], [slot], now=BASE + 1)
            if taken.granted:
                held.append((state, taken.tokens[0]))
        assert len(held) == 256  # blocks of each process, then single slots: all of them
        for state, token in held:
            await state.release(slot.name, token)
            await state.release(slot.name, token)  # twice: nothing more
    finally:
        await one.close()
        await two.close()
    fresh = await open_state({"url": url})
    try:  # every block went back to the store: the whole limit is free again
        assert (await fresh.inner.take([], [Slot("k:slots", 256, units=256)],
                                       now=BASE + 2)).granted
    finally:
        await fresh.close()


async def test_requests_asking_together_never_occupy_a_block_past_its_units(url):
    """Requests that must ask the store for something else (each request of a rate limit
    near its end) while their slot is a unit of this process's block: each unit of the block
    goes to one request, and the concurrency limit is never passed."""
    state = await open_state({"url": url})
    try:
        rpm = Counter("k:rpm", "minute", limit=100)  # too few for leases: every take asks
        slot = Slot("k:slots", 640)  # blocks of 10
        first = await state.take([rpm], [slot], now=BASE + 1)
        assert first.granted
        taken = await asyncio.gather(*(state.take([rpm], [slot], now=BASE + 1)
                                       for _ in range(50)))
        held = 1 + sum(t.granted for t in taken)
        inner = await state.inner.take([], [Slot(slot.name, 640, units=640 - held + 1)],
                                       now=BASE + 1)
        # Every request held is a unit the store knows of: none past the limit unseen.
        assert not inner.granted
    finally:
        await state.close()


async def test_unused_leases_go_back_after_a_quiet_second(url, monkeypatch):
    monkeypatch.setattr(lease, "IDLE_SECONDS", 0.1)
    one, two = await open_state({"url": url}), await open_state({"url": url})
    try:
        rpm = Counter("k:rpm", "minute", limit=300)
        slot = Slot("k:slots", 256)
        now = time.time()
        for _ in range(3):
            taken = await one.take([rpm], [slot], now=now)
            await one.release(slot.name, taken.tokens[0])
        assert one._windows[("k:rpm", "minute")].room > 0  # a lease, unspent
        await asyncio.sleep(0.5)
        # The other process may have all the rest: 297 requests, 256 slots at once.
        assert (await two.inner.take([Counter("k:rpm", "minute", limit=300, amount=297)],
                                     [Slot("k:slots", 256, units=256)], now=now)).granted
    finally:
        await one.close()
        await two.close()


async def test_a_budget_crossed_is_refused_next_here_and_within_the_views_age_elsewhere(
        url, monkeypatch):
    monkeypatch.setattr(lease, "VIEW_SECONDS", 0.3)
    one, two = await open_state({"url": url}), await open_state({"url": url})
    try:
        budget = Counter("k:usd", "day", limit=1000, amount=0)
        now = time.time()
        assert (await one.take([budget], now=now)).granted
        assert (await two.take([budget], now=now)).granted
        await one.add([Counter("k:usd", "day", amount=1500)], now=now)  # an answer crossed it
        assert not (await one.take([budget], now=now)).granted  # this process's next: refused
        deadline = time.monotonic() + lease.VIEW_SECONDS + 2.0
        while (await two.take([budget], now=now)).granted:
            assert time.monotonic() < deadline, "the other process never saw the budget crossed"
            await asyncio.sleep(0.02)
    finally:
        await one.close()
        await two.close()


async def test_a_stale_view_is_read_again_once_for_the_requests_that_find_it_so(
        url, monkeypatch):
    monkeypatch.setattr(lease, "VIEW_SECONDS", 0.2)
    one, two = await open_state({"url": url}), await open_state({"url": url})
    try:
        counting = Counting(one)  # what reaches the store
        budget = Counter("k:usd", "day", limit=1000, amount=0)
        now = time.time()
        assert (await one.take([budget], now=now)).granted
        await two.add([Counter("k:usd", "day", amount=500)], now=now)  # another process's
        await two.close()  # its add is in the store
        await asyncio.sleep(lease.VIEW_SECONDS + 0.05)
        before = counting.takes
        many = await asyncio.gather(*[one.take([budget], now=now) for _ in range(20)])
        assert counting.takes - before == 1
        # The one read is every request's check: each saw the other process's spend.
        assert all(taken.granted and taken.counts[0].used == 500 for taken in many)
        # Near the limit a view is no check at all: every request asks.
        await one.add([Counter("k:usd", "day", amount=400)], now=now)
        await asyncio.gather(*[one.take([budget], now=now) for _ in range(3)])
        assert counting.takes - before == 4
    finally:
        await one.close()


@pytest.mark.slow
async def test_with_redis_a_request_near_its_limits_is_one_round_trip(redis_server):
    """A take that must ask Redis carries what the previous request left to write (its
    tokens and cost, its slot's release, its ledger row) in the same one round trip."""
    state = await open_state({"url": redis_server.url})
    try:
        trips = 0
        evalshas = state.inner._evalshas

        async def counted(calls):
            nonlocal trips
            trips += 1
            return await evalshas(calls)

        state.inner._evalshas = counted
        rpm = Counter("k:rpm", "minute", limit=10)
        slot = Slot("k:slots", 2)
        now = time.time()
        for n in range(10):
            taken = await state.take([rpm], [slot], now=now)
            assert taken.granted
            await state.add([Counter("k:otpm", "minute", amount=7)], now=now)
            await state.release(slot.name, taken.tokens[0])
            await state.record([{"id": f"req_{n}", "time": now}])
        assert trips == 10
        assert len(await state.rows()) == 10
        assert (await state.counts([Counter("k:otpm", "minute")], now=now))[0].used == 70
    finally:
        await state.close()


async def test_a_request_refused_by_a_limit_without_a_lease_asks_once(url):
    """A budget spent refuses every request; a lease the take asked for alongside is no
    reason to ask again (with Redis: still one round trip a request)."""
    state = await open_state({"url": url})
    try:
        rpm = Counter("k:rpm", "minute", limit=10**6)
        budget = Counter("k:usd", "day", limit=100, amount=0)
        assert (await state.take([budget, rpm], now=BASE + 1)).granted
        await state.add([Counter("k:usd", "day", limit=100, amount=150)], now=BASE + 1)
        counting = Counting(state)
        for _ in range(5):
            refused = await state.take([budget, rpm], now=BASE + 1)
            assert not refused.granted and refused.blocked == "k:usd"
        assert counting.takes == 5
    finally:
        await state.close()


async def test_a_lease_whose_request_was_given_up_is_kept_not_lost(url):
    """The client gone while its take (with a lease) was at the store: the lease granted is
    this process's to spend, neither lost to the window nor counted twice."""
    state = await open_state({"url": url})
    try:
        rpm = Counter("k:rpm", "minute", limit=10**6)
        now = time.time()
        assert (await state.take([rpm], now=now)).granted  # the window seen: leases next
        counting = Counting(state)
        given_up = asyncio.ensure_future(state.take([rpm], now=now))
        await asyncio.sleep(0)
        given_up.cancel()
        with pytest.raises(asyncio.CancelledError):
            await given_up
        await asyncio.sleep(0.3)  # the store answers meanwhile
        assert counting.takes == 1
        for _ in range(10):
            assert (await state.take([rpm], now=now)).granted
        assert counting.takes == 1  # spent from the lease the given-up request took
        lease_taken = lease.lease_size(10**6 - 1) + 1
        assert (await state.counts([rpm], now=now))[0].used == 1 + lease_taken
    finally:
        await state.close()


async def test_what_the_hot_paths_make_without_the_named_tuples_constructors_is_whole(tmp_path):
    # take_now and spent make their tuples with tuple's own constructor, which checks no
    # length: a field added to Taken, Count or Counter must be given there too.
    state = await open_state({"url": f"sqlite:///{tmp_path}/state.db"})
    try:
        counters = [Counter("k:rpm", "minute", limit=10**9), Counter("k:all", "day")]
        slots = [Slot("k:slots", 10**6)]
        for _ in range(5):  # the store's takes lease what take_now then spends
            taken = state.take_now(counters, slots, now=BASE + 1)
            if taken is not None:
                break
            asked = await state.take(counters, slots, now=BASE + 1)
            await state.release(slots[0].name, asked.tokens[0])
        assert taken is not None and len(taken) == len(Taken._fields)
        assert all(len(count) == len(Count._fields) for count in taken.counts)
    finally:
        await state.close()
    found = limits.Limits.of({"output_tokens_per_minute": 100})
    plan = found.plan("k", "claude-x") if found is not None else None
    assert plan is not None
    added = limits.spent(plan, type("Used", (), {"output_tokens": 5})())
    assert added and all(len(counter) == len(Counter._fields) for counter in added)

