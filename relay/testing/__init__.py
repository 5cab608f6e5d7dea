"""A test kit for relay plugins, shipped with the package: what the project's own tests use.

    from relay.testing import request, user, assistant, use, result, text
    from relay.testing import exchange_for, refuses, passes, repairs

    def test_my_plugin_refuses_a_blocked_model():
        message = refuses(my_plugin.relay_request, request(user(text("hi")), model="bad"))
        assert "blocked" in message

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

import orjson

from relay import skeleton
from relay.config import Backend
from relay.errors import RelayError
from relay.exchange import Exchange

__all__ = ["request", "user", "assistant", "text", "use", "result", "exchange_for", "refuses",
           "passes", "repairs"]


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
