"""The Ray Train worker of attention tuning and calibration (`train_func`, in the shape of Ray's DeepSpeed
example): set up DeepSpeed beside the frozen target, resume from the latest checkpoint, take steps, report.

Training resumes exactly: a checkpoint holds the DeepSpeed state (drafter, optimizer, scheduler) and the
step; batch order and anchors are functions of (seed, rank, step), so a run restarted from a checkpoint
takes the same steps it would have taken.
"""
from __future__ import annotations

import os
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

from flexdraft.core.config import RuntimeConfig, from_dict
from flexdraft.core.errors import FlexDraftError
from flexdraft.drafter.recipe import PipelineConfig, TrainConfig
from flexdraft.training.budget import StepClock, StepPlan, deadline_budget, lr_lambda
from flexdraft.training.common import log, stage_config


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


@dataclass(frozen=True)
class WorkerArgs:
    """What a stage's Ray Train workers are given: the pipeline, the stage and its run key, the stage's MLflow run
    (tracking URI and run id, rank 0 logs there), the pipeline's deadline (epoch seconds; attention tuning under
    a pipeline budget, else None) and when the stage was launched. Crosses to the workers as TorchTrainer's
    `train_loop_config` dict (`to_config` / `from_config`)."""
    pipeline: PipelineConfig
    stage: str
    run_key: str
    mlflow_uri: str
    mlflow_run_id: str
    deadline: float | None
    launched: float

    def to_config(self) -> dict:
        return {**asdict(self), "pipeline": asdict(self.pipeline)}

    @staticmethod
    def from_config(config: dict) -> WorkerArgs:
        return WorkerArgs(**{**config, "pipeline": from_dict(PipelineConfig, config["pipeline"])})


def train_func(config: dict) -> None:
    """Ray Train worker loop (one per worker), in the shape of Ray's DeepSpeed example: DeepSpeed over the
    drafter's trainable tensors beside the frozen target, resume from ray.train.get_checkpoint(), the dataset
    shard, then steps; every checkpoint_every steps a DeepSpeed checkpoint through ray.train.report. A time
    budget sets the step count (`budget.StepPlan`, `StepClock`); rank 0 logs to the run's MLflow run."""
    import ray.train
    import ray.train.torch

    args = WorkerArgs.from_config(config)
    cfg, stage = args.pipeline, args.stage
    tc = stage_config(cfg, stage)
    torch.set_num_threads(cfg.workers.threads_per_worker)
    device = ray.train.torch.get_device()
    lm, runtime, engine, scheduler, plan = _prepare(cfg, stage, tc, device)

    start = 0  # resume
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            _, client = engine.load_checkpoint(d, tag="ds")
        start = client["step"]
        plan.restore(client)

    B = cfg.drafter.block_size
    train_rows = _rows(ray.train.get_dataset_shard("train"), tc.max_seq_len, B + 2)
    val_rows = _rows(ray.train.get_dataset_shard("validation"), tc.max_seq_len, B + 2)[: tc.eval_sequences]
    run = Worker(args, tc, engine, lm, scheduler, plan, val_rows, device)
    if not train_rows:
        raise FlexDraftError(f"worker {run.rank} got no training sequence long enough for a block of {B}")
    run.start_tracking(start, len(train_rows), runtime)
    run.plan_budget(start)
    run.loop(start, train_rows)
    run.finish()


class Worker:
    """One worker's run of a stage: its DeepSpeed engine, the frozen target, the step plan, its rank, and (rank 0)
    the stage's MLflow run; `loop` takes the steps, `report` logs and checkpoints through Ray Train."""

    def __init__(self, args: WorkerArgs, tc: TrainConfig, engine, lm, scheduler, plan: StepPlan,
                 val_rows: list[dict], device: torch.device):
        import ray.train

        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        self.args, self.cfg, self.stage = args, args.pipeline, args.stage
        self.tc, self.engine, self.lm, self.scheduler, self.plan = tc, engine, lm, scheduler, plan
        self.val_rows, self.device = val_rows, device
        self.mlflow = None
        self.by_deadline = False

    def start_tracking(self, start: int, train_sequences: int, runtime: RuntimeConfig) -> None:
        """Rank 0 joins the stage's MLflow run and tags the Ray node of each rank for this attempt."""
        import ray

        nodes = [ray.get_runtime_context().get_node_id()] * self.world  # the Ray node of each rank, this attempt
        if self.world > 1:
            torch.distributed.all_gather_object(nodes, nodes[0])
        if self.rank != 0:
            return
        import mlflow

        self.mlflow = mlflow
        mlflow.set_tracking_uri(self.args.mlflow_uri)
        mlflow.start_run(run_id=self.args.mlflow_run_id)
        if start == 0:
            mlflow.log_params({"train_sequences_rank0": train_sequences, "world_size": self.world,
                               "resolved_dtype": runtime.dtype_name()})
            log(self.stage, f"{self.world} workers on {self.device.type}, dtype {self.tc.dtype} -> "
                            f"{runtime.dtype_name()}")
        # where each attempt ran (a restart after a node failure is one more attempt, from its checkpoint's step)
        mlflow.set_tag(f"ray_nodes.from_step_{start}", ",".join(nodes))
        log(self.stage, f"from step {start}: ranks on Ray nodes " + ", ".join(f"{r}:{n[:12]}" for r, n in enumerate(nodes)))

    def plan_budget(self, start: int) -> None:
        """A fresh attention run evaluates the untrained drafter (for before/after); under a pipeline deadline
        that evaluation's time sets the budget. A resumed attempt keeps the stage's own budget."""
        eval_s = None
        if start == 0 and self.stage == "attention":
            t_eval = time.time()
            self.report(self.evaluate(), 0, save=False)
            eval_s = time.time() - t_eval
        self.by_deadline = bool(self.args.deadline) and not self.plan.fixed and eval_s is not None
        if self.by_deadline:
            self.plan.budget_s = deadline_budget(self.cfg, self.args.deadline, self.args.launched, time.time(), eval_s)

    def reduce(self, values: list[float], op=None) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        if self.world > 1:
            torch.distributed.all_reduce(t, op=op or torch.distributed.ReduceOp.SUM)
        return t.tolist()

    def evaluate(self) -> dict:
        self.engine.module.eval()
        return {f"eval/{k}": v for k, v in _evaluate(self.engine.module, self.lm.model, self.val_rows, self.tc,
                                                     self.rank, self.world, self.device).items()}

    def report(self, metrics: dict, step: int, save: bool) -> None:
        """Log (rank 0) and report to Ray Train; save: with a DeepSpeed checkpoint of every rank."""
        import ray.train

        if self.mlflow is not None:
            self.mlflow.log_metrics({k: float(v) for k, v in metrics.items()}, step=step)
        if not save:
            ray.train.report({**metrics, "step": step})
            return
        with tempfile.TemporaryDirectory() as tmp:
            self.engine.save_checkpoint(tmp, tag="ds", client_state={"step": step, **self.plan.state()})
            ray.train.report({**metrics, "step": step}, checkpoint=ray.train.Checkpoint.from_directory(tmp))

    def loop(self, start: int, train_rows: list[dict]) -> None:
        """Steps start..plan.steps; every log_every / checkpoint_every / eval_every step a report."""
        from flexdraft.training.drafter_training import collate, training_step

        tc, plan, engine, rank = self.tc, self.plan, self.engine, self.rank
        clock = StepClock(plan, start, lambda v: self.reduce(v, torch.distributed.ReduceOp.MAX))
        window = Window()
        self.t_run, self.run_tokens, self.run_blocks = time.perf_counter(), 0, 0  # this attempt's
        step = start
        while step < plan.steps:
            engine.module.train()
            seqs = collate(_batch(train_rows, step, tc.batch_size, tc.seed * 1000 + rank), self.device)
            g = torch.Generator().manual_seed(hash((tc.seed, rank, step)) % 2 ** 62)
            out = training_step(engine.module, self.lm.model, seqs, self.stage, tc.anchors_per_seq, tc.loss,
                                tc.slot_decay, g)
            engine.backward(out.loss)
            engine.step()
            window.add(out.loss.item(), out.tokens, out.blocks)
            self.run_tokens, self.run_blocks = self.run_tokens + out.tokens, self.run_blocks + out.blocks
            done = step + 1
            was_fixed = plan.fixed
            event = clock.step_done(done)
            if event and rank == 0:
                self.log_budget(event, was_fixed, done)
            evaluating = bool(tc.eval_every) and done % tc.eval_every == 0 and done != plan.steps  # (last: finish)
            if done % tc.log_every == 0 or done % tc.checkpoint_every == 0 or done == plan.steps or evaluating:
                metrics = window.metrics(self.reduce, self.world, self.scheduler.get_last_lr()[0])
                if evaluating:  # (not counted as training time by the budget)
                    t_eval = time.perf_counter()
                    metrics.update(self.evaluate())
                    clock.exclude(time.perf_counter() - t_eval)
                if rank == 0:
                    pace = (time.perf_counter() - self.t_run) / (done - start)  # this attempt's s/step
                    log(self.stage, f"step {done}/{plan.steps} loss {metrics['train/loss']:.3f} "
                                    f"lr {metrics['train/lr']:.2e} {metrics['train/seq_tokens_per_s']:.0f} seq tok/s "
                                    f"{metrics['train/blocks_per_s']:.1f} blocks/s, "
                                    f"~{(plan.steps - done) * pace / 60:.1f} min left")
                self.report(metrics, done, save=done % tc.checkpoint_every == 0 or done == plan.steps)
                window = Window()
            step = done

    def log_budget(self, event: str, was_fixed: bool, done: int) -> None:
        if not was_fixed:
            whose = (f"what the pipeline's {self.cfg.time_budget_min:g} min leave" if self.by_deadline
                     else "the stage's own")
            event += f" (at most {self.tc.steps}; {whose})"
            self.mlflow.log_metric("train/budget_min", self.plan.budget_s / 60, step=done)
        log(self.stage, event)
        self.mlflow.log_metric("train/planned_steps", self.plan.steps, step=done)

    def finish(self) -> None:
        """The final evaluation; rank 0 saves the drafter, logs it as the run's MLflow model and ends the run."""
        import ray.train

        from flexdraft.drafter.model import save_drafter
        from flexdraft.training.register import log_stage_model

        train_seconds = time.perf_counter() - self.t_run
        tokens, blocks = self.reduce([self.run_tokens, self.run_blocks])
        throughput = {"train/mean_seq_tokens_per_s": tokens / train_seconds,
                      "train/mean_blocks_per_s": blocks / train_seconds}
        final = self.evaluate()
        steps = self.plan.steps
        if self.rank == 0:
            info = {"stage": self.stage, "steps": steps, "eval": final, "run_key": self.args.run_key,
                    "train_seconds": train_seconds, **throughput}
            self.mlflow.log_metrics(throughput, step=steps)
            folder = save_drafter(self.engine.module, self.cfg.drafter_dir(self.stage), self.lm.name,
                                  self.lm.model.fingerprint, info)
            # (the final evaluation: logged at the last step, linked to the model and its data set)
            model_id = log_stage_model(folder, self.stage, final, self.cfg.distill_dir(), steps)
            self.mlflow.set_tags({"drafter_path": str(folder), "flexdraft.model_id": model_id})
            self.mlflow.end_run()
        ray.train.report({**final, "step": steps})


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
