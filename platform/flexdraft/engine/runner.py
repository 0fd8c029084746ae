"""Assembling a ready engine: target model, drafter (a path, the default pipeline's, or `init`), engine config
and the adaptive policy's cost profile (measured once per model/drafter/device/dtype/threads, then cached).
Used by the CLI and the benchmark harness."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from flexdraft.core import logs
from flexdraft.core.config import RuntimeConfig, data_dir
from flexdraft.core.errors import FlexDraftError
from flexdraft.drafter import registry
from flexdraft.drafter.model import Drafter, DrafterConfig, load_drafter, read_drafter_meta
from flexdraft.drafter.recipe import PipelineConfig, default_drafter_dir
from flexdraft.drafter.registry import Version
from flexdraft.engine.config import EngineConfig, resolve
from flexdraft.engine.engine import Engine
from flexdraft.models.loading import LoadedModel, load_model
from flexdraft.speculative.drafts import NO_DRAFTER, Mode
from flexdraft.speculative.grammar import Grammars
from flexdraft.speculative.lookup import NgramStore
from flexdraft.speculative.policy_file import Policy, load_policy

PROFILE_FORMAT = 19  # bump when Engine.profile measures other shapes or passes, or forwards get faster: cached profiles are redone


@dataclass
class DrafterChoice:
    drafter: Drafter | None
    source: str  # a folder, a models:/ URI, "init", or "" (none)
    prior: dict | None  # the drafter's validation agreement (seeds the acceptance model)
    fingerprint: str = ""  # of its weights file ("init-k<k>-B<B>" for init): what a policy is measured for
    version: Version | None = None  # the registered version a models:/ source resolved to
    why_none: str = ""  # with no drafter: why not the default pipeline's


def resolve_drafter(spec: str | None, target, required: bool) -> DrafterChoice:
    """spec: a drafter folder, a models:/ URI (`drafter.registry`: downloaded once, refused before its download
    when registered for other target weights), "init" (projectors copied from the target, calibration zero:
    lossless, slow), or None = the default pipeline's drafter if it exists, made ready for inference beside
    `target`. required: a speculative mode was asked for; without it, a default drafter trained for other base
    weights is passed over (nothing asked for it), where a named or required one is refused."""
    if spec == "init":  # the default shape, with fewer tuned layers on a model too shallow for it
        cfg = DrafterConfig()
        cfg.k = min(cfg.k, max(1, target.args.n_layers // 2))
        return DrafterChoice(Drafter.from_target(target, cfg).to_runtime(target), "init", None,
                             f"init-k{cfg.k}-B{cfg.block_size}")
    version = None
    if registry.is_model_uri(spec):
        folder, version = registry.resolve(spec, target.fingerprint)
    else:
        folder = Path(spec).expanduser() if spec else default_drafter_dir()
    if not spec and not (folder / "drafter.json").is_file():
        if required:
            raise FlexDraftError(f"no drafter given and the default one ({folder}) does not exist: train it with "
                                 "`flexdraft pipeline`, pass --drafter PATH|models:/NAME@ALIAS, or --drafter init "
                                 "(untrained)")
        return DrafterChoice(None, "", None, why_none=f"the default {folder} does not exist")
    meta = read_drafter_meta(folder)
    if not spec and not required and meta["base_fingerprint"] != target.fingerprint:
        return DrafterChoice(None, "", None, why_none=f"the default {folder} was trained for other base weights")
    drafter = load_drafter(folder, target).to_runtime(target)
    source = f"{spec} (version {version.version})" if version and not spec.endswith(f"/{version.version}") else spec
    # of the bytes this process loads (what a replica reports serving): a registered version's was just checked
    # against the file by `registry.resolve`, cached or not; a folder's is hashed here
    digest = (version and version.tag("weights_digest")) or registry.weights_digest(folder)
    return DrafterChoice(drafter, source or str(folder), meta.get("eval"), digest, version)


def provenance(choice: DrafterChoice) -> dict[str, str]:
    """What a run or a served engine records about its drafter (as `flexdraft.<key>` tags): its source, weights
    digest and, for a registered one, its version and LoggedModel (what `flexdraft report` finds runs by)."""
    if choice.drafter is None:
        return {}
    v = choice.version
    return {"drafter": choice.source, "drafter_digest": choice.fingerprint,
            **({"drafter_version": v.uri, "drafter_model_id": v.model_id} if v else {})}


def resolve_policy(path: str, target, choice: DrafterChoice) -> Policy:
    """Load a policy file (or the one attached to a registered drafter version: models:/...) for this target and
    drafter: one measured for another is refused; one measured on another device, dtype or thread count is used
    with a warning (lossless anyway, maybe slower)."""
    if registry.is_model_uri(path):  # the policy a sweep attached to that registered version
        path = str(registry.attached_policy(path))
    policy = load_policy(path)
    if choice.drafter is None:
        raise FlexDraftError(f"policy {path} needs a drafter (it was tuned for {policy.drafter.get('path')}): "
                             "pass --drafter")
    policy.refuse_other(target.fingerprint, choice.fingerprint, path)
    here = {"device": str(target.device.type), "dtype": str(target.dtype).removeprefix("torch."),
            "threads": torch.get_num_threads()}
    differs = {k: (policy.machine.get(k), v) for k, v in here.items() if policy.machine.get(k) not in (None, v)}
    if differs:
        logs.get("engine").warning(f"policy {path} was measured with "
                                   + ", ".join(f"{k} {a} (here {b})" for k, (a, b) in differs.items())
                                   + ": its choices may not be the fastest here")
    return policy


def resolve_store(spec: str | None, model: str, vocab_size: int) -> tuple[NgramStore | None, str]:
    """The n-gram store lookup steps draft from -> (store, where it came from). spec: a store file, a distill
    folder (its store, built on first use), "none", or None = the default pipeline's distilled data when it
    exists and `model` is the default pipeline's model."""
    from flexdraft.speculative.lookup import store_path

    if spec == "none":
        return None, ""
    if spec:
        path = Path(spec).expanduser()
        if path.is_dir() and any(path.glob("train-*.parquet")):
            path = store_path(path, vocab_size)
        return NgramStore.load(path, vocab_size), str(path)
    default = PipelineConfig()
    folder = default.distill_dir()
    if model != default.model or not any(folder.glob("train-*.parquet")):
        return None, ""
    path = store_path(folder, vocab_size)
    return NgramStore.load(path, vocab_size), str(path)


def profile_file(target, drafter: Drafter, cfg: EngineConfig, tree_sizes: list[int] | None = None) -> Path:
    """The cached cost profile of this model, drafter shape, device, dtype, threads and batch size (tree_sizes:
    a policy's, when other than [tree_nodes])."""
    key = json.dumps([PROFILE_FORMAT, target.fingerprint, asdict(drafter.config), str(target.device),
                      str(target.dtype), target.math_attention, torch.get_num_threads(), cfg.max_batch,
                      cfg.switch_batch, cfg.block_size, cfg.tree_nodes] + ([tree_sizes] if tree_sizes else []),
                     sort_keys=True)
    return data_dir() / "profiles" / (hashlib.sha256(key.encode()).hexdigest()[:12] + ".json")


def seed_costs(engine: Engine) -> None:
    """Adaptive engines: load the cached cost profile, or measure it (a few seconds) and cache it."""
    if engine.config.mode != Mode.ADAPTIVE or not engine.config.cost_model:
        return
    sizes = engine.tree_sizes()
    path = profile_file(engine.target, engine.drafter, engine.config,
                        sizes if sizes != [engine.config.tree_nodes] else None)
    if path.is_file():
        engine.costs.load_profile(path)
        return
    logs.get("engine").info(f"profiling forwards for the adaptive policy; cached in {path}")
    engine.profile()
    engine.costs.save_profile(path)


def build_engine(lm: LoadedModel, choice: DrafterChoice, cfg: EngineConfig, store: NgramStore | None,
                 policy: Policy | None = None) -> Engine:
    """An engine over a loaded model: the drafter where the mode uses one, seeded with the drafter's validation
    agreement, the policy's bands if given (`resolve_policy`), and (adaptive) the cost profile `seed_costs` loads
    or measures."""
    use_drafter = cfg.mode not in NO_DRAFTER or policy is not None
    grammars = Grammars(lm.tokenizer, lm.model.args.vocab_size) if lm.tokenizer is not None else None
    engine = Engine(lm.model, choice.drafter if use_drafter else None, cfg, lm.eos_token_ids,
                    acceptance_prior=choice.prior, store=store, policy=policy, grammars=grammars)
    seed_costs(engine)
    return engine


def load_engine(model: str, runtime: RuntimeConfig, drafter_spec: str | None, cfg: EngineConfig,
                mode_given: bool = True, store_spec: str | None = None,
                policy_spec: str | None = None) -> tuple[LoadedModel, Engine, str, dict[str, str]]:
    """-> (model, ready engine, a note saying which drafter, policy, n-gram store, mode and runtime, and where the
    engine's drafts come from: `provenance` + the policy's file or models:/ URI for an engine with a drafter, and
    the proposers beside prompt lookup by name). Without an explicit mode: adaptive when a drafter is available,
    else AR. policy_spec: a policy file (`policy_file`) or the models:/ URI of a version with one attached."""
    lm = load_model(model, runtime)
    required = (cfg.mode not in NO_DRAFTER and mode_given) or bool(policy_spec)
    choice = resolve_drafter(drafter_spec, lm.model, required=required)
    policy = resolve_policy(policy_spec, lm.model, choice) if policy_spec else None
    cfg = resolve(cfg, choice.drafter, lm.model.args.max_position_embeddings, policy, mode_given)
    if choice.source:
        note = f"[drafter: {choice.source}; mode {cfg.mode}" + (f", policy {policy_spec}]" if policy else "]")
    else:
        note = f"[no drafter ({choice.why_none}): mode {cfg.mode}]"
    store, source = resolve_store(store_spec, model, lm.model.args.vocab_size) if cfg.lookup else (None, "")
    if source and cfg.mode in (Mode.LOOKUP, Mode.ADAPTIVE):
        note = note[:-1] + f"; n-gram store {source}]"
    m = lm.model
    note = note[:-1] + (f"; {m.device.type} {str(m.dtype).removeprefix('torch.')} (dtype {runtime.dtype}), "
                        f"prepacked {m.lm_head.packed is not None}]")
    engine = build_engine(lm, choice, cfg, store, policy)
    where = {**provenance(choice), **({"policy": policy_spec} if policy else {})} if engine.drafter is not None else {}
    named = [p.name for p in engine.proposers if p.name != "lookup"]
    if named:
        where["proposers"] = ", ".join(named)
    return lm, engine, note, where
