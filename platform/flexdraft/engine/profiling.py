"""The start-up cost profile: each kind of forward the planner prices, timed on the engine's own buffers."""
from __future__ import annotations

import torch

from flexdraft.core.errors import FlexDraftError
from flexdraft.engine.stats import IDLE, PROFILE, StepStats
from flexdraft.speculative.planner import measure, profile_shapes


@torch.inference_mode()
def profile(engine, context: int = 256, rounds: int = 5, timer=None) -> dict:
    """Time each kind of forward over the shapes the planner prices (`planner.profile_shapes`; rows at `context`
    cached tokens) and seed `engine`'s cost model with them (`planner.measure`); the engine must be idle.
    Returns {kind: {(rows, tokens per row): s}}. timer(kind, rows, tokens per row, branches) -> seconds of one
    forward (`time_forward` on the engine by default)."""
    if engine.slots:
        raise FlexDraftError("profile() needs an idle engine (no active rows)")
    if engine.drafter is None:
        return {}
    B, cfg = engine.B, engine.config
    engine.cache.lens.fill_(min(context, cfg.max_len - max((B + 1) * (B + 2), cfg.tree_nodes + 1)))
    engine.state.bonus.fill_(0)
    engine.state.drafts.fill_(0)
    shapes = profile_shapes(cfg.max_batch, B, cfg.switch_batch, engine.tree_sizes())
    points = measure(shapes, timer or (lambda *shape: time_forward(engine, *shape)), rounds)
    engine.costs.set_profile(points)
    engine.cache.lens.zero_()
    engine.stats = StepStats(IDLE, 0)
    return points


def time_forward(engine, kind: str, n: int, T: int, m: int) -> float:
    """One forward of `kind` (target / draft / parallel with m branches) for rows 0..n-1, T tokens each, at the
    rows' cache lengths -> seconds (timed as a step times its forwards)."""
    dev = engine.target.device
    rows = torch.arange(n, device=dev)
    pos = engine.cache.lens[:n, None] + torch.arange(T, device=dev)
    tokens = torch.zeros(n, T, dtype=torch.long, device=dev)
    anchors = torch.arange(m, device=dev).expand(n, m)
    view = engine.cache.rows(0, n)
    runs = {"target": lambda: engine.verifier.target_logits(tokens, pos, view),
            "draft": lambda: engine.proposer.forward(rows, T - 1),
            "parallel": lambda: engine.verifier.parallel_logits(tokens, pos, view, anchors)}
    engine.stats = StepStats(PROFILE, n)
    engine.timed(kind, runs[kind])
    return engine.stats.forward_seconds[kind]
