"""The JavaScript clients, end to end: the Vercel AI SDK (``ai`` with ``@ai-sdk/anthropic``) and
the TypeScript SDK's tool runner (``@anthropic-ai/sdk``), each a small node script in tests/js/
that runs its client's own tool loop against the relay (a real server) in front of the
emulators, executing every Bash call for real in a scratch directory.

The packages are the Makefile's pins (``JS_CLIENTS``), installed by ``make test`` next to the
Claude Code CLI in .e2e; the scripts resolve them through NODE_PATH.

What the pinned clients do, as these tests pin down:

- The Vercel AI SDK, like the Python SDK, sends a history back as it got it: given a repeated
  tool_use id it sends the duplicate on, and the upstream answers 400.
- The TypeScript SDK's tool runner threads by default: its first request carries
  ``thread: {"type": "create"}`` and the ``message-threads-2026-08-12`` beta, each later one
  ``thread: {"type": "continue", "previous_message_id": ...}`` and only the new turn. Told
  ``400`` with ``error.details.error_code: "thread_unsupported_request"``, it sends that turn
  again, and every later one, as a full history without ``thread``
  (lib/internal/threads/ThreadState.ts, ``recoversFrom``; the runner asks for
  ``continue_unthreaded``). In front of a backend that holds threads (``--threads hold``,
  ``holds_threads: true``) it keeps one thread to the end; in front of one that does not
  (``--threads refuse``, or any OpenAI-format one) the relay carries the thread, sending each
  turn up as the whole history, and the runner threads to the end as against the API.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from support import ROOT, backend

pytestmark = pytest.mark.e2e

NODE_MODULES = Path(os.environ.get("RELAY_NODE_MODULES") or ROOT / ".e2e" / "node_modules")
SCRIPTS = ROOT / "tests" / "js"
PINS = dict(re.findall(r"(@?[\w./-]+?)@(\S+)", re.search(
    r"^JS_CLIENTS := (.+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)[1]))
RUN_TIMEOUT = 60  # seconds for one script; each takes about one
REUSED = "toolu_01ReusedId00000000000000"
THREADS_BETA = "message-threads-2026-08-12"
STREAMING = pytest.mark.parametrize("mode", ["generate", "stream"])


@pytest.fixture(scope="session")
def node() -> str:
    """Node.js with the pinned clients, or a loud failure: the end-to-end suite never skips."""
    binary = shutil.which("node")
    if binary is None:
        pytest.fail("Node.js is missing: install Node.js 18+ and npm, then `make e2e`",
                    pytrace=False)
    for package, version in PINS.items():
        manifest = NODE_MODULES / package / "package.json"
        installed = json.loads(manifest.read_text())["version"] if manifest.is_file() else None
        if installed != version:
            pytest.fail(f"{package}@{version} is not installed in {NODE_MODULES} (found "
                        f"{installed}): run `make e2e`", pytrace=False)
    return binary


@pytest.fixture
def workdir(tmp_path) -> Path:
    path = tmp_path / "work"
    path.mkdir()
    return path


@pytest.fixture
def run_js(node, tmp_path, workdir):
    """Run one script against ``base_url``; its JSON report (with ``error`` when it failed)."""
    home = tmp_path / "home"
    home.mkdir()
    env = {"PATH": os.environ.get("PATH", os.defpath), "HOME": str(home),
           "NODE_PATH": str(NODE_MODULES), "NO_PROXY": "127.0.0.1,localhost"}

    def run(script: str, base_url: str, *args: str) -> dict:
        done = subprocess.run([node, str(SCRIPTS / script), base_url, str(workdir), *args],
                              cwd=workdir, env=env, capture_output=True, text=True,
                              timeout=RUN_TIMEOUT, stdin=subprocess.DEVNULL, check=False)
        lines = done.stdout.strip().splitlines()
        if not lines:
            pytest.fail(f"{script} printed nothing (exit {done.returncode}):\n{done.stderr}")
        report = json.loads(lines[-1])
        report["stderr"] = done.stderr
        assert (done.returncode != 0) == ("error" in report), done.stderr
        return report
    return run


@pytest.fixture
def dumps(tmp_path) -> Path:
    return tmp_path / "dumps"


def pipeline_config(dumps: Path, *backends: dict) -> dict:
    """The whole pipeline; every exchange, answered or not, dumped with its timeline."""
    return {"pipeline": ["dedup", "pairing", "ordering", "dump"],
            "plugins": {"dump": {"dir": str(dumps), "statuses": ["200-599"],
                                 "include_relay_rejections": True}},
            "backends": list(backends)}


def dumped(dumps: Path, count: int) -> list[dict]:
    """The dumps, once ``count`` are on disk: the relay writes them in the background after
    answering, so the last may land a moment after the client is done."""
    deadline = time.monotonic() + 10
    while True:
        files = sorted(dumps.rglob("*.json")) if dumps.exists() else []
        if len(files) >= count or time.monotonic() > deadline:
            return [json.loads(path.read_text()) for path in files]
        time.sleep(0.05)


def suffixed(base: str, turn: int) -> str:
    return base if turn == 0 else f"{base}-{turn + 1}"


def upstream_tool_ids(record: dict) -> list[list[str]]:
    return [[b["id"] for b in m["content"] if b["type"] == "tool_use"]
            for m in record["body"]["messages"]
            if m["role"] == "assistant" and isinstance(m["content"], list)]


# --- the Vercel AI SDK --------------------------------------------------------------------------

TURNS, PARALLEL = 5, 2
BASES = [f"toolu_01ReusedId{i:014d}" for i in range(PARALLEL)]


@STREAMING
def test_vercel_tool_loop_with_reused_ids_completes_through_the_relay(
        emulator, relay, run_js, dumps, mode):
    emu = emulator("--tool-turns", str(TURNS), "--reuse-ids", "--parallel", str(PARALLEL),
                   "--max-requests", "40")
    r = relay(pipeline_config(dumps, backend(emu.url)))
    out = run_js("vercel_tool_loop.cjs", r.url, mode, "12")
    assert "error" not in out, out
    assert out["text"] == f"All {TURNS} tool turns done."

    steps = out["steps"]
    assert [s["finishReason"] for s in steps] == ["tool-calls"] * TURNS + ["stop"]
    # The SDK saw every call under an id of its own, ran it, and answered that id.
    expected = [[suffixed(base, turn) for base in BASES] for turn in range(TURNS)] + [[]]
    assert [[c["id"] for c in s["calls"]] for s in steps] == expected
    assert [sorted(x["id"] for x in s["results"]) for s in steps] == [sorted(e) for e in expected]
    for turn, step in enumerate(steps[:TURNS]):
        assert sorted(c["command"] for c in step["calls"]) == [
            f"echo relay-turn-{turn}-{i}" for i in range(PARALLEL)]
        outputs = {x["id"]: x["output"] for x in step["results"]}
        for call in step["calls"]:
            assert outputs[call["id"]] == call["command"].removeprefix("echo ") + "\n"

    # Every turn reached the upstream (no 400 on the way) with ids unique in the request.
    received = emu.requests()
    assert len(received) == TURNS + 1
    assert upstream_tool_ids(received[-1]) == expected[:TURNS]

    # The relay said what it rewrote: a stream's headers leave before its events, so there
    # only the timeline has it; a whole answer's header counts it too.
    if mode == "generate":
        assert [s["rewrites"] for s in steps] == [None] + [str(PARALLEL)] * (TURNS - 1) + [None]
    else:
        assert [s["rewrites"] for s in steps] == [None] * (TURNS + 1)
    records = dumped(dumps, TURNS + 1)
    assert [(d["outcome"], [a["status"] for a in d["attempts"]]) for d in records] == [
        ("ok", [200])] * (TURNS + 1)
    rewrites = sorted(tuple(pair) for d in records for step in d["timeline"]["steps"]
                      if step["step"] == "dedup" and step.get("direction") == "to_client"
                      for pair in step["ids"])
    assert rewrites == sorted((base, suffixed(base, turn))
                              for turn in range(1, TURNS) for base in BASES)


@STREAMING
def test_vercel_tool_loop_completes_through_an_openai_format_backend_that_reuses_ids(
        emulator, relay, run_js, dumps, mode):
    emu = emulator("--format", "openai", "--tool-turns", str(TURNS), "--reuse-ids",
                   "--parallel", str(PARALLEL), "--interleave", "--max-requests", "40")
    r = relay(pipeline_config(dumps, backend(emu.url + "/v1", format="openai")))
    out = run_js("vercel_tool_loop.cjs", r.url, mode, "12")
    assert "error" not in out, out
    assert out["text"] == f"All {TURNS} tool turns done."
    steps = out["steps"]
    assert [s["finishReason"] for s in steps] == ["tool-calls"] * TURNS + ["stop"]
    ids = [c["id"] for s in steps for c in s["calls"]]
    assert len(set(ids)) == len(ids) == TURNS * PARALLEL  # the backend's call_0, call_1 each turn
    for turn, step in enumerate(steps[:TURNS]):
        assert sorted(c["command"] for c in step["calls"]) == [
            f"echo relay-turn-{turn}-{i}" for i in range(PARALLEL)]
        outputs = {x["id"]: x["output"] for x in step["results"]}
        assert {c["id"]: c["command"].removeprefix("echo ") + "\n" for c in step["calls"]} == outputs
    assert len([r for r in emu.requests() if r["path"] == "/v1/chat/completions"]) == TURNS + 1


def test_vercel_tool_loop_sent_straight_to_a_reusing_upstream_is_refused(emulator, run_js):
    emu = emulator("--tool-turns", str(TURNS), "--reuse-ids", "--max-requests", "40")
    out = run_js("vercel_tool_loop.cjs", emu.url, "generate", "12")
    assert out["error"]["status"] == 400, out
    assert "messages.3.content.1: `tool_use` ids must be unique" in out["error"]["message"]
    assert len(emu.requests()) == 3  # the SDK sent the duplicate on: its second call's answer


# --- the TypeScript SDK's tool runner -----------------------------------------------------------

RUNNER_TURNS = 3
RUNNER_MODES = pytest.mark.parametrize("mode", ["create", "stream"])
# How the emulator plays each kind of backend, and how the relay's configuration declares it.
KINDS = {
    "holding": (("--threads", "hold"), {"holds_threads": True}),
    "not-holding": (("--threads", "refuse"), {"holds_threads": False}),
    "openai": (("--format", "openai"), {"format": "openai"}),
}


def runner_through_relay(emulator, relay, dumps, kind: str, *emulator_args: str):
    args, declared = KINDS[kind]
    emu = emulator(*args, "--tool-turns", str(RUNNER_TURNS), "--max-requests", "40",
                   *emulator_args)
    url = emu.url + "/v1" if declared.get("format") == "openai" else emu.url
    return emu, relay(pipeline_config(dumps, backend(url, **declared)))


def upstream_bodies(emu) -> list[dict]:
    return [r["body"] for r in emu.requests()
            if r["path"] in ("/v1/messages", "/v1/chat/completions")]


def assert_runner_completed(out: dict) -> None:
    assert "error" not in out, out
    assert out["final"] == {"stop_reason": "end_turn",
                            "text": f"All {RUNNER_TURNS} tool turns done."}
    assert [c["command"] for c in out["calls"]] == [
        f"echo relay-turn-{turn}-0" for turn in range(RUNNER_TURNS)]
    for call in out["calls"]:
        assert call["output"] == call["command"].removeprefix("echo ") + "\n"
    assert len({c["id"] for c in out["calls"]}) == RUNNER_TURNS


@RUNNER_MODES
def test_ts_tool_runner_keeps_its_thread_on_a_backend_that_holds_threads(
        emulator, relay, run_js, dumps, mode):
    emu, r = runner_through_relay(emulator, relay, dumps, "holding")
    out = run_js("ts_tool_runner.cjs", r.url, mode, "10")
    assert_runner_completed(out)
    # One thread, created once and continued with only the new turn each time: the relay
    # refused none of the continuations, whose calls live in the part the server holds.
    sent = [(x["thread"]["type"], x["messages"], x["status"]) for x in out["exchanges"]]
    assert sent == [("create", 1, 200)] + [("continue", 1, 200)] * RUNNER_TURNS
    assert all(THREADS_BETA in x["betas"] for x in out["exchanges"])
    bodies = upstream_bodies(emu)
    assert [b["thread"]["type"] for b in bodies] == ["create"] + ["continue"] * RUNNER_TURNS
    assert [len(b["messages"]) for b in bodies] == [1] * (RUNNER_TURNS + 1)


@RUNNER_MODES
@pytest.mark.parametrize("kind", ["not-holding", "openai"])
def test_ts_tool_runner_keeps_its_thread_carried_by_the_relay_on_a_backend_without_threads(
        emulator, relay, run_js, dumps, kind, mode):
    emu, r = runner_through_relay(emulator, relay, dumps, kind)
    out = run_js("ts_tool_runner.cjs", r.url, mode, "10")
    assert_runner_completed(out)
    # The runner threads as against the API, never refused: the relay carries the thread.
    sent = [(x["thread"]["type"], x["messages"], x["status"]) for x in out["exchanges"]]
    assert sent == [("create", 1, 200)] + [("continue", 1, 200)] * RUNNER_TURNS
    # The backend never saw a thread: it got each turn as the whole history.
    bodies = upstream_bodies(emu)
    assert len(bodies) == RUNNER_TURNS + 1
    assert not any("thread" in b for b in bodies)
    if kind == "not-holding":
        assert [len(b["messages"]) for b in bodies] == [
            1 + 2 * turn for turn in range(RUNNER_TURNS + 1)]


@RUNNER_MODES
def test_ts_tool_runner_gets_unique_ids_from_a_backend_that_reuses_them(
        emulator, relay, run_js, dumps, mode):
    # Only where the relay carries the thread: what a server holds, the relay cannot rewrite,
    # so an emulator holding its own repeated ids refuses its own head; Anthropic's API, the
    # one backend known to hold threads, mints unique ids.
    emu, r = runner_through_relay(emulator, relay, dumps, "not-holding", "--reuse-ids")
    out = run_js("ts_tool_runner.cjs", r.url, mode, "10")
    assert_runner_completed(out)
    assert [c["id"] for c in out["calls"]] == [suffixed(REUSED, t) for t in range(RUNNER_TURNS)]
    assert [x["status"] for x in out["exchanges"]] == [200] * (RUNNER_TURNS + 1)
    assert upstream_tool_ids(emu.requests()[-1]) == [
        [suffixed(REUSED, t)] for t in range(RUNNER_TURNS)]
