"""``relay serve --workers N``: N worker processes on one port, pre-forked, with SO_REUSEPORT.

The supervisor (this process) loads the config and the plugins, reserves the port, forks
the workers and then only watches them: it serves nothing itself. Each worker is a whole
relay (``server.serve``): it runs the plugins' ``relay_startup`` and ``relay_shutdown``,
binds the port with SO_REUSEPORT (the kernel spreads new connections evenly over the
workers' sockets) and drains on its own (see :mod:`relay.lifecycle`).

Signals: SIGTERM or SIGINT to the supervisor is passed on to every worker as SIGTERM (the
workers ignore SIGINT, so a Ctrl-C to the terminal's process group stops them once, through
the supervisor); a second one is passed on as SIGUSR1 and cuts the drains short. A worker
takes a SIGTERM after the first for nothing more: systemd (``KillMode=control-group``, its
default) and dumb-init send SIGTERM to every process of the relay at once, and the
supervisor's copy must not cut the drain that the first began. Until a worker's loop handles
them, its SIGTERM and SIGUSR1 wait blocked, never taken by their default action. A worker
still there ``KILL_GRACE`` seconds after the drain's deadline, or after the second signal, is
killed. SIGHUP is logged and changes nothing (there is no reload), in the workers too. The
supervisor exits 0 when every worker drained completely, 1 otherwise, or with a worker's own
status when one could not start (2: a config error from a plugin's relay_startup). A worker that
dies once the relay serves is started again after a wait that doubles with each death
(:func:`restart_delay`). A worker whose supervisor is gone (killed outright) drains and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import signal
import socket
import sys
import time

from . import logs
from .errors import ConfigError
from .lifecycle import SharedCounter, hangup
from .listen import url_of

log = logging.getLogger("relay")

# A worker that dies at start-up, or soon after, would die again at once (a service its
# plugins need is down, the disk is full): started again every second, it filled the log with
# a death a second for as long as the cause lasted. The wait doubles, as Kubernetes'
# CrashLoopBackOff does (10 s to 5 minutes, reset after 10 minutes of running), but from 1 s
# and to 30 s: the other workers serve meanwhile, and a slot that recovers should not sit
# empty for minutes.
RESTART_FIRST = 1.0
RESTART_MAX = 30.0
RESTART_RESET = 60.0  # seconds a worker must have served for its slot's next wait to be the first
KILL_GRACE = 15.0  # seconds past the drain before a worker that hangs is killed
HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD)
STOP, HURRY = signal.SIGTERM, signal.SIGUSR1  # to a worker: the first stop signal, the second
# Blocked from before the fork until the worker's loop has its handlers for them.
WORKER_SIGNALS = (STOP, HURRY)


class WorkerLink:
    """What a worker shares with its supervisor: the serving count for ``/readyz``, a pipe to
    say it listens, and a pipe that ends when the supervisor does."""

    def __init__(self, slot: int, serving: SharedCounter, ready_fd: int, alive_fd: int):
        self.slot = slot
        self.serving = serving
        self._ready_fd = ready_fd
        self._alive_fd = alive_fd

    @staticmethod
    def handle_signals(loop: asyncio.AbstractEventLoop, state) -> None:
        """The supervisor's signals, to ``state`` (a :class:`relay.lifecycle.Lifecycle`):
        one that came since the fork is taken now."""
        loop.add_signal_handler(STOP, state.stop)
        loop.add_signal_handler(HURRY, state.hurry)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, WORKER_SIGNALS)

    def started(self, loop: asyncio.AbstractEventLoop, stop) -> None:
        os.write(self._ready_fd, bytes([self.slot]))

        def supervisor_gone() -> None:
            loop.remove_reader(self._alive_fd)
            log.warning("worker %d: the supervisor is gone; draining", self.slot)
            stop()

        loop.add_reader(self._alive_fd, supervisor_gone)


def restart_delay(previous: float | None, served: float | None) -> float:
    """How long a slot waits before its worker is started again: ``previous`` is the wait
    before the worker that died was started (None: it was the first), ``served`` how long that
    worker listened (None: it never did)."""
    if previous is None or (served is not None and served >= RESTART_RESET):
        return RESTART_FIRST
    return min(previous * 2, RESTART_MAX)


def how_it_ended(wait_status: int) -> str:
    if os.WIFSIGNALED(wait_status):
        number = os.WTERMSIG(wait_status)
        try:
            return f"was killed by {signal.Signals(number).name}"
        except ValueError:
            return f"was killed by signal {number}"
    return f"exited with status {os.waitstatus_to_exitcode(wait_status)}"


def reserve_port(host: str, port: int) -> tuple[socket.socket, tuple]:
    """Bind (never listen on) ``host:port`` with SO_REUSEPORT: it picks the port when
    ``port`` is 0 and keeps it for workers started later. A port someone already holds is
    an error here, even one held with SO_REUSEPORT by the same user (another relay)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    if port:
        probe = socket.socket(family, kind, proto)
        try:
            probe.bind(address)
        finally:
            probe.close()
    reserved = socket.socket(family, kind, proto)
    try:
        reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        reserved.bind(address)
    except OSError:
        reserved.close()
        raise
    return reserved, reserved.getsockname()


class Supervisor:
    def __init__(self, config, chain, host: str, port: int, workers: int):
        self.config, self.chain, self.host, self.port = config, chain, host, port
        self.workers = workers
        self.serving = SharedCounter()
        self.slots: dict[int, int | None] = dict.fromkeys(range(workers))  # slot -> pid
        self.ready: set[int] = set()  # slots whose current worker listens
        self.pids: dict[int, int] = {}  # pid -> slot
        self.ready_at: dict[int, float] = {}  # slot -> when its current worker listened
        self.delay: dict[int, float] = {}  # slot -> the wait before its current worker started
        self.restart_at: dict[int, float] = {}  # slot -> when its next worker starts
        self.announced = False
        self.stopping = 0  # stop signals received
        self.stop_deadline: float | None = None
        self.status = 0
        self.reserved: socket.socket  # the listening port, held from run() on

    def run(self) -> int:
        self.reserved, bound = reserve_port(self.host, self.port)
        self.port = bound[1]
        self.wake_r, self.wake_w = os.pipe()
        self.ready_r, self.ready_w = os.pipe()
        self.alive_r, self.alive_w = os.pipe()
        for fd in (self.wake_r, self.wake_w, self.ready_r):
            os.set_blocking(fd, False)
        for sig in HANDLED:
            signal.signal(sig, lambda *_: None)  # the wake-up fd carries the signal
        signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)
        for slot in self.slots:
            self.start(slot)
        while self.pids or not self.stopping:
            self.wait()
        self.reserved.close()
        return self.status

    def start(self, slot: int) -> None:
        # Held back across the fork: until the child has handlers of its own, a signal to it
        # would run the supervisor's and write to the supervisor's wake-up pipe.
        signal.pthread_sigmask(signal.SIG_BLOCK, (*HANDLED, *WORKER_SIGNALS))
        pid = os.fork()
        if pid == 0:
            self.worker(slot)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, (*HANDLED, *WORKER_SIGNALS))
        self.slots[slot] = pid
        self.pids[pid] = slot

    def worker(self, slot: int) -> None:
        """The child's whole life; never returns."""
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor passes it on
            signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the supervisor logs it
            # Its stop signals stay blocked until serve() handles them: a SIGTERM now would
            # otherwise end it at once, and the relay's stop with status 1 for nothing cut.
            signal.pthread_sigmask(signal.SIG_UNBLOCK,
                                   [sig for sig in HANDLED if sig not in WORKER_SIGNALS])
            for fd in (self.wake_r, self.wake_w, self.ready_r, self.alive_w):
                os.close(fd)
            self.reserved.close()
            from .server import serve
            link = WorkerLink(slot, self.serving, self.ready_w, self.alive_r)
            code = asyncio.run(serve(self.config, self.chain, self.host, self.port, worker=link))
        except ConfigError as e:
            print(f"relay: config error: {e}", file=sys.stderr)
            code = 2
        except OSError as e:
            print(f"relay: worker {slot} cannot listen on {self.host}:{self.port}: "
                  f"{e.strerror or e}", file=sys.stderr)
            code = 2
        except BaseException:
            log.exception("worker %d failed", slot)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    def wait(self) -> None:
        timeout = None
        now = time.monotonic()
        if self.stop_deadline is not None:
            timeout = max(0.0, self.stop_deadline - now)
        elif not self.stopping:
            waiting = [self.restart_at[s] - now for s, pid in self.slots.items() if pid is None]
            if waiting:
                timeout = max(0.0, min(waiting))
        try:
            readable, _, _ = select.select([self.wake_r, self.ready_r], [], [], timeout)
        except InterruptedError:
            readable = []
        if self.ready_r in readable:
            self.read_ready()
        if self.wake_r in readable:
            for signum in self.drain_pipe(self.wake_r):
                if signum in (signal.SIGTERM, signal.SIGINT):
                    self.stop()
                elif signum == signal.SIGHUP:
                    hangup()
        self.reap()
        if self.stop_deadline is not None and time.monotonic() >= self.stop_deadline:
            for pid in self.pids:
                log.error("worker pid %d did not stop in time; killing it", pid)
                os.kill(pid, signal.SIGKILL)
            self.status = 1
            self.stop_deadline = None
        if not self.stopping:
            for slot, running in self.slots.items():
                if running is None and time.monotonic() >= self.restart_at[slot]:
                    log.warning("starting worker %d again", slot)
                    self.start(slot)

    @staticmethod
    def drain_pipe(fd: int) -> bytes:
        data = b""
        while True:
            try:
                chunk = os.read(fd, 512)
            except BlockingIOError:
                return data
            if not chunk:
                return data
            data += chunk

    def read_ready(self) -> None:
        for slot in self.drain_pipe(self.ready_r):
            self.ready.add(slot)
            self.ready_at[slot] = time.monotonic()
        self.serving.value = len(self.ready)
        if not self.announced and len(self.ready) == self.workers:
            self.announced = True
            logs.announce(f"relay listening on {url_of(self.reserved.getsockname())} "
                          f"({self.workers} workers)")

    def stop(self) -> None:
        self.stopping += 1
        if self.stopping == 1:
            self.stop_deadline = (time.monotonic() + self.config.unready_seconds
                                  + self.config.drain_seconds + KILL_GRACE)
            log.info("stopping %d worker(s): %sdraining for up to %gs", len(self.pids),
                     f"accepting for {self.config.unready_seconds:g}s, then "
                     if self.config.unready_seconds else "", self.config.drain_seconds)
        elif self.stop_deadline is not None:
            # The drains end now: a worker still there once the grace is over is stuck, however
            # long drain_seconds is.
            self.stop_deadline = min(self.stop_deadline, time.monotonic() + KILL_GRACE)
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):  # exited since the last reap
                os.kill(pid, STOP if self.stopping == 1 else HURRY)

    def reap(self) -> None:
        while self.pids:
            try:
                pid, wait_status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            slot = self.pids.pop(pid)
            self.slots[slot] = None
            was_ready = slot in self.ready
            self.ready.discard(slot)
            self.serving.value = len(self.ready)
            code = os.waitstatus_to_exitcode(wait_status)
            if self.stopping:
                if code != 0 and not self.status:
                    self.status = 1
                continue
            if not self.announced and not was_ready:
                # A worker that could not start: the others would fail alike.
                log.error("worker %d %s before it listened; stopping", slot,
                          how_it_ended(wait_status))
                self.status = code if code > 0 else 1
                self.stop()
                continue
            now = time.monotonic()
            served = now - self.ready_at[slot] if was_ready else None
            delay = self.delay[slot] = restart_delay(self.delay.get(slot), served)
            self.restart_at[slot] = now + delay
            log.error("worker %d (pid %d) %s %s; starting it again in %gs", slot, pid,
                      how_it_ended(wait_status),
                      "while serving" if was_ready else "before it listened", delay)


def run(config, chain, host: str, port: int, workers: int) -> int:
    return Supervisor(config, chain, host, port, workers).run()
