"""Everything before the upstream is called: parse the request, route it, run the request
chain. No ``aiohttp.web`` here: the server, ``relay replay`` and the benchmarks prepare an
exchange the same way, and only the server needs a web server.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import orjson

from . import betas, resume, sessions, skeleton, threads
from .chain import Chain
from .config import Backend, Config, InboundKey
from .errors import RelayError, invalid_request, not_json
from .exchange import Exchange
from .inbound import Gate, forbidden
from .skeleton import Skeleton

log = logging.getLogger("relay")

ENDPOINTS = {"/v1/messages": "messages", "/v1/messages/count_tokens": "count_tokens"}
# Longer than any model name a backend serves; a client's longer name is refused, not routed
# (and not cached).
MAX_MODEL_CHARS = 256


class Preparation:
    """What preparing a request needs, built once: the config, the chain and the store of
    server-held threads (:mod:`relay.threads`)."""

    def __init__(self, config: Config, chain: Chain):
        self.config = config
        self.chain = chain
        state = chain.state
        # Shared with the other workers and replicas when the host's state is.
        self.threads = threads.Store(
            shared=state if state is not None and state.kind != "memory" else None)
        # Where each session's last request ended (relay.resume), when every plugin that
        # walks a request can go on from there.
        self.resume = (resume.Store(config.resume_bytes)
                       if config.resume_bytes > 0 and chain.resumable() else None)
        # The inbound keys (relay.inbound.Gate) when the server authenticates clients.
        self.gate: Gate | None = None

    def tenants(self) -> int:
        """How many inbound keys the relay serves (0 without auth): with several, a thread
        whose key is not known is not forwarded (relay.threads)."""
        return self.gate.tenants if self.gate is not None else 0


def parse_request(raw: bytes) -> Skeleton | dict:
    """The request body as a skeleton (see :mod:`relay.skeleton`), or when it cannot be one,
    fully parsed, or a 400 that says what is wrong with it."""
    if not raw:
        raise invalid_request("request body is empty: expected a JSON object")
    found = skeleton.decode(raw)
    if found is not None:
        return found
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise not_json(e) from None
    if not isinstance(body, dict):
        raise invalid_request("request body must be a JSON object")
    if "messages" not in body:
        raise invalid_request("messages: Field required")
    if not isinstance(body["messages"], list):
        raise invalid_request("messages: Input should be a valid list")
    if not isinstance(body.get("model"), str):
        raise invalid_request("model: Field required" if "model" not in body
                              else "model: Input should be a valid string")
    return body


async def prepare_exchange(state: Preparation, *, method: str, path: str, query: str,
                           headers: Mapping, raw_body: bytes, key: InboundKey | None = None,
                           backend: Backend | None = None, moved: bool = False) -> Exchange:
    """Parse, route and run the request chain: everything before the upstream is called.

    ``key`` is the inbound key the client authenticated with, if auth is on: a backend or
    model it may not use is refused here. ``backend`` overrides routing (a fallback).
    ``moved``: the request's thread is carried, its pooled credential unable to take it
    (:class:`relay.threads.ThreadMoved`). Raises
    RelayError for a request the client must be refused; the exchange it was refused in is
    attached as ``error.exchange`` (when one was built) so the end hooks can see it.
    """
    endpoint = ENDPOINTS[path]
    store = state.resume if endpoint == "messages" and backend is None else None
    if store is None or len(raw_body) < store.min_bytes:
        return await _prepare(state, endpoint, method, path, query, headers, raw_body, key,
                              backend, parse_request(raw_body), moved=moved)
    tenant = key.name if key else None
    session, decoded, resumed, head = None, None, None, None
    if not headers.get(sessions.HEADER):
        # The key comes from the body's content: the records of such sessions are found by
        # the body's bytes instead of by a key worked out from the whole of it.
        head = resume.head(tenant, raw_body)
        session, record, start = store.take_unnamed(head, raw_body)
        if record is not None:
            resumed = resume.decode_from(record, raw_body, start)
            if resumed is None or resumed.end is None:
                # The bytes after its messages are not shown to be the record's (the body
                # only ends as the record's did): its key may not be the record's.
                session, resumed = None, None
    if session is None:
        session, decoded = sessions.session_of(raw_body, headers, tenant)
        record, start = store.take(session, raw_body) if session is not None else (None, 0)
        if record is not None:
            resumed = resume.decode_from(record, raw_body, start)
    if resumed is not None:
        try:
            return await _prepare(state, endpoint, method, path, query, headers, raw_body,
                                  key, backend, resumed.skeleton, (store, session, resumed, head))
        except resume.Decline:
            pass  # walked whole below
    parsed = decoded if decoded is not None else parse_request(raw_body)
    return await _prepare(state, endpoint, method, path, query, headers, raw_body, key, backend,
                          parsed, (store, session, None, head) if session is not None else None)


async def _prepare(state: Preparation, endpoint: str, method: str, path: str, query: str,
                   headers: Mapping, raw_body: bytes, key: InboundKey | None,
                   backend: Backend | None, parsed: Skeleton | dict,
                   resuming: tuple | None = None, moved: bool = False) -> Exchange:
    if isinstance(parsed, dict):
        exchange = Exchange(endpoint=endpoint, method=method, path=path, query=query,
                            headers=headers, raw_body=raw_body, body=parsed)
    else:
        exchange = Exchange(endpoint=endpoint, method=method, path=path, query=query,
                            headers=headers, raw_body=raw_body, skeleton=parsed)
    if key is not None:
        exchange.key, exchange.key_name = key, key.name
    exchange.response_headers["x-relay-request-id"] = exchange.id

    def refused(error: RelayError) -> RelayError:
        error.exchange = exchange
        return error

    model = exchange.model or ""  # parse_request makes sure there is one
    if len(model) > MAX_MODEL_CHARS:
        raise refused(invalid_request(
            f"model: String should have at most {MAX_MODEL_CHARS} characters"))
    if backend is None:
        backend = state.config.backend_for(model)
    exchange.backend = backend
    if backend is None:
        raise refused(RelayError(
            404, f"model: {model} (no backend in the relay's configuration serves it)",
            "not_found_error"))
    if key is not None and not key.may_use(backend, model):
        raise refused(forbidden(key, f"model {model!r} (backend {backend.name})"))
    target = backend.upstream_model(model)
    if target is not None and target != model:
        exchange.set_model(target)
        exchange.note("relay", "renamed model", model=model, upstream_model=target)
    try:
        await prepare_history(state, exchange, moved)
        keeping = _resume(state, exchange, resuming)
        changed = exchange.changed
        await state.chain.run("relay_request", exchange)
        if exchange.repaired_by:
            keeping = None  # the next request repairs again, and says so: walked whole
        if keeping is not None:
            # A request the chain changed (a repair, a rename) leaves changed messages in its
            # record: the next request, resumed from them, holds them as its own and must go
            # up encoded, not as the client's bytes.
            keeping = (*keeping, exchange.changed and not changed
                       or (resuming is not None and resuming[2] is not None
                           and resuming[2].record.dirty))
        threads.restore_held_ids(exchange)
        kept = exchange.messages if keeping is not None and resuming is not None \
            and exchange._skeleton is not None else None
        if backend.credentials:
            exchange.session()  # while the request is decoded: the pool keeps it sticky
        # Encoded here, where a request that cannot be is still answered in Anthropic's
        # format.
        try:
            exchange.release_body(exchange.upstream_body())
        except RecursionError:  # nested deeper than the encoder goes (the parse went deeper)
            raise invalid_request("request body is nested too deeply to be re-encoded") from None
        except Exception:
            log.exception("%s: the changed request could not be encoded", exchange.id)
            raise
        if kept is not None and keeping is not None and resuming is not None:
            # Once the request has gone into bytes and let its messages go: from here the
            # record is the only holder of that list, which the session's next request goes
            # on in (relay.resume.decode_from).
            _keep(exchange, resuming, keeping, kept)
    except resume.Decline:
        raise
    except RelayError as error:
        raise refused(threads.carried_error(error, exchange.thread)) from None
    except skeleton.UNREADABLE as e:
        # A value the skeleton kept raw and a plugin decoded: broken UTF-8, say, which the
        # API refuses as it refuses any body that does not parse (anthropics/claude-code
        # #6464: "The request body is not valid JSON: ...").
        raise refused(not_json(e)) from None
    except Exception as e:  # logged by the chain with the plugin's name, or above
        raise refused(RelayError(500, "the relay failed while preparing this request",
                                 "api_error")) from e
    return exchange


def _resume(state: Preparation, exchange: Exchange, resuming: tuple | None):
    """Set ``exchange.resume`` for the request chain (relay.resume); returns what keeping a
    record of this request needs after it (None when none will be kept)."""
    if resuming is None or exchange.thread is not None or exchange._skeleton is None:
        if resuming is not None and resuming[2] is not None:
            raise resume.Decline()
        return None
    store, session, resumed, _ = resuming
    messages = exchange.messages or []
    count = len(messages)
    if not count:
        return None  # no boundary to keep (and no session: the rule needs a message)
    # The same rule over the same request (the chain has not run): not worked out twice.
    exchange._session = session
    # A session's first request keeps a record too, as a trial (see resume.Store): else its
    # second, the first that goes on from it, is walked whole again.
    trial = resumed is None and not store.established(session)
    chain = state.chain
    context = resume.context(exchange)
    if resumed is None:
        start, states, changer = 0, None, -1
    else:
        record = resumed.record
        if record.context != context:
            raise resume.Decline()
        start = resumed.start
        states = record.states[start]
        # Its messages[:start] are the chain's, not the client's, where a plugin changed
        # one of them (a boundary before every change, which a request going back to an
        # earlier turn resumes from, holds the client's messages as they came).
        if record.dirty and any(changed for _, changed in states.values()):
            exchange.mark_changed()
        changer = max((chain.position(name) for name, (_, changed) in states.items()
                       if changed), default=-1)
    marks = range(max(start, count - resume.MARKS + 1, 1), count + 1)
    exchange.resume = resume.Resume(start, marks, states, changer, chain.positions,
                                    resumed.offset if resumed is not None else 0)
    # The canonical bytes of the messages that will locate this request's boundaries, made
    # before any plugin changes them.
    encoded = resume.canonical(messages[start:] if resumed is not None
                               else messages[max(count - resume.MARKS + 1, 0):])
    # The record's size counts the blocks the decode found (a resumed request's record
    # counts its new ones in _keep).
    blocks = exchange._skeleton.blocks if resumed is None else 0
    return context, count, encoded, trial, blocks


def _keep(exchange: Exchange, resuming: tuple, keeping: tuple, messages: list) -> None:
    """Keep what this request's chain left (``messages``: its messages as a skeleton's),
    for the session's next request."""
    store, session, resumed, head = resuming
    context, count, encoded, trial, blocks, dirty = keeping
    if exchange.resume is None:
        return
    saved = exchange.resume.saved
    # Kept only when the chain left the request a skeleton of the same messages, each
    # position still the client's (nothing merged or dropped), and at a boundary where
    # every plugin that keeps a state (saved one anywhere) saved it. A chain of plugins
    # that keep none (or no plugin at all) goes on from any boundary.
    if encoded is None or type(messages) is not list or len(messages) != count:
        return
    keeping_state = set().union(*(found.keys() for found in saved.values()))
    states = {index: found for index in exchange.resume.marks
              if keeping_state <= (found := saved.get(index, {})).keys()}
    if not states:
        return
    raw = exchange.raw_body
    if resumed is None:
        record = resume.Record(raw, count, context, messages, states, encoded, None, None, 0,
                               blocks)
    else:
        offsets = resume.new_offsets(raw, resumed, encoded)
        if offsets is None:
            return
        old = resumed.record
        if exchange.resume is not None:
            exchange.resume.span = (old.array, resumed.offset, resumed.end)
        # The messages before the boundary keep what the earlier ones were decoded from
        # (the earlier body itself, for a record made by a full walk); the new ones, a copy
        # of this body's last part.
        pinned = old.pinned + (len(old.raw) if old.pinned == 0 else 0) + len(raw) \
            - resumed.offset
        # This body's bytes up to the boundary resumed from are the earlier record's: where
        # those are the body the messages were first decoded from, the new record keeps that
        # one and a copy of what follows (while that is small beside it), not this whole
        # body too.
        base, cut = raw, None
        tail: bytes | bytearray = b""
        if old.pinned == 0 or old.cut < len(old.raw):
            shared = min(old.cut, old.offsets[resumed.start])
            if len(raw) - shared <= min(shared, resume.TAIL_BYTES):
                base, cut = old.raw, shared
                tail = resume.tail_after(old, raw, shared, old.offsets[resumed.start])
        record = resume.Record(base, count, context, messages, states, None, offsets,
                               old.before, old.array,
                               old.blocks + resume.blocks_in(messages[resumed.start:]), pinned,
                               cut, tail)
        record.after = resumed.after
    record.dirty = dirty
    store.put(session, record, trial, head)


async def prepare_history(state: Preparation, exchange: Exchange, moved: bool = False) -> None:
    """What the history rules must know before they run: the betas and fields they defer to
    the upstream for (:mod:`relay.betas`), and the server-held thread the request belongs
    to (:mod:`relay.threads`: forwarded, carried, or refused the API's way)."""
    deferring = betas.deferring(exchange.client_headers, exchange.other_fields())
    if deferring:
        exchange.rules_defer = deferring
        exchange.note("relay", "history rules defer", reasons=betas.described(deferring))
        exchange.flag("history-rules-deferred")
    if exchange.endpoint == "messages":
        await threads.prepare(state.threads, exchange, state.tenants, moved)


class Fallbacks:
    """The exchanges one client request is tried with after its first backend, each prepared
    when the upstream seam asks for it (:meth:`relay.upstream.Upstream.open`): the request
    chain runs again for each, since quirks differ, and a fallback it refuses is skipped.
    ``current`` is the exchange in flight."""

    __slots__ = ("state", "key", "current", "backends")

    def __init__(self, state: Preparation, exchange: Exchange, key: InboundKey | None = None):
        self.state = state
        self.key = key
        self.current = exchange
        self.backends: list[Backend] | None = None  # what is left to try, once asked

    async def next(self) -> Exchange | None:
        """The exchange for the next fallback the chain accepts, taking over from the
        current one; None when none is left."""
        previous = self.current
        if self.backends is None:
            config = self.state.config
            self.backends = [config.backend(name) for name in previous.backend.fallbacks]
        while self.backends:
            target = self.backends.pop(0)
            try:
                following = await prepare_exchange(
                    self.state, method=previous.method, path=previous.path,
                    query=previous.query, headers=previous.client_headers,
                    raw_body=previous.raw_body, key=self.key, backend=target)
            except RelayError as refused:
                previous.note("relay", "fallback refused", backend=target.name,
                              message=refused.message)
                continue
            following.follow(previous)
            self.current = following
            return following
        return None

    async def moved(self) -> Exchange:
        """The current exchange prepared again for its own backend with its thread carried
        (:class:`relay.threads.ThreadMoved`), taking over from it; raises the RelayError
        that refuses it (its record gone meanwhile: 404 thread_not_found)."""
        previous = self.current
        try:
            following = await prepare_exchange(
                self.state, method=previous.method, path=previous.path, query=previous.query,
                headers=previous.client_headers, raw_body=previous.raw_body, key=self.key,
                backend=previous.backend, moved=True)
        except RelayError as refused:
            if refused.exchange is not None:  # the record of the answer, flags and all
                refused.exchange.follow(previous)
                self.current = refused.exchange
            raise
        following.follow(previous)
        self.current = following
        return following
