"""Policies and sweeps: a policy file decides the engine's steps by live batch size and is refused for another model
or drafter; `tuning/sweep.py` runs a 2-trial sweep of each kind on the session's Ray instance, is interrupted and
resumed, and leaves MLflow parent and child runs and a policy file; bad input stops it before any trial."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import ENV, REPO, make_tiny_hf, recorded_pipeline, write_jsonl
from flexdraft.cli.main import main
from flexdraft.core.config import RuntimeConfig, from_dict
from flexdraft.core.errors import FlexDraftError
from flexdraft.drafter.model import Drafter, DrafterConfig
from flexdraft.engine.ar import generate
from flexdraft.engine.config import EngineConfig
from flexdraft.engine.engine import Engine
from flexdraft.models.loading import load_model
from flexdraft.speculative.policy_file import Band, Policy, load_policy, save_policy
from flexdraft.speculative.sampling import SamplingParams
from flexdraft.tuning.sweep import Objective, SweepConfig, export_policy, prepare

SWEEP = [sys.executable, str(REPO / "tuning" / "sweep.py")]


def test_a_policy_decides_each_step_by_live_rows_and_output_stays_ar(tmp_path):
    """Bands: one live row -> parallel with B' = 2 and at most 2 branches; more rows -> AR. Three requests of
    different lengths drain from 3 rows to 1: every step follows its band, and every output is AR's."""
    make_tiny_hf("llama", tmp_path / "m")
    model = load_model(tmp_path / "m", RuntimeConfig(device="cpu", dtype="float32", threads=1, cpu_prepack=False),
                       with_tokenizer=False).model
    drafter = Drafter.from_target(model, DrafterConfig(k=2, block_size=4)).to_runtime(model)
    policy = Policy(switch_batch=1, bands=[Band(1, "parallel", block=2, top_m=2), Band(None, "ar")])
    engine = Engine(model, drafter, EngineConfig(mode="ar", max_batch=3, max_len=160), policy=policy)
    prompts, lengths = [[5, 9, 11, 4], [7, 3, 8], [12, 6, 30, 2, 9]], [6, 14, 40]
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, lengths)]
    seen = set()
    while engine.has_work():
        s = engine.step().stats
        if s.rows and not s.admitted:
            seen.add((s.rows > 1, s.mode, s.block, s.branches <= 2))
    assert seen == {(True, "ar", 0, True), (False, "parallel", 2, True)}
    for rid, p, n in zip(ids, prompts, lengths):
        assert engine.result(rid).token_ids == generate(model, [p], SamplingParams(max_new_tokens=n))[0].token_ids


def test_export_policy_takes_the_best_trial_of_each_band_ties_by_objective_and_skips_unfinished_trials():
    """A hand-made trial table whose winners are known: batch 1 -> trial A (adaptive, S 4); batch 4 -> a tie
    between B and C, which B wins by its better objective; batch 16 -> C. D, stopped early, was fastest at batch 1
    but is not compared. Bands cover rows up to each batch size (the last any number), each with its winner's
    settings at that size; S is the one under which every band plans as its winner did."""
    def trial(tid, params, speedups, status="measured"):
        return {"trial_id": tid, "params": params, "status": status,
                "results": {b: {"speedup": v} for b, v in speedups.items()}}

    trials = [trial("A", {"switch_batch": 4, "cost_model": True}, {1: 1.5, 4: 1.1, 16: 0.90}),
              trial("B", {"switch_batch": 1, "cost_model": False, "top_m": 2}, {1: 1.2, 4: 1.3, 16: 1.00}),
              trial("C", {"switch_batch": 0, "cost_model": False}, {1: 1.0, 4: 1.3, 16: 1.05}),
              trial("D", {"tree_nodes": 16}, {1: 2.0}, status="stopped early")]
    policy = export_policy(trials, Objective(batch_sizes=[1, 4, 16], weights=[1, 1, 1]), {}, {})
    assert policy.bands == [Band(1, "adaptive", top_m=0), Band(4, "sequential", top_m=2),
                            Band(None, "sequential", top_m=0)]
    assert policy.switch_batch == 1
    assert [policy.band(n).mode for n in (1, 3, 4, 5, 64)] == ["adaptive", "sequential", "sequential", "sequential",
                                                                 "sequential"]
    # the same winner at adjacent sizes: one band; and no trial measured everywhere: a clear error
    merged = export_policy(trials[:1], Objective(batch_sizes=[1, 4, 16], weights=[1, 1, 1]), {}, {})
    assert merged.bands == [Band(None, "adaptive")] and merged.switch_batch == 4
    with pytest.raises(FlexDraftError, match="no trial was measured at every batch size"):
        export_policy(trials[3:], Objective(batch_sizes=[1, 4, 16], weights=[1, 1, 1]), {}, {})


def _policy_for(path: Path, target: str, drafter: str) -> Path:
    return save_policy(Policy(switch_batch=2, bands=[Band(1, "parallel", block=4), Band(None, "sequential")],
                              target={"model": "tiny", "fingerprint": target},
                              drafter={"path": "init", "fingerprint": drafter, "block_size": 8}), path)


def test_generate_takes_a_policy_and_refuses_one_for_another_model_or_drafter(tmp_path, capsys, tiny_smollm2):

    fp = load_model(tiny_smollm2, RuntimeConfig(device="cpu"), with_tokenizer=False).model.fingerprint
    good = _policy_for(tmp_path / "good.yaml", fp, "init-k2-B8")
    assert load_policy(good).bands == [Band(1, "parallel", block=4), Band(None, "sequential")]  # round trip
    argv = ["generate", "--model", str(tiny_smollm2), "--drafter", "init", "--prompt", "hi", "--max-new-tokens", "4"]
    assert main([*argv, "--policy", str(good)]) == 0
    assert "policy" in capsys.readouterr().err
    for path, needle in [(_policy_for(tmp_path / "m.yaml", "0" * 16, "init-k2-B8"), "was tuned for another model"),
                         (_policy_for(tmp_path / "d.yaml", fp, "abc"), "was tuned for another drafter")]:
        assert main([*argv, "--policy", str(path)]) == 2
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1
    bad = yaml.safe_load(good.read_text())
    bad["bands"][0]["block"] = 9
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    with pytest.raises(FlexDraftError, match=r"bands\[0\].block=9: B' must be between 0 \(all\) and the drafter's"):
        load_policy(tmp_path / "bad.yaml")


@pytest.mark.parametrize("raw,needle", [
    ({"space": {}}, "empty search space"),
    ({"space": {"temperature": [0.5]}}, "space.temperature: unknown parameter (a decode sweep takes switch_batch"),
    ({"kind": "training", "space": {"top_m": [2]}}, "space.top_m is a decode-time parameter: sweep it over the "
                                                    "trained drafter"),
    ({"space": {"block": [4, 16]}}, "space.block: B' = 16 > the drafter's block size B = 8"),
    ({"kind": "training", "space": {"k": [2, 9]}}, "space.k: 9 tuned layers, but the model has"),
])
def test_bad_sweep_input_is_one_clear_error_before_any_trial(raw, needle, tiny_smollm2, tiny_pipeline):
    _, _, root = tiny_pipeline
    base = {"model": str(tiny_smollm2), "drafter": "init", "pipeline": str(root / "tiny.yaml"), "prompts": "validation"}
    with pytest.raises(FlexDraftError) as e:
        prepare(from_dict(SweepConfig, {**base, **raw}))
    assert needle in str(e.value)


def test_the_sweep_entrypoint_reports_bad_input_in_one_line_without_starting_ray(tmp_path):
    """(Whether Ray started is read from its output, not from how long the command took.)"""
    (tmp_path / "s.yaml").write_text("name: x\nspace: {foo: [1]}\n")
    p = subprocess.run([*SWEEP, "--config", str(tmp_path / "s.yaml")], env={**ENV, "FLEXDRAFT_HOME": str(tmp_path)},
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1].startswith("tuning/sweep.py: error: space.foo: unknown parameter")
    assert "Ray" not in p.stdout + p.stderr


def _interrupted_then_resumed(config: Path, home: Path, uri: str) -> subprocess.CompletedProcess:
    """Run the sweep; SIGINT (Ctrl-C) it as soon as its second trial has started; then run it with --resume."""
    env = {**ENV, "FLEXDRAFT_HOME": str(home), "MLFLOW_TRACKING_URI": uri, "RAY_ADDRESS": os.environ["RAY_ADDRESS"]}
    name = yaml.safe_load(config.read_text())["name"]
    runs = home / "sweeps" / name / "trial-runs"
    first = subprocess.Popen([*SWEEP, "--config", str(config)], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 600
    while not (runs.is_dir() and len(list(runs.iterdir())) >= 2) and first.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    first.send_signal(signal.SIGINT)
    out = first.communicate(timeout=300)[0]
    assert first.returncode == 130, out[-3000:]
    resumed = subprocess.run([*SWEEP, "--config", str(config), "--resume"], env=env, capture_output=True, text=True,
                             timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    return resumed


def _runs(uri: str, experiment: str = "flexdraft-sweeps") -> tuple:
    """-> (the sweep's parent run, its child runs, client)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    return parents[0], children, client


def test_decode_sweep_is_resumed_after_ctrl_c_and_exports_a_policy_generate_takes(ray_head, tiny_smollm2, tiny_pipeline,
                                                                                  tmp_path, mlflow_uri, capsys):
    """Two decode trials over a registered drafter (`models:/flexdraft-drafter-tiny@champion`): interrupted while
    the second runs, resumed; each trial has one nested MLflow run with its params and one objective (nothing
    measured twice); the exported policy is attached to the drafter's version, and `--policy` with the version's
    URI decodes with it."""
    from flexdraft.drafter.registry import lookup
    from flexdraft.training.register import register_drafter

    version = register_drafter(recorded_pipeline(tiny_smollm2, tmp_path, "tiny", tiny_pipeline[0].distill_dir(), 1))
    config = tmp_path / "decode.yaml"
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"messages": [{"role": "user", "content": q}]} for q in
                                                       ("Name three rivers.", "What is a prime number?")])
    config.write_text(yaml.safe_dump({
        "name": "tiny-decode", "model": str(tiny_smollm2), "drafter": "models:/flexdraft-drafter-tiny@champion",
        "threads": 1, "prompts": str(prompts),
        "space": {"switch_batch": [1, 4], "cost_model": [True, False]}, "first": [{}, {"cost_model": False}],
        "trials": 2, "time_budget_min": 10,
        "objective": {"batch_sizes": [1, 2], "weights": [1, 1], "prompts": 2, "max_new_tokens": 8}}))
    home = tmp_path / "home"
    resumed = _interrupted_then_resumed(config, home, mlflow_uri)
    root = home / "sweeps" / "tiny-decode"
    assert "2/2 trials measured" in resumed.stdout
    parent, children, client = _runs(mlflow_uri)
    assert len(children) == 2 and parent.data.metrics["best/objective"] > 0
    for child in children:
        assert set(child.data.params) == {"switch_batch", "cost_model"} and child.info.status == "FINISHED"
        assert len(client.get_metric_history(child.info.run_id, "objective")) == 1
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} >= {"results.md", "policy.yaml",
                                                                         "policy-fixed.yaml", "throughput_vs_S.png"}
    results = (root / "results.md").read_text()
    assert "Fixed threshold (S only) against the cost model" in results and f"attached to {version}" in results
    policy = load_policy(root / "policy.yaml")
    v = lookup(version)
    assert policy.drafter["fingerprint"] == v.tag("weights_digest") and policy.source["best_trial"]
    assert v.tag("policy.run_id") == parent.info.run_id and v.tag("policy.sweep") == "tiny-decode"
    assert main(["generate", "--model", str(tiny_smollm2), "--drafter", version, "--policy", version,
                 "--prompt", "hi", "--max-new-tokens", "4"]) == 0


@pytest.mark.slow
def test_training_sweep_trains_a_drafter_per_trial_under_asha_and_resumes(ray_head, tiny_pipeline, tmp_path,
                                                                         mlflow_uri):
    """Two training trials (k = 1, 2) on the tiny pipeline's data, each a Ray Train run inside its Tune trial,
    reporting validation tau as it trains (calibration skipped: its Ray Train run is the same job's, tested in
    test_jobs); interrupted while the second runs, resumed; the measured best's drafter goes into the policy
    file."""
    _, raw, _ = tiny_pipeline
    (tmp_path / "pipeline.yaml").write_text(json.dumps({**raw, "workers": {"num_workers": 1}}))  # (start-up: halved)
    config = tmp_path / "training.yaml"
    config.write_text(yaml.safe_dump({
        "name": "tiny-training", "kind": "training", "pipeline": str(tmp_path / "pipeline.yaml"), "prompts": "validation",
        "space": {"k": [1, 2]}, "first": [{"k": 2}], "trials": 2, "time_budget_min": 15,
        "trial_budget_min": 0.1, "calibration_budget_min": 0, "grace_min": 0.05, "eval_every": 5,
        "objective": {"batch_sizes": [1, 2], "weights": [1, 1], "prompts": 2, "max_new_tokens": 8}}))
    home = tmp_path / "home"
    resumed = _interrupted_then_resumed(config, home, mlflow_uri)
    results = json.loads((home / "sweeps" / "tiny-training" / "results.json").read_text())
    trials = results["trials"]
    assert sorted(t["params"]["k"] for t in trials) == [1, 2]
    assert all(t["status"] in ("measured", "stopped early") for t in trials), resumed.stdout[-3000:]
    measured = [t for t in trials if t["status"] == "measured"]
    assert measured and all(len(h) >= 2 for h in results["histories"].values())  # tau before, during, after
    parent, children, client = _runs(mlflow_uri)
    assert len(children) == 2 and {c.data.params["k"] for c in children} == {"1", "2"}
    policy = load_policy(home / "sweeps" / "tiny-training" / "policy.yaml")
    best = max(measured, key=lambda t: t["objective"])
    assert policy.drafter["path"] == best["drafter"] == results["summary"]["drafter"]
    assert Path(best["drafter"], "drafter.json").is_file()
