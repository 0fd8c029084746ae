"""The pipeline's Ray side: distill (Ray actors), attention tuning and calibration (Ray Train TorchTrainer +
DeepSpeed). The entrypoints in jobs/ and the `flexdraft` CLI call these; nothing else in the library
imports Ray.

Training resumes exactly: a checkpoint holds the DeepSpeed state (drafter, optimizer, scheduler) and the
step; batch order and anchors are functions of (seed, rank, step), so a run restarted from a checkpoint
takes the same steps it would have taken.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from flexdraft.core import logs
from flexdraft.training.budget import StepClock, StepPlan, deadline_budget, lr_lambda
from flexdraft.core.config import RuntimeConfig, from_dict
from flexdraft.drafter.model import FORMAT
from flexdraft.core.errors import FlexDraftError
from flexdraft.drafter.recipe import PipelineConfig, TrainConfig

STAGES = ("attention", "calibration")


def log(stage: str, msg: str) -> None:
    logs.get(stage).info(msg)  # not print: Ray Train patches it in workers, and each line showed twice


def _model_args(cfg: PipelineConfig):
    from flexdraft.models.config import ModelArgs
    from flexdraft.models.loading import resolve_source

    folder = resolve_source(cfg.model)
    return ModelArgs.from_hf_config(json.loads((folder / "config.json").read_text()))


# ---------------------------------------------------------------------------------------------- distill

def run_distill(cfg: PipelineConfig) -> Path:
    """Answer the selected prompts with the target, one shard per actor call; finished shards are skipped.
    Within the distill budget (from this call on): no shard starts once less than a third of a shard's time is
    left (a shard cut after its prefill would teach nothing), running ones are cut at the deadline, and the first
    shard of each actor always starts, so there is validation data and some training data."""
    import ray

    from flexdraft.speculative.lookup import store_path
    from flexdraft.training.distill import select_prompts, shards, write_manifest
    from flexdraft.models.loading import load_tokenizer, resolve_source

    out = cfg.distill_dir()
    if (out / "manifest.json").is_file():
        log("distill", f"reusing {out} (finished earlier with this config)")
        return out
    d = cfg.distill
    deadline = time.time() + 60 * d.time_budget_min if d.time_budget_min else None
    init_ray()
    out.mkdir(parents=True, exist_ok=True)
    runtime = RuntimeConfig(device="cpu" if not cfg.workers.use_gpu else "auto", dtype=d.dtype,
                            threads=cfg.workers.threads_per_worker)
    prompts = select_prompts(cfg, load_tokenizer(resolve_source(cfg.model)))  # the weights load in the actors
    all_shards = shards(prompts, d.shard_size)
    todo = [(name, rows) for name, rows in all_shards if not (out / name).is_file()]
    log("distill", f"{len(prompts)} prompts in {len(all_shards)} shards -> {out}; "
                   f"{len(all_shards) - len(todo)} already done; dtype {d.dtype} -> {runtime.dtype_name()}; "
                   + (f"time budget {d.time_budget_min:g} min" if deadline else "no time budget"))

    @ray.remote(num_cpus=cfg.workers.threads_per_worker, num_gpus=1 if cfg.workers.use_gpu else 0)
    class Answerer:
        def __init__(self):
            from flexdraft.models.loading import load_model

            self.lm = load_model(cfg.model, runtime, with_tokenizer=True)  # the tokenizer knows the EOS ids

        def answer(self, rows, path, deadline):
            from flexdraft.training.distill import answer_shard

            return answer_shard(self.lm, rows, cfg, Path(path), deadline)

    cut = 0
    if todo:
        idle = [Answerer.remote() for _ in range(min(cfg.workers.num_workers, len(todo)))]
        actors, running = list(idle), {}
        t0, tokens, done, whole = time.perf_counter(), 0, 0, []  # whole: seconds of the shards answered in full

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
        if todo:
            log("distill", f"time budget of {d.time_budget_min:g} min spent: {len(todo)} train shards left out")
    manifest = write_manifest(out, cfg, {"shards_left_out": len(todo), "answers_cut": cut,
                                         "dtype": runtime.dtype_name()})
    store = store_path(out, _model_args(cfg).vocab_size)
    log("distill", f"done: train {manifest['train']}, validation {manifest['validation']}; n-gram store {store}")
    return out


# --------------------------------------------------------------------------------------------- training

def _stage_config(cfg: PipelineConfig, stage: str) -> TrainConfig:
    return cfg.attention if stage == "attention" else cfg.calibration


def run_key(cfg: PipelineConfig, stage: str) -> str:
    """Identifies a training run: the same key resumes, any config change starts afresh."""
    # the drafter format too: after a format change (e.g. 3: a known bonus takes the target's path) no stage
    # may resume from an older format's Ray Train checkpoint
    parts = [cfg.model, asdict(cfg.drafter), asdict(_stage_config(cfg, stage)), asdict(cfg.distill),
             cfg.workers.num_workers, FORMAT, cfg.time_budget_min]
    if stage == "calibration":
        parts.append(asdict(cfg.attention))
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:10]


def _deepspeed_config(tc: TrainConfig, dtype: torch.dtype) -> dict:
    return {
        "train_micro_batch_size_per_gpu": tc.batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": tc.zero_stage},
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": dtype == torch.float16},
        "zero_allow_untested_optimizer": True,  # torch AdamW: DeepSpeed's CPU Adam needs a compiler at run time
        "steps_per_print": 10 ** 9,
    }


def _rows(ds_shard, max_len: int, min_len_after_prompt: int) -> list[dict]:
    """A worker's sequences, in a fixed order (by id), cut to max_len; too short ones dropped."""
    rows = []
    for r in ds_shard.iter_rows():
        ids = [int(t) for t in r["input_ids"]][:max_len]
        if len(ids) - int(r["prompt_len"]) >= min_len_after_prompt:
            rows.append({"id": r["id"], "input_ids": ids, "prompt_len": int(r["prompt_len"])})
    return sorted(rows, key=lambda r: r["id"])


def _batch(rows: list[dict], step: int, bs: int, seed: int) -> list[dict]:
    """The step's sequences: an epoch-wise seeded permutation, a function of the step alone."""
    out = []
    for i in range(step * bs, step * bs + bs):
        epoch, k = divmod(i, len(rows))
        perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed * 100003 + epoch))
        out.append(rows[int(perm[k])])
    return out


def _evaluate(drafter, target, rows: list[dict], tc: TrainConfig, rank: int, world: int, device) -> dict:
    """Agreement metrics over the validation sequences, split across workers and summed."""
    import torch.distributed as dist

    from flexdraft.training.drafter_training import add_counts, agreement_counts, agreement_metrics, collate

    mine = rows[rank::world]
    counts = None
    for i in range(0, len(mine), 2):
        c = agreement_counts(drafter, target, collate(mine[i:i + 2], device), tc.eval_stride, tc.eval_anchors)
        counts = c if counts is None else add_counts(counts, c)
    keys = sorted(counts)
    flat = torch.tensor([x for k in keys for x in (counts[k] if isinstance(counts[k], list) else [counts[k]])],
                        dtype=torch.float64)
    if world > 1:
        dist.all_reduce(flat)
    total, i = {}, 0
    for k in keys:
        n = len(counts[k]) if isinstance(counts[k], list) else 1
        vals = flat[i:i + n].tolist()
        total[k] = vals if isinstance(counts[k], list) else vals[0]
        i += n
    return agreement_metrics(total)


def _prepare(cfg: PipelineConfig, stage: str, tc: TrainConfig, device: torch.device):
    """The worker's models and DeepSpeed engine: the frozen target, the drafter (fresh for attention tuning, the
    tuned one for calibration) wrapped by `deepspeed.initialize` with AdamW over the stage's tensors and the
    budget's LR schedule -> (lm, runtime, engine, scheduler, plan)."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if cfg.workers.use_gpu else "cpu")
    import deepspeed

    from flexdraft.drafter.model import Drafter, load_drafter
    from flexdraft.models.loading import load_model

    runtime = RuntimeConfig(device=str(device), dtype=tc.train_dtype(device.type),
                            threads=cfg.workers.threads_per_worker, cpu_prepack=False,
                            # the block pass: one kernel for every worker and restart (SDPA's CPU backward
                            # is slow); the frozen target pass always takes SDPA (training.target_pass)
                            cpu_attention="math")
    lm = load_model(cfg.model, runtime, with_tokenizer=False)
    drafter = (Drafter.from_target(lm.model, cfg.drafter) if stage == "attention"
               else load_drafter(cfg.drafter_dir("attention"), lm.model))
    params = drafter.parameters_for(stage)
    plan = StepPlan(tc)
    # fused: one vectorised pass over DeepSpeed's flat fp32 partition (~10x faster than the loop on a CPU thread)
    optimizer = torch.optim.AdamW(params, lr=tc.lr, weight_decay=tc.weight_decay, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(tc, plan))
    engine, _, _, scheduler = deepspeed.initialize(model=drafter, optimizer=optimizer, lr_scheduler=scheduler,
                                                   model_parameters=params,
                                                   config=_deepspeed_config(tc, runtime.torch_dtype()))
    return lm, runtime, engine, scheduler, plan


def train_func(config: dict) -> None:
    """Ray Train worker loop (one per worker), in the shape of Ray's DeepSpeed example: DeepSpeed over the
    drafter's trainable tensors beside the frozen target, resume from ray.train.get_checkpoint(), the dataset
    shard, then steps; every checkpoint_every steps a DeepSpeed checkpoint through ray.train.report. A time
    budget sets the step count (`budget.StepPlan`, `StepClock`); rank 0 logs to the run's MLflow run."""
    import ray.train
    import ray.train.torch

    from flexdraft.drafter.model import save_drafter, weights_fingerprint
    from flexdraft.training.drafter_training import collate, training_step

    cfg: PipelineConfig = from_dict(PipelineConfig, config["pipeline"])
    stage: str = config["stage"]
    tc = _stage_config(cfg, stage)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(cfg.workers.threads_per_worker)
    device = ray.train.torch.get_device()
    lm, runtime, engine, scheduler, plan = _prepare(cfg, stage, tc, device)
    target = lm.model

    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            _, client = engine.load_checkpoint(d, tag="ds")
        start = client["step"]
        plan.restore(client)

    B = cfg.drafter.block_size
    train_rows = _rows(ray.train.get_dataset_shard("train"), tc.max_seq_len, B + 2)
    val_rows = _rows(ray.train.get_dataset_shard("validation"), tc.max_seq_len, B + 2)[: tc.eval_sequences]
    if not train_rows:
        raise FlexDraftError(f"worker {rank} got no training sequence long enough for a block of {B}")

    nodes = [ray.get_runtime_context().get_node_id()] * world  # the Ray node of each rank, this attempt
    if world > 1:
        torch.distributed.all_gather_object(nodes, nodes[0])
    mlflow = None
    if rank == 0:
        import mlflow

        mlflow.set_tracking_uri(config["mlflow_uri"])
        mlflow.start_run(run_id=config["mlflow_run_id"])
        if start == 0:
            mlflow.log_params({"train_sequences_rank0": len(train_rows), "world_size": world,
                               "resolved_dtype": runtime.dtype_name()})
            log(stage, f"{world} workers on {device.type}, dtype {tc.dtype} -> {runtime.dtype_name()}")
        # where each attempt ran (a restart after a node failure is one more attempt, from its checkpoint's step)
        mlflow.set_tag(f"ray_nodes.from_step_{start}", ",".join(nodes))
        log(stage, f"from step {start}: ranks on Ray nodes " + ", ".join(f"{r}:{n[:12]}" for r, n in enumerate(nodes)))

    def report(metrics: dict, step: int, save: bool) -> None:
        if mlflow is not None:
            mlflow.log_metrics({k: float(v) for k, v in metrics.items()}, step=step)
        if not save:
            ray.train.report({**metrics, "step": step})
            return
        with tempfile.TemporaryDirectory() as tmp:
            engine.save_checkpoint(tmp, tag="ds", client_state={"step": step, **plan.state()})
            ray.train.report({**metrics, "step": step}, checkpoint=ray.train.Checkpoint.from_directory(tmp))

    def evaluate() -> dict:
        engine.module.eval()
        return {f"eval/{k}": v for k, v in _evaluate(engine.module, target, val_rows, tc, rank, world, device).items()}

    eval_s = None  # this attempt's first evaluation: how long the pipeline's later ones will take
    if start == 0 and stage == "attention":  # the untrained drafter, for before/after
        t_eval = time.time()
        report(evaluate(), 0, save=False)
        eval_s = time.time() - t_eval
    # a resumed attempt (no first evaluation timed) keeps the stage's own budget
    by_deadline = bool(config.get("deadline")) and not plan.fixed and eval_s is not None
    if by_deadline:
        plan.budget_s = deadline_budget(cfg, config["deadline"], config["launched"], time.time(), eval_s)

    def reduce(values: list[float], op=None) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        if world > 1:
            torch.distributed.all_reduce(t, op=op or torch.distributed.ReduceOp.SUM)
        return t.tolist()

    clock = StepClock(plan, start, lambda v: reduce(v, torch.distributed.ReduceOp.MAX))
    window = Window()
    t_run, run_tokens, run_blocks = time.perf_counter(), 0, 0  # this attempt's
    step = start
    while step < plan.steps:
        engine.module.train()
        seqs = collate(_batch(train_rows, step, tc.batch_size, tc.seed * 1000 + rank), device)
        g = torch.Generator().manual_seed(hash((tc.seed, rank, step)) % 2 ** 62)
        out = training_step(engine.module, target, seqs, stage, tc.anchors_per_seq, tc.loss, tc.slot_decay, g)
        engine.backward(out.loss)
        engine.step()
        window.add(out.loss.item(), out.tokens, out.blocks)
        run_tokens, run_blocks = run_tokens + out.tokens, run_blocks + out.blocks
        done = step + 1
        was_fixed = plan.fixed
        event = clock.step_done(done)
        if event and rank == 0:
            if not was_fixed:
                whose = f"what the pipeline's {cfg.time_budget_min:g} min leave" if by_deadline else "the stage's own"
                event += f" (at most {tc.steps}; {whose})"
                mlflow.log_metric("train/budget_min", plan.budget_s / 60, step=done)
            log(stage, event)
            mlflow.log_metric("train/planned_steps", plan.steps, step=done)
        evaluating = bool(tc.eval_every) and done % tc.eval_every == 0 and done != plan.steps  # (the last: below)
        if done % tc.log_every == 0 or done % tc.checkpoint_every == 0 or done == plan.steps or evaluating:
            metrics = window.metrics(reduce, world, scheduler.get_last_lr()[0])
            if evaluating:  # (not counted as training time by the budget)
                t_eval = time.perf_counter()
                metrics.update(evaluate())
                clock.exclude(time.perf_counter() - t_eval)
            if rank == 0:
                log(stage, f"step {done}/{plan.steps} loss {metrics['train/loss']:.3f} lr {metrics['train/lr']:.2e} "
                           f"{metrics['train/seq_tokens_per_s']:.0f} seq tok/s "
                           f"{metrics['train/blocks_per_s']:.1f} blocks/s")
            report(metrics, done, save=done % tc.checkpoint_every == 0 or done == plan.steps)
            window = Window()
        step = done

    train_seconds = time.perf_counter() - t_run
    tokens, blocks = reduce([run_tokens, run_blocks])
    throughput = {"train/mean_seq_tokens_per_s": tokens / train_seconds,
                  "train/mean_blocks_per_s": blocks / train_seconds}
    final = evaluate()
    if rank == 0:
        info = {"stage": stage, "steps": plan.steps, "eval": final, "run_key": config["run_key"],
                "train_seconds": train_seconds, **throughput}
        mlflow.log_metrics(throughput, step=plan.steps)
        folder = save_drafter(engine.module, cfg.drafter_dir(stage), lm.name, weights_fingerprint(target), info)
        mlflow.log_metrics({k: float(v) for k, v in final.items()}, step=plan.steps)
        mlflow.log_artifacts(str(folder), artifact_path=f"drafter-{stage}")
        mlflow.set_tag("drafter_path", str(folder))
        mlflow.end_run()
    ray.train.report({**final, "step": plan.steps})


class Window:
    """Losses, sequence tokens and blocks since the last log line -> the logged train/ metrics (summed over
    workers: loss averaged, throughput over the window's wall time)."""

    def __init__(self):
        self.t0, self.losses, self.tokens, self.blocks = time.perf_counter(), [], 0, 0

    def add(self, loss: float, tokens: int, blocks: int) -> None:
        self.losses.append(loss)
        self.tokens, self.blocks = self.tokens + tokens, self.blocks + blocks

    def metrics(self, reduce, world: int, lr: float) -> dict:
        loss, tokens, blocks = reduce([sum(self.losses) / len(self.losses), self.tokens, self.blocks])
        dt = time.perf_counter() - self.t0
        return {"train/loss": loss / world, "train/lr": lr, "train/seq_tokens_per_s": tokens / dt,
                "train/blocks_per_s": blocks / dt}


def preflight(cfg: PipelineConfig, stage: str) -> dict[str, list[Path]]:
    """Every check that can fail before work starts: drafter config vs the model, data, the tuned drafter."""
    import pyarrow.parquet as pq

    from flexdraft.core.data import read_split

    if stage not in STAGES:
        raise FlexDraftError(f"unknown training stage {stage!r}: {' or '.join(STAGES)}")
    cfg.drafter.check(_model_args(cfg))
    if not cfg.workers.use_gpu:  # (a driver on a cluster may have no GPU of its own: GPU dtypes are checked there)
        RuntimeConfig(device="cpu", dtype=_stage_config(cfg, stage).dtype).torch_dtype()

    files = {split: read_split(cfg.distill_dir(), split) for split in ("train", "validation")}
    for split, paths in files.items():
        if sum(pq.ParquetFile(f).metadata.num_rows for f in paths) == 0:
            raise FlexDraftError(f"the {split} data in {cfg.distill_dir()} is empty")
    if stage == "calibration":
        from flexdraft.drafter.model import read_drafter_meta, weights_fingerprint
        from flexdraft.models.loading import load_model

        meta = read_drafter_meta(cfg.drafter_dir("attention"))
        target = load_model(cfg.model, RuntimeConfig(device="cpu", dtype="float32", cpu_prepack=False),
                            with_tokenizer=False).model
        if meta["base_fingerprint"] != weights_fingerprint(target):
            raise FlexDraftError(f"the drafter in {cfg.drafter_dir('attention')} was trained for other base weights "
                                 f"({meta['base_model']}) than {cfg.model}")
        if meta.get("run_key") != run_key(cfg, "attention"):
            raise FlexDraftError(f"the drafter in {cfg.drafter_dir('attention')} was tuned with another config: "
                                 "run attention tuning with this config first")
    return files


def run_training(cfg: PipelineConfig, stage: str, deadline: float | None = None, callbacks: list | None = None):
    """Fit one stage with TorchTrainer; reuses a finished result and resumes an interrupted run. deadline: when
    the pipeline this stage runs in should end (epoch seconds; `deadline_budget`). callbacks: Ray Train callbacks
    (a sweep's trial passes Tune's `TuneReportCallback`)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray
    from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from flexdraft.drafter.model import read_drafter_meta
    from flexdraft.core.tracking import start_run, tracking_uri

    launched = time.time()  # the stage's start-up runs from here to its first step
    files = preflight(cfg, stage)
    init_ray()
    key = run_key(cfg, stage)
    out = cfg.drafter_dir(stage)
    try:
        done = read_drafter_meta(out) if (out / "drafter.json").is_file() else {}
    except FlexDraftError as e:  # e.g. calibrated by an older FlexDraft (its run key differs too): trained afresh
        log(stage, f"not reusing {out}: {e}")
        done = {}
    if done.get("run_key") == key:
        log(stage, f"reusing {out} (trained earlier with this config)")
        return done
    run_file = cfg.root / f"{stage}-{key}.mlflow-run"
    run_id = run_file.read_text().strip() if run_file.is_file() else None
    with start_run(cfg.mlflow_experiment, {"stage": stage, "run_key": key, **asdict(cfg)},
                   run_name=f"{cfg.name}-{stage}", run_id=run_id) as run:
        run_file.parent.mkdir(parents=True, exist_ok=True)
        run_file.write_text(run.info.run_id)
    log(stage, f"{'resuming' if run_id else 'starting'} {cfg.workers.num_workers} workers; MLflow run {run.info.run_id}")
    w = cfg.workers
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"pipeline": asdict(cfg), "stage": stage, "run_key": key, "mlflow_uri": tracking_uri(),
                           "mlflow_run_id": run.info.run_id,
                           "deadline": deadline if stage == "attention" else None, "launched": launched},
        scaling_config=ScalingConfig(num_workers=w.num_workers, use_gpu=w.use_gpu,
                                     resources_per_worker={"CPU": w.threads_per_worker}),
        # read here, into the object store, before the workers start: once they hold every CPU of a small machine,
        # read tasks would wait forever (and the distilled data is small: read tasks cost ~10 s, this ~0.1 s)
        datasets={split: ray.data.from_arrow(pa.concat_tables([pq.read_table(f) for f in files[split]]))
                  for split in ("train", "validation")},
        dataset_config=DataConfig(datasets_to_split=["train"]),
        run_config=RunConfig(name=f"{stage}-{key}", storage_path=str(cfg.root / "ray"),
                             failure_config=FailureConfig(max_failures=w.max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=2), callbacks=callbacks),
    )
    result = trainer.fit()
    meta = read_drafter_meta(out)
    ev = meta["eval"]
    log(stage, f"done: drafter at {out}; validation tau with bonus {ev['eval/bonus/tau']:.2f}, "
               f"masked {ev['eval/mask/tau']:.2f}, masked+calibrated {ev['eval/mask_calibrated/tau']:.2f}")
    return {**meta, "checkpoint": str(result.checkpoint.path) if result.checkpoint else None}


# ------------------------------------------------------------------------------------------ entrypoints

def init_ray() -> None:
    """Join the cluster named by RAY_ADDRESS (set under `ray job submit`), else start a local one."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=True)
    ray.data.DataContext.get_current().enable_progress_bars = False  # the jobs print their own progress


def shutdown_ray() -> None:
    import ray

    ray.shutdown()


def pipeline_deadline(cfg: PipelineConfig) -> float | None:
    """When a pipeline starting now should end (epoch seconds), or None without a pipeline budget."""
    return time.time() + 60 * cfg.time_budget_min if cfg.time_budget_min else None


def run_stage(cfg: PipelineConfig, stage: str, deadline: float | None = None):
    """Run one stage ("distill", "attention", "calibration") or all ("pipeline"); every check that can fail
    runs before Ray starts (local) or is joined (RAY_ADDRESS). deadline: the pipeline's (`pipeline_deadline`),
    for a stage run as part of one."""
    cfg.output_dir = str(cfg.root.resolve())  # workers must not depend on their own environment for it
    if stage == "distill":
        return run_distill(cfg)
    if stage == "pipeline":
        t0, deadline = time.perf_counter(), pipeline_deadline(cfg)
        run_distill(cfg)
        run_training(cfg, "attention", deadline=deadline)
        meta = run_training(cfg, "calibration")
        log("pipeline", f"all stages done in {time.perf_counter() - t0:.0f}s; drafter at {cfg.drafter_dir('calibration')}")
        return meta
    return run_training(cfg, stage, deadline=deadline)


def job_main(stage: str, argv: list[str] | None = None) -> None:
    """`python jobs/<job>.py --config FILE`: the same whether run directly or through `ray job submit`."""
    import argparse

    from flexdraft.drafter.recipe import load_pipeline_config

    parser = argparse.ArgumentParser(prog=f"jobs/{stage}", description=f"FlexDraft {stage} job on Ray")
    parser.add_argument("--config", required=True, help="pipeline YAML (e.g. configs/smollm2.yaml)")
    args = parser.parse_args(argv)
    try:
        run_stage(load_pipeline_config(args.config), stage)
    except FlexDraftError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
