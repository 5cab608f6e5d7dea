"""ordering: a message that answers tool calls opens with one contiguous run of tool_result blocks."""

from __future__ import annotations

import functools
import logging

import pytest
import support
from support import assistant, exchange_for, request, result, text, use, user

from plugins import ordering
from relay.config import Backend, Config
from relay.errors import ConfigError

rejection = functools.partial(support.rejection, ordering.relay_request)
passes = functools.partial(support.passes, ordering.relay_request)


def not_first(index, calls):
    return (f"messages.{index}: Did not find {calls} `tool_result` block(s) at the beginning of this "
            f"message. Messages following `tool_use` blocks must begin with a matching number of "
            f"`tool_result` blocks.")


def test_results_then_text_passes():
    passes(request(user(text("go")), assistant(use("toolu_a"), use("toolu_b")),
                   user(result("toolu_a"), result("toolu_b"), text("Explain briefly."), text("More."))))


def test_text_before_results_is_refused():
    body = request(user(text("go")), assistant(use("toolu_a")), user(text("first"), result("toolu_a")))
    assert rejection(body) == not_first(2, 1)


def test_results_split_by_text_are_refused():
    body = request(user(text("go")), assistant(text("two"), use("toolu_a"), use("toolu_b")),
                   user(result("toolu_a"), text("between"), result("toolu_b")))
    assert rejection(body) == not_first(2, 2)


def test_the_count_is_the_previous_messages_tool_use_blocks():
    body = request(user(text("go")),
                   assistant({"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search",
                              "input": {}}, use("toolu_a"), use("toolu_b"), use("toolu_c")),
                   user(text("x"), result("toolu_a")))
    assert rejection(body) == not_first(2, 3)


def test_placement_is_checked_across_system_entries():
    body = request(user(text("go")), assistant(use("toolu_a")), {"role": "system", "content": "note"},
                   user(text("first"), result("toolu_a")))
    assert rejection(body) == not_first(3, 1)


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
    assert [p.location for p in ordering.problems(messages)] == ["messages.2", "messages.6"]


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
                                     "moved_results_first": ["messages.2"]}
    assert "messages.2" in caplog.text
    assert ordering.problems(body["messages"]) == []


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
        {"location": "messages.2", "message": not_first(2, 1)},
        {"location": "messages.4", "message": not_first(4, 2)},
    ]
    exchange = exchange_for(body)
    assert ordering.relay_validate(exchange, {}, True) == []
    assert exchange.changed and exchange.repairs == 2
    assert ordering.relay_validate(exchange_for(exchange.body), {}, False) == []
    assert ordering.relay_validate(exchange_for(body), {"ordering_mode": "off"}, False) is None


def test_startup_checks_the_mode_in_options_and_quirks():
    config = Config(backends=[Backend(name="a", url="http://x", models=["*"],
                                      quirks={"ordering_mode": "sort"})])
    with pytest.raises(ConfigError, match=r"^plugins\.ordering\.ordering_mode: "):
        ordering.relay_startup(config, {"ordering_mode": "maybe"})
    with pytest.raises(ConfigError, match=r"^backends\[0\]\.quirks\.ordering_mode: "):
        ordering.relay_startup(config, {})
    config.backends[0].quirks["ordering_mode"] = "repair"
    ordering.relay_startup(config, {"ordering_mode": "off"})
