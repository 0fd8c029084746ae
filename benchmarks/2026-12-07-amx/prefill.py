"""Prefill with and without the causal form (`Transformer.forward`: positions 0..T-1 over nothing cached attend
through SDPA's causal kernel, no mask built), paired in one process: each dataset's 16 bench prompts prefilled as
the engine does (`engine.ar.prefill`: length groups into one 16-row cache), the two forms alternating, best of 5.

    python benchmarks/2026-12-07-amx/prefill.py
"""
from __future__ import annotations

import time

import torch

import flexdraft.models.transformer as transformer
from flexdraft.core.config import RuntimeConfig
from flexdraft.core.data import bench_prompts
from flexdraft.engine.ar import prefill
from flexdraft.models.loading import load_model

FORMS = {"masked": 10 ** 9, "causal": transformer.CAUSAL_MIN_TOKENS}


def main() -> None:
    for dtype in ("bfloat16", "float32"):
        lm = load_model("smollm2", RuntimeConfig(device="cpu", dtype=dtype, threads=2))
        print(f"\n{dtype}, 2 threads, best of 5 alternating\n")
        print("| dataset | prompt tokens | masked ms | causal ms | ratio | causal tok/s | last hidden equal |")
        print("|---|---|---|---|---|---|---|")
        for name in ("gsm8k", "humaneval"):
            prompts = sorted((p.ids for p in bench_prompts(name, lm.tokenizer, 16, seed=0)), key=len, reverse=True)
            times, last = {f: [] for f in FORMS}, {}
            with torch.inference_mode():
                for _ in range(6):
                    for form, min_tokens in FORMS.items():
                        transformer.CAUSAL_MIN_TOKENS = min_tokens
                        cache = lm.model.new_cache(16, 640)
                        t0 = time.perf_counter()
                        last[form] = prefill(lm.model, cache, prompts)
                        times[form].append(time.perf_counter() - t0)
            a, b = (1000 * min(times[f][1:]) for f in FORMS)
            tokens = sum(map(len, prompts))
            print(f"| {name} | {tokens} | {a:.0f} | {b:.0f} | {b / a:.2f} | {tokens / b * 1000:.0f} | "
                  f"{torch.equal(last['masked'], last['causal'])} |", flush=True)


if __name__ == "__main__":
    main()
