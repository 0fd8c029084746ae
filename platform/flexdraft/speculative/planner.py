"""The adaptive policy: which plan (AR, sequential, tree, parallel or lookup; drafts per row; branches) promises
the most tokens per second for the live batch, from the acceptance model (tokens) and the cost model (seconds).
It sees only numbers (rows, rows without drafts, per-row lookup kinds), never requests or the engine; the
engine proposes the lookup drafts and carries the plan out."""
from __future__ import annotations

from flexdraft.speculative.branches import AcceptanceModel, CostModel, monotone
from flexdraft.speculative.drafts import PARALLEL, SEQUENTIAL, TREE, Chains, Mode, Plan

# A lookup step replaces a planned AR step only if it promises 50% more tokens/s: with long contexts a
# multi-token verify costs more, next to a one-token step, than the profile (taken at 256 cached tokens) says
# (docs/decoding.md). Against a speculative plan (a multi-token verify too) the bias cancels: no margin.
LOOKUP_MARGIN = 1.5
REPLAN_STEPS = 16  # a cached plan is re-priced after this many steps (costs and acceptance drift slowly)
MISPRICED = 0.3  # ... or at once when its step's forwards took 30% more or less than the plan was priced at


class Planner:
    """Plans steps for `block` drafts per row at most. `trees`: tree steps may be weighed (tree_nodes: the largest);
    `switch_batch` (S): parallel plans only at <= S rows, and the rule without a cost model (parallel at <= S
    rows, sequential above). A step's `band` (`policy_file.Band`, a function of the live rows) caps the drafts
    (`block`) and sets the tree's nodes (0: no tree steps)."""

    def __init__(self, block: int, switch_batch: int, tree_nodes: int, trees: bool, cost_model: bool,
                 acceptance_prior: dict | None = None, online: bool = True, rate_of=lambda kind: None):
        self.B, self.switch_batch, self.tree_nodes, self.trees = block, switch_batch, tree_nodes, trees
        self.cost_model = cost_model
        self.acceptance = AcceptanceModel(max(block, 1), acceptance_prior, tree_nodes=tree_nodes, rate_of=rate_of)
        self.costs = CostModel(online)
        # (rows, fresh, speculating share in eighths) -> plan, tokens/s, step priced, its forwards' seconds
        self._plans: dict[tuple[int, int, int], tuple[Plan, float, int, float]] = {}
        self._last: tuple[int, int, int] | None = None  # the key of the last plan given

    def forget_plans(self) -> None:
        """Re-price every plan at its next use (after a knob changed)."""
        self._plans.clear()

    def ready(self) -> bool:
        """Whether plans are priced (a cost model with every kind measured), not the rule alone."""
        return self.cost_model and all(self.costs.known(k) for k in CostModel.KINDS)

    @staticmethod
    def block_sizes(block: int) -> list[int]:
        """The drafts per row a plan of at most `block` drafts weighs."""
        return sorted({1, 2, 4, block} & set(range(1, block + 1)))

    def adaptive(self, n: int, fresh: int, step: int, band, share: float = 1.0) -> tuple[Plan, float | None]:
        """The plan for n rows, `fresh` of them without drafts (fresh, pruned, after AR or lookup), at engine step
        `step`, within the rows' band -> (plan, its expected tokens/s; None when the rule chose it). share: the
        rows' speculating weight against the acceptance model, averaged (`RowAcceptance.weight`; 1 = as the
        model expects, 0 = no row speculates)."""
        rule = Mode.PARALLEL if n <= self.switch_batch else Mode.SEQUENTIAL
        if not self.ready():
            return Plan(rule, band.block or self.B), None
        key = (n, fresh, round(share * 8))  # (the band is a function of n)
        if key not in self._plans or step - self._plans[key][2] >= REPLAN_STEPS:
            plan, rate = self.best(n, fresh, rule, band, share)
            self._plans[key] = (plan, rate, step, self.forward_seconds(plan, n, fresh, band))
        plan, rate, _, _ = self._plans[key]
        self._last = key
        return plan, rate

    def observe(self, plan: Plan, forward_seconds: float) -> None:
        """The forwards of a step that carried out the last `adaptive` plan took forward_seconds: a plan priced
        30% off (`MISPRICED`) is re-priced at its next use, with the cost model that has learned from it."""
        entry = self._plans.get(self._last)
        if entry is not None and entry[0] == plan and abs(forward_seconds / max(entry[3], 1e-9) - 1) > MISPRICED:
            del self._plans[self._last]

    def forward_seconds(self, plan: Plan, n: int, fresh: int, band) -> float:
        """What the plan's forwards cost by the cost model (drafter passes for rows without drafts included)."""
        costs, Bv = self.costs, plan.block
        if plan.mode == Mode.AR:
            return costs.seconds("target", n, 1)
        if plan.mode == Mode.TREE:
            return costs.seconds("target", n, plan.nodes + 1) + costs.seconds("draft", n, Bv + 1)
        if plan.mode == Mode.PARALLEL:
            first = costs.seconds("draft", fresh, Bv + 1) if fresh else 0.0
            return first + costs.seconds("parallel", n, (Bv + 1) * (1 + plan.branches))
        return costs.seconds("target", n, Bv + 1) + costs.seconds("draft", n, Bv + 1)

    def best(self, n: int, fresh: int, rule: Mode, band, share: float = 1.0) -> tuple[Plan, float]:
        """-> the best plan for n rows, `fresh` of them without drafts, and its expected tokens per second; each
        row's accepted drafts are the acceptance model's times `share` (see `adaptive`)."""
        B, costs = band.block or self.B, self.costs
        acc = self.acceptance
        E = lambda kind, b: share * acc.expected_accepted(kind, b)  # noqa: E731
        best = Plan(Mode.AR)
        best_rate = n / (self.forward_seconds(best, n, fresh, band) + costs.overhead("ar"))
        for Bv in self.block_sizes(B):
            plan = Plan(Mode.SEQUENTIAL, Bv)
            rate = n * (1 + E(SEQUENTIAL, Bv)) / (self.forward_seconds(plan, n, fresh, band)
                                                    + costs.overhead("sequential"))
            if rate > best_rate:
                best, best_rate = plan, rate
        if self.trees and band.tree_nodes:
            plan = Plan(Mode.TREE, B, nodes=band.tree_nodes)
            rate = n * (1 + E(TREE, B)) / (self.forward_seconds(plan, n, fresh, band) + costs.overhead("tree"))
            if rate > best_rate:
                best, best_rate = plan, rate
        for Bv in (self.block_sizes(B) if rule == Mode.PARALLEL else ()):
            p_len = acc.length_distribution(PARALLEL, Bv).sort(descending=True).values
            # rows without drafts get a sequential drafter pass first (bonus-known drafts) and pay for it
            tokens = (n - fresh) * (1 + E(PARALLEL, Bv)) + fresh * (1 + E(SEQUENTIAL, Bv))
            for m in sorted({1, 2, 3, Bv + 1} & set(range(1, Bv + 2))):
                plan = Plan(Mode.PARALLEL, Bv, m)
                miss = max(0.0, 1 - float(p_len[:m].sum()))  # a pruned branch: a drafter pass next step
                seconds = (self.forward_seconds(plan, n, fresh, band) + costs.overhead("parallel")
                           + miss * costs.seconds("draft", n, Bv + 1))
                if tokens / seconds > best_rate:
                    best, best_rate = plan, tokens / seconds
        return best, best_rate

    def expected_accepted(self, option: Chains, block: int) -> float:
        """The drafts an option's rows are expected to accept at `block` drafts a chain, summed over its rows."""
        return sum(self.acceptance.expected_accepted(k, block) for k in option.kinds if k is not None)

    def lookup(self, options: list[Chains], critical: list[int] | None, rate_to_beat: float,
               block: int) -> tuple[Plan, int] | None:
        """The best step over proposers' `options` (each: per row its chains and kind) with 1/2/4/`block` drafts per
        row, if one promises more than rate_to_beat tokens/s -> (plan, index of the option). Rows without a match
        still get one token. `critical`: the rows that set when the batch drains (None while requests wait): then a
        step counts n times the tokens of its poorest critical row."""
        best, best_rate = None, rate_to_beat
        for i, option in enumerate(options):
            n = len(option.kinds)
            for Bv in self.block_sizes(block):
                expected = {k: self.acceptance.expected_accepted(k, Bv) for k in set(option.kinds) - {None}}
                extra = [expected[k] if k else 0.0 for k in option.kinds]  # per row
                tokens = n + (sum(extra) if critical is None else n * min(extra[r] for r in critical))
                # (a proposer's steps learn their own overhead; every step's includes what all options() took)
                seconds = self.costs.seconds("target", n, option.nodes(Bv) + 1) + self.costs.overhead(option.source)
                if tokens / seconds > best_rate:
                    best, best_rate = (Plan(Mode.LOOKUP, Bv), i), tokens / seconds
        return best


def profile_shapes(max_batch: int, block: int, switch_batch: int, tree_nodes: list[int]) -> list[tuple[str, int, int, int]]:
    """The forwards the planner prices, as (kind, rows, tokens per row, branches): target forwards of 1 token
    (AR), the verify blocks weighed, trees (of each size in tree_nodes) and a lookup trie of two chains (measured with or
    without a store: engines that differ only in their store share one profile); drafter passes; parallel
    forwards at <= switch_batch rows."""
    rows = [n for n in (1, 2, 4, 8, 16, 32, 64) if n <= max_batch]
    blocks = sorted({2, 3, 5, block + 1} & set(range(2, block + 2)))  # the block lengths the policy weighs
    verify = sorted({1, *blocks, 2 * block + 1} | {t + 1 for t in tree_nodes if t})
    shapes = [("target", n, T, 0) for n in rows for T in verify]
    shapes += [("draft", n, T, 0) for n in rows for T in blocks]
    S = min(switch_batch, max_batch)
    shapes += [("parallel", n, block + 1, m) for n in (1, 2, 4) if n <= max(S, 1) for m in (1, 2, block + 1)]
    shapes += [("parallel", 1, T, 1) for T in blocks[:-1]]  # the smallest verify + branch forwards
    return shapes


def measure(shapes: list[tuple[str, int, int, int]], timer, rounds: int) -> dict:
    """{kind: {(rows, tokens per row incl. branches): seconds}} from timer(kind, rows, tokens, branches).

    A round runs every shape once; the first warms up, and each shape keeps its fastest run of the other
    `rounds` (noise only adds). Rounds, not runs of one shape back to back: on a shared machine a slow spell
    lasts a few forwards or seconds and would catch every run of the shapes it fell on (docs/decoding.md).
    Then no shape costs more than one with as many or more rows and tokens (`monotone`)."""
    points: dict = {k: {} for k in CostModel.KINDS}
    for r in range(rounds + 1):
        for kind, n, T, m in shapes:
            seconds, key = timer(kind, n, T, m), (n, T * (1 + m))
            if r:
                points[kind][key] = min(seconds, points[kind].get(key, seconds))
    return {kind: monotone(pts) for kind, pts in points.items()}
