"""Attention for the decoder: a C++ kernel for a few query rows on CPU (`kernels`), SDPA, or explicit GQA matmuls
for bf16/fp16 on CPUs where they are faster, each over the query heads grouped by the key/value head they share;
which of the last two a CPU runs faster is timed once per process.

Shapes as in `transformer`: q [B, H, T, D], keys/values [B, Hkv, S, D], masks [B, 1, H/Hkv*T, S].
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flexdraft.models import kernels
from flexdraft.models.config import ModelArgs


def grouped_mask(mask: torch.Tensor, group: int) -> torch.Tensor:
    """Boolean mask [B, 1, T, S] -> [B, 1, group*T, S]: the rows of the `group` query heads that share a key/value
    head, one after another (what `attend` and `grouped_attention` take)."""
    B, _, T, S = mask.shape
    return mask[:, :, None].expand(B, 1, group, T, S).reshape(B, 1, group * T, S)


def grouped_bias(mask: torch.Tensor, group: int) -> torch.Tensor:
    """Boolean mask [B, 1, T, S] -> additive fp32 bias [B, 1, group*T, S] in `grouped_attention`'s row order."""
    mask = grouped_mask(mask, group)
    return torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, float("-inf"))


def grouped_attention(q, k, v, bias):
    """Explicit-matmul GQA attention, q [B, H, T, D], k/v [B, Hkv, S, D], bias from `grouped_bias` -> [B, H, T, D].

    For bf16/fp16 on CPUs where SDPA's CPU kernel is slow for a few query tokens (up to 10x on some AVX512-BF16
    CPUs); `cpu_attention_kernel` decides.
    Query head h uses key/value head h // group, as in SDPA's enable_gqa; the softmax runs in fp32.
    """
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    # (k @ q^T)^T, not q @ k^T: a cache slice is a plain row-major matrix per (row, head), while its
    # transpose makes the bf16 batched GEMM copy it first (0.17 ms against 0.29 ms per layer, batch 16)
    qt = q.reshape(B, Hkv, H // Hkv * T, D).transpose(-1, -2)
    scores = (k @ qt).transpose(-1, -2)  # [B, Hkv, g*T, S]
    probs = torch.add(bias, scores.float(), alpha=D ** -0.5).softmax(-1).to(q.dtype)  # scaled in fp32
    return (probs @ v).view(B, H, T, D)


_KERNEL_CHOICE: dict[tuple, str] = {}
# From this many tokens per row a forward attends with SDPA even where the model takes the math path: the math
# path's fp32 scores grow as T x S (a 444-token prefill of 4 rows took 2.5 s against SDPA's 1.8 s in bf16 on an
# AVX512-BF16 EPYC, while at 56-121 tokens the two were within noise).
SDPA_MIN_TOKENS = 256
# A forward of this many tokens per row from position 0 over nothing cached (a prefill) attends causally: SDPA's
# causal kernel skips the blocks above the diagonal and builds no mask (bf16, 2-6 rows of 120-444 tokens: 0.62-0.64x
# the time of the same attention under a bool mask, outputs equal). Below, decode-sized kernels take it.
CAUSAL_MIN_TOKENS = 32


@dataclass(frozen=True)
class Packed:
    """Sequences side by side in one row (a packed prefill): sequence i is tokens starts[i]..starts[i+1]-1 of the
    row, at its own positions 0.., and attends causally over its own tokens only. What `attend` takes in place of a
    mask for such a row; the GEMMs around it see every sequence's tokens at once."""
    starts: tuple[int, ...]  # len(sequences) + 1 offsets, starts[0] = 0

    @staticmethod
    def of(lens: list[int]) -> Packed:
        return Packed((0, *itertools.accumulate(lens)))

    def spans(self) -> list[tuple[int, int]]:
        return list(zip(self.starts[:-1], self.starts[1:]))


def attend_packed(q, keys, values, packed: Packed):
    """q [1, H, N, D], keys/values [1, Hkv, N, D] of sequences packed in one row -> [1, H, N, D] (laid out as
    [1, N, H, D], so the output projection's input is a view): each sequence's causal attention over its own keys."""
    _, H, N, D = q.shape
    out = q.new_empty(1, N, H, D)
    for s, e in packed.spans():
        y = F.scaled_dot_product_attention(q[:, :, s:e], keys[:, :, s:e], values[:, :, s:e], is_causal=True,
                                           enable_gqa=True)
        out[:, s:e] = y.transpose(1, 2)
    return out.transpose(1, 2)


def cpu_attention_kernel(args: ModelArgs, dtype: torch.dtype) -> str:
    """"sdpa" or "math": whichever attention runs this model's heads faster on this CPU in `dtype`, timed once per
    process and shape (best of 5, ~30 ms in all) over a decode step at 16 rows, a 9-token verify at 1 row
    (256 cached keys each) and a 64-token prefill at 4 rows. Timed, not assumed: which is faster differs by CPU
    (measurements: docs/runtime.md)."""
    H, Hkv, D = args.n_heads, args.n_kv_heads, args.head_dim
    key = (H, Hkv, D, dtype, torch.get_num_threads())
    if key not in _KERNEL_CHOICE:
        total = {"sdpa": 0.0, "math": 0.0}
        gen = torch.Generator().manual_seed(0)
        for B, T, S in ((16, 1, 256), (1, 9, 256), (4, 64, 64)):
            q = torch.randn(B, H, T, D, generator=gen).to(dtype)
            k, v = (torch.randn(B, Hkv, S, D, generator=gen).to(dtype) for _ in range(2))
            mask = (torch.arange(S) <= (S - T + torch.arange(T))[:, None]).expand(B, 1, T, S)
            bias, grouped = grouped_bias(mask, H // Hkv), grouped_mask(mask, H // Hkv)
            runs = {"sdpa": lambda: attend(q, k, v, grouped),  # noqa: B023
                    "math": lambda: grouped_attention(q, k, v, bias)}  # noqa: B023 (both run within this iteration)
            with torch.inference_mode():
                for name, fn in runs.items():
                    fn()
                    best = float("inf")
                    for _ in range(5):
                        t = time.perf_counter()
                        fn()
                        best = min(best, time.perf_counter() - t)
                    total[name] += best
        _KERNEL_CHOICE[key] = min(total, key=total.get)
    return _KERNEL_CHOICE[key]


def attend(q, keys, values, mask):
    """q [B, H, T, D], keys/values [B, Hkv, S, D]; mask: bool from `grouped_mask` (SDPA) or an additive bias from
    `grouped_bias` (the bf16-on-CPU path), both [B, 1, H/Hkv*T, S], None: causal over S = T keys, the query
    tokens' own (a prefill, `CAUSAL_MIN_TOKENS`), or `Packed`: sequences side by side in one row, each causal over
    its own keys (a packed prefill) -> [B, H, T, D].

    Decode steps and short verifies on CPU run the C++ kernel `decode_attention` (`kernels.use_decode_attention`
    says when): SDPA's CPU kernel tiles for long query blocks, and with a few query rows per head its overhead
    dominates (a bf16 decode step of 16 rows over 120-500 cached tokens: 0.89-0.94x the forward's time on the
    kernel).

    Over several rows SDPA sees the query heads that share a key/value head as that head's rows, rather than
    enable_gqa's heads, whose CPU kernel reads each key/value head once per query head (a bf16 9-token verify at 16
    rows: 0.90-0.97x the forward's time). A single row keeps enable_gqa: grouped, its Hkv heads leave SDPA too few
    tasks for its threads (a 9-token verify at 1 row: 1.02-1.05x the time grouped)."""
    if mask is None:
        return F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=True)
    if isinstance(mask, Packed):
        return attend_packed(q, keys, values, mask)
    if kernels.use_decode_attention(q, keys, values):
        return torch.ops.flexdraft.decode_attention(q, keys, values, mask)
    if mask.dtype != torch.bool:
        return grouped_attention(q, keys, values, mask)
    B, H, T, D = q.shape
    Hkv = keys.shape[1]
    if B == 1 and Hkv < H:  # the grouped mask's rows are the same for each of a group's heads: take the first's
        heads_mask = mask.view(B, 1, H // Hkv, T, -1)[:, :, 0]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=heads_mask, enable_gqa=True)
    out = F.scaled_dot_product_attention(q.reshape(B, Hkv, H // Hkv * T, D), keys, values, attn_mask=mask)
    return out.view(B, H, T, D)
