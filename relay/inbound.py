"""What a client request must be before the relay acts on it: a plain path, a Host that names
this relay, JSON where JSON is expected, and (when ``server.auth`` is on) a relay key; for the
operator's routes (:class:`AdminRoute`), the admin key instead.

Pure functions over strings and headers; the server calls them before anything else.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from .config import SEGMENT, Config, InboundKey, is_loopback
from .errors import RelayError, invalid_request

# Query strings go up as the client's bytes, so they may hold only what RFC 3986 allows in a
# query, and "%" only as the start of an escape.
_QUERY = re.compile(r"(?:[A-Za-z0-9._~!$&'()*+,;=:@/?-]|%[0-9A-Fa-f]{2})*")
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})


def split_target(raw: str) -> tuple[str, str]:
    """The request target as the client sent it, split into path and query (both still
    percent-encoded)."""
    path, _, query = raw.partition("?")
    return path, query


def check_target(path: str, query: str) -> list[str]:
    """The path's segments, or a 400 for a path that could mean something else once decoded
    or normalised on the way up: dot segments, empty segments, any percent-encoding
    (``%2e``, ``%2f``, ...), ``;`` parameters, or a query with characters a query may not
    hold."""
    segments = _plain_segments(path)
    if segments is None:
        if not path.startswith("/"):
            raise invalid_request(
                f"request target must be a path starting with '/': {path[:200]!r}")
        raise invalid_request(
            f"path {path[:200]!r} is not accepted: it must be plain segments "
            f"(no empty or dot segments, percent-encoding or ';' parameters)")
    if query and not _QUERY.fullmatch(query):
        raise invalid_request("query string holds characters that are not allowed in a query")
    return list(segments)


# A few paths are asked for over and over; what is cached is bounded (aiohttp caps a request
# line at 8 KiB).
@functools.lru_cache(maxsize=128)
def _plain_segments(path: str) -> tuple[str, ...] | None:
    if not path.startswith("/"):
        return None
    segments = tuple(path[1:].split("/"))
    for segment in segments:
        if segment in ("", ".", "..") or ";" in segment or not SEGMENT.fullmatch(segment):
            return None
    return segments


def host_allowed(host: str | None, config: Config) -> bool:
    """Whether a Host header names this relay: a loopback name, the address it was told to
    listen on, or one of ``server.allowed_hosts``. A browser always sends Host, so a page
    that rebinds its own name to 127.0.0.1 is refused here."""
    if host is None:
        return True  # HTTP/1.0 without Host: not a browser
    name = host.strip().lower()
    if name.startswith("["):
        name, _, port = name.partition("]")
        if port and not (port.startswith(":") and port[1:].isdigit()):
            return False
        name += "]"
    elif name.count(":") == 1:
        name, _, port = name.partition(":")
        if not port.isdigit():
            return False
    if name in LOOPBACK_NAMES or name in config.allowed_hosts:
        return True
    if name == config.host.lower() and config.host not in ("0.0.0.0", "::", ""):
        return True
    return is_loopback(name) and name.count(".") == 3  # other 127.x.y.z addresses


def is_json(content_type: str | None) -> bool:
    """Whether a Content-Type is JSON (``application/json``, any parameters). The types a web
    page may send cross-site without asking (text/plain, forms) are not."""
    if not content_type:
        return False
    return content_type.partition(";")[0].strip().lower() == "application/json"


def presented_key(headers) -> str | None:
    """The key a client sent, the way Anthropic clients send one: ``x-api-key``
    (``ANTHROPIC_API_KEY``) or ``Authorization: Bearer`` (``ANTHROPIC_AUTH_TOKEN``)."""
    key = headers.get("x-api-key")
    if key:
        return key
    authorization = headers.get("Authorization", "")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return None


class Gate:
    """The relay's inbound keys. relay.yaml's are compared as SHA-256 digests with
    :func:`hmac.compare_digest`, every key every time, so the time taken says nothing about
    which key (or how much of one) matched. Those ``relay keys`` stored (:mod:`relay.keys`),
    which may be many, are looked up by digest: what a lookup's time could tell is about the
    digest of what was presented, which says nothing of any key's value."""

    def __init__(self, keys: list[InboundKey]):
        self.keys = [(hashlib.sha256(key.secret.encode()).digest(), key) for key in keys]
        self.configured_names = frozenset(key.name for key in keys)
        self.stored: dict[bytes, InboundKey] = {}
        self.tenants = len(self.configured_names)  # names served: each is a tenant

    def replace(self, stored: dict[bytes, InboundKey]) -> None:
        """Serve with these stored keys from now on (by digest), in one assignment: a
        request in flight keeps the key it came in with."""
        self.stored = stored
        self.tenants = len(self.configured_names | {key.name for key in stored.values()})

    def authenticate(self, headers) -> InboundKey:
        presented = presented_key(headers)
        if presented is None:
            raise RelayError(401, "x-api-key header is required (or Authorization: Bearer)",
                             "authentication_error")
        digest = hashlib.sha256(presented.encode("utf-8", "surrogateescape")).digest()
        found = None
        for known, key in self.keys:
            if hmac.compare_digest(digest, known):
                found = key
        if found is None:
            found = self.stored.get(digest)
        if found is None:
            raise RelayError(401, "invalid x-api-key", "authentication_error")
        if found.expires is not None and found.expires <= time.time():
            raise RelayError(401, "this relay key has expired", "authentication_error")
        return found


def forbidden(key: InboundKey, what: str) -> RelayError:
    return RelayError(403, f"the relay key {key.name!r} may not use {what}", "permission_error")


@dataclass(frozen=True)
class AdminRoute:
    """A plugin route for the operator, not for clients: return it from ``relay_routes`` in
    place of a bare handler (``{"GET /metrics": AdminRoute(handler)}``). It takes the admin
    key (``server.auth.admin_key_env`` or ``admin_key_file``) or one of ``keys``, the route's
    own (a scraper's), and never a client's relay key."""

    handler: Callable
    keys: tuple[InboundKey, ...] = ()


class AdminGate:
    """Who may use an :class:`AdminRoute`: the admin key and the route's own keys, compared
    like relay keys (:class:`Gate`). With none of them configured, the route is open only
    where every route is (no inbound keys); otherwise it is closed."""

    def __init__(self, route: AdminRoute, admin_key: str | None, clients: Gate | None):
        keys = [InboundKey("admin", admin_key)] if admin_key else []
        keys += [key for key in route.keys if key.secret]
        self.admins = Gate(keys) if keys else None
        self.clients = clients

    def authenticate(self, headers, what: str) -> InboundKey | None:
        if self.admins is None and self.clients is None:
            return None
        if presented_key(headers) is None:
            raise RelayError(401, f"{what} takes the admin key: x-api-key header is required "
                                  f"(or Authorization: Bearer)", "authentication_error")
        if self.admins is not None:
            try:
                return self.admins.authenticate(headers)
            except RelayError:
                pass
        if self.clients is not None:
            try:
                self.clients.authenticate(headers)
            except RelayError:
                pass
            else:
                configured = ("" if self.admins is not None else
                              " (none is configured: see server.auth.admin_key_env)")
                raise RelayError(403, f"{what} takes the admin key{configured}, not a relay "
                                      f"key", "permission_error")
        raise RelayError(401, "invalid x-api-key", "authentication_error")
