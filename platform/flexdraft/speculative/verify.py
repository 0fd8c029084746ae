"""Verification of a chain of drafts, shaped like a rejection sampler: draft ids (and, sampling, their
probabilities) and the target's logits in; accepted counts and the next (bonus) token out. Token trees are
walked by `trees.tree_walk` / `trees.tree_sample`."""
from __future__ import annotations

import torch

from flexdraft.speculative.sampling import SamplingParams, argmax_tokens, draw, filtered_logits


def greedy_accept(logits: torch.Tensor, drafts: torch.Tensor,
                  caps: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [n, Bv + 1, V] at the verify tokens [bonus, d_1..d_Bv], drafts [n, Bv] -> (accepted [n], bonus [n]):
    accept while d_j is the target's argmax (at most caps [n] drafts per row); the bonus is the argmax after the
    last accepted draft."""
    n, Bv = drafts.shape
    top = argmax_tokens(logits)  # [n, Bv + 1]
    accepted = ((drafts == top[:, :Bv]).long().cumprod(-1).sum(-1) if Bv
                else torch.zeros(n, dtype=torch.long, device=logits.device))
    if caps is not None:
        accepted = torch.minimum(accepted, caps)
    return accepted, top.gather(1, accepted[:, None]).squeeze(1)


def speculative_sample(p: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None,
                       generator: torch.Generator | None) -> tuple[int, int]:
    """One row: p [Bv + 1, V] the target's (filtered) distributions at the verify tokens, drafts [Bv], q [Bv, V]
    the (equally filtered) draft distributions (None when Bv = 0: an AR step) -> (accepted, bonus). Accept d_j with probability
    min(1, p_j(d_j) / q_j(d_j)); at the first rejection draw the bonus from normalize(max(0, p_j - q_j)), after
    all accepted from p_Bv: each emitted token is distributed exactly as the target's p."""
    Bv = drafts.shape[0]
    a = 0
    while a < Bv:
        d = drafts[a]
        if torch.rand((), generator=generator, device=p.device) >= p[a, d] / q[a, d]:
            break
        a += 1
    dist = p[a]
    if a < Bv:
        residual = (p[a] - q[a]).clamp_(min=0)
        dist = residual if residual.sum() > 0 else p[a]
    return a, int(draw(dist, generator))


def accept_rows(logits: torch.Tensor, drafts: torch.Tensor, caps: torch.Tensor, params: list[SamplingParams],
                generators: list, q: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A verify's rows: logits [n, T, V] at the verify tokens, drafts [n, Bv] -> accepted drafts [n] (at most caps
    [n]), next bonus [n]: greedy rows by `greedy_accept`, sampled rows (params[i] not greedy) by
    `speculative_sample` over their first caps[i] drafts, with their own filters, generator and draft
    distributions q [>= n, >= Bv, V] (allocated once a row samples)."""
    accepted, bonus = greedy_accept(logits, drafts, caps)
    for i, (p_i, gen) in enumerate(zip(params, generators)):
        if not p_i.greedy:
            c = min(drafts.shape[1], int(caps[i]))
            p = filtered_logits(logits[i, : c + 1], p_i).softmax(-1)  # [c + 1, V]
            accepted[i], bonus[i] = speculative_sample(p, drafts[i, :c], q[i, :c] if c else None, gen)
    return accepted, bonus
