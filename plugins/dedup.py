"""Make every tool_use id the client sees unique, without unpairing any result from its call.

Some upstreams draw their tool_use ids from a small space and, deep in a long conversation,
reuse one. Older clients send the duplicate back and the upstream answers 400; Claude Code
2.1.x silently drops the repeated call (its work is lost; a model that asks again loops). So:

- Upstream -> client: an id the client already holds (anywhere in the history it sent, or
  earlier in the same answer) reaches it as ``<original><sep>N`` — ``toolu_abc``,
  ``toolu_abc-2``, ``toolu_abc-3`` — N being the occurrence, bumped past any id already taken.
  When streaming, the rewrite happens on ``content_block_start``, before any delta of the block.
- Client -> upstream, every request, over the whole ``messages`` array: by default the upstream
  gets ids unique in the request (``-N`` ids go up as they are; exact duplicates already in the
  history are rewritten together with the results that answer them). With the
  ``restore_original_ids`` quirk, ``<id><sep>N`` goes back to ``<id>``, for backends that must
  see their own ids again, except where that would repeat an id within one message (an
  upstream that repeated an id inside one answer: see :func:`restore_originals`).

Any id ending in ``<sep><integer >= 2>`` counts as a rewrite, so recognition survives a
compaction that dropped the first occurrence. Nothing is kept between requests: every
decision follows from the request itself, and a decision about ``messages[i]`` only from
``messages[:i+1]``, so earlier turns never change as the conversation grows (prompt caching
depends on that).

A request that continues a server-held thread (:mod:`relay.threads`) is walked together with
the held part where the relay saw it, so its ids and the answer's are unique in the whole
conversation; where it did not, within the request.

Options (plugin options or backend quirks): see ``OPTIONS``.
"""

from __future__ import annotations

from relay import skeleton, threads
from relay.hookspecs import hookimpl
from relay.options import Option

PLUGIN = "dedup"
# The request walk goes on from where the session's previous request ended (relay.resume).
RESUMABLE = True
DEFAULT_SEPARATOR = "-"


def _separator(sep: str) -> str | None:
    if not sep or any(c.isdigit() for c in sep):
        return f"must be a non-empty string without digits, not {sep!r}"
    return None


OPTIONS = (
    Option("dedup_tool_ids", bool, True, "rewrite repeated tool_use ids at all", quirk=True),
    Option("restore_original_ids", bool, False,
           "the upstream matches calls against its own ids: `id-N` goes back up as `id`",
           quirk=True),
    Option("dedup_separator", str, DEFAULT_SEPARATOR,
           "the suffix separator, for backends whose own ids contain `-`", quirk=True,
           check=_separator),
)


def split_suffix(tool_id: str, sep: str) -> tuple[str, int]:
    """``("toolu_abc", 3)`` for ``toolu_abc-3``; ``(tool_id, 1)`` for an id without a suffix.

    A suffix is the separator and an integer >= 2 without leading zero, after a non-empty head.
    """
    if sep not in tool_id:
        return tool_id, 1
    head, _, tail = tool_id.rpartition(sep)
    if tail.isdigit() and tail.isascii() and tail[0] != "0" and tail != "1" and head:
        return head, int(tail)
    return tool_id, 1


class Ledger:
    """The ids already taken in a conversation, and how often each original occurred.

    ``fresh`` hands out the next ``<base><sep>N``: N is one more than the occurrences of
    ``base`` so far (at least 2), bumped past taken ids. ``next_free`` remembers where the
    last bump ended; ids never leave ``taken``, so the search never rescans the same numbers
    and a history full of suffixed ids still costs linear time.
    """

    __slots__ = ("sep", "taken", "counts", "next_free")

    def __init__(self, sep: str):
        self.sep = sep
        self.taken: set[str] = set()
        self.counts: dict[str, int] = {}
        self.next_free: dict[str, int] = {}

    def fresh(self, base: str) -> tuple[str, int]:
        n = max(self.counts.get(base, 0) + 1, self.next_free.get(base, 2), 2)
        candidate = f"{base}{self.sep}{n}"
        while candidate in self.taken:
            n += 1
            candidate = f"{base}{self.sep}{n}"
        self.next_free[base] = n + 1
        return candidate, n

    def claim(self, tool_id: str, original: str) -> None:
        self.taken.add(tool_id)
        self.counts[original] = self.counts.get(original, 0) + 1

    def issue(self, emitted: str, restore: bool) -> tuple[str, str, int] | None:
        """Take the id an upstream just emitted; return (new id, original, N) if it must change.

        In restore mode a rewrite is later undone by stripping exactly one suffix, so an
        emitted id that merely looks like a rewrite (``call-2``) gets a suffix of its own too.
        """
        original, _ = split_suffix(emitted, self.sep)
        if restore:
            if emitted not in self.taken and original == emitted:
                self.claim(emitted, original)
                return None
            base = emitted
            # The upstream will get ``emitted`` back for the id issued now: no later call of
            # this answer may be issued ``emitted`` itself, or restoring could give one
            # message two equal ids.
            self.taken.add(emitted)
        elif emitted not in self.taken:
            self.claim(emitted, original)
            return None
        else:
            base = original
        new_id, n = self.fresh(base)
        self.claim(new_id, base)
        return new_id, base, n


class Walk:
    """What one pass over a request's history did, and the ledger it leaves for the answer."""

    __slots__ = ("kept", "ledger", "recognised", "tool_results", "tool_uses")

    def __init__(self, sep: str):
        self.ledger = Ledger(sep)
        # (i, client id, new id, original, N)
        self.tool_uses: list[tuple[int, str, str, str, int]] = []
        self.tool_results = 0  # tool_result blocks whose tool_use_id changed
        self.recognised: list[tuple[int, str, str, int]] = []  # (i, id, original, N) sent as is
        self.kept: list[tuple[int, str]] = []  # restore mode: (i, id) not restored, see there

    @property
    def changed(self) -> bool:
        return bool(self.tool_uses or self.tool_results)


def make_unique(messages: list, sep: str = DEFAULT_SEPARATOR, answer: bool = True,
                resume=None) -> Walk:
    """Rewrite ``messages`` in place so that its tool_use ids are unique (the default mode).

    A tool_use whose id is already taken by an earlier upstream-bound tool_use becomes
    ``<original><sep>N``; the results in the next user message follow their call, matched
    per id in order, so two parallel calls sharing an id keep their two results. With
    ``answer`` (an answer with content will follow), the walk's ledger ends up holding every
    id of the history — upstream-bound, as the client sent it, and every tool_result's — for
    the answer to be checked against; without it, only what the walk itself needs.

    With ``resume`` (a :class:`relay.resume.Resume`), the walk starts at ``resume.start``
    from the state saved there, and saves its state at each of ``resume.marks``: a decision
    about ``messages[i]`` follows from ``messages[:i+1]`` alone, so walking on from a
    boundary decides what the whole walk would.
    """
    walk = Walk(sep)
    # The results' ids not among the calls' when they came (the others are in the ledger
    # already): what the answer's ledger holds besides the calls'.
    answered: set[str] = set()
    calls = None  # the previous assistant message's content and renamed blocks, if any changed
    start, marks = 0, range(0)
    if resume is not None:
        start, marks = resume.start, resume.marks
        if start:
            saved = resume.state(PLUGIN)
            if saved is None:
                resume.decline()
            calls = _restore(walk, answered, saved)
    at = start
    snapshot = None
    for mark in marks:
        if mark >= at:
            calls = _unique_walk(messages, at, mark, walk, answered, calls, answer)
            # Only an assistant message changes the ledger and the calls' lists: past user
            # messages alone, the previous mark's copies of them are this one's too (a
            # record's states are used once, by one request).
            shared = snapshot if snapshot is not None and not any(
                type(message) is dict and message.get("role") == "assistant"
                for message in messages[at:mark]) else None
            at = mark
            snapshot = _snapshot(walk, answered, calls, shared)
            resume.save(PLUGIN, mark, snapshot, walk.changed)
    calls = _unique_walk(messages, at, len(messages), walk, answered, calls, answer)
    walk.ledger.taken.update(answered)
    return walk


def _snapshot(walk: Walk, answered: set, calls, shared: tuple | None = None) -> tuple:
    """The walk's state at a boundary, as values (the next request's walk goes on from a
    copy: nothing here refers to a message, which later plugins may change); ``shared``: an
    earlier snapshot of this walk whose ledger and calls' lists are still the walk's."""
    ledger = walk.ledger
    if calls is not None and type(calls) is not dict:
        calls = _result_queues(*calls)
    if calls is not None:
        calls = {key: list(queue) for key, queue in calls.items()}
    if shared is not None:
        taken, counts, next_free, _, tool_uses, _, recognised, _ = shared
        return (taken, counts, next_free, set(answered), tool_uses, walk.tool_results,
                recognised, calls)
    return (set(ledger.taken), dict(ledger.counts), dict(ledger.next_free), set(answered),
            list(walk.tool_uses), walk.tool_results, list(walk.recognised), calls)


def _restore(walk: Walk, answered: set, saved: tuple):
    """Go on from a snapshot (taken over: a record is used once)."""
    taken, counts, next_free, answered_before, tool_uses, tool_results, recognised, calls = saved
    ledger = walk.ledger
    ledger.taken, ledger.counts, ledger.next_free = taken, counts, next_free
    answered.update(answered_before)
    walk.tool_uses, walk.tool_results, walk.recognised = tool_uses, tool_results, recognised
    return calls


def _unique_walk(messages: list, lo: int, hi: int, walk: Walk, answered: set, calls,
                 answer: bool):
    """:func:`make_unique` over ``messages[lo:hi]``; returns what the next user message's
    results follow (the renamed calls before it, or their result queues)."""
    ledger = walk.ledger
    seen = ledger.taken  # while walking: exactly the upstream-bound tool_use ids so far
    counts = ledger.counts
    sep = ledger.sep
    for i in range(lo, hi):
        message = messages[i]
        if type(message) is not dict:
            continue
        role = message.get("role")
        if role == "assistant":
            calls = None
            content = message.get("content")
            if type(content) is not list:
                continue
            # The client's ids of the blocks rewritten here, by id(block).
            renamed: dict[int, str] | None = None
            for block in content:
                if type(block) is not dict or block.get("type") != "tool_use":
                    continue
                client_id = block.get("id")
                if type(client_id) is not str:
                    continue
                if sep in client_id:
                    original, n = split_suffix(client_id, sep)
                else:  # the common case, without a call
                    original, n = client_id, 1
                if client_id in seen:
                    upstream_id, n = ledger.fresh(original)
                    block["id"] = upstream_id
                    walk.tool_uses.append((i, client_id, upstream_id, original, n))
                    if renamed is None:
                        renamed = {}
                        calls = (content, renamed)
                    renamed[id(block)] = client_id
                    seen.add(upstream_id)
                else:
                    if n > 1:
                        walk.recognised.append((i, client_id, original, n))
                    seen.add(client_id)
                counts[original] = counts.get(original, 0) + 1
        elif role == "user":
            content = message.get("content")
            if type(content) is not list:
                calls = None
                continue
            if calls is None:
                queues = None
            else:
                queues = calls if type(calls) is dict else _result_queues(*calls)
            calls = None
            for block in content:
                if type(block) is not dict or block.get("type") != "tool_result":
                    continue
                client_id = block.get("tool_use_id")
                if type(client_id) is not str:
                    continue
                if answer and client_id not in seen:
                    answered.add(client_id)
                if queues:
                    queue = queues.get(client_id)
                    if queue:
                        upstream_id = queue.pop()
                        if upstream_id != client_id:
                            block["tool_use_id"] = upstream_id
                            walk.tool_results += 1
    return calls


def _result_queues(content: list, renamed: dict) -> dict[str, list[str]]:
    """Per client id, the upstream ids of the calls that carry it, last first (pop() is next)."""
    queues: dict[str, list[str]] = {}
    for block in reversed(content):
        if type(block) is dict and block.get("type") == "tool_use":
            upstream_id = block.get("id")
            if type(upstream_id) is str:
                queues.setdefault(renamed.get(id(block), upstream_id), []).append(upstream_id)
    return queues


def restore_originals(messages: list, sep: str = DEFAULT_SEPARATOR, answer: bool = True) -> Walk:
    """Strip one recognised suffix from every tool_use id and tool_result tool_use_id, in place.

    One exception keeps every message valid: when the upstream repeated an id within one
    answer, the client got ``X`` and ``X-2`` for it, and sending both back as ``X`` would give
    one assistant message two equal ids (and its user message two results for one id), which
    no upstream can pair and the API refuses ("`tool_use` ids must be unique"; a Kimi-like
    upstream, which repeats ids across turns, still wants them distinct within a message).
    So a suffixed id whose original already stands in the same message keeps the client's
    id, and so do the results that answer it in the next user message. Restore mode promises
    the upstream its own ids back; the upstream never had two calls with one id to match, so
    nothing it could match is lost.

    With ``answer``, the ledger holds the ids as the client sent them, for the answer.
    """
    walk = Walk(sep)
    ledger = walk.ledger
    taken = ledger.taken
    counts = ledger.counts
    # The ids kept as sent in the last assistant message, for its results.
    kept: set[str] | None = None
    for i, message in enumerate(messages):
        if type(message) is not dict:
            continue
        role = message.get("role")
        if role == "assistant":
            block_type, field = "tool_use", "id"
            kept = None
        elif role == "user":
            block_type, field = "tool_result", "tool_use_id"
        else:
            continue
        content = message.get("content")
        if type(content) is not list:
            if role == "user":
                kept = None
            continue
        used = None  # the ids this assistant message sends up, once a suffix is seen
        for block in content:
            if type(block) is not dict or block.get("type") != block_type:
                continue
            client_id = block.get(field)
            if type(client_id) is not str:
                continue
            if answer:
                taken.add(client_id)
            original, n = split_suffix(client_id, sep)
            if role == "assistant":
                if answer:
                    counts[original] = counts.get(original, 0) + 1
                if n == 1:
                    continue
                if used is None:
                    used = _unsuffixed_ids(content, sep)
                if original in used:
                    used.add(client_id)
                    if kept is None:
                        kept = set()
                    kept.add(client_id)
                    walk.kept.append((i, client_id))
                    continue
                used.add(original)
                block[field] = original
                walk.tool_uses.append((i, client_id, original, original, n))
            elif n > 1 and (kept is None or client_id not in kept):
                block[field] = original
                walk.tool_results += 1
        if role == "user":
            kept = None
    return walk


def _unsuffixed_ids(content: list, sep: str) -> set[str]:
    """The tool_use ids of an assistant message that go up unchanged in restore mode."""
    found = set()
    for block in content:
        if type(block) is dict and block.get("type") == "tool_use":
            tool_id = block.get("id")
            if type(tool_id) is str and split_suffix(tool_id, sep)[1] == 1:
                found.add(tool_id)
    return found


def duplicate_locations(messages: list) -> list[str]:
    """Where the history repeats a tool_use id, as the API would name each repeat."""
    seen = set()
    found = []
    for i, message in enumerate(messages):
        if type(message) is not dict or message.get("role") != "assistant":
            continue
        content = message.get("content")
        if type(content) is not list:
            continue
        for k, block in enumerate(content):
            if type(block) is dict and block.get("type") == "tool_use":
                tool_id = block.get("id")
                if type(tool_id) is str:
                    if tool_id in seen:
                        found.append(f"messages.{i}.content.{k}")
                    seen.add(tool_id)
    return found


# --- hooks --------------------------------------------------------------------------------


def _settings(options: dict) -> tuple[bool, str, bool]:
    return (options.get("dedup_tool_ids", True) is not False,
            options.get("dedup_separator") or DEFAULT_SEPARATOR,
            bool(options.get("restore_original_ids", False)))


@hookimpl
def relay_request(exchange, options):
    enabled, sep, restore = _settings(options)
    messages = exchange.messages if enabled else None
    if messages is None:
        if exchange.resume is not None:
            exchange.resume.save_all(PLUGIN)
        return
    # A count_tokens answer holds no content, so nothing is kept for it.
    answer = exchange.endpoint == "messages"
    if exchange.resume is None and exchange.thread is None and not skeleton.has_blocks(messages):
        # No content block, so no id: the walk would find nothing and leave an empty ledger,
        # which the answer makes only if it has a call to check (see _answer_state).
        if answer:
            exchange.state[PLUGIN] = len(messages)
        return
    # A thread's held part, where the relay saw it, is walked too (the walk decides each
    # message from those before it, so the request's messages come out as they did when the
    # whole conversation was sent), and the answer is checked against all of it.
    whole, offset = threads.conversation(exchange)
    resume = exchange.resume.usable(messages) if exchange.resume is not None else None
    if resume is not None and (restore or offset):
        if resume.start:
            resume.decline()
        resume = None  # restore mode and threads walk whole
    if restore:
        walk = restore_originals(whole, sep, answer)
    else:
        walk = make_unique(whole, sep, answer, resume)
    if answer:
        exchange.state[PLUGIN] = {"ledger": walk.ledger, "restore": restore,
                                  "message_index": len(messages)}
    if offset:
        _own(walk, offset)
    table = exchange.translation
    if restore:
        for i, client_id, original, _, n in walk.tool_uses:
            table[client_id] = {"original": original, "occurrence": n, "message_index": i,
                                "direction": "restored"}
    else:
        for i, client_id, original, n in walk.recognised:
            table[client_id] = {"original": original, "occurrence": n, "message_index": i,
                                "direction": "history"}
        for i, _, upstream_id, original, n in walk.tool_uses:
            table[upstream_id] = {"original": original, "occurrence": n, "message_index": i,
                                  "direction": "to_upstream"}
    if walk.changed:
        exchange.mark_changed()
        _count(exchange, len(walk.tool_uses))
        exchange.note(PLUGIN, "restored" if restore else "rewrote",
                      direction="restored" if restore else "to_upstream",
                      tool_use_ids=len(walk.tool_uses), tool_result_ids=walk.tool_results)
    if walk.kept:
        exchange.note(PLUGIN, "kept", direction="restored", reason="repeated within one message",
                      ids=[client_id for _, client_id in walk.kept])


def _own(walk: Walk, offset: int) -> None:
    """Keep of a walk over a thread's held part and the request only what concerns the
    request's own messages, at their own indexes."""
    walk.tool_uses = [(i - offset, client_id, new_id, original, n)
                      for i, client_id, new_id, original, n in walk.tool_uses if i >= offset]
    walk.recognised = [(i - offset, sent, original, n)
                       for i, sent, original, n in walk.recognised if i >= offset]
    walk.kept = [(i - offset, tool_id) for i, tool_id in walk.kept if i >= offset]


def _count(exchange, rewritten: int) -> None:
    """Say in ``x-relay-rewrites`` how many tool ids the relay rewrote (both ways). A stream's
    headers go out before its events, so there it counts the request's rewrites only."""
    headers = exchange.response_headers
    headers["x-relay-rewrites"] = str(int(headers.get("x-relay-rewrites", 0)) + rewritten)


def _answer_state(exchange, sep: str, restore: bool) -> dict:
    state = exchange.state.get(PLUGIN)
    if type(state) is dict:
        return state
    # None: the request hook did not see this exchange, so the answer is deduplicated within
    # itself; a count: the request's messages held no block, so no id.
    state = exchange.state[PLUGIN] = {"ledger": Ledger(sep), "restore": restore,
                                      "message_index": state}
    return state


def _issue(exchange, state: dict, block: dict) -> tuple[str, str] | None:
    emitted = block.get("id")
    if type(emitted) is not str:
        return None
    issued = state["ledger"].issue(emitted, state["restore"])
    if issued is None:
        return None
    new_id, original, n = issued
    block["id"] = new_id
    entry = exchange.translation[new_id] = {"original": original, "occurrence": n,
                                            "message_index": state["message_index"],
                                            "direction": "to_client"}
    if emitted != original:  # what the upstream holds, when that is not the original
        entry["emitted"] = emitted
    return emitted, new_id


@hookimpl
def relay_response(exchange, response, options):
    # bytes.find rather than `in`, here and below: `in` tries its operand as an integer first,
    # and raising and clearing that TypeError costs more than the search of a short answer.
    if response.body.find(b"tool_use") < 0 or exchange.endpoint != "messages":
        return
    enabled, sep, restore = _settings(options)
    if not enabled:
        return
    data = response.data
    content = data.get("content") if type(data) is dict else None
    if type(content) is not list:
        return
    state = _answer_state(exchange, sep, restore)
    rewritten = []
    for block in content:
        if type(block) is dict and block.get("type") == "tool_use":
            pair = _issue(exchange, state, block)
            if pair:
                rewritten.append(pair)
    if rewritten:
        response.mark_changed()
        _count(exchange, len(rewritten))
        exchange.note(PLUGIN, "rewrote", direction="to_client", ids=rewritten)


@hookimpl
def relay_stream_events(exchange, options):
    enabled, _, _ = _settings(options)
    return BLOCK_STARTS if enabled and exchange.endpoint == "messages" else None


BLOCK_STARTS = frozenset({"content_block_start"})


@hookimpl
def relay_stream_event(exchange, event, options):
    if event.raw.find(b"tool_use") < 0:
        return
    data = event.data
    block = data.get("content_block") if type(data) is dict else None
    if type(block) is not dict or block.get("type") != "tool_use":
        return
    _, sep, restore = _settings(options)
    pair = _issue(exchange, _answer_state(exchange, sep, restore), block)
    if pair:
        event.mark_changed()
        exchange.note(PLUGIN, "rewrote", direction="to_client", ids=[pair], index=data.get("index"))


@hookimpl
def relay_validate(exchange, options, repair):
    enabled, sep, restore = _settings(options)
    messages = exchange.messages if enabled and not restore else None
    if messages is None:
        return None
    if repair:
        walk = make_unique(messages, sep)
        if walk.changed:
            exchange.repaired(PLUGIN, len(walk.tool_uses), direction="to_upstream",
                              tool_use_ids=len(walk.tool_uses), tool_result_ids=walk.tool_results)
        return []
    return [{"location": location, "message": f"{location}: `tool_use` ids must be unique"}
            for location in duplicate_locations(messages)]
