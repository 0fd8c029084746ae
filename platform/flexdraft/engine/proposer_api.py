"""The seam for draft sources: the `Proposer` protocol, the `Verified` step a proposer hears about after each verify,
and the registry that names proposers (`EngineConfig.proposers`, `flexdraft generate/serve --proposer`, the harness
and sweep configs all name them the same way).

A proposer is found by name, in this order: one registered in this process (`register_proposer`), an installed
package's entry point in the `flexdraft.proposers` group, or an import path `module:attribute` (what a Serve
replica or a Ray worker can import: installed in the image, or on its runtime_env's `PYTHONPATH`, or in a
`py_modules` / `working_dir` URI). The attribute is a factory
(a `Proposer` subclass is one): `factory(context, **settings) -> Proposer`, settings from the config's mapping."""
from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from flexdraft.core.errors import FlexDraftError
from flexdraft.engine.state import Request
from flexdraft.models.transformer import Transformer
from flexdraft.speculative.drafts import Chains, DraftKind, Drafts, Plan, Verdict
from flexdraft.speculative.lookup import NgramStore
from flexdraft.speculative.policy_file import Band

ENTRY_POINTS = "flexdraft.proposers"


@dataclass(frozen=True)
class ProposerContext:
    """What a proposer is built with: the target it drafts for (its config, embeddings, LM head), the most drafts a
    step verifies per row, and the n-gram store of lookup steps (None: none)."""
    target: Transformer
    block: int
    store: NgramStore | None = None


@dataclass(frozen=True)
class Verified:
    """One verified step, as every proposer hears of it (`Proposer.after_verify`), rows 0..n-1 = `requests`.
    hidden [n, N + 1, d]: the target's last hidden states at [bonus, nodes] (what an EAGLE-style head drafts from);
    logits [n, N + 1, V] its logits there; verdict: the accepted node per row and the next bonus; plan: the step."""
    requests: list[Request]
    plan: Plan
    drafts: Drafts
    verdict: Verdict
    hidden: torch.Tensor
    logits: torch.Tensor


class Proposer(Protocol):
    """A draft source whose drafts the engine verifies beside the drafter's: each step it offers candidate chains
    per row (`options`), the planner weighs each option by its acceptance model and the verify's measured cost
    (plus the time `options` itself took), and the step that takes one reports it under the proposer's `name`
    (mode share, metrics, MLflow). Subclass it for the defaults below; register it by name to select it from
    configs. Output stays lossless whatever a proposer drafts: the target verifies every draft."""

    name: str

    def options(self, requests: list[Request], band: Band, first: list[int] | None) -> list[Chains]:
        """Candidate drafts for the rows of `requests`, each a `Chains` (per row its chains and `DraftKind`; its
        `source` this proposer's name); the planner verifies at most one. [] when no row has any, or as soon as a
        row in `first` (the rows that set when the batch drains) has none. At most `band.block` drafts a chain
        count; a request with `params.max_draft_tokens` 0 gets none."""
        ...

    def scratch_slots(self, block: int) -> int:
        """Cache slots past a row's tokens that verifying one option of `block` drafts per chain takes: its largest
        trie's nodes + 1 (the bonus). Default: one chain."""
        return block + 1

    def acceptance_rate(self, kind: DraftKind) -> float | None:
        """The prior P(draft j accepted | drafts before it accepted) of this proposer's `kind` of drafts (the
        acceptance model starts there and learns; None: 0.5)."""
        return None

    def after_verify(self, verified: Verified) -> None:
        """Called after every verify (whoever drafted it), before the next step's `options`."""
        return None

    def release(self, request_id: int) -> None:
        """The request left the engine (finished or aborted, its result taken): drop what was kept for it."""
        return None


def acceptance_rate(proposers: list[Proposer], kind: DraftKind) -> float | None:
    """The prior acceptance rate of `kind` of drafts: the first of `proposers` that knows it (`acceptance_rate`)."""
    rates = (p.acceptance_rate(kind) for p in proposers)
    return next((r for r in rates if r is not None), None)


NAME = re.compile(r"[A-Za-z0-9_.:/-]+")  # (a name labels metrics and MLflow keys: `serve/mode_share/<name>`)


def check_name(name) -> None:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise FlexDraftError(f"a proposer's name must be letters, digits and _ . : / - (it names metrics), got "
                             f"{name!r}")


def check_option(option, proposer: Proposer, rows: int, block: int, scratch: int, vocab: int) -> None:
    """An option a proposer offered for `rows` rows at most `block` drafts a chain, or a FlexDraftError naming the
    proposer and what is wrong with it (a proposer's bug must not reach the verifier or fail the step elsewhere)."""
    def bad(what: str):
        raise FlexDraftError(f"proposer {proposer.name!r} offered {what}")

    if not isinstance(option, Chains):
        bad(f"a {type(option).__name__}, not a Chains")
    if len(option.rows) != rows or len(option.kinds) != rows:
        bad(f"drafts for {len(option.rows)} rows and {len(option.kinds)} kinds, not the step's {rows}")
    for r, (chains, kind) in enumerate(zip(option.rows, option.kinds)):
        if not isinstance(chains, tuple | list) or any(not isinstance(c, tuple | list) for c in chains):
            bad(f"row {r} as {chains!r}: a row is a tuple of chains, each a list of token ids")
        if any(not isinstance(t, int) or not 0 <= t < vocab for c in chains for t in c):
            bad(f"a token id outside the vocabulary of {vocab} in row {r}")
        if (kind is None) != (not chains) or (kind is not None and not isinstance(kind, DraftKind)):
            bad(f"row {r} with kind {kind!r}: a row with chains has a DraftKind, one without has None")
    if option.nodes(block) + 1 > scratch:
        bad(f"{option.nodes(block)} drafts per row, past the {scratch} cache slots its scratch_slots reserves")


_REGISTRY: dict[str, Callable[..., Proposer]] = {}


def register_proposer(name: str, factory: Callable[..., Proposer]) -> None:
    """Make `name` select `factory(context, **settings)` in this process (a plugin module calls this on import)."""
    check_name(name)
    if ":" in name:
        raise FlexDraftError(f"a registered proposer's name has no ':' (that is an import path), got {name!r}")
    _REGISTRY[name] = factory


def registered_proposers() -> list[str]:
    """The names this process can build without an import path: registered ones and installed entry points."""
    return sorted({*_REGISTRY, *(ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINTS))})


def proposer_factory(name: str) -> Callable[..., Proposer]:
    """The factory a proposer name selects (see the module's doc) or a FlexDraftError naming what is known."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    for ep in importlib.metadata.entry_points(group=ENTRY_POINTS, name=name):
        return ep.load()
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise FlexDraftError(f"proposer {name!r}: cannot import {attr} from {module} ({e})") from None
    raise FlexDraftError(f"unknown proposer {name!r}: registered are {', '.join(registered_proposers()) or 'none'}; "
                         "name one, or give an import path module:attribute")


def build_proposer(name: str, context: ProposerContext, settings: dict | None = None) -> Proposer:
    """The proposer `name` selects, built for `context` with its `settings`; its `name` is the one it was selected
    by (so a step's report names what the config named)."""
    check_name(name)
    factory, settings = proposer_factory(name), settings or {}
    try:
        inspect.signature(factory).bind(context, **settings)
    except TypeError as e:
        raise FlexDraftError(f"proposer {name!r} does not take settings {settings}: {e}") from None
    except ValueError:  # (no signature to read: a builtin; the call says)
        pass
    proposer = factory(context, **settings)
    for method in ("options", "scratch_slots", "acceptance_rate", "after_verify", "release"):
        if not callable(getattr(proposer, method, None)):
            raise FlexDraftError(f"proposer {name!r} has no {method}(): subclass flexdraft.engine.proposer_api."
                                 "Proposer")
    try:
        proposer.name = name
    except AttributeError:
        raise FlexDraftError(f"proposer {name!r}: its name cannot be set (a frozen or slotted class)") from None
    return proposer
