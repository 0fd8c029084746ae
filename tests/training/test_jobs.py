"""The Ray jobs, end to end on one shared Ray instance (started like a user would: `ray start --head`):
distill on the real model, attention tuning and calibration on a tiny model with 2 Ray Train workers +
DeepSpeed, exact resume after a worker failure, `ray job submit`, and bad input failing before any work."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ENV, RAY, REPO, make_tiny_hf
from flexdraft.core.config import from_dict
from flexdraft.core.errors import FlexDraftError
from flexdraft.drafter.recipe import PipelineConfig


def fail_once_after(step: int, marker: Path):
    """`jobs.train_func` whose workers raise once, right after reporting `step` (its checkpoint, when it makes one,
    is then saved): the failure is injected from here, through Ray Train's own `report`, not by the job's code."""
    from flexdraft.training import worker

    train_func = worker.train_func

    def failing_train_func(config: dict) -> None:
        import ray.train

        report = ray.train.report

        def report_then_fail(metrics, *args, **kwargs):
            report(metrics, *args, **kwargs)
            if metrics.get("step") == step and not marker.exists():
                marker.touch()  # once: the resumed attempt passes this step
                raise RuntimeError(f"injected failure after step {step}")

        ray.train.report = report_then_fail
        train_func(config)

    return failing_train_func


def mlflow_history(uri: str, run_id: str, key: str, values: bool = False) -> list:
    """The steps at which a run logged metric `key`, in order; values: (step, value) pairs instead."""
    from mlflow.tracking import MlflowClient

    history = sorted(MlflowClient(uri).get_metric_history(run_id, key), key=lambda m: m.step)
    return [(m.step, m.value) for m in history] if values else [m.step for m in history]


@pytest.fixture(scope="module")
def resumed_attention(ray_head, tiny_pipeline, tmp_path_factory, mlflow_db):
    """Attention tuning of the tiny config (2 workers, ZeRO-2, 6 steps, checkpoints at 3 and 6) whose workers
    raise right after the step-3 checkpoint: Ray Train restarts them from it. -> (its result, its MLflow URI)."""
    from flexdraft.training.jobs import run_training

    cfg, _, _ = tiny_pipeline
    home = tmp_path_factory.mktemp("mlflow")
    uri = mlflow_db(home)
    with pytest.MonkeyPatch.context() as mp:  # never the user's store; artifacts land relative to the cwd
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        mp.chdir(home)
        mp.setattr("flexdraft.training.trainer.train_func", fail_once_after(3, home / "attention.failed-once"))
        meta = run_training(cfg, "attention")
    return meta, uri, home


def test_attention_tuning_killed_after_a_checkpoint_resumes_exactly(resumed_attention, tiny_pipeline):
    """Attention tuning killed right after its step-3 checkpoint resumes from it and logs each step once, with
    before/after agreement."""
    cfg, _, _ = tiny_pipeline
    meta, uri, home = resumed_attention
    assert (home / "attention.failed-once").is_file()  # the failure did happen
    assert meta["steps"] == 6 and meta["checkpoint"] and Path(meta["checkpoint"]).is_dir()
    run_id = (cfg.root / f"attention-{meta['run_key']}.mlflow-run").read_text()
    assert mlflow_history(uri, run_id, "train/loss") == [3, 6]
    assert mlflow_history(uri, run_id, "eval/bonus/tau") == [0, 6]  # before and after tuning


@pytest.mark.slow
def test_budgeted_calibration_killed_after_a_checkpoint_restarts_with_the_count_it_fixed(resumed_attention,
                                                                                         tiny_pipeline, monkeypatch,
                                                                                         tmp_path):
    """Calibration (a 6 s budget: its step count is fixed at step 10), killed right after its step-12 checkpoint,
    restarts from it with the count it fixed (never fixed again), ends there with the learning rate at its floor
    (10% of lr), having logged every 4th step once (nothing repeated, nothing lost). (It needs more than 12 steps to
    fit in 6 s; the count is asserted, so a machine too slow for that fails loudly instead of passing vacuously.)"""
    from flexdraft.training.jobs import run_stage, run_training

    cfg, _, _ = tiny_pipeline
    meta, uri, home = resumed_attention
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("flexdraft.training.trainer.train_func", fail_once_after(12, tmp_path / "calibration.failed-once"))
    meta = run_training(cfg, "calibration")
    assert (tmp_path / "calibration.failed-once").is_file()
    run_id = (cfg.root / f"calibration-{meta['run_key']}.mlflow-run").read_text()
    fixed = mlflow_history(uri, run_id, "train/planned_steps", values=True)
    assert [step for step, _ in fixed] == [10]  # by the first attempt only
    steps = int(fixed[0][1])
    assert 12 < steps <= 1000 and meta["steps"] == steps
    assert mlflow_history(uri, run_id, "train/loss") == sorted({*range(4, steps + 1, 4), steps})
    assert mlflow_history(uri, run_id, "train/lr", values=True)[-1] == (steps, pytest.approx(0.1 * cfg.calibration.lr))
    assert (cfg.root / "drafter" / "drafter.safetensors").is_file()
    # a re-run with the same config reuses the result instead of training again
    assert run_stage(cfg, "calibration")["run_key"] == meta["run_key"]


def test_ray_job_submit_trains_exactly_the_drafter_of_the_resumed_run(ray_head, tiny_pipeline, resumed_attention,
                                                                      tmp_path, mlflow_db):
    """`ray job submit --working-dir . -- python jobs/attn_tuning.py --config ...` against `ray start --head`, of the
    tiny config, uninterrupted, ends with the very drafter (every tensor bitwise) of the run killed after step 3 and
    resumed from its step-3 checkpoint: a resume repeats and loses nothing, and a fresh drafter is seeded."""
    from flexdraft.drafter.model import Drafter, load_drafter
    from flexdraft.models.loading import load_model

    _, raw, _ = tiny_pipeline
    cfg = dict(raw, output_dir=str(tmp_path / "out"))
    src = from_dict(PipelineConfig, raw)
    dst = from_dict(PipelineConfig, cfg).distill_dir()
    dst.parent.mkdir(parents=True)
    dst.symlink_to(src.distill_dir())  # the tiny data, shared
    (tmp_path / "job.yaml").write_text(json.dumps(cfg))
    env = {**ENV, "MLFLOW_TRACKING_URI": mlflow_db(tmp_path)}
    proc = subprocess.run([RAY, "job", "submit", "--address", ray_head, "--working-dir", str(REPO),
                           "--runtime-env-json", json.dumps({"env_vars": {k: env[k] for k in (
                               "MLFLOW_TRACKING_URI", "TOKENIZERS_PARALLELISM")}}),
                           "--", "python", "jobs/attn_tuning.py", "--config", str(tmp_path / "job.yaml")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[attention] done" in proc.stdout and proc.stdout.count("step 6/6 loss") == 1  # once, not once per logger
    assert "injected failure" not in proc.stdout + proc.stderr
    target = load_model(src.model, with_tokenizer=False).model
    ours = load_drafter(tmp_path / "out" / "drafter-attention", target).state_dict()
    resumed = load_drafter(src.drafter_dir("attention"), target).state_dict()  # by the resumed_attention fixture
    assert ours.keys() == resumed.keys()
    for name, t in ours.items():  # calibration.up too: untrained here, it is equal only because it is seeded
        assert torch.equal(t, resumed[name]), name
    fresh = Drafter.from_target(target, src.drafter).state_dict()
    assert not torch.equal(ours["attn.1.q_proj.weight"], fresh["attn.1.q_proj.weight"])  # it did train


def test_calibration_registers_its_drafter_with_the_runs_and_data_that_made_it(resumed_attention, tiny_pipeline,
                                                                               tmp_path, monkeypatch):
    """Calibration (4 steps, 2 Ray Train workers) after the resumed attention run: its rank-0 worker logs the
    drafter as the run's MLflow model (the folder it saved, once), and the stage registers it as version 1 of
    flexdraft-drafter-model, alias champion, tagged with the attention and calibration runs, the data set's digest
    and the validation tau; both runs have the distilled data as their dataset input; a re-run keeps the version."""
    import shutil

    from mlflow.tracking import MlflowClient

    from flexdraft.drafter.registry import lookup, resolve
    from flexdraft.training.common import run_key
    from flexdraft.training.jobs import run_stage

    src, raw, _ = tiny_pipeline
    _, uri, _ = resumed_attention
    cfg = from_dict(PipelineConfig, {**raw, "output_dir": str(tmp_path / "out"),
                                     "calibration": {**raw["calibration"], "steps": 4, "time_budget_min": 0}})
    cfg.distill_dir().parent.mkdir(parents=True)
    cfg.distill_dir().symlink_to(src.distill_dir())
    attention_run = src.root / f"attention-{run_key(src, 'attention')}.mlflow-run"
    shutil.copytree(src.drafter_dir("attention"), cfg.drafter_dir("attention"))
    shutil.copy(attention_run, cfg.root / attention_run.name)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("FLEXDRAFT_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    meta = run_stage(cfg, "calibration")
    assert meta["registered"] == "models:/flexdraft-drafter-model/1" and meta["steps"] == 4
    v = lookup("models:/flexdraft-drafter-model@champion")
    calibration_run = (cfg.root / f"calibration-{meta['run_key']}.mlflow-run").read_text()
    assert v.tag("run.attention") == attention_run.read_text() and v.tag("run.calibration") == calibration_run
    assert v.tag("tau.bonus") == f"{meta['eval']['eval/bonus/tau']:.4f}" and v.tag("k") == "2"
    client = MlflowClient(uri)
    logged = client.get_logged_model(v.model_id)
    assert logged.source_run_id == calibration_run and logged.tags["flexdraft.stage"] == "calibration"
    for run_id in (attention_run.read_text(), calibration_run):
        inputs = client.get_run(run_id).inputs.dataset_inputs
        assert [i.dataset.digest for i in inputs] == [v.tag("dataset.digest")], run_id
    folder, _ = resolve(v.uri)  # the model's artifact is the folder the engine loads, byte for byte
    assert (folder / "drafter.safetensors").read_bytes() == (cfg.drafter_dir("calibration") / "drafter.safetensors").read_bytes()
    assert run_stage(cfg, "calibration")["registered"] == v.uri


@pytest.mark.slow
def test_budgeted_attention_in_a_pipeline_trains_until_the_rest_is_left(ray_head, tiny_pipeline, tmp_path,
                                                                         monkeypatch, mlflow_db):
    """Inside a pipeline of 10 minutes, an attention stage whose own budget (0.03 s) fits no more than its 10 probe
    steps trains what the deadline leaves instead: all of its 40 steps. Every worker fixes the same count, and
    checks it against the budget together after every step from step 30 on (`StepPlan.hold`: the count stays, at
    its most)."""
    import time

    from flexdraft.training.jobs import run_training

    _, raw, _ = tiny_pipeline
    cfg = from_dict(PipelineConfig, {**raw, "output_dir": str(tmp_path / "out"), "time_budget_min": 10,
                                     "attention": {**raw["attention"], "steps": 40, "time_budget_min": 0.0005,
                                                   "checkpoint_every": 20, "log_every": 20}})
    cfg.distill_dir().parent.mkdir(parents=True)
    cfg.distill_dir().symlink_to(from_dict(PipelineConfig, raw).distill_dir())
    uri = mlflow_db(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)
    meta = run_training(cfg, "attention", deadline=time.time() + 600)
    run_id = (cfg.root / f"attention-{meta['run_key']}.mlflow-run").read_text()
    assert mlflow_history(uri, run_id, "train/planned_steps", values=True) == [(10, 40)] and meta["steps"] == 40
    (_, budget_min), = mlflow_history(uri, run_id, "train/budget_min", values=True)
    # the deadline's (less calibration's budget, evaluations, start-up and the margin; at least the 1-min floor),
    # not the stage's own 0.03 s: how much less than 10 min depends on how long Ray Train took to start here
    assert 1 <= budget_min < 10


@pytest.mark.real_model
def test_distill_spends_its_time_budget_on_validation_first_and_leaves_the_rest_out(ray_head, tmp_path):
    """Self-distillation of the bundled model with a budget spent before the actors start: each of the 2 actors'
    first shard still runs (validation first, then one train shard), its answers cut after the token the prefill
    gives (finish_reason "time"); the 3 other train shards are left out, the manifest says so, and a second run
    reuses the folder."""
    import pyarrow.parquet as pq

    from flexdraft.training.jobs import run_distill

    cfg = from_dict(PipelineConfig, {"name": "d", "output_dir": str(tmp_path / "out"),
                                     "distill": {"num_prompts": 10, "validation_prompts": 2, "shard_size": 2,
                                                 "batch_size": 2, "max_new_tokens": 16, "time_budget_min": 1e-4}})
    out = run_distill(cfg)
    assert sorted(f.name for f in out.glob("*.parquet")) == ["train-00000.parquet", "validation-00000.parquet"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["shards_left_out"] == 3 and manifest["answers_cut"] == 4
    assert manifest["train"]["sequences"] == manifest["validation"]["sequences"] == 2
    for f in out.glob("*.parquet"):
        t = pq.read_table(f).to_pylist()
        assert [r["finish_reason"] for r in t] == ["time", "time"]
        assert all(len(r["input_ids"]) == r["prompt_len"] + 1 for r in t)
    before = (out / "manifest.json").stat().st_mtime_ns
    assert run_distill(cfg) == out and (out / "manifest.json").stat().st_mtime_ns == before


@pytest.mark.parametrize("change,msg", [
    ({"drafter": {"k": 9}}, "between 1 and the model's 4 layers"),
    ({"attention": {"stepz": 3}}, "unknown key"),
    ({"attention": {"steps": "many"}}, "config.attention.steps: expected int"),
    ({"distill": {"seed": 1}}, "no train data"),  # another distill config = data not made yet
    ({"attention": {"dtype": "float16"}}, "float16 is GPU-only"),
    ({"calibration": {"time_budget_min": -5}}, "config.calibration.time_budget_min must be >= 0"),
    ({"time_budget_min": -30}, "config.time_budget_min must be >= 0"),
], ids=["k-too-large", "unknown-key", "wrong-type", "missing-data", "fp16-on-cpu", "negative-budget",
        "negative-pipeline-budget"])
def test_bad_input_fails_before_any_work(tiny_pipeline, tmp_path, change, msg):
    """Each a one-line error and exit status 2 from the job entrypoint, before Ray starts."""
    _, raw, _ = tiny_pipeline
    bad = {**raw, **{k: {**raw.get(k, {}), **v} if isinstance(v, dict) else v for k, v in change.items()}}
    (tmp_path / "bad.yaml").write_text(json.dumps(bad))
    env = {k: v for k, v in ENV.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "jobs/attn_tuning.py", "--config", str(tmp_path / "bad.yaml")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert msg in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "Started a local Ray instance" not in proc.stdout + proc.stderr


def test_calibration_refuses_a_drafter_for_other_weights(tiny_pipeline, tmp_path):
    from flexdraft.drafter.model import Drafter, DrafterConfig, save_drafter
    from flexdraft.models.loading import load_model
    from flexdraft.training.trainer import preflight

    _, raw, _ = tiny_pipeline
    make_tiny_hf("llama", tmp_path / "other", seed=1)
    other = load_model(tmp_path / "other", with_tokenizer=False).model
    cfg = from_dict(PipelineConfig, {**raw, "output_dir": str(tmp_path / "out")})
    cfg.distill_dir().parent.mkdir(parents=True)
    cfg.distill_dir().symlink_to(from_dict(PipelineConfig, raw).distill_dir())
    save_drafter(Drafter.from_target(other, DrafterConfig(k=2, block_size=4)), cfg.drafter_dir("attention"),
                 "other", "0123456789abcdef")
    with pytest.raises(FlexDraftError, match="other base weights"):
        preflight(cfg, "calibration")
