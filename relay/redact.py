"""The operator's credentials never go back to a client.

An upstream may echo the key it was sent, in an error body (``invalid x-api-key: sk-...``) or
a header. Everything the relay sends a client on behalf of a backend that holds a key of the
relay's (its ``api_key_env``: the client's own key going up is the client's to see) has each
of those keys replaced by ``[redacted]``: headers, bodies, and streams.

A stream is scanned per write where writes are whole events (what :class:`relay.stream.
StreamRelay` writes): a key cannot straddle two events. Where writes may cut anywhere
(pass-through), :class:`StreamRedactor` keeps back the last ``len(key) - 1`` bytes of each
chunk until the next one shows whether a key began there.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from multidict import CIMultiDict

REDACTED = b"[redacted]"
# As in the dumps (plugins/dump.py): text shorter than this cannot be told from ordinary
# words, and a credential that short protects nothing. Real keys are far longer.
MIN_SECRET_LENGTH = 16


def secrets_of(keys) -> tuple[bytes, ...]:
    """The keys worth searching for, as bytes, longest first (so that a key containing
    another is replaced whole)."""
    found = {key.encode("utf-8") for key in keys if key and len(key) >= MIN_SECRET_LENGTH}
    return tuple(sorted(found, key=len, reverse=True))


def redact(data: bytes, secrets: tuple[bytes, ...]) -> bytes:
    for secret in secrets:
        if secret in data:
            data = data.replace(secret, REDACTED)
    return data


def redact_text(text: str, secrets: tuple[bytes, ...]) -> str:
    """``text`` with every key redacted: a message of the relay's that quotes an upstream's
    answer (one it could not translate), before it goes to the log, the record or a trace."""
    for secret in secrets:
        key = secret.decode("utf-8")
        if key in text:
            text = text.replace(key, REDACTED.decode())
    return text


def redact_headers(headers: CIMultiDict, secrets: tuple[bytes, ...]) -> CIMultiDict:
    """``headers`` with every value holding a key redacted (in place; returned)."""
    if not secrets:
        return headers
    texts = [secret.decode("utf-8") for secret in secrets]
    for name, value in list(headers.items()):
        if any(text in value for text in texts):
            for text in texts:
                value = value.replace(text, REDACTED.decode())
            headers.popall(name)
            headers.add(name, value)
    return headers


def redacting_writer(write: Callable[[bytes], Awaitable[None]],
                     secrets: tuple[bytes, ...]) -> Callable[[bytes], Awaitable[None]]:
    """``write`` itself when there is nothing to redact; else a write of whole events that
    redacts each."""
    if not secrets:
        return write
    # 16-byte probes from the keys' ends (their random part) first: a long needle costs
    # bytes.find its preprocessing on every call, and a write almost never holds a key.
    probes = tuple(secret[-MIN_SECRET_LENGTH:] for secret in secrets)
    if len(probes) == 1:
        probe, = probes

        def redacted(data: bytes) -> Awaitable[None]:  # no coroutine of its own per write
            # bytes.find, not `in`: `in` tries its operand as an integer first, every write
            return write(redact(data, secrets) if data.find(probe) >= 0 else data)
    else:
        def redacted(data: bytes) -> Awaitable[None]:
            if any(data.find(probe) >= 0 for probe in probes):
                data = redact(data, secrets)
            return write(data)
    return redacted


class StreamRedactor:
    """Redacts a byte stream cut anywhere: :meth:`feed` each chunk and send what it returns,
    then :meth:`close` for the rest. Holds back at most the longest key less one byte."""

    __slots__ = ("secrets", "keep", "held")

    def __init__(self, secrets: tuple[bytes, ...]):
        self.secrets = secrets
        self.keep = max(len(secret) for secret in secrets) - 1
        self.held = b""

    def feed(self, chunk: bytes) -> bytes:
        data = redact(self.held + chunk if self.held else chunk, self.secrets)
        # Whatever could be the start of a key goes out with the next chunk.
        cut = max(0, len(data) - self.keep)
        self.held = data[cut:]
        return data[:cut]

    def close(self) -> bytes:
        rest, self.held = self.held, b""
        return rest
