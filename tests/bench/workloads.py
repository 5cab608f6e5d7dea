"""What the benchmark sends and what its mock upstream answers, generated deterministically.

Shared by the mock upstream, the load generator and the micro-benchmarks, so that every
process builds the same bytes from the same seed (nothing large crosses a pipe).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import random
import string

import orjson
from relay_builtins import portable

MODEL = "claude-sonnet-4-5-20250929"
# Long enough to be a relay key too (16 characters or more): the accounting relay's client.
KEY = "bench-key-0123456789"
HEADERS = {"content-type": "application/json", "x-api-key": KEY,
           "anthropic-version": "2023-06-01"}
HISTORY_MESSAGES = 500
HISTORY_PAIRS = 250
RESULT_SIZE = 3250  # mean tool_result length: makes the history body 1,006,507 bytes
REUSE_EVERY = 25  # with reuse, every 25th tool call repeats an earlier id: 10 exact duplicates

# The workloads: how the request body is made and which canned answer the mock gives.
# "query" selects the mock's answer, so the mock never parses a body.
WORKLOADS = {
    "small": {"body": "small", "query": "mock=json", "stream": False},
    "history_changed": {"body": "history_reused", "query": "mock=json", "stream": False},
    "history_unchanged": {"body": "history_unique", "query": "mock=json", "stream": False},
    "stream50": {"body": "small_stream", "query": "mock=sse&events=50", "stream": True},
    "stream2000": {"body": "small_stream", "query": "mock=sse&events=2000", "stream": True},
    # The same stream from an upstream that sends 50 events at a time (a fast backend, a
    # cached replay): the proxies get big chunks, so what each does per event shows.
    "stream2000_burst": {"body": "small_stream", "query": "mock=sse&events=2000&per_send=50",
                         "stream": True},
    # A coding agent's session: the 500-message history growing by one turn per request,
    # each request the previous one's bytes up to its last message, where the cache marker
    # moves (session_bodies); each connection of the load takes turns with sessions of its own.
    "session": {"body": "session", "query": "mock=json", "stream": False, "session": "grow"},
}
# The history workloads send every request as the first of a session of its own (a new
# session id each time): what the relay does with a history it has never seen.
for _name in ("history_changed", "history_unchanged"):
    WORKLOADS[_name]["session"] = "fresh"
SESSION_HEADER = "x-claude-code-session-id"
SESSION_REQUESTS = 40  # the turns of a growing session (the next one begins at the first)
IDLE_QUERY = "mock=idle"

_WORDS = ("the", "relay", "tool", "result", "file", "line", "def", "return", "self", "import",
          "value", "error", "test", "config", "stream", "event", "block", "message", "id",
          "request", "response", "upstream", "client", "json", "path", "async", "await",
          "None", "True", "False", "if", "for", "in", "not", "is", "and", "or", "with",
          "naïve", "café", "→", "✓", "データ", "\"quoted\"", "back\\slash", "tab\there")


_ASCII_WORDS = tuple(w for w in _WORDS if w.isascii())


def _text(rng: random.Random, size: int, words: tuple = _WORDS) -> str:
    """About ``size`` characters of code-ish text with newlines, quotes and some non-ASCII."""
    out = []
    n = 0
    while n < size:
        line = " " * (4 * rng.randrange(4)) + " ".join(rng.choice(words) for _ in range(rng.randrange(3, 12)))
        out.append(line)
        n += len(line) + 1
    return "\n".join(out)[:size]


def _tool_id(rng: random.Random) -> str:
    return "toolu_01" + "".join(rng.choice(string.ascii_letters + string.digits) for _ in range(22))


def small_request(stream: bool = False) -> dict:
    body = {"model": MODEL, "max_tokens": 1024,
            "messages": [{"role": "user", "content": "Say hello in one short sentence."}]}
    if stream:
        body["stream"] = True
    return body


def history_messages(reuse: bool, result_size: int = RESULT_SIZE, ascii_only: bool = False) -> list:
    """500 messages, 250 tool_use/tool_result pairs, valid for the pairing contract.

    A user task, then 249 tool turns (one of them with two parallel calls), and one
    ``role: "system"`` entry as Claude Code puts in ``messages``: 1 + 498 + 1 = 500. With
    ``reuse``, every REUSE_EVERY-th call repeats the id of a call ten turns earlier (and its
    result answers it with that id): exact duplicates, which dedup rewrites.

    The text has a few non-ASCII words (as Claude Code's own "→" line markers in Read
    results), so most strings are not pure ASCII, which costs JSON codecs about twice as much
    as ASCII; ``ascii_only`` leaves them out, for comparison.
    """
    rng = random.Random(20240611)
    words = _ASCII_WORDS if ascii_only else _WORDS

    def text(rng: random.Random, size: int) -> str:
        return _text(rng, size, words)

    messages: list = [{"role": "user", "content": [
        {"type": "text", "text": "Refactor the relay so that its hot path allocates less.\n"
                                 + text(rng, 900)}]}]
    ids: list[str] = []
    calls = 0
    for turn in range(249):
        parallel = 2 if turn == 120 else 1
        uses, results = [], []
        for _ in range(parallel):
            calls += 1
            tool_id = _tool_id(rng)
            if reuse and calls % REUSE_EVERY == 0:
                tool_id = ids[-10]
            ids.append(tool_id)
            if calls % 2:
                tool = {"type": "tool_use", "id": tool_id, "name": "Bash",
                        "input": {"command": f"grep -rn \"{rng.choice(_WORDS)}\" relay/ | head -50",
                                  "description": "Search the relay for a word"}}
            else:
                tool = {"type": "tool_use", "id": tool_id, "name": "Read",
                        "input": {"file_path": f"/srv/project/relay/{rng.choice(_WORDS)}.py",
                                  "offset": rng.randrange(1, 400), "limit": 200}}
            uses.append(tool)
            size = rng.randrange(result_size // 2, result_size * 3 // 2)
            content = text(rng, size)
            if calls % 3 == 0:
                results.append({"type": "tool_result", "tool_use_id": tool_id,
                                "content": [{"type": "text", "text": content}]})
            else:
                results.append({"type": "tool_result", "tool_use_id": tool_id, "content": content,
                                **({"is_error": True} if calls % 17 == 0 else {})})
        messages.append({"role": "assistant", "content": [
            {"type": "text", "text": text(rng, rng.randrange(80, 400))}, *uses]})
        if turn % 40 == 39:
            results.append({"type": "text", "text": "Keep going, and keep the tests green."})
        messages.append({"role": "user", "content": results})
        if turn == 200:
            messages.append({"role": "system", "content": "Context: the user switched branches."})
    assert len(messages) == HISTORY_MESSAGES and calls == HISTORY_PAIRS, (len(messages), calls)
    return messages


def history_request(reuse: bool, result_size: int | None = None, ascii_only: bool = False) -> dict:
    return {"model": MODEL, "max_tokens": 32000,
            "system": [{"type": "text", "text": "You are a coding agent working in /srv/project."}],
            "tools": [{"name": "Bash", "description": "Run a shell command",
                       "input_schema": {"type": "object",
                                        "properties": {"command": {"type": "string"},
                                                       "description": {"type": "string"}},
                                        "required": ["command"]}},
                      {"name": "Read", "description": "Read a file",
                       "input_schema": {"type": "object",
                                        "properties": {"file_path": {"type": "string"},
                                                       "offset": {"type": "integer"},
                                                       "limit": {"type": "integer"}},
                                        "required": ["file_path"]}}],
            "messages": history_messages(reuse, result_size or RESULT_SIZE, ascii_only)}


@functools.cache
def body(kind: str) -> bytes:
    """A request body by name: small, small_stream, history_reused, history_unique, ..."""
    if kind == "small":
        return orjson.dumps(small_request())
    if kind == "small_stream":
        return orjson.dumps(small_request(stream=True))
    if kind == "history_reused":
        return orjson.dumps(history_request(True))
    if kind == "history_unique":
        return orjson.dumps(history_request(False))
    if kind == "history_reused_ascii":
        return orjson.dumps(history_request(True, ascii_only=True))
    if kind == "history_unique_ascii":
        return orjson.dumps(history_request(False, ascii_only=True))
    if kind == "stream_with_history_call":
        # One earlier call with STREAM_TOOL_ID: an upstream that emits that id again is
        # rewritten by dedup (the micro-benchmark of the rewrite path).
        request = small_request(stream=True)
        request["messages"] = [
            {"role": "user", "content": "List the files."},
            {"role": "assistant", "content": [{"type": "tool_use", "id": STREAM_TOOL_ID,
                                               "name": "Bash", "input": {"command": "ls"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": STREAM_TOOL_ID,
                                          "content": "relay\nplugins\ntests"}]}]
        return orjson.dumps(request)
    if kind == "session":
        return session_bodies()[-1]
    raise KeyError(kind)


@functools.cache
def session_bodies() -> tuple[bytes, ...]:
    """The requests of a growing session: the unique history up to each of its last
    SESSION_REQUESTS user messages (the last is the 500-message history), each with a
    ``cache_control`` breakpoint on its last block, as Claude Code sends them."""
    request = history_request(False)
    messages = request["messages"]
    ends = [n for n in range(2, len(messages) + 1) if messages[n - 1]["role"] == "user"]
    bodies = []
    for n in ends[-SESSION_REQUESTS:]:
        turn = [dict(m) for m in messages[:n]]
        last = turn[-1] = dict(turn[-1])
        last["content"] = [*last["content"][:-1],
                           {**last["content"][-1], "cache_control": {"type": "ephemeral"}}]
        bodies.append(orjson.dumps({**request, "messages": turn}))
    return tuple(bodies)


# --- the mock's canned answers --------------------------------------------------------------

STREAM_TOOL_ID = "toolu_01BenchStreamToolCallAAA"

ANSWER = orjson.dumps({
    "id": "msg_01BenchAnswer", "type": "message", "role": "assistant", "model": MODEL,
    "content": [{"type": "text", "text": "Hello! This is a canned answer from the benchmark's mock."}],
    "stop_reason": "end_turn", "stop_sequence": None,
    "usage": {"input_tokens": 21, "output_tokens": 14, "cache_creation_input_tokens": 0,
              "cache_read_input_tokens": 0}})


def event(name: str, data: dict) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


MESSAGE_START = event("message_start", {"type": "message_start", "message": {
    "id": "msg_01BenchStream", "type": "message", "role": "assistant", "model": MODEL,
    "content": [], "stop_reason": None, "stop_sequence": None,
    "usage": {"input_tokens": 21, "output_tokens": 1}}})
TEXT_BLOCK_START = event("content_block_start", {"type": "content_block_start", "index": 0,
                                                 "content_block": {"type": "text", "text": ""}})
TOOL_BLOCK_START = event("content_block_start", {
    "type": "content_block_start", "index": 1,
    "content_block": {"type": "tool_use", "id": STREAM_TOOL_ID, "name": "Bash", "input": {}}})


def text_delta(text: str, index: int = 0) -> bytes:
    return event("content_block_delta", {"type": "content_block_delta", "index": index,
                                         "delta": {"type": "text_delta", "text": text}})


@functools.cache
def sse_events(n: int) -> tuple:
    """A stream of exactly ``n`` (>= 10) events: message_start, a ping, a text block, a
    tool_use block with input_json_delta fragments, message_delta, message_stop."""
    n = max(n, 10)
    rng = random.Random(n)
    deltas = n - 8
    json_deltas = max(1, deltas // 5)
    text_deltas = deltas - json_deltas
    out = [MESSAGE_START, TEXT_BLOCK_START, event("ping", {"type": "ping"})]
    for _ in range(text_deltas):
        out.append(text_delta(" ".join(rng.choice(_WORDS) for _ in range(rng.randrange(1, 6)))))
    out.append(event("content_block_stop", {"type": "content_block_stop", "index": 0}))
    out.append(TOOL_BLOCK_START)
    fragments = ['{"command": "ls -la relay/ && echo ' + "x" * (json_deltas * 4) + '"}'] if json_deltas else []
    text = fragments[0]
    step = max(1, len(text) // json_deltas)
    for i in range(json_deltas):
        part = text[i * step:(i + 1) * step] if i < json_deltas - 1 else text[i * step:]
        out.append(event("content_block_delta", {"type": "content_block_delta", "index": 1,
                                                 "delta": {"type": "input_json_delta", "partial_json": part}}))
    out.append(event("content_block_stop", {"type": "content_block_stop", "index": 1}))
    out.append(event("message_delta", {"type": "message_delta",
                                       "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                                       "usage": {"output_tokens": n}}))
    out.append(event("message_stop", {"type": "message_stop"}))
    assert len(out) == n, (len(out), n)
    return tuple(out)


# --- the same answers from an OpenAI Chat Completions upstream --------------------------------

CHAT_ANSWER = orjson.dumps({
    "id": "chatcmpl-bench", "object": "chat.completion", "created": 1, "model": MODEL,
    "choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant",
        "content": "Hello! This is a canned answer from the benchmark's mock."}}],
    "usage": {"prompt_tokens": 21, "completion_tokens": 14, "total_tokens": 35}})


def chat_chunk(delta: dict | None, finish_reason=None, **extra) -> bytes:
    choices = [] if delta is None else [{"index": 0, "delta": delta,
                                         "finish_reason": finish_reason}]
    return b"data: " + orjson.dumps({"id": "chatcmpl-bench", "object": "chat.completion.chunk",
                                     "created": 1, "model": MODEL, "choices": choices,
                                     **extra}) + b"\n\n"


def chat_text_delta(text: str) -> bytes:
    return chat_chunk({"content": text})


@functools.cache
def chat_chunks(n: int) -> tuple:
    """The stream of :func:`sse_events` as an OpenAI-format server sends it, in exactly ``n``
    (>= 10) sends: a role chunk, text deltas, a tool call whose arguments come in fragments,
    the finish reason, the usage chunk and ``[DONE]``."""
    n = max(n, 10)
    rng = random.Random(n)
    deltas = n - 4
    json_deltas = max(1, deltas // 5)
    out = [chat_chunk({"role": "assistant", "content": ""})]
    for _ in range(deltas - json_deltas - 1):
        words = rng.randrange(1, 6)
        out.append(chat_text_delta(" ".join(rng.choice(_WORDS) for _ in range(words))))
    out.append(chat_chunk({"tool_calls": [{"index": 0, "id": "call_bench_0", "type": "function",
                                           "function": {"name": "Bash", "arguments": ""}}]}))
    text = '{"command": "ls -la relay/ && echo ' + "x" * (json_deltas * 4) + '"}'
    step = max(1, len(text) // json_deltas)
    for i in range(json_deltas):
        part = text[i * step:(i + 1) * step] if i < json_deltas - 1 else text[i * step:]
        out.append(chat_chunk({"tool_calls": [{"index": 0, "function": {"arguments": part}}]}))
    out.append(chat_chunk({}, "tool_calls"))
    out.append(chat_chunk(None, usage={"prompt_tokens": 21, "completion_tokens": n,
                                       "total_tokens": 21 + n}))
    out.append(b"data: [DONE]\n\n")
    assert len(out) == n, (len(out), n)
    return tuple(out)


# --- thinking answers, one of a kind ---------------------------------------------------------
# As a real backend's, each answer's signature and tool id are new (``seq`` picks them), so
# what the relay remembers per block or per id (the portable plugin's record and caches)
# grows as it does in service, and its bounds are what a long soak sees.

OPENAI_MODEL = "gpt-bench"


def signature(seq: int) -> str:
    """A signature of the size the API's are (a few hundred base64 characters)."""
    return base64.b64encode(hashlib.sha512(b"bench-signature-%d" % seq).digest() * 5).decode()


def thinking_tool_id(seq: int, wire_format: str = "anthropic") -> str:
    # An OpenAI-format backend's ids in the grammar some mint (``functions.Name:N``), which
    # the portable plugin translates on the way to an Anthropic-format backend.
    return f"functions.Bash:{seq}" if wire_format == "openai" else f"toolu_01Think{seq:015d}"


THINKING_TEXT = "The user wants the files listed; a shell call does that."


def thinking_content(seq: int, wire_format: str = "anthropic") -> list:
    """The assistant content of thinking answer ``seq`` as the client gets it: a thinking
    block (unsigned from an OpenAI-format backend), a text and a tool call (its id in
    Anthropic's grammar, as the portable plugin hands it to the client)."""
    return [{"type": "thinking", "thinking": THINKING_TEXT,
             "signature": "" if wire_format == "openai" else signature(seq)},
            {"type": "text", "text": "Listing them."},
            {"type": "tool_use", "id": client_tool_id(seq, wire_format), "name": "Bash",
             "input": {"command": "ls"}}]


def client_tool_id(seq: int, wire_format: str = "anthropic") -> str:
    """The id the client holds for the call of thinking answer ``seq``."""
    return portable.client_form(thinking_tool_id(seq, wire_format))


def thinking_events(seq: int) -> tuple:
    """Answer ``seq`` streamed: message_start, a thinking block with its signature_delta, a
    text block, a tool_use block, message_delta, message_stop."""
    content = thinking_content(seq)
    out = [MESSAGE_START,
           event("content_block_start", {"type": "content_block_start", "index": 0,
                                         "content_block": {"type": "thinking", "thinking": "",
                                                           "signature": ""}})]
    for word in THINKING_TEXT.split(" "):
        out.append(event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                 "delta": {"type": "thinking_delta",
                                                           "thinking": word + " "}}))
    out += [event("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {
                "type": "signature_delta", "signature": content[0]["signature"]}}),
            event("content_block_stop", {"type": "content_block_stop", "index": 0}),
            event("content_block_start", {"type": "content_block_start", "index": 1,
                                          "content_block": {"type": "text", "text": ""}}),
            text_delta(content[1]["text"], 1),
            event("content_block_stop", {"type": "content_block_stop", "index": 1}),
            event("content_block_start", {"type": "content_block_start", "index": 2,
                                          "content_block": {**content[2], "input": {}}}),
            event("content_block_delta", {"type": "content_block_delta", "index": 2, "delta": {
                "type": "input_json_delta", "partial_json": '{"command": "ls"}'}}),
            event("content_block_stop", {"type": "content_block_stop", "index": 2}),
            event("message_delta", {"type": "message_delta",
                                    "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                                    "usage": {"output_tokens": 40}}),
            event("message_stop", {"type": "message_stop"})]
    return tuple(out)


def thinking_answer(seq: int) -> bytes:
    return orjson.dumps({
        "id": f"msg_01Think{seq:015d}", "type": "message", "role": "assistant", "model": MODEL,
        "content": thinking_content(seq), "stop_reason": "tool_use", "stop_sequence": None,
        "usage": {"input_tokens": 21, "output_tokens": 40}})


def chat_thinking_chunks(seq: int) -> tuple:
    """Answer ``seq`` from an OpenAI-format server: ``reasoning_content`` deltas, the text, a
    tool call, the finish reason, usage, ``[DONE]``."""
    out = [chat_chunk({"role": "assistant", "content": ""})]
    for word in THINKING_TEXT.split(" "):
        out.append(chat_chunk({"reasoning_content": word + " "}))
    out += [chat_text_delta("Listing them."),
            chat_chunk({"tool_calls": [{"index": 0, "id": thinking_tool_id(seq, "openai"),
                                        "type": "function",
                                        "function": {"name": "Bash", "arguments": ""}}]}),
            chat_chunk({"tool_calls": [{"index": 0,
                                        "function": {"arguments": '{"command": "ls"}'}}]}),
            chat_chunk({}, "tool_calls"),
            chat_chunk(None, usage={"prompt_tokens": 21, "completion_tokens": 40,
                                    "total_tokens": 61}),
            b"data: [DONE]\n\n"]
    return tuple(out)


def chat_thinking_answer(seq: int) -> bytes:
    return orjson.dumps({
        "id": f"chatcmpl-think-{seq}", "object": "chat.completion", "created": 1,
        "model": OPENAI_MODEL, "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": "Listing them.", "reasoning_content": THINKING_TEXT,
            "tool_calls": [{"id": thinking_tool_id(seq, "openai"), "type": "function",
                            "function": {"name": "Bash", "arguments": '{"command": "ls"}'}}]}}],
        "usage": {"prompt_tokens": 21, "completion_tokens": 40, "total_tokens": 61}})
