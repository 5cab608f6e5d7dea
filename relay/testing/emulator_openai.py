"""A strict stand-in for an OpenAI Chat Completions server (``relay emulate --format openai``).

The far side of the wire for OpenAI-format backends, scripted like the Anthropic emulator
(:mod:`relay.testing.emulator`, whose options it shares): ``turn`` is the number of assistant
messages in the history, ``--tool-turns`` says how many turns end in tool calls. It rejects
what these servers reject, with their wording: an assistant message with ``tool_calls`` not
followed by ``tool`` messages answering each id, a ``tool`` message that answers nothing, a
duplicate tool call id, an unknown request field, and shapes the format does not have.

Its answers are the shapes real servers send: ``chat.completion`` objects, and
``chat.completion.chunk`` streams with a role chunk first, ``reasoning_content`` (or
``reasoning``) deltas, content deltas, tool calls whose arguments come in several fragments, a
``finish_reason`` chunk, a usage chunk when ``stream_options.include_usage`` asks for one
(unless the usage report, as the Anthropic emulator's ``--usage``, says ``none``: many servers
ignore the option), then ``data: [DONE]``. Options of its own: ``--late-ids`` (a call's id and
name come in its second fragment), ``--interleave`` (parallel calls' fragments alternate by
index), ``--reasoning-field``, ``--bad-arguments`` (arguments that are not JSON).

It imports nothing from the relay but the Anthropic emulator, the other far side.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import sys
import time

import orjson
from aiohttp import web

from relay.testing import emulator as anthropic
from relay.testing.emulator import (
    INCOMING,
    STATE,
    EmulatorState,
    RaggedSplitter,
    handle_clear_records,
    handle_records,
    handle_stats,
    options_from_args,
)

# Request fields OpenAI's Chat Completions endpoint knows; any other is refused, as OpenAI
# refuses it ("Unrecognized request argument supplied").
REQUEST_FIELDS = frozenset({
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n",
    "stream", "stream_options", "stop", "presence_penalty", "frequency_penalty", "logit_bias",
    "logprobs", "top_logprobs", "user", "tools", "tool_choice", "parallel_tool_calls",
    "response_format", "seed", "service_tier", "store", "metadata", "reasoning_effort",
    "modalities", "audio", "prediction", "web_search_options", "verbosity",
    "prompt_cache_key", "safety_identifier", "functions", "function_call"})
ROLES = ("system", "developer", "user", "assistant", "tool")
# What a message of each role may hold besides its role; reasoning_content is DeepSeek's.
MESSAGE_FIELDS = {
    "system": {"content", "name"}, "developer": {"content", "name"},
    "user": {"content", "name"},
    "assistant": {"content", "name", "tool_calls", "refusal", "audio", "function_call",
                  "reasoning_content"},
    "tool": {"content", "tool_call_id"},
}
ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
               403: "invalid_request_error", 404: "invalid_request_error",
               413: "invalid_request_error", 429: "rate_limit_exceeded",
               500: "server_error", 503: "server_error"}
FAULT_MESSAGES = {
    400: "Emulated invalid request", 401: "Incorrect API key provided",
    403: "You are not allowed to use this model", 404: "The model does not exist",
    413: "Request too large", 429: "Rate limit reached for requests",
    500: "The server had an error while processing your request.",
    503: "The engine is currently overloaded, please try again later",
}
MODELS = ["gpt-4.1-mini", "deepseek-chat", "qwen3-coder"]
_BASE62 = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """This emulator's own options, beside the Anthropic emulator's (which it shares)."""
    parser.add_argument("--format", choices=("anthropic", "openai"), default="anthropic",
                        help="the wire format to emulate (openai: Chat Completions)")
    parser.add_argument("--late-ids", action="store_true",
                        help="openai streams: a call's id and name come in its second fragment")
    parser.add_argument("--interleave", action="store_true",
                        help="openai streams: parallel calls' argument fragments alternate")
    parser.add_argument("--reasoning-field", choices=("reasoning_content", "reasoning"),
                        default="reasoning_content",
                        help="openai: where --thinking puts the reasoning")
    parser.add_argument("--bad-arguments", action="store_true",
                        help="openai: tool call arguments that are not JSON")


# --- validation -------------------------------------------------------------------------------

def find_problem(body) -> str | None:
    """An OpenAI-format server's 400 message for the first problem in a request, or None."""
    if type(body) is not dict:
        return "Invalid request: the body must be a JSON object."
    for key in body:
        if key not in REQUEST_FIELDS:
            return f"Unrecognized request argument supplied: {key}"
    if not isinstance(body.get("model"), str):
        return "you must provide a model parameter"
    messages = body.get("messages")
    if type(messages) is not list or not messages:
        return "Invalid 'messages': expected a non-empty array."
    if "stream_options" in body and not body.get("stream"):
        return "The 'stream_options' parameter is only allowed when 'stream' is enabled."
    for n, message in enumerate(messages):
        problem = _message_problem(n, message)
        if problem:
            return problem
    problem = _tools_problem(body)
    return problem or _pairing_problem(messages)


def _message_problem(n: int, message) -> str | None:
    where = f"messages[{n}]"
    if type(message) is not dict or message.get("role") not in ROLES:
        return f"Invalid value for '{where}.role': expected one of {', '.join(ROLES)}."
    role = message["role"]
    for key in message:
        if key != "role" and key not in MESSAGE_FIELDS[role]:
            return f"Additional properties are not allowed ('{key}' was unexpected) - '{where}'"
    content = message.get("content")
    if role == "assistant":
        if content is None and not message.get("tool_calls"):
            return f"Invalid '{where}': an assistant message needs content or tool_calls."
    elif content is None:
        return f"Missing required parameter: '{where}.content'."
    if content is not None and not isinstance(content, str):
        if type(content) is not list:
            return f"Invalid type for '{where}.content': expected a string or an array."
        allowed = ("text", "image_url") if role == "user" else ("text",)
        for k, part in enumerate(content):
            kind = part.get("type") if type(part) is dict else None
            if kind not in allowed:
                return (f"Invalid value: '{kind}'. Supported values are: "
                        f"{', '.join(repr(a) for a in allowed)}. - '{where}.content[{k}].type'")
            if kind == "text" and not isinstance(part.get("text"), str):
                return f"Missing required parameter: '{where}.content[{k}].text'."
            url = (part.get("image_url") or {}).get("url") if kind == "image_url" else ""
            if not isinstance(url, str):
                return f"Missing required parameter: '{where}.content[{k}].image_url.url'."
    if role == "tool" and not isinstance(message.get("tool_call_id"), str):
        return f"Missing required parameter: '{where}.tool_call_id'."
    for k, call in enumerate(message.get("tool_calls") or []):
        function = call.get("function") if type(call) is dict else None
        if (type(call) is not dict or not isinstance(call.get("id"), str)
                or call.get("type") != "function" or type(function) is not dict
                or not isinstance(function.get("name"), str)):
            return f"Invalid '{where}.tool_calls[{k}]': needs an id, type 'function' and a name."
        if not isinstance(function.get("arguments"), str):
            return (f"Invalid type for '{where}.tool_calls[{k}].function.arguments': expected "
                    f"a string, but got an object instead.")
    return None


def _tools_problem(body: dict) -> str | None:
    tools = body.get("tools")
    if tools is None:
        return ("Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' "
                "are specified.") if "tool_choice" in body else None
    if type(tools) is not list:
        return "Invalid type for 'tools': expected an array."
    for j, tool in enumerate(tools):
        function = tool.get("function") if type(tool) is dict else None
        if tool.get("type") != "function" or type(function) is not dict \
                or not isinstance(function.get("name"), str):
            return f"Missing required parameter: 'tools[{j}].function.name'."
    return None


def _pairing_problem(messages: list) -> str | None:
    """Each assistant message's calls answered by the tool messages right after it; no tool
    message without a call; no id twice in the request."""
    seen: set[str] = set()
    for n, message in enumerate(messages):
        if message["role"] == "tool":
            previous = n - 1
            while previous >= 0 and messages[previous]["role"] == "tool":
                previous -= 1
            if previous < 0 or not messages[previous].get("tool_calls"):
                return ("Invalid parameter: messages with role 'tool' must be a response to a "
                        "preceeding message with 'tool_calls'.")
            continue
        calls = message.get("tool_calls") if message["role"] == "assistant" else None
        if not calls:
            continue
        ids = [call["id"] for call in calls]
        for k, call_id in enumerate(ids):
            if call_id in seen:
                return (f"Invalid parameter: duplicate tool_call id {call_id!r} "
                        f"('messages[{n}].tool_calls[{k}].id').")
            seen.add(call_id)
        answered = set()
        following = n + 1
        while following < len(messages) and messages[following]["role"] == "tool":
            call_id = messages[following]["tool_call_id"]
            if call_id not in ids:
                return (f"Invalid parameter: 'tool_call_id' of '{call_id}' not found in "
                        f"'tool_calls' of previous message.")
            answered.add(call_id)
            following += 1
        missing = [call_id for call_id in ids if call_id not in answered]
        if missing:
            return ("An assistant message with 'tool_calls' must be followed by tool messages "
                    "responding to each 'tool_call_id'. The following tool_call_ids did not "
                    f"have response messages: {', '.join(missing)}")
    return None


# --- the script -------------------------------------------------------------------------------

def _base62(number: int, length: int) -> str:
    chars = []
    for _ in range(length):
        number, digit = divmod(number, 62)
        chars.append(_BASE62[digit])
    return "".join(chars)


def tool_id(options, turn: int, index: int, name: str) -> str:
    """``call_...`` ids (``call_0``, ``call_1`` every turn with ``--reuse-ids``), or Kimi's
    ``functions.Name:N``."""
    if options.id_style == "functions":
        counter = index if options.reuse_ids else turn * options.parallel + index
        return f"functions.{name}:{counter}"
    if options.reuse_ids:
        return f"call_{index}"
    digest = hashlib.sha256(f"call:{turn}:{index}".encode()).digest()
    return "call_" + _base62(int.from_bytes(digest, "big"), 24)


def is_turn(message: dict, options) -> bool:
    if message["role"] != "assistant":
        return False
    return not options.reask_dropped or bool(message.get("tool_calls"))


def _pick_tool(body: dict) -> dict | None:
    tools = [t["function"] for t in body.get("tools") or []]
    if not tools or body.get("tool_choice") == "none":
        return None
    return next((t for t in tools if t["name"] == "Bash"), tools[0])


def _arguments(tool: dict, turn: int, index: int, options) -> str:
    if options.bad_arguments:
        return '{"command": "echo unterminated'
    if tool["name"] == "Bash":
        value: dict[str, object] = {"command": f"echo relay-turn-{turn}-{index}",
                                    "description": "Print a marker"}
    else:
        parameters = tool.get("parameters") or {}
        properties = parameters.get("properties") or {}
        value = {name: anthropic._placeholder(properties.get(name))
                 for name in parameters.get("required") or [] if isinstance(name, str)}
    return orjson.dumps(value).decode()


def plan_reply(body: dict, options) -> dict:
    """The assistant message (reasoning, content, tool_calls) and finish_reason for a valid
    request."""
    turn = sum(1 for m in body["messages"] if is_turn(m, options))
    tool = _pick_tool(body)
    tool_turn = turn < options.tool_turns and tool is not None
    message: dict = {"role": "assistant"}
    if options.thinking:
        message[options.reasoning_field] = (
            f"Turn {turn}: the plan calls for {'a tool call' if tool_turn else 'a final answer'}"
            " now.")
    if turn >= options.tool_turns:
        message["content"] = f"All {options.tool_turns} tool turns done."
        return {"message": message, "finish_reason": "stop"}
    if tool is None:
        message["content"] = f"Turn {turn}: no tool to call, so in words."
        return {"message": message, "finish_reason": "stop"}
    message["content"] = f"Turn {turn}: calling {tool['name']}."
    message["tool_calls"] = [
        {"id": tool_id(options, turn, i, tool["name"]), "type": "function",
         "function": {"name": tool["name"], "arguments": _arguments(tool, turn, i, options)}}
        for i in range(options.parallel)]
    return {"message": message, "finish_reason": "tool_calls"}


def usage(prompt_tokens: int, reply: dict,
          report: dict[str, int | None] | None = None) -> dict | None:
    """The usage object: ``prompt_tokens`` is the whole prompt, the tokens served from the
    cache (``cache_read`` of the emulator's usage report) included, as OpenAI counts them.
    None when the report says the server reports none; a count it withholds is left out."""
    report = report or {}
    if anthropic.NO_USAGE in report:
        return None
    cached = report.get("cache_read") or 0
    found: dict = {}
    given = report.get("input", prompt_tokens)
    if given is not None:
        found["prompt_tokens"] = given + cached
    given = report.get("output", max(1, len(orjson.dumps(reply["message"])) // 4))
    if given is not None:
        found["completion_tokens"] = given
    found["total_tokens"] = found.get("prompt_tokens", 0) + found.get("completion_tokens", 0)
    found["prompt_tokens_details"] = {"cached_tokens": cached}
    return found


def completion(body: dict, reply: dict, prompt_tokens: int, completion_id: str,
               report: dict[str, int | None] | None = None) -> dict:
    message = dict(reply["message"])
    message.setdefault("content", None)
    answer = {"id": completion_id, "object": "chat.completion", "created": int(time.time()),
              "model": body["model"],
              "choices": [{"index": 0, "message": message, "logprobs": None,
                           "finish_reason": reply["finish_reason"]}]}
    reported = usage(prompt_tokens, reply, report)
    if reported is not None:
        answer["usage"] = reported
    return answer


def _pieces(text: str, count: int = 3) -> list[str]:
    size = max(1, -(-len(text) // count))
    return [text[i:i + size] for i in range(0, len(text), size)] or [""]


def _call_fragments(index: int, call: dict, options) -> list[dict]:
    function = call["function"]
    pieces = _pieces(function["arguments"])
    if options.late_ids:  # nothing but an argument piece comes first
        return [{"index": index, "function": {"arguments": pieces[0]}},
                {"index": index, "id": call["id"], "type": "function",
                 "function": {"name": function["name"], "arguments": ""}},
                *({"index": index, "function": {"arguments": p}} for p in pieces[1:])]
    return [{"index": index, "id": call["id"], "type": "function",
             "function": {"name": function["name"], "arguments": ""}},
            *({"index": index, "function": {"arguments": p}} for p in pieces)]


def stream_chunks(body: dict, reply: dict, prompt_tokens: int, completion_id: str,
                  options, report: dict[str, int | None] | None = None) -> list[dict]:
    """The ``chat.completion.chunk`` objects of one streamed answer, in order."""
    base = {"id": completion_id, "object": "chat.completion.chunk",
            "created": int(time.time()), "model": body["model"]}

    def chunk(delta: dict, finish_reason=None) -> dict:
        return {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                     "finish_reason": finish_reason}]}

    message = reply["message"]
    chunks = [chunk({"role": "assistant", "content": ""})]
    reasoning = message.get(options.reasoning_field)
    if reasoning:
        chunks += [chunk({options.reasoning_field: p}) for p in _pieces(reasoning, 2)]
    if message.get("content"):
        chunks += [chunk({"content": p}) for p in _pieces(message["content"], 2)]
    fragments = [_call_fragments(i, call, options)
                 for i, call in enumerate(message.get("tool_calls") or [])]
    if options.interleave:
        while any(fragments):
            for queue in fragments:
                if queue:
                    chunks.append(chunk({"tool_calls": [queue.pop(0)]}))
    else:
        chunks += [chunk({"tool_calls": [f]}) for queue in fragments for f in queue]
    chunks.append(chunk({}, reply["finish_reason"]))
    reported = usage(prompt_tokens, reply, report)
    if (body.get("stream_options") or {}).get("include_usage") and reported is not None:
        chunks.append({**base, "choices": [], "usage": reported})
    return chunks


# --- the server -------------------------------------------------------------------------------

def error_response(request: web.Request, status: int, message: str, *,
                   code: str | None = None, headers: dict | None = None) -> web.Response:
    error = {"message": message,
             "type": ERROR_TYPES.get(status, "server_error" if status >= 500
                                     else "invalid_request_error"),
             "param": None, "code": code}
    return web.Response(status=status, body=orjson.dumps({"error": error}),
                        content_type="application/json", headers=headers)


def _authorised(request: web.Request, api_key: str | None) -> bool:
    return api_key is None or request.headers.get("authorization") == f"Bearer {api_key}"


_front_door = anthropic.front_door(
    _authorised, error_response,
    lambda request: error_response(request, 401, FAULT_MESSAGES[401], code="invalid_api_key"))


async def _stamp_headers(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["x-request-id"] = request[INCOMING].request_id


async def handle_completions(request: web.Request) -> web.StreamResponse:
    refusal = await anthropic.admit(request, error_response)
    if refusal:
        return refusal
    options = request.app[STATE].options
    incoming = request[INCOMING]
    problem = incoming.json_problem or find_problem(incoming.body)
    if problem:
        return error_response(request, 400, problem)
    try:
        report = anthropic.parse_usage(request.headers.get(anthropic.USAGE_HEADER,
                                                           options.usage))
    except ValueError as e:
        return error_response(request, 400, str(e))
    body = incoming.body
    reply = plan_reply(body, options)
    completion_id = "chatcmpl-" + os.urandom(12).hex()
    prompt_tokens = len(incoming.raw) // 4
    if body.get("stream"):
        return await _stream(request, stream_chunks(body, reply, prompt_tokens, completion_id,
                                                    options, report), options)
    return web.Response(body=orjson.dumps(completion(body, reply, prompt_tokens, completion_id,
                                                     report)),
                        content_type="application/json")


async def _stream(request: web.Request, chunks: list[dict], options) -> web.StreamResponse:
    response = web.StreamResponse(headers={"content-type": "text/event-stream",
                                           "cache-control": "no-cache"})
    await response.prepare(request)
    splitter = RaggedSplitter() if options.ragged else None
    eol = b"\r\n" if options.crlf else b"\n"

    async def send(data: bytes) -> None:
        if splitter is None:
            await response.write(data)
            return
        for piece in splitter.feed(data):
            await response.write(piece)
            await asyncio.sleep(0)

    try:
        for sent, chunk in enumerate(chunks):
            if sent == options.cut_after:
                if splitter:
                    await response.write(splitter.flush())
                if request.transport:
                    request.transport.close()
                return response
            if sent == options.stream_error_after:
                error = {"error": {"message": FAULT_MESSAGES[503], "type": "server_error",
                                   "param": None, "code": 503}}
                await send(b"data: " + orjson.dumps(error) + eol + eol)
                break
            await send(b"data: " + orjson.dumps(chunk) + eol + eol)
        else:
            await send(b"data: [DONE]" + eol + eol)
        if splitter:
            await response.write(splitter.flush())
        await response.write_eof()
    except ConnectionError:
        pass
    return response


def _model(name: str) -> dict:
    return {"id": name, "object": "model", "created": 1735689600, "owned_by": "emulator"}


async def handle_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model(m) for m in MODELS]})


async def handle_model(request: web.Request) -> web.Response:
    model_id = request.match_info["model_id"]
    if model_id not in MODELS:
        return error_response(request, 404, f"The model '{model_id}' does not exist",
                              code="model_not_found")
    return web.json_response(_model(model_id))


def create_app(options) -> web.Application:
    app = web.Application(middlewares=[_front_door], client_max_size=anthropic.MAX_BODY_BYTES)
    app[STATE] = EmulatorState(options)
    app.on_response_prepare.append(_stamp_headers)
    app.router.add_post("/v1/chat/completions", handle_completions)
    app.router.add_get("/v1/models", handle_models)
    app.router.add_get("/v1/models/{model_id}", handle_model)
    app.router.add_get("/_emulator/requests", handle_records)
    app.router.add_delete("/_emulator/requests", handle_clear_records)
    app.router.add_get("/_emulator/stats", handle_stats)
    return app


def options_for(args):
    """The shared options, with this emulator's own ones set on them."""
    options = options_from_args(args)
    for name in ("late_ids", "interleave", "bad_arguments"):
        setattr(options, name, getattr(args, name, False))
    options.reasoning_field = getattr(args, "reasoning_field", "reasoning_content")
    return options


def main(args) -> int:
    asyncio.run(anthropic.serve(options_for(args), create_app))
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(description="A strict OpenAI Chat Completions emulator.")
    anthropic.add_arguments(_parser)
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
