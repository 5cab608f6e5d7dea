"""pairing: every client ``tool_use`` gets exactly one ``tool_result`` in the next message.

A tolerant upstream may answer 200 to a broken history, so an upstream's success proves
nothing; this plugin checks the pairing contract locally, the way the Messages API does, and
refuses (or repairs) a broken history before any upstream sees it.

The contract, for client tools only: an assistant message's ``tool_use`` blocks must be
answered by the next message, a user message holding exactly one ``tool_result`` per
``tool_use`` id (none missing, none unknown, none twice); ``tool_result`` blocks belong in user
messages only; ``tool_use`` ids are unique in the whole request. Server-side tools
(``server_tool_use``, ``web_search_tool_result`` and other ``*_tool_result`` blocks,
``mcp_tool_use``/``mcp_tool_result``) pair inside the assistant message and are never checked
here; unknown block types pass. Entries with other roles (Claude Code puts ``role: "system"``
entries in ``messages``) are stepped over: they neither answer nor interrupt a tool call.

Where the ``tool_result`` blocks sit inside the answering message is the ``ordering`` plugin's
business, not this one's.

Options (a backend's ``quirks:`` may set the same key and wins):
  ``pairing_mode``: ``reject`` (default) answers 400 with the API's own wording and the first
  problem in the order the API reports it; ``repair`` answers a tool call that has no result
  with an ``is_error`` result saying that none was recorded, and still refuses what it cannot
  repair honestly (unknown or duplicate results, duplicate ``tool_use`` ids, a result in an
  assistant message, a tool call in the final message); ``off`` does nothing.
  ``restore_original_ids`` (set by the ``dedup`` plugin's backend quirk): the upstream's own
  repeated ids are sent back on purpose, so request-wide id uniqueness is not checked.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import orjson

from relay.config import check_choice
from relay.errors import invalid_request
from relay.hookspecs import hookimpl

log = logging.getLogger("relay.plugins.pairing")

MODES = ("reject", "repair", "off")

# What a repaired history tells the model about a call whose result never came back: an
# error, with no claim that the tool ran or did not.
NO_RESULT_RECORDED = ("No result was recorded for this tool call. The relay that forwarded "
                      "this conversation cannot tell whether the tool ran or what it did.")


class Problem(NamedTuple):
    """One pairing fault, worded as the Messages API words it."""

    location: str
    message: str
    index: int = -1  # the message the location names
    # For a tool call without a result: its ids, the index of the user message that should
    # have answered (None when the next message is not a user message), and whether
    # repair mode can add the missing results.
    missing: tuple = ()
    answer_at: int | None = None
    repairable: bool = False

    def as_dict(self) -> dict:
        return {"location": self.location, "message": self.message}


def _missing(index: int, ids: list, answer_at: int | None, repairable: bool) -> Problem:
    location = f"messages.{index}"
    return Problem(location, f"{location}: `tool_use` ids were found without `tool_result` blocks "
                             f"immediately after: {', '.join(ids)}. Each `tool_use` block must have "
                             f"a corresponding `tool_result` block in the next message.",
                   index, tuple(ids), answer_at, repairable)


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
                             f"{_shown(tool_use_id)}. Each `tool_result` block must have a corresponding "
                             f"`tool_use` block in the previous message.", index)


# "each tool_use must have a single result" is the API's text as quoted in a public fix
# (QwenLM/qwen-code#8163); the sentence after it is unconfirmed.
def _duplicate_result(index: int, k: int, tool_use_id) -> Problem:
    location = f"messages.{index}.content.{k}"
    return Problem(location, f"{location}: each tool_use must have a single result. Found multiple "
                             f"`tool_result` blocks with id: {tool_use_id}", index)


def _result_in_assistant(index: int) -> Problem:
    location = f"messages.{index}"
    return Problem(location, f"{location}: `tool_result` blocks can only be in `user` messages", index)


def _duplicate_id(index: int, k: int) -> Problem:
    location = f"messages.{index}.content.{k}"
    return Problem(location, f"{location}: `tool_use` ids must be unique", index)


def _clean(messages: list, unique_ids: bool) -> bool:
    """True when ``messages`` certainly pair cleanly; False means "look closer".

    The quick walk every request takes: it assumes well-formed messages and results given in
    the order of their calls, and leaves anything else to :func:`problems`' full walk.
    """
    try:
        seen = set() if unique_ids else None
        pending = None
        for message in messages:
            role = message["role"]
            if role == "assistant":
                if pending is not None:
                    return False
                content = message["content"]
                if content.__class__ is not list:
                    continue
                for block in content:
                    kind = block["type"]
                    if kind == "tool_use":
                        tool_use_id = block["id"]
                        if tool_use_id.__class__ is not str:
                            return False
                        if pending is None:
                            pending = [tool_use_id]
                        else:
                            pending.append(tool_use_id)
                    elif kind == "tool_result":
                        return False
                if pending is None:
                    continue
                if seen is not None:
                    size = len(seen)
                    seen.update(pending)
                    if len(seen) != size + len(pending):
                        return False
                elif len(pending) > 1 and len(set(pending)) != len(pending):
                    return False
            elif role == "user":
                content = message["content"]
                if pending is None:
                    if content.__class__ is list:
                        for block in content:
                            if block["type"] == "tool_result":
                                return False
                    continue
                if content.__class__ is not list:
                    return False
                answered = 0
                for block in content:
                    if block["type"] == "tool_result":
                        if block["tool_use_id"] != pending[answered]:
                            return False
                        answered += 1
                if answered != len(pending):
                    return False
                pending = None
        return pending is None
    except (LookupError, AttributeError, TypeError):
        return False


def problems(messages, unique_ids: bool = True) -> list[Problem]:
    """Every pairing fault in ``messages``, in the order the API reports them.

    One walk collects three kinds, reported kind by kind in the order the API (and the
    emulator that stands for it) checks them: results in assistant messages (part of the check
    of each message's shape), then repeated ``tool_use`` ids across the request, then the
    pairing of each assistant message with the next one. In that last kind, a user message's
    unknown or repeated results come before the calls it leaves unanswered: public reports of
    id mismatches show the API calling the result unexpected rather than naming the call.
    ``unique_ids=False`` skips the id check.
    """
    if type(messages) is not list or _clean(messages, unique_ids):
        return []
    misplaced: list[Problem] = []
    repeated: list[Problem] = []
    unpaired: list[Problem] = []
    seen = set() if unique_ids else None
    pending = None  # the client tool_use ids of the last assistant message, if it had any
    pending_at = -1
    for i, message in enumerate(messages):
        if type(message) is not dict:
            continue
        role = message.get("role")
        if role == "user":
            content = message.get("content")
            if pending is None:
                if type(content) is list:
                    for k, block in enumerate(content):
                        if type(block) is dict and block.get("type") == "tool_result":
                            unpaired.append(_unknown(i, k, block.get("tool_use_id")))
                continue
            answered = set()
            if type(content) is list:
                expected = set(pending)
                for k, block in enumerate(content):
                    if type(block) is not dict or block.get("type") != "tool_result":
                        continue
                    tool_use_id = block.get("tool_use_id")
                    if type(tool_use_id) is not str or tool_use_id not in expected:
                        unpaired.append(_unknown(i, k, tool_use_id))
                    elif tool_use_id in answered:
                        unpaired.append(_duplicate_result(i, k, tool_use_id))
                    else:
                        answered.add(tool_use_id)
            unanswered = [x for x in dict.fromkeys(pending) if x not in answered]
            if unanswered:
                repairable = content is None or type(content) in (list, str)
                unpaired.append(_missing(pending_at, unanswered, i, repairable))
            pending = None
        elif role == "assistant":
            if pending is not None:
                unpaired.append(_missing(pending_at, list(dict.fromkeys(pending)), None, True))
                pending = None
            content = message.get("content")
            if type(content) is not list:
                continue
            ids = None
            for k, block in enumerate(content):
                if type(block) is not dict:
                    continue
                kind = block.get("type")
                if kind == "tool_use":
                    tool_use_id = block.get("id")
                    if type(tool_use_id) is not str:
                        continue  # a schema fault: the upstream's own validation names it
                    if seen is not None:
                        if tool_use_id in seen:
                            repeated.append(_duplicate_id(i, k))
                        else:
                            seen.add(tool_use_id)
                    if ids is None:
                        ids = [tool_use_id]
                    else:
                        ids.append(tool_use_id)
                elif kind == "tool_result" and (not misplaced or misplaced[-1].index != i):
                    misplaced.append(_result_in_assistant(i))
            if ids is not None:
                pending, pending_at = ids, i
        # Any other role is stepped over: it neither answers nor interrupts a tool call.
    if pending is not None:
        # A request that ends with an assistant message asks the model to continue that very
        # message (a prefill). Adding a user turn of made-up results behind it would turn the
        # continuation into a new turn, and the client would splice that answer onto its own
        # message, so this is refused even in repair mode: only the client knows the results.
        unpaired.append(_missing(pending_at, list(dict.fromkeys(pending)), None, False))
    return misplaced + repeated + unpaired


def add_missing_results(messages: list, found: list[Problem]) -> list[str]:
    """Answer each repairable tool call without a result with an ``is_error`` result that
    says no result was recorded; return the ids answered. Changes ``messages`` in place.

    The results use the tool calls' own ids and go to the front of the answering message's
    ``tool_result`` run, or into a new user message right after the assistant message when
    the next message is not a user message. Other problems are left alone.
    """
    answered = []
    # From the end, so that an inserted message does not move the ones still to repair.
    for problem in reversed(found):
        if not problem.repairable:
            continue
        results = [{"type": "tool_result", "tool_use_id": tool_use_id,
                    "content": NO_RESULT_RECORDED, "is_error": True}
                   for tool_use_id in problem.missing]
        if problem.answer_at is None:
            messages.insert(problem.index + 1, {"role": "user", "content": results})
        else:
            message = messages[problem.answer_at]
            content = message.get("content")
            if type(content) is list:
                at = next((k for k, block in enumerate(content)
                           if type(block) is dict and block.get("type") == "tool_result"), 0)
                content[at:at] = results
            elif content:  # a plain string: keep it as a text block after the results
                message["content"] = results + [{"type": "text", "text": content}]
            else:
                message["content"] = results
        answered[:0] = problem.missing
    return answered


def _mode(options) -> str:
    return options.get("pairing_mode", "reject")


def _repair(exchange, messages: list, found: list[Problem]) -> None:
    ids = add_missing_results(messages, found)
    exchange.repaired("pairing", len(ids), added_error_results=len(ids), tool_use_ids=ids,
                      locations=[p.location for p in found if p.repairable])
    log.warning("%s: %d tool call(s) had no tool_result; answered them with is_error results "
                "saying none was recorded: %s", exchange.id, len(ids), ", ".join(ids))


@hookimpl
def relay_startup(config, options):
    check_choice(config, "pairing", options, "pairing_mode", MODES)


@hookimpl
def relay_request(exchange, options):
    mode = _mode(options)
    if mode == "off":
        return
    messages = exchange.messages
    found = problems(messages, unique_ids=not options.get("restore_original_ids"))
    if not found:
        return
    if mode == "repair":
        for problem in found:
            if not problem.repairable:
                raise invalid_request(problem.message)
        _repair(exchange, messages, found)
        return
    raise invalid_request(found[0].message)


@hookimpl
def relay_validate(exchange, options, repair):
    messages = exchange.messages
    if _mode(options) == "off" or messages is None:
        return None
    unique_ids = not options.get("restore_original_ids")
    found = problems(messages, unique_ids)
    if repair and any(problem.repairable for problem in found):
        _repair(exchange, messages, found)
        found = problems(messages, unique_ids)
    return [problem.as_dict() for problem in found]
