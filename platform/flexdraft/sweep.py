"""Sweeps (`flexdraft sweep`, tuning/sweep.py): the library side. The config and its search space, checked before
any trial starts; what a trial measures (decoding throughput against AR, side by side, at each batch size, on
prompts held apart from training and from the benchmark sets); the policy a sweep exports; its tables and plots.
Ray Tune (trials, ASHA, resume) and the per-trial MLflow runs live in tuning/sweep.py.

Two kinds of parameters, never mixed:
* decode-time (`DECODE_PARAMS`): how the engine decodes with a given drafter. A decode sweep measures them over
  one drafter (`drafter:`), never retraining;
* training-time (`TRAINING_PARAMS`): what drafter gets trained. A training sweep trains one drafter per trial
  (attention tuning + calibration, the pipeline's own jobs) and measures it at the default decode settings.
"""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from flexdraft import logs
from flexdraft.config import RuntimeConfig, data_dir, load_yaml
from flexdraft.engine_config import EngineConfig
from flexdraft.errors import FlexDraftError
from flexdraft.policy_file import Band, Policy

log = logs.get("sweep")

KINDS = ("decode", "training")
_EC = EngineConfig()
# name -> (type, default); a decode trial's parameters become a policy (`trial_policy`)
DECODE_PARAMS = {"switch_batch": (int, _EC.switch_batch), "cost_model": (bool, _EC.cost_model),
                 "top_m": (int, _EC.top_m), "rho": (float, _EC.rho), "tree_nodes": (int, _EC.tree_nodes),
                 "block": (int, 0), "lookup": (int, _EC.lookup)}
TRAINING_PARAMS = {"k": (int, None), "block_size": (int, None), "lr": (float, None), "entry_layer": (int, None)}


@dataclass
class Objective:
    """Measured tokens/s over AR's at each batch size, weighted: sum_b w_b * speedup_b / sum_b w_b."""
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 16])
    weights: list[float] = field(default_factory=lambda: [1.0, 1.0, 1.0])
    prompts: int = 4  # a batch-b measurement decodes max(prompts, b) prompts
    max_new_tokens: int = 64

    def score(self, speedups: dict[int, float]) -> float:
        return sum(w * speedups[b] for b, w in zip(self.batch_sizes, self.weights)) / sum(self.weights)


@dataclass
class SweepConfig:
    name: str = "decode"
    kind: str = "decode"  # decode | training
    model: str = "smollm2"  # decode sweeps (a training sweep's model is its pipeline's)
    drafter: str = ""  # decode: the drafter swept over ("" = the default pipeline's; a folder; "init")
    store: str = ""  # n-gram store of lookup steps ("" = the default pipeline's distilled data; a file; "none")
    pipeline: str = ""  # the base pipeline YAML ("" = the embedded defaults): a training trial's, and the prompt pick's
    # validation prompts: held-out = ShareGPT prompts past the pipeline's distill selection (in neither split, never
    # in a benchmark set); validation = the pipeline's distill validation split; or a JSONL prompts file
    prompts: str = "held-out"
    space: dict = field(default_factory=dict)  # parameter -> list of values (each trial draws one of each)
    first: list[dict] = field(default_factory=lambda: [{}])  # configurations run first ({}: the defaults)
    trials: int = 24  # at most; the time budget usually ends a sweep first
    time_budget_min: float = 12.0  # the whole sweep's (Tune stops trials at it)
    trial_budget_min: float = 5.0  # training: attention-tuning minutes per trial (ASHA stops weak ones sooner)
    calibration_budget_min: float = 1.0  # training: calibration minutes per trial
    # training: validation tau every eval_every steps; ASHA compares trials at grace_steps, then at 2x, 4x, ... as
    # many steps, and stops the worse half at each (comparing at equal steps: deeper drafters step slower)
    eval_every: int = 50
    grace_steps: int = 100
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"
    threads: int = 0  # decode measurements (0: $OMP_NUM_THREADS, else one per core)
    objective: Objective = field(default_factory=Objective)
    output_dir: str = ""  # "" = $FLEXDRAFT_HOME/sweeps/<name>
    mlflow_experiment: str = "flexdraft-sweeps"
    max_concurrent_trials: int = 1  # trials that share a machine's cores would time each other

    def __post_init__(self):
        if self.kind not in KINDS:
            raise FlexDraftError(f"sweep kind must be decode or training, got {self.kind!r}")
        if not self.name or "/" in self.name:
            raise FlexDraftError(f"sweep name must be a non-empty name without '/', got {self.name!r}")
        own, other = (DECODE_PARAMS, TRAINING_PARAMS) if self.kind == "decode" else (TRAINING_PARAMS, DECODE_PARAMS)
        if not self.space or not any(isinstance(v, list) and v for v in self.space.values()):
            raise FlexDraftError(f"empty search space: give `space:` a list of values for some of {', '.join(own)}")
        for name, values in self.space.items():
            if name in other:
                why = ("a decode-time parameter: sweep it over the trained drafter (kind: decode), never retrain for "
                       "it") if self.kind == "training" else "a training-time parameter: sweep it with kind: training"
                raise FlexDraftError(f"space.{name} is {why}")
            if name not in own:
                raise FlexDraftError(f"space.{name}: unknown parameter (a {self.kind} sweep takes {', '.join(own)})")
            if not isinstance(values, list) or not values:
                raise FlexDraftError(f"space.{name} must be a non-empty list of values, got {values!r}")
            typ = own[name][0]
            for v in values:
                if not (isinstance(v, typ) or (typ is float and isinstance(v, int))) or (typ is int and isinstance(v, bool)):
                    raise FlexDraftError(f"space.{name}: {v!r} is not a {typ.__name__}")
        for point in self.first:
            unknown = sorted(set(point) - set(own))
            if unknown:
                raise FlexDraftError(f"first: unknown parameter {unknown[0]} (a {self.kind} sweep takes {', '.join(own)})")
        o = self.objective
        if not o.batch_sizes or min(o.batch_sizes) < 1 or len(o.weights) != len(o.batch_sizes) or min(o.weights) < 0 \
                or not sum(o.weights):
            raise FlexDraftError(f"objective: batch_sizes must be >= 1 with one weight >= 0 each (not all 0), got "
                                 f"{o.batch_sizes} and {o.weights}")
        for key in ("trials", "max_concurrent_trials", "eval_every", "grace_steps"):
            if getattr(self, key) < 1:
                raise FlexDraftError(f"{key} must be >= 1, got {getattr(self, key)}")
        if min(self.time_budget_min, self.trial_budget_min, self.calibration_budget_min) <= 0:
            raise FlexDraftError("time budgets must be > 0 minutes")
        self.check_values()

    def check_values(self) -> None:
        """Values each parameter can take on its own."""
        space = {**{k: [v] for p in self.first for k, v in p.items()}, **self.space}
        positive = {"switch_batch": 0, "top_m": 0, "tree_nodes": 0, "block": 0, "lookup": 0, "k": 1, "block_size": 1,
                    "entry_layer": 0}
        for name, low in positive.items():
            bad = [v for v in space.get(name, []) if v < low]
            if bad:
                raise FlexDraftError(f"space.{name}: {bad[0]} is below {low}")
        for name in ("rho", "lr"):
            bad = [v for v in space.get(name, []) if not 0 < v <= (1 if name == "rho" else math.inf)]
            if bad:
                raise FlexDraftError(f"space.{name}: {bad[0]} is out of range")

    def check_model(self, n_layers: int, drafter_block: int | None, drafter_k: int | None = None) -> None:
        """What depends on the model and the drafter: k and the entry layer within the layers, B' <= B."""
        values = lambda name: self.space.get(name, []) + [p[name] for p in self.first if name in p]  # noqa: E731
        for k in values("k"):
            if k > n_layers:
                raise FlexDraftError(f"space.k: {k} tuned layers, but the model has {n_layers}")
        k_max = max(values("k") or [drafter_k or 1])
        for e in values("entry_layer"):
            if e > n_layers - k_max:
                raise FlexDraftError(f"space.entry_layer: {e} > L - k = {n_layers - k_max} (L = {n_layers}, k up to "
                                     f"{k_max})")
        if drafter_block is not None:
            for b in values("block"):
                if b > drafter_block:
                    raise FlexDraftError(f"space.block: B' = {b} > the drafter's block size B = {drafter_block}")

    def root(self) -> Path:
        return Path(self.output_dir).expanduser() if self.output_dir else data_dir() / "sweeps" / self.name


def load_sweep_config(path: str | Path) -> SweepConfig:
    return load_yaml(SweepConfig, path)


# ------------------------------------------------------------------------------------------- trials -> policies

def decode_params(params: dict) -> dict:
    """A trial's decode-time parameters, defaults filled in."""
    return {name: params.get(name, default) for name, (_, default) in DECODE_PARAMS.items()}


def trial_policy(params: dict) -> Policy:
    """The policy a decode trial runs: its settings at every batch size, the planner choosing each step (cost
    model on), or the method's fixed rule (off): parallel up to S rows, sequential above."""
    p = decode_params(params)
    band = dict(block=p["block"], top_m=p["top_m"], rho=p["rho"], tree_nodes=p["tree_nodes"], lookup=p["lookup"])
    S = p["switch_batch"]
    if p["cost_model"]:
        bands = [Band(None, "adaptive", **band)]
    else:
        bands = ([Band(S, "parallel", **band)] if S else []) + [Band(None, "sequential", **band)]
    return Policy(switch_batch=S, bands=bands)


def export_policy(trials: list[dict], objective: Objective, identity: dict, source: dict) -> Policy:
    """The policy of the best measured trial at each batch size: band i covers the live rows up to batch size
    b_i (the last one: any number) with the settings of the trial fastest at b_i. S is the value under which
    the most bands (by weight) decide parallel plans as their trial did. trials: [{"params", "results": {b:
    {"speedup", ...}}}], each measured at every batch size."""
    bands, allow = [], []  # allow: did the winner at b permit parallel plans at b rows (b <= its S)?
    batches = sorted(objective.batch_sizes)
    for i, b in enumerate(batches):
        best = max(trials, key=lambda t: t["results"][b]["speedup"])
        policy = trial_policy(best["params"])
        band = dataclasses.replace(policy.band(b), max_rows=None if i == len(batches) - 1 else b)
        bands.append(band)
        allow.append((b, b <= policy.switch_batch, objective.weights[objective.batch_sizes.index(b)]))
    candidates = {0} | {b for b, _, _ in allow}
    S = max(candidates, key=lambda s: (sum(w for b, ok, w in allow if (b <= s) == ok), -s))
    return Policy(switch_batch=S, bands=_merge(bands), source=source, **identity)


def _merge(bands: list[Band]) -> list[Band]:
    """Adjacent bands with the same settings as one."""
    out = []
    for b in bands:
        if out and dataclasses.replace(out[-1], max_rows=None) == dataclasses.replace(b, max_rows=None):
            out[-1] = dataclasses.replace(out[-1], max_rows=b.max_rows)
        else:
            out.append(b)
    return out


# ------------------------------------------------------------------------------------------- before any trial

@dataclass
class Prepared:
    """What every trial shares, found (and checked) before the first starts."""
    pipeline: object  # the base PipelineConfig
    prompts: list[list[int]]
    defaults: dict  # each parameter's value when a trial does not set it
    model: str  # the target (decode: cfg.model; training: the pipeline's)


def prepare(cfg: SweepConfig) -> Prepared:
    """Check the space against the model and drafter, pick the validation prompts -> what trials share. Every
    error here is a FlexDraftError raised before Ray starts."""
    from flexdraft.drafter import DrafterConfig, read_drafter_meta
    from flexdraft.models.config import ModelArgs
    from flexdraft.models.loading import load_tokenizer, resolve_source
    from flexdraft.pipeline import PipelineConfig, default_drafter_dir, load_pipeline_config

    pipeline = load_pipeline_config(cfg.pipeline) if cfg.pipeline else PipelineConfig()
    model = cfg.model if cfg.kind == "decode" else pipeline.model
    folder = resolve_source(model)
    args = ModelArgs.from_hf_config(json.loads((folder / "config.json").read_text()))
    if cfg.kind == "decode":
        if cfg.drafter == "init":
            block, k = DrafterConfig().block_size, min(DrafterConfig().k, max(1, args.n_layers // 2))
        else:
            path = Path(cfg.drafter).expanduser() if cfg.drafter else default_drafter_dir()
            if not (path / "drafter.json").is_file():
                raise FlexDraftError(f"no drafter at {path}: train one (`flexdraft pipeline`) or pass --drafter PATH")
            meta = read_drafter_meta(path)
            block, k = meta["config"]["block_size"], meta["config"]["k"]
        cfg.check_model(args.n_layers, block, k)
        defaults = {name: default for name, (_, default) in DECODE_PARAMS.items()}
    else:
        cfg.check_model(args.n_layers, None, pipeline.drafter.k)
        defaults = {"k": pipeline.drafter.k, "block_size": pipeline.drafter.block_size, "lr": pipeline.attention.lr,
                    "entry_layer": pipeline.drafter.entry_layer}
    try:
        tokenizer = load_tokenizer(folder)
    except FlexDraftError:
        tokenizer = None  # (prompts: validation needs none)
    n = max(cfg.objective.prompts, max(cfg.objective.batch_sizes))
    return Prepared(pipeline, pick_prompts(cfg, pipeline, tokenizer, n), defaults, model)


def trial_points(cfg: SweepConfig, defaults: dict) -> list[dict]:
    """The configurations to try, in order: `first` (defaults filled in), then the grid of `space` in a seeded
    random order; each complete (every swept parameter set), none twice (decode: none that decodes as an earlier
    one does, e.g. tree sizes under the fixed rule, which never takes tree steps), at most `trials`."""
    import itertools
    import random

    names = list(cfg.space)
    grid = [dict(zip(names, values)) for values in itertools.product(*cfg.space.values())]
    random.Random(cfg.seed).shuffle(grid)
    swept = set(names) | {k for p in cfg.first for k in p}
    points, seen = [], set()
    for point in [*cfg.first, *grid]:
        full = {k: point.get(k, defaults[k]) for k in swept}
        key = _effective(full) if cfg.kind == "decode" else json.dumps(full, sort_keys=True)
        if key not in seen:
            seen.add(key)
            points.append(full)
    return points[:cfg.trials]


def _effective(params: dict) -> str:
    """What a decode configuration does, as a key: the bands of its policy (and S where it matters)."""
    p = trial_policy(params)
    if all(b.mode != "adaptive" for b in p.bands):
        p.bands = [dataclasses.replace(b, tree_nodes=0, lookup=0) for b in p.bands]  # the fixed rule ignores them
        if all(b.mode != "parallel" for b in p.bands):
            p.bands = [dataclasses.replace(b, top_m=0, rho=1.0) for b in p.bands]
    return json.dumps([p.switch_batch, [asdict(b) for b in p.bands]])


def trial_pipeline(cfg: SweepConfig, base, params: dict, trial_id: str):
    """A training trial's pipeline: the base one with the trial's k, B, lr and entry layer, named after the
    trial, beside the base pipeline (so it shares its distilled data), its stages on the sweep's budgets."""
    drafter = {**asdict(base.drafter), **{k: params[k] for k in ("k", "block_size", "entry_layer") if k in params}}
    attention = {**asdict(base.attention), "time_budget_min": cfg.trial_budget_min, "eval_every": cfg.eval_every}
    if "lr" in params:
        attention["lr"] = params["lr"]
    calibration = {**asdict(base.calibration), "time_budget_min": cfg.calibration_budget_min}
    from flexdraft.config import from_dict
    from flexdraft.pipeline import PipelineConfig

    name = f"{cfg.name}-{trial_id}"
    return from_dict(PipelineConfig, {**asdict(base), "name": name, "output_dir": str(base.root.parent / name),
                                      "drafter": drafter, "attention": attention, "calibration": calibration,
                                      "time_budget_min": 0.0})


# ------------------------------------------------------------------------------------------- MLflow

def parent_run(cfg: SweepConfig, root: Path) -> dict:
    """The sweep's MLflow run (created once; a resumed sweep reopens it) -> what trials need to nest theirs."""
    from flexdraft.tracking import start_run, tracking_uri

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

    def __enter__(self) -> "TrialRun":
        return self

    def __exit__(self, kind, error, tb) -> None:
        """FINISHED, or FAILED when the trial raised (KILLED when Tune stopped it: the process ends first)."""
        self.client.set_terminated(self.run_id, "FAILED" if kind else "FINISHED")


# ------------------------------------------------------------------------------------------- measuring

def pick_prompts(cfg: SweepConfig, pipeline, tokenizer, n: int) -> list[list[int]]:
    """n validation prompts (token ids, chat template) per `cfg.prompts`; see SweepConfig.prompts."""
    from flexdraft.data import read_prompts_file
    from flexdraft.distill import read_split, select_prompts

    if cfg.prompts == "held-out":
        if tokenizer is None:
            raise FlexDraftError("prompts: held-out needs the model's tokenizer; use prompts: validation or a file")
        wider = dataclasses.replace(pipeline, distill=dataclasses.replace(pipeline.distill,
                                                                          num_prompts=pipeline.distill.num_prompts + n))
        return [p["prompt_ids"] for p in select_prompts(wider, tokenizer)[pipeline.distill.num_prompts:]]
    if cfg.prompts == "validation":
        import pyarrow.parquet as pq

        rows = [r for f in read_split(pipeline.distill_dir(), "validation") for r in pq.read_table(f).to_pylist()]
        prompts = [list(r["input_ids"][:r["prompt_len"]]) for r in sorted(rows, key=lambda r: r["id"])]
    else:
        prompts = read_prompts_file(cfg.prompts, tokenizer)
    if len(prompts) < n:
        raise FlexDraftError(f"prompts {cfg.prompts}: {len(prompts)} prompts, the objective needs {n}")
    return prompts[:n]


class Measurer:
    """One model, drafter and store loaded once; `run(policy, batch)` decodes the same prompts with the policy and
    with AR in lockstep (one step of each in turn, `harness.lockstep`) and compares their tokens per second."""

    def __init__(self, cfg: SweepConfig, drafter: str, prompts: list[list[int]], model: str):
        from flexdraft.models.loading import TOKENIZER_FILES, load_model, resolve_source
        from flexdraft.runner import resolve_drafter, resolve_store

        runtime = RuntimeConfig(device=cfg.device, dtype=cfg.dtype, threads=cfg.threads)
        tokenizer = any((resolve_source(model) / f).is_file() for f in TOKENIZER_FILES)  # (its EOS ids, if any)
        self.lm = load_model(model, runtime, with_tokenizer=tokenizer)
        self.choice = resolve_drafter(drafter or None, self.lm.model, required=True)
        self.store, _ = resolve_store(cfg.store or None, model, self.lm.model.args.vocab_size)
        self.model, self.prompts, self.objective = model, prompts, cfg.objective
        B = self.choice.drafter.config.block_size
        self.max_len = min(self.lm.model.args.max_position_embeddings,
                           max(map(len, prompts)) + cfg.objective.max_new_tokens + (B + 1) + (B + 1) ** 2)

    def identity(self) -> dict:
        """What a policy measured here is for and where it was measured (`Policy` fields)."""
        import torch

        from flexdraft.drafter import weights_fingerprint
        from flexdraft.tracking import hardware

        m = self.lm.model
        return {"target": {"model": self.model, "fingerprint": weights_fingerprint(m)},
                "drafter": {"path": self.choice.source, "fingerprint": self.choice.fingerprint,
                            "block_size": self.choice.drafter.config.block_size, "k": self.choice.drafter.config.k},
                "machine": {"device": m.device.type, "dtype": str(m.dtype).removeprefix("torch."),
                            "threads": torch.get_num_threads(), "cpu": hardware().get("gpu") or hardware()["cpu"]}}

    def run(self, policy: Policy, batch: int) -> dict:
        from flexdraft.generate import SamplingParams
        from flexdraft.harness import lockstep
        from flexdraft.runner import build_engine

        ec = lambda mode: EngineConfig(mode=mode, max_batch=batch, max_len=self.max_len)  # noqa: E731
        engines = {"policy": build_engine(self.lm, self.choice, ec("adaptive"), self.store, policy),
                   "ar": build_engine(self.lm, self.choice, ec("ar"), None)}
        prompts = self.prompts[:max(self.objective.prompts, batch)]
        lockstep(engines, prompts[:batch], SamplingParams(max_new_tokens=8))  # warm-up
        res = lockstep(engines, prompts, SamplingParams(max_new_tokens=self.objective.max_new_tokens))
        tok_s = {name: sum(map(len, r["outputs"])) / r["seconds"] for name, r in res.items()}
        mismatched = sum(a != b for a, b in zip(res["policy"]["outputs"], res["ar"]["outputs"]))
        if mismatched:  # greedy: the policy's output must be AR's; a difference is a bug, never a result
            log.warning(f"{mismatched} of {len(prompts)} outputs differ from AR's at batch {batch}")
        steps = sum(res["policy"]["modes"].values())
        return {"speedup": tok_s["policy"] / tok_s["ar"], "tok_s": tok_s["policy"], "ar_tok_s": tok_s["ar"],
                "tau": res["policy"]["tau"], "mismatched": mismatched,
                "mode_share": {k: v / steps for k, v in res["policy"]["modes"].items()}}


def flat_metrics(results: dict[int, dict], objective: Objective) -> dict[str, float]:
    """Per-batch results -> flat metric names (b<batch>/speedup, ...) and, once every batch size is measured,
    `objective` and `tau` (the mean over batch sizes)."""
    out = {f"b{b}/{k}": float(v) for b, r in results.items() for k, v in r.items() if not isinstance(v, dict)}
    if all(b in results for b in objective.batch_sizes):
        out["objective"] = objective.score({b: results[b]["speedup"] for b in objective.batch_sizes})
        out["tau"] = statistics.mean(results[b]["tau"] for b in objective.batch_sizes)
    return out


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
        fig.tight_layout()
        paths.append(out / "throughput_vs_S.png")
        fig.savefig(paths[-1], dpi=110)
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
        fig.tight_layout()
        paths.append(out / "throughput_vs_k.png")
        fig.savefig(paths[-1], dpi=110)
    if histories:
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        for trial_id, pts in histories.items():
            if pts:
                ax.plot(*zip(*pts), marker=".", label=trial_id)
        ax.set_xlabel("training step")
        ax.set_ylabel("validation tau (bonus known)")
        ax.set_title(f"Sweep {cfg.name}: tau vs training steps")
        ax.legend(fontsize=6)
        fig.tight_layout()
        paths.append(out / "tau_vs_steps.png")
        fig.savefig(paths[-1], dpi=110)
    plt.close("all")
    return paths


def write_json(path: Path, data) -> Path:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)
    return path


def finish(cfg: SweepConfig, root: Path, trials: list[dict], histories: dict, parent: dict, seconds: float) -> dict:
    """After the trials: results.md / results.json, the policy files, plots, and all of it on the sweep's MLflow
    run (and each training trial's tau history on its own) -> a summary (best trial, policy path)."""
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    from flexdraft.policy_file import save_policy
    from flexdraft.tracking import hardware

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
            fixed = [t for t in complete if not decode_params(t["params"])["cost_model"]]
            costed = [t for t in complete if decode_params(t["params"])["cost_model"]]
            if fixed and costed:
                lines += ["**Fixed threshold (S only) against the cost model**: the best trial of each at each batch "
                          "size", "", "| batch | fixed threshold | cost model | wins |", "|---|---|---|---|"]
                for b in batches:
                    f, c = (max(ts, key=lambda t: t["results"][b]["speedup"]) for ts in (fixed, costed))
                    fs, cs = f["results"][b]["speedup"], c["results"][b]["speedup"]
                    lines.append(f"| {b} | {fs:.2f}x ({f['trial_id']}) | {cs:.2f}x ({c['trial_id']}) | "
                                 f"{'fixed' if fs > cs else 'cost model'} |")
                lines.append("")
                save_policy(export_policy(fixed, cfg.objective, identity, {**source, "only": "fixed threshold"}),
                            root / "policy-fixed.yaml")
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
    (root / "results.md").write_text("\n".join(lines) + "\n")
    write_json(root / "results.json", {"config": asdict(cfg), "trials": trials, "histories": histories,
                                       "summary": summary})
    for path in [*plot(trials, cfg, root, histories), root / "results.md", root / "results.json",
                 *root.glob("policy*.yaml")]:
        client.log_artifact(parent["run_id"], str(path))
    client.set_terminated(parent["run_id"], "FINISHED")
    return summary
