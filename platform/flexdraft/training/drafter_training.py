"""Training and evaluating the drafter on self-distilled sequences (plain PyTorch; the Ray Train/DeepSpeed
wiring is in jobs.py).

Per batch of sequences: one frozen target forward without gradients gives the KV cache of every layer and
the target's next-token logits; then many blocks per sequence, anchored at random answer positions, go
through the drafter in one pass (block-diagonal masks). Shapes: R = sequences, T = padded length,
A = blocks per sequence, B = draft slots per block (slots 1..B; slot 0 is the bonus), V = vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flexdraft.core.errors import FlexDraftError
from flexdraft.drafter.model import Drafter
from flexdraft.models.transformer import KVCache, Transformer
from flexdraft.speculative.sampling import argmax_tokens, top_logprobs
from flexdraft.speculative.trees import draft_tree, tree_ancestors, tree_tokens, tree_walk


@dataclass
class Sequences:
    tokens: torch.Tensor  # [R, T] right-padded
    lens: torch.Tensor  # [R]
    prompt_lens: torch.Tensor  # [R]: answer tokens start here


def collate(rows: list[dict], device) -> Sequences:
    """rows of {"input_ids": [...], "prompt_len": int} (the distill format) -> Sequences."""
    T = max(len(r["input_ids"]) for r in rows)
    tokens = torch.zeros(len(rows), T, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : len(r["input_ids"])] = torch.as_tensor(r["input_ids"])
    lens = torch.tensor([len(r["input_ids"]) for r in rows])
    prompt_lens = torch.tensor([int(r["prompt_len"]) for r in rows])
    return Sequences(tokens.to(device), lens.to(device), prompt_lens.to(device))


@torch.no_grad()
def target_pass(target: Transformer, seqs: Sequences, sdpa: bool = True) -> tuple[KVCache, torch.Tensor]:
    """The frozen target over whole sequences -> (its KV cache, final hidden states [R, T, d]).
    Padding sits after each row's tokens, so causal attention keeps it out of every real token.
    On SDPA by default, even where training pins the math path for the block pass: this pass has no backward
    (SDPA's slow part on CPU), and a fixed choice, unlike a timed one, is the same in every worker and restart.
    sdpa=False: the model's own kernel, the block pass's (evaluation: see agreement_counts)."""
    R, T = seqs.tokens.shape
    cache = target.new_cache(R, T)
    pos = torch.arange(T, device=seqs.tokens.device).expand(R, T)
    h = target(seqs.tokens, pos, cache, sdpa=sdpa)
    cache.lens[:] = seqs.lens
    return cache, h


def valid_anchor_range(seqs: Sequences, B: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchors p with the bonus at p+1 an answer token and the whole block inside the sequence:
    prompt_len - 1 <= p <= len - B - 2. Returns (first, last) [R]; rows with last < first have none."""
    return seqs.prompt_lens - 1, seqs.lens - B - 2


def sample_anchors(seqs: Sequences, B: int, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to n distinct random anchors per row -> (anchors [R, A], valid [R, A]); invalid ones point at 0."""
    first, last = valid_anchor_range(seqs, B)
    count = (last - first + 1).clamp(min=0)
    A = int(min(n, int(count.max())))
    if A <= 0:
        raise FlexDraftError(f"no sequence in this batch is long enough for a block of {B} drafts")
    # a random permutation of each row's candidates: argsort of random keys, candidates beyond count last
    T = int(seqs.lens.max())
    keys = torch.rand(first.shape[0], T, generator=generator).to(first.device)
    offsets = torch.arange(T, device=first.device)
    keys = keys.masked_fill(offsets >= count[:, None], 2.0)
    picked = keys.argsort(-1)[:, :A]  # [R, A] offsets from first
    valid = picked < count[:, None]
    anchors = torch.where(valid, first[:, None] + picked, torch.zeros_like(picked))
    return anchors, valid


def strided_anchors(seqs: Sequences, B: int, stride: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic evaluation anchors: every stride-th valid position, at most n per row."""
    first, last = valid_anchor_range(seqs, B)
    offsets = torch.arange(n, device=first.device) * stride
    anchors = first[:, None] + offsets
    valid = anchors <= last[:, None]
    return torch.where(valid, anchors, torch.zeros_like(anchors)), valid


def draft_hidden(drafter: Drafter, target: Transformer, seqs: Sequences, cache: KVCache, anchors: torch.Tensor,
                 bonus_known: torch.Tensor) -> torch.Tensor:
    """Blocks anchored at anchors [R, A] -> hidden states of every slot [R, A, B + 1, d]."""
    R, A = anchors.shape
    B1 = drafter.config.block_size + 1
    pos = anchors[..., None] + 1 + torch.arange(B1, device=anchors.device)  # [R, A, B+1]
    bonus = seqs.tokens.gather(1, anchors + 1)  # [R, A]
    inputs = drafter.slot_inputs(target, bonus, bonus_known)  # [R, A, B+1, d]
    block_of = torch.arange(A, device=anchors.device)[None, :, None].expand(R, A, B1)
    T = seqs.tokens.shape[1]
    ctx = torch.arange(T, device=anchors.device) <= anchors[..., None]  # [R, A, T]: the prefix up to p
    ctx = ctx[:, :, None].expand(R, A, B1, T)
    N = A * B1
    clean = bonus_known[..., None] & (torch.arange(B1, device=anchors.device) == 0)  # [R, A, B+1]: known slot 0
    h = drafter(target, inputs.reshape(R, N, -1), pos.reshape(R, N), block_of.reshape(R, N), cache,
                ctx.reshape(R, N, T), clean=clean.reshape(R, N))
    return h.view(R, A, B1, -1)


def draft_outputs(h: torch.Tensor, bonus_known: torch.Tensor) -> torch.Tensor:
    """Slot hidden states [R, A, B+1, d] -> those that draft d_1..d_B [R, A, B, d] (Drafter.draft_slots)."""
    B = h.shape[2] - 1
    slots = [torch.tensor(Drafter.draft_slots(B, known), device=h.device) for known in (False, True)]
    idx = torch.where(bonus_known[..., None], slots[1], slots[0])  # [R, A, B]
    return h.gather(2, idx[..., None].expand(*idx.shape, h.shape[-1]))


def gather_positions(x: torch.Tensor, anchors: torch.Tensor, B: int) -> torch.Tensor:
    """x [R, T, ...] -> [R, A, B, ...]: x at positions p+1 .. p+B for each anchor p (where the target
    predicts the tokens that slots 1..B draft)."""
    idx = anchors[..., None] + 1 + torch.arange(B, device=anchors.device)  # [R, A, B]
    R, A, _ = idx.shape
    flat = idx.reshape(R, A * B)
    out = x.gather(1, flat.view(R, A * B, *([1] * (x.dim() - 2))).expand(R, A * B, *x.shape[2:]))
    return out.view(R, A, B, *x.shape[2:])


def block_targets(seqs: Sequences, anchors: torch.Tensor, B: int) -> torch.Tensor:
    """anchors [R, A] -> the sequence's tokens at p+2 .. p+B+1 [R, A, B], which slots 1..B draft. On distilled
    answers (the target's own greedy tokens) they are the target's argmax at p+1 .. p+B."""
    return gather_positions(seqs.tokens, anchors + 1, B)


def slot_weights(B: int, decay: float, device) -> torch.Tensor:
    """[B]: decay^(j-1) for slots j = 1..B (later slots count less: they are accepted less often)."""
    return decay ** torch.arange(B, device=device, dtype=torch.float32)


def block_loss(draft_logits: torch.Tensor, target: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor,
               kind: str) -> torch.Tensor:
    """draft logits [R, A, B, V]; target: the target's tokens [R, A, B] ("ce": cross-entropy to them) or its
    logits [R, A, B, V] ("kl": KL(p_target || q_draft)); valid [R, A] (blocks) or [R, A, B] (slots), weights [B]
    -> the weighted mean over valid slots."""
    logits = draft_logits.float()
    if kind == "ce":
        per_slot = F.cross_entropy(logits.flatten(0, -2), target.flatten(), reduction="none").view(target.shape)
    elif kind == "kl":
        logp = target.float().log_softmax(-1)
        per_slot = (logp.exp() * (logp - logits.log_softmax(-1))).sum(-1)
    else:
        raise FlexDraftError(f"unknown loss {kind!r}: ce or kl")
    w = weights * (valid if valid.dim() == 3 else valid[..., None]).float()  # [R, A, B]
    return (per_slot * w).sum() / w.sum().clamp(min=1e-9)


@dataclass
class StepOutput:
    loss: torch.Tensor
    blocks: int  # valid blocks trained
    tokens: int  # real sequence tokens in the batch


def training_step(drafter: Drafter, target: Transformer, seqs: Sequences, stage: str, anchors_per_seq: int,
                  loss_kind: str, decay: float, generator: torch.Generator) -> StepOutput:
    """The loss of one batch. attention: half the blocks with the true bonus in slot 0, half masked;
    calibration: every block masked, drafter frozen, the MLP fed the true bonus."""
    B = drafter.config.block_size
    cache, h = target_pass(target, seqs)
    anchors, valid = sample_anchors(seqs, B, anchors_per_seq, generator)
    if loss_kind == "ce":  # the target's greedy tokens are in the distilled answers: no LM head for them
        wanted = block_targets(seqs, anchors, B)  # [R, A, B]
    else:
        with torch.no_grad():
            wanted = target.logits(gather_positions(h, anchors, B))  # [R, A, B, V]
    weights = slot_weights(B, decay, anchors.device)  # [B]
    slot_valid = valid  # [R, A], or [R, A, B] where some slots of a block do not count
    if stage == "attention":
        bonus_known = (torch.rand(anchors.shape, generator=generator) < 0.5).to(anchors.device)
        hd = draft_outputs(draft_hidden(drafter, target, seqs, cache, anchors, bonus_known), bonus_known)
        # a known bonus's draft d_1 is the target's own prediction (nothing to learn): no loss there
        first = torch.arange(B, device=anchors.device) == 0
        slot_valid = valid[..., None] & ~(bonus_known[..., None] & first)
    else:
        with torch.no_grad():
            hd = draft_hidden(drafter, target, seqs, cache, anchors, torch.zeros_like(valid))[:, :, 1:]
        bonus = seqs.tokens.gather(1, anchors + 1)[..., None].expand(hd.shape[:-1])
        hd = drafter.calibrate(target, hd, bonus)
    loss = block_loss(target.logits(hd), wanted, slot_valid, weights, loss_kind)
    return StepOutput(loss, int(valid.sum()), int(seqs.lens.sum()))


MODES = ("bonus", "mask", "mask_calibrated")
TREES = (8, 16)  # token-tree sizes (engine tree mode, top-4 drafts per slot) whose accepted length is evaluated too


def tree_accepted(logits: torch.Tensor, target_tokens: torch.Tensor, nodes: int, width: int = 4) -> torch.Tensor:
    """Draft logits [M, B, V] of M blocks (d_1..d_B), the target's greedy continuation [M, B] -> drafts a token
    tree of `nodes` drafts would accept per block [M], as the engine's tree mode builds and walks it."""
    logp, cand = top_logprobs(logits, width)  # [M, B, K]
    depth, parent, rank = draft_tree(logp, nodes)
    tokens = tree_tokens(cand, depth, rank)  # [M, N]
    return tree_walk(tokens == target_tokens.gather(1, depth - 1), tree_ancestors(parent), depth)[0]


@torch.no_grad()
def agreement_counts(drafter: Drafter, target: Transformer, seqs: Sequences, stride: int, max_anchors: int) -> dict:
    """For each mode (slot 0 = true bonus; masked; masked + calibration): per-slot counts of draft argmax ==
    target argmax, and the summed agreeing-prefix length, over strided anchors; with the bonus known, also the
    drafts token trees of TREES nodes would accept. Sums, so workers can add.
    The target's tokens come from the block pass's own kernel, as in the engine, where one kernel serves the
    verify and the drafter pass: a known bonus's draft d_1 then is the target's argmax bitwise (two kernels
    disagree at bf16 near-ties, which would read tau low)."""
    B = drafter.config.block_size
    cache, h = target_pass(target, seqs, sdpa=False)
    anchors, valid = strided_anchors(seqs, B, stride, max_anchors)
    target_tokens = argmax_tokens(target.logits(gather_positions(h, anchors, B)))  # [R, A, B]
    bonus = seqs.tokens.gather(1, anchors + 1)
    out = {"blocks": int(valid.sum())}
    for mode in MODES:
        known = torch.full_like(valid, mode == "bonus")
        hd = draft_outputs(draft_hidden(drafter, target, seqs, cache, anchors, known), known)
        if mode == "mask_calibrated":
            hd = drafter.calibrate(target, hd, bonus[..., None].expand(hd.shape[:-1]))
        logits = target.logits(hd)  # [R, A, B, V]
        agree = (argmax_tokens(logits) == target_tokens) & valid[..., None]  # [R, A, B]
        out[f"{mode}.agree"] = agree.sum((0, 1)).tolist()
        out[f"{mode}.prefix"] = int(agree.long().cumprod(-1).sum())
        if mode == "bonus":  # sequential drafts verified as token trees (the engine's tree mode)
            for N in TREES:
                out[f"bonus.tree{N}.prefix"] = int(tree_accepted(logits[valid], target_tokens[valid], N).sum())
    return out


def add_counts(a: dict, b: dict) -> dict:
    return {k: ([x + y for x, y in zip(a[k], b[k])] if isinstance(a[k], list) else a[k] + b[k]) for k in a}


def agreement_metrics(counts: dict) -> dict[str, float]:
    """Counts -> per-slot top-1 agreement acc_j, the real greedy accepted length tau = mean agreeing prefix
    + 1 (the bonus), and the implied one from per-slot rates, 1 + sum_a prod_{j<=a} acc_j; bonus/tau_treeN: the
    accepted length + 1 when the bonus-known drafts are verified as a token tree of N nodes."""
    n = max(counts["blocks"], 1)
    metrics = {"eval_blocks": float(counts["blocks"])}
    for mode in MODES:
        acc = [c / n for c in counts[f"{mode}.agree"]]
        for j, a in enumerate(acc, 1):
            metrics[f"{mode}/acc_slot{j}"] = a
        metrics[f"{mode}/tau"] = 1 + counts[f"{mode}.prefix"] / n
        implied, prod = 1.0, 1.0
        for a in acc:
            prod *= a
            implied += prod
        metrics[f"{mode}/tau_implied"] = implied
    for N in TREES:
        metrics[f"bonus/tau_tree{N}"] = 1 + counts[f"bonus.tree{N}.prefix"] / n
    return metrics
