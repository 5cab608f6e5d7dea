"""`relay emulate --format openai`: strict like the servers it stands for, and its answers parsed
by the official ``openai`` SDK, so that their shapes are not only ours."""

from __future__ import annotations

import json

import openai
import pytest

from relay.testing.emulator_openai import find_problem

BASH = {"type": "function", "function": {
    "name": "Bash", "description": "Run a command",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                   "required": ["command"]}}}
ASK = [{"role": "user", "content": "Run the tool."}]


def calling(*ids, name="Bash"):
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": i, "type": "function", "function": {"name": name, "arguments": "{}"}}
        for i in ids]}


def answer(call_id, content="done"):
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def body(*messages, **extra):
    return {"model": "m", "messages": [*ASK, *messages], **extra}


# --- what it refuses --------------------------------------------------------------------------

def test_calls_without_tool_messages_are_refused_in_openais_words():
    assert find_problem(body(calling("call_1", "call_2"), answer("call_1"))) == (
        "An assistant message with 'tool_calls' must be followed by tool messages responding "
        "to each 'tool_call_id'. The following tool_call_ids did not have response messages: "
        "call_2")
    # a user message in between counts as no answer at all
    assert find_problem(body(calling("call_1"), {"role": "user", "content": "x"},
                             answer("call_1"))).endswith("response messages: call_1")


def test_duplicate_ids_and_stray_tool_messages_are_refused():
    assert find_problem(body(calling("call_0"), answer("call_0"), calling("call_0"),
                             answer("call_0"))) == (
        "Invalid parameter: duplicate tool_call id 'call_0' ('messages[3].tool_calls[0].id').")
    assert find_problem(body(calling("a", "a"), answer("a"))).startswith(
        "Invalid parameter: duplicate tool_call id 'a'")
    assert find_problem(body(answer("call_9"))) == (
        "Invalid parameter: messages with role 'tool' must be a response to a preceeding "
        "message with 'tool_calls'.")
    assert find_problem(body(calling("a"), answer("b"))) == (
        "Invalid parameter: 'tool_call_id' of 'b' not found in 'tool_calls' of previous message.")


@pytest.mark.parametrize("request_body, expected", [
    (body(top_k=5), "Unrecognized request argument supplied: top_k"),
    (body(stream_options={"include_usage": True}),
     "The 'stream_options' parameter is only allowed when 'stream' is enabled."),
    (body(tool_choice="auto"), "Invalid value for 'tool_choice': 'tool_choice' is only "
                               "allowed when 'tools' are specified."),
    (body({"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "Bash", "arguments": {}}}]}),
     "Invalid type for 'messages[1].tool_calls[0].function.arguments': expected a string, but "
     "got an object instead."),
    (body({"role": "user", "content": [{"type": "tool_result"}]}),
     "Invalid value: 'tool_result'. Supported values are: 'text', 'image_url'. - "
     "'messages[1].content[0].type'"),
    (body({"role": "tool_result", "content": "x"}),
     "Invalid value for 'messages[1].role': expected one of system, developer, user, "
     "assistant, tool."),
    (body({"role": "user", "content": "x", "cache_control": {}}),
     "Additional properties are not allowed ('cache_control' was unexpected) - 'messages[1]'"),
    ({"model": "m", "messages": []}, "Invalid 'messages': expected a non-empty array."),
])
def test_shapes_the_format_does_not_have_are_refused(request_body, expected):
    assert find_problem(request_body) == expected


def test_a_sound_history_passes():
    assert find_problem(body(calling("call_0", "call_1"), answer("call_1"), answer("call_0"),
                             {"role": "assistant", "content": "ok"}, tools=[BASH],
                             tool_choice="auto", stream=True,
                             stream_options={"include_usage": True})) is None


# --- its answers, through the openai SDK ------------------------------------------------------

@pytest.fixture
def openai_emulator(emulator):
    def start(*args):
        emu = emulator("--format", "openai", *args)
        sdk = openai.OpenAI(base_url=emu.url + "/v1", api_key="sk-test", max_retries=0,
                            timeout=10)
        return emu, sdk
    return start


def history_after(completion) -> list:
    """The next request's messages: the answer, and a tool message for each call."""
    message = completion.choices[0].message
    calls = message.tool_calls or []
    return [*ASK, message.model_dump(exclude_none=True, exclude={"reasoning_content"}),
            *(answer(c.id) for c in calls)]


@pytest.mark.parametrize("args, ids", [
    ((), None), (("--reuse-ids", "--parallel", "2"), ["call_0", "call_1"]),
    (("--id-style", "functions", "--reuse-ids", "--parallel", "3"),
     ["functions.Bash:0", "functions.Bash:1", "functions.Bash:2"])])
def test_completions_parse_with_the_sdk(openai_emulator, args, ids):
    _, sdk = openai_emulator("--tool-turns", "1", "--thinking", *args)
    first = sdk.chat.completions.create(model="m", messages=ASK, tools=[BASH])
    assert first.object == "chat.completion" and first.choices[0].finish_reason == "tool_calls"
    message = first.choices[0].message
    assert message.content == "Turn 0: calling Bash."
    assert message.model_extra["reasoning_content"].startswith("Turn 0")
    calls = message.tool_calls
    assert [json.loads(c.function.arguments)["command"] for c in calls] == [
        f"echo relay-turn-0-{i}" for i in range(len(calls))]
    if ids:
        assert [c.id for c in calls] == ids
    assert first.usage.prompt_tokens > 0 and first.usage.prompt_tokens_details.cached_tokens == 0

    last = sdk.chat.completions.create(model="m", messages=history_after(first), tools=[BASH])
    assert last.choices[0].finish_reason == "stop"
    assert last.choices[0].message.content == "All 1 tool turns done."


@pytest.mark.parametrize("args", [
    (), ("--late-ids", "--interleave"), ("--ragged", "--crlf", "--interleave"),
    ("--reasoning-field", "reasoning", "--ragged")])
def test_streams_parse_with_the_sdk(openai_emulator, args):
    _, sdk = openai_emulator("--tool-turns", "1", "--parallel", "2", "--thinking", *args)
    with sdk.chat.completions.stream(model="m", messages=ASK, tools=[BASH],
                                     stream_options={"include_usage": True}) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.delta" in events and events[-1] == "chunk"
    message = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls"
    assert [json.loads(c.function.arguments) for c in message.tool_calls] == [
        {"command": f"echo relay-turn-0-{i}", "description": "Print a marker"} for i in (0, 1)]
    assert all(c.id.startswith("call_") and c.function.name == "Bash" for c in message.tool_calls)
    assert message.content == "Turn 0: calling Bash."
    assert final.usage.completion_tokens > 0  # the usage chunk was there
    field = "reasoning" if "reasoning" in args else "reasoning_content"
    assert message.model_extra[field].startswith("Turn 0")


def test_raw_stream_chunks(openai_emulator):
    _, sdk = openai_emulator("--tool-turns", "1", "--late-ids")
    chunks = list(sdk.chat.completions.create(model="m", messages=ASK, tools=[BASH],
                                              stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    fragments = [c.choices[0].delta.tool_calls[0] for c in chunks
                 if c.choices and c.choices[0].delta.tool_calls]
    assert fragments[0].id is None and fragments[1].id  # the id comes in the second fragment
    assert len(fragments) >= 3  # the arguments come in pieces
    assert chunks[-1].choices[0].finish_reason == "tool_calls"  # no usage chunk unasked


def test_arguments_that_are_not_json(openai_emulator):
    _, sdk = openai_emulator("--tool-turns", "1", "--bad-arguments")
    message = sdk.chat.completions.create(model="m", messages=ASK,
                                          tools=[BASH]).choices[0].message
    with pytest.raises(json.JSONDecodeError):
        json.loads(message.tool_calls[0].function.arguments)


@pytest.mark.parametrize("status, error", [
    (400, openai.BadRequestError), (401, openai.AuthenticationError),
    (429, openai.RateLimitError), (500, openai.InternalServerError),
    (503, openai.InternalServerError)])
def test_errors_parse_with_the_sdk(openai_emulator, status, error):
    _, sdk = openai_emulator("--fail-status", str(status))
    with pytest.raises(error) as failed:
        sdk.chat.completions.create(model="m", messages=ASK)
    assert failed.value.status_code == status
    assert failed.value.body["message"] and failed.value.body["type"]


def test_a_refused_history_parses_with_the_sdk(openai_emulator):
    _, sdk = openai_emulator()
    with pytest.raises(openai.BadRequestError) as failed:
        sdk.chat.completions.create(model="m", messages=[*ASK, calling("call_1")], tools=[BASH])
    assert "did not have response messages: call_1" in failed.value.body["message"]


def test_a_wrong_key_is_refused(openai_emulator):
    emu, _ = openai_emulator("--api-key", "sk-right")
    sdk = openai.OpenAI(base_url=emu.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as failed:
        sdk.chat.completions.create(model="m", messages=ASK)
    assert failed.value.body["code"] == "invalid_api_key"


def test_an_error_in_the_stream_and_a_cut(openai_emulator):
    _, sdk = openai_emulator("--stream-error-after", "2")
    with pytest.raises(openai.APIError) as failed:
        list(sdk.chat.completions.create(model="m", messages=ASK, stream=True))
    assert "overloaded" in str(failed.value.message)

    _, sdk = openai_emulator("--cut-after", "2")
    with pytest.raises(openai.APIConnectionError):
        list(sdk.chat.completions.create(model="m", messages=ASK, stream=True))


def test_models_parse_with_the_sdk(openai_emulator):
    _, sdk = openai_emulator()
    models = sdk.models.list()
    assert [m.id for m in models] and all(m.object == "model" for m in models)
    assert sdk.models.retrieve(models.data[0].id).id == models.data[0].id
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("nope")


def test_usage_counts_cached_tokens_inside_prompt_tokens():
    from relay.testing.emulator_openai import usage
    reply = {"message": {"role": "assistant", "content": "hi"}}
    assert usage(40, reply, {"input": 10, "cache_read": 90, "output": 3}) == {
        "prompt_tokens": 100, "completion_tokens": 3, "total_tokens": 103,
        "prompt_tokens_details": {"cached_tokens": 90}}
    assert usage(40, reply)["prompt_tokens"] == 40
