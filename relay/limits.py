"""Per-key limits, as pure logic: what relay.yaml's ``limits:`` may say, which counters and
slots a request takes from the state (:mod:`relay.state`), what an answer adds to them, and
the headers and refusals that follow. The ``limits`` plugin is the glue around this.

A key's limits (``server.auth.keys[i].limits``, ``server.auth.default_limits`` for every
key, or what ``relay keys create --limits`` stored) are ``requests_per_minute``,
``input_tokens_per_minute``, ``output_tokens_per_minute``, ``concurrent``, ``budget: {usd,
per: day|week|month}`` and the same again under ``models: {PATTERN: {...}}`` for the models a
pattern matches. A key's own limits overlay the defaults one name at a time (``null`` lifts a
default), and each matching model pattern is a limit of its own beside the key's.

Windows are the state's: fixed and aligned to UTC, so every process names the same window
and the same reset.
"""

from __future__ import annotations

import dataclasses
import datetime
import fnmatch
import functools
import math
from collections.abc import Iterable, Sequence
from typing import Any

from .errors import ConfigError, RelayError
from .options import unknown
from .state import Count, Counter, Slot, made

RATES = {
    "requests_per_minute": "requests per minute",
    "input_tokens_per_minute": "input tokens per minute",
    "output_tokens_per_minute": "output tokens per minute",
    "concurrent": "requests in flight at once",
}
FIELDS = (*RATES, "budget")
HEADER_FAMILIES = {"requests_per_minute": "requests",
                   "input_tokens_per_minute": "input-tokens",
                   "output_tokens_per_minute": "output-tokens"}
FAMILY_HEADERS = {family: tuple(f"anthropic-ratelimit-{family}-{part}"
                                for part in ("limit", "remaining", "reset"))
                  for family in HEADER_FAMILIES.values()}
BUDGET_PERIODS = ("day", "week", "month")
# The words Claude Code's usage-limit headers use for a budget's period (its gateway
# contract, docs/accounting.md).
PERIOD_WORDS = {"day": "daily", "week": "weekly", "month": "monthly"}
# A slot not given back (a process that died holding it) frees itself after this long: longer
# than a stream may last under the default read timeout of 600 s.
SLOT_LEASE = 900.0
# Claude Code shows its usage notice once a budget passes these fractions (its contract).
THRESHOLDS = (0.95, 0.75)
MAX_CACHED_MODELS = 256
RATELIMIT_PREFIX = "anthropic-ratelimit-"


# --- relay.yaml's limits: ---------------------------------------------------------------


def _count(value, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{path}: must be a whole number, 1 or more (or null: no limit)")
    return value


def _budget(value, path: str) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: must be a mapping like {{usd: 50, per: month}}")
    for name in value:
        if name not in ("usd", "per"):
            raise unknown(path, name, ("usd", "per"), "key")
    usd = value.get("usd")
    if isinstance(usd, bool) or not isinstance(usd, (int, float)) or not usd > 0 \
            or not math.isfinite(usd):
        raise ConfigError(f"{path}.usd: must be a positive number of US dollars")
    per = value.get("per")
    if per not in BUDGET_PERIODS:
        raise ConfigError(f"{path}.per: must be one of {', '.join(BUDGET_PERIODS)}, "
                          f"not {per!r}")
    return {"usd": usd, "per": per}


def _rule(raw, path: str, models: bool) -> dict:
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: must be a mapping of limits")
    known = (*FIELDS, "models") if models else FIELDS
    for name in raw:
        if name not in known:
            raise unknown(path, name, known, "limit")
    checked: dict[str, Any] = {}
    for name in RATES:
        if name in raw:
            checked[name] = None if raw[name] is None else _count(raw[name], f"{path}.{name}")
    if "budget" in raw:
        checked["budget"] = (None if raw["budget"] is None
                             else _budget(raw["budget"], f"{path}.budget"))
    return checked


def check_limits(raw, path: str) -> dict:
    """``raw`` checked (every problem names its key path under ``path``) and normalised: the
    names given (a null kept, meaning no limit), ``models`` a mapping of pattern to the same."""
    if raw is None:
        return {}
    checked = _rule(raw, path, models=True)
    if "models" in raw:
        models = raw["models"]
        if not isinstance(models, dict):
            raise ConfigError(f'{path}.models: must be a mapping of model name pattern to '
                              f'limits, like {{"claude-opus-*": {{budget: ...}}}}')
        checked["models"] = {}
        for pattern, rule in models.items():
            if not isinstance(pattern, str) or not pattern:
                raise ConfigError(f"{path}.models: {pattern!r} is not a model name pattern")
            checked["models"][pattern] = _rule(rule, f"{path}.models.{pattern}", models=False)
    return checked


def overlay(default: dict | None, own: dict | None) -> dict:
    """A key's limits over the defaults, one name at a time (and one pattern at a time)."""
    default, own = default or {}, own or {}
    merged = {name: value for name, value in {**default, **own}.items() if name != "models"}
    patterns = {**default.get("models", {})}
    for pattern, rule in own.get("models", {}).items():
        patterns[pattern] = {**patterns.get(pattern, {}), **rule}
    if patterns:
        merged["models"] = patterns
    return merged


@dataclasses.dataclass(frozen=True, slots=True)
class Rule:
    """One set of limits: the key's own (``pattern`` None) or those of the models a pattern
    matches. A budget is in micro-dollars, as the state counts spend."""

    pattern: str | None = None
    requests_per_minute: int | None = None
    input_tokens_per_minute: int | None = None
    output_tokens_per_minute: int | None = None
    concurrent: int | None = None
    budget_micro_usd: int | None = None
    budget_per: str | None = None

    @classmethod
    def of(cls, raw: dict, pattern: str | None = None) -> Rule | None:
        budget = raw.get("budget")
        rule = cls(pattern, raw.get("requests_per_minute"), raw.get("input_tokens_per_minute"),
                   raw.get("output_tokens_per_minute"), raw.get("concurrent"),
                   round(budget["usd"] * 1_000_000) if budget else None,
                   budget["per"] if budget else None)
        return rule if rule != cls(pattern) else None

    def scope(self) -> str:
        return "" if self.pattern is None else f" for models {self.pattern}"


class Limits:
    """A key's effective limits: its own rule and one per model pattern."""

    __slots__ = ("rules", "raw", "_applying", "_plans")

    def __init__(self, rules: Sequence[Rule], raw: dict):
        self.rules = tuple(rules)
        self.raw = raw  # the checked form, for listings
        self._applying: dict[str, tuple[Rule, ...]] = {}
        self._plans: dict[tuple[str, str], Plan] = {}

    @classmethod
    def of(cls, raw: dict) -> Limits | None:
        """None when ``raw`` (checked, overlaid) limits nothing."""
        rules = [Rule.of(raw)] + [Rule.of(rule, pattern)
                                  for pattern, rule in raw.get("models", {}).items()]
        found = [rule for rule in rules if rule is not None]
        return cls(found, raw) if found else None

    def applying(self, model: str | None) -> tuple[Rule, ...]:
        """The rules a request for ``model`` is under (cached: model names repeat)."""
        name = model or ""
        found = self._applying.get(name)
        if found is None:
            found = tuple(rule for rule in self.rules if rule.pattern is None or (
                model is not None and fnmatch.fnmatchcase(model, rule.pattern)))
            # Model names come from clients: what is kept is bounded.
            if len(self._applying) >= MAX_CACHED_MODELS:
                self._applying.clear()
            self._applying[name] = found
        return found

    def plan(self, key: str, model: str | None, scope: str = "limits") -> Plan | None:
        """What a request by ``key`` for ``model`` takes (:func:`plan`), or None when no
        limit applies; made once per model (cached like :meth:`applying`)."""
        found = self._plans.get((key, model or ""))
        if found is None:
            rules = self.applying(model)
            if not rules:
                return None
            if len(self._plans) >= MAX_CACHED_MODELS:
                self._plans.clear()
            found = self._plans[key, model or ""] = plan(key, rules, scope)
        return found


def upstream_model(backend, model: str | None) -> str | None:
    """The model a request's limits are decided by: as it goes upstream, after ``backend``'s
    rename (docs/accounting.md), not the client's name for it, so that an alias is no way
    around a model pattern's limit."""
    if backend is not None and backend.rename and model is not None:
        return backend.upstream_model(model) or model
    return model


def effective(default: dict | None, own: dict | None) -> Limits | None:
    return Limits.of(overlay(default, own))


# --- one request ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Limit:
    """What one counter or slot stands for: the rule and which of its limits."""

    rule: Rule
    name: str  # requests_per_minute, ..., concurrent, budget
    limit: int


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """What one request takes (in one :meth:`relay.state.State.take`) and, once answered,
    adds: ``counters`` and ``slots``, what each stands for (``limits``, by counter or slot
    name), and which of the answer's amounts each counter adds (``adds``: ``itpm``,
    ``otpm``, ``usd`` or None)."""

    key: str
    rules: tuple[Rule, ...]
    counters: tuple[Counter, ...]
    slots: tuple[Slot, ...]
    limits: dict[str, Limit]
    adds: tuple[str | None, ...]
    # By position among the counters (a take's counts come in their order): each header
    # family's names and the rate limits it reports, the budgets, and what the answer adds
    # to (kind, position).
    families: tuple[tuple[tuple[str, ...], tuple[int, ...]], ...] = ()
    budgets: tuple[int, ...] = ()
    added: tuple[tuple[str, int], ...] = ()
    # Each counter's limit as a header value, made once.
    limit_texts: tuple[str, ...] = ()


def counter_name(key: str, rule: Rule, kind: str, scope: str = "limits") -> str:
    return f"{scope}:{key}:{rule.pattern or ''}:{kind}"


def plan(key: str, rules: Iterable[Rule], scope: str = "limits") -> Plan:
    """The counters and slots a request under ``rules`` takes. Budgets come first, then
    tokens, then requests, so that a refusal names the limit that lasts longest: the first
    one over is what the state reports. ``scope`` keeps apart the counters of what is
    limited: a relay key's (``limits``) and an upstream credential's (``pool``), whose names
    may be the same."""
    rules = tuple(rules)
    budgets: list[Counter] = []
    tokens: list[Counter] = []
    requests: list[Counter] = []
    slots: list[Slot] = []
    limits: dict[str, Limit] = {}

    def counter(into: list, rule: Rule, name: str, kind: str, per: str, limit: int,
                amount: int) -> None:
        counter = Counter(counter_name(key, rule, kind, scope), per, limit, amount)
        into.append(counter)
        limits[counter.name] = Limit(rule, name, limit)

    for rule in rules:
        if rule.budget_micro_usd is not None and rule.budget_per is not None:
            counter(budgets, rule, "budget", "usd", rule.budget_per, rule.budget_micro_usd, 0)
        if rule.input_tokens_per_minute is not None:
            counter(tokens, rule, "input_tokens_per_minute", "itpm", "minute",
                    rule.input_tokens_per_minute, 0)
        if rule.output_tokens_per_minute is not None:
            counter(tokens, rule, "output_tokens_per_minute", "otpm", "minute",
                    rule.output_tokens_per_minute, 0)
        if rule.requests_per_minute is not None:
            counter(requests, rule, "requests_per_minute", "rpm", "minute",
                    rule.requests_per_minute, 1)
        if rule.concurrent is not None:
            slot = Slot(counter_name(key, rule, "slots", scope), rule.concurrent, SLOT_LEASE)
            slots.append(slot)
            limits[slot.name] = Limit(rule, "concurrent", rule.concurrent)
    counters = (*budgets, *tokens, *requests)
    adds = tuple(kind if kind in ("itpm", "otpm", "usd") else None
                 for kind in (c.name.rsplit(":", 1)[1] for c in counters))
    families: dict[str, list[int]] = {}
    for i, c in enumerate(counters):
        if limits[c.name].name in HEADER_FAMILIES:
            families.setdefault(HEADER_FAMILIES[limits[c.name].name], []).append(i)
    return Plan(key, rules, counters, tuple(slots), limits, adds,
                tuple((FAMILY_HEADERS[family], tuple(at)) for family, at in families.items()),
                tuple(range(len(budgets))),
                tuple((kind, i) for i, kind in enumerate(adds) if kind is not None),
                tuple(str(c.limit) for c in counters))


def spent(plan: Plan, usage) -> list[Counter]:
    """What an answer adds to the windows of ``plan``'s limits, from its usage (the pinned
    fields of :class:`relay.usage.Usage`). Input tokens per minute count fresh input and
    cache writes, not cache reads: Anthropic's own input-token limits count cache reads only
    for a few older models (docs.claude.com/en/api/rate-limits, "cache-aware ITPM")."""
    if usage is None or not plan.added:
        return []
    added = []
    counters = plan.counters
    for kind, at in plan.added:  # only the amounts some limit counts
        if kind == "otpm":
            amount = getattr(usage, "output_tokens", 0) or 0
        elif kind == "usd":
            amount = getattr(usage, "cost_micro_usd", None) or 0
        else:
            amount = (getattr(usage, "input_tokens", 0) or 0) \
                + (getattr(usage, "cache_write_5m_input_tokens", 0) or 0) \
                + (getattr(usage, "cache_write_1h_input_tokens", 0) or 0)
        if amount > 0:
            name, per, limit, _ = counters[at]
            added.append(made(Counter, (name, per, limit, amount)))  # for every answer
    return added


# --- what the client is told --------------------------------------------------------------


@functools.lru_cache(maxsize=64)  # a window's end: the same for a minute, or a month
def rfc3339(epoch: int) -> str:
    """The form the API's ``anthropic-ratelimit-*-reset`` headers take."""
    return datetime.datetime.fromtimestamp(epoch, datetime.timezone.utc).strftime(
        "%Y-%m-%dT%H:%M:%SZ")


def seconds_until(reset: int, now: float) -> int:
    """A ``retry-after``: whole seconds, at least one."""
    return max(1, math.ceil(reset - now))


def quota_headers(plan: Plan, counts: Sequence[Count]) -> dict[str, str]:
    """An answer's quota headers: :func:`rate_headers`, then Claude Code's usage-limit
    headers (``anthropic-ratelimit-unified-*``) for the fullest budget the request is under,
    in the shape its gateway contract gives for a gateway's own spend cap
    (docs/accounting.md quotes it): the ``overage`` claim (a calendar budget, not the rolling
    5-hour or 7-day windows the client does time math on), the fraction used kept below 1
    while requests are let through, and the threshold passed, which is what makes the client
    show its notice. A key without a budget has none of those."""
    headers = rate_headers(plan, counts)
    if plan.budgets:
        fullest = _fullest(plan, counts)
        if fullest is not None:
            headers.update(_budget_headers(math.floor(fullest[0] * 100), fullest[1].reset))
    return headers


def rate_headers(plan: Plan, counts: Sequence[Count]) -> dict[str, str]:
    """``anthropic-ratelimit-{requests,input-tokens,output-tokens}-{limit,remaining,reset}``
    from the key's own counts (in the order of ``plan.counters``), as the API sends its own:
    for each family, the limit with the least left. A family the key has no limit for is
    not sent."""
    headers: dict[str, str] = {}
    texts = plan.limit_texts
    for names, indexes in plan.families:
        at = indexes[0]
        _, used, limit, reset = counts[at]
        left = (limit or 0) - used
        if left < 0:
            left = 0
        if len(indexes) > 1:  # a key's own limit and a model pattern's: the least left
            for index in indexes[1:]:
                other = counts[index]
                other_left = max(0, (other.limit or 0) - other.used)
                if other_left < left:
                    at, reset, left = index, other.reset, other_left
        headers[names[0]] = texts[at]
        headers[names[1]] = str(left)
        headers[names[2]] = rfc3339(reset)
    return headers


def _fullest(plan: Plan, counts: Sequence[Count]) -> tuple[float, Count] | None:
    best = None
    for index in plan.budgets:
        count = counts[index]
        if not count.limit:
            continue
        used = count.used / count.limit
        if best is None or used > best[0] or (used == best[0] and count.reset > best[1].reset):
            best = (used, count)
    return best


@functools.lru_cache(maxsize=256)  # the same for every request until a whole cent of 100 moves
def _budget_headers(percent: int, reset: int) -> dict[str, str]:
    used = percent / 100
    status = "allowed_warning" if used >= THRESHOLDS[-1] else "allowed"
    headers = {
        "anthropic-ratelimit-unified-status": status,
        "anthropic-ratelimit-unified-representative-claim": "overage",
        "anthropic-ratelimit-unified-overage-status": status,
        "anthropic-ratelimit-unified-overage-utilization": f"{min(0.99, used):.2f}",
        "anthropic-ratelimit-unified-reset": str(reset),
        "anthropic-ratelimit-unified-overage-reset": str(reset),
    }
    passed = next((t for t in THRESHOLDS if used >= t), None)
    if passed is not None:
        headers["anthropic-ratelimit-unified-overage-surpassed-threshold"] = f"{passed:.2f}"
    return headers


def dollars(usd: float) -> str:
    return f"${usd:,.2f}" if usd >= 0.01 or usd == 0 else f"${usd:g}"


def refusal(plan: Plan, counts: Sequence[Count], blocked: str, now: float
            ) -> tuple[RelayError, dict[str, str]]:
    """The 429 for a request the state refused (``blocked``: the counter or slot that did),
    and the headers it goes with.

    A budget: ``billing_error`` with the shape Claude Code's gateway contract gives for a
    spend cap reached (``retry-after`` until the reset, ``x-should-retry: false`` so that no
    client retries into it, ``-unified-status: rejected``; the claim left off, so that the
    client prints the message as it is). Any other limit: ``rate_limit_error`` with the
    key's ``anthropic-ratelimit-*`` headers and ``retry-after``, the seconds until the
    window lets the request through (for ``concurrent``, one: a slot frees when a request
    in flight ends, which the relay cannot foresee)."""
    limit = plan.limits[blocked]
    rule, key = limit.rule, plan.key
    count = next((c for c in counts if c.name == blocked), None)
    if limit.name == "concurrent":
        retry = 1
        message = (f"rate limit: the relay key {key!r} may have {limit.limit} "
                   f"request{'s' if limit.limit != 1 else ''} in flight at once"
                   f"{rule.scope()} (concurrent); retry when one has finished")
        headers = {**rate_headers(plan, counts), "retry-after": str(retry)}
        return RelayError(429, message, "rate_limit_error"), headers
    assert count is not None  # a counter the state refused is among those it returned
    retry = seconds_until(count.reset, now)
    if limit.name == "budget":
        period = rule.budget_per or "month"
        usd = (rule.budget_micro_usd or 0) / 1_000_000
        resets = datetime.datetime.fromtimestamp(count.reset, datetime.timezone.utc)
        message = (f"spend limit reached: the relay key {key!r} has used its "
                   f"{PERIOD_WORDS[period]} budget of {dollars(usd)}{rule.scope()} · resets "
                   f"{resets:%b} {resets.day} {resets:%H:%M} UTC · ask the relay's operator "
                   f"to raise it")
        headers = {
            "retry-after": str(retry),
            "x-should-retry": "false",
            "anthropic-ratelimit-unified-status": "rejected",
            "anthropic-ratelimit-unified-reset": str(count.reset),
            "anthropic-ratelimit-unified-overage-reset": str(count.reset),
            "anthropic-ratelimit-unified-overage-utilization": "1",
            "anthropic-ratelimit-unified-overage-surpassed-threshold": "1",
            "anthropic-ratelimit-unified-overage-period": PERIOD_WORDS[period],
            "anthropic-ratelimit-unified-overage-disabled-reason": "org_spend_cap_reached",
        }
        return RelayError(429, message, "billing_error"), headers
    message = (f"rate limit: the relay key {key!r} may use {limit.limit} "
               f"{RATES[limit.name]}{rule.scope()} ({limit.name}); retry in {retry} s")
    headers = {**rate_headers(plan, counts), "retry-after": str(retry)}
    return RelayError(429, message, "rate_limit_error"), headers
