"""Where the relay's CPU goes under a workload, by sampling it with py-spy (an investigation
tool: install it into the venv yourself, `pip install py-spy`; it is no dependency).

    python tests/bench/profile_relay.py [--workload small --concurrency 32 --seconds 10]
                                        [--target relay|bare] [--raw FILE]

Starts the mock upstream and the relay (the pipeline of relay.yaml) like run.py, keeps the
workload running while py-spy samples the relay process, then prints the functions with
the most samples: self time (the frame on top of the stack) and inclusive time (anywhere on
the stack), and the share per area (relay/, plugins/, aiohttp, asyncio, ...).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import micro  # noqa: E402
import procs  # noqa: E402

FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def area(path: str) -> str:
    path = path.replace("\\", "/")
    for marker, name in (("/relay/", "relay"), ("/plugins/", "plugins"), ("aiohttp/", "aiohttp"),
                         ("multidict/", "multidict"), ("yarl/", "yarl"), ("asyncio/", "asyncio"),
                         ("pluggy/", "pluggy"), ("selectors.py", "selectors"), ("socket.py", "socket")):
        if marker in path:
            return name
    return "other: " + os.path.basename(path)


def summarise(raw_path: str, top: int) -> str:
    selfs: Counter = Counter()
    inclusive: Counter = Counter()
    areas: Counter = Counter()
    total = 0
    with open(raw_path) as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            stack, _, count = line.rpartition(" ")
            n = int(count)
            total += n
            frames = [fr for fr in stack.split(";") if fr]
            # py-spy's raw lines may start with the process/thread name: keep code frames only.
            frames = [fr for fr in frames if FRAME.match(fr)]
            if not frames:
                continue
            leaf = FRAME.match(frames[-1])
            selfs[f"{leaf['func']} ({short(leaf['file'])})"] += n
            areas[area(leaf["file"])] += n
            seen = set()
            for fr in frames:
                m = FRAME.match(fr)
                key = f"{m['func']} ({short(m['file'])})"
                if key not in seen:
                    seen.add(key)
                    inclusive[key] += n
    out = [f"{total} samples"]
    out.append("\nself time by area:")
    out += [f"  {n / total:6.1%}  {name}" for name, n in areas.most_common()]
    out.append(f"\nself time, top {top}:")
    out += [f"  {n / total:6.1%}  {name}" for name, n in selfs.most_common(top)]
    out.append(f"\ninclusive time, top {top}:")
    out += [f"  {n / total:6.1%}  {name}" for name, n in inclusive.most_common(top)]
    return "\n".join(out)


def short(path: str) -> str:
    for marker in ("site-packages/", str(procs.ROOT) + "/", "lib/python3"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="small")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--rate", type=int, default=500)
    parser.add_argument("--target", default="relay", choices=("relay", "bare"))
    parser.add_argument("--launch", default="", help="flags for launch.py (e.g. --uvloop)")
    parser.add_argument("--native", action="store_true", help="include native frames (C extensions)")
    parser.add_argument("--raw", help="also keep py-spy's collapsed stacks in this file")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(spy):
        print("py-spy is not installed (pip install py-spy into the venv)", file=sys.stderr)
        return 2
    py = sys.executable
    with tempfile.TemporaryDirectory(prefix="relay-profile-") as tmp:
        mock = procs.Server("mock", [py, os.path.join(procs.HERE, "mock_upstream.py")])
        load = procs.LoadWorker()
        servers = [mock]
        try:
            upstream = mock.wait_ready()
            config_path = os.path.join(tmp, "relay.yaml")
            with open(config_path, "w") as f:
                yaml.safe_dump(micro.relay_config(micro.available_pipeline(), upstream,
                                                  os.path.join(tmp, "dumps")), f)
            if args.target == "bare":
                argv = [py, os.path.join(procs.HERE, "bare_proxy.py"), "--upstream", upstream]
            elif args.launch:
                argv = [py, os.path.join(procs.HERE, "launch.py"), *args.launch.split(), "--",
                        "--config", config_path, "--port", "0"]
            else:
                argv = [py, "-m", "relay", "--config", config_path, "--port", "0"]
            server = procs.Server(args.target, argv, cwd=tmp)
            servers.append(server)
            url = server.wait_ready()
            load.wait_ready()
            load.call(op="run", url=url, workload=args.workload, concurrency=args.concurrency,
                      count=200, seconds=3)
            raw = args.raw or os.path.join(tmp, "stacks.txt")
            cmd = [spy, "record", "--pid", str(server.pid), "--rate", str(args.rate), "--format", "raw",
                   "--output", raw, "--duration", str(int(args.seconds))]
            if args.native:
                cmd.append("--native")
            answer = {}
            runner = threading.Thread(target=lambda: answer.update(load.call(
                op="run", url=url, workload=args.workload, concurrency=args.concurrency,
                count=10 ** 7, seconds=args.seconds + 1)))
            cpu0 = procs.cpu_seconds(server.pid)
            runner.start()
            time.sleep(0.3)
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            runner.join()
            cpu = procs.cpu_seconds(server.pid) - cpu0
            done = len(answer.get("latencies_ms", []))
            print(f"{args.target}, {args.workload} at c={args.concurrency}: {done} requests in "
                  f"{answer.get('elapsed_s', 0):.1f} s, {cpu / max(done, 1) * 1000:.3f} ms CPU per request "
                  f"(sampling slows it down), errors {answer.get('errors')}")
            print(summarise(raw, args.top))
        finally:
            load.stop()
            for server in servers:
                server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
