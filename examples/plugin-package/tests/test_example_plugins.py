"""The example plugins, tested the way the relay tests its own plugins: with relay.testing."""

import pytest
from relay_example import model_blocklist

from relay.errors import ConfigError
from relay.hookspecs import hookimpl
from relay.testing import passes, refuses, request, text, user
from relay.testing.fixtures import received, received_headers

BLOCK_OPUS = {"blocked": ["claude-opus-*"]}


def test_a_blocked_model_is_refused_and_others_pass():
    opus = request(user(text("hi")), model="claude-opus-4")
    message = refuses(model_blocklist.relay_request, opus, BLOCK_OPUS, status=403)
    assert message == "model claude-opus-4 is blocked on this relay"
    passes(model_blocklist.relay_request, request(user(text("hi"))), BLOCK_OPUS)


async def test_the_blocklist_through_a_relay(relay_client):
    client = await relay_client(["model_blocklist"], {"model_blocklist": BLOCK_OPUS})
    resp = await client.post("/v1/messages", json=request(user(text("hi")), model="claude-opus-4"))
    assert resp.status == 403
    assert (await resp.json())["error"]["type"] == "permission_error"
    assert received(client) == []


async def test_the_team_header_reaches_the_upstream_and_credentials_stay_the_hosts(relay_client):
    client = await relay_client(["team_header"], {"team_header": {"team": "research"}})
    resp = await client.post("/v1/messages", json=request(user(text("hi"))),
                             headers={"x-api-key": "client-key"})
    assert resp.status == 200
    [sent] = received_headers(client)
    assert sent["x-team"] == "research" and sent["x-api-key"] == "client-key"


async def test_a_missing_team_stops_start_up(relay_client):
    with pytest.raises(ConfigError, match="plugins.team_header.team"):
        await relay_client(["team_header"])


async def test_stream_events_are_counted_on_the_timeline(relay_client):
    ended = []

    class Keep:
        @hookimpl
        def relay_exchange_end(self, exchange):
            ended.append(exchange)

    client = await relay_client(["keep", "event_counter"], extra={"keep": Keep()})
    resp = await client.post("/v1/messages", json=request(user(text("go")), stream=True))
    await resp.read()
    [counted] = [entry for entry in ended[0].timeline if entry["step"] == "event_counter"]
    assert counted["events"]["message_start"] == counted["events"]["message_stop"] == 1
    assert counted["total"] == sum(counted["events"].values())
