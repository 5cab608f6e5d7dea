"""relay.usage: reading usage from answers and streams, prices in micro-dollars, the ledger
added up."""

from __future__ import annotations

import orjson
import pytest

from relay.errors import ConfigError
from relay.usage import (
    StreamMeter,
    Usage,
    aggregate,
    answer_fields,
    from_answer,
    parse_prices,
    parse_time,
    usd,
)

SONNET = {"models": ["claude-sonnet-*"],
          "usd_per_mtok": {"input": 3, "output": 15, "cache_write_5m": 3.75,
                           "cache_write_1h": 6, "cache_read": 0.30},
          "usd_per_server_tool_request": {"web_search": 0.01}}


def test_a_cache_read_is_not_fresh_input_and_a_write_is_not_counted_twice():
    # The answer of LiteLLM #9812: 3 fresh tokens, 12304 written to the cache.
    usage = from_answer({"input_tokens": 3, "cache_creation_input_tokens": 12304,
                         "cache_read_input_tokens": 0, "output_tokens": 550})
    assert usage == Usage(input_tokens=3, output_tokens=550, cache_write_5m_input_tokens=12304)
    # Anthropic's console billed it $0.05439 for Claude 3.7 Sonnet ($3/$15, writes $3.75).
    assert parse_prices([SONNET]).price(usage, "claude-sonnet-3-7").cost_micro_usd == 54399


def test_cache_writes_are_split_by_lifetime():
    usage = from_answer({"input_tokens": 10, "output_tokens": 5, "cache_read_input_tokens": 7,
                         "cache_creation_input_tokens": 300,
                         "cache_creation": {"ephemeral_5m_input_tokens": 100,
                                            "ephemeral_1h_input_tokens": 200}})
    assert (usage.cache_write_5m_input_tokens, usage.cache_write_1h_input_tokens) == (100, 200)
    assert usage.cache_read_input_tokens == 7 and usage.input_tokens == 10
    # 10*3 + 5*15 + 7*0.3 + 100*3.75 + 200*6 = 30 + 75 + 2.1 + 375 + 1200
    assert parse_prices([SONNET]).price(usage, "claude-sonnet-4-5").cost_micro_usd == 1682


def test_a_total_without_its_split_is_five_minute_writes():
    usage = from_answer({"input_tokens": 1, "output_tokens": 1,
                         "cache_creation_input_tokens": 40})
    assert (usage.cache_write_5m_input_tokens, usage.cache_write_1h_input_tokens) == (40, 0)


def test_server_tool_requests_are_counted_and_priced():
    usage = from_answer({"input_tokens": 0, "output_tokens": 0,
                         "server_tool_use": {"web_search_requests": 3, "web_fetch_requests": 1}})
    assert usage.server_tool_requests == {"web_search": 3, "web_fetch": 1}
    # $0.01 a search; web_fetch has no price of its own here: tokens only.
    assert parse_prices([SONNET]).price(usage, "claude-sonnet-4").cost_micro_usd == 30000


def test_values_that_are_not_counts_are_not_counted_and_flagged():
    usage = from_answer({"input_tokens": "12", "output_tokens": -1, "cache_read_input_tokens": 2.5,
                         "cache_creation": "x", "server_tool_use": {"web_search_requests": True}})
    assert usage == Usage(reported=False)


@pytest.mark.parametrize("reported, counted", [
    (None, Usage()),  # an answer without usage
    ({"input_tokens": 7}, Usage(input_tokens=7)),
    ({"output_tokens": 7, "input_tokens": None}, Usage(output_tokens=7)),
    ({"input_tokens": 7, "output_tokens": "3"}, Usage(input_tokens=7)),
    # A cache-write split larger than its total: the counts contradict each other.
    ({"input_tokens": 1, "output_tokens": 1, "cache_creation_input_tokens": 10,
      "cache_creation": {"ephemeral_5m_input_tokens": 10, "ephemeral_1h_input_tokens": 5}},
     Usage(input_tokens=1, output_tokens=1, cache_write_5m_input_tokens=10,
           cache_write_1h_input_tokens=5)),
])
def test_an_answer_that_does_not_report_its_usage_in_full_counts_what_it_gave_flagged(
        reported, counted):
    counted.reported = False
    assert from_answer(reported) == counted


def test_an_integral_float_count_is_its_integer():
    # JSON has no integer type: 12.0 is the number 12.
    assert from_answer({"input_tokens": 12.0, "output_tokens": 3}) == Usage(input_tokens=12,
                                                                           output_tokens=3)


def test_a_stream_whose_events_carry_no_usage_is_flagged():
    meter = StreamMeter()
    meter.message_start({"message": {"model": "m"}})
    usage = meter.message_delta({"delta": {"stop_reason": "end_turn"}})
    assert usage == Usage(reported=False)
    # message_start's output count is the first token, not the stream's.
    meter = StreamMeter()
    meter.message_start({"message": {"usage": {"input_tokens": 9, "output_tokens": 1}}})
    assert meter.message_delta({"usage": {"input_tokens": 9}}) == Usage(
        input_tokens=9, output_tokens=1, reported=False)
    # Some backends give all of it in the message_delta: reported.
    meter = StreamMeter()
    meter.message_start({"message": {"usage": None}})
    assert meter.message_delta({"usage": {"input_tokens": 9, "output_tokens": 4}}) == Usage(
        input_tokens=9, output_tokens=4)


def test_a_stream_takes_its_input_from_message_start_and_the_last_delta_replaces():
    meter = StreamMeter()
    meter.message_start({"type": "message_start", "message": {
        "model": "claude-sonnet-4-5-20250929",
        "usage": {"input_tokens": 20, "output_tokens": 1, "cache_read_input_tokens": 1000,
                  "cache_creation_input_tokens": 50,
                  "cache_creation": {"ephemeral_5m_input_tokens": 0,
                                     "ephemeral_1h_input_tokens": 50}}}})
    assert meter.model == "claude-sonnet-4-5-20250929" and not meter.usage.complete
    meter.message_delta({"type": "message_delta", "usage": {"output_tokens": 200}})
    # Cumulative: the second delta's 350 is the stream's output, not 200 + 350.
    usage = meter.message_delta({"type": "message_delta", "usage": {
        "output_tokens": 350, "input_tokens": 20, "cache_read_input_tokens": 1000,
        "cache_creation_input_tokens": 50, "server_tool_use": {"web_search_requests": 1}}})
    assert usage == Usage(input_tokens=20, output_tokens=350, cache_read_input_tokens=1000,
                          cache_write_1h_input_tokens=50, server_tool_requests={"web_search": 1},
                          complete=True)


def test_a_stream_cut_before_its_delta_is_incomplete_and_keeps_what_was_reported():
    meter = StreamMeter()
    usage = meter.message_start({"message": {"usage": {"input_tokens": 9, "output_tokens": 1}}})
    assert usage == Usage(input_tokens=9, output_tokens=1, complete=False)


def test_a_translated_stream_reports_everything_in_its_delta():
    # What relay/formats/openai makes of a Chat Completions stream: zeros at the start, the
    # usage chunk's counts in the message_delta.
    meter = StreamMeter()
    meter.message_start({"message": {"model": "gpt-4.1-mini",
                                     "usage": {"input_tokens": 0, "output_tokens": 0}}})
    usage = meter.message_delta({"usage": {"input_tokens": 60, "output_tokens": 7,
                                           "cache_creation_input_tokens": 0,
                                           "cache_read_input_tokens": 40}})
    assert usage == Usage(input_tokens=60, output_tokens=7, cache_read_input_tokens=40)


def test_answer_fields_reads_only_model_and_usage():
    body = orjson.dumps({"id": "msg_1", "model": "claude-x", "content": [{"type": "text",
                         "text": "hi" * 1000}], "usage": {"input_tokens": 4}})
    assert answer_fields(body) == ("claude-x", {"input_tokens": 4})
    assert answer_fields(b"not json") == (None, None)
    assert answer_fields(b"[1, 2]") == (None, None)
    assert answer_fields(b'{"model": 3, "usage": []}') == (None, None)


def test_money_is_exact_and_rounded_once():
    prices = parse_prices([{"models": ["m"], "usd_per_mtok": {
        "input": 0.1, "output": 0.2, "cache_write_5m": 0.125, "cache_write_1h": 0,
        "cache_read": "0.01"}}])
    # 0.1 + 0.2 in floats is 0.30000000000000004; here it is 0.3, then half up: 1 µ$.
    assert prices.price(Usage(input_tokens=1, output_tokens=1), "m").cost_micro_usd == 0
    assert prices.price(Usage(input_tokens=3, output_tokens=1), "m").cost_micro_usd == 1
    assert prices.price(Usage(cache_write_5m_input_tokens=4), "m").cost_micro_usd == 1  # 0.5
    assert prices.price(Usage(cache_read_input_tokens=10 ** 9), "m").cost_micro_usd == 10 ** 7
    assert usd(1234567) == "1.234567" and usd(5) == "0.000005" and usd(None) == "-"


def test_the_first_matching_entry_wins_and_a_model_without_a_price_is_none():
    prices = parse_prices([
        {"models": ["claude-opus-5-5*"], "usd_per_mtok": dict.fromkeys(
            ("input", "output", "cache_write_5m", "cache_write_1h", "cache_read"), 4)},
        {"models": ["claude-opus-*", "opus"], "usd_per_mtok": dict.fromkeys(
            ("input", "output", "cache_write_5m", "cache_write_1h", "cache_read"), 5)}])
    one = Usage(input_tokens=1_000_000)
    assert prices.price(one, "claude-opus-5-5").cost_micro_usd == 4_000_000
    assert prices.price(one, "claude-opus-5").cost_micro_usd == 5_000_000
    assert prices.price(one, "opus").cost_micro_usd == 5_000_000
    assert prices.price(one, "claude-sonnet-5").cost_micro_usd is None
    assert prices.price(one, None).cost_micro_usd is None


@pytest.mark.parametrize("entry, where", [
    ({"usd_per_mtok": {}}, "prices.0.models"),
    ({"models": ["m"]}, "prices.0.usd_per_mtok"),
    ({"models": ["m"], "usd_per_mtok": {"input": 1}}, "prices.0.usd_per_mtok.output"),
    ({"models": ["m"], "usd_per_mtok": {**SONNET["usd_per_mtok"], "inptu": 1}},
     "prices.0.usd_per_mtok.inptu"),
    ({"models": ["m"], "usd_per_mtok": {**SONNET["usd_per_mtok"], "input": -1}},
     "prices.0.usd_per_mtok.input"),
    ({"models": ["m"], "usd_per_mtok": {**SONNET["usd_per_mtok"], "input": "cheap"}},
     "prices.0.usd_per_mtok.input"),
    ({"models": ["m"], "usd_per_mtok": {**SONNET["usd_per_mtok"], "output": True}},
     "prices.0.usd_per_mtok.output"),
    ({"models": ["m"], "usd_per_mtok": SONNET["usd_per_mtok"], "per_request": {}},
     "prices.0.per_request"),
])
def test_a_bad_price_names_its_key(entry, where):
    with pytest.raises(ConfigError) as failed:
        parse_prices([entry])
    assert str(failed.value).startswith(where + ":")


def test_parse_time_reads_dates_and_iso_times():
    assert parse_time("2026-12-01") == 1796083200.0
    assert parse_time("2026-12-01", end=True) == 1796083200.0 + 86400
    assert parse_time("2026-12-01T01:00:00Z") == 1796083200.0 + 3600
    assert parse_time("2026-12-01T02:00:00+01:00") == 1796083200.0 + 3600
    assert parse_time("2026-12-01T01:00:00") == 1796083200.0 + 3600
    with pytest.raises(ValueError):
        parse_time("yesterday")


def test_aggregate_adds_up_by_group_and_flags_unpriced_rows():
    day = 1796083200.0
    rows = [
        {"time": day + 10, "key": "a", "model": "m1", "backend": "b", "input_tokens": 1,
         "output_tokens": 2, "cache_read_input_tokens": 3, "cache_write_5m_input_tokens": 4,
         "cache_write_1h_input_tokens": 5, "cost_micro_usd": 100},
        {"time": day + 86400, "key": "a", "model": "m2", "backend": "b", "input_tokens": 10,
         "output_tokens": 0, "cost_micro_usd": None},
        {"time": day + 20, "key": None, "model": "m1", "backend": "b", "cost_micro_usd": 7},
    ]
    assert aggregate(rows, "key") == [
        {"key": "a", "requests": 2, "input_tokens": 11, "output_tokens": 2,
         "cache_read_input_tokens": 3, "cache_write_5m_input_tokens": 4,
         "cache_write_1h_input_tokens": 5, "cost_micro_usd": 100, "unpriced_requests": 1,
         "unreported_requests": 0},
        {"key": None, "requests": 1, "input_tokens": 0, "output_tokens": 0,
         "cache_read_input_tokens": 0, "cache_write_5m_input_tokens": 0,
         "cache_write_1h_input_tokens": 0, "cost_micro_usd": 7, "unpriced_requests": 0,
         "unreported_requests": 0}]
    assert [(g["day"], g["requests"]) for g in aggregate(rows, "day")] == [
        ("2026-12-01", 2), ("2026-12-02", 1)]
    assert [(g["model"], g["cost_micro_usd"]) for g in aggregate(rows, "model")] == [
        ("m1", 107), ("m2", 0)]
    assert aggregate([], "backend") == []
    with pytest.raises(ValueError):
        aggregate(rows, "colour")


def framed(name: str, data: dict, eol: bytes = b"\n") -> bytes:
    return b"event: " + name.encode() + eol + b"data: " + orjson.dumps(data) + eol + eol


@pytest.mark.parametrize("eol", [b"\n", b"\r\n"])
def test_a_stream_is_read_from_its_events_bytes(eol):
    meter = StreamMeter()
    start = {"type": "message_start", "message": {"model": "claude-x", "content": [],
                                                   "usage": {"input_tokens": 5, "output_tokens": 1}}}
    assert meter.event("message_start", framed("message_start", start, eol)) == Usage(
        input_tokens=5, output_tokens=1, complete=False)
    assert meter.model == "claude-x"
    delta = {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
             "usage": {"output_tokens": 40}}
    assert meter.event("message_delta", framed("message_delta", delta, eol)) == Usage(
        input_tokens=5, output_tokens=40, complete=True)


def test_a_stream_read_from_its_bytes_without_usage_is_flagged():
    meter = StreamMeter()
    start = {"type": "message_start", "message": {"model": "claude-x", "content": []}}
    assert meter.event("message_start", framed("message_start", start)) == Usage(
        complete=False)
    delta = {"type": "message_delta", "delta": {"stop_reason": "end_turn"}}
    assert meter.event("message_delta", framed("message_delta", delta)) == Usage(
        reported=False)


@pytest.mark.parametrize("raw", [
    b'event: message_delta\ndata: {"usage":\ndata: {"output_tokens": 3}}\n\n',  # two lines
    b'event: message_delta\ndata: {"usage": \n\n',                             # not JSON
    b'event: message_delta\n\n',                                             # no data
    b'event: message_start\ndata: {"message": [1]}\n\n',                      # not a message
])
def test_events_framed_otherwise_are_left_to_the_parsed_data(raw):
    meter = StreamMeter()
    assert meter.event("message_start" if b"start" in raw else "message_delta", raw) is None
    assert meter.usage == Usage(complete=False)


def test_aggregate_keeps_to_its_window():
    rows = [{"time": t, "key": "a", "cost_micro_usd": 1} for t in (10.0, 20.0, 30.0)]
    assert [g["requests"] for g in aggregate(rows, "key", since=20.0)] == [2]
    assert [g["requests"] for g in aggregate(rows, "key", since=10.0, until=30.0)] == [2]
    assert aggregate(rows, "key", until=10.0) == []
