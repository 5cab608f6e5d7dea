"""The relay in front of scripted OpenAI-format upstreams: where requests go, what the client
gets back for answers, streams, errors, model lists and token counts, what the record keeps,
and that the first byte is not held back."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import anthropic
import orjson
import pytest
import yaml
from aiohttp import web
from test_server import Upstream, start_relay, start_upstream
from test_upstream import Recorder

from relay import config as config_module
from relay.errors import ConfigError
from relay.sse import SSEDecoder

BODY = {"model": "claude-test", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "qwen3",
              "choices": [{"index": 0, "finish_reason": "stop",
                           "message": {"role": "assistant", "content": "hello"}}],
              "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}


def data(*chunks, done=True) -> bytes:
    out = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks)
    return out + (b"data: [DONE]\n\n" if done else b"")


def chunk(delta: dict, finish=None) -> dict:
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "qwen3",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def stream_reply(payload: bytes):
    async def reply(request):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(payload)
        return response
    return reply


@pytest.fixture
async def oa(aiohttp_server, aiohttp_client):
    async def make(reply=None, pipeline=(), plugins=None, extra=None, **backend_extra):
        upstream = Upstream()
        if reply is not None:
            upstream.reply = reply
        else:
            async def completion(request):
                return web.json_response(COMPLETION)
            upstream.reply = completion
        server = await start_upstream(aiohttp_server, upstream)
        raw = {"pipeline": list(pipeline), "plugins": plugins or {},
               "backends": [{"name": "oa", "url": str(server.make_url("/v1")),
                             "models": ["*"], "format": "openai", **backend_extra}]}
        return await start_relay(aiohttp_client, raw, extra=extra), upstream
    return make


def events_of(raw: bytes) -> list[dict]:
    decoder = SSEDecoder()
    return [e.data for e in decoder.feed(raw) + decoder.close()]


async def test_a_request_goes_to_chat_completions_translated(oa):
    client, upstream = await oa()
    response = await client.post("/v1/messages?beta=true", json=BODY, headers={
        "x-api-key": "sk-client", "anthropic-version": "2023-06-01", "anthropic-beta": "x"})
    assert response.status == 200
    answer = await response.json()
    assert answer["type"] == "message" and answer["content"] == [{"type": "text",
                                                                  "text": "hello"}]
    assert answer["stop_reason"] == "end_turn" and answer["usage"]["input_tokens"] == 5
    (sent,) = upstream.received
    assert (sent["path"], sent["query"]) == ("/v1/chat/completions", "")
    assert orjson.loads(sent["raw"]) == {"model": "claude-test", "max_tokens": 10,
                                         "messages": [{"role": "user", "content": "hi"}],
                                         "stream": False}
    assert sent["headers"]["Authorization"] == "Bearer sk-client"
    assert "x-api-key" not in sent["headers"] and "anthropic-version" not in sent["headers"]


async def test_the_backends_own_key_goes_as_a_bearer_token(aiohttp_server, aiohttp_client):
    upstream = Upstream()

    async def completion(request):
        return web.json_response(COMPLETION)
    upstream.reply = completion
    server = await start_upstream(aiohttp_server, upstream)
    client = await start_relay(aiohttp_client, {"backends": [
        {"name": "oa", "url": str(server.make_url("/v1")), "format": "openai",
         "models": ["*"], "api_key_env": "OA_KEY"}]}, env={"OA_KEY": "sk-operator"})
    await client.post("/v1/messages", json=BODY, headers={"x-api-key": "sk-client"})
    assert upstream.received[0]["headers"]["Authorization"] == "Bearer sk-operator"


async def test_what_cannot_be_translated_is_refused_before_the_upstream(oa):
    client, upstream = await oa()
    body = {**BODY, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}
    response = await client.post("/v1/messages", json=body)
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("tools.0: `tool type web_search_20250305` cannot be sent "
                                       "to backend oa")
    assert upstream.received == []


@pytest.mark.parametrize("status, kind", [(400, "invalid_request_error"),
                                          (401, "authentication_error"),
                                          (429, "rate_limit_error"), (503, "overloaded_error")])
async def test_upstream_errors_come_back_in_anthropics_format(oa, status, kind):
    async def failing(request):
        return web.json_response({"error": {"message": f"upstream says {status}",
                                            "type": "x", "param": None, "code": None}},
                                 status=status, headers={"retry-after": "7"})
    client, _ = await oa(failing)
    response = await client.post("/v1/messages", json=BODY)
    assert response.status == status
    assert response.headers["retry-after"] == "7"
    body = await response.json()
    assert body["type"] == "error"
    assert body["error"] == {"type": kind, "message": f"upstream says {status}"}
    assert body["request_id"] == response.headers["x-relay-request-id"]


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/models"])
async def test_a_redirect_is_a_502_never_relayed(oa, path):
    # FastAPI's servers (vLLM's among them) redirect a path with a trailing slash, 307; a
    # redirect relayed to an SDK is followed, x-api-key (kept across origins) and all.
    async def redirect(request):
        return web.Response(status=307, headers={
            "Location": "https://elsewhere.invalid/v1/chat/completions/"})
    client, upstream = await oa(redirect)
    response = await client.request("POST" if path == "/v1/messages" else "GET", path,
                                    json=BODY, allow_redirects=False)
    assert response.status == 502 and "Location" not in response.headers
    assert (await response.json())["error"] == {"type": "api_error", "message": (
        "upstream oa answered HTTP 307, a redirect, which the relay does not follow: "
        "check the backend's url (the relay's log names where it pointed)")}
    assert response.headers["request-id"] == response.headers["x-relay-request-id"]
    assert len(upstream.received) == 1


async def test_tool_arguments_that_are_not_json_are_a_502_naming_the_call(oa):
    async def bad(request):
        return web.json_response({**COMPLETION, "choices": [{"index": 0, "finish_reason":
            "tool_calls", "message": {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "Bash", "arguments": '{"command": '}}]}}]})
    client, _ = await oa(bad)
    response = await client.post("/v1/messages", json=BODY)
    assert response.status == 502
    error = (await response.json())["error"]
    assert error["type"] == "api_error" and "call_1" in error["message"]
    assert "'{\"command\": '" in error["message"]


async def test_a_stream_is_translated(oa):
    client, _ = await oa(stream_reply(data(
        chunk({"role": "assistant", "content": ""}), chunk({"content": "hel"}),
        chunk({"content": "lo"}), chunk({}, "stop"),
        {**chunk({}), "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}})))
    response = await client.post("/v1/messages", json={**BODY, "stream": True})
    assert response.status == 200 and response.content_type == "text/event-stream"
    events = events_of(await response.read())
    assert [e["type"] for e in events] == [
        "message_start", "ping", "content_block_start", "content_block_delta",
        "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert events[-2]["usage"]["output_tokens"] == 2


@pytest.mark.parametrize("payload, message", [
    (data(chunk({"content": "x"}), done=False), "broke off"),  # cut: the relay's own error
    (data(chunk({"content": "x"}), {"error": {"message": "upstream fell over", "code": 500}},
          done=False), "upstream fell over"),
    (data(chunk({"tool_calls": [{"index": 0, "id": "c", "type": "function", "function": {
        "name": "Bash", "arguments": "{nope"}}]}), chunk({}, "tool_calls")), "c"),
    # OpenRouter's provider died mid-answer (gethouston/houston#1211)
    (data(chunk({"content": "x"}), chunk({}, "error")), "finish_reason 'error'"),
])
async def test_a_stream_that_fails_ends_with_an_error_event(oa, payload, message):
    client, _ = await oa(stream_reply(payload))
    response = await client.post("/v1/messages", json={**BODY, "stream": True})
    events = events_of(await response.read())
    assert events[0]["type"] == "message_start"
    assert events[-1]["type"] == "error" and message in events[-1]["error"]["message"]
    assert not any(e["type"] == "message_stop" for e in events)


async def test_an_error_in_a_200_answer_is_answered_as_that_error(oa):
    # OpenRouter: an error "occurred while the LLM is producing the output will be emitted
    # in the response body" of a 200, error.code the status it stands for.
    async def limited(request):
        return web.json_response({"error": {"message": "Rate limit exceeded: free-models-per-"
                                                       "day", "code": 429}})
    recorder = Recorder()
    client, _ = await oa(limited, pipeline=["recorder"], extra={"recorder": recorder})
    response = await client.post("/v1/messages", json=BODY)
    assert response.status == 429
    assert (await response.json())["error"] == {
        "type": "rate_limit_error", "message": "Rate limit exceeded: free-models-per-day"}
    for _ in range(100):  # the end hooks run once the answer is out
        if recorder.ended:
            break
        await asyncio.sleep(0.01)
    assert recorder.ended[0].outcome == "upstream_error"


async def test_a_server_that_always_streams_answers_a_client_that_asked_for_no_stream(oa):
    # sgl-project/mini-sglang#51, kaito-project/kaito#1880: SSE whatever "stream" says.
    client, upstream = await oa(stream_reply(data(
        chunk({"role": "assistant", "content": ""}), chunk({"content": "hel"}),
        chunk({"content": "lo"}), chunk({}, "stop"),
        {**chunk({}), "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}})))
    sdk = anthropic.AsyncAnthropic(base_url=str(client.make_url("")).rstrip("/"),
                                   api_key="k" * 20, max_retries=0)
    message = await sdk.messages.create(**BODY)
    assert isinstance(message, anthropic.types.Message)
    response = await client.post("/v1/messages", json=BODY)
    assert response.status == 200 and response.content_type == "application/json"
    answer = await response.json()
    assert answer["content"] == [{"type": "text", "text": "hello"}] == [
        block.model_dump(exclude_none=True) for block in message.content]
    assert answer["stop_reason"] == "end_turn" and answer["usage"]["input_tokens"] == 5
    streamed = await client.post("/v1/messages", json={**BODY, "stream": True})
    assert streamed.content_type == "text/event-stream"
    assert events_of(await streamed.read())[-1]["type"] == "message_stop"


async def test_a_server_that_answers_whole_a_client_that_asked_for_a_stream_streams(oa):
    # sgl-project/sglang#2810: with tools, a stream request got one chat completion.
    client, upstream = await oa()
    sdk = anthropic.AsyncAnthropic(base_url=str(client.make_url("")).rstrip("/"),
                                   api_key="k" * 20, max_retries=0)
    async with sdk.messages.stream(**BODY) as stream:
        texts = [text async for text in stream.text_stream]
        message = await stream.get_final_message()
    assert texts == ["hello"] and message.stop_reason == "end_turn"
    assert message.usage.input_tokens == 5 and message.usage.output_tokens == 1
    assert orjson.loads(upstream.received[0]["raw"])["stream"] is True
    response = await client.post("/v1/messages", json={**BODY, "stream": True})
    assert response.content_type == "text/event-stream"


async def test_an_error_answered_whole_to_a_request_for_a_stream_keeps_its_status(oa):
    async def limited(request):
        return web.json_response({"error": {"message": "slow down", "code": 429}})
    client, _ = await oa(limited)
    response = await client.post("/v1/messages", json={**BODY, "stream": True})
    assert response.status == 429 and response.content_type == "application/json"
    assert (await response.json())["error"] == {"type": "rate_limit_error",
                                                "message": "slow down"}


async def test_the_first_event_is_not_held_back(oa):
    go_on = asyncio.Event()

    async def slow(request):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(data(chunk({"role": "assistant", "content": ""}), done=False))
        await go_on.wait()  # the rest comes only once the client has seen the first event
        await response.write(data(chunk({"content": "x"}), chunk({}, "stop")))
        return response
    client, _ = await oa(slow)
    response = await client.post("/v1/messages", json={**BODY, "stream": True})
    first = await asyncio.wait_for(response.content.readuntil(b"\n\n"), 10)
    assert first.startswith(b"event: message_start\n")
    go_on.set()
    assert events_of(await response.read())[-1]["type"] == "message_stop"


async def test_count_tokens_is_an_estimate_that_says_so(oa):
    client, upstream = await oa()
    raw = orjson.dumps(BODY)
    response = await client.post("/v1/messages/count_tokens", data=raw,
                                 headers={"Content-Type": "application/json"})
    assert response.status == 200
    assert response.headers["x-relay-token-count"] == "estimate"
    assert await response.json() == {"input_tokens": -(-len(raw) // 4)}  # 4 bytes a token
    assert upstream.received == []


async def test_the_model_list_in_anthropics_shape(oa):
    async def models(request):
        if request.path.endswith("/models"):
            return web.json_response({"object": "list", "data": [
                {"id": "qwen3", "object": "model", "created": 0, "owned_by": "x"}]})
        return web.json_response({"error": {"message": "no such model"}}, status=404)
    client, upstream = await oa(models)
    listed = await (await client.get("/v1/models")).json()
    assert listed == {"data": [{"type": "model", "id": "qwen3", "display_name": "qwen3",
                                "created_at": "1970-01-01T00:00:00Z"}],
                      "has_more": False, "first_id": "qwen3", "last_id": "qwen3"}
    assert upstream.received[0]["path"] == "/v1/models"
    missing = await client.get("/v1/models/nope")
    assert missing.status == 404
    assert (await missing.json())["error"] == {"type": "not_found_error",
                                               "message": "no such model"}


async def test_the_record_keeps_both_requests_and_the_upstreams_own_answer(oa, tmp_path):
    async def refusing(request):
        return web.json_response({"error": {"message": "bad history"}}, status=400)
    dumps = tmp_path / "dumps"
    client, _ = await oa(refusing, pipeline=["dump"], plugins={"dump": {"dir": str(dumps)}})
    response = await client.post("/v1/messages", json=BODY)
    assert response.status == 400
    for _ in range(100):  # the dump is written in the background
        files = list(dumps.rglob("*.json"))
        if files:
            break
        await asyncio.sleep(0.05)
    dump = json.loads(files[0].read_text())
    assert json.loads(dump["client_request"]["body"])["messages"] == BODY["messages"]
    assert dump["upstream_request"]["url"].endswith("/v1/chat/completions")
    assert json.loads(dump["upstream_request"]["body"])["messages"] == [
        {"role": "user", "content": "hi"}]
    assert json.loads(dump["upstream_response"]["body"]) == {"error": {"message": "bad history"}}


@pytest.mark.parametrize("backend, message", [
    ({"format": "grpc"}, "backends[0].format: must be one of anthropic, openai, not 'grpc'"),
    ({"format": "openai", "quirks": {"reasoning_control": "magic"}},
     "backends[0].quirks.reasoning_control: must be one of none, reasoning_effort, openrouter, "
     "chat_template_kwargs, deepseek, not 'magic'"),
    ({"format": "openai", "quirks": {"stream_usage": "yes"}},
     "backends[0].quirks.stream_usage: must be one of true, false, not 'yes'"),
])
def test_config_checks_the_format_and_its_quirks(backend, message):
    with pytest.raises(ConfigError) as failed:
        config_module.parse({"backends": [{"name": "b", "url": "http://x.invalid", **backend}]})
    assert str(failed.value) == message


def test_an_openai_backend_defaults_to_bearer_auth():
    config = config_module.parse({"backends": [
        {"name": "a", "url": "http://x.invalid/v1", "format": "openai"},
        {"name": "b", "url": "http://x.invalid"}]})
    assert [(b.format, b.auth) for b in config.backends] == [("openai", "bearer"),
                                                             ("anthropic", "x-api-key")]


def test_the_readmes_openai_examples_are_valid():
    readme = (Path(__file__).resolve().parent.parent / "docs" / "openai-backends.md").read_text()
    example = readme.split("```yaml", 1)[1].split(
        "```", 1)[0]
    config = config_module.parse(yaml.safe_load(example), env={
        "OPENROUTER_API_KEY": "sk-or-test", "DEEPSEEK_API_KEY": "sk-ds-test"})
    assert {b.format for b in config.backends} == {"openai"}
    assert config.backend("deepseek").quirks == {"reasoning_control": "deepseek",
                                                 "reasoning_history": "reasoning_content"}
