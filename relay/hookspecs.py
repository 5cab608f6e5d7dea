"""Every hook a relay plugin can implement, each typed and documented once, with the order
the chain calls its implementations in (``@called_in``).

Errors: :class:`relay.errors.RelayError` (``RelayError(status, message, type=None)``; the
type defaults to the API's own for the status, e.g. 400 ``invalid_request_error``, 403
``permission_error``, 429 ``rate_limit_error``) answers the client in Anthropic's error
format. What raising it does depends on the hook, and each hook below says so.

A plugin is a module or class registered under the ``relay.plugins`` entry-point group.
The ``pipeline:`` list in relay.yaml is the order a request travels up; everything that
comes back (responses, stream events, the end of the exchange) visits the plugins in
reverse, like aiohttp's middleware onion. The relay calls each implementation itself,
in that order, and awaits it when it returns an awaitable: pluggy's ``tryfirst`` and
``trylast`` have no effect on chain hooks.

Every chain hook receives ``options``: the plugin's own section of ``plugins:`` in
relay.yaml overlaid with the chosen backend's ``quirks:`` (quirks win). An implementation
may accept any subset of a hook's arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from .config import Config
    from .exchange import Exchange, UpstreamResponse
    from .sse import Event
    from .state import State

hookspec = pluggy.HookspecMarker("relay")
hookimpl = pluggy.HookimplMarker("relay")

# How the chain calls a hook's implementations: in pipeline order (the request going up), or
# in reverse (everything coming back, like aiohttp's middleware onion).
PIPELINE, REVERSE = "pipeline order", "reverse pipeline order"


def called_in(order: str):
    """Declare, next to a hook's spec, the order its implementations are called in."""
    def mark(spec):
        spec.relay_order = order
        return spec
    return mark


# --- start-up ---------------------------------------------------------------------------


@hookspec
@called_in(PIPELINE)
def relay_startup(config: Config, options: dict, state: State) -> None:
    """Called once per plugin after relay.yaml is loaded and before the server listens.

    ``config`` is the whole validated :class:`relay.config.Config`; ``options`` is the plugin's
    own ``plugins:`` section (without quirks); ``state`` the host's shared state
    (:class:`relay.state.State`, opened from relay.yaml's ``state:``), to keep for the
    plugin's own records and counters. Check options here and raise
    :class:`relay.errors.ConfigError` with a key path (``plugins.dump.dir: ...``) to stop
    start-up. May prepare resources; must not change ``config``.
    """


@hookspec
@called_in(PIPELINE)
def relay_routes(config: Config, options: dict, state: State) -> dict[str, Callable] | None:
    """Called once at start-up: return the HTTP routes this plugin serves, as a mapping of
    ``"METHOD /path"`` to an aiohttp handler (``async def handler(request) -> web.Response``),
    or None.

    The relay serves them beside its own endpoints, behind the same checks (the request
    target, the Host, inbound keys); a handler wrapped in :class:`relay.inbound.AdminRoute`
    is the operator's and takes the admin key instead of a relay key. A path is plain (no
    wildcards) and may not be one the relay or another plugin already serves (a ConfigError
    at start-up).
    """


@hookspec
@called_in(REVERSE)
def relay_shutdown(config: Config) -> None:
    """Called once when the server stops, after the last exchange has ended.

    Finish or cancel background work (pending writes, open files). Exceptions are logged.
    """


# --- the request on its way up ----------------------------------------------------------


@hookspec
@called_in(PIPELINE)
def relay_request(exchange: Exchange, options: dict) -> None:
    """Called for each ``/v1/messages`` and ``/v1/messages/count_tokens`` request, after the
    backend is chosen and before anything is sent upstream, in pipeline order.

    ``exchange.messages`` is the conversation as a skeleton (roles, block types and tool ids
    decoded, other values left as the client's JSON text until someone asks for the body:
    read them with ``relay.skeleton.value``); ``exchange.body`` is the whole request,
    decoded in place on first use, which costs far more on a long history. A plugin may
    change either in place and must then call ``exchange.mark_changed()``; when no plugin
    does, the client's original bytes go up.
    Raise :class:`relay.errors.RelayError` to refuse the request: the client gets that error,
    later plugins are skipped and the upstream receives nothing.

    Resuming: a plugin that declares ``RESUMABLE = True`` (module or class attribute) may
    be handed a request that continues the session's previous one, with
    ``exchange.resume`` (a :class:`relay.resume.Resume`) saying where its walk starts,
    what it saved there and at which boundaries to save its state now; its result must be
    the one the whole walk gives. While one plugin with this hook does not declare it,
    every request is walked whole and ``exchange.resume`` is None.
    """


# --- the answer on its way back ---------------------------------------------------------


@hookspec
@called_in(REVERSE)
def relay_response(exchange: Exchange, response: UpstreamResponse, options: dict) -> None:
    """Called for a successful (2xx) non-streaming ``/v1/messages`` answer (not for
    count_tokens, whose answer holds no content), in reverse pipeline order.

    ``response.data`` is the parsed body (None for one that is not JSON, which goes back as
    the upstream sent it). A plugin may change it in place and must then call
    ``response.mark_changed()``; unchanged answers reach the client as the upstream's bytes.
    ``response.headers`` (upstream headers) and ``exchange.response_headers`` (extra headers
    for the client) may be changed too. Raise :class:`relay.errors.RelayError` to answer the
    client with that error instead; any other exception is logged and the upstream's own
    answer goes back unchanged.
    """


@hookspec
@called_in(REVERSE)
def relay_stream_events(exchange: Exchange, options: dict) -> Iterable[str] | str | None:
    """Called once when an upstream answers with an event stream, before the first event.

    Return the event names (``{"content_block_start"}``) this plugin wants to see through
    :func:`relay_stream_event` for this exchange, ``"*"`` for every event, or ``None`` for
    none. Events no plugin asked for are forwarded as their original bytes, unparsed.
    Called for every plugin that implements it, so a plugin may also use it to learn that a
    stream began. An exception is logged and the plugin sees no events of this stream.
    """


@hookspec
@called_in(REVERSE)
def relay_stream_event(exchange: Exchange, event: Event, options: dict) -> Iterable[str] | None:
    """Called for each stream event this plugin asked for, in reverse pipeline order, before
    the event is flushed to the client.

    ``event.name`` is the SSE event name and ``event.data`` the parsed JSON. A plugin may
    change ``event.data`` in place and must then call ``event.mark_changed()``; the event is
    re-serialised only then. Return more event names to see from the next event of this
    stream on (the deltas of a block whose start it just saw), or None: what nobody asked for
    is never framed. Keep it quick: the client waits for this event until every
    plugin has returned. Raise :class:`relay.errors.RelayError` to end the stream: the
    client gets an ``error`` event with its type and message instead of this event, and
    nothing after it. Any other exception is logged and the event goes on.
    """


@hookspec
@called_in(REVERSE)
def relay_upstream_error(exchange: Exchange, response: UpstreamResponse, options: dict) -> None:
    """Called when the upstream answers with a non-2xx status, in reverse pipeline order.

    ``response.status``, ``response.headers`` and ``response.body`` (bytes) are what the
    upstream sent; they go back to the client unmodified, since clients match on the wording.
    For observing (logging, dumps) only: changes are ignored, and so is any exception
    (:class:`relay.errors.RelayError` included), which is logged.
    """


@hookspec
@called_in(REVERSE)
def relay_exchange_end(exchange: Exchange, options: dict) -> None:
    """Called once when an exchange is over, whatever happened, in reverse pipeline order:
    for every request the relay answered, pass-through and refusals included.

    It runs after the client has its answer: a complete answer (or a refusal) has been
    written to the last byte, a stream has ended. It does run before the next request on
    the same kept-alive connection is read, so keep it quick (hand slow work, such as
    writing a file, to a thread or a task). ``exchange`` is the complete record (see
    :class:`relay.exchange.Exchange`): ``endpoint`` (``messages``, ``count_tokens``,
    ``passthrough``, or ``refused`` for a request turned away before it was routed, such as
    an auth failure), ``outcome`` (a :class:`relay.exchange.Outcome`: ``ok``, ``rejected``,
    ``refused``, ``upstream_error``, ``upstream_malformed``, ``stream_error``,
    ``upstream_unreachable``, ``pool_full``, ``client_disconnected``, ``relay_error``),
    ``answer`` (status, headers, size), ``attempts``, ``upstream_request`` and
    ``upstream_response``, ``stream_failure``, ``timings`` and ``timeline``. This hook
    cannot change the answer. Exceptions are logged and swallowed.
    """


# --- offline tools ----------------------------------------------------------------------


@hookspec
@called_in(PIPELINE)
def relay_validate(exchange: Exchange, options: dict, repair: bool) -> list[dict[str, Any]] | None:
    """Called by ``relay validate`` (offline, no upstream) in pipeline order.

    Return every problem this plugin finds in the request (``exchange.messages`` or
    ``exchange.body``) — not only the first — as a list of
    ``{"location": "messages.6", "message": "..."}`` with the API's wording, or None.
    When ``repair`` is true, first repair the request in place where the plugin can
    (calling ``exchange.mark_changed()``) and return only the problems left.
    """
