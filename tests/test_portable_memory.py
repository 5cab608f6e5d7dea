"""The portable plugin's caches under a long run: every new tool call and thinking block
passes through them, so what they keep must be bounded in bytes, not only in count."""

from __future__ import annotations

import tracemalloc

from relay_builtins import portable

MiB = 1 << 20
# More distinct ids and signatures than any of the caches counts, as a relay sees them over
# hours.
DISTINCT = 10000


def held_after(step) -> int:
    """The bytes still allocated after ``step(n)`` for each n: what the caches kept."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for n in range(DISTINCT):
            step(n)
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def test_the_id_cache_keeps_a_few_mb_and_still_remembers_a_sessions_ids():
    portable._id_for_cached.cache_clear()

    def ids(n: int) -> None:
        # Ids of another grammar, translated on the way up: a short one and a long one.
        messages = [{"role": "assistant", "content": [
            {"type": "tool_use", "id": f"functions.Bash:{n}", "name": "Bash", "input": {}},
            {"type": "tool_use", "id": f"functions.Read:{n}." + "x" * 150, "name": "Read",
             "input": {}}]}]
        assert len(portable.translate_ids(messages, portable.ANTHROPIC_IDS)) == 2

    held = held_after(ids)
    assert held < 6 * MiB, f"{held / MiB:.1f} MB kept after {DISTINCT:,} ids of each length"
    hits = portable._id_for_cached.cache_info().hits
    ids(DISTINCT - 1)
    assert portable._id_for_cached.cache_info().hits == hits + 1


def test_the_signature_cache_keeps_a_few_mb():
    portable._key_cached.cache_clear()

    def signatures(n: int) -> None:
        # Of the sizes the API's come in: a few hundred characters to several KB.
        for size in (500, 4000):
            key = portable.block_key({"type": "thinking", "thinking": "",
                                      "signature": f"{n}:" + "s" * size})
            assert key and len(key) == 32

    held = held_after(signatures)
    assert held < 6 * MiB, f"{held / MiB:.1f} MB kept after {DISTINCT:,} signatures of each size"
