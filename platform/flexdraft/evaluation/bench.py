"""Benchmark: our batched AR generation against `transformers` `generate`, same weights, prompts and dtype.

Both sides generate exactly `max_new_tokens` per row (EOS ignored) so they do the same work; timing
excludes model loading and includes prefill; one warm-up run, then the median of `repeats` runs,
alternating the two implementations so machine noise hits both alike.
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from flexdraft.core.config import RuntimeConfig
from flexdraft.core.data import chat_ids, gsm8k_questions
from flexdraft.core.errors import FlexDraftError
from flexdraft.engine.ar import generate
from flexdraft.models.loading import load_model
from flexdraft.speculative.sampling import SamplingParams


@dataclass
class ArBenchConfig:
    model: str = "smollm2"
    device: str = "auto"
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 16])
    dtypes: list[str] = field(default_factory=lambda: ["float32", "bfloat16"])
    threads: list[int] = field(default_factory=lambda: [0])  # 0 = one per core
    max_new_tokens: int = 64
    repeats: int = 3

    def __post_init__(self):
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise FlexDraftError(f"batch sizes must be >= 1, got {self.batch_sizes}")
        if self.repeats < 1:
            raise FlexDraftError(f"repeats must be >= 1, got {self.repeats}")
        if self.max_new_tokens < 1:
            raise FlexDraftError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


def timed(fn) -> float:
    """Wall seconds of fn(), the GPU (if any) synchronised before and after."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def load_hf(lm, runtime: RuntimeConfig):
    """The same weights as `lm` as a `transformers` model (the peer of every comparison)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(lm.folder, dtype=runtime.torch_dtype()).to(
        runtime.torch_device()).eval()


def hf_generate(hf, prompts: list[list[int]], max_new: int, pad_id: int, eos: list[int] | None = None,
                lookup: int = 0) -> list[list[int]]:
    """transformers generate, greedy, one left-padded batch -> the new token ids per row. eos: stop rows at
    these tokens (None: as `hf.generation_config` says; run_ar_benchmark clears its EOS so every row gets
    max_new). lookup > 0: prompt-lookup decoding with that
    many candidate tokens (transformers supports it at batch 1 only)."""
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    att = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, T - len(p):] = torch.tensor(p)
        att[i, T - len(p):] = 1
    extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    with torch.inference_mode():
        out = hf.generate(input_ids=ids.to(hf.device), attention_mask=att.to(hf.device), max_new_tokens=max_new,
                          do_sample=False, pad_token_id=pad_id, eos_token_id=eos, **extra)
    rows = out[:, T:].tolist()
    if eos:  # cut after the first EOS (what follows is padding)
        rows = [next((r[:i + 1] for i, t in enumerate(r) if t in eos), r) for r in rows]
    return rows


def _side_by_side(lm, hf, prompts: list[list[int]], cfg: ArBenchConfig, pad_id: int) -> dict:
    """One cell: warm up both, then `repeats` alternating timed runs; tokens/s from the medians."""
    params = SamplingParams(max_new_tokens=cfg.max_new_tokens)
    outputs = {}
    runs = {
        "ours": lambda: outputs.__setitem__("ours", [g.token_ids for g in generate(lm.model, prompts, params)]),
        "hf": lambda: outputs.__setitem__("hf", hf_generate(hf, prompts, cfg.max_new_tokens, pad_id)),
    }
    times = {name: [] for name in runs}
    with torch.inference_mode():
        for run in runs.values():
            run()  # warm-up
        for _ in range(cfg.repeats):
            for name, run in runs.items():
                times[name].append(timed(run))
    n_tokens = len(prompts) * cfg.max_new_tokens
    row = {
        "dtype": str(lm.model.dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
        "batch": len(prompts),
        "ours_tok_s": n_tokens / statistics.median(times["ours"]),
        "hf_tok_s": n_tokens / statistics.median(times["hf"]),
        "same_tokens": sum(a == b for a, b in zip(outputs["ours"], outputs["hf"])) / len(prompts),
    }
    row["ratio"] = row["ours_tok_s"] / row["hf_tok_s"]
    return row


def run_ar_benchmark(cfg: ArBenchConfig) -> list[dict]:
    import mlflow

    from flexdraft.core.tracking import start_run

    rows = []
    with start_run("ar-benchmark", asdict(cfg), run_name=f"bench-ar-{'-'.join(cfg.dtypes)}") as run:
        for threads in cfg.threads:
            for dtype in cfg.dtypes:
                runtime = RuntimeConfig(device=cfg.device, dtype=dtype, threads=threads)
                lm = load_model(cfg.model, runtime)
                hf = load_hf(lm, runtime)
                hf.generation_config.eos_token_id = None  # EOS ignored, as on our side: same work, same tokens
                pad = lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else 0
                questions = gsm8k_questions(max(cfg.batch_sizes))
                prompts = [chat_ids(lm.tokenizer, [{"role": "user", "content": q}]) for q in questions]
                for bs in cfg.batch_sizes:
                    row = _side_by_side(lm, hf, prompts[:bs], cfg, pad)
                    rows.append(row)
                    print(_fmt_row(row), flush=True)
                    tag = f"{row['dtype']}.t{row['threads']}.b{bs}"
                    mlflow.log_metrics({f"ours_tok_s.{tag}": row["ours_tok_s"], f"hf_tok_s.{tag}": row["hf_tok_s"],
                                        f"ratio.{tag}": row["ratio"]})
                del hf, lm
        table = markdown_table(rows, cfg)
        print("\n" + table)
        mlflow.log_text(table, "ar_benchmark.md")
        mlflow.log_text(json.dumps(rows, indent=2), "ar_benchmark.json")
        print(f"\nMLflow run {run.info.run_id} (experiment ar-benchmark)")
    return rows


def _fmt_row(r: dict) -> str:
    return (f"{r['dtype']:>8} threads={r['threads']} batch={r['batch']:>2}: ours {r['ours_tok_s']:7.1f} tok/s, "
            f"transformers {r['hf_tok_s']:7.1f} tok/s, ratio {r['ratio']:.2f}x, "
            f"same tokens {r['same_tokens']:.0%}")


def markdown(caption: str, header: list[str], cells: list[list]) -> str:
    """A caption line, then a Markdown table."""
    lines = [caption, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in cells]
    return "\n".join(lines)


def markdown_table(rows: list[dict], cfg: ArBenchConfig) -> str:
    return markdown(f"AR generation, {cfg.max_new_tokens} new tokens per row (EOS ignored), GSM8K chat prompts, "
                    f"median of {cfg.repeats}; prefill included, loading excluded.",
                    ["dtype", "threads", "batch", "ours tok/s", "transformers tok/s", "ratio", "identical rows"],
                    [[r["dtype"], r["threads"], r["batch"], f"{r['ours_tok_s']:.1f}", f"{r['hf_tok_s']:.1f}",
                      f"{r['ratio']:.2f}x", f"{r['same_tokens']:.0%}"] for r in rows])
