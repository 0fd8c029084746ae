"""Issue 41: what a replica spends on the cost profile at start. Builds the adaptive engine a Serve replica
builds (the demo's Serve config: 1 thread, batch 16) twice in one process, under an empty FLEXDRAFT_HOME
profiles folder: the first measures the profile and caches it, the second loads the cache.

    FLEXDRAFT_HOME=$(mktemp -d) python benchmarks/2026-12-03-online/startup.py --drafter DRAFTER
"""
import argparse
import time

from flexdraft.core.config import RuntimeConfig
from flexdraft.engine.config import EngineConfig
from flexdraft.engine.runner import build_engine, profile_file, resolve_drafter
from flexdraft.models.loading import load_model

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    lm = load_model("smollm2", RuntimeConfig(threads=args.threads))
    choice = resolve_drafter(args.drafter, lm.model, required=True)
    for attempt in ("no cached profile", "cached profile"):
        t0 = time.perf_counter()
        engine = build_engine(lm, choice, EngineConfig(mode="adaptive", max_batch=args.batch), None)
        print(f"{attempt}: engine ready in {time.perf_counter() - t0:.1f} s "
              f"({profile_file(engine.target, engine.drafter, engine.config)})")
