"""Host time per decoding step (the step's wall time less its forwards: planning, proposing, acceptance,
bookkeeping) and what each mode decodes, at batch 1 and 16 on the real model, fp32 greedy. Run it on two
checkouts to compare them (same drafter, same prompts): the outputs' digest and tau per cell must match.

    PYTHONPATH=<checkout>/platform python benchmarks/step_host.py --drafter PATH [--json out.json]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time

import torch

from flexdraft.core.config import RuntimeConfig
from flexdraft.core.data import bench_prompts
from flexdraft.engine.config import EngineConfig
from flexdraft.engine.runner import load_engine
from flexdraft.speculative.sampling import SamplingParams

MODES = ("ar", "sequential", "tree", "parallel", "lookup", "adaptive")


def run_cell(engine, prompts: list[list[int]], new_tokens: int) -> dict:
    """All prompts through the engine at its max_batch; per decoding step its host time."""
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=new_tokens)) for p in prompts]
    host, t0 = [], time.perf_counter()
    while engine.has_work():
        out = engine.step()
        stats = getattr(out, "stats", None) or engine.last_stats  # (a checkout before StepOutput)
        if stats.rows and not stats.admitted:
            host.append(stats.seconds - sum(stats.forward_seconds.values()))
    seconds = time.perf_counter() - t0
    gens = [engine.result(i) for i in ids]
    forwards = sum(g.stats.forwards if hasattr(g, "stats") else g.extra["forwards"] for g in gens)
    tokens = [g.token_ids for g in gens]
    return {"steps": len(host), "host_ms_median": 1000 * statistics.median(host),
            "host_ms_mean": 1000 * statistics.fmean(host), "tok_s": sum(map(len, tokens)) / seconds,
            "tau": (sum(map(len, tokens)) - len(tokens)) / max(forwards, 1),
            "digest": hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:12]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json")
    args = ap.parse_args()
    runtime = RuntimeConfig(device="cpu", dtype=args.dtype, threads=2)
    rows = []
    for mode in args.modes.split(","):
        for batch in map(int, args.batches.split(",")):
            cfg = EngineConfig(mode=mode, max_batch=batch, max_len=640)
            lm, engine, *_ = load_engine("smollm2", runtime, args.drafter, cfg, store_spec="none")
            prompts = [p.ids for p in bench_prompts("gsm8k", lm.tokenizer, 16, seed=0)]
            run_cell(engine, prompts[:2], 4)  # warm-up
            row = {"mode": mode, "batch": batch, **run_cell(engine, prompts, args.new_tokens)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
