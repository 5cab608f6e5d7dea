"""pytest fixtures for plugin tests: load them with one line in a ``conftest.py``,
``pytest_plugins = ["relay.testing.fixtures"]`` (they need pytest-aiohttp).

``relay_client`` starts a whole relay in process in front of the strict emulator
(:mod:`relay.testing.emulator`, which refuses what the real API refuses) and returns an
aiohttp test client for it::

    async def test_my_plugin(relay_client):
        client = await relay_client(pipeline=["dedup", "my_plugin"],
                                    plugins={"my_plugin": {"word": "hi"}}, tool_turns=1)
        resp = await client.post("/v1/messages", json=request(user(text("go"))))
        assert resp.status == 200
        assert received(client)[0]["model"] == "claude-test"

Plugins are found by their entry points, as in serving; ``extra`` registers plugin objects by
name without one. Keyword arguments the relay does not take are emulator options
(``relay emulate --help``: ``tool_turns``, ``reuse_ids``, ``fail_status``, ...).
"""

from __future__ import annotations

import orjson
import pytest_asyncio

from relay import config as config_module
from relay.chain import Chain, load_plugins
from relay.server import create_app
from relay.testing import emulator


def received(client) -> list[dict]:
    """The request bodies the emulator behind ``client`` received, parsed, oldest first."""
    return [orjson.loads(raw) for *_, raw in client.upstream.app[emulator.STATE].records]


def received_headers(client) -> list[dict]:
    """The headers of each request the emulator behind ``client`` received (names lower
    case), oldest first."""
    return [{name.decode("latin-1").lower(): value.decode("latin-1") for name, value in headers}
            for *_, headers, _ in client.upstream.app[emulator.STATE].records]


async def start_relay(aiohttp_client, raw_config: dict, extra: dict | None = None,
                      env: dict | None = None):
    """A relay made from a whole relay.yaml document (``raw_config``, as a dict), started as
    serving starts one (plugins found by entry point or given in ``extra``, ``relay_startup``
    run), behind an aiohttp test client; ``client.chain`` and ``client.config`` are its own.
    Call ``client.chain.shutdown(client.config)`` when done, as serving does on stop."""
    config = config_module.parse(raw_config, env or {})
    chain = Chain(load_plugins(config.pipeline, extra=extra), config)
    await chain.startup(config)
    client = await aiohttp_client(create_app(config, chain))
    client.chain, client.config = chain, config
    return client


@pytest_asyncio.fixture
async def relay_client(aiohttp_client, aiohttp_server):
    started = []

    async def start(pipeline=(), plugins=None, *, extra=None, quirks=None, server=None,
                    backend=None, env=None, upstream=None, **emulator_options):
        if upstream is None:
            options = emulator.EmulatorOptions(**emulator_options)
            upstream = await aiohttp_server(emulator.create_app(options))
        raw = {"pipeline": list(pipeline), "plugins": plugins or {}, "server": server or {},
               "backends": [{"name": "emulator", "url": str(upstream.make_url("")).rstrip("/"),
                             "models": ["*"], "quirks": quirks or {}, **(backend or {})}]}
        client = await start_relay(aiohttp_client, raw, extra, env)
        client.upstream = upstream
        started.append(client)
        return client

    yield start
    for client in started:
        await client.close()
        await client.chain.shutdown(client.config)
