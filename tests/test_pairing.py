"""pairing: every client tool_use answered by exactly one tool_result in the next turn.

Plain histories through the plugin's hooks. The rules' evidence is exercised in
test_evidence.py; generated histories with several faults in test_history_properties.py.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import re
from pathlib import Path

import orjson
import pytest
import support
from relay_builtins import ordering, pairing
from support import assistant, exchange_for, request, result, text, use, user

from relay.errors import RelayError

rejection = functools.partial(support.refuses, pairing.relay_request)
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
    found, _ = pairing.check(body["messages"])
    assert [p.location for p in found] == ["messages.2.content.0", "messages.2"]


def test_seed_corrected_history_passes_untouched():
    passes(request(user(text("Look up DEMO-42.")), *SEED_CORRECTED))


def test_missing_result_names_the_message_that_should_hold_it():
    # As the API does (Mirascope#2503: [user, assistant tool_use, user text] -> messages.2).
    body = request(user(text("go")), assistant(text("two calls"), use("toolu_a"), use("toolu_b")),
                   user(result("toolu_a")))
    assert rejection(body) == missing_text(2, "toolu_b")


def test_every_missing_id_is_named_in_call_order():
    body = request(user(text("go")), assistant(use("toolu_a"), use("toolu_b"), use("toolu_c")),
                   user(text("no results at all")))
    assert rejection(body) == missing_text(2, "toolu_a", "toolu_b", "toolu_c")


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


def test_trailing_tool_use_is_forwarded_with_a_note():
    # A prefill: whether the model continues it or refuses it is the model's business.
    exchange = passes(request(user(text("go")), assistant(text("calling"), use("toolu_a"))))
    (note,) = exchange.timeline
    assert (note["step"], note["action"], note["location"]) == ("pairing", "unsure", "messages.1")


def test_consecutive_messages_of_one_role_are_one_turn():
    body = request(user(text("go")), assistant(use("toolu_a")), assistant(text("then this")),
                   user(text("hm")))
    assert rejection(body) == missing_text(3, "toolu_a")
    # Results split over consecutive user messages answer the calls (the API combines them).
    split = request(user(text("go")), assistant(use("toolu_a"), use("toolu_b")),
                    user(result("toolu_a")), user(result("toolu_b"), text("go on")))
    found, unsure = pairing.check(split["messages"])
    assert found == [] and unsure == []


def test_string_content_cannot_answer_a_call():
    body = request(user(text("go")), assistant(use("toolu_a")), {"role": "user", "content": "next"})
    assert rejection(body) == missing_text(2, "toolu_a")


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
    assert rejection(body, {"restore_original_ids": True}) == missing_text(4, "functions.Bash:0")


def test_problems_come_in_message_order():
    messages = [user(text("go")), assistant(use("toolu_a")), user(result("toolu_x")),
                assistant(use("toolu_a"), result("toolu_a")), user(text("x"))]
    found, _ = pairing.check(messages)
    assert [p.location for p in found] == [
        "messages.2.content.0", "messages.2", "messages.3", "messages.3.content.0", "messages.4"]


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
        user(result("toolu_a"), {"type": "brand_new_block", "x": 1}),
        {"role": "system", "content": [text("another")]},
        assistant(text("done")),
        {"role": "system", "content": "a reminder Claude Code put here"},
    )
    exchange = passes(body)
    # code_execution_tool_result without its server_tool_use: only the advisor's refusal is
    # recorded, so this one goes up, noted.
    assert [(n["action"], n["location"]) for n in exchange.timeline] == [("unsure", "messages.1.content.5")]


def server_use(tool_use_id, name="web_search"):
    return {"type": "server_tool_use", "id": tool_use_id, "name": name, "input": {}}


def server_result(tool_use_id, kind="web_search_tool_result"):
    return {"type": kind, "tool_use_id": tool_use_id, "content": []}


def alone_text(index, k, kind, id):
    return (f"messages.{index}.content.{k}: unexpected `tool_use_id` found in `{kind}` blocks: "
            f"{id}. Each `{kind}` block must have a corresponding `server_tool_use` block before it.")


@pytest.mark.parametrize("mode", ["reject", "repair"])
@pytest.mark.parametrize("messages, k", [
    ([user(text("news?")), assistant(server_result("srvtoolu_1"), text("Based on that"))], 0),
    # Before its own call in the message (greenthread-ai/klaudia: "a result that precedes its
    # call is rejected").
    ([user(text("news?")), assistant(text("x"), server_result("srvtoolu_1"), server_use("srvtoolu_1"))], 1),
    # A server result does not pair with a client call of the same id.
    ([user(text("news?")), assistant(use("srvtoolu_1")), user(result("srvtoolu_1")),
      assistant(server_result("srvtoolu_1"))], 0),
])
def test_a_web_search_result_with_no_call_before_it_is_refused(messages, k, mode):
    body = request(*messages)
    index = len(messages) - 1
    assert rejection(body, {"pairing_mode": mode}) == alone_text(index, k, "web_search_tool_result",
                                                                 "srvtoolu_1")


def test_a_server_result_in_the_turn_after_its_deferred_call_passes_without_a_note():
    # The API runs a server tool called beside client tools on the next request (docs: server
    # tools), and a programmatic run ends in a code_execution_tool_result turns later.
    body = request(user(text("search and look")),
                   assistant(server_use("srvtoolu_1"), use("toolu_a")), user(result("toolu_a")),
                   assistant(server_result("srvtoolu_1"), server_use("srvtoolu_2", "code_execution"),
                             {**use("toolu_b"), "caller": {"type": "code_execution_20260120",
                                                           "tool_id": "srvtoolu_2"}}),
                   user(result("toolu_b")),
                   assistant(server_result("srvtoolu_2", "code_execution_tool_result"), text("done")))
    assert passes(body).timeline == []


def test_a_server_result_split_from_a_turn_without_client_calls_goes_up_noted():
    # The shape of the advisor reports (claude-code#65938 and others), whose refused requests
    # may have lost the server_tool_use on the way: forwarded, noted at the result.
    body = request(user(text("ask")), assistant(text("asking"), server_use("srvtoolu_1", "advisor")),
                   user(text("The user named this session.")),
                   assistant(server_result("srvtoolu_1", "advisor_tool_result"), text("done")))
    exchange = passes(body)
    assert [(n["action"], n["location"]) for n in exchange.timeline] == [("unsure", "messages.3.content.0")]
    assert "earlier assistant turn" in exchange.timeline[0]["reason"]
    # A pause_turn continuation in the next assistant message is the same turn: nothing to note.
    body = request(user(text("research")), assistant(text("searching"), server_use("srvtoolu_1")),
                   assistant(server_result("srvtoolu_1"), text("found")))
    assert passes(body).timeline == []


@pytest.mark.parametrize("kind", ["web_fetch_tool_result", "bash_code_execution_tool_result",
                                  "text_editor_code_execution_tool_result",
                                  "tool_search_tool_result", "mcp_tool_result"])
def test_other_server_results_without_a_call_go_up_noted(kind):
    exchange = passes(request(user(text("go")), assistant(text("x"), server_result("srvtoolu_1", kind))))
    assert [(n["action"], n["location"]) for n in exchange.timeline] == [("unsure", "messages.1.content.1")]
    assert passes(request(user(text("go")), assistant(
        {"type": "mcp_tool_use", "id": "mcptoolu_1", "name": "f", "server_name": "s", "input": {}}
        if kind == "mcp_tool_result" else server_use("srvtoolu_1"),
        server_result("mcptoolu_1" if kind == "mcp_tool_result" else "srvtoolu_1", kind)))).timeline == []


def sdk_result_kinds() -> set[str]:
    """The server-tool result block types the installed anthropic SDK declares."""
    kinds = set()
    # Found, not imported: importing the SDK takes seconds.
    types = Path(importlib.util.find_spec("anthropic").origin).parent / "types"
    for path in [*types.glob("*tool_result_block*.py"), *types.glob("beta/*tool_result_block*.py")]:
        kinds.update(re.findall(r'Literal\["([a-z_]+_tool_result)"\]', path.read_text()))
    return kinds - {"tool_result"}


def test_every_server_result_kind_the_sdk_declares_is_refused_or_noted_when_alone():
    kinds = sdk_result_kinds()
    assert {"advisor_tool_result", "web_search_tool_result", "code_execution_tool_result"} <= kinds
    for kind in sorted(kinds):
        body = request(user(text("go")), assistant(text("x"), server_result("srvtoolu_1", kind)))
        if kind in ("advisor_tool_result", "web_search_tool_result"):
            assert rejection(body) == alone_text(1, 1, kind, "srvtoolu_1")
        else:
            assert [n["location"] for n in passes(body).timeline] == ["messages.1.content.1"], kind


def open_text(index, name, id):
    return (f"messages.{index}: `{name}` tool use with id `{id}` was found without a corresponding "
            f"`{name}_tool_result` block")


def deferred(*answer, name="web_fetch"):
    """A server call deferred beside a client call (docs: server tools, "Mixing server tools and
    client tools in one turn"), then the user turn ``answer``."""
    return request(user(text("fetch it and run it")),
                   assistant(text("both"), server_use("srvtoolu_1", name), use("toolu_a")), *answer)


@pytest.mark.parametrize("mode", ["reject", "repair"])
@pytest.mark.parametrize("answer", [
    [user(result("toolu_a"), text("What next?"))],
    [user(result("toolu_a")), user(text("and this"))],  # peer user messages are the same turn
    [user(result("toolu_a")), {"role": "user", "content": "a plain string too"}],
])
def test_a_user_turn_that_adds_to_the_results_of_a_deferred_call_is_refused(answer, mode):
    assert rejection(deferred(*answer), {"pairing_mode": mode}) == open_text(1, "web_fetch", "srvtoolu_1")


def test_a_deferred_call_continued_by_the_results_alone_passes():
    assert passes(deferred(user(result("toolu_a")))).timeline == []
    # The client's pairing faults come first, in the client tool's words (the docs say so too).
    rules = [[p.rule for p in pairing.check(deferred(answer)["messages"])[0]]
             for answer in (user(text("first"), result("toolu_a")), user(text("no results")))]
    assert rules == [[], ["unanswered-call"]]  # the first is ordering's to refuse
    # Its result missing from the turn after: unknown, noted.
    exchange = passes(deferred(user(result("toolu_a")), assistant(text("done")), user(text("ok"))))
    assert [(n["action"], n["location"]) for n in exchange.timeline] == [("unsure", "messages.1")]


def test_a_paused_server_call_must_stay_the_last_message():
    paused = [user(text("research")), assistant(text("searching"), server_use("srvtoolu_1"))]
    assert passes(request(*paused)).timeline == []  # the pause_turn continuation
    assert rejection(request(*paused, user(text("never mind")))) == open_text(1, "web_search", "srvtoolu_1")
    # Its result later in the same turn, or a call from code execution: nothing to say.
    passes(request(*paused, assistant(server_result("srvtoolu_1"), text("found")), user(text("ok"))))
    from_code = {**server_use("srvtoolu_2"), "caller": {"type": "code_execution_20260120",
                                                        "tool_id": "srvtoolu_3"}}
    assert passes(request(user(text("go")), assistant(from_code), user(text("ok")))).timeline == []


@pytest.mark.parametrize("block", [server_use("srvtoolu_1", "advisor"),
                                   server_use("srvtoolu_1", "code_execution"),
                                   {"type": "mcp_tool_use", "id": "srvtoolu_1", "name": "f",
                                    "server_name": "s", "input": {}}])
def test_other_server_calls_left_open_go_up_noted(block):
    exchange = passes(request(user(text("go")), assistant(text("x"), block), user(text("next"))))
    assert [(n["action"], n["location"]) for n in exchange.timeline] == [("unsure", "messages.1")]


def test_a_system_entry_must_precede_an_assistant_message_or_end_the_array():
    # claude-code#73821; so nothing may stand between calls and their results.
    body = request(user(text("go")), assistant(use("toolu_a")),
                   {"role": "system", "content": "reminder"}, user(result("toolu_a")))
    assert rejection(body) == ("messages.2: role 'system' must precede an 'assistant' message or "
                               "end the array")
    exchange = passes(request({"role": "system", "content": "first"}, assistant(text("hi")),
                              user(text("go"))))
    assert [n["location"] for n in exchange.timeline] == ["messages.0"]


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
    body = request(user(text("go")), assistant(use("toolu_a")), user(text("y")))
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
    assert pairing.check(body["messages"]) == ([], [])
    assert orjson.loads(exchange.upstream_body()) == body


def test_repair_goes_to_the_front_of_a_misplaced_run():
    # The run stays in one piece, so the ordering plugin can still move it whole.
    body = request(user(text("go")), assistant(use("toolu_a"), use("toolu_b")),
                   user(text("first"), result("toolu_b")))
    exchange = exchange_for(body)
    pairing.relay_request(exchange, {"pairing_mode": "repair"})
    assert [b.get("tool_use_id") for b in exchange.messages[2]["content"]] == [None, "toolu_a", "toolu_b"]


def test_repair_answers_calls_split_over_consecutive_messages_in_the_answering_turn():
    body = request(user(text("go")), assistant(use("toolu_a")), assistant(text("x"), use("toolu_b")),
                   user(text("y")))
    exchange = exchange_for(body)
    pairing.relay_request(exchange, {"pairing_mode": "repair"})
    messages = exchange.body["messages"]  # the request as repaired
    assert [b.get("tool_use_id") for b in messages[3]["content"]] == ["toolu_a", "toolu_b", None]
    assert exchange.repairs == 2 and exchange.response_headers["x-relay-repairs"] == "2"
    # Text after a call: not merged here (that would move the indexes the errors name); the
    # ordering plugin refuses it or puts it in place.
    assert [m["role"] for m in messages] == ["user", "assistant", "assistant", "user"]
    assert [e["action"] for e in exchange.timeline] == ["repaired", "unsure"]
    ordering.relay_request(exchange, {"ordering_mode": "repair"})
    assert [[b["type"] for b in m["content"]] for m in exchange.body["messages"]] == [
        ["text"], ["text", "tool_use", "tool_use"], ["tool_result", "tool_result", "text"]]


def test_split_tool_turns_are_merged_losslessly_and_counted():
    body = request(user(text("go")), assistant(text("two calls")), assistant(use("toolu_a")),
                   assistant(use("toolu_b")), user(result("toolu_a")), user(result("toolu_b"), text("on")))
    exchange = exchange_for(body)
    pairing.relay_request(exchange, {})
    messages = exchange.body["messages"]
    assert messages == [user(text("go")), assistant(text("two calls")),
                        assistant(use("toolu_a"), use("toolu_b")),
                        user(result("toolu_a"), result("toolu_b"), text("on"))]
    assert exchange.repairs == 2 and exchange.response_headers["x-relay-repairs"] == "2"
    assert exchange.timeline[-1]["merged_consecutive"] == ["messages.2-3", "messages.4-5"]
    # Off for a backend that reads turns as the API does: the client's bytes go up.
    passes(body, {"merge_consecutive": False})


def test_a_split_tool_turn_is_merged_before_a_final_prefill_with_text_after_its_call():
    # The final assistant turn is a prefill, left to the model's rules: whatever it holds, it
    # puts no earlier turn out of place (hypothesis found the merge skipped for it).
    prefill = assistant(text("one more"), use("toolu_z"), text("and then"))
    body = request(user(text("go")), assistant(use("toolu_a"), use("toolu_b")),
                   user(result("toolu_a")), user(result("toolu_b"), text("on")), prefill)
    exchange = exchange_for(body)
    pairing.relay_request(exchange, {})
    assert exchange.body["messages"][2:] == [
        user(result("toolu_a"), result("toolu_b"), text("on")), prefill]
    assert exchange.timeline[-1]["merged_consecutive"] == ["messages.2-3"]


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


# --- relay validate ---------------------------------------------------------------------------


def test_validate_lists_every_problem():
    body = request(user(text("go")), assistant(use("toolu_a"), use("toolu_b")), user(result("toolu_a")),
                   assistant(use("toolu_c")), user(result("toolu_c"), result("toolu_c")),
                   assistant(use("toolu_d")))
    found = pairing.relay_validate(exchange_for(body), {}, False)
    assert found == [
        {"location": "messages.2", "message": missing_text(2, "toolu_b")},
        {"location": "messages.4.content.1",
         "message": "messages.4.content.1: each tool_use must have a single result. Found multiple "
                    "`tool_result` blocks with id: toolu_c"},
    ]


def test_validate_repair_returns_only_what_is_left():
    body = request(user(text("go")), assistant(use("toolu_a"), use("toolu_b")), user(result("toolu_a")),
                   assistant(use("toolu_d")))
    exchange = exchange_for(body)
    assert pairing.relay_validate(exchange, {}, True) == []  # the trailing call is a prefill
    assert exchange.changed and exchange.repairs == 1
    assert [e["action"] for e in exchange.timeline] == ["unsure", "repaired"]
    assert pairing.relay_validate(exchange_for(request(*SEED_CORRECTED)), {}, True) == []
    assert pairing.relay_validate(exchange_for(request(*SEED_BROKEN)), {"pairing_mode": "off"}, False) is None


def test_a_merge_never_moves_the_index_an_error_names():
    body = request(user(text("go")), assistant(use("toolu_a")), assistant(use("toolu_b")),
                   user(result("toolu_a"), result("toolu_b")),
                   assistant(use("toolu_c")), user(text("note"), result("toolu_c")))
    exchange = exchange_for(body)
    pairing.relay_request(exchange, {})
    assert not exchange.changed  # left as sent: the ordering fault comes next
    with pytest.raises(RelayError) as caught:
        ordering.relay_request(exchange, {})
    assert caught.value.message.startswith("messages.5: `tool_use` ids were found without")
