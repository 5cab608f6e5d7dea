"""Command line: serve (the default), emulate, validate, replay, usage."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import sys
from types import ModuleType

from . import __version__, logs
from . import config as config_module
from .chain import Chain, load_plugins
from .errors import ConfigError
from .state import check_per_process

# Each command: the module that declares its arguments and runs it (serve's is this one), and
# its help line.
COMMANDS = {
    "serve": ("cli", "run the relay (the default command)"),
    "emulate": ("testing.emulator", "run the strict upstream emulator"),
    "validate": ("validate", "check a saved request or messages array offline"),
    "replay": ("replay", "rebuild a dumped exchange and compare"),
    "usage": ("usage", "what each key used and cost, from the ledger"),
    "keys": ("keys", "make, list, change and revoke the relay's own keys while it serves"),
    "backends": ("pools", "each pooled upstream credential's state (healthy, cooling, out)"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or with ``command`` only that command's arguments. A process
    runs one command, and declaring them all imports every command's module: the emulator's
    aiohttp server alone more than doubled the start of ``relay validate``."""
    parser = argparse.ArgumentParser(
        prog="relay", usage="relay [serve] [--config relay.yaml] [--host H] [--port P]\n"
                            "       relay {emulate,validate,replay,usage,keys,backends} ...",
        description="A relay for Anthropic's Messages API that repairs tool-use faults on the "
                    "way through.",
        epilog="Without a command, relay serves: --config names relay.yaml (default: "
               "./relay.yaml); see `relay serve --help`.")
    parser.add_argument("--version", action="version", version=f"relay {__version__}")
    commands = parser.add_subparsers(dest="command")
    for name, (_, summary) in COMMANDS.items():
        subparser = commands.add_parser(name, help=summary)
        if command is None or command == name:
            add_command_arguments(name, subparser)
    return parser


def add_command_arguments(name: str, parser: argparse.ArgumentParser) -> None:
    if name == "serve":
        add_serve_arguments(parser)
        return
    command_module(name).add_arguments(parser)
    if name == "emulate":
        from .testing import emulator_openai
        emulator_openai.add_arguments(parser)


def command_module(name: str) -> ModuleType:
    return importlib.import_module(f".{COMMANDS[name][0]}", __package__)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="relay.yaml", help="path to relay.yaml")
    default = config_module.server_default
    parser.add_argument("--host", help=f"override server.host (default {default('host')})")
    parser.add_argument("--port", type=int, help=f"override server.port (default "
                                                 f"{default('port')}; 0 picks a free port)")
    parser.add_argument("--workers", type=int, metavar="N",
                        help=f"override server.workers: worker processes sharing the port "
                             f"(default {default('workers')})")
    parser.add_argument("--log-format", choices=config_module.SERVER["log_format"].choices,
                        help=f"override server.log_format (json: one object per line; "
                             f"default {default('log_format')})")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `relay --config relay.yaml` means `relay serve --config relay.yaml`; a word that is no
    # command is left for argparse to call an invalid choice.
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version")):
        argv.insert(0, "serve")
    # Only the command asked for is declared: `relay --help` names them all without them.
    args = build_parser(argv[0] if argv[0] in COMMANDS else "").parse_args(argv)
    if args.command == "serve":
        return run_serve(args)
    if args.command == "emulate":
        from .testing import emulator, emulator_openai
        emulators = {"anthropic": emulator, "openai": emulator_openai}
        return emulators[args.format].main(args)
    return command_module(args.command).main(args)


def fail(message: str, code: int = 2) -> int:
    print(f"relay: {message}", file=sys.stderr)
    return code


def run_serve(args) -> int:
    """Serve until stopped. Exit status: 0 after a complete drain, 1 when the drain was cut
    short (a second signal, or ``server.drain_seconds``), 2 for a config error or a port
    that cannot be had."""
    try:
        config = config_module.load(args.config)
    except ConfigError as e:
        return fail(f"config error: {e}")
    if args.workers is not None:
        if not 1 <= args.workers <= config_module.MAX_WORKERS:
            return fail(f"--workers: must be between 1 and {config_module.MAX_WORKERS}")
        config.workers = args.workers
    # Plugins that keep per-process state shared across workers (metrics) set it up when
    # they load, before the fork: they need to know workers are coming.
    os.environ["RELAY_WORKERS"] = str(config.workers)
    try:
        chain = Chain(load_plugins(config.pipeline), config)
    except ConfigError as e:
        return fail(f"config error: {e}")
    if args.log_format is not None:
        config.log_format = args.log_format
    logs.configure(config.log_level, config.log_format, config.access_log, config.workers)
    host = args.host or config.host
    port = config.port if args.port is None else args.port
    if not 0 <= port <= 65535:
        return fail(f"--port: must be between 0 and 65535, not {port}")
    # What the server reads of them (the Host names it answers to) is what it listens on.
    config.host, config.port = host, port
    try:
        config_module.check_exposure(config, host)
    except ConfigError as e:
        return fail(f"config error: {e}")
    for name in config.plugins:
        if name not in config.pipeline:
            logging.getLogger("relay").warning(
                "plugins.%s: options for a plugin that is not in the pipeline", name)
    try:
        check_per_process(config)
    except ConfigError as e:
        return fail(f"config error: {e}")
    warn_if_unenforced(config)
    from .listen import fit_open_files  # the server's (aiohttp's): serve alone needs it
    enough, said = fit_open_files(config.max_connections, config.upstream_connections)
    logging.getLogger("relay").log(logging.DEBUG if enough else logging.WARNING, said)
    logs.announce(describe(config))
    try:
        if config.workers > 1:
            from . import workers
            return workers.run(config, chain, host, port, config.workers)
        from .server import serve
        return asyncio.run(serve(config, chain, host, port))
    except ConfigError as e:
        return fail(f"config error: {e}")
    except OSError as e:
        return fail(f"cannot listen on {host}:{port}: {e.strerror or e}")


def warn_if_unenforced(config) -> None:
    """Relay keys' limits in relay.yaml that the pipeline would not keep: said at start-up,
    rather than found out from a bill. (Refused for a credential's, which the host keeps
    itself; a key's belong to the limits plugin, which a pipeline may leave out on purpose.)"""
    raws = [config.default_limits, *(key.limits.raw for key in config.keys or ()
                                     if key.limits is not None)]
    if not any(raws):
        return
    warn = logging.getLogger("relay").warning
    if "limits" not in config.pipeline:
        warn("server.auth: relay keys have limits, but the limits plugin is not in the "
             "pipeline: none of them is enforced")
        return
    counted = next((found for raw in raws if (found := config_module.counted_from_usage(raw))),
                   None)
    if counted and "usage" not in config.pipeline:
        warn("server.auth: a relay key's %s counts what answers used, which the usage plugin "
             "reads, and it is not in the pipeline: that limit never advances", counted)


def describe(config) -> str:
    """What start-up loaded, said once: the config file, the pipeline, the backends (never a
    key), and whether inbound auth is on."""
    from .document import redact_url  # a password in a backend's URL is never shown
    backends = "; ".join(
        f"{b.name} {redact_url(b.url)} ({', '.join(b.models) or 'no models'}"
        f"{', default' if b.default else ''}"
        f"{', ' + b.adapter.described if b.adapter.described else ''}"
        f"{f', via proxy {b.proxy.url} from {b.proxy.source}' if b.proxy else ''})"
        for b in config.backends)
    auth = f"{len(config.keys)} inbound key(s)" if config.keys is not None else "inbound auth off"
    return (f"relay: config {config.source or '-'}; pipeline [{', '.join(config.pipeline)}]; "
            f"backends: {backends}; {auth}")
