"""A plugin that asks for more events mid-stream (``relay_stream_event`` returning names) sees
every one of them after the event it asked at, wherever the upstream's chunks fall, and what
reaches the client is the upstream's bytes; nobody pays for events nobody asked for."""

from __future__ import annotations

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from relay import config as config_module
from relay.chain import Chain, load_plugins
from relay.hookspecs import hookimpl
from relay.stream import StreamRelay
from relay.testing import exchange_for


def event(name: str, data: dict) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps({"type": name, **data}) + b"\n\n"


def delta(index: int, text: str) -> bytes:
    return event("content_block_delta", {"index": index,
                                         "delta": {"type": "text_delta", "text": text}})


STREAM = b"".join([
    event("message_start", {"message": {"id": "msg_1", "content": []}}),
    event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
    delta(0, "before"), delta(0, "still before"),
    event("content_block_stop", {"index": 0}),
    event("content_block_start", {"index": 1, "content_block": {"type": "watched"}}),
    delta(1, "after 1"), b"event: ping\ndata: {\"type\": \"ping\"}\n\n", delta(1, "after 2"),
    event("content_block_stop", {"index": 1}),
    delta(2, "after 3"),
    event("message_stop", {}),
])


class Watcher:
    """Sees block starts; at the start of a "watched" block, asks for the deltas."""

    def __init__(self):
        self.seen: list[tuple[str, object]] = []

    @hookimpl
    def relay_stream_events(self):
        return {"content_block_start"}

    @hookimpl
    def relay_stream_event(self, event):
        data = event.data
        if event.name == "content_block_delta":
            self.seen.append(("delta", data["delta"]["text"]))
            return None
        kind = data["content_block"]["type"]
        self.seen.append(("start", kind))
        return ["content_block_delta"] if kind == "watched" else None


class Confused(Watcher):
    """Answers with something that names no event."""

    @hookimpl
    def relay_stream_event(self, event):
        super().relay_stream_event(event)
        return True


async def relayed(chunks: list[bytes], watcher=None) -> tuple[bytes, list]:
    watcher = watcher or Watcher()
    config = config_module.parse({"pipeline": ["watcher"],
                                  "backends": [{"name": "test", "url": "http://127.0.0.1:9"}]}, {})
    chain = Chain(load_plugins(config.pipeline, extra={"watcher": watcher}), config)
    exchange = exchange_for({"model": "m", "max_tokens": 9, "stream": True,
                             "messages": [{"role": "user", "content": "hi"}]})
    out: list[bytes] = []

    async def write(data: bytes) -> None:
        out.append(data)

    stream = StreamRelay(chain, exchange, await chain.stream_plan(exchange), write)
    for chunk in chunks:
        await stream.feed(chunk)
    await stream.finish()
    return b"".join(out), watcher.seen


EXPECTED = [("start", "text"), ("start", "watched"), ("delta", "after 1"), ("delta", "after 2"),
            ("delta", "after 3")]


async def test_the_deltas_after_the_event_that_asked_are_seen_in_one_chunk_or_many():
    for chunks in ([STREAM], [STREAM[i:i + 1] for i in range(len(STREAM))],
                   STREAM.split(b"\n\n")):
        if chunks[-1] == b"":
            chunks = [c + b"\n\n" for c in chunks[:-1]]
        sent, seen = await relayed(chunks)
        assert sent == STREAM
        assert seen == EXPECTED


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=len(STREAM) - 1), max_size=10, unique=True))
async def test_any_chunking_gives_the_same_events_and_bytes(cuts):
    bounds = [0, *sorted(cuts), len(STREAM)]
    sent, seen = await relayed([STREAM[a:b] for a, b in zip(bounds, bounds[1:], strict=False)])
    assert sent == STREAM
    assert seen == EXPECTED


async def test_what_names_no_event_is_logged_and_the_stream_goes_on(caplog):
    sent, seen = await relayed([STREAM], Confused())
    assert sent == STREAM
    assert seen == [("start", "text"), ("start", "watched")]
    assert "relay_stream_event returned True, not an event name" in caplog.text
