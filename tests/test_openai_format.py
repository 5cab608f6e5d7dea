"""relay/formats/openai.py: the translation between Anthropic's Messages API and OpenAI's Chat
Completions, as plain data: requests down, answers, streams, errors and model lists back."""

from __future__ import annotations

import msgspec
import orjson
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.config import Backend
from relay.errors import RelayError
from relay.formats import openai
from relay.sse import SSEDecoder


def backend(**quirks) -> Backend:
    return Backend(name="oa", url="http://127.0.0.1:9/v1", models=["*"], format="openai",
                   quirks=quirks)


def chat(body: dict, **quirks) -> dict:
    """The translation of ``body``, checked to be the same whether the request comes parsed or
    as bytes (where the history's bulk stays the client's JSON text)."""
    body = {"model": "m", "max_tokens": 10, **body}
    out = openai.chat_request(body, backend(**quirks))
    assert msgspec.json.decode(openai.request_bytes(msgspec.json.encode(body),
                                                    backend(**quirks))) == out
    return out


def refusal(body: dict) -> str:
    body = {"model": "m", "max_tokens": 10, **body}
    with pytest.raises(RelayError) as refused:
        openai.chat_request(body, backend())
    with pytest.raises(RelayError) as as_bytes:
        openai.request_bytes(msgspec.json.encode(body), backend())
    assert as_bytes.value.message == refused.value.message
    assert refused.value.status == 400 and refused.value.type == "invalid_request_error"
    return refused.value.message


def user(*blocks):
    return {"role": "user", "content": list(blocks)}


def assistant(*blocks):
    return {"role": "assistant", "content": list(blocks)}


def text(value="hi", **extra):
    return {"type": "text", "text": value, **extra}


def use(id, name="Bash", input=None):
    return {"type": "tool_use", "id": id, "name": name, "input": input or {"command": "ls"}}


def result(id, content="done", **extra):
    return {"type": "tool_result", "tool_use_id": id, "content": content, **extra}


PNG = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}


# --- requests ---------------------------------------------------------------------------------

def test_a_whole_request_translates():
    body = {
        "model": "deepseek-chat", "max_tokens": 512, "temperature": 0.3, "top_p": 0.9,
        "stop_sequences": ["END"], "metadata": {"user_id": "u-1"}, "stream": True,
        "system": [text("You are terse.", cache_control={"type": "ephemeral"}), text("Be kind.")],
        "tools": [{"name": "Bash", "description": "run", "input_schema": {"type": "object"},
                   "cache_control": {"type": "ephemeral"}}],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
        "messages": [
            user(text("look"), {"type": "image", "source": PNG},
                 {"type": "image", "source": {"type": "url", "url": "https://x.invalid/a.png"}}),
            assistant({"type": "thinking", "thinking": "hm", "signature": "sig"},
                      text("Running."), use("call_0"), use("call_1", input={"command": "pwd"})),
            user(result("call_0", [text("a"), text("b")]), result("call_1", "oops", is_error=True),
                 text("and now?")),
        ]}
    assert chat(body) == {
        "model": "deepseek-chat",
        "messages": [
            {"role": "system", "content": "You are terse.\n\nBe kind."},
            {"role": "user", "content": [
                {"type": "text", "text": "look"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
                {"type": "image_url", "image_url": {"url": "https://x.invalid/a.png"}}]},
            {"role": "assistant", "content": "Running.", "tool_calls": [
                {"id": "call_0", "type": "function",
                 "function": {"name": "Bash", "arguments": '{"command":"ls"}'}},
                {"id": "call_1", "type": "function",
                 "function": {"name": "Bash", "arguments": '{"command":"pwd"}'}}]},
            {"role": "tool", "tool_call_id": "call_0", "content": "a\nb"},
            {"role": "tool", "tool_call_id": "call_1", "content": "Error: oops"},
            {"role": "user", "content": "and now?"},
        ],
        "max_tokens": 512, "temperature": 0.3, "top_p": 0.9, "stop": ["END"], "user": "u-1",
        "tools": [{"type": "function", "function": {
            "name": "Bash", "parameters": {"type": "object"}, "description": "run"}}],
        "tool_choice": "auto", "parallel_tool_calls": False,
        "stream": True, "stream_options": {"include_usage": True},
    }


def test_images_inside_a_tool_result_follow_in_a_user_message():
    out = chat({"messages": [assistant(use("c1")),
                             user(result("c1", [text("shot:"), {"type": "image", "source": PNG}]),
                                  text("see?"))]})
    assert out["messages"][1:] == [
        {"role": "tool", "tool_call_id": "c1", "content": "shot:"},
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
            {"type": "text", "text": "see?"}]}]


@pytest.mark.parametrize("choice, expected", [
    ({"type": "auto"}, "auto"), ({"type": "any"}, "required"), ({"type": "none"}, "none"),
    ({"type": "tool", "name": "Bash"}, {"type": "function", "function": {"name": "Bash"}}),
])
def test_tool_choice(choice, expected):
    tools = [{"name": "Bash", "input_schema": {"type": "object"}}]
    out = chat({"messages": [user(text())], "tools": tools, "tool_choice": choice})
    assert out["tool_choice"] == expected and "parallel_tool_calls" not in out


def test_a_request_that_does_not_stream_says_so():
    # OpenAI's default is false, yet some servers stream when the field is absent
    # (unslothai/unsloth#5047, diegosouzapw/OmniRoute#10239).
    assert chat({"messages": [user(text())]})["stream"] is False
    assert "stream_options" not in chat({"messages": [user(text())], "stream": False})


def test_backend_quirks_for_max_tokens_usage_and_reasoning():
    body = {"messages": [user(text())], "stream": True,
            "thinking": {"type": "enabled", "budget_tokens": 20000}}
    assert "max_tokens" in chat(body) and "reasoning_effort" not in chat(body)
    out = chat(body, max_tokens_field="max_completion_tokens", stream_usage=False,
               reasoning_control="reasoning_effort")
    assert out["max_completion_tokens"] == 10 and "max_tokens" not in out
    assert "stream_options" not in out and out["reasoning_effort"] == "high"
    assert chat(body, reasoning_control="openrouter")["reasoning"] == {"max_tokens": 20000}
    assert chat(body, reasoning_control="chat_template_kwargs")["chat_template_kwargs"] == {
        "enable_thinking": True}
    off = dict(body, thinking={"type": "disabled"})
    assert chat(off, reasoning_control="deepseek")["thinking"] == {"type": "disabled"}
    assert "reasoning_effort" not in chat(off, reasoning_control="reasoning_effort")


def test_harmless_leftovers_are_dropped():
    out = chat({"messages": [
        user(text("q", cache_control={"type": "ephemeral"})),
        assistant({"type": "thinking", "thinking": "t", "signature": "s"},
                  {"type": "redacted_thinking", "data": "x"},
                  text("a", citations=[{"type": "char_location"}])),
        assistant({"type": "redacted_thinking", "data": "x"}),  # nothing left: no message
        user(text("more"))],
        "top_k": 5, "context_management": {"edits": []}, "output_config": {"effort": "high"}})
    assert out["messages"] == [{"role": "user", "content": "q"},
                               {"role": "assistant", "content": "a"},
                               {"role": "user", "content": "more"}]
    assert set(out) == {"model", "messages", "max_tokens", "stream"}


def test_reasoning_can_be_sent_back_when_the_backend_wants_it():
    out = chat({"messages": [user(text()), assistant(
        {"type": "thinking", "thinking": "because", "signature": ""}, use("c1")),
        user(result("c1"))]}, reasoning_history="reasoning_content")
    assert out["messages"][1]["reasoning_content"] == "because"
    # a call turn without thinking still carries the field: DeepSeek refuses one without it
    out = chat({"messages": [user(text()), assistant(use("c1")), user(result("c1")),
                             assistant(text("done"))]}, reasoning_history="reasoning_content")
    assert out["messages"][1]["reasoning_content"] == ""
    assert "reasoning_content" not in out["messages"][3]


def test_mid_conversation_system_messages_and_plain_strings():
    out = chat({"system": "sys", "messages": [
        {"role": "user", "content": "hi"}, {"role": "system", "content": [text("note")]},
        {"role": "assistant", "content": "yo"}]})
    assert out["messages"] == [{"role": "system", "content": "sys"},
                               {"role": "user", "content": "hi"},
                               {"role": "system", "content": "note"},
                               {"role": "assistant", "content": "yo"}]


def test_a_tool_reference_names_the_tool_every_function_already_offers():
    tools = [{"name": "Cron", "input_schema": {"type": "object"}, "defer_loading": True}]
    out = chat({"tools": tools, "messages": [
        assistant(use("c1", "ToolSearch", {"query": "cron"})),
        user(result("c1", [{"type": "tool_reference", "tool_name": "Cron"}]))]})
    assert out["messages"][1] == {"role": "tool", "tool_call_id": "c1",
                                  "content": "Tool loaded: Cron"}
    assert out["tools"] == [{"type": "function", "function": {
        "name": "Cron", "parameters": {"type": "object"}}}]


def test_plain_text_documents_translate():
    doc = {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                          "data": "the doc"}}
    assert chat({"messages": [user(doc)]})["messages"] == [{"role": "user",
                                                             "content": "the doc"}]
    # Anthropic passes a document's title and context to the model (never cited): so here.
    titled = {**doc, "title": "README.md", "context": "the project's readme",
              "citations": {"enabled": True}}
    assert chat({"messages": [user(titled), user(result("c", [titled]))]})["messages"] == [
        {"role": "user", "content": "README.md\n\nthe project's readme\n\nthe doc"},
        {"role": "tool", "tool_call_id": "c",
         "content": "README.md\n\nthe project's readme\n\nthe doc"}]


@pytest.mark.parametrize("body, named", [
    ({"messages": [user(text())], "tools": [{"type": "web_search_20250305",
                                             "name": "web_search"}]},
     "tools.0: `tool type web_search_20250305`"),
    ({"messages": [user(text()), assistant(
        {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {}})]},
     "messages.1.content.0: `server_tool_use`"),
    ({"messages": [user({"type": "document", "source": {
        "type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}})]},
     "messages.0.content.0: `document (base64 source)`"),
    ({"messages": [user(result("x", [{"type": "search_result", "source": "s", "title": "t",
                                      "content": []}]))]},
     "messages.0.content.0.content.0: `search_result`"),
    ({"messages": [user({"type": "future_block"})]}, "messages.0.content.0: `future_block`"),
    ({"messages": [user(text())], "mcp_servers": [{"type": "url", "url": "https://x.invalid"}]},
     "mcp_servers: `mcp_servers`"),
])
def test_what_cannot_be_translated_without_loss_is_refused_by_name(body, named):
    message = refusal(body)
    assert message.startswith(named)
    assert "backend oa" in message and "OpenAI Chat Completions" in message


@pytest.mark.parametrize("raw", [
    b"{", b"[1]",
    # broken UTF-8 where the translation must read the text
    b'{"model":"m","messages":[{"role":"assistant","content":[{"type":"tool_use","id":"a",'
    b'"name":"B","input":{"x":"\xff"}}]}]}',
    b'{"model":"m","messages":[{"role":"user","content":[{"type":"tool_result",'
    b'"tool_use_id":"a","is_error":true,"content":"\xff"}]}]}',
    # results that are not blocks
    b'{"model":"m","messages":[{"role":"user","content":[{"type":"tool_result",'
    b'"tool_use_id":"a","content":[1]}]}]}',
])
def test_request_bytes_refuses_what_is_not_a_request_with_a_400(raw):
    with pytest.raises(RelayError) as refused:
        openai.request_bytes(raw, backend())
    assert refused.value.status == 400 and refused.value.type == "invalid_request_error"


# --- answers ----------------------------------------------------------------------------------

def completion(message: dict, finish_reason="stop", usage=None) -> dict:
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "ds",
            "choices": [{"index": 0, "message": {"role": "assistant", **message},
                         "finish_reason": finish_reason}],
            "usage": usage or {"prompt_tokens": 100, "completion_tokens": 7,
                               "prompt_tokens_details": {"cached_tokens": 40}}}


def test_an_answer_translates():
    message = openai.anthropic_message(completion({
        "reasoning_content": "think", "content": "Calling.",
        "tool_calls": [{"id": "functions.Bash:0", "type": "function",
                        "function": {"name": "Bash", "arguments": '{"command": "ls"}'}},
                       {"id": "call_2", "type": "function",
                        "function": {"name": "Read", "arguments": ""}}]}, "tool_calls"), "oa")
    assert message["id"].startswith("msg_") and message["type"] == "message"
    assert message["model"] == "ds" and message["stop_reason"] == "tool_use"
    assert message["content"] == [
        {"type": "thinking", "thinking": "think", "signature": ""},
        {"type": "text", "text": "Calling."},
        {"type": "tool_use", "id": "functions.Bash:0", "name": "Bash", "input": {"command": "ls"}},
        {"type": "tool_use", "id": "call_2", "name": "Read", "input": {}}]
    assert message["usage"] == {"input_tokens": 60, "output_tokens": 7,
                                "cache_creation_input_tokens": 0, "cache_read_input_tokens": 40,
                                "cache_creation": {"ephemeral_5m_input_tokens": 0,
                                                   "ephemeral_1h_input_tokens": 0}}


@pytest.mark.parametrize("finish, expected", [
    ("stop", "end_turn"), ("length", "max_tokens"), ("tool_calls", "tool_use"),
    ("content_filter", "refusal"), (None, "end_turn")])
def test_finish_reasons(finish, expected):
    if finish == "tool_calls":  # with a call, as it should come
        answer = completion({"content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "T", "arguments": "{}"}}]},
            finish)
    else:
        answer = completion({"content": "x"}, finish)
    assert openai.anthropic_message(answer, "oa")["stop_reason"] == expected


def test_tool_calls_said_without_a_call_is_the_end_of_the_turn():
    # vLLM answers tool_choice "required" with finish_reason "tool_calls" and no call when
    # none was parsed (vllm-project/vllm#53255); Anthropic's tool_use comes with its block.
    assert openai.anthropic_message(completion({"content": "Hello!", "tool_calls": []},
                                               "tool_calls"), "oa")["stop_reason"] == "end_turn"
    events, _ = translate(sse(chunk({"content": "Hello!"}), chunk({}, "tool_calls")))
    assert sdk_message(events)["stop_reason"] == "end_turn"


def test_deepseek_cache_hits_and_the_reasoning_field():
    message = openai.anthropic_message(completion(
        {"reasoning": "r", "content": "x"},
        usage={"prompt_tokens": 10, "completion_tokens": 1, "prompt_cache_hit_tokens": 4}), "oa")
    assert message["content"][0] == {"type": "thinking", "thinking": "r", "signature": ""}
    usage = message["usage"]
    assert usage["input_tokens"] == 6 and usage["cache_read_input_tokens"] == 4


@pytest.mark.parametrize("arguments", ['{"command": "ls"', "[1, 2]", "null", "ls -la"])
def test_tool_arguments_that_are_not_a_json_object_are_an_error_never_dropped(arguments):
    with pytest.raises(RelayError) as failed:
        openai.anthropic_message(completion({"content": None, "tool_calls": [
            {"id": "call_9", "type": "function",
             "function": {"name": "Bash", "arguments": arguments}}]}, "tool_calls"), "oa")
    assert failed.value.status == 502 and failed.value.type == "api_error"
    assert "call_9" in failed.value.message and repr(arguments) in failed.value.message


@pytest.mark.parametrize("status, kind", [
    (400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
    (404, "not_found_error"), (413, "request_too_large"), (422, "invalid_request_error"),
    (429, "rate_limit_error"), (500, "api_error"), (502, "api_error"),
    (503, "overloaded_error"), (504, "timeout_error"), (529, "overloaded_error")])
def test_error_types_follow_the_status(status, kind):
    body = orjson.loads(openai.error_bytes(status, b'{"error": {"message": "why", "type": "x"}}',
                                           "req_1"))
    assert body == {"type": "error", "error": {"type": kind, "message": "why"},
                    "request_id": "req_1"}


@pytest.mark.parametrize("payload, message", [
    (b'{"error": "model not found"}', "model not found"),  # Ollama
    (b'{"object": "error", "message": "too long", "code": 400}', "too long"),  # vLLM
    (b"Bad Gateway", "Bad Gateway"), (b"", "upstream answered HTTP 502"),
    # nginx in front of the server: the page's title, not its markup
    (b"<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n<center><h1>502 "
     b"Bad Gateway</h1></center>\r\n<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n",
     "upstream answered HTTP 502 with an HTML page: 502 Bad Gateway"),
    (b"<!DOCTYPE html><html><body><h1>Service\n  Unavailable</h1></body></html>",
     "upstream answered HTTP 502 with an HTML page: Service Unavailable")])
def test_error_messages_in_every_shape(payload, message):
    assert openai.error_message(payload, 502) == message


def test_the_model_list_in_anthropics_shape():
    listed = orjson.loads(openai.models_bytes(orjson.dumps({"object": "list", "data": [
        {"id": "qwen3", "object": "model", "created": 1735689600, "owned_by": "me"},
        {"id": "llama", "object": "model"}]})))
    assert listed == {"data": [
        {"type": "model", "id": "qwen3", "display_name": "qwen3",
         "created_at": "2025-01-01T00:00:00Z"},
        {"type": "model", "id": "llama", "display_name": "llama",
         "created_at": "1970-01-01T00:00:00Z"}],
        "has_more": False, "first_id": "qwen3", "last_id": "llama"}
    assert orjson.loads(openai.models_bytes(b'{"id": "qwen3", "object": "model"}'))["id"] == "qwen3"


def test_upstream_paths_and_headers():
    from multidict import CIMultiDict
    assert openai.upstream_path("/v1/messages") == "/chat/completions"
    assert openai.upstream_path("/v1/models/x") == "/models/x"
    headers = CIMultiDict({"x-api-key": "k", "anthropic-version": "2023-06-01",
                           "anthropic-beta": "b", "User-Agent": "cli"})
    openai.upstream_headers(headers)
    assert dict(headers) == {"User-Agent": "cli", "Authorization": "Bearer k"}


# --- streams ----------------------------------------------------------------------------------

def sse(*chunks, done=True) -> bytes:
    out = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks)
    return out + (b"data: [DONE]\n\n" if done else b"")


def chunk(delta=None, finish=None, **extra) -> dict:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "ds",
            "choices": choices, **extra}


def call(index, id=None, name=None, arguments=None) -> dict:
    fragment = {"index": index, "function": {}}
    if id:
        fragment.update(id=id, type="function")
    if name:
        fragment["function"]["name"] = name
    if arguments is not None:
        fragment["function"]["arguments"] = arguments
    return {"tool_calls": [fragment]}


def translate(data: bytes, pieces=None) -> tuple[list[dict], bool]:
    """The Anthropic events a translator makes of ``data`` fed in ``pieces`` (sizes), and
    whether the stream ended."""
    translator = openai.StreamTranslator("oa", "m")
    out = []
    at = 0
    for size in pieces or [len(data)]:
        out.append(translator.feed(data[at:at + size]))
        at += size
    out.append(translator.feed(data[at:]))
    out.append(translator.close())
    decoder = SSEDecoder()
    events = decoder.feed(b"".join(out)) + decoder.close()
    for event in events:
        assert event.name == event.data["type"]
    return [e.data for e in events], translator.ended


def summary(events: list[dict]) -> list:
    """Each event as a short tuple: what a reader of the sequence checks."""
    out = []
    for e in events:
        kind = e["type"]
        if kind == "content_block_start":
            block = e["content_block"]
            out.append(("start", e["index"], block["type"], block.get("id"), block.get("name")))
        elif kind == "content_block_delta":
            delta = e["delta"]
            value = next(v for k, v in delta.items() if k != "type")
            out.append(("delta", e["index"], value))
        elif kind == "content_block_stop":
            out.append(("stop", e["index"]))
        elif kind == "message_delta":
            out.append(("message_delta", e["delta"]["stop_reason"], e["usage"]["output_tokens"]))
        elif kind == "error":
            out.append(("error", e["error"]["type"], e["error"]["message"]))
        else:
            out.append((kind,))
    return out


USAGE = {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}

INTERLEAVED = sse(
    chunk({"role": "assistant", "content": ""}),
    chunk({"reasoning_content": "Let me "}), chunk({"reasoning_content": "see."}),
    chunk({"content": "Two calls."}),
    chunk(call(0, "call_a", "Bash", "")), chunk(call(1, "call_b", "Read", "")),
    chunk(call(0, arguments='{"comm')), chunk(call(1, arguments='{"path"')),
    chunk(call(0, arguments='and": "ls"}')), chunk(call(1, arguments=': "x"}')),
    chunk({}, "tool_calls"), chunk(usage=USAGE))


def test_interleaved_calls_become_whole_blocks_in_order():
    events, ended = translate(INTERLEAVED)
    assert ended
    assert summary(events) == [
        ("message_start",), ("ping",),
        ("start", 0, "thinking", None, None), ("delta", 0, "Let me "), ("delta", 0, "see."),
        ("delta", 0, ""), ("stop", 0),
        ("start", 1, "text", None, None), ("delta", 1, "Two calls."), ("stop", 1),
        # the first call streams live ...
        ("start", 2, "tool_use", "call_a", "Bash"), ("delta", 2, '{"comm'),
        ("delta", 2, 'and": "ls"}'),
        # ... the other is held until the upstream is done with its calls
        ("stop", 2), ("start", 3, "tool_use", "call_b", "Read"), ("delta", 3, '{"path": "x"}'),
        ("stop", 3),
        ("message_delta", "tool_use", 3), ("message_stop",)]
    assert events[0]["message"]["model"] == "ds"
    assert events[-2]["usage"] == {"input_tokens": 9, "output_tokens": 3,
                                   "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
                                   "cache_creation": {"ephemeral_5m_input_tokens": 0,
                                                      "ephemeral_1h_input_tokens": 0}}


def test_ids_and_names_that_come_late_hold_the_call_until_known():
    events, ended = translate(sse(
        chunk({"role": "assistant"}), chunk(call(0, arguments='{"a"')),
        chunk(call(0, id="call_x", arguments=": 1")), chunk(call(0, name="T", arguments="}")),
        chunk({}, "tool_calls")))
    assert ended
    # what came before the name goes out with it, in one piece
    assert summary(events)[2:] == [("start", 0, "tool_use", "call_x", "T"),
                                   ("delta", 0, '{"a": 1}'), ("stop", 0),
                                   ("message_delta", "tool_use", 0), ("message_stop",)]


def test_a_call_that_never_gets_an_id_is_given_one_and_one_without_a_name_fails():
    events, _ = translate(sse(chunk({"role": "assistant"}),
                              chunk(call(0, name="T", arguments="{}")), chunk({}, "tool_calls")))
    started = events[2]["content_block"]
    assert started["name"] == "T" and started["id"].startswith("call_msg_")
    events, ended = translate(sse(chunk({"role": "assistant"}),
                                  chunk(call(0, id="c", arguments="{}")), chunk({}, "tool_calls")))
    assert ended and summary(events)[-1] == ("error", "api_error",
                                             "upstream oa sent tool call c without a name")


def test_a_fresh_id_at_a_used_index_is_a_new_call():
    # Ollama numbers every call of a parallel batch 0.
    events, _ = translate(sse(
        chunk(call(0, "c1", "Bash", '{"command": "a"}')),
        chunk(call(0, "c2", "Bash", '{"command": "b"}')), chunk({}, "stop")))
    starts = [e["content_block"]["id"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["c1", "c2"]
    assert events[-2]["delta"]["stop_reason"] == "tool_use"  # "stop" after calls is a call


def test_text_after_a_live_call_waits_for_it():
    events, _ = translate(sse(chunk(call(0, "c1", "Bash", "{}")), chunk({"content": "after"}),
                              chunk({}, "tool_calls")))
    assert summary(events)[2:-2] == [("start", 0, "tool_use", "c1", "Bash"), ("delta", 0, "{}"),
                                     ("stop", 0), ("start", 1, "text", None, None),
                                     ("delta", 1, "after"), ("stop", 1)]


def test_invalid_arguments_end_the_stream_with_an_error_event():
    events, ended = translate(sse(chunk(call(0, "c1", "Bash", '{"command": "ls')),
                                  chunk({}, "tool_calls")))
    assert ended
    kind, error_type, message = summary(events)[-1]
    assert (kind, error_type) == ("error", "api_error")
    assert "c1" in message and "'{\"command\": \"ls'" in message
    assert not any(e["type"] == "message_stop" for e in events)


def test_an_error_object_in_the_stream_is_an_error_event():
    events, ended = translate(sse(chunk({"content": "x"}), {"error": {
        "message": "Overloaded", "type": "server_error", "code": 503}}, done=False))
    assert ended and summary(events)[-1] == ("error", "overloaded_error", "Overloaded")
    # LiteLLM's proxy says the status as a string
    events, ended = translate(sse(chunk({"content": "x"}), {"error": {
        "message": "budget exceeded", "type": "auth_error", "param": "None", "code": "429"}},
        done=False))
    assert ended and summary(events)[-1] == ("error", "rate_limit_error", "budget exceeded")


def test_a_stream_cut_before_its_end_is_left_unended():
    _, ended = translate(sse(chunk({"content": "x"}), done=False))
    assert not ended  # the server's StreamRelay then ends it with its own error event


def test_a_stream_that_ends_after_its_finish_reason_without_done_is_complete():
    events, ended = translate(sse(chunk({"content": "x"}), chunk({}, "length"), done=False))
    assert ended and summary(events)[-2:] == [("message_delta", "max_tokens", 0),
                                              ("message_stop",)]


def test_comments_keepalives_and_crlf():
    data = (b": OPENROUTER PROCESSING\r\n\r\n" + sse(chunk({"content": "x"}), chunk({}, "stop"))
            .replace(b"\n", b"\r\n"))
    events, ended = translate(data, [1] * len(data))
    assert ended and summary(events)[2:4] == [("start", 0, "text", None, None), ("delta", 0, "x")]


def test_a_stream_event_that_is_not_json_is_an_error():
    events, ended = translate(b"data: {not json\n\n")
    assert ended and summary(events)[-1][0] == "error"


def test_the_first_event_goes_out_with_the_first_chunk():
    translator = openai.StreamTranslator("oa")
    first = translator.feed(sse(chunk({"role": "assistant", "content": ""}), done=False))
    assert first.startswith(b"event: message_start\n")
    assert translator.feed(b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n').startswith(
        b"event: content_block_start")


# --- properties -------------------------------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=40), max_size=80))
def test_any_chunking_yields_the_same_events(sizes):
    whole, _ = translate(INTERLEAVED)
    events, ended = translate(INTERLEAVED, sizes)
    assert ended
    for event in events + whole:  # message ids differ per translator
        if event["type"] == "message_start":
            event["message"]["id"] = "msg"
    assert events == whole


words = st.text(alphabet="abc xyz\n{}\"", min_size=1, max_size=12)
ids = st.from_regex(r"[a-zA-Z0-9_]{1,8}", fullmatch=True)
inputs = st.dictionaries(st.sampled_from(["command", "path", "n"]),
                         st.one_of(words, st.integers(), st.booleans()), max_size=3)
image = st.builds(lambda data: {"type": "image", "source": {
    "type": "base64", "media_type": "image/png", "data": data}}, st.from_regex(r"[A-Za-z0-9]{4,8}",
                                                                            fullmatch=True))
cache = st.one_of(st.just({}), st.just({"cache_control": {"type": "ephemeral"}}))


@st.composite
def conversations(draw):
    """Anthropic histories with every translatable block: turns of text, images, tool calls
    and their results (text, images, errors), thinking that may be dropped."""
    messages = [{"role": "user", "content": [dict(text(draw(words)), **draw(cache))]}]
    serial = 0
    for _ in range(draw(st.integers(0, 4))):
        blocks = []
        if draw(st.booleans()):
            blocks.append({"type": "thinking", "thinking": draw(words), "signature": "s"})
        blocks += [text(draw(words)) for _ in range(draw(st.integers(0, 2)))]
        calls = []
        for _ in range(draw(st.integers(0 if blocks else 1, 3))):
            serial += 1
            calls.append(use(f"{draw(ids)}_{serial}", draw(st.sampled_from(["Bash", "Read"])),
                             draw(inputs)))
        messages.append(assistant(*blocks, *calls))
        answer = []
        for c in calls:
            content = draw(st.one_of(words, st.lists(st.one_of(st.builds(text, words), image),
                                                     max_size=3)))
            answer.append(result(c["id"], content, **({"is_error": True}
                                                      if draw(st.booleans()) else {})))
        answer += draw(st.lists(st.one_of(st.builds(text, words), image), max_size=2,
                                min_size=0 if answer else 1))
        messages.append(user(*answer))
    return messages


def anthropic_items(messages: list) -> list:
    """What each message carries that has an equivalent, in order: text, images, calls, results."""
    items = []
    for message in messages:
        content = message["content"]
        if message["role"] == "user":
            results = [b for b in content if b["type"] == "tool_result"]
            for b in results:
                inner = b["content"] if isinstance(b["content"], list) else [text(b["content"])]
                items.append(("result", b["tool_use_id"], bool(b.get("is_error")),
                              "\n".join(x["text"] for x in inner if x["type"] == "text")))
            images = [x["source"]["data"] for b in results if isinstance(b["content"], list)
                      for x in b["content"] if x["type"] == "image"]
            items += [("image", data) for data in images]
            for b in content:
                if b["type"] == "text":
                    items.append(("text", b["text"]))
                elif b["type"] == "image":
                    items.append(("image", b["source"]["data"]))
        else:
            texts = [b["text"] for b in content if b["type"] == "text"]
            if texts:
                items.append(("text", "\n\n".join(texts)))
            items += [("call", b["id"], b["name"], b["input"]) for b in content
                      if b["type"] == "tool_use"]
    return items


def chat_items(messages: list) -> list:
    """The same, read back from the Chat Completions messages."""
    items = []
    for message in messages:
        content = message.get("content")
        if message["role"] == "tool":
            is_error = content.startswith("Error: ")
            items.append(("result", message["tool_call_id"], is_error,
                          content[len("Error: "):] if is_error else content))
            continue
        parts = [text(content)] if isinstance(content, str) else content or []
        for part in parts:
            if part["type"] == "text":
                items.append(("text", part["text"]))
            else:
                items.append(("image", part["image_url"]["url"].split("base64,")[1]))
        items += [("call", c["id"], c["function"]["name"],
                   msgspec.json.decode(c["function"]["arguments"]))
                  for c in message.get("tool_calls") or []]
    return items


@settings(max_examples=200, deadline=None)
@given(conversations())
def test_every_block_with_an_equivalent_survives_the_translation(messages):
    out = chat({"messages": messages})
    assert chat_items(out["messages"]) == anthropic_items(messages)
    # Every call is answered by the tool messages right after it, as the format demands.
    for n, message in enumerate(out["messages"]):
        if message.get("tool_calls"):
            answers = [m["tool_call_id"] for m in out["messages"][n + 1:n + 1 + len(
                message["tool_calls"])]]
            assert answers == [c["id"] for c in message["tool_calls"]]


@st.composite
def interleavings(draw):
    """Up to three calls whose fragments arrive in any interleaving that keeps each call's own
    order, ids and names in the first fragment or later, text and reasoning around them."""
    calls = []
    for index in range(draw(st.integers(1, 3))):
        arguments = msgspec.json.encode(draw(inputs)).decode()
        cuts = sorted(draw(st.lists(st.integers(0, len(arguments)), max_size=4)))
        pieces = [arguments[a:b] for a, b in zip([0, *cuts], [*cuts, len(arguments)], strict=True)]
        fragments = [{"index": index, "function": {"arguments": p}} for p in pieces]
        late = draw(st.integers(0, len(fragments) - 1))  # which fragment names the call
        fragments[late].update(id=f"call_{index}", type="function")
        fragments[late]["function"]["name"] = f"Tool{index}"
        calls.append(fragments)
    order = []
    queues = [list(f) for f in calls]
    while any(queues):
        queue = draw(st.sampled_from([q for q in queues if q]))
        order.append(queue.pop(0))
    lead = [chunk({"reasoning_content": "hm"})] if draw(st.booleans()) else []
    lead += [chunk({"content": t}) for t in draw(st.lists(words, max_size=2))]
    body = [chunk({"tool_calls": [f]}) for f in order]
    return calls, sse(chunk({"role": "assistant"}), *lead, *body, chunk({}, "tool_calls"),
                      chunk(usage=USAGE))


@settings(max_examples=200, deadline=None)
@given(interleavings(), st.lists(st.integers(min_value=1, max_value=64), max_size=40))
def test_interleaved_calls_always_make_well_formed_blocks(case, sizes):
    calls, data = case
    events, ended = translate(data, sizes)
    assert ended and events[-1]["type"] == "message_stop"
    blocks, current = [], None
    for event in events:  # blocks open, fill and close one at a time, indices in order
        if event["type"] == "content_block_start":
            assert current is None and event["index"] == len(blocks)
            current = dict(event["content_block"], partial="")
        elif event["type"] == "content_block_delta":
            assert current is not None and event["index"] == len(blocks)
            current["partial"] += event["delta"].get("partial_json", "")
        elif event["type"] == "content_block_stop":
            assert event["index"] == len(blocks)
            blocks.append(current)
            current = None
    got = sorted((b["id"], b["name"], msgspec.json.decode(b["partial"]))
                 for b in blocks if b["type"] == "tool_use")
    assert got == [(f"call_{i}", f"Tool{i}", msgspec.json.decode(
        "".join(f["function"]["arguments"] for f in fragments)))
        for i, fragments in enumerate(calls)]
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


# --- malformed answers ------------------------------------------------------------------------

def test_nulls_are_absent_and_integral_float_counts_are_integers():
    message = openai.anthropic_message({
        "model": None, "choices": [{"message": {"content": None, "refusal": None,
                                                "tool_calls": None}, "finish_reason": None}],
        "usage": {"prompt_tokens": 12.0, "completion_tokens": None,
                  "prompt_tokens_details": None}}, "oa", "asked")
    assert message["model"] == "asked" and message["content"] == []
    assert message["usage"]["input_tokens"] == 12 and type(message["usage"]["input_tokens"]) is int
    assert message["usage"]["output_tokens"] == 0


def test_content_parts_without_text_add_none():
    message = openai.anthropic_message(completion({"content": [
        {"type": "thinking", "thinking": [{"type": "text", "text": "hm"}]},
        {"type": "text", "text": "Hello"}]}), "oa")
    assert message["content"] == [{"type": "text", "text": "Hello"}]


@pytest.mark.parametrize("change, where", [
    ({"usage": {"prompt_tokens": -1}}, "usage.prompt_tokens is not a token count"),
    ({"usage": {"completion_tokens": 1.5}}, "usage.completion_tokens is not a token count"),
    ({"usage": {"prompt_tokens": True}}, "usage.prompt_tokens is not a token count"),
    ({"choices": [1]}, "choices[0] is not an object"),
    ({"choices": [{"message": []}]}, "choices[0].message is not an object"),
    ({"choices": [{"message": {"content": 5}}]}, "choices[0].message.content is not a string"),
    ({"choices": [{"message": {"content": [1]}}]}, "choices[0].message.content[0] is not an "
                                                   "object"),
    ({"choices": [{"message": {"refusal": {}}}]}, "choices[0].message.refusal is not a string"),
    ({"choices": [{"message": {"tool_calls": {}}}]}, "choices[0].message.tool_calls is not a "
                                                     "list"),
    ({"choices": [{"message": {"tool_calls": [{"function": {"name": "x", "arguments": 1}}]}}]},
     "choices[0].message.tool_calls[0].function.arguments is not a string"),
])
def test_a_value_of_the_wrong_type_is_a_502_naming_where(change, where):
    with pytest.raises(RelayError) as failed:
        openai.anthropic_message({**completion({"content": "x"}), **change}, "oa")
    assert failed.value.status == 502 and failed.value.type == "api_error"
    assert failed.value.message == (f"upstream oa answered with a malformed chat completion: "
                                    f"{where}")


def test_a_stream_chunk_of_the_wrong_shape_ends_the_stream_and_none_of_it_goes_out():
    events, ended = translate(sse(chunk({"content": "a"}), {"choices": [
        {"delta": {"content": "never sent", "tool_calls": [{"index": "0"}]}}]}, done=False))
    assert ended and summary(events)[-1][0] == "error"
    assert [e["delta"]["text"] for e in events if e["type"] == "content_block_delta"] == ["a"]
    assert events[-1]["error"]["message"] == (
        "upstream oa sent a malformed stream chunk: choices[0].delta.tool_calls[0].index is not "
        "an integer")


def test_an_event_that_never_ends_is_cut_at_the_limit(monkeypatch):
    monkeypatch.setattr(openai.stream, "MAX_EVENT_BYTES", 1000)
    translator = openai.StreamTranslator("oa")
    assert translator.feed(sse(chunk({"content": "a"}), done=False)).startswith(
        b"event: message_start")
    out = b""
    for _ in range(20):
        out += translator.feed(b"x" * 100 if out or translator.pending else b'data: {"x": "')
    assert out.startswith(b"event: error\n") and b"grew past 1000 bytes" in out
    assert translator.ended and translator.fault[0] == "stream_error"
    assert translator.pending == [] and translator.pending_size <= 1100


def test_what_waits_behind_a_live_call_is_bounded(monkeypatch):
    monkeypatch.setattr(openai.stream, "MAX_HELD_BYTES", 1000)
    translator = openai.StreamTranslator("oa")
    out = translator.feed(sse(chunk(call(0, id="c1", name="Bash", arguments="{")), done=False))
    for _ in range(20):
        out += translator.feed(sse(chunk({"content": "y" * 100}), done=False))
    assert b"event: error\n" in out and translator.fault[0] == "stream_error"
    assert translator.held == []


@pytest.mark.parametrize("usage, expected", [
    # OpenAI: prompt_tokens holds the cache hits; Anthropic's input_tokens does not.
    ({"prompt_tokens": 1000, "completion_tokens": 5,
      "prompt_tokens_details": {"cached_tokens": 900}}, (100, 0, 900)),
    # OpenRouter: and its cache writes (https://openrouter.ai/docs/use-cases/usage-accounting).
    ({"prompt_tokens": 194, "completion_tokens": 2,
      "prompt_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 100}}, (94, 100, 0)),
    # Parts larger than the prompt are cut to it: never more than prompt_tokens in all.
    ({"prompt_tokens": 10, "completion_tokens": 1,
      "prompt_tokens_details": {"cached_tokens": 40, "cache_write_tokens": 5}}, (0, 0, 10)),
])
def test_usage_counts_each_prompt_token_once(usage, expected):
    out, _ = openai.read_usage(usage)
    assert (out["input_tokens"], out["cache_creation_input_tokens"],
            out["cache_read_input_tokens"]) == expected
    assert sum(expected) <= usage["prompt_tokens"]


def test_a_streamed_usage_chunk_with_cache_hits_counts_them_once():
    events, ended = translate(sse(
        chunk({"role": "assistant", "content": "hi"}), chunk({}, "stop"),
        chunk(usage={"prompt_tokens": 1200, "completion_tokens": 30,
                     "prompt_tokens_details": {"cached_tokens": 1024}})))
    assert ended and not any(events[0]["message"]["usage"]["cache_creation"].values())
    usage = events[-2]["usage"]
    assert (usage["input_tokens"], usage["output_tokens"], usage["cache_read_input_tokens"],
            usage["cache_creation_input_tokens"]) == (176, 30, 1024, 0)


def unreported_of(data: bytes) -> tuple[dict, list[str]]:
    """The usage a translated stream's message_delta gives, and what it says went unreported."""
    translator = openai.StreamTranslator("oa", "m")
    out = translator.feed(data) + translator.close()
    [delta] = [e.data for e in SSEDecoder().feed(out) if e.name == "message_delta"]
    return delta["usage"], translator.unreported


@pytest.mark.parametrize("usage, unreported", [
    (None, ["input_tokens", "output_tokens"]),  # stream_options.include_usage ignored
    ({"prompt_tokens": 9}, ["output_tokens"]),
    ({"completion_tokens": 3, "prompt_tokens": None}, ["input_tokens"]),
    (USAGE, []),
])
def test_a_stream_without_its_usage_gives_zeros_and_says_they_are_unreported(usage, unreported):
    chunks = [chunk({"role": "assistant", "content": "hi"}), chunk({}, "stop")]
    if usage is not None:
        chunks.append(chunk(usage=usage))
    given, said = unreported_of(sse(*chunks))
    assert said == unreported
    # The client's usage is Anthropic's whole shape all the same, with what was reported.
    assert given["input_tokens"] == ((usage or {}).get("prompt_tokens") or 0)
    assert given["output_tokens"] == ((usage or {}).get("completion_tokens") or 0)


@pytest.mark.parametrize("usage, unreported", [
    (None, ("input_tokens", "output_tokens")),
    ({"prompt_tokens": 9, "total_tokens": 9}, ("output_tokens",)),
    ({"prompt_tokens": 10, "completion_tokens": 1,
      "prompt_tokens_details": {"cached_tokens": 40}}, ("cache_read_input_tokens",)),
    (USAGE, ()),
])
def test_a_whole_answer_says_what_of_its_usage_is_unreported(usage, unreported):
    answer = completion({"content": "hi"})
    if usage is None:
        del answer["usage"]
    else:
        answer["usage"] = usage
    body, said = openai.answer_bytes(orjson.dumps(answer), "oa")
    assert said == unreported
    assert set(orjson.loads(body)["usage"]) >= {"input_tokens", "output_tokens"}


def test_usage_in_several_chunks_keeps_each_count_the_last_one_gave():
    # Cumulative, as OpenAI's (vLLM's continuous_usage_stats puts it on every chunk): a chunk
    # that leaves a count out has not taken it back to 0.
    given, said = unreported_of(sse(
        chunk({"role": "assistant", "content": "hi"},
              usage={"prompt_tokens": 1200, "completion_tokens": 1,
                     "prompt_tokens_details": {"cached_tokens": 1024}}),
        chunk({"content": " there"}, usage={"prompt_tokens": 1200, "completion_tokens": 2}),
        chunk({}, "stop", usage={"completion_tokens": 3}), chunk(usage={})))
    assert (given["input_tokens"], given["cache_read_input_tokens"],
            given["output_tokens"]) == (176, 1024, 3)
    assert said == []


# --- what real servers send -------------------------------------------------------------------

def sdk_message(events: list[dict]) -> dict:
    """The message the anthropic SDK's stream accumulator builds of ``events``: what a client
    gets of the stream."""
    snapshot = None
    buffers: dict = {}
    for event in events:
        if event["type"] != "ping":
            snapshot = accumulate_event(event=event, current_snapshot=snapshot,
                                        json_bufs=buffers)
    assert snapshot is not None
    return snapshot.to_dict()


def test_a_streamed_refusal_is_the_answers_text_as_in_a_whole_answer():
    # OpenAI streams a structured-output refusal in delta.refusal, content null (the API
    # reference's chat.completion.chunk; openclaw/openclaw#102334, NousResearch/hermes-agent
    # #91181: clients that read only content showed an empty answer).
    events, ended = translate(sse(
        chunk({"role": "assistant", "content": None, "refusal": ""}),
        chunk({"content": None, "refusal": "I can't help"}),
        chunk({"content": None, "refusal": " with that."}), chunk({}, "stop")))
    assert ended
    whole = openai.anthropic_message(completion({"content": None,
                                                 "refusal": "I can't help with that."}), "oa")
    streamed = sdk_message(events)
    assert streamed["content"] == whole["content"] == [
        {"type": "text", "text": "I can't help with that."}]
    assert streamed["stop_reason"] == whole["stop_reason"] == "end_turn"


def test_a_null_error_on_a_healthy_chunk_is_no_error():
    # Gateways that put "error": null on every chunk (NVIDIA-NeMo/Guardrails#2306's review:
    # testing the key's presence "would terminate a healthy stream").
    events, ended = translate(sse(chunk({"content": "hi"}, error=None),
                                  chunk({}, "stop", error=None)))
    assert ended and sdk_message(events)["content"] == [{"type": "text", "text": "hi"}]
    events, ended = translate(sse(chunk({"content": "hi"}), {"error": {"message": "Boom"},
                                                             "choices": []}, done=False))
    assert ended and summary(events)[-1] == ("error", "api_error", "Boom")


@pytest.mark.parametrize("finish", ["error", "network_error", "insufficient_system_resource"])
def test_a_finish_reason_that_says_the_generation_failed_is_an_error_not_an_end(finish):
    # OpenRouter ends a stream with finish_reason "error" when its provider dies mid-answer
    # (gethouston/houston#1211), and a whole answer too (maximhq/bifrost#5425); z.AI says
    # network_error (genkit-ai/genkit#6259), DeepSeek insufficient_system_resource.
    events, ended = translate(sse(chunk({"content": "The answer is"}), chunk({}, finish),
                                  chunk(usage=USAGE)))
    assert ended and summary(events)[-1] == (
        "error", "api_error", f"upstream oa ended the stream with finish_reason {finish!r}: "
                              "the generation failed part way")
    assert not any(e["type"] in ("message_delta", "message_stop") for e in events)
    with pytest.raises(RelayError) as failed:
        openai.anthropic_message(completion({"content": '{"events": [{"title": "partial'},
                                            finish), "oa")
    assert (failed.value.status, failed.value.type) == (502, "api_error")
    assert failed.value.message == (f"upstream oa answered with finish_reason {finish!r}: the "
                                    "generation failed part way")


def test_the_error_a_gateway_puts_on_a_failed_choice_is_what_the_client_reads():
    failing = {"message": "Provider disconnected unexpectedly", "code": 502}
    events, _ = translate(sse(chunk({"content": "x"}),
                              {"choices": [{"index": 0, "delta": {}, "finish_reason": "error",
                                            "error": failing}]}))
    assert summary(events)[-1] == ("error", "api_error", "Provider disconnected unexpectedly")
    answer = completion({"content": "x"}, "error")
    answer["choices"][0]["error"] = failing
    with pytest.raises(RelayError) as failed:
        openai.anthropic_message(answer, "oa")
    assert (failed.value.status, failed.value.message) == (
        502, "Provider disconnected unexpectedly")


@pytest.mark.parametrize("error, status, kind, message", [
    # OpenRouter's errors page: error.code is the HTTP status it stands for.
    ({"message": "Rate limit exceeded: free-models-per-day", "code": 429}, 429,
     "rate_limit_error", "Rate limit exceeded: free-models-per-day"),
    ({"message": "Internal", "code": "server_error"}, 502, "api_error", "Internal"),
    ("model is loading", 502, "api_error", "model is loading"),
    ({"code": 503}, 503, "overloaded_error",
     'upstream oa answered with an error: {"code":503}'),
])
def test_an_error_in_a_200_answer_is_that_error_in_its_own_words(error, status, kind, message):
    for answer in ({"error": error}, {**completion({"content": "x"}), "error": error}):
        with pytest.raises(RelayError) as failed:
            openai.anthropic_message(answer, "oa")
        assert (failed.value.status, failed.value.type, failed.value.message) == (
            status, kind, message)
    assert openai.anthropic_message({**completion({"content": "x"}), "error": None}, "oa")[
        "content"] == [{"type": "text", "text": "x"}]


def test_a_whole_stream_collected_is_the_answer_the_same_completion_makes():
    collected, unreported = openai.stream.collected(INTERLEAVED, "oa")
    assert unreported == ()
    whole = openai.anthropic_message(completion({
        "reasoning_content": "Let me see.", "content": "Two calls.", "tool_calls": [
            {"id": "call_a", "type": "function",
             "function": {"name": "Bash", "arguments": '{"command": "ls"}'}},
            {"id": "call_b", "type": "function",
             "function": {"name": "Read", "arguments": '{"path": "x"}'}}]}, "tool_calls",
        usage=USAGE), "oa")
    for message in (collected, whole):
        message.pop("id")
    assert collected == whole


@pytest.mark.parametrize("stream, status, kind, message", [
    (sse(chunk({"content": "x"}), {"error": {"message": "slow down", "code": 429}},
         done=False), 429, "rate_limit_error", "slow down"),
    (sse(chunk({"content": "x"}), done=False), 502, "api_error",
     "upstream oa answered with a stream that broke off before its end"),
    (sse(chunk(call(0, "c1", "Bash", "{nope")), chunk({}, "tool_calls")), 502, "api_error",
     "upstream oa called tool Bash (c1) with arguments that are not a JSON object: '{nope'"),
])
def test_a_collected_stream_that_fails_is_the_error_it_ended_in(stream, status, kind, message):
    with pytest.raises(RelayError) as failed:
        openai.stream.collected(stream, "oa")
    assert (failed.value.status, failed.value.type, failed.value.message) == (
        status, kind, message)


def test_a_whole_answer_where_a_stream_was_asked_for_is_made_its_stream():
    # sglang answered a stream request with tools as one chat completion (sgl-project/sglang
    # #2810): the client, reading a stream, gets the stream of that answer.
    answer = completion({"reasoning_content": "hm", "content": "Calling.", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "Bash", "arguments": '{"command": "ls"}'}}]}, "tool_calls")
    raw = orjson.dumps(answer, option=orjson.OPT_INDENT_2)
    whole = openai.anthropic_message(answer, "oa")
    for pieces in (None, [1] * len(raw)):
        events, ended = translate(raw, pieces)
        assert ended
        streamed = sdk_message(events)
        assert streamed.pop("id").startswith("msg_")
        assert streamed.pop("stop_details") is None
        assert streamed == {key: value for key, value in whole.items() if key != "id"}


@pytest.mark.parametrize("body, kind, message", [
    (b'{"error": {"message": "slow down", "code": 429}}', "rate_limit_error", "slow down"),
    (b'{"choices": {}}', "api_error",
     "upstream oa answered with a malformed chat completion: choices is not a list"),
    (b'{"choices": [', "api_error", "upstream oa answered a stream with a body that is "
                                    "neither a stream nor JSON: b'{\"choices\": ['"),
])
def test_a_whole_answer_in_place_of_a_stream_that_is_no_answer_is_an_error_event(
        body, kind, message):
    events, ended = translate(body)
    assert ended and summary(events) == [("error", kind, message)]


def test_fragments_of_one_call_each_with_an_id_of_their_own_are_one_call():
    # LM Studio (Gemma 4): the first fragment names the call, each later one has a new id
    # and no name (NousResearch/hermes-agent#106943): one call, not one per fragment.
    events, ended = translate(sse(
        chunk(call(0, "c1", "Read", "")), chunk(call(0, "c2", arguments='{"pa')),
        chunk(call(0, "c3", arguments='th": "x"}')), chunk({}, "tool_calls")))
    assert ended
    assert sdk_message(events)["content"] == [
        {"type": "tool_use", "id": "c1", "name": "Read", "input": {"path": "x"}}]


@pytest.mark.parametrize("fragments, name", [
    # Gemini streams a name in pieces (continuedev/continue#5849) ...
    ([call(0, "c1", "edit_ex", ""), call(0, name="isting_file", arguments=""),
      call(0, arguments='{"a": '), call(0, arguments="1}")], "edit_existing_file"),
    # ... also with the arguments begun (ankit373/hydra#957, a stub on LM Studio's port) ...
    ([call(0, "c1", "get_wea", '{"a": '), call(0, name="ther", arguments="1"),
      call(0, arguments="}")], "get_weather"),
    # ... and MiniMax through NVIDIA NIM says it whole with every fragment
    # (NousResearch/hermes-agent#11984).
    ([call(0, "c1", "read_file", ""), call(0, name="read_file", arguments='{"a": '),
      call(0, name="read_file", arguments="1}")], "read_file"),
])
def test_a_name_in_pieces_or_said_again_is_the_calls_whole_name(fragments, name):
    events, ended = translate(sse(*map(chunk, fragments), chunk({}, "tool_calls")))
    assert ended
    assert sdk_message(events)["content"] == [
        {"type": "tool_use", "id": "c1", "name": name, "input": {"a": 1}}]
    # still live: the block starts once the name is whole, before the upstream is done
    translator = openai.StreamTranslator("oa")
    assert b'"content_block_start"' in translator.feed(sse(*map(chunk, fragments), done=False))


def test_a_name_in_pieces_is_whole_also_for_a_call_held_behind_the_live_one():
    events, ended = translate(sse(
        chunk(call(0, "c1", "Bash", "")), chunk(call(0, arguments='{"command": "ls"}')),
        chunk(call(1, "c2", "Re", "")), chunk(call(1, name="ad", arguments='{"path": "x"}')),
        chunk({}, "tool_calls")))
    assert ended
    assert [(b["id"], b["name"]) for b in sdk_message(events)["content"]] == [
        ("c1", "Bash"), ("c2", "Read")]


def test_a_call_whose_name_could_still_grow_goes_live_when_anything_else_comes():
    events, _ = translate(sse(chunk(call(0, "c1", "Bash", '{"command": "a"}')),
                              chunk({"content": "and"}),
                              chunk(call(1, "c2", "Read", '{"path": "b"}')), chunk({}, "stop")))
    assert summary(events)[2:-2] == [
        ("start", 0, "tool_use", "c1", "Bash"), ("delta", 0, '{"command": "a"}'), ("stop", 0),
        ("start", 1, "text", None, None), ("delta", 1, "and"), ("stop", 1),
        ("start", 2, "tool_use", "c2", "Read"), ("delta", 2, '{"path": "b"}'), ("stop", 2)]


def sdk_until_error(events: list[dict]) -> dict:
    """What the SDK's accumulator builds of ``events`` up to an ``error`` event: it raises
    on a tool input that cannot be JSON, before the error could say why."""
    return sdk_message([e for e in events[:next(
        (n for n, e in enumerate(events) if e["type"] == "error"), len(events))]])


@pytest.mark.parametrize("fragments", [
    # a live call whose arguments stop being JSON (the Hermes parser's, in
    # openvinotoolkit/model_server#3838) ...
    [call(0, "c1", "Bash", '{"command": "ls"'), call(0, arguments=', , "x": 1}')],
    [call(0, "c1", "Bash", "{'command': 'ls'}")],
    # ... and a call held behind it, sent whole once the first is done
    [call(0, "c1", "Bash", '{"command": "ls"}'), call(1, "c2", "Read", '{"path": [}')],
])
def test_arguments_that_cannot_be_json_never_reach_the_client(fragments):
    events, ended = translate(sse(*map(chunk, fragments), chunk({}, "tool_calls")))
    assert ended and events[-1]["type"] == "error"
    assert "with arguments that are not a JSON object" in events[-1]["error"]["message"]
    sdk_until_error(events)  # never "Unable to parse tool parameter JSON from model"


JSON_OBJECTS = st.dictionaries(st.text(), st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 63, 2 ** 63 - 1) | st.floats(allow_nan=False,
                                                          allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner), max_leaves=12))


@settings(max_examples=300, deadline=None)
@given(JSON_OBJECTS, st.booleans(), st.lists(st.integers(1, 9), max_size=30), st.data())
def test_every_prefix_of_a_json_object_may_go_on_and_no_json_object_is_refused(
        value, indent, sizes, data):
    text = orjson.dumps(value, option=orjson.OPT_INDENT_2 if indent else 0).decode()
    prefix, at = openai.stream._ObjectPrefix(), 0
    for size in [*sizes, len(text)]:
        assert prefix.feed(text[at:at + size]), text[:at + size]
        at += size
    # one character changed: refused only when no JSON object is left
    where = data.draw(st.integers(0, len(text) - 1))
    changed = text[:where] + data.draw(st.sampled_from('{}[],:"\\ x.-0e\x01')) + text[where + 1:]
    try:
        whole = type(msgspec.json.decode(changed)) is dict
    except msgspec.DecodeError:
        whole = False
    if whole:
        assert openai.stream._ObjectPrefix().feed(changed)
