"""Micro-benchmarks of the relay's pure parts, in-process, CPU time per call.

    python tests/bench/micro.py [--quick]

- The request chain on the ~1 MB, 500-message history, exactly as serving runs it
  (``relay.prepare.prepare_exchange``: decode, route, every ``relay_request`` hook), with and
  without a change to make, plus what follows it per request (``upstream_body``, the end hooks).
- One SSE event through the stream path as ``relay.stream`` runs it: ``LazyFramer.feed``
  (which frames only the events some plugin asked for), ``StreamPlan.calls_for``, the plugins
  that asked for the event, ``Event.encode``; and ``SSEDecoder.feed`` alone, the full framing
  a stream takes when a plugin asks for every event or uses ``\r`` line ends.
- What an OpenAI-format backend adds: the translations of a small request and its answer, and
  per streamed chunk the translator with the stream path, against the Anthropic event alone.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import os
import sys
import tempfile
import time
import tracemalloc
from importlib.metadata import entry_points
from time import perf_counter, process_time

import orjson
from multidict import CIMultiDict, CIMultiDictProxy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workloads  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def shipped_pipeline() -> list[str]:
    """The pipeline of the repository's relay.yaml: the bench measures what ships, read from
    the file so that the two cannot drift apart."""
    import yaml

    with open(os.path.join(ROOT, "relay.yaml")) as f:
        return list(yaml.safe_load(f)["pipeline"])


FULL_PIPELINE = shipped_pipeline()


def available_pipeline() -> list[str]:
    """The shipped pipeline, less any plugin that cannot be imported yet."""
    found = {ep.name: ep for ep in entry_points(group="relay.plugins")}
    pipeline = []
    for name in FULL_PIPELINE:
        try:
            found[name].load()
        except Exception:  # noqa: BLE001 - a plugin still being written
            continue
        pipeline.append(name)
    return pipeline


def relay_config(pipeline: list[str], upstream: str, dump_dir: str,
                 wire_format: str = "anthropic") -> dict:
    """The relay.yaml the benchmark runs: ``pipeline`` (the shipped one), one backend, dumps
    to a temp dir, no relay keys and the state in the process's memory (no ``state`` section).
    With ``wire_format`` openai the backend is the mock's Chat Completions side."""
    backend = {"name": "mock", "url": upstream, "models": ["*"], "default": True}
    if wire_format == "openai":
        backend.update(url=upstream + "/v1", format="openai")
    config = {"server": {"host": "127.0.0.1", "port": 0}, "pipeline": pipeline,
              "backends": [backend]}
    if "dump" in pipeline:
        config["plugins"] = {"dump": {"dir": dump_dir}}
    return config


# The benchmark's relay key for the accounting relay, and limits it never reaches: every
# request takes and adds to each, and none is refused.
ACCOUNTING_KEY_ENV = "RELAY_BENCH_KEY"
ACCOUNTING_LIMITS = {"requests_per_minute": 10**9, "output_tokens_per_minute": 10**12,
                     "concurrent": 10**6, "budget": {"usd": 10**6, "per": "day"}}


def accounting_config(pipeline: list[str], upstream: str, dump_dir: str, state: str) -> dict:
    """The benchmark's relay.yaml with usage and limits in ``pipeline`` (put in front where it
    has none), one relay
    key with limits, prices for every model, and the embedded store (SQLite at ``state``)."""
    ahead = [name for name in ("limits", "usage") if name not in pipeline]
    config = relay_config([*ahead, *pipeline], upstream, dump_dir)
    config["server"]["auth"] = {"keys": [{"name": "bench", "key_env": ACCOUNTING_KEY_ENV,
                                          "limits": ACCOUNTING_LIMITS}]}
    config["state"] = {"url": f"sqlite:///{state}"}
    config.setdefault("plugins", {})["usage"] = {"prices": [{
        "models": ["*"], "usd_per_mtok": {"input": 3, "output": 15, "cache_write_5m": 3.75,
                                          "cache_write_1h": 6, "cache_read": 0.3}}]}
    return config


class Budget:
    """Iterate until ``count`` calls or ``seconds`` of wall time, whichever comes first."""

    def __init__(self, count: int, seconds: float):
        self.count = count
        self.deadline = perf_counter() + seconds
        self.done = 0

    def more(self) -> bool:
        return self.done < self.count and (self.done == 0 or perf_counter() < self.deadline)


class GCTime:
    """Wall time spent in the garbage collector, and collections per generation, while
    the block runs."""

    def __init__(self):
        self.seconds = 0.0
        self.counts = [0, 0, 0]
        self._start = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = perf_counter()
        else:
            self.seconds += perf_counter() - self._start
            self.counts[info["generation"]] += 1

    def __enter__(self):
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._callback)


async def live_memory(prepare, size: int) -> dict:
    """What one request's path allocates and holds, by tracemalloc (Python allocations only).

    ``parsed_body_bytes``: the parsed body as it lives during the exchange; ``live_peak_x``:
    the peak over parse, hooks and ``upstream_body``, plus the raw body the server read,
    over the raw body's size.
    """
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        exchange = await prepare()
        parsed = tracemalloc.get_traced_memory()[0] - base
        exchange.upstream_body()
        peak = tracemalloc.get_traced_memory()[1] - base
        del exchange
    finally:
        tracemalloc.stop()
    return {"parsed_body_bytes": parsed, "live_peak_bytes": peak + size,
            "live_peak_x": round((peak + size) / size, 2)}


async def request_benchmarks(state, pipeline, count: int, seconds: float) -> dict:
    from relay import skeleton
    from relay.exchange import Exchange
    from relay.prepare import prepare_exchange

    chain = state.chain
    headers = CIMultiDictProxy(CIMultiDict(workloads.HEADERS))
    # Each request the first of a session of its own: the full walk of a history the relay
    # has not seen.
    fresh = iter([CIMultiDictProxy(CIMultiDict({**workloads.HEADERS,
                                                workloads.SESSION_HEADER: f"micro-{n}"}))
                  for n in range(20 * count + 100)])
    out = {}
    for case, kind, expect_change in (("changed", "history_reused", True),
                                      ("unchanged", "history_unique", False),
                                      ("changed_ascii", "history_reused_ascii", True),
                                      ("unchanged_ascii", "history_unique_ascii", False)):
        raw = workloads.body(kind)

        async def prepare(raw=raw):
            return await prepare_exchange(state, method="POST", path="/v1/messages", query="",
                                          headers=next(fresh), raw_body=raw)

        exchange = await prepare()
        sent = exchange.upstream_body()
        figures = {"bytes": len(raw), "changed": exchange.changed,
                   "forwarded_verbatim": sent is raw, "as_expected": exchange.changed == expect_change}
        del exchange, sent
        figures.update(await live_memory(prepare, len(raw)))

        # The decode serving does, and for comparison the full parse a plugin asking for
        # ``exchange.body`` costs.
        for figure, decode in (("parse_ms", skeleton.decode), ("full_parse_ms", orjson.loads)):
            budget = Budget(count, seconds)
            cpu = process_time()
            while budget.more():
                decode(raw)
                budget.done += 1
            figures[figure] = (process_time() - cpu) / budget.done * 1000

        budget = Budget(count, seconds)
        cpu = process_time()
        while budget.more():
            await prepare()
            budget.done += 1
        figures["chain_ms"] = (process_time() - cpu) / budget.done * 1000

        gc_spent = GCTime()
        budget = Budget(count, seconds)
        cpu = process_time()
        with gc_spent:
            while budget.more():
                exchange = await prepare()
                exchange.upstream_body()
                exchange.outcome = "ok"
                await chain.end(exchange)
                del exchange
                budget.done += 1
        figures["request_path_ms"] = (process_time() - cpu) / budget.done * 1000
        figures["iterations"] = budget.done
        figures["gc_ms_per_request"] = gc_spent.seconds / budget.done * 1000
        figures["gc_collections_per_request"] = [round(n / budget.done, 2) for n in gc_spent.counts]

        # Where the time goes: each relay_request hook alone, in pipeline order.
        spent = {impl.plugin: 0.0 for impl in chain.impls["relay_request"]}
        serialise = 0.0
        budget = Budget(count, seconds)
        options = None
        while budget.more():
            parsed = skeleton.decode(raw)  # what prepare_exchange's parse does, timed above
            exchange = Exchange(endpoint="messages", method="POST", path="/v1/messages", query="",
                                headers=headers, raw_body=raw, skeleton=parsed,
                                backend=state.config.backend_for(parsed.model))
            options = chain.options_for(exchange)
            for impl in chain.impls["relay_request"]:
                cpu = process_time()
                impl.call({"exchange": exchange, "options": options[impl.plugin]})
                spent[impl.plugin] += process_time() - cpu
            cpu = process_time()
            exchange.upstream_body()
            serialise += process_time() - cpu
            budget.done += 1
        figures["hooks_ms"] = {name: t / budget.done * 1000 for name, t in spent.items()}
        figures["upstream_body_ms"] = serialise / budget.done * 1000
        out[case] = figures
    return out


async def session_benchmarks(state, count: int, seconds: float) -> dict:
    """The growing session's requests (workloads.session_bodies) in order, through the
    request path as serving runs it: resumed from the previous request, and walked whole
    (each a session of its own); and what a session's record holds while it is idle
    (tracemalloc, over bodies of their own as a server reads them)."""
    from relay.prepare import prepare_exchange

    chain = state.chain
    bodies = workloads.session_bodies()

    def session(name: str) -> CIMultiDictProxy:
        return CIMultiDictProxy(CIMultiDict({**workloads.HEADERS, workloads.SESSION_HEADER: name}))

    async def one(raw: bytes, headers) -> None:
        exchange = await prepare_exchange(state, method="POST", path="/v1/messages",
                                          query="", headers=headers, raw_body=raw)
        exchange.upstream_body()
        exchange.outcome = "ok"
        await chain.end(exchange)

    out = {}
    # Resumed: sessions going through the bodies in order, one after another (a session never
    # shrinks), each session's first request left out of the time (walked whole: whole_ms).
    for warm in (True, False):
        budget = Budget(count, seconds)
        spent = 0.0
        cycle = 0
        while budget.more():
            headers = session(f"micro-session-{warm}-{cycle}")
            cycle += 1
            await one(bodies[0], headers)
            for raw in bodies[1:]:
                if not budget.more():
                    break
                cpu = process_time()
                await one(raw, headers)
                spent += process_time() - cpu
                budget.done += 1
            if warm:
                break
    out["request_path_ms"] = spent / budget.done * 1000
    # Walked whole: each request the first of a session of its own.
    sessions = [session(f"micro-whole-{n}") for n in range(count + 50)]
    for raw in bodies:
        await one(raw, sessions[0])
    budget = Budget(count, seconds)
    cpu = process_time()
    while budget.more():
        await one(bodies[budget.done % len(bodies)], sessions[budget.done % len(sessions)])
        budget.done += 1
    out["whole_ms"] = (process_time() - cpu) / budget.done * 1000
    for name, raw in (("idle_kib", bodies[-1]), ("idle_small_kib", workloads.body("small"))):
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for n in range(8):  # a record is kept from a session's second request on
                headers = CIMultiDictProxy(CIMultiDict({**workloads.HEADERS,
                                                        workloads.SESSION_HEADER: f"idle-{n}"}))
                for _ in range(2):
                    exchange = await prepare_exchange(
                        state, method="POST", path="/v1/messages", query="", headers=headers,
                        raw_body=bytes(bytearray(raw)))
                    del exchange
            gc.collect()
            out[name] = round((tracemalloc.get_traced_memory()[0] - before) / 8 / 1024, 1)
        finally:
            tracemalloc.stop()
    return out


async def sse_benchmarks(state, count: int, seconds: float) -> dict:
    from relay.prepare import prepare_exchange
    from relay.redact import redacting_writer, secrets_of
    from relay.sse import Event, SSEDecoder
    from relay.stream import KeepAlive, StreamRelay

    chain = state.chain
    headers = CIMultiDictProxy(CIMultiDict(workloads.HEADERS))
    raw_body = workloads.body("stream_with_history_call")

    async def discard(data: bytes) -> None:
        pass

    async def fresh():
        exchange = await prepare_exchange(state, method="POST", path="/v1/messages", query="",
                                          headers=headers, raw_body=raw_body)
        return exchange, await chain.stream_plan(exchange)

    delta = workloads.text_delta("Hello, world")
    new_ids = [workloads.event("content_block_start", {
        "type": "content_block_start", "index": 1,
        "content_block": {"type": "tool_use", "id": f"toolu_01BenchFresh{i:010d}", "name": "Bash",
                          "input": {}}}) for i in range(500)]

    async def per_event(raws: list[bytes], per_feed: int = 1, batch: int = 500,
                        keepalive: float = 0, secrets=()) -> tuple[float, int]:
        """CPU microseconds per event through the stream path; a fresh exchange per batch.
        ``keepalive`` runs the stream's keep-alive timer, ``secrets`` redacts what it writes."""
        budget = Budget(count, seconds)
        cpu_total = 0.0
        while budget.more():
            exchange, plan = await fresh()
            # The relay's own stream loop, writing into nothing, with the access log off as
            # it is by default; primed with message_start so that the timed chunks take the
            # steady path.
            stream = StreamRelay(chain, exchange, plan, redacting_writer(discard, secrets),
                                 count_events=False)
            alive = KeepAlive(stream, keepalive) if keepalive else None
            await stream.feed(workloads.MESSAGE_START)
            chunks = [b"".join(raws[(i + k) % len(raws)] for k in range(per_feed))
                      for i in range(0, batch, per_feed)]
            cpu = process_time()
            for chunk in chunks:
                await stream.feed(chunk)
            cpu_total += process_time() - cpu
            if alive is not None:
                alive.stop()
            budget.done += len(chunks) * per_feed
        return cpu_total / budget.done * 1e6, budget.done

    # Check the cases do what they claim before timing them.
    exchange, plan = await fresh()
    checks = {}
    for name, raw in (("delta", delta), ("text_start", workloads.TEXT_BLOCK_START),
                      ("tool_new", new_ids[0]), ("tool_rewrite", workloads.TOOL_BLOCK_START)):
        event = SSEDecoder().feed(raw)[0]
        calls = plan.calls_for(event.name)
        if calls:
            await chain.stream_event(exchange, event, calls)
        checks[name] = {"plugins": [c[1].plugin for c in calls or ()], "changed": event.changed}

    out = {"checks": checks}
    out["passthrough_delta_us"], out["events"] = await per_event([delta])
    out["passthrough_delta_batched20_us"], _ = await per_event([delta], per_feed=20)
    # What stream liveness and key redaction add per event when on (off, they add nothing).
    out["passthrough_delta_keepalive_us"], _ = await per_event([delta], keepalive=10)
    out["passthrough_delta_redacting_us"], _ = await per_event(
        [delta], secrets=secrets_of(["sk-ant-api03-" + "k" * 95]))
    out["text_block_start_us"], _ = await per_event([workloads.TEXT_BLOCK_START])
    out["tool_use_start_new_id_us"], _ = await per_event(new_ids)
    out["tool_use_start_rewrite_us"], _ = await per_event([workloads.TOOL_BLOCK_START])

    # Parts of the pass-through cost.
    budget = Budget(count * 10, seconds)
    decoder = SSEDecoder()
    cpu = process_time()
    while budget.more():
        decoder.feed(delta)
        budget.done += 1
    out["decoder_feed_us"] = (process_time() - cpu) / budget.done * 1e6
    budget = Budget(count * 10, seconds)
    cpu = process_time()
    while budget.more():
        _ = Event(delta).data
        budget.done += 1
    out["event_parse_json_us"] = (process_time() - cpu) / budget.done * 1e6
    return out


async def openai_benchmarks(state, count: int, seconds: float) -> dict:
    """What an OpenAI-format backend adds over the Anthropic path: the request and answer
    translations of a small request, and per streamed chunk, the translator plus the stream
    path over its Anthropic output against the stream path over the Anthropic event alone."""
    from relay.formats import openai
    from relay.prepare import prepare_exchange
    from relay.stream import StreamRelay

    backend = dataclasses.replace(state.config.backends[0], format="openai")
    small = workloads.body("small")
    out = {}
    budget = Budget(count * 10, seconds)
    cpu = process_time()
    while budget.more():
        openai.answer_bytes(workloads.CHAT_ANSWER, "mock",
                            orjson.loads(openai.request_bytes(small, backend))["model"])
        budget.done += 1
    out["per_request_ms"] = (process_time() - cpu) / budget.done * 1e3

    chain = state.chain
    headers = CIMultiDictProxy(CIMultiDict(workloads.HEADERS))
    raw_body = workloads.body("small_stream")

    async def discard(data: bytes) -> None:
        pass

    async def per_chunk(translated: bool, per_feed: int = 1, batch: int = 500) -> float:
        budget = Budget(count * 10, seconds)
        cpu_total = 0.0
        anthropic_delta = workloads.text_delta("Hello, world")
        chat_delta = workloads.chat_text_delta("Hello, world")
        while budget.more():
            exchange = await prepare_exchange(state, method="POST", path="/v1/messages",
                                              query="", headers=headers, raw_body=raw_body)
            stream = StreamRelay(chain, exchange, await chain.stream_plan(exchange), discard,
                                 count_events=False)
            translator = openai.StreamTranslator("mock", keep_raw=True)
            if translated:  # primed: started, a text block open
                await stream.feed(translator.feed(workloads.chat_chunk(
                    {"role": "assistant", "content": ""}) + chat_delta))
                chunks = [chat_delta * per_feed] * (batch // per_feed)
            else:
                await stream.feed(workloads.MESSAGE_START + workloads.TEXT_BLOCK_START)
                chunks = [anthropic_delta * per_feed] * (batch // per_feed)
            cpu = process_time()
            if translated:
                for chunk in chunks:
                    await stream.feed(translator.feed(chunk))
            else:
                for chunk in chunks:
                    await stream.feed(chunk)
            cpu_total += process_time() - cpu
            budget.done += len(chunks) * per_feed
        return cpu_total / budget.done * 1e6

    out["anthropic_chunk_us"] = await per_chunk(False)
    out["openai_chunk_us"] = await per_chunk(True)
    out["added_per_chunk_us"] = out["openai_chunk_us"] - out["anthropic_chunk_us"]
    out["anthropic_chunk_batched20_us"] = await per_chunk(False, 20)
    out["openai_chunk_batched20_us"] = await per_chunk(True, 20)
    out["added_per_chunk_batched20_us"] = (out["openai_chunk_batched20_us"]
                                           - out["anthropic_chunk_batched20_us"])
    return out


async def run_async(quick: bool) -> dict:
    from relay import config as config_module
    from relay.chain import Chain, load_plugins
    from relay.server import RelayState, settle

    pipeline = available_pipeline()
    with tempfile.TemporaryDirectory(prefix="relay-bench-micro-") as tmp:
        config = config_module.parse(relay_config(pipeline, "http://127.0.0.1:9", tmp), {})
        chain = Chain(load_plugins(config.pipeline), config)
        await chain.startup(config)
        state = RelayState(config, chain)
        settle(config)  # the collector's and the allocator's settings, as serving runs
        try:
            count, seconds = (3, 0.5) if quick else (200, 1.5)
            started = perf_counter()
            request = await request_benchmarks(state, pipeline, count, seconds)
            session = await session_benchmarks(state, count, seconds)
            sse = await sse_benchmarks(state, *((1000, 0.3) if quick else (50000, 2.0)))
            translation = await openai_benchmarks(state, *((100, 0.3) if quick else (5000, 2.0)))
            ends = await end_benchmarks(state, *((100, 0.3) if quick else (20000, 1.0)))
        finally:
            await chain.shutdown(config)
    return {"pipeline": pipeline, "request": request, "session": session, "sse": sse,
            "openai": translation,
            "end": ends, "seconds": perf_counter() - started}


async def end_benchmarks(state, count: int, seconds: float) -> dict:
    """CPU per finished small exchange in the end-of-exchange hooks, per plugin (the metrics
    plugin's counting is all there)."""
    from relay.exchange import Answer, Attempt
    from relay.prepare import prepare_exchange

    exchange = await prepare_exchange(
        state, method="POST", path="/v1/messages", query="",
        headers=CIMultiDictProxy(CIMultiDict(workloads.HEADERS)), raw_body=workloads.body("small"))
    exchange.answer, exchange.outcome = Answer(200, {}, 300), "ok"
    exchange.attempts.append(Attempt(exchange.backend.name, "http://127.0.0.1:9", 200, None, 0.01))
    exchange.timings.upstream_headers = exchange.timings.first_byte = 0.01
    out = {}
    for impl in state.chain.impls["relay_exchange_end"]:
        options = state.chain.options_for(exchange)[impl.plugin]
        budget = Budget(count, seconds)
        cpu = process_time()
        while budget.more():
            impl.call({"exchange": exchange, "options": options})
            budget.done += 1
        out[impl.plugin] = (process_time() - cpu) / budget.done * 1e6
    return {"per_exchange_us": out}


def run(quick: bool = False) -> dict:
    return asyncio.run(run_async(quick))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    t = time.time()
    result = run(args.quick)
    print(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())
    print(f"({time.time() - t:.1f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
