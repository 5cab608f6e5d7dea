"""A session's request resumed from where its previous one ended (relay.resume) comes out
exactly as the full walk makes it: the bytes that go upstream, the refusal, the repairs,
the rewrites, the record's timeline and tables. Over generated sessions (the history
generator of test_history_properties, with reused ids, faults and repairs, ids outside the
grammar, foreign thinking, and Claude Code's moving cache marker), two relays side by side:
one resuming, one walking every request whole."""

from __future__ import annotations

import asyncio
import logging

import orjson
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict, CIMultiDictProxy
from relay_builtins import dedup, portable
from support import assistant, result, text, use, user
from test_history_properties import histories

from relay import config as config_module
from relay import resume
from relay import sessions as session_rule
from relay.chain import Chain, load_plugins
from relay.errors import RelayError
from relay.hookspecs import hookimpl
from relay.prepare import Preparation, prepare_exchange
from relay.testing.fixtures import received, relay_client  # noqa: F401  (the fixture)

PIPELINE = ["dedup", "pairing", "ordering", "portable"]
RUN = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SESSION = {"x-claude-code-session-id": "session-1", "content-type": "application/json"}
UNNAMED = {"x-claude-code-session-id": ""}  # no session id: the key comes from the content
FOREIGN = "sig-other"  # a thinking signature another backend issued


def relay(pipeline=PIPELINE, plugins=None, resume_bytes=64 * 1024 * 1024, extra=None):
    raw = {"pipeline": pipeline, "plugins": plugins or {},
           "server": {"resume_bytes": resume_bytes},
           "backends": [{"name": "emu", "url": "http://127.0.0.1:9", "models": ["*"]},
                        {"name": "other", "url": "http://127.0.0.1:9", "models": ["other-*"]}]}
    config = config_module.parse(raw, {})
    chain = Chain(load_plugins(config.pipeline, extra=extra), config)
    asyncio.run(chain.startup(config))
    state = Preparation(config, chain)
    if state.resume is not None:
        state.resume.min_bytes = 0  # the histories here are small
    if "portable" in pipeline:
        block = {"type": "thinking", "signature": FOREIGN}
        chain.pm.get_plugin("portable").provenance.record(
            [(portable.block_key(block), "other", "other-model")])
    return state


def headers(extra=None):
    return CIMultiDictProxy(CIMultiDict({**SESSION, **(extra or {})}))


def prepared(state: Preparation, raw: bytes, extra_headers=None):
    """What preparing ``raw`` gave: everything the exchange records, or the refusal."""
    try:
        exchange = asyncio.run(prepare_exchange(
            state, method="POST", path="/v1/messages", query="", headers=headers(extra_headers),
            raw_body=raw))
    except RelayError as error:
        return ("refused", error.status, error.message, error.rule), None
    # What dedup leaves for the answer, as the answer takes it (a request without blocks
    # leaves its ledger to be made then).
    answering = dedup._answer_state(exchange, dedup.DEFAULT_SEPARATOR, False) \
        if "dedup" in exchange.state else {}
    ledger = answering.get("ledger")
    found = (exchange.upstream_body(),
             {k: v for k, v in exchange.response_headers.items() if k != "x-relay-request-id"},
             exchange.translation, exchange.repairs, exchange.repaired_by, exchange.uncertain,
             [{k: v for k, v in entry.items() if k != "t"} for entry in exchange.timeline],
             exchange.state.get(portable.RAW_IDS),
             (ledger.taken, ledger.counts, ledger.next_free) if ledger else None,
             answering.get("message_index"), answering.get("restore"),
             exchange.model)
    return found, exchange


def body(messages, **fields) -> bytes:
    return orjson.dumps({"model": "claude-test", "max_tokens": 64, "messages": messages,
                         **fields})


def marked(messages: list) -> list:
    """The request as Claude Code sends it: a cache breakpoint on its last block."""
    messages = orjson.loads(orjson.dumps(messages))
    last = messages[-1]
    if isinstance(last["content"], str):
        last["content"] = [{"type": "text", "text": last["content"]}]
    if last["content"]:
        last["content"][-1]["cache_control"] = {"type": "ephemeral"}
    return messages


@st.composite
def sessions(draw):
    """A conversation and how it is sent: one request per message, growing, each the
    previous one's messages (byte for byte, but for a moving cache marker) plus one."""
    messages, _ = draw(histories())
    if draw(st.booleans()):  # ids another provider minted, outside Anthropic's grammar
        messages = orjson.loads(orjson.dumps(messages).replace(b'"toolu_', b'"fn.tool:'))
    if draw(st.booleans()):  # thinking, some of it issued by another backend, some unsigned
        for message in messages:
            if message["role"] == "assistant" and isinstance(message["content"], list):
                signature = draw(st.sampled_from(["sig-ours", FOREIGN, ""]))
                message["content"].insert(0, {"type": "thinking", "thinking": "hm",
                                              "signature": signature})
    fields = draw(st.sampled_from([{}, {"system": "be brief"},
                                   {"thinking": {"type": "enabled", "budget_tokens": 1024}}]))
    marker = draw(st.booleans())
    options = {"pairing": {"pairing_mode": draw(st.sampled_from(["reject", "repair"]))},
               "ordering": {"ordering_mode": draw(st.sampled_from(["reject", "repair"]))}}
    requests = [body(marked(messages[:n]) if marker else messages[:n], **fields)
                for n in range(1, len(messages) + 1)]
    return options, requests


def resumed_as_whole(session, extra_headers=None) -> None:
    """Each request of ``session`` comes out of a resuming relay as the full walk makes it."""
    options, requests = session
    resuming, whole = relay(plugins=options), relay(plugins=options, resume_bytes=0)
    assert resuming.resume is not None and whole.resume is None
    for raw in requests:
        assert prepared(resuming, raw, extra_headers)[0] == prepared(whole, raw, extra_headers)[0]


@RUN
@given(sessions(), st.booleans())
def test_a_resumed_request_is_the_full_walk_byte_for_byte(session, unnamed):
    resumed_as_whole(session, UNNAMED if unnamed else None)


def conversation(turns: int, reuse: bool = False, size: int = 0) -> list:
    messages = [user(text("start"))]
    for n in range(turns):
        tool_id = "toolu_0" if reuse and n % 3 == 2 else f"toolu_{n + 1}"
        messages += [assistant(text("looking"), use(tool_id)),
                     user(result(tool_id, "done" + "." * size))]
    return messages


@pytest.mark.parametrize("reuse", [False, True])
def test_each_request_of_a_growing_session_walks_only_its_new_turn(reuse):
    state, whole = relay(), relay(resume_bytes=0)
    messages = conversation(12, reuse)
    starts = []
    for n in range(3, len(messages) + 1, 2):
        raw = body(marked(messages[:n]))
        ours, exchange = prepared(state, raw)
        assert ours == prepared(whole, raw)[0]
        starts.append(exchange.resume.start if exchange.resume is not None else None)
        if not reuse:
            assert exchange.upstream_body() == raw  # the client's own bytes
    # The first request of a session is walked whole and kept (a trial); each one after goes
    # on from before the previous request's last message, whose marker moved.
    assert starts == [0, *range(2, len(messages) - 2, 2)]


def opened(state, raw, extra_headers=None):
    """A session's first two requests: from the second on, the relay keeps a record."""
    prepared(state, raw, extra_headers)
    return prepared(state, raw, extra_headers)


def test_a_message_dropped_whole_on_a_tool_loop_is_resumed_as_walked_whole():
    # The assistant message holding only another backend's thinking is dropped whole, so the
    # messages judged are one fewer than the client's, whose count the marks are in.
    def thinking(signature):
        return {"type": "thinking", "thinking": "hm", "signature": signature}
    messages = [user(text("start")), assistant(thinking("sig-ours"), use("toolu_1")),
                user(result("toolu_1"), text("go on")), assistant(thinking(FOREIGN)),
                assistant(thinking("sig-ours"), use("toolu_2")), user(result("toolu_2")),
                assistant(thinking("sig-ours"), text("ok")), user(text("more"))]
    state, whole = relay(), relay(resume_bytes=0)
    for n in range(1, len(messages) + 1):
        raw = body(marked(messages[:n]), thinking={"type": "enabled", "budget_tokens": 1024})
        ours = prepared(state, raw)[0]
        assert ours == prepared(whole, raw)[0]
        assert ours[0] != "refused"


def test_an_edited_history_or_another_model_is_walked_whole():
    state = relay()
    messages = conversation(4)
    opened(state, body(messages))
    edited = [user(text("another start")), *messages[1:]]
    _, exchange = prepared(state, body(edited + [assistant(text("ok"))]))
    assert exchange.resume.start == 0
    _, exchange = prepared(state, body(edited + [assistant(text("ok")), user(text("go"))],
                                       model="other-model"))
    assert exchange.resume.start == 0  # another backend: the record is not used


def test_an_evicted_session_costs_a_full_walk_and_the_budget_holds():
    state = relay(resume_bytes=40_000)  # a quarter: 10,000 bytes per session
    messages = conversation(6)
    for name in ("a", "b", "c", "d", "e"):
        opened(state, body(messages), {"x-claude-code-session-id": name})
    assert state.resume.bytes <= 40_000 and len(state.resume.records) < 5
    _, exchange = prepared(state, body(messages + [assistant(text("ok"))]),
                           {"x-claude-code-session-id": "a"})
    assert exchange.resume.start == 0  # "a" was evicted first
    big = conversation(6)
    big[0] = user(text("x" * 20_000))
    opened(state, body(big), {"x-claude-code-session-id": "big"})
    assert "big" not in state.resume.lanes  # over a session's share: not kept
    assert state.resume.bytes <= 40_000


def test_two_conversations_of_one_session_each_go_on_from_their_own_record():
    state, whole = relay(), relay(resume_bytes=0)
    main, side = conversation(6), [user(text("summarise this session")), *conversation(2)[1:]]
    for messages in (main, side):
        opened(state, body(messages))
    for turn in range(3):  # interleaved, as Claude Code's main loop and a subagent are
        for messages in (main, side):
            messages += [assistant(text(f"turn {turn}")), user(text("go on"))]
            ours, exchange = prepared(state, body(messages))
            assert exchange.resume.start == len(messages) - 2
            assert ours == prepared(whole, body(messages))[0]


def test_a_conversation_that_goes_back_keeps_one_record_not_two():
    """A request back at an earlier turn (an edit, a rewind) supersedes the record of the
    later one it cannot go on from; another conversation of the session keeps its own."""
    state = relay()
    main, side = conversation(8), [user(text("summarise this session")), *conversation(2)[1:]]
    opened(state, body(main))
    opened(state, body(side))
    _, exchange = prepared(state, body(main[:5]))  # back to an earlier turn
    assert exchange.resume.start == 0
    [lanes] = state.resume.lanes.values()
    assert sorted(state.resume.records[key].count for key in state.resume.records) == sorted(
        [len(side), 5])
    assert len(lanes) == 2
    _, exchange = prepared(state, body(main[:5] + [assistant(text("again")), user(text("go"))]))
    assert exchange.resume.start >= 4  # going on from the one kept


def test_a_record_that_could_go_no_further_than_the_one_found_is_not_compared(monkeypatch):
    state, whole = relay(), relay(resume_bytes=0)
    main, side = conversation(6), [user(text("summarise this session")), *conversation(1)[1:]]
    for messages in (main, side):
        opened(state, body(messages))
    compared = []
    matching = resume.match

    def counted(record, raw):
        compared.append(record.count)
        return matching(record, raw)

    monkeypatch.setattr(resume, "match", counted)
    main += [assistant(text("more")), user(text("go on"))]
    ours, exchange = prepared(state, body(main))
    assert exchange.resume.start == len(main) - 2
    assert ours == prepared(whole, body(main))[0]
    # The side conversation's record ends before the boundary the main one's gave.
    assert compared == [len(main) - 2]


class Walker:
    """A third-party plugin that walks requests and has not opted in."""

    seen: list = []

    @hookimpl
    def relay_request(self, exchange):
        Walker.seen.append(len(exchange.messages))


class Stateless:
    """A plugin whose request hook reads no history: it opts in and does nothing more."""

    RESUMABLE = True
    models: list = []

    @hookimpl
    def relay_request(self, exchange):
        Stateless.models.append(exchange.model)


def test_a_plugin_that_reads_no_history_opts_in_and_need_do_nothing_more():
    state = relay(pipeline=["stateless", *PIPELINE], extra={"stateless": Stateless})
    messages = conversation(4)
    starts = []
    for n in range(3, len(messages) + 1, 2):
        _, exchange = prepared(state, body(messages[:n]))
        starts.append(exchange.resume.start if exchange.resume is not None else None)
    assert starts == [0, 3, 5, 7] and len(Stateless.models) == 4


@pytest.mark.parametrize("pipeline", [[], ["stateless"], ["stateless", "metrics"]])
def test_a_chain_that_keeps_no_state_goes_on_from_the_previous_request(pipeline):
    """No plugin saves a state at any boundary (or none walks at all): every boundary is
    one to go on from, not none."""
    state = relay(pipeline=pipeline, extra={"stateless": Stateless})
    whole = relay(pipeline=pipeline, extra={"stateless": Stateless}, resume_bytes=0)
    messages = conversation(5)
    starts = []
    for n in range(3, len(messages) + 1, 2):
        raw = body(marked(messages[:n]))
        ours, exchange = prepared(state, raw)
        assert ours == prepared(whole, raw)[0] and exchange.upstream_body() == raw
        starts.append(exchange.resume.start if exchange.resume is not None else None)
    assert starts == [0, *range(2, len(messages) - 2, 2)]


@RUN
@given(sessions(), st.sampled_from([[], ["limits", "usage", "metrics"]]))
def test_a_chain_that_keeps_no_state_resumes_as_the_full_walk(session, pipeline):
    _, requests = session
    resuming, whole = relay(pipeline), relay(pipeline, resume_bytes=0)
    starts = []
    for raw in requests:
        ours, exchange = prepared(resuming, raw)
        assert ours == prepared(whole, raw)[0]
        starts.append(exchange.resume.start if exchange.resume is not None else 0)
    # From the third request on, each goes on from before the previous one's last message.
    assert len(requests) < 3 or any(starts[2:])


def test_a_plugin_that_does_not_opt_in_gets_every_request_whole():
    state = relay(pipeline=[*PIPELINE, "walker"], extra={"walker": Walker})
    assert state.resume is None
    messages = conversation(3)
    for n in range(3, len(messages) + 1, 2):
        _, exchange = prepared(state, body(messages[:n]))
        assert exchange.resume is None
    assert Walker.seen == [3, 5, 7]


def test_the_fields_around_the_messages_are_the_new_request_s():
    state, whole = relay(), relay(resume_bytes=0)
    messages = conversation(4)
    opened(state, body(messages, system="one"))
    raw = body(messages + [assistant(text("ok"))], system="two")  # after "messages"
    ours, exchange = prepared(state, raw)
    assert exchange.resume.start == len(messages) and ours == prepared(whole, raw)[0]
    assert orjson.loads(ours[0])["system"] == "two"
    state = relay()
    opened(state, orjson.dumps({"system": "one", "model": "claude-test",
                                "messages": messages}))
    raw = orjson.dumps({"system": "two", "model": "claude-test",
                        "messages": messages + [assistant(text("ok"))]})
    ours, exchange = prepared(state, raw)
    assert exchange.resume.start == 0 and ours == prepared(whole, raw)[0]


def test_a_record_holds_no_more_than_its_marks():
    record_state = relay()
    messages = conversation(3)
    prepared(record_state, body(messages))
    (record,) = record_state.resume.records.values()
    assert sorted(record.states) == list(range(len(messages) - resume.MARKS + 1,
                                               len(messages) + 1))


async def test_through_the_server_the_upstream_gets_what_the_full_walk_sends(relay_client):
    """A growing session with reused ids through two relays in front of the emulator, one
    resuming, one walking every request whole: the same bytes upstream, the same headers
    back."""
    pipeline = ["metrics", *PIPELINE]
    resuming = await relay_client(pipeline)
    whole = await relay_client(pipeline, server={"resume_bytes": 0})
    # Results large enough that the later requests are worth resuming (resume.MIN_BYTES).
    messages = conversation(12, reuse=True, size=5000)
    for n in range(3, len(messages) + 1, 2):
        answers = []
        for client in (resuming, whole):
            response = await client.post("/v1/messages", data=body(marked(messages[:n])),
                                         headers={**SESSION, "x-api-key": "test",
                                                  "anthropic-version": "2023-06-01"})
            assert response.status == 200, await response.text()
            answers.append({k: v for k, v in response.headers.items()
                            if k.startswith("x-relay-") and k != "x-relay-request-id"})
        assert answers[0] == answers[1]
    assert received(resuming) == received(whole)
    assert "x-relay-rewrites" in answers[0]  # the reused ids were rewritten all along
    from relay.server import STATE
    assert resuming.server.app[STATE].resume.records  # and the session went on from them
    assert whole.server.app[STATE].resume is None


def test_one_off_requests_take_the_room_left_and_never_a_session_s_record():
    """Every session's first request keeps a record, a trial: the one-off requests' records
    take the room the others leave, and when room is needed they go first, oldest out
    first; the record of the session that went on stays."""
    messages = conversation(4, size=2000)
    raw = body(marked(messages))
    probe = relay()
    prepared(probe, raw)
    (record,) = probe.resume.records.values()
    state = relay(resume_bytes=16 * record.size)
    store = state.resume
    going_on = prepared(state, body(marked(messages[:3])))[1]
    prepared(state, raw)
    assert going_on.resume.start == 0 and len(store.records) == 1 and not store.trials
    order = []  # the one-offs' sessions (their keys), as they came
    for n in range(40):
        prepared(state, raw, {"x-claude-code-session-id": f"one-off-{n}"})
        order.append(next(reversed(store.trials))[0])
        assert store.bytes <= store.budget
        assert sum(1 for key in store.records if key not in store.trials) == 1
    # Room for all but the session's record: the newest one-offs'.
    kept = [session for session, _ in store.trials]
    assert kept == order[-len(kept):] and len(kept) >= 14
    # The session that went on resumes as before; of the one-offs, the newest kept theirs.
    _, exchange = prepared(state, body(marked(messages + [assistant(text("ok")),
                                                       user(text("go on"))])))
    assert exchange.resume.start == len(messages) - 1
    for n, start in ((39, len(messages)), (40 - len(kept), len(messages)),
                     (39 - len(kept), 0), (0, 0)):
        _, exchange = prepared(state, raw, {"x-claude-code-session-id": f"one-off-{n}"})
        assert exchange.resume.start == start, n


def test_sessions_that_begin_at_once_each_keep_their_first_request_s_record():
    """Many sessions whose first requests arrive before any second one (agents started
    together, a relay restarted under them) each go on from their first request while
    their records fit the budget, whatever the share of any one of them."""
    messages = conversation(4, size=2000)
    probe = relay()
    prepared(probe, body(marked(messages)))
    (record,) = probe.resume.records.values()
    # Room for the ten sessions' records, a twentieth of it each: a trial's former share
    # was a quarter between them all.
    state = relay(resume_bytes=20 * record.size)
    sessions = [f"agent-{n}" for n in range(10)]
    for session in sessions:
        prepared(state, body(marked(messages)), {"x-claude-code-session-id": session})
    grown = body(marked(messages + [assistant(text("ok")), user(text("go on"))]))
    for session in sessions:
        _, exchange = prepared(state, grown, {"x-claude-code-session-id": session})
        # From before the message that held the marker, which moved.
        assert exchange.resume.start == len(messages) - 1, session
    assert not state.resume.trials and state.resume.bytes <= state.resume.budget


class Sized:
    """A stand-in for a record, of which the store reads the size and the first message (a
    conversation of its own: none)."""

    def __init__(self, size: int):
        self.size = size
        self.messages: list = []


def test_a_trial_with_no_room_left_is_not_kept_and_pushes_out_no_other_trial():
    store = resume.Store(104)  # a quarter: 26
    for session, size in (("a", 26), ("b", 26), ("c", 26), ("d", 10)):
        store.put(session, Sized(size))
    store.put("t1", Sized(8), trial=True)
    store.put("t2", Sized(8), trial=True)
    store.put("t3", Sized(20), trial=True)  # the other sessions leave 16: never kept
    assert [session for session, _ in store.records] == ["a", "b", "c", "d", "t1", "t2"]
    assert store.bytes == 104 and store.trial_bytes == 16
    store.put("t4", Sized(8), trial=True)  # room once the oldest trial goes
    assert [session for session, _ in store.trials] == ["t2", "t4"]
    assert store.bytes == 104 and store.trial_bytes == 16


def test_a_session_that_went_on_in_another_conversation_keeps_its_first_record():
    """A session's first record is a trial until the session sends more, in any of its
    conversations (Claude Code's subagents share its id): then one-offs push out neither."""
    store = resume.Store(100)
    store.put("S", Sized(20), trial=True)
    store.put("S", Sized(5))  # a second conversation of the session
    assert not store.trials and store.trial_bytes == 0
    for n in range(8):
        store.put(f"one-off-{n}", Sized(10), trial=True)
        assert len(store.lanes["S"]) == 2 and store.bytes <= store.budget
    assert store.trial_bytes == sum(store.records[key].size for key in store.trials) == 70


def test_a_small_request_is_walked_whole_without_bookkeeping():
    state = relay()
    state.resume.min_bytes = resume.MIN_BYTES
    messages = conversation(3)
    for _ in range(3):
        _, exchange = prepared(state, body(messages))
        assert exchange.resume is None
    assert not state.resume.records and not state.resume.seen


def test_a_request_without_messages_is_judged_as_before():
    state, whole = relay(), relay(resume_bytes=0)
    for raw in (body([]), body([]), body([user(text("hi"))])):
        assert prepared(state, raw)[0] == prepared(whole, raw)[0]


# Where the fields the cache fingerprint reads stand: before the messages, or after them.
AROUND = [{}, {"cache_control": {"type": "ephemeral", "ttl": "1h"}},
          {"tools": [{"name": "t", "input_schema": {"type": "object"},
                      "cache_control": {"type": "ephemeral"}}],
           "system": [{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}]},
          {"tool_choice": {"type": "auto"}, "speed": "fast"}]


def judged(state: Preparation, raw: bytes, extra_headers=None):
    """The cache plugin's account of ``raw`` (the fingerprints of what went up and of what
    the client sent, and the verdict against the session's previous request), as the
    answer asks for it."""
    _, exchange = prepared(state, raw, extra_headers)
    if exchange is None:
        return None, None
    plugin = state.chain.pm.get_plugin("cache")
    judgement = asyncio.run(plugin._judge(exchange))
    if judgement is None:
        return None, exchange
    asyncio.run(plugin._settle(exchange, judgement, None))
    cache = {k: v for k, v in judgement.cache.items() if k != "gap_seconds"}
    return (judgement.upstream, judgement.client, judgement.lane, cache), exchange


@RUN
@given(sessions(), st.sampled_from(AROUND), st.booleans(), st.booleans())
def test_the_cache_fingerprint_of_a_resumed_request_is_the_whole_body_s(session, around, first,
                                                                       unnamed):
    options, requests = session
    requests = [orjson.dumps({**around, **orjson.loads(raw)} if first
                             else {**orjson.loads(raw), **around}) for raw in requests]
    pipeline = ["cache", *PIPELINE]
    resuming = relay(pipeline, plugins=options)
    whole = relay(pipeline, plugins=options, resume_bytes=0)
    extra = UNNAMED if unnamed else None
    for raw in requests:
        ours, _ = judged(resuming, raw, extra)
        assert ours == judged(whole, raw, extra)[0]


def test_a_session_without_an_id_is_found_by_its_bytes_without_decoding_them_whole(monkeypatch):
    """A client that sends no session id (the SDKs) has its session worked out from the
    content (relay.sessions), which takes decoding the whole body: its next request is
    matched against the records of such sessions by its bytes instead, and goes on from
    its own record under the same key."""
    # A first message longer than the bytes a request is looked up by (resume.HEAD_BYTES).
    messages = [user(text("Refactor the relay. " * 40)), *conversation(6, size=2000)[1:]]
    state, whole = relay(), relay(resume_bytes=0)
    requests = [body(messages[:n], system="be brief") for n in range(2, len(messages) + 1)]
    _, first = prepared(state, requests[0], UNNAMED)
    decoded = found_by_each_call(monkeypatch, session_rule, "session_of")
    for raw in requests[1:]:
        _, exchange = prepared(state, raw, UNNAMED)
        _, walked = prepared(whole, raw, UNNAMED)
        assert exchange.resume.start > 0
        assert exchange.session() == walked.session() == first.session()
    assert decoded == []
    # The same first bytes with other fields after the messages: another session's key,
    # which the record's bytes cannot stand for.
    other = body(messages, system="be verbose")
    _, exchange = prepared(state, other, UNNAMED)
    _, walked = prepared(whole, other, UNNAMED)
    assert exchange.resume.start == 0 and decoded == [True]
    assert exchange.session() == walked.session() != first.session()
    # A session id of its own: never taken for one without.
    _, exchange = prepared(state, requests[-1], {"x-claude-code-session-id": "s-2"})
    assert exchange.resume.start == 0
    # Only sessions with a record are looked up by their bytes, the newest few of those
    # that began alike.
    store = state.resume
    for n in range(2 * resume.HEAD_SESSIONS):
        prepared(state, body(messages[:3], system=f"variant {n}"), UNNAMED)
    assert store.head_of and set(store.head_of) <= set(store.lanes)
    assert sum(map(len, store.unnamed.values())) == len(store.head_of)
    assert max(map(len, store.unnamed.values())) == resume.HEAD_SESSIONS
    _, exchange = prepared(state, body(messages[:5], system="variant 15"), UNNAMED)
    assert exchange.resume.start == 3


def test_a_breakpoint_after_a_turn_without_one_is_found_where_only_the_new_bytes_are_read():
    """A request without a breakpoint leaves the next one to search only the bytes after
    the part they share: a breakpoint in the new turn, or in a field after the messages,
    is found all the same."""
    messages = conversation(6, size=2000)
    system = [{"type": "text", "text": "be brief"}]
    marked_system = [{**system[0], "cache_control": {"type": "ephemeral"}}]
    requests = [body(messages[:3], system=system), body(messages[:5], system=system),
                body(marked(messages[:7]), system=system), body(messages[:9], system=system),
                body(messages[:11], system=marked_system)]
    pipeline = ["cache", *PIPELINE]
    resuming, whole = relay(pipeline), relay(pipeline, resume_bytes=0)
    for n, raw in enumerate(requests):
        ours, exchange = judged(resuming, raw)
        assert ours == judged(whole, raw)[0]
        assert (ours is None) == (n in (0, 1, 3))
        assert (exchange.resume.start > 0) == (n > 0)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=120), st.lists(st.integers(0, 120), max_size=3),
       st.integers(0, 130), st.integers(1, 40))
# A key that starts one byte before where the tail begins, and one that ends there.
@example(b"x" * 40, [34], 0, 20)
@example(b"x" * 40, [21], 0, 20)
def test_a_breakpoint_is_found_wherever_it_lies_against_the_searched_tail(filler, at, start,
                                                                          tail):
    """The cache plugin looks for a breakpoint in the body's tail first, then forward
    through the rest: a key anywhere at or after where the search starts is found, one
    straddling the tail's edge too, and one before it is not."""
    from relay_builtins import cache as plugin

    raw = filler
    for n in sorted(at, reverse=True):
        raw = raw[:n] + plugin._KEY + raw[n:]
    kept, plugin._TAIL = plugin._TAIL, tail
    try:
        assert plugin._marked(raw, start) == (plugin._KEY in raw[start:])
    finally:
        plugin._TAIL = kept


def found_by_each_call(monkeypatch, module, name: str) -> list[bool]:
    """Whether each call of ``module.name`` from now on returned something (not None)."""
    found_by: list[bool] = []
    original = getattr(module, name)

    def counted(*args):
        found = original(*args)
        found_by.append(found is not None)
        return found

    monkeypatch.setattr(module, name, counted)
    return found_by


def test_a_resumed_request_s_fingerprint_is_taken_from_the_previous_one(monkeypatch):
    from relay import cache as fingerprints
    taken = found_by_each_call(monkeypatch, fingerprints, "resumed")
    pipeline = ["cache", *PIPELINE]
    state, whole = relay(pipeline), relay(pipeline, resume_bytes=0)
    messages = conversation(12)
    for n in range(3, len(messages) + 1, 2):
        raw = body(marked(messages[:n]), cache_control={"type": "ephemeral"})
        ours, exchange = judged(state, raw)
        assert ours == judged(whole, raw)[0]
        assert ours[0] == fingerprints.fingerprint(raw)
    # From the second request on (the first is walked whole, and its record kept).
    assert taken == [True] * (len(range(3, len(messages) + 1, 2)) - 1)


@pytest.mark.parametrize("around", AROUND)
@pytest.mark.parametrize("first", [True, False])
def test_a_resumed_request_around_the_same_fields_reads_only_its_new_messages(
        monkeypatch, around, first):
    """When the bytes after the messages are the previous request's too (the fields around
    the messages before or after them), the fingerprint takes every part but the new
    messages' from the previous one, and is still the whole body's."""
    from relay import cache as fingerprints
    grown = found_by_each_call(monkeypatch, fingerprints, "_grown")
    pipeline = ["cache", *PIPELINE]
    state, whole = relay(pipeline), relay(pipeline, resume_bytes=0)
    messages = conversation(12)
    for n in range(3, len(messages) + 1, 2):
        request = orjson.loads(body(marked(messages[:n])))
        raw = orjson.dumps({**around, **request} if first else {**request, **around})
        ours, _ = judged(state, raw)
        assert ours == judged(whole, raw)[0]
        assert ours[0] == fingerprints.fingerprint(raw)
    assert grown == [True] * (len(range(3, len(messages) + 1, 2)) - 1)
    # Fields after the messages that changed: the whole rest of the body is read again.
    grown.clear()
    for n, system in ((3, "one"), (5, "one"), (7, "two")):
        raw = body(marked(messages[:n]), system=system)
        ours, _ = judged(state, raw)
        assert ours == judged(whole, raw)[0]
    assert grown == [True]


def _held_by_records(state, requests):
    """What the session's record keeps alive after ``requests`` (by tracemalloc), and the
    size the byte budget counts for it."""
    import gc
    import tracemalloc
    tracemalloc.start()
    try:
        for raw in requests:
            prepared(state, bytes(bytearray(raw)))  # a body of its own, as a server reads it
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
        (record,) = state.resume.records.values()
        size, base = record.size, record.cut < len(record.raw)
        del record
        state.resume.records.clear()
        gc.collect()
        return held - tracemalloc.get_traced_memory()[0], size, base
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("first", [3, 51])
def test_a_record_counts_what_it_holds_and_holds_a_long_history_once(first):
    """The messages before a boundary keep the body they were first decoded from (and each
    request's new turn): a record's size, what the byte budget counts, covers all it keeps
    alive; and when the record started from a long history (a session the relay first sees
    far into it), it keeps that body and a copy of what followed, not a second copy of the
    whole."""
    messages = conversation(30, size=20000)
    requests = [body(marked(messages[:n])) for n in range(first, len(messages) + 1, 2)]
    freed, size, base = _held_by_records(relay(), requests)
    assert freed <= 1.1 * size
    if first > 3:
        assert base and freed < 1.5 * len(requests[-1])


def test_a_long_history_s_record_extends_the_copy_of_what_followed_it():
    """A session first seen far into it: each record holds the first body and a copy of
    what followed it, which the next record takes over and extends by what is new rather
    than copying it again whole; the record's bytes are always its request's, and each
    request comes out as the full walk makes it."""
    messages = conversation(30, size=2000)
    state, whole = relay(), relay(resume_bytes=0)
    tails = []
    for n in range(41, len(messages) + 1, 2):
        raw = body(marked(messages[:n]))
        assert prepared(state, raw)[0] == prepared(whole, raw)[0]
        if not state.resume.records:
            continue  # a session's first request keeps nothing
        (record,) = state.resume.records.values()
        assert bytes(record.raw[:record.cut]) + bytes(record.tail) == raw
        tails.append(record.tail)
        del record
    # The record of the full walk holds its whole body, the first resumed one a copy of what
    # follows the boundary; from there on, each takes over its predecessor's copy.
    assert len(tails) >= 5 and tails[0] == b""
    assert all(tail is tails[1] for tail in tails[2:])


def grown_to_13(messages: list):
    """A resuming relay and a walking one given the session up to its 9th, 11th and 13th
    message (each alike), and the resuming one's record."""
    state, whole = relay(), relay(resume_bytes=0)
    for n in (9, 11, 13):
        raw = body(marked(messages[:n]))
        assert prepared(state, raw)[0] == prepared(whole, raw)[0]
    (record,) = state.resume.records.values()
    return state, whole, record


def test_dedup_s_states_past_a_user_message_share_its_ledger():
    """Past a user message (tool results only) the ledger is as it was: the record's state
    after it shares the copy made at the mark before it, and the session's next request,
    resumed there, still comes out as the full walk makes it."""
    messages = conversation(6, reuse=True)
    state, whole, record = grown_to_13(messages)
    count = record.count  # the last message a user's, the one before an assistant's
    states = {index: record.states[index]["dedup"][0] for index in (count - 2, count - 1, count)}
    assert states[count][0] is states[count - 1][0] and states[count][1] is states[count - 1][1]
    assert states[count - 1][0] is not states[count - 2][0]
    # Every result answers a call of the history: none is kept apart for the answer's ledger.
    assert states[count][0] == states[count - 1][0] and states[count][3] == set()
    del record, states
    raw = body(marked(messages[:13]) + [assistant(use("toolu_0"))] + [user(result("toolu_0", "x"))])
    assert prepared(state, raw)[0] == prepared(whole, raw)[0]


def test_pairing_s_states_past_the_last_call_share_its_ids():
    """Past the last assistant message no id joins the ones pairing has seen: the marks
    there keep the walk's own set (a record's states are used once), those before it a
    copy; and the next request, resumed from either, comes out as the full walk makes it."""
    messages = conversation(6)
    for then in ([assistant(use("toolu_9"))] + [user(result("toolu_9", "x"))],
                 [user(text("and then?"))]):
        state, whole, record = grown_to_13(messages)
        count = record.count  # the last message a user's, the one before an assistant's
        seen = {index: record.states[index]["pairing"][0][0]
                for index in (count - 2, count - 1, count)}
        assert seen[count] is seen[count - 1] and seen[count - 1] is not seen[count - 2]
        assert seen[count - 2] < seen[count - 1]
        del record, seen
        raw = body(marked(messages[:13]) + then)
        assert prepared(state, raw)[0] == prepared(whole, raw)[0]


def test_with_thinking_on_the_final_tool_turn_is_looked_for_back_to_the_new_turn_only(
        monkeypatch):
    """A long tool loop with thinking on: each resumed request looks for its final assistant
    turn (the whole loop, back to the last question) only over its new messages, from the
    loop's reach the previous request found, and comes out as the full walk makes it; a
    question that opens a turn without thinking is found the same way (and repaired)."""
    visited = []
    looked = portable._loop_step
    monkeypatch.setattr(portable, "_loop_step",
                        lambda messages, index: visited.append(1) or looked(messages, index))
    thinking = {"thinking": {"type": "enabled", "budget_tokens": 1024}}
    messages = [user(text("start"))]
    for n in range(12):
        messages += [assistant({"type": "thinking", "thinking": "hm", "signature": "sig-ours"},
                               use(f"toolu_{n}")), user(result(f"toolu_{n}", "done"))]
    asked = messages + [assistant(text("done")), user(text("and now?")),
                        assistant(use("toolu_x")), user(result("toolu_x", "ok"))]
    state, whole = relay(), relay(resume_bytes=0)
    walked, walked_whole = [], []
    for history in [messages[:n] for n in range(3, len(messages) + 1, 2)] + [asked]:
        raw = body(marked(history), **thinking)
        visited.clear()
        ours, exchange = prepared(state, raw)
        walked.append(len(visited))
        visited.clear()
        assert ours == prepared(whole, raw)[0]
        walked_whole.append(len(visited))
    assert exchange.repaired_by and exchange.repaired_by[0].rule == "thinking-off"
    # The first two requests are walked whole; from the third on only the new turn is.
    assert walked_whole[-2] > 20
    assert max(walked[2:]) <= 8, (walked, walked_whole)


UNSIGNED = object()  # learnt: that backend's model issued unsigned thinking


def _thinking_turns(signatures: list[str]) -> list:
    messages = [user(text("start"))]
    for n, signature in enumerate(signatures):
        messages += [assistant({"type": "thinking", "thinking": "hm", "signature": signature},
                               use(f"toolu_{n}")), user(result(f"toolu_{n}", "done"))]
    return messages


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(["sig-a", "sig-b", "sig-c", FOREIGN, ""]), min_size=2,
                max_size=8),
       st.lists(st.tuples(st.sampled_from(["sig-a", "sig-b", "sig-c", "sig-d", UNSIGNED]),
                          st.sampled_from([("emu", "claude-test"), ("other", "other-model")])),
                max_size=8),
       st.booleans())
def test_earlier_thinking_judged_again_only_where_the_record_may_say_otherwise(
        signatures, learnt, small):
    """A thinking session whose provenance record changes between requests (issuers learnt
    for blocks already sent, issuers changed, the memory too small to keep them all, a
    backend seen issuing unsigned thinking): each resumed request, which judges again only
    the earlier blocks whose verdict may have changed, comes out as the full walk makes it."""
    state, whole = relay(), relay(resume_bytes=0)
    records = [relay_state.chain.pm.get_plugin("portable").provenance
               for relay_state in (state, whole)]
    if small:
        for provenance in records:
            provenance.memory_rows = 2
    messages = _thinking_turns(signatures)
    thinking = {"thinking": {"type": "enabled", "budget_tokens": 1024}}
    for step, n in enumerate(range(3, len(messages) + 1, 2)):
        raw = body(marked(messages[:n]), **thinking)
        assert prepared(state, raw)[0] == prepared(whole, raw)[0]
        if step < len(learnt):
            signature, (backend, model) = learnt[step]
            keys = portable.unsigned_markers(backend, model) if signature is UNSIGNED else [
                portable.block_key({"type": "thinking", "signature": signature})]
            for provenance in records:
                provenance.record([(key, backend, model) for key in keys])


def test_a_resumed_thinking_request_judges_only_its_new_blocks(monkeypatch):
    """Nothing learnt or forgotten since: the earlier blocks keep their verdicts and only the
    new turn's are judged; an issuer learnt for an earlier block of unknown issuer has that
    block judged again (and dropped, as the full walk does)."""
    judged = []
    real = portable.verdict
    monkeypatch.setattr(portable, "verdict", lambda key, *rest: judged.append(key)
                        or real(key, *rest))
    state, whole = relay(), relay(resume_bytes=0)
    messages = _thinking_turns([f"sig-{n}" for n in range(10)])
    thinking = {"thinking": {"type": "enabled", "budget_tokens": 1024}}
    counts = []
    for n in range(3, len(messages) + 1, 2):
        raw = body(marked(messages[:n]), **thinking)
        judged.clear()
        ours = prepared(state, raw)[0]
        counts.append(len(judged))
        assert ours == prepared(whole, raw)[0]
    # One new thinking block a request, the first's the only one it holds.
    assert set(counts) == {1}, counts
    key = portable.block_key({"type": "thinking", "signature": "sig-3"})
    for relay_state in (state, whole):
        relay_state.chain.pm.get_plugin("portable").provenance.record(
            [(key, "other", "other-model")])
    raw = body(marked(messages + [assistant(text("and?"))] + [user(text("go on"))]),
               **thinking)
    judged.clear()
    ours, exchange = prepared(state, raw)
    assert ours == prepared(whole, raw)[0]
    assert exchange.repaired_by[0].rule == "foreign-thinking"


def test_a_result_without_its_call_stays_in_the_answer_s_ledger_when_resumed():
    """dedup keeps apart only the results whose call the history does not hold (the others'
    ids are the calls'): a resumed request's ledger for the answer holds them as the full
    walk's does, and a later call with that id goes up as the full walk sends it."""
    messages = conversation(4) + [assistant(use("toolu_7"))] \
        + [user(result("toolu_7", "ok"), result("toolu_lost", "orphan"))]
    # dedup alone: pairing would refuse the result without its call, as the API does.
    state, whole = relay(["dedup"]), relay(["dedup"], resume_bytes=0)
    later = messages + [assistant(use("toolu_lost"))] + [user(result("toolu_lost", "x"))]
    for raw in [body(marked(conversation(4)[:n])) for n in (5, 7, 9)] + \
            [body(marked(messages)), body(marked(later))]:
        ours, exchange = prepared(state, raw)
        assert ours == prepared(whole, raw)[0]
    assert exchange.resume.start and "toolu_lost" in ours[8][0]


def test_a_request_back_at_a_turn_before_every_change_goes_up_as_the_client_sent_it():
    """The previous request had its ids translated (another provider's, outside Anthropic's
    grammar) in its last message; the next one goes back to the turn before that message:
    resumed from a boundary before every change, it holds the client's messages as they
    came, and goes up as the client's bytes, as the full walk sends it (it went up
    re-encoded, its fields in another order)."""
    first = [user(text("start"))]
    called = first + [assistant(use("fn.tool:1"), use("fn.tool:2"))]
    state, whole = relay(["portable"]), relay(["portable"], resume_bytes=0)
    for history in (first, called, first):
        raw = body(history)
        ours, exchange = prepared(state, raw)
        assert ours == prepared(whole, raw)[0]
    assert exchange.resume.start == 1
    assert ours[0] == raw


@st.composite
def wandering_sessions(draw):
    """A session whose requests go back to earlier turns and fork: each request one of the
    conversation's prefixes, in any order, some with their last message edited."""
    options, requests = draw(sessions())
    picked = draw(st.lists(st.integers(0, len(requests) - 1), min_size=2, max_size=8))
    chosen = []
    for n in picked:
        raw = requests[n]
        if draw(st.booleans()):  # a fork: the last message's text or thinking otherwise
            raw = raw.replace(b'"hm"', b'"mh"').replace(b'"ok"', b'"ko"')
        chosen.append(raw)
    return options, chosen


@RUN
@given(wandering_sessions())
def test_a_session_that_goes_back_and_forks_is_resumed_as_the_full_walk(session):
    resumed_as_whole(session)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(["sig-a", "sig-b", "sig-c", FOREIGN, ""]), min_size=2,
                max_size=6),
       st.lists(st.tuples(st.sampled_from(["sig-a", "sig-b", "sig-d", UNSIGNED]),
                          st.sampled_from([("emu", "claude-test"), ("other", "other-model")])),
                max_size=6),
       st.sampled_from([1, 2, 100]))
def test_earlier_thinking_judged_against_a_record_on_disk_as_the_full_walk(
        signatures, learnt, rows):
    """The record in a file, its memory in front too small to hold every issuer: the blocks
    it forgot are read from the file (the asynchronous lookup), and each resumed request, which
    judges again only the earlier blocks of unknown issuer, comes out as the full walk makes
    it."""
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        relays = [relay(plugins={"portable": {"provenance_db": f"{directory}/{n}.db"}},
                        resume_bytes=budget) for n, budget in enumerate((64 * 1024 * 1024, 0))]
        records = [each.chain.pm.get_plugin("portable").provenance for each in relays]
        read = []
        for provenance in records:
            provenance.memory_rows = rows
            provenance.flush(5)
            looked = provenance.lookup
            provenance.lookup = lambda keys, looked=looked: read.append(1) or looked(keys)
        # A block no record knows: every request has the file read.
        messages = _thinking_turns(["sig-nobody", *signatures])
        thinking = {"thinking": {"type": "enabled", "budget_tokens": 1024}}
        try:
            for step, n in enumerate(range(3, len(messages) + 1, 2)):
                raw = body(marked(messages[:n]), **thinking)
                assert prepared(relays[0], raw)[0] == prepared(relays[1], raw)[0]
                if step < len(learnt):
                    signature, (backend, model) = learnt[step]
                    keys = portable.unsigned_markers(backend, model) if signature is UNSIGNED \
                        else [portable.block_key({"type": "thinking", "signature": signature})]
                    for provenance in records:
                        provenance.record([(key, backend, model) for key in keys])
                        provenance.flush(5)  # in the file before the next request reads it
        finally:
            for provenance in records:
                provenance.close(1)
        assert read


# --- bodies whose bytes a prefix comparison could misread (each found by a fuzzer) ---------

def _loose(message) -> bytes:
    """A message written with a space after ``"role":``: valid, not the relay's form."""
    return orjson.dumps(message).replace(b'"role":', b'"role": ', 1)


def _messages_twice(messages) -> bytes:
    return (b'{"messages":[' + orjson.dumps(user(text("x"))) + b'],"max_tokens":64,'
            b'"system":"be brief","messages":[' + b",".join(map(orjson.dumps, messages))
            + b'],"model":"claude-test"}')


def _decoy(copies) -> bytes:
    first, call, answer = user(text("start")), assistant(text("looking"), use("toolu_1")), \
        user(result("toolu_1"))
    return (b'{"model":"claude-test","max_tokens":64,"messages":[' + orjson.dumps(first) + b","
            + _loose(call) + b"," + _loose(answer) + b'],"stop_sequences":[0,'
            + b",".join(map(orjson.dumps, copies)) + b"]}")


_TURN = [user(text("start")), assistant(text("looking"), use("toolu_1"))]
_CALL, _ANSWER = assistant(text("looking"), use("toolu_1")), user(result("toolu_1"))
_THREE = [user(text("start")), assistant(text("looking"), use("fn.tool:1")),
          user(result("fn.tool:1"))]


@pytest.mark.parametrize("requests", [
    # A trailing comma after the boundary: not JSON, refused by the full decode.
    [body([user(text("start")), assistant(text("ok"))]),
     body([user(text("start")), assistant(text("ok"))])[:-2] + b",]}"],
    [body([user(text("start")), assistant(text("ok"))]),
     body([user(text("start")), assistant(text("ok"))])[:-2] + b", ]}"],
    # "messages" again after the array, plain or escaped: the full decode keeps the last.
    [body(_TURN), body(_TURN)[:-1] + b',"messages":[' + orjson.dumps(user(text("new"))) + b"]}"],
    [body(_TURN), body(_TURN)[:-1] + b',"m\\u0065ssages":[' + orjson.dumps(user(text("new")))
     + b"]}"],
    # "messages" twice with fields between: the second array, and every field, count.
    [_messages_twice(_THREE), _messages_twice([*_THREE, assistant(text("done"))])],
    # The last messages' bytes in a later field, the messages themselves in another form.
    [_decoy([_CALL, _ANSWER]), _decoy([_CALL, _ANSWER, assistant(use("toolu_9"))])],
], ids=["comma", "comma-space", "messages-again", "messages-escaped", "messages-twice",
        "decoy"])
def test_bodies_a_prefix_comparison_could_misread_go_as_the_full_walk_sends_them(requests):
    resuming, whole = relay(), relay(resume_bytes=0)
    for raw in requests:
        assert prepared(resuming, raw)[0] == prepared(whole, raw)[0]


def test_a_request_without_a_session_id_that_adds_a_field_after_its_messages_is_keyed_anew():
    """Its bytes end as the previous request's did ("]}", a tools array now), but what follows
    its messages is not the record's: the session rule, which reads the tools, decides."""
    unnamed = {"x-claude-code-session-id": ""}
    history = [user(text("Refactor the relay. " * 40)), assistant(text("ok"))]
    first = body(marked(history))
    second = orjson.dumps({"model": "claude-test", "max_tokens": 64,
                           "messages": marked([*history, user(text("go on"))]),
                           "tools": [{"name": "t", "input_schema": {"type": "object"}}]})
    pipeline = ["cache", *PIPELINE]
    resuming, whole = relay(pipeline), relay(pipeline, resume_bytes=0)
    for raw in (first, second):
        (found, resumed), (expected, walked) = judged(resuming, raw, unnamed), \
            judged(whole, raw, unnamed)
        assert found == expected
        assert resumed.session() == walked.session()


def test_a_request_without_messages_has_no_session_whether_resuming_or_not():
    raw = orjson.dumps({"model": "claude-test", "max_tokens": 64, "messages": [],
                        "system": [{"type": "text", "text": "be brief",
                                    "cache_control": {"type": "ephemeral"}}]})
    pipeline = ["cache", *PIPELINE]
    resuming, whole = relay(pipeline), relay(pipeline, resume_bytes=0)
    for _ in range(2):
        (found, resumed), (expected, walked) = judged(resuming, raw), judged(whole, raw)
        assert found == expected and resumed.session() is walked.session() is None


def test_a_repaired_first_message_keeps_the_request_in_the_clients_session():
    """Without a session header the key is a fingerprint of the first message: the client's,
    whether the request is resumed (keyed before the chain runs) or walked whole (keyed when
    a plugin first asks, after portable dropped a foreign thinking block from it)."""
    raw = orjson.dumps({"model": "claude-test", "max_tokens": 64, "messages": [
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hm", "signature": FOREIGN},
            {"type": "text", "text": "hello"}]},
        user(text("go"))]})
    client = session_rule.session_of(raw, {}, None)[0]
    for state in (relay(), relay(resume_bytes=0)):
        _, exchange = prepared(state, raw, UNNAMED)
        assert exchange.repairs == 1
        assert exchange.session() == client is not None


@pytest.mark.parametrize("raw", [
    # Broken UTF-8 in a field the skeleton keeps raw: the relay cannot read it and forwards it
    # for the backend to judge, resuming or not (portable read it while resuming: a 500).
    b'{"model":"claude-test","max_tokens":64,"messages":[{"role":"user","content":"hi"}],'
    b'"thinking":{"type":"enabled","budget_t\xffokens":1024}}',
    b'{"model":"claude-test","max_tokens":64,"messages":[{"role":"user","content":[{"type":'
    b'"text","text":"hi"}]}],"thinking":{"type":"enabled","budget_t\xffokens":1024}}',
])
def test_a_field_the_relay_cannot_read_goes_up_as_it_came(raw):
    resuming, whole = relay(), relay(resume_bytes=0)
    assert prepared(resuming, raw)[0] == prepared(whole, raw)[0]
    assert prepared(whole, raw)[0][0] == raw


def test_broken_utf8_a_plugin_must_read_is_a_400_in_the_apis_words(caplog):
    """A thinking block's signature the portable plugin must judge: the API refuses a body
    that does not parse with 400 invalid_request_error ("The request body is not valid JSON"),
    the client's error, logged as no fault of the plugin's."""
    raw = (b'{"model":"claude-test","max_tokens":64,"messages":[{"role":"user","content":"hi"},'
           b'{"role":"assistant","content":[{"type":"thinking","thinking":"hm","signature":'
           b'"s\xff"},{"type":"text","text":"ok"}]},{"role":"user","content":"go"}],'
           b'"thinking":{"type":"enabled","budget_tokens":1024}}')
    for state in (relay(), relay(resume_bytes=0)):
        found = prepared(state, raw)[0]
        assert found[:2] == ("refused", 400)
        assert found[2].startswith("The request body is not valid JSON: ")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
