"""What crosses the engine's boundary about its steps: what `Engine.step` returns (`StepOutput`: one
`RequestDelta` per request that made tokens, its `StepStats`, the queue), and `SpecDecodingStats`, the running
counts a server or benchmark keeps (in the shape of vLLM's `SpecDecodingStats`: drafts, draft tokens,
accepted tokens, accepted tokens per draft position; plus steps by mode)."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

from flexdraft.speculative.drafts import Mode
from flexdraft.speculative.sampling import TokenLogprob

# the step kinds that are not a decoding mode: nothing to do; prompts prefilled (their first tokens drawn); a profile
IDLE, PREFILL, PROFILE = "idle", "prefill", "profile"
NOT_DECODING = (IDLE, PREFILL, PROFILE)


@dataclass
class StepStats:
    mode: Mode | str  # a Mode (ar | sequential | tree | parallel | lookup), or one of NOT_DECODING
    rows: int  # rows decoded this step (after admission)
    proposer: str = ""  # a lookup step's: the `Proposer` whose drafts it verified (its name)
    admitted: int = 0
    admitted_ids: list[int] = field(default_factory=list)  # the requests prefilled this step
    preempted: int = 0  # rows given up this step to a waiting client that held none (`Engine._schedule`)
    block: int = 0  # drafts verified per row
    drafted_rows: int = 0  # rows that needed a sequential drafter pass
    branches: float = 0.0  # parallel: branches kept per row (mean)
    pruned_misses: int = 0  # parallel: rows whose real accepted length fell on a pruned branch
    accepted: list[int] = field(default_factory=list)  # accepted drafts per verified row
    tokens: int = 0  # tokens emitted (admissions' first tokens included)
    seconds: float = 0.0
    forward_seconds: dict = field(default_factory=dict)  # prefill / draft / target / parallel

    @property
    def kind(self) -> str:
        """What mode shares count the step as: its mode, or for a lookup step the proposer that drafted it."""
        return self.proposer if self.mode == Mode.LOOKUP and self.proposer else str(self.mode)

    @property
    def speculative(self) -> bool:
        """Whether the step verified drafts (an AR, idle or profile step did not)."""
        return self.mode != Mode.AR and self.mode not in NOT_DECODING and bool(self.accepted)


@dataclass(frozen=True)
class RequestDelta:
    """What one step made of one request, handed unchanged from the engine to the request's stream reader: its new
    token ids (a request admitted this step: its first), their logprobs (one per token; None: not asked for), and
    the reason it finished at this step (eos | length | error; None: it goes on; `Engine.result` then hands its
    generation over once)."""
    id: int
    tokens: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None
    finish_reason: str | None = None


@dataclass(frozen=True)
class StepOutput:
    """One step's result: a delta per request that made tokens, the step's stats, and the queue after it (the ids
    of the requests in rows and of those waiting, in order)."""
    deltas: tuple[RequestDelta, ...]
    stats: StepStats
    running: tuple[int, ...] = ()
    waiting: tuple[int, ...] = ()

    @property
    def finished(self) -> list[int]:
        """The requests that ended at this step."""
        return [d.id for d in self.deltas if d.finish_reason is not None]


@dataclass
class Recovery:
    """What `Engine.recover` hands back after a step that raised: tokens[id] = every token each request in a row
    (or finished and not yet collected) has made, the requests among them that are finished (`Engine.result`
    hands each over once), and the requests the failed step was admitting; logprobs[id] one per token, for the
    requests that ask for them; waiting: the queue after it (ids, in order)."""
    tokens: dict[int, list[int]]
    finished: list[int]
    admitted: list[int]
    logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)
    waiting: tuple[int, ...] = ()


COUNTS = ("num_steps", "num_rows", "num_tokens", "num_drafts", "num_draft_tokens", "num_accepted_tokens")


@dataclass
class SpecDecodingStats:
    """Counts over steps, as vLLM counts them: a draft is one row verified by a speculative step (its
    `num_draft_tokens` are the block verified), `num_accepted_tokens_per_pos[j]` the rows that accepted draft j.
    AR steps count towards steps and tokens only. `delta(earlier)` gives the counts between two snapshots."""
    num_steps: int = 0
    num_rows: int = 0  # rows decoded, summed over steps (/ num_steps: the mean batch)
    num_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    steps_by_mode: dict[str, int] = field(default_factory=dict)  # by `StepStats.kind` (a proposer: its name)

    @staticmethod
    def of_step(step: StepStats) -> SpecDecodingStats:
        s = SpecDecodingStats(num_steps=1, num_rows=step.rows, num_tokens=step.tokens)
        if step.mode not in NOT_DECODING:
            s.steps_by_mode = {step.kind: 1}
        if step.speculative:
            acc = step.accepted
            s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens = len(acc), len(acc) * step.block, sum(acc)
            s.num_accepted_tokens_per_pos = [sum(a > j for a in acc) for j in range(max(acc))]
        return s

    def observe(self, step: StepStats) -> None:
        self.add(SpecDecodingStats.of_step(step))

    def add(self, other: SpecDecodingStats) -> None:
        for name in COUNTS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        pos = self.num_accepted_tokens_per_pos
        pos.extend([0] * (len(other.num_accepted_tokens_per_pos) - len(pos)))
        for j, n in enumerate(other.num_accepted_tokens_per_pos):
            pos[j] += n
        for mode, n in other.steps_by_mode.items():
            self.steps_by_mode[mode] = self.steps_by_mode.get(mode, 0) + n

    def delta(self, earlier: SpecDecodingStats) -> SpecDecodingStats:
        d = copy.deepcopy(self)
        for name in COUNTS:
            setattr(d, name, getattr(self, name) - getattr(earlier, name))
        for j, n in enumerate(earlier.num_accepted_tokens_per_pos):
            d.num_accepted_tokens_per_pos[j] -= n
        for mode, n in earlier.steps_by_mode.items():
            d.steps_by_mode[mode] -= n
        return d

    def copy(self) -> SpecDecodingStats:
        return copy.deepcopy(self)

    @property
    def num_target_forwards(self) -> int:
        """Steps that decoded rows: one target forward each (AR or verify)."""
        return sum(self.steps_by_mode.values())

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens per verified row of the speculative steps (accepted drafts + the bonus), vLLM's definition."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    @property
    def draft_acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None
