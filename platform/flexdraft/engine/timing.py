"""How an engine times its steps' forwards (`StepTimer`): wall time per forward kind into the step's `StepStats`,
and each forward's rows x tokens and seconds into the cost model the planner prices steps with. A value of its
own, held by the parts that run forwards (the verifier, the drafter's proposer): none of them holds the engine."""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

from flexdraft.engine.stats import IDLE, StepStats
from flexdraft.speculative.branches import CostModel


class StepTimer:
    """`timer(kind, fn, rows, tokens)` runs fn (a forward of `rows` rows x `tokens` tokens each; 0: not priced) and
    adds its wall time to `stats` (the step under way) under `kind`; `clock` is what it times with (a test's fake
    clock, or the cost model's learning from injected costs)."""

    def __init__(self, device: torch.device, costs: CostModel, clock: Callable[[], float] = time.perf_counter):
        self.device, self.costs, self.clock = device, costs, clock
        self.stats = StepStats(IDLE, 0)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def __call__(self, kind: str, fn, rows: int = 0, tokens: int = 0):
        self.sync()
        t0 = self.clock()
        result = fn()
        self.sync()
        dt = self.clock() - t0
        seconds = self.stats.forward_seconds
        seconds[kind] = seconds.get(kind, 0.0) + dt
        if kind == "draft":
            self.stats.drafted_rows += rows
        if rows:
            self.costs.record(kind, rows, tokens, dt)
        return result
