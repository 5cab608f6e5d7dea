"""Log lines an operator and a log shipper can trust: text, or one JSON object per line.

Much of what the relay logs comes from clients and upstreams (a model name, a path, an
error message). Every such value is escaped and capped here, in both formats: a newline in
``model`` must not forge a line, and a 5 MB model name must not become a 5 MB line.
"""

from __future__ import annotations

import datetime
import logging
import re

import orjson

MAX_FIELD = 200  # characters of one access-line field
MAX_MESSAGE = 4000  # characters of any other record's message

access_log = logging.getLogger("relay.access")

# C0 and C1 controls, DEL and the Unicode line separators: anything a terminal, a pager or a
# log shipper might take for the end of a line.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
# What makes a logfmt value need quotes.
_QUOTE = re.compile("[\\s\"=\\\\\x00-\x1f\x7f-\x9f\u2028\u2029]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape_char(match: re.Match) -> str:
    char = match.group()
    named = _NAMED.get(char)
    if named:
        return named
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def cap(value: str, limit: int = MAX_FIELD) -> str:
    """``value`` cut to ``limit`` characters, saying how long it was."""
    if len(value) <= limit:
        return value
    return f"{value[:limit]}...[{len(value)} chars]"


def escape(value: str) -> str:
    """Control characters as visible escapes: the value stays on one line."""
    return _CONTROL.sub(_escape_char, value)


def logfmt_value(value) -> str:
    """One access-line value for the text format: bare when it is a plain word, else in
    double quotes with quotes, backslashes and control characters escaped."""
    if value is True or value is False:
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    text = cap(str(value))
    if text and not _QUOTE.search(text):
        return text
    text = text.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escape(text)}"'


def access_fields(exchange, status: int | None) -> dict:
    """What the access line says about an exchange; a field that does not apply is left out.
    ``ttfb_ms`` is the time to the answer's first byte, from the exchange's record (the line
    is written once the answer has gone).

    Never a secret: no header, no query string, no body; the inbound key by its name only.
    """
    backend = exchange.backend
    fields = {
        "request_id": exchange.id,
        "endpoint": exchange.endpoint,
        "model": exchange.model,
        "backend": backend.name if backend is not None else None,
        "credential": exchange.credential,
        "status": status,
        "outcome": exchange.outcome,
        "stream": exchange.stream,
        "method": exchange.method,
        "path": exchange.path,
        "duration_ms": round(exchange.elapsed() * 1000, 1),
        "ttfb_ms": (round(exchange.timings.first_byte * 1000, 1)
                    if exchange.timings.first_byte is not None else None),
        "events": exchange.answer.events if exchange.answer is not None else None,
        "ids_rewritten": sum(1 for entry in exchange.translation.values()
                             if entry.get("direction") == "to_client"),
        "repairs": exchange.repairs,
        "key": getattr(exchange, "key_name", None),
        "cache": _cache(exchange.cache),
    }
    used = getattr(exchange, "usage", None)
    if used is not None:
        fields.update(usage_fields(used))
    return {name: value if value is None or isinstance(value, (bool, int, float))
            else cap(str(value)) for name, value in fields.items() if value is not None}


def usage_fields(used) -> dict:
    """The access line's account of what the answer used (a :class:`relay.usage.Usage`):
    input and output always, the cache columns when not 0, the cost in micro-dollars
    (``unpriced`` when no price matched), ``usage_complete=false`` for a stream that ended
    before its usage was final and ``usage_reported=false`` for an answer whose upstream did
    not report its usage in full."""
    fields = {"input_tokens": used.input_tokens, "output_tokens": used.output_tokens}
    for name in ("cache_read_input_tokens", "cache_write_5m_input_tokens",
                 "cache_write_1h_input_tokens"):
        count = getattr(used, name)
        if count:
            fields[name] = count
    fields["cost_micro_usd"] = ("unpriced" if used.cost_micro_usd is None
                                else used.cost_micro_usd)
    if not used.complete:
        fields["usage_complete"] = False
    if not getattr(used, "reported", True):  # a plugin's own usage object may not say
        fields["usage_reported"] = False
    return fields
def _cache(cache: dict | None) -> str | None:
    """The prompt cache's verdict (the cache plugin's ``exchange.cache``) as the header
    ``x-relay-cache`` words it: ``hit``, ``write``, ``none``, ``miss; cause=...``."""
    if not cache:
        return None
    text = str(cache.get("status"))
    return f"{text}; cause={cache['cause']}" if cache.get("cause") else text


def access_line(fields: dict) -> str:
    """The text form: ``id endpoint key=value ...``, every value a logfmt value."""
    rest = " ".join(f"{name}={logfmt_value(value)}" for name, value in fields.items()
                    if name not in ("request_id", "endpoint"))
    return (f"{logfmt_value(fields.get('request_id', '-'))} "
            f"{logfmt_value(fields.get('endpoint', '-'))} {rest}")


def log_access(fields: dict) -> None:
    access_log.info("%s", access_line(fields), extra={"access": fields})


class TextFormatter(logging.Formatter):
    """``time LEVEL logger: message``, the message escaped onto one line and capped.
    Tracebacks follow indented, so no line of one starts like a record."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        if getattr(record, "access", None) is None:  # an access line is escaped already
            record.message = escape(cap(record.message, MAX_MESSAGE))
        return super().formatMessage(record)

    def formatException(self, ei) -> str:
        return "  " + escape_lines(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:
        return "  " + escape_lines(stack_info)


def escape_lines(text: str) -> str:
    """A multi-line text (a traceback) with every line indented and escaped."""
    return "\n  ".join(escape(line) for line in text.split("\n"))


class JSONFormatter(logging.Formatter):
    """One JSON object per record, on one line: ``time`` (UTC, ISO 8601), ``level``,
    ``logger``, ``pid``, ``message``; an access record is ``"message": "exchange"`` with its
    fields at the top level; ``exc`` holds the traceback when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
                    .isoformat(timespec="microseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "pid": record.process,
        }
        fields = getattr(record, "access", None)
        if fields is not None:
            out["message"] = "exchange"
            out.update(fields)
        else:
            out["message"] = cap(record.getMessage(), MAX_MESSAGE)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        try:
            return orjson.dumps(out).decode()
        except TypeError:  # a lone surrogate, which UTF-8 cannot hold: kept as escape text
            return orjson.dumps({name: value.encode("utf-8", "backslashreplace").decode()
                                 if isinstance(value, str) else value
                                 for name, value in out.items()}).decode()


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
TEXT_FORMAT_WORKERS = "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"


_format = "text"


def announce(text: str) -> None:
    """A line for whoever started the relay (``relay listening on ...``): on stdout as it
    is, or with ``json`` a log record like every other line."""
    if _format == "json":
        logger = logging.getLogger("relay")
        # At INFO whatever server.log_level says: whoever started the relay waits for it.
        logger.handle(logger.makeRecord(logger.name, logging.INFO, __file__, 0, "%s", (text,),
                                        None))
    else:
        print(text, flush=True)


def configure(level: str, log_format: str, access: bool, workers: int = 1) -> None:
    """Send every record to stderr in ``log_format`` (text or json). With several workers
    the text format names each line's process; JSON lines always carry ``pid``."""
    global _format
    _format = log_format
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(JSONFormatter())
    else:
        handler.setFormatter(TextFormatter(TEXT_FORMAT_WORKERS if workers > 1 else TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    access_log.setLevel(logging.INFO if access else logging.WARNING)
