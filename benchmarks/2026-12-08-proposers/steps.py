"""Median time of an engine step (not the prefill) on SmolLM2 in fp32, 2 threads: modes lookup, sequential (the
demo drafter) and AR at batch 1 and 16, 48 new tokens, three repeats of the same GSM8K prompts. Run it once per
code version, alternating (`PYTHONPATH=<checkout>/platform python steps.py`), to compare the engine's per-step
overhead before and after a change: docs/results/2026-12-08-proposers."""
import json
import statistics
import time
from pathlib import Path

import torch

from flexdraft.core.config import RuntimeConfig
from flexdraft.core.data import chat_ids, gsm8k_questions
from flexdraft.engine.config import EngineConfig
from flexdraft.engine.runner import build_engine, resolve_drafter
from flexdraft.models.loading import load_model
from flexdraft.speculative.sampling import SamplingParams

DRAFTER = Path("~/.flexdraft/pipelines/smollm2-demo/drafter").expanduser()


def main():
    torch.set_num_threads(2)
    lm = load_model("smollm2", RuntimeConfig(device="cpu", dtype="float32", threads=2))
    choice = resolve_drafter(str(DRAFTER), lm.model, required=True)
    prompts = [chat_ids(lm.tokenizer, [{"role": "user", "content": q}]) for q in gsm8k_questions(16)]
    out = {}
    for mode in ("lookup", "sequential", "ar"):
        for batch in (1, 16):
            engine = build_engine(lm, choice, EngineConfig(mode=mode, max_batch=batch, max_len=1024), None)
            times, tokens = [], 0
            for _ in range(3):
                ids = [engine.add_request(p, SamplingParams(max_new_tokens=48)) for p in prompts[:max(batch, 4)]]
                while engine.has_work():
                    t0 = time.perf_counter()
                    stats = engine.step().stats
                    if stats.mode not in ("prefill", "idle"):
                        times.append(time.perf_counter() - t0)
                tokens += sum(len(engine.result(i).token_ids) for i in ids)
            out[f"{mode}/b{batch}"] = {"ms_per_step": round(1000 * statistics.median(times), 2), "steps": len(times),
                                       "tokens": tokens}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
