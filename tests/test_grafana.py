"""The Grafana dashboard (docs/grafana/relay-dashboard.json): importable as Grafana's
"Import dashboard" takes a shared one, reading only metrics a real relay serves, and every
query of it run by a real Prometheus scraping a real relay after traffic."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from support import ROOT
from test_server import BODY, STREAM, Upstream, dying_stream, start_upstream, stream_reply
from test_upstream import scripted

from relay.testing import assistant, request, result, text, use, user
from relay.testing.fixtures import start_relay

DASHBOARD = ROOT / "docs" / "grafana" / "relay-dashboard.json"
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
FAST = {"attempts": 3, "backoff": 0.01, "max_backoff": 0.05, "budget": 5}
# What a PromQL expression names that is not a metric: functions, keywords, and the
# dashboard's variables.
NOT_METRICS = {"sum", "rate", "by", "histogram_quantile", "le", "without", "on", "ignoring"}
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count",
                                                             "_created"), "gauge": ("",)}
# The panels the traffic below must fill: the rest (auth failures, provenance, pool full,
# deferred rules, ...) need failures this traffic does not make, and must only run.
FILLED = {"Requests / s", "Failed (relay or upstream)", "Open streams", "Upstream latency p95",
          "Requests by outcome", "Requests by status", "Requests by backend and key",
          "Upstream latency (each attempt)", "Time to first byte", "Upstream errors by status",
          "Retries and fallbacks", "Repairs by plugin and rule",
          "Refused histories by plugin and rule", "Stream errors", "Dumps queued and dropped"}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def targets(board: dict):
    for panel in board["panels"]:
        for target in panel.get("targets", ()):
            yield panel, target


def metric_names(expr: str) -> set[str]:
    """The metric names an expression reads (label names inside braces and ``by (...)``
    left out)."""
    bare = re.sub(r"\{[^}]*\}", "", expr)
    bare = re.sub(r"\b(by|without)\s*\([^)]*\)", "", bare)
    bare = re.sub(r"\[[^\]]*\]", "", bare)
    # Not inside a number (``1e6``).
    return {name for name in re.findall(r"(?<![\w.])[a-zA-Z_:][a-zA-Z0-9_:]*", bare)
            if name not in NOT_METRICS}


def test_the_dashboard_is_importable():
    board = dashboard()
    assert isinstance(board["schemaVersion"], int) and board["schemaVersion"] >= 36
    assert board["title"] and board["uid"] and board["id"] is None
    [source] = board["__inputs"]
    assert source == {**source, "name": "DS_PROMETHEUS", "type": "datasource",
                      "pluginId": "prometheus"}
    assert {"type": "datasource", "id": "prometheus"}.items() <= next(
        r for r in board["__requires"] if r["type"] == "datasource").items()
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    used_types = {panel["type"] for panel in board["panels"]} - {"row"}
    assert used_types <= {r["id"] for r in board["__requires"] if r["type"] == "panel"}
    for panel in board["panels"]:
        grid = panel["gridPos"]
        assert set(grid) == {"h", "w", "x", "y"} and grid["x"] + grid["w"] <= 24
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == DATASOURCE and panel["targets"], panel["title"]
        refs = [target["refId"] for target in panel["targets"]]
        assert len(refs) == len(set(refs))
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE and target["expr"].strip()
    variables = {v["name"]: v for v in board["templating"]["list"]}
    for variable in variables.values():
        assert variable["datasource"] == DATASOURCE
    for _, target in targets(board):  # every $variable a query uses is defined
        for name in re.findall(r"\$(\w+)", target["expr"]):
            assert name in variables or name.startswith("__"), name
    # Panels do not overlap.
    cells = set()
    for panel in board["panels"]:
        grid = panel["gridPos"]
        mine = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"])
                for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not cells & mine, panel["title"]
        cells |= mine


async def traffic(aiohttp_server, aiohttp_client, tmp_path):
    """A relay with the shipped relay.yaml's plugins over scripted upstreams, after a bit of
    everything: answers, a retried and fallen-back request, a stream and a broken one, an
    upstream 500 (dumped), a repair and a refusal."""
    flaky, spare, failing, broken = Upstream(), Upstream(), Upstream(), Upstream()
    flaky.reply = scripted(529, 529, 529)
    failing.reply = scripted(500, 500)
    broken.reply = dying_stream
    streaming = Upstream()
    streaming.reply = stream_reply([STREAM])
    entries = []
    for name, upstream, extra in (
            ("main", flaky, {"models": ["claude-*"], "retries": FAST, "fallbacks": ["spare"]}),
            ("spare", spare, {"models": ["fix-*"], "quirks": {"pairing_mode": "repair"}}),
            ("failing", failing, {"models": ["fail-*"]}),
            ("broken", broken, {"models": ["broken-*"]}),
            ("streaming", streaming, {"models": ["stream-*"]})):
        server = await start_upstream(aiohttp_server, upstream)
        entries.append({"name": name, "url": str(server.make_url("")), **extra})
    raw = {"pipeline": ["metrics", "dedup", "pairing", "ordering", "dump"],
           "plugins": {"dump": {"dir": str(tmp_path / "dumps"), "statuses": ["400-599"]}},
           "backends": entries}
    client = await start_relay(aiohttp_client, raw)
    await exchanges(client)
    return client


async def exchanges(client) -> None:
    orphan = request(user(text("go")), assistant(use("toolu_a"), use("toolu_b")),
                     user(result("toolu_b"), text("and then")))
    for body, status in ((BODY, 200), (BODY, 200), ({**BODY, "model": "fail-1"}, 500),
                         ({**orphan, "model": "fix-1"}, 200), ({**orphan}, 400)):
        resp = await client.post("/v1/messages", json=body)
        assert resp.status == status, await resp.text()
    for model in ("stream-1", "broken-1"):
        resp = await client.post("/v1/messages", json={**BODY, "model": model, "stream": True})
        await resp.read()


async def scrape(client) -> dict[str, set[str]]:
    """The relay's /metrics: each exposed sample name, with the label names it was seen
    with (none for a family that has no sample yet)."""
    resp = await client.get("/metrics")
    assert resp.status == 200
    exposed: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(await resp.text()):
        for suffix in SUFFIXES.get(family.type, ("",)):
            exposed.setdefault(family.name + suffix, set())
        for sample in family.samples:
            exposed.setdefault(sample.name, set()).update(sample.labels)
    return exposed


async def test_every_metric_the_dashboard_reads_is_one_the_relay_serves(
        aiohttp_server, aiohttp_client, tmp_path):
    client = await traffic(aiohttp_server, aiohttp_client, tmp_path)
    exposed = await scrape(client)
    await client.chain.shutdown(client.config)
    for panel, target in targets(dashboard()):
        names = metric_names(target["expr"])
        assert names, target["expr"]
        for name in names:
            assert name in exposed, f"{panel['title']}: {name} is not a metric the relay serves"
            labels = exposed[name]
            if not labels:
                continue  # no sample yet: its labels are not on show
            selected = re.findall(r"(\w+)\s*=~?", " ".join(re.findall(r"\{([^}]*)\}",
                                                                        target["expr"])))
            grouped = re.findall(r"\bby\s*\(([^)]*)\)", target["expr"])
            wanted = set(selected) | {label.strip() for group in grouped
                                      for label in group.split(",")}
            assert wanted - {"le"} <= labels | {"le"}, (panel["title"], name, labels)
    for variable in dashboard()["templating"]["list"]:
        metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)",
                                     variable["query"]["query"]).groups()
        assert label in exposed[metric]


# --- a real Prometheus ------------------------------------------------------------------

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def query(base: str, expr: str) -> dict:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as e:  # a bad query is a 400 with the reason in its body
        return json.loads(e.read())


def substituted(expr: str) -> str:
    """A panel's query as Grafana sends it: its variables at "All", the rate interval of
    a short scrape."""
    return (expr.replace("$__rate_interval", "20s").replace('"$backend"', '".*"')
            .replace('"$key"', '".*"'))


@pytest.mark.slow
async def test_every_query_runs_in_a_real_prometheus_scraping_the_relay(
        aiohttp_server, aiohttp_client, tmp_path):
    client = await traffic(aiohttp_server, aiohttp_client, tmp_path)
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "relay", "metrics_path": "/metrics",
                            "static_configs": [{"targets": [
                                f"127.0.0.1:{client.server.port}"]}]}]}))
    prometheus = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        # Traffic between scrapes, so that every counter has grown within a rate's window.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            ready = await asyncio.to_thread(
                query, base, "count(relay_requests_total)") if _up(base) else {}
            if ready.get("data", {}).get("result"):
                break
            await asyncio.sleep(0.2)
        else:
            raise AssertionError("Prometheus never scraped the relay")
        await asyncio.sleep(1.5)
        await exchanges(client)
        await asyncio.sleep(3)  # three more scrapes
        empty = []
        for panel, target in targets(dashboard()):
            answer = await asyncio.to_thread(query, base, substituted(target["expr"]))
            assert answer["status"] == "success", (panel["title"], target["expr"], answer)
            if panel["title"] in FILLED and not answer["data"]["result"]:
                empty.append((panel["title"], target["refId"]))
        for variable in dashboard()["templating"]["list"]:
            metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)",
                                         variable["query"]["query"]).groups()
            url = f"{base}/api/v1/label/{label}/values?match[]={metric}"
            with urllib.request.urlopen(url, timeout=10) as response:
                assert json.loads(response.read())["data"], variable["name"]
        assert empty == []
    finally:
        prometheus.terminate()
        try:
            prometheus.wait(10)
        except subprocess.TimeoutExpired:
            prometheus.kill()
        await client.chain.shutdown(client.config)


def _up(base: str) -> bool:
    try:
        with urllib.request.urlopen(base + "/-/ready", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False
