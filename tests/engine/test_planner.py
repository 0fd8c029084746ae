"""The adaptive planner learns online: forward costs from every timed step (the start-up profile only its prior),
acceptance per request (a request whose drafts fail takes AR steps while the others speculate), and a request
may switch speculation off or cap its drafts. Whatever it learns, greedy output stays AR greedy's."""
import itertools

import pytest

from conftest import ragged_prompts
from engine_fixtures import OracleProposer, drafters, tiny, tiny_folder  # noqa: F401 (fixtures)
from flexdraft.engine.ar import generate
from flexdraft.engine.config import EngineConfig
from flexdraft.engine.engine import Engine
from flexdraft.speculative.branches import CostModel
from flexdraft.speculative.drafts import Chains, DraftKind, Mode, Plan
from flexdraft.speculative.planner import Planner
from flexdraft.speculative.policy_file import Band
from flexdraft.speculative.sampling import SamplingParams


def profiled(true) -> CostModel:
    costs = CostModel()
    costs.set_profile({kind: {(n, t): true(kind, n, t) for n, t in itertools.product((1, 2, 4, 8), (1, 2, 3, 5, 9))}
                       for kind in CostModel.KINDS})
    return costs


def test_cost_model_learns_load_and_a_mispriced_shape_and_forgets_it_unseen():
    """A machine twice as busy as the profile: after 25 forwards of one shape every shape is priced ~2x (the
    load). A shape the profile prices at a third of its cost is learned within 10 of its forwards beside the
    others. Left unseen (its mode priced out), its own price fades into the load's (the slower the dearer it
    was), so the planner re-tries it; once the load halves, what it learned under the old load is forgotten;
    one noisy forward moves an estimate by about 30% at most."""
    true = lambda kind, n, t: 0.01 + 0.001 * n * t  # noqa: E731
    costs = profiled(true)
    ar, tree = ("target", 4, 1), ("target", 4, 9)
    for _ in range(25):
        costs.record(*ar, 2 * true(*ar))
    for kind, n, t in (ar, tree, ("target", 8, 5), ("draft", 2, 3), ("parallel", 1, 9)):
        assert costs.seconds(kind, n, t) == pytest.approx(2 * true(kind, n, t), rel=0.1), (kind, n, t)

    for _ in range(10):
        costs.record(*tree, 2 * 3 * true(*tree))
        costs.record(*ar, 2 * true(*ar))
    assert costs.seconds(*tree) == pytest.approx(6 * true(*tree), rel=0.1)
    assert costs.seconds(*ar) == pytest.approx(2 * true(*ar), rel=0.1)

    for _ in range(3 * 3 * CostModel.HALF_LIFE):  # the tree priced out (3 of its half-lives): AR steps only
        costs.record(*ar, 2 * true(*ar))
    assert costs.seconds(*tree) < 2 * 1.5 * true(*tree)  # most of the learned 3x forgotten
    assert costs.seconds("target", 8, 5) == pytest.approx(2 * true("target", 8, 5), rel=0.1)

    for _ in range(10):
        costs.record(*tree, 6 * true(*tree))
    for _ in range(15):  # the machine quiet again: the tree's 3x, learned under twice the load, is dropped
        costs.record(*ar, true(*ar))
    assert costs.seconds(*tree) == pytest.approx(true(*tree), rel=0.15)

    before = costs.seconds(*ar)
    costs.record(*ar, 100 * before)  # a burst
    assert costs.seconds(*ar) < 1.35 * before


class FakeClock:
    """Time that moves only when a forward runs: by cost(kind, rows, tokens per row)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def on_fake_clock(engine: Engine, cost) -> FakeClock:
    """Forwards of `engine` advance a fake clock by cost(kind, rows, tokens per row); the engine times with it."""
    clock = engine.clock = FakeClock()
    target_logits, draft = engine.verifier.target_logits, engine.proposer.forward

    def timed_target(tokens, pos, cache):
        clock.now += cost("target", *tokens.shape)
        return target_logits(tokens, pos, cache)

    def timed_draft(rows, Bv):
        clock.now += cost("draft", rows.numel(), Bv + 1)
        return draft(rows, Bv)

    engine.verifier.target_logits, engine.proposer.forward = timed_target, timed_draft
    return clock


def planned_modes(tiny, drafter, cost, wrong: bool, steps: int, prompts, before_step=lambda done: None) -> list:
    """An adaptive engine of 2 rows (no parallel, trees or lookup) profiled and timed on a fake clock by
    cost(kind, rows, tokens per row), drafting the AR reference (wrong: a token that never matches), kept full
    of requests for `steps` decoding steps -> the mode of each; every finished request equals AR greedy.
    before_step(steps done so far) may change the costs."""
    engine = Engine(tiny, drafter, EngineConfig(mode="adaptive", switch_batch=0, tree_nodes=0, lookup=0,
                                                max_batch=2, max_len=128))
    engine.profile(rounds=1, timer=lambda kind, n, T, m: cost(kind, n, T))
    params = SamplingParams(max_new_tokens=24)
    ref = {tuple(p): g.token_ids for p, g in zip(prompts, generate(tiny, prompts, params))}
    engine.proposer = OracleProposer(engine, ref, wrong=wrong)
    on_fake_clock(engine, cost)
    pending, ids, modes = list(prompts), {}, []
    while len(modes) < steps:
        while len(engine.slots) + len(engine.waiting) < 2:
            prompt = pending.pop(0)
            pending.append(prompt)
            ids[engine.add_request(prompt, params)] = prompt
        before_step(len(modes))
        s = engine.step().stats
        if not s.admitted:
            modes.append(s.mode)
        for rid in [r for r in ids if r in engine.scheduler.finished]:
            assert engine.result(rid).token_ids == ref[tuple(ids.pop(rid))]
    return modes


def test_learned_costs_follow_an_injected_change_and_the_planner_returns_when_it_pays(tiny, drafters):
    """On a fake clock, with drafts that are always right: verifying drafts cheap -> sequential steps; verify
    forwards 5x dearer from step 60 (AR then pays) -> AR steps within 25 steps (the profile still says cheap),
    over 90% of them; cheap again from step 200 -> speculative steps again within 200 steps (the learned price
    fades, the planner re-tries, measures, goes back). Greedy outputs equal AR greedy throughout."""
    verify = {"extra": 0.001}
    cost = lambda kind, n, T: 0.002 * n if kind == "draft" else 0.01 * n + (verify["extra"] * n if T > 1 else 0)  # noqa: E731

    def inject(done: int) -> None:
        verify["extra"] = 0.05 if 60 <= done < 200 else 0.001

    modes = planned_modes(tiny, drafters["trained"], cost, False, 450, ragged_prompts(40, seed=5), inject)
    assert modes[:60].count("sequential") > 50
    switched = next(i for i in range(60, 200) if modes[i] == "ar")
    assert switched - 60 <= 25 and modes[switched + 5:200].count("ar") > 0.9 * len(modes[switched + 5:200])
    back = next(i for i in range(200, 449) if modes[i] == "sequential" and modes[i + 1] == "sequential")
    assert back - 200 <= 200, back


def test_drafts_that_are_always_wrong_make_the_planner_take_ar_steps(tiny, drafters):
    """On a fake clock where verifying drafts costs barely more than an AR step, drafts that are never accepted
    leave nothing to gain: after a few steps to learn that, over 90% of steps are AR (the rest probes whether
    acceptance came back), new requests included; greedy outputs equal AR greedy."""
    cost = lambda kind, n, T: 0.002 * n if kind == "draft" else 0.01 * n + (0.0005 * n if T > 1 else 0)  # noqa: E731
    modes = planned_modes(tiny, drafters["trained"], cost, True, 200, ragged_prompts(12, seed=7))
    assert modes[:10].count("sequential") >= 1  # (it tried: the profile alone says drafts pay)
    assert modes[20:].count("ar") > 0.9 * len(modes[20:]), modes


def test_speculation_off_for_one_request_while_its_neighbours_speculate(tiny, drafters):
    """A request with max_draft_tokens=0 takes AR steps only (its share of modes is all AR, no accepted
    lengths) in the same batch whose other rows speculate; one capped at 1 never accepts more than one draft;
    all outputs equal AR greedy."""
    prompts = ragged_prompts(4, seed=3)
    params = [SamplingParams(max_new_tokens=30, max_draft_tokens=c) for c in (0, None, 1, None)]
    ref = [g.token_ids for g in generate(tiny, prompts, SamplingParams(max_new_tokens=30))]
    engine = Engine(tiny, drafters["trained"], EngineConfig(mode="sequential", max_batch=4, max_len=96))
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while engine.has_work():
        engine.step()
    results = [engine.result(i) for i in ids]
    assert [g.token_ids for g in results] == ref
    assert results[0].stats.mode_share == {"ar": 1.0} and results[0].stats.accepted_lengths == []
    assert results[1].stats.mode_share == {"sequential": 1.0} and sum(results[1].stats.accepted_lengths) > 0
    assert max(results[2].stats.accepted_lengths) == 1


def test_a_request_whose_drafts_fail_is_planned_ar_while_the_others_speculate(tiny, drafters):
    """Drafts always right for three requests and always wrong for the fourth: the fourth's own acceptance
    falls below `RowAcceptance.OFF` within a few steps, after which its row verifies no drafts but on probe steps
    (its first few, then 1 in PROBE), while the others keep speculating; outputs equal AR greedy."""
    prompts = ragged_prompts(4, seed=9)
    params = SamplingParams(max_new_tokens=40)
    ref = {tuple(p): g.token_ids for p, g in zip(prompts, generate(tiny, prompts, params))}

    class OneWrong(OracleProposer):
        def replace(self, row, ref_tokens, V, K):
            self.wrong = self.slots_now[row].prompt == prompts[3]
            super().replace(row, ref_tokens, V, K)

        def write(self, rows, logits, slots, batch, confidences, from_branch=False):
            self.slots_now = slots
            super().write(rows, logits, slots, batch, confidences, from_branch)

    engine = Engine(tiny, drafters["trained"], EngineConfig(mode="sequential", max_batch=4, max_len=96))
    engine.proposer = OneWrong(engine, ref, wrong=False)
    ids = [engine.add_request(p, params) for p in prompts]
    while engine.has_work():
        engine.step()
    results = [engine.result(i) for i in ids]
    assert [g.token_ids for g in results] == [ref[tuple(p)] for p in prompts]
    bad = results[3].stats
    assert bad.mode_share.get("ar", 0) > 0.7 and len(bad.accepted_lengths) <= 6 + bad.forwards // 8
    assert all(g.stats.mode_share == {"sequential": 1.0} for g in results[:3])


def priced_planner(true, trees: bool = True) -> Planner:
    """A planner for blocks of 4 (trees of 8 nodes, parallel at <= 4 rows) whose cost model's profile is
    true(kind, rows, tokens per row); acceptance as its prior says (no drafter tau: r = 0.5 per draft)."""
    planner = Planner(4, 4, 8, trees, cost_model=True)
    planner.costs = profiled(true)
    return planner


def learn(planner: Planner, true, dearer: list[tuple], normal: list[tuple], times: int = 20) -> None:
    """Forwards measured `times` each: the `dearer` shapes at 4x their profiled cost, the `normal` ones as profiled
    (so the cost model learns those shapes' prices, not a busier machine)."""
    for _ in range(times):
        for shape in dearer:
            planner.costs.record(*shape, 4 * true(*shape))
        for shape in normal:
            planner.costs.record(*shape, true(*shape))


def test_the_planner_picks_trees_parallel_and_lookup_steps_by_their_learned_costs():
    """Straight from `Planner.best` / `Planner.lookup`, with the cost model learning injected forward times
    (not the profile): a token tree whose verify costs about a chain's is chosen over the chain (it is expected to
    accept more); once its verifies are measured 4x dearer the chain is. Parallel steps are chosen at <= S rows
    while their forwards cost about a verify; measured 4x dearer, sequential steps are. A lookup step is taken over AR while its verify is cheap and refused once measured 4x dearer."""
    # a forward costs per row, a little more per token; a drafter pass half a target forward
    true = lambda kind, n, t: (0.005 if kind == "draft" else 0.01) * n * (1 + 0.005 * t)  # noqa: E731
    band = Band(None, "adaptive", 4, tree_nodes=8)
    planner = priced_planner(true)
    planner.switch_batch = 0  # (no parallel plans: trees against chains alone)
    assert planner.best(2, 0, Mode.SEQUENTIAL, band)[0].mode == Mode.TREE
    learn(planner, true, [("target", 2, 9)], [("target", 2, 5), ("target", 2, 1), ("draft", 2, 5)])
    assert planner.best(2, 0, Mode.SEQUENTIAL, band)[0] == Plan(Mode.SEQUENTIAL, 4)

    planner = priced_planner(true, trees=False)
    plan = planner.best(2, 0, Mode.PARALLEL, band)[0]
    assert plan.mode == Mode.PARALLEL, plan
    shape = (plan.block + 1) * (1 + plan.branches)
    learn(planner, true, [("parallel", 2, (b + 1) * (1 + m)) for m in (1, 2, 3, 5) for b in (1, 2, 4)],
          [("target", 2, b + 1) for b in (1, 2, 4)] + [("draft", 2, b + 1) for b in (1, 2, 4)], times=8)
    assert planner.costs.seconds("parallel", 2, shape) > 3 * true("parallel", 2, shape)
    assert planner.best(2, 0, Mode.PARALLEL, band)[0].mode == Mode.SEQUENTIAL

    planner = priced_planner(true, trees=False)
    kind = DraftKind("lookup", 3)
    options = [Chains(((list(range(10, 14)),), (list(range(20, 24)),)), (kind, kind))]  # a 4-token chain per row
    ar_rate = 2 / true("target", 2, 1)
    chosen = planner.lookup(options, None, ar_rate, 4)
    assert chosen is not None and chosen[0].mode == Mode.LOOKUP
    learn(planner, true, [("target", 2, b + 1) for b in (1, 2, 4)], [("target", 2, 1), ("draft", 2, 5)])
    assert planner.lookup(options, None, ar_rate, 4) is None
