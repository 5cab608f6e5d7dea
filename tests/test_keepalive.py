"""Stream liveness: a quiet stream gets the API's own ping, between whole events, after
message_start, and a dead upstream still ends in ``event: error``."""

from __future__ import annotations

import asyncio

import anthropic
import orjson
import pytest
from aiohttp import web
from test_server import BODY, STREAM, Upstream, start_upstream
from test_upstream import Recorder

from relay import config as config_module
from relay.errors import ConfigError
from relay.stream import PING
from relay.testing.fixtures import start_relay

START, REST = STREAM.split(b"\n\n", 1)
START += b"\n\n"


def paused(before: list[bytes], after: list[bytes], pause: float):
    """An upstream that sends ``before``, goes quiet for ``pause`` seconds, then sends
    ``after``."""
    async def reply(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in before:
            await resp.write(chunk)
        await asyncio.sleep(pause)
        for chunk in after:
            await resp.write(chunk)
        await resp.write_eof()
        return resp
    return reply


async def relay_over(aiohttp_server, aiohttp_client, reply, keepalive, extra=None,
                     **backend_extra):
    upstream = Upstream()
    upstream.reply = reply
    server = await start_upstream(aiohttp_server, upstream)
    raw = {"server": {"stream_keepalive": keepalive}, "pipeline": list(extra or ()),
           "backends": [{"name": "up", "url": str(server.make_url("")), "models": ["claude-*"],
                         **backend_extra}]}
    return await start_relay(aiohttp_client, raw, extra=extra)


def events(out: bytes) -> list[bytes]:
    return [event + b"\n\n" for event in out.split(b"\n\n") if event]


async def test_a_quiet_stream_gets_pings_between_events(aiohttp_server, aiohttp_client):
    # The pause falls after half an event: what the client gets is whole events all the same.
    cut = REST.index(b"event: content_block_delta") + 30
    reply = paused([START, REST[:cut]], [REST[cut:]], pause=0.8)
    client = await relay_over(aiohttp_server, aiohttp_client, reply, keepalive=0.1)
    resp = await client.post("/v1/messages", json={**BODY, "stream": True})
    out = await resp.read()
    got = events(out)
    assert got[0] == START
    pings = [event for event in got if event == PING]
    # The stream's own ping plus the relay's: several during 0.8 s of silence at 0.1 s.
    assert len(pings) >= 3
    assert b"".join(event for event in got if event != PING) == \
        STREAM.replace(b'event: ping\ndata: {"type": "ping"}\n\n', b"")
    assert got[-1].startswith(b"event: message_stop")


async def test_no_ping_before_message_start(aiohttp_server, aiohttp_client):
    reply = paused([], [STREAM], pause=0.6)
    client = await relay_over(aiohttp_server, aiohttp_client, reply, keepalive=0.1)
    resp = await client.post("/v1/messages", json={**BODY, "stream": True})
    out = await resp.read()
    assert out == STREAM


async def test_off_means_no_pings(aiohttp_server, aiohttp_client):
    reply = paused([START], [REST], pause=0.5)
    client = await relay_over(aiohttp_server, aiohttp_client, reply, keepalive=0)
    resp = await client.post("/v1/messages", json={**BODY, "stream": True})
    assert await resp.read() == STREAM


async def test_pings_never_hide_a_dead_upstream(aiohttp_server, aiohttp_client):
    reply = paused([START], [REST], pause=3)
    client = await relay_over(aiohttp_server, aiohttp_client, reply, keepalive=0.1,
                              timeouts={"read": 0.6})
    resp = await client.post("/v1/messages", json={**BODY, "stream": True})
    got = events(await resp.read())
    assert got[0] == START and PING in got
    assert got[-1].startswith(b"event: error\n")
    error = orjson.loads(got[-1].split(b"data: ", 1)[1])["error"]
    assert error["message"] == ("upstream up's stream broke off: nothing came for more "
                                "than 0.6 s (its timeouts.read), so the relay ended it")
    assert "Error" not in error["message"]  # no library class names for the client


def chat(delta: dict | None = None, finish=None) -> bytes:
    choice = {"index": 0, "delta": delta or {}, "finish_reason": finish}
    return b"data: " + orjson.dumps({"id": "c1", "model": "m", "choices": [choice]}) + b"\n\n"


def call(index: int, *, id=None, name=None, arguments=None) -> dict:
    function = {}
    if name:
        function["name"] = name
    if arguments is not None:
        function["arguments"] = arguments
    fragment = {"index": index, "function": function}
    if id:
        fragment["id"] = id
    return {"tool_calls": [fragment]}


async def test_pings_while_the_translator_holds_tool_call_fragments(aiohttp_server,
                                                                    aiohttp_client):
    """The upstream keeps sending (a second call's fragments, held while the first is open),
    yet nothing reaches the client: the client is what the timer watches."""
    pieces = ['{"comm', 'and": ', '"echo ', 'held', ' for', ' a', ' while"}']

    async def reply(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(chat({"role": "assistant", "content": ""}))
        await resp.write(chat(call(0, id="call_a", name="Bash", arguments='{"command": ')))
        await resp.write(chat(call(1, id="call_b", name="Bash")))
        for piece in pieces:
            await asyncio.sleep(0.15)
            await resp.write(chat(call(1, arguments=piece)))
        await resp.write(chat(call(0, arguments='"ls"}')))
        await resp.write(chat(finish="tool_calls"))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
    client = await relay_over(aiohttp_server, aiohttp_client, reply, keepalive=0.2,
                              format="openai")
    resp = await client.post("/v1/messages", json={**BODY, "stream": True})
    got = events(await resp.read())
    assert got[0].startswith(b"event: message_start")
    # The translator's own ping follows message_start; the relay's come during the hold.
    assert got.count(PING) >= 2
    parsed = [orjson.loads(event.split(b"data: ", 1)[1]) for event in got if event != PING
              and not event.startswith(b"event: ping")]
    inputs: dict = {}
    for event in parsed:
        if event["type"] == "content_block_start":
            inputs[event["index"]] = [event["content_block"]["id"], ""]
        elif event["type"] == "content_block_delta":
            inputs[event["index"]][1] += event["delta"]["partial_json"]
    assert {block_id: orjson.loads(text) for block_id, text in inputs.values()} == {
        "call_a": {"command": "ls"}, "call_b": {"command": "echo held for a while"}}
    assert parsed[-1]["type"] == "message_stop"


@pytest.mark.parametrize("value", [-1, "10", True])
def test_stream_keepalive_must_be_seconds(value):
    with pytest.raises(ConfigError, match=r"^server\.stream_keepalive: "):
        config_module.parse({"server": {"stream_keepalive": value},
                             "backends": [{"name": "b", "url": "http://127.0.0.1:1"}]})


def test_stream_keepalive_defaults_on():
    config = config_module.parse({"backends": [{"name": "b", "url": "http://127.0.0.1:1"}]})
    assert config.stream_keepalive == 10.0


async def test_pings_never_hide_a_dead_openai_format_upstream(aiohttp_server, aiohttp_client):
    async def reply(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(chat({"role": "assistant", "content": ""}))
        await resp.write(chat(call(0, id="call_a", name="Bash", arguments='{"comm')))
        await asyncio.sleep(3)
        await resp.write_eof()
        return resp
    client = await relay_over(aiohttp_server, aiohttp_client, reply, keepalive=0.1,
                              format="openai", timeouts={"read": 0.6})
    resp = await client.post("/v1/messages", json={**BODY, "stream": True})
    got = events(await resp.read())
    assert got[0].startswith(b"event: message_start") and PING in got
    assert got[-1].startswith(b"event: error\n")
    assert b"timeouts.read" in got[-1]


async def test_the_sdk_reads_a_pinged_stream_as_the_same_message(aiohttp_server,
                                                                 aiohttp_client):
    plain = STREAM.replace(b'event: brand_new_event\ndata: {"type":"brand_new_event"}\n\n', b"")
    head, tail = plain.split(b"event: content_block_delta", 1)
    reply = paused([head], [b"event: content_block_delta" + tail], pause=0.6)
    recorder = Recorder()
    client = await relay_over(aiohttp_server, aiohttp_client, reply, keepalive=0.1,
                              extra={"rec": recorder})
    sdk = anthropic.AsyncAnthropic(base_url=str(client.make_url("")), api_key="k" * 20,
                                   max_retries=0)
    try:
        # Twice: the SDK builds its event models on the first stream it reads, on this loop,
        # which on a busy machine can take up the pause the pings are counted in.
        for _ in range(2):
            async with sdk.messages.stream(model=BODY["model"], max_tokens=10,
                                           messages=BODY["messages"]) as stream:
                kinds = [event.type async for event in stream]
                message = await stream.get_final_message()
            assert "ping" not in kinds and message.content[0].text == "hello"
    finally:
        await sdk.close()
    pinged = [e for e in recorder.ended[-1].timeline if e["action"] == "keep-alive"]
    assert pinged and pinged[0]["pings"] >= 3, recorder.ended[-1].timeline
