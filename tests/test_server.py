"""The host against scripted in-process upstreams: routing, auth, headers, limits, bad
input, streaming, disconnects."""

from __future__ import annotations

import asyncio
import gzip
import logging

import orjson
import pytest
from aiohttp import web

from relay import config as config_module
from relay.errors import RelayError
from relay.hookspecs import hookimpl
from relay.testing.fixtures import start_relay

BODY = {"model": "claude-test", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
ANSWER = {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-test",
          "content": [{"type": "text", "text": "hello"}], "stop_reason": "end_turn",
          "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}}
STREAM = (
    b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1","type":"message",'
    b'"role":"assistant","content":[],"model":"m","stop_reason":null,"usage":{"input_tokens":1,'
    b'"output_tokens":0}}}\n\n'
    b'event: ping\ndata: {"type": "ping"}\n\n'
    b': a comment\n\n'
    b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
    b'"content_block":{"type":"text","text":""}}\n\n'
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
    b'"delta":{"type":"text_delta","text":"hello"}}\n\n'
    b'event: brand_new_event\ndata: {"type":"brand_new_event"}\n\n'
    b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
    b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn"},'
    b'"usage":{"output_tokens":1}}\n\n'
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
)


class Upstream:
    """A scripted upstream that records what it received."""

    def __init__(self):
        self.received: list[dict] = []
        self.reply = self.json_reply

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.received.append({"path": request.path, "query": request.query_string,
                              "headers": request.headers, "raw": raw, "method": request.method})
        return await self.reply(request)

    async def json_reply(self, request):
        return web.json_response(ANSWER, headers={"request-id": "req_up1",
                                                  "anthropic-ratelimit-requests-remaining": "9"})


async def start_upstream(aiohttp_server, upstream: Upstream):
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_route("*", "/{tail:.*}", upstream.handle)
    return await aiohttp_server(app)


@pytest.fixture
async def setup(aiohttp_server, aiohttp_client):
    async def make(pipeline=(), extra=None, env=None, upstream=None, **backend_extra):
        upstream = upstream or Upstream()
        server = await start_upstream(aiohttp_server, upstream)
        raw = {"pipeline": list(pipeline),
               "backends": [{"name": "up", "url": str(server.make_url("")), "models": ["claude-*"],
                             **backend_extra}]}
        client = await start_relay(aiohttp_client, raw, extra=extra, env=env)
        return client, upstream
    return make


# --- routing and auth -------------------------------------------------------------------

async def test_routes_by_model_first_match_wins(aiohttp_server, aiohttp_client):
    a, b = Upstream(), Upstream()
    sa, sb = await start_upstream(aiohttp_server, a), await start_upstream(aiohttp_server, b)
    client = await start_relay(aiohttp_client, {"backends": [
        {"name": "a", "url": str(sa.make_url("")), "models": ["claude-*"]},
        {"name": "b", "url": str(sb.make_url("")), "models": ["kimi-*", "claude-opus-*"],
         "rename": {"kimi-latest": "kimi-k2"}},
    ]})
    await client.post("/v1/messages", json=BODY)
    await client.post("/v1/messages", json={**BODY, "model": "claude-opus-9"})
    await client.post("/v1/messages", json={**BODY, "model": "kimi-latest"})
    assert [orjson.loads(r["raw"])["model"] for r in a.received] == ["claude-test", "claude-opus-9"]
    assert [orjson.loads(r["raw"])["model"] for r in b.received] == ["kimi-k2"]


async def test_unknown_model_is_404_naming_it(setup):
    client, upstream = await setup()
    resp = await client.post("/v1/messages", json={**BODY, "model": "gpt-9"})
    assert resp.status == 404
    error = await resp.json()
    assert error["type"] == "error" and error["error"]["type"] == "not_found_error"
    assert "gpt-9" in error["error"]["message"]
    assert upstream.received == []


async def test_default_backend_takes_unmatched_models(aiohttp_server, aiohttp_client):
    a, b = Upstream(), Upstream()
    sa, sb = await start_upstream(aiohttp_server, a), await start_upstream(aiohttp_server, b)
    client = await start_relay(aiohttp_client, {"backends": [
        {"name": "a", "url": str(sa.make_url("")), "models": ["claude-*"]},
        {"name": "b", "url": str(sb.make_url("")), "models": [], "default": True}]})
    assert (await client.post("/v1/messages", json={**BODY, "model": "other"})).status == 200
    assert len(b.received) == 1 and not a.received
    assert (await client.get("/v1/models")).status == 200
    assert b.received[-1]["path"] == "/v1/models"


async def test_client_auth_passes_through_unchanged(setup):
    client, upstream = await setup()
    await client.post("/v1/messages", json=BODY, headers={"x-api-key": "sk-client"})
    await client.post("/v1/messages", json=BODY, headers={"Authorization": "Bearer tok"})
    assert upstream.received[0]["headers"]["x-api-key"] == "sk-client"
    assert upstream.received[1]["headers"]["Authorization"] == "Bearer tok"


@pytest.mark.parametrize("auth,header,expected", [
    ("x-api-key", "x-api-key", "sk-from-env"),
    ("bearer", "Authorization", "Bearer sk-from-env")])
async def test_env_key_replaces_client_auth(setup, auth, header, expected):
    client, upstream = await setup(env={"UP_KEY": "sk-from-env"}, api_key_env="UP_KEY", auth=auth)
    await client.post("/v1/messages", json=BODY,
                      headers={"x-api-key": "sk-client", "Authorization": "Bearer client"})
    headers = upstream.received[0]["headers"]
    assert headers[header] == expected
    other = "Authorization" if header == "x-api-key" else "x-api-key"
    assert other not in headers


# --- headers and encodings --------------------------------------------------------------

async def test_end_to_end_headers_forwarded_hop_by_hop_dropped(setup):
    client, upstream = await setup()
    resp = await client.post("/v1/messages?beta=true", json=BODY, headers={
        "anthropic-version": "2023-06-01", "anthropic-beta": "a-1,b-2",
        "User-Agent": "claude-cli/2.1.0 (external, sdk-cli)",
        "X-Claude-Code-Session-Id": "sess-1", "X-Stainless-Lang": "js",
        "Proxy-Authorization": "Basic xyz", "TE": "trailers", "Keep-Alive": "timeout=5"})
    assert resp.status == 200
    got = upstream.received[0]
    assert got["query"] == "beta=true"
    headers = got["headers"]
    assert headers["anthropic-version"] == "2023-06-01"
    assert headers["anthropic-beta"] == "a-1,b-2"
    assert headers["User-Agent"] == "claude-cli/2.1.0 (external, sdk-cli)"
    assert headers["X-Claude-Code-Session-Id"] == "sess-1"
    assert headers["X-Stainless-Lang"] == "js"
    for dropped in ("Proxy-Authorization", "TE", "Keep-Alive"):
        assert dropped not in headers
    assert int(headers["Content-Length"]) == len(got["raw"])
    assert resp.headers["request-id"] == "req_up1"
    assert resp.headers["anthropic-ratelimit-requests-remaining"] == "9"
    assert resp.headers["x-relay-request-id"].startswith("relay_")


async def test_gzip_upstream_is_decoded_once_with_fresh_length(setup):
    async def gzipped(request):
        payload = gzip.compress(orjson.dumps(ANSWER))
        return web.Response(body=payload, headers={
            "Content-Encoding": "gzip", "Content-Type": "application/json",
            "retry-after": "3", "x-should-retry": "false"})
    upstream = Upstream()
    upstream.reply = gzipped
    client, _ = await setup(upstream=upstream)
    resp = await client.post("/v1/messages", json=BODY, headers={"Accept-Encoding": "gzip"},
                             auto_decompress=False)
    raw = await resp.read()
    assert "Content-Encoding" not in resp.headers
    assert int(resp.headers["Content-Length"]) == len(raw)
    assert orjson.loads(raw) == ANSWER
    assert resp.headers["retry-after"] == "3" and resp.headers["x-should-retry"] == "false"


async def test_gzip_request_body_is_forwarded_decoded(setup):
    client, upstream = await setup()
    payload = orjson.dumps(BODY)
    resp = await client.post("/v1/messages", data=gzip.compress(payload),
                             headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})
    assert resp.status == 200
    got = upstream.received[0]
    assert got["raw"] == payload and "Content-Encoding" not in got["headers"]


# --- bodies -----------------------------------------------------------------------------

async def test_unchanged_request_goes_up_as_the_clients_bytes(setup):
    client, upstream = await setup()
    payload = b'{"model":  "claude-test", "max_tokens": 5,\n "messages": [{"role":"user","content":"x"}]}'
    await client.post("/v1/messages", data=payload, headers={"Content-Type": "application/json"})
    assert upstream.received[0]["raw"] == payload


async def test_a_changed_request_keeps_the_clients_escapes_and_a_lone_surrogate_is_the_apis_400(
        setup):
    # dedup renames the repeated id, so the request is encoded again: the texts it did not
    # touch go up as the client's JSON text, escapes and all, not decoded and re-escaped.
    # A lone surrogate never gets that far: the API refuses it (docs/evidence/inbound.json),
    # and so does the relay, in the same words.
    client, upstream = await setup(pipeline=("dedup",))
    turn = (b'{"role":"assistant","content":[{"type":"tool_use","id":"toolu_1","name":"Bash",'
            b'"input":{"c":"\\u00e9"}}]},{"role":"user","content":[{"type":"tool_result",'
            b'"tool_use_id":"toolu_1","content":"ok \\ud83d\\ude00 \\"q\\""}]}')
    raw = (b'{"model":"claude-test","max_tokens":5,"messages":[{"role":"user","content":"go"},'
           + turn + b"," + turn + b"]}")
    headers = {"Content-Type": "application/json"}
    assert (await client.post("/v1/messages", data=raw, headers=headers)).status == 200
    sent = upstream.received[0]["raw"]
    assert sent != raw and b'"toolu_1-2"' in sent
    assert sent.count(b'"ok \\ud83d\\ude00 \\"q\\""') == 2 and sent.count(b'{"c":"\\u00e9"}') == 2
    lone = raw.replace(b"\\ud83d\\ude00", b"\\ud83d", 1)
    resp = await client.post("/v1/messages", data=lone, headers=headers)
    assert resp.status == 400
    assert (await resp.json())["error"]["message"].startswith(
        "The request body is not valid JSON: no low surrogate in string: line 1 column ")
    assert len(upstream.received) == 1


async def test_large_history_accepted_and_oversize_is_413(aiohttp_server, aiohttp_client):
    upstream = Upstream()
    server = await start_upstream(aiohttp_server, upstream)
    client = await start_relay(aiohttp_client, {
        "server": {"max_body_bytes": 3 * 1024 * 1024},
        "backends": [{"name": "up", "url": str(server.make_url("")), "models": ["*"]}]})
    big = {**BODY, "messages": [{"role": "user", "content": "x" * (2 * 1024 * 1024)}]}
    assert (await client.post("/v1/messages", json=big)).status == 200
    huge = {**BODY, "messages": [{"role": "user", "content": "x" * (4 * 1024 * 1024)}]}
    resp = await client.post("/v1/messages", json=huge)
    assert resp.status == 413
    assert (await resp.json())["error"]["type"] == "request_too_large"
    assert len(upstream.received) == 1


async def test_a_chunked_body_is_read_whole_and_its_limit_holds(aiohttp_server, aiohttp_client):
    """A body without a declared length, in HTTP chunks of every size: the bytes that go up
    are the client's, and one past the limit is a 413 once it is read that far."""
    upstream = Upstream()
    server = await start_upstream(aiohttp_server, upstream)
    client = await start_relay(aiohttp_client, {
        "server": {"max_body_bytes": 1024 * 1024},
        "backends": [{"name": "up", "url": str(server.make_url("")), "models": ["*"]}]})
    payload = orjson.dumps({**BODY, "messages": [{"role": "user", "content": "x" * 300_000}]})

    async def pieces(data: bytes, sizes=(1, 7, 65536, 200_000)):
        at, n = 0, 0
        while at < len(data):
            size = sizes[n % len(sizes)]
            yield data[at:at + size]
            at, n = at + size, n + 1

    resp = await client.post("/v1/messages", data=pieces(payload),
                             headers={"Content-Type": "application/json"})
    assert resp.status == 200
    assert upstream.received[0]["raw"] == payload
    over = orjson.dumps({**BODY, "messages": [{"role": "user", "content": "x" * 1_100_000}]})
    resp = await client.post("/v1/messages", data=pieces(over),
                             headers={"Content-Type": "application/json"})
    assert resp.status == 413
    assert (await resp.json())["error"]["type"] == "request_too_large"
    assert len(upstream.received) == 1


def test_default_body_limit_is_the_apis_32_mb():
    config = config_module.parse({"backends": [{"name": "a", "url": "http://x", "models": []}]})
    assert config.max_body_bytes == 32 * 1024 * 1024


@pytest.mark.parametrize("payload,fragment", [
    (b"", "empty"),
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (b'{"model": "claude-test"}', "messages: Field required"),
    (b'{"model": "claude-test", "messages": {"a": 1}}', "messages: Input should be a valid list"),
    (b'{"messages": []}', "model: Field required"),
    (b'{"model": 5, "messages": []}', "model: Input should be a valid string"),
    (b"\xff\xfe\x00garbage", "not valid JSON"),
    # Broken values where the relay reads them: in a structural field, in ``stream``.
    (b'{"model":"claude-test","messages":[{"role":"user","content":[{"type":"tool_result",'
     b'"tool_use_id":"\xff"}]}]}', "not valid JSON"),
    (b'{"model":"claude-test","messages":[{"role":"assistant","content":[{"type":"tool_use",'
     b'"id":1e400,"name":"n","input":{}}]}]}', "not valid JSON"),
    (b'{"model":"claude-test","stream":"\xff","messages":[]}', "not valid JSON"),
    (b'{"model":"claude-test","stream":1e400,"messages":[]}', "not valid JSON"),
    (b'{"model":"claude-test","messages":[],"metadata":' + b"[" * 2000 + b"]" * 2000 + b"}",
     "not valid JSON"),
])
async def test_bad_input_is_a_clear_400(setup, payload, fragment):
    client, upstream = await setup()
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        resp = await client.post(path, data=payload, headers={"Content-Type": "application/json"})
        assert resp.status == 400
        error = await resp.json()
        assert error["error"]["type"] == "invalid_request_error"
        assert fragment in error["error"]["message"]
    assert upstream.received == []


@pytest.mark.parametrize("depth, status", [(900, 200), (1010, 400)])
async def test_a_changed_request_too_deep_to_encode_is_a_400(setup, depth, status):
    # Deeper than the skeleton and the encoder go, not than the full parse: held as a dict,
    # and the rename means it has to be encoded again.
    content = b"[" * depth + b"]" * depth
    raw = (b'{"model":"claude-test","max_tokens":10,"messages":[{"role":"user","content":'
           b'[{"type":"tool_result","tool_use_id":"t","content":' + content + b'}]}]}')
    client, upstream = await setup(rename={"claude-test": "claude-real"})
    resp = await client.post("/v1/messages", data=raw, headers={"Content-Type": "application/json"})
    assert resp.status == status
    if status == 400:
        assert (await resp.json())["error"]["type"] == "invalid_request_error"
        assert upstream.received == []
    else:
        assert orjson.loads(upstream.received[0]["raw"])["model"] == "claude-real"


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_undecodable_body_is_a_400_not_a_500(setup, encoding):
    client, upstream = await setup()
    resp = await client.post("/v1/messages", data=b"not compressed at all",
                             headers={"Content-Encoding": encoding,
                                      "Content-Type": "application/json"})
    assert resp.status == 400
    error = await resp.json()
    assert error["error"]["type"] == "invalid_request_error"
    assert "could not be read" in error["error"]["message"]
    assert upstream.received == []


async def test_headers_named_by_connection_are_hop_by_hop(setup):
    client, upstream = await setup()
    await client.post("/v1/messages", json=BODY,
                      headers={"Connection": "keep-alive, X-Hop", "X-Hop": "1", "X-Kept": "2"})
    headers = upstream.received[0]["headers"]
    assert "X-Hop" not in headers and headers["X-Kept"] == "2"


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308, 300])
@pytest.mark.parametrize("method, path", [("POST", "/v1/messages"), ("GET", "/v1/models")])
async def test_an_upstream_redirect_is_a_502_that_keeps_its_location_from_the_client(
        setup, caplog, status, method, path):
    # A redirect relayed is followed (the SDKs follow them) with the client's x-api-key,
    # which HTTP clients keep across origins: the key and request would go wherever it points.
    async def redirect(request):
        if request.path == "/elsewhere":
            return web.json_response({"followed": True})
        return web.Response(status=status, headers={
            "Location": "https://elsewhere.invalid/collect?token=upstream-secret"})
    upstream = Upstream()
    upstream.reply = redirect
    ended = []

    class Ended:
        @hookimpl
        def relay_exchange_end(self, exchange):
            ended.append(exchange)
    client, _ = await setup(pipeline=["ended"], extra={"ended": Ended()}, upstream=upstream)
    with caplog.at_level(logging.WARNING, logger="relay"):
        resp = await client.request(method, path, json=BODY, headers={"x-api-key": "sk-c"},
                                    allow_redirects=False)
        text = await resp.text()
    assert resp.status == 502 and "Location" not in resp.headers
    assert "elsewhere" not in text and "upstream-secret" not in text
    assert orjson.loads(text)["error"] == {"type": "api_error", "message": (
        f"upstream up answered HTTP {status}, a redirect, which the relay does not follow: "
        "check the backend's url (the relay's log names where it pointed)")}
    assert resp.headers["request-id"] == resp.headers["x-relay-request-id"]
    assert [r["path"] for r in upstream.received] == [path]
    where = "https://elsewhere.invalid/collect?token=upstream-secret"
    [exchange] = ended
    assert exchange.outcome == "upstream_error" and exchange.upstream_response.status == status
    [note] = exchange.noted("relay", "redirect refused")
    assert (note["status"], note["location"]) == (status, where)
    assert any(where in r.getMessage() and exchange.id in r.getMessage()
               for r in caplog.records)


async def test_a_not_modified_answer_is_no_redirect_and_goes_back_as_it_came(setup):
    async def not_modified(request):
        return web.Response(status=304, headers={"ETag": '"v1"'})
    upstream = Upstream()
    upstream.reply = not_modified
    client, _ = await setup(upstream=upstream)
    resp = await client.get("/v1/models", headers={"If-None-Match": '"v1"'})
    assert resp.status == 304 and resp.headers["ETag"] == '"v1"'
    assert upstream.received[0]["headers"]["If-None-Match"] == '"v1"'


async def test_unknown_route_and_method_in_anthropic_format(setup):
    client, _ = await setup()
    resp = await client.get("/nope")
    assert resp.status == 404 and (await resp.json())["error"]["type"] == "not_found_error"
    resp = await client.get("/v1/messages")  # known endpoint, wrong method
    assert resp.status == 405 and (await resp.json())["error"]["type"] == "invalid_request_error"
    resp = await client.get("/v1/other")  # not on the pass-through allowlist
    assert resp.status == 404 and (await resp.json())["error"]["type"] == "not_found_error"
    health = await (await client.get("/healthz")).json()
    assert health["status"] == "ok" and health["backends"] == ["up"]


# --- upstream errors --------------------------------------------------------------------

async def test_upstream_error_comes_back_unmodified(setup):
    body = (b'{"type":"error","error":{"type":"invalid_request_error","message":'
            b'"messages.1: `tool_use` ids must be unique"},  "request_id":"req_x"}')

    async def refuse(request):
        return web.Response(status=400, body=body, content_type="application/json",
                            headers={"request-id": "req_x", "x-should-retry": "false"})
    upstream = Upstream()
    upstream.reply = refuse
    client, _ = await setup(upstream=upstream)
    resp = await client.post("/v1/messages", json=BODY)
    assert resp.status == 400
    assert await resp.read() == body
    assert resp.headers["request-id"] == "req_x" and resp.headers["x-should-retry"] == "false"


async def test_unreachable_upstream_is_502_in_anthropic_format(aiohttp_client, unused_tcp_port):
    client = await start_relay(aiohttp_client, {"backends": [
        {"name": "gone", "url": f"http://127.0.0.1:{unused_tcp_port}", "models": ["*"]}]})
    resp = await client.post("/v1/messages", json=BODY)
    assert resp.status == 502
    error = await resp.json()
    assert error["error"]["type"] == "api_error" and "gone" in error["error"]["message"]


# --- streaming --------------------------------------------------------------------------

async def dying_stream(request):
    """An upstream that dies mid-stream: part of STREAM, then the connection closed."""
    cut = STREAM.index(b"event: content_block_delta")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(STREAM[:cut + 20])
    request.transport.close()
    return resp


def stream_reply(chunks, gate: asyncio.Event | None = None, hold_after: int = 1):
    async def reply(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "request-id": "req_s"})
        await resp.prepare(request)
        for i, chunk in enumerate(chunks):
            if gate is not None and i == hold_after:
                await gate.wait()
            await resp.write(chunk)
        await resp.write_eof()
        return resp
    return reply


async def test_stream_passes_through_byte_for_byte_under_ragged_chunks(setup):
    chunks = [STREAM[i:i + 7] for i in range(0, len(STREAM), 7)]
    upstream = Upstream()
    upstream.reply = stream_reply(chunks)
    client, _ = await setup(upstream=upstream)
    resp = await client.post("/v1/messages", json={**BODY, "stream": True})
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    assert resp.headers["request-id"] == "req_s"
    assert await resp.read() == STREAM


async def test_each_event_is_flushed_at_once(setup):
    gate = asyncio.Event()
    events = STREAM.split(b"\n\n")
    chunks = [event + b"\n\n" for event in events if event]
    upstream = Upstream()
    upstream.reply = stream_reply(chunks, gate=gate, hold_after=1)
    client, _ = await setup(upstream=upstream)
    resp = await client.post("/v1/messages", json={**BODY, "stream": True})
    # The upstream holds the rest back until the first event has reached the client.
    first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
    assert first.startswith(b"event: message_start")
    gate.set()
    rest = await resp.read()
    assert first + rest == STREAM


class Upper:
    """Upper-cases text deltas: the one event it changes is re-serialised, no other."""

    @hookimpl
    def relay_stream_events(self):
        return {"content_block_delta"}

    @hookimpl
    def relay_stream_event(self, event):
        event.data["delta"]["text"] = event.data["delta"]["text"].upper()
        event.mark_changed()


async def test_changed_event_reserialised_others_untouched(setup):
    upstream = Upstream()
    upstream.reply = stream_reply([STREAM[:200], STREAM[200:]])
    client, _ = await setup(pipeline=["upper"], extra={"upper": Upper}, upstream=upstream)
    resp = await client.post("/v1/messages", json={**BODY, "stream": True})
    out = await resp.read()
    before, after = STREAM.split(b"event: content_block_delta")
    assert out.startswith(before)
    assert b'"text":"HELLO"' in out
    assert out.endswith(after[after.index(b"\n\n") + 2:])


async def test_upstream_dying_mid_stream_yields_an_error_event(setup):
    upstream = Upstream()
    upstream.reply = dying_stream
    client, _ = await setup(upstream=upstream)
    resp = await client.post("/v1/messages", json={**BODY, "stream": True})
    out = await resp.read()
    assert out.startswith(STREAM[:STREAM.index(b"event: content_block_delta")])
    last = out.rstrip(b"\n").split(b"\n\n")[-1]
    assert last.startswith(b"event: error\ndata: ")
    error = orjson.loads(last.split(b"data: ", 1)[1])
    assert error["type"] == "error" and error["error"]["type"] == "api_error"


async def test_events_after_message_stop_in_the_same_chunk_are_not_a_truncation(setup):
    upstream = Upstream()
    upstream.reply = stream_reply([STREAM + b'event: ping\ndata: {"type": "ping"}\n\n'])
    client, _ = await setup(upstream=upstream)
    out = await (await client.post("/v1/messages", json={**BODY, "stream": True})).read()
    assert out == STREAM + b'event: ping\ndata: {"type": "ping"}\n\n'


async def test_stream_ending_without_message_stop_is_an_error_not_a_truncation(setup):
    upstream = Upstream()
    upstream.reply = stream_reply([STREAM[:STREAM.index(b"event: message_delta")]])
    client, _ = await setup(upstream=upstream)
    out = await (await client.post("/v1/messages", json={**BODY, "stream": True})).read()
    assert out.rstrip(b"\n").split(b"\n\n")[-1].startswith(b"event: error")


@pytest.mark.parametrize("wanted", [False, True])
@pytest.mark.parametrize("trickle", [False, True])
async def test_an_event_that_never_ends_is_cut_off_with_an_error(setup, monkeypatch, wanted, trickle):
    import relay.stream
    monkeypatch.setattr(relay.stream, "MAX_EVENT_BYTES", 4096)
    start = STREAM[:STREAM.index(b"event: content_block_delta")]
    endless = [b"event: content_block_delta\ndata: {\"text\": \""] + [b"x" * 1000] * 10
    chunks = [start, *endless, b'"}\n\n', STREAM[len(start):]]
    gate = asyncio.Event()  # the event's end comes only once the client has its answer

    async def reply(request):
        # All at once (one read holds the lot), or a read per chunk (the event grows over
        # reads that let nothing out).
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, chunk in enumerate(chunks):
            if i == 1 + len(endless):
                await gate.wait()
            await resp.write(chunk)
            if trickle:
                await asyncio.sleep(0.01)
        await resp.write_eof()
        return resp

    upstream = Upstream()
    upstream.reply = reply
    client, _ = await setup(upstream=upstream, pipeline=["dedup"] if wanted else [])
    resp = await client.post("/v1/messages", json={**BODY, "stream": True})
    out = await asyncio.wait_for(resp.read(), 10)
    gate.set()
    assert out.startswith(start) and b"x" * 1000 not in out
    last = out.rstrip(b"\n").split(b"\n\n")[-1]
    assert last.startswith(b"event: error") and b"grew past 4096 bytes" in last


async def test_client_disconnect_cancels_the_upstream(setup):
    seen = {"written": 0, "closed": asyncio.Event()}

    async def slow(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for _ in range(200):
                await resp.write(b'event: ping\ndata: {"type":"ping"}\n\n')
                seen["written"] += 1
                await asyncio.sleep(0.02)
        except (ConnectionError, asyncio.CancelledError):
            seen["closed"].set()
            raise
        return resp
    upstream = Upstream()
    upstream.reply = slow
    client, _ = await setup(upstream=upstream)
    resp = await client.post("/v1/messages", json={**BODY, "stream": True})
    await resp.content.readuntil(b"\n\n")
    resp.close()  # the client goes away mid-stream
    await asyncio.wait_for(seen["closed"].wait(), 5)
    assert seen["written"] < 200


@pytest.mark.parametrize("framing, sent", [
    (b"Content-Length: 500\r\n", orjson.dumps(BODY)),  # less than it declared
    (b"Transfer-Encoding: chunked\r\n", b"10\r\n" + orjson.dumps(BODY)[:16] + b"\r\n"),
])
async def test_a_client_that_hangs_up_mid_body_ends_its_exchange_without_a_traceback(
        aiohttp_server, aiohttp_client, caplog, framing, sent):
    ended: list = []

    class Ends:
        @hookimpl
        def relay_exchange_end(self, exchange):
            ended.append(exchange.outcome)

    upstream = Upstream()
    server = await start_upstream(aiohttp_server, upstream)
    client = await start_relay(aiohttp_client, {
        "pipeline": ["ends"],
        "backends": [{"name": "up", "url": str(server.make_url("")), "models": ["*"]}]},
        extra={"ends": Ends})
    reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
    writer.write(b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                 b"application/json\r\n" + framing + b"\r\n" + sent)
    await writer.drain()
    writer.write_eof()  # the client is done: the body will never be whole
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()
    for _ in range(100):
        if ended:
            break
        await asyncio.sleep(0.01)
    assert [str(outcome) for outcome in ended] == ["client_disconnected"]
    assert upstream.received == []
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


# --- the chain --------------------------------------------------------------------------

def recorder(name: str, calls: list):
    class Recorder:
        @hookimpl
        def relay_request(self, exchange, options):
            calls.append(("request", name, dict(options)))

        @hookimpl
        async def relay_response(self, exchange, response):
            await asyncio.sleep(0)
            calls.append(("response", name))

        @hookimpl
        def relay_stream_events(self):
            return "*"

        @hookimpl
        async def relay_stream_event(self, event):
            await asyncio.sleep(0)
            calls.append(("event", name, event.name))

        @hookimpl
        def relay_exchange_end(self, exchange):
            calls.append(("end", name, exchange.outcome))
    return Recorder


async def test_yaml_order_up_reverse_order_back(aiohttp_server, aiohttp_client):
    calls: list = []
    upstream = Upstream()
    server = await start_upstream(aiohttp_server, upstream)
    names = ["c", "a", "b"]
    client = await start_relay(aiohttp_client, {
        "pipeline": names,
        "plugins": {"a": {"level": 1, "mode": "x"}},
        "backends": [{"name": "up", "url": str(server.make_url("")), "models": ["*"],
                      "quirks": {"mode": "quirk-wins"}}]},
        extra={n: recorder(n, calls) for n in names})
    await client.post("/v1/messages", json=BODY)
    assert calls == [
        ("request", "c", {"mode": "quirk-wins"}),
        ("request", "a", {"level": 1, "mode": "quirk-wins"}),
        ("request", "b", {"mode": "quirk-wins"}),
        ("response", "b"), ("response", "a"), ("response", "c"),
        ("end", "b", "ok"), ("end", "a", "ok"), ("end", "c", "ok")]
    calls.clear()
    upstream.reply = stream_reply([STREAM])
    await (await client.post("/v1/messages", json={**BODY, "stream": True})).read()
    events = [c for c in calls if c[0] == "event"]
    assert [c[1] for c in events[:3]] == ["b", "a", "c"]
    assert [c[2] for c in events[::3]] == ["message_start", "ping", None, "content_block_start",
                                           "content_block_delta", "brand_new_event",
                                           "content_block_stop", "message_delta", "message_stop"]


class Refuse:
    @hookimpl
    async def relay_request(self, exchange):
        await asyncio.sleep(0)
        if exchange.endpoint == "count_tokens":
            raise RelayError(400, "messages.0: refused by a plugin")


async def test_plugin_rejects_and_count_tokens_goes_through_the_chain(setup):
    client, upstream = await setup(pipeline=["refuse"], extra={"refuse": Refuse})
    resp = await client.post("/v1/messages/count_tokens", json=BODY)
    assert resp.status == 400
    assert (await resp.json())["error"] == {"type": "invalid_request_error",
                                            "message": "messages.0: refused by a plugin"}
    assert upstream.received == []
    assert (await client.post("/v1/messages", json=BODY)).status == 200


class Crash:
    @hookimpl
    def relay_request(self):
        raise KeyError("bug")


async def test_a_crashing_plugin_is_a_500_not_a_dropped_connection(setup):
    calls: list = []
    client, upstream = await setup(pipeline=["crash", "rec"],
                                   extra={"crash": Crash, "rec": recorder("rec", calls)})
    resp = await client.post("/v1/messages", json=BODY)
    assert resp.status == 500
    error = await resp.json()
    assert error["error"]["type"] == "api_error"
    assert error["request_id"] == resp.headers["x-relay-request-id"]
    assert upstream.received == []
    assert calls == [("end", "rec", "relay_error")]


async def test_rejections_carry_the_relay_request_id(setup):
    client, _ = await setup(pipeline=["refuse"], extra={"refuse": Refuse})
    resp = await client.post("/v1/messages/count_tokens", json=BODY)
    assert resp.status == 400
    assert (await resp.json())["request_id"] == resp.headers["x-relay-request-id"]


class BrokenOnTheWayBack:
    @hookimpl
    def relay_response(self, response):
        response.data["content"] = None
        response.mark_changed()
        raise RuntimeError("bug")

    @hookimpl
    def relay_stream_events(self):
        raise RuntimeError("bug")

    @hookimpl
    def relay_stream_event(self, event):
        raise AssertionError("never asked for")


async def test_a_plugin_fault_on_the_way_back_never_costs_the_answer(setup):
    client, upstream = await setup(pipeline=["broken"], extra={"broken": BrokenOnTheWayBack})
    resp = await client.post("/v1/messages", json=BODY)
    assert resp.status == 200 and await resp.json() == ANSWER
    upstream.reply = stream_reply([STREAM])
    resp = await client.post("/v1/messages", json={**BODY, "stream": True})
    assert await resp.read() == STREAM


async def test_stream_without_space_after_event_colon_still_reaches_plugins(setup):
    tight = STREAM.replace(b"event: ", b"event:")
    upstream = Upstream()
    upstream.reply = stream_reply([tight])
    client, _ = await setup(pipeline=["upper"], extra={"upper": Upper}, upstream=upstream)
    out = await (await client.post("/v1/messages", json={**BODY, "stream": True})).read()
    assert b'"text":"HELLO"' in out and b"event: error" not in out


async def test_one_log_line_per_exchange(setup, caplog):
    client, _ = await setup(pipeline=["refuse"], extra={"refuse": Refuse})
    with caplog.at_level("INFO", logger="relay.access"):
        ok = await client.post("/v1/messages", json=BODY)
        refused = await client.post("/v1/messages/count_tokens", json=BODY)
    lines = [r.getMessage() for r in caplog.records if r.name == "relay.access"]
    assert len(lines) == 2
    assert lines[0].startswith(ok.headers["x-relay-request-id"] + " messages model=claude-test "
                               "backend=up status=200 outcome=ok")
    assert lines[1].startswith(refused.headers["x-relay-request-id"] + " count_tokens")
    assert "status=400 outcome=rejected" in lines[1]


async def test_connection_dropping_after_a_complete_stream_is_not_an_error(setup):
    async def complete_then_drop(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(STREAM)
        request.transport.close()  # no final chunk: the body never ends properly
        return resp
    upstream = Upstream()
    upstream.reply = complete_then_drop
    client, _ = await setup(upstream=upstream)
    out = await (await client.post("/v1/messages", json={**BODY, "stream": True})).read()
    assert out == STREAM


class StopWatcher:
    seen: list = []

    @hookimpl
    def relay_stream_events(self):
        return "message_stop"  # a bare name is one name, not its letters

    @hookimpl
    def relay_stream_event(self, event):
        StopWatcher.seen.append(event.name)


async def test_a_last_event_without_its_blank_line_still_reaches_plugins(setup):
    StopWatcher.seen = []
    upstream = Upstream()
    upstream.reply = stream_reply([STREAM[:-2]])
    client, _ = await setup(pipeline=["watch"], extra={"watch": StopWatcher}, upstream=upstream)
    out = await (await client.post("/v1/messages", json={**BODY, "stream": True})).read()
    assert StopWatcher.seen == ["message_stop"]
    assert out == STREAM


async def test_an_event_cut_in_half_is_not_forwarded_half(setup):
    cut = STREAM.index(b'"stop_reason":"end_turn"')
    upstream = Upstream()
    upstream.reply = stream_reply([STREAM[:cut]])  # ends cleanly, mid-event
    client, _ = await setup(upstream=upstream)
    out = await (await client.post("/v1/messages", json={**BODY, "stream": True})).read()
    complete = STREAM[:STREAM.index(b"event: message_delta")]
    assert out.startswith(complete)
    assert out[len(complete):].startswith(b"event: error\ndata: ")


class OddNames:
    @hookimpl
    def relay_stream_events(self):
        return {None, b"ping"}

    @hookimpl
    def relay_stream_event(self, event):
        raise AssertionError("asked for nothing usable")


async def test_unusable_event_names_are_ignored_not_fatal(setup):
    upstream = Upstream()
    upstream.reply = stream_reply([STREAM])
    client, _ = await setup(pipeline=["odd"], extra={"odd": OddNames}, upstream=upstream)
    assert await (await client.post("/v1/messages", json={**BODY, "stream": True})).read() == STREAM


class Renamer:
    """Changes the request, then looks at it again once the answer is in."""
    seen: list = []

    @hookimpl
    def relay_request(self, exchange):
        exchange.body["messages"][0]["content"] = "changed by a plugin"
        exchange.mark_changed()

    @hookimpl
    def relay_exchange_end(self, exchange):
        Renamer.seen.append((exchange._body, exchange.body))


async def test_the_parsed_request_is_let_go_once_sent_and_reread_on_demand(setup):
    Renamer.seen = []
    client, upstream = await setup(pipeline=["renamer"], extra={"renamer": Renamer})
    assert (await client.post("/v1/messages", json=BODY)).status == 200
    released, reread = Renamer.seen[0]
    assert released is None  # nothing held the parsed history while the upstream worked
    assert reread == orjson.loads(upstream.received[0]["raw"])
    assert reread["messages"][0]["content"] == "changed by a plugin"


@pytest.mark.parametrize("pipeline, ends", [((), 0), (("dedup", "pairing", "ordering"), 0),
                                            (("dedup", "metrics"), 2)])
async def test_the_end_hooks_cost_only_a_pipeline_that_has_them(setup, monkeypatch, pipeline,
                                                                ends):
    """Pay for what is configured: the end-of-exchange loop runs only where a plugin has an
    end hook (dedup, pairing and ordering have none)."""
    from relay.chain import Chain

    ran = []
    original = Chain.end

    async def counted(self, exchange):
        ran.append(exchange.id)
        await original(self, exchange)

    monkeypatch.setattr(Chain, "end", counted)
    client, _ = await setup(pipeline=pipeline)
    assert (await client.post("/v1/messages", json=BODY)).status == 200
    assert (await (await client.post("/v1/messages", json={**BODY, "stream": True})).read())
    assert len(ran) == ends
