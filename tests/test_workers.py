"""`relay serve --workers N` and the drain, end to end: real relay processes, signals sent as
an operator or an orchestrator sends them, the bytes a client sees.

The slow streams come from a small upstream in the test's own loop that sends the first
events of an answer and then holds the rest until the test lets it go; slow complete answers
from the emulator's ``--delay-ms``.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import orjson
import pytest
from aiohttp import web
from support import Process, Relay, backend

from relay.chain import Chain, load_plugins
from relay.config import parse
from relay.errors import ConfigError
from relay.lifecycle import Lifecycle, SharedCounter
from relay.server import create_app

BODY = {"model": "claude-test", "max_tokens": 50,
        "messages": [{"role": "user", "content": "hi"}]}
STREAM_BODY = {**BODY, "stream": True}
SHUTTING_DOWN = b"the relay is shutting down"
WORKER_COUNTS = pytest.mark.parametrize("workers", [1, 2], ids=["one-process", "two-workers"])


def sse(name: str, data: dict) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


HEAD = (sse("message_start", {"type": "message_start", "message": {
            "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-test",
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": 1, "output_tokens": 1}}})
        + sse("content_block_start", {"type": "content_block_start", "index": 0,
                                      "content_block": {"type": "text", "text": ""}}))
TAIL = (sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                    "delta": {"type": "text_delta", "text": "done"}})
        + sse("content_block_stop", {"type": "content_block_stop", "index": 0})
        + sse("message_delta", {"type": "message_delta",
                                "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                "usage": {"output_tokens": 2}})
        + sse("message_stop", {"type": "message_stop"}))


MESSAGE = {"id": "msg_2", "type": "message", "role": "assistant", "model": "claude-test",
           "content": [{"type": "text", "text": "done"}], "stop_reason": "end_turn",
           "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}}


class HeldStream:
    """An upstream whose streams send their first events, then wait for ``release``; a
    request that does not stream is answered at once."""

    def __init__(self):
        self.release = asyncio.Event()
        self.started = asyncio.Event()
        self.url = None
        self._runner = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if not (await request.json()).get("stream"):
            return web.json_response(MESSAGE)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(HEAD)
        self.started.set()
        try:
            await asyncio.wait_for(self.release.wait(), 30)
        except asyncio.TimeoutError:
            return response
        await response.write(TAIL)
        await response.write_eof()
        return response

    async def models(self, request: web.Request) -> web.Response:
        self.started.set()
        await asyncio.wait_for(self.release.wait(), 30)
        return web.json_response({"data": [], "has_more": False})

    async def __aenter__(self):
        app = web.Application()
        app.router.add_post("/v1/messages", self.handle)
        app.router.add_get("/v1/models", self.models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return self

    async def __aexit__(self, *exc):
        self.release.set()
        await self._runner.cleanup()


def start_relay(tmp_path: Path, upstream: str, workers: int, **server) -> Relay:
    config = {"server": {"access_log": True, **server},
              "pipeline": ["dedup", "pairing", "ordering"],
              "backends": [backend(upstream)]}
    return Relay(config, tmp_path, args=["--workers", str(workers), "--log-format", "json"])


def exit_status(relay: Relay, timeout: float = 20) -> int:
    return relay.wait(timeout)


def access_lines(relay: Relay) -> list[dict]:
    lines = []
    for line in relay.output().splitlines():
        if line.startswith("{"):
            record = orjson.loads(line)
            if record["logger"] == "relay.access":
                lines.append(record)
    return lines


def refuses_connections(url: str) -> bool:
    parts = urlsplit(url)
    try:
        socket.create_connection((parts.hostname, parts.port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    except ConnectionResetError:  # caught in the backlog as the listener closed: ask again
        return False
    return False


async def until(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await asyncio.to_thread(condition):
            return True
        await asyncio.sleep(0.05)
    return False


# --- workers --------------------------------------------------------------------------------


async def test_every_request_is_answered_by_two_workers(tmp_path, emulator):
    emu = emulator()
    relay = start_relay(tmp_path, emu.url, workers=2)
    try:
        assert "(2 workers)" in relay.output()
        # A connection of its own for each request: the kernel spreads connections, not
        # requests, over the workers' sockets.
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            async def ask(stream: bool) -> tuple[int, bytes, str]:
                async with session.post(relay.url + "/v1/messages",
                                        json=STREAM_BODY if stream else BODY) as response:
                    return (response.status, await response.read(),
                            response.headers["x-relay-request-id"])
            answers = await asyncio.gather(*(ask(i % 2 == 1) for i in range(64)))
        assert [status for status, _, _ in answers] == [200] * 64
        assert all(b"message_stop" in body for _, body, _ in answers[1::2])
        ids = [request_id for _, _, request_id in answers]
        assert len(set(ids)) == 64
        assert await until(lambda: len(access_lines(relay)) == 64)
        lines = access_lines(relay)
        pids = {line["pid"] for line in lines}
        assert len(pids) == 2 and relay.pid not in pids  # the supervisor serves nothing
        # Each worker numbers its requests with a prefix of its own.
        assert len({request_id[:18] for request_id in ids}) == 2
        assert sorted(line["request_id"] for line in lines) == sorted(ids)
        assert len(emu.requests()) == 64
    finally:
        relay.stop()
    assert exit_status(relay) == 0


async def test_readyz_and_healthz_say_the_workers_serve(tmp_path, emulator):
    emu = emulator()
    relay = start_relay(tmp_path, emu.url, workers=2)
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(relay.url + "/readyz") as response:
                assert response.status == 200
                assert await response.json() == {"status": "ready", "workers": {
                    "configured": 2, "serving": 2}}
            async with session.get(relay.url + "/healthz") as response:
                assert response.status == 200
                assert (await response.json())["status"] == "ok"
    finally:
        relay.stop()


PROBE = '''
import os
from relay.hookspecs import hookimpl


def _mark(options, what):
    with open(os.path.join(options["dir"], f"{what}-{os.getpid()}"), "w"):
        pass


@hookimpl
def relay_startup(config, options):
    _mark(options, "startup")


@hookimpl
def relay_shutdown(config):
    _mark({"dir": os.environ["PROBE_DIR"]}, "shutdown")
'''


def probe_plugin(root: Path, source: str = PROBE) -> dict:
    """A third-party plugin, installed the way pip installs one (an entry point in a
    dist-info directory on the path): it leaves a file per process for its start and end."""
    (root / "relay_probe.py").write_text(source)
    info = root / "relay_probe-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: relay-probe\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[relay.plugins]\nprobe = relay_probe\n")
    return {"PYTHONPATH": os.pathsep.join([str(root), *sys.path])}


def test_each_worker_runs_the_plugins_startup_and_shutdown(tmp_path, emulator):
    emu = emulator()
    marks = tmp_path / "marks"
    marks.mkdir()
    (tmp_path / "site").mkdir()
    env = {**probe_plugin(tmp_path / "site"), "PROBE_DIR": str(marks)}
    relay = Relay({"pipeline": ["dedup", "probe"], "plugins": {"probe": {"dir": str(marks)}},
                   "backends": [backend(emu.url)]}, tmp_path, env=env, args=["--workers", "3"])
    started = {p.name.split("-")[1] for p in marks.glob("startup-*")}
    assert len(started) == 3 and str(relay.pid) not in started
    relay.stop()
    assert exit_status(relay) == 0
    assert {p.name.split("-")[1] for p in marks.glob("shutdown-*")} == started


# A plugin whose start-up waits long (on a service it needs, say).
SLOW_START = """
import asyncio
import os
from relay.hookspecs import hookimpl


def _mark(what):
    with open(os.path.join(os.environ["PROBE_DIR"], f"{what}-{os.getpid()}"), "w"):
        pass


@hookimpl
async def relay_startup(config):
    _mark("startup")
    await asyncio.sleep(60)


@hookimpl
def relay_shutdown(config):
    _mark("shutdown")
"""


@pytest.mark.slow
@WORKER_COUNTS
def test_a_second_signal_ends_a_start_up_that_takes_long(tmp_path, workers):
    marks = tmp_path / "marks"
    marks.mkdir()
    (tmp_path / "site").mkdir()
    env = {**probe_plugin(tmp_path / "site", SLOW_START), "PROBE_DIR": str(marks)}
    config = tmp_path / "relay.yaml"
    config.write_text(orjson.dumps({
        "pipeline": ["probe"],
        "backends": [backend("http://127.0.0.1:9")]}).decode())
    relay = Process([sys.executable, "-m", "relay", "--config", str(config), "--port", "0",
                     "--workers", str(workers)], env=env, cwd=str(tmp_path))
    try:
        deadline = time.monotonic() + 20
        while len(list(marks.glob("startup-*"))) < workers and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(list(marks.glob("startup-*"))) == workers
        os.kill(relay.pid, signal.SIGTERM)
        time.sleep(0.2)
        os.kill(relay.pid, signal.SIGTERM)
        assert relay.wait(10) == 1
        assert "listening" not in relay.output()
        assert "second stop signal: ending the start-up" in relay.output()
        # What had started was shut down: each process ran the plugins' relay_shutdown.
        assert len(list(marks.glob("shutdown-*"))) == workers
    finally:
        relay.stop()


def test_a_plugin_config_error_in_the_workers_stops_the_relay_with_status_2(tmp_path, emulator):
    emu = emulator()
    relay_yaml = tmp_path / "relay.yaml"
    relay_yaml.write_text(orjson.dumps({
        "pipeline": ["pairing"], "plugins": {"pairing": {"pairing_mode": "sometimes"}},
        "backends": [backend(emu.url)]}).decode())
    done = subprocess.run([sys.executable, "-m", "relay", "--config", str(relay_yaml),
                           "--port", "0", "--workers", "2"],
                          capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert done.returncode == 2
    assert "config error: plugins.pairing.pairing_mode" in done.stderr
    assert "listening" not in done.stdout


def test_a_worker_that_dies_is_started_again(tmp_path, emulator):
    emu = emulator()
    relay = start_relay(tmp_path, emu.url, workers=2)
    try:
        pids = set(worker_pids(relay.pid))
        assert len(pids) == 2
        os.kill(next(iter(pids)), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            now = set(worker_pids(relay.pid))
            if len(now) == 2 and now != pids:
                break
            time.sleep(0.1)
        assert len(now) == 2 and len(now & pids) == 1
        assert relay.wait_for_output("was killed by SIGKILL while serving; starting it again "
                                     "in 1s")
        assert relay.wait_for_output("starting worker")
    finally:
        relay.stop()


# A plugin whose start-up makes its worker die while the file CRASH_FILE names is there.
CRASHING = """
import os
from relay.hookspecs import hookimpl


@hookimpl
def relay_startup(config):
    if os.path.exists(os.environ["CRASH_FILE"]):
        os._exit(3)
"""


def log_records(relay: Relay, containing: str) -> list[tuple[float, str]]:
    """The relay's JSON log lines whose message has ``containing``: (unix time, message)."""
    found = []
    for line in relay.output().splitlines():
        if line.startswith("{"):
            record = orjson.loads(line)
            if containing in record["message"]:
                when = datetime.datetime.fromisoformat(record["time"].replace("Z", "+00:00"))
                found.append((when.timestamp(), record["message"]))
    return found


@pytest.mark.slow
def test_a_worker_that_keeps_dying_waits_longer_each_time_and_a_stop_ends_the_wait(
        tmp_path, emulator):
    emu = emulator()
    crash = tmp_path / "crash"
    (tmp_path / "site").mkdir()
    env = {**probe_plugin(tmp_path / "site", CRASHING), "CRASH_FILE": str(crash)}
    relay = Relay({"pipeline": ["probe"], "backends": [backend(emu.url)]}, tmp_path, env=env,
                  args=["--workers", "2", "--log-format", "json"])
    try:
        crash.touch()  # from now on a worker dies in its start-up
        os.kill(worker_pids(relay.pid)[0], signal.SIGKILL)
        assert relay.wait_for_output("starting it again in 4s", timeout=30), relay.output()
        deaths = log_records(relay, "; starting it again in ")
        starts = log_records(relay, "starting worker ")
        assert [message.split(") ", 1)[1] for _, message in deaths] == [
            "was killed by SIGKILL while serving; starting it again in 1s",
            "exited with status 3 before it listened; starting it again in 2s",
            "exited with status 3 before it listened; starting it again in 4s"]
        assert len(starts) == 2
        for (died, _), (started, _), wait in zip(deaths[:2], starts, (1, 2), strict=True):
            assert wait <= started - died < wait + 1
        # Meanwhile the other worker serves.
        with urllib.request.urlopen(relay.url + "/readyz", timeout=10) as response:
            assert orjson.loads(response.read())["workers"] == {"configured": 2, "serving": 1}
        signalled = time.monotonic()
        os.kill(relay.pid, signal.SIGTERM)
        assert exit_status(relay, timeout=10) == 0
        assert time.monotonic() - signalled < 3
        assert len(log_records(relay, "starting worker ")) == 2
    finally:
        relay.stop()


def test_the_restart_wait_doubles_to_its_cap_and_starts_over_after_a_worker_served():
    from relay.workers import RESTART_MAX, RESTART_RESET, restart_delay
    waits = [restart_delay(None, None)]
    for _ in range(7):
        waits.append(restart_delay(waits[-1], None))
    assert waits == [1, 2, 4, 8, 16, RESTART_MAX, RESTART_MAX, RESTART_MAX] and RESTART_MAX == 30
    assert restart_delay(8, 5.0) == 16  # served, but briefly: it counts as dying again
    assert restart_delay(RESTART_MAX, RESTART_RESET) == 1


def worker_pids(parent: int) -> list[int]:
    children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    return [int(pid) for pid in children]


def test_workers_whose_supervisor_is_killed_drain_and_exit(tmp_path, emulator):
    emu = emulator()
    relay = start_relay(tmp_path, emu.url, workers=2)
    pids = worker_pids(relay.pid)
    os.kill(relay.pid, signal.SIGKILL)
    relay.wait(5)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in pids):
        time.sleep(0.1)
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)
    assert refuses_connections(relay.url)


def metrics_dirs(parent: Path) -> list[Path]:
    return sorted(parent.glob("relay-metrics-*"))


def test_a_killed_supervisors_metrics_directory_is_removed_at_the_next_start(tmp_path,
                                                                             emulator):
    emu = emulator()
    temp = tmp_path / "tmp"
    temp.mkdir()
    # Directories still in use are kept: one whose maker lives (this test), one whose maker is
    # gone but whose writer lives.
    alive = temp / f"relay-metrics-{os.getpid()}-alive"
    alive.mkdir()
    orphan = temp / "relay-metrics-999999999-orphan"
    orphan.mkdir()
    (orphan / f"counter_{os.getpid()}.db").write_bytes(b"")
    config = {"pipeline": ["metrics"], "backends": [backend(emu.url)]}
    first = Relay(config, tmp_path, env={"TMPDIR": str(temp)}, args=["--workers", "2"])
    pids = worker_pids(first.pid)
    with urllib.request.urlopen(first.url + "/metrics", timeout=10) as response:
        assert response.status == 200  # the workers have written into their directory
    (left,) = [d for d in metrics_dirs(temp) if d not in (alive, orphan)]
    assert left.name.startswith(f"relay-metrics-{first.pid}-")
    os.kill(first.pid, signal.SIGKILL)
    first.wait(5)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in pids):
        time.sleep(0.1)
    assert left.is_dir()  # nothing could remove it
    second = Relay(config, tmp_path, env={"TMPDIR": str(temp)}, args=["--workers", "2"])
    try:
        assert not left.exists()
        assert alive.is_dir() and orphan.is_dir()
        (mine,) = [d for d in metrics_dirs(temp) if d not in (alive, orphan)]
        assert mine.name.startswith(f"relay-metrics-{second.pid}-")
        assert "removed 1 metrics directory left by relays that were killed" in second.output()
    finally:
        second.stop()
    assert metrics_dirs(temp) == [alive, orphan]  # a clean stop removes its own


def test_the_port_of_a_running_relay_is_not_shared_by_accident(tmp_path, emulator):
    emu = emulator()
    first = start_relay(tmp_path, emu.url, workers=2)
    try:
        port = urlsplit(first.url).port
        done = subprocess.run([sys.executable, "-m", "relay", "--config",
                               str(first.config_path), "--port", str(port), "--workers", "2"],
                              capture_output=True, text=True, timeout=30, cwd=tmp_path)
        assert done.returncode == 2
        assert f"cannot listen on 127.0.0.1:{port}" in done.stderr
    finally:
        first.stop()


# --- the drain ------------------------------------------------------------------------------


async def read_stream(response) -> bytes:
    """The body as a client reading event by event has it; ``<cut>`` marks a body that did
    not end properly."""
    body = b""
    try:
        async for chunk in response.content.iter_any():
            body += chunk
    except aiohttp.ClientPayloadError:
        body += b"<cut>"
    return body


@pytest.mark.slow
@WORKER_COUNTS
async def test_sigterm_lets_a_stream_in_flight_finish_and_exits_0(tmp_path, workers):
    async with HeldStream() as upstream, aiohttp.ClientSession() as session:
        relay = start_relay(tmp_path, upstream.url, workers=workers)
        try:
            async with session.post(relay.url + "/v1/messages", json=STREAM_BODY) as response:
                assert response.status == 200
                await upstream.started.wait()
                os.kill(relay.pid, signal.SIGTERM)
                # It stops accepting at once, while the stream goes on.
                assert await until(lambda: refuses_connections(relay.url))
                upstream.release.set()
                body = await read_stream(response)
            assert body == HEAD + TAIL
            assert await asyncio.to_thread(exit_status, relay) == 0
        finally:
            relay.stop()


@pytest.mark.slow
@WORKER_COUNTS
async def test_unready_seconds_keep_serving_new_connections_unready_then_drain(tmp_path,
                                                                              workers):
    # A load balancer or Kubernetes takes a stopping relay out some seconds after the signal;
    # until then its new connections must find the port open.
    window = 3.0
    async with HeldStream() as upstream, aiohttp.ClientSession() as session:
        relay = start_relay(tmp_path, upstream.url, workers=workers, unready_seconds=window)
        # A connection per request, as new ones come: with workers the kernel spreads them.
        fresh = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
        try:
            async with session.post(relay.url + "/v1/messages", json=STREAM_BODY) as response:
                await upstream.started.wait()
                signalled = time.monotonic()
                os.kill(relay.pid, signal.SIGTERM)

                async def ready() -> int:
                    async with fresh.get(relay.url + "/readyz") as answer:
                        return answer.status
                while await ready() == 200:
                    assert time.monotonic() - signalled < window
                    await asyncio.sleep(0.02)
                for _ in range(4):
                    async with fresh.get(relay.url + "/readyz") as answer:
                        assert answer.status == 503
                        assert (await answer.json())["status"] == "draining"
                    async with fresh.post(relay.url + "/v1/messages", json=BODY) as answer:
                        assert answer.status == 200
                        assert (await answer.json())["content"] == MESSAGE["content"]
                assert time.monotonic() - signalled < window
                # Then the drain as without the window: the port closes, the stream goes on.
                assert await until(lambda: refuses_connections(relay.url))
                assert time.monotonic() - signalled >= window
                upstream.release.set()
                body = await read_stream(response)
            assert body == HEAD + TAIL
            assert await asyncio.to_thread(exit_status, relay) == 0
            assert relay.output().count("still accepting for") == workers
        finally:
            await fresh.close()
            relay.stop()


@pytest.mark.slow
async def test_a_stop_signal_to_every_process_at_once_drains_as_one_to_the_relay(tmp_path):
    # systemd's default KillMode=control-group and dumb-init signal every process of the
    # relay, the workers as well as their supervisor, which passes its SIGTERM on: a worker
    # took that copy for a second signal and cut its streams.
    async with HeldStream() as upstream, aiohttp.ClientSession() as session:
        relay = start_relay(tmp_path, upstream.url, workers=2)
        try:
            async with session.post(relay.url + "/v1/messages", json=STREAM_BODY) as response:
                await upstream.started.wait()
                await asyncio.sleep(0.2)  # the first events are through the relay
                for pid in [*worker_pids(relay.pid), relay.pid]:
                    os.kill(pid, signal.SIGTERM)
                assert await until(lambda: refuses_connections(relay.url))
                await asyncio.sleep(0.3)  # the supervisor's copies have come
                upstream.release.set()
                body = await read_stream(response)
            assert body == HEAD + TAIL
            assert await asyncio.to_thread(exit_status, relay) == 0
            assert "second stop signal" not in relay.output()
        finally:
            relay.stop()


@pytest.mark.slow
def test_a_stop_signal_as_the_workers_are_forked_lets_them_start_and_drain(tmp_path):
    # Right after the fork a worker's SIGTERM had its default action until its loop handled
    # it: the worker died at once, and the relay exited 1 as if it had cut requests.
    marks = tmp_path / "marks"
    marks.mkdir()
    (tmp_path / "site").mkdir()
    env = {**probe_plugin(tmp_path / "site"), "PROBE_DIR": str(marks)}
    config = tmp_path / "relay.yaml"
    config.write_text(orjson.dumps({
        "pipeline": ["probe"], "plugins": {"probe": {"dir": str(marks)}},
        "backends": [backend("http://127.0.0.1:9")]}).decode())
    relay = Process([sys.executable, "-m", "relay", "--config", str(config), "--port", "0",
                     "--workers", "2"], env=env, cwd=str(tmp_path))
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if len(worker_pids(relay.pid)) == 2:
                    break
            except FileNotFoundError:  # not started yet
                pass
        assert not list(marks.glob("startup-*"))  # the workers are still on their way
        os.kill(relay.pid, signal.SIGTERM)
        assert relay.wait(20) == 0, relay.output()
        # Each worker started, served nothing and shut down: what a signal during start-up is.
        assert len(list(marks.glob("startup-*"))) == 2
        assert len(list(marks.glob("shutdown-*"))) == 2
    finally:
        relay.stop()


@pytest.mark.slow
@WORKER_COUNTS
async def test_sighup_neither_stops_the_relay_nor_cuts_a_stream(tmp_path, workers):
    # The relay has no reload: SIGHUP's default action would end it at once, every stream
    # cut without an error event. A terminal's hangup reaches the workers too.
    async with HeldStream() as upstream, aiohttp.ClientSession() as session:
        relay = start_relay(tmp_path, upstream.url, workers=workers)
        try:
            async with session.post(relay.url + "/v1/messages", json=STREAM_BODY) as response:
                await upstream.started.wait()
                for pid in [relay.pid, *worker_pids(relay.pid)]:
                    os.kill(pid, signal.SIGHUP)
                assert relay.wait_for_output("SIGHUP: the relay does not reload")
                async with session.get(relay.url + "/readyz") as ready:
                    assert ready.status == 200
                upstream.release.set()
                body = await read_stream(response)
            assert body == HEAD + TAIL
            assert relay.proc.poll() is None
            assert relay.output().count("SIGHUP") == 1
            os.kill(relay.pid, signal.SIGTERM)
            assert await asyncio.to_thread(exit_status, relay) == 0
        finally:
            relay.stop()


@pytest.mark.slow
@WORKER_COUNTS
async def test_a_second_sigterm_ends_open_streams_with_an_error_event_and_exits_1(tmp_path,
                                                                                 workers):
    async with HeldStream() as upstream, aiohttp.ClientSession() as session:
        relay = start_relay(tmp_path, upstream.url, workers=workers)
        try:
            async with session.post(relay.url + "/v1/messages", json=STREAM_BODY) as response:
                await upstream.started.wait()
                await asyncio.sleep(0.2)  # the first events are through the relay
                os.kill(relay.pid, signal.SIGTERM)
                assert await until(lambda: refuses_connections(relay.url))
                os.kill(relay.pid, signal.SIGTERM)
                body = await read_stream(response)
            assert body.startswith(HEAD)
            assert body[len(HEAD):] == sse("error", {"type": "error", "error": {
                "type": "api_error", "message": SHUTTING_DOWN.decode()}})
            assert await asyncio.to_thread(exit_status, relay) == 1
            assert "drain cut short after a second signal: ending 1 request(s)" in relay.output()
        finally:
            relay.stop()


@pytest.mark.slow
@WORKER_COUNTS
async def test_the_drain_deadline_ends_open_streams_with_an_error_event(tmp_path, workers):
    async with HeldStream() as upstream, aiohttp.ClientSession() as session:
        relay = start_relay(tmp_path, upstream.url, workers=workers, drain_seconds=0.5)
        try:
            async with session.post(relay.url + "/v1/messages", json=STREAM_BODY) as response:
                await upstream.started.wait()
                await asyncio.sleep(0.2)
                os.kill(relay.pid, signal.SIGTERM)
                body = await read_stream(response)
            assert body.endswith(b"event: error\n" + b'data: {"type":"error","error":{'
                                 b'"type":"api_error","message":"' + SHUTTING_DOWN + b'"}}\n\n')
            assert body.startswith(HEAD) and b"message_stop" not in body
            assert await asyncio.to_thread(exit_status, relay) == 1
            assert "drain cut short after 0.5s" in relay.output()
        finally:
            relay.stop()


@WORKER_COUNTS
async def test_a_complete_answer_in_flight_is_waited_for(tmp_path, emulator, workers):
    emu = emulator("--delay-ms", "1500")
    relay = start_relay(tmp_path, emu.url, workers=workers)
    try:
        async with aiohttp.ClientSession() as session:
            answer = asyncio.ensure_future(session.post(relay.url + "/v1/messages", json=BODY))
            assert await until(lambda: len(emu.requests()) == 1)
            os.kill(relay.pid, signal.SIGTERM)
            response = await answer
            assert response.status == 200
            assert (await response.json())["type"] == "message"
        assert await asyncio.to_thread(exit_status, relay) == 0
    finally:
        relay.stop()


@WORKER_COUNTS
async def test_an_answer_cut_by_the_drain_is_a_503_in_anthropics_format(tmp_path, emulator,
                                                                        workers):
    emu = emulator("--delay-ms", "20000")
    relay = start_relay(tmp_path, emu.url, workers=workers)
    try:
        async with aiohttp.ClientSession() as session:
            answer = asyncio.ensure_future(session.post(relay.url + "/v1/messages", json=BODY))
            assert await until(lambda: len(emu.requests()) == 1)
            os.kill(relay.pid, signal.SIGTERM)
            assert await until(lambda: refuses_connections(relay.url))
            os.kill(relay.pid, signal.SIGTERM)
            response = await answer
            assert response.status == 503
            assert response.headers["x-should-retry"] == "true"
            request_id = response.headers["x-relay-request-id"]
            # Where the SDKs read an error's request id, as for every error of the relay's.
            assert response.headers["request-id"] == request_id
            assert await response.json() == {"type": "error", "error": {
                "type": "api_error", "message": SHUTTING_DOWN.decode()},
                "request_id": request_id}
        assert await asyncio.to_thread(exit_status, relay) == 1
        # The record says what the client got: the relay's 503, under the id the client has.
        [line] = [line for line in access_lines(relay) if line["path"] == "/v1/messages"]
        assert (line["status"], line["outcome"]) == (503, "relay_error")
        assert request_id == line["request_id"]
    finally:
        relay.stop()


@pytest.mark.slow
async def test_a_pass_through_request_cut_by_the_drain_is_a_recorded_503(tmp_path):
    async with HeldStream() as upstream, aiohttp.ClientSession() as session:
        relay = start_relay(tmp_path, upstream.url, workers=1)
        try:
            answer = asyncio.ensure_future(session.get(relay.url + "/v1/models"))
            await upstream.started.wait()
            os.kill(relay.pid, signal.SIGTERM)
            assert await until(lambda: refuses_connections(relay.url))
            os.kill(relay.pid, signal.SIGTERM)
            response = await answer
            assert response.status == 503
            request_id = response.headers["request-id"]
            assert (await response.json())["request_id"] == request_id
            assert await asyncio.to_thread(exit_status, relay) == 1
            [line] = access_lines(relay)
            assert (line["request_id"], line["endpoint"], line["status"], line["outcome"]) == (
                request_id, "passthrough", 503, "relay_error")
        finally:
            relay.stop()


@pytest.mark.slow
@WORKER_COUNTS
async def test_a_request_whose_body_is_still_coming_at_the_deadline_gets_a_recorded_503(
        tmp_path, emulator, workers):
    emu = emulator()
    relay = start_relay(tmp_path, emu.url, workers=workers, drain_seconds=0.5)
    body = orjson.dumps(BODY)
    parts = urlsplit(relay.url)
    try:
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        writer.write(b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body[:10])
        await writer.drain()
        await asyncio.sleep(0.3)  # its handler waits for the rest of the body
        os.kill(relay.pid, signal.SIGTERM)
        head, _, answer = (await asyncio.wait_for(reader.read(), 10)).partition(b"\r\n\r\n")
        writer.close()
        assert head.startswith(b"HTTP/1.1 503 ")
        headers = dict(line.split(": ", 1) for line in head.decode().split("\r\n")[1:])
        request_id = headers["x-relay-request-id"]
        assert headers["request-id"] == request_id
        assert orjson.loads(answer) == {"type": "error", "error": {
            "type": "api_error", "message": SHUTTING_DOWN.decode()}, "request_id": request_id}
        assert await asyncio.to_thread(exit_status, relay) == 1
        [line] = [line for line in access_lines(relay) if line["path"] == "/v1/messages"]
        assert (line["request_id"], line["status"], line["outcome"]) == (
            request_id, 503, "relay_error")
        assert emu.requests() == []
    finally:
        relay.stop()


@WORKER_COUNTS
def test_an_idle_relay_stops_at_once_with_status_0(tmp_path, emulator, workers):
    emu = emulator()
    relay = start_relay(tmp_path, emu.url, workers=workers)
    started = time.monotonic()
    os.kill(relay.pid, signal.SIGINT)  # Ctrl-C, as a terminal sends it
    assert exit_status(relay) == 0
    assert time.monotonic() - started < 10


# --- the keys and the states -----------------------------------------------------------------


def test_the_server_keys_have_safe_defaults_and_say_what_is_wrong():
    minimal = {"backends": [backend("http://127.0.0.1:9")]}
    config = parse(minimal)
    assert (config.workers, config.log_format, config.drain_seconds) == (1, "text", 30.0)
    config = parse({**minimal, "server": {"workers": 4, "log_format": "json", "drain_seconds": 0}})
    assert (config.workers, config.log_format, config.drain_seconds) == (4, "json", 0.0)
    for server, message in [
        ({"workers": 0}, "server.workers: must be between 1 and 256"),
        ({"workers": "2"}, "server.workers: must be an integer"),
        ({"workers": True}, "server.workers: must be an integer"),
        ({"log_format": "xml"}, "server.log_format: must be text or json"),
        ({"drain_seconds": -1}, "server.drain_seconds: must be a number of seconds, 0 or more"),
        ({"drain_seconds": "30s"}, "server.drain_seconds: must be a number of seconds, 0 or more"),
    ]:
        with pytest.raises(ConfigError) as error:
            parse({**minimal, "server": server})
        assert str(error.value) == message


@pytest.mark.slow
def test_workers_on_the_command_line_are_checked(tmp_path):
    (tmp_path / "relay.yaml").write_text("backends: [{name: a, url: 'http://127.0.0.1:9'}]\n")
    done = subprocess.run([sys.executable, "-m", "relay", "--config", "relay.yaml",
                           "--workers", "0"], capture_output=True, text=True, timeout=30,
                          cwd=tmp_path)
    assert done.returncode == 2
    assert "--workers: must be between 1 and 256" in done.stderr


def test_a_second_signal_leaves_a_stuck_worker_the_grace_alone_not_the_drain():
    from relay import workers
    config = parse({"backends": [backend("http://127.0.0.1:9")],
                    "server": {"drain_seconds": 600}})
    supervisor = workers.Supervisor(config, None, "127.0.0.1", 0, 2)
    started = time.monotonic()
    supervisor.stop()
    assert supervisor.stop_deadline is not None
    assert supervisor.stop_deadline - started >= 600 + workers.KILL_GRACE
    supervisor.stop()
    assert supervisor.stop_deadline - started <= workers.KILL_GRACE + 1


def test_the_listening_line_names_an_ipv6_address_as_a_url_does():
    # One process and the supervisor alike (`relay --host ::1`): http://::1:8787 is no URL.
    from relay.listen import url_of
    assert url_of(("::1", 8787, 0, 0)) == "http://[::1]:8787"
    assert url_of(("127.0.0.1", 8787)) == "http://127.0.0.1:8787"


async def test_readiness_follows_the_process_through_its_life():
    serving = SharedCounter()
    state = Lifecycle(3, serving)
    assert state.readiness() == (503, {"status": "starting",
                                       "workers": {"configured": 3, "serving": 0}})
    state.listening = True
    serving.value = 3
    assert state.readiness() == (200, {"status": "ready",
                                       "workers": {"configured": 3, "serving": 3}})
    serving.value = 2  # one worker being started again: this one still serves
    assert state.readiness()[0] == 200
    state.signal()
    assert state.stop_requested.is_set() and not state.second_signal.is_set()
    state.draining = True
    assert state.readiness() == (503, {"status": "draining",
                                       "workers": {"configured": 3, "serving": 2}})
    state.signal()
    assert state.second_signal.is_set()


async def test_a_second_signal_ends_the_unready_wait_and_a_late_start_keeps_the_deadline():
    state = Lifecycle()
    state.listening = True
    state.signal()
    assert state.readiness()[0] == 503
    waiting = asyncio.ensure_future(state.unready(30))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    state.signal()
    await asyncio.wait_for(waiting, 1)
    # A worker whose start-up outlasted the window, begun at the signal, does not add one.
    late = Lifecycle()
    late.signal()
    late.stopped_at -= 30
    await asyncio.wait_for(late.unready(30), 0.1)


async def test_an_app_without_the_lifecycle_is_ready_once_it_answers(aiohttp_client):
    config = parse({"backends": [backend("http://127.0.0.1:9")]})
    client = await aiohttp_client(create_app(config, Chain(load_plugins([]), config)))
    response = await client.get("/readyz")
    assert response.status == 200 and await response.json() == {"status": "ready"}
