"""What this machine runs fast: one probe per process, read wherever a fast path is chosen.

- CPU: the instruction set torch dispatches to (`ATEN_CPU_CAPABILITY` caps it), native bf16 matrix instructions
  (AVX512-BF16 or AMX on x86-64, BF16 on aarch64; `ONEDNN_MAX_CPU_ISA` caps them), and the dtypes whose linear
  weights oneDNN can prepack, found by trying (a bf16 prepack needs AVX512BW/VL/DQ or AVX-NE-CONVERT).
- CUDA: present or not, and whether it has bf16.

`dtype: auto` is decided here: bfloat16 on CUDA with bf16 and on CPUs with native bf16, else float32 (emulated
bf16 is slower than fp32). An x86-64 CPU with more runs as an AVX2-only one (e.g. an AMD EPYC of family 23) when
its libraries are capped: ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2; oneDNN then
refuses bf16 prepacking as it does there, and the probe sees it.
"""
from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from flexdraft.core import logs

# oneDNN's ISA names in ascending order (its ONEDNN_MAX_CPU_ISA values); native bf16 starts at AVX512_CORE_BF16
_ONEDNN_ISAS = ["SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI",
                "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX10_1_512", "AVX512_CORE_AMX", "AVX10_1_512_AMX",
                "AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2"]
_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # x86-64 flags; "bf16" is aarch64's Features entry


def cpuinfo(field: str) -> str:
    """The first value of `field` in /proc/cpuinfo ("model name", "flags"); "" where there is none (not Linux)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in lines if line.split(":", 1)[0].strip() == field), "")


def onednn_isa_cap() -> str:
    """The ISA cap oneDNN was given (ONEDNN_MAX_CPU_ISA, or its old name DNNL_MAX_CPU_ISA); "" = none."""
    return (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").upper()


def _cap_allows_bf16(cap: str) -> bool:
    if not cap or cap in ("ALL", "DEFAULT") or cap not in _ONEDNN_ISAS:
        return True
    return _ONEDNN_ISAS.index(cap) >= _ONEDNN_ISAS.index("AVX512_CORE_BF16")


def _can_prepack(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), 16)
    except RuntimeError:
        return False
    return True


@dataclass(frozen=True)
class Capabilities:
    arch: str  # x86_64, aarch64, ...
    cpu_name: str
    cpu_isa: str  # torch's dispatch level: AVX512, AVX2, DEFAULT, SVE256, ...
    onednn_cap: str  # ONEDNN_MAX_CPU_ISA, "" = none
    cpu_bf16: bool  # native bf16 matrix instructions (as capped)
    prepack: tuple[str, ...]  # dtype names oneDNN can prepack linear weights for
    cuda: bool
    cuda_name: str
    cuda_bf16: bool

    def native_bf16(self, device_type: str) -> bool:
        return self.cuda_bf16 if device_type == "cuda" else self.cpu_bf16

    def auto_dtype(self, device_type: str) -> str:
        """What `dtype: auto` means on this device."""
        return "bfloat16" if self.native_bf16(device_type) else "float32"

    def can_prepack(self, dtype: torch.dtype) -> bool:
        return str(dtype).removeprefix("torch.") in self.prepack

    def describe(self) -> dict[str, str]:
        return {"arch": self.arch, "cpu": self.cpu_name, "cpu_isa": self.cpu_isa,
                "onednn_max_cpu_isa": self.onednn_cap or "(none)", "native_bf16_cpu": str(self.cpu_bf16),
                "prepack_dtypes": ", ".join(self.prepack) or "(none)",
                "cuda": self.cuda_name if self.cuda else "(none)"}


_probed: Capabilities | None = None


def probe() -> Capabilities:
    """This process's capabilities, probed on first use (a few ms) and kept."""
    global _probed
    if _probed is None:
        flags = set((cpuinfo("flags") or cpuinfo("Features")).split())
        cuda, cap = torch.cuda.is_available(), onednn_isa_cap()
        _probed = Capabilities(
            arch=platform.machine(), cpu_name=cpuinfo("model name") or platform.processor() or platform.machine(),
            cpu_isa=torch.backends.cpu.get_cpu_capability(), onednn_cap=cap,
            cpu_bf16=bool(_BF16_FLAGS & flags) and _cap_allows_bf16(cap),
            prepack=tuple(n for n, d in (("float32", torch.float32), ("bfloat16", torch.bfloat16)) if _can_prepack(d)),
            cuda=cuda, cuda_name=torch.cuda.get_device_name(0) if cuda else "",
            cuda_bf16=cuda and torch.cuda.is_bf16_supported())
    return _probed


@functools.cache
def warn_emulated_bf16() -> None:
    """Said once per process: an explicit bfloat16 on a CPU without native bf16 runs correctly, but slowly."""
    caps = probe()
    logs.get("hardware").warning("bfloat16 on this CPU (%s, %s) is emulated: correct, but slower than float32; "
                                 "dtype auto picks float32 here", caps.cpu_name, caps.cpu_isa)
