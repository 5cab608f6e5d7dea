"""Real servers for the tests: the emulator and the relay run as subprocesses on free
loopback ports, exactly as a user would start them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import orjson
import pytest
import yaml

from relay import skeleton
from relay.config import Backend
from relay.errors import RelayError
from relay.exchange import Exchange

ROOT = Path(__file__).resolve().parent.parent
LISTENING = re.compile(r"listening on (http://[\w.\[\]:]+)")


class Process:
    """A subprocess that prints ``... listening on http://HOST:PORT`` once it is ready; its
    output is kept (up to ``MAX_LINES`` lines, for a long benchmark run)."""

    MAX_LINES = 5000

    def __init__(self, argv: list[str], env: dict | None = None, cwd: str | None = None):
        full_env = dict(os.environ, PYTHONUNBUFFERED="1")
        full_env.pop("RELAY_TRACE", None)
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

    def wait_for_output(self, text: str, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.output():
                return True
            time.sleep(0.02)
        return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


class Server(Process):
    """``python -m relay ARGS`` (the relay or the emulator), started and ready."""

    def __init__(self, args: list[str], env: dict | None = None, cwd: str | None = None,
                 timeout: float = 20.0):
        self.args = args
        super().__init__([sys.executable, "-m", "relay", *args], env=env, cwd=cwd)
        self.wait_ready(timeout, str(args[:2]))


class Emulator(Server):
    def _call(self, method: str, path: str):
        request = urllib.request.Request(self.url + path, method=method)
        with urllib.request.urlopen(request, timeout=10) as response:
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


# --- running a plugin's request hook ----------------------------------------------------


def exchange_for(body: dict, quirks=None, endpoint: str = "messages") -> Exchange:
    """An exchange for ``body`` built as serving builds it: from the skeleton, or from the
    full parse when the body cannot be one."""
    raw = orjson.dumps(body)
    found = skeleton.decode(raw)
    kind = {"skeleton": found} if found is not None else {"body": body}
    return Exchange(endpoint=endpoint, method="POST", path="/v1/messages", query="", headers={},
                    raw_body=raw, backend=Backend(name="b", url="http://x", models=["*"],
                                                  quirks=quirks or {}), **kind)


def rejection(hook, body: dict, options=None) -> str:
    """The message of the 400 ``hook`` (a plugin's relay_request) refuses ``body`` with."""
    with pytest.raises(RelayError) as caught:
        hook(exchange_for(body), options or {})
    assert caught.value.status == 400 and caught.value.type == "invalid_request_error"
    return caught.value.message


def passes(hook, body: dict, options=None) -> Exchange:
    """Run ``hook`` on ``body``, which it must leave alone: the client's bytes go up."""
    exchange = exchange_for(body)
    hook(exchange, options or {})
    assert not exchange.changed and exchange.repairs == 0
    assert exchange.upstream_body() == orjson.dumps(body)
    return exchange


# --- building message histories ---------------------------------------------------------


def request(*messages, **extra) -> dict:
    return {"model": "claude-test", "max_tokens": 100, "messages": list(messages), **extra}


def user(*blocks) -> dict:
    return {"role": "user", "content": list(blocks)}


def assistant(*blocks) -> dict:
    return {"role": "assistant", "content": list(blocks)}


def text(value: str = "ok") -> dict:
    return {"type": "text", "text": value}


def use(id, name: str = "Bash") -> dict:
    return {"type": "tool_use", "id": id, "name": name, "input": {"command": "ls"}}


def result(id, content="done") -> dict:
    return {"type": "tool_result", "tool_use_id": id, "content": content}
