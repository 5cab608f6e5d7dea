"""One session, many backends: what one backend left in a history must not kill the request
to another.

Two things break when a conversation moves (``/model``, ``--resume`` with another model, a
fallback): tool ids minted by a backend with another id grammar (``functions.Bash:0`` sent to
Anthropic: ``String should match pattern '^[a-zA-Z0-9_-]+$'``), and thinking blocks signed by
another issuer (``Invalid `signature` in `thinking` block``). This plugin runs on the request
for the backend it was routed to (after dedup, pairing and ordering, so it sees the ids that
will really go up) and makes the history fit that backend:

- **Ids.** An id that does not fit the backend's grammar (the ``tool_id_pattern`` quirk; by
  default Anthropic's for Anthropic-format backends, none for OpenAI-format ones) goes up as
  ``relayid_`` and the base32 of its UTF-8 bytes, in the ``tool_use`` and in the
  ``tool_result`` that answers it. The mapping is a pure function of the id: no state, every
  later request maps it the same way, and earlier turns never change (prompt caching depends
  on that). An id of that form bound for a backend whose grammar admits the original goes
  back to the original. On the way back, a tool_use id a backend minted outside Anthropic's
  grammar reaches the client in the same encoding (in a whole answer, or in a stream's
  ``content_block_start``): every Anthropic-format client can then send it back as it got it,
  where clients that "sanitise" ids would otherwise send back ids no backend issued
  (LiteLLM's ``functions_Bash_0``, LangChain's ``toolu_<hash>``) and so defeat dedup's check
  for a repeated id. This runs before dedup on the way back, so dedup judges the ids as the
  client will hold them.
- **Thinking.** Each thinking (and redacted_thinking) block's issuer, backend and model, is
  recorded when its answer passes through, whether or not the request asked for thinking
  (some Anthropic-compatible backends think unasked), keyed by a hash of its signature (the
  client's transcript is never touched: it stays valid for talking to that backend directly).
  On the way up, a block known to come from another issuer, or unsigned (an OpenAI-format
  backend's reasoning: only the issuer can sign), is dropped: the API does not require
  thinking from earlier turns. A block of unknown issuer goes up as it is, so the relay
  never alters what it cannot judge. When thinking is on with a budget (``type: enabled``)
  and the final assistant turn (the whole tool loop whose results follow) does not start
  with a thinking block (the API refuses that: "When `thinking` is enabled, a final
  `assistant` message must start with a thinking block"), that one request goes up with
  ``thinking: {"type": "disabled"}`` and without the ``clear_thinking_*`` context-management
  edits (they apply to thinking that is on): the model answers without extended thinking
  this once. With adaptive thinking that rule is not on record, so the request keeps its
  thinking, noted ``unsure``. A backend with the ``thinking_passed_back`` quirk (DeepSeek's
  ``/anthropic``, which thinks unless told not to and wants every tool turn's thinking back)
  gets any request holding a tool turn without thinking with thinking disabled. Every drop
  and those switches are counted in ``x-relay-repairs`` and noted on the timeline; id
  translations are counted in ``x-relay-rewrites``.

The record lives in the relay's shared state when there is one (``state.url``: one SQLite
file for the workers of a host, Redis for replicas on several hosts, so that a session
crossing backends through different replicas keeps its thinking valid), each block kept
``SHARED_DAYS`` days; else in process memory (``provenance_rows`` blocks). The older
``provenance_db`` (a SQLite file of its own, for the workers and replicas of one host) still
works and then wins; ``state.url`` replaces it. A replica that has no record of a block sends
it as it is. The record is never waited for on the event loop past ``LOOKUP_SECONDS`` (see
:class:`Provenance`); what it could not record or tell is logged once a minute at most per
condition, and counted on the timeline of the next exchange that ends (``provenance
missed``), where the metrics plugin reads it.

Options (plugin options or backend quirks): see ``OPTIONS``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import functools
import hashlib
import logging
import os
import queue
import re
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from relay import betas, skeleton
from relay.errors import ConfigError
from relay.hookspecs import hookimpl
from relay.options import Option
from relay.state import State, Unavailable

PLUGIN = "portable"
RAW_IDS = "portable.raw"  # exchange.state: the tool_use ids the client holds outside the grammar
ANTHROPIC_IDS = "^[a-zA-Z0-9_-]+$"
PREFIX = "relayid_"
THINKING = ("thinking", "redacted_thinking")
log = logging.getLogger("relay.portable")

# The record on disk must never hold up a request: a statement gives up on another
# connection's lock after BUSY_SECONDS (SQLite's busy timeout), a request waits at most
# LOOKUP_SECONDS for a read, at most MAX_READS reads are queued or running at once, and
# WRITE_QUEUE answers' records wait for the writer (each transaction takes up to WRITE_BATCH
# of them). In front of a file, memory keeps the CACHE_ROWS blocks last written or read.
BUSY_SECONDS = 0.1
CREATE_SECONDS = 1.0  # how long a new file's WAL switch is tried again
LOOKUP_SECONDS = 0.5
MAX_READS = 32
CACHE_ROWS = 10000
WRITE_QUEUE = 1024
WRITE_BATCH = 64
# Records for a shared state that is out wait (in that queue) and are tried again this often,
# twice as long each time up to MAX_RETRY_SECONDS.
RETRY_SECONDS = 1.0
MAX_RETRY_SECONDS = 30.0
# In the shared state, each block's issuer is kept this long (a session resumed later than
# that sends its thinking as it is, which is what a relay without the record does).
SHARED_NAMESPACE = "provenance"
SHARED_DAYS = 7
# A condition (a held lock, a full disk) is logged once, then again at most this often.
WARN_EVERY = 60.0
# Why the record could not be written or read: the metric's reason label, and the log's words.
REASONS = {
    "locked": "the file is locked by another connection",
    "full": "the disk (or the database) is full",
    "read_only": "the file cannot be written (read-only)",
    "corrupt": "the file is not a SQLite database, or is damaged",
    "unopenable": "the file cannot be opened",
    "io": "the disk failed to read or write",
    "queue": "too many records wait for the writer",
    "busy": "too many reads wait already",
    "slow": f"no answer within {LOOKUP_SECONDS} s",
    "unreachable": "the shared state (state.url) cannot be reached",
    "error": "SQLite failed",
}
# SQLite's primary result codes (https://sqlite.org/rescode.html), and the words of the
# errors raised without one.
_CODES = {5: "locked", 6: "locked", 8: "read_only", 10: "io", 11: "corrupt", 13: "full",
          14: "unopenable", 26: "corrupt"}
_WORDS = (("locked", "locked"), ("full", "full"), ("readonly", "read_only"),
          ("read-only", "read_only"), ("not a database", "corrupt"), ("malformed", "corrupt"),
          ("unable to open", "unopenable"), ("disk i/o", "io"))


def _pattern(value: str) -> str | None:
    try:
        re.compile(value)
    except re.error as e:
        return f"must be a regular expression: {e}"
    return None


OPTIONS = (
    Option("tool_id_pattern", str, "",
           "the tool ids this backend accepts (a regular expression); empty: "
           "`^[a-zA-Z0-9_-]+$` for Anthropic-format backends, any for OpenAI-format ones",
           quirk=True, check=_pattern),
    Option("thinking_signatures", bool, True,
           "the backend checks thinking signatures (OpenAI-format backends never do): thinking "
           "from another issuer is dropped on the way to it", quirk=True),
    Option("thinking_scope", str, "model",
           "who a signature is valid for: the model that made it, or any model of its backend",
           choices=("model", "backend"), quirk=True),
    Option("thinking_passed_back", bool, False,
           "in thinking mode (on unless `thinking: disabled`) the backend refuses an assistant "
           "tool turn sent back without its thinking (DeepSeek's `/anthropic`): a request "
           "holding such a turn (its thinking another issuer's, or never there) goes with "
           "thinking disabled", quirk=True),
    Option("provenance_db", str, "",
           "deprecated (set `state.url`, which holds the record then): a SQLite file of its "
           "own recording which backend and model issued each thinking block; empty: the "
           "shared state, or without one process memory only"),
    Option("provenance_rows", int, 100000,
           "how many thinking blocks the record keeps (the oldest go first)",
           check=lambda n: None if n > 0 else "must be positive"),
)


# --- ids ------------------------------------------------------------------------------------


def encode_id(original: str) -> str:
    """``original`` in a form every id grammar here admits: the prefix and lower-case base32."""
    raw = original.encode("utf-8", "surrogatepass")
    return PREFIX + base64.b32encode(raw).decode("ascii").rstrip("=").lower()


def decode_id(tool_id: str) -> str | None:
    """The original of an id :func:`encode_id` made, or None for any other id."""
    if not tool_id.startswith(PREFIX):
        return None
    body = tool_id[len(PREFIX):]
    if not body or not body.isascii() or body.lower() != body:
        return None
    try:
        raw = base64.b32decode(body.upper() + "=" * (-len(body) % 8))
        original = raw.decode("utf-8", "surrogatepass")
    except (binascii.Error, ValueError):
        return None
    return original if encode_id(original) == tool_id else None


@functools.lru_cache(maxsize=64)
def _grammar(pattern: str):
    return re.compile(pattern)


# What the caches below remember is bounded in bytes as well as in count: only strings of
# ordinary length are kept (a count alone let 65,536 ids and 16,384 signatures of any length
# pile up, tens of MB filling for many minutes with every new tool call and thinking block).
CACHED_ID_CHARS = 128
CACHED_SIGNATURE_CHARS = 2048


def id_for(tool_id: str, pattern: str | None) -> str:
    """The id ``tool_id`` goes up as to a backend whose ids match ``pattern`` (None: any)."""
    # The same ids come back in every request of a conversation: remember the answer for ids
    # of ordinary length.
    if len(tool_id) <= CACHED_ID_CHARS:
        return _id_for_cached(tool_id, pattern)
    return _id_for(tool_id, pattern)


# 8,192 ids: the histories of the sessions in flight; at most about 5 MB.
@functools.lru_cache(maxsize=8192)
def _id_for_cached(tool_id: str, pattern: str | None) -> str:
    return _id_for(tool_id, pattern)


def _id_for(tool_id: str, pattern: str | None) -> str:
    original = decode_id(tool_id)
    if original is not None:
        return original if pattern is None or _grammar(pattern).fullmatch(original) else tool_id
    if pattern is None or _grammar(pattern).fullmatch(tool_id):
        return tool_id
    return encode_id(tool_id)


def target_pattern(options: dict, backend) -> str | None:
    pattern = options.get("tool_id_pattern") or ""
    if pattern:
        return pattern
    # An upstream that does not hold ids to Anthropic's grammar takes the client's as they are.
    return None if backend is not None and not backend.adapter.checks_tool_ids else ANTHROPIC_IDS


def translate_ids(messages: list, pattern: str | None, thinking: list | None = None,
                  raw: set | None = None, lo: int = 0,
                  hi: int | None = None) -> list[tuple[int, int, str, str, str]]:
    """Rewrite, in place, every tool_use id and tool_result tool_use_id that does not fit
    ``pattern``; return ``(message, block, block type, client id, upstream id)`` for each
    change. ``thinking``, when given, gets True appended if any block is a thinking block
    (the walk that follows is then worth taking); ``raw``, when given, gets every tool_use
    id the client holds outside Anthropic's grammar, unless ``pattern`` is Anthropic's (those
    ids are then among the changes)."""
    changed: list[tuple[int, int, str, str, str]] = []
    if pattern == ANTHROPIC_IDS:
        raw = None
    for i in range(lo, len(messages) if hi is None else hi):
        message = messages[i]
        if type(message) is not dict:
            continue
        content = message.get("content")
        if type(content) is not list:
            continue
        for k, block in enumerate(content):
            if type(block) is not dict:
                continue
            kind = block.get("type")
            if thinking is not None and not thinking and kind in THINKING:
                thinking.append(True)
            field = "id" if kind == "tool_use" else "tool_use_id" if kind == "tool_result" else None
            client_id = block.get(field) if field else None
            if type(client_id) is not str or type(kind) is not str:
                continue
            if raw is not None and field == "id" and client_form(client_id) != client_id:
                raw.add(client_id)
            upstream_id = id_for(client_id, pattern)
            if upstream_id != client_id:
                block[field] = upstream_id
                changed.append((i, k, kind, client_id, upstream_id))
    return changed


# --- thinking provenance --------------------------------------------------------------------


def block_key(block: dict) -> str | None:
    """What identifies a thinking block's issue: a hash of its signature (or, redacted, its
    data); ``""`` for an empty one (no backend signed it); None when there is no string to
    judge (a malformed block, left for the upstream to refuse)."""
    kind = block.get("type")
    field = "signature" if kind == "thinking" else "data" if kind == "redacted_thinking" else None
    if field is None or not isinstance(kind, str):
        return None
    value = skeleton.value(block.get(field))
    if type(value) is not str:
        return None
    if not value:
        return ""
    return _key_cached(kind, value) if len(value) <= CACHED_SIGNATURE_CHARS else _key(kind, value)


def _key(kind: str, value: str) -> str:
    return hashlib.sha256(f"{kind}\0{value}".encode()).hexdigest()[:32]


# Every request of a session carries its earlier thinking blocks again: 4,096 signatures, at
# most about 10 MB; a longer one is hashed each time (a few microseconds).
@functools.lru_cache(maxsize=1 << 12)
def _key_cached(kind: str, value: str) -> str:
    return _key(kind, value)


class Trouble:
    """What kept the record from being written or read: counted (for the exchange that ends
    next to carry to the metrics) and logged once per condition every ``WARN_EVERY`` seconds,
    whichever thread saw it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}  # per condition: when it was last logged
        self._quiet: dict[str, int] = {}  # per condition: times seen since
        self.pending: collections.Counter = collections.Counter()  # (what, reason) -> count

    def report(self, what: str, reason: str, count: int = 1, detail: str = "") -> None:
        now = time.monotonic()
        with self._lock:
            if count:
                self.pending[what, reason] += count
            last = self._last.get(reason)
            if last is not None and now - last < WARN_EVERY:
                self._quiet[reason] = self._quiet.get(reason, 0) + count
                return
            self._last[reason] = now
            quiet = self._quiet.pop(reason, 0)
        log.warning("thinking provenance %s: %s%s%s", what.replace("_", " "), REASONS[reason],
                    f" ({detail})" if detail else "",
                    f"; {quiet} more since the last warning" if quiet else "")

    def drain(self) -> dict:
        with self._lock:
            counts = dict(self.pending)
            self.pending.clear()
        return counts


def reason_of(error: Exception) -> str:
    """Which condition an error from SQLite stands for (a key of ``REASONS``)."""
    code = getattr(error, "sqlite_errorcode", None)
    if code is not None:
        found = _CODES.get(code & 0xFF)
        if found:
            return found
    text = str(error).lower()
    for words, reason in _WORDS:
        if words in text:
            return reason
    return "error"


class Provenance:
    """Which backend and model issued each thinking block, bounded to ``rows`` entries.

    Without ``path`` the record is the shared ``state`` (a :class:`relay.state.State` other
    than memory: SQLite, Redis), in namespace ``provenance``, written by a task of its own
    from a bounded queue (where records wait while the state is out, to be written once it
    is back) and read with a deadline, with a memory cache in front; without
    either, this process's memory. With ``path``, it is a SQLite file, and
    the event loop never waits for it: writes go to a thread of their own through a bounded
    queue, reads to another with a deadline, every statement gives up on a lock after
    ``BUSY_SECONDS``, and what this process wrote or read is kept in memory (bounded too), so
    a block it has seen needs no read at all. A record that could not be written or read is
    "not recorded" or "not known" (counted in :attr:`trouble`): the block then goes up as the
    client sent it, which is what a replica without the record does anyway.
    """

    def __init__(self, path: str = "", rows: int = 100000, state: State | None = None):
        self.path = path
        self.rows = rows
        self.shared = state if not path and state is not None and state.kind != "memory" \
            else None
        # Without a file or a shared state, memory is the record; with one, a cache of it.
        self.memory_rows = min(rows, CACHE_ROWS) if path or self.shared else rows
        self._shares: collections.deque = collections.deque()  # records for the state
        self._sharer: asyncio.Task | None = None
        self.memory: collections.OrderedDict[str, tuple[str, str]] = collections.OrderedDict()
        # Moves when an issuer the memory knew changes or is forgotten: a judgement that
        # dropped nothing, made against the same version, still holds for every block whose
        # issuer it knew.
        self.version = 0
        self.added = 0  # issuers learnt: with nothing behind the memory, how one gets known
        self.trouble = Trouble()
        self._writes: queue.Queue = queue.Queue(maxsize=WRITE_QUEUE)
        self._writer: threading.Thread | None = None
        self._reader: ThreadPoolExecutor | None = None
        self._reads = 0  # reads queued for the reader or running there
        self._reads_lock = threading.Lock()
        self._read_db: sqlite3.Connection | None = None  # the reader thread's connection

    def connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, isolation_level=None, timeout=BUSY_SECONDS)
        try:
            # Connections making a new file at once (two workers' start-up, or the writer's
            # and the reader's threads): SQLite answers the second switch to WAL with
            # "database is locked" at once, whatever the busy timeout. Tried again for a
            # moment; on a file in WAL mode already the switch takes no lock.
            deadline = time.monotonic() + CREATE_SECONDS
            while True:
                try:
                    db.execute("PRAGMA journal_mode=WAL")
                    break
                except sqlite3.OperationalError as e:
                    if "locked" not in str(e) or time.monotonic() > deadline:
                        raise
                    time.sleep(0.01)
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("CREATE TABLE IF NOT EXISTS issued (key TEXT PRIMARY KEY, "
                       "backend TEXT NOT NULL, model TEXT NOT NULL)")
        except BaseException:
            db.close()
            raise
        return db

    def check(self, where: str) -> None:
        """At start-up: the file's directory exists, and the file is a database this process
        can write. A lock held now (a backup) or a full disk may pass; they are logged."""
        directory = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(directory):
            raise ConfigError(f"{where}: the directory {directory} does not exist")
        try:
            db = self.connect()
            try:
                db.execute("BEGIN IMMEDIATE")  # takes the write lock: can this process write?
                db.execute("ROLLBACK")
            finally:
                db.close()
        except sqlite3.Error as e:
            reason = reason_of(e)
            if reason in ("locked", "full"):
                self.trouble.report("at_start_up", reason, 0, str(e))
                return
            raise ConfigError(f"{where}: {self.path}: {REASONS[reason]} ({e})") from None

    # --- memory ---

    def _remember(self, key: str, issuer: tuple[str, str]) -> None:
        memory = self.memory
        before = memory.pop(key, None)
        memory[key] = issuer
        if before is None:
            self.added += 1
        elif before != issuer:
            self.version += 1
        if len(memory) > self.memory_rows:
            memory.popitem(last=False)
            # A forgotten issuer is asked of the record behind the memory again, or learnt
            # again from an answer, and may come back another.
            self.version += 1

    def record(self, entries: list[tuple[str, str, str]]) -> None:
        """Note who issued each block: at once in memory, later in the file."""
        if not entries:
            return
        for key, backend, model in entries:
            self._remember(key, (backend, model))
        if self.shared is not None:
            self._share(entries)
            return
        if not self.path:
            return
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, daemon=True,
                                            name="relay-provenance-write")
            self._writer.start()
        try:
            self._writes.put_nowait(entries)
        except queue.Full:
            self.trouble.report("not_recorded", "queue", len(entries))

    def known(self, keys) -> tuple[dict[str, tuple[str, str]], list[str]]:
        """What memory knows of ``keys``, and the keys only the file may know."""
        memory = self.memory
        found, missing = {}, []
        for key in dict.fromkeys(keys):
            issuer = memory.get(key)
            if issuer is not None:
                found[key] = issuer
            else:
                missing.append(key)
        return found, (missing if self.path or self.shared else [])

    async def lookup(self, keys) -> dict[str, tuple[str, str]]:
        """Who issued each of ``keys``, as far as is known within ``LOOKUP_SECONDS``."""
        found, missing = self.known(keys)
        if not missing:
            return found
        if self.shared is not None:
            return await self._look_up_shared(found, missing)
        # A read given up on may still be queued or running (a slow disk): those count too,
        # until the thread is done with them, so the reader's queue stays bounded.
        with self._reads_lock:
            busy = self._reads >= MAX_READS
            if not busy:
                self._reads += 1
        if busy:
            self.trouble.report("not_known", "busy", len(missing))
            return found
        if self._reader is None:
            self._reader = ThreadPoolExecutor(max_workers=1,
                                              thread_name_prefix="relay-provenance-read")
        job = self._reader.submit(self._read, missing)
        job.add_done_callback(self._read_done)
        try:
            # On time-out the job is cancelled if it has not started.
            read = await asyncio.wait_for(asyncio.wrap_future(job), LOOKUP_SECONDS)
        except asyncio.TimeoutError:
            self.trouble.report("not_known", "slow", len(missing))
            return found
        except Exception as e:  # sqlite3's own, or a value it could not take
            self.trouble.report("not_known", reason_of(e), len(missing), str(e))
            return found
        for key, issuer in read.items():
            self._remember(key, issuer)
        found.update(read)
        return found

    def _read_done(self, _job) -> None:
        with self._reads_lock:
            self._reads -= 1

    # --- the shared state ---

    def _share(self, entries: list[tuple[str, str, str]]) -> None:
        if len(self._shares) >= WRITE_QUEUE:
            self.trouble.report("not_recorded", "queue", len(entries))
            return
        self._shares.append(entries)
        if self._sharer is None or self._sharer.done():
            self._sharer = asyncio.get_running_loop().create_task(self._share_loop())

    async def _share_loop(self) -> None:
        assert self.shared is not None
        pause = RETRY_SECONDS
        while self._shares:
            taken = []
            batch: dict[str, bytes] = {}
            while self._shares and len(batch) < WRITE_BATCH:
                taken.append(self._shares.popleft())
                for key, backend, model in taken[-1]:
                    batch[key] = f"{backend}\0{model}".encode()
            try:
                await self.shared.put(SHARED_NAMESPACE, batch, SHARED_DAYS * 86400)
                pause = RETRY_SECONDS
            except Unavailable:
                # Kept for when the state is back (the state logs and counts the outage):
                # another replica that carries the session on must know these issuers.
                self._shares.extendleft(reversed(taken))
                await asyncio.sleep(pause)
                pause = min(pause * 2, MAX_RETRY_SECONDS)
            except Exception as e:  # a value the state could not take: the task goes on
                self.trouble.report("not_recorded", "error", len(batch), str(e))

    async def _look_up_shared(self, found: dict[str, tuple[str, str]], missing: list[str]
                              ) -> dict[str, tuple[str, str]]:
        assert self.shared is not None
        if self._reads >= MAX_READS:
            self.trouble.report("not_known", "busy", len(missing))
            return found
        self._reads += 1
        try:
            values = await asyncio.wait_for(self.shared.get(SHARED_NAMESPACE, missing),
                                            LOOKUP_SECONDS)
        except asyncio.TimeoutError:
            self.trouble.report("not_known", "slow", len(missing))
            return found
        except Unavailable as e:
            self.trouble.report("not_known", "unreachable", len(missing), str(e))
            return found
        except Exception as e:  # a state that failed otherwise: the blocks go as they are
            self.trouble.report("not_known", "error", len(missing), str(e))
            return found
        finally:
            self._reads -= 1
        for key, value in zip(missing, values, strict=True):
            if value is not None:
                backend, _, model = value.decode().partition("\0")
                self._remember(key, (backend, model))
                found[key] = (backend, model)
        return found

    async def drain(self, timeout: float) -> None:
        """Give the records still queued for the shared state ``timeout`` seconds to land."""
        if self._sharer is not None and not self._sharer.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._sharer), timeout)
            except asyncio.TimeoutError:
                self._sharer.cancel()

    # --- the threads ---

    def _read(self, keys: list[str]) -> dict[str, tuple[str, str]]:
        try:
            if self._read_db is None:
                self._read_db = self.connect()
            found: dict[str, tuple[str, str]] = {}
            for start in range(0, len(keys), 500):
                chunk = keys[start:start + 500]
                rows = self._read_db.execute(f"SELECT key, backend, model FROM issued WHERE key "
                                             f"IN ({','.join('?' * len(chunk))})", chunk)
                found.update((key, (backend, model)) for key, backend, model in rows)
            return found
        except Exception:
            self._drop_read_db()  # a file replaced or repaired meanwhile is opened afresh
            raise

    def _drop_read_db(self) -> None:
        if self._read_db is not None:
            self._read_db.close()
            self._read_db = None

    def _write_loop(self) -> None:
        db = None
        stop = False
        while not stop:
            items = [self._writes.get()]
            # What queued meanwhile goes in the same transaction.
            while items[-1] is not None and len(items) < WRITE_BATCH:
                try:
                    items.append(self._writes.get_nowait())
                except queue.Empty:
                    break
            stop = items[-1] is None
            entries = [entry for item in items if item is not None for entry in item]
            try:
                if entries:
                    if db is None:
                        db = self.connect()
                    with db:
                        db.execute("BEGIN")
                        db.executemany("INSERT OR REPLACE INTO issued (key, backend, model) "
                                       "VALUES (?, ?, ?)", entries)
                        db.execute("DELETE FROM issued WHERE rowid <= "
                                   "(SELECT MAX(rowid) FROM issued) - ?", (self.rows,))
            except Exception as e:  # sqlite3's own, or a value it could not take: the
                # thread goes on, or every later record would wait in a queue nobody reads
                self.trouble.report("not_recorded", reason_of(e), len(entries), str(e))
                if db is not None:
                    db.close()  # a file replaced or repaired meanwhile is opened afresh
                    db = None
            finally:
                for _ in items:
                    self._writes.task_done()
        if db is not None:
            db.close()

    def flush(self, timeout: float) -> bool:
        """Wait (in the calling thread) up to ``timeout`` seconds for queued writes to land;
        whether they did."""
        deadline = time.monotonic() + timeout
        with self._writes.all_tasks_done:
            while self._writes.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._writes.all_tasks_done.wait(left)
        return True

    def close(self, timeout: float = 0.0) -> None:
        """Stop the threads; writes still queued get ``timeout`` seconds to land."""
        if self._writer is not None:
            self.flush(timeout)
            try:
                self._writes.put_nowait(None)
            except queue.Full:
                pass  # the daemon thread dies with the process
            self._writer = None
        if self._reader is not None:
            self._reader.submit(self._drop_read_db)
            self._reader.shutdown(wait=False)
            self._reader = None


def thinking_blocks(messages: list, lo: int = 0, hi: int | None = None) -> list:
    """``(message, block, key)`` for each thinking block of an assistant message in
    ``messages[lo:hi]`` (the key as :func:`block_key` gives it)."""
    found = []
    for i in range(lo, len(messages) if hi is None else hi):
        message = messages[i]
        if type(message) is not dict or message.get("role") != "assistant":
            continue
        content = message.get("content")
        if type(content) is not list:
            continue
        for k, block in enumerate(content):
            if type(block) is dict and block.get("type") in THINKING:
                found.append((i, k, block_key(block)))
    return found


# The models with preserved thinking, as the API's docs list them (their prefix-checks page's
# supportedModels), on the Claude API and on the cloud platforms (``anthropic.`` and the like
# before the name, a version or ``@date`` after it).
PRESERVED_THINKING = re.compile(
    r"(?:^|[./:])claude-(?:fable-5-[12]|mythos-5-[12]|opus-5-5|sonnet-5-5|haiku-5-5)"
    r"(?![0-9])")


def preserved_thinking(model: str) -> bool:
    """Whether ``model`` is one the API checks thinking blocks for itself: "If the current
    model can't read a block, the API drops it from that request without an error", and a
    block whose prefix (``system``, ``tools``, the messages before it, another block left
    out among them) differs from the one it was made under fails the prefix check
    (platform.claude.com/docs/en/build-with-claude/preserved-thinking)."""
    return PRESERVED_THINKING.search(model) is not None


def verdict(key: str | None, issuers: dict, backend: str, model: str,
            scope: str) -> str | None:
    """Why the target would refuse the thinking block of this key, or None."""
    if key == "":
        # A target seen issuing unsigned thinking checks no signature on unsigned blocks (it
        # could not tell its own from others'); backends that sign nothing also want a tool
        # turn's thinking back (DeepSeek's thinking-mode guide), so dropping it is the fault.
        return None if unsigned_marker(backend, model, scope) in issuers else "unsigned"
    issuer = issuers.get(key) if key else None
    if issuer is None:
        return None
    if issuer[0] != backend:
        return f"issued by {issuer[0]}/{issuer[1]}"
    if scope == "model" and issuer[1] != model and not preserved_thinking(model):
        # Another model of the same backend: a model with preserved thinking drops a block
        # it cannot read itself, without an error, and keeps one it can (Fable 5.1 reads
        # Opus 5's and, on the Claude API, Opus 5.5's). Dropping it here would lose that
        # reasoning, and would change the prefix of the thinking the model then makes: a
        # record that forgets the issuer later (evicted, restarted, another replica) sends
        # the block again, and that thinking fails the prefix check (a 400, "The block is
        # bound to a different conversation", where the account enforces it).
        return f"issued by {issuer[0]}/{issuer[1]}"
    return None


def unsigned_marker(backend: str, model: str, scope: str) -> str:
    """The record's key for "this backend (with ``scope`` "model": this model of it) issued
    thinking with an empty signature"; no block's key looks like it (those are hex)."""
    return f"unsigned:{backend}" if scope == "backend" else f"unsigned:{backend}/{model}"


def unsigned_markers(backend: str, model: str) -> list[str]:
    """The markers one unsigned block from ``backend``'s ``model`` sets, for either scope."""
    return [unsigned_marker(backend, model, "backend"), unsigned_marker(backend, model, "model")]


def drop_blocks(messages: list, where: list[tuple[int, int, str]]) -> list[int]:
    """Remove the blocks at ``where``, in place, and any thinking block a removal left behind
    other content (the API wants a message's thinking first); a message left empty goes too
    (the API merges the neighbours it leaves, both the user's). Returns the indices of the
    messages removed, as they were."""
    by_message: dict[int, set[int]] = {}
    for i, k, _ in where:
        by_message.setdefault(i, set()).add(k)
    emptied = []
    for i, blocks in by_message.items():
        content = [b for k, b in enumerate(messages[i]["content"]) if k not in blocks]
        leading = 0
        while leading < len(content) and _is_thinking(content[leading]):
            leading += 1
        content = content[:leading] + [b for b in content[leading:] if not _is_thinking(b)]
        messages[i]["content"] = content
        if not content:
            emptied.append(i)
    for i in reversed(emptied):
        del messages[i]
    return emptied


def _is_thinking(block) -> bool:
    return type(block) is dict and block.get("type") in THINKING


def _role(message) -> str | None:
    return message.get("role") if type(message) is dict else None


def final_tool_turn_without_thinking(messages: list) -> int | None:
    """Where the final assistant turn starts, when that turn holds calls whose results follow
    and does not start with a thinking block; None otherwise (see :func:`final_tool_turn`)."""
    return final_tool_turn(messages)[0]


def _loop_step(messages: list, index: int) -> int | None:
    """Where a tool loop reaching back over ``messages[index - 1]`` goes on from: past an
    assistant message or a system entry, or past the whole user turn it is part of when that
    turn answers calls; None where the loop stops."""
    role = _role(messages[index - 1])
    if role == "assistant" or role == "system":
        return index - 1
    if role != "user":
        return None
    # The API combines consecutive user messages into one turn ("Consecutive user or
    # assistant turns in your request will be combined into a single turn"): a text in a
    # message of its own beside the results answers calls as much as the results do.
    first = index - 1
    while first > 0 and _role(messages[first - 1]) == "user":
        first -= 1
    return first if any(_answers_calls(message) for message in messages[first:index]) else None


def loop_reach(messages: list, index: int, known: tuple[int, int] | None = None) -> int:
    """How far back from ``index`` the messages go on a tool loop: the least ``reach`` such
    that every message in ``messages[reach:index]`` is an assistant message, a system entry
    or part of a user turn answering calls. ``known``: ``(at, reach)``, that value for index
    ``at`` (a session's previous request's, whose messages up to ``at`` are these), so that
    only what lies after it is walked."""
    while index > 0:
        if known is not None and known[1] < index <= known[0]:
            return known[1]  # every message from there to ``at`` goes on: so on down to it
        step = _loop_step(messages, index)
        if step is None:
            break
        index = step
    return index


def final_tool_turn(messages: list, known: tuple[int, int] | None = None
                    ) -> tuple[int | None, tuple[int, int] | None]:
    """:func:`final_tool_turn_without_thinking`, and what it found of the loop's reach as
    ``(index, reach)`` (None when it did not look that far), for :func:`loop_reach`;
    ``known`` as there.

    The API's assistant turn is the whole tool loop: it runs from the first assistant message
    after the last user message that answers no call, over the user messages of results in
    between ("tool use loops are part of the assistant turn", and without interleaved thinking
    "subsequent responses after tool results continue without new thinking blocks":
    https://platform.claude.com/docs/en/build-with-claude/extended-thinking, "Toggling thinking
    modes in conversations", "Interleaved thinking"). A user message holding a result counts
    as part of the loop, whatever else it holds."""
    end = len(messages) - 1
    while end >= 0 and _role(messages[end]) != "assistant":
        end -= 1
    if end < 0 or end == len(messages) - 1:
        return None, None  # no assistant turn, or a prefill: the model's own rules
    last = end  # the final assistant message group, whose calls the results answer
    while last > 0 and _role(messages[last - 1]) == "assistant":
        last -= 1
    if not any(type(b) is dict and b.get("type") == "tool_use"
               for m in messages[last:end + 1] if type(m.get("content")) is list
               for b in m["content"]):
        return None, None
    start = loop_reach(messages, last, known)
    found = (last, start)
    while _role(messages[start]) != "assistant":
        start += 1
    opening = start  # the turn's first assistant message group
    while opening <= end and _role(messages[opening]) == "assistant":
        opening += 1
    turn = [b for m in messages[start:opening] if type(m.get("content")) is list
            for b in m["content"] if not (type(b) is dict and b.get("type") in _NOT_SAMPLED)]
    return (None if turn and _is_thinking(turn[0]) else start), found


# Blocks an answer carries ahead of what the model wrote, which go back unchanged: a fallback
# block "not rendered into the prompt", the tool listing an MCP server returned, a compaction
# block standing for earlier messages (the SDK's BetaFallbackBlockParam,
# BetaMCPToolListingBlockParam, BetaCompactionBlockParam). A turn's thinking comes after them.
_NOT_SAMPLED = frozenset({"fallback", "mcp_tool_listing", "compaction"})


def _falls_back(messages: list, start: int) -> bool:
    """Whether an assistant message from ``start`` on holds a ``fallback`` block."""
    return any(_role(m) == "assistant" and type(m.get("content")) is list
               and any(type(b) is dict and b.get("type") == "fallback" for b in m["content"])
               for m in messages[start:])


def _answers_calls(message) -> bool:
    content = message.get("content") if _role(message) == "user" else None
    return type(content) is list and any(type(b) is dict and b.get("type") == "tool_result"
                                         for b in content)


# --- the plugin -----------------------------------------------------------------------------


def _without_thinking_edits(body: dict) -> None:
    """Drop the context-management edits that manage thinking (``clear_thinking_*``): with
    thinking off they have nothing to manage, and the API documents them for requests with
    thinking on. The other edits stay."""
    management = body.get("context_management")
    if type(management) is not dict:
        return
    edits = management.get("edits")
    if type(edits) is not list:
        return
    kept = [e for e in edits if not (type(e) is dict and str(e.get("type", "")).startswith(
        "clear_thinking"))]
    if len(kept) == len(edits):
        return
    if kept:
        management["edits"] = kept
    else:
        del body["context_management"]


def tool_turn_without_thinking(messages: list) -> int | None:
    """The first assistant message holding a call and no thinking block, or None."""
    for i, message in enumerate(messages):
        content = message.get("content") if _role(message) == "assistant" else None
        if type(content) is list \
                and any(type(b) is dict and b.get("type") == "tool_use" for b in content) \
                and not any(type(b) is dict and b.get("type") == "thinking" for b in content):
            return i
    return None


def _passed_back_off(exchange, messages: list, done: list, validating: bool) -> None:
    """For a backend that wants every tool turn's thinking back in thinking mode: a request
    with a tool turn that has none goes with thinking disabled. DeepSeek's thinking-mode
    guide (api-docs.deepseek.com/guides/thinking_mode): thinking is on unless `thinking:
    {"type": "disabled"}`, and "for turns that do perform tool calls, the reasoning_content
    must be fully passed back to the API in all subsequent requests", else 400 ("The
    `content[].thinking` in the thinking mode must be passed back to the API." from its
    /anthropic, NousResearch/hermes-agent#16748, #22313); with thinking disabled sent
    explicitly such histories go through (hermes-agent#15700, #21668). Nothing is invented
    in place of the missing thinking (a turn another backend made has none valid here)."""
    try:
        thinking = exchange.field("thinking")
    except ValueError:  # not JSON the relay can read (broken UTF-8): the backend's to judge
        return
    if thinking is not None and not (type(thinking) is dict
                                     and thinking.get("type") in ("enabled", "adaptive")):
        return  # disabled already, or a value that is the backend's to judge
    at = tool_turn_without_thinking(messages)
    if at is None:
        return
    if validating:
        done.append({"location": f"messages.{at}",
                     "message": f"messages.{at}: an assistant tool turn has no thinking block "
                                "and this backend wants every tool turn's thinking back: the "
                                "relay sends this request with thinking disabled"})
        return
    _thinking_switched_off(exchange, at, "a tool turn has no thinking block, and this backend "
                                         "wants every tool turn's thinking back in thinking mode")


def _thinking_switched_off(exchange, index: int, reason: str) -> None:
    """The request goes with thinking disabled, and without the edits that apply to thinking
    that is on; counted as a repair at message ``index``."""
    body = exchange.body
    body["thinking"] = {"type": "disabled"}
    _without_thinking_edits(body)
    exchange.repaired(PLUGIN, 1, rule="thinking-off", message_index=index, reason=reason)


def _checks_signatures(options: dict, backend) -> bool:
    if backend is not None and not backend.adapter.signs_thinking:
        return False
    return options.get("thinking_signatures", True) is not False


class _Saved:
    """What ``_fit`` saved at a mark for the session's next request: the ids translated
    before it (``changed``), the tool ids outside the grammar (``raw``), whether a thinking
    block came before it, every thinking block before it (``blocks``, as a chain of
    ``(earlier chain, chunk)`` pairs: a request adds its new turn's chunk to the one it
    resumed from rather than copying every block of the history), the foreign ones
    (``dropped``), the tool loop's reach there (``reach``, a one-item list filled in once
    the final turn was looked for, see :func:`loop_reach`), and how the blocks were judged:
    ``judged``, the provenance record, its version and what it had learnt then (None: not
    judged), and ``unknown``, the blocks whose issuer it did not know (a chain too)."""

    __slots__ = ("changed", "raw", "thinking", "blocks", "dropped", "reach", "judged",
                 "unknown")

    def __init__(self, changed: tuple = (), raw: frozenset = frozenset(), thinking=False,
                 blocks: tuple = (), dropped: tuple = (), reach: list | None = None,
                 judged: tuple | None = None, unknown: tuple = ()):
        self.changed, self.raw, self.thinking, self.blocks = changed, raw, thinking, blocks
        self.dropped, self.reach = dropped, reach if reach is not None else [None]
        self.judged, self.unknown = judged, unknown


_NOTHING_SAVED = _Saved()


class _Chain:
    """A chain of blocks (see :class:`_Saved`) extended by ``blocks`` (in message order) up
    to each mark in turn."""

    __slots__ = ("chain", "blocks", "taken")

    def __init__(self, chain: tuple, blocks: list | None):
        self.chain, self.blocks, self.taken = chain, blocks or (), 0

    def until(self, end: int) -> tuple:
        """The chain with the blocks before message ``end`` (marks come in order)."""
        blocks = self.blocks
        count = len(blocks)
        while count > self.taken and blocks[count - 1][0] >= end:
            count -= 1  # from the end: the marks are at the last messages
        if count > self.taken:
            self.chain = (self.chain, tuple(blocks[self.taken:count]))
            self.taken = count
        return self.chain


def _flatten(chain: tuple) -> list:
    """The blocks of a chain of ``(earlier chain, chunk)`` pairs, in order."""
    chunks = []
    while chain:
        chain, chunk = chain
        chunks.append(chunk)
    return [block for chunk in reversed(chunks) for block in chunk]


class _Walked:
    """What ``_fit`` walked of a request, and what it saves for the session's next one
    (:class:`relay.resume.Resume`, a :class:`_Saved` at each mark). Resumed, it walks only
    the messages from ``resume.start`` on and takes the rest from the state saved there;
    the thinking blocks before it are judged again only where their judgement may have
    changed since (see :meth:`to_judge`)."""

    __slots__ = ("resume", "start", "count", "before", "pieces", "_new", "_reaches",
                 "_judged", "_unknown")

    def __init__(self, resume, count: int):
        self.resume = resume
        self.count = count
        self.start = 0
        self.before: _Saved | None = None  # the state saved at start
        if resume is not None and resume.start:
            self.before = resume.state(PLUGIN)
            if self.before is None or not resume.seen(PLUGIN):
                resume.decline()  # the final turn's check reads what a later plugin changed
            self.start = resume.start
        self.pieces: list[tuple[int, list, bool, set]] = []  # (end, changed, thinking, raw)
        self._new: list | None = None  # the thinking blocks from start on
        self._reaches: dict[int, list] = {}  # each mark's reach, filled in by keep_reach
        self._judged: tuple | None = None  # the provenance record as it was when judging
        self._unknown: tuple = ()  # the chain of blocks of unknown issuer not judged again

    def translate(self, messages: list, pattern: str | None, holding: bool) -> list:
        ends = [m for m in self.resume.marks if m >= self.start] if self.resume else []
        at = self.start
        for end in [*ends, self.count]:
            thinking: list = []
            raw: set | None = set() if holding else None
            changed = translate_ids(messages, pattern, thinking, raw, at, end)
            self.pieces.append((end, changed, bool(thinking), raw or set()))
            at = end
        found = list(self.before.changed) if self.before else []
        for _, changed, _, _ in self.pieces:
            found += changed
        return found

    def raw(self) -> set:
        found = set(self.before.raw) if self.before else set()
        for *_, raw in self.pieces:
            found |= raw
        return found

    def thinking(self) -> bool:
        return bool(self.before and self.before.thinking) or any(p[2] for p in self.pieces)

    def to_judge(self, messages: list, provenance: Provenance) -> list:
        """The thinking blocks to judge, as :func:`thinking_blocks` gives them: every one;
        or, resumed from a request that judged its blocks and dropped none, against this
        provenance record when no issuer it knew had changed or been forgotten since, those
        before the resume point whose issuer was unknown then (the record may know it now,
        as a full walk would ask; not even those when the memory is the whole record and
        has learnt nothing since) and the new ones: the others' verdicts are the ones
        saved (None: their blocks went as sent)."""
        self._new = thinking_blocks(messages, self.start)
        # Taken before anything is read: a change while this request reads the record is one
        # its judgement may not have seen.
        self._judged = judged = (provenance, provenance.version, provenance.added,
                                 not provenance.path and provenance.shared is None)
        before = self.before
        if before is None or not before.blocks:
            return self._new
        if before.judged is not None and before.judged[:2] == judged[:2] \
                and not before.dropped:
            if before.judged == judged and judged[3]:
                self._unknown = before.unknown
                return self._new
            return _flatten(before.unknown) + self._new
        return _flatten(before.blocks) + self._new

    def check_dropped(self, foreign: list) -> None:
        if self.before is not None and [f for f in foreign if f[0] < self.start] \
                != list(self.before.dropped):
            self.resume.decline()

    def new(self, foreign: list) -> list:
        """The blocks to drop now: those before the resume point went already."""
        return [f for f in foreign if f[0] >= self.start]

    def save(self, foreign: list, unknown: list | None = None) -> None:
        """Keep the state at each mark; ``unknown``: the blocks judged, of unknown issuer
        (None: no block was judged)."""
        resume = self.resume
        if resume is None:
            return
        before = self.before or _NOTHING_SAVED
        changed, raw, thinking = list(before.changed), set(before.raw), before.thinking
        # The marks' chains share their blocks up to the first mark (one copy, not one a mark).
        blocks, unknowns = _Chain(before.blocks, self._new), _Chain(self._unknown, unknown)
        for end, piece, seen, more in self.pieces:
            if end == self.count and end not in resume.marks:
                break
            changed += piece
            raw |= more
            thinking = thinking or seen
            dropped = tuple(f for f in foreign if f[0] < end)
            reach = self._reaches[end] = [None]
            resume.save(PLUGIN, end, _Saved(
                tuple(changed), frozenset(raw), thinking,
                blocks.until(end) if thinking else before.blocks, dropped, reach,
                self._judged if unknown is not None else None, unknowns.until(end)),
                bool(changed or dropped))

    def known_reach(self) -> tuple[int, int] | None:
        """The tool loop's reach at the resume point, as the previous request found it."""
        reach = self.before.reach[0] if self.before is not None else None
        return (self.start, reach) if reach is not None else None

    def keep_reach(self, messages: list, found: tuple[int, int] | None) -> None:
        """Save the tool loop's reach at each mark (``found``: one the final turn's search
        found, else the one at the resume point), walking only the messages after it."""
        basis = found or self.known_reach()
        if basis is None:
            return  # nobody looked that far: the next request looks for itself
        if len(messages) != self.count:
            # A message dropped whole (its only block another issuer's thinking): the marks
            # count the client's messages, which these no longer are.
            return
        for end, holder in self._reaches.items():
            holder[0] = loop_reach(messages, end, basis)


class Portable:
    """The hooks; one instance per running relay, holding the provenance record."""

    OPTIONS = OPTIONS
    # The request walk goes on from where the session's previous request ended
    # (relay.resume).
    RESUMABLE = True

    def __init__(self):
        self.provenance = Provenance()
        self.recording = True  # until relay_startup knows the backends
        # Without a record to keep: the backends' models whose thinking was seen, signed or not.
        self.learnt: set[tuple[str, str]] = set()

    @hookimpl
    def relay_startup(self, config, options, state):
        self.provenance.close()
        path = options.get("provenance_db") or ""
        provenance = Provenance(path, options.get("provenance_rows") or 100000, state)
        if path:
            # Once, before the first request: a directory that is missing or a file that is
            # no database is the operator's to fix, not a warning per request later.
            provenance.check(f"plugins.{PLUGIN}.provenance_db")
        self.provenance = provenance
        # Who issued a thinking block matters only where there is another backend to carry it
        # to, now or after a restart with another configuration (a record kept on disk): else
        # recording would cost every thinking stream its deltas' framing for nothing (all but
        # whether a backend signs its thinking at all: see _reads_thinking).
        self.recording = len(config.backends) > 1 or bool(path) or provenance.shared is not None
        self.learnt = set()

    def _reads_thinking(self, exchange) -> bool:
        """Whether an answer's thinking is read: always where the record is kept; else until
        its backend's model has been seen signing it or not. Even a lone backend must be
        learnt issuing unsigned thinking, or that thinking is dropped on its way back to it."""
        if self.recording:
            return True
        backend = exchange.backend.name if exchange.backend is not None else ""
        return (backend, exchange.model or "") not in self.learnt

    @hookimpl
    async def relay_shutdown(self):
        # The records still queued get a moment to land (before the host closes the state),
        # waited for off the loop.
        await self.provenance.drain(SHUTDOWN_SECONDS)
        await asyncio.get_running_loop().run_in_executor(None, self.provenance.close,
                                                         SHUTDOWN_SECONDS)

    def _fit(self, exchange, options: dict, validating: bool = False):
        """Make the history fit the exchange's backend, in place. ``validating``: also return
        what was done, as validate reports it, and only report a request that would go with
        thinking off (validate writes back the messages alone). Returns that list, or an
        awaitable of it when the record must be read from disk first."""
        messages = exchange.messages
        if messages is None:
            return []
        if exchange.resume is None and not skeleton.has_blocks(messages):
            return []  # no id to translate, no thinking block, no tool turn
        resume = None if validating or exchange.resume is None \
            else exchange.resume.usable(messages)
        walked = _Walked(resume, len(messages))
        backend = exchange.backend
        done = []
        pattern = target_pattern(options, backend)
        raw: set[str] | None = set() if exchange.endpoint == "messages" and not validating else None
        changed = walked.translate(messages, pattern, raw is not None)
        if raw is not None:
            raw.update(walked.raw())
        if raw is not None and pattern == ANTHROPIC_IDS:
            raw.update(client_id for _, _, kind, client_id, _ in changed
                       if kind == "tool_use" and decode_id(client_id) is None)
        if raw:
            exchange.state[RAW_IDS] = raw
        if changed:
            exchange.mark_changed()
            tool_uses = 0
            for i, _, kind, client_id, upstream_id in changed:
                if kind == "tool_use":
                    tool_uses += 1
                    exchange.translation.setdefault(upstream_id, {
                        "original": client_id, "message_index": i, "direction": "to_upstream",
                        "reason": "decoded" if decode_id(client_id) else "id grammar"})
            _count(exchange, tool_uses)
            exchange.note(PLUGIN, "translated ids", direction="to_upstream", pattern=pattern,
                          ids=sorted({(client_id, upstream_id)
                                      for *_, client_id, upstream_id in changed}))
            if validating:
                done += [{"location": f"messages.{i}.content.{k}",
                          "message": f"messages.{i}.content.{k}.{kind}: id {client_id} "
                                     + (f"does not fit '{pattern}': "
                                        if decode_id(client_id) is None
                                        else "is the relay's encoding: ")
                                     + f"sent as {upstream_id}"}
                         for i, k, kind, client_id, upstream_id in changed]
        if not _checks_signatures(options, backend):
            walked.save([])
            if options.get("thinking_passed_back"):
                _passed_back_off(exchange, messages, done, validating)
            return done
        if not walked.thinking():
            # No thinking block to judge, none to drop; the final turn may still lack one.
            walked.save([])
            return self._thinking_off(exchange, options, done, validating, [], set(), walked)
        blocks = walked.to_judge(messages, self.provenance)
        keys = [key for _, _, key in blocks if key]
        if len(keys) < len(blocks) and any(key == "" for _, _, key in blocks):
            keys.append(unsigned_marker(backend.name if backend is not None else "",
                                        exchange.model or "",
                                        options.get("thinking_scope") or "model"))
        issuers, missing = self.provenance.known(keys)
        if missing:
            return self._judge_after_reading(exchange, options, done, validating, keys, walked,
                                             blocks)
        return self._judge(exchange, options, done, validating, issuers, walked, blocks)

    async def _judge_after_reading(self, exchange, options, done, validating, keys, walked,
                                   blocks):
        # Without the record (locked, slow, broken) nothing more is known: those blocks go
        # as the client sent them.
        issuers = await self.provenance.lookup(keys)
        return self._judge(exchange, options, done, validating, issuers, walked, blocks)

    def _judge(self, exchange, options: dict, done: list, validating: bool,
               issuers: dict, walked: _Walked, blocks: list) -> list[dict]:
        messages = exchange.messages
        backend = exchange.backend
        name = backend.name if backend is not None else ""
        model, scope = exchange.model or "", options.get("thinking_scope") or "model"
        foreign = [(i, k, why) for i, k, why in (
            (i, k, verdict(key, issuers, name, model, scope)) for i, k, key in blocks)
            if why is not None]
        # Those before the resume point were dropped when they were first judged, and are
        # judged the same now, or this request is walked whole (a resumed request judges
        # again only those whose verdict may have changed, none of them dropped).
        walked.check_dropped(foreign)
        walked.save(foreign, [block for block in blocks if block[2] and block[2] not in issuers])
        touched: set = set()
        if foreign:
            done += [{"location": f"messages.{i}.content.{k}",
                      "message": f"messages.{i}.content.{k}: thinking block {why}: dropped"}
                     for i, k, why in foreign]
            touched = {id(messages[i]) for i, _, _ in foreign}
            removed = drop_blocks(messages, walked.new(foreign))
            exchange.repaired(PLUGIN, len(foreign), rule="foreign-thinking",
                              blocks=[f"messages.{i}.content.{k}" for i, k, _ in foreign],
                              reasons=sorted({why for *_, why in foreign}),
                              removed_messages=removed)
        return self._thinking_off(exchange, options, done, validating, foreign, touched,
                                  walked)

    def _thinking_off(self, exchange, options: dict, done: list, validating: bool,
                      foreign: list, touched: set, walked: _Walked) -> list[dict]:
        """With thinking enabled, a final assistant tool turn that has no thinking block valid
        here is refused by the API: that request goes with thinking disabled. So does, for a
        backend with ``thinking_passed_back``, a request with any tool turn lacking thinking."""
        messages = exchange.messages
        try:
            thinking = exchange.field("thinking")
        except ValueError:  # not JSON the relay can read: the backend's to judge, as it is
            thinking = None
        mode = thinking.get("type") if type(thinking) is dict else None
        # The final turn reaches back over the whole tool loop: looked for only when thinking
        # is on, the one case where it can matter, and, in a session's request resumed from
        # the previous one, only as far back as the resume point (the loop's reach there is
        # the previous request's).
        final = None
        if mode in ("enabled", "adaptive"):
            final, found = final_tool_turn(messages, walked.known_reach())
            walked.keep_reach(messages, found)
        if mode == "adaptive" and final is not None and foreign \
                and id(messages[final]) in touched:
            # The API's rule is on record for budgeted thinking; with adaptive thinking the
            # model may skip thinking in a turn, and whether such a turn is accepted is not:
            # the request goes as it is, noted.
            exchange.unsure(PLUGIN, f"messages.{final}",
                            "adaptive thinking, and the final tool turn's thinking was "
                            "another issuer's: sent without it")
        if mode != "enabled":
            final = None
        elif final is not None and id(messages[final]) not in touched \
                and (exchange.rules_defer or _falls_back(messages, final)):
            # Betas that reshape histories (relay.betas: compaction, inline tools, thinking
            # binding controls, ...), or a turn another model took over mid-output (what it
            # kept of the declined model's part is the fallback guide's echo rule): the API
            # judges what the client sent.
            why = betas.described(exchange.rules_defer) if exchange.rules_defer \
                else "a fallback block in the turn"
            exchange.unsure(PLUGIN, f"messages.{final}",
                            f"thinking is on and the final tool turn does not open with "
                            f"thinking, with {why}: sent as it is")
            final = None
        if final is not None and validating:
            done.append({"location": f"messages.{final}",
                         "message": f"messages.{final}: the final assistant tool turn has no "
                                    "thinking block valid here: the relay sends this request "
                                    "with thinking disabled"})
        elif final is not None:
            _thinking_switched_off(exchange, final, "the final assistant turn has no thinking "
                                                    "block of this backend's")
        if final is None and options.get("thinking_passed_back"):
            _passed_back_off(exchange, messages, done, validating)
        return done

    @hookimpl
    def relay_request(self, exchange, options):
        messages = exchange.messages
        if messages is None or exchange.resume is None and not skeleton.has_blocks(messages):
            return None  # what _fit would find: nothing to fit
        fitted = self._fit(exchange, options)
        return None if type(fitted) is list else fitted

    @hookimpl
    def relay_validate(self, exchange, options, repair):
        if exchange.backend is None:
            return None  # without --target, no backend to fit
        fitted = self._fit(exchange, options, validating=True)
        if type(fitted) is list:
            return _validated(fitted, repair)

        async def after_reading():
            return _validated(await fitted, repair)
        return after_reading()

    # --- answers: ids the client can send back, and who issued each thinking block ------

    def _record(self, exchange, blocks) -> None:
        backend = exchange.backend.name if exchange.backend is not None else ""
        model = exchange.model or ""
        keys = [block_key(block) for block in blocks]
        entries = [(key, backend, model) for key in keys if key] if self.recording else []
        if not self.recording and any(key is not None for key in keys) \
                and len(self.learnt) < MAX_LEARNT:
            self.learnt.add((backend, model))  # nothing more to learn of it
        if "" in keys:
            memory, issuer = self.provenance.memory, (backend, model)
            for marker in unsigned_markers(backend, model):
                if memory.get(marker) == issuer:
                    memory.move_to_end(marker)  # kept while the backend keeps issuing them
                else:
                    entries.append((marker, backend, model))
        self.provenance.record(entries)

    @hookimpl
    def relay_response(self, exchange, response):
        if exchange.endpoint != "messages":
            return
        body = response.body
        # bytes.find rather than `in`, here and below: `in` tries its operand as an integer
        # first, and raising and clearing that TypeError costs more than the search.
        calls = body.find(b"tool_use") >= 0
        thinks = self._reads_thinking(exchange) and body.find(b"thinking") >= 0
        if not (calls or thinks):
            return
        data = response.data
        content = data.get("content") if type(data) is dict else None
        if type(content) is not list:
            return
        if calls:
            held = exchange.state.get(RAW_IDS, ())
            pairs = [pair for pair in (_to_client(block, held) for block in content) if pair]
            if pairs:
                response.mark_changed()
                _count(exchange, len(pairs))
                _note_to_client(exchange, pairs)
        if thinks:
            # Whether or not the request asked for thinking: some backends think unasked.
            self._record(exchange, [b for b in content if _is_thinking(b)])

    @hookimpl
    def relay_stream_events(self, exchange):
        # Every tool_use id is seen at its block's start, and so is every thinking block,
        # asked for or not (some backends think unasked): only then are the deltas framed
        # that carry its signature, so a stream without thinking costs no more than that.
        return BLOCK_STARTS if exchange.endpoint == "messages" else None

    @hookimpl
    def relay_stream_event(self, exchange, event):
        name = event.name
        if name == "content_block_delta":
            open_blocks = exchange.state.get(PLUGIN)
            if not open_blocks or event.raw.find(b"signature_delta") < 0:
                return
            data = event.data
            block = open_blocks.get(data.get("index")) if type(data) is dict else None
            delta = data.get("delta") if block is not None else None
            if type(delta) is dict and type(delta.get("signature")) is str:
                block["signature"] = (block.get("signature") or "") + delta["signature"]
        elif name == "content_block_start":
            raw = event.raw
            if raw.find(b"tool_use") < 0 and raw.find(b"thinking") < 0:
                return
            data = event.data
            block = data.get("content_block") if type(data) is dict else None
            if type(block) is not dict:
                return
            kind = block.get("type")
            if kind == "tool_use":
                pair = _to_client(block, exchange.state.get(RAW_IDS, ()))
                if pair:
                    event.mark_changed()
                    _note_to_client(exchange, [pair], index=data.get("index"))
            elif not self._reads_thinking(exchange):
                return
            elif kind == "redacted_thinking":
                self._record(exchange, [block])
            elif kind == "thinking":
                open_blocks = exchange.state.get(PLUGIN)
                if open_blocks is None:
                    open_blocks = exchange.state[PLUGIN] = {}
                    open_blocks[data.get("index")] = dict(block)
                    return THINKING_EVENTS  # asked for once per stream
                open_blocks[data.get("index")] = dict(block)
        elif name == "content_block_stop":
            open_blocks = exchange.state.get(PLUGIN)
            if not open_blocks:
                return
            data = event.data
            block = open_blocks.pop(data.get("index"), None) if type(data) is dict else None
            if block is not None:
                self._record(exchange, [block])

    @hookimpl
    def relay_exchange_end(self, exchange):
        # What the record missed since the last exchange ended (writes land later, in their
        # own thread) goes on this one's timeline, where the metrics plugin counts it.
        trouble = self.provenance.trouble
        if trouble.pending:
            exchange.note(PLUGIN, "provenance missed", counts=[
                {"result": what, "reason": reason, "count": count}
                for (what, reason), count in sorted(trouble.drain().items())])


MAX_LEARNT = 1024  # backends' models learnt without a record (the client names the models)
SHUTDOWN_SECONDS = 5.0  # how long stopping waits for the records still queued
BLOCK_STARTS = frozenset({"content_block_start"})
THINKING_EVENTS = ("content_block_delta", "content_block_stop")  # a thinking block's signature


def _validated(done: list[dict], repair: bool) -> list[dict]:
    return [p for p in done if "thinking disabled" in p["message"]] if repair else done


def _count(exchange, rewritten: int) -> None:
    """``x-relay-rewrites`` counts the tool ids rewritten, by any plugin, both ways."""
    headers = exchange.response_headers
    headers["x-relay-rewrites"] = str(int(headers.get("x-relay-rewrites", 0)) + rewritten)


def _to_client(block, held) -> tuple[str, str] | None:
    """Give a tool_use block a backend minted outside Anthropic's grammar the encoded form of
    its id, in place: every Anthropic-format client can send that back as it got it (clients
    that "sanitise" ids otherwise turn ``functions.Bash:0`` into ``functions_Bash_0``, which
    no backend issued and which defeats dedup's check for a repeated id). Returns
    ``(minted, encoded)`` when the id changed.

    An id the client already holds as minted (``held``: a transcript from before the relay
    translated answers) stays as it is, for dedup to rename the repeat: encoded, it would be
    a new id to dedup, and the two would go up to a backend as one."""
    if type(block) is not dict or block.get("type") != "tool_use":
        return None
    minted = block.get("id")
    if type(minted) is not str or not minted or minted in held:
        return None
    encoded = client_form(minted)
    if encoded == minted:
        return None
    block["id"] = encoded
    return minted, encoded


def client_form(minted: str) -> str:
    """The id a client gets for one a backend minted: itself when it fits Anthropic's
    grammar, else its encoding."""
    # Remembered for ids of ordinary length, like id_for's answers.
    return _client_id(minted) if len(minted) <= 128 else _encoded_unless_fitting(minted)


@functools.lru_cache(maxsize=8192)
def _client_id(minted: str) -> str:
    return _encoded_unless_fitting(minted)


def _encoded_unless_fitting(minted: str) -> str:
    return minted if _grammar(ANTHROPIC_IDS).fullmatch(minted) else encode_id(minted)


def _note_to_client(exchange, pairs: list[tuple[str, str]], **detail) -> None:
    for minted, encoded in pairs:
        exchange.translation[encoded] = {"original": minted, "message_index": None,
                                         "direction": "to_client", "reason": "id grammar"}
    exchange.note(PLUGIN, "translated ids", direction="to_client", pattern=ANTHROPIC_IDS,
                  ids=pairs, **detail)
