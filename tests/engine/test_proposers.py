"""A new draft source is one class in a file outside the package (tests/plugins/proposer_plugin), named in a config: the
planner weighs its drafts every step beside the drafter's plans, the verifier checks them like any other, the
output stays AR greedy, its steps are reported under its own name, and its `after_verify` hook sees the target's
hidden states. Broken proposers and bad names are errors naming them."""
import itertools
import re

import pytest
import torch
from proposer_plugin import SuffixProposer

from conftest import ragged_prompts
from engine_fixtures import drafters, tiny, tiny_folder  # noqa: F401 (fixtures)
from flexdraft.core.errors import FlexDraftError
from flexdraft.engine.ar import generate, prefill
from flexdraft.engine.config import EngineConfig
from flexdraft.engine.engine import Engine
from flexdraft.engine.proposer_api import ProposerContext, register_proposer
from flexdraft.speculative.drafts import Chains, DraftKind, Mode
from flexdraft.speculative.sampling import SamplingParams

PLUGIN = "proposer_plugin:SuffixProposer"


def flat_costs(engine: Engine, rows: int) -> None:
    """Verify forwards priced flat, drafter passes dear: whatever a proposer offers that matches is worth a step."""
    for n, tokens in itertools.product(range(1, rows + 1), (1, 2, 3, 5, 9, 18)):
        engine.costs.record("target", n, tokens, 0.01)
        engine.costs.record("parallel", n, tokens, 0.05)
        engine.costs.record("draft", n, tokens, 0.05)


def decode(engine: Engine, prompts, params):
    ids = [engine.add_request(p, params) for p in prompts]
    steps = []
    while engine.has_work():
        steps.append(engine.step().stats)
    return [engine.result(i) for i in ids], steps


def test_a_proposer_named_by_its_import_path_runs_beside_the_drafter_losslessly(tiny, drafters):
    """Adaptive with the drafter, prompt lookup off and the plugin named in EngineConfig.proposers: some steps
    verify its drafts and accept some, they count under its name (the step's kind, the engine's totals and each
    request's mode share), every output equals AR greedy, and the hidden state its hook kept for a request is the
    target's own at the last accepted token."""
    prompts = ragged_prompts(3, seed=4)
    params = SamplingParams(max_new_tokens=24)
    ref = [g.token_ids for g in generate(tiny, prompts, params)]
    engine = Engine(tiny, drafters["trained"], EngineConfig(mode="adaptive", max_batch=3, max_len=96, lookup=0,
                                                            proposers={PLUGIN: {"n": 1}}))
    plugin = engine.proposers[0]
    assert isinstance(plugin, SuffixProposer) and plugin.name == PLUGIN
    flat_costs(engine, 3)
    gens, steps = decode(engine, prompts, params)
    assert [g.token_ids for g in gens] == ref
    ours = [s for s in steps if s.kind == PLUGIN]
    assert ours and all(s.mode == Mode.LOOKUP for s in ours) and sum(a for s in ours for a in s.accepted) > 0
    assert engine.totals.steps_by_mode[PLUGIN] == len(ours)
    assert any(PLUGIN in g.stats.mode_share for g in gens)
    assert plugin.verified == sum(1 for s in steps if s.mode not in ("prefill", "idle"))
    assert plugin.features == {}  # each request's state released when its result was taken

    # the hook's hidden state, after each step of a lone request that goes on: the target's at the token before
    # the new bonus (the request's last token), as a prefill of everything before it computes it
    rid = engine.add_request(prompts[0], SamplingParams(max_new_tokens=40))
    engine.step()  # the prefill
    for _ in range(4):
        engine.step()
        (req,) = engine.slots
        expected = prefill(tiny, tiny.new_cache(1, 96), [req.prompt + req.tokens[:-1]])[0]
        torch.testing.assert_close(plugin.features[rid], expected, rtol=1e-4, atol=1e-4)
    engine.abort(rid)
    engine.result(rid)
    assert rid not in plugin.features


def test_a_registered_name_selects_the_same_proposer_in_lookup_mode_without_a_drafter(tiny):
    """register_proposer("suffix", ...) then EngineConfig(mode lookup, lookup 0, proposers {suffix}): no drafter,
    every speculative step is the plugin's, output equals AR greedy."""
    register_proposer("suffix", SuffixProposer)
    prompts = ragged_prompts(4, seed=9)
    params = SamplingParams(max_new_tokens=20)
    ref = [g.token_ids for g in generate(tiny, prompts, params)]
    engine = Engine(tiny, None, EngineConfig(mode="lookup", lookup=0, max_batch=2, max_len=96,
                                             proposers={"suffix": {}}))
    gens, steps = decode(engine, prompts, params)
    assert [g.token_ids for g in gens] == ref
    kinds = {s.kind for s in steps if s.mode not in ("prefill", "idle")}
    assert "suffix" in kinds and kinds <= {"suffix", "ar"}


class Broken(SuffixProposer):
    """Offers what `offer(requests, block)` makes of each step."""
    name = "broken"

    def __init__(self, context, offer):
        super().__init__(context)
        self.offer = offer

    def options(self, requests, band, first):
        return [self.offer(requests, band.block)]


KIND = DraftKind("suffix")
BROKEN = [  # (what it offers, the error after "proposer 'broken' offered")
    (lambda reqs, B: Chains(tuple(([1] * B, [2] * B) for _ in reqs), (KIND,) * len(reqs)),  # a trie of 2B nodes
     "8 drafts per row, past the 5 cache slots its scratch_slots reserves"),
    (lambda reqs, B: Chains(tuple(([10 ** 6],) for _ in reqs), (KIND,) * len(reqs)),
     "a token id outside the vocabulary of 96 in row 0"),
    (lambda reqs, B: Chains(tuple((5, 6) for _ in reqs), (KIND,) * len(reqs)), "a row is a tuple of chains"),
    (lambda reqs, B: Chains(tuple(((5,),) for _ in reqs), ("suffix",) * len(reqs)), "has a DraftKind"),
    (lambda reqs, B: Chains(tuple(() for _ in reqs), (KIND,) * len(reqs)), "one without has None"),
    (lambda reqs, B: Chains(((5,),), (KIND,)), "drafts for 1 rows and 1 kinds, not the step's 2"),
    (lambda reqs, B: [[5, 6]] * len(reqs), "a list, not a Chains"),
]


@pytest.mark.parametrize("proposers, error", [
    ({"no_such_proposer": {}}, "unknown proposer 'no_such_proposer'"),
    ({"proposer_plugin:Missing": {}}, "cannot import Missing from proposer_plugin"),
    ({PLUGIN: {"depth": 3}}, "does not take settings"),
    ({PLUGIN: 3}, "proposers maps a proposer's name to its settings"),
])
def test_bad_proposer_names_and_settings_are_named(tiny, proposers, error):
    with pytest.raises(FlexDraftError, match=error):
        Engine(tiny, None, EngineConfig(mode="lookup", lookup=0, max_batch=1, max_len=64, proposers=proposers))


@pytest.mark.parametrize("offer, error", BROKEN)
def test_a_proposer_offering_malformed_drafts_is_refused_by_name(tiny, offer, error):
    """A proposer's bug (drafts past its cache slots or the vocabulary, malformed rows or kinds, the wrong number of
    rows, not a Chains) is a FlexDraftError naming it, raised before anything reaches the verifier."""
    engine = Engine(tiny, None, EngineConfig(mode="lookup", max_batch=2, max_len=64, block_size=4),
                    proposers=[Broken(ProposerContext(tiny, 4), offer)])
    for prompt in ([5, 6, 7], [8, 9]):
        engine.add_request(prompt, SamplingParams(max_new_tokens=4))
    engine.step()  # the prefill
    with pytest.raises(FlexDraftError, match="proposer 'broken' offered .*" + re.escape(error)):
        engine.step()


def test_proposers_where_nothing_weighs_them_are_refused(tiny, drafters):
    """Named proposers in a mode that never takes their drafts (sequential; adaptive without its cost model) are an
    error, not silently ignored."""
    for cfg in (EngineConfig(mode="sequential", max_batch=1, max_len=64, proposers={PLUGIN: {}}),
                EngineConfig(mode="adaptive", cost_model=False, max_batch=1, max_len=64, proposers={PLUGIN: {}})):
        with pytest.raises(FlexDraftError, match="proposers are weighed in mode lookup, or adaptive"):
            Engine(tiny, drafters["trained"], cfg)


def test_a_policy_measured_with_a_proposer_brings_it_along(tiny, drafters, tmp_path):
    """A decode sweep's policy records the proposers it was measured with (`Policy.proposers`); an engine built with
    that policy, from its file, weighs the same proposer."""
    from flexdraft.speculative.policy_file import Band, Policy, load_policy, save_policy

    path = save_policy(Policy(switch_batch=1, bands=[Band(None, "adaptive")], proposers={PLUGIN: {"n": 2}}),
                       tmp_path / "policy.yaml")
    engine = Engine(tiny, drafters["trained"], EngineConfig(max_batch=2, max_len=96), policy=load_policy(path))
    assert engine.config.proposers == {PLUGIN: {"n": 2}}
    assert [p.name for p in engine.proposers] == ["lookup", PLUGIN] and engine.proposers[1].n == 2


def test_a_dropped_engine_is_freed_without_the_garbage_collector(tiny, drafters):
    """No part of an engine holds the engine (the timer, the proposers, the planner's acceptance priors): dropping
    the last reference frees it and its KV cache at once, so a process that builds engine after engine (the
    harness, a sweep) does not hold every earlier cache until a collection."""
    import gc
    import weakref

    gc.disable()
    try:
        engine = Engine(tiny, drafters["trained"], EngineConfig(mode="adaptive", max_batch=2, max_len=96,
                                                                proposers={PLUGIN: {}}))
        engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=6))
        while engine.has_work():
            engine.step()
        ref = weakref.ref(engine)
        del engine
        assert ref() is None
    finally:
        gc.enable()
