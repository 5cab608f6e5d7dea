"""Server-held threads through a real relay (in process) in front of the strict emulator: a
continuation is judged as a tail, a backend that holds no threads refuses them the API's way,
and the record of threads the relay saw is bounded."""

from __future__ import annotations

import asyncio

import orjson
import pytest
import pytest_asyncio

from relay import config as config_module
from relay import threads
from relay.errors import ConfigError
from relay.testing import assistant, emulator, result, text, use, user
from relay.testing.fixtures import received, received_headers, start_relay

BETA = {"anthropic-beta": "message-threads-2026-08-12"}
TOOLS = [{"name": "Bash", "description": "Run a command", "input_schema": {
    "type": "object", "properties": {"command": {"type": "string"}}}}]
PIPELINE = ["metrics", "dedup", "pairing", "ordering", "portable"]


@pytest.fixture
def upstream(aiohttp_server):
    async def start(**options):
        return await aiohttp_server(emulator.create_app(emulator.EmulatorOptions(**options)))
    return start


@pytest_asyncio.fixture
async def local_relay(aiohttp_client):
    started = []

    async def start(upstream, holds_threads=True, pipeline=PIPELINE, server=None, env=None,
                    **backend):
        url = str(upstream.make_url("")).rstrip("/")
        client = await start_relay(aiohttp_client, {
            "pipeline": list(pipeline), "server": server or {},
            "backends": [{"name": "emu", "url": url, "models": ["*"],
                          "holds_threads": holds_threads, **backend}]}, env=env)
        client.upstream = upstream
        started.append(client)
        return client

    yield start
    for client in started:
        await client.chain.shutdown(client.config)


def body(*messages, thread=None, **extra) -> dict:
    doc = {"model": "claude-test", "max_tokens": 100, "messages": list(messages), **extra}
    if thread is not None:
        doc["thread"] = thread
    return doc


def create(*messages, **extra) -> dict:
    return body(*messages, thread={"type": "create"}, tools=TOOLS, **extra)


def carry_on(previous: str, *messages, **extra) -> dict:
    return body(*messages, thread={"type": "continue", "previous_message_id": previous}, **extra)


async def post(client, doc: dict, headers=BETA):
    response = await client.post("/v1/messages", data=orjson.dumps(doc),
                                 headers={"Content-Type": "application/json", **headers})
    raw = await response.read()
    return response, orjson.loads(raw) if raw.startswith(b"{") else raw


def answers_to(message: dict) -> list[dict]:
    return [result(block["id"]) for block in message["content"] if block["type"] == "tool_use"]


async def test_a_continuation_answering_held_calls_is_not_refused(upstream, local_relay):
    client = await local_relay(await upstream(tool_turns=2, threads="hold"))
    response, first = await post(client, create(user(text("go"))))
    assert response.status == 200 and first["stop_reason"] == "tool_use"
    response, second = await post(client, carry_on(first["id"], user(*answers_to(first))))
    assert response.status == 200, second
    assert second["stop_reason"] == "tool_use"
    assert response.headers.get("x-relay-notes") is None  # the relay saw the head
    response, third = await post(client, carry_on(second["id"], user(*answers_to(second))))
    assert response.status == 200 and third["stop_reason"] == "end_turn"
    sent = received(client)
    # Only the new turn went up, with the thread as the client sent it.
    assert [len(doc["messages"]) for doc in sent] == [1, 1, 1]
    assert sent[2]["thread"] == {"type": "continue", "previous_message_id": second["id"]}
    assert "tools" not in sent[1]


async def refused_for_nobody(client, message_id):
    """A result for a call nobody made, continuing ``message_id``: refused by the relay in
    the API's words, named where the client put it."""
    response, error = await post(client, carry_on(message_id, user(result("toolu_nobody"))))
    assert response.status == 400
    assert error["error"]["message"].startswith(
        "messages.0.content.0: unexpected `tool_use_id` found in `tool_result` blocks: "
        "toolu_nobody")


async def test_with_the_head_known_the_whole_conversation_is_judged(upstream, local_relay):
    emu = await upstream(tool_turns=2, threads="hold")
    client = await local_relay(emu)
    _, first = await post(client, create(user(text("go"))))
    # A result for a call nobody made: refused by the relay, named where the client put it.
    await refused_for_nobody(client, first["id"])
    # The held calls left unanswered: the API's words, at the request's own index.
    response, error = await post(client, carry_on(first["id"], user(text("never mind"))))
    assert response.status == 400
    assert error["error"]["message"].startswith("messages.0: `tool_use` ids were found without")
    assert len(received(client)) == 1


async def test_a_head_the_relay_did_not_see_is_forwarded_and_noted(upstream, local_relay):
    emu = await upstream(tool_turns=2, threads="hold")
    elsewhere = await local_relay(emu)  # another replica, or this one before a restart
    _, first = await post(elsewhere, create(user(text("go"))))
    client = await local_relay(emu)
    response, second = await post(client, carry_on(first["id"], user(*answers_to(first))))
    assert response.status == 200, second
    assert "thread-head-unseen" in response.headers["x-relay-notes"]
    # The upstream judges what the relay could not: it holds the head.
    response, error = await post(client, carry_on(second["id"], user(result("toolu_nobody"))))
    assert response.status == 400
    assert "unexpected `tool_use_id`" in error["error"]["message"]
    assert "toolu_nobody" in error["error"]["message"]
    assert len(received(client)) == 3  # the same emulator behind both


async def test_a_tail_continuing_a_held_paused_turn_is_forwarded_unseen(upstream, local_relay):
    # A paused web search the server holds, continued: the tail opens with the assistant
    # message that carries its result (relay.threads.opens_with_held_calls).
    client = await local_relay(await upstream(threads="hold"))
    searched = {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_held",
                "content": []}
    response, _ = await post(client, carry_on("msg_unseen", assistant(searched, text("found")),
                                              user(text("thanks"))))
    assert len(received(client)) == 1, response.status
    assert "thread-head-unseen" in response.headers.get("x-relay-notes", "")


async def test_a_tail_of_its_own_faults_is_refused_even_unseen(upstream, local_relay):
    client = await local_relay(await upstream(tool_turns=2, threads="hold"))
    broken = carry_on("msg_unseen", user(result("toolu_a")),
                      assistant(text("again"), use("toolu_b")), user(result("toolu_c")))
    response, error = await post(client, broken)
    assert response.status == 400
    assert error["error"]["message"].startswith(
        "messages.2.content.0: unexpected `tool_use_id` found in `tool_result` blocks: toolu_c")
    assert received(client) == []


async def test_a_streamed_answer_is_recorded_too(upstream, local_relay):
    client = await local_relay(await upstream(tool_turns=2, threads="hold"))
    response, raw = await post(client, create(user(text("go")), stream=True))
    assert response.status == 200
    events = [orjson.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: ")]
    message = events[0]["message"]
    calls = [e["content_block"] for e in events if e["type"] == "content_block_start"
             and e["content_block"]["type"] == "tool_use"]
    response, error = await post(client, carry_on(message["id"], user(text("no results"))))
    assert response.status == 400  # judged against the streamed answer's calls
    assert calls[0]["id"] in error["error"]["message"]
    response, _ = await post(client, carry_on(message["id"], user(
        *[result(call["id"]) for call in calls]), stream=True))
    assert response.status == 200


async def test_a_backend_without_threads_gets_the_whole_conversation_carried(upstream,
                                                                           local_relay):
    # The emulator refuses any thread itself: it must never see one.
    emu = await upstream(tool_turns=2, threads="refuse")
    client = await local_relay(emu, holds_threads=False)
    response, first = await post(client, create(user(text("go"))))
    assert response.status == 200 and first["stop_reason"] == "tool_use"
    response, second = await post(client, carry_on(first["id"], user(*answers_to(first))))
    assert response.status == 200, second
    response, third = await post(client, carry_on(second["id"], user(*answers_to(second))))
    assert response.status == 200 and third["stop_reason"] == "end_turn"
    sent = received(client)
    assert all("thread" not in doc for doc in sent)
    # Each went up whole: 1, 3, 5 messages, each valid for the strict emulator.
    assert [len(doc["messages"]) for doc in sent] == [1, 3, 5]
    assert sent[2]["messages"][:3] == sent[1]["messages"]
    assert all(BETA["anthropic-beta"] not in headers.get("anthropic-beta", "")
               for headers in received_headers(client))


async def test_a_carried_conversation_is_judged_whole_and_named_at_the_clients_indexes(
        upstream, local_relay):
    client = await local_relay(await upstream(tool_turns=2, threads="refuse"), holds_threads=False)
    _, first = await post(client, create(user(text("go"))))
    await refused_for_nobody(client, first["id"])
    assert len(received(client)) == 1


async def test_a_thread_the_relay_cannot_carry_is_refused_as_the_api_does(upstream, local_relay):
    emu = await upstream(tool_turns=1, threads="refuse")
    client = await local_relay(emu, holds_threads=False)
    # One it holds no state for, as the API answers an unknown previous_message_id.
    response, error = await post(client, carry_on("msg_x", user(result("toolu_a"))))
    assert response.status == 404
    assert error["error"]["type"] == "not_found_error"
    assert error["error"]["details"] == {"error_code": "thread_not_found"}
    # One it cannot read, as the API answers what it cannot thread.
    response, error = await post(client, body(user(text("go")), thread={"type": "branch"}))
    assert response.status == 400
    assert error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error"
    assert error["error"]["details"] == {"error_code": "thread_unsupported_request"}
    assert error["request_id"] == response.headers["x-relay-request-id"]
    assert received(client) == []
    response, _ = await post(client, body(user(text("go")), tools=TOOLS))
    assert response.status == 200


async def test_a_thread_moves_to_a_backend_that_does_not_hold_it(upstream, aiohttp_client):
    holding = await upstream(tool_turns=2, threads="hold")
    other = await upstream(tool_turns=2, threads="refuse")
    client = await start_relay(aiohttp_client, {"pipeline": PIPELINE, "backends": [
        {"name": "a", "url": str(holding.make_url("")).rstrip("/"), "models": ["claude-a"],
         "holds_threads": True},
        {"name": "b", "url": str(other.make_url("")).rstrip("/"), "models": ["claude-b"],
         "holds_threads": True}]})
    try:
        _, first = await post(client, create(user(text("go")), model="claude-a"))
        # A /model switch: the other backend never held this thread, so it is carried there.
        response, second = await post(client, carry_on(first["id"], user(*answers_to(first)),
                                                       model="claude-b"))
        assert response.status == 200, second
        sent = [orjson.loads(raw) for *_, raw in other.app[emulator.STATE].records]
        assert "thread" not in sent[0] and len(sent[0]["messages"]) == 3
        # And carried from then on, wherever it goes next.
        response, third = await post(client, carry_on(second["id"], user(*answers_to(second)),
                                                      model="claude-a"))
        assert response.status == 200, third
        back = [orjson.loads(raw) for *_, raw in holding.app[emulator.STATE].records]
        assert "thread" not in back[-1] and len(back[-1]["messages"]) == 5
    finally:
        await client.chain.shutdown(client.config)


@pytest.mark.parametrize("url, extra, holds", [
    ("https://api.anthropic.com", {}, True),
    ("https://api.anthropic.com/", {"holds_threads": False}, False),
    ("https://api.moonshot.ai/anthropic", {}, False),
    ("http://127.0.0.1:9", {"holds_threads": True}, True),
])
def test_holds_threads_defaults_to_anthropics_own_api(url, extra, holds):
    config = config_module.parse({"backends": [{"name": "b", "url": url, "models": ["*"],
                                                **extra}]}, {})
    assert config.backends[0].holds_threads is holds


def test_an_openai_format_backend_cannot_be_said_to_hold_threads():
    with pytest.raises(ConfigError, match=r"backends\[0\].holds_threads: the openai format"):
        config_module.parse({"backends": [{"name": "b", "url": "http://127.0.0.1:9/v1",
                                           "format": "openai", "holds_threads": True}]}, {})


def test_the_record_is_bounded_by_count_bytes_and_age():
    now = [0.0]
    store = threads.Store(max_threads=2, max_bytes=100, max_age=10, clock=lambda: now[0])
    store.put("a", "emu", b"x" * 40)
    store.put("b", "emu", b"x" * 40)
    store.put("c", "emu", b"x" * 40)  # a third: the least recently used goes
    assert store.get("a") is None and len(store) == 2 and store.bytes == 80
    store.get("b")
    store.put("d", "emu", b"x" * 70)  # past the bytes: c (used longest ago) goes, then b
    assert store.get("c") is None and store.get("b") is None and store.bytes == 70
    assert store.put("e", "emu", b"x" * 101) is False and store.get("e") is None
    now[0] = 11
    assert store.get("d") is None and store.bytes == 0


async def test_a_shared_state_out_is_logged_once_not_for_every_thread(caplog):
    """Records read and written while the shared state is out: said once (then once a
    minute, with the count since), not once per continuation and per answer."""
    import socket

    from relay.state import open_state

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    state = await open_state({"url": f"redis://127.0.0.1:{port}/0", "timeout": 0.05})
    try:
        store = threads.Store(shared=state)
        for n in range(10):
            store.put(f"msg_{n}", "emu", b"[]")
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # the writes, in the background, fail
        other = threads.Store(shared=state)  # another worker's, or replica's
        for n in range(10):
            assert await other.fetch(f"msg_{n}") is None
        for doing in ("written", "read"):
            said = [r for r in caplog.records
                    if f"shared record could not be {doing}" in r.getMessage()]
            assert len(said) == 1, doing
    finally:
        await state.close()


def test_a_location_is_renamed_after_the_requests_own_messages():
    message = "messages.5.content.1: unexpected `tool_use_id`"
    assert threads.shifted("messages.5.content.1", message, 3) == (
        "messages.2.content.1", "messages.2.content.1: unexpected `tool_use_id`")
    assert threads.shifted("messages.5", "messages.5: x", 0) == ("messages.5", "messages.5: x")


def test_the_messages_a_stream_builds():
    from relay.sse import Event

    def event(data):
        return Event(b"event: " + data["type"].encode() + b"\ndata: " + orjson.dumps(data)
                     + b"\n\n")

    events = [event(e) for e in emulator.stream_events({
        "id": "msg_1", "type": "message", "role": "assistant", "model": "m",
        "content": [{"type": "text", "text": "Calling."},
                    {"type": "tool_use", "id": "toolu_1", "name": "Bash",
                     "input": {"command": "ls -la"}}],
        "stop_reason": "tool_use", "stop_sequence": None,
        "usage": {"input_tokens": 1, "output_tokens": 2}})]
    message = threads.message_from_events(events)
    assert message["id"] == "msg_1"
    assert message["content"] == [{"type": "text", "text": "Calling."},
                                  {"type": "tool_use", "id": "toolu_1", "name": "Bash",
                                   "input": {"command": "ls -la"}}]
    assert threads.message_from_events(events[:-1]) is None


# An answer as the API streams it (SDK types/beta: BetaCompactionContentBlockDelta,
# BetaCitationsDelta): a compaction block whose summary and opaque metadata come in its
# compaction_delta, a text block opened with `"citations": null` and cited by a
# citations_delta; and the same answer unstreamed, as the SDK's accumulator gives it.
CITATION = {"type": "char_location", "cited_text": "The sky is blue.", "document_index": 0,
            "document_title": None, "start_char_index": 0, "end_char_index": 16}
STREAMED = [
    {"type": "message_start", "message": {
        "id": "msg_s", "type": "message", "role": "assistant", "model": "claude-test",
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": 5, "output_tokens": 1}}},
    {"type": "content_block_start", "index": 0, "content_block": {
        "type": "compaction", "content": None, "encrypted_content": None}},
    {"type": "content_block_delta", "index": 0, "delta": {
        "type": "compaction_delta", "content": "Earlier: the files were listed.",
        "encrypted_content": "Eo8BCkYIBRgC"}},
    {"type": "content_block_stop", "index": 0},
    {"type": "content_block_start", "index": 1, "content_block": {
        "type": "text", "text": "", "citations": None}},
    {"type": "content_block_delta", "index": 1, "delta": {
        "type": "text_delta", "text": "The sky is blue."}},
    {"type": "content_block_delta", "index": 1, "delta": {
        "type": "citations_delta", "citation": CITATION}},
    {"type": "content_block_stop", "index": 1},
    {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
     "usage": {"output_tokens": 9}},
    {"type": "message_stop"}]
UNSTREAMED = [{"type": "compaction", "content": "Earlier: the files were listed.",
               "encrypted_content": "Eo8BCkYIBRgC"},
              {"type": "text", "text": "The sky is blue.", "citations": [CITATION]}]


def test_a_streamed_compaction_and_citations_build_what_the_answer_holds():
    from relay.sse import Event

    events = [Event(emulator.encode_event(event)) for event in STREAMED]
    assert threads.message_from_events(events)["content"] == UNSTREAMED


async def test_a_carried_thread_goes_on_with_its_streamed_compaction_and_citations(local_relay,
                                                                                   aiohttp_server):
    from aiohttp import web

    bodies = []

    async def messages(request):
        bodies.append(orjson.loads(await request.read()))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in STREAMED:
            await response.write(emulator.encode_event(event))
        return response

    app = web.Application()
    app.router.add_post("/v1/messages", messages)
    client = await local_relay(await aiohttp_server(app), holds_threads=False)
    response, _ = await post(client, create(user(text("go")), stream=True))
    assert response.status == 200
    response, _ = await post(client, carry_on("msg_s", user(text("and?")), stream=True))
    assert response.status == 200
    assert bodies[1]["messages"] == [user(text("go")), assistant(*UNSTREAMED),
                                     user(text("and?"))]


async def test_a_streamed_answer_the_record_cannot_read_still_reaches_the_client(
        local_relay, aiohttp_server, caplog):
    from aiohttp import web

    # A backend's text delta of the wrong type: the record fails on it, after the stream.
    broken = [dict(event, delta={"type": "text_delta", "text": None})
              if event.get("delta", {}).get("type") == "text_delta" else event
              for event in STREAMED]

    async def messages(request):
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in broken:
            await response.write(emulator.encode_event(event))
        return response

    app = web.Application()
    app.router.add_post("/v1/messages", messages)
    client = await local_relay(await aiohttp_server(app), holds_threads=False)
    response, raw = await post(client, create(user(text("go")), stream=True))
    assert response.status == 200
    assert raw == b"".join(emulator.encode_event(event) for event in broken)
    # Logged as what it is, not as a handler that failed (aiohttp then drops the connection).
    assert [r.name for r in caplog.records if r.levelname == "ERROR"] == ["relay"]
    assert "could not be recorded" in caplog.text
    # Unrecorded, the relay holds no state for the thread: the API's answer to that, from
    # which the SDKs replay the history.
    response, error = await post(client, carry_on("msg_s", user(text("and?"))))
    assert response.status == 404
    assert error["error"]["details"] == {"error_code": "thread_not_found"}


async def test_a_carried_thread_marking_each_turn_for_the_cache_goes_past_four_turns(
        upstream, local_relay):
    # A client that marks its newest block each turn holds one breakpoint a request against
    # the API's threads; carried, the earlier turns go without theirs, as the SDK resends a
    # thread's history, or the fifth turn would hold five (the strict emulator, like the
    # API, takes four).
    mark = {"type": "ephemeral"}
    client = await local_relay(await upstream(tool_turns=6, threads="refuse"), holds_threads=False)
    response, answer = await post(client, create(user(dict(text("go"), cache_control=mark))))
    for _ in range(5):
        assert response.status == 200, answer
        results = answers_to(answer)
        results[-1]["cache_control"] = mark
        response, answer = await post(client, carry_on(answer["id"], user(*results)))
    assert response.status == 200, answer
    sent = received(client)
    assert [len(doc["messages"]) for doc in sent] == [1, 3, 5, 7, 9, 11]
    assert all(orjson.dumps(doc["messages"]).count(b'"cache_control"') == 1 for doc in sent)
    assert sent[-1]["messages"][-1]["content"][-1]["cache_control"] == mark


def test_a_carried_head_loses_its_breakpoints_and_nothing_else():
    head = [user(dict(text("go"), cache_control={"type": "ephemeral"}),
                 {"type": "document", "cache_control": {"type": "ephemeral"},
                  "source": {"type": "content", "content": [
                      dict(text("a"), cache_control={"type": "ephemeral", "ttl": "1h"})]}}),
            assistant(dict(use("toolu_1"), input={"cache_control": "a tool's own input"})),
            user(dict(result("toolu_1", [dict(text("r"), cache_control={"type": "ephemeral"})]),
                      cache_control={"type": "ephemeral"}))]
    assert threads.without_cache_control(head) == [
        user(text("go"), {"type": "document", "source": {"type": "content",
                                                         "content": [text("a")]}}),
        assistant(dict(use("toolu_1"), input={"cache_control": "a tool's own input"})),
        user(result("toolu_1", [text("r")]))]


def test_relay_validate_judges_a_continuation_as_a_tail(tmp_path, capsys):
    from relay import cli
    path = tmp_path / "tail.json"
    path.write_bytes(orjson.dumps(carry_on("msg_x", user(result("toolu_held")))))
    assert cli.main(["validate", str(path)]) == 0
    out, err = capsys.readouterr()
    assert "no tool-use faults found" in out
    assert "may answer a call in the part of the thread the server holds" in err
    path.write_bytes(orjson.dumps(body(user(result("toolu_held")))))
    assert cli.main(["validate", str(path)]) == 1  # without the thread, it is refused


async def test_ordering_judges_the_first_turn_against_held_calls(upstream, local_relay):
    client = await local_relay(await upstream(tool_turns=2, threads="hold"))
    _, first = await post(client, create(user(text("go"))))
    late = carry_on(first["id"], user(text("here:"), *answers_to(first)))
    response, error = await post(client, late)
    assert response.status == 400
    assert error["error"]["message"].startswith("messages.0: `tool_use` ids were found without")
    # Unseen, the same tail cannot be judged: it goes up, and the upstream refuses it.
    other = await local_relay(client.upstream)
    response, error = await post(other, late)
    assert response.status == 400 and len(received(other)) == 2
    assert "thread-head-unseen" in response.headers["x-relay-notes"]


async def test_an_answer_repeating_a_held_id_reaches_the_client_renamed(upstream, local_relay):
    client = await local_relay(await upstream(tool_turns=3, threads="hold", reuse_ids=True))
    _, first = await post(client, create(user(text("go"))))
    response, second = await post(client, carry_on(first["id"], user(*answers_to(first))))
    assert response.status == 200
    (held,) = [b["id"] for b in first["content"] if b["type"] == "tool_use"]
    (renamed,) = [b["id"] for b in second["content"] if b["type"] == "tool_use"]
    assert renamed == f"{held}-2"  # unique in the whole conversation, not only the request


async def test_the_emulator_holds_threads_as_the_sdk_types_describe(upstream, aiohttp_client):
    emu = await upstream(tool_turns=2, threads="hold")
    client = await aiohttp_client(emu)
    _, first = await post(client, create(user(text("go"))))
    response, error = await post(client, carry_on("msg_unknown", user(text("hi"))))
    assert response.status == 404
    assert error["error"]["details"] == {"error_code": "thread_not_found"}
    response, error = await post(client, carry_on(first["id"], user(text("hi")), tools=TOOLS))
    assert response.status == 400 and error["error"]["message"].startswith("tools:")
    response, error = await post(client, carry_on(first["id"], user(text("hi"))))
    assert response.status == 400  # the held calls are unanswered: the whole is judged
    assert error["error"]["message"].startswith("messages.2: `tool_use` ids were found")
    response, _ = await post(client, carry_on(first["id"], user(*answers_to(first))))
    assert response.status == 200
    response, error = await post(client, carry_on(first["id"], user(*answers_to(first))))
    assert response.status == 400
    assert error["error"]["details"] == {"error_code": "thread_already_continued"}
    response, error = await post(client, create(user(text("go"))), headers={})
    assert response.status == 400 and error["error"]["message"].startswith("thread:")


async def test_a_stream_too_long_to_keep_is_relayed_but_not_recorded():
    written = []

    async def write(data):
        written.append(data)

    tap = threads.Tap(write, limit=10)
    await tap(b"event: ping\ndata: {}\n\n")
    assert written == [b"event: ping\ndata: {}\n\n"] and tap.message() is None


async def test_a_renamed_call_is_answered_upstream_under_the_id_the_server_holds(upstream,
                                                                                local_relay):
    # A Kimi-like backend that holds threads: it repeats its ids turn after turn.
    emu = await upstream(tool_turns=3, threads="hold", reuse_ids=True, id_style="functions")
    client = await local_relay(emu, quirks={"tool_id_pattern": "^[a-zA-Z0-9_.:-]+$"})
    _, first = await post(client, create(user(text("go"))))
    _, second = await post(client, carry_on(first["id"], user(*answers_to(first))))
    (renamed,) = [b["id"] for b in second["content"] if b["type"] == "tool_use"]
    # The portable plugin hands it to the client in Anthropic's grammar; dedup renames the
    # repeat (the upstream's own id is functions.Bash:0 again).
    (held,) = [b["id"] for b in first["content"] if b["type"] == "tool_use"]
    assert held.startswith("relayid_") and renamed == f"{held}-2"
    response, third = await post(client, carry_on(second["id"], user(*answers_to(second))))
    assert response.status == 200, third
    sent = received(client)[-1]["messages"][0]["content"][0]
    assert sent["tool_use_id"] == "functions.Bash:0"  # what the server holds


async def test_one_clients_thread_is_no_other_clients_to_judge_against(upstream, local_relay):
    keys = {"KEY_A": "relay-key-alpha-0123456789", "KEY_B": "relay-key-bravo-0123456789"}
    client = await local_relay(await upstream(tool_turns=2, threads="hold"), env=keys,
                         server={"auth": {"keys": [{"name": "alpha", "key_env": "KEY_A"},
                                                   {"name": "bravo", "key_env": "KEY_B"}]}})
    alpha = {**BETA, "x-api-key": keys["KEY_A"]}
    bravo = {**BETA, "x-api-key": keys["KEY_B"]}
    _, first = await post(client, create(user(text("go"))), alpha)
    response, _ = await post(client, carry_on(first["id"], user(*answers_to(first))), bravo)
    assert response.status == 404  # not bravo's to continue (below)
    response, _ = await post(client, carry_on(first["id"], user(text("hi"))), alpha)
    assert response.status == 400  # alpha's record is still there, judged against
    assert len(received(client)) == 1


async def test_workers_sharing_a_state_carry_each_others_threads(upstream, aiohttp_client,
                                                                  tmp_path):
    # Two relays on one SQLite state, as two workers (or replicas on Redis) are: a thread
    # begun through one goes on through the other, carried whole to a backend without threads.
    emu = await upstream(tool_turns=2, threads="refuse")
    raw = {"pipeline": PIPELINE, "state": {"url": f"sqlite:///{tmp_path / 'state.db'}"},
           "backends": [{"name": "emu", "url": str(emu.make_url("")).rstrip("/"),
                         "models": ["*"], "holds_threads": False}]}
    one, other = (await start_relay(aiohttp_client, raw), await start_relay(aiohttp_client, raw))
    try:
        _, first = await post(one, create(user(text("go"))))
        for _ in range(100):  # the record is written to the state in the background
            if (await other.chain.state.get(threads.NAMESPACE, [f"\x00{first['id']}"]))[0]:
                break
            await asyncio.sleep(0.02)
        response, second = await post(other, carry_on(first["id"], user(*answers_to(first))))
        assert response.status == 200, second
        sent = [orjson.loads(raw) for *_, raw in emu.app[emulator.STATE].records]
        assert [len(doc["messages"]) for doc in sent] == [1, 3]
        assert sent[1]["tools"] == TOOLS and "thread" not in sent[1]
    finally:
        for client in (one, other):
            await client.chain.shutdown(client.config)


async def test_a_thread_moved_after_a_held_turn_keeps_the_fields_it_was_created_with(
        upstream, aiohttp_client):
    # Two turns held by one backend, then a /model switch: the continuation the relay
    # recorded sent no `system` or `tools` (a continuation may not), and the conversation
    # carried to the other backend must still have the ones the thread was created with.
    holding = await upstream(tool_turns=3, threads="hold")
    other = await upstream(tool_turns=3, threads="refuse")
    client = await start_relay(aiohttp_client, {"pipeline": PIPELINE, "backends": [
        {"name": "a", "url": str(holding.make_url("")).rstrip("/"), "models": ["claude-a"],
         "holds_threads": True},
        {"name": "b", "url": str(other.make_url("")).rstrip("/"), "models": ["claude-b"],
         "holds_threads": True}]})
    try:
        _, first = await post(client, create(user(text("go")), model="claude-a",
                                             system="be brief"))
        response, second = await post(client, carry_on(first["id"], user(*answers_to(first)),
                                                       model="claude-a"))
        assert response.status == 200, second
        response, third = await post(client, carry_on(second["id"], user(*answers_to(second)),
                                                      model="claude-b"))
        assert response.status == 200, third
        sent = [orjson.loads(raw) for *_, raw in other.app[emulator.STATE].records]
        assert "thread" not in sent[0] and len(sent[0]["messages"]) == 5
        assert sent[0]["tools"] == TOOLS and sent[0]["system"] == "be brief"
    finally:
        await client.chain.shutdown(client.config)


async def test_one_clients_thread_is_not_continued_by_another_client(upstream, local_relay):
    # The upstream holds every tenant's threads under the relay's one credential: a
    # continuation of a thread the relay recorded for another key would have the model answer
    # from that key's conversation. The relay answers as the API does for a thread it does
    # not hold, and the SDK replays its own history under a new thread.
    keys = {"KEY_A": "relay-key-alpha-0123456789", "KEY_B": "relay-key-bravo-0123456789"}
    client = await local_relay(await upstream(tool_turns=2, threads="hold"), env=keys,
                         server={"auth": {"keys": [{"name": "alpha", "key_env": "KEY_A"},
                                                   {"name": "bravo", "key_env": "KEY_B"}]}})
    alpha = {**BETA, "x-api-key": keys["KEY_A"]}
    bravo = {**BETA, "x-api-key": keys["KEY_B"]}
    _, first = await post(client, create(user(text("go"))), alpha)
    response, error = await post(client, carry_on(first["id"], user(*answers_to(first))), bravo)
    assert response.status == 404, error
    assert error["error"]["type"] == "not_found_error"
    assert error["error"]["details"] == {"error_code": "thread_not_found"}
    assert len(received(client)) == 1
    # Alpha's thread is still alpha's to continue.
    response, second = await post(client, carry_on(first["id"], user(*answers_to(first))),
                                  alpha)
    assert response.status == 200, second


def thread_store(client) -> threads.Store:
    from relay import server
    return client.server.app[server.STATE].threads


def expire_records(client) -> None:
    """What an hour without use does to the relay's record of threads."""
    store = thread_store(client)
    clock = store.clock
    store.clock = lambda: clock() + threads.MAX_AGE + 1


async def test_a_thread_the_relay_lost_is_answered_as_the_api_answers_a_thread_it_lost(
        upstream, local_relay):
    # The relay carries this thread for a backend that holds none; its record expired. The
    # API answers a previous_message_id it holds no state for 404 thread_not_found (the SDK's
    # ThreadNotFoundError), and the SDK replays its history under a new thread: the client
    # goes on threading. thread_unsupported_request would have the SDK's thread helper raise
    # (its unsupported_request_behavior is "error" by default) and its tool runner stop
    # threading for good.
    client = await local_relay(await upstream(tool_turns=2, threads="refuse"),
                               holds_threads=False)
    _, first = await post(client, create(user(text("go"))))
    expire_records(client)
    response, error = await post(client, carry_on(first["id"], user(*answers_to(first))))
    assert response.status == 404, error
    assert error["error"]["type"] == "not_found_error"
    assert error["error"]["details"] == {"error_code": "thread_not_found"}
    assert error["request_id"] == response.headers["x-relay-request-id"]
    assert "thread-not-recorded" in response.headers["x-relay-notes"]
    assert len(received(client)) == 1


async def test_the_sdks_thread_goes_on_when_the_relay_lost_its_record(upstream, local_relay):
    import anthropic
    client = await local_relay(await upstream(tool_turns=2, threads="refuse"),
                               holds_threads=False)
    sdk = anthropic.AsyncAnthropic(base_url=str(client.make_url("")).rstrip("/"),
                                   api_key="sk-test-client", max_retries=0)
    thread = sdk.beta.messages.thread(model="claude-test", max_tokens=100, tools=TOOLS)
    first = await thread.send(user(text("go")))
    expire_records(client)
    second = await thread.send(user(*answers_to(first.model_dump())))
    third = await thread.send(user(*answers_to(second.model_dump())))
    assert third.stop_reason == "end_turn"
    # The replay went up whole, and the turn after it continued the new thread.
    assert [len(doc["messages"]) for doc in received(client)] == [1, 3, 5]
    await sdk.close()



KEYS = {"KEY_A": "relay-key-alpha-0123456789", "KEY_B": "relay-key-bravo-0123456789"}
AUTH = {"auth": {"keys": [{"name": "alpha", "key_env": "KEY_A"},
                          {"name": "bravo", "key_env": "KEY_B"}]}}
ALPHA = {**BETA, "x-api-key": KEYS["KEY_A"]}
BRAVO = {**BETA, "x-api-key": KEYS["KEY_B"]}


async def not_bravos(client, message: dict) -> None:
    """Bravo's continuation of alpha's answer: the API's answer to a thread it does not hold,
    and nothing upstream."""
    before = len(received(client))
    response, error = await post(client, carry_on(message["id"], user(*answers_to(message))),
                                 BRAVO)
    assert response.status == 404, error
    assert error["error"]["details"] == {"error_code": "thread_not_found"}
    assert len(received(client)) == before


async def test_a_thread_whose_record_is_gone_is_still_its_own_keys(upstream, local_relay):
    # Evicted or expired: the conversation is no longer known, its owner still is.
    client = await local_relay(await upstream(tool_turns=2, threads="hold"), env=KEYS,
                               server=AUTH)
    _, first = await post(client, create(user(text("go"))), ALPHA)
    expire_records(client)
    await not_bravos(client, first)
    response, second = await post(client, carry_on(first["id"], user(*answers_to(first))),
                                  ALPHA)
    assert response.status == 200, second
    assert "thread-head-unseen" in response.headers["x-relay-notes"]


async def test_a_thread_gone_on_unseen_is_still_its_own_keys(upstream, local_relay):
    # Its conversation expired, its owner known: alpha's thread goes on unseen, and its next
    # answer is alpha's alone all the same.
    client = await local_relay(await upstream(tool_turns=3, threads="hold"), env=KEYS,
                               server=AUTH)
    _, first = await post(client, create(user(text("go"))), ALPHA)
    expire_records(client)
    response, second = await post(client, carry_on(first["id"], user(*answers_to(first))),
                                  ALPHA)
    assert response.status == 200, second
    assert "thread-head-unseen" in response.headers["x-relay-notes"]
    await not_bravos(client, second)


async def test_with_several_keys_a_thread_of_no_known_key_is_not_forwarded(upstream,
                                                                         local_relay):
    # A restart without a shared state (or another replica): the relay knows neither the
    # conversation nor the key alpha's answer went to. The upstream holds it under the
    # operator's one credential, so bravo's continuation would be answered from alpha's
    # conversation: neither key's goes up, each gets the API's answer to a thread it cannot
    # find, from which the SDKs replay their own history.
    emu = await upstream(tool_turns=3, threads="hold")
    before = await local_relay(emu, env=KEYS, server=AUTH)
    _, first = await post(before, create(user(text("go"))), ALPHA)
    client = await local_relay(emu, env=KEYS, server=AUTH)
    for headers in (BRAVO, ALPHA):
        response, error = await post(client, carry_on(first["id"], user(*answers_to(first))),
                                     headers)
        assert response.status == 404, error
        assert error["error"]["type"] == "not_found_error"
        assert error["error"]["details"] == {"error_code": "thread_not_found"}
        assert "thread-owner-unknown" in response.headers["x-relay-notes"]
    assert len(received(client)) == 1  # the create, through the relay before
    # Alpha's replay under a new thread goes on as any thread does.
    _, again = await post(client, create(user(text("go")), assistant(*first["content"]),
                                         user(*answers_to(first))),
                          ALPHA)
    response, third = await post(client, carry_on(again["id"], user(*answers_to(again))),
                                 ALPHA)
    assert response.status == 200, third


@pytest.mark.parametrize("auth", [None, "one key"])
async def test_with_one_key_or_none_a_thread_of_no_known_key_goes_on(upstream, local_relay,
                                                                    auth):
    # No other tenant to keep out: forwarded unseen, as before.
    server = {"auth": {"keys": [{"name": "alpha", "key_env": "KEY_A"}]}} if auth else None
    headers = ALPHA if auth else BETA
    emu = await upstream(tool_turns=3, threads="hold")
    before = await local_relay(emu, env=KEYS, server=server)
    _, first = await post(before, create(user(text("go"))), headers)
    client = await local_relay(emu, env=KEYS, server=server)
    response, second = await post(client, carry_on(first["id"], user(*answers_to(first))),
                                  headers)
    assert response.status == 200, second
    assert response.headers["x-relay-notes"] == "thread-head-unseen"


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
async def test_the_sdks_tool_runner_survives_a_restart_and_no_other_key_takes_its_thread(
        upstream, local_relay, stream):
    import anthropic
    import httpx2

    emu = await upstream(tool_turns=3, threads="hold")
    before = await local_relay(emu, env=KEYS, server=AUTH)
    serving = [before]

    class Current(httpx2.AsyncHTTPTransport):
        """Each request to the relay serving now: the one before the restart, then the
        one after."""

        async def handle_async_request(self, request):
            request.url = request.url.copy_with(port=serving[0].make_url("").port)
            return await super().handle_async_request(request)

    def sdk(key: str, statuses: list | None = None):
        async def seen(response):
            if statuses is not None:
                statuses.append(response.status_code)
        return anthropic.AsyncAnthropic(
            base_url=str(before.make_url("")).rstrip("/"), api_key=key, max_retries=0,
            http_client=httpx2.AsyncClient(transport=Current(),
                                           event_hooks={"response": [seen]}))

    after = await local_relay(emu, env=KEYS, server=AUTH)

    @anthropic.beta_async_tool
    async def Bash(command: str, description: str = "") -> str:
        """Run a command.

        Args:
            command: the command line
            description: what it is for
        """
        serving[0] = after  # the relay restarted, with nothing shared, after the first turn
        return f"ran {command}"

    statuses: list[int] = []
    alpha = sdk(KEYS["KEY_A"], statuses)
    runner = alpha.beta.messages.tool_runner(
        model="claude-test", max_tokens=200, tools=[Bash], stream=stream,
        messages=[{"role": "user", "content": "Run the tool until you are done."}])
    final = await runner.until_done()
    assert final.stop_reason == "end_turn"
    # The create, before the restart; its continuation, whose key the relay after it does
    # not know; the history replayed under a new thread, and that thread continued.
    assert statuses == [200, 404, 200, 200, 200], statuses
    sent = received(after)  # the emulator's: both relays' requests
    assert [doc["thread"]["type"] for doc in sent] == ["create", "create", "continue",
                                                       "continue"]
    assert len(sent[1]["messages"]) == 3
    # Held upstream: the answer before the restart, whose key the relay does not know now,
    # and the last, which it knows is alpha's. Bravo continues neither.
    ids = list(emu.app[emulator.STATE].threads)
    assert len(ids) == 2
    bravo = sdk(KEYS["KEY_B"])
    for _, answer_id in ids:
        with pytest.raises(anthropic.NotFoundError) as refused:
            await bravo.beta.messages.create(
                model="claude-test", max_tokens=100, betas=[threads.BETA],
                thread={"type": "continue", "previous_message_id": answer_id},
                messages=[{"role": "user", "content": "what did we just do?"}])
        assert refused.value.body["error"]["details"] == {"error_code": "thread_not_found"}
    assert len(received(after)) == len(sent)
    await alpha.close()
    await bravo.close()


def test_the_keys_a_relay_serves_are_counted_by_name():
    from relay import keys
    from relay.config import InboundKey
    from relay.inbound import Gate
    gate = Gate([InboundKey("alpha", KEYS["KEY_A"])])
    assert gate.tenants == 1
    records = [{"name": name, "hash": keys.digest(name * 8)} for name in ("alpha", "bravo")]
    gate.replace(keys.stored(records, None, gate.configured_names))  # alpha's is left out
    assert gate.tenants == 2
    gate.replace({})
    assert gate.tenants == 1


@pytest.mark.parametrize("store", ["sqlite", pytest.param("redis", marks=pytest.mark.slow)])
async def test_replicas_sharing_a_state_keep_each_keys_threads_its_own(upstream,
                                                                       aiohttp_client,
                                                                       tmp_path, request,
                                                                       store):
    emu = await upstream(tool_turns=2, threads="hold")
    url = (f"sqlite:///{tmp_path / 'state.db'}" if store == "sqlite"
           else request.getfixturevalue("redis_server").url)
    raw = {"pipeline": PIPELINE, "server": AUTH, "state": {"url": url},
           "backends": [{"name": "emu", "url": str(emu.make_url("")).rstrip("/"),
                         "models": ["*"], "holds_threads": True}]}
    one, other = (await start_relay(aiohttp_client, raw, env=KEYS),
                  await start_relay(aiohttp_client, raw, env=KEYS))
    other.upstream = emu
    try:
        _, first = await post(one, create(user(text("go"))), ALPHA)
        for _ in range(100):  # the owner is written to the state in the background
            if (await other.chain.state.get(threads.OWNERS, [first["id"]]))[0]:
                break
            await asyncio.sleep(0.02)
        await not_bravos(other, first)
        response, second = await post(other, carry_on(first["id"], user(*answers_to(first))),
                                      ALPHA)
        assert response.status == 200, second
    finally:
        for client in (one, other):
            await client.chain.shutdown(client.config)


@pytest.mark.parametrize("holds", [True, False], ids=["held", "carried"])
async def test_a_continuation_on_another_replica_waits_for_its_answers_record(
        upstream, aiohttp_client, tmp_path, holds):
    # The record and the owner of an answer reach the shared state behind it: a client that
    # continues at once on another replica comes before them (here they take 50 ms). It was
    # judged as unseen, or refused as a thread nobody recorded; the replica waits for them.
    emu = await upstream(tool_turns=2, threads="hold" if holds else "refuse")
    raw = {"pipeline": PIPELINE, "server": AUTH,
           "state": {"url": f"sqlite:///{tmp_path / 'state.db'}"},
           "backends": [{"name": "emu", "url": str(emu.make_url("")).rstrip("/"),
                         "models": ["*"], "holds_threads": holds}]}
    one, other = (await start_relay(aiohttp_client, raw, env=KEYS),
                  await start_relay(aiohttp_client, raw, env=KEYS))
    other.upstream = emu
    state = one.chain.state
    put, put_soon = state.put, state.put_soon
    loop = asyncio.get_running_loop()

    async def slow_put(*args):
        await asyncio.sleep(0.05)
        await put(*args)

    state.put = slow_put
    state.put_soon = lambda *args: loop.call_later(0.05, put_soon, *args)
    try:
        _, first = await post(one, create(user(text("go"))), ALPHA)
        response, second = await post(other, carry_on(first["id"], user(*answers_to(first))),
                                      ALPHA)
        assert response.status == 200, second
        assert response.headers.get("x-relay-notes") is None  # the head known
    finally:
        for client in (one, other):
            await client.chain.shutdown(client.config)


async def test_a_streamed_answer_cut_short_is_still_its_own_keys(upstream, local_relay):
    # The server holds an answer whole or not at all (the SDK's record_partial_reply): this
    # one it holds, though the client's stream ended in an error event and the relay kept
    # nothing of it to continue from.
    client = await local_relay(await upstream(tool_turns=2, threads="hold",
                                              stream_error_after=3), env=KEYS, server=AUTH)
    response, raw = await post(client, create(user(text("go")), stream=True), ALPHA)
    assert response.status == 200 and b"event: error" in raw
    started = orjson.loads(raw.split(b"data: ", 1)[1].split(b"\n", 1)[0])["message"]
    (held,) = [content for content in client.upstream.app[emulator.STATE].threads.values()]
    calls = [block for block in held[0][-1]["content"] if block["type"] == "tool_use"]
    await not_bravos(client, {"id": started["id"], "content": calls})


def test_a_stream_too_long_to_keep_still_names_its_answer():
    async def write(data):
        pass

    start = {"type": "message_start", "message": {"id": "msg_long", "content": []}}
    tap = threads.Tap(write, limit=200)
    asyncio.run(tap(b"event: message_start\ndata: " + orjson.dumps(start) + b"\n\n"))
    asyncio.run(tap(b"event: ping\ndata: {\"type\": \"ping\"}\n\n" * 10))
    assert tap.parts is None and tap.message() is None
    assert tap.answer_id() == "msg_long"


def test_the_owners_are_bounded_by_count():
    store = threads.Store()
    store.max_owners = 2
    for answer in ("msg_a", "msg_b", "msg_c"):
        store.own(("alpha", answer))
    assert list(store._owners) == ["msg_b", "msg_c"]


DIAGNOSED = {"anthropic-beta": f"{BETA['anthropic-beta']},cache-diagnosis-2026-04-07"}
DIAGNOSING = ["cache", *PIPELINE]


def diagnosing(previous: str | None) -> dict:
    return {"diagnostics": {"previous_message_id": previous}}


async def test_diagnostics_of_a_held_continuation_compare_the_whole_conversation(
        upstream, local_relay):
    # A backend that holds threads and answers no diagnostics: the relay answers them, and
    # the prompt the server builds is the held turns and the new one, not the new one alone.
    client = await local_relay(await upstream(tool_turns=3, threads="hold", diagnostics=False),
                               pipeline=DIAGNOSING)
    _, first = await post(client, create(user(text("go")), **diagnosing(None)), DIAGNOSED)
    _, second = await post(client, carry_on(first["id"], user(*answers_to(first)),
                                            **diagnosing(first["id"])), DIAGNOSED)
    assert "diagnostics" not in second  # the prefix only grew: no divergence
    _, third = await post(client, carry_on(second["id"], user(*answers_to(second)),
                                           **diagnosing(second["id"])), DIAGNOSED)
    assert "diagnostics" not in third  # it knew the second, held, request as well
    _, fourth = await post(client, carry_on(third["id"], user(*answers_to(third)),
                                            model="claude-other", **diagnosing(third["id"])),
                           DIAGNOSED)
    assert fourth["diagnostics"]["cache_miss_reason"]["type"] == "model_changed"


async def test_diagnostics_of_a_thread_moved_off_a_holding_backend(upstream, aiohttp_client):
    # Held turns on a backend that answers diagnostics itself, then a /model switch to one
    # that answers none, the thread carried there: the relay compares with the held turn.
    holding = await upstream(tool_turns=3, threads="hold")
    other = await upstream(tool_turns=3, threads="refuse", diagnostics=False)
    client = await start_relay(aiohttp_client, {"pipeline": DIAGNOSING, "backends": [
        {"name": "a", "url": str(holding.make_url("")).rstrip("/"), "models": ["claude-a"],
         "holds_threads": True, "holds_diagnostics": True},
        {"name": "b", "url": str(other.make_url("")).rstrip("/"), "models": ["claude-b"],
         "holds_threads": True}]})
    try:
        _, first = await post(client, create(user(text("go")), model="claude-a",
                                             **diagnosing(None)), DIAGNOSED)
        _, second = await post(client, carry_on(first["id"], user(*answers_to(first)),
                                                model="claude-a", **diagnosing(first["id"])),
                               DIAGNOSED)
        response, third = await post(client, carry_on(
            second["id"], user(*answers_to(second)), model="claude-b",
            **diagnosing(second["id"])), DIAGNOSED)
        assert response.status == 200, third
        assert third["diagnostics"]["cache_miss_reason"]["type"] == "model_changed"
    finally:
        await client.chain.shutdown(client.config)


async def test_a_stream_the_client_left_is_no_turn_to_continue(upstream, aiohttp_client):
    # The SDK never continues a reply whose stream ended before message_stop (the server
    # holds it whole or not at all: record_partial_reply starts a new thread); the relay,
    # the server of a carried thread, holds none of it, and the turn before stays.
    from relay.hookspecs import hookimpl

    class Ends:
        def __init__(self):
            self.ended: list = []

        @hookimpl
        def relay_exchange_end(self, exchange):
            self.ended.append(exchange.outcome)

    ends = Ends()
    emu = await upstream(tool_turns=2, threads="refuse", stall_after=2, stall_ms=300)
    client = await start_relay(aiohttp_client, {
        "pipeline": ["ends", *PIPELINE], "backends": [{
            "name": "emu", "url": str(emu.make_url("")).rstrip("/"), "models": ["*"],
            "holds_threads": False}]}, extra={"ends": ends})
    try:
        _, first = await post(client, create(user(text("go"))))
        response = await client.post("/v1/messages", data=orjson.dumps(carry_on(
            first["id"], user(*answers_to(first)), stream=True)), headers={
                "Content-Type": "application/json", **BETA})
        started = orjson.loads((await response.content.readuntil(b"\n\n")).split(b"data: ")[1])
        response.close()  # gone mid-answer
        for _ in range(300):  # the relay goes on until the upstream does, then cannot write
            if len(ends.ended) == 2:
                break
            await asyncio.sleep(0.01)
        assert [outcome.value for outcome in ends.ended] == ["ok", "client_disconnected"]
        store = thread_store(client)
        assert store.get((None, started["message"]["id"])) is None
        assert store.get((None, first["id"])) is not None
    finally:
        await client.chain.shutdown(client.config)


UPSTREAM_KEYS = {"K1": "sk-upstream-one-0123456789", "K2": "sk-upstream-two-0123456789"}


async def pooled_relay(aiohttp_client, emu):
    """A relay whose one backend, holding threads, has a pool of two credentials: two
    accounts, each holding only its own threads (the emulator holds them per key)."""
    client = await start_relay(aiohttp_client, {"pipeline": PIPELINE, "backends": [{
        "name": "a", "url": str(emu.make_url("")).rstrip("/"), "models": ["*"],
        "holds_threads": True, "credentials": [{"name": "one", "key_env": "K1"},
                                               {"name": "two", "key_env": "K2"}]}]},
        env=UPSTREAM_KEYS)
    client.upstream = emu
    return client


def sent_with(client) -> list[tuple[str, dict]]:
    """Each upstream request's credential (``one``, ``two``) and body."""
    names = {key: name for name, key in zip(("one", "two"), UPSTREAM_KEYS.values(),
                                            strict=True)}
    return [(names[headers["x-api-key"]], doc)
            for headers, doc in zip(received_headers(client), received(client), strict=True)]


async def test_a_held_thread_stays_on_the_credential_that_holds_it(upstream, aiohttp_client):
    # A pool's keys are accounts of their own: a thread is held by the one it was created
    # with, and a continuation sent with another would find nothing there. A continuation
    # holds neither the thread's system and tools nor its first message, so the relay's
    # session rule reads them from the conversation the relay recorded: it is the create's
    # session, on the create's credential.
    client = await pooled_relay(aiohttp_client, await upstream(tool_turns=3, threads="hold"))
    try:
        _, first = await post(client, create(user(text("go")), system="be brief"))
        _, second = await post(client, carry_on(first["id"], user(*answers_to(first))))
        _, third = await post(client, carry_on(second["id"], user(*answers_to(second))))
        assert third["stop_reason"] == "tool_use"
        keys = [headers["x-api-key"] for headers in received_headers(client)]
        assert len(keys) == 3 and len(set(keys)) == 1, keys
    finally:
        await client.chain.shutdown(client.config)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
async def test_a_held_thread_whose_credential_cools_is_carried_to_the_next(upstream,
                                                                           aiohttp_client,
                                                                           stream):
    # The account holding the thread answers its third request 429: the pool moves the
    # session to the other account, which holds none of the thread (it answered 404
    # thread_not_found, and the client replayed its whole history). The relay recorded the
    # conversation: it goes there whole, as to a backend without threads, and the client
    # threads on.
    emu = await upstream(tool_turns=4, threads="hold", key_budget=2, key_window=600)
    client = await pooled_relay(aiohttp_client, emu)
    try:
        _, first = await post(client, create(user(text("go")), system="be brief"))
        _, second = await post(client, carry_on(first["id"], user(*answers_to(first))))
        response, raw = await post(client, carry_on(second["id"], user(*answers_to(second)),
                                                    stream=stream))
        assert response.status == 200, raw
        third = message_of(raw) if stream else raw
        assert answers_to(third)
        response, fourth = await post(client, carry_on(third["id"], user(*answers_to(third))))
        assert response.status == 200, fourth
        sent = sent_with(client)
        assert [(name, doc.get("thread", {}).get("type"), len(doc["messages"]))
                for name, doc in sent] == [("one", "create", 1), ("one", "continue", 1),
                                           ("one", "continue", 1), ("two", None, 5),
                                           ("two", None, 7)]
        assert sent[3][1]["system"] == "be brief" and sent[3][1]["tools"] == TOOLS
        assert all(BETA["anthropic-beta"] not in headers.get("anthropic-beta", "")
                   for headers in received_headers(client)[3:])
    finally:
        await client.chain.shutdown(client.config)


def message_of(raw: bytes) -> dict:
    """The message a stream's events build, as the SDK's accumulator builds it."""
    from relay.sse import SSEDecoder
    decoder = SSEDecoder()
    events = decoder.feed(raw) + decoder.close()
    message = threads.message_from_events(events)
    assert message is not None, raw
    return message


async def test_a_held_thread_the_relay_lost_goes_where_its_session_goes(upstream,
                                                                        aiohttp_client):
    # Without a record the relay knows neither the conversation nor the account holding it:
    # the continuation goes as a session of its own, and an account that holds none of the
    # thread answers as the API does, 404 thread_not_found, from which the SDKs replay.
    emu = await upstream(tool_turns=3, threads="hold", key_budget=1, key_window=600)
    client = await pooled_relay(aiohttp_client, emu)
    try:
        _, first = await post(client, create(user(text("go"))))
        expire_records(client)
        response, error = await post(client, carry_on(first["id"], user(*answers_to(first))))
        assert response.status == 404, error
        assert error["error"]["details"] == {"error_code": "thread_not_found"}
        assert error["request_id"] != response.headers["x-relay-request-id"]  # two's own
        assert [name for name, _ in sent_with(client)] == ["one", "two"]
    finally:
        await client.chain.shutdown(client.config)
