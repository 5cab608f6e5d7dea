"""usage: what each exchange used and cost, on the exchange, in the ledger, and queryable.

The usage of an exchange is what its answer reports (:mod:`relay.usage` says how it is read,
counted and priced): a complete answer's ``usage``, read without decoding the answer's content;
a stream's ``message_start`` and ``message_delta`` events, the only ones this plugin asks to
see. It is set on the exchange as ``exchange.usage`` (a :class:`relay.usage.Usage`) as soon as
it is known, for the access log, the metrics and the other plugins' end hooks, and written to
the ledger (:meth:`relay.state.State.record`) once the exchange is over: one row per exchange,
by its id, so a write that is retried never counts twice. An answer whose upstream did not
report its usage in full (none at all, a count missing or not a count: an OpenAI-format server
that ignores ``stream_options.include_usage``, say) is counted as far as it was reported and
flagged ``reported=False`` (``usage_reported`` in its row), never taken for a free one. A
request turned away before it was routed (a wrong key, a bad Host) makes no row: whoever sends
those cannot fill the ledger.

``GET /v1/relay/usage?by=key|model|backend|day&since=...&until=...`` is the ledger added up,
as ``relay usage --json`` prints it. It is the operator's (a :class:`relay.inbound.AdminRoute`):
it takes the admin key (``server.auth.admin_key_env``), never a client's relay key, since it
shows every key's spend.

Put ``usage`` early in ``pipeline:`` (after ``limits``): end hooks run in reverse order, so
its row is written after every later plugin has noted what it did (a dump's file name), and
before ``limits`` reads ``exchange.usage``.

Options: see ``Usage.OPTIONS``.
"""

from __future__ import annotations

import asyncio
import logging
import os

import orjson
from aiohttp import web

from relay import usage as metering
from relay.errors import error_body
from relay.hookspecs import hookimpl
from relay.inbound import AdminRoute
from relay.options import Option
from relay.state import Unavailable

log = logging.getLogger("relay.plugins.usage")

PLUGIN = "usage"
PATH = "/v1/relay/usage"
TIMELINE = 64  # entries of an exchange's timeline a row keeps
STREAM_EVENTS = ("message_start", "message_delta")
MAX_WARNED = 64  # unpriced models named in the log, once each: the names are the clients'


class Usage:
    """The usage plugin; the host makes one instance per relay."""

    # Its request hook reads no history: a session's request may go on from where the
    # previous one ended (relay.resume) with this plugin in the pipeline.
    RESUMABLE = True
    OPTIONS = (Option(
        "prices", list, [],
        "what each model costs: a list of `{models: [glob, ...], usd_per_mtok: {input, "
        "output, cache_write_5m, cache_write_1h, cache_read}, usd_per_server_tool_request: "
        "{web_search: ...}}`, the first entry whose globs match the model wins; a model no "
        "entry matches is counted in tokens and flagged unpriced",
        parse=metering.parse_prices),)

    def __init__(self):
        self.prices = metering.Prices()
        self.state = None
        self.warned: set[str] = set()
        self.unreported_warned: set[str] = set()
        self.keeps_rows = True

    @hookimpl
    def relay_startup(self, config, options, state):
        self.prices = options["prices"]
        self.state = state
        # Rows in this process's memory (no ``state: url``) are read only through the
        # operator's routes (this plugin's, the console's), which need the admin key: without
        # one, nothing could ever read them, and none is kept.
        self.keeps_rows = state.kind != "memory" or config.admin_key is not None

    @hookimpl
    def relay_routes(self):
        return {f"GET {PATH}": AdminRoute(self.serve)}

    @hookimpl
    def relay_request(self, exchange):
        # The row's session, while the request is still held as the skeleton: after it has
        # gone upstream, it would cost a second decode of the whole request.
        if self.keeps_rows:
            exchange.session()

    @hookimpl
    def relay_response(self, exchange, response):
        if response.changed:  # a plugin changed the answer: what it says now counts
            data = response.data
            if data.__class__ is not dict:
                return
            model, reported = data.get("model"), data.get("usage")
        else:
            model, reported = metering.answer_fields(response.body)
        # An answer without usage is still an answer that was paid for: counted as nothing,
        # and flagged, never taken for a free one.
        used = metering.from_answer(reported)
        if exchange.unreported_usage:
            used.reported = False
        exchange.usage = self.prices.price(used,
                                           model if model.__class__ is str else exchange.model)

    @hookimpl
    def relay_stream_events(self, exchange):
        exchange.state[PLUGIN] = metering.StreamMeter()
        return STREAM_EVENTS

    @hookimpl
    def relay_stream_event(self, exchange, event):
        meter = exchange.state[PLUGIN]
        # The event's bytes, read for its usage alone, unless a plugin changed its data.
        used = None if event.changed else meter.event(event.name, event.raw)
        if used is None:
            used = (meter.message_start(event.data) if event.name == "message_start"
                    else meter.message_delta(event.data))
        if exchange.unreported_usage:  # a translated stream's, known by its message_delta
            used.reported = False
        exchange.usage = self.prices.price(used, meter.model or exchange.model)

    @hookimpl
    def relay_exchange_end(self, exchange):
        if exchange.endpoint == "refused" or self.state is None:
            return
        used = exchange.usage
        if used is not None:
            if used.cost_micro_usd is None:
                self._unpriced(exchange.model)
            if not used.reported:
                self._unreported(exchange)
        if self.keeps_rows:
            self.state.record_soon([ledger_row(exchange)])

    def _unpriced(self, model: str | None) -> None:
        name = str(model)[:200]
        if name in self.warned or len(self.warned) >= MAX_WARNED:
            return
        self.warned.add(name)
        log.warning("plugins.usage.prices: no price for model %r: its usage is counted in "
                    "tokens, not in cost (relay_usage_unpriced_total)", name)

    def _unreported(self, exchange) -> None:
        backend = exchange.backend.name if exchange.backend is not None else "-"
        if backend in self.unreported_warned:  # backends are relay.yaml's: a bounded set
            return
        self.unreported_warned.add(backend)
        missing = ", ".join(exchange.unreported_usage)
        log.warning("%s: upstream %s did not report the usage of its answer in full%s: what "
                    "it reported is counted, and may be short of what was used "
                    "(usage_reported=false, relay_usage_unreported_total; said once a backend)",
                    exchange.id, backend, f" ({missing})" if missing else "")

    async def serve(self, request: web.Request) -> web.Response:
        query = request.query
        by = query.get("by", "key")
        try:
            since = metering.parse_time(query["since"]) if "since" in query else None
            until = metering.parse_time(query["until"], end=True) if "until" in query else None
            if by not in metering.GROUPS:
                raise ValueError(f"by: must be one of {', '.join(metering.GROUPS)}")
        except ValueError as e:
            return web.Response(status=400, body=error_body("invalid_request_error", str(e)),
                                content_type="application/json")
        assert self.state is not None  # routes are served after start-up
        try:
            rows = await self.state.rows(since=since, until=until)
        except Unavailable as e:
            # The ledger out of reach is the state's trouble, said as the relay says it
            # elsewhere (a 503 in Anthropic's format), not aiohttp's bare 500 and a traceback.
            return web.Response(status=503, body=error_body(
                "api_error", f"the shared state cannot be reached now: {e}"),
                content_type="application/json")
        # Months of rows are a lot of adding up: not on the event loop.
        groups = await asyncio.get_running_loop().run_in_executor(
            None, metering.aggregate, rows, by)
        return web.Response(body=orjson.dumps(groups), content_type="application/json")


def ledger_row(exchange) -> dict:
    """The exchange's row in the ledger (the fields every reader of the ledger relies on)."""
    used = exchange.usage
    answer = exchange.answer
    backend = exchange.backend
    dump = exchange.dump_path
    notes = exchange.response_headers.get("x-relay-notes")
    outcome = exchange.outcome
    attempts = exchange.attempts
    row = {
        "id": exchange.id,
        "time": exchange.received,
        "key": exchange.key_name,
        "backend": backend.name if backend is not None else None,
        "credential": exchange.credential,
        "model": exchange.model,
        "endpoint": exchange.endpoint,
        "stream": exchange.stream,
        "status": answer.status if answer is not None else None,
        # An outcome is a str: its text, without the enum's __str__ (a Python call).
        "outcome": str.__str__(outcome) if outcome is not None else None,
        "duration_ms": round(exchange.elapsed() * 1000, 1),
        "session": exchange.session(),
        "cache": exchange.cache,
        "repairs": exchange.repairs,
        "notes": notes.split(", ") if notes else [],
        "dump": os.path.basename(dump) if dump else None,
        "timeline": exchange.timeline[:TIMELINE],
        "attempts": [{"backend": attempt.backend, "credential": attempt.credential,
                      "status": attempt.status, "wait_ms": round(attempt.waited * 1000, 1)}
                     for attempt in attempts] if attempts else [],
    }
    if used is None:  # nothing was reported (an error, a refusal): nothing to pay for
        row.update(NOTHING_USED)
        row["server_tool_requests"] = {}
    else:
        cost = used.cost_micro_usd
        row["input_tokens"] = used.input_tokens
        row["output_tokens"] = used.output_tokens
        row["cache_read_input_tokens"] = used.cache_read_input_tokens
        row["cache_write_5m_input_tokens"] = used.cache_write_5m_input_tokens
        row["cache_write_1h_input_tokens"] = used.cache_write_1h_input_tokens
        row["server_tool_requests"] = dict(used.server_tool_requests)
        row["cost_micro_usd"] = cost
        row["priced"] = cost is not None
        row["usage_complete"] = used.complete
        row["usage_reported"] = used.reported
    return row


# A row's usage fields when nothing was reported (server_tool_requests, a dict, is each
# row's own).
NOTHING_USED = {**dict.fromkeys(metering.TOKEN_FIELDS, 0), "server_tool_requests": None,
                "cost_micro_usd": 0, "priced": True, "usage_complete": True,
                "usage_reported": True}
