"""pairing: every client ``tool_use`` is answered by exactly one ``tool_result`` in the next turn.

A tolerant upstream may answer 200 to a broken history, so an upstream's success proves
nothing; this plugin checks the history locally, the way the Messages API does, and refuses
(or repairs) what the API is known to refuse, before any upstream sees it. Each rule, its
error text and where the evidence for it comes from is listed in ``docs/evidence/rules.json``
and on the docs page generated from it (docs/history-rules.md).

The API combines consecutive ``user`` or ``assistant`` messages into one turn, so pairing is
judged on turns: the calls of an assistant turn are answered by the user turn after it, one
``tool_result`` per ``tool_use`` id, wherever in that turn's messages (where the results sit is
the ``ordering`` plugin's business). Refused here, in the API's words: a call left without a
result (the error names the first message of the turn that should have answered it), a result
for no call of the previous turn, a call answered twice, a repeated ``tool_use`` id, a
``tool_result`` in an assistant message or a ``tool_use`` in a user message, an empty message
other than a final assistant one, a ``role: "system"`` entry followed by a user message, an
``advisor_tool_result`` or ``web_search_tool_result`` with no ``server_tool_use`` before it, and
a ``web_search`` or ``web_fetch`` call left without its result by a user turn that closes its
turn: any user turn after a paused call, and one that adds to the results of client calls made
beside a deferred call.

A server tool's result may come in a later assistant turn than its ``server_tool_use``: the API
defers a server tool called alongside client tools to the next request, and programmatic calls
end in a ``code_execution_tool_result`` turns later. So a result is judged against every
``server_tool_use`` (or ``mcp_tool_use``) before it, not only its own turn's.

What the API's answer is unknown for is forwarded, with an ``unsure`` entry on the timeline: a
history ending with unanswered calls (a prefill, which some models refuse in other words), a
system entry first, other server-tool results without their ``server_tool_use``, a result whose
``server_tool_use`` is in an earlier turn that made no client call (nothing there for the API to
defer), other server calls closed without their result, and a turn answering programmatic calls
(``caller`` other than ``direct``) that holds more than results.

A request that continues a server-held thread (see :mod:`relay.threads`) is a tail: where
the relay saw the earlier turns it judges the whole conversation and names what the request
holds; where it did not, a result that may answer a call in the held part is forwarded,
noted ``unsure``. A request whose betas or fields may change what a valid history is
(:mod:`relay.betas`) is neither refused nor repaired: what was found is noted ``deferred``.

Options (a backend's ``quirks:`` may set the same key and wins):
  ``pairing_mode``: ``reject`` (default) answers 400 with the API's wording and the first
  problem in message order; ``repair`` answers a call that has no result with an ``is_error``
  result saying that none was recorded, and still refuses what it cannot repair honestly;
  ``off`` does nothing.
  ``merge_consecutive`` (default true): some Anthropic-compatible backends pair message by
  message instead of turn by turn; where a tool turn's calls or results are split over
  consecutive messages, those messages are merged into one (lossless, and what the API does
  itself), counted in ``x-relay-repairs``. ``false`` leaves them as sent.
  ``restore_original_ids`` (set by the ``dedup`` plugin's backend quirk): the upstream's own
  repeated ids are sent back on purpose, so request-wide id uniqueness is not checked.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import msgspec
import orjson

from relay import betas, skeleton, threads
from relay.errors import invalid_request
from relay.hookspecs import hookimpl
from relay.options import Option

log = logging.getLogger("relay.plugins.pairing")
# The quick walk goes on from where the session's previous request ended (relay.resume).
RESUMABLE = True

MODES = ("reject", "repair", "off")
OPTIONS = (
    Option("pairing_mode", str, "reject", "what to do with a call without a result, an unknown "
           "or duplicate result, and the other history rules", choices=MODES, quirk=True),
    Option("merge_consecutive", bool, True, "merge a tool turn's calls or results split over "
           "consecutive messages into one message, for backends that pair message by message",
           quirk=True),
    Option("restore_original_ids", bool, False, "the upstream wants its own repeated ids back "
           "(the dedup quirk): request-wide id uniqueness is not checked", quirk=True),
)

# What a repaired history tells the model about a call whose result never came back: an
# error, with no claim that the tool ran or did not.
NO_RESULT_RECORDED = ("No result was recorded for this tool call. The relay that forwarded "
                      "this conversation cannot tell whether the tool ran or what it did.")

# Blocks a server tool's result pairs with.
_SERVER_USES = frozenset({"server_tool_use", "mcp_tool_use"})
# Server-tool results the API is known to refuse with no server_tool_use before them (anywhere
# earlier in the request), each with its id in docs/evidence/rules.json; for the other kinds of
# result only a note is made.
_REFUSED_WITHOUT_USE = {"advisor_tool_result": "advisor-result-without-use",
                        "web_search_tool_result": "web-search-result-without-use"}
# Server tools whose call closed without a result the API is known to refuse, in its words (the
# docs quote web_fetch's, public reports web_search's); for the others only a note is made.
_OPEN_CALL_REFUSED = frozenset({"web_search", "web_fetch"})

# ``caller`` as models send it on ordinary calls (as the client's JSON text, or decoded).
_DIRECT = {"type": "direct"}
_DIRECT_RAW = msgspec.Raw(b'{"type":"direct"}')

# Within one message the API names a wrong result before the calls it leaves unanswered
# (public reports of id mismatches call the result unexpected rather than name the call).
_AFTER_BLOCKS = 1 << 30


class Problem(NamedTuple):
    """One fault, worded as the Messages API words it."""

    location: str
    message: str
    message_index: int = -1  # the message the location names
    block: int = -1  # the block it names; calls without a result sort after their turn's blocks
    # For calls without a result: their ids; repair adds results to message ``message_index``.
    missing: tuple = ()
    rule: str = ""  # its id in docs/evidence/rules.json

    def as_dict(self) -> dict:
        return {"location": self.location, "message": self.message}


class Unsure(NamedTuple):
    """Something the API's answer to is not known: forwarded, and noted on the timeline."""

    location: str
    reason: str


def _missing(index: int, ids: list) -> Problem:
    location = f"messages.{index}"
    return Problem(location, f"{location}: `tool_use` ids were found without `tool_result` blocks "
                             f"immediately after: {', '.join(ids)}. Each `tool_use` block must "
                             f"have a corresponding `tool_result` block in the next message.",
                   index, _AFTER_BLOCKS, tuple(ids), "unanswered-call")


def _shown(value) -> str:
    """An id as a message shows it: a string as it is, anything else in its JSON form (the
    client sent JSON, so a Python repr such as ``None`` would name nothing it wrote)."""
    if type(value) is str:
        return value
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        return str(value)


def _unknown(index: int, k: int, tool_use_id) -> Problem:
    location = f"messages.{index}.content.{k}"
    return Problem(location, f"{location}: unexpected `tool_use_id` found in `tool_result` blocks: "
                             f"{_shown(tool_use_id)}. Each `tool_result` block must have a "
                             f"corresponding `tool_use` block in the previous message.", index, k,
                   rule="unknown-result")


# "each tool_use must have a single result" is the API's text as quoted in a public fix
# (QwenLM/qwen-code#8163); the sentence after it is unconfirmed.
def _duplicate_result(index: int, k: int, tool_use_id) -> Problem:
    location = f"messages.{index}.content.{k}"
    return Problem(location, f"{location}: each tool_use must have a single result. Found multiple "
                             f"`tool_result` blocks with id: {tool_use_id}", index, k,
                   rule="duplicate-result")


def _wrong_role(index: int, kind: str, home: str) -> Problem:
    location = f"messages.{index}"
    return Problem(location, f"{location}: `{kind}` blocks can only be in `{home}` messages", index,
                   rule="result-in-assistant" if kind == "tool_result" else "tool-use-in-user")


def _duplicate_id(index: int, k: int) -> Problem:
    location = f"messages.{index}.content.{k}"
    return Problem(location, f"{location}: `tool_use` ids must be unique", index, k,
                   rule="duplicate-id")


def _empty(index: int) -> Problem:
    location = f"messages.{index}"
    return Problem(location, f"{location}: all messages must have non-empty content except for "
                             f"the optional final assistant message", index, rule="empty-content")


def _system_misplaced(index: int) -> Problem:
    location = f"messages.{index}"
    return Problem(location, f"{location}: role 'system' must precede an 'assistant' message or "
                             f"end the array", index, rule="system-placement")


def _server_result_alone(index: int, k: int, kind: str, tool_use_id) -> Problem:
    location = f"messages.{index}.content.{k}"
    return Problem(location, f"{location}: unexpected `tool_use_id` found in `{kind}` blocks: "
                             f"{_shown(tool_use_id)}. Each `{kind}` block must have a "
                             f"corresponding `server_tool_use` block before it.", index, k,
                   rule=_REFUSED_WITHOUT_USE[kind])


def _open_server_call(index: int, k: int, name: str, tool_use_id: str, rule: str) -> Problem:
    location = f"messages.{index}"
    return Problem(location, f"{location}: `{name}` tool use with id `{tool_use_id}` was found "
                             f"without a corresponding `{name}_tool_result` block", index, k,
                   rule=rule)


def _clean(messages: list, unique_ids: bool, resume=None) -> bool:
    """True when ``messages`` certainly break no rule of this plugin; False means "look closer".

    The quick walk every request takes: it assumes well-formed, strictly alternating messages
    with results given in the order of their calls, and leaves anything else (consecutive
    messages of one role, system entries out of place, server results, ``caller``) to
    :func:`check`'s full walk. With ``resume`` (:class:`relay.resume.Resume`) it goes on from
    the state saved at ``resume.start`` and saves its state at each mark it gets past.
    """
    state: list = [set() if unique_ids else None, None, False, None]  # seen, pending, programmatic,
    # previous (the role of the last message)
    if resume is None:
        return _clean_walk(messages, 0, len(messages), state, True)
    at = resume.start
    if at:
        saved = resume.state("pairing")
        if saved is None:
            return False
        seen, pending, programmatic, previous = saved  # taken over: used once
        state = [seen, None if pending is None else list(pending), programmatic, previous]
    # Only an assistant message adds to ``seen``: past the last one the set stays as it is,
    # and the marks there save it without a copy (a record's states are used once).
    growing = len(messages)
    while growing > at and _role(messages[growing - 1]) != "assistant":
        growing -= 1
    for mark in resume.marks:
        if mark >= at:
            if not _clean_walk(messages, at, mark, state):
                return False
            at = mark
            seen, pending, programmatic, previous = state
            if seen is not None and mark < growing:
                seen = set(seen)
            resume.save("pairing", mark, (seen, None if pending is None else tuple(pending),
                                          programmatic, previous))
    return _clean_walk(messages, at, len(messages), state) and state[1] is None


def _role(message):
    return message.get("role") if type(message) is dict else None


def _clean_walk(messages: list, lo: int, hi: int, state: list, last: bool = False) -> bool:
    """:func:`_clean` over ``messages[lo:hi]``, from and into ``state``; with ``last``, also
    False when a call is left unanswered at ``hi`` (the end of the messages)."""
    seen, pending, programmatic, previous = state
    try:
        for i in range(lo, hi):
            message = messages[i]
            role = message["role"]
            content = message["content"]
            if not content:
                return False
            if role == "assistant":
                if previous == "assistant" or pending is not None:
                    return False
                # A result paired with an earlier turn's server_tool_use is for the full walk.
                servers = None
                if content.__class__ is list:
                    for block in content:
                        kind = block["type"]
                        if kind == "tool_use":
                            tool_use_id = block["id"]
                            if tool_use_id.__class__ is not str:
                                return False
                            caller = block.get("caller")
                            if caller is not None and caller != _DIRECT_RAW and caller != _DIRECT:
                                programmatic = True
                            if pending is None:
                                pending = [tool_use_id]
                            else:
                                pending.append(tool_use_id)
                        elif kind == "server_tool_use" or kind == "mcp_tool_use":
                            if servers is None:
                                servers = set()
                            servers.add(block["id"])
                        elif "tool_use_id" in block:  # a tool_result, or a server tool's result
                            if kind == "tool_result" or servers is None \
                                    or block["tool_use_id"] not in servers:
                                return False
                            servers.discard(block["tool_use_id"])
                    if servers:  # a server call left open (deferred, or paused): the full walk's
                        return False
                    if pending is not None:
                        if seen is not None:
                            size = len(seen)
                            seen.update(pending)
                            if len(seen) != size + len(pending):
                                return False
                        elif len(pending) > 1 and len(set(pending)) != len(pending):
                            return False
            elif role == "user":
                if previous == "user":
                    return False
                if pending is None:
                    if content.__class__ is list:
                        for block in content:
                            kind = block["type"]
                            if kind == "tool_result" or kind == "tool_use":
                                return False
                else:
                    if content.__class__ is not list:
                        return False
                    answered = 0
                    for block in content:
                        kind = block["type"]
                        if kind == "tool_result":
                            if answered == len(pending) \
                                    or block["tool_use_id"] != pending[answered]:
                                return False
                            answered += 1
                        elif kind == "tool_use" or programmatic:
                            return False
                    if answered != len(pending):
                        return False
                    pending = None
                    programmatic = False
            elif role == "system":
                if previous is None:
                    return False
            else:
                return False
            if previous == "system" and role == "user":
                return False
            previous = role
        if last:
            return pending is None
        state[:] = seen, pending, programmatic, previous
        return True
    except (LookupError, AttributeError, TypeError):
        return False


def turns(messages: list) -> list[tuple[str, list[int]]]:
    """The conversation as the API reads it: consecutive user or assistant messages combined
    into one turn, ``(role, message indexes)``; system entries and malformed ones stepped over."""
    found: list[tuple[str, list[int]]] = []
    for i, message in enumerate(messages):
        if type(message) is not dict:
            continue
        role = message.get("role")
        if role != "user" and role != "assistant":
            continue
        if found and found[-1][0] == role:
            found[-1][1].append(i)
        else:
            found.append((role, [i]))
    return found


def _blocks(messages: list, indexes: list[int]):
    """``(message index, block index, block)`` for every block of a turn, in order."""
    for i in indexes:
        content = messages[i].get("content")
        if type(content) is list:
            for k, block in enumerate(content):
                if type(block) is dict:
                    yield i, k, block


def _programmatic(block: dict) -> bool:
    caller = block.get("caller")
    if caller is None:
        return False
    try:
        caller = skeleton.value(caller)
    except ValueError:
        return False
    return type(caller) is not dict or caller.get("type") != "direct"


def check(messages, unique_ids: bool = True) -> tuple[list[Problem], list[Unsure]]:
    """Every fault in ``messages`` in message order, and what the relay is unsure of.

    ``unique_ids=False`` skips the request-wide id check."""
    if type(messages) is not list or _clean(messages, unique_ids):
        return [], []
    return _check(messages, unique_ids)


def _check(messages: list, unique_ids: bool) -> tuple[list[Problem], list[Unsure]]:
    problems: list[Problem] = []
    unsure: list[Unsure] = []
    _check_messages(messages, unique_ids, problems, unsure)
    _check_server_results(messages, problems, unsure)
    _check_open_server_calls(messages, problems, unsure)
    _check_turns(messages, problems, unsure)
    problems.sort(key=lambda p: (p.message_index, p.block))
    return problems, unsure


def _check_messages(messages: list, unique_ids: bool, problems: list, unsure: list) -> None:
    """The rules that look at one message at a time (and the ids seen so far)."""
    conversational = [i for i, m in enumerate(messages)
                      if type(m) is dict and m.get("role") in ("user", "assistant")]
    last = conversational[-1] if conversational else -1
    seen: set | None = set() if unique_ids else None
    for i, message in enumerate(messages):
        if type(message) is not dict:
            continue
        role = message.get("role")
        content = message.get("content")
        if role == "system":
            following = messages[i + 1] if i + 1 < len(messages) else None
            if type(following) is dict and following.get("role") == "user":
                problems.append(_system_misplaced(i))
            elif i == 0:
                unsure.append(Unsure("messages.0", "a system entry comes first: the API documents "
                                                   "that as refused, but not its error text"))
            continue
        if role != "user" and role != "assistant":
            continue  # a schema fault: the upstream's own validation names it
        if (content == "" or content == []) and not (i == last and role == "assistant"):
            problems.append(_empty(i))
        if type(content) is not list:
            continue
        flagged = False
        for k, block in enumerate(content):
            if type(block) is not dict:
                continue
            kind = block.get("type")
            if role == "user":
                if kind == "tool_use" and not flagged:
                    problems.append(_wrong_role(i, "tool_use", "assistant"))
                    flagged = True
                continue
            if kind == "tool_use":
                tool_use_id = block.get("id")
                if seen is not None and type(tool_use_id) is str:
                    if tool_use_id in seen:
                        problems.append(_duplicate_id(i, k))
                    else:
                        seen.add(tool_use_id)
            elif kind == "tool_result":
                if not flagged:
                    problems.append(_wrong_role(i, "tool_result", "user"))
                    flagged = True


def _check_server_results(messages: list, problems: list, unsure: list) -> None:
    """Each server tool's result in an assistant turn against the ``server_tool_use`` (or
    ``mcp_tool_use``) blocks before it, in this turn or an earlier one."""
    uses: dict = {}  # id -> (its turn, whether that turn made client calls)
    for turn, (role, indexes) in enumerate(turns(messages)):
        if role != "assistant":
            continue
        blocks = list(_blocks(messages, indexes))
        calls = any(block.get("type") == "tool_use" for _, _, block in blocks)
        for i, k, block in blocks:
            kind = block.get("type")
            if type(kind) is not str:
                continue
            if kind in _SERVER_USES:
                if type(block.get("id")) is str:
                    uses.setdefault(block["id"], (turn, calls))
            elif kind.endswith("_tool_result") and kind != "tool_result":
                _judge_server_result(i, k, kind, block.get("tool_use_id"), turn, uses, problems,
                                     unsure)


def _judge_server_result(i: int, k: int, kind: str, tool_use_id, turn: int, uses: dict,
                         problems: list, unsure: list) -> None:
    found = uses.get(tool_use_id) if type(tool_use_id) is str else None
    location = f"messages.{i}.content.{k}"
    if found is None:
        if kind in _REFUSED_WITHOUT_USE:
            problems.append(_server_result_alone(i, k, kind, tool_use_id))
        else:
            unsure.append(Unsure(location, f"a {kind} block without a server_tool_use before it: "
                                           f"the API's answer is recorded only for "
                                           f"{' and '.join(_REFUSED_WITHOUT_USE)}"))
    elif found[0] != turn and not found[1]:
        # Claude Code reports 400s for advisor results split from their call by an injected user
        # message, but not whether the refused requests still held the server_tool_use.
        unsure.append(Unsure(location, f"a {kind} block whose server_tool_use is in an earlier "
                                       f"assistant turn that made no client call: the API's "
                                       f"answer is not known"))


def _check_open_server_calls(messages: list, problems: list, unsure: list) -> None:
    """Server tool calls with no result after them, in an assistant turn the next user turn
    closes. The API runs a server call left open (``pause_turn``, or deferred beside client calls)
    at the start of the next request only if that request ends with the paused turn, or with a
    user turn of nothing but the client calls' results (docs: server tools, "Mixing server tools
    and client tools in one turn")."""
    # A server result's tool_use_id -> where its last result is; one misplaced in a user message
    # counts too, as that fault is the API's to word.
    results: dict = {}
    for i, message in enumerate(messages):
        if type(message) is dict:
            for _, k, block in _blocks(messages, [i]):
                kind = block.get("type")
                if type(kind) is str and kind.endswith("_tool_result") and kind != "tool_result" \
                        and type(block.get("tool_use_id")) is str:
                    results[block["tool_use_id"]] = (i, k)
    found = turns(messages)
    for position, (role, indexes) in enumerate(found[:-1]):
        if role != "assistant":
            continue
        blocks = list(_blocks(messages, indexes))
        # Server calls made from code execution are the programmatic run's business.
        open_calls = [(i, k, block) for i, k, block in blocks
                      if _kind(block) in _SERVER_USES and type(block.get("id")) is str
                      and results.get(block["id"], (-1, -1)) <= (i, k) and not _programmatic(block)]
        if not open_calls:
            continue
        closed = _closes(messages, blocks, found[position + 1][1])
        if closed is None:
            continue
        for i, k, block in open_calls:
            name = _decoded(block.get("name"))
            if not closed:
                # Continued: the call runs now, or its result leads the next assistant turn.
                if position + 2 < len(found) and block["id"] not in results:
                    unsure.append(Unsure(f"messages.{i}",
                                         f"a {block.get('type')} deferred beside client calls "
                                         f"has no result after their results: the API's answer "
                                         f"is not known"))
            elif block["type"] == "server_tool_use" and type(name) is str \
                    and name in _OPEN_CALL_REFUSED:
                problems.append(_open_server_call(i, k, name, block["id"], closed))
            else:
                unsure.append(Unsure(f"messages.{i}",
                                     f"a {block.get('type')} left open before a user turn: the "
                                     f"API's words are recorded only for "
                                     f"{' and '.join(sorted(_OPEN_CALL_REFUSED))}"))


def _decoded(item):
    """A block's value as JSON gives it (the skeleton leaves names as raw JSON text)."""
    try:
        return skeleton.value(item)
    except ValueError:
        return None


def _kind(block: dict) -> str | None:
    kind = block.get("type")
    return kind if type(kind) is str else None


def _closes(messages: list, blocks: list, answering: list[int]) -> str | None:
    """The rule by which the user turn at ``answering`` closes an assistant turn holding an open
    server call (its id in docs/evidence/rules.json); ``""`` when it continues the turn (nothing but
    the client calls' results); None when the client calls' own pairing is at fault (the API
    names that first)."""
    calls = []
    for _, _, block in blocks:
        kind = block.get("type")
        if kind == "tool_use":
            calls.append(block.get("id"))
        elif kind == "text" and calls:
            return None  # text after a client call: the client call's error comes first
    if not calls:
        return "paused-server-call-not-last"
    kinds = []
    answered = []
    for i in answering:
        content = messages[i].get("content")
        if type(content) is str:
            kinds.append("text")
        for _, _, block in _blocks(messages, [i]):
            kinds.append(block.get("type"))
            if block.get("type") == "tool_result":
                answered.append(block.get("tool_use_id"))
    lead = 0
    while lead < len(kinds) and kinds[lead] == "tool_result":
        lead += 1
    if lead != len(answered) or sorted(map(str, answered)) != sorted(map(str, calls)):
        return None
    return "deferred-server-call-closed" if lead < len(kinds) else ""


def _check_turns(messages: list, problems: list, unsure: list) -> None:
    """Pairing, turn by turn: each assistant turn's calls against the user turn after it."""
    pending: list | None = None  # the client tool_use ids of the last assistant turn
    programmatic = False
    for role, indexes in turns(messages):
        if role == "assistant":
            calls = [block for _, _, block in _blocks(messages, indexes)
                     if block.get("type") == "tool_use" and type(block.get("id")) is str]
            pending = list(dict.fromkeys(block["id"] for block in calls)) or None
            programmatic = any(_programmatic(block) for block in calls)
            continue
        expected = set(pending or ())
        answered = set()
        other = False
        for i, k, block in _blocks(messages, indexes):
            if block.get("type") != "tool_result":
                other = True
                continue
            tool_use_id = block.get("tool_use_id")
            if type(tool_use_id) is not str or tool_use_id not in expected:
                problems.append(_unknown(i, k, tool_use_id))
            elif tool_use_id in answered:
                problems.append(_duplicate_result(i, k, tool_use_id))
            else:
                answered.add(tool_use_id)
        if pending:
            unanswered = [x for x in pending if x not in answered]
            if unanswered:
                problems.append(_missing(indexes[0], unanswered))
            if programmatic and other:
                unsure.append(Unsure(f"messages.{indexes[0]}",
                                     "a turn answering programmatic tool calls holds more than "
                                     "tool_result blocks: documented as refused, error text "
                                     "unknown"))
        pending, programmatic = None, False
    if pending:
        # A request that ends with an assistant message asks the model to continue it (a
        # prefill): some models refuse that in their own words, others continue the message.
        # Only the client knows the results, so nothing is added either.
        unsure.append(Unsure(f"messages.{len(messages) - 1}",
                             f"the history ends with tool calls and no results "
                             f"({', '.join(pending)}): a prefill, answered by the model's own "
                             f"rules"))


def add_missing_results(messages: list, found: list[Problem]) -> list[str]:
    """Answer each call without a result with an ``is_error`` result that says no result was
    recorded; return the ids answered. Changes ``messages`` in place.

    The results use the calls' own ids and go to the front of the ``tool_result`` run of the
    first message of the answering turn. Other problems are left alone.
    """
    answered: list[str] = []
    for problem in found:
        if not problem.missing:
            continue
        results = [{"type": "tool_result", "tool_use_id": tool_use_id,
                    "content": NO_RESULT_RECORDED, "is_error": True}
                   for tool_use_id in problem.missing]
        message = messages[problem.message_index]
        content = message.get("content")
        if type(content) is list:
            at = next((k for k, block in enumerate(content)
                       if type(block) is dict and block.get("type") == "tool_result"), 0)
            content[at:at] = results
        elif content:  # a plain string: keep it as a text block after the results
            message["content"] = results + [{"type": "text", "text": content}]
        else:
            message["content"] = results
        answered.extend(problem.missing)
    return answered


def split_tool_turns(messages: list) -> list[tuple[int, int]]:
    """The spans ``(first, last)`` of consecutive messages to merge so that a backend pairing
    message by message sees each tool turn whole: the messages of an assistant turn from the
    first to the last holding calls, and from the first message of the answering turn to the last
    holding results. Spans whose messages carry fields besides ``role`` and ``content``, or that
    a system entry interrupts, are left alone (merging them would lose those fields, or put the
    system entry's text in the turn)."""
    spans: list[tuple[int, int]] = []
    calls_before = False
    for role, indexes in turns(messages):
        if len(indexes) > 1:
            if role == "assistant":
                marked = [i for i in indexes if _holds(messages[i], "tool_use")]
                first, last = (marked[0], marked[-1]) if marked else (None, None)
            else:
                marked = [i for i in indexes if _holds(messages[i], "tool_result")]
                first, last = (indexes[0], marked[-1]) if marked and calls_before else (None, None)
            if first is not None and last is not None and first != last \
                    and all(type(messages[i]) is dict and messages[i].keys() <= {"role", "content"}
                            and messages[i].get("role") == role for i in range(first, last + 1)):
                spans.append((first, last))
        if role == "assistant":
            calls_before = any(_holds(messages[i], "tool_use") for i in indexes)
    return spans


def _holds(message: dict, kind: str) -> bool:
    content = message.get("content")
    return type(content) is list and any(type(b) is dict and b.get("type") == kind
                                         for b in content)


def merge(messages: list, spans: list[tuple[int, int]]) -> None:
    """Merge each span of consecutive same-role messages into its first message, in place: a
    string content becomes a text block, every block is kept in order."""
    for first, last in reversed(spans):
        merged = []
        for message in messages[first:last + 1]:
            content = message.get("content")
            if type(content) is list:
                merged.extend(content)
            elif content:
                merged.append({"type": "text", "text": content})
        messages[first]["content"] = merged
        del messages[first + 1:last + 1]


def _mode(options) -> str:
    return options.get("pairing_mode", "reject")


def _note_unsure(exchange, unsure: list[Unsure]) -> None:
    for item in unsure:
        exchange.unsure("pairing", item.location, item.reason)


def _repair(exchange, messages: list, found: list[Problem]) -> None:
    ids = add_missing_results(messages, found)
    exchange.repaired("pairing", len(ids), added_error_results=len(ids), tool_use_ids=ids,
                      locations=[p.location for p in found if p.missing])
    log.warning("%s: %d tool call(s) had no tool_result; answered them with is_error results "
                "saying none was recorded: %s", exchange.id, len(ids), ", ".join(ids))


def in_place(messages: list) -> bool:
    """Whether every assistant turn ends with its calls and every turn answering calls opens
    with its results. Merging changes the message indexes the API's errors name, so a history
    with calls or results out of place is left for the ``ordering`` plugin to refuse or repair
    as the client sent it."""
    calls = False
    found = turns(messages)
    for n, (role, indexes) in enumerate(found):
        if role == "assistant" and n == len(found) - 1:
            break  # a final assistant turn is a prefill, left to the model's own rules
        kinds = [block.get("type") for _, _, block in _blocks(messages, indexes)]
        if role == "assistant":
            first = kinds.index("tool_use") if "tool_use" in kinds else len(kinds)
            if any(kind != "tool_use" for kind in kinds[first:]):
                return False
            calls = first < len(kinds)
            continue
        if calls:
            lead = 0
            while lead < len(kinds) and kinds[lead] == "tool_result":
                lead += 1
            if "tool_result" in kinds[lead:]:
                return False
        calls = False
    return True


def _merge(exchange, messages: list) -> None:
    spans = split_tool_turns(messages)
    if spans and not in_place(messages):
        exchange.unsure("pairing", f"messages.{spans[0][0]}",
                        "a tool turn split over consecutive messages was not merged: its "
                        "calls or results are out of place")
    elif spans:
        merge(messages, spans)
        exchange.repaired("pairing", sum(last - first for first, last in spans),
                          merged_consecutive=[f"messages.{first}-{last}" for first, last in spans])


@hookimpl
def relay_request(exchange, options):
    mode = _mode(options)
    resume = exchange.resume
    if mode == "off":
        if resume is not None:
            resume.save_all("pairing")
        return
    messages = exchange.messages
    unique_ids = not options.get("restore_original_ids")
    if type(messages) is not list:
        return
    if resume is not None:
        resume = resume.usable(messages)
    thread = exchange.thread
    if thread is not None and thread.continues:
        found, unsure, whole = _check_tail(exchange, messages, unique_ids)
    elif _clean(messages, unique_ids, resume):
        return
    else:
        if resume is not None and resume.start and not resume.seen("pairing"):
            resume.decline()  # the full walk reads what a later plugin changed
        (found, unsure), whole = _check(messages, unique_ids), messages
    _note_unsure(exchange, unsure)
    if exchange.rules_defer:
        if found:
            _defer(exchange, found)
        return
    if found:
        if mode != "repair":
            raise invalid_request(found[0].message, found[0].rule)
        for problem in found:
            if not problem.missing:
                raise invalid_request(problem.message, problem.rule)
        _repair(exchange, whole, found)
    if options.get("merge_consecutive", True):
        _merge(exchange, messages)


def _check_tail(exchange, messages: list, unique_ids: bool):
    """A request that continues a server-held thread: with the held part known, the whole
    conversation is judged and what the request itself holds is named, at its own indexes
    (a problem's ``index`` stays the whole conversation's, for repairs); with it unknown, the
    request alone, and a result that may answer a call in the held part is forwarded."""
    whole, offset = threads.conversation(exchange)
    if offset:
        found, unsure = check(whole, unique_ids)
        found = [_shifted(problem, offset) for problem in found if problem.message_index >= offset]
        unsure = [Unsure(threads.shifted(item.location, "", offset)[0], item.reason)
                  for item in unsure if threads.index_of(item.location) >= offset]
        return found, unsure, whole
    found, unsure = check(messages, unique_ids)
    held = threads.opens_with_held_calls(messages)
    kept = []
    for problem in found:
        if problem.rule in _HELD_ANSWERS and problem.message_index < held:
            unsure.append(Unsure(problem.location, "a result that may answer a call in the "
                                                   "part of the thread the server holds"))
        else:
            kept.append(problem)
    return kept, unsure, messages


# What the held part of a thread may make right: a client result answering a held call, and a
# server tool's result in an assistant message continuing a held turn (a paused server call).
_HELD_ANSWERS = frozenset({"unknown-result", *_REFUSED_WITHOUT_USE.values()})


def _shifted(problem: Problem, offset: int) -> Problem:
    location, message = threads.shifted(problem.location, problem.message, offset)
    return problem._replace(location=location, message=message)


def _defer(exchange, found: list[Problem]) -> None:
    """A request whose betas or fields may change what a valid history is: what the rules
    found goes on the timeline, and the upstream judges."""
    exchange.note("pairing", "deferred", location=found[0].location, rule=found[0].rule,
                  problems=len(found), reasons=betas.described(exchange.rules_defer))


@hookimpl
def relay_validate(exchange, options, repair):
    messages = exchange.messages
    if _mode(options) == "off" or messages is None:
        return None
    unique_ids = not options.get("restore_original_ids")
    if exchange.thread is None:  # offline, nothing of the thread is known but the request
        exchange.thread = threads.requested(exchange.field("thread"))
    if exchange.thread is not None and exchange.thread.continues:
        found, unsure, _ = _check_tail(exchange, messages, unique_ids)
    else:
        found, unsure = check(messages, unique_ids)
    _note_unsure(exchange, unsure)
    if repair:
        if any(problem.missing for problem in found):
            _repair(exchange, messages, found)
            found, _ = check(messages, unique_ids)
        if options.get("merge_consecutive", True):
            _merge(exchange, messages)
    return [problem.as_dict() for problem in found]
