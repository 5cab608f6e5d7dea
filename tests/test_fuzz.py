"""A seeded fuzzer against a real relay process in front of the strict emulator.

Valid histories (built with the helpers of support.py) are mutated the ways a broken client,
a hostile one or a bad network mangles a request: blocks and messages deleted, duplicated,
swapped or retyped, values replaced by odd unicode, huge or negative numbers and deep
nesting, bodies truncated or given invalid UTF-8, wrong content types, bogus headers and odd
query strings; half of them ask for a stream. Whatever comes in, the relay answers in the
API's terms: no 5xx, every error in Anthropic's format with the status's own type, every
stream ending in ``message_stop`` or ``event: error``, and the server healthy afterwards.

Every case is built from ``(seed, number)`` alone. A failure prints both; rerun one case with
``RELAY_FUZZ_SEED=S RELAY_FUZZ_CASE=N pytest tests/test_fuzz.py``.
"""

from __future__ import annotations

import asyncio
import copy
import gzip
import json
import os
import random
import zlib

import aiohttp
import pytest
from support import assistant, backend, request, result, text, use, user
from yarl import URL

from relay.testing.emulator import sign_thinking

SEED = int(os.environ.get("RELAY_FUZZ_SEED", "20261130"))
CASES = int(os.environ.get("RELAY_FUZZ_CASES", "3000"))
ONLY = os.environ.get("RELAY_FUZZ_CASE")
CONCURRENCY = 12
SIGNING_SECRET = "fuzz-signing-secret"

# PROTOCOL.md's table of statuses and error types; 502 is the relay's own "upstream
# unreachable" (README), which cannot happen here: the emulator is always up.
STATUS_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
    500: "api_error", 502: "api_error", 504: "timeout_error", 529: "overloaded_error",
}
ERROR_TYPES = set(STATUS_TYPES.values())


# --- valid histories -----------------------------------------------------------------------


def histories() -> list[dict]:
    """Requests the strict emulator accepts (checked by the test before any mutation)."""
    thinking = {"type": "thinking", "thinking": "Let me look.",
                "signature": sign_thinking(SIGNING_SECRET.encode(), "Let me look.")}
    server_use = {"type": "server_tool_use", "id": "srvtoolu_01A", "name": "web_search",
                  "input": {"query": "relay"}}
    server_result = {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_01A",
                     "content": [{"type": "web_search_result", "url": "https://example.com",
                                  "title": "Example", "encrypted_content": "abc"}]}
    tools = [{"name": "Bash", "description": "Run a command",
              "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}]
    return [
        request(user(text("Say hello."))),
        request({"role": "user", "content": "a plain string"}, system="Be brief."),
        request(user(text("List the files.")),
                assistant(text("Looking."), use("toolu_01A")),
                user(result("toolu_01A", "relay\nplugins"), text("And now?")),
                tools=tools),
        request(user(text("Two at once.")),
                assistant(use("toolu_01A"), use("toolu_01B", "Read")),
                user(result("toolu_01A"), result("toolu_01B", [text("file body")])),
                assistant(text("Both done.")),
                user(text("Thanks.")),
                tools=tools, metadata={"user_id": "u1"}, temperature=0.5),
        request(user(text("Search.")),
                assistant(server_use, server_result, text("Found it.")),
                user(text("Good."))),
        # A mid-conversation system entry precedes an assistant message (docs/evidence/rules.json:
        # "system-placement").
        request(user(text("Go.")),
                {"role": "system", "content": "The user switched branches."},
                assistant(text("On it.")), user(text("Go on."))),
        request(user(text("Think first.")), assistant(thinking, text("Done.")),
                user(text("Again."))),
        request(user(text("ünïcödé → データ ✓ \"quoted\" back\\slash")),
                assistant(use("toolu_01C")),
                user({"type": "tool_result", "tool_use_id": "toolu_01C", "content": "failed",
                      "is_error": True})),
    ]


# --- mutations -----------------------------------------------------------------------------

BLOCK_TYPES = ["text", "tool_use", "tool_result", "thinking", "redacted_thinking", "image",
               "server_tool_use", "web_search_tool_result", "mcp_tool_use", "document",
               "brand_new_block", "", "TEXT", " text"]
ROLES = ["user", "assistant", "system", "tool", "", "USER", None, 1, ["user"]]
KEYS = ["model", "messages", "max_tokens", "role", "content", "type", "id", "tool_use_id",
        "text", "input", "name", "stream", "system", "tools"]


def odd_string(rng: random.Random) -> str:
    """Unicode from every plane, with controls, lone surrogates, bidi marks and nulls."""
    pick = rng.random()
    if pick < 0.15:
        return ""
    if pick < 0.25:
        return rng.choice(["\u0000", "\u2028\u2029", "\ufeff", "\u202e\u202d", "\r\n\r\n",
                           "event: error\n\ndata: x", "%s%n%x", "\\u0000", "null", "toolu_01A"])
    if pick < 0.35:
        return rng.choice("aé→😀") * rng.choice([1000, 70000])
    out = []
    for _ in range(rng.randrange(1, 40)):
        plane = rng.random()
        if plane < 0.4:
            out.append(chr(rng.randrange(0x20, 0x7F)))
        elif plane < 0.5:
            out.append(chr(rng.randrange(0, 0x20)))
        elif plane < 0.6:
            out.append(chr(rng.randrange(0xD800, 0xE000)))  # lone surrogates
        elif plane < 0.8:
            out.append(chr(rng.randrange(0x80, 0xD800)))
        else:
            out.append(chr(rng.randrange(0xE000, 0x110000)))
    return "".join(out)


def odd_number(rng: random.Random):
    return rng.choice([0, -1, -2**31, 2**31, 2**63 - 1, 2**63, 2**64, -2**64, 10**30,
                       -10**400, 10**4000, 1e308, -1e308, 5e-324, -0.0, 0.5, float("inf"),
                       float("nan"), True, False])


def nested(rng: random.Random):
    # Deeper nesting than Python's own recursion allows is made as bytes (mutate_bytes).
    depth = rng.choice([10, 50, 300])
    value = rng.choice([[], {}, "x", 1])
    for _ in range(depth):
        value = [value] if rng.random() < 0.5 else {"a": value}
    return value


def odd_value(rng: random.Random):
    pick = rng.random()
    if pick < 0.35:
        return odd_string(rng)
    if pick < 0.6:
        return odd_number(rng)
    if pick < 0.7:
        return nested(rng)
    return rng.choice([None, [], {}, [None], {"": None}, {"type": "text"}, [1, "a", {}]])


def containers(doc) -> list:
    """Every list and dict in ``doc`` (the document itself included)."""
    out, stack = [], [doc]
    while stack:
        node = stack.pop()
        if isinstance(node, (list, dict)):
            out.append(node)
            stack.extend(node.values() if isinstance(node, dict) else node)
    return out


def lists_of(doc, what: str) -> list[list]:
    """The message lists (``what="messages"``) or content lists (``"blocks"``) in ``doc``."""
    found = []
    if isinstance(doc, dict) and isinstance(doc.get("messages"), list):
        if what == "messages":
            found.append(doc["messages"])
        else:
            found += [m["content"] for m in doc["messages"]
                      if isinstance(m, dict) and isinstance(m.get("content"), list)]
    return found


def mutate_list(rng: random.Random, items: list) -> str:
    op = rng.choice(["delete", "duplicate", "swap", "reverse", "clear", "insert"])
    if not items:
        items.append(odd_value(rng))
        return "insert into empty"
    i, j = rng.randrange(len(items)), rng.randrange(len(items))
    if op == "delete":
        del items[i]
    elif op == "duplicate":
        items.insert(j, copy.deepcopy(items[i]))
    elif op == "swap":
        items[i], items[j] = items[j], items[i]
    elif op == "reverse":
        items.reverse()
    elif op == "clear":
        items.clear()
    else:
        items.insert(i, odd_value(rng))
    return op


def mutate_tree(rng: random.Random, doc: dict) -> list[str]:
    """One to four structural mutations of a parsed request, in place; says which."""
    done = []
    for _ in range(rng.randrange(1, 5)):
        pick = rng.random()
        messages, blocks = lists_of(doc, "messages"), lists_of(doc, "blocks")
        if pick < 0.15 and messages:
            done.append("messages " + mutate_list(rng, rng.choice(messages)))
        elif pick < 0.35 and blocks:
            done.append("blocks " + mutate_list(rng, rng.choice(blocks)))
        elif pick < 0.45 and blocks and any(blocks):
            block = rng.choice(rng.choice([b for b in blocks if b]))
            if isinstance(block, dict):
                block["type"] = rng.choice(BLOCK_TYPES + [odd_value(rng)])
                done.append(f"block type -> {block['type']!r:.40}")
        elif pick < 0.5 and messages and messages[0]:
            message = rng.choice(messages[0])
            if isinstance(message, dict):
                message["role"] = rng.choice(ROLES)
                done.append(f"role -> {message['role']!r}")
        elif pick < 0.6:
            node = rng.choice([c for c in containers(doc) if isinstance(c, dict)])
            key = rng.choice(KEYS)
            if key in node and rng.random() < 0.5:
                del node[key]
                done.append(f"drop {key}")
            else:
                node[key] = odd_value(rng)
                done.append(f"set {key}")
        elif pick < 0.65:
            doc["model"] = rng.choice(["", "x" * rng.choice([300, 100000]), "claude\nforged line",
                                       "../../admin", "claude-test\r\nx-injected: 1",
                                       odd_string(rng), 12, None])
            done.append("model")
        else:
            node = rng.choice(containers(doc))
            value = odd_value(rng)
            if isinstance(node, dict):
                key = rng.choice(list(node) or ["k"]) if rng.random() < 0.8 else odd_string(rng)
                node[key] = value
            elif node:
                node[rng.randrange(len(node))] = value
            else:
                node.append(value)
            done.append(f"value -> {type(value).__name__}")
    return done


def serialise(rng: random.Random, doc) -> bytes:
    """JSON text as Python writes it: big integers, NaN and lone surrogates survive."""
    ascii_only = rng.random() < 0.5
    try:
        out = json.dumps(doc, ensure_ascii=ascii_only, separators=rng.choice([(",", ":"), (", ", ": ")]))
    except RecursionError:
        out = json.dumps({"model": "claude-test", "max_tokens": 5, "messages": []})
        return out.replace('"messages": []', '"messages": ' + "[" * 30000 + "]" * 30000).encode()
    return out.encode("utf-8", "surrogatepass")


def mutate_bytes(rng: random.Random, raw: bytes) -> tuple[bytes, str]:
    pick = rng.random()
    if pick < 0.2:
        cut = rng.randrange(len(raw) + 1)
        return raw[:cut], f"truncated at {cut}"
    if pick < 0.4:
        bad = rng.choice([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\xaf",
                          b"\xe2\x82", b"\x00", b"\x80\x80\x80"])
        # Inside a string when there is one: the text a skeleton keeps raw.
        quote = raw.find(b'"text":"') if rng.random() < 0.7 else -1
        at = quote + 8 if quote >= 0 else rng.randrange(len(raw) + 1)
        return raw[:at] + bad + raw[at:], f"invalid utf-8 {bad!r} at {at}"
    if pick < 0.5:
        data = bytearray(raw)
        for _ in range(rng.randrange(1, 6)):
            if data:
                data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data), "flipped bytes"
    if pick < 0.6:
        return rng.choice([b"", b"null", b"[]", b"{}", b'"messages"', b"1e999999", b"\xef\xbb\xbf" + raw,
                           b"  \n" + raw + b"\n\n", raw + b"garbage", raw + raw,
                           b"{" * 5000, b"[" * 200000, raw.replace(b"{", b"{\"model\":1,", 1)]), "replaced"
    if pick < 0.65 and raw.startswith(b"{"):
        depth = rng.choice([100, 1000, 5000, 100000])
        where = rng.choice([b'"deep":', b'"messages":[{"role":"user","content":'])
        deep = b"[" * depth + b"]" * depth if rng.random() < 0.5 else b'{"a":' * depth + b"1" + b"}" * depth
        return b"{" + where + deep + (b"]," if b"messages" in where else b",") + raw[1:], \
            f"nested {depth} deep in {where!r}"
    if pick < 0.75 and raw.startswith(b"{"):
        # Duplicate keys: which one wins is the parser's choice; both must get a clean answer.
        dup = rng.choice([b'"messages":[],', b'"model":"x",', b'"stream":true,', b'"stream":"yes",'])
        return b"{" + dup + raw[1:], f"duplicate key {dup!r}"
    return raw, "as is"


QUERIES = ["", "beta=true", "beta=true&beta=false", "%zz", "a=%00", "=&&=", "q=a%23b&beta=true",
           "x=" + "y" * 4000, "beta", "%E2%82", "a[]=1&a[]=2", "beta=true#frag", "%3F%3F", "+",
           "%C3%BC=%C3%B6", "beta=true;x=1", "a=%2F..%2F", "%%", "beta=true&" * 200]
CONTENT_TYPES = ["application/json", "application/json; charset=utf-8", "APPLICATION/JSON",
                 "application/json; charset=latin-1", "text/plain", "text/plain;charset=UTF-8",
                 "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                 "application/octet-stream", "", "application/jsonx", "*/*", None]
BOGUS_HEADERS = [
    {"anthropic-version": "1999-01-01"}, {"anthropic-version": ""},
    {"anthropic-beta": ",".join(["x"] * 500)}, {"x-api-key": "k" * 4000},
    {"authorization": "Bearer"}, {"authorization": "Basic Zm9vOmJhcg=="},
    {"accept": "text/event-stream"}, {"accept-encoding": "gzip, br, zstd"},
    {"connection": "close"}, {"connection": "x-api-key, anthropic-version"},
    {"expect": "100-continue"}, {"x-forwarded-for": "1.2.3.4"}, {"host": "evil.example"},
    {"x-stainless-retry-count": "-1"}, {"cookie": "a=b"}, {"range": "bytes=0-1"},
    {"te": "trailers"}, {"x-claude-code-session-id": "\u00e9\u00e8"},
]
ENCODINGS = ["gzip", "deflate", "gzip-invalid", "identity", "x-unknown", "gzip, gzip"]
PATHS = ["/v1/messages"] * 8 + ["/v1/messages/count_tokens"] * 2 + [
    "/v1/models", "/v1/messages/", "/v1/nope", "/healthz", "/", "/v1//messages"]
METHODS = ["POST"] * 20 + ["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]


def build_case(seed: int, number: int, bases: list[dict]) -> dict:
    """Everything about case ``number``: method, path, query, headers, body, and what was done."""
    rng = random.Random(f"{seed}:{number}")
    doc = copy.deepcopy(rng.choice(bases))
    if rng.random() < 0.5:
        doc["stream"] = True
    done = mutate_tree(rng, doc) if rng.random() < 0.85 else ["valid"]
    raw = serialise(rng, doc)
    if rng.random() < 0.3:
        raw, what = mutate_bytes(rng, raw)
        done.append(what)
    headers = {"anthropic-version": "2023-06-01", "x-api-key": "fuzz-key"}
    content_type = "application/json" if rng.random() < 0.7 else rng.choice(CONTENT_TYPES)
    if content_type is not None:
        headers["content-type"] = content_type
        if content_type != "application/json":
            done.append(f"content-type {content_type!r}")
    if rng.random() < 0.2:
        extra = rng.choice(BOGUS_HEADERS)
        headers.update(extra)
        done.append(f"header {next(iter(extra))}")
    if rng.random() < 0.08:
        encoding = rng.choice(ENCODINGS)
        if encoding.startswith("gzip") and encoding != "gzip-invalid":
            raw = gzip.compress(raw)
            if encoding == "gzip, gzip":
                raw = gzip.compress(raw)
        elif encoding == "deflate":
            raw = zlib.compress(raw)
        headers["content-encoding"] = "gzip" if encoding == "gzip-invalid" else encoding
        done.append(f"content-encoding {encoding}")
    query = rng.choice(QUERIES) if rng.random() < 0.3 else rng.choice(["", "beta=true"])
    path = rng.choice(PATHS) if rng.random() < 0.1 else "/v1/messages"
    method = rng.choice(METHODS) if rng.random() < 0.05 else "POST"
    chunked = rng.random() < 0.05
    return {"number": number, "method": method, "path": path, "query": query, "headers": headers,
            "body": raw, "chunked": chunked, "done": done,
            "stream": isinstance(doc, dict) and doc.get("stream") is True}


# --- checking the answers ------------------------------------------------------------------


def describe(case: dict) -> str:
    body = case["body"]
    return (f"seed {SEED} case {case['number']} (rerun: RELAY_FUZZ_SEED={SEED} "
            f"RELAY_FUZZ_CASE={case['number']}): {case['method']} {case['path']}?{case['query']} "
            f"headers {case['headers']} chunked {case['chunked']} mutations {case['done']} "
            f"body ({len(body)} bytes) {body[:300]!r}")


def check_error(status: int, content_type: str, payload: bytes) -> str | None:
    """What is wrong with an error answer, or None when it is in Anthropic's format."""
    if content_type != "application/json":
        return f"error {status} with content-type {content_type!r}: {payload[:300]!r}"
    try:
        doc = json.loads(payload)
    except ValueError:
        return f"error {status} body is not JSON: {payload[:300]!r}"
    error = doc.get("error") if isinstance(doc, dict) else None
    if doc.get("type") != "error" or not isinstance(error, dict):
        return f"error {status} not in Anthropic's format: {payload[:300]!r}"
    if not isinstance(error.get("message"), str) or not isinstance(error.get("type"), str):
        return f"error {status} without a string type and message: {payload[:300]!r}"
    expected = STATUS_TYPES.get(status)
    if expected and error["type"] != expected:
        return f"error {status} has type {error['type']!r}, the table says {expected!r}"
    if error["type"] not in ERROR_TYPES:
        return f"error {status} has type {error['type']!r}, not one the API uses"
    return None


def check_stream(payload: bytes) -> str | None:
    """A stream must end with message_stop or with an error event, nothing else."""
    events = [e for e in payload.replace(b"\r\n", b"\n").split(b"\n\n") if e.strip()]
    if not events:
        return "an empty stream"
    last = events[-1]
    names = [line[6:].strip() for line in last.split(b"\n") if line.startswith(b"event:")]
    if names not in ([b"message_stop"], [b"error"]):
        return f"the stream ends with {last[:300]!r}, not message_stop or an error event"
    return None


def check_answer(case: dict, status: int, headers, payload: bytes) -> str | None:
    origin = "upstream" if "request-id" in headers else "relay"
    content_type = headers.get("content-type", "").split(";")[0].strip().lower()
    if status >= 500:
        return f"{origin} answered {status}: {payload[:500]!r}"
    if status >= 400 and case["method"] != "HEAD":  # a HEAD answer has no body to check
        problem = check_error(status, content_type, payload)
        return f"{origin}: {problem}" if problem else None
    if content_type == "text/event-stream":
        return check_stream(payload)
    return None


async def send(session: aiohttp.ClientSession, base: str, case: dict):
    url = URL(f"{base}{case['path']}" + (f"?{case['query']}" if case["query"] else ""),
              encoded=True)
    data = case["body"]
    if case["chunked"]:
        async def pieces(body=data):
            for i in range(0, len(body), 997):
                yield body[i:i + 997]
        data = pieces()
    skip = () if "content-type" in case["headers"] else ("Content-Type",)
    async with session.request(case["method"], url, data=data if case["method"] != "GET" else None,
                               headers=case["headers"], skip_auto_headers=skip) as response:
        payload = await response.read()
        return response.status, response.headers, payload


async def run_cases(base: str, cases: list[dict]) -> list[str]:
    failures: list[str] = []
    statuses: dict[int, int] = {}
    gate = asyncio.Semaphore(CONCURRENCY)
    connector = aiohttp.TCPConnector(limit=CONCURRENCY)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout,
                                     auto_decompress=False) as session:
        async def one(case):
            async with gate:
                try:
                    status, headers, payload = await send(session, base, case)
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    failures.append(f"no answer ({type(e).__name__}; a reset may come from the "
                                    f"previous request on the connection): {e} to {describe(case)}")
                    return
            statuses[status] = statuses.get(status, 0) + 1
            problem = check_answer(case, status, headers, payload)
            if problem:
                failures.append(f"{problem}\n    for {describe(case)}")

        await asyncio.gather(*(one(case) for case in cases))
    print(f"fuzz seed {SEED}: {len(cases)} cases, statuses {dict(sorted(statuses.items()))}")
    return failures


async def healthy(base: str) -> list[str]:
    """What is wrong with the relay after the storm: it answers, and serves a valid request."""
    problems = []
    body = json.dumps(request(user(text("Still there?")))).encode()
    stream_body = json.dumps(request(user(text("Still there?")), stream=True)).encode()
    headers = {"content-type": "application/json", "anthropic-version": "2023-06-01",
               "x-api-key": "fuzz-key"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        async with session.get(f"{base}/healthz") as response:
            if response.status != 200:
                problems.append(f"/healthz answered {response.status}")
        async with session.post(f"{base}/v1/messages", data=body, headers=headers) as response:
            payload = await response.read()
            if response.status != 200 or json.loads(payload).get("type") != "message":
                problems.append(f"a valid request got {response.status}: {payload[:300]!r}")
        async with session.post(f"{base}/v1/messages", data=stream_body, headers=headers) as response:
            payload = await response.read()
            if response.status != 200 or not payload.rstrip().endswith(b'{"type":"message_stop"}'):
                problems.append(f"a valid stream got {response.status}: {payload[-300:]!r}")
    return problems


def log_problems(output: str) -> list[str]:
    """Each traceback (or aiohttp unhandled-error report) in the relay's output, named by its
    last line."""
    lines = output.splitlines()
    found = []
    n = 0
    while n < len(lines):
        line = lines[n]
        if not ("Traceback" in line or "Unhandled exception" in line
                or "Error handling request" in line or "Too many open files" in line):
            n += 1
            continue
        end = n + 1
        while end < len(lines) and not lines[end][:4].isdigit():
            end += 1  # up to the next timestamped log line
        block = lines[n:end]
        last = next((b for b in reversed(block) if b.strip() and not b.startswith(" ")), line)
        found.append(f"relay log ({last.strip()[:100]}): " + "\n".join(block[:60]))
        n = end
    return found


def summary(failures: list[str]) -> str:
    """Two examples of each kind of failure."""
    kinds: dict[str, list[str]] = {}
    for failure in failures:
        kind = (failure[:failure.index("): ") + 1] if failure.startswith("relay log")
                else failure.split(":")[0])
        kinds.setdefault(kind[:120], []).append(failure)
    return "\n".join(f"- {len(found)} x {kind}:\n" + "\n".join(f[:1500] for f in found[:2])
                     for kind, found in kinds.items())


# --- the test ------------------------------------------------------------------------------


@pytest.fixture
def servers(emulator, relay):
    upstream = emulator("--no-record", "--signing-secret", SIGNING_SECRET)
    server = relay({"pipeline": ["dedup", "pairing", "ordering", "dump"],
                    "plugins": {"dump": {"dir": "dumps", "include_relay_rejections": True,
                                         "include_stream_errors": True}},
                    "backends": [backend(upstream.url, default=True)]})
    return upstream, server


async def test_the_unmutated_histories_are_valid(servers):
    """The fuzzer starts from requests the strict emulator accepts, through the relay."""
    _, server = servers
    cases = []
    for n, body in enumerate(histories()):
        for stream in (False, True):
            raw = json.dumps({**body, "stream": stream}).encode()
            cases.append({"number": n, "method": "POST", "path": "/v1/messages", "query": "",
                          "headers": {"content-type": "application/json"}, "body": raw,
                          "chunked": False, "done": ["valid"], "stream": stream})
    async with aiohttp.ClientSession() as session:
        for case in cases:
            status, headers, payload = await send(session, server.url, case)
            assert status == 200, f"{payload[:500]!r} for {describe(case)}"
            assert check_answer(case, status, headers, payload) is None


async def test_fuzzed_requests_get_clean_answers_and_leave_the_relay_healthy(servers):
    _, server = servers
    bases = histories()
    numbers = [int(ONLY)] if ONLY else range(CASES)
    cases = [build_case(SEED, n, bases) for n in numbers]
    failures = await run_cases(server.url, cases)
    failures += await healthy(server.url)
    assert server.proc.poll() is None, f"the relay exited ({server.proc.returncode}), seed {SEED}"
    failures += log_problems(server.output())
    assert not failures, f"seed {SEED}: {len(failures)} failure(s)\n" + summary(failures)


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict, bytes]:
    """One HTTP/1.1 answer with a Content-Length body, from a raw connection."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    body = await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", 0))), 10)
    return status, headers, body


def raw_post(host: str, body: bytes, headers: str = "") -> bytes:
    return (f"POST /v1/messages HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"x-api-key: fuzz-key\r\n{headers}Content-Length: {len(body)}\r\n\r\n").encode() + body


async def test_an_undecodable_body_is_refused_cleanly_and_the_connection_stays_usable(servers):
    """A gzip body that is not gzip: a 400 in Anthropic's format, and then either the
    connection serves the next request or the answer said ``Connection: close``; never an
    answer that promises keep-alive on a connection the server then drops (the client's next
    request on it is reset), and never a traceback in the log. Found by the fuzzer
    (mutation ``content-encoding gzip-invalid``)."""
    _, server = servers
    host = server.url.split("//")[1]
    reader, writer = await asyncio.open_connection(*host.rsplit(":", 1))
    try:
        writer.write(raw_post(host, b"not gzip at all", "Content-Encoding: gzip\r\n"))
        status, headers, payload = await read_answer(reader)
        assert status == 400
        assert check_error(400, headers.get("content-type", "").split(";")[0], payload) is None
        if headers.get("connection", "").lower() != "close":
            writer.write(raw_post(host, json.dumps(request(user(text("hi")))).encode()))
            try:
                status, _, payload = await read_answer(reader)
            except (asyncio.IncompleteReadError, ConnectionError) as e:
                pytest.fail(f"the 400 kept the connection alive, then the relay dropped it: {e!r}")
            assert status == 200, payload
    finally:
        writer.close()
    await asyncio.sleep(0.2)
    assert not log_problems(server.output()), log_problems(server.output())[0]


# Requests aiohttp's HTTP parser refuses (or reads its own way) before the relay's handlers
# see them. Where the relay cannot answer in Anthropic's format, aiohttp's own plain-text 400
# remains; what must hold for every one is an answer or a closed connection, never a 5xx, a
# hang, or a traceback in the log (one per request is a log flood anyone can send).
WIRE = {
    "raw non-ASCII in the query": b"POST /v1/messages?\xc3\xbc=\xc3\xb6 HTTP/1.1\r\n",
    "content-encoding br": b"POST /v1/messages HTTP/1.1\r\nContent-Encoding: br\r\n",
    "content-encoding zstd": b"POST /v1/messages HTTP/1.1\r\nContent-Encoding: zstd\r\n",
    "unknown method": b"BREW /v1/messages HTTP/1.1\r\n",
    "lower-case method": b"post /v1/messages HTTP/1.1\r\n",
    "transfer-encoding foo": b"POST /v1/messages HTTP/1.1\r\nTransfer-Encoding: foo\r\n",
    "transfer-encoding gzip, chunked":
        b"POST /v1/messages HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n",
    "content-length and chunked":
        b"POST /v1/messages HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n",
    "content-length abc": b"POST /v1/messages HTTP/1.1\r\nContent-Length: abc\r\n",
    "content-length -1": b"POST /v1/messages HTTP/1.1\r\nContent-Length: -1\r\n",
    "two content-lengths": b"POST /v1/messages HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 3\r\n",
    "a 20 KB header": b"POST /v1/messages HTTP/1.1\r\nx-big: " + b"a" * 20000 + b"\r\n",
    "a header without a colon": b"POST /v1/messages HTTP/1.1\r\nnocolon\r\n",
    "a NUL in a header": b"POST /v1/messages HTTP/1.1\r\nx-api-key: a\x00b\r\n",
    "HTTP/2.0 on the request line": b"POST /v1/messages HTTP/2.0\r\n",
    "no version": b"POST /v1/messages\r\n",
    "absolute-form target": b"POST http://evil.example/v1/messages HTTP/1.1\r\n",
    "a space in the path": b"POST /v1/mess ages HTTP/1.1\r\n",
}


async def test_malformed_http_gets_an_answer_or_a_close_never_a_5xx_or_a_traceback(servers):
    _, server = servers
    host = server.url.split("//")[1]
    body = json.dumps(request(user(text("hi")))).encode()
    problems, plain = [], []
    for name, head in WIRE.items():
        reader, writer = await asyncio.open_connection(*host.rsplit(":", 1))
        try:
            writer.write(head + b"Host: " + host.encode() + b"\r\nConnection: close\r\n"
                         + (b"" if b"Content-Length" in head or b"Transfer-Encoding" in head
                            else b"Content-Length: %d\r\n" % len(body))
                         + b"\r\n" + body)
            answer = await asyncio.wait_for(reader.read(), 10)
        except ConnectionError:
            answer = b""
        except asyncio.TimeoutError:
            problems.append(f"{name}: no answer and no close within 10 s")
            continue
        finally:
            writer.close()
        if not answer:
            continue
        head_end = answer.find(b"\r\n\r\n")
        status_line, _, header_text = answer[:head_end].decode("latin-1").partition("\r\n")
        parts = status_line.split()
        status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
        headers = {k.strip().lower(): v.strip() for k, _, v in
                   (line.partition(":") for line in header_text.split("\r\n") if line)}
        content_type = headers.get("content-type", "").split(";")[0].strip()
        if not 100 <= status < 500:
            problems.append(f"{name}: answered {status_line!r}")
        elif status >= 400 and content_type == "application/json":
            problem = check_error(status, content_type, answer[head_end + 4:])
            if problem:
                problems.append(f"{name}: {problem}")
        elif status >= 400:
            plain.append(f"{name}: {status} {content_type or '(no content-type)'}")
    print("answered by aiohttp's parser, not in Anthropic's format:\n  " + "\n  ".join(plain))
    problems += await healthy(server.url)
    problems += log_problems(server.output())
    assert not problems, "\n".join(problems)
