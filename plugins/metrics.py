"""metrics: Prometheus metrics from the exchange record, served at ``GET /metrics``.

Everything here is read off the finished exchange (:class:`relay.exchange.Exchange`) in
``relay_exchange_end``, plus one gauge for the streams open now: the plugin needs nothing
from the host but the record. Labels are only what the operator's configuration bounds
(backend names, inbound key names, endpoints, statuses, plugin and rule names), or a value
the client chooses held to a few distinct names, the rest counted as ``other`` (the model
of the token and cost counters, from ``exchange.usage``, which the usage plugin sets).

With several worker processes (``relay serve --workers N``) the metrics go through
prometheus-client's multi-process mode: each worker writes its values under
``PROMETHEUS_MULTIPROC_DIR`` (made here for the workers unless the operator set it) and
``/metrics``, whichever worker answers, adds them all up. A worker that crashes leaves its
open streams counted in ``relay_active_streams`` until the relay restarts.

``/metrics`` is the operator's (a :class:`relay.inbound.AdminRoute`): it takes the admin key
(``server.auth.admin_key_env``) or the plugin's own scrape key (``scrape_key_env``), never a
client's relay key, since every backend's and every key's traffic is in it. Only a relay with
neither inbound keys nor either of those serves it to anyone who passes the Host check, as it
serves every route then.

Put ``metrics`` before the other plugins in ``pipeline:`` (only ``limits`` and ``usage``, which
set what it counts before any end hook runs, go before it): end hooks run in reverse order,
so it then sees what every later plugin noted (the dump plugin's queued and dropped dumps,
say).

Options: see ``Metrics.OPTIONS``.
"""

from __future__ import annotations

import asyncio
import atexit
import bisect
import datetime
import functools
import logging
import operator
import os
import re
import shutil
import stat
import tempfile
import time

from aiohttp import web

from relay.config import InboundKey
from relay.errors import ConfigError
from relay.exchange import Outcome
from relay.hookspecs import hookimpl
from relay.inbound import AdminRoute
from relay.options import Option
from relay.state import State

log = logging.getLogger("relay.plugins.metrics")

# relay-metrics-<pid of the process that made it>-<mkdtemp's random part>
SHARED_NAME = re.compile(r"relay-metrics-(\d+)-\w+")
# prometheus-client's files in it: <metric type>_<pid of the writer>.db
WRITER_FILE = re.compile(r"\w+_(\d+)\.db")


def _shared_directory() -> None:
    """With workers coming (``RELAY_WORKERS``, set by ``relay serve`` before it loads plugins
    and forks), give them one emptied directory for prometheus-client's multi-process mode,
    before prometheus-client is imported: it chooses its mode at import. The process that
    made the directory removes it when it exits; one killed outright cannot, so the next
    start removes the directories whose maker and writers are all gone."""
    if int(os.environ.get("RELAY_WORKERS", "1")) <= 1 or "PROMETHEUS_MULTIPROC_DIR" in os.environ:
        return
    parent = tempfile.gettempdir()
    remove_stale_directories(parent)
    owner = os.getpid()
    directory = tempfile.mkdtemp(prefix=f"relay-metrics-{owner}-", dir=parent)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
    def remove() -> None:
        if os.getpid() == owner:  # a forked worker inherits the hook: only the maker removes
            shutil.rmtree(directory, ignore_errors=True)

    atexit.register(remove)


def remove_stale_directories(parent: str) -> list[str]:
    """Remove this user's shared directories in ``parent`` that no live process uses: the
    process that made one (named in it) and every worker that wrote to it (named in its
    files) are gone. Returns what was removed."""
    removed: list[str] = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        match = SHARED_NAME.fullmatch(entry.name)
        if match is None:
            continue
        try:
            info = entry.stat(follow_symlinks=False)
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
                continue
            users = {int(match.group(1))}
            for name in os.listdir(entry.path):
                writer = WRITER_FILE.fullmatch(name)
                if writer is not None:
                    users.add(int(writer.group(1)))
        except OSError:
            continue
        if not any(_alive(pid) for pid in users):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    if removed:
        log.warning("removed %d metrics director%s left by relays that were killed: %s",
                    len(removed), "y" if len(removed) == 1 else "ies", ", ".join(removed))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    try:  # a zombie (exited, not yet reaped: where nothing reaps orphans) writes nothing
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


_shared_directory()

from prometheus_client import (  # noqa: E402
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    generate_latest,
    multiprocess,
)
from prometheus_client import metrics as client_metrics  # noqa: E402
from prometheus_client import values as client_values  # noqa: E402
from prometheus_client.metrics_core import (  # noqa: E402
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.samples import Sample  # noqa: E402
from prometheus_client.utils import floatToGoString  # noqa: E402

PLUGIN = "metrics"
MIN_KEY_CHARS = 16  # as for relay keys
# Upstream latency and time to first byte: from a few ms (a cached answer) to minutes (a long
# generation before its first token).
# Betas and fields the relay does not know are the client's words: a few distinct names get
# their own label, the rest count as "other", so that no client can grow the label set.
NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
MAX_NAMES = 32
MODEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@\[\]-]{0,127}")
MAX_MODELS = 32
# The Usage fields counted in relay_tokens_total, by their ``kind`` label.
TOKEN_KINDS = (("input", "input_tokens"), ("output", "output_tokens"),
               ("cache_read", "cache_read_input_tokens"),
               ("cache_write_5m", "cache_write_5m_input_tokens"),
               ("cache_write_1h", "cache_write_1h_input_tokens"))
TOKEN_COUNTS = operator.attrgetter(*(name for _, name in TOKEN_KINDS))  # in one call
# The cache plugin's figures in relay_cache_input_tokens_total, by their ``kind`` label.
CACHE_KINDS = (("read", "read_input_tokens"), ("written", "written_input_tokens"),
               ("fresh", "fresh_input_tokens"))
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# The upstream account's quota headers (anthropic-ratelimit-KIND-limit, -remaining, -reset:
# https://docs.anthropic.com/en/api/rate-limits#response-headers), by their ``kind`` label;
# read at most once a QUOTA_SECONDS per backend and credential.
QUOTA_KINDS = (("requests", "anthropic-ratelimit-requests-"),
               ("input_tokens", "anthropic-ratelimit-input-tokens-"),
               ("output_tokens", "anthropic-ratelimit-output-tokens-"),
               ("tokens", "anthropic-ratelimit-tokens-"))
QUOTA_SECONDS = 1.0


def _timestamp(value: str) -> float:
    """An RFC 3339 time (the quota headers' ``-reset``) as Unix time."""
    return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


class _Value:
    """One series of a counter or a gauge in a single process."""

    __slots__ = ("value", "created")

    def __init__(self):
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1) -> None:
        if amount < 0:  # as prometheus-client's counters refuse it
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self.value += amount

    def dec(self, amount: float = 1) -> None:  # the gauge's
        self.value -= amount

    def set(self, value: float) -> None:  # the gauge's
        self.value = value


class _Observed:
    """One series of a histogram in a single process: each bucket's own count (made
    cumulative when scraped) and the sum."""

    __slots__ = ("bounds", "counts", "sum", "created")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        self.sum += amount
        # The first bound at or above the amount, as prometheus-client's ``amount <= bound``.
        at = bisect.bisect_left(self.bounds, amount)
        if at < len(self.counts):
            self.counts[at] += 1


class _Written:
    """One series of a counter or a gauge with workers: its value lives in this process's
    file of prometheus-client's multi-process mode (a value of prometheus-client's own value
    class), which ``/metrics`` of any worker reads."""

    __slots__ = ("file",)

    def __init__(self, file):
        self.file = file

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self.file.inc(amount)

    def dec(self, amount: float = 1) -> None:
        self.file.inc(-amount)

    def set(self, value: float) -> None:
        # Stamped, for a gauge whose workers' values are not added up: the last one set wins.
        self.file.set(value, time.time())


class _WrittenObserved:
    """One series of a histogram with workers: its sum and each bucket's own count in this
    process's file, as prometheus-client's own histograms keep them there."""

    __slots__ = ("bounds", "sum", "buckets")

    def __init__(self, bounds: tuple[float, ...], total, buckets: list):
        self.bounds = bounds
        self.sum = total
        self.buckets = buckets

    def observe(self, amount: float) -> None:
        self.sum.inc(amount)
        at = bisect.bisect_left(self.bounds, amount)
        if at < len(self.buckets):
            self.buckets[at].inc(1)


Series = _Value | _Observed | _Written | _WrittenObserved


class Family:
    """A metric, counted without prometheus-client's metric classes, whose counters and
    histograms take a lock, check their arguments and build tuples on every ``labels()``,
    ``inc()`` and ``observe()``: that cost a small exchange more than anything else in this
    plugin.

    In a single process the values are plain Python on the event loop (the only thread that
    counts or scrapes), handed to prometheus-client only when ``/metrics`` is read, as a
    custom collector (prometheus-client's documented pattern for values kept elsewhere).
    With workers (``written``: prometheus-client's multi-process mode) each value goes to
    this process's file through prometheus-client's own value class, under the names,
    labels and help its own metrics would write, so that its ``MultiProcessCollector`` adds
    the workers up as before; nothing is registered. The text served is the same either way:
    the same families, series, values and (in a single process) ``_created`` samples."""

    def __init__(self, kind: str, name: str, documentation: str, labelnames=(),
                 registry: CollectorRegistry | None = None, buckets: tuple | None = None,
                 written: bool = False, mode: str = "livesum"):
        self.kind = kind
        self.mode = mode  # a gauge's, across workers: added up, or the one set last
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.bounds = (*(float(b) for b in buckets), float("inf")) if buckets else ()
        self.written = written
        self.series: dict[tuple[str, ...], Series] = {}
        self.found: dict[tuple, Series] = {}
        if not self.labelnames:  # shown at 0 from the start, as prometheus-client does
            self.series[()] = self._new(())
        if registry is not None and not written:
            registry.register(self)

    def _new(self, key: tuple[str, ...]) -> Series:
        if not self.written:
            return _Observed(self.bounds) if self.kind == "histogram" else _Value()
        if self.kind == "counter":
            return _Written(self._file(self.name + "_total", self.labelnames, key))
        if self.kind == "gauge":
            return _Written(self._file(self.name, self.labelnames, key,
                                       multiprocess_mode=self.mode))
        names = (*self.labelnames, "le")
        return _WrittenObserved(
            self.bounds, self._file(self.name + "_sum", self.labelnames, key),
            [self._file(self.name + "_bucket", names, (*key, floatToGoString(bound)))
             for bound in self.bounds])

    def _file(self, sample: str, labelnames: tuple, labelvalues: tuple, **kwargs):
        return client_values.ValueClass(self.kind, self.name, sample, labelnames, labelvalues,
                                        self.documentation, **kwargs)

    def labels(self, *values):
        # By the values as given first (an exchange's labels are mostly the same few), then
        # as the strings they are shown as.
        series = _found(self.found, values)
        if series is None:
            key = tuple(str(value) for value in values)
            series = self.series.get(key)
            if series is None:
                if len(key) != len(self.labelnames):
                    raise ValueError(f"{self.name}: expected {len(self.labelnames)} label "
                                     "values")
                series = self.series[key] = self._new(key)
            _keep(self.found, values, series)
        return series

    def inc(self, amount: float = 1) -> None:
        self.series[()].inc(amount)  # type: ignore[union-attr]

    def dec(self, amount: float = 1) -> None:
        self.series[()].dec(amount)  # type: ignore[union-attr]

    def describe(self) -> list[Metric]:
        return [Metric(self.name, self.documentation, self.kind)]

    def collect(self) -> list[Metric]:
        names = self.labelnames
        # Where the operator turned the ``_created`` series off (PROMETHEUS_DISABLE_CREATED_SERIES,
        # or disable_created_metrics()), prometheus-client's own metrics leave them out: so do
        # these. Its switch is that module's flag, read when scraped.
        created = getattr(client_metrics, "_use_created", True)
        if self.kind == "counter":
            counter = CounterMetricFamily(self.name, self.documentation, labels=names)
            for key, value in self.series.items():
                assert isinstance(value, _Value)
                counter.add_metric(key, value.value,
                                   created=value.created if created else None)
            return [counter]
        if self.kind == "gauge":
            gauge = GaugeMetricFamily(self.name, self.documentation, labels=names)
            for key, value in self.series.items():
                assert isinstance(value, _Value)
                gauge.add_metric(key, value.value)
            return [gauge]
        histogram = HistogramMetricFamily(self.name, self.documentation, labels=names)
        for key, observed in self.series.items():
            assert isinstance(observed, _Observed)
            total, buckets = 0.0, []
            for bound, count in zip(self.bounds, observed.counts, strict=True):
                total += count
                buckets.append((floatToGoString(bound), total))
            histogram.add_metric(key, buckets, observed.sum)
            if created:
                labels = dict(zip(names, key, strict=True))
                histogram.samples.append(Sample(self.name + "_created", labels,
                                                observed.created, None))
        return [histogram]


def _found(found: dict, values: tuple):
    try:
        return found.get(values)
    except TypeError:  # a value that cannot be a key (a plugin's list): shown as its text
        return None


def _keep(found: dict, values: tuple, series) -> None:
    # Only strings shown as themselves, which equal no value of another text (1, 1.0 and
    # True are one key and three texts): the rest is looked up by its text every time.
    if all(isinstance(value, str) and str(value) == value for value in values):
        found[values] = series


class Metrics:
    """The metrics plugin; the host makes one instance per relay."""

    def __init__(self):
        self.registry = CollectorRegistry()  # replaced at start-up; empty until then
        self.state = State()  # the host's, from start-up
        self.state_unavailable_seen = 0
        self.path = "/metrics"
        # (backend, key, model): the children of relay_tokens_total (by kind),
        # relay_usage_unreported_total, relay_usage_unpriced_total and
        # relay_cost_micro_usd_total, as made.
        self.usage_children: dict[tuple[str, str, str], list] = {}
        self.scrape_keys: tuple[InboundKey, ...] = ()
        self.deferred_names: set[str] = set()
        self.model_names: set[str] = set()

    OPTIONS = (Option("path", str, "/metrics", "where the metrics are served",
                      check=lambda path: None if path.startswith("/") and " " not in path
                      else "must be a path starting with '/'"),
               Option("scrape_key_env", str, "",
                      "an environment variable holding a key that may read the metrics "
                      "(a scraper's), besides the admin key; never a client's relay key"))

    @hookimpl
    def relay_startup(self, config, options, state):
        self.state = state
        self.state_unavailable_seen = 0
        self.path = options["path"]
        self.scrape_keys = scrape_keys(options["scrape_key_env"], config)
        registry = self.registry = CollectorRegistry()
        written = "PROMETHEUS_MULTIPROC_DIR" in os.environ
        counter = functools.partial(Family, "counter", written=written)
        histogram = functools.partial(Family, "histogram", written=written)
        gauge = functools.partial(Family, "gauge", written=written)
        self.usage_children = {}
        self.requests = counter(
            "relay_requests", "Exchanges answered, by backend, inbound key, endpoint, status, "
            "stream and outcome.", ["backend", "key", "endpoint", "status", "stream", "outcome"],
            registry=registry)
        self.state_unavailable = counter(
            "relay_state_unavailable", "Calls to the shared state (state.url) that found it "
            "unreachable, by its kind.", ["store"], registry=registry)
        self.upstream_latency = histogram(
            "relay_upstream_latency_seconds", "From sending a request upstream to its answer's "
            "headers (each attempt).", ["backend"], buckets=BUCKETS, registry=registry)
        self.first_byte = histogram(
            "relay_time_to_first_byte_seconds", "From receiving a request to the first byte of "
            "its answer written to the client.", ["backend", "stream"], buckets=BUCKETS,
            registry=registry)
        self.active_streams = gauge(
            "relay_active_streams", "Streams open now.", registry=registry)
        self.rewritten = counter(
            "relay_tool_ids_rewritten", "Tool ids rewritten by the relay, by direction.",
            ["backend", "direction"], registry=registry)
        self.refused = counter(
            "relay_histories_refused", "Requests a plugin refused, by plugin and rule.",
            ["plugin", "rule"], registry=registry)
        self.repaired = counter(
            "relay_histories_repaired", "Repairs made to requests, by plugin and rule.",
            ["plugin", "rule"], registry=registry)
        self.dumps = counter(
            "relay_dumps", "Dumps the dump plugin queued or dropped.", ["result"],
            registry=registry)
        self.retries = counter(
            "relay_upstream_retries", "Attempts beyond a backend's first, per backend.",
            ["backend"], registry=registry)
        self.fallbacks = counter(
            "relay_upstream_fallbacks", "Requests sent on to a fallback backend.",
            ["backend", "fallback"], registry=registry)
        self.deferred = counter(
            "relay_history_rules_deferred", "Requests whose history the rules left to the "
            "upstream, by the beta or top-level field they hold no evidence about.",
            ["kind", "name"], registry=registry)
        self.provenance_missed = counter(
            "relay_provenance_missed", "Thinking blocks the portable plugin's record on disk "
            "could not write (not_recorded) or read (not_known), by reason (locked, full, ...).",
            ["result", "reason"], registry=registry)
        self.tokens = counter(
            "relay_tokens", "Tokens the upstreams reported, by backend, inbound key, model "
            f"(the first {MAX_MODELS} names seen, then other) and kind (input, output, "
            "cache_read, cache_write_5m, cache_write_1h).", ["backend", "key", "model", "kind"],
            registry=registry)
        self.cost = counter(
            "relay_cost_micro_usd", "What the reported usage cost by the usage plugin's "
            "prices, in micro-dollars, by backend, inbound key and model.",
            ["backend", "key", "model"], registry=registry)
        self.unpriced = counter(
            "relay_usage_unpriced", "Exchanges whose usage no price matched: counted in "
            "tokens, not in cost.", ["backend", "key", "model"], registry=registry)
        self.unreported = counter(
            "relay_usage_unreported", "Exchanges whose upstream did not report their usage in "
            "full (none at all, a count missing or not a count): counted as far as it was "
            "reported, and so maybe short.", ["backend", "key", "model"], registry=registry)
        self.auth_failures = counter(
            "relay_auth_failures", "Requests refused for a missing or wrong relay key.",
            registry=registry)
        # A backend's pool of credentials (relay.pools): names from relay.yaml only.
        self.credential_requests = counter(
            "relay_credential_requests", "Attempts sent with each pooled credential, by the "
            "upstream's status (- when none came).", ["backend", "credential", "status"],
            registry=registry)
        self.credential_cooldown = counter(
            "relay_credential_cooldown_seconds", "Seconds of cooldown put on each pooled "
            "credential (429, 529, connection failures).", ["backend", "credential"],
            registry=registry)
        self.credential_out = counter(
            "relay_credential_out", "Times a pooled credential was taken out (401, 403).",
            ["backend", "credential"], registry=registry)
        self.sessions_placed = counter(
            "relay_credential_sessions_placed", "New sessions placed on each pooled credential.",
            ["backend", "credential"], registry=registry)
        self.sessions_moved = counter(
            "relay_credential_sessions_moved", "Sessions moved off a pooled credential that was "
            "cooling or out (each move costs the session a prompt-cache miss).",
            ["backend", "credential", "to"], registry=registry)
        self.credential_tokens = counter(
            "relay_credential_tokens", "Tokens of the answers each pooled credential got, by "
            "kind (where the usage plugin runs).", ["backend", "credential", "kind"],
            registry=registry)
        self.credential_cost = counter(
            "relay_credential_cost_micro_usd", "What the answers each pooled credential got "
            "cost, in millionths of a US dollar (where the usage plugin prices them).",
            ["backend", "credential"], registry=registry)
        # The upstream account's quota as its last answer stated it, whether the client saw
        # those headers or a relay key's own in their place (the limits plugin's).
        quota = functools.partial(gauge, labelnames=["backend", "credential", "kind"],
                                  registry=registry, mode="mostrecent")
        self.quota_limit = quota(
            "relay_upstream_ratelimit_limit", "The upstream account's rate limit, by backend, "
            "pooled credential (- for none) and kind (requests, input_tokens, output_tokens, "
            "tokens), from its anthropic-ratelimit-* answer headers.")
        self.quota_remaining = quota(
            "relay_upstream_ratelimit_remaining", "What the upstream account's last answer "
            "said is left of each rate limit, by backend, credential and kind.")
        self.quota_reset = quota(
            "relay_upstream_ratelimit_reset_timestamp_seconds", "When the upstream account's "
            "rate limit of each kind is next fully replenished (Unix time), as its last answer "
            "said.")
        self.quota_read: dict[tuple[str, str], float] = {}
        # The prompt cache, from the cache plugin's exchange.cache (its causes are a closed
        # set of the relay's words).
        self.cache_breaks = counter(
            "relay_cache_breaks", "Requests whose prompt-cache prefix no longer matched the "
            "session's previous request, by cause.", ["cause"], registry=registry)
        self.cache_tokens = counter(
            "relay_cache_input_tokens", "Input tokens by what the prompt cache did with them "
            "(read, written, fresh), per backend and inbound key.", ["backend", "key", "kind"],
            registry=registry)

    def _deferred_name(self, name: str) -> str:
        if name in self.deferred_names:
            return name
        if len(self.deferred_names) < MAX_NAMES and NAME.fullmatch(name):
            self.deferred_names.add(name)
            return name
        return "other"

    def _model_name(self, name: str | None) -> str:
        if name is None:
            return "-"
        if name in self.model_names:
            return name
        if len(self.model_names) < MAX_MODELS and MODEL.fullmatch(name):
            self.model_names.add(name)
            return name
        return "other"

    def _usage(self, used, backend: str, key: str, model: str | None) -> None:
        model = self._model_name(model)
        labels = (backend, key, model)
        # One lookup for the exchange's labels; each child is made when first counted, so
        # that a series nobody counted yet is not shown at 0.
        children = self.usage_children.get(labels)
        if children is None:
            children = self.usage_children[labels] = [None] * (len(TOKEN_KINDS) + 3)
        for i, count in enumerate(TOKEN_COUNTS(used)):
            if count:
                child = children[i]
                if child is None:
                    child = children[i] = self.tokens.labels(backend, key, model,
                                                             TOKEN_KINDS[i][0])
                child.inc(count)
        # A usage object of another plugin's making may predate the flag: reported, then.
        if not getattr(used, "reported", True):
            child = children[-3]
            if child is None:
                child = children[-3] = self.unreported.labels(backend, key, model)
            child.inc()
        cost = used.cost_micro_usd
        if cost is None:
            child = children[-2]
            if child is None:
                child = children[-2] = self.unpriced.labels(backend, key, model)
            child.inc()
        elif cost:
            child = children[-1]
            if child is None:
                child = children[-1] = self.cost.labels(backend, key, model)
            child.inc(cost)

    @hookimpl
    def relay_shutdown(self):
        if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
            # This process's live gauges (open streams) stop counting.
            multiprocess.mark_process_dead(os.getpid())

    @hookimpl
    def relay_routes(self):
        return {f"GET {self.path}": AdminRoute(self.serve, self.scrape_keys)}

    async def serve(self, request: web.Request) -> web.Response:
        if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
            # Every worker's files are read: disk I/O, kept off the event loop.
            body = await asyncio.get_running_loop().run_in_executor(None, collect_processes)
        else:
            body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    @hookimpl
    def relay_stream_events(self, exchange):
        self.active_streams.inc()
        exchange.state[PLUGIN] = True  # this exchange holds one in the gauge
        return None

    @hookimpl
    def relay_exchange_end(self, exchange):
        if exchange.state.pop(PLUGIN, False):
            self.active_streams.dec()
        # The state counts its own failures; what it counted since the last exchange.
        unavailable = self.state.unavailable_count
        if unavailable > self.state_unavailable_seen:
            self.state_unavailable.labels(self.state.kind).inc(
                unavailable - self.state_unavailable_seen)
            self.state_unavailable_seen = unavailable
        backend = exchange.backend.name if exchange.backend is not None else "-"
        answer = exchange.answer
        stream = "true" if answer is not None and answer.stream else "false"
        # A key's name comes from relay.yaml (the key the client authenticated with), never
        # from the request.
        self.requests.labels(backend, exchange.key_name or "-", exchange.endpoint,
                             str(answer.status) if answer is not None else "-", stream,
                             exchange.outcome or "-").inc()
        if exchange.timings.first_byte is not None:
            self.first_byte.labels(backend, stream).observe(exchange.timings.first_byte)
        if answer is not None:
            self._quota(exchange, backend, answer)
        error = exchange.error
        if exchange.endpoint == "refused":
            if error is not None and error.status == 401:
                self.auth_failures.inc()
            return
        used = getattr(exchange, "usage", None)
        if used is not None:
            self._usage(used, backend, exchange.key_name or "-", exchange.model)
        previous = None
        pooled = False
        for attempt in exchange.attempts:
            if attempt.credential is not None:
                pooled = True
                self.credential_requests.labels(
                    attempt.backend, attempt.credential,
                    attempt.status if attempt.status is not None else "-").inc()
            if attempt.status is not None:
                self.upstream_latency.labels(attempt.backend).observe(attempt.seconds)
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
        for repair in exchange.repaired_by:
            self.repaired.labels(repair.step, repair.rule).inc(repair.count)
        # One pass over the timeline for what the dump and portable plugins note.
        for entry in exchange.timeline:
            step = entry.get("step")
            if step == "dump" and entry.get("action") in ("queued", "dropped"):
                self.dumps.labels(entry["action"]).inc()
            elif step == "portable" and entry.get("action") == "provenance missed":
                for missed in entry["counts"]:
                    self.provenance_missed.labels(missed["result"], missed["reason"]).inc(
                        missed["count"])
        # Not the exchange's own credential: a fallback without a pool answers for one
        # whose pool noted its placements and cooldowns on the way.
        if pooled:
            self._credentials(exchange)
        for kind, name in exchange.rules_defer:
            self.deferred.labels(kind, self._deferred_name(name)).inc()
        if exchange.outcome == Outcome.REJECTED and error is not None and error.plugin is not None:
            self.refused.labels(error.plugin, error.rule or error.plugin).inc()
        cache = exchange.cache
        if cache:
            if cache.get("status") == "miss":
                self.cache_breaks.labels(str(cache.get("cause"))).inc()
            for kind, field in CACHE_KINDS:
                tokens = cache.get(field)
                if tokens:
                    self.cache_tokens.labels(backend, exchange.key_name or "-", kind).inc(
                        tokens)

    def _quota(self, exchange, backend: str, answer) -> None:
        """The upstream account's quota headers of this answer (those a relay key's replaced,
        or those the client got), at most once a QUOTA_SECONDS per backend and credential."""
        credential = exchange.credential or "-"
        now = time.monotonic()
        if now - self.quota_read.get((backend, credential), -QUOTA_SECONDS) < QUOTA_SECONDS:
            return
        self.quota_read[backend, credential] = now
        replaced = exchange.replaced_headers  # a dict once a relay key's took their place
        headers = answer.headers if replaced is None else replaced
        for kind, prefix in QUOTA_KINDS:
            for family, field, read in ((self.quota_limit, "limit", float),
                                        (self.quota_remaining, "remaining", float),
                                        (self.quota_reset, "reset", _timestamp)):
                value = headers.get(prefix + field)
                if value is None:
                    continue
                try:
                    number = read(value)
                except (TypeError, ValueError):
                    continue  # not a number or a time: nothing to show
                family.labels(backend, credential, kind).set(number)

    def _credentials(self, exchange) -> None:
        """What a pool noted on the exchange (relay.pools) and the usage it was answered
        with, per credential."""
        for entry in exchange.noted("relay", "credential placed", "credential moved",
                                    "credential cooling", "credential backoff",
                                    "credential out"):
            backend, credential, action = entry["backend"], entry["credential"], entry["action"]
            if action == "credential placed":
                self.sessions_placed.labels(backend, credential).inc()
            elif action == "credential moved":
                self.sessions_moved.labels(backend, credential, entry["to"]).inc()
            elif action == "credential out":
                self.credential_out.labels(backend, credential).inc()
            else:
                self.credential_cooldown.labels(backend, credential).inc(entry["seconds"])
        usage = getattr(exchange, "usage", None)
        if usage is not None and exchange.backend is not None and exchange.credential is not None:
            for kind in ("input_tokens", "output_tokens", "cache_read_input_tokens",
                         "cache_write_5m_input_tokens", "cache_write_1h_input_tokens"):
                count = getattr(usage, kind, 0)
                if count:
                    self.credential_tokens.labels(exchange.backend.name, exchange.credential,
                                                  kind).inc(count)
            cost = getattr(usage, "cost_micro_usd", None)
            if cost:
                self.credential_cost.labels(exchange.backend.name,
                                            exchange.credential).inc(cost)


def collect_processes() -> bytes:
    """The metrics of every worker process, added up from their files."""
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    return generate_latest(registry)


def scrape_keys(variable: str, config) -> tuple[InboundKey, ...]:
    """The scrape key named by ``scrape_key_env``: set, long enough, and no client's key."""
    if not variable:
        return ()
    where = f"plugins.{PLUGIN}.scrape_key_env"
    secret = os.environ.get(variable, "")
    if not secret:
        raise ConfigError(f"{where}: environment variable {variable} is not set")
    if len(secret) < MIN_KEY_CHARS:
        raise ConfigError(f"{where}: the key must be at least {MIN_KEY_CHARS} characters long")
    if any(key.secret == secret for key in config.keys or ()):
        raise ConfigError(f"{where}: the scrape key must differ from every inbound key")
    return (InboundKey("metrics scrape key", secret),)
