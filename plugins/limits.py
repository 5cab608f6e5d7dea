"""limits: each relay key's rate limits, concurrency and budgets, enforced before anything goes
upstream, and the key's own quota in the answer's headers in place of the upstream account's.

The limits are the key's (``server.auth.keys[i].limits`` over ``server.auth.default_limits``,
or what ``relay keys create --limits`` stored; see :mod:`relay.limits`). For a request with
any, ``relay_request`` makes ONE :meth:`relay.state.State.take`: a request counts toward its
requests per minute, a concurrency slot is taken, and the token and budget windows must still
be under their limits. Refused: ``429`` naming the limit, with ``retry-after``; granted: the
answer carries ``anthropic-ratelimit-*`` headers from the key's counts. Once the answer is in,
``relay_exchange_end`` (after the usage plugin's, which sets ``exchange.usage``) adds its
tokens and cost to their windows: an answer that crosses a budget finishes, the next request
is refused.

The slot goes back on every exit: the end of the exchange, and, should that never come (a
handler that failed or was cancelled before its exchange was made), the end of the request's
task. A fallback to another backend is the same client request: it takes nothing more.

When the state cannot be reached, ``state.on_unavailable`` decides: ``open`` lets the request
through unchecked (a warning, a note on the exchange, :attr:`Limits.unavailable` counted),
``closed`` refuses it with ``503``.

Put it first in ``pipeline:``: it refuses before any other plugin works on a request, and its
end hook runs last, after the usage plugin has the answer's usage.
"""

from __future__ import annotations

import asyncio
import logging
import time

from relay import limits
from relay.errors import RelayError
from relay.hookspecs import hookimpl
from relay.state import State, Unavailable

log = logging.getLogger("relay.plugins.limits")
WARN_EVERY = 60.0  # seconds between two warnings that the state is unreachable
REPLACES = (limits.RATELIMIT_PREFIX,)


class Held:
    """What one client request holds: its plan, its slots' release tokens, the headers its
    answer carries, and the task it runs in."""

    __slots__ = ("plan", "tokens", "headers", "task", "released")

    def __init__(self, plan: limits.Plan, tokens: tuple[str, ...], headers: dict[str, str],
                 task: asyncio.Task | None):
        self.plan = plan
        self.tokens = tokens
        self.headers = headers
        self.task = task
        self.released = not tokens


class Limits:
    OPTIONS = ()
    # Its request hook reads no history: a session's request may go on from where the
    # previous one ended (relay.resume) with this plugin in the pipeline.
    RESUMABLE = True

    def __init__(self) -> None:
        self.state: State | None = None
        self.held: dict[asyncio.Task, Held] = {}  # by the request's task: in flight now
        self.unavailable = 0  # requests let through unchecked, the state unreachable
        self._warned = 0.0

    @hookimpl
    def relay_startup(self, state: State) -> None:
        self.state = state

    @hookimpl
    def relay_request(self, exchange):
        # Not a coroutine: a take this process decides in its memory (leases) costs none.
        key = exchange.key
        if key is None:
            return None
        # A shared relay's answers describe the key's quota, never the pooled account's.
        exchange.replaces_headers = REPLACES
        if key.limits is None or exchange.endpoint != "messages":
            return None
        task = asyncio.current_task()
        before = self.held.get(task) if task is not None else None
        if before is not None:  # a fallback: the client's request has what it needs
            exchange.state["limits"] = before
            exchange.response_headers.update(before.headers)
            return None
        plan = key.limits.plan(key.name, limits.upstream_model(exchange.backend, exchange.model))
        if plan is None:
            return None
        assert self.state is not None  # relay_startup ran
        taken = self.state.take_now(plan.counters, plan.slots)
        if taken is None:
            return self._ask(exchange, plan, task)
        self._taken(exchange, plan, taken, task)
        return None

    async def _ask(self, exchange, plan: limits.Plan, task: asyncio.Task | None) -> None:
        assert self.state is not None
        try:
            # Not shielded: a backend gives back what it granted a caller that gave up (the
            # client gone while the state decided).
            taken = await self.state.take(plan.counters, plan.slots)
        except Unavailable as e:
            self._unreachable(exchange, e)
            return
        self._taken(exchange, plan, taken, task)

    def _taken(self, exchange, plan: limits.Plan, taken, task: asyncio.Task | None) -> None:
        if not taken.granted:
            assert taken.blocked is not None  # a refusal names what refused
            error, headers = limits.refusal(plan, taken.counts, taken.blocked, time.time())
            error.rule = plan.limits[taken.blocked].name
            exchange.response_headers.update(headers)
            exchange.note("limits", "refused", limit=error.rule, key=plan.key)
            raise error
        headers = limits.quota_headers(plan, taken.counts)
        held = Held(plan, taken.tokens, headers, task)
        exchange.state["limits"] = held
        exchange.response_headers.update(headers)
        if task is not None:  # for a fallback to find, and the task's end to give back
            self.held[task] = held
            task.add_done_callback(self._task_done)

    @hookimpl
    def relay_exchange_end(self, exchange) -> None:
        held: Held | None = exchange.state.get("limits")
        if held is None:
            return
        task = held.task
        if task is not None and self.held.get(task) is held:
            del self.held[task]
            task.remove_done_callback(self._task_done)
        state = self.state
        if state is None:
            return
        self._release(held)
        plan = held.plan
        if plan.added:
            added = limits.spent(plan, getattr(exchange, "usage", None))
            if added:
                state.add_soon(added)

    def _task_done(self, task: asyncio.Task) -> None:
        """The request's task ended without its exchange's end (the handler failed before
        an exchange could be finished): give its slots back."""
        held = self.held.pop(task, None)
        if held is not None:
            self._release(held)

    def _release(self, held: Held) -> None:
        # Every backend queues a release (its lease gives back one it cannot write).
        if held.released or self.state is None:
            return
        held.released = True
        release = self.state.release_soon
        for slot, token in zip(held.plan.slots, held.tokens, strict=True):
            release(slot.name, token)

    def _unreachable(self, exchange, error: Unavailable) -> None:
        assert self.state is not None
        if self.state.on_unavailable == "closed":
            raise RelayError(503, "the relay cannot reach its shared state to check this key's "
                                  "limits (state.on_unavailable: closed); the request was not "
                                  "sent", "api_error")
        self.unavailable += 1
        exchange.note("limits", "state unavailable: let through unchecked")
        self._warn(f"limits: the state is unreachable; requests go through without their "
                   f"keys' limits (state.on_unavailable: open) ({error})")

    def _warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self._warned >= WARN_EVERY:
            self._warned = now
            log.warning("%s", message)

