"""Fixtures that start the emulator and the relay as subprocesses (see support.py), and the
tiers: a test that starts a process is ``slow`` (or ``e2e``); the rest is the fast tier that
``make check`` runs (``-m "not e2e and not slow"``)."""

from __future__ import annotations

import contextlib
import os
import subprocess

import pytest
from support import Emulator, RedisServer, Relay, Server

# Asking for one of these is starting a process: such a test is slow without saying so.
PROCESS_FIXTURES = frozenset({"emulator", "relay", "redis_server"})
PROCESS_TIERS = ("slow", "e2e")


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items):
    for item in items:
        if PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@contextlib.contextmanager
def no_processes(nodeid: str):
    """Starting a process (``subprocess`` and all built on it, ``os.fork``) fails, naming the
    test, so that the fast tier cannot grow a process unseen."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"{nodeid} starts a process outside the slow tier: mark it "
                             f"@pytest.mark.slow (or e2e), see docs/development.md")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "__init__", refuse)
        patch.setattr(os, "fork", refuse)
        yield


# Around setup, call and teardown, so a module-wide fixture that starts a server for an
# unmarked test is caught as well.
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if any(item.get_closest_marker(tier) for tier in PROCESS_TIERS):
        yield
        return
    with no_processes(item.nodeid):
        yield


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


@pytest.fixture
def redis_server(tmp_path):
    """A redis-server of the test's own (see support.RedisServer), stopped after."""
    server = RedisServer(tmp_path)
    yield server
    server.stop()
