"""Two replicas behind the real HAProxy sharing a real redis-server (each test starts its own
on loopback): a key's requests per minute hold across them, the ledger holds each exchange
exactly once, a session crossing backends through both keeps its thinking valid, and Redis
stopped mid-run costs no request a hang or a traceback: with ``on_unavailable: open`` the
requests go through and the ledger catches up once Redis is back, with ``closed`` they get
a clean 503 until it is."""

from __future__ import annotations

import asyncio
import collections
import time
import urllib.error
import urllib.request

import anthropic
import orjson
import pytest
from support import Relay, backend, request, text, user
from test_limits import same_minute
from test_limits_workers import post
from test_replicas import LoadBalancer, directory

from relay.state import Unavailable, open_state

KEY = "team-a-key-" + "r" * 20


@pytest.fixture
def replicas(emulator, redis_server, tmp_path, request):
    started: list = []
    emu = emulator()
    on_unavailable = getattr(request, "param", "open")
    config = {"server": {"access_log": True, "log_format": "json",
                         "auth": {"keys": [{"name": "team-a", "key_env": "RELAY_KEY",
                                            "limits": {"requests_per_minute": 10}}]}},
              "state": {"url": redis_server.url, "timeout": 0.25,
                        "on_unavailable": on_unavailable},
              "pipeline": ["limits", "usage"], "backends": [backend(emu.url)]}
    relays = [Relay(config, directory(tmp_path / f"replica{i}"), env={"RELAY_KEY": KEY})
              for i in range(2)]
    started.extend(relays)
    balancer = LoadBalancer([r.url for r in relays], tmp_path)
    started.append(balancer)
    yield relays, balancer
    for thing in started:
        thing.stop()


def answered(relays: list[Relay]) -> dict[str, tuple[int, int]]:
    """Each exchange the replicas' access logs name: its status, and which replica."""
    found = {}
    for index, relay in enumerate(relays):
        for line in relay.output().splitlines():
            record = orjson.loads(line) if line.startswith("{") else {}
            if record.get("logger") == "relay.access":
                found[record["request_id"]] = (record["status"], index)
    return found


def ledger(url: str) -> list[dict]:
    async def read():
        state = await open_state({"url": url})
        try:
            return await state.rows()
        finally:
            await state.close()
    return asyncio.run(read())


def settled(relays: list[Relay], count: int) -> dict:
    deadline = time.monotonic() + 10
    while len(found := answered(relays)) < count:
        assert time.monotonic() < deadline, f"{len(found)} of {count} exchanges logged"
        time.sleep(0.05)
    return found


def test_a_keys_limit_holds_across_replicas_and_the_ledger_has_each_exchange_once(
        replicas, redis_server):
    relays, balancer = replicas
    same_minute(20)
    statuses = [post(balancer.url, KEY)[0] for _ in range(25)]
    assert statuses == [200] * 10 + [429] * 15
    found = settled(relays, 25)
    by_replica = collections.Counter(index for status, index in found.values() if status == 200)
    assert set(by_replica) == {0, 1}  # both replicas let some through, 10 in all

    deadline = time.monotonic() + 10
    while len(rows := ledger(redis_server.url)) < len(found):
        assert time.monotonic() < deadline, f"{len(rows)} ledger rows for {len(found)}"
        time.sleep(0.1)
    ids = [row["id"] for row in rows]
    assert len(ids) == len(set(ids)) == len(found)
    assert sorted(row["status"] for row in rows) == sorted(s for s, _ in found.values())


def test_redis_stopped_mid_run_lets_requests_through_and_the_ledger_catches_up(
        replicas, redis_server):
    relays, balancer = replicas
    same_minute(20)
    assert [post(balancer.url, KEY)[0] for _ in range(2)] == [200, 200]
    redis_server.stop()
    started = time.monotonic()
    during = [post(balancer.url, KEY) for _ in range(4)]
    assert [status for status, _ in during] == [200] * 4  # on_unavailable: open
    assert time.monotonic() - started < 4 * 1.0
    settled(relays, 6)
    for relay in relays:
        assert "Traceback" not in relay.output()
    assert any("state redis://" in relay.output() and "unreachable" in relay.output()
               for relay in relays)
    outage = {headers["x-relay-request-id"] for _, headers in during}
    redis_server.start()
    # Redis kept nothing (no persistence): the outage's four rows are written when it is
    # back, each once.
    deadline = time.monotonic() + 20
    while True:
        try:
            ids = [row["id"] for row in ledger(redis_server.url)]
        except Unavailable:  # still starting
            ids = []
        if outage <= set(ids):
            break
        assert time.monotonic() < deadline, f"{len(outage & set(ids))} of the outage's rows"
        time.sleep(0.2)
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("replicas", ["closed"], indirect=True)
def test_redis_stopped_mid_run_with_on_unavailable_closed_refuses_cleanly(
        replicas, redis_server):
    relays, balancer = replicas
    same_minute(20)
    assert post(balancer.url, KEY)[0] == 200
    redis_server.stop()
    started = time.monotonic()
    refused = []
    for _ in range(3):
        call = urllib.request.Request(
            balancer.url + "/v1/messages", data=orjson.dumps(request(user(text("hi")))),
            headers={"content-type": "application/json", "x-api-key": KEY}, method="POST")
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(call, timeout=10)
        refused.append((caught.value.code, orjson.loads(caught.value.read())))
    assert time.monotonic() - started < 3 * 1.0
    for status, body in refused:
        assert status == 503 and body["type"] == "error"
        assert "state.on_unavailable: closed" in body["error"]["message"]
    for relay in relays:
        assert "Traceback" not in relay.output()
    redis_server.start()
    deadline = time.monotonic() + 10
    while post(balancer.url, KEY)[0] != 200:  # back: the key's requests go through again
        assert time.monotonic() < deadline, "the relay never used Redis again"
        time.sleep(0.2)


@pytest.mark.e2e  # the anthropic SDK drives the session
@pytest.mark.parametrize("url", ["redis", ""], ids=["shared-in-redis", "in-each-replica"])
def test_a_session_crossing_backends_through_both_replicas_keeps_its_thinking_valid(
        emulator, redis_server, tmp_path, url):
    """Each turn to the other backend (each signs its own thinking), and so, round robin,
    through the other replica: which backend issued a thinking block is known to the replica
    that did not see it only through the shared state."""
    from test_portable_e2e import Session

    backends = [backend(emulator("--signing-secret", f"secret-of-{name}", "--thinking",
                                 "--tool-turns", "4").url, name=name, models=[f"model-{name}"])
                for name in ("a", "b")]
    config = {"state": {"url": redis_server.url if url else ""},
              "pipeline": ["dedup", "pairing", "ordering", "portable"], "backends": backends}
    relays = [Relay(config, directory(tmp_path / f"replica{i}")) for i in range(2)]
    balancer = LoadBalancer([r.url for r in relays], tmp_path)
    try:
        session = Session([balancer.url], ["model-a", "model-b"], tmp_path, thinking=True,
                          stream=False)
        if url:
            assert session.run().stop_reason == "end_turn"
        else:
            with pytest.raises(anthropic.BadRequestError,
                               match="Invalid `signature` in `thinking` block"):
                session.run()
    finally:
        balancer.stop()
        for relay in relays:
            relay.stop()
