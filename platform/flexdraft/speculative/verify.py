"""The rejection sampler: the target's logits at a step's verify tokens and the step's `Drafts` in, a `Verdict`
per row out (drafts accepted, the accepted node, the next token). One function for every proposer's drafts, as
vLLM's `RejectionSampler` consumes one `SpecDecodeMetadata`:

- greedy rows accept the deepest node whose path is the target's own argmax continuation;
- sampled rows run speculative sampling, vectorised over rows and draft positions: a chain's draft d_j is
  accepted with probability min(1, p_j(d_j) / q_j(d_j)) and at the first rejection the next token is drawn from
  normalize(max(0, p_j - q_j)), after all accepted from p; a tree of point-mass drafts tries a node's children in
  order, each accepted with probability r(c) where r is p at the node less the rejected children's mass. Either
  way each emitted token is distributed exactly as the target's p given the tokens before it.

Each sampled row draws from its own generator (`SamplingBatch`). caps [n]: the most drafts a row may have
accepted (its deeper nodes are not tried)."""
from __future__ import annotations

import torch

from flexdraft.speculative.drafts import Drafts, Verdict
from flexdraft.speculative.sampling import SamplingBatch, argmax_tokens
from flexdraft.speculative.trees import tree_walk


def rejection_sample(logits: torch.Tensor, drafts: Drafts, caps: torch.Tensor, batch: SamplingBatch) -> Verdict:
    """logits [n, N + 1, V] at [bonus, node 1..N] of each row -> Verdict."""
    if not drafts.nodes and batch.all_greedy:  # an AR step: each row's argmax
        bonus = argmax_tokens(logits[:, 0])
        zeros = torch.zeros_like(bonus)
        return Verdict(zeros, zeros, bonus)
    top = argmax_tokens(logits)  # [n, N + 1]
    allowed = drafts.depth <= caps[:, None]  # [n, N]
    match = (drafts.tokens == top.gather(1, drafts.parent)) & allowed
    if drafts.chain:
        accepted = match.long().cumprod(-1).sum(-1)
        node = accepted
    else:
        accepted, node = tree_walk(match, drafts.ancestors, drafts.depth)
    bonus = top.gather(1, node[:, None]).squeeze(1)
    if not batch.all_greedy:
        rows = batch.sampled
        p = batch.probs(logits[rows])  # [s, N + 1, V]
        sample = sample_chains if drafts.chain else sample_trees
        accepted[rows], node[rows], bonus[rows] = sample(p, drafts, rows, allowed[rows], batch)
    return Verdict(accepted, node, bonus)


def sample_chains(p: torch.Tensor, drafts: Drafts, rows: torch.Tensor, allowed: torch.Tensor,
                  batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sampled chain rows: p [s, N + 1, V] their filtered target distributions, allowed [s, N] -> accepted,
    node, bonus [s]. Drafts without q are point masses (q_j(d_j) = 1)."""
    s, N = allowed.shape
    d = drafts.tokens[rows]  # [s, N]
    p_d = p[:, :N].gather(-1, d[..., None]).squeeze(-1)  # [s, N]
    q = drafts.q[rows] if drafts.q is not None else None
    q_d = q.gather(-1, d[..., None]).squeeze(-1) if q is not None else torch.ones_like(p_d)
    u = batch.uniform(N, device=p.device)  # [s, N]
    accepted = ((u < p_d / q_d) & allowed).long().cumprod(-1).sum(-1)  # [s]
    at = torch.arange(s, device=p.device)
    target = p[at, accepted]  # [s, V]
    rejected = accepted < allowed.sum(-1)  # stopped by a rejection, not by the cap or the chain's end
    if bool(rejected.any()):
        j = accepted.clamp(max=max(N - 1, 0))
        if q is not None:
            residual = (target - q[at, j]).clamp(min=0)
        else:
            residual = target.scatter(-1, d[at, j, None], 0.0)
        residual = torch.where((residual.sum(-1, keepdim=True) > 0) & rejected[:, None], residual, target)
        target = residual
    return accepted, accepted.clone(), batch.draw(target)


def sample_trees(p: torch.Tensor, drafts: Drafts, rows: torch.Tensor, allowed: torch.Tensor,
                 batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sampled tree rows (point-mass drafts): each row walks its tree from the bonus, trying a node's children in
    order; one host read of the children's probabilities per step, the walk itself on the host."""
    s, N = allowed.shape
    tokens, parent, depth = drafts.tokens[rows], drafts.parent[rows], drafts.depth[rows]
    at = torch.arange(s, device=p.device)
    p_child = p[at[:, None], parent, tokens]  # [s, N]: p at its parent of each node's token
    u = batch.uniform(N, device=p.device)
    walks = [_walk(pc, par, tok, ok, uu) for pc, par, tok, ok, uu in
             zip(p_child.tolist(), parent.tolist(), tokens.tolist(), allowed.tolist(), u.tolist())]
    node = torch.tensor([w[0] for w in walks], dtype=torch.long, device=p.device)
    target = p[at, node].clone()  # [s, V]
    for i, (_, removed) in enumerate(walks):
        if removed:
            target[i, removed] = 0.0  # (the remaining mass is > 0: the rejected tokens did not hold all of it)
    accepted = torch.where(node > 0, depth.gather(1, (node - 1).clamp(min=0)[:, None]).squeeze(1), 0)
    return accepted, node, batch.draw(target)


def _walk(p_child: list[float], parent: list[int], tokens: list[int], allowed: list[bool],
          u: list[float]) -> tuple[int, list[int]]:
    """One row's walk -> (the accepted node's verify index, the tokens rejected at it). Child c of the current
    node is accepted when u * (1 - mass rejected there) < p(c) (c's token rejected already: probability 0)."""
    children: dict[int, list[int]] = {}
    for i, (par, ok) in enumerate(zip(parent, allowed)):
        if ok:
            children.setdefault(par, []).append(i)
    node, removed, gone, draw = 0, [], 0.0, iter(u)
    while True:
        for c in children.get(node, ()):
            t = tokens[c]
            pc = 0.0 if t in removed else p_child[c]
            if next(draw) * (1.0 - gone) < pc:
                node, removed, gone = c + 1, [], 0.0
                break
            removed.append(t)
            gone += pc
        else:
            return node, removed
