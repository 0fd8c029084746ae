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
// Memory bound at decode: it reads each batch row's keys and values up to the last one the row sees (not the
// batch's span), a block of Vec::size() keys at a time, prefetched ahead; a block's dot products become scores
// through one transposing sum (vec_io.h's `sum_lanes`) rather than a horizontal sum per key. A score's summation
// order is fixed, so a query row's result does not depend on which rows or tokens come with it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "vec_io.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using namespace flexdraft_kernels;
constexpr int kMaxRows = 64;  // query rows per key/value head (H/Hkv x T): kernels.DECODE_MAX_ROWS
constexpr int64_t kAhead = 16;  // keys (and values) prefetched ahead of the score pass

// n elements from p on, a cache line at a time, into L1: each row's prefix is a stream too short for the hardware
// prefetcher to ramp up on
template <typename E>
inline void prefetch(const E* p, int64_t n) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t i = 0; i < n * static_cast<int64_t>(sizeof(E)); i += 64) __builtin_prefetch(bytes + i);
}

constexpr int64_t W = Vec::size();  // keys per block

// whether the W bools at p are all true (a block of keys every one of which the row sees)
inline bool all_true(const bool* p) {
  uint64_t word;
  for (int64_t i = 0; i < W; i += 8) {
    std::memcpy(&word, p + i, 8);
    if (word != 0x0101010101010101ull) return false;
  }
  return true;
}

template <typename E, bool kBoolMask, int64_t NV>  // NV = D / Vec::size()
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), S = k.size(2), g = H / Hkv, R = g * T;
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

  // the keys past the last one any of row b's query rows sees (a shorter row's padding up to the batch's span) are
  // not read: a decode step over rows of mixed lengths reads each row's own prefix
  auto visible_end = [&](int64_t b) {
    int64_t n = 0;
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t s = S - 1; s >= n; --s) {
        const int64_t m = b * msb + r * msr + s * mss;
        if (kBoolMask ? mb[m] : mf[m] != neg_inf) { n = s + 1; break; }
      }
    }
    return n;
  };

  // one task per (row b, key/value head): each key and value row is converted to fp32 once for all R query rows
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(R * Sp);  // [R, Sp]: scores, then unnormalised probabilities
    std::vector<Vec> qv(R * NV), acc(R * NV);
    std::vector<float> mx(R), total(R);
    std::vector<Vec> mxv(R);  // each row's running maximum score, lane by lane (mx: its largest lane)
    std::vector<Vec> block(W * NV);  // a block of keys, then of values, in fp32
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, hkv = task % Hkv;
      const E* kbase = kp + b * ksb + hkv * ksh;
      const E* vbase = vp + b * vsb + hkv * vsh;
      for (int64_t r = 0; r < R; ++r) {
        const E* qrow = qp + b * qsb + (hkv * g + r / T) * qsh + (r % T) * qst;
        for (int64_t i = 0; i < NV; ++i) qv[r * NV + i] = loadf(qrow + i * Vec::size()) * Vec(scale);
        mxv[r] = Vec(neg_inf);
      }
      const int64_t n = visible_end(b);
      const int64_t np = (n + Vec::size() - 1) / Vec::size() * Vec::size();
      for (int64_t r = 0; r < R; ++r) std::fill_n(&scores[r * Sp], np, neg_inf);  // masked: exp(-inf) = 0

      // scores a block of W keys at a time: per query row, each key's dot product as a vector of partial sums,
      // then one transposing sum turns the block's W vectors into W scores (no horizontal sum per key)
      for (int64_t s0 = 0; s0 < n; s0 += W) {
        const int64_t w = std::min<int64_t>(W, n - s0);
        for (int64_t j = 0; j < w; ++j) {
          const E* krow = kbase + (s0 + j) * kss;
          prefetch(krow + kAhead * kss, D);  // the keys and values ahead: each row's prefix is a short stream
          prefetch(vbase + (s0 + j + kAhead) * vss, D);
          for (int64_t i = 0; i < NV; ++i) block[j * NV + i] = loadf(krow + i * Vec::size());
        }
        for (int64_t r = 0; r < R; ++r) {
          Vec qr[NV];
          for (int64_t i = 0; i < NV; ++i) qr[i] = qv[r * NV + i];
          Vec part[W];
          for (int64_t j = 0; j < w; ++j) {
            const Vec* kj = &block[j * NV];
            Vec dot = qr[0] * kj[0];
            for (int64_t i = 1; i < NV; ++i) dot = at::vec::fmadd(qr[i], kj[i], dot);
            part[j] = dot;
          }
          for (int64_t j = w; j < W; ++j) part[j] = Vec(0.0f);
          const Vec dots = sum_lanes(part);
          float* row = &scores[r * Sp + s0];
          const int64_t m = b * msb + r * msr + s0 * mss;
          if (w == W && mss == 1 && (kBoolMask ? all_true(mb + m) : true)) {  // a whole block, a dense mask row
            Vec score = dots;
            if constexpr (!kBoolMask) {  // an additive bias: -inf stays -inf whatever the dot product
              const Vec bias = Vec::loadu(mf + m);
              score = Vec::blendv(dots + bias, Vec(neg_inf), bias == Vec(neg_inf));
            }
            score.store(row);
            mxv[r] = at::vec::maximum(mxv[r], score);
            continue;
          }
          float d[W];
          dots.store(d);
          for (int64_t j = 0; j < w; ++j) {
            float score = neg_inf;
            if constexpr (kBoolMask) {
              if (mb[m + j * mss]) score = d[j];
            } else {
              if (mf[m + j * mss] != neg_inf) score = d[j] + mf[m + j * mss];
            }
            row[j] = score;
          }
          mxv[r] = at::vec::maximum(mxv[r], Vec::loadu(row));  // (past w: the -inf the row was filled with)
        }
      }
      for (int64_t r = 0; r < R; ++r) mx[r] = mxv[r].reduce_max();

      for (int64_t r = 0; r < R; ++r) {  // exp of every score at once
        float* row = &scores[r * Sp];
        if (mx[r] == neg_inf) { std::fill_n(row, np, 0.0f); total[r] = 0.0f; continue; }
        Vec sum(0.0f);
        for (int64_t s = 0; s < np; s += Vec::size()) {
          const Vec e = (Vec::loadu(row + s) - Vec(mx[r])).exp();
          e.store(row + s);
          sum = sum + e;
        }
        total[r] = sum.reduce_add();
      }

      // the weighted sum of the values, a block of W at a time: each row's accumulators stay in registers
      std::fill(acc.begin(), acc.end(), Vec(0.0f));
      for (int64_t s0 = 0; s0 < n; s0 += W) {
        const int64_t w = std::min<int64_t>(W, n - s0);
        for (int64_t j = 0; j < w; ++j) {
          const E* vrow = vbase + (s0 + j) * vss;
          for (int64_t i = 0; i < NV; ++i) block[j * NV + i] = loadf(vrow + i * Vec::size());
        }
        for (int64_t r = 0; r < R; ++r) {
          const float* p = &scores[r * Sp + s0];
          Vec a[NV];
          for (int64_t i = 0; i < NV; ++i) a[i] = acc[r * NV + i];
          for (int64_t j = 0; j < w; ++j) {
            if (p[j] == 0.0f) continue;
            const Vec pv(p[j]);
            for (int64_t i = 0; i < NV; ++i) a[i] = at::vec::fmadd(pv, block[j * NV + i], a[i]);
          }
          for (int64_t i = 0; i < NV; ++i) acc[r * NV + i] = a[i];
        }
      }

      for (int64_t r = 0; r < R; ++r) {
        const int64_t h = hkv * g + r / T, t = r % T;
        const Vec inv(total[r] > 0.0f ? 1.0f / total[r] : 0.0f);  // a row that sees no key: zeros
        E* orow = op + ((b * T + t) * H + h) * D;
        for (int64_t i = 0; i < NV; ++i) storef(orow + i * Vec::size(), acc[r * NV + i] * inv);
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
  TORCH_CHECK(D % Vec::size() == 0, "decode_attention: head_dim ", D, " is not a multiple of ", Vec::size());
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
    auto go = [&](auto nv) {  // the head's vectors as a constant: a row's accumulators stay in registers
      constexpr int64_t NV = decltype(nv)::value;
      boolean ? run<E, true, NV>(q, keys, values, mask, out) : run<E, false, NV>(q, keys, values, mask, out);
    };
    switch (D / Vec::size()) {
      case 1: go(std::integral_constant<int64_t, 1>{}); break;
      case 2: go(std::integral_constant<int64_t, 2>{}); break;
      case 4: go(std::integral_constant<int64_t, 4>{}); break;
      case 8: go(std::integral_constant<int64_t, 8>{}); break;
      case 16: go(std::integral_constant<int64_t, 16>{}); break;
      default:
        TORCH_CHECK(false, "decode_attention: head_dim ", D, " is not 1, 2, 4, 8 or 16 vectors of ", Vec::size());
    }
  });
  return out.transpose(1, 2);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flexdraft, m) {
  m.def("decode_attention(Tensor q, Tensor keys, Tensor values, Tensor mask) -> Tensor");
}

TORCH_LIBRARY_IMPL(flexdraft, CPU, m) { m.impl("decode_attention", &decode_attention); }
