"""A test kit for relay plugins, shipped with the package: what the project's own tests use.

    from relay.testing import request, user, assistant, use, result, text
    from relay.testing import exchange_for, refuses, passes, repairs, finished_exchange
    from relay.exchange import Outcome

    def test_my_plugin_refuses_a_blocked_model():
        message = refuses(my_plugin.relay_request, request(user(text("hi")), model="bad"))
        assert "blocked" in message

    def test_my_plugin_counts_upstream_errors():
        exchange = finished_exchange(status=529, outcome=Outcome.UPSTREAM_ERROR)
        my_plugin.relay_exchange_end(exchange)

:func:`finished_exchange` builds the record as ``relay_exchange_end`` sees it (request,
attempts, the upstream's request and answer, the client's answer, outcome, timings and
timeline), for a plugin that reads the record once the exchange is over.

For a whole relay in process, in front of the strict emulator (``relay.testing.emulator``),
load the pytest fixture with one line in a ``conftest.py``: ``pytest_plugins =
["relay.testing.fixtures"]`` (it needs pytest-aiohttp), then ask for ``relay_client``.

The far sides of the wire: ``relay.testing.emulator`` (Anthropic's API, strict) and
``relay.testing.emulator_openai`` (an OpenAI Chat Completions server), both run by ``relay
emulate``; and ``relay.testing.hostile`` (``python -m relay.testing.hostile``), a backend that
misbehaves in either format as the request's model says: a stream or an answer that never
ends, a line that never ends, answers and stream chunks of the wrong shape
(``malformed-usage-strings``, ``malformed-tool-calls-number``, ...), a model list with
``created: 1e300``, and the credential it was sent echoed back (``echo-key``). Its
``create_app()`` serves in process, behind ``aiohttp_server``.
"""

from __future__ import annotations

from collections.abc import Iterable

import orjson
from multidict import CIMultiDict

from relay import skeleton
from relay.config import Backend
from relay.errors import RelayError
from relay.exchange import (
    Answer,
    Attempt,
    Exchange,
    Outcome,
    StreamFailure,
    Timings,
    UpstreamAnswer,
    UpstreamRequest,
)

__all__ = ["request", "user", "assistant", "text", "use", "result", "exchange_for", "refuses",
           "passes", "repairs", "finished_exchange", "answer_message"]


# --- building message histories -----------------------------------------------------------


def request(*messages, **extra) -> dict:
    """A Messages API request body holding ``messages`` (``model`` and ``max_tokens`` set)."""
    return {"model": "claude-test", "max_tokens": 100, "messages": list(messages), **extra}


def user(*blocks) -> dict:
    return {"role": "user", "content": list(blocks)}


def assistant(*blocks) -> dict:
    return {"role": "assistant", "content": list(blocks)}


def text(value: str = "ok") -> dict:
    return {"type": "text", "text": value}


def use(id, name: str = "Bash") -> dict:
    """A client ``tool_use`` block."""
    return {"type": "tool_use", "id": id, "name": name, "input": {"command": "ls"}}


def result(id, content="done") -> dict:
    """The ``tool_result`` answering the call ``id``."""
    return {"type": "tool_result", "tool_use_id": id, "content": content}


# --- running a plugin's request hook --------------------------------------------------------


def exchange_for(body: dict, quirks: dict | None = None, endpoint: str = "messages",
                 backend: Backend | None = None) -> Exchange:
    """An exchange for ``body``, built as serving builds it: from the request's skeleton (or,
    for a body that cannot be one, from the full parse), routed to ``backend`` (by default a
    test backend with ``quirks``)."""
    raw = orjson.dumps(body)
    found = skeleton.decode(raw)
    kind = {"skeleton": found} if found is not None else {"body": body}
    if backend is None:
        backend = Backend(name="test", url="http://127.0.0.1:9", models=["*"],
                          quirks=quirks or {})
    return Exchange(endpoint=endpoint, method="POST", path="/v1/messages", query="", headers={},
                    raw_body=raw, backend=backend, **kind)


def refuses(hook, body: dict, options: dict | None = None, status: int = 400) -> str:
    """The message of the error (``status``, 400 by default) that ``hook`` (a plugin's
    ``relay_request``) refuses ``body`` with; fails if it does not refuse it so."""
    exchange = exchange_for(body)
    try:
        hook(exchange, options or {})
    except RelayError as error:
        assert error.status == status, f"refused with {error.status}, not {status}: {error}"
        return error.message
    raise AssertionError("the request was not refused")


def passes(hook, body: dict, options: dict | None = None) -> Exchange:
    """Run ``hook`` on ``body``, which it must leave alone: the client's own bytes go up."""
    exchange = exchange_for(body)
    hook(exchange, options or {})
    assert not exchange.changed and exchange.repairs == 0, exchange.timeline
    assert exchange.upstream_body() == orjson.dumps(body)
    return exchange


def repairs(hook, body: dict, options: dict | None = None) -> dict:
    """Run ``hook`` on ``body``, which it must repair; return the request as it would go
    up (parsed), for the caller to compare with the form it expects."""
    exchange = exchange_for(body)
    hook(exchange, options or {})
    assert exchange.changed, "the request was not changed"
    return orjson.loads(exchange.upstream_body())


# --- a finished exchange, as the end hooks see it -------------------------------------------


def answer_message(content: str = "ok", model: str = "claude-test") -> dict:
    """A complete Messages API answer saying ``content``."""
    return {"id": "msg_test", "type": "message", "role": "assistant", "model": model,
            "content": [text(content)], "stop_reason": "end_turn", "stop_sequence": None,
            "usage": {"input_tokens": 10, "output_tokens": 2}}


def finished_exchange(body: dict | None = None, *, status: int = 200,
                      answer: bytes | dict | None = None,
                      outcome: Outcome | str | None = Outcome.OK,
                      stream: bool = False, events: int | None = None,
                      attempts: Iterable[Attempt] | None = None,
                      timeline: Iterable[tuple] = (), error: RelayError | None = None,
                      stream_failure: StreamFailure | None = None,
                      headers: dict | None = None, quirks: dict | None = None,
                      backend: Backend | None = None) -> Exchange:
    """An exchange that is over, as ``relay_exchange_end`` sees it: ``body`` (by default a
    one-turn request) sent once to ``backend`` (as :func:`exchange_for` makes it), the
    upstream's answer (``status``; ``answer``, by default :func:`answer_message` or an error
    of that status) passed on to the client, ``outcome``, timings, and the ``timeline``
    entries given as ``(step, action, detail)`` tuples (``detail`` a dict, may be left out).

    ``attempts`` replaces the one attempt; ``error`` (a relay error the client got instead:
    then no upstream answer is recorded unless ``answer`` is given), ``stream`` and
    ``events`` (a stream's events written), ``stream_failure`` and ``headers`` (the client's
    request headers) are recorded as given."""
    exchange = exchange_for(body if body is not None else request(user(text("hi"))),
                            quirks=quirks, backend=backend)
    if headers:
        exchange.client_headers = CIMultiDict(headers)
    used = exchange.backend
    assert used is not None
    sent = exchange.upstream_body()
    exchange.release_body(sent)
    url = used.url.rstrip("/") + exchange.path
    if error is None or answer is not None:
        exchange.upstream_request = UpstreamRequest(
            url, CIMultiDict({"content-type": "application/json"}), sent)
        if answer is None:
            answer = answer_message() if status < 300 else {
                "type": "error", "error": {"type": "api_error", "message": "upstream failed"}}
        payload = answer if isinstance(answer, bytes) else orjson.dumps(answer)
        content_type = "text/event-stream" if stream else "application/json"
        exchange.upstream_response = UpstreamAnswer(
            status, CIMultiDict({"content-type": content_type}), None if stream else payload)
        exchange.attempts = list(attempts) if attempts is not None else [
            Attempt(used.name, url, status=status, seconds=0.01)]
        exchange.answer = Answer(status, CIMultiDict({"content-type": content_type}),
                                 size=len(payload), stream=stream, events=events)
        exchange.timings = Timings(upstream_headers=0.01, first_byte=0.02, last_byte=0.03)
    else:
        exchange.error = error
        exchange.attempts = list(attempts or ())
        exchange.answer = Answer(error.status, CIMultiDict({"content-type": "application/json"}),
                                 size=len(error.body(exchange.id)))
        exchange.timings = Timings(first_byte=0.01, last_byte=0.01)
    exchange.stream_failure = stream_failure
    exchange.outcome = Outcome(outcome) if outcome is not None else None
    for step, action, *detail in timeline:
        exchange.note(step, action, **(detail[0] if detail else {}))
    return exchange
