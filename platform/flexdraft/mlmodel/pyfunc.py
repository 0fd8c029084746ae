"""The code of a drafter's MLflow model (models-from-code: MLflow copies this file into the model and runs it to
load it; `log_model.log_drafter_model` logs it). `predict` answers chat prompts with the adaptive engine over
the drafter's target: lossless, the target's own greedy answer.

The target model is not part of the artifact: it is loaded by the name the drafter records (`base_model`:
'smollm2' is bundled; a path must exist where the model is loaded) and checked against its fingerprint.
"""
from __future__ import annotations

from pathlib import Path

import mlflow

ARTIFACT = "drafter"  # (= drafter.registry.ARTIFACT; this file must run on its own)


class DrafterModel(mlflow.pyfunc.PythonModel):
    """predict(list of user messages) -> list of answers (chat template, greedy, `max_new_tokens` param, 128)."""

    def load_context(self, context) -> None:
        self.folder = Path(context.artifacts[ARTIFACT])
        self.engine = self.lm = None

    # (no type hints: MLflow would take its signature from them, which cannot carry the `max_new_tokens` param;
    # log_model.log_drafter_model gives the signature)
    def predict(self, context, model_input, params=None):
        from flexdraft.core.config import RuntimeConfig
        from flexdraft.core.data import chat_ids
        from flexdraft.drafter.model import read_drafter_meta
        from flexdraft.engine.config import EngineConfig
        from flexdraft.engine.runner import load_engine
        from flexdraft.speculative.sampling import SamplingParams

        if self.engine is None:
            meta = read_drafter_meta(self.folder)
            self.lm, self.engine, _, _ = load_engine(meta["base_model"], RuntimeConfig(), str(self.folder),
                                                     EngineConfig(mode="adaptive"), store_spec="none")
        tok = self.lm.tokenizer
        messages = model_input.iloc[:, 0].tolist() if hasattr(model_input, "iloc") else list(model_input)
        prompts = [chat_ids(tok, [{"role": "user", "content": str(m)}]) for m in messages]
        sampling = SamplingParams(max_new_tokens=int((params or {}).get("max_new_tokens", 128)))
        return [tok.decode(g.token_ids, skip_special_tokens=True) for g in self.engine.generate(prompts, sampling)]


mlflow.models.set_model(DrafterModel())
