"""Property tests over generated histories, with none, one or several faults (and shapes the
evidence does not settle, which the relay forwards with a note and the emulator accepts).

- The relay's verdict (pairing and ordering, as the pipeline runs them) agrees with the
  emulator's, which keeps its own copy of each rule; with one kind of fault, the emulator's
  words are among the relay's.
- A history the relay repairs is accepted by the emulator; no repair claims a success (an
  added result is an ``is_error`` saying no result was recorded) or invents an id; no block the
  client sent is lost.
- A history the emulator accepts is forwarded byte for byte (a tool turn split over consecutive
  messages is merged only with ``merge_consecutive``, and counted).
- The quick walks never hide what the full walks find.
"""

from __future__ import annotations

from unittest import mock

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from relay_builtins import ordering, pairing
from support import assistant, exchange_for, request, result, text, use, user

from relay.errors import RelayError
from relay.testing.emulator import EmulatorOptions, find_problem

FAULTS = ("drop_result", "wrong_id", "duplicate_result", "text_first", "text_after_call",
          "system_between", "empty_message", "use_in_user", "advisor_alone", "reuse_id",
          # not faults as far as the evidence goes: forwarded, with a note
          "trailing_call", "system_first", "programmatic_extra")
SYSTEM = {"role": "system", "content": "a reminder"}
RUN = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def histories(draw):
    """``(messages, faults)``: a conversation of tool turns, some split over consecutive
    messages, with system entries where Claude Code puts them, then up to three faults."""
    messages = [user(text("start"))]
    counter = 0
    for _ in range(draw(st.integers(0, 4))):
        if draw(st.booleans()):
            messages.append(dict(SYSTEM))
        ids = []
        for _ in range(draw(st.integers(0, 3))):
            counter += 1
            ids.append(f"toolu_{counter:04d}")
        calls = [use(i) for i in ids]
        opening = [text("let me look")] if draw(st.booleans()) or not calls else []
        if calls and opening and draw(st.booleans()):
            messages += [assistant(*opening), assistant(*calls)]  # the text in a message of its own
        elif len(calls) > 1 and draw(st.booleans()):
            # calls split, sometimes around a system entry (which a merge must not swallow)
            between = [dict(SYSTEM)] if draw(st.booleans()) else []
            messages += [assistant(*opening, calls[0]), *between, assistant(*calls[1:])]
        else:
            messages.append(assistant(*opening, *calls))
        if not ids:
            messages.append(user(text("go on")))
            continue
        answers = [result(i) for i in draw(st.permutations(ids))]
        if len(answers) > 1 and draw(st.booleans()):
            messages += [user(answers[0]), user(*answers[1:], text("go on"))]  # results split
        else:
            messages.append(user(*answers, text("go on")))
    faults = []
    for _ in range(draw(st.integers(0, 3))):
        fault = draw(st.sampled_from(FAULTS))
        if _inject(draw, messages, fault):
            faults.append(fault)
    return messages, faults


def _where(messages, role, kind):
    return [i for i, m in enumerate(messages) if m["role"] == role
            and any(b["type"] == kind for b in m["content"])]


def _inject(draw, messages, fault) -> bool:
    answering = _where(messages, "user", "tool_result")
    calling = _where(messages, "assistant", "tool_use")
    if fault == "trailing_call":
        messages.append(assistant(text("one more"), use("toolu_8888")))
        return True
    if fault == "system_first":
        messages.insert(0, dict(SYSTEM))  # before a user message: refused; else only noted
        return True
    if fault == "programmatic_extra":
        if not calling or calling[-1] + 1 >= len(messages) \
                or messages[calling[-1] + 1]["role"] != "user":
            return False
        block = next(b for b in messages[calling[-1]]["content"] if b["type"] == "tool_use")
        block["caller"] = {"type": "code_execution_20250825", "tool_id": "srvtoolu_9"}
        messages[calling[-1] + 1]["content"].append(text("and this"))
        return True
    if fault == "empty_message":
        at = draw(st.integers(0, len(messages) - 1))
        if messages[at]["role"] == "system" or at == len(messages) - 1:
            return False
        messages[at]["content"] = []
        return True
    if fault == "use_in_user":
        at = draw(st.sampled_from([i for i, m in enumerate(messages) if m["role"] == "user"]))
        messages[at]["content"].append(use("toolu_9999"))
        return True
    if fault == "advisor_alone":
        messages.insert(1, assistant(text("asking"), {"type": "advisor_tool_result",
                                                      "tool_use_id": "srvtoolu_x", "content": {}}))
        messages.insert(2, user(text("ok")))
        return True
    if fault == "reuse_id":
        if not calling:
            return False
        first = next(b["id"] for b in messages[calling[0]]["content"] if b["type"] == "tool_use")
        messages += [assistant(use(first)), user(result(first))]
        return True
    if fault in ("text_after_call", "system_between"):
        if not calling:
            return False
        at = draw(st.sampled_from(calling))
        if fault == "text_after_call":
            messages[at]["content"].append(text("and then"))
        elif at + 1 < len(messages) and messages[at + 1]["role"] == "user":
            messages.insert(at + 1, dict(SYSTEM))
        else:
            return False
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
    return True


def relay_problems(messages) -> list[str]:
    return ([p.message for p in pairing.check(messages)[0]]
            + [p.message for p in ordering.check(messages)[0]])


def emulator_verdict(messages):
    return find_problem(request(*messages), EmulatorOptions())


@RUN
@given(histories())
def test_the_relay_and_the_emulator_agree(history):
    messages, faults = history
    ours = relay_problems(messages)
    theirs = emulator_verdict(messages)
    assert bool(ours) == (theirs is not None), (ours, theirs, faults)
    if theirs is not None and len(set(faults)) == 1:
        assert theirs in ours, (theirs, ours)


def _blocks(body) -> list[bytes]:
    return [orjson.dumps(b) for m in body["messages"] if isinstance(m["content"], list)
            for b in m["content"]]


@RUN
@given(histories())
def test_repair_is_honest_and_leaves_a_history_the_emulator_accepts(history):
    messages, _ = history
    original = request(*messages)
    exchange = exchange_for(orjson.loads(orjson.dumps(original)))
    try:
        pairing.relay_request(exchange, {"pairing_mode": "repair"})
        ordering.relay_request(exchange, {"ordering_mode": "repair"})
    except RelayError as e:
        # Refused even in repair mode: only what the API refuses too.
        assert emulator_verdict(messages) is not None, e.message
        return
    repaired = exchange.body
    assert find_problem(repaired, EmulatorOptions()) is None
    calls = {b["id"] for m in original["messages"] if isinstance(m["content"], list)
             for b in m["content"] if b["type"] == "tool_use"}
    before = _blocks(original)
    after = _blocks(repaired)
    for block in after:
        if block not in before:  # added by the repair: an honest failure for a real call
            added = orjson.loads(block)
            assert added["type"] == "tool_result" and added["is_error"] is True
            assert added["content"] == pairing.NO_RESULT_RECORDED
            assert added["tool_use_id"] in calls
    for block in before:
        assert before.count(block) <= after.count(block)  # nothing the client sent is lost
    if exchange.repairs == 0:
        assert exchange.upstream_body() == orjson.dumps(original)


@RUN
@given(histories())
def test_a_history_the_emulator_accepts_goes_up_byte_for_byte(history):
    messages, _ = history
    if emulator_verdict(messages) is not None:
        return
    raw = orjson.dumps(request(*messages))
    exchange = exchange_for(orjson.loads(raw))
    options = {"merge_consecutive": False}
    pairing.relay_request(exchange, options)
    ordering.relay_request(exchange, options)
    assert exchange.upstream_body() == raw and exchange.repairs == 0
    # With the merge on, the only change is the merge, counted.
    exchange = exchange_for(orjson.loads(raw))
    pairing.relay_request(exchange, {})
    ordering.relay_request(exchange, {})
    spans = pairing.split_tool_turns(orjson.loads(raw)["messages"])
    assert exchange.repairs == sum(last - first for first, last in spans)
    if not spans:
        assert exchange.upstream_body() == raw
    sent = orjson.loads(exchange.upstream_body())["messages"]
    assert [m for m in sent if m["role"] == "system"] == [
        m for m in messages if m["role"] == "system"]  # a merge keeps every system entry


@RUN
@given(histories())
def test_the_quick_walks_never_hide_a_problem(history):
    messages, _ = history
    with mock.patch.object(pairing, "_clean", return_value=False):
        slow = pairing.check(messages)
    with mock.patch.object(ordering, "_clean", return_value=False):
        slow_order = ordering.check(messages)
    assert pairing.check(messages) == slow
    assert ordering.check(messages) == slow_order


JSON = st.recursive(st.none() | st.booleans() | st.integers(-1000, 1000) | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.sampled_from(["type", "id", "tool_use_id", "text", "x"]),
                                      inner, max_size=3), max_leaves=12)
KINDS = st.sampled_from(["text", "tool_use", "tool_result", "server_tool_use",
                         "advisor_tool_result", "web_search_tool_result", "thinking"])
BLOCK = st.fixed_dictionaries({"type": KINDS | JSON},
                              optional={"id": st.sampled_from(["toolu_a", "srvtoolu_a"]) | JSON,
                                        "tool_use_id": st.sampled_from(["toolu_a", "srvtoolu_a"]) | JSON,
                                        "caller": JSON, "text": st.text(max_size=3)})
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]) | JSON},
                                optional={"content": st.lists(BLOCK | JSON, max_size=4) | JSON})


@RUN
@given(st.lists(MESSAGE | JSON, max_size=6))
def test_malformed_histories_never_crash_a_check(messages):
    for module in (pairing, ordering):
        module.check(messages)
        for mode in ("reject", "repair"):
            exchange = exchange_for({"model": "m", "max_tokens": 5, "messages": messages})
            try:
                module.relay_request(exchange, {"pairing_mode": mode, "ordering_mode": mode})
            except RelayError as e:
                assert e.status == 400
    find_problem({"model": "m", "max_tokens": 5, "messages": messages}, EmulatorOptions())
