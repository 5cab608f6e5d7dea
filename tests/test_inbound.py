"""The inbound edge's evidence table (docs/evidence/inbound.json). Each case with a body goes
through a relay and, directly, to the emulator (the API's stand-in, which parses as the API
does): a case the relay refuses must be refused alike, in the API's words, with nothing sent
up; a case it forwards must reach the upstream as the client sent it, and come back with the
upstream's own answer. A case without a body names the tests that hold it."""

from __future__ import annotations

import ast
import json

import aiohttp
import pytest
from support import ROOT

from relay.testing import emulator
from relay.testing.fixtures import relay_client  # noqa: F401  (the fixture)

CASES = json.loads((ROOT / "docs" / "evidence" / "inbound.json").read_text())["cases"]
PLAYED = [case for case in CASES if "body" in case or "body_repeat" in case]


def body_of(case: dict) -> bytes:
    if "body" in case:
        return case["body"].encode()
    repeat = case["body_repeat"]
    return (repeat["prefix"] + repeat["open"] * repeat["times"] + repeat["close"] * repeat["times"]
            + repeat["suffix"]).encode()


@pytest.mark.parametrize("case", PLAYED, ids=[case["id"] for case in PLAYED])
async def test_the_relay_answers_a_case_as_the_api_does(relay_client, case):  # noqa: F811
    client = await relay_client(["dedup", "pairing", "ordering"],
                                backend={"models": ["claude-*"]})
    raw = body_of(case)
    headers = {"Content-Type": "application/json"}
    relayed = await client.post("/v1/messages", data=raw, headers=headers)
    relayed_doc = await relayed.json()
    records = client.upstream.app[emulator.STATE].records
    sent = [record[-1] for record in records]
    async with aiohttp.ClientSession() as session:
        async with session.post(client.upstream.make_url("/v1/messages"), data=raw,
                                headers=headers) as direct:
            direct_doc = await direct.json()
            direct_status = direct.status
    if case["relay"] == "refuse":
        api = case["api"]
        assert sent == []
        assert relayed.status == direct_status == api["status"]
        assert relayed_doc["error"]["type"] == direct_doc["error"]["type"] == api["type"]
        assert relayed_doc["error"]["message"] == direct_doc["error"]["message"]
        assert case["match"] in relayed_doc["error"]["message"]
        assert relayed.headers["request-id"] == relayed_doc["request_id"]
    else:
        assert sent == [raw]
        assert relayed.status == direct_status
        assert relayed_doc == {**direct_doc, **{k: relayed_doc[k] for k in ("id", "request_id")
                                                if k in relayed_doc}}
        assert relayed.headers["request-id"].startswith("req_")  # the upstream's answer


def test_every_case_says_what_it_rests_on():
    tests = {}
    for case in CASES:
        assert case["relay"] in ("refuse", "forward", "own"), case["id"]
        assert case["wording"] in ("confirmed", "inferred", "unknown"), case["id"]
        assert case["sources"] or case["wording"] == "unknown", case["id"]
        assert "api" in case or "why" in case, case["id"]
        assert case in PLAYED or case["tests"], case["id"]
        for name in case.get("tests", ()):
            path, _, test = name.partition("::")
            if path not in tests:
                tree = ast.parse((ROOT / path).read_text())
                tests[path] = {node.name for node in ast.walk(tree)
                               if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
            assert test in tests[path], f"{case['id']}: {name} does not exist"
