"""`attend` as shipped (SDPA over query heads grouped by their key/value head, from 2 rows on) against SDPA's own
enable_gqa at every shape, inside whole target forwards: for each shape (rows x tokens over a cache of S tokens),
both forms alternate, one forward each, in one process, and the median of each and their ratio are printed (this
machine's speed drifts between runs, not within a pair).

    python benchmarks/2026-12-06-attention/ab.py --dtype bfloat16 [--json out.json]

Runs the model on SDPA in every dtype (cpu_attention=sdpa): the form `attend` takes for a bool mask.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

import flexdraft.models.transformer as tr
from flexdraft.core.config import RuntimeConfig
from flexdraft.models.loading import load_model

SHAPES = [(1, 1, 120), (1, 9, 120), (16, 1, 120), (16, 1, 300), (16, 9, 120), (16, 9, 300), (4, 64, 0)]
GROUPED = (tr.attend, tr.grouped_mask)


def enable_gqa(q, keys, values, mask):
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)


def use(form: str) -> None:
    """Point the model's attention at one form (module globals the forward looks up on every call)."""
    if form == "grouped":
        tr.attend, tr.grouped_mask = GROUPED
    else:
        tr.attend, tr.grouped_mask = enable_gqa, lambda mask, group: mask


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json")
    args = ap.parse_args()
    runtime = RuntimeConfig(device="cpu", dtype=args.dtype, threads=2, cpu_attention="sdpa")
    m = load_model("smollm2", runtime, with_tokenizer=False).model
    rows = []
    for B, T, S in SHAPES:
        cache = m.new_cache(B, 1024)
        cache.lens[:] = S
        tokens = torch.randint(0, 1000, (B, T), generator=torch.Generator().manual_seed(0))
        pos = cache.lens[:, None] + torch.arange(T)
        times = {"enable_gqa": [], "grouped": []}
        out = {}
        with torch.inference_mode():
            for rep in range(args.reps + 2):
                for form in times:
                    use(form)
                    t0 = time.perf_counter()
                    out[form] = m.logits(m(tokens, pos, cache))
                    if rep >= 2:  # two warm-up pairs
                        times[form].append(time.perf_counter() - t0)
        use("grouped")
        a, b = (1000 * statistics.median(times[f]) for f in ("enable_gqa", "grouped"))
        diff = (out["grouped"].float() - out["enable_gqa"].float()).abs().max().item()
        rows.append({"rows": B, "tokens": T, "cached": S, "enable_gqa_ms": a, "grouped_ms": b, "ratio": b / a,
                     "max_logit_diff": diff})
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{args.dtype}, 2 threads, median of {args.reps} alternating pairs\n")
    print("| rows x tokens, cached | enable_gqa ms | grouped ms | grouped / enable_gqa | max logit difference |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rows']} x {r['tokens']}, {r['cached']} | {r['enable_gqa_ms']:.1f} | {r['grouped_ms']:.1f} | "
              f"{r['ratio']:.2f} | {r['max_logit_diff']:.1e} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
