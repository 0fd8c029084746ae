"""Batched AR generation: equal to `transformers` greedy, batch-invariant, EOS per row, sampling filters."""
import pytest
import torch

from conftest import make_tiny_hf
from flexdraft.core.config import RuntimeConfig
from flexdraft.core.errors import FlexDraftError
from flexdraft.engine.ar import generate
from flexdraft.models.loading import load_model
from flexdraft.speculative.sampling import (
    SamplingParams,
    argmax_tokens,
    draw,
    filtered_logits,
    top_logprobs,
    top_p_drop,
)

GREEDY64 = SamplingParams(max_new_tokens=64)


@pytest.mark.real_model
def test_greedy_equals_transformers_generate_on_gsm8k(real_lm, real_hf, gsm8k_prompts):
    """Bundled SmolLM2, fp32: our batch of 4 ragged GSM8K chat prompts x 64 new tokens gives, token for token,
    what `transformers` generate gives for each prompt (greedy, same EOS)."""
    prompts = gsm8k_prompts[:4]
    ours = generate(real_lm.model, prompts, GREEDY64, real_lm.eos_token_ids)
    for p, g in zip(prompts, ours):
        ref = real_hf.generate(torch.tensor([p]), max_new_tokens=64, do_sample=False,
                               eos_token_id=list(real_lm.eos_token_ids), pad_token_id=2)[0, len(p):].tolist()
        assert g.token_ids == ref


@pytest.mark.real_model
def test_ragged_batch_of_8_equals_each_prompt_alone(real_lm, gsm8k_prompts):
    """Bundled SmolLM2, fp32: 8 prompts of different lengths in one batch give the same 32 tokens as alone."""
    assert len({len(p) for p in gsm8k_prompts}) > 4  # really ragged
    params = SamplingParams(max_new_tokens=32)
    batched = generate(real_lm.model, gsm8k_prompts, params, real_lm.eos_token_ids)
    for p, g in zip(gsm8k_prompts, batched):
        assert g.token_ids == generate(real_lm.model, [p], params, real_lm.eos_token_ids)[0].token_ids


def test_rows_stop_at_their_own_eos_and_others_continue(tmp_path):
    """Tiny llama: with EOS = a token one row emits early, that row ends there (EOS included) while the
    others, dropped from or kept in the batch, produce exactly what they produce alone."""
    make_tiny_hf("llama", tmp_path)
    model = load_model(tmp_path, RuntimeConfig(device="cpu", dtype="float32"), with_tokenizer=False).model
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (5, 11, 8, 3)]
    params = SamplingParams(max_new_tokens=20)
    free = generate(model, prompts, params)
    eos = free[1].token_ids[4]  # row 1 emits this at step 4
    with_eos = generate(model, prompts, params, eos_token_ids=[eos])
    first = free[1].token_ids.index(eos)
    assert with_eos[1].token_ids == free[1].token_ids[: first + 1] and with_eos[1].finish_reason == "eos"
    for p, got in zip(prompts, with_eos):
        assert got.token_ids == generate(model, [p], params, eos_token_ids=[eos])[0].token_ids
    assert any(len(r.token_ids) == 20 and r.finish_reason == "length" for r in with_eos)


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(tmp_path):
    make_tiny_hf("qwen3", tmp_path)
    model = load_model(tmp_path, RuntimeConfig(device="cpu", dtype="float32"), with_tokenizer=False).model
    prompts = [[5, 6, 7, 8], [9, 10]]
    sampled = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.9, seed=7)
    a, b = generate(model, prompts, sampled), generate(model, prompts, sampled)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    greedy = generate(model, prompts, SamplingParams(max_new_tokens=16))
    top1 = generate(model, prompts, SamplingParams(max_new_tokens=16, temperature=1.0, top_k=1, seed=1))
    assert [r.token_ids for r in top1] == [r.token_ids for r in greedy]


def test_top_k_top_p_keep_exactly_the_reference_sets():
    """top-k keeps the k largest; top-p keeps the smallest prefix (by probability) whose mass reaches p."""
    probs = torch.tensor([[0.05, 0.4, 0.1, 0.3, 0.15]])
    logits = probs.log()
    kept = lambda params: torch.isfinite(filtered_logits(logits, params))[0].nonzero().flatten().tolist()
    assert kept(SamplingParams(temperature=1.0, top_k=2)) == [1, 3]
    assert kept(SamplingParams(temperature=1.0, top_p=0.7)) == [1, 3]  # 0.4 + 0.3 reaches 0.7
    assert kept(SamplingParams(temperature=1.0, top_p=0.71)) == [1, 3, 4]
    assert kept(SamplingParams(temperature=1.0, top_p=0.1)) == [1]  # the top token always stays
    renorm = filtered_logits(logits, SamplingParams(temperature=1.0, top_p=0.7)).softmax(-1)[0]
    torch.testing.assert_close(renorm[[1, 3]], torch.tensor([0.4, 0.3]) / 0.7)


def test_top_p_ranks_only_the_head_where_it_holds_the_mass_and_equals_a_full_sort():
    """top_p_drop ranks a row's first k tokens when they hold top_p of its mass, else sorts the row: on peaked
    and flat rows alike (both paths in one batch) it removes exactly the tokens a full sort removes."""
    g = torch.Generator().manual_seed(0)
    peaked = torch.randn(6, 5000, generator=g) * 4
    peaked[:, :3] += 24  # a few likely tokens, as a language model's next-token logits usually have
    flat = torch.randn(6, 5000, generator=g) * 0.1
    logits = torch.cat((peaked, flat))
    for top_p in (0.5, 0.9, 0.99):
        ranked, order = logits.softmax(-1).sort(dim=-1, descending=True)
        cut = ranked.cumsum(-1) - ranked >= top_p
        reference = cut.scatter(-1, order, cut)
        drop = top_p_drop(logits, top_p, first=64)
        assert torch.equal(drop, reference)
        head = (logits.softmax(-1).topk(64).values.sum(-1) >= top_p)
        assert head[:6].all() and not head[6:].any()  # both paths taken


def test_draw_follows_the_weights_and_never_picks_a_zero_weight():
    """Inverse-CDF draws, 40,000 per row from unnormalised weights with zeros at both ends and inside: zero-weight
    tokens never come up, and every frequency is within 5 standard errors of its probability."""
    weights = torch.tensor([[0.0, 3.0, 0.0, 1.0, 6.0, 0.0], [2.0, 0.0, 0.0, 0.0, 0.0, 2.0]])
    g = torch.Generator().manual_seed(0)
    n = 40_000
    tokens = draw(weights[:, None, :].expand(2, n, 6), g)  # [2, n]
    counts = torch.stack([torch.bincount(t, minlength=6) for t in tokens]).double()
    assert torch.all(counts[weights == 0] == 0)
    p = weights / weights.sum(-1, keepdim=True)
    assert torch.all((counts / n - p).abs() <= 5 * (p * (1 - p) / n).sqrt())


@pytest.mark.parametrize("vocab", [49152, 151936, 1000, 96])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chunked_argmax_and_top_logprobs_equal_torch(vocab, dtype):
    """argmax_tokens equals torch's argmax (the first of tied maxima, here at both ends of the vocabulary and in
    two chunks) and top_logprobs the top 4 of log_softmax, over bf16 and fp32, strided slices, vocabularies the
    chunking splits (SmolLM2's 49,152, Qwen's 151,936 in chunks of 128) and ones it leaves to torch."""
    g = torch.Generator().manual_seed(vocab)
    x = (torch.randn(3, 6, vocab, generator=g) * 4).to(dtype)
    x[0, 0, 3] = x[0, 0, vocab - 1] = 60.0
    x[1, 2, vocab // 2] = x[1, 2, vocab // 2 + 1] = 60.0  # (adjacent: one chunk, unless it is a boundary)
    for logits in (x, x[:, 1:4]):
        assert torch.equal(argmax_tokens(logits), logits.float().argmax(-1))
        logp, ids = top_logprobs(logits, 4)
        ref_logp, ref_ids = logits.float().log_softmax(-1).topk(4, dim=-1)
        assert torch.allclose(logp, ref_logp, atol=1e-4)  # (fp32 sums of 150k terms in another order)
        assert torch.equal(logits.float().gather(-1, ids), logits.float().gather(-1, ref_ids))  # (ties: any order)
    assert argmax_tokens(x)[0, 0] == 3


@pytest.mark.parametrize("kwargs,needle", [
    ({"max_new_tokens": 0}, "max_new_tokens must be a positive integer, got 0"),
    ({"temperature": -0.5}, "temperature must be >= 0, got -0.5"),
    ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
    ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
])
def test_invalid_sampling_parameters_are_named(kwargs, needle):
    with pytest.raises(FlexDraftError, match=__import__("re").escape(needle)):
        SamplingParams(**kwargs)


def test_prompt_longer_than_context_is_refused(tmp_path):
    make_tiny_hf("llama", tmp_path)
    model = load_model(tmp_path, RuntimeConfig(device="cpu", dtype="float32"), with_tokenizer=False).model
    with pytest.raises(FlexDraftError, match="prompt 1 has 300 tokens: longer than the model's context of 256"):
        generate(model, [[5, 6], [7] * 300], SamplingParams(max_new_tokens=4))
    with pytest.raises(FlexDraftError, match="token id 96 outside the vocabulary of 96"):
        generate(model, [[5, 96]], SamplingParams(max_new_tokens=4))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_packed_prefill_fills_each_row_as_its_prompt_alone_would(tmp_path, monkeypatch, arch):
    """Ragged prompts prefilled packed side by side, over several forwards (a token budget smaller than the
    prompts), give each cache row the keys/values and last hidden state of its prompt prefilled alone (fp32; qwen3:
    per-head q/k norm), touch no slot past a row's length, and set each row's length."""
    import flexdraft.engine.ar as ar

    make_tiny_hf(arch, tmp_path)
    model = load_model(tmp_path, RuntimeConfig(device="cpu", dtype="float32"), with_tokenizer=False).model
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (40, 7, 33, 1, 19)]
    monkeypatch.setattr(ar, "PREFILL_TOKENS", 50)
    assert ar.prefill_chunks([len(p) for p in prompts], 50) == [(0, 2), (2, 4), (4, 5)]
    with torch.inference_mode():
        cache = model.new_cache(len(prompts), 64)
        h = ar.prefill(model, cache, prompts)
        assert cache.lens.tolist() == [len(p) for p in prompts]
        for r, p in enumerate(prompts):
            alone = model.new_cache(1, 64)
            h_alone = model(torch.tensor([p]), torch.arange(len(p))[None], alone)[0, -1]
            assert torch.allclose(h[r], h_alone, atol=1e-5)
            for mine, ref in zip(cache.k + cache.v, alone.k + alone.v):
                assert torch.allclose(mine[r, :, :len(p)], ref[0, :, :len(p)], atol=1e-5)
                assert not mine[r, :, len(p):].any()


def test_a_deadline_cuts_running_rows_and_a_future_one_changes_nothing(tmp_path):
    """A deadline already passed stops every row after the token its prefill gives (finish_reason "time"); one
    far ahead gives exactly the tokens and reasons of a call without one."""
    import time

    make_tiny_hf("llama", tmp_path)
    model = load_model(tmp_path, RuntimeConfig(device="cpu", dtype="float32"), with_tokenizer=False).model
    prompts, params = [[5, 6, 7], [9] * 6, [11, 12]], SamplingParams(max_new_tokens=12)
    full = generate(model, prompts, params, eos_token_ids=(3,))
    cut = generate(model, prompts, params, eos_token_ids=(3,), deadline=time.time() - 1)
    later = generate(model, prompts, params, eos_token_ids=(3,), deadline=time.time() + 3600)
    assert [g.token_ids for g in later] == [g.token_ids for g in full]
    assert [g.finish_reason for g in later] == [g.finish_reason for g in full]
    assert all(len(g.token_ids) == 12 for g in full)  # so every row was still running at the deadline
    assert [g.token_ids for g in cut] == [g.token_ids[:1] for g in full]
    assert {g.finish_reason for g in cut} == {"time"}
