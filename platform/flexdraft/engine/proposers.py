"""Where drafts come from. Every proposer's drafts reach the verifier as one `Drafts` value. As vLLM's proposers:
`DrafterProposer` (the drafter over the target's cache: sequential chains, token trees of each slot's top
candidates, and the branch of a parallel step that matched) and the `Proposer`s (engine/proposer_api.py:
`LookupProposer`'s prompt lookup and n-gram store, and any a config names), whose `Chains` the planner weighs
against the drafter's plans each step and cuts to the drafts a step verifies. `rows` are cache rows; `slots[r]`
is row r's `Request`.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from flexdraft.drafter.model import Drafter
from flexdraft.engine.proposer_api import Proposer, Verified
from flexdraft.engine.state import Request, RowState
from flexdraft.models.transformer import Transformer
from flexdraft.speculative.branches import rate_for
from flexdraft.speculative.drafts import PARALLEL, SEQUENTIAL, TREE, Chains, DraftKind, Drafts, Mode, Plan
from flexdraft.speculative.lookup import PRIOR_ACCEPTED, STORE_PRIOR_ACCEPTED, NgramStore
from flexdraft.speculative.policy_file import Band
from flexdraft.speculative.sampling import SamplingBatch, argmax_tokens, top_logprobs
from flexdraft.speculative.trees import draft_tree, tree_tokens


class DrafterProposer:
    """Drafts of the drafter. Rows keep drafts across steps in `RowState` (a parallel step's matched branch drafts
    the next step's); `propose` drafts the rows that have none and returns the step's `Drafts`.
    `timed(kind, fn, rows, tokens)` runs a forward and charges the step's cost model."""

    def __init__(self, target: Transformer, drafter: Drafter, cache, state: RowState, trees: bool, timed: Callable):
        self.target, self.drafter, self.cache, self.state, self.trees, self.timed = (
            target, drafter, cache, state, trees, timed)

    def propose(self, plan: Plan, caps: torch.Tensor, slots: list[Request], batch: SamplingBatch,
                confidences: bool) -> Drafts:
        """The drafts of rows 0..n-1 (n = len(caps)) for `plan` (sequential, tree or parallel): a drafter pass
        for rows without plan.block drafts that may speculate (caps > 0), slot 0 = their known bonus.
        confidences: whether a parallel step may come next (its pruning weighs them; else no softmax)."""
        n, Bv, state = caps.shape[0], plan.block, self.state
        need = ((state.ndrafts[:n] < Bv) & (caps > 0)).nonzero().squeeze(-1)
        if need.numel():
            logits = self.timed("draft", lambda: self.forward(need, Bv), need.numel(), Bv + 1)
            self.write(need, logits, slots, batch.subset(need.tolist()), confidences)
        if plan.mode == Mode.TREE:
            depth, parent, rank = draft_tree(state.cand_logp[:n, :Bv], plan.nodes)  # [n, N]
            return Drafts.tree(tree_tokens(state.cand[:n, :Bv], depth, rank), parent, depth, (TREE,) * n)
        kinds = [PARALLEL if b else SEQUENTIAL for b in state.from_branch[:n].tolist()]
        q = state.q[:n, :Bv] if state.q is not None and not batch.all_greedy else None
        return Drafts.chains(state.drafts[:n, :Bv], kinds, state.conf[:n, :Bv], q)

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

    def write(self, rows: torch.Tensor, logits: torch.Tensor, slots: list[Request], batch: SamplingBatch,
              confidences: bool, from_branch: bool = False) -> None:
        """Draft logits [r, Bv, V] of rows -> their drafts (argmax; sampled rows, those of `batch`, which is over
        `rows`: drawn from q, each with its request's generator) and confidences, kept in the row state."""
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
        if not batch.all_greedy:
            s = batch.sampled
            q = batch.probs(logits[s])  # [s, Bv, V]
            drafts[s] = batch.draw(q)
            conf[s] = q.gather(-1, drafts[s][..., None]).squeeze(-1)
            state.q[rows[s], :Bv] = q
        state.drafts[rows, :Bv] = drafts
        state.conf[rows, :Bv] = conf
        state.ndrafts[rows] = Bv
        state.from_branch[rows] = from_branch

    def take_branches(self, verified: Verified, hb: torch.Tensor, anchors: torch.Tensor, batch: SamplingBatch,
                      calibrate: bool, confidences: bool) -> int:
        """After a parallel step's verify, hb [n, m, Bv+1, d] its branches' hidden states: the branch whose anchor
        equals the accepted length becomes the row's drafts (calibrated with the bonus); rows whose branch was
        pruned draft sequentially next step -> how many rows missed."""
        Bv, new_bonus, slots = hb.shape[2] - 1, verified.verdict.bonus, verified.requests
        hit = anchors == verified.verdict.accepted[:, None]  # [n, m]
        rows = hit.any(-1).nonzero().squeeze(-1)
        if rows.numel():
            branch = hit[rows].float().argmax(-1)
            h = hb[rows, branch, 1:]  # [r, Bv, d]
            if calibrate:
                h = self.drafter.calibrate(self.target, h, new_bonus[rows, None].expand(-1, Bv))
            self.write(rows, self.target.logits(h), slots, batch.subset(rows.tolist()), confidences,
                       from_branch=True)
        return anchors.shape[0] - rows.numel()


class LookupProposer(Proposer):
    """Prompt-lookup drafts (the tokens that followed the latest earlier occurrence of a row's last n tokens,
    `NgramIndex`) and, with a store, the store's chain beside them. Options: the prompt's and the store's chains
    together (a trie where they differ), and with a store the prompt's alone too: a trie of two chains verifies up
    to twice the tokens, which at 4-16 rows costs more than the store's chains add."""

    name = "lookup"

    def __init__(self, block: int, store: NgramStore | None):
        self.B, self.store = block, store

    def scratch_slots(self, block: int) -> int:
        return 2 * block + 1 if self.store is not None else block + 1  # (with a store: a trie of two chains)

    def acceptance_rate(self, kind: DraftKind) -> float | None:
        """A rate whose expected accepted of 8 drafts is what drafts of the n-gram size behind them accepted
        (`lookup.PRIOR_ACCEPTED`, `STORE_PRIOR_ACCEPTED`)."""
        prior = {"lookup": PRIOR_ACCEPTED, "store": STORE_PRIOR_ACCEPTED}.get(kind.source)
        return rate_for(prior[min(max(kind.size, min(prior)), max(prior))], 8) if prior else None

    def options(self, requests: list[Request], band: Band, first: list[int] | None = None) -> list[Chains]:
        """From n-grams of up to band.lookup tokens; the rows in `first` are looked up first (16 rows: ~1 ms a
        step), and none of the others when one of them has no match."""
        if not band.lookup:
            return []
        found: list = [None] * len(requests)
        for row in first or ():
            found[row] = self._chains(requests[row], band.lookup)
            if found[row][1] is None:
                return []
        rows = [f or self._chains(req, band.lookup) for f, req in zip(found, requests)]
        both = Chains(tuple(cs for cs, _ in rows), tuple(kind for _, kind in rows))
        if not both.matched:
            return []
        if self.store is None:
            return [both]
        prompt = [(cs[:1], kind) if kind is not None and kind.source == "lookup" else ((), None) for cs, kind in rows]
        return [both, Chains(tuple(cs for cs, _ in prompt), tuple(kind for _, kind in prompt))]

    def _chains(self, req: Request, max_n: int) -> tuple[tuple, DraftKind | None]:
        cap = req.params.max_draft_tokens
        if cap == 0:  # the request asked for no speculation
            return (), None
        k = self.B if cap is None else min(cap, self.B)
        chain, size = req.index.propose(k, max_n)
        chains, kind = ([chain], DraftKind("lookup", size)) if size else ([], None)
        if self.store is not None:
            extra, size = self.store.propose(req.index.tokens, k)
            if extra and extra != chain[:len(extra)]:  # a prefix of the prompt's chain adds nothing
                chains.append(extra)
                kind = kind or DraftKind("store", size)
        return tuple(chains), kind


def critical_rows(requests: list[Request], block: int, waiting: bool) -> list[int] | None:
    """The rows that set when this batch drains: None while requests wait (a row that finishes early is refilled,
    so every row's tokens count); else the rows with the most tokens left to their max_new_tokens (within `block`
    of the most). Drafts that speed up other rows end those rows early, not the batch: at 16 rows, lookup steps
    where 9-14 rows had a match made 2.6 tokens per row, yet the batch took 62 steps against AR's 63, each dearer
    (adaptive 0.92x of AR, the same prompts in lockstep)."""
    if waiting:
        return None
    left = [req.params.max_new_tokens - len(req.tokens) for req in requests]
    return [row for row, x in enumerate(left) if x >= max(left) - block]
