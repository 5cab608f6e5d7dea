"""The cache plugin through a real relay in front of the emulator's prompt cache: each
cache-break cause with its header, metric and timeline entry; cache diagnostics answered for
a backend without them, checked with the SDK's own types; the session record."""

from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import datetime
import time

import orjson
import pytest
from anthropic.types.beta import (
    BetaCacheMissMessagesChanged,
    BetaCacheMissModelChanged,
    BetaCacheMissPreviousMessageNotFound,
    BetaCacheMissSystemChanged,
    BetaCacheMissToolsChanged,
    BetaCacheMissUnavailable,
    BetaMessage,
)
from test_metrics import samples, value

from relay import config as config_module
from relay import document, logs
from relay.chain import Chain, load_plugins
from relay.hookspecs import hookimpl
from relay.server import create_app
from relay.sessions import Record
from relay.state.memory import MemoryState
from relay.testing import emulator, emulator_openai
from relay.testing.fixtures import relay_client, start_relay  # noqa: F401  (the fixture)

CC = {"type": "ephemeral"}
TOOLS = [{"name": "Bash", "input_schema": {"type": "object"}},
         {"name": "Read", "input_schema": {"type": "object"}, "cache_control": CC}]
SYSTEM = [{"type": "text", "text": "You are a coding agent. " * 20},
          {"type": "text", "text": "Be terse.", "cache_control": CC}]


def conversation(turns: int, model: str = "claude-test", **more) -> dict:
    """A session's request after ``turns`` exchanges: the marker on the newest message."""
    messages = []
    for n in range(2 * turns + 1):
        role = "user" if n % 2 == 0 else "assistant"
        messages.append({"role": role, "content": [{"type": "text", "text": f"{role} {n} " * 30}]})
    messages[-1]["content"][0]["cache_control"] = CC
    return {"model": model, "max_tokens": 2048, "tools": copy.deepcopy(TOOLS),
            "system": copy.deepcopy(SYSTEM), "messages": messages, **more}


class Recorder:
    """Keeps every finished exchange (first in the pipeline: its end hook runs last)."""

    def __init__(self):
        self.exchanges = []

    @hookimpl
    def relay_exchange_end(self, exchange):
        self.exchanges.append(exchange)


class Stamp:
    """A gateway's classic fault: a time stamp in the system prompt, on every request."""

    def __init__(self):
        self.count = 0

    @hookimpl
    def relay_request(self, exchange):
        self.count += 1
        exchange.body["system"][0]["text"] += f" [{self.count}]"
        exchange.mark_changed()
        exchange.note("stamp", "rewrote", location="system[0]")


class Pool:
    """Stands in for the pools plugin: names the upstream credential used."""

    credential = "key-1"

    @hookimpl
    def relay_request(self, exchange):
        exchange.credential = self.credential


async def start(relay_client, *extra_names, extra=None, **options):
    recorder = Recorder()
    client = await relay_client(["recorder", "metrics", "cache", *extra_names],
                                extra={"recorder": recorder, **(extra or {})},
                                prompt_cache=True, diagnostics=False, **options)
    client.recorder = recorder
    return client


# Claude Code's session header: the session rule's first choice. Without one, a changed
# system prompt or first message would be another session (the rule's fingerprint holds them).
SESSION = {"x-claude-code-session-id": "session-1"}


async def send(client, body: dict) -> tuple[dict, str]:
    resp = await client.post("/v1/messages", json=body, headers=SESSION)
    assert resp.status == 200, await resp.text()
    return await resp.json(), resp.headers["x-relay-cache"]


async def breaks(client) -> dict:
    found = samples(await (await client.get("/metrics")).text())
    return {dict(labels)["cause"]: v for (name, labels), v in found.items()
            if name == "relay_cache_breaks_total"}


def noted(client) -> dict:
    entries = [entry for entry in client.recorder.exchanges[-1].timeline
               if entry["step"] == "cache" and entry["action"] in ("hit", "write", "miss", "none")]
    assert len(entries) == 1
    return entries[0]


async def test_a_growing_session_writes_then_hits(relay_client):
    client = await start(relay_client)
    answer, header = await send(client, conversation(0))
    assert header == "write"
    assert answer["usage"]["cache_creation_input_tokens"] > 0
    answer, header = await send(client, conversation(1))
    assert header == "hit"
    assert answer["usage"]["cache_read_input_tokens"] > 0
    cache = client.recorder.exchanges[-1].cache
    assert cache["status"] == "hit" and cache["read_input_tokens"] > 0
    assert cache["predicted"] is False
    assert noted(client)["read_input_tokens"] == cache["read_input_tokens"]
    assert await breaks(client) == {}
    found = samples(await (await client.get("/metrics")).text())
    assert value(found, "relay_cache_input_tokens_total", kind="read") == \
        cache["read_input_tokens"]


CHANGES = [
    ("system_changed", "system[1]",
     lambda body: body["system"][1].update(text="Be verbose.")),
    ("tools_changed", "tools[1]",
     lambda body: body["tools"][1].update(description="reads files")),
    ("tools_changed", "tools[0]", lambda body: body["tools"].reverse()),
    ("messages_changed", "messages[1].content[0]",
     lambda body: body["messages"][1]["content"][0].update(text="edited")),
    ("model_changed", "model", lambda body: body.update(model="claude-other")),
    ("thinking_changed", "thinking",
     lambda body: body.update(thinking={"type": "enabled", "budget_tokens": 1024})),
    ("tool_choice_changed", "tool_choice", lambda body: body.update(tool_choice={"type": "any"})),
]


@pytest.mark.parametrize("cause, where, change", CHANGES, ids=[c[0] + c[1] for c in CHANGES])
async def test_each_change_of_the_clients_bytes_is_a_named_break(relay_client, cause, where,
                                                                  change):
    client = await start(relay_client)
    await send(client, conversation(1))
    body = conversation(2)
    change(body)
    answer, header = await send(client, body)
    assert header == f"miss; cause={cause}; where={where}; by=client"
    entry = noted(client)
    assert (entry["cause"], entry["where"], entry["by"]) == (cause, where, "client")
    assert await breaks(client) == {cause: 1}
    # The emulator's own cache, which knows nothing of the relay's, agrees: the part after
    # the change was written again.
    assert answer["usage"]["cache_creation_input_tokens"] > 0


async def test_a_plugins_rewrite_is_named(relay_client):
    client = await start(relay_client, "stamp", extra={"stamp": Stamp()})
    await send(client, conversation(1))
    _, header = await send(client, conversation(2))
    assert header == "miss; cause=system_changed; where=system[0]; by=stamp"
    assert await breaks(client) == {"system_changed": 1}
    entry = noted(client)
    assert (entry["cause"], entry["where"], entry["by"]) == ("system_changed", "system[0]", "stamp")


async def test_the_lifetime_lapsing(relay_client):
    client = await start(relay_client)
    await send(client, conversation(1))
    # Six minutes pass, for the relay's record and for the upstream's cache.
    plugin = client.chain.pm.get_plugin("cache")
    for entry in list(plugin.records._entries.values()):
        for lane in entry[2].lanes:
            lane.time -= 360
    state = client.upstream.app[emulator.STATE]
    for digest in state.prompt_cache:
        state.prompt_cache[digest] -= 360
    _, header = await send(client, conversation(2))
    assert header == "miss; cause=ttl_expired"
    entry = noted(client)
    assert entry["cause"] == "ttl_expired" and entry["gap_seconds"] >= 360
    assert await breaks(client) == {"ttl_expired": 1}


async def test_a_prefix_the_upstream_no_longer_holds(relay_client):
    client = await start(relay_client)
    await send(client, conversation(1))
    client.upstream.app[emulator.STATE].prompt_cache.clear()  # evicted upstream
    _, header = await send(client, conversation(2))
    assert header == "miss; cause=unexplained"
    assert noted(client)["cause"] == "unexplained"
    assert await breaks(client) == {"unexplained": 1}


async def test_a_credential_switch(relay_client):
    pool = Pool()
    client = await start(relay_client, "pool", extra={"pool": pool})
    await send(client, conversation(1))
    pool.credential = "key-2"
    client.upstream.app[emulator.STATE].prompt_cache.clear()  # another organisation's cache
    _, header = await send(client, conversation(2))
    assert header == "miss; cause=credential_changed"
    assert noted(client)["cause"] == "credential_changed"
    assert await breaks(client) == {"credential_changed": 1}


async def test_a_backend_switch(aiohttp_server, aiohttp_client):
    upstreams = [await aiohttp_server(emulator.create_app(emulator.EmulatorOptions(
        prompt_cache=True, diagnostics=False))) for _ in range(2)]
    recorder = Recorder()
    client = await start_relay(aiohttp_client, {
        "pipeline": ["recorder", "metrics", "cache"],
        "backends": [{"name": name, "url": str(upstream.make_url("")).rstrip("/"),
                      "models": [pattern]}
                     for name, upstream, pattern in zip(("a", "b"), upstreams,
                                                        ("claude-a*", "claude-b*"), strict=True)],
    }, extra={"recorder": recorder})
    client.recorder = recorder
    try:
        await send(client, conversation(1, model="claude-a"))
        _, header = await send(client, conversation(2, model="claude-b"))
        assert header == "miss; cause=backend_changed; where=a -> b"
        assert noted(client)["cause"] == "backend_changed"
        assert await breaks(client) == {"backend_changed": 1}
        # And back: b's record is the newest, a's cache has lapsed for nobody.
        _, header = await send(client, conversation(3, model="claude-b"))
        assert header == "hit"
    finally:
        await client.close()
        await client.chain.shutdown(client.config)


async def test_a_stream_says_its_header_is_a_prediction(relay_client):
    client = await start(relay_client)
    await send(client, conversation(1))
    resp = await client.post("/v1/messages", json={**conversation(2), "stream": True},
                             headers=SESSION)
    assert resp.status == 200
    assert resp.headers["x-relay-cache"] == "hit; predicted"
    await resp.read()
    cache = client.recorder.exchanges[-1].cache
    assert cache["status"] == "hit" and cache["predicted"] is False
    body = conversation(3)
    body["system"][1]["text"] = "changed"
    resp = await client.post("/v1/messages", json={**body, "stream": True}, headers=SESSION)
    assert resp.headers["x-relay-cache"] == \
        "miss; cause=system_changed; where=system[1]; by=client; predicted"
    await resp.read()
    assert await breaks(client) == {"system_changed": 1}


async def test_subagents_and_small_model_calls_keep_lanes_of_their_own(relay_client):
    """Claude Code sends its subagents' and its small model's requests with the main loop's
    session id: each conversation (its own first message) is compared with its own."""
    client = await start(relay_client)
    session = SESSION
    for turns in (1, 2):
        resp = await client.post("/v1/messages", json=conversation(turns), headers=session)
        side = {"model": "claude-small", "max_tokens": 50, "system": "Title this.",
                "messages": [{"role": "user", "content": f"title {turns}"}]}
        other = await client.post("/v1/messages", json=side, headers=session)
        assert other.headers["x-relay-cache"] == "none"
    assert resp.headers["x-relay-cache"] == "hit"
    assert await breaks(client) == {}


# --- diagnostics --------------------------------------------------------------------------


def asking(body: dict, previous: str | None) -> dict:
    return {**body, "diagnostics": {"previous_message_id": previous}}


DIAGNOSED = [
    (lambda body: body["system"][1].update(text="x"), BetaCacheMissSystemChanged),
    (lambda body: body["tools"][0].update(description="x"), BetaCacheMissToolsChanged),
    (lambda body: body["messages"][1]["content"][0].update(text="x"),
     BetaCacheMissMessagesChanged),
    (lambda body: body.update(model="claude-other"), BetaCacheMissModelChanged),
    (lambda body: body.update(tool_choice={"type": "any"}), BetaCacheMissUnavailable),
    (lambda body: body.update(thinking={"type": "enabled", "budget_tokens": 1024}),
     BetaCacheMissUnavailable),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("change, kind", DIAGNOSED, ids=[k.__name__ for _, k in DIAGNOSED])
async def test_diagnostics_for_a_backend_without_them(relay_client, change, kind, stream):
    client = await start(relay_client)
    first, _ = await send(client, asking(conversation(1), None))
    assert BetaMessage.model_validate(first).diagnostics is None
    body = asking(conversation(2), first["id"])
    change(body)
    message = await answer(client, body, stream)
    reason = message.diagnostics.cache_miss_reason
    assert isinstance(reason, kind)
    if hasattr(reason, "cache_missed_input_tokens"):
        assert reason.cache_missed_input_tokens > 0
    assert any(entry["action"] == "diagnosed" for entry in client.recorder.exchanges[-1].timeline)


async def answer(client, body: dict, stream: bool) -> BetaMessage:
    """The answer as the SDK reads it: a message, or a stream's message_start message."""
    resp = await client.post("/v1/messages", json={**body, "stream": stream}, headers=SESSION)
    assert resp.status == 200
    if not stream:
        return BetaMessage.model_validate(await resp.json())
    raw = await resp.read()
    for event in raw.split(b"\n\n"):
        if event.startswith(b"event: message_start"):
            data = orjson.loads(event.split(b"data: ", 1)[1])
            return BetaMessage.model_validate(data["message"])
    raise AssertionError("no message_start")


async def test_diagnostics_when_nothing_changed_or_nothing_is_known(relay_client):
    client = await start(relay_client)
    first, _ = await send(client, asking(conversation(1), None))
    second, _ = await send(client, asking(conversation(2), first["id"]))
    assert "diagnostics" not in second  # null: appended turns are no divergence
    unknown, _ = await send(client, asking(conversation(3), "msg_01unknown"))
    assert isinstance(BetaMessage.model_validate(unknown).diagnostics.cache_miss_reason,
                      BetaCacheMissPreviousMessageNotFound)
    # An answer whose request did not ask for diagnostics left no fingerprint, as with the API.
    plain, _ = await send(client, conversation(4))
    later, _ = await send(client, asking(conversation(5), plain["id"]))
    assert later["diagnostics"]["cache_miss_reason"]["type"] == "previous_message_not_found"


async def test_a_backend_that_holds_diagnostics_answers_alone(relay_client):
    """Never both: the emulator answers diagnostics itself (``unavailable`` for an id it
    knows), and with ``holds_diagnostics`` the relay leaves that answer as it came."""
    recorder = Recorder()
    client = await relay_client(["recorder", "cache"], extra={"recorder": recorder},
                                backend={"holds_diagnostics": True})
    first, _ = await send(client, asking(conversation(1), None))
    body = asking(conversation(2), first["id"])
    body["system"][1]["text"] = "changed"
    second, _ = await send(client, body)
    assert second["diagnostics"] == {"cache_miss_reason": {"type": "unavailable"}}
    assert not any(entry["action"] == "diagnosed" for entry in recorder.exchanges[-1].timeline)


async def test_the_session_record(relay_client):
    client = await start(relay_client)
    for turns in range(3):
        await send(client, conversation(turns))
    body = conversation(3)
    body["system"][1]["text"] = "changed"
    await send(client, body)
    plugin = client.chain.pm.get_plugin("cache")
    (record,) = [entry[2] for entry in plugin.records._entries.values()]
    summary = await plugin.summary(client.recorder.exchanges[-1].session())
    assert summary == record.summary()
    assert summary["turns"] == 4 and summary["backends"] == {"emulator": 4}
    assert summary["models"] == {"claude-test": 4}
    assert summary["cache"]["breaks"] == {"system_changed": 1}
    assert summary["cache"]["read_input_tokens"] > 0
    assert len(record.lanes) == 1


async def test_a_presumed_lapse_gives_way_to_the_upstreams_own_read(relay_client):
    """Only the record's clock moved: the upstream still holds the prefix and reads it, and
    its usage has the last word."""
    client = await start(relay_client)
    await send(client, conversation(1))
    plugin = client.chain.pm.get_plugin("cache")
    for entry in list(plugin.records._entries.values()):
        for lane in entry[2].lanes:
            lane.time -= 360
    _, header = await send(client, conversation(2))
    assert header == "hit"
    assert await breaks(client) == {}


async def test_the_access_log_and_the_dump_carry_the_verdict(relay_client):
    client = await start(relay_client)
    await send(client, conversation(1))
    body = conversation(2)
    body["tools"][0]["description"] = "changed"
    await send(client, body)
    exchange = client.recorder.exchanges[-1]
    assert logs.access_fields(exchange, 200)["cache"] == "miss; cause=tools_changed"
    dumped = document.to_document(exchange, reason="test", when=datetime.datetime.now(
        datetime.timezone.utc), config={})
    assert dumped["cache"]["cause"] == "tools_changed"
    assert dumped["cache"]["where"] == "tools[0]"
    assert any(step["step"] == "cache" and step["action"] == "miss"
               for step in dumped["timeline"]["steps"])


class SharedMemory(MemoryState):
    """One process's memory standing in for a state that replicas share (Redis, SQLite),
    counting the calls a request waits for (a round trip each, on a real one)."""

    kind = "shared"

    def __init__(self):
        super().__init__()
        self.waited: collections.Counter = collections.Counter()

    async def get(self, namespace, keys):
        self.waited["get", namespace] += 1
        return await super().get(namespace, keys)

    async def put(self, namespace, items, ttl):
        self.waited["put", namespace] += 1
        await super().put(namespace, items, ttl)


async def test_replicas_on_a_shared_state_share_the_record(aiohttp_server, aiohttp_client):
    upstream = await aiohttp_server(emulator.create_app(emulator.EmulatorOptions(
        prompt_cache=True, diagnostics=False)))
    state = SharedMemory()
    replicas = []
    for _ in range(2):
        config = config_module.parse({
            "pipeline": ["cache"],
            "backends": [{"name": "emulator", "url": str(upstream.make_url("")).rstrip("/"),
                          "models": ["*"]}]}, {})
        chain = Chain(load_plugins(config.pipeline), config)
        chain.state = state
        await chain.startup(config)
        replicas.append(await aiohttp_client(create_app(config, chain)))
    first, header = await send(replicas[0], asking(conversation(1), None))
    assert header == "write"
    body = asking(conversation(2), first["id"])
    body["system"][1]["text"] = "changed"
    second, header = await send(replicas[1], body)
    assert header == "miss; cause=system_changed; where=system[1]; by=client"
    assert second["diagnostics"]["cache_miss_reason"]["type"] == "system_changed"
    _, header = await send(replicas[0], conversation(3) | {"system": body["system"]})
    assert header == "hit"
    # A request waits for one read of its session's record, never for its write (written
    # behind); a diagnosed answer is written before its client has its id.
    assert state.waited == {("get", "sessions"): 3, ("put", "cache-answers"): 2,
                            ("get", "cache-answers"): 1}
    (key,) = [key for namespace, key in state._kv if namespace == "sessions"]
    stored = await state.get("sessions", [key])
    assert Record.from_bytes(stored[0]).turns == 3
    for client in replicas:
        await client.close()


async def test_a_request_that_asks_nothing_of_the_cache_costs_nothing(relay_client):
    client = await start(relay_client)
    plain = {"model": "claude-test", "max_tokens": 50,
             "messages": [{"role": "user", "content": "hi"}]}
    for _ in range(2):
        _, header = await send(client, plain)
        assert header == "none"
    resp = await client.post("/v1/messages", json={**plain, "stream": True}, headers=SESSION)
    assert resp.status == 200 and resp.headers["x-relay-cache"] == "none"
    await resp.read()
    plugin = client.chain.pm.get_plugin("cache")
    assert len(plugin.records) == 0
    exchange = client.recorder.exchanges[-1]
    assert exchange.cache["status"] == "none"
    # Its answer hooks hand the chain nothing to await.
    assert plugin.relay_response(exchange, None) is None
    assert plugin.relay_stream_events(exchange) is None
    resp = await client.post("/v1/messages/count_tokens", json=conversation(1))
    assert resp.status == 200 and "x-relay-cache" not in resp.headers


class Unreachable(SharedMemory):
    async def get(self, namespace, keys):
        raise ConnectionError("state down")

    async def put(self, namespace, items, ttl):
        raise ConnectionError("state down")


async def test_a_shared_state_out_of_reach_costs_the_account_not_the_answer(
        aiohttp_server, aiohttp_client, caplog):
    upstream = await aiohttp_server(emulator.create_app(emulator.EmulatorOptions(
        prompt_cache=True, diagnostics=False)))
    config = config_module.parse({
        "pipeline": ["cache"],
        "backends": [{"name": "emulator", "url": str(upstream.make_url("")).rstrip("/"),
                      "models": ["*"]}]}, {})
    chain = Chain(load_plugins(config.pipeline), config)
    chain.state = Unreachable()
    await chain.startup(config)
    client = await aiohttp_client(create_app(config, chain))
    headers = [(await send(client, conversation(turns)))[1] for turns in (1, 2, 3)]
    # No record to compare with: the upstream's usage alone says what happened.
    assert headers == ["write", "hit", "hit"]
    warnings = [r for r in caplog.records if "session records" in r.getMessage()]
    assert len(warnings) == 1  # once a minute, not once a request


@pytest.mark.parametrize("stream", [False, True])
async def test_diagnostics_from_an_openai_format_backend(aiohttp_server, aiohttp_client, stream):
    """A Chat Completions backend has no diagnostics: the relay answers them, in the
    translated answer as in a native one."""
    options = emulator_openai.options_for(argparse.Namespace(
        **dataclasses.asdict(emulator.EmulatorOptions())))
    upstream = await aiohttp_server(emulator_openai.create_app(options))
    client = await start_relay(aiohttp_client, {
        "pipeline": ["cache"],
        "backends": [{"name": "oa", "url": str(upstream.make_url("/v1")), "models": ["*"],
                      "format": "openai"}]})
    try:
        first = await answer(client, asking(conversation(1, model="gpt-test"), None), stream)
        assert first.diagnostics is None
        body = asking(conversation(2, model="gpt-test"), first.id)
        body["tools"][0]["description"] = "changed"
        second = await answer(client, body, stream)
        assert isinstance(second.diagnostics.cache_miss_reason, BetaCacheMissToolsChanged)
    finally:
        await client.close()
        await client.chain.shutdown(client.config)


@pytest.mark.parametrize("store", ["sqlite", "redis"])
def test_replicas_share_the_session_record_through_the_real_store(emulator, relay, tmp_path,
                                                                  request, store):
    """Two relay processes on one shared state (a SQLite file, a redis-server), taking a
    session's requests in turn: each judges against the record the other left, and computes
    diagnostics for an answer the other gave."""
    import urllib.request

    url = (f"sqlite:///{tmp_path / 'state.db'}" if store == "sqlite"
           else request.getfixturevalue("redis_server").url)
    emu = emulator("--prompt-cache", "--no-diagnostics")
    config = {"pipeline": ["cache"], "state": {"url": url},
              "backends": [{"name": "emulator", "url": emu.url, "models": ["*"]}]}
    replicas = [relay(config), relay(config)]

    def send(replica, body: dict) -> tuple[dict, str]:
        # A session's record is written behind each answer, within milliseconds: the next
        # turn of a conversation comes after its client has read the answer.
        time.sleep(0.5)
        asked = urllib.request.Request(
            replica.url + "/v1/messages", data=orjson.dumps(body), method="POST",
            headers={"content-type": "application/json", "anthropic-version": "2023-06-01",
                     "x-api-key": "sk-test", **SESSION})
        with urllib.request.urlopen(asked, timeout=10) as answer:
            return orjson.loads(answer.read()), answer.headers["x-relay-cache"]

    first, header = send(replicas[0], asking(conversation(1), None))
    assert header == "write"
    body = asking(conversation(2), first["id"])
    body["system"][1]["text"] = "changed"
    second, header = send(replicas[1], body)
    assert header == "miss; cause=system_changed; where=system[1]; by=client"
    reason = BetaMessage.model_validate(second).diagnostics.cache_miss_reason
    assert isinstance(reason, BetaCacheMissSystemChanged)
    third, header = send(replicas[0], asking(conversation(3) | {"system": body["system"]},
                                             second["id"]))
    assert header == "hit"
    assert "diagnostics" not in third  # the other replica's answer, found: nothing diverged


async def test_a_backends_null_diagnostics_are_its_answer(aiohttp_server, aiohttp_client):
    """Never both: an upstream that answers ``diagnostics: null`` (the API's word for no
    divergence, BetaMessage.diagnostics) answered the request, though the relay does not
    know it holds diagnostics: its null is not replaced by the relay's own reason."""
    from aiohttp import web

    async def messages(request):
        body = await request.json()
        return web.json_response({
            "id": f"msg_{len(body['messages'])}", "type": "message", "role": "assistant",
            "model": body["model"], "content": [{"type": "text", "text": "ok"}],
            "stop_reason": "end_turn", "stop_sequence": None, "diagnostics": None,
            "usage": {"input_tokens": 10, "output_tokens": 1}})

    app = web.Application()
    app.router.add_post("/v1/messages", messages)
    upstream = await aiohttp_server(app)
    client = await start_relay(aiohttp_client, {"pipeline": ["cache"], "backends": [
        {"name": "proxy", "url": str(upstream.make_url("")).rstrip("/"), "models": ["*"]}]})
    try:
        # An earlier answer this relay never saw (another replica's, say).
        resp = await client.post("/v1/messages", headers=SESSION,
                                 json=asking(conversation(1), "msg_elsewhere"))
        answer = await resp.json()
        assert resp.status == 200, answer
        assert BetaMessage.model_validate(answer).diagnostics is None
        assert answer["diagnostics"] is None
    finally:
        await client.chain.shutdown(client.config)
