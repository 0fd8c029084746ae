"""MLflow tracking: an embedded SQLite store under the data dir by default (MLFLOW_TRACKING_URI overrides).

Every run records its config (flattened params + the whole config as a JSON artifact), the git commit and
the hardware it ran on.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import platform
import subprocess
from pathlib import Path

import torch

from flexdraft.core.config import data_dir
from flexdraft.core.hardware import probe


def tracking_uri() -> str:
    """MLFLOW_TRACKING_URI, else the SQLite store under the data dir. (Also turns off MLflow's artifact progress
    bars unless asked for: model logs and downloads would print one per file into every log.)"""
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{data_dir() / 'mlflow.db'}"


def ready_store(uri: str | None = None) -> str:
    """-> the tracking URI (default: `tracking_uri()`) with its store created. A SQLite store's tables are created
    or migrated under a file lock: processes that open a new store at once (Serve replicas starting together)
    would otherwise run the same schema migration twice and fail."""
    uri = uri or tracking_uri()
    if uri.startswith("sqlite:///"):
        from mlflow.tracking import MlflowClient

        path = Path(uri.removeprefix("sqlite:///"))
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(f"{path}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            MlflowClient(uri).search_experiments(max_results=1)
    return uri


# MLflow 3's UI opens an experiment of this kind on its runs, metrics and artifacts (model training), not on the
# traces and evaluations of GenAI apps
KIND_TAG, KIND = "mlflow.experimentKind", "custom_model_development"


def experiment_id(client, name: str) -> str:
    """The id of experiment `name`, created when missing (by whichever process gets there first). Artifacts go to a
    tracking server's own artifact store; without a server, beside a SQLite store (else under the data dir), never
    MLflow's default `./mlruns` in whatever folder the process runs in."""
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(name)
    if exp is not None:
        if exp.tags.get(KIND_TAG) != KIND:  # (made by an earlier FlexDraft)
            client.set_experiment_tag(exp.experiment_id, KIND_TAG, KIND)
        return exp.experiment_id
    uri = client.tracking_uri
    database = Path(uri.removeprefix("sqlite:///")).parent if uri.startswith("sqlite:///") else data_dir()
    artifacts = None if uri.startswith(("http://", "https://", "databricks")) else (database / "mlartifacts").as_uri()
    try:
        return client.create_experiment(name, artifact_location=artifacts, tags={KIND_TAG: KIND})
    except MlflowException:  # created meanwhile by another process
        return client.get_experiment_by_name(name).experiment_id


def ui_command() -> str:
    """The command that opens this store in MLflow's UI, without the job consumers `mlflow ui` forks by default
    (they outlive a Ctrl-C of the UI); empty for a tracking server, which is its own UI."""
    uri = tracking_uri()
    if uri.startswith(("http://", "https://")):
        return ""
    return f"MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false mlflow ui --backend-store-uri {uri}"


def experiment_links(names: list[str], ui: str = "http://127.0.0.1:5000") -> dict[str, str]:
    """{name: its runs page} for the experiments of `names` the store has: links that open on the runs table
    (MLflow 3's UI otherwise opens a fresh browser on its GenAI view). A tracking server is its own UI."""
    from mlflow.tracking import MlflowClient

    uri = tracking_uri()
    ui = uri.rstrip("/") if uri.startswith(("http://", "https://")) else ui
    client = MlflowClient(uri)
    found = {n: client.get_experiment_by_name(n) for n in names}
    return {n: f"{ui}/#/experiments/{e.experiment_id}/runs?workflowType=machine_learning"
            for n, e in found.items() if e is not None}


def git_commit() -> str:
    """The commit of the source tree (FLEXDRAFT_GIT_COMMIT wins, e.g. for a Ray job's copied working dir)."""
    if os.environ.get("FLEXDRAFT_GIT_COMMIT"):
        return os.environ["FLEXDRAFT_GIT_COMMIT"]
    src = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=src, capture_output=True, text=True,
                                timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=src,
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (commit + ("-dirty" if dirty else "")) if commit else "unknown"


def hardware() -> dict[str, str]:
    caps = probe()
    info = {
        "cpu": caps.cpu_name,
        "cpu_isa": caps.cpu_isa,
        "native_bf16": str(caps.cpu_bf16),
        "prepack_dtypes": ",".join(caps.prepack),
        "cpu_count": str(os.cpu_count()),
        "torch_threads": str(torch.get_num_threads()),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = str(torch.cuda.device_count())
    return info


def flatten(d: dict, prefix: str = "") -> dict[str, str]:
    flat = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            flat.update(flatten(v, key + "."))
        else:
            flat[key] = str(v)[:6000]  # MLflow's param value limit
    return flat


@contextlib.contextmanager
def start_run(experiment: str, config: dict, run_name: str | None = None, run_id: str | None = None):
    """`with start_run("ar-benchmark", cfg) as run:` -> an active MLflow run with config, commit, hardware.
    run_id: reopen that run (a resumed job) instead of starting a new one."""
    import mlflow

    mlflow.set_tracking_uri(ready_store())
    mlflow.set_experiment(experiment_id=experiment_id(mlflow.MlflowClient(), experiment))
    if run_id is not None:
        with mlflow.start_run(run_id=run_id) as run:
            yield run
        return
    with mlflow.start_run(run_name=run_name) as run:
        mlflow.log_params(flatten(config))
        mlflow.set_tags({"git_commit": git_commit(), **{f"hw.{k}": v for k, v in hardware().items()}})
        mlflow.log_dict(config, "config.json")
        yield run
