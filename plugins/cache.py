"""cache: the session record, the prompt cache's health per exchange, and cache diagnostics
in front of every backend.

For each ``/v1/messages`` answer the plugin fingerprints the request's cacheable prefix
(:mod:`relay.cache`: tools, system, messages up to each ``cache_control`` breakpoint, and
the parameters whose change invalidates it), twice when a plugin rewrote it: what went up
and what the client sent. It compares what went up with the session's previous request of
the same conversation (:mod:`relay.sessions`: the session rule, and the record kept per
session) and says what became of the cache, and why:

- ``exchange.cache``: ``{"status", "cause", "where", "by", "api", "gap_seconds",
  "predicted", "read_input_tokens", "written_input_tokens", "fresh_input_tokens"}``.
  ``status`` is ``hit`` (the upstream read the prefix), ``write`` (a first request: nothing
  to read yet, something written), ``none`` (nothing cached or asked to be) or ``miss``;
  a miss has a ``cause``: the API's words where it has one (``model_changed``,
  ``tools_changed``, ``system_changed``, ``messages_changed``), the relay's where it knows
  more (``thinking_changed``, ``tool_choice_changed``, ``backend_changed``,
  ``credential_changed``, ``ttl_expired``, and ``unexplained`` when the prefix matched within
  its lifetime and the upstream still read nothing); ``where`` the first part that changed
  (``tools[3]``, ``system[1]``, ``messages[12].content[0]``); ``by`` whether the client's own
  bytes changed there (``client``) or a plugin's rewrite did (the plugins' names);
  ``api`` the API's ``cache_miss_reason`` for it.
- the answer's ``x-relay-cache`` header: ``hit``, ``write``, ``none``, or ``miss;
  cause=...; where=...; by=...``. A stream's headers go out before its usage is known, so
  there the header is the relay's prediction from the prefix alone and says so (``hit;
  predicted``); the settled verdict, from ``message_start``'s usage, is in
  ``exchange.cache``, on the timeline, in the access log and the metrics.
- the timeline (so the dump): one ``cache`` entry with the verdict.

Diagnostics: a request with ``diagnostics.previous_message_id`` gets
``diagnostics.cache_miss_reason`` in the API's shape. A backend with ``holds_diagnostics``
(by default only ``api.anthropic.com``) answers it itself and the plugin leaves its answer
alone; for every other backend the plugin answers from its record of that earlier request,
keyed by its answer's id (kept only for requests that carried ``diagnostics``, as the API
keeps fingerprints only for those): ``previous_message_not_found`` when it has none,
``unavailable`` when only ``thinking`` or ``tool_choice`` changed, else the section that
changed with ``cache_missed_input_tokens`` estimated from that request's own tokens per byte.
A continuation of a server-held thread is compared as the whole request the server builds
from it, where the relay recorded the thread's turns (``unavailable`` where it did not).
An answer that already holds diagnostics keeps them: never both. In a stream they go in
``message_start``'s message, where the API puts them. The ``diagnostics`` field itself goes
up as the client sent it (the relay does not know which backends refuse it: a backend's
``drop_betas: ["cache-diagnosis-*"]`` quirk takes it out with its beta).

Where the records live: process memory by default; on the host's state seam (namespaces
``sessions`` and ``cache-answers``) when ``state:`` is shared, so that replicas agree.
Put ``cache`` after ``metrics`` in ``pipeline:`` (the shipped relay.yaml does).

Options: see ``Cache.OPTIONS``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from relay import cache as fingerprints
from relay import threads
from relay.cache import Fingerprint
from relay.hookspecs import hookimpl
from relay.options import Option
from relay.sessions import (
    MAX_AGE,
    MAX_BYTES,
    MAX_LANES,
    MAX_SESSIONS,
    Lane,
    Record,
    Records,
    SharedRecords,
)

PLUGIN = "cache"
REQUEST = "cache request"  # exchange.state: what relay_request read of the request
RESUMED = "cache resumed"  # exchange.state: the previous request's _Held, and this one's
HEADER = "x-relay-cache"
_KEY = b'"cache_control"'
# The verdict on a request that asks nothing of the cache.
NOTHING = {"status": "none", "cause": None, "where": None, "by": None, "api": None,
           "gap_seconds": None, "predicted": False}
# Breaks the relay knows more about than the API says.
BACKEND, CREDENTIAL, TTL, UNEXPLAINED = ("backend_changed", "credential_changed",
                                         "ttl_expired", "unexplained")
# Causes the relay presumes from what changed around the prefix, not in it: the upstream's
# usage has the last word on them.
PRESUMED = (BACKEND, CREDENTIAL, TTL)
# Timeline actions by which a step says it changed the request on its way up.
REWRITES = ("repaired", "rewrote", "restored", "translated ids", "renamed model",
            "dropped betas")
MAX_NAMES = 16  # models and plugins counted per session: past that, "other"
MAX_NAME = 100


@dataclasses.dataclass(slots=True)
class Diagnosed:
    """What the relay keeps of a request that asked for diagnostics, by its answer's id."""

    fingerprint: Fingerprint
    tokens: int | None

    def nbytes(self) -> int:
        return 64 + self.fingerprint.nbytes()

    def to_bytes(self) -> bytes:
        return msgspec.msgpack.encode((self.fingerprint.to_bytes(), self.tokens))

    @classmethod
    def from_bytes(cls, raw: bytes) -> Diagnosed:
        fingerprint, tokens = msgspec.msgpack.decode(raw)
        return cls(Fingerprint.from_bytes(fingerprint), tokens)


_UNSET: Any = object()
_PENDING: Any = object()  # a judgement still to make (Cache._known)
# What a request without a breakpoint leaves for its session's next one (relay.resume): its
# bytes hold no key, so the next request's bytes that are the same hold none either.
_UNMARKED: Any = object()


# Clients put their breakpoints on the last messages, so the search looks there first
# (`rfind`); the rest is searched forward, where CPython's two-way search reads a body
# without a breakpoint at about half the cost of `rfind`'s.
_TAIL = 64 * 1024


def _marked(raw: bytes, start: int) -> bool:
    """Whether ``raw`` holds a ``"cache_control"`` key at or after ``start``."""
    split = max(start, len(raw) - _TAIL)
    if raw.rfind(_KEY, split) >= 0:
        return True
    return split > start and raw.find(_KEY, start, split + len(_KEY) - 1) >= 0


class _Held:
    """What a request leaves for its session's next one (through relay.resume, at each of
    its boundaries): the fingerprint of the client's bytes, once the answer has asked for
    it (until then, and when the body is not a request, None)."""

    __slots__ = ("found",)

    def __init__(self):
        self.found: fingerprints.Resumable | None = None


@dataclasses.dataclass(slots=True)
class Judgement:
    """One exchange's account, kept in ``exchange.state`` from the answer to the end."""

    key: str | None
    record: Record | None
    upstream: Fingerprint | None
    client: Fingerprint | None
    lane: int | None
    rewriters: tuple[str, ...]
    cache: dict
    diagnostics: Any = _UNSET  # what the relay answers (None: null); _UNSET: nothing
    wants_diagnostics: bool = False
    # What diagnostics compare: ``upstream``, or for a continuation of a thread the upstream
    # holds, the whole request the server builds from it (relay.threads.held_prompt).
    prompt: Fingerprint | None = None
    answer_id: str | None = None
    settled: bool = False


def describe(cache: dict | None, predicted: bool = False) -> str | None:
    """The ``x-relay-cache`` value for a verdict (the access log keeps status and cause)."""
    if not cache:
        return None
    text = cache["status"]
    if cache.get("cause"):
        text += f"; cause={cache['cause']}"
        if cache.get("where"):
            text += f"; where={cache['where']}"
        if cache.get("by"):
            text += f"; by={cache['by']}"
    if predicted:
        text += "; predicted"
    return text


def figures(usage) -> tuple[int, int, int] | None:
    """``(read, written, fresh)`` input tokens from an answer's usage: the usage plugin's
    :class:`relay.usage.Usage` (its pinned fields) or the answer's own ``usage`` object;
    None when the upstream reports nothing about the cache."""
    if usage is None:
        return None
    if isinstance(usage, dict):
        if "cache_read_input_tokens" not in usage and "cache_creation_input_tokens" not in usage:
            return None
        read = _int(usage.get("cache_read_input_tokens"))
        written = _int(usage.get("cache_creation_input_tokens"))
        creation = usage.get("cache_creation")
        if not written and isinstance(creation, dict):
            written = _int(creation.get("ephemeral_5m_input_tokens")) + \
                _int(creation.get("ephemeral_1h_input_tokens"))
        return read, written, _int(usage.get("input_tokens"))
    return (_int(getattr(usage, "cache_read_input_tokens", 0)),
            _int(getattr(usage, "cache_write_5m_input_tokens", 0))
            + _int(getattr(usage, "cache_write_1h_input_tokens", 0)),
            _int(getattr(usage, "input_tokens", 0)))


def _int(value) -> int:
    return value if type(value) is int and value > 0 else 0


def _continues(lane: Fingerprint, request: Fingerprint) -> bool:
    """Whether ``request`` goes on from ``lane``'s conversation: the same first message (what
    the session rule's fingerprint holds too). Claude Code's subagents and small-model calls
    share the main loop's session id, each with a first message of its own."""
    if not lane.messages or not request.messages:
        return not lane.messages and not request.messages
    start_a = lane.tools + lane.system + 2
    start_b = request.tools + request.system + 2
    a, b = lane.messages[0], request.messages[0]
    if a != b:
        return False
    # Array slices compare in a C loop; memoryviews unpack item by item.
    return lane.crcs[start_a:start_a + a] == request.crcs[start_b:start_b + b] \
        and lane.lengths[start_a:start_a + a] == request.lengths[start_b:start_b + b]


def choose_lane(record: Record | None, request: Fingerprint, backend: str | None,
                same_backend: bool = False) -> int | None:
    """The lane (most recent first) this request continues: its conversation's on the same
    backend, whose cache it can read, else (unless ``same_backend``) its conversation's on
    another backend; None for a conversation the record has not seen."""
    if record is None:
        return None
    found = None
    for i, lane in enumerate(record.lanes):
        if _continues(lane.upstream, request):
            if lane.backend == backend:
                return i
            if found is None:
                found = i
    return None if same_backend else found


def verdict(record: Record | None, lane_index: int | None, upstream: Fingerprint,
            client: Fingerprint, now: float, backend: str | None, credential: str | None,
            rewriters: tuple[str, ...]) -> dict:
    """What the relay expects of the cache for a request, before its usage is known."""
    cache: dict = {"status": "write" if upstream.last_breakpoint >= 0 else "none",
                   "cause": None, "where": None, "by": None, "api": None,
                   "gap_seconds": None, "predicted": True}
    if record is None or lane_index is None:
        return cache
    lane: Lane = record.lanes[lane_index]
    previous = lane.upstream
    gap = now - lane.time
    cache["gap_seconds"] = round(gap, 3)
    if previous.last_breakpoint < 0:
        return cache  # the previous request cached nothing: nothing could break
    cache["status"] = "hit"
    if lane.backend != backend:
        cache.update(status="miss", cause=BACKEND, where=f"{lane.backend} -> {backend}")
        return cache
    if lane.credential != credential:
        cache.update(status="miss", cause=CREDENTIAL)  # names, not secrets, but not shown
        return cache
    divergence = fingerprints.diverge(previous, upstream)
    if divergence is not None and divergence.cached:
        own = fingerprints.diverge(lane.client or previous, client)
        if own is not None and own.cached:
            by = "client"
        else:
            by = ",".join(dict.fromkeys(lane.rewriters + rewriters)) or "relay"
        cache.update(status="miss", cause=divergence.reason, where=divergence.where, by=by,
                     api=fingerprints.api_reason(divergence))
        return cache
    if gap > previous.ttl:
        cache.update(status="miss", cause=TTL)
    return cache


def settle(cache: dict, found: tuple[int, int, int] | None, lane: Lane | None) -> None:
    """The verdict once the answer's usage is known (``found``: read, written, fresh)."""
    if found is None:
        return
    read, written, fresh = found
    cache.update(predicted=False, read_input_tokens=read, written_input_tokens=written,
                 fresh_input_tokens=fresh)
    if cache["cause"] in PRESUMED and read:
        # The upstream still held the prefix (another replica or lane kept it alive, two
        # backend names for one organisation): the presumption was wrong, the cache is fine.
        cache.update(status="hit", cause=None, where=None)
    elif cache["cause"]:
        cache["status"] = "miss"
    elif read:
        cache["status"] = "hit"
    elif cache["status"] == "hit" and lane is not None and lane.cached:
        cache.update(status="miss", cause=UNEXPLAINED)
    else:
        cache["status"] = "write" if written else "none"


def rewriters_of(exchange) -> tuple[str, ...]:
    """The steps that changed this request on its way up, from their timeline entries."""
    names: dict[str, None] = {}
    for entry in exchange.timeline:
        if entry.get("action") in REWRITES and entry.get("direction") != "to_client" \
                and entry.get("step") != PLUGIN:
            names[str(entry.get("step"))] = None
    return tuple(names)


def _count(counts: dict, name: str | None) -> None:
    name = (name or "-")[:MAX_NAME]
    if name not in counts and len(counts) >= MAX_NAMES:
        name = "other"
    counts[name] = counts.get(name, 0) + 1


class Cache:
    """The cache plugin; the host makes one instance per relay."""

    # Its request hook reads no history: a session's request may go on from where the
    # previous one ended (relay.resume) with this plugin in the pipeline.
    RESUMABLE = True
    OPTIONS = (
        Option("max_sessions", int, MAX_SESSIONS, "session records kept (least recently used "
               "out first)"),
        Option("max_bytes", int, MAX_BYTES, "bytes the session records may hold in this "
               "process, fingerprints included (and as many the diagnosed answers')"),
        Option("max_age", float, MAX_AGE, "seconds a session record (and a diagnosed "
               "answer's fingerprint) is kept after its last use"),
        Option("max_answers", int, MAX_SESSIONS, "fingerprints kept for answers whose "
               "request asked for diagnostics"),
    )

    def __init__(self):
        self.records: Records | SharedRecords = Records()
        self.answers: Records | SharedRecords = Records()

    @hookimpl
    def relay_startup(self, options, state):
        if state is not None and getattr(state, "kind", "memory") != "memory":
            # A session's record is written at every request: behind, so that none waits
            # for the store. A diagnosed answer is written before the client has its id.
            self.records = SharedRecords(state, "sessions", Record.from_bytes,
                                         options["max_age"], behind=True)
            self.answers = SharedRecords(state, "cache-answers", Diagnosed.from_bytes,
                                         options["max_age"])
        else:
            self.records = Records(options["max_sessions"], options["max_bytes"],
                                   options["max_age"])
            self.answers = Records(options["max_answers"], options["max_bytes"],
                                   options["max_age"])

    @hookimpl
    def relay_request(self, exchange):
        # What the answer's account needs of the request, read while it is still decoded:
        # after it has gone up, it would be decoded again from the bytes sent.
        if exchange.endpoint != "messages":
            return
        requested = exchange.field("diagnostics")
        wants = isinstance(requested, dict) and "previous_message_id" in requested
        resume = exchange.resume
        previous = resume.state(PLUGIN) if resume is not None else None
        # Where the previous request had none, only the bytes after the part it shares
        # with this one.
        after = resume.offset if previous is _UNMARKED else 0
        if not wants and not _marked(exchange.raw_body, after):
            # No breakpoint, no diagnostics: nothing is cached, nothing to compare, nothing
            # to answer (the session record counts the requests that use the cache).
            exchange.state[REQUEST] = None
            if resume is not None:
                resume.save_all(PLUGIN, _UNMARKED)
            return
        exchange.state[REQUEST] = requested if wants else _UNSET
        exchange.session()
        if resume is not None:
            # The client's bytes up to the boundary resumed from are the previous request's:
            # so are their parts of the fingerprint (relay.cache.resumed).
            held = _Held()
            resume.save_all(PLUGIN, held)
            exchange.state[RESUMED] = (previous if previous is not _UNMARKED else None, held)

    async def summary(self, key: str) -> dict | None:
        """A session's record without its fingerprints (:meth:`relay.sessions.Record.summary`),
        by its key (``exchange.session()``), or None when none is kept: for a console."""
        record = await self.records.get(key)
        return record.summary() if record is not None else None

    @staticmethod
    def _known(exchange):
        """The judgement where it needs no record read: None for an exchange that asks
        nothing of the cache (its verdict set here), the one made already; else
        :data:`_PENDING`, for :meth:`_judge` to make."""
        state = exchange.state
        if exchange.endpoint != "messages" or PLUGIN in state:
            return state.get(PLUGIN)
        if state.get(REQUEST, _UNSET) is None:
            exchange.cache = dict(NOTHING)
            exchange.response_headers[HEADER] = "none"
            state[PLUGIN] = None
            return None
        return _PENDING

    async def _judge(self, exchange) -> Judgement | None:
        known = self._known(exchange)
        if known is not _PENDING:
            return known
        requested = exchange.state.get(REQUEST, _UNSET)
        sent = exchange.upstream_body()
        raw = exchange.raw_body
        found = self._resumed(exchange) or fingerprints.resumable(raw)
        if sent is raw or sent == raw:
            upstream, client = found.fingerprint if found is not None else None, None
        else:
            upstream = fingerprints.fingerprint(sent)
            client = found.fingerprint if found is not None else None
        held = exchange.state.get(RESUMED)
        if held is not None:
            held[1].found = found
        if requested is _UNSET and REQUEST not in exchange.state:
            requested = exchange.field("diagnostics")  # the request hook did not run
        wants = isinstance(requested, dict) and "previous_message_id" in requested
        prompt = upstream
        thread = exchange.thread
        if thread is not None and thread.continues and exchange.backend is not None \
                and exchange.backend.holds_threads:
            upstream = None  # the upstream holds the head: this body is not the prompt
            # The API compares the whole prompt the server builds: where the relay recorded
            # the head, it can too (and keep it for a later request that names this answer,
            # on this backend or, the thread moved, another).
            whole = threads.held_prompt(exchange, sent) if wants else None
            prompt = fingerprints.fingerprint(whole) if whole is not None else None
        key = exchange.session()
        record = await self.records.get(key) if key and upstream is not None else None
        rewriters = rewriters_of(exchange)
        backend = exchange.backend.name if exchange.backend is not None else None
        credential = getattr(exchange, "credential", None)
        if upstream is None:
            lane, cache = None, {"status": "none", "cause": None, "where": None, "by": None,
                                 "api": None, "gap_seconds": None, "predicted": True}
        else:
            lane = choose_lane(record, upstream, backend)
            cache = verdict(record, lane, upstream, client or upstream, exchange.received,
                            backend, credential, rewriters)
        judgement = exchange.state[PLUGIN] = Judgement(key, record, upstream, client, lane,
                                                       rewriters, cache, prompt=prompt)
        exchange.cache = cache
        if wants:
            judgement.wants_diagnostics = True
            if exchange.backend is not None and not exchange.backend.holds_diagnostics:
                judgement.diagnostics = await self._diagnose(exchange, requested, prompt)
        return judgement

    @staticmethod
    def _resumed(exchange) -> fingerprints.Resumable | None:
        """The fingerprint of the client's bytes, from the previous request's where this
        one was resumed from it (None: none to go on from)."""
        held = exchange.state.get(RESUMED)
        resume = exchange.resume
        if held is None or held[0] is None or held[0].found is None or resume is None \
                or resume.span is None:
            return None
        return fingerprints.resumed(exchange.raw_body, held[0].found, resume.start,
                                    *resume.span)

    async def _diagnose(self, exchange, requested: dict, upstream: Fingerprint | None):
        """The ``diagnostics`` the API would answer, from the relay's record."""
        previous = requested.get("previous_message_id")
        if previous is None:
            return None
        reason: dict
        entry = await self.answers.get(self._answer_key(exchange, previous)) \
            if isinstance(previous, str) and previous else None
        if entry is None:
            reason = {"type": fingerprints.NOT_FOUND}
        elif upstream is None:
            reason = {"type": fingerprints.UNAVAILABLE}
        else:
            divergence = fingerprints.diverge(entry.fingerprint, upstream)
            word = fingerprints.api_reason(divergence)
            if divergence is None or word is None:
                return None
            if word == fingerprints.UNAVAILABLE:
                reason = {"type": word}
            else:
                reason = {"type": word, "cache_missed_input_tokens": fingerprints.estimate_tokens(
                    divergence.missed_bytes, entry.tokens, entry.fingerprint.size())}
        return {"cache_miss_reason": reason}

    @staticmethod
    def _answer_key(exchange, message_id: str) -> str:
        # By tenant, as the API keeps fingerprints per organisation and workspace.
        return f"{exchange.key_name or ''}\x00{message_id[:256]}"

    def _answer(self, exchange, judgement: Judgement, message: dict) -> bool:
        """Put the relay's diagnostics in an answer (a message, or a stream's message_start
        message); True when it changed."""
        answer_id = message.get("id")
        if isinstance(answer_id, str):
            judgement.answer_id = answer_id
        if judgement.diagnostics is _UNSET:
            return False
        if "diagnostics" in message:
            # Null included: the API's word for "no divergence" (BetaMessage.diagnostics), so
            # a backend that says it answered, whatever the relay's record holds.
            exchange.note(PLUGIN, "diagnostics from the backend")
            return False
        reason = judgement.diagnostics
        exchange.note(PLUGIN, "diagnosed", reason=None if reason is None
                      else reason["cache_miss_reason"]["type"])
        if reason is None:
            return False  # absent and null say the same: no divergence
        message["diagnostics"] = reason
        return True

    async def _settle(self, exchange, judgement: Judgement, usage) -> None:
        """The verdict, once the answer's usage is known, on the timeline; and the record,
        updated before the client has its answer, so that its next request, on whichever
        connection, finds it."""
        if judgement.settled:
            return
        judgement.settled = True
        found = figures(getattr(exchange, "usage", None)) or figures(usage)
        lane = judgement.record.lanes[judgement.lane] \
            if judgement.record is not None and judgement.lane is not None else None
        cache = judgement.cache
        settle(cache, found, lane)
        exchange.note(PLUGIN, cache["status"], **{
            name: value for name, value in cache.items()
            if name != "status" and value is not None})
        if judgement.upstream is not None or judgement.prompt is not None:
            await self._remember(exchange, judgement)

    # The answer hooks return an awaitable only when there is a judgement to make or an
    # answer to settle: an exchange that asks nothing of the cache costs no coroutine.
    @hookimpl
    def relay_response(self, exchange, response):
        if self._known(exchange) is None:
            return None
        return self._respond(exchange, response)

    async def _respond(self, exchange, response) -> None:
        judgement = await self._judge(exchange)
        if judgement is None:
            return
        data = response.data
        if isinstance(data, dict) and data.get("type") == "message":
            if self._answer(exchange, judgement, data):
                response.mark_changed()
            await self._settle(exchange, judgement, data.get("usage"))
        exchange.response_headers[HEADER] = describe(judgement.cache)

    @hookimpl
    def relay_stream_events(self, exchange):
        if self._known(exchange) is None:
            return None
        return self._stream_events(exchange)

    async def _stream_events(self, exchange):
        judgement = await self._judge(exchange)
        if judgement is None:
            return None
        exchange.response_headers[HEADER] = describe(judgement.cache, predicted=True)
        return {"message_start"}

    @hookimpl
    async def relay_stream_event(self, exchange, event):
        judgement = exchange.state.get(PLUGIN)
        if judgement is None or event.name != "message_start":
            return None
        message = event.data.get("message") if isinstance(event.data, dict) else None
        if isinstance(message, dict):
            if self._answer(exchange, judgement, message):
                event.mark_changed()
            await self._settle(exchange, judgement, message.get("usage"))
        return None

    @hookimpl
    def relay_exchange_end(self, exchange):
        judgement: Judgement | None = exchange.state.get(PLUGIN)
        if judgement is not None and not judgement.settled:
            # A stream that ended before its message_start: what was predicted stands.
            judgement.settled = True
            exchange.note(PLUGIN, judgement.cache["status"], predicted=True)

    async def _remember(self, exchange, judgement: Judgement) -> None:
        cache = judgement.cache
        read = cache.get("read_input_tokens", 0)
        written = cache.get("written_input_tokens", 0)
        fresh = cache.get("fresh_input_tokens", 0)
        tokens = read + written + fresh if "read_input_tokens" in cache else None
        if judgement.wants_diagnostics and judgement.answer_id and judgement.prompt is not None:
            await self.answers.put(self._answer_key(exchange, judgement.answer_id),
                                   Diagnosed(judgement.prompt, tokens))
        upstream = judgement.upstream
        if judgement.key is None or upstream is None:
            return
        # Built on the record the judgement read once the answer began, moments ago: not
        # read again (a round trip to a shared state), so a write of this session by another
        # request in between (of this process or another) is overwritten.
        record = judgement.record
        now = exchange.received
        if record is None:
            record = Record(started=now, updated=now)
        record.updated = max(record.updated, now)
        record.turns += 1
        backend = exchange.backend.name if exchange.backend is not None else None
        _count(record.backends, backend)
        _count(record.models, exchange.model)
        record.repairs += exchange.repairs
        for name in judgement.rewriters:
            _count(record.rewrites, name)
        record.read += read
        record.written += written
        record.fresh += fresh
        if cache["status"] == "miss":
            _count(record.breaks, cache["cause"])
        lane = Lane(upstream, judgement.client, now, backend,
                    getattr(exchange, "credential", None), judgement.rewriters, tokens,
                    bool(read or written))
        lanes = record.lanes
        index = choose_lane(record, upstream, backend, same_backend=True)
        if index is not None:
            del lanes[index]
        lanes.insert(0, lane)
        del lanes[MAX_LANES:]
        await self.records.put(judgement.key, record)
