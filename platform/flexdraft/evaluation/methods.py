"""The methods a benchmark compares (`flexdraft bench`): our AR, `transformers` baselines, and the engine's modes."""
from __future__ import annotations

from dataclasses import dataclass

from flexdraft.evaluation.peers import PEERS


@dataclass(frozen=True)
class Method:
    kind: str  # engine | hf | hf-lookup | peer
    engine: tuple = ()  # EngineConfig overrides, (key, value) pairs
    about: str = ""
    store: bool = True  # lookup steps also draft from the n-gram store (when there is one)
    policy: str = ""  # a policy file (`policy_file`): its bands decide each step


METHODS = {
    "ar": Method("engine", (("mode", "ar"),), "our batched AR: the reference for speed-ups and correctness"),
    "ar-control": Method("engine", (("mode", "ar"),), "a second copy of our AR in the same lockstep: the same work, "
                         "so its ratio to `ar` is the run's noise floor"),
    "hf-generate": Method("hf", (), "transformers generate, greedy, static batches"),
    "hf-prompt-lookup": Method("hf-lookup", (), "transformers prompt-lookup decoding (batch 1 only)"),
    "sequential": Method("engine", (("mode", "sequential"),), "draft after verify, slot 0 = known bonus"),
    "tree": Method("engine", (("mode", "tree"),), "sequential drafts verified as a token tree"),
    "parallel-uncalibrated": Method("engine", (("mode", "parallel"), ("calibrate", False)),
                                    "ablation: attention tuning only (parallel, branches uncalibrated)"),
    "parallel": Method("engine", (("mode", "parallel"),), "ablation: + calibration (all branches)"),
    "parallel-pruned": Method("engine", (("mode", "parallel"), ("top_m", None)),
                              "ablation: + selective verification (top_m branches)"),
    "lookup-prompt": Method("engine", (("mode", "lookup"),), "our prompt lookup alone: n-gram drafts, no drafter",
                            store=False),
    "lookup": Method("engine", (("mode", "lookup"),),
                     "prompt lookup + the n-gram store's chain, one trie per step: no drafter"),
    "adaptive-drafter": Method("engine", (("mode", "adaptive"), ("lookup", 0)),
                               "adaptive without lookup drafts: the drafter's modes only"),
    "adaptive-no-store": Method("engine", (("mode", "adaptive"),), "adaptive with prompt lookup only, no n-gram store",
                                store=False),
    "adaptive-static": Method("engine", (("mode", "adaptive"), ("online", False)),
                              "adaptive planned from the start-up cost profile alone (one load factor, one acceptance "
                              "model): what the planner did before it learned online"),
    "adaptive": Method("engine", (("mode", "adaptive"),),
                       "the product: AR / sequential / tree / parallel / lookup (prompt + store) per step by cost"),
}

METHODS.update({name: Method("peer", about=spec.about) for name, spec in PEERS.items()})

OPT_IN = ("adaptive-static", *PEERS)  # named in a config's methods to run; not in the default benchmark


def speculative(method: str) -> bool:
    """Whether a method's steps speculate (every engine method but our AR; policy methods too)."""
    return method not in METHODS or (METHODS[method].kind == "engine" and METHODS[method].engine != (("mode", "ar"),))
