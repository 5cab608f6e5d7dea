"""Finding plugins, and running each hook along the pipeline in YAML order.

pluggy holds the registrations and checks them against the hook specs; the chain calls
the implementations itself so that the order is the pipeline's, each plugin gets its own
options, and awaitables are awaited.
"""

from __future__ import annotations

import difflib
import inspect
import logging
import os
from importlib.metadata import entry_points

import pluggy

from . import hookspecs
from .config import HOST_QUIRKS
from .errors import ConfigError, RelayError
from .options import declared, resolve
from .resume import Decline
from .skeleton import UNREADABLE
from .state import State, open_state

ENTRY_POINT_GROUP = "relay.plugins"
log = logging.getLogger("relay.chain")



def available_plugins() -> dict:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def available_quirks() -> set[str]:
    """The quirks the host reads and those every installed plugin declares (loading each;
    one that fails to load declares nothing)."""
    names = set(HOST_QUIRKS)
    for entry_point in available_plugins().values():
        try:
            plugin = entry_point.load()
        except Exception:
            continue
        names.update(option.name for option in declared(plugin) or () if option.quirk)
    return names


def load_plugins(names: list[str], extra: dict | None = None) -> pluggy.PluginManager:
    """A fresh plugin manager holding the named plugins, found through entry points.

    ``extra`` maps names to plugin objects registered as if an entry point had named them
    (for tests and embedding).
    """
    pm = pluggy.PluginManager("relay")
    pm.add_hookspecs(hookspecs)
    found = available_plugins()
    extra = extra or {}
    for i, name in enumerate(names):
        if name in extra:
            plugin = extra[name]
        elif name in found:
            try:
                plugin = found[name].load()
            except Exception as e:
                raise ConfigError(f"pipeline[{i}]: plugin {name!r} failed to load: {e}") from e
        else:
            known = sorted(set(found) | set(extra))
            raise ConfigError(f"pipeline[{i}]: unknown plugin {name!r} "
                              f"(available: {', '.join(known) or 'none'})")
        where = f"pipeline[{i}]: plugin {name!r}"
        if inspect.isclass(plugin):
            try:
                plugin = plugin()
            except Exception as e:
                raise ConfigError(f"{where}: could not be created (the relay makes one instance "
                                  f"with no arguments): {type(e).__name__}: {e}") from e
        _check_hooks(plugin, where)
        try:
            pm.register(plugin, name=name)
        except pluggy.PluginValidationError as e:
            raise ConfigError(f"{where}: {_validation_message(e)}") from e
    return pm


HOOK_NAMES = sorted(name for name in dir(hookspecs) if name.startswith("relay_"))


def _check_hooks(plugin, where: str) -> None:
    """Every ``relay_*`` attribute marked as a hook must name a hook, and be a plain one (not
    a wrapper): a misspelt one or a wrapper would otherwise never be called, and nothing
    would say why."""
    for attribute in dir(plugin):
        if not attribute.startswith("relay_"):
            continue
        function = getattr(plugin, attribute, None)
        marked = getattr(function, "relay_impl", None) if callable(function) else None
        if isinstance(marked, dict) and (marked.get("wrapper") or marked.get("hookwrapper")):
            # The chain calls each implementation itself, in pipeline order: a wrapper's
            # generator would be made and never run, its code silently skipped.
            raise ConfigError(f"{where}: {attribute} is a hook wrapper (wrapper=True or "
                              "hookwrapper=True), which the relay does not run: it calls each "
                              "plugin's hook in pipeline order; make it a plain hook")
        if attribute in HOOK_NAMES:
            continue
        if callable(function) and getattr(function, "relay_impl", None) is not None:
            close = difflib.get_close_matches(attribute, HOOK_NAMES, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"{where}: {attribute} is not a relay hook{hint}")


def _validation_message(error: pluggy.PluginValidationError) -> str:
    """pluggy's complaint about a hook implementation, said the relay's way."""
    text = str(error)
    hook = next((name for name in HOOK_NAMES if name in text), None)
    if hook is not None and "Argument(s)" in text:
        names = text.split("Argument(s)", 1)[1].split("are declared", 1)[0].strip()
        accepted = ", ".join(inspect.signature(getattr(hookspecs, hook)).parameters)
        return f"{hook} takes no argument(s) {names} (it may take any of: {accepted})"
    return text


def _traced(plugin: str, hook: str, function):
    """Wrap a hook implementation so each call is logged (RELAY_TRACE=1), with the request id
    and, for an async hook, what it returned once awaited."""
    names = list(inspect.signature(function).parameters)

    def call(*args, **kwargs):
        # The chain passes what a hook takes by position.
        kwargs.update(zip(names, args, strict=False))
        exchange = kwargs.get("exchange")
        request_id = exchange.id if exchange is not None else "-"
        result = function(**kwargs)
        if inspect.isawaitable(result):
            async def awaited():
                value = await result
                log.info("trace %s %s.%s -> %r", request_id, plugin, hook, value)
                return value
            return awaited()
        log.info("trace %s %s.%s -> %r", request_id, plugin, hook, result)
        return result
    # pluggy reads the arguments a hook takes from its signature; mypy does not model
    # attributes set on a function.
    call.__signature__ = inspect.signature(function)  # type: ignore[attr-defined]
    return call


class _Impl:
    """One plugin's implementation of one hook. pluggy's ``argnames`` are the function's
    positional parameters in order, so the chain passes the ones it takes by position: the
    hot hooks (a request's, an exchange's end, a stream event's) are called with their
    arguments in hand, without building a dict per call."""

    __slots__ = ("plugin", "function", "argnames", "takes", "_order")

    def __init__(self, plugin: str, function, argnames):
        self.plugin = plugin
        self.function = function
        self.argnames = argnames
        # The usual argument lists as the very tuples below (the chain's loops test them by
        # identity), or None.
        self.takes = _EXCHANGE_OPTIONS if argnames == _EXCHANGE_OPTIONS else \
            _EXCHANGE if argnames == _EXCHANGE else None
        # For call_one: which usual order the implementation takes its arguments in (the
        # exchange 0, the options 1, the third argument 2); 0: any other (call_one then
        # builds the arguments by name).
        self._order = _ORDERS.get(tuple(
            0 if name == "exchange" else 1 if name == "options" else 2 for name in argnames), 0)

    def call(self, kwargs: dict):
        return self.function(*[kwargs[name] for name in self.argnames])

    def call_with(self, exchange, options, **more):
        """The call for a hook whose arguments are ``exchange``, ``options`` and ``more``."""
        names = self.argnames
        if names == _EXCHANGE_OPTIONS:
            return self.function(exchange, options)
        if not more and names == _EXCHANGE:
            return self.function(exchange)
        more["exchange"] = exchange
        more["options"] = options
        return self.function(*[more[name] for name in names])

    def call_one(self, exchange, options, name: str, value):
        """:meth:`call_with` for a hook whose arguments are ``exchange``, ``options`` and one
        more, ``name`` (``response``, ``event``: pluggy lets an implementation take no other),
        without a dict or a list per call where it takes them in a usual order."""
        order = self._order
        function = self.function
        if order == 1:
            return function(exchange, value, options)
        if order == 2:
            return function(exchange, value)
        if order == 3:
            return function(exchange, options)
        if order == 4:
            return function(exchange)
        return self.call_with(exchange, options, **{name: value})


_EXCHANGE_OPTIONS = ("exchange", "options")
_EXCHANGE = ("exchange",)
# (exchange, value, options), (exchange, value), (exchange, options), (exchange,)
_ORDERS: dict[tuple[int, ...], int] = {(0, 2, 1): 1, (0, 2): 2, (0, 1): 3, (0,): 4}


def _awaitable(value) -> bool:
    """:func:`inspect.isawaitable` for a hook's result, with the common answers (a
    coroutine, a plain value) found without its ABC checks."""
    kind = value.__class__
    if kind is _COROUTINE:
        return True
    if kind in _PLAIN:
        return False
    return inspect.isawaitable(value)


async def _probe() -> None:
    pass


_probe_coroutine = _probe()
_COROUTINE = type(_probe_coroutine)
_probe_coroutine.close()
_PLAIN = frozenset({bool, int, float, str, bytes, list, tuple, dict, set, frozenset})


class StreamPlan:
    """Which plugins see which stream events of one exchange, decided once per stream."""

    __slots__ = ("by_name", "every")

    def __init__(self) -> None:
        self.by_name: dict[str, list] = {}
        self.every: list = []  # plugins that asked for "*"

    def calls_for(self, name):
        wanted = self.by_name.get(name)
        if not self.every or wanted is not None:
            return wanted
        return self.every

    def framed_names(self) -> set[str] | None:
        """The events :class:`relay.sse.LazyFramer` must frame: those plugins asked for.
        None: frame every event."""
        if self.every:
            return None
        return set(self.by_name)

    def widen(self, more: list) -> None:
        """Add what plugins asked for mid-stream: ``(call, names)`` pairs, as
        :meth:`Chain.stream_event` returns them; each name's calls stay in chain order."""
        for call, names in more:
            try:
                names = [names] if isinstance(names, str) else list(names)
            except TypeError:
                names = [names]
            for name in names:
                if not isinstance(name, str):
                    log.error("plugin %s: relay_stream_event returned %r, not an event name",
                              call[1].plugin, name)
                    continue
                calls = self.by_name.get(name)
                if calls is None:
                    calls = self.by_name[name] = list(self.every)
                if call not in calls:
                    calls.append(call)
                    calls.sort(key=lambda c: c[0])

    def merge_every(self) -> None:
        """Fold the "*" plugins into each named list once, keeping chain order."""
        if self.every:
            for name, calls in self.by_name.items():
                self.by_name[name] = sorted(calls + self.every, key=lambda c: c[0])

    def __bool__(self):
        return bool(self.by_name or self.every)


class Chain:
    """The pipeline: each hook's implementations in order, and per-backend options."""

    def __init__(self, pm: pluggy.PluginManager, config):
        self.pm = pm
        self.pipeline = list(config.pipeline)
        position = {name: i for i, name in enumerate(self.pipeline)}
        # Each implementation is called by the chain, not through pm.hook, so pluggy's own
        # tracing would see nothing: RELAY_TRACE wraps the implementations instead.
        trace = bool(os.environ.get("RELAY_TRACE"))
        self.impls: dict[str, list[_Impl]] = {}
        for spec_name in dir(hookspecs):
            if not spec_name.startswith("relay_"):
                continue
            caller = getattr(pm.hook, spec_name)
            impls = [_Impl(h.plugin_name,
                           _traced(h.plugin_name, spec_name, h.function) if trace else h.function,
                           tuple(h.argnames))
                     for h in caller.get_hookimpls()]
            impls.sort(key=lambda impl: position.get(impl.plugin, len(position)),
                       reverse=getattr(hookspecs, spec_name).relay_order == hookspecs.REVERSE)
            self.impls[spec_name] = impls
        # Checked against the plugins' declarations, and merged with the quirks each plugin
        # declared, once here rather than on every request.
        base, per_backend = resolve(config, {name: pm.get_plugin(name) for name in self.pipeline},
                                    elsewhere=available_quirks)
        self.options: dict[str | None, dict[str, dict]] = {None: base, **per_backend}
        # Opened by startup (from relay.yaml's ``state:``), closed by shutdown.
        self.state: State | None = None
        self.positions = position
        # The plugins that walk requests (relay.resume: each must be able to go on from
        # where the session's previous request ended).
        self.walkers = frozenset(impl.plugin for impl in self.impls["relay_request"])
        self._event_hooks = {impl.plugin: impl for impl in self.impls["relay_stream_event"]}

    def resumable(self) -> bool:
        """Whether every plugin with a ``relay_request`` hook declares ``RESUMABLE``."""
        return all(getattr(self.pm.get_plugin(name), "RESUMABLE", False) is True
                   for name in self.walkers)

    def position(self, plugin: str) -> int:
        return self.positions.get(plugin, len(self.positions))

    def options_for(self, exchange) -> dict[str, dict]:
        return self.options[exchange.backend.name if exchange.backend else None]

    async def startup(self, config) -> None:
        """Each plugin's ``relay_startup``. A :class:`ConfigError` stops start-up as it is (it
        names its key path); any other exception stops it naming the plugin."""
        if self.state is None:
            self.state = await open_state(config.state)
        for impl in self.impls["relay_startup"]:
            try:
                result = impl.call({"config": config, "state": self.state,
                                    "options": self.options[None][impl.plugin]})
                if inspect.isawaitable(result):
                    await result
            except ConfigError:
                raise
            except Exception as e:
                where = f"pipeline[{self.pipeline.index(impl.plugin)}]: plugin {impl.plugin!r}"
                raise ConfigError(f"{where}: relay_startup failed: {type(e).__name__}: {e}") from e

    def routes(self, config, reserved=()) -> dict:
        """The plugins' HTTP routes (``relay_routes``), as ``{(method, path): handler}``."""
        found: dict = {}
        for impl in self.impls["relay_routes"]:
            result = impl.call({"config": config, "state": self.state,
                                "options": self.options[None][impl.plugin]})
            for spec, handler in (result or {}).items():
                method, _, path = str(spec).partition(" ")
                where = f"plugin {impl.plugin!r}: route {spec!r}"
                if not method.isupper() or not path.startswith("/") or "*" in path:
                    raise ConfigError(f"{where}: must be \"METHOD /path\"")
                if (method, path) in found or path in reserved:
                    raise ConfigError(f"{where}: that path is served already")
                found[method, path] = handler
        return found

    async def shutdown(self, config) -> None:
        for impl in self.impls["relay_shutdown"]:
            try:
                result = impl.call({"config": config})
                if inspect.isawaitable(result):
                    await result
            except Exception:
                log.exception("plugin %s failed in relay_shutdown", impl.plugin)
        if self.state is not None:
            state, self.state = self.state, None
            await state.close()

    async def run(self, hook: str, exchange, **kwargs) -> list:
        """Call every implementation of ``hook`` in chain order; return their results.

        A :class:`RelayError` stops the chain and propagates; so does any other exception,
        after being logged with the plugin's name.
        """
        options = self.options_for(exchange)
        results = []
        one = next(iter(kwargs.items())) if len(kwargs) == 1 else None
        for impl in self.impls[hook]:
            try:
                if one is not None:
                    result = impl.call_one(exchange, options[impl.plugin], *one)
                elif impl.takes is _EXCHANGE_OPTIONS:  # the usual two: no call of call_with's
                    result = impl.function(exchange, options[impl.plugin])
                elif impl.takes is _EXCHANGE:
                    result = impl.function(exchange)
                else:
                    result = impl.call_with(exchange, options[impl.plugin], **kwargs)
                if result is not None and _awaitable(result):
                    result = await result
            except RelayError as error:
                if getattr(error, "plugin", None) is None:
                    error.plugin = impl.plugin  # who refused: for logs, dumps and metrics
                raise
            except Decline:
                raise  # not a fault: the request is walked whole instead
            except Exception as e:
                # A raw value of the request's that is not JSON after all is the client's
                # error (a 400, see relay.prepare), not the plugin's that read it.
                if not (hook == "relay_request" and isinstance(e, UNREADABLE)):
                    log.exception("plugin %s failed in %s", impl.plugin, hook)
                raise
            results.append(result)
        return results

    async def end(self, exchange) -> None:
        """The end-of-exchange hooks: every one runs, and none can fail the exchange."""
        options = self.options_for(exchange)
        for impl in self.impls["relay_exchange_end"]:
            try:
                takes = impl.takes
                if takes is _EXCHANGE:  # the usual two: no call of call_with's
                    result = impl.function(exchange)
                elif takes is _EXCHANGE_OPTIONS:
                    result = impl.function(exchange, options[impl.plugin])
                else:
                    result = impl.call_with(exchange, options[impl.plugin])
                if result is not None and _awaitable(result):
                    await result
            except Exception:
                log.exception("plugin %s failed in relay_exchange_end", impl.plugin)

    async def stream_plan(self, exchange) -> StreamPlan:
        plan = StreamPlan()
        options = self.options_for(exchange)
        hooks = self._event_hooks
        for order, impl in enumerate(self.impls["relay_stream_events"]):
            event_hook = hooks.get(impl.plugin)
            try:
                takes = impl.takes
                if takes is _EXCHANGE:  # the usual two: no call of call_with's
                    wanted = impl.function(exchange)
                elif takes is _EXCHANGE_OPTIONS:
                    wanted = impl.function(exchange, options[impl.plugin])
                else:
                    wanted = impl.call_with(exchange, options[impl.plugin])
                if wanted is not None and _awaitable(wanted):
                    wanted = await wanted
            except Exception:
                log.exception("plugin %s failed in relay_stream_events; it sees no events",
                              impl.plugin)
                continue
            if not wanted or event_hook is None:
                continue
            call = (order, event_hook, options[impl.plugin])
            if wanted == "*":
                plan.every.append(call)
                continue
            for name in {wanted} if isinstance(wanted, str) else wanted:
                if isinstance(name, str):
                    plan.by_name.setdefault(name, []).append(call)
                else:
                    log.error("plugin %s: relay_stream_events returned %r, not an event name",
                              impl.plugin, name)
        plan.merge_every()
        return plan

    async def stream_event(self, exchange, event, calls) -> list | None:
        """Run the plugins that asked for this event; return the event names they want from
        now on, as ``(call, names)`` pairs for :meth:`StreamPlan.widen`, or None. A
        :class:`RelayError` ends the stream (it propagates); any other exception is logged and
        the next plugin runs, and whatever the plugin had changed (and marked changed) before
        raising stays."""
        more = None
        for call in calls:
            impl, options = call[1], call[2]
            try:
                result = impl.call_one(exchange, options, "event", event)
                if result is not None and _awaitable(result):
                    result = await result
            except RelayError as error:
                error.plugin = error.plugin or impl.plugin
                raise
            except Exception:
                log.exception("plugin %s failed on stream event %s", impl.plugin, event.name)
                continue
            if result:
                if more is None:
                    more = []
                more.append((call, result))
        return more
