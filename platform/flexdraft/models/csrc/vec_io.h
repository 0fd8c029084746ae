// Float vectors in and out of the model dtypes, for the kernels in this folder: ATen's Vectorized<float> at the level
// kernels.py compiles for (CPU_CAPABILITY), loaded from and stored to float32, bfloat16 or float16.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <tuple>

namespace flexdraft_kernels {

using Vec = at::vec::Vectorized<float>;
template <typename E>
inline Vec loadf(const E* p) {
  if constexpr (std::is_same_v<E, float>) {
    return Vec::loadu(p);
  } else {
    Vec out;
    at::vec::load_to_float<E>(p, out);
    return out;
  }
}

template <typename E>
inline void storef(E* p, const Vec& v) {
  if constexpr (std::is_same_v<E, float>) {
    v.store(p);
  } else {
    at::vec::convert_from_float<E>(v, v).store(p, Vec::size());
  }
}

// rounds to E and back: where the PyTorch ops round an intermediate to the model's dtype
template <typename E>
inline Vec round_to(const Vec& v) {
  if constexpr (std::is_same_v<E, float>) {
    return v;
  } else {
    return std::get<0>(at::vec::convert_to_float<E>(at::vec::convert_from_float<E>(v, v)));
  }
}

// n <= Vec::size() elements (a row's tail): the rest of the vector is zeros, and only n are stored
template <typename E>
inline Vec loadf(const E* p, int64_t n) {
  if (n == Vec::size()) return loadf(p);
  float tmp[Vec::size()] = {};
  for (int64_t i = 0; i < n; ++i) tmp[i] = static_cast<float>(p[i]);
  return Vec::loadu(tmp);
}

template <typename E>
inline void storef(E* p, const Vec& v, int64_t n) {
  if (n == Vec::size()) return storef(p, v);
  float tmp[Vec::size()];
  v.store(tmp);
  for (int64_t i = 0; i < n; ++i) p[i] = static_cast<E>(tmp[i]);  // round to nearest even, as the vector path
}

inline int64_t chunk(int64_t i, int64_t d) { return std::min<int64_t>(Vec::size(), d - i); }

// sum_lanes(part)[j] = the sum of part[j]'s lanes, for the Vec::size() vectors of part: a transpose by shuffles and
// adds, in a fixed order (lane j's sum does not depend on the other vectors)
#if defined(CPU_CAPABILITY_AVX512)
inline __m512 sum_lanes(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit group: (a2i_0+a2i_2, a2i+1_0+a2i+1_2, a2i_1+a2i_3, a2i+1_1+a2i+1_3)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit group: the group's partial sums of vectors 4i .. 4i+3
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)  // groups 0+2 and 1+3 of c[2i], then of c[2i+1]
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88), _mm512_shuffle_f32x4(d[0], d[1], 0xDD));
}
inline Vec sum_lanes(const Vec* part) {
  __m512 a[16];
  for (int i = 0; i < 16; ++i) a[i] = part[i];
  return sum_lanes(a);
}
#elif defined(CPU_CAPABILITY_AVX2)
inline Vec sum_lanes(const Vec* part) {
  __m256 b[4], c[2];
  for (int i = 0; i < 4; ++i) {
    const __m256 x = part[2 * i], y = part[2 * i + 1];
    b[i] = _mm256_add_ps(_mm256_unpacklo_ps(x, y), _mm256_unpackhi_ps(x, y));
  }
  for (int i = 0; i < 2; ++i) {
    const __m256d x = _mm256_castps_pd(b[2 * i]), y = _mm256_castps_pd(b[2 * i + 1]);
    c[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(c[0], c[1], 0x20), _mm256_permute2f128_ps(c[0], c[1], 0x31));
}
#else
inline Vec sum_lanes(const Vec* part) {
  float sums[Vec::size()];
  for (int64_t j = 0; j < Vec::size(); ++j) sums[j] = part[j].reduce_add();
  return Vec::loadu(sums);
}
#endif

// calls f(E{}) for the model dtypes the kernels take
template <typename F>
void dispatch(at::ScalarType dtype, const char* op, F&& f) {
  switch (dtype) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(at::BFloat16{}); break;
    case at::kHalf: f(at::Half{}); break;
    default: TORCH_CHECK(false, op, ": float32, bfloat16 or float16, not ", dtype);
  }
}

}  // namespace flexdraft_kernels
