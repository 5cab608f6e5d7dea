"""Fixtures that start the emulator and the relay as subprocesses (see support.py)."""

from __future__ import annotations

import pytest

from support import Emulator, Relay, Server


@pytest.fixture
def emulator():
    started: list[Server] = []

    def start(*args: str, env: dict | None = None) -> Emulator:
        server = Emulator(["emulate", "--port", "0", *args], env=env)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def relay(tmp_path):
    started: list[Server] = []

    def start(config: dict, env: dict | None = None, args=()) -> Relay:
        server = Relay(config, tmp_path, env=env, args=args)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
