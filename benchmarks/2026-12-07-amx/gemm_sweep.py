"""The linear layers alone: one decoder's worth of SmolLM2-135M's GEMMs (30 layers of q/k/v, o, gate/up and down as
the model fuses them, then the 49152-wide head; random bf16 weights, 269 MB, so they stream from memory as in a
forward) at M rows, through oneDNN's prepacked GEMM and through our AMX tiles (and, at 1 row, the one-row GEMV),
alternating passes, median of 5; with the read bandwidth each implies. What `kernels.AMX_MAX_ROWS` is set from.

    python benchmarks/2026-12-07-amx/gemm_sweep.py 1 4 16 32 64 96 144 256
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from flexdraft.models import kernels

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (outputs, inputs): qkv, o, gate_up, down


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rows", type=int, nargs="+")
    args = ap.parse_args()
    assert kernels.amx_available(), "no AMX tiles here (a bf16 AMX CPU with the C++ kernels built)"
    torch.set_num_threads(2)
    weights = [torch.randn(n, k, dtype=torch.bfloat16) * 0.05 for _ in range(30) for n, k in SHAPES]
    weights.append(torch.randn(49152, 576, dtype=torch.bfloat16) * 0.05)
    layers = [(w, torch.ops.mkldnn._reorder_linear_weight(w, 16), torch.ops.flexdraft.amx_pack(w)) for w in weights]
    megabytes = sum(w.numel() * 2 for w in weights) / 1e6
    paths = {"oneDNN": lambda x, w, packed, tiles: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
             "AMX": lambda x, w, packed, tiles: torch.ops.flexdraft.amx_linear(x, tiles, None, w.shape[0]),
             "GEMV": lambda x, w, packed, tiles: torch.ops.flexdraft.gemv_bf16(x, w, None)}
    print(f"bf16, 2 threads, {megabytes:.0f} MB of weights per pass; ms (GB/s)\n")
    print("| rows | " + " | ".join(paths) + " | AMX / oneDNN |")
    print("|---" * (len(paths) + 2) + "|")
    with torch.inference_mode():
        for M in args.rows:
            xs = {k: torch.randn(M, k, dtype=torch.bfloat16) for k in (576, 1536)}
            names = [p for p in paths if p != "GEMV" or M == 1]
            times = {p: [] for p in names}
            for _ in range(6):
                for p in names:
                    t0 = time.perf_counter()
                    for w, packed, tiles in layers:
                        paths[p](xs[w.shape[1]], w, packed, tiles)
                    times[p].append(time.perf_counter() - t0)
            ms = {p: 1000 * statistics.median(t[1:]) for p, t in times.items()}  # the first pass warms up
            cells = [f"{ms[p]:.2f} ({megabytes / ms[p]:.1f})" if p in ms else "-" for p in paths]
            print(f"| {M} | " + " | ".join(cells) + f" | {ms['AMX'] / ms['oneDNN']:.2f} |")


if __name__ == "__main__":
    main()
