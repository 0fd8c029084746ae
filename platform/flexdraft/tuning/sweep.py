"""Sweeps (`flexdraft sweep`, tuning/sweep.py): the library side. The config and its search space, checked before
any trial starts; the trials' configurations; what a trial measures (decoding throughput against AR, side by
side, at each batch size, on prompts held apart from training and from the benchmark sets); the policy a sweep
exports. What a sweep records (MLflow runs, tables, plots, the policy files) is in `sweep_record`; Ray Tune
(trials, ASHA, resume) in tuning/sweep.py.

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

from flexdraft.core import logs
from flexdraft.core.config import RuntimeConfig, data_dir, load_yaml
from flexdraft.core.errors import FlexDraftError
from flexdraft.engine.config import EngineConfig
from flexdraft.speculative.drafts import Mode
from flexdraft.speculative.policy_file import Band, Policy

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
    drafter: str = ""  # decode: the drafter swept over ("" = the default pipeline's; a folder; models:/...; "init")
    store: str = ""  # n-gram store of lookup steps ("" = the default pipeline's distilled data; a file; "none")
    # decode: draft sources the policy's engine weighs beside prompt lookup, as EngineConfig.proposers names them
    proposers: dict = field(default_factory=dict)
    pipeline: str = ""  # the base pipeline YAML ("" = the embedded defaults): a training trial's, and the prompt pick's
    # validation prompts: held-out = ShareGPT prompts past the pipeline's distill selection (in neither split, never
    # in a benchmark set); validation = the pipeline's distill validation split; or a JSONL prompts file
    prompts: str = "held-out"
    space: dict = field(default_factory=dict)  # parameter -> list of values (the grid is tried in a seeded order)
    first: list[dict] = field(default_factory=lambda: [{}])  # configurations run first ({}: the defaults)
    trials: int = 24  # at most; the time budget usually ends a sweep first
    time_budget_min: float = 12.0  # the whole sweep's (Tune stops trials at it)
    trial_budget_min: float = 5.0  # training: attention-tuning minutes per trial (ASHA stops weak ones sooner)
    calibration_budget_min: float = 1.0  # training: calibration minutes per trial (0: none, the tuned drafter as is)
    # training: validation tau every eval_every steps; ASHA compares the trials' latest tau after grace_min minutes
    # of each trial (start-up included), then at 2x, 4x, ..., and stops the worse half each time: at equal time, as
    # the trials' budgets are (a deeper drafter takes fewer, slower steps in them)
    eval_every: int = 25
    eval_sequences: int = 12  # validation sequences per evaluation (fewer than the pipeline's 40: evaluations are frequent)
    grace_min: float = 3.0
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"
    threads: int = 0  # CPU threads of a measurement (0: every CPU of the largest node of the cluster)
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
            for v in values:
                _check_type(f"space.{name}", v, own[name][0])
        for point in self.first:
            unknown = sorted(set(point) - set(own))
            if unknown:
                raise FlexDraftError(f"first: unknown parameter {unknown[0]} (a {self.kind} sweep takes {', '.join(own)})")
            for name, v in point.items():
                _check_type(f"first.{name}", v, own[name][0])
        o = self.objective
        if not o.batch_sizes or min(o.batch_sizes) < 1 or len(o.weights) != len(o.batch_sizes) or min(o.weights) < 0 \
                or not sum(o.weights):
            raise FlexDraftError(f"objective: batch_sizes must be >= 1 with one weight >= 0 each (not all 0), got "
                                 f"{o.batch_sizes} and {o.weights}")
        for key in ("trials", "max_concurrent_trials", "eval_every", "eval_sequences"):
            if getattr(self, key) < 1:
                raise FlexDraftError(f"{key} must be >= 1, got {getattr(self, key)}")
        if min(self.time_budget_min, self.trial_budget_min, self.grace_min) <= 0 or self.calibration_budget_min < 0:
            raise FlexDraftError("time budgets and grace_min must be > 0 minutes (calibration_budget_min: >= 0)")
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


def _check_type(where: str, value, typ: type) -> None:
    if isinstance(value, bool) != (typ is bool) or not isinstance(value, (int, float) if typ is float else typ):
        raise FlexDraftError(f"{where}: {value!r} is not a {typ.__name__}")


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
    b_i (the last one: any number) with the settings of the trial fastest at b_i (a tie goes to the trial with the
    better objective, then to the earlier one). Only trials measured at every batch size compete (one stopped
    early is not compared on the sizes it reached). S is the value under which the most bands (by weight)
    decide parallel plans as their trial did. trials: [{"params", "results": {b: {"speedup", ...}}}]."""
    batches = sorted(objective.batch_sizes)
    trials = [t for t in trials if all(b in t["results"] for b in batches)]
    if not trials:
        raise FlexDraftError("no trial was measured at every batch size: nothing to export")
    overall = [objective.score({b: t["results"][b]["speedup"] for b in batches}) for t in trials]
    bands, allow = [], []  # allow: did the winner at b permit parallel plans at b rows (b <= its S)?
    for i, b in enumerate(batches):
        best = trials[max(range(len(trials)), key=lambda j: (trials[j]["results"][b]["speedup"], overall[j], -j))]
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
    from flexdraft.drafter.model import DrafterConfig, read_drafter_meta
    from flexdraft.drafter.recipe import PipelineConfig, default_drafter_dir, load_pipeline_config
    from flexdraft.drafter.registry import is_model_uri, resolve
    from flexdraft.models.config import ModelArgs
    from flexdraft.models.loading import load_tokenizer, resolve_source

    pipeline = load_pipeline_config(cfg.pipeline) if cfg.pipeline else PipelineConfig()
    model = cfg.model if cfg.kind == "decode" else pipeline.model
    folder = resolve_source(model)
    args = ModelArgs.from_hf_config(json.loads((folder / "config.json").read_text()))
    if cfg.kind == "decode":
        if cfg.drafter == "init":
            block, k = DrafterConfig().block_size, min(DrafterConfig().k, max(1, args.n_layers // 2))
        else:
            if is_model_uri(cfg.drafter):  # downloaded once here; each trial checks it against the target
                path, version = resolve(cfg.drafter)
                cfg.drafter = version.uri  # an alias, pinned: every trial and the exported policy are this version's
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
    if all(b.mode != Mode.ADAPTIVE for b in p.bands):
        p.bands = [dataclasses.replace(b, tree_nodes=0, lookup=0) for b in p.bands]  # the fixed rule ignores them
        if all(b.mode != Mode.PARALLEL for b in p.bands):
            p.bands = [dataclasses.replace(b, top_m=0, rho=1.0) for b in p.bands]
    return json.dumps([p.switch_batch, [asdict(b) for b in p.bands]])


def trial_pipeline(cfg: SweepConfig, base, params: dict, trial_id: str):
    """A training trial's pipeline: the base one with the trial's k, B, lr and entry layer, named after the
    trial, beside the base pipeline (so it shares its distilled data), its stages on the sweep's budgets."""
    drafter = {**asdict(base.drafter), **{k: params[k] for k in ("k", "block_size", "entry_layer") if k in params}}
    attention = {**asdict(base.attention), "time_budget_min": cfg.trial_budget_min, "eval_every": cfg.eval_every,
                 "eval_sequences": cfg.eval_sequences}
    if "lr" in params:
        attention["lr"] = params["lr"]
    calibration = {**asdict(base.calibration), "time_budget_min": cfg.calibration_budget_min}
    from flexdraft.core.config import from_dict
    from flexdraft.drafter.recipe import PipelineConfig

    name = f"{cfg.name}-{trial_id}"
    return from_dict(PipelineConfig, {**asdict(base), "name": name, "output_dir": str(base.root.parent / name),
                                      "drafter": drafter, "attention": attention, "calibration": calibration,
                                      "time_budget_min": 0.0})


# ------------------------------------------------------------------------------------------- measuring

def pick_prompts(cfg: SweepConfig, pipeline, tokenizer, n: int) -> list[list[int]]:
    """n validation prompts (token ids, chat template) per `cfg.prompts`; see SweepConfig.prompts."""
    from flexdraft.core.data import read_prompts_file, read_split
    from flexdraft.training.distill import select_prompts

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
        from flexdraft.engine.runner import resolve_drafter, resolve_store
        from flexdraft.models.loading import TOKENIZER_FILES, load_model, resolve_source

        runtime = RuntimeConfig(device=cfg.device, dtype=cfg.dtype, threads=cfg.threads)
        tokenizer = any((resolve_source(model) / f).is_file() for f in TOKENIZER_FILES)  # (its EOS ids, if any)
        self.lm = load_model(model, runtime, with_tokenizer=tokenizer)
        self.choice = resolve_drafter(drafter or None, self.lm.model, required=True)
        self.store, _ = resolve_store(cfg.store or None, model, self.lm.model.args.vocab_size)
        self.model, self.prompts, self.objective, self.proposers = model, prompts, cfg.objective, cfg.proposers
        B = self.choice.drafter.config.block_size
        self.max_len = min(self.lm.model.args.max_position_embeddings,
                           max(map(len, prompts)) + cfg.objective.max_new_tokens + (B + 1) + (B + 1) ** 2)

    def identity(self) -> dict:
        """What a policy measured here is for and where it was measured (`Policy` fields)."""
        import torch

        from flexdraft.core.tracking import hardware

        m = self.lm.model
        return {"target": {"model": self.model, "fingerprint": m.fingerprint},
                "drafter": {"path": self.choice.source, "fingerprint": self.choice.fingerprint,
                            "block_size": self.choice.drafter.config.block_size, "k": self.choice.drafter.config.k},
                "machine": {"device": m.device.type, "dtype": str(m.dtype).removeprefix("torch."),
                            "threads": torch.get_num_threads(), "cpu": hardware().get("gpu") or hardware()["cpu"]},
                **({"proposers": self.proposers} if self.proposers else {})}

    def run(self, policy: Policy, batch: int) -> dict:
        from flexdraft.engine.runner import build_engine
        from flexdraft.evaluation.harness import lockstep
        from flexdraft.speculative.sampling import SamplingParams

        ec = lambda mode: EngineConfig(mode=mode, max_batch=batch, max_len=self.max_len,  # noqa: E731
                                       proposers=self.proposers if mode != "ar" else {})
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
