"""`relay replay DUMP`: rebuild a dumped exchange from its client request alone, and compare.

The rebuild runs the request chain exactly as serving does (:func:`relay.prepare.prepare_exchange`)
with the pipeline, plugin options and backends the dump recorded, or those of ``--config``.
It prints the translation table and the upstream-bound body it got, then a unified diff of
each against the dump. Translation entries made on the way back (direction ``to_client``)
are not compared: the request alone cannot produce them. ``--config`` needs the backends'
``api_key_env`` variables only with ``--send``.

A dump is data that anyone who could write the file may have made: every part of it is
checked before use (by the host's reader, :func:`relay.document.from_document`), and one
that is not what the dump plugin writes (wrong types, header values with line breaks, a body
cut short by ``max_body_bytes``) is refused with a message.
Exit status: 0 identical, 1 different, 2 unusable input (or a ``--send`` that could not
reach the backend).

``--send`` sends the rebuilt request to a backend of the current configuration (``--config``,
else ``./relay.yaml``), which then also serves for the rebuild: never to a URL the dump
names. It goes through the same seam as serving (:class:`relay.upstream.Upstream`): the path
and query are checked as the server checks a client's and joined under the backend URL's
path, the target is printed before anything is sent, and a redirect is printed, not
followed. Credentials are never in a dump: the backend's ``api_key_env`` key is used when it
has one (a pool's: one of its ``credentials``, as serving chooses), else the client key in
``$RELAY_REPLAY_API_KEY`` (sent the way the client sent its own), else none.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import difflib
import logging
import os
import sys

import aiohttp
import orjson
from multidict import CIMultiDict

from . import config as config_module
from . import document as record
from .chain import Chain, load_plugins
from .document import REDACTED, pretty, printable, shown
from .errors import ConfigError, RelayError
from .exchange import Exchange, is_credential_header
from .inbound import check_target
from .prepare import ENDPOINTS, Preparation, prepare_exchange
from .redact import redact, secrets_of
from .upstream import Unreachable, Upstream, upstream_url

log = logging.getLogger("relay.replay")

API_KEY_VARIABLE = "RELAY_REPLAY_API_KEY"
DEFAULT_CONFIG = "relay.yaml"

# A dump is read by the host's reader (relay.document), whose refusals are this command's.
UnusableDump = record.DocumentError


@dataclasses.dataclass
class ClientRequest:
    method: str
    path: str
    query: str
    headers: CIMultiDict  # without the credential headers, which a dump holds redacted
    raw_body: bytes
    credentials: frozenset = frozenset()  # the credential headers the client sent, by name


@dataclasses.dataclass
class Result:
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
                             "print its answer (key: the backend's api_key_env or a "
                             f"credential of its pool, else ${API_KEY_VARIABLE})")


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
        check_endpoint(dump)
        exchange = record.from_document(dump)
        request = client_request(exchange)
        recorded = recorded_result(exchange)
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


async def _replay(args, config_path, dump: dict, request: ClientRequest, recorded: Result,
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
        # Never a password in its URL (the Basic credentials it sends).
        print(printable(f"backend: {exchange.backend.name} "
                        f"({record.redact_url(exchange.backend.url)})"))
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
    return record.load(raw)


def check_endpoint(dump: dict) -> None:
    """Only the Messages API's own requests are rebuilt: a dump may name any path."""
    part = dump["client_request"]
    path = part.get("path")
    if not isinstance(path, str) or path not in ENDPOINTS:
        raise UnusableDump(f"client_request.path: {shown(path)} is not a Messages API endpoint "
                           f"({', '.join(ENDPOINTS)})")
    method = part.get("method") or "POST"
    if method != "POST":
        raise UnusableDump(f"client_request.method: {shown(method)}, but {path} takes POST only")


def client_request(recorded: Exchange) -> ClientRequest:
    """The client's request as the dump recorded it, less the credentials it holds redacted
    (by name, for ``--send``)."""
    headers: CIMultiDict = CIMultiDict()
    credentials = set()
    for name, value in recorded.client_headers.items():
        if is_credential_header(name) or value == REDACTED:
            credentials.add(name.lower())
        else:
            headers.add(name, value)
    return ClientRequest(method=recorded.method, path=recorded.path, query=recorded.query,
                         headers=headers, raw_body=recorded.raw_body,
                         credentials=frozenset(credentials))


def recorded_result(recorded: Exchange) -> Result:
    sent = recorded.upstream_request
    error = recorded.error
    return Result(translation=recorded.translation,
                  upstream_body=sent.body if sent is not None else None,
                  relay_error=None if sent is not None or error is None else {
                      "status": error.status, "type": error.type, "message": error.message})


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
        kept = {key: value for key, value in backend.items()
                if key != "api_key_env" and value is not None}
        if isinstance(kept.get("url"), str):
            kept["url"] = _without_userinfo(kept["url"])
        backends.append(kept)
    pipeline = part.get("pipeline") or []
    if isinstance(pipeline, list):
        # The dump plugin writes only when an exchange ends, which no rebuild does: started,
        # all it would do is its retention, scanning the dumped dir and deleting the dumps
        # the dumped max_files and max_bytes leave over (at a look at a dump in the console).
        pipeline = [name for name in pipeline if name != "dump"]
    raw = {"pipeline": pipeline, "plugins": part.get("plugins") or {}, "backends": backends}
    try:
        return config_module.parse(raw, env={})
    except ConfigError as e:
        raise UnusableDump(f"config: {e}") from None
    except (TypeError, ValueError) as e:  # values no relay.yaml could hold (a bad IPv6 URL)
        raise UnusableDump(f"config: {type(e).__name__} {e}") from None


def _without_userinfo(url: str) -> str:
    """A dumped backend URL without its ``user:[redacted]@``: a rebuild sends nothing, and
    urlsplit reads the brackets of ``[redacted]`` as an IPv6 host, which it refuses."""
    scheme, sep, rest = url.partition("://")
    ends = [at for at in (rest.find(mark) for mark in "/?#") if at >= 0]
    end = min(ends, default=len(rest))
    return scheme + sep + rest[:end].rpartition("@")[2] + rest[end:]


# --- rebuilding and comparing ---------------------------------------------------------------


async def rebuild_dump(dump: dict) -> tuple[Result, Result]:
    """What the dump recorded and what its client request alone makes now, with the
    pipeline, plugin options and backends the dump recorded: the comparison this command
    prints, for a caller that shows it otherwise (the console). Raises UnusableDump."""
    check_endpoint(dump)
    exchange = record.from_document(dump)
    request = client_request(exchange)
    config = dumped_config(dump)
    try:
        chain = Chain(load_plugins(config.pipeline), config)
        await chain.startup(config)
    except Exception as e:  # the dump's options are data: a plugin may refuse them
        raise UnusableDump(f"the plugins could not start with its options: "
                           f"{type(e).__name__} {e}") from None
    try:
        _, rebuilt = await rebuild(Preparation(config, chain), request)
    finally:
        await chain.shutdown(config)
    return recorded_result(exchange), rebuilt



async def rebuild(state: Preparation, request: ClientRequest):
    """Run the request through the chain as serving does; return (exchange, Result). For a
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
        return refused, Result(
            translation=refused.translation if refused is not None else {},
            upstream_body=None,
            relay_error={"status": error.status, "type": error.type, "message": error.message})
    return exchange, Result(translation=exchange.translation, upstream_body=body,
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


def diff(recorded: Result, rebuilt: Result) -> str:
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
    # What serving redacts from an answer (relay.redact), the output redacts too: an upstream
    # may quote the key it was sent, and this output is pasted into issues. So is a client
    # key taken from the environment.
    secrets = backend.secrets
    if backend.api_key is None and os.environ.get(API_KEY_VARIABLE):
        client_key = os.environ[API_KEY_VARIABLE]
        secrets = secrets_of([client_key, *(s.decode() for s in secrets)])
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
    print(printable(f"\n== sending to {record.redact_url(str(url))} (backend {backend.name} "
                    f"of {source}; redirects are not followed)"), flush=True)
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
        location = answer.headers.get("Location")
        if location is not None:
            location = redact(location.encode(), secrets).decode()
        print(printable(f"(a redirect to {location}: not followed)"))
    print(printable(redact(payload, secrets).decode("utf-8", "replace")))
    return True


def _fail(message: str) -> int:
    print(f"relay: {message}", file=sys.stderr)
    return 2
