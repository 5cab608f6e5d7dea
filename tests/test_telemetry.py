"""Traces: real exchanges through a real relay, exported over OTLP/HTTP to a real receiver
started here (an aiohttp server on loopback taking ``/v1/traces``, decoded with
opentelemetry-proto's classes), and nothing at all when traces are not configured."""

from __future__ import annotations

import asyncio
import os
import sys
import time

import aiohttp
import pytest
import yaml
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from support import Process, Relay, backend
from test_server import ANSWER, BODY, STREAM, Upstream, dying_stream, start_upstream, stream_reply
from test_upstream import scripted

from relay import config as config_module
from relay.errors import ConfigError
from relay.exchange import Attempt
from relay.otel import Traces
from relay.testing import assistant, finished_exchange, request, result, text, use, user
from relay.testing.fixtures import start_relay

FAST = {"attempts": 3, "backoff": 0.01, "max_backoff": 0.05, "budget": 5}
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
RELAY_KEY = "relay-key-team-a-0123456789"
BACKEND_KEY = "sk-backend-secret-0123456789"


def _value(any_value):
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


def _attributes(pairs) -> dict:
    return {pair.key: _value(pair.value) for pair in pairs}


class Receiver:
    """An OTLP/HTTP collector's traces endpoint: every span it was sent, decoded, and the
    raw bodies (to look for what must never be there)."""

    def __init__(self):
        self.bodies: list[bytes] = []
        self.spans: list[dict] = []

    async def traces(self, request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        body = await request.read()
        self.bodies.append(body)
        export = ExportTraceServiceRequest()
        export.ParseFromString(body)
        for resource_spans in export.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.spans.append({
                        "name": span.name, "trace_id": span.trace_id.hex(),
                        "span_id": span.span_id.hex(),
                        "parent_span_id": span.parent_span_id.hex(),
                        "trace_state": span.trace_state, "kind": span.kind,
                        "start": span.start_time_unix_nano, "end": span.end_time_unix_nano,
                        "attributes": _attributes(span.attributes),
                        "events": [(event.name, _attributes(event.attributes),
                                    event.time_unix_nano) for event in span.events],
                        "status": span.status.code, "message": span.status.message,
                        "resource": resource, "scope": scope_spans.scope.name})
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    def roots(self) -> list[dict]:
        return [span for span in self.spans if span["kind"] == Span.SPAN_KIND_SERVER]

    def children(self, root: dict) -> list[dict]:
        return sorted((span for span in self.spans if span["parent_span_id"] == root["span_id"]),
                      key=lambda span: span["start"])


@pytest.fixture
async def receiver(aiohttp_server):
    found = Receiver()
    app = web.Application()
    app.router.add_post("/v1/traces", found.traces)
    server = await aiohttp_server(app, host="127.0.0.1")
    found.url = str(server.make_url("")).rstrip("/")
    return found


async def traced_relay(aiohttp_server, aiohttp_client, receiver, backends, pipeline=(),
                       extra=None, server=None, env=None, plugins=None):
    """A relay over in-process upstreams (``(Upstream, backend extras)`` pairs), exporting
    its traces to ``receiver``."""
    entries = []
    for i, (upstream, more) in enumerate(backends):
        listening = await start_upstream(aiohttp_server, upstream)
        entries.append({"name": more.pop("name", f"b{i}"), "url": str(listening.make_url("")),
                        "models": ["claude-*"] if i == 0 else [], **more})
    raw = {"server": server or {}, "pipeline": list(pipeline), "plugins": plugins or {},
           "backends": entries,
           "telemetry": {"otlp_endpoint": receiver.url, "service_name": "relay-test"}}
    return await start_relay(aiohttp_client, raw, extra=extra, env=env)


async def stop(client) -> None:
    """Stop the relay as serving does: its traces are exported before it is gone."""
    await client.close()
    await client.chain.shutdown(client.config)


async def test_a_retried_fallen_back_exchange_is_one_span_with_a_child_per_attempt(
        aiohttp_server, aiohttp_client, receiver):
    first, second = Upstream(), Upstream()
    first.reply = scripted(529, 529, 529)
    client = await traced_relay(aiohttp_server, aiohttp_client, receiver, [
        (first, {"retries": FAST, "fallbacks": ["b1"]}), (second, {})])
    before = time.time_ns()
    resp = await client.post("/v1/messages", json=BODY)
    assert resp.status == 200 and await resp.json() == ANSWER
    request_id = resp.headers["x-relay-request-id"]
    await stop(client)

    [root] = receiver.roots()
    assert root["name"] == "relay messages" and root["parent_span_id"] == ""
    assert root["resource"]["service.name"] == "relay-test"
    assert root["resource"]["process.pid"] == os.getpid()
    attributes = root["attributes"]
    assert attributes["relay.request_id"] == request_id
    assert attributes["relay.endpoint"] == "messages"
    assert attributes["relay.backend"] == "b1"  # the one that answered
    assert attributes["relay.outcome"] == "ok" and "error.type" not in attributes
    assert attributes["http.response.status_code"] == 200
    assert attributes["gen_ai.request.model"] == "claude-test"
    assert attributes["relay.attempts"] == 4 and attributes["relay.stream"] is False
    assert root["status"] == Status.STATUS_CODE_UNSET
    assert before <= root["start"] < root["end"] <= time.time_ns()

    attempts = receiver.children(root)
    assert [a["name"] for a in attempts] == ["upstream b0"] * 3 + ["upstream b1"]
    assert {a["trace_id"] for a in attempts} == {root["trace_id"]}
    assert all(a["kind"] == Span.SPAN_KIND_CLIENT for a in attempts)
    assert [a["attributes"]["http.response.status_code"] for a in attempts] == [529, 529, 529,
                                                                               200]
    assert [a["attributes"]["relay.attempt"] for a in attempts] == [1, 2, 3, 4]
    assert [a["status"] for a in attempts] == [Status.STATUS_CODE_ERROR] * 3 + [
        Status.STATUS_CODE_UNSET]
    waits = [a["attributes"]["relay.retry_wait_ms"] for a in attempts]
    assert waits[0] == 0 and waits[1] > 0 and waits[2] > 0 and waits[3] == 0
    # Each attempt in its place on the exchange's clock: after the wait before it, inside
    # the exchange, one after another.
    for earlier, later in zip(attempts, attempts[1:], strict=False):
        assert earlier["end"] <= later["start"]
    assert attempts[1]["start"] - attempts[0]["end"] >= waits[1] * 1e6 * 0.9
    assert root["start"] <= attempts[0]["start"] and attempts[-1]["end"] <= root["end"]
    events = [name for name, _, _ in root["events"]]
    assert events == ["relay retrying", "relay retrying", "relay fallback"]
    _, fallback, at = root["events"][2]
    assert fallback["relay.backend"] == "b1" and fallback["relay.after"] == "b0"
    assert attempts[2]["end"] <= at <= attempts[3]["start"]


async def test_the_clients_traceparent_is_continued_and_the_plugins_decisions_are_events(
        aiohttp_server, aiohttp_client, receiver):
    upstream = Upstream()
    client = await traced_relay(aiohttp_server, aiohttp_client, receiver, [(upstream, {})],
                                pipeline=["cache", "pairing"],
                                plugins={"pairing": {"pairing_mode": "repair"}})
    orphan = request(user(text("go")), assistant(use("toolu_a"), use("toolu_b")),
                     user(result("toolu_b"), text("and then")))
    resp = await client.post("/v1/messages", json=orphan, headers={
        "traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "tracestate": "vendor=abc"})
    assert resp.status == 200
    await stop(client)

    [root] = receiver.roots()
    assert root["trace_id"] == TRACE_ID and root["parent_span_id"] == PARENT_ID
    assert root["trace_state"] == "vendor=abc"
    [attempt] = receiver.children(root)
    assert attempt["trace_id"] == TRACE_ID
    [(name, repaired, _)] = root["events"]
    assert name == "pairing repaired"
    assert repaired["relay.step"] == "pairing" and repaired["relay.count"] == 1
    assert repaired["relay.tool_use_ids"] == '["toolu_a"]'
    assert root["attributes"]["relay.repairs"] == 1
    # The cache plugin's verdict: a request that marks nothing for the cache uses none.
    assert root["attributes"]["relay.cache.status"] == "none"


async def test_a_client_that_says_not_sampled_is_not_traced(aiohttp_server, aiohttp_client,
                                                           receiver):
    client = await traced_relay(aiohttp_server, aiohttp_client, receiver, [(Upstream(), {})])
    resp = await client.post("/v1/messages", json=BODY,
                             headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-00"})
    assert resp.status == 200
    resp = await client.post("/v1/messages", json=BODY)
    assert resp.status == 200
    await stop(client)
    [root] = receiver.roots()
    assert root["trace_id"] != TRACE_ID


async def test_upstream_failures_are_error_spans(aiohttp_server, aiohttp_client, receiver,
                                                 unused_tcp_port):
    failing = Upstream()
    failing.reply = scripted(500)
    gone = {"name": "gone", "url": f"http://127.0.0.1:{unused_tcp_port}", "models": ["gone-*"]}
    client = await traced_relay(aiohttp_server, aiohttp_client, receiver, [(failing, {})])
    resp = await client.post("/v1/messages", json=BODY)
    assert resp.status == 500
    await stop(client)
    raw = {"pipeline": [], "backends": [gone],
           "telemetry": {"otlp_endpoint": receiver.url + "/v1/traces"}}
    client2 = await start_relay(aiohttp_client, raw)
    resp = await client2.post("/v1/messages", json={**BODY, "model": "gone-1"})
    assert resp.status == 502
    await stop(client2)

    answered, unreachable = sorted(receiver.roots(), key=lambda span: span["start"])
    assert answered["attributes"]["relay.outcome"] == "upstream_error"
    assert answered["attributes"]["error.type"] == "upstream_error"
    assert answered["status"] == Status.STATUS_CODE_ERROR
    assert [name for name, _, _ in answered["events"]] == ["relay upstream error"]
    [attempt] = receiver.children(answered)
    assert attempt["status"] == Status.STATUS_CODE_ERROR
    assert attempt["attributes"]["error.type"] == "500"

    assert unreachable["attributes"]["relay.outcome"] == "upstream_unreachable"
    assert unreachable["attributes"]["http.response.status_code"] == 502
    assert unreachable["status"] == Status.STATUS_CODE_ERROR and unreachable["message"]
    [attempt] = receiver.children(unreachable)
    assert attempt["name"] == "upstream gone"
    assert "http.response.status_code" not in attempt["attributes"]
    assert attempt["status"] == Status.STATUS_CODE_ERROR
    assert "Connect" in attempt["attributes"]["error.type"]


async def test_a_refusal_of_the_clients_making_is_not_an_error(aiohttp_server, aiohttp_client,
                                                               receiver):
    client = await traced_relay(aiohttp_server, aiohttp_client, receiver, [(Upstream(), {})],
                                pipeline=["pairing"])
    orphan = request(user(text("go")), assistant(use("toolu_a")), user(text("y")))
    resp = await client.post("/v1/messages", json=orphan)
    assert resp.status == 400
    await stop(client)
    [root] = receiver.roots()
    assert root["attributes"]["relay.outcome"] == "rejected"
    assert root["attributes"]["http.response.status_code"] == 400
    assert root["status"] == Status.STATUS_CODE_UNSET
    assert receiver.children(root) == []  # nothing went upstream


async def test_streams_their_first_byte_and_their_failure(aiohttp_server, aiohttp_client,
                                                          receiver):
    whole, broken = Upstream(), Upstream()
    whole.reply = stream_reply([STREAM])
    broken.reply = dying_stream
    client = await traced_relay(aiohttp_server, aiohttp_client, receiver,
                                [(whole, {}), (broken, {"models": ["broken-*"]})])
    resp = await client.post("/v1/messages", json={**BODY, "stream": True})
    assert await resp.read() == STREAM
    resp = await client.post("/v1/messages", json={**BODY, "model": "broken-1", "stream": True})
    assert b"event: error" in await resp.read()
    await stop(client)

    ok, failed = sorted(receiver.roots(), key=lambda span: span["start"])
    assert ok["attributes"]["relay.stream"] is True and ok["attributes"]["relay.outcome"] == "ok"
    first_byte = ok["attributes"]["relay.time_to_first_byte_ms"]
    assert 0 < first_byte <= (ok["end"] - ok["start"]) / 1e6
    assert ok["status"] == Status.STATUS_CODE_UNSET
    assert failed["attributes"]["relay.outcome"] == "stream_error"
    assert failed["status"] == Status.STATUS_CODE_ERROR
    assert [name for name, _, _ in failed["events"]] == ["relay stream error"]
    assert failed["message"] == failed["events"][0][1]["relay.message"]


async def test_key_names_usage_and_credentials_but_never_a_secret(aiohttp_server, aiohttp_client,
                                                                  receiver):
    upstream = Upstream()
    upstream.reply = scripted(429)  # the first credential's: the pool asks the other at once
    client = await traced_relay(
        aiohttp_server, aiohttp_client, receiver,
        [(upstream, {"credentials": [{"name": "pool-a", "key_env": "KEY_A"},
                                     {"name": "pool-b", "key_env": "KEY_B"}]})],
        pipeline=["usage"],
        plugins={"usage": {"prices": [{"models": ["claude-*"], "usd_per_mtok": {
            "input": 3, "output": 15, "cache_write_5m": 3.75, "cache_write_1h": 6,
            "cache_read": 0.3}}]}},
        server={"auth": {"keys": [{"name": "team-a", "key_env": "RELAY_KEY"}]}},
        env={"RELAY_KEY": RELAY_KEY, "KEY_A": BACKEND_KEY, "KEY_B": BACKEND_KEY + "-b"})
    resp = await client.post("/v1/messages?beta=true&key=" + RELAY_KEY, json=BODY,
                             headers={"x-api-key": RELAY_KEY})
    assert resp.status == 200
    assert {r["headers"]["x-api-key"] for r in upstream.received} == {BACKEND_KEY,
                                                                      BACKEND_KEY + "-b"}
    resp = await client.post("/v1/messages", json=BODY, headers={"x-api-key": "wrong" * 4})
    assert resp.status == 401
    await stop(client)

    answered, refused = sorted(receiver.roots(), key=lambda span: span["start"])
    attributes = answered["attributes"]
    assert attributes["relay.key"] == "team-a"
    first, second = receiver.children(answered)
    assert [first["attributes"]["http.response.status_code"],
            second["attributes"]["http.response.status_code"]] == [429, 200]
    assert {first["attributes"]["relay.credential"],
            second["attributes"]["relay.credential"]} == {"pool-a", "pool-b"}
    assert attributes["relay.credential"] == second["attributes"]["relay.credential"]
    # ANSWER's usage (1 in, 1 out), priced by the usage plugin: 3 + 15 dollars per million.
    assert attributes["gen_ai.usage.input_tokens"] == 1
    assert attributes["gen_ai.usage.output_tokens"] == 1
    assert attributes["gen_ai.usage.cache_read.input_tokens"] == 0
    assert attributes["relay.usage.cost_micro_usd"] == 18
    assert attributes["relay.usage.complete"] is True
    assert "?" not in first["attributes"]["url.full"]
    assert refused["name"] == "relay refused"
    assert refused["attributes"]["http.response.status_code"] == 401
    assert "url.path" not in refused["attributes"]
    exported = b"".join(receiver.bodies)
    assert RELAY_KEY.encode() not in exported and BACKEND_KEY.encode() not in exported


def test_the_section_is_checked_and_holds_no_secret():
    def parse(section):
        return config_module.parse({"backends": [backend("http://127.0.0.1:9")],
                                    "telemetry": section}, {})

    assert parse({})  # off
    assert parse({}).telemetry["otlp_endpoint"] == ""
    section = parse({"otlp_endpoint": "http://127.0.0.1:4318", "headers": {"x-team": "a"}})
    assert section.telemetry["service_name"] == "relay"
    assert section.telemetry["headers"] == {"x-team": "a"}
    for bad, words in (({"otlp_endpoint": "127.0.0.1:4318"}, "telemetry.otlp_endpoint: must be"),
                       ({"otlp_endpoint": "http://x", "headers": {"authorization": "Bearer s"}},
                        "telemetry.headers.authorization: a credential is never written"),
                       ({"otlp_endpoint": "http://x", "timeout": 0}, "telemetry.timeout"),
                       ({"otlp_endpoint": "http://x", "sample": 1}, "telemetry.sample: unknown key"),
                       ({"otlp_endpoint": "http://x", "headers_env": "NOT A NAME"},
                        "telemetry.headers_env")):
        with pytest.raises(ConfigError, match=words):
            parse(bad)


async def test_headers_come_from_the_environment(aiohttp_server, aiohttp_client, monkeypatch):
    seen = []

    async def traces(request):
        seen.append(dict(request.headers))
        return web.Response(body=b"", content_type="application/x-protobuf")
    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    collector = await aiohttp_server(app, host="127.0.0.1")
    monkeypatch.setenv("COLLECTOR_HEADERS", "x-collector-token=s3cret,x-other=1")
    upstream = await start_upstream(aiohttp_server, Upstream())
    raw = {"backends": [backend(str(upstream.make_url("")))],
           "telemetry": {"otlp_endpoint": str(collector.make_url("")), "headers": {"x-team": "a"},
                         "headers_env": "COLLECTOR_HEADERS"}}
    client = await start_relay(aiohttp_client, raw)
    assert (await client.post("/v1/messages", json=BODY)).status == 200
    await stop(client)
    [headers] = seen
    assert headers["x-collector-token"] == "s3cret" and headers["x-other"] == "1"
    assert headers["x-team"] == "a"
    monkeypatch.delenv("COLLECTOR_HEADERS")
    with pytest.raises(ConfigError, match="COLLECTOR_HEADERS is not set"):
        await start_relay(aiohttp_client, raw)


# --- real processes: workers, and a relay without traces ------------------------------


@pytest.mark.slow
async def test_each_worker_exports_its_own_traces(tmp_path, aiohttp_server, receiver):
    upstream = await start_upstream(aiohttp_server, Upstream())
    config = {"pipeline": ["dedup"], "backends": [backend(str(upstream.make_url("")))],
              "telemetry": {"otlp_endpoint": receiver.url}}
    started = await asyncio.to_thread(
        Relay, config, tmp_path, {"OTEL_BSP_SCHEDULE_DELAY": "50"}, ["--workers", "2"])
    try:
        for _ in range(24):  # a connection each: the kernel spreads them over the workers
            async with aiohttp.ClientSession() as session:
                async with session.post(started.url + "/v1/messages", json=BODY) as resp:
                    assert resp.status == 200
        deadline = time.monotonic() + 20
        while len(receiver.roots()) < 24 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    finally:
        await asyncio.to_thread(started.stop)
    roots = receiver.roots()
    assert len(roots) == 24
    pids = {span["resource"]["process.pid"] for span in roots}
    assert len(pids) == 2 and started.pid not in pids  # made in each worker, after the fork
    assert len({span["attributes"]["relay.request_id"] for span in roots}) == 24


@pytest.mark.slow
async def test_without_the_section_nothing_is_imported_or_exported(tmp_path, aiohttp_server,
                                                                   receiver):
    upstream = await start_upstream(aiohttp_server, Upstream())
    base = {"pipeline": ["metrics", "dedup"], "backends": [backend(str(upstream.make_url("")))]}
    imported = {}
    for name, config in (("off", base),
                         ("on", {**base, "telemetry": {"otlp_endpoint": receiver.url}})):
        directory = tmp_path / name
        directory.mkdir()
        (directory / "relay.yaml").write_text(yaml.safe_dump(config))
        # -X importtime: every module the relay imports, as it imports it, on its output.
        # OpenTelemetry's own variable would point the SDK at the receiver if it were loaded.
        process = Process([sys.executable, "-X", "importtime", "-m", "relay", "--config",
                           str(directory / "relay.yaml"), "--port", "0"],
                          env={"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
                               "OTEL_TRACES_EXPORTER": "otlp"}, cwd=str(directory))
        try:
            url = await asyncio.to_thread(process.wait_ready, 20, "relay")
            async with aiohttp.ClientSession() as session:
                for _ in range(3):
                    async with session.post(url + "/v1/messages", json=BODY) as resp:
                        assert resp.status == 200
        finally:
            await asyncio.to_thread(process.stop)
        imported[name] = [line for line in process.lines if "import time:" in line
                          and "opentelemetry" in line]
        if name == "off":
            assert receiver.spans == []
    assert imported["off"] == []
    assert imported["on"]  # the check sees an import when there is one
    assert len(receiver.roots()) == 3


def test_the_record_as_spans_in_the_sdks_memory():
    """What a finished record becomes, to the nanosecond, with what other plugins record
    (the cache's diagnosis, the dump, server tools) and what must stay out."""
    section = config_module.parse({"backends": [backend("http://127.0.0.1:9")],
                                   "telemetry": {"otlp_endpoint": "http://127.0.0.1:9"}},
                                  {}).telemetry
    memory = InMemorySpanExporter()
    traces = Traces(section, {}, exporter=memory)
    exchange = finished_exchange(
        attempts=[Attempt("emu", "http://user:s3cret@127.0.0.1:9/v1/messages?beta=true", status=529,
                          seconds=0.01, sent=0.001),
                  Attempt("emu", "http://127.0.0.1:9/v1/messages?beta=true", status=200,
                          seconds=0.01, sent=0.016, waited=0.005)],
        timeline=[("relay", "retrying", {"backend": "emu", "status": 529, "wait": 0.005,
                                         "x-api-key": "sk-never"})],
        headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    exchange.cache = {"status": "miss", "cause": "tools changed", "where": "tools"}
    exchange.dump_path = "/var/lib/relay/dumps/relay_abc.json"
    exchange.usage = type("Usage", (), dict(
        input_tokens=3, output_tokens=4, cache_read_input_tokens=0,
        cache_write_5m_input_tokens=0, cache_write_1h_input_tokens=0,
        server_tool_requests={"web_search": 2}, complete=False, cost_micro_usd=None))()
    traces.record(exchange)
    traces.close()
    root, = [s for s in memory.get_finished_spans() if s.kind == SpanKind.SERVER]
    attempts = sorted((s for s in memory.get_finished_spans() if s.kind == SpanKind.CLIENT),
                      key=lambda s: s.start_time)
    received = int(exchange.received * 1e9)
    assert root.start_time == received and root.end_time == received + int(0.03 * 1e9)
    assert format(root.context.trace_id, "032x") == TRACE_ID
    assert format(root.parent.span_id, "016x") == PARENT_ID
    assert root.attributes["relay.cache.status"] == "miss"
    assert root.attributes["relay.cache.cause"] == "tools changed"
    assert root.attributes["relay.dump"] == "relay_abc.json"
    assert root.attributes["relay.usage.server_tool_requests"] == '{"web_search":2}'
    assert root.attributes["relay.usage.complete"] is False
    assert "relay.usage.cost_micro_usd" not in root.attributes  # no price matched
    [event] = root.events
    assert event.attributes["relay.wait"] == 0.005 and "relay.x-api-key" not in event.attributes
    assert [(s.start_time - received, s.end_time - s.start_time) for s in attempts] == [
        (int(0.001 * 1e9), int(0.01 * 1e9)), (int(0.016 * 1e9), int(0.01 * 1e9))]
    assert [s.attributes["url.full"] for s in attempts] == ["http://127.0.0.1:9/v1/messages"] * 2
    assert all(s.parent.span_id == root.context.span_id for s in attempts)


def test_the_timeline_keeps_the_exchanges_clock_when_the_wall_clock_is_stepped(monkeypatch):
    """A step of the wall clock during an exchange (NTP, a VM resumed) moves none of its times:
    a plugin's note lands between the attempts it came between, as the trace draws them."""
    section = config_module.parse({"backends": [backend("http://127.0.0.1:9")],
                                   "telemetry": {"otlp_endpoint": "http://127.0.0.1:9"}},
                                  {}).telemetry
    memory = InMemorySpanExporter()
    traces = Traces(section, {}, exporter=memory)
    exchange = finished_exchange(attempts=[
        Attempt("emu", "http://127.0.0.1:9/v1/messages", status=529, seconds=0.0, sent=0.0)])
    exchange.attempts[0].seconds = exchange.elapsed()
    monkeypatch.setattr(time, "time", lambda: exchange.received - 5.0)
    exchange.note("relay", "fallback", backend="b1")
    exchange.timings.last_byte = exchange.elapsed()
    assert 0 < exchange.timeline[-1]["t"] - exchange.received <= exchange.elapsed()
    traces.record(exchange)
    traces.close()
    root, = [s for s in memory.get_finished_spans() if s.kind == SpanKind.SERVER]
    attempt, = [s for s in memory.get_finished_spans() if s.kind == SpanKind.CLIENT]
    [event] = root.events
    assert attempt.end_time <= event.timestamp <= root.end_time
