"""Issue 41: does an AR step taken by the adaptive engine cost what the AR engine's step costs? An AR engine
and an adaptive one (FORCE=1: every plan replaced by AR, after the planner and lookup have done their work)
decode the same GSM8K chat prompts at batch N, stepping alternately (the same noise): median step time, median
host time (step less its forwards), tok/s.

    DRAFTER=... DT=float32 FORCE=1 python benchmarks/2026-12-03-online/arpair.py 8
"""
import os
import statistics as st
import sys
import time

import torch

from flexdraft.core.config import RuntimeConfig
from flexdraft.core.data import chat_ids
from flexdraft.engine.config import EngineConfig
from flexdraft.engine.runner import load_engine
from flexdraft.evaluation.loadtest import prompts_of
from flexdraft.speculative.drafts import Mode, Plan
from flexdraft.speculative.sampling import SamplingParams

if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("TH", 2)))
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    steps = int(os.environ.get("STEPS", 100))
    rt = RuntimeConfig(dtype=os.environ.get("DT", "auto"))
    texts = prompts_of("gsm8k")[:n]
    engines = {}
    for name, mode in (("ar", "ar"), ("adaptive", "adaptive")):
        lm, eng, note, _ = load_engine("smollm2", rt, os.environ["DRAFTER"] if mode != "ar" else None,
                                    EngineConfig(mode=mode, max_batch=16))
        if os.environ.get("FORCE") and mode == "adaptive":
            orig = eng.planner.adaptive
            eng.planner.adaptive = lambda *a, **k: (Plan(Mode.AR), orig(*a, **k)[1])
        ids = [chat_ids(lm.tokenizer, [{"role": "user", "content": t}]) for t in texts]
        for p in ids:
            eng.add_request(p, SamplingParams(max_new_tokens=steps + 20))
        eng.step()
        engines[name] = eng
        print(name, note, "max_len", eng.config.max_len, "cache", tuple(eng.cache.k[0].shape))
    t = {k: [] for k in engines}; h = {k: [] for k in engines}; modes = {k: {} for k in engines}; toks = {k: 0 for k in engines}
    for i in range(steps):
        for name, eng in (engines.items() if i % 2 else reversed(engines.items())):
            t0 = time.perf_counter(); out = eng.step(); dt = time.perf_counter() - t0
            t[name].append(dt); h[name].append(dt - sum(out.stats.forward_seconds.values()))
            modes[name][out.stats.mode] = modes[name].get(out.stats.mode, 0) + 1
            toks[name] += sum(len(d.tokens) for d in out.deltas)
    for name in engines:
        print(name, f"step median {st.median(t[name])*1e3:.2f} ms, host median {st.median(h[name])*1e3:.2f} ms, "
              f"tok/s {toks[name]/sum(t[name]):.1f}", modes[name])
    print("adaptive/ar step time ratio (median)", round(st.median(t['adaptive']) / st.median(t['ar']), 3))
