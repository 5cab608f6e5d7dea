"""The one interface every wire format implements, with Anthropic's own (the identity) as its
defaults.

The host asks a backend's adapter (``backend.adapter``, chosen from its ``format`` when the
config loads) for everything that differs between formats, and never which format it is: a
new format is a new adapter here, and nothing outside :mod:`relay.formats` changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from multidict import CIMultiDict


class Translator(Protocol):
    """One upstream stream as Anthropic SSE bytes: :meth:`feed` each chunk (any boundaries),
    send on what it returns, :meth:`close` when the upstream is done. ``fault`` is
    ``(outcome, message)`` once the translator ended the stream itself with an ``error``
    event; ``raw`` keeps the upstream's own bytes for the record (bounded); ``unreported``
    names the usage counts (Anthropic's names) the upstream did not report, which the
    translated ``message_delta`` gives as 0: one list, filled in place no later than that
    event is returned, so that a plugin reading it as the event passes sees it whole."""

    fault: tuple[str, str] | None
    unreported: list[str]

    @property
    def raw(self) -> Any: ...

    def feed(self, chunk: bytes) -> bytes: ...

    def close(self) -> bytes: ...


class Adapter:
    """A wire format: how an Anthropic request goes up and what comes back becomes Anthropic's.
    Every method's default is the identity: Anthropic's format needs no translation."""

    name = "anthropic"
    # The backend quirks the format reads, with their choices (first: the default); a value
    # outside them is a config error.
    quirks: Mapping[str, tuple] = {}
    auth = "x-api-key"  # how the backend's key goes up unless relay.yaml says ``auth``
    carries_threads = True  # its requests can carry a server-held ``thread`` (relay.threads)
    checks_tool_ids = True  # the upstream holds tool ids to Anthropic's grammar
    signs_thinking = True  # thinking blocks come back signed, and signatures are checked
    # Pass-through answers are read whole to be translated (else they stream as they come).
    reads_passthrough = False
    # A 2xx event stream answering a request that asked for none is read whole and given to
    # answer_body (else it is relayed as a stream, which such a client cannot read).
    collects_streams = False
    # A 2xx answer that is no event stream, to a request that asked for one, is checked by
    # answer_body (its RelayError is answered with its status), then goes through
    # stream_translator all the same, which makes it the stream's events; else it is
    # answered whole, which a client reading a stream cannot read.
    streams_answers = False
    described = ""  # what the start-up line says of the format ("" for Anthropic's)
    # The errors a 200 stream may open with, in place of an answer, each with the status it
    # stands for (the API's own pairing, relay.errors.STATUS_TYPES). Under load Anthropic
    # answers 200 and then, as its first event, ``event: error`` with ``overloaded_error``
    # (manaflow-ai/subrouter#230, seen in production; charmbracelet/fantasy#323): nothing of
    # the answer exists yet, so the relay treats such a stream as that status while no byte
    # of it has reached the client (relay.upstream). Empty: the relay never looks.
    opening_errors: Mapping[str, int] = {"rate_limit_error": 429, "api_error": 500,
                                         "timeout_error": 504, "overloaded_error": 529}

    def upstream_target(self, path: str, query: str) -> tuple[str, str]:
        """The path (under the backend's base URL) and query a client's request goes to."""
        return path, query

    def request_body(self, body: bytes, backend, endpoint: str) -> bytes:
        """The upstream-bound body for the chain's Anthropic one (a RelayError 400 for what
        the format cannot carry)."""
        return body

    def request_headers(self, headers: CIMultiDict) -> None:
        """Adjust the headers going up, in place."""

    def answer_body(self, payload: bytes, backend_name: str,
                    model: str | None) -> tuple[bytes, tuple[str, ...]]:
        """A complete 2xx answer body as Anthropic's (a RelayError 502 when it is not one),
        and the usage counts (Anthropic's names) the upstream's answer did not report, which
        the translated body gives as 0 since an Anthropic answer must have them. An answer
        of Anthropic's format is its own report: the usage plugin reads it as it is."""
        return payload, ()

    def error_body(self, status: int, payload: bytes, request_id: str | None) -> bytes | None:
        """An upstream error body as Anthropic's, or None when it already is one."""
        return None

    def stream_translator(self, backend_name: str, model: str | None) -> Translator | None:
        """The stage an upstream stream goes through before the chain sees it; None when the
        upstream's events are Anthropic's already."""
        return None

    def count_tokens(self, raw: bytes) -> int | None:
        """A token count the relay answers itself (an estimate) when the format has no
        count_tokens endpoint; None sends the request up."""
        return None

    def model_list(self, payload: bytes, backend_name: str) -> bytes:
        """A ``GET /v1/models`` answer as Anthropic's (a RelayError 502 when it is not one)."""
        return payload


ANTHROPIC = Adapter()
