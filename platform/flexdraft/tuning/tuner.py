"""The Ray Tune driver of a sweep (docs/tuning.md), in the shape of Ray's `Tuner` examples: the trial functions
(decode-time settings over one drafter; or one drafter trained per trial, a Ray Train run inside the trial, ASHA
stopping weak ones early), the `Tuner`, and `main` (the entrypoint `tuning/sweep.py` and `flexdraft sweep` run).
What a sweep measures and exports lives in `sweep` and `record`; this module is the only one importing Ray Tune.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import ray
from ray import tune
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

from flexdraft.core.config import from_dict
from flexdraft.core.errors import FlexDraftError
from flexdraft.drafter.recipe import PipelineConfig
from flexdraft.training.jobs import init_ray, run_distill, run_training
from flexdraft.tuning import record as rec
from flexdraft.tuning import sweep as sw


def _measure(cfg: sw.SweepConfig, measurer: sw.Measurer, policy, results: dict, run: rec.TrialRun, extra: dict):
    """Measure the policy at each batch size not measured yet; report (with a checkpoint of the results) after each."""
    identity = json.dumps(measurer.identity())
    for b in cfg.objective.batch_sizes:
        if b in results:
            continue
        results[b] = measurer.run(policy, b)
        metrics = sw.flat_metrics(results, cfg.objective)
        run.log(metrics)
        with tempfile.TemporaryDirectory() as d:
            Path(d, "results.json").write_text(json.dumps(results))
            tune.report({**metrics, "identity": identity, **extra}, checkpoint=tune.Checkpoint.from_directory(d))


def _restored(checkpoint) -> dict:
    """The batch sizes an interrupted attempt of this trial measured already."""
    if checkpoint is None:
        return {}
    with checkpoint.as_directory() as d:
        return {int(b): r for b, r in json.loads(Path(d, "results.json").read_text()).items()}


def _in_the_sweeps_store(parent: dict) -> None:
    """A trial runs in a Ray worker, whose environment is its node's, not the driver's: everything the trial
    tracks (its Ray Train runs, a drafter it registers) and resolves (a models:/ drafter) uses the sweep's store."""
    os.environ["MLFLOW_TRACKING_URI"] = parent["uri"]


def decode_trial(config: dict, sweep: dict, pipeline: dict, prompts: list, parent: dict) -> None:
    """One decode-time configuration over the sweep's drafter: its policy against AR at each batch size."""
    _in_the_sweeps_store(parent)
    cfg = from_dict(sw.SweepConfig, sweep)
    params = config["params"]
    with rec.TrialRun(parent, tune.get_context().get_trial_id(), params) as run:
        run.tag("ray_node", ray.get_runtime_context().get_node_id())
        measurer = sw.Measurer(cfg, cfg.drafter, prompts, cfg.model)
        _measure(cfg, measurer, sw.trial_policy(params), _restored(tune.get_checkpoint()), run, {})


def training_trial(config: dict, sweep: dict, pipeline: dict, prompts: list, parent: dict) -> None:
    """One drafter per trial: attention tuning as a Ray Train run inside the trial (its validation tau reaches Tune
    through TuneReportCallback, for ASHA), calibration (unless its budget is 0), then its throughput at the default
    decode settings. An interrupted trial resumes: finished stages are reused, an unfinished one restarts from
    its checkpoint."""
    from ray.tune.integration.ray_train import TuneReportCallback

    from flexdraft.training.register import register_drafter

    _in_the_sweeps_store(parent)
    cfg = from_dict(sw.SweepConfig, sweep)
    cfg.threads = cfg.threads or len(os.sched_getaffinity(0))  # (the trial holds no CPU: Ray's OMP_NUM_THREADS is 1)
    params, trial_id = config["params"], tune.get_context().get_trial_id()
    pipeline = sw.trial_pipeline(cfg, from_dict(PipelineConfig, pipeline), params, trial_id)
    with rec.TrialRun(parent, trial_id, params) as run:
        run.tag("ray_node", ray.get_runtime_context().get_node_id())  # (its Ray Train workers: the runs' own tags)
        results = _restored(tune.get_checkpoint())
        calibrate = cfg.calibration_budget_min > 0
        if not results:
            run_training(pipeline, "attention", callbacks=[TuneReportCallback()])
            if calibrate:
                run_training(pipeline, "calibration")
        if calibrate:  # a trial that trains to the end registers its drafter (once, also when resumed)
            run.tag("drafter_version", register_drafter(pipeline))
        drafter = str(pipeline.drafter_dir("calibration" if calibrate else "attention"))
        measurer = sw.Measurer(cfg, drafter, prompts, pipeline.model)
        _measure(cfg, measurer, sw.trial_policy({}), results, run, {"drafter": drafter})


def _trials(grid) -> tuple[list[dict], dict]:
    """ResultGrid -> plain trial dicts (params, per-batch results, objective, status) and tau histories."""
    trials, histories = [], {}
    for result in grid:
        m = result.metrics or {}
        trial_id = m.get("trial_id") or Path(result.path).name
        results: dict = {}
        for key, value in m.items():
            if key.startswith("b") and "/" in key and key[1:key.index("/")].isdigit():
                results.setdefault(int(key[1:key.index("/")]), {})[key.split("/", 1)[1]] = value
        status = "error" if result.error else "measured" if "objective" in m else "stopped early"
        trial = {"trial_id": trial_id, "params": result.config["params"], "results": results, "status": status,
                 **{k: m[k] for k in ("objective", "tau", "identity", "drafter") if k in m}}
        trials.append(trial)
        df = result.metrics_dataframe
        if df is not None and "eval/bonus/tau" in df and "step" in df:
            points = df[["step", "eval/bonus/tau"]].dropna()
            histories[trial_id] = [(int(s), float(v)) for s, v in points.itertuples(index=False)]
    return trials, histories


def run(cfg: sw.SweepConfig, prepared: sw.Prepared, resume: bool) -> dict:
    """The sweep on Ray Tune (or the rest of an interrupted one) -> `sweep.finish`'s summary."""
    root = cfg.root()
    root.mkdir(parents=True, exist_ok=True)
    (root / "sweep.json").write_text(json.dumps(asdict(cfg), indent=1))
    init_ray()
    if cfg.kind == "training":
        run_distill(prepared.pipeline)  # shared by every trial (reused when the base pipeline distilled it)
    parent = rec.parent_run(cfg, root)
    trial = decode_trial if cfg.kind == "decode" else training_trial
    # decode trials time forwards on the cores they hold; a training trial's cores go to its Ray Train workers (it
    # holds memory alone: its model for the measurement after training)
    # (threads 0: every CPU of the largest node; a trial that fits no node would wait for one forever)
    most = int(max((n["Resources"].get("CPU", 0) for n in ray.nodes() if n["Alive"]), default=0))
    cfg.threads = cfg.threads or most
    if cfg.kind == "decode" and cfg.threads > most:
        raise FlexDraftError(f"a decode trial takes {cfg.threads} CPUs (threads), but no node of the cluster has "
                             f"more than {most}: set threads in the sweep config")
    resources = {"memory": 2 ** 30} if cfg.kind == "training" else \
        {"CPU": 1, "GPU": 1} if cfg.device.startswith("cuda") else {"CPU": cfg.threads}
    trainable = tune.with_resources(tune.with_parameters(trial, sweep=asdict(cfg), pipeline=asdict(prepared.pipeline),
                                                         prompts=prepared.prompts, parent=parent), resources)
    storage = root / "ray"
    # a training trial reports its train loss more often than its validation tau: ASHA acts on the reports that
    # carry tau and passes over the others (Tune's strict check would fail the trial on them)
    os.environ["TUNE_DISABLE_STRICT_METRIC_CHECKING"] = "1"
    t0 = time.time()
    if resume:
        tuner = tune.Tuner.restore(str(storage / cfg.name), trainable, resume_errored=True)
    else:
        scheduler = FIFOScheduler() if cfg.kind == "decode" else ASHAScheduler(
            time_attr="time_total_s", metric="eval/bonus/tau", mode="max", max_t=60 * cfg.time_budget_min,
            grace_period=60 * cfg.grace_min, reduction_factor=2, stop_last_trials=False)  # (survivors: measured)
        tuner = tune.Tuner(
            trainable,
            param_space={"params": tune.grid_search(sw.trial_points(cfg, prepared.defaults))},
            tune_config=tune.TuneConfig(scheduler=scheduler, max_concurrent_trials=cfg.max_concurrent_trials,
                                        time_budget_s=60 * cfg.time_budget_min),
            run_config=tune.RunConfig(name=cfg.name, storage_path=str(storage), verbose=1,
                                      failure_config=tune.FailureConfig(max_failures=1)),
        )
    try:
        grid = tuner.fit()
        # a trial done, stopped by ASHA or failed says so, and a measured one has made its last report (its
        # "done" can be lost when Ctrl-C lands as it returns); one still running when Tune stopped before the time
        # budget was interrupted (Ctrl-C): Tune then returns normally, but nothing partial may be exported
        unfinished = [r for r in grid if not r.error and not ((r.metrics or {}).get("done") or
                                                               "objective" in (r.metrics or {}))]
        interrupted = unfinished and time.time() - t0 < 0.98 * 60 * cfg.time_budget_min
    except KeyboardInterrupt:  # (Tune re-raises it in some set-ups)
        interrupted = True
    if interrupted:
        print(f"sweep {cfg.name} interrupted: continue it with --resume", file=sys.stderr)
        sys.exit(130)
    trials, histories = _trials(grid)
    return rec.finish(cfg, root, trials, histories, parent, time.time() - t0)


def main(argv: list[str] | None = None, prog: str = "flexdraft sweep") -> None:
    parser = argparse.ArgumentParser(prog=prog, description="FlexDraft sweep on Ray Tune")
    parser.add_argument("--config", required=True, help="sweep YAML (tuning/configs/decode.yaml, training.yaml)")
    parser.add_argument("--drafter", help="decode sweeps: the drafter to sweep over (a folder, models:/NAME@ALIAS or "
                                          "models:/NAME/VERSION, or init)")
    parser.add_argument("--resume", action="store_true", help="continue the interrupted sweep of this name")
    args = parser.parse_args(argv)
    try:
        cfg = sw.load_sweep_config(args.config)
        if args.drafter:
            if cfg.kind != "decode":
                raise FlexDraftError("--drafter is for decode sweeps (a training sweep trains its own)")
            cfg.drafter = args.drafter
        prepared = sw.prepare(cfg)  # every check that can fail, before Ray starts
        saved = cfg.root() / "sweep.json"
        if saved.is_file() and not args.resume:
            raise FlexDraftError(f"sweep {cfg.name} exists ({cfg.root()}): --resume continues it; or give another name")
        if args.resume and not saved.is_file():
            raise FlexDraftError(f"nothing to resume: no sweep {cfg.name} in {cfg.root()}")
        if args.resume and json.loads(saved.read_text()) != asdict(cfg):
            raise FlexDraftError(f"sweep {cfg.name} was started with another config ({saved}); resume it with that one")
        summary = run(cfg, prepared, args.resume)
    except FlexDraftError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"sweep {cfg.name}: {summary['measured']}/{summary['trials']} trials measured; results "
          f"{cfg.root() / 'results.md'}" + (f"; best {summary['best']} (objective {summary['objective']:.3f}); policy "
                                           f"{summary['policy']}" if "policy" in summary else
                                           "; no trial was measured at every batch size: nothing exported"))


if __name__ == "__main__":
    main()
