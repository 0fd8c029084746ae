"""Token trees as tensors: which drafts a tree step verifies (`draft_tree`), a trie of lookup chains
(`chain_trie`), and how a verified tree is walked greedily (`tree_ancestors` + `tree_walk`; sampled rows:
`verify.sample_trees`). Pure functions of their inputs; node 0 is the bonus, the root."""
from __future__ import annotations

import torch


def draft_tree(logp: torch.Tensor, N: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The token tree a tree step verifies per row: logp [n, Bv, K], each draft slot's top-K log-probabilities
    (descending) -> the (at most) N paths of highest draft probability prod_j q_j(token_j) (EAGLE-2's rule
    over the block drafter's per-slot distributions), as depth, parent, rank [n, N']: verify token i + 1 is
    slot depth[i]'s rank[i]-th candidate, its parent is verify token parent[i] (0: the bonus). Nodes are
    sorted by depth, so a parent always comes before its children."""
    n, Bv, K = logp.shape
    dev = logp.device
    score = logp.new_zeros(n, 1)  # the frontier: the best nodes of the last depth (the bonus at first)
    ids = torch.full((n, 1), -1, dtype=torch.long, device=dev)
    scores, parents, ranks, depths, count = [], [], [], [], 0
    for j in range(Bv):
        # a child scores strictly below its parent, so the best N overall always include their ancestors;
        # and only the best N of a depth can have children among them
        child = (score[:, :, None] + logp[:, j, None, :] - 1e-4).flatten(1)  # [n, F * K]
        top = child.topk(min(N, child.shape[1]), dim=-1)
        F = top.values.shape[1]
        scores.append(top.values)
        parents.append(ids.gather(1, top.indices // K))
        ranks.append(top.indices % K)
        depths.append(torch.full((n, F), j + 1, dtype=torch.long, device=dev))
        score, ids = top.values, count + torch.arange(F, device=dev).expand(n, F)
        count += F
    keep = torch.cat(scores, 1).topk(min(N, count), dim=-1).indices.sort(-1).values  # [n, N']: ids ascend by depth
    verify_index = torch.zeros(n, count + 1, dtype=torch.long, device=dev)  # node id + 1 -> verify token index
    verify_index.scatter_(1, keep + 1, torch.arange(1, keep.shape[1] + 1, device=dev).expand_as(keep))
    parent = verify_index.gather(1, torch.cat(parents, 1).gather(1, keep) + 1)
    return torch.cat(depths, 1).gather(1, keep), parent, torch.cat(ranks, 1).gather(1, keep)


def tree_tokens(cand: torch.Tensor, depth: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
    """cand [n, Bv, K] (each slot's top-K drafts), a `draft_tree`'s depth and rank [n, N] -> node tokens [n, N]."""
    return cand.flatten(1).gather(1, (depth - 1) * cand.shape[-1] + rank)


def trie_nodes(chains: list[list[int]]) -> list[tuple]:
    """The nodes of the token trie of some chains: every distinct non-empty prefix, by depth (parents first)."""
    return sorted({tuple(c[:j]) for c in chains for j in range(1, len(c) + 1)}, key=lambda p: (len(p), p))


def chain_trie(chains: list[list[list[int]]], fill: list[int], device) -> tuple[torch.Tensor, torch.Tensor,
                                                                              torch.Tensor]:
    """Per row its candidate chains (lookup drafts) merged into one token trie, a shared prefix once -> depth,
    parent, tokens [n, N] as `draft_tree` and `tree_tokens` give them (nodes sorted by depth; parent 0 = the
    bonus). Rows with fewer nodes than the largest are padded with depth-1 nodes holding their `fill` token:
    like any node they are verified, so an accepted one is the target's own token."""
    rows = []
    for row_chains in chains:
        index: dict[tuple, int] = {}  # prefix -> its node's verify index
        nodes = []  # (depth, parent, token)
        for prefix in trie_nodes(row_chains):
            index[prefix] = len(nodes) + 1
            nodes.append((len(prefix), index.get(prefix[:-1], 0), prefix[-1]))
        rows.append(nodes)
    N = max(1, *map(len, rows))
    table = torch.tensor([r + [(1, 0, f)] * (N - len(r)) for r, f in zip(rows, fill)], dtype=torch.long, device=device)
    return table[..., 0], table[..., 1], table[..., 2]


def tree_ancestors(parent: torch.Tensor) -> torch.Tensor:
    """parent [n, N] (verify token i + 1's parent; 0 = the bonus, the root) -> [n, N + 1, N + 1] bool: entry
    (i, a) says verify token a is token i or one of its ancestors."""
    n, N = parent.shape
    par = torch.cat((parent.new_zeros(n, 1), parent), dim=1)  # the root is its own parent
    anc = torch.eye(N + 1, dtype=torch.bool, device=parent.device).expand(n, -1, -1).clone()
    rows = torch.arange(n, device=parent.device)
    for i in range(1, N + 1):  # parents come first: their rows are complete
        anc[:, i] |= anc[rows, par[:, i]]
    return anc


def tree_walk(match: torch.Tensor, anc: torch.Tensor, depth: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """match [n, N]: node i's token is the target's greedy token after its parent; anc from `tree_ancestors`;
    depth [n, N] -> (accepted [n]: depth of the deepest node whose whole path matches, node [n]: its verify
    index, 0 = the bonus). Siblings hold different tokens, so at most one node per depth matches."""
    match = torch.cat((torch.ones_like(match[:, :1]), match), dim=1)  # the bonus is given
    on_path = ~(anc & ~match[:, None, :]).any(-1)  # [n, N + 1]: every node from the root to i matches
    return torch.where(on_path, torch.cat((depth.new_zeros(depth.shape[0], 1), depth), dim=1), -1).max(-1)


def tree_mask(anc: torch.Tensor, lens: torch.Tensor, span: int) -> torch.Tensor:
    """anc [n, N + 1, N + 1] (node 0: the bonus), lens [n] -> the attention mask [n, N + 1, span] of a tree whose
    node i sits in cache slot lens + i: each node sees the row's prefix and its own path."""
    n, N1 = anc.shape[0], anc.shape[1]
    rel = torch.arange(span, device=anc.device) - lens[:, None, None]  # [n, 1, span]: slot - lens
    tree_part = anc.gather(2, rel.clamp(0, N1 - 1).expand(n, N1, span)) & (rel >= 0) & (rel < N1)
    return (rel < 0) | tree_part


def path_slots(anc: torch.Tensor, node: torch.Tensor, accepted: torch.Tensor, Bv: int) -> torch.Tensor:
    """The accepted path ending at node [n] (accepted [n] nodes deep): -> [n, Bv] tree slots (1..N) of its
    nodes in depth order (nodes are sorted by depth), then j for depths j past the path: where the nodes' keys and
    values are to be read from to sit at slots 1..Bv, as a chain's would."""
    n, N = anc.shape[0], anc.shape[1] - 1
    path = anc[torch.arange(n, device=anc.device), node, 1:]  # [n, N]
    index = torch.arange(1, N + 1, device=anc.device)
    src = torch.where(path, index, N + 1).sort(-1).values[:, :Bv]  # [n, Bv]
    if src.shape[1] < Bv:  # (a tree of fewer nodes than Bv)
        src = torch.cat((src, src.new_full((n, Bv - src.shape[1]), N + 1)), dim=1)
    dst = torch.arange(1, Bv + 1, device=anc.device).expand(n, Bv)
    return torch.where(dst <= accepted[:, None], src, dst)
