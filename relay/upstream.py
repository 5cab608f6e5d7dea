"""Where a request goes upstream and with which headers.

The client never chooses what the operator's key reaches: the upstream URL is the backend's
base URL with a path the relay has already checked (:func:`relay.inbound.check_target`)
appended as it is, and the result is checked again to stay under the base path.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from multidict import CIMultiDict
from yarl import URL

from .errors import RelayError

# RFC 9110 hop-by-hop headers, plus the ones the relay recomputes: aiohttp decodes content
# encodings on both sides, so a forwarded content-encoding or content-length would be stale.
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
    "te", "trailer", "trailers", "transfer-encoding", "upgrade",
    "host", "content-length", "content-encoding", "accept-encoding",
})
AUTH_HEADERS = ("x-api-key", "authorization")


def upstream_url(backend, path: str, query: str) -> URL:
    """``path`` (checked, still percent-encoded as the client sent it) and ``query`` (the
    client's own bytes) under the backend's base URL, never normalised: what the client sent
    is what goes up. Raises when the result would leave the base path."""
    base = urlsplit(backend.url).path.rstrip("/")
    url = URL(backend.url + path + ("?" + query if query else ""), encoded=True)
    if url.raw_path != base + path or url.raw_query_string != query:
        raise RelayError(400, f"path {path!r} cannot be sent to backend {backend.name}",
                         "invalid_request_error")
    return url


def _hop_by_hop(headers) -> frozenset:
    """The fixed hop-by-hop set plus whatever the sender's Connection header names."""
    named = headers.get("Connection")
    if not named:
        return HOP_BY_HOP
    return HOP_BY_HOP | {token.strip().lower() for token in named.split(",")}


def end_to_end(headers) -> CIMultiDict:
    """The headers a proxy passes on: all but the hop-by-hop ones."""
    out = CIMultiDict()
    drop = _hop_by_hop(headers)
    for name, value in headers.items():
        if name.lower() not in drop:
            out.add(name, value)
    return out


def forward_headers(headers, backend, strip_client_auth: bool = False) -> CIMultiDict:
    """The client's end-to-end headers with the backend's credentials: its own key when it
    has one, else the client's (unless ``strip_client_auth``: with inbound auth on, what the
    client presented is the relay's key and never goes up)."""
    out = end_to_end(headers)
    if backend.api_key or strip_client_auth:
        for name in AUTH_HEADERS:
            out.popall(name, None)
    if backend.api_key:
        if backend.auth == "bearer":
            out["Authorization"] = "Bearer " + backend.api_key
        else:
            out["x-api-key"] = backend.api_key
    return out


def client_headers(upstream_headers, extra: dict | None = None) -> CIMultiDict:
    out = end_to_end(upstream_headers)
    if extra:
        out.update(extra)
    return out
