"""Reused tool ids, end to end: the anthropic SDK drives a tool loop through the relay (a real
server) to an emulator that reuses its ids every turn."""

from __future__ import annotations

import anthropic
import pytest
from support import backend

pytestmark = pytest.mark.e2e

TOOLS = [{"name": "Bash", "description": "Run a command",
          "input_schema": {"type": "object", "properties": {"command": {"type": "string"}},
                           "required": ["command"]}}]
MAX_TURNS = 12  # every session below ends well before this


def sdk(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="sk-test-client", max_retries=0, timeout=30)


def run_session(client: anthropic.Anthropic, stream: bool):
    """Drive the tool loop as an agent does; return the final message and every call id seen."""
    messages = [{"role": "user", "content": "Run the tool until you are done."}]
    seen = []
    for _ in range(MAX_TURNS):
        request = {"model": "claude-test", "max_tokens": 200, "messages": messages, "tools": TOOLS}
        if stream:
            with client.messages.stream(**request) as events:
                message = events.get_final_message()
        else:
            message = client.messages.create(**request)
        messages.append({"role": "assistant",
                         "content": [b.model_dump(exclude_none=True) for b in message.content]})
        calls = [b for b in message.content if b.type == "tool_use"]
        seen += [c.id for c in calls]
        if message.stop_reason != "tool_use":
            return message, seen
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": c.id, "content": f"ran {c.input['command']}"}
            for c in calls]})
    raise AssertionError(f"the session did not end within {MAX_TURNS} turns")


def upstream_tool_use_ids(request: dict) -> list[str]:
    return [b["id"] for m in request["body"]["messages"] if m["role"] == "assistant"
            and isinstance(m["content"], list) for b in m["content"] if b["type"] == "tool_use"]


@pytest.mark.parametrize("pipeline", [["dedup"], ["dedup", "pairing", "ordering"]],
                         ids=["dedup", "full"])
@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_a_session_whose_upstream_reuses_one_id_every_turn_completes(emulator, relay, stream, pipeline):
    emu = emulator("--tool-turns", "6", "--reuse-ids")
    r = relay({"pipeline": pipeline, "backends": [backend(emu.url)]})
    final, seen = run_session(sdk(r.url), stream)
    assert final.stop_reason == "end_turn"
    assert seen == ["toolu_01ReusedId00000000000000"] + [
        f"toolu_01ReusedId00000000000000-{n}" for n in range(2, 7)]
    received = emu.requests()
    assert len(received) == 7
    assert upstream_tool_use_ids(received[-1]) == seen  # -N ids go up as the client holds them


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_parallel_kimi_style_ids_reused_every_turn_stay_unique_for_the_client(emulator, relay, stream):
    emu = emulator("--tool-turns", "4", "--id-style", "functions", "--parallel", "2", "--reuse-ids")
    r = relay({"pipeline": ["dedup"], "backends": [backend(emu.url)]})
    final, seen = run_session(sdk(r.url), stream)
    assert final.stop_reason == "end_turn"
    assert len(seen) == 8 and len(set(seen)) == 8
    assert seen[:4] == ["functions.Bash:0", "functions.Bash:1", "functions.Bash:0-2", "functions.Bash:1-2"]


def test_the_same_session_sent_directly_dies_on_the_duplicate(emulator):
    emu = emulator("--tool-turns", "6", "--reuse-ids")
    with pytest.raises(anthropic.BadRequestError) as e:
        run_session(sdk(emu.url), stream=False)
    assert e.value.status_code == 400
    assert e.value.body["error"]["message"] == "messages.3.content.1: `tool_use` ids must be unique"
    # ... and a Kimi-like upstream hands the client the same ids again and again.
    emu = emulator("--tool-turns", "3", "--id-style", "functions", "--parallel", "2", "--reuse-ids")
    _, seen = run_session(sdk(emu.url), stream=False)
    assert seen == ["functions.Bash:0", "functions.Bash:1"] * 3


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_restore_mode_gives_the_upstream_back_its_own_ids(emulator, relay, stream):
    emu = emulator("--tool-turns", "4", "--id-style", "functions", "--parallel", "2",
                   "--reuse-ids", "--expect-own-ids")
    r = relay({"pipeline": ["dedup"],
               "backends": [backend(emu.url, quirks={"restore_original_ids": True})]})
    final, seen = run_session(sdk(r.url), stream)
    assert final.stop_reason == "end_turn"
    assert len(seen) == 8 and len(set(seen)) == 8
    assert upstream_tool_use_ids(emu.requests()[-1]) == ["functions.Bash:0", "functions.Bash:1"] * 4


def test_without_restore_mode_an_upstream_expecting_its_own_ids_refuses_the_rewrites(emulator, relay):
    emu = emulator("--tool-turns", "4", "--id-style", "functions", "--parallel", "2",
                   "--reuse-ids", "--expect-own-ids")
    r = relay({"pipeline": ["dedup"], "backends": [backend(emu.url)]})
    with pytest.raises(anthropic.BadRequestError) as e:
        run_session(sdk(r.url), stream=False)
    assert "unknown `tool_use` id functions.Bash:0-2" in e.value.body["error"]["message"]
