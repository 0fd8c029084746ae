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
