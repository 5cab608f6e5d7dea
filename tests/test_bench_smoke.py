"""`make bench` cannot rot: its quick mode runs end to end and reports every figure."""

from __future__ import annotations

import json
import numbers
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the benchmark's own processes

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ("small", "history_changed", "history_unchanged", "session", "stream50",
             "stream2000", "stream2000_burst")
STREAMS = ("stream50", "stream2000", "stream2000_burst")
MEMORY = ("rss_at_rest_kib", "first_history_request_peak_delta_kib", "history_c1_peak_delta_kib",
          "history_c32_peak_delta_kib", "history_c32_peak_delta_per_request_kib",
          "per_idle_stream_kib", "peak_rss_kib", "rss_after_load_kib")


def number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def test_quick_bench_reports_every_figure(tmp_path):
    out = tmp_path / "result.json"
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "bench" / "run.py"), "--quick",
                          "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "targets pass" in run.stdout
    result = json.loads(out.read_text())

    meta = result["meta"]
    assert meta["quick"] is True and meta["workloads"] == list(WORKLOADS)
    assert meta["targets"][:4] == ["direct", "bare", "bare_skeleton", "relay"]
    assert "relay_openai" in meta["targets"] and "relay_accounting" in meta["targets"]
    assert meta["pipeline"], "the relay ran without plugins"

    for workload in WORKLOADS:
        for c in ("c1", "c32"):
            entry = result["workloads"][workload][c]
            for target in meta["targets"]:
                stats = entry[target]
                where = f"{workload} {c} {target}"
                assert stats["requests"] > 0 and stats["errors"] == 0, (where, stats["first_error"])
                for key in ("rps", "p50_ms", "p90_ms", "p99_ms", "mean_ms", "mock_cpu_ms_per_req",
                            "client_cpu_ms_per_req"):
                    assert number(stats[key]), (where, key, stats[key])
                if workload in STREAMS:
                    assert number(stats["ttfb_p50_ms"]) and number(stats["ttfb_p99_ms"]), where
                if target != "direct":
                    for key in ("proxy_cpu_ms_per_req", "added_p50_ms", "added_p99_ms",
                                "rps_vs_direct"):
                        assert number(stats[key]), (where, key, stats[key])
                    if workload in STREAMS:
                        assert number(stats["added_ttfb_p50_ms"]), where
                if target.startswith("relay") or target == "bare_skeleton":
                    assert number(stats["rps_vs_bare"]), where
            # A proxy passes the answer through: every target got the same bytes back (but
            # relay_openai, whose answers are translated from the mock's other format).
            sizes = {tuple(sorted(entry[t]["response_bytes"])) for t in meta["targets"]
                     if t != "relay_openai"}
            if workload in STREAMS:
                assert len(sizes) == 1, (workload, c, sizes)

    for proxy in meta["targets"][1:]:
        for key in MEMORY:
            assert number(result["memory"][proxy][key]), (proxy, key)
        assert number(result["per_event"][proxy]["cpu_us_per_event"])
        assert number(result["per_event"][proxy]["burst_cpu_us_per_event"])

    checks = result["checks"]
    assert checks["relay.history_unique"]["verbatim"] is True
    assert checks["relay.history_reused"]["verbatim"] is False
    assert checks["direct.history_reused"]["verbatim"] is True

    micro = result["micro"]
    assert micro["pipeline"] == meta["pipeline"]
    for case in ("changed", "unchanged", "changed_ascii", "unchanged_ascii"):
        figures = micro["request"][case]
        assert figures["as_expected"], case
        for key in ("parse_ms", "chain_ms", "request_path_ms", "upstream_body_ms",
                    "gc_ms_per_request", "live_peak_x", "parsed_body_bytes"):
            assert number(figures[key]), (case, key)
        assert figures["hooks_ms"] and set(figures["hooks_ms"]) <= set(meta["pipeline"]), case
    assert micro["request"]["unchanged"]["forwarded_verbatim"] is True
    for key in ("request_path_ms", "whole_ms", "idle_kib", "idle_small_kib"):
        assert number(micro["session"][key]), key
    sse = micro["sse"]
    assert sse["checks"]["tool_rewrite"]["changed"] is True
    assert sse["checks"]["delta"] == {"plugins": [], "changed": False}
    for key in ("passthrough_delta_us", "passthrough_delta_batched20_us", "text_block_start_us",
                "tool_use_start_new_id_us", "tool_use_start_rewrite_us", "decoder_feed_us",
                "event_parse_json_us"):
        assert number(sse[key]), key

    # The workers row: one process against --workers 2, every request answered.
    assert set(result["workers"]) == {"small", "stream50"}
    for workload, entry in result["workers"].items():
        for name in ("relay", "workers"):
            assert entry[name]["requests"] > 0 and entry[name]["errors"] == 0, (workload, name)
            assert number(entry[name]["cpu_ms_per_req"]), (workload, name)
            assert number(entry[name]["req_per_cpu_second"]), (workload, name)
        assert number(entry["cpu_per_req_ratio"]) and number(entry["rps_ratio"]), workload

    for key in ("per_request_ms", "anthropic_chunk_us", "openai_chunk_us", "added_per_chunk_us",
                "added_per_chunk_batched20_us"):
        assert number(micro["openai"][key]), key

    assert len(result["targets"]) >= 25
    for target in result["targets"]:
        assert number(target["value"]) and isinstance(target["pass"], bool), target
