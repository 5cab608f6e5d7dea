"""The benchmark's load generator sends the growing session the way its rows say: sessions
that only grow, their first requests kept out of the measured rounds, untouched by the runs
of other workloads between their own."""

from __future__ import annotations

import math
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


async def run(runner: load.Load, url: str, workload: str, concurrency: int, count: int,
              sessions: int = 1) -> dict:
    return await runner.run({"url": url, "workload": workload, "concurrency": concurrency,
                             "count": count, "seconds": 60, "sessions": sessions})


def turns(seen: list[tuple[str, bytes]]) -> dict[str, list[int]]:
    by_session: dict[str, list[int]] = {}
    for session, body in seen:
        by_session.setdefault(session, []).append(TURN[body])
    return by_session


async def test_a_growing_session_never_shrinks(aiohttp_server):
    url, seen = await recorder(aiohttp_server)
    runner = load.Load()
    try:
        first = await run(runner, url, "session", 2, 2 * workloads.SESSION_REQUESTS + 10)
    finally:
        await runner.close()
    by_session = turns(seen)
    # Each connection went through a session's turns in order, then began a new one: no
    # session id ever goes back to an earlier turn (which the relay would walk whole).
    assert len(by_session) == 4
    for ours in by_session.values():
        assert ours == list(range(len(ours)))
    assert first["session_starts"] == 4


async def test_the_measured_rounds_begin_no_session(aiohttp_server):
    url, seen = await recorder(aiohttp_server)
    runner = load.Load()
    rounds, per_round, concurrency = 3, 100, 1
    sessions = math.ceil((rounds + 1) * per_round / concurrency / workloads.SESSION_REQUESTS)
    try:
        warm = await run(runner, url, "session", concurrency, per_round, sessions)
        measured = [await run(runner, url, "session", concurrency, per_round, sessions)
                    for _ in range(rounds)]
    finally:
        await runner.close()
    # The benchmark's row at c=1: one connection taking turns with ten sessions, each begun
    # in the warm-up, none ended before the row's last request.
    assert warm["session_starts"] == sessions == 10
    assert [answer["session_starts"] for answer in measured] == [0, 0, 0]
    by_session = turns(seen)
    assert len(by_session) == 10
    assert all(ours == list(range(workloads.SESSION_REQUESTS)) for ours in by_session.values())


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
    assert sorted(turns(seen).values()) == [[0, 1], [0, 1]]
