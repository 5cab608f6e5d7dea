"""The operator's web console at ``/console`` (``server.console: true``).

Server-rendered pages over the shared record, so that every worker and replica shows the
same: the ledger rows of the state seam (:meth:`relay.state.State.rows`), the relay's own
keys (:mod:`relay.keys`), the backends' health (:mod:`relay.pools`) and the dump directory.
The request path does no work for it: the pages read the record only when someone asks
for one, and what a page read is kept only for the next look (:class:`Recent`).

Security (see docs/console.md): the admin key logs in once, at a form; after that a signed,
HttpOnly, SameSite=Strict cookie (:mod:`relay.console.auth`) proves the session. No client
key logs in, no key is ever in a URL. Every action is a form POST carrying a CSRF token.
Every answer carries a Content-Security-Policy that allows this origin's stylesheet and
nothing else (no script at all, no framing), and everything the pages need ships in the
package.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
import os
import secrets
import time
from importlib import resources
from typing import Any
from urllib.parse import parse_qs

from aiohttp import web

from .. import keys as keystore
from .. import pools
from .. import state as shared
from ..document import DocumentError
from ..errors import ConfigError, RelayError
from ..exchange import Outcome
from ..inbound import Gate
from ..limits import seconds_until
from . import auth, pages, record

log = logging.getLogger("relay.console")

PREFIX = "/console"
MAX_FORM_BYTES = 16 * 1024
MAX_FORM_FIELDS = 20
DAY = 86400.0
# Failed logins a minute from one client address, and from all together. The first bounds
# guessing from one place without touching anyone else's tries; the second bounds guessing
# from many places, and is high enough that filling it takes a hundred addresses failing
# within one minute: a single place that sends bad keys cannot lock the operator out.
# Counting only failures that the second let through bounds the addresses tracked, too.
FAILURES_PER_ADDRESS = 10
FAILURES_PER_MINUTE = 1000
SESSION_ROWS = 1000  # the most exchanges one session's page lists
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'none'; object-src 'none'; "
                               "base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    # Not no-referrer: under it a browser sends its form posts with ``Origin: null``, and
    # the origin is what a post from another site is told apart by (Fetch, "serializing a
    # request origin").
    "Referrer-Policy": "same-origin",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
    "Cache-Control": "no-store",
}
STATIC = {"console.css": "text/css"}
# What the key store's operations raise for a request they refuse (a name taken, no such
# key, limits that do not check).
REFUSED = (ValueError, LookupError, ConfigError)
CSRF = web.RequestKey("console_csrf", str)
SESSION = web.RequestKey("console_session", auth.Session)


def _hosts(request: web.Request) -> tuple[str | None, ...]:
    """The names the browser may have reached the console by: ``Host``, and behind a proxy
    that sets ``Host`` to the relay's own address (nginx's default), the first
    ``X-Forwarded-Host``. A page on another site cannot set that header on a form post, and
    the session-bound CSRF token is still required, so it only lets the console's own forms
    through such a proxy."""
    forwarded = request.headers.get("X-Forwarded-Host")
    host = request.headers.get("Host")
    if forwarded is None:
        return (host,)
    return host, forwarded.partition(",")[0].strip()


class Refused(Exception):
    """An action refused: the status and what the operator is told."""

    def __init__(self, status: int, message: str, allow: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.allow = allow  # a 405's Allow: the methods the path takes (RFC 9110, 15.5.6)


class Console:
    """The console's handlers: one instance per app, holding no record of its own."""

    def __init__(self, config, chain):
        if not config.admin_key:
            raise ValueError("the console needs the admin key")
        self.config = config
        self.chain = chain
        self.signer = auth.Signer(config.admin_key)
        # To tell an operator who typed a client's key what it is.
        self.clients = Gate(config.keys) if config.keys is not None else None
        folder = resources.files(__package__).joinpath("static")
        # Read once here, at start-up: serving them touches no disk.
        self.static = {name: folder.joinpath(name).read_bytes() for name in STATIC}
        self.last_day = Recent(DAY)
        self.last_week = Recent(record.SPEND_DAYS * DAY)
        self.refusals = shared.Seldom(log)  # an attack's every refused login, said once a minute
        self.routes = {
            ("GET", PREFIX): self.overview, ("GET", f"{PREFIX}/keys"): self.keys,
            ("POST", f"{PREFIX}/keys/create"): self.create_key,
            ("POST", f"{PREFIX}/keys/revoke"): self.revoke_key,
            ("POST", f"{PREFIX}/keys/limits"): self.set_limits,
            ("GET", f"{PREFIX}/sessions"): self.sessions,
            ("GET", f"{PREFIX}/session"): self.session,
            ("GET", f"{PREFIX}/exchanges"): self.exchanges,
            ("GET", f"{PREFIX}/exchange"): self.exchange,
            ("GET", f"{PREFIX}/dumps"): self.dumps, ("GET", f"{PREFIX}/dump"): self.dump,
            ("GET", f"{PREFIX}/dump/raw"): self.dump_raw,
            ("GET", f"{PREFIX}/backends"): self.backends,
            ("POST", f"{PREFIX}/logout"): self.logout,
        }

    @staticmethod
    def serves(path: str) -> bool:
        return path == PREFIX or path.startswith(PREFIX + "/")

    @property
    def state(self) -> shared.State:
        state = self.chain.state
        if state is None:
            raise Refused(503, "the relay's state is not open")
        return state

    # --- the way in ----------------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:
            response = await self._handle(request)
        except Refused as refused:
            response = self.page(request, "Refused", pages.notice(refused.message, bad=True),
                                 status=refused.status)
            if refused.allow is not None:
                response.headers["Allow"] = refused.allow
        except shared.Unavailable:
            response = self.page(request, "Unavailable", pages.notice(
                "The shared state cannot be reached: the console has nothing to show.",
                bad=True), status=503)
        except Exception:
            log.exception("console: %s %s failed", request.method, request.path)
            response = self.page(request, "Error", pages.notice(
                "This page could not be made; the relay's log says why.", bad=True), status=500)
        response.headers.update(HEADERS)
        return response

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        path, method = request.path, "GET" if request.method == "HEAD" else request.method
        if path.startswith(f"{PREFIX}/static/"):
            name = path[len(PREFIX) + 8:]
            if name not in self.static:
                raise Refused(404, "not found")
            if method != "GET":
                raise not_allowed(method, ["GET"])
            return web.Response(body=self.static[name], content_type=STATIC[name])
        if path == f"{PREFIX}/login":
            if method == "POST":
                return await self.login(request)
            if method == "GET":
                return self.login_form(request)
            raise not_allowed(method, ["GET", "POST"])
        handler = self.routes.get((method, path))
        if handler is None:
            allowed = [known_method for known_method, known in self.routes if known == path]
            if allowed:
                raise not_allowed(method, allowed)
            raise Refused(404, "not found")
        session = await self.session_of(request)
        if session is None:
            if method == "POST":
                raise Refused(401, "not logged in")
            return redirect(f"{PREFIX}/login")
        request[CSRF] = self.signer.csrf(session.nonce)
        if method == "POST":
            form = await self.form(request)
            if not self.signer.csrf_ok(session.nonce, form.get("csrf")):
                raise Refused(403, "this action's form is not this session's (no or a wrong "
                                   "CSRF token): reload the page and try again")
            request[SESSION] = session
            return await handler(request, form)
        return await handler(request)

    async def session_of(self, request: web.Request) -> auth.Session | None:
        session = self.signer.check(request.cookies.get(auth.COOKIE))
        if session is None:
            return None
        ended = await self.state.get(auth.LOGGED_OUT, [session.nonce])
        return None if ended[0] is not None else session

    async def form(self, request: web.Request) -> dict[str, str]:
        """A POSTed form, bounded, from this origin only (a browser says where a form came
        from in ``Origin``; one from elsewhere is refused before its token is looked at)."""
        origin = request.headers.get("Origin")
        if origin is not None and origin.partition("://")[2] not in _hosts(request):
            raise Refused(403, "this form was sent from another site")
        kind = (request.headers.get("Content-Type") or "").partition(";")[0].strip().lower()
        if kind != "application/x-www-form-urlencoded":
            raise Refused(415, "a form is expected")
        # Browsers give a form's length: one without is not a browser's.
        if request.content_length is None:
            raise Refused(411, "a form's length is required")
        if request.content_length > MAX_FORM_BYTES:
            raise Refused(413, "the form is too large")
        try:
            # An empty body is not read: aiohttp's stream for it refuses a read of 0 bytes.
            raw = (await request.content.readexactly(request.content_length)
                   if request.content_length else b"")
        except asyncio.IncompleteReadError:
            raise Refused(400, "the form was cut short") from None
        try:
            parsed = parse_qs(raw.decode("utf-8", "replace"), keep_blank_values=True,
                              max_num_fields=MAX_FORM_FIELDS)
        except ValueError:  # what parse_qs raises past max_num_fields
            raise Refused(400, "the form has too many fields") from None
        return {name: values[0] for name, values in parsed.items()}

    def page(self, request: web.Request, title: str, main: str, current: str | None = None,
             status: int = 200) -> web.Response:
        csrf = request.get(CSRF)
        return web.Response(text=pages.layout(title, main, current, csrf), status=status,
                            content_type="text/html", charset="utf-8")

    def login_form(self, request: web.Request, message: str | None = None,
                   status: int = 200) -> web.Response:
        nonce = secrets.token_hex(16)
        response = web.Response(text=pages.login(self.signer.csrf("login:" + nonce), message),
                                status=status, content_type="text/html", charset="utf-8")
        response.set_cookie(auth.LOGIN_COOKIE, nonce, max_age=auth.LOGIN_SECONDS,
                            path=f"{PREFIX}/login", httponly=True, samesite="Strict",
                            secure=request.secure)
        return response

    async def login(self, request: web.Request) -> web.StreamResponse:
        form = await self.form(request)
        nonce = request.cookies.get(auth.LOGIN_COOKIE) or ""
        if not nonce or not self.signer.csrf_ok("login:" + nonce, form.get("csrf")):
            return self.login_form(request, "The login form had expired: try again.", 403)
        address = client_address(request)
        failures = failure_counters(address)
        # Checked, not taken: a login that succeeds is not counted.
        taken = await self.state.take([counter._replace(amount=0) for counter in failures])
        if not taken.granted:
            now = time.time()
            wait = seconds_until(shared.window("minute", now)[1], now)
            mine = taken.blocked == failures[0].name
            self.refusals.warn(1, "console: a login from %s refused: %d failed logins this "
                                  "minute from %s", address,
                               FAILURES_PER_ADDRESS if mine else FAILURES_PER_MINUTE,
                               "that address" if mine else "all addresses together")
            response = self.login_form(request, f"Too many failed logins: try again in {wait} "
                                                f"seconds.", 429)
            response.headers["Retry-After"] = str(wait)
            return response
        key = form.get("key") or ""
        if not self.signer.is_admin_key(key):
            await self.state.add(failures)
            message = "That is not the admin key."
            if self.clients is not None and key:
                try:
                    self.clients.authenticate({"x-api-key": key})
                    message = "That is a relay key, for clients: the console takes the admin key."
                except RelayError:
                    pass
            return self.login_form(request, message, 401)
        token, session = self.signer.issue()
        response = redirect(PREFIX)
        response.set_cookie(auth.COOKIE, token, max_age=auth.SESSION_SECONDS, path=PREFIX,
                            httponly=True, samesite="Strict", secure=over_tls(request))
        response.del_cookie(auth.LOGIN_COOKIE, path=f"{PREFIX}/login")
        return response

    async def logout(self, request: web.Request, form: dict) -> web.StreamResponse:
        session: auth.Session = request[SESSION]
        left = max(session.expires - time.time(), 1.0)
        await self.state.put(auth.LOGGED_OUT, {session.nonce: b"1"}, ttl=left)
        response = redirect(f"{PREFIX}/login")
        response.del_cookie(auth.COOKIE, path=PREFIX, httponly=True, samesite="Strict",
                            secure=over_tls(request))
        return response

    # --- pages ---------------------------------------------------------------------------

    async def day_rows(self) -> list[dict]:
        return await self.last_day.rows(self.state)

    async def overview(self, request: web.Request) -> web.Response:
        rows = await self.day_rows()
        main = await asyncio.to_thread(
            lambda: pages.overview(record.overview(rows, time.time())))
        return self.page(request, "Overview", main, "overview")

    async def keys(self, request: web.Request, message: str | None = None,
                   secret: tuple[str, str] | None = None, status: int = 200) -> web.Response:
        # relay keys' own listing: each key with its usage, read from the limits' counters.
        listed = await keystore.listing(self.state, self.config)
        usage: dict[str, list] = {}
        spend: dict[str, list] = {}
        if listed:
            now = time.time()
            rows = await self.last_week.rows(self.state)
            for key in listed:
                usage[key["name"]] = [meter(entry) for entry in key.get("usage") or ()]
                spend[key["name"]] = record.spend_by_day(rows, key["name"], now)
        return self.page(request, "Keys", pages.keys(listed, usage, spend,
                                                     request[CSRF], message, secret),
                         "keys", status)

    async def create_key(self, request: web.Request, form: dict) -> web.Response:
        name = (form.get("name") or "").strip()
        try:
            if any(key.name == name for key in self.config.keys or ()):
                raise ValueError(f"{name!r} is a key in relay.yaml already")
            limits = keystore.parse_limits(form.get("limits") or None)
            secret = await keystore.create_key(self.state, name, limits=limits)
        except REFUSED as e:
            return await self.keys(request, message=f"Not created: {e}", status=400)
        return await self.keys(request, secret=(name, secret))

    async def revoke_key(self, request: web.Request, form: dict) -> web.StreamResponse:
        try:
            await keystore.revoke_key(self.state, form.get("name") or "")
        except REFUSED as e:
            return await self.keys(request, message=f"Not revoked: {e}", status=400)
        return redirect(f"{PREFIX}/keys")

    async def set_limits(self, request: web.Request, form: dict) -> web.StreamResponse:
        try:
            await keystore.set_limits(self.state, form.get("name") or "",
                                   keystore.parse_limits(form.get("limits") or None))
        except REFUSED as e:
            return await self.keys(request, message=f"Limits not changed: {e}", status=400)
        return redirect(f"{PREFIX}/keys")

    async def sessions(self, request: web.Request) -> web.Response:
        rows = await self.day_rows()
        page = _page(request)
        found = await asyncio.to_thread(record.sessions, rows)
        pages_count = (len(found) + record.PAGE - 1) // record.PAGE
        shown = found[page * record.PAGE:(page + 1) * record.PAGE]
        return self.page(request, "Sessions", pages.sessions(shown, page, pages_count),
                         "sessions")

    async def session(self, request: web.Request) -> web.Response:
        key = request.query.get("id") or ""
        # Its latest exchanges, shown in their order.
        rows = (await self.state.rows(since=time.time() - 7 * DAY, where={"session": key},
                                      limit=SESSION_ROWS, newest_first=True))[::-1]
        return self.page(request, "Session", pages.session(key, rows), "sessions")

    async def exchanges(self, request: web.Request) -> web.Response:
        filters = {name: request.query.get(name, "") for name in
                   ("key", "backend", "status", "outcome")}
        where: dict[str, Any] = {name: value for name, value in filters.items()
                                 if value and name != "status"}
        if filters["status"]:
            if not _digits(filters["status"]) or len(filters["status"]) > 3:
                raise Refused(400, "status: an HTTP status")
            where["status"] = int(filters["status"])
        before = _number(request.query.get("before"))
        rows = await self.state.rows(until=before, where=where or None,
                                     limit=record.PAGE + 1, newest_first=True)
        recent = await self.day_rows()
        choices = {
            "key": sorted({r["key"] for r in recent if r.get("key")}),
            "backend": sorted({b.name for b in self.config.backends}
                              | {r["backend"] for r in recent if r.get("backend")}),
            "status": sorted({r["status"] for r in recent if isinstance(r.get("status"), int)}),
            "outcome": [outcome.value for outcome in Outcome]}
        return self.page(request, "Exchanges", pages.exchanges(
            rows[:record.PAGE], filters, len(rows) > record.PAGE, choices), "exchanges")

    async def exchange(self, request: web.Request) -> web.Response:
        found = await self.state.rows(where={"id": request.query.get("id", "")}, limit=1,
                                      newest_first=True)
        return self.page(request, "Exchange", pages.exchange(found[0] if found else None),
                         "exchanges")

    async def dumps(self, request: web.Request) -> web.Response:
        directory = record.dump_dir(self.config)
        page = _page(request)
        if directory is None:
            main = pages.dumps(None, 0, page)
        else:
            listed, total = await asyncio.to_thread(record.list_dumps, directory,
                                                    page * record.PAGE)
            main = pages.dumps(listed, total, page)
        return self.page(request, "Dumps", main, "dumps")

    async def dump(self, request: web.Request) -> web.Response:
        directory = record.dump_dir(self.config)
        name = request.query.get("name", "")
        if directory is None:
            return self.page(request, "Dump", pages.dumps(None, 0, 0), "dumps")
        main = await asyncio.to_thread(_dump_page, directory, name)
        return self.page(request, f"Dump {name}", main, "dumps")

    async def dump_raw(self, request: web.Request) -> web.Response:
        """A dump's file as it is on disk, for what its page leaves out: streamed from the
        descriptor the checks opened, read in a thread a chunk at a time (aiohttp's file
        payload), as a download (never drawn by the browser)."""
        directory = record.dump_dir(self.config)
        if directory is None:
            raise Refused(404, "no dumps: the dump plugin is not in the pipeline")
        name = request.query.get("name", "")
        try:
            file = await asyncio.to_thread(record.open_dump, directory, name)
        except DocumentError as e:
            raise Refused(404, f"{name}: {e}") from None
        headers = {"Content-Disposition":
                   f'attachment; filename="{name.partition("/")[2]}"'}
        if request.method == "HEAD":
            headers["Content-Length"] = str(os.fstat(file.fileno()).st_size)
            file.close()
            return web.Response(headers=headers, content_type="application/json")
        return web.Response(body=file, headers=headers, content_type="application/json")

    async def backends(self, request: web.Request) -> web.Response:
        health = await pools.health(self.state, self.config)
        return self.page(request, "Backends", pages.backends(health, self.config.backends),
                         "backends")


class Recent:
    """The shared record's rows of the last ``span`` seconds, kept between page views so that
    looking again does not read them all again: a full read at most every ``FULL`` seconds;
    between full reads, at most every ``FRESH`` seconds, only the rows of exchanges that
    began since the last read, less ``MARGIN`` (a row is written when its exchange ends,
    under the time it began: one that ran longer than the margin shows from the next full
    read). Let go of after ``IDLE`` seconds without a look, so that a console nobody looks
    at holds nothing."""

    FULL = 60.0
    FRESH = 2.0
    MARGIN = 900.0
    IDLE = 300.0

    def __init__(self, span: float):
        self.span = span
        self.kept: dict[str, dict] = {}
        self.full_at = self.read_at = self.looked_at = 0.0
        self.lock = asyncio.Lock()
        self.forgetting: asyncio.TimerHandle | None = None

    async def rows(self, state: shared.State) -> list[dict]:
        async with self.lock:
            now = time.time()
            if now - self.full_at > self.FULL:
                found = await state.rows(since=now - self.span, limit=record.MAX_SCAN,
                                         newest_first=True)
                self.kept = {row["id"]: row for row in found}
                self.full_at = self.read_at = now
            elif now - self.read_at > self.FRESH:
                for row in await state.rows(since=self.read_at - self.MARGIN,
                                            limit=record.MAX_SCAN, newest_first=True):
                    self.kept[row["id"]] = row
                self.read_at = now
            self.looked_at = now
            if self.forgetting is None:
                self.forgetting = asyncio.get_running_loop().call_later(self.IDLE, self.forget)
            oldest = now - self.span
            return [row for row in self.kept.values() if row["time"] >= oldest]

    def forget(self) -> None:
        idle = time.time() - self.looked_at
        if idle >= self.IDLE:
            self.kept, self.full_at, self.forgetting = {}, 0.0, None
        else:
            self.forgetting = asyncio.get_running_loop().call_later(self.IDLE - idle,
                                                                   self.forget)


def client_address(request: web.Request) -> str:
    """Where a login came from, for counting its failures: the peer's address. Not
    ``X-Forwarded-For``: any client can write it, and nothing in relay.yaml names a proxy whose
    word on it could be trusted. An IPv6 address counts by its /64: one subnet (RFC 4291), all
    of whose addresses a single host may use."""
    peer = request.remote or ""
    try:
        found = ipaddress.ip_address(peer.partition("%")[0])
    except ValueError:
        return peer[:100] or "unknown"  # not over IP (a Unix socket): one place
    if isinstance(found, ipaddress.IPv6Address):
        if found.ipv4_mapped is not None:
            return str(found.ipv4_mapped)
        return str(ipaddress.IPv6Network((found, 64), strict=False))
    return str(found)


def failure_counters(address: str) -> list[shared.Counter]:
    """The counters a failed login adds to: its address's, then everyone's."""
    return [shared.Counter(f"console:login-failures:{address}", "minute", FAILURES_PER_ADDRESS),
            shared.Counter("console:login-failures", "minute", FAILURES_PER_MINUTE)]


def over_tls(request: web.Request) -> bool:
    """Whether the browser reached the console over TLS. The relay serves no TLS itself, so
    a proxy in front of it does, and only the browser knows: it names the scheme it used in
    the ``Origin`` of a form post. A client that claims https falsely gets a cookie it
    cannot send back over plain HTTP, which harms nobody else."""
    return request.secure or (request.headers.get("Origin") or "").lower().startswith("https://")


def not_allowed(method: str, allowed: list[str]) -> Refused:
    """A 405 naming the methods the path takes; HEAD wherever GET is."""
    methods = sorted({*allowed, *(["HEAD"] if "GET" in allowed else [])})
    return Refused(405, f"{method} is not allowed here", allow=", ".join(methods))


def redirect(location: str) -> web.Response:
    """After an action, the page to see (303: the browser follows it with a GET)."""
    return web.Response(status=303, headers={"Location": location})


def _dump_page(directory: str, name: str) -> str:
    """Read, check, replay and draw one dump (in a thread: files and the rebuild)."""
    try:
        doc = record.read_dump(directory, name)
    except DocumentError as e:
        return pages.dump(name, None, str(e), None,
                          raw=record.dump_file(directory, name) is not None)
    return pages.dump(name, doc, None, record.replay(doc))


def _digits(value: str) -> bool:
    # ASCII ones: str.isdigit takes "²" too, which int() refuses.
    return value.isascii() and value.isdigit()


def _page(request: web.Request) -> int:
    value = request.query.get("page") or "0"
    if not _digits(value):
        raise Refused(400, "page: a number")
    # Past 10,000 is 10,000, and int() refuses a number of more than 4,300 digits.
    digits = value.lstrip("0")
    return 10_000 if len(digits) > 5 else min(int(digits or "0"), 10_000)


def _number(value: str | None) -> float | None:
    try:
        found = float(value) if value else None
    except ValueError:
        found = math.nan
    if found is not None and not math.isfinite(found):
        raise Refused(400, "before: a time")
    return found


def meter(entry: dict) -> tuple[str, float, float]:
    """One of :func:`relay.keys.listing`'s usage entries as a bar: its label, what its
    window has used and its limit (a budget in US dollars)."""
    label = str(entry.get("limit")).replace("_", " ")
    if entry.get("models"):
        label += f" for models {entry['models']}"
    used, most = float(entry.get("used") or 0), float(entry.get("of") or 0)
    if entry.get("limit") == "budget":
        label, used, most = f"{label} (USD)", used / 1e6, most / 1e6
    return label, used, most
