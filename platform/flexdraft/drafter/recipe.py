"""The training pipeline's configuration (one YAML file for distill, attention tuning and calibration) and
where each stage keeps its outputs."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from flexdraft.core.config import data_dir, load_yaml
from flexdraft.core.errors import FlexDraftError
from flexdraft.core.hardware import probe
from flexdraft.drafter.model import DrafterConfig


@dataclass
class DistillConfig:
    # ShareGPT first turns answered by the target (train + validation): 600 train sequences are about what the
    # default's 2 workers see in its attention budget on the Intel dev machine (314 steps), 6.9 min to distill there
    num_prompts: int = 640
    validation_prompts: int = 40
    min_prompt_tokens: int = 8
    max_prompt_tokens: int = 160
    max_new_tokens: int = 192
    batch_size: int = 64  # one thread, bf16, 96 new tokens: 322 tok/s at 16, 409 at 32, 482 at 64
    shard_size: int = 64  # prompts per shard: the unit of parallelism and of resumption
    # the target's dtype while answering (its greedy answers are the training data); auto: see RuntimeConfig
    dtype: str = "auto"
    # minutes for answering, Ray's start-up included; 0 = none. Past it no shard starts, and the shards being
    # answered keep what they have (answers cut short: finish_reason "time"), so a slower machine distils fewer
    # tokens instead of taking longer. The validation shard goes first.
    time_budget_min: float = 7.0
    seed: int = 0


@dataclass
class TrainConfig:
    # Many small steps beat few large ones at equal compute (measured, SmolLM2 k=12, 6 CPU-minutes: 185 steps
    # of 1 sequence x 16 blocks reach the validation tau that 100 steps of 4 x 40 reached in 36 CPU-minutes)
    steps: int = 1500  # optimizer steps (each worker: batch_size sequences per step); with a time budget, the most
    # minutes of training steps (start-up and evaluation not counted); 0 = none. A budgeted run times its steps
    # 3-10, fixes its step count to what fits (at least 10, at most `steps`) and keeps it in its checkpoints: the
    # LR schedule ends where the run ends, and a resumed run ends where the first attempt would have. When the pace
    # drifts later, the count moves to hold the budget and the schedule follows (StepPlan.hold)
    time_budget_min: float = 0.0
    batch_size: int = 1  # sequences per worker per step
    anchors_per_seq: int = 16  # blocks per sequence per step
    max_seq_len: int = 384  # sequences are cut to this many tokens
    lr: float = 1e-3
    warmup_steps: int = 10
    weight_decay: float = 0.0
    loss: str = "ce"  # ce: cross-entropy to the distilled tokens (the target's greedy ones); kl: KL(p_target || q)
    slot_decay: float = 0.8  # slot j's loss weight is slot_decay^(j-1)
    zero_stage: int = 2
    dtype: str = "auto"  # auto: bfloat16 on GPU and on CPUs with bf16 instructions, else float32 (see train_dtype)
    checkpoint_every: int = 200
    log_every: int = 50
    eval_sequences: int = 40  # validation sequences for the agreement metrics
    eval_stride: int = 7  # one evaluation anchor every eval_stride answer positions
    eval_anchors: int = 24  # at most this many per sequence
    eval_every: int = 0  # also evaluate every this many steps (0: before and after training only); a sweep's ASHA
    # compares trials by it
    seed: int = 0

    def check(self, where: str) -> None:
        for key in ("steps", "batch_size", "anchors_per_seq", "checkpoint_every", "log_every", "eval_stride",
                    "eval_anchors"):
            if getattr(self, key) < 1:
                raise FlexDraftError(f"config.{where}.{key} must be >= 1, got {getattr(self, key)}")
        if self.eval_every < 0:
            raise FlexDraftError(f"config.{where}.eval_every must be >= 0 (0 = none), got {self.eval_every}")
        if self.time_budget_min < 0:
            raise FlexDraftError(f"config.{where}.time_budget_min must be >= 0 (0 = none), got {self.time_budget_min}")
        if self.loss not in ("ce", "kl"):
            raise FlexDraftError(f"config.{where}.loss must be ce or kl, got {self.loss!r}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise FlexDraftError(f"config.{where}.zero_stage must be 0-3, got {self.zero_stage}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise FlexDraftError(f"config.{where}.dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")

    def train_dtype(self, device_type: str) -> str:
        """The dtype `auto` means on this device. Training a k = 12 drafter on SmolLM2 (one CPU thread, 1
        sequence x 16 blocks per step) takes 0.54 s per step in bf16 against 1.4 s in fp32 on an AVX512-BF16
        CPU; DeepSpeed keeps fp32 master weights either way."""
        if self.dtype != "auto":
            return self.dtype
        return probe().auto_dtype(device_type)


@dataclass
class WorkersConfig:
    num_workers: int = 2  # Ray Train workers (and distill actors)
    threads_per_worker: int = 1  # two 1-thread processes use both cores of the dev machine without contention
    use_gpu: bool = False
    max_failures: int = 3  # Ray Train restarts from the last checkpoint this many times


@dataclass
class PipelineConfig:
    name: str = "smollm2-default"
    output_dir: str = ""  # where every stage writes (on a cluster: shared storage); "" = $FLEXDRAFT_HOME/pipelines/<name>
    model: str = "smollm2"  # 'smollm2' (bundled), a .gguf file or a HF folder
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    # time budgets sized for ~30 min end to end on a 2-core machine (distill, start-up and evaluations included)
    attention: TrainConfig = field(default_factory=lambda: TrainConfig(time_budget_min=12.0))
    calibration: TrainConfig = field(default_factory=lambda: TrainConfig(steps=200, time_budget_min=3.0,
                                                                         checkpoint_every=100, log_every=50))
    workers: WorkersConfig = field(default_factory=WorkersConfig)
    # the whole pipeline's minutes (`flexdraft pipeline`, `make demo`; distill, start-up and evaluations included):
    # distill keeps its own budget, and a budgeted attention stage then trains until only what the rest needs is
    # left (its final evaluation, calibration's start-up, budget and evaluation), more or less than its own
    # time_budget_min, so a faster machine spends the time a slower one needs on more steps and a slower one ends
    # in time. 0 = every stage keeps its own budget; a stage run alone always does (budget.deadline_budget)
    time_budget_min: float = 30.0
    mlflow_experiment: str = "flexdraft-training"

    def __post_init__(self):
        if not self.name or "/" in self.name:
            raise FlexDraftError(f"config.name must be a non-empty name without '/', got {self.name!r}")
        self.attention.check("attention")
        self.calibration.check("calibration")
        if self.time_budget_min < 0:
            raise FlexDraftError(f"config.time_budget_min must be >= 0 (0 = none), got {self.time_budget_min}")
        if self.workers.num_workers < 1:
            raise FlexDraftError(f"config.workers.num_workers must be >= 1, got {self.workers.num_workers}")
        if self.distill.validation_prompts >= self.distill.num_prompts:
            raise FlexDraftError("config.distill.validation_prompts must be smaller than num_prompts")
        if self.distill.time_budget_min < 0:
            raise FlexDraftError(f"config.distill.time_budget_min must be >= 0 (0 = none), got "
                                 f"{self.distill.time_budget_min}")
        if self.distill.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise FlexDraftError(f"config.distill.dtype must be auto, float32, bfloat16 or float16, got "
                                 f"{self.distill.dtype!r}")

    @property
    def root(self) -> Path:
        return Path(self.output_dir).expanduser() if self.output_dir else data_dir() / "pipelines" / self.name

    def distill_dir(self) -> Path:
        """Beside the pipeline's folder, keyed by the model and the distill config: pipelines that differ only
        in the drafter or training share their data, and a changed distill config never reuses stale data."""
        key = hashlib.sha256(json.dumps([self.model, asdict(self.distill)], sort_keys=True).encode()).hexdigest()[:10]
        return self.root.parent / "distill" / key

    def drafter_dir(self, stage: str) -> Path:
        """attention: the tuned drafter; calibration: the final (calibrated) drafter."""
        return self.root / ("drafter" if stage == "calibration" else "drafter-attention")


def load_pipeline_config(path: str | Path) -> PipelineConfig:
    return load_yaml(PipelineConfig, path)


def default_drafter_dir() -> Path:
    """Where the default pipeline (configs/smollm2.yaml = the embedded defaults) puts its drafter: what
    `flexdraft generate`, the harness and the demo use when no drafter is named."""
    return PipelineConfig().drafter_dir("calibration")
