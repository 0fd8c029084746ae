"""The adaptive policy's models: how many drafts get accepted (`AcceptanceModel`), what a forward costs
(`CostModel`), and which branches a parallel step keeps (`branch_anchors`). The engine asks them; they know
nothing of the engine."""
from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import torch

from flexdraft.speculative.drafts import DRAFTER_KINDS, PARALLEL, SEQUENTIAL, TREE, DraftKind


def rate_for(mean_accepted: float, block: int) -> float:
    """r in [0, 1) with sum_{j=1..block} r^j = mean_accepted (bisection): the constant per-draft rate of a
    proposer whose blocks of `block` drafts have mean_accepted accepted on average."""
    lo, hi = 0.0, 0.999
    for _ in range(50):
        mid = (lo + hi) / 2
        if sum(mid ** j for j in range(1, block + 1)) < mean_accepted:
            lo = mid
        else:
            hi = mid
    return lo


def monotone(points: dict[tuple[int, int], float]) -> dict[tuple[int, int], float]:
    """{(rows, tokens per row): seconds} -> the same with each value at most that of every point with as many or
    more rows and tokens."""
    return {(n, t): min(s for (n2, t2), s in points.items() if n2 >= n and t2 >= t) for (n, t) in points}


class AcceptanceModel:
    """Running estimate of P(draft j accepted | drafts 1..j-1 accepted) for sequential (bonus known), tree
    (bonus known, a token tree verified) and parallel (masked slot 0, calibrated) drafts. Prior, worth
    `weight` verified blocks: a constant rate r per draft whose expected accepted length sum_j r^j matches
    the drafter's validation tau (bonus / mask calibrated / tree of N nodes) when it has one, else r = 0.5.
    Without a validation tau for its size, a tree of N nodes starts from the sequential prior's expected
    accepted drafts times 1 + 0.13 log2(N / 4): what trees of 8 / 16 / 32 nodes added over the chain on the
    default SmolLM2 drafter's validation split (+13% / +25% / +35%, 1,856 blocks). Other proposers' drafts count
    by their `DraftKind` (e.g. prompt lookup's by the size of the n-gram that matched), each from the rate
    `rate_of(kind)` gives (the proposer's `acceptance_rate`; None: r = 0.5)."""

    KINDS = DRAFTER_KINDS

    def __init__(self, block: int, prior: dict | None = None, weight: float = 20.0, tree_nodes: int = 8,
                 rate_of: Callable[[DraftKind], float | None] = lambda kind: None):
        self.block, self.weight, self.rate_of = block, weight, rate_of
        self.tried = {k: torch.full((block,), weight, dtype=torch.float64) for k in self.KINDS}
        self.passed = {}
        prior = prior or {}
        for kind, key in ((SEQUENTIAL, "bonus"), (TREE, "bonus"), (PARALLEL, "mask_calibrated")):
            tau = prior.get(f"eval/{key}/tau")
            rate = rate_for(tau - 1, block) if tau else 0.5
            if kind == TREE:
                tree_tau = prior.get(f"eval/bonus/tau_tree{tree_nodes}")
                gain = 1 + 0.13 * math.log2(max(tree_nodes, 4) / 4)
                accepted = tree_tau - 1 if tree_tau else gain * sum(rate ** j for j in range(1, block + 1))
                rate = rate_for(accepted, block)
            self.passed[kind] = torch.full((block,), weight * rate, dtype=torch.float64)

    def _model_free_kind(self, kind: DraftKind) -> None:
        if kind not in self.tried:
            rate = self.rate_of(kind)
            rate = 0.5 if rate is None else min(max(float(rate), 0.0), 0.999)
            self.tried[kind] = torch.full((self.block,), self.weight, dtype=torch.float64)
            self.passed[kind] = self.tried[kind] * rate

    def record(self, kind: DraftKind, block: int, accepted: list[int]) -> None:
        self._model_free_kind(kind)
        for a in accepted:
            n = min(a + 1, block)  # drafts 1..a passed, draft a+1 (if any) failed
            self.tried[kind][:n] += 1
            self.passed[kind][:a] += 1

    def expected_accepted(self, kind: DraftKind, block: int) -> float:
        return float(self._at_least(kind, block)[1:].sum())

    def length_distribution(self, kind: DraftKind, block: int) -> torch.Tensor:
        """[block + 1]: P(accepted = a) for a = 0..block."""
        ge = self._at_least(kind, block)
        return ge - torch.cat((ge[1:], ge.new_zeros(1)))

    def _at_least(self, kind: DraftKind, block: int) -> torch.Tensor:
        """[block + 1]: P(accepted >= a) for a = 0..block."""
        self._model_free_kind(kind)
        rate = self.passed[kind][:block] / self.tried[kind][:block]
        return torch.cat((rate.new_ones(1), rate.cumprod(0)))


class CostModel:
    """Seconds of a forward of each kind ("target": AR or verify, "draft": a sequential drafter pass,
    "parallel": verify + branches) as a function of the rows it carries and the tokens per row, on this device
    (not of total tokens: a 16-row verify of 2 tokens each costs other than 4 rows x 9 tokens).

    The prior is a profile (`Engine.profile`, or a cached one) over a grid of row counts x tokens per row;
    between grid points the time is linear in tokens per row along a measured row count, then linear in rows
    between the two nearest row counts (beyond the largest: proportional to rows). Without a profile the first
    timed forward of each shape becomes its grid point.

    Every timed forward then teaches the ratio of its shape's cost to that prior (`record`), kept relative to
    `load`, the lowest ratio among the shapes seen in the last `RECENT` forwards (how busy the machine is now).
    A shape is priced at load x its relative ratio: a shape the profile misprices (a tree of 8 nodes at 4 rows
    may cost 1.5x what the grid says) keeps its own, a shape not seen since the machine got busier or quieter
    moves with the load, and a shape never seen is priced at the load (optimistic: it gets tried and measured).
    A relative ratio fades to 1 as forwards of other shapes pass, over `HALF_LIFE` forwards times that ratio:
    a shape priced out is re-tried and re-measured, so a mode that pays again is found, and a shape k times
    dearer than the rest is re-tried k times more rarely (exploring costs about the same small share of time).
    One learned while the load was over `REGIME` times what it is now (or under) is forgotten: relative costs
    change with the load (another process on a core makes a 1-token forward cost nearly a 5-token one)."""

    KINDS = ("target", "draft", "parallel")
    SHAPE_RATE = 0.3  # per forward of that shape: a change of cost is 90% learned within ~7 of its forwards
    HALF_LIFE = 48  # forwards of other shapes after which half a shape's relative ratio is forgotten (x that ratio)
    REGIME = 1.5
    RECENT = 24  # shapes seen within this many forwards set the load
    STEP_CLIP = (0.5, 2.0)  # one forward counts as at most 2x (at least 0.5x) the current ratio: a noise burst
    # moves an estimate by at most 1 + rate, a real change of 10x is learned within ~10 forwards

    def __init__(self, online: bool = True):
        """online False: timed forwards move one common load factor only (EWMA 0.05), never one shape: the
        start-up profile decides the relative costs for good (the planner before it learned; for comparison)."""
        self.online = online
        self.points: dict[str, dict[tuple[int, int], float]] = {k: {} for k in self.KINDS}  # (rows, tokens) -> s
        self.profiled = False
        self.load = 1.0
        # shape -> (its ratio to the load then, the forward it was last seen, the load then)
        self.ratios: dict[tuple[str, int, int], tuple[float, int, float]] = {}
        self.forwards = 0  # forwards recorded
        # mode -> seconds per step outside the forwards (acceptance, sampling, branch choice, bookkeeping): they
        # differ by mode (AR's are a fraction of a parallel step's), so each mode learns its own
        self.step_overhead: dict[str, float] = {}

    def record_step(self, mode: str, seconds: float, forward_seconds: float) -> None:
        x = max(seconds - forward_seconds, 0.0)
        old = self.step_overhead.get(mode)
        self.step_overhead[mode] = x if old is None else 0.9 * old + 0.1 * x

    def overhead(self, mode: str) -> float:
        """A mode not run yet borrows the smallest overhead seen (optimistic: it gets tried, then measured)."""
        return self.step_overhead.get(mode, min(self.step_overhead.values(), default=0.0))

    def set_profile(self, points: dict[str, dict[tuple[int, int], float]]) -> None:
        self.points = {k: dict(points.get(k, {})) for k in self.KINDS}
        self.profiled, self.load, self.ratios = True, 1.0, {}

    def save_profile(self, path: Path) -> None:
        """The measured points as JSON: {kind: {"<rows>x<tokens per row>": seconds}}."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({k: {f"{rows}x{tokens}": t for (rows, tokens), t in pts.items()}
                                    for k, pts in self.points.items()}))

    def load_profile(self, path: Path) -> None:
        points = json.loads(path.read_text())
        self.set_profile({k: {tuple(map(int, key.split("x"))): t for key, t in points[k].items()}
                          for k in self.KINDS})

    def record(self, kind: str, rows: int, tokens: int, seconds: float) -> None:
        """A timed forward of `rows` rows x `tokens` tokens each."""
        self.forwards += 1
        if not self.profiled and (rows, tokens) not in self.points[kind]:
            self.points[kind][(rows, tokens)] = seconds  # the grid's first point of this shape
            return
        ratio = seconds / max(self._interpolate(kind, rows, tokens), 1e-9)
        if not self.online:
            self.load = 0.95 * self.load + 0.05 * ratio
            return
        shape = (kind, rows, tokens)
        own = self._ratio(shape)
        own += self.SHAPE_RATE * (self._clip(ratio, own) - own)
        others = [rel * self.load for other, (rel, seen, _) in self.ratios.items()
                  if other != shape and self.forwards - seen <= self.RECENT]
        self.load = min(others + [own])
        self.ratios[shape] = (own / self.load, self.forwards, self.load)

    def _clip(self, ratio: float, estimate: float) -> float:
        return min(max(ratio, self.STEP_CLIP[0] * estimate), self.STEP_CLIP[1] * estimate)

    def _ratio(self, shape: tuple[str, int, int]) -> float:
        """The shape's ratio to the prior: the load x its relative ratio, faded by the forwards since it was seen."""
        if shape not in self.ratios:
            return self.load
        rel, seen, then = self.ratios[shape]
        if max(self.load / then, then / self.load) > self.REGIME:  # learned under another load: start over
            return self.load
        half_life = self.HALF_LIFE * max(rel, 1.0)  # a dearer shape is re-tried more rarely
        return self.load * (1 + (rel - 1) * 0.5 ** ((self.forwards - seen) / half_life))

    def known(self, kind: str) -> bool:
        return bool(self.points[kind])

    def seconds(self, kind: str, rows: int, tokens: int) -> float:
        """The estimate: the prior x the shape's ratio (`_ratio`)."""
        return self._interpolate(kind, rows, tokens) * self._ratio((kind, rows, tokens))

    def _interpolate(self, kind: str, rows: int, tokens: int) -> float:
        counts = sorted({r for r, _ in self.points[kind]})
        lo, hi = [r for r in counts if r <= rows], [r for r in counts if r >= rows]
        if not hi:  # more rows than ever measured: proportional
            return self._along(kind, lo[-1], tokens) * rows / lo[-1]
        if not lo:
            return self._along(kind, hi[0], tokens)
        a, b = self._along(kind, lo[-1], tokens), self._along(kind, hi[0], tokens)
        return a if lo[-1] == hi[0] else a + (b - a) * (rows - lo[-1]) / (hi[0] - lo[-1])

    def _along(self, kind: str, rows: int, tokens: int) -> float:
        """Piecewise linear in tokens per row over the sizes measured at this row count (extended linearly)."""
        line = sorted((t, s) for (r, t), s in self.points[kind].items() if r == rows)
        if len(line) == 1:
            return line[0][1] * max(tokens / line[0][0], 1.0)
        i = next((i for i in range(1, len(line) - 1) if tokens <= line[i][0]), len(line) - 1)
        (t0, s0), (t1, s1) = line[i - 1], line[i]
        return max(s0 + (s1 - s0) * (tokens - t0) / (t1 - t0), 0.0)


def branch_anchors(conf: torch.Tensor, rho: float = 1.0, top_m: int = 0, cap: int = 0) -> torch.Tensor:
    """Selective verification: draft confidences conf [n, Bv] (q_j(d_j)) -> per row the accepted lengths a (branch
    anchors) most probable under P(accept >= a) = prod_{j<=a} c_j and P(accept = a) = P(>= a) (1 - c_{a+1}),
    [n, m], most probable first. m: every length (Bv + 1), or as few as cover `rho` of the mass in every row, at
    most top_m and cap (0 = no limit)."""
    n, Bv = conf.shape
    c = conf.double()
    ge = torch.cat((torch.ones(n, 1, dtype=c.dtype, device=c.device), c.cumprod(-1)), dim=1)  # [n, Bv+1]
    eq = ge * (1 - torch.cat((c, torch.zeros_like(c[:, :1])), dim=1))
    m = Bv + 1
    if rho < 1:
        mass = eq.sort(-1, descending=True).values.cumsum(-1)
        m = int((mass < rho * eq.sum(-1, keepdim=True)).sum(-1).max()) + 1
    for limit in (top_m, cap):
        if limit:
            m = min(m, limit)
    return eq.topk(min(m, Bv + 1), dim=-1).indices
