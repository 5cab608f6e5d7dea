"""The anthropic SDK's tool runner, threaded by default, streaming and not, through a real
relay server in front of each kind of backend: one that holds threads as the API does, an
Anthropic-like one that holds none, and an OpenAI-format one. Cache diagnostics go through
untouched."""

from __future__ import annotations

import hashlib
import json
import urllib.request

import anthropic
import httpx2
import pytest
from support import backend

pytestmark = pytest.mark.e2e

THREADS_BETA = "message-threads-2026-08-12"
TURNS = 2  # the emulators' tool turns before their final answer


@anthropic.beta_tool
def run(command: str) -> str:
    """Run a shell command.

    Args:
        command: the command line
    """
    return f"ran {command}"


def sdk(url: str, statuses: list | None = None) -> anthropic.Anthropic:
    """A client; ``statuses`` collects the status of every answer it gets."""
    hooks = {"response": [lambda response: statuses.append(response.status_code)]} \
        if statuses is not None else {}
    return anthropic.Anthropic(base_url=url, api_key="sk-test-client", max_retries=0,
                               http_client=httpx2.Client(event_hooks=hooks))


def finish(client: anthropic.Anthropic, stream: bool):
    runner = client.beta.messages.tool_runner(
        model="claude-test", max_tokens=200, tools=[run], stream=stream,
        messages=[{"role": "user", "content": "Run the tool until you are done."}])
    return runner.until_done()


def messages_requests(emu, path="/v1/messages") -> list[dict]:
    return [r for r in emu.requests() if r["path"] == path]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_the_tool_runner_threads_through_a_backend_that_holds_threads(emulator, relay, stream):
    emu = emulator("--threads", "hold", "--tool-turns", str(TURNS))
    r = relay({"backends": [backend(emu.url, holds_threads=True)]})
    final = finish(sdk(r.url), stream)
    assert final.stop_reason == "end_turn"
    sent = messages_requests(emu)
    assert len(sent) == TURNS + 1  # no refusal, no replay
    # The first asks the server to hold the conversation; each later one sends only the new
    # turn (results whose calls the server holds) and continues from the answer before it.
    # The emulator judged each against the whole conversation it held.
    assert sent[0]["body"]["thread"] == {"type": "create"}
    for request in sent[1:]:
        body = request["body"]
        assert body["thread"]["type"] == "continue"
        assert [m["role"] for m in body["messages"]] == ["user"]
        assert body["messages"][0]["content"][0]["type"] == "tool_result"
        assert "tools" not in body
        headers = {k.lower(): v for k, v in request["headers"]}
        assert THREADS_BETA in headers["anthropic-beta"]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_the_tool_runner_threads_through_a_backend_without_threads(emulator, relay, stream):
    # The emulator would refuse a thread itself: it must never see one. The relay carries the
    # thread: the client threads as against the API, and is never refused.
    emu = emulator("--threads", "refuse", "--tool-turns", str(TURNS))
    r = relay({"backends": [backend(emu.url)]})
    statuses: list[int] = []
    final = finish(sdk(r.url, statuses), stream)
    assert final.stop_reason == "end_turn"
    assert statuses == [200] * (TURNS + 1)
    sent = messages_requests(emu)
    assert len(sent) == TURNS + 1
    assert all("thread" not in request["body"] for request in sent)
    # Full histories, each valid for the strict emulator: 1, 3, 5 messages.
    assert [len(request["body"]["messages"]) for request in sent] == [1, 3, 5]


class Alternating(httpx2.BaseTransport):
    """Each request to the next of some relays in turn: replicas behind a round-robin
    balancer, with nothing shared between them."""

    def __init__(self, urls: list[str]):
        self.ports = [httpx2.URL(url).port for url in urls]
        self.sent = 0
        self.inner = httpx2.HTTPTransport()

    def handle_request(self, request):
        request.url = request.url.copy_with(port=self.ports[self.sent % len(self.ports)])
        self.sent += 1
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_the_tool_runner_goes_on_unthreaded_where_the_relay_has_no_record(emulator, relay,
                                                                          stream):
    """Two replicas without a shared state, in turn: the continuation reaches the one that
    did not see the thread's start, which has nothing to carry for a backend without
    threads, and answers as the API does a thread it holds no state for (404
    thread_not_found); the SDK's tool runner replays the history under a new thread, and
    when that one is lost as well (the other replica again) sends the whole history
    without a thread from then on and completes, every upstream request a valid history
    without ``thread``."""
    emu = emulator("--threads", "refuse", "--tool-turns", str(TURNS))
    first, second = (relay({"backends": [backend(emu.url)]}) for _ in range(2))
    statuses: list[int] = []
    client = anthropic.Anthropic(
        base_url=first.url, api_key="sk-test-client", max_retries=0,
        http_client=httpx2.Client(transport=Alternating([first.url, second.url]), event_hooks={
            "response": [lambda response: statuses.append(response.status_code)]}))
    final = finish(client, stream)
    assert final.stop_reason == "end_turn"
    # The create (first replica), the continuation not found (second), the replay under a
    # new thread (first), its continuation not found (second), then the full history
    # unthreaded (first).
    assert statuses == [200, 404, 200, 404, 200], statuses
    sent = messages_requests(emu)
    assert len(sent) == TURNS + 1
    assert all("thread" not in request["body"] for request in sent)
    assert [len(request["body"]["messages"]) for request in sent] == [1, 3, 5]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_the_tool_runner_threads_through_an_openai_format_backend(emulator, relay, stream):
    emu = emulator("--format", "openai", "--tool-turns", str(TURNS))
    r = relay({"backends": [backend(emu.url + "/v1", format="openai")]})
    statuses: list[int] = []
    final = finish(sdk(r.url, statuses), stream)
    assert final.stop_reason == "end_turn"
    assert statuses == [200] * (TURNS + 1)
    sent = messages_requests(emu, "/v1/chat/completions")
    assert len(sent) == TURNS + 1
    assert all("thread" not in request["body"] for request in sent)
    assert [sum(m["role"] == "tool" for m in request["body"]["messages"])
            for request in sent] == [0, 1, 2]


def test_cache_diagnostics_pass_through_untouched(emulator, relay):
    emu = emulator("--tool-turns", "0")
    r = relay({"backends": [backend(emu.url)]})
    client = sdk(r.url)
    first = client.beta.messages.create(
        model="claude-test", max_tokens=50, betas=["cache-diagnosis-2026-04-07"],
        diagnostics={"previous_message_id": "msg_never_seen"},
        messages=[{"role": "user", "content": "hi"}])
    assert first.diagnostics.cache_miss_reason.type == "previous_message_not_found"
    # In a stream the answer's diagnostics come in message_start (BetaMessage.diagnostics).
    with client.beta.messages.stream(
            model="claude-test", max_tokens=50, betas=["cache-diagnosis-2026-04-07"],
            diagnostics={"previous_message_id": first.id},
            messages=[{"role": "user", "content": "hi again"}]) as stream:
        final = stream.get_final_message()
    assert final.diagnostics.cache_miss_reason.type == "unavailable"
    # The request's bytes go up as they came, odd spacing and all.
    raw = json.dumps({"model": "claude-test", "max_tokens": 50,
                      "diagnostics": {"previous_message_id": None},
                      "messages": [{"role": "user", "content": "hi"}]},
                     separators=(" , ", " : ")).encode()
    call = urllib.request.Request(r.url + "/v1/messages", data=raw, method="POST", headers={
        "content-type": "application/json", "x-api-key": "sk-test-client",
        "anthropic-version": "2023-06-01"})
    with urllib.request.urlopen(call, timeout=10) as response:
        answer = json.loads(response.read())
    assert answer["diagnostics"] == {"cache_miss_reason": None}
    sent = messages_requests(emu)
    assert sent[0]["body"]["diagnostics"] == {"previous_message_id": "msg_never_seen"}
    assert sent[2]["body_sha256"] == hashlib.sha256(raw).hexdigest()


KEYS = {"RELAY_KEY_A": "relay-key-alpha-0123456789", "RELAY_KEY_B": "relay-key-bravo-0123456789",
        "UPSTREAM_KEY": "sk-operator-0123456789"}


def test_the_tool_runner_survives_a_restart_and_another_key_never_takes_its_thread(emulator,
                                                                                   relay):
    """Two relay keys, the operator's one credential upstream, a backend that holds threads,
    no shared state: the relay restarts after the runner's first turn. The continuation it
    then gets is of an answer whose key it does not know: the API's answer to a thread it
    cannot find, from which the runner replays its history and goes on. Bravo continues
    none of alpha's answers the upstream holds, the one before the restart included."""
    emu = emulator("--threads", "hold", "--tool-turns", str(TURNS))
    config = {"server": {"auth": {"keys": [{"name": "alpha", "key_env": "RELAY_KEY_A"},
                                           {"name": "bravo", "key_env": "RELAY_KEY_B"}]}},
              "backends": [backend(emu.url, holds_threads=True, api_key_env="UPSTREAM_KEY")]}
    serving = [relay(config, env=KEYS)]

    class Current(httpx2.HTTPTransport):
        def handle_request(self, request):
            request.url = request.url.copy_with(port=httpx2.URL(serving[0].url).port)
            return super().handle_request(request)

    @anthropic.beta_tool
    def restart(command: str) -> str:
        """Run a shell command.

        Args:
            command: the command line
        """
        if len(serving) == 1:
            serving[0].stop()
            serving.insert(0, relay(config, env=KEYS))
        return f"ran {command}"

    def client(key: str, statuses: list | None = None) -> anthropic.Anthropic:
        hooks = {"response": [lambda response: statuses.append(response.status_code)]} \
            if statuses is not None else {}
        return anthropic.Anthropic(base_url=serving[0].url, api_key=key, max_retries=0,
                                   http_client=httpx2.Client(transport=Current(),
                                                             event_hooks=hooks))

    statuses: list[int] = []
    runner = client(KEYS["RELAY_KEY_A"], statuses).beta.messages.tool_runner(
        model="claude-test", max_tokens=200, tools=[restart],
        messages=[{"role": "user", "content": "Run the tool until you are done."}])
    answers = list(runner)
    assert answers[-1].stop_reason == "end_turn"
    assert statuses == [200, 404] + [200] * TURNS, statuses
    sent = messages_requests(emu)
    assert [request["body"]["thread"]["type"] for request in sent] == \
        ["create", "create"] + ["continue"] * (TURNS - 1)
    assert len(sent[1]["body"]["messages"]) == 3  # the replay: the whole history
    bravo = client(KEYS["RELAY_KEY_B"])
    for answer in answers:
        with pytest.raises(anthropic.NotFoundError) as refused:
            bravo.beta.messages.create(
                model="claude-test", max_tokens=100, betas=[THREADS_BETA],
                thread={"type": "continue", "previous_message_id": answer.id},
                messages=[{"role": "user", "content": "what did we just do?"}])
        assert refused.value.body["error"]["details"] == {"error_code": "thread_not_found"}
    assert len(messages_requests(emu)) == len(sent)
