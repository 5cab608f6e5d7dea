"""The load generator, in a process of its own so that it does not share a core with the
harness: reads one JSON command per line on stdin, answers one JSON line on stdout.

Commands (``op``):
- ``run``: ``url`` (base), ``workload`` (a name in workloads.WORKLOADS), ``concurrency``,
  ``count``, ``seconds``: that many requests or that long, whichever ends first, from
  ``concurrency`` sequential loops; answers per-request latencies and first-byte times (ms),
  errors, response sizes, its own CPU time. For the growing session, ``sessions`` (default
  1): how many sessions each connection takes turns with; the answer's ``session_starts``
  counts the requests that began one.
- ``check``: one request of body ``body`` with query ``query``; answers status, size and the
  ``x-bench-*`` headers the mock added.
- ``idle_open``: ``url``, ``k``, ``hold``: open k streams that the mock holds idle after
  message_start; answers once each has delivered its first bytes. ``idle_close`` ends them.
- ``quit``.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from time import perf_counter

import aiohttp
import orjson

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workloads  # noqa: E402

MESSAGE_STOP = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
TAIL = len(MESSAGE_STOP)
HEADERS = workloads.HEADERS
IDLE_BATCH = 50  # opened at once; keeps the accept backlogs from overflowing


class Load:
    def __init__(self):
        self.sessions: dict[str, aiohttp.ClientSession] = {}
        self.idle: list = []
        self.idle_release: asyncio.Event | None = None
        # (url, concurrency, connection) -> its growing sessions, each [generation, next turn], and which
        # of them sends next
        self.growing: dict = {}

    runs = 0

    def session(self, base: str) -> aiohttp.ClientSession:
        session = self.sessions.get(base)
        if session is None:
            session = self.sessions[base] = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, limit_per_host=0),
                timeout=aiohttp.ClientTimeout(total=120), skip_auto_headers=("User-Agent",))
        return session

    async def run(self, cmd: dict) -> dict:
        spec = workloads.WORKLOADS[cmd["workload"]]
        body = workloads.body(spec["body"])
        stream = spec["stream"]
        url = cmd["url"] + "/v1/messages?" + spec["query"]
        # The query again, for the mock's Chat Completions route: the relay sends no query there.
        base = {**HEADERS, "x-bench-mock": spec["query"]}
        sessions = spec.get("session")
        bodies = workloads.session_bodies() if sessions == "grow" else ()
        self.runs += 1
        run = self.runs
        session = self.session(cmd["url"])
        count = int(cmd["count"])
        concurrency = max(1, min(int(cmd["concurrency"]), count))
        latencies: list[float] = []
        ttfb: list[float] = []
        sizes: dict[int, int] = {}
        errors = 0
        first_error = None
        issued = 0
        finished_at = 0.0
        starts = 0
        per_connection = max(1, int(cmd.get("sessions", 1)))

        async def loop(worker: int):
            nonlocal issued, errors, first_error, finished_at, starts
            headers = base
            # A growing session goes on where its last run left it, whatever ran in between,
            # and never shrinks: after its last turn the connection begins a new session (a
            # first request, which the history workloads measure), so that the benchmark can
            # keep a session's first requests out of the rounds it measures.
            # Each row (a concurrency) its own sessions: a row never ends one another began.
            growing = self.growing.setdefault((cmd["url"], concurrency, worker), [0, []])
            while len(growing[1]) < per_connection:
                growing[1].append([0, 0])
            sent = body
            while issued < count and perf_counter() < deadline:
                issued += 1
                if sessions == "fresh":
                    headers = {**base, workloads.SESSION_HEADER: f"bench-{run}-{issued}"}
                if sessions == "grow":
                    slot = growing[0] % per_connection
                    growing[0] += 1
                    state = growing[1][slot]
                    generation, turn = state
                    headers = {**base, workloads.SESSION_HEADER:
                               f"bench-{cmd['url']}-{worker}-{slot}-{generation}"}
                    starts += turn == 0
                    sent = bodies[turn]
                    state[:] = (generation + 1, 0) if turn + 1 == len(bodies) else (generation,
                                                                                     turn + 1)
                t0 = perf_counter()
                try:
                    async with session.post(url, data=sent, headers=headers) as response:
                        content = response.content
                        tail = await content.readany()
                        t1 = perf_counter()
                        size = len(tail)
                        while True:
                            chunk = await content.readany()
                            if not chunk:
                                break
                            size += len(chunk)
                            # The last event may arrive split over two chunks.
                            tail = chunk if len(chunk) >= TAIL else (tail + chunk)[-TAIL:]
                        status = response.status
                except Exception as e:  # noqa: BLE001 - counted and reported
                    errors += 1
                    first_error = first_error or f"{type(e).__name__}: {e}"
                    continue
                t2 = perf_counter()
                finished_at = t2
                if status != 200 or (stream and not tail.endswith(MESSAGE_STOP)):
                    errors += 1
                    first_error = first_error or (f"status {status}, ends with message_stop: "
                                                  f"{tail.endswith(MESSAGE_STOP)}, {size} bytes")
                    continue
                latencies.append((t2 - t0) * 1000)
                if stream:
                    ttfb.append((t1 - t0) * 1000)
                sizes[size] = sizes.get(size, 0) + 1

        cpu0 = time.process_time()
        start = perf_counter()
        deadline = start + float(cmd["seconds"])
        await asyncio.gather(*(loop(worker) for worker in range(concurrency)))
        cpu = time.process_time() - cpu0
        elapsed = (finished_at or perf_counter()) - start
        return {"latencies_ms": latencies, "ttfb_ms": ttfb, "errors": errors,
                "first_error": first_error, "elapsed_s": elapsed, "sizes": sizes,
                "client_cpu_s": cpu, "concurrency": concurrency, "session_starts": starts}

    async def check(self, cmd: dict) -> dict:
        body = workloads.body(cmd["body"])
        async with self.session(cmd["url"]).post(
                cmd["url"] + "/v1/messages?" + cmd["query"], data=body,
                headers={**HEADERS, "x-bench-mock": cmd["query"]}) as response:
            payload = await response.read()
            return {"status": response.status, "bytes": len(payload),
                    "headers": {k.lower(): v for k, v in response.headers.items()
                                if k.lower().startswith(("x-bench-", "x-relay-"))},
                    "body": payload[:2000].decode("utf-8", "replace") if response.status != 200 else None}

    async def idle_open(self, cmd: dict) -> dict:
        release = self.idle_release = asyncio.Event()
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, limit_per_host=0),
                                        timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        self.sessions["idle:" + cmd["url"]] = session
        query = f"{workloads.IDLE_QUERY}&hold={cmd.get('hold', 30)}"
        url = f"{cmd['url']}/v1/messages?{query}"
        body = workloads.body("small_stream")
        failures: list[str] = []

        async def hold(ready: asyncio.Event):
            try:
                async with session.post(url, data=body,
                                        headers={**HEADERS, "x-bench-mock": query}) as response:
                    if response.status != 200 or not await response.content.readany():
                        failures.append(f"status {response.status}")
                        return
                    ready.set()
                    await release.wait()
            except Exception as e:  # noqa: BLE001
                failures.append(f"{type(e).__name__}: {e}")
            finally:
                ready.set()

        k = int(cmd["k"])
        opened = 0
        while opened < k:
            batch = [asyncio.Event() for _ in range(min(IDLE_BATCH, k - opened))]
            self.idle.extend(asyncio.create_task(hold(ready)) for ready in batch)
            await asyncio.wait_for(asyncio.gather(*(ready.wait() for ready in batch)), 30)
            opened += len(batch)
        return {"opened": k - len(failures), "failures": failures[:5]}

    async def idle_close(self, cmd: dict) -> dict:
        if self.idle_release is not None:
            self.idle_release.set()
        tasks, self.idle = self.idle, []
        if tasks:
            await asyncio.wait(tasks, timeout=30)
        for name in [n for n in self.sessions if n.startswith("idle:")]:
            await self.sessions.pop(name).close()
        return {"closed": len(tasks)}

    async def close(self) -> None:
        for session in self.sessions.values():
            await session.close()


async def main() -> None:
    load = Load()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    for kind in ("small", "small_stream", "history_reused", "history_unique", "session"):
        workloads.body(kind)  # built before the first command, never while timing
    print(orjson.dumps({"ready": True}).decode(), flush=True)
    try:
        while True:
            line = await reader.readline()
            if not line:
                break
            cmd = orjson.loads(line)
            op = cmd["op"]
            if op == "quit":
                break
            try:
                answer = await getattr(load, op)(cmd)
            except Exception as e:  # noqa: BLE001 - reported to the harness
                answer = {"exception": f"{type(e).__name__}: {e}"}
            sys.stdout.write(orjson.dumps(answer, option=orjson.OPT_NON_STR_KEYS).decode() + "\n")
            sys.stdout.flush()
    finally:
        await load.close()


if __name__ == "__main__":
    asyncio.run(main())
