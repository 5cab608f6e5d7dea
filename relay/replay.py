"""`relay replay DUMP`: rebuild a dumped exchange from its client request alone, and compare.

The rebuild runs the request chain exactly as serving does (:func:`relay.server.prepare_exchange`)
with the pipeline, plugin options and backends the dump recorded, or those of ``--config``.
It prints the translation table and the upstream-bound body it got, then a unified diff of
each against the dump. Translation entries made on the way back (direction ``to_client``)
are not compared: the request alone cannot produce them. ``--config`` needs the backends'
``api_key_env`` variables only with ``--send``. Exit status: 0 identical, 1 different, 2 unusable input (or a
``--send`` that could not reach the backend).

``--send`` sends the rebuilt request to the backend and prints the answer. Credentials are
never in a dump: the backend's ``api_key_env`` key is used when ``--config`` names one, else
the client key in ``$RELAY_REPLAY_API_KEY`` (sent the way the client sent its own), else none.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import dataclasses
import difflib
import logging
import os
import sys

import aiohttp
import orjson
from multidict import CIMultiDict

from . import config as config_module
from .chain import Chain, load_plugins
from .errors import ConfigError, RelayError
from .exchange import CREDENTIAL_HEADERS
from .server import ENDPOINTS, RelayState, forward_headers, prepare_exchange

log = logging.getLogger("relay.replay")

API_KEY_VARIABLE = "RELAY_REPLAY_API_KEY"


class UnusableDump(Exception):
    """The dump cannot be replayed; the message says why."""


@dataclasses.dataclass
class ClientRequest:
    method: str
    path: str
    query: str
    headers: CIMultiDict
    raw_body: bytes


@dataclasses.dataclass
class Outcome:
    """What the request chain made of a request: the parts a replay compares."""
    translation: dict | None
    upstream_body: bytes | None
    relay_error: dict | None

    def comparable(self) -> dict:
        return {"translation table": request_entries(self.translation),
                "upstream-bound body": _as_json(self.upstream_body),
                "relay error": self.relay_error}


# Entries a plugin made while the answer came back (dedup's ``to_client`` rewrites): the dump
# records them, but a rebuild from the client request alone cannot make them, so they are
# left out of the comparison.
ANSWER_DIRECTIONS = frozenset({"to_client"})


def request_entries(translation):
    """The translation table without its answer-direction entries."""
    if not isinstance(translation, dict):
        return translation
    return {key: entry for key, entry in translation.items()
            if not (isinstance(entry, dict) and entry.get("direction") in ANSWER_DIRECTIONS)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dump", help="a dump file written by the dump plugin")
    parser.add_argument("--config", help="rebuild with this relay.yaml's pipeline, plugin options "
                                         "and backends instead of the ones the dump recorded")
    parser.add_argument("--send", action="store_true",
                        help="send the rebuilt request to the backend and print its answer (key: "
                             f"the backend's api_key_env with --config, else ${API_KEY_VARIABLE})")


def main(args) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        dump = load_dump(args.dump)
        request = client_request(dump)
        recorded = recorded_outcome(dump)
        if args.config:
            config = config_module.load(args.config, require_keys=args.send)
        else:
            config = dumped_config(dump)
        chain = Chain(load_plugins(config.pipeline), config)
    except UnusableDump as e:
        return _fail(f"{args.dump}: {e}")
    except ConfigError as e:
        return _fail(f"config error: {e}")
    return asyncio.run(_replay(args, dump, request, recorded, config, chain))


async def _replay(args, dump: dict, request: ClientRequest, recorded: Outcome, config,
                  chain: Chain) -> int:
    try:
        await chain.startup(config)
    except ConfigError as e:
        return _fail(f"config error: {e}")
    try:
        exchange, rebuilt = await rebuild(RelayState(config, chain), request)
    finally:
        await chain.shutdown(config)

    source = args.config or "the dump"
    print(f"replaying {args.dump}: request {dump.get('request_id')} of {dump.get('time')}, "
          f"pipeline [{', '.join(config.pipeline)}] from {source}")
    if exchange is not None and exchange.backend is not None:
        print(f"backend: {exchange.backend.name} ({exchange.backend.url})")
    print("\n== translation table (rebuilt)")
    print(pretty(rebuilt.translation))
    if rebuilt.relay_error is not None:
        print("\n== relay error (rebuilt)")
        print(pretty(rebuilt.relay_error))
    else:
        print("\n== upstream-bound body (rebuilt)")
        print(pretty(_as_json(rebuilt.upstream_body)))

    skipped = len(recorded.translation or {}) - len(request_entries(recorded.translation) or {}) \
        if isinstance(recorded.translation, dict) else 0
    if skipped:
        print(f"\n(the dump's {skipped} answer-direction translation entr"
              f"{'y is' if skipped == 1 else 'ies are'} not compared: the request alone "
              f"cannot produce them)")
    differences = diff(recorded, rebuilt)
    if differences:
        print("\n== differences from the dump")
        print(differences, end="")
        status = 1
    else:
        print("\n== identical to the dump")
        status = 0

    if args.send:
        if exchange is None or rebuilt.relay_error is not None:
            print("\n--send: nothing to send, the relay refused the rebuilt request",
                  file=sys.stderr)
            return 2
        if not await send(exchange, request, rebuilt.upstream_body,
                          use_backend_key=bool(args.config)):
            return 2
    return status


# --- reading the dump -----------------------------------------------------------------------


def load_dump(name: str) -> dict:
    try:
        with open(name, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise UnusableDump(f"cannot read: {e.strerror or e}") from None
    try:
        dump = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise UnusableDump(f"not valid JSON: {e}") from None
    if not isinstance(dump, dict) or not isinstance(dump.get("client_request"), dict):
        raise UnusableDump("not a relay dump (no client_request)")
    return dump


def body_bytes(section: dict | None, where: str) -> bytes | None:
    """The body stored in a dump section: UTF-8 text under ``body`` or ``body_base64``."""
    if not section:
        return None
    if isinstance(section.get("body_base64"), str):
        try:
            return base64.b64decode(section["body_base64"], validate=True)
        except (binascii.Error, ValueError):
            raise UnusableDump(f"{where}.body_base64: not valid base64") from None
    body = section.get("body")
    if body is None:
        return None
    if not isinstance(body, str):
        raise UnusableDump(f"{where}.body: must be a string")
    return body.encode("utf-8")


def client_request(dump: dict) -> ClientRequest:
    section = dump["client_request"]
    path = section.get("path")
    if path not in ENDPOINTS:
        raise UnusableDump(f"client_request.path: {path!r} is not a Messages API endpoint "
                           f"({', '.join(ENDPOINTS)})")
    raw = body_bytes(section, "client_request")
    if raw is None:
        raise UnusableDump("client_request: no body")
    headers = CIMultiDict()
    for name, value in (section.get("headers") or {}).items():
        for item in (value if isinstance(value, list) else [value]):
            headers.add(str(name), str(item))
    return ClientRequest(method=section.get("method") or "POST", path=path,
                         query=section.get("query") or "", headers=headers, raw_body=raw)


def recorded_outcome(dump: dict) -> Outcome:
    upstream = dump.get("upstream_request")
    return Outcome(translation=dump.get("translation"),
                   upstream_body=body_bytes(upstream, "upstream_request"),
                   relay_error=dump.get("relay_error") if upstream is None else None)


def dumped_config(dump: dict):
    """The recorded pipeline, plugin options and backends, as a validated Config.

    Keys are never in a dump, so ``api_key_env`` is left out: the rebuild needs no key.
    """
    section = dump.get("config")
    if not isinstance(section, dict) or not section.get("backends"):
        raise UnusableDump("config: missing (replay with --config relay.yaml)")
    backends = []
    for backend in section["backends"]:
        if not isinstance(backend, dict):
            raise UnusableDump("config.backends: must be a list of mappings")
        backends.append({key: value for key, value in backend.items()
                         if key != "api_key_env" and value is not None})
    raw = {"pipeline": section.get("pipeline") or [], "plugins": section.get("plugins") or {},
           "backends": backends}
    try:
        return config_module.parse(raw, env={})
    except ConfigError as e:
        raise UnusableDump(f"config: {e}") from None


# --- rebuilding and comparing ---------------------------------------------------------------


async def rebuild(state: RelayState, request: ClientRequest):
    """Run the request through the chain as serving does; return (exchange, Outcome)."""
    try:
        exchange = await prepare_exchange(state, method=request.method, path=request.path,
                                          query=request.query, headers=request.headers,
                                          raw_body=request.raw_body)
    except RelayError as error:
        exchange = getattr(error, "exchange", None)
        return exchange, Outcome(
            translation=exchange.translation if exchange is not None else {},
            upstream_body=None,
            relay_error={"status": error.status, "type": error.type, "message": error.message})
    return exchange, Outcome(translation=exchange.translation,
                             upstream_body=exchange.upstream_body(), relay_error=None)


def _as_json(raw: bytes | None):
    """Parsed JSON when the bytes are JSON (so key order and spacing do not count), else text."""
    if raw is None:
        return None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw.decode("utf-8", "replace")


def pretty(value, sort_keys: bool = False) -> str:
    if isinstance(value, str):
        return value
    option = orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS
    if sort_keys:
        option |= orjson.OPT_SORT_KEYS
    return orjson.dumps(value, option=option, default=str).decode()


def diff(recorded: Outcome, rebuilt: Outcome) -> str:
    """A unified diff (pretty JSON, sorted keys) of every part that differs; "" when none."""
    out = []
    before, after = recorded.comparable(), rebuilt.comparable()
    for part in before:
        if _normalised(before[part]) == _normalised(after[part]):
            continue
        out.extend(difflib.unified_diff(
            (pretty(before[part], sort_keys=True) + "\n").splitlines(keepends=True),
            (pretty(after[part], sort_keys=True) + "\n").splitlines(keepends=True),
            fromfile=f"dump: {part}", tofile=f"replay: {part}"))
    return "".join(out)


def _normalised(value):
    """JSON round trip, so tuples and lists (and similar) compare as the dump stores them."""
    return orjson.loads(orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS, default=str))


# --- sending --------------------------------------------------------------------------------


async def send(exchange, request: ClientRequest, body: bytes, *, use_backend_key: bool) -> bool:
    """Send the rebuilt request to its backend and print the answer; False if it failed."""
    backend = exchange.backend
    headers = CIMultiDict((name, value) for name, value in request.headers.items()
                          if name.lower() not in CREDENTIAL_HEADERS)
    key = backend.api_key if use_backend_key else None
    if key is None and os.environ.get(API_KEY_VARIABLE):
        client_key = os.environ[API_KEY_VARIABLE]
        if "authorization" in request.headers:
            headers["Authorization"] = "Bearer " + client_key
        else:
            headers["x-api-key"] = client_key
    headers = forward_headers(headers, dataclasses.replace(backend, api_key=key))
    url = backend.url + request.path + ("?" + request.query if request.query else "")
    timeout = aiohttp.ClientTimeout(total=backend.timeouts.total, connect=backend.timeouts.connect,
                                    sock_read=backend.timeouts.read)
    print(f"\n== sending to {url}")
    try:
        async with aiohttp.ClientSession(skip_auto_headers=("User-Agent",)) as session:
            async with session.post(url, data=body, headers=headers, timeout=timeout) as answer:
                payload = await answer.read()
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        print(f"relay: could not reach {backend.name}: {type(e).__name__} {e}".rstrip(),
              file=sys.stderr)
        return False
    print(f"== answer: {answer.status}")
    print(payload.decode("utf-8", "replace"))
    return True


def _fail(message: str) -> int:
    print(f"relay: {message}", file=sys.stderr)
    return 2
