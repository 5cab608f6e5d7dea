"""The limits plugin through a real relay (in process, in front of the strict emulator): each
limit refused at the right request with the right headers and retry-after, budgets crossed by
an answer in flight, concurrency slots given back on every exit, the state unreachable."""

from __future__ import annotations

import asyncio
import math
import time

import aiohttp
import pytest
from support import request, text, user

from relay import config as config_module
from relay import limits
from relay.chain import Chain, load_plugins
from relay.errors import ConfigError
from relay.hookspecs import hookimpl
from relay.server import create_app
from relay.state import Unavailable
from relay.state.memory import MemoryState
from relay.testing import emulator
from relay.testing.fixtures import received

KEYS = {"KEY_A": "a-key-" + "a" * 20, "KEY_B": "b-key-" + "b" * 20}
# What every answer reports (the emulator is told), and what it costs at the prices below:
# 1000 input tokens at $3 per million, 100 output at $15, 1000 cache reads at $0.30 and 400
# five-minute cache writes at $3.75: 3000 + 1500 + 300 + 1500 micro-dollars.
USAGE = "input=1000,output=100,cache_read=1000,cache_write_5m=400"
COST = 6300
FRESH_INPUT = 1400  # what counts toward input tokens per minute: no cache reads
PRICES = [{"models": ["*"], "usd_per_mtok": {"input": 3, "output": 15, "cache_write_5m": 3.75,
                                               "cache_write_1h": 6, "cache_read": 0.3}}]


def auth(a: dict | None = None, b: dict | None = None, default: dict | None = None) -> dict:
    section: dict = {"keys": [{"name": "team-a", "key_env": "KEY_A", "limits": a},
                              {"name": "team-b", "key_env": "KEY_B", "limits": b}]}
    if default is not None:
        section["default_limits"] = default
    return section


async def start(aiohttp_client, aiohttp_server, server_auth: dict, *, state=None,
                pipeline=("limits", "usage"), extra=None, **emulator_options):
    upstream = await aiohttp_server(emulator.create_app(
        emulator.EmulatorOptions(**emulator_options)))
    raw = {"pipeline": list(pipeline), "server": {"auth": server_auth},
           "plugins": {"usage": {"prices": PRICES}},
           "backends": [{"name": "emulator", "url": str(upstream.make_url("")).rstrip("/"),
                         "models": ["*"]}]}
    config = config_module.parse(raw, KEYS)
    chain = Chain(load_plugins(config.pipeline, extra=extra), config)
    chain.state = state
    await chain.startup(config)
    client = await aiohttp_client(create_app(config, chain))
    client.chain, client.config, client.upstream = chain, config, upstream
    return client


def headers(key: str = "KEY_A") -> dict:
    return {"x-api-key": KEYS[key], "x-emulator-usage": USAGE}


async def post(client, key="KEY_A", model="claude-test", **extra):
    resp = await client.post("/v1/messages", json=request(user(text("hi")), model=model, **extra),
                             headers=headers(key))
    body = await resp.json()
    return resp, body


def same_minute(seconds: float = 10.0) -> None:
    """Wait out the end of the minute when fewer than ``seconds`` are left of it: the
    per-minute windows are fixed, and a test's requests must fall in one."""
    left = 60 - time.time() % 60
    if left < seconds:
        time.sleep(left + 0.05)


async def test_requests_per_minute_per_key(aiohttp_client, aiohttp_server):
    same_minute()
    client = await start(aiohttp_client, aiohttp_server,
                         auth({"requests_per_minute": 2}, {"requests_per_minute": 3}))
    seen = []
    for _ in range(2):
        resp, _body = await post(client)
        assert resp.status == 200
        seen.append(resp.headers)
    # The key's own quota, in place of the emulator's (the pooled account's) 4000.
    assert [h["anthropic-ratelimit-requests-limit"] for h in seen] == ["2", "2"]
    assert [h["anthropic-ratelimit-requests-remaining"] for h in seen] == ["1", "0"]
    reset = seen[0]["anthropic-ratelimit-requests-reset"]
    assert reset == limits.rfc3339(int(time.time()) // 60 * 60 + 60)
    assert "anthropic-ratelimit-unified-status" not in seen[0]

    resp, body = await post(client)
    assert resp.status == 429
    assert body["error"]["type"] == "rate_limit_error"
    assert "requests_per_minute" in body["error"]["message"]
    assert "team-a" in body["error"]["message"]
    retry = int(resp.headers["retry-after"])
    assert 1 <= retry <= 60
    assert retry == math.ceil(60 - time.time() % 60) or retry == math.ceil(
        60 - time.time() % 60) + 1
    assert resp.headers["anthropic-ratelimit-requests-remaining"] == "0"
    assert "x-should-retry" not in resp.headers
    assert len(received(client)) == 2  # nothing went up for the refusal

    # The other key has its own.
    for remaining in ("2", "1", "0"):
        resp, _ = await post(client, "KEY_B")
        assert resp.status == 200
        assert resp.headers["anthropic-ratelimit-requests-remaining"] == remaining
    assert (await post(client, "KEY_B"))[0].status == 429
    await client.chain.shutdown(client.config)


async def test_token_limits_count_the_answers(aiohttp_client, aiohttp_server):
    same_minute()
    client = await start(aiohttp_client, aiohttp_server,
                         auth({"input_tokens_per_minute": FRESH_INPUT + 100},
                              {"output_tokens_per_minute": 1}))
    resp, body = await post(client)
    assert resp.status == 200 and body["usage"]["cache_read_input_tokens"] == 1000
    assert resp.headers["anthropic-ratelimit-input-tokens-limit"] == "1500"
    assert resp.headers["anthropic-ratelimit-input-tokens-remaining"] == "1500"
    assert "anthropic-ratelimit-requests-limit" not in resp.headers  # no such limit: not sent
    # Fresh input and cache writes counted, cache reads not: 100 left, still under.
    resp, body = await post(client)
    assert resp.status == 200
    assert resp.headers["anthropic-ratelimit-input-tokens-remaining"] == "100"
    resp, body = await post(client)
    assert resp.status == 429 and "input_tokens_per_minute" in body["error"]["message"]
    assert resp.headers["anthropic-ratelimit-input-tokens-remaining"] == "0"
    assert 1 <= int(resp.headers["retry-after"]) <= 60

    resp, body = await post(client, "KEY_B")
    assert resp.status == 200
    resp, body = await post(client, "KEY_B")
    assert resp.status == 429 and "output_tokens_per_minute" in body["error"]["message"]
    assert resp.headers["anthropic-ratelimit-output-tokens-limit"] == "1"
    await client.chain.shutdown(client.config)


def day_end() -> int:
    return int(time.time()) // 86400 * 86400 + 86400


async def test_budget_warns_then_refuses(aiohttp_client, aiohttp_server):
    # A budget the first answer fills to 80%: the second answer warns, and crosses it.
    budget = {"budget": {"usd": COST / 0.8 / 1e6, "per": "day"}}
    client = await start(aiohttp_client, aiohttp_server, auth(budget))
    resp, _ = await post(client)
    assert resp.status == 200
    assert resp.headers["anthropic-ratelimit-unified-status"] == "allowed"
    assert resp.headers["anthropic-ratelimit-unified-overage-utilization"] == "0.00"
    assert resp.headers["anthropic-ratelimit-unified-representative-claim"] == "overage"
    assert resp.headers["anthropic-ratelimit-unified-reset"] == str(day_end())
    assert "anthropic-ratelimit-unified-overage-surpassed-threshold" not in resp.headers
    resp, _ = await post(client)
    assert resp.status == 200
    assert resp.headers["anthropic-ratelimit-unified-status"] == "allowed_warning"
    assert resp.headers["anthropic-ratelimit-unified-overage-status"] == "allowed_warning"
    assert resp.headers["anthropic-ratelimit-unified-overage-utilization"] == "0.80"
    assert resp.headers["anthropic-ratelimit-unified-overage-surpassed-threshold"] == "0.75"
    # Crossed by that answer: the next is refused, in the shape Claude Code reads.
    resp, body = await post(client)
    assert resp.status == 429
    assert body["error"]["type"] == "billing_error"
    assert "daily budget" in body["error"]["message"] and "resets" in body["error"]["message"]
    assert resp.headers["x-should-retry"] == "false"
    assert resp.headers["anthropic-ratelimit-unified-status"] == "rejected"
    assert resp.headers["anthropic-ratelimit-unified-overage-period"] == "daily"
    assert resp.headers["anthropic-ratelimit-unified-reset"] == str(day_end())
    assert "anthropic-ratelimit-unified-representative-claim" not in resp.headers
    assert abs(int(resp.headers["retry-after"]) - (day_end() - time.time())) <= 2
    # Another key is not under it.
    assert (await post(client, "KEY_B"))[0].status == 200
    await client.chain.shutdown(client.config)


async def test_budget_crossed_mid_stream_lets_the_stream_finish(aiohttp_client, aiohttp_server):
    # One micro-dollar: the first stream's answer crosses it while it streams.
    client = await start(aiohttp_client, aiohttp_server,
                         auth({"budget": {"usd": 0.000001, "per": "week"}}))
    resp = await client.post("/v1/messages", json=request(user(text("hi")), stream=True),
                             headers=headers())
    assert resp.status == 200
    assert resp.headers["anthropic-ratelimit-unified-status"] == "allowed"
    streamed = await resp.read()
    assert b"event: message_stop" in streamed and b"event: error" not in streamed
    resp, body = await post(client, stream=True)
    assert resp.status == 429 and body["error"]["type"] == "billing_error"
    assert resp.headers["anthropic-ratelimit-unified-overage-period"] == "weekly"
    await client.chain.shutdown(client.config)


async def test_model_pattern_limits_stand_beside_the_keys(aiohttp_client, aiohttp_server):
    same_minute()
    client = await start(aiohttp_client, aiohttp_server, auth(
        default={"requests_per_minute": 5, "models": {"claude-opus-*": {"requests_per_minute": 1}}}))
    assert (await post(client, model="claude-opus-9"))[0].status == 200
    resp, body = await post(client, model="claude-opus-9")
    assert resp.status == 429 and "claude-opus-*" in body["error"]["message"]
    resp, _ = await post(client, model="claude-sonnet-9")
    assert resp.status == 200
    # The key-wide limit counted both granted requests.
    assert resp.headers["anthropic-ratelimit-requests-remaining"] == "3"
    await client.chain.shutdown(client.config)


async def test_a_weekly_budget_for_one_model_pattern_leaves_the_others_open(aiohttp_client,
                                                                             aiohttp_server):
    """The weekly Opus cap operators ask for: two answers' worth of Opus a week, spent;
    the next Opus request is refused, naming the pattern, while Sonnet still goes through."""
    client = await start(aiohttp_client, aiohttp_server, auth({"models": {
        "claude-opus-*": {"budget": {"usd": 2 * COST / 1e6, "per": "week"}}}}))
    for _ in range(2):
        assert (await post(client, model="claude-opus-4-1"))[0].status == 200
    resp, body = await post(client, model="claude-opus-4-1")
    assert resp.status == 429 and body["error"]["type"] == "billing_error"
    assert "claude-opus-*" in body["error"]["message"], body
    assert resp.headers["anthropic-ratelimit-unified-overage-period"] == "weekly"
    assert int(resp.headers["retry-after"]) > 0
    assert (await post(client, model="claude-opus-4-5"))[0].status == 429  # any Opus
    resp, _ = await post(client, model="claude-sonnet-4-5")
    assert resp.status == 200
    assert (await post(client, "KEY_B", model="claude-opus-4-1"))[0].status == 200
    await client.chain.shutdown(client.config)


async def concurrent_posts(client, n: int, key="KEY_A") -> list[int]:
    async def one():
        resp, body = await post(client, key)
        if resp.status == 429:
            assert resp.headers["retry-after"] == "1"
            assert "(concurrent)" in body["error"]["message"], body
            assert body["error"]["type"] == "rate_limit_error"
        return resp.status
    return list(await asyncio.gather(*(one() for _ in range(n))))


async def test_concurrency_and_slots_given_back_after_failures(aiohttp_client, aiohttp_server):
    client = await start(aiohttp_client, aiohttp_server, auth({"concurrent": 2}), delay_ms=300)
    statuses = await concurrent_posts(client, 3)
    assert sorted(statuses) == [200, 200, 429]
    assert await concurrent_posts(client, 2) == [200, 200]
    await client.chain.shutdown(client.config)

    # A hundred upstream failures, then the whole concurrency is there again.
    client = await start(aiohttp_client, aiohttp_server, auth({"concurrent": 3}),
                         fail_status=500)
    for _ in range(100):
        assert (await post(client))[0].status == 500
    state = client.chain.state
    slot = limits.counter_name("team-a", limits.Rule(), "slots")
    assert not state._held(slot, time.time())
    await client.chain.shutdown(client.config)


async def test_slots_given_back_after_disconnects(aiohttp_client, aiohttp_server):
    client = await start(aiohttp_client, aiohttp_server, auth({"concurrent": 3}),
                         stall_after=2, stall_ms=10_000)
    state = client.chain.state
    slot = limits.counter_name("team-a", limits.Rule(), "slots")
    for _ in range(100):
        resp = await client.post("/v1/messages", json=request(user(text("hi")), stream=True),
                                 headers=headers())
        assert resp.status == 200
        await resp.content.readany()
        resp.close()  # the client goes away mid-stream
    for _ in range(100):
        if not state._held(slot, time.time()):
            break
        await asyncio.sleep(0.02)
    assert not state._held(slot, time.time())
    # And the full concurrency serves again.
    statuses = await asyncio.gather(*(client.post(
        "/v1/messages", json=request(user(text("hi")), stream=True), headers=headers())
        for _ in range(3)))
    assert [r.status for r in statuses] == [200, 200, 200]
    for r in statuses:
        r.close()
    await client.chain.shutdown(client.config)


class Crash:
    """A plugin after limits that fails in relay_request: ``boom`` with an exception,
    ``cancel`` by cancelling the request's own task (a handler that dies before its exchange
    is made), by the request's ``metadata.user_id``."""

    @hookimpl
    async def relay_request(self, exchange):
        how = (exchange.body.get("metadata") or {}).get("user_id")
        if how == "boom":
            raise RuntimeError("boom")
        if how == "cancel":
            asyncio.current_task().cancel()
            await asyncio.sleep(0)


async def test_slots_given_back_when_the_handler_fails(aiohttp_client, aiohttp_server):
    client = await start(aiohttp_client, aiohttp_server, auth({"concurrent": 1}),
                         pipeline=("limits", "usage", "crash"), extra={"crash": Crash()})
    state = client.chain.state
    slot = limits.counter_name("team-a", limits.Rule(), "slots")
    resp, body = await post(client, metadata={"user_id": "boom"})
    assert resp.status == 500
    assert not state._held(slot, time.time())
    for _ in range(3):
        with pytest.raises(aiohttp.ClientError):
            await post(client, metadata={"user_id": "cancel"})
        for _ in range(50):
            if not state._held(slot, time.time()):
                break
            await asyncio.sleep(0.01)
        assert not state._held(slot, time.time())
    assert (await post(client))[0].status == 200
    await client.chain.shutdown(client.config)


class Unreachable(MemoryState):
    async def take(self, counters, slots=(), now=None):
        raise Unavailable("no answer within 0.25 s")


async def test_state_unreachable_open_and_closed(aiohttp_client, aiohttp_server, caplog):
    state = Unreachable()
    client = await start(aiohttp_client, aiohttp_server, auth({"requests_per_minute": 1}),
                         state=state)
    for _ in range(3):
        assert (await post(client))[0].status == 200
    assert client.chain.pm.get_plugin("limits").unavailable == 3
    assert "state is unreachable" in caplog.text
    await client.chain.shutdown(client.config)

    state = Unreachable()
    state.on_unavailable = "closed"
    client = await start(aiohttp_client, aiohttp_server, auth({"requests_per_minute": 1}),
                         state=state)
    resp, body = await post(client)
    assert resp.status == 503 and body["type"] == "error"
    assert "state.on_unavailable" in body["error"]["message"]
    # A key without limits needs no state.
    assert (await post(client, "KEY_B"))[0].status == 200
    await client.chain.shutdown(client.config)


class Ended:
    """Keeps every finished exchange."""

    def __init__(self):
        self.exchanges = []

    @hookimpl
    def relay_exchange_end(self, exchange):
        self.exchanges.append(exchange)


async def test_streams_carry_the_keys_headers(aiohttp_client, aiohttp_server):
    same_minute()
    ended = Ended()
    client = await start(aiohttp_client, aiohttp_server, auth({"requests_per_minute": 7}),
                         pipeline=("limits", "usage", "ended"), extra={"ended": ended})
    resp = await client.post("/v1/messages", json=request(user(text("hi")), stream=True),
                             headers=headers())
    await resp.read()
    assert resp.headers["anthropic-ratelimit-requests-limit"] == "7"
    assert resp.headers["anthropic-ratelimit-requests-remaining"] == "6"
    # The upstream's (the pooled account's) stay in the record.
    assert ended.exchanges[-1].replaced_headers == {
        "anthropic-ratelimit-requests-limit": "4000",
        "anthropic-ratelimit-requests-remaining": "3999"}
    # A key without limits sees none of the pooled account's.
    resp = await client.post("/v1/messages", json=request(user(text("hi")), stream=True),
                             headers=headers("KEY_B"))
    await resp.read()
    assert not [name for name in resp.headers if name.lower().startswith("anthropic-ratelimit")]
    await client.chain.shutdown(client.config)


def test_limits_are_checked_at_load_with_their_paths():
    def load(limits_section):
        return config_module.parse(
            {"server": {"auth": {"keys": [{"name": "a", "key_env": "KEY_A",
                                           "limits": limits_section}]}},
             "backends": [{"name": "b", "url": "http://127.0.0.1:1"}]}, KEYS)

    for section, wanted in [
        ({"requests_per_minut": 3}, "server.auth.keys[0].limits.requests_per_minut: unknown "
                                    "limit (did you mean requests_per_minute?)"),
        ({"concurrent": 0}, "server.auth.keys[0].limits.concurrent: must be a whole number"),
        ({"budget": {"usd": 5, "per": "year"}}, "limits.budget.per: must be one of day, week"),
        ({"budget": {"usd": -1, "per": "day"}}, "limits.budget.usd: must be a positive"),
        ({"models": {"claude-opus-*": {"models": {}}}}, "limits.models.claude-opus-*.models: "
                                                       "unknown limit"),
        ({"models": ["claude-opus-*"]}, "limits.models: must be a mapping"),
    ]:
        with pytest.raises(ConfigError) as caught:
            load(section)
        assert wanted in str(caught.value)


def test_a_keys_limits_overlay_the_defaults():
    own = {"requests_per_minute": None, "concurrent": 2,
           "models": {"claude-opus-*": {"budget": {"usd": 1, "per": "day"}}}}
    default = {"requests_per_minute": 10, "output_tokens_per_minute": 100,
               "models": {"claude-opus-*": {"requests_per_minute": 2}}}
    found = limits.effective(default, own)
    assert found is not None
    key, opus = found.rules
    assert (key.requests_per_minute, key.output_tokens_per_minute, key.concurrent) == (None, 100, 2)
    assert (opus.requests_per_minute, opus.budget_micro_usd, opus.budget_per) == (2, 1_000_000, "day")
    assert found.applying("claude-opus-4") == (key, opus)
    assert found.applying("claude-haiku-4") == (key,)
    assert limits.effective(None, {"requests_per_minute": None}) is None


@pytest.mark.parametrize("concurrent", [1, None])
async def test_a_fallback_is_the_same_request(aiohttp_client, aiohttp_server, concurrent):
    """A request its first backend fails and a fallback answers counts once, holds one slot
    and gives it back once."""
    same_minute()
    failing = await aiohttp_server(emulator.create_app(emulator.EmulatorOptions(fail_status=529)))
    working = await aiohttp_server(emulator.create_app(emulator.EmulatorOptions()))
    url = lambda server: str(server.make_url("")).rstrip("/")  # noqa: E731
    raw = {"pipeline": ["limits", "usage"], "plugins": {"usage": {"prices": PRICES}},
           "server": {"auth": auth({"requests_per_minute": 3, "concurrent": concurrent})},
           "backends": [{"name": "first", "url": url(failing), "models": ["*"],
                         "fallbacks": ["second"]},
                        {"name": "second", "url": url(working), "models": []}]}
    config = config_module.parse(raw, KEYS)
    chain = Chain(load_plugins(config.pipeline), config)
    await chain.startup(config)
    client = await aiohttp_client(create_app(config, chain))
    for remaining in ("2", "1"):
        resp, body = await post(client)
        assert resp.status == 200, body
        assert resp.headers["anthropic-ratelimit-requests-remaining"] == remaining
    slot = limits.counter_name("team-a", limits.Rule(), "slots")
    assert not chain.state._held(slot, time.time())
    await chain.shutdown(config)


@pytest.mark.parametrize("pipeline, limits_of_a, default, warned", [
    (["usage"], {"requests_per_minute": 5}, None, "the limits plugin is not in the pipeline"),
    (["usage"], None, {"concurrent": 2}, "the limits plugin is not in the pipeline"),
    (["limits"], {"budget": {"usd": 5, "per": "day"}}, None,
     "a relay key's budget counts what answers used"),
    (["limits"], None, {"models": {"claude-opus-*": {"output_tokens_per_minute": 9}}},
     "a relay key's output_tokens_per_minute counts what answers used"),
    (["limits"], {"requests_per_minute": 5, "concurrent": 1}, None, None),
    (["limits", "usage"], {"budget": {"usd": 5, "per": "day"}}, None, None),
    ([], None, None, None),
])
def test_limits_the_pipeline_would_not_keep_are_said_at_start_up(
        caplog, pipeline, limits_of_a, default, warned):
    from relay import cli
    config = config_module.parse({"pipeline": pipeline, "server": {"auth": auth(
        limits_of_a, default=default)}, "backends": [{"name": "e", "url": "http://127.0.0.1:1",
                                                     "models": ["*"]}]}, KEYS)
    unguarded = config_module.parse({"pipeline": pipeline, "backends": [
        {"name": "e", "url": "http://127.0.0.1:1", "models": ["*"]}]}, KEYS)
    with caplog.at_level("WARNING", logger="relay"):
        cli.warn_if_unenforced(unguarded)  # no inbound keys: nothing to say
        cli.warn_if_unenforced(config)
    messages = [r.getMessage() for r in caplog.records]
    if warned is None:
        assert messages == []
    else:
        assert len(messages) == 1 and warned in messages[0]


async def test_a_model_pattern_limits_the_renamed_model(aiohttp_client, aiohttp_server):
    """A pattern's limit is the model's as sent upstream, after the backend's rename
    (docs/accounting.md): a client's alias for Opus is under the Opus limit, and an alias
    that matches the pattern but goes up as another model is not."""
    same_minute()
    upstream = await aiohttp_server(emulator.create_app(emulator.EmulatorOptions()))
    raw = {"pipeline": ["limits", "usage"], "plugins": {"usage": {"prices": PRICES}},
           "server": {"auth": auth(default={"models": {
               "claude-opus-*": {"requests_per_minute": 1}}})},
           "backends": [{"name": "emulator", "url": str(upstream.make_url("")).rstrip("/"),
                         "models": ["*"], "rename": {"fast": "claude-opus-4-1",
                                                     "claude-opus-alias": "claude-haiku-4-5"}}]}
    config = config_module.parse(raw, KEYS)
    chain = Chain(load_plugins(config.pipeline), config)
    await chain.startup(config)
    client = await aiohttp_client(create_app(config, chain))
    assert (await post(client, model="fast"))[0].status == 200
    resp, body = await post(client, model="fast")
    assert resp.status == 429, body
    assert "claude-opus-*" in body["error"]["message"]
    # Sent up as Haiku: not under the Opus limit, whatever the client called it.
    for _ in range(2):
        assert (await post(client, model="claude-opus-alias"))[0].status == 200
    await chain.shutdown(config)
