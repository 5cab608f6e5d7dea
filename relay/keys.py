"""The relay's own keys: made, changed and revoked while it serves (``relay keys``), kept in
the shared state (:meth:`relay.state.State.put_key`) as the SHA-256 hash of each, never the
key itself, which is shown once, when it is made.

A serving relay (each worker, each replica) reads the keys' version at most once a second,
off the request path (:class:`Watch`), and swaps its table of stored keys when the version
moves: a change is seen within seconds, and a request in flight keeps the key it came in
with. Keys in relay.yaml (``key_env``, ``key_file``) stand beside the stored ones; their
names may not be taken by a stored key.

Each stored key is a record ``{name, hash, created, expires, revoked, limits}`` (epoch
seconds; ``limits`` in relay.yaml's form, under ``server.auth.default_limits``).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import hashlib
import json
import logging
import re
import secrets
import sys
import time
from typing import Any

import yaml

from . import limits as limits_module
from .config import InboundKey
from .errors import ConfigError
from .state import Count, State, Unavailable, open_state

log = logging.getLogger("relay.keys")

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
PREFIX = "sk-relay-"  # says where a key belongs when it turns up somewhere it should not
POLL_SECONDS = 1.0
WARN_EVERY = 60.0


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8", "surrogateescape")).hexdigest()


def expiry(value) -> float | None:
    """An expiry as epoch seconds, from epoch seconds, a datetime (naive: UTC) or date, or
    an ISO 8601 string (``2027-01-31``, ``2027-01-31T18:00:00+01:00``); a date is its
    midnight UTC: the key works until that day begins."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"expires: {value!r} is not a date")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            value = datetime.datetime.fromisoformat(value.strip())
        except ValueError:
            raise ValueError(f"expires: {value!r} is not an ISO 8601 date or time "
                             f"(2027-01-31, 2027-01-31T18:00:00Z)") from None
    if isinstance(value, datetime.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=datetime.timezone.utc)
        return value.timestamp()
    if isinstance(value, datetime.date):
        return float(datetime.datetime(value.year, value.month, value.day,
                                       tzinfo=datetime.timezone.utc).timestamp())
    raise ValueError(f"expires: {value!r} is not a date")


def _name(name: str) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(f"key name {name!r}: letters, digits, '.', '_' and '-', at most 64, "
                         f"starting with a letter or digit")
    return name


async def _find(state: State, name: str) -> dict[str, Any]:
    _, records = await state.keys()
    for record in records:
        if record.get("name") == name:
            return record
    raise LookupError(f"no key named {name!r}")


async def create_key(state: State, name: str, limits: dict | None = None,
                     expires=None) -> str:
    """Store a new key named ``name`` (with ``limits`` in relay.yaml's form, checked, and an
    ``expires`` instant, see :func:`expiry`) and return it: the only time it is shown. A
    revoked key's name may be used again."""
    _name(name)
    checked = limits_module.check_limits(limits, "limits")
    until = expiry(expires)
    _, records = await state.keys()
    if any(r.get("name") == name and not r.get("revoked") for r in records):
        raise ValueError(f"a key named {name!r} exists: revoke it first, or change its limits "
                         f"with `relay keys set`")
    secret = PREFIX + secrets.token_urlsafe(32)
    await state.put_key({"name": name, "hash": digest(secret), "created": time.time(),
                         "expires": until, "revoked": None, "limits": checked})
    return secret


async def revoke_key(state: State, name: str) -> None:
    """Revoke the key named ``name``: refused (401) everywhere within seconds."""
    record = await _find(state, name)
    if not record.get("revoked"):
        await state.put_key({**record, "revoked": time.time()})


async def set_limits(state: State, name: str, limits: dict | None) -> None:
    """Replace the limits of the key named ``name`` (None: only the defaults)."""
    record = await _find(state, name)
    await state.put_key({**record, "limits": limits_module.check_limits(limits, "limits")})


async def list_keys(state: State) -> list[dict[str, Any]]:
    """The stored keys, oldest first: name, created, expires, revoked, limits (never the
    hash, never the key)."""
    _, records = await state.keys()
    return [{field: record.get(field) for field in ("name", "created", "expires", "revoked",
                                                     "limits")}
            for record in sorted(records, key=lambda r: r.get("created") or 0)]


def stored(records, default_limits: dict | None, taken=()) -> dict[bytes, InboundKey]:
    """The keys a relay accepts from the stored ``records``, by digest: not revoked, not
    named like a relay.yaml key (``taken``), each with its limits over the defaults."""
    table: dict[bytes, InboundKey] = {}
    for record in records:
        name = record.get("name")
        if record.get("revoked") or not record.get("hash"):
            continue
        if name in taken:
            log.warning("stored key %r is left out: relay.yaml has a key of that name", name)
            continue
        try:
            key_limits = limits_module.effective(default_limits, record.get("limits"))
            table[bytes.fromhex(record["hash"])] = InboundKey(
                name=name, secret="", limits=key_limits, expires=record.get("expires"))
        except (ValueError, ConfigError) as e:  # written by hand, or by a newer relay
            log.warning("stored key %r is left out: %s", name, e)
    return table


class Watch:
    """Keeps a :class:`relay.inbound.Gate`'s stored keys up to date with the state."""

    def __init__(self, gate, state: State, default_limits: dict | None,
                 interval: float = POLL_SECONDS):
        self.gate = gate
        self.state = state
        self.default_limits = default_limits
        self.interval = interval
        self.version: int | None = None
        self._warned = 0.0

    async def load(self) -> None:
        version, records = await self.state.keys()
        table = stored(records, self.default_limits, self.gate.configured_names)
        if self.version is not None and version < self.version:
            # Only a store that lost what it held counts back; without a word, its keys
            # would just start failing with 401.
            gone = len(self.gate.stored.keys() - table.keys())
            log.warning("keys: the state's keys version went back from %d to %d: it lost "
                        "what it held (a Redis restarted without persistence, a state file "
                        "deleted?); %d stored key(s) no longer there are refused until made "
                        "again", self.version, version, gone)
        self.gate.replace(table)
        self.version = version

    async def poll(self) -> None:
        """Once: reload when the keys' version moved. The state unreachable: the table
        stays as it is."""
        try:
            if self.version is None or await self.state.keys_version() != self.version:
                await self.load()
        except Unavailable as e:
            now = time.monotonic()
            if now - self._warned >= WARN_EVERY:
                self._warned = now
                log.warning("keys: the state is unreachable; serving with the keys as last "
                            "read (%s)", e)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.poll()
            except Exception:
                log.exception("keys: reading the stored keys failed")


def watching(gate, state: State, default_limits: dict | None):
    """An aiohttp ``cleanup_ctx`` entry: the stored keys loaded before serving, then
    watched until the app stops."""
    async def context(app):
        watch = Watch(gate, state, default_limits)
        await watch.poll()
        task = asyncio.get_running_loop().create_task(watch.run())
        yield
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
    return context


# --- relay keys -----------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", default="relay.yaml",
                        help="relay.yaml, whose state: section says where the keys live")
    actions = parser.add_subparsers(dest="action", required=True)

    def action(name: str, help: str) -> argparse.ArgumentParser:
        return actions.add_parser(name, help=help, parents=[common])

    create = action("create", "make a key and print it (once)")
    create.add_argument("name")
    create.add_argument("--limits", help="its limits, as YAML or JSON ('{requests_per_minute: "
                                         "50, budget: {usd: 20, per: day}}')")
    create.add_argument("--expires", metavar="DATE",
                        help="when it stops working (ISO 8601: 2027-01-31, a date's midnight "
                             "UTC, or 2027-01-31T18:00:00Z)")
    listing = action("list", "every key, with its usage against its limits")
    listing.add_argument("--json", action="store_true", help="a JSON list")
    revoke = action("revoke", "revoke a key")
    revoke.add_argument("name")
    change = action("set", "replace a key's limits")
    change.add_argument("name")
    change.add_argument("--limits", required=True, help="as for create ('null': the defaults)")


def parse_limits(text: str | None) -> dict | None:
    if text is None:
        return None
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"--limits: not YAML or JSON: {e}") from None
    except RecursionError:  # the parser recurses once a level: "[[[[..." deep enough
        raise ValueError("--limits: not YAML or JSON: nested too deeply") from None
    if value is not None and not isinstance(value, dict):
        raise ValueError("--limits: must be a mapping, like '{requests_per_minute: 50}'")
    return value


def main(args) -> int:
    from . import config as config_module
    try:
        config = config_module.load(args.config, require_keys=False)
    except ConfigError as e:
        print(f"relay keys: config error: {e}", file=sys.stderr)
        return 2
    if not config.state.get("url"):
        print("relay keys: state.url is not set in " + args.config + ": keys made here would "
              "live only in this command's memory. Set state.url (sqlite:///PATH for one host, "
              "redis://HOST:PORT/DB for several)", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_run(args, config))
    except (ValueError, LookupError, ConfigError) as e:
        print(f"relay keys: {e.args[0] if e.args else e}", file=sys.stderr)
        return 1
    except Unavailable as e:
        print(f"relay keys: the state cannot be reached: {e}", file=sys.stderr)
        return 1


async def _run(args, config) -> int:
    state = await open_state(config.state)
    try:
        configured = {key.name for key in config.keys or ()}
        if args.action == "create":
            if args.name in configured:
                raise ValueError(f"{args.name!r} is a key in {args.config} already")
            secret = await create_key(state, args.name, parse_limits(args.limits), args.expires)
            print(secret)
            print(f"relay keys: {args.name!r} made; the key above is shown only now",
                  file=sys.stderr)
        elif args.action == "revoke":
            await revoke_key(state, args.name)
            print(f"relay keys: {args.name!r} revoked", file=sys.stderr)
        elif args.action == "set":
            await set_limits(state, args.name, parse_limits(args.limits))
            print(f"relay keys: {args.name!r} has new limits", file=sys.stderr)
        else:
            rows = await listing(state, config)
            if args.json:
                print(json.dumps(rows, indent=2))
            else:
                print(table(rows))
        return 0
    finally:
        await state.close()


async def listing(state: State, config) -> list[dict[str, Any]]:
    """Every key (relay.yaml's and the stored ones), each with its usage in the current
    window of each of its limits, read from the counters."""
    rows: list[dict[str, Any]] = []
    for key in config.keys or ():
        # relay.yaml holds its keys' limits already laid over the defaults.
        rows.append({"name": key.name, "source": "relay.yaml", "created": None,
                     "expires": None, "revoked": None,
                     "limits": key.limits.raw if key.limits is not None else None,
                     "_limits": key.limits})
    for record in await list_keys(state):
        rows.append({**record, "source": "stored", "_limits": limits_module.effective(
            config.default_limits, record["limits"])})
    now = time.time()
    for row in rows:
        key_limits = row.pop("_limits")
        row["effective_limits"] = key_limits.raw if key_limits is not None else None
        row["status"] = ("revoked" if row["revoked"] else
                         "expired" if row["expires"] is not None and row["expires"] <= now
                         else "active")
        row["usage"] = await usage(state, row["name"], key_limits)
    return rows


async def usage(state: State, name: str, key_limits) -> list[dict[str, Any]]:
    """Each limit of a key with what its current window holds: ``{limit, models, used, of,
    reset}`` (a budget's in micro-dollars; ``concurrent`` is not counted here)."""
    if key_limits is None:
        return []
    plan = limits_module.plan(name, key_limits.rules)
    counts: list[Count] = await state.counts(plan.counters) if plan.counters else []
    return [{"limit": plan.limits[count.name].name, "models": plan.limits[count.name].rule.pattern,
             "used": count.used, "of": count.limit, "reset": count.reset} for count in counts]


def _when(epoch) -> str:
    if epoch is None:
        return "-"
    return datetime.datetime.fromtimestamp(epoch, datetime.timezone.utc).strftime(
        "%Y-%m-%d %H:%M")


SHORT = {"requests_per_minute": "rpm", "input_tokens_per_minute": "in/min",
         "output_tokens_per_minute": "out/min", "budget": "budget"}


def _used(entry: dict) -> str:
    scope = f"[{entry['models']}]" if entry["models"] else ""
    if entry["limit"] == "budget":
        return f"{SHORT['budget']}{scope} ${entry['used'] / 1e6:,.2f}/${entry['of'] / 1e6:,.2f}"
    return f"{SHORT[entry['limit']]}{scope} {entry['used']}/{entry['of']}"


def table(rows: list[dict[str, Any]]) -> str:
    header = ("NAME", "SOURCE", "STATUS", "CREATED", "EXPIRES", "USAGE")
    lines = [header] + [(row["name"], row["source"], row["status"], _when(row["created"]),
                         _when(row["expires"]), ", ".join(map(_used, row["usage"])) or "-")
                        for row in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line[:-1], widths,
                                                                          strict=True))
                     + "  " + line[-1] for line in lines)
