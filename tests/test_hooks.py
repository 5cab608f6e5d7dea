"""Every hook: documented once with its exact signature, and a test of its own here
(``test_hook_<name>``), as a plugin author would use it."""

from __future__ import annotations

import asyncio
import inspect
import sys

import orjson
import pytest
from aiohttp import web
from support import ROOT, backend
from test_server import BODY, STREAM, Upstream, start_relay, start_upstream, stream_reply

from relay import config as config_module
from relay import hookspecs
from relay.chain import Chain, load_plugins
from relay.errors import ConfigError, RelayError
from relay.hookspecs import hookimpl
from relay.testing import exchange_for

HOOKS = sorted(name for name in dir(hookspecs) if name.startswith("relay_"))


def signature(name: str) -> str:
    return name + str(inspect.signature(getattr(hookspecs, name))).replace("'", "")


def test_every_hook_is_in_the_plugin_guide_with_its_exact_signature():
    readme = (ROOT / "docs" / "writing-a-plugin.md").read_text()
    rows = [line for line in readme.splitlines() if line.startswith("| `relay_")]
    documented = {row.split("`")[1].replace("\\|", "|") for row in rows}
    assert documented == {signature(name) for name in HOOKS}


def test_every_hook_has_a_test_of_its_own_and_a_call_order():
    tests = {name for name in dir(sys.modules[__name__]) if name.startswith("test_hook_")}
    assert tests == {"test_hook_" + name for name in HOOKS}
    for name in HOOKS:
        assert getattr(hookspecs, name).relay_order in (hookspecs.PIPELINE, hookspecs.REVERSE)
        assert getattr(hookspecs, name).__doc__


async def serve(aiohttp_server, aiohttp_client, plugin, reply=None, raw=None, **server):
    upstream = Upstream()
    if reply is not None:
        upstream.reply = reply
    up = await start_upstream(aiohttp_server, upstream)
    config = {"pipeline": ["p"], "backends": [backend(str(up.make_url("")), **(raw or {}))],
              "server": server}
    return await start_relay(aiohttp_client, config, extra={"p": plugin},
                             env={"K": "sk-backend"}), upstream


def test_hook_relay_startup():
    class Picky:
        @hookimpl
        def relay_startup(self, config, options):
            if "level" not in options:
                raise ConfigError("plugins.p.level: required")
    config = config_module.parse({"pipeline": ["p"], "backends": [backend("http://127.0.0.1:1")]})
    chain = Chain(load_plugins(["p"], extra={"p": Picky()}), config)
    with pytest.raises(ConfigError, match="plugins.p.level"):
        asyncio.run(chain.startup(config))


async def test_hook_relay_request(aiohttp_server, aiohttp_client):
    class Shape:
        @hookimpl
        def relay_request(self, exchange):
            headers = exchange.upstream_headers
            assert "x-api-key" not in headers  # credentials are never shown to plugins
            headers["x-team"] = "blue"
            headers.popall("x-drop-me", None)
            headers["x-api-key"] = "stolen"  # and cannot be set by them
            if exchange.model == "claude-blocked":
                raise RelayError(403, "that model is blocked here")

    client, upstream = await serve(aiohttp_server, aiohttp_client, Shape(),
                                   raw={"api_key_env": "K"})
    resp = await client.post("/v1/messages", json=BODY, headers={"x-drop-me": "1"})
    assert resp.status == 200
    sent = upstream.received[0]["headers"]
    assert sent["x-team"] == "blue" and "x-drop-me" not in sent
    assert sent.getall("x-api-key") == ["sk-backend"]
    resp = await client.post("/v1/messages", json={**BODY, "model": "claude-blocked"})
    assert resp.status == 403 and (await resp.json())["error"]["type"] == "permission_error"
    assert len(upstream.received) == 1


async def test_hook_relay_response(aiohttp_server, aiohttp_client):
    class Tag:
        @hookimpl
        def relay_response(self, exchange, response):
            response.data["content"].append({"type": "text", "text": "tagged"})
            response.mark_changed()
            exchange.response_headers["x-tagged"] = "1"

    client, _ = await serve(aiohttp_server, aiohttp_client, Tag())
    resp = await client.post("/v1/messages", json=BODY)
    assert (await resp.json())["content"][-1]["text"] == "tagged" and resp.headers["x-tagged"] == "1"


async def test_hook_relay_stream_events(aiohttp_server, aiohttp_client):
    seen = []

    class Count:
        @hookimpl
        def relay_stream_events(self, exchange):
            seen.append(exchange.stream)
            return None

    client, _ = await serve(aiohttp_server, aiohttp_client, Count(), reply=stream_reply([STREAM]))
    text = await (await client.post("/v1/messages", json={**BODY, "stream": True})).read()
    assert text == STREAM and seen == [True]


async def test_hook_relay_stream_event(aiohttp_server, aiohttp_client):
    class Stop:
        @hookimpl
        def relay_stream_events(self):
            return {"content_block_delta"}

        @hookimpl
        def relay_stream_event(self, event):
            raise RelayError(400, "that text is not allowed here")

    client, _ = await serve(aiohttp_server, aiohttp_client, Stop(), reply=stream_reply([STREAM]))
    text = await (await client.post("/v1/messages", json={**BODY, "stream": True})).read()
    last = text.rstrip().split(b"\n\n")[-1]
    assert last.startswith(b"event: error")
    assert orjson.loads(last.split(b"data: ", 1)[1])["error"] == {
        "type": "invalid_request_error", "message": "that text is not allowed here"}
    assert b"content_block_delta" not in text


async def test_hook_relay_upstream_error(aiohttp_server, aiohttp_client):
    seen = []

    class Watch:
        @hookimpl
        def relay_upstream_error(self, response):
            seen.append(response.status)
            raise RelayError(500, "ignored")

    async def refuse(request):
        return web.json_response({"type": "error", "error": {"type": "rate_limit_error",
                                                             "message": "slow down"}}, status=429)
    client, _ = await serve(aiohttp_server, aiohttp_client, Watch(), reply=refuse)
    resp = await client.post("/v1/messages", json=BODY)
    assert resp.status == 429 and (await resp.json())["error"]["message"] == "slow down"
    assert seen == [429]


async def test_hook_relay_exchange_end(aiohttp_server, aiohttp_client):
    ended = []

    class Record:
        @hookimpl
        def relay_exchange_end(self, exchange):
            ended.append(exchange)

    client, _ = await serve(aiohttp_server, aiohttp_client, Record())
    await client.post("/v1/messages", json=BODY)
    await client.get("/v1/nowhere")
    assert [(e.endpoint, e.outcome, e.answer.status) for e in ended] == [
        ("messages", "ok", 200), ("refused", "refused", 404)]


async def test_hook_relay_routes(aiohttp_server, aiohttp_client):
    class Hello:
        @hookimpl
        def relay_routes(self, options):
            async def hello(request):
                return web.json_response({"hello": "world"})
            return {"GET /hello": hello}

    client, _ = await serve(aiohttp_server, aiohttp_client, Hello())
    assert await (await client.get("/hello")).json() == {"hello": "world"}
    resp = await client.post("/hello", json={})
    assert resp.status == 405

    class Clash:
        @hookimpl
        def relay_routes(self):
            return {"GET /healthz": None}
    config = config_module.parse({"pipeline": ["p"], "backends": [backend("http://127.0.0.1:1")]})
    chain = Chain(load_plugins(["p"], extra={"p": Clash()}), config)
    with pytest.raises(ConfigError, match="served already"):
        chain.routes(config, reserved=("/healthz",))


def test_hook_relay_validate():
    class Lint:
        @hookimpl
        def relay_validate(self, exchange, repair):
            return [{"location": "messages.0", "message": "messages.0: too polite"}]
    config = config_module.parse({"pipeline": ["p"], "backends": [backend("http://127.0.0.1:1")]})
    chain = Chain(load_plugins(["p"], extra={"p": Lint()}), config)
    exchange = exchange_for(BODY, backend=config.backends[0])
    assert asyncio.run(chain.run("relay_validate", exchange, repair=False)) == [
        [{"location": "messages.0", "message": "messages.0: too polite"}]]


def test_hook_relay_shutdown():
    calls = []

    class Closing:
        @hookimpl
        async def relay_shutdown(self, config):
            calls.append(config.pipeline)
            raise RuntimeError("logged, not raised")
    config = config_module.parse({"pipeline": ["p"], "backends": [backend("http://127.0.0.1:1")]})
    chain = Chain(load_plugins(["p"], extra={"p": Closing()}), config)
    asyncio.run(chain.shutdown(config))
    assert calls == [["p"]]


def test_relay_error_needs_a_status_first():
    with pytest.raises(TypeError, match="status comes first"):
        RelayError("just a message")
    assert RelayError(429, "slow").type == "rate_limit_error"



# --- plugin mistakes stop start-up cleanly ------------------------------------------------------

def load(plugin):
    config = config_module.parse({"pipeline": ["first", "p"],
                                  "backends": [backend("http://127.0.0.1:1")]})
    chain = Chain(load_plugins(["first", "p"], extra={"first": object(), "p": plugin}), config)
    asyncio.run(chain.startup(config))


def test_a_misspelt_hook_is_named_with_a_suggestion():
    class Typo:
        @hookimpl
        def relay_reqeust(self, exchange):
            pass
    with pytest.raises(ConfigError, match=r"^pipeline\[1\]: plugin 'p': relay_reqeust is not a "
                                          r"relay hook \(did you mean relay_request\?\)"):
        load(Typo())


def test_a_hook_argument_that_does_not_exist_is_named():
    class Extra:
        @hookimpl
        def relay_request(self, exchange, backend):
            pass
    with pytest.raises(ConfigError, match=r"^pipeline\[1\]: plugin 'p': relay_request takes no "
                                          r"argument\(s\) \{'backend'\} \(it may take any of: "
                                          r"exchange, options\)"):
        load(Extra())


def test_a_plugin_class_needing_arguments_or_failing_at_startup_is_named():
    class Needs:
        def __init__(self, something):
            pass
    with pytest.raises(ConfigError, match=r"^pipeline\[1\]: plugin 'p': could not be created"):
        load(Needs)

    class Boom:
        @hookimpl
        def relay_startup(self):
            raise KeyError("missing")
    with pytest.raises(ConfigError, match=r"^pipeline\[1\]: plugin 'p': relay_startup failed: "
                                          r"KeyError"):
        load(Boom())


def test_trace_lines_carry_the_request_id_and_awaited_results(monkeypatch, caplog):
    monkeypatch.setenv("RELAY_TRACE", "1")

    class Async:
        @hookimpl
        async def relay_validate(self, exchange):
            return [{"location": "messages", "message": "found"}]
    config = config_module.parse({"pipeline": ["p"], "backends": [backend("http://127.0.0.1:1")]})
    chain = Chain(load_plugins(["p"], extra={"p": Async()}), config)
    exchange = exchange_for(BODY, backend=config.backends[0])
    with caplog.at_level("INFO", logger="relay.chain"):
        asyncio.run(chain.run("relay_validate", exchange, repair=False))
    [line] = [r.getMessage() for r in caplog.records if "trace" in r.getMessage()]
    assert line == (f"trace {exchange.id} p.relay_validate -> "
                    "[{'location': 'messages', 'message': 'found'}]")
