"""What every part of the Chat Completions adapter shares: the format's name, the quirks it
reads, message ids, where a request goes and with which headers, and the JSON codecs."""

from __future__ import annotations

import itertools
import os

import msgspec

FORMAT = "OpenAI Chat Completions"

# The backend quirks this format reads, with their choices (first: the default).
QUIRKS = {
    "max_tokens_field": ("max_tokens", "max_completion_tokens"),
    "reasoning_control": ("none", "reasoning_effort", "openrouter", "chat_template_kwargs",
                          "deepseek"),
    "reasoning_history": ("drop", "reasoning_content"),
    "stream_usage": (True, False),
}


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


# msgspec, not orjson: integers past 64 bits stay exact both ways.
decode = msgspec.json.Decoder().decode
encode = msgspec.json.Encoder().encode
