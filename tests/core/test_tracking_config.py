"""Tracking records config, commit and hardware; configs are strict dataclasses."""
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from conftest import REPO
from flexdraft.core.config import RuntimeConfig, from_dict
from flexdraft.core.errors import FlexDraftError
from flexdraft.core.hardware import probe


def test_run_records_config_commit_and_hardware(mlflow_uri):
    """A run holds its flattened config, the commit and the hardware; its experiment is of the kind MLflow's UI
    opens on runs and metrics (not GenAI traces), and keeps its artifacts beside the SQLite store the user named
    (not in MLflow's default ./mlruns of whatever folder the process runs in)."""
    import os
    import subprocess

    import mlflow

    from flexdraft.core.tracking import start_run

    with start_run("unit-test", {"model": "tiny", "runtime": {"threads": 1}}) as run:
        pass
    got = mlflow.MlflowClient(mlflow_uri).get_run(run.info.run_id)
    assert got.data.params == {"model": "tiny", "runtime.threads": "1"}
    tags = got.data.tags
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert tags["git_commit"].removesuffix("-dirty") == os.environ.get("FLEXDRAFT_GIT_COMMIT", head)
    assert tags["hw.cpu_count"] == str(os.cpu_count()) and tags["hw.torch"] == torch.__version__
    model_name = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    assert tags["hw.cpu"] == model_name
    exp = mlflow.MlflowClient(mlflow_uri).get_experiment(got.info.experiment_id)
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    store = Path(mlflow_uri.removeprefix("sqlite:///"))
    assert exp.artifact_location == (store.parent / "mlartifacts").as_uri()


def test_processes_opening_a_new_store_at_once_all_get_it(tmp_path):
    """Three processes (replicas starting together) create the same new SQLite store and the same experiment at
    once: each gets the store and one shared experiment, none fails in MLflow's schema migration."""
    import subprocess
    import sys

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    code = ("from mlflow.tracking import MlflowClient; from flexdraft.core.tracking import experiment_id, ready_store; "
            f"print(experiment_id(MlflowClient(ready_store({uri!r})), 'flexdraft-serve'))")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err[-2000:] for _, err in outs]
    assert len({out.strip() for out, _ in outs}) == 1


@dataclass
class Inner:
    lr: float = 1e-3
    layers: list[int] = field(default_factory=list)


@dataclass
class Outer:
    name: str = "x"
    inner: Inner = field(default_factory=Inner)


def test_config_from_dict_nested_and_strict():
    """Nested sections fill their missing keys from the field's default (not the nested class's), an int for a
    float field becomes a float (the shipped YAML then hashes to the embedded defaults' run keys: `flexdraft
    pipeline` with and without `--config configs/smollm2.yaml` share their results, which `make demo` then uses),
    and unknown keys or wrong types name the key."""
    cfg = from_dict(Outer, {"name": "y", "inner": {"lr": 1, "layers": [1, 2]}})
    assert cfg.inner.lr == 1 and isinstance(cfg.inner.lr, float) and cfg.inner.layers == [1, 2]
    from flexdraft.drafter.recipe import PipelineConfig, load_pipeline_config
    from flexdraft.training.common import run_key

    shipped = load_pipeline_config(REPO / "configs" / "smollm2.yaml")
    for stage in ("attention", "calibration"):
        assert run_key(shipped, stage) == run_key(PipelineConfig(), stage)

    cfg = from_dict(PipelineConfig, {"calibration": {"lr": 3e-3}})
    assert cfg.calibration.lr == 3e-3 and cfg.calibration.steps == PipelineConfig().calibration.steps == 200
    with pytest.raises(FlexDraftError, match=r"config.inner: unknown key\(s\) lrr"):
        from_dict(Outer, {"inner": {"lrr": 1}})
    with pytest.raises(FlexDraftError, match=r"config.inner.lr: expected float, got 'fast'"):
        from_dict(Outer, {"inner": {"lr": "fast"}})
    with pytest.raises(FlexDraftError, match=r"config.inner.layers"):
        from_dict(Outer, {"inner": {"layers": [1, "a"]}})


def test_runtime_refuses_fp16_on_cpu_and_unknown_device():
    with pytest.raises(FlexDraftError, match="float16 is GPU-only"):
        RuntimeConfig(device="cpu", dtype="float16").torch_dtype()
    with pytest.raises(FlexDraftError, match="cpu_attention must be auto, sdpa or math, got 'flash'"):
        RuntimeConfig(device="cpu", cpu_attention="flash").apply()
    # auto: bf16 only where this CPU has it natively (emulated bf16 is slower than fp32)
    native = probe().native_bf16("cpu")
    assert RuntimeConfig(device="cpu").torch_dtype() == (torch.bfloat16 if native else torch.float32)


def test_every_shipped_config_loads(real_folder):
    """The packaged configs stay valid as the dataclasses change, strictly loaded: pipeline configs (drafter checked
    against SmolLM2), the harness configs of configs/bench/, which equal the embedded defaults where they claim to,
    the sweeps', the Serve config's user_config and the local cluster's."""
    import json

    from flexdraft.drafter.recipe import PipelineConfig, load_pipeline_config
    from flexdraft.evaluation.harness import HarnessConfig, load_harness_config
    from flexdraft.models.config import ModelArgs

    args = ModelArgs.from_hf_config(json.loads((real_folder / "config.json").read_text()))
    from flexdraft.cluster.local import load_cluster_config
    from flexdraft.core.config import CONFIGS, from_dict, read_yaml
    from flexdraft.serving.config import ServeConfig
    from flexdraft.tuning.sweep import load_sweep_config

    configs = REPO / "configs"
    assert configs.resolve() == CONFIGS  # the repository's configs/ is the package's
    bench = sorted((configs / "bench").glob("*.yaml"))
    pipelines = sorted([*configs.glob("*.yaml"), *(configs / "ablations").glob("*.yaml")])
    for f in (configs / "sweeps").glob("*.yaml"):
        load_sweep_config(f)
    from_dict(ServeConfig, read_yaml("serve/config.yaml")["applications"][0]["deployments"][0]["user_config"])
    assert len(load_cluster_config().ray.nodes) == 2  # (the packaged default, found from any directory)
    assert len(pipelines) >= 4 and {f.name for f in bench} >= {"default.yaml", "full.yaml", "gpu.yaml"}
    for f in pipelines:
        load_pipeline_config(f).drafter.check(args)
    for f in bench:
        load_harness_config(f)
    assert load_harness_config(configs / "bench" / "default.yaml") == HarnessConfig()
    assert load_pipeline_config(configs / "smollm2.yaml") == PipelineConfig()
