"""The metrics plugin: Prometheus text from the exchange record, for the operator's eyes only."""

from __future__ import annotations

import time
import urllib.request

import orjson
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from relay_builtins import metrics as metrics_plugin
from relay_builtins.metrics import Metrics
from support import backend
from test_server import ANSWER, BODY, STREAM, Upstream, start_relay, start_upstream, stream_reply  # noqa: F401

from relay import config as config_module
from relay.errors import ConfigError, RelayError
from relay.exchange import Outcome
from relay.state.memory import MemoryState
from relay.testing import finished_exchange

KEY = "relay-key-metrics-0123456789"
OTHER_KEY = "relay-key-metrics-other-0123456789"
ADMIN_KEY = "relay-admin-key-0123456789abcdef"
SCRAPE_KEY = "relay-scrape-key-0123456789abcdef"


def samples(text: str) -> dict:
    """{(name, frozenset(labels)): value} for every sample."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name, frozenset(sample.labels.items())] = sample.value
    return out


def value(found: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in found.items()
               if n == name and all((k, str(x)) in ls for k, x in labels.items()))


async def test_counts_what_the_exchange_record_says(aiohttp_server, aiohttp_client, tmp_path):
    upstream = Upstream()
    statuses = iter([200, 200, 529, 200, 400])

    async def reply(request):
        body = await request.json()
        if body.get("stream"):
            return await stream_reply([STREAM])(request)
        status = next(statuses)
        if status == 200:
            return await upstream.json_reply(request)
        return web.json_response({"type": "error", "error": {"type": "x", "message": "no"}},
                                 status=status)
    upstream.reply = reply
    server = await start_upstream(aiohttp_server, upstream)
    client = await start_relay(aiohttp_client, {
        "server": {"auth": {"keys": [{"name": "k", "key_env": "K"}], "admin_key_env": "ADMIN"}},
        "pipeline": ["metrics", "dedup", "pairing", "ordering", "dump"],
        "plugins": {"dump": {"dir": str(tmp_path / "dumps")}},
        "backends": [backend(str(server.make_url("")), name="main",
                             retries={"attempts": 2, "backoff": 0.01, "max_backoff": 0.02})]},
        env={"K": KEY, "ADMIN": ADMIN_KEY})
    auth = {"x-api-key": KEY}
    assert (await client.post("/v1/messages", json=BODY, headers=auth)).status == 200
    assert (await client.post("/v1/messages", json={**BODY, "model": "claude-secret-name"},
                              headers=auth)).status == 200
    assert (await client.post("/v1/messages", json=BODY, headers=auth)).status == 200  # retried
    assert (await client.post("/v1/messages", json=BODY, headers=auth)).status == 400
    await (await client.post("/v1/messages", json={**BODY, "stream": True}, headers=auth)).read()
    broken = {**BODY, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_x", "content": "?"}]}]}
    assert (await client.post("/v1/messages", json=broken, headers=auth)).status == 400
    assert (await client.post("/v1/messages", json=BODY, headers={"x-api-key": "nope"})).status == 401

    assert (await client.get("/metrics")).status == 401
    resp = await client.get("/metrics", headers={"x-api-key": ADMIN_KEY})
    assert resp.status == 200 and resp.content_type == "text/plain"
    text = await resp.text()
    found = samples(text)
    assert value(found, "relay_requests_total", backend="main", status="200", stream="false",
                 key="k") == 3
    assert value(found, "relay_requests_total", backend="main", status="400",
                 outcome="upstream_error") == 1
    assert value(found, "relay_requests_total", stream="true", outcome="ok") == 1
    assert value(found, "relay_requests_total", outcome="rejected") == 1
    assert value(found, "relay_histories_refused_total", plugin="pairing") == 1
    assert value(found, "relay_upstream_retries_total", backend="main") == 1
    assert value(found, "relay_dumps_total", result="queued") == 1  # the upstream's 400
    assert value(found, "relay_auth_failures_total") == 2  # the /metrics without a key too
    assert value(found, "relay_active_streams") == 0
    assert value(found, "relay_time_to_first_byte_seconds_count", stream="true") == 1
    assert value(found, "relay_upstream_latency_seconds_count", backend="main") == 6
    assert "claude-secret-name" not in text and "claude-test" not in text


async def test_rewrites_and_repairs_are_counted(aiohttp_server, aiohttp_client):
    upstream = Upstream()
    server = await start_upstream(aiohttp_server, upstream)
    client = await start_relay(aiohttp_client, {
        "pipeline": ["metrics", "dedup", "pairing", "ordering"],
        "plugins": {"ordering": {"ordering_mode": "repair"}},
        "backends": [backend(str(server.make_url("")))]})
    use = {"type": "tool_use", "id": "toolu_a", "name": "Bash", "input": {}}
    history = {**BODY, "messages": [
        {"role": "user", "content": "go"}, {"role": "assistant", "content": [use]},
        {"role": "user", "content": [{"type": "text", "text": "first"},
                                     {"type": "tool_result", "tool_use_id": "toolu_a",
                                      "content": "1"}]}]}
    assert (await client.post("/v1/messages", json=history)).status == 200
    found = samples(await (await client.get("/metrics")).text())
    assert value(found, "relay_histories_repaired_total", plugin="ordering") == 1
    assert value(found, "relay_requests_total", key="-", status="200") == 1  # no keys: no name


async def metrics_relay(aiohttp_server, aiohttp_client, auth: dict, env: dict, pipeline=None):
    server = await start_upstream(aiohttp_server, Upstream())
    return await start_relay(aiohttp_client, {
        "server": {"auth": auth}, "pipeline": pipeline or ["metrics"],
        "backends": [backend(str(server.make_url("")), name="main")]}, env=env)


async def test_only_the_admin_key_reads_the_metrics(aiohttp_server, aiohttp_client, tmp_path):
    admin_file = tmp_path / "admin-key"
    admin_file.write_text(ADMIN_KEY + "\n")
    client = await metrics_relay(aiohttp_server, aiohttp_client, {
        "keys": [{"name": "team-a", "key_env": "K"},
                 {"name": "nothing", "key_env": "OTHER", "backends": []}],
        "admin_key_file": str(admin_file)}, {"K": KEY, "OTHER": OTHER_KEY})
    for presented in (KEY, OTHER_KEY):  # a client key, even one that reaches nothing
        for headers in ({"x-api-key": presented}, {"Authorization": f"Bearer {presented}"}):
            resp = await client.get("/metrics", headers=headers)
            assert resp.status == 403
            doc = orjson.loads(await resp.read())
            assert doc["type"] == "error" and doc["error"]["type"] == "permission_error"
            assert "admin key" in doc["error"]["message"]
            assert resp.headers["x-relay-request-id"] == doc["request_id"]
    for headers in ({}, {"x-api-key": "relay-wrong-key-0123456789abcdef"}):
        resp = await client.get("/metrics", headers=headers)
        assert resp.status == 401
        assert orjson.loads(await resp.read())["error"]["type"] == "authentication_error"
    resp = await client.get("/metrics", headers={"x-api-key": ADMIN_KEY})
    assert resp.status == 200 and resp.content_type == "text/plain"
    text = await resp.text()
    assert value(samples(text), "relay_auth_failures_total") == 2
    assert ADMIN_KEY not in text and KEY not in text
    await client.chain.shutdown(client.config)


async def test_a_scrape_key_reads_the_metrics_and_nothing_else(aiohttp_server, aiohttp_client,
                                                                monkeypatch):
    monkeypatch.setenv("SCRAPE", SCRAPE_KEY)
    server = await start_upstream(aiohttp_server, Upstream())
    client = await start_relay(aiohttp_client, {
        "server": {"auth": {"keys": [{"name": "team-a", "key_env": "K"},
                                     {"name": "team-b", "key_env": "OTHER"}]}},
        "pipeline": ["metrics"], "plugins": {"metrics": {"scrape_key_env": "SCRAPE"}},
        "backends": [backend(str(server.make_url("")), name="main")]},
        env={"K": KEY, "OTHER": OTHER_KEY})
    for key, count in ((KEY, 2), (OTHER_KEY, 1)):
        for _ in range(count):
            assert (await client.post("/v1/messages", json=BODY,
                                      headers={"x-api-key": key})).status == 200
    # The scrape key is no relay key: the Messages API refuses it.
    assert (await client.post("/v1/messages", json=BODY,
                              headers={"x-api-key": SCRAPE_KEY})).status == 401
    resp = await client.get("/metrics", headers={"Authorization": f"Bearer {SCRAPE_KEY}"})
    assert resp.status == 200
    found = samples(await resp.text())
    assert value(found, "relay_requests_total", key="team-a", status="200") == 2
    assert value(found, "relay_requests_total", key="team-b", status="200") == 1
    assert {dict(labels)["key"] for name, labels in found
            if name == "relay_requests_total"} == {"team-a", "team-b", "-"}
    resp = await client.get("/metrics", headers={"x-api-key": KEY})
    assert resp.status == 403
    await client.chain.shutdown(client.config)


async def test_with_inbound_keys_and_no_admin_key_the_metrics_are_closed(aiohttp_server,
                                                                         aiohttp_client):
    client = await metrics_relay(aiohttp_server, aiohttp_client,
                                 {"keys": [{"name": "team-a", "key_env": "K"}]}, {"K": KEY})
    resp = await client.get("/metrics", headers={"x-api-key": KEY})
    assert resp.status == 403
    assert "server.auth.admin_key_env" in orjson.loads(await resp.read())["error"]["message"]
    assert (await client.get("/metrics")).status == 401
    await client.chain.shutdown(client.config)


def test_the_admin_and_scrape_keys_are_no_client_keys(tmp_path, monkeypatch):
    keys = [{"name": "team-a", "key_env": "K"}]
    raw = {"server": {"auth": {"keys": keys, "admin_key_env": "ADMIN"}},
           "backends": [backend("http://127.0.0.1:9")]}
    with pytest.raises(ConfigError, match="admin key must differ"):
        config_module.parse(raw, {"K": KEY, "ADMIN": KEY})
    with pytest.raises(ConfigError, match="server.auth.admin_key_env: environment variable"):
        config_module.parse(raw, {"K": KEY})
    with pytest.raises(ConfigError, match="at least 16"):
        config_module.parse(raw, {"K": KEY, "ADMIN": "short"})
    both = {"server": {"auth": {"keys": keys, "admin_key_env": "ADMIN",
                                "admin_key_file": str(tmp_path / "k")}},
            "backends": raw["backends"]}
    with pytest.raises(ConfigError, match="not both"):
        config_module.parse(both, {"K": KEY, "ADMIN": ADMIN_KEY})
    assert ADMIN_KEY not in repr(config_module.parse(raw, {"K": KEY, "ADMIN": ADMIN_KEY}))
    from relay_builtins.metrics import scrape_keys
    config = config_module.parse(raw, {"K": KEY, "ADMIN": ADMIN_KEY})
    monkeypatch.setenv("SCRAPE", KEY)
    with pytest.raises(ConfigError, match="scrape key must differ"):
        scrape_keys("SCRAPE", config)
    monkeypatch.delenv("SCRAPE")
    with pytest.raises(ConfigError, match="SCRAPE is not set"):
        scrape_keys("SCRAPE", config)


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def post(url: str) -> int:
    import orjson
    request = urllib.request.Request(url + "/v1/messages", data=orjson.dumps(BODY),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.status


def test_processes_sharing_a_multiprocess_dir_add_up(relay, emulator, tmp_path):
    emu = emulator()
    shared = tmp_path / "prometheus"
    shared.mkdir()
    config = {"pipeline": ["metrics"], "backends": [backend(emu.url)]}
    env = {"PROMETHEUS_MULTIPROC_DIR": str(shared)}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    from support import Relay
    first = Relay(config, tmp_path / "a", env=env)
    second = Relay(config, tmp_path / "b", env=env)
    try:
        for server, count in ((first, 2), (second, 3)):
            for _ in range(count):
                assert post(server.url) == 200
        deadline = time.monotonic() + 5
        while True:
            found = samples(fetch(first.url + "/metrics"))
            total = value(found, "relay_requests_total", status="200")
            if total == 5 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert total == 5
    finally:
        first.stop()
        second.stop()


def test_a_finished_exchange_is_counted_from_its_fields():
    plugin = Metrics()
    plugin.relay_startup(config=config_module.parse({"backends": [backend("http://127.0.0.1:9")]},
                                                    env={}),
                         options={"path": "/metrics", "scrape_key_env": ""},
                         state=MemoryState())
    exchange = finished_exchange(status=529, outcome=Outcome.UPSTREAM_ERROR,
                                 timeline=[("dump", "queued", {"reason": "upstream_error"}),
                                           ("other", "queued")])
    exchange.repaired("dedup", 2, rule="repeated_id")
    plugin.relay_exchange_end(exchange)
    found = samples(generate_latest(plugin.registry).decode())
    assert value(found, "relay_requests_total", backend="test", status=529,
                 outcome="upstream_error", stream="false") == 1
    assert value(found, "relay_histories_repaired_total", plugin="dedup",
                 rule="repeated_id") == 2
    assert value(found, "relay_dumps_total", result="queued") == 1


def test_the_states_failures_are_counted_by_its_kind():
    state = MemoryState()
    plugin = Metrics()
    plugin.relay_startup(config=config_module.parse({"backends": [backend("http://127.0.0.1:9")]},
                                                    env={}),
                         options={"path": "/metrics", "scrape_key_env": ""}, state=state)
    state.kind, state.unavailable_count = "redis", 3  # what a store that went out counted
    plugin.relay_exchange_end(finished_exchange(status=200))
    plugin.relay_exchange_end(finished_exchange(status=200))
    state.unavailable_count = 4
    plugin.relay_exchange_end(finished_exchange(status=200))
    found = samples(generate_latest(plugin.registry).decode())
    assert value(found, "relay_state_unavailable_total", store="redis") == 4


def test_the_model_label_of_usage_is_bounded():
    from relay_builtins.metrics import MAX_MODELS

    from relay.usage import Usage

    plugin = Metrics()
    plugin.relay_startup(config=config_module.parse({"backends": [backend("http://127.0.0.1:9")]},
                                                    env={}),
                         options={"path": "/metrics", "scrape_key_env": ""},
                         state=MemoryState())
    for n in range(MAX_MODELS + 8):
        exchange = finished_exchange()
        exchange.model = f"model-{n}"
        exchange.usage = Usage(input_tokens=10, output_tokens=1, cost_micro_usd=None if n % 2
                               else 5)
        plugin.relay_exchange_end(exchange)
    found = samples(generate_latest(plugin.registry).decode())
    models = {dict(labels)["model"] for name, labels in found if name == "relay_tokens_total"}
    assert len(models) == MAX_MODELS + 1 and "other" in models
    assert value(found, "relay_tokens_total", kind="input") == 10 * (MAX_MODELS + 8)
    assert value(found, "relay_tokens_total", model="other", kind="output") == 8
    assert value(found, "relay_usage_unpriced_total") == (MAX_MODELS + 8) // 2
    assert value(found, "relay_cost_micro_usd_total") == 5 * ((MAX_MODELS + 8) // 2)


def exchanges_of_every_kind():
    """Finished exchanges that fill every family a single exchange can reach: statuses,
    streams, retries and fallbacks, repairs, dumps, usage, the cache's verdicts, a pooled
    credential, a refusal."""
    from relay.exchange import Attempt
    from relay.usage import Usage

    made = []
    for n, status in enumerate((200, 200, 529, 400, 200)):
        exchange = finished_exchange(
            status=status, stream=n == 1,
            outcome=Outcome.OK if status == 200 else Outcome.UPSTREAM_ERROR,
            attempts=[Attempt("test", "http://x", status=529, seconds=0.02 * n),
                      Attempt("test", "http://x", status=status, seconds=7.0),
                      *([Attempt("other", "http://y", status=200, seconds=400.0)] if n == 4
                        else [])],
            timeline=[("dump", "queued", {"reason": "x"}), ("dump", "dropped")])
        exchange.timings.first_byte = 0.001 * 10 ** n
        exchange.repaired("dedup", n + 1, rule="repeated_id")
        exchange.usage = Usage(input_tokens=10 * n, output_tokens=n,
                               cache_read_input_tokens=3, cost_micro_usd=None if n % 2 else n)
        exchange.cache = {"status": "miss" if n % 2 else "hit", "cause": "system_changed",
                          "read_input_tokens": n, "fresh_input_tokens": 2}
        exchange.translation = {"toolu_a": {"direction": "to_upstream"}}
        if n == 0:  # the upstream account's quota, as a relay key's headers replaced it
            exchange.replaced_headers = {"anthropic-ratelimit-requests-remaining": "41",
                                         "anthropic-ratelimit-input-tokens-reset":
                                             "2026-12-02T21:30:00Z"}
        if n == 2:
            exchange.credential = "first"
            exchange.attempts[-1].credential = "first"
            exchange.note("relay", "credential placed", backend="test", credential="first")
            exchange.note("relay", "credential cooling", backend="test", credential="first",
                          seconds=1.5)
        made.append(exchange)
    refused = finished_exchange(status=401, error=RelayError(401, "no key",
                                                             "authentication_error"))
    refused.endpoint = "refused"
    made.append(refused)
    return made


@pytest.mark.parametrize("created", [True, False], ids=["created", "created-disabled"])
def test_workers_serve_what_one_process_serves(monkeypatch, tmp_path, request, created):
    """A single process counts in plain Python and hands the values over when scraped; with
    workers every count goes to the process's file of prometheus-client's multi-process mode
    (through its own value class) and ``/metrics`` adds the files up. The same exchanges
    make the same families, help, series and values both ways, but for the ``_created``
    times, which the files do not keep, and the families nothing counted yet (the files hold
    series only); and a single process has none where the operator
    turned them off (PROMETHEUS_DISABLE_CREATED_SERIES, read once by prometheus-client,
    which ``disable_created_metrics`` stands for here)."""
    import prometheus_client
    from prometheus_client import values

    if not created:
        prometheus_client.disable_created_metrics()
        request.addfinalizer(prometheus_client.enable_created_metrics)

    def scraped(written: bool) -> tuple[dict, dict]:
        if written:
            monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
            # What prometheus-client chooses at import when the variable is set.
            monkeypatch.setattr(values, "ValueClass", values.MultiProcessValue())
        else:
            monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
        plugin = Metrics()
        plugin.relay_startup(config=config_module.parse(
            {"backends": [backend("http://127.0.0.1:9")]}, env={}),
            options={"path": "/metrics", "scrape_key_env": ""}, state=MemoryState())
        for exchange in exchanges_of_every_kind():
            if exchange.answer is not None and exchange.answer.stream:
                plugin.relay_stream_events(exchange)
                plugin.relay_stream_events(finished_exchange(stream=True))  # still open
            plugin.relay_exchange_end(exchange)
        text = (metrics_plugin.collect_processes() if written
                else generate_latest(plugin.registry)).decode()
        families = {family.name: (family.type, family.documentation)
                    for family in text_string_to_metric_families(text)
                    if family.samples and not family.name.endswith("_created")}
        return families, samples(text)

    own_families, own = scraped(written=False)
    their_families, theirs = scraped(written=True)
    assert own_families == their_families
    assert {key: v for key, v in own.items() if not key[0].endswith("_created")} == theirs
    assert value(own, "relay_upstream_latency_seconds_bucket", le="+Inf") == 11
    assert value(own, "relay_upstream_latency_seconds_bucket", le="300.0") == 10
    assert value(own, "relay_active_streams") == 1
    assert value(own, "relay_auth_failures_total") == 1
    assert value(own, "relay_credential_cooldown_seconds_total", credential="first") == 1.5
    assert value(own, "relay_upstream_ratelimit_remaining", kind="requests") == 41
    assert value(own, "relay_upstream_ratelimit_reset_timestamp_seconds",
                 kind="input_tokens") == 1796247000
    assert any(name.endswith("_created") for name, _ in own) is created


def test_label_values_that_are_equal_but_shown_apart_or_unhashable_keep_their_own_series():
    # The single-process families find a series by the values as given: 1, 1.0 and True are
    # one dict key, and a list none; each must still count under its own text.
    registry = CollectorRegistry()
    family = metrics_plugin.Family("counter", "relay_test_total", "a test", ["value"],
                                   registry)
    for value in (1, 1.0, True, ["a"], "1"):
        family.labels(value).inc()
    text = generate_latest(registry).decode()
    for shown, count in (("1", 2.0), ("1.0", 1.0), ("True", 1.0), ("['a']", 1.0)):
        assert f'relay_test_total{{value="{shown}"}} {count}' in text, (shown, text)



async def test_the_upstream_accounts_quota_is_kept_where_a_relay_keys_replaced_it(
        aiohttp_server, aiohttp_client, monkeypatch):
    """A key with limits gets its own anthropic-ratelimit-* headers, in place of the pooled
    account's; the account's stay in the metrics, by backend, credential and kind, as do
    those the client of a key without limits sees."""
    monkeypatch.setattr(metrics_plugin, "QUOTA_SECONDS", 0)  # every answer read
    upstream = Upstream()
    quota = iter([("4000", "3999", "2026-12-02T21:30:00Z"), ("4000", "3998", "not a time")])

    async def reply(request):
        limit, remaining, reset = next(quota)
        return web.json_response(ANSWER, headers={
            "anthropic-ratelimit-requests-limit": limit,
            "anthropic-ratelimit-requests-remaining": remaining,
            "anthropic-ratelimit-requests-reset": reset,
            "anthropic-ratelimit-output-tokens-remaining": "79000"})

    upstream.reply = reply
    server = await start_upstream(aiohttp_server, upstream)
    client = await start_relay(aiohttp_client, {
        "server": {"auth": {"keys": [{"name": "k", "key_env": "K",
                                      "limits": {"requests_per_minute": 7}},
                                     {"name": "open", "key_env": "OPEN"}],
                            "admin_key_env": "ADMIN"}},
        "pipeline": ["limits", "metrics"],
        "backends": [backend(str(server.make_url("")), name="main")]},
        env={"K": KEY, "OPEN": OTHER_KEY, "ADMIN": ADMIN_KEY})
    resp = await client.post("/v1/messages", json=BODY, headers={"x-api-key": KEY})
    assert resp.status == 200
    assert resp.headers["anthropic-ratelimit-requests-limit"] == "7"
    assert "anthropic-ratelimit-output-tokens-remaining" not in resp.headers
    found = samples(await (await client.get("/metrics", headers={"x-api-key": ADMIN_KEY})).text())
    labels = {"backend": "main", "credential": "-"}
    assert value(found, "relay_upstream_ratelimit_limit", kind="requests", **labels) == 4000
    assert value(found, "relay_upstream_ratelimit_remaining", kind="requests", **labels) == 3999
    assert value(found, "relay_upstream_ratelimit_remaining", kind="output_tokens",
                 **labels) == 79000
    assert value(found, "relay_upstream_ratelimit_reset_timestamp_seconds", kind="requests",
                 **labels) == 1796247000  # 2026-12-02T21:30:00Z
    # A key without limits sees none of the account's headers; the metrics do (a reset that
    # is not a time is left as it was).
    resp = await client.post("/v1/messages", json=BODY, headers={"x-api-key": OTHER_KEY})
    assert resp.status == 200
    assert not [name for name in resp.headers if name.lower().startswith("anthropic-ratelimit")]
    found = samples(await (await client.get("/metrics", headers={"x-api-key": ADMIN_KEY})).text())
    assert value(found, "relay_upstream_ratelimit_remaining", kind="requests", **labels) == 3998
    assert value(found, "relay_upstream_ratelimit_reset_timestamp_seconds", kind="requests",
                 **labels) == 1796247000
