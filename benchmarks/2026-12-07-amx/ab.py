"""The decode step's last two levers, each against what it replaces, on the real model in bf16, paired in one
process (both forms are the same loaded model):

- `--lever amx`: the linear layers' few-row GEMMs on AMX tiles (`Linear.tiles`, C++ `amx_linear`) against oneDNN's
  prepacked GEMM (a single row: the one-row GEMV); `kernels.AMX_MAX_ROWS` = 0 sends every GEMM the old way. The
  layers run in Python in both forms.
- `--lever stack`: the layers as one C++ call (`decoder_stack`) against the Python layers on the same kernels
  (bf16, or `--dtype float32`, where its GEMMs are oneDNN's and F.linear's).

1. whole target forwards per shape (rows x tokens over S cached tokens), alternating, median of each;
2. whole generations (16 GSM8K prompts, greedy, 64 new tokens) in AR and adaptive at batch 1 and 16, alternating:
   tokens/s, outputs that agree between the forms, and, per form, how many of adaptive's outputs equal AR's (a
   row whose GEMMs round alike whatever their row count follows AR's path further).

    python benchmarks/2026-12-07-amx/ab.py --lever amx --drafter ~/.flexdraft/pipelines/smollm2-demo/drafter
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

SHAPES = [(1, 1, 256), (1, 9, 120), (4, 1, 256), (4, 5, 256), (16, 1, 256), (16, 1, 500), (16, 2, 256), (16, 4, 256)]
ROWS = kernels.AMX_MAX_ROWS
# per lever: (name of the form without it, name with it), and how each form is set on a model
LEVERS = {"amx": ("onednn", "amx"), "stack": ("python", "stack")}
FORMS: tuple[str, str] = LEVERS["amx"]


def use(form: str, model) -> None:
    kernels.AMX_MAX_ROWS = 0 if form == "onednn" else ROWS
    model.stack_params = model.decoder_stack_params() if form == "stack" else None


def timed_pairs(run, model, reps: int, warmup: int = 2) -> dict[str, list]:
    """run() under each form in turn, reps + warmup times; -> form: [(seconds, run's result)] after the warm-up."""
    out = {form: [] for form in FORMS}
    for rep in range(reps + warmup):
        for form in FORMS:
            use(form, model)
            t0 = time.perf_counter()
            result = run()
            if rep >= warmup:
                out[form].append((time.perf_counter() - t0, result))
    return out


def forwards(runtime: RuntimeConfig, reps: int) -> list[dict]:
    m = load_model("smollm2", runtime, with_tokenizer=False).model
    rows = []
    for B, T, S in SHAPES:
        cache = m.new_cache(B, 1024)
        cache.lens[:] = S
        tokens = torch.randint(0, 1000, (B, T), generator=torch.Generator().manual_seed(0))
        pos = cache.lens[:, None] + torch.arange(T)
        with torch.inference_mode():
            runs = timed_pairs(lambda: m.logits(m(tokens, pos, cache)), m, reps)
        a, b = (1000 * statistics.median(t for t, _ in runs[f]) for f in FORMS)
        rows.append({"rows": B, "tokens": T, "cached": S, f"{FORMS[0]}_ms": a, f"{FORMS[1]}_ms": b, "ratio": b / a})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def generations(runtime: RuntimeConfig, drafter: str, pairs: int) -> list[dict]:
    rows, outputs = [], {}
    for mode in ("ar", "adaptive"):
        for batch in (1, 16):
            lm, engine, *_ = load_engine("smollm2", runtime, drafter, EngineConfig(mode=mode, max_batch=batch,
                                                                                   max_len=640), store_spec="none")
            prompts = [p.ids for p in bench_prompts("gsm8k", lm.tokenizer, 16, seed=0)]
            runs = timed_pairs(lambda: [g.token_ids for g in engine.generate(prompts, SamplingParams(
                max_new_tokens=64))], lm.model, pairs, warmup=0)
            tok_s = {f: statistics.median(sum(map(len, out)) / t for t, out in runs[f]) for f in FORMS}
            for f in FORMS:
                outputs[mode, batch, f] = runs[f][-1][1]
            same = sum(x == y for x, y in zip(*(outputs[mode, batch, f] for f in FORMS)))
            rows.append({"mode": mode, "batch": batch, **{f"{f}_tok_s": tok_s[f] for f in FORMS},
                         "speedup": tok_s[FORMS[1]] / tok_s[FORMS[0]], "same_outputs": same})
            if mode == "adaptive":
                for f in FORMS:
                    rows[-1][f"{f}_equal_ar"] = sum(x == y for x, y in zip(outputs[mode, batch, f],
                                                                          outputs["ar", batch, f]))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    global FORMS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lever", choices=LEVERS, required=True)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--dtype", default="bfloat16", help="bfloat16, or float32 for --lever stack")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    assert args.dtype == "bfloat16" or args.lever == "stack", "AMX tiles are bf16 only"
    assert kernels.load() and (args.dtype == "float32" or kernels.amx_available()), "no AMX tiles or kernels here"
    FORMS = LEVERS[args.lever]
    runtime = RuntimeConfig(device="cpu", dtype=args.dtype, threads=2)
    fw = forwards(runtime, args.reps)
    gen = generations(runtime, args.drafter, args.pairs)
    print(f"\n{args.dtype}, 2 threads; forwards: median of {args.reps} alternating pairs\n")
    print(f"| rows x tokens, cached | {FORMS[0]} ms | {FORMS[1]} ms | ratio |")
    print("|---|---|---|---|")
    for r in fw:
        print(f"| {r['rows']} x {r['tokens']}, {r['cached']} | {r[FORMS[0] + '_ms']:.1f} | {r[FORMS[1] + '_ms']:.1f} |"
              f" {r['ratio']:.2f} |")
    print(f"\ngenerations: 16 GSM8K prompts, 64 new tokens, median of {args.pairs} alternating pairs\n")
    print(f"| mode, batch | {FORMS[0]} tok/s | {FORMS[1]} tok/s | speed-up | same outputs | equal to AR's |")
    print("|---|---|---|---|---|---|")
    for r in gen:
        a, b = FORMS
        ar = f"{r[a + '_equal_ar']} / {r[b + '_equal_ar']}" if b + "_equal_ar" in r else "-"
        print(f"| {r['mode']}, {r['batch']} | {r[a + '_tok_s']:.1f} | {r[b + '_tok_s']:.1f} | {r['speedup']:.2f}x |"
              f" {r['same_outputs']}/16 | {ar} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dtype": args.dtype, "lever": args.lever, "forwards": fw, "generations": gen}, f, indent=1)


if __name__ == "__main__":
    main()
