"""The decoding engine is lossless whatever the drafter does: greedy outputs equal AR greedy token for token,
sampled outputs follow the target's distribution; continuous batching never changes another row."""
import itertools
import math
import random

import pytest
import torch

from conftest import make_tiny_hf, ragged_prompts
from engine_fixtures import (  # noqa: F401 (fixtures)
    CPU32,
    OracleProposer,
    ReferenceProposer,
    drafters,
    tiny,
    tiny_folder,
    tiny_vocabulary,
)
from flexdraft.core.config import RuntimeConfig
from flexdraft.core.errors import FieldError, FlexDraftError
from flexdraft.drafter.model import Drafter, DrafterConfig, load_drafter, parallel_forward, read_drafter_meta
from flexdraft.drafter.recipe import default_drafter_dir
from flexdraft.engine.ar import generate, prefill
from flexdraft.engine.config import EngineConfig
from flexdraft.engine.engine import Engine
from flexdraft.engine.proposer_api import Proposer
from flexdraft.models.loading import load_model
from flexdraft.speculative.branches import CostModel, monotone
from flexdraft.speculative.drafts import Chains, DraftKind, Mode, Plan
from flexdraft.speculative.lookup import NgramIndex, NgramStore
from flexdraft.speculative.sampling import SamplingParams, filtered_logits
from flexdraft.speculative.trees import chain_trie

EOS = 2
MODES = [("sequential", {}), ("parallel", {}), ("parallel", {"top_m": 2}), ("tree", {}), ("parallel", {"rho": 0.6}),
         ("adaptive", {"switch_batch": 3}), ("adaptive", {"switch_batch": 3, "cost_model": False}), ("lookup", {})]


@pytest.mark.parametrize("batch", [1, 3, 16])
@pytest.mark.parametrize("mode,extra", MODES, ids=[f"{m}-{'-'.join(map(str, e.values())) or 'all'}" for m, e in MODES])
def test_speculative_greedy_equals_ar_greedy(tiny, drafters, batch, mode, extra):
    """Every mode (parallel with and without pruning), batch 1, 3 and 16 with ragged prompts, rows ending at
    their own EOS or length, 4 rows at a time (the rest join as rows leave), with an untrained, a random and
    a trained drafter: output token for token equal to AR greedy (fp32)."""
    prompts = ragged_prompts(batch, seed=batch)
    params = SamplingParams(max_new_tokens=28)
    eos = generate(tiny, prompts[-1:], params)[0].token_ids[9]  # a token some row emits: rows end apart
    ref = [g.token_ids for g in generate(tiny, prompts, params, eos_token_ids=[eos])]
    assert len({len(r) for r in ref}) > 1 or batch == 1
    taus = {}
    for name, drafter in drafters.items():
        engine = Engine(tiny, drafter, EngineConfig(mode=mode, max_batch=4, max_len=96, **extra), eos_token_ids=[eos])
        out = engine.generate(prompts, params)
        assert [g.token_ids for g in out] == ref, name
        assert engine.totals.num_target_forwards < sum(map(len, ref))  # some step yielded several tokens
        taus[name] = sum(g.stats.tau for g in out) / batch
    if batch == 16 and mode == "sequential":
        assert taus["trained"] > taus["random"]  # the training fixture really trains


@pytest.mark.parametrize("mode,extra", MODES, ids=[f"{m}-{'-'.join(map(str, e.values())) or 'all'}" for m, e in MODES])
def test_ignore_eos_and_stop_token_ids_end_rows_where_ar_ends_them(tiny, drafters, mode, extra):
    """vLLM's ending extensions, per request, in every mode while it speculates: ignore_eos runs a row past the
    model's EOS to max_new_tokens, stop_token_ids end a row at the first such token (kept); the tokens are AR
    greedy's under the same params, rows of either kind and plain ones side by side in one batch."""
    prompts = ragged_prompts(6, seed=21)
    plain = SamplingParams(max_new_tokens=24)
    free = generate(tiny, prompts, plain)  # (no EOS: which tokens the rows emit)
    eos = free[0].token_ids[6]
    stop = next(tok for tok in free[2].token_ids[3:] if tok != eos)
    kinds = [plain, SamplingParams(max_new_tokens=24, ignore_eos=True),
             SamplingParams(max_new_tokens=24, stop_token_ids=(stop,))]
    params = [kinds[i % 3] for i in range(len(prompts))]
    ref = [generate(tiny, [p], sp, eos_token_ids=[eos])[0].token_ids for p, sp in zip(prompts, params)]
    assert any(len(r) < 24 for r in ref[::3]) and all(len(r) == 24 for r in ref[1::3])
    assert any(r[-1] == stop and len(r) < 24 for r in ref[2::3])
    engine = Engine(tiny, drafters["trained"], EngineConfig(mode=mode, max_batch=4, max_len=96, **extra),
                    eos_token_ids=[eos])
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while engine.has_work():
        engine.step()
    assert [engine.result(i).token_ids for i in ids] == ref
    assert engine.totals.num_target_forwards < sum(map(len, ref))  # (it speculated)


@pytest.mark.parametrize("mode,extra", MODES[:4], ids=["sequential", "parallel", "parallel-pruned", "tree"])
@pytest.mark.parametrize("wrong", [False, True], ids=["always-right", "always-wrong"])
def test_lossless_with_adversarial_and_perfect_drafts(tiny, drafters, mode, extra, wrong):
    """Drafts forced to the reference continuation (every draft accepted, every step but a request's last, which
    may reach past the reference: Bv + 1 tokens per forward) or to a token that never matches (none accepted: one
    token per forward): the output is AR greedy either way."""
    prompts = ragged_prompts(5, seed=11)
    params = SamplingParams(max_new_tokens=25)
    ref = [g.token_ids for g in generate(tiny, prompts, params)]
    reference = {tuple(p): r for p, r in zip(prompts, ref)}
    engine = Engine(tiny, drafters["random"], EngineConfig(mode=mode, max_batch=5, max_len=96, **extra))
    engine.proposer = OracleProposer(engine, reference, wrong)
    out = engine.generate(prompts, params)
    assert [g.token_ids for g in out] == ref
    for g in out:  # every step accepts all 4 drafts (the last may reach past the reference), or none
        accepted = g.stats.accepted_lengths
        assert set(accepted) == {0} if wrong else (set(accepted[:-1]) <= {4} and len(accepted) > 1), accepted
    if not wrong and mode == "parallel":
        assert engine.pruned_misses == 0  # full confidence in every draft: branch Bv is kept


class RandomPlanEngine(Engine):
    """Each step's plan drawn at random (AR, sequential, tree or parallel with random drafts and branches, or a
    lookup step when some row has a match): every transition between modes occurs."""

    def __init__(self, *args, seed: int, **kw):
        super().__init__(*args, **kw)
        self.rng = random.Random(seed)

    def plan(self, n, caps=None):
        Bv = self.rng.randint(1, self.B)
        plans = [Plan(Mode.AR), Plan(Mode.SEQUENTIAL, Bv), Plan(Mode.TREE, Bv, nodes=self.config.tree_nodes),
                 Plan(Mode.PARALLEL, Bv, self.rng.randint(1, 3))]
        lookup = self.model_free_plan(n, Bv)
        if lookup is not None:
            plans.append(lookup)
        return self.rng.choice(plans)


@pytest.mark.parametrize("batch", [1, 3])
def test_any_sequence_of_plans_is_lossless(tiny, drafters, batch):
    """Whatever the adaptive policy picks, step after step (random plans: every mode after every other, rows
    with drafts from a branch, a drafter pass, a lookup step or none), and whatever cap a request sets on its
    drafts (none, 0 = no speculation, 1, 2), greedy output equals AR greedy."""
    prompts = ragged_prompts(batch + 2, seed=21)
    params = SamplingParams(max_new_tokens=30)
    ref = [g.token_ids for g in generate(tiny, prompts, params)]
    capped = [SamplingParams(max_new_tokens=30, max_draft_tokens=[None, 0, 1, 2][i % 4]) for i in range(len(prompts))]
    modes = set()
    for seed in range(3):
        engine = RandomPlanEngine(tiny, drafters["trained"], EngineConfig(mode="adaptive", max_batch=batch, max_len=96),
                                  seed=seed)
        ids = [engine.add_request(p, c) for p, c in zip(prompts, capped)]
        while engine.has_work():
            modes.add(engine.step().stats.mode)
        results = [engine.result(i) for i in ids]
        assert [g.token_ids for g in results] == ref, seed
        assert all(max(g.stats.accepted_lengths, default=0) <= c.max_draft_tokens
                   for g, c in zip(results, capped) if c.max_draft_tokens is not None)
    assert modes == {"prefill", "ar", "sequential", "tree", "parallel", "lookup"}


class SecondChoiceProposer(ReferenceProposer):
    """Tree candidates where the reference token is the drafter's first choice at every slot but the second,
    whose first choice is wrong (the chain's draft there never passes)."""

    def __init__(self, engine: Engine, reference: dict, second: int):
        super().__init__(engine, reference)
        self.second = second

    def replace(self, row, ref, V, K):
        cand = (ref[:, None] + torch.arange(max(K, 2))) % V  # [B, K]: the reference first
        cand[self.second - 1, :2] = cand[self.second - 1, :2].flip(0)  # ... except at slot `second`
        self.state.cand[row, : self.B], self.state.drafts[row, : self.B] = cand[:, :K], cand[:, 0]
        self.state.cand_logp[row, : self.B] = torch.tensor([-0.1, -0.2, -5.0, -5.0][:K] + [-5.0] * (K - 4))


def test_tree_accepts_a_path_through_a_second_choice(tiny, drafters):
    """Tree mode, 5 ragged greedy rows: where slot 2's first choice is wrong and its second is right, the
    24-node tree still accepts all 4 drafts every step (a path whose nodes are not the first in their depth:
    their cached keys/values must move to the chain's slots) while the chain accepts 1; both equal AR greedy.
    A sampled row in the same tree steps (walked by speculative sampling) leaves the greedy rows unchanged."""
    prompts = ragged_prompts(5, seed=13)
    params = SamplingParams(max_new_tokens=25)
    ref = [g.token_ids for g in generate(tiny, prompts, params)]
    reference = {tuple(p): r for p, r in zip(prompts, ref)}
    accepted = {}
    for mode in ("tree", "sequential"):
        engine = Engine(tiny, drafters["random"], EngineConfig(mode=mode, max_batch=5, max_len=96, tree_nodes=24))
        engine.proposer = SecondChoiceProposer(engine, reference, second=2)
        out = engine.generate(prompts, params)
        assert [g.token_ids for g in out] == ref, mode
        accepted[mode] = [g.stats.accepted_lengths[:-1] for g in out]  # the last step may pass max_new_tokens
    assert all(set(a) == {4} for a in accepted["tree"])
    assert all(set(a) <= {0, 1} for a in accepted["sequential"])

    engine = Engine(tiny, drafters["trained"], EngineConfig(mode="tree", max_batch=6, max_len=96))
    ids = [engine.add_request(p, params) for p in prompts]
    engine.add_request(prompts[0], SamplingParams(max_new_tokens=6, temperature=1.0, seed=0))
    modes = []
    while engine.has_work():
        modes.append(engine.step().stats.mode)
    assert [engine.result(i).token_ids for i in ids] == ref
    assert set(modes) == {"prefill", "tree"}  # (the admissions, then tree steps only)


def test_parallel_clean_path_is_the_plain_verify_up_to_rounding(tmp_path):
    """The verify tokens' hidden states from the parallel forward (3 branches per row riding along from
    layer 0, sharing the clean tokens' GEMMs) equal a plain target forward over the same tokens and cache to
    fp32 rounding (1e-5), and the cache it leaves up to the verify tokens is the plain forward's; each branch
    equals the drafter's own masked block after its anchor (1e-5); perturbing the branches' mask embedding
    changes the branches and leaves the clean path bit-identical (nothing flows from them)."""
    make_tiny_hf("qwen3", tmp_path)
    model = load_model(tmp_path, CPU32, with_tokenizer=False).model
    drafter = Drafter.from_target(model, DrafterConfig(k=2, block_size=4))
    for p in drafter.attn.parameters():  # tuned projectors unlike the target's
        p.data.add_(0.3 * torch.randn_like(p))
    drafter.pair_with(model)
    prompts = sorted(ragged_prompts(3, seed=2), key=len, reverse=True)
    caches = [model.new_cache(3, 64) for _ in range(2)]
    for c in caches:
        prefill(model, c, prompts)
    tokens = torch.randint(3, 96, (3, 5))
    pos = caches[0].lens[:, None] + torch.arange(5)
    anchors = torch.tensor([[0, 2, 4], [1, 3, 0], [4, 0, 2]])
    with torch.inference_mode():
        h_par, hb = parallel_forward(model, drafter, tokens, pos, caches[0], anchors)
        h = model(tokens, pos, caches[1])
        torch.testing.assert_close(h_par, h, atol=1e-5, rtol=1e-5)
        for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
            for r, n in enumerate((pos[:, -1] + 1).tolist()):  # each row's prefix + verify tokens
                torch.testing.assert_close(a[r, :, :n], b[r, :, :n], atol=1e-5, rtol=1e-5)
        for r, j in ((0, 1), (1, 0), (2, 2)):  # branch j of row r: a masked block after verify token anchors[r, j]
            at = int(pos[r, 0] + anchors[r, j])
            block_pos = at + 1 + torch.arange(5)[None]
            inputs = drafter.slot_inputs(model, torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.bool))
            ctx = (torch.arange(at + 1) <= at).expand(1, 5, at + 1)
            alone = drafter(model, inputs, block_pos, torch.zeros_like(block_pos), caches[0], ctx, rows=torch.tensor([r]))
            torch.testing.assert_close(hb[r, j], alone[0], atol=1e-5, rtol=1e-5)
        drafter.mask_embedding.add_(1.0)
        h_par2, hb2 = parallel_forward(model, drafter, tokens, pos, caches[0], anchors)
    assert torch.equal(h_par2, h_par) and not torch.allclose(hb2, hb)
    assert hb.shape == (3, 3, 5, model.args.dim)


def exact_distribution(model, prompt, params, n_tokens) -> dict[tuple, float]:
    """P(first n_tokens generated) by enumerating every continuation (tiny vocabulary)."""
    probs = {(): 1.0}
    for _ in range(n_tokens):
        nxt = {}
        for seq, p in probs.items():
            ids = torch.tensor([prompt + list(seq)])
            cache = model.new_cache(1, ids.shape[1])
            with torch.inference_mode():
                h = model(ids, torch.arange(ids.shape[1])[None], cache)
            dist = filtered_logits(model.logits(h[0, -1:]), params).softmax(-1)[0].double()
            for t in dist.nonzero().squeeze(-1).tolist():
                nxt[seq + (t,)] = p * float(dist[t])
        probs = nxt
    return probs


def marginal(dist: dict[tuple, float], j: int) -> dict[tuple, float]:
    """A distribution (or counts) over sequences -> over their token j."""
    out: dict[tuple, float] = {}
    for seq, p in dist.items():
        out[seq[j:j + 1]] = out.get(seq[j:j + 1], 0) + p
    return out


def chi_square_ok(counts: dict, exact: dict, n: int, alpha_z: float = 3.09) -> tuple[float, float]:
    """Pearson chi-square over outcomes with expected count >= 5 (the rest pooled); returns (statistic,
    the 0.999 quantile by the Wilson-Hilferty approximation; z = 3.09 is the normal 0.999 quantile)."""
    big = [k for k, p in exact.items() if p * n >= 5]
    cells = [(counts.get(k, 0), exact[k] * n) for k in big]
    rest_obs = n - sum(o for o, _ in cells)
    rest_exp = n - sum(e for _, e in cells)
    if rest_exp >= 5:
        cells.append((rest_obs, rest_exp))
    else:
        assert rest_obs <= 3 * rest_exp + 10  # outcomes that should be rare stay rare
    stat = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    q = df * (1 - 2 / (9 * df) + alpha_z * math.sqrt(2 / (9 * df))) ** 3
    return stat, q


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_speculative_sampling_follows_the_target_distribution(tmp_path, top_p):
    """Tiny vocabulary (12 tokens), temperature 1 (and top-p 0.8): the first 3 tokens of 6000 sampled
    generations in sequential, parallel, tree and lookup mode, with a random drafter whose q is far from p, match the
    exact target distribution (enumerated) by chi-square tests at significance 0.001 (the joint, and the marginal of
    each speculated position), in runs that verified drafts
    and both accepted and rejected some; in every mode the same counts fail against the distribution at
    temperature 1.3 (the test has power)."""
    model, drafter = tiny_vocabulary(tmp_path)
    prompt = [3, 7, 5, 9]
    exact = exact_distribution(model, prompt, SamplingParams(temperature=1.0, top_p=top_p), 3)
    hotter = exact_distribution(model, prompt, SamplingParams(temperature=1.3, top_p=top_p), 3)
    N = 6000
    # a store whose chains differ from the prompt's: lookup steps then verify two chains as one trie
    g = torch.Generator().manual_seed(1)
    store = NgramStore.build([torch.randint(3, 12, (400,), generator=g).tolist()], 12, max_n=2, min_n=1, min_count=1,
                             min_share=0.0)
    # lookup: point-mass drafts, where a 1-gram repeats; with the store: a trie of point-mass drafts
    for mode, kw in (("sequential", {}), ("parallel", {}), ("tree", {}), ("lookup", {}), ("lookup", {"store": store})):
        engine = Engine(model, drafter, EngineConfig(mode=mode, max_batch=64, max_len=24), **kw)
        ids = [engine.add_request(prompt, SamplingParams(max_new_tokens=3, temperature=1.0, top_p=top_p, seed=i))
               for i in range(N)]
        while engine.has_work():
            engine.step()
        counts = {}
        for i in ids:
            seq = tuple(engine.result(i).token_ids)
            counts[seq] = counts.get(seq, 0) + 1
        stat, q = chi_square_ok(counts, exact, N)
        assert stat < q, (mode, kw, stat, q)
        for j in (1, 2):  # each speculated position alone: 12 cells, more power than the joint's many sparse ones
            stat, q = chi_square_ok(marginal(counts, j), marginal(exact, j), N)
            assert stat < q, (mode, kw, f"position {j}", stat, q)
        # it speculated: drafts were verified, and some accepted and some rejected (not plain sampling)
        t = engine.totals
        assert t.num_drafts > 0 and 0 < t.num_accepted_tokens < t.num_draft_tokens, (mode, kw, t)
        # power: the same counts against the distribution at temperature 1.3 (a subtly wrong sampler) fail
        stat, q = chi_square_ok(counts, hotter, N)
        assert stat > q, (mode, kw, "no power")


def test_requests_joining_and_aborted_mid_flight_leave_other_rows_unchanged(tiny, drafters):
    """Continuous batching, parallel/sequential switching (S = 2): requests added after some steps and
    requests aborted mid-flight do not change what the other requests generate (each equals AR alone)."""
    prompts = ragged_prompts(7, seed=5)
    params = SamplingParams(max_new_tokens=20)
    alone = [generate(tiny, [p], params, eos_token_ids=[EOS])[0].token_ids for p in prompts]
    engine = Engine(tiny, drafters["trained"], EngineConfig(mode="adaptive", switch_batch=2, cost_model=False,
                                                           max_batch=4, max_len=96), eos_token_ids=[EOS])
    ids = {engine.add_request(prompts[i], params): i for i in (0, 1, 2)}
    streamed = {i: [] for i in range(7)}
    modes = set()
    for step in range(40):
        if step == 2:
            ids.update({engine.add_request(prompts[i], params): i for i in (3, 4, 5)})
            engine.abort(next(k for k, v in ids.items() if v == 1))  # running
        if step == 3:
            engine.abort(next(k for k, v in ids.items() if v == 5))  # still waiting (4 rows busy)
        if step == 4:
            ids[engine.add_request(prompts[6], params)] = 6
        out = engine.step()
        for delta in out.deltas:
            streamed[ids[delta.id]].extend(delta.tokens)
        modes.add(out.stats.mode)
        if not engine.has_work():
            break
    assert not engine.has_work() and {"parallel", "sequential"} <= modes
    for i in (0, 2, 3, 4, 6):
        assert streamed[i] == alone[i] == engine.result(next(k for k, v in ids.items() if v == i)).token_ids
    assert engine.result(next(k for k, v in ids.items() if v == 1)).finish_reason == "abort"
    assert streamed[5] == []


def test_bad_input_is_named_and_the_engine_keeps_serving(tiny, drafters):
    engine = Engine(tiny, drafters["random"], EngineConfig(mode="sequential", max_batch=2, max_len=40))
    good = engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=10))
    with pytest.raises(FlexDraftError, match="exceeds the cache of 40 slots"):
        engine.add_request(list(range(3, 33)), SamplingParams(max_new_tokens=10))
    with pytest.raises(FlexDraftError, match="outside the vocabulary"):
        engine.add_request([5, 500], SamplingParams())
    for ids in ([96], [2 ** 31 - 1]):  # (a stop id past V indexed the logits in a step: two failed steps)
        with pytest.raises(FieldError, match="stop_token_ids has token id .* outside the vocabulary of 96") as e:
            engine.add_request([5], SamplingParams(max_new_tokens=8, min_tokens=4, stop_token_ids=tuple(ids)))
        assert e.value.field == "stop_token_ids"
    with pytest.raises(FlexDraftError, match="top_p"):
        engine.add_request([5], SamplingParams(temperature=1.0, top_p=0.0))
    with pytest.raises(FlexDraftError, match="no running or waiting request with id 99"):
        engine.abort(99)
    while engine.has_work():
        engine.step()
    ref = generate(tiny, [[5, 6, 7]], SamplingParams(max_new_tokens=10))[0].token_ids
    assert engine.result(good).token_ids == ref
    with pytest.raises(FlexDraftError, match="block_size=9"):
        Engine(tiny, drafters["random"], EngineConfig(block_size=9))
    with pytest.raises(FlexDraftError, match="needs a drafter"):
        Engine(tiny, None, EngineConfig(mode="parallel"))
    with pytest.raises(FlexDraftError, match=r"not ready for inference: call drafter.to_runtime\(target\)"):
        Engine(tiny, Drafter.from_target(tiny, DrafterConfig(k=2, block_size=4)), EngineConfig(mode="sequential"))


DEFAULT_DRAFTER = default_drafter_dir()


@pytest.mark.real_model
def test_real_model_greedy_lossless_with_trained_drafter(real_lm, gsm8k_prompts):
    """Bundled SmolLM2 in fp32, 4 GSM8K chat prompts, 32 new tokens: sequential, tree, parallel (top-3 branches)
    and adaptive output equals AR greedy, with the drafter trained by the default pipeline when it exists here
    (else an untrained one: losslessness holds for any drafter)."""
    model = real_lm.model
    if (DEFAULT_DRAFTER / "drafter.json").is_file():
        drafter = load_drafter(DEFAULT_DRAFTER, model).to_runtime(model)
        prior = read_drafter_meta(DEFAULT_DRAFTER).get("eval")
    else:
        drafter, prior = Drafter.from_target(model, DrafterConfig()).to_runtime(model), None
    prompts = gsm8k_prompts[:4]
    params = SamplingParams(max_new_tokens=32)
    ref = [g.token_ids for g in generate(model, prompts, params, real_lm.eos_token_ids)]
    for mode, extra in (("sequential", {}), ("tree", {}), ("parallel", {"top_m": 3}), ("adaptive", {})):
        engine = Engine(model, drafter, EngineConfig(mode=mode, max_batch=4, max_len=512, **extra),
                        real_lm.eos_token_ids, acceptance_prior=prior)
        assert [g.token_ids for g in engine.generate(prompts, params)] == ref, mode


def test_a_default_drafter_for_other_weights_is_passed_over_unless_a_drafter_is_required(tiny, tmp_path, monkeypatch):
    """With no drafter named, the default pipeline's drafter is the one used; one trained for other base weights is
    passed over, with the reason, where nothing needs a drafter (AR, lookup, a harness of AR and peers), and refused
    with a named error where a speculative mode needs it."""
    from flexdraft.drafter.model import save_drafter
    from flexdraft.engine.runner import resolve_drafter

    monkeypatch.setenv("FLEXDRAFT_HOME", str(tmp_path / "home"))
    make_tiny_hf("llama", tmp_path / "other", seed=1)
    other = load_model(tmp_path / "other", CPU32, with_tokenizer=False).model
    save_drafter(Drafter.from_target(other, DrafterConfig(k=2, block_size=4)), default_drafter_dir(), "other",
                 other.fingerprint)
    assert resolve_drafter(None, other, required=True).drafter is not None  # its own weights: used
    choice = resolve_drafter(None, tiny, required=False)
    assert choice.drafter is None and "trained for other base weights" in choice.why_none
    with pytest.raises(FlexDraftError, match="other base weights"):
        resolve_drafter(None, tiny, required=True)


def default_or_init_drafter(model):
    from flexdraft.engine.runner import resolve_drafter

    choice = resolve_drafter(None, model, required=False)
    return ((choice.drafter, choice.prior) if choice.drafter
            else (Drafter.from_target(model, DrafterConfig()).to_runtime(model), None))


NEAR_TIE = 0.5  # logits; 2 bf16 ulps at |logit| in [32, 64), the range of SmolLM2's top logits


@pytest.mark.real_model
def test_bf16_divergences_happen_only_at_near_ties(real_folder, gsm8k_prompts):
    """Bundled SmolLM2 in bf16: verifying many tokens in one forward may round logits differently from a
    one-token step, which can flip a greedy choice only where the top two logits are within rounding. For
    sequential, tree and parallel mode, every row either equals AR bf16 or first differs at a position where AR's
    own top-2 gap is below NEAR_TIE (on this CPU the oneDNN GEMMs are row-independent: sequential and parallel
    never diverge; a tree's keys sit in other cache slots, which can flip a near-tie)."""
    model = load_model(real_folder, RuntimeConfig(device="cpu", dtype="bfloat16", threads=0)).model
    drafter, prior = default_or_init_drafter(model)
    prompts = gsm8k_prompts[:4]
    params = SamplingParams(max_new_tokens=40)
    ref = [g.token_ids for g in generate(model, prompts, params)]
    for mode, extra in (("sequential", {}), ("tree", {}), ("parallel", {"top_m": 2})):
        engine = Engine(model, drafter, EngineConfig(mode=mode, max_batch=4, max_len=512, **extra),
                        acceptance_prior=prior)
        for p, r, g in zip(prompts, ref, engine.generate(prompts, params)):
            if g.token_ids == r:
                continue
            j = next(i for i, (a, b) in enumerate(zip(g.token_ids, r)) if a != b)
            ids = torch.tensor([p + r[:j]])
            with torch.inference_mode():
                h = model(ids, torch.arange(ids.shape[1])[None], model.new_cache(1, ids.shape[1]))
            top2 = model.logits(h[0, -1]).float().topk(2).values
            assert float(top2[0] - top2[1]) < NEAR_TIE, (mode, j)


def test_adaptive_policy_follows_the_measured_costs(tiny, drafters):
    """With costs where a draft pass costs half a target forward, adaptive plans speculative steps (parallel at
    <= S rows: one forward; sequential above S, or a token tree while a forward's cost hardly grows with its
    tokens, but no tree where it grows steeply); where a draft pass or a forward carrying branches costs 10
    target forwards, it plans plain AR steps. A parallel step for rows without drafts pays for their drafter pass.
    Without the cost model, the switch rule alone decides: parallel at <= S rows, sequential above."""
    def engine(draft_cost: float, branch_cost: float, per_token: float = 1e-5, **kw):
        e = Engine(tiny, drafters["trained"], EngineConfig(mode="adaptive", switch_batch=2, max_batch=8, **kw))
        for rows, tokens in itertools.product((1, 2, 4, 8), (1, 2, 3, 5, 9, 18, 45)):
            e.costs.record("target", rows, tokens, 0.01 + per_token * rows * tokens)
            e.costs.record("parallel", rows, tokens, branch_cost + 2e-5 * rows * tokens)
            e.costs.record("draft", rows, tokens, draft_cost)
        return e

    cheap, costly = engine(0.005, 0.01, tree_nodes=0), engine(0.1, 0.1)
    cheap.state.ndrafts[:1] = cheap.B  # a row holding drafts (see below for rows without)
    assert cheap.plan(1).mode == "parallel" and cheap.plan(5).mode == "sequential"
    assert costly.plan(5) == costly.plan(1) == type(costly.plan(1))("ar")
    # token trees: worth it where a forward's cost hardly grows with its tokens, not where it grows fast
    assert engine(0.005, 0.01).plan(5).mode == "tree"
    assert engine(0.005, 0.01, per_token=3e-3).plan(5).mode != "tree"
    # a parallel step's drafts come from the last step's branches: rows without any (fresh, or after an AR or
    # lookup step) need a drafter pass first, and with a draft pass as dear as a target forward that is not worth it
    even = engine(0.01, 0.011, tree_nodes=0)
    assert even.plan(1).mode != "parallel"  # an idle engine's rows have no drafts
    even.state.ndrafts[:1] = even.B
    assert even.plan(1).mode == "parallel"
    rule = Engine(tiny, drafters["trained"], EngineConfig(mode="adaptive", switch_batch=2, cost_model=False))
    assert [rule.plan(n).mode for n in (1, 2, 3)] == ["parallel", "parallel", "sequential"]


def test_lookup_proposes_what_followed_the_latest_longest_match():
    """Prompt lookup: the longest suffix n-gram's latest earlier occurrence decides; a continuation that runs
    into the present repeats itself (a loop proposes its next k tokens); no match, no drafts; growing the
    index token by token gives what building it at once gives."""
    index = NgramIndex([5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7], max_n=3)
    assert index.propose(3) == ([9, 2, 6], 2)  # "6 7" last seen before "9 2 6"; "1 6 7", "8 1 6 7"... not seen
    index.extend([9])
    assert index.propose(3) == ([2, 6, 7], 3)  # now "6 7 9" matches (3-gram wins over the later 1-gram "9")
    loop = NgramIndex([4, 1, 2, 1, 2], max_n=2)
    assert loop.propose(5) == ([1, 2, 1, 2, 1], 2)  # period 2: continued past the present
    assert NgramIndex([1, 2, 3], max_n=4).propose(4) == ([], 0)
    tokens = torch.randint(0, 6, (60,), generator=torch.Generator().manual_seed(0)).tolist()
    grown = NgramIndex(tokens[:5], max_n=4)
    for i in range(5, 60):
        grown.extend([tokens[i]])
        assert grown.propose(6) == NgramIndex(tokens[: i + 1], max_n=4).propose(6)


def test_ngram_store_proposes_the_confident_continuation_and_round_trips(tmp_path):
    """The store keeps an n-gram's most frequent next token when it is frequent enough (min_count, min_share),
    continues greedily from the longest confident suffix, and a saved store loads to the same table; a store
    for another vocabulary and a file that is no store are refused by name."""
    corpus = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [7, 2, 3, 9], [8, 8, 3, 4, 6]]
    store = NgramStore.build(corpus, vocab_size=10, max_n=3, min_n=1, min_count=2, min_share=0.5)
    assert store.propose([0, 2, 3], 3) == ([4, 5], 2)  # "2 3" -> 4 (2 of 3), "3 4" -> 5 (2 of 3), "4 5": never followed
    assert store.propose([7, 2, 3], 2) == ([4, 5], 2)  # "7 2 3" -> 9 occurs once (< min_count): the 2-gram decides
    assert store.propose([6], 3) == ([], 0)
    strict = NgramStore.build(corpus, vocab_size=10, max_n=3, min_n=1, min_count=2, min_share=0.7)
    assert strict.propose([0, 2, 3], 3) == ([4, 5], 1)  # "2 3" -> 4 is 2 of 3 (< 70%): "3" -> 4 (3 of 4) decides
    path = tmp_path / NgramStore.FILE
    store.save(path)
    loaded = NgramStore.load(tmp_path, vocab_size=10)
    assert loaded.table == store.table and (loaded.max_n, loaded.min_n) == (3, 1)
    with pytest.raises(FlexDraftError, match="vocabulary of 10 tokens; the model has 12"):
        NgramStore.load(path, vocab_size=12)
    (tmp_path / "junk.safetensors").write_bytes(b"not a store")
    with pytest.raises(FlexDraftError, match="not a readable n-gram store"):
        NgramStore.load(tmp_path / "junk.safetensors", vocab_size=10)


def test_chain_trie_merges_shared_prefixes():
    """Two chains sharing a prefix become one trie (the prefix once, nodes by depth, parents first); a row with
    fewer nodes is padded with depth-1 nodes holding its fill token."""
    depth, parent, tokens = chain_trie([[[5, 6, 7], [5, 6, 8, 9]], [[4]]], fill=[0, 3], device="cpu")
    assert tokens[0].tolist() == [5, 6, 7, 8, 9] and depth[0].tolist() == [1, 2, 3, 3, 4]
    assert parent[0].tolist() == [0, 1, 2, 2, 4]  # 7 and 8 hang from 6 (verify index 2), 9 from 8
    assert tokens[1].tolist() == [4, 3, 3, 3, 3] and depth[1].tolist() == [1] * 5 and parent[1].tolist() == [0] * 5


@pytest.mark.parametrize("batch", [1, 3, 16])
def test_lookup_with_an_ngram_store_equals_ar_greedy(tiny, drafters, batch):
    """Lookup steps that also verify an n-gram store's chain (beside the prompt's, merged into one trie) equal
    AR greedy at batch 1, 3 and 16 with ragged prompts and rows ending at their own EOS, 4 rows at a time, for
    lookup and adaptive mode, with a store of the tiny target's own greedy text (these prompts' continuations:
    right where prompt lookup has nothing, e.g. the first steps) and one of random text (mostly wrong, and apart
    from the prompt's chain: tries of two chains) and one whose chains end before B drafts; the right store takes
    fewer forwards than prompt lookup alone."""
    prompts = ragged_prompts(batch, seed=batch + 20)
    params = SamplingParams(max_new_tokens=28)
    eos = generate(tiny, prompts[-1:], params)[0].token_ids[9] if batch > 1 else -1  # (one row: no early end)
    ref = [g.token_ids for g in generate(tiny, prompts, params, eos_token_ids=[eos])]
    own = [p + r for p, r in zip(prompts, ref)]
    g = torch.Generator().manual_seed(0)
    noise = [torch.randint(3, 96, (200,), generator=g).tolist() for _ in range(4)]
    stores = {"own": NgramStore.build(own, 96, min_count=1),
              "noise": NgramStore.build(noise, 96, min_n=1, min_count=1, min_share=0.0),
              "short": NgramStore.build([p + r[:2] for p, r in zip(prompts, ref)], 96, min_count=1)}  # chains < B
    for mode in ("lookup", "adaptive"):
        forwards = {}
        for name, store in [("none", None), *stores.items()]:
            engine = Engine(tiny, drafters["trained"], EngineConfig(mode=mode, max_batch=4, max_len=96),
                            eos_token_ids=[eos], store=store)
            verified = verified_drafts(engine)
            ids = [engine.add_request(p, params) for p in prompts]
            while engine.has_work():
                engine.step()
            tries = sum(plan.mode == Mode.LOOKUP and not drafts.chain for plan, drafts in verified)
            results = [engine.result(i) for i in ids]
            assert [r.token_ids for r in results] == ref, (mode, name)
            forwards[name] = sum(r.stats.forwards for r in results)  # per row: the rows end at their own times
            if name == "noise" and mode == "lookup":
                assert tries
        if mode == "lookup":
            assert forwards["own"] < forwards["none"]


def verified_drafts(engine: Engine) -> list:
    """The (plan, drafts) of every step `engine` verifies from now on, in order."""
    seen, verify = [], engine.verify
    engine.verify = lambda plan, drafts, caps, batch: seen.append((plan, drafts)) or verify(plan, drafts, caps, batch)
    return seen


def test_adaptive_verifies_store_chains_only_where_they_pay(tiny, drafters):
    """With a store, adaptive weighs each lookup step as a trie (prompt + store chains) and as the prompt's chains
    alone: where a forward's cost is flat in its tokens it verifies tries of more than B nodes, where every token
    past a chain's B + 1 is dear it verifies full chains of B drafts and nothing larger (weighing tries alone it
    would only have small tries of shorter chains); the output equals AR greedy either way."""
    prompts = ragged_prompts(3, seed=3)
    params = SamplingParams(max_new_tokens=28)
    ref = [g.token_ids for g in generate(tiny, prompts, params)]
    g = torch.Generator().manual_seed(0)
    store = NgramStore.build([torch.randint(3, 96, (800,), generator=g).tolist()], 96, min_n=1, min_count=1,
                             min_share=0.0)

    def lookup_nodes(dear: float) -> list[tuple[int, int]]:
        """Per lookup step: drafts per chain, the most verify tokens after the bonus of any row."""
        e = Engine(tiny, drafters["trained"], EngineConfig(mode="adaptive", max_batch=3, max_len=96), store=store)
        for rows, tokens in itertools.product((1, 2, 3), (1, 2, 3, 5, 6, 9, 18, 45)):
            e.costs.record("target", rows, tokens, 0.01 + dear * (tokens > e.B + 1))
            e.costs.record("parallel", rows, tokens, 0.05)
            e.costs.record("draft", rows, tokens, 0.05)
        ids = [e.add_request(p, params) for p in prompts]
        verified = verified_drafts(e)
        while e.has_work():
            e.step()
        nodes = [(plan.block, drafts.nodes) for plan, drafts in verified if plan.mode == Mode.LOOKUP]
        assert [e.result(i).token_ids for i in ids] == ref
        return nodes

    B = drafters["trained"].config.block_size
    flat, dear = lookup_nodes(0.0), lookup_nodes(1.0)
    assert max(n for _, n in flat) > B
    assert max(n for _, n in dear) <= B and (B, B) in dear


def test_adaptive_takes_lookup_steps_where_they_pay_and_stays_exact(tiny, drafters):
    """The tiny model's greedy text repeats itself, so n-gram drafts are right; with measured costs adaptive
    takes lookup steps (one forward, no drafter), equals AR greedy, and verifies fewer forwards than with
    lookup off; where a forward's cost grows steeply with its tokens it takes none."""
    prompts = ragged_prompts(3, seed=3)
    params = SamplingParams(max_new_tokens=28)
    ref = [g.token_ids for g in generate(tiny, prompts, params)]

    def run(lookup: int, per_token: float = 1e-5):
        e = Engine(tiny, drafters["trained"], EngineConfig(mode="adaptive", max_batch=3, max_len=96, lookup=lookup))
        for rows, tokens in itertools.product((1, 2, 3), (1, 2, 3, 5, 9, 18, 45)):
            e.costs.record("target", rows, tokens, 0.01 + per_token * rows * tokens)
            e.costs.record("parallel", rows, tokens, 0.012 + 2e-5 * rows * tokens)
            e.costs.record("draft", rows, tokens, 0.008)
        ids = [e.add_request(p, params) for p in prompts]
        modes = []
        while e.has_work():
            modes.append(e.step().stats.mode)
        assert [e.result(i).token_ids for i in ids] == ref
        return modes, e.totals.num_target_forwards

    (modes, forwards), (off_modes, off_forwards) = run(4), run(0)
    assert "lookup" in modes and "lookup" not in off_modes
    assert forwards < off_forwards
    assert "lookup" not in run(4, per_token=0.05)[0]


def test_a_draining_batch_takes_lookup_steps_only_where_every_lagging_row_has_a_match(tiny, drafters):
    """With requests waiting, a lookup step where one of two rows has a match pays (a row that ends early is
    refilled); once nothing waits it does not, since the batch ends with its slowest row; when the matched row is
    more than B tokens ahead, the other one alone sets the pace and an AR step is all a lookup step would give."""
    e = Engine(tiny, drafters["trained"], EngineConfig(mode="adaptive", max_batch=2, max_len=96))
    for rows, tokens in itertools.product((1, 2), (1, 2, 3, 5, 9)):
        e.costs.record("target", rows, tokens, 0.01)  # flat: verifying drafts is free
    ids = [e.add_request(p, SamplingParams(max_new_tokens=40)) for p in ragged_prompts(3, seed=5)]
    e.step()  # admits two rows; the third request waits
    for req in e.slots:
        del req.tokens[1:]  # both rows equally far from their max_new_tokens
    proposals = [([[5, 6, 7, 8]], DraftKind("lookup", 3)), ((), None)]  # row 0 has a match, row 1 none

    class Fixed(Proposer):  # a proposer with these chains, honouring `first` as the protocol asks
        name = "fixed"

        def options(self, requests, band, first):
            if any(proposals[r][1] is None for r in first or ()):
                return []
            return [Chains(tuple(cs for cs, _ in proposals), tuple(k for _, k in proposals))]

    e.proposers[:] = [Fixed()]  # (the list the planner asks for acceptance priors)
    plan = lambda: e.weigh_model_free(2, e.band(2), 2 / 0.01)  # noqa: E731  (AR's rate)

    assert e.waiting and plan() is not None
    e.abort(ids[2])
    assert plan() is None
    proposals.reverse()
    e.slots[1].tokens.extend([1] * (e.B + 1))  # row 1 (now the matched one) far ahead: row 0 alone is critical
    assert plan() is None
    proposals.reverse()
    assert plan() is not None


def test_profile_keeps_each_shape_fastest_run_past_a_slow_spell_and_is_monotone(tiny, drafters):
    """Engine.profile on a synthetic clock: a slow spell as long as a whole round but one shape (every shape
    has a run outside it) changes no profiled cost; a shape measured slower than a larger one of its kind is
    priced at that larger one's cost; the profile seeds the cost model."""
    engine = Engine(tiny, drafters["untrained"], EngineConfig(mode="adaptive", max_batch=4, max_len=64))
    true = lambda kind, n, T, m: 0.01 + 0.001 * n * T * (1 + m) + (0.005 if kind == "draft" else 0)  # noqa: E731
    calls = []

    def clean(kind, n, T, m):
        calls.append((kind, n, T, m))
        return true(kind, n, T, m)

    engine.profile(rounds=2, timer=clean)
    per_round = len(calls) // 3  # the warm-up round + 2
    spell = range(per_round + 1, 2 * per_round + 1)  # from round 1's second shape into round 2's first
    clock = iter(range(10 ** 6))

    def spelled(kind, n, T, m):
        i = next(clock)
        slow = 1.0 if i in spell else 0.0
        anomaly = 0.5 if (kind, n, T) == ("target", 1, 2) else 0.0  # always slower than 1 x 3 tokens
        return true(kind, n, T, m) + slow + anomaly

    points = engine.profile(rounds=2, timer=spelled)
    for kind, n, T, m in set(calls) - {("target", 1, 2, 0)}:
        assert points[kind][(n, T * (1 + m))] == pytest.approx(true(kind, n, T, m)), (kind, n, T, m)
    assert points["target"][(1, 2)] == pytest.approx(true("target", 1, 3, 0))  # bounded by the larger shape
    assert engine.costs.seconds("target", 4, 5) == pytest.approx(true("target", 4, 5, 0))


def test_monotone_bounds_each_point_by_every_larger_one():
    pts = {(1, 1): 3.0, (1, 2): 2.0, (1, 4): 5.0, (2, 1): 1.5, (2, 4): 6.0}
    assert monotone(pts) == {(1, 1): 1.5, (1, 2): 2.0, (1, 4): 5.0, (2, 1): 1.5, (2, 4): 6.0}
    assert monotone(monotone(pts)) == monotone(pts)


def test_cost_model_tells_rows_from_tokens_per_row():
    """Forward costs are kept by (rows, tokens per row): between measured points time is linear in tokens per
    row along a row count, then in rows; beyond the most rows measured, proportional. 16 rows x 2 tokens and
    4 rows x 8 carry as many tokens but do not cost the same."""
    costs = CostModel()
    f = lambda rows, tokens: 0.01 + 0.001 * rows + 0.0005 * rows * tokens  # noqa: E731  (bilinear)
    for rows, tokens in itertools.product((1, 4, 16), (1, 3, 9)):
        costs.record("target", rows, tokens, f(rows, tokens))
    for rows, tokens in ((16, 2), (4, 8), (10, 5), (2, 1), (16, 9)):
        assert costs.seconds("target", rows, tokens) == pytest.approx(f(rows, tokens))
    assert costs.seconds("target", 16, 2) != pytest.approx(costs.seconds("target", 4, 8))
    assert costs.seconds("target", 32, 3) == pytest.approx(2 * f(16, 3))


def test_engine_totals_are_the_sum_of_its_steps(tiny, drafters):
    """Over a whole run, the engine's totals equal the sum over its steps' own stats, and its tokens are every
    token the requests got."""
    from flexdraft.engine.stats import SpecDecodingStats

    engine = Engine(tiny, drafters["trained"], EngineConfig(mode="adaptive", max_batch=3, max_len=96, cost_model=False))
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=12)) for p in ragged_prompts(4, seed=2)]
    mine = SpecDecodingStats()
    while engine.has_work():
        mine.observe(engine.step().stats)
    assert engine.totals == mine
    assert mine.num_tokens == sum(len(engine.result(i).token_ids) for i in ids)
    assert mine.num_drafts > 0 and mine.num_accepted_tokens_per_pos[0] <= mine.num_drafts


def test_reconfigure_is_checked_whole_before_anything_changes(tiny, drafters):
    """`reconfigure` takes live knobs only, applies nothing when any value is invalid, and the planner follows
    the knobs it owns (switch_batch, cost_model) with re-priced plans."""
    engine = Engine(tiny, drafters["trained"], EngineConfig(mode="adaptive", switch_batch=4, max_len=96))
    with pytest.raises(FlexDraftError, match="not a live engine knob: max_batch"):
        engine.reconfigure(max_batch=2)
    with pytest.raises(FlexDraftError, match="rho must be in"):
        engine.reconfigure(switch_batch=1, rho=0.0)
    assert engine.config.switch_batch == engine.planner.switch_batch == 4
    assert engine.reconfigure(switch_batch=1, cost_model=False, top_m=0) == {"switch_batch": 1, "cost_model": False}
    assert (engine.planner.switch_batch, engine.planner.cost_model) == (1, False)
    assert [engine.plan(n).mode for n in (1, 2)] == ["parallel", "sequential"]
