"""The C++ CPU kernels (`kernels`): the decode attention computes what SDPA computes, for every mask and layout the
model hands it, in fp32 and with a single rounding in bf16, and is taken exactly where `use_decode_attention` says;
the fused elementwise ops compute what the PyTorch ops they replace compute, bitwise in bf16, and the model with
them what it computes without; where they cannot be built or are turned off, the model runs on PyTorch's ops."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import REPO, make_tiny_hf
from flexdraft.core.config import RuntimeConfig
from flexdraft.core.hardware import probe
from flexdraft.models import kernels, transformer
from flexdraft.models.attention import attend, grouped_bias, grouped_mask
from flexdraft.models.linear import Linear
from flexdraft.models.loading import load_model
from flexdraft.models.transformer import apply_rope

# the kernels need a C++ compiler and AVX2 or AVX-512; on such a machine a failed build fails this file's first test
BUILDABLE = bool(shutil.which(os.environ.get("CXX", "c++"))) and probe().cpu_isa in ("AVX512", "AVX2")
pytestmark = pytest.mark.skipif(not BUILDABLE, reason="no C++ compiler, or a CPU without AVX2")


def test_the_kernels_build_here():
    assert kernels.load(), "the C++ kernels did not build: see the [runtime] warning above"


@pytest.fixture(autouse=True)
def built():
    """Each test runs with the kernels loaded (alone, too: `pytest -k`)."""
    kernels.load()


def case(B, H, Hkv, T, S, D, dtype, seed=0):
    """q [B, H, T, D], keys/values as views of a longer cache, and a ragged causal mask with holes [B, 1, T, S]."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g).to(dtype)
    cache_k, cache_v = (torch.randn(B, Hkv, S + 13, D, generator=g).to(dtype) for _ in range(2))
    pos = torch.randint(T - 1, S - T + 1, (B, 1), generator=g) + torch.arange(T)  # [B, T]
    mask = torch.arange(S) <= pos[..., None]  # [B, T, S]
    mask &= torch.rand(B, T, S, generator=g) > 0.2  # a token tree's holes
    mask[..., 0] = True
    return q, cache_k[:, :, :S], cache_v[:, :, :S], mask[:, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("B,H,Hkv,T,S,D", [(16, 9, 3, 1, 70, 64), (3, 4, 2, 5, 33, 16), (1, 9, 3, 9, 120, 64),
                                           (2, 8, 8, 2, 17, 32), (1, 2, 1, 32, 70, 128), (4, 9, 3, 9, 60, 64)])
def test_decode_attention_is_sdpa_rounded_once(dtype, B, H, Hkv, T, S, D):
    """Bool mask and additive bias alike: fp32 equals SDPA to 1e-5; bf16 is SDPA over the same bf16 inputs,
    computed in fp32, rounded once (within half a bf16 step: 2^-8 of the value). The output is laid out [B, T, H, D],
    so the output projection's [B, T, H*D] is a view."""
    q, k, v, mask = case(B, H, Hkv, T, S, D, dtype)
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                              enable_gqa=True)
    for form in (grouped_mask(mask, H // Hkv), grouped_bias(mask, H // Hkv)):
        got = torch.ops.flexdraft.decode_attention(q, k, v, form)
        assert got.shape == (B, H, T, D) and got.dtype == dtype and got.transpose(1, 2).is_contiguous()
        if dtype == torch.float32:
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        else:
            assert ((got.float() - expected).abs() <= expected.abs() * 2 ** -8 + 1e-5).all()


def test_a_row_that_sees_no_key_attends_to_nothing():
    q, k, v, mask = case(2, 4, 2, 1, 20, 16, torch.float32)
    mask[1] = False
    got = torch.ops.flexdraft.decode_attention(q, k, v, grouped_mask(mask, 2))
    assert got[1].eq(0).all() and got[0].abs().sum() > 0


def test_attend_takes_the_kernel_for_few_query_rows_only():
    """Decode steps and verifies of up to 64 query rows per key/value head (H/Hkv x tokens) take the kernel, at any
    batch size; more rows, autograd and head dims other than 16, 32, 64 and 128 take PyTorch's ops."""
    def takes(B, T, D=64, grad=False):
        q, k, v, _ = case(B, 9, 3, T, 80, D, torch.float32)
        return kernels.use_decode_attention(q.requires_grad_(grad), k, v)

    assert takes(16, 1) and takes(16, 9) and takes(1, 21) and takes(3, 21) and takes(16, 21)
    assert not takes(1, 22) and not takes(16, 22) and not takes(1, 1, D=72) and not takes(1, 1, D=96)
    assert not takes(1, 1, grad=True) and takes(1, 1, D=32) and takes(1, 1, D=128)
    q, k, v, mask = case(4, 9, 3, 1, 40, 64, torch.float32)
    q.requires_grad_(True)
    out = attend(q, k, v, grouped_mask(mask, 3))
    out.sum().backward()  # the autograd path: SDPA, whose gradient reaches q
    assert q.grad is not None and q.grad.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("d,D", [(576, 64), (40, 12)], ids=["smollm2", "ragged"])
@torch.inference_mode()
def test_fused_ops_compute_what_the_pytorch_ops_compute(dtype, d, D):
    """Each op equals the PyTorch ops it replaces, on widths in whole vectors and not: bitwise in bf16 (every
    intermediate rounded where PyTorch rounds it); in fp32 the norm's sum of squares, and SiLU's exp on a row's tail
    (scalar in PyTorch), may differ in the last bit."""
    g = torch.Generator().manual_seed(0)
    ops = torch.ops.flexdraft
    x, r = (3 * torch.randn(5, 2, d, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(d, generator=g).to(dtype)
    same = torch.equal if dtype == torch.bfloat16 else (lambda a, b: torch.allclose(a, b, rtol=1e-6, atol=1e-6))
    assert same(ops.rms_norm(x, w, 1e-6), w * F.rms_norm(x, (d,), eps=1e-6))
    h, y = ops.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(h, x + r) and same(y, w * F.rms_norm(x + r, (d,), eps=1e-6))
    gate_up = 3 * torch.randn(5, 2, 2 * d, generator=g).to(dtype)
    assert same(ops.silu_mul(gate_up), F.silu(gate_up[..., :d]) * gate_up[..., d:])
    heads = torch.randn(3, 2, 7, D, generator=g).to(dtype).view(3, 7, 2, D).transpose(1, 2)  # strided, as in a model
    cos, sin = (torch.randn(3, 1, 7, D, generator=g).to(dtype) for _ in range(2))
    assert torch.equal(ops.rope(heads, cos, sin), heads * cos + heads.roll(D // 2, -1) * sin)
    cache_k, cache_v = (torch.zeros(3, 2, 9, D, dtype=dtype) for _ in range(2))
    slots = torch.tensor([[4, 1], [0, 8], [7, 7]])  # a tree puts siblings in any slot; a repeat keeps the last
    k, v = heads[:, :, :2], heads[:, :, 5:]
    ops.write_kv(cache_k, cache_v, slots, k, v)
    rows = torch.arange(3)[:, None]
    expected_k, expected_v = torch.zeros_like(cache_k), torch.zeros_like(cache_v)
    expected_k[rows, :, slots], expected_v[rows, :, slots] = k.transpose(1, 2), v.transpose(1, 2)
    assert torch.equal(cache_k, expected_k) and torch.equal(cache_v, expected_v)
    with pytest.raises(RuntimeError, match="outside the cache's 9 slots"):
        ops.write_kv(cache_k, cache_v, slots + 5, k, v)


@pytest.mark.skipif(not kernels.has_gemv_bf16(probe().cpu_isa), reason="a CPU without AVX512-BF16")
def test_gemv_bf16_is_the_linear_rounded_once():
    """One bf16 row through a weight of any shape (outputs and inputs not in whole blocks, with and without bias):
    F.linear computed in fp32 over the same bf16 values, rounded once to bf16; several rows, each as it is alone."""
    g = torch.Generator().manual_seed(0)
    for n, k in ((37, 50), (576, 576), (96, 1536)):
        w, b = torch.randn(n, k, generator=g).bfloat16(), torch.randn(n, generator=g).bfloat16()
        x = torch.randn(1, 1, k, generator=g).bfloat16()
        for bias in (None, b):
            want = F.linear(x.float(), w.float(), None if bias is None else bias.float())
            got = torch.ops.flexdraft.gemv_bf16(x, w, bias)
            assert got.shape == (1, 1, n) and got.dtype == torch.bfloat16
            assert ((got.float() - want).abs() <= want.abs() * 2 ** -8 + 1e-3).all()  # + fp32 summation order
    rows = torch.randn(5, 96, generator=g).bfloat16()  # several rows: each computed as it is alone, bitwise
    w = torch.randn(40, 96, generator=g).bfloat16()
    alone = torch.cat([torch.ops.flexdraft.gemv_bf16(row[None], w, None) for row in rows])
    assert torch.equal(torch.ops.flexdraft.gemv_bf16(rows, w, None), alone)


@pytest.mark.skipif(not kernels.amx_available(), reason="a CPU without AMX-BF16")
def test_amx_linear_is_the_linear_rounded_once_whatever_the_row_count():
    """bf16 rows through AMX tiles (outputs not in whole blocks, with and without bias): F.linear in fp32 over the
    same values, rounded once; each row bitwise as it is alone, from 1 row to past a brgemm call's 32. A packed
    Linear takes the tiles up to AMX_MAX_ROWS rows and oneDNN beyond; an input width not in whole tiles (32) is
    never tiled, and amx_pack names the problem."""
    g = torch.Generator().manual_seed(0)
    for n, k in ((37, 64), (960, 576), (96, 1536)):
        w, b = torch.randn(n, k, generator=g).bfloat16(), torch.randn(n, generator=g).bfloat16()
        tiles = torch.ops.flexdraft.amx_pack(w)
        x = torch.randn(40, k, generator=g).bfloat16()
        for bias in (None, b):
            want = F.linear(x.float(), w.float(), None if bias is None else bias.float())
            got = torch.ops.flexdraft.amx_linear(x, tiles, bias, n)
            assert got.shape == (40, n) and got.dtype == torch.bfloat16
            assert ((got.float() - want).abs() <= want.abs() * 2 ** -8 + 1e-3).all()  # + fp32 summation order
            for rows in (1, 3, 9, 16, 17, 32, 33):
                assert torch.equal(torch.ops.flexdraft.amx_linear(x[:rows], tiles, bias, n), got[:rows])
    linear = Linear(576, 960).bfloat16()
    linear.pack()
    assert linear.tiles is not None
    with torch.inference_mode():
        x = torch.randn(2, kernels.AMX_MAX_ROWS - 4, 576, generator=g).bfloat16()
        few, many = linear(x[:1]), linear(x)  # up to AMX_MAX_ROWS rows: tiles; twice as many: oneDNN
    assert torch.equal(few, torch.ops.flexdraft.amx_linear(x[:1].contiguous(), linear.tiles, linear.bias, 960))
    assert not torch.equal(many[:1], few)  # oneDNN sums in another order: these rows round differently
    odd = Linear(560, 64).bfloat16()
    odd.pack()
    assert odd.tiles is None
    with pytest.raises(RuntimeError, match="K a multiple of 32"):
        torch.ops.flexdraft.amx_pack(odd.weight)


@pytest.mark.skipif(not kernels.amx_available(), reason="a CPU without AMX-BF16")
def test_a_bf16_verify_computes_what_one_token_steps_compute(tmp_path):
    """Batch 1 in bf16 with every kernel: a forward of 5 tokens gives, bitwise, the logits of 5 one-token forwards
    (GEMMs on AMX tiles, attention and elementwise ops each compute a row alone), so a verify accepts exactly
    where AR's own steps would have gone. At SmolLM2's widths, where oneDNN's few-row GEMMs round unlike its
    single-row path (without the tiles the two differ)."""
    make_tiny_hf("llama", tmp_path, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                 num_key_value_heads=3)
    model = load_model(tmp_path, RuntimeConfig(device="cpu", dtype="bfloat16", threads=1),
                       with_tokenizer=False).model
    seq = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        cache = model.new_cache(1, 32)
        model(seq[:, :7], torch.arange(7)[None], cache)
        cache.lens[:] = 7
        steps = []
        for t in range(7, 12):
            steps.append(model.logits(model(seq[:, t:t + 1], cache.next_positions(1), cache)))
            cache.lens += 1
        cache.lens[:] = 7
        verify = model.logits(model(seq[:, 7:], cache.next_positions(5), cache))
    assert torch.equal(verify, torch.cat(steps, dim=1))


@pytest.mark.parametrize("arch,form", [("llama", "bf16-amx"), ("qwen2", "bf16-amx"), ("llama", "bf16-onednn"),
                                       ("llama", "fp32"), ("llama", "fp32-pair"), ("qwen3", "fp32")])
def test_the_cpp_decoder_stack_computes_what_the_python_layers_compute(tmp_path, monkeypatch, arch, form):
    """At SmolLM2's widths (qwen2: with q/k/v biases), decode steps of ragged rows, a single row, a batch-1 verify
    and a verify of 8 rows x 9 tokens (72 rows: past amx_linear's 64, on oneDNN's packed copy) through
    `decoder_stack` give bitwise the logits and cache of the Python layers on the same kernels, with every GEMM path
    the stack has: AMX tiles (bf16), oneDNN's packed copy and the one-row GEMV (bf16 with the tiles off), packed with
    one row on F.linear or as a pair (fp32); a prefill (more query rows per head than decode attention takes) stays
    in Python. Qwen3's per-head q/k norm has no C++ body: its layers stay in Python."""
    if form == "bf16-amx" and not kernels.amx_available():
        pytest.skip("a CPU without AMX-BF16")
    if form == "bf16-onednn":
        monkeypatch.setattr(kernels, "AMX_MAX_ROWS", 0)
    # a single row's path is timed at load (`one_row_path`); fixed here to the ones this case is about
    one_row = {"fp32": "linear", "fp32-pair": "pair"}.get(form, "gemv" if kernels.gemv_available() else "packed")
    monkeypatch.setattr(transformer, "one_row_path", lambda dtype, with_kernels=True: one_row)
    make_tiny_hf(arch, tmp_path, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                 num_key_value_heads=3, head_dim=64)
    dtype = "float32" if form.startswith("fp32") else "bfloat16"
    model = load_model(tmp_path, RuntimeConfig(device="cpu", dtype=dtype, threads=1), with_tokenizer=False).model
    if arch == "qwen3":
        assert model.stack_params is None
        return
    assert model.stack_params is not None
    seqs = torch.randint(3, 96, (8, 49), generator=torch.Generator().manual_seed(3))

    @torch.inference_mode()
    def run(stack):
        model.stack_params = stack
        cache, out = model.new_cache(8, 64), []
        model(seqs[:, :30], torch.arange(30).expand(8, 30), cache)  # 90 query rows per head: Python
        cache.lens[:] = torch.tensor([30, 27, 29, 30, 28, 26, 30, 25])
        for t in range(30, 33):  # 8 rows of 1 token
            out.append(model.logits(model(seqs[:, t:t + 1], cache.next_positions(1), cache)))
            cache.lens += 1
        one = cache.rows(0, 1)  # row 0 alone: a step, then a verify of 6 tokens
        out.append(model.logits(model(seqs[:1, 33:34], one.next_positions(1), one)).expand(8, -1, -1))
        one.lens += 1
        out.append(model.logits(model(seqs[:1, 34:40], one.next_positions(6), one)).expand(8, -1, -1))
        one.lens += 6
        out.append(model.logits(model(seqs[:, 40:49], cache.next_positions(9), cache)))  # 8 x 9 tokens
        return torch.cat(out, dim=1), [k.clone() for k in cache.k]

    params = model.stack_params
    x = torch.zeros(8, 1, 576, dtype=model.dtype)
    with torch.inference_mode():
        wide, prefill = (torch.zeros(8, T, 576, dtype=model.dtype) for T in (9, 30))
        assert kernels.use_decoder_stack(x, 9, 3, 64) and kernels.use_decoder_stack(wide, 9, 3, 64)
        assert not kernels.use_decoder_stack(prefill, 9, 3, 64)
    (logits, keys), (want, want_keys) = run(params), run(None)
    assert torch.equal(logits, want) and all(torch.equal(a, b) for a, b in zip(keys, want_keys))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_model_computes_the_same_with_the_kernels_and_without(tmp_path, monkeypatch, dtype):
    """A tiny Llama's prefill and cached decode steps (ragged rows) through every kernel equal the same model on
    PyTorch's ops: fp32 to 1e-5; bf16, where only the attention's rounding differs, on >= 90% of argmaxes. Outside
    inference (autograd), the kernels stay out of the way: gradients reach the inputs."""
    make_tiny_hf("llama", tmp_path)
    model = load_model(tmp_path, RuntimeConfig(device="cpu", dtype=dtype, threads=1), with_tokenizer=False).model
    seqs = torch.randint(3, 96, (3, 14), generator=torch.Generator().manual_seed(3))

    @torch.inference_mode()
    def run():
        cache = model.new_cache(3, 32)
        out = [model.logits(model(seqs[:, :8], torch.arange(8).expand(3, 8), cache))]
        cache.lens[:] = torch.tensor([8, 6, 7])
        for t in range(8, 14):
            out.append(model.logits(model(seqs[:, t:t + 1], cache.next_positions(1), cache)))
            cache.lens += 1
        return torch.cat(out, dim=1).float()

    with_kernels = run()
    monkeypatch.setattr(kernels, "load", lambda: False)
    without = run()
    if dtype == "float32":
        torch.testing.assert_close(with_kernels, without, atol=1e-5, rtol=1e-5)
    else:
        assert (with_kernels.argmax(-1) == without.argmax(-1)).float().mean() >= 0.9
    monkeypatch.undo()
    x = torch.randn(2, 3, 16, requires_grad=True)
    apply_rope(x.view(2, 3, 1, 16), torch.ones(2, 1, 1, 16), torch.zeros(2, 1, 1, 16)).sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


SCRIPT = """
import json, torch, torch.nn.functional as F
from flexdraft.models import kernels
from flexdraft.models.attention import attend, grouped_mask
from flexdraft.core.hardware import probe
g = torch.Generator().manual_seed(0)
q, k, v = torch.randn(4, 9, 1, 64, generator=g), torch.randn(4, 3, 30, 64, generator=g), torch.randn(4, 3, 30, 64, generator=g)
mask = torch.ones(4, 1, 1, 30, dtype=torch.bool)
expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
got = attend(q, k, v, grouped_mask(mask, 3))
print(json.dumps({"loaded": kernels.load(), "isa": probe().cpu_isa, "diff": (got - expected).abs().max().item()}))
"""


@pytest.mark.parametrize("env,loaded", [({"ATEN_CPU_CAPABILITY": "avx2"}, True), ({"CXX": "/nonexistent/c++"}, False),
                                        ({"FLEXDRAFT_CPU_KERNELS": "0"}, False),
                                        ({"CXX": "/nonexistent/c++", "FLEXDRAFT_KERNELS_DIR": "BUILT"}, True)],
                         ids=["avx2", "no-compiler", "off", "built-no-compiler"])
def test_kernels_build_per_isa_or_fall_back(tmp_path, env, loaded):
    """In a fresh cache: an AVX2-only CPU (torch capped to AVX2) gets a build of its own that computes the same;
    without a compiler the build fails with one warning line, not a traceback, and attention runs on SDPA; so it does
    with FLEXDRAFT_CPU_KERNELS=0. A build already in FLEXDRAFT_KERNELS_DIR loads without a compiler (an image's)."""
    env = {k: str(kernels.cache_dir()) if v == "BUILT" else v for k, v in env.items()}
    base = {k: v for k, v in os.environ.items() if k != "FLEXDRAFT_KERNELS_DIR"}  # (a fresh cache unless named)
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, cwd=REPO,
                         env={**base, "XDG_CACHE_HOME": str(tmp_path), **env})
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.splitlines()[-1])
    assert result["loaded"] is loaded and result["diff"] < 1e-5
    if env.get("ATEN_CPU_CAPABILITY"):
        assert result["isa"] == "AVX2" and list(tmp_path.glob("flexdraft/kernels/*/*.so"))
    if "CXX" in env and not loaded:
        assert "could not be built" in run.stderr and "Traceback" not in run.stderr
