"""The rejection sampler on synthetic logits (no model): greedy rows accept the target's argmax continuation,
sampled rows emit tokens distributed exactly as the target's p whatever the drafts and their q, caps bound what a
row accepts, and each row draws from its own generator only."""
import math

import pytest
import torch

from flexdraft.speculative.drafts import DraftKind, Drafts
from flexdraft.speculative.sampling import SamplingBatch, SamplingParams
from flexdraft.speculative.verify import rejection_sample

V = 6
KIND = DraftKind("test")


def batch_of(n: int, seed: int = 0, **params) -> SamplingBatch:
    """n sampled rows (temperature 1 unless given), row i on a generator seeded seed + i."""
    p = SamplingParams(**{"temperature": 1.0, **params})
    return SamplingBatch.of([p] * n, [torch.Generator().manual_seed(seed + i) for i in range(n)])


def greedy_batch(n: int) -> SamplingBatch:
    return SamplingBatch.of([SamplingParams()] * n, [None] * n)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """Pearson statistic of counts [K] against probs [K] (cells expected >= 5), and its 0.999 quantile."""
    n = float(counts.sum())
    keep = probs * n >= 5
    stat = float(((counts[keep] - probs[keep] * n) ** 2 / (probs[keep] * n)).sum())
    df = int(keep.sum()) - 1
    return stat, df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3


def test_greedy_chains_accept_the_argmax_prefix_up_to_the_cap():
    """Row 0's drafts are the argmax continuation (all 3 accepted, the bonus is the argmax after them), row 1's
    second draft is wrong (1 accepted, bonus = the argmax there), row 2 is right but capped at 1."""
    logits = torch.full((3, 4, V), -5.0)
    best = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [5, 0, 1, 2]])
    logits.scatter_(-1, best[..., None], 5.0)
    drafts = Drafts.chains(torch.tensor([[1, 2, 3], [1, 0, 3], [5, 0, 1]]), [KIND] * 3)
    v = rejection_sample(logits, drafts, torch.tensor([3, 3, 1]), greedy_batch(3))
    assert v.accepted.tolist() == [3, 1, 1] and v.node.tolist() == [3, 1, 1] and v.bonus.tolist() == [4, 2, 0]


def test_greedy_tree_accepts_the_deepest_matching_path():
    """A tree whose argmax path runs through a second child: nodes 1 (a, depth 1) and 2 (b, depth 1, the argmax),
    node 3 under node 2 (the argmax there) -> 2 accepted at node 3."""
    logits = torch.full((1, 4, V), -5.0)
    for i, t in enumerate([2, 0, 4, 1]):  # argmax after the bonus, node 1, node 2, node 3
        logits[0, i, t] = 5.0
    drafts = Drafts.tree(torch.tensor([[3, 2, 4]]), torch.tensor([[0, 0, 2]]), torch.tensor([[1, 1, 2]]), [KIND])
    v = rejection_sample(logits, drafts, torch.tensor([8]), greedy_batch(1))
    assert (v.accepted.item(), v.node.item(), v.bonus.item()) == (2, 3, 1)


@pytest.mark.parametrize("shape", ["chain-q", "chain-point", "tree", "capped"])
def test_sampled_rows_emit_the_target_distribution(shape):
    """20,000 sampled rows verify drafts against fixed target logits: the first emitted token follows p_0 and,
    where the first draft was accepted, the second follows p_1 (chi-square at 0.001) — for chains whose drafts
    are drawn from a q far from p (with their q), point-mass drafts (lookup), a tree of point masses and rows
    capped at 0 drafts. The same counts fail against a subtly wrong p (the test has power), and drafts were
    both accepted and rejected."""
    g = torch.Generator().manual_seed(0)
    n, N = 20000, 2
    target = torch.randn(N + 1, V, generator=g) * 1.5
    logits = target.expand(n, -1, -1)
    p = target.softmax(-1)
    q = (torch.randn(N, V, generator=g) * 1.5).softmax(-1)
    tokens = torch.multinomial(q, n, replacement=True, generator=g).T  # [n, N] drafts drawn from q
    caps = torch.full((n,), N)
    if shape == "chain-q":
        drafts = Drafts.chains(tokens, [KIND] * n, q=q.expand(n, -1, -1))
    elif shape == "chain-point":
        drafts = Drafts.chains(tokens, [KIND] * n)
    elif shape == "tree":  # two children of the bonus (siblings differ), one grandchild under the first
        second = (tokens[:, 0] + 1 + torch.randint(0, V - 1, (n,), generator=g)) % V
        drafts = Drafts.tree(torch.stack((tokens[:, 0], second, tokens[:, 1]), 1), torch.tensor([[0, 0, 1]] * n),
                             torch.tensor([[1, 1, 2]] * n), [KIND] * n)
        logits = target[[0, 1, 1, 2]].expand(n, -1, -1)  # after each node: p of its depth
    else:
        drafts, caps = Drafts.chains(tokens, [KIND] * n, q=q.expand(n, -1, -1)), torch.zeros(n, dtype=torch.long)
    v = rejection_sample(logits, drafts, caps, batch_of(n))
    first = torch.where(v.accepted > 0, tokens[:, 0], v.bonus)
    if shape == "tree":  # the first emitted token is the depth-1 node on the accepted path
        on_path = drafts.ancestors[torch.arange(n), v.node, 1:3]  # [n, 2]: nodes 1, 2
        first = torch.where(v.accepted > 0, torch.where(on_path[:, 0], drafts.tokens[:, 0], drafts.tokens[:, 1]),
                            v.bonus)
    stat, bound = chi_square(torch.bincount(first, minlength=V).double(), p[0].double())
    assert stat < bound, (shape, stat, bound)
    wrong = (target[0] * 1.3).softmax(-1)
    assert chi_square(torch.bincount(first, minlength=V).double(), wrong.double())[0] > bound
    if shape != "capped":
        assert 0 < int((v.accepted > 0).sum()) < n
        path1 = v.accepted > 0 if shape != "tree" else (v.accepted > 0) & on_path[:, 0]
        second = torch.where(v.accepted[path1] > 1, tokens[path1, 1], v.bonus[path1])
        stat, bound = chi_square(torch.bincount(second, minlength=V).double(), p[1].double())
        assert stat < bound, (shape, "second", stat, bound)
    else:
        assert int(v.accepted.sum()) == 0


def test_each_row_draws_from_its_own_generator_only():
    """A sampled row's verdict depends on its own generator and logits alone: the same row beside other rows
    (greedy or sampled, other seeds) gets the same verdict, and a greedy row's is its argmax path."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 4, V, generator=g)
    tokens = torch.randint(0, V, (3, 3), generator=g)
    drafts = Drafts.chains(tokens, [KIND] * 3)
    caps = torch.full((3,), 3)
    params = [SamplingParams(temperature=1.0), SamplingParams(), SamplingParams(temperature=0.7, top_k=3)]
    mixed = rejection_sample(logits, drafts, caps, SamplingBatch.of(
        params, [torch.Generator().manual_seed(7), None, torch.Generator().manual_seed(1)]))
    alone = rejection_sample(logits[:1], Drafts.chains(tokens[:1], [KIND]), caps[:1], SamplingBatch.of(
        params[:1], [torch.Generator().manual_seed(7)]))
    greedy = rejection_sample(logits[1:2], Drafts.chains(tokens[1:2], [KIND]), caps[:1], greedy_batch(1))
    assert (mixed.accepted[0], mixed.bonus[0]) == (alone.accepted[0], alone.bonus[0])
    assert (mixed.accepted[1], mixed.bonus[1]) == (greedy.accepted[0], greedy.bonus[0])


def test_sampling_batch_filters_each_row_with_its_own_settings():
    """One pass filters rows with different temperatures, top-k and top-p exactly as each row alone would."""
    from flexdraft.speculative.sampling import filtered_logits

    logits = torch.randn(3, 2, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.5, top_k=5), SamplingParams(temperature=1.3, top_p=0.7),
              SamplingParams(temperature=1.0, top_k=10, top_p=0.9)]
    batch = SamplingBatch.of(params, [None] * 3)
    together = batch.filtered(logits)
    for i, sp in enumerate(params):
        torch.testing.assert_close(together[i], filtered_logits(logits[i], sp))
