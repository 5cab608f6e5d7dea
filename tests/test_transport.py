"""The lean upstream client (relay.transport): aiohttp's bytes on the wire, its answers and
its exceptions, and a pool that reuses, retries once, bounds and closes its connections."""

from __future__ import annotations

import asyncio
import errno
import gzip
import ssl
import subprocess

import aiohttp
import orjson
import pytest
from multidict import CIMultiDict
from test_server import ANSWER, BODY
from test_upstream import Recorder
from yarl import URL

from relay import transport
from relay.testing.fixtures import start_relay

TIMEOUT = aiohttp.ClientTimeout(total=10, connect=5, sock_read=5)
UNBOUNDED = aiohttp.ClientTimeout(total=None, connect=5, sock_read=5)  # the relay's default
OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


class Raw:
    """A server scripted byte by byte: ``answer(reader, writer, request_bytes)`` per request,
    on as many connections as the client opens."""

    def __init__(self, answer=None):
        self.answer = answer or (lambda reader, writer, request: writer.write(OK))
        self.requests: list[bytes] = []
        self.connections = 0
        self.closed = 0
        self.server: asyncio.AbstractServer | None = None
        self.writers: set = set()

    async def start(self) -> URL:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return URL(f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}")

    async def _serve(self, reader, writer):
        self.connections += 1
        self.writers.add(writer)
        try:
            while True:
                request = await read_request(reader)
                if request is None:
                    break
                self.requests.append(request)
                done = self.answer(reader, writer, request)
                if asyncio.iscoroutine(done):
                    done = await done
                await writer.drain()
                if done == "close":
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.closed += 1
            writer.close()

    async def stop(self):
        if self.server is not None:
            self.server.close()
            for writer in self.writers:
                writer.close()  # its reader sees the end, and its task ends
            await self.server.wait_closed()


async def read_request(reader) -> bytes | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head + await reader.readexactly(length)


@pytest.fixture
async def raw():
    servers = []

    async def make(answer=None):
        server = Raw(answer)
        servers.append(server)
        return server, await server.start()
    yield make
    for server in servers:
        await server.stop()


async def send(pool, url: URL, method="POST", body: bytes | None = b"{}", headers=None,
               timeout=TIMEOUT) -> bytes:
    answer = await pool.request(method, url, url.raw_path_qs, CIMultiDict(headers or {}),
                                body, timeout)
    async with answer:
        return await answer.read()


HEADERS = [("content-type", "application/json"), ("anthropic-beta", "a-1"),
           ("anthropic-beta", "b-2"), ("x-api-key", "k"), ("X-User", "Renée")]


@pytest.mark.parametrize("method, body, headers", [
    ("POST", b'{"a": 1}', HEADERS),
    ("POST", b'{"a": 1}', []),  # aiohttp names a type for a body that has none
    ("POST", b"x" * 100_000, HEADERS),  # written after the head, not copied into its write
    ("POST", None, HEADERS),
    ("POST", b"", []),
    ("GET", None, HEADERS),
    ("HEAD", None, []),
    ("DELETE", None, []),
    ("GET", None, [("Host", "elsewhere.example"), ("Accept", "text/plain"),
                   ("Accept-Encoding", "identity")]),
])
async def test_the_request_is_byte_for_byte_what_aiohttp_sends(raw, method, body, headers):
    server, base = await raw(lambda reader, writer, request: writer.write(
        b"HTTP/1.1 204 No Content\r\n\r\n"))
    url = URL(f"{base}/v1/x%2Fy?beta=true&a=%20", encoded=True)
    async with aiohttp.ClientSession(  # as relay.upstream.Upstream.start makes it
            cookie_jar=aiohttp.DummyCookieJar(), skip_auto_headers=("User-Agent",)) as session:
        async with session.request(method, url, data=body, headers=CIMultiDict(headers),
                                   allow_redirects=False) as answer:
            await answer.read()
    pool = transport.Pool(4)
    await send(pool, url, method, body, headers)
    await pool.close()
    theirs, ours = server.requests
    assert ours == theirs
    assert ours.startswith(f"{method} /v1/x%2Fy?beta=true&a=%20 HTTP/1.1\r\n".encode())


def test_the_host_header_names_a_port_only_when_it_is_not_the_schemes():
    for url, host in (("http://h.example/v1", "h.example"), ("https://h.example:443/v1",
                                                              "h.example"),
                      ("https://h.example:8443/v1", "h.example:8443"),
                      ("http://[::1]:8080/v1", "[::1]:8080")):
        head = transport.request_head("GET", URL(url), "/v1", CIMultiDict(), None)
        assert f"\r\nHost: {host}\r\n".encode() in head, url


def test_a_control_character_in_a_header_is_refused_not_sent():
    with pytest.raises(ValueError, match="header injection"):
        transport.request_head("GET", URL("http://h/"), "/", CIMultiDict(
            {"X-A": "v\r\nX-Injected: 1"}), None)


async def test_a_kept_alive_connection_carries_the_next_request(raw):
    server, url = await raw()
    pool = transport.Pool(4)
    for _ in range(3):
        assert await send(pool, url) == b"{}"
    await pool.close()
    assert server.connections == 1 and len(server.requests) == 3


async def test_connection_close_a_body_left_unread_or_an_idle_one_is_not_reused(raw):
    def answer(reader, writer, request):
        if b"close" in request:
            writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}")
            return "close"
        if b"large" in request:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"x" * 100000)
            return None
        writer.write(OK)
    server, base = await raw(answer)
    pool = transport.Pool(4, keepalive=0.2)
    await send(pool, base / "close")
    await send(pool, base)
    assert server.connections == 2
    unread = await pool.request("GET", base / "large", "/large", CIMultiDict(), None, TIMEOUT)
    assert unread.status == 200
    unread.release()  # the rest of its body would be read as the next answer
    await send(pool, base)
    assert server.connections == 3
    await asyncio.sleep(0.5)  # past the keep-alive time: the pool closes it
    assert server.closed == 3 and pool._open == 0
    await send(pool, base)
    assert server.connections == 4
    await pool.close()
    await asyncio.sleep(0.05)
    assert server.closed == 4


async def test_a_request_the_idle_connection_lost_is_sent_again_on_a_new_one(raw):
    async def answer(reader, writer, request):
        if len(server.requests) == 2:  # closed as the second request arrived: never answered
            return "close"
        writer.write(OK)
    server, url = await raw(answer)
    pool = transport.Pool(4)
    await send(pool, url, body=b'{"n": 1}')
    assert await send(pool, url, body=b'{"n": 2}') == b"{}"
    assert server.connections == 2
    assert [r.endswith(b'{"n": 2}') for r in server.requests] == [False, True, True]
    await pool.close()


async def test_no_second_send_once_an_answer_began_or_on_a_new_connection(raw):
    async def answer(reader, writer, request):
        if b"partial" in request:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-")
        return "close"
    server, base = await raw(answer)
    pool = transport.Pool(4)
    with pytest.raises(aiohttp.ServerDisconnectedError):
        await send(pool, base)  # a POST on a new connection: aiohttp does not send it again
    assert len(server.requests) == 1
    with pytest.raises(aiohttp.ServerDisconnectedError):
        await send(pool, base, method="GET", body=None)  # aiohttp's one retry of a GET
    assert len(server.requests) == 3
    with pytest.raises(aiohttp.ClientError):
        await send(pool, base / "partial", method="GET", body=None)
    assert len(server.requests) == 4
    await pool.close()


async def test_answers_are_read_as_aiohttp_reads_them(raw):
    """In turn on one connection (without a total timeout, one parser reads them all)."""
    packed = gzip.compress(b'{"a": 1}')

    def answer(reader, writer, request):
        if request.startswith(b"GET /gzip"):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d"
                         b"\r\n\r\n%s" % (len(packed), packed))
        elif request.startswith(b"GET /chunked"):
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\n"
                         b"Transfer-Encoding: chunked\r\nSet-Cookie: a=1\r\nSet-Cookie: b=2\r\n"
                         b"\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\nuntil close")
            return "close"
    server, base = await raw(answer)
    pool = transport.Pool(4)
    answer_ = await pool.request("GET", base / "gzip", "/gzip", CIMultiDict(), None, UNBOUNDED)
    assert await answer_.read() == b'{"a": 1}' and answer_.headers["Content-Encoding"] == "gzip"
    assert answer_.content_type == "application/octet-stream"
    answer_.release()
    answer_ = await pool.request("GET", base / "chunked", "/chunked", CIMultiDict(), None,
                                 UNBOUNDED)
    assert answer_.status == 201 and answer_.reason == "Created"
    assert answer_.headers.getall("Set-Cookie") == ["a=1", "b=2"]
    assert [chunk async for chunk in answer_.content.iter_any()] in ([b"abcde"],
                                                                      [b"abc", b"de"])
    answer_.release()
    answer_ = await pool.request("GET", base, "/", CIMultiDict(), None, UNBOUNDED)
    assert answer_.content_type == "text/event-stream" and answer_.content_length is None
    assert await answer_.read() == b"until close"
    answer_.release()
    assert server.connections == 1
    await pool.request("GET", base / "gzip", "/gzip", CIMultiDict(), None, UNBOUNDED)
    assert server.connections == 2  # read until close: that one ended with its answer
    await pool.close()


async def test_failures_raise_what_aiohttp_raises(raw, unused_tcp_port_factory):
    async def answer(reader, writer, request):
        if b"short" in request:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
            return "close"
        if b"garbage" in request:
            writer.write(b"HTP/1.1 200 OK\r\n\r\n")
            return "close"
        if b"slow" in request:
            await asyncio.sleep(1)
        if b"drip" in request:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n")
            for _ in range(10):
                await writer.drain()
                await asyncio.sleep(0.1)
                writer.write(b"x")
            return None
        writer.write(OK)
    server, base = await raw(answer)
    pool = transport.Pool(4)
    with pytest.raises(aiohttp.ClientPayloadError, match="Not enough data"):
        await send(pool, base / "short")
    with pytest.raises(aiohttp.ClientResponseError) as refused:
        await send(pool, base / "garbage")
    assert refused.value.status == 400
    with pytest.raises(aiohttp.ServerTimeoutError):
        await send(pool, base / "slow", timeout=aiohttp.ClientTimeout(total=10, sock_read=0.2))
    assert await send(pool, base, timeout=UNBOUNDED) == b"{}"
    with pytest.raises(aiohttp.ServerTimeoutError):  # on that connection, a shorter wait
        await asyncio.wait_for(send(pool, base / "slow", timeout=aiohttp.ClientTimeout(
            sock_read=0.2)), 0.9)
    with pytest.raises(asyncio.TimeoutError) as late:  # each byte in time, the whole not
        await send(pool, base / "drip", timeout=aiohttp.ClientTimeout(total=0.4, sock_read=0.3))
    assert not isinstance(late.value, aiohttp.ServerTimeoutError)
    port = unused_tcp_port_factory()
    with pytest.raises(aiohttp.ClientConnectorError) as refused_connection:
        await send(pool, URL(f"http://127.0.0.1:{port}"))
    e = refused_connection.value
    assert (e.host, e.port, e.os_error.errno) == ("127.0.0.1", port, errno.ECONNREFUSED)
    assert await send(pool, base) == b"{}"
    await pool.close()
    assert pool._open == 0


async def test_a_name_whose_every_address_refuses_keeps_the_errno(unused_tcp_port_factory,
                                                                   monkeypatch):
    # Two loopback addresses, as a name with an IPv4 and an IPv6 address has: asyncio's own
    # happy eyeballs reports their differing messages with no errno.
    port = unused_tcp_port_factory()
    loop = asyncio.get_running_loop()
    resolve = loop.getaddrinfo

    async def two_addresses(host, *args, **kwargs):
        assert host == "upstream.test"
        return [*await resolve("127.0.0.1", *args, **kwargs),
                *await resolve("127.0.0.2", *args, **kwargs)]

    monkeypatch.setattr(loop, "getaddrinfo", two_addresses)
    pool = transport.Pool(4)
    with pytest.raises(aiohttp.ClientConnectorError) as refused:
        await send(pool, URL(f"http://upstream.test:{port}"))
    assert refused.value.os_error.errno == errno.ECONNREFUSED
    await pool.close()


async def test_a_full_pool_waits_under_the_connect_timeout_and_makes_room(raw):
    release = asyncio.Event()

    async def answer(reader, writer, request):
        if b"hold" in request:
            await release.wait()
        writer.write(OK)
    server, base = await raw(answer)
    other, elsewhere = await raw()
    pool = transport.Pool(1)
    held = asyncio.ensure_future(send(pool, base / "hold"))
    await asyncio.sleep(0.1)
    assert pool.full
    with pytest.raises(aiohttp.ConnectionTimeoutError):
        await send(pool, base, timeout=aiohttp.ClientTimeout(total=5, connect=0.2))
    waiting = asyncio.ensure_future(send(pool, base))
    await asyncio.sleep(0.05)
    release.set()
    assert await held == b"{}" and await waiting == b"{}"
    assert server.connections == 1 and not pool.full
    # The one connection idles; another upstream's request closes it to open its own.
    assert await send(pool, elsewhere) == b"{}"
    await asyncio.sleep(0.05)
    assert server.closed == 1 and other.connections == 1 and pool._open == 1
    await pool.close()


async def test_a_reader_that_stops_stops_the_upstream(raw):
    """The StreamReader's limit pauses the socket: the upstream's writes stall at what the
    kernel's buffers and the reader's hold, and the rest arrives once it reads again."""
    piece = b"x" * 65536
    pieces = 1024  # 64 MiB, far past loopback's socket buffers
    written = []

    async def answer(reader, writer, request):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (len(piece) * pieces))
        for i in range(pieces):
            writer.write(piece)
            await writer.drain()
            written.append(i)
    server, url = await raw(answer)
    pool = transport.Pool(4)
    answer_ = await pool.request("GET", url, "/", CIMultiDict(), None, TIMEOUT)
    await asyncio.sleep(0.5)
    stalled = len(written)
    await asyncio.sleep(0.2)
    assert len(written) == stalled < pieces // 2
    size = 0
    async for chunk in answer_.content.iter_any():
        size += len(chunk)
    assert size == len(piece) * pieces
    answer_.release()
    await pool.close()


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture
def certificates(tmp_path):
    """A CA of the test's own and two server certificates it signed: one for localhost, one
    for another name."""
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
             "-subj", "/CN=relay test CA", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign", cwd=tmp_path)
    for name in ("localhost", "other.example"):
        (tmp_path / f"{name}.ext").write_text(
            f"subjectAltName=DNS:{name}\nbasicConstraints=CA:FALSE\n"
            "extendedKeyUsage=serverAuth\n")
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=tmp_path)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.pem", "-days", "1",
                 "-extfile", f"{name}.ext", cwd=tmp_path)
    return tmp_path


@pytest.mark.slow  # openssl makes the certificates
async def test_tls_checks_the_certificate_and_name_with_sni_and_alpn(certificates,
                                                                     monkeypatch):
    seen = []

    async def serve(name):
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(certificates / f"{name}.pem", certificates / f"{name}.key")
        context.set_alpn_protocols(["h2", "http/1.1"])
        context.sni_callback = lambda sock, server_name, _: seen.append(server_name)

        async def answer(reader, writer):
            ssl_object = writer.get_extra_info("ssl_object")
            seen.append(ssl_object.selected_alpn_protocol())
            await read_request(reader)
            writer.write(OK)
            await writer.drain()
            writer.close()
        server = await asyncio.start_server(answer, "127.0.0.1", 0, ssl=context)
        return server, URL(f"https://localhost:{server.sockets[0].getsockname()[1]}/v1")

    good, good_url = await serve("localhost")
    wrong, wrong_url = await serve("other.example")
    # The system's trust store, as aiohttp's ssl=True; OpenSSL reads SSL_CERT_FILE for it.
    monkeypatch.setenv("SSL_CERT_FILE", str(certificates / "ca.pem"))
    monkeypatch.setattr(transport, "_tls_context", None)
    pool = transport.Pool(4)
    try:
        assert await send(pool, good_url) == b"{}"
        assert seen == ["localhost", "http/1.1"]
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            await send(pool, wrong_url)  # signed by the trusted CA, for another name
        monkeypatch.delenv("SSL_CERT_FILE")
        monkeypatch.setattr(transport, "_tls_context", None)
        await pool.close()
        pool = transport.Pool(4)
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            await send(pool, good_url)  # the right name, from a CA the system does not trust
    finally:
        await pool.close()
        good.close()
        wrong.close()


async def test_through_the_relay_the_resend_is_one_attempt(raw, aiohttp_client):
    """The upstream drops its idle connection as the client's second request reaches it:
    the client gets its answer, the record one attempt, and the upstream the request twice."""
    async def answer(reader, writer, request):
        if len(server.requests) == 2:
            return "close"
        body = orjson.dumps(ANSWER)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    server, url = await raw(answer)
    recorder = Recorder()
    client = await start_relay(aiohttp_client, {
        "pipeline": ["rec"],
        "backends": [{"name": "up", "url": str(url), "models": ["claude-*"]}]},
        extra={"rec": recorder})
    for _ in range(2):
        resp = await client.post("/v1/messages", json=BODY)
        assert resp.status == 200 and await resp.json() == ANSWER
    assert [len(e.attempts) for e in recorder.ended] == [1, 1]
    assert all(e.attempts[0].status == 200 and e.attempts[0].error is None
               for e in recorder.ended)
    assert len(server.requests) == 3 and server.connections == 2
    assert server.requests[1] == server.requests[2]  # the same bytes, again
