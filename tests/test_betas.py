"""The safety valve: the betas and fields the relay knows are classified in one place, in step
with the installed SDK; with one the history rules hold no evidence about, a running relay
forwards what they would have refused, and says so."""

from __future__ import annotations

import json
import typing

import orjson
import pytest
import pytest_asyncio
from anthropic.types import anthropic_beta_param
from anthropic.types.beta import message_create_params
from support import ROOT

from relay import betas, skeleton
from relay.testing import assistant, emulator, result, text, use, user
from relay.testing.fixtures import received, start_relay

EVIDENCE = json.loads((ROOT / "docs" / "evidence" / "betas.json").read_text())
# The SDK's name for the anthropic-beta header, not a body field.
SDK_ONLY = {"betas"}


def sdk_betas() -> set[str]:
    (_, names) = typing.get_args(anthropic_beta_param.AnthropicBetaParam)
    return set(typing.get_args(names))


def sdk_fields() -> set[str]:
    fields = set()
    for params in (message_create_params.MessageCreateParamsNonStreaming,
                   message_create_params.MessageCreateParamsStreaming):
        fields |= params.__required_keys__ | params.__optional_keys__
    return fields - SDK_ONLY


def test_every_beta_the_sdk_declares_is_classified():
    unclassified = sorted(sdk_betas() - set(betas.BETAS))
    assert not unclassified, (
        f"the installed anthropic SDK declares betas relay/betas.py does not classify: "
        f"{', '.join(unclassified)}. Read their types, decide what each means for the history "
        f"rules, and say what the decision rests on in docs/evidence/betas.json")


def test_every_top_level_field_the_sdk_declares_is_classified():
    unclassified = sorted(sdk_fields() - set(betas.FIELDS))
    assert not unclassified, f"unclassified request fields: {', '.join(unclassified)}"


def test_each_classification_says_what_it_rests_on():
    assert set(EVIDENCE["betas"]) == set(betas.BETAS)
    assert set(EVIDENCE["fields"]) == set(betas.FIELDS)
    assert all(EVIDENCE["betas"].values()) and all(EVIDENCE["fields"].values())
    effects = {betas.NONE, betas.KNOWN, betas.THREADS, betas.DEFER}
    assert set(betas.BETAS.values()) <= effects and set(betas.FIELDS.values()) <= effects


def test_the_betas_known_to_touch_histories_make_the_rules_defer():
    for name in ("compact-2026-09-04", "mid-conversation-system-clear-at-2026-08-21",
                 "mid-conversation-output-config-2026-07-01", "thinking-binding-controls-2026-08-01",
                 "thinking-display-updates-2026-08-18", "inline-tools-2026-09-15",
                 "mcp-client-2026-09-15"):
        assert betas.BETAS[name] == betas.DEFER, name


def test_the_skeletons_fixed_form_holds_no_field_the_rules_defer_for():
    # A request of those fields alone is never looked at again (Skeleton.other_fields).
    assert all(betas.FIELDS[name] != betas.DEFER for name in skeleton.KNOWN_FIELDS)


def test_what_defers():
    headers = {"Anthropic-Beta": "prompt-caching-2024-07-31, compact-2026-09-04,new-thing-2027-01-01"}
    assert betas.deferring(headers, ["compaction", "thread", "brand_new"]) == (
        ("beta", "compact-2026-09-04"), ("beta", "new-thing-2027-01-01"),
        ("field", "compaction"), ("field", "brand_new"))
    assert betas.deferring({"anthropic-beta": "message-threads-2026-08-12"}, []) == ()
    assert betas.deferring({}, []) == ()


BROKEN = {"model": "claude-test", "max_tokens": 50, "messages": [
    user(text("go")), assistant(use("toolu_a")), user(result("toolu_wrong"))]}


@pytest_asyncio.fixture
async def local_relay(aiohttp_client, aiohttp_server):
    upstream = await aiohttp_server(emulator.create_app(emulator.EmulatorOptions()))
    client = await start_relay(aiohttp_client, {
        "pipeline": ["metrics", "dedup", "pairing", "ordering"],
        "backends": [{"name": "emu", "url": str(upstream.make_url("")).rstrip("/"),
                      "models": ["*"]}]})
    client.upstream = upstream
    yield client
    await client.chain.shutdown(client.config)


async def post(client, doc, beta=None):
    headers = {"Content-Type": "application/json"}
    if beta:
        headers["anthropic-beta"] = beta
    response = await client.post("/v1/messages", data=orjson.dumps(doc), headers=headers)
    return response, await response.json()


@pytest.mark.parametrize("beta, extra", [
    ("brand-new-2027-01-01", {}),
    ("compact-2026-09-04", {}),
    (None, {"brand_new_field": {"on": True}}),
])
async def test_the_rules_defer_and_the_upstream_judges(local_relay, beta, extra):
    response, error = await post(local_relay, {**BROKEN, **extra}, beta)
    # The emulator's refusal, not the relay's: it went up.
    assert len(received(local_relay)) == 1
    assert response.status == 400 and "toolu_wrong" in error["error"]["message"]
    assert response.headers["x-relay-notes"] == "history-rules-deferred"
    metrics = await (await local_relay.get("/metrics")).text()
    kind, name = ("beta", beta) if beta else ("field", "brand_new_field")
    assert f'relay_history_rules_deferred_total{{kind="{kind}",name="{name}"}} 1.0' in metrics


async def test_a_beta_that_changes_no_history_leaves_the_rules_on(local_relay):
    response, error = await post(local_relay, BROKEN,
                                 "prompt-caching-2024-07-31,cache-diagnosis-2026-04-07")
    assert response.status == 400 and received(local_relay) == []
    assert "x-relay-notes" not in response.headers


async def test_client_chosen_names_cannot_grow_the_metrics_labels(local_relay):
    for n in range(40):
        await post(local_relay, {**BROKEN, "messages": BROKEN["messages"][:1]}, f"made-up-{n}")
    await post(local_relay, {**BROKEN, "messages": BROKEN["messages"][:1]}, "NOT a name")
    metrics = await (await local_relay.get("/metrics")).text()
    lines = [line for line in metrics.splitlines()
             if line.startswith("relay_history_rules_deferred_total{")]
    assert len(lines) == 33  # 32 names and "other"
    assert 'relay_history_rules_deferred_total{kind="beta",name="other"} 9.0' in metrics


# The anthropic-beta header of Claude Code 2.1.332's main loop, as the emulator received it.
CLAUDE_CODE_BETAS = ("claude-code-20250219,interleaved-thinking-2025-05-14,"
                     "context-management-2025-06-27,per-turn-control-2026-07-01,"
                     "mid-conversation-tool-changes-2026-07-01,thinking-token-count-2026-05-13,"
                     "advanced-tool-use-2025-11-20,effort-2025-11-24")


async def test_claude_codes_own_betas_leave_the_rules_on(local_relay):
    response, error = await post(local_relay, BROKEN, CLAUDE_CODE_BETAS)
    assert response.status == 400 and received(local_relay) == []
    assert "unexpected `tool_use_id`" in error["error"]["message"]
