"""Diagnostic dumps: one write-once JSON file per failed exchange, for grep and `relay replay`.

Options (``plugins.dump``; backend quirks do not change them):

- ``dir`` (required): dumps go to ``<dir>/<YYYY-MM-DD>/<HHMMSS.micro>-<request id>.json``,
  UTC. A relative dir is taken from the working directory at start-up.
- ``statuses``: the upstream answers to dump, as codes and ``"lo-hi"`` ranges
  (default ``400-499``).
- ``include_relay_rejections``: also the relay's own refusals (outcome ``rejected``).
- ``include_stream_errors``: also streams that end in an error, the upstream's
  ``event: error`` or the relay's own when the upstream broke off.
- ``max_files``, ``max_bytes``: retention; the oldest dumps are deleted first, and the
  newest one is always kept.

A fault is noticed where it happens (``relay_upstream_error``, the ``error`` stream event) but
the file is written at ``relay_exchange_end``, so that its timeline holds what every plugin
did, to the end. Building and writing the document happen in a one-thread executor per relay,
in the background: the client never waits for the disk, and a failed write is logged, never
raised. Files are created exclusively and appear complete or not at all (written under a
temporary name, then hard-linked into place); a name clash gets a ``-1``, ``-2`` suffix.

Secrets never reach the disk. The credential headers (``x-api-key``, ``authorization``,
``proxy-authorization``, ``cookie``, ``set-cookie``) are redacted by name wherever headers are
recorded, whatever their value. Elsewhere in the document (bodies, the translation table, the
timeline) every occurrence of a credential value or a backend's ``api_key`` is replaced by
``[redacted]`` too, but only for secrets of at least ``MIN_SECRET_LENGTH`` (16) characters,
and never inside a JSON key: a short value cannot be told apart from ordinary text (a client
key ``e`` would turn every "e" of the dump, its keys included, into ``[redacted]`` and leave
nothing to read or replay), and a credential that short protects nothing anyway. Real API
keys and tokens are far longer, and a 16-character random string does not turn up by chance.

The plugin is a class: the host makes one instance per plugin manager, that is per running
relay, and :meth:`Dump.relay_startup` keeps that relay's options, configuration, writer
thread and pending writes on the instance. Nothing is shared between relays.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import datetime as dt
import logging
import os
import re
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import orjson

from relay import __version__
from relay.errors import ConfigError
from relay.exchange import CREDENTIAL_HEADERS
from relay.hookspecs import hookimpl

log = logging.getLogger("relay.plugins.dump")

PLUGIN = "dump"
FORMAT = 1
REDACTED = "[redacted]"
OPTIONS = ("dir", "statuses", "include_relay_rejections", "include_stream_errors",
           "max_files", "max_bytes")
DEFAULT_STATUSES = frozenset(range(400, 500))
ID_FIELDS = ("id", "tool_use_id")
MAX_CLASHES = 1000
SHUTDOWN_TIMEOUT = 30.0
UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
DAY_NAME = re.compile(r"^\d{4}-\d{2}-\d{2}$")
DUMP_NAME = re.compile(r"^\d{6}\.\d{6}-[A-Za-z0-9_-]+\.json$")
STATUS_RANGE = re.compile(r"^\s*(\d{3})\s*-\s*(\d{3})\s*$")
ERROR_EVENTS = frozenset({"error"})
# Secrets shorter than this are redacted by header name only, never searched for in text:
# see the module docstring.
MIN_SECRET_LENGTH = 16


# --- options ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    dir: str
    statuses: frozenset = DEFAULT_STATUSES
    include_relay_rejections: bool = False
    include_stream_errors: bool = False
    max_files: int | None = None
    max_bytes: int | None = None


def parse_options(options: dict, path: str = f"plugins.{PLUGIN}") -> Settings:
    """Check the plugin's options; raise ConfigError naming the key path of the first fault."""
    if not isinstance(options, dict):
        raise ConfigError(f"{path}: must be a mapping")
    for key in options:
        if key not in OPTIONS:
            raise ConfigError(f"{path}.{key}: unknown key (expected one of: {', '.join(OPTIONS)})")
    directory = options.get("dir")
    if directory is None:
        raise ConfigError(f"{path}.dir: required (the directory dumps are written to)")
    if not isinstance(directory, str) or not directory.strip():
        raise ConfigError(f"{path}.dir: must be a directory path")
    if "\0" in directory:
        raise ConfigError(f"{path}.dir: must not contain a NUL character")
    settings = {"dir": os.path.abspath(os.path.expanduser(directory))}
    if options.get("statuses") is not None:
        settings["statuses"] = parse_statuses(options["statuses"], f"{path}.statuses")
    for key in ("include_relay_rejections", "include_stream_errors"):
        if key in options:
            if not isinstance(options[key], bool):
                raise ConfigError(f"{path}.{key}: must be true or false")
            settings[key] = options[key]
    for key in ("max_files", "max_bytes"):
        value = options.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{path}.{key}: must be a positive integer")
            settings[key] = value
    return Settings(**settings)


def parse_statuses(value, path: str) -> frozenset:
    """``[400, 404, "500-599"]`` (or one such item) as a set of HTTP status codes."""
    items = value if isinstance(value, list) else [value]
    if not items:
        raise ConfigError(f"{path}: must name at least one status")
    statuses = set()
    for i, item in enumerate(items):
        where = f"{path}[{i}]" if isinstance(value, list) else path
        if isinstance(item, int) and not isinstance(item, bool):
            low = high = item
        elif isinstance(item, str) and STATUS_RANGE.match(item):
            low, high = (int(n) for n in STATUS_RANGE.match(item).groups())
        elif isinstance(item, str) and item.strip().isdigit():
            low = high = int(item)
        else:
            raise ConfigError(f"{where}: must be a status code or a range like \"400-499\", "
                              f"not {item!r}")
        if not 300 <= low <= high <= 599:
            raise ConfigError(f"{where}: must lie within 300-599 (non-2xx answers), low to high, "
                              f"not {item!r}")
        statuses.update(range(low, high + 1))
    return frozenset(statuses)


# --- the document -------------------------------------------------------------------------


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
    return {"name": backend.name, "url": backend.url, "models": list(backend.models),
            "default": backend.default, "rename": dict(backend.rename), "auth": backend.auth,
            "api_key_env": backend.api_key_env, "quirks": copy.deepcopy(backend.quirks),
            "timeouts": timeouts}


def headers_document(headers) -> dict | None:
    """Headers as ``{name: value}`` (a list of values for a repeated name), credentials
    redacted."""
    if headers is None:
        return None
    doc: dict = {}
    names: dict[str, str] = {}
    for name, value in headers.items():
        lower = name.lower()
        if lower in CREDENTIAL_HEADERS:
            value = REDACTED
        key = names.setdefault(lower, name)
        if key in doc:
            previous = doc[key]
            doc[key] = (previous if isinstance(previous, list) else [previous]) + [value]
        else:
            doc[key] = value
    return doc


def header_secrets(headers) -> set[str]:
    """Credential header values, and the token alone of ``Bearer TOKEN`` (searched for in the
    rest of the document when long enough)."""
    found = set()
    for name, value in (headers or {}).items():
        if name.lower() in CREDENTIAL_HEADERS and value:
            found.add(value)
            _, _, token = value.partition(" ")
            if token.strip():
                found.add(token.strip())
    return found


def body_fields(raw, secrets: list[str]) -> dict:
    """``{"body": text}`` for UTF-8 bytes (redacted later with the rest), else
    ``{"body_base64": ...}`` of the bytes with every secret replaced first."""
    if raw is None:
        return {"body": None}
    raw = bytes(raw)
    try:
        return {"body": raw.decode("utf-8")}
    except UnicodeDecodeError:
        for secret in secrets:
            raw = raw.replace(secret.encode("utf-8"), REDACTED.encode())
        return {"body_base64": base64.b64encode(raw).decode("ascii")}


def message_outline(messages) -> list[dict]:
    """Per message: its index, role, and block types with their tool ids."""
    if not isinstance(messages, list):
        return []
    outline = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            outline.append({"index": index, "role": None, "blocks": []})
            continue
        content = message.get("content")
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


def redact(value, secrets: list[str]):
    """A copy of ``value`` with every occurrence of a secret in its strings replaced; keys are
    left as they are (see the module docstring)."""
    if isinstance(value, str):
        for secret in secrets:
            if secret in value:
                value = value.replace(secret, REDACTED)
        return value
    if isinstance(value, dict):
        return {k: redact(v, secrets) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(item, secrets) for item in value]
    return value


def _utc(timestamp: float | None) -> str | None:
    if timestamp is None:
        return None
    return dt.datetime.fromtimestamp(timestamp, dt.timezone.utc).isoformat()


def build_document(exchange, *, reason: str, when: dt.datetime, config: dict,
                   secrets=(), stream_error=None) -> dict:
    """The dump of one exchange, secrets redacted. ``config`` is :func:`config_document`'s."""
    secrets = set(secrets) | header_secrets(exchange.client_headers)
    upstream_request = exchange.upstream_request
    if upstream_request is not None:
        secrets |= header_secrets(upstream_request.get("headers"))
    secrets = sorted((s for s in secrets if len(s) >= MIN_SECRET_LENGTH and s != REDACTED),
                     key=len, reverse=True)

    backend = exchange.backend
    error = exchange.error
    document = {
        "dump_format": FORMAT,
        "relay_version": __version__,
        "time": when.isoformat(),
        "request_id": exchange.id,
        "reason": reason,
        "outcome": exchange.outcome,
        "endpoint": exchange.endpoint,
        "started": _utc(exchange.started),
        "backend": {"name": backend.name, "url": backend.url} if backend else None,
        "client_request": {
            "method": exchange.method, "path": exchange.path, "query": exchange.query,
            "headers": headers_document(exchange.client_headers),
            **body_fields(exchange.raw_body, secrets)},
        "upstream_request": None if upstream_request is None else {
            "url": upstream_request.get("url"),
            "headers": headers_document(upstream_request.get("headers")),
            **body_fields(upstream_request.get("body"), secrets)},
        "upstream_response": None if exchange.upstream_response is None else {
            "status": exchange.upstream_response.get("status"),
            "headers": headers_document(exchange.upstream_response.get("headers")),
            **body_fields(exchange.upstream_response.get("body"), secrets)},
        "relay_error": None if error is None else {
            "status": getattr(error, "status", None), "type": getattr(error, "type", None),
            "message": getattr(error, "message", str(error))},
        "stream_error": stream_error,
        "translation": exchange.translation,
        "timeline": {"messages": message_outline(exchange.messages), "steps": exchange.timeline},
        "config": {**config, "quirks": backend.quirks if backend else {}},
    }
    return redact(document, secrets)


def encode_document(document: dict) -> bytes:
    return orjson.dumps(document, default=str,
                        option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS) + b"\n"


# --- the files ----------------------------------------------------------------------------


def safe_name(text: str, limit: int = 96) -> str:
    """``text`` reduced to characters that are safe in a file name (never a path)."""
    return UNSAFE.sub("_", str(text))[:limit] or "unknown"


def make_private_dirs(path: str) -> None:
    """Create ``path`` and any missing parents with mode 0700."""
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            if not os.path.isdir(directory):
                raise NotADirectoryError(f"{directory} exists and is not a directory") from None
        else:
            os.chmod(directory, 0o700)  # whatever the umask


def write_dump(directory: str, data: bytes, request_id: str, when: dt.datetime) -> str:
    """Write ``data`` once, as a new file named after ``when`` (UTC) and the request id.

    The bytes go to a temporary file first, then are hard-linked under the final name, which
    fails rather than replace an existing file: a reader sees the whole dump or none, and a
    clash gets the next free ``-N`` suffix. Returns the path written.
    """
    when = when.astimezone(dt.timezone.utc)
    day = os.path.join(directory, when.strftime("%Y-%m-%d"))
    make_private_dirs(day)
    stem = f"{when:%H%M%S.%f}-{safe_name(request_id)}"
    temporary = os.path.join(day, f".{stem}.{os.urandom(6).hex()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0),
                 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        for n in range(MAX_CLASHES):
            path = os.path.join(day, f"{stem}.json" if n == 0 else f"{stem}-{n}.json")
            try:
                os.link(temporary, path)
            except FileExistsError:
                continue
            return path
        raise FileExistsError(f"{MAX_CLASHES} dumps named {stem} already exist in {day}")
    finally:
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass


class Retention:
    """Deletes the oldest dumps beyond ``max_files`` / ``max_bytes``.

    The directory is scanned once, on the first write; after that the index follows the
    relay's own writes, so each check is cheap. Dumps written by another process into the
    same directory are counted from the next start-up.
    """

    def __init__(self, directory: str, max_files: int | None, max_bytes: int | None):
        self.directory = directory
        self.max_files = max_files
        self.max_bytes = max_bytes
        self.entries: deque | None = None  # (path, size), oldest first
        self.total = 0

    def scan(self) -> deque:
        found = []
        with os.scandir(self.directory) as days:
            for day in days:
                if not (DAY_NAME.match(day.name) and day.is_dir(follow_symlinks=False)):
                    continue
                with os.scandir(day.path) as files:
                    for entry in files:
                        if DUMP_NAME.match(entry.name) and entry.is_file(follow_symlinks=False):
                            found.append((f"{day.name}/{entry.name}", entry.path,
                                          entry.stat(follow_symlinks=False).st_size))
        found.sort()
        return deque((path, size) for _, path, size in found)

    def add(self, path: str, size: int) -> list[str]:
        """Count a new dump; delete and return the oldest ones beyond the limits."""
        if self.entries is None:
            self.entries = self.scan()  # already holds the new dump
            self.total = sum(size for _, size in self.entries)
        else:
            self.entries.append((path, size))
            self.total += size
        deleted = []
        while len(self.entries) > 1 and (
                (self.max_files and len(self.entries) > self.max_files)
                or (self.max_bytes and self.total > self.max_bytes)):
            oldest, size = self.entries.popleft()
            self.total -= size
            try:
                os.unlink(oldest)
            except FileNotFoundError:
                pass
            deleted.append(oldest)
            try:
                os.rmdir(os.path.dirname(oldest))  # only once the day is empty
            except OSError:
                pass
        return deleted


class Dump:
    """The dump plugin: one instance per relay (the host instantiates the class)."""

    def __init__(self):
        self.settings: Settings | None = None
        self.config_doc: dict = {}
        self.secrets: set[str] = set()
        self.retention: Retention | None = None
        self.executor: ThreadPoolExecutor | None = None
        self.pending: set[asyncio.Future] = set()

    # --- hooks ----------------------------------------------------------------------------

    @hookimpl
    def relay_startup(self, config, options):
        self.settings = settings = parse_options(options)
        self.config_doc = config_document(config)
        self.secrets = {backend.api_key for backend in config.backends if backend.api_key}
        self.retention = (Retention(settings.dir, settings.max_files, settings.max_bytes)
                          if settings.max_files or settings.max_bytes else None)
        if self.executor is None:
            self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relay-dump")

    @hookimpl
    async def relay_shutdown(self, config):
        if self.pending:
            _, left = await asyncio.wait(set(self.pending), timeout=SHUTDOWN_TIMEOUT)
            if left:
                log.error("%d dump(s) still being written after %.0f s; giving up on them",
                          len(left), SHUTDOWN_TIMEOUT)
        if self.executor is not None:
            self.executor.shutdown(wait=False)
            self.executor = None

    @hookimpl
    def relay_upstream_error(self, exchange, response):
        settings = self.settings
        if settings is not None and response.status in settings.statuses:
            exchange.state[PLUGIN] = {"reason": "upstream_error"}

    @hookimpl
    def relay_stream_events(self, exchange):
        settings = self.settings
        return ERROR_EVENTS if settings is not None and settings.include_stream_errors else None

    @hookimpl
    def relay_stream_event(self, exchange, event):
        data = event.data
        if data is None:
            data = event.raw.decode("utf-8", "replace")
        exchange.state[PLUGIN] = {"reason": "stream_error", "stream_error": data}

    @hookimpl
    def relay_exchange_end(self, exchange):
        if self.settings is None or self.executor is None:
            return
        reason = self.reason_for(exchange)
        if reason is not None:
            self.submit(exchange, reason)

    # --- the work -------------------------------------------------------------------------

    def reason_for(self, exchange) -> str | None:
        noticed = exchange.state.get(PLUGIN)
        if noticed:
            return noticed["reason"]
        if exchange.outcome == "rejected" and self.settings.include_relay_rejections:
            return "rejected"
        if exchange.outcome == "stream_error" and self.settings.include_stream_errors:
            return "stream_error"
        return None

    def submit(self, exchange, reason: str) -> asyncio.Future:
        """Write the exchange's dump in the background; the exchange must be over."""
        when = dt.datetime.now(dt.timezone.utc)
        noticed = exchange.state.get(PLUGIN)
        stream_error = noticed.get("stream_error") if noticed else None
        if stream_error is None and reason == "stream_error":
            stream_error = relay_stream_error(exchange)
        future = asyncio.get_running_loop().run_in_executor(
            self.executor, self.write, exchange, reason, when, stream_error)
        self.pending.add(future)
        future.add_done_callback(self.pending.discard)
        return future

    def write(self, exchange, reason: str, when: dt.datetime, stream_error=None) -> str | None:
        """Build, write and account for one dump (in the writer thread). Never raises."""
        directory = self.settings.dir
        try:
            document = build_document(exchange, reason=reason, when=when, config=self.config_doc,
                                      secrets=self.secrets, stream_error=stream_error)
            data = encode_document(document)
            path = write_dump(directory, data, exchange.id, when)
        except OSError as e:
            log.error("%s: could not write the %s dump under %s: %s",
                      exchange.id, reason, directory, e)
            return None
        except Exception:
            log.exception("%s: could not build the %s dump", exchange.id, reason)
            return None
        log.info("%s: %s dump written to %s", exchange.id, reason, path)
        if self.retention is not None:
            try:
                for deleted in self.retention.add(path, len(data)):
                    log.info("retention: deleted %s", deleted)
            except OSError as e:
                log.warning("retention under %s failed: %s", directory, e)
        return path


def relay_stream_error(exchange) -> dict | None:
    """The error event the relay itself sent when the upstream's stream broke off, rebuilt
    from the relay's ``stream error`` timeline note (the event the server writes has this
    shape)."""
    for step in reversed(exchange.timeline):
        if step.get("step") == "relay" and step.get("action") == "stream error":
            return {"type": "error", "error": {"type": "api_error", "message": step.get("message")}}
    return None
