// A few bf16 rows through a linear layer on AMX tiles, reading each weight once for all rows:
//   torch.ops.flexdraft.amx_pack(w) -> tiles     w [N, K] bf16 (K even) -> [ceil(N/32), K * 32], the layer's weight
//                                                 transposed in blocks of 32 outputs, each VNNI-packed, zero-padded
//   torch.ops.flexdraft.amx_linear(x, tiles, bias, N) -> [..., N]   x [..., K] bf16 contiguous, bias [N] or None
//   torch.ops.flexdraft.amx_ready() -> bool       whether this CPU runs them (ATen's brgemm has AMX-BF16 here)
// Each row is fp32 sums of bf16 products, bias added in fp32, one rounding; a row's result does not depend on how
// many rows come with it (AMX accumulates every row alone), so a verify's rows equal the AR step's single row.
//
// Why: decode and verify GEMMs have 1-32 rows, where the weights streaming once is the bound. oneDNN's prepacked
// GEMMs spend more per call than the work; ATen's brgemm (oneDNN's ukernel, the one inductor's AMX GEMM templates
// call) over one contiguous block of weights at a time gets closer to the read bandwidth.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "vec_io.h"

namespace {

using namespace flexdraft_kernels;
using at::native::cpublas::brgemm;
constexpr int64_t NB = 32;  // outputs per block: two 16-wide AMX tiles (32 measured best of 16, 32 and 64)
constexpr int64_t MB = 32;  // rows per brgemm call

bool amx_ready() { return at::native::cpublas::could_pack(at::kBFloat16); }

at::Tensor amx_pack(const at::Tensor& w) {
  TORCH_CHECK(amx_ready(), "amx_pack: this CPU has no AMX-BF16 for ATen's brgemm");
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.size(1) % 2 == 0,
              "amx_pack: a bf16 CPU weight [N, K] with K even, got ", w.scalar_type(), " ", w.sizes());
  const int64_t N = w.size(0), K = w.size(1), blocks = (N + NB - 1) / NB;
  at::Tensor wt = at::zeros({K, blocks * NB}, w.options());  // [K, N] with the last block's outputs padded
  wt.narrow(1, 0, N).copy_(w.t());
  at::Tensor tiles = at::empty({blocks, K * NB}, w.options());
  for (int64_t b = 0; b < blocks; ++b)
    at::native::cpublas::pack(K, NB, blocks * NB, NB, at::kBFloat16, at::kBFloat16,
                              wt.data_ptr<at::BFloat16>() + b * NB, tiles.data_ptr<at::BFloat16>() + b * K * NB);
  return tiles;
}

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& tiles, const std::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.dim() >= 1,
              "amx_linear: x [..., K] bf16, contiguous, on CPU");
  const int64_t K = x.size(-1), M = x.numel() / K, blocks = (N + NB - 1) / NB;
  TORCH_CHECK(tiles.scalar_type() == at::kBFloat16 && tiles.is_contiguous() && tiles.dim() == 2 &&
                  tiles.size(0) == blocks && tiles.size(1) == K * NB,
              "amx_linear: tiles of amx_pack for [", N, ", ", K, "], got ", tiles.sizes());
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == N,
                "amx_linear: bias [N] in bf16");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor y = at::empty(shape, x.options());
  if (M == 0) return y;
  const auto* xp = x.data_ptr<at::BFloat16>();
  const auto* wp = tiles.data_ptr<at::BFloat16>();
  const auto* bp = has_bias ? bias->data_ptr<at::BFloat16>() : nullptr;
  auto* yp = y.data_ptr<at::BFloat16>();
  // each thread a contiguous run of blocks, every row of the block at once: the weights stream through once
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(MB * NB);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * NB, width = std::min(NB, N - n0);
      for (int64_t m0 = 0; m0 < M; m0 += MB) {
        const int64_t rows = std::min(MB, M - m0);
        brgemm(rows, NB, K, K, NB, NB, false, xp + m0 * K, wp + b * K * NB, acc.data());
        for (int64_t m = 0; m < rows; ++m)
          for (int64_t j = 0; j < width; j += Vec::size()) {
            const int64_t n = chunk(j, width);
            Vec v = Vec::loadu(acc.data() + m * NB + j);
            if (bp) v = v + loadf(bp + n0 + j, n);
            storef(yp + (m0 + m) * N + n0 + j, v, n);
          }
      }
    }
    at::native::cpublas::brgemm_release();
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flexdraft, m) {
  m.def("amx_ready() -> bool", &amx_ready);  // no tensor to dispatch on: one kernel for every key
  m.def("amx_pack(Tensor w) -> Tensor");
  m.def("amx_linear(Tensor x, Tensor tiles, Tensor? bias, int N) -> Tensor");
}

TORCH_LIBRARY_IMPL(flexdraft, CPU, m) {
  m.impl("amx_pack", &amx_pack);
  m.impl("amx_linear", &amx_linear);
}
