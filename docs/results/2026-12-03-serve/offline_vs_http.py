"""How much of the offline engine's speed reaches an HTTP client at concurrency 1: the same prompts decoded by an
engine in this process (as `flexdraft generate --batch-size 1` does) and sent one at a time to a running app, in
alternating rounds (ABBA) so a machine whose speed drifts slows both alike.

    FLEXDRAFT_HOME=... python offline_vs_http.py --url http://127.0.0.1:8000 --requests 16 --max-tokens 64
"""
import argparse
import asyncio
import time

from flexdraft.config import RuntimeConfig
from flexdraft.data import chat_ids
from flexdraft.engine_config import EngineConfig
from flexdraft.generate import SamplingParams
from flexdraft.loadtest import _level, prompts_of, rounds, summarize
from flexdraft.runner import load_engine

p = argparse.ArgumentParser()
p.add_argument("--url", default="http://127.0.0.1:8000")
p.add_argument("--dataset", default="gsm8k")
p.add_argument("--requests", type=int, default=16)
p.add_argument("--max-tokens", type=int, default=64)
p.add_argument("--mode", default="adaptive")
p.add_argument("--threads", type=int, default=0)
args = p.parse_args()

lm, engine, note = load_engine("smollm2", RuntimeConfig(threads=args.threads), None,
                               EngineConfig(mode=args.mode, max_batch=1))
print("offline engine:", note)
texts = prompts_of(args.dataset)
params = SamplingParams(max_new_tokens=args.max_tokens)
engine.generate([chat_ids(lm.tokenizer, [{"role": "user", "content": texts[0]}])], params)  # warm-up
offline_tokens = offline_s = 0.0
http = ([], 0.0)
for k, (first, n) in enumerate(rounds(args.requests, 1)):
    for side in (("offline", "http") if k % 2 == 0 else ("http", "offline")):
        if side == "offline":
            ids = [chat_ids(lm.tokenizer, [{"role": "user", "content": t}]) for t in texts[first:first + n]]
            t0 = time.perf_counter()
            gens = engine.generate(ids, params)
            offline_s += time.perf_counter() - t0
            offline_tokens += sum(len(g.token_ids) for g in gens)
        else:
            outcomes, wall = asyncio.run(_level(args.url, texts, 1, first, n, True, args.max_tokens, {}, 300, None))
            http = (http[0] + outcomes, http[1] + wall)
r = summarize(*http)
offline = offline_tokens / offline_s
print(f"offline engine {offline:.1f} tok/s; HTTP (streamed, concurrency 1) {r['tokens_per_s']:.1f} tok/s, "
      f"{r['errors']} errors: {r['tokens_per_s'] / offline:.0%} of the offline speed reaches the client")
