"""OpenAI Chat Completions backends, end to end: the real Claude Code CLI and the anthropic SDK
through the relay in front of the emulator's ``--format openai``.

Through the whole pipeline, sessions whose upstream reuses its call ids (``call_0``,
``functions.Bash:0``), calls in parallel with fragments interleaved, names and ids that come
late, reasoning on and off, all complete; the same sessions through the translation alone
(``pipeline: []``) fail where the ids repeat. The anthropic SDK gets answers shaped like the
Anthropic emulator's, event for event.
"""

from __future__ import annotations

import json

import anthropic
import pytest
from support import backend
from test_claude_code import claude, claude_binary  # noqa: F401  (fixtures)
from test_sdk_e2e import BASH, Agent, client

pytestmark = pytest.mark.e2e

FULL = ["dedup", "pairing", "ordering"]

SESSIONS = {
    # the emulator's script, and the ids it hands out every turn
    "call-ids-reused": (("--reuse-ids",), ["call_0"]),
    "parallel-interleaved-late-ids": (
        ("--reuse-ids", "--parallel", "2", "--interleave", "--late-ids", "--ragged"),
        ["call_0", "call_1"]),
    "kimi-ids-reasoning": (
        ("--reuse-ids", "--id-style", "functions", "--parallel", "2", "--thinking"),
        ["functions.Bash:0", "functions.Bash:1"]),
    "reasoning-field-crlf": (
        ("--reuse-ids", "--thinking", "--reasoning-field", "reasoning", "--crlf", "--ragged"),
        ["call_0"]),
}


@pytest.fixture
def openai_relay(emulator, relay):
    """The OpenAI-format emulator with these options behind a relay running ``pipeline``."""
    def start(*emulator_args: str, pipeline=FULL, quirks=None):
        emu = emulator("--format", "openai", *emulator_args)
        extra = {"quirks": quirks} if quirks else {}
        r = relay({"pipeline": pipeline,
                   "backends": [backend(emu.url + "/v1", format="openai", **extra)]})
        return emu, r
    return start


def chat_requests(emu) -> list[dict]:
    return [r for r in emu.requests() if r["path"] == "/v1/chat/completions"]


def tool_turns(body: dict) -> list[list[tuple[str, str, str]]]:
    """Per assistant message with calls: (id, command, the answering tool message) per call.
    The emulator has already refused any history whose tool messages do not pair."""
    messages = body["messages"]
    turns = []
    for n, message in enumerate(messages):
        if message["role"] != "assistant" or not message.get("tool_calls"):
            continue
        answers = {}
        for following in messages[n + 1:]:
            if following["role"] != "tool":
                break
            answers[following["tool_call_id"]] = following["content"]
        turns.append([(c["id"], json.loads(c["function"]["arguments"])["command"],
                       answers.get(c["id"])) for c in message["tool_calls"]])
    return turns


def assert_every_call_ran(turns, count: int, parallel: int) -> None:
    assert len(turns) == count
    for turn, calls in enumerate(turns):
        assert len(calls) == parallel
        for i, (_, command, output) in enumerate(sorted(calls, key=lambda c: c[1])):
            assert command == f"echo relay-turn-{turn}-{i}"
            assert output.strip() == f"relay-turn-{turn}-{i}"  # Bash really ran it


@pytest.mark.parametrize("session", SESSIONS)
def test_claude_code_completes_tool_sessions_through_the_relay(openai_relay, claude, session):
    args, bases = SESSIONS[session]
    emu, r = openai_relay("--tool-turns", "5", *args, "--reask-dropped", "--max-requests", "40")
    run = claude.run(r.url)
    assert run.returncode == 0, run
    assert "All 5 tool turns done." in run.stdout
    received = chat_requests(emu)
    assert len(received) == 6  # five tool turns and the final answer, nothing asked twice
    turns = tool_turns(received[-1]["body"])
    assert_every_call_ran(turns, count=5, parallel=len(bases))
    for turn, calls in enumerate(turns):  # unique for the upstream too: dedup's -N suffixes
        assert sorted(c[0] for c in calls) == [b if turn == 0 else f"{b}-{turn + 1}"
                                               for b in bases]
    first = received[0]
    assert first["query"] == ""  # Anthropic's ?beta=true stays behind
    headers = {k.lower(): v for k, v in first["headers"]}
    assert "anthropic-version" not in headers and "x-api-key" not in headers
    assert headers["authorization"].startswith("Bearer ")  # the CLI's key, as these servers read it
    assert first["body"]["stream"] is True
    assert first["body"]["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize("session", SESSIONS)
def test_the_same_sessions_through_the_translation_alone_never_complete(openai_relay, claude,
                                                                       session):
    args, bases = SESSIONS[session]
    budget = 12
    emu, r = openai_relay("--tool-turns", "5", *args, "--reask-dropped", "--max-requests",
                          str(budget), pipeline=[])
    run = claude.run(r.url)
    assert run.returncode != 0
    assert "request budget exhausted" in run.stdout
    assert "All 5 tool turns done." not in run.stdout
    received = chat_requests(emu)
    assert len(received) == budget + 1
    # The CLI dropped every call whose id it already held: only the first turn ever ran.
    turns = tool_turns(received[-1]["body"])
    assert_every_call_ran(turns, count=1, parallel=len(bases))
    assert sorted(c[0] for c in turns[0]) == bases


def test_claude_code_sees_an_upstream_error_in_its_own_words(openai_relay, claude):
    emu, r = openai_relay("--fail-status", "400")
    run = claude.run(r.url)
    assert run.returncode == 1
    assert "Emulated invalid request" in run.stdout


# --- the anthropic SDK ------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_the_sdk_completes_a_session_with_reused_ids_only_through_the_plugins(
        openai_relay, tmp_path, stream):
    emu, r = openai_relay("--tool-turns", "3", "--reuse-ids", "--parallel", "2", "--interleave")
    agent = Agent(client(r.url, max_retries=0), tmp_path, stream)
    final = agent.run()
    assert final.content[-1].text == "All 3 tool turns done."
    assert len(agent.calls) == 6 and len({c[0] for c in agent.calls}) == 6

    # The SDK sends the repeated ids on as it got them: the translation alone carries them up
    # and the upstream refuses them.
    _, bare = openai_relay("--tool-turns", "3", "--reuse-ids", "--parallel", "2",
                           pipeline=[])
    agent = Agent(client(bare.url, max_retries=0), tmp_path, stream)
    with pytest.raises(anthropic.BadRequestError) as refused:
        agent.run()
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    assert "duplicate tool_call id 'call_0'" in refused.value.body["error"]["message"]


def shape(value):
    """A value with its leaves replaced by their type names: what two backends share."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(v) for v in value]
    return type(value).__name__


def event_shapes(events) -> list:
    """The stream's events as (class, block or delta type); between two other events, the
    kinds of delta are what counts, not how many (a backend chooses its own pieces)."""
    out, deltas = [], set()
    for event in events:
        kind = getattr(event, "content_block", None) or getattr(event, "delta", None)
        entry = (type(event).__name__, getattr(kind, "type", None))
        if event.type in ("content_block_delta", "text", "input_json", "thinking",
                          "signature", "citation"):
            deltas.add(entry)
            continue
        if deltas:
            out.append(sorted(deltas, key=repr))
            deltas = set()
        out.append(entry)
    return out


def sdk_answers(url: str, thinking: bool) -> tuple:
    sdk = client(url, max_retries=0)
    request = {"model": "claude-shape", "max_tokens": 1024, "tools": [BASH],
               "messages": [{"role": "user", "content": "Run the tool."}]}
    created = sdk.messages.create(**request)
    with sdk.messages.stream(**request) as events:
        streamed = event_shapes(events)
        final = events.get_final_message()
    return created, streamed, final


@pytest.mark.parametrize("thinking", [False, True], ids=["plain", "thinking"])
def test_the_sdk_sees_the_shapes_an_anthropic_backend_gives(emulator, relay, openai_relay,
                                                            thinking):
    script = ("--tool-turns", "1", "--parallel", "2") + (("--thinking",) if thinking else ())
    emu = emulator(*script)
    anthropic_relay = relay({"pipeline": FULL, "backends": [backend(emu.url)]})
    _, openai_side = openai_relay(*script, "--interleave", "--late-ids")

    theirs = sdk_answers(anthropic_relay.url, thinking)
    ours = sdk_answers(openai_side.url, thinking)
    for a, b in ((theirs[0], ours[0]), (theirs[2], ours[2])):
        dumped_a, dumped_b = a.model_dump(), b.model_dump()
        assert shape(dumped_b) == shape(dumped_a)
        assert [c["type"] for c in dumped_b["content"]] == [c["type"] for c in dumped_a["content"]]
        assert b.stop_reason == a.stop_reason == "tool_use"
        assert [c.input for c in b.content if c.type == "tool_use"] == \
               [c.input for c in a.content if c.type == "tool_use"]
    assert ours[1] == theirs[1]
