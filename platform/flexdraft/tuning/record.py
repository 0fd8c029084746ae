"""What a sweep records: its MLflow run with a nested run per trial, results.md / results.json, the plots, and the
policy files it exports (`finish`). Tables and plots read plain trial dicts: {"trial_id", "params", "results":
{batch: {"speedup", "tok_s", "ar_tok_s", "tau", ...}}, "status", and once measured at every batch size
"objective", "tau", "identity"}."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict
from pathlib import Path

from flexdraft.drafter.registry import attach_policy, is_model_uri
from flexdraft.evaluation.report import save_figure
from flexdraft.tuning.sweep import (
    DECODE_PARAMS,
    TRAINING_PARAMS,
    SweepConfig,
    decode_params,
    export_policy,
    trial_policy,
)

# ------------------------------------------------------------------------------------------- MLflow

def parent_run(cfg: SweepConfig, root: Path) -> dict:
    """The sweep's MLflow run (created once; a resumed sweep reopens it) -> what trials need to nest theirs."""
    from flexdraft.core.tracking import start_run, tracking_uri

    file = root / "parent.mlflow-run"
    run_id = file.read_text().strip() if file.is_file() else None
    with start_run(cfg.mlflow_experiment, asdict(cfg), run_name=cfg.name, run_id=run_id) as run:
        file.write_text(run.info.run_id)
        experiment = run.info.experiment_id
    runs = root / "trial-runs"
    runs.mkdir(parents=True, exist_ok=True)
    return {"uri": tracking_uri(), "experiment_id": experiment, "run_id": run.info.run_id, "runs_dir": str(runs)}


class TrialRun:
    """A trial's MLflow run, nested under the sweep's: created on the trial's first attempt with its params, and
    reopened by the id kept in the sweep folder when a restored sweep runs the trial again (params never logged
    twice, so never with other values)."""

    def __init__(self, parent: dict, trial_id: str, params: dict):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(parent["uri"])
        file = Path(parent["runs_dir"]) / f"{trial_id}.mlflow-run"
        if file.is_file():
            self.run_id = file.read_text().strip()
            self.client.update_run(self.run_id, status="RUNNING")
            return
        run = self.client.create_run(parent["experiment_id"], run_name=trial_id,
                                     tags={"mlflow.parentRunId": parent["run_id"], "trial_id": trial_id})
        self.run_id = run.info.run_id
        self.client.log_batch(self.run_id, params=[Param(k, str(v)) for k, v in params.items()])
        file.write_text(self.run_id)

    @staticmethod
    def existing(parent: dict, trial_id: str) -> str | None:
        file = Path(parent["runs_dir"]) / f"{trial_id}.mlflow-run"
        return file.read_text().strip() if file.is_file() else None

    def log(self, metrics: dict[str, float], step: int = 0) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])

    def tag(self, key: str, value: str) -> None:
        self.client.set_tag(self.run_id, key, value)

    def __enter__(self) -> TrialRun:
        return self

    def __exit__(self, kind, error, tb) -> None:
        """FINISHED, or FAILED when the trial raised (KILLED when Tune stopped it: the process ends first)."""
        self.client.set_terminated(self.run_id, "FAILED" if kind else "FINISHED")


# ------------------------------------------------------------------------------------------- reporting

def results_table(trials: list[dict], cfg: SweepConfig) -> str:
    """Markdown: one row per measured trial, best objective first."""
    batches = cfg.objective.batch_sizes
    names = sorted({k for t in trials for k in t["params"]}, key=list(DECODE_PARAMS | TRAINING_PARAMS).index)
    head = ["trial", *names, *[f"x AR b{b}" for b in batches], "tau", "objective", "status"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t in sorted(trials, key=lambda t: -t.get("objective", -1)):
        r = t["results"]
        cells = [t["trial_id"], *[_fmt(t["params"].get(n, "")) for n in names],
                 *[f"{r[b]['speedup']:.2f}x" if b in r else "-" for b in batches],
                 f"{t['tau']:.2f}" if "tau" in t else "-", f"{t['objective']:.3f}" if "objective" in t else "-",
                 t.get("status", "")]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def _fmt(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def plot(trials: list[dict], cfg: SweepConfig, out: Path, histories: dict[str, list[tuple[int, float]]]) -> list[Path]:
    """decode: speed-up vs S per batch size (cost model on / off apart); training: objective vs k and validation
    tau vs training steps per trial (histories: trial id -> [(step, tau)])."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    done = [t for t in trials if "objective" in t]
    batches = cfg.objective.batch_sizes
    if cfg.kind == "decode" and done:
        fig, axes = plt.subplots(1, len(batches), figsize=(4 * len(batches), 3.6), squeeze=False, sharey=True)
        for ax, b in zip(axes[0], batches):
            for on, marker in ((True, "o"), (False, "x")):
                pts = [(decode_params(t["params"])["switch_batch"], t["results"][b]["speedup"]) for t in done
                       if decode_params(t["params"])["cost_model"] == on]
                if pts:
                    ax.scatter(*zip(*pts), marker=marker, label="cost model" if on else "fixed threshold (S only)")
            ax.axhline(1.0, color="grey", linewidth=0.8)
            ax.set_title(f"batch {b}")
            ax.set_xlabel("switch threshold S")
        axes[0][0].set_ylabel("tokens/s over AR")
        axes[0][-1].legend(fontsize=7)
        fig.suptitle(f"Sweep {cfg.name}: throughput vs S, each trial")
        paths.append(save_figure(fig, out / "throughput_vs_S.png"))
    if cfg.kind == "training" and done:
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        for b in batches:
            pts = sorted((t["params"].get("k", 0), t["results"][b]["speedup"]) for t in done)
            ax.plot(*zip(*pts), marker="o", linestyle="", label=f"batch {b}")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xlabel("k (tuned layers)")
        ax.set_ylabel("tokens/s over AR")
        ax.set_title(f"Sweep {cfg.name}: throughput vs k")
        ax.legend(fontsize=7)
        paths.append(save_figure(fig, out / "throughput_vs_k.png"))
    if histories:
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        for trial_id, pts in histories.items():
            if pts:
                ax.plot(*zip(*pts), marker=".", label=trial_id)
        ax.set_xlabel("training step")
        ax.set_ylabel("validation tau (bonus known)")
        ax.set_title(f"Sweep {cfg.name}: tau vs training steps")
        ax.legend(fontsize=6)
        paths.append(save_figure(fig, out / "tau_vs_steps.png"))
    plt.close("all")
    return paths


def write_json(path: Path, data) -> Path:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)
    return path


def _fixed_against_cost_model(complete: list[dict], cfg: SweepConfig, identity: dict, source: dict,
                              root: Path) -> list[str]:
    """A decode sweep with trials of both kinds: the best of each at each batch size (markdown lines), and the
    fixed-threshold trials' own policy (policy-fixed.yaml)."""
    from flexdraft.speculative.policy_file import save_policy

    fixed = [t for t in complete if not decode_params(t["params"])["cost_model"]]
    costed = [t for t in complete if decode_params(t["params"])["cost_model"]]
    if not (fixed and costed):
        return []
    lines = ["**Fixed threshold (S only) against the cost model**: the best trial of each at each batch size", "",
             "| batch | fixed threshold | cost model | wins |", "|---|---|---|---|"]
    for b in cfg.objective.batch_sizes:
        f, c = (max(ts, key=lambda t: t["results"][b]["speedup"]) for ts in (fixed, costed))
        fs, cs = f["results"][b]["speedup"], c["results"][b]["speedup"]
        lines.append(f"| {b} | {fs:.2f}x ({f['trial_id']}) | {cs:.2f}x ({c['trial_id']}) | "
                     f"{'fixed' if fs > cs else 'cost model'} |")
    save_policy(export_policy(fixed, cfg.objective, identity, {**source, "only": "fixed threshold"}),
                root / "policy-fixed.yaml")
    return lines + [""]


def finish(cfg: SweepConfig, root: Path, trials: list[dict], histories: dict, parent: dict, seconds: float) -> dict:
    """After the trials: results.md / results.json, the policy files, plots, and all of it on the sweep's MLflow
    run (and each training trial's tau history on its own) -> a summary (best trial, policy path)."""
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    from flexdraft.core.tracking import hardware
    from flexdraft.speculative.policy_file import save_policy

    client = MlflowClient(parent["uri"])
    complete = [t for t in trials if "objective" in t]
    batches = cfg.objective.batch_sizes
    hw = hardware()
    lines = [f"# Sweep {cfg.name} ({cfg.kind})", "",
             f"* Machine: {hw.get('gpu') or hw['cpu']} ({hw['cpu_count']} CPUs); {len(trials)} trials, "
             f"{len(complete)} measured at every batch size, in {seconds / 60:.1f} min (budget {cfg.time_budget_min:g} "
             "min).",
             f"* Objective: tokens/s over AR's, measured side by side (lockstep) at batch {batches} with weights "
             f"{cfg.objective.weights}, on {max(cfg.objective.prompts, max(batches))} {cfg.prompts} prompts, "
             f"{cfg.objective.max_new_tokens} new tokens, greedy.", "", results_table(trials, cfg), ""]
    summary: dict = {"trials": len(trials), "measured": len(complete)}
    if complete:
        best = max(complete, key=lambda t: t["objective"])
        identity = json.loads(best["identity"])
        source = {"sweep": cfg.name, "kind": cfg.kind, "mlflow_run_id": parent["run_id"], "best_trial": best["trial_id"],
                  "objective": best["objective"], "speedup": {b: best["results"][b]["speedup"] for b in batches}}
        if cfg.kind == "decode":
            policy = export_policy(complete, cfg.objective, identity, source)
            lines += _fixed_against_cost_model(complete, cfg, identity, source, root)
        else:
            policy = dataclasses.replace(trial_policy({}), source={**source, "drafter": best["drafter"]}, **identity)
            lines += [f"Best drafter: `{best['drafter']}` (trial {best['trial_id']}), at the default decode settings.",
                      ""]
            summary["drafter"] = best["drafter"]
        path = save_policy(policy, root / "policy.yaml")
        lines += ["**Exported policy** (`policy.yaml`): each band takes the settings of the trial fastest at its "
                  f"batch size; S = {policy.switch_batch}", "", policy.table(), "",
                  f"Use it: `flexdraft generate --policy {path} ...`; the harness's `policies: {{tuned: {path}}}`; "
                  f"Serve's `user_config.policy: {path}`."]
        summary.update(best=best["trial_id"], objective=best["objective"], policy=str(path))
        client.log_batch(parent["run_id"], metrics=[Metric(f"best/{k}", float(v), 0, 0) for k, v in
                                                    {"objective": best["objective"],
                                                     **{f"b{b}/speedup": best["results"][b]["speedup"]
                                                        for b in batches}}.items()])
    for trial_id, points in histories.items():
        run_id = TrialRun.existing(parent, trial_id)
        if run_id and points and not client.get_metric_history(run_id, "eval/bonus/tau"):
            client.log_batch(run_id, metrics=[Metric("eval/bonus/tau", v, 0, step) for step, v in points])
    if cfg.kind == "decode" and is_model_uri(cfg.drafter) and "policy" in summary:  # the policy joins its drafter
        v = attach_policy(cfg.drafter, parent["run_id"], "policy.yaml", cfg.name, summary["objective"])
        summary["drafter_version"] = v.uri
        lines += ["", f"The policy is attached to {v.uri}: `--policy {v.uri}` loads it."]
    (root / "results.md").write_text("\n".join(lines) + "\n")
    write_json(root / "results.json", {"config": asdict(cfg), "trials": trials, "histories": histories,
                                       "summary": summary})
    for path in [*plot(trials, cfg, root, histories), root / "results.md", root / "results.json",
                 *root.glob("policy*.yaml")]:
        client.log_artifact(parent["run_id"], str(path))
    client.set_terminated(parent["run_id"], "FINISHED")
    return summary
