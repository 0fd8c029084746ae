"""Batched autoregressive generation over the static KV cache: the baseline every speed-up is measured against,
and the prefill every decoder starts from."""
from __future__ import annotations

import time

import torch

from flexdraft.core.errors import FlexDraftError
from flexdraft.models.transformer import KVCache, Transformer
from flexdraft.speculative.sampling import Generation, SamplingParams, make_generator, sample


def check_prompts(prompts: list[list[int]], context: int, vocab_size: int) -> None:
    if not prompts:
        raise FlexDraftError("no prompts given")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise FlexDraftError(f"prompt {i} is empty")
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise FlexDraftError(f"prompt {i} has token id {bad[0]} outside the vocabulary of {vocab_size}")
        if len(p) >= context:
            raise FlexDraftError(f"prompt {i} has {len(p)} tokens: longer than the model's context of {context}")


# tokens per packed prefill forward: bounds its activations (the MLP's are tokens x 2 x intermediate size) while
# its GEMMs still see thousands of rows
PREFILL_TOKENS = 8192


def prefill_chunks(lens: list[int], budget: int = PREFILL_TOKENS) -> list[tuple[int, int]]:
    """Split rows into [start, end) runs of at most `budget` tokens each (a longer prompt is a run of its own)."""
    chunks, start, total = [], 0, 0
    for i, n in enumerate(lens):
        if i > start and total + n > budget:
            chunks.append((start, i))
            start, total = i, 0
        total += n
    chunks.append((start, len(lens)))
    return chunks


def prefill(model: Transformer, cache: KVCache, prompts: list[list[int]]) -> torch.Tensor:
    """Prefill cache rows 0..len(prompts)-1 and set their lengths; -> the last prompt token's hidden state per
    row [b, d]. The prompts go packed side by side, up to PREFILL_TOKENS per forward (`Transformer.prefill`): no
    compute goes to padding, and the GEMMs see the prompts' tokens together."""
    lens = [len(p) for p in prompts]
    h_last = [model.prefill(prompts[start:end], cache.rows(start, end)) for start, end in prefill_chunks(lens)]
    return torch.cat(h_last)


@torch.inference_mode()
def generate(model: Transformer, prompts: list[list[int]], params: SamplingParams,
             eos_token_ids=(), deadline: float | None = None) -> list[Generation]:
    """Generate for a batch of prompts of different lengths, each row at its own position.

    Rows that finish (EOS or max_new_tokens) are dropped from the cache, so later steps stop paying for them.
    deadline (epoch seconds): decoding stops there, and rows still running end with finish_reason "time".
    """
    if not params.plain:
        raise FlexDraftError("ar.generate applies no penalties, logit bias, min_tokens or grammar and reports no "
                             "logprobs: decode such requests with the Engine (mode 'ar' for plain decoding)")
    context = model.args.max_position_embeddings
    check_prompts(prompts, context, model.args.vocab_size)
    device = model.device
    t0 = time.perf_counter()
    B = len(prompts)
    order = sorted(range(B), key=lambda i: -len(prompts[i]))  # longest first: the cache spans the first's
    lens = [len(prompts[i]) for i in order]
    max_len = min(context, lens[0] + params.max_new_tokens)
    cache = model.new_cache(B, max_len)
    eos = torch.tensor(sorted(params.stop_ids(eos_token_ids)) or [-1], device=device)
    generator = make_generator(params, device)

    h_last = prefill(model, cache, [prompts[i] for i in order])
    next_tok = sample(model.logits(h_last), params, generator)  # [B]

    out = torch.zeros(B, params.max_new_tokens, dtype=torch.long, device=device)
    n_out = torch.zeros(B, dtype=torch.long, device=device)
    rows = torch.tensor(order, device=device)  # active cache row -> original prompt index
    cut = torch.zeros(B, dtype=torch.bool, device=device)  # rows the deadline stopped
    for step in range(params.max_new_tokens):
        out[rows, step] = next_tok
        n_out[rows] += 1
        # a row stops at EOS, at max_new_tokens, or when its cache (the context) is full
        done = torch.isin(next_tok, eos) | (step + 1 >= params.max_new_tokens) | (cache.lens + 1 >= max_len)
        if bool(done.any()):
            keep = (~done).nonzero().squeeze(-1)
            if keep.numel() == 0:
                break
            rows, next_tok = rows[keep], next_tok[keep]
            cache.keep_rows(keep)
        if deadline is not None and time.time() >= deadline:
            cut[rows] = True
            break
        pos = cache.lens[:, None]  # [b, 1]
        h = model(next_tok[:, None], pos, cache)  # [b, 1, d]
        cache.lens += 1
        next_tok = sample(model.logits(h[:, 0]), params, generator)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / B
    eos_set = set(eos.tolist())
    results = []
    for i in range(B):
        ids = out[i, : n_out[i]].tolist()
        reason = "eos" if ids and ids[-1] in eos_set else "time" if cut[i] else "length"
        results.append(Generation(ids, reason, seconds, len(prompts[i])))
    return results
