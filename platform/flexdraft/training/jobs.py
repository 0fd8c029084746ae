"""The pipeline's entrypoints: one stage or all of them (`run_stage`), and `python jobs/<job>.py --config FILE`
(`job_main`). The stages: distill (`distill_job`, Ray actors), attention tuning and calibration (`trainer`: Ray
Train + DeepSpeed, workers in `worker`). Inside the library only these training modules and the Serve app
import Ray."""
from __future__ import annotations

import sys
import time

from flexdraft.core.errors import FlexDraftError
from flexdraft.drafter.recipe import PipelineConfig
from flexdraft.training.common import init_ray, log
from flexdraft.training.distill_job import run_distill
from flexdraft.training.register import register_drafter
from flexdraft.training.trainer import run_training

__all__ = ["init_ray", "job_main", "pipeline_deadline", "run_distill", "run_stage", "run_training", "shutdown_ray"]


def shutdown_ray() -> None:
    import ray

    ray.shutdown()


def pipeline_deadline(cfg: PipelineConfig) -> float | None:
    """When a pipeline starting now should end (epoch seconds), or None without a pipeline budget."""
    return time.time() + 60 * cfg.time_budget_min if cfg.time_budget_min else None


def run_stage(cfg: PipelineConfig, stage: str, deadline: float | None = None):
    """Run one stage ("distill", "attention", "calibration") or all ("pipeline"); every check that can fail
    runs before Ray starts (local) or is joined (RAY_ADDRESS). deadline: the pipeline's (`pipeline_deadline`),
    for a stage run as part of one. A calibrated drafter is registered in MLflow (`register_drafter`): the meta
    returned then holds its models:/ URI as "registered"."""
    cfg.output_dir = str(cfg.root.resolve())  # workers must not depend on their own environment for it
    if stage == "distill":
        return run_distill(cfg)
    if stage == "pipeline":
        t0, deadline = time.perf_counter(), pipeline_deadline(cfg)
        run_distill(cfg)
        run_training(cfg, "attention", deadline=deadline)
        meta = {**run_training(cfg, "calibration"), "registered": register_drafter(cfg)}
        log("pipeline", f"all stages done in {time.perf_counter() - t0:.0f}s; drafter at {cfg.drafter_dir('calibration')}"
                        f" = {meta['registered']}")
        return meta
    meta = run_training(cfg, stage, deadline=deadline)
    return {**meta, "registered": register_drafter(cfg)} if stage == "calibration" else meta


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
