"""Shapes the Messages API accepts, from the installed ``anthropic`` SDK's block types and the
API's docs, go through the shipped pipeline (relay.yaml's plugins) to the strict emulator as
the client sent them: not refused, not repaired, not rewritten.

A refusal or an alteration here is a false positive, the worst bug a relay can have. Each
case names where the shape comes from; the rules that refuse are in docs/evidence/rules.json
and their refused examples in test_evidence.py. An answer holding every block kind an answer
may hold goes back to the client byte for byte, streamed and whole. The SDK's own tool
runner, threaded and not, then runs loops whose answers hold server tools, pauses,
programmatic calls and thinking, each request judged by the emulator's rules.
"""

from __future__ import annotations

import copy

import anthropic
import orjson
import pytest
import yaml
from aiohttp import web
from support import ROOT, assistant, request, result, text, use, user

from relay.testing.emulator import EmulatorOptions, find_problem, redacted_data, sign_thinking
from relay.testing.fixtures import received, relay_client  # noqa: F401  (the fixture)

SECRET = "secret-of-the-shapes"
THINKING = {"type": "enabled", "budget_tokens": 1024}


def thought(words: str = "Let me look.") -> dict:
    return {"type": "thinking", "thinking": words,
            "signature": sign_thinking(SECRET.encode(), words)}


def system(content, **fields) -> dict:
    return {"role": "system", "content": content, **fields}


def server_use(tool_id: str, name: str) -> dict:
    return {"type": "server_tool_use", "id": tool_id, "name": name, "input": {"query": "relay"}}


def web_search_result(tool_id: str) -> dict:
    return {"type": "web_search_tool_result", "tool_use_id": tool_id, "content": [
        {"type": "web_search_result", "url": "https://example.com", "title": "Example",
         "encrypted_content": "abc"}]}


def web_fetch_result(tool_id: str) -> dict:
    return {"type": "web_fetch_tool_result", "tool_use_id": tool_id, "content": {
        "type": "web_fetch_result", "url": "https://example.com/a",
        "retrieved_at": "2026-01-01T00:00:00Z",
        "content": {"type": "document", "title": "A", "citations": {"enabled": True},
                    "source": {"type": "text", "media_type": "text/plain", "data": "page"}}}}


def code_result(tool_id: str) -> dict:
    return {"type": "code_execution_tool_result", "tool_use_id": tool_id,
            "content": {"type": "code_execution_result", "stdout": "1", "stderr": "",
                        "return_code": 0, "content": []}}


def loop_step(tool_id: str, *before) -> list:
    """One step of a tool loop: an assistant message ending in a call, and its result."""
    return [assistant(*before, use(tool_id)), user(result(tool_id))]


QUESTION = user(text("go"))
EPHEMERAL = {"type": "ephemeral"}
HOUR = {"type": "ephemeral", "ttl": "1h"}
CALLER = {"type": "code_execution_20260120", "tool_id": "srvtoolu_1"}

# name: (messages, extra top-level fields, extra headers)
SHAPES = {
    # extended-thinking docs, "Interleaved thinking": without it, "Response 2: [tool_use]
    # <- no thinking block"; the tool loop is one assistant turn, which opened with thinking.
    "a thinking tool loop whose later steps do not think": (
        [QUESTION, *loop_step("toolu_1", thought()), *loop_step("toolu_2"),
         *loop_step("toolu_3", text("and one more"))], {"thinking": THINKING}, {}),
    "a tool loop whose result turns carry text after the results": (
        [QUESTION, assistant(thought(), use("toolu_1")),
         user(result("toolu_1"), text("<system-reminder>")), *loop_step("toolu_2")],
        {"thinking": THINKING}, {}),
    # The same text in a user message of its own: the API reference, "Consecutive user or
    # assistant turns in your request will be combined into a single turn", so the results
    # and the text are one user turn that answers calls, and the loop still opened with
    # thinking (tests/fixtures/recorded/accepts-consecutive-same-role.json: such a split
    # accepted). The relay read the text alone as the loop's start and sent thinking off.
    "a thinking tool loop whose results and a reminder are consecutive user messages": (
        [QUESTION, assistant(thought(), use("toolu_1")), user(result("toolu_1")),
         user(text("<system-reminder>")), *loop_step("toolu_2")], {"thinking": THINKING}, {}),
    # Mid-conversation system messages: before an assistant message, or at the end.
    "calls split around a system entry": (
        [QUESTION, assistant(use("toolu_1")), system("a reminder"), assistant(use("toolu_2")),
         user(result("toolu_1"), result("toolu_2"))], {}, {}),
    "a system entry before an assistant message and one ending the array": (
        [QUESTION, system("be brief"), assistant(text("ok")), user(text("more")),
         system([text("note")])], {}, {}),
    "a system entry carrying only output_config": (
        [QUESTION, {"role": "system", "output_config": {"effort": "low"}}], {}, {}),
    "tool additions and removals in system entries": (
        [QUESTION, system([{"type": "tool_removal", "tool": {"type": "tool_reference",
                                                             "name": "Bash"}}]),
         assistant(text("ok")), user(text("again")),
         system([{"type": "tool_addition", "tool": {"type": "tool_reference", "name": "Bash"}}])],
        {}, {"anthropic-beta": "mid-conversation-tool-changes-2026-07-01"}),
    # Server tools (SDK types/beta/*_tool_result_block_param.py): their pairs sit in the
    # assistant turn and take no client result.
    "server tool pairs of every kind": (
        [QUESTION, assistant(
            server_use("srvtoolu_1", "web_search"), web_search_result("srvtoolu_1"),
            server_use("srvtoolu_2", "code_execution"), code_result("srvtoolu_2"),
            server_use("srvtoolu_3", "bash_code_execution"),
            {"type": "bash_code_execution_tool_result", "tool_use_id": "srvtoolu_3",
             "content": {"type": "bash_code_execution_result", "stdout": "", "stderr": "",
                         "return_code": 0, "content": []}},
            server_use("srvtoolu_4", "text_editor_code_execution"),
            {"type": "text_editor_code_execution_tool_result", "tool_use_id": "srvtoolu_4",
             "content": {"type": "text_editor_code_execution_view_result", "content": "x",
                         "file_type": "text"}},
            {"type": "mcp_tool_use", "id": "mcptoolu_1", "name": "search", "server_name": "s",
             "input": {}},
            {"type": "mcp_tool_result", "tool_use_id": "mcptoolu_1", "content": [text("r")]},
            text("found")), user(text("more"))], {}, {}),
    "a tool search whose found tool is then called": (
        [QUESTION, assistant(
            server_use("srvtoolu_1", "tool_search_tool_regex"),
            {"type": "tool_search_tool_result", "tool_use_id": "srvtoolu_1",
             "content": {"type": "tool_search_tool_search_result",
                         "tool_references": [{"type": "tool_reference", "tool_name": "Bash"}]}},
            use("toolu_1")), user(result("toolu_1"))], {}, {}),
    # server-tools docs: a server call made beside client calls runs on the next request.
    "a server call deferred beside a client call, its result in the next turn": (
        [QUESTION, assistant(server_use("srvtoolu_1", "web_search"), use("toolu_1")),
         user(result("toolu_1")), assistant(web_search_result("srvtoolu_1"), text("done")),
         user(text("thanks"))], {}, {}),
    "a paused turn sent back as the last message": (
        [QUESTION, assistant(text("Searching."), server_use("srvtoolu_1", "web_search"))],
        {}, {}),
    # programmatic-tool-calling docs: calls made by code, answered by results alone.
    "programmatic calls and the code's result turns later": (
        [QUESTION, assistant(server_use("srvtoolu_1", "code_execution"),
                             dict(use("toolu_1"), caller={"type": "code_execution_20250825",
                                                          "tool_id": "srvtoolu_1"})),
         user(result("toolu_1")), assistant(code_result("srvtoolu_1"), text("ok")),
         user(text("thanks"))], {}, {}),
    # Content the user turn and results may hold (SDK beta_tool_result_block_param.py).
    "results holding images, documents and search results, or nothing": (
        [QUESTION, assistant(use("toolu_1"), use("toolu_2"), use("toolu_3")),
         user(result("toolu_1", [
             text("a"), {"type": "image", "source": {"type": "url",
                                                     "url": "https://example.com/a.png"}},
             {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                             "data": "doc"}},
             {"type": "search_result", "source": "s", "title": "t", "content": [text("c")]}]),
              {"type": "tool_result", "tool_use_id": "toolu_2"},
              dict(result("toolu_3", []), is_error=True),
              {"type": "container_upload", "file_id": "file_1"}, text("see"))], {}, {}),
    "string contents": (
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
         {"role": "user", "content": "again"}], {}, {}),
    "cache_control and citations on blocks": (
        [user({"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                              "data": "The sky is blue."},
               "citations": {"enabled": True}, "cache_control": EPHEMERAL},
              dict(text("q"), cache_control=EPHEMERAL)),
         assistant(dict(text("The sky is blue."), citations=[
             {"type": "char_location", "cited_text": "The sky is blue.", "document_index": 0,
              "start_char_index": 0, "end_char_index": 16}]),
             dict(use("toolu_1"), cache_control={"type": "ephemeral", "ttl": "1h"})),
         user(dict(result("toolu_1"), cache_control=EPHEMERAL))], {}, {}),
    "an empty final assistant message (a prefill)": ([QUESTION, assistant()], {}, {}),
    "a prefill after results": (
        [QUESTION, *loop_step("toolu_1"), assistant(text("The answer is"))], {}, {}),
    "consecutive messages of one role without calls": (
        [QUESTION, user(text("and")), assistant(text("x")), assistant(text("y")),
         user(text("z"))], {}, {}),
    "results in another order than their calls": (
        [QUESTION, assistant(use("toolu_1"), use("toolu_2")),
         user(result("toolu_2"), result("toolu_1"))], {}, {}),
    # Blocks a response carries and the client sends back unchanged (SDK beta_fallback_block,
    # beta_mcp_tool_listing_block, beta_thinking_block with display "omitted").
    "fallback, MCP listing and omitted-thinking blocks sent back": (
        [QUESTION, assistant({"type": "thinking", "thinking": "", "signature":
                              sign_thinking(SECRET.encode(), "")},
                             {"type": "mcp_tool_listing", "mcp_server_name": "s", "tools": []},
                             text("x"),
                             {"type": "fallback", "from": {"model": "claude-a"},
                              "to": {"model": "claude-b"}, "trigger": None},
                             thought("again"), use("toolu_1")),
         user(result("toolu_1"))], {"thinking": THINKING},
        {"anthropic-beta": "server-side-fallback-2026-07-01"}),
    # The fallback guide: a fallback before any output comes first in the content; the block
    # is not rendered into the prompt (the SDK's BetaFallbackBlockParam).
    "a thinking tool turn opening with its fallback block": (
        [QUESTION, assistant({"type": "fallback", "from": {"model": "claude-a"},
                              "to": {"model": "claude-b"}}, thought(), use("toolu_1")),
         user(result("toolu_1"))], {"thinking": THINKING},
        {"anthropic-beta": "server-side-fallback-2026-07-01"}),
    # Its echo rules after a mid-output fallback: the declined model's text stays, its
    # thinking and calls before the final fallback block go.
    "a thinking tool turn another model took over mid-output": (
        [QUESTION, assistant(text("The first part"), {"type": "fallback", "from": {
            "model": "claude-a"}, "to": {"model": "claude-b"}}, thought(), use("toolu_1")),
         user(result("toolu_1"))], {"thinking": THINKING},
        {"anthropic-beta": "server-side-fallback-2026-07-01"}),
    # BetaMCPToolListingBlock: "the tool listing the server fetched from an MCP server while
    # producing this response. Send the assistant message back unchanged, this block included".
    "a thinking tool turn opening with an MCP server's tool listing": (
        [QUESTION, assistant({"type": "mcp_tool_listing", "mcp_server_name": "s", "tools": []},
                             thought(), use("toolu_1")),
         user(result("toolu_1"))], {"thinking": THINKING, "mcp_servers": [
             {"type": "url", "url": "https://mcp.example.com", "name": "s"}]},
        {"anthropic-beta": "mcp-client-2025-11-20"}),
    "interleaved thinking after a server result": (
        [QUESTION, assistant(thought(), server_use("srvtoolu_1", "web_search"),
                             web_search_result("srvtoolu_1"), thought("again"), text("found")),
         user(text("more"))], {"thinking": THINKING}, {}),
    # SDK 2.16's server-tool results beyond search and code (beta_web_fetch_tool_result_block_param,
    # beta_advisor_tool_result_block_param, beta_encrypted_code_execution_result_block_param,
    # beta_tool_search_tool_result_error_param and the other *_error params).
    "web fetch, advisor and tool search results, errors among them": (
        [QUESTION, assistant(
            server_use("srvtoolu_1", "web_fetch"), web_fetch_result("srvtoolu_1"),
            server_use("srvtoolu_2", "web_fetch"),
            {"type": "web_fetch_tool_result", "tool_use_id": "srvtoolu_2", "content": {
                "type": "web_fetch_tool_result_error", "error_code": "url_not_accessible"}},
            server_use("srvtoolu_3", "web_search"),
            {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_3", "content": {
                "type": "web_search_tool_result_error", "error_code": "max_uses_exceeded"}},
            server_use("srvtoolu_4", "advisor"),
            {"type": "advisor_tool_result", "tool_use_id": "srvtoolu_4",
             "content": {"type": "advisor_result", "text": "Check the tests first."}},
            server_use("srvtoolu_5", "advisor"),
            {"type": "advisor_tool_result", "tool_use_id": "srvtoolu_5",
             "content": {"type": "advisor_redacted_result", "encrypted_content": "e"}},
            server_use("srvtoolu_6", "code_execution"),
            {"type": "code_execution_tool_result", "tool_use_id": "srvtoolu_6", "content": {
                "type": "encrypted_code_execution_result", "encrypted_stdout": "e",
                "stderr": "", "return_code": 0, "content": []}},
            server_use("srvtoolu_7", "tool_search_tool_bm25"),
            {"type": "tool_search_tool_result", "tool_use_id": "srvtoolu_7",
             "content": {"type": "tool_search_tool_result_error", "error_code": "unavailable"}},
            use("toolu_1")), user(result("toolu_1"))], {},
        {"anthropic-beta": "advisor-tool-2026-03-01,advanced-tool-use-2025-11-20"}),
    # A server tool called from code carries `caller` on its use and its result
    # (beta_server_tool_use_block_param, beta_web_search_tool_result_block_param); so does a
    # client call, with the newer caller type (beta_server_tool_caller_20260120_param).
    "server and client tools called from code, results in later turns": (
        [QUESTION, assistant(server_use("srvtoolu_1", "code_execution"),
                             dict(server_use("srvtoolu_2", "web_search"), caller=CALLER),
                             dict(use("toolu_1"), caller=CALLER)),
         user(result("toolu_1")),
         assistant(dict(use("toolu_2"), caller=CALLER)), user(result("toolu_2")),
         assistant(dict(web_search_result("srvtoolu_2"), caller=CALLER),
                   code_result("srvtoolu_1"), text("ok")), user(text("thanks"))], {}, {}),
    "a client call explicitly direct": (
        [QUESTION, assistant(dict(use("toolu_1"), caller={"type": "direct"})),
         user(result("toolu_1"))], {}, {}),
    "an MCP call beside a client call, and an MCP error as a string": (
        [QUESTION, assistant(
            {"type": "mcp_tool_use", "id": "mcptoolu_1", "name": "search", "server_name": "s",
             "input": {}},
            {"type": "mcp_tool_result", "tool_use_id": "mcptoolu_1", "content": "boom",
             "is_error": True}, use("toolu_1")), user(result("toolu_1"))],
        {"mcp_servers": [{"type": "url", "url": "https://mcp.example.com", "name": "s"}]},
        {"anthropic-beta": "mcp-client-2025-11-20"}),
    "a deferred web fetch beside a client call, its result in the next turn": (
        [QUESTION, assistant(server_use("srvtoolu_1", "web_fetch"), use("toolu_1")),
         user(result("toolu_1")), assistant(web_fetch_result("srvtoolu_1"), text("done")),
         user(text("thanks"))], {}, {}),
    # Thinking: redacted blocks open a tool turn as thinking does (extended-thinking docs);
    # the config's newer variants (beta_thinking_config_*_param: display, adaptive,
    # between_tools) and a history made with thinking then sent with it disabled.
    "a tool turn opening with redacted thinking": (
        [QUESTION, assistant({"type": "redacted_thinking",
                              "data": redacted_data(SECRET.encode(), 1)}, use("toolu_1")),
         user(result("toolu_1"))], {"thinking": THINKING}, {}),
    "thinking shown as omitted": (
        [QUESTION, *loop_step("toolu_1", thought(""))],
        {"thinking": dict(THINKING, display="omitted")}, {}),
    "adaptive thinking with a display and effort": (
        [QUESTION, *loop_step("toolu_1", thought()), *loop_step("toolu_2")],
        {"thinking": {"type": "adaptive", "display": "summarized"},
         "output_config": {"effort": "xhigh"}}, {}),
    "adaptive thinking, a tool turn that did not think": (
        [QUESTION, *loop_step("toolu_1")], {"thinking": {"type": "adaptive"}}, {}),
    "thinking between tools": (
        [QUESTION, *loop_step("toolu_1")], {"thinking": {"type": "between_tools"}}, {}),
    "thinking disabled over a history that thought": (
        [QUESTION, *loop_step("toolu_1", thought())], {"thinking": {"type": "disabled"}}, {}),
    "a thinking tool turn whose server tools ran after the thinking": (
        [QUESTION, assistant(thought(), server_use("srvtoolu_1", "web_search"),
                             web_search_result("srvtoolu_1"), use("toolu_1")),
         user(result("toolu_1"))], {"thinking": THINKING}, {}),
    "a paused thinking turn the client continued in a message of its own": (
        [QUESTION, assistant(thought(), server_use("srvtoolu_1", "web_search")),
         assistant(web_search_result("srvtoolu_1"), use("toolu_1")), user(result("toolu_1"))],
        {"thinking": THINKING}, {}),
    # Toolsets (beta_tool_use_block_param and beta_tool_result_block_param's toolset_name,
    # beta_browser_state_block_param in a result).
    "a toolset member's call and its result with the browser's state": (
        [QUESTION, assistant(dict(use("toolu_1", "navigate"), toolset_name="browser")),
         user({"type": "tool_result", "tool_use_id": "toolu_1", "toolset_name": "browser",
               "content": [text("ok"), {"type": "browser_state", "tabs": [
                   {"id": 1, "url": "https://example.com", "title": "E", "active": True}]}]})],
        {"tools": [{"type": "browser_toolset_20260801", "name": "browser"}]}, {}),
    "a client tool search answered with tool references": (
        [QUESTION, assistant(use("toolu_1", "find_tools")),
         user(result("toolu_1", [{"type": "tool_reference", "tool_name": "Bash"}])),
         *loop_step("toolu_2")], {}, {}),
    # Every citation location (beta_text_citation_param) and source kind
    # (beta_request_document_block_param, beta_image_block_param).
    "citations of every kind, and sources of every kind": (
        [user({"type": "document", "source": {"type": "base64", "media_type": "application/pdf",
                                              "data": "JVBERi0="},
               "citations": {"enabled": True}, "title": "pdf", "context": "c"},
              {"type": "document", "source": {"type": "content", "content": [text("chunk")]},
               "citations": {"enabled": True}},
              {"type": "document", "source": {"type": "url", "url": "https://example.com/a.pdf"}},
              {"type": "document", "source": {"type": "file", "file_id": "file_2"}},
              {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                           "data": "iVBORw0KGgo="}, "transformations": {}},
              {"type": "image", "source": {"type": "file", "file_id": "file_1"}},
              {"type": "search_result", "source": "https://s", "title": "t",
               "content": [text("c")], "citations": {"enabled": True}}, text("q")),
         assistant(dict(text("A"), citations=[{
             "type": "page_location", "cited_text": "x", "document_index": 0,
             "start_page_number": 1, "end_page_number": 2}]),
             dict(text("B"), citations=[{
                 "type": "content_block_location", "cited_text": "chunk", "document_index": 1,
                 "start_block_index": 0, "end_block_index": 1}]),
             dict(text("C"), citations=[{
                 "type": "search_result_location", "cited_text": "c", "search_result_index": 0,
                 "source": "https://s", "title": "t", "start_block_index": 0,
                 "end_block_index": 1}]),
             dict(text("D"), citations=[{
                 "type": "web_search_result_location", "cited_text": "c",
                 "url": "https://example.com", "title": "E", "encrypted_index": "ei"}])),
         user(text("thanks"))], {}, {"anthropic-beta": "files-api-2025-04-14"}),
    "a container upload opening the conversation": (
        [user({"type": "container_upload", "file_id": "file_1"}, text("analyse it"))],
        {"container": "container_1",
         "tools": [{"type": "code_execution_20250825", "name": "code_execution"}]},
        {"anthropic-beta": "files-api-2025-04-14"}),
    "breakpoints with a ttl on server blocks, and the top-level one": (
        [QUESTION, assistant(dict(server_use("srvtoolu_1", "web_search"), cache_control=HOUR),
                             dict(web_search_result("srvtoolu_1"), cache_control=HOUR),
                             dict(text("x"), cache_control=EPHEMERAL)), user(text("more"))],
        {"cache_control": EPHEMERAL}, {}),
    # The top-level fields and tool kinds of beta MessageCreateParams and BetaToolUnionParam.
    "every top-level field and tool kind": (
        [QUESTION], {
            "service_tier": "standard_only", "inference_geo": "us", "speed": "fast",
            "metadata": {"user_id": "u"}, "stop_sequences": ["X"], "temperature": 0.2,
            "top_k": 3, "top_p": 0.9, "diagnostics": {"previous_message_id": None},
            "output_config": {"effort": "max", "task_budget": {"type": "tokens", "total": 20000},
                              "format": {"type": "json_schema", "schema": {"type": "object"}}},
            "container": {"id": "c", "skills": [{"type": "anthropic", "skill_id": "pptx",
                                                 "version": "latest"}]},
            "context_management": {"edits": [
                {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens",
                                                                 "value": 30000},
                 "keep": {"type": "tool_uses", "value": 3}, "exclude_tools": ["Bash"]}]},
            "mcp_servers": [{"type": "url", "url": "https://mcp.example.com", "name": "s"}],
            "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
            "tools": [
                {"name": "get", "input_schema": {"type": "object"}, "strict": True,
                 "input_examples": [{"a": "x"}], "defer_loading": True,
                 "allowed_callers": ["direct", "code_execution_20250825"],
                 "cache_control": EPHEMERAL},
                {"type": "bash_20250124", "name": "bash"},
                {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"},
                {"type": "computer_20251124", "name": "computer", "display_width_px": 1024,
                 "display_height_px": 768},
                {"type": "memory_20250818", "name": "memory"},
                {"type": "web_search_20260209", "name": "web_search", "max_uses": 3},
                {"type": "web_fetch_20260209", "name": "web_fetch", "max_uses": 2},
                {"type": "code_execution_20260120", "name": "code_execution"},
                {"type": "tool_search_tool_regex_20251119", "name": "tool_search_tool_regex"},
                {"type": "advisor_20260301", "name": "advisor", "model": "claude-test"},
                {"type": "mcp_toolset", "mcp_server_name": "s"}]},
        {"anthropic-beta": "fast-mode-2026-02-01,task-budgets-2026-03-13,skills-2025-10-02,"
                           "context-management-2025-06-27,computer-use-2025-11-24,"
                           "advanced-tool-use-2025-11-20,mcp-client-2025-11-20,"
                           "advisor-tool-2026-03-01,cache-diagnosis-2026-04-07"}),
    "a system entry after the results and before the answer, and one ending the array": (
        [QUESTION, *loop_step("toolu_1"), system("a reminder"), assistant(text("done")),
         user(text("k")), system("another")], {}, {}),
    "tool changes naming MCP toolsets and tools": (
        [QUESTION, system([{"type": "tool_addition",
                            "tool": {"type": "mcp_toolset_reference", "server_name": "s"}},
                           {"type": "tool_removal", "tool": {
                               "type": "mcp_tool_reference", "server_name": "s", "name": "x"}}]),
         assistant(text("ok")), user(text("k"))],
        {"mcp_servers": [{"type": "url", "url": "https://mcp.example.com", "name": "s"}]},
        {"anthropic-beta": "mid-conversation-tool-changes-2026-07-01,mcp-client-2025-11-20"}),
    "a conversation opening with an assistant message": (
        [assistant(text("Hello, how can I help?")), user(text("hi"))], {}, {}),
    # MessageCreateParams.max_tokens: "Set to `0` to populate the prompt cache without
    # generating a response".
    "a cache warm-up: max_tokens 0 with a breakpoint": (
        [QUESTION, *loop_step("toolu_1"), user(dict(text("go on"), cache_control=EPHEMERAL))],
        {"max_tokens": 0}, {}),
}


@pytest.mark.parametrize("name", SHAPES)
async def test_an_accepted_shape_goes_up_as_the_client_sent_it(relay_client, tmp_path, name):
    messages, fields, headers = SHAPES[name]
    shipped = yaml.safe_load((ROOT / "relay.yaml").read_text())
    client = await relay_client(shipped["pipeline"], {"dump": {"dir": str(tmp_path / "dumps")}},
                                signing_secret=SECRET)
    body = request(*messages, **fields)
    response = await client.post("/v1/messages", json=body, headers={
        "x-api-key": "test", "anthropic-version": "2023-06-01", **headers})
    assert response.status == 200, await response.text()
    assert "x-relay-repairs" not in response.headers
    assert "x-relay-rewrites" not in response.headers
    (sent,) = received(client)
    assert sent == body


# --- answers holding the newest blocks --------------------------------------------------------

# An answer as the API streams it, block by block (SDK 2.16: BetaRawContentBlockStartEvent's
# blocks; the deltas of BetaRawContentBlockDelta, compaction_delta and citations_delta among
# them; a message_delta with a container, context management and iterations).
ANSWER_BLOCKS = [
    ({"type": "compaction", "content": None, "encrypted_content": None},
     [{"type": "compaction_delta", "content": "Earlier work.", "encrypted_content": "enc"}]),
    ({"type": "thinking", "thinking": "", "signature": ""},
     [{"type": "thinking_delta", "thinking": "Let me look.", "estimated_tokens": None},
      {"type": "signature_delta", "signature": sign_thinking(SECRET.encode(), "Let me look.")}]),
    ({"type": "redacted_thinking", "data": redacted_data(SECRET.encode(), 1)}, []),
    ({"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {},
      "caller": {"type": "direct"}},
     [{"type": "input_json_delta", "partial_json": ""},
      {"type": "input_json_delta", "partial_json": '{"query": "relay"}'}]),
    (dict(web_search_result("srvtoolu_1"), caller={"type": "direct"}), []),
    ({"type": "server_tool_use", "id": "srvtoolu_2", "name": "web_fetch", "input": {}},
     [{"type": "input_json_delta", "partial_json": '{"url": "https://example.com/a"}'}]),
    (web_fetch_result("srvtoolu_2"), []),
    ({"type": "text", "text": "", "citations": None},
     [{"type": "text_delta", "text": "The sky is blue."},
      {"type": "citations_delta", "citation": {
          "type": "web_search_result_location", "cited_text": "blue",
          "url": "https://example.com", "title": "Example", "encrypted_index": "ei"}}]),
    ({"type": "mcp_tool_use", "id": "mcptoolu_1", "name": "search", "server_name": "s",
      "input": {}}, [{"type": "input_json_delta", "partial_json": '{"q": 1}'}]),
    ({"type": "mcp_tool_result", "tool_use_id": "mcptoolu_1", "is_error": False,
      "content": [text("r")]}, []),
    ({"type": "fallback", "from": {"model": "claude-a"}, "to": {"model": "claude-b"},
      "trigger": None}, []),
    ({"type": "server_tool_use", "id": "srvtoolu_3", "name": "code_execution", "input": {}},
     [{"type": "input_json_delta", "partial_json": '{"code": "print(1)"}'}]),
    ({"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {}, "caller": CALLER
      | {"tool_id": "srvtoolu_3"}},
     [{"type": "input_json_delta", "partial_json": '{"command": "ls"}'}])]
ANSWER_END = {"type": "message_delta", "delta": {
    "stop_reason": "tool_use", "stop_sequence": None, "stop_details": None,
    "container": {"id": "container_1", "expires_at": "2026-12-01T00:00:00Z"}},
    "context_management": {"applied_edits": []}, "usage": {
        "output_tokens": 50, "server_tool_use": {"web_search_requests": 1},
        "iterations": [{"type": "compaction", "input_tokens": 100, "output_tokens": 20},
                       {"type": "message", "input_tokens": 10, "output_tokens": 30}]}}


def answer_events() -> bytes:
    events = [{"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-test",
        "content": [], "stop_reason": None, "stop_sequence": None, "container": None,
        "input_transformations": [], "usage": {"input_tokens": 10, "output_tokens": 1}}}]
    for index, (start, deltas) in enumerate(ANSWER_BLOCKS):
        events.append({"type": "content_block_start", "index": index, "content_block": start})
        events += [{"type": "content_block_delta", "index": index, "delta": delta}
                   for delta in deltas]
        events.append({"type": "content_block_stop", "index": index})
        if index == 3:
            events.append({"type": "ping"})
    events += [ANSWER_END, {"type": "message_stop"}]
    return b"".join(f"event: {e['type']}\ndata: {orjson.dumps(e).decode()}\n\n".encode()
                    for e in events)


def whole_answer() -> bytes:
    return orjson.dumps({
        "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-test",
        "content": [dict(start, input={"query": "relay"}) if start.get("id") == "srvtoolu_1"
                    else start for start, _ in ANSWER_BLOCKS],
        "stop_reason": "tool_use", "stop_sequence": None, "container": ANSWER_END["delta"][
            "container"], "usage": {"input_tokens": 10, "output_tokens": 50}})


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "whole"])
async def test_an_answer_with_the_newest_blocks_reaches_the_client_as_sent(
        relay_client, aiohttp_server, tmp_path, streamed):
    payload = answer_events() if streamed else whole_answer()

    async def messages(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream" if streamed else "application/json"})
        await response.prepare(request)
        for at in range(0, len(payload), 61):  # events cut across writes
            await response.write(payload[at:at + 61])
        return response

    app = web.Application()
    app.router.add_post("/v1/messages", messages)
    shipped = yaml.safe_load((ROOT / "relay.yaml").read_text())
    client = await relay_client(shipped["pipeline"], {"dump": {"dir": str(tmp_path / "dumps")}},
                                upstream=await aiohttp_server(app))
    response = await client.post("/v1/messages", json=request(
        QUESTION, *loop_step("toolu_0", thought()), stream=streamed, thinking=THINKING),
        headers={"x-api-key": "test", "anthropic-version": "2023-06-01"})
    assert response.status == 200
    assert await response.read() == payload
    assert "x-relay-rewrites" not in response.headers


# --- the SDK's own tool runner ----------------------------------------------------------------

# What the API answers, turn by turn, thinking on (the emulator answers with client calls only):
# a server call deferred beside a client call, then its result in the next turn; a paused
# server call; programmatic calls; a thinking loop whose later steps do not think.
SCRIPTS = {
    "a deferred web search": [
        ([thought(), text("Both."), server_use("srvtoolu_1", "web_search"),
          dict(use("toolu_1", "run"), input={"command": "ls"})], "tool_use"),
        ([web_search_result("srvtoolu_1"), dict(use("toolu_2", "run"), input={"command": "pwd"})],
         "tool_use"),
        ([text("done")], "end_turn")],
    "a paused turn": [
        ([thought(), server_use("srvtoolu_1", "web_search")], "pause_turn"),
        ([web_search_result("srvtoolu_1"), dict(use("toolu_1", "run"), input={"command": "ls"})],
         "tool_use"),
        ([text("done")], "end_turn")],
    "programmatic calls": [
        ([thought(), server_use("srvtoolu_1", "code_execution"),
          dict(use("toolu_1", "run"), input={"command": "ls"},
               caller={"type": "code_execution_20250825", "tool_id": "srvtoolu_1"})], "tool_use"),
        ([code_result("srvtoolu_1"), text("done")], "end_turn")],
    "a thinking loop": [
        ([thought(), dict(use("toolu_1", "run"), input={"command": "ls"})], "tool_use"),
        ([dict(use("toolu_2", "run"), input={"command": "pwd"})], "tool_use"),
        ([text("done")], "end_turn")],
}


@anthropic.beta_async_tool
async def run(command: str) -> str:
    """Run a shell command.

    Args:
        command: the command line
    """
    return f"ran {command}"


def scripted(answers: list, judged: list, bodies: list) -> web.Application:
    """An upstream answering ``answers`` in turn; ``bodies`` gets each request, and ``judged``
    what the strict emulator says of it (None: accepted)."""
    async def messages(request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        bodies.append(body)
        judged.append(find_problem(copy.deepcopy(body), EmulatorOptions(signing_secret=SECRET)))
        content, stop = answers[min(len(judged), len(answers)) - 1]
        return web.json_response({
            "id": f"msg_{len(judged)}", "type": "message", "role": "assistant",
            "model": body["model"], "content": content, "stop_reason": stop,
            "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}})
    app = web.Application()
    app.router.add_post("/v1/messages", messages)
    return app


@pytest.mark.parametrize("threaded", [True, False], ids=["threaded", "unthreaded"])
@pytest.mark.parametrize("script", SCRIPTS)
async def test_the_sdks_tool_runner_goes_through_with_the_newest_blocks(
        relay_client, aiohttp_server, tmp_path, script, threaded):
    judged: list = []
    bodies: list = []
    shipped = yaml.safe_load((ROOT / "relay.yaml").read_text())
    client = await relay_client(shipped["pipeline"], {"dump": {"dir": str(tmp_path / "dumps")}},
                                upstream=await aiohttp_server(
                                    scripted(SCRIPTS[script], judged, bodies)))
    sent: list = []
    answered: list = []

    async def on_request(request):
        sent.append(orjson.loads(request.content))

    async def on_response(response):
        answered.append((response.status_code, response.headers.get("x-relay-repairs")))

    sdk = anthropic.AsyncAnthropic(
        base_url=str(client.make_url("")).rstrip("/"), api_key="sk-test", max_retries=0,
        http_client=anthropic.DefaultAsyncHttpxClient(
            event_hooks={"request": [on_request], "response": [on_response]}))
    runner = sdk.beta.messages.tool_runner(
        model="claude-test", max_tokens=2048, tools=[run], max_iterations=6,
        messages=[{"role": "user", "content": "go"}],
        thinking={"type": "enabled", "budget_tokens": 1024},
        **({} if threaded else {"thread": False}))
    stops = [message.stop_reason async for message in runner]
    assert stops[-1] == "end_turn"
    assert answered == [(200, None)] * len(SCRIPTS[script])
    assert judged == [None] * len(SCRIPTS[script])
    assert all(body["thinking"] == {"type": "enabled", "budget_tokens": 1024} for body in bodies)
    if threaded:
        assert sent[0]["thread"] == {"type": "create"}
        # This backend holds no threads: the relay carries them, so each request goes up as
        # the whole conversation, which ends with what the SDK sent (nothing, to continue a
        # paused turn).
        assert all(body["messages"][len(body["messages"]) - len(mine["messages"]):]
                   == mine["messages"] for body, mine in zip(bodies, sent, strict=True))
    else:
        assert bodies == sent
