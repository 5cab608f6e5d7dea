"""A hostile upstream: what a broken or malicious backend does, in both wire formats.

    python -m relay.testing.hostile [--host 127.0.0.1] [--port 0] [--malformed-model-list]

It answers Anthropic's ``POST /v1/messages`` and OpenAI's ``POST /v1/chat/completions``; the
request's ``model`` names what it does (so one server, behind any backend, serves every
mode), ``stream`` whether it streams:

- ``endless``: a stream that never ends (text deltas as fast as they are read, in the
  backend's format); not streamed, a JSON body that never ends.
- ``endless-line``: a stream that starts well, then sends one line that never ends (no line
  end, ever).
- ``echo-key``: the credential it was sent (``x-api-key``, else ``Authorization``) comes
  back: not streamed, in a 400 error's message and an ``x-echoed-key`` header; streamed, in
  that header and the text of a stream that otherwise ends well.
- ``malformed-KIND`` (OpenAI format): an answer of the wrong shape, or a stream whose third
  chunk is, for each KIND of :data:`MALFORMED`: ``usage-strings``, ``float-tokens``,
  ``choices-object``, ``tool-calls-number``, ``function-string``, ``tool-id-number``,
  ``tool-name-number``, ``part-text-number``, ``finish-reason-list``, ``model-number``,
  ``not-json``.
- anything else: a short, well-formed answer or stream.

``GET /v1/models`` lists the modes; ``GET /v1/models/malformed-created`` is one model whose
``created`` is ``1e300``, and ``--malformed-model-list`` puts that model in the list too.
Everything it sends is written as fast as the reader takes it (each write waits for the
socket), so an endless mode costs the far side what it reads and no more.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from typing import Any

import orjson
from aiohttp import web

from relay.testing import emulator

# One write of an endless mode: small enough to interleave with the reader, large enough that
# the relay, not this server, is what is measured.
WRITE_BYTES = 64 * 1024
TEXT = "All work and no play. "


def _usage_strings(doc, holder):
    doc["usage"] = {"prompt_tokens": "5", "completion_tokens": "1"}


def _float_tokens(doc, holder):
    doc["usage"] = {"prompt_tokens": 5.5, "completion_tokens": 1}


def _choices_object(doc, holder):
    doc["choices"] = {"0": doc["choices"][0]}


def _tool_calls_number(doc, holder):
    holder["tool_calls"] = [1]


def _function_string(doc, holder):
    holder["tool_calls"][0]["function"] = "x"


def _tool_id_number(doc, holder):
    holder["tool_calls"][0]["id"] = 7


def _tool_name_number(doc, holder):
    holder["tool_calls"][0]["function"]["name"] = 7


def _part_text_number(doc, holder):
    holder["content"] = [{"type": "text", "text": 5}]


def _finish_reason_list(doc, holder):
    doc["choices"][0]["finish_reason"] = [1]


def _model_number(doc, holder):
    doc["model"] = 7


# What each malformed-KIND does to a chat completion (``holder`` is its message, or a chunk's
# delta); ``not-json`` is a body (or event) that is not JSON at all.
MALFORMED = {"usage-strings": _usage_strings, "float-tokens": _float_tokens,
             "choices-object": _choices_object, "tool-calls-number": _tool_calls_number,
             "function-string": _function_string, "tool-id-number": _tool_id_number,
             "tool-name-number": _tool_name_number, "part-text-number": _part_text_number,
             "finish-reason-list": _finish_reason_list, "model-number": _model_number,
             "not-json": None}
MODES = ("endless", "endless-line", "echo-key", *(f"malformed-{kind}" for kind in MALFORMED))
HUGE_CREATED = {"id": "malformed-created", "object": "model", "created": 1e300,
                "owned_by": "hostile"}


@dataclasses.dataclass
class HostileOptions:
    host: str = "127.0.0.1"
    port: int = 0
    malformed_model_list: bool = False


OPTIONS = web.AppKey("hostile_options", HostileOptions)


# --- the two formats --------------------------------------------------------------------------

def _sse(data: dict, name: str | None = None) -> bytes:
    head = b"event: " + name.encode() + b"\n" if name else b""
    return head + b"data: " + orjson.dumps(data) + b"\n\n"


def _anthropic_start(model: str) -> bytes:
    message: dict[str, Any] = {
        "id": "msg_hostile", "type": "message", "role": "assistant", "model": model,
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": 1, "output_tokens": 0}}
    return (_sse({"type": "message_start", "message": message}, "message_start")
            + _sse({"type": "content_block_start", "index": 0,
                    "content_block": {"type": "text", "text": ""}}, "content_block_start"))


def _anthropic_delta(text: str) -> bytes:
    return _sse({"type": "content_block_delta", "index": 0,
                 "delta": {"type": "text_delta", "text": text}}, "content_block_delta")


def _anthropic_end() -> bytes:
    return (_sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
            + _sse({"type": "message_delta", "delta": {"stop_reason": "end_turn",
                                                       "stop_sequence": None},
                    "usage": {"output_tokens": 1}}, "message_delta")
            + _sse({"type": "message_stop"}, "message_stop"))


def _anthropic_message(model: str, text: str) -> dict:
    return {"id": "msg_hostile", "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": text}], "stop_reason": "end_turn",
            "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}}


def _chunk(model, delta: dict, finish_reason=None) -> dict:
    return {"id": "chatcmpl-hostile", "object": "chat.completion.chunk", "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}


def _completion(model: str, text: str) -> dict:
    """A chat completion with everything a malformation can touch: text, a call, usage."""
    return {"id": "chatcmpl-hostile", "object": "chat.completion", "created": 1, "model": model,
            "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                "role": "assistant", "content": text,
                "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "Bash", "arguments": '{"command": "ls"}'}}]}}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1}}


class Anthropic:
    path = "/v1/messages"

    @staticmethod
    def error(status: int, message: str) -> bytes:
        return orjson.dumps({"type": "error", "error": {"type": "invalid_request_error",
                                                        "message": message}})

    @staticmethod
    def start(model: str) -> bytes:
        return _anthropic_start(model)

    @staticmethod
    def delta(text: str) -> bytes:
        return _anthropic_delta(text)

    @staticmethod
    def line_start() -> bytes:
        return b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,' \
               b'"delta":{"type":"text_delta","text":"'

    @staticmethod
    def end() -> bytes:
        return _anthropic_end()

    @staticmethod
    def answer(model: str, text: str) -> bytes:
        return orjson.dumps(_anthropic_message(model, text))

    @staticmethod
    def answer_start(model: str) -> bytes:
        return (b'{"id": "msg_hostile", "type": "message", "role": "assistant", "content": '
                b'[{"type": "text", "text": "')


class OpenAI:
    path = "/v1/chat/completions"

    @staticmethod
    def error(status: int, message: str) -> bytes:
        return orjson.dumps({"error": {"message": message, "type": "invalid_request_error",
                                       "param": None, "code": None}})

    @staticmethod
    def start(model: str) -> bytes:
        return _sse(_chunk(model, {"role": "assistant", "content": ""}))

    @staticmethod
    def delta(text: str) -> bytes:
        return _sse(_chunk("hostile", {"content": text}))

    @staticmethod
    def line_start() -> bytes:
        return b'data: {"choices":[{"index":0,"delta":{"content":"'

    @staticmethod
    def end() -> bytes:
        return _sse(_chunk("hostile", {}, "stop")) + b"data: [DONE]\n\n"

    @staticmethod
    def answer(model: str, text: str) -> bytes:
        doc = _completion(model, text)
        del doc["choices"][0]["message"]["tool_calls"]
        doc["choices"][0]["finish_reason"] = "stop"
        return orjson.dumps(doc)

    @staticmethod
    def answer_start(model: str) -> bytes:
        return b'{"id": "chatcmpl-hostile", "choices": [{"index": 0, "message": {"content": "'


def malformed_answer(kind: str, model: str) -> bytes:
    """The body of a chat completion malformed as ``kind`` says."""
    malform = MALFORMED[kind]
    if malform is None:
        return b'{"id": "chatcmpl-hostile", "choices": [{'
    doc = _completion(model, "Calling.")
    malform(doc, doc["choices"][0]["message"])
    return orjson.dumps(doc)


def malformed_stream(kind: str, model: str) -> bytes:
    """A stream whose third chunk (text, a call, the finish and usage in one) is malformed as
    ``kind`` says; the chunks before it are well-formed."""
    good = OpenAI.start(model) + OpenAI.delta("Calling. ")
    malform = MALFORMED[kind]
    if malform is None:
        return good + b"data: {nope\n\n" + b"data: [DONE]\n\n"
    doc = _completion(model, "Still calling.")
    choice = doc["choices"][0]
    choice["delta"] = choice.pop("message")
    choice["delta"]["tool_calls"][0]["index"] = 0
    doc["object"] = "chat.completion.chunk"
    malform(doc, choice["delta"])
    return good + _sse(doc) + b"data: [DONE]\n\n"


# --- the server -------------------------------------------------------------------------------

def _credential(request: web.Request) -> str:
    return request.headers.get("x-api-key") or request.headers.get("authorization") or ""


async def _endless(request: web.Request, response: web.StreamResponse, first: bytes,
                   piece: bytes) -> web.StreamResponse:
    """``first``, then ``piece`` over and over until the reader goes away."""
    await response.prepare(request)
    burst = piece * max(1, WRITE_BYTES // len(piece))
    try:
        await response.write(first)
        while True:
            await response.write(burst)
    except ConnectionError:  # the reader hung up
        pass
    return response


def handler(wire):
    async def handle(request: web.Request) -> web.StreamResponse:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            body = None
        if type(body) is not dict:
            return web.Response(status=400, body=wire.error(400, "the body is not JSON"),
                                content_type="application/json")
        model = body.get("model")
        if not isinstance(model, str):
            model = "hostile"
        stream = body.get("stream") is True
        stream_headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        if model == "endless":
            if stream:
                return await _endless(request, web.StreamResponse(headers=stream_headers),
                                      wire.start(model), wire.delta(TEXT))
            return await _endless(request, web.StreamResponse(
                headers={"Content-Type": "application/json"}), wire.answer_start(model),
                TEXT.encode())
        if model == "endless-line":
            return await _endless(request, web.StreamResponse(headers=stream_headers),
                                  wire.start(model) + wire.line_start(), TEXT.encode())
        if model == "echo-key":
            key = _credential(request)
            if not stream:
                return web.Response(status=400, body=wire.error(400, f"bad key {key}"),
                                    content_type="application/json",
                                    headers={"x-echoed-key": key})
            return web.Response(body=wire.start(model) + wire.delta(f"your key is {key}")
                                + wire.end(), headers={**stream_headers, "x-echoed-key": key})
        kind = model.removeprefix("malformed-")
        if wire is OpenAI and kind in MALFORMED:
            if stream:
                return web.Response(body=malformed_stream(kind, model), headers=stream_headers)
            return web.Response(body=malformed_answer(kind, model),
                                content_type="application/json")
        if stream:
            return web.Response(body=wire.start(model) + wire.delta("fine") + wire.end(),
                                headers=stream_headers)
        return web.Response(body=wire.answer(model, "fine"), content_type="application/json")
    return handle


def _model(name: str) -> dict:
    return {"id": name, "object": "model", "created": 1735689600, "owned_by": "hostile"}


async def handle_models(request: web.Request) -> web.Response:
    listed = [_model(mode) for mode in MODES]
    if request.app[OPTIONS].malformed_model_list:
        listed.append(HUGE_CREATED)
    return web.json_response({"object": "list", "data": listed})


async def handle_model(request: web.Request) -> web.Response:
    name = request.match_info["model_id"]
    return web.json_response(HUGE_CREATED if name == HUGE_CREATED["id"] else _model(name))


def create_app(options: HostileOptions | None = None) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[OPTIONS] = options or HostileOptions()
    app.router.add_post(Anthropic.path, handler(Anthropic))
    app.router.add_post(OpenAI.path, handler(OpenAI))
    app.router.add_get("/v1/models", handle_models)
    app.router.add_get("/v1/models/{model_id}", handle_model)
    return app


async def serve(options: HostileOptions) -> None:
    await emulator.serve(options, create_app, "hostile upstream")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--malformed-model-list", action="store_true",
                        help="GET /v1/models lists a model whose created is 1e300")
    args = parser.parse_args(argv)
    asyncio.run(serve(HostileOptions(args.host, args.port, args.malformed_model_list)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
