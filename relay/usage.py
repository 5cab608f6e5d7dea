"""What an exchange used and what it cost: the usage an answer reports, its price, and the
ledger's rows added up. Pure functions and plain records; the ``usage`` plugin
(``plugins/usage.py``) applies them to the exchange, ``relay usage`` to the ledger.

**Counting.** Anthropic's ``usage.input_tokens`` counts only the input that was neither read
from nor written to the prompt cache; ``cache_read_input_tokens`` and
``cache_creation_input_tokens`` are separate and the three add up to the whole prompt
(https://docs.anthropic.com/en/docs/build-with-claude/prompt-caching, "Tracking cache
performance"). So each is counted once, in its own column, and priced at its own rate: never
a cache read as fresh input, never a cache write twice (the faults of LiteLLM #9812, #11364 and
#11789, which added the cache counts to a prompt count that already held them). Cache writes
are split by lifetime from ``usage.cache_creation.ephemeral_5m_input_tokens`` /
``ephemeral_1h_input_tokens`` (a one-hour write costs 2x input, a five-minute one 1.25x); an
answer that gives only ``cache_creation_input_tokens`` wrote five-minute entries, the API's
default lifetime.

**Streams.** ``message_start`` carries the input side; each ``message_delta``'s usage is
cumulative (the SDK's accumulator replaces, never adds: ``lib/streaming/_messages.py``), so
the last one seen is the stream's usage, and any field it gives replaces what
``message_start`` said. A stream that ended before a ``message_delta`` is ``complete=False``
and is charged what was reported up to then.

**Unreported usage.** Every answer's usage must give ``input_tokens`` and ``output_tokens``
(the SDK's ``Usage`` and ``MessageDeltaUsage`` require them; a stream's output count is its
``message_delta``'s, ``message_start`` holding only the first token). An answer without
them, a value that is no count (a string, a negative or fractional number; an integral
float is its integer, as JSON numbers have no integer type), or a cache-write split larger
than its total, is ``reported=False``: what it did report is counted, nothing is made up,
and the flag says the count may be short of what was used.

**Money** is integers of micro-dollars (1e-6 USD). A price per million tokens in USD is, by
the same number, micro-dollars per token, so a cost is an exact sum of tokens times rates;
prices are read as decimals (never binary floats) and the sum is rounded once per exchange,
half up, to a whole micro-dollar.
"""

from __future__ import annotations

import calendar
import dataclasses
import datetime
import fnmatch
import re
from collections.abc import Iterable
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from math import lcm
from typing import Any

import msgspec

from .errors import ConfigError

# The price kinds of ``usd_per_mtok``, each the Usage field it prices.
RATES = {"input": "input_tokens", "output": "output_tokens",
         "cache_write_5m": "cache_write_5m_input_tokens",
         "cache_write_1h": "cache_write_1h_input_tokens",
         "cache_read": "cache_read_input_tokens"}
TOKEN_FIELDS = ("input_tokens", "output_tokens", "cache_read_input_tokens",
                "cache_write_5m_input_tokens", "cache_write_1h_input_tokens")
GROUPS = ("key", "model", "backend", "day")
MAX_COUNT = 2 ** 53  # no answer reports more; a bigger number is a fault, not usage
MAX_TOOLS = 16  # distinct server tools one answer may name


@dataclasses.dataclass(slots=True)
class Usage:
    """What one exchange used, as the upstream reported it, and its cost (``None`` when no
    price matched the model). ``server_tool_requests`` maps a server tool (``web_search``,
    ``web_fetch``) to its requests. ``complete`` is False for a stream that ended before its
    ``message_delta``; ``reported`` is False when the upstream did not report the usage in
    full (see the module's docstring), so that the counts may be short."""

    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_input_tokens: int = 0
    cache_write_5m_input_tokens: int = 0
    cache_write_1h_input_tokens: int = 0
    server_tool_requests: dict[str, int] = dataclasses.field(default_factory=dict)
    complete: bool = True
    reported: bool = True
    cost_micro_usd: int | None = None


# Bits of what a usage object gave: the two counts every answer must report.
INPUT, OUTPUT = 1, 2
BOTH = INPUT | OUTPUT


def _odd(usage: Usage, value) -> int | None:
    """A value that failed the fast check for a count: None (absent) as None, an integral
    float as its integer; anything else is no count, and flags ``usage`` unreported."""
    if value is None:
        return None
    if value.__class__ is float and value.is_integer() and 0 <= value <= MAX_COUNT:
        return int(value)
    usage.reported = False
    return None


def _count(usage: Usage, value) -> int | None:
    if value.__class__ is int and 0 <= value <= MAX_COUNT:
        return value
    return _odd(usage, value)


def _tools(usage: Usage, server_tool_use) -> dict[str, int] | None:
    """``{"web_search_requests": 2, "web_fetch_requests": 0}`` as ``{"web_search": 2}``."""
    if server_tool_use.__class__ is not dict:
        _odd(usage, server_tool_use)
        return None
    tools: dict[str, int] = {}
    for name, value in server_tool_use.items():
        if not name.endswith("_requests"):
            continue
        count = _count(usage, value)
        if not count or len(tools) >= MAX_TOOLS:
            continue
        tools[name[:-len("_requests")]] = count
    return tools


def apply(usage: Usage, reported) -> int:
    """Fold an Anthropic ``usage`` object into ``usage``: every count it gives replaces the
    one there (usage objects are cumulative), counts it leaves out stay. A value that is not
    a count is not counted, and sets ``usage.reported`` False. Returns which of
    ``input_tokens`` (:data:`INPUT`) and ``output_tokens`` (:data:`OUTPUT`) it gave."""
    # Written out, not looped: this runs for every answer and twice for every stream.
    if reported.__class__ is not dict:
        _odd(usage, reported)
        return 0
    given = 0
    get = reported.get
    count = get("input_tokens")
    if count.__class__ is not int or not 0 <= count <= MAX_COUNT:
        count = _odd(usage, count)
    if count is not None:
        usage.input_tokens = count
        given = INPUT
    count = get("output_tokens")
    if count.__class__ is not int or not 0 <= count <= MAX_COUNT:
        count = _odd(usage, count)
    if count is not None:
        usage.output_tokens = count
        given |= OUTPUT
    count = get("cache_read_input_tokens")
    if count.__class__ is not int or not 0 <= count <= MAX_COUNT:
        count = _odd(usage, count)
    if count is not None:
        usage.cache_read_input_tokens = count
    split = get("cache_creation")
    total = get("cache_creation_input_tokens")
    if total is not None:
        total = _count(usage, total)
    if split.__class__ is dict:
        five = _count(usage, split.get("ephemeral_5m_input_tokens")) or 0
        hour = _count(usage, split.get("ephemeral_1h_input_tokens")) or 0
        if total is not None:
            if total > five + hour:
                five += total - five - hour  # written, but no lifetime given: the default's
            elif total < five + hour:
                usage.reported = False  # the split says more was written than the total
        usage.cache_write_5m_input_tokens, usage.cache_write_1h_input_tokens = five, hour
    else:
        if split is not None:
            _odd(usage, split)
        if total is not None:
            # A total without its split (a message_delta's): the one-hour part already
            # known stays one-hour, as far as the total allows; the rest is five-minute.
            hour = min(usage.cache_write_1h_input_tokens, total)
            usage.cache_write_5m_input_tokens = total - hour
            usage.cache_write_1h_input_tokens = hour
    if "server_tool_use" in reported:
        tools = _tools(usage, reported["server_tool_use"])
        if tools is not None:
            usage.server_tool_requests = tools
    return given


def from_answer(usage_object) -> Usage:
    """The usage of a complete (non-streamed) answer, from its ``usage`` object (None when
    it had none: nothing reported)."""
    usage = Usage()
    if apply(usage, usage_object) != BOTH:
        usage.reported = False
    return usage


class _Answer(msgspec.Struct):
    model: Any = None
    usage: Any = None


_answer = msgspec.json.Decoder(_Answer).decode


def answer_fields(body: bytes) -> tuple[str | None, dict | None]:
    """An answer body's ``model`` and ``usage``, read without building the rest of it (the
    content, which is nearly all of it, is only scanned); ``(None, None)`` for a body that
    is not a JSON object."""
    try:
        answer = _answer(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None, None
    model = answer.model if answer.model.__class__ is str else None
    usage = answer.usage if answer.usage.__class__ is dict else None
    return model, usage


class _Start(msgspec.Struct):
    message: _Answer | None = None


class _Delta(msgspec.Struct):
    usage: Any = None


_start = msgspec.json.Decoder(_Start).decode
_delta = msgspec.json.Decoder(_Delta).decode


def _data_line(raw: bytes) -> bytes | None:
    """The data of an event framed as Anthropic frames one (its name, then one ``data:``
    line); None for any other framing, which the caller parses the slow way."""
    start = raw.find(b"\ndata: ")
    if start < 0:
        return None
    start += 7
    end = raw.find(b"\n", start)
    if end < 0:
        end = len(raw)
    elif raw.find(b"data:", end) >= 0:  # its data in several lines
        return None
    return raw[start:end]


class StreamMeter:
    """The usage of one stream, fed its ``message_start`` and ``message_delta`` events: as
    parsed data (:meth:`message_start`, :meth:`message_delta`), or as their bytes
    (:meth:`event`), read for ``model`` and ``usage`` alone. The input count may come in
    either event; the output count only in a ``message_delta`` (``message_start``'s is the
    stream's first token): once one has come without them, the usage is unreported."""

    __slots__ = ("usage", "model", "given")

    def __init__(self) -> None:
        self.usage = Usage(complete=False)
        self.model: str | None = None
        self.given = 0  # INPUT and OUTPUT, as far as they came

    def message_start(self, data) -> Usage:
        message = data.get("message") if data.__class__ is dict else None
        if message.__class__ is dict:
            self._started(message.get("model"), message.get("usage"))
        return self.usage

    def _started(self, model, reported) -> None:
        if model.__class__ is str:
            self.model = model
        self.given |= apply(self.usage, reported) & INPUT

    def message_delta(self, data) -> Usage:
        self._delta(data.get("usage") if data.__class__ is dict else None)
        return self.usage

    def _delta(self, reported) -> None:
        usage = self.usage
        given = self.given = self.given | apply(usage, reported)
        if given != BOTH:
            usage.reported = False
        usage.complete = True

    def event(self, name: str | None, raw: bytes) -> Usage | None:
        """Fold in the ``message_start`` or ``message_delta`` event framed as ``raw``; None
        when its bytes are not one JSON object on one ``data:`` line (then give its parsed
        data to :meth:`message_start` or :meth:`message_delta`)."""
        line = _data_line(raw)
        if line is None:
            return None
        try:
            if name == "message_start":
                message = _start(line).message
                if message is not None:
                    self._started(message.model, message.usage)
                return self.usage
            reported = _delta(line).usage
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        self._delta(reported)
        return self.usage


# --- prices ----------------------------------------------------------------------------


def _amount(value, path: str) -> Fraction:
    """A price given in relay.yaml as an exact fraction. YAML reads ``3.75`` as a float;
    its shortest decimal form is the number the operator wrote."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"{path}: must be a number of US dollars")
    try:
        amount = Decimal(str(value).strip())
    except InvalidOperation:
        raise ConfigError(f"{path}: {value!r} is not a number") from None
    if not amount.is_finite() or amount < 0:
        raise ConfigError(f"{path}: must be a number of dollars, 0 or more")
    return Fraction(amount)


@dataclasses.dataclass(frozen=True)
class Price:
    """One entry of the ``prices`` option, in micro-dollars: every rate as an integer over
    one shared ``denominator``, so that a cost is integer arithmetic alone."""

    models: tuple[str, ...]
    per_token: tuple[tuple[str, int], ...]  # (Usage field, rate * denominator)
    per_request: dict[str, int]  # server tool -> rate * denominator
    denominator: int
    pattern: re.Pattern = dataclasses.field(compare=False, repr=False)

    def cost(self, usage: Usage) -> int:
        """The cost of ``usage`` in micro-dollars, rounded half up once. A server tool
        without a price of its own costs nothing beyond its tokens."""
        # Written out, not looped: this runs for every answer (per_token is in RATES' order).
        (_, a), (_, b), (_, c), (_, d), (_, e) = self.per_token
        total = usage.input_tokens * a + usage.output_tokens * b \
            + usage.cache_write_5m_input_tokens * c + usage.cache_write_1h_input_tokens * d \
            + usage.cache_read_input_tokens * e
        if usage.server_tool_requests:
            for tool, count in usage.server_tool_requests.items():
                total += count * self.per_request.get(tool, 0)
        return (2 * total + self.denominator) // (2 * self.denominator)


def parse_price(entry, path: str) -> Price:
    if not isinstance(entry, dict):
        raise ConfigError(f"{path}: must be a mapping with models and usd_per_mtok")
    unknown = set(entry) - {"models", "usd_per_mtok", "usd_per_server_tool_request"}
    if unknown:
        raise ConfigError(f"{path}.{sorted(unknown)[0]}: unknown key (known: models, "
                          f"usd_per_mtok, usd_per_server_tool_request)")
    models = entry.get("models")
    if isinstance(models, str):
        models = [models]
    if not isinstance(models, list) or not models or not all(
            isinstance(m, str) and m for m in models):
        raise ConfigError(f"{path}.models: must be a list of model names or globs")
    rates = entry.get("usd_per_mtok")
    if not isinstance(rates, dict):
        raise ConfigError(f"{path}.usd_per_mtok: must be a mapping of "
                          f"{', '.join(RATES)} to US dollars per million tokens")
    for name in rates:
        if name not in RATES:
            raise ConfigError(f"{path}.usd_per_mtok.{name}: unknown kind (known: "
                              f"{', '.join(RATES)})")
    missing = [name for name in RATES if name not in rates]
    if missing:
        # A kind left out would price its tokens at nothing, silently.
        raise ConfigError(f"{path}.usd_per_mtok.{missing[0]}: required (give 0 for a kind "
                          f"that is free)")
    tools = entry.get("usd_per_server_tool_request") or {}
    if not isinstance(tools, dict) or not all(isinstance(t, str) for t in tools):
        raise ConfigError(f"{path}.usd_per_server_tool_request: must be a mapping of server "
                          f"tool names (web_search, ...) to US dollars per request")
    # USD per million tokens is micro-dollars per token; USD per request is 1e6 of them.
    token_rates = {RATES[name]: _amount(rates[name], f"{path}.usd_per_mtok.{name}")
                   for name in RATES}
    tool_rates = {tool: _amount(value, f"{path}.usd_per_server_tool_request.{tool}")
                  * 1_000_000 for tool, value in tools.items()}
    denominator = lcm(*(rate.denominator for rate in (*token_rates.values(),
                                                      *tool_rates.values())))
    return Price(
        models=tuple(models),
        per_token=tuple((name, int(rate * denominator)) for name, rate in token_rates.items()),
        per_request={tool: int(rate * denominator) for tool, rate in tool_rates.items()},
        denominator=denominator,
        pattern=re.compile("|".join(f"(?:{fnmatch.translate(glob)})" for glob in models)))


class Prices:
    """The ``prices`` option: entries tried in order, the first whose globs match the model
    wins."""

    MAX_REMEMBERED = 1024  # model names are the client's: what is remembered is bounded

    def __init__(self, entries: Iterable[Price] = ()):
        self.entries = tuple(entries)
        self._found: dict[str, Price | None] = {}

    def __bool__(self) -> bool:
        return bool(self.entries)

    def find(self, model: str | None) -> Price | None:
        if model is None:
            return None
        try:
            return self._found[model]
        except KeyError:
            pass
        found = next((price for price in self.entries if price.pattern.fullmatch(model)), None)
        if len(self._found) < self.MAX_REMEMBERED:
            self._found[model] = found
        return found

    def price(self, usage: Usage, model: str | None) -> Usage:
        """Set ``usage.cost_micro_usd`` for ``model`` (None when no entry matches)."""
        price = self.find(model)
        usage.cost_micro_usd = price.cost(usage) if price is not None else None
        return usage


def parse_prices(value, path: str = "prices") -> Prices:
    """The ``prices`` option checked and built (a ConfigError naming the key path)."""
    if value is None:
        return Prices()
    if not isinstance(value, list):
        raise ConfigError(f"{path}: must be a list of {{models, usd_per_mtok}} entries")
    return Prices(parse_price(entry, f"{path}.{n}") for n, entry in enumerate(value))


# --- the ledger, added up ----------------------------------------------------------------


def parse_time(text: str, end: bool = False) -> float:
    """``--since`` / ``--until``: a date (``2026-12-01``, UTC) or an ISO time (UTC unless it
    names its offset). A date as an ``end`` means the end of that day: it is included."""
    text = text.strip()
    try:
        if len(text) == 10:
            day = datetime.date.fromisoformat(text)
            start = calendar.timegm(day.timetuple())
            return float(start + 86400 if end else start)
        moment = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"{text!r} is neither a date (2026-12-01) nor an ISO time "
                         f"(2026-12-01T09:30:00Z)") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.timezone.utc)
    return moment.timestamp()


def _group_value(row: dict, by: str):
    if by == "day":
        return datetime.datetime.fromtimestamp(row["time"], datetime.timezone.utc) \
            .strftime("%Y-%m-%d")
    return row.get(by)


def aggregate(rows: Iterable[dict], by: str = "key", since: float | None = None,
              until: float | None = None) -> list[dict]:
    """Ledger rows with ``since <= time < until`` added up by ``by`` (key, model, backend or
    day, UTC): one dict per group with the group's field, ``requests``, the token columns,
    ``cost_micro_usd`` (of the rows that were priced), ``unpriced_requests`` (rows with
    usage but no price: their tokens are counted, their cost is not known) and
    ``unreported_requests`` (rows whose upstream did not report the usage in full: their
    counts, and so their cost, may be short). Ordered by the group's value, an unknown
    (None) last."""
    if by not in GROUPS:
        raise ValueError(f"cannot group by {by!r} (one of {', '.join(GROUPS)})")
    groups: dict[Any, dict] = {}
    for row in rows:
        if (since is not None and row["time"] < since) or (
                until is not None and row["time"] >= until):
            continue
        value = _group_value(row, by)
        group = groups.get(value)
        if group is None:
            group = groups[value] = {by: value, "requests": 0, **dict.fromkeys(TOKEN_FIELDS, 0),
                                     "cost_micro_usd": 0, "unpriced_requests": 0,
                                     "unreported_requests": 0}
        group["requests"] += 1
        for name in TOKEN_FIELDS:
            group[name] += row.get(name) or 0
        cost = row.get("cost_micro_usd")
        if cost is None:
            group["unpriced_requests"] += 1
        else:
            group["cost_micro_usd"] += cost
        if row.get("usage_reported") is False:  # rows written before the flag: not known
            group["unreported_requests"] += 1
    return [groups[value] for value in sorted(groups, key=lambda v: (v is None, str(v)))]


def usd(micro: int | None) -> str:
    """Micro-dollars as dollars, exactly (``1234567`` -> ``1.234567``)."""
    if micro is None:
        return "-"
    sign = "-" if micro < 0 else ""
    whole, part = divmod(abs(micro), 1_000_000)
    return f"{sign}{whole}.{part:06d}"


# --- relay usage ------------------------------------------------------------------------

COLUMNS = ("requests", *TOKEN_FIELDS, "cost_micro_usd", "unpriced_requests",
           "unreported_requests")
HEADINGS = ("requests", "input", "output", "cache read", "cache write 5m", "cache write 1h",
            "cost USD", "unpriced", "unreported")


def add_arguments(parser) -> None:
    parser.add_argument("--config", default="relay.yaml", help="path to relay.yaml")
    parser.add_argument("--by", choices=GROUPS, default="key", help="group rows by (default key)")
    parser.add_argument("--since", help="from this date (UTC) or ISO time on")
    parser.add_argument("--until", help="up to this date (included) or ISO time (excluded)")
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="a JSON list of rows")
    output.add_argument("--csv", action="store_true", help="CSV with a header line")


def table(groups: list[dict], by: str) -> str:
    """The groups as an aligned text table, dollars in full (six decimals)."""
    lines: list[tuple[str, ...]] = [(by, *HEADINGS)]
    for group in groups:
        value = group[by]
        lines.append(("-" if value is None else str(value),
                      *(usd(group[c]) if c == "cost_micro_usd" else str(group[c])
                        for c in COLUMNS)))
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                               for i, (cell, w) in enumerate(zip(line, widths, strict=True)))
                     .rstrip() for line in lines)


def csv_text(groups: list[dict], by: str) -> str:
    import csv
    import io

    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow((by, *COLUMNS))
    for group in groups:
        writer.writerow((group[by] if group[by] is not None else "",
                         *(group[c] for c in COLUMNS)))
    return out.getvalue()


async def read_ledger(state_options: dict, since: float | None,
                      until: float | None) -> tuple[str, list[dict]]:
    """The ledger's rows in the window, from the state relay.yaml's ``state:`` names, and
    that state's kind."""
    from .state import open_state

    state = await open_state(state_options)
    try:
        return state.kind, await state.rows(since=since, until=until)
    finally:
        await state.close()


def main(args) -> int:
    """``relay usage``: the ledger added up. Exit status 2 for a config error or a bad
    time, 1 when the state cannot be reached."""
    import asyncio
    import sys

    import orjson

    from . import config as config_module

    try:
        # Only state: is read: the keys' variables need not be set where the command runs.
        config = config_module.load(args.config, require_keys=False)
        since = parse_time(args.since) if args.since else None
        until = parse_time(args.until, end=True) if args.until else None
    except (ConfigError, ValueError) as e:
        print(f"relay: {e}", file=sys.stderr)
        return 2
    from .state import Unavailable
    try:
        kind, rows = asyncio.run(read_ledger(config.state, since, until))
    except Unavailable as e:  # said as `relay keys` says it: one line, no traceback
        print(f"relay usage: the state cannot be reached: {e}", file=sys.stderr)
        return 1
    if kind == "memory":
        print("relay: state.url is not set, so the ledger lives in the serving relay's memory, "
              "which this command cannot read: set state.url, or ask the serving relay "
              "(GET /v1/relay/usage with the admin key)", file=sys.stderr)
    groups = aggregate(rows, args.by)
    if args.json:
        sys.stdout.write(orjson.dumps(groups, option=orjson.OPT_INDENT_2).decode() + "\n")
    elif args.csv:
        sys.stdout.write(csv_text(groups, args.by))
    else:
        print(table(groups, args.by))
    return 0
