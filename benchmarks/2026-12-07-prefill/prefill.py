"""The prefill as the engine ran it before (one forward per group of similar prompt lengths, padded to the group's
longest) against the packed prefill (`engine.ar.prefill`: every prompt side by side in one forward, each attending
over its own tokens), alternating in one process, best of 3 after a warm-up, on each dataset's 16 bench prompts
(MT-Bench's with the model's own earlier answers, as `flexdraft bench` builds them); with how far the two forms'
last hidden states and next tokens agree.

    python benchmarks/2026-12-07-prefill/prefill.py --dtype bfloat16
"""
from __future__ import annotations

import argparse
import time

import torch

from flexdraft.core.config import RuntimeConfig
from flexdraft.core.data import bench_prompts
from flexdraft.engine.ar import generate, prefill
from flexdraft.models.loading import load_model
from flexdraft.speculative.sampling import SamplingParams


def length_groups(lens: list[int], max_padding: float = 0.1) -> list[tuple[int, int]]:
    """(The grouping the engine used before) runs of sorted lengths padded at most 10% over their tokens."""
    groups, start, total = [], 0, 0
    for i, n in enumerate(lens):
        if i > start and lens[start] * (i - start + 1) > (1 + max_padding) * (total + n):
            groups.append((start, i))
            start, total = i, 0
        total += n
    groups.append((start, len(lens)))
    return groups


def grouped_prefill(model, cache, prompts: list[list[int]]) -> torch.Tensor:
    """The prefill before: one forward per length group of the prompts (sorted longest first)."""
    lens = [len(p) for p in prompts]
    h_last = torch.empty(len(prompts), model.args.dim, dtype=model.dtype)
    for start, end in length_groups(lens):
        T = lens[start]
        tokens = torch.zeros(end - start, T, dtype=torch.long)
        for r in range(start, end):
            tokens[r - start, : lens[r]] = torch.tensor(prompts[r])
        h = model(tokens, torch.arange(T).expand(end - start, T), cache.rows(start, end), span=T)
        h_last[start:end] = h[torch.arange(end - start), torch.tensor(lens[start:end]) - 1]
    cache.lens[: len(prompts)] = torch.tensor(lens)
    return h_last


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    lm = load_model("smollm2", RuntimeConfig(device="cpu", dtype=args.dtype, threads=2))
    answer = lambda ps: [g.token_ids for g in generate(  # noqa: E731
        lm.model, ps, SamplingParams(max_new_tokens=128), lm.eos_token_ids)]
    forms = {"grouped": grouped_prefill, "packed": prefill}
    print(f"\n{args.dtype}, 2 threads, best of 3 alternating\n")
    print("| dataset | prompt tokens | grouped ms | packed ms | packed / grouped | packed tok/s | max hidden diff "
          "| next tokens equal |")
    print("|---|---|---|---|---|---|---|---|")
    for name in ("gsm8k", "humaneval", "mt-bench"):
        prompts = sorted((p.ids for p in bench_prompts(name, lm.tokenizer, 16, 0, answer)), key=len, reverse=True)
        times, last = {f: [] for f in forms}, {}
        with torch.inference_mode():
            cache = lm.model.new_cache(16, 1024)
            for _ in range(4):
                for form, fn in forms.items():
                    t0 = time.perf_counter()
                    last[form] = fn(lm.model, cache, prompts)
                    times[form].append(time.perf_counter() - t0)
            agree = int((lm.model.logits(last["grouped"]).argmax(-1) == lm.model.logits(last["packed"]).argmax(-1)).sum())
        a, b = (1000 * min(times[f][1:]) for f in forms)
        tokens = sum(map(len, prompts))
        diff = (last["grouped"].float() - last["packed"].float()).abs().max().item()
        print(f"| {name} | {tokens} | {a:.0f} | {b:.0f} | {b / a:.2f}x | {tokens / b * 1000:.0f} | {diff:.2g} | "
              f"{agree} of 16 |", flush=True)


if __name__ == "__main__":
    main()
