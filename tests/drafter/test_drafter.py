"""The drafter's block path: what it shares with the target, what it must never see, what it trains."""
import itertools
import json

import pytest
import torch

from conftest import make_tiny_hf
from flexdraft.core.config import RuntimeConfig
from flexdraft.core.errors import FlexDraftError
from flexdraft.drafter.model import Drafter, DrafterConfig, load_drafter, save_drafter
from flexdraft.engine.ar import generate
from flexdraft.models.loading import load_model
from flexdraft.speculative.sampling import SamplingParams
from flexdraft.training.drafter_training import (
    Sequences,
    agreement_counts,
    block_targets,
    draft_hidden,
    gather_positions,
    sample_anchors,
    target_pass,
    training_step,
    tree_accepted,
)

CPU32 = RuntimeConfig(device="cpu", dtype="float32", threads=1, cpu_prepack=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    make_tiny_hf("qwen3", folder)  # q/k norm: the projector copy must carry them too
    return load_model(folder, CPU32, with_tokenizer=False).model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llama")
    make_tiny_hf("llama", folder)  # no q/k norm: paired projectors pick each slot's half before rope
    return load_model(folder, CPU32, with_tokenizer=False).model


def sequences(vocab: int, R: int = 2, T: int = 40, seed: int = 0) -> Sequences:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, vocab, (R, T), generator=g)
    return Sequences(tokens, torch.full((R,), T), torch.full((R,), 6))


def true_token_blocks(drafter, target, seqs, cache, anchors):
    """Blocks whose every slot holds the real token at its position (not the mask) -> hidden [R, A, B+1, d]."""
    R, A = anchors.shape
    B1 = drafter.config.block_size + 1
    pos = anchors[..., None] + 1 + torch.arange(B1)
    inputs = target.embed_tokens(seqs.tokens.gather(1, pos.reshape(R, -1)))
    T = seqs.tokens.shape[1]
    ctx = (torch.arange(T) <= anchors[..., None])[:, :, None].expand(R, A, B1, T).reshape(R, A * B1, T)
    block_of = torch.arange(A)[None, :, None].expand(R, A, B1).reshape(R, -1)
    return drafter(target, inputs, pos.reshape(R, -1), block_of, cache, ctx).view(R, A, B1, -1)


@torch.no_grad()
@pytest.mark.parametrize("tuned_attention", ["causal", "bidirectional"])
def test_init_copy_drafter_reproduces_target_on_true_tokens(tiny, tuned_attention):
    """e = 0, projectors copied from the target, every slot holding the real token: a block slot is an ordinary
    token of the sequence, so its final hidden state equals the target's at that position (fp32, 1e-5) — for
    every slot with causal in-block attention in the tuned layers (k = 2); with bidirectional attention only
    for the block's last slot and only for k = 1 (it sees no later slot, but in a second tuned layer it would
    read the keys of earlier slots that saw later ones). Three overlapping blocks per row, one pass."""
    k = 2 if tuned_attention == "causal" else 1
    drafter = Drafter.from_target(tiny, DrafterConfig(k=k, block_size=4, tuned_attention=tuned_attention))
    seqs = sequences(tiny.args.vocab_size)
    cache, h = target_pass(tiny, seqs)
    anchors = torch.tensor([[5, 7, 20], [9, 10, 30]])
    got = true_token_blocks(drafter, tiny, seqs, cache, anchors)  # [R, A, 5, d]
    pos = anchors[..., None] + 1 + torch.arange(5)
    want = h.gather(1, pos.reshape(2, -1, 1).expand(-1, -1, h.shape[-1])).view(got.shape)
    if tuned_attention == "causal":
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(got[:, :, -1], want[:, :, -1], atol=1e-5, rtol=1e-5)
        assert not torch.allclose(got[:, :, 0], want[:, :, 0], atol=1e-3)  # slot 0 now sees later slots


@torch.no_grad()
@pytest.mark.parametrize("tuned_attention", ["causal", "bidirectional"])
@pytest.mark.parametrize("model", ["tiny", "tiny_llama"])
def test_known_bonus_drafts_the_targets_own_next_token(request, model, tuned_attention):
    """A known bonus in slot 0 is a clean token: whatever the tuned projectors (randomised here), its final
    hidden state equals the target's at that position (fp32, 1e-5), so d_1 = the target's next token; the
    sequential engine path (blocks written in the cache) gives the same. A masked slot 0 does not. The
    engine's paired projectors (one GEMM for the target's and the drafter's) change no slot (1e-5), with
    q/k norms (Qwen3: each set's heads and rope apart) and without (Llama: each slot's half picked first)."""
    tiny = request.getfixturevalue(model)
    torch.manual_seed(0)
    drafter = Drafter.from_target(tiny, DrafterConfig(k=2, block_size=4, tuned_attention=tuned_attention))
    for p in drafter.attn.parameters():
        p.add_(0.5 * torch.randn_like(p))
    seqs = sequences(tiny.args.vocab_size)
    cache, h = target_pass(tiny, seqs)
    anchors = torch.tensor([[5, 7, 20], [9, 10, 30]])
    known = torch.tensor([[True, False, True], [True, True, False]])
    got = draft_hidden(drafter, tiny, seqs, cache, anchors, known)[:, :, 0]  # [R, A, d]
    want = h.gather(1, (anchors + 1)[..., None].expand(-1, -1, h.shape[-1]))
    torch.testing.assert_close(got[known], want[known], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got[~known], want[~known], atol=1e-2)

    row = seqs.tokens[:1, :11]  # the sequential engine's pass: a block at the row's length, bonus = token 10
    part = tiny.new_cache(1, 40)
    tiny(row[:, :10], torch.arange(10)[None], part)
    part.lens[:] = 10
    inputs = drafter.slot_inputs(tiny, row[:, 10], torch.ones(1, dtype=torch.bool))
    unpaired = drafter.forward_in_cache(tiny, inputs, part)
    torch.testing.assert_close(unpaired[:, 0], h[:1, 10], atol=1e-5, rtol=1e-5)

    drafter.pair_with(tiny)  # fp32 rounding apart (the AMD machine: 1.6e-6 between one GEMM and two); swapped halves differ by ~1
    torch.testing.assert_close(drafter.forward_in_cache(tiny, inputs, part), unpaired, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(draft_hidden(drafter, tiny, seqs, cache, anchors, known)[:, :, 0], got, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_blocks_are_isolated_and_see_only_their_prefix(tiny):
    """Perturbing one block's slot-0 token leaves the other blocks bit-identical; cached keys past a block's
    anchor never reach it; the drafter never writes the target's cache."""
    drafter = Drafter.from_target(tiny, DrafterConfig(k=2, block_size=3))
    seqs = sequences(tiny.args.vocab_size)
    cache, _ = target_pass(tiny, seqs)
    snapshot = [k.clone() for k in cache.k] + [v.clone() for v in cache.v]
    anchors = torch.tensor([[8, 9, 25], [6, 15, 16]])
    known = torch.ones_like(anchors, dtype=torch.bool)
    base = draft_hidden(drafter, tiny, seqs, cache, anchors, known)
    assert all(torch.equal(a, b) for a, b in zip(snapshot, cache.k + cache.v))

    other = Sequences(seqs.tokens.clone(), seqs.lens, seqs.prompt_lens)
    other.tokens[0, 9 + 1] += 1  # slot 0 (bonus) of block (row 0, anchor 9) only; a prefix token of no block <= 9
    changed = draft_hidden(drafter, tiny, other, cache, anchors, known)  # same cache: only block inputs differ
    assert torch.equal(changed[0, [0, 2]], base[0, [0, 2]]) and torch.equal(changed[1], base[1])
    assert not torch.allclose(changed[0, 1], base[0, 1])

    for layer in range(tiny.args.n_layers):  # cached keys after anchor 25 (row 0): invisible to every block
        cache.k[layer][0, :, 26:] += 5.0
    assert torch.equal(draft_hidden(drafter, tiny, seqs, cache, anchors, known), base)
    cache.k[-1][0, :, 3] += 5.0  # inside every row-0 prefix
    assert not torch.allclose(draft_hidden(drafter, tiny, seqs, cache, anchors, known)[0], base[0])


def test_gradients_reach_only_the_tuned_projectors(tiny):
    """Attention tuning with e = 0 < s: gradients land on Q'K'V'O' of the k tuned layers only — not the mask
    embedding (frozen below s), the calibration MLP or any target weight; calibration trains only the MLP."""
    drafter = Drafter.from_target(tiny, DrafterConfig(k=2, block_size=4))
    seqs = sequences(tiny.args.vocab_size)
    g = torch.Generator().manual_seed(0)
    trainable = drafter.parameters_for("attention")
    training_step(drafter, tiny, seqs, "attention", 8, "ce", 0.8, g).loss.backward()
    with_grad = {n for n, p in drafter.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert with_grad == {n for n, _ in drafter.named_parameters() if n.startswith("attn.")}
    assert len(trainable) == len(with_grad)
    # the target's weights, and the fused q/k/v and gate/up copies its layers compute with, record no graph
    fused = [f.linear.weight for layer in tiny.layers for f in (layer.self_attn.qkv, layer.mlp.gate_up)]
    assert all(not p.requires_grad and p.grad is None for p in [*tiny.parameters(), *fused])

    drafter.zero_grad(set_to_none=True)
    drafter.parameters_for("calibration")
    training_step(drafter, tiny, seqs, "calibration", 8, "kl", 0.8, g).loss.backward()
    assert {n for n, p in drafter.named_parameters() if p.grad is not None} == {
        n for n, _ in drafter.named_parameters() if n.startswith("calibration.")}


@torch.no_grad()
def test_ce_targets_are_the_targets_greedy_tokens_on_its_own_answers(tiny):
    """The ce loss trains slot j of a block anchored at p towards the distilled token at p+1+j, without an LM
    head for the target: on the target's own greedy answers (what distillation writes) that token is the
    target's argmax at p+j, for every anchor the sampler can pick."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, tiny.args.vocab_size, (n,), generator=g).tolist() for n in (5, 9, 7)]
    outs = generate(tiny, prompts, SamplingParams(max_new_tokens=30))
    rows = [p + o.token_ids for p, o in zip(prompts, outs)]
    tokens = torch.zeros(3, max(map(len, rows)), dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r)
    seqs = Sequences(tokens, torch.tensor([len(r) for r in rows]), torch.tensor([len(p) for p in prompts]))
    _, h = target_pass(tiny, seqs)
    B = 4
    anchors, valid = sample_anchors(seqs, B, 64, g)  # every valid anchor
    assert int(valid.sum()) == sum(len(r) - len(p) - B for r, p in zip(rows, prompts))
    wanted = block_targets(seqs, anchors, B)[valid]
    assert torch.equal(wanted, tiny.logits(gather_positions(h, anchors, B)).argmax(-1)[valid])


@torch.no_grad()
def test_evaluation_scores_a_known_bonus_with_the_block_pass_arithmetic(tmp_path):
    """bf16 on the math path, as training pins it: a known bonus's draft d_1, the target's own next token, agrees
    with the evaluation's target tokens wherever the block pass gives the bonus slot the very hidden state of
    the sequence pass, near-ties included: on CPUs whose bf16 GEMMs treat rows alike (AMX) that is every one of
    216 blocks (with the target pass on SDPA beside the math block pass, 4 of them disagreed on an AVX512-BF16
    machine); elsewhere at least the blocks whose hidden states are bitwise equal."""
    make_tiny_hf("llama", tmp_path)
    runtime = RuntimeConfig(device="cpu", dtype="bfloat16", cpu_prepack=False, cpu_attention="math")
    target = load_model(tmp_path, runtime, with_tokenizer=False).model
    drafter = Drafter.from_target(target, DrafterConfig(k=2, block_size=4))
    seqs = sequences(target.args.vocab_size, R=4, T=64)
    anchors = torch.arange(5, 59).expand(4, -1)  # every valid anchor
    cache, h = target_pass(target, seqs, sdpa=False)
    slot0 = draft_hidden(drafter, target, seqs, cache, anchors, torch.ones_like(anchors, dtype=torch.bool))[:, :, 0]
    equal = (slot0 == h.gather(1, (anchors + 1)[..., None].expand(-1, -1, h.shape[-1]))).all(-1)  # [4, 54]
    counts = agreement_counts(drafter, target, seqs, stride=1, max_anchors=64)
    assert counts["blocks"] == 216 and counts["bonus.agree"][0] >= int(equal.sum())
    if equal.all():
        assert counts["bonus.agree"][0] == 216


@torch.no_grad()
def test_fresh_calibration_changes_nothing(tiny):
    """The calibration MLP's last layer starts at zero: calibrated and uncalibrated agreement are identical."""
    drafter = Drafter.from_target(tiny, DrafterConfig(k=2, block_size=4))
    counts = agreement_counts(drafter, tiny, sequences(tiny.args.vocab_size), stride=2, max_anchors=8)
    assert counts["blocks"] == 2 * 8
    assert counts["mask.agree"] == counts["mask_calibrated.agree"]


def test_save_load_roundtrip_and_base_mismatch(tiny, tmp_path):
    """A saved drafter reloads bit-exactly (safetensors + JSON); weights that disagree with the config's k and a
    drafter for other base weights are refused with a named error."""
    drafter = Drafter.from_target(tiny, DrafterConfig(k=3, block_size=5, entry_layer=1))
    with torch.no_grad():
        drafter.calibration.down.weight.normal_()
    save_drafter(drafter, tmp_path / "d", "tiny", tiny.fingerprint)
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["drafter.json", "drafter.safetensors"]
    loaded = load_drafter(tmp_path / "d", tiny)
    assert loaded.config == drafter.config
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), drafter.state_dict().values()))

    meta = json.loads((tmp_path / "d" / "drafter.json").read_text())
    meta["config"]["k"] = 2  # config edited by hand: weights of 3 tuned layers, config says 2
    (tmp_path / "d" / "drafter.json").write_text(json.dumps(meta))
    with pytest.raises(FlexDraftError, match="weights do not match its config"):
        load_drafter(tmp_path / "d", tiny)

    make_tiny_hf("qwen3", tmp_path / "other", seed=1)
    other = load_model(tmp_path / "other", CPU32, with_tokenizer=False).model
    with pytest.raises(FlexDraftError, match="other base weights"):
        load_drafter(tmp_path / "d", other)

    # formats 1 and 2 drafted with a known bonus on the tuned projectors: refused, with what to do
    for old in ("flexdraft-drafter/1", "flexdraft-drafter/2"):
        meta.update(format=old, stage="attention", config=drafter.config.__dict__)
        (tmp_path / "d" / "drafter.json").write_text(json.dumps(meta))
        with pytest.raises(FlexDraftError, match="older FlexDraft.*train it again"):
            load_drafter(tmp_path / "d", tiny)


def test_fingerprint_ignores_dtype(tiny, tmp_path):
    """fp32 and bf16 loads of the same weights have one fingerprint (a drafter serves both)."""
    make_tiny_hf("qwen3", tmp_path)
    a = load_model(tmp_path, CPU32, with_tokenizer=False).model
    b = load_model(tmp_path, RuntimeConfig(device="cpu", dtype="bfloat16", threads=1), with_tokenizer=False).model
    assert a.fingerprint == b.fingerprint == tiny.fingerprint


@pytest.mark.parametrize("cfg,msg", [(DrafterConfig(k=9), "between 1 and the model's 4 layers"),
                                     (DrafterConfig(k=2, entry_layer=3), "entry_layer=3"),
                                     (DrafterConfig(block_size=0, k=2), "block_size")])
def test_bad_drafter_config(tiny, cfg, msg):
    with pytest.raises(FlexDraftError, match=msg):
        Drafter(tiny.args, cfg)


@torch.no_grad()
@pytest.mark.parametrize("tuned_attention", ["bidirectional", "causal"])
def test_in_cache_drafting_equals_the_copying_block_forward(tiny, tuned_attention):
    """One block per row at the row's length (the engine's sequential drafting): writing the block's K/V past
    each row's length and attending over the cache gives the hidden states of the block forward that copies
    the prefix (fp32, 1e-5), ragged rows, entry layer 1; the cache up to each row's length is untouched."""
    drafter = Drafter.from_target(tiny, DrafterConfig(k=2, block_size=4, entry_layer=1,
                                                      tuned_attention=tuned_attention))
    seqs = sequences(tiny.args.vocab_size, R=3)
    cache, _ = target_pass(tiny, seqs)
    cache.lens = torch.tensor([12, 30, 21])
    kept = [k[r, :, :n].clone() for k in cache.k for r, n in enumerate(cache.lens.tolist())]
    inputs = drafter.slot_inputs(tiny, torch.tensor([5, 9, 11]), torch.ones(3, dtype=torch.bool))  # [3, 5, d]
    pos = cache.lens[:, None] + torch.arange(5)
    ctx = (torch.arange(40) < cache.lens[:, None, None]).expand(3, 5, 40)
    clean = (torch.arange(5) == 0).expand(3, 5)  # slot 0: the known bonus
    want = drafter(tiny, inputs, pos, torch.zeros_like(pos), cache, ctx, clean=clean)
    got = drafter.forward_in_cache(tiny, inputs, cache)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert all(torch.equal(a, k[r, :, :n]) for a, (k, (r, n)) in
               zip(kept, ((k, rn) for k in cache.k for rn in enumerate(cache.lens.tolist()))))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("entry", [0, 1])
def test_a_paired_drafter_pass_through_the_cpp_stack_computes_what_its_python_layers_compute(tmp_path, dtype, entry):
    """At SmolLM2's widths, prepacked: the sequential pass (blocks in the cache, ragged rows) and the parallel pass
    (verify tokens plus branches) of a paired drafter, blocks entering at layer 0 or 1, give bitwise the hidden
    states and cache writes of the Python layers when their layers run as one C++ call (the tuned layers' paired
    GEMMs, each slot's half picked, under their own mask)."""
    from flexdraft.drafter.model import parallel_forward
    from flexdraft.models import kernels

    make_tiny_hf("llama", tmp_path, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                 num_key_value_heads=3, head_dim=64)
    model = load_model(tmp_path, RuntimeConfig(device="cpu", dtype=dtype, threads=1), with_tokenizer=False).model
    if model.stack_params is None:
        pytest.skip("no C++ layer stack on this CPU in this dtype")
    torch.manual_seed(0)
    drafter = Drafter.from_target(model, DrafterConfig(k=model.args.n_layers - 1, block_size=4, entry_layer=entry))
    with torch.no_grad():
        for p in drafter.attn.parameters():
            p.add_(0.5 * torch.randn_like(p))
    drafter.to_runtime(model)
    seqs = torch.randint(3, 96, (2, 30), generator=torch.Generator().manual_seed(1))

    @torch.inference_mode()
    def run(stack):
        model.stack_params = stack
        cache = model.new_cache(2, 64)
        model(seqs[:, :20], torch.arange(20).expand(2, 20), cache)
        cache.lens[:] = torch.tensor([20, 17])
        inputs = drafter.slot_inputs(model, seqs[:, 20], torch.ones(2, dtype=torch.bool))
        sequential = drafter.forward_in_cache(model, inputs, cache)  # 2 rows x 5 slots
        one = cache.rows(0, 1)
        clean, branches = parallel_forward(model, drafter, seqs[:1, 20:23], one.next_positions(3), one,
                                           torch.tensor([[0, 1]]))  # 3 verify tokens + 2 branches of 3
        return [sequential, clean, branches, *(k.clone() for k in cache.k), *(v.clone() for v in cache.v)]

    x = torch.zeros(1, 9, 576, dtype=model.dtype)
    with torch.inference_mode():
        assert kernels.use_decoder_stack(x, 9, 3, 64)  # the parallel pass's 9 tokens: the stack takes them
    got, want = run(model.stack_params), run(None)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_tree_accepted_length_matches_brute_force():
    """bonus/tau_treeN's count (the engine's draft_tree + tree_walk): for random draft distributions and
    continuations, the accepted length equals brute force over every path of top-4 ranks: the N prefixes of
    highest summed log-probability, then the deepest one whose tokens are the continuation's."""
    g = torch.Generator().manual_seed(0)
    M, B, V, K = 60, 4, 9, 4
    logits = torch.randn(M, B, V, generator=g) * 2
    logp, cand = logits.log_softmax(-1).topk(K, dim=-1)
    # continuations drawn near the drafts: rank 0-2 mostly, sometimes a token outside the top 4
    pick = torch.randint(0, 6, (M, B), generator=g)
    target = torch.where(pick < K, cand.gather(-1, pick.clamp(max=K - 1)[..., None]).squeeze(-1), V - 1 - cand[..., 0])
    for N in (1, 5, 8, 16):
        got = tree_accepted(logits, target, N, width=K)
        for m in range(M):
            prefixes = [p for d in range(1, B + 1) for p in itertools.product(range(K), repeat=d)]
            score = {p: sum(float(logp[m, j, r]) for j, r in enumerate(p)) for p in prefixes}
            tree = sorted(prefixes, key=lambda p: (-score[p], len(p)))[:N]
            ok = [len(p) for p in tree if all(int(cand[m, j, r]) == int(target[m, j]) for j, r in enumerate(p))]
            assert int(got[m]) == max(ok, default=0), (N, m)
