"""The benchmark's load generator sends the growing session the way its rows say: each
connection a session of its own, not in step with the others, and untouched by the runs of
other workloads between its own."""

from __future__ import annotations

import sys
from pathlib import Path

from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))
import load  # noqa: E402
import workloads  # noqa: E402

TURN = {body: n for n, body in enumerate(workloads.session_bodies())}


async def recorder(aiohttp_server):
    seen: list[tuple[str, bytes]] = []

    async def messages(request: web.Request) -> web.Response:
        seen.append((request.headers.get(workloads.SESSION_HEADER, ""), await request.read()))
        return web.Response(body=workloads.ANSWER, content_type="application/json")

    app = web.Application(client_max_size=8 * 1024 * 1024)
    app.router.add_post("/v1/messages", messages)
    server = await aiohttp_server(app)
    return str(server.make_url("")).rstrip("/"), seen


async def run(runner: load.Load, url: str, workload: str, concurrency: int, count: int):
    await runner.run({"url": url, "workload": workload, "concurrency": concurrency,
                      "count": count, "seconds": 60})


def turns(seen: list[tuple[str, bytes]]) -> dict[str, list[int]]:
    by_session: dict[str, list[int]] = {}
    for session, body in seen:
        by_session.setdefault(session, []).append(TURN[body])
    return by_session


async def test_growing_sessions_are_spread_over_the_cycle(aiohttp_server):
    url, seen = await recorder(aiohttp_server)
    runner = load.Load()
    try:
        await run(runner, url, "session", 32, 64)
    finally:
        await runner.close()
    by_session = turns(seen)
    assert len(by_session) == 32
    firsts = sorted(ours[0] for ours in by_session.values())
    # Connection w begins at turn w * 40 // 32: every session at a turn of its own, so they
    # go back to their first turn in different rounds.
    assert firsts == [w * workloads.SESSION_REQUESTS // 32 for w in range(32)]
    for ours in by_session.values():
        assert ours[1] == (ours[0] + 1) % workloads.SESSION_REQUESTS


async def test_other_workloads_do_not_move_a_growing_session(aiohttp_server):
    url, seen = await recorder(aiohttp_server)
    runner = load.Load()
    try:
        await run(runner, url, "session", 2, 2)
        for workload in ("history_changed", "small"):
            await run(runner, url, workload, 2, 6)
        del seen[2:]
        await run(runner, url, "session", 2, 2)
    finally:
        await runner.close()
    # Each session goes on at the turn after its last one, whatever ran in between.
    assert sorted(turns(seen).values()) == [[0, 1], [1, 2]]
