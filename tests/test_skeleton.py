"""The request skeleton: what it decodes, what it keeps raw, and that the request chain reaches
the same verdict and sends the same request through it as through a full parse."""

from __future__ import annotations

import msgspec
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from relay_builtins import dedup, ordering, pairing

from relay import skeleton
from relay.config import Backend
from relay.errors import RelayError
from relay.exchange import Exchange

PROPERTY = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=300)


def history_body(**extra):
    return {"model": "m", "max_tokens": 100, "system": [{"type": "text", "text": "be brief"}],
            "messages": [
                {"role": "user", "content": "list the files"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "ls will do", "signature": "c2ln"},
                    {"type": "tool_use", "id": "toolu_1", "name": "Bash",
                     "input": {"command": "ls", "nested": [1, 2.5, None, True]}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": False,
                     "content": [{"type": "text", "text": "a.py\nb.py → café"}],
                     "cache_control": {"type": "ephemeral"}}]}],
            **extra}


def exchange_for(raw: bytes, parsed) -> Exchange:
    kind = {"body": parsed} if type(parsed) is dict else {"skeleton": parsed}
    return Exchange(endpoint="messages", method="POST", path="/v1/messages", query="", headers={},
                    raw_body=raw, backend=Backend(name="b", url="http://x", models=["*"]), **kind)


# --- decoding ---------------------------------------------------------------------------------


def test_structure_is_decoded_and_the_rest_kept_as_sent():
    raw = orjson.dumps(history_body())
    found = skeleton.decode(raw)
    assert found.model == "m" and found.stream is False
    user, call, answer = found.messages
    assert user == {"role": "user", "content": "list the files"}
    thinking, tool_use = call["content"]
    assert thinking["type"] == "thinking" and isinstance(thinking["thinking"], msgspec.Raw)
    assert (tool_use["type"], tool_use["id"]) == ("tool_use", "toolu_1")
    assert bytes(tool_use["input"]) == b'{"command":"ls","nested":[1,2.5,null,true]}'
    (result,) = answer["content"]
    assert (result["type"], result["tool_use_id"]) == ("tool_result", "toolu_1")
    assert bytes(result["is_error"]) == b"false"
    assert orjson.loads(found.encode()) == orjson.loads(raw)


def test_escaped_structural_strings_are_decoded():
    raw = (b'{"model":"m","messages":[{"role":"assistant","content":[{"type":"tool\\u005fuse",'
           b'"id":"toolu_\\u00e9\\"x","name":"n","input":{}}]}]}')
    block = skeleton.decode(raw).messages[0]["content"][0]
    assert (block["type"], block["id"]) == ("tool_use", 'toolu_é"x')


def test_a_field_it_does_not_know_is_kept():
    body = history_body(future_field={"a": [1, "two"]}, stream=True)
    found = skeleton.decode(orjson.dumps(body))
    assert found is not None and found.stream is True
    assert orjson.loads(found.encode()) == body


@pytest.mark.parametrize("stream, expected", [("true", True), ("false", False), ("null", False),
                                              ('"yes"', True), ("0", False), ("1", True)])
def test_stream_is_read_as_the_full_parse_reads_it(stream, expected):
    raw = b'{"model":"m","messages":[],"stream":%s}' % stream.encode()
    assert skeleton.decode(raw).stream is expected
    assert skeleton.decode(raw.replace(b'"messages"', b'"later":1,"messages"')).stream is expected


@pytest.mark.parametrize("raw", [
    b'[1, 2]',
    b'{"model": "m"}',
    b'{"messages": []}',
    b'{"model": 7, "messages": []}',
    b'{"model": "m", "messages": {}}',
    b'{"model": "m", "messages": [1]}',
    b'{"model": "m", "messages": [{"role": "user", "content": null}]}',
    b'{"model": "m", "messages": [{"role": "user", "content": ["text"]}]}',
    b'{"model": "m", "messages": [{"role": "user", "content": [], "n": 3}]}',
    b'{"model": "m", "messages": [], "extra": 1, "model": 7}',
    b'{"model": "m", "messages": []',
    b'{"model": "m", "messages": []} trailing',
    b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}',
])
def test_what_it_cannot_hold_is_left_to_the_full_parse(raw):
    assert skeleton.decode(raw) is None


def test_set_model_on_either_decode():
    for body in (history_body(), history_body(unknown=1)):
        found = skeleton.decode(orjson.dumps(body))
        found.set_model("upstream-model")
        assert orjson.loads(found.encode()) == {**body, "model": "upstream-model"}


# --- the exchange's two views -----------------------------------------------------------------


def test_unchanged_request_goes_up_as_the_client_sent_it():
    raw = orjson.dumps(history_body())
    exchange = exchange_for(raw, skeleton.decode(raw))
    assert exchange.messages[1]["content"][1]["id"] == "toolu_1"
    assert exchange.upstream_body() is raw


def test_a_change_to_messages_carries_into_body_and_up():
    raw = orjson.dumps(history_body())
    exchange = exchange_for(raw, skeleton.decode(raw))
    exchange.messages[1]["content"][1]["id"] = "toolu_1-2"
    exchange.messages[2]["content"][0]["tool_use_id"] = "toolu_1-2"
    exchange.mark_changed()
    body = exchange.body
    assert body["messages"][1]["content"][1] == {"type": "tool_use", "id": "toolu_1-2", "name": "Bash",
                                                 "input": {"command": "ls", "nested": [1, 2.5, None, True]}}
    # From now on the full parse is the request: messages is its list, and changes follow it.
    assert exchange.messages is body["messages"]
    body["messages"][0]["content"] = "changed"
    sent = orjson.loads(exchange.upstream_body())
    assert sent["messages"][0]["content"] == "changed"
    assert sent["messages"][2]["content"][0]["tool_use_id"] == "toolu_1-2"


def test_asking_for_body_keeps_what_plugins_hold_of_messages():
    raw = orjson.dumps(history_body())
    exchange = exchange_for(raw, skeleton.decode(raw))
    messages = exchange.messages
    call = messages[1]["content"][1]
    call["id"] = "toolu_1-2"  # before body is asked for, marked changed after
    body = exchange.body
    assert body["messages"] is messages and exchange.messages is messages
    messages[2]["content"][0]["tool_use_id"] = "toolu_1-2"  # through the held reference
    body["messages"][0]["content"] = [{"type": "text", "text": msgspec.Raw(b'"raw text"')}]
    exchange.mark_changed()
    sent = orjson.loads(exchange.upstream_body())
    assert sent["messages"][0]["content"] == [{"type": "text", "text": "raw text"}]
    assert sent["messages"][1]["content"][1]["id"] == "toolu_1-2"
    assert sent["messages"][2]["content"][0]["tool_use_id"] == "toolu_1-2"
    assert sent["messages"][2]["content"][0]["content"] == [{"type": "text", "text": "a.py\nb.py → café"}]


def test_value_reads_raw_and_decoded_values_alike():
    raw = orjson.dumps(history_body())
    exchange = exchange_for(raw, skeleton.decode(raw))
    block = exchange.messages[1]["content"][1]
    assert type(block["input"]) is msgspec.Raw
    before = skeleton.value(block["input"])
    _ = exchange.body  # asked for: the skeleton is decoded in place
    assert type(block["input"]) is dict and skeleton.value(block["input"]) == before == {
        "command": "ls", "nested": [1, 2.5, None, True]}


def test_broken_text_is_the_clients_400_when_a_plugin_asks_for_body():
    raw = b'{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"\xff"}]}]}'
    exchange = exchange_for(raw, skeleton.decode(raw))
    assert exchange.messages[0]["content"][0]["type"] == "text"
    with pytest.raises(RelayError) as caught:
        _ = exchange.body
    assert caught.value.status == 400 and "not valid JSON" in caught.value.message


def test_after_sending_broken_text_is_a_plugin_fault_not_the_clients_400():
    # Asked for in a response hook, say: the upstream has answered, and that answer must not
    # turn into the client's 400 (the chain logs the fault and passes the answer on).
    raw = b'{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"\xff"}]}]}'
    exchange = exchange_for(raw, skeleton.decode(raw))
    exchange.release_body(exchange.upstream_body())
    with pytest.raises(Exception) as caught:
        _ = exchange.body
    assert not isinstance(caught.value, RelayError)


def test_the_model_cannot_change_once_the_request_is_sent():
    raw = orjson.dumps(history_body())
    exchange = exchange_for(raw, skeleton.decode(raw))
    exchange.release_body(exchange.upstream_body())
    with pytest.raises(RuntimeError):
        exchange.set_model("other")


def test_a_plugin_may_replace_the_whole_body():
    raw = orjson.dumps(history_body())
    exchange = exchange_for(raw, skeleton.decode(raw))
    exchange.body = {"model": "m", "messages": [{"role": "user", "content": "new"}]}
    exchange.mark_changed()
    assert exchange.messages == [{"role": "user", "content": "new"}]
    assert orjson.loads(exchange.upstream_body()) == exchange.body


def test_after_release_both_views_are_read_again_from_what_was_sent():
    raw = orjson.dumps(history_body())
    exchange = exchange_for(raw, skeleton.decode(raw))
    exchange.set_model("other")
    sent = exchange.upstream_body()
    exchange.release_body(sent)
    assert exchange.upstream_body() is sent
    assert exchange.messages[1]["content"][1]["id"] == "toolu_1"
    assert exchange.body["model"] == "other" and exchange.model == "m"


# --- the chain through a skeleton and through a full parse ------------------------------------

ids = st.sampled_from(["toolu_a", "toolu_b", "toolu_a-2", "toolu_b-3", "c\u00e9"])
opaque = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=4),
                      lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.sampled_from(["a", "b", "type"]), inner, max_size=3),
                      max_leaves=6)
blocks = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, st.text(max_size=6)),
    st.builds(lambda i, v: {"type": "tool_use", "id": i, "name": "Bash", "input": {"v": v}}, ids, opaque),
    st.builds(lambda i, v: {"type": "tool_result", "tool_use_id": i, "content": v}, ids, opaque),
    st.builds(lambda v: {"type": "thinking", "thinking": "t", "signature": v}, opaque),
    st.builds(lambda v: {"type": "image", "source": v, "cache_control": {"type": "ephemeral"}}, opaque),
)
messages = st.lists(st.builds(lambda role, content: {"role": role, "content": content},
                              st.sampled_from(["user", "assistant", "user", "assistant", "system"]),
                              st.text(max_size=5) | st.lists(blocks, max_size=4)),
                    max_size=8)
modes = st.sampled_from(["reject", "repair", "off"])


def run_chain(raw: bytes, parsed, pairing_mode: str, ordering_mode: str, restore: bool):
    exchange = exchange_for(raw, parsed)
    try:
        dedup.relay_request(exchange, {"restore_original_ids": restore})
        pairing.relay_request(exchange, {"pairing_mode": pairing_mode, "restore_original_ids": restore})
        ordering.relay_request(exchange, {"ordering_mode": ordering_mode})
    except RelayError as error:
        return ("refused", error.status, error.message)
    sent = exchange.upstream_body()
    return ("sent", orjson.loads(sent), sent is raw, exchange.translation, exchange.repairs,
            [(step["step"], step["action"]) for step in exchange.timeline])


@PROPERTY
@given(messages, modes, modes, st.booleans(), st.booleans())
def test_the_chain_reaches_the_same_result_through_either_decode(history, pairing_mode, ordering_mode,
                                                                 restore, unknown_field):
    body = {"model": "m", "max_tokens": 5, "messages": history}
    if unknown_field:
        body["not_yet_known"] = {"x": 1}
    raw = orjson.dumps(body)
    found = skeleton.decode(raw)
    assert found is not None
    through_skeleton = run_chain(raw, found, pairing_mode, ordering_mode, restore)
    through_body = run_chain(raw, orjson.loads(raw), pairing_mode, ordering_mode, restore)
    assert through_skeleton == through_body
