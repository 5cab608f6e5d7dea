"""Limits and keys across processes: a relay with two workers sharing one SQLite state file
lets exactly a key's requests per minute through, and sees keys that ``relay keys`` makes and
revokes from another process while it serves."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

from support import ROOT, backend, request, text, user
from test_limits import same_minute

KEY = "team-a-key-" + "k" * 20


def post(url: str, key: str) -> tuple[int, dict]:
    call = urllib.request.Request(
        url + "/v1/messages", data=json.dumps(request(user(text("hi")))).encode(),
        headers={"content-type": "application/json", "x-api-key": key,
                 "connection": "close"}, method="POST")
    try:
        with urllib.request.urlopen(call, timeout=10) as response:
            return response.status, dict(response.headers)
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers)


def keys_command(config_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "relay", "keys", *args, "--config",
                           str(config_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=30)


def until(url: str, key: str, wanted: int, seconds: float = 6.0) -> None:
    deadline = time.monotonic() + seconds
    while post(url, key)[0] != wanted:
        assert time.monotonic() < deadline, f"a request with the key never got {wanted}"
        time.sleep(0.1)


def test_two_workers_share_limits_and_keys(emulator, relay, tmp_path):
    emu = emulator()
    config = {"server": {"auth": {"keys": [{"name": "team-a", "key_env": "RELAY_KEY",
                                            "limits": {"requests_per_minute": 10}}]}},
              "state": {"url": f"sqlite:///{tmp_path / 'state.db'}"},
              "pipeline": ["limits"], "backends": [backend(emu.url)]}
    server = relay(config, env={"RELAY_KEY": KEY}, args=["--workers", "2"])
    same_minute(20)
    statuses = [post(server.url, KEY)[0] for _ in range(25)]
    assert statuses.count(200) == 10 and statuses.count(429) == 15, statuses
    assert statuses[:10] == [200] * 10

    made = keys_command(server.config_path, "create", "team-cli",
                        "--limits", "{output_tokens_per_minute: 100000}")
    assert made.returncode == 0, made.stderr
    secret = made.stdout.strip()
    assert secret.startswith("sk-relay-") and "shown only now" in made.stderr
    until(server.url, secret, 200)
    # Every worker has it by now, or within the second after.
    time.sleep(1.2)
    answers = [post(server.url, secret) for _ in range(8)]
    assert [status for status, _ in answers] == [200] * 8
    assert answers[0][1]["anthropic-ratelimit-output-tokens-limit"] == "100000"

    listed = keys_command(server.config_path, "list", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = {row["name"]: row for row in json.loads(listed.stdout)}
    assert rows["team-a"]["source"] == "relay.yaml"
    assert rows["team-a"]["limits"] == rows["team-a"]["effective_limits"] \
        == {"requests_per_minute": 10}
    assert rows["team-cli"]["limits"] == rows["team-cli"]["effective_limits"] \
        == {"output_tokens_per_minute": 100000}
    assert rows["team-a"]["usage"][0]["limit"] == "requests_per_minute"
    assert rows["team-a"]["usage"][0]["used"] == 10
    assert rows["team-cli"]["status"] == "active" and "hash" not in rows["team-cli"]
    table = keys_command(server.config_path, "list").stdout
    assert "team-cli" in table and "rpm 10/10" in table

    # New limits and an expiry date, through the command line, seen by every worker.
    changed = keys_command(server.config_path, "set", "team-cli",
                           "--limits", "{requests_per_minute: 3}")
    assert changed.returncode == 0, changed.stderr
    until(server.url, secret, 429)
    dated = keys_command(server.config_path, "create", "team-dated", "--expires", "2099-01-31")
    assert dated.returncode == 0, dated.stderr
    rows = {row["name"]: row for row in json.loads(
        keys_command(server.config_path, "list", "--json").stdout)}
    assert rows["team-cli"]["limits"] == {"requests_per_minute": 3}
    assert rows["team-dated"]["expires"] == 4073500800.0
    assert rows["team-dated"]["status"] == "active"
    until(server.url, dated.stdout.strip(), 200)

    revoked = keys_command(server.config_path, "revoke", "team-cli")
    assert revoked.returncode == 0, revoked.stderr
    until(server.url, secret, 401)
    time.sleep(1.2)
    assert [post(server.url, secret)[0] for _ in range(8)] == [401] * 8
    assert post(server.url, KEY)[0] == 429  # relay.yaml's key: still itself, still limited

    taken = keys_command(server.config_path, "create", "team-a")
    assert taken.returncode == 1 and "already" in taken.stderr


def test_a_drain_gives_the_slots_back(emulator, relay, tmp_path):
    """A stream cut short by the drain ends its exchange: its slot is back in the shared
    state, not held for the lease's 15 minutes, so the next relay serves the key at once."""
    emu = emulator("--stall-after", "2", "--stall-ms", "30000")
    config = {"server": {"auth": {"keys": [{"name": "team-a", "key_env": "RELAY_KEY",
                                            "limits": {"concurrent": 1}}]},
                         "drain_seconds": 0.3},
              "state": {"url": f"sqlite:///{tmp_path / 'state.db'}"},
              "pipeline": ["limits"], "backends": [backend(emu.url)]}
    first = relay(config, env={"RELAY_KEY": KEY})
    host, port = first.url.removeprefix("http://").split(":")
    stream = http.client.HTTPConnection(host, int(port), timeout=10)
    stream.request("POST", "/v1/messages",
                   body=json.dumps(request(user(text("hi")), stream=True)),
                   headers={"content-type": "application/json", "x-api-key": KEY})
    answer = stream.getresponse()
    assert answer.status == 200
    assert answer.read1(65536).startswith(b"event: message_start")
    assert post(first.url, KEY)[0] == 429  # its one slot is taken
    first.stop()  # SIGTERM: the drain ends the stream with an error event
    assert b"event: error" in answer.read()
    config["backends"] = [backend(emulator().url)]
    second = relay(config, env={"RELAY_KEY": KEY})
    assert post(second.url, KEY)[0] == 200
