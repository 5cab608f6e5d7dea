"""The relay never breaks the prompt cache itself: generated sessions through the shipped
pipeline (relay.yaml's plugins, pairing repairing, the cache plugin) in front of two emulated
backends with prompt caches, one that mints ids in another grammar: reused ids, calls left
without results, backend switches, thinking. Each upstream-bound body's prefix up to the previous
request's last breakpoint is the previous request's, except where the relay recorded a
cause; and where it recorded a structural one, it was not the client's doing.

The prefixes are compared here on the emulator's side, from the bodies it received, decoded
(tools, system, a parameters entry, then each message's role and blocks, markers left out):
apart from the relay's own fingerprint of the raw bytes.
"""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path

import orjson
import yaml
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relay import config as config_module
from relay.chain import Chain, load_plugins
from relay.hookspecs import hookimpl
from relay.server import create_app
from relay.testing import emulator

ROOT = Path(__file__).resolve().parent.parent
CC = {"type": "ephemeral"}
TOOLS = [{"name": "Bash", "input_schema": {"type": "object", "properties": {
    "command": {"type": "string"}}}},
         {"name": "Read", "input_schema": {"type": "object"}, "cache_control": CC}]
SYSTEM = [{"type": "text", "text": "You are a coding agent."},
          {"type": "text", "text": "Be terse.", "cache_control": CC}]
STRUCTURAL = ("model_changed", "tools_changed", "system_changed", "messages_changed",
              "thinking_changed", "tool_choice_changed")


@st.composite
def sessions(draw):
    turns = draw(st.integers(2, 6))
    return {"turns": turns,
            "reuse_ids": draw(st.booleans()),
            "thinking": draw(st.booleans()),
            "parallel": draw(st.integers(1, 2)),
            "backends": draw(st.lists(st.sampled_from("ab"), min_size=turns, max_size=turns)),
            "unanswered_at": draw(st.one_of(st.none(), st.integers(0, turns - 1))),
            "stream": draw(st.lists(st.booleans(), min_size=turns, max_size=turns))}


class Recorder:
    def __init__(self):
        self.exchanges = []

    @hookimpl
    def relay_exchange_end(self, exchange):
        if exchange.endpoint == "messages":
            self.exchanges.append(exchange)


def _uncached(value):
    if isinstance(value, dict):
        return {k: _uncached(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [_uncached(v) for v in value]
    return value


def _marked(value) -> bool:
    return orjson.dumps(value).find(b'"cache_control"') >= 0


def pieces(body: dict) -> tuple[list[bytes], int]:
    """The prompt as the cache sees it, and the index of its last breakpoint."""
    out: list[bytes] = [orjson.dumps(["model", body.get("model")])]
    last = -1

    def add(value, marked):
        nonlocal last
        out.append(orjson.dumps(_uncached(value), option=orjson.OPT_SORT_KEYS))
        if marked:
            last = len(out) - 1

    for tool in body.get("tools") or ():
        add(tool, _marked(tool))
    system = body.get("system")
    for block in [{"type": "text", "text": system}] if isinstance(system, str) else system or ():
        add(block, _marked(block))
    add(["parameters", body.get("thinking"), body.get("tool_choice")], False)
    for message in body["messages"]:
        add(["role", message["role"]], False)
        content = message["content"]
        for block in [{"type": "text", "text": content}] if isinstance(content, str) else content:
            add(block, _marked(block))
    return out, last


def answer_of(raw: bytes) -> dict:
    """The message a stream makes, put together from its events (as an SDK does)."""
    message: dict = {}
    for event in raw.split(b"\n\n"):
        if b"data: " not in event:
            continue
        data = orjson.loads(event.split(b"data: ", 1)[1])
        kind = data.get("type")
        if kind == "message_start":
            message = data["message"]
        elif kind == "content_block_start":
            message["content"].append(dict(data["content_block"]))
        elif kind == "content_block_delta":
            block, delta = message["content"][data["index"]], data["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                block["signature"] = delta["signature"]
            elif delta["type"] == "input_json_delta":
                block["partial"] = block.get("partial", "") + delta["partial_json"]
    for block in message.get("content", ()):
        if block["type"] == "tool_use":
            partial = block.pop("partial", "")
            block["input"] = orjson.loads(partial) if partial else {}
    return message


async def run(session: dict, tmp: Path) -> None:
    servers = []
    for style in ("anthropic", "functions"):
        options = emulator.EmulatorOptions(
            tool_turns=99, reuse_ids=session["reuse_ids"], thinking=session["thinking"],
            parallel=session["parallel"], id_style=style, prompt_cache=True, diagnostics=False)
        server = TestServer(emulator.create_app(options), host="127.0.0.1")
        await server.start_server()
        servers.append(server)
    shipped = yaml.safe_load((ROOT / "relay.yaml").read_text())
    raw = {"pipeline": ["recorder", *shipped["pipeline"]],
           "plugins": {**shipped["plugins"], "dump": {"dir": str(tmp / "dumps")},
                       "portable": {}, "pairing": {"pairing_mode": "repair"}},
           "backends": [
               {"name": "a", "url": str(servers[0].make_url("")).rstrip("/"),
                "models": ["claude-a*"]},
               {"name": "b", "url": str(servers[1].make_url("")).rstrip("/"),
                "models": ["claude-b*"]}]}
    config = config_module.parse(raw, {})
    recorder = Recorder()
    chain = Chain(load_plugins(config.pipeline, extra={"recorder": recorder}), config)
    await chain.startup(config)
    client = TestClient(TestServer(create_app(config, chain), host="127.0.0.1"))
    await client.start_server()
    try:
        await converse(client, session)
        check(session, servers, recorder)
    finally:
        await client.close()
        await chain.shutdown(config)
        for server in servers:
            await server.close()


async def converse(client, session: dict) -> None:
    messages: list = [{"role": "user", "content": [{"type": "text", "text": "fix the bug"}]}]
    for turn in range(session["turns"]):
        body = {"model": f"claude-{session['backends'][turn]}-1", "max_tokens": 4096,
                "tools": copy.deepcopy(TOOLS), "system": copy.deepcopy(SYSTEM),
                "messages": copy.deepcopy(messages),
                "stream": session["stream"][turn]}
        if session["thinking"]:
            body["thinking"] = {"type": "enabled", "budget_tokens": 1024}
        body["messages"][-1]["content"][-1]["cache_control"] = CC  # the marker moves on
        resp = await client.post("/v1/messages", json=body,
                                 headers={"x-claude-code-session-id": "property"})
        raw = await resp.read()
        assert resp.status == 200, raw[:500]
        answer = answer_of(raw) if body["stream"] else orjson.loads(raw)
        messages.append({"role": "assistant", "content": answer["content"]})
        results = [{"type": "tool_result", "tool_use_id": block["id"], "content": "ok"}
                   for block in answer["content"] if block["type"] == "tool_use"]
        if turn == session["unanswered_at"]:
            del results[0]  # a call left without its result: pairing adds one, every turn
        messages.append({"role": "user",
                         "content": results + [{"type": "text", "text": f"turn {turn}"}]})


def check(session: dict, servers, recorder: Recorder) -> None:
    received = {name: [orjson.loads(record[-1])
                       for record in server.app[emulator.STATE].records]
                for name, server in zip("ab", servers, strict=True)}
    bodies = [received[name].pop(0) for name in session["backends"]]
    assert len(recorder.exchanges) == len(bodies)
    last_on: dict[str, int] = {}
    for i, body in enumerate(bodies):
        backend = session["backends"][i]
        cache = recorder.exchanges[i].cache
        assert cache is not None
        j = last_on.get(backend)
        last_on[backend] = i
        if j is None:
            # The conversation's first request on this backend: nothing there to read yet.
            assert cache["status"] != "hit", (i, cache)
            assert cache["cause"] in (None, "backend_changed"), (i, cache)
            continue
        # The cache it can read is its backend's: compared with that backend's last request.
        before, last = pieces(bodies[j])
        now, _ = pieces(body)
        if now[:last + 1] == before[:last + 1]:
            assert cache["cause"] not in STRUCTURAL, (i, cache)
            continue
        # The relay changed the prefix only for a reason it names: the thinking switch the
        # API forces (portable's), never as if the client had.
        assert cache["status"] == "miss", (i, cache, first_difference(before, now))
        assert cache["cause"] == "thinking_changed", (i, cache, first_difference(before, now))
        assert "portable" in cache["by"].split(","), (i, cache)


def first_difference(before: list, now: list) -> tuple:
    for j, (a, b) in enumerate(zip(before, now, strict=False)):
        if a != b:
            return j, a[:200], b[:200]
    return len(before), None, None


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(sessions())
def test_the_relay_never_breaks_the_cache_itself(tmp_path, session):
    asyncio.run(run(session, tmp_path))
