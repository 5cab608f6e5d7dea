"""Betas per backend: ``allow_betas`` / ``drop_betas`` filter the header and the fields only a
dropped beta gives meaning to."""

from __future__ import annotations

import orjson
import pytest
from test_server import BODY, Upstream, start_upstream
from test_upstream import Recorder

from relay import config as config_module
from relay.errors import ConfigError
from relay.testing.fixtures import start_relay

CLAUDE_CODE_BETAS = ("claude-code-20250219,interleaved-thinking-2025-05-14,"
                     "context-management-2025-06-27,fine-grained-tool-streaming-2025-05-14")
COMPUTER = {"type": "computer_20250124", "name": "computer", "display_width_px": 10,
            "display_height_px": 10}
BASH = {"name": "Bash", "input_schema": {"type": "object"}}


async def relay_with(aiohttp_server, aiohttp_client, quirks):
    upstream, recorder = Upstream(), Recorder()
    server = await start_upstream(aiohttp_server, upstream)
    client = await start_relay(aiohttp_client, {
        "pipeline": ["rec"],
        "backends": [{"name": "strict", "url": str(server.make_url("")), "models": ["claude-*"],
                      "quirks": quirks}]}, extra={"rec": recorder})
    return client, upstream, recorder


async def test_dropped_betas_leave_the_header_and_their_fields(aiohttp_server, aiohttp_client):
    client, upstream, recorder = await relay_with(
        aiohttp_server, aiohttp_client,
        {"drop_betas": ["context-management-*", "interleaved-*", "computer-use-*"]})
    body = {**BODY, "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]},
            "tools": [BASH, COMPUTER]}
    resp = await client.post("/v1/messages", json=body, headers={
        "anthropic-beta": CLAUDE_CODE_BETAS + ",computer-use-2025-01-24"})
    assert resp.status == 200
    sent = upstream.received[0]
    assert sent["headers"].getall("anthropic-beta") == [
        "claude-code-20250219,fine-grained-tool-streaming-2025-05-14"]
    assert orjson.loads(sent["raw"]) == {**BODY, "tools": [BASH]}
    note = next(e for e in recorder.ended[0].timeline if e["action"] == "dropped betas")
    assert note["backend"] == "strict"
    assert note["betas"] == ["interleaved-thinking-2025-05-14", "context-management-2025-06-27",
                             "computer-use-2025-01-24"]
    assert note["fields"] == ["context_management", "tools[computer_20250124]"]


async def test_allow_betas_keeps_only_those_and_an_empty_header_goes(aiohttp_server,
                                                                   aiohttp_client):
    client, upstream, _ = await relay_with(aiohttp_server, aiohttp_client,
                                           {"allow_betas": ["prompt-caching-*"]})
    await client.post("/v1/messages", json=BODY, headers={
        "anthropic-beta": "prompt-caching-2024-07-31, claude-code-20250219"})
    await client.post("/v1/messages", data=orjson.dumps(BODY), headers={
        "anthropic-beta": CLAUDE_CODE_BETAS, "Content-Type": "application/json"})
    first, second = upstream.received
    assert first["headers"].getall("anthropic-beta") == ["prompt-caching-2024-07-31"]
    assert "anthropic-beta" not in second["headers"]
    assert second["raw"] == orjson.dumps(BODY)  # no field of theirs: the client's own bytes


async def test_without_the_quirks_betas_and_bytes_go_as_sent(aiohttp_server, aiohttp_client):
    client, upstream, recorder = await relay_with(aiohttp_server, aiohttp_client, {})
    raw = orjson.dumps({**BODY, "context_management": {"edits": []}})
    await client.post("/v1/messages", data=raw, headers={
        "anthropic-beta": CLAUDE_CODE_BETAS, "Content-Type": "application/json"})
    sent = upstream.received[0]
    assert sent["headers"]["anthropic-beta"] == CLAUDE_CODE_BETAS and sent["raw"] == raw
    assert not any(e["action"] == "dropped betas" for e in recorder.ended[0].timeline)


@pytest.mark.parametrize("quirks, where", [
    ({"drop_betas": "context-management-*"}, "drop_betas"),
    ({"allow_betas": [1]}, r"allow_betas\[0\]"),
])
def test_the_quirks_are_lists_of_patterns(quirks, where):
    with pytest.raises(ConfigError, match=rf"^backends\[0\]\.quirks\.{where}: "):
        config_module.parse({"backends": [{"name": "b", "url": "http://127.0.0.1:1",
                                           "quirks": quirks}]})
