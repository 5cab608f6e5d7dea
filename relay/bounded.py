"""A bounded record of a byte stream: its first and last bytes, and how many were left out.

What the relay keeps of a stream for the record (a dump) must not grow with the stream: an
upstream that never stops would otherwise take the relay's memory with it. The head says how
the stream began, the tail how it ended (where a fault shows), and the count between them
says how much is missing.
"""

from __future__ import annotations

# Each end; a stream shorter than both together is kept whole. Small, since every stream in
# flight holds one.
HEAD_BYTES = 64 * 1024
TAIL_BYTES = 64 * 1024


class HeadTail:
    """The first ``head`` and last ``tail`` bytes of the chunks :meth:`add` was given: time
    linear in the chunks, memory at most ``head`` and twice ``tail`` (and one chunk),
    however long the stream."""

    __slots__ = ("head_limit", "tail_limit", "_head", "_head_size", "_tail", "_tail_size",
                 "total")

    def __init__(self, head: int = HEAD_BYTES, tail: int = TAIL_BYTES):
        self.head_limit = head
        self.tail_limit = tail
        self._head: list[bytes] = []
        self._head_size = 0
        self._tail: list[bytes] = []
        self._tail_size = 0
        self.total = 0  # every byte added, kept or not

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.head_limit - self._head_size
        if room > 0:
            if len(chunk) <= room:
                self._head.append(chunk)
                self._head_size += len(chunk)
                return
            self._head.append(chunk[:room])
            self._head_size = self.head_limit
            chunk = chunk[room:]
        self._tail.append(chunk)
        self._tail_size += len(chunk)
        # Cut back to size now and then, not on every chunk: this runs for every chunk of a
        # stream, and each byte is copied at most twice this way.
        if self._tail_size > 2 * self.tail_limit:
            kept = b"".join(self._tail)[-self.tail_limit:]
            self._tail = [kept]
            self._tail_size = len(kept)

    @property
    def omitted(self) -> int:
        """Bytes between the head and the tail that were not kept."""
        return max(0, self.total - self._head_size - min(self._tail_size, self.tail_limit))

    def value(self) -> bytes:
        """What was kept: the whole stream when nothing was left out, else the head, a line
        saying how many bytes are missing, and the tail (each end cut at a UTF-8 character
        boundary, so that text stays text)."""
        head = b"".join(self._head)
        tail = b"".join(self._tail)[-self.tail_limit:] if self._tail else b""
        omitted = self.omitted
        if not omitted:
            return head + tail
        cut = _whole_characters(head)
        start = _next_character(tail)
        left_out = omitted + len(head) - cut + start
        return (head[:cut] + b"\n[relay: " + str(left_out).encode() + b" bytes left out]\n"
                + tail[start:])


def _whole_characters(data: bytes) -> int:
    """Where ``data`` ends once a UTF-8 character cut off at its end is dropped."""
    at = len(data) - 1
    while at >= 0 and len(data) - at < 4 and 0x80 <= data[at] < 0xC0:
        at -= 1
    if at < 0 or data[at] < 0x80:
        return len(data)
    lead = data[at]
    size = 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
    return at if len(data) - at < size else len(data)


def _next_character(data: bytes) -> int:
    """Where the first whole UTF-8 character of ``data`` starts (at most three bytes on)."""
    at = 0
    while at < min(len(data), 3) and 0x80 <= data[at] < 0xC0:
        at += 1
    return at
