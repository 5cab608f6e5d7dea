"""Which requests form one conversation: the relay's own rule, in one place, for everything
that keeps something per session (a sticky upstream credential, the session record, cache
health).

In order:

1. Claude Code's ``X-Claude-Code-Session-Id`` header: the CLI sends it on every request of
   a session, the same across ``--resume``;
2. else the request's ``metadata.user_id``, which the API documents as an opaque id of the
   end user and which clients such as Claude Code fill with a per-session value;
3. else a fingerprint of what stays fixed through a conversation: ``system``, ``tools`` and
   the first message, with every ``cache_control`` taken out (clients move their cache
   breakpoints forward each turn, so a fingerprint that held them would change every turn).
   The model is not in it, so a ``/model`` switch stays the same session.

The key is namespaced by the inbound key's name, so two tenants never share a session, and
is a short hex digest: it never holds what the client sent.
"""

from __future__ import annotations

import hashlib

import orjson

from . import skeleton

HEADER = "x-claude-code-session-id"
MAX_ID = 256  # longer header or user_id values are hashed like any other


def session_key(exchange) -> str | None:
    """The session this request belongs to, or None for a request without messages."""
    messages = exchange.messages
    if not messages:
        return None
    tenant = (exchange.key_name or "").encode()
    header = exchange.client_headers.get(HEADER)
    if header:
        return _digest(b"h", tenant, header.encode()[:MAX_ID])
    metadata = exchange.field("metadata")
    user = metadata.get("user_id") if isinstance(metadata, dict) else None
    if isinstance(user, str) and user:
        return _digest(b"u", tenant, user.encode()[:MAX_ID])
    fixed = [_without_cache_control(exchange.field("system")),
             _without_cache_control(exchange.field("tools")),
             _without_cache_control(skeleton.value(messages[0]))]
    return _digest(b"f", tenant, orjson.dumps(fixed, option=orjson.OPT_SORT_KEYS,
                                              default=skeleton.value))


def _digest(kind: bytes, tenant: bytes, value: bytes) -> str:
    hasher = hashlib.blake2b(digest_size=12)
    for part in (kind, tenant, value):
        hasher.update(len(part).to_bytes(4, "big"))
        hasher.update(part)
    return hasher.hexdigest()


def _without_cache_control(item):
    if isinstance(item, dict):
        return {k: _without_cache_control(v) for k, v in item.items() if k != "cache_control"}
    if isinstance(item, list):
        return [_without_cache_control(v) for v in item]
    return item
