"""What a step's requests ask of the target's output beyond their tokens: logits processed as each request's
penalties and grammar say (what the rejection sampler judges drafts against), the log-probabilities of the tokens
they emit, and which of the requests being admitted share one prefill (the n choices of a prompt).

Shapes: n = rows, T = verify positions per row, P = tokens emitted per row (at most), V = vocabulary."""
from __future__ import annotations

import torch

from flexdraft.engine.state import Request
from flexdraft.speculative.drafts import Drafts, Verdict
from flexdraft.speculative.grammar import constrained
from flexdraft.speculative.penalties import History, penalised
from flexdraft.speculative.sampling import TokenLogprob, token_logprobs


def processed(logits: torch.Tensor, requests: list[Request], drafts: Drafts | None) -> torch.Tensor:
    """logits [n, T, V] of the requests' rows (drafts: the step's; None at a prefill) -> masked by each request's
    grammar (`grammar.constrained`), then as its penalties, bias and min_tokens make them (`penalties.penalised`);
    the same tensor when no request asks for either. The grammar goes first so that it wins: min_tokens holds a
    stop token back only where the grammar allows another token (a complete JSON value allows only EOS)."""
    rows = [i for i, r in enumerate(requests) if r.matcher is not None]
    if rows:
        logits = constrained(logits, rows, [requests[i].matcher for i in rows], drafts)
    rows = [i for i, r in enumerate(requests) if r.params.processes]
    if rows:
        logits = penalised(logits, rows, [requests[i].params for i in rows],
                           [History(requests[i].prompt, requests[i].tokens, requests[i].stop) for i in rows], drafts)
    return logits


def emitted_logprobs(logits: torch.Tensor, requests: list[Request], tokens: torch.Tensor,
                     positions: torch.Tensor | None = None) -> dict[int, list[TokenLogprob]]:
    """{row: the TokenLogprob of each of tokens [n, P]} for the rows whose request asks for logprobs; logits
    [n, T, V] raw, as the target made them; positions [n, P] the verify index that emitted each token (None:
    0..P-1)."""
    rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    if not rows:
        return {}
    at = torch.tensor(rows, dtype=torch.long, device=logits.device)
    x = logits[at] if positions is None else logits[at[:, None], positions[at]]  # [s, P, V]
    return dict(zip(rows, token_logprobs(x, tokens[at], [requests[i].params.logprobs for i in rows])))


def committed_logprobs(logits: torch.Tensor, requests: list[Request], path: torch.Tensor, src: torch.Tensor | None,
                       verdict: Verdict, nodes: int) -> dict[int, list[TokenLogprob]]:
    """After a verify: {row: the TokenLogprob of its accepted drafts and bonus, then of drafts past them} for the rows
    whose request asks for logprobs. path [n, Bv]: the drafts along each row's accepted path; src [n, Bv] their
    verify indices (None: a chain, 1..Bv); logits [n, nodes + 1, V] raw."""
    if all(r.params.logprobs is None for r in requests):
        return {}
    n = path.shape[0]
    bonus, accepted = verdict.bonus[:, None], verdict.accepted[:, None]
    tokens = torch.cat((path, bonus), dim=1).scatter(1, accepted, bonus)  # [n, Bv + 1]: drafts, the bonus at acc
    positions = None if src is None else torch.cat((src.new_zeros(n, 1), src.clamp(max=nodes)), dim=1)
    return emitted_logprobs(logits, requests, tokens, positions)


def shared_prefills(new: list[Request]) -> tuple[list[Request], list[Request], list[int]]:
    """Requests to admit (longest first) -> (their rows' order: one request per distinct token sequence first,
    the requests repeating one after them; those first ones, which are prefilled; per row the index among them of
    the row it copies its cache from)."""
    key = lambda req: tuple(req.prompt + req.tokens)  # noqa: E731
    firsts: dict[tuple, int] = {}  # tokens -> the index in `new` of the first request holding them
    for i, req in enumerate(new):
        firsts.setdefault(key(req), i)
    unique = [new[i] for i in firsts.values()]
    rows = unique + [req for i, req in enumerate(new) if firsts[key(req)] != i]
    prefilled = {k: j for j, k in enumerate(firsts)}
    return rows, unique, [prefilled[key(req)] for req in rows]
