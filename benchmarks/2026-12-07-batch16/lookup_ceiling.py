"""How much prompt-lookup speculation could buy at batch 16 on this CPU, if a verify cost only the tokens it carries.

    python benchmarks/2026-12-07-batch16/lookup_ceiling.py [--dtype bfloat16]

Decodes the peers benchmark's 16 prompts per dataset greedily (64 new tokens, our AR at batch 16), then replays the
batch in lockstep with prompt-lookup drafts (`NgramIndex`, n-grams of up to 4, as the engine's lookup steps): each
step, every live row whose suffix n-gram (of at least `min_n` tokens) occurred before gets its next Bv tokens as
drafts, and accepts the longest prefix of them that matches what the model did decode (exact: greedy). A step is
priced by forwards measured here (16 rows x T tokens over 300 cached tokens each, fewer rows as rows finish):
  - padded: every row verifies Bv + 1 tokens when any row has a match (what the engine's lookup step does);
  - ragged: the step costs its rows' tokens, R = rows + drafts, priced as a uniform forward of R / rows tokens
    per row (interpolated): an upper bound on what a verify that packs rows of different lengths could buy.
Prints tokens/s of each against AR's, per dataset, Bv and min_n. Acceptance is the model's own: nothing assumed.
"""
from __future__ import annotations

import argparse
import time

import torch

from flexdraft.core.config import RuntimeConfig
from flexdraft.engine.config import EngineConfig
from flexdraft.engine.runner import load_engine
from flexdraft.evaluation.harness import load_harness_config, prompt_ids
from flexdraft.speculative.lookup import NgramIndex
from flexdraft.speculative.sampling import SamplingParams

TOKENS = (1, 2, 3, 5, 9)


def forward_costs(model, rows: int) -> dict[int, float]:
    """{T: seconds} of a forward of `rows` rows x T tokens (logits included), best of 7 after a warm-up."""
    cache = model.new_cache(rows, 1024)
    cache.lens[:] = 300
    out = {}
    with torch.inference_mode():
        for T in TOKENS:
            tokens, pos = torch.randint(0, 1000, (rows, T)), cache.next_positions(T)
            model.logits(model(tokens, pos, cache))
            best = float("inf")
            for _ in range(7):
                t0 = time.perf_counter()
                model.logits(model(tokens, pos, cache))
                best = min(best, time.perf_counter() - t0)
            out[T] = best
    return out


def price(costs: dict[int, dict[int, float]], rows: int, tokens: float) -> float:
    """A forward of `rows` rows and `tokens` tokens in all: the next measured row count's, at tokens / rows per row."""
    n = min(r for r in costs if r >= rows)
    t = min(max(tokens / rows, 1.0), TOKENS[-1])
    lo = max(T for T in TOKENS if T <= t)
    hi = min(T for T in TOKENS if T >= t)
    c = costs[n]
    return c[lo] if hi == lo else c[lo] + (c[hi] - c[lo]) * (t - lo) / (hi - lo)


def replay(prompts, outputs, costs, Bv: int, min_n: int) -> tuple[float, float, float]:
    """-> (tokens, seconds padded, seconds ragged) of lockstep lookup decoding of the batch."""
    index = [NgramIndex(p, 4) for p in prompts]
    done = [0] * len(prompts)
    tokens = padded = ragged = 0.0
    while live := [i for i in range(len(prompts)) if done[i] < len(outputs[i])]:
        drafts, advance = 0, {}
        for i in live:
            out, accepted = outputs[i], 0
            proposal, size = index[i].propose(Bv) if Bv else ([], 0)
            if proposal and size >= min_n:
                drafts += len(proposal)
                while (accepted < len(proposal) and done[i] + accepted < len(out)
                       and proposal[accepted] == out[done[i] + accepted]):
                    accepted += 1
            advance[i] = min(accepted + 1, len(out) - done[i])
        for i in live:
            index[i].extend(outputs[i][done[i]:done[i] + advance[i]])
            done[i] += advance[i]
        n = len(live)
        tokens += sum(advance.values())
        padded += price(costs, n, n * (Bv + 1) if drafts else n)
        ragged += price(costs, n, n + drafts)
    return tokens, padded, ragged


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    cfg = load_harness_config("platform/flexdraft/configs/bench/peers.yaml")
    lm, engine, _, _ = load_engine("smollm2", RuntimeConfig(device="cpu", dtype=args.dtype, threads=2), None,
                                   EngineConfig(mode="ar", max_batch=16, max_len=1024))
    costs = {n: forward_costs(lm.model, n) for n in (1, 2, 4, 8, 16)}
    print("16-row forwards, ms:", {T: round(1000 * s, 1) for T, s in costs[16].items()})
    for dataset, prompts in prompt_ids(lm, cfg, cfg.datasets).items():
        outputs = [g.token_ids for g in engine.generate(prompts, SamplingParams(max_new_tokens=cfg.max_new_tokens))]
        tokens, ar, _ = replay(prompts, outputs, costs, 0, 1)
        print(f"{dataset}: AR {tokens / ar:.0f} tok/s (priced)")
        for Bv in (1, 2, 4, 8):
            for min_n in (1, 2, 3):
                tokens, padded, ragged = replay(prompts, outputs, costs, Bv, min_n)
                print(f"  Bv {Bv} min_n {min_n}: padded {ar / padded:.2f}x AR, ragged {ar / ragged:.2f}x AR")


if __name__ == "__main__":
    main()
