"""The verify forward of a step: one target forward over each row's [bonus, drafts] (a chain: a causal block; a
token tree: its nodes in scratch slots past the row's length, each seeing its own path; a parallel step: the most
probable branches' draft blocks carried through the same forward), and, after the rejection sampler, a tree's
accepted path moved to where a chain's keys/values would be. The engine commits what was accepted."""
from __future__ import annotations

from collections.abc import Callable

import torch

from flexdraft.drafter.model import Drafter, parallel_forward
from flexdraft.engine.state import RowState
from flexdraft.models.transformer import KVCache, Transformer
from flexdraft.speculative.drafts import Drafts, Verdict
from flexdraft.speculative.trees import path_slots, tree_mask


class Verifier:
    """Verify forwards over rows 0..n-1 of the engine's cache; `state.bonus` holds each row's bonus token.
    `timed(kind, fn, rows, tokens)` runs a forward and charges the step's cost model."""

    def __init__(self, target: Transformer, drafter: Drafter | None, cache: KVCache, state: RowState,
                 timed: Callable):
        self.target, self.drafter, self.cache, self.state, self.timed = target, drafter, cache, state, timed

    def forward(self, drafts: Drafts, lens: torch.Tensor, anchors: torch.Tensor | None):
        """-> logits [n, N + 1, V] at [bonus, nodes], the target's last hidden states there [n, N + 1, d], and the
        branches' hidden states [n, m, N + 1, d] (anchors [n, m] given: a parallel step) or None. A chain is a plain
        causal forward; a tree's node i goes to cache slot lens + i + 1 and sees the row's prefix and its own path."""
        n, N, dev = drafts.rows, drafts.nodes, self.target.device
        tokens = torch.cat((self.state.bonus[:n, None], drafts.tokens), dim=1)  # [n, N + 1]
        view = self.cache.rows(0, n)
        if drafts.chain:
            pos = lens[:, None] + torch.arange(N + 1, device=dev)
            if anchors is not None:
                return self.timed("parallel", lambda: self.parallel_logits(tokens, pos, view, anchors), n,
                                  (N + 1) * (1 + anchors.shape[1]))
            return *self.timed("target", lambda: self.target_logits(tokens, pos, view), n, N + 1), None
        pos = lens[:, None] + torch.cat((drafts.depth.new_zeros(n, 1), drafts.depth), dim=1)
        slots = lens[:, None] + torch.arange(N + 1, device=dev)
        span = int(lens.max()) + N + 1
        mask = tree_mask(drafts.ancestors, lens, span)  # [n, N + 1, span]
        logits, h = self.timed("target", lambda: self.target_logits(tokens, pos, view, mask=mask, span=span,
                                                                     slots=slots), n, N + 1)
        return logits, h, None

    def move_path(self, lens: torch.Tensor, drafts: Drafts, verdict: Verdict) -> tuple[torch.Tensor, torch.Tensor]:
        """A verified tree's accepted path: its nodes' keys/values moved from their slots lens + 1 + i to lens + 1..
        lens + a, where a chain's would be -> the path's tokens and their verify indices [n, depth] (then, past
        it, any)."""
        n, Bv, dev = drafts.rows, drafts.block, self.target.device
        src = path_slots(drafts.ancestors, verdict.node, verdict.accepted, Bv)  # [n, Bv]: verify indices
        dst = torch.arange(1, Bv + 1, device=dev).expand(n, Bv)
        rows = torch.arange(n, device=dev)[:, None]
        view = self.cache.rows(0, n)
        for kv in (*view.k, *view.v):  # [n, Hkv, S, D]
            kv[rows, :, lens[:, None] + dst] = kv[rows, :, lens[:, None] + src]
        tokens = torch.cat((self.state.bonus[:n, None], drafts.tokens), dim=1)
        return tokens.gather(1, src.clamp(max=drafts.nodes)), src

    def target_logits(self, tokens, pos, cache, **tree) -> tuple[torch.Tensor, torch.Tensor]:
        """[n, T] tokens -> [n, T, V] logits and [n, T, d] hidden states (the LM head is timed with the forward: at
        batch 1 it is ~15%). tree: a token tree's mask, span and slots (`Transformer.forward`)."""
        h = self.target(tokens, pos, cache, **tree)
        return self.target.logits(h), h

    def parallel_logits(self, tokens, pos, cache, anchors):
        """-> clean logits [n, T, V], their hidden states [n, T, d], branch hidden states [n, m, T, d]."""
        h, hb = parallel_forward(self.target, self.drafter, tokens, pos, cache, anchors)
        return self.target.logits(h), h, hb
