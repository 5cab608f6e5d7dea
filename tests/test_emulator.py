"""The emulator is the relay's yardstick: it must reject what the real API rejects, word for word."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import io
import os
import re
import signal
import subprocess
import sys
import urllib.request

import aiohttp
import anthropic
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import assistant, request, result, text, use, user

from relay.testing.emulator import (
    EmulatorOptions,
    RaggedSplitter,
    add_arguments,
    build_message,
    create_app,
    encode_event,
    find_problem,
    is_fault,
    options_from_args,
    plan_reply,
    redacted_data,
    sign_thinking,
    stream_events,
    tool_id,
)

EMULATOR = os.path.join(os.path.dirname(__file__), "..", "relay", "testing", "emulator.py")

BASH = {"name": "Bash", "description": "Run a command",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}},
                         "required": ["command"]}}


def problem(body, **options):
    return find_problem(body, EmulatorOptions(**options))


MISSING = ("messages.{n}: `tool_use` ids were found without `tool_result` blocks immediately "
           "after: {ids}. Each `tool_use` block must have a corresponding `tool_result` block in "
           "the next message.")
UNEXPECTED = ("messages.{n}.content.{k}: unexpected `tool_use_id` found in `tool_result` blocks: "
              "{id}. Each `tool_result` block must have a corresponding `tool_use` block in the "
              "previous message.")


def test_command_line_options_map_onto_the_dataclass():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert options_from_args(parser.parse_args([])) == EmulatorOptions()
    args = parser.parse_args(["--tool-turns", "3", "--parallel", "2", "--id-style", "functions",
                              "--reuse-ids", "--fail-status", "529", "--fail-count", "2",
                              "--cut-after", "5", "--no-record", "--api-key", "k",
                              "--reask-dropped"])
    assert options_from_args(args) == EmulatorOptions(
        tool_turns=3, parallel=2, id_style="functions", reuse_ids=True, fail_status=529,
        fail_count=2, cut_after=5, record=False, api_key="k", reask_dropped=True)


# --- validation, as plain data ----------------------------------------------------------------

def test_a_well_formed_tool_loop_passes():
    body = request(user(text("hi")), assistant(text(), use("toolu_a"), use("toolu_b")),
                   user(result("toolu_a"), result("toolu_b"), text("and more")),
                   assistant(text("done")), user(text("thanks")))
    assert problem(body) is None


def test_tool_result_in_an_assistant_message():
    body = request(user(text()), assistant(result("toolu_a")))
    assert problem(body) == "messages.1: `tool_result` blocks can only be in `user` messages"


def test_tool_use_ids_must_be_unique_across_the_request():
    body = request(user(text()), assistant(use("toolu_a")), user(result("toolu_a")),
                   assistant(text(), use("toolu_a")), user(result("toolu_a")))
    assert problem(body) == "messages.3.content.1: `tool_use` ids must be unique"
    same_message = request(user(text()), assistant(use("toolu_a"), use("toolu_a")))
    assert problem(same_message) == "messages.1.content.1: `tool_use` ids must be unique"


def test_tool_use_id_pattern():
    body = request(user(text()), assistant(text(), use("functions.Bash:0")),
                   user(result("functions.Bash:0")))
    assert problem(body) == (
        "messages.1.content.1.tool_use.id: String should match pattern '^[a-zA-Z0-9_-]+$'")
    assert problem(body, id_style="functions") is None


def test_functions_style_accepts_ids_repeated_across_turns_but_not_within_one():
    body = request(user(text()), assistant(use("functions.Bash:0")), user(result("functions.Bash:0")),
                   assistant(use("functions.Bash:0")), user(result("functions.Bash:0")))
    assert problem(body, id_style="functions") is None
    twice = request(user(text()), assistant(use("functions.Bash:0"), use("functions.Bash:0")))
    assert problem(twice, id_style="functions") == "messages.1.content.1: `tool_use` ids must be unique"


def test_missing_tool_results_name_the_message_that_should_hold_them():
    # As the API does: Mirascope#2503 ([user, assistant tool_use, user text] -> messages.2) and
    # the recorded exchange in tests/fixtures/recorded (assistant at 0 -> messages.1).
    body = request(user(text()), assistant(use("toolu_a"), use("toolu_b")), user(text("no")))
    assert problem(body) == MISSING.format(n=2, ids="toolu_a, toolu_b")
    partial = request(user(text()), assistant(use("toolu_a"), use("toolu_b")), user(result("toolu_a")))
    assert problem(partial) == MISSING.format(n=2, ids="toolu_b")
    # A history ending with calls is a prefill: the model's own rules decide, not pairing.
    assert problem(request(user(text()), assistant(text(), use("toolu_a")))) is None
    # Consecutive messages of one role are one turn: text after the call, in the next message.
    followed_by_text = request(user(text()), assistant(use("toolu_a")), assistant(text()),
                               user(result("toolu_a")))
    assert problem(followed_by_text) == MISSING.format(n=3, ids="toolu_a")
    split = request(user(text()), assistant(use("toolu_a")), assistant(use("toolu_b")),
                    user(result("toolu_a")), user(result("toolu_b"), text()))
    assert problem(split) is None


def test_unexpected_tool_result_ids():
    body = request(user(text()), assistant(use("toolu_a")), user(result("toolu_a"), result("toolu_x")))
    assert problem(body) == UNEXPECTED.format(n=2, k=1, id="toolu_x")
    no_tool_use = request(user(result("toolu_x")))
    assert problem(no_tool_use) == UNEXPECTED.format(n=0, k=0, id="toolu_x")


def test_a_repeated_tool_result_says_so():
    body = request(user(text()), assistant(use("toolu_a"), use("toolu_b")),
                   user(result("toolu_a"), result("toolu_a")))
    assert problem(body) == ("messages.2.content.1: each tool_use must have a single result. "
                             "Found multiple `tool_result` blocks with id: toolu_a")


def test_tool_results_must_lead_the_message():
    text_first = request(user(text()), assistant(use("toolu_a")), user(text(), result("toolu_a")))
    assert problem(text_first) == MISSING.format(n=2, ids="toolu_a")
    interrupted = request(user(text()), assistant(use("toolu_a"), use("toolu_b")),
                          user(result("toolu_a"), text(), result("toolu_b")))
    assert problem(interrupted) == MISSING.format(n=2, ids="toolu_b")


def test_server_tool_blocks_need_no_tool_result():
    body = request(
        user(text("search")),
        assistant(
            {"type": "server_tool_use", "id": "srvtoolu_01", "name": "web_search", "input": {"query": "q"}},
            {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_01", "content": []},
            {"type": "mcp_tool_use", "id": "mcptoolu_01", "name": "x", "server_name": "s", "input": {}},
            {"type": "mcp_tool_result", "tool_use_id": "mcptoolu_01", "content": []},
            text("found it"),
        ),
        user(text("thanks")),
    )
    assert problem(body) is None


def test_advisor_and_web_search_results_need_a_server_tool_use_before_them():
    search = {"type": "server_tool_use", "id": "srvtoolu_01", "name": "web_search", "input": {}}
    for kind in ("advisor_tool_result", "web_search_tool_result"):
        found = {"type": kind, "tool_use_id": "srvtoolu_01", "content": []}
        assert problem(request(user(text()), assistant(text("x"), found))) == (
            f"messages.1.content.1: unexpected `tool_use_id` found in `{kind}` blocks: srvtoolu_01. "
            f"Each `{kind}` block must have a corresponding `server_tool_use` block before it.")
        assert problem(request(user(text()), assistant(found, search))) is not None
        # Deferred beside a client call, the result comes in the next assistant turn.
        assert problem(request(user(text()), assistant(search, use("toolu_a")), user(result("toolu_a")),
                               assistant(found, text("done")))) is None
    fetched = {"type": "web_fetch_tool_result", "tool_use_id": "srvtoolu_02", "content": {}}
    assert problem(request(user(text()), assistant(text("x"), fetched))) is None  # unknown: accepted


def test_a_server_call_closed_without_its_result_is_refused():
    fetch = {"type": "server_tool_use", "id": "srvtoolu_01", "name": "web_fetch", "input": {}}
    words = ("messages.1: `web_fetch` tool use with id `srvtoolu_01` was found without a "
             "corresponding `web_fetch_tool_result` block")
    mixed = [user(text()), assistant(fetch, use("toolu_a"))]
    assert problem(request(*mixed, user(result("toolu_a")))) is None  # deferred: runs now
    assert problem(request(*mixed, user(result("toolu_a"), text("and?")))) == words
    assert problem(request(*mixed, user(result("toolu_a")), {"role": "user", "content": "x"})) == words
    assert problem(request(*mixed, user(text("first"), result("toolu_a")))) == MISSING.format(
        n=2, ids="toolu_a")  # the client call's error comes first
    paused = [user(text()), assistant(text("looking"), fetch)]
    assert problem(request(*paused)) is None
    assert problem(request(*paused, user(text("never mind")))) == words
    advisor = dict(fetch, name="advisor")
    assert problem(request(user(text()), assistant(advisor), user(text("x")))) is None  # unknown


def test_system_entries_must_precede_an_assistant_message_or_end_the_array():
    # Claude Code's shapes: after a user turn, before the assistant's, or last.
    body = request(user(text()), {"role": "system", "content": "be brief"}, assistant(use("toolu_a")),
                   user(result("toolu_a")), {"role": "system", "content": [{"type": "text", "text": "r"}]})
    assert problem(body) is None
    # claude-code#73821: between calls and their results, or before a user message, it is refused.
    between = request(user(text()), assistant(use("toolu_a")), {"role": "system", "content": "x"},
                      user(result("toolu_a")))
    assert problem(between) == ("messages.2: role 'system' must precede an 'assistant' message or "
                                "end the array")


def test_at_most_four_blocks_carry_cache_control():
    mark = {"type": "ephemeral"}
    marked = dict(text(), cache_control=mark)
    # A tool, a system block, a text and one inside a document: four. A tool's input is the
    # model's own data, whatever its keys.
    body = request(user(marked, {"type": "document", "source": {"type": "content",
                                                                "content": [marked]}}),
                   assistant(dict(use("toolu_a"), input={"cache_control": mark})),
                   user(result("toolu_a")), tools=[dict(BASH, cache_control=mark)],
                   system=[marked])
    assert problem(body) is None
    body["messages"][2]["content"][0]["content"] = [marked]  # inside a tool result: five
    assert problem(body) == "A maximum of 4 blocks with cache_control may be provided. Found 5."


def test_unknown_fields_and_block_types_pass():
    body = request(user(text(), {"type": "future_block", "anything": 1}),
                   metadata={"user_id": "u"}, context_management={"edits": []}, brand_new=True)
    body["messages"][0]["cache_hint"] = "x"
    assert problem(body) is None


@pytest.mark.parametrize("body, message", [
    ([], "Input should be a valid dictionary"),
    ({"max_tokens": 1, "messages": [user(text())]}, "model: Field required"),
    ({"model": 3, "max_tokens": 1, "messages": [user(text())]}, "model: Input should be a valid string"),
    ({"model": "m", "messages": [user(text())]}, "max_tokens: Field required"),
    ({"model": "m", "max_tokens": "1", "messages": [user(text())]},
     "max_tokens: Input should be a valid integer"),
    ({"model": "m", "max_tokens": -1, "messages": [user(text())]},
     "max_tokens: Input should be greater than or equal to 0"),
    ({"model": "m", "max_tokens": 1}, "messages: Field required"),
    ({"model": "m", "max_tokens": 1, "messages": {}}, "messages: Input should be a valid list"),
    ({"model": "m", "max_tokens": 1, "messages": []}, "messages: at least one message is required"),
    (request("hi"), "messages.0: Input should be a valid dictionary"),
    (request({"content": "hi"}), "messages.0.role: Field required"),
    (request({"role": "tool", "content": "hi"}), "messages.0.role: Input should be 'user' or 'assistant'"),
    (request({"role": "user"}), "messages.0.content: Field required"),
    (request({"role": "user", "content": 5}), "messages.0.content: Input should be a valid list"),
    (request(user({"text": "x"})), "messages.0.content.0: Unable to extract tag using discriminator 'type'"),
    (request(user(text()), assistant({"type": "tool_use", "id": "toolu_a", "name": "Bash"})),
     "messages.1.content.0.tool_use.input: Field required"),
    (request(user(text()), assistant({"type": "tool_use", "id": "toolu_a", "name": "Bash", "input": []})),
     "messages.1.content.0.tool_use.input: Input should be a valid dictionary"),
    (request(user(text()), assistant({"type": "thinking", "thinking": "hm"})),
     "messages.1.content.0.thinking.signature: Field required"),
    (request(user({"type": "tool_result", "tool_use_id": "bad id"})),
     "messages.0.content.0.tool_result.tool_use_id: String should match pattern '^[a-zA-Z0-9_-]+$'"),
    (request(user(use("toolu_a"))), "messages.0: `tool_use` blocks can only be in `assistant` messages"),
    (request(user(text()), stream="yes"), "stream: Input should be a valid boolean"),
    (request(user(text()), {"role": "assistant", "content": ""}, user(text())),
     "messages.1: all messages must have non-empty content except for the optional final assistant message"),
    (request(user()), "messages.0: all messages must have non-empty content except for the optional "
                      "final assistant message"),
    (request(user(text(""))), "messages: text content blocks must be non-empty"),
    (request(user(text(" \n"))), "messages: text content blocks must contain non-whitespace text"),
])
def test_shape_problems(body, message):
    assert problem(body) == message


def test_a_final_assistant_message_may_be_empty():
    assert problem(request(user(text()), assistant())) is None


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2, 2) | st.sampled_from(
        ["", " ", "user", "assistant", "system", "text", "tool_use", "tool_result", "thinking",
         "redacted_thinking", "toolu_a", "toolu_b", "functions.Bash:0", "Bash"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["role", "content", "type", "id", "tool_use_id", "name", "input", "text",
                         "thinking", "signature", "data", "input_schema", "required", "properties"]),
        inner, max_size=5),
    max_leaves=25)


@settings(max_examples=300, deadline=None)
@given(messages=JSON, tools=JSON, id_style=st.sampled_from(["anthropic", "functions"]))
def test_arbitrary_json_gets_an_answer_never_a_crash(messages, tools, id_style):
    options = EmulatorOptions(tool_turns=1, id_style=id_style, expect_own_ids=True, thinking=True)
    body = {"model": "m", "max_tokens": 5, "messages": messages, "tools": tools}
    if find_problem(body, options) is None:
        assert plan_reply(body, options)[1] in ("tool_use", "end_turn")
    content, stop = plan_reply(request(user(text()), tools=tools), options)
    if stop == "tool_use":  # only ever a tool it was offered
        assert content[-1]["name"] in [t.get("name") for t in tools if isinstance(t, dict)]
    else:
        assert stop == "end_turn" and content[-1]["type"] == "text"


def test_max_tokens_zero_warms_the_cache_and_generates_nothing():
    # The SDK's MessageCreateParams.max_tokens: "Set to `0` to populate the prompt cache
    # without generating a response".
    body = request(user(text()), max_tokens=0, tools=[BASH])
    assert find_problem(body, EmulatorOptions()) is None
    message = build_message(body, EmulatorOptions(thinking=True), 100)
    assert message["content"] == [] and message["stop_reason"] == "max_tokens"
    assert message["usage"]["output_tokens"] == 0


def test_count_tokens_needs_no_max_tokens():
    body = {"model": "m", "messages": [user(text())]}
    assert find_problem(body, EmulatorOptions(), needs_max_tokens=False) is None


# --- thinking signatures ----------------------------------------------------------------------

def first_answer(options, **extra):
    extra.setdefault("tools", [BASH])
    content, _ = plan_reply(request(user(text("go")), **extra), options)
    return content


def test_own_thinking_blocks_come_back_valid_and_tampering_is_caught():
    options = EmulatorOptions(thinking=True, redacted_thinking=True, tool_turns=1)
    content = first_answer(options)
    assert [b["type"] for b in content] == ["thinking", "redacted_thinking", "text", "tool_use"]
    follow_up = [result(content[3]["id"])]
    body = request(user(text("go")), assistant(*content), user(*follow_up))
    assert find_problem(body, options) is None

    tampered = [dict(content[0], signature="s\u00e9"), *content[1:]]
    body = request(user(text("go")), assistant(*tampered), user(*follow_up))
    assert find_problem(body, options) == "messages.1.content.0: Invalid `signature` in `thinking` block"

    tampered = [dict(content[0], thinking=content[0]["thinking"] + " "), *content[1:]]
    body = request(user(text("go")), assistant(*tampered), user(*follow_up))
    assert find_problem(body, options) == "messages.1.content.0: Invalid `signature` in `thinking` block"

    tampered = [content[0], dict(content[1], data=redacted_data(b"other key", 0)), *content[2:]]
    body = request(user(text("go")), assistant(*tampered), user(*follow_up))
    assert find_problem(body, options) == (
        "messages.1.content.1: Invalid `data` in `redacted_thinking` block")


def test_signatures_depend_on_the_secret():
    signed = sign_thinking(EmulatorOptions(signing_secret="a").signing_key, "thought")
    block = {"type": "thinking", "thinking": "thought", "signature": signed}
    body = request(user(text()), assistant(block, text()))
    assert problem(body, signing_secret="a") is None
    assert problem(body, signing_secret="b") == (
        "messages.1.content.0: Invalid `signature` in `thinking` block")


# --- the script -------------------------------------------------------------------------------

def history(options, turns, **extra):
    """A conversation in which a client faithfully answered each of the emulator's tool turns."""
    extra.setdefault("tools", [BASH])
    messages = [user(text("go"))]
    for _ in range(turns):
        content, stop = plan_reply(request(*messages, **extra), options)
        assert stop == "tool_use"
        messages.append(assistant(*content))
        messages.append(user(*(result(b["id"]) for b in content if b["type"] == "tool_use")))
    return request(*messages, **extra)


def tool_ids(options, body):
    content, _ = plan_reply(body, options)
    return [b["id"] for b in content if b["type"] == "tool_use"]


def test_anthropic_ids_are_unique_across_turns_and_well_formed():
    options = EmulatorOptions(tool_turns=4, parallel=3)
    ids = [tool_ids(options, history(options, turn)) for turn in range(4)]
    flat = [i for turn in ids for i in turn]
    assert len(set(flat)) == 12
    assert all(re.fullmatch(r"toolu_01[0-9A-Za-z]{22}", i) for i in flat)
    assert find_problem(history(options, 4), options) is None


def test_anthropic_reused_ids_repeat_every_turn():
    options = EmulatorOptions(tool_turns=3, parallel=2, reuse_ids=True)
    assert tool_ids(options, history(options, 0)) == tool_ids(options, history(options, 2))
    assert all(re.fullmatch(r"toolu_01[0-9A-Za-z]{22}", i) for i in tool_ids(options, history(options, 0)))
    assert find_problem(history(options, 2), options) == "messages.3.content.1: `tool_use` ids must be unique"


def test_functions_ids_count_over_the_conversation_or_restart_when_reused():
    options = EmulatorOptions(tool_turns=3, parallel=2, id_style="functions")
    assert tool_ids(options, history(options, 0)) == ["functions.Bash:0", "functions.Bash:1"]
    assert tool_ids(options, history(options, 2)) == ["functions.Bash:4", "functions.Bash:5"]
    reused = EmulatorOptions(tool_turns=3, parallel=2, id_style="functions", reuse_ids=True)
    assert tool_ids(reused, history(reused, 2)) == ["functions.Bash:0", "functions.Bash:1"]
    assert find_problem(history(reused, 3), reused) is None


def test_expect_own_ids():
    options = EmulatorOptions(tool_turns=3, parallel=2, id_style="functions", reuse_ids=True,
                              expect_own_ids=True)
    assert find_problem(history(options, 3), options) is None
    body = history(options, 2)
    body["messages"][3]["content"][2]["id"] = "functions.Bash:7"
    body["messages"][4]["content"][1]["tool_use_id"] = "functions.Bash:7"
    assert find_problem(body, options) == (
        "messages.3.content.2: unknown `tool_use` id functions.Bash:7: this backend issued "
        "functions.Bash:0, functions.Bash:1 for turn 1")
    anthropic_style = EmulatorOptions(tool_turns=2, expect_own_ids=True)
    body = history(anthropic_style, 1)
    assert find_problem(body, anthropic_style) is None
    body["messages"][1]["content"][1]["id"] = body["messages"][2]["content"][0]["tool_use_id"] = "toolu_x"
    assert "unknown `tool_use` id toolu_x" in find_problem(body, anthropic_style)


def test_tool_choice_and_input():
    options = EmulatorOptions(tool_turns=1)
    bash = {"name": "Bash", "input_schema": {"type": "object"}}
    read = {"name": "Read", "input_schema": {"type": "object", "required": ["path", "limit"],
                                             "properties": {"path": {"type": "string"},
                                                            "limit": {"type": "integer"}}}}
    web_search = {"type": "web_search_20250305", "name": "web_search"}

    def call(tools):
        return first_answer(options, tools=tools)[-1]

    assert call([read, bash])["name"] == "Bash"
    assert call([read, bash])["input"] == {"command": "echo relay-turn-0-0", "description": "Print a marker"}
    assert call([web_search, read]) == {"type": "tool_use", "id": tool_id(options, 0, 0, "Read"),
                                        "name": "Read", "input": {"path": "x", "limit": 0}}



def test_without_a_tool_to_call_it_answers_in_text():
    # Claude Code's side requests (a title, a quota check) offer no tools.
    options = EmulatorOptions(tool_turns=3, thinking=True)
    web_search = {"type": "web_search_20250305", "name": "web_search"}
    for extra in ({}, {"tools": []}, {"tools": [web_search]},
                  {"tools": [BASH], "tool_choice": {"type": "none"}}):
        content, stop = plan_reply(request(user(text("go")), **extra), options)
        assert stop == "end_turn", extra
        assert [b["type"] for b in content] == ["thinking", "text"]
        assert content[-1]["text"] == "Turn 0: no tool to call, so in words."
    content, stop = plan_reply(request(user(text("go")), tools=[BASH],
                                       tool_choice={"type": "auto"}), options)
    assert stop == "tool_use"


def test_reask_dropped_asks_again_for_a_call_the_client_dropped():
    # Claude Code 2.1.332 drops a call whose id it already holds, keeps the assistant's text and
    # answers "(no content)". A model that sees its call unanswered makes it again.
    options = EmulatorOptions(tool_turns=3, reuse_ids=True, reask_dropped=True)
    body = history(options, 1)
    first = plan_reply(body, options)[0]
    assert first[-1]["input"]["command"] == "echo relay-turn-1-0"
    dropped = [b for b in first if b["type"] != "tool_use"]
    body["messages"] += [assistant(*dropped), user(text("(no content)"))]
    again, stop = plan_reply(body, options)
    assert stop == "tool_use" and again == first
    assert find_problem(body, options) is None
    # Without the option every assistant message is a turn, dropped call or not.
    plain = EmulatorOptions(tool_turns=3, reuse_ids=True)
    assert plan_reply(body, plain)[0][-1]["input"]["command"] == "echo relay-turn-2-0"
    # A faithful client sees the same script either way.
    assert history(options, 3) == history(plain, 3)


def test_after_the_tool_turns_it_answers_with_text():
    options = EmulatorOptions(tool_turns=2)
    content, stop = plan_reply(history(options, 2), options)
    assert stop == "end_turn"
    assert content == [{"type": "text", "text": "All 2 tool turns done."}]


def test_stream_events_rebuild_the_message():
    options = EmulatorOptions(tool_turns=1, parallel=2, thinking=True, redacted_thinking=True)
    message = build_message(request(user(text("go")), tools=[BASH]), options, 10)
    events = stream_events(message)
    assert [e["type"] for e in events[:2]] == ["message_start", "ping"]
    assert [e["type"] for e in events[-2:]] == ["message_delta", "message_stop"]
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    assert events[0]["message"]["content"] == []
    assert rebuild(events) == message["content"]


def rebuild(events):
    """Accumulate content blocks the way the SDK does, checking index order on the way."""
    blocks, partial = [], {}
    for event in events:
        if event["type"] == "content_block_start":
            assert event["index"] == len(blocks)
            blocks.append(dict(event["content_block"]))
        elif event["type"] == "content_block_delta":
            assert event["index"] == len(blocks) - 1
            block, delta = blocks[-1], event["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                block["signature"] = delta["signature"]
            elif delta["type"] == "input_json_delta":
                partial[event["index"]] = partial.get(event["index"], "") + delta["partial_json"]
        elif event["type"] == "content_block_stop":
            if event["index"] in partial:
                blocks[-1]["input"] = orjson.loads(partial[event["index"]])
    return blocks


def test_deltas_come_in_pieces():
    message = build_message(request(user(text("go")), tools=[BASH]), EmulatorOptions(tool_turns=1), 10)
    deltas = [e["delta"] for e in stream_events(message) if e["type"] == "content_block_delta"]
    assert sum(d["type"] == "text_delta" for d in deltas) >= 2
    json_pieces = [d["partial_json"] for d in deltas if d["type"] == "input_json_delta"]
    assert json_pieces[0] == "" and len(json_pieces) >= 3


def test_ragged_pieces_split_lines_and_crlf_pairs():
    data = b"".join(encode_event(e, crlf=True) for e in stream_events(
        build_message(request(user(text("go")), tools=[BASH]), EmulatorOptions(tool_turns=1), 10)))
    splitter = RaggedSplitter()
    pieces = [p for i in range(0, len(data), 100) for p in splitter.feed(data[i:i + 100])]
    pieces.append(splitter.flush())
    assert b"".join(pieces) == data
    assert max(len(p) for p in pieces) < 40
    assert any(a.endswith(b"\r") and b.startswith(b"\n") for a, b in zip(pieces, pieces[1:], strict=False))


def test_fault_schedule():
    assert not is_fault(1, EmulatorOptions())
    assert all(is_fault(n, EmulatorOptions(fail_status=529)) for n in (1, 2, 50))
    first_two = EmulatorOptions(fail_status=529, fail_count=2)
    assert [is_fault(n, first_two) for n in (1, 2, 3)] == [True, True, False]
    every_third = EmulatorOptions(fail_status=500, fail_every=3)
    assert [is_fault(n, every_third) for n in range(1, 7)] == [False, False, True] * 2


# --- over HTTP --------------------------------------------------------------------------------

async def make_client(aiohttp_client, **options):
    return await aiohttp_client(create_app(EmulatorOptions(**options)))


def parse_sse(data: bytes) -> list[dict]:
    normal = data.decode().replace("\r\n", "\n").replace("\r", "\n")
    events = []
    for chunk in normal.split("\n\n"):
        if not chunk.strip():
            continue
        fields = dict(line.split(": ", 1) for line in chunk.split("\n"))
        event = orjson.loads(fields["data"])
        assert event["type"] == fields["event"]
        events.append(event)
    return events


async def test_non_streaming_answer_and_headers(aiohttp_client):
    client = await make_client(aiohttp_client, tool_turns=1)
    response = await client.post("/v1/messages?beta=true", json=request(user(text("go")), tools=[BASH]))
    assert response.status == 200
    assert re.fullmatch(r"req_[0-9a-f]+", response.headers["request-id"])
    assert response.headers["anthropic-ratelimit-requests-limit"] == "4000"
    assert "anthropic-ratelimit-requests-remaining" in response.headers
    message = await response.json()
    assert message["type"] == "message" and message["model"] == "claude-test"
    assert message["stop_reason"] == "tool_use" and message["stop_sequence"] is None
    assert message["content"][-1]["id"] == tool_id(EmulatorOptions(), 0, 0, "Bash")
    assert message["usage"]["input_tokens"] > 0 and message["usage"]["output_tokens"] > 0


async def test_errors_over_http_carry_the_request_id(aiohttp_client):
    client = await make_client(aiohttp_client)
    body = request(user(text()), assistant(use("toolu_a")), user(text()))
    response = await client.post("/v1/messages", json=body)
    assert response.status == 400
    error = await response.json()
    assert error == {"type": "error", "error": {"type": "invalid_request_error",
                                                "message": MISSING.format(n=2, ids="toolu_a")},
                     "request_id": response.headers["request-id"]}


async def test_body_that_is_not_json(aiohttp_client):
    client = await make_client(aiohttp_client)
    response = await client.post("/v1/messages", data=b'{"model": ')
    assert response.status == 400
    assert (await response.json())["error"]["message"] == (
        "The request body is not valid JSON: unexpected end of data: line 1 column 11 (char 10)")


async def test_bodies_over_32_mb_are_refused(aiohttp_client):
    client = await make_client(aiohttp_client)
    response = await client.post("/v1/messages", data=io.BytesIO(b" " * (32 * 1024 * 1024 + 1)))
    assert response.status == 413
    assert (await response.json())["error"]["type"] == "request_too_large"


async def test_unknown_paths_answer_in_the_api_format(aiohttp_client):
    client = await make_client(aiohttp_client)
    response = await client.get("/v1/nothing")
    assert response.status == 404
    assert (await response.json())["error"]["type"] == "not_found_error"


async def test_auth(aiohttp_client):
    client = await make_client(aiohttp_client, api_key="sekrit")
    body = request(user(text()))
    response = await client.post("/v1/messages", json=body, headers={"x-api-key": "wrong"})
    assert response.status == 401
    assert (await response.json())["error"] == {"type": "authentication_error",
                                                "message": "invalid x-api-key"}
    assert (await client.post("/v1/messages", json=body, headers={"x-api-key": "sekrit"})).status == 200
    non_ascii = {"x-api-key": "s\u00e9krit"}
    assert (await client.post("/v1/messages", json=body, headers=non_ascii)).status == 401
    bearer = {"Authorization": "Bearer sekrit"}
    assert (await client.post("/v1/messages", json=body, headers=bearer)).status == 200


async def test_count_tokens(aiohttp_client):
    client = await make_client(aiohttp_client)
    body = {"model": "m", "messages": [user(text("count me"))]}
    response = await client.post("/v1/messages/count_tokens", data=orjson.dumps(body))
    assert response.status == 200
    assert (await response.json()) == {"input_tokens": len(orjson.dumps(body)) // 4}
    broken = {"model": "m", "messages": [user(result("toolu_x"))]}
    response = await client.post("/v1/messages/count_tokens", json=broken)
    assert response.status == 400
    assert (await response.json())["error"]["message"] == UNEXPECTED.format(n=0, k=0, id="toolu_x")


async def test_models(aiohttp_client):
    client = await make_client(aiohttp_client)
    listing = await (await client.get("/v1/models")).json()
    assert listing["has_more"] is False
    assert listing["first_id"] == listing["data"][0]["id"]
    assert listing["last_id"] == listing["data"][-1]["id"]
    first = listing["data"][0]
    assert first["type"] == "model" and first["created_at"].endswith("Z") and first["display_name"]
    assert await (await client.get(f"/v1/models/{first['id']}")).json() == first
    missing = await client.get("/v1/models/claude-nope")
    assert missing.status == 404
    assert (await missing.json())["error"] == {"type": "not_found_error", "message": "model: claude-nope"}


async def test_request_record_and_stats(aiohttp_client):
    client = await make_client(aiohttp_client)
    raw = b'{"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}'
    await client.post("/v1/messages?beta=true", data=raw,
                      headers={"anthropic-beta": "a,b", "Content-Type": "application/json"})
    await client.post("/v1/messages", data=b"not json")
    records = await (await client.get("/_emulator/requests")).json()
    assert len(records) == 2
    first = records[0]
    assert (first["method"], first["path"], first["query"]) == ("POST", "/v1/messages", "beta=true")
    assert ["anthropic-beta", "a,b"] in first["headers"]
    assert first["body"] == orjson.loads(raw)
    assert first["body_sha256"] == hashlib.sha256(raw).hexdigest()
    assert records[1]["body"] is None
    assert await (await client.get("/_emulator/stats")).json() == {"requests": 2, "messages": 2}
    assert (await client.delete("/_emulator/requests")).status == 200
    assert await (await client.get("/_emulator/requests")).json() == []


async def test_fail_status_and_count(aiohttp_client):
    client = await make_client(aiohttp_client, fail_status=529, fail_count=2)
    body = request(user(text()))
    for _ in range(2):
        response = await client.post("/v1/messages", json=body)
        assert response.status == 529
        assert (await response.json())["error"] == {"type": "overloaded_error", "message": "Overloaded"}
    assert (await client.post("/v1/messages", json=body)).status == 200


async def test_rate_limit_fault_says_retry_now(aiohttp_client):
    client = await make_client(aiohttp_client, fail_status=429, fail_count=1)
    response = await client.post("/v1/messages", json=request(user(text())))
    assert response.status == 429
    assert response.headers["retry-after"] == "0"
    assert (await response.json())["error"]["type"] == "rate_limit_error"


async def test_request_budget(aiohttp_client):
    client = await make_client(aiohttp_client, max_requests=2)
    body = request(user(text()))
    first = await client.post("/v1/messages", json=body)
    assert first.headers["anthropic-ratelimit-requests-remaining"] == "1"
    assert (await client.post("/v1/messages", json=body)).status == 200
    response = await client.post("/v1/messages", json=body)
    assert response.status == 429
    assert response.headers["x-should-retry"] == "false"
    assert (await response.json())["error"] == {"type": "rate_limit_error",
                                                "message": "request budget exhausted"}


async def test_stream_shape(aiohttp_client):
    client = await make_client(aiohttp_client, tool_turns=1, thinking=True)
    response = await client.post("/v1/messages",
                                 json=request(user(text("go")), tools=[BASH], stream=True))
    assert response.headers["content-type"] == "text/event-stream"
    events = parse_sse(await response.read())
    types = [e["type"] for e in events]
    assert types[:2] == ["message_start", "ping"] and types[-2:] == ["message_delta", "message_stop"]
    blocks = rebuild(events)
    assert [b["type"] for b in blocks] == ["thinking", "text", "tool_use"]
    assert blocks[2]["id"] == tool_id(EmulatorOptions(), 0, 0, "Bash")


async def raw_exchange(client, body: dict) -> bytes:
    """The response bytes exactly as sent, read until the server closes the connection."""
    reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
    payload = orjson.dumps(body)
    writer.write(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload)
    data = await reader.read()
    writer.close()
    return data


def dechunk(data: bytes) -> tuple[list[bytes], bool]:
    """The chunks of a chunked body and whether the terminating chunk arrived."""
    body = data.split(b"\r\n\r\n", 1)[1]
    chunks = []
    while body:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return chunks, True
        chunks.append(body[:size])
        body = body[size + 2:]
    return chunks, False


async def test_ragged_crlf_stream_on_the_wire(aiohttp_client):
    client = await make_client(aiohttp_client, tool_turns=1, ragged=True, crlf=True)
    chunks, complete = dechunk(await raw_exchange(client, request(user(text("go")), stream=True)))
    assert complete and max(len(c) for c in chunks) < 40
    assert any(a.endswith(b"\r") and b.startswith(b"\n") for a, b in zip(chunks, chunks[1:], strict=False))
    stream = b"".join(chunks)
    assert b"\r\n\r\n" in stream and b"\n\n" not in stream.replace(b"\r\n", b"")
    assert [e["type"] for e in parse_sse(stream)][-1] == "message_stop"


async def test_cut_after(aiohttp_client):
    client = await make_client(aiohttp_client, cut_after=4)
    chunks, complete = dechunk(await raw_exchange(client, request(user(text("go")), stream=True)))
    assert not complete
    assert [e["type"] for e in parse_sse(b"".join(chunks))] == [
        "message_start", "ping", "content_block_start", "content_block_delta"]
    response = await client.post("/v1/messages",
                                 json=request(user(text("go")), tools=[BASH], stream=True))
    with pytest.raises(aiohttp.ClientPayloadError):
        await response.read()


async def test_cut_after_with_ragged_sends_every_byte_before_the_cut(aiohttp_client):
    client = await make_client(aiohttp_client, cut_after=3, ragged=True)
    chunks, complete = dechunk(await raw_exchange(client, request(user(text("go")), stream=True)))
    assert not complete and len(parse_sse(b"".join(chunks))) == 3


async def test_stream_error_after(aiohttp_client):
    client = await make_client(aiohttp_client, stream_error_after=3)
    response = await client.post("/v1/messages",
                                 json=request(user(text("go")), tools=[BASH], stream=True))
    events = parse_sse(await response.read())
    assert [e["type"] for e in events] == ["message_start", "ping", "content_block_start", "error"]
    assert events[-1]["error"] == {"type": "overloaded_error", "message": "Overloaded"}


# --- real clients -----------------------------------------------------------------------------


async def test_the_official_sdk_talks_to_it(aiohttp_server):
    options = EmulatorOptions(tool_turns=1, thinking=True)
    server = await aiohttp_server(create_app(options))
    sdk = anthropic.AsyncAnthropic(base_url=str(server.make_url("")), api_key="k", max_retries=0)
    try:
        first = await sdk.messages.create(model="claude-test", max_tokens=100, tools=[BASH],
                                          messages=[{"role": "user", "content": "go"}])
        expected_id = tool_id(options, 0, 0, "Bash")
        assert first.stop_reason == "tool_use"
        assert first.content[-1].id == expected_id
        assert first.content[-1].input == {"command": "echo relay-turn-0-0", "description": "Print a marker"}

        async with sdk.messages.stream(model="claude-test", max_tokens=100, tools=[BASH],
                                       messages=[{"role": "user", "content": "go"}]) as stream:
            streamed = await stream.get_final_message()
        assert streamed.content[-1].id == expected_id
        assert streamed.content[0].signature == first.content[0].signature

        # The thinking block survives the SDK's model round trip and still verifies.
        history = [{"role": "user", "content": "go"},
                   {"role": "assistant", "content": [b.model_dump() for b in streamed.content]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": expected_id,
                                                 "content": "relay-turn-0-0"}]}]
        final = await sdk.messages.create(model="claude-test", max_tokens=100, tools=[BASH],
                                          messages=history)
        assert final.stop_reason == "end_turn"
        assert final.content[-1].text == "All 1 tool turns done."
    finally:
        await sdk.close()


@pytest.mark.slow
def test_standalone_process_announces_its_port_and_stops_on_sigterm():
    with subprocess.Popen([sys.executable, EMULATOR, "--port", "0"], stdout=subprocess.PIPE,
                          text=True) as process:
        try:
            line = process.stdout.readline()
            match = re.fullmatch(r"emulator listening on http://127\.0\.0\.1:(\d+)\n", line)
            assert match, line
            url = f"http://127.0.0.1:{match[1]}/v1/models"
            with urllib.request.urlopen(url, timeout=5) as response:
                assert orjson.loads(response.read())["has_more"] is False
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=5) == 0
        finally:
            if process.poll() is None:
                process.kill()


# --- the usage it reports -------------------------------------------------------------------

async def test_usage_is_what_the_option_or_the_header_says(aiohttp_client):
    client = await make_client(aiohttp_client, usage="input=7,cache_read=300")
    told = await (await client.post("/v1/messages", json=request(user(text("go"))))).json()
    assert told["usage"] == {"input_tokens": 7, "cache_creation_input_tokens": 0,
                             "cache_read_input_tokens": 300,
                             "cache_creation": {"ephemeral_5m_input_tokens": 0,
                                                "ephemeral_1h_input_tokens": 0},
                             "output_tokens": told["usage"]["output_tokens"]}
    header = {"x-emulator-usage": "output=9,cache_write_5m=20,cache_write_1h=30,web_search=2"}
    told = await (await client.post("/v1/messages", json=request(user(text("go"))),
                                    headers=header)).json()
    usage = told["usage"]
    assert usage["output_tokens"] == 9 and usage["cache_creation_input_tokens"] == 50
    assert usage["cache_creation"] == {"ephemeral_5m_input_tokens": 20,
                                       "ephemeral_1h_input_tokens": 30}
    assert usage["server_tool_use"] == {"web_search_requests": 2, "web_fetch_requests": 0}
    assert usage["cache_read_input_tokens"] == 0  # the header replaces the option whole
    split = await (await client.post("/v1/messages", json=request(user(text("go"))),
                                     headers={"x-emulator-usage": "cache_write_1h=5,split=0"})
                   ).json()
    assert "cache_creation" not in split["usage"]
    assert split["usage"]["cache_creation_input_tokens"] == 5
    bad = await client.post("/v1/messages", json=request(user(text("go"))),
                            headers={"x-emulator-usage": "cache_hits=5"})
    assert bad.status == 400 and "x-emulator-usage" in (await bad.json())["error"]["message"]


def test_a_stream_reports_its_input_at_the_start_and_its_usage_so_far_at_the_end():
    message = build_message(request(user(text("go"))), EmulatorOptions(), 10,
                            {"cache_read": 5, "cache_write_1h": 3, "web_search": 1})
    events = stream_events(message)
    start = events[0]["message"]["usage"]
    assert start["output_tokens"] == 1 and start["cache_read_input_tokens"] == 5
    assert start["cache_creation"]["ephemeral_1h_input_tokens"] == 3
    assert "server_tool_use" not in start  # no search has run yet
    [delta] = [e for e in events if e["type"] == "message_delta"]
    assert delta["usage"] == {"input_tokens": 10, "cache_creation_input_tokens": 3,
                              "cache_read_input_tokens": 5,
                              "output_tokens": message["usage"]["output_tokens"],
                              "server_tool_use": {"web_search_requests": 1,
                                                  "web_fetch_requests": 0}}
