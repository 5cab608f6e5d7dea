"""Run the relay (``relay.cli.main``) with a runtime change, for comparison runs only.

    python tests/bench/launch.py [--uvloop] [--gc-threshold N] [--patch FILE] -- ARGS...

- ``--uvloop``: on uvloop's event loop (when uvloop is installed; it is no dependency).
- ``--gc-threshold N``: ``gc.set_threshold(N)`` (the first generation's threshold).
- ``--patch FILE``: run a Python file first, which may monkeypatch the relay: a way to
  measure a proposed change to the host before making it.

ARGS are the relay's own command line (``--config FILE --port 0``).
"""

import argparse
import asyncio
import gc
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--uvloop", action="store_true")
    parser.add_argument("--gc-threshold", type=int)
    parser.add_argument("--patch", action="append", default=[])
    parser.add_argument("relay_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    relay_args = args.relay_args[1:] if args.relay_args[:1] == ["--"] else args.relay_args
    if args.uvloop:
        import uvloop
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    from relay import cli
    for path in args.patch:
        with open(path) as f:
            exec(compile(f.read(), path, "exec"), {"__name__": "relay_bench_patch"})
    if args.gc_threshold:
        gc.set_threshold(args.gc_threshold)
    return cli.main(relay_args)


if __name__ == "__main__":
    sys.exit(main())
