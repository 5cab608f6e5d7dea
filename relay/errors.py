"""Anthropic-format errors, for the faults the relay itself reports."""

from __future__ import annotations

from typing import Any

import orjson

# The API's own pairing of status and error type; a relay error never invents another.
STATUS_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}


# The rule of a RelayError that carries the upstream's own error (told in its words, at the
# status it named), as a format adapter reads one from a successful-looking answer: recorded
# as the upstream's error, not as the relay refusing a malformed answer.
UPSTREAM_ERROR = "upstream_error"


class RelayError(Exception):
    """A refusal in Anthropic's error format: ``RelayError(400, "what is wrong")``. ``type``
    defaults to the API's own for the status (see ``STATUS_TYPES``). Raise it from a hook to
    answer the client with it; each hook's documentation says what raising it does there."""

    def __init__(self, status: int, message: str | None = None, type: str | None = None,
                 rule: str | None = None):
        if not isinstance(status, int) or message is None:
            raise TypeError("RelayError(status, message, type=None): the HTTP status comes "
                            "first, as in RelayError(400, 'what is wrong')")
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or STATUS_TYPES.get(status, "api_error")
        self.rule = rule  # which rule refused, when a plugin names one (metrics count by it)
        self.plugin: str | None = None  # set by the chain: the plugin that raised it
        # The exchange it refused, when one was built (relay.prepare.prepare_exchange).
        self.exchange: Any = None

    def body(self, request_id: str | None = None) -> bytes:
        return error_body(self.type, self.message, request_id)


def let_go(error: BaseException | None) -> None:
    """Drop what ``error`` and the errors it came from hold: the frames they went through
    and the exchange they carried (``.exchange``). The frames' locals hold the exchange or
    what keeps the error (the upstream's reader, a refused exchange's record of it): a cycle,
    which keeps a request's body alive until the collector's next pass, and a relay refusing
    large bodies one after another would hold every one of them until then."""
    pending, seen = [error], set()
    while pending:
        error = pending.pop()
        if not isinstance(error, BaseException) or id(error) in seen:
            continue
        seen.add(id(error))
        if "exchange" in getattr(error, "__dict__", ()):  # a RelayError's, an Unreachable's
            error.exchange = None  # type: ignore[attr-defined]
        error.__traceback__ = None
        pending += (error.__cause__, error.__context__)


def invalid_request(message: str, rule: str | None = None) -> RelayError:
    return RelayError(400, message, "invalid_request_error", rule=rule)


def not_json(detail) -> RelayError:
    """A body that does not parse, refused in the API's words: its texts are orjson's, the
    relay's parser ("The request body is not valid JSON: no low surrogate in string: line 1
    column 129185 (char 129184)", docs/evidence/inbound.json)."""
    return invalid_request(f"The request body is not valid JSON: {detail}")


def error_body(type: str, message: str, request_id: str | None = None) -> bytes:
    doc = {"type": "error", "error": {"type": type, "message": message}}
    if request_id:
        doc["request_id"] = request_id
    return orjson.dumps(doc)


class ConfigError(Exception):
    """A relay.yaml problem; the message starts with the key path (`backends[1].url: required`)."""
