"""The distill job: the target answers the selected prompts, one shard per Ray actor call (the data the drafter
is trained on, and the n-gram store's source)."""
from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

from flexdraft.core.config import RuntimeConfig
from flexdraft.drafter.recipe import PipelineConfig
from flexdraft.training.common import init_ray, log, model_args


def run_distill(cfg: PipelineConfig) -> Path:
    """Answer the selected prompts with the target, one shard per actor call; finished shards are skipped.
    Within the distill budget (from this call on): no shard starts once less than a third of a shard's time is
    left (a shard cut after its prefill would teach nothing), running ones are cut at the deadline, and the first
    shard of each actor always starts, so there is validation data and some training data."""
    import mlflow

    from flexdraft.core.tracking import start_run
    from flexdraft.models.loading import load_tokenizer, resolve_source
    from flexdraft.speculative.lookup import store_path
    from flexdraft.training.distill import select_prompts, shards, write_manifest
    from flexdraft.training.register import distilled_dataset

    out = cfg.distill_dir()
    if (out / "manifest.json").is_file():
        log("distill", f"reusing {out} (finished earlier with this config)")
        return out
    d = cfg.distill
    deadline = time.time() + 60 * d.time_budget_min if d.time_budget_min else None
    init_ray()
    out.mkdir(parents=True, exist_ok=True)
    run_file = out / "distill.mlflow-run"  # a restarted distill job continues its run
    run_id = run_file.read_text().strip() if run_file.is_file() else None
    with start_run(cfg.mlflow_experiment, {"stage": "distill", "model": cfg.model, "distill": asdict(d)},
                   run_name=f"{cfg.name}-distill", run_id=run_id) as run:
        run_file.write_text(run.info.run_id)
        t0 = time.perf_counter()
        runtime = RuntimeConfig(device="cpu" if not cfg.workers.use_gpu else "auto", dtype=d.dtype,
                                threads=cfg.workers.threads_per_worker)
        prompts = select_prompts(cfg, load_tokenizer(resolve_source(cfg.model)))  # the weights load in the actors
        all_shards = shards(prompts, d.shard_size)
        todo = [(name, rows) for name, rows in all_shards if not (out / name).is_file()]
        log("distill", f"{len(prompts)} prompts in {len(all_shards)} shards -> {out}; "
                       f"{len(all_shards) - len(todo)} already done; dtype {d.dtype} -> {runtime.dtype_name()}; "
                       + (f"time budget {d.time_budget_min:g} min" if deadline else "no time budget"))

        cut = _answer_shards(cfg, runtime, todo, out, deadline) if todo else 0
        if todo:
            log("distill", f"time budget of {d.time_budget_min:g} min spent: {len(todo)} train shards left out")
        manifest = write_manifest(out, cfg, {"shards_left_out": len(todo), "answers_cut": cut,
                                             "dtype": runtime.dtype_name(), "mlflow_run_id": run.info.run_id})
        mlflow.log_metrics({f"distill/{split}_{k}": float(v) for split in ("train", "validation")
                            for k, v in manifest[split].items()}
                           | {"distill/shards_left_out": len(todo), "distill/answers_cut": cut,
                              "distill/seconds": time.perf_counter() - t0})
        mlflow.log_input(distilled_dataset(out), context="distilled")
    store = store_path(out, model_args(cfg).vocab_size)
    log("distill", f"done: train {manifest['train']}, validation {manifest['validation']}; n-gram store {store}; "
                   f"MLflow run {run.info.run_id}")
    return out


def _answer_shards(cfg: PipelineConfig, runtime: RuntimeConfig, todo: list, out: Path, deadline: float | None) -> int:
    """Answer the shards of `todo` on a pool of Ray actors, one shard per call, as the budget allows (see
    `run_distill`); what is left unanswered stays in `todo` -> how many answers the deadline cut."""
    import ray

    @ray.remote(num_cpus=cfg.workers.threads_per_worker, num_gpus=1 if cfg.workers.use_gpu else 0)
    class Answerer:
        def __init__(self):
            from flexdraft.models.loading import load_model

            self.lm = load_model(cfg.model, runtime, with_tokenizer=True)  # the tokenizer knows the EOS ids

        def answer(self, rows, path, deadline):
            from flexdraft.training.distill import answer_shard

            return answer_shard(self.lm, rows, cfg, Path(path), deadline)

    idle = [Answerer.remote() for _ in range(min(cfg.workers.num_workers, len(todo)))]
    actors, running = list(idle), {}
    t0, tokens, done, cut, whole = time.perf_counter(), 0, 0, 0, []  # whole: seconds of shards answered in full

    def may_start() -> bool:  # each actor's first shard; later ones while a third of a shard's time is left
        if deadline is None or done + len(running) < len(actors):
            return True
        return time.time() + (sum(whole) / len(whole) / 3 if whole else 0.0) < deadline

    while todo or running:
        while idle and todo and may_start():
            name, rows = todo.pop(0)
            actor = idle.pop()
            running[actor.answer.remote(rows, str(out / name), deadline)] = actor
        if not running:
            break
        [ref], _ = ray.wait(list(running), num_returns=1)
        idle.append(running.pop(ref))
        res = ray.get(ref)
        done, tokens, cut = done + 1, tokens + res["answer_tokens"], cut + res["cut"]
        if not res["cut"]:
            whole.append(res["seconds"])
        elapsed = time.perf_counter() - t0
        log("distill", f"shard {res['file']} done ({done}/{done + len(todo) + len(running)}): "
                       f"{res['answer_tokens']} answer tokens in {res['seconds']:.0f}s"
                       + (f" ({res['cut']} answers cut by the time budget)" if res["cut"] else "")
                       + f"; total {tokens} tokens, {tokens / elapsed:.0f} tok/s")
    for a in actors:
        ray.kill(a)
    return cut
