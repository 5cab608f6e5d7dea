"""`make load`: what the relay holds under load, over time and against hostile clients.

    python tests/load/run.py [--only streams,soak,slow_clients,connection_cap,endless] [--quick]
                             [--out-dir .load] [--state sqlite|redis]

Everything runs on loopback, bounded in count and time, and stops by itself (about
eighteen minutes, fifteen of them the soak; ``--quick`` takes seconds and proves only that
the scenarios run). The upstream is the benchmark's mock (tests/bench/mock_upstream.py) and
the relay runs with the full pipeline (dedup, pairing, ordering, portable, dump) as a
subprocess, as in `make bench`. Scenarios:

- ``streams``: 500 concurrent streams of 200 events, several rounds; every byte the client
  gets is checked against what the mock sent (one stream in five reuses an id of its history,
  so dedup rewrites that block's id: the rewritten event is compared as JSON, every other one
  byte for byte).
- ``soak``: fifteen minutes of steady mixed load through a relay shaped as shipped (inbound
  keys with limits on each (rates, tokens, concurrency, budgets, none of them reached), usage
  priced, the shared state in a SQLite file or, with ``--state redis``, in a redis-server the
  run starts on loopback; an Anthropic-format and an OpenAI-format backend, both the mock): answers and streams checked byte for byte, rewrites, refused
  histories that are dumped, client disconnects, count_tokens, 1 MB histories, wrong keys,
  the same answers translated from the OpenAI-format backend, thinking answers each with
  its own signature and tool id, carried back in later histories to either backend (dropped
  or translated on the way), and turns of 64 conversations under Claude Code's session
  header with a cache breakpoint (their records read and written on the shared state). The relay's RSS and open fds are sampled from /proc every 2 s;
  after a three-minute warm-up (caches and pools filling to their bounds), lines are fitted
  through the lowest sample of each 20 s, which a leak lifts and a request in flight does
  not, against time and against requests answered. A slope beyond its limit fails, and once
  the load stops the fds must come back to where they were at rest (after the relay's idle
  upstream connections expire). What the state holds is sampled too: the counters and slots
  must stay bounded throughout and no slot may be held once the load stops; the ledger's rows
  (one per exchange, kept for its retention) and the key-value records are reported.
- ``slow_clients``: 1,100 connections that send half their headers or half their body and
  hold, while a normal client keeps asking; with ``server.header_timeout``,
  ``server.body_timeout`` and ``server.max_connections`` set small, every slow connection
  must be closed within its timeout, the normal client must always get an answer (a 200, or
  a 529 overloaded_error while the relay is full) and be served again once the slow ones are
  gone.
- ``connection_cap``: ``max_connections`` idle keep-alive connections, then more: the extra
  ones get a 529 overloaded_error or are refused at accept, and normal service resumes once
  the idle ones close.
- ``sessions``: many conversations one after another, each under a session id of its own
  (``X-Claude-Code-Session-Id``, as Claude Code sends it) and a few turns long, its history
  growing by the previous answer and a new user turn with the cache marker on it: well past
  the relay's bound on the session records it keeps (``max_sessions``), so the oldest are
  evicted all along. After the warm-up (the records filling to their bound) the RSS floor
  must be flat against the sessions begun; the memory an idle session holds is reported (the
  RSS the records added while filling, over the sessions they hold).
- ``endless``: the hostile upstream (relay.testing.hostile) behind an Anthropic-format and
  an OpenAI-format backend: per format, endless streams read for tens of megabytes each, and
  lines that never end, which the relay must cut with ``event: error`` at its 64 MiB event
  limit; several rounds, with the relay's RSS sampled throughout. An endless stream must not
  lift RSS while it runs, and RSS between rounds must be flat once the first has warmed up.

Each scenario prints a summary line and writes its result as JSON to ``<out-dir>/NAME.json``
(all of them in ``result.json``). The exit status is 1 when any check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import pathlib
import resource
import sys
import tempfile
import time
from importlib.metadata import entry_points

import aiohttp
import orjson
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "bench"))
import micro  # noqa: E402
import procs  # noqa: E402
import workloads  # noqa: E402

# What the slow-client and cap scenarios configure (keys under ``server:`` in relay.yaml).
LIMITS = {"header_timeout": 2, "body_timeout": 3, "max_connections": 200}
# Time a slow connection may outlive its timeout: the relay's timer granularity and a busy
# 2-core machine accepting 1,100 connections at once.
CLOSE_SLACK = 3.0
# A fitted slope beyond these over the soak is a leak.
RSS_SLOPE_LIMIT_MB_MIN = 1.0
FD_SLOPE_LIMIT_PER_MIN = 1.0
REST_WAIT = 35

FULL = {"streams": {"concurrency": 500, "events": 200, "rounds": 4, "gap_ms": 10},
        "soak": {"seconds": 720, "warmup": 180, "concurrency": 16, "sample_every": 2,
                 "floor_window": 20},
        "slow_clients": {"slow": 1100, "hold": 10},
        "connection_cap": {"extra": 50},
        "endless": {"streams": 4, "megabytes": 30, "lines": 2, "rounds": 4},
        "sessions": {"sessions": 30000, "turns": 3, "warmup_sessions": 12000,
                     "concurrency": 16, "sample_every": 1, "floor_sessions": 1000}}
QUICK = {"streams": {"concurrency": 20, "events": 200, "rounds": 1, "gap_ms": 2},
         "soak": {"seconds": 6, "warmup": 2, "concurrency": 4, "sample_every": 0.5,
                  "floor_window": 1},
         "slow_clients": {"slow": 40, "hold": 6},
         "connection_cap": {"extra": 5},
         "endless": {"streams": 1, "megabytes": 2, "lines": 1, "rounds": 2},
         "sessions": {"sessions": 800, "turns": 3, "warmup_sessions": 200, "concurrency": 4,
                      "sample_every": 0.05, "floor_sessions": 100}}
SCENARIOS = ("streams", "soak", "sessions", "slow_clients", "connection_cap", "endless")
# A session's record past the warm-up may lift the RSS floor by at most this much per
# thousand sessions begun (the records are bounded; what is left is the allocator's noise).
SESSIONS_SLOPE_LIMIT_MB_PER_1K = 0.5
HEADERS = workloads.HEADERS


def raise_fd_limit() -> int:
    """As many fds as the hard limit allows: 1,100 slow clients and 500 streams need them,
    on this side and (inherited) in the relay."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 65536
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# --- the processes -------------------------------------------------------------------------


class Stack:
    """The mock upstream and a relay with the full pipeline in front of it."""

    def __init__(self, server: dict | None = None, dump: dict | None = None, setup=None,
                 upstream: tuple[str, list[str]] | None = None):
        self.tmp = tempfile.TemporaryDirectory(prefix="relay-load-")
        py = sys.executable
        # ``upstream``: another server than the mock, as (name, command line).
        name, command = upstream or ("mock", [py, os.path.join(procs.HERE, "mock_upstream.py")])
        self.mock = procs.Server(name, command)
        self.relay = None
        upstream = self.mock.wait_ready()
        pipeline = micro.available_pipeline()
        config = micro.relay_config(pipeline, upstream, os.path.join(self.tmp.name, "dumps"))
        config["server"].update(server or {})
        if dump and "dump" in pipeline:
            config["plugins"]["dump"].update(dump)
        # ``setup(config, folder)``: a scenario's own relay.yaml; it returns the relay's
        # environment (the keys the configuration names).
        env = setup(config, self.tmp.name) if setup else None
        self.pipeline = pipeline
        self.config_path = os.path.join(self.tmp.name, "relay.yaml")
        with open(self.config_path, "w") as f:
            yaml.safe_dump(config, f, sort_keys=False)
        try:
            self.relay = procs.Server("relay", [py, "-m", "relay", "--config", self.config_path,
                                                "--port", "0"], cwd=self.tmp.name, env=env)
            self.url = self.relay.wait_ready()
        except RuntimeError:
            self.stop()
            raise
        self.host, port = self.url.split("//")[1].rsplit(":", 1)
        self.port = int(port)

    @property
    def pid(self) -> int:
        return self.relay.pid

    def rss_kib(self) -> int:
        return procs.status_kib(self.pid, "VmRSS")

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def newest_dump(self) -> float:
        """When the last dump file was written (0 when none)."""
        newest = 0.0
        for folder, _, files in os.walk(os.path.join(self.tmp.name, "dumps")):
            for name in files:
                try:
                    newest = max(newest, os.stat(os.path.join(folder, name)).st_mtime)
                except FileNotFoundError:  # deleted by retention meanwhile
                    pass
        return newest

    def health(self) -> list[str]:
        """What is wrong with the relay process now: exited, or a traceback in its output."""
        problems = []
        if self.relay.proc.poll() is not None:
            problems.append(f"the relay exited with status {self.relay.proc.returncode}")
        for marker in ("Traceback", "Too many open files", "Unhandled exception"):
            count = self.relay.output().count(marker)
            if count:
                problems.append(f"{count} x {marker!r} in the relay's output")
        return problems

    def stop(self) -> None:
        if self.relay is not None:
            self.relay.stop()
        self.mock.stop()
        self.tmp.cleanup()


def limited_stack(limits: dict) -> tuple[Stack, bool]:
    """A relay with the slow-client limits; when this relay does not know the keys yet, the
    relay as it is (so the scenario still measures what happens), and False."""
    try:
        return Stack(server=limits), True
    except RuntimeError as e:
        print(f"  the relay refused the limits {limits}: {str(e).strip().splitlines()[-1]}",
              flush=True)
        return Stack(), False


class Sampler:
    """RSS and open fds of the relay every ``every`` seconds, in the background."""

    def __init__(self, stack: Stack, every: float):
        self.stack, self.every = stack, every
        self.samples: list[tuple[float, int, int]] = []
        self.task: asyncio.Task | None = None

    async def _run(self) -> None:
        start = time.monotonic()
        while True:
            self.samples.append((time.monotonic() - start, self.stack.rss_kib(), self.stack.fds()))
            await asyncio.sleep(self.every)

    def __enter__(self):
        self.task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc) -> None:
        self.task.cancel()

    def peak_fds(self) -> int:
        return max((s[2] for s in self.samples), default=0)


def slope_per_minute(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, value) points, per minute."""
    if len(points) < 3:
        return None
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in points)
    return sxy / sxx * 60 if sxx else None


def floors(points: list[tuple[float, float]], start: float, window: float) -> list[tuple[float, float]]:
    """The lowest value of each ``window`` seconds from ``start``, at the window's middle."""
    lowest: dict[int, float] = {}
    for t, value in points:
        n = int((t - start) // window)
        lowest[n] = min(value, lowest.get(n, value))
    return [(start + (n + 0.5) * window, value) for n, value in sorted(lowest.items())]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q / 100 * len(ordered)) - 1))]


def r(value, digits: int = 2):
    return None if value is None else round(value, digits)


# --- what the client must receive ----------------------------------------------------------


def split_events(data: bytes) -> list[bytes]:
    return [e + b"\n\n" for e in data.split(b"\n\n") if e]


def expected_stream(events: int) -> bytes:
    return b"".join(workloads.sse_events(events))


def stream_problem(got: bytes, events: int, rewritten: bool) -> str | None:
    """Whether a streamed answer is exactly what the mock sent, but for dedup's rewrite of
    the one tool id the history already holds (``rewritten``)."""
    want = expected_stream(events)
    if got == want and not rewritten:
        return None
    if not rewritten:
        return f"{len(got)} bytes differ from the {len(want)} the mock sent"
    got_events, want_events = split_events(got), list(workloads.sse_events(events))
    if len(got_events) != len(want_events):
        return f"{len(got_events)} events where the mock sent {len(want_events)}"
    for n, (mine, theirs) in enumerate(zip(got_events, want_events, strict=True)):
        if mine == theirs:
            continue
        if theirs != workloads.TOOL_BLOCK_START:
            return f"event {n} differs: {mine[:200]!r}"
        data = orjson.loads(mine.split(b"data: ", 1)[1])
        original = orjson.loads(theirs.split(b"data: ", 1)[1])
        original["content_block"]["id"] = workloads.STREAM_TOOL_ID + "-2"
        if data != original or not mine.startswith(b"event: content_block_start\ndata: "):
            return f"the rewritten tool block start is {mine[:300]!r}"
    if got == want:
        return "the reused tool id was not rewritten"
    return None


def anthropic_error(status: int, content_type: str, payload: bytes) -> str | None:
    if content_type != "application/json":
        return f"{status} with content-type {content_type!r}: {payload[:200]!r}"
    try:
        doc = orjson.loads(payload)
    except orjson.JSONDecodeError:
        doc = None
    error = doc.get("error") if isinstance(doc, dict) else None
    if (not isinstance(error, dict) or doc.get("type") != "error"
            or not isinstance(error.get("message"), str)):
        return f"{status} not in Anthropic's error format: {payload[:200]!r}"
    error_type = error.get("type")
    wanted = {400: "invalid_request_error", 408: None, 413: "request_too_large",
              529: "overloaded_error"}.get(status)
    if wanted and error_type != wanted:
        return f"{status} with error type {error_type!r}"
    return None


# --- a: streams ----------------------------------------------------------------------------


async def scenario_streams(stack: Stack, concurrency: int, events: int, rounds: int,
                           gap_ms: int) -> dict:
    url = f"{stack.url}/v1/messages?mock=sse&events={events}&gap_ms={gap_ms}"
    plain, reused = workloads.body("small_stream"), workloads.body("stream_with_history_call")
    durations: list[float] = []
    problems: list[str] = []
    open_now = max_open = 0
    ok = total_bytes = 0
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=120)) as session:
        async def one(n: int) -> None:
            nonlocal open_now, max_open, ok, total_bytes
            rewritten = n % 5 == 4
            started = time.monotonic()
            try:
                async with session.post(url, data=reused if rewritten else plain,
                                        headers=HEADERS) as response:
                    open_now += 1
                    max_open = max(max_open, open_now)
                    try:
                        got = await response.read()
                    finally:
                        open_now -= 1
                    status = response.status
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                problems.append(f"stream {n}: {type(e).__name__} {e}")
                return
            durations.append(time.monotonic() - started)
            total_bytes += len(got)
            problem = (f"status {status}: {got[:200]!r}" if status != 200
                       else stream_problem(got, events, rewritten))
            if problem:
                problems.append(f"stream {n}: {problem}")
            else:
                ok += 1

        with Sampler(stack, 0.5) as sampler:
            cpu0 = procs.cpu_seconds(stack.pid)
            started = time.monotonic()
            for round_ in range(rounds):
                tasks = []
                # Opened 50 at a time: a burst of 500 SYNs overflows the listen backlog, and
                # the kernel's retry a second later would hide the concurrency being measured.
                for n in range(concurrency):
                    tasks.append(asyncio.create_task(one(round_ * concurrency + n)))
                    if n % 50 == 49:
                        await asyncio.sleep(0.05)
                await asyncio.gather(*tasks)
            elapsed = time.monotonic() - started
            cpu = procs.cpu_seconds(stack.pid) - cpu0
    total = concurrency * rounds
    checks = {
        "every stream byte-exact": ok == total,
        f"at least 90% of {concurrency} streams open at once": max_open >= 0.9 * concurrency,
        "relay healthy": not stack.health(),
    }
    return {
        "summary": (f"{ok}/{total} streams of {events} events byte-exact "
                    f"({total * events} events, {total_bytes / 1e6:.1f} MB), up to {max_open} open "
                    f"at once, p50 {r(percentile(durations, 50))} s p99 {r(percentile(durations, 99))} s, "
                    f"relay CPU {cpu / total * 1000:.2f} ms/stream, peak {sampler.peak_fds()} fds, "
                    f"RSS {stack.rss_kib() / 1024:.0f} MB"),
        "streams": total, "byte_exact": ok, "events_per_stream": events,
        "max_open_at_once": max_open, "bytes": total_bytes, "elapsed_s": r(elapsed),
        "p50_s": r(percentile(durations, 50), 3), "p99_s": r(percentile(durations, 99), 3),
        "relay_cpu_ms_per_stream": r(cpu / total * 1000, 3),
        "relay_peak_fds": sampler.peak_fds(), "relay_rss_kib_after": stack.rss_kib(),
        "relay_peak_rss_kib": procs.status_kib(stack.pid, "VmHWM"),
        "problems": problems[:20] + stack.health(), "checks": checks,
    }


# --- b: soak -------------------------------------------------------------------------------

# A history whose tool call has no result: pairing refuses it, dump writes the refusal. Its
# 16 KB of text make each dump cost the writer something, as a real session's would.
UNPAIRED = orjson.dumps({"model": workloads.MODEL, "max_tokens": 10, "messages": [
    {"role": "user", "content": "go"},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_01Unpaired",
                                       "name": "Bash", "input": {}}]},
    {"role": "user", "content": [{"type": "text", "text": "no result\n" + "0123456789abcdef" * 1024}]}]})
# The soak's relay keys (inbound auth on) and the key it sends upstream, by environment
# variable as relay.yaml takes them.
SOAK_KEYS = {"RELAY_SOAK_KEY_A": "soak-team-a-0123456789abcdef",
             "RELAY_SOAK_KEY_B": "soak-team-b-0123456789abcdef",
             "RELAY_SOAK_UPSTREAM": "soak-upstream-0123456789abcdef"}
THINKING_ON = {"type": "enabled", "budget_tokens": 1024}
# The thinking answers a session carries back in its history: the latest few of either format.
CARRIED_TURNS = 6
# The soak's mix, one kind per step (and a 1 MB history every 50th, a wrong key every 100th):
# Anthropic-format answers and streams, dedup's rewrite, a refusal that is dumped, a client
# that goes away, count_tokens, the same from the OpenAI-format backend, thinking answers
# of a kind each (their own signature and tool id), carried back across backends, and a turn
# of one of SOAK_SESSIONS conversations under Claude Code's session header with the cache
# marker on its last block (its session's record read and written on the shared state).
SOAK_MIX = ("json", "stream", "rewrite", "refused", "disconnect", "count_tokens", "think_stream",
            "oai_json", "oai_stream", "oai_think_stream", "think_history", "think_json",
            "oai_think_json", "oai_disconnect", "oai_think_history", "stream", "session")
# The soak's conversations, each begun again after SOAK_SESSION_TURNS turns under the same id:
# as many session records all along.
SOAK_SESSIONS = 64
SOAK_SESSION_TURNS = 8


# Limits on every key, high enough that the soak's own load never reaches them, so each
# request is counted, slotted and priced like a team's, and nothing is refused for it.
SOAK_LIMITS = {"requests_per_minute": 1_000_000, "input_tokens_per_minute": 10**12,
               "output_tokens_per_minute": 10**12, "concurrent": 256,
               "budget": {"usd": 1_000_000, "per": "day"},
               "models": {"claude-*": {"budget": {"usd": 1_000_000, "per": "week"}}}}
SOAK_PRICES = [{"models": ["claude-*", workloads.OPENAI_MODEL],
                "usd_per_mtok": {"input": 3, "output": 15, "cache_write_5m": 3.75,
                                 "cache_write_1h": 6, "cache_read": 0.30}}]
# The accounting plugins, where this relay has them, in the shipped order.
ACCOUNTING = ("limits", "usage")


def soak_state(folder: str) -> str:
    """The state the soak's relay shares its counts in: SQLite in the run's folder, or the
    runner's redis-server (``--state redis``)."""
    if SOAK_REDIS.get("url"):
        return SOAK_REDIS["url"]
    return f"sqlite:///{os.path.join(folder, 'state.db')}"


def soak_setup(config: dict, folder: str) -> dict:
    """The shipped shape: two backends (Anthropic- and OpenAI-format, both the mock), inbound
    keys with limits, usage priced, the shared state (counters, slots, the ledger, the
    provenance record) in SQLite or Redis; the environment holding the keys."""
    upstream = config["backends"][0]["url"]
    config["server"]["auth"] = {"keys": [{"name": "team-a", "key_env": "RELAY_SOAK_KEY_A"},
                                         {"name": "team-b", "key_env": "RELAY_SOAK_KEY_B"}],
                                "default_limits": SOAK_LIMITS}
    found = {ep.name for ep in entry_points(group="relay.plugins")}
    config["pipeline"] = [name for name in ACCOUNTING if name in found] + [
        name for name in config["pipeline"] if name not in ACCOUNTING]
    if "cache" in found and "cache" not in config["pipeline"]:
        config["pipeline"].insert(config["pipeline"].index("metrics") + 1
                                  if "metrics" in config["pipeline"] else 0, "cache")
    config["state"] = {"url": soak_state(folder)}
    config["backends"] = [
        {"name": "anthropic", "url": upstream, "models": ["claude-*"], "default": True,
         "api_key_env": "RELAY_SOAK_UPSTREAM"},
        {"name": "openai", "url": upstream + "/v1", "format": "openai",
         "models": [workloads.OPENAI_MODEL], "api_key_env": "RELAY_SOAK_UPSTREAM"}]
    plugins = config.setdefault("plugins", {})
    if "usage" in config["pipeline"]:
        plugins["usage"] = {"prices": SOAK_PRICES}
    return SOAK_KEYS


SOAK_REDIS: dict = {}  # the runner's redis-server, with --state redis
# What lives in the state only while it is in use: counters (their window) and slots (their
# request), as SQLite tables and as Redis key kinds. Two keys with five limits each, over the
# windows alive at once, are a few dozen.
LIVE_KINDS = ("counters", "slots", "c", "s")
LIVE_BOUND = 200


def state_counts(stack: Stack) -> dict:
    """What the shared state holds, by kind: rows of each SQLite table, or Redis keys by the
    kind their name says. Counters end with their window, slots when released, key-value
    entries with their expiry; the ledger grows by a row per exchange (until its retention)."""
    if SOAK_REDIS.get("url"):
        import redis
        client = redis.Redis.from_url(SOAK_REDIS["url"])
        counts: dict = collections.Counter()
        for key in client.scan_iter(count=1000):
            parts = key.decode().split(":")
            counts[parts[1] if len(parts) > 1 else parts[0]] += 1
        client.close()
        return dict(counts)
    import sqlite3
    path = os.path.join(stack.tmp.name, "state.db")
    if not os.path.exists(path):
        return {}
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
    try:
        counts = {table: db.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
                  for table in ("counters", "slots", "ledger", "kv")}
    except sqlite3.Error as e:
        counts = {"error": str(e)}
    finally:
        db.close()
    for suffix in ("", "-wal"):
        try:
            counts[f"bytes{suffix}"] = os.path.getsize(path + suffix)
        except OSError:
            pass
    return counts


class Soak:
    """The client side of the soak: which thinking answer comes next, and the latest ones a
    session would carry back."""

    def __init__(self, session: aiohttp.ClientSession, base: str):
        self.session, self.base = session, base
        self.seq = 0
        self.carried: collections.deque = collections.deque(maxlen=CARRIED_TURNS)
        self.turns = 0

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def next_turn(self) -> tuple[int, int]:
        """The next conversation's number and turn."""
        self.turns += 1
        return self.turns % SOAK_SESSIONS, self.turns // SOAK_SESSIONS % SOAK_SESSION_TURNS

    def history(self, model: str) -> dict:
        """A thinking session's next request: each carried answer, its call's result after it."""
        messages = [{"role": "user", "content": "List the files, then again."}]
        for seq, wire_format in list(self.carried):
            content = workloads.thinking_content(seq, wire_format)
            messages += [{"role": "assistant", "content": content},
                         {"role": "user", "content": [{"type": "tool_result",
                                                       "tool_use_id": content[2]["id"],
                                                       "content": "relay\nplugins\ntests"}]}]
        return {"model": model, "max_tokens": 2048, "thinking": THINKING_ON, "stream": True,
                "messages": messages}


def soak_request(soak: Soak, kind: str) -> tuple[str, dict, bytes, int]:
    """Path, mock query (in the query for the Anthropic-format backend, in ``x-bench-mock``
    for the OpenAI-format one), body and thinking answer number (0: none) of ``kind``."""
    seq = soak.next_seq() if "think" in kind else 0
    oai = kind.startswith("oai_")
    small = workloads.small_request
    if kind.endswith("think_history"):
        body = soak.history(workloads.OPENAI_MODEL if oai else workloads.MODEL)
        query = f"mock=thinking_sse&seq={seq}"
    elif kind.endswith(("think_stream", "think_json")):
        stream = kind.endswith("stream")
        body = {**small(stream), "thinking": THINKING_ON}
        query = f"mock={'thinking_sse' if stream else 'thinking'}&seq={seq}"
    elif kind.endswith("disconnect"):
        body, query = small(True), "mock=idle&hold=30"
    elif kind.endswith("stream"):
        body, query = small(True), "mock=sse&events=50"
    else:
        body, query = small(), "mock=json"
    if oai:
        body["model"] = workloads.OPENAI_MODEL
    return "/v1/messages", query, orjson.dumps(body), seq


def translated_problem(kind: str, payload: bytes, seq: int) -> str | None:
    """Whether an OpenAI-format backend's answer reached the client as the Anthropic answer it
    stands for: its blocks, and for a thinking answer its unsigned thinking and its call."""
    want = {"oai_json": ["text"], "oai_stream": ["text", "tool_use"]}.get(
        kind, ["thinking", "text", "tool_use"])
    try:
        if kind == "oai_json" or kind == "oai_think_json":
            content = orjson.loads(payload)["content"]
        else:
            content, names = [], []
            for raw in split_events(payload):
                name = raw.split(b"\n", 1)[0].removeprefix(b"event: ").decode()
                names.append(name)
                data = orjson.loads(raw.split(b"data: ", 1)[1])
                if name == "content_block_start":
                    content.append(data["content_block"])
                elif name == "error":
                    return f"{kind}: event: error {data}"
            if names[:1] != ["message_start"] or names[-1:] != ["message_stop"]:
                return f"{kind}: events {names[:3]}...{names[-3:]}"
    except (orjson.JSONDecodeError, KeyError, TypeError, IndexError, UnicodeDecodeError) as e:
        return f"{kind}: {type(e).__name__} {e}: {payload[:200]!r}"
    if [block.get("type") for block in content] != want:
        return f"{kind}: blocks {[block.get('type') for block in content]}"
    if seq and (content[0].get("signature") != ""
                or content[2].get("id") != workloads.client_tool_id(seq, "openai")):
        return f"{kind}: the thinking or the call is not the backend's: {content}"
    return None


async def soak_step(soak: Soak, n: int) -> str | None:
    """One request of the soak's mix (chosen by ``n``); what went wrong, or None."""
    kind = SOAK_MIX[n % len(SOAK_MIX)]
    if n % 50 == 49:
        kind = "history"
    secret = SOAK_KEYS["RELAY_SOAK_KEY_A" if n % 2 else "RELAY_SOAK_KEY_B"]
    if n % 100 == 99:
        kind, secret = "wrong_key", secret[::-1]
    headers = {**HEADERS, "x-api-key": secret}
    session, base = soak.session, soak.base
    if kind in ("json", "stream", "rewrite", "refused", "count_tokens", "history", "wrong_key"):
        path, query, body = {
            "json": ("/v1/messages", "mock=json", workloads.body("small")),
            "stream": ("/v1/messages", "mock=sse&events=50", workloads.body("small_stream")),
            "rewrite": ("/v1/messages", "mock=sse&events=50", workloads.body("stream_with_history_call")),
            "refused": ("/v1/messages", "mock=json", UNPAIRED),
            "count_tokens": ("/v1/messages/count_tokens", "", workloads.body("small")),
            "history": ("/v1/messages", "mock=json", workloads.body("history_reused")),
            "wrong_key": ("/v1/messages", "mock=json", workloads.body("small")),
        }[kind]
        seq = 0
    elif kind == "session":
        number, turn = soak.next_turn()
        headers[workloads.SESSION_HEADER] = f"soak-{number}"
        path, query, body, seq = ("/v1/messages", "mock=json",
                                  orjson.dumps(session_turn(number, turn)), 0)
    else:
        path, query, body, seq = soak_request(soak, kind)
    if kind.startswith("oai_"):
        headers["x-bench-mock"], query = query, ""
    url = f"{base}{path}?{query}" if query else f"{base}{path}"
    if kind.endswith("disconnect"):
        # The client goes away after the first event: the relay must cancel the upstream
        # request and let go of both connections.
        async with session.post(url, data=body, headers=headers) as response:
            first = await response.content.readany()
            response.close()
            return None if response.status == 200 and first else f"{kind}: {response.status}"
    async with session.post(url, data=body, headers=headers) as response:
        payload = await response.read()
        status, content_type = response.status, response.content_type
    if kind in ("refused", "wrong_key"):
        wanted = 400 if kind == "refused" else 401
        problem = None if status == wanted else f"{kind}: status {status}"
        return problem or anthropic_error(status, content_type, payload)
    if status != 200:
        return f"{kind}: status {status}: {payload[:200]!r}"
    if kind.startswith("oai_"):
        problem = translated_problem(kind, payload, seq)
    elif kind in ("stream", "rewrite"):
        problem = stream_problem(payload, 50, kind == "rewrite")
    elif kind in ("think_stream", "think_history"):
        want = b"".join(workloads.thinking_events(seq))
        problem = None if payload == want else (
            f"{kind}: {len(payload)} bytes differ from the {len(want)} the mock sent")
    elif kind == "think_json":
        problem = None if payload == workloads.thinking_answer(seq) else (
            f"think_json: the answer differs from the mock's: {payload[:200]!r}")
    elif kind == "json" and payload != workloads.ANSWER:
        problem = f"json: the answer differs from the mock's: {payload[:200]!r}"
    else:
        problem = None
    if seq and problem is None:
        soak.carried.append((seq, "openai" if kind.startswith("oai_") else "anthropic"))
    return problem


def floor_samples(samples: list[tuple], start: float, window: float) -> list[tuple]:
    """The sample with the lowest RSS of each ``window`` seconds from ``start``."""
    lowest: dict[int, tuple] = {}
    for sample in samples:
        if sample[0] < start:
            continue
        n = int((sample[0] - start) // window)
        if n not in lowest or sample[1] < lowest[n][1]:
            lowest[n] = sample
    return [lowest[n] for n in sorted(lowest)]


async def scenario_soak(stack: Stack, seconds: float, warmup: float, concurrency: int,
                        sample_every: float, floor_window: float) -> dict:
    problems: list[str] = []
    counts = {"requests": 0, "failed": 0}
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60))
    soak = Soak(session, stack.url)
    # One of each kind first, so that what the relay opens once and keeps (the provenance
    # file and its journal) is there at rest too.
    for n in range(len(SOAK_MIX)):
        problem = await soak_step(soak, n)
        if problem:
            problems.append(f"before the soak: {problem}")
    await asyncio.sleep(0.5)
    fds_before = stack.fds()
    started = time.monotonic()
    deadline = started + warmup + seconds
    # (seconds, RSS KiB, open fds, requests answered so far)
    samples: list[tuple[float, int, int, int]] = []

    async def sample() -> None:
        while True:
            samples.append((time.monotonic() - started, stack.rss_kib(), stack.fds(),
                            counts["requests"]))
            await asyncio.sleep(sample_every)

    async def loop(worker: int) -> None:
        n = worker
        while time.monotonic() < deadline:
            try:
                problem = await soak_step(soak, n)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                problem = f"{type(e).__name__} {e}"
            counts["requests"] += 1
            if problem:
                counts["failed"] += 1
                problems.append(problem)
            n += concurrency

    # (seconds, what the shared state holds): counters and slots must stay bounded.
    state_samples: list[tuple[float, dict]] = []

    async def sample_state() -> None:
        while True:
            counts = await asyncio.to_thread(state_counts, stack)
            state_samples.append((time.monotonic() - started, counts))
            await asyncio.sleep(max(sample_every * 15, 1))

    sampler = asyncio.create_task(sample())
    state_sampler = asyncio.create_task(sample_state())
    cpu0 = procs.cpu_seconds(stack.pid)
    try:
        await asyncio.gather(*(loop(w) for w in range(concurrency)))
    finally:
        sampler.cancel()
        state_sampler.cancel()
    cpu = procs.cpu_seconds(stack.pid) - cpu0
    await session.close()
    stopped_at = time.time()
    # Back at rest once the relay's idle upstream connections expire (aiohttp keeps them
    # 15 s): what is still open then was leaked.
    stopped = time.monotonic()
    while stack.fds() > fds_before + 2 and time.monotonic() - stopped < REST_WAIT:
        await asyncio.sleep(1)
    fds_after, rest_after = stack.fds(), time.monotonic() - stopped
    state_after = await asyncio.to_thread(state_counts, stack)
    held = [sum(counts.get(kind, 0) for kind in LIVE_KINDS)
            for t, counts in state_samples if t >= warmup]
    # Dumps still being written after the load stopped are the writer's backlog.
    backlog = max(0.0, stack.newest_dump() - stopped_at)
    steady = [s for s in samples if s[0] >= warmup]
    raw_rss_slope = slope_per_minute([(t, rss / 1024) for t, rss, _, _ in steady])
    # A 1 MB request in flight lifts RSS by a few MB for a moment, and each request in
    # flight holds two fds; a leak lifts the floor. So the lines go through the lowest
    # sample of each window (20 s), after the warm-up (caches and pools filling up to their
    # bounds), against time and against requests answered (the machine's speed varies).
    lows = floor_samples(samples, warmup, floor_window)
    rss_slope = slope_per_minute([(t, rss / 1024) for t, rss, _, _ in lows])
    per_request = slope_per_minute([(done, rss / 1024) for _, rss, _, done in lows])
    rss_per_10k = None if per_request is None else per_request / 60 * 10000
    fd_slope = slope_per_minute(floors([(t, fds) for t, _, fds, _ in steady], warmup,
                                       floor_window))
    by_minute = [{"minute": int(t // 60), "rss_floor_mb": r(rss / 1024, 1), "requests": done}
                 for t, rss, _, done in floor_samples(samples, 0, 60)]
    checks = {
        "every answer as expected": counts["failed"] == 0 and counts["requests"] > 0,
        f"RSS floor slope under {RSS_SLOPE_LIMIT_MB_MIN} MB/min":
            rss_slope is not None and rss_slope < RSS_SLOPE_LIMIT_MB_MIN,
        f"fd floor slope under {FD_SLOPE_LIMIT_PER_MIN}/min":
            fd_slope is not None and fd_slope < FD_SLOPE_LIMIT_PER_MIN,
        f"fds back to rest within {REST_WAIT} s of the load stopping": fds_after <= fds_before + 2,
        "relay healthy": not stack.health(),
        "no concurrency slot held once the load stopped":
            state_after.get("slots", 0) + state_after.get("s", 0) == 0,
        f"counters and slots in the state under {LIVE_BOUND} throughout":
            max(held, default=0) < LIVE_BOUND,
    }
    rss = [s[1] for s in samples] or [0]
    return {
        "summary": (f"{counts['requests']} requests ({soak.seq} thinking answers) in "
                    f"{seconds + warmup:.0f} s at c={concurrency}, {counts['failed']} failed; "
                    f"RSS {rss[0] / 1024:.1f} -> {rss[-1] / 1024:.1f} MB, floor by minute "
                    f"{[m['rss_floor_mb'] for m in by_minute]}; after {warmup:.0f} s floor slope "
                    f"{r(rss_slope, 3)} MB/min, {r(rss_per_10k, 3)} MB per 10k requests (raw "
                    f"{r(raw_rss_slope, 3)} MB/min); fd floor slope {r(fd_slope, 3)}/min, "
                    f"{fds_before} before / {fds_after} {rest_after:.0f} s after; dumps written "
                    f"until {backlog:.0f} s after; state "
                    f"({SOAK_REDIS.get('url', 'sqlite').split(':')[0]}) after: {state_after}, "
                    f"counters and slots at most {max(held, default=0)}; relay CPU "
                    f"{cpu / max(1, counts['requests']) * 1000:.2f} ms/request"),
        "requests": counts["requests"], "failed": counts["failed"], "seconds": seconds,
        "thinking_answers": soak.seq, "warmup_s": warmup, "concurrency": concurrency,
        "rss_floor_slope_mb_per_min": r(rss_slope, 4),
        "rss_floor_slope_mb_per_10k_requests": r(rss_per_10k, 4),
        "rss_slope_mb_per_min": r(raw_rss_slope, 4), "rss_floor_by_minute": by_minute,
        "fd_floor_slope_per_min": r(fd_slope, 4),
        "fds_before": fds_before, "fds_after": fds_after, "fds_rest_after_s": r(rest_after, 1),
        "dumps_written_until_s_after": r(backlog, 1),
        "samples": [{"t": r(t), "rss_kib": rss_kib, "fds": fds, "requests": done}
                    for t, rss_kib, fds, done in samples],
        "relay_cpu_ms_per_request": r(cpu / max(1, counts["requests"]) * 1000, 3),
        "state": SOAK_REDIS.get("url", "sqlite").split(":")[0], "state_after": state_after,
        "state_samples": [{"t": r(t), **counts} for t, counts in state_samples],
        "state_live_max": max(held, default=0),
        "problems": problems[:20] + stack.health(), "checks": checks,
    }


# --- sessions: records bounded across many conversations -----------------------------------

SESSION_SYSTEM = "You are a coding agent working in a repository. " * 40
SESSION_ANSWER = orjson.loads(workloads.ANSWER)["content"]


def session_turn(session: int, turn: int) -> dict:
    """Turn ``turn`` of session ``session``: its own first task, then each canned answer the
    mock gave and a new user turn, the cache marker on the last block (as Claude Code)."""
    messages: list[dict] = []
    for n in range(turn + 1):
        if n:
            messages.append({"role": "assistant", "content": SESSION_ANSWER})
        text = f"Session {session}, step {n}: " + "read the file and fix the failing test. " * 20
        messages.append({"role": "user", "content": [{"type": "text", "text": text}]})
    messages[-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}
    return {"model": workloads.MODEL, "max_tokens": 1024, "system": SESSION_SYSTEM,
            "messages": messages}


async def scenario_sessions(stack: Stack, sessions: int, turns: int, warmup_sessions: int,
                            concurrency: int, sample_every: float, floor_sessions: int) -> dict:
    problems: list[str] = []
    counts = {"requests": 0, "failed": 0, "begun": 0}
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60))
    url = f"{stack.url}/v1/messages?mock=json"
    run_id = os.urandom(4).hex()
    await asyncio.sleep(0.5)
    rss_rest = stack.rss_kib()
    started = time.monotonic()
    # (seconds, RSS KiB, sessions begun so far)
    samples: list[tuple[float, int, int]] = []

    async def sample() -> None:
        while True:
            samples.append((time.monotonic() - started, stack.rss_kib(), counts["begun"]))
            await asyncio.sleep(sample_every)

    async def one(n: int) -> None:
        headers = {**HEADERS, workloads.SESSION_HEADER: f"load-{run_id}-{n:06d}"}
        for turn in range(turns):
            try:
                async with session.post(url, data=orjson.dumps(session_turn(n, turn)),
                                        headers=headers) as response:
                    payload = await response.read()
                    problem = (None if response.status == 200
                               and orjson.loads(payload).get("type") == "message"
                               else f"session {n} turn {turn}: {response.status} {payload[:200]!r}")
            except (aiohttp.ClientError, asyncio.TimeoutError, orjson.JSONDecodeError) as e:
                problem = f"session {n} turn {turn}: {type(e).__name__} {e}"
            counts["requests"] += 1
            if problem:
                counts["failed"] += 1
                problems.append(problem)
                return

    async def worker(first: int) -> None:
        for n in range(first, sessions, concurrency):
            counts["begun"] += 1
            await one(n)

    sampler = asyncio.create_task(sample())
    cpu0 = procs.cpu_seconds(stack.pid)
    try:
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
    finally:
        sampler.cancel()
    cpu = procs.cpu_seconds(stack.pid) - cpu0
    await session.close()
    elapsed = time.monotonic() - started
    # The floor (lowest RSS) of each ``floor_sessions`` sessions begun, against sessions.
    lowest: dict[int, int] = {}
    for _, rss, begun in samples:
        if begun >= warmup_sessions:
            bucket = begun // floor_sessions
            lowest[bucket] = min(rss, lowest.get(bucket, rss))
    lows = [((bucket + 0.5) * floor_sessions, rss / 1024) for bucket, rss in sorted(lowest.items())]
    # slope_per_minute reads its x in seconds: sessions / 60 makes it per session, * 1000 per 1k.
    slope = slope_per_minute(lows)
    per_1k = None if slope is None else slope / 60 * 1000
    at_warmup = min((rss for _, rss, begun in samples if begun >= warmup_sessions),
                    default=rss_rest)
    per_idle_kib = (at_warmup - rss_rest) / warmup_sessions
    checks = {
        "every answer as expected": counts["failed"] == 0 and counts["requests"] > 0,
        f"RSS floor slope after {warmup_sessions} sessions under "
        f"{SESSIONS_SLOPE_LIMIT_MB_PER_1K} MB per 1,000 sessions":
            per_1k is not None and per_1k < SESSIONS_SLOPE_LIMIT_MB_PER_1K,
        "relay healthy": not stack.health(),
    }
    rss = [s[1] for s in samples] or [0]
    return {
        "summary": (f"{counts['begun']} sessions of {turns} turns ({counts['requests']} "
                    f"requests) in {elapsed:.0f} s at c={concurrency}, {counts['failed']} "
                    f"failed; RSS {rss_rest / 1024:.1f} at rest -> {at_warmup / 1024:.1f} after "
                    f"{warmup_sessions} sessions -> {rss[-1] / 1024:.1f} MB at the end; floor "
                    f"slope after the warm-up {r(per_1k, 3)} MB per 1,000 sessions; about "
                    f"{per_idle_kib:.1f} KiB per idle session; relay CPU "
                    f"{cpu / max(1, counts['requests']) * 1000:.2f} ms/request"),
        "sessions": counts["begun"], "turns": turns, "requests": counts["requests"],
        "failed": counts["failed"], "concurrency": concurrency, "elapsed_s": r(elapsed, 1),
        "rss_rest_kib": rss_rest, "rss_after_warmup_kib": at_warmup,
        "kib_per_idle_session": r(per_idle_kib, 2),
        "rss_floor_slope_mb_per_1k_sessions": r(per_1k, 4),
        "floors": [{"sessions": int(x), "rss_mb": r(y, 2)} for x, y in lows],
        "samples": [{"t": r(t), "rss_kib": kib, "sessions": begun} for t, kib, begun in samples],
        "relay_cpu_ms_per_request": r(cpu / max(1, counts["requests"]) * 1000, 3),
        "problems": problems[:20] + stack.health(), "checks": checks,
    }


# --- c: slow clients -----------------------------------------------------------------------


async def hold_slow(host: str, port: int, kind: str, hold: float) -> dict:
    """One slow client: half its headers or half its body, then wait for the relay to act."""
    loop = asyncio.get_running_loop()
    head = (f"POST /v1/messages HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nx-api-key: load\r\n").encode()
    partial = (head if kind == "headers"
               else head + b"Content-Length: 2000\r\n\r\n" + b'{"model": "' + b"x" * 990)
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 10)
    except (OSError, asyncio.TimeoutError) as e:
        return {"kind": kind, "outcome": "refused", "after": 0.0, "error": repr(e)}
    sent = loop.time()
    data, outcome = b"", "held"
    try:
        writer.write(partial)
        while True:
            chunk = await asyncio.wait_for(reader.read(65536), max(0.01, sent + hold - loop.time()))
            if not chunk:
                outcome = "closed"
                break
            data += chunk
    except asyncio.TimeoutError:
        outcome = "held"
    except OSError:
        outcome = "reset"
    after = loop.time() - sent
    writer.close()
    answer = parse_answer(data) if data else None
    return {"kind": kind, "outcome": outcome, "after": after, "answer": answer}


def parse_answer(data: bytes) -> dict:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split()
    status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    content_type = headers.get("content-type", "").split(";")[0].strip()
    return {"status": status, "problem": anthropic_error(status, content_type, body)}


async def normal_client(url: str, until: float, results: list) -> None:
    """A well-behaved client asking every 0.25 s on a fresh connection, 5 s to answer."""
    loop = asyncio.get_running_loop()
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=5)) as session:
        start = loop.time()
        while loop.time() < until:
            asked = loop.time()
            entry = {"t": asked - start}
            try:
                async with session.post(f"{url}/v1/messages?mock=json",
                                        data=workloads.body("small"), headers=HEADERS) as response:
                    payload = await response.read()
                    entry["status"] = response.status
                    if response.status != 200:
                        entry["problem"] = anthropic_error(response.status, response.content_type,
                                                           payload)
            except asyncio.TimeoutError:
                entry["status"] = "timeout"
            except (aiohttp.ClientConnectionError, OSError) as e:
                entry["status"] = "refused"
                entry["error"] = f"{type(e).__name__}"
            entry["seconds"] = loop.time() - asked
            results.append(entry)
            await asyncio.sleep(max(0.0, 0.25 - (loop.time() - asked)))


async def scenario_slow_clients(slow: int, hold: float) -> dict:
    stack, limited = limited_stack(LIMITS)
    try:
        return await slow_clients(stack, limited, slow, hold)
    finally:
        stack.stop()


async def slow_clients(stack: Stack, limited: bool, slow: int, hold: float) -> dict:
    loop = asyncio.get_running_loop()
    limit = {"headers": LIMITS["header_timeout"], "body": LIMITS["body_timeout"]}
    normal: list[dict] = []
    start = loop.time()
    normal_task = asyncio.create_task(normal_client(stack.url, start + hold + 2, normal))
    with Sampler(stack, 0.5) as sampler:
        tasks = []
        for n in range(slow):
            tasks.append(asyncio.create_task(
                hold_slow(stack.host, stack.port, "headers" if n % 2 == 0 else "body",
                          max(limit.values()) + hold)))
            if n % 100 == 99:
                await asyncio.sleep(0.1)
        all_opened = loop.time() - start
        slow_results = await asyncio.gather(*tasks)
        await normal_task
    outcomes: dict[str, int] = {}
    late, bad_answers = [], []
    for entry in slow_results:
        answered = entry.get("answer")
        key = f"{entry['kind']}:{entry['outcome']}" + (f":{answered['status']}" if answered else "")
        outcomes[key] = outcomes.get(key, 0) + 1
        if entry["outcome"] == "held" or entry["after"] > limit[entry["kind"]] + CLOSE_SLACK:
            late.append(entry)
        if answered and (answered["problem"] or answered["status"] not in (400, 408, 413, 529)):
            bad_answers.append(answered)
    restored_after = all_opened + max(limit.values()) + CLOSE_SLACK
    hung = [e for e in normal if e["status"] == "timeout"]
    odd = [e for e in normal if e["status"] not in (200, 529, "refused", "timeout")
           or e.get("problem")]
    after_timeouts = [e for e in normal if e["t"] >= restored_after + 1.0]
    served = sum(1 for e in normal if e["status"] == 200)
    checks = {
        "the relay took the limits (server.header_timeout, body_timeout, max_connections)": limited,
        "every slow connection closed within its timeout": not late,
        "every answer to a slow connection is a 4xx/529 in Anthropic's format": not bad_answers,
        "the normal client never waited 5 s for an answer": not hung,
        "the normal client got only 200s, clean 529s or refused connections": not odd,
        "the normal client is served once the slow ones are closed":
            bool(after_timeouts) and all(e["status"] == 200 for e in after_timeouts),
        "relay healthy": not stack.health(),
    }
    closed = [e["after"] for e in slow_results if e["outcome"] != "held"]
    return {
        "summary": (f"{slow} slow connections: {len(slow_results) - len(late)} closed in time, "
                    f"{len(late)} late or held; outcomes {outcomes}; normal client: {served}/"
                    f"{len(normal)} served, {len(hung)} hung; peak {sampler.peak_fds()} relay fds"),
        "limits": LIMITS if limited else None, "slow": slow, "outcomes": outcomes,
        "late_or_held": len(late), "closed_after_p50_s": r(percentile(closed, 50)),
        "closed_after_max_s": r(max(closed, default=None)),
        "normal": {"requests": len(normal), "served": served, "hung": len(hung),
                   "statuses": {str(s): sum(1 for e in normal if e["status"] == s)
                                for s in {e["status"] for e in normal}},
                   "p99_s": r(percentile([e["seconds"] for e in normal], 99), 3)},
        "relay_peak_fds": sampler.peak_fds(),
        "problems": ([f"slow {e['kind']} connection {e['outcome']} after {e['after']:.1f} s"
                      for e in late[:5]] + [str(a) for a in bad_answers[:5]]
                     + [str(e) for e in (hung + odd)[:5]] + stack.health()),
        "checks": checks,
    }


# --- d: connection cap ---------------------------------------------------------------------


async def keep_alive_healthz(host: str, port: int, timeout: float = 5.0):
    """A connection that asked /healthz once and stays open; or what happened instead."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, asyncio.TimeoutError) as e:
        return None, {"outcome": "refused", "error": repr(e)}
    writer.write(f"GET /healthz HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        body = await asyncio.wait_for(reader.readexactly(length), timeout)
    except asyncio.TimeoutError:
        writer.close()
        return None, {"outcome": "hung"}
    except (asyncio.IncompleteReadError, OSError) as e:
        writer.close()
        partial = getattr(e, "partial", b"")
        if partial:
            return None, {"outcome": "answered", "answer": parse_answer(partial)}
        return None, {"outcome": "refused", "error": repr(e)}
    answer = parse_answer(head + body)
    if answer["status"] == 200:
        return writer, {"outcome": "served"}
    writer.close()
    return None, {"outcome": "answered", "answer": answer}


async def scenario_connection_cap(extra: int) -> dict:
    # Timeouts long enough that the idle connections outlive the measurement: the cap is
    # what is tested here.
    limits = {"header_timeout": 30, "body_timeout": 30,
              "max_connections": LIMITS["max_connections"]}
    stack, limited = limited_stack(limits)
    try:
        return await connection_cap(stack, limited, limits["max_connections"], extra)
    finally:
        stack.stop()


async def connection_cap(stack: Stack, limited: bool, cap: int, extra: int) -> dict:
    idle, first = [], []
    for _ in range(0, cap, 50):
        batch = await asyncio.gather(*(keep_alive_healthz(stack.host, stack.port)
                                       for _ in range(min(50, cap - len(first)))))
        first += [outcome for _, outcome in batch]
        idle += [writer for writer, _ in batch if writer is not None]
    fds_full = stack.fds()
    beyond = await asyncio.gather(*(keep_alive_healthz(stack.host, stack.port)
                                    for _ in range(extra)))
    for writer, _ in beyond:
        if writer is not None:
            idle.append(writer)
    extra_outcomes: dict[str, int] = {}
    bad = []
    for _, outcome in beyond:
        key = outcome["outcome"] + (f":{outcome['answer']['status']}" if "answer" in outcome else "")
        extra_outcomes[key] = extra_outcomes.get(key, 0) + 1
        answer = outcome.get("answer")
        if outcome["outcome"] in ("served", "hung") or (
                answer and (answer["status"] != 529 or answer["problem"])):
            bad.append(outcome)
    for writer in idle:
        writer.close()
    await asyncio.sleep(1.0)
    after = []
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=5)) as session:
        for _ in range(20):
            try:
                async with session.post(f"{stack.url}/v1/messages?mock=json",
                                        data=workloads.body("small"), headers=HEADERS) as response:
                    await response.read()
                    after.append(response.status)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                after.append(type(e).__name__)
    served_first = sum(1 for o in first if o["outcome"] == "served")
    checks = {
        "the relay took the limits (server.max_connections)": limited,
        f"all {cap} connections up to the cap served": served_first == cap,
        f"the {extra} beyond the cap got a 529 in Anthropic's format or were refused": not bad,
        "normal service once they closed": after == [200] * len(after),
        "relay healthy": not stack.health(),
    }
    return {
        "summary": (f"{served_first}/{cap} connections served and held idle; {extra} beyond: "
                    f"{extra_outcomes}; after closing them {after.count(200)}/{len(after)} served"),
        "cap": cap if limited else None, "held": served_first, "extra": extra,
        "extra_outcomes": extra_outcomes, "after": after, "relay_fds_when_full": fds_full,
        "problems": [str(b) for b in bad[:5]] + stack.health(), "checks": checks,
    }


# --- e: what never ends ---------------------------------------------------------------------


class HostileStack(Stack):
    """The hostile upstream (relay.testing.hostile) behind a relay with the full pipeline,
    once as an Anthropic-format backend and once as an OpenAI-format one: the model names
    the format (``anthropic/...``, ``openai/...``) and, renamed, the hostile mode."""

    def __init__(self):
        super().__init__(dump={"include_stream_errors": True, "max_files": 100},
                         setup=hostile_backends,
                         upstream=("hostile", [sys.executable, "-m", "relay.testing.hostile",
                                               "--port", "0"]))


def hostile_backends(config: dict, folder: str) -> None:
    """The hostile upstream as both kinds of backend, its modes behind model names."""
    upstream = config["backends"][0]["url"]
    modes = ("endless", "endless-line")
    config["backends"] = [
        {"name": wire, "url": upstream + ("/v1" if wire == "openai" else ""),
         "format": wire, "models": [f"{wire}/*"], "default": wire == "anthropic",
         "rename": {f"{wire}/{mode}": mode for mode in modes}}
        for wire in ("anthropic", "openai")]


def hostile_body(model: str) -> bytes:
    return orjson.dumps({"model": model, "max_tokens": 10, "stream": True,
                         "messages": [{"role": "user", "content": "hi"}]})


async def read_endless(session: aiohttp.ClientSession, url: str, model: str,
                       megabytes: float) -> str | None:
    """Read ``megabytes`` of a stream that never ends, then hang up; what went wrong, if
    anything."""
    want = int(megabytes * 1e6)
    async with session.post(url, data=hostile_body(model), headers=HEADERS) as response:
        if response.status != 200:
            return f"status {response.status}"
        first = await response.content.readuntil(b"\n\n")
        if not first.startswith(b"event: message_start\n"):
            return f"began {first[:100]!r}"
        read = len(first)
        while read < want:
            chunk = await response.content.readany()
            if not chunk:
                return f"ended after {read} bytes"
            read += len(chunk)
    return None


async def read_line(session: aiohttp.ClientSession, url: str, model: str) -> str | None:
    """A stream whose line never ends: the relay must end it with ``event: error``."""
    async with session.post(url, data=hostile_body(model), headers=HEADERS) as response:
        raw = await response.read()
    last = raw.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
    if not raw.startswith(b"event: message_start\n"):
        return f"began {raw[:100]!r}"
    if not last.startswith(b"event: error\n") or b"without ending" not in last:
        return f"ended {last[-200:]!r}"
    return None


async def scenario_endless(stack: Stack, streams: int, megabytes: float, lines: int,
                           rounds: int) -> dict:
    """Per format: ``streams`` endless streams at once, each read for ``megabytes`` MB, and
    ``lines`` never-ending lines at once, each cut by the relay at its event limit; ``rounds``
    times over. RSS is sampled throughout. What the relay keeps of an endless stream is
    bounded, so one never lifts RSS while it runs; a line is buffered up to the limit, and
    freed after: once the first round has warmed the allocator up, RSS between rounds must be
    flat."""
    url = f"{stack.url}/v1/messages"
    problems: list[str] = []
    phases: list[dict] = []
    after_round: list[float] = []
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=300)) as session:
        with Sampler(stack, 0.25) as sampler:
            cpu0 = procs.cpu_seconds(stack.pid)
            rest = stack.rss_kib() / 1024
            for round_ in range(rounds):
                for wire in ("anthropic", "openai"):
                    for kind, count in (("endless", streams), ("endless-line", lines)):
                        started = time.monotonic()
                        cpu = procs.cpu_seconds(stack.pid)
                        before = stack.rss_kib() / 1024
                        first = len(sampler.samples)
                        if kind == "endless":
                            calls = [read_endless(session, url, f"{wire}/{kind}", megabytes)
                                     for _ in range(count)]
                        else:
                            calls = [read_line(session, url, f"{wire}/{kind}")
                                     for _ in range(count)]
                        found = await asyncio.gather(*calls, return_exceptions=True)
                        for problem in found:
                            if problem is not None:
                                problems.append(f"round {round_} {wire} {kind}: {problem!r}")
                        await asyncio.sleep(0.5)  # the relay's end hooks, a sample after
                        during = [s[1] / 1024 for s in sampler.samples[first:]]
                        phases.append({"round": round_, "format": wire, "mode": kind,
                                       "streams": count, "seconds": r(time.monotonic() - started),
                                       "relay_cpu_s": r(procs.cpu_seconds(stack.pid) - cpu),
                                       "rss_before_mb": r(before, 1),
                                       "peak_rss_mb": r(max(during, default=before), 1),
                                       "rss_after_mb": r(stack.rss_kib() / 1024, 1)})
                after_round.append(stack.rss_kib() / 1024)
            cpu_total = procs.cpu_seconds(stack.pid) - cpu0
    relayed = {wire: r(sum(p["streams"] for p in phases if p["format"] == wire
                           and p["mode"] == "endless") * megabytes, 1)
               for wire in ("anthropic", "openai")}
    endless = [p for p in phases if p["mode"] == "endless"]
    lift = max((p["peak_rss_mb"] - p["rss_before_mb"] for p in endless), default=0.0)
    drift = after_round[-1] - after_round[min(1, len(after_round) - 1)]
    checks = {
        "every endless stream was relayed and every line cut with event: error": not problems,
        "no endless stream lifted RSS more than 10 MB while it ran": lift <= 10,
        "RSS after the last round within 5 MB of after the second": drift <= 5,
        "relay healthy": not stack.health(),
    }
    return {
        "summary": (f"{rounds} rounds per format of {streams} endless streams x {megabytes:g} MB "
                    f"and {lines} never-ending lines: RSS at rest {rest:.1f} MB; endless streams "
                    f"lifted it at most {lift:.1f} MB; lines peaked at "
                    f"{max(p['peak_rss_mb'] for p in phases):.1f} MB; after each round "
                    f"{', '.join(f'{mb:.1f}' for mb in after_round)} MB; relay CPU "
                    f"{cpu_total:.1f} s"),
        "rss_at_rest_mb": r(rest, 1), "rss_after_round_mb": [r(mb, 1) for mb in after_round],
        "relayed_mb": relayed, "phases": phases, "relay_cpu_s": r(cpu_total),
        "samples": [{"t": r(t), "rss_kib": rss} for t, rss, _ in sampler.samples],
        "problems": problems[:20] + stack.health(), "checks": checks,
    }


# --- the run -------------------------------------------------------------------------------


async def run(names: list[str], profile: dict) -> dict:
    results = {}
    for name in names:
        print(f"{name} ...", flush=True)
        started = time.monotonic()
        params = profile[name]
        if name in ("streams", "soak"):
            dump = {"include_relay_rejections": True, "max_files": 100} if name == "soak" else None
            stack = Stack(dump=dump, setup=soak_setup if name == "soak" else None)
            try:
                scenario = scenario_streams if name == "streams" else scenario_soak
                result = await scenario(stack, **params)
            finally:
                stack.stop()
        elif name == "sessions":
            stack = Stack()
            try:
                result = await scenario_sessions(stack, **params)
            finally:
                stack.stop()
        elif name == "endless":
            stack = HostileStack()
            try:
                result = await scenario_endless(stack, **params)
            finally:
                stack.stop()
        elif name == "slow_clients":
            result = await scenario_slow_clients(**params)
        else:
            result = await scenario_connection_cap(**params)
        result["duration_s"] = r(time.monotonic() - started, 1)
        result["passed"] = all(result["checks"].values())
        results[name] = result
        print(f"{name}: {'PASS' if result['passed'] else 'FAIL'}  {result['summary']}", flush=True)
        for check, held in result["checks"].items():
            if not held:
                print(f"  failed: {check}", flush=True)
        for problem in result["problems"][:5]:
            print(f"  {problem[:300]}", flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated scenarios: " + ", ".join(SCENARIOS))
    parser.add_argument("--quick", action="store_true", help="tiny versions, to check they run")
    parser.add_argument("--out-dir", default=os.path.join(procs.ROOT, ".load"))
    parser.add_argument("--state", choices=("sqlite", "redis"), default="sqlite",
                        help="where the soak's relay shares its counts: a SQLite file, or a "
                             "redis-server the run starts on loopback")
    args = parser.parse_args()
    names = [n for n in SCENARIOS if not args.only or n in args.only.split(",")]
    fds = raise_fd_limit()
    started = time.time()
    redis_server = None
    if args.state == "redis":
        redis_dir = tempfile.TemporaryDirectory(prefix="relay-load-redis-")
        redis_server = procs.support.RedisServer(pathlib.Path(redis_dir.name))
        SOAK_REDIS["url"] = redis_server.url
    try:
        results = asyncio.run(run(names, QUICK if args.quick else FULL))
    finally:
        if redis_server is not None:
            redis_server.stop()
            redis_dir.cleanup()
    meta = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
            "duration_s": r(time.time() - started, 1), "quick": args.quick, "fd_limit": fds,
            "cpus": os.cpu_count(), "loadavg_after": procs.loadavg(),
            "aiohttp": aiohttp.__version__}
    os.makedirs(args.out_dir, exist_ok=True)
    for name, result in results.items():
        with open(os.path.join(args.out_dir, f"{name}.json"), "wb") as f:
            f.write(orjson.dumps({"meta": meta, name: result}, option=orjson.OPT_INDENT_2))
    with open(os.path.join(args.out_dir, "result.json"), "wb") as f:
        f.write(orjson.dumps({"meta": meta, **results}, option=orjson.OPT_INDENT_2))
    failed = [name for name, result in results.items() if not result["passed"]]
    print(f"make load: {len(results) - len(failed)} of {len(results)} scenarios pass "
          f"({meta['duration_s']} s); results in {args.out_dir}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
