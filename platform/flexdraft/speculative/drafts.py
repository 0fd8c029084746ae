"""The values one decoding step hands from part to part: the decoding `Mode`, the step's `Plan`, the `Drafts` a
proposer returns (a token tree per row; a chain is the tree whose every node hangs from the one before) with the
`DraftKind` each row's acceptance counts towards, and the rejection sampler's `Verdict`.

Shapes: n = rows, N = draft nodes per row, V = vocabulary. Verify index 0 is the row's bonus token (the last
emitted one, not yet in the cache); node i sits at verify index i + 1."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from functools import cached_property

import torch

from flexdraft.speculative.trees import chain_trie, tree_ancestors, trie_nodes


class Mode(enum.StrEnum):
    """Decoding modes; a str (its name is its value), so configs, policy files and metrics take the plain names."""
    AR = "ar"
    SEQUENTIAL = "sequential"
    TREE = "tree"
    PARALLEL = "parallel"
    LOOKUP = "lookup"  # drafts from a `Proposer`'s options: prompt lookup and the n-gram store, or one a config names
    ADAPTIVE = "adaptive"


MODES = tuple(m.value for m in Mode)
NO_DRAFTER = (Mode.AR, Mode.LOOKUP)  # the modes that run without a drafter


@dataclass(frozen=True)
class DraftKind:
    """Which acceptance statistics a row's drafts count towards: their source and, for n-gram drafts (`lookup`,
    `store`), the size of the n-gram that matched."""
    source: str
    size: int = 0

    def __str__(self) -> str:
        return f"{self.source}{self.size or ''}"


SEQUENTIAL, TREE, PARALLEL = DraftKind("sequential"), DraftKind("tree"), DraftKind("parallel")
DRAFTER_KINDS = (SEQUENTIAL, TREE, PARALLEL)  # the drafter's; the others are model-free


@dataclass(frozen=True)
class Plan:
    """What one step does: its mode, drafts verified per row (a tree: its depth at most), the most branches kept
    per row (parallel; 0 = as the config's top_m / rho decide), a tree's nodes (tree), and the drafts a
    proposer's option already made for it and that proposer's name (lookup)."""
    mode: Mode
    block: int = 0
    branches: int = 0
    nodes: int = 0
    proposer: str = ""
    drafts: Drafts | None = field(default=None, compare=False)  # (this step's: not part of the plan's shape)


@dataclass(frozen=True, eq=False)
class Drafts:
    """Per row a token tree of drafts, nodes sorted by depth where they are real (rows with fewer nodes than the
    widest are padded with depth-1 nodes that hang from the bonus; like any node they are verified, so one
    accepted is the target's own token).

    tokens, parent, depth [n, N]: node i's token, the verify index of its parent (0: the bonus), its depth.
    kinds: per row, the acceptance statistics its drafts count towards (None: filler, counted nowhere).
    probs [n, N] fp32: the proposer's probability of each node (its confidence; 1 for model-free drafts).
    q [n, N, V] fp32: a chain's full draft distributions for sampled rows (None: each draft a point mass)."""
    tokens: torch.Tensor
    parent: torch.Tensor
    depth: torch.Tensor
    kinds: tuple
    probs: torch.Tensor
    q: torch.Tensor | None = None
    chain: bool = False

    @staticmethod
    def chains(tokens: torch.Tensor, kinds, probs: torch.Tensor | None = None,
               q: torch.Tensor | None = None) -> Drafts:
        """tokens [n, Bv]: one chain per row."""
        n, N = tokens.shape
        index = torch.arange(N, device=tokens.device).expand(n, N)
        probs = torch.ones(n, N, device=tokens.device) if probs is None else probs
        return Drafts(tokens, index, index + 1, tuple(kinds), probs, q, chain=True)

    @staticmethod
    def tree(tokens: torch.Tensor, parent: torch.Tensor, depth: torch.Tensor, kinds) -> Drafts:
        return Drafts(tokens, parent, depth, tuple(kinds), torch.ones(tokens.shape, device=tokens.device))

    @staticmethod
    def none(n: int, device) -> Drafts:
        """An AR step's: no drafts."""
        return Drafts.chains(torch.zeros(n, 0, dtype=torch.long, device=device), (None,) * n)

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def nodes(self) -> int:
        return self.tokens.shape[1]

    @cached_property
    def block(self) -> int:
        """The deepest node's depth: the most drafts a row can have accepted."""
        return self.nodes if self.chain else int(self.depth.max()) if self.nodes else 0

    @cached_property
    def ancestors(self) -> torch.Tensor:
        """[n, N + 1, N + 1] bool: entry (i, a) says verify token a is token i or one of its ancestors."""
        return tree_ancestors(self.parent)


@dataclass(frozen=True)
class Chains:
    """A proposer's option: its drafts before a plan picks how many to verify: per row its candidate chains (two or
    more are verified as one token trie, a shared prefix once) and their kind (None: no match; such a row verifies
    filler, its bonus repeated, and counts nowhere)."""
    rows: tuple  # [n] tuples of chains (lists of token ids)
    kinds: tuple  # [n] DraftKind | None
    source: str = ""  # the proposer that offered them (the engine sets it)

    @property
    def matched(self) -> bool:
        return any(k is not None for k in self.kinds)

    def nodes(self, Bv: int) -> int:
        """Verify tokens after the bonus at Bv drafts per chain: Bv, or the largest trie's nodes."""
        return max([Bv] + [len(trie_nodes([c[:Bv] for c in cs])) for cs in self.rows if len(cs) > 1])

    def drafts(self, Bv: int, bonus: list[int], device) -> Drafts:
        """The chains cut at Bv drafts: one chain per row (filled up to Bv with the row's bonus), or a trie."""
        if any(len(cs) > 1 for cs in self.rows):
            depth, parent, tokens = chain_trie([[c[:Bv] for c in cs] for cs in self.rows], bonus, device)
            return Drafts.tree(tokens, parent, depth, self.kinds)
        rows = [((cs[0] if cs else []) + [b] * Bv)[:Bv] for cs, b in zip(self.rows, bonus)]
        return Drafts.chains(torch.tensor(rows, dtype=torch.long, device=device), self.kinds)


@dataclass(frozen=True)
class Verdict:
    """The rejection sampler's answer per row: accepted [n] drafts (the accepted node's depth), node [n] (its
    verify index; 0 = none, the bonus), bonus [n] (the target's next token after it)."""
    accepted: torch.Tensor
    node: torch.Tensor
    bonus: torch.Tensor
