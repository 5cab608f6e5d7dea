"""Server-held threads (beta ``message-threads-2026-08-12``): what the relay knows of them.

A request may ask the server to hold its conversation (``thread: {"type": "create"}``) under
the answer's ``id``, or continue one (``thread: {"type": "continue", "previous_message_id":
"msg_..."}``), sending only the new turn: its first message may be a user turn of
``tool_result`` blocks whose ``tool_use`` lives in the part the server holds. The official
SDKs' tool runners thread by default (``anthropic`` 2.14, ``lib/threads/_thread_state.py``).

So a continuation is judged as a tail whose head the server holds. Where this relay saw the
earlier turns, it keeps them here (the conversation as the client sent it, up to each answer,
keyed by the answer's id; bounded by count, bytes and age) and the history rules judge the
whole conversation; where it did not (a restart, another replica, a thread made elsewhere),
they judge only what the tail can show, and the exchange says so (``x-relay-notes:
thread-head-unseen``).

A backend that holds no threads (``holds_threads: false``, every OpenAI-format backend) never
gets a ``thread``: the relay carries the thread for it. A ``create`` goes up without the field;
a ``continue`` whose earlier turns the relay recorded goes up as the whole conversation, the
recorded turns (without their ``cache_control`` breakpoints, as the SDKs resend a thread's
history) followed by the request's own, without the field (and without the threads beta
in ``anthropic-beta``), and its answer is recorded in turn, so the client threads as it would
against the API. A thread also moves this way with its session: a continuation of a thread
held by one backend, bound for another (a fallback, a ``/model`` switch), is carried, and so
is one held by a pooled credential (an account of its own) that cannot take it now
(:class:`ThreadMoved`). The plugins then see a whole conversation, as if the client had
sent it all.

Where the relay has no record to carry (evicted, expired, another replica), a backend that
holds threads gets the request as it came; for one that holds none the relay is the thread's
server and holds no state for it, so it answers as the API answers such a continuation: 404
with ``error.details.error_code: "thread_not_found"``, and the SDKs replay the history under a
new thread (``ThreadNotFoundError``; ``_REPLAY_ERROR_CODES`` / ``recovers_from`` in the SDK's
``lib/threads/_thread_state.py``). A ``thread`` value it cannot read gets the API's answer to a
request it cannot thread, 400 ``thread_unsupported_request``.

The functions are pure but for :class:`Store`, an in-process map the host owns. When the
host's state is shared (``state.url``: SQLite for one host's workers, Redis for replicas), each
record also goes there (namespace ``threads``, expiring with the record's age; a conversation
over :data:`MAX_SHARED_BYTES` stays in its process), so a continuation that reaches another
worker or replica finds it: the local map answers first, the state when it does not. Which
inbound key each answer went to is kept apart from the conversations, and longer (namespace
``thread-owners``, see :data:`MAX_OWNERS`): a key continues only its own threads. With
several inbound keys, a continuation whose key the relay does not know (a restart or another
replica without a shared state, past those bounds) is answered thread_not_found too: the
upstream might hold another key's conversation under that id, and the client's replay costs
little.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import re
import time
from typing import Any

import msgspec
import orjson

from . import beta_filter
from .errors import RelayError
from .sse import SSEDecoder
from .state import Seldom

log = logging.getLogger("relay.threads")

BETA = "message-threads-2026-08-12"
# The SDK reads `unsupported` as a list of ThreadUnsupportedFeatureName values and falls back
# on any value it does not know, or on none: a backend without threads is none of its names.
UNSUPPORTED_MESSAGE = ("thread: this backend does not hold conversations (the relay's "
                       "holds_threads: false for it); send the full conversation without "
                       "`thread`")

# Bounds of the record: threads, bytes of their conversations, seconds since last use. The
# API documents no lifetime for a thread; an hour covers a tool loop's pauses.
MAX_THREADS = 1000
MAX_BYTES = 64 * 1024 * 1024
MAX_AGE = 3600.0
# A streamed answer kept for the record, events and all: beyond this it is not recorded (its
# thread's next turn is then judged as unseen). An answer of 300k output tokens fits.
MAX_STREAM_BYTES = 16 * 1024 * 1024
# A record larger than this is not written to a shared state.
MAX_SHARED_BYTES = 4 * 1024 * 1024
NAMESPACE = "threads"
MAX_PENDING = 256  # writes to the shared state under way; past this, kept in process only
# Which inbound key each answer to a thread request was given to, kept apart from the
# conversations and far longer: the upstream holds every key's threads under the relay's one
# credential, so this alone keeps a key from continuing another's thread once its
# conversation is evicted or expired, was never recorded (a thread that went on unseen, a
# stream too long to keep or cut short), or was recorded by another replica; an answer past
# it is no key's known, refused where the relay serves several. About 230 bytes an answer in
# process (23 MB at the bound); in a shared state, a day each.
MAX_OWNERS = 100_000
OWNER_AGE = 86400.0
OWNERS = "thread-owners"
# How long a continuation that finds neither its record nor its owner in a shared state waits
# for them, in reads after these pauses (seconds): both are written behind the answer
# (``put_soon``), so a client quick to continue on another worker or replica can come first.
SETTLE = (0.02, 0.05, 0.1, 0.2)
# The fields a thread keeps from its ``create`` and a continuation may not send
# (``CREATE_ONLY_FIELDS`` in the SDK's ``lib/threads/_thread_state.py``).
CREATE_ONLY = ("system", "tools")

# What the record holds of one answer: the backend that holds its thread ("" for a thread
# the relay carries), the conversation up to it as JSON, the ids the relay renamed for the
# client, the create-only fields as JSON text, the pooled credential that holds it.
Record = tuple[str, bytes, dict, dict, "str | None"]


@dataclasses.dataclass(slots=True)
class Thread:
    """What a request asks of a thread, and what the relay knows of the part held upstream.

    ``kind`` is ``create``, ``continue``, or ``other`` for a value the relay cannot read (the
    upstream judges it; the rules treat it like a continuation they know nothing of).
    ``head`` is the conversation up to ``previous_id``'s answer as the client sent it, when
    this relay saw it; None otherwise (and for ``create``)."""

    kind: str
    previous_id: str | None = None
    head: list | None = None
    # The head as recorded: plugins may change ``head`` in place (dedup walks it as it goes
    # up), and the next turn's record must hold it as the client sent it.
    recorded: bytes | None = None
    # The ids the relay gave the client for calls of the held answer that the server holds
    # under the upstream's own: client id -> upstream id.
    renamed: dict | None = None
    # Carried by the relay (the backend holds no thread of it): where the request's own
    # messages start in the conversation that goes up (0 for a ``create``); None otherwise.
    carried: int | None = None
    # The create-only fields (``system``, ``tools``) as JSON text, from the record.
    fields: dict | None = None
    # The pooled credential (an upstream account of its own) that holds the thread, from the
    # record: the request goes with it, or is carried where it cannot (see ThreadMoved).
    credential: str | None = None

    @property
    def continues(self) -> bool:
        """Whether the server holds a part of this conversation that the request leaves out."""
        return self.kind != "create" and self.carried is None

    @property
    def unseen(self) -> bool:
        """A continuation whose held part this relay does not know."""
        return self.kind != "create" and self.head is None and self.carried is None

    def opening(self, raw: bytes) -> bytes | None:
        """For the session rule (:mod:`relay.sessions`), a continuation the upstream holds the
        head of, as the relay recorded it: the request's ``model`` and ``metadata`` with the
        thread's ``system``, ``tools`` and first message, which the request itself leaves
        out. None for any other request."""
        if not self.continues or not self.recorded:
            return None
        try:
            recorded = _messages.decode(self.recorded)
            top = _top_level.decode(raw)
        except msgspec.MsgspecError:
            return None
        if not recorded:
            return None
        doc: dict[str, Any] = {name: msgspec.Raw(value)
                               for name, value in (self.fields or {}).items()}
        for name in ("model", "metadata"):
            if name in top:
                doc[name] = top[name]
        doc["messages"] = [recorded[0]]
        return msgspec.json.encode(doc)


def requested(value) -> Thread | None:
    """The thread a request's ``thread`` field asks for (None: no field, or null)."""
    if value is None:
        return None
    kind = value.get("type") if type(value) is dict else None
    if kind == "create":
        return Thread("create")
    previous = value.get("previous_message_id") if type(value) is dict else None
    if kind == "continue" and type(previous) is str:
        return Thread("continue", previous)
    return Thread("other")


class ThreadUnsupported(RelayError):
    """The API's refusal of a request it cannot thread, in the shape the SDKs read."""

    error_code = "thread_unsupported_request"

    def __init__(self, message: str = UNSUPPORTED_MESSAGE):
        super().__init__(400, message, "invalid_request_error", rule="thread-unsupported")

    def body(self, request_id: str | None = None) -> bytes:
        doc = {"type": "error", "error": {
            "type": self.type, "message": self.message,
            "details": {"error_code": self.error_code}}}
        if request_id:
            doc["request_id"] = request_id
        return orjson.dumps(doc)


class ThreadNotFound(ThreadUnsupported):
    """The API's answer to a continuation of a thread it holds none of (``ThreadNotFoundError``
    in the SDK, which then replays the full history under a new thread)."""

    error_code = "thread_not_found"

    def __init__(self, previous_id: str):
        RelayError.__init__(self, 404, f"previous_message_id: no thread state for {previous_id}",
                            "not_found_error", rule="thread-not-found")


class ThreadMoved(Exception):
    """The pooled credential that holds a continuation's thread cannot take it now (cooling,
    out, at its limits, or gone from relay.yaml): another account of the pool holds none of
    it, so the request is prepared again with the thread carried (:func:`prepare`,
    ``moved``), the conversation the relay recorded sent whole."""

    def __init__(self, backend: str, holder: str, to: str):
        super().__init__(f"backend {backend}: credential {holder} holds the thread, "
                         f"the request goes with {to}")
        self.holder, self.to = holder, to


def holder(exchange) -> str | None:
    """The pooled credential a request must go with to find its thread held there, or
    None where any will do."""
    thread = exchange.thread
    return thread.credential if thread is not None and thread.continues else None


class Store:
    """Conversations of threads this relay saw, by answer id, least recently used first
    out; bounded by ``max_threads``, ``max_bytes`` and ``max_age`` seconds since last use."""

    def __init__(self, max_threads: int = MAX_THREADS, max_bytes: int = MAX_BYTES,
                 max_age: float = MAX_AGE, clock=time.monotonic, shared=None):
        # The host's state (relay.state.State) when it is shared between processes.
        self.shared = shared
        self._pending: set[asyncio.Task] = set()
        self._unread, self._unwritten = Seldom(log), Seldom(log)
        self.unowned = Seldom(log)  # continuations refused for an owner not known
        self.unread = 0  # reads of the shared state that failed
        self.max_threads = max_threads
        self.max_bytes = max_bytes
        self.max_age = max_age
        self.clock = clock
        self.bytes = 0
        self._entries: collections.OrderedDict[
            object, tuple[float, str, bytes, dict, dict, str | None]] = \
            collections.OrderedDict()
        # Answer id -> the name of the inbound key it was given to (see MAX_OWNERS), least
        # recently given first out.
        self.max_owners = MAX_OWNERS
        self._owners: collections.OrderedDict[str, str] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    async def fetch(self, message_id) -> Record | None:
        """:meth:`get`, and from the shared state when this process has no record. A state
        out of reach is a record not found (the request is then forwarded or refused as for
        any thread the relay did not see)."""
        found = self.get(message_id)
        if found is not None or self.shared is None:
            return found
        try:
            value = (await self.shared.get(NAMESPACE, [_shared_key(message_id)]))[0]
        except Exception as e:  # Unavailable, or a backend's own failure
            self._unread.warn(1, "threads: the shared record could not be read: %s", e)
            self.unread += 1
            return None
        if value is None:
            return None
        try:
            doc = orjson.loads(value)
            # Copies of their own size: orjson's output keeps the buffer it was written into
            # (about 4 KiB for a short value) for as long as it lives, and these are kept.
            entry = (doc["backend"], bytes(memoryview(orjson.dumps(doc["conversation"]))),
                     doc["renamed"], {name: bytes(memoryview(orjson.dumps(field)))
                                      for name, field in doc["fields"].items()},
                     doc.get("credential"))
        except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
            return None
        self._keep(message_id, *entry)
        return entry

    def own(self, message_id) -> None:
        """Note that the answer ``message_id`` names (``(key name, answer id)``) was given to
        that inbound key: in process, and in the shared state when there is one. Without
        auth (no key name) there is no other tenant to keep out."""
        key_name, answer_id = _split(message_id)
        if key_name is None:
            return
        owners = self._owners
        known = owners.get(answer_id)
        owners[answer_id] = key_name
        owners.move_to_end(answer_id)
        while len(owners) > self.max_owners:
            owners.popitem(last=False)
        if known != key_name and self.shared is not None:
            try:
                self.shared.put_soon(OWNERS, {answer_id: key_name.encode()}, OWNER_AGE)
            except Exception as e:  # Unavailable, or a backend's own failure
                self._unwritten.warn(1, "threads: the answer's owner could not be shared: %s",
                                     e)

    async def lookup(self, message_id, settle: bool) -> tuple[Record | None, str | None]:
        """:meth:`fetch` and, without a record, :meth:`owner`; with ``settle``, in a shared
        state that answers, read again for a while (:data:`SETTLE`) while neither is
        found."""
        unread = self.unread
        found = await self.fetch(message_id)
        if found is not None:
            return found, None
        owner = await self.owner(message_id)
        if owner is not None or self.shared is None or not settle:
            return None, owner
        for pause in SETTLE:
            if self.unread != unread:  # out of reach: waiting brings nothing
                break
            await asyncio.sleep(pause)
            found = await self.fetch(message_id)
            if found is not None:
                return found, None
            owner = await self.owner(message_id)
            if owner is not None:
                return None, owner
        return None, None

    async def owner(self, message_id) -> str | None:
        """The name of the inbound key the answer ``message_id`` names was given to, known
        in process, else from the shared state; None when unknown (a state out of reach is
        an owner not found) and without auth."""
        key_name, answer_id = _split(message_id)
        if key_name is None:
            return None
        owner = self._owners.get(answer_id)
        if owner is None and self.shared is not None:
            try:
                value = (await self.shared.get(OWNERS, [answer_id]))[0]
            except Exception as e:  # Unavailable, or a backend's own failure
                self._unread.warn(1, "threads: the answer's owner could not be read: %s", e)
                self.unread += 1
                return None
            owner = value.decode("utf-8", "replace") if value is not None else None
        return owner

    def get(self, message_id) -> Record | None:
        """``(backend name, conversation as JSON, renamed ids, the fields the thread was
        created with, the pooled credential that holds it)`` recorded under
        ``message_id``."""
        self._expire()
        entry = self._entries.get(message_id)
        if entry is None:
            return None
        self._entries.move_to_end(message_id)
        self._entries[message_id] = (self.clock(), *entry[1:])
        return entry[1:]

    def put(self, message_id, backend: str, conversation: bytes,
            renamed: dict | None = None, fields: dict[str, bytes] | None = None,
            credential: str | None = None) -> bool:
        """Record a conversation (the answer's ids the relay renamed for the client, the
        create-only fields as JSON text, and the pooled credential that holds it); False
        when it alone is larger than the whole record."""
        fields = fields or {}
        kept = self._keep(message_id, backend, conversation, renamed or {}, fields, credential)
        if kept and self.shared is not None and _size(conversation, fields) <= MAX_SHARED_BYTES:
            doc = orjson.dumps({"backend": backend, "conversation": orjson.Fragment(conversation),
                                "renamed": renamed or {},
                                "fields": {k: orjson.Fragment(v) for k, v in fields.items()},
                                "credential": credential})
            self._share(self.shared.put(NAMESPACE, {_shared_key(message_id): doc},
                                        self.max_age))
        return kept

    def _keep(self, message_id, backend: str, conversation: bytes, renamed: dict,
              fields: dict, credential: str | None = None) -> bool:
        self._forget(message_id)
        size = _size(conversation, fields)
        if size > self.max_bytes:
            return False
        self._entries[message_id] = (self.clock(), backend, conversation, renamed, fields,
                                     credential)
        self.bytes += size
        while len(self._entries) > self.max_threads or self.bytes > self.max_bytes:
            self._drop_oldest()
        return True

    def pop(self, message_id) -> None:
        self._forget(message_id)
        if self.shared is not None:
            self._share(self.shared.delete(NAMESPACE, [_shared_key(message_id)]))

    def _forget(self, message_id) -> None:
        entry = self._entries.pop(message_id, None)
        if entry is not None:
            self.bytes -= _size(entry[2], entry[4])

    def _share(self, write) -> None:
        """Write to the shared state in the background (the answer is not held for it); a
        write that fails is logged: the record then stays in this process only."""
        if len(self._pending) >= MAX_PENDING:
            write.close()
            return
        task = asyncio.ensure_future(write)
        self._pending.add(task)
        task.add_done_callback(self._written)

    def _written(self, task: asyncio.Task) -> None:
        self._pending.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._unwritten.warn(1, "threads: the shared record could not be written: %s",
                                 task.exception())

    def _drop_oldest(self) -> None:
        message_id, entry = self._entries.popitem(last=False)
        self.bytes -= _size(entry[2], entry[4])

    def _expire(self) -> None:
        limit = self.clock() - self.max_age
        while self._entries:
            used = next(iter(self._entries.values()))[0]
            if used >= limit:
                return
            self._drop_oldest()


def _split(message_id) -> tuple[str | None, str]:
    return message_id if type(message_id) is tuple else (None, message_id)


def _shared_key(message_id) -> str:
    key_name, answer_id = _split(message_id)
    return f"{key_name or ''}\x00{answer_id}"


def _size(conversation: bytes, fields: dict[str, bytes]) -> int:
    return len(conversation) + sum(len(value) for value in fields.values())


# --- what the rules see -------------------------------------------------------------------


def conversation(exchange) -> tuple[list, int]:
    """The conversation the history rules judge, and where the request's own messages start
    in it: the held head and the request's messages when the relay knows the head, else the
    request's messages alone (at 0)."""
    messages = exchange.messages
    thread = exchange.thread
    if thread is None or thread.head is None or type(messages) is not list:
        return messages, 0
    return thread.head + messages, len(thread.head)


def shifted(location: str, text: str, offset: int) -> tuple[str, str]:
    """``(location, text)`` of a finding at ``location`` (``messages.N...``) in the whole
    conversation, renamed after the request's own messages, as the client sent them."""
    if not offset or not location.startswith("messages."):
        return location, text
    number, dot, rest = location[len("messages."):].partition(".")
    if not number.isdigit():
        return location, text
    renamed = f"messages.{int(number) - offset}{dot}{rest}"
    return renamed, renamed + text[len(location):] if text.startswith(location) else text


def index_of(location: str) -> int:
    """The message index a location names (``messages.3.content.0`` is 3), or -1."""
    number = location[len("messages."):].partition(".")[0]
    return int(number) if location.startswith("messages.") and number.isdigit() else -1


def opens_with_held_calls(messages: list) -> int:
    """How many of a continuation's first messages belong to turns that may answer (or
    continue) the held part's calls. The held part ends with the answer named by
    ``previous_message_id``: assistant messages that open the request continue that turn,
    and the user messages after them answer it."""
    i = 0
    while i < len(messages) and _role(messages[i]) in ("assistant", "system"):
        i += 1
    while i < len(messages) and _role(messages[i]) in ("user", "system"):
        i += 1
    return i


def _role(message) -> str | None:
    return message.get("role") if type(message) is dict else None


# --- the host's part ----------------------------------------------------------------------


async def prepare(store: Store, exchange, tenants=lambda: 0, moved: bool = False) -> None:
    """Read the request's ``thread`` and put on the exchange what the relay knows of the held
    part: forwarded to a backend that holds the thread, carried (see the module's docs) where
    the relay recorded it and the backend does not hold it, refused the API's way where
    neither holds it. ``tenants()``: how many inbound keys the relay serves (0 without
    auth). ``moved``: the pooled credential that holds the thread cannot take it (see
    :class:`ThreadMoved`). Costs a field lookup without ``thread``."""
    thread = requested(exchange.field("thread"))
    if thread is None:
        return  # the exchange's class says so already
    exchange.thread = thread
    backend = exchange.backend
    # Waited for only where finding nothing is a refusal: forwarded unseen, the request
    # would pay the wait at every turn.
    refusing = not backend.holds_threads or moved \
        or exchange.key_name is not None and tenants() > 1
    found, owner = await store.lookup(_key(exchange, thread.previous_id), refusing) \
        if thread.previous_id is not None else (None, None)
    if found is None and thread.previous_id is not None:
        _check_owner(store, exchange, thread, owner, tenants)
    if found is not None:
        try:
            head = orjson.loads(found[1])
        except orjson.JSONDecodeError:  # not written by ``record``: treat it as unseen
            found = head = None
    holds = backend.holds_threads and not moved and (found is None or found[0] == backend.name)
    if thread.kind == "create" and not backend.holds_threads or not holds and found:
        if found:
            _carry(exchange, thread, head, found[1], found[3],
                   "the credential that holds this thread cannot take it now (cooling, out "
                   "or at its limits), and another account of the pool holds none of it: "
                   "the relay sends the conversation it recorded, without `thread`"
                   if moved else None)
        else:
            _carry(exchange, thread, [], None, None)
        return
    if moved:
        # Its record went between the two preparations: no account of the pool holds the
        # thread now, and the relay cannot carry it.
        exchange.note("relay", "thread refused", kind=thread.kind, backend=backend.name,
                      previous_message_id=thread.previous_id,
                      reason="the credential that holds this thread cannot take it now, and "
                             "the relay has no record of it to carry to another")
        exchange.flag("thread-not-recorded")
        raise ThreadNotFound(thread.previous_id or "")
    if not backend.holds_threads:
        if thread.previous_id is None:  # a `thread` value the relay cannot read
            exchange.note("relay", "thread refused", kind=thread.kind, backend=backend.name,
                          reason="the backend holds no threads (holds_threads: false) and "
                                 "the relay cannot read this `thread`")
            raise ThreadUnsupported()
        # The relay is the thread's server here, and it holds no state for this id: the API's
        # answer to such a continuation is thread_not_found, from which the SDKs replay the
        # history under a new thread (thread_unsupported_request would have the SDK's thread
        # helper raise, its default, and its tool runner stop threading for good).
        exchange.note("relay", "thread refused", kind=thread.kind, backend=backend.name,
                      previous_message_id=thread.previous_id,
                      reason="the backend holds no threads (holds_threads: false) and the "
                             "relay has no record of this one to carry (evicted, expired, "
                             "or recorded by another replica): answered as the API answers "
                             "a thread it holds no state for")
        exchange.flag("thread-not-recorded")
        raise ThreadNotFound(thread.previous_id)
    if thread.kind == "create":
        return
    if found is not None:
        thread.head, thread.recorded, thread.renamed = head, found[1], found[2]
        # A continuation sends no create-only fields: the next turn's record keeps the ones
        # the thread was created with, for a backend it may be carried to later.
        thread.fields = found[3]
        if backend.credentials:
            thread.credential = found[4]
        exchange.note("relay", "thread head known", previous_message_id=thread.previous_id,
                      messages=len(head))
        return
    exchange.note("relay", "thread head unseen", previous_message_id=thread.previous_id,
                  reason="this relay did not see the earlier turns: the rules judge only "
                         "what the request holds, and the upstream judges the rest")
    exchange.flag("thread-head-unseen")


def _check_owner(store: Store, exchange, thread: Thread, owner: str | None, tenants) -> None:
    """Refuse a continuation the relay has no record of when it may be another inbound key's
    thread: given to another key, or, with several keys, to a key the relay does not know
    (the owner index lost it: a restart or another replica without a shared state, past its
    bounds, the state out of reach). The upstream holds every key's threads under the
    operator's credential, so forwarding it could have the model answer from another key's
    conversation. The API's answer to a thread it cannot find costs the client a replay of
    its own history (the SDKs' ``_REPLAY_ERROR_CODES``); with one key or none there is no
    other tenant to keep out, and the request goes on."""
    if owner is not None and owner != exchange.key_name:
        exchange.note("relay", "thread refused", kind=thread.kind,
                      previous_message_id=thread.previous_id,
                      reason="the relay gave this answer to another inbound key")
        raise ThreadNotFound(thread.previous_id or "")
    if owner is None and exchange.key_name is not None and exchange.backend.holds_threads \
            and tenants() > 1:
        exchange.note("relay", "thread refused", kind=thread.kind,
                      previous_message_id=thread.previous_id,
                      reason="the relay does not know which inbound key this answer went to "
                             "(a restart or another replica without a shared state, or past "
                             "the owner index's bounds), and it serves several: answered as "
                             "the API answers a thread it cannot find, so that the client "
                             "replays its own history")
        exchange.flag("thread-owner-unknown")
        store.unowned.warn(1, "threads: %s: a continuation of an answer whose inbound key "
                              "this relay does not know was answered 404 thread_not_found, "
                              "and the client replays its history (a shared state: lets "
                              "every worker and replica, and a restart, know the keys)",
                           exchange.id)
        raise ThreadNotFound(thread.previous_id or "")


def _carry(exchange, thread: Thread, head: list, recorded: bytes | None,
           fields: dict[str, bytes] | None, reason: str | None = None) -> None:
    """Send the whole conversation up in place of a thread the backend does not hold: the
    turns recorded (without their cache breakpoints, see :func:`without_cache_control`),
    and the fields a thread keeps from its ``create`` (``system``, ``tools``), which a
    continuation may not send."""
    messages = exchange.messages
    if type(messages) is not list or type(head) is not list:
        raise ThreadUnsupported()
    messages[:0] = without_cache_control(head)
    for name, value in (fields or {}).items():
        exchange.set_field(name, msgspec.Raw(value))
    exchange.drop_field("thread")
    thread.fields = fields
    exchange.mark_changed()
    beta_filter.filter_header(exchange.upstream_headers, {"drop_betas": [BETA]})
    thread.carried, thread.recorded = len(head), recorded
    exchange.note("relay", "thread carried", kind=thread.kind, backend=exchange.backend.name,
                  previous_message_id=thread.previous_id, messages=len(head),
                  reason=reason or "the backend does not hold this thread: the relay sends "
                                   "the conversation it recorded, without `thread`")


# The keys of a message or block whose values hold blocks (the SDK's KEYS_THAT_HOLD_BLOCKS,
# ``lib/threads/_thread_state.py``): a tool's ``input`` and other free-form data are not.
_HOLD_BLOCKS = ("content", "source", "tool", "definition", "tool_references")


def without_cache_control(value):
    """A copy of the recorded turns ``value`` without the ``cache_control`` of any block in
    them, as the SDK resends a thread's history unthreaded: each breakpoint was set for the
    turn that first sent it, and the API takes at most four in a request ("A maximum of 4
    blocks with cache_control may be provided"), so a thread carried past its fourth turn
    with the client's marker on every turn would be refused."""
    if type(value) is dict:
        return {key: without_cache_control(item) if key in _HOLD_BLOCKS else item
                for key, item in value.items() if key != "cache_control"}
    if type(value) is list:
        return [without_cache_control(item) for item in value]
    return value


def carried_error(error: RelayError, thread: Thread | None) -> RelayError:
    """A refusal of a carried conversation, its ``messages.N`` locations named at the
    client's own indexes (``messages.N`` of the part the relay carried stays, and says so)."""
    if thread is None or not thread.carried:
        return error
    offset = thread.carried

    def own(match: re.Match) -> str:
        n = int(match.group(1))
        return f"messages.{n - offset}" if n >= offset \
            else f"messages.{n} (of the thread's earlier turns)"

    message = _LOCATION.sub(own, error.message)
    if message != error.message:
        error.message = message
    return error


_LOCATION = re.compile(r"messages\.(\d+)")


def record(store: Store, exchange, answer) -> None:
    """After a successful answer to a thread request (``answer``: the message as the client
    got it), keep the conversation up to it under its id, and forget the one it continued:
    the API lets each answer be continued once (``thread_already_continued``)."""
    thread = exchange.thread
    if thread is None or type(answer) is not dict:
        return
    message_id = answer.get("id")
    if type(message_id) is not str:
        return
    # Whatever is kept of the conversation: the upstream may hold it under this id.
    store.own(_key(exchange, message_id))
    content = answer.get("content")
    if thread.kind == "other" or thread.unseen or type(content) is not list:
        return
    try:
        top = _top_level.decode(exchange.raw_body)
        sent = _messages_json(top)
    except (msgspec.MsgspecError, KeyError, TypeError):
        return
    fields = thread.fields if thread.fields is not None else {
        name: bytes(top[name]) for name in CREATE_ONLY if name in top}
    reply = orjson.dumps([{"role": "assistant", "content": content}])
    if thread.previous_id is not None:
        store.pop(_key(exchange, thread.previous_id))
    # The relay's renames of this answer's calls (the dedup plugin's ``to_client`` entries in
    # the shared translation table): the server holds the upstream's ids.
    renamed = {}
    for client_id in exchange.translation:
        held = _held_id(exchange.translation, client_id)
        if held is not None:
            renamed[client_id] = held
    # A carried thread is held by no backend: its next turn is carried again, wherever it goes.
    # A held one, by the account of the pooled credential that answered.
    carried = thread.carried is not None
    store.put(_key(exchange, message_id), "" if carried else exchange.backend.name,
              _joined(thread.recorded or b"[]", sent, reply), renamed, fields,
              None if carried or not exchange.backend.credentials else exchange.credential)


def own_stream(store: Store, exchange, tap: Tap) -> None:
    """After a stream to a thread request, however it ended: the answer it began is the
    inbound key's (see :data:`MAX_OWNERS`)."""
    answer_id = tap.answer_id()
    if answer_id is not None:
        store.own(_key(exchange, answer_id))


def held_prompt(exchange, body: bytes) -> bytes | None:
    """The request the server builds from ``body`` (what goes up) for a continuation whose
    head it holds and the relay recorded: the recorded turns before its own messages, with
    the fields the thread was created with, without ``thread``. None where the relay did not
    see the head. The recorded turns are the client's: where a plugin renamed an id on the
    way up, the server's own differ there."""
    thread = exchange.thread
    if thread is None or not thread.continues or thread.recorded is None:
        return None
    try:
        top = _top_level.decode(body)
        messages = _messages_json(top)
    except (msgspec.MsgspecError, KeyError, TypeError):
        return None
    top["messages"] = msgspec.Raw(_joined(thread.recorded, messages))
    for name, value in (thread.fields or {}).items():
        top[name] = msgspec.Raw(value)
    top.pop("thread", None)
    return msgspec.json.encode(top)


def _held_id(table: dict, client_id: str) -> str | None:
    """The id the upstream gave the call the client holds as ``client_id``, following the
    answer's renames back (each plugin renames what the one after it handed on: dedup's
    ``-2`` of portable's encoding of the upstream's own id), or None if none renamed it."""
    held = None
    for _ in range(len(table)):
        entry = table.get(client_id)
        if type(entry) is not dict or entry.get("direction") != "to_client":
            break
        previous = entry.get("emitted", entry.get("original"))
        if type(previous) is not str or previous == client_id:
            break
        held = client_id = previous
    return held


def _key(exchange, message_id: str):
    """Records are kept per inbound key (when auth is on): one client's thread is no other's
    to judge against, or to use up."""
    return exchange.key_name, message_id


_top_level = msgspec.json.Decoder(dict[str, msgspec.Raw])
_messages = msgspec.json.Decoder(list[msgspec.Raw])


def _messages_json(top: dict) -> bytes:
    """The request's ``messages`` as the client's own JSON text, found without decoding it."""
    messages = bytes(top["messages"])
    if not messages.startswith(b"["):
        raise TypeError("messages is not a list")
    return messages


def _joined(*arrays: bytes) -> bytes:
    """JSON arrays joined into one, as text."""
    inner = [array.strip()[1:-1].strip() for array in arrays]
    return b"[" + b",".join(part for part in inner if part) + b"]"


def restore_held_ids(exchange) -> None:
    """After the plugins: results in the request's opening user turn that answer a held call
    under the id the relay gave the client go up under the id the server holds."""
    thread = exchange.thread
    if thread is None or not thread.renamed:
        return
    messages = exchange.messages
    if type(messages) is not list:
        return
    restored = []
    for message in messages[:opens_with_held_calls(messages)]:
        content = message.get("content") if type(message) is dict else None
        if type(content) is not list:
            continue
        for block in content:
            if type(block) is dict and block.get("type") == "tool_result":
                upstream_id = thread.renamed.get(block.get("tool_use_id"))
                if upstream_id is not None:
                    restored.append(block["tool_use_id"])
                    block["tool_use_id"] = upstream_id
    if restored:
        exchange.mark_changed()
        exchange.note("relay", "restored held ids", tool_use_ids=restored,
                      reason="the server holds the answer's calls under the upstream's ids")


def message_from_events(events) -> dict | None:
    """The message a stream's events build (``id`` and ``content``), as the SDK's stream
    accumulator builds it for the client, or None for a stream that did not reach
    ``message_stop``."""
    message = None
    # Keyed by the events' ``index`` as it came: an int from a sound server, but whatever
    # JSON holds from another (``_sort_key`` puts those first).
    blocks: dict[Any, dict] = {}
    partial: dict[Any, list[str]] = {}
    for event in events:
        data = event.data
        if type(data) is not dict:
            continue
        kind = data.get("type")
        if kind == "message_start" and type(data.get("message")) is dict:
            message = dict(data["message"])
        elif kind == "content_block_start" and type(data.get("content_block")) is dict:
            blocks[data.get("index")] = dict(data["content_block"])
        elif kind == "content_block_delta":
            block, delta = blocks.get(data.get("index")), data.get("delta")
            if block is None or type(delta) is not dict:
                continue
            dtype = delta.get("type")
            if dtype == "text_delta":
                block["text"] = block.get("text", "") + delta.get("text", "")
            elif dtype == "input_json_delta":
                partial.setdefault(data.get("index"), []).append(delta.get("partial_json", ""))
            elif dtype == "thinking_delta":
                block["thinking"] = block.get("thinking", "") + delta.get("thinking", "")
            elif dtype == "signature_delta":
                block["signature"] = block.get("signature", "") + delta.get("signature", "")
            elif dtype == "citations_delta":
                # The API opens a text block with `"citations": null`.
                if type(block.get("citations")) is not list:
                    block["citations"] = []
                block["citations"].append(delta.get("citation"))
            elif dtype == "compaction_delta":
                # The summary and its opaque metadata come in the delta, not the block's
                # start; the SDK's accumulator takes both from it.
                block["content"] = delta.get("content")
                block["encrypted_content"] = delta.get("encrypted_content")
        elif kind == "message_stop" and message is not None:
            for index, pieces in partial.items():
                text = "".join(pieces)
                try:
                    blocks[index]["input"] = orjson.loads(text) if text else {}
                except orjson.JSONDecodeError:
                    return None
            message["content"] = [blocks[i] for i in sorted(blocks, key=_sort_key)]
            return message
    return None


def _sort_key(index) -> int:
    return index if type(index) is int else -1


class Tap:
    """Keeps what a stream wrote to the client, up to ``limit`` bytes, for :func:`record`;
    past the limit it keeps nothing (the answer is then not recorded) but the answer's id."""

    __slots__ = ("write", "limit", "parts", "size", "started")

    def __init__(self, write, limit: int = MAX_STREAM_BYTES):
        self.write = write
        self.limit = limit
        self.parts: list[bytes] | None = []
        self.size = 0
        self.started: str | None = None  # the answer's id, once ``parts`` is let go

    async def __call__(self, data: bytes) -> None:
        if self.parts is not None:
            self.size += len(data)
            self.parts.append(data)
            if self.size > self.limit:
                self.started = self.answer_id()
                self.parts = None
        await self.write(data)

    def answer_id(self) -> str | None:
        """The id of the answer the stream began (its ``message_start``'s), however far it
        got: the upstream may hold the answer whether or not the client saw it end."""
        if self.parts is None:
            return self.started
        decoder = SSEDecoder()
        for part in self.parts:
            for event in decoder.feed(part):
                data = event.data
                if type(data) is dict and data.get("type") == "message_start":
                    message = data.get("message")
                    answer_id = message.get("id") if type(message) is dict else None
                    return answer_id if type(answer_id) is str else None
        return None

    def message(self) -> dict | None:
        if self.parts is None:
            return None
        decoder = SSEDecoder()
        events = decoder.feed(b"".join(self.parts))
        events.extend(decoder.close())
        return message_from_events(events)
