"""Preserved thinking: a thinking block sent back must come with the prefix it was produced
under. On the models with preserved thinking (claude-fable-5-1/5-2, claude-mythos-5-1/5-2,
claude-opus-5-5, claude-sonnet-5-5, claude-haiku-5-5) "The top-level system prompt, tools,
and messages before the block are its prefix. If the prefix differs from what you sent when
the block was produced, that block and every later thinking block are invalid, and the API
rejects the request with a 400 error or drops the invalid blocks"; the check "also fails if a
thinking block between others was left out or moved"
(https://platform.claude.com/docs/en/build-with-claude/preserved-thinking,
https://platform.claude.com/docs/en/build-with-claude/preserved-thinking/prefix-checks).

A client that sends its history back as it got it passes that check; the relay must not make
it fail. Generated sessions through the shipped pipeline (dedup, pairing repairing, ordering,
portable, the cache plugin) in front of two emulated backends, one minting ids in another
grammar, with model switches on one backend and backend switches, reused ids, calls left
without results, streams, and a provenance record that may forget (``provenance_rows``: an
evicted entry, a restart without the file, a replica without the record). For every thinking
block each backend received, its prefix there (``system``, ``tools``, the messages before
it; ``cache_control`` left out, as the check leaves it out) is the one the request that
produced it had on that backend.
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
from relay.server import create_app
from relay.testing import emulator
from tests.test_cache_properties import CC, SYSTEM, TOOLS, Recorder, _uncached, answer_of

ROOT = Path(__file__).resolve().parent.parent
# Backend a serves two models with preserved thinking (Fable 5.1 reads Opus 5.5's blocks on
# the Claude API, Opus 5.5 does not read Fable 5.1's: the emulator reads any, which the check
# here does not depend on), b an older one.
MODELS = ("claude-opus-5-5", "claude-fable-5-1", "claude-b-1")


@st.composite
def sessions(draw):
    turns = draw(st.integers(2, 6))
    return {"turns": turns,
            "reuse_ids": draw(st.booleans()),
            "parallel": draw(st.integers(1, 2)),
            "models": draw(st.lists(st.sampled_from(MODELS), min_size=turns, max_size=turns)),
            "unanswered_at": draw(st.one_of(st.none(), st.integers(0, turns - 1))),
            "stream": draw(st.lists(st.booleans(), min_size=turns, max_size=turns)),
            "rows": draw(st.sampled_from((100000, 1, 2))),
            # Backend a fails every K-th request (529): its fallback c, serving the same
            # models, answers that one, and the next goes to a again.
            "fail_every": draw(st.sampled_from((0, 2, 3))),
            # Claude Code sends adaptive thinking to the newer models.
            "thinking": draw(st.sampled_from(("adaptive", "enabled")))}


def prefix(body: dict, message: int) -> bytes:
    """What the prefix check compares for a block in ``messages[message]`` (at its start):
    ``system``, ``tools`` and the messages before it, markers left out."""
    system = body.get("system")
    if isinstance(system, str):
        system = [{"type": "text", "text": system}]
    messages = []
    for m in body["messages"][:message]:
        content = m["content"]
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        messages.append({"role": m["role"], "content": content})
    return orjson.dumps(_uncached({"tools": body.get("tools"), "system": system,
                                   "messages": messages}), option=orjson.OPT_SORT_KEYS)


def thinking_in(body: dict):
    for i, message in enumerate(body["messages"]):
        if message["role"] != "assistant" or not isinstance(message["content"], list):
            continue
        for k, block in enumerate(message["content"]):
            if block.get("type") == "thinking":
                yield i, k, block["signature"]


async def run(session: dict, tmp: Path, options: dict | None = None) -> list:
    servers, emulated = [], []
    fail_every = session.get("fail_every", 0)
    for name, style in (("a", "anthropic"), ("b", "functions"), ("c", "anthropic")):
        opts = emulator.EmulatorOptions(
            tool_turns=99, reuse_ids=session["reuse_ids"], thinking=True,
            parallel=session["parallel"], id_style=style, prompt_cache=True, diagnostics=False,
            signing_secret=f"secret-{name}",
            fail_status=529 if name == "a" and fail_every else None,
            fail_every=fail_every if name == "a" else 0)
        server = TestServer(emulator.create_app(opts), host="127.0.0.1")
        await server.start_server()
        servers.append(server)
        emulated.append(opts)
    shipped = yaml.safe_load((ROOT / "relay.yaml").read_text())
    raw = {"pipeline": ["recorder", *shipped["pipeline"]],
           "plugins": {**shipped["plugins"], "dump": {"dir": str(tmp / "dumps")},
                       "portable": {"provenance_rows": session["rows"], **(options or {})},
                       "pairing": {"pairing_mode": "repair"}},
           "backends": [
               {"name": "a", "url": str(servers[0].make_url("")).rstrip("/"),
                "models": ["claude-opus-5-5", "claude-fable-5-1"], "fallbacks": ["c"]},
               {"name": "b", "url": str(servers[1].make_url("")).rstrip("/"),
                "models": ["claude-b*"]},
               {"name": "c", "url": str(servers[2].make_url("")).rstrip("/"),
                "models": ["claude-c*"]}]}
    config = config_module.parse(raw, {})
    recorder = Recorder()
    chain = Chain(load_plugins(config.pipeline, extra={"recorder": recorder}), config)
    await chain.startup(config)
    client = TestClient(TestServer(create_app(config, chain), host="127.0.0.1"))
    await client.start_server()
    try:
        await converse(client, session)
        return violations(servers, emulated, bool(session.get("refused")))
    finally:
        await client.close()
        await chain.shutdown(config)
        for server in servers:
            await server.close()


async def converse(client, session: dict) -> None:
    messages: list = [{"role": "user", "content": [{"type": "text", "text": "fix the bug"}]}]
    for turn, model in enumerate(session["models"]):
        body = {"model": model, "max_tokens": 4096, "tools": copy.deepcopy(TOOLS),
                "system": copy.deepcopy(SYSTEM), "messages": copy.deepcopy(messages),
                "stream": session["stream"][turn],
                "thinking": {"type": "adaptive"} if session["thinking"] == "adaptive"
                else {"type": "enabled", "budget_tokens": 1024}}
        body["messages"][-1]["content"][-1]["cache_control"] = CC  # the marker moves on
        resp = await client.post("/v1/messages", json=body,
                                 headers={"x-claude-code-session-id": "preserved"})
        raw = await resp.read()
        if resp.status == 400 and b"Invalid `signature`" in raw and session["rows"] < 100:
            # A record that forgot the issuer sends another backend's block as the client
            # sent it, which is what a relay without the record does (docs/sessions.md).
            session["refused"] = True
            return
        assert resp.status == 200, raw[:500]
        answer = answer_of(raw) if body["stream"] else orjson.loads(raw)
        messages.append({"role": "assistant", "content": answer["content"]})
        results = [{"type": "tool_result", "tool_use_id": block["id"], "content": "ok"}
                   for block in answer["content"] if block["type"] == "tool_use"]
        if turn == session["unanswered_at"]:
            del results[0]  # a call left without its result: pairing adds one, every turn
        messages.append({"role": "user",
                         "content": results + [{"type": "text", "text": f"turn {turn}"}]})


def violations(servers, emulated, refused: bool = False) -> list:
    """Each thinking block backends a and c (their models have preserved thinking) received
    whose prefix there is not the one it was produced under (the emulator's answer to the
    request is rebuilt from that request: its thinking block comes first, its signature from
    the request alone; a request a failed made none). With ``refused``, the session's last
    request, which the emulator refused, is not judged (nor is any backend's last)."""
    found = []
    for name, server, opts in zip("abc", servers, emulated, strict=True):
        if name == "b":
            continue
        produced: dict[str, tuple[int, bytes]] = {}
        number = 0
        records = server.app[emulator.STATE].records
        for n, record in enumerate(records):
            body = orjson.loads(record[-1])
            if not body.get("messages"):
                continue
            number += 1
            if refused and n == len(records) - 1:
                continue
            for i, k, signature in thinking_in(body):
                if signature not in produced:
                    continue
                when, expected = produced[signature]
                if k != 0 or prefix(body, i) != expected:
                    found.append((name, n, f"messages.{i}.content.{k}", f"made by request {when}"))
            if emulator.is_fault(number, opts):
                continue
            content, _ = emulator.plan_reply(body, opts)
            if content and content[0]["type"] == "thinking":
                produced.setdefault(content[0]["signature"],
                                    (n, prefix(body, len(body["messages"]))))
    return found


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(sessions())
def test_the_relay_keeps_every_thinking_blocks_prefix(tmp_path, session):
    assert asyncio.run(run(session, tmp_path)) == []


def test_a_model_switch_on_one_backend_keeps_the_prefix_when_the_record_forgets(tmp_path):
    # Opus 5.5, then Fable 5.1 on the same backend, and back: the relay used to leave Opus
    # 5.5's block out of Fable 5.1's request (another model's), so Fable 5.1 thought under a
    # prefix without it; a record that kept one row (an evicted entry) no longer knew that
    # block two requests later and sent it, and Fable 5.1's thinking failed the prefix check.
    # The API drops a block the model cannot read without an error: it goes up as sent.
    models = ["claude-opus-5-5", "claude-fable-5-1", "claude-opus-5-5", "claude-fable-5-1"]
    session = {"turns": 4, "reuse_ids": False, "parallel": 1, "models": models,
               "unanswered_at": None, "stream": [False, True, False, True], "rows": 1,
               "thinking": "adaptive"}
    assert asyncio.run(run(session, tmp_path)) == []


def test_the_models_with_preserved_thinking_are_told_by_name():
    from relay_builtins.portable import preserved_thinking, verdict

    for model in ("claude-fable-5-1", "claude-fable-5-2", "claude-mythos-5-1",
                  "claude-mythos-5-2", "claude-opus-5-5", "claude-sonnet-5-5",
                  "claude-haiku-5-5", "anthropic.claude-haiku-5-5",
                  "us.anthropic.claude-opus-5-5", "claude-sonnet-5-5@20261001"):
        assert preserved_thinking(model), model
    for model in ("claude-opus-5", "claude-fable-5", "claude-sonnet-4-5", "claude-opus-5-50",
                  "claude-haiku-5-55", "my-claude-opus-5-5x", "claude-a-1", ""):
        assert not preserved_thinking(model), model
    issuers = {"k": ("api", "claude-opus-5-5")}
    # Another model of the same backend: the API judges it on these models, and only there.
    assert verdict("k", issuers, "api", "claude-fable-5-1", "model") is None
    assert verdict("k", issuers, "api", "claude-opus-5", "model") is not None
    # Another backend's block is still dropped (its signature is another issuer's).
    assert verdict("k", issuers, "bedrock", "claude-fable-5-1", "model") is not None
