"""The exchange as an OpenTelemetry trace, exported over OTLP/HTTP (see
:mod:`relay.telemetry`, which imports this module only when traces are configured).

One span for the exchange (kind SERVER), continuing the client's ``traceparent`` and
``tracestate`` (W3C Trace Context) when it sent them, and one child span (kind CLIENT) per
attempt at an upstream, retries and fallbacks included. The timeline (what each plugin and
the relay did: repairs, retries, fallbacks, refusals, dumps) becomes the exchange span's
events. Everything is built once, from the finished record, at the end of the exchange: the
times are the exchange's own (``received``, ``timings``, each attempt's ``sent`` and
``seconds``), no span is open while the request is served, so none can leak on any path, and
the SDK's batch processor exports from a thread of its own, so that the event loop never
waits for a collector.

What goes into attributes is what the operator configured or the record already shows in
logs and metrics: names of keys, backends and credentials, never a key, a header's value or a
query string.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit

import orjson
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.re import parse_env_headers

from . import __version__
from .errors import ConfigError
from .exchange import Exchange, Outcome, is_credential_header
from .telemetry import traces_url

# W3C Trace Context only (traceparent, tracestate), whatever OTEL_PROPAGATORS says: the
# relay reads the client's trace, it does not take part in baggage.
PROPAGATOR = TraceContextTextMapPropagator()
# The relay's or the upstream's failures; a request the relay refused (a 4xx of the
# client's making) or a client that went away leaves the status unset, as OpenTelemetry's
# HTTP conventions say for a server's 4xx.
FAILED = frozenset({Outcome.RELAY_ERROR, Outcome.UPSTREAM_MALFORMED,
                    Outcome.UPSTREAM_UNREACHABLE, Outcome.POOL_FULL, Outcome.STREAM_ERROR})
# A timeline entry's detail can be a whole message: bounded in the span as in a log line.
MAX_ATTRIBUTE_CHARS = 1024
# The entry's own fields, attributes of their own already.
ENTRY_FIELDS = frozenset({"t", "step", "action"})


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class Traces:
    """This process's tracer provider and its exporter: one per serving process, made
    after a worker has forked (the batch processor's thread is the process's own)."""

    def __init__(self, section: dict, env=os.environ, exporter: SpanExporter | None = None):
        """``exporter``: where the spans go; by default OTLP/HTTP to ``otlp_endpoint`` (a
        test may give the SDK's in-memory one)."""
        headers = dict(section["headers"])
        if section["headers_env"]:
            text = env.get(section["headers_env"], "")
            if not text:
                raise ConfigError(f"telemetry.headers_env: environment variable "
                                  f"{section['headers_env']} is not set")
            headers.update(parse_env_headers(text, liberal=True))
        # Each worker is a process of its own, with its own provider: its pid tells them apart.
        resource = Resource.create({"service.name": section["service_name"],
                                    "service.version": __version__, "process.pid": os.getpid()})
        self.provider = TracerProvider(
            resource=resource, span_limits=SpanLimits(max_attribute_length=MAX_ATTRIBUTE_CHARS))
        self.exporter = exporter or OTLPSpanExporter(
            endpoint=traces_url(section["otlp_endpoint"]), headers=headers,
            timeout=section["timeout"])
        # Bounded: when the collector is slow, spans past the queue's 2048 are dropped,
        # never held.
        self.provider.add_span_processor(BatchSpanProcessor(self.exporter))
        self.tracer = self.provider.get_tracer("relay", __version__)

    def close(self) -> None:
        """Export what is queued, then stop (blocking: called off the event loop)."""
        self.provider.shutdown()

    def record(self, exchange: Exchange) -> None:
        """The finished ``exchange`` as a trace, handed to the batch processor."""
        parent = PROPAGATOR.extract(exchange.client_headers)
        # In nanoseconds from the one wall-clock reading, offsets added: every time of the
        # trace is the exchange's own clock, to the nanosecond.
        start = _ns(exchange.received)
        timings = exchange.timings
        end = start + _ns(timings.last_byte if timings.last_byte is not None
                          else exchange.elapsed())
        backend = exchange.backend.name if exchange.backend is not None else None
        answer = exchange.answer
        outcome = exchange.outcome
        attributes = {
            "relay.request_id": exchange.id,
            "relay.endpoint": exchange.endpoint,
            "http.request.method": exchange.method,
            "relay.backend": backend,
            "relay.key": exchange.key_name,
            "relay.credential": getattr(exchange, "credential", None),
            "relay.stream": exchange.stream,
            "relay.outcome": str(outcome) if outcome is not None else None,
            "relay.repairs": exchange.repairs,
            "relay.attempts": len(exchange.attempts),
            "http.response.status_code": answer.status if answer is not None else None,
        }
        if exchange.endpoint != "refused":  # a refused request's path is anyone's
            attributes["url.path"] = exchange.path
            attributes["gen_ai.request.model"] = exchange.model
        if outcome is not None and outcome != Outcome.OK:
            attributes["error.type"] = str(outcome)
        if timings.first_byte is not None:
            attributes["relay.time_to_first_byte_ms"] = round(timings.first_byte * 1000, 3)
        _usage(attributes, getattr(exchange, "usage", None))
        cache = getattr(exchange, "cache", None)
        if isinstance(cache, dict):
            attributes["relay.cache.status"] = cache.get("status")
            attributes["relay.cache.cause"] = cache.get("cause")
        dump = getattr(exchange, "dump_path", None)
        if dump:
            attributes["relay.dump"] = os.path.basename(str(dump))
        name = f"relay {exchange.endpoint}"
        span = self.tracer.start_span(name, context=parent, kind=SpanKind.SERVER,
                                      start_time=start, attributes=_present(attributes))
        try:
            for entry in exchange.timeline:
                step, action = entry.get("step", "-"), entry.get("action", "-")
                event = {"relay.step": step, "relay.action": action}
                for key, value in entry.items():
                    if key not in ENTRY_FIELDS and not is_credential_header(key):
                        event[f"relay.{key}"] = _value(value)
                span.add_event(f"{step} {action}", _present(event),
                               timestamp=start + _ns(entry["t"] - exchange.received)
                               if "t" in entry else end)
            if _failed(exchange):
                span.set_status(Status(StatusCode.ERROR, _why(exchange)))
            context = trace.set_span_in_context(span)
            for number, attempt in enumerate(exchange.attempts, 1):
                sent = start + _ns(attempt.sent)
                child = self.tracer.start_span(
                    f"upstream {attempt.backend}", context=context, kind=SpanKind.CLIENT,
                    start_time=sent, attributes=_present({
                        "relay.backend": attempt.backend,
                        "relay.credential": getattr(attempt, "credential", None),
                        "relay.attempt": number,
                        "relay.retry_wait_ms": round(attempt.waited * 1000, 3),
                        "http.response.status_code": attempt.status,
                        "url.full": _address(attempt.url),
                        "error.type": attempt.error if attempt.status is None
                        else (str(attempt.status) if attempt.status >= 400 else None),
                    }))
                if attempt.status is None or attempt.status >= 400:
                    child.set_status(Status(StatusCode.ERROR, attempt.error
                                            or f"HTTP {attempt.status}"))
                child.end(end_time=sent + _ns(attempt.seconds))
        finally:
            span.end(end_time=end)


def _address(url: str) -> str:
    """The upstream's address without what may hold a secret: no user or password in it, no
    query (the client's words)."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url.partition("?")[0]
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    if parts.port is not None:
        netloc += f":{parts.port}"
    return f"{parts.scheme}://{netloc}{parts.path}"


def _usage(attributes: dict, usage) -> None:
    """The answer's token counts (``exchange.usage``), in OpenTelemetry's GenAI names where
    there is one (their input count includes the cache's, Anthropic's does not) and
    Anthropic's own beside them."""
    if usage is None:
        return
    read = getattr(usage, "cache_read_input_tokens", 0) or 0
    written = (getattr(usage, "cache_write_5m_input_tokens", 0) or 0) \
        + (getattr(usage, "cache_write_1h_input_tokens", 0) or 0)
    uncached = getattr(usage, "input_tokens", 0) or 0
    attributes.update({
        "gen_ai.usage.input_tokens": uncached + read + written,
        "gen_ai.usage.output_tokens": getattr(usage, "output_tokens", 0) or 0,
        "gen_ai.usage.cache_read.input_tokens": read,
        "gen_ai.usage.cache_creation.input_tokens": written,
        "relay.usage.input_tokens": uncached,
        "relay.usage.cache_write_5m_input_tokens":
            getattr(usage, "cache_write_5m_input_tokens", None),
        "relay.usage.cache_write_1h_input_tokens":
            getattr(usage, "cache_write_1h_input_tokens", None),
        "relay.usage.cost_micro_usd": getattr(usage, "cost_micro_usd", None),
        "relay.usage.complete": getattr(usage, "complete", None),
        "relay.usage.reported": getattr(usage, "reported", None),
        "relay.usage.server_tool_requests":
            _value(getattr(usage, "server_tool_requests", None) or None),
    })


def _failed(exchange: Exchange) -> bool:
    outcome = exchange.outcome
    if outcome in FAILED:
        return True
    answer = exchange.answer
    return outcome == Outcome.UPSTREAM_ERROR and answer is not None and answer.status >= 500


def _why(exchange: Exchange) -> str:
    if exchange.stream_failure is not None:
        return exchange.stream_failure.message
    if exchange.error is not None:
        return exchange.error.message
    last = exchange.attempts[-1] if exchange.attempts else None
    if last is not None and last.error:
        return last.error
    return str(exchange.outcome)


def _value(value):
    """An attribute value: OpenTelemetry takes scalars (and lists of one kind); anything
    else goes in as its JSON text."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    try:
        return orjson.dumps(value, default=str).decode()
    except TypeError:
        return str(value)


def _present(attributes: dict) -> dict:
    return {key: value for key, value in attributes.items() if value is not None}
