"""Which headers a proxy passes on, and which carry credentials."""

from __future__ import annotations

import datetime
import email.utils
import re

from multidict import CIMultiDict

# RFC 9110 hop-by-hop headers, plus the ones the relay recomputes: aiohttp decodes content
# encodings on both sides, so a forwarded content-encoding or content-length would be stale.
# And ``expect``: the relay has the client's whole body before it sends anything up (aiohttp
# answered the client's ``100-continue`` itself), and aiohttp's client, seeing the header,
# would hold the body back until the upstream said 100, which a server or proxy that ignores
# expectations (RFC 9110 allows it) never says.
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
    "te", "trailer", "trailers", "transfer-encoding", "upgrade",
    "host", "content-length", "content-encoding", "accept-encoding", "expect",
})
# The content codings aiohttp's client decodes: its parser's own test is the whole header
# value, lower-cased, being one of these. Any other coding leaves the body as the upstream
# sent it, and its header has to go on with it.
DECODED_CODINGS = frozenset({"gzip", "deflate", "br", "zstd"})
# What a client authenticates with, and what the relay puts a backend's key in.
AUTH_HEADERS = ("x-api-key", "authorization")


def _hop_by_hop(headers) -> frozenset:
    """The fixed hop-by-hop set plus whatever the sender's Connection header names."""
    named = headers.get("Connection")
    if not named:
        return HOP_BY_HOP
    return HOP_BY_HOP | {token.strip().lower() for token in named.split(",")}


def end_to_end(headers) -> CIMultiDict:
    """The headers a proxy passes on: all but the hop-by-hop ones."""
    # Copied whole (in C, order and repeats kept), then what does not pass taken out: most
    # names of the set are never there, and a lookup costs less than a header copied by hand.
    out: CIMultiDict[str] = CIMultiDict(headers)
    for name in _hop_by_hop(headers):
        if name in out:
            out.popall(name)
    return out


# What the relay's server cannot write in a field: every control character but HTAB (aiohttp's
# serialiser raises on them, for header injection). aiohttp's lenient response parser lets
# all of them but NUL through, CR and LF included only where they end a line.
_UNSENDABLE = re.compile("[\x00-\x08\x0a-\x1f\x7f]")


def sendable(headers):
    """An upstream's ``headers`` as the relay can pass them on: a name's whitespace before
    its colon removed, as RFC 9112 section 5.1 has a proxy do (aiohttp's lenient parser keeps
    it on the names llhttp frames by: ``Content-Length``, ``Transfer-Encoding``,
    ``Connection``, ``Upgrade``, ``Proxy-Connection``, all hop-by-hop once it is gone), and a
    control character in a value replaced by a space (RFC 9110 section 5.5). ``headers``
    itself when none needs it, which is nearly always."""
    if " " not in "".join(headers.keys()) and _UNSENDABLE.search(
            "".join(headers.values())) is None:
        return headers
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        out.add(name.rstrip(" \t"), _UNSENDABLE.sub(" ", value))
    return out


def keep_undecoded_coding(out, upstream_headers) -> None:
    """Put the upstream's ``Content-Encoding`` back on ``out`` when aiohttp left the body
    encoded (a coding it does not decode, or several): dropped, the client would read the
    encoded bytes as the plain body."""
    coding = upstream_headers.get("Content-Encoding")
    if coding and coding.lower() not in DECODED_CODINGS and coding.lower() != "identity":
        out["Content-Encoding"] = coding


def seconds_until(value: str, now: float) -> float | None:
    """Seconds from ``now`` until the instant a header names, as RFC 3339
    (``anthropic-ratelimit-*-reset``) or an HTTP date (``retry-after``); None for a value that
    is neither, or has no time zone."""
    try:
        when = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - now)
