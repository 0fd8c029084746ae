"""How far from this machine's limits each forward shape runs: for B rows x T tokens per row over a cache of S
tokens, the bytes a target forward must move (weights once, the rows' cached keys/values) and the FLOPs it must
do, against the machine's measured read bandwidth and best GEMM throughput, beside the forward's measured time.

    python benchmarks/2026-12-06-roofline/roofline.py --dtype bfloat16 [--json out.json]

The bound of a shape is max(bytes / bandwidth, FLOPs / GEMM throughput): what a forward could take if it were
nothing but its unavoidable memory traffic or its arithmetic at the speed this CPU's best GEMM reaches. Run it
under ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 for an AVX2-only machine's view.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from flexdraft.core.config import RuntimeConfig
from flexdraft.models.loading import load_model

SHAPES = [(1, 1), (1, 9), (4, 1), (4, 9), (16, 1), (16, 9)]


def median_seconds(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def read_bandwidth() -> float:
    """Bytes/s of a sum over 512 MB (far past the caches): what streaming weights from memory can reach."""
    x = torch.ones(128 * 1024 * 1024)
    return x.numel() * 4 / median_seconds(x.sum, 10)


def gemm_flops(dtype: torch.dtype, model) -> float:
    """FLOP/s of the model's own best GEMM: its widest layer (gate/up) at 144 rows, as the forward runs it."""
    linear = model.layers[0].mlp.gate_up.linear
    x = torch.randn(144, linear.in_features).to(dtype)
    with torch.inference_mode():
        return 2 * 144 * linear.in_features * linear.out_features / median_seconds(lambda: linear(x), 20)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--context", type=int, default=300, help="cached tokens per row (S)")
    ap.add_argument("--json")
    args = ap.parse_args()
    runtime = RuntimeConfig(device="cpu", dtype=args.dtype, threads=2)
    m = load_model("smollm2", runtime, with_tokenizer=False).model
    a = m.args
    size = m.dtype.itemsize
    bw, peak = read_bandwidth(), gemm_flops(m.dtype, m)
    # every weight a forward reads: the layers' and the LM head's (the embedding is a lookup of B*T rows)
    linear_params = sum(p.numel() for n, p in m.named_parameters() if "layers." in n and p.dim() == 2) \
        + a.vocab_size * a.dim
    rows = []
    for B, T in SHAPES:
        S = args.context
        kv_bytes = B * (S + T) * a.n_layers * 2 * a.n_kv_heads * a.head_dim * size
        weight_bytes = linear_params * size
        flops = 2 * B * T * linear_params + 4 * B * T * (S + T) * a.n_heads * a.head_dim * a.n_layers
        cache = m.new_cache(B, S + T)
        cache.lens[:] = S
        tokens = torch.randint(0, a.vocab_size, (B, T))
        pos = cache.lens[:, None] + torch.arange(T)
        with torch.inference_mode():
            seconds = median_seconds(lambda: m.logits(m(tokens, pos, cache)), 15)
        bound = max((weight_bytes + kv_bytes) / bw, flops / peak)
        row = {"batch": B, "tokens": T, "context": S, "weights_mb": weight_bytes / 1e6, "kv_mb": kv_bytes / 1e6,
               "gflop": flops / 1e9, "memory_ms": 1e3 * (weight_bytes + kv_bytes) / bw,
               "compute_ms": 1e3 * flops / peak, "bound_ms": 1e3 * bound, "measured_ms": 1e3 * seconds,
               "of_bound": bound / seconds}
        rows.append(row)
        print(json.dumps(row), flush=True)
    one = {r["batch"]: r["measured_ms"] for r in rows if r["tokens"] == 1}
    print(f"\nmachine: read {bw / 1e9:.1f} GB/s, GEMM {peak / 1e9:.0f} GFLOP/s ({args.dtype}, 2 threads)\n")
    print("| rows x tokens | weights + KV MB | GFLOP | memory bound ms | compute bound ms | measured ms | "
          "bound / measured | x the 1-token step |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} x {r['tokens']} | {r['weights_mb']:.0f} + {r['kv_mb']:.0f} | {r['gflop']:.1f} | "
              f"{r['memory_ms']:.1f} | {r['compute_ms']:.1f} | {r['measured_ms']:.1f} | {r['of_bound']:.0%} | "
              f"{r['measured_ms'] / one[r['batch']]:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dtype": args.dtype, "bandwidth_gbs": bw / 1e9, "gemm_gflops": peak / 1e9, "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
