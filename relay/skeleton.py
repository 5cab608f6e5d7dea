"""A request's structure, decoded without its bulk.

A long agent history is mostly text: tool results, file contents, thinking. The checks the
relay makes on every request need only its shape (roles, block types, tool ids), but a full
parse builds every string (non-ASCII text costs about twice as much), and re-serialising a
full parse encodes each of them again. So a request is decoded once into a *skeleton*: every
message a dict with its ``role`` and ``content``; in each content block ``type``, ``id`` and
``tool_use_id`` are Python values and every other value is a :class:`msgspec.Raw`, the JSON
text exactly as the client sent it, which encodes back byte for byte. Outside ``messages``
only ``model`` and ``stream`` are read.

A body the skeleton cannot hold (a block that is not an object, a message field of another
type, a ``model`` that is not a string...) gets ``None`` from :func:`decode`, and the caller
parses it in full: that is also where the client's error for a malformed body comes from.

The skeleton does not look inside the values it keeps raw, so it does not check that their
strings are valid UTF-8: a body with broken text there goes up, and the upstream refuses it
(unless a plugin asks for the full body first: then the relay refuses it, see
:meth:`Skeleton.to_body`).
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, Raw, UnsetType

Block = dict[str, Raw]
Message = dict[str, str | list[Block]]

# The Messages API's top-level fields (API reference and SDK, late 2026). A request with one
# more still gets a skeleton, through a second, slower decode (see ``decode``).
KNOWN_FIELDS = ("max_tokens", "system", "metadata", "stop_sequences", "stream", "temperature",
                "top_k", "top_p", "tools", "tool_choice", "thinking", "service_tier",
                "container", "mcp_servers", "context_management", "output_config",
                "output_format", "inference_geo", "speed", "cache_control", "diagnostics")

# Not tracked by the garbage collector (a quarter of the decode, and one object fewer for
# every collection while the request is in flight): a request's top level is never part of
# a reference cycle, as nothing it holds refers back to it (its lists and dicts are tracked
# as ever).
_Known = msgspec.defstruct(
    "_Known", [("model", str), ("messages", list[Message])]
    + [(name, Raw | UnsetType, UNSET) for name in KNOWN_FIELDS],
    forbid_unknown_fields=True, gc=False)

_known = msgspec.json.Decoder(_Known)
KNOWN_NAMES = frozenset(("model", "messages", *KNOWN_FIELDS))
_fields = msgspec.json.Decoder(dict[str, Raw])
_messages = msgspec.json.Decoder(list[Message])
_model = msgspec.json.Decoder(str)
_encoder = msgspec.json.Encoder()
_decode = msgspec.json.decode

# Block types as JSON text, so the common ones cost a dict lookup instead of a decode.
_TYPES = {f'"{name}"'.encode(): name for name in (
    "text", "image", "document", "search_result", "tool_use", "tool_result", "thinking",
    "redacted_thinking", "server_tool_use", "web_search_tool_result", "web_fetch_tool_result",
    "code_execution_tool_result", "bash_code_execution_tool_result",
    "text_editor_code_execution_tool_result", "mcp_tool_use", "mcp_tool_result",
    "container_upload")}


class Skeleton:
    """One request body as a skeleton: ``messages``, ``model``, ``stream``, and the rest raw."""

    __slots__ = ("_top", "messages", "model", "stream", "blocks")

    def __init__(self, top, messages: list, model: str, stream: bool, blocks: int = 0):
        self._top = top
        self.messages = messages
        self.model = model
        self.stream = stream
        self.blocks = blocks  # the content blocks decoded (0: not counted)

    def set_model(self, model: str) -> None:
        self.model = model
        if type(self._top) is dict:
            self._top["model"] = model
        else:
            self._top.model = model

    def field(self, name: str):
        """A top-level field's value (decoded), or None when the request has none."""
        top = self._top
        item = top.get(name) if type(top) is dict else getattr(top, name, None)
        if item is None or item is UNSET:
            return None
        return _decode(item) if type(item) is Raw else item

    def set_field(self, name: str, value) -> None:
        if type(self._top) is dict:
            self._top[name] = value
        else:
            setattr(self._top, name, value)

    def drop_field(self, name: str) -> None:
        top = self._top
        if type(top) is dict:
            top.pop(name, None)
        elif name in KNOWN_FIELDS:
            setattr(top, name, UNSET)

    def other_fields(self):
        """The names of top-level fields outside ``KNOWN_FIELDS`` (none in the usual request,
        which decodes into the fixed form)."""
        top = self._top
        if type(top) is not dict:
            return ()
        return [name for name in top if name not in KNOWN_NAMES]

    def encode(self) -> bytes:
        """The body as JSON: raw values as they came, the structure as it now stands."""
        return _encoder.encode(self._top)

    def to_body(self) -> dict:
        """The whole request as Python values, decoded in place: ``messages`` stays the same
        list of the same dicts, so whatever a plugin holds of it stays live. Raises
        :class:`msgspec.DecodeError` (or ValueError) for a value that is not valid JSON after
        all (broken UTF-8 in a text, a number out of range)."""
        top = self._top
        if type(top) is dict:
            body = top
        else:
            body = {name: getattr(top, name) for name in top.__struct_fields__
                    if getattr(top, name) is not UNSET}
        for key, item in body.items():
            if type(item) is Raw:
                body[key] = _decode(item)
        for message in self.messages:
            content = message.get("content")
            if type(content) is list:
                for block in content:
                    for key, item in block.items():
                        if type(item) is Raw:
                            block[key] = _decode(item)
        return body


def decode(raw: bytes) -> Skeleton | None:
    """The skeleton of a request body, or None if it cannot be held as one (see the module)."""
    top: Any  # _Known is made at run time: the type checker cannot know its fields
    try:
        try:
            top = _known.decode(raw)
            messages, model, stream = top.messages, top.model, top.stream
        except msgspec.DecodeError:
            # A field this module does not list, or a body that is not a request at all.
            top = _fields.decode(raw)
            messages = top["messages"] = _messages.decode(top["messages"])
            model = top["model"] = _model.decode(top["model"])
            stream = top.get("stream", UNSET)
        blocks = _expose(messages)
        return Skeleton(top, messages, model, stream is not UNSET and bool(_decode(stream)),
                        blocks)
    except (msgspec.MsgspecError, ValueError, RecursionError, KeyError, TypeError):
        # The full parse decides: it holds what this cannot, or writes the client's error.
        # (ValueError: msgspec 0.18 reports broken UTF-8 as a UnicodeDecodeError.)
        return None


_Rest = msgspec.defstruct(
    "_Rest", [("messages", list[Message])]
    + [(name, Raw | UnsetType, UNSET) for name in ("model", *KNOWN_FIELDS)],
    forbid_unknown_fields=True, gc=False)  # as _Known
_rest = msgspec.json.Decoder(_Rest)


def decode_messages(raw: bytes) -> list:
    """A ``messages`` array's JSON text as the skeleton holds it (see :func:`decode`)."""
    messages = _messages.decode(raw)
    _expose(messages)
    return messages


def decode_rest(raw: bytes) -> tuple[list, dict]:
    """The messages of a body's last part (``{"messages":[`` followed by the rest of a
    body), as the skeleton holds them, and the other fields given there, raw. Raises
    :class:`msgspec.DecodeError` for a field outside ``KNOWN_FIELDS``."""
    rest: Any = _rest.decode(raw)
    messages = rest.messages
    _expose(messages)
    fields = {}
    for name in rest.__struct_fields__[1:]:
        item = getattr(rest, name)
        if item is not UNSET:
            fields[name] = item
    return messages, fields


def decode_model(raw) -> str:
    return _model.decode(raw) if type(raw) is Raw else raw


def from_fields(model: str, messages: list, fields: dict) -> Skeleton:
    """The skeleton of a request made of these parts (``fields``: the other top-level
    fields, each a :data:`KNOWN_FIELDS` name with its raw JSON text), as :func:`decode`
    makes it for the same body."""
    stream = fields.get("stream", UNSET)
    return Skeleton(_Known(model=model, messages=messages, **fields), messages, model,
                    stream is not UNSET and bool(_decode(stream)))


def has_blocks(messages: list) -> bool:
    """Whether any message may hold content blocks: False only when every message is a dict
    whose ``content`` is a string (a plain chat request, which no id or block rule
    concerns)."""
    for message in messages:
        if type(message) is not dict or type(message.get("content")) is not str:
            return True
    return False


# What decoding a raw value raises when it is not JSON after all (broken UTF-8 in a text,
# a number out of range): the client's error, not a fault of the plugin that read it.
UNREADABLE = (msgspec.DecodeError, UnicodeDecodeError)


def value(item):
    """``item`` as a Python value, whether it is still raw JSON text or already decoded."""
    return _decode(item) if type(item) is Raw else item


def encode(body) -> bytes:
    """JSON for a request in any mix of decoded values and :class:`msgspec.Raw` ones."""
    return _encoder.encode(body)


def _expose(messages: list) -> int:
    """Decode the structural values of every content block, in place; returns how many
    blocks there are."""
    types = _TYPES
    blocks = 0
    for message in messages:
        content = message.get("content")
        if type(content) is not list:
            continue
        blocks += len(content)
        for block in content:
            value = block.get("type")
            if value is not None:
                block["type"] = types.get(bytes(value)) or _decode(value)
            value = block.get("id")
            if value is not None:
                block["id"] = _decode(value)
            value = block.get("tool_use_id")
            if value is not None:
                block["tool_use_id"] = _decode(value)
    return blocks
