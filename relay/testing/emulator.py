"""A strict stand-in for Anthropic's Messages API: the upstream of every relay test.

A tolerant upstream would let a broken relay pass its tests, so this one rejects what the real
API rejects, with the real API's wording (see PROTOCOL.md), and answers from a script decided
by the request alone: ``turn`` is the number of assistant messages in the history, and the
options say how many turns end in tool calls, how the tool ids look and which faults to inject.

It imports nothing from the relay on purpose: it stands for the far side of the wire, and it
runs on its own (``python relay/testing/emulator.py --port 0``).

A request that offers no client tool (a side request, such as a title or a quota check), or
forbids calls with ``tool_choice: none``, gets a text answer: a model cannot call a tool it was
not given.

Validation order, first problem wins: the body's shape (fields, block fields, id patterns,
which role may hold which block), then where ``role: "system"`` entries stand, then content
(empty messages and text blocks), then tool_use id uniqueness (and, with ``expect_own_ids``,
provenance), then server-tool results without their ``server_tool_use``, then pairing, then
server calls a user turn closed without their result, then thinking signatures. Pairing is
judged the way the API reads a history: consecutive messages of one role form one turn; a
turn's calls must be its last blocks; the next turn must open with their results (an unknown or
repeated ``tool_use_id`` is named at its block); a call left without a result in that leading
run is named at the first message of that turn. A history that ends with calls is a prefill,
left to the model's own rules. The rules and their evidence are listed in
``docs/evidence/rules.json``; this module keeps its own copy of each check, so that a mistake in the
relay's plugins is not repeated here.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import dataclasses
import datetime
import hashlib
import hmac
import itertools
import math
import os
import re
import signal
import sys
import time
from typing import Any

import orjson
from aiohttp import web

STATUS_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}

FAULT_MESSAGES = {
    400: "Emulated invalid request",
    401: "invalid x-api-key",
    403: "Your API key does not have permission to use the specified resource.",
    404: "Not Found",
    413: "Request exceeds the maximum allowed number of bytes.",
    429: "Number of requests has exceeded your per-minute rate limit",
    500: "Internal server error",
    504: "Request timed out",
    529: "Overloaded",
}

MAX_BODY_BYTES = 32 * 1024 * 1024

# A Kimi-like backend names its calls `functions.Bash:0`; it must accept its own ids back.
ID_PATTERNS = {"anthropic": "^[a-zA-Z0-9_-]+$", "functions": "^[a-zA-Z0-9_.:-]+$"}
_ID_REGEXES = {style: re.compile(pattern) for style, pattern in ID_PATTERNS.items()}

MODELS = [
    {"type": "model", "id": "claude-sonnet-4-5-20250929", "display_name": "Claude Sonnet 4.5",
     "created_at": "2025-09-29T00:00:00Z"},
    {"type": "model", "id": "claude-haiku-4-5-20251001", "display_name": "Claude Haiku 4.5",
     "created_at": "2025-10-15T00:00:00Z"},
    {"type": "model", "id": "claude-opus-4-1-20250805", "display_name": "Claude Opus 4.1",
     "created_at": "2025-08-05T00:00:00Z"},
]

# Sizes of the pieces a ragged stream is cut into; irregular so that over a stream every kind
# of boundary (inside a line, between \r and \n, across events) gets hit.
RAGGED_SIZES = (1, 3, 2, 7, 1, 13, 5, 2, 29, 4, 1, 11)

# Signatures are keyed per process unless given: a restarted emulator rejects old histories,
# just as the real API rejects blocks it did not sign.
_PROCESS_SECRET = os.urandom(32)

_BASE62 = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


@dataclasses.dataclass
class EmulatorOptions:
    """Every emulator option, named as on the command line (``--tool-turns`` is tool_turns).

    ``fail_status`` alone fails every /v1/messages request; with ``fail_count`` it fails the
    first C, with ``fail_every`` every K-th (both may be combined). ``cut_after`` and
    ``stream_error_after`` count stream events, ``ping`` included.

    Keys, as an account's API would treat them: ``key_budget`` allows each key (its
    ``x-api-key`` or Bearer token) that many requests per fixed ``key_window`` seconds, then
    answers ``429 rate_limit_error`` with ``retry-after`` (the seconds left in its window) and
    ``anthropic-ratelimit-requests-remaining: 0`` with the window's end as its ``-reset``;
    ``revoked_keys`` answer ``401 authentication_error``. ``POST /_emulator/keys`` changes
    both while serving (``{"revoke": [...], "restore": [...], "reset_budgets": true}``).
    """

    host: str = "127.0.0.1"
    port: int = 0
    api_key: str | None = None
    tool_turns: int = 0
    parallel: int = 1
    id_style: str = "anthropic"
    reuse_ids: bool = False
    thinking: bool = False
    redacted_thinking: bool = False
    unsigned_thinking: bool = False
    expect_own_ids: bool = False
    reask_dropped: bool = False
    signing_secret: str | None = None
    fail_status: int | None = None
    fail_count: int = 0
    fail_every: int = 0
    cut_after: int | None = None
    stream_error_after: int | None = None
    stall_after: int | None = None
    stall_ms: int = 0
    ragged: bool = False
    crlf: bool = False
    max_requests: int | None = None
    delay_ms: int = 0
    record: bool = True
    threads: str = "ignore"
    usage: str | None = None
    key_budget: int | None = None
    key_window: float = 60.0
    revoked_keys: tuple[str, ...] = ()
    prompt_cache: bool = False
    diagnostics: bool = True

    @property
    def signing_key(self) -> bytes:
        return self.signing_secret.encode() if self.signing_secret else _PROCESS_SECRET


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = EmulatorOptions()
    parser.add_argument("--host", default=d.host)
    parser.add_argument("--port", type=int, default=d.port, help="0 picks a free port")
    parser.add_argument("--api-key", default=d.api_key,
                        help="require this key (x-api-key or Bearer); default accepts any")
    parser.add_argument("--tool-turns", type=int, default=d.tool_turns,
                        help="answer with tool calls while the history has fewer assistant turns")
    parser.add_argument("--parallel", type=int, default=d.parallel, help="tool calls per tool turn")
    parser.add_argument("--id-style", choices=("anthropic", "functions"), default=d.id_style,
                        help="toolu_01... ids, or Kimi-like functions.Name:N ids")
    parser.add_argument("--reuse-ids", action="store_true",
                        help="give every turn's i-th call the same id")
    parser.add_argument("--thinking", action="store_true",
                        help="start each answer with a signed thinking block")
    parser.add_argument("--redacted-thinking", action="store_true",
                        help="add a redacted_thinking block to each answer")
    parser.add_argument("--unsigned-thinking", action="store_true",
                        help="like an Anthropic-format backend that signs nothing (DeepSeek's "
                             "/anthropic): each answer starts with a thinking block whose "
                             "signature is empty, and in thinking mode an assistant message "
                             "with tool calls must come back with its thinking")
    parser.add_argument("--expect-own-ids", action="store_true",
                        help="reject tool_use ids this emulator would not have issued")
    parser.add_argument("--reask-dropped", action="store_true",
                        help="count only assistant turns that kept their tool calls, so a call "
                             "the client dropped from its history is asked for again")
    parser.add_argument("--signing-secret", default=d.signing_secret,
                        help="key for thinking signatures (default: random per process)")
    parser.add_argument("--fail-status", type=int, default=d.fail_status,
                        help="answer /v1/messages with this status (alone: always)")
    parser.add_argument("--fail-count", type=int, default=d.fail_count,
                        help="fail only the first C requests")
    parser.add_argument("--fail-every", type=int, default=d.fail_every,
                        help="fail every K-th request")
    parser.add_argument("--cut-after", type=int, default=d.cut_after,
                        help="streaming: drop the connection after E events")
    parser.add_argument("--stream-error-after", type=int, default=d.stream_error_after,
                        help="streaming: send an overloaded error event after E events")
    parser.add_argument("--stall-after", type=int, default=d.stall_after,
                        help="streaming: go quiet after E events, in the first stream only")
    parser.add_argument("--stall-ms", type=int, default=d.stall_ms,
                        help="how long --stall-after stays quiet")
    parser.add_argument("--ragged", action="store_true",
                        help="streaming: write the bytes in small irregular pieces")
    parser.add_argument("--crlf", action="store_true", help="streaming: end lines with \\r\\n")
    parser.add_argument("--max-requests", type=int, default=d.max_requests,
                        help="after M requests answer 429 to everything (bounds runaway loops)")
    parser.add_argument("--delay-ms", type=int, default=d.delay_ms,
                        help="latency before each /v1/messages answer")
    parser.add_argument("--threads", choices=THREAD_MODES, default=d.threads,
                        help="requests with `thread`: ignore the field (a backend that knows no "
                             "threads), hold conversations as the API does, or refuse them as "
                             "the API refuses what it cannot thread")
    parser.add_argument("--usage", default=d.usage, metavar="SPEC",
                        help="the usage every answer reports, as `name=count,...` with names "
                             f"{', '.join(USAGE_NAMES)} (a request's {USAGE_HEADER} header "
                             "overrides it); input defaults to a quarter of the body's bytes, "
                             "output to a quarter of the answer's; input=- or output=- leaves "
                             f"that count out, {NO_USAGE} the whole usage")
    parser.add_argument("--prompt-cache", action="store_true",
                        help="keep a prompt cache as the API does (prefixes up to each "
                             "cache_control breakpoint) and report its reads and writes in usage")
    parser.add_argument("--no-diagnostics", dest="diagnostics", action="store_false",
                        help="ignore `diagnostics` (a backend without cache diagnostics)")
    parser.add_argument("--no-record", dest="record", action="store_false",
                        help="keep no request log (long benchmarks)")
    parser.add_argument("--key-budget", type=int, default=d.key_budget,
                        help="requests each key may make per --key-window, then 429 with "
                             "retry-after")
    parser.add_argument("--key-window", type=float, default=d.key_window,
                        help="seconds of each key's budget window")
    parser.add_argument("--revoke-key", dest="revoked_keys", action="append",
                        default=[], metavar="KEY",
                        help="answer this key with 401 (may be repeated)")


def options_from_args(args) -> EmulatorOptions:
    names = [f.name for f in dataclasses.fields(EmulatorOptions)]
    values = {n: getattr(args, n) for n in names if hasattr(args, n)}
    if "revoked_keys" in values:  # repeatable on the command line: a list there
        values["revoked_keys"] = tuple(values["revoked_keys"])
    return EmulatorOptions(**values)


# --- validation -------------------------------------------------------------------------------

_BLOCK_FIELDS = {
    "text": (("text", str),),
    "tool_use": (("id", str), ("name", str), ("input", dict)),
    "tool_result": (("tool_use_id", str),),
    "thinking": (("thinking", str), ("signature", str)),
    "redacted_thinking": (("data", str),),
}
_KIND_NAMES = {str: "string", dict: "dictionary"}
_ID_FIELDS = {"tool_use": "id", "tool_result": "tool_use_id"}
# Block types a message of the other role may not hold. The user-side wording mirrors the
# confirmed assistant-side one; the real API's text for it is unconfirmed.
_FORBIDDEN_BLOCKS = {"assistant": ("tool_result", "user"), "user": ("tool_use", "assistant")}


def find_problem(body, options: EmulatorOptions, *, needs_max_tokens: bool = True) -> str | None:
    """The real API's 400 message for the first problem in a request body, or None."""
    problem = _shape_problem(body, options, needs_max_tokens)
    if problem:
        return problem
    messages = body["messages"]
    convo = [(n, m) for n, m in enumerate(messages) if m["role"] != "system"]
    return (_breakpoint_problem(body) or _system_problem(messages) or _content_problem(convo)
            or _id_problem(convo, options) or _server_result_problem(convo)
            or _pairing_problem(convo) or _open_server_call_problem(convo)
            or _signature_problem(convo, options.signing_key, options.unsigned_thinking)
            or _final_thinking_problem(convo, body.get("thinking"))
            or (_passed_back_problem(convo, body.get("thinking"))
                if options.unsigned_thinking else None))


def _shape_problem(body, options, needs_max_tokens) -> str | None:
    if not isinstance(body, dict):
        return "Input should be a valid dictionary"
    if "model" not in body:
        return "model: Field required"
    if not isinstance(body["model"], str):
        return "model: Input should be a valid string"
    if needs_max_tokens:
        if "max_tokens" not in body:
            return "max_tokens: Field required"
        max_tokens = body["max_tokens"]
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
            return "max_tokens: Input should be a valid integer"
        # 0 is valid: it writes the prompt cache and generates nothing (the SDK's
        # MessageCreateParams.max_tokens, "Set to `0` to populate the prompt cache without
        # generating a response").
        if max_tokens < 0:
            return "max_tokens: Input should be greater than or equal to 0"
    if "messages" not in body:
        return "messages: Field required"
    messages = body["messages"]
    if not isinstance(messages, list):
        return "messages: Input should be a valid list"
    if not messages:
        return "messages: at least one message is required"
    pattern, regex = ID_PATTERNS[options.id_style], _ID_REGEXES[options.id_style]
    for n, message in enumerate(messages):
        problem = _message_shape_problem(n, message, regex, pattern)
        if problem:
            return problem
    if "stream" in body and not isinstance(body["stream"], bool):
        return "stream: Input should be a valid boolean"
    return None


def _message_shape_problem(n, message, regex, pattern) -> str | None:
    if not isinstance(message, dict):
        return f"messages.{n}: Input should be a valid dictionary"
    if "role" not in message:
        return f"messages.{n}.role: Field required"
    role = message["role"]
    if role == "system":  # Claude Code sends these; the API tolerates them
        return None
    if role not in ("user", "assistant"):
        return f"messages.{n}.role: Input should be 'user' or 'assistant'"
    if "content" not in message:
        return f"messages.{n}.content: Field required"
    content = message["content"]
    if isinstance(content, str):
        return None
    if not isinstance(content, list):
        return f"messages.{n}.content: Input should be a valid list"
    for k, block in enumerate(content):
        loc = f"messages.{n}.content.{k}"
        if not isinstance(block, dict):
            return f"{loc}: Input should be a valid dictionary"
        if not isinstance(block.get("type"), str):
            return f"{loc}: Unable to extract tag using discriminator 'type'"
        block_type = block["type"]
        for field, kind in _BLOCK_FIELDS.get(block_type, ()):
            if field not in block:
                return f"{loc}.{block_type}.{field}: Field required"
            if not isinstance(block[field], kind):
                return f"{loc}.{block_type}.{field}: Input should be a valid {_KIND_NAMES[kind]}"
        id_field = _ID_FIELDS.get(block_type)
        if id_field and not regex.match(block[id_field]):
            return f"{loc}.{block_type}.{id_field}: String should match pattern '{pattern}'"
    forbidden, home = _FORBIDDEN_BLOCKS[role]
    if any(block["type"] == forbidden for block in content):
        return f"messages.{n}: `{forbidden}` blocks can only be in `{home}` messages"
    return None


# The prompt caching guide allows up to four cache breakpoints a request; the API's words for
# more are quoted in public reports (tghamm/Anthropic.SDK#50, Wei-Shaw/sub2api#176). The
# top-level `cache_control` is left out of the count: whether it counts is not on record.
MAX_BREAKPOINTS = 4
_HOLD_BLOCKS = ("content", "source", "tool", "definition", "tool_references")


def _breakpoint_problem(body) -> str | None:
    found = _breakpoints(body.get("tools")) + _breakpoints(body.get("system")) \
        + _breakpoints(body["messages"])
    if found > MAX_BREAKPOINTS:
        return (f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. "
                f"Found {found}.")
    return None


def _breakpoints(value) -> int:
    """The blocks in ``value`` that carry a ``cache_control``, following only the keys that
    hold blocks (a tool's ``input`` is free-form)."""
    if isinstance(value, list):
        return sum(_breakpoints(item) for item in value)
    if not isinstance(value, dict):
        return 0
    return (isinstance(value.get("cache_control"), dict)
            + sum(_breakpoints(value.get(key)) for key in _HOLD_BLOCKS))


def _blocks(message) -> list:
    content = message["content"]
    return content if isinstance(content, list) else []


def _content_problem(convo) -> str | None:
    last = len(convo) - 1
    for pos, (n, message) in enumerate(convo):
        if not message["content"] and not (pos == last and message["role"] == "assistant"):
            return (f"messages.{n}: all messages must have non-empty content except for the "
                    "optional final assistant message")
        for block in _blocks(message):
            if block["type"] == "text":
                if not block["text"]:
                    return "messages: text content blocks must be non-empty"
                if block["text"].isspace():
                    return "messages: text content blocks must contain non-whitespace text"
    return None


def _system_problem(messages) -> str | None:
    # claude-code#73821: "role 'system' must precede an 'assistant' message or end the array".
    for n, message in enumerate(messages[:-1]):
        if message["role"] == "system" and messages[n + 1]["role"] == "user":
            return (f"messages.{n}: role 'system' must precede an 'assistant' message or end "
                    f"the array")
    return None


# The server-tool results whose refusal without a server_tool_use is on record: the advisor's
# (claude-code#64383 and others) and web search's (quoted in greenthread-ai/klaudia).
_RESULTS_NEEDING_A_USE = ("advisor_tool_result", "web_search_tool_result")


def _server_result_problem(convo) -> str | None:
    # Any earlier server_tool_use will do, in this turn or before: the API answers a server tool
    # called beside client tools on the next request, in the next assistant turn.
    started: set = set()
    for n, message in convo:
        for k, block in enumerate(_blocks(message)):
            if block["type"] == "server_tool_use":
                started.add(str(block.get("id")))
            elif block["type"] in _RESULTS_NEEDING_A_USE \
                    and str(block.get("tool_use_id")) not in started:
                kind = block["type"]
                return (f"messages.{n}.content.{k}: unexpected `tool_use_id` found in `{kind}` "
                        f"blocks: {block.get('tool_use_id')}. Each `{kind}` block must have a "
                        "corresponding `server_tool_use` block before it.")
    return None


# The server tools whose call closed without a result is refused in recorded words: web_fetch
# (the server tools docs) and web_search (public reports).
_CALLS_NEEDING_A_RESULT = ("web_search", "web_fetch")


def _open_server_call_problem(convo) -> str | None:
    """A server call with no result after it, in an assistant turn that a user turn closes:
    the API continues such a turn only from a user turn of nothing but the client results (a
    deferred call) or, with no client call in the turn (a paused one), not at all."""
    groups: list[list] = []  # consecutive messages of one role: [role, [(n, message)]]
    for n, message in convo:
        if groups and groups[-1][0] == message["role"]:
            groups[-1][1].append((n, message))
        else:
            groups.append([message["role"], [(n, message)]])
    answered_at = {}  # a result in a user message answers too: its fault is worded elsewhere
    for n, message in convo:
        for k, block in enumerate(_blocks(message)):
            if block["type"].endswith("_tool_result") and block["type"] != "tool_result":
                answered_at[str(block.get("tool_use_id"))] = (n, k)
    for g in range(len(groups) - 1):
        role, members = groups[g]
        if role != "assistant":
            continue
        made_calls = any(b["type"] == "tool_use" for _, m in members for b in _blocks(m))
        closing = groups[g + 1][1]
        if made_calls:
            rest = []
            for _, m in closing:
                content = m["content"]
                rest += [b["type"] for b in _blocks(m)] if isinstance(content, list) else ["text"]
            while rest and rest[0] == "tool_result":
                rest.pop(0)
            if not rest:
                continue  # only the client results: the deferred call runs now
        for n, m in members:
            for k, block in enumerate(_blocks(m)):
                caller = block.get("caller")
                if block["type"] != "server_tool_use" \
                        or block.get("name") not in _CALLS_NEEDING_A_RESULT \
                        or (caller is not None
                            and not (isinstance(caller, dict) and caller.get("type") == "direct")):
                    continue
                if answered_at.get(str(block.get("id")), (-1, -1)) < (n, k):
                    name = block["name"]
                    return (f"messages.{n}: `{name}` tool use with id `{block.get('id')}` was "
                            f"found without a corresponding `{name}_tool_result` block")
    return None


def is_turn(message, options: EmulatorOptions) -> bool:
    """Whether a history entry counts as one of the script's turns.

    Every assistant message does; with ``reask_dropped`` only one that still holds its tool
    calls, like a model that sees its call gone unanswered and makes it again.
    """
    if message["role"] != "assistant":
        return False
    return not options.reask_dropped or any(b["type"] == "tool_use" for b in _blocks(message))


def _id_problem(convo, options) -> str | None:
    # A Kimi-like backend repeats its ids across turns, so only one turn's ids must differ there.
    per_turn = options.id_style == "functions"
    seen: set[str] = set()
    turn = 0
    for n, message in convo:
        if not is_turn(message, options):
            continue
        if per_turn:
            seen = set()
        for k, block in enumerate(_blocks(message)):
            if block["type"] != "tool_use":
                continue
            if block["id"] in seen:
                return f"messages.{n}.content.{k}: `tool_use` ids must be unique"
            seen.add(block["id"])
            if options.expect_own_ids:
                own = own_ids(options, turn, block["name"])
                if block["id"] not in own:
                    return (f"messages.{n}.content.{k}: unknown `tool_use` id {block['id']}: "
                            f"this backend issued {', '.join(own)} for turn {turn}")
        turn += 1
    return None


def _pairing_problem(convo) -> str | None:
    """Pairing as the API reads a history: consecutive messages of one role are one turn; the
    calls of an assistant turn must be its last blocks, and the next turn must open with their
    results. A fault names the first message of the turn where the results should have been."""
    merged: list[tuple[str, list[int], list[tuple[int, int, dict]]]] = []
    for n, message in convo:
        blocks = [(n, k, b) for k, b in enumerate(_blocks(message))]
        if merged and merged[-1][0] == message["role"]:
            merged[-1][1].append(n)
            merged[-1][2].extend(blocks)
        else:
            merged.append((message["role"], [n], blocks))
    calls: list[str] = []
    for position, (role, numbers, blocks) in enumerate(merged):
        if role == "assistant":
            calls = [b["id"] for _, _, b in blocks if b["type"] == "tool_use"]
            if not calls or position + 1 == len(merged):
                continue  # a history ending in calls is a prefill: the model's rules decide
            last_text = max((i for i, (_, _, b) in enumerate(blocks) if b["type"] == "text"),
                            default=0)
            followed = [b["id"] for _, _, b in blocks[:last_text] if b["type"] == "tool_use"]
            if followed:
                return _missing_results(merged[position + 1][1][0], followed)
            continue
        problem = _turn_results_problem(numbers[0], blocks, calls)
        if problem:
            return problem
        calls = []
    return None


def _turn_results_problem(first: int, blocks, calls: list[str]) -> str | None:
    lead = 0
    while lead < len(blocks) and blocks[lead][2]["type"] == "tool_result":
        lead += 1
    waiting = list(calls)
    for n, k, block in blocks[:lead]:
        tool_use_id = block["tool_use_id"]
        if tool_use_id in waiting:
            waiting.remove(tool_use_id)
        elif tool_use_id in calls:
            # The API's text as quoted in a public fix; the second sentence is unconfirmed.
            return (f"messages.{n}.content.{k}: each tool_use must have a single result. "
                    f"Found multiple `tool_result` blocks with id: {tool_use_id}")
        else:
            return _unexpected_result(n, k, tool_use_id)
    for n, k, block in blocks[lead:]:
        if block["type"] != "tool_result":
            continue
        tool_use_id = block["tool_use_id"]
        if tool_use_id not in calls:
            return _unexpected_result(n, k, tool_use_id)
        if tool_use_id not in waiting:
            return (f"messages.{n}.content.{k}: each tool_use must have a single result. "
                    f"Found multiple `tool_result` blocks with id: {tool_use_id}")
    if waiting:
        return _missing_results(first, waiting)
    return None


def _unexpected_result(n, k, tool_use_id) -> str:
    return (f"messages.{n}.content.{k}: unexpected `tool_use_id` found in `tool_result` blocks: "
            f"{tool_use_id}. Each `tool_result` block must have a corresponding `tool_use` "
            "block in the previous message.")


def _missing_results(n, ids) -> str:
    return (f"messages.{n}: `tool_use` ids were found without `tool_result` blocks immediately "
            f"after: {', '.join(ids)}. Each `tool_use` block must have a corresponding "
            "`tool_result` block in the next message.")


def _signature_problem(convo, key: bytes, unsigned: bool = False) -> str | None:
    for n, message in convo:
        if message["role"] != "assistant":
            continue
        for k, block in enumerate(_blocks(message)):
            if block["type"] == "thinking":
                if unsigned and block["signature"] == "":
                    continue  # what a backend that signs nothing issues, and all it can check
                if block["signature"] != sign_thinking(key, block["thinking"]):
                    return f"messages.{n}.content.{k}: Invalid `signature` in `thinking` block"
            elif block["type"] == "redacted_thinking":
                if not redacted_data_is_ours(key, block["data"]):
                    return f"messages.{n}.content.{k}: Invalid `data` in `redacted_thinking` block"
    return None


def _passed_back_problem(convo, thinking) -> str | None:
    # DeepSeek's thinking-mode guide (api-docs.deepseek.com/guides/thinking_mode): thinking
    # mode is on unless disabled, and "for turns that do perform tool calls, the
    # reasoning_content must be fully passed back to the API in all subsequent requests",
    # else a 400; its /anthropic endpoint words it as below (NousResearch/hermes-agent#22313,
    # earendil-works/pi#4003).
    if isinstance(thinking, dict) and thinking.get("type") == "disabled":
        return None
    for _, message in convo:
        blocks = _blocks(message)
        if (message["role"] == "assistant" and any(b["type"] == "tool_use" for b in blocks)
                and not any(b["type"] == "thinking" for b in blocks)):
            return "The `content[].thinking` in the thinking mode must be passed back to the API."
    return None


def _final_thinking_problem(convo, thinking) -> str | None:
    # n8n-io/n8n#22550, anthropics/claude-code#20705: with budgeted thinking on, a final
    # assistant tool-use turn whose results follow must open with its thinking. (Adaptive
    # thinking may skip a turn's thinking; the API's rule there is not on record.)
    if not isinstance(thinking, dict) or thinking.get("type") != "enabled":
        return None
    end = len(convo) - 1
    while end >= 0 and convo[end][1]["role"] != "assistant":
        end -= 1
    if end < 0 or end == len(convo) - 1:
        return None
    last = end  # consecutive assistant messages are one message group
    while last > 0 and convo[last - 1][1]["role"] == "assistant":
        last -= 1
    if not any(b["type"] == "tool_use" for _, message in convo[last:end + 1]
               for b in _blocks(message)):
        return None
    # The turn is the whole tool loop, back to the last user message that answers no call
    # (the docs' "Toggling thinking modes in conversations"; without interleaved thinking the
    # later steps of a loop carry no thinking block of their own).
    start = last
    while start > 0:
        if convo[start - 1][1]["role"] == "assistant":
            start -= 1
            continue
        # Consecutive user messages are one turn: it answers calls if any of them does.
        first = start - 1
        while first > 0 and convo[first - 1][1]["role"] == "user":
            first -= 1
        if not any(b["type"] == "tool_result" for _, message in convo[first:start]
                   for b in _blocks(message)):
            break
        start = first
    while convo[start][1]["role"] != "assistant":
        start += 1
    opening = start
    while opening <= end and convo[opening][1]["role"] == "assistant":
        opening += 1
    # What a turn another model took over must open with (the fallback guide's echo rules
    # leave out some of the declined model's blocks) is not on record.
    if any(b["type"] == "fallback" for _, message in convo[start:end + 1]
           for b in _blocks(message)):
        return None
    # Blocks an answer carries ahead of what the model wrote (an MCP server's tool listing, a
    # compaction summary), sent back unchanged: the turn's thinking comes after them.
    blocks = [b for _, message in convo[start:opening] for b in _blocks(message)
              if b["type"] not in ("mcp_tool_listing", "compaction")]
    if blocks and blocks[0]["type"] in ("thinking", "redacted_thinking"):
        return None
    found = blocks[0]["type"] if blocks else "text"  # string contents hold only text
    return (f"messages.{convo[start][0]}.content.0.type: Expected `thinking` or "
            f"`redacted_thinking`, but found `{found}`. When `thinking` is enabled, "
            "a final `assistant` message must start with a thinking block (preceeding the "
            "lastmost set of `tool_use` and `tool_result` blocks). We recommend you include "
            "thinking blocks from previous turns. To avoid this requirement, disable "
            "`thinking`. Please consult our documentation at "
            "https://docs.claude.com/en/docs/build-with-claude/extended-thinking")


def sign_thinking(key: bytes, text: str) -> str:
    return base64.b64encode(hmac.digest(key, b"thinking\0" + text.encode(), "sha256")).decode()


def redacted_data(key: bytes, turn: int) -> str:
    payload = f"emulator-redacted-turn-{turn}".encode()
    return base64.b64encode(payload + _redacted_mac(key, payload)).decode()


def redacted_data_is_ours(key: bytes, data: str) -> bool:
    try:
        raw = base64.b64decode(data, validate=True)
    except binascii.Error:
        return False
    payload, mac = raw[:-32], raw[-32:]
    return bool(payload) and hmac.compare_digest(mac, _redacted_mac(key, payload))


def _redacted_mac(key: bytes, payload: bytes) -> bytes:
    return hmac.digest(key, b"redacted\0" + payload, "sha256")


# --- the script -------------------------------------------------------------------------------

def _base62(number: int, length: int) -> str:
    chars = []
    for _ in range(length):
        number, digit = divmod(number, 62)
        chars.append(_BASE62[digit])
    return "".join(chars)


def tool_id(options: EmulatorOptions, turn: int, index: int, name: str) -> str:
    """The id of the index-th call of a turn; a pure function of the turn, so no state is kept."""
    if options.id_style == "functions":
        counter = index if options.reuse_ids else turn * options.parallel + index
        return f"functions.{name}:{counter}"
    if options.reuse_ids:
        return f"toolu_01ReusedId{index:014d}"
    digest = hashlib.sha256(f"tool:{turn}:{index}".encode()).digest()
    return "toolu_01" + _base62(int.from_bytes(digest, "big"), 22)


def own_ids(options: EmulatorOptions, turn: int, name: str) -> list[str]:
    return [tool_id(options, turn, i, name) for i in range(options.parallel)]


def _pick_tool(body: dict) -> dict | None:
    """The client tool to call: Bash if offered, else the first; None when none may be called."""
    tools = body.get("tools")
    # Server tools (web_search and the like) carry no input_schema and are never called here.
    client_tools = [t for t in tools if isinstance(t, dict) and isinstance(t.get("name"), str)
                    and isinstance(t.get("input_schema"), dict)] if isinstance(tools, list) else []
    choice = body.get("tool_choice")
    if not client_tools or (isinstance(choice, dict) and choice.get("type") == "none"):
        return None
    for tool in client_tools:
        if tool["name"] == "Bash":
            return tool
    return client_tools[0]


def _placeholder(property_schema) -> object:
    kind = property_schema.get("type") if isinstance(property_schema, dict) else None
    if not isinstance(kind, str):
        return "x"
    return {"integer": 0, "number": 0, "boolean": False, "array": [], "object": {}}.get(kind, "x")


def _tool_input(tool: dict, turn: int, index: int) -> dict:
    if tool["name"] == "Bash":
        return {"command": f"echo relay-turn-{turn}-{index}", "description": "Print a marker"}
    properties = tool["input_schema"].get("properties")
    properties = properties if isinstance(properties, dict) else {}
    required = tool["input_schema"].get("required")
    if not isinstance(required, list):
        return {}
    return {name: _placeholder(properties.get(name)) for name in required if isinstance(name, str)}


def plan_reply(body: dict, options: EmulatorOptions) -> tuple[list[dict], str]:
    """The content blocks and stop_reason the script gives for a (valid) request."""
    if body.get("max_tokens") == 0:  # a cache warm-up: nothing generated
        return [], "max_tokens"
    turn = sum(1 for m in body["messages"] if is_turn(m, options))
    tool = _pick_tool(body)
    tool_turn = turn < options.tool_turns and tool is not None
    content: list[dict] = []
    thinking = body.get("thinking")
    # A request that turns thinking off gets none, as from the real API.
    thinks = not (isinstance(thinking, dict) and thinking.get("type") == "disabled")
    if (options.thinking or options.unsigned_thinking) and thinks:
        thought = (f"Turn {turn}: the plan calls for "
                   f"{'a tool call' if tool_turn else 'a final answer'} now.")
        content.append({"type": "thinking", "thinking": thought, "signature":
                        "" if options.unsigned_thinking
                        else sign_thinking(options.signing_key, thought)})
    if options.redacted_thinking and thinks:
        content.append({"type": "redacted_thinking",
                        "data": redacted_data(options.signing_key, turn)})
    if turn >= options.tool_turns:
        content.append({"type": "text", "text": f"All {options.tool_turns} tool turns done."})
        return content, "end_turn"
    if tool is None:
        content.append({"type": "text", "text": f"Turn {turn}: no tool to call, so in words."})
        return content, "end_turn"
    name = tool["name"]
    content.append({"type": "text", "text": f"Turn {turn}: calling {name}."})
    for i in range(options.parallel):
        content.append({"type": "tool_use", "id": tool_id(options, turn, i, name), "name": name,
                        "input": _tool_input(tool, turn, i)})
    return content, "tool_use"


# What an answer's usage can be told to report (--usage, or a request's x-emulator-usage):
# counts by name; `split=0` leaves out the cache_creation breakdown by lifetime, as answers
# from before one-hour caching did. Like backends that report less than the API: `input=-`
# or `output=-` leaves that count out, and `none` the whole usage (an OpenAI-format server
# then ignores stream_options.include_usage, as many do).
USAGE_HEADER = "x-emulator-usage"
USAGE_NAMES = ("input", "output", "cache_read", "cache_write_5m", "cache_write_1h",
               "web_search", "web_fetch", "split")
WITHHELD = {"input": "input_tokens", "output": "output_tokens"}  # the counts `-` may leave out
NO_USAGE = "none"


def parse_usage(spec: str | None) -> dict[str, int | None]:
    """``"input=10,cache_read=900"`` as ``{"input": 10, "cache_read": 900}``, ``output=-`` as
    ``{"output": None}``, ``none`` as ``{"none": None}``; a ValueError naming what is
    wrong."""
    report: dict[str, int | None] = {}
    for part in (spec or "").split(","):
        if not part.strip():
            continue
        if part.strip() == NO_USAGE:
            report[NO_USAGE] = None
            continue
        name, _, value = part.partition("=")
        name, value = name.strip(), value.strip()
        if name in WITHHELD and value == "-":
            report[name] = None
            continue
        if name not in USAGE_NAMES or not value.isdigit():
            raise ValueError(f"{USAGE_HEADER}: {part.strip()!r} is not NAME=COUNT with a name "
                             f"among {', '.join(USAGE_NAMES)} (or input=-, output=-, "
                             f"{NO_USAGE})")
        report[name] = int(value)
    return report


def withhold(message: dict, report: dict[str, int | None]) -> None:
    """Leave out of ``message``'s usage what ``report`` says the backend does not report."""
    if NO_USAGE in report:
        del message["usage"]
        return
    for name, field in WITHHELD.items():
        if name in report and report[name] is None:
            del message["usage"][field]


def message_usage(report: dict[str, int | None], input_tokens: int,
                  output_tokens: int) -> dict:
    """An answer's ``usage`` as the API shapes it: the input the cache neither served nor
    took, the cache's reads and writes apart (the writes by lifetime), the server tools'
    requests when there were any."""
    five, hour = report.get("cache_write_5m") or 0, report.get("cache_write_1h") or 0
    usage: dict = {"input_tokens": report.get("input", input_tokens),
                   "cache_creation_input_tokens": five + hour,
                   "cache_read_input_tokens": report.get("cache_read", 0)}
    if report.get("split", 1):
        usage["cache_creation"] = {"ephemeral_5m_input_tokens": five,
                                   "ephemeral_1h_input_tokens": hour}
    usage["output_tokens"] = report.get("output", output_tokens)
    tools = {f"{name}_requests": report[name] for name in ("web_search", "web_fetch")
             if report.get(name)}
    if tools:
        usage["server_tool_use"] = {"web_search_requests": 0, "web_fetch_requests": 0, **tools}
    return usage


def build_message(body: dict, options: EmulatorOptions, input_tokens: int,
                  report: dict[str, int | None] | None = None) -> dict:
    content, stop_reason = plan_reply(body, options)
    output_tokens = max(1, len(orjson.dumps(content)) // 4) if content else 0
    return {
        "id": "msg_01" + _base62(int.from_bytes(os.urandom(17), "big"), 22),
        "type": "message",
        "role": "assistant",
        "model": body["model"],
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": None,
        "usage": message_usage(report or {}, input_tokens, output_tokens),
    }


def _halves(text: str) -> list[str]:
    middle = len(text) // 2
    return [text[:middle], text[middle:]] if middle else [text]


def _block_events(index: int, block: dict) -> list[dict]:
    kind = block["type"]
    start: dict
    deltas: list[dict]
    if kind == "text":
        start = {"type": "text", "text": ""}
        deltas = [{"type": "text_delta", "text": piece} for piece in _halves(block["text"])]
    elif kind == "thinking":
        start = {"type": "thinking", "thinking": "", "signature": ""}
        deltas = [{"type": "thinking_delta", "thinking": p} for p in _halves(block["thinking"])]
        if block["signature"]:  # a backend that signs nothing sends no signature
            deltas.append({"type": "signature_delta", "signature": block["signature"]})
    elif kind == "tool_use":
        start = dict(block, input={})
        arguments = orjson.dumps(block["input"]).decode()
        deltas = [{"type": "input_json_delta", "partial_json": p}
                  for p in ["", *_halves(arguments)]]
    else:  # complete in its start event, like redacted_thinking
        start, deltas = block, []
    return [
        {"type": "content_block_start", "index": index, "content_block": start},
        *({"type": "content_block_delta", "index": index, "delta": d} for d in deltas),
        {"type": "content_block_stop", "index": index},
    ]


def stream_events(message: dict) -> list[dict]:
    """The SSE events that carry ``message``, in the API's order: ``message_start`` with the
    input side of the usage (and one output token), the ``message_delta`` with the usage so
    far, cumulative, without the breakdown by lifetime (the SDK's MessageDeltaUsage)."""
    usage = message.get("usage")  # none from a backend told to report none
    start = dict(message, content=[], stop_reason=None, stop_sequence=None)
    delta: dict = {"type": "message_delta",
                   "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None}}
    if usage is not None:
        # No server tool has run yet when the stream starts.
        start["usage"] = {name: value for name, value in usage.items()
                          if name != "server_tool_use"}
        if "output_tokens" in usage:
            start["usage"]["output_tokens"] = 1
        delta["usage"] = {name: value for name, value in usage.items()
                          if name != "cache_creation"}
    events: list[dict] = [{"type": "message_start", "message": start}, {"type": "ping"}]
    for index, block in enumerate(message["content"]):
        events.extend(_block_events(index, block))
    events.append(delta)
    events.append({"type": "message_stop"})
    return events


def encode_event(event: dict, crlf: bool = False) -> bytes:
    eol = b"\r\n" if crlf else b"\n"
    return b"event: " + event["type"].encode() + eol + b"data: " + orjson.dumps(event) + eol + eol


class RaggedSplitter:
    """Cuts a byte stream into pieces of irregular size, carrying the rest across writes."""

    def __init__(self, sizes=RAGGED_SIZES):
        self._sizes = itertools.cycle(sizes)
        self._size = next(self._sizes)
        self._pending = b""

    def feed(self, data: bytes) -> list[bytes]:
        self._pending += data
        pieces = []
        while len(self._pending) >= self._size:
            pieces.append(self._pending[:self._size])
            self._pending = self._pending[self._size:]
            self._size = next(self._sizes)
        return pieces

    def flush(self) -> bytes:
        rest, self._pending = self._pending, b""
        return rest


# --- the server -------------------------------------------------------------------------------

def parse_body(raw: bytes) -> tuple[object, str | None]:
    """The parsed body, or None and the API's message for bytes that are not JSON."""
    try:
        return orjson.loads(raw), None
    except orjson.JSONDecodeError as exc:
        # The real API parses with orjson too: its texts ("no low surrogate in string: ...")
        # are orjson's.
        return None, f"The request body is not valid JSON: {exc}"


def is_fault(number: int, options: EmulatorOptions) -> bool:
    """Whether the number-th /v1/messages request gets the fail status."""
    if options.fail_status is None:
        return False
    if not (options.fail_count or options.fail_every):
        return True
    every = options.fail_every
    return number <= options.fail_count or bool(every and number % every == 0)


@dataclasses.dataclass
class EmulatorState:
    options: EmulatorOptions
    records: list[tuple] = dataclasses.field(default_factory=list)
    # --threads hold: (key, answer id) -> (the conversation up to and with that answer, the
    # fields the thread was created with); an answer continued once leaves it. Each key is
    # an account of its own, as for its budget: a thread is held where it was made.
    threads: dict = dataclasses.field(default_factory=dict)
    continued: dict = dataclasses.field(default_factory=dict)  # (key, answer id) continued
    answered: dict = dataclasses.field(default_factory=dict)  # ids of answers with diagnostics
    # --prompt-cache: the hash of a prefix up to a breakpoint -> when it expires (monotonic)
    prompt_cache: dict = dataclasses.field(default_factory=dict)
    received: int = 0  # every /v1/* request
    messages: int = 0  # authorised /v1/messages requests: what faults and the budget count
    stalled: bool = False  # --stall-after has had its stream
    revoked: set = dataclasses.field(default_factory=set)  # keys answered with 401
    windows: dict = dataclasses.field(default_factory=dict)  # key -> [window start, used]

    def __post_init__(self) -> None:
        self.revoked.update(self.options.revoked_keys)


STATE = web.AppKey("emulator_state", EmulatorState)


@dataclasses.dataclass
class Incoming:
    """What the front door learned about a request, for the handler behind it."""
    request_id: str
    raw: bytes = b""
    body: Any = None  # the parsed JSON, whatever value it is
    json_problem: str | None = None


INCOMING = web.RequestKey("emulator_incoming", Incoming)


def error_response(request: web.Request, status: int, message: str, *,
                   headers: dict | None = None) -> web.Response:
    error_type = STATUS_TYPES.get(status) or (
        "invalid_request_error" if status < 500 else "api_error")
    body = {"type": "error", "error": {"type": error_type, "message": message},
            "request_id": request[INCOMING].request_id}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json",
                        headers=headers)


def _authorised(request: web.Request, api_key: str | None) -> bool:
    if api_key is None:
        return True
    return (request.headers.get("x-api-key") == api_key
            or request.headers.get("authorization") == f"Bearer {api_key}")


def front_door(authorised, refuse, unauthorised):
    """The middleware an emulated API puts first: it names each request, records it, reads
    and parses its body, and checks its key. ``authorised(request, api_key)`` says whether the
    key is good, ``unauthorised(request)`` answers when it is not, and ``refuse(request,
    status, message)`` answers in that API's error format (too large a body, the router's 404
    and 405)."""
    @web.middleware
    async def door(request: web.Request, handler):
        incoming = request[INCOMING] = Incoming("req_" + os.urandom(12).hex())
        if not request.path.startswith("/v1/"):
            return await handler(request)
        state = request.app[STATE]
        state.received += 1
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return refuse(request, 413, FAULT_MESSAGES[413])
        incoming.raw = raw
        incoming.body, incoming.json_problem = parse_body(raw)
        if state.options.record:
            # The raw bytes, not the parsed body: a list of many large parsed bodies makes
            # every garbage collection crawl through them, which tripled a request's cost.
            state.records.append((incoming.request_id, request.method, request.path,
                                  request.query_string, request.raw_headers, raw))
        if not authorised(request, state.options.api_key):
            return unauthorised(request)
        try:
            return await handler(request)
        except web.HTTPException as exc:  # the router's 404 and 405, in the API's format
            return refuse(request, exc.status, exc.reason)
    return door


_front_door = front_door(_authorised, error_response,
                         lambda request: error_response(request, 401, "invalid x-api-key"))


async def _stamp_headers(request: web.Request, response: web.StreamResponse) -> None:
    options = request.app[STATE].options
    response.headers["request-id"] = request[INCOMING].request_id
    if options.max_requests is None:
        limit, remaining = 4000, 3999
    else:
        limit = options.max_requests
        remaining = max(0, limit - request.app[STATE].messages)
    response.headers.setdefault("anthropic-ratelimit-requests-limit", str(limit))
    response.headers.setdefault("anthropic-ratelimit-requests-remaining", str(remaining))


def _checked_body(request: web.Request, options: EmulatorOptions, *, needs_max_tokens: bool):
    """The request's body, or the 400 response that refuses it."""
    incoming = request[INCOMING]
    if incoming.json_problem:
        return None, error_response(request, 400, incoming.json_problem)
    body = incoming.body
    problem = find_problem(body, options, needs_max_tokens=needs_max_tokens)
    return (None, error_response(request, 400, problem)) if problem else (body, None)


async def admit(request: web.Request, refuse=None) -> web.Response | None:
    """What every answering request goes through first, in any emulated format: it counts,
    waits ``delay_ms``, and meets the request budget and the scripted faults; the refusal
    (made by ``refuse``, that format's ``error_response``) or None to go on."""
    refuse = refuse or error_response
    state = request.app[STATE]
    options = state.options
    state.messages += 1
    number = state.messages
    if options.delay_ms:
        await asyncio.sleep(options.delay_ms / 1000)
    if options.max_requests is not None and number > options.max_requests:
        # x-should-retry: false makes SDK clients give up at once instead of retrying.
        return refuse(request, 429, "request budget exhausted",
                      headers={"retry-after": "0", "x-should-retry": "false"})
    refusal = _key_refusal(request, state, refuse)
    if refusal is not None:
        return refusal
    status = options.fail_status
    if status is not None and is_fault(number, options):
        return refuse(request, status, FAULT_MESSAGES.get(status, "Emulated failure"),
                      headers={"retry-after": "0"} if status == 429 else None)
    return None


def presented_key(request: web.Request) -> str | None:
    """The key a request carries: its ``x-api-key``, else its Bearer token."""
    key = request.headers.get("x-api-key")
    if key:
        return key
    authorization = request.headers.get("authorization", "")
    return authorization[7:] if authorization.lower().startswith("bearer ") else None


def _key_refusal(request: web.Request, state: EmulatorState, refuse) -> web.Response | None:
    """A revoked key's 401, or the 429 of a key past its budget in this window."""
    key = presented_key(request)
    if key is not None and key in state.revoked:
        return refuse(request, 401, FAULT_MESSAGES[401])
    options = state.options
    if options.key_budget is None or key is None:
        return None
    now = time.time()
    window = state.windows.get(key)
    if window is None or now >= window[0] + options.key_window:
        window = state.windows[key] = [now, 0]
    if window[1] >= options.key_budget:
        end = window[0] + options.key_window
        reset = datetime.datetime.fromtimestamp(end, datetime.timezone.utc)
        return refuse(request, 429, FAULT_MESSAGES[429], headers={
            "retry-after": str(max(1, math.ceil(end - now))),
            "anthropic-ratelimit-requests-limit": str(options.key_budget),
            "anthropic-ratelimit-requests-remaining": "0",
            "anthropic-ratelimit-requests-reset": reset.isoformat().replace("+00:00", "Z")})
    window[1] += 1
    return None


async def handle_keys(request: web.Request) -> web.Response:
    state = request.app[STATE]
    asked = orjson.loads(await request.read() or b"{}")
    state.revoked.update(asked.get("revoke") or ())
    state.revoked.difference_update(asked.get("restore") or ())
    if asked.get("reset_budgets"):
        state.windows.clear()
    return _json({"revoked": len(state.revoked)})


async def handle_messages(request: web.Request) -> web.StreamResponse:
    refusal = await admit(request)
    if refusal:
        return refusal
    options = request.app[STATE].options
    thread, refusal = _thread_of(request, options)
    if refusal:
        return refusal
    body, refusal = _checked_body(request, options, needs_max_tokens=True)
    if refusal:
        return refusal
    try:
        report = parse_usage(request.headers.get(USAGE_HEADER, options.usage))
    except ValueError as e:
        return error_response(request, 400, str(e))
    message = build_message(body, options, len(request[INCOMING].raw) // 4, report)
    if options.prompt_cache:
        _cache_usage(request.app[STATE], body, message)
    if options.diagnostics:
        _diagnose(request.app[STATE], body, message)
    if thread is not None:
        _hold(request.app[STATE], presented_key(request), thread, body, message)
    withhold(message, report)
    if body.get("stream"):
        return await _stream(request, message, options)
    return _json(message)


# --- server-held threads ------------------------------------------------------------------
# From the anthropic SDK 2.14's types and thread helper, read on their own: `thread` is
# {"type": "create"} or {"type": "continue", "previous_message_id"} (beta_thread_*_params.py,
# beta message-threads-2026-08-12); a continuation sends only the new messages and no
# `system` or `tools`, which the thread keeps (CREATE_ONLY_FIELDS in _thread_state.py); an
# unknown id is 404 `thread_not_found`, an answer continued twice is 400
# `thread_already_continued`, and a server that cannot thread a request says 400
# `thread_unsupported_request` (_error_classes.py, thread_*_error_details.py). The messages
# that go with those codes are the emulator's own: the API's texts are unrecorded.

THREAD_MODES = ("ignore", "hold", "refuse")
THREADS_BETA = "message-threads-2026-08-12"
CREATE_ONLY = ("system", "tools")
MAX_HELD = 1000


def thread_error(request: web.Request, status: int, code: str, message: str) -> web.Response:
    error_type = STATUS_TYPES[status]
    body = {"type": "error", "error": {"type": error_type, "message": message,
                                       "details": {"error_code": code}},
            "request_id": request[INCOMING].request_id}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


def _thread_of(request: web.Request, options: EmulatorOptions):
    """The request's `thread` (None without one), or the answer refusing it. A continuation's
    body becomes the whole conversation here, so that every later check judges all of it."""
    incoming = request[INCOMING]
    body = incoming.body
    thread = body.get("thread") if isinstance(body, dict) else None
    if thread is None or options.threads == "ignore":
        return None, None
    if options.threads == "refuse":
        return None, thread_error(request, 400, "thread_unsupported_request",
                                  "thread: this server cannot hold this conversation; send "
                                  "the full conversation without `thread`")
    betas = ",".join(request.headers.getall("anthropic-beta", ()))
    if THREADS_BETA not in [b.strip() for b in betas.split(",")]:
        return None, error_response(request, 400, "thread: Extra inputs are not permitted")
    kind = thread.get("type") if isinstance(thread, dict) else None
    if kind == "create":
        return thread, None
    previous = thread.get("previous_message_id") if isinstance(thread, dict) else None
    if kind != "continue" or not isinstance(previous, str):
        return None, error_response(request, 400, "thread: Input tag does not match any of "
                                                  "the expected tags: 'create', 'continue'")
    state = request.app[STATE]
    held = state.threads.get((presented_key(request), previous))
    if held is None:
        if (presented_key(request), previous) in state.continued:
            return None, thread_error(request, 400, "thread_already_continued",
                                      f"previous_message_id: {previous} was already continued")
        return None, thread_error(request, 404, "thread_not_found",
                                  f"previous_message_id: no thread state for {previous}")
    conversation, fields = held
    repeated = [name for name in CREATE_ONLY if name in body]
    if repeated:
        return None, error_response(request, 400, f"{repeated[0]}: cannot be sent when "
                                                  f"continuing a thread")
    messages = body.get("messages")
    if not isinstance(messages, list):
        return thread, None  # the shape check names it
    incoming.body = {**fields, **body, "messages": conversation + messages}
    return thread, None


def _diagnose(state: EmulatorState, body: dict, message: dict) -> None:
    """Cache diagnostics (beta cache-diagnosis-2026-04-07, SDK types beta_diagnostics*.py and
    beta_cache_miss_*.py): a request's `diagnostics.previous_message_id` gets the answer's
    `diagnostics.cache_miss_reason`. This emulator keeps no cache: an id it did not answer
    is `previous_message_not_found`, one it did is `unavailable`."""
    asked = body.get("diagnostics")
    if not isinstance(asked, dict):
        return
    previous = asked.get("previous_message_id")
    if previous is None:
        reason = None
    elif previous in state.answered:
        reason = {"type": "unavailable"}
    else:
        reason = {"type": "previous_message_not_found"}
    message["diagnostics"] = {"cache_miss_reason": reason}
    state.answered[message["id"]] = True
    if len(state.answered) > MAX_HELD:
        del state.answered[next(iter(state.answered))]


# --- the prompt cache ---------------------------------------------------------------------
# Anthropic's prompt caching guide, read on its own: the prompt is tools, then system, then
# messages; a breakpoint caches the prefix up to and including its block, for 5 minutes (ttl
# "1h": an hour), refreshed on each read; the model is part of every entry, and the thinking
# settings and tool_choice of the messages' part. The emulator hashes decoded values (its
# own rendering, apart from the relay's fingerprint of the raw bytes) and counts a token per
# four bytes of them. Only exact breakpoint positions hit (the API also looks back up to 20
# blocks from each).

CACHE_TTL = {"5m": 300.0, "1h": 3600.0}


def _uncached(value):
    if isinstance(value, dict):
        return {k: _uncached(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [_uncached(v) for v in value]
    return value


def _control(value) -> dict | None:
    """The block's cache_control, or one inside it (a tool result's content)."""
    if isinstance(value, dict):
        if isinstance(value.get("cache_control"), dict):
            return value["cache_control"]
        for item in value.values():
            found = _control(item)
            if found is not None:
                return found
    elif isinstance(value, list):
        for item in value:
            found = _control(item)
            if found is not None:
                return found
    return None


def _cache_usage(state: EmulatorState, body: dict, message: dict) -> None:
    pieces: list = [["model", body.get("model"), body.get("speed")]]
    marks: list = [None]
    for tool in body.get("tools") or ():
        pieces.append(_uncached(tool))
        marks.append(_control(tool))
    system = body.get("system")
    for block in ([{"type": "text", "text": system}] if isinstance(system, str)
                  else system or ()):
        pieces.append(_uncached(block))
        marks.append(_control(block))
    pieces.append(["parameters", body.get("thinking"), body.get("tool_choice")])
    marks.append(None)
    for item in body.get("messages") or ():
        pieces.append(["role", item.get("role")])
        marks.append(None)
        content = item.get("content")
        for block in ([{"type": "text", "text": content}] if isinstance(content, str)
                      else content or ()):
            pieces.append(_uncached(block))
            marks.append(_control(block))
    if isinstance(body.get("cache_control"), dict):
        marks[-1] = body["cache_control"]
    now = time.monotonic()
    digest = hashlib.sha256()
    chain, tokens, total = [], [], 0
    for piece in pieces:
        raw = orjson.dumps(piece, option=orjson.OPT_SORT_KEYS)
        digest.update(raw)
        chain.append(digest.copy().digest())
        total += len(raw) // 4
        tokens.append(total)
    breakpoints = [i for i, mark in enumerate(marks) if mark is not None]
    cache = state.prompt_cache
    hit = -1
    for i in reversed(breakpoints):
        if cache.get(chain[i], 0.0) > now:
            hit = i
            break
    read = tokens[hit] if hit >= 0 else 0
    written = {"5m": 0, "1h": 0}
    done = read
    for i in breakpoints:
        ttl = marks[i].get("ttl") if marks[i].get("ttl") in CACHE_TTL else "5m"
        cache[chain[i]] = max(cache.get(chain[i], 0.0), now + CACHE_TTL[ttl])
        if i > hit:
            written[ttl] += tokens[i] - done
            done = tokens[i]
    while len(cache) > MAX_HELD:
        del cache[next(iter(cache))]
    usage = message["usage"]
    usage.update(input_tokens=max(0, total - done), cache_read_input_tokens=read,
                 cache_creation_input_tokens=written["5m"] + written["1h"],
                 cache_creation={"ephemeral_5m_input_tokens": written["5m"],
                                 "ephemeral_1h_input_tokens": written["1h"]})


def _hold(state: EmulatorState, key: str | None, thread: dict, body: dict,
          message: dict) -> None:
    """Keep the conversation under the answer's id, in the account of the key it came with;
    the answer it continued is used up (a refused continuation uses up nothing)."""
    previous = (key, thread.get("previous_message_id"))
    if thread.get("type") == "continue" and state.threads.pop(previous, None) is not None:
        state.continued[previous] = True
        if len(state.continued) > MAX_HELD:
            del state.continued[next(iter(state.continued))]
    held = state.threads
    if len(held) >= MAX_HELD:
        del held[next(iter(held))]
    fields = {name: body[name] for name in CREATE_ONLY if name in body}
    answer = {"role": "assistant", "content": message["content"]}
    held[key, message["id"]] = (body["messages"] + [answer], fields)


async def _stream(request: web.Request, message: dict,
                  options: EmulatorOptions) -> web.StreamResponse:
    response = web.StreamResponse(headers={"content-type": "text/event-stream",
                                           "cache-control": "no-cache"})
    await response.prepare(request)
    state = request.app[STATE]
    stall = options.stall_after if not state.stalled else None
    state.stalled = state.stalled or stall is not None
    splitter = RaggedSplitter() if options.ragged else None

    async def send(data: bytes) -> None:
        if splitter is None:
            await response.write(data)
            return
        for piece in splitter.feed(data):
            await response.write(piece)
            await asyncio.sleep(0)  # let each piece leave on its own

    try:
        for sent, event in enumerate(stream_events(message)):
            if sent == options.cut_after:
                if splitter:
                    await response.write(splitter.flush())
                # Closing the socket mid-body leaves the chunked response unterminated, which
                # is what a dropped upstream connection looks like to the client.
                if request.transport:
                    request.transport.close()
                return response
            if sent == stall:
                await asyncio.sleep(options.stall_ms / 1000)
            if sent == options.stream_error_after:
                await send(encode_event({"type": "error", "error": {
                    "type": "overloaded_error", "message": "Overloaded"}}, options.crlf))
                break
            await send(encode_event(event, options.crlf))
        if splitter:
            await response.write(splitter.flush())
        await response.write_eof()
    except ConnectionError:  # the client went away; nothing is left to tell it
        pass
    return response


async def handle_count_tokens(request: web.Request) -> web.Response:
    _, refusal = _checked_body(request, request.app[STATE].options, needs_max_tokens=False)
    if refusal:
        return refusal
    return _json({"input_tokens": len(request[INCOMING].raw) // 4})


def _json(value) -> web.Response:
    return web.Response(body=orjson.dumps(value), content_type="application/json")


async def handle_models(request: web.Request) -> web.Response:
    return _json({"data": MODELS, "has_more": False, "first_id": MODELS[0]["id"],
                              "last_id": MODELS[-1]["id"]})


async def handle_model(request: web.Request) -> web.Response:
    model_id = request.match_info["model_id"]
    for model in MODELS:
        if model["id"] == model_id:
            return _json(model)
    return error_response(request, 404, f"model: {model_id}")


async def handle_records(request: web.Request) -> web.Response:
    return _json([
        {"request_id": request_id, "method": method, "path": path, "query": query,
         "headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in raw_headers],
         "body": parse_body(raw)[0], "body_sha256": hashlib.sha256(raw).hexdigest()}
        for request_id, method, path, query, raw_headers, raw in request.app[STATE].records
    ])


async def handle_clear_records(request: web.Request) -> web.Response:
    request.app[STATE].records.clear()
    return _json({"cleared": True})


async def handle_stats(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return _json({"requests": state.received, "messages": state.messages})


def create_app(options: EmulatorOptions) -> web.Application:
    app = web.Application(middlewares=[_front_door], client_max_size=MAX_BODY_BYTES)
    app[STATE] = EmulatorState(options)
    app.on_response_prepare.append(_stamp_headers)
    app.router.add_post("/v1/messages", handle_messages)
    app.router.add_post("/v1/messages/count_tokens", handle_count_tokens)
    app.router.add_get("/v1/models", handle_models)
    app.router.add_get("/v1/models/{model_id}", handle_model)
    app.router.add_get("/_emulator/requests", handle_records)
    app.router.add_delete("/_emulator/requests", handle_clear_records)
    app.router.add_get("/_emulator/stats", handle_stats)
    app.router.add_post("/_emulator/keys", handle_keys)
    return app


async def serve(options, make_app=None, name: str = "emulator") -> None:
    """Serve until SIGINT or SIGTERM, announcing the bound address on stdout as ``name``.
    ``make_app`` builds the application from the options (``options.host`` and ``.port``
    say where it listens): this emulator's, unless another's (the other format's, the
    hostile upstream's)."""
    # A stopping emulator does not wait for answers held back by --delay-ms (aiohttp's
    # default waits up to 60 s for handlers).
    runner = web.AppRunner((make_app or create_app)(options), access_log=None,
                           shutdown_timeout=1.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, options.host, options.port)
        await site.start()
        port = runner.addresses[0][1]
        print(f"{name} listening on http://{options.host}:{port}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()


def main(args) -> int:
    asyncio.run(serve(options_from_args(args)))
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(description="A strict Anthropic Messages API emulator.")
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
