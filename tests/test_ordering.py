"""ordering: calls end their assistant turn; the answering turn opens with one run of tool_result blocks."""

from __future__ import annotations

import functools
import logging

import support
from relay_builtins import ordering
from support import assistant, exchange_for, request, result, text, use, user

rejection = functools.partial(support.refuses, ordering.relay_request)
passes = functools.partial(support.passes, ordering.relay_request)


def not_first(index, *ids):
    # The older "Did not find N `tool_result` block(s)" wording is superseded: a text block before
    # the results now gets this one (learn-claude-code PR #210), naming the calls it displaced.
    return (f"messages.{index}: `tool_use` ids were found without `tool_result` blocks immediately "
            f"after: {', '.join(ids)}. Each `tool_use` block must have a corresponding `tool_result` "
            f"block in the next message.")


def test_results_then_text_passes():
    passes(request(user(text("go")), assistant(use("toolu_a"), use("toolu_b")),
                   user(result("toolu_a"), result("toolu_b"), text("Explain briefly."), text("More."))))


def test_text_before_results_is_refused():
    body = request(user(text("go")), assistant(use("toolu_a")), user(text("first"), result("toolu_a")))
    assert rejection(body) == not_first(2, "toolu_a")


def test_results_split_by_text_are_refused():
    body = request(user(text("go")), assistant(text("two"), use("toolu_a"), use("toolu_b")),
                   user(result("toolu_a"), text("between"), result("toolu_b")))
    assert rejection(body) == not_first(2, "toolu_b")


def test_the_ids_are_the_calls_not_answered_at_the_start():
    body = request(user(text("go")),
                   assistant({"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search",
                              "input": {}}, use("toolu_a"), use("toolu_b"), use("toolu_c")),
                   user(text("x"), result("toolu_a")))
    assert rejection(body) == not_first(2, "toolu_a")


def test_placement_is_checked_across_system_entries():
    body = request(user(text("go")), {"role": "system", "content": "note"}, assistant(use("toolu_a")),
                   user(text("first"), result("toolu_a")))
    assert rejection(body) == not_first(3, "toolu_a")


def test_text_after_a_call_in_its_turn_is_refused():
    # The recorded real exchange: [tool_use call_1, text] then the result -> messages.1.
    body = {"model": "m", "messages": [assistant(use("call_1"), text("I will check.")),
                                       user(result("call_1")), user(text("answer briefly"))]}
    assert rejection(body) == not_first(1, "call_1")
    split = request(user(text("go")), assistant(use("toolu_a")), assistant(text("then")),
                    user(result("toolu_a")))
    assert rejection(split) == not_first(3, "toolu_a")
    # Text first, then the call, in one message or two consecutive ones, is what the API accepts.
    passes(request(user(text("go")), assistant(text("I will check."), use("toolu_a")), user(result("toolu_a"))))
    passes(request(user(text("go")), assistant(text("I will")), assistant(use("toolu_a")),
                   user(result("toolu_a")), user(text("go on"))))


def test_another_block_after_a_call_is_forwarded_with_a_note():
    server = [{"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {}},
              {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []}]
    exchange = passes(request(user(text("go")), assistant(use("toolu_a"), *server), user(result("toolu_a"))))
    assert [(n["step"], n["action"], n["location"]) for n in exchange.timeline] == [
        ("ordering", "unsure", "messages.2")]


def test_repair_moves_text_before_the_calls():
    body = {"model": "m", "messages": [assistant(use("call_1"), text("I will check.")),
                                       user(result("call_1")), user(text("answer briefly"))]}
    exchange = exchange_for(body)
    ordering.relay_request(exchange, {"ordering_mode": "repair"})
    assert exchange.body["messages"][0]["content"] == [text("I will check."), use("call_1")]
    assert exchange.repairs == 1
    split = request(user(text("go")), assistant(use("toolu_a")), assistant(text("then")),
                    user(result("toolu_a")))
    exchange = exchange_for(split)
    ordering.relay_request(exchange, {"ordering_mode": "repair"})
    assert exchange.body["messages"][1:] == [assistant(text("then"), use("toolu_a")), user(result("toolu_a"))]


def test_what_is_not_an_answer_to_tool_calls_is_left_to_pairing():
    # A result with no call before it is pairing's to report, wherever it sits.
    passes(request(user(text("go"), result("toolu_x"))))
    passes(request(user(text("go")), assistant(text("no tools")), user(text("x"), result("toolu_x"))))
    passes(request(user(text("go")), assistant(use("toolu_a")), user(text("x"), text("y")),
                   {"role": "user", "content": "z"}))


def test_server_tool_results_and_unknown_blocks_are_ordinary_content():
    passes(request(user(text("go")), assistant(use("toolu_a")),
                   user(result("toolu_a"), {"type": "web_search_tool_result", "tool_use_id": "s"},
                        {"type": "brand_new"}, text("x"))))


def test_malformed_input_is_left_to_the_upstream():
    for messages in (None, "x", [1, None], [{"role": "user", "content": [1, text(), result("a")]}],
                     [{"role": "user"}], [{"content": []}]):
        passes({"model": "m", "messages": messages})


def test_every_misplaced_message_is_found_in_order():
    messages = [user(text("go")), assistant(use("toolu_a")), user(text("x"), result("toolu_a")),
                assistant(use("toolu_b")), user(result("toolu_b")),
                assistant(use("toolu_c"), use("toolu_d")), user(result("toolu_c"), text("y"), result("toolu_d"))]
    assert [p.location for p in ordering.check(messages)[0]] == ["messages.2", "messages.6"]


def test_off_mode_forwards_anything():
    passes(request(user(text("go")), assistant(use("toolu_a")), user(text("first"), result("toolu_a"))),
           {"ordering_mode": "off"})


def test_repair_moves_results_first_and_keeps_everything(caplog):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    body = request(user(text("go")), assistant(use("toolu_a"), use("toolu_b")),
                   user(text("first"), result("toolu_b"), image, result("toolu_a"), text("last")))
    exchange = exchange_for(body)
    with caplog.at_level(logging.INFO, logger="relay.plugins.ordering"):
        ordering.relay_request(exchange, {"ordering_mode": "repair"})
    body = exchange.body  # the request as repaired
    assert body["messages"][2]["content"] == [result("toolu_b"), result("toolu_a"), text("first"),
                                              image, text("last")]
    assert exchange.changed and exchange.repairs == 1
    assert exchange.response_headers["x-relay-repairs"] == "1"
    assert exchange.timeline[-1] == {**exchange.timeline[-1], "step": "ordering", "action": "repaired",
                                     "moved_into_place": ["messages.2"]}
    assert "messages.2" in caplog.text
    assert ordering.check(body["messages"]) == ([], [])


def test_repairs_add_to_the_exchanges_count():
    body = request(user(text("go")), assistant(use("toolu_a")), user(text("x"), result("toolu_a")),
                   assistant(use("toolu_b")), user(text("y"), result("toolu_b")))
    exchange = exchange_for(body)
    exchange.repairs = 2  # say, results another plugin added
    ordering.relay_request(exchange, {"ordering_mode": "repair"})
    assert exchange.repairs == 4 and exchange.response_headers["x-relay-repairs"] == "4"


def test_validate_lists_every_problem_and_repair_leaves_none():
    body = request(user(text("go")), assistant(use("toolu_a")), user(text("x"), result("toolu_a")),
                   assistant(use("toolu_b"), use("toolu_c")),
                   user(result("toolu_b"), text("y"), result("toolu_c")))
    assert ordering.relay_validate(exchange_for(body), {}, False) == [
        {"location": "messages.2", "message": not_first(2, "toolu_a")},
        {"location": "messages.4", "message": not_first(4, "toolu_c")},
    ]
    exchange = exchange_for(body)
    assert ordering.relay_validate(exchange, {}, True) == []
    assert exchange.changed and exchange.repairs == 2
    assert ordering.relay_validate(exchange_for(exchange.body), {}, False) == []
    assert ordering.relay_validate(exchange_for(body), {"ordering_mode": "off"}, False) is None


