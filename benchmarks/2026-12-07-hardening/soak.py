"""A replica's engine under a soak of mixed option requests, in process (no Ray, no HTTP): AsyncEngine over the
real model with plain, logprobs-20, 4-choice, grammar and dropped-stream requests, 8 at once; the process's RSS
after every 250 requests, with the engine's periodic heap trim on and off (`--no-trim`).

    python benchmarks/2026-12-07-hardening/soak.py --requests 1500 [--no-trim] [--dtype float32]
"""
import argparse
import asyncio
import random
import time

import psutil
import torch

import flexdraft.serving.async_engine as async_engine
from flexdraft.core.config import RuntimeConfig
from flexdraft.engine.config import EngineConfig
from flexdraft.engine.runner import load_engine
from flexdraft.serving.async_engine import AsyncEngine, built_apart
from flexdraft.speculative.grammar import JSON_OBJECT, Grammar
from flexdraft.speculative.sampling import SamplingParams

KINDS = ("plain", "logprobs", "choices", "grammar", "dropped")
SCHEMA = Grammar.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})


async def soak(engine: AsyncEngine, grammars, prompts: list[list[int]], total: int, every: int) -> list[tuple]:
    rng, gate, process, marks, t0 = random.Random(0), asyncio.Semaphore(8), psutil.Process(), [], time.time()

    async def one(i: int):
        kind = rng.choice(KINDS)
        options = dict(max_new_tokens=rng.randint(4, 24), temperature=rng.choice([0.0, 0.8]), seed=i)
        if kind == "logprobs":
            options["logprobs"] = 20
        if kind == "grammar":  # (compiled once, as a server does, then copied per choice)
            options["grammar"] = grammars.compile(rng.choice([SCHEMA, JSON_OBJECT]))
        params = SamplingParams(**options)

        async def read(leave: int | None):
            async for k, _ in aenumerate(engine.generate(prompts[i % len(prompts)], params, group=i)):
                if leave is not None and k >= leave:
                    break

        async with gate:
            await asyncio.gather(*(read(rng.choice([0, 1, 2]) if kind == "dropped" else None)
                                   for _ in range(4 if kind == "choices" else 1)))
        if (i + 1) % every == 0:
            marks.append((i + 1, round(process.memory_info().rss / 2 ** 20, 1), round(time.time() - t0)))
            print(*marks[-1], flush=True)

    await asyncio.gather(*(one(i) for i in range(total)))
    return marks


async def aenumerate(items):
    k = 0
    async for item in items:
        k += 1
        yield k, item


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--every", type=int, default=250)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--no-trim", action="store_true", help="no periodic malloc_trim (the engine before it)")
    args = parser.parse_args()
    if args.no_trim:
        async_engine.TRIM_EVERY_S = float("inf")
    torch.set_num_threads(2)
    lm, engine, note, _ = built_apart(lambda: load_engine(
        "smollm2", RuntimeConfig(device="cpu", dtype=args.dtype, threads=2), "init",
        EngineConfig(mode="adaptive", max_batch=16), store_spec="none"))
    print(note, "trim" if not args.no_trim else "no trim", flush=True)
    prompts = [lm.tokenizer(f"Question {i}: what is {i} plus {3 * i}? Explain.")["input_ids"] for i in range(64)]
    served = AsyncEngine(engine)
    try:
        marks = asyncio.run(soak(served, engine.grammars, prompts, args.requests, args.every))
    finally:
        served.shutdown()
    after = [rss for n, rss, _ in marks if n >= args.requests // 3]
    print(f"RSS over requests {args.requests // 3}-{args.requests}: {after[0]} -> {after[-1]} MB "
          f"({after[-1] - after[0]:+.1f})")


if __name__ == "__main__":
    main()
