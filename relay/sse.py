"""Server-sent events, framed incrementally from whatever chunks the upstream writes.

The framer keeps each event's exact bytes so that an event no plugin touched is forwarded
as it arrived; only events a plugin changed are serialised again.
"""

from __future__ import annotations

import collections
import re

import orjson


def _fields(raw: bytes) -> tuple[str | None, bytes | None]:
    """The event name and the joined data of one framed event (None where absent)."""
    name = None
    data = None
    for line in raw.splitlines():
        if line.startswith(b"data:"):
            value = line[6:] if line[5:6] == b" " else line[5:]
            data = value if data is None else data + b"\n" + value
        elif line.startswith(b"event:"):
            value = line[7:] if line[6:7] == b" " else line[6:]
            name = value.decode("utf-8", "replace")
    return name, data


_LINE_END = re.compile(rb"[\r\n]")
# How much of the stream's end LazyFramer keeps to look for its ending events in: they come
# last, maybe followed by a ping, but never by this much.
TAIL_BYTES = 16384
_UNREAD = object()  # the data lines have not been read yet
_TYPE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class Event:
    """One SSE event: its original bytes, its name, and its data parsed on first use."""

    __slots__ = ("raw", "name", "_payload", "_data", "_parsed", "_changed")

    def __init__(self, raw: bytes):
        self.raw = raw
        self.name: str | None
        # Most events open with "event: NAME\n": read the name without splitting every line;
        # the data is only looked at if a plugin asks for it.
        end = raw.find(b"\n")
        if raw.startswith(b"event: ") and end > 0 and raw.find(b"\r", 0, end) < 0 \
                and raw.find(b"\nevent:", end) < 0:
            self.name = raw[7:end].decode("utf-8", "replace")
            self._payload = _UNREAD
        else:
            self.name, self._payload = _fields(raw)
        self._data = None
        self._parsed = False
        self._changed = False

    @classmethod
    def build(cls, name: str, data) -> Event:
        """A new event made by the relay (an error, say), framed the way Anthropic frames it."""
        return cls(b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n")

    @property
    def data(self):
        """The parsed JSON data, or None when the event has no data or it is not JSON."""
        if not self._parsed:
            self._parsed = True
            if self._payload is _UNREAD:
                self._payload = _fields(self.raw)[1]
            if self._payload is not None:
                try:
                    self._data = orjson.loads(self._payload)
                except orjson.JSONDecodeError:
                    self._data = None
        return self._data

    def adopt_type(self) -> None:
        """Name an event that came without an ``event:`` line after its data's ``type``, and
        give it that line, as Anthropic frames events."""
        data = self.data
        kind = data.get("type") if type(data) is dict else None
        if type(kind) is str and _TYPE_NAME.fullmatch(kind):
            self.name = kind
            self.raw = b"event: " + kind.encode() + b"\n" + self.raw

    @property
    def changed(self) -> bool:
        return self._changed

    def mark_changed(self) -> None:
        """Say that ``data`` was changed in place, so the event must be serialised again."""
        self._changed = True

    def encode(self) -> bytes:
        if not self._changed:
            return self.raw
        head = b"event: " + self.name.encode() + b"\n" if self.name is not None else b""
        return head + b"data: " + orjson.dumps(self._data) + b"\n\n"


class SSEDecoder:
    """Turns a byte stream into :class:`Event` objects, chunk by chunk.

    Line ends may be ``\\n``, ``\\r\\n`` or ``\\r``; an event ends at a blank line. A ``\\r``
    at the very end of a chunk is held back until the next byte says whether it was the
    first half of ``\\r\\n``. Lines of any length are fine: the buffer grows, and scanning
    resumes where it stopped instead of starting over.
    """

    def __init__(self):
        self._buf = bytearray()
        self._scan = 0  # everything before this offset has been scanned for line ends
        self._line = 0  # offset where the current line starts
        self._cr = False  # once a "\r" shows up, every later chunk takes the general path

    def feed(self, chunk: bytes) -> list[Event]:
        buf = self._buf
        buf += chunk
        events: list[Event] = []
        if not self._cr and chunk.find(b"\r") >= 0:  # see LazyFramer.feed
            self._cr = True
        if not self._cr:
            # The common case: plain \n line ends, so a blank line is exactly "\n\n".
            start = 0
            pos = max(self._scan - 1, 0)
            size = len(buf)
            while True:
                while start < size and buf[start] == 0x0A:  # blank lines between events
                    start += 1
                end = buf.find(b"\n\n", max(pos, start))
                if end < 0:
                    break
                events.append(Event(bytes(buf[start:end + 2])))
                start = pos = end + 2
            del buf[:start]
            self._scan = len(buf)
            self._line = self._last_line_start(buf)
            return events
        return self._feed_general(events)

    @staticmethod
    def _last_line_start(buf: bytearray) -> int:
        return buf.rfind(b"\n") + 1

    def _feed_general(self, events: list[Event], final: bool = False) -> list[Event]:
        buf = self._buf
        size = len(buf)
        start = 0  # where the current event starts
        line = self._line
        i = self._scan
        search = _LINE_END.search
        while True:
            found = search(buf, i)
            if found is None:
                i = size
                break
            i = found.start()
            if buf[i] == 0x0D:
                if i + 1 == size:
                    if not final:
                        break  # is it "\r" or the first half of "\r\n"? wait for the next chunk
                    end = size
                else:
                    end = i + 2 if buf[i + 1] == 0x0A else i + 1
            else:
                end = i + 1
            if i == line:  # a blank line closes the event
                if line > start:
                    events.append(Event(bytes(buf[start:end])))
                start = end
            line = i = end
        del buf[:start]
        self._scan = i - start
        self._line = line - start
        return events

    @property
    def buffered(self) -> int:
        """Bytes held back: the event (or line) still waiting for its end."""
        return len(self._buf)

    def close(self) -> list[Event]:
        """Events left when the stream ends. A final event without its blank line counts when
        its data is complete JSON (an upstream that skipped the last blank line); a fragment
        cut off mid-event is dropped, as a client would drop it: forwarding half an event
        would hand the client broken JSON instead of the error that follows."""
        events = self._feed_general([], final=True) if self._buf.endswith(b"\r") else []
        rest = bytes(self._buf).strip(b"\r\n")
        self._buf = bytearray()
        self._scan = self._line = 0
        if rest:
            event = Event(rest + b"\n\n")
            if event.data is not None:
                events.append(event)
        return events


def _needles(names) -> list[bytes]:
    return [name.encode() + b"\n" for name in names]


class _EventLines:
    """Finds the ``event:`` lines that name any of some events, in one pass over the bytes
    however many names there are: a regular expression whose literal start (a newline, then
    ``event:``) the engine looks for first, trying the names at each event line in C, with
    no Python step per event. A ``bytes.find`` per name costs each name a pass of its own,
    and short needles that end in a newline skip little of a stream's text: for the three
    names the shipped pipeline asks for, those passes cost about 1.6 times as much per byte
    as this one, on every byte of every stream."""

    __slots__ = ("names", "_line", "_lines")
    _made: dict[frozenset, _EventLines] = {}  # by names: pipelines ask for few sets of them

    def __init__(self, names: frozenset):
        self.names = names
        alternatives = b"|".join(re.escape(name.encode()) for name in sorted(names))
        self._line = re.compile(b"\nevent: ?(?:" + alternatives + b")\n").search
        # The same lines as literal prefixes, for the line at ``pos``: a regular expression's
        # call costs more than the whole of a one-event read.
        self._lines = tuple(f"event:{space}{name}\n".encode()
                            for name in sorted(names) for space in ("", " "))

    @classmethod
    def of(cls, names) -> _EventLines | None:
        names = frozenset(names)
        if not names:
            return None
        found = cls._made.get(names)
        if found is None:
            found = cls(names)
            if len(cls._made) < 64:
                cls._made[names] = found
        return found

    def find(self, data: bytes, pos: int) -> int:
        """Where, from ``pos`` (a line start) on, the first line naming one of the names
        starts, or -1."""
        if data.startswith(self._lines, pos):
            return pos
        # Most reads hold one event, whose only event line is the first: no other line starts
        # with "event:", and the expression is not run at all.
        at = data.find(b"\nevent:", pos)
        if at < 0:
            return -1
        found = self._line(data, at)
        return found.start() + 1 if found is not None else -1


def _last_event_line(data: bytes, needle: bytes) -> int:
    """Where the last ``event:`` line naming ``needle`` has the name, or -1."""
    at = data.rfind(needle)
    while at >= 0 and not _names_event(data, at):
        at = data.rfind(needle, 0, at)
    return at


def _names_event(data: bytes, at: int) -> bool:
    """Whether the name found at ``at`` is the value of an ``event:`` field: the line starts
    with ``event:`` and one optional space (``data`` begins at a line start)."""
    if at and data[at - 1] == 32:  # " "
        at -= 1
    start = at - 6
    return start >= 0 and data[start:at] == b"event:" and (start == 0 or data[start - 1] == 10)


class LazyFramer:
    """Frames only the events somebody has to look at.

    Complete events whose name is not in ``names`` are passed on as their bytes, unframed and
    unparsed: most of a stream is deltas no plugin asked for, and a ``bytes.find`` per wanted
    name costs far less than framing every event. ``names=None`` frames everything; so does a
    stream that uses ``\r`` line ends, where a blank line is not simply ``\n\n``. ``ends``
    are names the framer does not frame but can say were seen (:attr:`ended`).
    """

    def __init__(self, names, ends=(), name_by_type: bool = False):
        self._frame_all = names is None
        self._wanted = None if names is None else _EventLines.of(names)
        self._decoder = SSEDecoder()
        self._pending: list[bytes] = []  # chunks after the last blank line seen
        self._pending_size = 0  # kept as they come: summing them per chunk would be quadratic
        self._ends = frozenset(ends)
        # In the order given: the stream's usual ending (``message_stop``) first, found at
        # the very end of the tail, before a name that is searched for through all of it.
        self._end_needles = _needles(ends)
        self._ended = False  # an event in ``ends`` was framed
        self._ending: Event | None = None  # that event
        self._name_by_type = name_by_type
        # The last TAIL_BYTES of what went out unframed, where ``ended`` looks when asked.
        self._tail: collections.deque[bytes] = collections.deque()
        self._tail_size = 0

    def feed(self, chunk: bytes) -> tuple[list, list[Event]]:
        """The stream so far in order, as ``bytes`` to forward as they are and :class:`Event`
        objects; and those events alone."""
        if self._frame_all:
            return self._framed(self._decoder.feed(chunk))
        pending = self._pending
        if not chunk:
            return [], []
        if chunk.find(b"\r") >= 0:  # not `in`: it tries its operand as an integer first
            self._frame_all = True
            self._wanted = None
            events = self._decoder.feed(b"".join(pending) + chunk)
            pending.clear()
            self._pending_size = 0
            return self._framed(events)
        end = chunk.rfind(b"\n\n")
        if end < 0:
            if not (pending and chunk[:1] == b"\n" and pending[-1][-1:] == b"\n"):
                pending.append(chunk)
                self._pending_size += len(chunk)
                return [], []
            end = -1  # the blank line straddles the two chunks
        cut = end + 2
        if pending:
            complete = b"".join(pending) + chunk[:cut]
            pending.clear()
            self._pending_size = 0
        else:
            complete = chunk if cut == len(chunk) else chunk[:cut]
        if cut < len(chunk):
            pending.append(chunk[cut:])
            self._pending_size = len(chunk) - cut
        self._keep(complete)
        wanted = self._wanted
        hit = wanted.find(complete, 0) if wanted is not None else -1
        if hit < 0:  # no wanted name anywhere in this read (most reads of a stream)
            return [complete], []
        assert wanted is not None  # a name was found
        return self._split(complete, wanted, hit)

    def want(self, names) -> None:
        """Frame these names too, from the next chunk on (see :meth:`reframe` for the rest of
        the current one)."""
        if not self._frame_all:
            known = self._wanted.names if self._wanted is not None else frozenset()
            self._wanted = _EventLines.of(known | set(names))

    def reframe(self, part: bytes) -> tuple[list, list[Event]]:
        """A part :meth:`feed` returned unframed (whole events), split again for the names
        wanted now."""
        wanted = self._wanted
        if self._frame_all or wanted is None:  # framing everything: nothing was left unframed
            return [part], []
        hit = wanted.find(part, 0)
        return self._split(part, wanted, hit) if hit >= 0 else ([part], [])

    def _framed(self, events: list[Event]) -> tuple[list, list[Event]]:
        if self._name_by_type:
            for event in events:
                if event.name is None:
                    event.adopt_type()
        if not self._ended and self._ends:
            for event in events:
                if event.name in self._ends:
                    self._ended, self._ending = True, event
                    break
        return events, events

    def _keep(self, complete: bytes) -> None:
        if not self._ends:
            return
        if len(complete) >= TAIL_BYTES:
            self._tail.clear()
            complete = complete[-TAIL_BYTES:]
            self._tail_size = 0
        self._tail.append(complete)
        self._tail_size += len(complete)
        if self._tail_size >= 4 * TAIL_BYTES:  # cut back now and then, not on every read
            self._trim()

    def _trim(self) -> None:
        """The tail cut to the fewest last parts that hold TAIL_BYTES."""
        tail = self._tail
        while self._tail_size - len(tail[0]) >= TAIL_BYTES:
            self._tail_size -= len(tail.popleft())

    def _split(self, complete: bytes, wanted: _EventLines,
               hit: int) -> tuple[list, list[Event]]:
        """``complete`` (whole events, from a line start) as parts, the events with a line
        naming a wanted one framed, from ``hit``, the first such line."""
        parts: list = []
        events: list[Event] = []
        pos = 0
        while hit >= 0:
            start = complete.rfind(b"\n\n", pos, hit)
            start = start + 2 if start >= 0 else pos
            while complete[start] == 0x0A:  # extra blank lines go out as they came
                start += 1
            stop = complete.find(b"\n\n", hit) + 2
            if start > pos:
                parts.append(complete[pos:start])
            # Exactly one whole event, with "\n" line ends (a chunk with a "\r" is framed
            # whole by the decoder), and nothing held in the decoder: framed as it is.
            event = Event(complete[start:stop])
            parts.append(event)
            events.append(event)
            pos = stop
            hit = wanted.find(complete, stop)
        if pos < len(complete):
            parts.append(complete[pos:])
        return parts, events

    @property
    def buffered(self) -> int:
        return self._pending_size + self._decoder.buffered

    @property
    def ended(self) -> bool:
        """Whether an event named in ``ends`` has gone by: framed, or among the last
        TAIL_BYTES forwarded. The relay asks when the stream ends or breaks (an ending event
        is the last thing a stream sends), so that no chunk is searched for those names."""
        if self._ended:
            return True
        if self._tail:
            self._trim()
        needles = self._end_needles
        # From the end: the ending event is the last one, so the last part usually has it.
        return any(_last_event_line(part, needle) >= 0 for part in reversed(self._tail)
                   for needle in needles)

    def ending(self, name: str | None = None) -> Event | None:
        """The event in ``ends`` that ended the stream (see :attr:`ended`), framed, or None;
        with ``name``, only when it is that event. Asked once, at the end: an unframed one is
        looked for in the tail then, and framed only when it is the one asked for."""
        found = self._ending
        if found is not None or not self._tail:
            return found if name is None or found is None or found.name == name else None
        self._trim()
        if name is not None:
            # Which event ended it, from the last part of the tail that names one (every
            # stream ends so, and most with message_stop): nothing joined for those.
            for part in reversed(self._tail):
                at, needle = max((_last_event_line(part, needle), needle)
                                 for needle in self._end_needles)
                if at >= 0:
                    break
            else:
                return None
            if needle != name.encode() + b"\n":
                return None
        tail = b"".join(self._tail)
        at = max(_last_event_line(tail, needle) for needle in self._end_needles)
        if at < 0:
            return None
        start = tail.rfind(b"\n\n", 0, at)
        stop = tail.find(b"\n\n", at)
        return Event(tail[start + 2 if start >= 0 else 0:stop + 2 if stop >= 0 else len(tail)])

    def close(self) -> list[Event]:
        """The events left at the end of the stream (see :meth:`SSEDecoder.close`)."""
        if not self._pending and not self._decoder.buffered:
            return []
        events = self._decoder.feed(b"".join(self._pending)) if self._pending else []
        self._pending.clear()
        self._pending_size = 0
        events += self._decoder.close()
        return self._framed(events)[0]


def names_events(chunk: bytes) -> bool | None:
    """Whether the stream that starts with ``chunk`` names its events: True when its first
    event has an ``event:`` line, False when it has data but no name (some upstreams put the
    type only in the JSON), None when the first event is not complete yet."""
    end = chunk.find(b"\n\n")
    if end < 0:
        end = chunk.find(b"\r\n\r\n")
    if end < 0:
        return None
    first = b"\n" + chunk[:end]
    if b"\nevent:" in first or b"\revent:" in first:
        return True
    return False if (b"\ndata:" in first or b"\rdata:" in first) else None
