"""A compact decoder for the Llama / Qwen2 / Qwen3 family, with a static batched KV cache.

Shapes: B = batch rows, T = new tokens per row in this call, S = attention span (cache slots visible),
H = query heads, Hkv = key/value heads, D = head_dim, d = model width.

Every call takes explicit positions `pos [B, T]` (row b's tokens sit at positions pos[b]) and an optional
explicit boolean mask `[B, T, S]` (True = may attend). New keys/values are written into the cache at slot =
position, so the default mask "key slot <= query position" is causal attention over each row's own prefix;
slots beyond a row's length hold stale entries that the mask never shows (this is what makes rollback free).
Module and parameter names follow `transformers` so HF checkpoints load by name.
"""
from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from flexdraft.core.hardware import probe
from flexdraft.models import kernels
from flexdraft.models.attention import (
    CAUSAL_MIN_TOKENS,
    SDPA_MIN_TOKENS,
    Packed,
    attend,
    cpu_attention_kernel,
    grouped_bias,
    grouped_mask,
)
from flexdraft.models.config import ModelArgs
from flexdraft.models.linear import STACK_PATHS, Fused, Linear, one_row_path


class KVCache:
    """Keys/values of every layer, `k[l]: [B, Hkv, max_len, D]`, and the number of tokens each row holds.

    Rolling a row back is `lens[row] = n`: nothing is copied; later writes overwrite the stale slots.
    """

    def __init__(self, args: ModelArgs, batch: int, max_len: int, dtype: torch.dtype, device):
        shape = (batch, args.n_kv_heads, max_len, args.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(args.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(args.n_layers)]
        self.lens = torch.zeros(batch, dtype=torch.long, device=device)
        self.max_len = max_len

    @property
    def batch(self) -> int:
        return self.lens.shape[0]

    def next_positions(self, T: int) -> torch.Tensor:
        """[B, T]: the positions of T tokens appended to every row at its own length."""
        return self.lens[:, None] + torch.arange(T, device=self.lens.device)

    def write(self, layer: int, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v `[B, Hkv, T, D]` at slots pos `[B, T]`."""
        if kernels.fused(k, v):
            torch.ops.flexdraft.write_kv(self.k[layer], self.v[layer], pos, k, v)
            return
        rows = torch.arange(pos.shape[0], device=pos.device)[:, None]
        # advanced indices (rows, pos) around a slice put their broadcast dims first: [B, T, Hkv, D]
        self.k[layer][rows, :, pos] = k.transpose(1, 2)
        self.v[layer][rows, :, pos] = v.transpose(1, 2)

    def writer(self, layer: int, slots: torch.Tensor, span: int):
        """`DecoderLayer`'s kv for an ordinary forward: store the new k, v at `slots` [B, T], then attend over
        cache slots 0..span-1."""
        def kv(k: torch.Tensor, v: torch.Tensor):
            self.write(layer, slots, k, v)
            return self.k[layer][:, :, :span], self.v[layer][:, :, :span]
        return kv

    def packed_writer(self, layer: int, packed: Packed):
        """`DecoderLayer`'s kv for a packed prefill (`Transformer.prefill`): sequence i's keys/values in the row
        [1, Hkv, N, D] go to cache row i, slots 0.., and attention runs over the row's keys/values as they are."""
        def kv(k: torch.Tensor, v: torch.Tensor):
            for i, (s, e) in enumerate(packed.spans()):
                self.k[layer][i, :, : e - s].copy_(k[0, :, s:e])
                self.v[layer][i, :, : e - s].copy_(v[0, :, s:e])
            return k, v
        return kv

    def rows(self, start: int, end: int) -> KVCache:
        """A view of rows start..end-1: writes through it land in this cache."""
        view = KVCache.__new__(KVCache)
        view.k = [k[start:end] for k in self.k]
        view.v = [v[start:end] for v in self.v]
        view.lens = self.lens[start:end]
        view.max_len = self.max_len
        return view

    def copy_row(self, src: int, dst: int) -> None:
        """Row dst holds what row src holds (its cached tokens and length)."""
        n = int(self.lens[src])
        for kv in (*self.k, *self.v):
            kv[dst, :, :n] = kv[src, :, :n]
        self.lens[dst] = n

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Drop every row not in `rows` (e.g. finished sequences) so later steps stop paying for them."""
        self.k = [k.index_select(0, rows) for k in self.k]
        self.v = [v.index_select(0, rows) for v in self.v]
        self.lens = self.lens.index_select(0, rows)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalised in fp32 and rounded once to the model dtype (rms_norm's reduced-precision kernels compute in
        # fp32: bitwise the reference's x.float() ... .to(dtype), two copies fewer), then scaled in the model dtype
        if kernels.fused(x, self.weight) and x.is_contiguous():
            return torch.ops.flexdraft.rms_norm(x, self.weight, self.eps)
        return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)

    def residual(self, x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + r, this norm of it): a residual connection and the norm after it, as one op where it can."""
        if kernels.fused(x, r, self.weight) and x.is_contiguous() and r.is_contiguous():
            return torch.ops.flexdraft.add_rms_norm(x, r, self.weight, self.eps)
        x = x + r
        return x, self(x)


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """[D/2] fp32 inverse frequencies, with the config's scaling (default, linear or llama3)."""
    D = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
    scaling = args.rope_scaling
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]; cos [B, 1, T, D]; sin [B, 1, T, D] with its first half negated (`Transformer.rope`) ->
    the reference's x * cos + rotate_half(x) * sin, bitwise: rotate_half(x) = cat(-x2, x1) and
    roll(x) * [-sin, sin] = cat(x2, x1) * [-sin, sin] differ only in where the sign flip happens (exact)."""
    if kernels.fused(x) and x.stride(-1) == 1:
        return torch.ops.flexdraft.rope(x, cos, sin)
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        q_dim, kv_dim = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        self.q_proj = Linear(args.dim, q_dim, bias=args.qkv_bias)
        self.k_proj = Linear(args.dim, kv_dim, bias=args.qkv_bias)
        self.v_proj = Linear(args.dim, kv_dim, bias=args.qkv_bias)
        self.o_proj = Linear(q_dim, args.dim, bias=args.o_bias)
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
            self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.qkv: Fused | None = None  # inference: q, k, v in one GEMM (Transformer.to_runtime)

    def project(self, x, cos, sin):
        """x [B, T, d] -> q [B, H, T, D], k and v [B, Hkv, T, D], with rope (and q/k norm) applied."""
        if self.qkv is not None and self.q_norm is None:
            return self.fused_heads(self.qkv.linear(x), cos, sin)
        if self.qkv is not None:
            return self.heads(*self.qkv(x), cos, sin)
        return self.heads(self.q_proj(x), self.k_proj(x), self.v_proj(x), cos, sin)

    def fused_heads(self, qkv, cos, sin):
        """The fused projection's output [B, T, (H + 2 Hkv) * D] -> `project`'s result, rope over q's and k's heads
        at once (no per-head q/k norm)."""
        B, T, _ = qkv.shape
        H, Hkv = self.n_heads, self.n_kv_heads
        heads = qkv.view(B, T, H + 2 * Hkv, self.head_dim).transpose(1, 2)
        qk = apply_rope(heads[:, : H + Hkv], cos, sin)
        return qk[:, :H], qk[:, H:], heads[:, H + Hkv:]

    def heads(self, q, k, v, cos, sin):
        """The projections' outputs q [B, T, H*D], k and v [B, T, Hkv*D] -> `project`'s result."""
        B, T, _ = q.shape
        q = q.view(B, T, self.n_heads, self.head_dim)
        k = k.view(B, T, self.n_kv_heads, self.head_dim)
        v = v.view(B, T, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def output(self, y):
        """y [B, H, T, D] -> [B, T, d]."""
        B, H, T, D = y.shape
        return self.o_proj(y.transpose(1, 2).reshape(B, T, H * D))



class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = Linear(args.dim, args.intermediate_size, bias=args.mlp_bias)
        self.up_proj = Linear(args.dim, args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = Linear(args.intermediate_size, args.dim, bias=args.mlp_bias)
        self.gate_up: Fused | None = None  # inference: gate and up in one GEMM (Transformer.to_runtime)

    def forward(self, x):
        if self.gate_up is not None and kernels.fused(x):
            return self.down_proj(torch.ops.flexdraft.silu_mul(self.gate_up.linear(x)))
        gate, up = self.gate_up(x) if self.gate_up is not None else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(args.dim, args.rms_norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.dim, args.rms_norm_eps)
        self.mlp = MLP(args)

    def gemms(self) -> tuple[Linear, Linear, Linear, Linear]:
        """Inference, with q/k/v and gate/up fused: the Linears of q/k/v, o, gate/up and down, in the order the C++
        `decoder_stack` takes them."""
        return self.self_attn.qkv.linear, self.self_attn.o_proj, self.mlp.gate_up.linear, self.mlp.down_proj

    def forward(self, x, cos, sin, mask, kv, attn=None):
        """x [B, T, d] -> [B, T, d]: attention and MLP, each with its residual; the one layer body that the
        target's forward, the drafter's block pass and the engine's parallel pass all run.

        kv(k, v): stores this call's keys/values [B, Hkv, T, D] where they belong and returns the keys/values
        [B, Hkv, S, D] to attend over (`KVCache.writer` for an ordinary forward); mask [B, 1, H/Hkv*T, S] as
        `Transformer.attention_mask` gives it. attn: the projections, anything with `project(x, cos, sin)` and
        `output(y)` as `Attention` has them (default this layer's own; the drafter passes its tuned ones)."""
        attn = self.self_attn if attn is None else attn
        q, k, v = attn.project(self.input_layernorm(x), cos, sin)
        x, h = self.post_attention_layernorm.residual(x, attn.output(attend(q, *kv(k, v), mask)))
        return x + self.mlp(h)


@dataclass
class TunedLayers:
    """A forward in which, from layer `first` on, each layer reads its q/k/v and o through paired GEMMs (the target's
    outputs, then another set's: a drafter's `PairedAttention`) and keeps the target's half at the `clean` slots
    [B, T], the other's elsewhere; those layers attend under `mask`. paired[i] serves layer first + i: its `qkv` and
    `o` Linears, and `at(clean)`, the projections `DecoderLayer` takes. params: the C++ stack's, 8 per layer (weight,
    packed copy, tiles and bias of qkv, then of o)."""
    first: int
    paired: list
    clean: torch.Tensor
    mask: torch.Tensor
    params: list[torch.Tensor | None]

    def paths(self, x: torch.Tensor) -> list[int]:
        """How the paired q/k/v and o GEMMs run for x [B, T, d] (every layer's alike)."""
        return [STACK_PATHS[self.paired[0].qkv.path(x)], STACK_PATHS[self.paired[0].o.path(x)]]


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.rms_norm_eps)
        self.lm_head = Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.inv_freq = rope_inv_freq(args)  # [D/2] fp32; a plain attribute so dtype casts never touch it
        self.math_attention = False  # grouped_attention instead of SDPA (set by to_runtime)
        self.stack_params: list[torch.Tensor | None] | None = None  # decoder_stack's (set by to_runtime)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @functools.cached_property
    def fingerprint(self) -> str:
        """A short hash of the weights that does not depend on the dtype or device they were loaded in: a strided
        sample of every tensor, rounded to bf16 (fp32 and bf16 loads of one checkpoint agree). What drafters,
        policies and cost profiles are keyed by; computed once (a loaded target's weights never change)."""
        h = hashlib.sha256()
        for name, t in sorted(self.state_dict().items()):
            flat = t.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // 4096)].to("cpu", torch.bfloat16).view(torch.int16)
            h.update(f"{name}:{tuple(t.shape)}".encode())
            h.update(sample.numpy().tobytes())
        return h.hexdigest()[:16]

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def to_runtime(self, device, dtype, prepack: bool = False, attention: str = "auto") -> Transformer:
        """Move to device/dtype for inference (the model is frozen from here on); prepack: oneDNN weight
        prepacking on CPU where oneDNN can pack this dtype, a single row going the way `one_row_path` measures
        fastest (see Linear; elsewhere plain F.linear); q/k/v and
        gate/up are fused (see Fused); attention: the kernel for bf16/fp16 on CPU, sdpa, math
        (`grouped_attention`) or auto (`cpu_attention_kernel`)."""
        self.to(device=device, dtype=dtype)
        on_cpu = torch.device(device).type == "cpu"
        pack = one_row_path(dtype) if prepack and on_cpu and probe().can_prepack(dtype) else None
        fused: set[Linear] = set()  # run only through their Fused: never packed themselves
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv, gate_up = [attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]
            attn.qkv, mlp.gate_up = Fused(qkv, pack), Fused(gate_up, pack)
            fused.update(qkv + gate_up)
        for m in self.modules():
            if isinstance(m, Linear):
                m.unpack()
                if pack is not None and m not in fused:
                    m.pack(pack)
        if on_cpu and dtype != torch.float32:
            kernel = cpu_attention_kernel(self.args, dtype) if attention == "auto" else attention
            self.math_attention = kernel == "math"
        else:
            self.math_attention = False
        self.inv_freq = rope_inv_freq(self.args).to(device)  # stays fp32 (and leaves the meta device)
        self.stack_params = self.decoder_stack_params()
        return self

    def decoder_stack_params(self) -> list[torch.Tensor | None] | None:
        """The C++ `decoder_stack`'s params, 18 per layer (the two norms' weights; weight, packed copy, tiles and bias
        of the fused q/k/v, o, the fused gate/up and down), where every layer has its GEMMs fused and prepacked
        alike and no per-head q/k norm; else, or with FLEXDRAFT_CPU_STACK=0, None (the layers run in Python)."""
        if not kernels.stack_wanted():
            return None
        params, kinds = [], set()
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if attn.qkv is None or mlp.gate_up is None or attn.q_norm is not None:
                return None
            linears = layer.gemms()
            kinds.add(tuple((m.packed is None, m.tiles is None, m.one_row) for m in linears))
            params += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            params += [t for m in linears for t in (m.weight, m.packed, m.tiles, m.bias)]
        return params if len(kinds) == 1 and self.layers[0].self_attn.o_proj.packed is not None else None

    def stack_paths(self, x: torch.Tensor) -> list[int]:
        """How the stack's four GEMMs run for x [B, T, d] (`Linear.path`, as decoder_stack numbers them); every
        layer's are alike (`decoder_stack_params`)."""
        return [STACK_PATHS[m.path(x)] for m in self.layers[0].gemms()]

    def attention_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """bool [B, 1, T, S] (True = visible) -> what this model's attention takes (`attend`): its rows grouped by
        key/value head, as a mask (`grouped_mask`) or, on the bf16-on-CPU math path, an additive bias
        (`grouped_bias`)."""
        group = self.args.n_heads // self.args.n_kv_heads
        return grouped_bias(mask, group) if self.math_attention else grouped_mask(mask, group)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache(self.args, batch, max_len, self.dtype, self.device)

    def rope(self, pos: torch.Tensor, dtype: torch.dtype):
        """cos, sin [B, 1, T, D] for positions [B, T] (computed in fp32, then cast), sin with its first half
        negated (what `apply_rope` takes)."""
        freqs = pos[..., None].float() * self.inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        sin = emb.sin()
        sin[..., : freqs.shape[-1]].neg_()
        return emb.cos().to(dtype), sin.to(dtype)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, cache: KVCache,
                mask: torch.Tensor | None = None, span: int | None = None,
                slots: torch.Tensor | None = None, sdpa: bool = False) -> torch.Tensor:
        """tokens, pos [B, T] -> final-normed hidden states [B, T, d]; writes K/V at cache slots `slots`
        [B, T] (default: pos; a token tree puts siblings at one position in different slots).

        span: cache slots attended to (default: up to the largest position). mask [B, T, S]: True = visible;
        default: slot <= the query's position (causal over the row's own prefix; for a prefill of CAUSAL_MIN_TOKENS
        or more, SDPA's causal kernel without a mask). sdpa: this call on SDPA even where the model takes the math
        path (`math_attention`); a call of SDPA_MIN_TOKENS or more per row always is.
        """
        if span is None:
            span = int(pos.max()) + 1
        T = tokens.shape[1]
        # a prefill (positions 0..T-1 at slots 0..T-1, nothing else attended): `attend`'s causal SDPA, no mask
        causal = (mask is None and slots is None and span == T >= CAUSAL_MIN_TOKENS
                  and bool((pos == torch.arange(T, device=pos.device)).all()))
        if not causal:
            if mask is None:
                mask = torch.arange(span, device=pos.device) <= pos[..., None]  # [B, T, S]
            mask = mask[:, None]  # [B, 1, T, S]: the same for every head
            sdpa = sdpa or T >= SDPA_MIN_TOKENS  # a long prefill: SDPA's tiles, not T x S fp32 scores
            # once for all layers
            mask = grouped_mask(mask, self.args.n_heads // self.args.n_kv_heads) if sdpa else self.attention_mask(mask)
        x = self.embed_tokens(tokens)
        cos, sin = self.rope(pos, x.dtype)
        return self.norm(self.run_layers(x, cos, sin, mask, pos if slots is None else slots, span, cache))

    def run_layers(self, x: torch.Tensor, cos, sin, mask, slots: torch.Tensor, span: int, cache: KVCache,
                   start: int = 0, end: int | None = None, tuned: TunedLayers | None = None) -> torch.Tensor:
        """x [B, T, d] through layers start..end-1 (default: to the last), each writing its keys/values into the cache
        at `slots` [B, T] and attending over its first `span` slots under `mask` (as `attention_mask` gives it; None:
        causal, a prefill); with `tuned`, its layers project through their paired GEMMs. As one C++ call where every
        op of the body has a kernel (`kernels.use_decoder_stack`: a decode step, a small verify or drafter pass, no
        interpreter per op), else the Python layers: the same ops either way."""
        end = self.args.n_layers if end is None else end
        a = self.args
        if (self.stack_params is not None and mask is not None
                and kernels.use_decoder_stack(x, a.n_heads, a.n_kv_heads, a.head_dim)):
            extra = ((-1, None, None, [], []) if tuned is None
                     else (tuned.first - start, tuned.mask, tuned.clean, tuned.params, tuned.paths(x)))
            per_layer = len(self.stack_params) // a.n_layers
            return torch.ops.flexdraft.decoder_stack(
                x, cos, sin, mask, slots, span, cache.k[start:end], cache.v[start:end],
                self.stack_params[per_layer * start:per_layer * end], self.stack_paths(x), a.rms_norm_eps,
                a.n_heads, a.n_kv_heads, a.head_dim, *extra)
        for i in range(start, end):
            paired = tuned is not None and i >= tuned.first
            attn = tuned.paired[i - tuned.first].at(tuned.clean) if paired else None
            x = self.layers[i](x, cos, sin, tuned.mask if paired else mask, cache.writer(i, slots, span), attn)
        return x

    def prefill(self, prompts: list[list[int]], cache: KVCache) -> torch.Tensor:
        """Prompts into cache rows 0..len(prompts)-1 (slots 0..len-1, lengths set) in one forward over them packed
        side by side in a row (`Packed`): the GEMMs take every prompt's tokens at once, and each prompt attends over
        its own -> the last prompt token's final-normed hidden state per row [b, d]."""
        dev, lens = self.device, [len(p) for p in prompts]
        packed = Packed.of(lens)
        tokens = torch.tensor([t for p in prompts for t in p], device=dev)[None]  # [1, N]
        pos = torch.cat([torch.arange(n, device=dev) for n in lens])[None]  # [1, N]: each prompt's own positions
        x = self.embed_tokens(tokens)
        cos, sin = self.rope(pos, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, packed, cache.packed_writer(i, packed))
        cache.lens[: len(lens)] = torch.tensor(lens, device=dev)
        last = torch.tensor(packed.starts[1:], device=dev) - 1
        return self.norm(x[0, last])

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., d] -> [..., V], as one 2-D GEMM: a strided h of 3+ dims (e.g. draft slots 1..B of blocks)
        would make matmul broadcast the LM head's weight into a batched GEMM, copying it per batch entry"""
        return self.lm_head(h.reshape(-1, h.shape[-1])).view(*h.shape[:-1], -1)
