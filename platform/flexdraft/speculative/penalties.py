"""What a request's logit processing does to the target's logits: OpenAI's `logit_bias`, presence and frequency
penalties, and vLLM's `min_tokens` and repetition penalty, applied in vLLM's order (bias and min_tokens, then
repetition, frequency, presence) to the raw logits, before temperature and top-k / top-p.

At a verify position the counts are over every token before it: the request's output so far (the prompt too,
for the repetition penalty) and the drafts on the position's own path in this step. So each position's
distribution is the one an AR step would have met there, and the rejection sampler accepts against exactly it:
a draft accepted early in a block is penalised at the positions after it.

Shapes: s = rows with processing, T = verify positions per row (1 + N draft nodes), V = vocabulary."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from flexdraft.speculative.drafts import Drafts
from flexdraft.speculative.sampling import SamplingParams


@dataclass(frozen=True)
class History:
    """One row's tokens before the step: its prompt, its output so far (the bonus included), and the tokens that
    end it (what min_tokens holds back)."""
    prompt: list[int]
    output: list[int]
    stop: set[int]


def path_counts(drafts: Drafts | None, rows: torch.Tensor, V: int) -> torch.Tensor:
    """[s, T, V]: how often each token occurs among the drafts before verify position t on its path, for `rows`
    (position 0, the bonus's, has none before it; node i has its ancestors and itself). [s, 1, V] zeros without
    drafts."""
    if drafts is None or not drafts.nodes:
        return torch.zeros(len(rows), 1, V, device=rows.device)
    onehot = torch.nn.functional.one_hot(drafts.tokens[rows], V).float()  # [s, N, V]
    return drafts.ancestors[rows][:, :, 1:].float() @ onehot  # [s, N + 1, N] @ [s, N, V]


def position_depths(drafts: Drafts | None, rows: torch.Tensor) -> torch.Tensor:
    """[s, T]: drafts before each verify position on its path (0 at the bonus, a node's depth after it)."""
    if drafts is None or not drafts.nodes:
        return torch.zeros(len(rows), 1, dtype=torch.long, device=rows.device)
    depth = drafts.depth[rows]
    return torch.cat((depth.new_zeros(len(rows), 1), depth), dim=1)


def penalised(logits: torch.Tensor, rows: list[int], params: list[SamplingParams], history: list[History],
              drafts: Drafts | None) -> torch.Tensor:
    """logits [n, T, V] (drafts: the step's for the n rows; None: a prefill or an AR step, T = 1), `rows` those
    that process logits (`SamplingParams.processes`) with their params and history -> fp32 logits [n, T, V],
    each of `rows` as its request asks, the others as they came."""
    n, T, V = logits.shape
    dev = logits.device
    out = logits.float()
    at = torch.tensor(rows, dtype=torch.long, device=dev)
    s = len(rows)
    x = out[at]  # [s, T, V] (a copy)
    output = torch.zeros(s, V, device=dev)
    prompt = torch.zeros(s, V, dtype=torch.bool, device=dev)
    for i, h in enumerate(history):
        if h.output:
            output[i] = torch.bincount(torch.tensor(h.output, device=dev), minlength=V)[:V].float()
        prompt[i, torch.tensor(h.prompt, dtype=torch.long, device=dev)] = True
    counts = output[:, None] + path_counts(drafts, at, V)  # [s, T, V]: output tokens before each position
    for i, p in enumerate(params):
        for token, bias in p.logit_bias:
            x[i, :, token] += bias
    depth = position_depths(drafts, at)  # [s, T]
    vocab = torch.arange(V, device=dev)
    for i, (p, h) in enumerate(zip(params, history)):
        if p.min_tokens and h.stop:
            early = len(h.output) + depth[i] < p.min_tokens  # [T]: a token drawn here comes before min_tokens
            stop = torch.isin(vocab, torch.tensor(sorted(h.stop), device=dev))  # [V]
            x[i] = x[i].masked_fill(early[:, None] & stop[None], float("-inf"))
    column = lambda name: torch.tensor([float(getattr(p, name)) for p in params], device=dev).view(s, 1, 1)  # noqa: E731
    seen = (counts > 0) | prompt[:, None]
    repetition = column("repetition_penalty")
    x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
    x = x - column("frequency_penalty") * counts - column("presence_penalty") * (counts > 0).float()
    if out.data_ptr() == logits.data_ptr():  # (fp32 logits: write into a copy, not the caller's tensor)
        out = out.clone()
    out[at] = x
    return out
