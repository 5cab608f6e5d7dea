"""ordering: the message that answers tool calls begins with its ``tool_result`` blocks.

The Messages API wants the user message after an assistant message with ``tool_use`` blocks
to open with one contiguous run of ``tool_result`` blocks; ordinary content may follow the
run but never precede or interrupt it: ``[tool_result, text]`` passes,
``[text, tool_result]`` and ``[tool_result, text, tool_result]`` do not. A tolerant upstream
may accept either, so this plugin checks it locally.

Whether every call has exactly one result is the ``pairing`` plugin's business; this one only
looks at where the results sit. Entries with other roles (Claude Code's ``role: "system"``
entries) are stepped over, as ``pairing`` does.

Option (a backend's ``quirks:`` may set the same key and wins):
  ``ordering_mode``: ``reject`` (default) answers 400 with the API's wording; ``repair`` moves
  the ``tool_result`` blocks to the front, keeping their order and every other block (nothing
  is lost); ``off`` does nothing.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from relay.config import check_choice
from relay.errors import invalid_request
from relay.hookspecs import hookimpl

log = logging.getLogger("relay.plugins.ordering")

MODES = ("reject", "repair", "off")


class Problem(NamedTuple):
    """A message whose ``tool_result`` blocks do not open it, worded as the API words it."""

    location: str
    message: str
    index: int

    def as_dict(self) -> dict:
        return {"location": self.location, "message": self.message}


def _is_result(block) -> bool:
    return type(block) is dict and block.get("type") == "tool_result"


def _misplaced(index: int, calls: int) -> Problem:
    location = f"messages.{index}"
    return Problem(location, f"{location}: Did not find {calls} `tool_result` block(s) at the "
                             f"beginning of this message. Messages following `tool_use` blocks "
                             f"must begin with a matching number of `tool_result` blocks.", index)


def _calls(message) -> int:
    content = message.get("content")
    if type(content) is not list:
        return 0
    return sum(1 for block in content if type(block) is dict and block.get("type") == "tool_use")


def _clean(messages: list) -> bool:
    """True when no user message holds a ``tool_result`` after another kind of block; False
    means "look closer". The quick walk every request takes, for well-formed messages."""
    try:
        for message in messages:
            if message["role"] == "user":
                content = message["content"]
                if content.__class__ is list and len(content) > 1:
                    other = False
                    for block in content:
                        if block["type"] == "tool_result":
                            if other:
                                return False
                        else:
                            other = True
        return True
    except (LookupError, AttributeError, TypeError):
        return False


def problems(messages) -> list[Problem]:
    """Every user message that answers tool calls but does not begin with all its
    ``tool_result`` blocks, in message order."""
    found: list[Problem] = []
    if type(messages) is not list or _clean(messages):
        return found
    previous = None  # the last user or assistant message
    for i, message in enumerate(messages):
        if type(message) is not dict:
            continue
        role = message.get("role")
        if role == "user":
            content = message.get("content")
            if type(content) is list and previous is not None:
                other = False
                for block in content:
                    if type(block) is dict and block.get("type") == "tool_result":
                        if other:
                            # Rare: only now is it worth asking whether this message answers
                            # tool calls (a result with no call before it is pairing's fault).
                            calls = _calls(previous) if previous.get("role") == "assistant" else 0
                            if calls:
                                found.append(_misplaced(i, calls))
                            break
                    else:
                        other = True
            previous = message
        elif role == "assistant":
            previous = message
    return found


def move_results_first(messages: list, found: list[Problem]) -> None:
    """Move each flagged message's ``tool_result`` blocks to its front, keeping the order of
    the results and of every other block. Changes ``messages`` in place."""
    for problem in found:
        content = messages[problem.index]["content"]
        content[:] = ([block for block in content if _is_result(block)]
                      + [block for block in content if not _is_result(block)])


def _mode(options) -> str:
    return options.get("ordering_mode", "reject")


def _repair(exchange, messages: list, found: list[Problem]) -> None:
    move_results_first(messages, found)
    locations = [problem.location for problem in found]
    exchange.repaired("ordering", len(found), moved_results_first=locations)
    log.warning("%s: tool_result blocks did not open their message; moved them first in %s",
                exchange.id, ", ".join(locations))


@hookimpl
def relay_startup(config, options):
    check_choice(config, "ordering", options, "ordering_mode", MODES)


@hookimpl
def relay_request(exchange, options):
    mode = _mode(options)
    if mode == "off":
        return
    messages = exchange.messages
    found = problems(messages)
    if not found:
        return
    if mode == "repair":
        _repair(exchange, messages, found)
        return
    raise invalid_request(found[0].message)


@hookimpl
def relay_validate(exchange, options, repair):
    messages = exchange.messages
    if _mode(options) == "off" or messages is None:
        return None
    found = problems(messages)
    if repair and found:
        _repair(exchange, messages, found)
        return []
    return [problem.as_dict() for problem in found]
