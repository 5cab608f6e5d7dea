"""The usage plugin through a real relay in front of the emulators: what each key used and
what it cost, to the micro-dollar, for answers and streams from Anthropic-format and
OpenAI-format backends; abandoned streams; the ledger's rows; the admin endpoint; the
``relay usage`` command."""

from __future__ import annotations

import argparse
import asyncio
import csv
import io
import logging

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from relay import usage as metering
from relay.testing import emulator, emulator_openai, request, text, user
from relay.testing.fixtures import start_relay

KEYS = {"KEY_A": "relay-key-team-a-0123456789", "KEY_B": "relay-key-team-b-0123456789",
        "ADMIN": "relay-admin-key-0123456789abcdef"}
SONNET = {"input": 3, "output": 15, "cache_write_5m": 3.75, "cache_write_1h": 6,
          "cache_read": 0.30}
PRICES = [{"models": ["claude-sonnet-*", "gpt-*"], "usd_per_mtok": SONNET,
           "usd_per_server_tool_request": {"web_search": 0.01}}]
# What the emulator is told to report, and its price at SONNET's rates in micro-dollars:
# 120*3 + 45*15 + 900*0.3 + 200*3.75 + 64*6 + 2 searches * 10000.
REPORT = "input=120,output=45,cache_read=900,cache_write_5m=200,cache_write_1h=64,web_search=2"
COST = 360 + 675 + 270 + 750 + 384 + 20000


def key(name: str) -> dict:
    return {"x-api-key": KEYS[name]}


async def relay_for(aiohttp_client, aiohttp_server, *, fmt="anthropic", pipeline=None,
                    prices=PRICES, backend=None, **options):
    settings = emulator.EmulatorOptions(**options)
    if fmt == "openai":  # the options of its own, as `relay emulate --format openai` sets them
        settings.late_ids = settings.interleave = settings.bad_arguments = False
        settings.reasoning_field = "reasoning_content"
    upstream = await aiohttp_server(
        (emulator_openai if fmt == "openai" else emulator).create_app(settings))
    url = str(upstream.make_url("")).rstrip("/")
    client = await start_relay(aiohttp_client, {
        "server": {"access_log": True, "auth": {
            "keys": [{"name": "team-a", "key_env": "KEY_A"},
                     {"name": "team-b", "key_env": "KEY_B"}],
            "admin_key_env": "ADMIN"}},
        "pipeline": pipeline or ["usage", "metrics"],
        "plugins": {"usage": {"prices": prices}},
        "backends": [{"name": "emu", "url": url + ("/v1" if fmt == "openai" else ""),
                      "models": ["*"], **({"format": "openai"} if fmt == "openai" else {}),
                      **(backend or {})}]}, env=KEYS)
    client.upstream = upstream
    return client


async def ledger(client, count: int) -> list[dict]:
    """The ledger once it holds ``count`` rows (end hooks run after the answer's last byte)."""
    for _ in range(200):
        rows = await client.chain.state.rows()
        if len(rows) >= count:
            return rows
        await asyncio.sleep(0.01)
    raise AssertionError(f"the ledger holds {len(rows)} rows, not {count}")


async def post(client, body, who="KEY_A", report=REPORT):
    return await client.post("/v1/messages", json=body,
                             headers={**key(who), emulator.USAGE_HEADER: report})


def metric(text_: str, name: str, **labels) -> float:
    return sum(sample.value for family in text_string_to_metric_families(text_)
               for sample in family.samples
               if sample.name == name and all(sample.labels.get(k) == v
                                              for k, v in labels.items()))


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream"])
async def test_usage_and_cost_are_what_the_upstream_reported_per_key(
        aiohttp_client, aiohttp_server, caplog, stream):
    client = await relay_for(aiohttp_client, aiohttp_server)
    caplog.set_level(logging.INFO, logger="relay.access")
    body = request(user(text("go")), model="claude-sonnet-5-5", stream=stream)
    first = await post(client, body, "KEY_A")
    second = await post(client, body, "KEY_B", report="input=1000000,output=0")
    assert first.status == second.status == 200
    await first.read(), await second.read()
    rows = {row["key"]: row for row in await ledger(client, 2)}
    a, b = rows["team-a"], rows["team-b"]
    assert (a["input_tokens"], a["output_tokens"], a["cache_read_input_tokens"],
            a["cache_write_5m_input_tokens"], a["cache_write_1h_input_tokens"]) == (
        120, 45, 900, 200, 64)
    assert a["server_tool_requests"] == {"web_search": 2}
    assert a["cost_micro_usd"] == COST and a["priced"] and a["usage_complete"]
    assert a["usage_reported"] and b["usage_reported"]
    assert b["input_tokens"] == 1_000_000 and b["cost_micro_usd"] == 3_000_000
    assert a["stream"] is stream and a["model"] == "claude-sonnet-5-5" and a["backend"] == "emu"
    assert a["status"] == 200 and a["outcome"] == "ok" and a["endpoint"] == "messages"
    assert a["attempts"] == [{"backend": "emu", "credential": None, "status": 200,
                              "wait_ms": 0.0}]
    lines = [record.access for record in caplog.records if hasattr(record, "access")]
    assert {(line["key"], line["input_tokens"], line["cost_micro_usd"]) for line in lines} == {
        ("team-a", 120, COST), ("team-b", 1_000_000, 3_000_000)}
    scraped = await client.get("/metrics", headers=key("ADMIN"))
    found = await scraped.text()
    assert metric(found, "relay_tokens_total", key="team-a", model="claude-sonnet-5-5",
                  kind="cache_read") == 900
    assert metric(found, "relay_cost_micro_usd_total", key="team-b") == 3_000_000


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream"])
async def test_an_openai_backend_counts_cached_prompt_tokens_once(
        aiohttp_client, aiohttp_server, stream):
    client = await relay_for(aiohttp_client, aiohttp_server, fmt="openai")
    # The emulator reports prompt_tokens 1120 with 900 of them cached, as OpenAI does.
    resp = await post(client, request(user(text("go")), model="gpt-4.1-mini", stream=stream),
                      report="input=220,output=30,cache_read=900")
    assert resp.status == 200
    await resp.read()
    [row] = await ledger(client, 1)
    assert (row["input_tokens"], row["cache_read_input_tokens"], row["output_tokens"]) == (
        220, 900, 30)
    assert row["cost_micro_usd"] == 220 * 3 + 900 * 0.3 + 30 * 15 and row["usage_complete"]


FORMATS = [("anthropic", "claude-sonnet-5-5"), ("openai", "gpt-4.1-mini")]


async def streamed_usage(resp) -> dict:
    """The usage a client reads from the answer: the whole one's, or a stream's, each field as
    the last event that gave it said (the SDK's accumulator)."""
    if resp.content_type != "text/event-stream":
        return (await resp.json()).get("usage")
    from relay.sse import SSEDecoder
    usage: dict = {}
    for event in SSEDecoder().feed(await resp.read()):
        if event.name == "message_start":
            usage.update(event.data["message"].get("usage") or {})
        elif event.name == "message_delta":
            usage.update(event.data.get("usage") or {})
    return usage


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream"])
@pytest.mark.parametrize("fmt, model", FORMATS, ids=[f for f, _ in FORMATS])
async def test_an_answer_without_usage_is_counted_as_nothing_and_flagged(
        aiohttp_client, aiohttp_server, caplog, fmt, model, stream):
    # Issue #22: many OpenAI-compatible servers ignore stream_options.include_usage (and some
    # report no usage at all); answers that say nothing were charged 0 with nothing flagged.
    client = await relay_for(aiohttp_client, aiohttp_server, fmt=fmt)
    caplog.set_level(logging.INFO, logger="relay.access")
    resp = await post(client, request(user(text("go")), model=model, stream=stream),
                      report="none")
    assert resp.status == 200
    usage = await streamed_usage(resp)
    if fmt == "openai":  # the client still gets Anthropic's shape, with nothing made up
        assert (usage["input_tokens"], usage["output_tokens"]) == (0, 0)
    [row] = await ledger(client, 1)
    assert row["usage_reported"] is False and row["usage_complete"]
    assert (row["input_tokens"], row["output_tokens"], row["cost_micro_usd"]) == (0, 0, 0)
    [line] = [r.access for r in caplog.records if hasattr(r, "access")]
    assert line["usage_reported"] is False and line["input_tokens"] == 0
    [warning] = [r.getMessage() for r in caplog.records if "did not report" in r.getMessage()]
    assert "upstream emu" in warning
    found = await (await client.get("/metrics", headers=key("ADMIN"))).text()
    assert metric(found, "relay_usage_unreported_total", backend="emu", key="team-a",
                  model=model) == 1
    [group] = await (await client.get("/v1/relay/usage", headers=key("ADMIN"))).json()
    assert (group["requests"], group["unreported_requests"]) == (1, 1)


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream"])
@pytest.mark.parametrize("fmt, model", FORMATS, ids=[f for f, _ in FORMATS])
@pytest.mark.parametrize("withheld", ["output", "input"])
async def test_partial_usage_counts_what_was_given_and_is_flagged(
        aiohttp_client, aiohttp_server, fmt, model, stream, withheld):
    client = await relay_for(aiohttp_client, aiohttp_server, fmt=fmt)
    resp = await post(client, request(user(text("go")), model=model, stream=stream),
                      report=f"input=120,output=45,cache_read=900,{withheld}=-")
    assert resp.status == 200
    await resp.read()
    [row] = await ledger(client, 1)
    assert row["usage_reported"] is False
    counted = {"input": 120, "output": 45, withheld: 0}
    assert (row["input_tokens"], row["output_tokens"], row["cache_read_input_tokens"]) == (
        counted["input"], counted["output"], 900)
    assert row["cost_micro_usd"] == counted["input"] * 3 + counted["output"] * 15 + 270


async def test_a_stream_cut_before_its_usage_is_final_is_charged_what_was_reported(
        aiohttp_client, aiohttp_server):
    # Upstream gone after message_start, ping and a block's start: no message_delta.
    client = await relay_for(aiohttp_client, aiohttp_server, cut_after=3)
    resp = await post(client, request(user(text("go")), model="claude-sonnet-5-5", stream=True))
    await resp.read()
    [row] = await ledger(client, 1)
    assert not row["usage_complete"]
    # message_start's input side, and the one output token it reports.
    assert (row["input_tokens"], row["cache_read_input_tokens"], row["output_tokens"]) == (
        120, 900, 1)
    assert row["cost_micro_usd"] == 360 + 15 + 270 + 750 + 384


async def test_an_openai_stream_cut_before_its_usage_chunk_is_marked_incomplete(
        aiohttp_client, aiohttp_server):
    # An OpenAI-format stream reports its usage in its last chunk only: cut before it, the
    # upstream reported nothing, and the row says that it is incomplete rather than free.
    client = await relay_for(aiohttp_client, aiohttp_server, fmt="openai", cut_after=3)
    resp = await post(client, request(user(text("go")), model="gpt-4.1-mini", stream=True))
    streamed = await resp.read()
    assert b"event: error" in streamed
    [row] = await ledger(client, 1)
    assert not row["usage_complete"]
    assert (row["input_tokens"], row["output_tokens"], row["cost_micro_usd"]) == (0, 0, 0)


async def test_a_stream_the_client_abandons_is_charged_and_marked_incomplete(
        aiohttp_client, aiohttp_server):
    client = await relay_for(aiohttp_client, aiohttp_server, stall_after=4, stall_ms=3000)
    resp = await post(client, request(user(text("go")), model="claude-sonnet-5-5", stream=True))
    assert b"message_start" in await resp.content.readuntil(b"message_start")
    resp.close()
    [row] = await ledger(client, 1)
    assert row["outcome"] == "client_disconnected" and not row["usage_complete"]
    assert (row["input_tokens"], row["output_tokens"]) == (120, 1)


async def test_one_row_per_exchange_retries_included(aiohttp_client, aiohttp_server):
    client = await relay_for(aiohttp_client, aiohttp_server, fail_status=529, fail_count=1,
                             backend={"retries": {"attempts": 2, "backoff": 0.01}})
    resp = await post(client, request(user(text("go")), model="claude-sonnet-5-5"))
    assert resp.status == 200
    [row] = await ledger(client, 1)
    assert [a["status"] for a in row["attempts"]] == [529, 200]
    assert row["cost_micro_usd"] == COST
    # The same row written again (a retried write) is still one row.
    await client.chain.state.record([dict(row)])
    assert len(await client.chain.state.rows()) == 1


async def test_a_model_without_a_price_is_counted_and_flagged(aiohttp_client, aiohttp_server,
                                                            caplog):
    client = await relay_for(aiohttp_client, aiohttp_server)
    for _ in range(2):
        resp = await post(client, request(user(text("go")), model="kimi-k2"))
        assert resp.status == 200
    rows = await ledger(client, 2)
    assert [r.message for r in caplog.records if "no price" in r.message] == [
        "plugins.usage.prices: no price for model 'kimi-k2': its usage is counted in tokens, "
        "not in cost (relay_usage_unpriced_total)"]  # once a model
    row = rows[0]
    assert row["cost_micro_usd"] is None and row["priced"] is False
    assert row["input_tokens"] == 120
    found = await (await client.get("/metrics", headers=key("ADMIN"))).text()
    assert metric(found, "relay_usage_unpriced_total", key="team-a", model="kimi-k2") == 2
    usage = await (await client.get("/v1/relay/usage?by=model", headers=key("ADMIN"))).json()
    assert usage == [{"model": "kimi-k2", "requests": 2, "input_tokens": 240,
                      "output_tokens": 90, "cache_read_input_tokens": 1800,
                      "cache_write_5m_input_tokens": 400, "cache_write_1h_input_tokens": 128,
                      "cost_micro_usd": 0, "unpriced_requests": 2, "unreported_requests": 0}]


async def test_the_usage_endpoint_is_the_operators(aiohttp_client, aiohttp_server):
    client = await relay_for(aiohttp_client, aiohttp_server)
    for who in ("KEY_A", "KEY_B"):
        await (await post(client, request(user(text("go")), model="claude-sonnet-5-5"),
                          who)).read()
    await ledger(client, 2)
    refused = await client.get("/v1/relay/usage", headers=key("KEY_A"))
    assert refused.status == 403
    assert (await refused.json())["error"]["type"] == "permission_error"
    assert (await client.get("/v1/relay/usage")).status == 401
    by_key = await (await client.get("/v1/relay/usage", headers=key("ADMIN"))).json()
    assert [(g["key"], g["requests"], g["cost_micro_usd"]) for g in by_key] == [
        ("team-a", 1, COST), ("team-b", 1, COST)]
    by_day = await (await client.get("/v1/relay/usage?by=day&since=2026-01-01",
                                     headers=key("ADMIN"))).json()
    assert [g["requests"] for g in by_day] == [2]
    none = await (await client.get("/v1/relay/usage?until=2000-01-01",
                                   headers=key("ADMIN"))).json()
    assert none == []
    bad = await client.get("/v1/relay/usage?by=colour", headers=key("ADMIN"))
    assert bad.status == 400 and "by" in (await bad.json())["error"]["message"]
    bad = await client.get("/v1/relay/usage?since=yesterday", headers=key("ADMIN"))
    assert bad.status == 400


async def test_the_usage_endpoint_with_the_state_out_is_a_clean_503(aiohttp_client,
                                                                    aiohttp_server, tmp_path):
    """The ledger unreachable (another process holds the SQLite file's write lock past the
    timeout): the operator's endpoint answers 503 in Anthropic's format, not aiohttp's bare
    500 with a traceback in the log."""
    import sqlite3

    upstream = await aiohttp_server(emulator.create_app(emulator.EmulatorOptions()))
    path = tmp_path / "state.db"
    client = await start_relay(aiohttp_client, {
        "server": {"auth": {"keys": [{"name": "team-a", "key_env": "KEY_A"}],
                            "admin_key_env": "ADMIN"}},
        "state": {"url": f"sqlite:///{path}", "timeout": 0.1}, "pipeline": ["usage"],
        "backends": [{"name": "emu", "url": str(upstream.make_url("")).rstrip("/"),
                      "models": ["*"]}]}, env=KEYS)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        resp = await client.get("/v1/relay/usage", headers=key("ADMIN"))
        assert resp.status == 503
        body = await resp.json()
        assert body["type"] == "error" and body["error"]["type"] == "api_error"
        assert "state" in body["error"]["message"]
    finally:
        holder.execute("ROLLBACK")
        holder.close()
        await client.close()
        await client.chain.shutdown(client.config)


async def test_a_ledger_nobody_could_read_is_not_kept(aiohttp_client, aiohttp_server, caplog):
    # No state url (rows in this process's memory) and no admin key (no route reads them):
    # the usage is still metered, and no row is kept.
    upstream = await aiohttp_server(emulator.create_app(emulator.EmulatorOptions()))
    client = await start_relay(aiohttp_client, {
        "server": {"access_log": True,
                   "auth": {"keys": [{"name": "team-a", "key_env": "KEY_A"}]}},
        "pipeline": ["usage"], "plugins": {"usage": {"prices": PRICES}},
        "backends": [{"name": "emu", "url": str(upstream.make_url("")).rstrip("/"),
                      "models": ["*"]}]}, env=KEYS)
    with caplog.at_level(logging.INFO, logger="relay.access"):
        resp = await post(client, request(user(text("go")), model="claude-sonnet-5-5"))
        assert resp.status == 200
        await resp.read()
        for _ in range(100):
            if any("cost_micro_usd" in r.getMessage() for r in caplog.records):
                break
            await asyncio.sleep(0.01)
    [line] = [r.getMessage() for r in caplog.records if r.name == "relay.access"]
    assert f"cost_micro_usd={COST}" in line and "input_tokens=120" in line
    assert await client.chain.state.rows() == []


async def test_refusals_before_routing_write_no_row(aiohttp_client, aiohttp_server):
    client = await relay_for(aiohttp_client, aiohttp_server)
    for _ in range(3):
        resp = await client.post("/v1/messages", json=request(user(text("go"))),
                                 headers={"x-api-key": "wrong-key-0123456789abcdef"})
        assert resp.status == 401
    await (await post(client, request(user(text("go")), model="claude-sonnet-5-5"))).read()
    assert [row["key"] for row in await ledger(client, 1)] == ["team-a"]


@pytest.mark.parametrize("by", metering.GROUPS)
async def test_relay_usage_prints_the_ledger_added_up(aiohttp_client, aiohttp_server,
                                                      monkeypatch, tmp_path, capsys, by):
    client = await relay_for(aiohttp_client, aiohttp_server)
    for who, model, report in (("KEY_A", "claude-sonnet-5-5", REPORT),
                               ("KEY_A", "kimi-k2", REPORT),
                               ("KEY_B", "claude-sonnet-5-5", REPORT),
                               ("KEY_B", "claude-sonnet-5-5", "none")):
        await (await post(client, request(user(text("go")), model=model), who, report)).read()
    await ledger(client, 4)
    state = client.chain.state

    async def the_serving_state(options):
        return state
    monkeypatch.setattr("relay.state.open_state", the_serving_state)
    monkeypatch.setattr(state, "close", lambda: asyncio.sleep(0))
    config = tmp_path / "relay.yaml"
    config.write_text("backends: [{name: emu, url: 'http://127.0.0.1:9', models: ['*']}]\n")

    def command(*options: str) -> str:
        parser = argparse.ArgumentParser()
        metering.add_arguments(parser)
        args = parser.parse_args(["--config", str(config), "--by", by, *options])
        assert metering.main(args) == 0
        return capsys.readouterr().out

    async def run(*options: str) -> str:  # the command runs its own event loop
        return await asyncio.to_thread(command, *options)

    groups = orjson.loads(await run("--json"))
    assert sum(g["requests"] for g in groups) == 4
    assert sum(g["cost_micro_usd"] for g in groups) == 2 * COST
    assert sum(g["unpriced_requests"] for g in groups) == 1
    assert sum(g["unreported_requests"] for g in groups) == 1
    assert all(set(g) == {by, *metering.COLUMNS} for g in groups)
    if by == "key":
        assert [(g["key"], g["requests"], g["unpriced_requests"], g["unreported_requests"])
                for g in groups] == [("team-a", 2, 1, 0), ("team-b", 2, 0, 1)]
    if by == "model":
        assert [(g["model"], g["cost_micro_usd"]) for g in groups] == [
            ("claude-sonnet-5-5", 2 * COST), ("kimi-k2", 0)]
    rows = list(csv.reader(io.StringIO(await run("--csv"))))
    assert rows[0] == [by, *metering.COLUMNS] and len(rows) == len(groups) + 1
    assert [int(r[rows[0].index("requests")]) for r in rows[1:]] == [
        g["requests"] for g in groups]
    assert [int(r[rows[0].index("unreported_requests")]) for r in rows[1:]] == [
        g["unreported_requests"] for g in groups]
    lines = (await run()).splitlines()
    assert lines[0].split()[0] == by and "cost USD" in lines[0]
    assert lines[0].split()[-1] == "unreported"
    assert len(lines) == len(groups) + 1
    if by == "backend":
        assert lines[1].split()[0] == "emu" and metering.usd(2 * COST) in lines[1]
    assert (await run("--json", "--until", "2000-01-01")).strip() == "[]"


def test_relay_usage_with_the_state_out_says_so_without_a_traceback(tmp_path, capsys):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    config = tmp_path / "relay.yaml"
    config.write_text("backends: [{name: emu, url: 'http://127.0.0.1:9', models: ['*']}]\n"
                      f"state: {{url: 'redis://:secret@127.0.0.1:{port}/0', timeout: 0.1}}\n")
    parser = argparse.ArgumentParser()
    metering.add_arguments(parser)
    assert metering.main(parser.parse_args(["--config", str(config)])) == 1
    out, err = capsys.readouterr()
    assert out == "" and "relay usage: the state cannot be reached" in err
    assert "Traceback" not in err and "secret" not in err


@pytest.mark.slow
def test_relay_usage_reads_the_ledger_a_serving_relay_wrote(emulator, relay, tmp_path):
    """Across processes: a relay writes its rows to a SQLite state, `relay usage` (a process
    of its own, on the same relay.yaml) adds them up."""
    import json
    import subprocess
    import sys
    import time
    import urllib.request

    from support import ROOT, backend

    emu = emulator("--usage", "input=100,output=10,cache_read=50,cache_write_1h=8")
    state = tmp_path / "state.db"
    served = relay({"server": {"auth": {"keys": [{"name": "team-a", "key_env": "KEY_A"}],
                                        "admin_key_env": "ADMIN"}},
                    "state": {"url": f"sqlite:///{state}"}, "pipeline": ["usage"],
                    "plugins": {"usage": {"prices": PRICES}},
                    "backends": [backend(emu.url)]}, env=KEYS)
    for model in ("claude-sonnet-5-5", "kimi-k2"):
        call = urllib.request.Request(
            served.url + "/v1/messages", method="POST",
            data=orjson.dumps(request(user(text("go")), model=model)),
            headers={"content-type": "application/json", "x-api-key": KEYS["KEY_A"]})
        with urllib.request.urlopen(call, timeout=10) as answer:
            assert answer.status == 200

    def usage(*options: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "relay", "usage", "--config",
                               str(served.config_path), *options], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
    deadline = time.monotonic() + 10
    while True:  # the serving relay writes its rows in batches
        done = usage("--by", "model", "--json")
        assert done.returncode == 0, done.stderr
        groups = json.loads(done.stdout)
        if sum(g["requests"] for g in groups) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert [(g["model"], g["requests"], g["cost_micro_usd"], g["unpriced_requests"])
            for g in groups] == [("claude-sonnet-5-5", 1, 100 * 3 + 10 * 15 + 50 * 0.3 + 8 * 6, 0),
                                 ("kimi-k2", 1, 0, 1)]
    assert done.stderr == ""
    table = usage()
    assert table.returncode == 0 and table.stdout.split("\n")[1].split()[:2] == ["team-a", "2"]
    bad = usage("--since", "last tuesday")
    assert bad.returncode == 2 and "neither a date" in bad.stderr
