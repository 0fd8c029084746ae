"""Where a batch-16 AR generation's time goes, for comparing the code of two commits in turn: each dataset's 16
bench prompts (as `flexdraft bench` builds them) through `load_engine` + the engine's steps in AR mode, greedy,
64 new tokens, bf16, 2 threads, best of 3: tokens/s, the prefill step, the mean decode step. Run it once per
checkout, alternating (the library is whatever `flexdraft` imports: put a worktree's `platform/` first on
PYTHONPATH for an older commit):

    git worktree add /tmp/before 256f167
    PYTHONPATH=/tmp/before/platform python benchmarks/2026-12-07-prefill/generations.py --label before
    python benchmarks/2026-12-07-prefill/generations.py --label after
"""
from __future__ import annotations

import argparse
import time

import torch

from flexdraft.core.config import RuntimeConfig
from flexdraft.core.data import bench_prompts
from flexdraft.engine.ar import generate
from flexdraft.engine.config import EngineConfig
from flexdraft.engine.runner import load_engine
from flexdraft.speculative.drafts import Mode
from flexdraft.speculative.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", required=True)
    args = ap.parse_args()
    lm, engine, _, _ = load_engine("smollm2", RuntimeConfig(device="cpu", dtype="bfloat16", threads=2), None,
                                   EngineConfig(mode=Mode.AR, max_batch=16, max_len=1024), store_spec="none")
    answer = lambda ps: [g.token_ids for g in generate(  # noqa: E731
        lm.model, ps, SamplingParams(max_new_tokens=128), lm.eos_token_ids)]
    params = SamplingParams(max_new_tokens=64)
    for name in ("gsm8k", "humaneval", "mt-bench"):
        prompts = [p.ids for p in bench_prompts(name, lm.tokenizer, 16, 0, answer)]
        runs = []
        with torch.inference_mode():
            for _ in range(4):  # a warm-up, then 3
                for p in prompts:
                    engine.add_request(p, params)
                t0, tokens, prefill, steps, done = time.perf_counter(), 0, 0.0, [], []
                while engine.has_work():
                    out = engine.step()
                    done += out.finished
                    tokens += out.stats.tokens
                    if out.stats.mode == "prefill":
                        prefill += out.stats.seconds
                    else:
                        steps.append(out.stats.seconds)
                wall = time.perf_counter() - t0
                for i in done:
                    engine.result(i)
                runs.append((tokens / wall, prefill, 1000 * sum(steps) / len(steps)))
        best = max(runs[1:])  # (the fastest run after the warm-up)
        print(f"| {args.label} | {name} | {best[0]:.1f} | {best[1]:.2f} | {best[2]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
