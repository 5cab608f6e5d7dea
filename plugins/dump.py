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
  (logged when the queue drains), never queued; an empty queue always takes one. Each dump
  is noted on the exchange's timeline, ``queued`` or ``dropped`` with its reason (what the
  metrics plugin counts).

``exchange.dump_path`` is the path of the dump being written for the exchange (None when
there is none), set in this plugin's ``relay_exchange_end``, which runs before the other
plugins' (dump is last in the pipeline): the ledger row names the file, and the console
links an exchange to its dump by it. The file may still be on its way to the disk.

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

The document is the exchange record's one document form, the host's
(:mod:`relay.document`, which ``relay replay`` reads too). A body the upstream was sent
unchanged is stored once: the upstream request then says
``"body_same_as": "client_request"``. Bodies are stored as the bytes that crossed the wire
(UTF-8 text, or ``body_base64``), never re-encoded, so any valid JSON the relay passed on
(integers beyond 64 bits, deep nesting) is dumped as sent. The relay's own records (the
translation table, the timeline) are made encodable: integers beyond 64 bits as text, and
anything nested deeper than ``relay.document.MAX_DEPTH`` cut there.

Secrets never reach the disk. Every header whose name suggests a credential (see
:func:`relay.exchange.is_credential_header`: ``x-api-key``, ``authorization``, ``cookie``,
``anthropic-api-key``, ``x-goog-api-key``, ``x-auth-token``, ...) is redacted wherever headers
are recorded, whatever its value, and so is such a query parameter, and the password of a URL.
Elsewhere in the document (bodies, the translation table, the timeline) every occurrence of
such a value or of a backend's key (its ``api_key_env``, each of its ``credentials``) is
replaced by ``[redacted]`` too, but only for secrets of at least ``MIN_SECRET_LENGTH`` (16)
characters, and never inside a JSON key: a short value cannot be told apart from ordinary
text (a client key ``e`` would turn every "e" of the dump, its keys included, into
``[redacted]`` and leave nothing to read or replay), and a credential that short protects
nothing anyway. Real API keys and tokens are far longer, and a
16-character random string does not turn up by chance.

The plugin is a class: the host makes one instance per plugin manager, that is per running
relay, and :meth:`Dump.relay_startup` keeps that relay's options, configuration, writer
thread and pending writes on the instance. Nothing is shared between relays.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import errno
import functools
import logging
import os
import re
import stat
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass

from relay import document as record
from relay.errors import ConfigError
from relay.exchange import Exchange, Outcome
from relay.hookspecs import hookimpl
from relay.options import Option

log = logging.getLogger("relay.plugins.dump")
# A failure that repeats (a full disk) is logged again at most this often.
WARN_EVERY = 60.0

PLUGIN = "dump"
DEFAULT_STATUSES = frozenset(range(400, 500))
MiB = 1024 * 1024
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
DIRECTORY = os.O_RDONLY | os.O_DIRECTORY
NOFOLLOW = os.O_NOFOLLOW


# --- options ------------------------------------------------------------------------------


def _positive(value) -> str | None:
    return None if value >= 1 else "must be a positive integer"


def _directory(value: str) -> str | None:
    if not value.strip():
        return "must be a directory path"
    if "\0" in value:
        return "must not contain a NUL character"
    return None


DECLARED = (
    Option("dir", str, None, "where dumps go (relative to the directory the relay runs in)",
           check=_directory, required=True),
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
    """The settings ``options`` make, once the host has checked them against
    :data:`DECLARED` (at start-up, by :mod:`relay.options`): ``dir`` (which has no default)
    made absolute, ``statuses`` read as a set; an option left out takes its default. Raises
    ConfigError naming the key path of what the declarations cannot say."""
    directory = options.get("dir")
    if directory is None:
        raise ConfigError(f"{path}.dir: required (the directory dumps are written to)")
    statuses = options.get("statuses")
    return Settings(
        dir=os.path.abspath(os.path.expanduser(directory)),
        statuses=(DEFAULT_STATUSES if statuses is None
                  else parse_statuses(statuses, f"{path}.statuses")),
        **{option.name: options[option.name] for option in DECLARED
           if option.name not in ("dir", "statuses") and options.get(option.name) is not None})


def parse_statuses(value, path: str) -> frozenset:
    """``[400, 404, "500-599"]`` (or one such item) as a set of HTTP status codes."""
    items = value if isinstance(value, list) else [value]
    if not items:
        raise ConfigError(f"{path}: must name at least one status")
    statuses: set[int] = set()
    for i, item in enumerate(items):
        where = f"{path}[{i}]" if isinstance(value, list) else path
        found = STATUS_RANGE.match(item) if isinstance(item, str) else None
        if isinstance(item, int) and not isinstance(item, bool):
            low = high = item
        elif found is not None:
            low, high = (int(n) for n in found.groups())
        elif isinstance(item, str) and item.strip().isdigit():
            low = high = int(item)
        else:
            raise ConfigError(f"{where}: must be a status code or a range like \"400-499\", "
                              f"not {item!r}")
        if not 200 <= low <= high <= 599:
            raise ConfigError(f"{where}: must lie within 200-599, low to high, not {item!r}")
        statuses.update(range(low, high + 1))
    return frozenset(statuses)


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


def dump_name(request_id: str, when: dt.datetime) -> tuple[str, str]:
    """The day directory and the file name's stem (``.json`` follows) of the dump of
    ``request_id`` written at ``when``."""
    when = when.astimezone(dt.timezone.utc)
    return when.strftime("%Y-%m-%d"), f"{when:%H%M%S.%f}-{safe_name(request_id)}"


def write_dump(directory: str, data: bytes, request_id: str, when: dt.datetime) -> str:
    """Write ``data`` once, as a new file named after ``when`` (UTC) and the request id.

    The bytes go to a temporary file first, then are hard-linked under the final name, which
    fails rather than replace an existing file: a reader sees the whole dump or none, and a
    clash gets the next free ``-N`` suffix. Returns the path written.
    """
    day, stem = dump_name(request_id, when)
    make_private_dirs(directory)
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
        deleted: list[str] = []
        entries = self.entries
        while entries is not None and len(entries) > 1 and (len(entries) > self.max_files
                                                              or self.total > self.max_bytes):
            day, name, size = entries.popleft()
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


# Read once: an enum member's lookup on its class costs more than a global's, per exchange.
_OK, _MALFORMED, _REJECTED, _STREAM_ERROR = (Outcome.OK, Outcome.UPSTREAM_MALFORMED,
                                             Outcome.REJECTED, Outcome.STREAM_ERROR)


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

    def started(self) -> Settings:
        """The running relay's settings (from :meth:`relay_startup` on). A method, not a
        property: pluggy 1.3 (the floor) reads every attribute of a plugin when registering it."""
        if self.settings is None:
            raise RuntimeError("the dump plugin has not started")
        return self.settings

    # --- hooks ----------------------------------------------------------------------------

    @hookimpl
    def relay_startup(self, config, options):
        self.settings = settings = parse_options(options)
        self.config_doc = record.config_document(config)
        # And what a backend's URL sends as Basic credentials, which no recorded header
        # holds (aiohttp adds them).
        self.secrets = {key for backend in config.backends
                        for key in (backend.api_key,
                                    *(credential.key for credential in backend.credentials),
                                    *backend.url_credentials)
                        if key}
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
        limit = self.started().max_body_bytes
        if len(event.raw) > limit:
            fields = record.body_fields(event.raw, (), limit)
            data = {"event": fields.get("body"), "event_truncated": fields["body_truncated"]}
        else:
            data = event.data
            if data is None:
                data = event.raw.decode("utf-8", "replace")
        exchange.state[PLUGIN] = {"reason": "stream_error", "stream_error": data}

    @hookimpl
    def relay_exchange_end(self, exchange):
        settings = self.settings
        if settings is None or self.executor is None:
            return
        reason = self.reason_for(exchange, settings)
        if reason is not None:
            self.submit(exchange, reason)

    # --- the work -------------------------------------------------------------------------

    def reason_for(self, exchange, settings: Settings | None = None) -> str | None:
        if settings is None:
            settings = self.started()
        noticed = exchange.state.get(PLUGIN)
        if noticed:
            return noticed["reason"]
        outcome = exchange.outcome
        if outcome == _OK:
            answer = exchange.answer
            if (answer is not None and 200 <= answer.status < 300
                    and answer.status in settings.statuses
                    and exchange.endpoint in ("messages", "count_tokens")):
                return "ok"  # asked for: successful exchanges too
            return None
        if outcome == _MALFORMED:
            return "upstream_malformed"  # a fault of the upstream's, like its 4xx
        if outcome == _REJECTED and settings.include_relay_rejections:
            return "rejected"
        if outcome == _STREAM_ERROR and settings.include_stream_errors:
            return "stream_error"
        return None

    def submit(self, exchange, reason: str) -> asyncio.Future | None:
        """Write the exchange's dump in the background (the exchange must be over), or drop
        it when the write queue is full: None then."""
        settings = self.started()
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
        # Known before the write, for the end hooks that run after this one (the ledger
        # row names it); only a clash (the same request id in the same microsecond) would
        # give the file a suffix.
        day, stem = dump_name(exchange.id, when)
        exchange.dump_path = os.path.join(settings.dir, day, f"{stem}.json")
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
        settings = self.started()
        directory = settings.dir
        try:
            document = record.to_document(
                exchange, reason=reason, when=when, config=self.config_doc, secrets=self.secrets,
                stream_error=stream_error, max_body_bytes=settings.max_body_bytes)
            data = record.encode(document)
            path = write_dump(directory, data, exchange.id, when)
        except OSError as e:
            self.write_failed(exchange.id, reason, directory, e)
            return None
        except Exception:
            log.exception("%s: could not build the %s dump", exchange.id, reason)
            return None
        log.info("%s: %s dump written to %s", exchange.id, reason, path)
        retention = self.retention
        try:
            for deleted in retention.add(path, len(data)) if retention is not None else ():
                log.info("retention: deleted %s", deleted)
        except OSError as e:
            log.warning("retention under %s failed: %s", directory, e)
        return path


def held_bytes(exchange: Exchange) -> int:
    """About what a pending dump keeps alive: the exchange's bodies."""
    size = len(exchange.raw_body or b"")
    sent = exchange.upstream_request.body if exchange.upstream_request is not None else None
    if sent is not None and sent is not exchange.raw_body:
        size += len(sent)
    answer = exchange.upstream_response
    if answer is not None and answer.body is not None:
        size += len(answer.body)
    return size


def relay_stream_error(exchange: Exchange) -> dict | None:
    """The error event the relay itself sent when the upstream's stream broke off, as the
    record's :attr:`~relay.exchange.Exchange.stream_failure` says (a dump has recorded it
    with the type ``api_error`` whatever the event's own)."""
    failure = exchange.stream_failure
    if failure is None:
        return None
    return {"type": "error", "error": {"type": "api_error", "message": failure.message}}
