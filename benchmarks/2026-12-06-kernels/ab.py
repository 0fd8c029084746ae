"""The C++ CPU kernels (`flexdraft.models.kernels`: decode attention and the fused elementwise ops) against the
PyTorch ops the model runs without them (SDPA, or the explicit-matmul path where the model takes it), on the real
model, paired in one process:

1. whole target forwards per shape (rows x tokens over S cached tokens), the two forms alternating, median of each;
2. whole generations of the engine (16 GSM8K prompts, greedy, 64 new tokens) in AR and adaptive at batch 1 and 16,
   alternating: tokens/s of each and how many of the 16 outputs are the same token for token; in bf16, also how
   many of each form's outputs equal fp32 AR's (the reference the two roundings approximate).

    python benchmarks/2026-12-06-kernels/ab.py --dtype bfloat16 --drafter ~/.flexdraft/pipelines/smollm2-demo/drafter
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import flexdraft.models.kernels as kernels
from flexdraft.core.config import RuntimeConfig
from flexdraft.core.data import bench_prompts
from flexdraft.engine.config import EngineConfig
from flexdraft.engine.runner import load_engine
from flexdraft.models.loading import load_model
from flexdraft.speculative.sampling import SamplingParams

SHAPES = [(1, 1, 256), (4, 1, 256), (16, 1, 120), (16, 1, 256), (16, 1, 500), (1, 9, 120), (16, 5, 256)]
LOAD = kernels.load


def use(form: str) -> None:
    """Every kernel on, or every one off (the predicates that pick them read `kernels.load` on each call)."""
    kernels.load = LOAD if form == "kernel" else (lambda: False)


def forwards(runtime: RuntimeConfig, reps: int) -> list[dict]:
    m = load_model("smollm2", runtime, with_tokenizer=False).model
    rows = []
    for B, T, S in SHAPES:
        cache = m.new_cache(B, 1024)
        cache.lens[:] = S
        tokens = torch.randint(0, 1000, (B, T), generator=torch.Generator().manual_seed(0))
        pos = cache.lens[:, None] + torch.arange(T)
        times = {"pytorch": [], "kernel": []}
        with torch.inference_mode():
            for rep in range(reps + 2):
                for form in times:
                    use(form)
                    t0 = time.perf_counter()
                    m.logits(m(tokens, pos, cache))
                    if rep >= 2:  # two warm-up pairs
                        times[form].append(time.perf_counter() - t0)
        a, b = (1000 * statistics.median(times[f]) for f in ("pytorch", "kernel"))
        rows.append({"rows": B, "tokens": T, "cached": S, "pytorch_ms": a, "kernel_ms": b, "ratio": b / a})
        print(json.dumps(rows[-1]), flush=True)
    use("kernel")
    return rows


def generations(runtime: RuntimeConfig, drafter: str, pairs: int) -> list[dict]:
    rows, reference = [], {}
    if runtime.dtype != "float32":
        lm, engine, *_ = load_engine("smollm2", RuntimeConfig(device="cpu", dtype="float32", threads=2), None,
                                     EngineConfig(mode="ar", max_batch=16, max_len=640), store_spec="none")
        prompts = [p.ids for p in bench_prompts("gsm8k", lm.tokenizer, 16, seed=0)]
        reference = [g.token_ids for g in engine.generate(prompts, SamplingParams(max_new_tokens=64))]
    for mode in ("ar", "adaptive"):
        for batch in (1, 16):
            lm, engine, *_ = load_engine("smollm2", runtime, drafter, EngineConfig(mode=mode, max_batch=batch,
                                                                                   max_len=640), store_spec="none")
            prompts = [p.ids for p in bench_prompts("gsm8k", lm.tokenizer, 16, seed=0)]
            params = SamplingParams(max_new_tokens=64)
            tok_s, outs = {"pytorch": [], "kernel": []}, {}
            for _ in range(pairs):
                for form in tok_s:
                    use(form)
                    t0 = time.perf_counter()
                    gens = engine.generate(prompts, params)
                    tok_s[form].append(sum(len(g.token_ids) for g in gens) / (time.perf_counter() - t0))
                    outs[form] = [g.token_ids for g in gens]
            use("kernel")
            a, b = (statistics.median(tok_s[f]) for f in ("pytorch", "kernel"))
            same = sum(x == y for x, y in zip(outs["pytorch"], outs["kernel"]))
            rows.append({"mode": mode, "batch": batch, "pytorch_tok_s": a, "kernel_tok_s": b, "speedup": b / a,
                         "same_outputs": same})
            if reference:
                for form in outs:
                    rows[-1][f"{form}_equal_fp32"] = sum(x == y for x, y in zip(outs[form], reference))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    assert kernels.load(), "the C++ kernels did not build here"
    runtime = RuntimeConfig(device="cpu", dtype=args.dtype, threads=2)
    fw = forwards(runtime, args.reps)
    gen = generations(runtime, args.drafter, args.pairs)
    print(f"\n{args.dtype}, 2 threads; forwards: median of {args.reps} alternating pairs\n")
    print("| rows x tokens, cached | PyTorch ops ms | C++ kernels ms | ratio |")
    print("|---|---|---|---|")
    for r in fw:
        print(f"| {r['rows']} x {r['tokens']}, {r['cached']} | {r['pytorch_ms']:.1f} | {r['kernel_ms']:.1f} | "
              f"{r['ratio']:.2f} |")
    print(f"\ngenerations: 16 GSM8K prompts, 64 new tokens, median of {args.pairs} alternating pairs\n")
    print("| mode, batch | PyTorch ops tok/s | C++ kernels tok/s | speed-up | same outputs | equal to fp32 AR's |")
    print("|---|---|---|---|---|---|")
    for r in gen:
        fp32 = f"{r['pytorch_equal_fp32']} / {r['kernel_equal_fp32']}" if "kernel_equal_fp32" in r else "-"
        print(f"| {r['mode']}, {r['batch']} | {r['pytorch_tok_s']:.1f} | {r['kernel_tok_s']:.1f} | "
              f"{r['speedup']:.2f}x | {r['same_outputs']}/16 | {fp32} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dtype": args.dtype, "forwards": fw, "generations": gen}, f, indent=1)


if __name__ == "__main__":
    main()
