"""SSE framing: the same events whatever the chunking, line ends or line lengths."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_server import STREAM

from relay.sse import TAIL_BYTES, Event, LazyFramer, SSEDecoder


def frame(stream: bytes, cuts) -> list[Event]:
    decoder = SSEDecoder()
    events, previous = [], 0
    for cut in [*sorted(cuts), len(stream)]:
        events += decoder.feed(stream[previous:cut])
        previous = cut
    return events + decoder.close()


def fields(events):
    return [(e.name, e.data) for e in events]


EXPECTED_NAMES = ["message_start", "ping", None, "content_block_start", "content_block_delta",
                  "brand_new_event", "content_block_stop", "message_delta", "message_stop"]


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"])
def test_every_split_point_gives_the_same_events(newline):
    stream = STREAM.replace(b"\n", newline)
    whole = frame(stream, [])
    assert [e.name for e in whole] == EXPECTED_NAMES
    assert b"".join(e.raw for e in whole) == stream
    for i in range(len(stream) + 1):
        assert fields(frame(stream, [i])) == fields(whole), i


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=12),
       st.sampled_from([b"\n", b"\r\n", b"\r"]))
def test_any_chunking_gives_the_same_events_and_bytes(cuts, newline):
    stream = STREAM.replace(b"\n", newline)
    events = frame(stream, cuts)
    assert fields(events) == fields(frame(stream, []))
    assert b"".join(e.raw for e in events) == stream


def test_multi_line_data_comments_and_field_spacing():
    stream = b": keep-alive\nevent:x\ndata:{\"a\":\ndata: 1}\nid: 7\n\n"
    (comment_and_event,) = frame(stream, [])
    assert comment_and_event.name == "x"
    assert comment_and_event.data == {"a": 1}


def test_line_over_one_mebibyte_in_small_chunks():
    text = "x" * (3 * 1024 * 1024)
    payload = orjson.dumps({"type": "content_block_delta", "delta": {"text": text}})
    stream = b"event: content_block_delta\ndata: " + payload + b"\n\nevent: ping\ndata: {}\n\n"
    cuts = range(0, len(stream), 65536)
    events = frame(stream, cuts)
    assert [e.name for e in events] == ["content_block_delta", "ping"]
    assert events[0].data["delta"]["text"] == text
    assert events[0].raw == stream[:len(events[0].raw)]


def test_last_event_without_blank_line_is_kept_and_blank_lines_between_are_ignored():
    events = frame(b"\n\nevent: a\ndata: 1\n\n\n\nevent: b\ndata: 2", [3])
    assert fields(events) == [("a", 1), ("b", 2)]


def test_changed_event_is_reserialised_unchanged_is_raw():
    raw = b'event: content_block_start\ndata: {"type": "content_block_start", "index": 0}\n\n'
    event = Event(raw)
    assert event.encode() is raw
    event.data["index"] = 1
    event.mark_changed()
    assert event.encode() == (b'event: content_block_start\n'
                              b'data: {"type":"content_block_start","index":1}\n\n')


def test_non_json_data_parses_to_none():
    assert Event(b"event: x\ndata: [DONE]\n\n").data is None
    assert Event(b": only a comment\n\n").name is None


def test_stream_ending_in_a_lone_cr_keeps_both_events():
    events = frame(b"event: a\rdata: 1\r\revent: b\rdata: 2\r", [])
    assert fields(events) == [("a", 1), ("b", 2)]


def lazy_frame(stream: bytes, cuts, needles, framer=None):
    framer = framer or LazyFramer(needles)
    out, events, previous = [], [], 0
    for cut in [*sorted(cuts), len(stream)]:
        parts, found = framer.feed(stream[previous:cut])
        previous = cut
        out.extend(part if isinstance(part, bytes) else part.raw for part in parts)
        assert [part for part in parts if isinstance(part, Event)] == found
        events += found
    tail = framer.close()
    out.extend(e.raw for e in tail)
    return b"".join(out), events + tail


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=12),
       st.sampled_from([(), ("content_block_start",), ("content_block_delta", "ping")]),
       st.sampled_from([b"\n", b"\r\n"]))
def test_lazy_framing_forwards_every_byte_and_frames_every_wanted_event(cuts, wanted, newline):
    stream = STREAM.replace(b"\n", newline)
    forwarded, events = lazy_frame(stream, cuts, {*wanted, "message_stop", "error"})
    assert forwarded == stream
    names = [e.name for e in events]
    for name in (*wanted, "message_stop"):
        assert names.count(name) == stream.count(b"event: " + name.encode() + newline)


def test_lazy_framing_leaves_unwanted_runs_unframed():
    cut = STREAM.index(b"event: content_block_stop")
    forwarded, events = lazy_frame(STREAM, [cut], {"message_stop", "ping"})
    assert forwarded == STREAM
    assert [e.name for e in events] == ["ping", "message_stop"]
    _, everything = lazy_frame(STREAM, [cut], None)
    assert [e.name for e in everything] == EXPECTED_NAMES


def test_event_lines_are_matched_at_a_line_start_with_or_without_the_space():
    stream = (b'data: not json event: ping\n\n'
              b'event:ping\ndata: {"n": 1}\n\n'
              b'id: 7\nevent: ping\ndata: {"n": 2}\n\n'
              b'event: pingpong\ndata: {"n": 3}\n\n')
    forwarded, events = lazy_frame(stream, [], {"ping"})
    assert forwarded == stream
    assert [(e.name, e.data) for e in events] == [("ping", {"n": 1}), ("ping", {"n": 2})]


def test_event_names_are_matched_as_they_are_spelt_not_as_patterns():
    stream = (b'event: a.b\ndata: {"n": 1}\n\n'
              b'event: axb\ndata: {"n": 2}\n\n'
              b'event: a+\ndata: {"n": 3}\n\n'
              b'event: aa\ndata: {"n": 4}\n\n')
    forwarded, events = lazy_frame(stream, [], {"a.b", "a+"})
    assert forwarded == stream
    assert [(e.name, e.data) for e in events] == [("a.b", {"n": 1}), ("a+", {"n": 3})]


def test_names_wanted_mid_stream_are_framed_from_then_on():
    framer = LazyFramer({"message_start"})
    first, rest = STREAM[:STREAM.index(b"event: ping")], STREAM[STREAM.index(b"event: ping"):]
    parts, events = framer.feed(first)
    assert [e.name for e in events] == ["message_start"]
    framer.want({"ping", "message_stop"})
    parts, events = framer.feed(rest)
    assert b"".join(p if isinstance(p, bytes) else p.raw for p in parts) == rest
    assert [e.name for e in events] == ["ping", "message_stop"]


ENDS = ("message_stop", "error")
PING = b'event: ping\ndata: {"type": "ping"}\n\n'
ERROR = b'event: error\ndata: {"type": "error", "error": {"type": "overloaded_error"}}\n\n'


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(STREAM) + len(PING)), max_size=6),
       st.sampled_from([set(), {"content_block_start"}, {"message_stop"}, None]))
def test_the_end_of_a_stream_is_seen_without_framing_it(cuts, names):
    for stream, ended in ((STREAM, True), (STREAM + PING, True), (STREAM[:STREAM.index(b"event: message_stop")], False),
                          (STREAM[:STREAM.index(b"event: brand_new")] + ERROR, True)):
        framer = LazyFramer(names, ends=ENDS)
        forwarded, events = lazy_frame(stream, cuts, names, framer)
        assert forwarded == stream
        assert framer.ended is ended
        if names == set():
            assert events == []


def test_an_end_followed_by_more_than_the_tail_no_longer_counts():
    many_pings = PING * (TAIL_BYTES // len(PING) + 1)
    one_by_one = [PING] * (TAIL_BYTES // len(PING) + 1)  # the tail cut back only when asked
    for chunks, ended in (([STREAM, many_pings], False), ([STREAM + many_pings], False),
                          ([STREAM, *one_by_one], False), ([STREAM, *one_by_one[:3]], True),
                          ([STREAM, PING * 3], True), ([STREAM + PING * 3], True)):
        framer = LazyFramer(set(), ends=ENDS)
        for chunk in chunks:
            framer.feed(chunk)
        assert framer.ended is ended


@pytest.mark.parametrize("cut", [0, 1, 2])
def test_blank_lines_before_a_framed_event_go_out_as_they_came(cut):
    first = b'event: message_start\ndata: {"type": "message_start"}\n\n'
    stream = first + b"\n" * cut + b'\nevent: ping\ndata: {"type": "ping"}\n\n'
    forwarded, events = lazy_frame(stream, [len(first)], {"ping"})
    assert forwarded == stream
    assert [e.name for e in events] == ["ping"]
