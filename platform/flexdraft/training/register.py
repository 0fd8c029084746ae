"""The pipeline's side of the model registry: the distilled data as an MLflow dataset, each stage's drafter as
the stage run's MLflow model, and the final drafter as a version of `flexdraft-drafter-<target>` tagged with its
lineage (data, the three runs, code, hardware) and validation tau."""
from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

from flexdraft.core.errors import FlexDraftError
from flexdraft.drafter.recipe import PipelineConfig
from flexdraft.training.common import log, run_key

TAU_KEYS = {"bonus": "eval/bonus/tau", "mask": "eval/mask/tau", "mask_calibrated": "eval/mask_calibrated/tau",
            "tree8": "eval/bonus/tau_tree8", "tree16": "eval/bonus/tau_tree16"}


def distilled_dataset(folder: Path):
    """The distilled data set as an MLflow dataset: its folder as source, a digest of its files, its size per
    split (sequences; answer tokens from the manifest when the distill job wrote one) as profile."""
    import pyarrow.parquet as pq
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset

    from flexdraft.core.data import read_split

    manifest = json.loads((folder / "manifest.json").read_text()) if (folder / "manifest.json").is_file() else {}
    profile, h = {}, hashlib.sha256()
    for split in ("train", "validation"):
        files = read_split(folder, split)
        for f in files:
            h.update(f"{f.name}:{f.stat().st_size}".encode())
        profile[split] = {"sequences": sum(pq.ParquetFile(f).metadata.num_rows for f in files),
                          **({"answer_tokens": manifest[split]["answer_tokens"]} if split in manifest else {})}

    class Distilled(MetaDataset):
        @property
        def profile(self):
            return profile

    with warnings.catch_warnings():  # (MLflow registers the file:// source twice and says so)
        warnings.simplefilter("ignore")
        source = resolve_dataset_source(folder.resolve().as_uri())
    return Distilled(source, name=f"distill-{folder.name}", digest=h.hexdigest()[:10])


def log_stage_model(folder: Path, stage: str, final: dict, data: Path | None = None, step: int = 0) -> str:
    """A finished stage's drafter as the active run's MLflow model, its final evaluation `final` logged at `step`
    and linked to it -> its LoggedModel id. data: the distilled data folder, whose validation split `final` was
    measured on (linked as the metrics' dataset)."""
    from flexdraft.drafter.model import read_drafter_meta
    from flexdraft.drafter.registry import weights_digest
    from flexdraft.mlmodel.log_model import log_drafter_model

    meta = read_drafter_meta(folder)
    params = {**meta["config"], "stage": stage, "base_model": meta["base_model"],
              "base_fingerprint": meta["base_fingerprint"], "format": meta["format"]}
    return log_drafter_model(folder, params, {k: float(v) for k, v in final.items()},
                             {"flexdraft.stage": stage, "flexdraft.weights_digest": weights_digest(folder)},
                             distilled_dataset(data) if data is not None else None, step)


def stage_run_id(cfg: PipelineConfig, stage: str) -> str:
    path = cfg.root / f"{stage}-{run_key(cfg, stage)}.mlflow-run"
    if not path.is_file():
        raise FlexDraftError(f"no MLflow run recorded for the {stage} stage of {cfg.name} ({path}): run that stage first")
    return path.read_text().strip()


def register_drafter(cfg: PipelineConfig) -> str:
    """Register the pipeline's calibrated drafter as a version of `flexdraft-drafter-<target>` (once: a drafter
    already registered keeps its version) -> its models:/NAME/VERSION URI. The first version also gets the alias
    `champion`, so `models:/NAME@champion` names a drafter from the start."""
    import mlflow

    from flexdraft.core.tracking import git_commit, hardware, ready_store
    from flexdraft.drafter.model import read_drafter_meta
    from flexdraft.drafter.registry import SCHEME, TAG, registered_name, weights_digest

    folder = cfg.drafter_dir("calibration")
    meta = read_drafter_meta(folder)
    mlflow.set_tracking_uri(ready_store())
    client = mlflow.MlflowClient()
    runs = {s: stage_run_id(cfg, s) for s in ("attention", "calibration")}
    manifest = cfg.distill_dir() / "manifest.json"
    runs["distill"] = json.loads(manifest.read_text()).get("mlflow_run_id", "") if manifest.is_file() else ""
    calibration = client.get_run(runs["calibration"])
    model_id = calibration.data.tags.get("flexdraft.model_id")
    if not model_id:  # trained before drafters were MLflow models: log it now, into its own run
        with mlflow.start_run(run_id=runs["calibration"]):
            model_id = log_stage_model(folder, "calibration", meta.get("eval", {}), cfg.distill_dir(),
                                       int(meta.get("steps", 0)))
            mlflow.set_tag("flexdraft.model_id", model_id)
    name = registered_name(meta["base_model"])
    if client.search_registered_models(f"name='{name}'"):
        for mv in client.search_model_versions(f"name='{name}'", max_results=1000):
            if (getattr(mv, "model_id", None) or mv.source.removeprefix(SCHEME)) == model_id:
                uri = f"{SCHEME}{name}/{mv.version}"
                log("registry", f"drafter already registered as {uri}")
                return uri
    else:
        client.create_registered_model(name, tags={TAG + "base_model": meta["base_model"]},
                                       description=f"FlexDraft drafters for {meta['base_model']} "
                                                   f"(target weights fingerprint {meta['base_fingerprint']})")
    ev = meta.get("eval", {})
    dataset = distilled_dataset(cfg.distill_dir())
    tags = {"base_model": meta["base_model"], "base_fingerprint": meta["base_fingerprint"],
            "format": meta["format"], **{k: meta["config"][k] for k in ("k", "block_size", "entry_layer")},
            **{f"tau.{k}": f"{ev[key]:.4f}" for k, key in TAU_KEYS.items() if key in ev},
            **{f"run.{s}": r for s, r in runs.items() if r},
            "dataset.name": dataset.name, "dataset.digest": dataset.digest, "dataset.source": dataset.source.uri,
            "dataset.sequences": sum(split["sequences"] for split in dataset.profile.values()),
            "pipeline": cfg.name, "weights_digest": weights_digest(folder), "trained_steps": meta.get("steps", ""),
            # what the calibration run recorded (its code and machine), not what registers it
            "git_commit": calibration.data.tags.get("git_commit") or git_commit(),
            "hw.cpu": calibration.data.tags.get("hw.cpu") or hardware()["cpu"]}
    # (mlflow.register_model, not the client's create_model_version: it also links the LoggedModel to the version)
    mv = mlflow.register_model(f"{SCHEME}{model_id}", name, tags={TAG + k: str(v) for k, v in tags.items()})
    client.update_model_version(name, mv.version, description=f"pipeline {cfg.name}: k={meta['config']['k']}, "
                                f"B={meta['config']['block_size']}, validation tau "
                                f"{ev.get(TAU_KEYS['bonus'], float('nan')):.2f} (bonus known)")
    uri = f"{SCHEME}{name}/{mv.version}"
    if "champion" not in (client.get_registered_model(name).aliases or {}):
        client.set_registered_model_alias(name, "champion", mv.version)
        log("registry", f"drafter registered as {uri} (alias champion: the first version of {name})")
    else:
        log("registry", f"drafter registered as {uri}; promote it with `flexdraft drafters promote {uri} --alias champion`")
    return uri
