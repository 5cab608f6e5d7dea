"""The official anthropic SDK as client, through the relay (a real server) to the emulator."""

from __future__ import annotations

import anthropic
import pytest
from support import backend

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "Run the tool."}]
TOOLS = [{"name": "Bash", "description": "Run a command",
          "input_schema": {"type": "object", "properties": {"command": {"type": "string"}},
                           "required": ["command"]}}]


def sdk(url: str, **kw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="sk-test-client", **kw)


@pytest.fixture
def through_relay(emulator, relay):
    def start(*emulator_args, pipeline=("dedup", "pairing", "ordering")):
        emu = emulator(*emulator_args)
        r = relay({"pipeline": list(pipeline), "backends": [backend(emu.url)]})
        return emu, r
    return start


def test_non_streaming_and_streaming_messages(through_relay):
    emu, r = through_relay("--tool-turns", "1")
    client = sdk(r.url)
    message = client.messages.create(model="claude-test", max_tokens=100, messages=MESSAGES,
                                     tools=TOOLS)
    assert message.stop_reason == "tool_use"
    (call,) = [b for b in message.content if b.type == "tool_use"]
    assert call.name == "Bash" and call.input["command"].startswith("echo")

    with client.messages.stream(model="claude-test", max_tokens=100, messages=MESSAGES,
                                tools=TOOLS) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in message.content]
    assert "".join(texts) == "".join(b.text for b in final.content if b.type == "text")
    received = emu.requests()
    assert len(received) == 2
    assert received[1]["body"]["stream"] is True
    headers = {k.lower(): v for k, v in received[0]["headers"]}
    sent_key = headers.get("x-api-key") or headers["authorization"].removeprefix("Bearer ")
    assert sent_key == "sk-test-client"
    assert headers["anthropic-version"]
    assert headers["user-agent"].startswith("Anthropic/Python")


def test_count_tokens_and_models(through_relay):
    emu, r = through_relay()
    client = sdk(r.url)
    counted = client.messages.count_tokens(model="claude-test", messages=MESSAGES)
    assert counted.input_tokens > 0
    models = client.models.list()
    assert models.data and models.data[0].type == "model"
    assert [rec["path"] for rec in emu.requests()] == ["/v1/messages/count_tokens", "/v1/models"]


def test_broken_history_count_tokens_is_rejected_by_the_relay(through_relay):
    emu, r = through_relay()
    broken = [{"role": "user", "content": "go"},
              {"role": "assistant", "content": [
                  {"type": "tool_use", "id": "toolu_demo_a", "name": "Bash", "input": {}}]},
              {"role": "user", "content": [
                  {"type": "tool_result", "tool_use_id": "toolu_wrong_id", "content": "ok"}]}]
    with pytest.raises(anthropic.BadRequestError) as e:
        sdk(r.url).messages.count_tokens(model="claude-test", messages=broken)
    assert "unexpected `tool_use_id` found in `tool_result` blocks: toolu_wrong_id" in e.value.message
    assert emu.requests() == []


def test_upstream_4xx_is_the_sdks_typed_error_with_the_upstreams_wording(through_relay):
    emu, r = through_relay(pipeline=())
    broken = [{"role": "user", "content": "go"},
              {"role": "assistant", "content": [
                  {"type": "tool_use", "id": "toolu_demo_a", "name": "Bash", "input": {}}]},
              {"role": "user", "content": "and?"}]
    with pytest.raises(anthropic.BadRequestError) as e:
        sdk(r.url).messages.create(model="claude-test", max_tokens=10, messages=broken)
    assert e.value.status_code == 400
    assert e.value.body["error"]["message"].startswith(
        "messages.2: `tool_use` ids were found without `tool_result` blocks immediately after")
    assert len(emu.requests()) == 1


def test_529_surfaces_as_overloaded_and_the_sdk_retry_goes_through(through_relay):
    emu, r = through_relay("--fail-status", "529", "--fail-count", "3")
    with pytest.raises(anthropic.InternalServerError) as e:
        sdk(r.url, max_retries=0).messages.create(model="claude-test", max_tokens=10,
                                                   messages=MESSAGES)
    assert e.value.status_code == 529
    assert e.value.body["error"]["type"] == "overloaded_error"
    # Two failures left: the SDK's own retries (it obeys retry-after) get through them.
    message = sdk(r.url, max_retries=3).messages.create(model="claude-test", max_tokens=10,
                                                        messages=MESSAGES)
    assert message.stop_reason == "end_turn"
    assert len(emu.requests()) == 4


async def test_async_client_streaming_events(through_relay):
    emu, r = through_relay("--tool-turns", "1", "--thinking")
    client = anthropic.AsyncAnthropic(base_url=r.url, api_key="sk-test")
    async with client.messages.stream(model="claude-test", max_tokens=100, messages=MESSAGES,
                                      tools=TOOLS) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert [b.type for b in final.content][0] == "thinking"
    assert final.content[0].signature
