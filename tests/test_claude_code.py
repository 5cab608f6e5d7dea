"""The real Claude Code CLI, end to end: `claude -p ... --allowedTools Bash` in a scratch
directory, pointed at the relay (a real server) in front of the emulator, or straight at the
emulator to show what the relay saves it from.

Each CLI run gets its own HOME, TMPDIR and working directory under tmp_path, and a minimal
environment (no inherited ANTHROPIC_*, proxy or Claude settings), so it never touches the real
~/.claude. In -p mode the CLI skips onboarding and trust prompts; with
CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC it sends no telemetry, error reports or update checks.
It listens on nothing but a Unix socket under TMPDIR.

What Claude Code 2.1.332 does, as these tests pin down (and as seen by hand, where noted):

- Its traffic: only `POST /v1/messages?beta=true`, streaming, with `anthropic-beta`,
  `anthropic-version`, `x-api-key`, `x-app: cli`, `User-Agent: claude-cli/2.1.332 (external,
  sdk-cli)`, `X-Claude-Code-Session-Id` and `X-Stainless-*` headers. In -p mode it sends no
  side requests (no title, no quota check; by hand: not even with nonessential traffic
  allowed).
- Given a tool_use id it already holds, it silently drops the call, keeps the assistant's text,
  answers "(no content)" and asks again. A model that then makes its call again (the
  emulator's ``--reask-dropped``) loops until the request budget runs out; one that moves on
  gets an exit status 0 with four of five calls never run.
- It retries a 529 itself (same body, `X-Stainless-Retry-Count` stays 0).
- On `--resume` it repairs the pairing of the stored transcript before sending it: a result
  with a wrong id, a dropped result or a repeated result make it drop the orphaned call (by
  hand: results swapped between turns get it to answer one call with "[Tool result missing
  due to internal error]"). It does not move a
  `tool_result` that follows other content, so that is the broken history the CLI really
  sends. On the 400 it re-sends the request a few times in other shapes, then prints
  `API Error: 400 <message>` and exits 1; for the API's "`tool_use` ids were found without
  `tool_result` blocks immediately after" it prints "API Error: 400 due to tool use
  concurrency issues." instead, so it matches on that wording.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from support import ROOT, backend

from relay.testing.emulator import EmulatorOptions, plan_reply

pytestmark = pytest.mark.e2e

CLAUDE = Path(os.environ.get("RELAY_CLAUDE") or ROOT / ".e2e" / "node_modules" / ".bin" / "claude")
PINNED = re.search(r"^CLAUDE_CODE_VERSION := (\S+)$", (ROOT / "Makefile").read_text(),
                   re.MULTILINE)[1]
API_KEY = "sk-ant-e2e-test-key"
PROMPT = "Run the tool until you are done."
RUN_TIMEOUT = 90  # seconds for one CLI run; each takes one to three
REUSED = "toolu_01ReusedId00000000000000"
# A note before the third turn's result: the API names the call it displaced (the older
# "Did not find 1 `tool_result` block(s)" wording is superseded, see docs/evidence/rules.json).
NOT_AT_START = ("messages.7: `tool_use` ids were found without `tool_result` blocks immediately "
                f"after: {REUSED}-3. Each `tool_use` block must have a corresponding `tool_result` "
                "block in the next message.")


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    seconds: float


class ClaudeCode:
    """One scratch installation of the CLI: its HOME, TMPDIR and working directory."""

    def __init__(self, root: Path):
        self.home, self.tmp, self.workdir = root / "home", root / "tmp", root / "work"
        for path in (self.home, self.tmp, self.workdir):
            path.mkdir(parents=True)

    def env(self, base_url: str) -> dict:
        return {
            "PATH": os.environ.get("PATH", os.defpath),
            "HOME": str(self.home),
            "TMPDIR": str(self.tmp),
            "XDG_CONFIG_HOME": str(self.home / ".config"),
            "XDG_CACHE_HOME": str(self.home / ".cache"),
            "XDG_DATA_HOME": str(self.home / ".local" / "share"),
            "XDG_STATE_HOME": str(self.home / ".local" / "state"),
            "NO_PROXY": "127.0.0.1,localhost",
            "ANTHROPIC_BASE_URL": base_url,
            "ANTHROPIC_API_KEY": API_KEY,
            # No telemetry, error reports or auto-update checks: nothing leaves the machine.
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1",
        }

    def run(self, base_url: str, prompt: str = PROMPT, *args: str,
            timeout: float = RUN_TIMEOUT) -> Run:
        command = [str(CLAUDE), "-p", prompt, "--allowedTools", "Bash", *args]
        started = time.monotonic()
        proc = subprocess.Popen(command, cwd=self.workdir, env=self.env(base_url),
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the CLI and the shells it started
            stdout, stderr = proc.communicate()
            pytest.fail(f"claude did not finish within {timeout}s\nstdout:\n{stdout}\n"
                        f"stderr:\n{stderr}")
        return Run(proc.returncode, stdout, stderr, time.monotonic() - started)

    def transcript(self) -> Path:
        (path,) = self.home.glob(".claude/projects/*/*.jsonl")
        return path


@pytest.fixture(scope="session")
def claude_binary() -> Path:
    """The CLI, or a loud failure: the end-to-end suite never skips."""
    if not (CLAUDE.is_file() and os.access(CLAUDE, os.X_OK)):
        pytest.fail(f"the Claude Code CLI is missing at {CLAUDE}: run `make e2e` (it installs "
                    f"@anthropic-ai/claude-code@{PINNED}) or set RELAY_CLAUDE", pytrace=False)
    return CLAUDE


@pytest.fixture
def claude(claude_binary, tmp_path) -> ClaudeCode:
    return ClaudeCode(tmp_path / "claude")


@pytest.fixture
def dumps(tmp_path) -> Path:
    return tmp_path / "dumps"


@pytest.fixture
def through_relay(emulator, relay, dumps):
    """The emulator with these options behind a relay running the whole pipeline."""
    def start(*emulator_args: str, quirks: dict | None = None):
        emu = emulator(*emulator_args)
        extra = {"quirks": quirks} if quirks else {}
        r = relay({"pipeline": ["dedup", "pairing", "ordering", "dump"],
                   "plugins": {"dump": {"dir": str(dumps), "include_relay_rejections": True}},
                   "backends": [backend(emu.url, **extra)]})
        return emu, r
    return start


def headers_of(record: dict) -> dict:
    return {k.lower(): v for k, v in record["headers"]}


def agent_requests(emu) -> list[dict]:
    """The main loop's requests: the ones that offer Bash (side requests offer no tools)."""
    return [r for r in emu.requests() if r["path"] == "/v1/messages"
            and any(t.get("name") == "Bash" for t in (r["body"] or {}).get("tools") or [])]


def conversation(body: dict) -> list[dict]:
    """The messages without Claude Code's `role: system` entries."""
    return [m for m in body["messages"] if m["role"] != "system"]


def blocks(message: dict) -> list[dict]:
    return message["content"] if isinstance(message["content"], list) else []


def plain_text(message: dict) -> str:
    """The text of a message that holds only text (a string or text blocks)."""
    if isinstance(message["content"], str):
        return message["content"]
    assert all(b["type"] == "text" for b in message["content"]), message
    return "".join(b["text"] for b in message["content"])


def result_text(block: dict) -> str:
    content = block.get("content")
    if isinstance(content, list):
        return "".join(b.get("text", "") for b in content)
    return content or ""


def tool_turns(body: dict) -> list[list[tuple[str, str, str]]]:
    """Per assistant message with calls: (id, command, the answering result's text) per call.

    The emulator already refused any history whose results do not pair with the calls before
    them; this reads which command each call ran and what came back for it.
    """
    messages = conversation(body)
    turns = []
    for n, message in enumerate(messages):
        calls = [b for b in blocks(message) if message["role"] == "assistant"
                 and b["type"] == "tool_use"]
        if not calls:
            continue
        results = {b["tool_use_id"]: result_text(b) for b in blocks(messages[n + 1])
                   if b["type"] == "tool_result"}
        turns.append([(c["id"], c["input"]["command"], results.get(c["id"])) for c in calls])
    return turns


def suffixed(base: str, turn: int) -> str:
    return base if turn == 0 else f"{base}-{turn + 1}"


def assert_every_call_ran(turns, count: int, parallel: int) -> None:
    assert len(turns) == count
    for turn, calls in enumerate(turns):
        assert len(calls) == parallel
        for i, (_, command, output) in enumerate(sorted(calls, key=lambda c: c[1])):
            assert command == f"echo relay-turn-{turn}-{i}"
            assert output.strip() == f"relay-turn-{turn}-{i}"  # Bash really ran it


def dump_files(dumps: Path) -> list[Path]:
    return sorted(dumps.rglob("*.json")) if dumps.exists() else []


def test_the_cli_is_the_pinned_version(claude):
    version = subprocess.run([str(CLAUDE), "--version"], capture_output=True, text=True,
                             timeout=30, env=claude.env("http://127.0.0.1:9"), check=False)
    assert version.returncode == 0, version.stderr
    assert version.stdout.split()[0] == PINNED


# --- 1 and 2: an upstream that reuses its tool_use ids ---------------------------------------

REUSE_CASES = {
    # id style and parallel calls per turn: the ids the upstream hands out every turn
    "anthropic": (("--tool-turns", "5", "--reuse-ids"), [REUSED]),
    "functions-parallel": (("--tool-turns", "5", "--reuse-ids", "--id-style", "functions",
                            "--parallel", "2"), ["functions.Bash:0", "functions.Bash:1"]),
}


@pytest.mark.parametrize("case", REUSE_CASES)
def test_reused_ids_complete_through_the_relay(through_relay, claude, dumps, case):
    args, bases = REUSE_CASES[case]
    emu, r = through_relay(*args, "--reask-dropped", "--max-requests", "40")
    run = claude.run(r.url)
    assert run.returncode == 0, run
    assert "All 5 tool turns done." in run.stdout

    received = agent_requests(emu)
    assert len(received) == 6  # five tool turns and the final answer, nothing asked twice
    assert len(emu.requests()) == 6  # and no side requests: -p mode sends none
    turns = tool_turns(received[-1]["body"])
    assert_every_call_ran(turns, count=5, parallel=len(bases))
    # The client's `-N` ids go up as they are: unique for the client and the upstream alike.
    for turn, calls in enumerate(turns):
        assert sorted(c[0] for c in calls) == [suffixed(b, turn) for b in bases]
    transcript = claude.transcript().read_text()
    assert all(f'"id":"{suffixed(b, 4)}"' in transcript for b in bases)
    assert dump_files(dumps) == []  # nothing failed, so nothing was dumped

    first = headers_of(received[0])
    assert first["user-agent"].startswith(f"claude-cli/{PINNED}")
    assert first["x-api-key"] == API_KEY and first["anthropic-version"] == "2023-06-01"
    assert "claude-code-20250219" in first["anthropic-beta"]
    assert received[0]["query"] == "beta=true" and received[0]["body"]["stream"] is True


@pytest.mark.parametrize("mode", ["reject", "repair", "off"])
def test_sessions_complete_in_every_built_in_mode(through_relay, claude, dumps, mode):
    # The CLI's own histories (its `role: system` entries included) break no rule, so every
    # mode forwards them as they are: nothing refused, nothing repaired, nothing dumped.
    emu, r = through_relay("--tool-turns", "3", "--parallel", "2",
                           quirks={"pairing_mode": mode, "ordering_mode": mode})
    run = claude.run(r.url)
    assert run.returncode == 0, run
    assert "All 3 tool turns done." in run.stdout
    received = agent_requests(emu)
    assert len(received) == 4
    assert_every_call_ran(tool_turns(received[-1]["body"]), count=3, parallel=2)
    assert any(m["role"] == "system" for m in received[-1]["body"]["messages"])
    last = received[-1]["body"]
    assert "No result was recorded" not in json.dumps(last)  # no call was answered for the CLI
    roles = [m["role"] for m in conversation(last)]
    assert all(a != b for a, b in zip(roles, roles[1:], strict=False))  # as the CLI sent it: nothing merged
    assert dump_files(dumps) == []


def test_restored_ids_give_a_kimi_like_upstream_its_own_ids_back(through_relay, claude):
    emu, r = through_relay(*REUSE_CASES["functions-parallel"][0], "--expect-own-ids",
                           "--reask-dropped", "--max-requests", "40",
                           quirks={"restore_original_ids": True})
    run = claude.run(r.url)
    assert run.returncode == 0, run
    assert "All 5 tool turns done." in run.stdout
    received = agent_requests(emu)
    assert len(received) == 6
    turns = tool_turns(received[-1]["body"])
    assert_every_call_ran(turns, count=5, parallel=2)
    for calls in turns:  # the upstream sees the ids it issued, every turn
        assert sorted(c[0] for c in calls) == ["functions.Bash:0", "functions.Bash:1"]
    transcript = claude.transcript().read_text()  # while the CLI held unique ones
    assert '"id":"functions.Bash:0-5"' in transcript and '"id":"functions.Bash:1-5"' in transcript


@pytest.mark.parametrize("case", REUSE_CASES)
def test_reused_ids_sent_directly_never_complete(emulator, claude, case):
    args, bases = REUSE_CASES[case]
    budget = 12
    emu = emulator(*args, "--reask-dropped", "--max-requests", str(budget))
    run = claude.run(emu.url)
    assert run.returncode != 0
    assert "request budget exhausted" in run.stdout
    assert "All 5 tool turns done." not in run.stdout

    received = agent_requests(emu)
    assert len(received) == budget + 1  # the CLI went round until the budget refused it
    last = received[-1]["body"]
    # It never sent the duplicate up: it dropped the repeated call each time it came back, ...
    turns = tool_turns(last)
    assert_every_call_ran(turns, count=1, parallel=len(bases))
    assert sorted(c[0] for c in turns[0]) == bases
    # ... kept the assistant's text and answered "(no content)": turn 1 never ran.
    messages = conversation(last)
    assert [plain_text(m) for m in messages[3::2]] == ["Turn 1: calling Bash."] * (budget - 1)
    assert [plain_text(m) for m in messages[4::2]] == ["(no content)"] * (budget - 1)


def test_directly_without_a_model_that_asks_again_the_calls_are_lost_silently(emulator, claude):
    emu = emulator("--tool-turns", "5", "--reuse-ids", "--max-requests", "40")
    run = claude.run(emu.url)
    assert run.returncode == 0 and "All 5 tool turns done." in run.stdout  # looks fine ...
    last = agent_requests(emu)[-1]["body"]
    assert tool_turns(last) == [[(REUSED, "echo relay-turn-0-0", "relay-turn-0-0")]]
    # ... but four of the five calls never ran.
    assert [plain_text(m) for m in conversation(last)[4::2]] == ["(no content)"] * 4


# --- 3: thinking blocks ------------------------------------------------------------------------

def test_signed_thinking_survives_the_round_trip_byte_for_byte(through_relay, claude):
    secret = "e2e-thinking-secret"
    emu, r = through_relay("--tool-turns", "5", "--reuse-ids", "--thinking",
                           "--redacted-thinking", "--signing-secret", secret, "--reask-dropped",
                           "--max-requests", "40")
    run = claude.run(r.url)
    assert run.returncode == 0, run  # the emulator checks every signature and would have 400d
    assert "All 5 tool turns done." in run.stdout
    received = agent_requests(emu)
    assert len(received) == 6
    options = EmulatorOptions(tool_turns=5, reuse_ids=True, thinking=True, redacted_thinking=True,
                              signing_secret=secret, reask_dropped=True)
    sent = [plan_reply(record["body"], options)[0] for record in received[:-1]]
    came_back = [blocks(m) for m in conversation(received[-1]["body"]) if m["role"] == "assistant"]
    assert len(came_back) == 5
    for turn, (ours, theirs) in enumerate(zip(sent, came_back, strict=False)):
        thinking = [b for b in ours if b["type"] in ("thinking", "redacted_thinking")]
        assert [b["type"] for b in thinking] == ["thinking", "redacted_thinking"]
        assert theirs[:2] == thinking  # every byte of text, signature and data, in place
        assert theirs[-1]["id"] == suffixed(REUSED, turn)  # while the ids beside them changed
    assert_every_call_ran(tool_turns(received[-1]["body"]), count=5, parallel=1)


# --- 4: a broken history -----------------------------------------------------------------------

def rewrite_transcript(claude: ClaudeCode, edit) -> str:
    """Apply ``edit`` to the rows of the stored session; return the session id."""
    path = claude.transcript()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    edit(rows)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path.stem


def result_rows(rows) -> list[dict]:
    """The transcript rows that carry tool results, in order."""
    return [row for row in rows if row.get("type") == "user"
            and isinstance(row["message"]["content"], list)
            and any(b.get("type") == "tool_result" for b in row["message"]["content"])]


def note_before_the_result(rows) -> None:
    result_rows(rows)[2]["message"]["content"].insert(
        0, {"type": "text", "text": "A note that landed before the tool result."})


def result_with_a_wrong_id(rows) -> None:
    result_rows(rows)[2]["message"]["content"][0]["tool_use_id"] = "toolu_01WrongId000000000000000"


def test_a_broken_resumed_history_is_refused_with_the_apis_wording(through_relay, claude, dumps):
    emu, r = through_relay("--tool-turns", "5", "--reuse-ids", "--reask-dropped")
    assert claude.run(r.url).returncode == 0
    session = rewrite_transcript(claude, note_before_the_result)
    emu.clear()

    run = claude.run(r.url, "continue", "--resume", session)
    assert run.returncode == 1
    # The CLI knows this wording: it prints its own summary of it instead of the message.
    assert run.stdout.strip() == "API Error: 400 due to tool use concurrency issues."
    assert emu.requests() == []  # the relay refused every attempt itself
    refused = [json.loads(p.read_text()) for p in dump_files(dumps)]
    assert refused and all(d["reason"] == "rejected" for d in refused)
    assert {d["relay_error"]["message"] for d in refused} == {NOT_AT_START}
    # The CLI sent the note where the transcript had it; it did not reorder the history.
    sent = json.loads(refused[0]["client_request"]["body"])
    assert [b["type"] for b in conversation(sent)[6]["content"]] == ["text", "tool_result"]

    # Sent straight to the (strict) upstream, the same history gets the same words back.
    direct = claude.run(emu.url, "continue", "--resume", session)
    assert (direct.returncode, direct.stdout) == (run.returncode, run.stdout)
    assert len(emu.requests()) >= 1


def test_on_resume_the_cli_itself_drops_a_result_with_a_wrong_id(through_relay, claude):
    emu, r = through_relay("--tool-turns", "5", "--reuse-ids", "--reask-dropped")
    assert claude.run(r.url).returncode == 0
    session = rewrite_transcript(claude, result_with_a_wrong_id)
    emu.clear()
    run = claude.run(r.url, "continue", "--resume", session)
    assert run.returncode == 0, run
    request = agent_requests(emu)[0]
    turns = tool_turns(request["body"])
    # The call whose result it could not match is gone from the history, and so is the result.
    assert [calls[0][0] for calls in turns] == [suffixed(REUSED, t) for t in (0, 1, 3, 4)]
    assert "toolu_01WrongId" not in json.dumps(request["body"])


# --- 5: an overloaded upstream -------------------------------------------------------------------

def test_the_clis_own_retry_gets_through_an_overloaded_upstream(through_relay, claude, dumps):
    emu, r = through_relay("--fail-status", "529", "--fail-count", "2", "--tool-turns", "2")
    run = claude.run(r.url)
    assert run.returncode == 0, run
    assert "All 2 tool turns done." in run.stdout
    received = agent_requests(emu)
    assert len(received) == 5  # two 529s, the retry that passed, then two more turns
    assert len({record["body_sha256"] for record in received[:3]}) == 1  # the same request
    assert_every_call_ran(tool_turns(received[-1]["body"]), count=2, parallel=1)
    assert dump_files(dumps) == []  # 529 is not a 4xx: the default dump policy keeps none
