"""Answers: a Chat Completions answer, error or model list in Anthropic's shape, every field
of the format's own checked for its type (see the package's docstring)."""

from __future__ import annotations

import datetime
import re

import msgspec
import orjson

from ...errors import UPSTREAM_ERROR, RelayError, error_body
from .wire import decode as _decode
from .wire import encode as _encode
from .wire import message_id

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
                "function_call": "tool_use", "content_filter": "refusal"}

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error",
               529: "overloaded_error"}


# Finish reasons that say the generation failed part way, so that what came is no answer:
# OpenRouter's "error" (its provider died mid-generation, the 200 long sent:
# gethouston/houston#1211, maximhq/bifrost#5425), z.AI's "network_error"
# (genkit-ai/genkit#6259), DeepSeek's "insufficient_system_resource" (its API reference: the
# inference system ran short). Taken for "end_turn", a cut answer would look complete.
FAILED_FINISH_REASONS = frozenset({"error", "network_error", "insufficient_system_resource"})


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


def read_usage(usage, where: str = "usage") -> tuple[dict, tuple[str, ...]]:
    """Chat Completions usage as Anthropic's, and the counts (Anthropic's names) it does
    not report as they are given. There ``prompt_tokens`` is the whole prompt, cache hits
    included (``prompt_tokens_details.cached_tokens``, DeepSeek's ``prompt_cache_hit_tokens``)
    and, on OpenRouter, cache writes too (``prompt_tokens_details.cache_write_tokens``:
    https://openrouter.ai/docs/use-cases/usage-accounting); Anthropic's ``input_tokens`` is
    only what was neither read from the cache nor written to it. So each part comes out of
    ``prompt_tokens`` once, and a part larger than what is left is cut to it: the prompt is
    never counted past its total, and the part cut is unreported, since the counts contradict
    each other. ``prompt_tokens`` or ``completion_tokens`` absent (or the whole usage: many
    servers ignore ``stream_options.include_usage``) is 0 in the answer, which must have
    them, and unreported; the cache's parts are then counted as given, there being no total
    to hold them to. Counts must be counts (Malformed otherwise): a string or a fraction
    is never passed on."""
    usage = _optional(usage, dict, where, "an object") or {}
    given = usage.get("prompt_tokens")
    prompt = _count(given, f"{where}.prompt_tokens")
    unreported: list[str] = [] if given is not None else ["input_tokens"]
    completion = usage.get("completion_tokens")
    if completion is None:
        unreported.append("output_tokens")
    details = _optional(usage.get("prompt_tokens_details"), dict,
                        f"{where}.prompt_tokens_details", "an object") or {}
    cached = (_count(details.get("cached_tokens"), f"{where}.prompt_tokens_details.cached_tokens")
              or _count(usage.get("prompt_cache_hit_tokens"), f"{where}.prompt_cache_hit_tokens"))
    written = _count(details.get("cache_write_tokens"),
                     f"{where}.prompt_tokens_details.cache_write_tokens")
    if given is not None:
        if cached > prompt:
            cached = prompt
            unreported.append("cache_read_input_tokens")
        if written > prompt - cached:
            written = prompt - cached
            unreported.append("cache_creation_input_tokens")
        prompt -= cached + written
    return {"input_tokens": prompt,
            "output_tokens": _count(completion, f"{where}.completion_tokens"),
            "cache_creation_input_tokens": written, "cache_read_input_tokens": cached,
            # Writes of a lifetime no Chat Completions server names: the API's default one.
            "cache_creation": {"ephemeral_5m_input_tokens": written,
                               "ephemeral_1h_input_tokens": 0}}, tuple(unreported)


def stop_reason(finish_reason, called: bool) -> str:
    # Some servers (Ollama among them) say "stop" after tool calls.
    if called and finish_reason in (None, "stop"):
        return "tool_use"
    # And some "tool_calls" after none (vLLM with tool_choice "required" and no call parsed:
    # vllm-project/vllm#53255): Anthropic's tool_use always comes with a tool_use block.
    if not called and finish_reason in ("tool_calls", "function_call"):
        return "end_turn"
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
    return translated(chat, backend_name, model)[0]


def translated(chat, backend_name: str,
               model: str | None = None) -> tuple[dict, tuple[str, ...]]:
    """:func:`anthropic_message`, and the usage counts the answer does not report
    (:func:`read_usage`)."""
    try:
        return _message_of(chat, backend_name, model)
    except Malformed as e:
        raise RelayError(502, f"upstream {backend_name} answered with a malformed chat "
                              f"completion: {e}", "api_error", rule="openai_malformed") from None


def upstream_failure(error) -> tuple[int | None, str | None]:
    """The HTTP status and message of an error object an upstream sent in place of (or in)
    an answer: ``{"message", "code"}`` (OpenRouter's and LiteLLM's ``code`` is the HTTP status
    it stands for), or a bare string (Ollama); None for what it does not say."""
    if isinstance(error, str):
        return None, error or None
    if type(error) is not dict:
        return None, None
    code, message = error.get("code"), error.get("message")
    if type(code) is str and code.isdecimal() and len(code) == 3:
        code = int(code)  # LiteLLM's proxy says its status as a string ("code": "429")
    status = code if type(code) is int and 400 <= code <= 599 else None
    return status, message if isinstance(message, str) and message else None


def _failed(error, backend_name: str, finish_reason: str | None = None) -> RelayError:
    """A 200 answer that says the upstream failed, as the error it is: the upstream's own
    words, and the status its error names (else 502)."""
    status, message = upstream_failure(error)
    if message is None:
        message = (f"upstream {backend_name} answered with finish_reason {finish_reason!r}: "
                   "the generation failed part way" if finish_reason else
                   f"upstream {backend_name} answered with an error: "
                   f"{orjson.dumps(error).decode()[:2000]}")
    status = status or 502
    return RelayError(status, message, error_type(status), rule=UPSTREAM_ERROR)


def _message_of(chat, backend_name: str, model: str | None) -> tuple[dict, tuple[str, ...]]:
    if type(chat) is not dict:
        raise Malformed("the answer is not a JSON object")
    # OpenRouter: an error "occurred while the LLM is producing the output will be emitted
    # in the response body" of a 200 (its errors page; xyOz-dev/Saturn#43).
    if chat.get("error") is not None:
        raise _failed(chat["error"], backend_name)
    choices = _optional(chat.get("choices"), list, "choices", "a list")
    if not choices:
        raise RelayError(502, f"upstream {backend_name} answered without a choice",
                         "api_error", rule="openai_malformed")
    choice = _optional(choices[0], dict, "choices[0]", "an object")
    if choice is None:
        raise Malformed("choices[0] is not an object")
    message = _optional(choice.get("message"), dict, "choices[0].message", "an object") or {}
    finish_reason = _optional_text(choice.get("finish_reason"), "choices[0].finish_reason")
    if finish_reason in FAILED_FINISH_REASONS:
        # A gateway puts its failure on the choice (genkit-ai/genkit#6259).
        raise _failed(choice.get("error"), backend_name, finish_reason)
    answered_model = _optional_text(chat.get("model"), "model")
    usage, unreported = read_usage(chat.get("usage"))
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
            "stop_sequence": None, "usage": usage}, unreported


def answer_bytes(payload: bytes, backend_name: str,
                 model: str | None = None) -> tuple[bytes, tuple[str, ...]]:
    """A Chat Completions answer body as an Anthropic message body, and the usage counts it
    does not report (:func:`read_usage`); a RelayError 502 naming what is wrong when it is
    not a chat completion (every such answer is one: the relay translates it or says why
    not, never fails on it)."""
    try:
        chat = orjson.loads(payload)
    except orjson.JSONDecodeError:
        raise RelayError(502, f"upstream {backend_name} answered with a body that is not "
                              f"JSON: {payload[:200]!r}", "api_error",
                         rule="openai_malformed") from None
    message, unreported = translated(chat, backend_name, model)
    return _encode(message), unreported


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
    page = _html_page(text)
    if page is not None:
        # A proxy's error page (nginx, a load balancer, a captive portal): its markup, up to
        # 2,000 characters of it, says nothing more to the client than its title does.
        return f"upstream answered HTTP {status} with an HTML page: {page}"
    return text[:2000] if text else f"upstream answered HTTP {status}"


_TITLE = re.compile(r"<title[^>]*>(.*?)</title>", re.IGNORECASE | re.DOTALL)
_MARKUP = re.compile(r"<[^>]*>|\s+")


def _html_page(text: str) -> str | None:
    """What an HTML page says of itself (its title, else its text), short; None when
    ``text`` is no HTML page."""
    if not text[:15].lower().startswith(("<!doctype html", "<html", "<head")):
        return None
    found = _TITLE.search(text)
    said = _MARKUP.sub(" ", found.group(1) if found else text).strip()
    return said[:200] or "(no text)"


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
