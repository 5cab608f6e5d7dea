"""What the portable plugin does to answers, through a real relay in front of the strict
emulator: a Kimi-like backend's ids reach the client in Anthropic's grammar (so clients that
"sanitise" ids never hold a repeated one), and thinking a backend returned unasked is
recorded like any other, streamed or not.
"""

from __future__ import annotations

import hashlib
import re

import pytest
from support import backend
from test_sdk_e2e import BASH, client

pytestmark = pytest.mark.e2e

ANTHROPIC_IDS = re.compile("^[a-zA-Z0-9_-]+$")
PIPELINE = ["metrics", "dedup", "pairing", "ordering", "portable"]
TURNS = 4


def litellm_like(tool_id: str) -> str:
    """LiteLLM (and many gateways) replace what Anthropic's grammar does not admit with `_`."""
    return re.sub(r"[^a-zA-Z0-9_-]", "_", tool_id)


def langchain_like(tool_id: str) -> str:
    """LangChain sends an id outside the grammar back as ``toolu_`` and a hash of it."""
    if ANTHROPIC_IDS.fullmatch(tool_id):
        return tool_id
    return "toolu_" + hashlib.sha256(tool_id.encode()).hexdigest()[:24]


SANITISERS = {"as-is": lambda tool_id: tool_id, "litellm": litellm_like,
              "langchain": langchain_like}


def tool_loop(url: str, sanitise, stream: bool, models=("m",), thinking=None) -> list[str]:
    """A tool loop through the relay whose client rewrites every tool id it sends back with
    ``sanitise``; the ids it held, as it holds them, call after call. Turn n asks model n
    (cycling)."""
    sdk = client(url, max_retries=0)
    messages: list = [{"role": "user", "content": "Run the tool until you are done."}]
    held: list[str] = []
    for turn in range(TURNS + 2):
        request = {"model": models[turn % len(models)], "max_tokens": 2048, "tools": [BASH],
                   "messages": messages}
        if thinking:
            request["thinking"] = thinking
        if stream:
            with sdk.messages.stream(**request) as events:
                message = events.get_final_message()
        else:
            message = sdk.messages.create(**request)
        content = [block.model_dump(exclude_none=True) for block in message.content]
        for block in content:
            if block["type"] == "tool_use":
                block["id"] = sanitise(block["id"])
                held.append(block["id"])
        messages.append({"role": "assistant", "content": content})
        if message.stop_reason != "tool_use":
            return held
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": block["id"], "content": "done"}
            for block in content if block["type"] == "tool_use"]})
    raise AssertionError("the loop did not end")


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
@pytest.mark.parametrize("sanitiser", SANITISERS)
def test_a_kimi_like_backends_reused_ids_reach_every_client_fitting_and_never_twice(
        emulator, relay, stream, sanitiser):
    kimi = emulator("--id-style", "functions", "--reuse-ids", "--parallel", "2",
                    "--tool-turns", str(TURNS))
    r = relay({"pipeline": PIPELINE, "backends": [backend(kimi.url)]})
    held = tool_loop(r.url, SANITISERS[sanitiser], stream)
    assert len(held) == TURNS * 2
    assert all(ANTHROPIC_IDS.fullmatch(tool_id) for tool_id in held), held
    # What the client got it sends back unchanged, however it sanitises: no repeat reaches it.
    assert len(set(held)) == len(held), held
    # The backend minted the same two ids every turn and accepted what came back each time
    # (a refusal would have raised in the loop).
    assert len(kimi.requests()) == TURNS + 1


@pytest.mark.parametrize("sanitiser", ["litellm", "langchain"])
def test_without_the_translation_a_sanitising_client_holds_a_repeated_id(emulator, relay,
                                                                          sanitiser):
    kimi = emulator("--id-style", "functions", "--reuse-ids", "--parallel", "2",
                    "--tool-turns", str(TURNS))
    r = relay({"pipeline": [p for p in PIPELINE if p != "portable"],
               "backends": [backend(kimi.url)]})
    held = tool_loop(r.url, SANITISERS[sanitiser], False)
    assert len(set(held)) == 2  # dedup never sees the ids the client sends back as its own


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_thinking_nobody_asked_for_is_recorded_and_kept_from_the_next_backend(
        emulator, relay, tmp_path, stream):
    """Both backends think although the requests never ask them to; each signs with its own
    key, so each refuses the other's thinking."""
    started = [emulator("--thinking", "--signing-secret", f"secret-of-{name}", "--tool-turns",
                        str(TURNS)) for name in ("a", "b")]
    r = relay({"pipeline": PIPELINE,
               "backends": [backend(emu.url, name=name, models=[f"model-{name}"])
                            for emu, name in zip(started, ("a", "b"), strict=True)]})
    held = tool_loop(r.url, SANITISERS["as-is"], stream, models=("model-a", "model-b"))
    assert len(held) == TURNS
    for emu in started:
        bodies = [record["body"] for record in emu.requests()]
        assert bodies and all("thinking" not in body for body in bodies)  # nobody asked
        # Each backend got its own thinking back and none of the other's (which it refuses).
        assert any(block["type"] == "thinking" for body in bodies[1:]
                   for message in body["messages"] if message["role"] == "assistant"
                   for block in message["content"])


def test_a_transcript_holding_a_minted_id_as_it_was_gets_the_repeat_renamed_and_moves_on(
        emulator, relay):
    """A session from before answers were translated holds ``functions.Bash:0`` as minted.
    When the Kimi-like backend mints it again, the repeat is renamed by dedup (as it was)
    rather than encoded: encoded, it would be another id to dedup, and both would go up to
    the next backend as ``relayid_...``, one id twice."""
    kimi = emulator("--id-style", "functions", "--reuse-ids", "--tool-turns", "3")
    strict = emulator("--tool-turns", "3")  # ids unique across the whole conversation
    r = relay({"pipeline": PIPELINE,
               "backends": [backend(kimi.url, name="kimi", models=["model-k"]),
                            backend(strict.url, name="anthropic", models=["model-a"])]})
    sdk = client(r.url, max_retries=0)
    messages = [
        {"role": "user", "content": "Run the tool until you are done."},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "functions.Bash:0", "name": "Bash",
             "input": {"command": "true"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "functions.Bash:0", "content": "done"}]}]
    answer = sdk.messages.create(model="model-k", max_tokens=256, tools=[BASH],
                                 messages=messages)
    (call,) = [block for block in answer.content if block.type == "tool_use"]
    assert call.id == "functions.Bash:0-2"
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                   for b in answer.content]},
                 {"role": "user", "content": [
                     {"type": "tool_result", "tool_use_id": call.id, "content": "done"}]}]
    sdk.messages.create(model="model-a", max_tokens=256, tools=[BASH], messages=messages)
    (sent,) = [record["body"] for record in strict.requests()]
    ids = [block["id"] for message in sent["messages"] if message["role"] == "assistant"
           for block in message["content"] if block["type"] == "tool_use"]
    assert len(set(ids)) == 2 and all(ANTHROPIC_IDS.fullmatch(i) for i in ids), ids
