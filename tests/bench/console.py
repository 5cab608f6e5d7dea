"""The console's pages with a full record: how long each takes to render and how much it
weighs, against the targets (under 200 ms; pages and assets together at most 300 KB).

    python tests/bench/console.py [--exchanges 10000] [--dumps 1000] [--rounds 7] [--sqlite]

A relay in process with the console on, its shared state (in memory, or with ``--sqlite``
a SQLite file, as workers share it) holding
``--exchanges`` ledger rows over the last day (sessions, repairs, id rewrites, cache breaks,
errors, dumps named), and ``--dumps`` dump files in its dump directory (copies of one real
dump of an upstream 400). Each page is fetched ``--rounds`` times through a real socket after
logging in; the first fetch's wall time (the console reads the record afresh) and the
median of the rest (it reads only what is new since, see relay.console.Recent) are printed
per page with its size. Not a test: a figure.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import re
import statistics
import sys
import tempfile
import time

import aiohttp
from aiohttp import web

from relay import config as config_module
from relay import document as record
from relay.chain import Chain, load_plugins
from relay.server import create_app
from relay.testing import assistant, emulator, finished_exchange, request, result, text, use, user

ADMIN = "bench-admin-key-0123456789"
CLIENT = "bench-client-key-0123456789"
CSRF = re.compile(r'name="csrf" value="([0-9a-f]+)"')
RENDER_TARGET_MS = 200
WEIGHT_TARGET = 300 * 1024


def rows(count: int, now: float) -> list[dict]:
    out = []
    for n in reversed(range(count)):
        t = now - n * 86400 / count
        status = 400 if n % 25 == 0 else 200
        out.append({
            "id": f"req_{n:08d}", "time": t, "key": f"team-{n % 4}", "backend": "emulator",
            "credential": f"cred-{n % 2}", "model": "claude-test", "endpoint": "messages",
            "stream": n % 2 == 0, "status": status,
            "outcome": "upstream_error" if status == 400 else "ok", "duration_ms": 40 + n % 90,
            "input_tokens": 200, "output_tokens": 50, "cache_read_input_tokens": 4000,
            "cache_write_5m_input_tokens": 100, "cache_write_1h_input_tokens": 0,
            "server_tool_requests": {}, "cost_micro_usd": 2100, "priced": True,
            "usage_complete": True, "session": f"session-{n // 20:06d}",
            "cache": ({"status": "miss", "cause": "system_changed", "where": "system"}
                      if n % 50 == 1 else {"status": "hit", "cause": None, "where": None}),
            "repairs": 1 if n % 10 == 0 else 0, "notes": [],
            "dump": f"{dt.datetime.fromtimestamp(t, dt.timezone.utc):%H%M%S.%f}-req_{n:08d}.json"
            if status == 400 else None,
            "timeline": [{"t": t, "step": "dedup", "action": "rewrote", "direction": "to_client",
                          "ids": [["toolu_a", "toolu_a-2"]]}] if n % 7 == 0 else [],
            "attempts": [{"backend": "emulator", "credential": f"cred-{n % 2}",
                          "status": status, "wait_ms": 0}]})
    return out


def write_dumps(directory: str, count: int, now: float) -> str:
    """``count`` dumps, copies of one real dump document; returns one's name."""
    body = request(user(text("go")), assistant(use("toolu_1")), user(result("toolu_1")),
                   assistant(text("done")), user(text("again"), result("toolu_gone")))
    exchange = finished_exchange(body, status=400, answer={"type": "error", "error": {
        "type": "invalid_request_error", "message": "messages.4.content.1: unexpected "
        "`tool_use_id` found in `tool_result` blocks: toolu_gone."}})
    config = config_module.parse({"backends": [{"name": "emulator", "url": "http://127.0.0.1:1",
                                                "models": ["*"]}]}, {})
    data = record.encode(record.to_document(
        exchange, reason="upstream_error", when=dt.datetime.now(dt.timezone.utc),
        config=record.config_document(config)))
    name = ""
    for n in range(count):
        when = dt.datetime.fromtimestamp(now - n * 60, dt.timezone.utc)
        day = os.path.join(directory, f"{when:%Y-%m-%d}")
        os.makedirs(day, exist_ok=True)
        file = f"{when:%H%M%S.%f}-req_{n:08d}.json"
        with open(os.path.join(day, file), "wb") as f:
            f.write(data)
        name = name or f"{when:%Y-%m-%d}/{file}"
    return name


async def main(args) -> int:
    now = time.time()
    with tempfile.TemporaryDirectory() as directory:
        dumps = os.path.join(directory, "dumps")
        one_dump = write_dumps(dumps, args.dumps, now)
        upstream = web.AppRunner(emulator.create_app(emulator.EmulatorOptions()))
        await upstream.setup()
        site = web.TCPSite(upstream, "127.0.0.1", 0)
        await site.start()
        port = upstream.addresses[0][1]
        config = config_module.parse({
            "server": {"console": True, "auth": {"keys": [{"name": "team-0", "key_env": "K"}],
                                                 "admin_key_env": "ADMIN"}},
            "pipeline": ["dump"], "plugins": {"dump": {"dir": dumps}},
            "state": {"url": f"sqlite:///{directory}/state.db"} if args.sqlite else {},
            "backends": [{"name": "emulator", "url": f"http://127.0.0.1:{port}"}]},
            {"ADMIN": ADMIN, "K": CLIENT})
        chain = Chain(load_plugins(config.pipeline), config)
        await chain.startup(config)
        assert chain.state is not None
        await chain.state.record(rows(args.exchanges, now))
        relay = web.AppRunner(create_app(config, chain))
        await relay.setup()
        relay_site = web.TCPSite(relay, "127.0.0.1", 0)
        await relay_site.start()
        base = f"http://127.0.0.1:{relay.addresses[0][1]}"
        pages = ["/console", "/console/keys", "/console/sessions", "/console/exchanges",
                 "/console/exchanges?outcome=upstream_error",
                 f"/console/exchange?id=req_{7:08d}", "/console/session?id=session-000000",
                 "/console/dumps", f"/console/dump?name={one_dump}", "/console/backends",
                 "/console/static/console.css", "/console/login"]
        failed = False
        # unsafe: the jar keeps cookies of an IP address (the relay on 127.0.0.1)
        async with aiohttp.ClientSession(base_url=base,
                                         cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
            form = await (await http.get("/console/login")).text()
            token = CSRF.search(form).group(1)  # type: ignore[union-attr]
            await http.post("/console/login", data={"csrf": token, "key": ADMIN},
                            allow_redirects=False)  # the first page is fetched cold
            print(f"{args.exchanges} exchanges, {args.dumps} dumps on record "
                  f"({chain.state.kind} state); median of {args.rounds} rounds")
            print(f"{'page':52} {'first':>8} {'median':>8} {'bytes':>9}")
            weight = 0
            for page in pages:
                times = []
                for _ in range(args.rounds):
                    started = time.perf_counter()
                    async with http.get(page, allow_redirects=False) as resp:
                        body = await resp.read()
                        assert resp.status == 200, (page, resp.status)
                    times.append((time.perf_counter() - started) * 1000)
                median = statistics.median(times[1:])
                weight += len(body)
                verdict = "" if max(times[0], median) < RENDER_TARGET_MS else "  OVER TARGET"
                failed |= bool(verdict)
                print(f"{page[:52]:52} {times[0]:8.1f} {median:8.1f} {len(body):9d}{verdict}")
            print(f"{'all pages and assets':52} {'':8} {'':8} {weight:9d}"
                  f"{'' if weight <= WEIGHT_TARGET else '  OVER TARGET'}")
            failed |= weight > WEIGHT_TARGET
        await relay.cleanup()
        await chain.shutdown(config)
        await upstream.cleanup()
    return 1 if failed else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--exchanges", type=int, default=10_000)
    parser.add_argument("--dumps", type=int, default=1_000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--sqlite", action="store_true", help="the state in a SQLite file")
    sys.exit(asyncio.run(main(parser.parse_args())))
