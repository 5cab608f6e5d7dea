"""Requests: an Anthropic Messages request as a Chat Completions request (see the package's
docstring for what translates, what is dropped and what is refused)."""

from __future__ import annotations

import msgspec

from ...errors import RelayError
from .wire import FORMAT, quirk
from .wire import decode as _decode
from .wire import encode as _encode

# Block types whose loss cannot change what the model is told (see the module's docstring).
_DROPPED_ASSISTANT = frozenset({"thinking", "redacted_thinking"})
_SEPARATOR = "\n\n"  # between the text blocks of one assistant message, which takes one string

def refuse(backend, where: str, kind: str, why: str = "it has no equivalent there") -> RelayError:
    return RelayError(400, f"{where}: `{kind}` cannot be sent to backend {backend.name} "
                           f"({FORMAT} format): {why}, and the relay does not drop it",
                      "invalid_request_error", rule="openai_translation")


def _invalid(where: str, what: str) -> RelayError:
    return RelayError(400, f"{where}: {what}", "invalid_request_error")


Raw = msgspec.Raw
_Block = dict[str, Raw]
# A history's bulk (texts, tool results, tool inputs) stays the client's JSON text, which the
# encoder writes back as it is: a long history is translated without building its strings.
# The fields the translation reads, in one pass; any other is dropped anyway.
_READ = ("model", "system", "max_tokens", "temperature", "top_p", "stop_sequences", "metadata",
         "tools", "tool_choice", "output_config", "thinking", "stream", "mcp_servers",
         "container")
_Request = msgspec.defstruct(
    "_Request", [("messages", list[dict[str, str | list[_Block]]] | Raw,
                  msgspec.UNSET)]
    + [(name, Raw | msgspec.UnsetType, msgspec.UNSET) for name in _READ])
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
    else:
        # OpenAI's default, said: some servers stream when the field is absent
        # (unslothai/unsloth#5047, diegosouzapw/OmniRoute#10239, open-webui/computer#193).
        out["stream"] = False
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
        # Anthropic gives the model a document's title and context too (they are only
        # never cited): dropped, the model would not know which document it reads.
        said = [_value(block.get(key)) for key in ("title", "context")]
        said = [text for text in said if isinstance(text, str) and text]
        return {"type": "text", "text": _SEPARATOR.join([*said, source["data"]])}
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
