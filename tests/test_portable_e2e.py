"""One session, many backends, end to end with the anthropic SDK: a tool loop whose every
turn goes to another backend (Anthropic-format with its own signing secret, Kimi-like with
``functions.Name:N`` ids and its own secret, OpenAI-format), thinking on and off, parallel
calls, reused ids, a fallback mid-loop. Through the relay with the portable plugin every
session completes, and what each backend receives of earlier turns never changes from one of
its requests to the next; without the plugin the same steps fail as the real API fails them.
"""

from __future__ import annotations

import itertools
import re

import anthropic
import pytest
from support import backend
from test_sdk_e2e import BASH, MAX_TURNS, client, run_bash

pytestmark = pytest.mark.e2e

TURNS = 5
ANTHROPIC_IDS = "^[a-zA-Z0-9_-]+$"
FUNCTIONS = "^[a-zA-Z0-9_.:-]+$"
THINKING = {"type": "enabled", "budget_tokens": 1024}
PIPELINE = ["dedup", "pairing", "ordering", "portable"]
WITHOUT = ["dedup", "pairing", "ordering"]

# Each backend: the emulator's arguments, and its relay.yaml entry's extras.
BACKENDS = {
    "anthropic": (("--signing-secret", "secret-of-a"), {}),
    "kimi": (("--id-style", "functions", "--signing-secret", "secret-of-k"),
             {"quirks": {"tool_id_pattern": FUNCTIONS}}),
    "openai": (("--format", "openai"), {"format": "openai"}),
}

SESSIONS = {
    # the backends the turns cycle through, thinking on, emulator extras, how it fails without
    "anthropic-kimi-thinking": (("anthropic", "kimi"), True, ("--parallel", "2"),
                                "messages.1.content.0: Invalid `signature` in `thinking` block"),
    "kimi-anthropic-thinking-reused": (
        ("kimi", "anthropic"), True, ("--parallel", "2", "--reuse-ids"),
        "messages.1.content.2.tool_use.id: String should match pattern '^[a-zA-Z0-9_-]+$'"),
    "openai-anthropic-thinking": (("openai", "anthropic"), True, (),
                                  "messages.1.content.0: Invalid `signature` in `thinking` block"),
    "kimi-anthropic-openai-no-thinking": (
        ("kimi", "anthropic", "openai"), False, ("--parallel", "2", "--reuse-ids"),
        "messages.1.content.1.tool_use.id: String should match pattern '^[a-zA-Z0-9_-]+$'"),
}


def model_of(name: str) -> str:
    return f"model-{name}"


class Session:
    """A tool loop whose n-th turn asks the n-th model of ``models`` (cycling)."""

    def __init__(self, urls, models, workdir, thinking: bool, stream: bool):
        self.sdks = [client(url, max_retries=0) for url in urls]
        self.models = itertools.cycle(models)
        self.workdir, self.thinking, self.stream = workdir, thinking, stream
        self.messages: list = [{"role": "user", "content": "Run the tool until you are done."}]
        self.calls: list[str] = []
        self.headers: list = []  # the relay's answer headers, turn by turn

    def run(self):
        for turn in range(MAX_TURNS):
            sdk = self.sdks[turn % len(self.sdks)]
            request = {"model": next(self.models), "max_tokens": 2048, "tools": [BASH],
                       "messages": self.messages}
            if self.thinking:
                request["thinking"] = THINKING
            if self.stream:
                with sdk.messages.stream(**request) as events:
                    message = events.get_final_message()
                    self.headers.append(events.response.headers)
            else:
                raw = sdk.messages.with_raw_response.create(**request)
                message = raw.parse()
                self.headers.append(raw.headers)
            self.messages.append({"role": "assistant", "content": message.content})
            if message.stop_reason != "tool_use":
                return message
            results = []
            for call in (b for b in message.content if b.type == "tool_use"):
                self.calls.append(call.id)
                results.append({"type": "tool_result", "tool_use_id": call.id,
                                **run_bash(call.input["command"], self.workdir)})
            self.messages.append({"role": "user", "content": results})
        raise AssertionError(f"the session did not end within {MAX_TURNS} turns")


@pytest.fixture
def backends(emulator):
    def start(names, thinking: bool, extra):
        started = {}
        for name in dict.fromkeys(names):
            args, entry = BACKENDS[name]
            emu = emulator(*args, "--tool-turns", str(TURNS), *extra,
                           *(("--thinking",) if thinking else ()))
            url = emu.url + ("/v1" if entry.get("format") == "openai" else "")
            started[name] = (emu, backend(url, name=name, models=[model_of(name)], **entry))
        return started
    return start


def config(started, pipeline, tmp_path) -> dict:
    return {"pipeline": pipeline,
            "plugins": {"portable": {"provenance_db": str(tmp_path / "provenance.db")}}
            if "portable" in pipeline else {},
            "backends": [entry for _, entry in started.values()]}


def assert_earlier_turns_stable(emu) -> None:
    """Each request a backend got holds the previous one's messages unchanged, as its prefix:
    prompt caching keeps working across the moves."""
    bodies = [record["body"] for record in emu.requests() if record["path"].endswith(
        ("/v1/messages", "/chat/completions"))]
    assert bodies
    for before, after in itertools.pairwise(bodies):
        key = "messages"
        assert after[key][:len(before[key])] == before[key]


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
@pytest.mark.parametrize("case", SESSIONS)
def test_a_session_moving_between_backends_every_turn_completes(backends, relay, tmp_path,
                                                                 case, stream):
    names, thinking, extra, _ = SESSIONS[case]
    started = backends(names, thinking, extra)
    r = relay(config(started, PIPELINE, tmp_path))
    session = Session([r.url], [model_of(n) for n in names], tmp_path, thinking, stream)
    final = session.run()
    assert final.stop_reason == "end_turn"
    assert final.content[-1].text == f"All {TURNS} tool turns done."
    parallel = 2 if "--parallel" in extra else 1
    assert len(session.calls) == len(set(session.calls)) == TURNS * parallel
    for emu, _ in started.values():
        assert_earlier_turns_stable(emu)
    # Whoever minted them, the ids the client got fit Anthropic's grammar.
    assert all(re.fullmatch(ANTHROPIC_IDS, call) for call in session.calls), session.calls
    # What was adapted shows in the answer's headers: the first turn has nothing to adapt but
    # a Kimi-like backend's ids on their way back (counted where the headers come after the
    # answer); with thinking on, the second, to Anthropic-like rules, has: the first turn's
    # thinking is the other backend's (the ids the client holds fit them already). Later
    # requests back to a turn's first backend may need nothing: the tool loop is one turn,
    # and it opens with that backend's own thinking.
    adapted = [int(h.get("x-relay-repairs", 0)) + int(h.get("x-relay-rewrites", 0))
               for h in session.headers]
    assert adapted[0] == (parallel if names[0] == "kimi" and not stream else 0), adapted
    assert not thinking or adapted[1] > 0, adapted


def test_two_replicas_sharing_the_record_carry_one_session(backends, relay, tmp_path):
    names = ("anthropic", "kimi")
    started = backends(names, True, ("--parallel", "2"))
    replicas = [relay(config(started, PIPELINE, tmp_path)) for _ in range(2)]
    # Turn n goes through replica n % 2: the one that saw an answer is never the next to
    # send it on.
    session = Session([r.url for r in replicas], [model_of(n) for n in names], tmp_path,
                      True, False)
    assert session.run().stop_reason == "end_turn"
    for emu, _ in started.values():
        assert_earlier_turns_stable(emu)


@pytest.mark.parametrize("case", SESSIONS)
def test_without_the_plugin_the_same_session_fails(backends, relay, tmp_path, case):
    names, thinking, extra, error = SESSIONS[case]
    started = backends(names, thinking, extra)
    r = relay(config(started, WITHOUT, tmp_path))
    session = Session([r.url], [model_of(n) for n in names], tmp_path, thinking, False)
    with pytest.raises(anthropic.BadRequestError) as refused:
        session.run()
    assert refused.value.body["error"]["message"] == error


@pytest.mark.parametrize("portable", [True, False], ids=["portable", "without"])
def test_a_fallback_to_another_backend_mid_loop_keeps_the_session(emulator, relay, tmp_path,
                                                                  portable):
    """The Anthropic-like backend is overloaded every second request; its fallback is the
    Kimi-like one, which then gets the other's history (and the client never chose it)."""
    strict = emulator("--signing-secret", "secret-of-a", "--thinking", "--tool-turns",
                      str(TURNS), "--fail-status", "529", "--fail-every", "2")
    kimi = emulator("--id-style", "functions", "--signing-secret", "secret-of-k", "--thinking",
                    "--tool-turns", str(TURNS), "--reuse-ids")
    backends = {"anthropic": (strict, backend(strict.url, name="anthropic", models=["model-*"],
                                              fallbacks=["kimi"])),
                "kimi": (kimi, backend(kimi.url, name="kimi", models=["kimi-*"],
                                       quirks={"tool_id_pattern": FUNCTIONS}))}
    pipeline = PIPELINE if portable else WITHOUT
    r = relay(config(backends, pipeline, tmp_path))
    session = Session([r.url], ["model-a"], tmp_path, True, False)
    if not portable:
        with pytest.raises(anthropic.BadRequestError) as refused:
            session.run()
        assert refused.value.body["error"]["message"] == (
            "messages.1.content.0: Invalid `signature` in `thinking` block")
        return
    assert session.run().stop_reason == "end_turn"
    assert len(session.calls) == TURNS
    served = [record["body"] for record in kimi.requests()]
    assert len(served) == (TURNS + 1) // 2  # every second turn fell back
    assert all(body["thinking"] == {"type": "disabled"} for body in served)
    for emu, _ in backends.values():
        assert_earlier_turns_stable(emu)


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
@pytest.mark.parametrize("thinking", [True, False], ids=["thinking-enabled", "no-thinking-field"])
def test_a_backend_that_signs_nothing_gets_its_thinking_back(emulator, relay, tmp_path,
                                                             thinking, stream):
    """DeepSeek's /anthropic issues thinking without a signature and, in thinking mode (on
    unless disabled), refuses a tool turn sent back without it. Its own blocks go back to it
    as the client sent them, and thinking stays as the client asked."""
    signless = emulator("--unsigned-thinking", "--tool-turns", str(TURNS))
    backends = {"deepseek": (signless, backend(signless.url, name="deepseek",
                                               models=["model-*"]))}
    r = relay(config(backends, PIPELINE, tmp_path))
    session = Session([r.url], ["model-d"], tmp_path, thinking, stream)
    assert session.run().stop_reason == "end_turn"
    assert len(session.calls) == TURNS
    served = [record["body"] for record in signless.requests()]
    assert len(served) == TURNS + 1
    assert all(body.get("thinking") == (THINKING if thinking else None) for body in served)
    assert all(block["signature"] == "" for body in served for message in body["messages"]
               if message["role"] == "assistant" for block in message["content"]
               if block["type"] == "thinking")
    assert_earlier_turns_stable(signless)
    assert all(int(h.get("x-relay-repairs", 0)) == 0 for h in session.headers)


@pytest.mark.parametrize("quirk", [True, False], ids=["thinking_passed_back", "default"])
def test_a_session_moving_to_a_backend_that_wants_every_tool_turns_thinking(emulator, relay,
                                                                            tmp_path, quirk):
    """Two turns on an Anthropic-like backend (thinking unasked, signed), the rest on a
    DeepSeek-like one, whose thinking mode is on without the field and refuses a tool turn
    sent back without its thinking. The first backend's thinking cannot go to the second
    (another issuer's): with `thinking_passed_back` the second gets those requests with
    thinking disabled; without it, it refuses them as DeepSeek's /anthropic does."""
    signed = emulator("--signing-secret", "secret-of-a", "--thinking", "--tool-turns",
                      str(TURNS))
    signless = emulator("--unsigned-thinking", "--tool-turns", str(TURNS))
    quirks = {"quirks": {"thinking_passed_back": True}} if quirk else {}
    backends = {"anthropic": (signed, backend(signed.url, name="anthropic",
                                              models=["model-a"])),
                "deepseek": (signless, backend(signless.url, name="deepseek",
                                               models=["model-d"], **quirks))}
    r = relay(config(backends, PIPELINE, tmp_path))
    session = Session([r.url], ["model-a"] * 2 + ["model-d"] * TURNS, tmp_path, False, False)
    if not quirk:
        with pytest.raises(anthropic.BadRequestError) as refused:
            session.run()
        assert refused.value.body["error"]["message"] == (
            "The `content[].thinking` in the thinking mode must be passed back to the API.")
        return
    assert session.run().stop_reason == "end_turn"
    assert len(session.calls) == TURNS
    assert all("thinking" not in record["body"] for record in signed.requests())
    served = [record["body"] for record in signless.requests()]
    assert len(served) == TURNS + 1 - 2
    assert all(body["thinking"] == {"type": "disabled"} for body in served)
    for emu, _ in backends.values():
        assert_earlier_turns_stable(emu)
    # Each request there: the first backend's two blocks dropped, and thinking switched off.
    assert [int(h.get("x-relay-repairs", 0)) for h in session.headers] == [0] * 2 + [3] * 4


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
@pytest.mark.parametrize("thinking", [True, False], ids=["thinking-enabled", "no-thinking-field"])
def test_a_lone_backend_that_signs_nothing_gets_its_thinking_back_without_a_record_on_disk(
        emulator, relay, tmp_path, thinking, stream):
    """The usual set-up in front of DeepSeek: that one backend, no ``provenance_db``. The
    relay has no other backend to carry thinking to, but it must still learn that this one
    issues unsigned thinking, or it drops those blocks and the backend refuses the tool turn
    sent back without them."""
    signless = emulator("--unsigned-thinking", "--tool-turns", str(TURNS))
    entry = backend(signless.url, name="deepseek", models=["model-*"])
    r = relay({"pipeline": PIPELINE, "backends": [entry]})
    session = Session([r.url], ["model-d"], tmp_path, thinking, stream)
    assert session.run().stop_reason == "end_turn"
    served = [record["body"] for record in signless.requests()]
    assert len(served) == TURNS + 1
    assert all(body.get("thinking") == (THINKING if thinking else None) for body in served)
    assert all(any(block["type"] == "thinking" for block in message["content"])
               for body in served for message in body["messages"]
               if message["role"] == "assistant")
    assert all(int(h.get("x-relay-repairs", 0)) == 0 for h in session.headers)
