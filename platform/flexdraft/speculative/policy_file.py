"""Decoding policies: what the engine does at each live batch size, as a file a sweep writes (`flexdraft sweep`,
tuning/sweep.py) and `flexdraft generate --policy`, the benchmark harness and the Serve app read.

A policy is S (`switch_batch`: parallel plans only at <= S rows) and a list of bands by live rows. Each band
says which mode a step takes (`adaptive`: the planner's choice by the cost model; or a fixed one: ar, sequential,
tree, parallel, lookup), the drafts it may verify (`block`, B' <= the drafter's B), parallel pruning (`top_m`,
`rho`), token trees (`tree_nodes`) and prompt lookup (`lookup`, the longest n-gram; 0 = none). The method's
fixed-threshold rule is two bands: parallel up to S rows, sequential above.

A policy is measured for one target and one drafter: the file names both by fingerprint and any other pair is
refused. The machine it was measured on (device, dtype, threads, CPU) is recorded; elsewhere it still decodes
losslessly, only perhaps slower (a warning says so)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from flexdraft.core.config import from_dict, read_yaml
from flexdraft.core.errors import FlexDraftError
from flexdraft.speculative.drafts import MODES, Mode

FORMAT = "flexdraft-policy/1"
# EngineConfig fields a policy sets (its bands' maxima, S, the cost model) or decides per band (top_m, rho)
POLICY_KEYS = ("mode", "switch_batch", "cost_model", "block_size", "tree_nodes", "lookup", "top_m", "rho")


@dataclass(frozen=True)
class Band:
    """The step settings for live batches of up to `max_rows` rows (None: any number)."""
    max_rows: int | None = None
    mode: Mode = Mode.ADAPTIVE
    block: int = 0  # drafts verified per row at most (0 = the drafter's block size)
    top_m: int = 0  # parallel: keep at most this many branches per row (0 = no cap)
    rho: float = 1.0  # parallel: keep branches until they cover this probability mass
    tree_nodes: int = 8  # token-tree steps verify this many drafts per row (0 = no tree steps)
    lookup: int = 4  # prompt-lookup drafts from n-grams of up to this size (0 = no lookup steps)

    def __post_init__(self):
        if self.mode in MODES:  # (a file's name of it; `check` names a bad one)
            object.__setattr__(self, "mode", Mode(self.mode))

    def check(self, where: str, drafter_block: int) -> None:
        if self.mode not in MODES:
            raise FlexDraftError(f"{where}.mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not 0 <= self.block <= drafter_block:
            raise FlexDraftError(f"{where}.block={self.block}: B' must be between 0 (all) and the drafter's block "
                                 f"size B={drafter_block}")
        if self.top_m < 0 or not 0 < self.rho <= 1:
            raise FlexDraftError(f"{where}: top_m must be >= 0 and rho in (0, 1], got {self.top_m} and {self.rho}")
        if self.tree_nodes < 0 or self.lookup < 0:
            raise FlexDraftError(f"{where}: tree_nodes and lookup must be >= 0, got {self.tree_nodes} and {self.lookup}")
        if self.mode == Mode.TREE and not self.tree_nodes:
            raise FlexDraftError(f"{where}: mode tree needs tree_nodes >= 1")
        if self.mode == Mode.LOOKUP and not self.lookup:
            raise FlexDraftError(f"{where}: mode lookup needs lookup >= 1")


@dataclass
class Policy:
    switch_batch: int = 4
    bands: list[Band] = field(default_factory=lambda: [Band()])
    target: dict = field(default_factory=dict)  # {"model": name, "fingerprint": Transformer.fingerprint}
    drafter: dict = field(default_factory=dict)  # {"path": folder or "init", "fingerprint": ..., "block_size": B}
    machine: dict = field(default_factory=dict)  # device, dtype, threads, cpu: where it was measured
    proposers: dict = field(default_factory=dict)  # the draft sources it was measured with (EngineConfig.proposers)
    source: dict = field(default_factory=dict)  # the sweep that chose it and what it measured (not read back)
    format: str = FORMAT

    def band(self, rows: int) -> Band:
        """The band that covers a live batch of `rows` rows."""
        for b in self.bands:
            if b.max_rows is None or rows <= b.max_rows:
                return b
        return self.bands[-1]

    def check(self, where: str = "policy") -> None:
        if self.format != FORMAT:
            raise FlexDraftError(f"{where}: unknown format {self.format!r} (expected {FORMAT})")
        if not self.bands:
            raise FlexDraftError(f"{where}: no bands")
        if self.switch_batch < 0:
            raise FlexDraftError(f"{where}.switch_batch must be >= 0, got {self.switch_batch}")
        bounds = [b.max_rows for b in self.bands]
        ints = [x for x in bounds if x is not None]
        if None in bounds[:-1] or min(ints, default=1) < 1 or ints != sorted(set(ints)):
            raise FlexDraftError(f"{where}.bands: max_rows must increase (>= 1), only the last may be null, got {bounds}")
        B = int(self.drafter.get("block_size", 0)) or max(b.block for b in self.bands) or 64
        for i, b in enumerate(self.bands):
            b.check(f"{where}.bands[{i}]", B)

    def engine_settings(self) -> dict:
        """EngineConfig fields that must hold the bands' maxima (buffers, cache slots, n-gram indexes)."""
        return {"mode": "adaptive", "switch_batch": self.switch_batch,
                "cost_model": any(b.mode == "adaptive" for b in self.bands),
                "block_size": 0 if any(b.block == 0 for b in self.bands) else max(b.block for b in self.bands),
                "tree_nodes": max(b.tree_nodes for b in self.bands), "lookup": max(b.lookup for b in self.bands),
                **({"proposers": self.proposers} if self.proposers else {})}

    def refuse_other(self, target_fingerprint: str, drafter_fingerprint: str, path: str = "") -> None:
        """Raise unless this policy was measured for this target and drafter."""
        name = f"policy {path}" if path else "the policy"
        if self.target.get("fingerprint") != target_fingerprint:
            raise FlexDraftError(f"{name} was tuned for another model ({self.target.get('model')}, fingerprint "
                                 f"{self.target.get('fingerprint')}); this one's is {target_fingerprint}")
        if self.drafter.get("fingerprint") != drafter_fingerprint:
            raise FlexDraftError(f"{name} was tuned for another drafter ({self.drafter.get('path')}, fingerprint "
                                 f"{self.drafter.get('fingerprint')}); this one's is {drafter_fingerprint}")

    def table(self) -> str:
        """The bands as a Markdown table."""
        lines = ["| live rows | mode | B' | top_m | rho | tree nodes | lookup n |", "|---|---|---|---|---|---|---|"]
        low = 1
        for b in self.bands:
            rows = f"{low}-{b.max_rows}" if b.max_rows is not None else f">= {low}"
            lines.append(f"| {rows} | {b.mode} | {b.block or 'B'} | {b.top_m or '-'} | {b.rho:g} | {b.tree_nodes} | "
                         f"{b.lookup} |")
            low = (b.max_rows or low) + 1
        return "\n".join(lines)


def save_policy(policy: Policy, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = asdict(policy)
    data["bands"] = [{**asdict(b), "mode": str(b.mode)} for b in policy.bands]
    head = ("# FlexDraft decoding policy (flexdraft.speculative.policy_file): the step settings per live batch size, measured "
            "for one\n# target + drafter on one machine. Use: flexdraft generate --policy FILE | harness `policies:` | "
            "serve user_config.policy\n")
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(head + yaml.safe_dump(data, sort_keys=False))
    tmp.replace(path)
    return path


def load_policy(path: str | Path) -> Policy:
    data = read_yaml(path, "policy file")
    if not isinstance(data, dict):
        raise FlexDraftError(f"policy file {path}: expected a mapping")
    bands = data.get("bands")
    if not isinstance(bands, list) or not all(isinstance(b, dict) for b in bands):
        raise FlexDraftError(f"policy file {path}: `bands` must be a list of mappings")
    policy = from_dict(Policy, {**data, "bands": []}, f" {path}")
    policy.bands = [from_dict(Band, b, f" {path}.bands[{i}]") for i, b in enumerate(bands)]
    policy.check(f"policy file {path}")
    return policy
