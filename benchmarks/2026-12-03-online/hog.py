"""Issue 41: the online-learning planner against the start-up-profile planner and AR while the machine's load
changes. Four engines over one loaded model (`ar`, `ar-control` = AR again: the noise floor, `adaptive-static` =
online False, `adaptive`) each keep
`--batch` rows busy with GSM8K chat prompts (the same order), stepping in turn (one step each, round-robin:
the same noise for all); a CPU hog (a busy loop pinned to one core) runs through the middle third of the steps.
Prints tokens/s per engine and phase, the speed-ups over AR, and each engine's step modes per phase.

    python benchmarks/2026-12-03-online/hog.py --drafter DRAFTER --batch 4 --steps 120
"""
import argparse
import subprocess
import sys
import time

import torch

from flexdraft.core.config import RuntimeConfig
from flexdraft.core.data import chat_ids
from flexdraft.engine.config import EngineConfig
from flexdraft.engine.runner import build_engine, resolve_drafter
from flexdraft.evaluation.loadtest import prompts_of
from flexdraft.models.loading import load_model
from flexdraft.speculative.sampling import SamplingParams

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=120, help="steps per engine in each of the three phases")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    lm = load_model("smollm2", RuntimeConfig(dtype=args.dtype, threads=args.threads))
    choice = resolve_drafter(args.drafter, lm.model, required=True)
    prompts = [chat_ids(lm.tokenizer, [{"role": "user", "content": t}]) for t in prompts_of("gsm8k")]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    engines = {
        "ar": build_engine(lm, choice, EngineConfig(mode="ar", max_batch=args.batch), None),
        "ar-control": build_engine(lm, choice, EngineConfig(mode="ar", max_batch=args.batch), None),
        "adaptive-static": build_engine(lm, choice, EngineConfig(mode="adaptive", online=False, max_batch=args.batch,
                                                                 lookup=4), None),
        "adaptive": build_engine(lm, choice, EngineConfig(mode="adaptive", max_batch=args.batch, lookup=4), None),
    }
    nxt = {name: 0 for name in engines}
    phases = ("before", "hog", "after")
    tokens = {(n, p): 0 for n in engines for p in phases}
    seconds = {(n, p): 0.0 for n in engines for p in phases}
    modes = {(n, p): {} for n in engines for p in phases}
    hog = None
    try:
        for i in range(3 * args.steps):
            phase = phases[i // args.steps]
            if phase == "hog" and hog is None:
                hog = subprocess.Popen(["taskset", "-c", "1", sys.executable, "-c", "while True: pass"])
            if phase == "after" and hog is not None and hog.poll() is None:
                hog.kill()
                hog.wait()
            for name, eng in engines.items():
                while len(eng.slots) + len(eng.waiting) < args.batch:
                    eng.add_request(prompts[nxt[name] % len(prompts)], params)
                    nxt[name] += 1
                t0 = time.perf_counter()
                out = eng.step()
                seconds[name, phase] += time.perf_counter() - t0
                tokens[name, phase] += sum(len(d.tokens) for d in out.deltas)
                m = modes[name, phase]
                m[out.stats.mode] = m.get(out.stats.mode, 0) + 1
                for rid in out.finished:
                    eng.result(rid)
    finally:
        if hog is not None and hog.poll() is None:
            hog.kill()

    print(f"batch {args.batch}, {args.steps} steps per engine per phase, {lm.model.dtype}, {torch.get_num_threads()} threads")
    print("| engine | " + " | ".join(f"{p} tok/s | {p} x AR" for p in phases) + " |")
    print("|---|" + "---|---|" * len(phases))
    for name in engines:
        cells = []
        for p in phases:
            rate, ar = tokens[name, p] / seconds[name, p], tokens["ar", p] / seconds["ar", p]
            cells += [f"{rate:.1f}", f"{rate / ar:.2f}x"]
        print(f"| {name} | " + " | ".join(cells) + " |")
    for name in engines:
        print(name, {p: {k: round(v / sum(modes[name, p].values()), 2) for k, v in sorted(modes[name, p].items())}
                     for p in phases})
