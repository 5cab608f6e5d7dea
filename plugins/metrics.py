"""metrics: Prometheus metrics from the exchange record, served at ``GET /metrics``.

Everything here is read off the finished exchange (:class:`relay.exchange.Exchange`) in
``relay_exchange_end``, plus one gauge for the streams open now: the plugin needs nothing
from the host but the record. Labels are only what the operator's configuration bounds
(backend names, endpoints, statuses, plugin and rule names), never a value the client
chooses, such as a model name.

With several worker processes (``relay serve --workers N``) the metrics go through
prometheus-client's multi-process mode: each worker writes its values under
``PROMETHEUS_MULTIPROC_DIR`` (made here for the workers unless the operator set it) and
``/metrics``, whichever worker answers, adds them all up. A worker that crashes leaves its
open streams counted in ``relay_active_streams`` until the relay restarts.

``/metrics`` sits behind the same checks as every route: the Host check without auth, a
relay key with it.

Put ``metrics`` first in ``pipeline:``: end hooks run in reverse order, so it then sees what
every other plugin noted (the dump plugin's queued and dropped dumps, say).

Options: see ``Metrics.OPTIONS``.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

from aiohttp import web


def _shared_directory() -> None:
    """With workers coming (``RELAY_WORKERS``, set by ``relay serve`` before it loads plugins
    and forks), give them one emptied directory for prometheus-client's multi-process mode,
    before prometheus-client is imported: it chooses its mode at import. The process that
    made the directory removes it when it exits."""
    if int(os.environ.get("RELAY_WORKERS", "1")) <= 1 or "PROMETHEUS_MULTIPROC_DIR" in os.environ:
        return
    directory = tempfile.mkdtemp(prefix="relay-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
    owner = os.getpid()
    atexit.register(lambda: os.getpid() == owner and shutil.rmtree(directory, ignore_errors=True))


_shared_directory()

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter,  # noqa: E402
                               Gauge, Histogram, generate_latest, multiprocess)

from relay.hookspecs import hookimpl
from relay.options import Option

PLUGIN = "metrics"
# Upstream latency and time to first byte: from a few ms (a cached answer) to minutes (a long
# generation before its first token).
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    """The metrics plugin; the host makes one instance per relay."""

    def __init__(self):
        self.registry: CollectorRegistry | None = None
        self.path = "/metrics"
        self.children: dict = {}

    OPTIONS = (Option("path", str, "/metrics", "where the metrics are served",
                      check=lambda path: None if path.startswith("/") and " " not in path
                      else "must be a path starting with '/'"),)

    @hookimpl
    def relay_startup(self, config, options):
        self.path = options["path"]
        registry = self.registry = CollectorRegistry()
        self.requests = Counter(
            "relay_requests", "Exchanges answered, by backend, endpoint, status, stream and "
            "outcome.", ["backend", "endpoint", "status", "stream", "outcome"], registry=registry)
        self.upstream_latency = Histogram(
            "relay_upstream_latency_seconds", "From sending a request upstream to its answer's "
            "headers (each attempt).", ["backend"], buckets=BUCKETS, registry=registry)
        self.first_byte = Histogram(
            "relay_time_to_first_byte_seconds", "From receiving a request to the first byte of "
            "its answer written to the client.", ["backend", "stream"], buckets=BUCKETS,
            registry=registry)
        self.active_streams = Gauge(
            "relay_active_streams", "Streams open now.", registry=registry,
            multiprocess_mode="livesum")
        self.rewritten = Counter(
            "relay_tool_ids_rewritten", "Tool ids rewritten by the relay, by direction.",
            ["backend", "direction"], registry=registry)
        self.refused = Counter(
            "relay_histories_refused", "Requests a plugin refused, by plugin and rule.",
            ["plugin", "rule"], registry=registry)
        self.repaired = Counter(
            "relay_histories_repaired", "Repairs made to requests, by plugin and rule.",
            ["plugin", "rule"], registry=registry)
        self.dumps = Counter(
            "relay_dumps", "Dumps the dump plugin queued or dropped.", ["result"],
            registry=registry)
        self.retries = Counter(
            "relay_upstream_retries", "Attempts beyond a backend's first, per backend.",
            ["backend"], registry=registry)
        self.fallbacks = Counter(
            "relay_upstream_fallbacks", "Requests sent on to a fallback backend.",
            ["backend", "fallback"], registry=registry)
        self.provenance_missed = Counter(
            "relay_provenance_missed", "Thinking blocks the portable plugin's record on disk "
            "could not write (not_recorded) or read (not_known), by reason (locked, full, ...).",
            ["result", "reason"], registry=registry)
        self.auth_failures = Counter(
            "relay_auth_failures", "Requests refused for a missing or wrong relay key.",
            registry=registry)

    def _child(self, metric, *labels):
        """``metric.labels(*labels)``, looked up once: every label value is bounded by the
        configuration, so the cache is too."""
        key = (metric, labels)
        child = self.children.get(key)
        if child is None:
            child = self.children[key] = metric.labels(*labels)
        return child

    @hookimpl
    def relay_shutdown(self):
        if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
            # This process's live gauges (open streams) stop counting.
            multiprocess.mark_process_dead(os.getpid())

    @hookimpl
    def relay_routes(self):
        return {f"GET {self.path}": self.serve}

    async def serve(self, request: web.Request) -> web.Response:
        if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
        else:
            registry = self.registry
        return web.Response(body=generate_latest(registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    @hookimpl
    def relay_stream_events(self, exchange):
        self.active_streams.inc()
        exchange.state[PLUGIN] = True  # this exchange holds one in the gauge
        return None

    @hookimpl
    def relay_exchange_end(self, exchange):
        if exchange.state.pop(PLUGIN, False):
            self.active_streams.dec()
        backend = exchange.backend.name if exchange.backend is not None else "-"
        answer = exchange.answer
        stream = "true" if answer is not None and answer.stream else "false"
        self._child(self.requests, backend, exchange.endpoint,
                    str(answer.status) if answer is not None else "-", stream,
                    exchange.outcome or "-").inc()
        if exchange.timings.first_byte is not None:
            self._child(self.first_byte, backend, stream).observe(exchange.timings.first_byte)
        error = exchange.error
        if exchange.endpoint == "refused":
            if error is not None and error.status == 401:
                self.auth_failures.inc()
            return
        previous = None
        for attempt in exchange.attempts:
            if attempt.status is not None:
                self._child(self.upstream_latency, attempt.backend).observe(attempt.seconds)
            if attempt.backend == previous:
                self.retries.labels(attempt.backend).inc()
            elif previous is not None:
                self.fallbacks.labels(previous, attempt.backend).inc()
            previous = attempt.backend
        if exchange.translation:
            counts: dict = {}
            for entry in exchange.translation.values():
                direction = entry.get("direction", "-") if isinstance(entry, dict) else "-"
                counts[direction] = counts.get(direction, 0) + 1
            for direction, count in counts.items():
                self.rewritten.labels(backend, direction).inc(count)
        for entry in exchange.timeline:
            action = entry.get("action")
            if action == "repaired":
                self.repaired.labels(entry["step"], str(entry.get("rule", entry["step"]))).inc(
                    entry.get("count", 1))
            elif entry.get("step") == "dump" and action in ("queued", "dropped"):
                self.dumps.labels(action).inc()
            elif entry.get("step") == "portable" and action == "provenance missed":
                for missed in entry["counts"]:
                    self.provenance_missed.labels(missed["result"], missed["reason"]).inc(
                        missed["count"])
        if exchange.outcome == "rejected" and error is not None and error.plugin is not None:
            self.refused.labels(error.plugin, error.rule or error.plugin).inc()
