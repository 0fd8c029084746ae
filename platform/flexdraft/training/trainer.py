"""The driver of a training stage: every check that can fail before work starts (`preflight`), then Ray Train's
`TorchTrainer` over `worker.train_func`, reusing a finished result and resuming an interrupted run."""
from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

from flexdraft.core.config import RuntimeConfig
from flexdraft.core.errors import FlexDraftError
from flexdraft.drafter.recipe import PipelineConfig
from flexdraft.training.common import STAGES, init_ray, log, model_args, run_key, stage_config
from flexdraft.training.worker import WorkerArgs, train_func


def preflight(cfg: PipelineConfig, stage: str) -> dict[str, list[Path]]:
    """Every check that can fail before work starts: drafter config vs the model, data, the tuned drafter."""
    import pyarrow.parquet as pq

    from flexdraft.core.data import read_split

    if stage not in STAGES:
        raise FlexDraftError(f"unknown training stage {stage!r}: {' or '.join(STAGES)}")
    cfg.drafter.check(model_args(cfg))
    if not cfg.workers.use_gpu:  # (a driver on a cluster may have no GPU of its own: GPU dtypes are checked there)
        RuntimeConfig(device="cpu", dtype=stage_config(cfg, stage).dtype).torch_dtype()

    files = {split: read_split(cfg.distill_dir(), split) for split in ("train", "validation")}
    for split, paths in files.items():
        if sum(pq.ParquetFile(f).metadata.num_rows for f in paths) == 0:
            raise FlexDraftError(f"the {split} data in {cfg.distill_dir()} is empty")
    if stage == "calibration":
        from flexdraft.drafter.model import read_drafter_meta
        from flexdraft.models.loading import load_model

        meta = read_drafter_meta(cfg.drafter_dir("attention"))
        target = load_model(cfg.model, RuntimeConfig(device="cpu", dtype="float32", cpu_prepack=False),
                            with_tokenizer=False).model
        if meta["base_fingerprint"] != target.fingerprint:
            raise FlexDraftError(f"the drafter in {cfg.drafter_dir('attention')} was trained for other base weights "
                                 f"({meta['base_model']}) than {cfg.model}")
        if meta.get("run_key") != run_key(cfg, "attention"):
            raise FlexDraftError(f"the drafter in {cfg.drafter_dir('attention')} was tuned with another config: "
                                 "run attention tuning with this config first")
    return files


def _finished(out: Path, stage: str, key: str) -> dict:
    """The drafter.json of a stage already trained into `out` with this run key, else {}."""
    from flexdraft.drafter.model import read_drafter_meta

    try:
        done = read_drafter_meta(out) if (out / "drafter.json").is_file() else {}
    except FlexDraftError as e:  # e.g. calibrated by an older FlexDraft (its run key differs too): trained afresh
        log(stage, f"not reusing {out}: {e}")
        return {}
    if done.get("run_key") != key:
        return {}
    log(stage, f"reusing {out} (trained earlier with this config)")
    return done


def run_training(cfg: PipelineConfig, stage: str, deadline: float | None = None, callbacks: list | None = None):
    """Fit one stage with TorchTrainer; reuses a finished result and resumes an interrupted run. deadline: when
    the pipeline this stage runs in should end (epoch seconds; `deadline_budget`). callbacks: Ray Train callbacks
    (a sweep's trial passes Tune's `TuneReportCallback`)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray
    from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from flexdraft.core.tracking import start_run, tracking_uri
    from flexdraft.drafter.model import read_drafter_meta

    launched = time.time()  # the stage's start-up runs from here to its first step
    files = preflight(cfg, stage)
    init_ray()
    key = run_key(cfg, stage)
    out = cfg.drafter_dir(stage)
    done = _finished(out, stage, key)
    if done:
        return done
    run_file = cfg.root / f"{stage}-{key}.mlflow-run"
    run_id = run_file.read_text().strip() if run_file.is_file() else None
    with start_run(cfg.mlflow_experiment, {"stage": stage, "run_key": key, **asdict(cfg)},
                   run_name=f"{cfg.name}-{stage}", run_id=run_id) as run:
        run_file.parent.mkdir(parents=True, exist_ok=True)
        run_file.write_text(run.info.run_id)
        if run_id is None:  # the data this stage trains on, as the run's dataset input
            import mlflow

            from flexdraft.training.register import distilled_dataset

            mlflow.log_input(distilled_dataset(cfg.distill_dir()), context="training")
    log(stage, f"{'resuming' if run_id else 'starting'} {cfg.workers.num_workers} workers; MLflow run {run.info.run_id}")
    w = cfg.workers
    trainer = TorchTrainer(
        train_func,
        train_loop_config=WorkerArgs(cfg, stage, key, tracking_uri(), run.info.run_id,
                                     deadline if stage == "attention" else None, launched).to_config(),
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
