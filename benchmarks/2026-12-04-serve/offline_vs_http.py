"""How much of the offline engine's speed reaches an HTTP client at concurrency 1: the same prompts decoded by an
engine in this process (as `flexdraft generate --batch-size 1` does, `--threads` threads) and sent one at a time to
a running app with the same engine, streamed, in alternating rounds (ABBA) so a machine whose speed drifts slows
both alike. Run it while the app's replica is otherwise idle.

    FLEXDRAFT_HOME=... python offline_vs_http.py --url http://127.0.0.1:8000/ar --mode ar --threads 1
"""
import argparse
import asyncio
import time

from flexdraft.core.config import RuntimeConfig
from flexdraft.core.data import chat_ids
from flexdraft.engine.config import EngineConfig
from flexdraft.engine.runner import load_engine
from flexdraft.evaluation.loadtest import prompts_of, rounds, send_level, summarize
from flexdraft.speculative.sampling import SamplingParams

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--dataset", default="gsm8k")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--mode", default="adaptive")
    p.add_argument("--drafter")
    p.add_argument("--store")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()

    lm, engine, note, _ = load_engine("smollm2", RuntimeConfig(threads=args.threads), args.drafter,
                                   EngineConfig(mode=args.mode, max_batch=1), store_spec=args.store)
    print("offline engine:", note)
    texts = prompts_of(args.dataset)
    params = SamplingParams(max_new_tokens=args.max_tokens)
    engine.generate([chat_ids(lm.tokenizer, [{"role": "user", "content": texts[0]}])], params)  # warm-up
    offline_tokens = offline_s = 0.0
    http = ([], 0.0)
    for k, (first, n) in enumerate(rounds(args.requests, 1)):
        for side in (("offline", "http") if k % 2 == 0 else ("http", "offline")):
            if side == "offline":
                for t in texts[first:first + n]:  # one at a time, as the client sends them; tokenising counted
                    t0 = time.perf_counter()
                    gen, = engine.generate([chat_ids(lm.tokenizer, [{"role": "user", "content": t}])], params)
                    lm.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
                    offline_s += time.perf_counter() - t0
                    offline_tokens += len(gen.token_ids)
            else:
                outcomes, wall = asyncio.run(send_level(args.url, texts, 1, first, n, True, args.max_tokens, {}, 300, None))
                http = (http[0] + outcomes, http[1] + wall)
    r = summarize(*http)
    offline = offline_tokens / offline_s
    print(f"{args.mode}: offline engine ({args.threads} thread(s)) {offline:.1f} tok/s; HTTP (streamed, concurrency 1) "
          f"{r['tokens_per_s']:.1f} tok/s, {r['errors']} errors: {r['tokens_per_s'] / offline:.0%} of the offline "
          "speed reaches the client")
