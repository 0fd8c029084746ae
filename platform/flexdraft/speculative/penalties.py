"""What a request's logit processing does to the target's logits: OpenAI's `logit_bias`, presence and frequency
penalties, and vLLM's `min_tokens` and repetition penalty, applied in vLLM's order (bias and min_tokens, then
repetition, frequency, presence) to the raw logits (a grammar's mask already on them), before temperature and
top-k / top-p. min_tokens holds stop tokens back only at positions where some other token may come.

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


def path_counts(drafts: Drafts | None, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[s, T, K]: how often each of tokens [s, K] occurs among the drafts before verify position t on its path, for
    `rows` (position 0, the bonus's, has none before it; node i has its ancestors and itself). [s, 1, K] zeros
    without drafts."""
    if drafts is None or not drafts.nodes:
        return torch.zeros(len(rows), 1, tokens.shape[1], device=tokens.device)
    hits = (drafts.tokens[rows][:, :, None] == tokens[:, None, :]).float()  # [s, N, K]
    return drafts.ancestors[rows][:, :, 1:].float() @ hits  # [s, N + 1, N] @ [s, N, K]


def position_depths(drafts: Drafts | None, rows: torch.Tensor) -> torch.Tensor:
    """[s, T]: drafts before each verify position on its path (0 at the bonus, a node's depth after it)."""
    if drafts is None or not drafts.nodes:
        return torch.zeros(len(rows), 1, dtype=torch.long, device=rows.device)
    depth = drafts.depth[rows]
    return torch.cat((depth.new_zeros(len(rows), 1), depth), dim=1)


def _touched(history: list[History], drafted: list[list[int]], device) -> tuple[torch.Tensor, ...]:
    """The tokens each row's penalties can change (its prompt's, its output's and this step's drafts'), padded to
    one width with the row's first such token -> tokens [s, K], their output counts [s, K], in the prompt [s, K]."""
    rows = []
    for h, extra in zip(history, drafted):
        counts: dict[int, int] = {}
        for t in h.output:
            counts[t] = counts.get(t, 0) + 1
        prompt = set(h.prompt)
        rows.append([(t, counts.get(t, 0), t in prompt) for t in sorted(prompt | counts.keys() | set(extra))])
    K = max(len(r) for r in rows)
    padded = [r + [r[0]] * (K - len(r)) for r in rows]  # (a repeat gets the same value, so scattering it is safe)
    tokens = torch.tensor([[t for t, _, _ in r] for r in padded], dtype=torch.long, device=device)
    counts = torch.tensor([[c for _, c, _ in r] for r in padded], dtype=torch.float32, device=device)
    prompt = torch.tensor([[p for _, _, p in r] for r in padded], dtype=torch.bool, device=device)
    return tokens, counts, prompt


def penalised(logits: torch.Tensor, rows: list[int], params: list[SamplingParams], history: list[History],
              drafts: Drafts | None) -> torch.Tensor:
    """logits [n, T, V] (drafts: the step's for the n rows; None: a prefill or an AR step, T = 1), `rows` those
    that process logits (`SamplingParams.processes`) with their params and history -> fp32 logits [n, T, V],
    each of `rows` as its request asks, the others as they came. The penalties touch only the tokens a row has
    seen (K of them, a few hundred), never the whole vocabulary."""
    n, T, V = logits.shape
    dev = logits.device
    out = logits.float()
    if out.data_ptr() == logits.data_ptr():  # (fp32 logits: write into a copy, not the caller's tensor)
        out = out.clone()
    at = torch.tensor(rows, dtype=torch.long, device=dev)
    depth = position_depths(drafts, at)  # [s, T]
    for i, (r, p, h) in enumerate(zip(rows, params, history)):
        for token, bias in p.logit_bias:
            out[r, :, token] += bias
        if p.min_tokens and h.stop:
            early = (len(h.output) + depth[i] < p.min_tokens).nonzero().squeeze(-1)  # positions before min_tokens
            if early.numel():  # (held back only where another token may come: a grammar's mask may allow none)
                stops = torch.tensor(sorted(h.stop), device=dev)
                others = out[r, early].index_fill(-1, stops, float("-inf"))  # [e, V]
                early = early[others.isfinite().any(-1)]
                out[r, early[:, None], stops[None]] = float("-inf")
    drafted = drafts.tokens[at].tolist() if drafts is not None and drafts.nodes else [[] for _ in rows]
    tokens, output, in_prompt = _touched(history, drafted, dev)  # [s, K]
    counts = output[:, None] + path_counts(drafts, at, tokens)  # [s, T, K]: output tokens before each position
    where = (at[:, None, None], torch.arange(T, device=dev)[None, :, None], tokens[:, None, :])
    x = out[where]  # [s, T, K]
    column = lambda name: torch.tensor([float(getattr(p, name)) for p in params], device=dev).view(-1, 1, 1)  # noqa: E731
    seen = (counts > 0) | in_prompt[:, None]
    repetition = column("repetition_penalty")
    x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
    out[where] = x - column("frequency_penalty") * counts - column("presence_penalty") * (counts > 0).float()
    return out
