import time, sys, torch
from flexdraft.core.config import RuntimeConfig
from flexdraft.engine.config import EngineConfig
from flexdraft.engine.runner import load_engine
from flexdraft.speculative.sampling import SamplingParams
from flexdraft.core.data import chat_ids
mode = sys.argv[1]
lm, engine, _ = load_engine("smollm2", RuntimeConfig(device="cpu", dtype="float32", threads=2), "init",
                            EngineConfig(mode=mode, max_batch=1), store_spec="none")
text = " ".join(["The quick brown fox jumps over the lazy dog and then runs into the forest."] * 40)
prompt = chat_ids(lm.tokenizer, [{"role": "user", "content": text + " Summarize."}])
over = []
for rep in range(3):
    engine.add_request(prompt, SamplingParams(max_new_tokens=48))
    while engine.has_work():
        engine.step(); s = engine.last_stats
        if not s.admitted: over.append(s.seconds - sum(s.forward_seconds.values()))
over.sort()
print(mode, f"overhead median {over[len(over)//2]*1000:.2f} ms/step, min {over[0]*1000:.2f}")
