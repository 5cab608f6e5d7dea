"""What the console shows, read from the shared record: the ledger rows of the state seam and
the dump directory. Pure functions over rows, and the file reads (run in a thread by the
caller, never on the event loop).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import re
import stat
from collections import Counter as Tally
from typing import Any, BinaryIO

from .. import document

# The most rows one page reads: a day of a busy relay is summarised from at most this many.
MAX_SCAN = 50_000
PAGE = 50
SPEND_DAYS = 7  # the Keys page's spend by day
# ASCII digits (``\d`` takes any script's) and nothing after, not even a line break (``$``).
DAY_NAME = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}\Z")
DUMP_NAME = re.compile(r"[0-9]{6}\.[0-9]{6}-[A-Za-z0-9_-]+\.json\Z")
# A dump holds at most four bodies of the writer's max_body_bytes (8 MiB by default).
MAX_DUMP_BYTES = 64 * 1024 * 1024
# Where an error names the part of the request it refuses: "messages.3.content.1: ...".
ERROR_PATH = re.compile(r"\bmessages\.(\d+)(?:\.content\.(\d+))?")
REWRITES = frozenset({"rewrote", "restored", "translated ids", "restored held ids"})
CACHE_BREAKS = frozenset({"miss", "break", "broken"})


def repairs_of(row: dict) -> int:
    value = row.get("repairs")
    if isinstance(value, bool):
        return 0
    if isinstance(value, int):
        return value
    if isinstance(value, list):
        return sum(item.get("count", 1) if isinstance(item, dict) else 1 for item in value)
    return 0


def rewrites_of(row: dict) -> int:
    """The id rewrites an exchange's timeline shows (dedup's, portable's, threads')."""
    return sum(1 for entry in row.get("timeline") or ()
               if isinstance(entry, dict) and entry.get("action") in REWRITES)


def is_error(row: dict) -> bool:
    status = row.get("status")
    return (isinstance(status, int) and status >= 400) or row.get("outcome") not in (None, "ok")


def cache_break(row: dict) -> dict | None:
    """The prompt-cache break an exchange saw (with its cause), or None."""
    cache = row.get("cache")
    if isinstance(cache, dict) and cache.get("status") in CACHE_BREAKS and cache.get("cause"):
        return cache
    return None


def cache_ratio(rows) -> float | None:
    read = total = 0
    for row in rows:
        figures = cache_tokens(row)
        read += figures[0]
        total += sum(figures)
    return read / total if total else None


def cache_tokens(row: dict) -> tuple[int, int, int]:
    """What the prompt cache did with an exchange's input tokens: read, written, sent fresh."""
    return (row.get("cache_read_input_tokens") or 0,
            (row.get("cache_write_5m_input_tokens") or 0)
            + (row.get("cache_write_1h_input_tokens") or 0),
            row.get("input_tokens") or 0)


def cache_by(rows, field: str) -> list[dict]:
    """The cache's figures by ``field`` (``backend``, ``key``): read, written and fresh input
    tokens, the hit ratio, and the breaks, the most input first."""
    found: dict[str, dict] = {}
    for row in rows:
        name = row.get(field) or "-"
        entry = found.get(name)
        if entry is None:
            entry = found[name] = {"name": name, "read": 0, "written": 0, "fresh": 0,
                                   "breaks": 0}
        read, written, fresh = cache_tokens(row)
        entry["read"] += read
        entry["written"] += written
        entry["fresh"] += fresh
        entry["breaks"] += cache_break(row) is not None
    for entry in found.values():
        total = entry["read"] + entry["written"] + entry["fresh"]
        entry["ratio"] = entry["read"] / total if total else None
    return sorted(found.values(), key=lambda e: -(e["read"] + e["written"] + e["fresh"]))


def buckets(rows, start: float, size: float, count: int, value) -> list[float]:
    """``value(row)`` summed into ``count`` buckets of ``size`` seconds from ``start``."""
    out = [0.0] * count
    for row in rows:
        i = int((row["time"] - start) // size)
        if 0 <= i < count:
            out[i] += value(row)
    return out


def overview(rows: list[dict], now: float) -> dict[str, Any]:
    """The last hour by minute and the last day by hour: requests, errors, repairs and
    rewrites, spend; the cache hit ratio of each span."""
    hour_start = now - now % 60 - 59 * 60
    day_start = now - now % 3600 - 23 * 3600
    last_hour = [row for row in rows if row["time"] >= hour_start]
    series: dict[str, Any] = {}
    for name, value in (("requests", lambda r: 1), ("errors", lambda r: int(is_error(r))),
                        ("repairs", lambda r: repairs_of(r) + rewrites_of(r)),
                        ("spend", lambda r: (r.get("cost_micro_usd") or 0) / 1e6)):
        series[name] = {"hour": buckets(last_hour, hour_start, 60, 60, value),
                        "day": buckets(rows, day_start, 3600, 24, value)}
    series["cache_hour"] = cache_ratio(last_hour)
    series["cache_day"] = cache_ratio(rows)
    series["cache_by"] = {field: cache_by(rows, field) for field in ("backend", "key")}
    series["hour_start"], series["day_start"] = hour_start, day_start
    series["total"] = len(rows)
    return series


def sessions(rows: list[dict]) -> list[dict]:
    """Rows grouped by ``session``, the latest session first."""
    found: dict[str, dict] = {}
    for row in rows:
        key = row.get("session")
        if not key:
            continue
        session = found.get(key)
        if session is None:
            session = found[key] = {"session": key, "first": row["time"], "last": row["time"],
                                    "turns": 0, "backends": Tally(), "models": Tally(),
                                    "keys": set(), "repairs": 0, "rewrites": 0, "breaks": [],
                                    "errors": 0, "ids": [], "read": 0, "written": 0,
                                    "fresh": 0}
        session["first"] = min(session["first"], row["time"])
        session["last"] = max(session["last"], row["time"])
        session["turns"] += 1
        session["backends"][row.get("backend") or "-"] += 1
        session["models"][row.get("model") or "-"] += 1
        if row.get("key"):
            session["keys"].add(row["key"])
        session["repairs"] += repairs_of(row)
        session["rewrites"] += rewrites_of(row)
        session["errors"] += is_error(row)
        read, written, fresh = cache_tokens(row)
        session["read"] += read
        session["written"] += written
        session["fresh"] += fresh
        broke = cache_break(row)
        if broke is not None:
            session["breaks"].append((row["id"], broke))
        session["ids"].append(row["id"])
    return sorted(found.values(), key=lambda s: s["last"], reverse=True)


def spend_by_day(rows: list[dict], key: str, now: float, days: int = SPEND_DAYS
                 ) -> list[tuple[str, float]]:
    start = now - now % 86400 - (days - 1) * 86400
    mine = [row for row in rows if row.get("key") == key]
    totals = buckets(mine, start, 86400, days, lambda r: (r.get("cost_micro_usd") or 0) / 1e6)
    return [(dt.datetime.fromtimestamp(start + i * 86400, dt.timezone.utc).strftime("%m-%d"),
             total) for i, total in enumerate(totals)]


# --- dumps ---------------------------------------------------------------------------------


def dump_dir(config) -> str | None:
    """The dump plugin's directory, when it is in the pipeline (as it resolves it: relative
    to the directory the relay runs in)."""
    if "dump" not in config.pipeline:
        return None
    directory = (config.plugins.get("dump") or {}).get("dir")
    if not isinstance(directory, str) or not directory.strip():
        return None
    return os.path.abspath(os.path.expanduser(directory))


def list_dumps(directory: str, offset: int = 0, limit: int = PAGE) -> tuple[list[dict], int]:
    """The dumps under ``directory``, newest first: one page of them and how many there are.
    Never through a symbolic link."""
    found: list[tuple[str, str, int]] = []
    try:
        days = [entry for entry in os.scandir(directory)
                if DAY_NAME.match(entry.name) and entry.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return [], 0
    for day in days:
        for entry in os.scandir(day.path):
            if DUMP_NAME.match(entry.name) and entry.is_file(follow_symlinks=False):
                found.append((day.name, entry.name, 0))
    found.sort(reverse=True)
    page = []
    for day_name, name, _ in found[offset:offset + limit]:
        try:
            size = os.stat(os.path.join(directory, day_name, name), follow_symlinks=False).st_size
        except FileNotFoundError:  # deleted by retention since the scan
            continue
        time_part, _, rest = name.partition("-")
        page.append({"name": f"{day_name}/{name}", "day": day_name, "time": time_part,
                     "request_id": rest[:-len(".json")], "size": size})
    return page, len(found)


def dump_file(directory: str, name: str) -> str | None:
    """The path of the dump ``name`` (``DAY/FILE``) under ``directory``, or None for a name
    that is not one a dump has."""
    day, _, file = name.partition("/")
    if not (DAY_NAME.match(day) and DUMP_NAME.match(file)):
        return None
    try:
        dt.date.fromisoformat(day)  # a day the dump plugin names, not 2026-13-45
    except ValueError:
        return None
    return os.path.join(directory, day, file)


def open_dump(directory: str, name: str) -> BinaryIO:
    """The dump ``name`` opened for reading, never through a symbolic link; raises
    DocumentError."""
    path = dump_file(directory, name)
    if path is None:
        raise document.DocumentError("not a dump's name")
    if not os.path.lexists(path):
        # The ledger names the file; its day is the exchange's start, and a dump written
        # just after midnight is in the next day's directory.
        day, _, file = name.partition("/")
        following = dt.date.fromisoformat(day) + dt.timedelta(days=1)
        later = os.path.join(directory, following.isoformat(), file)
        if os.path.lexists(later):
            path = later
    try:
        # Not blocking: opening a FIFO planted under a dump's name waits for a writer, and
        # held a thread, and the page, for good. A regular file reads as ever.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        raise document.DocumentError(f"cannot read: {e.strerror or e}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise document.DocumentError("not a file")
    return os.fdopen(fd, "rb")


def read_dump(directory: str, name: str) -> dict:
    """A dump's document, read with the host's reader; raises DocumentError."""
    with open_dump(directory, name) as f:
        raw = f.read(MAX_DUMP_BYTES + 1)
    if len(raw) > MAX_DUMP_BYTES:
        raise document.DocumentError(f"larger than {MAX_DUMP_BYTES} bytes")
    return document.load(raw)


def offending(message: str | None) -> tuple[int, int | None] | None:
    """The message (and block) an error message names, ``messages.N.content.K``."""
    found = ERROR_PATH.search(message or "")
    if found is None:
        return None
    return int(found.group(1)), None if found.group(2) is None else int(found.group(2))


def error_message(dump: dict) -> str | None:
    """What the dump's request was refused with: the upstream's error message, else the
    relay's own."""
    answer = dump.get("upstream_response")
    if isinstance(answer, dict) and isinstance(answer.get("body"), str):
        try:
            error = document.orjson.loads(answer["body"]).get("error")
            if isinstance(error, dict) and isinstance(error.get("message"), str):
                return error["message"]
        except (ValueError, AttributeError):
            pass
    relay_error = dump.get("relay_error")
    if isinstance(relay_error, dict) and isinstance(relay_error.get("message"), str):
        return relay_error["message"]
    stream_error = dump.get("stream_error")
    if isinstance(stream_error, dict) and isinstance(stream_error.get("error"), dict):
        return str(stream_error["error"].get("message"))
    return None


def rejected_body(dump: dict) -> Any:
    """The request the error is about: what went upstream, else what the client sent."""
    upstream = dump.get("upstream_request")
    client = dump.get("client_request") or {}
    part = client
    if isinstance(upstream, dict) and upstream.get("body_same_as") != "client_request" \
            and isinstance(upstream.get("body"), str):
        part = upstream
    try:
        return document.orjson.loads(part.get("body") or "null")
    except ValueError:
        return None


def replay(dump: dict):
    """``relay replay``'s rebuild of a dump (:func:`relay.replay.rebuild_dump`), on a loop of
    its own: run it in a thread. Returns (recorded, rebuilt) results, or a string saying why
    the dump cannot be replayed."""
    from .. import replay as replaying
    try:
        return asyncio.run(replaying.rebuild_dump(dump))
    except replaying.UnusableDump as e:
        return f"cannot be replayed: {e}"
