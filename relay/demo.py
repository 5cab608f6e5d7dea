"""`python -m relay.demo`: one tool session, sent directly to an upstream that reuses its
tool_use ids and then through the relay. Directly it dies on the second tool turn; through
the relay it completes, with the repeated ids rewritten as ``<id>-2``, ``<id>-3``, ...
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import aiohttp
import orjson
import yaml

TOOL_TURNS = 5
TOOLS = [{"name": "Bash", "description": "Run a shell command",
          "input_schema": {"type": "object", "properties": {"command": {"type": "string"}},
                           "required": ["command"]}}]


def start(args: list[str], cwd: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "relay", *args], cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None  # stdout=PIPE
    for line in proc.stdout:
        match = re.search(r"listening on (http://\S+)", line)
        if match:
            return proc, match.group(1)
    raise RuntimeError(f"{args[0]} did not start")


async def session(http: aiohttp.ClientSession, url: str, label: str, stream: bool) -> bool:
    """Drive a tool loop the way an agent does; True when the model finished its task."""
    print(f"\n== {label} ({'streaming' if stream else 'non-streaming'})")
    messages: list[dict] = [{"role": "user", "content": "Check the build, step by step."}]
    for turn in range(TOOL_TURNS + 2):
        body = {"model": "claude-demo", "max_tokens": 512, "tools": TOOLS,
                "messages": messages, "stream": stream}
        headers = {"x-api-key": "sk-demo", "anthropic-version": "2023-06-01"}
        async with http.post(url + "/v1/messages", json=body, headers=headers) as r:
            if r.status != 200:
                error = (await r.json())["error"]
                print(f"  turn {turn}: HTTP {r.status} {error['type']}: {error['message']}")
                return False
            content, stop = await (read_stream(r) if stream else read_json(r))
        calls = [b for b in content if b["type"] == "tool_use"]
        print(f"  turn {turn}: {stop:9} " + ", ".join(f"{c['name']}({c['id']})" for c in calls))
        if stop != "tool_use":
            return stop == "end_turn"
        messages.append({"role": "assistant", "content": content})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": c["id"], "content": f"ran {c['input']}"}
            for c in calls]})
    return False


async def read_json(response) -> tuple[list, str]:
    message = await response.json()
    return message["content"], message["stop_reason"]


async def read_stream(response) -> tuple[list, str | None]:
    """Assemble the message from its events, as the SDKs do."""
    blocks: list[dict] = []
    stop: str | None = None
    partial: dict[int, str] = {}
    async for line in response.content:
        if not line.startswith(b"data: "):
            continue
        event = orjson.loads(line[6:])
        kind = event["type"]
        if kind == "content_block_start":
            blocks.append(dict(event["content_block"]))
            partial[event["index"]] = ""
        elif kind == "content_block_delta":
            delta = event["delta"]
            if delta["type"] == "input_json_delta":
                partial[event["index"]] += delta["partial_json"]
            elif delta["type"] == "text_delta":
                blocks[event["index"]]["text"] += delta["text"]
        elif kind == "content_block_stop":
            block = blocks[event["index"]]
            if block["type"] == "tool_use" and partial[event["index"]]:
                block["input"] = orjson.loads(partial[event["index"]])
        elif kind == "message_delta":
            stop = event["delta"]["stop_reason"]
        elif kind == "error":
            raise RuntimeError(event["error"]["message"])
    return blocks, stop


async def run(emulator_url: str, relay_url: str) -> bool:
    async with aiohttp.ClientSession() as http:
        direct = await session(http, emulator_url, "directly to the upstream", stream=False)
        relayed = await session(http, relay_url, "through the relay", stream=False)
        relayed_stream = await session(http, relay_url, "through the relay", stream=True)
    print(f"\ndirect: {'completed' if direct else 'FAILED'}; "
          f"through the relay: {'completed' if relayed and relayed_stream else 'FAILED'}")
    return not direct and relayed and relayed_stream


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        emulator, emulator_url = start(
            ["emulate", "--port", "0", "--tool-turns", str(TOOL_TURNS), "--reuse-ids"], tmp)
        config = Path(tmp, "relay.yaml")
        config.write_text(yaml.safe_dump({
            "pipeline": ["dedup", "pairing", "ordering", "dump"],
            "plugins": {"dump": {"dir": str(Path(tmp, "dumps"))}},
            "backends": [{"name": "emulator", "url": emulator_url, "models": ["*"]}]}))
        relay, relay_url = start(["--config", str(config), "--port", "0"], tmp)
        print(f"upstream emulator (reuses one tool_use id every turn): {emulator_url}")
        print(f"relay: {relay_url}")
        try:
            ok = asyncio.run(run(emulator_url, relay_url))
        finally:
            for proc in (relay, emulator):
                proc.terminate()
                proc.wait(5)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
