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
// It reads each batch row's keys and values up to the last one the row sees (not the batch's span), prefetched ahead.
// Two forms of the score and value passes, each in a fixed summation order, so that a query row's result does not
// depend on which rows or tokens come with it (a verify computes what one-token steps compute):
// - vectors (fp32, fp16, and bf16 without AMX): a block of Vec::size() keys at a time; a block's dot products become
//   scores through one transposing sum (vec_io.h's `sum_lanes`) rather than a horizontal sum per key;
// - AMX tiles (bf16 where the CPU has AMX, FLEXDRAFT_CPU_AMX not 0, head dims in whole tiles of 32): 16 keys at a time,
//   read from the cache as they lie, meet all of a head's query rows in tile products. A 9-token verify's 27 rows
//   per head made the vector form compute-bound (each score a dot product of its own); tiles also beat it at decode.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "vec_io.h"
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "amx.h"
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using namespace flexdraft_kernels;
constexpr int kMaxRows = 64;  // query rows per key/value head (H/Hkv x T): kernels.DECODE_MAX_ROWS
constexpr int64_t kAhead = 16;  // keys (and values) prefetched ahead of the score pass
constexpr int64_t W = Vec::size();  // keys per block of the vector score pass
constexpr int64_t KC = 16;  // keys per AMX tile; each row's scores are padded to whole tiles

// n elements from p on, a cache line at a time, into L1: each row's prefix is a stream too short for the hardware
// prefetcher to ramp up on
template <typename E>
inline void prefetch(const E* p, int64_t n) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t i = 0; i < n * static_cast<int64_t>(sizeof(E)); i += 64) __builtin_prefetch(bytes + i);
}

// whether the W bools at p are all true (a block of keys every one of which the row sees)
inline bool all_true(const bool* p) {
  uint64_t word;
  for (int64_t i = 0; i < W; i += 8) {
    std::memcpy(&word, p + i, 8);
    if (word != 0x0101010101010101ull) return false;
  }
  return true;
}

template <typename T>  // a buffer left uninitialised (what is read of it is written first)
using Buffer = std::unique_ptr<T[]>;

// the vector score pass: rows' raw scores q . k / sqrt(D) over keys 0..n-1 into scores [R, Sp], a block of W keys at
// a time: per query row, each key's dot product as a vector of partial sums, then one transposing sum turns the
// block's W vectors into W scores (no horizontal sum per key); each key converted to fp32 once for all rows
template <typename E, int64_t NV>
void vector_scores(const Vec* qv, int64_t R, const E* kbase, int64_t kss, const E* vbase, int64_t vss, int64_t n,
                   float* scores, int64_t Sp, Vec* block) {
  for (int64_t s0 = 0; s0 < n; s0 += W) {
    const int64_t w = std::min<int64_t>(W, n - s0);
    for (int64_t j = 0; j < w; ++j) {
      const E* krow = kbase + (s0 + j) * kss;
      prefetch(krow + kAhead * kss, NV * W);  // the keys and values ahead: each row's prefix is a short stream
      prefetch(vbase + (s0 + j + kAhead) * vss, NV * W);
      for (int64_t i = 0; i < NV; ++i) block[j * NV + i] = loadf(krow + i * W);
    }
    for (int64_t r = 0; r < R; ++r) {
      Vec part[W];
      for (int64_t j = 0; j < w; ++j) {
        const Vec* kj = &block[j * NV];
        Vec dot = qv[r * NV] * kj[0];
        for (int64_t i = 1; i < NV; ++i) dot = at::vec::fmadd(qv[r * NV + i], kj[i], dot);
        part[j] = dot;
      }
      for (int64_t j = w; j < W; ++j) part[j] = Vec(0.0f);
      sum_lanes(part).store(scores + r * Sp + s0);  // (past n: the mask pass writes -inf)
    }
  }
}

// the vector value pass: acc [R, D] = sum over keys of p [R, Sp] x values, a block of W at a time, each row's
// accumulators in registers
template <typename E, int64_t NV>
void vector_values(const float* p, int64_t R, int64_t Sp, const E* vbase, int64_t vss, int64_t n, float* acc,
                   Vec* block) {
  std::fill_n(acc, R * NV * W, 0.0f);
  for (int64_t s0 = 0; s0 < n; s0 += W) {
    const int64_t w = std::min<int64_t>(W, n - s0);
    for (int64_t j = 0; j < w; ++j) {
      const E* vrow = vbase + (s0 + j) * vss;
      for (int64_t i = 0; i < NV; ++i) block[j * NV + i] = loadf(vrow + i * W);
    }
    for (int64_t r = 0; r < R; ++r) {
      const float* pr = p + r * Sp + s0;
      Vec a[NV];
      for (int64_t i = 0; i < NV; ++i) a[i] = Vec::loadu(acc + (r * NV + i) * W);
      for (int64_t j = 0; j < w; ++j) {
        if (pr[j] == 0.0f) continue;
        const Vec pv(pr[j]);
        for (int64_t i = 0; i < NV; ++i) a[i] = at::vec::fmadd(pv, block[j * NV + i], a[i]);
      }
      for (int64_t i = 0; i < NV; ++i) a[i].store(acc + (r * NV + i) * W);
    }
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define FLEXDRAFT_AMX_ATTENTION 1
// The AMX form: products of bf16 tiles summed in fp32 (keys, values and queries are bf16 already; the probabilities
// are split into two bf16 terms). Each output element is one tile element's sums, independent of the tile's other rows.

// r[j] = row j of a 16 x 16 matrix of 32-bit elements -> r[i] = column i
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane l: (r2i[4l], r2i+1[4l], r2i[4l+1], r2i+1[4l+1]) and the next two
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + m], lane l: column 4l + m of rows 4i .. 4i+3
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int m = 0; m < 4; ++m) {  // column 4l + m: lane l of r[m], r[4 + m], r[8 + m], r[12 + m]
    const __m512i a = _mm512_shuffle_i32x4(r[m], r[4 + m], 0x44), b = _mm512_shuffle_i32x4(r[m], r[4 + m], 0xEE);
    const __m512i c = _mm512_shuffle_i32x4(r[8 + m], r[12 + m], 0x44), d = _mm512_shuffle_i32x4(r[8 + m], r[12 + m], 0xEE);
    t[m] = _mm512_shuffle_i32x4(a, c, 0x88);
    t[4 + m] = _mm512_shuffle_i32x4(a, c, 0xDD);
    t[8 + m] = _mm512_shuffle_i32x4(b, d, 0x88);
    t[12 + m] = _mm512_shuffle_i32x4(b, d, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// rows s0 .. s0+15 of keys or values (row stride rs; n of them exist) as a tile loads them -> (first row, bytes between
// rows): in the cache as they lie, or, where they pass row n, copied into `tail` [16, D] after it zeros (the cache
// may end before 16 more)
inline std::pair<const at::BFloat16*, int64_t> tile_rows(const at::BFloat16* base, int64_t rs, int64_t s0, int64_t n,
                                                         int64_t D, at::BFloat16* tail) {
  if (s0 + 16 <= n) return {base + s0 * rs, rs * 2};
  for (int64_t j = 0; j < 16; ++j) {
    if (s0 + j < n) std::copy_n(base + (s0 + j) * rs, D, tail + j * D);
    else std::fill_n(tail + j * D, D, at::BFloat16(0.f));
  }
  return {tail, D * 2};
}

// the query rows (qbuf [Rp, D] bf16, rows past R zeros) as B tiles, pairs of dims by queries: qt [Rp/16][D/32][16
// pairs of dims][16 queries x 2]
void transpose_queries(const at::BFloat16* qbuf, int64_t Rp, int64_t D, at::BFloat16* qt) {
  for (int64_t q0 = 0; q0 < Rp; q0 += 16) {
    for (int64_t c = 0; c < D / 32; ++c) {
      __m512i r[16];
      for (int64_t j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(qbuf + (q0 + j) * D + c * 32);
      transpose16(r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(qt + ((q0 / 16 * (D / 32) + c) * 16 + i) * 32, r[i]);
    }
  }
}

// raw scores q . k of R query rows (qt of transpose_queries) over keys 0..np-1 (np in whole 16s) into scores [Rp,
// Sp]: per 16 keys, the keys as they lie in the cache (A tiles) meet each tile of queries, and the product [16 keys x
// 16 queries] is transposed into the rows' scores. tail: 16 x D scratch, block: 16 x 16 scratch
void amx_scores(const at::BFloat16* qt, int64_t Rp, int64_t R, int64_t D, const at::BFloat16* kbase, int64_t kss,
                const at::BFloat16* vbase, int64_t vss, int64_t n, int64_t np, float* scores, int64_t Sp,
                at::BFloat16* tail, float* block) {
  const int64_t nc = D / 32;
  for (int64_t s0 = 0; s0 < np; s0 += 16) {
    const auto [keys, stride] = tile_rows(kbase, kss, s0, n, D, tail);
    for (int64_t j = 0; j < 16; ++j) {  // the keys and values ahead: each row's prefix is a short stream
      prefetch(kbase + (s0 + j + kAhead) * kss, D);
      prefetch(vbase + (s0 + j + kAhead) * vss, D);
    }
    for (int64_t q0 = 0; q0 < Rp; q0 += 16) {
      _tile_zero(0);
      for (int64_t c = 0; c < nc; ++c) {
        _tile_loadd(4, keys + c * 32, stride);
        _tile_loadd(5, qt + (q0 / 16 * nc + c) * 512, 64);
        _tile_dpbf16ps(0, 4, 5);
      }
      _tile_stored(0, block, 64);
      __m512i r[16];
      for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(block + j * 16);
      transpose16(r);  // row i: query q0 + i's scores of the 16 keys
      for (int64_t i = 0; i < std::min<int64_t>(16, R - q0); ++i) _mm512_storeu_si512(scores + (q0 + i) * Sp + s0, r[i]);
    }
  }
}

// acc [Rp, D] = p [Rp, Sp] (fp32, R rows) x values 0..np-1 (np in whole 16s). Per tile of 16 query rows and 16 keys,
// the values as they lie in the cache (B tiles: pairs of dims) meet each probability as two bf16 terms (p = hi + lo,
// to 2^-17 of p), once in the even slot of a pair and once in the odd one (the other slot zero), so that the even
// dims' sums and the odd dims' sums accumulate apart (two 32-dim halves at a time: four accumulators). pt: [4][16][32]
// scratch (the A tiles), tail: [16, D], out: [2][16][16]
void amx_values(const float* p, int64_t R, int64_t Rp, int64_t Sp, int64_t np, const at::BFloat16* vbase, int64_t vss,
                int64_t n, int64_t D, float* acc, at::BFloat16* pt, at::BFloat16* tail, float* out) {
  // the even dims' sums e and the odd dims' o of 32 dims -> dims 0-15 (e0 o0 .. e7 o7) and 16-31 (e8 o8 .. e15 o15)
  const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i second = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  const int64_t halves = D / 32;
  for (int64_t q0 = 0; q0 < Rp; q0 += 16) {
    const int64_t rows = std::min<int64_t>(16, R - q0);
    for (int64_t h0 = 0; h0 < halves; h0 += 2) {
      const bool two = h0 + 1 < halves;  // tiles 0, 1: half h0's even and odd dims; 2, 3: half h0 + 1's
      _tile_zero(0);
      _tile_zero(1);
      if (two) {
        _tile_zero(2);
        _tile_zero(3);
      }
      for (int64_t s0 = 0; s0 < np; s0 += 16) {
        for (int64_t r = 0; r < rows; ++r) {  // pt: hi at even slots, lo at even, hi at odd, lo at odd
          const Vec pr = Vec::loadu(p + (q0 + r) * Sp + s0);
          const auto hi = at::vec::convert_from_float<at::BFloat16>(pr, pr);
          const Vec rest = pr - std::get<0>(at::vec::convert_to_float<at::BFloat16>(hi));
          const auto lo = at::vec::convert_from_float<at::BFloat16>(rest, rest);
          const __m512i even_hi = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(__m512i(hi)));
          const __m512i even_lo = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(__m512i(lo)));
          _mm512_storeu_si512(pt + r * 32, even_hi);
          _mm512_storeu_si512(pt + 512 + r * 32, even_lo);
          _mm512_storeu_si512(pt + 1024 + r * 32, _mm512_slli_epi32(even_hi, 16));
          _mm512_storeu_si512(pt + 1536 + r * 32, _mm512_slli_epi32(even_lo, 16));
        }
        const auto [values, stride] = tile_rows(vbase, vss, s0, n, D, tail);
        _tile_loadd(5, values + h0 * 32, stride);
        if (two) _tile_loadd(6, values + (h0 + 1) * 32, stride);
        _tile_loadd(4, pt, 64);
        _tile_dpbf16ps(0, 4, 5);
        if (two) _tile_dpbf16ps(2, 4, 6);
        _tile_loadd(7, pt + 512, 64);
        _tile_dpbf16ps(0, 7, 5);
        if (two) _tile_dpbf16ps(2, 7, 6);
        _tile_loadd(4, pt + 1024, 64);
        _tile_dpbf16ps(1, 4, 5);
        if (two) _tile_dpbf16ps(3, 4, 6);
        _tile_loadd(7, pt + 1536, 64);
        _tile_dpbf16ps(1, 7, 5);
        if (two) _tile_dpbf16ps(3, 7, 6);
      }
      for (int64_t h = h0; h < h0 + (two ? 2 : 1); ++h) {
        if (h == h0) {
          _tile_stored(0, out, 64);
          _tile_stored(1, out + 256, 64);
        } else {
          _tile_stored(2, out, 64);
          _tile_stored(3, out + 256, 64);
        }
        for (int64_t r = 0; r < rows; ++r) {
          const __m512 e = _mm512_loadu_ps(out + r * 16), o = _mm512_loadu_ps(out + 256 + r * 16);
          float* row = acc + (q0 + r) * D + h * 32;
          _mm512_storeu_ps(row, _mm512_permutex2var_ps(e, first, o));
          _mm512_storeu_ps(row + 16, _mm512_permutex2var_ps(e, second, o));
        }
      }
    }
  }
}
#endif

template <typename E, bool kBoolMask, int64_t NV>  // NV = D / Vec::size()
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask, at::Tensor& out,
         bool amx) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), S = k.size(2), g = H / Hkv, R = g * T;
  const int64_t Sp = (S + KC - 1) / KC * KC, Rp = (R + 15) / 16 * 16;
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
  // the vector pass scales the queries, the tiles' raw scores are scaled with the mask
  const float factor = amx ? scale : 1.0f;

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

  // one task per (row b, key/value head), for its R query rows
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    Buffer<float> scores(new float[Rp * Sp]);  // [Rp, Sp]: raw scores, then masked, then unnormalised probabilities
    Buffer<float> acc(new float[Rp * D]);  // [Rp, D]: the weighted sums of the values
    std::vector<float> mx(R), total(R);
    std::vector<Vec> qv(R * NV), block(W * NV);  // the vector passes' scaled queries and a block of keys or values
#ifdef FLEXDRAFT_AMX_ATTENTION
    constexpr bool bf16 = std::is_same_v<E, at::BFloat16>;
    Buffer<at::BFloat16> qbuf, qt;  // the tiles' query rows, then as B tiles (+ scratch: a tail of keys or values)
    alignas(64) at::BFloat16 pt[4 * 512] = {};  // amx_values' A tiles
    alignas(64) float block16[512];  // a tile's product
    if constexpr (bf16) {
      if (amx) {
        configure_tiles();
        qbuf.reset(new at::BFloat16[Rp * D]), qt.reset(new at::BFloat16[Rp * D + 16 * D]);
        std::fill_n(qbuf.get() + R * D, (Rp - R) * D, at::BFloat16(0.f));  // padding rows: finite, never stored
      }
    }
#endif
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, hkv = task % Hkv;
      const E* kbase = kp + b * ksb + hkv * ksh;
      const E* vbase = vp + b * vsb + hkv * vsh;
      const auto qrow = [&](int64_t r) { return qp + b * qsb + (hkv * g + r / T) * qsh + (r % T) * qst; };
      const int64_t n = visible_end(b);
      const int64_t np = (n + KC - 1) / KC * KC;

#ifdef FLEXDRAFT_AMX_ATTENTION
      if constexpr (bf16) {
        if (amx) {
          for (int64_t r = 0; r < R; ++r) std::copy_n(qrow(r), D, qbuf.get() + r * D);
          transpose_queries(qbuf.get(), Rp, D, qt.get());
          amx_scores(qt.get(), Rp, R, D, kbase, kss, vbase, vss, n, np, scores.get(), Sp, qt.get() + Rp * D, block16);
        }
      }
#endif
      if (!amx) {
        for (int64_t r = 0; r < R; ++r)
          for (int64_t i = 0; i < NV; ++i) qv[r * NV + i] = loadf(qrow(r) + i * W) * Vec(scale);
        vector_scores<E, NV>(qv.data(), R, kbase, kss, vbase, vss, n, scores.get(), Sp, block.data());
      }

      // the mask (and the tiles' scale) over each row's raw scores, up to np: -inf where the row does not see the
      // key (exp(-inf) = 0), and each row's maximum
      for (int64_t r = 0; r < R; ++r) {
        float* row = scores.get() + r * Sp;
        Vec mxv(neg_inf);
        for (int64_t s0 = 0; s0 < np; s0 += W) {
          const int64_t m = b * msb + r * msr + s0 * mss;
          Vec score;
          if (s0 + W <= n && mss == 1 && (kBoolMask ? all_true(mb + m) : true)) {  // a whole block, dense mask row
            score = Vec::loadu(row + s0) * Vec(factor);
            if constexpr (!kBoolMask) {  // an additive bias: -inf stays -inf whatever the dot product
              const Vec bias = Vec::loadu(mf + m);
              score = Vec::blendv(score + bias, Vec(neg_inf), bias == Vec(neg_inf));
            }
          } else {
            float d[W];
            for (int64_t j = 0; j < W; ++j) {
              const int64_t s = s0 + j;
              d[j] = neg_inf;
              if (s >= n) continue;
              if constexpr (kBoolMask) {
                if (mb[m + j * mss]) d[j] = row[s] * factor;
              } else {
                if (mf[m + j * mss] != neg_inf) d[j] = row[s] * factor + mf[m + j * mss];
              }
            }
            score = Vec::loadu(d);
          }
          score.store(row + s0);
          mxv = at::vec::maximum(mxv, score);
        }
        mx[r] = mxv.reduce_max();
      }

      for (int64_t r = 0; r < R; ++r) {  // exp of every score at once
        float* row = scores.get() + r * Sp;
        if (mx[r] == neg_inf) { std::fill_n(row, np, 0.0f); total[r] = 0.0f; continue; }
        Vec sum(0.0f);
        for (int64_t s = 0; s < np; s += W) {
          const Vec e = (Vec::loadu(row + s) - Vec(mx[r])).exp();
          e.store(row + s);
          sum = sum + e;
        }
        total[r] = sum.reduce_add();
      }

#ifdef FLEXDRAFT_AMX_ATTENTION
      if constexpr (bf16) {
        if (amx) {
          amx_values(scores.get(), R, Rp, Sp, np, vbase, vss, n, D, acc.get(), pt, qt.get() + Rp * D, block16);
        }
      }
#endif
      if (!amx) vector_values<E, NV>(scores.get(), R, Sp, vbase, vss, n, acc.get(), block.data());

      for (int64_t r = 0; r < R; ++r) {
        const int64_t h = hkv * g + r / T, t = r % T;
        const Vec inv(total[r] > 0.0f ? 1.0f / total[r] : 0.0f);  // a row that sees no key: zeros
        E* orow = op + ((b * T + t) * H + h) * D;
        for (int64_t i = 0; i < NV; ++i) storef(orow + i * W, Vec::loadu(acc.get() + r * D + i * W) * inv);
      }
    }
#ifdef FLEXDRAFT_AMX_ATTENTION
    if (bf16 && amx) _tile_release();
#endif
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
#ifdef FLEXDRAFT_AMX_ATTENTION  // bf16 head dims in whole tiles take AMX where this process may (FLEXDRAFT_CPU_AMX)
  const bool amx = q.scalar_type() == at::kBFloat16 && D % 32 == 0 && amx_wanted();
#else
  const bool amx = false;
#endif
  dispatch(q.scalar_type(), "decode_attention", [&](auto tag) {
    using E = decltype(tag);
    auto go = [&](auto nv) {  // the head's vectors as a constant: a row's accumulators stay in registers
      constexpr int64_t NV = decltype(nv)::value;
      boolean ? run<E, true, NV>(q, keys, values, mask, out, amx) : run<E, false, NV>(q, keys, values, mask, out, amx);
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
