"""The bounded record of a stream (relay.bounded.HeadTail): its first and last bytes, and how
many were left out between them, for any chunking."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from relay.bounded import HeadTail


def record(chunks, head=8, tail=8) -> HeadTail:
    kept = HeadTail(head, tail)
    for chunk in chunks:
        kept.add(chunk)
    return kept


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=30), max_size=20), st.integers(1, 20), st.integers(1, 20))
def test_the_record_is_the_stream_or_its_two_ends_and_the_count_between(chunks, head, tail):
    whole = b"".join(chunks)
    kept = record(chunks, head, tail)
    assert kept.total == len(whole)
    value = kept.value()
    if len(whole) <= head + tail:
        assert value == whole and kept.omitted == 0
        return
    # The stream's own bytes may hold the marker's words too: the marker is the one that
    # starts within the head and is followed by a count.
    found = re.compile(rb"\n\[relay: ([0-9]+) bytes left out\]\n").finditer(value)
    marker = next(m for m in found if m.start() <= head)
    first, count, last = value[:marker.start()], marker.group(1), value[marker.end():]
    assert whole.startswith(first) and whole.endswith(last)
    assert len(first) + int(count) + len(last) == len(whole)
    assert len(first) <= head and len(last) <= tail


def test_text_stays_text_at_the_cuts():
    text = "é" * 40  # two bytes each: any cut may fall inside one
    for head, tail in ((7, 9), (8, 8), (9, 7)):
        value = record([text.encode()[i:i + 5] for i in range(0, 80, 5)], head, tail).value()
        first, _, rest = value.decode("utf-8").partition("\n[relay: ")
        assert set(first) == {"é"} and set(rest.rsplit("]\n", 1)[1]) == {"é"}


def test_memory_stays_bounded_however_long_the_stream():
    kept = HeadTail(1024, 1024)
    for _ in range(100_000):
        kept.add(b"x" * 100)
    assert kept.total == 10_000_000
    assert len(kept.value()) < 2048 + 50
    assert sum(len(c) for c in kept._tail) <= 2 * 1024 + 100
