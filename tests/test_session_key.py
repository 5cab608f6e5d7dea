"""The rule that groups requests into sessions (relay.sessions.session_key)."""

import copy

from multidict import CIMultiDict

from relay.sessions import session_key
from relay.testing import exchange_for

FIRST = {"model": "claude-sonnet-4-5", "max_tokens": 64,
         "system": [{"type": "text", "text": "You are terse.",
                     "cache_control": {"type": "ephemeral"}}],
         "tools": [{"name": "Bash", "input_schema": {"type": "object"}}],
         "messages": [{"role": "user", "content": [
             {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}]}


def later_turn():
    body = copy.deepcopy(FIRST)
    body["model"] = "claude-opus-4-5"  # a /model switch stays in the session
    del body["messages"][0]["content"][0]["cache_control"]  # the breakpoint moved on
    body["messages"] += [{"role": "assistant", "content": "hello"},
                         {"role": "user", "content": [{"type": "text", "text": "more",
                                                       "cache_control": {"type": "ephemeral"}}]}]
    return body


def keyed(body, headers=None, key_name=None):
    exchange = exchange_for(body)
    if headers:
        exchange.client_headers = CIMultiDict(exchange.client_headers, **headers)
    exchange.key_name = key_name
    return session_key(exchange)


def test_a_conversation_keeps_its_fingerprint_as_it_grows_and_its_breakpoints_move():
    assert keyed(FIRST) == keyed(later_turn())


def test_another_first_message_or_system_is_another_session():
    other = copy.deepcopy(FIRST)
    other["messages"][0]["content"][0]["text"] = "hello"
    assert keyed(other) != keyed(FIRST)
    other = copy.deepcopy(FIRST)
    other["system"][0]["text"] = "You are verbose."
    assert keyed(other) != keyed(FIRST)


def test_the_claude_code_header_wins_then_metadata_user_id():
    header = {"X-Claude-Code-Session-Id": "3f6c"}
    assert keyed(FIRST, header) == keyed({**FIRST, "system": "other"}, header)
    assert keyed(FIRST, header) != keyed(FIRST, {"X-Claude-Code-Session-Id": "9a1b"})
    user = {**FIRST, "metadata": {"user_id": "user_abc_session_1"}}
    assert keyed(user) == keyed({**later_turn(), "metadata": {"user_id": "user_abc_session_1"}})
    assert keyed(user) != keyed(FIRST)


def test_tenants_never_share_a_session_and_the_key_holds_nothing_sent():
    header = {"X-Claude-Code-Session-Id": "3f6c"}
    assert keyed(FIRST, header, "team-a") != keyed(FIRST, header, "team-b")
    assert "3f6c" not in keyed(FIRST, header, "team-a")


def test_a_request_without_messages_has_no_session():
    assert keyed({"model": "m", "max_tokens": 1, "messages": []}) is None
