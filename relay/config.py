"""relay.yaml: loading and validation. Every problem names its key path."""

from __future__ import annotations

import base64
import fnmatch
import functools
import ipaddress
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

import yaml

from . import egress
from .beta_filter import QUIRKS as BETA_QUIRKS
from .errors import ConfigError
from .formats import ADAPTERS, FORMATS, Adapter
from .limits import Limits, check_limits, effective
from .options import Option, check_section, unknown
from .redact import secrets_of
from .state import OPTIONS as STATE_OPTIONS
from .telemetry import OPTIONS as TELEMETRY_OPTIONS

# Quirks the host itself reads (the wire formats', the beta filter's), beside those
# plugins declare.
HOST_QUIRKS = frozenset(q for a in ADAPTERS.values() for q in a.quirks) | frozenset(BETA_QUIRKS)
MAX_BODY_BYTES = 32 * 1024 * 1024  # the Messages API's own request limit
ROUTE_CACHE_BYTES = 256 * 1024
# What a path segment may hold: RFC 3986's unreserved and sub-delims, ":" and "@"; no "%"
# (an encoded "/" or "." would let a path leave the backend's base path once decoded), no ";".
SEGMENT = re.compile(r"[A-Za-z0-9._~@:+=,!$&'()*-]+")
# Paths passed through to the default backend untouched, as "METHOD /path"; "*" stands for
# one path segment.
DEFAULT_PASSTHROUGH = ("GET /v1/models", "GET /v1/models/*")
MAX_WORKERS = 256  # a typo, not a machine: each worker holds its own connections and memory


def _positive(value) -> str | None:
    return None if value > 0 else "must be a positive number"


def _at_least_zero(words: str) -> Callable[[float], str | None]:
    return lambda value: None if value >= 0 else f"must be {words}"


def _between(low: int, high: int) -> Callable[[int], str | None]:
    return lambda value: None if low <= value <= high else f"must be between {low} and {high}"


def _statuses(value, path: str) -> frozenset:
    _expect(value, list, path, "a list of status codes")
    for j, status in enumerate(value):
        _expect(status, int, f"{path}[{j}]", "a status code")
        if not (status == 429 or 500 <= status <= 599):
            raise ConfigError(f"{path}[{j}]: only 429 and 5xx answers are retried")
    return frozenset(value)


TIMEOUT_OPTIONS = (
    Option("connect", float, 10.0, "seconds to connect", expect="a positive number",
           check=_positive),
    Option("read", float, 600.0, "the longest silence allowed between two upstream chunks (and, "
           "while a request is sent, the longest the upstream may take none of it), in seconds",
           expect="a positive number", check=_positive),
    Option("total", float, None, "seconds for a whole exchange (null: no limit)",
           expect="a positive number", check=_positive),
)
TIMEOUTS = {option.name: option for option in TIMEOUT_OPTIONS}


@dataclass
class Timeouts:
    connect: float = TIMEOUTS["connect"].default
    read: float = TIMEOUTS["read"].default
    total: float | None = TIMEOUTS["total"].default


RETRY_STATUSES = (429, 500, 502, 503, 504, 529)
RETRY_OPTIONS = (
    Option("attempts", int, 1, "tries in all, the first included (1 to 10)",
           expect="an integer", check=_between(1, 10)),
    Option("backoff", float, 0.5, "the first wait in seconds; doubled each time, with jitter",
           expect="a positive number", check=_positive),
    Option("max_backoff", float, 8.0, "no wait is longer (a longer `retry-after` ends the "
           "retries)", expect="a positive number", check=_positive),
    Option("budget", float, 30.0, "seconds for all tries and waits together",
           expect="a positive number", check=_positive),
    Option("statuses", list, list(RETRY_STATUSES), "the upstream statuses retried (429 and "
           "5xx only)", parse=_statuses),
)
RETRIES = {option.name: option for option in RETRY_OPTIONS}


@dataclass
class Retries:
    """How a backend's failures are retried before any byte reaches the client. One attempt
    (no retries) unless relay.yaml asks: the SDKs and Claude Code retry on their own."""

    attempts: int = RETRIES["attempts"].default
    backoff: float = RETRIES["backoff"].default
    max_backoff: float = RETRIES["max_backoff"].default
    budget: float = RETRIES["budget"].default
    statuses: frozenset = frozenset(RETRY_STATUSES)


def _weight(value) -> str | None:
    return None if value > 0 else "must be a positive number"


POOL_OPTIONS = (
    Option("max_cooldown", float, 300.0, "the longest a credential cools down, in seconds, "
           "whatever `retry-after` asks", expect="a positive number", check=_positive),
    Option("default_cooldown", float, 10.0, "seconds a `429` or `529` without `retry-after` "
           "(or an exhausted `anthropic-ratelimit-*-reset`) cools a credential",
           expect="a positive number", check=_positive),
    Option("backoff", float, 1.0, "the first cooldown after a connection failure; doubled for "
           "each failure in a row (up to `max_cooldown`)", expect="a positive number",
           check=_positive),
    Option("refresh", float, 1.0, "seconds this process trusts what it knows of other "
           "processes' cooldowns and sessions before reading the shared state again (0: every "
           "request)", expect="a number of seconds, 0 or more",
           check=lambda value: None if value >= 0 else "must be 0 or more"),
    Option("sticky_seconds", float, 3600.0, "how long a session idle that long stays on its "
           "credential (the prompt cache lives at most an hour)", expect="a positive number",
           check=_positive),
)
POOL = {option.name: option for option in POOL_OPTIONS}


@dataclass
class PoolOptions:
    """How a backend's credentials are chosen and cooled down (:mod:`relay.pools`)."""

    max_cooldown: float = POOL["max_cooldown"].default
    default_cooldown: float = POOL["default_cooldown"].default
    backoff: float = POOL["backoff"].default
    refresh: float = POOL["refresh"].default
    sticky_seconds: float = POOL["sticky_seconds"].default


@dataclass
class Credential:
    """One upstream key of a backend's pool (``credentials:``): its name goes in logs,
    metrics, dumps and the timeline; its key never does."""

    name: str
    key: str = field(repr=False)
    weight: float = 1.0
    key_env: str | None = None
    key_file: str | None = None
    limits: dict | None = None  # checked (relay.limits.check_limits); the pool enforces them


@dataclass
class Backend:
    name: str
    # Never in a repr (a log line): it may hold a user and password (see url_credentials).
    url: str = field(repr=False)
    models: list[str]
    default: bool = False
    rename: dict[str, str] = field(default_factory=dict)
    api_key_env: str | None = None
    # Read from api_key_env at start-up, never from the file; never in a repr (a log line).
    api_key: str | None = field(default=None, repr=False)
    auth: str = "x-api-key"
    quirks: dict = field(default_factory=dict)
    timeouts: Timeouts = field(default_factory=Timeouts)
    retries: Retries = field(default_factory=Retries)
    fallbacks: list[str] = field(default_factory=list)  # backends to try, in order, after this one
    format: str = "anthropic"  # the wire format it speaks (relay.formats.FORMATS)
    # Whether it keeps conversations sent with ``thread`` (relay.threads); see _holds_threads.
    holds_threads: bool = False
    # A pool of upstream keys (relay.pools); empty for one key (api_key_env) or none.
    credentials: list[Credential] = field(default_factory=list)
    pool: PoolOptions = field(default_factory=PoolOptions)
    # Whether it answers ``diagnostics.previous_message_id`` itself; see _holds_diagnostics.
    holds_diagnostics: bool = False
    # The HTTP(S) proxy it is reached through (relay.egress), None for a direct connection.
    proxy: egress.Proxy | None = None

    @functools.cached_property
    def adapter(self) -> Adapter:
        """The wire format's adapter (:class:`relay.formats.base.Adapter`): everything the
        host does differently for a format, it asks this for. Chosen when the config loads."""
        return ADAPTERS[self.format]

    def serves(self, model: str) -> bool:
        return any(fnmatch.fnmatchcase(model, pattern) for pattern in self.models)

    @functools.cached_property
    def secrets(self) -> tuple[bytes, ...]:
        """Every key of the relay's that goes to this backend (its ``api_key_env`` key, or
        each of its ``credentials``), as :func:`relay.redact.secrets_of` searches for them
        in what goes back to clients. Empty when the client's own key goes up."""
        return secrets_of(([self.api_key] if self.api_key else
                           [credential.key for credential in self.credentials])
                          + self.url_credentials)

    @functools.cached_property
    def url_credentials(self) -> list[str]:
        """What the ``user:password@`` of its URL sends: aiohttp makes them Basic credentials
        on every request, the operator's as much as a key is. The user and password, and
        the Basic token they make; empty for a URL without them."""
        parts = urlsplit(self.url)
        if parts.username is None and parts.password is None:
            return []
        user, password = unquote(parts.username or ""), unquote(parts.password or "")
        token = base64.b64encode(f"{user}:{password}".encode("latin-1", "replace")).decode()
        return [user, password, token]

    @property
    def keyed(self) -> bool:
        """Whether the operator's key (or keys) go up, not the client's: its
        ``api_key_env``, its ``credentials``, or credentials in its URL."""
        return bool(self.api_key_env or self.credentials or self.url_credentials)

    def upstream_model(self, model: str) -> str | None:
        """The model name to send up, when relay.yaml renames this one."""
        for pattern, target in self.rename.items():
            if fnmatch.fnmatchcase(model, pattern):
                return target
        return None


@dataclass
class InboundKey:
    """A key a client presents to the relay (``server.auth.keys``): never from relay.yaml
    itself, and never sent upstream."""

    name: str
    secret: str = field(repr=False)
    backends: list[str] | None = None  # the backends it may reach; None: all
    models: list[str] | None = None  # model name patterns it may ask for; None: all
    # Its limits with server.auth.default_limits under them (relay.limits); None: none.
    limits: Limits | None = None
    expires: float | None = None  # epoch seconds; a key made by `relay keys create --expires`

    def may_use(self, backend: Backend, model: str | None) -> bool:
        if self.backends is not None and backend.name not in self.backends:
            return False
        if self.models is not None and (model is None or not any(
                fnmatch.fnmatchcase(model, pattern) for pattern in self.models)):
            return False
        return True


@dataclass
class Passthrough:
    """One pass-through route: a method and a path whose ``*`` segments match any one
    segment."""

    method: str
    segments: tuple[str, ...]

    def matches(self, method: str, segments: list[str]) -> bool:
        return (method == self.method and len(segments) == len(self.segments)
                and all(want == "*" or want == got
                        for want, got in zip(self.segments, segments, strict=True)))


# --- server: -------------------------------------------------------------------------------
# The host's own keys, declared like plugin options: the checks, the defaults (Config's too),
# the docs' table and the CLI's help all come from here.

def _hosts(value, path: str) -> list[str]:
    names = _expect(value or [], list, path, "a list of host names")
    for i, name in enumerate(names):
        _expect(name, str, f"{path}[{i}]", "a host name")
    return [name.lower() for name in names]


def _routes(value, path: str) -> list[Passthrough]:
    _expect(value, list, path, 'a list of "METHOD /v1/path" entries')
    return [_passthrough(entry, f"{path}[{i}]") for i, entry in enumerate(value)]


def _mapping(value, path: str) -> dict:
    return _expect(value, dict, path, "a mapping")


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_DRAIN = "a number of seconds, 0 or more"
_KEEPALIVE = "a number of seconds, 0 (off) or more"

SERVER_OPTIONS = (
    Option("host", str, "127.0.0.1", "the address to listen on; `--host` overrides. Beyond "
           "loopback, a backend with `api_key_env` needs inbound auth or "
           "`allow_unauthenticated`", expect="a string"),
    Option("port", int, 8787, "the port to listen on (0 picks a free port); `--port` "
           "overrides", expect="an integer", check=_between(0, 65535)),
    Option("max_body_bytes", float, MAX_BODY_BYTES, "the largest request body (the API's own "
           "32 MB limit); larger bodies get `413 request_too_large`",
           expect="a positive number", check=_positive),
    Option("upstream_connections", float, 512, "connections open to the backends, in all",
           expect="a positive number", check=_positive),
    Option("log_level", str, "INFO", "DEBUG, INFO, WARNING or ERROR (any case)",
           expect="a string",
           check=lambda value: None if value.upper() in LOG_LEVELS
           else "must be DEBUG, INFO, WARNING or ERROR"),
    Option("access_log", bool, False, "one log line per exchange", expect="true or false"),
    Option("max_upstream_body_bytes", float, 64 * 1024 * 1024, "the largest non-streaming "
           "upstream answer, decompressed (`502` beyond)", expect="a positive number",
           check=_positive),
    Option("max_connections", float, 1024, "open client connections; past it a connection "
           "gets `529 overloaded_error`", expect="a positive number", check=_positive),
    Option("header_timeout", float, 10.0, "seconds a connection may go without a complete "
           "request (also idle keep-alive)", expect="a positive number", check=_positive),
    Option("body_timeout", float, 60.0, "seconds to receive a whole request body "
           "(`408 timeout_error` after)", expect="a positive number", check=_positive),
    Option("allowed_hosts", list, [], "`Host` names served besides loopback ones, when auth is "
           "off", parse=_hosts),
    Option("allow_unauthenticated", bool, False, "listen beyond loopback without inbound auth "
           "anyway (something in front of the relay authenticates clients)",
           expect="true or false"),
    Option("passthrough", list, list(DEFAULT_PASSTHROUGH), 'other paths sent on to the default '
           'backend untouched, as `"METHOD /v1/path"` (`*` for one segment)', parse=_routes),
    Option("auth", dict, None, "inbound keys (`keys`, `admin_key_env` / `admin_key_file`); "
           "without it, inbound auth is off", parse=_mapping),
    Option("log_format", str, "text", "`json`: one JSON object per line; `--log-format` "
           "overrides", choices=("text", "json"), expect="text or json"),
    Option("workers", int, 1, "worker processes sharing the port; `--workers` overrides",
           expect="an integer", check=_between(1, MAX_WORKERS)),
    Option("drain_seconds", float, 30.0, "on SIGTERM, how long requests in flight may finish "
           "(0: none)", expect=_DRAIN, check=_at_least_zero(_DRAIN)),
    # Off by default, as Traefik's requestAcceptGraceTimeout and Boundary's shutdown grace
    # period are: without a load balancer that polls /readyz the wait only delays the stop
    # (docs/operations.md, "The drain", has the sources).
    Option("unready_seconds", float, 0.0, "on SIGTERM, how long `/readyz` answers 503 while "
           "the relay still accepts and serves, before the drain (0: the drain starts at once)",
           expect=_DRAIN, check=_at_least_zero(_DRAIN)),
    # Below Claude Code's 20 s "Waiting for API response" stall banner and the 60 s idle
    # timeout common to proxies and load balancers; the gateways that fixed this chose 10 to
    # 15 s (archestra 10 s, LiteLLM 15 s).
    Option("stream_keepalive", float, 10.0, "seconds a stream may be quiet toward its client "
           "before a ping (0: never)", expect=_KEEPALIVE, check=_at_least_zero(_KEEPALIVE)),
    Option("console", bool, False, "serve the operator's web console at `/console`, behind "
           "the admin key (`auth.admin_key_env` / `admin_key_file`, which it needs)",
           expect="true or false"),
    Option("resume_bytes", float, 64 * 1024 * 1024, "memory kept so that a session's next "
           "request is checked from where its previous one ended (its new turn only), in all; "
           "one session takes at most a quarter (0: every request is walked whole)",
           expect="a number of bytes", check=lambda n: None if n >= 0 else "must be 0 or more"),
    Option("keep_freed_bytes", float, 64 * 1024 * 1024, "freed memory the process keeps for "
           "reuse rather than handing back to the kernel, so that large request bodies reuse "
           "pages instead of faulting in fresh ones (glibc; 0: the C library's own policy)",
           expect="a number of bytes", check=lambda n: None if n >= 0 else "must be 0 or more"),
)
SERVER = {option.name: option for option in SERVER_OPTIONS}


def server_default(name: str):
    """The default of the ``server.<name>`` key, as the relay uses it."""
    return SERVER[name].initial(f"server.{name}")


@dataclass
class Config:
    backends: list[Backend]
    pipeline: list[str] = field(default_factory=list)
    plugins: dict[str, dict] = field(default_factory=dict)
    host: str = SERVER["host"].default
    port: int = SERVER["port"].default
    max_body_bytes: int = SERVER["max_body_bytes"].default
    upstream_connections: int = SERVER["upstream_connections"].default
    log_level: str = SERVER["log_level"].default
    access_log: bool = SERVER["access_log"].default
    max_upstream_body_bytes: int = SERVER["max_upstream_body_bytes"].default
    header_timeout: float = SERVER["header_timeout"].default
    body_timeout: float = SERVER["body_timeout"].default
    max_connections: int = SERVER["max_connections"].default
    allowed_hosts: list[str] = field(default_factory=list)
    allow_unauthenticated: bool = SERVER["allow_unauthenticated"].default
    # Empty for a Config built in code (validate); relay.yaml's default is DEFAULT_PASSTHROUGH.
    passthrough: list[Passthrough] = field(default_factory=list)
    keys: list[InboundKey] | None = None  # None: inbound auth off
    # server.auth.default_limits, checked: under every key's own, those `relay keys` made too.
    default_limits: dict = field(default_factory=dict)
    admin_key: str | None = field(default=None, repr=False)  # server.auth.admin_key_env/_file
    log_format: str = SERVER["log_format"].default
    workers: int = SERVER["workers"].default
    drain_seconds: float = SERVER["drain_seconds"].default
    unready_seconds: float = SERVER["unready_seconds"].default
    stream_keepalive: float = SERVER["stream_keepalive"].default
    console: bool = SERVER["console"].default
    resume_bytes: int = SERVER["resume_bytes"].default
    keep_freed_bytes: int = SERVER["keep_freed_bytes"].default
    # The checked ``state:`` section (relay.state.OPTIONS): where shared state lives.
    state: dict = field(default_factory=dict)
    # The checked ``telemetry:`` section (relay.telemetry.OPTIONS): traces, off by default.
    telemetry: dict = field(default_factory=dict)
    source: str | None = None
    _routes: dict = field(default_factory=dict, repr=False, compare=False)
    _routes_bytes: int = field(default=0, repr=False, compare=False)

    def backend_for(self, model: str) -> Backend | None:
        try:
            return self._routes[model]
        except KeyError:
            pass
        found = next((b for b in self.backends if b.serves(model)), None)
        if found is None:
            found = self.default_backend(fallback=False)
        # Model names come from clients: what the cache holds is bounded by bytes, not only
        # by count.
        if self._routes_bytes + len(model) > ROUTE_CACHE_BYTES:
            self._routes.clear()
            self._routes_bytes = 0
        self._routes[model] = found
        self._routes_bytes += len(model)
        return found

    def backend(self, name: str) -> Backend:
        return next(b for b in self.backends if b.name == name)

    def default_backend(self, fallback: bool = True) -> Backend | None:
        for backend in self.backends:
            if backend.default:
                return backend
        return self.backends[0] if fallback else None


def load(path: str, env=os.environ, require_keys: bool = True) -> Config:
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    config = parse(raw if raw is not None else {}, env, require_keys)
    config.source = path
    return config


def _expect(value, kind, path: str, what: str):
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{path}: must be {what}")
    return value


def _number(value, path: str, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (positive and value <= 0):
        raise ConfigError(f"{path}: must be a positive number")
    return value


def _unknown(section: dict, known: set, path: str) -> None:
    for key in section:
        if key not in known:
            raise unknown(path, key, known, "key")


def parse(raw, env=os.environ, require_keys: bool = True) -> Config:
    """Validate a loaded relay.yaml document and build the :class:`Config`.

    ``require_keys=False`` is for offline tools (validate, replay without --send): a backend
    whose ``api_key_env`` variable is unset then simply has no key.
    """
    _expect(raw, dict, "(top level)", "a mapping")
    _unknown(raw, {"server", "pipeline", "plugins", "backends", "state", "telemetry"}, "")
    config = Config(backends=[])
    state = _expect(raw.get("state", {}) or {}, dict, "state", "a mapping")
    config.state = check_section(state, STATE_OPTIONS, "state", "key")
    telemetry = _expect(raw.get("telemetry", {}) or {}, dict, "telemetry", "a mapping")
    config.telemetry = check_section(telemetry, TELEMETRY_OPTIONS, "telemetry", "key")

    server = _expect(raw.get("server", {}) or {}, dict, "server", "a mapping")
    values = check_section(server, SERVER_OPTIONS, "server", "key")
    for name in ("host", "port", "access_log", "header_timeout", "body_timeout",
                 "allowed_hosts", "allow_unauthenticated", "passthrough", "log_format",
                 "workers", "console"):
        setattr(config, name, values[name])
    # Counts and sizes have always taken a number and dropped its fraction.
    for name in ("max_body_bytes", "upstream_connections", "max_upstream_body_bytes",
                 "max_connections", "resume_bytes", "keep_freed_bytes"):
        setattr(config, name, int(values[name]))
    config.log_level = values["log_level"].upper()
    config.drain_seconds = float(values["drain_seconds"])
    config.unready_seconds = float(values["unready_seconds"])
    config.stream_keepalive = float(values["stream_keepalive"])
    if values["auth"] is not None:
        config.keys = _keys(values["auth"], "server.auth", env, require_keys)
        config.default_limits = check_limits(values["auth"].get("default_limits"),
                                             "server.auth.default_limits")
        config.admin_key = _admin_key(values["auth"], "server.auth", env, require_keys,
                                      config.keys)
    if config.console and not (values["auth"] and any(k in values["auth"] for k in ADMIN_KEYS)):
        raise ConfigError("server.console: needs the admin key (server.auth.admin_key_env or "
                          "admin_key_file): the console is the operator's, never open")

    pipeline = _expect(raw.get("pipeline", []) or [], list, "pipeline", "a list of plugin names")
    for i, name in enumerate(pipeline):
        _expect(name, str, f"pipeline[{i}]", "a plugin name")
        if name in pipeline[:i]:
            raise ConfigError(f"pipeline[{i}]: {name!r} is listed twice")
    config.pipeline = list(pipeline)

    plugins = _expect(raw.get("plugins", {}) or {}, dict, "plugins",
                      "a mapping of plugin name to options")
    for name, options in plugins.items():
        config.plugins[name] = dict(_expect(options or {}, dict, f"plugins.{name}", "a mapping"))

    backends = raw.get("backends")
    if not backends:
        raise ConfigError("backends: required (at least one backend)")
    _expect(backends, list, "backends", "a list")
    names = set()
    for i, item in enumerate(backends):
        backend = _backend(item, f"backends[{i}]", env, require_keys)
        if backend.name in names:
            raise ConfigError(f"backends[{i}].name: {backend.name!r} is used twice")
        names.add(backend.name)
        config.backends.append(backend)
    if sum(b.default for b in config.backends) > 1:
        raise ConfigError("backends: only one backend may be the default")
    for i, backend in enumerate(config.backends):
        for j, name in enumerate(backend.fallbacks):
            if name not in names or name == backend.name:
                raise ConfigError(f"backends[{i}].fallbacks[{j}]: {name!r} is not another "
                                  f"configured backend")
        for j, credential in enumerate(backend.credentials):
            counted = counted_from_usage(credential.limits)
            if counted and "usage" not in config.pipeline:
                raise ConfigError(
                    f"backends[{i}].credentials[{j}].limits: {counted} counts what answers "
                    f"used, which the usage plugin reads: add usage to pipeline")
    return config


def counted_from_usage(raw: dict | None) -> str | None:
    """The first limit of ``raw`` (checked) that only an answer's usage can advance."""
    for rule in (raw or {}, *(raw or {}).get("models", {}).values()):
        for name in ("input_tokens_per_minute", "output_tokens_per_minute", "budget"):
            if rule.get(name) is not None:
                return name
    return None


def _passthrough(entry, path: str) -> Passthrough:
    _expect(entry, str, path, 'a "METHOD /v1/path" string')
    method, _, route = entry.strip().partition(" ")
    if not route:
        method, route = "GET", method
    route = route.strip()
    segments = route.split("/")[1:]
    if (not route.startswith("/v1/") or not method.isalpha() or not method.isupper()
            or any(s in ("", ".", "..") or not SEGMENT.fullmatch(s) for s in segments if s != "*")):
        raise ConfigError(f'{path}: must be "METHOD /v1/path" with plain path segments '
                          f'(or * for one segment), not {entry!r}')
    return Passthrough(method, tuple(segments))


def _names(value, path: str) -> list[str]:
    _expect(value, list, path, "a list of names")
    for j, name in enumerate(value):
        _expect(name, str, f"{path}[{j}]", "a string")
    return list(value)


AUTH_OPTIONS = (
    Option("keys", list, None, "the inbound keys, each a mapping of the keys below (`[]`: "
           "only those `relay keys create` stores)", required=True, expect="a list of keys"),
    Option("admin_key_env", str, None, "the environment variable holding the operator's key "
           "for admin routes (`/metrics`)", expect="an environment variable name"),
    Option("admin_key_file", str, None, "or the file holding it", expect="a file path"),
    Option("default_limits", dict, None, "limits for every key, under each key's own "
           "`limits` (see docs/accounting.md)", parse=check_limits),
)
KEY_OPTIONS = (
    Option("name", str, None, "shown in logs and metrics, never the key", required=True,
           expect="a string"),
    Option("key_env", str, None, "the environment variable holding the key (16 characters "
           "or more)", expect="an environment variable name"),
    Option("key_file", str, None, "or the file holding it (one of the two, never the key "
           "itself)", expect="a file path"),
    Option("backends", list, None, "the backends it may reach (default: all)", parse=_names),
    Option("models", list, None, "the model name patterns it may ask for (default: all)",
           parse=_names),
    Option("limits", dict, None, "its rate limits, concurrency and budgets, over "
           "`default_limits` (see docs/accounting.md)",
           parse=check_limits),
)


def _keys(raw: dict, path: str, env, require_keys: bool) -> list[InboundKey]:
    """The inbound keys: each from an environment variable or a file, never from relay.yaml."""
    auth = check_section(raw, AUTH_OPTIONS, path, "key")
    # An empty list: only the keys `relay keys create` stores (until one is, none passes).
    entries = _expect(auth["keys"], list, f"{path}.keys", "a list of keys")
    keys: list[InboundKey] = []
    names = set()
    for i, item in enumerate(entries):
        where = f"{path}.keys[{i}]"
        values = check_section(_expect(item, dict, where, "a mapping"), KEY_OPTIONS, where,
                               "key")
        name = values["name"]
        if name in names:
            raise ConfigError(f"{where}.name: {name!r} is used twice")
        names.add(name)
        if ("key_env" in item) == ("key_file" in item):
            raise ConfigError(f"{where}: give exactly one of key_env or key_file "
                              f"(a key is never written in relay.yaml)")
        secret = _secret(item, where, env, require_keys)
        keys.append(InboundKey(name=name, secret=secret, backends=values["backends"],
                               models=values["models"],
                               limits=effective(auth["default_limits"], values["limits"])))
    return keys


def _secret(item: dict, where: str, env, require_keys: bool, prefix: str = "") -> str:
    """A key from ``<prefix>key_env`` or ``<prefix>key_file``, whichever ``item`` names."""
    env_key, file_key = f"{prefix}key_env", f"{prefix}key_file"
    if env_key in item:
        var = _expect(item[env_key], str, f"{where}.{env_key}", "an environment variable name")
        secret = env.get(var, "")
        if not secret and require_keys:
            raise ConfigError(f"{where}.{env_key}: environment variable {var} is not set")
    else:
        file = _expect(item[file_key], str, f"{where}.{file_key}", "a file path")
        try:
            with open(file, encoding="utf-8") as f:
                secret = f.read().strip()
        except (OSError, UnicodeDecodeError) as e:
            if require_keys:
                raise ConfigError(f"{where}.{file_key}: cannot read {file}: "
                                  f"{getattr(e, 'strerror', None) or e}") from None
            secret = ""
        if not secret and require_keys:
            raise ConfigError(f"{where}.{file_key}: {file} is empty")
    if secret and len(secret) < 16:
        raise ConfigError(f"{where}: the key must be at least 16 characters long")
    return secret


ADMIN_KEYS = ("admin_key_env", "admin_key_file")


def _admin_key(raw: dict, path: str, env, require_keys: bool,
               keys: list[InboundKey]) -> str | None:
    """The operator's key for admin routes (``/metrics``): like an inbound key, from an
    environment variable or a file, and never one a client holds."""
    if not any(name in raw for name in ADMIN_KEYS):
        return None
    if all(name in raw for name in ADMIN_KEYS):
        raise ConfigError(f"{path}: give one of admin_key_env or admin_key_file, not both")
    secret = _secret(raw, path, env, require_keys, prefix="admin_")
    if secret and any(key.secret == secret for key in keys):
        raise ConfigError(f"{path}: the admin key must differ from every inbound key")
    return secret or None


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or address to listen on) stays on this machine."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(config: Config, host: str) -> None:
    """Refuse to listen beyond loopback with an operator's key on offer to anyone: a relay
    with a backend key and no inbound auth would be an open proxy for that key."""
    if is_loopback(host) or config.keys is not None or config.allow_unauthenticated:
        return
    keyed = [b.name for b in config.backends if b.keyed]
    if keyed:
        raise ConfigError(
            f"server.host: {host} listens beyond loopback, and backends {', '.join(keyed)} "
            f"put the operator's key on every request, but inbound auth is off: anyone who can "
            f"reach {host} could use that key. Set server.auth.keys, listen on 127.0.0.1, or "
            f"set server.allow_unauthenticated: true if something in front of the relay "
            f"authenticates clients")


# Each backend's keys: their names, what is required, the docs' table. Their values are
# checked in _backend, where several depend on others (auth and holds_threads on the format).
BACKEND_OPTIONS = (
    Option("name", str, None, "what fallbacks, keys and logs call it", required=True),
    Option("url", str, None, "its base URL, `http://` or `https://`; the API's paths go under "
           "its path, and a query it carries (`?api-version=...`) goes ahead of the client's "
           "on every request", required=True),
    Option("models", list, [], "glob patterns of the model names it serves; the first backend "
           "that matches wins"),
    Option("default", bool, False, "takes models no pattern matches, and every other `/v1/` "
           "path (one backend at most)"),
    Option("rename", dict, {}, "the model name sent upstream, by model name pattern"),
    Option("api_key_env", str, None, "the environment variable holding the key that replaces "
           "the client's (never put a key in relay.yaml)"),
    Option("auth", str, None, "how that key goes up: `x-api-key`, or `bearer` "
           "(`Authorization: Bearer`), the default for `format: openai`",
           choices=("x-api-key", "bearer")),
    Option("quirks", dict, {}, "plugin options for requests routed here (the plugins' tables "
           "say which may be set)"),
    Option("timeouts", dict, {}, "`connect`, `read`, `total` (below)"),
    Option("retries", dict, {}, "how failures are retried (below); off by default"),
    Option("fallbacks", list, [], "backends to try, in order, when this one still fails in a "
           "retryable way"),
    Option("format", str, "anthropic", "the wire format it speaks", choices=tuple(FORMATS)),
    Option("holds_threads", bool, None, "whether it keeps conversations sent with `thread`: "
           "by default only `api.anthropic.com`, never `format: openai`"),
    Option("credentials", list, [], "a pool of upstream keys in place of `api_key_env`, each a "
           "mapping of the keys below; a session stays on one while it is healthy (see "
           "pools.md)"),
    Option("pool", dict, {}, "how the pool's credentials cool down and are shared (below)"),
    Option("holds_diagnostics", bool, None, "whether it answers a request's "
           "`diagnostics.previous_message_id` with `diagnostics.cache_miss_reason` itself "
           "(else the relay answers from its own record): by default only `api.anthropic.com`"),
    Option("proxy", str, None, "the HTTP(S) proxy it is reached through, `http://` or "
           "`https://` with an optional `user:password@`, or `none` to go direct; by default "
           "`HTTPS_PROXY` / `HTTP_PROXY` (for its URL's scheme) unless `NO_PROXY` names its host "
           "(see [egress proxies](#egress-proxies))"),
)

CREDENTIAL_OPTIONS = (
    Option("name", str, None, "shown in logs, metrics, dumps and `relay backends`, never the "
           "key", required=True, expect="a string"),
    Option("key_env", str, None, "the environment variable holding the key",
           expect="an environment variable name"),
    Option("key_file", str, None, "or the file holding it (one of the two)",
           expect="a file path"),
    Option("weight", float, 1.0, "its share of new sessions, against the others' weights",
           expect="a positive number", check=_weight),
    Option("limits", dict, None, "this credential's own limits, in the shape of a relay key's: "
           "a request goes with another credential while this one is at them, and is refused "
           "with a 429 when every credential is (see docs/pools.md)", expect="a mapping"),
)


def _backend(item, path: str, env, require_keys: bool) -> Backend:
    _expect(item, dict, path, "a mapping")
    _unknown(item, {option.name for option in BACKEND_OPTIONS}, path)
    for option in BACKEND_OPTIONS:
        if option.required and option.name not in item:
            raise ConfigError(f"{path}.{option.name}: required")
    name = _expect(item["name"], str, f"{path}.name", "a string")
    url = _expect(item["url"], str, f"{path}.url", "a string").rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"{path}.url: must be an http:// or https:// URL, not {url!r}")
    if parts.fragment or url.endswith("#"):
        raise ConfigError(f"{path}.url: a fragment (#...) is never sent; leave it out")
    models = item.get("models", [])
    _expect(models, list, f"{path}.models", "a list of model name patterns")
    for j, pattern in enumerate(models):
        _expect(pattern, str, f"{path}.models[{j}]", "a string")
    rename = _expect(item.get("rename", {}) or {}, dict, f"{path}.rename",
                     "a mapping of model to model")
    for key, value in rename.items():
        _expect(value, str, f"{path}.rename.{key}", "a model name")
    backend = Backend(
        name=name, url=url, models=list(models),
        default=_expect(item.get("default", False), bool, f"{path}.default", "true or false"),
        rename={str(k): v for k, v in rename.items()},
        quirks=dict(_expect(item.get("quirks", {}) or {}, dict, f"{path}.quirks", "a mapping")),
    )
    backend.format = _expect(item.get("format", "anthropic"), str, f"{path}.format", "a string")
    if ADAPTERS.get(backend.format) is None:
        raise ConfigError(f"{path}.format: must be one of {', '.join(FORMATS)}, "
                          f"not {backend.format!r}")
    _format_quirks(backend.adapter, backend.quirks, f"{path}.quirks")
    for key in BETA_QUIRKS:
        if key in backend.quirks:
            patterns = _expect(backend.quirks[key], list, f"{path}.quirks.{key}",
                               "a list of beta name patterns")
            for j, pattern in enumerate(patterns):
                _expect(pattern, str, f"{path}.quirks.{key}[{j}]", "a beta name pattern")
    auth = _expect(item.get("auth", backend.adapter.auth),
                   str, f"{path}.auth", "a string")
    if auth not in ("x-api-key", "bearer"):
        raise ConfigError(f"{path}.auth: must be x-api-key or bearer")
    backend.auth = auth
    if "api_key_env" in item:
        var = _expect(item["api_key_env"], str, f"{path}.api_key_env",
                      "an environment variable name")
        if not env.get(var) and require_keys:
            raise ConfigError(f"{path}.api_key_env: environment variable {var} is not set")
        backend.api_key_env, backend.api_key = var, env.get(var) or None
    if "credentials" in item:
        if "api_key_env" in item:
            raise ConfigError(f"{path}: give api_key_env (one key) or credentials (a pool), "
                              f"not both")
        backend.credentials = _credentials(item["credentials"], f"{path}.credentials", env,
                                           require_keys)
    backend.pool = PoolOptions(**check_section(
        _expect(item.get("pool", {}) or {}, dict, f"{path}.pool", "a mapping"), POOL_OPTIONS,
        f"{path}.pool", "key"))
    backend.holds_threads = _holds_threads(item, backend, path)
    backend.holds_diagnostics = _expect(
        item.get("holds_diagnostics", urlsplit(backend.url).hostname in DIAGNOSTICS_HOSTS),
        bool, f"{path}.holds_diagnostics", "true or false")
    backend.retries = _retries(item.get("retries", {}) or {}, f"{path}.retries")
    fallbacks = _expect(item.get("fallbacks", []) or [], list, f"{path}.fallbacks",
                        "a list of backend names")
    for j, name in enumerate(fallbacks):
        _expect(name, str, f"{path}.fallbacks[{j}]", "a backend name")
    backend.fallbacks = list(fallbacks)
    timeouts = _expect(item.get("timeouts", {}) or {}, dict, f"{path}.timeouts", "a mapping")
    backend.timeouts = Timeouts(**check_section(timeouts, TIMEOUT_OPTIONS, f"{path}.timeouts",
                                                "key"))
    backend.proxy = egress.configured(item["proxy"], f"{path}.proxy") if "proxy" in item \
        else egress.from_environment(url, env, path)
    return backend


def _credentials(raw, path: str, env, require_keys: bool) -> list[Credential]:
    """A backend's pool: each key from an environment variable or a file, as a relay key's."""
    entries = _expect(raw, list, path, "a list of credentials")
    if not entries:
        raise ConfigError(f"{path}: at least one credential (or leave it out)")
    found: list[Credential] = []
    for i, item in enumerate(entries):
        where = f"{path}[{i}]"
        values = check_section(_expect(item, dict, where, "a mapping"), CREDENTIAL_OPTIONS,
                               where, "key")
        name = values["name"]
        if any(credential.name == name for credential in found):
            raise ConfigError(f"{where}.name: {name!r} is used twice")
        if ("key_env" in item) == ("key_file" in item):
            raise ConfigError(f"{where}: give exactly one of key_env or key_file "
                              f"(a key is never written in relay.yaml)")
        secret = _secret(item, where, env, require_keys)
        if secret and any(credential.key == secret for credential in found):
            raise ConfigError(f"{where}: the same key as another credential of this backend")
        found.append(Credential(name=name, key=secret, weight=float(values["weight"]),
                                key_env=values["key_env"], key_file=values["key_file"],
                                limits=check_limits(values["limits"], f"{where}.limits")
                                if values["limits"] is not None else None))
    return found


# Anthropic's own API holds threads (beta message-threads-2026-08-12, SDK 2.14's
# lib/threads); Anthropic-compatible servers elsewhere are not known to.
THREAD_HOSTS = ("api.anthropic.com",)


# Cache diagnostics are "available on the Claude API only" (the cache diagnostics guide; not
# on Bedrock or Vertex AI): docs/evidence/cache.json.
DIAGNOSTICS_HOSTS = ("api.anthropic.com",)


def _holds_threads(item: dict, backend: Backend, path: str) -> bool:
    """``holds_threads``: by default true only for Anthropic's own API host, and never for a
    wire format that has no ``thread`` to carry."""
    carries = backend.adapter.carries_threads
    default = carries and urlsplit(backend.url).hostname in THREAD_HOSTS
    holds = _expect(item.get("holds_threads", default), bool, f"{path}.holds_threads",
                    "true or false")
    if holds and not carries:
        raise ConfigError(f"{path}.holds_threads: the {backend.format} format has no threads "
                          f"to hold")
    return holds


def _format_quirks(adapter: Adapter, quirks: dict, path: str) -> None:
    for key, choices in adapter.quirks.items():
        if key in quirks and (quirks[key] not in choices
                              or type(quirks[key]) is not type(choices[0])):
            names = [str(c).lower() if isinstance(c, bool) else c for c in choices]
            raise ConfigError(f"{path}.{key}: must be one of {', '.join(names)}, "
                              f"not {quirks[key]!r}")


def _retries(raw, path: str) -> Retries:
    return Retries(**check_section(_expect(raw, dict, path, "a mapping"), RETRY_OPTIONS, path,
                                   "key"))
