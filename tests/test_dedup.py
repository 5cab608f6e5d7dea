"""The dedup plugin: its pure id logic, its hooks, and properties over generated histories."""

import copy
import sys

import orjson
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from relay_builtins import dedup
from relay_builtins import pairing as pairing_plugin
from support import exchange_for

from relay.chain import Chain, load_plugins
from relay.config import parse
from relay.exchange import UpstreamResponse
from relay.sse import Event
from relay.testing.emulator import EmulatorOptions, find_problem

RESTORE = {"restore_original_ids": True}
# No deadline: a shared, loaded machine must not turn a slow example into a failure.
PROPERTY = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Few enough ids to collide often; some look like rewrites, some only nearly do.
POOL = ["toolu_a", "toolu_b", "toolu_a-2", "toolu_a-3", "toolu_b-10", "call-2", "a-1", "a-02",
        "-2", "x", "functions.Bash:0", "functions.Bash:0-2"]
ids = st.sampled_from(POOL)


def make_exchange(messages, quirks=None, endpoint="messages", stream=False):
    body = {"model": "m", "max_tokens": 10, "messages": messages}
    if stream:
        body["stream"] = True
    return exchange_for(body, quirks, endpoint)


def call(tool_id, n=0):
    return {"type": "tool_use", "id": tool_id, "name": "Bash", "input": {"n": n}}


def result(tool_id, text="ok"):
    return {"type": "tool_result", "tool_use_id": tool_id, "content": text}


def turn(*tool_ids):
    """An assistant message calling tools, and the user message answering them in order."""
    return [{"role": "assistant", "content": [call(t, k) for k, t in enumerate(tool_ids)]},
            {"role": "user", "content": [result(t, f"r{k}") for k, t in enumerate(tool_ids)]}]


def tool_use_ids(messages):
    return [b["id"] for m in messages if m.get("role") == "assistant" and isinstance(m.get("content"), list)
            for b in m["content"] if b.get("type") == "tool_use"]


def every_id(messages):
    """Every tool_use id and tool_result tool_use_id of a history."""
    found = set()
    for m in messages:
        if isinstance(m.get("content"), list):
            for b in m["content"]:
                if b.get("type") == "tool_use":
                    found.add(b["id"])
                elif b.get("type") == "tool_result":
                    found.add(b["tool_use_id"])
    return found


def pairing(messages):
    """Which call each tool_result answers: (message, block) -> (message, block).

    A result answers the first call not yet answered that has its id in the previous assistant
    message (system entries between them do not count).
    """
    pairs = {}
    calls = None
    for i, m in enumerate(messages):
        content = m.get("content")
        if m.get("role") == "assistant":
            calls = [(i, k, b["id"]) for k, b in enumerate(content)
                     if b.get("type") == "tool_use"] if isinstance(content, list) else None
        elif m.get("role") == "user":
            if isinstance(content, list) and calls:
                open_calls = list(calls)
                for k, b in enumerate(content):
                    if b.get("type") != "tool_result":
                        continue
                    for n, (ci, ck, cid) in enumerate(open_calls):
                        if cid == b["tool_use_id"]:
                            pairs[(i, k)] = (ci, ck)
                            del open_calls[n]
                            break
            calls = None
    return pairs


def without_ids(messages):
    """The history with client tool ids blanked: what dedup must never change."""
    out = copy.deepcopy(messages)
    for m in out:
        if isinstance(m.get("content"), list):
            for b in m["content"]:
                if b.get("type") == "tool_use":
                    b["id"] = None
                elif b.get("type") == "tool_result":
                    b["tool_use_id"] = None
    return out


@st.composite
def histories(draw, max_turns=8):
    """Histories with repeated ids, parallel calls, server tools, thinking, system entries,
    string contents, orphan results, and sometimes the start cut off (compaction)."""
    messages = [{"role": "user", "content": "start"}]
    for _ in range(draw(st.integers(0, max_turns))):
        if draw(st.integers(0, 4)) == 0:
            messages.append({"role": "system", "content": "a system note"})
        kind = draw(st.sampled_from(["tools", "tools", "tools", "text", "server"]))
        content = []
        if draw(st.booleans()):
            content.append({"type": "thinking", "thinking": "hmm", "signature": "sig"})
        if draw(st.booleans()):
            content.append({"type": "text", "text": "calling"})
        if kind == "server":
            content.append({"type": "server_tool_use", "id": draw(ids), "name": "web_search", "input": {}})
            content.append({"type": "web_search_tool_result", "tool_use_id": draw(ids), "content": []})
        calls = draw(st.lists(ids, min_size=1, max_size=3)) if kind == "tools" else []
        content += [call(t, k) for k, t in enumerate(calls)]
        messages.append({"role": "assistant", "content": content})
        if calls:
            order = draw(st.permutations(range(len(calls))))
            results = [result(calls[k], f"r{k}") for k in order]
            if draw(st.integers(0, 5)) == 0:
                results.append(result(draw(ids), "orphan"))
            if draw(st.booleans()):
                results.append({"type": "text", "text": "go on"})
            messages.append({"role": "user", "content": results})
        else:
            messages.append({"role": "user", "content": draw(st.sampled_from(
                ["go on", [{"type": "text", "text": "go on"}]]))})
    return messages[draw(st.integers(0, len(messages) - 1)):]


def reply(emitted):
    """An upstream answer: text, a server tool, then client tool calls with the given ids."""
    return ([{"type": "text", "text": "sure"},
             {"type": "server_tool_use", "id": "toolu_a", "name": "web_search", "input": {}}]
            + [call(t, k) for k, t in enumerate(emitted)])


def events_for(content):
    """The SSE events an upstream streams for a message with this content."""
    yield Event.build("message_start", {"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": "m"}})
    for index, block in enumerate(content):
        start = dict(block, input={}) if block["type"] in ("tool_use", "server_tool_use") else block
        yield Event.build("content_block_start",
                          {"type": "content_block_start", "index": index, "content_block": start})
        if block["type"] in ("tool_use", "server_tool_use"):
            yield Event.build("content_block_delta", {
                "type": "content_block_delta", "index": index,
                "delta": {"type": "input_json_delta", "partial_json": orjson.dumps(block["input"]).decode()}})
        yield Event.build("content_block_stop", {"type": "content_block_stop", "index": index})
    yield Event.build("message_stop", {"type": "message_stop"})


def answer(exchange, content, options, streaming):
    """Send an upstream answer through the response hooks; return the content the client gets."""
    if not streaming:
        response = UpstreamResponse(200, {}, orjson.dumps({"type": "message", "content": content}))
        dedup.relay_response(exchange=exchange, response=response, options=options)
        return orjson.loads(response.final_body())["content"]
    wanted = dedup.relay_stream_events(exchange=exchange, options=options)
    received = []
    for event in events_for(content):
        if event.name in wanted:
            dedup.relay_stream_event(exchange=exchange, event=event, options=options)
        received.append(Event(event.encode()))
    blocks = {}
    for event in received:
        if event.name == "content_block_start":
            blocks[event.data["index"]] = event.data["content_block"]
        elif event.name == "content_block_delta":
            blocks[event.data["index"]]["input"] = orjson.loads(event.data["delta"]["partial_json"])
    return [blocks[i] for i in sorted(blocks)]


def answered_by_client(content):
    """The client's next user message: a result for every tool_use, or plain text."""
    calls = [b["id"] for b in content if b["type"] == "tool_use"]
    return {"role": "user", "content": [result(t) for t in calls] if calls else "go on"}


# --- the pure pieces ----------------------------------------------------------------------


@pytest.mark.parametrize("tool_id, expected", [
    ("toolu_abc", ("toolu_abc", 1)),
    ("toolu_abc-2", ("toolu_abc", 2)),
    ("toolu_abc-10", ("toolu_abc", 10)),
    ("toolu_abc-2-3", ("toolu_abc-2", 3)),
    ("toolu_abc-1", ("toolu_abc-1", 1)),   # occurrence 1 is never written out
    ("toolu_abc-0", ("toolu_abc-0", 1)),
    ("toolu_abc-02", ("toolu_abc-02", 1)),  # no leading zero
    ("toolu_abc-", ("toolu_abc-", 1)),
    ("-2", ("-2", 1)),                      # a suffix needs something in front of it
    ("toolu_abc-²", ("toolu_abc-²", 1)),    # ASCII digits only
    ("functions.Bash:0-2", ("functions.Bash:0", 2)),
])
def test_split_suffix(tool_id, expected):
    assert dedup.split_suffix(tool_id, "-") == expected


def test_split_suffix_with_another_separator():
    assert dedup.split_suffix("toolu_abc_r3", "_r") == ("toolu_abc", 3)
    assert dedup.split_suffix("toolu_abc-3", "_r") == ("toolu_abc-3", 1)


# --- upstream -> client -------------------------------------------------------------------


@pytest.mark.parametrize("streaming", [False, True])
def test_a_reused_id_reaches_the_client_with_its_occurrence(streaming):
    history = [{"role": "user", "content": "hi"}] + turn("toolu_abc123")
    ex = make_exchange(copy.deepcopy(history), stream=streaming)
    dedup.relay_request(exchange=ex, options={})
    content = answer(ex, reply(["toolu_abc123"]), {}, streaming)
    assert tool_use_ids([{"role": "assistant", "content": content}]) == ["toolu_abc123-2"]

    history += [{"role": "assistant", "content": content}, answered_by_client(content)]
    ex = make_exchange(copy.deepcopy(history), stream=streaming)
    dedup.relay_request(exchange=ex, options={})
    assert not ex.changed  # the -2 the relay issued goes up as it is
    content = answer(ex, reply(["toolu_abc123"]), {}, streaming)
    assert tool_use_ids([{"role": "assistant", "content": content}]) == ["toolu_abc123-3"]


@pytest.mark.parametrize("streaming", [False, True])
def test_an_id_repeated_within_one_answer(streaming):
    ex = make_exchange([{"role": "user", "content": "hi"}], stream=streaming)
    dedup.relay_request(exchange=ex, options={})
    content = answer(ex, reply(["toolu_x", "toolu_x", "toolu_x"]), {}, streaming)
    assert [b["id"] for b in content if b["type"] == "tool_use"] == ["toolu_x", "toolu_x-2", "toolu_x-3"]
    assert [b["input"] for b in content if b["type"] == "tool_use"] == [{"n": 0}, {"n": 1}, {"n": 2}]


def test_the_occurrence_is_bumped_past_ids_already_taken():
    history = [{"role": "user", "content": "hi"}] + turn("toolu_x") + turn("toolu_x-3")
    ex = make_exchange(history)
    dedup.relay_request(exchange=ex, options={})
    content = answer(ex, reply(["toolu_x", "toolu_x-3"]), {}, False)
    # toolu_x has occurred twice (toolu_x, toolu_x-3): N would be 3, but that is taken.
    assert tool_use_ids([{"role": "assistant", "content": content}]) == ["toolu_x-4", "toolu_x-5"]


def test_an_id_already_used_by_a_result_only_is_taken_too():
    history = [{"role": "user", "content": [result("toolu_orphan")]}]
    ex = make_exchange(history)
    dedup.relay_request(exchange=ex, options={})
    assert tool_use_ids([{"role": "assistant", "content": answer(ex, reply(["toolu_orphan"]), {}, False)}]) \
        == ["toolu_orphan-2"]


def test_the_translation_table_and_the_note_for_an_answer():
    history = [{"role": "user", "content": "hi"}] + turn("toolu_x")
    ex = make_exchange(history)
    dedup.relay_request(exchange=ex, options={})
    assert ex.translation == {} and ex.timeline == []
    answer(ex, reply(["toolu_x", "toolu_y"]), {}, False)
    assert ex.translation == {"toolu_x-2": {"original": "toolu_x", "occurrence": 2,
                                            "message_index": 3, "direction": "to_client"}}
    assert [(n["step"], n["action"], n["direction"], n["ids"]) for n in ex.timeline] == \
        [("dedup", "rewrote", "to_client", [("toolu_x", "toolu_x-2")])]


@pytest.mark.parametrize("streaming", [False, True])
def test_a_plain_text_request_takes_the_walks_way_to_the_answer(streaming):
    # No block to walk: the answer's ledger is made when a call comes, with the same record
    # of where it stands as after a walk.
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
               {"role": "user", "content": "call twice"}]
    ex = make_exchange(copy.deepcopy(history), stream=streaming)
    dedup.relay_request(exchange=ex, options={})
    assert not ex.changed
    content = answer(ex, reply(["toolu_x", "toolu_x"]), {}, streaming)
    assert tool_use_ids([{"role": "assistant", "content": content}]) == ["toolu_x", "toolu_x-2"]
    assert ex.translation == {"toolu_x-2": {"original": "toolu_x", "occurrence": 2,
                                            "message_index": 3, "direction": "to_client"}}
    walked = make_exchange(copy.deepcopy(history) + [{"role": "user", "content": []}],
                           stream=streaming)
    dedup.relay_request(exchange=walked, options={})
    assert walked.state["dedup"]["message_index"] == 4


def test_an_answer_without_tool_use_is_not_parsed():
    ex = make_exchange([{"role": "user", "content": "hi"}])
    dedup.relay_request(exchange=ex, options={})
    body = b'{"type":"message","content":[{"type":"text","text":"hello"}]}'
    response = UpstreamResponse(200, {}, body)
    dedup.relay_response(exchange=ex, response=response, options={})
    assert response._data is None  # never parsed
    assert response.final_body() is body


def test_stream_events_only_block_starts_and_pass_through_stays_unparsed():
    ex = make_exchange([{"role": "user", "content": "hi"}] + turn("toolu_x"), stream=True)
    dedup.relay_request(exchange=ex, options={})
    assert dedup.relay_stream_events(exchange=ex, options={}) == {"content_block_start"}
    text = Event(b'event: content_block_start\ndata: {"type": "content_block_start", "index": 0, '
                 b'"content_block": {"type": "text", "text": ""}}\n\n')
    dedup.relay_stream_event(exchange=ex, event=text, options={})
    assert text._parsed is False and text.encode() is text.raw
    tool = Event(b'event: content_block_start\r\ndata: {"type": "content_block_start", "index": 1, '
                 b'"content_block": {"type": "tool_use", "id": "toolu_x", "name": "Bash", "input": {}}}\r\n\r\n')
    dedup.relay_stream_event(exchange=ex, event=tool, options={})
    assert tool.changed
    again = Event(tool.encode())
    assert again.name == "content_block_start"
    assert again.data == {"type": "content_block_start", "index": 1, "content_block": {
        "type": "tool_use", "id": "toolu_x-2", "name": "Bash", "input": {}}}
    assert ex.timeline[-1]["ids"] == [("toolu_x", "toolu_x-2")] and ex.timeline[-1]["index"] == 1


def test_server_tools_in_an_answer_are_untouched():
    ex = make_exchange([{"role": "user", "content": "hi"}] + turn("toolu_a"))
    dedup.relay_request(exchange=ex, options={})
    content = [{"type": "server_tool_use", "id": "toolu_a", "name": "web_search", "input": {}},
               {"type": "web_search_tool_result", "tool_use_id": "toolu_a", "content": []},
               {"type": "mcp_tool_use", "id": "toolu_a", "name": "q", "server_name": "s", "input": {}}]
    assert answer(ex, copy.deepcopy(content), {}, False) == content
    assert answer(ex, copy.deepcopy(content), {}, True) == content


def test_count_tokens_answers_are_not_touched():
    ex = make_exchange([{"role": "user", "content": "hi"}] + turn("toolu_a"), endpoint="count_tokens")
    dedup.relay_request(exchange=ex, options={})
    response = UpstreamResponse(200, {}, orjson.dumps({"content": [call("toolu_a")]}))
    dedup.relay_response(exchange=ex, response=response, options={})
    assert not response.changed
    assert dedup.relay_stream_events(exchange=ex, options={}) is None


# --- client -> upstream -------------------------------------------------------------------


def test_an_unchanged_request_goes_up_as_the_clients_bytes():
    history = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}] \
        + turn("toolu_a", "toolu_b") + turn("toolu_a-2")
    ex = make_exchange(history)
    dedup.relay_request(exchange=ex, options={})
    assert ex.changed is False and ex.upstream_body() is ex.raw_body and ex.timeline == []
    assert ex.translation == {"toolu_a-2": {"original": "toolu_a", "occurrence": 2,
                                            "message_index": 4, "direction": "history"}}


def test_a_duplicate_in_the_history_is_rewritten_with_its_result():
    history = [{"role": "user", "content": "hi"}] + turn("toolu_a") + turn("toolu_b") + turn("toolu_a")
    ex = make_exchange(copy.deepcopy(history))
    dedup.relay_request(exchange=ex, options={})
    sent = orjson.loads(ex.upstream_body())["messages"]
    assert tool_use_ids(sent) == ["toolu_a", "toolu_b", "toolu_a-2"]
    assert sent[6]["content"][0]["tool_use_id"] == "toolu_a-2"
    assert sent[:5] == history[:5]
    assert ex.translation == {"toolu_a-2": {"original": "toolu_a", "occurrence": 2,
                                            "message_index": 5, "direction": "to_upstream"}}
    assert [(n["step"], n["action"], n["tool_use_ids"], n["tool_result_ids"]) for n in ex.timeline] \
        == [("dedup", "rewrote", 1, 1)]
    assert ex.state["dedup"]["message_index"] == 7


def test_parallel_calls_sharing_an_id_keep_their_results_in_order():
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": [call("t", 0), call("t", 1), call("u", 2)]},
               {"role": "system", "content": "between"},
               {"role": "user", "content": [result("t", "first"), result("u", "third"),
                                            result("t", "second"), {"type": "text", "text": "go"}]}]
    ex = make_exchange(history)
    dedup.relay_request(exchange=ex, options={})
    assert tool_use_ids(ex.body["messages"]) == ["t", "t-2", "u"]
    assert [(b.get("tool_use_id"), b.get("content")) for b in ex.body["messages"][3]["content"]] == \
        [("t", "first"), ("u", "third"), ("t-2", "second"), (None, None)]


def test_the_separator_is_a_quirk():
    quirks = {"dedup_separator": "_r"}
    history = [{"role": "user", "content": "hi"}] + turn("toolu_a") + turn("toolu_a") + turn("toolu_a-2")
    ex = make_exchange(history, quirks)
    dedup.relay_request(exchange=ex, options=quirks)
    assert tool_use_ids(ex.body["messages"]) == ["toolu_a", "toolu_a_r2", "toolu_a-2"]
    content = answer(ex, reply(["toolu_a", "toolu_a-2"]), quirks, True)
    assert tool_use_ids([{"role": "assistant", "content": content}]) == ["toolu_a_r3", "toolu_a-2_r2"]


def test_dedup_tool_ids_false_turns_it_off():
    off = {"dedup_tool_ids": False}
    history = [{"role": "user", "content": "hi"}] + turn("toolu_a") + turn("toolu_a")
    ex = make_exchange(copy.deepcopy(history), off)
    dedup.relay_request(exchange=ex, options=off)
    assert not ex.changed and ex.body["messages"] == history and ex.translation == {}
    assert dedup.relay_stream_events(exchange=ex, options=off) is None
    response = UpstreamResponse(200, {}, orjson.dumps({"content": [call("toolu_a")]}))
    dedup.relay_response(exchange=ex, response=response, options=off)
    assert not response.changed
    assert dedup.relay_validate(exchange=ex, options=off, repair=False) is None


def test_server_tools_thinking_and_unknown_blocks_pass_untouched():
    assistant = {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "toolu_a", "signature": "s"},
        {"type": "redacted_thinking", "data": "toolu_a"},
        {"type": "server_tool_use", "id": "srv", "name": "web_search", "input": {}},
        {"type": "web_search_tool_result", "tool_use_id": "srv", "content": []},
        {"type": "mcp_tool_use", "id": "srv", "name": "q", "server_name": "s", "input": {}},
        {"type": "mcp_tool_result", "tool_use_id": "srv", "content": []},
        {"type": "future_block", "id": "srv"},
        "not even a block",
        {"type": "tool_use", "id": None, "name": "Bash", "input": {}},
    ]}
    history = [{"role": "user", "content": "hi"}, assistant, {"role": "user", "content": "ok"},
               copy.deepcopy(assistant), {"role": "user", "content": "ok"},
               {"role": "system", "content": [{"type": "tool_use", "id": "srv"}]}, "not a message"]
    ex = make_exchange(copy.deepcopy(history))
    dedup.relay_request(exchange=ex, options={})
    assert not ex.changed and ex.body["messages"] == history


def test_count_tokens_requests_are_made_unique_too():
    history = [{"role": "user", "content": "hi"}] + turn("toolu_a") + turn("toolu_a")
    ex = make_exchange(history, endpoint="count_tokens")
    dedup.relay_request(exchange=ex, options={})
    assert ex.changed and tool_use_ids(ex.body["messages"]) == ["toolu_a", "toolu_a-2"]
    assert ex.translation["toolu_a-2"]["direction"] == "to_upstream"
    # The answer holds no content: no ledger is kept for it.
    assert "dedup" not in ex.state


@pytest.mark.parametrize("options", [{}, RESTORE])
def test_count_tokens_builds_no_answer_ledger(options, monkeypatch):
    history = [{"role": "user", "content": "hi"}] + turn("toolu_a") + turn("toolu_a-2", "toolu_b") \
        + [{"role": "assistant", "content": "text"},
           {"role": "user", "content": [result("toolu_orphan")]}]
    ex = make_exchange(copy.deepcopy(history), options, endpoint="count_tokens")
    built = []
    real = dedup.Ledger.__init__

    def spy(self, sep):
        built.append(self)
        real(self, sep)
    monkeypatch.setattr(dedup.Ledger, "__init__", spy)
    dedup.relay_request(exchange=ex, options=options)
    assert "dedup" not in ex.state
    [ledger] = built
    if options:  # restoring needs no ledger at all
        assert ledger.taken == set() and ledger.counts == {}
        assert tool_use_ids(ex.body["messages"]) == ["toolu_a", "toolu_a", "toolu_b"]
    else:  # only the upstream-bound tool_use ids the walk itself needs, no result ids
        assert ledger.taken == {"toolu_a", "toolu_a-2", "toolu_b"}


# --- restore mode ---------------------------------------------------------------------------


def test_restore_mode_sends_the_upstream_its_own_ids():
    history = [{"role": "user", "content": "hi"}] + turn("functions.Bash:0") + turn("functions.Bash:0-2") \
        + turn("functions.Bash:0-3", "functions.Bash:1")
    ex = make_exchange(copy.deepcopy(history), RESTORE)
    dedup.relay_request(exchange=ex, options=RESTORE)
    sent = ex.body["messages"]
    assert tool_use_ids(sent) == ["functions.Bash:0"] * 3 + ["functions.Bash:1"]
    assert [b["tool_use_id"] for b in sent[4]["content"] + sent[6]["content"]] == \
        ["functions.Bash:0", "functions.Bash:0", "functions.Bash:1"]
    assert ex.translation["functions.Bash:0-3"] == {"original": "functions.Bash:0", "occurrence": 3,
                                                     "message_index": 5, "direction": "restored"}
    assert [(n["action"], n["tool_use_ids"], n["tool_result_ids"]) for n in ex.timeline] == [("restored", 2, 2)]
    # The upstream calls functions.Bash:0 again: the client gets a fourth distinct id.
    content = answer(ex, reply(["functions.Bash:0"]), RESTORE, True)
    assert tool_use_ids([{"role": "assistant", "content": content}]) == ["functions.Bash:0-4"]


def test_restore_mode_leaves_a_history_without_suffixes_as_it_came():
    ex = make_exchange([{"role": "user", "content": "hi"}] + turn("functions.Bash:0"), RESTORE)
    dedup.relay_request(exchange=ex, options=RESTORE)
    assert not ex.changed and ex.translation == {}


@pytest.mark.parametrize("streaming", [False, True])
def test_restore_mode_keeps_a_repeat_within_one_answer_apart(streaming):
    # A Kimi-like upstream repeats an id inside one answer. Sending both calls back as its
    # own id would give one message two identical ids (and two results with one id): the
    # second keeps the id the client holds, so every message still has distinct ids.
    history = [{"role": "user", "content": "hi"}]
    ex = make_exchange(copy.deepcopy(history), RESTORE, stream=streaming)
    dedup.relay_request(exchange=ex, options=RESTORE)
    content = answer(ex, reply(["functions.Bash:0", "functions.Bash:0"]), RESTORE, streaming)
    assert tool_use_ids([{"role": "assistant", "content": content}]) == \
        ["functions.Bash:0", "functions.Bash:0-2"]
    history += [{"role": "assistant", "content": content}, answered_by_client(content)]

    ex = make_exchange(copy.deepcopy(history), RESTORE, stream=streaming)
    dedup.relay_request(exchange=ex, options=RESTORE)
    assert ex.body["messages"] == history and not ex.changed
    pairing_plugin.relay_request(exchange=ex, options=RESTORE)  # no duplicate-result refusal
    assert find_problem(ex.body, EmulatorOptions(id_style="functions")) is None

    # The next answer repeats functions.Bash:0 twice again: across messages the upstream gets
    # its own id back, within the message the repeat stays apart.
    content = answer(ex, reply(["functions.Bash:0", "functions.Bash:0"]), RESTORE, streaming)
    assert tool_use_ids([{"role": "assistant", "content": content}]) == \
        ["functions.Bash:0-3", "functions.Bash:0-4"]
    history += [{"role": "assistant", "content": content}, answered_by_client(content)]
    ex = make_exchange(copy.deepcopy(history), RESTORE, stream=streaming)
    dedup.relay_request(exchange=ex, options=RESTORE)
    sent = ex.body["messages"]
    assert tool_use_ids(sent) == ["functions.Bash:0", "functions.Bash:0-2",
                                  "functions.Bash:0", "functions.Bash:0-4"]
    assert [b["tool_use_id"] for b in sent[4]["content"]] == ["functions.Bash:0", "functions.Bash:0-4"]
    pairing_plugin.relay_request(exchange=ex, options=RESTORE)
    assert find_problem(ex.body, EmulatorOptions(id_style="functions")) is None


def test_restore_mode_never_gives_one_message_the_same_id_twice():
    # An upstream that emits a suffix-like id and a repeat in one answer.
    ex = make_exchange([{"role": "user", "content": "hi"}], RESTORE)
    dedup.relay_request(exchange=ex, options=RESTORE)
    content = answer(ex, reply(["x", "x-2", "x"]), RESTORE, False)
    got = tool_use_ids([{"role": "assistant", "content": content}])
    assert len(set(got)) == 3
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": content},
               answered_by_client(content)]
    ex = make_exchange(history, RESTORE)
    dedup.relay_request(exchange=ex, options=RESTORE)
    sent = tool_use_ids(ex.body["messages"])
    assert sent[:2] == ["x", "x-2"] and len(set(sent)) == 3


def test_restore_mode_suffixes_an_id_that_only_looks_like_a_rewrite():
    ex = make_exchange([{"role": "user", "content": "hi"}], RESTORE)
    dedup.relay_request(exchange=ex, options=RESTORE)
    content = answer(ex, reply(["call-2"]), RESTORE, False)
    assert tool_use_ids([{"role": "assistant", "content": content}]) == ["call-2-2"]


async def test_restore_mode_repeat_within_one_answer_through_the_relay(aiohttp_server, aiohttp_client):
    """A Kimi-like upstream (functions ids, validated like the emulator's functions style) that
    repeats an id inside one answer: the next turn goes up valid, not refused by pairing."""
    from aiohttp import web

    from relay.testing.fixtures import start_relay

    received = []

    async def messages(request):
        body = await request.json()
        received.append(body)
        problem = find_problem(body, EmulatorOptions(id_style="functions"))
        if problem:
            return web.json_response({"type": "error", "error": {
                "type": "invalid_request_error", "message": problem}}, status=400)
        turn = sum(1 for m in body["messages"] if m["role"] == "assistant")
        content = ([call("functions.Bash:0", 0), call("functions.Bash:0", 1)] if turn == 0
                   else [{"type": "text", "text": "done"}])
        return web.json_response({"id": "msg_1", "type": "message", "role": "assistant",
                                  "model": body["model"], "content": content,
                                  "stop_reason": "tool_use" if turn == 0 else "end_turn",
                                  "stop_sequence": None,
                                  "usage": {"input_tokens": 1, "output_tokens": 1}})

    upstream = web.Application()
    upstream.router.add_post("/v1/messages", messages)
    server = await aiohttp_server(upstream)
    client = await start_relay(aiohttp_client, {
        "pipeline": ["dedup", "pairing", "ordering"],
        "backends": [{"name": "kimi", "url": str(server.make_url("")).rstrip("/"),
                      "models": ["*"], "quirks": RESTORE}]})
    history = [{"role": "user", "content": "go"}]
    first = await client.post("/v1/messages", json={"model": "kimi-k2", "max_tokens": 10,
                                                    "messages": history})
    assert first.status == 200
    assert first.headers["x-relay-rewrites"] == "1"  # the answer's repeated id
    content = (await first.json())["content"]
    assert tool_use_ids([{"role": "assistant", "content": content}]) == \
        ["functions.Bash:0", "functions.Bash:0-2"]
    history += [{"role": "assistant", "content": content}, answered_by_client(content)]
    second = await client.post("/v1/messages", json={"model": "kimi-k2", "max_tokens": 10,
                                                     "messages": history})
    assert second.status == 200, await second.text()
    assert "x-relay-rewrites" not in second.headers  # kept: restoring would repeat an id
    sent = received[-1]["messages"]
    assert tool_use_ids(sent) == ["functions.Bash:0", "functions.Bash:0-2"]
    assert [b["tool_use_id"] for b in sent[2]["content"]] == ["functions.Bash:0", "functions.Bash:0-2"]
    await client.close()
    await client.chain.shutdown(client.config)


# --- start-up and validate ------------------------------------------------------------------


def test_validate_reports_and_repairs_duplicates():
    history = [{"role": "user", "content": "hi"}] + turn("toolu_a") + turn("toolu_a", "toolu_a")
    ex = make_exchange(history)
    assert dedup.relay_validate(exchange=ex, options={}, repair=False) == [
        {"location": "messages.3.content.0",
         "message": "messages.3.content.0: `tool_use` ids must be unique"},
        {"location": "messages.3.content.1",
         "message": "messages.3.content.1: `tool_use` ids must be unique"}]
    assert not ex.changed
    assert dedup.relay_validate(exchange=ex, options={}, repair=True) == []
    assert ex.changed and ex.repairs == 2
    assert tool_use_ids(ex.body["messages"]) == ["toolu_a", "toolu_a-2", "toolu_a-3"]
    assert dedup.relay_validate(exchange=ex, options={}, repair=False) == []
    assert dedup.relay_validate(exchange=ex, options=RESTORE, repair=False) is None


async def test_through_the_chain_with_backend_quirks():
    config = parse({"pipeline": ["dedup"], "plugins": {"dedup": {"dedup_separator": "_"}},
                    "backends": [{"name": "emu", "url": "http://127.0.0.1:1", "models": ["*"],
                                  "quirks": {"dedup_separator": "~"}}]})
    chain = Chain(load_plugins(config.pipeline), config)
    await chain.startup(config)
    ex = make_exchange([{"role": "user", "content": "hi"}] + turn("a") + turn("a"))
    ex.backend = config.backends[0]
    await chain.run("relay_request", ex)
    assert tool_use_ids(ex.body["messages"]) == ["a", "a~2"]
    plan = await chain.stream_plan(ex)
    assert set(plan.by_name) == {"content_block_start"}


# --- properties -----------------------------------------------------------------------------


@PROPERTY
@given(histories())
def test_upstream_ids_are_unique_and_results_answer_the_same_calls(history):
    sent = copy.deepcopy(history)
    walk = dedup.make_unique(sent)
    upstream = tool_use_ids(sent)
    assert len(upstream) == len(set(upstream))
    assert without_ids(sent) == without_ids(history)
    before, after = pairing(history), pairing(sent)
    assert {r: c for r, c in after.items() if r in before} == before
    for i, m in enumerate(history):  # a result that answered nothing keeps its id
        if m.get("role") == "user" and isinstance(m["content"], list):
            for k, b in enumerate(m["content"]):
                if b.get("type") == "tool_result" and (i, k) not in before:
                    assert sent[i]["content"][k] == b
    for _, client_id, upstream_id, original, n in walk.tool_uses:
        assert upstream_id == f"{original}-{n}" and dedup.split_suffix(client_id, "-")[0] == original
    assert walk.changed == (sent != history)


@PROPERTY
@given(histories())
def test_each_prefix_goes_up_the_same_whatever_follows(history):
    sent = copy.deepcopy(history)
    dedup.make_unique(sent)
    for i in range(len(history)):
        prefix = copy.deepcopy(history[:i])
        dedup.make_unique(prefix)
        assert prefix == sent[:i]


@PROPERTY
@given(histories())
def test_making_unique_twice_changes_nothing_more(history):
    sent = copy.deepcopy(history)
    dedup.make_unique(sent)
    again = copy.deepcopy(sent)
    assert not dedup.make_unique(again).changed
    assert again == sent


@PROPERTY
@given(histories(max_turns=5), st.lists(st.lists(ids, max_size=4), min_size=1, max_size=4), st.booleans())
def test_ids_the_client_receives_are_unique_against_its_history(history, answers, streaming):
    history = copy.deepcopy(history)
    for emitted in answers:
        ex = make_exchange(copy.deepcopy(history), stream=streaming)
        dedup.relay_request(exchange=ex, options={})
        content = answer(ex, reply(emitted), {}, streaming)
        got = tool_use_ids([{"role": "assistant", "content": content}])
        assert len(got) == len(set(got)) and not set(got) & every_id(history)
        assert [dedup.split_suffix(g, "-")[0] for g in got] == \
            [dedup.split_suffix(e, "-")[0] for e in emitted]
        history += [{"role": "assistant", "content": content}, answered_by_client(content)]
        # What the relay just issued goes up as the client holds it.
        ex = make_exchange(copy.deepcopy(history))
        dedup.relay_request(exchange=ex, options={})
        assert ex.body["messages"][-2:] == history[-2:]


@PROPERTY
@given(st.lists(st.lists(ids, max_size=3), min_size=1, max_size=8), st.booleans())
def test_restore_mode_round_trips_to_the_ids_the_upstream_emitted(answers, streaming):
    history = [{"role": "user", "content": "start"}]  # as the client holds it
    emitted_view = copy.deepcopy(history)  # as the upstream emitted it
    for emitted in answers:
        ex = make_exchange(copy.deepcopy(history), RESTORE, stream=streaming)
        dedup.relay_request(exchange=ex, options=RESTORE)
        assert ex.body["messages"] == emitted_view
        assert ex.changed == (history != emitted_view)
        for message in ex.body["messages"]:
            if message["role"] == "assistant":
                sent = tool_use_ids([message])
                assert len(sent) == len(set(sent))
        upstream_content = reply(emitted)
        content = answer(ex, copy.deepcopy(upstream_content), RESTORE, streaming)
        got = tool_use_ids([{"role": "assistant", "content": content}])
        assert len(got) == len(set(got)) and not set(got) & every_id(history)
        history += [{"role": "assistant", "content": content}, answered_by_client(content)]
        # The upstream gets its own ids back, except a repeat within one answer, which keeps
        # the client's id: one message never holds the same id twice.
        sent_content = copy.deepcopy(upstream_content)
        first = set()
        for block, client_block in zip(sent_content, content, strict=True):
            if block["type"] == "tool_use":
                if block["id"] in first:
                    block["id"] = client_block["id"]
                first.add(block["id"])
        emitted_view += [{"role": "assistant", "content": sent_content},
                         answered_by_client(sent_content)]


def _lines_run(function, *args) -> int:
    """How many lines of plugins/dedup.py a call executes: a cost measure immune to load."""
    count = 0

    def local(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return local

    def tracer(frame, event, arg):
        return local if frame.f_code.co_filename == dedup.__file__ else None

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        function(*args)
    finally:
        sys.settrace(previous)
    return count


@settings(phases=[Phase.explicit, Phase.reuse, Phase.generate], max_examples=30, deadline=None)
@given(histories(max_turns=6))
def test_cost_grows_linearly_with_the_history(history):
    # Four and sixteen copies repeat every id, so almost every call of both gets rewritten.
    small = _lines_run(dedup.make_unique, copy.deepcopy(history * 4))
    large = _lines_run(dedup.make_unique, copy.deepcopy(history * 16))
    assert large <= 4 * small * 1.25 + 50


def test_cost_stays_linear_when_suffixes_crowd_the_next_numbers():
    def history(m):  # toolu_x-(m+2) .. toolu_x-(2m+1), then toolu_x m+1 times
        return [{"role": "user", "content": "hi"}] + [
            msg for k in range(m + 2, 2 * m + 2) for msg in turn(f"toolu_x-{k}")] + [
            msg for _ in range(m + 1) for msg in turn("toolu_x")]

    small = _lines_run(dedup.make_unique, history(50))
    large = _lines_run(dedup.make_unique, history(200))
    assert large <= 4 * small * 1.25
    sent = history(200)
    dedup.make_unique(sent)
    assert len(set(tool_use_ids(sent))) == 401


async def test_rewrites_on_the_way_up_are_counted_in_a_header(aiohttp_server, aiohttp_client):
    from test_server import BODY, Upstream, start_relay, start_upstream
    upstream = Upstream()
    server = await start_upstream(aiohttp_server, upstream)
    client = await start_relay(aiohttp_client, {"pipeline": ["dedup"], "backends": [
        {"name": "b", "url": str(server.make_url("")), "models": ["*"]}]})
    history = [{"role": "user", "content": "hi"}] + turn("toolu_a") + turn("toolu_a")
    resp = await client.post("/v1/messages", json={**BODY, "messages": history})
    assert resp.headers["x-relay-rewrites"] == "1"
    resp = await client.post("/v1/messages", json=BODY)
    assert "x-relay-rewrites" not in resp.headers
