"""What the engine holds per request (`Request`) and per cache row beside the cached tokens (`RowState`)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from flexdraft.engine.stats import RequestDelta
from flexdraft.speculative.branches import AcceptanceModel
from flexdraft.speculative.grammar import Matcher
from flexdraft.speculative.lookup import NgramIndex
from flexdraft.speculative.sampling import Generation, GenerationStats, SamplingParams, TokenLogprob


@dataclass
class RowAcceptance:
    """One request's drafter acceptance against the engine's acceptance model: `weight` = (accepted + PRIOR) /
    (expected + PRIOR) over its verified blocks, older blocks fading by DECAY each, so the planner weighs a
    request whose drafts keep failing (a long document, sampling at a high temperature) at what it accepts.
    Below OFF its rows verify no drafts (AR for that row while the others speculate), except every PROBE-th
    step, which drafts to notice when they pay again."""
    PRIOR, DECAY, OFF, PROBE = 2.0, 0.85, 0.3, 8

    accepted: float = 0.0  # (decayed) accepted drafts
    expected: float = 0.0  # (decayed) what the acceptance model expected of the same blocks
    steps_off: int = 0

    @property
    def weight(self) -> float:
        return min((self.accepted + self.PRIOR) / (self.expected + self.PRIOR), 2.0)

    def observe(self, accepted: int, expected: float) -> None:
        self.accepted = self.DECAY * self.accepted + accepted
        self.expected = self.DECAY * self.expected + expected

    def drafts_now(self) -> bool:
        """Whether this step drafts for the request (counts the steps it does not)."""
        if self.weight >= self.OFF:
            return True
        self.steps_off += 1
        return self.steps_off % self.PROBE == 0


@dataclass
class Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)  # accepted drafts per speculative step
    forwards: int = 0  # target forwards after the prefill (AR or verify steps)
    modes: dict = field(default_factory=dict)  # those forwards by step mode
    finish_reason: str | None = None
    index: NgramIndex | None = None  # its prompt and tokens, for lookup drafts
    acceptance: RowAcceptance = field(default_factory=RowAcceptance)
    stop: set[int] = field(default_factory=set)  # tokens that end it: params.stop_ids(the model's EOS ids)
    logprobs: list[TokenLogprob] | None = None  # one per token (params.logprobs set)
    matcher: Matcher | None = None  # its grammar's state after its tokens (params.grammar set)
    error: str | None = None  # why it ended with finish_reason "error" (its grammar could not go on)
    group: object = None  # who sent it (a client): rows are shared fairly between groups (`scheduler.schedule`)

    def emit(self, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> RequestDelta:
        """Append tokens (and their logprobs, when the request asks), cut at a stop token or max_new_tokens -> the
        step's delta of the request: the tokens kept, their logprobs, and why it finished there (if it did)."""
        room = self.params.max_new_tokens - len(self.tokens)
        emitted = []
        for t in tokens[:room]:
            emitted.append(t)
            if t in self.stop:
                self.finish_reason = "eos"
                break
        self.tokens.extend(emitted)
        if self.matcher is not None:
            self.matcher.consume(emitted)
            if self.matcher.error is not None:  # (the EOS its error state allowed is not a finished answer)
                self.finish_reason = "error"
                self.error = f"the grammar failed after {len(self.tokens)} tokens: {self.matcher.error}"
        kept = None
        if self.logprobs is not None:
            kept = tuple(logprobs[: len(emitted)])
            self.logprobs.extend(kept)
        if self.index is not None:
            self.index.extend(emitted)
        if self.finish_reason is None and len(self.tokens) >= self.params.max_new_tokens:
            self.finish_reason = "length"
        return RequestDelta(self.id, tuple(emitted), kept, self.finish_reason)

    def generation(self) -> Generation:
        """What a finished request reports: its tokens, tau (tokens per target forward, the prefill's token not
        counted: it costs the same in every mode), its accepted lengths and its forwards' mode shares."""
        tau = (len(self.tokens) - 1) / self.forwards if self.forwards else 1.0
        share = {mode: count / self.forwards for mode, count in self.modes.items()}
        return Generation(self.tokens, self.finish_reason, 0.0, len(self.prompt),
                          GenerationStats(self.accepted, tau, self.forwards, share), self.logprobs, self.error)


def draft_caps(requests: list[Request], B: int, online: bool = True) -> list[int]:
    """The most drafts each request's row may have accepted this step: its `max_draft_tokens` (0: no
    speculation), 0 while its own acceptance says drafting does not pay (`RowAcceptance`; `online` only), else B."""
    return [min(B, req.params.max_draft_tokens) if req.params.max_draft_tokens is not None
            else B if not online or req.acceptance.drafts_now() else 0 for req in requests]


def count_acceptance(requests: list[Request], model: AcceptanceModel, acc: list[int], kinds: list, caps: list[int],
                     block: int) -> list[int]:
    """After a verify of blocks of `block` drafts: each request's own acceptance against the acceptance model's
    expectation (drafter kinds), and the model's counts (rows not capped below the block) -> the accepted drafts of
    each row that verified drafts (kinds[r] None: filler or a row capped at 0)."""
    for req, a, kind, cap in zip(requests, acc, kinds, caps):
        if kind in AcceptanceModel.KINDS:
            req.acceptance.observe(a, model.expected_accepted(kind, min(block, cap)))
    full = [k if c >= block else None for k, c in zip(kinds, caps)]
    for kind in set(full) - {None}:
        model.record(kind, block, [a for a, k in zip(acc, full) if k == kind])
    return [a for a, k in zip(acc, kinds) if k is not None]


def speculating_share(requests: list[Request], caps: list[int], Bv: int) -> float:
    """How much of the acceptance model's expected drafts the rows stand to accept, averaged: a row weighs its
    cap's share of Bv times its request's own acceptance weight (the planner's `share`)."""
    return sum(min(c, Bv) / Bv * req.acceptance.weight for c, req in zip(caps, requests)) / len(requests)


@dataclass
class RowState:
    """What each cache row holds beside its cached tokens (row r of every tensor = cache row r); `move` covers
    every field, so a new one cannot be forgotten when a finished row is filled."""
    bonus: torch.Tensor  # [R] the last emitted token, not yet in the cache (it sits at position lens)
    drafts: torch.Tensor  # [R, B] d_1.. for positions lens+1..
    conf: torch.Tensor  # [R, B] fp32 q_j(d_j)
    ndrafts: torch.Tensor  # [R] valid drafts per row (0: draft first)
    from_branch: torch.Tensor  # [R] bool: a parallel branch made the drafts
    cand: torch.Tensor  # [R, B, K] each draft slot's top-K candidates (token trees)
    cand_logp: torch.Tensor  # [R, B, K] fp32, their log-probabilities
    q: torch.Tensor | None = None  # [R, B, V] fp32 draft distributions, allocated for the first sampled request

    @staticmethod
    def empty(rows: int, block: int, tree_width: int, device) -> RowState:
        zeros = lambda *shape, dtype=torch.long: torch.zeros(*shape, dtype=dtype, device=device)
        return RowState(bonus=zeros(rows), drafts=zeros(rows, block), conf=zeros(rows, block, dtype=torch.float32),
                        ndrafts=zeros(rows), from_branch=zeros(rows, dtype=torch.bool),
                        cand=zeros(rows, block, tree_width),
                        cand_logp=zeros(rows, block, tree_width, dtype=torch.float32))

    def move(self, src: int, dst: int) -> None:
        """Row src's state into row dst."""
        for f in dataclasses.fields(self):
            t = getattr(self, f.name)
            if t is not None:
                t[dst] = t[src]
