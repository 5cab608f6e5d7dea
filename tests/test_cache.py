"""The prompt-cache fingerprint (relay/cache.py): what counts as the same prefix, and where
two requests part, in the API's words and the relay's."""

import json
from pathlib import Path

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relay import cache

CC = {"type": "ephemeral"}


def body(messages, *, tools=None, system=None, model="claude-x", dumps=json.dumps, **more):
    request = {"model": model, "max_tokens": 10, "messages": messages, **more}
    if tools is not None:
        request["tools"] = tools
    if system is not None:
        request["system"] = system
    return dumps(request).encode() if dumps is json.dumps else dumps(request)


def turn(n, marked=False):
    block = {"type": "text", "text": f"turn {n}"}
    if marked:
        block["cache_control"] = CC
    return {"role": "user" if n % 2 == 0 else "assistant", "content": [block]}


TOOLS = [{"name": "a", "input_schema": {"type": "object"}},
         {"name": "b", "input_schema": {"type": "object"}, "cache_control": CC}]
SYSTEM = [{"type": "text", "text": "you are"}, {"type": "text", "text": "terse", "cache_control": CC}]


def fp(*args, **kwargs):
    result = cache.fingerprint(body(*args, **kwargs))
    assert result is not None
    return result


@pytest.mark.parametrize("dumps", [json.dumps, orjson.dumps,
                                   lambda v: json.dumps(v, separators=(",", ":")).encode()])
def test_a_moved_breakpoint_changes_no_part(dumps):
    """Clients move their marker to the newest message each turn: the earlier turns' parts
    stay the same, whichever encoder (spaced like the Python SDK's, or compact) wrote them."""
    before = fp([turn(0), turn(1, marked=True)], tools=TOOLS, system=SYSTEM, dumps=dumps)
    after = fp([turn(0), turn(1), turn(2), turn(3, marked=True)], tools=TOOLS, system=SYSTEM,
               dumps=dumps)
    assert cache.diverge(before, after) is None
    assert before.last_breakpoint == len(before) - 1
    assert list(after.breakpoints) == [1, 4, len(after) - 1]


def test_strip_takes_the_member_and_its_comma():
    for raw, stripped in [
        (b'{"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}}',
         b'{"type": "text", "text": "a"}'),
        (b'{"cache_control":{"type":"ephemeral","ttl":"1h"},"type":"text"}', b'{"type":"text"}'),
        (b'{"type":"text","cache_control":{"type":"ephemeral"},"text":"a"}',
         b'{"type":"text","text":"a"}'),
        (b'{"cache_control":{"type":"a}b"},"type":"text"}', b'{"type":"text"}'),
        (b'{"cache_control":{"type":"ephemeral","x":{"y":1}},"type":"text"}', b'{"type":"text"}'),
        (b'{"type":"text","text":"say \\"cache_control\\": x"}',
         b'{"type":"text","text":"say \\"cache_control\\": x"}'),
    ]:
        assert cache.strip_cache_control(raw)[0] == stripped
    assert cache.strip_cache_control(
        b'{"cache_control":{"type":"ephemeral","ttl":"1h"},"type":"text"}')[1] == [3600.0]


def _without_markers(value):
    if isinstance(value, dict):
        return {k: _without_markers(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [_without_markers(v) for v in value]
    return value


def _markers(value) -> list:
    """The markers' lifetimes in the order their keys come in the JSON text."""
    if isinstance(value, dict):
        found = []
        for k, v in value.items():
            found += [cache.TTL_SECONDS[v.get("ttl", "5m")]] if k == "cache_control" \
                else _markers(v)
        return found
    if isinstance(value, list):
        return [ttl for v in value for ttl in _markers(v)]
    return []


_MARKER = st.sampled_from([{"type": "ephemeral"}, {"type": "ephemeral", "ttl": "1h"}])
_TEXT = st.text(alphabet='ab "{}:,\\', max_size=8)  # a key's bytes inside a string are escaped
_VALUES = st.recursive(
    _TEXT | st.integers(0, 9),
    lambda inner: st.lists(inner, max_size=3) | st.lists(
        st.tuples(st.sampled_from(["type", "text", "x"]), inner)
        | st.tuples(st.just("cache_control"), _MARKER), max_size=4).map(dict), max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["type", "text", "content", "x"]), _VALUES),
                max_size=4).map(dict),
       st.lists(st.tuples(st.integers(0, 4), _MARKER), max_size=2),
       st.sampled_from([json.dumps, lambda v: json.dumps(v, separators=(",", ":"))]))
def test_strip_gives_the_block_without_its_markers(block, markers, dumps):
    """Whatever holds the markers, wherever they sit (the last member, as clients put them,
    or another; one or several; nested in a block's content), and whichever encoder wrote
    it: the block's bytes without them, and their lifetimes in order, whether the caller
    found the first key already or not."""
    items = list(block.items())
    for at, marker in markers:
        items.insert(min(at, len(items)), ("cache_control", marker))
    value = dict(items)  # a repeated key counts once, as in any JSON reader
    raw = dumps(value).encode()
    expected = (dumps(_without_markers(value)).encode(), _markers(value))
    assert cache.strip_cache_control(raw) == expected
    first = raw.find(b'"cache_control"')
    if first >= 0:
        assert cache.strip_cache_control(raw, first) == expected


@pytest.mark.parametrize("change, reason, where", [
    (dict(model="claude-y"), cache.MODEL, "model"),
    (dict(speed="fast"), cache.MODEL, "model"),
    (dict(tools=TOOLS[:1] + [{**TOOLS[1], "description": "new"}]), cache.TOOLS, "tools[1]"),
    (dict(tools=TOOLS + [{"name": "c", "input_schema": {}}]), cache.TOOLS, "tools[2]"),
    (dict(tools=TOOLS[::-1]), cache.TOOLS, "tools[0]"),
    (dict(system=[SYSTEM[0], {**SYSTEM[1], "text": "verbose"}]), cache.SYSTEM, "system[1]"),
    (dict(system="one string"), cache.SYSTEM, "system[0]"),
    (dict(thinking={"type": "enabled", "budget_tokens": 2048}), cache.THINKING, "thinking"),
    (dict(tool_choice={"type": "any"}), cache.TOOL_CHOICE, "tool_choice"),
    (dict(messages=[turn(0), {"role": "assistant", "content": [
        {"type": "text", "text": "edited", "cache_control": CC}]}]),
     cache.MESSAGES, "messages[1].content[0]"),
    (dict(messages=[turn(0), {"role": "user", "content": [
        {"type": "text", "text": "turn 1", "cache_control": CC}]}]), cache.MESSAGES,
     "messages[1]"),
    (dict(messages=[turn(0)]), cache.MESSAGES, "messages[1]"),
])
def test_each_change_is_named_where_it_happened(change, reason, where):
    base = dict(messages=[turn(0), turn(1, marked=True)], tools=TOOLS, system=SYSTEM)
    previous = fp(**base)
    divergence = cache.diverge(previous, fp(**{**base, **change}))
    assert divergence is not None
    assert (divergence.reason, divergence.where, divergence.cached) == (reason, where, True)
    assert divergence.missed_bytes > 0
    assert cache.api_reason(divergence) == (
        cache.UNAVAILABLE if reason in (cache.THINKING, cache.TOOL_CHOICE) else reason)


def test_a_change_after_the_last_breakpoint_breaks_nothing_cached():
    previous = fp([turn(0, marked=True), turn(1)])
    divergence = cache.diverge(previous, fp([turn(0, marked=True), turn(3)]))
    assert divergence is not None and divergence.reason == cache.MESSAGES
    assert not divergence.cached and divergence.missed_bytes == 0


def test_automatic_caching_marks_the_last_block():
    marked = fp([turn(0), turn(1)], cache_control=CC)
    assert marked.last_breakpoint == len(marked) - 1


def test_ttl_and_round_trip():
    one = fp([{"role": "user", "content": [
        {"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}])
    assert one.ttl == 3600.0
    assert cache.Fingerprint.from_bytes(one.to_bytes()) == one


@pytest.mark.parametrize("raw", [b"not json", b"[]", b'{"model": 3, "messages": []}',
                                 b'{"model": "m", "messages": [{"role": "user", "content": 7}]}'])
def test_not_a_request(raw):
    assert cache.fingerprint(raw) is None


def test_first_difference_on_long_sequences():
    from array import array
    a = array("I", range(10_000))
    for at in (0, 1, 4_999, 9_999):
        b = array("I", a)
        b[at] = 1 << 31
        assert cache.first_difference(a, b) == at
    assert cache.first_difference(a, a[:500]) == 500


def test_every_cache_rule_names_its_sources():
    table = json.loads((Path(__file__).parent.parent / "docs" / "evidence" / "cache.json")
                       .read_text())
    assert table["rules"]
    for name, rule in table["rules"].items():
        assert rule["rule"] and rule["sources"], name


def test_the_encoders_whitespace_is_no_part_of_the_prompt():
    """The Python SDK writes `, ` and `: `; the relay re-encodes a changed request compactly:
    the same prompt either way."""
    messages = [turn(0), turn(1, marked=True)]
    spaced = fp(messages, tools=TOOLS, system=SYSTEM)
    compact = fp(messages, tools=TOOLS, system=SYSTEM, dumps=orjson.dumps)
    indented = cache.fingerprint(json.dumps(
        {"model": "claude-x", "max_tokens": 10, "messages": messages, "tools": TOOLS,
         "system": SYSTEM}, indent=2).encode())
    assert spaced == compact == indented


def test_a_string_is_the_text_block_it_stands_for():
    as_string = fp([{"role": "user", "content": "hi"}, turn(1, marked=True)], system="be terse")
    as_blocks = fp([{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                    turn(1, marked=True)], system=[{"type": "text", "text": "be terse"}])
    assert cache.diverge(as_string, as_blocks) is None
    assert cache.diverge(as_blocks, as_string) is None


def test_a_value_spelling_the_key_does_not_hide_the_marker_after_it():
    marked = b'{"type":"text","text":"cache_control","cache_control":{"type":"ephemeral"}}'
    assert cache.strip_cache_control(marked) == (b'{"type":"text","text":"cache_control"}',
                                                 [cache.TTL_SECONDS["5m"]])
