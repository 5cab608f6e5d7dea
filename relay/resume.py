"""Resuming a request where the session's previous one ended: the request path costs
O(new turn), not O(history).

A coding agent sends its whole conversation every turn, and each request's ``messages`` are
byte for byte the previous request's up to its last message or two (where the client moves
its ``cache_control`` marker). So, after the request chain, the relay keeps a :class:`Record`
per session (:meth:`relay.exchange.Exchange.session`): the client's bytes, the messages as
the chain left them, and each plugin's state at the last few message boundaries
(:data:`MARKS`). The session's next request is compared with those bytes (never trusted
from a header): when it starts with the bytes of the previous request's first ``k``
messages, for the largest such ``k`` kept, only the rest is decoded (the fields before
``messages`` are the same bytes, so they are taken from the record), the request's messages
are the record's first ``k`` and the new ones, and each plugin goes on from its state at
``k`` (:class:`Resume`, ``exchange.resume``). The result is the full walk's, byte for byte.

Every plugin with a ``relay_request`` hook must opt in (``RESUMABLE = True``, see
:func:`relay.hookspecs.relay_request`); with one that does not, every request is walked
whole, as before. A record is kept only for a ``/v1/messages`` request without a thread
whose body stayed a skeleton (nobody asked for ``exchange.body``) and whose messages the
plugins neither merged nor dropped, and it is used only by a request for the same backend,
model and inbound key, with the same deferrals of the history rules. What it cannot use (an
edited history, other bytes, an evicted record) costs a full walk and makes a new record.

Memory: the records are bounded in bytes (``server.resume_bytes``, a quarter of it at most
per session) and evicted oldest first; a record holds the previous request's body, the
buffers its messages' values were decoded from (the body of the full walk the session's
record started from, and each resumed request's new turn: the messages before the boundary
are the earlier request's values, and their bytes stay with them) and the plugins' states.
"""

from __future__ import annotations

import collections
import itertools
from typing import Any

import msgspec

from . import skeleton

# The boundaries kept per request: before its last two messages, before its last one, after
# all of it (Claude Code moves its marker over the last message or two).
MARKS = 3
_MESSAGES_KEY = b'"messages":['
_MESSAGES_NAME = b'"messages"'
# What a record costs beyond the body it keeps, roughly, per message and per block (the
# dicts, lists and Raw values of the skeleton), for the byte budget.
MESSAGE_BYTES = 400
BLOCK_BYTES = 300
MAX_SEEN = 4096  # sessions remembered as seen (a digest each: about 0.5 MB at most)
LANES = 4  # conversations kept per session
MIN_BYTES = 32 * 1024  # smaller requests cost less walked whole than resumed
# The bytes a request without a session id is looked up by (see Store.take_unnamed), and
# the sessions compared at most for one lookup (the newest that began with those bytes).
HEAD_BYTES = 512
HEAD_SESSIONS = 8
# The most a record copies of its request's body after the part it shares with the body the
# record started from (see Record): past that, the record keeps the whole body instead.
TAIL_BYTES = 256 * 1024

_fields = msgspec.json.Decoder(dict[str, msgspec.Raw])
_value = msgspec.json.Decoder(msgspec.Raw)  # one JSON value, nothing after it
_encoder = msgspec.json.Encoder()


class Decline(Exception):
    """Raised by :meth:`Resume.decline`: this request is walked whole instead."""


class Resume:
    """What a resumable plugin's ``relay_request`` reads and leaves for the next request
    (``exchange.resume``; None when resuming is off).

    ``start``: the index of the first message the plugin must walk; ``messages[:start]``
    are as the chain left them in the session's previous request, and :meth:`state` is
    what the plugin saved there. On a full walk ``start`` is 0. :meth:`save` keeps the
    plugin's state after ``messages[:index]`` for each index in ``marks``; a plugin that
    saves a state at some marks makes the others unusable (one that saves none keeps no
    state, and leaves every mark usable). :meth:`seen` says whether
    ``messages[:start]`` are as this plugin would see them in a full walk (no plugin after
    it changed them); where not, it must not read them, and a plugin that needs them
    anyway calls :meth:`decline`. A plugin takes its resume through :meth:`usable`, which
    declines when an earlier plugin moved the boundaries. :attr:`span` tells a plugin that
    reads the body's bytes (the cache plugin's fingerprint) where the previous request's
    bytes end; before that, :attr:`offset` says where message ``start`` begins in the body
    (the client's bytes before it are the previous request's; 0 on a full walk).
    """

    __slots__ = ("start", "marks", "_states", "saved", "_changer", "_position", "span",
                 "offset")

    def __init__(self, start: int, marks: range, states: dict | None = None,
                 changer: int = -1, position: dict | None = None, offset: int = 0):
        self.start = start
        self.offset = offset
        self.marks = marks
        self._states = states or {}
        self.saved: dict[int, dict[str, tuple[Any, bool]]] = {}
        self._changer = changer  # the position of the last plugin that changed the prefix
        self._position = position or {}
        # Once the chain has run, for a resumed request whose new messages were found in
        # canonical form: where the messages array's first value starts in the body, where
        # message ``start`` does (bytes up to there are the previous request's), and where
        # the array closes when the bytes from there on are the previous request's too
        # (else None).
        self.span: tuple[int, int, int | None] | None = None

    def state(self, plugin: str):
        """What ``plugin`` saved at ``start``: None on a full walk, and when it saved
        nothing in the request resumed from (a plugin that keeps a state walks whole or
        declines then); the plugin's to change, since a record is used once."""
        found = self._states.get(plugin)
        return found[0] if found is not None else None

    def seen(self, plugin: str) -> bool:
        """Whether ``messages[:start]`` are as ``plugin`` would see them in a full walk
        (besides its own changes): no plugin after it in the pipeline changed them."""
        return self._position.get(plugin, -1) >= self._changer

    def save(self, plugin: str, index: int, state, changed: bool = False) -> None:
        """Keep ``state``, ``plugin``'s state after ``messages[:index]``; ``changed``: the
        plugin changed something in ``messages[:index]`` (now or in a request it resumed
        from), so that plugins before it in the pipeline will not read them."""
        self.saved.setdefault(index, {})[plugin] = (state, changed)

    def save_all(self, plugin: str, state=None) -> None:
        """Keep the same state at every mark: a plugin that left this request alone."""
        for index in self.marks:
            self.save(plugin, index, state)

    def usable(self, messages) -> Resume | None:
        """This resume, for a plugin about to walk ``messages``; None (walk them whole, save
        nothing) when a plugin before it merged or dropped messages, which moves every
        boundary: a request resumed from one is then walked whole instead."""
        if type(messages) is list and self.marks and len(messages) == self.marks[-1]:
            return self
        if self.start:
            self.decline()
        return None

    def decline(self):
        """Walk this request whole instead (the plugin needs what resuming did not give
        it)."""
        raise Decline()


class Record:
    """What the session's last request left for its next one."""

    __slots__ = ("raw", "count", "context", "messages", "states", "offsets", "before",
                 "array", "pending", "size", "blocks", "after", "dirty", "pinned", "cut",
                 "tail")

    def __init__(self, raw: bytes, count: int, context: tuple, messages: list, states: dict,
                 pending: list[bytes] | None, offsets: dict | None, before, array: int,
                 blocks: int, pinned: int = 0, cut: int | None = None,
                 tail: bytes | bytearray = b""):
        # The request's bytes are ``raw[:cut] + tail``: a resumed request's record keeps the
        # body its messages were first decoded from (``raw``, in memory with them anyway)
        # and a copy of what this request's body holds after ``cut`` (its bytes up to
        # ``cut`` were compared with that body's), rather than a second copy of the whole;
        # a bytearray, which the session's next record takes over and extends
        # (:func:`tail_after`).
        self.raw = raw
        self.cut = len(raw) if cut is None else cut
        self.tail = tail
        self.count = count
        self.context = context
        self.messages = messages  # as the chain left them
        self.states = states  # index -> {plugin: (state, changed)}
        # index -> the offset in ``raw`` where messages[:index] end (at the "," or "]" after
        # them); found at the next request when ``pending`` holds the canonical bytes of the
        # last messages instead (a record made by a full walk).
        self.offsets = offsets
        self.pending = pending
        self.before = before  # the top-level fields before "messages", as Raw values
        self.array = array  # the offset where the messages array's first value starts
        self.blocks = blocks
        # The bytes of the buffers the messages' raw values keep alive, besides ``raw``: a
        # resumed request's first messages are the ones decoded from an earlier body (the
        # full walk's, then each request's new turn), which stay in memory with them.
        self.pinned = pinned
        self.size = (len(raw) if cut is None else 0) + len(tail) + pinned \
            + MESSAGE_BYTES * count + BLOCK_BYTES * blocks
        # The top-level fields after "messages", as Raw values, once a resumed request has
        # decoded them (the bytes after the messages array are then compared, not decoded).
        self.after: dict | None = None
        # Whether the chain changed this request or one it was resumed from: its messages
        # may then differ from the client's bytes.
        self.dirty = False


class Store:
    """The records of the sessions in flight: up to :data:`LANES` per session (a session
    holds more than one conversation: Claude Code's subagents and side calls share its id),
    bounded by ``budget`` bytes in all and a quarter of it per session, oldest evicted
    first. The records of sessions seen for the first time (*trials*: most requests that are
    the only one of their session never send another) take what room the others leave, and
    go first, oldest out first, when room is needed: one-off requests cannot push out the
    records of the sessions that go on, and many sessions that begin at once (a team's
    agents, a restart) each keep their first request's record while there is room."""

    def __init__(self, budget: int, min_bytes: int | None = None):
        self.budget = budget
        # Below this a request is walked whole: its decode costs less than the bookkeeping.
        self.min_bytes = MIN_BYTES if min_bytes is None else min_bytes
        self.records: collections.OrderedDict[tuple[str, int], Record] = \
            collections.OrderedDict()
        self.lanes: dict[str, list[int]] = {}
        self.bytes = 0
        self._lane = itertools.count()
        # The sessions seen before: a record of any other session's request is a trial.
        self.seen: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.trials: collections.OrderedDict[tuple[str, int], None] = \
            collections.OrderedDict()
        self.trial_bytes = 0
        # The sessions whose key came from the request itself (no session id), by their
        # requests' first bytes: such a request is matched against their records without
        # working out its key, which decodes the whole body (relay.sessions).
        self.unnamed: dict[tuple, dict[str, None]] = {}
        self.head_of: dict[str, tuple] = {}

    def established(self, session: str) -> bool:
        """Whether the session was seen before (its request's record is then no trial)."""
        if session in self.seen:
            self.seen.move_to_end(session)
            return True
        self.seen[session] = None
        if len(self.seen) > MAX_SEEN:
            self.seen.popitem(last=False)
        return False

    def take(self, session: str, raw: bytes) -> tuple[Record | None, int]:
        """The session's record that ``raw`` goes on from furthest, taken out of the store,
        and the boundary it goes on from (0: none does)."""
        best: Record | None = None
        start = lane = 0
        for candidate in self.lanes.get(session, ()):
            record = self.records[session, candidate]
            if start and record.offsets and max(record.offsets) <= start:
                continue  # it could go no further than the one found: not compared
            found = match(record, raw)
            if found > start:
                best, start, lane = record, found, candidate
        if best is not None:
            self._drop(session, lane)
        return best, start

    def take_unnamed(self, key: tuple, raw: bytes) -> tuple[str | None, Record | None, int]:
        """For a request without a session id: the session, record and boundary
        :meth:`take` would give once its key was worked out, among the sessions whose key
        came from their requests' own content and whose requests began with the same bytes
        (``key``: :func:`head`); (None, None, 0) when none goes on.

        That key is a digest of the tenant, ``metadata``, ``system``, ``tools`` and the
        first message (:func:`relay.sessions.session_key`). A record is taken only where
        ``raw`` holds the same bytes as its request up to a boundary after the first
        message (:func:`match`: every field before ``messages`` too) and from the end of
        its messages on (every field after them): those are the bytes the key is made of,
        so the key is the record's."""
        best: Record | None = None
        found = ("", 0)
        start = 0
        for session in self.unnamed.get(key, ()):
            for lane in self.lanes.get(session, ()):
                record = self.records[session, lane]
                at = match(record, raw)
                if at > start and raw.endswith(
                        _bytes_from(record, (record.offsets or {})[record.count])):
                    best, start, found = record, at, (session, lane)
        if best is None:
            return None, None, 0
        self._drop(*found)
        return found[0], best, start

    def put(self, session: str, record: Record, trial: bool = False,
            head: tuple | None = None) -> None:
        """Keep ``record`` as the session's newest; ``head`` (:func:`head`), for a session
        whose key came from the request's content, registers it for
        :meth:`take_unnamed`."""
        share = self.budget // 4
        if record.size > share or trial and record.size > \
                self.budget - self.bytes + self.trial_bytes:
            # A trial the other sessions' records leave no room for would push out every
            # other trial, then itself.
            return
        first = record.messages[0] if record.messages else None
        for kept in [lane for lane in self.lanes.get(session, ()) if first is not None
                     and (old := self.records[session, lane].messages) and old[0] == first]:
            # The same conversation (its first message): one that went back to an earlier
            # turn (an edit, a rewind), whose record for the later turn it will not go on
            # from, and which would hold that record's megabyte until evicted.
            self._drop(session, kept)
        lanes = self.lanes.setdefault(session, [])
        while lanes and (len(lanes) >= LANES or record.size + sum(
                self.records[session, lane].size for lane in lanes) > share):
            self._drop(session, lanes[0])
        lane = next(self._lane)
        self.lanes.setdefault(session, []).append(lane)
        self.records[session, lane] = record
        self.bytes += record.size
        if trial:
            self.trials[session, lane] = None
            self.trial_bytes += record.size
        else:
            # The session went on (in another of its conversations, maybe): its records
            # are no trials any more.
            for kept in self.lanes[session]:
                if (session, kept) in self.trials:
                    del self.trials[session, kept]
                    self.trial_bytes -= self.records[session, kept].size
        while self.bytes > self.budget:
            self._drop(*next(iter(self.trials or self.records)))
        if head is not None and session in self.lanes and self.head_of.get(session) != head:
            self._unregister(session)
            self.head_of[session] = head
            sessions_ = self.unnamed.setdefault(head, {})
            sessions_[session] = None
            if len(sessions_) > HEAD_SESSIONS:
                # Its records stay, found by its key worked out the usual way.
                self._unregister(next(iter(sessions_)))

    def _drop(self, session: str, lane: int) -> None:
        record = self.records.pop((session, lane))
        self.bytes -= record.size
        if (session, lane) in self.trials:
            del self.trials[session, lane]
            self.trial_bytes -= record.size
        lanes = self.lanes[session]
        lanes.remove(lane)
        if not lanes:
            del self.lanes[session]
            self._unregister(session)

    def _unregister(self, session: str) -> None:
        key = self.head_of.pop(session, None)
        if key is not None:
            sessions_ = self.unnamed[key]
            del sessions_[session]
            if not sessions_:
                del self.unnamed[key]


def head(tenant: str | None, raw: bytes) -> tuple:
    """What :meth:`Store.take_unnamed` looks a request up by: its tenant and first bytes."""
    return tenant, hash(raw[:HEAD_BYTES])


def _locate(record: Record) -> bool:
    """For a record made by a full walk: find where its messages array starts and where its
    last messages end, from their canonical bytes; False when that cannot be told for sure
    (a body not in compact form, or holding the same bytes twice)."""
    raw = record.raw
    at = raw.find(_MESSAGES_KEY)
    if at < 0 or raw.find(_MESSAGES_NAME, 0, at) >= 0:
        return False
    try:
        before = _fields.decode(raw[:at] + b'"messages":[]}')
    except msgspec.DecodeError:
        return False
    before.pop("messages", None)
    array = at + len(_MESSAGES_KEY)
    pending = record.pending or []
    count = record.count
    if not pending:  # no message: nothing to resume from
        return False
    first = count - len(pending)
    needle = (b"," if first > 0 else b"") + b",".join(pending) + b"]"
    found = raw.find(needle, array)
    if found < 0 or raw.rfind(needle) != found:
        return False
    if first > 0:
        offsets = {first: found}
        position = found + 1
    elif found == array:
        offsets = {}
        position = found
    else:
        return False
    for index, encoded in enumerate(pending, start=first + 1):
        position += len(encoded)
        offsets[index] = position  # the "," or "]" after messages[index - 1]
        position += 1
    close = offsets[count]
    if first > 0:
        # The last messages' bytes are where they were found only if the array that opens
        # at ``array`` closes there: they may also stand in a later field (the messages
        # written in another form), or in a second "messages" the full decode took.
        try:
            _value.decode(memoryview(raw)[array - 1:close + 1])
        except msgspec.DecodeError:
            return False
    if _names_after(raw, close) is None:
        return False  # "messages" given twice: the full decode decides which one counts
    record.offsets = offsets
    record.before = before
    record.array = array
    record.pending = None
    return True


def match(record: Record, raw: bytes) -> int:
    """The largest kept boundary ``k`` (0 when none) such that ``raw`` starts with the bytes
    of the record's first ``k`` messages, followed by another message or the array's end."""
    if record.offsets is None and not _locate(record):
        record.offsets = {}  # not to be looked for again
        return 0
    offsets = record.offsets or {}
    best = 0
    checked = 0  # raw[:checked] is the record's bytes
    # From the earliest boundary on, each check comparing only the bytes after the last one.
    for index in sorted(offsets):
        end = offsets[index]
        if len(raw) <= end or not _same(record, raw, checked, end):
            break
        checked = end
        if index > 0 and index in record.states and raw[end] in b",]":
            best = index
    return best


def _same(record: Record, raw: bytes, lo: int, hi: int) -> bool:
    """Whether ``raw[lo:hi]`` are the record's request's bytes there."""
    cut = record.cut
    if hi > cut + len(record.tail):
        return False
    if lo < cut:
        top = min(hi, cut)
        if not raw.startswith(memoryview(record.raw)[lo:top], lo):
            return False
        lo = top
    return lo >= hi or raw.startswith(memoryview(record.tail)[lo - cut:hi - cut], lo)


def tail_after(record: Record, raw: bytes, cut: int, boundary: int) -> bytearray:
    """``raw[cut:]`` for the record that follows ``record`` (taken out of the store: its
    tail is the new record's to take over), where ``raw[:boundary]`` are ``record``'s
    request's bytes: ``record``'s tail up to ``boundary``, then ``raw`` from there, so that
    only what is new is copied (the part before it was copied once, by an earlier
    request)."""
    tail = record.tail
    if cut == record.cut and boundary >= cut and type(tail) is bytearray:
        try:
            del tail[boundary - cut:]
            tail += memoryview(raw)[boundary:]
            record.tail = b""  # the new record's now
            return tail
        except BufferError:  # a view of it still held somewhere: copied instead
            pass
    return bytearray(memoryview(raw)[cut:])


def _bytes_from(record: Record, at: int):
    """The record's request's bytes from ``at`` to its end."""
    cut = record.cut
    if at >= cut:
        return memoryview(record.tail)[at - cut:]
    if not record.tail:
        return memoryview(record.raw)[at:cut]
    return record.raw[at:cut] + record.tail


class Resumed:
    """A request decoded from a record: its skeleton (the record's first ``start`` messages,
    then the new ones), where its new messages' bytes begin, and (``end``) where its
    messages array closes when the bytes from there on are the record's request's (None
    when they are not)."""

    __slots__ = ("skeleton", "start", "record", "offset", "after", "end")

    def __init__(self, skeleton_: skeleton.Skeleton, start: int, record: Record, offset: int,
                 after: dict, end: int | None = None):
        self.skeleton = skeleton_
        self.start = start
        self.record = record
        self.offset = offset
        self.after = after
        self.end = end


def _names_after(raw: bytes, close: int) -> dict | None:
    """The top-level fields after the messages array that closes at ``close``, raw; None
    when one of them is "messages" again (written with escapes, maybe), which the full
    decode would take instead."""
    found = _fields.decode(b'{"":0' + raw[close + 1:])
    return None if "messages" in found else found


def decode_from(record: Record, raw: bytes, start: int) -> Resumed | None:
    """The skeleton of ``raw`` resumed at boundary ``start`` of ``record``, or None when it
    cannot be held as one (then the full decode decides)."""
    offsets = record.offsets or {}
    end = offsets[start]
    comma = raw[end] == 44  # ","
    offset = end + 1 if comma else end  # where the new messages begin
    try:
        after = record.after
        closing = offsets[record.count]  # the "]" of the record's messages
        suffix = _bytes_from(record, closing)
        last = len(raw) - len(suffix)  # where this request's "]" is, if it ends the same
        same = last >= end and raw.endswith(suffix)
        if after is not None and same:
            # The fields after the messages are the same bytes: only the messages between
            # are decoded.
            # Copied once: the new messages' raw values keep this buffer, not the body.
            tail = skeleton.decode_messages(b"".join((b"[", memoryview(raw)[end + 1:last],
                                                      b"]"))) if comma else []
            if not comma and last != end:
                return None
        else:
            tail, after = skeleton.decode_rest(b'{"messages":[' + raw[offset:])
            # Where this array closes, told by its new messages' bytes: the fields after it
            # must hold no second "messages", and are the record's only if they start there.
            close = _closing(raw, offset, tail)
            if close is None or _names_after(raw, close) is None:
                return None
            same = same and close == last
        if comma and not tail:
            return None  # "[...,]": not JSON, which the full decode says
        before = record.before
        if any(name in before for name in after):
            return None  # a field given twice: the full decode decides which one counts
        fields = {**before, **after}
        model = skeleton.decode_model(fields.pop("model"))
        if any(name not in skeleton.KNOWN_NAMES for name in fields):
            return None
        # The record is this request's alone (taken out of the store) and so is its list:
        # going on in it, rather than in a copy, leaves the garbage collector's youngest
        # generation without a list of the whole history per request in flight.
        messages = record.messages
        del messages[start:]
        messages += tail
        found = skeleton.from_fields(model, messages, fields)
    except (msgspec.MsgspecError, ValueError, KeyError, TypeError, RecursionError):
        return None
    return Resumed(found, start, record, offset, after, last if same else None)


def _closing(raw: bytes, offset: int, messages: list) -> int | None:
    """Where the messages array whose values from ``offset`` on are ``messages`` closes, if
    they are written there in their canonical form (None if not: then nobody can say
    without decoding the body whole)."""
    encoded = canonical(messages)
    if encoded is None:
        return None
    joined = b",".join(encoded)
    close = offset + len(joined)
    if not raw.startswith(joined, offset) or close >= len(raw) or raw[close] != 93:  # "]"
        return None
    return close


def canonical(messages: list) -> list[bytes] | None:
    """Each message's JSON as the relay encodes it, before any plugin has changed it."""
    try:
        return [_encoder.encode(message) for message in messages]
    except (TypeError, ValueError, OverflowError):
        return None


def new_offsets(raw: bytes, resumed: Resumed, encoded: list[bytes]) -> dict | None:
    """Where each of a resumed request's messages from ``start`` on ends in ``raw`` (at the
    "," or "]" after it), checked against their canonical bytes (``encoded``, made before
    any plugin ran); None when one is not in that form."""
    start = resumed.start
    end = resumed.record.offsets[start]  # type: ignore[index]
    offsets = {start: end}
    position = resumed.offset
    for index, value in enumerate(encoded, start=start + 1):
        if not raw.startswith(value, position):
            return None
        position += len(value)
        if position >= len(raw) or raw[position] not in b",]":
            return None
        offsets[index] = position
        position += 1
    last = offsets[start + len(encoded)]
    if raw[last] != 93 or raw.find(_MESSAGES_NAME, last) >= 0:  # 93: "]"
        return None
    return offsets


def context(exchange) -> tuple:
    """What a plugin's state may depend on besides the messages: a record is used only
    under the same."""
    backend = exchange.backend
    return (exchange.endpoint, backend.name if backend is not None else None, exchange.model,
            exchange.key_name, exchange.rules_defer)


def blocks_in(messages: list) -> int:
    count = 0
    for message in messages:
        content = message.get("content") if type(message) is dict else None
        if type(content) is list:
            count += len(content)
    return count

