"""What the training jobs share: the stages, their logging, the run key, and Ray's start-up."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict

from flexdraft.core import logs
from flexdraft.drafter.model import FORMAT
from flexdraft.drafter.recipe import PipelineConfig, TrainConfig

STAGES = ("attention", "calibration")


def log(stage: str, msg: str) -> None:
    logs.get(stage).info(msg)  # not print: Ray Train patches it in workers, and each line showed twice


def model_args(cfg: PipelineConfig):
    from flexdraft.models.config import ModelArgs
    from flexdraft.models.loading import resolve_source

    folder = resolve_source(cfg.model)
    return ModelArgs.from_hf_config(json.loads((folder / "config.json").read_text()))


def stage_config(cfg: PipelineConfig, stage: str) -> TrainConfig:
    return cfg.attention if stage == "attention" else cfg.calibration


def run_key(cfg: PipelineConfig, stage: str) -> str:
    """Identifies a training run: the same key resumes, any config change starts afresh."""
    # the drafter format too: after a format change (e.g. 3: a known bonus takes the target's path) no stage
    # may resume from an older format's Ray Train checkpoint
    parts = [cfg.model, asdict(cfg.drafter), asdict(stage_config(cfg, stage)), asdict(cfg.distill),
             cfg.workers.num_workers, FORMAT, cfg.time_budget_min]
    if stage == "calibration":
        parts.append(asdict(cfg.attention))
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:10]


def init_ray() -> None:
    """Join the cluster named by RAY_ADDRESS (set under `ray job submit`), else start a local one."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=True)
    ray.data.DataContext.get_current().enable_progress_bars = False  # the jobs print their own progress
