"""Time budgets: a pipeline's deadline shared between its stages, a step count that holds its budget when the pace
drifts, and a learning-rate schedule that ends where the count does."""
import json

import pytest


def test_pipeline_deadline_leaves_the_rest_its_time_and_the_stage_what_is_left():
    """Attention tuning's budget in a pipeline: the time to the deadline less what the rest needs (its final
    evaluation and calibration's, as long as its first; calibration's start-up, as long as its own; calibration's
    budget; 5% of the pipeline's budget), more than its own 12 min on a fast machine, less on a slow one (the
    pipeline's budget wins), and never under a minute."""
    from flexdraft.drafter.recipe import PipelineConfig
    from flexdraft.training.budget import MIN_BUDGET_S, deadline_budget

    cfg = PipelineConfig()  # 30 min in all; attention 12 on its own, calibration 3
    # the stage launched at t = 100 s, evaluated for 30 s, its steps start at t = 160 s: start-up 30 s
    reserve = 2 * 30 + 30 + 3 * 60 + 0.05 * 30 * 60
    left = deadline_budget(cfg, deadline=1900.0, launched=100.0, train_start=160.0, eval_s=30.0)
    assert left == 1900 - 160 - reserve and left > 12 * 60
    # a slow machine's distill and start-up left 10 min to the deadline: under the stage's own 12
    assert deadline_budget(cfg, deadline=760.0, launched=100.0, train_start=160.0, eval_s=30.0) == 600 - reserve
    # nothing left: a minute, so the stage still makes a drafter
    assert deadline_budget(cfg, deadline=200.0, launched=100.0, train_start=160.0, eval_s=30.0) == MIN_BUDGET_S == 60


def test_a_pace_that_drifts_moves_the_step_count_and_the_schedule_follows_without_a_jump():
    """A 15-min budget fixed at 2 s/step (450 steps); 200 steps later the machine runs at 2.6 s/step: the count
    drops to what the rest of the budget fits, the learning rate goes on from the rate it had reached and is at
    its floor (10%) on the new last step. A pace within 3% of the plan changes nothing, a faster one adds steps
    up to the config's most, and a plan restored from a checkpoint's state gives the same schedule."""
    from flexdraft.drafter.recipe import TrainConfig
    from flexdraft.training.budget import StepPlan, lr_lambda

    tc = TrainConfig(steps=1500, time_budget_min=15, warmup_steps=10)
    plan = StepPlan(tc)
    lr = lr_lambda(tc, plan)
    plan.fix(10, 2.0)
    assert plan.steps == 450
    assert not plan.hold(200, 400.0, 2.05)  # 250 x 2.05 s = 512.5 s for the 500 s left: within 3% of 900 s
    before = [lr(s) for s in range(451)]
    assert plan.hold(200, 420.0, 2.6)  # 480 s left at 2.6 s/step: 184 more steps, not 250
    assert plan.steps == 384 and plan.replans == [(200, 384)]
    after = [lr(s) for s in range(385)]
    assert after[:200] == before[:200]  # the steps taken keep their rates; step 200's is where the new cosine starts
    assert after[200] == pytest.approx(before[200])
    assert after[384] == pytest.approx(0.1) and min(after[201:]) == pytest.approx(0.1)
    assert all(a > b for a, b in zip(after[200:383], after[201:384]))  # still falling, and faster than planned
    assert all(a < b for a, b in zip(after[201:384], before[201:384]))

    assert plan.hold(300, 600.0, 1.0)  # then much faster: 300 s left buys 300 more steps
    assert plan.steps == 600 and lr(600) == pytest.approx(0.1) and lr(300) == pytest.approx(after[300])
    restored = StepPlan(tc)
    restored.restore(json.loads(json.dumps(plan.state())))  # as a checkpoint's client state
    assert [lr_lambda(tc, restored)(s) for s in range(601)] == [lr(s) for s in range(601)]
    most = StepPlan(TrainConfig(steps=500, time_budget_min=15))
    most.fix(10, 2.0)  # 450 steps; then 1 s/step: the rest would fit 680, the config allows 500
    assert most.hold(200, 220.0, 1.0) and most.steps == 500


def test_the_step_clock_fixes_the_count_from_the_slowest_worker_and_holds_it_when_the_pace_drifts():
    """A fake clock: steps of 2 s with a 15-min budget, but the other worker paces 2.2 s and was given 14 min
    (reduce_max takes the slowest and the smallest): the count is fixed at step 10 for 14 min at 2.2 s/step; when
    the steps then take 3 s, the count moves down within a step of the hold starting, and the steps stay within
    the budget (3% tolerance)."""
    from flexdraft.drafter.recipe import TrainConfig
    from flexdraft.training.budget import StepClock, StepPlan

    t = [0.0]
    plan = StepPlan(TrainConfig(steps=1500, time_budget_min=15))
    other = [2.2, -14 * 60.0]  # the other worker's pace and (negated) budget at the probe
    clock = StepClock(plan, 0, reduce_max=lambda v: [max(a, b) for a, b in zip(v, other)], now=lambda: t[0])
    events, done = [], 0
    while done < plan.steps:
        t[0] += 2.0 if done < 100 else 3.0
        done += 1
        event = clock.step_done(done)
        if done == 10:
            other[:] = [0.0, float("-inf")]  # after the probe the other worker is no slower
        if event:
            events.append((done, event))
    assert events[0] == (10, "time budget 14.0 min at 2.20 s/step: 381 steps")
    assert plan.budget_s == 14 * 60 and len(events) > 1 and events[1][0] <= 102
    assert t[0] <= 14 * 60 * 1.03 and plan.steps == done < 381
