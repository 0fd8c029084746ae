"""The engine on a GPU: every decoding mode, on tiny random Llama and Qwen3 models (no model hub on the GPU
machine), fp32 and bf16, greedy outputs against AR greedy on the same device, plus one sampled run, the adaptive
planner's cost profile (timed with CUDA syncs) and a fp32 CPU-vs-CUDA AR comparison.
    PYTHONPATH=platform python benchmarks/2026-12-04-cuda/cuda_smoke.py [--device cuda]"""
import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from flexdraft.core.config import RuntimeConfig
from flexdraft.drafter.model import Drafter, DrafterConfig
from flexdraft.engine.ar import generate
from flexdraft.engine.config import EngineConfig
from flexdraft.engine.engine import Engine
from flexdraft.models.config import tiny_hf_config
from flexdraft.models.loading import load_model
from flexdraft.speculative.sampling import SamplingParams

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    print(f"torch {torch.__version__}, cuda {torch.cuda.is_available()}"
          + (f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""), flush=True)


    def tiny(arch: str, folder: Path) -> Path:
        """As tests/conftest.make_tiny_hf: a random tiny model, weights widened so greedy choices are not coin flips."""
        cfg = AutoConfig.for_model(**tiny_hf_config(arch))
        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        with torch.no_grad():
            for w in hf.parameters():
                if w.dim() == 2:
                    w.mul_(3.0)
        hf.save_pretrained(folder)
        return folder


    def prompts(n: int, seed: int = 0, vocab: int = 96) -> list[list[int]]:
        g = torch.Generator().manual_seed(seed)
        return [torch.randint(3, vocab, (int(torch.randint(2, 24, (1,), generator=g)),), generator=g).tolist()
                for _ in range(n)]


    failures = 0
    params = SamplingParams(max_new_tokens=24)
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ("llama", "qwen3"):
            folder = tiny(arch, Path(tmp) / arch)
            ps = prompts(6)
            cpu = load_model(folder, RuntimeConfig(device="cpu", dtype="float32", threads=1), with_tokenizer=False).model
            cpu_ref = [g.token_ids for g in generate(cpu, ps, params)]
            for dtype in ("float32", "bfloat16"):
                model = load_model(folder, RuntimeConfig(device=args.device, dtype=dtype, threads=1),
                                   with_tokenizer=False).model
                ref = [g.token_ids for g in generate(model, ps, params)]
                if dtype == "float32":
                    same = sum(a == b for a, b in zip(ref, cpu_ref))
                    print(f"{arch} fp32 AR on {args.device} vs CPU: {same}/{len(ps)} rows equal", flush=True)
                drafter = Drafter.from_target(model, DrafterConfig(k=2, block_size=4)).to_runtime(model)
                for mode in ("ar", "sequential", "tree", "parallel", "lookup", "adaptive"):
                    engine = Engine(model, drafter, EngineConfig(mode=mode, max_batch=4, max_len=96))
                    if mode == "adaptive":
                        engine.profile(context=32, rounds=2)
                    t0 = time.perf_counter()
                    out = engine.generate(ps, params)
                    dt = time.perf_counter() - t0
                    same = sum(g.token_ids == r for g, r in zip(out, ref))
                    modes = {k: v for k, v in engine.totals.steps_by_mode.items() if v}
                    ok = same == len(ps) or dtype == "bfloat16"
                    failures += not ok
                    print(f"{arch} {dtype} {mode:10s} rows equal to AR {same}/{len(ps)}, "
                          f"steps {({getattr(k, 'value', k): v for k, v in modes.items()})}, {dt:.2f} s"
                          + ("" if ok else "  <-- FAIL"), flush=True)
                sampled = Engine(model, drafter, EngineConfig(mode="sequential", max_batch=4, max_len=96)).generate(
                    ps, SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.95, seed=1))
                print(f"{arch} {dtype} sampled sequential: {sum(len(g.token_ids) for g in sampled)} tokens", flush=True)
    print("FAILURES", failures)
    sys.exit(1 if failures else 0)
