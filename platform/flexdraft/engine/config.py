"""The engine's configuration (`EngineConfig`: the mode, the policy knobs, the batch and cache sizes; also the
flags of `flexdraft generate`), a frozen value: `resolve` builds the one an engine runs with, and a live engine
changes its knobs only through `Engine.reconfigure`, which replaces the value."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from flexdraft.core.errors import FlexDraftError
from flexdraft.drafter.model import Drafter
from flexdraft.speculative.drafts import MODES, NO_DRAFTER, Mode

if TYPE_CHECKING:
    from flexdraft.speculative.policy_file import Policy


def _knob(default, help_: str, flag: str = ""):
    """A config field that is also a `flexdraft generate` flag (`flag`, default: --field-name), help included."""
    return field(default=default, metadata={"help": help_, "flag": flag})


@dataclass(frozen=True)
class EngineConfig:
    mode: Mode = Mode.ADAPTIVE  # (a config file's or flag's name, e.g. "lookup", becomes its Mode)
    block_size: int = _knob(0, "drafts verified per step (0 = the drafter's block size; lookup alone: 8)")
    switch_batch: int = _knob(4, "S: adaptive runs parallel mode at <= this many rows, sequential above")
    top_m: int = _knob(0, "parallel: keep at most the m most probable branches per row (0 = no cap)")
    rho: float = _knob(1.0, "parallel: keep the most probable branches until they cover this mass (1 = all)")
    calibrate: bool = True  # parallel: correct the taken branch with the now-known bonus
    cost_model: bool = True  # adaptive: per step, pick AR / sequential / tree / parallel and Bv by measured cost
    online: bool = True  # adaptive: learn each step shape's cost and each request's acceptance while decoding (False:
    # the start-up profile under one load factor, one acceptance model for every request: the planner before it learned)
    tree_nodes: int = _knob(8, "tree (and adaptive): drafts verified per row as a token tree (0 = no trees)")
    tree_width: int = 4  # a tree's depth-j nodes are among slot j's top tree_width drafts
    # adaptive weighs a lookup step every step (with the cost model), mode lookup takes one whenever a row has a match
    lookup: int = _knob(4, "prompt-lookup drafts from n-grams of up to this size (lookup, adaptive; 0 = none)")
    # draft sources beside prompt lookup, by name (engine/proposer_api.py: registered, an entry point, or an import
    # path module:attribute) -> their settings; lookup and adaptive steps weigh their drafts, mode share names them
    proposers: dict = field(default_factory=dict)
    max_batch: int = _knob(16, "rows decoded together (continuous batching); further requests wait",
                           flag="--batch-size")
    max_len: int = _knob(0, "cache slots per row (0: min(2048, context); see Engine.slots_needed)")

    def __post_init__(self):
        if self.mode not in MODES:
            raise FlexDraftError(f"engine mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        object.__setattr__(self, "mode", Mode(self.mode))

    def check(self, drafter: Drafter | None, context: int) -> None:
        if self.mode not in NO_DRAFTER and drafter is None:
            raise FlexDraftError(f"mode {self.mode} needs a drafter (modes ar and lookup do not)")
        if drafter is not None and not 0 <= self.block_size <= drafter.config.block_size:
            raise FlexDraftError(f"block_size={self.block_size} must be at most the drafter's block size "
                                 f"{drafter.config.block_size} (0 = the drafter's)")
        if self.top_m < 0:
            raise FlexDraftError(f"top_m must be >= 0 (0 = no cap), got {self.top_m}")
        if not 0 < self.rho <= 1:
            raise FlexDraftError(f"rho must be in (0, 1], got {self.rho}")
        if self.tree_nodes < 0 or self.tree_width < 1:
            raise FlexDraftError(f"tree_nodes must be >= 0 and tree_width >= 1, got {self.tree_nodes} and "
                                 f"{self.tree_width}")
        if self.mode == Mode.TREE and not self.tree_nodes:
            raise FlexDraftError("mode tree needs tree_nodes >= 1")
        if self.block_size < 0:
            raise FlexDraftError(f"block_size must be >= 0, got {self.block_size}")
        if self.lookup < 0 or (self.mode == Mode.LOOKUP and not self.lookup and not self.proposers):
            raise FlexDraftError(f"lookup (the longest n-gram matched) must be >= 0, and >= 1 for mode lookup "
                                 f"without other proposers, got {self.lookup}")
        bad = [k for k, v in self.proposers.items() if not isinstance(k, str) or not isinstance(v, dict | None)]
        if bad:
            raise FlexDraftError(f"proposers maps a proposer's name to its settings (a mapping), got {bad[0]!r}: "
                                 f"{self.proposers[bad[0]]!r}")
        if self.switch_batch < 0:
            raise FlexDraftError(f"switch_batch must be >= 0, got {self.switch_batch}")
        if self.max_batch < 1:
            raise FlexDraftError(f"max_batch must be >= 1, got {self.max_batch}")
        if not 2 <= self.max_len <= context:
            raise FlexDraftError(f"max_len={self.max_len} must be between 2 and the model's context of {context}")


def resolve(cfg: EngineConfig, drafter: Drafter | None, context: int, policy: Policy | None = None,
            mode_given: bool = True) -> EngineConfig:
    """The config an engine runs with, built once from what was asked (the caller's value is left as it was):
    without an explicit mode (mode_given False), adaptive when there is a drafter, else lookup when proposers are
    named, else AR; a policy's settings
    (adaptive, its S and cost model, the largest block, tree and n-gram size its bands use); max_len 0 ->
    min(2048, context). Checked whole: FlexDraftError names what is wrong."""
    changes: dict = {}
    if policy is not None:
        changes.update(policy.engine_settings())
    elif not mode_given:  # (proposers without a drafter: lookup steps over their drafts)
        changes["mode"] = Mode.ADAPTIVE if drafter is not None else Mode.LOOKUP if cfg.proposers else Mode.AR
    if cfg.max_len == 0:
        changes["max_len"] = min(2048, context)
    resolved = dataclasses.replace(cfg, **changes)
    resolved.check(drafter, context)
    return resolved
