"""Subprocesses for the benchmark, and what /proc says about them (Linux only)."""

from __future__ import annotations

import asyncio
import glob
import os
import subprocess
import sys
import time

import orjson

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")

sys.path.insert(0, os.path.dirname(HERE))  # tests/, for the subprocess helper the tests use
import support  # noqa: E402


def child_env() -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("RELAY_TRACE", None)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


class Server(support.Process):
    """A benchmark process by name: the mock, a proxy, the relay."""

    def __init__(self, name: str, argv: list[str], cwd: str = ROOT, env: dict | None = None):
        self.name = name
        super().__init__(argv, env={**child_env(), **(env or {})}, cwd=cwd)

    def wait_ready(self, timeout: float = 30.0) -> str:
        return super().wait_ready(timeout, self.name)


class LoadWorker:
    """tests/bench/load.py as a subprocess, driven one JSON line at a time."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "load.py")], cwd=ROOT,
                                     env=child_env(), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=None)
        self.pid = self.proc.pid
        self.ready = False

    def wait_ready(self) -> None:
        line = self.proc.stdout.readline()
        if not line or not orjson.loads(line).get("ready"):
            raise RuntimeError("the load generator did not start")
        self.ready = True

    def call(self, **cmd) -> dict:
        self.proc.stdin.write(orjson.dumps(cmd) + b"\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the load generator died during {cmd.get('op')}")
        answer = orjson.loads(line)
        if "exception" in answer:
            raise RuntimeError(f"load generator {cmd.get('op')}: {answer['exception']}")
        return answer

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(b'{"op": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(5)


def cpu_seconds(pid: int) -> float:
    """CPU time of every thread of ``pid`` so far: nanosecond schedstat where the kernel keeps
    it, else utime+stime from /proc/<pid>/stat (10 ms ticks)."""
    total = 0
    found = False
    for path in glob.glob(f"/proc/{pid}/task/*/schedstat"):
        try:
            with open(path) as f:
                total += int(f.read().split()[0])
                found = True
        except (OSError, ValueError, IndexError):
            pass
    if found and total > 0:
        return total / 1e9
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def children(pid: int) -> list[int]:
    """The live child processes of ``pid`` (``relay serve --workers N``: its workers)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(child) for child in f.read().split()]
    except OSError:
        return []


def tree_cpu_seconds(pid: int) -> float:
    """CPU time of ``pid`` and its live children: a supervisor and its workers together."""
    total = cpu_seconds(pid)
    for child in children(pid):
        try:
            total += cpu_seconds(child)
        except OSError:  # exited since the listing
            pass
    return total


def status_kib(pid: int, key: str) -> int:
    """A ``kB`` figure from /proc/<pid>/status: VmRSS, VmHWM, ..."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def reset_peak(pid: int) -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0, needs the right to write clear_refs)."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def loadavg() -> list[float]:
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


def busy_processes(exclude: set[int], sample: float = 1.0, limit: int = 8) -> list[dict]:
    """Other processes that used CPU during a short sample: what else was running."""
    def snapshot() -> dict[int, tuple[float, str]]:
        out = {}
        for stat in glob.glob("/proc/[0-9]*/stat"):
            try:
                with open(stat) as f:
                    text = f.read()
                pid = int(stat.split("/")[2])
                name = text[text.index("(") + 1:text.rindex(")")]
                fields = text.rsplit(")", 1)[1].split()
                out[pid] = ((int(fields[11]) + int(fields[12])) / CLOCK_TICKS, name)
            except (OSError, ValueError):
                pass
        return out

    before = snapshot()
    time.sleep(sample)
    after = snapshot()
    used = []
    for pid, (cpu, name) in after.items():
        if pid in exclude or pid not in before:
            continue
        share = (cpu - before[pid][0]) / sample
        if share > 0.02:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()[:120]
            except OSError:
                cmd = name
            used.append({"pid": pid, "cpu_share": round(share, 2), "cmd": cmd or name})
    used.sort(key=lambda p: -p["cpu_share"])
    return used[:limit]


async def serve_app(runner, label: str, host: str, port: int) -> None:
    """Run an aiohttp AppRunner on host:port until cancelled, announcing the bound address
    the way the relay does, so :class:`Server` can wait for it."""
    from aiohttp import web
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    await site.start()
    bound = site._server.sockets[0].getsockname()
    print(f"{label} listening on http://{bound[0]}:{bound[1]}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
