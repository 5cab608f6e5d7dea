"""Command line: serve (the default), emulate, validate, replay."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys

import orjson

from . import __version__, config as config_module
from .chain import Chain, load_plugins
from .errors import ConfigError
from .exchange import Exchange

COMMANDS = ("serve", "emulate", "validate", "replay")
DEFAULT_VALIDATE_PIPELINE = ("dedup", "pairing", "ordering")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="relay", description=(
        "A relay for Anthropic's Messages API that repairs tool-use faults on the way through."))
    parser.add_argument("--version", action="version", version=f"relay {__version__}")
    commands = parser.add_subparsers(dest="command")

    serve = commands.add_parser("serve", help="run the relay (the default command)")
    add_serve_arguments(serve)

    from . import emulator, emulator_openai
    emulate = commands.add_parser("emulate", help="run the strict upstream emulator")
    emulator.add_arguments(emulate)
    emulator_openai.add_arguments(emulate)

    validate = commands.add_parser("validate", help="check a saved request or messages array offline")
    validate.add_argument("file", help="a JSON request body or messages array ('-' for stdin)")
    validate.add_argument("--config", help="take the pipeline and plugin options from this relay.yaml")
    validate.add_argument("--json", action="store_true", help="print the verdict as JSON")
    validate.add_argument("--repair", action="store_true",
                          help="repair what can be repaired and write the result to stdout")

    from . import replay
    replay_parser = commands.add_parser("replay", help="rebuild a dumped exchange and compare")
    replay.add_arguments(replay_parser)
    return parser


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="relay.yaml", help="path to relay.yaml")
    parser.add_argument("--host", help="override server.host")
    parser.add_argument("--port", type=int, help="override server.port (0 picks a free port)")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `relay --config relay.yaml` means `relay serve --config relay.yaml`.
    if not argv or (argv[0] not in COMMANDS and argv[0] not in ("-h", "--help", "--version")):
        argv.insert(0, "serve")
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return run_serve(args)
    if args.command == "emulate":
        from . import emulator, emulator_openai
        return (emulator_openai if args.format == "openai" else emulator).main(args)
    if args.command == "validate":
        return run_validate(args)
    from . import replay
    return replay.main(args)


def fail(message: str, code: int = 2) -> int:
    print(f"relay: {message}", file=sys.stderr)
    return code


def run_serve(args) -> int:
    try:
        config = config_module.load(args.config)
        chain = Chain(load_plugins(config.pipeline), config)
    except ConfigError as e:
        return fail(f"config error: {e}")
    logging.basicConfig(level=config.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not config.access_log:
        logging.getLogger("relay.access").setLevel(logging.WARNING)
    from .server import serve
    host = args.host or config.host
    port = config.port if args.port is None else args.port
    if not 0 <= port <= 65535:
        return fail(f"--port: must be between 0 and 65535, not {port}")
    try:
        config_module.check_exposure(config, host)
    except ConfigError as e:
        return fail(f"config error: {e}")
    for name in config.plugins:
        if name not in config.pipeline:
            logging.getLogger("relay").warning(
                "plugins.%s: options for a plugin that is not in the pipeline", name)

    async def run():
        task = asyncio.create_task(serve(config, chain, host, port))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await task

    try:
        asyncio.run(run())
    except ConfigError as e:
        return fail(f"config error: {e}")
    except OSError as e:
        return fail(f"cannot listen on {host}:{port}: {e.strerror or e}")
    return 0


def read_json_file(name: str):
    try:
        raw = sys.stdin.buffer.read() if name == "-" else open(name, "rb").read()
    except OSError as e:
        raise ValueError(f"cannot read {name}: {e.strerror}") from None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ValueError(f"{name} is not valid JSON: {e}") from None


def run_validate(args) -> int:
    """Check (or ``--repair``) a request body offline with the pipeline's ``relay_validate``.

    The plugins start as in serving (``relay_startup``), so bad plugin options are config
    errors (exit 2). Every problem is printed as the API words it, its location first; one
    found by two plugins (dedup and pairing both see a repeated id) is printed once.
    Exit status: 0 valid (or fully repaired), 1 problems left, 2 unusable input or config.
    """
    try:
        document = read_json_file(args.file)
    except ValueError as e:
        return fail(str(e))
    bare = isinstance(document, list)
    body = {"messages": document} if bare else document
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        return fail("expected a request body with a messages list, or a messages array")
    try:
        if args.config:
            config = config_module.load(args.config, require_keys=False)  # offline: no key
        else:
            config = config_module.Config(backends=[], pipeline=list(DEFAULT_VALIDATE_PIPELINE))
        chain = Chain(load_plugins(config.pipeline), config)
    except ConfigError as e:
        return fail(f"config error: {e}")
    exchange = Exchange(endpoint="messages", method="POST", path="/v1/messages", query="",
                        headers={}, raw_body=b"", body=body)

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
    problems = []
    seen = set()
    for found in results:
        for problem in found or []:
            key = (problem.get("location"), problem.get("message"))
            if key not in seen:
                seen.add(key)
                problems.append(problem)
    if args.json and not args.repair:
        print(orjson.dumps({"valid": not problems, "problems": problems},
                           option=orjson.OPT_INDENT_2).decode())
    else:
        out = sys.stderr if args.repair else sys.stdout
        for problem in problems:
            print(problem["message"], file=out)
        if not problems and not args.repair:
            print(f"{args.file}: valid ({len(body['messages'])} messages)")
    if args.repair:
        repaired = body["messages"] if bare else body
        sys.stdout.write(orjson.dumps(repaired, option=orjson.OPT_INDENT_2).decode() + "\n")
        if exchange.repairs:
            print(f"relay: {exchange.repairs} repair(s) made", file=sys.stderr)
    return 1 if problems else 0
