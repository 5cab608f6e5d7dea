"""One upstream event stream on its way to the client, through the format's translator (when
it has one) and the plugins that asked for its events.

:func:`relay_stream` answers a streaming request: it sends the headers, then :func:`pump`
feeds the upstream's chunks through the translator into a :class:`StreamRelay`, which frames
what plugins must see, runs them, and writes everything else on as the upstream's own bytes.
:class:`StreamRelay` and :func:`pump` need only an async ``write`` and an async iterator of
chunks, so that the benchmark measures this very code.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import AsyncIterable, Awaitable, Callable

import aiohttp
from aiohttp import web

from . import lifecycle, threads
from .errors import RelayError, let_go
from .exchange import Answer, Exchange, Outcome, UpstreamAnswer
from .formats import Translator
from .logs import access_log
from .redact import redact_text, redacting_writer
from .sse import Event, LazyFramer, names_events
from .upstream import Reply, answer_headers

log = logging.getLogger("relay")

STREAM_ENDS = ("message_stop", "error")
# The Messages API's own keep-alive, byte for byte. Every client of the API already skips it:
# the Python and TypeScript SDKs drop ``ping`` events before their callers see them, the
# Vercel AI SDK's chunk schema has it and ignores it. Watchdogs that count bytes count it as
# life: Claude Code's (2.1.3xx: a byte clock on the response body, 5 minutes behind a custom
# base URL, "Waiting for API response" after 20 s, and a heartbeat to its event clock whenever
# bytes came but no event did). An SSE comment would count the same there; the API's own
# event is what every Anthropic-format parser is known to take.
PING = b'event: ping\ndata: {"type": "ping"}\n\n'
# One event larger than this means the upstream stopped framing: give up rather than buffer on.
MAX_EVENT_BYTES = 64 * 1024 * 1024
# A first read with more than this after its first event has that event sent on its own
# first; a shorter one goes out whole, in one write, as the bare pass-through sends it:
# framing that much and running the plugins on it delays the first byte far less than a
# write of its own costs.
FIRST_READ_WHOLE = 16384
# Where a blank line may end: a line end ("\r\n", "\r", "\n") followed by another.
_BLANK_LINES = (b"\n\n", b"\n\r", b"\r\r")


class _StreamAnswer(web.StreamResponse):
    """A stream's response whose status line and headers go out with its first bytes, in one
    write (as aiohttp's own ``web.Response`` sends a small answer's, aiohttp PR #10991),
    rather than in a write of their own: a send to the client's socket costs more than
    relaying a short stream's events, and a write that carries only headers wakes the client
    for nothing. :func:`relay_stream` sends them on their own at the event loop's next turn
    if the first bytes are not there by then, so they never wait for the upstream."""

    _send_headers_immediately = False


def _send_head(writer) -> None:
    """The headers of a stream whose first bytes are not ready yet (a no-op once they went)."""
    with contextlib.suppress(ConnectionError):  # the client is gone: the stream will say so
        writer.send_headers()


class StreamBroken(Exception):
    """The upstream's stream cannot be relayed on: it ended early or stopped framing."""


class StreamRelay:
    """Relays one stream: :meth:`feed` each upstream chunk, then :meth:`finish`."""

    __slots__ = ("chain", "exchange", "plan", "write", "end", "last", "ending", "framer",
                 "head", "writing", "written", "events")

    def __init__(self, chain, exchange, plan, write: Callable[[bytes], Awaitable[None]],
                 count_events: bool = True, end: Callable[[bytes], Awaitable[None]] | None = None):
        self.chain = chain
        self.exchange = exchange
        self.plan = plan
        self.write = write
        # Writes the stream's last bytes and the end of the body together, in one write
        # rather than two: used when :attr:`last` says the chunk being fed is the upstream's
        # last (:func:`pump` sets it) and it leaves the stream ended and nothing held back.
        self.end = end
        self.last = False
        self.ending = False  # the last bytes went to ``end``: the stream is whole and over
        self.framer: LazyFramer | None = None
        # The stream's start while it is not yet known whether its events are named: that
        # takes its first whole event with a field, which one read need not hold.
        self.head = bytearray()
        self.writing = False  # inside a write: what the framer saw has not all gone out
        self.written = 0  # bytes written to the client
        # Events written to the client, counted by the blank lines ending them: a scan of
        # every byte, so only for a reader of the count (the access log).
        self.events: int | None = 0 if count_events else None

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
            head = self.head
            # Looked at again only where this read may have ended the first event: a start
            # that trickles in is not scanned whole per read.
            seen = max(len(head) - 1, 0)
            start: bytes | bytearray = head
            if head:
                head += chunk
            else:
                start = chunk
            if not any(start.find(blank, seen) >= 0 for blank in _BLANK_LINES):
                if start is chunk:
                    head += chunk
                if len(head) > MAX_EVENT_BYTES:
                    raise StreamBroken(f"an event grew past {MAX_EVENT_BYTES} bytes without "
                                       f"ending")
                return
            if start is head:
                chunk = bytes(head)
            named = names_events(chunk)
            self.head = bytearray()
            framer = self._framer(named)
        parts, events = framer.feed(chunk)
        if parts:
            if events and self.plan:
                await self._relay(parts, events)
            else:  # most reads: nothing for a plugin, and no coroutine of _relay's for them
                self.writing = True
                await self._out(self._data(parts))
                self.writing = False
        # After a read that let something out, what is held back is part of that read: only a
        # read that let nothing out, or a huge one, can pass the limit.
        limit = MAX_EVENT_BYTES
        if (not parts or len(chunk) > limit) and framer.buffered > limit:
            raise StreamBroken(f"an event grew past {limit} bytes without ending")

    def _framer(self, named: bool | None) -> LazyFramer:
        # An upstream that frames without "event:" lines (the type only in the data) is
        # framed by that type, and its events get their names back: clients drop events
        # without one.
        untyped = named is False
        framer = self.framer = LazyFramer(None if untyped else self.plan.framed_names(),
                                          ends=STREAM_ENDS, name_by_type=untyped)
        if untyped:
            self.exchange.note("relay", "named untyped stream events")
        return framer

    async def finish(self) -> None:
        """The upstream has sent everything: relay what is left, and raise
        :class:`StreamBroken` if the stream did not end on its own terms."""
        if self.framer is None and self.head:
            # A stream whose start never showed a whole event: framed as its last event is.
            head = bytes(self.head)
            self.head = bytearray()
            framer = self._framer(names_events(head + b"\n\n"))
            parts, events = framer.feed(head)
            if parts:
                await self._relay(parts, events)
        if self.framer is None:
            raise StreamBroken("the stream ended before message_start")
        if self.ending:
            return
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
        await self._out(self._data(parts))
        self.writing = False

    def _out(self, data: bytes) -> Awaitable[None]:
        if self.last and self.end is not None:
            framer = self.framer
            assert framer is not None  # data comes from it
            if not framer.buffered and framer.ended:
                self.ending = True
                return self.end(data)
        return self.write(data)

    def _data(self, parts: list) -> bytes:
        """What goes out for ``parts``, counted."""
        if len(parts) == 1:
            part = parts[0]
            data = part if part.__class__ is bytes else part.encode()
        else:
            data = b"".join([part if part.__class__ is bytes else part.encode() for part in parts])
        if not self.written:
            self.exchange.timings.first_byte = self.exchange.elapsed()
        self.written += len(data)
        if self.events is not None:
            self.events += data.count(b"\n\n") or data.count(b"\r\n\r\n")
        return data

    def may_ping(self) -> bool:
        """Whether a keep-alive may go out now: after the first event (message_start, which
        decides the stream: nothing may come before it), between events (the framer lets
        out only whole ones, so anything written ends one), never during a write (a client
        that is not reading gets nothing more) and never once the stream is ending."""
        framer = self.framer
        return (self.written > 0 and not self.writing and framer is not None
                and self.exchange.outcome is None and not framer.ended)

    def _widen(self, more: list, parts: list, event: Event) -> tuple[list, list[Event]]:
        """Plugins asked for more events at ``event``: frame them from here on, in what is left
        of ``parts`` too. Returns the parts, and the events after ``event``."""
        self.plan.widen(more)
        framer = self.framer
        assert framer is not None  # events were framed, so the framer is there
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


class KeepAlive:
    """Writes :data:`PING` into a stream that has sent its client nothing for ``interval``
    seconds (a ping goes out between ``interval`` and 1.5 × ``interval`` after the last
    byte). What counts is bytes reaching the client, not bytes arriving from the upstream: a
    translator that holds back a tool call's fragments is silence to the client.

    Every half interval a tick compares :attr:`StreamRelay.written` with what it saw last
    time: the stream's own path does nothing more per event. The ticks are one timer for
    every open stream of the same interval (:class:`_Ticker`), not a timer per stream: a
    stream joins and leaves a set, and its first tick comes within half an interval, which
    keeps the bound above. It never hides a dead upstream (the concern with keep-alives in
    Wei-Shaw/sub2api PR #1707): the backend's read timeout still ends the stream with
    ``event: error``."""

    __slots__ = ("stream", "interval", "loop", "ticker", "seen", "quiet", "task", "sent")

    def __init__(self, stream: StreamRelay, interval: float):
        self.stream = stream
        self.interval = interval
        self.loop = asyncio.get_running_loop()
        self.seen = -1
        self.quiet = 0  # ticks without a byte written
        self.task: asyncio.Task | None = None
        self.sent = 0
        self.ticker = _Ticker.of(self.loop, interval)
        self.ticker.join(self)

    def tick(self) -> None:
        written = self.stream.written
        if written != self.seen:
            self.seen, self.quiet = written, 0
            return
        self.quiet += 1
        if self.quiet >= 2 and self.task is None and self.stream.may_ping():
            self.task = self.loop.create_task(self._ping())

    async def _ping(self) -> None:
        try:
            # Asked again where the bytes go out: the stream may have moved on since the tick.
            # The write reaches the transport before it can wait, so no event can come between.
            if self.stream.may_ping():
                self.quiet = 0
                self.sent += 1
                await self.stream.write(PING)
        except Exception as e:  # the client is gone; the stream's own write will say so
            log.debug("%s: keep-alive not written: %r", self.stream.exchange.id, e)
        finally:
            self.task = None

    @property
    def bytes(self) -> int:
        return self.sent * len(PING)

    def stop(self) -> None:
        self.ticker.leave(self)
        if self.task is not None:
            self.task.cancel()


class _Ticker:
    """The one timer of an event loop's streams that share a keep-alive interval: it ticks
    every half interval while any of them is open, and stops at the first tick that finds
    none."""

    __slots__ = ("loop", "half", "streams", "handle", "__weakref__")
    _tickers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(self, loop: asyncio.AbstractEventLoop, interval: float):
        self.loop = loop
        self.half = interval / 2
        self.streams: dict[KeepAlive, None] = {}  # in the order they joined
        self.handle: asyncio.TimerHandle | None = None

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop, interval: float) -> _Ticker:
        try:
            tickers = cls._tickers.get(loop)
            if tickers is None:
                tickers = cls._tickers[loop] = {}
        except TypeError:  # a loop that takes no weak reference: a ticker per stream
            return cls(loop, interval)
        ticker = tickers.get(interval)
        if ticker is None:
            ticker = tickers[interval] = cls(loop, interval)
        return ticker

    def join(self, keepalive: KeepAlive) -> None:
        self.streams[keepalive] = None
        if self.handle is None:
            self.handle = self.loop.call_later(self.half, self._tick)

    def leave(self, keepalive: KeepAlive) -> None:
        # The timer runs on to its tick, which stops it if no stream has joined since: a
        # stream that follows another takes no timer of its own.
        self.streams.pop(keepalive, None)

    def _tick(self) -> None:
        if not self.streams:
            self.handle = None
            return
        self.handle = self.loop.call_later(self.half, self._tick)
        for keepalive in list(self.streams):
            try:
                keepalive.tick()
            except Exception:  # one stream's fault must not stop the others' pings
                log.exception("%s: keep-alive tick failed", keepalive.stream.exchange.id)


def error_event(message: str, kind: str = "api_error") -> bytes:
    """An ``error`` event as Anthropic sends one after the headers have gone."""
    return Event.build("error", {"type": "error", "error": {"type": kind, "message": message}}).raw


async def pump(stream: StreamRelay, chunks: AsyncIterable[bytes],
               translator: Translator | None = None,
               at_end: Callable[[], bool] | None = None) -> None:
    """Feed the upstream's ``chunks`` into ``stream`` through ``translator`` (the format's
    stage, when it has one), then finish it. A long first read is cut after its first
    event, which goes out before the rest of that read is translated or scanned: time to
    first byte must not grow with how much the upstream managed to send before the relay
    read (a short one goes out whole: see :data:`FIRST_READ_WHOLE`). ``at_end`` says, after
    a read, whether it was the upstream's last (its body has ended): ``stream`` may then
    send it with the end of its own body (:attr:`StreamRelay.end`)."""
    reads = chunks.__aiter__()
    stage = translator.feed if translator is not None else None
    if stage is not None:  # what a translator holds comes out at its close, after the reads
        at_end = None
    async for chunk in reads:
        cut = chunk.find(b"\n\n") + 2
        if 1 < cut < len(chunk) - FIRST_READ_WHOLE:
            await stream.feed(stage(chunk[:cut]) if stage is not None else chunk[:cut])
            chunk = chunk[cut:]
        if at_end is not None:
            stream.last = at_end()
        await stream.feed(stage(chunk) if stage is not None else chunk)
        break
    if translator is None:
        if at_end is None:
            async for chunk in reads:
                await stream.feed(chunk)
        else:
            async for chunk in reads:
                stream.last = at_end()
                await stream.feed(chunk)
    else:
        if translator.fault is None:
            async for chunk in reads:
                chunk = translator.feed(chunk)
                if chunk:
                    await stream.feed(chunk)
                if translator.fault is not None:
                    break  # the relay ended the stream: the rest is not read
        chunk = translator.close()
        if chunk:
            await stream.feed(chunk)
    await stream.finish()


def stream_break(backend, e: BaseException) -> str:
    """What a client is told when an upstream stream stops short, in plain words: the
    library's own account (``ClientPayloadError ... TransferEncodingError: 400, message='Not
    enough data ...'``, where the 400 is no HTTP status) is for the log and the dump."""
    if isinstance(e, aiohttp.ServerTimeoutError):
        why = (f"nothing came for more than {backend.timeouts.read:g} s (its timeouts.read), "
               f"so the relay ended it")
    elif isinstance(e, asyncio.TimeoutError) and backend.timeouts.total is not None:
        why = f"it did not finish within {backend.timeouts.total:g} s (its timeouts.total)"
    elif isinstance(e, StreamBroken):
        why = str(e)
    else:
        why = "the upstream ended it before it was complete"
    return f"upstream {backend.name}'s stream broke off: {why}"


async def stream_failed(exchange: Exchange, response: web.StreamResponse, message: str,
                        kind: str = "api_error", detail: str | None = None) -> None:
    """End a stream whose headers are gone with an ``error`` event, so the client knows it is
    cut short. Bounded: a client that does not read cannot hold the relay here. ``detail``
    (what the library said) goes to the timeline, and so the dump, not to the client."""
    exchange.outcome = Outcome.STREAM_ERROR
    exchange.stream_failed(message, kind, detail)
    try:
        await asyncio.wait_for(response.write(error_event(message, kind)), 5)
    except Exception as e:  # the client is gone or stuck; nothing more to tell it
        log.info("%s: could not deliver the stream's error event: %r", exchange.id, e)


async def relay_stream(state, request: web.Request, exchange: Exchange,
                       upstream: Reply) -> web.StreamResponse:
    """Answer ``exchange`` with the upstream's event stream (``state`` is the server's: its
    chain, its threads, ``server.stream_keepalive``). Once the headers are gone, every way
    the stream can fail ends it with an ``error`` event."""
    plan = await state.chain.stream_plan(exchange)
    backend = exchange.backend
    secrets = backend.secrets
    headers = answer_headers(exchange, upstream.headers, secrets)
    # What the SDKs report as the request id, when the upstream gave none (a translated
    # stream).
    headers.setdefault("request-id", exchange.id)
    if upstream.content_type != "text/event-stream":  # a whole answer made a stream
        headers["Content-Type"] = "text/event-stream; charset=utf-8"
    response = _StreamAnswer(status=upstream.status, headers=headers)
    answer = exchange.answer = Answer(response.status, response.headers, stream=True)
    writer = await response.prepare(request)
    # The first bytes are usually in hand already (the upstream's first read held its headers
    # and first event): written before this runs, they take the headers with them.
    asyncio.get_running_loop().call_soon(_send_head, writer)
    write = redacting_writer(response.write, secrets)
    # A thread's record is what the client received.
    tap = threads.Tap(write) if exchange.thread is not None else None
    # A thread's tap keeps every write: its stream ends with a write of its own.
    end = redacting_writer(response.write_eof, secrets) if tap is None else None
    stream = StreamRelay(state.chain, exchange, plan, tap or write,
                         count_events=access_log.isEnabledFor(logging.INFO), end=end)
    translator = backend.adapter.stream_translator(backend.name, exchange.model)
    record = None
    if translator is not None:
        record = exchange.upstream_response = UpstreamAnswer(upstream.status, upstream.headers,
                                                             translator.raw)
        exchange.unreported_usage = translator.unreported
    # Started where the ``finally`` below is sure to stop it.
    interval = state.config.stream_keepalive
    keepalive = KeepAlive(stream, interval) if interval else None
    try:
        try:
            content = upstream.content
            await pump(stream, content.iter_any(), translator,
                       content.at_eof if end is not None else None)
        except (aiohttp.ClientError, asyncio.TimeoutError, StreamBroken) as e:
            let_go(e)  # the upstream's reader keeps it, and its traceback this frame
            if request.transport is None or request.transport.is_closing():
                exchange.outcome = Outcome.CLIENT_DISCONNECTED
                return response
            if stream.ended:
                # Everything the client needs arrived; only the connection's own ending
                # failed.
                log.info("%s: upstream connection ended uncleanly after the stream: %r",
                         exchange.id, e)
            else:
                message = stream_break(backend, e)
                detail = f"{type(e).__name__} {e}".rstrip()
                log.warning("%s: %s (%s)", exchange.id, message, detail)
                await stream_failed(exchange, response, message, detail=detail)
                return response
        except RelayError as error:  # a stream plugin refused to go on
            exchange.error = error
            await stream_failed(exchange, response, error.message, error.type)
            return response
        except asyncio.CancelledError:
            # The client went away, or the relay is stopping with this stream still open:
            # then the client is told, not cut off.
            if (request.transport is not None and not request.transport.is_closing()
                    and not stream.ended):
                await stream_failed(exchange, response, lifecycle.SHUTTING_DOWN)
                # A clean end of the body: a client drops a body cut short, error and all.
                with contextlib.suppress(Exception):
                    await response.write_eof()
            raise
        except Exception:
            log.exception("%s: the stream loop failed", exchange.id)
            if not stream.ended:
                await stream_failed(exchange, response,
                                    "the relay failed while relaying this stream")
                return response
        await response.write_eof()
        if tap is not None:
            try:
                threads.record(state.threads, exchange, tap.message())
            except Exception:
                # The client has its answer: a failed record leaves the thread unrecorded (its
                # next turn is then one the relay did not see), never a dropped connection.
                log.exception("%s: the thread's streamed answer could not be recorded",
                              exchange.id)
        return response
    finally:
        if tap is not None:
            threads.own_stream(state.threads, exchange, tap)
        answer.size, answer.events = stream.written, stream.events
        if keepalive is not None:
            keepalive.stop()
            if keepalive.sent:
                answer.size += keepalive.bytes
                if answer.events is not None:
                    answer.events += keepalive.sent
                exchange.note("relay", "keep-alive", pings=keepalive.sent)
        exchange.timings.last_byte = exchange.elapsed()
        if translator is not None and record is not None:
            record.body = translator.raw.value()
            if translator.fault is not None and exchange.outcome is None:
                outcome, message = translator.fault
                # It may quote the upstream's event, and so a key the upstream echoed.
                message = redact_text(message, secrets)
                exchange.outcome = Outcome(outcome)
                log.warning("%s: %s", exchange.id, message)
                exchange.error = RelayError(502, message, "api_error")
                exchange.stream_failed(message)
        if exchange.outcome is None and stream.ended:
            ended_in_error(exchange, stream)


def ended_in_error(exchange: Exchange, stream: StreamRelay) -> None:
    """Record a stream that the upstream itself ended with an ``error`` event (overloaded
    mid-answer, say): the client has the event as it came, and the record says why, as for
    a stream the relay ended."""
    framer = stream.framer
    ending = framer.ending("error") if framer is not None else None
    if ending is None:
        return
    data = ending.data
    error = data.get("error") if type(data) is dict else None
    message = error.get("message") if type(error) is dict else None
    kind = error.get("type") if type(error) is dict else None
    if type(message) is not str or not message:
        message = "the upstream ended the stream with an error event"
    # The client's copy was redacted as it was written; this one was read before that, and
    # an upstream may quote the key it was sent ("invalid api key sk-...").
    message = redact_text(message, exchange.backend.secrets)
    exchange.outcome = Outcome.STREAM_ERROR
    exchange.stream_failed(message, kind if type(kind) is str and kind else "api_error",
                           "the upstream's own error event")
    log.warning("%s: upstream %s ended the stream with an error event: %s", exchange.id,
                exchange.backend.name, message)
