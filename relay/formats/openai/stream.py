"""Streams: a Chat Completions stream as Anthropic SSE bytes, one chunk at a time, in bounded
memory (see the package's docstring)."""

from __future__ import annotations

import re

import orjson

from ...bounded import HeadTail
from ...errors import STATUS_TYPES, UPSTREAM_ERROR, RelayError
from ...sse import SSEDecoder
from .answer import (
    FAILED_FINISH_REASONS,
    Malformed,
    _content_text,
    _function,
    _optional,
    _reasoning_text,
    error_type,
    read_usage,
    stop_reason,
    tool_input,
    translated,
    upstream_failure,
)
from .wire import message_id


def _event(name: bytes, data: dict) -> bytes:
    return b"event: " + name + b"\ndata: " + orjson.dumps(data) + b"\n\n"


_PING = _event(b"ping", {"type": "ping"})
_STOP = _event(b"message_stop", {"type": "message_stop"})
# message_start's usage, shaped as Anthropic's: a Chat Completions stream reports its counts
# only at its end, so they come in the message_delta. Read, never written.
_START_USAGE = {"input_tokens": 0, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
                "cache_creation": {"ephemeral_5m_input_tokens": 0,
                                   "ephemeral_1h_input_tokens": 0},
                "output_tokens": 0}


def _payload(event: bytes) -> bytes | None:
    """The data of one event (its lines joined), or None when it has no data line."""
    if event.startswith(b"data: ") and event.find(b"\n") < 0:
        return event[6:]
    data = None
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            value = line[6:] if line[5:6] == b" " else line[5:]
            data = value if data is None else data + b"\n" + value
    return data


_DELTA = b'event: content_block_delta\ndata: {"type":"content_block_delta","index":'
_TEXT_DELTA = b',"delta":{"type":"text_delta","text":'
_THINKING_DELTA = b',"delta":{"type":"thinking_delta","thinking":'
_JSON_DELTA = b',"delta":{"type":"input_json_delta","partial_json":'


def _delta(index: int, kind: bytes, value: str) -> bytes:
    return _DELTA + str(index).encode() + kind + orjson.dumps(value) + b"}}\n\n"


_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]*')
_NUMBER_START = frozenset("-0123456789")
_NUMBER_CHARS = frozenset("-+.eE0123456789")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?\Z")
_NUMBER_PREFIX = re.compile(
    r"-?(?:(?:0|[1-9][0-9]*)(?:\.[0-9]*|(?:\.[0-9]+)?[eE][+-]?[0-9]*)?)?\Z")
_LITERALS = ("true", "false", "null")
_HEX = frozenset("0123456789abcdefABCDEF")
_SPACE = frozenset(" \t\n\r")


class _ObjectPrefix:
    """Whether the text fed so far can still begin a JSON object: a tool call's arguments,
    checked as they stream. The SDKs' stream accumulators parse a tool's input after every
    fragment and raise on one that cannot be JSON (the Python SDK's "Unable to parse tool
    parameter JSON from model"), so such a fragment must never go out: the stream ends with
    the relay's error in its place. Linear: each character is looked at once (runs of a
    string at regex speed)."""

    __slots__ = ("ok", "stack", "expect", "string", "key", "escape", "token")

    def __init__(self):
        self.ok = True
        self.stack: list[str] = []  # "{" and "[" still open
        self.expect = "top"  # what may come next, outside strings and tokens
        self.string = False
        self.key = False  # the string is an object's key
        self.escape = 0  # 1 after a backslash, 2 to 5 inside a \u escape's digits
        self.token = ""  # a number or literal still coming

    def feed(self, text: str) -> bool:
        if not self.ok:
            return False
        i, n = 0, len(text)
        while i < n:
            if self.string:
                i = self._in_string(text, i)
                if i < 0:
                    self.ok = False
                    return False
                continue
            c = text[i]
            if self.token:
                if c in _NUMBER_CHARS or c.isalpha():
                    self.token += c
                    if not self._token_may_grow():
                        self.ok = False
                        return False
                    i += 1
                    continue
                if not self._token_ended():
                    self.ok = False
                    return False
            if not self._structure(c):
                self.ok = False
                return False
            i += 1
        return True

    def _in_string(self, text: str, i: int) -> int:
        """Read on in a string from ``i``; where to go on, or -1 when it cannot be JSON."""
        if self.escape == 1:
            c = text[i]
            if c == "u":
                self.escape = 2
            elif c in '"\\/bfnrt':
                self.escape = 0
            else:
                return -1
            return i + 1
        if self.escape:
            if text[i] not in _HEX:
                return -1
            self.escape = 0 if self.escape == 5 else self.escape + 1
            return i + 1
        run = _STRING_RUN.match(text, i)  # matches always: the run may be empty
        end = run.end() if run is not None else i
        if end == len(text):
            return end
        c = text[end]
        if c == '"':
            self.string = False
            if self.key:
                self.expect = "colon"
            else:
                self._value_done()
        elif c == "\\":
            self.escape = 1
        else:
            return -1  # a control character
        return end + 1

    def _token_may_grow(self) -> bool:
        token = self.token
        if token[0] in _NUMBER_START:
            return _NUMBER_PREFIX.match(token) is not None
        return any(literal.startswith(token) for literal in _LITERALS)

    def _token_ended(self) -> bool:
        token, self.token = self.token, ""
        if not (token in _LITERALS or _NUMBER.match(token)):
            return False
        self._value_done()
        return True

    def _value_done(self) -> None:
        self.expect = "comma" if self.stack else "end"

    def _structure(self, c: str) -> bool:
        if c in _SPACE:
            return True
        expect = self.expect
        if expect == "top":
            if c != "{":
                return False
            self.stack.append("{")
            self.expect = "key_or_close"
        elif expect in ("value", "value_or_close"):
            if c == "]" and expect == "value_or_close":
                self.stack.pop()
                self._value_done()
            elif c in "{[":
                self.stack.append(c)
                self.expect = "key_or_close" if c == "{" else "value_or_close"
            elif c == '"':
                self.string, self.key = True, False
            elif c in _NUMBER_START or c in "tfn":
                self.token = c
            else:
                return False
        elif expect in ("key", "key_or_close"):
            if c == '"':
                self.string, self.key = True, True
            elif c == "}" and expect == "key_or_close":
                self.stack.pop()
                self._value_done()
            else:
                return False
        elif expect == "colon":
            if c != ":":
                return False
            self.expect = "value"
        elif expect == "comma":
            top = self.stack[-1]
            if c == ",":
                self.expect = "key" if top == "{" else "value"
            elif c == ("}" if top == "{" else "]"):
                self.stack.pop()
                self._value_done()
            else:
                return False
        else:  # "end": the object is whole, and only space may follow
            return False
        return True


class _Call:
    """One streamed tool call: what is known of it, and whether its block is out."""

    __slots__ = ("index", "id", "name", "parts", "block", "arguments")

    def __init__(self, index: int):
        self.index = index
        self.id: str | None = None
        self.name: str | None = None
        self.parts: list[str] = []
        self.block = -1  # its Anthropic block index, once started
        self.arguments = _ObjectPrefix()  # whether ``parts`` may still be a JSON object


class _Held:
    """Text or thinking that came while a tool call was streaming live."""

    __slots__ = ("kind", "parts")

    def __init__(self, kind: str, text: str):
        self.kind = kind
        self.parts = [text]


# What one stream may hold back at once: the event still coming, and the tool calls'
# arguments with what waits while one streams live (text, other calls; each call counts
# CALL_BYTES besides). The
# same bound as the Anthropic path's (relay.stream): past it the upstream has stopped making
# sense, and the stream ends with an ``error`` event rather than the relay's memory.
MAX_EVENT_BYTES = MAX_HELD_BYTES = 64 * 1024 * 1024
CALL_BYTES = 256
_EMPTY: dict = {}  # read, never written


class StreamTranslator:
    """One Chat Completions stream as Anthropic SSE bytes: :meth:`feed` each upstream chunk
    (any boundaries) and send on what it returns; :meth:`close` when the upstream is done.

    ``ended`` says the translated stream is complete (``message_stop`` or ``error`` out).
    ``fault`` is ``(outcome, message)`` when the translator ended the stream itself with an
    ``error`` event (``upstream_malformed`` for a chunk of the wrong shape, ``stream_error``
    for one that grew past the limits): the caller need read no more of the upstream then.
    ``raw`` keeps the upstream's own bytes for the record, bounded (a
    :class:`relay.bounded.HeadTail`). ``unreported`` names the usage counts the upstream did
    not report (:func:`.answer.read_usage`), filled in, in place, as the ``message_delta`` is
    made. Time and memory are linear in the stream: an event that takes many chunks is
    appended to, never copied, until it ends."""

    def __init__(self, backend_name: str, model: str | None = None, keep_raw: bool = True):
        self.backend = backend_name
        self.model = model
        self.pending: list[bytes] = []  # the start of an event still coming
        self.whole: list[bytes] | None = None  # a whole answer in place of a stream, so far
        self.pending_size = 0
        self.cr = False  # "\r" line ends seen: every chunk is normalised from then on
        self.held_cr = False  # a chunk ended in "\r": is it half of "\r\n"?
        self.raw: HeadTail | None = HeadTail() if keep_raw else None
        self.id = message_id()
        self.started = False
        self.ended = False
        self.fault: tuple[str, str] | None = None
        self.blocks = 0  # Anthropic blocks started so far
        self.open: str | _Call | None = None  # the live block: "text", "thinking", a _Call
        self.calls: dict[int, _Call] = {}  # upstream index -> its current call
        self.called = False
        self.held: list = []  # _Held and _Call items waiting, in arrival order
        self.naming: _Call | None = None  # the held call whose name may still grow
        self.held_bytes = 0  # what the calls and ``held`` keep
        self.finish_reason: str | None = None
        self.failure = None  # the error a gateway put on a choice that failed
        # The usage chunks' fields, each as the last chunk that gave it said: the counts are
        # cumulative, and a chunk that leaves one out has not taken it back.
        self.usage: dict = {}
        self.unreported: list[str] = []

    def feed(self, chunk: bytes) -> bytes:
        if self.raw is not None:
            self.raw.add(chunk)
        if self.ended:
            return b""
        whole = self.whole
        if whole is None and not self.started and not self.pending \
                and chunk.lstrip()[:1] == b"{":
            # A chat completion, not a stream: some servers answer so even when asked to
            # stream (sgl-project/sglang#2810, with tools). It is translated at the close.
            whole = self.whole = []
        if whole is not None:
            whole.append(chunk)
            self.pending_size += len(chunk)
            if self.pending_size <= MAX_EVENT_BYTES:
                return b""
            failed: list[bytes] = []
            self._fail(failed, f"upstream {self.backend} answered a stream with a body of more "
                               f"than {MAX_EVENT_BYTES} bytes", fault="stream_error")
            return failed[0]
        # bytes.find, not `in`, on every chunk: `in` tries its operand as an integer first
        if self.cr or chunk.find(b"\r") >= 0:
            chunk = self._line_feeds(chunk)
        if not chunk:
            return b""
        pending = self.pending
        if pending:
            # Joined only once the event ends: its blank line in this chunk, or straddling
            # the two ("\n" | "\n").
            if chunk.find(b"\n\n") < 0 and not (chunk[0] == 0x0A and pending[-1][-1] == 0x0A):
                return self._hold_back(chunk)
            buf = b"".join(pending) + chunk
            pending.clear()
            self.pending_size = 0
        else:
            buf = chunk
        out: list[bytes] = []
        start = 0
        while not self.ended:
            end = buf.find(b"\n\n", start)
            if end < 0:
                break
            event = buf[start:end]
            start = end + 2
            if event:
                self._event(event, out)
        if not self.ended and start < len(buf):
            out.append(self._hold_back(buf[start:] if start else buf))
        if len(out) == 1:
            return out[0]
        return b"".join(out)

    def _line_feeds(self, chunk: bytes) -> bytes:
        """Any line end as "\n"; a "\r" at the very end waits for the next chunk to say
        whether it was the first half of "\r\n"."""
        self.cr = True
        if self.held_cr:
            chunk = b"\r" + chunk
        self.held_cr = chunk.endswith(b"\r")
        if self.held_cr:
            chunk = chunk[:-1]
        return chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")

    def _hold_back(self, part: bytes) -> bytes:
        self.pending.append(part)
        self.pending_size += len(part)
        if self.pending_size <= MAX_EVENT_BYTES:
            return b""
        out: list[bytes] = []
        self._fail(out, f"upstream stream from {self.backend} broke off: an event grew past "
                        f"{MAX_EVENT_BYTES} bytes without ending", fault="stream_error")
        return out[0]

    def close(self) -> bytes:
        """The upstream has finished: what is left. Without ``[DONE]`` or a finish reason the
        stream is left unended, for the caller to report as cut. A last event without its
        blank line counts when it is whole; a fragment cut off mid-event does not."""
        if self.ended:
            return b""
        out: list[bytes] = []
        if self.whole is not None:
            self._answer(b"".join(self.whole), out)
            return b"".join(out)
        rest = b"".join(self.pending).strip(b"\r\n")
        self.pending.clear()
        if rest:
            payload = _payload(rest)
            if payload == b"[DONE]":
                self._end(out)
            elif payload is not None:
                try:
                    data = orjson.loads(payload)
                except orjson.JSONDecodeError:
                    data = None
                if type(data) is dict:
                    self._data(data, out)
        if not self.ended and self.finish_reason is not None:
            self._end(out)
        return b"".join(out)

    def _answer(self, payload: bytes, out: list) -> None:
        """A whole chat completion as the events of its Anthropic message, or the error it
        is."""
        try:
            message, unreported = translated(orjson.loads(payload), self.backend, self.model)
        except orjson.JSONDecodeError:
            self._fail(out, f"upstream {self.backend} answered a stream with a body that is "
                            f"neither a stream nor JSON: {payload[:200]!r}",
                       fault="upstream_malformed")
            return
        except RelayError as e:
            self._fail(out, e.message, e.type, None if e.rule == UPSTREAM_ERROR
                       else "upstream_malformed")
            return
        self.unreported.extend(unreported)
        self._start(message["model"], out)
        for index, block in enumerate(message["content"]):
            kind = block["type"]
            shell = ({"type": "text", "text": ""} if kind == "text" else
                     {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                     else {**block, "input": {}})
            out.append(_event(b"content_block_start", {
                "type": "content_block_start", "index": index, "content_block": shell}))
            if kind == "text":
                out.append(_delta(index, _TEXT_DELTA, block["text"]))
            elif kind == "thinking":
                out.append(_delta(index, _THINKING_DELTA, block["thinking"]))
                out.append(_event(b"content_block_delta", {
                    "type": "content_block_delta", "index": index,
                    "delta": {"type": "signature_delta", "signature": ""}}))
            else:
                out.append(_delta(index, _JSON_DELTA, orjson.dumps(block["input"]).decode()))
            out.append(_event(b"content_block_stop", {"type": "content_block_stop",
                                                      "index": index}))
        out.append(_event(b"message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
            "usage": message["usage"]}))
        out.append(_STOP)
        self.ended = True

    # the upstream's events

    def _event(self, event: bytes, out: list) -> None:
        payload = _payload(event)
        if payload is None:
            return  # a comment or a keep-alive
        if payload == b"[DONE]":
            self._end(out)
            return
        try:
            data = orjson.loads(payload)
        except orjson.JSONDecodeError:
            data = None
        if type(data) is not dict:
            self._fail(out, f"upstream {self.backend} sent a stream event that is not a "
                            f"JSON object: {event[:200]!r}", fault="upstream_malformed")
            return
        self._data(data, out)

    def _data(self, data: dict, out: list) -> None:
        # Null is absent here as everywhere: some gateways put "error": null on every
        # healthy chunk.
        if data.get("error") is not None or data.get("object") == "error":
            self._upstream_error(data, out)
            return
        try:
            self._chunk(data, out)
        except Malformed as e:
            self._fail(out, f"upstream {self.backend} sent a malformed stream chunk: {e}",
                       fault="upstream_malformed")

    def _chunk(self, data: dict, out: list) -> None:
        # Read and checked whole before any of it goes out: nothing of a malformed chunk does.
        # The checks are written out: this runs for every chunk of every stream.
        model = data.get("model")
        if model is not None and model.__class__ is not str:
            raise Malformed("model is not a string")
        usage = data.get("usage")
        if usage is not None and (usage or usage.__class__ is not dict):
            read_usage(usage)  # checked now, translated at the end
        choices = data.get("choices")
        choice: dict = _EMPTY
        delta: dict = _EMPTY
        if choices is not None:
            if choices.__class__ is not list:
                raise Malformed("choices is not a list")
            if choices:
                choice = _optional(choices[0], dict, "choices[0]", "an object") or _EMPTY
                found = choice.get("delta")
                delta = found if found.__class__ is dict else (
                    _optional(found, dict, "choices[0].delta", "an object") or _EMPTY)
        content = delta.get("content")
        if content is not None and content.__class__ is not str:
            content = _content_text(content, "choices[0].delta.content")
        # A structured-output refusal streams here, not in content: as in a whole answer, it
        # is the model's text (else the client gets an empty answer that says end_turn).
        refusal = delta.get("refusal")
        if refusal is not None and refusal.__class__ is not str:
            raise Malformed("choices[0].delta.refusal is not a string")
        calls = delta.get("tool_calls")
        fragments = [self._fragment(call, position) for position, call in enumerate(
            _optional(calls, list, "choices[0].delta.tool_calls", "a list"))] \
            if calls is not None else ()
        reason = choice.get("finish_reason")
        if reason is not None and reason.__class__ is not str:
            raise Malformed("choices[0].finish_reason is not a string")
        if not self.started:
            self._start(model, out)
        if usage:
            self.usage.update((name, value) for name, value in usage.items()
                              if value is not None)
        if "reasoning_content" in delta or "reasoning" in delta:
            reasoning = _reasoning_text(delta)
            if reasoning:
                self._text("thinking", reasoning, out)
        if content:
            self._text("text", content, out)
        if refusal:
            self._text("text", refusal, out)
        for fragment in fragments:
            self._call(*fragment, out)
            if self.ended:
                return
        if reason:
            self.finish_reason = reason
            if reason in FAILED_FINISH_REASONS:
                self.failure = choice.get("error")

    @staticmethod
    def _fragment(fragment, position: int) -> tuple[int, str | None, str | None, str | None]:
        """One tool call fragment, checked: its index, id, name and arguments."""
        where = f"choices[0].delta.tool_calls[{position}]"
        function = _function(fragment, where)
        index = fragment.get("index")
        if index is None:
            index = position
        elif type(index) is not int:
            raise Malformed(f"{where}.index is not an integer")
        arguments = function.get("arguments")
        if type(arguments) is dict:
            arguments = orjson.dumps(arguments).decode()
        return index, fragment.get("id") or None, function.get("name"), arguments

    def _start(self, model: str | None, out: list) -> None:
        self.started = True
        message: dict = {"id": self.id, "type": "message", "role": "assistant",
                   "model": model or self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": _START_USAGE}
        out.append(_event(b"message_start", {"type": "message_start", "message": message}))
        out.append(_PING)

    def _hold(self, size: int, out: list) -> bool:
        """Count ``size`` more bytes held; False (the stream ended) past the limit."""
        self.held_bytes += size
        if self.held_bytes <= MAX_HELD_BYTES:
            return True
        self._fail(out, f"upstream {self.backend} sent more than {MAX_HELD_BYTES} bytes of "
                        "tool calls (and text while one streamed) in one answer",
                   fault="stream_error")
        return False

    def _text(self, kind: str, text: str, out: list) -> None:
        if self.naming is not None:
            self._named(out)  # the call before this text has its name whole
            if self.ended:
                return
        open_ = self.open
        if open_.__class__ is _Call:
            if not self._hold(len(text), out):
                return
            held = self.held
            if held and held[-1].__class__ is _Held and held[-1].kind == kind:
                held[-1].parts.append(text)
            else:
                held.append(_Held(kind, text))
            return
        if open_ != kind:
            if open_ is not None:
                self._stop(out)
            self._open(kind, out)
        out.append(_delta(self.blocks - 1, _TEXT_DELTA if kind == "text" else _THINKING_DELTA,
                          text))

    def _open(self, kind: str, out: list) -> None:
        block = {"type": "text", "text": ""} if kind == "text" else {
            "type": "thinking", "thinking": "", "signature": ""}
        out.append(_event(b"content_block_start", {
            "type": "content_block_start", "index": self.blocks, "content_block": block}))
        self.blocks += 1
        self.open = kind

    def _call(self, index: int, new_id: str | None, name: str | None, arguments: str | None,
              out: list) -> None:
        found = self.calls.get(index)
        # A fresh id at an index in use is a new call when it names one (Ollama numbers every
        # call of a parallel batch 0); without a name it goes on with the call there: LM
        # Studio gives each fragment of one call an id of its own and only the first a name
        # (NousResearch/hermes-agent#106943).
        if found is None or (new_id and name and found.id and new_id != found.id):
            if not self._hold(CALL_BYTES, out):
                return
            call = self.calls[index] = _Call(index)
            self.called = True
            self.held.append(call)  # until it goes live
        else:
            call = found
        naming = self.naming
        if naming is not None and naming is not call:
            self._named(out)  # something else came: that call's name was whole
            if self.ended:
                return
            naming = None
        if new_id and call.id is None:
            call.id = new_id
        # A name may come in pieces (Gemini: continuedev/continue#5849) or again whole with
        # every fragment (MiniMax: NousResearch/hermes-agent#11984): so a call goes live with
        # its next fragment, once that adds nothing new to the name.
        whole = call is naming and (not name or name == call.name)
        if name and name != call.name and call.block < 0:  # once live, its name is out
            call.name = name if call.name is None else call.name + name
        if arguments:
            if not self._hold(len(arguments), out):
                return
            call.parts.append(arguments)
            call.arguments.feed(arguments)
            if self.open is call:
                if not call.arguments.ok:
                    self._bad_arguments(call, out)
                    return
                out.append(_delta(call.block, _JSON_DELTA, arguments))
                return
        if call.block >= 0 or self.open is call or not (call.id and call.name) \
                or self.open.__class__ is _Call:
            return  # not yet known, or waiting behind the live call
        if whole:
            self._named(out)
        else:
            self.naming = call

    def _named(self, out: list) -> None:
        """The call whose name was still coming has it whole: it goes live."""
        call = self.naming
        assert call is not None  # only called when one is
        self.naming = None
        self.held.remove(call)
        self._go_live(call, out)

    def _go_live(self, call: _Call, out: list) -> None:
        if self.open is not None:
            self._stop(out)
            if self.ended:
                return
        if not call.arguments.ok:
            self._bad_arguments(call, out)
            return
        call.block = self.blocks
        self.blocks += 1
        self.open = call
        out.append(_event(b"content_block_start", {
            "type": "content_block_start", "index": call.block,
            "content_block": {"type": "tool_use", "id": call.id, "name": call.name,
                              "input": {}}}))
        if call.parts:
            out.append(_event(b"content_block_delta", {
                "type": "content_block_delta", "index": call.block,
                "delta": {"type": "input_json_delta", "partial_json": "".join(call.parts)}}))

    def _bad_arguments(self, call: _Call, out: list) -> None:
        """End the stream for a call whose arguments can no longer be a JSON object, before
        any more of them go out."""
        try:
            tool_input("".join(call.parts), call.id, call.name, self.backend)
            message = (f"upstream {self.backend} called tool {call.name} ({call.id}) with "
                       "arguments that are not a JSON object")
        except RelayError as e:
            message = e.message
        self._fail(out, message, fault="upstream_malformed")

    def _stop(self, out: list) -> None:
        open_ = self.open
        index = self.blocks - 1
        if open_ == "thinking":
            out.append(_event(b"content_block_delta", {
                "type": "content_block_delta", "index": index,
                "delta": {"type": "signature_delta", "signature": ""}}))
        elif isinstance(open_, _Call):
            index = open_.block
            try:
                tool_input("".join(open_.parts), open_.id, open_.name, self.backend)
            except RelayError as e:
                self._fail(out, e.message, fault="upstream_malformed")
                return
        out.append(_event(b"content_block_stop", {"type": "content_block_stop",
                                                  "index": index}))
        self.open = None

    def _end(self, out: list) -> None:
        """The upstream is done: close the live block, send what was held, then the stop."""
        if not self.started:
            self._start(None, out)
        self.naming = None  # goes out in its turn with the rest of ``held``
        if self.finish_reason in FAILED_FINISH_REASONS:
            # What came is not the whole answer: the client is told so, as for a cut stream.
            status, message = upstream_failure(self.failure)
            self._fail(out, message or f"upstream {self.backend} ended the stream with "
                                       f"finish_reason {self.finish_reason!r}: the generation "
                                       "failed part way",
                       error_type(status) if status else "api_error")
            return
        for item in self.held:
            if self.open is not None:
                self._stop(out)
            if self.ended:
                return
            if item.__class__ is _Held:
                self._text(item.kind, "".join(item.parts), out)
                continue
            if not item.name:
                self._fail(out, f"upstream {self.backend} sent tool call {item.id or item.index} "
                                "without a name", fault="upstream_malformed")
                return
            if not item.id:
                item.id = f"call_{self.id}_{item.index}"
            self._go_live(item, out)
        if self.ended:
            return
        if self.open is not None:
            self._stop(out)
            if self.ended:
                return
        self.held = []
        usage, unreported = read_usage(self.usage)
        self.unreported.extend(unreported)
        out.append(_event(b"message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason(self.finish_reason, self.called),
                      "stop_sequence": None},
            "usage": usage}))
        out.append(_STOP)
        self.ended = True

    def _upstream_error(self, data: dict, out: list) -> None:
        status, message = upstream_failure(data.get("error") if data.get("error") is not None
                                           else data)
        if message is None:
            message = orjson.dumps(data).decode()[:2000]
        self._fail(out, message, error_type(status) if status else "api_error")

    def _fail(self, out: list, message: str, kind: str = "api_error",
              fault: str | None = None) -> None:
        out.append(_event(b"error", {"type": "error",
                                     "error": {"type": kind, "message": message}}))
        self.ended = True
        if fault is not None:
            self.fault = (fault, message)
        # Nothing more will be read: what was held for the stream's end goes now.
        self.pending.clear()
        self.held, self.calls, self.whole, self.naming = [], {}, None, None


# The status each error type of the API stands for, for an error a collected stream ended in.
# (api_error: 502, the upstream's fault.)
_STATUSES = {kind: status for status, kind in sorted(STATUS_TYPES.items())}
_STREAM_START = (b"data:", b"event:", b":", b"id:", b"retry:")


def is_stream(payload: bytes) -> bool:
    """Whether an answer body is an event stream: it opens with a field or a comment, where
    JSON opens with a value."""
    return payload.lstrip().startswith(_STREAM_START)


def collected(payload: bytes, backend_name: str,
              model: str | None = None) -> tuple[dict, tuple[str, ...]]:
    """The Anthropic message of a whole Chat Completions stream, for a client that asked for
    no stream from a server that streams anyway, and the usage counts the stream did not
    report; a RelayError when the stream ended in an error or broke off before its end."""
    translator = StreamTranslator(backend_name, model, keep_raw=False)
    decoder = SSEDecoder()
    events = decoder.feed(translator.feed(payload) + translator.close()) + decoder.close()
    message: dict = {}
    inputs: dict[int, list[str]] = {}
    for event in events:
        data = event.data
        kind = data["type"]
        if kind == "message_start":
            message = data["message"]
            message["content"] = []
        elif kind == "content_block_start":
            message["content"].append(data["content_block"])
        elif kind == "content_block_delta":
            block, delta = message["content"][data["index"]], data["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "input_json_delta":
                inputs.setdefault(data["index"], []).append(delta["partial_json"])
        elif kind == "message_delta":
            message.update(data["delta"])
            message["usage"] = data["usage"]
        elif kind == "message_stop":
            for index, parts in inputs.items():  # whole and valid: checked at their block's end
                block = message["content"][index]
                block["input"] = tool_input("".join(parts), block["id"], block["name"],
                                            backend_name)
            return message, tuple(translator.unreported)
        elif kind == "error":
            error = data["error"]
            raise RelayError(_STATUSES.get(error["type"], 502), error["message"], error["type"],
                             rule="openai_malformed" if translator.fault else
                             UPSTREAM_ERROR)
    raise RelayError(502, f"upstream {backend_name} answered with a stream that broke off "
                          "before its end", "api_error", rule="openai_malformed")
