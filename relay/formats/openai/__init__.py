"""OpenAI Chat Completions backends: Anthropic requests down, Anthropic answers back up.

One adapter (:data:`OPENAI`) over three parts, one module each: :mod:`.request`,
:mod:`.answer`, :mod:`.stream`; what they share is in :mod:`.wire`.

Everything here is a pure function of its input (the stream translator keeps only the state of
one stream), so that the plugin chain keeps seeing Anthropic requests and Anthropic events and
the translation is testable with plain data.

Requests. What translates: ``system`` (a string or text blocks) to a system message; text;
images (base64 and URL) to ``image_url`` parts; plain-text documents to text (title and
context first); ``tool_use`` to assistant ``tool_calls`` (arguments as a JSON string);
``tool_result`` to ``tool`` messages (text content; images inside a result go in a user
message right after the tool messages, since a tool message holds only text; ``is_error``
becomes an ``Error: `` prefix, as the format has no flag for it); ``tools`` to functions;
``tool_choice`` and ``disable_parallel_tool_use``; ``stop_sequences``; ``max_tokens`` (or
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
signature: only Anthropic can sign), text (and a ``refusal``, streamed or not) a ``text``
block, ``tool_calls`` ``tool_use`` blocks with their arguments parsed. Arguments that are not
a JSON object are never passed on as something else: the answer becomes an ``api_error``
(502 when not streaming, an ``error`` event in a stream, in place of the first fragment
that makes them impossible) naming the call and quoting the arguments. So does any answer or
chunk whose fields of the format's own (``choices``, ``message``/``delta``, ``content`` and
its parts' ``text``, ``refusal``, ``tool_calls`` and their ``index``, ``id``, ``function``,
``name``, ``arguments``, ``finish_reason``, ``model``, ``usage`` and its counts) are not of
their type, naming where (``choices[0].message.tool_calls[0] is not an object``): a value of
the wrong type never reaches the client, and null is taken as absent. An integral float
count (``12.0``) is its integer. Extensions (``reasoning_content``, ``reasoning``) are read
when they are text and otherwise left alone. An error in a 200 answer, and a finish reason
that says the generation failed part way (:data:`FAILED_FINISH_REASONS`), are the upstream's
error, in its own words: never a cut answer passed on as complete.

Streams. The first upstream chunk becomes ``message_start`` at once; text and thinking stream
live. One tool call at a time streams live (its ``input_json_delta`` fragments go out as they
come): an Anthropic block cannot be interleaved with another, and an OpenAI stream never says
that a call is complete before it ends, so the fragments of any other call (interleaved by
``index``, or following the first) are held and that call is sent whole, in order, when the
upstream says it is done. A call whose id or name comes after its first fragment is held until
both are known; a call that never gets a name ends the stream with an ``error`` event, one that
never gets an id is given ``call_<message>_<index>``. A name may come in pieces or again with
every fragment: a call goes live with its first fragment that adds nothing new to its name, or
as soon as anything else comes. A fresh id at an index already in use is a new call when its
fragment has a name (Ollama numbers every call of a parallel batch 0), else more of the call
there (LM Studio gives each fragment an id of its own). ``message_delta`` (stop reason, usage
from the last chunk) and ``message_stop`` go out at ``data: [DONE]``, or when the connection
ends after a ``finish_reason``; a stream cut before either gets no ``message_stop``, so the
relay ends it with its own ``error`` event. An ``error`` object in the stream becomes an
``error`` event. Memory is bounded whatever the upstream sends: an event still coming may
grow to ``MAX_EVENT_BYTES`` (the Anthropic path's limit), the tool calls' arguments with what
waits behind a live call to ``MAX_HELD_BYTES``, and past either the stream ends with an
``error`` event; the copy kept for the record is a head and a tail
(:class:`relay.bounded.HeadTail`). A whole chat completion where a stream was asked for is
translated at the close into the events of its message; a whole stream where none was asked
for is read by :func:`.stream.collected` into one message.
"""

from __future__ import annotations

from collections.abc import Mapping

from multidict import CIMultiDict

from ..base import Adapter
from .answer import (
    ERROR_TYPES,
    FAILED_FINISH_REASONS,
    MAX_COUNT,
    STOP_REASONS,
    Malformed,
    answer_bytes,
    anthropic_message,
    error_bytes,
    error_message,
    error_type,
    estimate_tokens,
    models_bytes,
    read_usage,
    stop_reason,
    tool_input,
)
from .request import chat_request, refuse, request_bytes
from .stream import (
    CALL_BYTES,
    MAX_EVENT_BYTES,
    MAX_HELD_BYTES,
    StreamTranslator,
    collected,
    is_stream,
)
from .wire import FORMAT, QUIRKS, encode, message_id, quirk, upstream_headers, upstream_path


class OpenAI(Adapter):
    """The Chat Completions format."""

    name = "openai"
    quirks = QUIRKS
    auth = "bearer"  # these servers read keys as bearer tokens
    carries_threads = False  # the format has no ``thread`` field
    checks_tool_ids = False
    signs_thinking = False  # only Anthropic signs: the translated blocks carry none
    reads_passthrough = True
    # Some servers stream whatever the request says (sgl-project/mini-sglang#51,
    # kaito-project/kaito#1880): such a stream is read whole and answered as one message.
    collects_streams = True
    # And some answer whole when asked to stream (sgl-project/sglang#2810): the translator
    # makes that answer its stream.
    streams_answers = True
    described = "openai"
    # Its stream errors are the translator's to make Anthropic's; which of them an OpenAI
    # server sends before anything else is unrecorded.
    opening_errors: Mapping[str, int] = {}

    def upstream_target(self, path: str, query: str) -> tuple[str, str]:
        # Anthropic's query parameters (?beta=true) mean nothing there.
        return upstream_path(path), ""

    def request_body(self, body: bytes, backend, endpoint: str) -> bytes:
        return request_bytes(body, backend) if endpoint == "messages" else body

    def request_headers(self, headers: CIMultiDict) -> None:
        upstream_headers(headers)

    def answer_body(self, payload: bytes, backend_name: str,
                    model: str | None) -> tuple[bytes, tuple[str, ...]]:
        if is_stream(payload):  # a server that streams even when asked not to
            message, unreported = collected(payload, backend_name, model)
            return encode(message), unreported
        return answer_bytes(payload, backend_name, model)

    def error_body(self, status: int, payload: bytes, request_id: str | None) -> bytes | None:
        return error_bytes(status, payload, request_id)

    def stream_translator(self, backend_name: str, model: str | None) -> StreamTranslator:
        return StreamTranslator(backend_name, model)

    def count_tokens(self, raw: bytes) -> int | None:
        return estimate_tokens(raw)

    def model_list(self, payload: bytes, backend_name: str) -> bytes:
        return models_bytes(payload, backend_name)


OPENAI = OpenAI()

__all__ = ["CALL_BYTES", "ERROR_TYPES", "FAILED_FINISH_REASONS", "FORMAT", "MAX_COUNT",
           "MAX_EVENT_BYTES", "MAX_HELD_BYTES", "OPENAI", "QUIRKS", "STOP_REASONS",
           "Malformed", "OpenAI", "StreamTranslator", "anthropic_message", "answer_bytes",
           "chat_request", "error_bytes", "error_message", "error_type", "estimate_tokens",
           "message_id", "models_bytes", "quirk", "read_usage", "refuse", "request_bytes",
           "stop_reason", "tool_input", "upstream_headers", "upstream_path"]
