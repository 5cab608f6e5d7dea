"""The operator's key never goes back to a client, whatever an upstream echoes."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from aiohttp import web
from test_server import BODY, Upstream, start_upstream
from test_upstream import Recorder

from relay.redact import StreamRedactor, redact, secrets_of
from relay.testing.fixtures import start_relay

KEY = "sk-operator-0123456789abcdefghij"
CLIENT_KEY = "sk-client-0123456789abcdefghijk"


def sent_key(request: web.Request) -> str:
    return request.headers.get("x-api-key") or \
        request.headers.get("Authorization", "").removeprefix("Bearer ")


def event(name: str, data: dict) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def anthropic_stream(key: str) -> list[bytes]:
    """A stream that says the key in a text delta, cut in the middle of the key."""
    whole = b"".join([
        event("message_start", {"type": "message_start", "message": {
            "id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": "m",
            "stop_reason": None, "usage": {"input_tokens": 1, "output_tokens": 0}}}),
        event("content_block_start", {"type": "content_block_start", "index": 0,
                                      "content_block": {"type": "text", "text": ""}}),
        event("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {
            "type": "text_delta", "text": f"you sent {key}, which is fine"}}),
        event("content_block_stop", {"type": "content_block_stop", "index": 0}),
        event("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                                "usage": {"output_tokens": 1}}),
        event("message_stop", {"type": "message_stop"})])
    middle = whole.index(key.encode()) + len(key) // 2
    return [whole[:middle], whole[middle:]]


def openai_stream(key: str) -> list[bytes]:
    def chunk(delta, finish=None):
        return b"data: " + orjson.dumps({"id": "c", "model": "m", "choices": [
            {"index": 0, "delta": delta, "finish_reason": finish}]}) + b"\n\n"
    whole = (chunk({"role": "assistant", "content": ""}) + chunk({"content": f"key {key} ok"})
             + chunk({}, "stop") + b"data: [DONE]\n\n")
    middle = whole.index(key.encode()) + 5
    return [whole[:middle], whole[middle:]]


def echo(kind: str):
    async def reply(request: web.Request) -> web.StreamResponse:
        key = sent_key(request)
        headers = {"x-echo-key": f"Bearer {key}"}
        if kind == "error":
            return web.json_response({"type": "error", "error": {
                "type": "authentication_error", "message": f"invalid x-api-key: {key}"}},
                status=401, headers=headers)
        if kind == "openai_error":
            return web.json_response({"error": {"message": f"Incorrect API key: {key}",
                                                "type": "invalid_request_error"}},
                                     status=401, headers=headers)
        if kind == "answer":
            return web.json_response({
                "id": "msg_1", "type": "message", "role": "assistant", "model": "m",
                "content": [{"type": "text", "text": f"the key is {key}"}],
                "stop_reason": "end_turn", "usage": {"input_tokens": 1, "output_tokens": 1}},
                headers=headers)
        if kind == "stream":
            chunks = anthropic_stream(key)
        elif kind == "openai_stream":
            chunks = openai_stream(key)
        elif kind == "stream_error":
            start = anthropic_stream(key)[0]
            chunks = [start[:start.index(b"event: content_block_delta")],
                      event("error", {"type": "error", "error": {
                          "type": "authentication_error", "message": f"key {key} revoked"}})]
        elif kind == "openai_stream_error":
            chunks = [openai_stream(key)[0].split(b"\n\n")[0] + b"\n\n",
                      b"data: " + orjson.dumps({"error": {"message": f"key {key} revoked",
                                                          "code": 401}}) + b"\n\n"]
        else:
            whole = orjson.dumps({"data": [{"id": key}]})
            middle = whole.index(key.encode()) + 7
            chunks = [whole[:middle], whole[middle:]]
        resp = web.StreamResponse(headers={
            **headers, "Content-Type": "application/json" if kind == "models"
            else "text/event-stream"})
        await resp.prepare(request)
        for chunk in chunks:
            await resp.write(chunk)
            await asyncio.sleep(0.02)  # two reads for the relay, the key cut between them
        await resp.write_eof()
        return resp
    return reply


async def relay_with(aiohttp_server, aiohttp_client, kind, with_key=True, recorder=None,
                     **extra):
    upstream = Upstream()
    upstream.reply = echo(kind)
    server = await start_upstream(aiohttp_server, upstream)
    entry = {"name": "up", "url": str(server.make_url("")), "models": ["claude-*"],
             "default": True, **extra}
    if with_key:
        entry["api_key_env"] = "UP_KEY"
    if extra.get("format") == "openai":
        entry["url"] = entry["url"].rstrip("/") + "/v1"
    raw = {"backends": [entry], "pipeline": ["recorder"] if recorder else []}
    return await start_relay(aiohttp_client, raw, env={"UP_KEY": KEY},
                             extra={"recorder": recorder} if recorder else None)


CASES = [("error", {}, False), ("answer", {}, False), ("stream", {}, True),
         ("openai_error", {"format": "openai"}, False),
         ("openai_stream", {"format": "openai"}, True)]


@pytest.mark.parametrize("kind,extra,stream", CASES, ids=[case[0] for case in CASES])
async def test_an_echoed_key_is_redacted_everywhere(aiohttp_server, aiohttp_client, kind,
                                                    extra, stream):
    client = await relay_with(aiohttp_server, aiohttp_client, kind, **extra)
    resp = await client.post("/v1/messages", json={**BODY, "stream": stream},
                             headers={"x-api-key": CLIENT_KEY})
    body = await resp.read()
    assert KEY.encode() not in body and b"[redacted]" in body
    assert all(KEY not in value for value in resp.headers.values())
    assert resp.headers["x-echo-key"] == "Bearer [redacted]"
    if stream:
        assert body.rstrip().endswith(b'{"type":"message_stop"}')


@pytest.mark.parametrize("kind, extra", [("stream_error", {}),
                                         ("openai_stream_error", {"format": "openai"})])
async def test_an_echoed_key_in_an_upstreams_error_event_is_redacted_in_the_record_too(
        aiohttp_server, aiohttp_client, caplog, kind, extra):
    # The client's copy is redacted as written; the log line and the exchange's record of a
    # stream the upstream ended with an error are made from what was read before that.
    recorder = Recorder()
    client = await relay_with(aiohttp_server, aiohttp_client, kind, recorder=recorder, **extra)
    resp = await client.post("/v1/messages", json={**BODY, "stream": True},
                             headers={"x-api-key": CLIENT_KEY})
    body = await resp.read()
    assert b"key [redacted] revoked" in body and KEY.encode() not in body
    for _ in range(100):  # the end hooks run once the answer is out
        if recorder.ended:
            break
        await asyncio.sleep(0.01)
    (exchange,) = recorder.ended
    assert exchange.outcome == "stream_error"
    assert exchange.stream_failure.message == "key [redacted] revoked"
    assert KEY not in caplog.text and "key [redacted] revoked" in caplog.text


async def test_a_passthrough_answer_is_redacted_across_chunks(aiohttp_server, aiohttp_client):
    client = await relay_with(aiohttp_server, aiohttp_client, "models")
    resp = await client.get("/v1/models")
    body = await resp.read()
    assert orjson.loads(body) == {"data": [{"id": "[redacted]"}]}
    assert resp.headers["x-echo-key"] == "Bearer [redacted]"


async def test_the_clients_own_key_is_the_clients_to_see(aiohttp_server, aiohttp_client):
    client = await relay_with(aiohttp_server, aiohttp_client, "error", with_key=False)
    resp = await client.post("/v1/messages", json=BODY, headers={"x-api-key": CLIENT_KEY})
    assert CLIENT_KEY in (await resp.json())["error"]["message"]


def test_a_key_cut_anywhere_is_still_caught():
    secrets = secrets_of([KEY, "short"])
    assert secrets == (KEY.encode(),)  # too short to tell from words: never searched for
    text = f"a {KEY} b {KEY}".encode()
    for cut in range(len(text) + 1):
        redactor = StreamRedactor(secrets)
        out = redactor.feed(text[:cut]) + redactor.feed(text[cut:]) + redactor.close()
        assert out == redact(text, secrets) == b"a [redacted] b [redacted]"
