"""The runtime reproduces `transformers`' implementation of the same weights, through the KV cache."""
import pytest
import torch

from conftest import make_tiny_hf
from flexdraft.core.config import RuntimeConfig
from flexdraft.models.attention import CAUSAL_MIN_TOKENS
from flexdraft.models.loading import load_model

CPU32 = RuntimeConfig(device="cpu", dtype="float32", threads=1)

LLAMA3_ROPE = {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 32}}


def incremental_logits(model, seqs: torch.Tensor, n_prefill: int) -> torch.Tensor:
    """Prefill n_prefill tokens, then feed the rest one token per step through the cache: [B, T, V]."""
    B, T = seqs.shape
    cache = model.new_cache(B, T)
    pos = torch.arange(n_prefill).expand(B, n_prefill)
    out = [model.logits(model(seqs[:, :n_prefill], pos, cache))]
    cache.lens[:] = n_prefill
    for t in range(n_prefill, T):
        out.append(model.logits(model(seqs[:, t:t + 1], cache.next_positions(1), cache)))
        cache.lens += 1
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("qwen2", {}), ("qwen3", {}),
                                            ("llama", LLAMA3_ROPE), ("llama", {"attention_bias": True})],
                         ids=["llama", "qwen2", "qwen3", "llama-rope-llama3", "llama-attn-bias"])
@torch.inference_mode()
def test_tiny_logits_equal_transformers_prefill_and_decode(tmp_path, arch, overrides):
    """fp32, tiny random configs: a prefill under a mask (9 tokens) or causal without one (CAUSAL_MIN_TOKENS) +
    cached decode steps match HF's full forward to 1e-5."""
    hf = make_tiny_hf(arch, tmp_path, **overrides)
    ours = load_model(tmp_path, CPU32, with_tokenizer=False).model
    for n_prefill in (9, CAUSAL_MIN_TOKENS):
        seqs = torch.randint(3, hf.config.vocab_size, (3, n_prefill + 7), generator=torch.Generator().manual_seed(1))
        expected = hf(seqs).logits
        got = incremental_logits(ours, seqs, n_prefill=n_prefill)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_cache_rollback_by_length_equals_fresh_forward(tmp_path):
    """Rows at different lengths append, roll back by setting their length, and append other tokens:
    the logits equal a fresh forward of the sequences each row now holds."""
    make_tiny_hf("llama", tmp_path)
    model = load_model(tmp_path, CPU32, with_tokenizer=False).model
    g = torch.Generator().manual_seed(0)
    seqs = torch.randint(3, 96, (2, 20), generator=g)
    cache = model.new_cache(2, 32)
    model(seqs[:, :12], torch.arange(12).expand(2, 12), cache)
    cache.lens[:] = torch.tensor([12, 10])  # ragged: row 1 holds only its first 10 tokens
    model(seqs[:, 12:17], cache.next_positions(5), cache)  # row 0 gets 12..16, row 1 gets 12..16 at 10..14
    cache.lens += 5
    cache.lens[:] = torch.tensor([14, 11])  # roll back: row 0 keeps 2 of the 5, row 1 keeps 1
    new = torch.randint(3, 96, (2, 4), generator=g)
    got = model.logits(model(new, cache.next_positions(4), cache))  # [2, 4, V]

    row0 = torch.cat([seqs[0, :14], new[0]])
    row1 = torch.cat([seqs[1, :10], seqs[1, 12:13], new[1]])
    for row, seq in ((0, row0), (1, row1)):
        fresh_cache = model.new_cache(1, 32)
        fresh = model.logits(model(seq[None], torch.arange(len(seq))[None], fresh_cache))
        torch.testing.assert_close(got[row], fresh[0, -4:], atol=1e-5, rtol=1e-5)


@pytest.mark.real_model
@pytest.mark.parametrize("prepack,tol", [(False, 2e-4), (True, 1e-3)], ids=["plain", "prepacked"])
@torch.inference_mode()
def test_real_smollm2_logits_equal_transformers(real_folder, real_hf, gsm8k_prompts, prepack, tol):
    """Bundled SmolLM2-135M, fp32: prefill of a chat prompt + 8 cached decode steps match HF with the same
    argmax everywhere, to 2e-4 absolute with plain F.linear and 1e-3 with oneDNN-prepacked weights (logits
    span about +-30: both are float summation order over 30 layers, ~1e-5 relative)."""
    runtime = RuntimeConfig(device="cpu", dtype="float32", threads=1, cpu_prepack=prepack)
    model = load_model(real_folder, runtime, with_tokenizer=False).model
    prompt = torch.tensor(gsm8k_prompts[0])
    seqs = real_hf.generate(prompt[None], max_new_tokens=8, do_sample=False)
    expected = real_hf(seqs).logits
    got = incremental_logits(model, seqs, n_prefill=len(prompt))
    assert (got - expected).abs().max() < tol
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_both_attention_paths_compute_sdpa_with_gqa():
    """Each of `attend`'s paths (SDPA over query heads grouped by their key/value head, SDPA with enable_gqa for a
    single row, the bf16-on-CPU explicit-matmul path) computes what SDPA with enable_gqa computes (fp32, a ragged
    causal mask and several query tokens per row)."""
    from flexdraft.models.attention import attend, grouped_bias, grouped_mask

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, h, t, 16, generator=g) for h, t in ((6, 5), (2, 40), (2, 40)))
    pos = torch.tensor([[30], [10], [35]]) + torch.arange(5)  # [B, T]
    mask = (torch.arange(40) <= pos[..., None])[:, None]  # [B, 1, T, S]
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    for rows in (slice(0, 3), slice(1, 2)):  # several rows, and one (which takes enable_gqa itself)
        for grouped in (grouped_mask(mask[rows], group=3), grouped_bias(mask[rows], group=3)):
            got = attend(q[rows], k[rows], v[rows], grouped)
            torch.testing.assert_close(got, expected[rows], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention", ["math", "sdpa", "auto"])
@torch.inference_mode()
def test_bf16_runtime_tracks_fp32(tmp_path, attention):
    """bf16 on CPU stays close to fp32 with either attention kernel (and with the one `auto` measures faster):
    same argmax on >= 90% of positions."""
    from flexdraft.models.attention import cpu_attention_kernel

    make_tiny_hf("qwen3", tmp_path)
    ref = load_model(tmp_path, CPU32, with_tokenizer=False).model
    bf16 = load_model(tmp_path, RuntimeConfig(device="cpu", dtype="bfloat16", cpu_attention=attention),
                      with_tokenizer=False).model
    kernel = cpu_attention_kernel(bf16.args, torch.bfloat16) if attention == "auto" else attention
    assert bf16.math_attention == (kernel == "math") and not ref.math_attention
    seqs = torch.randint(3, 96, (2, 24), generator=torch.Generator().manual_seed(2))
    a, b = incremental_logits(ref, seqs, 16), incremental_logits(bf16, seqs, 16).float()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9
    assert (a - b).abs().max() < 0.1 * a.abs().max()


@pytest.mark.parametrize("prepack", [False, True], ids=["plain", "prepacked"])
def test_fused_projections_keep_the_state_and_share_its_memory(tmp_path, prepack):
    """to_runtime's fused q/k/v and gate/up GEMMs (with attention biases): the state_dict has the names and shapes
    of a model that was never fused (so weight fingerprints do not change), the originals' weights are views of
    the fused ones (no memory added), and a forward equals that never-fused model's."""
    from flexdraft.models.transformer import Transformer

    make_tiny_hf("llama", tmp_path, attention_bias=True)
    runtime = RuntimeConfig(device="cpu", dtype="float32", threads=1, cpu_prepack=prepack)
    model = load_model(tmp_path, runtime, with_tokenizer=False).model
    never_fused = Transformer(model.args)
    shapes = lambda m: {k: tuple(v.shape) for k, v in m.state_dict().items()}
    assert shapes(model) == shapes(never_fused)
    never_fused.load_state_dict(model.state_dict())
    assert model.fingerprint == never_fused.fingerprint
    attn = model.layers[0].self_attn
    fused = attn.qkv.linear
    assert attn.k_proj.weight.untyped_storage().data_ptr() == fused.weight.untyped_storage().data_ptr()
    assert attn.v_proj.bias.untyped_storage().data_ptr() == fused.bias.untyped_storage().data_ptr()
    assert (fused.packed is not None) == prepack and attn.q_proj.packed is None
    seqs = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        torch.testing.assert_close(incremental_logits(model, seqs, 5), incremental_logits(never_fused, seqs, 5),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch,name", [("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM"),
                                       ("qwen3", "Qwen3ForCausalLM")])
def test_a_conversion_without_architectures_gets_its_class_named(tmp_path, arch, name):
    """A converted folder's config.json names its `architectures` (what vLLM loads a folder by); one converted
    before that is given the name on its next use, and a named one is left as it is."""
    import json

    from flexdraft.models.config import tiny_hf_config
    from flexdraft.models.loading import name_architecture

    config = tmp_path / "config.json"
    config.write_text(json.dumps({**tiny_hf_config(arch), "architectures": None}))
    name_architecture(config)
    assert json.loads(config.read_text())["architectures"] == [name]
    config.write_text(json.dumps({**tiny_hf_config(arch), "architectures": ["Custom"]}))
    name_architecture(config)
    assert json.loads(config.read_text())["architectures"] == ["Custom"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_one_row_path_computes_the_linear(dtype):
    """Whichever way `one_row_path` picks on a CPU (packed as is, as two rows, F.linear, or our bf16 GEMV where the CPU
    has one), a single row's output is F.linear's up to summation order, and so are several rows' (always through the
    packed GEMM)."""
    from flexdraft.core.hardware import probe
    from flexdraft.models.linear import ONE_ROW_PATHS, Linear, one_row_path

    if not probe().can_prepack(dtype):
        pytest.skip(f"oneDNN cannot prepack {dtype} here")
    assert one_row_path(dtype) in ONE_ROW_PATHS
    torch.manual_seed(0)
    linear = Linear(64, 96, bias=True).to(dtype).requires_grad_(False)
    for x in (torch.randn(1, 1, 64).to(dtype), torch.randn(3, 2, 64).to(dtype)):
        want = torch.nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float())
        for path in ONE_ROW_PATHS:
            linear.pack(path)
            got = linear(x)
            assert got.shape == want.shape and got.dtype == dtype
            torch.testing.assert_close(got.float(), want, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2)
