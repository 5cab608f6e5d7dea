"""OpenAI Chat Completions backends: Anthropic requests down, Anthropic answers back up.

Everything here is a pure function of its input (the stream translator keeps only the state of
one stream), so that the plugin chain keeps seeing Anthropic requests and Anthropic events and
the translation is testable with plain data.

Requests. What translates: ``system`` (a string or text blocks) to a system message; text;
images (base64 and URL) to ``image_url`` parts; plain-text documents to text; ``tool_use`` to
assistant ``tool_calls`` (arguments as a JSON string); ``tool_result`` to ``tool`` messages
(text content; images inside a result go in a user message right after the tool messages,
since a tool message holds only text; ``is_error`` becomes an ``Error: `` prefix, as the
format has no flag for it); ``tools`` to functions; ``tool_choice`` and
``disable_parallel_tool_use``; ``stop_sequences``; ``max_tokens`` (or
``max_completion_tokens``); ``temperature``, ``top_p``; ``metadata.user_id`` to ``user``;
``output_config.format`` to ``response_format``; ``thinking`` to the backend's reasoning
control when its quirks name one; a ``tool_reference`` in a result to a line naming the tool
(every tool, deferred or not, is among the functions: ``defer_loading`` has no equivalent).

Dropped because dropping cannot change what the model is told: ``cache_control``,
``citations`` on text, the model's own earlier ``thinking`` and ``redacted_thinking`` (its
reasoning, not the conversation; the ``reasoning_history`` quirk sends it back as
``reasoning_content``, on every call turn, for backends that want it), ``top_k`` and other
Anthropic-only knobs (``context_management``, ``service_tier``, ``output_config.effort``,
unknown top-level fields). Refused with a 400 that
names the block type and the backend, because dropping would lose part of the conversation:
server tools and their results, MCP servers, documents other than plain text, and any block
type not listed here.

Answers. ``reasoning_content`` / ``reasoning`` become ``thinking`` blocks (with an empty
signature: only Anthropic can sign), text a ``text`` block, ``tool_calls`` ``tool_use``
blocks with their arguments parsed. Arguments that are not a JSON object are never passed on
as something else: the answer becomes an ``api_error`` (502 when not streaming, an ``error``
event in a stream) naming the call and quoting the arguments. So does any answer or chunk
whose fields of the format's own (``choices``, ``message``/``delta``, ``content`` and its
parts' ``text``, ``refusal``, ``tool_calls`` and their ``index``, ``id``, ``function``,
``name``, ``arguments``, ``finish_reason``, ``model``, ``usage`` and its counts) are not of
their type, naming where (``choices[0].message.tool_calls[0] is not an object``): a value of
the wrong type never reaches the client, and null is taken as absent. An integral float
count (``12.0``) is its integer. Extensions (``reasoning_content``, ``reasoning``) are read
when they are text and otherwise left alone.

Streams. The first upstream chunk becomes ``message_start`` at once; text and thinking stream
live. One tool call at a time streams live (its ``input_json_delta`` fragments go out as they
come): an Anthropic block cannot be interleaved with another, and an OpenAI stream never says
that a call is complete before it ends, so the fragments of any other call (interleaved by
``index``, or following the first) are held and that call is sent whole, in order, when the
upstream says it is done. A call whose id or name comes after its first fragment is held until
both are known; a call that never gets a name ends the stream with an ``error`` event, one that
never gets an id is given ``call_<message>_<index>``. A fresh id at an index already in use is
a new call (Ollama numbers every call of a parallel batch 0). ``message_delta`` (stop reason,
usage from the last chunk) and ``message_stop`` go out at ``data: [DONE]``, or when the
connection ends after a ``finish_reason``; a stream cut before either gets no
``message_stop``, so the relay ends it with its own ``error`` event. An ``error`` object in
the stream becomes an ``error`` event. Memory is bounded whatever the upstream sends: an
event still coming may grow to ``MAX_EVENT_BYTES`` (the Anthropic path's limit), the tool
calls' arguments with what waits behind a live call to ``MAX_HELD_BYTES``, and past either the stream ends with an ``error``
event; the copy kept for the record is a head and a tail (:class:`relay.bounded.HeadTail`).
"""

from __future__ import annotations

import datetime
import itertools
import os
from typing import Union

import msgspec
import orjson

from ..bounded import HeadTail
from ..errors import RelayError, error_body

FORMAT = "OpenAI Chat Completions"

# The backend quirks this format reads, with their choices (first: the default).
QUIRKS = {
    "max_tokens_field": ("max_tokens", "max_completion_tokens"),
    "reasoning_control": ("none", "reasoning_effort", "openrouter", "chat_template_kwargs",
                          "deepseek"),
    "reasoning_history": ("drop", "reasoning_content"),
    "stream_usage": (True, False),
}

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
                "function_call": "tool_use", "content_filter": "refusal"}

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error",
               529: "overloaded_error"}

# Block types whose loss cannot change what the model is told (see the module's docstring).
_DROPPED_ASSISTANT = frozenset({"thinking", "redacted_thinking"})
_SEPARATOR = "\n\n"  # between the text blocks of one assistant message, which takes one string

_PROCESS = os.urandom(5).hex()
_SEQUENCE = itertools.count()


def quirk(backend, name: str):
    return backend.quirks.get(name, QUIRKS[name][0])


def message_id() -> str:
    """Anthropic-shaped and unique: clients group streamed content by message id, and some
    OpenAI-format servers reuse theirs."""
    return f"msg_relay{_PROCESS}{next(_SEQUENCE):010x}"


def upstream_path(path: str) -> str:
    """Where an Anthropic path goes under an OpenAI backend's base URL (which ends in /v1)."""
    if path == "/v1/messages":
        return "/chat/completions"
    return path[3:] if path.startswith("/v1/") else path


def upstream_headers(headers) -> None:
    """Adjust the headers going up in place: Anthropic's own headers mean nothing there, and a
    client key given as ``x-api-key`` is sent the way these servers read keys."""
    for name in ("anthropic-version", "anthropic-beta"):
        headers.popall(name, None)
    key = headers.popall("x-api-key", None)
    if key and "authorization" not in headers:
        headers["Authorization"] = "Bearer " + key[0]


# --- requests ---------------------------------------------------------------------------------

def refuse(backend, where: str, kind: str, why: str = "it has no equivalent there") -> RelayError:
    return RelayError(400, f"{where}: `{kind}` cannot be sent to backend {backend.name} "
                           f"({FORMAT} format): {why}, and the relay does not drop it",
                      "invalid_request_error", rule="openai_translation")


def _invalid(where: str, what: str) -> RelayError:
    return RelayError(400, f"{where}: {what}", "invalid_request_error")


# msgspec, not orjson: integers past 64 bits stay exact both ways.
_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode
Raw = msgspec.Raw
_Block = dict[str, Raw]
# A history's bulk (texts, tool results, tool inputs) stays the client's JSON text, which the
# encoder writes back as it is: a long history is translated without building its strings.
# The fields the translation reads, in one pass; any other is dropped anyway.
_READ = ("model", "system", "max_tokens", "temperature", "top_p", "stop_sequences", "metadata",
         "tools", "tool_choice", "output_config", "thinking", "stream", "mcp_servers",
         "container")
_Request = msgspec.defstruct(
    "_Request", [("messages", Union[list[dict[str, Union[str, list[_Block]]]], Raw],
                  msgspec.UNSET)]
    + [(name, Union[Raw, msgspec.UnsetType], msgspec.UNSET) for name in _READ])
_request = msgspec.json.Decoder(_Request).decode
_blocks = msgspec.json.Decoder(list[_Block]).decode
# Block types as JSON text: a dict lookup instead of a decode for each block.
_KINDS = {f'"{kind}"'.encode(): kind for kind in (
    "text", "image", "document", "tool_use", "tool_result", "thinking", "redacted_thinking",
    "tool_reference")}


def _value(item):
    """``item`` as a Python value, whether it is still the client's JSON text or not."""
    return _decode(item) if type(item) is Raw else item


def _is_text(item) -> bool:
    return isinstance(item, str) or (type(item) is Raw and memoryview(item)[:1] == b'"')


def request_bytes(raw: bytes, backend) -> bytes:
    """The Chat Completions body for an Anthropic request body (bytes to bytes)."""
    try:
        try:
            request = _request(raw)
        except msgspec.ValidationError:  # a shape the raw path does not hold: decode it all
            body = _decode(raw)
        else:
            body = {name: _value(getattr(request, name)) for name in ("messages", *_READ)
                    if getattr(request, name) is not msgspec.UNSET}
        # Text kept raw is decoded only where it must be read: broken UTF-8 shows up here.
        return _encode(chat_request(body, backend))
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        raise _invalid("(body)", f"request body is not valid JSON: {e}") from None


def chat_request(body: dict, backend) -> dict:
    """The Chat Completions request for an Anthropic Messages request, or a 400 naming what
    cannot be translated without loss."""
    if type(body) is not dict:
        raise _invalid("(body)", "request body must be a JSON object")
    if body.get("mcp_servers"):
        raise refuse(backend, "mcp_servers", "mcp_servers", "MCP servers are reached by "
                     "Anthropic's API itself")
    if body.get("container") is not None:
        raise refuse(backend, "container", "container", "code execution containers are "
                     "Anthropic's")
    messages: list[dict] = []
    if body.get("system") is not None:
        text = _plain_text(body["system"], "system", backend)
        if text:
            messages.append({"role": "system", "content": text})
    history = body.get("messages")
    if type(history) is not list:
        raise _invalid("messages", "Input should be a valid list")
    for n, message in enumerate(history):
        _message(messages, message, n, backend)
    out = {"model": body.get("model"), "messages": messages}
    if "max_tokens" in body:
        out[quirk(backend, "max_tokens_field")] = body["max_tokens"]
    for key in ("temperature", "top_p"):
        if body.get(key) is not None:
            out[key] = body[key]
    if body.get("stop_sequences"):
        out["stop"] = body["stop_sequences"]
    metadata = body.get("metadata")
    if type(metadata) is dict and isinstance(metadata.get("user_id"), str):
        out["user"] = metadata["user_id"]
    tools = body.get("tools")
    if tools:
        out["tools"] = _tools(tools, backend)
        _tool_choice(out, body.get("tool_choice"), backend)
    output_config = body.get("output_config")
    if type(output_config) is dict and type(output_config.get("format")) is dict:
        out["response_format"] = _response_format(output_config["format"], backend)
    _reasoning(out, body, backend)
    if body.get("stream"):
        out["stream"] = True
        if quirk(backend, "stream_usage"):
            out["stream_options"] = {"include_usage": True}
    return out


def _plain_text(value, where: str, backend) -> str:
    """A system prompt (a string or text blocks) as one string."""
    if isinstance(value, str):
        return value
    if type(value) is not list:
        raise _invalid(where, "Input should be a valid string or list of blocks")
    parts = []
    for k, block in enumerate(value):
        kind = _kind(block, f"{where}.{k}")
        if kind != "text":
            raise refuse(backend, f"{where}.{k}", kind)
        parts.append(_value(_text(block, f"{where}.{k}")))
    return _SEPARATOR.join(parts)


def _kind(block, where: str) -> str:
    kind = block.get("type") if type(block) is dict else None
    if type(kind) is Raw:
        kind = _KINDS.get(bytes(kind)) or _decode(kind)
    if not isinstance(kind, str):
        raise _invalid(where, "Input should be a content block with a type")
    return kind


def _text(block: dict, where: str):
    """A block's text: a string, or the client's JSON text of one."""
    text = block.get("text")
    if not _is_text(text):
        raise _invalid(f"{where}.text", "Field required")
    return text


def _message(out: list, message, n: int, backend) -> None:
    where = f"messages.{n}"
    if type(message) is not dict:
        raise _invalid(where, "Input should be a valid dictionary")
    role, content = message.get("role"), message.get("content")
    if role == "system":
        out.append({"role": "system", "content": _plain_text(content, f"{where}.content",
                                                             backend)})
        return
    if role not in ("user", "assistant"):
        raise refuse(backend, f"{where}.role", str(role), "it is not a role this format has")
    if isinstance(content, str):
        out.append({"role": role, "content": content})
        return
    if type(content) is not list:
        raise _invalid(f"{where}.content", "Input should be a valid string or list")
    if role == "user":
        _user(out, content, where, backend)
    else:
        _assistant(out, content, where, backend)


def _image(block: dict, where: str, backend) -> dict:
    source = _value(block.get("source"))
    kind = source.get("type") if type(source) is dict else None
    if kind == "base64":
        url = f"data:{source.get('media_type')};base64,{source.get('data')}"
    elif kind == "url":
        url = source.get("url")
    else:
        raise refuse(backend, f"{where}.source", f"image source {kind}")
    return {"type": "image_url", "image_url": {"url": url}}


def _document(block: dict, where: str, backend) -> dict:
    source = _value(block.get("source"))
    if (type(source) is dict and source.get("type") == "text"
            and isinstance(source.get("data"), str)):
        return {"type": "text", "text": source["data"]}
    kind = source.get("type") if type(source) is dict else None
    raise refuse(backend, where, f"document ({kind} source)",
                 "only plain-text documents have an equivalent there")


def _user(out: list, content: list, where: str, backend) -> None:
    parts: list[dict] = []
    result_images: list[dict] = []
    for k, block in enumerate(content):
        at = f"{where}.content.{k}"
        kind = _kind(block, at)
        if kind == "text":
            parts.append({"type": "text", "text": _text(block, at)})
        elif kind == "image":
            parts.append(_image(block, at, backend))
        elif kind == "document":
            parts.append(_document(block, at, backend))
        elif kind == "tool_result":
            call = _value(block.get("tool_use_id"))
            if not isinstance(call, str):
                raise _invalid(f"{at}.tool_use_id", "Field required")
            text = _result_text(block.get("content"), at, backend, result_images)
            if _value(block.get("is_error")):
                text = "Error: " + _value(text)
            out.append({"role": "tool", "tool_call_id": call, "content": text})
        else:
            raise refuse(backend, at, kind)
    parts[:0] = result_images
    if not parts:
        return
    if len(parts) == 1 and parts[0]["type"] == "text":
        out.append({"role": "user", "content": parts[0]["text"]})
    else:
        out.append({"role": "user", "content": parts})


def _result_text(content, where: str, backend, images: list):
    if type(content) is Raw:
        if _is_text(content):
            return content
        try:
            content = _blocks(content) if memoryview(content)[:1] == b"[" else _decode(content)
        except msgspec.ValidationError:  # not all blocks: the checks below say what is wrong
            content = _decode(content)
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if type(content) is not list:
        raise _invalid(f"{where}.content", "Input should be a valid string or list")
    texts = []
    for j, block in enumerate(content):
        at = f"{where}.content.{j}"
        kind = _kind(block, at)
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "image":
            images.append(_image(block, at, backend))
        elif kind == "document":
            texts.append(_document(block, at, backend)["text"])
        elif kind == "tool_reference" and isinstance(_value(block.get("tool_name")), str):
            # Anthropic expands it into a deferred tool's definition; here every tool is
            # among the functions already, so the reference says which one was loaded.
            texts.append(f"Tool loaded: {_value(block['tool_name'])}")
        else:
            raise refuse(backend, at, kind)
    return texts[0] if len(texts) == 1 else "\n".join(_value(t) for t in texts)


def _assistant(out: list, content: list, where: str, backend) -> None:
    texts, calls, thoughts = [], [], []
    keep_thoughts = quirk(backend, "reasoning_history") == "reasoning_content"
    for k, block in enumerate(content):
        at = f"{where}.content.{k}"
        kind = _kind(block, at)
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_use":
            call, name = _value(block.get("id")), _value(block.get("name"))
            if not isinstance(call, str) or not isinstance(name, str):
                raise _invalid(at, "tool_use needs an id and a name")
            given = block.get("input", {})
            arguments = bytes(given).decode() if type(given) is Raw else _encode(given).decode()
            calls.append({"id": call, "type": "function",
                          "function": {"name": name, "arguments": arguments}})
        elif kind in _DROPPED_ASSISTANT:
            if kind == "thinking" and keep_thoughts and _is_text(block.get("thinking")):
                thoughts.append(_value(block["thinking"]))
        else:
            raise refuse(backend, at, kind)
    if len(texts) > 1:
        texts = [_SEPARATOR.join(_value(t) for t in texts)]
    message = {"role": "assistant", "content": texts[0] if texts else None}
    if calls:
        message["tool_calls"] = calls
    if (thoughts or calls) and keep_thoughts:
        # DeepSeek's thinking mode refuses a call turn without it, even an empty one.
        message["reasoning_content"] = _SEPARATOR.join(thoughts)
    elif not texts and not calls:
        return  # nothing but the model's own reasoning: nothing the model is told
    out.append(message)


def _tools(tools, backend) -> list[dict]:
    if type(tools) is not list:
        raise _invalid("tools", "Input should be a valid list")
    out = []
    for j, tool in enumerate(tools):
        kind = tool.get("type", "custom") if type(tool) is dict else None
        if kind not in ("custom", None) or type(tool.get("input_schema")) is not dict:
            raise refuse(backend, f"tools.{j}", f"tool type {kind}",
                         "server tools run inside Anthropic's API")
        function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description"):
            function["description"] = tool["description"]
        if tool.get("strict") is not None:
            function["strict"] = tool["strict"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(out: dict, choice, backend) -> None:
    if type(choice) is not dict:
        return
    kind = choice.get("type")
    if kind == "auto":
        out["tool_choice"] = "auto"
    elif kind == "any":
        out["tool_choice"] = "required"
    elif kind == "none":
        out["tool_choice"] = "none"
    elif kind == "tool":
        out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    else:
        raise refuse(backend, "tool_choice", f"tool_choice {kind}")
    if choice.get("disable_parallel_tool_use"):
        out["parallel_tool_calls"] = False


def _response_format(fmt: dict, backend) -> dict:
    if fmt.get("type") == "json_schema" and type(fmt.get("schema")) is dict:
        return {"type": "json_schema",
                "json_schema": {"name": "output", "schema": fmt["schema"], "strict": True}}
    raise refuse(backend, "output_config.format", f"output format {fmt.get('type')}")


def _reasoning(out: dict, body: dict, backend) -> None:
    """``thinking`` as the backend's own reasoning switch, when its quirks name one; without
    one it is dropped (the model answers without extended reasoning)."""
    control = quirk(backend, "reasoning_control")
    thinking = body.get("thinking")
    if control == "none" or type(thinking) is not dict:
        return
    on = thinking.get("type") in ("enabled", "adaptive")
    budget = thinking.get("budget_tokens")
    if control == "reasoning_effort":
        if on:
            effort = (body.get("output_config") or {}).get("effort")
            if effort not in ("low", "medium", "high"):
                effort = ("low" if isinstance(budget, int) and budget < 4096 else
                          "high" if isinstance(budget, int) and budget >= 16384 else "medium")
            out["reasoning_effort"] = effort
    elif control == "openrouter":
        out["reasoning"] = ({"max_tokens": budget} if on and isinstance(budget, int)
                            else {"enabled": on})
    elif control == "chat_template_kwargs":
        out["chat_template_kwargs"] = {"enable_thinking": on}
    elif control == "deepseek":
        out["thinking"] = {"type": "enabled" if on else "disabled"}


# --- answers ----------------------------------------------------------------------------------

class Malformed(Exception):
    """A value of the wrong type where an answer's shape says what it must be: its text is
    where, then what is wrong (``choices[0].message.content is not a string``)."""


# Past this, a "token count" is no count: no context holds 2**53 tokens, and JavaScript
# clients lose integers beyond it.
MAX_COUNT = 2 ** 53


def _optional(value, kind, where: str, what: str):
    """``value`` when it is of ``kind``; None for null or absent; anything else is malformed."""
    if value is None or type(value) is kind:
        return value
    raise Malformed(f"{where} is not {what}")


def _optional_text(value, where: str):
    return _optional(value, str, where, "a string")


def _count(value, where: str) -> int:
    """A token count as an integer: null is 0, an integral float (``12.0``) is its integer."""
    if value is None:
        return 0
    if type(value) is float and value.is_integer():
        value = int(value)
    if type(value) is not int or not 0 <= value <= MAX_COUNT:
        raise Malformed(f"{where} is not a token count")
    return value


def anthropic_usage(usage, where: str = "usage") -> dict:
    """Chat Completions usage as Anthropic's: cached prompt tokens are not input tokens there.
    Counts must be counts (Malformed otherwise): a string or a fraction is never passed on."""
    usage = _optional(usage, dict, where, "an object") or {}
    prompt = _count(usage.get("prompt_tokens"), f"{where}.prompt_tokens")
    details = _optional(usage.get("prompt_tokens_details"), dict,
                        f"{where}.prompt_tokens_details", "an object") or {}
    cached = (_count(details.get("cached_tokens"), f"{where}.prompt_tokens_details.cached_tokens")
              or _count(usage.get("prompt_cache_hit_tokens"), f"{where}.prompt_cache_hit_tokens"))
    return {"input_tokens": max(0, prompt - cached),
            "output_tokens": _count(usage.get("completion_tokens"), f"{where}.completion_tokens"),
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def stop_reason(finish_reason, called: bool) -> str:
    # Some servers (Ollama among them) say "stop" after tool calls.
    if called and finish_reason in (None, "stop"):
        return "tool_use"
    return STOP_REASONS.get(finish_reason, "end_turn")


def tool_input(arguments, call_id, name, backend_name: str) -> dict:
    """A call's arguments as the ``input`` object, or an ``api_error`` that quotes them."""
    if type(arguments) is dict:
        return arguments
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        return {}
    try:
        value = _decode(arguments)
    except (msgspec.DecodeError, TypeError):
        value = None
    if type(value) is not dict:
        text = arguments if isinstance(arguments, str) else repr(arguments)
        raise RelayError(502, f"upstream {backend_name} called tool {name} ({call_id}) with "
                              f"arguments that are not a JSON object: {text[:500]!r}",
                         "api_error", rule="openai_arguments")
    return value


def _reasoning_text(message: dict):
    # Extensions, not the format's own fields: read when they are text, else left alone.
    for key in ("reasoning_content", "reasoning"):
        value = message.get(key)
        if isinstance(value, str) and value:
            return value
    return None


def _content_text(content, where: str) -> str | None:
    """``content`` as one string: a string, or the text of a list of parts (parts without
    text, such as Mistral's thinking parts, add none)."""
    if type(content) is not list:
        return _optional_text(content, where)
    texts = []
    for k, part in enumerate(content):
        part = _optional(part, dict, f"{where}[{k}]", "an object")
        text = _optional_text(part.get("text"), f"{where}[{k}].text") if part else None
        if text:
            texts.append(text)
    return "".join(texts)


def _function(call, where: str) -> dict:
    call = _optional(call, dict, where, "an object")
    if call is None:
        raise Malformed(f"{where} is not an object")
    _optional_text(call.get("id"), f"{where}.id")
    function = _optional(call.get("function"), dict, f"{where}.function", "an object") or {}
    _optional_text(function.get("name"), f"{where}.function.name")
    if type(function.get("arguments")) is not dict:
        _optional_text(function.get("arguments"), f"{where}.function.arguments")
    return function


def anthropic_message(chat, backend_name: str, model: str | None = None) -> dict:
    """A Chat Completions answer as an Anthropic message (RelayError 502 for tool arguments
    that are not a JSON object, or an answer that is not a chat completion, naming what is
    wrong with it)."""
    try:
        return _message_of(chat, backend_name, model)
    except Malformed as e:
        raise RelayError(502, f"upstream {backend_name} answered with a malformed chat "
                              f"completion: {e}", "api_error", rule="openai_malformed") from None


def _message_of(chat, backend_name: str, model: str | None) -> dict:
    if type(chat) is not dict:
        raise Malformed("the answer is not a JSON object")
    choices = _optional(chat.get("choices"), list, "choices", "a list")
    if not choices:
        raise RelayError(502, f"upstream {backend_name} answered without a choice",
                         "api_error", rule="openai_malformed")
    choice = _optional(choices[0], dict, "choices[0]", "an object")
    if choice is None:
        raise Malformed("choices[0] is not an object")
    message = _optional(choice.get("message"), dict, "choices[0].message", "an object") or {}
    finish_reason = _optional_text(choice.get("finish_reason"), "choices[0].finish_reason")
    answered_model = _optional_text(chat.get("model"), "model")
    usage = anthropic_usage(chat.get("usage"))
    content: list[dict] = []
    reasoning = _reasoning_text(message)
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    text = _content_text(message.get("content"), "choices[0].message.content")
    if text:
        content.append({"type": "text", "text": text})
    refusal = _optional_text(message.get("refusal"), "choices[0].message.refusal")
    if refusal:
        content.append({"type": "text", "text": refusal})
    msg_id = message_id()
    calls = _optional(message.get("tool_calls"), list, "choices[0].message.tool_calls",
                      "a list") or []
    for i, call in enumerate(calls):
        function = _function(call, f"choices[0].message.tool_calls[{i}]")
        call_id = call.get("id") or f"call_{msg_id}_{i}"
        name = function.get("name")
        if not name:
            raise RelayError(502, f"upstream {backend_name} sent tool call {call_id} without "
                                  "a name", "api_error", rule="openai_arguments")
        content.append({"type": "tool_use", "id": call_id, "name": name,
                        "input": tool_input(function.get("arguments"), call_id, name,
                                            backend_name)})
    return {"id": msg_id, "type": "message", "role": "assistant",
            "model": answered_model or model, "content": content,
            "stop_reason": stop_reason(finish_reason, bool(calls)),
            "stop_sequence": None, "usage": usage}


def answer_bytes(payload: bytes, backend_name: str, model: str | None = None) -> bytes:
    """A Chat Completions answer body as an Anthropic message body; a RelayError 502 naming
    what is wrong when it is not a chat completion (every such answer is one: the relay
    translates it or says why not, never fails on it)."""
    try:
        chat = orjson.loads(payload)
    except orjson.JSONDecodeError:
        raise RelayError(502, f"upstream {backend_name} answered with a body that is not "
                              f"JSON: {payload[:200]!r}", "api_error",
                         rule="openai_malformed") from None
    return _encode(anthropic_message(chat, backend_name, model))


def error_type(status: int) -> str:
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def error_message(payload: bytes, status: int) -> str:
    """The upstream's own words: ``{"error": {"message"}}``, ``{"error": "..."}`` (Ollama),
    ``{"message"}`` (vLLM's older form), else the body's text."""
    try:
        doc = orjson.loads(payload)
    except orjson.JSONDecodeError:
        doc = None
    if type(doc) is dict:
        error = doc.get("error")
        if type(error) is dict and isinstance(error.get("message"), str):
            return error["message"]
        if isinstance(error, str):
            return error
        if isinstance(doc.get("message"), str):
            return doc["message"]
    text = payload.decode("utf-8", "replace").strip()
    return text[:2000] if text else f"upstream answered HTTP {status}"


def error_bytes(status: int, payload: bytes, request_id: str | None = None) -> bytes:
    """An OpenAI-format error body as Anthropic's, with the matching type for its status."""
    return error_body(error_type(status), error_message(payload, status), request_id)


def _created(value, where: str) -> str:
    """``created`` (Unix seconds) as Anthropic's ``created_at``; none is the epoch."""
    if value is None:
        value = 0
    if type(value) not in (int, float):
        raise Malformed(f"{where} is not a time")
    try:
        moment = datetime.datetime.fromtimestamp(value, datetime.timezone.utc)
    except (OverflowError, OSError, ValueError):
        raise Malformed(f"{where} is not a time") from None
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _model(entry, where: str) -> dict:
    entry = _optional(entry, dict, where, "an object")
    if entry is None or type(entry.get("id")) is not str:
        raise Malformed(f"{where}.id is not a string")
    return {"type": "model", "id": entry["id"], "display_name": entry["id"],
            "created_at": _created(entry.get("created"), f"{where}.created")}


def models_bytes(payload: bytes, backend_name: str = "") -> bytes:
    """``GET /models`` (a list, or one model) in Anthropic's shape; a RelayError 502 naming
    what is wrong when it is neither."""
    try:
        doc = orjson.loads(payload)
        if type(doc) is dict and "data" not in doc and "id" in doc:
            return orjson.dumps(_model(doc, "(the model)"))
        if type(doc) is not dict:
            raise Malformed("the answer is not a JSON object")
        data = _optional(doc.get("data"), list, "data", "a list") or []
        models = [_model(m, f"data[{n}]") for n, m in enumerate(data)]
    except orjson.JSONDecodeError:
        raise RelayError(502, f"upstream {backend_name} answered with a model list that is "
                              "not JSON", "api_error", rule="openai_malformed") from None
    except Malformed as e:
        raise RelayError(502, f"upstream {backend_name} answered with a malformed model "
                              f"list: {e}", "api_error", rule="openai_malformed") from None
    return orjson.dumps({"data": models, "has_more": False,
                         "first_id": models[0]["id"] if models else None,
                         "last_id": models[-1]["id"] if models else None})


def estimate_tokens(raw: bytes) -> int:
    """A token count without a tokenizer: four bytes of request per token, the usual rule of
    thumb for English and code. An estimate, and answered as one."""
    return max(1, (len(raw) + 3) // 4)


# --- streams ----------------------------------------------------------------------------------

def _event(name: bytes, data: dict) -> bytes:
    return b"event: " + name + b"\ndata: " + orjson.dumps(data) + b"\n\n"


_PING = _event(b"ping", {"type": "ping"})
_STOP = _event(b"message_stop", {"type": "message_stop"})


def _payload(event: bytes) -> bytes | None:
    """The data of one event (its lines joined), or None when it has no data line."""
    if event.startswith(b"data: ") and event.find(b"\n") < 0:
        return event[6:]
    data = None
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            value = line[6:] if line[5:6] == b" " else line[5:]
            data = value if data is None else data + b"\n" + value
    return data


_DELTA = b'event: content_block_delta\ndata: {"type":"content_block_delta","index":'
_TEXT_DELTA = b',"delta":{"type":"text_delta","text":'
_THINKING_DELTA = b',"delta":{"type":"thinking_delta","thinking":'
_JSON_DELTA = b',"delta":{"type":"input_json_delta","partial_json":'


def _delta(index: int, kind: bytes, value: str) -> bytes:
    return _DELTA + str(index).encode() + kind + orjson.dumps(value) + b"}}\n\n"


class _Call:
    """One streamed tool call: what is known of it, and whether its block is out."""

    __slots__ = ("index", "id", "name", "parts", "block")

    def __init__(self, index):
        self.index = index
        self.id = None
        self.name = None
        self.parts: list[str] = []
        self.block: int | None = None  # its Anthropic block index, once started


class _Held:
    """Text or thinking that came while a tool call was streaming live."""

    __slots__ = ("kind", "parts")

    def __init__(self, kind: str, text: str):
        self.kind = kind
        self.parts = [text]


# What one stream may hold back at once: the event still coming, and the tool calls'
# arguments with what waits while one streams live (text, other calls; each call counts
# CALL_BYTES besides). The
# same bound as the Anthropic path's (relay.stream): past it the upstream has stopped making
# sense, and the stream ends with an ``error`` event rather than the relay's memory.
MAX_EVENT_BYTES = MAX_HELD_BYTES = 64 * 1024 * 1024
CALL_BYTES = 256
_EMPTY: dict = {}  # read, never written


class StreamTranslator:
    """One Chat Completions stream as Anthropic SSE bytes: :meth:`feed` each upstream chunk
    (any boundaries) and send on what it returns; :meth:`close` when the upstream is done.

    ``ended`` says the translated stream is complete (``message_stop`` or ``error`` out).
    ``fault`` is ``(outcome, message)`` when the translator ended the stream itself with an
    ``error`` event (``upstream_malformed`` for a chunk of the wrong shape, ``stream_error``
    for one that grew past the limits): the caller need read no more of the upstream then. ``raw`` keeps the upstream's
    own bytes for the record, bounded (a :class:`relay.bounded.HeadTail`). Time and memory
    are linear in the stream: an event that takes many chunks is appended to, never copied,
    until it ends."""

    def __init__(self, backend_name: str, model: str | None = None, keep_raw: bool = True):
        self.backend = backend_name
        self.model = model
        self.pending: list[bytes] = []  # the start of an event still coming
        self.pending_size = 0
        self.cr = False  # "\r" line ends seen: every chunk is normalised from then on
        self.held_cr = False  # a chunk ended in "\r": is it half of "\r\n"?
        self.raw: HeadTail | None = HeadTail() if keep_raw else None
        self.id = message_id()
        self.started = False
        self.ended = False
        self.fault: tuple[str, str] | None = None
        self.blocks = 0  # Anthropic blocks started so far
        self.open = None  # the live block: "text", "thinking", a _Call, or None
        self.calls: dict = {}  # upstream index -> its current _Call
        self.called = False
        self.held: list = []  # _Held and _Call items waiting, in arrival order
        self.held_bytes = 0  # what the calls and ``held`` keep
        self.finish_reason = None
        self.usage = None  # Anthropic's usage, from the last chunk that had one

    def feed(self, chunk: bytes) -> bytes:
        if self.raw is not None:
            self.raw.add(chunk)
        if self.ended:
            return b""
        if self.cr or b"\r" in chunk:
            chunk = self._line_feeds(chunk)
        if not chunk:
            return b""
        pending = self.pending
        if pending:
            # Joined only once the event ends: its blank line in this chunk, or straddling
            # the two ("\n" | "\n").
            if b"\n\n" not in chunk and not (chunk[0] == 0x0A and pending[-1][-1] == 0x0A):
                return self._hold_back(chunk)
            buf = b"".join(pending) + chunk
            pending.clear()
            self.pending_size = 0
        else:
            buf = chunk
        out: list[bytes] = []
        start = 0
        while not self.ended:
            end = buf.find(b"\n\n", start)
            if end < 0:
                break
            event = buf[start:end]
            start = end + 2
            if event:
                self._event(event, out)
        if not self.ended and start < len(buf):
            out.append(self._hold_back(buf[start:] if start else buf))
        if len(out) == 1:
            return out[0]
        return b"".join(out)

    def _line_feeds(self, chunk: bytes) -> bytes:
        """Any line end as "\n"; a "\r" at the very end waits for the next chunk to say
        whether it was the first half of "\r\n"."""
        self.cr = True
        if self.held_cr:
            chunk = b"\r" + chunk
        self.held_cr = chunk.endswith(b"\r")
        if self.held_cr:
            chunk = chunk[:-1]
        return chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")

    def _hold_back(self, part: bytes) -> bytes:
        self.pending.append(part)
        self.pending_size += len(part)
        if self.pending_size <= MAX_EVENT_BYTES:
            return b""
        out: list[bytes] = []
        self._fail(out, f"upstream stream from {self.backend} broke off: an event grew past "
                        f"{MAX_EVENT_BYTES} bytes without ending", fault="stream_error")
        return out[0]

    def close(self) -> bytes:
        """The upstream has finished: what is left. Without ``[DONE]`` or a finish reason the
        stream is left unended, for the caller to report as cut. A last event without its
        blank line counts when it is whole; a fragment cut off mid-event does not."""
        if self.ended:
            return b""
        out: list[bytes] = []
        rest = b"".join(self.pending).strip(b"\r\n")
        self.pending.clear()
        if rest:
            payload = _payload(rest)
            if payload == b"[DONE]":
                self._end(out)
            elif payload is not None:
                try:
                    data = orjson.loads(payload)
                except orjson.JSONDecodeError:
                    data = None
                if type(data) is dict:
                    self._data(data, out)
        if not self.ended and self.finish_reason is not None:
            self._end(out)
        return b"".join(out)

    # the upstream's events

    def _event(self, event: bytes, out: list) -> None:
        payload = _payload(event)
        if payload is None:
            return  # a comment or a keep-alive
        if payload == b"[DONE]":
            self._end(out)
            return
        try:
            data = orjson.loads(payload)
        except orjson.JSONDecodeError:
            data = None
        if type(data) is not dict:
            self._fail(out, f"upstream {self.backend} sent a stream event that is not a "
                            f"JSON object: {event[:200]!r}", fault="upstream_malformed")
            return
        self._data(data, out)

    def _data(self, data: dict, out: list) -> None:
        if "error" in data or data.get("object") == "error":
            self._upstream_error(data, out)
            return
        try:
            self._chunk(data, out)
        except Malformed as e:
            self._fail(out, f"upstream {self.backend} sent a malformed stream chunk: {e}",
                       fault="upstream_malformed")

    def _chunk(self, data: dict, out: list) -> None:
        # Read and checked whole before any of it goes out: nothing of a malformed chunk does.
        # The checks are written out: this runs for every chunk of every stream.
        model = data.get("model")
        if model is not None and model.__class__ is not str:
            raise Malformed("model is not a string")
        usage = data.get("usage")
        if usage is not None:
            usage = anthropic_usage(usage) if usage or usage.__class__ is not dict else None
        choices = data.get("choices")
        choice = delta = _EMPTY
        if choices is not None:
            if choices.__class__ is not list:
                raise Malformed("choices is not a list")
            if choices:
                choice = _optional(choices[0], dict, "choices[0]", "an object") or _EMPTY
                delta = choice.get("delta")
                if delta.__class__ is not dict:
                    delta = _optional(delta, dict, "choices[0].delta", "an object") or _EMPTY
        content = delta.get("content")
        if content is not None and content.__class__ is not str:
            content = _content_text(content, "choices[0].delta.content")
        calls = delta.get("tool_calls")
        fragments = [self._fragment(call, position) for position, call in enumerate(
            _optional(calls, list, "choices[0].delta.tool_calls", "a list"))] \
            if calls is not None else ()
        reason = choice.get("finish_reason")
        if reason is not None and reason.__class__ is not str:
            raise Malformed("choices[0].finish_reason is not a string")
        if not self.started:
            self._start(model, out)
        if usage:
            self.usage = usage
        if "reasoning_content" in delta or "reasoning" in delta:
            reasoning = _reasoning_text(delta)
            if reasoning:
                self._text("thinking", reasoning, out)
        if content:
            self._text("text", content, out)
        for fragment in fragments:
            self._call(*fragment, out)
            if self.ended:
                return
        if reason:
            self.finish_reason = reason

    @staticmethod
    def _fragment(fragment, position: int) -> tuple:
        """One tool call fragment, checked: its index, id, name and arguments."""
        where = f"choices[0].delta.tool_calls[{position}]"
        function = _function(fragment, where)
        index = fragment.get("index")
        if index is None:
            index = position
        elif type(index) is not int:
            raise Malformed(f"{where}.index is not an integer")
        arguments = function.get("arguments")
        if type(arguments) is dict:
            arguments = orjson.dumps(arguments).decode()
        return index, fragment.get("id") or None, function.get("name"), arguments

    def _start(self, model: str | None, out: list) -> None:
        self.started = True
        message = {"id": self.id, "type": "message", "role": "assistant",
                   "model": model or self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": 0, "output_tokens": 0}}
        out.append(_event(b"message_start", {"type": "message_start", "message": message}))
        out.append(_PING)

    def _hold(self, size: int, out: list) -> bool:
        """Count ``size`` more bytes held; False (the stream ended) past the limit."""
        self.held_bytes += size
        if self.held_bytes <= MAX_HELD_BYTES:
            return True
        self._fail(out, f"upstream {self.backend} sent more than {MAX_HELD_BYTES} bytes of "
                        "tool calls (and text while one streamed) in one answer",
                   fault="stream_error")
        return False

    def _text(self, kind: str, text: str, out: list) -> None:
        open_ = self.open
        if open_.__class__ is _Call:
            if not self._hold(len(text), out):
                return
            held = self.held
            if held and held[-1].__class__ is _Held and held[-1].kind == kind:
                held[-1].parts.append(text)
            else:
                held.append(_Held(kind, text))
            return
        if open_ != kind:
            if open_ is not None:
                self._stop(out)
            self._open(kind, out)
        out.append(_delta(self.blocks - 1, _TEXT_DELTA if kind == "text" else _THINKING_DELTA,
                          text))

    def _open(self, kind: str, out: list) -> None:
        block = {"type": "text", "text": ""} if kind == "text" else {
            "type": "thinking", "thinking": "", "signature": ""}
        out.append(_event(b"content_block_start", {
            "type": "content_block_start", "index": self.blocks, "content_block": block}))
        self.blocks += 1
        self.open = kind

    def _call(self, index, new_id, name, arguments, out: list) -> None:
        call = self.calls.get(index)
        if call is None or (new_id and call.id and new_id != call.id):
            if not self._hold(CALL_BYTES, out):
                return
            call = self.calls[index] = _Call(index)
            self.called = True
            fresh = True
        else:
            fresh = False
        if new_id and call.id is None:
            call.id = new_id
        if name and call.name is None:
            call.name = name
        if arguments:
            if not self._hold(len(arguments), out):
                return
            call.parts.append(arguments)
            if self.open is call:
                out.append(_delta(call.block, _JSON_DELTA, arguments))
                return
        if call.block is not None or self.open is call:
            return
        live = self.open.__class__ is _Call
        if call.id and call.name and not live:
            if not fresh:
                self.held.remove(call)
            self._go_live(call, out)
        elif fresh:
            self.held.append(call)

    def _go_live(self, call: _Call, out: list) -> None:
        if self.open is not None:
            self._stop(out)
            if self.ended:
                return
        call.block = self.blocks
        self.blocks += 1
        self.open = call
        out.append(_event(b"content_block_start", {
            "type": "content_block_start", "index": call.block,
            "content_block": {"type": "tool_use", "id": call.id, "name": call.name,
                              "input": {}}}))
        if call.parts:
            out.append(_event(b"content_block_delta", {
                "type": "content_block_delta", "index": call.block,
                "delta": {"type": "input_json_delta", "partial_json": "".join(call.parts)}}))

    def _stop(self, out: list) -> None:
        open_ = self.open
        index = self.blocks - 1
        if open_ == "thinking":
            out.append(_event(b"content_block_delta", {
                "type": "content_block_delta", "index": index,
                "delta": {"type": "signature_delta", "signature": ""}}))
        elif open_.__class__ is _Call:
            index = open_.block
            try:
                tool_input("".join(open_.parts), open_.id, open_.name, self.backend)
            except RelayError as e:
                self._fail(out, e.message, fault="upstream_malformed")
                return
        out.append(_event(b"content_block_stop", {"type": "content_block_stop",
                                                  "index": index}))
        self.open = None

    def _end(self, out: list) -> None:
        """The upstream is done: close the live block, send what was held, then the stop."""
        if not self.started:
            self._start(None, out)
        for item in self.held:
            if self.open is not None:
                self._stop(out)
            if self.ended:
                return
            if item.__class__ is _Held:
                self._text(item.kind, "".join(item.parts), out)
                continue
            if not item.name:
                self._fail(out, f"upstream {self.backend} sent tool call {item.id or item.index} "
                                "without a name", fault="upstream_malformed")
                return
            if not item.id:
                item.id = f"call_{self.id}_{item.index}"
            self._go_live(item, out)
        if self.ended:
            return
        if self.open is not None:
            self._stop(out)
            if self.ended:
                return
        self.held = []
        out.append(_event(b"message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason(self.finish_reason, self.called),
                      "stop_sequence": None},
            "usage": self.usage or anthropic_usage(None)}))
        out.append(_STOP)
        self.ended = True

    def _upstream_error(self, data: dict, out: list) -> None:
        error = data.get("error") if "error" in data else data
        status = None
        message = None
        if type(error) is dict:
            message = error.get("message")
            code = error.get("code")
            status = code if isinstance(code, int) and not isinstance(code, bool) else None
        elif isinstance(error, str):
            message = error
        if not isinstance(message, str) or not message:
            message = orjson.dumps(data).decode()[:2000]
        self._fail(out, message, error_type(status) if status else "api_error")

    def _fail(self, out: list, message: str, kind: str = "api_error",
              fault: str | None = None) -> None:
        out.append(_event(b"error", {"type": "error",
                                     "error": {"type": kind, "message": message}}))
        self.ended = True
        if fault is not None:
            self.fault = (fault, message)
        # Nothing more will be read: what was held for the stream's end goes now.
        self.pending.clear()
        self.held, self.calls = [], {}
