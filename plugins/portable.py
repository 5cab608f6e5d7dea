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
  back to the original. Answers need nothing: a backend only mints new ids.
- **Thinking.** Each thinking (and redacted_thinking) block's issuer, backend and model, is
  recorded when its answer passes through, keyed by a hash of its signature (the client's
  transcript is never touched: it stays valid for talking to that backend directly). On the
  way up, a block known to come from another issuer, or unsigned (an OpenAI-format backend's
  reasoning: only the issuer can sign), is dropped: the API does not require thinking from
  earlier turns. A block of unknown issuer goes up as it is, so the relay never alters what
  it cannot judge. When thinking is on with a budget (``type: enabled``) and the final
  assistant turn, calls whose results follow, does not start with a thinking block (the API
  refuses that: "When `thinking` is enabled, a final `assistant` message must start with a
  thinking block"), that one request goes up with ``thinking: {"type": "disabled"}`` and
  without the ``clear_thinking_*`` context-management edits (they apply to thinking that is
  on): the model answers without extended thinking this once. With adaptive thinking that
  rule is not on record, so the request keeps its thinking, noted ``unsure``. Every drop and
  that switch are counted in ``x-relay-repairs`` and noted on the timeline; id translations
  are counted in ``x-relay-rewrites``.

The record is bounded (``provenance_rows``) and lives in process memory, or in a SQLite file
(``provenance_db``) that survives a restart and is shared by every worker and replica on the
same host. A replica that has no record of a block sends it as it is.

Options (plugin options or backend quirks): see ``OPTIONS``.
"""

from __future__ import annotations

import base64
import binascii
import collections
import functools
import hashlib
import logging
import os
import re
import sqlite3

from relay import skeleton
from relay.hookspecs import hookimpl
from relay.options import Option

PLUGIN = "portable"
THINKING_ASKED = "portable.thinking"  # exchange.state: whether the request asked for thinking
ANTHROPIC_IDS = "^[a-zA-Z0-9_-]+$"
PREFIX = "relayid_"
THINKING = ("thinking", "redacted_thinking")
log = logging.getLogger("relay.portable")


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
    Option("provenance_db", str, "",
           "the SQLite file recording which backend and model issued each thinking block; "
           "empty: process memory only (lost on restart, not shared between workers)"),
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
    return None if backend is not None and backend.format == "openai" else ANTHROPIC_IDS


def translate_ids(messages: list, pattern: str | None,
                  thinking: list | None = None) -> list[tuple[int, int, str, str, str]]:
    """Rewrite, in place, every tool_use id and tool_result tool_use_id that does not fit
    ``pattern``; return ``(message, block, block type, client id, upstream id)`` for each
    change. ``thinking``, when given, gets True appended if any block is a thinking block
    (the walk that follows is then worth taking)."""
    changed = []
    for i, message in enumerate(messages):
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
            if type(client_id) is not str:
                continue
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
    if field is None:
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


class Provenance:
    """Which backend and model issued each thinking block, bounded to ``rows`` entries."""

    def __init__(self, path: str = "", rows: int = 100000):
        self.path = path
        self.rows = rows
        self.memory: collections.OrderedDict[str, tuple[str, str]] = collections.OrderedDict()
        self._db = None
        self._pid = None

    def _connection(self):
        # A forked worker needs a connection of its own: SQLite's may not cross a fork.
        if self._db is None or self._pid != os.getpid():
            db = sqlite3.connect(self.path, isolation_level=None, timeout=5)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("CREATE TABLE IF NOT EXISTS issued (key TEXT PRIMARY KEY, "
                       "backend TEXT NOT NULL, model TEXT NOT NULL)")
            self._db, self._pid = db, os.getpid()
        return self._db

    def record(self, entries: list[tuple[str, str, str]]) -> None:
        if not entries:
            return
        if not self.path:
            for key, backend, model in entries:
                self.memory.pop(key, None)
                self.memory[key] = (backend, model)
            while len(self.memory) > self.rows:
                self.memory.popitem(last=False)
            return
        db = self._connection()
        with db:
            db.execute("BEGIN")
            db.executemany("INSERT OR REPLACE INTO issued (key, backend, model) VALUES (?, ?, ?)",
                           entries)
            db.execute("DELETE FROM issued WHERE rowid <= (SELECT MAX(rowid) FROM issued) - ?",
                       (self.rows,))

    def lookup(self, keys) -> dict[str, tuple[str, str]]:
        keys = list(dict.fromkeys(keys))
        if not self.path:
            return {key: self.memory[key] for key in keys if key in self.memory}
        found = {}
        db = self._connection()
        for start in range(0, len(keys), 500):
            chunk = keys[start:start + 500]
            rows = db.execute(f"SELECT key, backend, model FROM issued WHERE key IN "
                              f"({','.join('?' * len(chunk))})", chunk)
            found.update((key, (backend, model)) for key, backend, model in rows)
        return found

    def close(self) -> None:
        if self._db is not None and self._pid == os.getpid():
            self._db.close()
        self._db = None


def foreign_thinking(messages: list, issuers: dict, backend: str, model: str,
                     scope: str) -> list[tuple[int, int, str]]:
    """``(message, block, why)`` for each thinking block the target would refuse: unsigned,
    or issued by another backend (or, with ``scope`` "model", another model)."""
    found = []
    for i, message in enumerate(messages):
        if type(message) is not dict or message.get("role") != "assistant":
            continue
        content = message.get("content")
        if type(content) is not list:
            continue
        for k, block in enumerate(content):
            if type(block) is not dict or block.get("type") not in THINKING:
                continue
            key = block_key(block)
            if key == "":
                found.append((i, k, "unsigned"))
                continue
            issuer = issuers.get(key) if key else None
            if issuer is None:
                continue
            if issuer[0] != backend or (scope == "model" and issuer[1] != model):
                found.append((i, k, f"issued by {issuer[0]}/{issuer[1]}"))
    return found


def keys_in(messages: list) -> list[str]:
    keys = []
    for message in messages:
        if type(message) is dict and message.get("role") == "assistant":
            content = message.get("content")
            if type(content) is list:
                for block in content:
                    if type(block) is dict and block.get("type") in THINKING:
                        key = block_key(block)
                        if key:
                            keys.append(key)
    return keys


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
    """Where the final assistant turn starts, when that turn (consecutive assistant messages
    are one turn to the API) holds calls whose results follow and does not start with a
    thinking block; None otherwise."""
    end = len(messages) - 1
    while end >= 0 and _role(messages[end]) != "assistant":
        end -= 1
    if end < 0 or end == len(messages) - 1:
        return None  # no assistant turn, or a prefill: the model's own rules
    start = end
    while start > 0 and _role(messages[start - 1]) == "assistant":
        start -= 1
    turn = [b for m in messages[start:end + 1] if type(m.get("content")) is list
            for b in m["content"]]
    if not any(type(b) is dict and b.get("type") == "tool_use" for b in turn):
        return None
    return None if _is_thinking(turn[0]) else start


# --- the plugin -----------------------------------------------------------------------------


def _without_thinking_edits(body: dict) -> None:
    """Drop the context-management edits that manage thinking (``clear_thinking_*``): with
    thinking off they have nothing to manage, and the API documents them for requests with
    thinking on. The other edits stay."""
    management = body.get("context_management")
    edits = management.get("edits") if type(management) is dict else None
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


def _checks_signatures(options: dict, backend) -> bool:
    if backend is not None and backend.format == "openai":
        return False
    return options.get("thinking_signatures", True) is not False


class Portable:
    """The hooks; one instance per running relay, holding the provenance record."""

    OPTIONS = OPTIONS

    def __init__(self):
        self.provenance = Provenance()
        self.recording = True  # until relay_startup knows the backends

    @hookimpl
    def relay_startup(self, config, options):
        self.provenance.close()
        self.provenance = Provenance(options.get("provenance_db") or "",
                                     options.get("provenance_rows") or 100000)
        # Who issued a thinking block matters only where there is another backend to carry it
        # to, now or after a restart with another configuration (a record kept on disk): else
        # recording would cost every thinking stream its deltas' framing for nothing.
        self.recording = len(config.backends) > 1 or bool(options.get("provenance_db"))

    @hookimpl
    def relay_shutdown(self):
        self.provenance.close()

    def _fit(self, exchange, options: dict, validating: bool = False) -> list[dict]:
        """Make the history fit the exchange's backend, in place. ``validating``: also return
        what was done, as validate reports it, and only report a request that would go with
        thinking off (validate writes back the messages alone)."""
        messages = exchange.messages
        if messages is None:
            return []
        backend = exchange.backend
        done = []
        pattern = target_pattern(options, backend)
        thinking_blocks: list = []
        changed = translate_ids(messages, pattern, thinking_blocks)
        if changed:
            exchange.mark_changed()
            tool_uses = 0
            for i, _, kind, client_id, upstream_id in changed:
                if kind == "tool_use":
                    tool_uses += 1
                    exchange.translation.setdefault(upstream_id, {
                        "original": client_id, "message_index": i, "direction": "to_upstream",
                        "reason": "decoded" if decode_id(client_id) else "id grammar"})
            headers = exchange.response_headers
            headers["x-relay-rewrites"] = str(int(headers.get("x-relay-rewrites", 0)) + tool_uses)
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
            return done
        if not thinking_blocks:
            # No thinking block to judge, none to drop; the final turn may still lack one.
            return self._thinking_off(exchange, messages, done, validating, [], set())
        keys = keys_in(messages)
        try:
            issuers = self.provenance.lookup(keys) if keys else {}
        except sqlite3.Error:
            # Without the record nothing is known: every block goes as the client sent it.
            log.exception("could not read thinking provenance")
            issuers = {}
        name = backend.name if backend is not None else ""
        foreign = foreign_thinking(messages, issuers, name, exchange.model or "",
                                   options.get("thinking_scope") or "model")
        touched: set = set()
        if foreign:
            done += [{"location": f"messages.{i}.content.{k}",
                      "message": f"messages.{i}.content.{k}: thinking block {why}: dropped"}
                     for i, k, why in foreign]
            touched = {id(messages[i]) for i, _, _ in foreign}
            removed = drop_blocks(messages, foreign)
            exchange.repaired(PLUGIN, len(foreign), rule="foreign-thinking",
                              blocks=[f"messages.{i}.content.{k}" for i, k, _ in foreign],
                              reasons=sorted({why for *_, why in foreign}),
                              removed_messages=removed)
        return self._thinking_off(exchange, messages, done, validating, foreign, touched)

    def _thinking_off(self, exchange, messages: list, done: list, validating: bool,
                      foreign: list, touched: set) -> list[dict]:
        """With thinking enabled, a final assistant tool turn that has no thinking block valid
        here is refused by the API: that request goes with thinking disabled."""
        final = final_tool_turn_without_thinking(messages)
        thinking = exchange.field("thinking") if final is not None else None
        mode = thinking.get("type") if type(thinking) is dict else None
        if mode == "adaptive" and foreign and id(messages[final]) in touched:
            # The API's rule is on record for budgeted thinking; with adaptive thinking the
            # model may skip thinking in a turn, and whether such a turn is accepted is not:
            # the request goes as it is, noted.
            exchange.note(PLUGIN, "unsure", location=f"messages.{final}",
                          reason="adaptive thinking, and the final tool turn's thinking was "
                                 "another issuer's: sent without it")
        if mode != "enabled":
            final = None
        if final is not None and validating:
            done.append({"location": f"messages.{final}",
                         "message": f"messages.{final}: the final assistant tool turn has no "
                                    "thinking block valid here: the relay sends this request "
                                    "with thinking disabled"})
        elif final is not None:
            body = exchange.body
            body["thinking"] = {"type": "disabled"}
            _without_thinking_edits(body)
            exchange.repaired(PLUGIN, 1, rule="thinking-off", message_index=final,
                              reason="the final assistant turn has no thinking block of "
                                     "this backend's")
        return done

    @hookimpl
    def relay_request(self, exchange, options):
        # Read now, while the request's skeleton is at hand: the answer holds thinking blocks
        # to record only when the request asked for thinking.
        thinking = exchange.field("thinking")
        exchange.state[THINKING_ASKED] = type(thinking) is dict and thinking.get("type") not in (
            None, "disabled")
        self._fit(exchange, options)

    @hookimpl
    def relay_validate(self, exchange, options, repair):
        if exchange.backend is None:
            return None  # without --target, no backend to fit
        done = self._fit(exchange, options, validating=True)
        if repair:
            return [p for p in done if "thinking disabled" in p["message"]]
        return done

    # --- answers: who issued each block --------------------------------------------------

    def _record(self, exchange, blocks) -> None:
        backend = exchange.backend.name if exchange.backend is not None else ""
        entries = [(key, backend, exchange.model or "") for key in map(block_key, blocks) if key]
        try:
            self.provenance.record(entries)
        except sqlite3.Error:
            log.exception("could not record thinking provenance")

    @hookimpl
    def relay_response(self, exchange, response):
        if (exchange.endpoint != "messages" or not self.recording
                or b"thinking" not in response.body):
            return
        data = response.data
        content = data.get("content") if type(data) is dict else None
        if type(content) is list:
            self._record(exchange, [b for b in content if _is_thinking(b)])

    @hookimpl
    def relay_stream_events(self, exchange):
        if (exchange.endpoint != "messages" or not self.recording
                or not exchange.state.get(THINKING_ASKED, True)):
            return None  # nothing to record: no delta framed
        return {"content_block_start", "content_block_delta", "content_block_stop"}

    @hookimpl
    def relay_stream_event(self, exchange, event):
        raw = event.raw
        name = event.name
        if name == "content_block_start":
            if b"thinking" not in raw:
                return
            data = event.data
            block = data.get("content_block") if type(data) is dict else None
            if type(block) is not dict:
                return
            if block.get("type") == "redacted_thinking":
                self._record(exchange, [block])
            elif block.get("type") == "thinking":
                exchange.state.setdefault(PLUGIN, {})[data.get("index")] = dict(block)
        elif name == "content_block_delta":
            if b"signature_delta" not in raw:
                return
            data = event.data
            open_blocks = exchange.state.get(PLUGIN) or {}
            block = open_blocks.get(data.get("index")) if type(data) is dict else None
            delta = data.get("delta") if block is not None else None
            if type(delta) is dict and type(delta.get("signature")) is str:
                block["signature"] = (block.get("signature") or "") + delta["signature"]
        elif name == "content_block_stop":
            open_blocks = exchange.state.get(PLUGIN)
            if not open_blocks:
                return
            data = event.data
            block = open_blocks.pop(data.get("index"), None) if type(data) is dict else None
            if block is not None:
                self._record(exchange, [block])
