// A few bf16 rows through a linear layer on AMX tiles, reading each weight once for all rows:
//   torch.ops.flexdraft.amx_pack(w) -> tiles     w [N, K] bf16, K a multiple of 32 -> [ceil(N/32), K * 32]: each
//                                                 block of 32 outputs as [K/2][32][2] (AMX's pairs of k), the last
//                                                 block zero-padded
//   torch.ops.flexdraft.amx_linear(x, tiles, bias, N) -> [..., N]   x [..., K] bf16 contiguous, bias [N] or None
//   torch.ops.flexdraft.amx_ready() -> bool       whether this process may use AMX (the kernel grants its tile state)
// Each row is fp32 sums of bf16 products in K order, bias added in fp32, one rounding; a row's result does not
// depend on how many rows come with it (a tile computes each row alone), so a verify's rows equal an AR step's.
// Built only for CPUs with AVX512-BF16 (kernels.py adds -mamx-tile -mamx-bf16 there); run only where amx_ready.
//
// Why: decode and verify GEMMs have 1-32 rows, where streaming the weights once is the bound. Per block of 32
// outputs, up to 32 rows (two A tiles) meet the block's weights (two B tiles per 32 k) in four accumulator tiles;
// the two threads take the two halves of the blocks. oneDNN's prepacked GEMM and ATen's brgemm spent more per call.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "amx.h"
#include "vec_io.h"

namespace {

using namespace flexdraft_kernels;
constexpr int64_t NB = 32;  // outputs per block: two 16-wide tiles
constexpr int64_t KB = 32;  // bf16 k per tile row (64 bytes)

at::Tensor amx_pack(const at::Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.size(1) % KB == 0,
              "amx_pack: a bf16 CPU weight [N, K] with K a multiple of ", KB, ", got ", w.scalar_type(), " ",
              w.sizes());
  const int64_t N = w.size(0), K = w.size(1), blocks = (N + NB - 1) / NB;
  at::Tensor padded = at::zeros({blocks * NB, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  // [blocks, NB, K/2, 2] -> [blocks, K/2, NB, 2]: a B tile's row is one k pair of 16 outputs
  return padded.view({blocks, NB, K / 2, 2}).permute({0, 2, 1, 3}).contiguous().view({blocks, K * NB});
}

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& tiles, const std::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.dim() >= 1,
              "amx_linear: x [..., K] bf16, contiguous, on CPU");
  const int64_t K = x.size(-1), M = x.numel() / K, blocks = (N + NB - 1) / NB;
  TORCH_CHECK(tiles.scalar_type() == at::kBFloat16 && tiles.is_contiguous() && tiles.dim() == 2 &&
                  tiles.size(0) == blocks && tiles.size(1) == K * NB && K % KB == 0,
              "amx_linear: tiles of amx_pack for [", N, ", ", K, "], got ", tiles.sizes());
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == N,
                "amx_linear: bias [N] in bf16");
  TORCH_CHECK(amx_ready(), "amx_linear: this process may not use AMX");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor y = at::empty(shape, x.options());
  if (M == 0) return y;
  const int64_t Mp = (M + 15) / 16 * 16;  // rows in whole tiles of 16
  const auto* xp = x.data_ptr<at::BFloat16>();
  const auto* wp = tiles.data_ptr<at::BFloat16>();
  const auto* bp = has_bias ? bias->data_ptr<at::BFloat16>() : nullptr;
  auto* yp = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();  // tiles 0-3: accumulators [16 rows][16 fp32]; 4-5: rows of x [16][32 bf16]; 6-7: weights
    alignas(64) float acc[32 * NB];
    std::vector<at::BFloat16> tail;  // the last M % 16 rows, then zeros (computed, never stored): a whole tile
    if (Mp != M) {
      tail.assign(16 * K, at::BFloat16(0.f));
      std::copy(xp + (Mp - 16) * K, xp + M * K, tail.begin());
    }
    const auto rows_from = [&](int64_t r) { return r + 16 <= M ? xp + r * K : tail.data(); };  // a tile's rows
    for (int64_t b = begin; b < end; ++b) {
      const at::BFloat16* wb = wp + b * K * NB;
      const int64_t n0 = b * NB, width = std::min(NB, N - n0);
      for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
        const at::BFloat16 *x0 = rows_from(m0), *x1 = rows_from(m0 + 16);
        const bool two = m0 + 16 < Mp;  // a second tile of rows
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t k = 0; k < K; k += KB) {
          _tile_loadd(6, wb + k * NB, NB * 4);  // outputs 0-15 of the block, k .. k+31 (16 rows of k pairs)
          _tile_loadd(7, wb + k * NB + 32, NB * 4);  // outputs 16-31
          _tile_loadd(4, x0 + k, K * 2);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          if (two) {
            _tile_loadd(5, x1 + k, K * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
        }
        _tile_stored(0, acc, NB * 4);
        _tile_stored(1, acc + 16, NB * 4);
        if (two) {
          _tile_stored(2, acc + 16 * NB, NB * 4);
          _tile_stored(3, acc + 16 * NB + 16, NB * 4);
        }
        for (int64_t m = 0; m < std::min<int64_t>(32, M - m0); ++m)
          for (int64_t j = 0; j < width; j += Vec::size()) {
            const int64_t n = chunk(j, width);
            Vec v = Vec::loadu(acc + m * NB + j);
            if (bp) v = v + loadf(bp + n0 + j, n);
            storef(yp + (m0 + m) * N + n0 + j, v, n);
          }
      }
    }
    _tile_release();
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flexdraft, m) {
  m.def("amx_ready() -> bool", &flexdraft_kernels::amx_ready);  // no tensor to dispatch on: one kernel for every key
  m.def("amx_pack(Tensor w) -> Tensor");
  m.def("amx_linear(Tensor x, Tensor tiles, Tensor? bias, int N) -> Tensor");
}

TORCH_LIBRARY_IMPL(flexdraft, CPU, m) {
  m.impl("amx_pack", &amx_pack);
  m.impl("amx_linear", &amx_linear);
}
