"""The portable plugin: its pure id translation, thinking provenance, and its hooks on one
request, with the strict emulator judging what would go up."""

from __future__ import annotations

import asyncio
import copy
import re
import sqlite3
import threading

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from relay_builtins import dedup, portable
from support import exchange_for

from relay import config as config_module
from relay.config import Backend
from relay.exchange import UpstreamResponse
from relay.sse import Event
from relay.state.memory import MemoryState
from relay.testing.emulator import EmulatorOptions, find_problem, sign_thinking
from relay.testing.fixtures import relay_client  # noqa: F401  (the fixture)

PROPERTY = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
STRICT = re.compile(portable.ANTHROPIC_IDS)
FUNCTIONS = "^[a-zA-Z0-9_.:-]+$"
KEY_A, KEY_K = b"secret-a", b"secret-k"


# --- ids --------------------------------------------------------------------------------------


@PROPERTY
@given(st.text(min_size=1, max_size=80))
def test_an_encoded_id_fits_the_strict_grammar_and_decodes_to_its_original(original):
    encoded = portable.encode_id(original)
    assert STRICT.fullmatch(encoded)
    assert portable.decode_id(encoded) == original
    assert portable.encode_id(original) == encoded  # the same id, the same form, every time


@PROPERTY
@given(st.text(min_size=1, max_size=40), st.text(min_size=1, max_size=40))
def test_different_ids_never_share_an_encoding(a, b):
    if a != b:
        assert portable.encode_id(a) != portable.encode_id(b)


@PROPERTY
@given(st.text(min_size=1, max_size=60))
def test_every_id_goes_up_fitting_and_comes_back_where_the_original_fits(tool_id):
    strict = portable.id_for(tool_id, portable.ANTHROPIC_IDS)
    assert STRICT.fullmatch(strict)
    if STRICT.fullmatch(tool_id) and portable.decode_id(tool_id) is None:
        assert strict == tool_id  # what fits is never touched
    # Sent on to a permissive backend, the encoded form is the client's id again.
    original = portable.decode_id(tool_id) or tool_id
    assert portable.id_for(strict, None) == original


@pytest.mark.parametrize("tool_id", ["relayid_", "relayid_MZ2W", "relayid_!!", "relayid_a",
                                     "toolu_relayid_mz2w"])
def test_ids_that_only_look_encoded_are_left_alone(tool_id):
    assert portable.decode_id(tool_id) is None
    assert portable.id_for(tool_id, None) == tool_id


def history(*ids, thinking=None):
    messages = [{"role": "user", "content": [{"type": "text", "text": "go"}]}]
    for tool_id in ids:
        blocks = [thinking] if thinking else []
        messages.append({"role": "assistant", "content": blocks + [
            {"type": "text", "text": "calling"},
            {"type": "tool_use", "id": tool_id, "name": "Bash", "input": {"command": "ls"}}]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": tool_id, "content": "done"}]})
    return messages


def test_calls_and_their_results_are_translated_alike_and_earlier_turns_never_change():
    short = history("functions.Bash:0", "toolu_01abc")
    longer = history("functions.Bash:0", "toolu_01abc", "functions.Bash:1")
    for messages in (short, longer):
        portable.translate_ids(messages, portable.ANTHROPIC_IDS)
    assert longer[:len(short)] == short
    assert short[1]["content"][1]["id"] == portable.encode_id("functions.Bash:0")
    assert short[2]["content"][0]["tool_use_id"] == portable.encode_id("functions.Bash:0")
    assert short[3]["content"][1]["id"] == "toolu_01abc"
    body = {"model": "m", "max_tokens": 9, "messages": longer}
    assert find_problem(body, EmulatorOptions()) is None


def test_it_composes_with_dedup_reused_ids_stay_unique_and_fit():
    messages = history("functions.Bash:0", "functions.Bash:0", "functions.Bash:0")
    dedup.make_unique(messages)
    portable.translate_ids(messages, portable.ANTHROPIC_IDS)
    uses = [b["id"] for m in messages if m["role"] == "assistant" for b in m["content"]
            if b["type"] == "tool_use"]
    assert uses == [portable.encode_id(x) for x in
                    ("functions.Bash:0", "functions.Bash:0-2", "functions.Bash:0-3")]
    assert find_problem({"model": "m", "max_tokens": 9, "messages": messages},
                        EmulatorOptions()) is None
    # Back to a Kimi-like backend with restore_original_ids: its own ids again.
    portable.translate_ids(messages, FUNCTIONS)
    dedup.restore_originals(messages)
    assert {b["id"] for m in messages if m["role"] == "assistant" for b in m["content"]
            if b["type"] == "tool_use"} == {"functions.Bash:0"}


# --- thinking -------------------------------------------------------------------------------


def thought(key: bytes, text: str = "because") -> dict:
    return {"type": "thinking", "thinking": text, "signature": sign_thinking(key, text)}


def plugin(tmp_path=None) -> portable.Portable:
    made = portable.Portable()
    two = config_module.parse({"backends": [{"name": "a", "url": "http://127.0.0.1:1"},
                                             {"name": "b", "url": "http://127.0.0.1:2"}]})
    made.relay_startup(two, {"provenance_db": str(tmp_path / "p.db") if tmp_path else ""},
                       MemoryState())
    return made


def answer(made, backend_name, model, *blocks, stream=False):
    body = {"model": model, "max_tokens": 9, "messages": history()}
    exchange = exchange_for(body)
    exchange.backend = Backend(name=backend_name, url="http://127.0.0.1:9", models=["*"])
    message = {"type": "message", "role": "assistant", "content": list(blocks)}
    if not stream:
        made.relay_response(exchange, UpstreamResponse(200, {}, orjson.dumps(message)))
        return
    for index, block in enumerate(blocks):
        start = dict(block, signature="") if block["type"] == "thinking" else block
        events = [("content_block_start", {"type": "content_block_start", "index": index,
                                           "content_block": start})]
        if block["type"] == "thinking":
            half = len(block["signature"]) // 2
            events += [("content_block_delta", {"type": "content_block_delta", "index": index,
                                                "delta": {"type": "signature_delta",
                                                          "signature": part}})
                       for part in (block["signature"][:half], block["signature"][half:])]
        events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
        for name, data in events:
            made.relay_stream_event(exchange, Event(
                f"event: {name}\ndata: {orjson.dumps(data).decode()}\n\n".encode()))


def request_to(made, backend_name, model, messages, thinking=True, backend_format="anthropic",
               quirks=None):
    body = {"model": model, "max_tokens": 2048, "messages": copy.deepcopy(messages)}
    if thinking:
        body["thinking"] = {"type": "enabled", "budget_tokens": 1024}
    exchange = exchange_for(body)
    exchange.backend = Backend(name=backend_name, url="http://127.0.0.1:9", models=["*"],
                               format=backend_format)
    options = {**{o.name: o.default for o in portable.OPTIONS}, **(quirks or {})}
    reading = made.relay_request(exchange, options)
    if reading is not None:  # the record is read from disk first
        asyncio.run(reading)
    return exchange, orjson.loads(exchange.upstream_body())


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream"])
def test_thinking_from_another_backend_is_dropped_and_the_tool_turn_goes_without(stream):
    made = plugin()
    mine = thought(KEY_A)
    answer(made, "a", "model-a", mine, stream=stream)
    messages = history("toolu_1", thinking=mine)
    # Sent straight to K, its signature check refuses it, as the API words it.
    raw_body = {"model": "model-k", "max_tokens": 2048, "messages": messages,
                "thinking": {"type": "enabled", "budget_tokens": 1024}}
    assert find_problem(raw_body, EmulatorOptions(signing_secret="secret-k")) == (
        "messages.1.content.0: Invalid `signature` in `thinking` block")

    exchange, sent = request_to(made, "k", "model-k", messages)
    assert [b["type"] for b in sent["messages"][1]["content"]] == ["text", "tool_use"]
    assert sent["thinking"] == {"type": "disabled"}
    assert find_problem(sent, EmulatorOptions(signing_secret="secret-k")) is None
    assert exchange.response_headers["x-relay-repairs"] == "2"
    steps = [(e["step"], e.get("rule")) for e in exchange.timeline]
    assert steps == [("portable", "foreign-thinking"), ("portable", "thinking-off")]

    # Back to its issuer, the block goes up as it is, and the request is left alone.
    exchange, sent = request_to(made, "a", "model-a", messages)
    assert not exchange.changed and sent["messages"] == messages


def test_thinking_off_takes_the_thinking_edits_with_it_and_keeps_the_others():
    made = plugin()
    mine = thought(KEY_A)
    answer(made, "a", "model-a", mine)
    body = {"model": "model-k", "max_tokens": 2048, "messages": history("t", thinking=mine),
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"},
                                             {"type": "clear_tool_uses_20250919"}]}}
    exchange = exchange_for(body)
    exchange.backend = Backend(name="k", url="http://127.0.0.1:9", models=["*"])
    made.relay_request(exchange, {})
    sent = orjson.loads(exchange.upstream_body())
    assert sent["context_management"] == {"edits": [{"type": "clear_tool_uses_20250919"}]}
    del body["context_management"]["edits"][1]
    exchange = exchange_for(body)
    exchange.backend = Backend(name="k", url="http://127.0.0.1:9", models=["*"])
    made.relay_request(exchange, {})
    assert "context_management" not in orjson.loads(exchange.upstream_body())


def test_the_final_turn_keeps_thinking_on_when_its_own_issuer_gets_it():
    made = plugin()
    other, mine = thought(KEY_K, "k"), thought(KEY_A, "a")
    answer(made, "k", "model-k", other)
    answer(made, "a", "model-a", mine)
    # The final turn opens after the last question, with this backend's own thinking.
    messages = history("toolu_1", thinking=other) + [
        {"role": "assistant", "content": [{"type": "text", "text": "done"}]},
        {"role": "user", "content": [{"type": "text", "text": "next"}]},
        *history("toolu_2", thinking=mine)[1:]]
    exchange, sent = request_to(made, "a", "model-a", messages)
    assert sent["thinking"]["type"] == "enabled"
    assert sent["messages"][1]["content"][0]["type"] == "text"
    assert sent["messages"][5]["content"][0] == mine
    assert exchange.repairs == 1
    assert find_problem(sent, EmulatorOptions(signing_secret="secret-a")) is None
    # Within one tool loop the turn is the loop's: it opened with the other issuer's thinking,
    # which goes, so the request goes without thinking.
    loop = history("toolu_1", thinking=other) + history("toolu_2", thinking=mine)[1:]
    _, sent = request_to(made, "a", "model-a", loop)
    assert sent["thinking"] == {"type": "disabled"}
    assert find_problem(sent, EmulatorOptions(signing_secret="secret-a")) is None


def test_unsigned_thinking_is_dropped_and_unknown_thinking_goes_as_it_is():
    made = plugin()
    unsigned = {"type": "thinking", "thinking": "reasoning", "signature": ""}
    unknown = thought(b"nobody-told-us")
    messages = history("a1", thinking=unsigned) + history("a2", thinking=unknown)[1:]
    exchange, sent = request_to(made, "a", "model-a", messages, thinking=False)
    assert sent["messages"][1]["content"][0]["type"] == "text"
    assert sent["messages"][3]["content"][0] == unknown  # never judged without knowing
    assert exchange.repairs == 1 and "thinking" not in sent


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream"])
def test_unsigned_thinking_goes_back_to_a_backend_seen_issuing_it(stream):
    # DeepSeek's /anthropic signs nothing and refuses a tool turn sent back without its
    # thinking: a backend seen issuing unsigned thinking gets unsigned blocks back.
    made = plugin()
    unsigned = {"type": "thinking", "thinking": "reasoning", "signature": ""}
    answer(made, "b", "model-b", unsigned, stream=stream)
    messages = history("toolu_1", thinking=unsigned)
    options = EmulatorOptions(unsigned_thinking=True)
    for thinking in (True, False):  # without the field, its thinking mode is on too
        exchange, sent = request_to(made, "b", "model-b", messages, thinking=thinking)
        assert not exchange.changed and sent["messages"] == messages
        assert find_problem(sent, options) is None
    # What the relay sent it before: the block dropped, refused.
    assert find_problem(request_to(made, "a", "model-b", messages, thinking=False)[1],
                        options) is not None
    # Elsewhere they go as before: to another backend, and to another model of it unless
    # its scope is the backend.
    for backend, model, quirks in (("a", "model-b", None), ("b", "model-c", None)):
        exchange, sent = request_to(made, backend, model, messages, quirks=quirks)
        assert sent["messages"][1]["content"][0]["type"] == "text", (backend, model)
    exchange, sent = request_to(made, "b", "model-c", messages,
                                quirks={"thinking_scope": "backend"})
    assert not exchange.changed


def test_a_backend_wanting_every_tool_turns_thinking_gets_thinking_off_when_one_has_none():
    # A session moving from an Anthropic-like backend to a DeepSeek-like one: the first
    # prompt's tool turn's thinking is the other backend's (dropped), the next prompt's is the
    # target's own, so the final turn keeps thinking on. The target's thinking-mode rule
    # (every tool turn's thinking back) then refuses the request unless thinking goes off;
    # with `thinking_passed_back` it does.
    made = plugin()
    signed, unsigned = thought(KEY_A), {"type": "thinking", "thinking": "mine", "signature": ""}
    answer(made, "a", "model-b", signed)
    answer(made, "b", "model-b", unsigned)
    first, second = history("toolu_1", thinking=signed), history("toolu_2", thinking=unsigned)
    messages = first + [{"role": "assistant", "content": [{"type": "text", "text": "done"}]},
                        {"role": "user", "content": [{"type": "text", "text": "next"}]}]
    messages += second[1:]
    deepseek = EmulatorOptions(unsigned_thinking=True)
    quirk = {"thinking_passed_back": True}

    exchange, sent = request_to(made, "b", "model-b", messages)
    assert sent["thinking"]["type"] == "enabled"  # the final turn opens with thinking
    assert find_problem(sent, deepseek) == (
        "The `content[].thinking` in the thinking mode must be passed back to the API.")
    for thinking in (True, False):  # without the field, its thinking mode is on too
        exchange, sent = request_to(made, "b", "model-b", messages, thinking=thinking,
                                    quirks=quirk)
        assert sent["thinking"] == {"type": "disabled"}
        assert find_problem(sent, deepseek) is None
        assert [(e["step"], e.get("rule"), e.get("message_index")) for e in exchange.timeline
                if e["step"] == "portable"] == [("portable", "foreign-thinking", None),
                                                ("portable", "thinking-off", 1)]
        # The target's own thinking stays where it was; nothing stands in for the dropped one.
        assert sent["messages"][5] == messages[5]
        assert [b["type"] for b in sent["messages"][1]["content"]] == ["text", "tool_use"]
    # Every tool turn with its thinking: left as it is.
    own = history("toolu_1", "toolu_2", thinking=unsigned)
    exchange, sent = request_to(made, "b", "model-b", own, quirks=quirk)
    assert not exchange.changed and sent["thinking"]["type"] == "enabled"
    # Adaptive thinking is switched off the same way; thinking off already stays so.
    for thinking, switched in (({"type": "adaptive"}, True), ({"type": "disabled"}, False)):
        body = {"model": "model-b", "max_tokens": 9, "messages": messages, "thinking": thinking}
        exchange = exchange_for(body)
        exchange.backend = Backend(name="b", url="http://127.0.0.1:9", models=["*"])
        made.relay_request(exchange, {**{o.name: o.default for o in portable.OPTIONS}, **quirk})
        assert orjson.loads(exchange.upstream_body())["thinking"] == {"type": "disabled"}
        assert [e.get("rule") for e in exchange.timeline if e["step"] == "portable"] == [
            "foreign-thinking"] + (["thinking-off"] if switched else [])
    # Where signatures are not checked every block goes, and a tool turn the client sent
    # without thinking still turns it off.
    bare = history("toolu_1")
    exchange, sent = request_to(made, "b", "model-b", bare,
                                quirks={**quirk, "thinking_signatures": False})
    assert sent["thinking"] == {"type": "disabled"} and sent["messages"] == bare


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream"])
def test_a_lone_backend_is_learnt_signing_or_not_with_no_record_to_keep(stream):
    # One backend and no provenance_db: no other backend to carry thinking to, so no block is
    # recorded, but a backend that signs nothing must still be learnt (it was not: its
    # unsigned thinking was dropped on the way back to it, and the tool turn sent without).
    made = portable.Portable()
    made.relay_startup(config_module.parse({"backends": [{"name": "b", "url": "http://x"}]}),
                       {"provenance_db": ""}, MemoryState())
    unsigned = {"type": "thinking", "thinking": "reasoning", "signature": ""}
    answer(made, "b", "model-b", unsigned, stream=stream)
    messages = history("toolu_1", thinking=unsigned)
    exchange, sent = request_to(made, "b", "model-b", messages)
    assert not exchange.changed and sent["messages"] == messages
    # A model learnt, signing or not, is not read again: its streams' deltas are not asked
    # for, and nothing of its blocks is kept; one not learnt yet is read.
    answer(made, "b", "model-a", thought(KEY_A), stream=stream)
    assert set(made.provenance.memory) == set(portable.unsigned_markers("b", "model-b"))
    start = {"type": "content_block_start", "index": 0,
             "content_block": {"type": "thinking", "thinking": "", "signature": ""}}
    for model, read in (("model-a", False), ("model-b", False), ("model-c", True)):
        exchange = exchange_for({"model": model, "max_tokens": 9, "messages": history()})
        exchange.backend = Backend(name="b", url="http://x", models=["*"])
        asked = made.relay_stream_event(exchange, Event(
            f"event: content_block_start\ndata: {orjson.dumps(start).decode()}\n\n".encode()))
        assert (asked is not None) is read, model


def test_model_bound_signatures_follow_the_scope_quirk():
    made = plugin()
    mine = thought(KEY_A)
    answer(made, "a", "model-1", mine)
    messages = history("t1", thinking=mine)
    _, sent = request_to(made, "a", "model-2", messages)
    assert sent["messages"][1]["content"][0]["type"] == "text"
    exchange, sent = request_to(made, "a", "model-2", messages,
                                quirks={"thinking_scope": "backend"})
    assert not exchange.changed and sent["messages"] == messages


def test_an_openai_format_backend_gets_every_block_and_any_id():
    made = plugin()
    mine = thought(KEY_A)
    answer(made, "a", "model-a", mine)
    messages = history("functions.Bash:0", thinking=mine)
    exchange, _ = request_to(made, "o", "model-o", messages, backend_format="openai")
    assert not exchange.changed


def test_a_message_left_empty_goes_and_its_neighbours_stay():
    made = plugin()
    only = thought(KEY_K)
    answer(made, "k", "model-k", only)
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                {"role": "assistant", "content": [only]},
                {"role": "user", "content": [{"type": "text", "text": "and?"}]}]
    exchange, sent = request_to(made, "a", "model-a", messages, thinking=False)
    assert [m["role"] for m in sent["messages"]] == ["user", "user"]
    assert find_problem(sent, EmulatorOptions()) is None
    assert exchange.timeline[0]["removed_messages"] == [1]


async def test_the_record_is_bounded_and_survives_a_restart_and_is_shared(tmp_path):
    path = str(tmp_path / "p.db")
    first = portable.Provenance(path, rows=3)
    first.record([(f"k{n}", "a", "m") for n in range(5)])
    assert await first.lookup([f"k{n}" for n in range(5)]) == {
        f"k{n}": ("a", "m") for n in (2, 3, 4)}
    first.close(timeout=5)
    again, replica = portable.Provenance(path, rows=3), portable.Provenance(path, rows=3)
    assert await again.lookup([f"k{n}" for n in range(5)]) == {
        f"k{n}": ("a", "m") for n in (2, 3, 4)}
    replica.record([("k9", "b", "n")])
    assert replica.flush(5)
    assert await again.lookup(["k9"]) == {"k9": ("b", "n")}
    memory = portable.Provenance("", rows=2)
    memory.record([("x", "a", "m"), ("y", "a", "m"), ("z", "a", "m")])
    assert await memory.lookup(["x", "y", "z"]) == {"y": ("a", "m"), "z": ("a", "m")}
    for made in (again, replica):
        made.close()


def test_connections_making_a_new_file_at_once_both_open_it(tmp_path):
    """Two workers starting together, or one store's writer and reader threads: SQLite
    answers the second switch of a new file to WAL with "database is locked" at once,
    whatever the busy timeout (before the retry, about one pair in twenty lost)."""
    failures = []
    for n in range(100):
        store = portable.Provenance(str(tmp_path / f"p{n}.db"), rows=3)
        barrier = threading.Barrier(2)

        def open_it(store=store, barrier=barrier):
            barrier.wait()
            try:
                store.connect().close()
            except sqlite3.Error as e:
                failures.append(str(e))
        threads = [threading.Thread(target=open_it) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert failures == []


def test_two_replicas_sharing_the_record_judge_alike(tmp_path):
    one, two = plugin(tmp_path), plugin(tmp_path)
    mine = thought(KEY_A)
    answer(one, "a", "model-a", mine)
    assert one.provenance.flush(5)
    _, sent = request_to(two, "k", "model-k", history("t", thinking=mine))
    assert sent["thinking"] == {"type": "disabled"}


def test_the_emulator_requires_the_final_tool_turns_thinking_only_with_thinking_on():
    messages = history("toolu_1")
    body = {"model": "m", "max_tokens": 2048, "messages": messages,
            "thinking": {"type": "enabled", "budget_tokens": 1024}}
    assert find_problem(body, EmulatorOptions()).startswith(
        "messages.1.content.0.type: Expected `thinking` or `redacted_thinking`, but found `text`. "
        "When `thinking` is enabled, a final `assistant` message must start with a thinking block")
    body["thinking"] = {"type": "disabled"}
    assert find_problem(body, EmulatorOptions()) is None
    body["thinking"] = {"type": "enabled", "budget_tokens": 1024}
    body["messages"] = messages + [{"role": "assistant", "content": [{"type": "text",
                                                                      "text": "ok"}]},
                                   {"role": "user", "content": [{"type": "text", "text": "k"}]}]
    assert find_problem(body, EmulatorOptions()) is None


def docs_tool_loop(first: dict) -> list[dict]:
    """The docs' two-tool flow without interleaved thinking: the model thinks once, at the start
    of the assistant turn, and its later steps in the loop carry no thinking block
    (https://platform.claude.com/docs/en/build-with-claude/extended-thinking, "Interleaved
    thinking": "Response 2: [tool_use: database_query] <- no thinking block")."""
    return [{"role": "user", "content": [{"type": "text", "text": "revenue?"}]},
            {"role": "assistant", "content": [first, {"type": "tool_use", "id": "toolu_1",
                                                      "name": "calculator", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": "7500"}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_2",
                                               "name": "database_query", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2",
                                          "content": "5200"}, {"type": "text", "text": "note"}]}]


_LOOP_MESSAGES = st.sampled_from([
    {"role": "user", "content": [{"type": "text", "text": "a question"}]},
    {"role": "user", "content": "a question"},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"},
                                 {"type": "text", "text": "note"}]},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "t",
                                       "input": {}}]},
    {"role": "assistant", "content": [{"type": "thinking", "thinking": "", "signature": "s"},
                                      {"type": "tool_use", "id": "toolu_1", "name": "t",
                                       "input": {}}]},
    {"role": "assistant", "content": [{"type": "text", "text": "done"}]},
    {"role": "system", "content": "a reminder"}])


@settings(max_examples=400, deadline=None)
@given(st.lists(_LOOP_MESSAGES, max_size=14), st.data())
def test_the_final_turn_from_a_known_reach_is_the_whole_search_s(messages, data):
    """A session's request resumed at ``at`` looks for its final tool turn only as far back
    as ``at``, from the loop's reach there as the previous request found it: the same turn
    as the search over the whole history, and the same reach at every later index."""
    at = data.draw(st.integers(0, len(messages)))
    known = (at, portable.loop_reach(messages[:at], at))
    assert portable.final_tool_turn(messages, known)[0] == \
        portable.final_tool_turn_without_thinking(messages)
    for index in range(at, len(messages) + 1):
        assert portable.loop_reach(messages, index, known) == \
            portable.loop_reach(messages, index)
    found = portable.final_tool_turn(messages)[1]
    if found is not None:
        assert found[1] == portable.loop_reach(messages, found[0])
        for index in range(found[0], len(messages) + 1):
            assert portable.loop_reach(messages, index, found) == \
                portable.loop_reach(messages, index)


def test_the_final_turn_is_the_whole_tool_loop_back_to_the_last_question():
    loop = docs_tool_loop(thought(KEY_A))
    assert portable.final_tool_turn_without_thinking(loop) is None
    assert portable.final_tool_turn_without_thinking(
        docs_tool_loop({"type": "text", "text": "Let me add it up."})) == 1
    # A new question opens a new turn, which must open with its own thinking.
    asked = loop + [{"role": "assistant", "content": [{"type": "text", "text": "44% above."}]},
                    {"role": "user", "content": [{"type": "text", "text": "and tomorrow?"}]},
                    {"role": "system", "content": "a reminder"},
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_3",
                                                       "name": "calculator", "input": {}}]},
                    {"role": "user", "content": [{"type": "tool_result",
                                                  "tool_use_id": "toolu_3"}]}]
    assert portable.final_tool_turn_without_thinking(asked) == 8
    body = {"model": "m", "max_tokens": 2048, "thinking": {"type": "enabled",
                                                           "budget_tokens": 1024}}
    options = EmulatorOptions(signing_secret="secret-a")
    assert find_problem(dict(body, messages=loop), options) is None
    assert find_problem(dict(body, messages=asked), options).startswith(
        "messages.8.content.0.type: Expected `thinking` or `redacted_thinking`, but found "
        "`tool_use`.")


def test_under_betas_that_reshape_histories_the_final_turn_is_the_apis_to_judge():
    made = plugin()
    compacted = [{"role": "user", "content": [{"type": "text", "text": "go on"}]},
                 {"role": "assistant", "content": [
                     {"type": "compaction", "content": "what happened so far"},
                     {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {}}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"}]}]
    body = {"model": "model-a", "max_tokens": 2048, "messages": compacted,
            "thinking": {"type": "enabled", "budget_tokens": 1024}}
    exchange = exchange_for(body)
    exchange.backend = Backend(name="a", url="http://127.0.0.1:9", models=["*"])
    exchange.rules_defer = (("beta", "compact-2026-01-12"),)
    made.relay_request(exchange, {})
    assert not exchange.changed
    assert [(e["action"], e["location"]) for e in exchange.timeline] == [
        ("unsure", "messages.1")]
    # Without such a beta the rule is on record: that request goes without thinking.
    _, sent = request_to(made, "a", "model-a", compacted)
    assert sent["thinking"] == {"type": "disabled"}


async def test_a_tool_loop_whose_later_steps_do_not_think_goes_up_as_it_is(relay_client,
                                                                           tmp_path):
    import yaml
    from support import ROOT

    from relay.testing.fixtures import received
    shipped = yaml.safe_load((ROOT / "relay.yaml").read_text())
    client = await relay_client(shipped["pipeline"], {"dump": {"dir": str(tmp_path / "dumps")}},
                                signing_secret="secret-a")
    body = {"model": "claude-test", "max_tokens": 2048,
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "messages": docs_tool_loop(thought(KEY_A))}
    response = await client.post("/v1/messages", json=body, headers={
        "x-api-key": "test", "anthropic-version": "2023-06-01"})
    assert response.status == 200, await response.text()
    assert "x-relay-repairs" not in response.headers
    (sent,) = received(client)
    assert sent["thinking"] == body["thinking"] and sent["messages"] == body["messages"]


# --- relay validate --target ------------------------------------------------------------------


def validate(tmp_path, capsys, document, *args):
    import yaml

    from relay import cli
    config = tmp_path / "relay.yaml"
    config.write_text(yaml.safe_dump({
        "pipeline": ["dedup", "pairing", "ordering", "portable"],
        "plugins": {"portable": {"provenance_db": str(tmp_path / "p.db")}},
        "backends": [{"name": "anthropic", "url": "http://127.0.0.1:9", "models": ["claude-*"]},
                     {"name": "kimi", "url": "http://127.0.0.1:9", "models": ["kimi-*"],
                      "quirks": {"tool_id_pattern": FUNCTIONS}}]}))
    path = tmp_path / "request.json"
    path.write_bytes(orjson.dumps(document))
    code = cli.main(["validate", "--config", str(config), *args, str(path)])
    out, err = capsys.readouterr()
    return code, out, err


def test_validate_says_what_a_history_needs_to_go_to_a_target(tmp_path, capsys):
    kimi_thought = thought(KEY_K)
    record = portable.Provenance(str(tmp_path / "p.db"))
    record.record([(portable.block_key(kimi_thought), "kimi", "kimi-test")])
    record.close(timeout=10)  # the write lands in the writer thread: validate reads the file
    document = {"model": "claude-x", "max_tokens": 2048,
                "thinking": {"type": "enabled", "budget_tokens": 1024},
                "messages": history("functions.Bash:0", thinking=kimi_thought)}
    code, out, _ = validate(tmp_path, capsys, document, "--target", "anthropic")
    assert code == 1
    assert out.splitlines() == [
        "messages.1.content.0: thinking block issued by kimi/kimi-test: dropped",
        "messages.1.content.2.tool_use: id functions.Bash:0 does not fit '^[a-zA-Z0-9_-]+$': "
        f"sent as {portable.encode_id('functions.Bash:0')}",
        "messages.1: the final assistant tool turn has no thinking block valid here: the relay "
        "sends this request with thinking disabled",
        "messages.2.content.0.tool_result: id functions.Bash:0 does not fit '^[a-zA-Z0-9_-]+$': "
        f"sent as {portable.encode_id('functions.Bash:0')}"]
    # Its own backend needs nothing.
    code, out, _ = validate(tmp_path, capsys, dict(document, model="kimi-test"), "--target", "kimi")
    assert code == 0, out
    # Repaired, the history fits; the thinking switch is what the relay does on the way.
    code, out, err = validate(tmp_path, capsys, document, "--target", "anthropic", "--repair")
    repaired = orjson.loads(out)
    assert find_problem(dict(repaired, thinking={"type": "disabled"}),
                        EmulatorOptions(signing_secret="secret-a")) is None
    assert "thinking disabled" in err and code == 1
    code, _, err = validate(tmp_path, capsys, document, "--target", "nowhere")
    assert code == 2 and "no backend named 'nowhere'" in err


def test_validate_says_a_backend_wanting_every_tool_turns_thinking_gets_thinking_off(tmp_path,
                                                                                     capsys):
    import yaml

    from relay import cli
    config = tmp_path / "relay.yaml"
    config.write_text(yaml.safe_dump({
        "pipeline": ["portable"],
        "backends": [{"name": "deepseek", "url": "http://127.0.0.1:9", "models": ["*"],
                      "quirks": {"thinking_passed_back": True}},
                     {"name": "other", "url": "http://127.0.0.1:9", "models": ["x-*"]}]}))
    path = tmp_path / "request.json"
    # No thinking field: DeepSeek's thinking mode is on all the same.
    path.write_bytes(orjson.dumps({"model": "deepseek-flash", "max_tokens": 2048,
                                   "messages": history("toolu_1")}))
    for target, expected in (("deepseek", 1), ("other", 0)):
        code = cli.main(["validate", "--config", str(config), "--target", target, str(path)])
        out, _ = capsys.readouterr()
        assert code == expected, out
    code = cli.main(["validate", "--config", str(config), "--target", "deepseek", str(path)])
    out, _ = capsys.readouterr()
    assert out.splitlines() == [
        "messages.1: an assistant tool turn has no thinking block and this backend wants every "
        "tool turn's thinking back: the relay sends this request with thinking disabled"]


def test_with_adaptive_thinking_the_request_keeps_it_and_says_it_is_unsure():
    made = plugin()
    mine = thought(KEY_A)
    answer(made, "a", "model-a", mine)
    body = {"model": "model-k", "max_tokens": 2048, "messages": history("t", thinking=mine),
            "thinking": {"type": "adaptive"}}
    exchange = exchange_for(body)
    exchange.backend = Backend(name="k", url="http://127.0.0.1:9", models=["*"])
    made.relay_request(exchange, {})
    sent = orjson.loads(exchange.upstream_body())
    assert sent["thinking"] == {"type": "adaptive"}
    assert sent["messages"][1]["content"][0]["type"] == "text"
    assert [e["action"] for e in exchange.timeline] == ["repaired", "unsure"]
    assert exchange.repairs == 1


def test_a_final_turn_split_over_messages_is_judged_as_one_turn():
    made = plugin()
    mine = thought(KEY_A)
    answer(made, "a", "model-a", mine)
    messages = [{"role": "user", "content": [{"type": "text", "text": "go"}]},
                {"role": "assistant", "content": [mine, {"type": "text", "text": "calling"}]},
                {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "t", "name": "Bash", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]
    exchange, sent = request_to(made, "a", "model-a", messages)
    assert not exchange.changed  # the turn opens with its own thinking
    exchange, sent = request_to(made, "k", "model-k", messages)
    assert sent["thinking"] == {"type": "disabled"}
    assert exchange.timeline[-1]["message_index"] == 1


def test_a_malformed_block_is_left_for_the_upstream_and_a_broken_record_judges_nothing(tmp_path):
    made = plugin(tmp_path)
    mine = thought(KEY_A)
    answer(made, "a", "model-a", mine)
    odd = {"type": "thinking", "thinking": "x", "signature": 7}
    messages = history("t1", thinking=odd) + history("t2", thinking=mine)[1:]
    _, sent = request_to(made, "k", "model-k", messages, thinking=False)
    assert sent["messages"][1]["content"][0] == odd
    assert sent["messages"][3]["content"][0]["type"] == "text"
    made.provenance.close(timeout=5)
    for path in tmp_path.glob("p.db*"):
        path.unlink(missing_ok=True)  # the record's last close may remove its -wal and -shm
    (tmp_path / "p.db").write_bytes(b"not a database")
    # A replica (or this relay restarted) that can only ask the broken file.
    made.provenance = portable.Provenance(str(tmp_path / "p.db"))
    exchange, sent = request_to(made, "k", "model-k", messages, thinking=False)
    assert not exchange.changed  # unknown now: as the client sent it
    assert made.provenance.trouble.drain() == {("not_known", "corrupt"): 1}
    made.provenance.close()


# --- in a relay: header, timeline, dump -------------------------------------------------------

async def test_what_was_translated_shows_in_the_header_the_timeline_and_the_dump(relay_client,
                                                                                  tmp_path):
    client = await relay_client(["dedup", "portable", "dump"], {
        "dump": {"dir": str(tmp_path / "dumps"), "statuses": ["200-299"]}})
    body = {"model": "claude-test", "max_tokens": 64,
            "messages": history("functions.Bash:0", "functions.Bash:0")}
    response = await client.post("/v1/messages", json=body, headers={
        "x-api-key": "test", "anthropic-version": "2023-06-01"})
    assert response.status == 200, await response.text()
    # dedup renamed the repeat (one), portable translated both calls (two).
    assert response.headers["x-relay-rewrites"] == "3"
    await client.close()
    await client.chain.shutdown(client.config)  # the pending dump is written
    (path,) = (tmp_path / "dumps").rglob("*.json")
    document = orjson.loads(path.read_bytes())
    (step,) = [s for s in document["timeline"]["steps"] if s["step"] == "portable"]
    assert step["action"] == "translated ids" and step["pattern"] == portable.ANTHROPIC_IDS
    encoded = portable.encode_id("functions.Bash:0-2")
    assert document["translation"][encoded]["original"] == "functions.Bash:0-2"
    assert document["translation"]["functions.Bash:0-2"]["original"] == "functions.Bash:0"


def test_with_one_backend_there_is_nothing_to_record_and_no_delta_is_framed():
    start = Event(b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
                  b'"content_block":{"type":"thinking","thinking":"","signature":""}}\n\n')
    one = config_module.parse({"backends": [{"name": "a", "url": "http://127.0.0.1:1"}]})
    made = portable.Portable()
    made.relay_startup(one, {}, MemoryState())
    exchange = exchange_for({"model": "m", "max_tokens": 9, "thinking": {"type": "enabled",
                                                                          "budget_tokens": 9},
                             "messages": [{"role": "user", "content": "hi"}]})
    made.relay_request(exchange, {})
    assert made.relay_stream_events(exchange) == {"content_block_start"}  # for tool ids
    # Only until the backend's model is seen signing (a backend that signs nothing must be
    # learnt: its unsigned thinking goes back to it).
    assert made.relay_stream_event(exchange, start) == ("content_block_delta",
                                                         "content_block_stop")
    answer(made, "test", "m", thought(KEY_A))
    exchange = exchange_for({"model": "m", "max_tokens": 9, "thinking": {"type": "enabled",
                                                                          "budget_tokens": 9},
                             "messages": [{"role": "user", "content": "hi"}]})
    assert made.relay_stream_event(exchange, start) is None
    assert not made.provenance.memory
    made.relay_startup(config_module.parse({"backends": [
        {"name": "a", "url": "http://127.0.0.1:1"}, {"name": "b", "url": "http://127.0.0.1:2"}]}),
        {}, MemoryState())
    # A thinking block's start asks for the deltas that carry its signature, once a stream.
    assert made.relay_stream_events(exchange) == {"content_block_start"}
    assert made.relay_stream_event(exchange, start) == ("content_block_delta",
                                                         "content_block_stop")
    assert made.relay_stream_event(exchange, start) is None
