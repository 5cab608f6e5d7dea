"""Real servers for the tests: the emulator and the relay run as subprocesses on free
loopback ports, exactly as a user would start them."""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

# The plugin test kit the package ships (relay.testing), re-exported for the suites here.
from relay.testing import assistant, exchange_for, passes, refuses, request, result, text, use, user  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
LISTENING = re.compile(r"listening on (http://[\w.\[\]:]+)")


class Process:
    """A subprocess that prints ``... listening on http://HOST:PORT`` once it is ready; its
    output is kept (up to ``MAX_LINES`` lines, for a long benchmark run)."""

    MAX_LINES = 5000

    def __init__(self, argv: list[str], env: dict | None = None, cwd: str | None = None):
        full_env = dict(os.environ, PYTHONUNBUFFERED="1")
        full_env.pop("RELAY_TRACE", None)
        # The relay reads these (relay.egress): a developer's own proxy is not the tests'.
        for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "no_proxy",
                     "NO_PROXY"):
            full_env.pop(name, None)
        full_env.update(env or {})
        self.lines: list[str] = []
        self.url: str | None = None
        self._ready = threading.Event()
        self.proc = subprocess.Popen(
            argv, cwd=cwd or ROOT, env=full_env,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.pid = self.proc.pid
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if len(self.lines) < self.MAX_LINES:
                self.lines.append(line)
            if self.url is None:
                match = LISTENING.search(line)
                if match:
                    self.url = match.group(1)
                    self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout: float, what: str) -> str:
        if not self._ready.wait(timeout) or self.url is None:
            self.stop()
            raise RuntimeError(f"{what} did not start:\n{self.output()}")
        return self.url

    def output(self) -> str:
        return "".join(self.lines)

    def wait_for_output(self, wanted: str, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if wanted in self.output():
                return True
            time.sleep(0.02)
        return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def wait(self, timeout: float) -> int:
        """``Popen.wait(timeout)``, told of the exit at once: Popen's own sleeps between looks,
        up to 50 ms, and every test stops a process or two."""
        try:
            pidfd = os.pidfd_open(self.pid)
        except ProcessLookupError:  # already reaped
            return self.proc.wait()
        try:
            if not select.select([pidfd], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.proc.args, timeout)
        finally:
            os.close(pidfd)
        return self.proc.wait()


class Server(Process):
    """``python -m relay ARGS`` (the relay or the emulator), started and ready."""

    def __init__(self, args: list[str], env: dict | None = None, cwd: str | None = None,
                 timeout: float = 20.0):
        self.args = args
        super().__init__([sys.executable, "-m", "relay", *args], env=env, cwd=cwd)
        self.wait_ready(timeout, str(args[:2]))


class Emulator(Server):
    def _call(self, method: str, path: str):
        call = urllib.request.Request(self.url + path, method=method)
        with urllib.request.urlopen(call, timeout=10) as response:
            return json.loads(response.read() or b"null")

    def requests(self) -> list[dict]:
        return self._call("GET", "/_emulator/requests")

    def clear(self) -> None:
        self._call("DELETE", "/_emulator/requests")


class Relay(Server):
    def __init__(self, config: dict, directory: Path, env: dict | None = None, args=()):
        self.config_path = directory / "relay.yaml"
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        super().__init__(["--config", str(self.config_path), "--port", "0", *args],
                         env=env, cwd=str(directory))


def backend(url: str, name: str = "emu", models=("*",), **extra) -> dict:
    """A relay.yaml backend entry pointing at a test server."""
    return {"name": name, "url": url, "models": list(models), **extra}



REDIS_SERVER = "/usr/bin/redis-server"


class RedisServer:
    """A ``redis-server`` of the test's own on a free loopback port, keeping nothing on disk;
    :meth:`stop` and :meth:`start` again (same port) stand for an outage."""

    def __init__(self, directory: Path):
        self.binary = shutil.which("redis-server") or REDIS_SERVER
        if not os.access(self.binary, os.X_OK):
            pytest.fail("redis-server is missing: run `make test` (it installs Debian's "
                        "redis-server)", pytrace=False)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.directory = directory
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: Process | None = None
        self.start()

    def start(self) -> None:
        self.process = Process([self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
                                "--save", "", "--appendonly", "no", "--dir",
                                str(self.directory), "--loglevel", "warning"])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not start:\n{self.process.output()}")

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None
