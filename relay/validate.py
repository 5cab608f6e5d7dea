"""`relay validate FILE`: check (or repair) a saved request body or messages array offline,
with the pipeline's ``relay_validate`` hooks."""

from __future__ import annotations

import argparse
import asyncio
import sys

import msgspec
import orjson

from . import config as config_module
from . import skeleton
from .chain import Chain, load_plugins
from .errors import ConfigError, RelayError
from .exchange import Exchange

DEFAULT_PIPELINE = ("dedup", "pairing", "ordering")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="a JSON request body or messages array ('-' for stdin)")
    parser.add_argument("--config",
                        help="take the pipeline and plugin options from this relay.yaml")
    parser.add_argument("--json", action="store_true", help="print the verdict as JSON")
    parser.add_argument("--repair", action="store_true",
                        help="repair what can be repaired and write the result to stdout")
    parser.add_argument("--target", metavar="BACKEND",
                        help="check as for this backend of --config: its quirks, and what "
                             "the history would need to be sent there (portable plugin)")


def fail(message: str, code: int = 2) -> int:
    print(f"relay: {message}", file=sys.stderr)
    return code


def read_json_file(name: str) -> bytes:
    """The bytes of ``name`` ('-' for stdin), or ValueError saying why they cannot be read."""
    try:
        if name == "-":
            return sys.stdin.buffer.read()
        with open(name, "rb") as file:
            return file.read()
    except OSError as e:
        raise ValueError(f"cannot read {name}: {e.strerror}") from None


def _location_order(problem: dict) -> tuple:
    """A problem's place in the request, so that problems from several plugins come out in
    message order; within a message, its blocks' problems before the message's own (calls
    left without a result), as the API names a wrong result before the calls it leaves."""
    numbers = [int(part) for part in str(problem.get("location", "")).split(".") if part.isdigit()]
    if not numbers:
        return (1 << 62, 0)
    return (numbers[0], numbers[1] if len(numbers) > 1 else 1 << 62)


def _request_for(raw: bytes, name: str):
    """``(skeleton, top, bare)`` for a saved request body or bare messages array: the skeleton
    keeps every value the plugins do not look at as the file's own JSON text, so a repaired
    history writes each number and string back exactly as it was."""
    try:
        top = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError) as e:
        raise ValueError(f"{name} is not valid JSON: {e}") from None
    bare = type(top) is list
    if not (bare or (type(top) is dict and type(top.get("messages")) is list)):
        raise ValueError("expected a request body with a messages list, or a messages array")
    if bare:
        raw = b'{"model":"","messages":' + raw + b"}"
        top = None
    else:
        top = msgspec.json.decode(raw, type=dict[str, msgspec.Raw])
        # The model and thinking settings matter to what a --target backend accepts, and a
        # thread to what the history may leave to the server.
        given = top.get("model")
        model = bytes(given) if given is not None and bytes(given).startswith(b'"') else b'""'
        kept = b"".join(b',"' + name.encode() + b'":' + bytes(top[name])
                        for name in ("thinking", "thread") if name in top)
        raw = b'{"model":' + model + b',"messages":' + bytes(top["messages"]) + kept + b"}"
    problem = _shape_problem(msgspec.json.decode(raw)["messages"])
    if problem:
        raise ValueError(f"{name}: {problem}")
    found = skeleton.decode(raw)
    if found is None:
        # A message or block of an unexpected type: the plugins read the full parse instead.
        whole = msgspec.json.decode(raw)
        found = skeleton.Skeleton(whole, whole["messages"], "", False)
    return found, top, bare


def _shape_problem(messages: list) -> str | None:
    """Where the file is not a conversation at all (a message or block of the wrong type): the
    tool-use checks would step over it and say nothing, so it is refused outright."""
    for n, message in enumerate(messages):
        if type(message) is not dict:
            return f"messages.{n}: expected an object"
        if type(message.get("role")) is not str:
            return f"messages.{n}.role: expected a string"
        content = message.get("content")
        if type(content) is str:
            continue
        if type(content) is not list:
            return f"messages.{n}.content: expected a string or a list of blocks"
        for k, block in enumerate(content):
            if type(block) is not dict:
                return f"messages.{n}.content.{k}: expected an object"
            if type(block.get("type")) is not str:
                return f"messages.{n}.content.{k}.type: expected a string"
    return None


def main(args) -> int:
    """Check (or ``--repair``) a request body offline with the pipeline's ``relay_validate``.

    The plugins start as in serving (``relay_startup``), so bad plugin options are config
    errors (exit 2). Every problem is printed as the API words it, in message order across the
    plugins; one found by two plugins (dedup and pairing both see a repeated id) is printed
    once; what the relay is unsure of (see docs/history-rules.md) is printed as a note.
    Exit status: 0 no fault found (or all repaired), 1 faults left, 2 unusable input (not JSON,
    no messages list, a message or block of the wrong type) or config.
    """
    try:
        found, top, bare = _request_for(read_json_file(args.file), args.file)
    except ValueError as e:
        return fail(str(e))
    try:
        if args.config:
            config = config_module.load(args.config, require_keys=False)  # offline: no key
        else:
            config = config_module.Config(backends=[], pipeline=list(DEFAULT_PIPELINE))
        chain = Chain(load_plugins(config.pipeline), config)
    except ConfigError as e:
        return fail(f"config error: {e}")
    target = None
    if args.target is not None:
        names = [b.name for b in config.backends]
        if args.target not in names:
            return fail(f"--target: no backend named {args.target!r} in the config "
                        f"(backends: {', '.join(names) or 'none; give --config'})")
        target = config.backend(args.target)
    exchange = Exchange(endpoint="messages", method="POST", path="/v1/messages", query="",
                        headers={}, raw_body=b"", skeleton=found, backend=target)
    count = len(found.messages)

    async def check():
        await chain.startup(config)
        try:
            return await chain.run("relay_validate", exchange, repair=args.repair)
        finally:
            await chain.shutdown(config)

    try:
        results = asyncio.run(check())
    except ConfigError as e:
        return fail(f"config error: {e}")
    except RelayError as e:
        return fail(e.message)
    problems = []
    seen = set()
    for listed in results:
        for problem in listed or []:
            key = (problem.get("location"), problem.get("message"))
            if key not in seen:
                seen.add(key)
                problems.append(problem)
    problems.sort(key=_location_order)
    notes = [{"location": item.location, "plugin": item.step, "reason": item.reason}
             for item in exchange.uncertain]
    if args.json and not args.repair:
        print(orjson.dumps({"valid": not problems, "checked": "tool-use faults",
                            "problems": problems, "notes": notes},
                           option=orjson.OPT_INDENT_2).decode())
    else:
        out = sys.stderr if args.repair else sys.stdout
        for problem in problems:
            print(problem["message"], file=out)
        for note in notes:
            print(f"note: {note['location']}: {note['reason']} (forwarded as it is)",
                  file=sys.stderr)
        if not problems and not args.repair:
            print(f"{args.file}: no tool-use faults found ({count} messages)")
    if args.repair:
        messages = exchange.messages
        if bare:
            written = skeleton.encode(messages)
        else:
            top["messages"] = messages
            written = skeleton.encode(top)
        sys.stdout.write(written.decode() + "\n")
        if exchange.repairs:
            print(f"relay: {exchange.repairs} repair(s) made", file=sys.stderr)
    return 1 if problems else 0
