"""Upstreams that break HTTP/1.1, scripted byte by byte behind a whole relay: an answer the
relay cannot read is its own 502 in Anthropic's format, one it can is passed on in a form the
client can read, and the next request never reads what the last one left."""

from __future__ import annotations

import asyncio
import gzip
import logging

import aiohttp
import orjson
import pytest
from multidict import CIMultiDict
from test_server import ANSWER, BODY, STREAM
from test_transport import UNBOUNDED, raw  # noqa: F401 - raw is a fixture
from yarl import URL

from relay import transport
from relay.testing.fixtures import start_relay

JSON = orjson.dumps(ANSWER)
BIG = 32 * 2**20  # a request body no socket buffer holds
GOOD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
    len(JSON), JSON)


def first(answer: bytes, close: bool = False):
    """An upstream that sends ``answer`` to the first request, and a good one to the others."""
    count = [0]

    def reply(reader, writer, request):
        count[0] += 1
        writer.write(answer if count[0] == 1 else GOOD)
        return "close" if close and count[0] == 1 else None
    return reply


async def relay_to(raw, aiohttp_client, reply):  # noqa: F811 - raw is the fixture
    server, url = await raw(reply)
    client = await start_relay(aiohttp_client, {"backends": [
        {"name": "up", "url": str(url), "models": ["claude-*"], "timeouts": {"read": 2}}]})
    return server, client


def head(*lines: bytes, status: bytes = b"200 OK") -> bytes:
    return b"HTTP/1.1 " + status + b"\r\n" + b"".join(line + b"\r\n" for line in lines) + b"\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


JSON_TYPE = b"Content-Type: application/json"
LENGTH = b"Content-Length: %d" % len(JSON)


@pytest.mark.parametrize("answer, close, said", [
    # A switch of protocols the relay never asked for: it was relayed, a 101 to a POST.
    (head(b"Upgrade: websocket", b"Connection: Upgrade", status=b"101 Switching Protocols"),
     False, "HTTP 101, a switch of protocols the relay did not ask for"),
    # A transfer coding the parser leaves on the body: the client got gzip bytes as JSON.
    (head(JSON_TYPE, b"Transfer-Encoding: gzip, chunked") + chunk(gzip.compress(JSON))
     + b"0\r\n\r\n", False,
     "Transfer-Encoding gzip, chunked, which the relay does not decode"),
    (head(JSON_TYPE, b"Transfer-Encoding: chunked, identity") + chunk(JSON) + b"0\r\n\r\n",
     True, "Transfer-Encoding chunked, identity, which the relay does not decode"),
    # What aiohttp's parser refuses (as its client does) stays refused.
    (head(JSON_TYPE, LENGTH, b"Transfer-Encoding: chunked") + chunk(JSON) + b"0\r\n\r\n",
     False, "Transfer-Encoding can't be present with Content-Length"),
    (head(JSON_TYPE, LENGTH, b"Content-Length: 5") + JSON, False, "Duplicate Content-Length"),
    (head(JSON_TYPE, b"Transfer-Encoding: chunked") + b"zz\r\n" + JSON, False,
     "Invalid character in chunk size"),
    (head(JSON_TYPE, b"Content-Length: %d" % (len(JSON) + 10)) + JSON, True, None),
    (head(JSON_TYPE, b"Content-Encoding: gzip", b"Content-Length: 4") + b"abcd", False, None),
    (head(JSON_TYPE, b"X-Big: " + b"a" * 9000, LENGTH) + JSON, False, "Got more than 8190"),
    (head(JSON_TYPE, LENGTH, status=b"204 No Content") + JSON, False, "Bad status line"),
], ids=["101", "gzip-chunked", "chunked-identity", "te-and-length", "two-lengths",
        "bad-chunk-size", "cut-short", "bad-gzip", "huge-header", "204-with-a-body"])
async def test_an_answer_that_cannot_be_read_is_a_502_and_the_next_is_read_whole(
        raw, aiohttp_client, caplog, answer, close, said):  # noqa: F811
    _, client = await relay_to(raw, aiohttp_client, first(answer, close))
    response = await client.post("/v1/messages", json=BODY)
    assert response.status == 502
    error = (await response.json())["error"]
    assert error["type"] == "api_error" and error["message"].startswith("upstream up is ")
    if said is not None:
        assert said in error["message"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    again = await client.post("/v1/messages", json=BODY)
    assert again.status == 200 and await again.json() == ANSWER


@pytest.mark.parametrize("stream", [False, True])
async def test_a_control_character_in_an_upstream_header_goes_on_as_a_space(
        raw, aiohttp_client, caplog, stream):  # noqa: F811
    # aiohttp's lenient parser takes them, and its server refuses to write them: the client
    # got a plain-text 500 (or a broken stream) and the log a traceback.
    body = STREAM if stream else JSON
    kind = b"text/event-stream" if stream else b"application/json"
    _, client = await relay_to(raw, aiohttp_client, first(head(
        b"Content-Type: " + kind, b"X-Odd: a\x01b\x7fc", b"Content-Length: %d" % len(body))
        + body))
    response = await client.post("/v1/messages", json={**BODY, "stream": stream})
    assert response.status == 200 and response.headers["X-Odd"] == "a b c"
    assert await response.read() == body
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


async def test_whitespace_before_a_colon_is_removed_so_framing_headers_stay_hop_by_hop(
        raw, aiohttp_client):  # noqa: F811
    # llhttp frames by "Content-Length :" (and "Connection :"); aiohttp kept the space in
    # the name, so it went to the client beside the relay's own Content-Length, here with
    # another value (the gzipped length), and the header Connection named went on too.
    packed = gzip.compress(JSON)
    _, client = await relay_to(raw, aiohttp_client, first(head(
        JSON_TYPE, b"Content-Encoding: gzip", b"Content-Length : %d" % len(packed),
        b"Connection : X-Internal", b"X-Internal: 1") + packed))
    response = await client.post("/v1/messages", json=BODY)
    assert response.status == 200 and await response.read() == JSON
    names = [name.decode().lower() for name, _ in response.raw_headers]
    assert names.count("content-length") == 1 and response.content_length == len(JSON)
    assert not {"content-length ", "connection ", "x-internal"} & set(names)


async def test_an_answer_that_comes_before_the_body_is_read_is_taken_at_once():
    """An upstream that refuses a large body as soon as it has the head, and reads no more of
    it: the answer was waited on until the upstream read the body, which it never does, and
    the connection, its request's rest unsent, is not kept."""
    refusal = b'{"type":"error","error":{"type":"request_too_large","message":"too large"}}'
    answered, ended = asyncio.Event(), asyncio.Event()
    taken: list[int] = []

    async def serve(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(head(JSON_TYPE, b"Content-Length: %d" % len(refusal),
                          status=b"413 Payload Too Large") + refusal)
        await writer.drain()
        await answered.wait()
        try:  # to the end the relay puts to it
            while data := await reader.read(2**20):
                taken.append(len(data))
        except ConnectionError:
            pass
        ended.set()
        writer.close()
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    url = URL(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/messages")
    pool = transport.Pool(4)
    try:
        answer = await asyncio.wait_for(pool.request(
            "POST", url, url.raw_path_qs, CIMultiDict(), b"x" * BIG, UNBOUNDED), 5)
        assert answer.status == 413 and await answer.read() == refusal
        answered.set()
        answer.release()
        await asyncio.wait_for(ended.wait(), 5)
        assert pool._open == 0
        assert sum(taken) < BIG // 2  # what the kernel held: the rest was never sent
    finally:
        await pool.close()
        server.close()


async def test_an_upstream_that_takes_none_of_the_body_times_out_under_sock_read():
    """No answer and no byte of the body taken: nothing timed the wait for the write."""
    async def serve(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        await asyncio.sleep(10)
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    url = URL(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/messages")
    pool = transport.Pool(4)
    try:
        with pytest.raises(aiohttp.ServerTimeoutError):
            await asyncio.wait_for(pool.request(
                "POST", url, url.raw_path_qs, CIMultiDict(), b"x" * BIG,
                aiohttp.ClientTimeout(total=None, connect=5, sock_read=0.5)), 5)
        assert pool._open == 0
    finally:
        await pool.close()
        server.close()
