"""Where drafts come from. A proposer fills the engine's per-row draft state (`RowState`: drafts d_1..,
their confidences, tree candidates, sampled rows' q) for the rows a plan needs; the engine's verifier then
checks them against the target. As vLLM's proposers: `LookupProposer` (prompt lookup and the n-gram store, no
model) and `DrafterProposer` (the drafter over the target's cache: sequential chains, the candidates a token
tree is built from, and the branch of a parallel step that matched). `rows` are cache rows; `slots[r]` is row
r's `Request`.
"""
from __future__ import annotations

from typing import Callable

import torch

from flexdraft.drafter.model import Drafter
from flexdraft.engine.state import Request, RowState
from flexdraft.models.transformer import Transformer
from flexdraft.speculative.branches import Plan
from flexdraft.speculative.lookup import NgramStore
from flexdraft.speculative.planner import Planner
from flexdraft.speculative.policy_file import Band
from flexdraft.speculative.sampling import argmax_tokens, draw, filtered_logits, top_logprobs

Chains = tuple[list[list[int]], str | None]  # one row's lookup chains and the acceptance kind (None: no match)


class DrafterProposer:
    """Drafts of the drafter. `timed(kind, fn, rows, tokens)` runs a forward and charges the step's cost model."""

    def __init__(self, target: Transformer, drafter: Drafter, cache, state: RowState, trees: bool, timed: Callable):
        self.target, self.drafter, self.cache, self.state, self.trees, self.timed = (
            target, drafter, cache, state, trees, timed)

    def propose(self, rows: torch.Tensor, Bv: int, slots: list[Request], confidences: bool) -> None:
        """A sequential drafter pass for `rows`: slot 0 = their known bonus, slots 1..Bv draft. confidences:
        whether a parallel step may come next (its pruning weighs them; else the softmax is skipped)."""
        logits = self.timed("draft", lambda: self.forward(rows, Bv), rows.numel(), Bv + 1)
        self.write(rows, logits, slots, confidences)

    def forward(self, rows: torch.Tensor, Bv: int) -> torch.Tensor:
        """-> draft logits [r, Bv, V] of a block at each row's length (slot 0 = the bonus, at its position: its
        output, the target's own next token, is d_1)."""
        dev, T = self.target.device, Bv + 1
        inputs = self.drafter.slot_inputs(self.target, self.state.bonus[rows], torch.ones_like(rows, dtype=torch.bool))
        first = int(rows[0])
        if torch.equal(rows, torch.arange(first, first + rows.numel(), device=dev)):  # contiguous: no copies
            h = self.drafter.forward_in_cache(self.target, inputs[:, :T], self.cache.rows(first, first + rows.numel()))
        else:  # scattered rows (fresh or pruned ones among others): read their prefixes by index
            lens = self.cache.lens[rows]  # [r]
            pos = lens[:, None] + torch.arange(T, device=dev)  # [r, T]
            S = int(lens.max())
            ctx = (torch.arange(S, device=dev) < lens[:, None, None]).expand(-1, T, S)  # [r, T, S]: the prefix
            clean = (torch.arange(T, device=dev) == 0).expand(rows.numel(), T)  # slot 0: the known bonus
            h = self.drafter(self.target, inputs[:, :T], pos, torch.zeros_like(pos), self.cache, ctx, rows=rows,
                             clean=clean)
        return self.target.logits(h[:, self.drafter.draft_slots(Bv, bonus_known=True)])

    def write(self, rows: torch.Tensor, logits: torch.Tensor, slots: list[Request], confidences: bool,
              from_branch: bool = False) -> None:
        """Draft logits [r, Bv, V] of rows -> drafts (argmax, or drawn from q for sampled rows) + confidences."""
        Bv, state = logits.shape[1], self.state
        if self.trees:  # a tree step may come next: keep each slot's top candidates (the first is the draft)
            logp, cand = top_logprobs(logits, state.cand.shape[-1])  # [r, Bv, K]
            state.cand[rows, :Bv], state.cand_logp[rows, :Bv] = cand, logp
            conf, drafts = logp[..., 0].exp(), cand[..., 0]
        elif confidences:
            logp, drafts = top_logprobs(logits, 1)
            conf, drafts = logp[..., 0].exp(), drafts[..., 0]  # [r, Bv]
        else:  # no parallel step can come next at this batch size: skip the softmax over the vocabulary
            drafts = argmax_tokens(logits)
            conf = torch.ones(drafts.shape, device=drafts.device)
        for i, row in enumerate(rows.tolist()):
            req = slots[row]
            if not req.params.greedy:
                q = filtered_logits(logits[i], req.params).softmax(-1)  # [Bv, V]
                drafts[i] = draw(q, req.generator)
                conf[i] = q.gather(-1, drafts[i][:, None]).squeeze(-1)
                state.q[row, :Bv] = q
        state.drafts[rows, :Bv] = drafts
        state.conf[rows, :Bv] = conf
        state.ndrafts[rows] = Bv
        state.from_branch[rows] = from_branch

    def take_branches(self, hb: torch.Tensor, anchors: torch.Tensor, accepted: torch.Tensor, new_bonus: torch.Tensor,
                      slots: list[Request], calibrate: bool, confidences: bool) -> int:
        """hb [n, m, Bv+1, d] of a parallel step: the branch whose anchor equals the accepted length becomes the
        row's drafts (calibrated with the bonus); rows whose branch was pruned draft sequentially next step
        -> how many rows missed."""
        Bv = hb.shape[2] - 1
        hit = anchors == accepted[:, None]  # [n, m]
        rows = hit.any(-1).nonzero().squeeze(-1)
        if rows.numel():
            branch = hit[rows].float().argmax(-1)
            h = hb[rows, branch, 1:]  # [r, Bv, d]
            if calibrate:
                h = self.drafter.calibrate(self.target, h, new_bonus[rows, None].expand(-1, Bv))
            self.write(rows, self.target.logits(h), slots, confidences, from_branch=True)
        return anchors.shape[0] - rows.numel()


class LookupProposer:
    """Prompt-lookup drafts (the tokens that followed the latest earlier occurrence of a row's last n tokens,
    `NgramIndex`) and, with a store, the store's chain beside them. `propose` finds this step's chains
    (`proposals`), `plan` prices a lookup step against a rate to beat, `write` sets single chains as drafts (more
    chains per row are verified as a trie by the engine)."""

    def __init__(self, block: int, store: NgramStore | None, planner: Planner):
        self.B, self.store, self.planner = block, store, planner
        self.proposals: list[Chains] = []  # this step's, per row

    def propose(self, slots: list[Request], n: int, max_n: int, first: list[int] | None = None) -> bool:
        """Rows 0..n-1's chains from n-grams of up to max_n tokens (the prompt's first); True when some row has
        one. With `first`, rows that all need one: False as soon as one has none, the others not proposed
        (16 rows: ~1 ms a step)."""
        proposals: list = [None] * n
        for row in first or ():
            proposals[row] = self._chains(slots[row], max_n)
            if proposals[row][1] is None:
                return False
        self.proposals = [p or self._chains(req, max_n) for p, req in zip(proposals, slots[:n])]
        return any(kind for _, kind in self.proposals)

    def _chains(self, req: Request, max_n: int) -> Chains:
        cap = req.params.max_draft_tokens
        if cap == 0:  # the request asked for no speculation
            return [], None
        k = self.B if cap is None else min(cap, self.B)
        chain, size = req.index.propose(k, max_n)
        chains, kind = ([chain], f"lookup{size}") if size else ([], None)
        if self.store is not None:
            extra, size = self.store.propose(req.index.tokens, k)
            if extra and extra != chain[:len(extra)]:  # a prefix of the prompt's chain adds nothing
                chains.append(extra)
                kind = kind or f"store{size}"
        return chains, kind

    def critical_rows(self, slots: list[Request], n: int, waiting: bool) -> list[int] | None:
        """The rows that set when this batch drains: None while requests wait (a row that finishes early is
        refilled, so every row's tokens count); else the rows with the most tokens left to their max_new_tokens
        (within B of the most). Drafts that speed up other rows end those rows early, not the batch: at 16 rows,
        lookup steps where 9-14 rows had a match made 2.6 tokens per row, yet the batch took 62 steps against
        AR's 63, each dearer (adaptive 0.92x of AR, the same prompts in lockstep)."""
        if waiting:
            return None
        left = [req.params.max_new_tokens - len(req.tokens) for req in slots[:n]]
        return [row for row, x in enumerate(left) if x >= max(left) - self.B]

    def plan(self, slots: list[Request], n: int, band: Band, rate_to_beat: float, waiting: bool) -> Plan | None:
        """A lookup step if one promises more than rate_to_beat tokens per second (`Planner.lookup`); it needs a
        match in every critical row (`critical_rows`). With a store it also weighs the prompt's chains alone: a
        trie of two chains verifies up to twice the tokens, which at 4-16 rows costs more than the store's chains
        add (and `proposals` becomes what won)."""
        critical = self.critical_rows(slots, n, waiting)
        if not self.propose(slots, n, band.lookup, first=critical):  # (a critical row without a match: AR, dearer)
            return None
        options = [self.proposals]
        if self.store is not None:
            options.append([(cs[:1], kind) if kind and kind.startswith("lookup") else ([], None)
                            for cs, kind in self.proposals])
        best = self.planner.lookup(options, critical, rate_to_beat, band.block or self.B)
        if best is None:
            return None
        plan, chosen = best
        self.proposals = options[chosen]
        return plan

    def write(self, state: RowState, slots: list[Request], n: int, Bv: int) -> None:
        """Rows 0..n-1 get their (single) chain, filled up to Bv with the row's bonus (a store chain can end
        early; a row without a match gets filler only), verified like any draft; sampled rows' q is the point
        mass on each draft (accepted with probability p(d_j))."""
        bonus = state.bonus[:n].tolist()
        chains = [((c[0] if c else []) + [b] * Bv)[:Bv] for (c, _), b in zip(self.proposals, bonus)]
        drafts = torch.tensor(chains, dtype=torch.long, device=state.drafts.device)  # [n, Bv]
        state.drafts[:n, :Bv] = drafts
        state.conf[:n, :Bv] = 1.0
        state.ndrafts[:n] = Bv
        state.from_branch[:n] = False
        for row in range(n):
            if not slots[row].params.greedy:
                state.q[row, :Bv] = torch.nn.functional.one_hot(drafts[row], state.q.shape[-1]).float()
