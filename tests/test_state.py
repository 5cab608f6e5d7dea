"""The state seam's contract, held by every backend alike (memory, SQLite, Redis): windowed
counters, slots and their leases, the idempotent ledger, the keys' version, the key-value
store's expiry; and what only the shared backends promise: atomic takes across processes,
a file that stays bounded, a clean ``Unavailable`` when the store cannot answer."""

from __future__ import annotations

import asyncio
import os
import socket
import sqlite3
import subprocess
import sys
import textwrap
import time

import orjson
import pytest
from support import exchange_for

from relay import config as config_module
from relay.config import Backend
from relay.errors import ConfigError
from relay.state import Counter, Slot, Unavailable, open_state, window
from relay.state import redis as redis_state
from relay.state import sqlite as sqlite_state

# A minute well ahead of the clock: its windows are whole and no sweep reaches them.
BASE = window("minute", time.time())[1] + 3600


@pytest.fixture(params=["memory", "sqlite", pytest.param("redis", marks=pytest.mark.slow)])
async def state(request, tmp_path):
    if request.param == "redis":
        url = request.getfixturevalue("redis_server").url
    else:
        url = {"memory": "", "sqlite": f"sqlite:///{tmp_path}/state.db"}[request.param]
    opened = await open_state({"url": url})
    yield opened
    await opened.close()


async def test_take_grants_up_to_the_limit_then_refuses_naming_the_counter(state):
    rpm = Counter("key:a:rpm", "minute", limit=3)
    granted = [await state.take([rpm], now=BASE + i) for i in range(3)]
    assert [t.granted for t in granted] == [True, True, True]
    assert [t.counts[0].used for t in granted] == [1, 2, 3]
    refused = await state.take([rpm], now=BASE + 5)
    assert not refused.granted and refused.blocked == "key:a:rpm"
    assert refused.counts[0].used == 3 and refused.counts[0].limit == 3
    assert refused.counts[0].reset == BASE + 60


async def test_a_refusal_changes_nothing(state):
    free = Counter("key:a:rpm", "minute", limit=10)
    unlimited = Counter("key:a:requests", "day")
    full = Counter("key:a:itpm", "minute", limit=100, amount=0)
    await state.add([Counter("key:a:itpm", "minute", amount=100)], now=BASE)
    refused = await state.take([free, unlimited, full], now=BASE + 1)
    assert not refused.granted and refused.blocked == "key:a:itpm"
    counts = await state.counts([free, unlimited, full], now=BASE + 2)
    assert [c.used for c in counts] == [0, 0, 100]


async def test_an_amount_of_zero_checks_the_count_is_under_the_limit(state):
    itpm = Counter("key:a:itpm", "minute", limit=1000, amount=0)
    await state.add([Counter("key:a:itpm", "minute", amount=999)], now=BASE)
    assert (await state.take([itpm], now=BASE)).granted
    await state.add([Counter("key:a:itpm", "minute", amount=5)], now=BASE)
    taken = await state.take([itpm], now=BASE)
    assert not taken.granted and taken.counts[0].used == 1004


async def test_windows_are_fixed_and_reset_at_their_end(state):
    rpm = Counter("key:a:rpm", "minute", limit=1)
    day = Counter("key:a:spend", "day", limit=None, amount=7)
    assert (await state.take([rpm, day], now=BASE + 59)).granted
    assert not (await state.take([rpm], now=BASE + 59.9)).granted
    again = await state.take([rpm, day], now=BASE + 60)
    assert again.granted and again.counts[0].reset == BASE + 120
    assert again.counts[1].used == 14 and again.counts[1].reset == window("day", BASE)[1]


async def test_slots_are_held_until_released_or_their_lease_runs_out(state):
    slot = Slot("key:a:concurrent", limit=2, lease=30)
    first = await state.take([], [slot], now=BASE)
    second = await state.take([], [slot], now=BASE + 1)
    assert first.granted and second.granted and first.tokens != second.tokens
    third = await state.take([], [slot], now=BASE + 10)
    assert not third.granted and third.blocked == "key:a:concurrent"
    assert third.slot_retry == pytest.approx(20, abs=0.01)
    await state.release(slot.name, first.tokens[0])
    await state.release(slot.name, first.tokens[0])  # twice: nothing more comes back
    assert (await state.take([], [slot], now=BASE + 11)).granted
    assert not (await state.take([], [slot], now=BASE + 12)).granted
    # The second's lease (taken at +1 for 30 s) runs out at +31: its slot is free again.
    assert (await state.take([], [slot], now=BASE + 31.5)).granted


async def test_slots_taken_as_a_block_count_each_unit(state):
    """A block (``units`` slots under one token) is taken only when all its units are free,
    counts them all while held, and gives them all back at once."""
    store = getattr(state, "inner", state)  # the backend itself, not the leases in front
    block = Slot("key:a:concurrent", limit=4, lease=30, units=3)
    one = Slot("key:a:concurrent", limit=4, lease=30)
    taken = await store.take([], [block], now=BASE)
    assert taken.granted
    assert not (await store.take([], [Slot(one.name, 4, 30, units=2)], now=BASE)).granted
    single = await store.take([], [one], now=BASE)
    assert single.granted
    assert not (await store.take([], [one], now=BASE)).granted  # 3 + 1 of 4
    await store.release(block.name, taken.tokens[0])
    assert (await store.take([], [block], now=BASE)).granted


async def test_a_slot_refused_takes_no_counter(state):
    rpm = Counter("key:a:rpm", "minute", limit=10)
    slot = Slot("key:a:concurrent", limit=1)
    assert (await state.take([rpm], [slot], now=BASE)).granted
    refused = await state.take([rpm], [slot], now=BASE)
    assert not refused.granted and refused.blocked == slot.name
    assert (await state.counts([rpm], now=BASE))[0].used == 1


async def test_the_ledger_keeps_one_row_per_id(state):
    rows = [{"id": f"ex{i}", "time": BASE + i, "key": "a" if i % 2 else "b", "cost": i}
            for i in range(6)]
    await state.record(rows[:4])
    await state.record(rows[2:] + [dict(rows[0], cost=99)])  # a retried write
    found = await state.rows()
    assert [r["id"] for r in found] == [f"ex{i}" for i in range(6)]
    assert found[0]["cost"] == 0
    assert [r["id"] for r in await state.rows(since=BASE + 2, until=BASE + 5)] == [
        "ex2", "ex3", "ex4"]
    assert [r["id"] for r in await state.rows(where={"key": "a"}, limit=2,
                                              newest_first=True)] == ["ex5", "ex3"]


async def test_the_memory_ledger_keeps_the_newest_rows_within_its_count_and_bytes():
    from relay.state.memory import MemoryState

    row = {"id": "", "time": time.time(), "key": "a", "timeline": ["x" * 900]}
    size = len(orjson.dumps(dict(row, id="ex000")))
    by_bytes = MemoryState(max_row_bytes=10 * size)
    by_count = MemoryState(max_rows=7)
    for n in range(40):
        await by_bytes.record([dict(row, id=f"ex{n:03d}")])
        await by_count.record([dict(row, id=f"ex{n:03d}")])
    assert [r["id"] for r in await by_bytes.rows()] == [f"ex{n:03d}" for n in range(30, 40)]
    assert [r["id"] for r in await by_count.rows()] == [f"ex{n:03d}" for n in range(33, 40)]
    assert by_bytes._row_bytes == 10 * size


async def test_keys_carry_a_version_that_changes_with_each_change(state):
    before = await state.keys_version()
    await state.put_key({"name": "team-a", "hash": "a" * 64, "limits": {"rpm": 10}})
    await state.put_key({"name": "team-b", "hash": "b" * 64})
    await state.put_key({"name": "team-a", "hash": "a" * 64, "revoked": True})
    version, keys = await state.keys()
    assert version == await state.keys_version() == before + 3
    assert sorted(keys, key=lambda k: k["name"]) == [
        {"name": "team-a", "hash": "a" * 64, "revoked": True},
        {"name": "team-b", "hash": "b" * 64}]


async def test_key_values_expire_and_namespaces_are_apart(state):
    await state.put("provenance", {"x": b"1", "y": b"2"}, ttl=60)
    await state.put("sticky", {"x": b"other"}, ttl=0.2)
    assert await state.get("provenance", ["x", "y", "z"]) == [b"1", b"2", None]
    assert await state.get("sticky", ["x"]) == [b"other"]
    await state.delete("provenance", ["y"])
    assert await state.get("provenance", ["y"]) == [None]
    await asyncio.sleep(0.3)
    assert await state.get("sticky", ["x"]) == [None]
    assert await state.get("provenance", ["x"]) == [b"1"]


async def test_a_value_put_soon_is_read_at_once_until_a_later_put_or_delete(state):
    state.put_soon("sessions", {"a": b"1", "b": b"2"}, ttl=60)
    state.put_soon("sessions", {"a": b"newer"}, ttl=60)
    assert await state.get("sessions", ["a", "b", "c"]) == [b"newer", b"2", None]
    assert await state.get("other", ["a"]) == [None]
    await state.put("sessions", {"a": b"put"}, ttl=60)
    await state.delete("sessions", ["b"])
    state.put_soon("sessions", {"short": b"x"}, ttl=0.2)
    assert await state.get("sessions", ["a", "b", "short"]) == [b"put", None, b"x"]
    await asyncio.sleep(0.3)  # queued or written: what the queue held is never read again
    assert await state.get("sessions", ["a", "b", "short"]) == [b"put", None, None]


async def rows_when_back(state, wanted: str, within: float = 15.0) -> list[dict]:
    deadline = time.monotonic() + within
    while True:
        try:
            rows = await state.rows()
            if any(r["id"] == wanted for r in rows):
                return rows
        except Unavailable:
            pass
        assert time.monotonic() < deadline, f"{wanted} never reached the ledger"
        await asyncio.sleep(0.1)


# --- SQLite: one file for the workers of a host ---------------------------------------------


async def test_sqlite_states_on_one_file_share_counters_slots_and_keys(tmp_path):
    url = f"sqlite:///{tmp_path}/state.db"
    one, two = await open_state({"url": url}), await open_state({"url": url})
    try:
        rpm = Counter("key:a:rpm", "minute", limit=3)
        slot = Slot("key:a:concurrent", limit=1)
        assert (await one.take([rpm], [slot], now=BASE)).granted
        refused = await two.take([rpm], [slot], now=BASE)
        assert not refused.granted and refused.counts[0].used == 1
        await one.put_key({"name": "a", "hash": "h"})
        assert await two.keys_version() == 1
        await one.record([{"id": "x", "time": BASE}])
        await one.rows()  # lands what this one queued
        assert [r["id"] for r in await two.rows()] == ["x"]
    finally:
        await one.close()
        await two.close()


async def test_sqlite_what_owes_no_answer_lands_by_itself(tmp_path):
    path = tmp_path / "state.db"
    state = await open_state({"url": f"sqlite:///{path}"})
    try:
        await state.add([Counter("key:a:otpm", "minute", amount=42)], now=BASE)
        await state.record([{"id": "x", "time": BASE}])
        await asyncio.sleep(0.2)
        db = sqlite3.connect(path)
        assert db.execute("SELECT used FROM counters").fetchall() == [(42,)]
        assert db.execute("SELECT id FROM ledger").fetchall() == [("x",)]
        db.close()
    finally:
        await state.close()


async def test_sqlite_sweeps_what_expired_so_the_file_stays_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(sqlite_state, "SWEEP_SECONDS", 0.1)
    path = tmp_path / "state.db"
    state = await open_state({"url": f"sqlite:///{path}", "retention_days": 1})
    try:
        past = time.time() - 2 * 86400
        await state.take([Counter("old", "minute", limit=5)], [Slot("old", 1, lease=1)],
                         now=past)
        # BASE: taken now, the window would end within the sleep below when the test starts
        # in a minute's last half second, and be swept as it should.
        await state.take([Counter("new", "minute", limit=5)], [Slot("new", 1)], now=BASE)
        await state.record([{"id": "old", "time": past}, {"id": "new", "time": time.time()}])
        await state.put("ns", {"gone": b"1"}, ttl=0.05)
        await state.put("ns", {"kept": b"1"}, ttl=60)
        await asyncio.sleep(0.5)
        db = sqlite3.connect(path)
        assert db.execute("SELECT name FROM counters").fetchall() == [("new",)]
        assert db.execute("SELECT name FROM slots").fetchall() == [("new",)]
        assert db.execute("SELECT id FROM ledger").fetchall() == [("new",)]
        assert db.execute("SELECT key FROM kv").fetchall() == [("kept",)]
        db.close()
    finally:
        await state.close()


async def test_sqlite_locked_past_the_timeout_is_unavailable_and_the_ledger_waits(tmp_path):
    path = tmp_path / "state.db"
    state = await open_state({"url": f"sqlite:///{path}", "timeout": 0.2})
    blocker = sqlite3.connect(path, isolation_level=None)
    try:
        blocker.execute("BEGIN IMMEDIATE")  # another process holding the write lock
        started = time.monotonic()
        with pytest.raises(Unavailable):
            await state.take([Counter("key:a:rpm", "minute", limit=5)])
        assert time.monotonic() - started < 1.0
        started = time.monotonic()
        with pytest.raises(Unavailable):  # at once, for a moment
            await state.counts([Counter("key:a:rpm", "minute", limit=5)])
        assert time.monotonic() - started < 0.1  # not the 0.2 s timeout
        assert state.unavailable_count >= 2
        await state.record([{"id": "waited", "time": time.time()}])  # never raises
        state.put_soon("ns", {"waited": b"1"}, ttl=60)
        assert await state.get("ns", ["waited"]) == [b"1"]  # this process reads its own
        await asyncio.sleep(sqlite_state.DOWN_SECONDS)
        blocker.execute("ROLLBACK")
        rows = await rows_when_back(state, "waited", within=5.0)
        assert [r["id"] for r in rows] == ["waited"]
        assert blocker.execute("SELECT value FROM kv WHERE key = 'waited'").fetchall() \
            == [(b"1",)]
        assert (await state.take([Counter("key:a:rpm", "minute", limit=5)])).granted
    finally:
        blocker.close()
        await state.close()


async def test_sqlite_reads_need_no_write_lock_and_leave_the_queue_to_its_time(
        tmp_path, monkeypatch):
    """A key-value read or the keys' version is answered while another process holds the
    write lock, and carries none of what waits to be written (ledger rows keep lingering,
    to share a commit)."""
    monkeypatch.setattr(sqlite_state, "ROW_LINGER", 30.0)  # the rows wait for a reader
    path = tmp_path / "state.db"
    state = await open_state({"url": f"sqlite:///{path}", "timeout": 0.2})
    blocker = sqlite3.connect(path, isolation_level=None)
    try:
        await state.put("ns", {"k": b"v"}, ttl=60)
        version = await state.keys_version()
        await state.record([{"id": "lingering", "time": time.time()}])
        blocker.execute("BEGIN IMMEDIATE")
        assert await state.get("ns", ["k", "x"]) == [b"v", None]
        assert await state.keys_version() == version
        blocker.execute("ROLLBACK")
        assert blocker.execute("SELECT id FROM ledger").fetchall() == []
        rows = await rows_when_back(state, "lingering", within=5.0)
        assert [r["id"] for r in rows] == ["lingering"]
    finally:
        blocker.close()
        await state.close()


async def test_sqlite_reads_are_answered_while_a_held_lock_fails_the_writes(tmp_path):
    """A take that met another process's write lock makes the writes fail at once for a
    moment, not the reads: a key-value record (a session's, portable's provenance) and the
    keys' version need no write lock, and are answered all the while the lock is held."""
    path = tmp_path / "state.db"
    state = await open_state({"url": f"sqlite:///{path}", "timeout": 0.2})
    blocker = sqlite3.connect(path, isolation_level=None)
    try:
        await state.put("ns", {"k": b"v"}, ttl=60)
        version = await state.keys_version()
        blocker.execute("BEGIN IMMEDIATE")
        with pytest.raises(Unavailable):
            await state.take([Counter("key:a:rpm", "minute", limit=5)])
        with pytest.raises(Unavailable):  # the writes: at once, for a moment
            await state.counts([Counter("key:a:rpm", "minute", limit=5)])
        assert await state.get("ns", ["k", "x"]) == [b"v", None]
        assert await state.keys_version() == version
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
        await state.close()


async def test_sqlite_a_later_put_soon_wins_over_an_earlier_delete_in_one_batch(tmp_path):
    """A delete made while the worker was busy and a put_soon made after it, written in one
    transaction: the newer entry stays."""
    path = tmp_path / "state.db"
    state = await open_state({"url": f"sqlite:///{path}", "timeout": 5})
    blocker = sqlite3.connect(path, isolation_level=None)
    try:
        await state.put("ns", {"k": b"old"}, ttl=60)
        blocker.execute("BEGIN IMMEDIATE")
        busy = asyncio.ensure_future(state.take([Counter("c", "minute", limit=5)]))
        await asyncio.sleep(0.1)  # the worker waits for the lock with that take
        deleting = asyncio.ensure_future(state.delete("ns", ["k"]))
        await asyncio.sleep(0)
        state.put_soon("ns", {"k": b"newest"}, ttl=60)
        blocker.execute("ROLLBACK")
        await busy
        await deleting
        assert await state.get("ns", ["k", "other"]) == [b"newest", None]
        assert blocker.execute("SELECT value FROM kv WHERE key = 'k'").fetchall() \
            == [(b"newest",)]
    finally:
        blocker.close()
        await state.close()


async def test_sqlite_a_read_sees_what_a_failed_transaction_left_queued(tmp_path):
    path = tmp_path / "state.db"
    state = await open_state({"url": f"sqlite:///{path}", "timeout": 0.3})
    blocker = sqlite3.connect(path, isolation_level=None)
    try:
        await state.put("ns", {"k": b"v0"}, ttl=60)
        blocker.execute("BEGIN IMMEDIATE")
        state.put_soon("ns", {"k": b"v1"}, ttl=60)
        await asyncio.sleep(0.1)  # taken into a transaction that waits for the lock, and fails
        assert await state.get("ns", ["k", "other"]) == [b"v1", None]
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
        await state.close()


async def eventually(check, within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not await check():
        assert time.monotonic() < deadline, "never came true"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("how", ["deleted", "replaced"])
async def test_sqlite_a_file_deleted_or_replaced_under_the_relay_is_the_one_it_uses(
        tmp_path, caplog, how):
    """The file removed (to start afresh) or another moved over it while the relay runs:
    the relay goes on with the file at the path, as a worker or `relay keys create`
    starting now does, not with the one gone (where its counts, its ledger rows and the
    keys it serves would be nobody else's)."""
    path = tmp_path / "state.db"
    url = f"sqlite:///{path}"
    running = await open_state({"url": url})
    try:
        rpm = Counter("key:a:rpm", "minute", limit=10)
        assert (await running.take([rpm], now=BASE)).granted
        await running.put_key({"name": "old", "hash": "h0"})
        for name in ("state.db", "state.db-wal", "state.db-shm"):  # `rm relay-state.db*`
            (tmp_path / name).unlink(missing_ok=True)
        if how == "replaced":  # and a copy moved in its place
            made = await open_state({"url": f"sqlite:///{tmp_path}/other.db"})
            await made.close()
            os.replace(tmp_path / "other.db", path)
        starting = await open_state({"url": url})  # another worker, or the CLI
        try:
            await starting.put_key({"name": "new", "hash": "h1"})

            async def sees_the_new_key():
                return [k["name"] for k in (await running.keys())[1]] == ["new"]

            await eventually(sees_the_new_key)
            assert (await running.take([rpm], now=BASE)).counts[0].used == 1
            assert (await starting.counts([rpm], now=BASE))[0].used == 1
            await running.record([{"id": "after", "time": BASE}])
            await running.rows()
            assert [r["id"] for r in await starting.rows()] == ["after"]
        finally:
            await starting.close()
        warnings = [r.getMessage() for r in caplog.records if "opened the one there" in
                    r.getMessage()]
        assert len(warnings) == 1
    finally:
        await running.close()


async def test_sqlite_url_names_a_file_in_a_directory_that_exists(tmp_path):
    with pytest.raises(ConfigError, match="state.url: the directory .* does not exist"):
        await open_state({"url": f"sqlite:///{tmp_path}/missing/state.db"})
    (tmp_path / "junk.db").write_bytes(b"not a database, not at all" * 100)
    with pytest.raises(ConfigError, match="state.url: .*junk.db"):
        await open_state({"url": f"sqlite:///{tmp_path}/junk.db"})
    with pytest.raises(ConfigError, match="names no state backend"):
        await open_state({"url": "postgres://db/relay"})


# A worker process: takes one unit at a time from one counter until refused, prints how
# many it was granted.
HAMMER = textwrap.dedent("""
    import asyncio, sys
    from relay.state import Counter, open_state

    async def main(url, limit, now):
        state = await open_state({"url": url, "timeout": 5.0})
        granted = 0
        counter = Counter("key:shared:rpm", "minute", limit=limit)
        while True:
            taken = await state.take([counter], now=now)
            if not taken.granted:
                break
            granted += 1
        await state.close()
        print(granted)

    asyncio.run(main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3])))
""")


def hammer(url: str, limit: int, processes: int = 4) -> list[int]:
    started = [subprocess.Popen([sys.executable, "-c", HAMMER, url, str(limit), str(BASE)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for _ in range(processes)]
    granted = []
    for process in started:
        out, err = process.communicate(timeout=60)
        assert process.returncode == 0, err
        granted.append(int(out))
    return granted


@pytest.mark.slow
def test_sqlite_take_is_atomic_across_processes(tmp_path):
    granted = hammer(f"sqlite:///{tmp_path}/state.db", limit=150)
    assert sum(granted) == 150


@pytest.mark.slow
def test_workers_starting_together_on_a_new_sqlite_file_all_open_it(tmp_path):
    # Workers of one relay open the same new file at the same moment: none may fail start-up
    # with "database is locked".
    for attempt in range(4):
        granted = hammer(f"sqlite:///{tmp_path}/state{attempt}.db", limit=8, processes=8)
        assert sum(granted) == 8


@pytest.mark.slow
def test_redis_take_is_atomic_across_processes(redis_server):
    granted = hammer(redis_server.url, limit=150)
    assert sum(granted) == 150


# --- Redis: replicas on several hosts ---------------------------------------------------------


async def test_redis_stopped_mid_run_is_unavailable_at_once_and_the_ledger_catches_up(
        redis_server, caplog):
    state = await open_state({"url": redis_server.url, "timeout": 0.2})
    try:
        rpm = Counter("key:a:rpm", "minute", limit=100)
        assert (await state.take([rpm])).granted
        redis_server.stop()
        caplog.clear()
        for call in (state.take([rpm]), state.counts([rpm]), state.get("ns", ["x"]),
                     state.keys_version(), state.put("ns", {"x": b"1"}, 60)):
            started = time.monotonic()
            with pytest.raises(Unavailable):
                await call
            assert time.monotonic() - started < 0.5
        assert state.unavailable_count >= 5
        warnings = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(warnings) == 1 and "Traceback" not in warnings[0].getMessage()
        await state.record([{"id": "during", "time": time.time()}])  # never raises
        # In a window of its own: the test outlasting a minute's end must not change the count.
        await state.add([Counter("key:a:otpm", "minute", amount=7)], now=BASE)
        state.put_soon("ns", {"during": b"1"}, ttl=60)
        redis_server.start()
        await rows_when_back(state, "during")
        other = await open_state({"url": redis_server.url})
        try:
            deadline = time.monotonic() + 10
            while await other.get("ns", ["during"]) != [b"1"]:
                assert time.monotonic() < deadline, "what was queued never landed"
                await asyncio.sleep(0.05)
        finally:
            await other.close()
        assert (await state.counts([rpm]))[0].used == 0  # Redis kept nothing
        counts = await state.counts([Counter("key:a:otpm", "minute")], now=BASE)
        assert counts[0].used == 7  # what waited landed
        assert (await state.take([rpm])).granted
    finally:
        await state.close()


async def test_redis_that_never_answers_is_unavailable_within_the_timeout():
    async def silent(reader, writer):
        await reader.read()  # reads the commands, answers none

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    state = await open_state({"url": f"redis://127.0.0.1:{port}/0", "timeout": 0.2})
    try:
        started = time.monotonic()
        with pytest.raises(Unavailable):
            await state.take([Counter("key:a:rpm", "minute", limit=5)])
        assert time.monotonic() - started < 0.6
        await state.record([{"id": "x", "time": time.time()}])
    finally:
        await state.close()
        server.close()


async def test_redis_unreachable_at_start_up_is_not_fatal(caplog):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    state = await open_state({"url": f"redis://:secret@127.0.0.1:{port}/0", "timeout": 0.2})
    try:
        assert any("unreachable at start-up" in r.getMessage() for r in caplog.records)
        assert not any("secret" in r.getMessage() for r in caplog.records)
        with pytest.raises(Unavailable):
            await state.take([Counter("key:a:rpm", "minute", limit=5)])
    finally:
        await state.close()


class Muffler:
    """A loopback proxy in front of Redis that, while ``mute``, passes the commands on and
    drops the answers: a round trip that ran but whose caller never heard. While ``hold``,
    it keeps the commands instead (a round trip still on its way) until :meth:`let_go`
    sends them on, even for a client that has hung up meanwhile."""

    def __init__(self, port: int):
        self.port = port
        self.mute = False
        self.hold = False
        self.held: list[tuple[asyncio.StreamWriter, bytes]] = []
        self.answered = asyncio.Event()  # Redis answered something held

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"redis://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/0"

    async def let_go(self) -> None:
        held, self.held = self.held, []
        self.answered.clear()
        for sink, data in held:
            sink.write(data)
        await asyncio.wait_for(self.answered.wait(), 5)

    async def _serve(self, reader, writer):
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.port)

        async def commands():
            holding = False
            while data := await reader.read(65536):
                if self.hold:
                    holding = True
                    self.held.append((upstream_writer, data))
                else:
                    upstream_writer.write(data)
            while holding and any(sink is upstream_writer for sink, _ in self.held):
                await asyncio.sleep(0.01)  # hung up: what it sent goes on all the same
            if holding:
                await asyncio.sleep(1)  # for the answer to what was let go

            upstream_writer.close()

        async def answers():
            while data := await upstream_reader.read(65536):
                self.answered.set()
                if not self.mute:
                    writer.write(data)
            writer.close()

        await asyncio.gather(commands(), answers(), return_exceptions=True)


async def test_redis_a_round_trip_unheard_is_sent_again_and_counts_once(redis_server):
    muffler = Muffler(redis_server.port)
    state = await open_state({"url": await muffler.start(), "timeout": 0.2})
    try:
        otpm = Counter("key:a:otpm", "minute", amount=5)
        await state.add([otpm], now=BASE)
        await state.record([{"id": "once", "time": BASE}])
        muffler.mute = True
        with pytest.raises(Unavailable):
            await state.counts([otpm], now=BASE)  # carries the add: it runs, unheard
        muffler.mute = False
        await asyncio.sleep(1.1)  # the moment a failure makes every call fail at once
        assert [c.used for c in await state.counts([otpm], now=BASE)] == [5]
        assert [r["id"] for r in await state.rows()] == ["once"]
    finally:
        await state.close()
        muffler.server.close()



async def test_redis_a_take_unheard_is_given_back_once_it_is_known_to_have_run(redis_server):
    """A take that ran but whose answer was lost: the caller heard it failed (with
    on_unavailable: closed, a 503 its client retries), so what it counted would be counted
    for nothing; it is given back, slot and count, by the next round trip."""
    muffler = Muffler(redis_server.port)
    state = await open_state({"url": await muffler.start(), "timeout": 0.2})
    try:
        rpm = Counter("key:a:rpm", "minute", limit=3)
        slot = Slot("key:a:concurrent", limit=1)
        muffler.mute = True
        with pytest.raises(Unavailable):
            await state.take([rpm], [slot], now=BASE)  # it runs, unheard
        muffler.mute = False
        await asyncio.sleep(redis_state.DOWN_SECONDS + 0.1)
        assert [c.used for c in await state.counts([rpm], now=BASE)] == [0]
        taken = [await state.take([rpm], now=BASE) for _ in range(3)]
        assert all(t.granted for t in taken)
        assert (await state.take([], [slot], now=BASE)).granted
    finally:
        await state.close()
        muffler.server.close()


async def test_redis_takes_to_undo_are_bounded_and_never_crowd_out_usage(
        redis_server, monkeypatch):
    """A Redis that swallows commands (a network dropping them), with takes going to it:
    the undoings wait in a bound of their own (the oldest left to their windows), and the
    batch of usage waiting with them is not pushed out by them."""
    monkeypatch.setattr(redis_state, "MAX_PENDING", 3)
    monkeypatch.setattr(redis_state, "MAX_UNDOS", 2)
    muffler = Muffler(redis_server.port)
    state = await open_state({"url": await muffler.start(), "timeout": 0.2})
    try:
        otpm = Counter("key:a:otpm", "minute", amount=5)
        rpm = Counter("key:a:rpm", "minute", limit=100)
        await state.counts([rpm], now=BASE)  # connected
        await state.add([otpm], now=BASE)
        muffler.hold = True
        taken = await asyncio.gather(*[state.take([rpm], now=BASE) for _ in range(10)],
                                     return_exceptions=True)
        assert all(isinstance(t, Unavailable) for t in taken)
        await asyncio.sleep(redis_state.DOWN_SECONDS + 0.1)
        with pytest.raises(Unavailable):  # what waits goes again, and is swallowed again
            await state.counts([rpm], now=BASE)
        muffler.held.clear()  # never to arrive
        muffler.hold = False
        await asyncio.sleep(redis_state.DOWN_SECONDS + 0.1)
        used = [c.used for c in await state.counts([Counter("key:a:otpm", "minute"), rpm],
                                                   now=BASE)]
        assert used == [5, 0]
    finally:
        await state.close()
        muffler.server.close()


async def test_redis_paused_the_takes_it_runs_late_are_given_back(redis_server):
    """Redis paused (SIGSTOP: a stall, a fork for a snapshot on a big data set) while
    requests take: each times out, and when Redis goes on it runs them all; they are
    undone, so the key's window and slots are as they were."""
    import signal

    state = await open_state({"url": redis_server.url, "timeout": 0.2})
    try:
        rpm = Counter("key:a:rpm", "minute", limit=100)
        slot = Slot("key:a:concurrent", limit=100)
        assert (await state.take([rpm], [slot], now=BASE)).granted
        os.kill(redis_server.process.pid, signal.SIGSTOP)
        try:
            taken = await asyncio.gather(*[state.take([rpm], [slot], now=BASE)
                                           for _ in range(20)], return_exceptions=True)
            assert all(isinstance(t, Unavailable) for t in taken)
        finally:
            os.kill(redis_server.process.pid, signal.SIGCONT)

        async def as_before():
            try:
                return (await state.inner.counts([rpm], now=BASE))[0].used == 1
            except Unavailable:
                return False

        await eventually(as_before)
        await asyncio.sleep(0.3)  # and stays so
        assert (await state.inner.counts([rpm], now=BASE))[0].used == 1
        for _ in range(99):
            assert (await state.inner.take([], [slot], now=BASE)).granted
        assert not (await state.inner.take([], [slot], now=BASE)).granted
    finally:
        await state.close()


async def test_redis_a_take_that_arrives_after_it_was_given_up_takes_nothing(redis_server):
    """The take's command still on its way on the connection given up (Redis paused, a
    slow network) when its undoing goes by another: it takes nothing once it arrives."""
    muffler = Muffler(redis_server.port)
    state = await open_state({"url": await muffler.start(), "timeout": 0.2})
    try:
        rpm = Counter("key:a:rpm", "minute", limit=3)
        slot = Slot("key:a:concurrent", limit=1)
        muffler.hold = True
        with pytest.raises(Unavailable):
            await state.take([rpm], [slot], now=BASE)
        muffler.hold = False
        await asyncio.sleep(redis_state.DOWN_SECONDS + 0.1)
        assert [c.used for c in await state.counts([rpm], now=BASE)] == [0]  # undone
        await muffler.let_go()  # the take arrives
        assert [c.used for c in await state.counts([rpm], now=BASE)] == [0]
        assert (await state.take([], [slot], now=BASE)).granted
    finally:
        await state.close()
        muffler.server.close()

async def test_redis_a_take_arriving_after_later_takes_still_takes_nothing(redis_server):
    """The same, with takes between its undoing and its arrival: each of them trims the
    numbers the process no longer waits for, and the one undone must stay there until a
    command given up can no longer arrive."""
    muffler = Muffler(redis_server.port)
    state = await open_state({"url": await muffler.start(), "timeout": 0.2})
    try:
        rpm = Counter("key:a:rpm", "minute", limit=5)
        muffler.hold = True
        with pytest.raises(Unavailable):
            await state.take([rpm], now=BASE)
        muffler.hold = False
        await asyncio.sleep(redis_state.DOWN_SECONDS + 0.1)
        assert [c.used for c in await state.counts([rpm], now=BASE)] == [0]  # undone
        for _ in range(2):
            assert (await state.take([rpm], now=BASE)).granted
        await muffler.let_go()  # the take arrives
        assert [c.used for c in await state.counts([rpm], now=BASE)] == [2]
    finally:
        await state.close()
        muffler.server.close()

# --- start-up -------------------------------------------------------------------------------


def test_workers_with_the_state_in_memory_are_warned_of_at_start(relay, emulator):
    emu = emulator()
    config = {"backends": [{"name": "emu", "url": emu.url, "models": ["*"]}]}
    in_memory = relay(config, args=["--workers", "2"])
    assert in_memory.wait_for_output("state.url is empty")
    assert in_memory.output().count("state.url is empty") == 1  # the supervisor's, once
    shared = relay(dict(config, state={"url": "sqlite:///./relay-state.db"}),
                   args=["--workers", "2"])
    assert shared.wait_for_output("(2 workers)")
    assert "state.url is empty" not in shared.output()


@pytest.mark.slow
def test_workers_with_limits_and_the_state_in_memory_do_not_start(tmp_path):
    """Limits each worker would count on its own let N times as much through: refused at
    start-up, before anything listens, rather than found out from a bill."""
    import yaml

    path = tmp_path / "relay.yaml"
    path.write_text(yaml.safe_dump({
        "pipeline": ["limits"],
        "server": {"auth": {"keys": [{"name": "team", "key_env": "TEAM_KEY",
                                      "limits": {"requests_per_minute": 10}}]}},
        "backends": [{"name": "emu", "url": "http://127.0.0.1:9", "models": ["*"]}]}))
    started = subprocess.run(
        [sys.executable, "-m", "relay", "--config", str(path), "--port", "0", "--workers", "2"],
        env={**os.environ, "TEAM_KEY": "team-key-" + "t" * 20}, capture_output=True,
        text=True, timeout=60)
    assert started.returncode == 2, started.stderr
    assert "each worker would count them on its own and let 2 times as much through" \
        in started.stderr
    assert "listening" not in started.stderr + started.stdout


# --- portable's thinking provenance on the seam ---------------------------------------------


async def replica_pair(url: str):
    from relay_builtins import portable

    two = config_module.parse({"backends": [{"name": "a", "url": "http://127.0.0.1:1"},
                                             {"name": "k", "url": "http://127.0.0.1:2"}]})
    replicas = []
    for _ in range(2):
        state = await open_state({"url": url})
        made = portable.Portable()
        made.relay_startup(two, {}, state)
        replicas.append((made, state))
    return replicas


async def judged_elsewhere(url: str) -> dict:
    """A thinking block answered through one replica, sent on to another backend through the
    other: what goes up."""
    from relay_builtins import portable
    from test_portable import KEY_A, answer, history, thought

    (one, one_state), (two, two_state) = await replica_pair(url)
    try:
        mine = thought(KEY_A)
        answer(one, "a", "model-a", mine)
        await one.provenance.drain(5)
        body = {"model": "model-k", "max_tokens": 2048, "messages": history("t", thinking=mine),
                "thinking": {"type": "enabled", "budget_tokens": 1024}}
        exchange = exchange_for(body)
        exchange.backend = Backend(name="k", url="http://127.0.0.1:2", models=["*"])
        reading = two.relay_request(exchange, {o.name: o.default for o in portable.OPTIONS})
        assert reading is not None  # not in that replica's memory: read from the state
        await reading
        return orjson.loads(exchange.upstream_body())
    finally:
        for made, state in ((one, one_state), (two, two_state)):
            await made.relay_shutdown()
            await state.close()


async def test_thinking_provenance_crosses_workers_through_sqlite(tmp_path):
    sent = await judged_elsewhere(f"sqlite:///{tmp_path}/state.db")
    assert sent["thinking"] == {"type": "disabled"}  # the foreign block was dropped


async def test_thinking_provenance_crosses_replicas_through_redis(redis_server):
    sent = await judged_elsewhere(redis_server.url)
    assert sent["thinking"] == {"type": "disabled"}


async def test_provenance_with_the_state_out_sends_blocks_as_they_are_and_says_so():
    from relay_builtins import portable

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    state = await open_state({"url": f"redis://127.0.0.1:{port}/0", "timeout": 0.1})
    try:
        record = portable.Provenance("", state=state)
        record.record([("k1", "a", "m")])
        other = portable.Provenance("", state=state)
        started = time.monotonic()
        assert await other.lookup(["k1"]) == {}
        assert time.monotonic() - started < portable.LOOKUP_SECONDS + 0.2
        assert ("not_known", "unreachable") in other.trouble.drain()
        assert record.trouble.drain() == {}  # not lost: it waits for the state
    finally:
        await record.drain(0.1)
        await state.close()


async def test_provenance_recorded_while_redis_is_out_reaches_the_other_replicas_once_back(
        redis_server):
    """A thinking block answered through one replica during an outage: once Redis is back,
    another replica knows its issuer (else a session moving to another backend through it
    would send that block to a backend that refuses its signature)."""
    from relay_builtins import portable

    one = await open_state({"url": redis_server.url, "timeout": 0.1})
    two = await open_state({"url": redis_server.url, "timeout": 0.1})
    record, other = portable.Provenance("", state=one), portable.Provenance("", state=two)
    try:
        redis_server.stop()
        record.record([("k1", "a", "m")])
        await asyncio.sleep(0.3)  # tried, and failed
        redis_server.start()
        deadline = time.monotonic() + 10
        while await other.lookup(["k1"]) != {"k1": ("a", "m")}:
            assert time.monotonic() < deadline, "the record made during the outage never landed"
            await asyncio.sleep(0.2)
        assert ("not_recorded", "unreachable") not in record.trouble.drain()
    finally:
        await record.drain(1)
        await one.close()
        await two.close()


@pytest.fixture(params=["sqlite", pytest.param("redis", marks=pytest.mark.slow)])
def shared_url(request, tmp_path):
    if request.param == "redis":
        return request.getfixturevalue("redis_server").url
    return f"sqlite:///{tmp_path}/state.db"


async def test_what_is_queued_at_close_is_written(shared_url):
    state = await open_state({"url": shared_url})
    await state.add([Counter("key:a:otpm", "minute", amount=3)], now=BASE)
    await state.record([{"id": "last", "time": BASE}])
    await state.close()
    again = await open_state({"url": shared_url})
    try:
        assert [r["id"] for r in await again.rows()] == ["last"]
        assert [c.used for c in await again.counts([Counter("key:a:otpm", "minute")],
                                                    now=BASE)] == [3]
    finally:
        await again.close()


@pytest.mark.parametrize("store", ["sqlite", pytest.param("redis", marks=pytest.mark.slow)])
async def test_what_an_outage_drops_from_the_queues_is_logged_once_not_per_request(
        store, tmp_path, request, monkeypatch, caplog):
    """Past its bound, what waits for a store that is out goes, oldest first: said once (and
    then once a minute with the count since), not once for every request that records."""
    backend = {"sqlite": sqlite_state, "redis": redis_state}[store]
    monkeypatch.setattr(backend, "MAX_PENDING", 5)
    if store == "sqlite":
        path = tmp_path / "state.db"
        state = await open_state({"url": f"sqlite:///{path}", "timeout": 0.1})
        blocker = sqlite3.connect(path, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")  # another process holding the write lock
        back = blocker.close
    else:
        server = request.getfixturevalue("redis_server")
        state = await open_state({"url": server.url, "timeout": 0.1})
        server.stop()
        back = server.start
    try:
        for n in range(30):  # a request each
            state.record_soon([{"id": f"row{n}", "time": BASE}])
            state.put_soon("ns", {f"key{n}": b"1"}, ttl=60)
            await asyncio.sleep(0.01)
        for what in ("ledger rows dropped", "key-value entries dropped"):
            assert len([r for r in caplog.records if what in r.getMessage()]) == 1, what
        back()
        # What is kept lands: the newest, within the bound.
        rows = await rows_when_back(state, "row29")
        assert len(rows) <= 5
    finally:
        await state.close()


async def test_redis_a_close_right_after_a_blip_writes_what_waits(redis_server):
    """The relay stopped within the second after a failure (every call then fails at once,
    not waiting again): Redis is back, and what waits is written all the same."""
    state = await open_state({"url": redis_server.url, "timeout": 0.2})
    rpm = Counter("key:a:otpm", "minute")
    redis_server.stop()
    with pytest.raises(Unavailable):
        await state.counts([rpm], now=BASE)
    redis_server.start()
    await state.record([{"id": "at-close", "time": BASE}])
    await state.add([Counter("key:a:otpm", "minute", amount=3)], now=BASE)
    await state.close()
    again = await open_state({"url": redis_server.url})
    try:
        assert [r["id"] for r in await again.rows()] == ["at-close"]
        assert [c.used for c in await again.counts([rpm], now=BASE)] == [3]
    finally:
        await again.close()


@pytest.mark.parametrize("store", ["sqlite", pytest.param("redis", marks=pytest.mark.slow)])
async def test_a_close_with_the_store_out_says_what_it_could_not_write(
        store, tmp_path, request, caplog):
    if store == "sqlite":
        path = tmp_path / "state.db"
        state = await open_state({"url": f"sqlite:///{path}", "timeout": 0.1})
        blocker = sqlite3.connect(path, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")  # another process holding the write lock
    else:
        server = request.getfixturevalue("redis_server")
        state = await open_state({"url": server.url, "timeout": 0.1})
        server.stop()
    await state.record([{"id": f"row{n}", "time": BASE} for n in range(3)])
    await asyncio.sleep(0.2)
    caplog.clear()
    started = time.monotonic()
    await state.close()
    assert time.monotonic() - started < 3
    lost = [r.getMessage() for r in caplog.records if "lost" in r.getMessage()]
    assert len(lost) == 1 and "3 ledger rows" in lost[0]


@pytest.mark.parametrize("store", ["sqlite", pytest.param("redis", marks=pytest.mark.slow)])
async def test_a_store_that_lost_its_counts_is_not_given_back_what_it_lost(
        store, tmp_path, request, monkeypatch):
    """Redis restarted empty (no persistence), or the SQLite file deleted, while a process
    held a lease: what it gives back unused must not take the fresh count below zero (a
    count of -1023 is 1,023 requests more than the limit in that window, per process)."""
    from relay.state import lease

    monkeypatch.setattr(sqlite_state, "LOOK_SECONDS", 0.05)
    if store == "sqlite":
        url = f"sqlite:///{tmp_path}/state.db"
    else:
        server = request.getfixturevalue("redis_server")
        url = server.url
    state = await open_state({"url": url, "timeout": 0.2})
    try:
        rpm = Counter("key:a:rpm", "minute", limit=100_000)
        for _ in range(2):  # the second takes a lease with it, the window seen
            assert (await state.take([rpm])).granted
        assert (await state.inner.counts([rpm]))[0].used > 2
        if store == "sqlite":
            # The file last: a process noticing in between would open it beside the old WAL.
            for name in ("state.db-wal", "state.db-shm", "state.db"):
                (tmp_path / name).unlink(missing_ok=True)
            deadline = time.monotonic() + 5  # noticed within LOOK_SECONDS, on a calm machine
            while (await state.inner.counts([rpm]))[0].used != 0:  # the new file's
                assert time.monotonic() < deadline, "the deleted file was never noticed"
                await asyncio.sleep(0.02)
        else:
            server.stop()
            server.start()
        await asyncio.sleep(lease.IDLE_SECONDS + 0.3)  # the lease unused: given back
        await state.record([{"id": "after", "time": BASE}])
        await rows_when_back(state, "after")  # lands with what was queued before it
        assert (await state.inner.counts([rpm]))[0].used == 0
    finally:
        await state.close()


async def test_a_value_put_soon_reaches_the_other_processes_within_moments(shared_url):
    """Written behind: no call waits for it, another process reads it once it lands (and
    what is still queued at close lands then)."""
    writer, reader = await open_state({"url": shared_url}), await open_state({"url": shared_url})
    try:
        writer.put_soon("sessions", {"s": b"turn 1"}, ttl=60)
        deadline = time.monotonic() + 5
        while await reader.get("sessions", ["s"]) != [b"turn 1"]:
            assert time.monotonic() < deadline, "never written"
            await asyncio.sleep(0.01)
        writer.put_soon("sessions", {"s": b"turn 2"}, ttl=60)
        await writer.close()
        assert await reader.get("sessions", ["s"]) == [b"turn 2"]
    finally:
        await writer.close()
        await reader.close()


async def test_a_take_whose_caller_gave_up_is_given_back_whole(shared_url):
    """The client gone while its take was at the store (a limit too small for leases): what
    the store granted nobody will use or release, its slot and its request's count alike,
    so a key of 3 requests a minute does not lose one to every client that hung up."""
    state = await open_state({"url": shared_url})
    try:
        rpm = Counter("key:gone:rpm", "minute", limit=3)
        slot = Slot("key:gone:concurrent", limit=3)
        given_up = asyncio.ensure_future(state.take([rpm], [slot], now=BASE))
        await asyncio.sleep(0)  # asked
        given_up.cancel()
        with pytest.raises(asyncio.CancelledError):
            await given_up
        deadline = time.monotonic() + 5
        # Over Redis the read below goes on a connection of its own, and could run before the
        # take given up (slow under load) and see nothing to wait for: that round trip first.
        while getattr(state.inner, "_senders", ()):
            assert time.monotonic() < deadline, "the take given up never came back"
            await asyncio.sleep(0.01)
        while (await state.counts([rpm], now=BASE))[0].used:
            assert time.monotonic() < deadline, "the take given up is still counted"
            await asyncio.sleep(0.05)
        for _ in range(3):  # the whole limit, and the slots, are there
            assert (await state.take([rpm], [slot], now=BASE)).granted
    finally:
        await state.close()


@pytest.mark.slow
async def test_redis_values_being_sent_are_read_superseded_and_kept_through_a_close(
        redis_server):
    """While a write-behind is on its way (slowed here): this process reads what it
    carries, a delete of one of its keys lands after it, and a close that cuts it short
    sends it again."""
    state = await open_state({"url": redis_server.url, "timeout": 2})
    inner = state.inner
    try:
        await state.put("ns", {"k": b"v0"}, ttl=60)
        pipeline = inner._redis.pipeline

        def slow_pipeline(*args, **kwargs):
            pipe = pipeline(*args, **kwargs)
            execute = pipe.execute

            async def slowly(*a, **kw):
                if any(command[0][0] == "SET" for command in pipe.command_stack):
                    await asyncio.sleep(0.3)
                return await execute(*a, **kw)

            pipe.execute = slowly
            return pipe

        inner._redis.pipeline = slow_pipeline
        state.put_soon("ns", {"k": b"v1", "d": b"x"}, ttl=60)
        await asyncio.sleep(0.1)
        assert inner._inflight  # on its way
        assert await state.get("ns", ["k"]) == [b"v1"]
        await state.delete("ns", ["d"])
        state.put_soon("ns", {"c": b"last"}, ttl=60)
        await asyncio.sleep(0.1)
        assert inner._inflight
    finally:
        await state.close()
    other = await open_state({"url": redis_server.url})
    try:
        assert await other.get("ns", ["k", "d", "c"]) == [b"v1", None, b"last"]
    finally:
        await other.close()


@pytest.mark.slow
async def test_redis_close_ends_even_when_its_flusher_missed_the_cancel(redis_server):
    """asyncio.wait_for (3.11) loses a cancel that comes as the send it waits for finishes:
    the flusher goes on, here with Redis out and rows queued. The close still ends, within
    its bound."""
    state = await open_state({"url": redis_server.url, "timeout": 0.2})
    inner = state.inner
    flush = inner._flush

    async def deaf_flush():
        try:
            await asyncio.sleep(0.3)
        except asyncio.CancelledError:
            pass  # the lost cancel
        await flush()

    inner._flush = deaf_flush
    redis_server.stop()
    try:
        await state.record([{"id": "queued", "time": time.time()}])
        await asyncio.sleep(0.15)  # the flusher is in its flush
        started = time.monotonic()
        await asyncio.wait_for(state.close(), 10)
        assert time.monotonic() - started < 2 * redis_state.CLOSE_SECONDS + 1
    finally:
        redis_server.start()


async def test_redis_every_key_expires_but_the_ledgers_index_and_the_keys(redis_server):
    import redis.asyncio

    state = await open_state({"url": redis_server.url})
    try:
        for n in range(20):
            taken = await state.take([Counter(f"key:{n % 3}:rpm", "minute", limit=100),
                                      Counter(f"key:{n % 3}:spend", "month", limit=None)],
                                     [Slot(f"key:{n % 3}:concurrent", 5)])
            await state.add([Counter(f"key:{n % 3}:otpm", "minute", amount=9)])
            await state.record([{"id": f"ex{n}", "time": time.time()}])
            if n % 2:
                await state.release(f"key:{n % 3}:concurrent", taken.tokens[0])
        await state.put("provenance", {"k": b"v"}, ttl=60)
        await state.put_key({"name": "a", "hash": "h"})
        await state.rows()
    finally:
        await state.close()
    client = redis.asyncio.Redis.from_url(redis_server.url)
    try:
        names = sorted([k.decode() async for k in client.scan_iter("*")])
        forever = [k for k in names if await client.ttl(k) < 0]
        assert forever == ["relay:keys", "relay:keys:version", "relay:ledger"]
        assert all(k.startswith("relay:") for k in names)
    finally:
        await client.aclose()


async def test_redis_keeps_the_ledger_for_its_retention_only(redis_server):
    """Rows older than the retention leave the ledger's index as new ones come, and every
    row's own key expires within the retention: the ledger stays bounded in Redis too."""
    import redis.asyncio

    state = await open_state({"url": redis_server.url, "retention_days": 1})
    try:
        await state.record([{"id": "old", "time": time.time() - 2 * 86400}])
        await state.record([{"id": "new", "time": time.time()}])
        assert [row["id"] for row in await state.rows()] == ["new"]
    finally:
        await state.close()
    client = redis.asyncio.Redis.from_url(redis_server.url)
    try:
        assert [member.decode() for member in await client.zrange("relay:ledger", 0, -1)] \
            == ["new"]
        rows = [k async for k in client.scan_iter("relay:row:*")]
        assert rows
        for row in rows:
            assert 0 < await client.ttl(row) <= 86400
    finally:
        await client.aclose()


async def test_redis_the_ids_of_the_adds_batches_cost_one_small_key_a_process(redis_server):
    """Each batch of adds has an id, so that one sent again counts once, and so has each take
    (so that one unheard can be undone); the ids the process has heard back about are
    dropped, so a soak's hundreds of thousands of batches and takes leave one key with
    nothing much in it (not a key per batch for ten minutes)."""
    import redis.asyncio

    state = await open_state({"url": redis_server.url})
    try:
        for _ in range(200):
            await state.inner.add([Counter("key:a:otpm", "minute", amount=1)], now=BASE)
            await state.inner.counts([Counter("key:a:otpm", "minute")], now=BASE)  # sends it
        assert (await state.counts([Counter("key:a:otpm", "minute")], now=BASE))[0].used == 200
        for _ in range(200):
            taken = await state.inner.take([Counter("key:a:rpm", "minute", limit=1000)],
                                           [Slot("key:a:concurrent", limit=10)], now=BASE)
            await state.inner.release("key:a:concurrent", taken.tokens[0])
    finally:
        await state.close()
    client = redis.asyncio.Redis.from_url(redis_server.url)
    try:
        batches = [k async for k in client.scan_iter("relay:batch*")]
        assert len(batches) == 1
        assert await client.zcard(batches[0]) <= 1
        assert 0 < await client.ttl(batches[0]) <= 600
    finally:
        await client.aclose()


async def test_redis_connections_a_burst_opened_are_closed_once_idle(redis_server,
                                                                     monkeypatch):
    import redis.asyncio

    from relay.state import redis as redis_state

    monkeypatch.setattr(redis_state, "IDLE_CONNECTION_SECONDS", 0.3)
    state = await open_state({"url": redis_server.url})
    client = redis.asyncio.Redis.from_url(redis_server.url)

    async def connected() -> int:  # the relay's, without this one
        return len(await client.client_list()) - 1

    try:
        await asyncio.gather(*(state.get("ns", [f"k{n}"]) for n in range(20)))
        assert await connected() > 2  # a burst: several at once
        deadline = time.monotonic() + 5
        while await connected() > 1:
            assert time.monotonic() < deadline, "the burst's connections stayed open"
            await asyncio.sleep(0.1)
        assert await state.get("ns", ["k0"]) == [None]  # and it still answers
    finally:
        await state.close()
        await client.aclose()
