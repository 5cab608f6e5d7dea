"""Upstream pools (relay.pools): several credentials for one backend, a session kept on one of
them, cooldowns and revoked keys, and replicas sharing what they learn through the state."""

from __future__ import annotations

import asyncio
import logging
import time

import orjson
import pytest
from aiohttp import web
from test_server import ANSWER, STREAM, stream_reply
from test_upstream import OPENING_ERROR, Recorder

from relay import cli, limits, pools
from relay import config as config_module
from relay.chain import Chain, load_plugins
from relay.errors import ConfigError
from relay.hookspecs import hookimpl
from relay.limits import plan as limits_plan
from relay.server import STATE, create_app
from relay.state import Counter, Unavailable, open_state
from relay.state.memory import MemoryState
from relay.testing import assistant, emulator, exchange_for, request, text, user

KEYS = {"POOL_A": "sk-ant-pool-key-a-000000000000", "POOL_B": "sk-ant-pool-key-b-111111111111",
        "POOL_C": "sk-ant-pool-key-c-222222222222"}
NAME_OF = {KEYS[f"POOL_{name.upper()}"]: name for name in "abc"}


def credentials(*names, **weights) -> list[dict]:
    return [{"name": name, "key_env": f"POOL_{name.upper()}", "weight": weights.get(name, 1)}
            for name in names]


class Relays:
    """Relays over one upstream, each with its own chain and app, optionally sharing one
    state (replicas)."""

    def __init__(self, aiohttp_client):
        self.aiohttp_client = aiohttp_client
        self.started = []

    async def start(self, upstream_url: str, creds: list[dict], state=None, pool=None,
                    pipeline=("metrics",), plugins=None, more=(), extra=None, **fields):
        recorder = Recorder()
        backend = {"name": "emu", "url": upstream_url, "models": ["*"], "credentials": creds,
                   "pool": pool or {}, **fields}
        config = config_module.parse({"pipeline": [*pipeline, "rec"],
                                      "backends": [backend, *more],
                                      "plugins": plugins or {}}, KEYS)
        chain = Chain(load_plugins(config.pipeline, extra={"rec": recorder, **(extra or {})}),
                      config)
        chain.state = state
        await chain.startup(config)
        client = await self.aiohttp_client(create_app(config, chain))
        client.chain, client.config, client.recorder = chain, config, recorder
        self.started.append(client)
        return client

    async def close(self):
        for client in self.started:
            await client.close()
            await client.chain.shutdown(client.config)


@pytest.fixture
async def relays(aiohttp_client):
    made = Relays(aiohttp_client)
    yield made
    await made.close()


async def emulated(aiohttp_server, **options):
    server = await aiohttp_server(emulator.create_app(emulator.EmulatorOptions(**options)))
    return server, str(server.make_url("")).rstrip("/")


def keys_seen(server) -> list[str]:
    """The credential (by name) each request the emulator received carried, in order."""
    seen = []
    for *_, raw_headers, _ in server.app[emulator.STATE].records:
        headers = {k.decode().lower(): v.decode() for k, v in raw_headers}
        seen.append(NAME_OF.get(headers.get("x-api-key"), headers.get("x-api-key")))
    return seen


async def converse(client, turns: int, session: str | None = None, first: str = "start"):
    """A conversation of ``turns`` requests, each answered and appended to the history;
    returns the statuses the client saw."""
    messages = [user(text(first))]
    headers = {"x-claude-code-session-id": session} if session else {}
    statuses = []
    for turn in range(turns):
        resp = await client.post("/v1/messages", json=request(*messages), headers=headers)
        statuses.append(resp.status)
        answer = await resp.json()
        if resp.status != 200:
            break
        messages += [assistant(*answer["content"]), user(text(f"turn {turn + 1}"))]
    return statuses


def noted(client, action: str) -> list[dict]:
    return [entry for exchange in client.recorder.ended
            for entry in exchange.noted("relay", action)]


async def metric(client, name: str, **labels) -> float:
    body = (await (await client.get("/metrics")).text()).splitlines()
    total = 0.0
    for line in body:
        if not line.startswith(name + "{"):
            continue
        if all(f'{key}="{value}"' in line for key, value in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


# --- config -----------------------------------------------------------------------------------


def test_credentials_are_named_keys_from_the_environment_and_never_in_the_config():
    config = config_module.parse({"backends": [{
        "name": "p", "url": "http://127.0.0.1:1",
        "credentials": credentials("a", "b", b=3) + [{"name": "c", "key_env": "POOL_C",
                                                      "limits": {"requests_per_minute": 10}}],
        "pool": {"max_cooldown": 60}}]}, KEYS)
    backend = config.backends[0]
    assert [(c.name, c.weight) for c in backend.credentials] == [("a", 1), ("b", 3), ("c", 1)]
    assert backend.credentials[2].limits == {"requests_per_minute": 10}
    assert backend.pool.max_cooldown == 60 and backend.pool.refresh == 1.0
    assert set(backend.secrets) == {key.encode() for key in KEYS.values()}
    assert all(key not in repr(backend) for key in KEYS.values())
    assert config_module.parse({"backends": [{"name": "p", "url": "http://127.0.0.1:1"}]}
                               ).backends[0].credentials == []


@pytest.mark.parametrize("entry, message", [
    ({"api_key_env": "POOL_A", "credentials": credentials("a")},
     "backends[0]: give api_key_env (one key) or credentials (a pool), not both"),
    ({"credentials": []}, "backends[0].credentials: at least one credential (or leave it out)"),
    ({"credentials": credentials("a", "a")}, "backends[0].credentials[1].name: 'a' is used twice"),
    ({"credentials": [{"name": "a", "key_env": "POOL_A", "weight": 0}]},
     "backends[0].credentials[0].weight: must be a positive number"),
    ({"credentials": [{"name": "a"}]},
     "backends[0].credentials[0]: give exactly one of key_env or key_file (a key is never "
     "written in relay.yaml)"),
    ({"credentials": [{"name": "a", "key_env": "MISSING"}]},
     "backends[0].credentials[0].key_env: environment variable MISSING is not set"),
    ({"credentials": [{"name": "a", "key_env": "POOL_A"}, {"name": "b", "key_env": "POOL_A"}]},
     "backends[0].credentials[1]: the same key as another credential of this backend"),
    ({"credentials": credentials("a"), "pool": {"cooldown": 3}},
     "backends[0].pool.cooldown: unknown key"),
])
def test_a_wrong_pool_is_refused_naming_its_key(entry, message):
    with pytest.raises(ConfigError) as error:
        config_module.parse({"backends": [{"name": "p", "url": "http://127.0.0.1:1", **entry}]},
                            KEYS)
    assert str(error.value).startswith(message)


def test_a_pool_is_an_operator_key_beyond_loopback():
    config = config_module.parse({"backends": [{"name": "p", "url": "http://127.0.0.1:1",
                                                "credentials": credentials("a")}]}, KEYS)
    with pytest.raises(ConfigError, match="backends p put the operator's key"):
        config_module.check_exposure(config, "0.0.0.0")


# --- choosing ---------------------------------------------------------------------------------


def test_cooldowns_follow_retry_after_then_the_exhausted_limits_reset_capped():
    options = config_module.PoolOptions(max_cooldown=100, default_cooldown=7)
    now = 1_800_000_000.0
    assert pools.cooldown({"retry-after": "12"}, options, now) == 12
    assert pools.cooldown({"retry-after": "1000"}, options, now) == 100
    reset = "2027-01-15T08:00:30Z"  # now + 30 s
    exhausted = {"anthropic-ratelimit-tokens-remaining": "0",
                 "anthropic-ratelimit-tokens-reset": reset,
                 "anthropic-ratelimit-requests-remaining": "5",
                 "anthropic-ratelimit-requests-reset": "2027-01-15T08:00:50Z"}
    assert pools.cooldown(exhausted, options, now) == 30  # only the limit that is used up
    assert pools.cooldown({}, options, now) == 7


def test_new_sessions_go_where_least_is_in_flight_for_the_weight():
    weights = {"a": 1.0, "b": 2.0}
    assert pools.pick(("a", "b"), weights, {"a": 0, "b": 1}, {"a": 0, "b": 0}) == "a"
    assert pools.pick(("a", "b"), weights, {"a": 1, "b": 1}, {"a": 0, "b": 0}) == "b"
    # Nothing in flight: the fewest placed for the weight, then the first listed.
    assert pools.pick(("a", "b"), weights, {"a": 0, "b": 0}, {"a": 0, "b": 0}) == "a"
    assert pools.pick(("a", "b"), weights, {"a": 0, "b": 0}, {"a": 1, "b": 1}) == "b"
    assert pools.pick(("a", "b"), weights, {"a": 0, "b": 0}, {"a": 1, "b": 2}) == "a"


def pool_of(*names, **pool):
    config = config_module.parse({"backends": [{
        "name": "p", "url": "http://127.0.0.1:1", "credentials": credentials(*names),
        "pool": pool}]}, KEYS)
    return config, config.backends[0]


async def test_connection_failures_back_off_doubling_and_an_answer_starts_over():
    config, backend = pool_of("a", "b", backoff=1, max_cooldown=3)
    clock = [1000.0]
    made = pools.Pools(config, clock=lambda: clock[0])
    pool, exchange = made.pools["p"], exchange_for(request(user(text("hi"))), backend=backend)
    waits = []
    for _ in range(4):
        assert not await made.report(exchange, pool, "a", None)  # retried as retries say
        waits.append(pool.health["a"].until - clock[0])
        clock[0] = pool.health["a"].until  # cooled down: the next failure is one in a row
    assert waits == [1, 2, 3, 3]
    assert [e["failures"] for e in exchange.noted("relay", "credential backoff")] == [1, 2, 3, 4]
    await made.report(exchange, pool, "a", 200)
    assert "a" not in pool.health and await made.state.get(pools.NAMESPACE, ["h:p:a"]) == [None]
    await made.report(exchange, pool, "a", None)
    assert pool.health["a"].until - clock[0] == 1


async def test_every_credential_overloaded_is_a_529_and_out_ones_a_503():
    config, backend = pool_of("a", "b")
    made = pools.Pools(config, clock=lambda: 1000.0)
    pool, exchange = made.pools["p"], exchange_for(request(user(text("hi"))), backend=backend)
    await made.report(exchange, pool, "a", 529, {"retry-after": "7"})
    await made.report(exchange, pool, "b", 401)
    with pytest.raises(pools.Exhausted) as refused:
        await made.choose(exchange, pool, set())
    assert (refused.value.error.status, refused.value.error.type) == (529, "overloaded_error")
    assert exchange.response_headers["retry-after"] == "7"
    await made.report(exchange, pool, "a", 403)
    with pytest.raises(pools.Exhausted) as refused:
        await made.choose(exchange, pool, set())
    assert refused.value.error.status == 503 and refused.value.retry is None


async def test_a_replica_honours_another_s_cooldown_within_the_refresh_and_reads_once():
    """The in-process cache: a healthy sticky session costs no round trip; another process's
    cooldown is seen once this one's view is ``refresh`` seconds old."""
    config = config_module.parse({"backends": [{
        "name": "p", "url": "http://127.0.0.1:1", "credentials": credentials("a", "b"),
        "pool": {"refresh": 5}}]}, KEYS)
    backend = config.backends[0]

    class Counting(MemoryState):
        reads = 0

        async def get(self, namespace, keys):
            Counting.reads += 1
            return await super().get(namespace, keys)

    state, clock = Counting(), [1000.0]
    one, two = (pools.Pools(config, state, clock=lambda: clock[0]) for _ in range(2))

    def exchange(session):
        made = exchange_for(request(user(text("hi"))), backend=backend)
        made.client_headers = {"x-claude-code-session-id": session}
        return made

    first = exchange("s1")
    chosen = await one.choose(first, one.pools["p"], set())
    one.release(first)
    assert Counting.reads == 1
    for _ in range(3):  # the sticky hot path: no read
        again = exchange("s1")
        assert (await one.choose(again, one.pools["p"], set())).name == chosen.name
        one.release(again)
    assert Counting.reads == 1
    elsewhere = exchange("s1")  # the other replica reads the session once, and follows
    assert (await two.choose(elsewhere, two.pools["p"], set())).name == chosen.name
    two.release(elsewhere)
    assert Counting.reads == 2
    # One cools the credential; two's view is fresh, so two's sticky session still goes there.
    assert await one.report(first, one.pools["p"], chosen.name, 429, {"retry-after": "60"})
    stale = exchange("s1")
    assert (await two.choose(stale, two.pools["p"], set())).name == chosen.name
    two.release(stale)
    clock[0] += 5  # two's view is now as old as the refresh: it reads, and moves the session
    moved = exchange("s1")
    assert (await two.choose(moved, two.pools["p"], set())).name != chosen.name
    assert [entry["to"] for entry in moved.noted("relay", "credential moved")] != []


# --- through a relay ----------------------------------------------------------------------------


async def test_a_twenty_turn_session_stays_on_one_credential(aiohttp_server, relays):
    server, url = await emulated(aiohttp_server)
    client = await relays.start(url, credentials("a", "b", "c"))
    # Three sessions told apart by their first message (no session header: the fingerprint
    # of what stays fixed), interleaved turn by turn.
    runs = await asyncio.gather(*(converse(client, 20, first=f"session {i}") for i in range(3)))
    assert runs == [[200] * 20] * 3
    by_session: dict[str, set] = {}
    for exchange in client.recorder.ended:
        by_session.setdefault(exchange.session(), set()).add(exchange.credential)
        assert [a.credential for a in exchange.attempts] == [exchange.credential]
    assert len(by_session) == 3 and all(len(used) == 1 for used in by_session.values())
    assert {next(iter(used)) for used in by_session.values()} == {"a", "b", "c"}
    assert sorted(keys_seen(server)) == sorted(["a"] * 20 + ["b"] * 20 + ["c"] * 20)
    assert len(noted(client, "credential placed")) == 3
    assert client.app[STATE].upstream.pools.pools["emu"].inflight == {"a": 0, "b": 0, "c": 0}
    assert await metric(client, "relay_credential_sessions_placed_total") == 3
    assert await metric(client, "relay_credential_requests_total", credential="a",
                        status="200") == 20


async def test_tokens_and_cost_per_credential_where_the_usage_is_known(aiohttp_server, relays):
    class Usage:  # what the usage plugin sets on exchange.usage (the pinned fields)
        input_tokens, output_tokens, cache_read_input_tokens = 100, 20, 900
        cache_write_5m_input_tokens = cache_write_1h_input_tokens = 0
        cost_micro_usd = 1500

    class Meter:
        @hookimpl
        def relay_exchange_end(self, exchange):
            exchange.usage = Usage()

    server, url = await emulated(aiohttp_server)
    client = await relays.start(url, credentials("a"), pipeline=("metrics", "meter"),
                                extra={"meter": Meter()})
    assert await converse(client, 2, session="s") == [200, 200]
    assert await metric(client, "relay_credential_tokens_total", credential="a",
                        kind="cache_read_input_tokens") == 1800
    assert await metric(client, "relay_credential_cost_micro_usd_total", credential="a") == 3000


async def test_a_session_s_first_requests_sent_together_go_with_one_credential(
        aiohttp_server, relays, tmp_path):
    """A client opens a session with requests at once (Claude Code's title and first turn):
    with a state whose reads wait (SQLite's thread), each request places the session only
    if no other of it did while it waited."""
    server, url = await emulated(aiohttp_server)
    state = await open_state({"url": f"sqlite:///{tmp_path}/state.db"})  # the chain closes it
    client = await relays.start(url, credentials("a", "b", "c"), state=state)
    statuses = await asyncio.gather(*(converse(client, 1, session="together",
                                               first=f"request {i}") for i in range(6)))
    assert statuses == [[200]] * 6
    assert len(set(keys_seen(server))) == 1
    assert len(noted(client, "credential placed")) == 1


async def test_a_rate_limited_credential_moves_its_session_once_unseen_by_the_client(
        aiohttp_server, relays):
    server, url = await emulated(aiohttp_server, key_budget=12, key_window=120)
    client = await relays.start(url, credentials("a", "b"))
    assert await converse(client, 20, session="sess-1") == [200] * 20
    seen = keys_seen(server)
    # Twelve turns on a, its 429 on the 13th, then every turn on b: one credential at a time.
    assert seen == ["a"] * 13 + ["b"] * 8
    moves = noted(client, "credential moved")
    assert [(m["credential"], m["to"]) for m in moves] == [("a", "b")]
    assert await metric(client, "relay_credential_sessions_moved_total", credential="a",
                        to="b") == 1
    assert 110 < await metric(client, "relay_credential_cooldown_seconds_total",
                              credential="a") <= 120
    moved = client.recorder.ended[12]
    assert [(a.credential, a.status) for a in moved.attempts] == [("a", 429), ("b", 200)]
    assert moved.credential == "b"
    listed = {entry["credential"]: entry for entry in
              (await (await client.get("/admin/backends")).json())["credentials"]}
    assert listed["a"]["state"] == "cooling" and listed["a"]["reason"] == "429 from upstream"
    assert listed["b"]["state"] == "healthy"


def limited(name: str, **limits) -> dict:
    return {"name": name, "key_env": f"POOL_{name.upper()}", "limits": limits}


async def test_a_credential_at_its_own_limits_moves_its_session_before_anything_goes_up(
        aiohttp_server, relays):
    server, url = await emulated(aiohttp_server)
    client = await relays.start(url, [limited("a", requests_per_minute=2), limited("b")])
    assert await converse(client, 4, session="sess-1") == [200] * 4
    # The third turn never reached a: a's own limit, not the upstream, decided it.
    assert keys_seen(server) == ["a", "a", "b", "b"]
    assert [(n["credential"], n["limit"]) for n in noted(client, "credential at its limits")] \
        == [("a", "requests_per_minute")]
    moves = noted(client, "credential moved")
    assert [(m["credential"], m["to"], m["reason"]) for m in moves] == [("a", "b", "at its limits")]
    assert [a.credential for a in client.recorder.ended[2].attempts] == ["b"]


async def test_a_credential_s_model_pattern_limits_the_renamed_model(aiohttp_server, relays):
    """A credential's limit for a model pattern is the model's as it goes up (after the
    backend's rename), as a relay key's is: the client's alias for Opus is under a's Opus
    limit."""
    server, url = await emulated(aiohttp_server)
    client = await relays.start(url, [
        {**limited("a"), "limits": {"models": {"claude-opus-*": {"requests_per_minute": 1}}}},
        limited("b")], rename={"fast": "claude-opus-4-1"})
    for _ in range(3):
        resp = await client.post("/v1/messages", json=request(user(text("hi")), model="fast"),
                                 headers={"x-claude-code-session-id": "s"})
        assert resp.status == 200
    assert keys_seen(server) == ["a", "b", "b"]
    assert [n["limit"] for n in noted(client, "credential at its limits")] == [
        "requests_per_minute"]


async def test_every_credential_at_its_limits_is_a_clean_429_with_the_wait(aiohttp_server,
                                                                             relays):
    server, url = await emulated(aiohttp_server)
    client = await relays.start(url, [limited("a", requests_per_minute=1),
                                      limited("b", requests_per_minute=1)])
    for n in range(2):
        resp = await client.post("/v1/messages", json=request(user(text("hi"))),
                                 headers={"x-claude-code-session-id": f"s{n}"})
        assert resp.status == 200
    resp = await client.post("/v1/messages", json=request(user(text("hi"))),
                             headers={"x-claude-code-session-id": "s2"})
    body = await resp.json()
    assert resp.status == 429 and body["error"]["type"] == "rate_limit_error"
    assert "every credential of backend emu is at its limits" in body["error"]["message"]
    assert 1 <= int(resp.headers["retry-after"]) <= 61
    assert sorted(keys_seen(server)) == ["a", "b"]  # the third request never went up
    assert client.recorder.ended[-1].attempts == []


async def test_a_credential_s_limits_count_its_messages_only(aiohttp_server, relays):
    # As a relay key's (docs/accounting.md): token counts and pass-through routes take
    # nothing from them, the upstream counting its token counts apart from its messages.
    server, url = await emulated(aiohttp_server)
    client = await relays.start(url, [limited("a", requests_per_minute=1, concurrent=1)])
    body = request(user(text("hi")))
    assert (await client.post("/v1/messages/count_tokens", json=body)).status == 200
    assert (await client.get("/v1/models")).status == 200
    assert (await client.post("/v1/messages", json=body)).status == 200
    assert keys_seen(server) == ["a"] * 3
    assert (await client.post("/v1/messages", json=body)).status == 429  # its one a minute
    assert (await client.post("/v1/messages/count_tokens", json=body)).status == 200
    assert keys_seen(server) == ["a"] * 4


async def test_a_credential_s_concurrency_slot_is_given_back_on_every_exit(aiohttp_server,
                                                                          relays):
    gate, fail = asyncio.Event(), []

    async def answer(request):
        await request.read()
        if fail:
            return web.json_response({"type": "error", "error": {
                "type": "api_error", "message": "upstream broke"}}, status=500)
        await gate.wait()
        return web.json_response(ANSWER)
    app = web.Application()
    app.router.add_post("/v1/messages", answer)
    server = await aiohttp_server(app)
    client = await relays.start(str(server.make_url("")).rstrip("/"),
                                [limited("a", concurrent=1)])
    body = request(user(text("hi")))
    first = asyncio.ensure_future(client.post("/v1/messages", json=body))
    while not client.app[STATE].upstream.pools.pools["emu"].inflight["a"]:
        await asyncio.sleep(0.01)
    second = await client.post("/v1/messages", json=body)  # a's one slot is held
    assert second.status == 429 and "at its limits" in (await second.json())["error"]["message"]
    gate.set()
    assert (await first).status == 200
    assert (await client.post("/v1/messages", json=body)).status == 200  # given back
    fail.append(True)
    for _ in range(3):  # an upstream failure gives it back too
        assert (await client.post("/v1/messages", json=body)).status == 500
    gate.clear()
    fail.clear()
    hung = asyncio.ensure_future(client.post("/v1/messages", json=body))
    while not client.app[STATE].upstream.pools.pools["emu"].inflight["a"]:
        await asyncio.sleep(0.01)
    hung.cancel()  # the client goes away mid-request
    while client.app[STATE].upstream.pools.pools["emu"].inflight["a"]:
        await asyncio.sleep(0.01)
    gate.set()
    assert (await client.post("/v1/messages", json=body)).status == 200


async def test_a_credential_s_budget_counts_what_its_answers_cost(aiohttp_server, relays):
    # 1,000 input tokens at $3/MTok: 3,000 micro-dollars an answer, over a $0.005 budget
    # after two answers.
    server, url = await emulated(aiohttp_server, usage="input=1000,output=0")
    prices = [{"models": ["*"], "usd_per_mtok": {"input": 3, "output": 15, "cache_write_5m": 0,
                                                  "cache_write_1h": 0, "cache_read": 0}}]
    client = await relays.start(url, [limited("a", budget={"usd": 0.005, "per": "day"}),
                                      limited("b")],
                                pipeline=("usage", "metrics"), plugins={"usage": {"prices": prices}})
    assert await converse(client, 4, session="sess-1") == [200] * 4
    assert keys_seen(server) == ["a", "a", "b", "b"]
    assert [n["limit"] for n in noted(client, "credential at its limits")] == ["budget"]


def test_credential_limits_that_count_tokens_or_cost_need_the_usage_plugin():
    backend = {"name": "p", "url": "http://127.0.0.1:1",
               "credentials": [limited("a", models={"claude-opus-*": {"budget": {
                   "usd": 5, "per": "week"}}})]}
    with pytest.raises(ConfigError) as error:
        config_module.parse({"pipeline": ["metrics"], "backends": [backend]}, KEYS)
    assert str(error.value).startswith("backends[0].credentials[0].limits: budget counts what")
    config_module.parse({"pipeline": ["usage"], "backends": [backend]}, KEYS)
    backend["credentials"] = [limited("a", requests_per_minute=5, concurrent=2)]
    config_module.parse({"backends": [backend]}, KEYS)  # counted without any answer's usage


async def test_weights_spread_a_thousand_new_sessions(aiohttp_server, relays):
    server, url = await emulated(aiohttp_server, record=True)
    client = await relays.start(url, credentials("a", "b", "c", b=2, c=1), pipeline=())

    async def one(i):
        resp = await client.post("/v1/messages/count_tokens",
                                 json={"model": "claude-test",
                                       "messages": [user(text(f"new session {i}"))]})
        assert resp.status == 200
    for start in range(0, 1000, 10):  # ten at a time: in flight counts as well
        await asyncio.gather(*(one(i) for i in range(start, start + 10)))
    seen = keys_seen(server)
    shares = {name: seen.count(name) / len(seen) for name in "abc"}
    assert len(seen) == 1000
    assert abs(shares["a"] - 0.25) < 0.03 and abs(shares["b"] - 0.5) < 0.03 \
        and abs(shares["c"] - 0.25) < 0.03, shares


async def test_every_credential_cooling_is_one_clean_429_with_the_shortest_wait(
        aiohttp_server, relays):
    asked = []

    async def limited(request):  # a for 40 s, b for 20 s
        key = NAME_OF[request.headers["x-api-key"]]
        asked.append(key)
        return web.json_response(
            {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}},
            status=429, headers={"retry-after": "40" if key == "a" else "20"})
    app = web.Application()
    app.router.add_post("/v1/messages", limited)
    server = await aiohttp_server(app)
    client = await relays.start(str(server.make_url("")).rstrip("/"), credentials("a", "b"))
    for n in range(3):
        resp = await client.post("/v1/messages", json=request(user(text("hi"))),
                                 headers={"x-claude-code-session-id": f"s{n}"})
        body = await resp.json()
        assert resp.status == 429
        assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error"
        assert "every credential of backend emu is cooling down" in body["error"]["message"]
        assert resp.headers["retry-after"] in ("19", "20")
        assert resp.headers.get("x-should-retry") != "false"
    assert asked == ["a", "b"]  # after the first request, nothing more went upstream
    last = client.recorder.ended[-1]
    assert last.attempts == [] and last.outcome == "rejected"


async def test_another_credential_is_tried_before_the_fallbacks(aiohttp_server, relays):
    limited, url = await emulated(aiohttp_server, key_budget=0)
    spare, spare_url = await emulated(aiohttp_server)
    client = await relays.start(url, credentials("a", "b"), fallbacks=["spare"],
                                more=[{"name": "spare", "url": spare_url}])
    resp = await client.post("/v1/messages", json=request(user(text("hi"))))
    assert resp.status == 200
    ended = client.recorder.ended[-1]
    assert [(a.backend, a.credential, a.status) for a in ended.attempts] == [
        ("emu", "a", 429), ("emu", "b", 429), ("spare", None, 200)]
    assert ended.credential is None and keys_seen(limited) == ["a", "b"]


async def test_a_stream_that_opens_overloaded_cools_its_credential_like_a_529(aiohttp_server,
                                                                             relays):
    # Anthropic under load answers 200 and opens the stream with an error event: nothing of
    # it has reached the client, so the next credential answers instead.
    asked = []

    async def answer(request):
        asked.append(NAME_OF[request.headers["x-api-key"]])
        return await stream_reply([OPENING_ERROR if asked[-1] == "a" else STREAM])(request)
    app = web.Application()
    app.router.add_post("/v1/messages", answer)
    server = await aiohttp_server(app)
    client = await relays.start(str(server.make_url("")).rstrip("/"), credentials("a", "b"),
                                pool={"default_cooldown": 60})
    for n in range(2):
        resp = await client.post("/v1/messages", json={**request(user(text("hi"))),
                                                       "stream": True},
                                 headers={"x-claude-code-session-id": f"s{n}"})
        assert resp.status == 200 and await resp.read() == STREAM
    assert asked == ["a", "b", "b"]  # a cooled: the second session went to b at once
    first = client.recorder.ended[0]
    assert [(a.credential, a.status) for a in first.attempts] == [("a", 200), ("b", 200)]
    [cooled] = first.noted("relay", "credential cooling")
    assert (cooled["credential"], cooled["status"], cooled["seconds"]) == ("a", 529, 60)
    assert client.app[STATE].upstream.pools.pools["emu"].inflight == {"a": 0, "b": 0}


async def test_a_token_count_s_429_cools_no_credential_for_messages(aiohttp_server, relays):
    # Token counting has rate limits of its own (Anthropic's token-counting docs: 100
    # requests a minute at tier 1, apart from the Messages API's): its 429 says nothing of
    # the messages a credential can take, and the client gets it as the API answered it.
    asked = []

    async def count(request):
        asked.append(("count", NAME_OF[request.headers["x-api-key"]]))
        return web.json_response({"type": "error", "error": {
            "type": "rate_limit_error", "message": "Number of requests has exceeded your "
            "rate limit"}}, status=429, headers={"retry-after": "60"})

    async def create(request):
        asked.append(("messages", NAME_OF[request.headers["x-api-key"]]))
        return web.json_response(ANSWER)
    app = web.Application()
    app.router.add_post("/v1/messages/count_tokens", count)
    app.router.add_post("/v1/messages", create)
    server = await aiohttp_server(app)
    client = await relays.start(str(server.make_url("")).rstrip("/"), credentials("a", "b"))
    session = {"x-claude-code-session-id": "s1"}
    body = request(user(text("hi")))
    resp = await client.post("/v1/messages/count_tokens", json=body, headers=session)
    assert resp.status == 429 and resp.headers["retry-after"] == "60"
    assert (await resp.json())["error"]["message"].startswith("Number of requests")
    resp = await client.post("/v1/messages", json=body, headers=session)
    assert resp.status == 200
    assert asked == [("count", "a"), ("messages", "a")]
    assert noted(client, "credential cooling") == [] and noted(client, "credential moved") == []


async def test_a_token_count_goes_with_credentials_cooling_for_messages(aiohttp_server,
                                                                         relays):
    # Every credential cooling after the Messages API's 429s: a token count, whose rate
    # limits are its own, still goes up (refused, it would be the relay's own 429), and the
    # session stays where it was.
    asked = []

    async def create(request):
        asked.append(("messages", NAME_OF[request.headers["x-api-key"]]))
        return web.json_response({"type": "error", "error": {
            "type": "rate_limit_error", "message": "slow down"}}, status=429,
            headers={"retry-after": "60"})

    async def count(request):
        asked.append(("count", NAME_OF[request.headers["x-api-key"]]))
        return web.json_response({"input_tokens": 12})
    app = web.Application()
    app.router.add_post("/v1/messages", create)
    app.router.add_post("/v1/messages/count_tokens", count)
    server = await aiohttp_server(app)
    client = await relays.start(str(server.make_url("")).rstrip("/"), credentials("a", "b"))
    session = {"x-claude-code-session-id": "s1"}
    body = request(user(text("hi")))
    resp = await client.post("/v1/messages", json=body, headers=session)
    assert resp.status == 429
    assert asked == [("messages", "a"), ("messages", "b")]
    resp = await client.post("/v1/messages/count_tokens", json=body, headers=session)
    assert resp.status == 200 and await resp.json() == {"input_tokens": 12}
    assert asked[-1][0] == "count"
    resp = await client.post("/v1/messages", json=body, headers=session)
    assert resp.status == 429 and "retry-after" in resp.headers  # the relay's: both cooling
    assert len(asked) == 3


async def test_a_switch_of_credential_leaves_the_client_its_own_retries(aiohttp_server,
                                                                        relays):
    # a is rate limited, b fails: the 500 was asked once, the relay retried nothing, and the
    # client may retry it as it would without the relay (no x-should-retry: false).
    async def answer(request):
        if request.headers["x-api-key"] == KEYS["POOL_A"]:
            return web.json_response({"type": "error", "error": {
                "type": "rate_limit_error", "message": "slow down"}}, status=429,
                headers={"retry-after": "30"})
        return web.json_response({"type": "error", "error": {
            "type": "api_error", "message": "Internal server error"}}, status=500)
    app = web.Application()
    app.router.add_post("/v1/messages", answer)
    server = await aiohttp_server(app)
    client = await relays.start(str(server.make_url("")).rstrip("/"), credentials("a", "b"))
    resp = await client.post("/v1/messages", json=request(user(text("hi"))))
    assert resp.status == 500 and "x-should-retry" not in resp.headers
    ended = client.recorder.ended[-1]
    assert [(a.credential, a.status) for a in ended.attempts] == [("a", 429), ("b", 500)]


async def test_a_revoked_key_is_taken_out_once_and_never_retried(aiohttp_server, relays,
                                                                 caplog):
    server, url = await emulated(aiohttp_server, revoked_keys=(KEYS["POOL_A"],))
    client = await relays.start(url, credentials("a", "b"))
    with caplog.at_level(logging.WARNING, logger="relay.pools"):
        for n in range(10):
            assert await converse(client, 2, session=f"s{n}") == [200, 200]
    assert keys_seen(server) == ["a"] + ["b"] * 20
    out = [r for r in caplog.records if "credential a is out" in r.getMessage()]
    assert len(out) == 1 and all(key not in r.getMessage() for key in KEYS.values()
                                 for r in caplog.records)
    assert await metric(client, "relay_credential_out_total", credential="a") == 1
    listed = await pools.health(client.chain.state, client.config)
    assert [(e["credential"], e["state"], e["reason"]) for e in listed] == [
        ("a", "out", "401 from upstream"), ("b", "healthy", None)]
    assert listed[0]["since"] is not None and listed[0]["until"] is None
    # The operator takes the key back at the provider and reinstates it.
    server.app[emulator.STATE].revoked.clear()
    assert await pools.reinstate(client.chain.state, client.config, "emu", "a")
    assert (await pools.health(client.chain.state, client.config))[0]["state"] == "healthy"


async def test_every_key_revoked_is_a_503_that_says_so(aiohttp_server, relays):
    server, url = await emulated(aiohttp_server, revoked_keys=(KEYS["POOL_A"], KEYS["POOL_B"]))
    client = await relays.start(url, credentials("a", "b"))
    for _ in range(2):
        resp = await client.post("/v1/messages", json=request(user(text("hi"))))
        assert resp.status == 503
        assert "every credential of backend emu is out" in (await resp.json())["error"]["message"]
    assert keys_seen(server) == ["a", "b"]


@pytest.fixture(params=["memory", "sqlite", pytest.param("redis", marks=pytest.mark.slow)])
async def replica_states(request, tmp_path):
    """Two states for two replicas: one MemoryState both hold (in this process), or two
    connections each to one SQLite file or one redis-server, as two processes would have."""
    if request.param == "memory":
        shared = MemoryState()
        yield shared, shared
        return
    url = (request.getfixturevalue("redis_server").url if request.param == "redis"
           else f"sqlite:///{tmp_path}/state.db")
    yield [await open_state({"url": url}) for _ in range(2)]  # each relay's chain closes its own


async def test_replicas_sharing_state_keep_a_session_and_honour_each_other(
        aiohttp_server, relays, replica_states):
    server, url = await emulated(aiohttp_server, key_budget=6, key_window=120)
    first, second = replica_states
    one = await relays.start(url, credentials("a", "b"), state=first, pool={"refresh": 0})
    two = await relays.start(url, credentials("a", "b"), state=second, pool={"refresh": 0})
    messages = [user(text("start"))]
    headers = {"x-claude-code-session-id": "shared"}
    for turn in range(10):  # alternating replicas, as a round-robin balancer sends them
        client = (one, two)[turn % 2]
        resp = await client.post("/v1/messages", json=request(*messages), headers=headers)
        assert resp.status == 200
        messages += [assistant(*(await resp.json())["content"]), user(text(f"t{turn}"))]
    seen = keys_seen(server)
    assert seen == ["a"] * 7 + ["b"] * 4  # the 429 on the seventh, once
    assert len(noted(one, "credential moved") + noted(two, "credential moved")) == 1
    # A new session on the replica that did not see the 429 keeps off the cooling credential.
    assert await converse(two, 1, session="new") == [200]
    assert keys_seen(server)[-1] == "b"


async def test_replicas_sharing_state_share_a_credential_s_own_limits(
        aiohttp_server, relays, replica_states):
    server, url = await emulated(aiohttp_server)
    first, second = replica_states
    replicas = [await relays.start(url, [limited("a", requests_per_minute=3)], state=state)
                for state in (first, second)]
    statuses = []
    for n in range(6):  # alternating replicas, one session each
        resp = await replicas[n % 2].post("/v1/messages", json=request(user(text("hi"))),
                                          headers={"x-claude-code-session-id": f"s{n}"})
        statuses.append(resp.status)
    assert statuses == [200, 200, 200, 429, 429, 429]
    assert keys_seen(server) == ["a"] * 3


async def test_an_unreachable_state_leaves_the_pool_to_what_this_process_knows(
        aiohttp_server, relays, caplog):
    class Down(MemoryState):
        calls = 0

        async def get(self, namespace, keys):
            Down.calls += 1
            raise Unavailable("down")

        async def put(self, namespace, items, ttl):
            Down.calls += 1
            raise Unavailable("down")

    server, url = await emulated(aiohttp_server, key_budget=3, key_window=120)
    client = await relays.start(url, credentials("a", "b"), state=Down())
    with caplog.at_level(logging.WARNING, logger="relay.pools"):
        assert await converse(client, 6, session="s") == [200] * 6
    assert keys_seen(server) == ["a"] * 4 + ["b"] * 3
    assert Down.calls == 1  # then left alone for a while, not asked on every request
    assert len([r for r in caplog.records if "unreachable" in r.getMessage()]) == 1


async def test_no_credential_reaches_a_client_or_a_dump(aiohttp_server, relays, tmp_path):
    async def echo(request):
        return web.json_response(
            {"type": "error", "error": {"type": "invalid_request_error",
                                        "message": f"bad key {request.headers['x-api-key']}"}},
            status=400, headers={"x-echo": request.headers["x-api-key"]})
    app = web.Application()
    app.router.add_post("/v1/messages", echo)
    server = await aiohttp_server(app)
    dumps = tmp_path / "dumps"
    client = await relays.start(str(server.make_url("")).rstrip("/"), credentials("a", "b"),
                                pipeline=("dump",), plugins={"dump": {"dir": str(dumps)}})
    for n in range(4):
        resp = await client.post("/v1/messages", json=request(user(text("hi"))),
                                 headers={"x-claude-code-session-id": f"s{n}"})
        raw = await resp.read()
        assert resp.status == 400 and b"[redacted]" in raw
        assert resp.headers["x-echo"] == "[redacted]"
        assert all(key.encode() not in raw for key in KEYS.values())
    assert {e.credential for e in client.recorder.ended} == {"a", "b"}
    await client.chain.shutdown(client.config)  # the dumps are written
    written = sorted(dumps.rglob("*.json"))
    assert len(written) == 4
    documents = [orjson.loads(path.read_bytes()) for path in written]
    assert all(key.encode() not in path.read_bytes() for path in written
               for key in KEYS.values())
    assert {d["attempts"][0]["credential"] for d in documents} == {"a", "b"}


async def test_a_pass_through_route_goes_with_a_pooled_key_never_the_client_s(aiohttp_server,
                                                                              relays):
    server, url = await emulated(aiohttp_server)
    client = await relays.start(url, credentials("a", "b"))
    for _ in range(4):
        resp = await client.get("/v1/models", headers={"x-api-key": "sk-ant-the-client-s-own"})
        assert resp.status == 200
    assert sorted(keys_seen(server)) == ["a", "a", "b", "b"]  # no session: spread
    assert client.app[STATE].upstream.pools.pools["emu"].inflight == {"a": 0, "b": 0}


def test_relay_backends_lists_each_credential(tmp_path, capsys, monkeypatch):
    path = tmp_path / "relay.yaml"
    own = {"requests_per_minute": 50, "budget": {"usd": 200, "per": "month"}}
    path.write_text(orjson.dumps({"pipeline": ["usage"], "backends": [
        {"name": "pooled", "url": "http://127.0.0.1:1",
         "credentials": [limited("a", **own), *credentials("b")]},
        {"name": "single", "url": "http://127.0.0.1:2", "api_key_env": "POOL_C"}]}).decode())
    for name, value in KEYS.items():
        monkeypatch.setenv(name, value)
    state = MemoryState()

    async def opened(options=None):
        return state
    monkeypatch.setattr("relay.state.open_state", opened)
    asyncio.run(state.put(pools.NAMESPACE, {pools.health_key("pooled", "b"): pools.Health(
        "out", 1_700_000_000.0, "401 from upstream", status=401,
        key=pools.fingerprint(KEYS["POOL_B"])).encode()}, 60))
    asyncio.run(state.record([{"id": f"r{n}", "time": time.time() - 10 + n, "attempts": [
        {"backend": "pooled", "credential": "a", "status": status, "wait_ms": 0}]}
        for n, status in enumerate((429, 200))]))
    plan = limits_plan("pooled/a", limits.Limits.of(limits.check_limits(own, "x")).rules,
                       pools.SCOPE)
    asyncio.run(state.take(plan.counters))  # one request, then its answer's cost
    asyncio.run(state.add([Counter(plan.counters[0].name, "month", None, 1_500_000)]))
    assert cli.main(["backends", "--config", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["pooled/a  healthy  (recent: 200 429)  (limits: budget $1.50 of $200.00, "
                   "requests_per_minute 1 of 50)",
                   "pooled/b  out since 2023-11-14T22:13:20Z: 401 from upstream",
                   "single  one key (api_key_env)"]
    assert cli.main(["backends", "--config", str(path), "--reinstate", "pooled/b",
                     "--json"]) == 0
    assert [e["state"] for e in orjson.loads(capsys.readouterr().out)] == ["healthy"] * 2
    assert cli.main(["backends", "--config", str(path), "--reinstate", "pooled/z"]) == 2


async def test_a_credential_that_a_fallback_took_over_from_is_given_back(aiohttp_server,
                                                                         relays):
    # The pooled backend answers a status it retries; its fallback answers: the credential
    # the first exchange held (its in-flight count, its one concurrency slot) goes back.
    async def broken(request):
        await request.read()
        return web.json_response({"type": "error", "error": {
            "type": "api_error", "message": "upstream broke"}}, status=500)
    app = web.Application()
    app.router.add_post("/v1/messages", broken)
    server = await aiohttp_server(app)
    spare, spare_url = await emulated(aiohttp_server)
    client = await relays.start(str(server.make_url("")).rstrip("/"),
                                [limited("a", concurrent=1)], fallbacks=["spare"],
                                more=[{"name": "spare", "url": spare_url}])
    body = request(user(text("hi")))
    for _ in range(3):
        resp = await client.post("/v1/messages", json=body)
        assert resp.status == 200
        ended = client.recorder.ended[-1]
        assert [(a.backend, a.credential, a.status) for a in ended.attempts] == [
            ("emu", "a", 500), ("spare", None, 200)]  # a's slot was free each time
    assert client.app[STATE].upstream.pools.pools["emu"].inflight == {"a": 0}


async def test_what_a_pool_noted_before_its_fallback_answered_is_counted(aiohttp_server,
                                                                       relays):
    # Both credentials are cooled by 429s, then a backend without a pool answers: the
    # exchange that ends holds no credential, but the cooldowns happened all the same.
    limited, url = await emulated(aiohttp_server, key_budget=0)
    spare, spare_url = await emulated(aiohttp_server)
    client = await relays.start(url, credentials("a", "b"), fallbacks=["spare"],
                                more=[{"name": "spare", "url": spare_url}])
    resp = await client.post("/v1/messages", json=request(user(text("hi"))),
                             headers={"x-claude-code-session-id": "s1"})
    assert resp.status == 200 and client.recorder.ended[-1].credential is None
    for name in ("a", "b"):
        assert await metric(client, "relay_credential_cooldown_seconds_total",
                            credential=name) > 0
    assert await metric(client, "relay_credential_sessions_placed_total", credential="a") == 1
    assert await metric(client, "relay_credential_sessions_moved_total", credential="a") == 1


class SlowWrites(MemoryState):
    """A shared state whose writes take their time once ``slow`` is set, like a distant
    Redis: ``task`` is the request that waits on one."""

    def __init__(self):
        super().__init__()
        self.slow = False
        self.task = None

    async def put(self, namespace, items, ttl):
        if self.slow and any(key.startswith("h:") for key in items):  # a credential's health
            self.task = asyncio.current_task()
            await asyncio.sleep(30)
        await super().put(namespace, items, ttl)


async def test_an_answer_whose_cooldown_was_being_written_is_let_go_on_a_disconnect(
        aiohttp_server, relays):
    # A 429 cools its credential; the client goes away while the cooldown is written to the
    # shared state, the 429's body not all come: its connection goes back all the same.
    hold = asyncio.Event()

    async def limited(request):
        await request.read()
        resp = web.StreamResponse(status=429, headers={"Content-Type": "application/json",
                                                       "Content-Length": "100"})
        await resp.prepare(request)
        await resp.write(b'{"type": "error", ')
        await hold.wait()
        return resp
    app = web.Application()
    app.router.add_post("/v1/messages", limited)
    server = await aiohttp_server(app)
    state = SlowWrites()
    client = await relays.start(str(server.make_url("")).rstrip("/"), credentials("a", "b"),
                                state=state)
    state.slow = True
    posted = asyncio.ensure_future(client.post("/v1/messages", json=request(user(text("hi")))))
    while state.task is None:
        await asyncio.sleep(0.01)
    state.task.cancel()
    while not client.recorder.ended:
        await asyncio.sleep(0.01)
    posted.cancel()
    hold.set()
    assert client.recorder.ended[0].outcome == "client_disconnected"
    assert not client.app[STATE].upstream.connections._busy
    assert client.app[STATE].upstream.pools.pools["emu"].inflight == {"a": 0, "b": 0}


async def test_a_credential_at_its_limits_beside_a_cooling_one_waits_for_the_soonest():
    """Every credential at its limits or cooling: the client's wait is the soonest any of
    them can take a request, the cooling one's too, not only the limits' window."""
    config = config_module.parse({"backends": [{
        "name": "p", "url": "http://127.0.0.1:1",
        "credentials": [limited("a", requests_per_minute=1), limited("b")]}]}, KEYS)
    backend = config.backends[0]
    made = pools.Pools(config)
    pool = made.pools["p"]
    first = exchange_for(request(user(text("hi"))), backend=backend)
    first.client_headers = {"x-claude-code-session-id": "s1"}
    assert (await made.choose(first, pool, set())).name == "a"  # a's one request a minute
    made.release(first)
    assert await made.report(first, pool, "b", 429, {"retry-after": "5"})
    second = exchange_for(request(user(text("hi"))), backend=backend)
    second.client_headers = {"x-claude-code-session-id": "s2"}
    with pytest.raises(pools.Exhausted) as refused:
        await made.choose(second, pool, set())
    assert refused.value.error.status == 429
    assert second.response_headers["retry-after"] in ("4", "5")  # b is back in 5 s, not 60


async def test_a_session_s_requests_moving_together_move_to_one_credential():
    """A session's credential cools while two of its requests are in hand (Claude Code's
    title and turn): with a state whose reads wait, both move to the same credential, not
    one each (a second move is a second cache write)."""
    config, backend = pool_of("a", "b", "c")

    class Slow(MemoryState):
        async def get(self, namespace, keys):
            found = await super().get(namespace, keys)
            for _ in range(3):  # the answer on its way back
                await asyncio.sleep(0)
            return found

    made = pools.Pools(config, Slow())
    pool = made.pools["p"]

    def exchange():
        found = exchange_for(request(user(text("hi"))), backend=backend)
        found.client_headers = {"x-claude-code-session-id": "s"}
        return found
    first = exchange()
    assert (await made.choose(first, pool, set())).name == "a"
    made.release(first)
    assert await made.report(first, pool, "a", 429, {"retry-after": "60"})
    together = [exchange(), exchange()]
    chosen = await asyncio.gather(*(made.choose(e, pool, set()) for e in together))
    assert [c.name for c in chosen] == ["b", "b"]
    assert sum(len(e.noted("relay", "credential moved")) for e in together) == 1


async def test_a_connection_failure_in_flight_neither_ends_a_cooldown_nor_an_out_key():
    """A request still in flight on a credential fails to connect after another was answered
    a 429 (or a 401) with it: the failure says nothing about the key, so the upstream's
    longer wait (or the refused key) stands, not the first second of backoff."""
    config, backend = pool_of("a", "b", backoff=1)
    clock = [1000.0]
    made = pools.Pools(config, clock=lambda: clock[0])
    pool, exchange = made.pools["p"], exchange_for(request(user(text("hi"))), backend=backend)
    assert await made.report(exchange, pool, "a", 429, {"retry-after": "60"})
    assert await made.report(exchange, pool, "b", 401)
    assert not await made.report(exchange, pool, "a", None)
    assert not await made.report(exchange, pool, "b", None)
    clock[0] += 2  # past the backoff's second
    assert pool.blocked("a", clock[0]) and pool.health["a"].until == 1060
    assert pool.blocked("b", clock[0]) and pool.health["b"].state == "out"
    stored = await made.state.get(pools.NAMESPACE, ["h:p:a", "h:p:b"])
    assert [pools.Health.decode(raw).state for raw in stored] == ["cooling", "out"]
    with pytest.raises(pools.Exhausted) as refused:
        await made.choose(exchange, pool, set())
    assert refused.value.error.status == 429 and refused.value.retry == 58


async def test_an_answer_after_a_backoff_leaves_another_replica_s_newer_cooldown():
    """One replica is answered again by a credential it had backed off from, while another
    was answered a 429 by it: forgetting its own backoff must not delete the other's
    cooldown from the shared state."""
    config, backend = pool_of("a", "b", backoff=1, refresh=0)
    state, clock = MemoryState(), [1000.0]
    one, two = (pools.Pools(config, state, clock=lambda: clock[0]) for _ in range(2))
    exchange = exchange_for(request(user(text("hi"))), backend=backend)
    assert not await one.report(exchange, one.pools["p"], "a", None)  # one backs off a for 1 s
    clock[0] += 2  # over; one sends with a again
    assert await two.report(exchange, two.pools["p"], "a", 429, {"retry-after": "60"})
    assert not await one.report(exchange, one.pools["p"], "a", 200)  # one's request answered
    stored = pools.Health.decode((await state.get(pools.NAMESPACE, ["h:p:a"]))[0])
    assert stored is not None and stored.status == 429 and stored.until == 1062
    three = pools.Pools(config, state, clock=lambda: clock[0])
    for _ in range(3):
        chosen = await three.choose(exchange, three.pools["p"], set())
        three.release(exchange)
        assert chosen.name == "b"
