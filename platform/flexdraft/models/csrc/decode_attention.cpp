// Attention for a few query rows per key/value head (decode steps and short verifies) on CPU, registered as
// torch.ops.flexdraft.decode_attention. Built by flexdraft/models/kernels.py with ATen's vector flags for this CPU.
//
// q [B, H, T, D]; keys, values [B, Hkv, S, D] (strided views of the KV cache: only the last dim must be dense);
// mask [B, 1, g*T, S], g = H / Hkv, rows in `grouped_mask` order (row j*T + t is query head hkv*g + j, token t):
// bool (true = visible) or an additive fp32 bias. Returns [B, H, T, D] laid out as [B, T, H, D] in memory, so the
// output projection's [B, T, H*D] is a view.
//
// One task per (row b, key/value head), for its query rows: their scores over the visible keys, a softmax and the
// weighted sum of the values, in fp32 until the single rounding of the output. Why not SDPA: its CPU flash kernel
// tiles for long query blocks; with one to a few query rows per head its per-task overhead dominates.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "vec_io.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using namespace flexdraft_kernels;
constexpr int kMaxVecs = 16;  // head_dim up to 16 vectors (256 floats with AVX-512, 128 with AVX2)
constexpr int kMaxRows = 64;  // query rows per key/value head (H/Hkv x T): kernels.SINGLE_MAX_ROWS

template <typename E, bool kBoolMask>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), S = k.size(2), g = H / Hkv, R = g * T;
  const int64_t nv = D / Vec::size();
  const int64_t Sp = (S + Vec::size() - 1) / Vec::size() * Vec::size();
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const E* qp = q.data_ptr<E>();
  const E* kp = k.data_ptr<E>();
  const E* vp = v.data_ptr<E>();
  E* op = out.data_ptr<E>();  // [B, T, H, D] contiguous
  const int64_t qsb = q.stride(0), qsh = q.stride(1), qst = q.stride(2);
  const int64_t ksb = k.stride(0), ksh = k.stride(1), kss = k.stride(2);
  const int64_t vsb = v.stride(0), vsh = v.stride(1), vss = v.stride(2);
  const int64_t msb = mask.stride(0), msr = mask.stride(2), mss = mask.stride(3);
  const bool* mb = kBoolMask ? mask.data_ptr<bool>() : nullptr;
  const float* mf = kBoolMask ? nullptr : mask.data_ptr<float>();
  const float neg_inf = -std::numeric_limits<float>::infinity();

  // one task per (row b, key/value head): each key and value row is converted to fp32 once for all R query rows
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(R * Sp);  // [R, Sp]: scores, then unnormalised probabilities
    std::vector<Vec> qv(R * nv), acc(R * nv);
    std::vector<float> mx(R), total(R);
    Vec kv[kMaxVecs];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, hkv = task % Hkv;
      const E* kbase = kp + b * ksb + hkv * ksh;
      const E* vbase = vp + b * vsb + hkv * vsh;
      for (int64_t r = 0; r < R; ++r) {
        const E* qrow = qp + b * qsb + (hkv * g + r / T) * qsh + (r % T) * qst;
        for (int64_t i = 0; i < nv; ++i) qv[r * nv + i] = loadf(qrow + i * Vec::size()) * Vec(scale);
        mx[r] = neg_inf;
      }
      std::fill(scores.begin(), scores.end(), neg_inf);  // masked keys and the padding: exp(-inf) = 0

      for (int64_t s = 0; s < S; ++s) {
        const E* krow = kbase + s * kss;
        for (int64_t i = 0; i < nv; ++i) kv[i] = loadf(krow + i * Vec::size());
        for (int64_t r = 0; r < R; ++r) {
          float bias = 0.0f;
          if constexpr (kBoolMask) {
            if (!mb[b * msb + r * msr + s * mss]) continue;
          } else {
            bias = mf[b * msb + r * msr + s * mss];
            if (bias == neg_inf) continue;
          }
          const Vec* qr = &qv[r * nv];
          Vec dot = qr[0] * kv[0];
          for (int64_t i = 1; i < nv; ++i) dot = at::vec::fmadd(qr[i], kv[i], dot);
          const float score = dot.reduce_add() + bias;
          scores[r * Sp + s] = score;
          mx[r] = score > mx[r] ? score : mx[r];
        }
      }

      for (int64_t r = 0; r < R; ++r) {  // exp of every score at once
        float* row = &scores[r * Sp];
        if (mx[r] == neg_inf) { std::fill(row, row + Sp, 0.0f); total[r] = 0.0f; continue; }
        Vec sum(0.0f);
        for (int64_t s = 0; s < Sp; s += Vec::size()) {
          const Vec e = (Vec::loadu(row + s) - Vec(mx[r])).exp();
          e.store(row + s);
          sum = sum + e;
        }
        total[r] = sum.reduce_add();
      }

      std::fill(acc.begin(), acc.end(), Vec(0.0f));
      for (int64_t s = 0; s < S; ++s) {
        const E* vrow = vbase + s * vss;
        for (int64_t i = 0; i < nv; ++i) kv[i] = loadf(vrow + i * Vec::size());
        for (int64_t r = 0; r < R; ++r) {
          const float p = scores[r * Sp + s];
          if (p == 0.0f) continue;
          const Vec pv(p);
          Vec* ar = &acc[r * nv];
          for (int64_t i = 0; i < nv; ++i) ar[i] = at::vec::fmadd(pv, kv[i], ar[i]);
        }
      }

      for (int64_t r = 0; r < R; ++r) {
        const int64_t h = hkv * g + r / T, t = r % T;
        const Vec inv(total[r] > 0.0f ? 1.0f / total[r] : 0.0f);  // a row that sees no key: zeros
        E* orow = op + ((b * T + t) * H + h) * D;
        for (int64_t i = 0; i < nv; ++i) storef(orow + i * Vec::size(), acc[r * nv + i] * inv);
      }
    }
  });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                            const at::Tensor& mask) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 4 && keys.dim() == 4 && values.dim() == 4 && mask.dim() == 4,
              "decode_attention: 4-d CPU tensors");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t Hkv = keys.size(1), S = keys.size(2);
  TORCH_CHECK(keys.scalar_type() == q.scalar_type() && values.scalar_type() == q.scalar_type(),
              "decode_attention: q, keys and values in one dtype");
  TORCH_CHECK(H % Hkv == 0 && keys.size(0) == B && keys.size(3) == D && values.sizes() == keys.sizes(),
              "decode_attention: q [B, H, T, D] with keys/values [B, Hkv, S, D], H a multiple of Hkv");
  TORCH_CHECK(D % Vec::size() == 0 && D / Vec::size() <= kMaxVecs, "decode_attention: head_dim ", D,
              " is not a multiple of ", Vec::size(), " up to ", kMaxVecs * Vec::size());
  TORCH_CHECK(q.stride(3) == 1 && keys.stride(3) == 1 && values.stride(3) == 1,
              "decode_attention: the head dim must be dense");
  TORCH_CHECK(mask.size(0) == B && mask.size(1) == 1 && mask.size(2) == H / Hkv * T && mask.size(3) == S,
              "decode_attention: mask [B, 1, H/Hkv*T, S]");
  TORCH_CHECK(H / Hkv * T <= kMaxRows, "decode_attention: at most ", kMaxRows, " query rows per key/value head");
  TORCH_CHECK(mask.scalar_type() == at::kBool || mask.scalar_type() == at::kFloat,
              "decode_attention: a bool mask or an fp32 bias");
  at::Tensor out = at::empty({B, T, H, D}, q.options());
  const bool boolean = mask.scalar_type() == at::kBool;
  dispatch(q.scalar_type(), "decode_attention", [&](auto tag) {
    using E = decltype(tag);
    boolean ? run<E, true>(q, keys, values, mask, out) : run<E, false>(q, keys, values, mask, out);
  });
  return out.transpose(1, 2);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flexdraft, m) {
  m.def("decode_attention(Tensor q, Tensor keys, Tensor values, Tensor mask) -> Tensor");
}

TORCH_LIBRARY_IMPL(flexdraft, CPU, m) { m.impl("decode_attention", &decode_attention); }
