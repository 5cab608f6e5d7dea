"""A request's prompt-cache fingerprint, and where two of them part: pure functions, no I/O.

The prompt cache is a prefix cache. The API renders a request as ``tools``, then ``system``,
then ``messages``, and caches the prefix up to each ``cache_control`` breakpoint; a change at
one point invalidates the cache from there on (Anthropic's prompt caching guide and "Tool use
with prompt caching": "the cache follows a prefix hierarchy (tools -> system -> messages)").
The model is part of every cache entry, and some parameters invalidate the messages' part
without touching tools or system: the thinking settings and ``tool_choice`` (the guide's
"what invalidates the cache" table; the cache diagnostics guide reports them as
``unavailable``). Sources, and what each rule rests on: ``docs/evidence/cache.json``.

A :class:`Fingerprint` is one request's prefix as a sequence of *parts*, each the CRC-32
of a tool, a system block or a message's block (a message opens with a part for its role)
with the length of its bytes, separated by fixed markers between the sections, so that the
first part where two fingerprints differ says which section changed first, and where.
``cache_control`` is taken out of each part's bytes before it is hashed: clients move their
breakpoints forward every turn, and a moved marker changes no cached token. The parts that
held one are the breakpoints (with their ``ttl``).

Cheap by construction: a body with whitespace between its tokens is minified first (one C
pass), then one decode of the body into raw JSON values (msgspec keeps each as the bytes
that came, nothing is re-encoded), and the parts' CRCs and lengths are taken by C loops
(``map``) into two arrays, message by message; only the few parts that hold
``cache_control`` are looked at one by one, to take it out. The hash is not cryptographic: a
fingerprint says whether a prefix changed, for diagnosis, and never decides what goes up.
"""

from __future__ import annotations

import dataclasses
import zlib
from array import array
from typing import Any

import msgspec
import orjson
from msgspec import Raw

# The API's words for a changed prefix (the SDK's ``BetaCacheMissReason`` types).
MODEL, SYSTEM, TOOLS, MESSAGES = ("model_changed", "system_changed", "tools_changed",
                                  "messages_changed")
NOT_FOUND, UNAVAILABLE = "previous_message_not_found", "unavailable"
# The relay's own, where the API has no word: parameters whose change drops the messages'
# cache (the API says ``unavailable`` for them).
THINKING, TOOL_CHOICE = "thinking_changed", "tool_choice_changed"
PARAMETERS = ("thinking", "tool_choice")

# Cache lifetimes by ``cache_control.ttl`` (the guide: 5 minutes by default, refreshed each
# time the entry is read; "1h" for an hour).
TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}

_KEY = b'"cache_control"'
# A comma, a space and an unescaped quote: between two members or items, never inside a
# string (there a quote is escaped, and a string that ends in ", " is only a needless check).
_SPACED = b', "'
# Markers between the sections, as lengths no part has (a body is at most 32 MB).
_END_TOOLS = 0xFFFFFFFD
_END_SYSTEM = 0xFFFFFFFE


class _Message(msgspec.Struct):
    role: Raw = Raw(b"null")
    # Decoded in the same pass as the rest: a list as its blocks' raw bytes, a string as
    # the text (see _text_block).
    content: list[Raw] | str | None = None


class _Request(msgspec.Struct):
    model: Raw = Raw(b"null")
    speed: Raw = Raw(b"null")
    tools: list[Raw] | None = None
    system: Raw = Raw(b"null")
    messages: list[_Message] = []
    thinking: Raw = Raw(b"null")
    tool_choice: Raw = Raw(b"null")
    cache_control: Raw = Raw(b"null")


_request = msgspec.json.Decoder(_Request)
_raws = msgspec.json.Decoder(list[Raw])
_encode = msgspec.json.Encoder().encode


@dataclasses.dataclass(slots=True)
class Fingerprint:
    """One request's cacheable prefix (see the module). ``crcs`` and ``lengths``: the
    parts in prefix order; ``tools`` and ``system`` their counts; ``messages`` each
    message's part count (its role part included); ``breakpoints`` the indexes of the parts
    that carried ``cache_control`` and ``ttls`` their lifetimes in seconds; ``model`` the
    model with ``speed``; ``parameters`` the CRC of each of :data:`PARAMETERS`."""

    model: str
    crcs: array
    lengths: array
    tools: int
    system: int
    messages: array
    breakpoints: array
    ttls: array
    parameters: tuple[int, ...]

    def __len__(self) -> int:
        """How many parts (markers included)."""
        return len(self.lengths)

    @property
    def last_breakpoint(self) -> int:
        """The index of the last part the cache holds (-1: the request cached nothing)."""
        return self.breakpoints[-1] if self.breakpoints else -1

    @property
    def ttl(self) -> float:
        """The longest lifetime among the breakpoints (0 without one)."""
        return max(self.ttls) if self.ttls else 0.0

    def size(self, start: int = 0, end: int | None = None) -> int:
        """The bytes of the parts from ``start`` up to ``end`` (excluded)."""
        return sum(length for length in self.lengths[start:end] if length < _END_TOOLS)

    def nbytes(self) -> int:
        """What this fingerprint holds in memory, roughly."""
        return 200 + 8 * len(self.lengths) + 4 * (len(self.messages)
                                                   + 3 * len(self.breakpoints))

    def location(self, index: int) -> str:
        """Where part ``index`` is in the request: ``tools[3]``, ``system[1]``,
        ``messages[12]`` (its role), ``messages[12].content[0]``."""
        if index <= self.tools:
            return f"tools[{index}]"
        index -= self.tools + 1
        if index <= self.system:
            return f"system[{index}]"
        index -= self.system + 1
        for i, count in enumerate(self.messages):
            if index < count:
                return f"messages[{i}]" if index == 0 else f"messages[{i}].content[{index - 1}]"
            index -= count
        return f"messages[{len(self.messages)}]"

    def section(self, index: int) -> str:
        """The API's word for a change first seen at part ``index``."""
        if index <= self.tools:
            return TOOLS
        if index <= self.tools + 1 + self.system:
            return SYSTEM
        return MESSAGES

    def to_bytes(self) -> bytes:
        """A compact, process-independent form (for the shared state)."""
        return msgspec.msgpack.encode((
            self.model, self.crcs.tobytes(), self.lengths.tobytes(), self.tools, self.system,
            self.messages.tobytes(), self.breakpoints.tobytes(), self.ttls.tobytes(),
            list(self.parameters)))

    @classmethod
    def from_bytes(cls, raw: bytes) -> Fingerprint:
        model, crcs, lengths, tools, system, messages, breakpoints, ttls, parameters = \
            msgspec.msgpack.decode(raw)
        return cls(model, _array("I", crcs), _array("I", lengths), tools, system,
                   _array("I", messages),
                   _array("I", breakpoints), _array("d", ttls), tuple(parameters))


def _array(kind: str, raw: bytes) -> array:
    values = array(kind)
    values.frombytes(raw)
    return values


def fingerprint(body: bytes) -> Fingerprint | None:
    """The fingerprint of a Messages request body, or None for one that is not a request."""
    found = resumable(body)
    return found.fingerprint if found is not None else None


@dataclasses.dataclass(slots=True)
class Resumable:
    """A body's fingerprint and what :func:`resumed` needs to go on from it: whether the
    body had a top-level ``cache_control`` (``automatic``: its breakpoint is the last one)
    and was read as it came (``plain``: not minified first)."""

    fingerprint: Fingerprint
    automatic: bool
    plain: bool


def resumable(body: bytes) -> Resumable | None:
    """:func:`fingerprint`, with what resuming from it needs."""
    try:
        plain = _plain(body)
        if not plain:
            # Whitespace between tokens is no part of the prompt, and the relay's own encoder
            # writes none: a spaced body (the Python SDK's) and its re-encoding must agree.
            body = msgspec.json.format(body, indent=-1)
        request = _request.decode(body)
    except (msgspec.MsgspecError, ValueError, RecursionError):
        return None
    found = _assemble(request.model, request.speed, request.tools, request.system,
                      request.thinking, request.tool_choice, request.cache_control,
                      request.messages, body.count(_KEY), None)
    return Resumable(found, bytes(request.cache_control) != b"null", plain) \
        if found is not None else None


_PLAIN_SPAN = 4096


def _plain(body: bytes) -> bool:
    # An encoder spaces all its separators or none, so the first few are enough (searching
    # a whole history for these bytes costs more than the rest).
    return body.find(_SPACED, 0, _PLAIN_SPAN) < 0 and body.find(b"\n", 0, _PLAIN_SPAN) < 0


class _Around(msgspec.Struct):
    """The fields :class:`_Request` reads, from one side of a body's messages (each UNSET
    when that side has none)."""

    messages: list[_Message] = []
    model: Raw | msgspec.UnsetType = msgspec.UNSET
    speed: Raw | msgspec.UnsetType = msgspec.UNSET
    tools: list[Raw] | None | msgspec.UnsetType = msgspec.UNSET
    system: Raw | msgspec.UnsetType = msgspec.UNSET
    thinking: Raw | msgspec.UnsetType = msgspec.UNSET
    tool_choice: Raw | msgspec.UnsetType = msgspec.UNSET
    cache_control: Raw | msgspec.UnsetType = msgspec.UNSET


_around = msgspec.json.Decoder(_Around)
_messages = msgspec.json.Decoder(list[_Message])
_AROUND = _Around.__struct_fields__[1:]
_NULL = Raw(b"null")


def resumed(body: bytes, previous: Resumable, count: int, array_at: int,
            offset: int, end: int | None = None) -> Resumable | None:
    """:func:`resumable` for a body whose bytes up to its ``count``-th message are the ones
    ``previous`` was taken from (the caller compared them: :mod:`relay.resume`): the first
    ``count`` messages' parts are ``previous``'s, and only the rest of the body is read.
    ``array_at``: where the messages array's first value starts, ``offset``: where message
    ``count`` starts (or the array's closing bracket); ``end``, when the bytes from the
    array's closing bracket on are the ones ``previous`` was taken from too (compared by the
    caller): where that bracket is in ``body``. Then every field around the messages is
    ``previous``'s, and only the new messages are read. None when it cannot be told this way
    (then the whole body decides)."""
    before = previous.fingerprint
    if count > len(before.messages) or not previous.plain:
        return None
    # _plain reads the first _PLAIN_SPAN bytes: where those are previous's, so is its answer.
    if offset < _PLAIN_SPAN and not _plain(body):
        return None
    if end is not None:
        return _grown(body, previous, count, offset, end)
    try:
        head = _around.decode(body[:array_at] + b"]}")
        tail = _around.decode(b'{"messages":[' + body[offset:])
    except (msgspec.MsgspecError, ValueError, RecursionError):
        return None
    fields = {}
    for name in _AROUND:
        first, second = getattr(head, name), getattr(tail, name)
        if first is not msgspec.UNSET and second is not msgspec.UNSET:
            return None  # given twice: the whole decode decides which one counts
        fields[name] = second if first is msgspec.UNSET else first
    tools = fields["tools"]
    automatic = bytes(_or_null(fields["cache_control"])) != b"null"
    base = before.tools + 1 + before.system + 1
    cut = len(before.lengths) - sum(before.messages[count:])  # the messages' parts come last
    kept = [i for i, at in enumerate(before.breakpoints) if base <= at < cut]
    if previous.automatic and count == len(before.messages) and kept:
        kept.pop()  # the automatic breakpoint (the last part's, sorted after its block's)
    prefix = (before, base, cut, kept, count)
    # Every key of the body but those in the first ``count`` messages.
    keys = body.count(_KEY, 0, array_at) + body.count(_KEY, offset)
    found = _assemble(
        _or_null(fields["model"]), _or_null(fields["speed"]),
        None if tools is msgspec.UNSET else tools, _or_null(fields["system"]),
        _or_null(fields["thinking"]), _or_null(fields["tool_choice"]),
        _or_null(fields["cache_control"]), tail.messages, keys, prefix)
    return Resumable(found, automatic, True) if found is not None else None


def _grown(body: bytes, previous: Resumable, count: int, offset: int,
           end: int) -> Resumable | None:
    """:func:`resumed` for a body that differs from ``previous``'s only in its messages from
    ``count`` on (``body[offset:end]``, the array's closing bracket at ``end``): the model,
    parameters, tools and system parts, the first ``count`` messages' parts and their
    breakpoints are ``previous``'s, as :func:`_assemble` would make them again from the
    same bytes."""
    try:
        messages = _messages.decode(_bracketed(body, offset, end)) if end > offset else []
    except (msgspec.MsgspecError, ValueError, RecursionError):
        return None
    before = previous.fingerprint
    cut = len(before.lengths) - sum(before.messages[count:])  # the messages' parts come last
    breakpoints, ttls = before.breakpoints, before.ttls
    # The automatic breakpoint is the last one (on the last part, sorted after its block's
    # own): it moves to this body's last part.
    marks = len(breakpoints) - 1 if previous.automatic else len(breakpoints)
    while marks and breakpoints[marks - 1] >= cut:
        marks -= 1
    crcs, lengths = before.crcs[:cut], before.lengths[:cut]
    points, lifetimes = breakpoints[:marks], ttls[:marks]
    counts = before.messages[:count]
    # A new turn is a few messages: each of their blocks is searched for a marker once,
    # rather than the turn counted first and the marked message's blocks searched again.
    _message_parts(messages, None, crcs, lengths, points, lifetimes, counts)
    if previous.automatic:
        points.append(len(lengths) - 1)
        lifetimes.append(ttls[-1])
    return Resumable(Fingerprint(before.model, crcs, lengths, before.tools, before.system,
                                 counts, points, lifetimes, before.parameters),
                     previous.automatic, True)


def _bracketed(body: bytes, start: int, end: int) -> bytes:
    """``body[start:end]`` in brackets, copied once (a slice and two concatenations copy
    it three times)."""
    return b"".join((b"[", memoryview(body)[start:end], b"]"))


def _or_null(value):
    return _NULL if value is msgspec.UNSET else value


def _assemble(model_raw, speed_raw, tools, system_raw, thinking, tool_choice, cache_control,
              messages, keys: int, prefix: tuple | None) -> Fingerprint | None:
    """A fingerprint from a request's decoded parts; ``prefix``: the parts of its first
    messages, taken from an earlier fingerprint (see :func:`resumed`), ``messages`` then
    the ones after them."""
    try:
        model = msgspec.json.decode(model_raw)
        speed = msgspec.json.decode(speed_raw)
        system = _items(system_raw)
    except (msgspec.MsgspecError, ValueError, RecursionError):
        return None
    if not isinstance(model, str) or system is None:
        return None
    automatic = bytes(cache_control) != b"null"
    left = keys - automatic
    crcs, lengths = array("I"), array("I")
    breakpoints, ttls = array("I"), array("d")
    tools = tools or ()
    for section, end in ((tools, _END_TOOLS), (system, _END_SYSTEM)):
        for item in section:
            left -= _part(item, crcs, lengths, breakpoints, ttls)
        crcs.append(0)
        lengths.append(end)
    counts = array("I")
    if prefix is not None:
        before, base, cut, kept, count = prefix
        shift = len(lengths) - base
        crcs.extend(before.crcs[base:cut])
        lengths.extend(before.lengths[base:cut])
        for i in kept:
            breakpoints.append(before.breakpoints[i] + shift)
            ttls.append(before.ttls[i])
        counts.extend(before.messages[:count])
    _message_parts(messages, left, crcs, lengths, breakpoints, ttls, counts)
    if automatic:
        # Automatic caching: the API puts the breakpoint on the last cacheable block.
        breakpoints.append(len(lengths) - 1)
        ttls.append(_ttl(cache_control))
    order = sorted(range(len(breakpoints)), key=breakpoints.__getitem__)
    return Fingerprint(
        model if speed is None else f"{model} speed={speed}", crcs, lengths, len(tools),
        len(system), counts, array("I", (breakpoints[i] for i in order)),
        array("d", (ttls[i] for i in order)),
        (zlib.crc32(thinking), zlib.crc32(tool_choice)))


def _message_parts(messages: list, left: int | None, crcs: array, lengths: array,
                   breakpoints: array, ttls: array, counts: array) -> None:
    """Add the parts of ``messages`` (``left``: at least as many markers as they hold;
    None: every block is searched for one)."""
    # Markers are few, and clients put them on the newest messages: the messages that hold
    # one are found from the end, and the parts of all are hashed in one C pass at the end.
    contents: list[list[Any]] = []
    for message in messages:
        value = message.content
        contents.append(value if type(value) is list else
                        [_text_block(value)] if type(value) is str else [])
    marked: set[int] | range
    if left is None:
        marked = range(len(contents))
    else:
        marked = set()
        for i in range(len(contents) - 1, -1, -1):
            if left <= 0:
                break
            found = sum(bytes(block).count(_KEY) for block in contents[i])
            if found:
                marked.add(i)
                left -= found
    parts: list[Any] = []
    base = len(lengths)
    for i, message in enumerate(messages):
        parts.append(message.role)
        blocks = contents[i]
        if i in marked:
            for block in blocks:
                parts.append(_unmarked(block, base + len(parts), breakpoints, ttls)[0])
        else:
            parts.extend(blocks)
    crcs.extend(map(zlib.crc32, parts))
    lengths.extend(map(len, parts))
    counts.extend([1 + len(blocks) for blocks in contents])


def _items(value: Raw) -> list | None:
    """``system`` as its parts: a list's items; a string as the one text block it stands
    for; nothing for null; None for anything else."""
    view = memoryview(value)  # a Raw is a buffer: read in place
    head = view[:1].tobytes()
    if head == b"[":
        return _raws.decode(value)
    if head == b'"':
        return [b'{"type":"text","text":' + bytes(value) + b"}"]
    return [] if view == b"null" else None


def _text_block(text: str) -> bytes:
    """The text block a string content stands for (the API reads ``"hi"`` as ``[{"type":
    "text", "text": "hi"}]``, and Claude Code sends one message in either form from one turn
    to the next), as a client's encoder writes it: the string re-encoded, which gives the
    client's bytes unless it escaped what needs no escape (``ensure_ascii``)."""
    return b'{"type":"text","text":' + _encode(text) + b"}"


def _part(raw: Raw | bytes, crcs: array, lengths: array, breakpoints: array, ttls: array) -> int:
    """Add one part, without its markers; returns how many it held."""
    data, found = _unmarked(raw, len(lengths), breakpoints, ttls)
    crcs.append(zlib.crc32(data))
    lengths.append(len(data))
    return found


def _unmarked(raw: Raw | bytes, index: int, breakpoints: array, ttls: array) -> tuple[bytes, int]:
    """A part's bytes without its markers, each noted as a breakpoint at part ``index``, and
    how many it held."""
    data = bytes(raw)
    # bytes.find rather than `in`: `in` tries its operand as an integer first, and raising and
    # clearing that TypeError costs more than the search, once per part.
    first = data.find(_KEY)
    if first < 0:
        return data, 0
    data, found = strip_cache_control(data, first)
    for ttl in found:
        breakpoints.append(index)
        ttls.append(ttl)
    return data, len(found)


def strip_cache_control(raw: bytes, start: int | None = None) -> tuple[bytes, list[float]]:
    """``raw`` (one JSON value) without its ``"cache_control": {...}`` members, each taken
    out with the comma that joined it, so that a block a client marked and the same block
    unmarked give the same bytes when the same encoder wrote both; and the lifetimes of the
    markers taken out. A key inside a string is never one: there its quotes are escaped.
    ``start``: where the key first occurs, when the caller has searched for it already."""
    found: list[float] = []
    if start is None:
        start = raw.find(_KEY)
    # The one key of the block (its usual marker, the block's last member: found from the
    # end at once): once it is out, a key could only be one that taking it out joined, so
    # the block is not searched again from the front.
    only = start >= 0 and raw.rfind(_KEY) == start
    while True:
        if start < 0:
            return raw, found
        colon = _skip(raw, start + len(_KEY))
        if raw[colon:colon + 1] != b":":
            # A string value of those letters, not a key: the block's marker may follow.
            start = raw.find(_KEY, start + len(_KEY))
            continue
        value = _skip(raw, colon + 1)
        end = _value_end(raw, value)
        if end is None:
            return raw, found
        try:
            found.append(_ttl(raw[value:end]))
        except ValueError:
            found.append(TTL_SECONDS["5m"])
        before = start
        while before > 0 and raw[before - 1] in b" \t\r\n":
            before -= 1
        if before > 0 and raw[before - 1:before] == b",":
            joined = before - 1
            raw = raw[:joined] + raw[end:]
        else:
            joined = start
            after = _skip(raw, end)
            if raw[after:after + 1] == b",":
                after = _skip(raw, after + 1)
            raw = raw[:start] + raw[after:]
        if only:
            start = raw.find(_KEY, max(joined - len(_KEY) + 1, 0), joined + len(_KEY) - 1)
            only = False  # a key made by the join (never in valid JSON): searched for as before
        else:
            start = raw.find(_KEY)


def _skip(raw: bytes, at: int) -> int:
    while at < len(raw) and raw[at] in b" \t\r\n":
        at += 1
    return at


def _value_end(raw: bytes, at: int) -> int | None:
    """Where the JSON value starting at ``at`` ends (an object, or a bare word)."""
    if raw[at:at + 1] == b"{":
        # A marker is flat ({"type": "ephemeral", "ttl": "1h"}): its first closing brace
        # ends it, unless a brace or quote inside says otherwise (then walk it).
        close = raw.find(b"}", at)
        if close > 0 and raw.find(b"{", at + 1, close) < 0 \
                and raw.find(b"\\", at, close) < 0 and raw.count(b'"', at, close) % 2 == 0:
            return close + 1
    if raw[at:at + 1] != b"{":
        end = at
        while end < len(raw) and raw[end] not in b",}] \t\r\n":
            end += 1
        return end if end > at else None
    depth, quoted, escaped = 0, False, False
    for i in range(at, len(raw)):
        char = raw[i]
        if quoted:
            if escaped:
                escaped = False
            elif char == 0x5C:  # backslash
                escaped = True
            elif char == 0x22:
                quoted = False
        elif char == 0x22:
            quoted = True
        elif char == 0x7B:
            depth += 1
        elif char == 0x7D:
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _ttl(value) -> float:
    control = orjson.loads(bytes(value))
    ttl = control.get("ttl") if isinstance(control, dict) else None
    return TTL_SECONDS.get(ttl, TTL_SECONDS["5m"]) if isinstance(ttl, str) else \
        TTL_SECONDS["5m"]


@dataclasses.dataclass(slots=True, frozen=True)
class Divergence:
    """Where a request's prefix first differs from an earlier one's. ``reason``: the API's
    word (``model_changed``, ``tools_changed``, ...) or the relay's (``thinking_changed``,
    ``tool_choice_changed``); ``where``: ``model``, ``thinking``, ``tools[3]``,
    ``messages[12].content[0]``; ``index``: the first part that differs (0 for the model,
    the first message part for a parameter); ``cached``: whether the earlier request's
    cache held that point (the change breaks the cache), and ``missed_bytes`` the bytes of
    the earlier request's cached prefix from there on."""

    reason: str
    where: str
    index: int
    cached: bool
    missed_bytes: int


def first_difference(previous: array, current: array) -> int:
    """The first index where two integer arrays of one type differ (the shorter one's length
    when one is a prefix of the other), found by comparing their bytes: C speed on long
    histories."""
    # As bytes: arrays compare item by item, making an integer of each, and memoryviews
    # unpack each item through struct, ten times slower still.
    n = min(len(previous), len(current))
    a = (previous if len(previous) == n else previous[:n]).tobytes()
    b = (current if len(current) == n else current[:n]).tobytes()
    if a == b:
        return n
    low, high = 0, len(a)  # a[:low] == b[:low]; a[:high] != b[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if a[low:middle] == b[low:middle]:
            low = middle
        else:
            high = middle
    return low // previous.itemsize


def diverge(previous: Fingerprint, current: Fingerprint) -> Divergence | None:
    """How ``current`` parts from ``previous``, or None when it only appends to it."""
    last = previous.last_breakpoint
    if previous.model != current.model:
        return Divergence(MODEL, "model", 0, last >= 0, previous.size(0, last + 1))
    index = min(first_difference(previous.crcs, current.crcs),
                first_difference(previous.lengths, current.lengths))
    messages_start = previous.tools + 1 + previous.system + 1
    if index < len(previous) and index < messages_start:
        where = current.location(index) if index < len(current) else \
            previous.location(index)
        return Divergence(previous.section(index), where, index, index <= last,
                          previous.size(index, last + 1))
    for name, reason, before, now in zip(PARAMETERS, (THINKING, TOOL_CHOICE),
                                         previous.parameters, current.parameters, strict=True):
        if before != now:
            return Divergence(reason, name, messages_start, messages_start <= last,
                              previous.size(messages_start, last + 1))
    if index >= len(previous):
        return None
    where = current.location(index) if index < len(current) else \
        previous.location(index)
    return Divergence(MESSAGES, where, index, index <= last, previous.size(index, last + 1))


def api_reason(divergence: Divergence | None) -> str | None:
    """The API's ``cache_miss_reason.type`` for a divergence (None: the prefix matched)."""
    if divergence is None:
        return None
    if divergence.reason in (THINKING, TOOL_CHOICE):
        return UNAVAILABLE
    return divergence.reason


def estimate_tokens(size: int, tokens: int | None, total_bytes: int) -> int:
    """Tokens in ``size`` bytes of a prompt, by the earlier request's own ratio of input
    tokens to bytes when it is known, else about four bytes a token."""
    if tokens and total_bytes:
        return round(size * tokens / total_bytes)
    return size // 4
