"""The official anthropic SDK drives a real agent loop through the relay: it runs each Bash call
for real (bounded, in a scratch directory) and sends the output back, streaming and not, in the
scenarios test_claude_code.py runs with the CLI.

Unlike Claude Code, the SDK sends a history back as it got it: given a repeated tool_use id it
sends the duplicate on, and the upstream answers 400.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import anthropic
import pytest
from support import backend

from relay.testing.emulator import EmulatorOptions, plan_reply

pytestmark = pytest.mark.e2e

MODEL = "claude-e2e-test"
API_KEY = "sk-ant-e2e-test-key"
BASH = {"name": "Bash", "description": "Run a shell command and return its output.",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}},
                         "required": ["command"]}}
MAX_TURNS = 12  # every session below ends well before this
COMMAND_TIMEOUT = 10
REUSED = "toolu_01ReusedId00000000000000"

STREAMING = pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])


def client(url: str, **options) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=API_KEY, timeout=30, **options)


def run_bash(command: str, workdir: Path) -> dict:
    """Run the call for real, as an agent does; its output (or failure) is the result."""
    try:
        done = subprocess.run(["bash", "-c", command], cwd=workdir, capture_output=True,
                              text=True, timeout=COMMAND_TIMEOUT, stdin=subprocess.DEVNULL,
                              check=False)
    except subprocess.TimeoutExpired:
        return {"content": f"timed out after {COMMAND_TIMEOUT}s", "is_error": True}
    output = done.stdout + done.stderr
    return {"content": output or "(no output)", "is_error": done.returncode != 0}


class Agent:
    """A tool loop: ask, run every Bash call, answer with the results, until the model is done."""

    def __init__(self, sdk: anthropic.Anthropic, workdir: Path, stream: bool):
        self.sdk, self.workdir, self.stream = sdk, workdir, stream
        self.messages: list[dict] = [{"role": "user",
                                      "content": "Run the tool until you are done."}]
        self.calls: list[tuple[str, str, str]] = []  # (id, command, output) of every call

    def ask(self) -> anthropic.types.Message:
        request = {"model": MODEL, "max_tokens": 1024, "tools": [BASH],
                   "messages": self.messages}
        if self.stream:
            with self.sdk.messages.stream(**request) as events:
                return events.get_final_message()
        return self.sdk.messages.create(**request)

    def run(self) -> anthropic.types.Message:
        for _ in range(MAX_TURNS):
            message = self.ask()
            # The SDK's own idiom: the response's content blocks go back as they came.
            self.messages.append({"role": "assistant", "content": message.content})
            if message.stop_reason != "tool_use":
                return message
            results = []
            for call in (b for b in message.content if b.type == "tool_use"):
                result = run_bash(call.input["command"], self.workdir)
                self.calls.append((call.id, call.input["command"], result["content"]))
                results.append({"type": "tool_result", "tool_use_id": call.id, **result})
            self.messages.append({"role": "user", "content": results})
        raise AssertionError(f"the session did not end within {MAX_TURNS} turns")


@pytest.fixture
def through_relay(emulator, relay, tmp_path):
    """The emulator with these options behind a relay running the whole pipeline."""
    def start(*emulator_args: str, quirks: dict | None = None):
        emu = emulator(*emulator_args)
        extra = {"quirks": quirks} if quirks else {}
        r = relay({"pipeline": ["dedup", "pairing", "ordering", "dump"],
                   "plugins": {"dump": {"dir": str(tmp_path / "dumps"),
                                        "include_relay_rejections": True}},
                   "backends": [backend(emu.url, **extra)]})
        return emu, r
    return start


@pytest.fixture
def workdir(tmp_path) -> Path:
    path = tmp_path / "work"
    path.mkdir()
    return path


def upstream_calls(record: dict) -> list[list[dict]]:
    """The tool_use blocks of each assistant turn of a request the emulator received."""
    turns = []
    for message in record["body"]["messages"]:
        if message["role"] == "assistant" and isinstance(message["content"], list):
            calls = [b for b in message["content"] if b["type"] == "tool_use"]
            if calls:
                turns.append(calls)
    return turns


def upstream_results(record: dict) -> dict[str, str]:
    return {b["tool_use_id"]: b["content"] for m in record["body"]["messages"]
            if m["role"] == "user" and isinstance(m["content"], list)
            for b in m["content"] if b["type"] == "tool_result"}


def suffixed(base: str, turn: int) -> str:
    return base if turn == 0 else f"{base}-{turn + 1}"


def assert_every_call_ran(agent: Agent, turns: int, parallel: int) -> None:
    expected = sorted(f"echo relay-turn-{t}-{i}" for t in range(turns) for i in range(parallel))
    assert sorted(command for _, command, _ in agent.calls) == expected
    for _, command, output in agent.calls:
        assert output == command.removeprefix("echo ") + "\n"  # Bash really ran it


# --- 1 and 2: an upstream that reuses its tool_use ids ---------------------------------------

REUSE_CASES = {
    "anthropic": (("--tool-turns", "5", "--reuse-ids"), [REUSED]),
    "functions-parallel": (("--tool-turns", "5", "--reuse-ids", "--id-style", "functions",
                            "--parallel", "2"), ["functions.Bash:0", "functions.Bash:1"]),
}


@STREAMING
@pytest.mark.parametrize("case", REUSE_CASES)
def test_reused_ids_complete_through_the_relay(through_relay, workdir, case, stream):
    args, bases = REUSE_CASES[case]
    emu, r = through_relay(*args, "--max-requests", "40")
    agent = Agent(client(r.url, max_retries=0), workdir, stream)
    final = agent.run()
    assert final.stop_reason == "end_turn"
    assert final.content[-1].text == "All 5 tool turns done."
    assert_every_call_ran(agent, turns=5, parallel=len(bases))
    held = [call_id for call_id, _, _ in agent.calls]
    assert held == [suffixed(b, t) for t in range(5) for b in bases]  # unique for the client

    received = emu.requests()
    assert len(received) == 6
    # The upstream gets the client's `-N` ids as they are, each answered by what Bash printed.
    turns = upstream_calls(received[-1])
    assert [[c["id"] for c in calls] for calls in turns] == [
        [suffixed(b, t) for b in bases] for t in range(5)]
    results = upstream_results(received[-1])
    assert {c["id"]: c["input"]["command"].removeprefix("echo ") + "\n"
            for calls in turns for c in calls} == results


@STREAMING
def test_restored_ids_give_a_kimi_like_upstream_its_own_ids_back(through_relay, workdir, stream):
    emu, r = through_relay(*REUSE_CASES["functions-parallel"][0], "--expect-own-ids",
                           quirks={"restore_original_ids": True})
    agent = Agent(client(r.url, max_retries=0), workdir, stream)
    assert agent.run().stop_reason == "end_turn"
    assert_every_call_ran(agent, turns=5, parallel=2)
    assert len({call_id for call_id, _, _ in agent.calls}) == 10
    turns = upstream_calls(emu.requests()[-1])
    assert [[c["id"] for c in calls] for calls in turns] == [
        ["functions.Bash:0", "functions.Bash:1"]] * 5


def test_reused_ids_sent_directly_are_refused(emulator, workdir):
    emu = emulator("--tool-turns", "5", "--reuse-ids")
    agent = Agent(client(emu.url, max_retries=0), workdir, stream=False)
    with pytest.raises(anthropic.BadRequestError) as refused:
        agent.run()
    assert refused.value.status_code == 400
    assert refused.value.body["error"]["message"] == (
        "messages.3.content.1: `tool_use` ids must be unique")
    # The SDK held the duplicate and sent it on; only the first call ever ran.
    assert [call_id for call_id, _, _ in agent.calls] == [REUSED, REUSED]
    assert len(emu.requests()) == 3


# --- 3: thinking blocks ------------------------------------------------------------------------

@STREAMING
def test_signed_thinking_survives_the_round_trip_byte_for_byte(through_relay, workdir, stream):
    secret = "e2e-thinking-secret"
    emu, r = through_relay("--tool-turns", "5", "--reuse-ids", "--parallel", "2", "--thinking",
                           "--redacted-thinking", "--signing-secret", secret)
    agent = Agent(client(r.url, max_retries=0), workdir, stream)
    assert agent.run().stop_reason == "end_turn"  # the emulator checks every signature
    assert_every_call_ran(agent, turns=5, parallel=2)
    received = emu.requests()
    assert len(received) == 6
    options = EmulatorOptions(tool_turns=5, reuse_ids=True, parallel=2, thinking=True,
                              redacted_thinking=True, signing_secret=secret)
    sent = [plan_reply(record["body"], options)[0] for record in received[:-1]]
    came_back = [m["content"] for m in received[-1]["body"]["messages"]
                 if m["role"] == "assistant"]
    for ours, theirs in zip(sent, came_back, strict=True):
        thinking = [b for b in ours if b["type"] in ("thinking", "redacted_thinking")]
        assert [b["type"] for b in thinking] == ["thinking", "redacted_thinking"]
        assert theirs[:2] == thinking  # every byte of text, signature and data, in place


# --- 4: broken histories -------------------------------------------------------------------------

def call(call_id: str) -> dict:
    return {"type": "tool_use", "id": call_id, "name": "Bash", "input": {"command": "true"}}


def result(call_id: str) -> dict:
    return {"type": "tool_result", "tool_use_id": call_id, "content": "(no output)"}


def text(value: str) -> dict:
    return {"type": "text", "text": value}


ASK = {"role": "user", "content": "Run the tool."}
BROKEN = {
    "wrong-id": ([ASK, {"role": "assistant", "content": [call("toolu_01A")]},
                  {"role": "user", "content": [result("toolu_01B")]}],
                 ("messages.2.content.0: unexpected `tool_use_id` found in `tool_result` blocks: "
                  "toolu_01B. Each `tool_result` block must have a corresponding `tool_use` "
                  "block in the previous message.")),
    "dropped-result": ([ASK,
                        {"role": "assistant", "content": [call("toolu_01A"), call("toolu_01B")]},
                        {"role": "user", "content": [result("toolu_01A"), text("go on")]}],
                       ("messages.2: `tool_use` ids were found without `tool_result` blocks "
                        "immediately after: toolu_01B. Each `tool_use` block must have a "
                        "corresponding `tool_result` block in the next message.")),
    "note-first": ([ASK, {"role": "assistant", "content": [call("toolu_01A")]},
                    {"role": "user", "content": [text("a note"), result("toolu_01A")]}],
                   ("messages.2: `tool_use` ids were found without `tool_result` blocks "
                    "immediately after: toolu_01A. Each `tool_use` block must have a "
                    "corresponding `tool_result` block in the next message.")),
}


@STREAMING
@pytest.mark.parametrize("case", BROKEN)
def test_a_broken_history_is_refused_with_the_apis_wording(through_relay, emulator, case, stream):
    messages, wording = BROKEN[case]
    request = {"model": MODEL, "max_tokens": 100, "tools": [BASH], "messages": messages}

    def send(url: str) -> anthropic.BadRequestError:
        sdk = client(url, max_retries=2)  # a 400 is final: the SDK does not retry it
        with pytest.raises(anthropic.BadRequestError) as refused:
            if stream:
                with sdk.messages.stream(**request) as events:
                    events.get_final_message()
            else:
                sdk.messages.create(**request)
        return refused.value

    emu, r = through_relay()
    by_relay = send(r.url)
    assert by_relay.status_code == 400
    assert by_relay.body["type"] == "error"
    assert by_relay.body["error"] == {"type": "invalid_request_error", "message": wording}
    assert emu.requests() == []  # refused before any upstream saw it

    upstream = emulator()  # the strict upstream, asked directly, words it the same
    assert send(upstream.url).body["error"] == by_relay.body["error"]
    assert len(upstream.requests()) == 1


# --- 5: an overloaded upstream -------------------------------------------------------------------

@STREAMING
def test_the_sdks_own_retry_gets_through_an_overloaded_upstream(through_relay, workdir, stream):
    emu, r = through_relay("--fail-status", "529", "--fail-count", "2", "--tool-turns", "2")
    agent = Agent(client(r.url, max_retries=2), workdir, stream)
    final = agent.run()
    assert final.content[-1].text == "All 2 tool turns done."
    assert_every_call_ran(agent, turns=2, parallel=1)
    received = emu.requests()
    assert len(received) == 5  # two 529s, the retry that passed, then two more turns
    retries = [{k.lower(): v for k, v in rec["headers"]}["x-stainless-retry-count"]
               for rec in received[:3]]
    assert retries == ["0", "1", "2"]
    assert len({rec["body_sha256"] for rec in received[:3]}) == 1  # the same request again
