"""Where the offline engine's speed goes on its way to an HTTP client at concurrency 1: the same prompts decoded
(1) by the engine's step loop in this process, (2) through AsyncEngine with the replica's per-chunk work
(detokenise, chunk body, SSE line) on an asyncio loop in this process, (3) by the Serve app over HTTP (streamed),
in rotating rounds (each request's prompt goes to every side, each round starting at the next side). Per side:
tok/s end to end, TTFT p50 and the decode time per token after the first (TPOT p50). Run it while the app is idle.

    FLEXDRAFT_HOME=... python gap.py --url http://127.0.0.1:8000/ar --mode ar --requests 16
    FLEXDRAFT_HOME=... python gap.py --url http://127.0.0.1:8000 --mode adaptive --drafter D --store S
"""
import argparse
import asyncio
import statistics
import time

from flexdraft.core.config import RuntimeConfig
from flexdraft.core.data import chat_ids
from flexdraft.engine.config import EngineConfig
from flexdraft.engine.runner import load_engine
from flexdraft.evaluation.loadtest import prompts_of, send_level
from flexdraft.serving.async_engine import AsyncEngine
from flexdraft.serving.openai_api import Request, TextStream, chunk, sse
from flexdraft.speculative.sampling import SamplingParams

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--mode", default="ar")
    p.add_argument("--drafter"); p.add_argument("--store")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--sides", default="offline,async,http")
    args = p.parse_args()
    lm, engine, note, _ = load_engine("smollm2", RuntimeConfig(threads=args.threads), args.drafter,
                                      EngineConfig(mode=args.mode, max_batch=1), store_spec=args.store)
    print(note)
    texts = prompts_of("gsm8k")[:args.requests]
    params = SamplingParams(max_new_tokens=args.max_tokens)
    ids = lambda t: chat_ids(lm.tokenizer, [{"role": "user", "content": t}])
    engine.generate([ids(texts[0])], params)

    def offline(t):
        t0 = time.perf_counter(); rid = engine.add_request(ids(t), params); first = None
        while engine.has_work():
            out = engine.step()
            if any(d.id == rid and d.tokens for d in out.deltas) and first is None: first = time.perf_counter()
        n = len(engine.result(rid).token_ids)
        return t0, first, time.perf_counter(), n

    aengine = None
    async def via_async(t):
        req = Request(True, "m", [], params, True, id="x", created=0)
        text = TextStream(lm.tokenizer, []); t0 = time.perf_counter(); first = None; n = 0; f = True
        async for c in aengine.generate(ids(t), params):
            first = first or time.perf_counter(); n += len(c.tokens)
            delta = text.add(c.tokens, final=c.finished is not None)
            sse(chunk(req, delta, c.tokens, None, first=f)); f = False
        return t0, first, time.perf_counter(), n

    def http(t):
        (o,), wall = asyncio.run(send_level(args.url, [t], 1, 0, 1, True, args.max_tokens, {}, 300, None))
        assert o.status == 200, o
        return 0.0, o.ttft, o.seconds, o.tokens

    rows = {s: [] for s in args.sides.split(",")}
    for k, t in enumerate(texts):
        sides = list(rows)[k % len(rows):] + list(rows)[:k % len(rows)]
        for s in sides:
            if s == "offline": r = offline(t)
            elif s == "async":
                aengine = AsyncEngine(engine)  # owns the engine while it lives: stopped before the offline side
                r = asyncio.run(via_async(t))
                aengine.shutdown()
            else: r = http(t)
            rows[s].append(r)
    base = None
    for s, rs in rows.items():
        tok = sum(r[3] for r in rs); secs = sum(r[2] - r[0] for r in rs)
        ttft = statistics.median(r[1] - r[0] for r in rs)
        tpot = statistics.median((r[2] - r[1]) / max(r[3] - 1, 1) for r in rs)
        base = base or tok / secs
        print(f"{args.mode:8s} {s:8s} {tok / secs:6.1f} tok/s ({tok / secs / base:4.0%})  TTFT p50 {ttft*1e3:6.1f} ms  "
              f"TPOT p50 {tpot*1e3:6.2f} ms  tokens {tok}")
