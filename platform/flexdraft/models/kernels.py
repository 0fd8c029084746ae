"""The C++ CPU kernels in csrc/ (torch.ops.flexdraft.*), built once per machine and cached, and whether to use them:
the decode attention, the fused elementwise ops and, on CPUs with AVX512-BF16, the one-row bf16 GEMV.

Built with torch.utils.cpp_extension for the instruction set torch dispatches to here (`probe().cpu_isa`: AVX512 or
AVX2, with ATen's vector types at that level) into ~/.cache/flexdraft/kernels/<a hash of the source, torch's version
and that level>, so a cache shared between machines never hands one CPU another's build. `make` builds them at
set-up (`python -m flexdraft.models.kernels`); elsewhere the first attention on CPU does (~10 s, logged).
Where they cannot be built (no C++ compiler, another ISA) or FLEXDRAFT_CPU_KERNELS=0, the model runs its PyTorch
ops instead, with a one-line warning; CUDA tensors never reach them.
"""
from __future__ import annotations

import functools
import hashlib
import os
import time
from pathlib import Path

import torch

from flexdraft.core import logs
from flexdraft.core.hardware import cpuinfo, probe

CSRC = Path(__file__).parent / "csrc"
# ATen's vector types compile to the level named by CPU_CAPABILITY; these are the flags PyTorch builds its own at
_ISA_FLAGS = {
    "AVX512": ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl",
               "-mavx512dq", "-mfma"],
    "AVX2": ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"],
}
# decode_attention takes the query rows of a key/value head (H/Hkv x tokens) up to DECODE_MAX_ROWS, and a single
# sequence's up to SINGLE_MAX_ROWS (the kernel's limit); beyond, SDPA, whose CPU kernel runs the scores as tiled
# GEMMs (AMX in bf16): a 9-token verify of 16 rows (27 rows per head) took 1.10x the forward's time on the kernel,
# of 1 row 0.95x (benchmarks/2026-12-06-kernels)
DECODE_MAX_ROWS, SINGLE_MAX_ROWS = 16, 64


def cache_dir() -> Path:
    """Per machine, not per FLEXDRAFT_HOME (which jobs and tests vary): the user's cache, as torch's own extensions"""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flexdraft" / "kernels"


@functools.cache
def has_gemv_bf16(isa: str) -> bool:
    """gemv_bf16 needs AVX512-BF16's dot products (Intel from Cooper Lake, AMD from Zen 4)."""
    return isa == "AVX512" and "avx512_bf16" in cpuinfo("flags").split()


def build_plan(isa: str) -> tuple[list[Path], list[str]]:
    """The sources and compiler flags of this CPU's build."""
    sources, flags = [CSRC / "decode_attention.cpp", CSRC / "fused_ops.cpp"], list(_ISA_FLAGS[isa])
    if has_gemv_bf16(isa):
        sources.append(CSRC / "gemv_bf16.cpp")
        flags.append("-mavx512bf16")
    return sources, flags


def build_id(isa: str) -> str:
    sources, flags = build_plan(isa)
    h = hashlib.sha256()
    for src in sources:
        h.update(src.read_bytes())
    h.update(f"{torch.__version__} {isa} {' '.join(flags)}".encode())
    return h.hexdigest()[:12]


@functools.cache
def load() -> bool:
    """Build (once per machine) and load the kernels; False, with a warning, where this CPU or machine cannot."""
    log = logs.get("runtime")
    if os.environ.get("FLEXDRAFT_CPU_KERNELS", "1") == "0":
        return False
    isa = probe().cpu_isa
    if isa not in _ISA_FLAGS:
        log.warning("no C++ CPU kernels for %s (they need AVX512 or AVX2): attention runs on PyTorch's ops", isa)
        return False
    from torch.utils import cpp_extension  # imported here: it pulls in setuptools

    try:
        ident = build_id(isa)
    except OSError as e:  # an install without the sources
        log.warning("flexdraft's C++ CPU kernels could not be built (%s): attention runs on PyTorch's ops", e)
        return False
    folder = cache_dir() / ident
    folder.mkdir(parents=True, exist_ok=True)
    fresh = not any(folder.glob("*.so"))
    if fresh:
        log.info("building flexdraft's C++ CPU kernels for %s into %s (once per machine, ~10 s)", isa, folder)
    start = time.perf_counter()
    try:
        sources, flags = build_plan(isa)
        cpp_extension.load(name=f"flexdraft_cpu_{ident}", sources=[str(s) for s in sources],
                           build_directory=str(folder),
                           extra_cflags=["-O3", "-std=c++17", "-ffp-contract=off", "-fopenmp", *flags],
                           extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    except (RuntimeError, OSError, ImportError) as e:  # no compiler, no ninja, a failed build
        lines = str(e).strip().splitlines() or [type(e).__name__]
        reason = next((line.strip() for line in lines if "error" in line), lines[-1])[:300]
        log.warning("flexdraft's C++ CPU kernels could not be built (%s): attention runs on PyTorch's ops", reason)
        return False
    if fresh:
        log.info("built flexdraft's C++ CPU kernels in %.0f s", time.perf_counter() - start)
    return True


def use_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether `attend` takes decode_attention for q [B, H, T, D] over keys/values [B, Hkv, S, D]: inference on CPU,
    a few query rows per key/value head, a head_dim in whole vectors, and the kernels loaded (FLEXDRAFT_CPU_KERNELS=0
    turns them off)."""
    rows, D = q.shape[1] // keys.shape[1] * q.shape[2], q.shape[-1]
    return (q.device.type == "cpu" and rows <= (SINGLE_MAX_ROWS if q.shape[0] == 1 else DECODE_MAX_ROWS)
            and D % 16 == 0 and D <= 128  # whole vectors of 16 (AVX-512) or 8 (AVX2) floats, at most 16 of them
            and not (torch.is_grad_enabled() and (q.requires_grad or keys.requires_grad or values.requires_grad))
            and q.dtype != torch.float64 and load())


def fused(*tensors: torch.Tensor) -> bool:
    """Whether the model's elementwise work over these tensors runs on the fused C++ ops (`csrc/fused_ops.cpp`):
    inference on CPU in a model dtype, with the kernels loaded."""
    t = tensors[0]
    return (t.device.type == "cpu" and t.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and not (torch.is_grad_enabled() and any(x.requires_grad for x in tensors)) and load())


def gemv_available() -> bool:
    """Whether one bf16 row can go through a linear layer on gemv_bf16 (`Linear`'s one-row path "gemv").
    FLEXDRAFT_CPU_GEMV=0 leaves single rows on oneDNN, as several rows are: in bf16 the GEMV rounds a batch-1 AR
    step's sums differently from a verify's GEMM, so more rows leave AR's path at near-ties (fp32 never takes it)."""
    return os.environ.get("FLEXDRAFT_CPU_GEMV", "1") != "0" and has_gemv_bf16(probe().cpu_isa) and load()


def main() -> None:
    """`python -m flexdraft.models.kernels`: build the kernels now (what `make` runs at set-up)."""
    start = time.perf_counter()
    ok = load()
    print(f"flexdraft C++ CPU kernels: {'ready' if ok else 'not available (PyTorch ops are used)'} "
          f"({probe().cpu_isa}, {time.perf_counter() - start:.0f} s, {cache_dir()})")


if __name__ == "__main__":
    main()
