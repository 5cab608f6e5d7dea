"""pairing: every client tool_use answered by exactly one tool_result in the next message.

Plain histories through the plugin's hooks, then property tests on generated histories:
repair always leaves a history that validates (or only what must not be guessed at), and the
relay's verdict (pairing, then ordering, as the pipeline runs them) agrees with the emulator's.
"""

from __future__ import annotations

import functools
import logging
from unittest import mock

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import support
from support import assistant, exchange_for, request, result, text, use, user

from plugins import ordering, pairing
from relay.config import Backend, Config
from relay.emulator import EmulatorOptions, find_problem
from relay.errors import ConfigError, RelayError

rejection = functools.partial(support.rejection, pairing.relay_request)
passes = functools.partial(support.passes, pairing.relay_request)


# --- building histories -----------------------------------------------------------------------


def missing_text(index, *ids):
    return (f"messages.{index}: `tool_use` ids were found without `tool_result` blocks immediately "
            f"after: {', '.join(ids)}. Each `tool_use` block must have a corresponding `tool_result` "
            f"block in the next message.")


def unexpected_text(index, k, id):
    return (f"messages.{index}.content.{k}: unexpected `tool_use_id` found in `tool_result` blocks: "
            f"{id}. Each `tool_result` block must have a corresponding `tool_use` block in the "
            f"previous message.")


# The seed document's two histories.
SEED_BROKEN = [
    assistant({"type": "tool_use", "id": "toolu_demo_a", "name": "lookup_ticket",
               "input": {"ticket_id": "DEMO-42"}}),
    user({"type": "tool_result", "tool_use_id": "toolu_wrong_id", "content": "resolved"}),
]
SEED_CORRECTED = [
    assistant({"type": "tool_use", "id": "toolu_demo_a", "name": "lookup_ticket",
               "input": {"ticket_id": "DEMO-42"}}),
    user({"type": "tool_result", "tool_use_id": "toolu_demo_a", "content": "resolved"},
         text("Explain this status briefly.")),
]


# --- reject mode ------------------------------------------------------------------------------


def test_seed_broken_history_is_refused_as_the_api_words_it():
    body = request(user(text("Look up DEMO-42.")), *SEED_BROKEN)
    assert rejection(body) == unexpected_text(2, 0, "toolu_wrong_id")


def test_seed_corrected_history_passes_untouched():
    passes(request(user(text("Look up DEMO-42.")), *SEED_CORRECTED))


def test_missing_result_among_parallel_calls_names_the_assistant_message():
    body = request(user(text("go")), assistant(text("two calls"), use("toolu_a"), use("toolu_b")),
                   user(result("toolu_a")))
    assert rejection(body) == missing_text(1, "toolu_b")


def test_every_missing_id_is_named_in_call_order():
    body = request(user(text("go")), assistant(use("toolu_a"), use("toolu_b"), use("toolu_c")),
                   user(text("no results at all")))
    assert rejection(body) == missing_text(1, "toolu_a", "toolu_b", "toolu_c")


def test_duplicate_result_names_the_second_block():
    body = request(user(text("go")), assistant(use("toolu_a")),
                   user(result("toolu_a"), result("toolu_a")))
    assert rejection(body) == ("messages.2.content.1: each tool_use must have a single result. "
                               "Found multiple `tool_result` blocks with id: toolu_a")


def test_result_in_assistant_message():
    body = request(user(text("go")), assistant(use("toolu_a"), result("toolu_a")),
                   user(result("toolu_a")))
    assert rejection(body) == "messages.1: `tool_result` blocks can only be in `user` messages"


def test_result_in_first_message_answers_nothing():
    body = request(user(result("toolu_gone"), text("hi")))
    assert rejection(body) == unexpected_text(0, 0, "toolu_gone")


def test_result_after_a_message_without_calls_is_unexpected():
    body = request(user(text("go")), assistant(text("no tools")), user(text("x"), result("toolu_x")))
    assert rejection(body) == unexpected_text(2, 1, "toolu_x")


def test_trailing_tool_use_has_no_result():
    body = request(user(text("go")), assistant(text("calling"), use("toolu_a")))
    assert rejection(body) == missing_text(1, "toolu_a")


def test_tool_use_followed_by_assistant_message():
    body = request(user(text("go")), assistant(use("toolu_a")), assistant(text("then this")),
                   user(text("hm")))
    assert rejection(body) == missing_text(1, "toolu_a")


def test_string_content_cannot_answer_a_call():
    body = request(user(text("go")), assistant(use("toolu_a")), {"role": "user", "content": "next"})
    assert rejection(body) == missing_text(1, "toolu_a")


def test_duplicate_tool_use_id_names_the_later_block():
    body = request(user(text("go")), assistant(use("toolu_a")), user(result("toolu_a")),
                   assistant(text("again"), use("toolu_a")), user(result("toolu_a")))
    assert rejection(body) == "messages.3.content.1: `tool_use` ids must be unique"


def test_repeated_ids_pass_when_the_backend_wants_its_own_ids_back():
    body = request(user(text("go")), assistant(use("functions.Bash:0")), user(result("functions.Bash:0")),
                   assistant(use("functions.Bash:0")), user(result("functions.Bash:0")))
    passes(body, {"restore_original_ids": True})
    # Pairing inside each turn is still checked.
    body["messages"][4] = user(text("forgot"))
    assert rejection(body, {"restore_original_ids": True}) == missing_text(3, "functions.Bash:0")


def test_problems_come_in_the_order_the_api_checks_them():
    messages = [user(text("go")), assistant(use("toolu_a")), user(result("toolu_x")),
                assistant(use("toolu_a"), result("toolu_a"))]
    assert [p.location for p in pairing.problems(messages)] == [
        "messages.3", "messages.3.content.0", "messages.2.content.0", "messages.1", "messages.3"]


def test_server_tools_and_system_entries_pass():
    body = request(
        user(text("search and run")),
        assistant(text("searching"),
                  {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search",
                   "input": {"query": "x"}},
                  {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []},
                  {"type": "mcp_tool_use", "id": "mcptoolu_1", "name": "fetch", "server_name": "s",
                   "input": {}},
                  {"type": "mcp_tool_result", "tool_use_id": "mcptoolu_1", "content": []},
                  {"type": "code_execution_tool_result", "tool_use_id": "srvtoolu_2", "content": {}},
                  use("toolu_a")),
        {"role": "system", "content": "a reminder Claude Code put here"},
        user(result("toolu_a"), {"type": "brand_new_block", "x": 1}),
        {"role": "system", "content": [text("another")]},
        assistant(text("done")),
    )
    passes(body)


def test_malformed_input_is_left_to_the_upstream():
    for messages in (None, "x", [1, "two", None], [{"role": "assistant", "content": [1, {"type": "tool_use"}]}],
                     [{"content": []}], [{"role": "user"}]):
        passes({"model": "m", "messages": messages})
    passes({"model": "m"})


@pytest.mark.parametrize("tool_use_id,shown", [
    (None, "null"), (7, "7"), (True, "true"), ({"id": "toolu_a"}, '{"id":"toolu_a"}'),
    (["toolu_a"], '["toolu_a"]')])
def test_a_tool_use_id_that_is_not_a_string_is_shown_as_json(tool_use_id, shown):
    body = request(user(text("go")), assistant(use("toolu_a")),
                   user({"type": "tool_result", "tool_use_id": tool_use_id, "content": "x"}))
    message = rejection(body)
    assert message.startswith(unexpected_text(2, 0, shown).split(" Each")[0])
    assert "None" not in message and "'" not in message


# --- modes ------------------------------------------------------------------------------------


def test_off_mode_forwards_anything():
    body = request(*SEED_BROKEN)
    passes(body, {"pairing_mode": "off"})


def test_quirk_wins_over_option_through_the_merged_options():
    # The chain merges quirks over options; the plugin just reads the merged key.
    body = request(user(text("go")), assistant(use("toolu_a")), assistant(text("x")), user(text("y")))
    exchange = exchange_for(body)
    pairing.relay_request(exchange, {**{"pairing_mode": "reject"}, **{"pairing_mode": "repair"}})
    assert exchange.repairs == 1


def test_repair_adds_an_error_result_with_the_calls_own_id(caplog):
    body = request(user(text("go")), assistant(use("toolu_a"), use("toolu_b")),
                   user(result("toolu_b"), text("and then")))
    exchange = exchange_for(body)
    with caplog.at_level(logging.INFO, logger="relay.plugins.pairing"):
        pairing.relay_request(exchange, {"pairing_mode": "repair"})
    body = exchange.body  # the request as repaired
    added = {"type": "tool_result", "tool_use_id": "toolu_a", "content": pairing.NO_RESULT_RECORDED,
             "is_error": True}
    assert body["messages"][2]["content"] == [added, result("toolu_b"), text("and then")]
    assert "cannot tell whether the tool ran" in pairing.NO_RESULT_RECORDED
    assert exchange.changed and exchange.repairs == 1
    assert exchange.response_headers["x-relay-repairs"] == "1"
    assert exchange.timeline[-1]["step"] == "pairing" and exchange.timeline[-1]["action"] == "repaired"
    assert exchange.timeline[-1]["tool_use_ids"] == ["toolu_a"]
    assert "toolu_a" in caplog.text
    assert pairing.problems(body["messages"]) == []
    assert orjson.loads(exchange.upstream_body()) == body


def test_repair_goes_to_the_front_of_a_misplaced_run():
    # The run stays in one piece, so the ordering plugin can still move it whole.
    body = request(user(text("go")), assistant(use("toolu_a"), use("toolu_b")),
                   user(text("first"), result("toolu_b")))
    exchange = exchange_for(body)
    pairing.relay_request(exchange, {"pairing_mode": "repair"})
    assert [b.get("tool_use_id") for b in exchange.messages[2]["content"]] == [None, "toolu_a", "toolu_b"]


def test_repair_inserts_a_user_message_when_none_answers():
    body = request(user(text("go")), assistant(use("toolu_a")), assistant(text("x"), use("toolu_b")),
                   user(text("y")))
    exchange = exchange_for(body)
    pairing.relay_request(exchange, {"pairing_mode": "repair"})
    body = exchange.body  # the request as repaired
    roles = [m["role"] for m in body["messages"]]
    assert roles == ["user", "assistant", "user", "assistant", "user"]
    assert [b["tool_use_id"] for b in body["messages"][2]["content"]] == ["toolu_a"]
    assert [b["tool_use_id"] for b in body["messages"][4]["content"][:1]] == ["toolu_b"]
    assert exchange.repairs == 2 and exchange.response_headers["x-relay-repairs"] == "2"
    assert pairing.problems(body["messages"]) == []


def test_repair_keeps_a_string_answer_as_text():
    body = request(user(text("go")), assistant(use("toolu_a")), {"role": "user", "content": "next"})
    exchange = exchange_for(body)
    pairing.relay_request(exchange, {"pairing_mode": "repair"})
    content = exchange.body["messages"][2]["content"]
    assert [b["type"] for b in content] == ["tool_result", "text"] and content[1]["text"] == "next"


@pytest.mark.parametrize("messages, message", [
    (SEED_BROKEN, unexpected_text(1, 0, "toolu_wrong_id")),
    ([user(text("go")), assistant(use("toolu_a")), user(result("toolu_a"), result("toolu_a"))],
     "messages.2.content.1: each tool_use must have a single result. Found multiple `tool_result` "
     "blocks with id: toolu_a"),
    ([user(text("go")), assistant(use("toolu_a"))], missing_text(1, "toolu_a")),
    ([user(text("go")), assistant(use("toolu_a")), user(result("toolu_a")), assistant(use("toolu_a")),
      user(text("x"))], "messages.3.content.0: `tool_use` ids must be unique"),
    ([user(text("go")), assistant(text("x"), result("toolu_a"))],
     "messages.1: `tool_result` blocks can only be in `user` messages"),
])
def test_repair_mode_still_refuses_what_it_must_not_guess(messages, message):
    # The seed's broken history also misses toolu_demo_a's result, and that part could be
    # repaired; the unknown result cannot, so nothing is changed at all.
    body = request(*messages)
    before = orjson.dumps(body)
    exchange = exchange_for(body)
    with pytest.raises(RelayError) as caught:
        pairing.relay_request(exchange, {"pairing_mode": "repair"})
    assert caught.value.message == message
    assert orjson.dumps(body) == before and not exchange.changed and exchange.repairs == 0


def test_startup_checks_the_mode_in_options_and_quirks():
    config = Config(backends=[Backend(name="a", url="http://x", models=["*"]),
                              Backend(name="b", url="http://y", models=["*"],
                                      quirks={"pairing_mode": "fix"})])
    with pytest.raises(ConfigError, match=r"^plugins\.pairing\.pairing_mode: "):
        pairing.relay_startup(config, {"pairing_mode": "lenient"})
    with pytest.raises(ConfigError, match=r"^backends\[1\]\.quirks\.pairing_mode: "):
        pairing.relay_startup(config, {"pairing_mode": "repair"})
    config.backends[1].quirks["pairing_mode"] = "off"
    pairing.relay_startup(config, {})


# --- relay validate ---------------------------------------------------------------------------


def test_validate_lists_every_problem():
    body = request(user(text("go")), assistant(use("toolu_a"), use("toolu_b")), user(result("toolu_a")),
                   assistant(use("toolu_c")), user(result("toolu_c"), result("toolu_c")),
                   assistant(use("toolu_d")))
    found = pairing.relay_validate(exchange_for(body), {}, False)
    assert found == [
        {"location": "messages.1", "message": missing_text(1, "toolu_b")},
        {"location": "messages.4.content.1",
         "message": "messages.4.content.1: each tool_use must have a single result. Found multiple "
                    "`tool_result` blocks with id: toolu_c"},
        {"location": "messages.5", "message": missing_text(5, "toolu_d")},
    ]


def test_validate_repair_returns_only_what_is_left():
    body = request(user(text("go")), assistant(use("toolu_a"), use("toolu_b")), user(result("toolu_a")),
                   assistant(use("toolu_d")))
    exchange = exchange_for(body)
    assert pairing.relay_validate(exchange, {}, True) == [
        {"location": "messages.3", "message": missing_text(3, "toolu_d")}]
    assert exchange.changed and exchange.repairs == 1
    assert pairing.relay_validate(exchange_for(request(*SEED_CORRECTED)), {}, True) == []
    assert pairing.relay_validate(exchange_for(request(*SEED_BROKEN)), {"pairing_mode": "off"}, False) is None


# --- generated histories ----------------------------------------------------------------------

MUTATIONS = ("drop_result", "wrong_id", "duplicate_result", "text_first", "split_run",
             "result_in_assistant", "trailing_call", "reuse_id", "no_answer", "string_answer")


@st.composite
def histories(draw):
    """A valid tool-using conversation, then up to three faults; returns (messages, faults)."""
    messages = [user(text("start"))]
    counter = 0
    for turn in range(draw(st.integers(1, 6))):
        calls = draw(st.integers(0, 3))
        blocks = [text(f"turn {turn}")] if draw(st.booleans()) else []
        if draw(st.booleans()):
            blocks += [{"type": "server_tool_use", "id": f"srvtoolu_{turn}", "name": "web_search",
                        "input": {"query": "q"}},
                       {"type": "web_search_tool_result", "tool_use_id": f"srvtoolu_{turn}", "content": []}]
        ids = []
        for _ in range(calls):
            counter += 1
            ids.append(f"toolu_{counter:04d}")
            blocks.append(use(ids[-1]))
        if not blocks:
            blocks = [text("thinking aloud")]
        messages.append(assistant(*blocks))
        if draw(st.booleans()):
            messages.append({"role": "system", "content": "reminder"})
        answers = [result(i) for i in draw(st.permutations(ids))]
        messages.append(user(*answers, text("go on")))
    faults = []
    for _ in range(draw(st.integers(0, 3))):
        fault = draw(st.sampled_from(MUTATIONS))
        if _mutate(draw, messages, fault):
            faults.append(fault)
    return messages, faults


def _answering(messages):
    """Indices of user messages that hold at least one result."""
    return [i for i, m in enumerate(messages) if m["role"] == "user" and isinstance(m["content"], list)
            and any(b["type"] == "tool_result" for b in m["content"])]


def _mutate(draw, messages, fault) -> bool:
    answering = _answering(messages)
    calls = [i for i, m in enumerate(messages) if m["role"] == "assistant"
             and any(b["type"] == "tool_use" for b in m["content"])]
    if fault == "trailing_call":
        messages.append(assistant(text("one more"), use("toolu_last")))
        return True
    if fault in ("reuse_id", "result_in_assistant", "no_answer", "string_answer"):
        if not calls:
            return False
        at = draw(st.sampled_from(calls))
        ids = [b["id"] for b in messages[at]["content"] if b["type"] == "tool_use"]
        if fault == "reuse_id":
            messages.append(assistant(use(ids[0])))
            messages.append(user(result(ids[0]), text("again")))
        elif fault == "result_in_assistant":
            messages[at]["content"].append(result(ids[0]))
        else:
            following = at + 1 + (messages[at + 1]["role"] == "system" if at + 1 < len(messages) else 0)
            if following >= len(messages) or messages[following]["role"] != "user":
                return False
            if fault == "no_answer":
                messages[following]["content"] = [text("nothing to report")]
            else:
                messages[following]["content"] = "plain words"
        return True
    if not answering:
        return False
    content = messages[draw(st.sampled_from(answering))]["content"]
    results = [k for k, b in enumerate(content) if b["type"] == "tool_result"]
    k = draw(st.sampled_from(results))
    if fault == "drop_result":
        del content[k]
    elif fault == "wrong_id":
        content[k] = result("toolu_wrong")
    elif fault == "duplicate_result":
        content.insert(k + 1, dict(content[k]))
    elif fault == "text_first":
        content.insert(0, text("before"))
    elif fault == "split_run":
        if len(results) < 2:
            return False
        content.insert(results[0] + 1, text("between"))
    return True


def relay_verdict(messages, unique_ids=True):
    """The first problem of the pipeline [pairing, ordering], as the client would read it."""
    found = pairing.problems(messages, unique_ids) or ordering.problems(messages)
    return found[0].message if found else None


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(histories())
def test_verdict_agrees_with_the_emulator(history):
    messages, faults = history
    ours = relay_verdict(messages)
    theirs = find_problem(request(*messages), EmulatorOptions())
    assert (ours is None) == (theirs is None), (ours, theirs)
    if len(set(faults)) == 1:
        assert ours == theirs


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(histories())
def test_quick_walk_never_hides_a_problem(history):
    messages, _ = history
    with mock.patch.object(pairing, "_clean", return_value=False):
        slow = pairing.problems(messages)
    with mock.patch.object(ordering, "_clean", return_value=False):
        slow_order = ordering.problems(messages)
    assert pairing.problems(messages) == slow
    assert ordering.problems(messages) == slow_order


UNREPAIRABLE = ("unexpected `tool_use_id`", "each tool_use must have a single result",
                "`tool_use` ids must be unique", "can only be in `user` messages")


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(histories())
def test_repair_leaves_a_valid_history_or_only_what_must_not_be_guessed(history):
    messages, _ = history
    before = pairing.problems(messages)
    trailing = messages[-1]["role"] == "assistant" and any(
        b["type"] == "tool_use" for b in messages[-1]["content"])
    exchange = exchange_for(orjson.loads(orjson.dumps(request(*messages))))
    left = pairing.relay_validate(exchange, {}, True)
    assert ordering.relay_validate(exchange, {}, True) == []
    for problem in left:
        assert (any(marker in problem["message"] for marker in UNREPAIRABLE)
                or (trailing and problem["location"] == f"messages.{len(exchange.body['messages']) - 1}"))
    if all(p.repairable for p in before):
        assert left == []
        assert find_problem(exchange.body, EmulatorOptions()) is None
    if not before and not ordering.problems(messages):
        assert not exchange.changed
    # Nothing the client sent is lost: every original block is still there.
    kept = orjson.dumps(exchange.body)
    for message in messages:
        for block in message["content"] if isinstance(message["content"], list) else [message["content"]]:
            assert orjson.dumps(block)[1:-1] in kept
