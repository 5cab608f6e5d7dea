"""One upstream event stream on its way to the client, through the plugins that asked for
its events.

The server feeds it the upstream's chunks as they arrive and tells it when the upstream has
finished; it frames what plugins must see, runs them, and writes everything else on as the
upstream's own bytes. Kept apart from aiohttp (it only needs an async ``write``) so that the
benchmark measures this very code.
"""

from __future__ import annotations

from typing import Awaitable, Callable

from .sse import Event, LazyFramer, names_events

STREAM_ENDS = ("message_stop", "error")
# One event larger than this means the upstream stopped framing: give up rather than buffer on.
MAX_EVENT_BYTES = 64 * 1024 * 1024


class StreamBroken(Exception):
    """The upstream's stream cannot be relayed on: it ended early or stopped framing."""


class StreamRelay:
    """Relays one stream: :meth:`feed` each upstream chunk, then :meth:`finish`."""

    __slots__ = ("chain", "exchange", "plan", "write", "framer", "writing", "written", "events")

    def __init__(self, chain, exchange, plan, write: Callable[[bytes], Awaitable[None]]):
        self.chain = chain
        self.exchange = exchange
        self.plan = plan
        self.write = write
        self.framer: LazyFramer | None = None
        self.writing = False  # inside a write: what the framer saw has not all gone out
        self.written = 0  # bytes written to the client
        self.events = 0  # events written to the client, counted by the blank lines ending them

    @property
    def ended(self) -> bool:
        """Whether the stream ended on its own terms (``message_stop`` or an ``error`` event)
        and all of it reached the client."""
        return self.framer is not None and not self.writing and self.framer.ended

    async def feed(self, chunk: bytes) -> None:
        framer = self.framer
        if framer is None:
            if not chunk:
                return
            # An upstream that frames without "event:" lines (the type only in the data) is
            # framed by that type, and its events get their names back: clients drop events
            # without one.
            untyped = names_events(chunk) is False
            framer = self.framer = LazyFramer(None if untyped else self.plan.framed_names(),
                                              ends=STREAM_ENDS, name_by_type=untyped)
            if untyped:
                self.exchange.note("relay", "named untyped stream events")
            # The first event (message_start) goes out before whatever came with it is
            # scanned: time to first byte must not grow with how much the upstream managed to
            # send before the relay read.
            cut = chunk.find(b"\n\n") + 2
            if 1 < cut < len(chunk):
                await self._relay(*framer.feed(chunk[:cut]))
                chunk = chunk[cut:]
        parts, events = framer.feed(chunk)
        if parts:
            await self._relay(parts, events)
        # After a read that let something out, what is held back is part of that read: only a
        # read that let nothing out, or a huge one, can pass the limit.
        limit = MAX_EVENT_BYTES
        if (not parts or len(chunk) > limit) and framer.buffered > limit:
            raise StreamBroken(f"an event grew past {limit} bytes without ending")

    async def finish(self) -> None:
        """The upstream has sent everything: relay what is left, and raise
        :class:`StreamBroken` if the stream did not end on its own terms."""
        if self.framer is None:
            raise StreamBroken("the stream ended before message_start")
        tail = self.framer.close()
        if tail:
            await self._relay(tail, tail)
        if not self.framer.ended:
            raise StreamBroken("the stream ended before message_stop")

    async def _relay(self, parts: list, events: list[Event]) -> None:
        self.writing = True
        plan = self.plan
        if events and plan:
            chain, exchange = self.chain, self.exchange
            for event in events:
                calls = plan.calls_for(event.name)
                if calls:
                    more = await chain.stream_event(exchange, event, calls)
                    if more:
                        # The loop goes on over the events framed now (a for loop reads the
                        # list's items by position, so a new tail is its next items).
                        parts, later = self._widen(more, parts, event)
                        events[events.index(event) + 1:] = later
        if len(parts) == 1:
            part = parts[0]
            data = part if part.__class__ is bytes else part.encode()
        else:
            data = b"".join([part if part.__class__ is bytes else part.encode() for part in parts])
        if not self.written:
            self.exchange.timings.first_byte = self.exchange.elapsed()
        self.written += len(data)
        self.events += data.count(b"\n\n") or data.count(b"\r\n\r\n")
        await self.write(data)
        self.writing = False

    def _widen(self, more: list, parts: list, event: Event) -> tuple[list, list[Event]]:
        """Plugins asked for more events at ``event``: frame them from here on, in what is left
        of ``parts`` too. Returns the parts, and the events after ``event``."""
        self.plan.widen(more)
        framer = self.framer
        framer.want(self.plan.framed_names() or ())
        at = next(n for n, part in enumerate(parts) if part is event) + 1
        rest: list = []
        later: list[Event] = []
        for part in parts[at:]:
            if part.__class__ is bytes:
                split, found = framer.reframe(part)
                rest += split
                later += found
            else:
                rest.append(part)
                later.append(part)
        return parts[:at] + rest, later


def error_event(message: str, kind: str = "api_error") -> bytes:
    """An ``error`` event as Anthropic sends one after the headers have gone."""
    return Event.build("error", {"type": "error", "error": {"type": kind, "message": message}}).raw
