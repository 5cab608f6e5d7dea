"""Two relay replicas behind a real load balancer: HAProxy from Debian's packages (the
Makefile installs it), started here on loopback with a config written for the test, sending
requests to the replicas in turn (roundrobin) and asking each replica's ``/readyz``.

The relay keeps nothing between requests, so a session whose requests alternate between
replicas must reach the upstream exactly as through one process. The one thing replicas
share is the dump directory: two replicas writing into it never clobber each other's files.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import signal
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import orjson
import pytest
from support import Process, Relay, backend
from test_claude_code import CLAUDE, ClaudeCode
from test_sdk_e2e import Agent, client

HAPROXY = shutil.which("haproxy") or "/usr/sbin/haproxy"
SECRET = "sk-ant-e2e-test-key"

HAPROXY_CONFIG = """\
global
    maxconn 256

defaults
    mode http
    timeout connect 5s
    timeout client 120s
    timeout server 120s
    option httpchk GET /readyz
    # A replica that stopped listening: the connection goes to the next one.
    retries 3
    option redispatch 1

frontend relay
    bind 127.0.0.1:{port}
    default_backend replicas

backend replicas
    balance roundrobin
{servers}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LoadBalancer:
    """HAProxy in the foreground, alternating between ``servers``."""

    def __init__(self, servers: list[str], directory: Path):
        if not (os.path.isfile(HAPROXY) and os.access(HAPROXY, os.X_OK)):
            pytest.fail("HAProxy is missing: run `make test` (it installs Debian's haproxy)",
                        pytrace=False)
        self.port = free_port()
        lines = []
        for i, url in enumerate(servers):
            address = url.removeprefix("http://")
            lines.append(f"    server replica{i} {address} check inter 500ms")
        config = directory / "haproxy.cfg"
        config.write_text(HAPROXY_CONFIG.format(port=self.port, servers="\n".join(lines)))
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = Process([HAPROXY, "-db", "-f", str(config)])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/readyz", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"haproxy did not start:\n{self.process.output()}")

    def stop(self) -> None:
        self.process.stop()


@pytest.fixture
def replicas(emulator, tmp_path):
    """``start(*emulator_args)``: an emulator, two relay replicas sharing one dump
    directory, and HAProxy in front of them."""
    started = []

    def start(*emulator_args: str, dumps: Path | None = None):
        emu = emulator(*emulator_args)
        dumps = dumps or tmp_path / "dumps"
        relays = [Relay(relay_config(emu.url, dumps), directory(tmp_path / f"replica{i}"))
                  for i in range(2)]
        started.extend(relays)
        balancer = LoadBalancer([r.url for r in relays], tmp_path)
        started.append(balancer)
        return emu, relays, balancer

    yield start
    for thing in started:
        thing.stop()


def directory(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def relay_config(upstream: str, dumps: Path) -> dict:
    return {"server": {"access_log": True, "log_format": "json"},
            "pipeline": ["dedup", "pairing", "ordering", "dump"],
            "plugins": {"dump": {"dir": str(dumps), "include_relay_rejections": True,
                                 "max_pending": 1000}},  # none dropped, whatever the disk
            "backends": [backend(upstream)]}


def served_by(relays: list[Relay]) -> list[int]:
    """Which replica answered each exchange, in the order they ended."""
    lines = []
    for index, relay in enumerate(relays):
        for line in relay.output().splitlines():
            record = orjson.loads(line)
            if record["logger"] == "relay.access":
                lines.append((record["time"], index))
    return [index for _, index in sorted(lines)]


def assert_alternated(relays: list[Relay], count: int) -> None:
    deadline = time.monotonic() + 5
    while len(served_by(relays)) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    order = served_by(relays)
    assert len(order) == count
    assert all(a != b for a, b in zip(order, order[1:], strict=False)), order


def upstream_bodies(emu) -> list[bytes]:
    return [orjson.dumps(record["body"]) for record in emu.requests()]


# --- dumps on a shared volume ------------------------------------------------------------------


def post(url: str, body: dict) -> tuple[int, str]:
    request = urllib.request.Request(url + "/v1/messages", method="POST",
                                     data=orjson.dumps(body),
                                     headers={"content-type": "application/json",
                                              "x-api-key": SECRET})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            answer.read()
            return answer.status, answer.headers["x-relay-request-id"]
    except urllib.error.HTTPError as e:
        e.read()
        return e.code, e.headers["x-relay-request-id"]


def test_two_replicas_dumping_into_one_directory_never_clobber(replicas, tmp_path):
    emu, relays, balancer = replicas("--fail-status", "400")  # every answer is dumped
    body = {"model": "claude-test", "max_tokens": 10,
            "messages": [{"role": "user", "content": "hi"}]}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: post(balancer.url, body), range(60)))
    assert [status for status, _ in answers] == [400] * 60
    ids = {request_id for _, request_id in answers}
    assert len(ids) == 60
    # Every replica numbers its requests with a random prefix of its own.
    assert len({request_id[:18] for request_id in ids}) == 2
    dumps = tmp_path / "dumps"
    deadline = time.monotonic() + 10
    while len(list(dumps.rglob("*.json"))) < 60 and time.monotonic() < deadline:
        time.sleep(0.05)
    files = sorted(dumps.rglob("*.json"))
    assert len(files) == 60
    assert {f.stem.split("-", 1)[1] for f in files} == ids
    for f in files:
        assert orjson.loads(f.read_bytes())["request_id"] == f.stem.split("-", 1)[1]
    assert not list(dumps.rglob("*.tmp"))
    served = served_by(relays)
    assert served.count(0) == served.count(1) == 30


# --- real clients through the load balancer ----------------------------------------------------


@pytest.mark.e2e
@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_an_sdk_session_alternating_between_replicas_is_sent_up_as_through_one(
        replicas, emulator, relay, tmp_path, stream):
    args = ("--tool-turns", "4", "--reuse-ids", "--parallel", "2", "--max-requests", "40")
    workdir = directory(tmp_path / "work")
    single_emu = emulator(*args)
    single = relay(relay_config(single_emu.url, tmp_path / "single-dumps"))
    assert Agent(client(single.url, max_retries=0), workdir, stream).run().stop_reason == "end_turn"

    emu, relays, balancer = replicas(*args)
    agent = Agent(client(balancer.url, max_retries=0), workdir, stream)
    assert agent.run().stop_reason == "end_turn"
    assert len(agent.calls) == 8

    assert len(emu.requests()) == 5
    assert upstream_bodies(emu) == upstream_bodies(single_emu)
    assert_alternated(relays, 5)


@pytest.mark.e2e
def test_a_claude_code_session_alternating_between_replicas_is_sent_up_as_through_one(
        replicas, emulator, relay, tmp_path):
    if not (CLAUDE.is_file() and os.access(CLAUDE, os.X_OK)):
        pytest.fail(f"the Claude Code CLI is missing at {CLAUDE}: run `make e2e`", pytrace=False)
    args = ("--tool-turns", "4", "--reuse-ids", "--reask-dropped", "--max-requests", "40")
    root = tmp_path / "claude"

    def session(url: str):
        # The same directories for both runs: the CLI writes its paths into the prompt.
        shutil.rmtree(root, ignore_errors=True)
        run = ClaudeCode(root).run(url)
        assert run.returncode == 0, run
        assert "All 4 tool turns done." in run.stdout

    single_emu = emulator(*args)
    session(relay(relay_config(single_emu.url, tmp_path / "single-dumps")).url)
    emu, relays, balancer = replicas(*args)
    session(balancer.url)

    assert len(emu.requests()) == len(single_emu.requests()) == 5
    assert normalized(emu) == normalized(single_emu)
    assert_alternated(relays, 5)


def normalized(emu) -> list[dict]:
    """The bodies less what the CLI makes new for every session: its session id in
    ``metadata.user_id``."""
    bodies = []
    for record in emu.requests():
        body = record["body"]
        body.pop("metadata", None)
        bodies.append(body)
    return bodies


def test_requests_are_answered_while_a_replica_stops(replicas):
    emu, relays, balancer = replicas()
    body = {"model": "claude-test", "max_tokens": 10,
            "messages": [{"role": "user", "content": "hi"}]}
    relays[0].proc.send_signal(signal.SIGTERM)
    assert relays[0].wait(20) == 0  # nothing was in flight: a complete drain
    answers = [post(balancer.url, body) for _ in range(20)]
    assert [status for status, _ in answers] == [200] * 20
    deadline = time.monotonic() + 5  # an access line is written once its answer has gone
    while len(served_by(relays)) < 20 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert served_by(relays) == [1] * 20
