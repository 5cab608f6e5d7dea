"""Who is looking at the console: the operator, proved once by the admin key at the login
form, then by a signed session cookie.

The cookie holds no key. It is ``<issued>.<nonce>.<mac>``: when it was issued, a random
nonce, and an HMAC-SHA256 of both under a signing key derived from the admin key. Every
worker and every replica that has the admin key can check it without asking anyone, and
changing the admin key ends every session. Logging out records the nonce in the shared
state's key-value store until the cookie would have expired anyway, so a copy of a
logged-out cookie is refused by every process that shares that state.

Each form carries a CSRF token, an HMAC of the session's nonce (for the login form, of a
random value also held in a short-lived cookie), checked on every POST: a page elsewhere
cannot read it, so cannot forge an action even where a browser would send the cookie.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from dataclasses import dataclass

SESSION_SECONDS = 12 * 3600
LOGIN_SECONDS = 600
COOKIE = "relay_console"
LOGIN_COOKIE = "relay_console_login"
LOGGED_OUT = "console-logged-out"  # the state namespace of ended sessions' nonces
_CONTEXT = b"relay console session v1"


def signing_key(admin_key: str) -> bytes:
    return hmac.new(admin_key.encode(), _CONTEXT, hashlib.sha256).digest()


# A cookie or a form field may hold any bytes (a header's that are not UTF-8 arrive as
# surrogates): they are compared and signed as the bytes they came as, never refused with a
# TypeError (compare_digest takes a str of ASCII only) or a UnicodeEncodeError.
def _bytes(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


def _mac(key: bytes, purpose: str, text: str) -> str:
    return hmac.new(key, _bytes(f"{purpose}:{text}"), hashlib.sha256).hexdigest()


def _same(presented: str, expected: str) -> bool:
    return hmac.compare_digest(_bytes(presented), _bytes(expected))


@dataclass(frozen=True)
class Session:
    nonce: str
    issued: int

    @property
    def expires(self) -> int:
        return self.issued + SESSION_SECONDS


class Signer:
    """Issues and checks session cookies and CSRF tokens under one admin key."""

    def __init__(self, admin_key: str):
        self.key = signing_key(admin_key)
        self.admin_digest = hashlib.sha256(admin_key.encode()).digest()

    def is_admin_key(self, presented: str) -> bool:
        digest = hashlib.sha256(_bytes(presented)).digest()
        return hmac.compare_digest(digest, self.admin_digest)

    def issue(self, now: float | None = None) -> tuple[str, Session]:
        session = Session(os.urandom(16).hex(), int(time.time() if now is None else now))
        text = f"{session.issued}.{session.nonce}"
        return f"{text}.{_mac(self.key, 'session', text)}", session

    def check(self, cookie: str | None, now: float | None = None) -> Session | None:
        """The session a cookie proves, or None (absent, forged, expired)."""
        if not cookie or len(cookie) > 200:
            return None
        issued, _, rest = cookie.partition(".")
        nonce, _, mac = rest.partition(".")
        if not (issued.isdigit() and nonce and mac):
            return None
        if not _same(mac, _mac(self.key, "session", f"{issued}.{nonce}")):
            return None
        session = Session(nonce, int(issued))
        now = time.time() if now is None else now
        if not session.issued - 60 <= now < session.expires:
            return None
        return session

    def csrf(self, nonce: str) -> str:
        return _mac(self.key, "csrf", nonce)[:32]

    def csrf_ok(self, nonce: str, token: str | None) -> bool:
        return bool(token) and _same(token or "", self.csrf(nonce))
