"""How a linear layer's GEMM runs at inference on this machine: `Linear` (nn.Linear with prepacked, tiled and
one-row paths, `Linear.path` choosing per call), `Fused` (several Linears that read one input, as one GEMM) and the
one-row timing that picks a single row's path.
"""
from __future__ import annotations

import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from flexdraft.models import kernels

ONE_ROW_PATHS = ("packed", "pair", "linear", "gemv")
STACK_PATHS = {"amx": 0, "packed": 1, "linear": 2, "gemv": 3, "pair": 4}  # `Linear.path` -> C++ decoder_stack's


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, one_row: str) -> torch.Tensor:
    """x [..., in] through a oneDNN-prepacked weight; a single row as `one_row` says (`one_row_path`; "gemv" is
    `Linear`'s to take, on the unpacked weight)."""
    if x.numel() == x.shape[-1] and one_row == "pair":  # two rows, then keep the first
        x2 = x.reshape(1, -1)
        y = torch.ops.mkldnn._linear_pointwise(torch.cat((x2, x2)), packed, bias, "none", [], "")
        return y[:1].view(*x.shape[:-1], -1)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


_ONE_ROW_TIMES: dict[tuple, dict[str, float]] = {}


def one_row_path(dtype: torch.dtype, with_kernels: bool = True) -> str:
    """How a single row (batch-1 decode) runs fastest through a prepacked weight on this CPU in `dtype`: "packed"
    (as it is), "pair" (as two rows, then keep the first), "linear" (plain F.linear on the unpacked weight) or, in
    bf16 on CPUs with AVX512-BF16, "gemv" (our C++ `gemv_bf16` on the unpacked weight, `kernels`).
    Timed once per process, dtype and thread count (best of 3 passes over 12 weights of a decoder's widest
    shape, 42-85 MB, so that weights stream from memory as in a forward; ~0.1 s): which wins differs by CPU (a
    one-row packed bf16 GEMM was pathologically slow on one AMX Xeon, while an AVX512-BF16 EPYC runs fp32 one-row
    decode 1.5x faster packed than through F.linear). with_kernels=False: the fastest of the PyTorch paths (where
    "gemv" won, what a row takes when the kernels are off)."""
    key = (dtype, torch.get_num_threads())
    if key not in _ONE_ROW_TIMES:
        weights = [torch.full((3072, 576), 0.01, dtype=dtype) for _ in range(12)]  # (values do not change speed)
        packs = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in weights]
        x = torch.ones(1, 576, dtype=dtype)
        runs = {"packed": lambda: [packed_linear(x, p, None, "packed") for p in packs],
                "pair": lambda: [packed_linear(x, p, None, "pair") for p in packs],
                "linear": lambda: [F.linear(x, w) for w in weights]}
        if dtype == torch.bfloat16 and kernels.gemv_available():
            runs["gemv"] = lambda: [torch.ops.flexdraft.gemv_bf16(x, w, None) for w in weights]
        best = {}
        with torch.inference_mode():
            for name, fn in runs.items():
                fn()
                times = []
                for _ in range(3):
                    t = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t)
                best[name] = min(times)
        _ONE_ROW_TIMES[key] = best
    best = {k: t for k, t in _ONE_ROW_TIMES[key].items() if with_kernels or k != "gemv"}
    return min(best, key=best.get)


class Linear(nn.Linear):
    """nn.Linear that, for CPU inference, can run on a oneDNN-prepacked copy of its weight.

    Prepacking (what inductor's freezing does) makes decode-sized GEMMs 1.5-2x faster, results equal to
    F.linear's up to summation order. A single row (batch-1 decode) goes the way `one_row_path` measured fastest
    on this CPU. Only for the dtypes the hardware probe says oneDNN can pack (`Transformer.to_runtime`).
    In bf16 on CPUs with AMX, up to AMX_MAX_ROWS rows (decode steps, small verifies; single rows too) run on
    AMX tiles instead (`kernels.amx_available`, C++ `amx_linear`): weights read once for all rows, and each
    row's result the same however many rows come with it, so a verify's rows equal an AR step's.
    Inference only: no gradient reaches `weight` through the packed copies (training leaves them None).
    """

    packed: torch.Tensor | None = None
    tiles: torch.Tensor | None = None  # the weight as amx_pack lays it out (bf16 on AMX CPUs), else None
    one_row: str = "packed"  # a single row's path (ONE_ROW_PATHS), where there are no tiles

    def pack(self, one_row: str = "packed") -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 16)  # 16: expected rows (hint)
        self.one_row = one_row
        if self.weight.dtype == torch.bfloat16 and self.in_features % 32 == 0 and kernels.amx_available():
            self.tiles = torch.ops.flexdraft.amx_pack(self.weight)

    def unpack(self) -> None:
        """Back to F.linear on `weight` (drops the packed copies)."""
        self.packed = self.tiles = None

    def path(self, x: torch.Tensor) -> str:
        """How x [..., in] goes through this layer: "amx" (the tiles), "linear" (F.linear on `weight`), "gemv"
        (a bf16 row, C++ `gemv_bf16`), or "packed" / "pair" (the oneDNN-packed copy; see `one_row_path`)."""
        rows = x.numel() // x.shape[-1]
        if self.tiles is not None and rows <= kernels.AMX_MAX_ROWS and x.is_contiguous() and kernels.fused(x):
            return "amx"
        if self.packed is None:
            return "linear"
        if rows != 1:
            return "packed"
        if self.one_row == "gemv":
            if x.dtype == torch.bfloat16 and x.is_contiguous() and kernels.fused(x) and kernels.gemv_available():
                return "gemv"
            return one_row_path(x.dtype, with_kernels=False)  # the kernels off: the fastest other path
        return self.one_row

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        path = self.path(x)
        if path == "amx":
            return torch.ops.flexdraft.amx_linear(x, self.tiles, self.bias, self.out_features)
        if path == "gemv":
            return torch.ops.flexdraft.gemv_bf16(x, self.weight, self.bias)
        if path == "linear":
            return F.linear(x, self.weight, self.bias)
        return packed_linear(x, self.packed, self.bias, path)

    @staticmethod
    def concat(linears: list[Linear], pack: str | None) -> Linear:
        """One Linear whose outputs are the given ones' side by side (same input width): a frozen copy, prepacked
        unless pack is None (else: a single row's path, `one_row_path`)."""
        w = torch.cat([m.weight.detach() for m in linears])
        out = Linear(w.shape[1], w.shape[0], bias=linears[0].bias is not None).to(device=w.device, dtype=w.dtype)
        out.weight.data = w
        if out.bias is not None:
            out.bias.data = torch.cat([m.bias.detach() for m in linears])
        # frozen: a copy's gradient reaches no original, and a trainable one makes autograd record (and pay for)
        # weight gradients of the target's fused projections in every block layer of attention tuning
        out.requires_grad_(False)
        if pack is not None:
            out.pack(pack)
        return out


class Fused:
    """Inference only: Linears that read the same input, run as one GEMM; `fused(x)` -> their outputs.

    A SmolLM2 forward makes 211 GEMM calls, each with a fixed cost; with q/k/v and gate/up fused it makes 121.
    Measured (bf16, oneDNN, 2 threads, forward time fused / unfused, median of 25 paired runs): batch 1 at 1
    and 9 tokens 0.93, at 17 tokens 1.00; batch 16 at 1 and 3 tokens 0.95 and 0.97. At batch 1 the outputs
    are bitwise those of the separate GEMMs; at 16 rows the wider GEMM may round differently in bf16. The
    originals' weights become views of the fused weight (no memory is added; only the fused one is prepacked).
    Not an nn.Module, so not in any state_dict; `Transformer.to_runtime` builds it after the model's last move,
    and a later `.to()` would leave it stale."""

    def __init__(self, linears: list[Linear], pack: str | None):
        self.linear = Linear.concat(linears, pack)
        self.sizes = [m.out_features for m in linears]
        start = 0
        for m, n in zip(linears, self.sizes):
            m.weight.data = self.linear.weight.data[start:start + n]
            if m.bias is not None:
                m.bias.data = self.linear.bias.data[start:start + n]
            start += n

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.linear(x).split(self.sizes, dim=-1)
