"""ordering: calls end their assistant turn, and results open the turn that answers them.

The Messages API pairs calls and results by position: the ``tool_use`` blocks of an assistant
turn must be followed immediately by their ``tool_result`` blocks, so nothing may come after a
call in its own turn, and the answering user turn must open with one contiguous run of results
(ordinary content may follow the run). The API combines consecutive messages of one role into
one turn, and so does this check. A tolerant upstream may accept either fault, so this plugin
checks them locally, in the API's words (see ``docs/evidence/rules.json``):

- a ``text`` block after a call in its assistant turn (``[tool_use, text]``) is refused, naming
  the first message of the answering turn and the calls the text follows, as a recorded real
  exchange shows; another kind of block after a call is unrecorded, so it is forwarded with an
  ``unsure`` entry on the timeline;
- results after other content in the answering turn (``[text, tool_result]``,
  ``[tool_result, text, tool_result]``) are refused, naming the first message of the turn and
  the calls not answered in its leading run.

Whether every call has exactly one result is the ``pairing`` plugin's business; this one only
looks at where calls and results sit. ``role: "system"`` entries are stepped over.

A request that continues a server-held thread (:mod:`relay.threads`) is judged with the
held part where the relay saw it, else alone; a turn that begins in the held part is not
repaired. A request whose betas or fields may change what a valid history is
(:mod:`relay.betas`) is neither refused nor repaired: what was found is noted ``deferred``.

Option (a backend's ``quirks:`` may set the same key and wins):
  ``ordering_mode``: ``reject`` (default) answers 400 with the API's wording; ``repair`` moves
  the other blocks before the calls, and the results to the front of their turn, keeping their
  order and every block (a turn split over consecutive messages is merged into its first
  message, as the API reads it); ``off`` does nothing.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from relay import betas, threads
from relay.errors import invalid_request
from relay.hookspecs import hookimpl
from relay.options import Option

log = logging.getLogger("relay.plugins.ordering")
# The quick walk goes on from where the session's previous request ended (relay.resume).
RESUMABLE = True

MODES = ("reject", "repair", "off")
OPTIONS = (
    Option("ordering_mode", str, "reject", "what to do with content after a call, or "
           "tool_results that do not lead their turn", choices=MODES, quirk=True),
)


class Problem(NamedTuple):
    """A turn whose calls or results are out of place, worded as the API words it."""

    location: str
    message: str
    message_index: int  # the message the location names
    turn: tuple  # the message indexes of the turn to reorder
    calls_first: bool  # an assistant turn (move the other blocks first) or a user one
    rule: str = ""  # its id in docs/evidence/rules.json

    def as_dict(self) -> dict:
        return {"location": self.location, "message": self.message}


def _not_after(index: int, ids: list, turn: list, calls: bool) -> Problem:
    location = f"messages.{index}"
    rule = "tool-use-then-text" if calls else "results-not-first"
    return Problem(location, f"{location}: `tool_use` ids were found without `tool_result` blocks "
                             f"immediately after: {', '.join(ids)}. Each `tool_use` block must "
                             f"have a corresponding `tool_result` block in the next message.",
                   index, tuple(turn), calls, rule)


def _clean(messages: list, resume=None) -> bool:
    """True when no call is followed by another block in its message, no user message holds a
    result after another kind of block, and no two messages in a row share a role; False
    means "look closer". The quick walk every request takes, for well-formed messages; with
    ``resume`` (:class:`relay.resume.Resume`) it goes on from the role saved at
    ``resume.start`` and saves the role at each mark it gets past."""
    previous = None
    at = 0
    if resume is not None:
        at = resume.start
        if at:
            previous = resume.state("ordering")
            if previous is None:
                return False
        for mark in resume.marks:
            if mark >= at:
                previous = _clean_walk(messages, at, mark, previous)
                if previous is False:
                    return False
                at = mark
                resume.save("ordering", mark, previous or "")
    return _clean_walk(messages, at, len(messages), previous) is not False


def _clean_walk(messages: list, lo: int, hi: int, previous):
    """:func:`_clean` over ``messages[lo:hi]`` after a message of role ``previous`` (None or
    "" for none): the role of the last message then, or False to look closer."""
    try:
        for i in range(lo, hi):
            message = messages[i]
            role = message["role"]
            if role == "system":
                continue
            if role == previous:
                return False
            previous = role
            content = message["content"]
            if content.__class__ is not list or len(content) < 2:
                continue
            if role == "user":
                other = False
                for block in content:
                    if block["type"] == "tool_result":
                        if other:
                            return False
                    else:
                        other = True
            else:
                called = False
                for block in content:
                    if block["type"] == "tool_use":
                        called = True
                    elif called:
                        return False
        return previous
    except (LookupError, AttributeError, TypeError):
        return False


def _turns(messages: list) -> list[tuple[str, list[int]]]:
    """Consecutive user or assistant messages combined, as the API combines them."""
    found: list[tuple[str, list[int]]] = []
    for i, message in enumerate(messages):
        if type(message) is not dict or message.get("role") not in ("user", "assistant"):
            continue
        if found and found[-1][0] == message["role"]:
            found[-1][1].append(i)
        else:
            found.append((message["role"], [i]))
    return found


def _blocks(messages: list, indexes: list[int]) -> list[dict]:
    found: list[dict] = []
    for i in indexes:
        content = messages[i].get("content")
        if type(content) is list:
            found.extend(block for block in content if type(block) is dict)
    return found


def check(messages, resume=None) -> tuple[list[Problem], list[tuple[str, str]]]:
    """Every turn with calls or results out of place, in message order, and ``(location,
    reason)`` for what the relay is unsure of."""
    if type(messages) is not list or _clean(messages, resume):
        return [], []
    if resume is not None and resume.start and not resume.seen("ordering"):
        resume.decline()  # the full walk reads what a later plugin changed
    return _closer(messages)


def _closer(messages: list) -> tuple[list[Problem], list[tuple[str, str]]]:
    """:func:`check`'s full walk, for messages its quick walk could not clear."""
    found: list[Problem] = []
    unsure: list[tuple[str, str]] = []
    calls: list[str] = []  # the ids of the last assistant turn
    turns = _turns(messages)
    for t, (role, indexes) in enumerate(turns):
        blocks = _blocks(messages, indexes)
        following = turns[t + 1][1] if t + 1 < len(turns) else None
        if role == "assistant":
            calls = [b["id"] for b in blocks
                     if b.get("type") == "tool_use" and type(b.get("id")) is str]
            before_text, other, earlier = [], False, []
            for block in blocks:
                kind = block.get("type")
                if kind == "tool_use":
                    if type(block.get("id")) is str:
                        earlier.append(block["id"])
                elif earlier:
                    if kind == "text":
                        before_text = list(earlier)
                    else:
                        other = True
            where = f"messages.{following[0]}" if following else f"messages.{indexes[-1]}"
            if before_text:
                if following:
                    found.append(_not_after(following[0], list(dict.fromkeys(before_text)),
                                            indexes, True))
                else:
                    unsure.append((where, "text after a tool call in the last message (a prefill)"))
            elif other:
                unsure.append((where, "a block other than text after a tool call: the API's "
                                      "answer to that is unrecorded"))
            continue
        if calls:
            expected = set(calls)
            lead = 0
            while lead < len(blocks) and blocks[lead].get("type") == "tool_result":
                lead += 1
            late = {b["tool_use_id"] for b in blocks[lead:] if b.get("type") == "tool_result"
                    and type(b.get("tool_use_id")) is str and b["tool_use_id"] in expected}
            if late:  # named in the order of the calls, as the API names unanswered ones
                found.append(_not_after(indexes[0], [c for c in dict.fromkeys(calls) if c in late],
                                        indexes, False))
        calls = []
    return found, unsure


def reorder(messages: list, found: list[Problem]) -> list[Problem]:
    """Move calls to the end of their turn and results to the front of theirs, keeping the order
    of each kind and every block; a turn of several messages is merged into its first message
    first. Changes ``messages`` in place; returns the problems it could not repair (a turn whose
    messages carry fields besides ``role`` and ``content``, or that a system entry interrupts:
    moved past it, blocks would change what the entry stands before)."""
    left = []
    for problem in sorted(found, key=lambda p: p.turn[0], reverse=True):
        turn = problem.turn
        if len(turn) > 1 and (turn[-1] - turn[0] != len(turn) - 1 or not all(
                messages[i].keys() <= {"role", "content"} for i in turn)):
            left.append(problem)
            continue
        blocks = []
        for i in turn:
            content = messages[i].get("content")
            if type(content) is list:
                blocks.extend(content)
            elif content:
                blocks.append({"type": "text", "text": content})
        moved = "tool_use" if problem.calls_first else "tool_result"
        mine = [b for b in blocks if type(b) is dict and b.get("type") == moved]
        rest = [b for b in blocks if not (type(b) is dict and b.get("type") == moved)]
        messages[turn[0]]["content"] = rest + mine if problem.calls_first else mine + rest
        for i in reversed(turn[1:]):
            del messages[i]
    return left


def _mode(options) -> str:
    return options.get("ordering_mode", "reject")


def _repair(exchange, messages: list, found: list[Problem]) -> list[Problem]:
    left = reorder(messages, found)
    done = [problem.location for problem in found if problem not in left]
    if done:
        exchange.repaired("ordering", len(done), moved_into_place=done)
        log.warning("%s: tool calls or results out of place; moved them in %s",
                    exchange.id, ", ".join(done))
    return left


def _note_unsure(exchange, unsure) -> None:
    for location, reason in unsure:
        exchange.unsure("ordering", location, reason)


@hookimpl
def relay_request(exchange, options):
    mode = _mode(options)
    resume = exchange.resume
    if mode == "off":
        if resume is not None:
            resume.save_all("ordering")
        return
    messages = exchange.messages
    if resume is not None:
        resume = resume.usable(messages)
    if exchange.thread is None and resume is None and type(messages) is list:
        # check() without a thread's held part to judge with: most requests end at its quick
        # walk (_clean's, with no state to go on from).
        if _clean_walk(messages, 0, len(messages), None) is not False:
            return
        whole, offset = messages, 0
        found, unsure = _closer(messages)
    else:
        whole, offset = threads.conversation(exchange)
        found, unsure = check(whole, None if offset else resume)
    if offset:
        found, unsure = _own(found, unsure, offset)
    _note_unsure(exchange, unsure)
    if not found:
        return
    if exchange.rules_defer:
        exchange.note("ordering", "deferred", location=found[0].location, rule=found[0].rule,
                      problems=len(found), reasons=betas.described(exchange.rules_defer))
        return
    if mode == "repair":
        held = [problem for problem in found if problem.turn[0] < offset]
        found = held + _repair(exchange, messages, [_moved(problem, -offset) for problem in found
                                                    if problem.turn[0] >= offset])
        if not found:
            return
    raise invalid_request(found[0].message, found[0].rule)


def _own(found: list[Problem], unsure: list, offset: int):
    """A continuation of a thread whose held part the relay knows: the whole conversation was
    judged; what the request itself holds is named at its own indexes. Without the held part
    the request is judged alone, which refuses nothing the held part could make right: a
    turn's calls are only ever checked against the turn after them."""
    own = []
    for problem in found:
        if problem.message_index >= offset:
            location, message = threads.shifted(problem.location, problem.message, offset)
            own.append(problem._replace(location=location, message=message))
    return own, [(threads.shifted(location, "", offset)[0], reason) for location, reason in unsure
                 if threads.index_of(location) >= offset]


def _moved(problem: Problem, by: int) -> Problem:
    return problem._replace(message_index=problem.message_index + by,
                            turn=tuple(i + by for i in problem.turn))


@hookimpl
def relay_validate(exchange, options, repair):
    messages = exchange.messages
    if _mode(options) == "off" or messages is None:
        return None
    found, unsure = check(messages)
    _note_unsure(exchange, unsure)
    if repair and found:
        found = _repair(exchange, messages, found)
    return [problem.as_dict() for problem in found]
