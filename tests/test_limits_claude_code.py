"""The real Claude Code CLI against a key whose budget is spent: the relay's 429 in the shape
of Claude Code's gateway contract (docs/accounting.md) is printed as the relay worded it, and
not retried into."""

from __future__ import annotations

import pytest
from support import backend
from test_claude_code import API_KEY, claude, claude_binary  # noqa: F401

pytestmark = pytest.mark.e2e

PRICES = [{"models": ["*"], "usd_per_mtok": {"input": 3, "output": 15, "cache_write_5m": 3.75,
                                               "cache_write_1h": 6, "cache_read": 0.3}}]


def test_a_spent_budget_is_told_not_retried(claude, emulator, relay):  # noqa: F811
    emu = emulator()
    config = {"server": {"auth": {"keys": [{"name": "team-a", "key_env": "RELAY_KEY", "limits": {
        "budget": {"usd": 0.000001, "per": "day"}}}]}},
              "pipeline": ["limits", "usage"], "plugins": {"usage": {"prices": PRICES}},
              "backends": [backend(emu.url)]}
    server = relay(config, env={"RELAY_KEY": API_KEY})
    first = claude.run(server.url, "Say hello.")
    assert first.returncode == 0, first.stderr
    sent = len(emu.requests())
    assert sent >= 1

    second = claude.run(server.url, "Say hello again.")
    assert second.returncode != 0
    printed = second.stdout + second.stderr
    # As the relay worded it (behind the CLI's own "API Error: Request rejected (429) · ").
    assert "spend limit reached: the relay key 'team-a' has used its daily budget" in printed, \
        printed
    assert len(emu.requests()) == sent  # refused before the upstream, and not retried into
    assert second.seconds < 30
