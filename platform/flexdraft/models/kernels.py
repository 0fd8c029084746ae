"""The C++ CPU kernels in csrc/ (torch.ops.flexdraft.*), built once per machine and cached, and whether to use them:
the decode attention, the fused elementwise ops, the decoder layers of a decode step as one call, and, on CPUs with
AVX512-BF16, the one-row bf16 GEMV and (where there is AMX) the few-row bf16 GEMM on AMX tiles.

Built with torch.utils.cpp_extension for the instruction set torch dispatches to here (`probe().cpu_isa`: AVX512 or
AVX2, with ATen's vector types at that level) into $FLEXDRAFT_KERNELS_DIR or ~/.cache/flexdraft/kernels, in a folder
named by a hash of the sources, torch's version and the flags, so a cache shared between machines never hands one
CPU another's build; a build found there is loaded as it is (no compiler needed). `make` builds this CPU's at set-up
(`python -m flexdraft.models.kernels`; `--all`: every variant, for an image whose nodes differ); elsewhere the first
forward on CPU does (~10-20 s, logged). Where they cannot be built (no C++ compiler, another ISA) or
FLEXDRAFT_CPU_KERNELS=0, the model runs its PyTorch ops instead, with a one-line warning; CUDA tensors never reach
them.
"""
from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import sys
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
# decode_attention takes up to this many query rows per key/value head (H/Hkv x tokens: the kernel's limit); beyond,
# SDPA, whose CPU kernel runs the scores as tiled GEMMs. bf16 9-token verifies (27 rows per head) over bench prompts'
# caches, forward time kernel / SDPA: 0.91-0.97x at 8 and 16 rows, 1.00x at 4 (the vector form); on AMX tiles the
# kernel alone takes 0.37-0.50x SDPA's time at 27-48 rows per head
DECODE_MAX_ROWS = 64
# amx_linear takes up to this many rows (a decode step, a small verify); beyond, oneDNN's prepacked GEMM
AMX_MAX_ROWS = 64


def cache_dir() -> Path:
    """$FLEXDRAFT_KERNELS_DIR, else per machine, not per FLEXDRAFT_HOME (which jobs and tests vary): the user's cache,
    as torch's own extensions."""
    if os.environ.get("FLEXDRAFT_KERNELS_DIR"):
        return Path(os.environ["FLEXDRAFT_KERNELS_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flexdraft" / "kernels"


@functools.cache
def has_gemv_bf16(isa: str) -> bool:
    """gemv_bf16 needs AVX512-BF16's dot products (Intel from Cooper Lake, AMD from Zen 4)."""
    return isa == "AVX512" and "avx512_bf16" in cpuinfo("flags").split()


VARIANTS = [("AVX2", False), ("AVX512", False), ("AVX512", True)]  # (ISA, with the bf16 GEMV and AMX GEMM)


def build_plan(isa: str, gemv: bool) -> tuple[list[Path], list[str]]:
    """The sources and compiler flags of one variant."""
    sources = [CSRC / "decode_attention.cpp", CSRC / "fused_ops.cpp", CSRC / "decoder_stack.cpp"]
    flags = list(_ISA_FLAGS[isa])
    if gemv:  # with the AMX GEMM: it is run only where the CPU and the kernel grant AMX (`amx_available`)
        sources += [CSRC / "gemv_bf16.cpp", CSRC / "linear_amx.cpp"]
        flags += ["-mavx512bf16", "-mamx-tile", "-mamx-bf16"]
    return sources, flags


def build_id(isa: str, gemv: bool) -> str:
    sources, flags = build_plan(isa, gemv)
    h = hashlib.sha256()
    for src in [*sources, *sorted(CSRC.glob("*.h"))]:
        h.update(src.read_bytes())
    h.update(f"{torch.__version__} {isa} {' '.join(flags)}".encode())
    return h.hexdigest()[:12]


def build(isa: str, gemv: bool) -> Path:
    """The variant's shared library, built into cache_dir() unless it is there; raises where it cannot be built."""
    from torch.utils import cpp_extension  # imported here: it pulls in setuptools

    ident = build_id(isa, gemv)
    folder = cache_dir() / ident
    library = folder / f"flexdraft_cpu_{ident}.so"
    if library.is_file() and not (folder / "lock").exists():  # (cpp_extension's lock: a build under way)
        return library
    folder.mkdir(parents=True, exist_ok=True)
    log = logs.get("runtime")
    log.info("building flexdraft's C++ CPU kernels for %s%s into %s (once per machine, ~10-20 s)", isa,
             " with the bf16 GEMV and AMX GEMM" if gemv else "", folder)
    start = time.perf_counter()
    sources, flags = build_plan(isa, gemv)
    cpp_extension.load(name=library.stem, sources=[str(s) for s in sources], build_directory=str(folder),
                       extra_cflags=["-O3", "-std=c++17", "-ffp-contract=off", "-fopenmp", *flags],
                       extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    log.info("built flexdraft's C++ CPU kernels in %.0f s", time.perf_counter() - start)
    return library


@functools.cache
def load() -> bool:
    """Load this CPU's kernels, building them first where no build is cached; False, with a warning, where this CPU
    or machine cannot."""
    log = logs.get("runtime")
    if os.environ.get("FLEXDRAFT_CPU_KERNELS", "1") == "0":
        return False
    isa = probe().cpu_isa
    if isa not in _ISA_FLAGS:
        log.warning("no C++ CPU kernels for %s (they need AVX512 or AVX2): attention runs on PyTorch's ops", isa)
        return False
    try:
        torch.ops.load_library(str(build(isa, has_gemv_bf16(isa))))
    except (RuntimeError, OSError, ImportError) as e:  # no sources, no compiler, no ninja, a failed build
        lines = str(e).strip().splitlines() or [type(e).__name__]
        reason = next((line.strip() for line in lines if "error" in line), lines[-1])[:300]
        log.warning("flexdraft's C++ CPU kernels could not be built (%s): attention runs on PyTorch's ops", reason)
        return False
    return True


def use_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether `attend` takes decode_attention for q [B, H, T, D] over keys/values [B, Hkv, S, D]: inference on CPU,
    a few query rows per key/value head, a head_dim in whole vectors, and the kernels loaded (FLEXDRAFT_CPU_KERNELS=0
    turns them off)."""
    B, H, T, D = q.shape
    return decode_attention_fits(B, T, H, keys.shape[1], D) and fused(q, keys, values)


def decode_attention_fits(B: int, T: int, H: int, Hkv: int, D: int) -> bool:
    """decode_attention's shapes: B rows of T tokens, H query and Hkv key/value heads of D."""
    rows = H // Hkv * T
    # the kernel is compiled for 1, 2, 4, 8 or 16 vectors of 16 (AVX-512) or 8 (AVX2) floats per head
    return rows <= DECODE_MAX_ROWS and D in (16, 32, 64, 128)


def stack_wanted() -> bool:
    """FLEXDRAFT_CPU_STACK=0 leaves the decoder layers in Python (`Transformer.decoder_stack_params`)."""
    return os.environ.get("FLEXDRAFT_CPU_STACK", "1") != "0"


def use_decoder_stack(x: torch.Tensor, H: int, Hkv: int, D: int) -> bool:
    """Whether a forward of embedded tokens x [B, T, d] can run its layers as one C++ call (`decoder_stack`): where
    every op of its body takes a kernel (inference on CPU, decode_attention's shapes), so the call computes what the
    Python layers would; at any row count: past 64 rows the GEMMs are oneDNN's, and the stack still saves the
    interpreter's ~5 ms per forward (a 16-row bf16 verify of 5 or 9 tokens in 0.87-0.88x the time).
    `Transformer.stack_paths` adds the GEMMs' paths."""
    B, T = x.shape[0], x.shape[1]
    return decode_attention_fits(B, T, H, Hkv, D) and x.is_contiguous() and fused(x)


def fused(*tensors: torch.Tensor) -> bool:
    """Whether work over these tensors runs on the C++ ops: inference on CPU in a model dtype, with the kernels
    loaded (what every op of theirs needs; `use_decode_attention` adds the attention's shapes)."""
    t = tensors[0]
    return (t.device.type == "cpu" and t.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and not (torch.is_grad_enabled() and any(x.requires_grad for x in tensors)) and load())


def amx_available() -> bool:
    """Whether bf16 linear layers can run on AMX tiles (`Linear.tiles`, C++ `amx_linear`): a CPU with AMX-BF16 (Intel
    from Sapphire Rapids), the kernels loaded and the OS granting AMX's state. FLEXDRAFT_CPU_AMX=0 turns them off
    alone."""
    return (os.environ.get("FLEXDRAFT_CPU_AMX", "1") != "0" and has_gemv_bf16(probe().cpu_isa)
            and "amx_bf16" in cpuinfo("flags").split() and load() and torch.ops.flexdraft.amx_ready())


def gemv_available() -> bool:
    """Whether one bf16 row can go through a linear layer on gemv_bf16 (`Linear`'s one-row path "gemv").
    FLEXDRAFT_CPU_GEMV=0 leaves single rows on oneDNN, as several rows are: in bf16 the GEMV rounds a batch-1 AR
    step's sums differently from a verify's GEMM, so more rows leave AR's path at near-ties (fp32 never takes it)."""
    return gemv_wanted() and load()


@functools.cache
def gemv_wanted() -> bool:
    """This CPU has the GEMV and FLEXDRAFT_CPU_GEMV does not turn it off (read once: `Linear` asks per call)."""
    return os.environ.get("FLEXDRAFT_CPU_GEMV", "1") != "0" and has_gemv_bf16(probe().cpu_isa)


def main() -> None:
    """`python -m flexdraft.models.kernels [--all]`: build this CPU's kernels now (what `make` runs at set-up), or
    every variant (an image built on one CPU for nodes of others)."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    ap.add_argument("--all", action="store_true", help="every variant: " + ", ".join(
        f"{isa}{' + bf16 GEMV and AMX' if gemv else ''}" for isa, gemv in VARIANTS))
    start = time.perf_counter()
    if ap.parse_args().all:  # one process per variant: a build loads its library, and two define the same ops
        for isa, gemv in VARIANTS:
            code = f"from flexdraft.models.kernels import build; print(build({isa!r}, {gemv}))"
            library = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
            print(f"flexdraft C++ CPU kernels, {isa}{' + bf16 GEMV and AMX' if gemv else ''}: {library.stdout.strip()}")
        return
    ok = load()
    print(f"flexdraft C++ CPU kernels: {'ready' if ok else 'not available (PyTorch ops are used)'} "
          f"({probe().cpu_isa}, {time.perf_counter() - start:.0f} s, {cache_dir()})")


if __name__ == "__main__":
    main()
