"""The document form of the exchange record: what a dump file holds and ``relay replay``
reads, written and read here and nowhere else (as mitmproxy's ``get_state``/``set_state`` is
the one form of its flows).

:func:`to_document` makes the document of a finished exchange, :func:`encode` its bytes;
:func:`load` reads those bytes back and :func:`from_document` the record, checked. The
format's version is :data:`FORMAT`; :data:`READS` are the versions this relay reads (version
1 had no ``dump_format`` key). The document is built only when a dump or a replay asks for
it: serving keeps the record as objects and never serialises it.

Bodies are stored as the bytes that crossed the wire (UTF-8 text under ``body``, or
``body_base64``), never re-encoded, so any valid JSON the relay passed on (integers beyond 64
bits, deep nesting) is stored as sent; a body the upstream was sent unchanged is stored once
(``"body_same_as": "client_request"``); a body longer than the writer's limit keeps its first
bytes, and ``body_truncated`` says so (kept and total bytes, the sha256 of the whole). The
relay's own records (the translation table, the timeline) are made encodable: integers
beyond 64 bits as text, and anything nested deeper than :data:`MAX_DEPTH` cut there.

Secrets never reach the document. Every header whose name suggests a credential (see
:func:`relay.exchange.is_credential_header`) is redacted wherever headers are recorded,
whatever its value, and so is such a query parameter, and the password of a URL. Elsewhere
(bodies, the translation table, the timeline) every occurrence of such a value or of another
secret the writer names is replaced by ``[redacted]`` too, but only for secrets of at least
:data:`MIN_SECRET_LENGTH` characters, and never inside a JSON key: a short value cannot be
told apart from ordinary text, and a credential that short protects nothing anyway.

A document is data that anyone who could write the file may have made: the reader checks
every part it takes and raises :class:`DocumentError` saying what is wrong with one that is
not what the writer makes.
"""

from __future__ import annotations

import base64
import binascii
import copy
import dataclasses
import datetime as dt
import hashlib
import json
import re
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

import msgspec
import orjson
from multidict import CIMultiDict

from . import __version__
from .errors import RelayError
from .exchange import Exchange, Outcome, UpstreamAnswer, UpstreamRequest, is_credential_header

FORMAT = 2
READS = (1, 2)
REDACTED = "[redacted]"
ID_FIELDS = ("id", "tool_use_id")
# Secrets shorter than this are redacted by header name only, never searched for in text:
# see the module docstring.
MIN_SECRET_LENGTH = 16
# The relay's own records are cut this deep: well within what the encoder (255) and a
# reader's decoder (1024) take, and what Python's recursion allows.
MAX_DEPTH = 100
TOO_DEEP = f"[nested deeper than {MAX_DEPTH} levels: not recorded]"
INT64 = (-2 ** 63, 2 ** 64 - 1)  # what JSON encoders take; beyond, an integer is kept as text
DEFAULT_BODY_BYTES = 8 * 1024 * 1024
HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")  # RFC 9110 token
# Any control character but tab: a line break in a value would forge a header when sent.
CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
# What is shown of a document goes to a terminal: no control sequences but newline and tab.
UNPRINTABLE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_OUTCOMES = frozenset(outcome.value for outcome in Outcome)


class DocumentError(ValueError):
    """The document is not one this relay reads; the message says why."""


class RecordedError(RelayError):
    """The relay's own error as a document recorded it (``relay_error``): the status, type and
    message it answered with, as they stand there (a hand-made document's are not checked,
    so they need not make a valid :class:`relay.errors.RelayError`)."""

    def __init__(self, status: Any, type: Any, message: Any):
        Exception.__init__(self, message)
        self.status = status
        self.type = type
        self.message = message
        self.rule = None
        self.plugin = None


# --- writing ------------------------------------------------------------------------------


def config_document(config) -> dict:
    """The configuration a replay needs: pipeline, plugin options, backends (no keys)."""
    return {
        "source": config.source,
        "pipeline": list(config.pipeline),
        "plugins": copy.deepcopy(config.plugins),
        "backends": [backend_document(backend) for backend in config.backends],
    }


def backend_document(backend) -> dict:
    timeouts = {key: getattr(backend.timeouts, key) for key in ("connect", "read", "total")
                if getattr(backend.timeouts, key) is not None}
    return {"name": backend.name, "url": redact_url(backend.url), "models": list(backend.models),
            "default": backend.default, "rename": dict(backend.rename), "auth": backend.auth,
            "api_key_env": backend.api_key_env, "quirks": copy.deepcopy(backend.quirks),
            "timeouts": timeouts, "format": backend.format}


def headers_document(headers) -> dict | None:
    """Headers as ``{name: value}`` (a list of values for a repeated name), credentials
    redacted."""
    if headers is None:
        return None
    doc: dict = {}
    names: dict[str, str] = {}
    for name, value in headers.items():
        if is_credential_header(name):
            value = REDACTED
        key = names.setdefault(name.lower(), name)
        if key in doc:
            previous = doc[key]
            doc[key] = (previous if isinstance(previous, list) else [previous]) + [value]
        else:
            doc[key] = value
    return doc


def redact_query(query: str | None) -> str | None:
    """The query string with the value of every credential-named parameter redacted."""
    if not query:
        return query
    parts = []
    for part in query.split("&"):
        name, equals, _ = part.partition("=")
        parts.append(f"{name}={REDACTED}" if equals and is_credential_header(unquote(name))
                     else part)
    return "&".join(parts)


def redact_url(url: str | None) -> str | None:
    """``url`` without a password in it and with its credential query parameters redacted."""
    if not url:
        return url
    try:
        parts = urlsplit(url)
    except ValueError:  # a netloc that does not parse may still hold a password
        return REDACTED
    netloc = parts.netloc
    if parts.password is not None:
        netloc = f"{parts.username}:{REDACTED}@{netloc.rpartition('@')[2]}"
    return urlunsplit(parts._replace(netloc=netloc, query=redact_query(parts.query) or ""))


def header_secrets(headers) -> set[str]:
    """Credential header values, and the token alone of ``Bearer TOKEN`` (searched for in the
    rest of the document when long enough)."""
    found = set()
    for name, value in (headers or {}).items():
        if is_credential_header(name) and value:
            found.add(value)
            _, _, token = value.partition(" ")
            if token.strip():
                found.add(token.strip())
    return found


def query_secrets(query: str | None) -> set[str]:
    """The values of credential-named query parameters."""
    found = set()
    for part in (query or "").split("&"):
        name, equals, value = part.partition("=")
        if equals and value and is_credential_header(unquote(name)):
            found.update({value, unquote(value)})
    return found


def url_query(url: str | None) -> str:
    return (url or "").partition("#")[0].partition("?")[2]


def redact_bytes(raw: bytes, secrets) -> bytes:
    for secret in secrets:
        raw = raw.replace(secret.encode("utf-8"), REDACTED.encode())
    return raw


def utf8_prefix(raw: bytes) -> str | None:
    """``raw`` as text, less a character the cut split in two; None if it is not UTF-8."""
    for cut in range(4):
        try:
            return raw[:len(raw) - cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return None


def body_fields(raw, secrets, limit: int) -> dict:
    """``{"body": text}`` for UTF-8 bytes (redacted later with the rest), else
    ``{"body_base64": ...}`` of the bytes with every secret replaced first. Beyond ``limit``
    bytes only a prefix is kept (secrets replaced before the cut, so that none is kept in
    part), with ``body_truncated`` saying so."""
    if raw is None:
        return {"body": None}
    raw = bytes(raw)
    if len(raw) <= limit:
        try:
            return {"body": raw.decode("utf-8")}
        except UnicodeDecodeError:
            return {"body_base64": base64.b64encode(redact_bytes(raw, secrets)).decode("ascii")}
    whole = hashlib.sha256(raw).hexdigest()
    kept = redact_bytes(raw, secrets)[:limit]
    text = utf8_prefix(kept)
    fields: dict[str, Any] = ({"body_base64": base64.b64encode(kept).decode("ascii")}
                              if text is None else {"body": text})
    fields["body_truncated"] = {
        "kept_bytes": len(kept) if text is None else len(text.encode("utf-8")),
        "total_bytes": len(raw), "sha256": whole, "limit": "plugins.dump.max_body_bytes"}
    return fields


def message_outline(messages) -> list[dict]:
    """Per message: its index, role, and block types with their tool ids."""
    if not isinstance(messages, list):
        return []
    outline: list[dict] = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            outline.append({"index": index, "role": None, "blocks": []})
            continue
        content = message.get("content")
        blocks: list[dict[str, Any]]
        if isinstance(content, str):
            blocks = [{"type": "text"}]
        elif isinstance(content, list):
            blocks = []
            for block in content:
                if not isinstance(block, dict):
                    blocks.append({"type": None})
                    continue
                entry = {"type": block.get("type")}
                for field in ID_FIELDS:
                    if field in block:
                        entry[field] = block[field]
                blocks.append(entry)
        else:
            blocks = []
        outline.append({"index": index, "role": message.get("role"), "blocks": blocks})
    return outline


def exchange_messages(exchange):
    """The exchange's messages, or None when they cannot be read (the dump still records
    the bodies as they were sent)."""
    try:
        return exchange.messages
    except (RelayError, ValueError, RecursionError, msgspec.MsgspecError):
        return None


def clean(value, secrets, depth: int = 0):
    """A copy of ``value`` that any JSON encoder takes, with every occurrence of a secret in
    its strings replaced; keys are left as they are (see the module docstring)."""
    if isinstance(value, str):
        for secret in secrets:
            if secret in value:
                value = value.replace(secret, REDACTED)
        return value
    if value is None or isinstance(value, (bool, float)):
        return value
    if isinstance(value, int):
        return value if INT64[0] <= value <= INT64[1] else str(value)
    if depth >= MAX_DEPTH:
        return TOO_DEEP
    if isinstance(value, dict):
        return {str(k): clean(v, secrets, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(item, secrets, depth + 1) for item in value]
    if isinstance(value, (bytes, bytearray, memoryview, msgspec.Raw)):
        return clean(bytes(value).decode("utf-8", "replace"), secrets)
    return clean(str(value), secrets)


def _utc(timestamp: float | None) -> str | None:
    if timestamp is None:
        return None
    return dt.datetime.fromtimestamp(timestamp, dt.timezone.utc).isoformat()


def to_document(exchange: Exchange, *, reason: str, when: dt.datetime, config: dict,
                secrets=(), stream_error=None, max_body_bytes: int = DEFAULT_BODY_BYTES) -> dict:
    """The document of a finished exchange, secrets redacted: what a dump holds. ``reason``
    says why it was written, ``when`` when; ``config`` is :func:`config_document`'s (the
    backend's quirks are added); ``stream_error`` is the error event the stream ended with;
    each body keeps at most ``max_body_bytes``. Built only when asked for: nothing of it is
    kept on the exchange."""
    secrets = set(secrets) | header_secrets(exchange.client_headers)
    secrets |= query_secrets(exchange.query)
    sent = exchange.upstream_request
    if sent is not None:
        secrets |= header_secrets(sent.headers)
        secrets |= query_secrets(url_query(sent.url))
    ordered = sorted((s for s in secrets if len(s) >= MIN_SECRET_LENGTH and s != REDACTED),
                     key=len, reverse=True)

    def body(raw):
        return body_fields(raw, ordered, max_body_bytes)

    upstream_body = None if sent is None else sent.body
    if upstream_body is not None and (upstream_body is exchange.raw_body
                                      or upstream_body == exchange.raw_body):
        upstream_body_fields = {"body_same_as": "client_request"}
    else:
        upstream_body_fields = body(upstream_body)
    received = exchange.upstream_response
    backend = exchange.backend
    error = exchange.error
    outcome = exchange.outcome
    document = {
        "dump_format": FORMAT,
        "relay_version": __version__,
        "time": when.isoformat(),
        "request_id": exchange.id,
        "reason": reason,
        "outcome": None if outcome is None else str(outcome),
        "endpoint": exchange.endpoint,
        "started": _utc(exchange.received),
        "backend": {"name": backend.name, "url": redact_url(backend.url)} if backend else None,
        "client_request": {
            "method": exchange.method, "path": exchange.path,
            "query": redact_query(exchange.query),
            "headers": headers_document(exchange.client_headers),
            **body(exchange.raw_body)},
        "upstream_request": None if sent is None else {
            "url": redact_url(sent.url),
            "headers": headers_document(sent.headers),
            **upstream_body_fields},
        "upstream_response": None if received is None else {
            "status": received.status,
            "headers": headers_document(received.headers),
            **body(received.body)},
        "relay_error": None if error is None else {
            "status": getattr(error, "status", None), "type": getattr(error, "type", None),
            "message": getattr(error, "message", str(error))},
        "stream_error": stream_error,
        "attempts": [dataclasses.asdict(attempt) for attempt in exchange.attempts],
        "timings": dataclasses.asdict(exchange.timings),
        "translation": exchange.translation,
        "cache": exchange.cache,
        "timeline": {"messages": message_outline(exchange_messages(exchange)),
                     "steps": exchange.timeline},
        "config": {**config, "quirks": backend.quirks if backend else {}},
    }
    return clean(document, ordered)


def encode(document: dict) -> bytes:
    """The document (made by :func:`to_document`, so encodable) as indented JSON: a dump
    file's bytes."""
    return orjson.dumps(document, option=orjson.OPT_INDENT_2) + b"\n"


# --- reading ------------------------------------------------------------------------------


def load(raw: bytes) -> dict:
    """A document from its bytes, checked to be one (it has a ``client_request``) of a
    version this relay reads."""
    try:
        document = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise DocumentError(f"not valid JSON: {e}") from None
    if not isinstance(document, dict) or not isinstance(document.get("client_request"), dict):
        raise DocumentError("not a relay dump (no client_request)")
    version = document.get("dump_format", 1)
    if version not in READS or isinstance(version, bool):
        raise DocumentError(f"dump_format: {shown(version)} is not one this relay reads "
                            f"({', '.join(map(str, READS))})")
    return document


def from_document(document: dict) -> Exchange:
    """The record a document holds, as an :class:`relay.exchange.Exchange`: its id, endpoint
    and outcome, the client's request (headers as recorded, credentials ``[redacted]``), the
    upstream request and answer, the relay's error (a :class:`RecordedError`), the
    translation table and the timeline's steps. Every part a replay uses is checked; raises
    :class:`DocumentError` naming the first that is wrong."""
    part = section(document, "client_request", required=True)
    assert part is not None
    path = part.get("path")
    if not isinstance(path, str):
        raise DocumentError(f"client_request.path: must be a string, not {type_name(path)}")
    method = part.get("method") or "POST"
    if not isinstance(method, str):
        raise DocumentError(f"client_request.method: must be a string, not {type_name(method)}")
    query = part.get("query") or ""
    if not isinstance(query, str):
        raise DocumentError(f"client_request.query: must be a string, not {type_name(query)}")
    raw = body_bytes(part, "client_request")
    if raw is None:
        raise DocumentError("client_request: no body")
    headers = recorded_headers(part.get("headers"), "client_request.headers")
    upstream = section(document, "upstream_request")
    translation = document.get("translation")
    if translation is not None and not isinstance(translation, dict):
        raise DocumentError(f"translation: must be a mapping, not {type_name(translation)}")
    upstream_body = body_bytes(upstream, "upstream_request", raw)
    error = section(document, "relay_error") if upstream is None else None

    endpoint = document.get("endpoint")
    exchange = Exchange(endpoint=endpoint if isinstance(endpoint, str) else "messages",
                        method=method, path=path, query=query, headers=headers, raw_body=raw)
    if isinstance(document.get("request_id"), str):
        exchange.id = document["request_id"]
    outcome = document.get("outcome")
    exchange.outcome = (Outcome(outcome) if isinstance(outcome, str) and outcome in _OUTCOMES
                        else None)
    if upstream is not None:
        url = upstream.get("url")
        exchange.upstream_request = UpstreamRequest(url if isinstance(url, str) else "",
                                                    upstream.get("headers"), upstream_body)
    answer = document.get("upstream_response")
    status = answer.get("status") if isinstance(answer, dict) else None
    if isinstance(answer, dict) and isinstance(status, int) and not isinstance(status, bool):
        # Not replayed, so not refused: a body that cannot be read back is left out.
        try:
            answer_body = body_bytes(answer, "upstream_response")
        except DocumentError:
            answer_body = None
        exchange.upstream_response = UpstreamAnswer(status, answer.get("headers"), answer_body)
    if error is not None:
        exchange.error = RecordedError(error.get("status"), error.get("type"),
                                       error.get("message"))
    exchange.translation = translation or {}
    timeline = document.get("timeline")
    steps = timeline.get("steps") if isinstance(timeline, dict) else None
    if isinstance(steps, list):
        exchange.timeline = [step for step in steps if isinstance(step, dict)]
    return exchange


def section(document: dict, key: str, required: bool = False) -> dict | None:
    """The mapping under ``key``; None when it is null and need not be there."""
    value = document.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, dict):
        raise DocumentError(f"{key}: must be a mapping, not {type_name(value)}")
    return value


def body_bytes(part: dict | None, where: str, client_body: bytes | None = None) -> bytes | None:
    """The body stored in a section: UTF-8 text under ``body``, ``body_base64``, or
    ``body_same_as`` the client's; a truncated one is refused."""
    if not part:
        return None
    if part.get("body_truncated") is not None:
        cut = part["body_truncated"]
        kept = (f" (the first {shown(cut.get('kept_bytes'))} of {shown(cut.get('total_bytes'))} "
                f"bytes)" if isinstance(cut, dict) else "")
        raise DocumentError(f"{where}.body was truncated when dumped{kept}, beyond "
                            f"plugins.dump.max_body_bytes: a truncated dump cannot be replayed")
    if part.get("body_same_as") is not None:
        if part["body_same_as"] != "client_request" or client_body is None:
            raise DocumentError(f"{where}.body_same_as: must be \"client_request\"")
        return client_body
    if part.get("body_base64") is not None:
        if not isinstance(part["body_base64"], str):
            raise DocumentError(f"{where}.body_base64: must be a string")
        try:
            return base64.b64decode(part["body_base64"], validate=True)
        except (binascii.Error, ValueError):
            raise DocumentError(f"{where}.body_base64: not valid base64") from None
    body = part.get("body")
    if body is None:
        return None
    if not isinstance(body, str):
        raise DocumentError(f"{where}.body: must be a string")
    return body.encode("utf-8")


def recorded_headers(value, where: str) -> CIMultiDict:
    """Headers as recorded (``{name: value}``, a list of values for a repeated name), each name
    a header name and each value free of line breaks: safe to send."""
    headers: CIMultiDict = CIMultiDict()
    if value is None:
        return headers
    if not isinstance(value, dict):
        raise DocumentError(f"{where}: must be a mapping of name to value, not "
                            f"{type_name(value)}")
    for name, values in value.items():
        if not HEADER_NAME.match(name):
            raise DocumentError(f"{where}: {shown(name)} is not a header name")
        for item in (values if isinstance(values, list) else [values]):
            if not isinstance(item, str):
                raise DocumentError(f"{where}.{name}: must be a string or a list of strings, "
                                    f"not {type_name(item)}")
            if CONTROL.search(item):
                raise DocumentError(f"{where}.{name}: holds a line break or another control "
                                    f"character")
            headers.add(name, item)
    return headers


def type_name(value) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean",
            int: "a number", float: "a number", type(None): "null"}.get(type(value), "a value")


def shown(value, limit: int = 80) -> str:
    """A value from a document, short and printable, for a message."""
    text = repr(value) if isinstance(value, str) else pretty(value)
    return printable(text if len(text) <= limit else text[:limit] + "...")


def printable(text: str) -> str:
    """``text`` without the control characters a terminal would act on."""
    return UNPRINTABLE.sub(lambda m: f"\\x{ord(m.group()):02x}", str(text))


def pretty(value, sort_keys: bool = False) -> str:
    """JSON for people; what the JSON encoder refuses (integers beyond 64 bits, deep nesting
    in a hand-made document) through the standard library's, else a note. Never raises."""
    if isinstance(value, str):
        return printable(value)
    option = orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS
    if sort_keys:
        option |= orjson.OPT_SORT_KEYS
    try:
        return printable(orjson.dumps(value, option=option, default=str).decode())
    except orjson.JSONEncodeError:
        pass
    try:
        return printable(json.dumps(value, indent=2, sort_keys=sort_keys, default=str,
                                    ensure_ascii=False))
    except (TypeError, ValueError, RecursionError) as e:
        return f"(cannot be shown: {type(e).__name__})"
