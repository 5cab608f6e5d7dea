"""What a shared gateway must refuse: no open proxy, strict routing, bounded resources, no
silent cuts. Each test fails against a relay that lacks the guard it names."""

from __future__ import annotations

import asyncio
import gzip
import logging
import socket
import subprocess
import sys
import time

import orjson
import pytest
from aiohttp import web
from support import ROOT, Process, backend
from test_server import (  # noqa: F401
    ANSWER,
    BODY,
    STREAM,
    Upstream,
    setup,
    start_relay,
    start_upstream,
    stream_reply,
)

from relay import config as config_module
from relay.errors import RelayError
from relay.hookspecs import hookimpl
from relay.inbound import check_target, host_allowed

KEY_A = "relay-key-alpha-0123456789abcdef"
KEY_B = "relay-key-bravo-0123456789abcdef"
BACKEND_KEY = "sk-operator-secret-0123456789abcdef"
ENV = {"KEY_A": KEY_A, "KEY_B": KEY_B, "UP_KEY": BACKEND_KEY}


def is_anthropic_error(doc: dict, status: int) -> bool:
    from relay.errors import STATUS_TYPES
    expected = {STATUS_TYPES[status]} if status in STATUS_TYPES else set(STATUS_TYPES.values())
    return (doc.get("type") == "error" and isinstance(doc.get("error"), dict)
            and doc["error"].get("type") in expected
            and isinstance(doc["error"].get("message"), str))


async def raw_request(client, data: bytes, read_timeout: float = 5.0) -> tuple[int, dict, bytes]:
    """Send ``data`` as it is (no client normalises it) and read one answer."""
    reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
    try:
        writer.write(data)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), read_timeout)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        body = b""
        if "content-length" in headers:
            body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])),
                                          read_timeout)
        return status, headers, body
    finally:
        writer.close()


def request_bytes(method: str, target: str, body: bytes = b"", host: str = "127.0.0.1",
                  headers: dict | None = None) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}", "Connection: close"]
    if body or method == "POST":
        lines.append(f"Content-Length: {len(body)}")
    if headers is None:
        headers = {"Content-Type": "application/json"}
    for name, value in headers.items():
        lines.append(f"{name}: {value}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


@pytest.fixture
async def guarded(aiohttp_server, aiohttp_client):
    """A relay with inbound keys in front of a keyed backend, and its upstream."""
    async def make(keys=None, server=None, **backend_extra):
        upstream = Upstream()
        up = await start_upstream(aiohttp_server, upstream)
        raw = {"server": {"auth": {"keys": keys or [
                   {"name": "alpha", "key_env": "KEY_A"},
                   {"name": "bravo", "key_env": "KEY_B", "models": ["claude-haiku-*"]}]},
                   **(server or {})},
               "backends": [{k: v for k, v in {
                   "name": "up", "url": str(up.make_url("")), "models": ["claude-*"],
                   "api_key_env": "UP_KEY", **backend_extra}.items() if v is not None}]}
        return await start_relay(aiohttp_client, raw, env=ENV), upstream
    return make


# --- inbound keys ----------------------------------------------------------------------------

@pytest.mark.parametrize("headers", [{}, {"x-api-key": "wrong-key-0123456789abcdef"},
                                     {"Authorization": "Bearer wrong-key-0123456789"},
                                     {"Authorization": "Basic " + KEY_A},
                                     {"x-api-key": KEY_A[:-1]}])
async def test_missing_or_wrong_key_is_401_and_nothing_goes_up(guarded, headers):
    client, upstream = await guarded()
    resp = await client.post("/v1/messages", json=BODY, headers=headers)
    assert resp.status == 401 and is_anthropic_error(await resp.json(), 401)
    resp = await client.get("/v1/models", headers=headers)
    assert resp.status == 401
    assert upstream.received == []


@pytest.mark.parametrize("headers", [{"x-api-key": KEY_A}, {"Authorization": "Bearer " + KEY_A}])
async def test_a_relay_key_is_accepted_and_never_forwarded(guarded, headers):
    client, upstream = await guarded()
    resp = await client.post("/v1/messages", json=BODY, headers=headers)
    assert resp.status == 200
    sent = upstream.received[0]["headers"]
    assert sent["x-api-key"] == BACKEND_KEY and "Authorization" not in sent
    assert KEY_A not in str(dict(sent))


async def test_without_a_backend_key_the_relay_key_still_stays_home(guarded):
    client, upstream = await guarded(api_key_env=None)
    assert (await client.post("/v1/messages", json=BODY, headers={"x-api-key": KEY_A})).status == 200
    sent = upstream.received[0]["headers"]
    assert "x-api-key" not in sent and "Authorization" not in sent


async def test_an_upstreams_cookie_goes_back_to_its_client_and_never_up_with_anothers(
        aiohttp_server, aiohttp_client):
    # By a host name: aiohttp's cookie jar keeps no cookie from an IP address.
    upstream = Upstream()
    up = await start_upstream(aiohttp_server, upstream)
    raw = {"server": {"auth": {"keys": [{"name": "alpha", "key_env": "KEY_A"},
                                        {"name": "bravo", "key_env": "KEY_B"}]}},
           "backends": [{"name": "up", "url": f"http://localhost:{up.port}",
                         "models": ["claude-*"], "api_key_env": "UP_KEY"}]}
    client = await start_relay(aiohttp_client, raw, env=ENV)
    client.session.cookie_jar.clear()

    async def reply(request):
        return web.json_response(ANSWER, headers={"Set-Cookie": "__cf_bm=alpha; Path=/"})
    upstream.reply = reply
    first = await client.post("/v1/messages", json=BODY, headers={"x-api-key": KEY_A})
    assert first.status == 200 and first.headers["Set-Cookie"] == "__cf_bm=alpha; Path=/"
    client.session.cookie_jar.clear()  # the test client is not the other tenant's browser
    second = await client.post("/v1/messages", json=BODY, headers={"x-api-key": KEY_B})
    assert second.status == 200
    assert "Cookie" not in upstream.received[1]["headers"]
    # A client's own cookie is an end-to-end header like any other.
    third = await client.post("/v1/messages", json=BODY,
                              headers={"x-api-key": KEY_A, "Cookie": "__cf_bm=alpha"})
    assert third.status == 200 and upstream.received[2]["headers"]["Cookie"] == "__cf_bm=alpha"


async def test_a_key_may_be_limited_to_models_and_backends(guarded):
    client, upstream = await guarded()
    resp = await client.post("/v1/messages", json=BODY, headers={"x-api-key": KEY_B})
    assert resp.status == 403 and is_anthropic_error(await resp.json(), 403)
    assert upstream.received == []
    resp = await client.post("/v1/messages", json={**BODY, "model": "claude-haiku-4-5"},
                             headers={"x-api-key": KEY_B})
    assert resp.status == 200
    client, upstream = await guarded(keys=[{"name": "other", "key_env": "KEY_A",
                                            "backends": ["elsewhere"]}])
    for resp in (await client.post("/v1/messages", json=BODY, headers={"x-api-key": KEY_A}),
                 await client.get("/v1/models", headers={"x-api-key": KEY_A})):
        assert resp.status == 403
    assert upstream.received == []


def test_keys_come_from_the_environment_or_a_file_never_from_the_yaml(tmp_path):
    def parse(keys, env=ENV):
        return config_module.parse({"server": {"auth": {"keys": keys}},
                                    "backends": [backend("http://127.0.0.1:1")]}, env)
    with pytest.raises(config_module.ConfigError, match=r"keys\[0\]\.key: unknown key"):
        parse([{"name": "a", "key": KEY_A}])
    with pytest.raises(config_module.ConfigError, match="exactly one of key_env or key_file"):
        parse([{"name": "a"}])
    with pytest.raises(config_module.ConfigError, match="KEY_Z is not set"):
        parse([{"name": "a", "key_env": "KEY_Z"}])
    with pytest.raises(config_module.ConfigError, match="at least 16"):
        parse([{"name": "a", "key_env": "SHORT"}], {"SHORT": "abc"})
    path = tmp_path / "key"
    path.write_text(KEY_B + "\n")
    config = parse([{"name": "f", "key_file": str(path)}])
    assert config.keys[0].secret == KEY_B and KEY_B not in repr(config.keys[0])


# --- fail safe ---------------------------------------------------------------------------------

def test_no_listening_beyond_loopback_with_an_operator_key_and_no_auth():
    config = config_module.parse({"backends": [backend("http://127.0.0.1:1", api_key_env="UP_KEY")]},
                                 ENV)
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        config_module.check_exposure(config, host)
    for host in ("0.0.0.0", "::", "192.0.2.7"):
        with pytest.raises(config_module.ConfigError, match="allow_unauthenticated"):
            config_module.check_exposure(config, host)
    config.allow_unauthenticated = True
    config_module.check_exposure(config, "0.0.0.0")
    unkeyed = config_module.parse({"backends": [backend("http://127.0.0.1:1")]}, ENV)
    config_module.check_exposure(unkeyed, "0.0.0.0")  # the client's own key goes up


@pytest.mark.slow
def test_the_cli_refuses_to_start_before_listening(tmp_path):
    (tmp_path / "relay.yaml").write_text(
        "backends:\n  - {name: up, url: 'http://127.0.0.1:1', models: ['*'], api_key_env: UP_KEY}\n")
    done = subprocess.run([sys.executable, "-m", "relay", "--config", "relay.yaml",
                           "--host", "0.0.0.0", "--port", "0"], cwd=tmp_path,
                          env={"UP_KEY": BACKEND_KEY, "PATH": "/usr/bin:/bin",
                               "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "listening" not in done.stdout
    assert "server.host" in done.stderr and "allow_unauthenticated" in done.stderr
    assert "Traceback" not in done.stderr and BACKEND_KEY not in done.stderr


def test_the_host_flag_is_the_address_the_relay_answers_to(tmp_path, monkeypatch):
    # As server.host in relay.yaml: a client that reaches the relay at the address it was
    # told to listen on (with auth off) names it in its Host header.
    import logging as logging_module

    from relay import cli, listen, server
    from relay.inbound import host_allowed

    (tmp_path / "relay.yaml").write_text(
        "backends:\n  - {name: up, url: 'http://127.0.0.1:1', models: ['*']}\n")
    seen = {}

    async def serve(config, chain, host, port, worker=None):
        seen.update(host=host, allowed=host_allowed("relay.internal:8787", config))
        return 0

    monkeypatch.setattr(server, "serve", serve)
    monkeypatch.setattr(listen, "fit_open_files", lambda *limits: (True, ""))
    monkeypatch.setenv("RELAY_WORKERS", "1")
    root = logging_module.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        assert cli.main(["--config", str(tmp_path / "relay.yaml"), "--host",
                         "relay.internal", "--port", "0"]) == 0
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    assert seen == {"host": "relay.internal", "allowed": True}


# --- browser-shaped requests -------------------------------------------------------------------

@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
async def test_json_endpoints_want_json(aiohttp_server, aiohttp_client, content_type):
    upstream = Upstream()
    up = await start_upstream(aiohttp_server, upstream)
    client = await start_relay(aiohttp_client, {"backends": [backend(str(up.make_url("")),
                                                                     api_key_env="UP_KEY")]}, env=ENV)
    headers = {"Content-Type": content_type} if content_type else {}
    status, _, body = await raw_request(client, request_bytes(
        "POST", "/v1/messages", orjson.dumps(BODY), headers=headers))
    assert status == 400 and is_anthropic_error(orjson.loads(body), 400)
    assert upstream.received == []


@pytest.mark.parametrize("host", ["evil.example", "attacker.test:8787", "127.0.0.1.nip.example",
                                  "relay.internal"])
async def test_without_auth_only_hosts_that_name_the_relay(aiohttp_server, aiohttp_client, host):
    upstream = Upstream()
    up = await start_upstream(aiohttp_server, upstream)
    client = await start_relay(aiohttp_client, {
        "server": {"allowed_hosts": ["relay.example.com"]},
        "backends": [backend(str(up.make_url("")), api_key_env="UP_KEY")]}, env=ENV)
    status, _, body = await raw_request(client, request_bytes(
        "POST", "/v1/messages", orjson.dumps(BODY), host=host))
    assert status == 403 and is_anthropic_error(orjson.loads(body), 403)
    for good in ("127.0.0.1:8787", "localhost", "[::1]:8787", "relay.example.com"):
        status, _, _ = await raw_request(client, request_bytes(
            "POST", "/v1/messages", orjson.dumps(BODY), host=good))
        assert status == 200, good
    assert len(upstream.received) == 4


def test_host_names_that_are_not_the_relay():
    config = config_module.parse({"backends": [backend("http://127.0.0.1:1")]})
    assert host_allowed("127.9.9.9:1", config) and host_allowed("LOCALHOST:80", config)
    assert not host_allowed("127.0.0.1.evil.example", config)
    assert not host_allowed("[::1].evil", config) and not host_allowed("0x7f000001", config)


async def test_with_auth_any_host_may_be_used(guarded):
    client, _ = await guarded()
    status, _, _ = await raw_request(client, request_bytes(
        "POST", "/v1/messages", orjson.dumps(BODY), host="relay.example.net",
        headers={"Content-Type": "application/json", "x-api-key": KEY_A}))
    assert status == 200


# --- strict routing ----------------------------------------------------------------------------

ESCAPES = ["/v1/%2e%2e/%2e%2e/admin/keys", "/v1/%2E%2E/admin", "/v1/models/%2f..%2fadmin",
           "/v1/./messages", "/v1/x/../messages", "/v1/messages%3Fbeta=true",
           "/v1/messages%23x", "/v1//messages", "/v1/models;x=y", "/v1/models/..",
           "/v1/models/a%00b", "/v1/models\\..\\admin", "http://evil.example/v1/models",
           "//evil.example/v1/models"]


@pytest.mark.parametrize("target", ESCAPES)
@pytest.mark.parametrize("method", ["GET", "POST"])
async def test_paths_that_could_escape_are_refused_and_nothing_goes_up(
        aiohttp_server, aiohttp_client, target, method):
    upstream = Upstream()
    up = await start_upstream(aiohttp_server, upstream)
    client = await start_relay(aiohttp_client, {"backends": [
        backend(str(up.make_url("/base")), api_key_env="UP_KEY")]}, env=ENV)
    status, _, body = await raw_request(client, request_bytes(
        method, target, orjson.dumps(BODY) if method == "POST" else b""))
    assert status in (400, 404, 405), (target, status)
    assert is_anthropic_error(orjson.loads(body), status)
    assert upstream.received == []


@pytest.mark.parametrize("method,target,status", [
    ("GET", "/v1/messages", 405), ("PUT", "/v1/messages", 405), ("DELETE", "/v1/messages", 405),
    ("POST", "/v1/messages/", 400), ("GET", "/v1/messages/batches", 404),
    ("POST", "/v1/models", 405), ("GET", "/v1/files", 404), ("GET", "/admin", 404),
    ("GET", "/v1/models/a/b", 404)])
async def test_known_endpoints_answer_their_methods_and_passthrough_is_an_allowlist(
        setup, method, target, status):
    client, upstream = await setup(pipeline=("dedup", "pairing", "ordering"))
    got, _, body = await raw_request(client, request_bytes(
        method, target, orjson.dumps(BODY) if method in ("POST", "PUT") else b""))
    assert got == status and is_anthropic_error(orjson.loads(body), status)
    assert upstream.received == []


async def test_passthrough_allowlist_serves_models_under_the_base_path(aiohttp_server,
                                                                      aiohttp_client):
    upstream = Upstream()
    up = await start_upstream(aiohttp_server, upstream)
    client = await start_relay(aiohttp_client, {
        "server": {"passthrough": ["GET /v1/models", "GET /v1/models/*", "POST /v1/extra/*"]},
        "backends": [backend(str(up.make_url("/base/")))]})
    for method, target in (("GET", "/v1/models?limit=5"), ("GET", "/v1/models/claude-x"),
                           ("POST", "/v1/extra/thing")):
        status, _, _ = await raw_request(client, request_bytes(method, target,
                                                                b"{}" if method == "POST" else b""))
        assert status == 200, target
    assert [(r["method"], r["path"], r["query"]) for r in upstream.received] == [
        ("GET", "/base/v1/models", "limit=5"), ("GET", "/base/v1/models/claude-x", ""),
        ("POST", "/base/v1/extra/thing", "")]


async def test_a_base_url_s_own_query_goes_up_ahead_of_the_client_s(aiohttp_server,
                                                                   aiohttp_client):
    # Azure's endpoints take ?api-version=... on every request: it went up glued to the path.
    upstream = Upstream()
    up = await start_upstream(aiohttp_server, upstream)
    client = await start_relay(aiohttp_client, {"backends": [
        backend(str(up.make_url("/base/")) + "?api-version=2025-01-01")]})
    for target in ("/v1/messages", "/v1/messages?beta=true"):
        status, _, _ = await raw_request(client, request_bytes("POST", target,
                                                                orjson.dumps(BODY)))
        assert status == 200, target
    assert [(r["path"], r["query"]) for r in upstream.received] == [
        ("/base/v1/messages", "api-version=2025-01-01"),
        ("/base/v1/messages", "api-version=2025-01-01&beta=true")]
    with pytest.raises(config_module.ConfigError, match="fragment"):
        config_module.parse({"backends": [backend("http://127.0.0.1:1/a#frag")]})


def test_passthrough_entries_are_checked():
    for bad in ["/admin", "GET /v1/../admin", "get /v1/models", "GET /v1/%2e/x", "GET /v1//x"]:
        with pytest.raises(config_module.ConfigError, match="server.passthrough"):
            config_module.parse({"server": {"passthrough": [bad]},
                                 "backends": [backend("http://127.0.0.1:1")]})


async def test_the_query_goes_up_exactly_as_sent(setup):
    client, upstream = await setup()
    status, _, _ = await raw_request(client, request_bytes(
        "POST", "/v1/messages?q=a%23b&beta=true&x=%2F", orjson.dumps(BODY)))
    assert status == 200
    sent = upstream.received[0]
    assert sent["path"] == "/v1/messages"
    # aiohttp decodes query_string; the raw target shows the bytes that went up
    assert sent["query"] == "q=a#b&beta=true&x=/"
    status, _, _ = await raw_request(client, request_bytes("POST", "/v1/messages?a=<b>",
                                                           orjson.dumps(BODY)))
    assert status == 400 and len(upstream.received) == 1


def test_check_target_keeps_plain_paths():
    assert check_target("/v1/models/claude-sonnet-4-5@20250929", "beta=true") == [
        "v1", "models", "claude-sonnet-4-5@20250929"]
    with pytest.raises(RelayError):
        check_target("/v1/models/%41", "")


# --- bounded resources ---------------------------------------------------------------------------

async def test_a_declared_length_over_the_limit_is_refused_before_reading(aiohttp_server,
                                                                         aiohttp_client):
    upstream = Upstream()
    up = await start_upstream(aiohttp_server, upstream)
    client = await start_relay(aiohttp_client, {"server": {"max_body_bytes": 1000},
                                                "backends": [backend(str(up.make_url("")))]})
    reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
    writer.write(b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                 b"\r\nContent-Length: 5000000000\r\n\r\n{")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)  # no body was sent
    assert head.startswith(b"HTTP/1.1 413")
    writer.close()
    assert upstream.received == []


async def expecting(client, target: str, headers: str, body: bytes) -> list[bytes]:
    """The answers to a request that asks ``Expect: 100-continue``, its body sent only once
    the relay says 100, as curl does for bodies over 1 MB: the interim answer's head, if
    any, then the final answer's head and body."""
    reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
    try:
        writer.write(f"POST {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                     f"Expect: 100-continue\r\n{headers}\r\n".encode())
        first = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        if not first.startswith(b"HTTP/1.1 100 "):
            return [first, await asyncio.wait_for(reader.read(), 5)]
        writer.write(body)
        return [first, *(await asyncio.wait_for(reader.read(), 5)).split(b"\r\n\r\n", 1)]
    finally:
        writer.close()


@pytest.mark.parametrize("target, headers", [
    ("/v1/messages", "Content-Type: text/plain\r\nContent-Length: 82\r\n"),
    ("/v1/messages", "Content-Type: application/json\r\nContent-Length: 5000000000\r\n"),
    ("/v1/nope", "Content-Type: application/json\r\nContent-Length: 82\r\n"),
])
async def test_a_request_refused_on_its_headers_is_answered_without_a_100(
        aiohttp_server, aiohttp_client, target, headers):
    # RFC 9110, 10.1.1: a final status its headers decide goes at once, not after a 100 that
    # has the client send a body only for it to be thrown away.
    upstream = Upstream()
    up = await start_upstream(aiohttp_server, upstream)
    client = await start_relay(aiohttp_client, {"server": {"max_body_bytes": 1000},
                                                "backends": [backend(str(up.make_url("")))]})
    head, body = await expecting(client, target, headers, orjson.dumps(BODY))
    status = int(head.split()[1])
    assert status in (400, 404, 413) and is_anthropic_error(orjson.loads(body), status)
    assert upstream.received == []


@pytest.mark.parametrize("expect, interim", [("100-continue", True), ("100-Continue", True),
                                             ("something-else", False)])
async def test_an_expectation_is_met_or_ignored_never_a_plain_text_417(setup, expect, interim):
    # aiohttp answers an expectation it does not know with a plain-text 417; RFC 9110 lets a
    # server ignore it, and nothing shows the API refusing one.
    client, upstream = await setup()
    payload = orjson.dumps(BODY)
    headers = f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
    if interim:
        answers = await expecting(client, "/v1/messages", headers, payload)
        assert answers[0] == b"HTTP/1.1 100 Continue\r\n\r\n"
        head = answers[1]
    else:
        status, _, _ = await raw_request(client, request_bytes(
            "POST", "/v1/messages", payload,
            headers={"Content-Type": "application/json", "Expect": expect}))
        head = f"HTTP/1.1 {status}".encode()
    assert head.startswith(b"HTTP/1.1 200")
    assert upstream.received[0]["raw"] == payload


async def test_a_body_that_stalls_gets_408(aiohttp_server, aiohttp_client):
    upstream = Upstream()
    up = await start_upstream(aiohttp_server, upstream)
    client = await start_relay(aiohttp_client, {"server": {"body_timeout": 0.5},
                                                "backends": [backend(str(up.make_url("")))]})
    reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
    writer.write(b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                 b"\r\nContent-Length: 100\r\n\r\n{\"model\"")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 408")
    writer.close()
    assert upstream.received == []


async def test_absurd_model_names_are_refused_and_the_route_cache_stays_small(setup):
    client, upstream = await setup()
    resp = await client.post("/v1/messages", json={**BODY, "model": "claude-" + "x" * 5_000_000})
    assert resp.status == 400 and "at most 256" in (await resp.json())["error"]["message"]
    config = config_module.parse({"backends": [backend("http://127.0.0.1:1")]})
    for i in range(5000):
        config.backend_for(f"claude-{i:0250d}")
    assert config._routes_bytes <= config_module.ROUTE_CACHE_BYTES
    assert upstream.received == []


async def test_a_huge_upstream_answer_is_502_not_memory(aiohttp_server, aiohttp_client):
    bomb = gzip.compress(b"{" + b" " * 20_000_000 + b"}")

    async def reply(request):
        return web.Response(body=bomb, headers={"Content-Encoding": "gzip",
                                                "Content-Type": "application/json"})
    upstream = Upstream()
    upstream.reply = reply
    up = await start_upstream(aiohttp_server, upstream)
    client = await start_relay(aiohttp_client, {
        "server": {"max_upstream_body_bytes": 1_000_000},
        "backends": [backend(str(up.make_url("")))]})
    resp = await client.post("/v1/messages", json=BODY)
    assert resp.status == 502 and is_anthropic_error(await resp.json(), 502)
    assert "max_upstream_body_bytes" in (await resp.json())["error"]["message"]


# --- never a silent cut, never a raw 500 -------------------------------------------------------

class Unencodable:
    """A plugin that leaves data orjson cannot encode."""

    @hookimpl
    def relay_response(self, response):
        response.data["content"].append({"type": "text", "text": object()})
        response.mark_changed()

    @hookimpl
    def relay_stream_events(self):
        return {"content_block_delta"}

    @hookimpl
    def relay_stream_event(self, event):
        event.data["delta"]["text"] = {1, 2}
        event.mark_changed()


async def test_an_unencodable_answer_sends_the_upstreams_own(setup):
    client, _ = await setup(pipeline=("bad",), extra={"bad": Unencodable()})
    resp = await client.post("/v1/messages", json=BODY)
    assert resp.status == 200 and await resp.json() == ANSWER


async def test_a_stream_loop_fault_ends_with_an_error_event(setup):
    upstream = Upstream()
    upstream.reply = stream_reply([STREAM])
    client, _ = await setup(pipeline=("bad",), extra={"bad": Unencodable()}, upstream=upstream)
    resp = await client.post("/v1/messages", json={**BODY, "stream": True})
    text = await resp.read()
    assert resp.status == 200
    assert text.rstrip().endswith(b'"type":"api_error","message":"the relay failed while '
                                  b'relaying this stream"}}')
    assert b"event: error" in text and b"message_stop" not in text


DATA_ONLY = b"".join(
    b"data: " + orjson.dumps(event) + b"\n\n" for event in [
        {"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant",
                                              "content": [], "model": "m", "stop_reason": None,
                                              "usage": {"input_tokens": 1, "output_tokens": 0}}},
        {"type": "content_block_start", "index": 0,
         "content_block": {"type": "tool_use", "id": "toolu_same", "name": "Bash", "input": {}}},
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 1}},
        {"type": "message_stop"}])


async def test_data_only_streams_are_framed_by_type(setup):
    upstream = Upstream()
    upstream.reply = stream_reply([DATA_ONLY[:40], DATA_ONLY[40:]])
    client, _ = await setup(pipeline=("dedup",), upstream=upstream)
    history = {**BODY, "stream": True, "messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_same", "name": "Bash",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_same",
                                      "content": "ok"}]}]}
    resp = await client.post("/v1/messages", json=history)
    text = await resp.read()
    assert b"event: error" not in text
    names = [line for line in text.split(b"\n") if line.startswith(b"event:")]
    assert names == [b"event: message_start", b"event: content_block_start",
                     b"event: content_block_stop", b"event: message_delta", b"event: message_stop"]
    assert b'"toolu_same-2"' in text  # the repeated id was seen and rewritten


# --- the listening socket (a real relay process) ---------------------------------------------------

def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def read_answer(sock: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return data


@pytest.fixture
def small_relay(relay, emulator):
    emu = emulator()
    return relay({"server": {"header_timeout": 1, "max_connections": 20, "access_log": True},
                  "backends": [backend(emu.url)]})


@pytest.mark.parametrize("head,fragment", [
    (b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Encoding: br\r\n"
     b"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}", None),
    (b"FROB /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", None),
    (b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: bogus\r\n\r\n", None),
    (b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Long: " + b"a" * 20000 + b"\r\n\r\n", None),
])
def test_requests_aiohttp_cannot_parse_are_answered_in_anthropic_format(small_relay, head,
                                                                        fragment):
    with connect(small_relay.url) as sock:
        sock.sendall(head)
        answer = read_answer(sock)
    status = int(answer.split(b" ", 2)[1])
    assert 400 <= status < 500, answer[:200]
    body = answer.split(b"\r\n\r\n", 1)[1]
    assert b"application/json" in answer.split(b"\r\n\r\n", 1)[0].lower()
    assert is_anthropic_error(orjson.loads(body), status)
    assert "Traceback" not in small_relay.output()


@pytest.mark.parametrize("content_type, declared", [
    (b"text/plain", 400_000),  # refused for its type, before its body is read
    (b"application/json", 200 * 1024 * 1024),  # refused for its declared size (413)
])
def test_a_client_still_sending_a_refused_body_can_finish_and_read_the_answer(
        small_relay, content_type, declared):
    # The answer goes before the body is read. Closed at once, the connection would answer
    # the client's next writes with a reset, which a client may report instead of the answer
    # (RFC 9112, 9.6): the relay reads on, for a while, what is still coming.
    with connect(small_relay.url) as sock:
        sock.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                     + content_type + b"\r\nContent-Length: " + str(declared).encode()
                     + b"\r\n\r\n")
        head = b""
        while b"\r\n\r\n" not in head:
            head += sock.recv(65536)
        assert head.startswith(b"HTTP/1.1 413" if declared > 1e6 else b"HTTP/1.1 400")
        for _ in range(24):  # 384 KiB, still arriving after the answer
            sock.sendall(b"x" * 16384)
            time.sleep(0.02)
        assert read_answer(sock).count(b"HTTP/1.1") == 0  # nothing more, then closed
    assert "Traceback" not in small_relay.output()


def test_half_sent_headers_are_dropped_after_the_header_timeout(small_relay):
    with connect(small_relay.url) as sock:
        sock.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        started = time.monotonic()
        assert read_answer(sock) == b""  # closed, not answered
        assert time.monotonic() - started < 8


def test_connections_past_the_cap_get_a_clean_529_and_service_resumes(small_relay):
    held = [connect(small_relay.url) for _ in range(20)]
    time.sleep(0.3)
    with connect(small_relay.url) as extra:
        answer = read_answer(extra)
    assert answer.startswith(b"HTTP/1.1 529")
    assert is_anthropic_error(orjson.loads(answer.split(b"\r\n\r\n", 1)[1]), 529)
    for sock in held:
        sock.close()
    deadline = time.monotonic() + 5
    while True:
        with connect(small_relay.url) as sock:
            sock.sendall(request_bytes("POST", "/v1/messages", orjson.dumps(BODY)))
            answer = read_answer(sock)
        if answer.startswith(b"HTTP/1.1 200") or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert answer.startswith(b"HTTP/1.1 200")
    assert "Traceback" not in small_relay.output()


def test_a_relay_out_of_file_descriptors_says_so_once_and_serves_again(tmp_path, emulator):
    # asyncio logs every failed accept with a traceback, up to the backlog's 1,024 a wake-up
    # (python/cpython#151615): thousands of lines a second until connections close.
    emu = emulator()
    config = tmp_path / "relay.yaml"
    config.write_text(orjson.dumps({"backends": [backend(emu.url)]}).decode())
    server = Process(["sh", "-c", 'ulimit -n 64 && exec "$@"', "sh", sys.executable, "-m",
                      "relay", "--config", str(config), "--port", "0"], cwd=str(tmp_path))
    try:
        url = server.wait_ready(20, "relay")
        # It says at start-up that the connections it is configured for cannot all be had.
        assert "open files: this process may have 64 open (ulimit -n)" in server.output()
        held = []
        for _ in range(80):
            held.append(connect(url))
        assert server.wait_for_output("cannot accept connections: Too many open files")
        time.sleep(1.5)  # asyncio's retries, once a second
        for sock in held:
            sock.close()
        deadline = time.monotonic() + 10
        while True:
            with connect(url) as sock:
                sock.sendall(request_bytes("POST", "/v1/messages", orjson.dumps(BODY)))
                answer = read_answer(sock)
            if answer.startswith(b"HTTP/1.1 200") or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert answer.startswith(b"HTTP/1.1 200")
        assert server.output().count("cannot accept connections") == 1
        assert "Traceback" not in server.output()
    finally:
        server.stop()
    assert server.proc.returncode == 0


def test_accept_errors_are_said_once_a_minute_with_a_count(caplog):
    from relay.listen import AcceptErrors

    now = [100.0]
    handler = AcceptErrors(every=60, clock=lambda: now[0])
    loop = asyncio.new_event_loop()
    try:
        failed = {"message": AcceptErrors.MESSAGE,
                  "exception": OSError(24, "Too many open files")}
        with caplog.at_level(logging.ERROR, logger="relay"):
            for _ in range(2000):
                handler(loop, failed)
            now[0] += 61
            handler(loop, failed)
            handler(loop, {"message": "something else broke"})
        said = [r.getMessage() for r in caplog.records]
    finally:
        loop.close()
    assert len(said) == 3
    assert said[0].startswith("cannot accept connections: Too many open files (this process "
                              "may have ")
    assert said[1].endswith("1999 more since it was last said")
    assert said[2] == "something else broke"  # asyncio's own handler, for everything else


@pytest.mark.parametrize("limits, need_met, soft_after", [
    ((1024, 524288), True, 1024 + 512 + 128),  # systemd's default: raised to what is needed
    ((256, 1000), False, 1000),  # as far as the hard limit goes, and said
    ((64, 64), False, 64),
    ((4096, 4096), True, 4096),
])
def test_the_open_files_limit_is_raised_to_what_the_connections_need(monkeypatch, limits,
                                                                      need_met, soft_after):
    from relay import listen

    current = list(limits)
    monkeypatch.setattr(listen.resource, "getrlimit", lambda which: tuple(current))

    def setrlimit(which, wanted):
        assert wanted[1] == limits[1]  # the hard limit is the operator's
        current[:] = wanted
    monkeypatch.setattr(listen.resource, "setrlimit", setrlimit)
    enough, said = listen.fit_open_files(1024, 512)
    assert (enough, current[0]) == (need_met, soft_after)
    if not need_met:
        assert said.startswith(f"open files: this process may have {soft_after} open")
        assert "server.max_connections (1024)" in said


def test_planted_secrets_never_reach_a_log_line_or_a_dump(relay, emulator, tmp_path):
    emu = emulator("--fail-status", "400")
    planted = "planted-secret-value-0123456789"
    server = relay({"server": {"access_log": True, "log_level": "DEBUG",
                               "auth": {"keys": [{"name": "team", "key_env": "KEY_A"}]}},
                    "pipeline": ["dedup", "pairing", "ordering", "dump"],
                    "plugins": {"dump": {"dir": str(tmp_path / "dumps")}},
                    "backends": [backend(emu.url, api_key_env="UP_KEY")]},
                   env=ENV)
    import urllib.request
    for headers in ({"x-api-key": KEY_A, "cookie": "session=" + planted},
                    {"Authorization": "Bearer " + KEY_A, "proxy-authorization": planted},
                    {"x-api-key": "wrong-" + planted}):
        request = urllib.request.Request(server.url + "/v1/messages", data=orjson.dumps(BODY),
                                         headers={"Content-Type": "application/json", **headers})
        try:
            urllib.request.urlopen(request, timeout=10)
        except urllib.error.HTTPError as e:
            assert e.code in (400, 401)
    assert server.wait_for_output("status=400")
    deadline = time.monotonic() + 10
    while not (dumps := list((tmp_path / "dumps").rglob("*.json"))) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert dumps
    for secret in (KEY_A, BACKEND_KEY, planted):
        assert secret not in server.output()
        for path in dumps:
            assert secret not in path.read_text()


SECRET_KEY = "sk-secret-key-value-0123456789abcdef"


PARSER_REFUSES = [
    # a control character in the key: aiohttp's parser quotes the header line it refuses
    b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nx-api-key: " + SECRET_KEY.encode()
    + b"\x01rest\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + SECRET_KEY.encode()
    + b"\x7f\r\n\r\n",
    # the key fine, the next line broken
    b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nx-api-key: " + SECRET_KEY.encode()
    + b"\nX-Bad\x01: v\r\n\r\n",
    # a value too long: quoted without its header's name
    b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nCookie: " + SECRET_KEY.encode() * 300
    + b"\r\n\r\n",
    b"GET /v1/models?key=" + SECRET_KEY.encode() + b"\x01 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
]


def test_a_request_the_parser_refuses_never_echoes_or_logs_its_credentials(relay, emulator):
    emu = emulator()
    server = relay({"server": {"access_log": True, "log_level": "DEBUG"},
                    "backends": [backend(emu.url)]})
    for head in PARSER_REFUSES:
        with connect(server.url) as sock:
            sock.sendall(head)
            answer = read_answer(sock)
        status = int(answer.split(b" ", 2)[1])
        assert status == 400, answer[:300]
        doc = orjson.loads(answer.split(b"\r\n\r\n", 1)[1])
        assert is_anthropic_error(doc, 400) and doc["request_id"].startswith("relay_")
        assert f"x-relay-request-id: {doc['request_id']}".encode() in answer
        assert server.wait_for_output(doc["request_id"])  # the refusal is logged, by id
        for fragment in (SECRET_KEY, SECRET_KEY[:16], "0123456789abcdef"):
            assert fragment.encode() not in answer
    time.sleep(0.2)
    for fragment in (SECRET_KEY, SECRET_KEY[:16], "0123456789abcdef"):
        assert fragment not in server.output()


async def test_a_request_the_parser_refuses_carries_its_id_where_the_sdks_read_it(
        aiohttp_server):
    # As every other error the relay makes: the SDKs take an error's request_id from the
    # request-id header, not from the body.
    from relay.chain import Chain, load_plugins
    from relay.listen import Listener
    from relay.server import create_app

    up = await start_upstream(aiohttp_server, Upstream())
    config = config_module.parse({"backends": [backend(str(up.make_url("")))]})
    runner = web.AppRunner(create_app(config, Chain(load_plugins(config.pipeline), config)),
                           access_log=None)
    await runner.setup()
    site = Listener(runner, "127.0.0.1", 0, max_connections=8, header_timeout=5)
    await site.start()
    try:
        host, port = runner.addresses[0][:2]
        for head in (b"FROB /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
                     b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n"):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(head)
            answer = await asyncio.wait_for(reader.read(), 5)
            writer.close()
            head_text, _, body = answer.partition(b"\r\n\r\n")
            headers = dict(line.lower().split(b": ", 1) for line in head_text.split(b"\r\n")[1:])
            doc = orjson.loads(body)
            assert is_anthropic_error(doc, 400)
            assert headers[b"request-id"].decode() == doc["request_id"]
            assert headers[b"x-relay-request-id"] == headers[b"request-id"]
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("parser", ["HttpRequestParser", "HttpRequestParserPy"])
def test_both_of_aiohttps_parsers_errors_are_redacted(parser):
    """The C parser (what serving uses) and the pure-Python one (AIOHTTP_NO_EXTENSIONS)
    quote a refused request differently; neither quote keeps a credential."""
    from unittest import mock

    from aiohttp import http_parser

    from relay.listen import redact_parser_message
    loop = asyncio.new_event_loop()
    try:
        for head in (b"GET / HTTP/1.1\r\nx-api-key: " + SECRET_KEY.encode() + b"\x01\r\n\r\n",
                     b"GET / HTTP/1.1\r\nx-api-key: " + SECRET_KEY.encode() * 400 + b"\r\n\r\n",
                     b"GET /?token=" + SECRET_KEY.encode() + b"\x01 HTTP/1.1\r\n\r\n"):
            found = getattr(http_parser, parser)(mock.Mock(), loop, 2 ** 16,
                                                 max_line_size=8190, max_field_size=8190)
            with pytest.raises(http_parser.BadHttpMessage) as raised:
                found.feed_data(head)
            text = raised.value.message
            assert SECRET_KEY[:16] in text  # what aiohttp says, unredacted
            assert SECRET_KEY[:16] not in redact_parser_message(text)
            assert "[redacted]" in redact_parser_message(text)
    finally:
        loop.close()
    plain = "Invalid header token:\n\n  b'Host: 127.0.0.1'\n     ^"
    assert redact_parser_message(plain) == plain  # nothing secret: left as it is


CLOSE = b"Connection: close\r\n"
ODD_TARGETS = [
    (b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n" + CLOSE + b"\r\n", 405),
    (b"OPTIONS * HTTP/1.1\r\nHost: 127.0.0.1\r\n" + CLOSE + b"\r\n", 405),
    (b"GET /v1/models%0d%0aX-Injected:%20yes HTTP/1.1\r\nHost: 127.0.0.1\r\n" + CLOSE
     + b"\r\n", 400),
    (b"GET /%0a HTTP/1.1\r\nHost: 127.0.0.1\r\n" + CLOSE + b"\r\n", 400),
    (b"POST /v1/messages%0D%0A HTTP/1.1\r\nHost: 127.0.0.1\r\n" + CLOSE
     + b"Content-Length: 2\r\nContent-Type: application/json\r\n\r\n{}", 400),
]


def test_targets_the_router_matches_to_nothing_are_answered_in_anthropic_format(small_relay):
    for head, status in ODD_TARGETS:
        with connect(small_relay.url) as sock:
            sock.sendall(head)
            answer = read_answer(sock)
        assert int(answer.split(b" ", 2)[1]) == status, answer[:300]
        headers, body = answer.split(b"\r\n\r\n", 1)
        assert b"application/json" in headers.lower()
        doc = orjson.loads(body)
        assert is_anthropic_error(doc, status)
        assert f"x-relay-request-id: {doc['request_id']}".encode() in headers
        assert b"X-Injected" not in headers
    assert "Traceback" not in small_relay.output()


def test_no_secret_is_in_the_configs_repr():
    # A repr reaches logs through any f-string or %r; keys are read into the config at start.
    env = {"UP": "sk-operator-secret-0123456789", "RELAY": KEY_A,
           "ADMIN": "admin-key-0123456789abcdefgh", "POOL": "sk-pool-key-0123456789abcdef"}
    config = config_module.parse({
        "server": {"auth": {"keys": [{"name": "a", "key_env": "RELAY"}],
                            "admin_key_env": "ADMIN"}},
        "backends": [{"name": "one", "url": "http://127.0.0.1:1", "api_key_env": "UP",
                      "models": ["*"]},
                     {"name": "pool", "url": "http://127.0.0.1:2", "models": ["*"],
                      "credentials": [{"name": "c", "key_env": "POOL"}]}]}, env)
    shown = repr(config) + repr(config.backends) + repr(config.keys)
    assert [name for name, secret in env.items() if secret in shown] == []


class Records:
    """Keeps each finished exchange's error and timeline, as the trace and the ledger read them."""

    def __init__(self):
        self.seen: list[str] = []

    @hookimpl
    def relay_exchange_end(self, exchange):
        error = exchange.error.message if exchange.error is not None else ""
        self.seen.append(error + repr(exchange.timeline))


@pytest.mark.parametrize("stream", [False, True])
async def test_an_upstream_answer_that_echoes_the_key_is_not_quoted_in_the_log(
        aiohttp_server, aiohttp_client, caplog, stream):
    # An OpenAI-format answer the relay cannot translate is quoted in its error, which goes to
    # the client (redacted), the log, the record and the trace: the key the upstream echoed
    # must not.
    upstream = Upstream()

    async def reply(request):
        if stream:
            return web.Response(body=b"data: bad key " + BACKEND_KEY.encode() + b"\n\n",
                                content_type="text/event-stream")
        return web.Response(body=b"bad key " + BACKEND_KEY.encode(),
                            content_type="application/json")
    upstream.reply = reply
    up = await start_upstream(aiohttp_server, upstream)
    raw = {"pipeline": ["records"],
           "backends": [{"name": "oa", "url": str(up.make_url("/v1")), "format": "openai",
                         "models": ["*"], "api_key_env": "UP_KEY"}]}
    records = Records()
    client = await start_relay(aiohttp_client, raw, extra={"records": records}, env=ENV)
    with caplog.at_level(logging.INFO):
        resp = await client.post("/v1/messages", json={**BODY, "stream": stream})
        text = await resp.text()
    assert upstream.received and "[redacted]" in text and BACKEND_KEY not in text
    assert caplog.records and BACKEND_KEY not in caplog.text
    assert records.seen and "[redacted]" in records.seen[0] and BACKEND_KEY not in records.seen[0]


URL_PASSWORD = "basic-auth-password-0123456789"


def test_a_backend_urls_password_is_never_shown():
    # A password in a backend's URL goes up as Basic credentials (aiohttp makes them): the
    # operator's, like a key, so neither the config's repr nor the start-up line shows it.
    from relay import cli
    config = config_module.parse({"backends": [
        {"name": "one", "url": f"http://relay:{URL_PASSWORD}@127.0.0.1:1/base",
         "models": ["*"]}]}, {})
    shown = repr(config) + repr(config.backends) + cli.describe(config)
    assert URL_PASSWORD not in shown
    assert "one http://relay:[redacted]@127.0.0.1:1/base (*)" in cli.describe(config)


def test_a_backend_urls_password_is_an_operator_credential():
    config = config_module.parse({"backends": [
        {"name": "one", "url": f"http://relay:{URL_PASSWORD}@127.0.0.1:1", "models": ["*"]}]}, {})
    with pytest.raises(config_module.ConfigError, match="backends one put the operator's key"):
        config_module.check_exposure(config, "0.0.0.0")


async def test_an_upstream_that_echoes_a_backend_urls_password_has_it_redacted(
        aiohttp_server, aiohttp_client, tmp_path):
    upstream = Upstream()

    async def reply(request):
        return web.json_response({"type": "error", "error": {
            "type": "authentication_error",
            "message": f"bad credentials: {request.headers.get('Authorization')} "
                       f"({URL_PASSWORD})"}}, status=401, headers={"x-echo": URL_PASSWORD})
    upstream.reply = reply
    up = await start_upstream(aiohttp_server, upstream)
    raw = {"server": {"auth": {"keys": [{"name": "alpha", "key_env": "KEY_A"}]}},
           "pipeline": ["dump"], "plugins": {"dump": {"dir": str(tmp_path)}},
           "backends": [{"name": "up", "url": f"http://relay:{URL_PASSWORD}@127.0.0.1:{up.port}",
                         "models": ["claude-*"]}]}
    client = await start_relay(aiohttp_client, raw, env=ENV)
    resp = await client.post("/v1/messages", json=BODY, headers={"x-api-key": KEY_A})
    text = await resp.text()
    sent = upstream.received[0]["headers"]["Authorization"]
    assert resp.status == 401 and sent.startswith("Basic ")
    await client.chain.shutdown(client.config)  # the dump written
    [dump] = tmp_path.rglob("*.json")
    for shown in (text, str(dict(resp.headers)), dump.read_text()):
        assert URL_PASSWORD not in shown and sent.split()[1] not in shown
