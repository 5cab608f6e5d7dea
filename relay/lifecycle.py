"""A serving process's life: readiness, the requests in flight, and the drain at the end.

On the first SIGTERM (or SIGINT) ``/readyz`` answers 503. For ``server.unready_seconds`` (0
by default) the process goes on accepting and serving, so that a load balancer that has not
yet taken it out sends nothing into a closed port; then it stops accepting, closes its idle
connections and waits up to ``server.drain_seconds`` for the requests in flight. When they
finish, it exits 0. When the deadline passes or a second signal comes first, what is still in
flight is cancelled: a stream ends with ``event: error`` (the stream loop writes it when its
task is cancelled while the client is still there), an answer not yet begun becomes a 503 in
Anthropic's format, and the process exits 1.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import mmap
import struct
import time

from aiohttp import web

from .errors import RelayError
from .exchange import new_request_id

log = logging.getLogger("relay")

SHUTTING_DOWN = "the relay is shutting down"


def hangup() -> None:
    """SIGHUP, which many daemons take for "reload": the relay has no reload, and the
    signal's default action would end the process at once, cutting every stream without an
    ``event: error``. It goes on serving and says so."""
    log.warning("SIGHUP: the relay does not reload its configuration and goes on serving "
                "with the one it started with; to apply a change, restart it (SIGTERM "
                "drains first)")

# When the answer's status line and headers went out, in the request's own task (aiohttp
# runs each request in a task of its own, with a context of its own): the access line's time
# to first byte, and how a cancelled request tells whether it can still be answered.
_RESPONSE_STARTED: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "relay_response_started", default=None)


async def mark_response_started(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``."""
    _RESPONSE_STARTED.set(time.time())


def response_started() -> float | None:
    """When the current request's answer began, or None while it has not."""
    return _RESPONSE_STARTED.get()


class SharedCounter:
    """One integer in memory shared with forked children: the supervisor writes how many
    workers are serving, each worker reads it for ``/readyz``."""

    def __init__(self):
        self._memory = mmap.mmap(-1, 8)

    @property
    def value(self) -> int:
        return struct.unpack_from("q", self._memory)[0]

    @value.setter
    def value(self, count: int) -> None:
        struct.pack_into("q", self._memory, 0, count)


# Set by a handler whose exchange the drain cut (see Lifecycle.cuts): the 503 it recorded.
CUT_ANSWER = web.RequestKey("relay_cut_answer", web.Response)


def shutting_down(request_id: str) -> web.Response:
    """The drain's 503, with its request id where every error of the relay's has it (the
    SDKs read ``request-id``)."""
    error = RelayError(503, SHUTTING_DOWN, "api_error")
    headers = {"x-should-retry": "true", "Connection": "close",
               "x-relay-request-id": request_id, "request-id": request_id}
    return web.Response(status=503, body=error.body(request_id),
                        content_type="application/json", headers=headers)


class Lifecycle:
    """What one serving process knows about its own state."""

    def __init__(self, workers: int = 1, serving: SharedCounter | None = None):
        self.workers = workers
        self.serving = serving  # None: a single process, which serves once it listens
        self.listening = False
        self.draining = False
        self.forced = False
        self.stopped_at: float | None = None  # monotonic, at the first stop signal
        self.in_flight: set[asyncio.Task] = set()
        self.stop_requested = asyncio.Event()
        self.second_signal = asyncio.Event()
        self._idle = asyncio.Event()

    def signal(self) -> None:
        """SIGTERM or SIGINT: the first starts the drain, the second cuts it short."""
        if self.stop_requested.is_set():
            self.hurry()
        else:
            self.stop()

    def stop(self) -> None:
        """Start the drain; once started, nothing more (a worker's SIGTERM, which may come
        from its supervisor and from whoever signalled the whole process group too)."""
        if not self.stop_requested.is_set():
            self.stopped_at = time.monotonic()
            self.stop_requested.set()

    def hurry(self) -> None:
        """The second stop signal: end the start-up, the window or the drain now."""
        if self.second_signal.is_set():
            return
        log.warning("second stop signal: ending the requests still in flight"
                    if self.listening else "second stop signal: ending the start-up")
        self.stop()
        self.second_signal.set()

    async def serve(self, request: web.Request, handler):
        """Answer ``request`` with ``handler`` as a request in flight, which the drain waits
        for (the dispatcher calls this for every request: no middleware of its own)."""
        task = asyncio.current_task()
        assert task is not None  # aiohttp runs every handler in a task of its own
        in_flight = self.in_flight
        in_flight.add(task)
        try:
            return await handler(request)
        except asyncio.CancelledError:
            # Cut short by the drain before any byte of the answer went out: the client can
            # still be told why, and that a retry (elsewhere) will do.
            if self.cuts(request):
                if hasattr(task, "uncancel"):  # Python 3.11+: the cancel is handled here
                    task.uncancel()
                return request.get(CUT_ANSWER) or shutting_down(new_request_id())
            raise
        finally:
            in_flight.discard(task)
            if not in_flight and self.draining:
                self._idle.set()

    def cuts(self, request: web.Request) -> bool:
        """Whether the cancel ``request``'s handler is getting is the drain's, with the client
        still there and no byte of its answer sent: then it gets :func:`shutting_down`."""
        return (self.forced and response_started() is None and request.transport is not None
                and not request.transport.is_closing())

    def readiness(self) -> tuple[int, dict]:
        """``/readyz``: 200 while this process takes requests, 503 from the stop signal on."""
        serving = self.workers if self.serving is None else self.serving.value
        stopping = self.stop_requested.is_set()
        if stopping or not self.listening:
            status = "draining" if stopping else "starting"
            return 503, {"status": status, "workers": {"configured": self.workers,
                                                      "serving": serving}}
        return 200, {"status": "ready", "workers": {"configured": self.workers,
                                                   "serving": serving}}

    async def unready(self, seconds: float) -> None:
        """Go on accepting and serving, unready, until ``seconds`` after the stop signal (or
        a second signal). A process that was still starting when the signal came keeps to the
        same deadline as its siblings, which accept meanwhile on the same port."""
        assert self.stopped_at is not None  # called once a stop was requested
        left = self.stopped_at + seconds - time.monotonic()
        if left <= 0 or self.second_signal.is_set():
            return
        log.info("stopping: /readyz answers 503; still accepting for %.3gs before the drain",
                 left)
        try:
            await asyncio.wait_for(self.second_signal.wait(), left)
        except asyncio.TimeoutError:
            pass

    async def drain(self, runner: web.AppRunner, seconds: float) -> int:
        """Stop accepting, let what is in flight finish for up to ``seconds`` (or until a
        second signal), then cancel the rest. Returns the exit status: 0 when nothing had to
        be cut, 1 otherwise."""
        self.draining = True
        for site in list(runner.sites):
            await site.stop()
        # Idle keep-alive connections close now; busy ones once their answer is complete.
        assert runner.server is not None  # set up before anything could be drained
        runner.server.pre_shutdown()
        if self.in_flight:
            log.info("draining: %d request(s) in flight, waiting up to %gs",
                     len(self.in_flight), seconds)
            self._idle.clear()
            waiters = [asyncio.ensure_future(self._idle.wait()),
                       asyncio.ensure_future(self.second_signal.wait())]
            try:
                await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in waiters:
                    waiter.cancel()
        if not self.in_flight:
            log.info("drained: every request finished")
            return 0
        self.forced = True
        cut = list(self.in_flight)
        log.warning("drain cut short after %s: ending %d request(s) with an error",
                    "a second signal" if self.second_signal.is_set() else f"{seconds:g}s",
                    len(cut))
        for task in cut:
            task.cancel()
        await asyncio.wait(cut, timeout=5)
        return 1


LIFECYCLE = web.AppKey("relay_lifecycle", Lifecycle)


def readiness_response(request: web.Request) -> web.Response:
    lifecycle = request.app.get(LIFECYCLE)
    if lifecycle is None:  # an app served without serve(): it answers, so it is ready
        return web.json_response({"status": "ready"})
    status, body = lifecycle.readiness()
    return web.json_response(body, status=status)
