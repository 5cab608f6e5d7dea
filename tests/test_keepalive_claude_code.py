"""The real Claude Code CLI counts the relay's keep-alive as life.

Claude Code 2.1.332 watches the bytes of a streaming answer: behind a custom base URL it
aborts a stream that has sent no byte for 5 minutes (CLAUDE_BYTE_STREAM_IDLE_TIMEOUT_MS,
at least 10 s) and sends the request again. The emulator goes quiet longer than that in its
first stream: without keep-alives the CLI gives up on it and retries; with them the stream
completes once.
"""

from __future__ import annotations

import pytest
from support import backend
from test_claude_code import ClaudeCode, agent_requests, claude_binary  # noqa: F401

pytestmark = pytest.mark.e2e

WATCHDOG_MS = 10000  # the shortest the CLI allows
STALL = ("--stall-after", "3", "--stall-ms", str(WATCHDOG_MS + 2500))


class Watched(ClaudeCode):
    def env(self, base_url: str) -> dict:
        return {**super().env(base_url), "CLAUDE_BYTE_STREAM_IDLE_TIMEOUT_MS": str(WATCHDOG_MS)}


@pytest.fixture
def watched(claude_binary, tmp_path) -> Watched:  # noqa: F811
    return Watched(tmp_path / "claude")


@pytest.mark.parametrize("keepalive, attempts", [(2, 1), (0, 2)], ids=["on", "off"])
def test_a_stall_longer_than_the_clis_watchdog(emulator, relay, watched, keepalive, attempts):
    emu = emulator("--tool-turns", "1", *STALL)
    r = relay({"server": {"stream_keepalive": keepalive}, "backends": [backend(emu.url)]})
    run = watched.run(r.url)
    assert run.returncode == 0, run
    assert len(agent_requests(emu)) == attempts + 1  # the stalled turn, then one more
