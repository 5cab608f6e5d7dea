"""The relay's own keys (relay.keys): stored as hashes, made, changed and revoked while a relay
serves, which sees each change within seconds without dropping a request in flight."""

from __future__ import annotations

import asyncio
import hashlib
import time

import pytest
from support import request, text, user

from relay import config as config_module
from relay import keys
from relay.chain import Chain, load_plugins
from relay.errors import ConfigError
from relay.server import create_app
from relay.state.memory import MemoryState
from relay.testing import emulator

YAML_KEY = "yaml-key-" + "y" * 20


async def test_keys_are_stored_as_hashes_and_listed_without_them():
    state = MemoryState()
    secret = await keys.create_key(state, "team-c", {"requests_per_minute": 5},
                                   expires="2099-01-31")
    assert secret.startswith(keys.PREFIX) and len(secret) > 40
    _, records = await state.keys()
    assert records[0]["hash"] == hashlib.sha256(secret.encode()).hexdigest()
    assert secret not in repr(records)
    listed = await keys.list_keys(state)
    assert listed == [{"name": "team-c", "created": listed[0]["created"],
                       "expires": 4073500800.0, "revoked": None,
                       "limits": {"requests_per_minute": 5}}]
    with pytest.raises(ValueError, match="exists"):
        await keys.create_key(state, "team-c")
    await keys.set_limits(state, "team-c", {"concurrent": 2})
    assert (await keys.list_keys(state))[0]["limits"] == {"concurrent": 2}
    await keys.revoke_key(state, "team-c")
    assert (await keys.list_keys(state))[0]["revoked"] is not None
    again = await keys.create_key(state, "team-c")  # a revoked key's name is free again
    assert again != secret
    with pytest.raises(LookupError):
        await keys.revoke_key(state, "nobody")
    with pytest.raises(ConfigError, match="limits.requests_per_minut: unknown limit"):
        await keys.create_key(state, "team-d", {"requests_per_minut": 5})
    with pytest.raises(ValueError, match="key name"):
        await keys.create_key(state, "no spaces")
    with pytest.raises(ValueError, match="ISO 8601"):
        await keys.create_key(state, "team-e", expires="next tuesday")


async def start(aiohttp_client, aiohttp_server, state, **emulator_options):
    upstream = await aiohttp_server(emulator.create_app(
        emulator.EmulatorOptions(**emulator_options)))
    raw = {"pipeline": ["limits"],
           "server": {"auth": {"keys": [{"name": "team-a", "key_env": "KEY_A"}],
                               "default_limits": {"requests_per_minute": 100}}},
           "backends": [{"name": "emulator", "url": str(upstream.make_url("")).rstrip("/"),
                         "models": ["*"]}]}
    config = config_module.parse(raw, {"KEY_A": YAML_KEY})
    chain = Chain(load_plugins(config.pipeline), config)
    chain.state = state
    await chain.startup(config)
    client = await aiohttp_client(create_app(config, chain))
    client.chain, client.config = chain, config
    return client


async def status(client, key: str) -> int:
    resp = await client.post("/v1/messages", json=request(user(text("hi"))),
                             headers={"x-api-key": key})
    await resp.read()
    return resp.status


async def until(client, key: str, wanted: int, seconds: float = 4.0) -> float:
    """Seconds until a request with ``key`` gets ``wanted``."""
    started = time.monotonic()
    while await status(client, key) != wanted:
        assert time.monotonic() - started < seconds, f"still not {wanted} after {seconds} s"
        await asyncio.sleep(0.1)
    return time.monotonic() - started


async def test_a_serving_relay_sees_keys_change_within_seconds(aiohttp_client, aiohttp_server):
    state = MemoryState()
    early = await keys.create_key(state, "early")
    client = await start(aiohttp_client, aiohttp_server, state, stall_after=2, stall_ms=1500)
    assert await status(client, early) == 200  # loaded before serving
    secret = await keys.create_key(state, "team-new")
    assert await until(client, secret, 200) < 2.5
    assert await status(client, YAML_KEY) == 200  # relay.yaml's keys keep working

    # Its limits: the defaults, then what `set` says, live.
    await keys.set_limits(state, "team-new", {"requests_per_minute": 1})
    await until(client, secret, 429)

    # Revoked while one of its streams is in flight: the stream finishes, the next is 401.
    stream = await client.post("/v1/messages", json=request(user(text("hi")), stream=True),
                               headers={"x-api-key": early})
    assert stream.status == 200
    await keys.revoke_key(state, "early")
    await until(client, early, 401)
    body = await stream.read()
    assert b"event: message_stop" in body and b"event: error" not in body
    resp = await client.post("/v1/messages", json=request(user(text("hi"))),
                             headers={"x-api-key": early})
    assert (await resp.json())["error"]["type"] == "authentication_error"
    assert await status(client, YAML_KEY) == 200
    await client.chain.shutdown(client.config)


async def test_an_expired_key_is_refused(aiohttp_client, aiohttp_server):
    state = MemoryState()
    secret = await keys.create_key(state, "short-lived", expires=time.time() + 1.0)
    client = await start(aiohttp_client, aiohttp_server, state)
    assert await status(client, secret) == 200
    await until(client, secret, 401)
    resp = await client.post("/v1/messages", json=request(user(text("hi"))),
                             headers={"x-api-key": secret})
    body = await resp.json()
    assert body["error"] == {"type": "authentication_error",
                             "message": "this relay key has expired"}
    await client.chain.shutdown(client.config)


async def test_keys_a_redis_restarted_empty_lost_are_refused_and_said_so(redis_server, caplog):
    """A Redis without persistence restarted: the stored keys are gone with it. They are
    refused from then on (the store is what says a key is valid), and the log says why,
    once, rather than leave an operator with 401s and nothing else."""
    from relay.inbound import Gate
    from relay.state import open_state

    state = await open_state({"url": redis_server.url, "timeout": 0.2})
    try:
        await keys.create_key(state, "team-c")
        gate = Gate([])
        watch = keys.Watch(gate, state, None)
        await watch.poll()
        assert len(gate.stored) == 1
        redis_server.stop()
        redis_server.start()
        deadline = time.monotonic() + 10
        while gate.stored:
            assert time.monotonic() < deadline, "still serving the keys Redis lost"
            await asyncio.sleep(0.2)
            await watch.poll()
        lost = [r.getMessage() for r in caplog.records if "lost" in r.getMessage()]
        assert len(lost) == 1 and "1 stored key" in lost[0]
        await watch.poll()
        assert len([r for r in caplog.records if "lost" in r.getMessage()]) == 1
    finally:
        await state.close()


async def test_a_stored_key_may_not_take_a_relay_yaml_name():
    table = keys.stored([{"name": "team-a", "hash": "00" * 32}, {"name": "b", "hash": "11" * 32,
                                                                 "revoked": 1.0}],
                        None, taken={"team-a"})
    assert table == {}
