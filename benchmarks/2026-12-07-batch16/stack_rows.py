"""Forwards past 64 rows through the C++ layer stack against the Python layers (what they ran on before it took them).

    python benchmarks/2026-12-07-batch16/stack_rows.py [--dtype bfloat16]

B rows x T tokens over 300 cached tokens per row, logits included, the two ways alternating for 3 rounds, each
shape's best of 7 per round and the best round kept: `decoder_stack` (the model's `stack_params`) against the same
kernels called from the Python layers (`stack_params` None). Both compute the same bits (the stack-vs-Python test).
"""
from __future__ import annotations

import argparse
import time

import torch

from flexdraft.core.config import RuntimeConfig
from flexdraft.models.loading import load_model

SHAPES = [(16, 1), (16, 3), (16, 4), (16, 5), (16, 9), (16, 17), (8, 9), (8, 17), (4, 17), (4, 27)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    model = load_model("smollm2", RuntimeConfig(device="cpu", dtype=args.dtype, threads=2), with_tokenizer=False).model
    params, best = model.stack_params, {}
    with torch.inference_mode():
        for _ in range(3):
            for B, T in SHAPES:
                cache = model.new_cache(B, 1024)
                cache.lens[:] = 300
                tokens, pos = torch.randint(0, 1000, (B, T)), cache.next_positions(T)
                for way, stack in (("python", None), ("stack", params)):
                    model.stack_params = stack
                    model.logits(model(tokens, pos, cache))
                    times = []
                    for _ in range(7):
                        t0 = time.perf_counter()
                        model.logits(model(tokens, pos, cache))
                        times.append(time.perf_counter() - t0)
                    best[B, T, way] = min(best.get((B, T, way), float("inf")), min(times))
    print("| rows x tokens | Python layers ms | C++ stack ms | stack / Python |\n|---|---|---|---|")
    for B, T in SHAPES:
        py, st = best[B, T, "python"], best[B, T, "stack"]
        print(f"| {B} x {T} ({B * T}) | {1000 * py:.1f} | {1000 * st:.1f} | {st / py:.2f}x |")


if __name__ == "__main__":
    main()
