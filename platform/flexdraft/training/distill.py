"""Self-distillation data: the target's own greedy answers to real ShareGPT prompts.

Prompts: the first human turn of each ShareGPT conversation, tokenised with the chat template, kept when
their length is within bounds, deduplicated, and never sharing text with an evaluation set (GSM8K, HumanEval,
MT-Bench; see data.EvalOverlap). A seeded shuffle picks `num_prompts`; the first `validation_prompts` of them
form the validation split. Each shard of prompts is answered by one Ray actor and written as one Parquet file
(`train-00003.parquet`: columns id, input_ids = prompt + answer, prompt_len, finish_reason), atomically, so a
restarted job skips the shards already on disk.
"""
from __future__ import annotations

import json
import random
import time
from pathlib import Path

from flexdraft.core.data import read_split
from flexdraft.core.errors import FlexDraftError
from flexdraft.drafter.recipe import PipelineConfig


def select_prompts(cfg: PipelineConfig, tokenizer) -> list[dict]:
    """-> [{"id", "prompt_ids", "split"}], validation first; deterministic for a given config."""
    from flexdraft.core.data import EvalOverlap, chat_ids, sharegpt_first_turns

    d = cfg.distill
    items = list(sharegpt_first_turns())
    random.Random(d.seed).shuffle(items)
    overlap, seen, chosen = EvalOverlap(), set(), []
    for item_id, text in items:
        key = " ".join(text.split()).lower()
        if not key or key in seen or text in overlap:
            continue
        seen.add(key)
        ids = chat_ids(tokenizer, [{"role": "user", "content": text}])
        if d.min_prompt_tokens <= len(ids) <= d.max_prompt_tokens:
            chosen.append({"id": item_id, "prompt_ids": ids})
            if len(chosen) == d.num_prompts:
                break
    if len(chosen) < d.num_prompts:
        raise FlexDraftError(f"only {len(chosen)} ShareGPT prompts pass the filters; asked for {d.num_prompts}")
    for i, p in enumerate(chosen):
        p["split"] = "validation" if i < d.validation_prompts else "train"
    return chosen


def shards(prompts: list[dict], shard_size: int) -> list[tuple[str, list[dict]]]:
    """-> [(file name, prompts)], validation and train sharded separately, validation first (a time-boxed run
    always has it)."""
    out = []
    for split in ("validation", "train"):
        rows = [p for p in prompts if p["split"] == split]
        for n, i in enumerate(range(0, len(rows), shard_size)):
            out.append((f"{split}-{n:05d}.parquet", rows[i:i + shard_size]))
    return out


def answer_shard(lm, prompts: list[dict], cfg: PipelineConfig, path: Path, deadline: float | None = None) -> dict:
    """Answer one shard with batched greedy AR decoding and write it to `path` (temp file + rename); answers
    still running at `deadline` (epoch seconds) are cut there, and batches not started by then are left out."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from flexdraft.engine.ar import generate
    from flexdraft.speculative.sampling import SamplingParams

    d = cfg.distill
    t0 = time.perf_counter()
    rows = {"id": [], "input_ids": [], "prompt_len": [], "finish_reason": []}
    params = SamplingParams(max_new_tokens=d.max_new_tokens)
    for i in range(0, len(prompts), d.batch_size):
        if deadline is not None and i and time.time() >= deadline:
            break
        batch = prompts[i:i + d.batch_size]
        gens = generate(lm.model, [p["prompt_ids"] for p in batch], params, lm.eos_token_ids, deadline)
        for p, g in zip(batch, gens):
            rows["id"].append(p["id"])
            rows["input_ids"].append(p["prompt_ids"] + g.token_ids)
            rows["prompt_len"].append(len(p["prompt_ids"]))
            rows["finish_reason"].append(g.finish_reason)
    tmp = path.with_suffix(".tmp")
    pq.write_table(pa.table(rows), tmp)
    tmp.rename(path)
    answer_tokens = sum(len(x) - n for x, n in zip(rows["input_ids"], rows["prompt_len"]))
    return {"file": path.name, "answer_tokens": answer_tokens, "seconds": time.perf_counter() - t0,
            "cut": rows["finish_reason"].count("time") + len(prompts) - len(rows["id"])}


def write_manifest(folder: Path, cfg: PipelineConfig, extra: dict | None = None) -> dict:
    import pyarrow.parquet as pq

    manifest = {"model": cfg.model, "distill": cfg.distill.__dict__, **(extra or {})}
    for split in ("train", "validation"):
        tables = [pq.read_table(f, columns=["input_ids", "prompt_len"]) for f in read_split(folder, split)]
        n = sum(t.num_rows for t in tables)
        tokens = sum(len(x) - p for t in tables for x, p in zip(t["input_ids"].to_pylist(), t["prompt_len"].to_pylist()))
        manifest[split] = {"sequences": n, "answer_tokens": tokens}
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest
