"""Diagnostic dumps: one write-once JSON file per failed exchange, for grep and `relay replay`.

Options (``plugins.dump``; backend quirks do not change them):

- ``dir`` (required): dumps go to ``<dir>/<YYYY-MM-DD>/<HHMMSS.micro>-<request id>.json``,
  UTC. A relative dir is taken from the working directory at start-up.
- ``statuses``: the upstream answers to dump, as codes and ``"lo-hi"`` ranges
  (default ``400-499``).
- ``include_relay_rejections``: also the relay's own refusals (outcome ``rejected``).
- ``include_stream_errors``: also streams that end in an error, the upstream's
  ``event: error`` or the relay's own when the upstream broke off.
- An answer the relay could not translate because it was malformed (outcome
  ``upstream_malformed``: a chat completion or stream chunk of the wrong shape) is always
  dumped, with the upstream's answer (a stream's first and last bytes).
- ``max_files`` (1000), ``max_bytes`` (1 GiB): retention, always on; the oldest dumps are
  deleted first, and the newest one is always kept.
- ``max_body_bytes`` (8 MiB): each body (client request, upstream request, upstream answer,
  stream error event) keeps at most this many bytes; a longer one keeps its first bytes and
  says so in ``body_truncated`` (kept and total bytes, sha256 of the whole body).
- ``max_pending`` (16), ``max_pending_bytes`` (64 MiB): the write queue. A pending dump holds
  its exchange's bodies in memory, so beyond either limit a dump is dropped and counted
  (logged when the queue drains), never queued; an empty queue always takes one.

A fault is noticed where it happens (``relay_upstream_error``, the ``error`` stream event) but
the file is written at ``relay_exchange_end``, so that its timeline holds what every plugin
did, to the end. Building and writing the document happen in a one-thread executor per relay,
in the background: the client never waits for the disk, and a failed write is logged, never
raised. Files are created exclusively and appear complete or not at all (written under a
temporary name, then hard-linked into place); a name clash gets a ``-1``, ``-2`` suffix. A
write that fails (a full disk) removes its temporary file; at start-up the writer thread scans
``dir`` for retention and deletes temporary files a writer that died left behind.
Below ``dir`` nothing is reached through a symbolic link: day directories and files are
opened relative to their parent's descriptor with ``O_NOFOLLOW``, so a link planted in the
tree makes that write fail (logged) rather than land elsewhere; retention deletes the same way.

A body the upstream was sent unchanged is stored once: the upstream request then says
``"body_same_as": "client_request"``. Bodies are stored as the bytes that crossed the wire
(UTF-8 text, or ``body_base64``), never re-encoded, so any valid JSON the relay passed on
(integers beyond 64 bits, deep nesting) is dumped as sent. The relay's own records (the
translation table, the timeline) are made encodable: integers beyond 64 bits as text, and
anything nested deeper than ``MAX_DEPTH`` cut there.

Secrets never reach the disk. Every header whose name suggests a credential (see
:func:`relay.exchange.is_credential_header`: ``x-api-key``, ``authorization``, ``cookie``,
``anthropic-api-key``, ``x-goog-api-key``, ``x-auth-token``, ...) is redacted wherever headers
are recorded, whatever its value, and so is such a query parameter, and the password of a URL.
Elsewhere in the document (bodies, the translation table, the timeline) every occurrence of
such a value or of a backend's ``api_key`` is replaced by ``[redacted]`` too, but only for
secrets of at least ``MIN_SECRET_LENGTH`` (16) characters, and never inside a JSON key: a short
value cannot be told apart from ordinary text (a client key ``e`` would turn every "e" of the
dump, its keys included, into ``[redacted]`` and leave nothing to read or replay), and a
credential that short protects nothing anyway. Real API keys and tokens are far longer, and a
16-character random string does not turn up by chance.

The plugin is a class: the host makes one instance per plugin manager, that is per running
relay, and :meth:`Dump.relay_startup` keeps that relay's options, configuration, writer
thread and pending writes on the instance. Nothing is shared between relays.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import dataclasses
import datetime as dt
import errno
import functools
import hashlib
import logging
import os
import re
import stat
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit, urlunsplit

import msgspec
import orjson

from relay import __version__
from relay.errors import ConfigError, RelayError
from relay.exchange import is_credential_header
from relay.hookspecs import hookimpl
from relay.options import Option

log = logging.getLogger("relay.plugins.dump")
# A failure that repeats (a full disk) is logged again at most this often.
WARN_EVERY = 60.0

PLUGIN = "dump"
FORMAT = 2
REDACTED = "[redacted]"
LIMITS = ("max_files", "max_bytes", "max_body_bytes", "max_pending", "max_pending_bytes")
DEFAULT_STATUSES = frozenset(range(400, 500))
MiB = 1024 * 1024
ID_FIELDS = ("id", "tool_use_id")
MAX_CLASHES = 1000
SHUTDOWN_TIMEOUT = 30.0
UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
DAY_NAME = re.compile(r"^\d{4}-\d{2}-\d{2}$")
DUMP_NAME = re.compile(r"^\d{6}\.\d{6}-[A-Za-z0-9_-]+\.json$")
TEMPORARY_NAME = re.compile(r"^\.\d{6}\.\d{6}-[A-Za-z0-9_-]+\.[0-9a-f]{12}\.tmp$")
# A write under way takes well under a second (a dump is at most a few bodies of
# max_body_bytes); a temporary file this old was left by a writer that died.
STALE_SECONDS = 300.0
STATUS_RANGE = re.compile(r"^\s*(\d{3})\s*-\s*(\d{3})\s*$")
ERROR_EVENTS = frozenset({"error"})
# Secrets shorter than this are redacted by header name only, never searched for in text:
# see the module docstring.
MIN_SECRET_LENGTH = 16
# The relay's own records are cut this deep: well within what the encoder (255) and a replay's
# decoder (1024) take, and what Python's recursion allows.
MAX_DEPTH = 100
TOO_DEEP = f"[nested deeper than {MAX_DEPTH} levels: not recorded]"
INT64 = (-2 ** 63, 2 ** 64 - 1)  # what JSON encoders take; beyond, an integer is kept as text
DIRECTORY = os.O_RDONLY | os.O_DIRECTORY
NOFOLLOW = os.O_NOFOLLOW


# --- options ------------------------------------------------------------------------------


def _positive(value) -> str | None:
    return None if value >= 1 else "must be a positive integer"


DECLARED = (
    Option("dir", str, None, "where dumps go (relative to the directory the relay runs in)"),
    Option("statuses", (list, int, str), ["400-499"],
           'upstream statuses to dump: codes and `"lo-hi"` ranges; a 2xx here dumps successful '
           "exchanges too (a stream's events are not kept, only its request side and headers)"),
    Option("include_relay_rejections", bool, False,
           "also the relay's own refusals (pairing, ordering, routing)"),
    Option("include_stream_errors", bool, False,
           "also streams that end in `event: error` (the upstream's, or the relay's when the "
           "upstream broke off)"),
    Option("max_files", int, 1000,
           "retention, always on: the oldest dumps are deleted first, the newest is always "
           "kept; dumps already in `dir` count from start-up", check=_positive),
    Option("max_bytes", int, 1024 * MiB, "retention by total size (1 GiB), as `max_files`",
           check=_positive),
    Option("max_body_bytes", int, 8 * MiB,
           "per body (client request, upstream request, upstream answer, stream error event; "
           "8 MiB): a longer one keeps its first bytes, and `body_truncated` gives the kept and "
           "total bytes and the sha256 of the whole; `relay replay` refuses such a dump",
           check=_positive),
    Option("max_pending", int, 16,
           "the write queue (a pending dump holds its exchange's bodies in memory): beyond it, "
           "a dump is dropped and counted, with a warning when drops start and their count "
           "when the queue drains", check=_positive),
    Option("max_pending_bytes", int, 64 * MiB, "the write queue in bytes (64 MiB), as "
           "`max_pending`", check=_positive),
)


@dataclass(frozen=True)
class Settings:
    dir: str
    statuses: frozenset = DEFAULT_STATUSES
    include_relay_rejections: bool = False
    include_stream_errors: bool = False
    max_files: int = 1000
    max_bytes: int = 1024 * MiB
    max_body_bytes: int = 8 * MiB
    max_pending: int = 16
    max_pending_bytes: int = 64 * MiB


def parse_options(options: dict, path: str = f"plugins.{PLUGIN}") -> Settings:
    """Check the plugin's options; raise ConfigError naming the key path of the first fault."""
    if not isinstance(options, dict):
        raise ConfigError(f"{path}: must be a mapping")
    known = [option.name for option in DECLARED]
    for key in options:
        if key not in known:
            raise ConfigError(f"{path}.{key}: unknown key (expected one of: {', '.join(known)})")
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
    for key in LIMITS:
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
        if not 200 <= low <= high <= 599:
            raise ConfigError(f"{where}: must lie within 200-599, low to high, not {item!r}")
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
    return urlunsplit(parts._replace(netloc=netloc, query=redact_query(parts.query)))


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
    fields = ({"body_base64": base64.b64encode(kept).decode("ascii")} if text is None
              else {"body": text})
    fields["body_truncated"] = {
        "kept_bytes": len(kept) if text is None else len(text.encode("utf-8")),
        "total_bytes": len(raw), "sha256": whole, "limit": "plugins.dump.max_body_bytes"}
    return fields


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


def build_document(exchange, *, reason: str, when: dt.datetime, config: dict,
                   secrets=(), stream_error=None, max_body_bytes: int = 8 * MiB) -> dict:
    """The dump of one exchange, secrets redacted. ``config`` is :func:`config_document`'s."""
    secrets = set(secrets) | header_secrets(exchange.client_headers)
    secrets |= query_secrets(exchange.query)
    upstream_request = exchange.upstream_request
    if upstream_request is not None:
        secrets |= header_secrets(upstream_request.get("headers"))
        secrets |= query_secrets(url_query(upstream_request.get("url")))
    secrets = sorted((s for s in secrets if len(s) >= MIN_SECRET_LENGTH and s != REDACTED),
                     key=len, reverse=True)

    def body(raw):
        return body_fields(raw, secrets, max_body_bytes)

    upstream_body = None if upstream_request is None else upstream_request.get("body")
    if upstream_body is not None and (upstream_body is exchange.raw_body
                                      or upstream_body == exchange.raw_body):
        upstream_body_fields = {"body_same_as": "client_request"}
    else:
        upstream_body_fields = body(upstream_body)
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
        "started": _utc(exchange.received),
        "backend": {"name": backend.name, "url": redact_url(backend.url)} if backend else None,
        "client_request": {
            "method": exchange.method, "path": exchange.path,
            "query": redact_query(exchange.query),
            "headers": headers_document(exchange.client_headers),
            **body(exchange.raw_body)},
        "upstream_request": None if upstream_request is None else {
            "url": redact_url(upstream_request.get("url")),
            "headers": headers_document(upstream_request.get("headers")),
            **upstream_body_fields},
        "upstream_response": None if exchange.upstream_response is None else {
            "status": exchange.upstream_response.get("status"),
            "headers": headers_document(exchange.upstream_response.get("headers")),
            **body(exchange.upstream_response.get("body"))},
        "relay_error": None if error is None else {
            "status": getattr(error, "status", None), "type": getattr(error, "type", None),
            "message": getattr(error, "message", str(error))},
        "stream_error": stream_error,
        "attempts": [dataclasses.asdict(attempt) for attempt in exchange.attempts],
        "timings": dataclasses.asdict(exchange.timings),
        "translation": exchange.translation,
        "timeline": {"messages": message_outline(exchange_messages(exchange)),
                     "steps": exchange.timeline},
        "config": {**config, "quirks": backend.quirks if backend else {}},
    }
    return clean(document, secrets)


def encode_document(document: dict) -> bytes:
    """The document (made by :func:`build_document`, so encodable) as indented JSON."""
    return orjson.dumps(document, option=orjson.OPT_INDENT_2) + b"\n"


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


@contextmanager
def opened(path: str, flags: int = DIRECTORY, dir_fd: int | None = None, mode: int = 0o700):
    fd = os.open(path, flags, mode, dir_fd=dir_fd)
    try:
        yield fd
    finally:
        os.close(fd)


def open_day(base: int, day: str, directory: str, create: bool = False) -> int:
    """A descriptor for the day directory ``day`` in ``base`` (a descriptor of ``directory``),
    made 0700 if ``create`` makes it; never through a symbolic link."""
    created = False
    if create:
        try:
            os.mkdir(day, 0o700, dir_fd=base)
            created = True
        except FileExistsError:
            pass
    try:
        fd = os.open(day, DIRECTORY | NOFOLLOW, dir_fd=base)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR) and stat.S_ISLNK(
                os.stat(day, dir_fd=base, follow_symlinks=False).st_mode):
            raise OSError(e.errno, f"{os.path.join(directory, day)} is a symbolic link; "
                                   f"dumps never follow one") from None
        raise
    if created:
        os.fchmod(fd, 0o700)  # whatever the umask
    return fd


def write_dump(directory: str, data: bytes, request_id: str, when: dt.datetime) -> str:
    """Write ``data`` once, as a new file named after ``when`` (UTC) and the request id.

    The bytes go to a temporary file first, then are hard-linked under the final name, which
    fails rather than replace an existing file: a reader sees the whole dump or none, and a
    clash gets the next free ``-N`` suffix. Returns the path written.
    """
    when = when.astimezone(dt.timezone.utc)
    day = when.strftime("%Y-%m-%d")
    make_private_dirs(directory)
    stem = f"{when:%H%M%S.%f}-{safe_name(request_id)}"
    temporary = f".{stem}.{os.urandom(6).hex()}.tmp"
    with opened(directory) as base:
        day_fd = open_day(base, day, directory, create=True)
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW
            fd = os.open(temporary, flags, 0o600, dir_fd=day_fd)
            try:
                # Removed whatever happens from here on (a full disk, say): a failed write
                # leaves nothing behind.
                try:
                    with memoryview(data) as view:
                        written = 0
                        while written < len(view):
                            written += os.write(fd, view[written:])
                    os.fsync(fd)
                finally:
                    os.close(fd)
                for n in range(MAX_CLASHES):
                    name = f"{stem}.json" if n == 0 else f"{stem}-{n}.json"
                    try:
                        os.link(temporary, name, src_dir_fd=day_fd, dst_dir_fd=day_fd,
                                follow_symlinks=False)
                    except FileExistsError:
                        continue
                    return os.path.join(directory, day, name)
                raise FileExistsError(f"{MAX_CLASHES} dumps named {stem} already exist in "
                                      f"{os.path.join(directory, day)}")
            finally:
                os.unlink(temporary, dir_fd=day_fd)
        finally:
            os.close(day_fd)


class Retention:
    """Deletes the oldest dumps beyond ``max_files`` / ``max_bytes``.

    The directory is scanned once, at start-up (:meth:`prepare`, in the writer thread) or
    else on the first write; after that the index follows the relay's own writes, so each
    check is cheap. Dumps written by another process into the same directory are counted
    from the next start-up. Temporary files count too: one older than ``STALE_SECONDS`` is
    what a writer left when it died mid-write, and is deleted by the scan; a younger one may
    be another process's write under way, and counts against the limits like a dump. Like
    the writer, it never goes through a symbolic link below ``directory``.
    """

    def __init__(self, directory: str, max_files: int, max_bytes: int):
        self.directory = directory
        self.max_files = max_files
        self.max_bytes = max_bytes
        self.entries: deque | None = None  # (day, name, size), oldest first
        self.total = 0
        self.stale = 0  # temporary files the scan deleted

    def prepare(self) -> None:
        """The start-up scan; a directory not made yet holds nothing."""
        try:
            self.entries = self.scan()
        except (FileNotFoundError, NotADirectoryError):
            self.entries = deque()
            return
        except OSError as e:
            log.warning("retention under %s could not scan it at start-up: %s", self.directory,
                        e.strerror or e)
            return
        self.total = sum(size for _, _, size in self.entries)
        if self.stale:
            log.warning("retention: deleted %d temporary file(s) under %s left by writes that "
                        "never finished", self.stale, self.directory)
        self.trim()

    def scan(self) -> deque:
        found = []
        stale_before = time.time() - STALE_SECONDS
        with opened(self.directory) as base:
            for day in os.scandir(base):
                if not (DAY_NAME.match(day.name) and day.is_dir(follow_symlinks=False)):
                    continue
                with opened(day.name, DIRECTORY | NOFOLLOW, dir_fd=base) as day_fd:
                    for entry in os.scandir(day_fd):
                        temporary = TEMPORARY_NAME.match(entry.name)
                        if not ((temporary or DUMP_NAME.match(entry.name))
                                and entry.is_file(follow_symlinks=False)):
                            continue
                        try:
                            info = entry.stat(follow_symlinks=False)
                        except FileNotFoundError:  # deleted by another worker's scan
                            continue
                        if temporary and info.st_mtime < stale_before:
                            with suppress(FileNotFoundError):
                                os.unlink(entry.name, dir_fd=day_fd)
                            self.stale += 1
                            continue
                        found.append((day.name, entry.name, info.st_size))
        found.sort()
        return deque(found)

    def add(self, path: str, size: int) -> list[str]:
        """Count a new dump (``path`` as :func:`write_dump` returned it); delete and return
        the oldest ones beyond the limits."""
        if self.entries is None:
            self.entries = self.scan()  # already holds the new dump
            self.total = sum(size for _, _, size in self.entries)
        else:
            self.entries.append((os.path.basename(os.path.dirname(path)),
                                 os.path.basename(path), size))
            self.total += size
        return self.trim()

    def trim(self) -> list[str]:
        deleted = []
        while len(self.entries) > 1 and (len(self.entries) > self.max_files
                                         or self.total > self.max_bytes):
            day, name, size = self.entries.popleft()
            self.total -= size
            self.delete(day, name)
            deleted.append(os.path.join(self.directory, day, name))
        return deleted

    def delete(self, day: str, name: str) -> None:
        with opened(self.directory) as base:
            try:
                with opened(day, DIRECTORY | NOFOLLOW, dir_fd=base) as day_fd:
                    os.unlink(name, dir_fd=day_fd)
            except FileNotFoundError:
                pass
            try:
                os.rmdir(day, dir_fd=base)  # only once the day is empty
            except OSError:
                pass


class Dump:
    """The dump plugin: one instance per relay (the host instantiates the class)."""

    OPTIONS = DECLARED

    def __init__(self):
        self.settings: Settings | None = None
        self.config_doc: dict = {}
        self.secrets: set[str] = set()
        self.retention: Retention | None = None
        self.executor: ThreadPoolExecutor | None = None
        self.pending: set[asyncio.Future] = set()
        self.pending_bytes = 0
        self.dropped = 0  # since start-up
        self.unreported = 0  # dropped since the queue last drained
        # Per kind of write failure: when it was last logged, and how often since.
        self.failures: dict = {}

    # --- hooks ----------------------------------------------------------------------------

    @hookimpl
    def relay_startup(self, config, options):
        self.settings = settings = parse_options(options)
        self.config_doc = config_document(config)
        self.secrets = {backend.api_key for backend in config.backends if backend.api_key}
        self.retention = Retention(settings.dir, settings.max_files, settings.max_bytes)
        if self.executor is None:
            self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relay-dump")
        # In the writer thread, ahead of any write: the loop never waits on the scan.
        self.executor.submit(self.retention.prepare)

    @hookimpl
    async def relay_shutdown(self, config):
        if self.pending:
            _, left = await asyncio.wait(set(self.pending), timeout=SHUTDOWN_TIMEOUT)
            if left:
                log.error("%d dump(s) still being written after %.0f s; giving up on them",
                          len(left), SHUTDOWN_TIMEOUT)
        self.report_drops()
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
        if len(event.raw) > self.settings.max_body_bytes:
            fields = body_fields(event.raw, (), self.settings.max_body_bytes)
            data = {"event": fields.get("body"), "event_truncated": fields["body_truncated"]}
        else:
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
        answer = exchange.answer
        if (exchange.outcome == "ok" and answer is not None and 200 <= answer.status < 300
                and answer.status in self.settings.statuses
                and exchange.endpoint in ("messages", "count_tokens")):
            return "ok"  # asked for: successful exchanges too
        if exchange.outcome == "upstream_malformed":
            return "upstream_malformed"  # a fault of the upstream's, like its 4xx
        if exchange.outcome == "rejected" and self.settings.include_relay_rejections:
            return "rejected"
        if exchange.outcome == "stream_error" and self.settings.include_stream_errors:
            return "stream_error"
        return None

    def submit(self, exchange, reason: str) -> asyncio.Future | None:
        """Write the exchange's dump in the background (the exchange must be over), or drop
        it when the write queue is full: None then."""
        settings = self.settings
        size = held_bytes(exchange)
        if self.pending and (len(self.pending) >= settings.max_pending
                             or self.pending_bytes + size > settings.max_pending_bytes):
            self.dropped += 1
            self.unreported += 1
            if self.unreported == 1:
                log.warning("%s: %s dump dropped: the write queue is full (%d dumps, %d bytes "
                            "pending; plugins.dump.max_pending, max_pending_bytes); further "
                            "drops are counted until it drains", exchange.id, reason,
                            len(self.pending), self.pending_bytes)
            exchange.note(PLUGIN, "dropped", reason=reason)
            return None
        exchange.note(PLUGIN, "queued", reason=reason)
        when = dt.datetime.now(dt.timezone.utc)
        noticed = exchange.state.get(PLUGIN)
        stream_error = noticed.get("stream_error") if noticed else None
        if stream_error is None and reason == "stream_error":
            stream_error = relay_stream_error(exchange)
        future = asyncio.get_running_loop().run_in_executor(
            self.executor, self.write, exchange, reason, when, stream_error)
        self.pending.add(future)
        self.pending_bytes += size
        future.add_done_callback(functools.partial(self.written, size))
        return future

    def written(self, size: int, future: asyncio.Future) -> None:
        self.pending.discard(future)
        self.pending_bytes -= size
        if not self.pending:
            self.report_drops()

    def report_drops(self) -> None:
        if self.unreported:
            log.warning("%d dump(s) dropped while the write queue was full (%d since start-up)",
                        self.unreported, self.dropped)
            self.unreported = 0

    def write_failed(self, exchange_id: str, reason: str, directory: str, e: OSError) -> None:
        """A full or read-only disk fails every dump alike: said once per kind of failure,
        then at most every ``WARN_EVERY`` seconds with the count in between (the writer is one
        thread, so no lock)."""
        kind = e.errno or type(e).__name__
        now = time.monotonic()
        last, quiet = self.failures.get(kind, (None, 0))
        if last is not None and now - last < WARN_EVERY:
            self.failures[kind] = (last, quiet + 1)
            return
        self.failures[kind] = (now, 0)
        log.error("%s: could not write the %s dump under %s: %s%s", exchange_id, reason,
                  directory, e.strerror or e,
                  f" ({quiet} more dumps failed alike since the last such message)" if quiet
                  else "")

    def write(self, exchange, reason: str, when: dt.datetime, stream_error=None) -> str | None:
        """Build, write and account for one dump (in the writer thread). Never raises."""
        settings = self.settings
        directory = settings.dir
        try:
            document = build_document(exchange, reason=reason, when=when, config=self.config_doc,
                                      secrets=self.secrets, stream_error=stream_error,
                                      max_body_bytes=settings.max_body_bytes)
            data = encode_document(document)
            path = write_dump(directory, data, exchange.id, when)
        except OSError as e:
            self.write_failed(exchange.id, reason, directory, e)
            return None
        except Exception:
            log.exception("%s: could not build the %s dump", exchange.id, reason)
            return None
        log.info("%s: %s dump written to %s", exchange.id, reason, path)
        try:
            for deleted in self.retention.add(path, len(data)):
                log.info("retention: deleted %s", deleted)
        except OSError as e:
            log.warning("retention under %s failed: %s", directory, e)
        return path


def held_bytes(exchange) -> int:
    """About what a pending dump keeps alive: the exchange's bodies."""
    size = len(exchange.raw_body or b"")
    sent = (exchange.upstream_request or {}).get("body")
    if sent is not None and sent is not exchange.raw_body:
        size += len(sent)
    answer = (exchange.upstream_response or {}).get("body")
    return size + len(answer or b"")


def relay_stream_error(exchange) -> dict | None:
    """The error event the relay itself sent when the upstream's stream broke off, rebuilt
    from the relay's ``stream error`` timeline note (the event the server writes has this
    shape)."""
    for step in reversed(exchange.timeline):
        if step.get("step") == "relay" and step.get("action") == "stream error":
            return {"type": "error", "error": {"type": "api_error", "message": step.get("message")}}
    return None
