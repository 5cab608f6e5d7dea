"""The real Claude Code CLI through a relay whose backend holds a pool of two keys: the
session's first credential runs out of its budget mid-session, and the session finishes on
the second (relay.pools)."""

from __future__ import annotations

import pytest
from support import backend
from test_claude_code import (  # noqa: F401  (fixtures)
    agent_requests,
    assert_every_call_ran,
    claude,
    claude_binary,
    headers_of,
    tool_turns,
)

pytestmark = pytest.mark.e2e

KEYS = {"POOL_A": "sk-ant-pool-e2e-key-a-00000000", "POOL_B": "sk-ant-pool-e2e-key-b-11111111"}
NAME_OF = {KEYS["POOL_A"]: "a", KEYS["POOL_B"]: "b"}


def test_a_session_whose_credential_runs_out_finishes_on_the_next(emulator, relay, claude):
    # Four requests on each key per ten minutes: the seven of a six-turn session cannot all
    # go with one.
    emu = emulator("--tool-turns", "6", "--key-budget", "4", "--key-window", "600")
    r = relay({"pipeline": ["dedup", "pairing", "ordering"],
               "backends": [backend(emu.url, credentials=[
                   {"name": "a", "key_env": "POOL_A"}, {"name": "b", "key_env": "POOL_B"}])]},
              env=KEYS)
    run = claude.run(r.url)
    assert run.returncode == 0, run
    assert "All 6 tool turns done." in run.stdout
    received = agent_requests(emu)
    keys = [NAME_OF[headers_of(record)["x-api-key"]] for record in received]
    # Each turn on one credential at a time: four on a, its 429 on the fifth, then b.
    assert keys == ["a"] * 5 + ["b"] * 3, keys
    assert_every_call_ran(tool_turns(received[-1]["body"]), count=6, parallel=1)
    sessions = {headers_of(record)["x-claude-code-session-id"] for record in received}
    assert len(sessions) == 1
    assert all(key not in run.stdout + run.stderr for key in KEYS.values())
