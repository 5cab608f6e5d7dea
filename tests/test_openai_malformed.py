"""Properties of what the relay does with answers of any shape: generated malformed answers,
streamed and not, from both formats.

OpenAI format, translated: an answer becomes an Anthropic message whose every value has its
type, or a 502 ``api_error``; a stream becomes events that end in ``message_stop`` or
``error`` (or are left unended, for the relay to report as cut), and the translator never
raises. Both formats, through a real relay with the full pipeline: never a 500, never a
traceback in the log, and every stream ends in ``message_stop`` or ``event: error``.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import aiohttp
import orjson
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relay import config as config_module
from relay.chain import Chain, load_plugins
from relay.errors import RelayError
from relay.formats import openai
from relay.server import create_app
from relay.sse import SSEDecoder

COMPLETION = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
              "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                  "role": "assistant", "content": "Calling.", "reasoning_content": "hm",
                  "tool_calls": [{"id": "call_1", "type": "function", "function": {
                      "name": "Bash", "arguments": '{"command": "ls"}'}}]}}],
              "usage": {"prompt_tokens": 5, "completion_tokens": 2,
                        "prompt_tokens_details": {"cached_tokens": 1}}}
CHUNKS = [
    {"model": "m", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
    {"choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}]},
    {"choices": [{"index": 0, "delta": {"content": "Calling."}}]},
    {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_1",
                                                        "function": {"name": "Bash",
                                                                     "arguments": ""}}]}}]},
    {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {
        "arguments": '{"command": "ls"}'}}]}}]},
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}},
]
MESSAGE = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
           "content": [{"type": "text", "text": "Calling."},
                       {"type": "tool_use", "id": "toolu_1", "name": "Bash",
                        "input": {"command": "ls"}}],
           "stop_reason": "tool_use", "stop_sequence": None,
           "usage": {"input_tokens": 5, "output_tokens": 2}}
EVENTS = [
    ("message_start", {"type": "message_start", "message": {**MESSAGE, "content": [],
                                                            "stop_reason": None}}),
    ("content_block_start", {"type": "content_block_start", "index": 0,
                             "content_block": {"type": "text", "text": ""}}),
    ("content_block_delta", {"type": "content_block_delta", "index": 0,
                             "delta": {"type": "text_delta", "text": "Calling."}}),
    ("content_block_stop", {"type": "content_block_stop", "index": 0}),
    ("content_block_start", {"type": "content_block_start", "index": 1, "content_block": {
        "type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {}}}),
    ("content_block_delta", {"type": "content_block_delta", "index": 1, "delta": {
        "type": "input_json_delta", "partial_json": '{"command": "ls"}'}}),
    ("content_block_stop", {"type": "content_block_stop", "index": 1}),
    ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "tool_use",
                                                          "stop_sequence": None},
                       "usage": {"output_tokens": 2}}),
    ("message_stop", {"type": "message_stop"}),
]

values = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 63, 2 ** 63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.sampled_from(["type", "id", "name", "text", "index", "x"]), inner,
                      max_size=3),
    max_leaves=6)


def paths(doc, at=()):
    """Every place in ``doc`` a value could be replaced."""
    yield at
    if type(doc) is dict:
        for key, value in doc.items():
            yield from paths(value, (*at, key))
    elif type(doc) is list:
        for n, value in enumerate(doc):
            yield from paths(value, (*at, n))


def replaced(doc, path, value):
    if not path:
        return value
    copy = orjson.loads(orjson.dumps(doc))
    holder = copy
    for step in path[:-1]:
        holder = holder[step]
    holder[path[-1]] = value
    return copy


@st.composite
def malformed(draw, doc):
    """``doc`` with one to three of its values (or the whole) replaced by any JSON value."""
    for _ in range(draw(st.integers(1, 3))):
        places = list(paths(doc))
        doc = replaced(doc, draw(st.sampled_from(places)), draw(values))
    return doc


@st.composite
def malformed_chunks(draw):
    chunks = list(CHUNKS)
    for _ in range(draw(st.integers(1, 2))):
        n = draw(st.integers(0, len(chunks) - 1))
        chunks[n] = draw(malformed(chunks[n]))
    return chunks


def sse(chunks, done: bool) -> bytes:
    return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + (
        b"data: [DONE]\n\n" if done else b"")


def typed(message: dict) -> None:
    """Every value of a translated message has the type Anthropic's format gives it."""
    assert message["type"] == "message" and isinstance(message["id"], str)
    assert message["model"] is None or type(message["model"]) is str
    assert message["stop_reason"] in ("end_turn", "max_tokens", "tool_use", "refusal")
    for block in message["content"]:
        if block["type"] == "tool_use":
            assert type(block["id"]) is str and block["id"]
            assert type(block["name"]) is str and block["name"]
            assert type(block["input"]) is dict
        elif block["type"] == "text":
            assert type(block["text"]) is str
        else:
            assert block["type"] == "thinking" and type(block["thinking"]) is str
    usage(message["usage"])


def usage(counts: dict) -> None:
    for name, value in counts.items():
        if name == "cache_creation":  # the writes by lifetime: counts too
            usage(value)
            continue
        assert type(value) is int and value >= 0


# --- the translation --------------------------------------------------------------------------

@settings(max_examples=400, deadline=None)
@given(malformed(COMPLETION))
def test_a_malformed_chat_completion_is_translated_typed_or_a_502(doc):
    try:
        message = orjson.loads(openai.answer_bytes(orjson.dumps(doc), "oa", "asked")[0])
    except RelayError as error:
        assert error.status == 502 and error.type == "api_error"
        assert error.message.startswith("upstream oa ")
        return
    typed(message)


@settings(max_examples=300, deadline=None)
@given(malformed_chunks(), st.booleans(), st.lists(st.integers(1, 64), max_size=20))
def test_a_malformed_stream_never_breaks_the_translator(chunks, done, sizes):
    data = sse(chunks, done)
    translator = openai.StreamTranslator("oa", "asked")
    out, at = [], 0
    for size in sizes:
        out.append(translator.feed(data[at:at + size]))
        at += size
    out.append(translator.feed(data[at:]))
    out.append(translator.close())
    decoder = SSEDecoder()
    events = [e.data for e in decoder.feed(b"".join(out)) + decoder.close()]
    names = [e["type"] for e in events]
    assert ("message_stop" in names or "error" in names) == translator.ended
    if translator.ended:
        assert names[-1] in ("message_stop", "error") and names.count(names[-1]) == 1
    if translator.fault is not None:
        assert names[-1] == "error" and events[-1]["error"]["message"] == translator.fault[1]
    for event in events:
        if event["type"] == "message_start":
            model = event["message"]["model"]
            assert model is None or type(model) is str
        elif event["type"] == "content_block_start" and event["content_block"]["type"] == \
                "tool_use":
            block = event["content_block"]
            assert type(block["id"]) is str and type(block["name"]) is str
        elif event["type"] == "content_block_delta":
            assert all(type(v) is str for k, v in event["delta"].items())
        elif event["type"] == "message_delta":
            usage(event["usage"])


# --- through a real relay, both formats --------------------------------------------------------

class Tracebacks(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        if record.exc_info or record.levelno >= logging.ERROR:
            self.records.append(record)


class Live:
    """A relay with the full pipeline in front of an upstream that answers what the test
    last set, both served on a loop of their own (hypothesis drives the test from outside
    it)."""

    def __init__(self, wire: str):
        self.wire = wire
        self.answer = (200, "application/json", b"{}")
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.run(self._start())

    def run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(30)

    async def _start(self):
        async def reply(request):
            await request.read()
            status, content_type, body = self.answer
            return web.Response(status=status, body=body, headers={"Content-Type": content_type})
        upstream = web.Application()
        upstream.router.add_route("*", "/{tail:.*}", reply)
        self.runners = [web.AppRunner(upstream)]
        await self.runners[0].setup()
        site = web.TCPSite(self.runners[0], "127.0.0.1", 0)
        await site.start()
        port = self.runners[0].addresses[0][1]
        url = f"http://127.0.0.1:{port}" + ("/v1" if self.wire == "openai" else "")
        config = config_module.parse({
            "pipeline": ["dedup", "pairing", "ordering"],
            "backends": [{"name": "up", "url": url, "models": ["*"], "format": self.wire}]}, {})
        self.chain = Chain(load_plugins(config.pipeline), config)
        self.config = config
        await self.chain.startup(config)
        relay = web.AppRunner(create_app(config, self.chain))
        self.runners.insert(0, relay)
        await relay.setup()
        site = web.TCPSite(relay, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{relay.addresses[0][1]}"
        self.session = aiohttp.ClientSession()

    async def _post(self, stream: bool):
        body = {"model": "m", "max_tokens": 10, "stream": stream,
                "messages": [{"role": "user", "content": "hi"}]}
        async with self.session.post(self.url + "/v1/messages", json=body) as response:
            return response.status, response.content_type, await response.read()

    def post(self, stream: bool):
        return self.run(self._post(stream))

    async def _stop(self):
        await self.session.close()
        for runner in self.runners:
            await runner.cleanup()
        await self.chain.shutdown(self.config)

    def stop(self):
        self.run(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def live():
    started = {wire: Live(wire) for wire in ("anthropic", "openai")}
    handler = Tracebacks()
    logging.getLogger().addHandler(handler)
    yield started, handler
    logging.getLogger().removeHandler(handler)
    for server in started.values():
        server.stop()


def stream_ends_well(raw: bytes) -> bool:
    decoder = SSEDecoder()
    events = decoder.feed(raw) + decoder.close()
    return bool(events) and events[-1].name in ("message_stop", "error")


def cut_short(doc):
    """``doc``'s JSON cut off somewhere: not JSON, though it names what a plugin looks for."""
    raw = orjson.dumps(doc)
    return st.integers(1, len(raw) - 1).map(lambda n: raw[:n])


answers = st.one_of(malformed(MESSAGE), malformed(COMPLETION), values, st.binary(max_size=40),
                    cut_short(MESSAGE), cut_short(COMPLETION))


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(["anthropic", "openai"]), answers)
def test_a_relay_never_fails_on_a_malformed_answer(live, wire, answer):
    servers, tracebacks = live
    server = servers[wire]
    body = answer if type(answer) is bytes else orjson.dumps(answer)
    server.answer = (200, "application/json", body)
    status, content_type, raw = server.post(stream=False)
    assert status != 500, raw
    if wire == "openai" and status != 200:
        assert status == 502 and orjson.loads(raw)["error"]["type"] == "api_error"
    assert not tracebacks.records, tracebacks.records[0].getMessage()


@st.composite
def malformed_events(draw):
    """An Anthropic stream with an event or two malformed: its data replaced by any JSON
    value, or cut short."""
    events = [[name, data] for name, data in EVENTS]
    for _ in range(draw(st.integers(0, 2))):
        n = draw(st.integers(0, len(events) - 1))
        events[n][1] = draw(malformed(events[n][1]))
    events = [[name, orjson.dumps(data)] for name, data in events]
    if draw(st.booleans()):
        n = draw(st.integers(0, len(events) - 1))
        events[n][1] = events[n][1][:draw(st.integers(0, len(events[n][1]) - 1))]
    cut = draw(st.integers(1, len(events)))
    return b"".join(b"event: " + name.encode() + b"\ndata: " + data + b"\n\n"
                    for name, data in events[:cut])


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(st.tuples(st.just("anthropic"), malformed_events()),
                 st.tuples(st.just("openai"), st.tuples(malformed_chunks(), st.booleans()).map(
                     lambda drawn: sse(*drawn)))))
def test_a_relay_ends_every_malformed_stream_with_stop_or_error(live, drawn):
    servers, tracebacks = live
    wire, body = drawn
    server = servers[wire]
    server.answer = (200, "text/event-stream", body)
    status, content_type, raw = server.post(stream=True)
    assert status == 200 and content_type == "text/event-stream"
    assert stream_ends_well(raw), raw[-300:]
    assert not tracebacks.records, tracebacks.records[0].getMessage()
