"""One Claude Code session, two backends: the real CLI, thinking on, starts on a Kimi-like
backend (``functions.Name:N`` ids, its own thinking signatures), is resumed with a model routed
to a strict Anthropic-like backend (its own signatures, Anthropic's id grammar), then resumed
back on the Kimi-like one, through a restarted relay. With the portable plugin every step
completes; without it the resumed session dies on Kimi's ids.

What Claude Code 2.1.332 does itself, as pinned here: it leaves out the thinking of turns
another model made (the transcript knows each turn's model), so a model switch alone does not
carry foreign thinking. A model name that moves to another backend (relay.yaml changed, a
fallback) does: the first request is refused with "Invalid `signature` in `thinking` block",
and the CLI re-sends the history with every thinking block stripped, for good. Through the
relay nothing is refused and each backend keeps its own thinking.
"""

from __future__ import annotations

import pytest
from support import backend
from test_claude_code import ClaudeCode, agent_requests, claude_binary, conversation  # noqa: F401

from relay.testing.emulator import EmulatorOptions, find_problem

pytestmark = pytest.mark.e2e

KIMI, CLAUDE_MODEL = "kimi-test", "claude-sonnet-4-5-20250929"
FUNCTIONS = "^[a-zA-Z0-9_.:-]+$"
SECRET_K, SECRET_A = "secret-of-the-kimi-like-backend", "secret-of-the-anthropic-like-one"


class ThinkingClaude(ClaudeCode):
    def env(self, base_url: str) -> dict:
        # Thinking on for Claude models too (Claude Code sends adaptive thinking to a model it
        # does not know, and budgeted thinking to a Claude model given a budget).
        return {**super().env(base_url), "MAX_THINKING_TOKENS": "2048"}


@pytest.fixture
def claude(claude_binary, tmp_path) -> ThinkingClaude:  # noqa: F811
    return ThinkingClaude(tmp_path / "claude")


@pytest.fixture
def setup(emulator, relay, tmp_path):
    def start(pipeline):
        kimi = emulator("--id-style", "functions", "--reuse-ids", "--parallel", "2",
                        "--thinking", "--signing-secret", SECRET_K, "--tool-turns", "2")
        strict = emulator("--thinking", "--signing-secret", SECRET_A, "--tool-turns", "5")

        def relay_for(kimi_url):
            return relay({"pipeline": pipeline,
                          "plugins": {"portable": {"provenance_db": str(tmp_path / "p.db")}}
                          if "portable" in pipeline else {},
                          "backends": [
                              backend(kimi_url, name="kimi", models=["kimi-*"],
                                      quirks={"tool_id_pattern": FUNCTIONS}),
                              backend(strict.url, name="anthropic", models=["claude-*"])]})
        return kimi, strict, relay_for
    return start


def test_a_thinking_session_moves_from_kimi_to_claude_and_back(setup, emulator, claude):
    kimi, strict, relay_for = setup(["dedup", "pairing", "ordering", "portable"])
    r = relay_for(kimi.url)
    first = claude.run(r.url, "Run the tool until you are done.", "--model", KIMI)
    assert first.returncode == 0, first
    assert "All 2 tool turns done." in first.stdout
    session = claude.transcript().stem

    second = claude.run(r.url, "continue", "--resume", session, "--model", CLAUDE_MODEL)
    assert second.returncode == 0, second
    assert "All 5 tool turns done." in second.stdout
    sent = agent_requests(strict)
    assert sent
    first_sent = conversation(sent[0]["body"])
    # Kimi's thinking stayed behind, its ids went up in a form the strict backend admits.
    assert not [b for m in first_sent if m["role"] == "assistant" for b in m["content"]
                if b["type"] == "thinking"]
    ids = [b["id"] for m in first_sent if m["role"] == "assistant" for b in m["content"]
           if b["type"] == "tool_use"]
    assert len(ids) == 4 and all(i.startswith("relayid_") for i in ids)

    # Back to a Kimi-like backend that has more to do, through a restarted relay: the record
    # of who issued which thinking block survived the restart.
    r.stop()
    kimi_again = emulator("--id-style", "functions", "--reuse-ids", "--parallel", "2",
                          "--thinking", "--signing-secret", SECRET_K, "--tool-turns", "8")
    r = relay_for(kimi_again.url)
    third = claude.run(r.url, "continue", "--resume", session, "--model", KIMI)
    assert third.returncode == 0, third
    assert "All 8 tool turns done." in third.stdout
    back = conversation(agent_requests(kimi_again)[0]["body"])
    thinking = [b["signature"] for m in back if m["role"] == "assistant" for b in m["content"]
                if b["type"] == "thinking"]
    assert len(thinking) == 3  # its own three turns' thinking, none of the other backend's

    # Claude Code itself leaves out the thinking of turns another model made (it knows each
    # turn's model): sent straight to the Kimi-like backend, the same history passes the
    # signature check, and only the ids would need the relay. A model name moved to another
    # backend is another story (below).
    kimi_again.clear()
    direct = claude.run(kimi_again.url, "continue", "--resume", session, "--model", KIMI)
    assert direct.returncode == 0, direct
    body = agent_requests(kimi_again)[0]["body"]
    shapes = [[b["type"] for b in m["content"]] for m in conversation(body)
              if m["role"] == "assistant"]
    assert [s[0] == "thinking" for s in shapes] == [True] * 3 + [False] * 3 + [True] * 3


def move(setup_relay, pipeline, tmp_path, url, name):
    """A relay where CLAUDE_MODEL goes to ``url`` as backend ``name``."""
    quirks = {"tool_id_pattern": FUNCTIONS} if name == "kimi" else {}
    return setup_relay({"pipeline": pipeline,
                        "plugins": {"portable": {"provenance_db": str(tmp_path / "p.db")}}
                        if "portable" in pipeline else {},
                        "backends": [backend(url, name=name, models=["claude-*"],
                                             quirks=quirks)]})


@pytest.mark.parametrize("portable", [True, False], ids=["portable", "without"])
def test_a_model_moved_to_another_backend_keeps_its_session(emulator, relay, claude, tmp_path,
                                                           portable):
    """The operator moves a model name to another backend (or a fallback takes it there):
    Claude Code cannot know, and sends the first backend's thinking on. Without the plugin
    the CLI pays for it with a refused request and the loss of every earlier thinking block."""
    pipeline = ["dedup", "pairing", "ordering"] + (["portable"] if portable else [])
    strict = emulator("--thinking", "--signing-secret", SECRET_A, "--tool-turns", "2")
    r = move(relay, pipeline, tmp_path, strict.url, "anthropic")
    assert claude.run(r.url, "Run the tool until you are done.", "--model",
                      CLAUDE_MODEL).returncode == 0
    session = claude.transcript().stem
    r.stop()

    kimi = emulator("--id-style", "functions", "--reuse-ids", "--parallel", "2", "--thinking",
                    "--signing-secret", SECRET_K, "--tool-turns", "5")
    r = move(relay, pipeline, tmp_path, kimi.url, "kimi")
    second = claude.run(r.url, "continue", "--resume", session, "--model", CLAUDE_MODEL)
    assert second.returncode == 0, second
    assert "All 5 tool turns done." in second.stdout
    received = agent_requests(kimi)
    judged = EmulatorOptions(id_style="functions", reuse_ids=True, parallel=2, thinking=True,
                             signing_secret=SECRET_K, tool_turns=5)
    first_problem = find_problem(received[0]["body"], judged)
    shapes = [[b["type"] for b in m["content"]] for m in conversation(received[1]["body"])
              if m["role"] == "assistant"]
    if not portable:
        # Claude Code 2.1.332 survives it, at a price: the first request is refused, and it
        # sends the history again with every thinking block stripped, for good.
        assert first_problem == "messages.1.content.0: Invalid `signature` in `thinking` block"
        assert len(received) == 4  # the refused one, then turns 3, 4 and 5
        assert all(s[0] != "thinking" for s in shapes[:3])
        return
    # Through the relay nothing is refused: turns 3, 4 and 5, one request each.
    assert first_problem is None and len(received) == 3
    r.stop()

    # And back: the Kimi-like turns' ids are translated, their thinking stays behind.
    strict_again = emulator("--thinking", "--signing-secret", SECRET_A, "--tool-turns", "8")
    r = move(relay, pipeline, tmp_path, strict_again.url, "anthropic")
    third = claude.run(r.url, "continue", "--resume", session, "--model", CLAUDE_MODEL)
    assert third.returncode == 0, third
    assert "All 8 tool turns done." in third.stdout
    body = agent_requests(strict_again)[0]["body"]
    shapes = [[b["type"] for b in m["content"]] for m in conversation(body)
              if m["role"] == "assistant"]
    assert [s[0] == "thinking" for s in shapes] == [True] * 3 + [False] * 3


def test_without_the_plugin_the_resumed_session_dies_on_kimis_ids(setup, claude):
    kimi, strict, relay_for = setup(["dedup", "pairing", "ordering"])
    r = relay_for(kimi.url)
    assert claude.run(r.url, "Run the tool until you are done.", "--model", KIMI).returncode == 0
    session = claude.transcript().stem
    second = claude.run(r.url, "continue", "--resume", session, "--model", CLAUDE_MODEL)
    assert second.returncode == 1
    assert "String should match pattern '^[a-zA-Z0-9_-]+$'" in second.stdout


@pytest.mark.parametrize("quirk", [True, False], ids=["thinking_passed_back", "default"])
def test_a_session_resumed_on_a_backend_that_wants_every_tool_turns_thinking(emulator, relay,
                                                                             claude, tmp_path,
                                                                             quirk):
    """Resumed with a model of a DeepSeek-like backend (thinking on unless disabled, every
    tool turn's thinking wanted back), the earlier turns carry no thinking it can take:
    Claude Code leaves out the other model's, and the relay would drop them anyway. With
    `thinking_passed_back` those requests go with thinking disabled and the session goes on;
    without it the backend refuses the first one."""
    strict = emulator("--thinking", "--signing-secret", SECRET_A, "--tool-turns", "2")
    signless = emulator("--unsigned-thinking", "--tool-turns", "5")
    r = relay({"pipeline": ["dedup", "pairing", "ordering", "portable"],
               "plugins": {"portable": {"provenance_db": str(tmp_path / "p.db")}},
               "backends": [backend(strict.url, name="anthropic", models=["claude-*"]),
                            backend(signless.url, name="deepseek", models=["deepseek-*"],
                                    **({"quirks": {"thinking_passed_back": True}}
                                       if quirk else {}))]})
    assert claude.run(r.url, "Run the tool until you are done.", "--model",
                      CLAUDE_MODEL).returncode == 0
    session = claude.transcript().stem
    second = claude.run(r.url, "continue", "--resume", session, "--model", "deepseek-test")
    received = agent_requests(signless)
    if not quirk:
        assert second.returncode != 0, second
        assert "must be passed back to the API" in second.stdout, second
        assert all(find_problem(request["body"], EmulatorOptions(unsigned_thinking=True))
                   for request in received)
        return
    assert second.returncode == 0, second
    assert "All 5 tool turns done." in second.stdout
    assert len(received) == 3  # turns 3, 4 and 5, none refused
    assert all(request["body"]["thinking"] == {"type": "disabled"} for request in received)
