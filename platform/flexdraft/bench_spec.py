"""Benchmark: speculative decoding modes against our own AR, side by side, on real GSM8K questions.

Per batch size: AR, sequential, parallel (all branches), parallel with pruning and adaptive decode the same
prompts (greedy, EOS respected: every mode emits exactly AR's tokens, checked) in lockstep, one step of each
engine in turn, so machine noise hits all alike. Reports tau (tokens per target forward), tokens/s, the speed-up over AR, where
each mode's time goes (target / drafter / parallel forwards, the rest: LM head, sampling, bookkeeping), and
a torch profile of one parallel step. Timing excludes model loading and the adaptive policy's one-time cost
profile; it includes prefill.
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from flexdraft.config import RuntimeConfig
from flexdraft.data import chat_ids, gsm8k_questions
from flexdraft.engine import Engine, EngineConfig
from flexdraft.bench import markdown
from flexdraft.errors import FlexDraftError
from flexdraft.generate import SamplingParams
from flexdraft.models.loading import load_model
from flexdraft.runner import resolve_drafter, seed_costs


@dataclass
class SpecBenchConfig:
    model: str = "smollm2"
    drafter: str = ""  # "" = the default pipeline's drafter; a folder; or "init"
    device: str = "auto"
    dtype: str = "bfloat16"
    threads: int = 0
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 16])
    max_new_tokens: int = 48
    repeats: int = 1
    top_m: int = 2  # the pruned parallel mode keeps this many branches
    switch_batch: int = 4

    def __post_init__(self):
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise FlexDraftError(f"batch sizes must be >= 1, got {self.batch_sizes}")
        if self.repeats < 1 or self.max_new_tokens < 1 or self.top_m < 1:
            raise FlexDraftError("repeats, max_new_tokens and top_m must be >= 1")


MODES = {  # name -> engine config overrides
    "ar": {"mode": "ar"},
    "sequential": {"mode": "sequential"},
    "parallel": {"mode": "parallel"},
    "parallel-pruned": {"mode": "parallel"},  # top_m from the bench config
    "adaptive": {"mode": "adaptive"},
}


def _engines(lm, drafter, prior, cfg: SpecBenchConfig, batch: int) -> dict[str, Engine]:
    max_len = 1024
    engines = {}
    for name, overrides in MODES.items():
        ec = EngineConfig(max_batch=batch, max_len=max_len, switch_batch=cfg.switch_batch,
                          top_m=cfg.top_m if name == "parallel-pruned" else 0, **overrides)
        engines[name] = Engine(lm.model, drafter if name != "ar" else None, ec, lm.eos_token_ids, prior)
        seed_costs(engines[name])
    return engines


def _lockstep(engines: dict[str, Engine], prompts, params) -> dict[str, dict]:
    """Decode the same prompts with every engine, one step of each in turn, timing each engine's steps only:
    noise on this shared machine comes in bursts of seconds, and interleaving at step granularity spreads
    it over all modes alike. -> per engine: outputs, seconds, forward seconds by kind, tokens, tau, steps
    per plan (mode/B<drafts>/m<branches>)."""
    ids = {name: [e.add_request(p, params) for p in prompts] for name, e in engines.items()}
    res = {name: {"seconds": 0.0, "forward": {}, "steps": {}} for name in engines}
    while any(e.has_work() for e in engines.values()):
        for name, engine in engines.items():
            if not engine.has_work():
                continue
            t0 = time.perf_counter()
            engine.step()
            r, s = res[name], engine.last_stats
            r["seconds"] += time.perf_counter() - t0
            plan = s.mode + (f"/B{s.block}" if s.block else "") + (f"/m{s.branches:g}" if s.mode == "parallel" else "")
            r["steps"][plan] = r["steps"].get(plan, 0) + 1
            for k, v in s.forward_seconds.items():
                r["forward"][k] = r["forward"].get(k, 0.0) + v
    for name, engine in engines.items():
        gens = [engine.result(i) for i in ids[name]]
        tokens = sum(len(g.token_ids) for g in gens)
        forwards = sum(g.extra["forwards"] for g in gens)  # target forwards after each row's prefill
        res[name].update(outputs=[g.token_ids for g in gens], tokens=tokens,
                         tau=(tokens - len(gens)) / max(forwards, 1),
                         misses=engine.totals["pruned_misses"] / max(engine.totals["parallel_rows"], 1))
        engine.totals.update(pruned_misses=0, parallel_rows=0)
    return res


def _cell(engines: dict[str, Engine], prompts, cfg: SpecBenchConfig) -> list[dict]:
    _lockstep(engines, prompts, SamplingParams(max_new_tokens=8))  # warm-up
    runs = [_lockstep(engines, prompts, SamplingParams(max_new_tokens=cfg.max_new_tokens))
            for _ in range(cfg.repeats)]
    ar_time = statistics.median(r["ar"]["seconds"] for r in runs)
    rows = []
    for name in engines:
        seconds = statistics.median(r[name]["seconds"] for r in runs)
        last = runs[-1][name]
        split = {k: v / last["seconds"] for k, v in last["forward"].items()}
        split["other"] = 1 - sum(split.values())
        rows.append({"batch": len(prompts), "mode": name, "tok_s": last["tokens"] / seconds,
                     "speedup": ar_time / seconds, "tau": last["tau"] if name != "ar" else 1.0,
                     "identical": all(r[name]["outputs"] == runs[0]["ar"]["outputs"] for r in runs),
                     "time_split": split, "steps": last["steps"], "pruned_misses": last["misses"]})
    return rows


def step_profile(engine: Engine, prompt: list[int], steps: int = 5, rows: int = 10) -> str:
    """torch.profiler table over `steps` decoding steps of `engine` (after the first two), totals."""
    from torch.profiler import ProfilerActivity, profile

    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=64))
    engine.step()
    engine.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.target.device.type == "cuda" else [])
    seconds, forward, plans = 0.0, {}, set()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
            s = engine.last_stats
            seconds += s.seconds
            plans.add(f"{s.mode}/B{s.block}/m{s.branches:g}")
            for k, v in s.forward_seconds.items():
                forward[k] = forward.get(k, 0.0) + v
    engine.abort(rid)
    head = (f"{steps} steps ({', '.join(sorted(plans))}), 1 row: {seconds / steps * 1000:.1f} ms per step, "
            "forwards " + ", ".join(f"{k} {v / steps * 1000:.1f} ms" for k, v in forward.items()) +
            " per step (profiler overhead included)")
    return head + "\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def run_spec_benchmark(cfg: SpecBenchConfig) -> list[dict]:
    import mlflow

    from flexdraft.tracking import start_run

    runtime = RuntimeConfig(device=cfg.device, dtype=cfg.dtype, threads=cfg.threads)
    lm = load_model(cfg.model, runtime)
    choice = resolve_drafter(cfg.drafter or None, lm.model, required=True)
    print(f"[drafter: {choice.source}; {cfg.dtype} on {lm.model.device}, {torch.get_num_threads()} threads]",
          flush=True)
    questions = gsm8k_questions(max(cfg.batch_sizes))
    prompts = [chat_ids(lm.tokenizer, [{"role": "user", "content": q}]) for q in questions]
    rows = []
    with start_run("spec-benchmark", {**asdict(cfg), "drafter_source": choice.source}) as run:
        for bs in cfg.batch_sizes:
            engines = _engines(lm, choice.drafter, choice.prior, cfg, bs)
            for row in _cell(engines, prompts[:bs], cfg):
                rows.append(row)
                print(_fmt(row), flush=True)
                tag = f"{row['mode']}.b{bs}"
                mlflow.log_metrics({f"tok_s.{tag}": row["tok_s"], f"speedup.{tag}": row["speedup"],
                                    f"tau.{tag}": row["tau"]})
        engine = _engines(lm, choice.drafter, choice.prior, cfg, 1)["parallel-pruned"]
        profile = step_profile(engine, prompts[0])
        table = markdown_table(rows, cfg)
        print("\n" + table + "\n\n" + profile)
        mlflow.log_text(table, "spec_benchmark.md")
        mlflow.log_text(profile, "step_profile.txt")
        mlflow.log_text(json.dumps(rows, indent=2), "spec_benchmark.json")
        print(f"\nMLflow run {run.info.run_id} (experiment spec-benchmark)")
    return rows


def _split(row: dict) -> str:
    return " ".join(f"{k} {v:.0%}" for k, v in sorted(row["time_split"].items(), key=lambda kv: -kv[1]))


def _fmt(r: dict) -> str:
    return (f"batch={r['batch']:>2} {r['mode']:>16}: {r['tok_s']:7.1f} tok/s, x{r['speedup']:.2f} over AR, "
            f"tau {r['tau']:.2f}, identical to AR: {r['identical']}, pruned misses {r['pruned_misses']:.0%}, "
            f"time: {_split(r)}, steps: {r['steps']}")


def markdown_table(rows: list[dict], cfg: SpecBenchConfig) -> str:
    return markdown(f"Speculative decoding vs our AR, {cfg.dtype}, GSM8K chat prompts, greedy, up to "
                    f"{cfg.max_new_tokens} new tokens per row, median of {cfg.repeats}; pruning keeps {cfg.top_m} "
                    "branches.",
                    ["batch", "mode", "tok/s", "speed-up", "tau", "identical to AR", "pruned misses",
                     "where the time goes"],
                    [[r["batch"], r["mode"], f"{r['tok_s']:.1f}", f"{r['speedup']:.2f}x", f"{r['tau']:.2f}",
                      "yes" if r["identical"] else "NO", f"{r['pruned_misses']:.0%}", _split(r)] for r in rows])
