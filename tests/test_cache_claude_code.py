"""The real Claude Code CLI over a twelve-turn session through the shipped pipeline, in front
of two emulated backends with prompt caches and thinking: the first reuses one tool id on
every turn (the relay's dedup renames them for the CLI) and is overloaded now and then, when
its fallback, the second, takes the turn. On each backend every request's prefix, up to the
previous request's last breakpoint, is that request's, except where the relay says why; the
cache is read wherever the prefix kept, and every miss is named.

What Claude Code 2.1.332 does itself, seen here: it rewrites its first message when a
session is resumed with another model (another environment reminder), so a resumed session
is a new conversation for the cache, whatever the relay does; and it sends a mid-conversation
`role: system` entry as a list of blocks with a breakpoint on one turn and as a string on the
next (the same prompt for the API).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml
from support import backend
from test_cache_properties import pieces
from test_claude_code import PROMPT, ClaudeCode, agent_requests, claude_binary  # noqa: F401

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
MODEL = "claude-sonnet-4-5-20250929"


def access_lines(relay) -> list[dict]:
    lines = []
    for line in relay.output().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("message") == "exchange" \
                and record.get("endpoint") == "messages":
            lines.append(record)
    return lines


def test_a_long_session_keeps_its_cache_through_id_reuse_and_fallbacks(
        emulator, relay, claude_binary, tmp_path):  # noqa: F811
    # The first backend repeats one tool id on every turn and is overloaded on every fifth
    # request (529): those go to the second, its fallback, mid-session.
    first = emulator("--prompt-cache", "--no-diagnostics", "--reuse-ids", "--tool-turns", "11",
                     "--thinking", "--signing-secret", "secret-of-the-first-backend",
                     "--fail-status", "529", "--fail-every", "5")
    second = emulator("--prompt-cache", "--no-diagnostics", "--tool-turns", "11",
                      "--thinking", "--signing-secret", "secret-of-the-second-backend")
    shipped = yaml.safe_load((ROOT / "relay.yaml").read_text())
    r = relay({"server": {"access_log": True, "log_format": "json"},
               "pipeline": shipped["pipeline"],
               "plugins": {"dump": {"dir": str(tmp_path / "dumps")},
                           "portable": {"provenance_db": str(tmp_path / "p.db")}},
               "backends": [backend(first.url, name="first", models=["claude-*"],
                                    fallbacks=["second"]),
                            backend(second.url, name="second", models=[])]})
    claude = ClaudeCode(tmp_path / "claude")
    run = claude.run(r.url, PROMPT, "--model", MODEL)
    assert run.returncode == 0, run
    assert "All 11 tool turns done." in run.stdout

    deadline = time.monotonic() + 5  # the last line is written once its answer has gone
    while len(lines := access_lines(r)) < 12 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(lines) == 12  # eleven tool turns and the last answer
    assert [line["backend"] for line in lines] == ["first"] * 4 + ["second"] + \
        ["first"] * 4 + ["second"] + ["first"] * 2
    # What each backend received, the requests it answered 529 left out.
    on = {"first": [request["body"] for n, request in enumerate(agent_requests(first), 1)
                    if n % 5], "second": [request["body"] for request in agent_requests(second)]}
    assert len(on["first"]) == 10 and len(on["second"]) == 2
    assert all(pieces(body)[1] >= 0 for bodies in on.values() for body in bodies)
    # Ids the first backend repeated reached the CLI renamed and went back up as they came.
    ids = [block["id"] for message in on["first"][-1]["messages"]
           if message["role"] == "assistant" for block in message["content"]
           if isinstance(block, dict) and block.get("type") == "tool_use"]
    assert len(ids) == 11 and len(set(ids)) == 11

    for name, bodies in on.items():
        verdicts = [line["cache"] for line in lines if line["backend"] == name]
        for i in range(1, len(bodies)):
            before, last = pieces(bodies[i - 1])
            now, _ = pieces(bodies[i])
            if now[:last + 1] == before[:last + 1]:
                # The prefix kept: the cache is read (on the first backend the turn after a
                # fallback too: the record names the switch, the upstream's read overrules).
                assert verdicts[i] == "hit", (name, i, verdicts)
            else:
                # Changed only where the relay must (a foreign thinking block left out, the
                # thinking switch it forces), and said so.
                assert verdicts[i] == "miss; cause=thinking_changed", (name, i, verdicts)
    verdicts = [line["cache"] for line in lines]
    assert verdicts[0] == "write"
    assert verdicts[4] == "miss; cause=backend_changed"
    assert set(verdicts) <= {"write", "hit", "miss; cause=backend_changed",
                             "miss; cause=thinking_changed"}, verdicts
