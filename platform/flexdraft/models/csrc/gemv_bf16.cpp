// One row through a linear layer in bf16 with AVX512-BF16 dot products: torch.ops.flexdraft.gemv_bf16(x, w, bias),
// x [1, K] or [K] (any leading dims of one row), w [N, K] row-major (the layer's own weight), bias [N] or None ->
// [..., N]: fp32 sums of bf16 products, bias added in fp32, one rounding. Built only for CPUs with AVX512-BF16
// (kernels.py compiles this file with -mavx512bf16 there).
//
// Why: a batch-1 decode step is the weights streaming through once; oneDNN's one-row GEMMs reached ~0.7 of this
// CPU's read bandwidth. Each block of 16 outputs streams 16 weight rows side by side into 16 accumulators, reduced
// by one transpose-add tree; the two threads take the two halves of the rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <optional>

#include "vec_io.h"

namespace {

using flexdraft_kernels::sum_lanes;

at::Tensor gemv_bf16(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 &&
                  x.is_contiguous() && w.is_contiguous() && w.dim() == 2,
              "gemv_bf16: bf16 CPU tensors, x [..., K] contiguous, w [N, K] contiguous");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "gemv_bf16: rows of ", K, " features, got ", x.sizes());
  const int64_t M = x.numel() / K;
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == N,
                "gemv_bf16: bias [N] in bf16");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor y = at::empty(shape, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  const auto* bp = has_bias ? reinterpret_cast<const uint16_t*>(bias->data_ptr()) : nullptr;
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t tail = K % 32;
  const __mmask32 tail_mask = static_cast<__mmask32>((1ULL << tail) - 1);
  at::parallel_for(0, (N + 15) / 16, 1, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n0 = blk * 16, rows = std::min<int64_t>(16, N - n0);
      const __mmask16 out_mask = static_cast<__mmask16>((1u << rows) - 1);
      // every row alike, the block's 16 weight rows read from cache after the first: a row's result does not
      // depend on how many rows come with it
      for (int64_t m = 0; m < M; ++m) {
        const uint16_t* xr = xp + m * K;
        __m512 acc[16];
        for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
        int64_t k = 0;
        for (; k + 32 <= K; k += 32) {
          const __m512bh xv = (__m512bh)_mm512_loadu_si512(xr + k);
          for (int j = 0; j < rows; ++j)
            acc[j] = _mm512_dpbf16_ps(acc[j], xv, (__m512bh)_mm512_loadu_si512(wp + (n0 + j) * K + k));
        }
        if (tail) {  // masked loads: the lanes past K are zeros
          const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tail_mask, xr + k);
          for (int j = 0; j < rows; ++j)
            acc[j] = _mm512_dpbf16_ps(acc[j], xv,
                                      (__m512bh)_mm512_maskz_loadu_epi16(tail_mask, wp + (n0 + j) * K + k));
        }
        __m512 s = sum_lanes(acc);
        if (bp) {  // bf16 -> fp32 is a 16-bit shift
          const __m256i b16 = _mm256_maskz_loadu_epi16(out_mask, bp + n0);
          s = _mm512_add_ps(s, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b16), 16)));
        }
        _mm256_mask_storeu_epi16(yp + m * N + n0, out_mask, (__m256i)_mm512_cvtneps_pbh(s));
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flexdraft, m) { m.def("gemv_bf16(Tensor x, Tensor w, Tensor? bias) -> Tensor"); }

TORCH_LIBRARY_IMPL(flexdraft, CPU, m) { m.impl("gemv_bf16", &gemv_bf16); }
