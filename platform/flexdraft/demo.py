"""The main job on embedded defaults (`make demo`): for now, the target answers real GSM8K questions with
batched AR generation, reports tokens/s and logs the run to MLflow. Later stages (distill, attention tuning,
calibration, speculative benchmark) join here."""
from __future__ import annotations

import time

import torch

from flexdraft.config import RuntimeConfig
from flexdraft.data import chat_ids, gsm8k_questions
from flexdraft.generate import SamplingParams, generate
from flexdraft.models.loading import BUNDLED, gguf_cache_folder, bundled_gguf, load_model
from flexdraft.tracking import start_run, tracking_uri


def run_demo(n_questions: int = 4, max_new_tokens: int = 128) -> None:
    runtime = RuntimeConfig()
    config = {"model": BUNDLED, "questions": n_questions, "max_new_tokens": max_new_tokens,
              "runtime": vars(runtime)}
    converted = (gguf_cache_folder(bundled_gguf()) / "config.json").is_file()
    print(f"[1/3] loading SmolLM2-135M-Instruct ({'cached conversion' if converted else 'dequantising the bundled GGUF once, ~30 s'})",
          flush=True)
    t = time.perf_counter()
    lm = load_model(BUNDLED, runtime)
    print(f"      loaded in {time.perf_counter() - t:.1f}s from {lm.folder} "
          f"({runtime.torch_device()}, {runtime.torch_dtype()}, {torch.get_num_threads()} thread(s))", flush=True)

    questions = gsm8k_questions(n_questions)
    prompts = [chat_ids(lm.tokenizer, [{"role": "user", "content": q}]) for q in questions]
    print(f"[2/3] answering {len(prompts)} GSM8K test questions in one batch (greedy, <= {max_new_tokens} tokens)",
          flush=True)
    with start_run("demo", config) as run:
        gens = generate(lm.model, prompts, SamplingParams(max_new_tokens=max_new_tokens), lm.eos_token_ids)
        seconds = gens[0].seconds * len(gens)
        n_tokens = sum(len(g.token_ids) for g in gens)
        for q, g in zip(questions, gens):
            print(f"\nQ: {q}\nA: {lm.tokenizer.decode(g.token_ids, skip_special_tokens=True).strip()}")
        import mlflow

        mlflow.log_metrics({"ar_tokens_per_s": n_tokens / seconds, "generated_tokens": n_tokens,
                            "seconds": seconds})
        print(f"\n[3/3] {n_tokens} tokens in {seconds:.2f}s: {n_tokens / seconds:.1f} tokens/s "
              f"(batched AR, prefill included)")
        print(f"MLflow run {run.info.run_id}: mlflow ui --backend-store-uri {tracking_uri()}")
