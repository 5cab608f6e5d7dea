"""The portable plugin's record on disk when the disk misbehaves: a lock held by someone else
delays no request (the missed records are counted), a directory that is missing or a file that
is no database stops start-up with a clear error, and a file that turns read-only or a disk
that fills is logged once and counted, not once per thinking block."""

from __future__ import annotations

import asyncio
import logging
import re
import sqlite3
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import orjson
import pytest
import yaml
from relay_builtins import portable
from support import backend

from relay.testing.emulator import sign_thinking
from relay.testing.fixtures import received, relay_client  # noqa: F401  (the fixture)

HEADERS = {"x-api-key": "test", "anthropic-version": "2023-06-01",
           "content-type": "application/json"}
ASK = {"model": "claude-test", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}
# The emulator thinks unless told not to: an answer without a thinking block to record.
QUIET = {**ASK, "thinking": {"type": "disabled"}}
MISSED = re.compile(r'^relay_provenance_missed_total\{reason="(\w+)",result="(\w+)"\} (\S+)$',
                    re.MULTILINE)


def missed(metrics: str) -> dict:
    return {(result, reason): float(count) for reason, result, count in MISSED.findall(metrics)}


def call(url: str, path: str, body: dict | None = None) -> str:
    """One request to the relay at ``url``; its answer's body. A status other than 200 fails."""
    data = orjson.dumps(body) if body is not None else None
    request = urllib.request.Request(url + path, data=data, headers=HEADERS)
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200
        return response.read().decode()


# --- a lock held by another connection ----------------------------------------------------


def test_a_held_lock_delays_no_request_and_the_records_it_kept_out_are_counted(
        emulator, relay, tmp_path):
    emu = emulator("--thinking")
    db = tmp_path / "provenance.db"
    r = relay({"pipeline": ["metrics", "portable"],
               "plugins": {"portable": {"provenance_db": str(db)}},
               "backends": [backend(emu.url)]})
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # a backup, another process: nobody else may write now
    answers = 16
    try:
        def timed(args):
            start = time.monotonic()
            call(r.url, *args)
            return time.monotonic() - start

        calls = [("/v1/messages", {**ASK, "stream": n % 2 == 0}) for n in range(answers)]
        calls += [("/healthz",)] * 8
        with ThreadPoolExecutor(8) as pool:
            took = list(pool.map(timed, calls))
        # Each write gives up on the lock after 0.1 s, in a thread of its own: nobody waits
        # for it (it used to hold every request on the worker for 5 s).
        assert max(took) < 1.0, took
        # The records that could not be written are counted, once each.
        deadline = time.monotonic() + 10
        while missed(call(r.url, "/metrics")).get(("not_recorded", "locked"), 0) < answers:
            assert time.monotonic() < deadline, call(r.url, "/metrics")
            call(r.url, "/v1/messages", QUIET)  # an exchange to carry the count
        assert missed(call(r.url, "/metrics")) == {("not_recorded", "locked"): answers}
    finally:
        holder.rollback()
    assert holder.execute("SELECT COUNT(*) FROM issued").fetchone() == (0,)
    # The lock gone, the next answer's thinking is recorded again.
    call(r.url, "/v1/messages", ASK)
    deadline = time.monotonic() + 10
    while holder.execute("SELECT COUNT(*) FROM issued").fetchone() != (1,):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert r.output().count("file is locked") == 1  # one warning for the sixteen
    holder.close()


# --- start-up -------------------------------------------------------------------------------


def start(tmp_path, provenance_db: str) -> subprocess.CompletedProcess:
    config = tmp_path / "relay.yaml"
    config.write_text(yaml.safe_dump({
        "pipeline": ["portable"], "plugins": {"portable": {"provenance_db": provenance_db}},
        "backends": [backend("http://127.0.0.1:9")]}))
    return subprocess.run([sys.executable, "-m", "relay", "--config", str(config), "--port", "0"],
                          capture_output=True, text=True, timeout=30, cwd=tmp_path)


@pytest.mark.slow
def test_a_missing_directory_stops_start_up_naming_it(tmp_path):
    done = start(tmp_path, str(tmp_path / "nowhere" / "p.db"))
    assert done.returncode == 2
    assert (f"config error: plugins.portable.provenance_db: the directory {tmp_path}/nowhere "
            "does not exist") in done.stderr + done.stdout


@pytest.mark.slow
def test_a_file_that_is_no_database_stops_start_up(tmp_path):
    (tmp_path / "p.db").write_bytes(b"a text file, not a database" * 200)
    done = start(tmp_path, str(tmp_path / "p.db"))
    assert done.returncode == 2
    assert (f"config error: plugins.portable.provenance_db: {tmp_path}/p.db: the file is not a "
            "SQLite database, or is damaged") in done.stderr + done.stdout


# --- the file turns read-only, the disk fills -------------------------------------------------


def read_only(self):
    """The plugin's connection as a read-only file gives it (root ignores file modes, so the
    test opens the file the way SQLite opens one it may not write)."""
    return sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, isolation_level=None,
                           timeout=portable.BUSY_SECONDS)


class FullDisk(sqlite3.Connection):
    """A connection on a disk with no room left: every write fails as SQLite says it."""

    def executemany(self, *args):
        raise sqlite3.OperationalError("database or disk is full")


def full_disk(self):
    return sqlite3.connect(self.path, isolation_level=None, factory=FullDisk)


def full_database(self):
    """A connection to a database filled up to its page limit (SQLite's own SQLITE_FULL)."""
    db = sqlite3.connect(self.path, isolation_level=None, timeout=portable.BUSY_SECONDS)
    db.execute(f"PRAGMA max_page_count = {fill(self.path)}")
    return db


FILLED: dict[str, int] = {}  # database path -> its page limit


def fill(path: str) -> int:
    """Fill the database at ``path`` up to a page limit (once: the plugin reconnects after
    each failure); that limit."""
    filled = FILLED
    if path not in filled:
        db = sqlite3.connect(path, isolation_level=None)
        filled[path] = pages = db.execute("PRAGMA page_count").fetchone()[0] + 2
        db.execute(f"PRAGMA max_page_count = {pages}")
        with pytest.raises(sqlite3.OperationalError, match="full"):
            for n in range(10000):
                db.execute("INSERT INTO issued VALUES (?, 'filler', 'm')", (f"filler{n}",))
        db.close()
    return filled[path]


@pytest.mark.parametrize("connect, reason, words", [
    (read_only, "read_only", "the file cannot be written (read-only)"),
    (full_disk, "full", "the disk (or the database) is full"),
    (full_database, "full", "the disk (or the database) is full"),
], ids=["read-only", "full-disk", "full-database"])
async def test_a_failing_file_is_logged_once_and_counted_per_block(
        relay_client, tmp_path, monkeypatch, caplog, connect, reason, words):
    client = await relay_client(["metrics", "portable"], {
        "portable": {"provenance_db": str(tmp_path / "p.db")}}, thinking=True)
    monkeypatch.setattr(portable.Provenance, "connect", connect)  # after start-up's check
    caplog.set_level(logging.WARNING, logger="relay.portable")
    answers = 30
    for n in range(answers):
        response = await client.post("/v1/messages", json={**ASK, "stream": n % 2 == 0},
                                     headers=HEADERS)
        assert response.status == 200
        await response.read()
    provenance = client.chain.pm.get_plugin("portable").provenance
    assert await asyncio.to_thread(provenance.flush, 5)
    await (await client.post("/v1/messages", json=QUIET, headers=HEADERS)).read()
    metrics = await (await client.get("/metrics")).text()
    assert missed(metrics) == {("not_recorded", reason): answers}
    warnings = [r.getMessage() for r in caplog.records if r.name == "relay.portable"]
    assert len(warnings) == 1 and words in warnings[0], warnings
    assert not any(r.exc_info for r in caplog.records)  # no traceback


def test_a_condition_is_logged_again_after_a_minute_with_what_it_kept_quiet(monkeypatch, caplog):
    now = [1000.0]
    monkeypatch.setattr(portable.time, "monotonic", lambda: now[0])
    caplog.set_level(logging.WARNING, logger="relay.portable")
    trouble = portable.Trouble()
    for at in (0, 1, 2, 30, 61, 62):
        now[0] = 1000.0 + at
        trouble.report("not_recorded", "full", 2)
    trouble.report("not_known", "locked")  # another condition: said at once
    assert [r.getMessage() for r in caplog.records] == [
        "thinking provenance not recorded: the disk (or the database) is full",
        "thinking provenance not recorded: the disk (or the database) is full; 6 more since "
        "the last warning",
        "thinking provenance not known: the file is locked by another connection"]
    assert trouble.drain() == {("not_recorded", "full"): 12, ("not_known", "locked"): 1}
    assert trouble.drain() == {}


async def test_a_read_that_does_not_come_back_in_time_leaves_the_block_as_it_is(
        relay_client, tmp_path, monkeypatch):
    client = await relay_client(["metrics", "portable"], {
        "portable": {"provenance_db": str(tmp_path / "p.db")}}, signing_secret="s")
    reader = portable.Provenance._read

    def slow(self, keys):
        time.sleep(2)  # a disk that takes its time
        return reader(self, keys)

    monkeypatch.setattr(portable.Provenance, "_read", slow)
    block = {"type": "thinking", "thinking": "x", "signature": sign_thinking(b"s", "x")}
    body = {**ASK, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [block, {"type": "text", "text": "hello"}]},
        {"role": "user", "content": "again"}]}
    start = time.monotonic()
    response = await client.post("/v1/messages", json=body, headers=HEADERS)
    assert response.status == 200, await response.text()
    assert time.monotonic() - start < 1.5  # the read's deadline is 0.5 s, not the disk's 2 s
    assert received(client)[-1]["messages"][1]["content"][0] == block  # not known: as sent
    metrics = await (await client.get("/metrics")).text()
    assert missed(metrics) == {("not_known", "slow"): 1}
