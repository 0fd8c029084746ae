"""decode_attention at decode and verify shapes, as a forward meets it: 30 layers' keys/values (one cache per layer,
[B, 3, 1024, 64] bf16, SmolLM2's heads) read cold in turn, rows of mixed lengths as a batch of bench prompts has
them. The kernel as of a git revision (`--before`, built into a temporary folder under another op namespace)
against the working tree's, alternating, best of 5; the bandwidth each implies over the keys/values the rows see.

    python benchmarks/2026-12-07-prefill/attention.py --before 37c4a8c~1
    python benchmarks/2026-12-07-prefill/attention.py --before 0b15621 --verifies   # + 9-token verifies of 8, 16 rows
"""
from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from flexdraft.models import kernels
from flexdraft.models.attention import grouped_mask

ROOT = Path(__file__).resolve().parents[2]
SOURCE = "platform/flexdraft/models/csrc/decode_attention.cpp"
# prompt lengths + 32 generated tokens, as in the middle of a 64-token bench generation (HumanEval's and GSM8K's 16
# bench prompts)
HUMANEVAL = [444, 380, 350, 300, 260, 230, 210, 200, 190, 180, 170, 160, 150, 130, 110, 100]
GSM8K = [121, 110, 100, 95, 90, 88, 85, 80, 80, 78, 75, 70, 66, 60, 58, 56]
CASES = [("HumanEval, 16 rows", HUMANEVAL, 1), ("GSM8K, 16 rows", GSM8K, 1), ("HumanEval, 4 rows", HUMANEVAL[:4], 1),
         ("HumanEval, 4 rows", HUMANEVAL[:4], 9), ("HumanEval, 1 row", HUMANEVAL[:1], 1),
         ("HumanEval, 1 row", HUMANEVAL[:1], 9), ("16 rows of 476", [444] * 16, 1)]
VERIFIES = [("HumanEval, 16 rows", HUMANEVAL, 9), ("GSM8K, 16 rows", GSM8K, 9), ("HumanEval, 8 rows", HUMANEVAL[:8], 9)]
LAYERS, H, HKV, D = 30, 9, 3, 64


def build_before(rev: str, folder: Path):
    """The kernel at `rev` as torch.ops.flexdraft_before.decode_attention."""
    from torch.utils import cpp_extension

    text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{SOURCE}"], capture_output=True, text=True,
                          check=True).stdout
    text = text.replace("TORCH_LIBRARY_FRAGMENT(flexdraft,", "TORCH_LIBRARY_FRAGMENT(flexdraft_before,")
    text = text.replace("TORCH_LIBRARY_IMPL(flexdraft,", "TORCH_LIBRARY_IMPL(flexdraft_before,")
    (folder / "before.cpp").write_text(text)
    (folder / "vec_io.h").write_text((ROOT / "platform/flexdraft/models/csrc/vec_io.h").read_text())
    flags = kernels._ISA_FLAGS[kernels.probe().cpu_isa]
    cpp_extension.load(name="decode_attention_before", sources=[str(folder / "before.cpp")],
                       build_directory=str(folder), extra_cflags=["-O3", "-std=c++17", "-ffp-contract=off",
                                                                  "-fopenmp", *flags],
                       extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    torch.ops.load_library(str(folder / "decode_attention_before.so"))
    return torch.ops.flexdraft_before.decode_attention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="git revision of the kernel to compare against")
    ap.add_argument("--verifies", action="store_true", help="also 9-token verifies of 8 and 16 rows")
    args = ap.parse_args()
    assert kernels.load(), "the C++ kernels are not available here"
    torch.set_num_threads(2)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        ops = {"before": build_before(args.before, Path(tmp)), "now": torch.ops.flexdraft.decode_attention}
        print(f"\nbf16, 2 threads, {LAYERS} layers' caches read cold in turn, best of 5 alternating\n")
        print("| rows | tokens per row | before ms | now ms | now / before | now GB/s (keys/values seen) | max diff |")
        print("|---|---|---|---|---|---|---|")
        for name, prompts, T in CASES + (VERIFIES if args.verifies else []):
            lens = torch.tensor(prompts) + 32
            B, S = len(prompts), int(lens.max()) + T
            caches = [(torch.randn(B, HKV, 1024, D, dtype=torch.bfloat16),
                       torch.randn(B, HKV, 1024, D, dtype=torch.bfloat16)) for _ in range(LAYERS)]
            q = torch.randn(B, T, H, D, dtype=torch.bfloat16).transpose(1, 2)
            pos = lens[:, None] + torch.arange(T)
            mask = grouped_mask((torch.arange(S) <= pos[..., None])[:, None], H // HKV)
            flush = torch.empty(64 << 20, dtype=torch.uint8)
            best, out = {k: float("inf") for k in ops}, {}
            for _ in range(5):
                for key, op in ops.items():
                    flush.add_(1)  # (the last layer's keys out of the caches)
                    t0 = time.perf_counter()
                    for k, v in caches:
                        out[key] = op(q, k[:, :, :S], v[:, :, :S], mask)
                    best[key] = min(best[key], time.perf_counter() - t0)
            seen = int((lens + T).sum()) * HKV * D * 2 * 2 * LAYERS
            diff = (out["before"].float() - out["now"].float()).abs().max().item()
            print(f"| {name} | {T} | {best['before'] * 1e3:.2f} | {best['now'] * 1e3:.2f} | "
                  f"{best['now'] / best['before']:.2f}x | {seen / best['now'] / 1e9:.1f} | {diff:.1g} |", flush=True)


if __name__ == "__main__":
    main()
