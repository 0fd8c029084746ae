"""Time budgets for training stages: how many steps a budgeted run takes (`StepPlan`), how much of a pipeline's
deadline its attention stage gets (`deadline_budget`), and the learning-rate schedule that ends where the plan
does (`lr_lambda`). Plain arithmetic on seconds and step counts: the Ray loop in jobs.py times the steps and
all-reduces the paces, this module decides."""
from __future__ import annotations

import collections
import math
import time

from flexdraft.drafter.recipe import PipelineConfig, TrainConfig


class StepPlan:
    """How many steps a run takes: `steps`, or with a time budget, as many as fit it at the pace of the run's
    steps 3-10, fixed then and kept in every checkpoint (a resumed run ends where the first attempt would).
    A pace that drifts later moves the count (`hold`): the budget holds, and the schedule is re-planned from the
    step it changed at."""
    PROBE = 10  # steps before the count is fixed (the first 2 warm up, the rest are timed)
    # then, from 20 steps after that on, every step's end checks the pace of the latest 50 (or all since the count
    # was fixed) against the budget: one all-reduce of two numbers, and a sudden slowdown is caught a step later
    HOLD_AFTER, HOLD_WINDOW = 20, 50
    TOLERANCE = 0.03  # of the budget: a projected end that misses it by less leaves the count alone

    def __init__(self, tc: TrainConfig):
        self.budget_s, self.most, self.steps = tc.time_budget_min * 60, tc.steps, tc.steps
        self.fixed = not self.budget_s or tc.steps <= self.PROBE
        self.first = self.steps  # the count the schedule was planned for; then each re-plan's (step, count)
        self.replans: list[tuple[int, int]] = []

    def state(self) -> dict:
        return {"planned_steps": self.steps if self.fixed else None, "first_steps": self.first,
                "replans": self.replans}

    def restore(self, client: dict) -> None:
        if client.get("planned_steps") is not None:
            self.steps, self.fixed = client["planned_steps"], True
            self.first = client.get("first_steps", self.steps)
            self.replans = [tuple(r) for r in client.get("replans", [])]

    def fix(self, done: int, s_per_step: float) -> None:
        self.steps, self.fixed = max(done, min(self.most, int(self.budget_s / s_per_step))), True
        self.first = self.steps

    def hold(self, done: int, spent_s: float, s_per_step: float) -> bool:
        """After `done` steps that took `spent_s` of the budget, at the pace `s_per_step` of the latest steps:
        re-fix the count to what the rest of the budget fits when the planned steps would miss it by more than
        the tolerance (at least `done`, at most `steps` of the config). True when the count changed."""
        left = self.budget_s - spent_s
        if abs(left - (self.steps - done) * s_per_step) <= self.TOLERANCE * self.budget_s:
            return False
        steps = max(done, min(self.most, done + int(left / s_per_step)))
        if steps == self.steps:
            return False
        self.steps = steps
        self.replans.append((done, steps))
        return True


def deadline_budget(cfg: PipelineConfig, deadline: float, launched: float, train_start: float,
                    eval_s: float) -> float:
    """Seconds of training steps for a budgeted attention stage inside a pipeline that should end at `deadline` (epoch
    seconds): what is left from `train_start` once the rest of the pipeline is reserved (at least a minute), more or
    less than the stage's own budget. The rest: this stage's final evaluation and calibration's (each as long as the
    `eval_s` this stage's first one took), calibration's start-up (as long as this stage's: from `launched`, when
    the driver began the stage, to `train_start`, less that evaluation) and its budget, and 5% of the pipeline's
    budget for a pace that drifts after it was measured."""
    startup = max(0.0, train_start - launched - eval_s)
    reserve = 2 * eval_s + startup + 60 * cfg.calibration.time_budget_min + 3 * cfg.time_budget_min
    return max(MIN_BUDGET_S, deadline - reserve - train_start)


MIN_BUDGET_S = 60.0  # a pipeline that left its attention stage less still gets a drafter (and ends that late)


def lr_lambda(tc: TrainConfig, plan: StepPlan):
    """Linear warm-up, then cosine down to 10% at the plan's last step. A re-plan at step c (`StepPlan.hold`) keeps
    the cosine's phase at c and runs the rest of it, faster or slower, to end at the new last step: no jump."""
    def phase(at: float, a: int, end: int, step: int) -> float:  # `at` at step a, 1 at step end
        return at + (1 - at) * min(1.0, (step - a) / max(1, end - a))

    def f(step: int) -> float:
        if step < tc.warmup_steps:
            return (step + 1) / tc.warmup_steps
        at, a, end = 0.0, tc.warmup_steps, plan.first
        for c, steps in plan.replans:
            if step < c:
                break
            at, a, end = phase(at, a, end, c), c, steps
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * phase(at, a, end, step)))
    return f


class StepClock:
    """Times one attempt's steps for its `StepPlan`: fixes the count from the pace of steps 3-10, then, from
    HOLD_AFTER steps later on, holds it after every step. `reduce_max(values) -> values` takes each entry's
    maximum over the workers (they step in lockstep, so all take the slowest pace and reach the same count);
    `now` is the clock. `step_done` returns a line to log when the count was fixed or moved, else None."""

    def __init__(self, plan: StepPlan, start: int, reduce_max=lambda values: values, now=None):
        self.plan, self.start, self.reduce_max = plan, start, reduce_max
        self.now = now or time.perf_counter
        self.t0 = self.now()
        self.probe: list[float] = []  # when this attempt's step 2 and step PROBE ended
        self.ends = collections.deque(maxlen=plan.HOLD_WINDOW + 1)  # when the latest steps ended
        self.spent_before = 0.0  # of the budget, by earlier attempts' steps (the count covers them)

    def exclude(self, seconds: float) -> None:
        """Time spent since the last step on something else (an evaluation): the budget and the pace skip it."""
        self.t0 += seconds
        self.probe = [t + seconds for t in self.probe]
        self.ends = collections.deque((t + seconds for t in self.ends), maxlen=self.ends.maxlen)

    def step_done(self, done: int) -> str | None:
        plan, t = self.plan, self.now()
        if not plan.fixed and done in (self.start + 2, self.start + plan.PROBE):
            self.probe.append(t)
            if len(self.probe) == 2:
                pace, neg_budget = self.reduce_max([(self.probe[1] - self.probe[0]) / (plan.PROBE - 2), -plan.budget_s])
                plan.budget_s = -neg_budget  # the smallest budget any worker was given
                plan.fix(done, pace)
                self.spent_before = self.start * pace
                self.ends.append(t)
                return f"time budget {plan.budget_s / 60:.1f} min at {pace:.2f} s/step: {plan.steps} steps"
        self.ends.append(t)
        # only the attempt that fixed the count holds it: it knows what its steps have spent
        if len(self.probe) < 2 or done >= plan.steps or done < self.start + plan.PROBE + plan.HOLD_AFTER:
            return None
        window = min(plan.HOLD_WINDOW, done - self.start - plan.PROBE)
        pace, spent = self.reduce_max([(self.ends[-1] - self.ends[-1 - window]) / window,
                                       self.ends[-1] - self.t0 + self.spent_before])
        was = plan.steps
        if plan.hold(done, spent, pace):
            return (f"pace {pace:.2f} s/step over the last {window} steps: {plan.steps} steps instead of {was}, "
                    f"to end within the {plan.budget_s / 60:.1f} min budget")
        return None
