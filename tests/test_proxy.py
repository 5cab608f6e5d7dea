"""Backends behind an egress proxy: a real tinyproxy of the test's own on loopback, between
the relay and scripted upstreams (plain HTTP, and HTTPS through a CONNECT tunnel)."""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import shutil
import socket
import ssl
import subprocess
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from support import Process, Relay, backend
from test_server import ANSWER, BODY, Upstream, start_relay, start_upstream

pytestmark = pytest.mark.slow

TINYPROXY = shutil.which("tinyproxy") or "/usr/bin/tinyproxy"
USER, PASSWORD = "relay-egress", "proxy-pass-7f3e9a1c5b"
# What a password could be seen as: itself, and inside the header value it makes.
SECRETS = (PASSWORD, base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TinyProxy:
    """tinyproxy in the foreground on a free loopback port, logging every request it takes
    (``seen``); with ``auth``, it asks for that ``(user, password)``."""

    def __init__(self, directory: Path, auth: tuple[str, str] | None = None):
        if not os.access(TINYPROXY, os.X_OK):
            pytest.fail("tinyproxy is missing: run `make test` (it installs Debian's "
                        "tinyproxy-bin)", pytrace=False)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        lines = [f"Port {self.port}", "Listen 127.0.0.1", "Timeout 30", "LogLevel Connect",
                 "MaxClients 50"]
        if auth:
            lines.append(f"BasicAuth {auth[0]} {auth[1]}")
        config = directory / f"tinyproxy-{self.port}.conf"
        config.write_text("\n".join(lines) + "\n")
        self.process = Process([TINYPROXY, "-d", "-c", str(config)])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"tinyproxy did not start:\n{self.process.output()}")

    def seen(self, at_least: int = 0) -> list[str]:
        """The request lines it was sent (``POST http://... HTTP/1.1``, ``CONNECT h:p ...``),
        once its log holds ``at_least`` of them (the log is read by a thread of its own)."""
        deadline = time.monotonic() + 5
        while True:
            lines = [line.split("): ", 1)[1].strip()
                     for line in self.process.output().splitlines()
                     if "Request (file descriptor" in line]
            if len(lines) >= at_least or time.monotonic() > deadline:
                return lines
            time.sleep(0.02)

    def stop(self) -> None:
        self.process.stop()


@pytest.fixture
def tinyproxy(tmp_path):
    started: list[TinyProxy] = []

    def start(auth=None) -> TinyProxy:
        proxy = TinyProxy(tmp_path, auth)
        started.append(proxy)
        return proxy

    yield start
    for proxy in started:
        proxy.stop()


async def relay_over(aiohttp_server, aiohttp_client, env=None, **extra):
    upstream = Upstream()
    server = await start_upstream(aiohttp_server, upstream)
    client = await start_relay(aiohttp_client, {"backends": [
        {"name": "up", "url": f"http://127.0.0.1:{server.port}", "models": ["claude-*"],
         **extra}]}, env=env)
    return client, upstream, server.port


async def test_an_http_backend_is_reached_through_the_proxy_the_environment_names(
        tinyproxy, aiohttp_server, aiohttp_client):
    proxy = tinyproxy()
    client, upstream, port = await relay_over(aiohttp_server, aiohttp_client,
                                              env={"HTTP_PROXY": proxy.url})
    resp = await client.post("/v1/messages", json=BODY)
    assert resp.status == 200 and await resp.json() == ANSWER
    assert (await client.get("/v1/models")).status == 200  # pass-through too
    assert proxy.seen(2) == [f"POST http://127.0.0.1:{port}/v1/messages HTTP/1.1",
                            f"GET http://127.0.0.1:{port}/v1/models HTTP/1.1"]
    assert all("tinyproxy" in r["headers"].get("Via", "") for r in upstream.received)
    # And only an http:// backend's variable counts for it.
    direct, upstream, _ = await relay_over(aiohttp_server, aiohttp_client,
                                           env={"HTTPS_PROXY": proxy.url})
    assert (await direct.post("/v1/messages", json=BODY)).status == 200
    assert "Via" not in upstream.received[0]["headers"] and len(proxy.seen()) == 2


@pytest.mark.parametrize("env,extra", [
    ({"NO_PROXY": "localhost,127.0.0.1"}, {}),
    ({"no_proxy": "127.0.0.0/8"}, {}),
    ({"NO_PROXY": "*"}, {}),
    ({}, {"proxy": "none"}),
    ({}, {"proxy": None}),
], ids=["no_proxy-address", "no_proxy-cidr", "no_proxy-star", "proxy-none", "proxy-null"])
async def test_no_proxy_or_proxy_none_goes_direct(tinyproxy, aiohttp_server, aiohttp_client,
                                                  env, extra):
    proxy = tinyproxy()
    client, upstream, _ = await relay_over(aiohttp_server, aiohttp_client,
                                           env={"HTTP_PROXY": proxy.url, **env}, **extra)
    assert (await client.post("/v1/messages", json=BODY)).status == 200
    assert "Via" not in upstream.received[0]["headers"] and proxy.seen() == []


async def test_a_backends_own_proxy_wins_over_the_environment(tinyproxy, aiohttp_server,
                                                               aiohttp_client):
    mine, theirs = tinyproxy(), tinyproxy()
    client, upstream, _ = await relay_over(
        aiohttp_server, aiohttp_client, env={"HTTP_PROXY": theirs.url, "NO_PROXY": "*"},
        proxy=mine.url)
    assert (await client.post("/v1/messages", json=BODY)).status == 200
    assert len(mine.seen(1)) == 1 and theirs.seen() == []


async def test_proxy_credentials_reach_the_proxy_alone_and_its_refusal_is_a_clean_502(
        tinyproxy, aiohttp_server, aiohttp_client, caplog):
    caplog.set_level(logging.DEBUG)
    proxy = tinyproxy(auth=(USER, PASSWORD))
    client, upstream, _ = await relay_over(
        aiohttp_server, aiohttp_client,
        proxy=f"http://{USER}:{PASSWORD}@127.0.0.1:{proxy.port}")
    resp = await client.post("/v1/messages", json=BODY)
    assert resp.status == 200 and len(proxy.seen(1)) == 1
    assert "Proxy-Authorization" not in upstream.received[0]["headers"]

    # Without them, the proxy's 407 is its refusal, not the backend's answer. (tinyproxy
    # answers wrong ones with a 401, which no client can tell from the backend's own.)
    refused, upstream, _ = await relay_over(aiohttp_server, aiohttp_client, proxy=proxy.url)
    resp = await refused.post("/v1/messages", json=BODY)
    assert resp.status == 502 and upstream.received == []
    error = (await resp.json())["error"]
    assert error["type"] == "api_error"
    assert error["message"] == (
        f"upstream up is unreachable: its proxy http://127.0.0.1:{proxy.port} refused to "
        f"forward the request (407 Proxy Authentication Required): check the proxy's user "
        f"and password")
    # An https:// backend's tunnel refused the same way (the CONNECT's 407), before any TLS.
    tunnel = await start_relay(aiohttp_client, {"backends": [
        {"name": "tls", "url": "https://127.0.0.1:9", "models": ["claude-*"],
         "proxy": proxy.url}]})
    resp = await tunnel.post("/v1/messages", json=BODY)
    assert resp.status == 502 and "(407 Proxy Authentication Required)" in \
        (await resp.json())["error"]["message"]
    assert proxy.seen(3)[-1] == "CONNECT 127.0.0.1:9 HTTP/1.1"
    for secret in SECRETS:
        assert secret not in caplog.text


async def test_a_proxy_that_cannot_be_reached_is_a_clean_502_and_the_fallback_answers(
        aiohttp_server, aiohttp_client):
    closed = free_port()
    upstream, spare = Upstream(), Upstream()
    server, other = (await start_upstream(aiohttp_server, upstream),
                     await start_upstream(aiohttp_server, spare))
    client = await start_relay(aiohttp_client, {"backends": [
        {"name": "up", "url": f"http://127.0.0.1:{server.port}", "models": ["claude-*"],
         "proxy": f"http://{USER}:{PASSWORD}@127.0.0.1:{closed}",
         "retries": {"attempts": 2, "backoff": 0.01}},
        {"name": "spare", "url": f"http://127.0.0.1:{other.port}", "models": ["spare-*"],
         "proxy": f"http://127.0.0.1:{closed}", "fallbacks": ["up"]}]})
    resp = await client.post("/v1/messages", json=BODY)
    body = await resp.json()
    assert resp.status == 502 and resp.headers["x-should-retry"] == "false"  # retried
    assert body["type"] == "error" and body["error"]["type"] == "api_error"
    assert body["error"]["message"] == (f"upstream up is unreachable: could not connect to its "
                                        f"proxy http://127.0.0.1:{closed} (connection refused)")
    assert upstream.received == [] and spare.received == []

    # Unreachable through its proxy is unreachable: the fallback is tried.
    client = await start_relay(aiohttp_client, {"backends": [
        {"name": "up", "url": f"http://127.0.0.1:{server.port}", "models": ["claude-*"],
         "proxy": f"http://127.0.0.1:{closed}", "fallbacks": ["spare"]},
        {"name": "spare", "url": f"http://127.0.0.1:{other.port}", "models": []}]})
    resp = await client.post("/v1/messages", json=BODY)
    assert resp.status == 200 and len(spare.received) == 1


def make_certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1, and its key."""
    cert, key = directory / "upstream.pem", directory / "upstream.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


HAPROXY = shutil.which("haproxy") or "/usr/sbin/haproxy"
TLS_FRONT = """\
defaults
    mode tcp
    timeout connect 5s
    timeout client 30s
    timeout server 30s
frontend tls
    bind 127.0.0.1:{port} ssl crt {pem}
    default_backend proxy
backend proxy
    server tinyproxy 127.0.0.1:{proxy}
"""


@pytest.fixture
def tls_front(tmp_path):
    """HAProxy terminating TLS in front of a port: an ``https://`` proxy made of tinyproxy."""
    started: list[Process] = []

    def start(pem: Path, proxy_port: int) -> int:
        if not os.access(HAPROXY, os.X_OK):
            pytest.fail("HAProxy is missing: run `make test` (it installs Debian's haproxy)",
                        pytrace=False)
        port = free_port()
        config = tmp_path / "haproxy.cfg"
        config.write_text(TLS_FRONT.format(port=port, pem=pem, proxy=proxy_port))
        started.append(Process([HAPROXY, "-db", "-f", str(config)]))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return port
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"haproxy did not start:\n{started[-1].output()}")

    yield start
    for process in started:
        process.stop()


@pytest.mark.parametrize("scheme", ["http", "https"])
async def test_an_https_backend_is_reached_through_the_proxys_tunnel_with_its_credentials(
        tinyproxy, tls_front, aiohttp_server, tmp_path, scheme):
    """The relay as an operator runs it, behind a proxy that asks for credentials (spoken to
    in plain HTTP, or in TLS itself): the backend's TLS goes through a CONNECT tunnel (the
    proxy sees no more than its address), certificates are checked against the CA the
    environment names, and neither the start-up line nor any log line holds the proxy's
    password."""
    cert, key = make_certificate(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    upstream = Upstream()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", upstream.handle)
    server = await aiohttp_server(app, ssl=context)
    proxy = tinyproxy(auth=(USER, PASSWORD))
    port = proxy.port
    if scheme == "https":
        pem = tmp_path / "front.pem"
        pem.write_text(cert.read_text() + key.read_text())
        port = tls_front(pem, proxy.port)
    relay = Relay({"server": {"access_log": True, "log_level": "DEBUG"},
                   "pipeline": ["metrics", "dump"],
                   "plugins": {"dump": {"dir": "dumps", "statuses": ["200"]}},
                   "backends": [backend(f"https://127.0.0.1:{server.port}", name="tls")]},
                  tmp_path, env={"HTTPS_PROXY": f"{scheme}://{USER}:{PASSWORD}@127.0.0.1:{port}",
                                 "SSL_CERT_FILE": str(cert)})
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(relay.url + "/v1/messages", json=BODY) as resp:
                assert resp.status == 200 and await resp.json() == ANSWER
            async with session.get(relay.url + "/metrics") as resp:
                metrics = await resp.text()
        assert proxy.seen(1) == [f"CONNECT 127.0.0.1:{server.port} HTTP/1.1"]
        headers = upstream.received[0]["headers"]
        assert "Proxy-Authorization" not in headers and "Via" not in headers
        assert await asyncio.to_thread(relay.wait_for_output, "path=/v1/messages")
        output = relay.output()
        assert f"via proxy {scheme}://127.0.0.1:{port} from HTTPS_PROXY" in output
        deadline = time.monotonic() + 5
        while not (dumps := list((tmp_path / "dumps").rglob("*.json"))):
            assert time.monotonic() < deadline, "no dump written"
            await asyncio.sleep(0.05)
        dump = dumps[0].read_text()
        assert "upstream_request" in dump and 'relay_requests_total{' in metrics
        for secret in SECRETS:
            assert secret not in output and secret not in dump and secret not in metrics
    finally:
        relay.stop()
