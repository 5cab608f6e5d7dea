"""`relay replay DUMP`: rebuild a dumped exchange from its client request alone, and compare.

The rebuild runs the request chain exactly as serving does (:func:`relay.prepare.prepare_exchange`)
with the pipeline, plugin options and backends the dump recorded, or those of ``--config``.
It prints the translation table and the upstream-bound body it got, then a unified diff of
each against the dump. Translation entries made on the way back (direction ``to_client``)
are not compared: the request alone cannot produce them. ``--config`` needs the backends'
``api_key_env`` variables only with ``--send``.

A dump is data that anyone who could write the file may have made: every part of it is
checked before use, and one that is not what the dump plugin writes (wrong types, header
values with line breaks, a body cut short by ``max_body_bytes``) is refused with a message.
Exit status: 0 identical, 1 different, 2 unusable input (or a ``--send`` that could not
reach the backend).

``--send`` sends the rebuilt request to a backend of the current configuration (``--config``,
else ``./relay.yaml``), which then also serves for the rebuild: never to a URL the dump
names. It goes through the same seam as serving (:class:`relay.upstream.Upstream`): the path
and query are checked as the server checks a client's and joined under the backend URL's
path, the target is printed before anything is sent, and a redirect is printed, not
followed. Credentials are never in a dump: the backend's ``api_key_env`` key is used when it
has one, else the client key in ``$RELAY_REPLAY_API_KEY`` (sent the way the client sent its
own), else none.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import dataclasses
import difflib
import json
import logging
import os
import re
import sys

import aiohttp
import orjson
from multidict import CIMultiDict

from . import config as config_module
from .chain import Chain, load_plugins
from .errors import ConfigError, RelayError
from .exchange import is_credential_header
from .inbound import check_target
from .prepare import ENDPOINTS, Preparation, prepare_exchange
from .upstream import Unreachable, Upstream, upstream_url

log = logging.getLogger("relay.replay")

API_KEY_VARIABLE = "RELAY_REPLAY_API_KEY"
DEFAULT_CONFIG = "relay.yaml"
FORMATS = (1, 2)
REDACTED = "[redacted]"
HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")  # RFC 9110 token
# Any control character but tab: a line break in a value would forge a header when sent.
CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
# What is printed of a dump goes to a terminal: no control sequences but newline and tab.
UNPRINTABLE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
# Everything visible in ASCII but "#" stays as the dump has it (percent escapes included);
# the rest is percent-encoded, so the query cannot end early or reach the path.


class UnusableDump(Exception):
    """The dump cannot be replayed; the message says why."""


@dataclasses.dataclass
class ClientRequest:
    method: str
    path: str
    query: str
    headers: CIMultiDict  # without the credential headers, which a dump holds redacted
    raw_body: bytes
    credentials: frozenset = frozenset()  # the credential headers the client sent, by name


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
            if not (isinstance(entry, dict) and isinstance(entry.get("direction"), str)
                    and entry["direction"] in ANSWER_DIRECTIONS)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dump", help="a dump file written by the dump plugin")
    parser.add_argument("--config", help="rebuild with this relay.yaml's pipeline, plugin options "
                                         "and backends instead of the ones the dump recorded")
    parser.add_argument("--send", action="store_true",
                        help="send the rebuilt request to the backend of the current config "
                             f"(--config, else ./{DEFAULT_CONFIG}; never a URL from the dump) and "
                             "print its answer (key: the backend's api_key_env, else "
                             f"${API_KEY_VARIABLE})")


def main(args) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    config_path = args.config
    if args.send and config_path is None:
        if not os.path.isfile(DEFAULT_CONFIG):
            return _fail(f"--send needs the current configuration (--config relay.yaml, or a "
                         f"./{DEFAULT_CONFIG}): it sends only to a backend configured there, "
                         f"never to a URL the dump names")
        config_path = DEFAULT_CONFIG
    try:
        dump = load_dump(args.dump)
        request = client_request(dump)
        recorded = recorded_outcome(dump)
        if config_path:
            config = config_module.load(config_path, require_keys=args.send)
        else:
            config = dumped_config(dump)
        chain = Chain(load_plugins(config.pipeline), config)
    except UnusableDump as e:
        return _fail(f"{printable(args.dump)}: {e}")
    except ConfigError as e:
        return _fail(f"config error: {e}")
    return asyncio.run(_replay(args, config_path, dump, request, recorded, config, chain))


async def _replay(args, config_path, dump: dict, request: ClientRequest, recorded: Outcome,
                  config, chain: Chain) -> int:
    try:
        await chain.startup(config)
    except ConfigError as e:
        return _fail(f"config error: {e}")
    except Exception as e:  # a plugin's own check missed options a dump may hold
        return _fail(f"config error: the plugins could not start with these options: "
                     f"{type(e).__name__} {e}")
    try:
        exchange, rebuilt = await rebuild(Preparation(config, chain), request)
    finally:
        await chain.shutdown(config)

    source = config_path or "the dump"
    print(printable(f"replaying {args.dump}: request {dump.get('request_id')} of "
                    f"{dump.get('time')}, pipeline [{', '.join(config.pipeline)}] from {source}"))
    if exchange is not None and exchange.backend is not None:
        print(printable(f"backend: {exchange.backend.name} ({exchange.backend.url})"))
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
        if not await send(config, exchange, request, rebuilt.upstream_body, source):
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
    version = dump.get("dump_format", 1)
    if version not in FORMATS or isinstance(version, bool):
        raise UnusableDump(f"dump_format: {shown(version)} is not one this relay reads "
                           f"({', '.join(map(str, FORMATS))})")
    return dump


def section(dump: dict, key: str, required: bool = False) -> dict | None:
    value = dump.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, dict):
        raise UnusableDump(f"{key}: must be a mapping, not {type_name(value)}")
    return value


def body_bytes(part: dict | None, where: str, client_body: bytes | None = None) -> bytes | None:
    """The body stored in a dump section: UTF-8 text under ``body``, ``body_base64``, or
    ``body_same_as`` the client's."""
    if not part:
        return None
    if part.get("body_truncated") is not None:
        cut = part["body_truncated"]
        kept = (f" (the first {shown(cut.get('kept_bytes'))} of {shown(cut.get('total_bytes'))} "
                f"bytes)" if isinstance(cut, dict) else "")
        raise UnusableDump(f"{where}.body was truncated when dumped{kept}, beyond "
                           f"plugins.dump.max_body_bytes: a truncated dump cannot be replayed")
    if part.get("body_same_as") is not None:
        if part["body_same_as"] != "client_request" or client_body is None:
            raise UnusableDump(f"{where}.body_same_as: must be \"client_request\"")
        return client_body
    if part.get("body_base64") is not None:
        if not isinstance(part["body_base64"], str):
            raise UnusableDump(f"{where}.body_base64: must be a string")
        try:
            return base64.b64decode(part["body_base64"], validate=True)
        except (binascii.Error, ValueError):
            raise UnusableDump(f"{where}.body_base64: not valid base64") from None
    body = part.get("body")
    if body is None:
        return None
    if not isinstance(body, str):
        raise UnusableDump(f"{where}.body: must be a string")
    return body.encode("utf-8")


def request_headers(value, where: str) -> tuple[CIMultiDict, frozenset]:
    """The recorded headers without the credential ones (redacted in a dump), and the names
    of those."""
    if value is None:
        return CIMultiDict(), frozenset()
    if not isinstance(value, dict):
        raise UnusableDump(f"{where}: must be a mapping of name to value, not {type_name(value)}")
    headers, credentials = CIMultiDict(), set()
    for name, values in value.items():
        if not HEADER_NAME.match(name):
            raise UnusableDump(f"{where}: {shown(name)} is not a header name")
        for item in (values if isinstance(values, list) else [values]):
            if not isinstance(item, str):
                raise UnusableDump(f"{where}.{name}: must be a string or a list of strings, "
                                   f"not {type_name(item)}")
            if CONTROL.search(item):
                raise UnusableDump(f"{where}.{name}: holds a line break or another control "
                                   f"character")
            if is_credential_header(name) or item == REDACTED:
                credentials.add(name.lower())
            else:
                headers.add(name, item)
    return headers, frozenset(credentials)


def client_request(dump: dict) -> ClientRequest:
    part = section(dump, "client_request", required=True)
    path = part.get("path")
    if not isinstance(path, str) or path not in ENDPOINTS:
        raise UnusableDump(f"client_request.path: {shown(path)} is not a Messages API endpoint "
                           f"({', '.join(ENDPOINTS)})")
    method = part.get("method") or "POST"
    if method != "POST":
        raise UnusableDump(f"client_request.method: {shown(method)}, but {path} takes POST only")
    query = part.get("query") or ""
    if not isinstance(query, str):
        raise UnusableDump(f"client_request.query: must be a string, not {type_name(query)}")
    raw = body_bytes(part, "client_request")
    if raw is None:
        raise UnusableDump("client_request: no body")
    headers, credentials = request_headers(part.get("headers"), "client_request.headers")
    return ClientRequest(method=method, path=path, query=query, headers=headers, raw_body=raw,
                         credentials=credentials)


def recorded_outcome(dump: dict) -> Outcome:
    upstream = section(dump, "upstream_request")
    translation = dump.get("translation")
    if translation is not None and not isinstance(translation, dict):
        raise UnusableDump(f"translation: must be a mapping, not {type_name(translation)}")
    client_body = body_bytes(dump["client_request"], "client_request")
    return Outcome(translation=translation,
                   upstream_body=body_bytes(upstream, "upstream_request", client_body),
                   relay_error=section(dump, "relay_error") if upstream is None else None)


def dumped_config(dump: dict):
    """The recorded pipeline, plugin options and backends, as a validated Config.

    Keys are never in a dump, so ``api_key_env`` is left out: the rebuild needs no key.
    """
    part = dump.get("config")
    if not isinstance(part, dict) or not part.get("backends"):
        raise UnusableDump("config: missing (replay with --config relay.yaml)")
    if not isinstance(part["backends"], list):
        raise UnusableDump("config.backends: must be a list of mappings")
    backends = []
    for backend in part["backends"]:
        if not isinstance(backend, dict):
            raise UnusableDump("config.backends: must be a list of mappings")
        backends.append({key: value for key, value in backend.items()
                         if key != "api_key_env" and value is not None})
    raw = {"pipeline": part.get("pipeline") or [], "plugins": part.get("plugins") or {},
           "backends": backends}
    try:
        return config_module.parse(raw, env={})
    except ConfigError as e:
        raise UnusableDump(f"config: {e}") from None
    except (TypeError, ValueError) as e:  # values no relay.yaml could hold (a bad IPv6 URL)
        raise UnusableDump(f"config: {type(e).__name__} {e}") from None


def type_name(value) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean",
            int: "a number", float: "a number", type(None): "null"}.get(type(value), "a value")


def shown(value, limit: int = 80) -> str:
    """A value from the dump, short and printable, for a message."""
    text = repr(value) if isinstance(value, str) else pretty(value)
    return printable(text if len(text) <= limit else text[:limit] + "...")


def printable(text: str) -> str:
    """``text`` without the control characters a terminal would act on."""
    return UNPRINTABLE.sub(lambda m: f"\\x{ord(m.group()):02x}", str(text))


# --- rebuilding and comparing ---------------------------------------------------------------


async def rebuild(state: Preparation, request: ClientRequest):
    """Run the request through the chain as serving does; return (exchange, Outcome). For a
    backend whose format translates, the upstream-bound body is the translated one, as it
    went up."""
    try:
        exchange = await prepare_exchange(state, method=request.method, path=request.path,
                                          query=request.query, headers=request.headers,
                                          raw_body=request.raw_body)
        body = exchange.upstream_body()
        body = exchange.backend.adapter.request_body(body, exchange.backend, exchange.endpoint)
    except RelayError as error:
        refused = error.exchange
        return refused, Outcome(
            translation=refused.translation if refused is not None else {},
            upstream_body=None,
            relay_error={"status": error.status, "type": error.type, "message": error.message})
    return exchange, Outcome(translation=exchange.translation, upstream_body=body,
                             relay_error=None)


def _as_json(raw: bytes | None):
    """Parsed JSON when the bytes are JSON that encodes back (so key order and spacing do not
    count), else text."""
    if raw is None:
        return None
    try:
        value = orjson.loads(raw)
        orjson.dumps(value)  # nested too deeply to show: compared as text instead
        return value
    except (orjson.JSONDecodeError, orjson.JSONEncodeError):
        return raw.decode("utf-8", "replace")


def pretty(value, sort_keys: bool = False) -> str:
    """JSON for people; what the JSON encoder refuses (integers beyond 64 bits, deep nesting
    in a hand-made dump) through the standard library's, else a note. Never raises."""
    if isinstance(value, str):
        return printable(value)
    option = orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS
    if sort_keys:
        option |= orjson.OPT_SORT_KEYS
    try:
        return printable(orjson.dumps(value, option=option, default=str).decode())
    except orjson.JSONEncodeError:
        pass
    try:
        return printable(json.dumps(value, indent=2, sort_keys=sort_keys, default=str,
                                    ensure_ascii=False))
    except (TypeError, ValueError, RecursionError) as e:
        return f"(cannot be shown: {type(e).__name__})"


def diff(recorded: Outcome, rebuilt: Outcome) -> str:
    """A unified diff (pretty JSON, sorted keys) of every part that differs; "" when none."""
    out: list[str] = []
    before, after = recorded.comparable(), rebuilt.comparable()
    for part in before:
        # Printed the same is the same: tuples and lists, say, as the dump stores them.
        old, new = pretty(before[part], sort_keys=True), pretty(after[part], sort_keys=True)
        if old == new:
            continue
        out.extend(difflib.unified_diff(
            (old + "\n").splitlines(keepends=True), (new + "\n").splitlines(keepends=True),
            fromfile=f"dump: {part}", tofile=f"replay: {part}"))
    return "".join(out)


# --- sending --------------------------------------------------------------------------------


async def send(config, exchange, request: ClientRequest, body: bytes, source: str) -> bool:
    """Send the rebuilt request to its backend (of the current config) through the same seam
    serving uses (:class:`relay.upstream.Upstream`: the path checked and joined under the
    backend's base URL, its key, its timeouts and retries, no redirects) and print the
    answer; False if it could not be sent."""
    backend = exchange.backend
    headers = request.headers.copy()
    if backend.api_key is None and os.environ.get(API_KEY_VARIABLE):
        client_key = os.environ[API_KEY_VARIABLE]
        if "authorization" in request.credentials:
            headers["Authorization"] = "Bearer " + client_key
        else:
            headers["x-api-key"] = client_key
    try:
        check_target(request.path, request.query)
        # Where Upstream.send sends it.
        url = upstream_url(backend, *backend.adapter.upstream_target(request.path, request.query))
    except RelayError as e:
        print(printable(f"relay: the dump's request cannot be sent: {e.message}"), file=sys.stderr)
        return False
    print(printable(f"\n== sending to {url} (backend {backend.name} of {source}; redirects are "
                    f"not followed)"), flush=True)
    upstream = Upstream(config)
    await upstream.start()
    try:
        answer = await upstream.send(exchange, backend, body=body, headers=headers)
        async with answer:
            payload = await answer.read()
    except (Unreachable, aiohttp.ClientError, asyncio.TimeoutError) as e:
        cause = e.__cause__ or e
        print(printable(f"relay: could not reach {backend.name}: {type(cause).__name__} "
                        f"{cause}".rstrip()), file=sys.stderr)
        return False
    finally:
        await upstream.close()
    print(f"== answer: {answer.status}")
    if 300 <= answer.status < 400:
        print(printable(f"(a redirect to {answer.headers.get('Location')}: not followed)"))
    print(printable(payload.decode("utf-8", "replace")))
    return True


def _fail(message: str) -> int:
    print(f"relay: {message}", file=sys.stderr)
    return 2
