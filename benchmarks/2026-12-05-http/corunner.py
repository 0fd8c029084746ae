"""How much a busy sibling core slows the engine: a 1-thread AR engine on core 0 decodes GSM8K prompts while
`duty.py` keeps core 1 busy 0%, 20% or 50% of the time (alternating orders); the median step per load.
    FLEXDRAFT_HOME=... python corunner.py"""
import os
import statistics
import subprocess
import sys
import time

from flexdraft.core.config import RuntimeConfig
from flexdraft.core.data import chat_ids
from flexdraft.engine.config import EngineConfig
from flexdraft.engine.runner import load_engine
from flexdraft.evaluation.loadtest import prompts_of
from flexdraft.speculative.sampling import SamplingParams

if __name__ == "__main__":
    os.sched_setaffinity(0, {0})
    lm, engine, note, _ = load_engine("smollm2", RuntimeConfig(threads=1), None, EngineConfig(mode="ar", max_batch=1))
    texts = prompts_of("gsm8k"); params = SamplingParams(max_new_tokens=64)
    def run(t):
        rid = engine.add_request(chat_ids(lm.tokenizer, [{"role": "user", "content": t}]), params); ts = []
        engine.step()
        while engine.has_work():
            t0 = time.perf_counter(); engine.step(); ts.append(time.perf_counter() - t0)
        engine.result(rid); return ts
    run(texts[0])
    res = {}
    for k in range(6):
        for duty in ([0, 0.2, 0.5] if k % 2 == 0 else [0.5, 0.2, 0]):
            p = subprocess.Popen(["taskset", "-c", "1", sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "duty.py"), str(duty)]) if duty else None
            time.sleep(0.2)
            res.setdefault(duty, []).extend(run(texts[k]))
            if p: p.kill()
    for d, ts in res.items(): print(f"other core busy {d:.0%}: step median {statistics.median(ts)*1e3:.2f} ms mean {statistics.mean(ts)*1e3:.2f}")
