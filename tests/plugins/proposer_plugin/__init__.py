"""A draft source defined outside the package, as a researcher's would be: selected by its import path
(`proposer_plugin:SuffixProposer`) in an engine config, the CLI, the harness config and a Serve app's user_config
(the app's runtime_env puts tests/plugins on the replicas' PYTHONPATH), with zero edits to flexdraft.

SuffixProposer drafts, per row, the tokens that followed the latest earlier occurrence of the row's last `n` tokens
in its prompt and output. From `after_verify` it keeps what an EAGLE-style head drafts from: per request the
target's last hidden state at the last accepted token (the one whose logits gave the new bonus)."""
from __future__ import annotations

import torch

from flexdraft.engine.proposer_api import Proposer, ProposerContext, Verified
from flexdraft.speculative.drafts import Chains, DraftKind


class SuffixProposer(Proposer):
    name = "suffix"  # (when built by name, the name it was selected by)

    def __init__(self, context: ProposerContext, n: int = 1, rate: float = 0.6):
        self.block, self.n, self.rate = context.block, n, rate
        self.features: dict[int, torch.Tensor] = {}  # request id -> [d] the target's hidden state, as above
        self.verified = 0  # steps heard of

    def options(self, requests, band, first):
        rows, kinds = [], []
        for req in requests:
            chain = self._follow(req.prompt + req.tokens, band.block or self.block)
            chain = chain if req.params.max_draft_tokens != 0 else []
            rows.append((chain,) if chain else ())
            kinds.append(DraftKind("suffix", self.n) if chain else None)
        if not any(kinds) or any(kinds[r] is None for r in first or ()):
            return []
        return [Chains(tuple(rows), tuple(kinds))]

    def _follow(self, tokens: list[int], block: int) -> list[int]:
        key = tokens[-self.n:]
        for start in range(len(tokens) - self.n - 1, -1, -1):
            if tokens[start:start + self.n] == key:
                return tokens[start + self.n: start + self.n + block]
        return []

    def acceptance_rate(self, kind):
        return self.rate if kind.source == "suffix" else None

    def release(self, request_id: int) -> None:
        self.features.pop(request_id, None)

    def after_verify(self, verified: Verified) -> None:
        self.verified += 1
        rows = torch.arange(verified.drafts.rows)
        h = verified.hidden[rows, verified.verdict.node]  # [n, d]
        for r, req in enumerate(verified.requests):
            self.features[req.id] = h[r].clone()
