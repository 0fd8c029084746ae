"""Tracking records config, commit and hardware; configs are strict dataclasses."""
import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from flexdraft.config import RuntimeConfig, from_dict
from flexdraft.errors import FlexDraftError


def test_run_records_config_commit_and_hardware(mlflow_uri):
    import mlflow

    from flexdraft.tracking import start_run

    with start_run("unit-test", {"model": "tiny", "runtime": {"threads": 1}}) as run:
        mlflow.log_metric("tokens_per_s", 12.5)
    got = mlflow.MlflowClient(mlflow_uri).get_run(run.info.run_id)
    assert got.data.params == {"model": "tiny", "runtime.threads": "1"}
    assert got.data.metrics["tokens_per_s"] == 12.5
    tags = got.data.tags
    assert tags["git_commit"] != "" and tags["hw.cpu_count"].isdigit() and tags["hw.torch"].startswith("2.")
    assert "hw.cpu" in tags


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
    float field becomes a float (the shipped YAML then hashes to the embedded defaults' run keys: `make demo`
    and `flexdraft pipeline --config configs/smollm2.yaml` share their results), and unknown keys or wrong
    types name the key."""
    cfg = from_dict(Outer, {"name": "y", "inner": {"lr": 1, "layers": [1, 2]}})
    assert cfg.inner.lr == 1 and isinstance(cfg.inner.lr, float) and cfg.inner.layers == [1, 2]
    from flexdraft.jobs import run_key
    from flexdraft.pipeline import PipelineConfig, load_pipeline_config

    shipped = load_pipeline_config(Path(__file__).resolve().parents[1] / "configs" / "smollm2.yaml")
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
    assert RuntimeConfig(device="cpu").torch_dtype().is_floating_point


def test_every_shipped_config_loads(real_folder):
    """configs/**/*.yaml stay valid as the dataclasses change, strictly loaded: pipeline configs (drafter checked
    against SmolLM2) and the harness configs of configs/bench/, which equal the embedded defaults where they
    claim to."""
    import json
    from pathlib import Path

    from flexdraft.harness import HarnessConfig, load_harness_config
    from flexdraft.models.config import ModelArgs
    from flexdraft.pipeline import PipelineConfig, load_pipeline_config

    args = ModelArgs.from_hf_config(json.loads((real_folder / "config.json").read_text()))
    configs = Path(__file__).parents[1] / "configs"
    bench = sorted((configs / "bench").glob("*.yaml"))
    pipelines = sorted(set(configs.rglob("*.yaml")) - set(bench))
    assert len(pipelines) >= 4 and {f.name for f in bench} >= {"default.yaml", "full.yaml", "gpu.yaml"}
    for f in pipelines:
        load_pipeline_config(f).drafter.check(args)
    for f in bench:
        load_harness_config(f)
    assert load_harness_config(configs / "bench" / "default.yaml") == HarnessConfig()
    assert load_pipeline_config(configs / "smollm2.yaml") == PipelineConfig()


def test_pipeline_deadline_leaves_the_rest_its_time_and_the_stage_what_is_left():
    """Attention tuning's budget in a pipeline: the time to the deadline less what the rest needs (its final
    evaluation and calibration's, as long as its first; calibration's start-up, as long as its own; calibration's
    budget; 5% of the pipeline's budget), more than its own 12 min on a fast machine, less on a slow one (the
    pipeline's budget wins), and never under a minute."""
    from flexdraft.jobs import MIN_BUDGET_S, deadline_budget
    from flexdraft.pipeline import PipelineConfig

    cfg = PipelineConfig()  # 30 min in all; attention 12 on its own, calibration 3
    # the stage launched at t = 100 s, evaluated for 30 s, its steps start at t = 160 s: start-up 30 s
    reserve = 2 * 30 + 30 + 3 * 60 + 0.05 * 30 * 60
    left = deadline_budget(cfg, deadline=1900.0, launched=100.0, train_start=160.0, eval_s=30.0)
    assert left == 1900 - 160 - reserve and left > 12 * 60
    # a slow machine's distill and start-up left 10 min to the deadline: under the stage's own 12
    assert deadline_budget(cfg, deadline=760.0, launched=100.0, train_start=160.0, eval_s=30.0) == 600 - reserve
    # nothing left: a minute, so the stage still makes a drafter
    assert deadline_budget(cfg, deadline=200.0, launched=100.0, train_start=160.0, eval_s=30.0) == MIN_BUDGET_S == 60


def test_a_pace_that_drifts_moves_the_step_count_and_the_schedule_follows_without_a_jump():
    """A 15-min budget fixed at 2 s/step (450 steps); 200 steps later the machine runs at 2.6 s/step: the count
    drops to what the rest of the budget fits, the learning rate goes on from the rate it had reached and is at
    its floor (10%) on the new last step. A pace within 3% of the plan changes nothing, a faster one adds steps
    up to the config's most, and a plan restored from a checkpoint's state gives the same schedule."""
    from flexdraft.jobs import StepPlan, _lr_lambda
    from flexdraft.pipeline import TrainConfig

    tc = TrainConfig(steps=1500, time_budget_min=15, warmup_steps=10)
    plan = StepPlan(tc)
    lr = _lr_lambda(tc, plan)
    plan.fix(10, 2.0)
    assert plan.steps == 450
    assert not plan.hold(200, 400.0, 2.05)  # 250 x 2.05 s = 512.5 s for the 500 s left: within 3% of 900 s
    before = [lr(s) for s in range(451)]
    assert plan.hold(200, 420.0, 2.6)  # 480 s left at 2.6 s/step: 184 more steps, not 250
    assert plan.steps == 384 and plan.replans == [(200, 384)]
    after = [lr(s) for s in range(385)]
    assert after[:200] == before[:200]  # the steps taken keep their rates; step 200's is where the new cosine starts
    assert after[200] == pytest.approx(before[200])
    assert after[384] == pytest.approx(0.1) and min(after[201:]) == pytest.approx(0.1)
    assert all(a > b for a, b in zip(after[200:383], after[201:384]))  # still falling, and faster than planned
    assert all(a < b for a, b in zip(after[201:384], before[201:384]))

    assert plan.hold(300, 600.0, 1.0)  # then much faster: 300 s left buys 300 more steps
    assert plan.steps == 600 and lr(600) == pytest.approx(0.1) and lr(300) == pytest.approx(after[300])
    restored = StepPlan(tc)
    restored.restore(json.loads(json.dumps(plan.state())))  # as a checkpoint's client state
    assert [_lr_lambda(tc, restored)(s) for s in range(601)] == [lr(s) for s in range(601)]
    most = StepPlan(TrainConfig(steps=500, time_budget_min=15))
    most.fix(10, 2.0)  # 450 steps; then 1 s/step: the rest would fit 680, the config allows 500
    assert most.hold(200, 220.0, 1.0) and most.steps == 500
