"""The offline engine loop (AR, 1 thread) in this driver vs in a Ray actor of 1 CPU, as a Serve replica runs,
alternating rounds of 3 GSM8K prompts; the median step of each. Needs a running Ray head.
    FLEXDRAFT_HOME=... python inactor.py"""
import os
import statistics
import time

import ray

if __name__ == "__main__":
    def bench(texts):
        import torch

        from flexdraft.core.config import RuntimeConfig
        from flexdraft.core.data import chat_ids
        from flexdraft.engine.config import EngineConfig
        from flexdraft.engine.runner import load_engine
        from flexdraft.speculative.sampling import SamplingParams
        global _eng
        if "_eng" not in globals():
            _eng = load_engine("smollm2", RuntimeConfig(threads=1), None, EngineConfig(mode="ar", max_batch=1))
        lm, engine = _eng[0], _eng[1]
        params = SamplingParams(max_new_tokens=64); ts = []
        for t in texts:
            rid = engine.add_request(chat_ids(lm.tokenizer, [{"role": "user", "content": t}]), params); engine.step()
            while engine.has_work():
                t0 = time.perf_counter(); engine.step(); ts.append(time.perf_counter() - t0)
            engine.result(rid)
        return statistics.median(ts) * 1e3, torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS"), \
            [l for l in open("/proc/self/maps").read().split("\n") if "jemalloc" in l][:1]
    ray.init(address="auto", runtime_env={"env_vars": {"FLEXDRAFT_HOME": os.environ["FLEXDRAFT_HOME"]}})
    @ray.remote(num_cpus=1)
    class A:
        def run(self, texts): return bench(texts)
    from flexdraft.evaluation.loadtest import prompts_of
    texts = prompts_of("gsm8k")
    a = A.remote(); ray.get(a.run.remote(texts[:1])); bench(texts[:1])
    res = {"driver": [], "actor": []}
    for k in range(4):
        chunk = texts[1 + 3 * k: 4 + 3 * k]
        for side in (["driver", "actor"] if k % 2 == 0 else ["actor", "driver"]):
            r = bench(chunk) if side == "driver" else ray.get(a.run.remote(chunk))
            res[side].append(r[0])
            print(side, f"{r[0]:.2f} ms/step", r[1:])
    for s, v in res.items(): print(s, f"median of medians {statistics.median(v):.2f} ms")
