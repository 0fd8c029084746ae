"""A new draft source is one class: a model-free proposer defined here, in a test file only, joins an adaptive
engine through its constructor; the planner weighs its drafts every step beside the drafter's plans, the
verifier checks them like any other, and the output stays AR greedy."""
import itertools

from conftest import ragged_prompts
from engine_fixtures import drafters, tiny, tiny_folder  # noqa: F401 (fixtures)
from flexdraft.engine.ar import generate
from flexdraft.engine.config import EngineConfig
from flexdraft.engine.engine import Engine
from flexdraft.speculative.drafts import Chains, DraftKind, Mode
from flexdraft.speculative.sampling import SamplingParams

REPEAT = DraftKind("repeat")


class RepeatLast:
    """Drafts each row's last token again, block times (a request that asked for no speculation gets none)."""

    def options(self, requests, band, first):
        rows = tuple(([r.tokens[-1]] * band.block,) if r.params.max_draft_tokens != 0 else () for r in requests)
        if any(not rows[i] for i in first or ()):
            return []
        return [Chains(rows, tuple(REPEAT if cs else None for cs in rows))]


def test_a_proposer_added_in_a_test_file_runs_in_adaptive_mode(tiny, drafters):
    """With prompt lookup off and verify forwards priced flat (drafts cost only their drafter pass), adaptive
    steps verify RepeatLast's drafts and accept some of them, and every output equals AR greedy."""
    prompts = ragged_prompts(3, seed=4)
    params = SamplingParams(max_new_tokens=24)
    ref = [g.token_ids for g in generate(tiny, prompts, params)]
    engine = Engine(tiny, drafters["trained"], EngineConfig(mode="adaptive", max_batch=3, max_len=96, lookup=0),
                    proposers=[RepeatLast()])
    for rows, tokens in itertools.product((1, 2, 3), (1, 2, 3, 5, 9, 18)):
        engine.costs.record("target", rows, tokens, 0.01)
        engine.costs.record("parallel", rows, tokens, 0.05)
        engine.costs.record("draft", rows, tokens, 0.05)
    verified, verify = [], engine.verify
    engine.verify = lambda plan, drafts, caps, batch: verified.append(drafts) or verify(plan, drafts, caps, batch)
    ids = [engine.add_request(p, params) for p in prompts]
    steps = []
    while engine.has_work():
        steps.append(engine.step().stats)
    assert [engine.result(i).token_ids for i in ids] == ref
    assert any(REPEAT in d.kinds for d in verified)
    assert sum(a for s in steps if s.mode == Mode.LOOKUP for a in s.accepted) > 0
