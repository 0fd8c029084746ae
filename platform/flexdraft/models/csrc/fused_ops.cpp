// The decoder layer's elementwise work between its GEMMs, each as one op over all rows (torch.ops.flexdraft.*),
// with the rounding of the PyTorch ops they replace in transformer.py (each intermediate rounded to the model's
// dtype where those round it), so the model computes the same with them or without:
//   rms_norm(x, w, eps)            w * rms_norm(x)                                   (RMSNorm.forward)
//   add_rms_norm(x, r, w, eps)     (x + r, w * rms_norm(x + r))                       (a residual, then a norm)
//   rope(x, cos, sin)              x * cos + roll(x, D/2) * sin                       (apply_rope)
//   silu_mul(gate_up)              silu(gate) * up, gate and up the halves of the last dim (MLP.forward)
//   write_kv(k_cache, v_cache, slots, k, v)   the cache rows at slots [B, T] := k, v [B, Hkv, T, D] (KVCache.write)
// Why: at decode sizes each PyTorch op costs its dispatch, not its arithmetic (~15 of them per layer).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "vec_io.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>

namespace {

using namespace flexdraft_kernels;
constexpr int64_t kGrain = 64;  // rows per thread below which an op runs on one thread (decode: always)

void check_rows(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && x.dim() >= 1, op, ": a contiguous CPU tensor");
}

template <typename E>
void norm_rows(const E* x, const E* w, E* y, int64_t d, float eps) {
  Vec sq(0.0f);
  for (int64_t i = 0; i < d; i += Vec::size()) {
    const Vec v = loadf(x + i, chunk(i, d));
    sq = at::vec::fmadd(v, v, sq);
  }
  const Vec rstd(1.0f / std::sqrt(sq.reduce_add() / static_cast<float>(d) + eps));
  for (int64_t i = 0; i < d; i += Vec::size()) {
    const int64_t n = chunk(i, d);
    storef(y + i, loadf(w + i, n) * round_to<E>(loadf(x + i, n) * rstd), n);
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, "rms_norm");
  const int64_t d = x.size(-1), n = x.numel() / d;
  TORCH_CHECK(w.is_contiguous() && w.numel() == d && w.scalar_type() == x.scalar_type(), "rms_norm: weight [d]");
  at::Tensor y = at::empty_like(x);
  dispatch(x.scalar_type(), "rms_norm", [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t *xp = x.data_ptr<scalar_t>(), *wp = w.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, n, kGrain, [&](int64_t a, int64_t b) {
      for (int64_t r = a; r < b; ++r) norm_rows(xp + r * d, wp, yp + r * d, d, static_cast<float>(eps));
    });
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& r, const at::Tensor& w,
                                                 double eps) {
  check_rows(x, "add_rms_norm");
  TORCH_CHECK(r.sizes() == x.sizes() && r.is_contiguous() && r.scalar_type() == x.scalar_type(),
              "add_rms_norm: x and the residual of one shape");
  const int64_t d = x.size(-1), n = x.numel() / d;
  TORCH_CHECK(w.is_contiguous() && w.numel() == d && w.scalar_type() == x.scalar_type(), "add_rms_norm: weight [d]");
  at::Tensor h = at::empty_like(x), y = at::empty_like(x);
  dispatch(x.scalar_type(), "add_rms_norm", [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t *xp = x.data_ptr<scalar_t>(), *rp = r.data_ptr<scalar_t>(), *wp = w.data_ptr<scalar_t>();
    scalar_t *hp = h.data_ptr<scalar_t>(), *yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, n, kGrain, [&](int64_t a, int64_t b) {
      for (int64_t row = a; row < b; ++row) {
        for (int64_t i = 0; i < d; i += Vec::size()) {
          const int64_t k = chunk(i, d);
          storef(hp + row * d + i, loadf(xp + row * d + i, k) + loadf(rp + row * d + i, k), k);
        }
        norm_rows(hp + row * d, wp, yp + row * d, d, static_cast<float>(eps));
      }
    });
  });
  return {h, y};
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 4 && x.stride(3) == 1, "rope: x [B, H, T, D], its last dim dense");
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3), half = D / 2;
  TORCH_CHECK(D % 2 == 0, "rope: an even head_dim");
  TORCH_CHECK(cos.dim() == 4 && cos.size(0) == B && cos.size(1) == 1 && cos.size(2) == T && cos.size(3) == D &&
                  sin.sizes() == cos.sizes() && cos.stride(3) == 1 && sin.stride(3) == 1 &&
                  cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rope: cos, sin [B, 1, T, D] in x's dtype");
  at::Tensor out = at::empty({B, H, T, D}, x.options());
  dispatch(x.scalar_type(), "rope", [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t *xp = x.data_ptr<scalar_t>(), *cp = cos.data_ptr<scalar_t>(), *sp = sin.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    // tasks in (b, t, h) order: a projection's heads of one token lie side by side, so x is read in memory order
    at::parallel_for(0, B * T * H, kGrain, [&](int64_t a, int64_t e) {
      for (int64_t task = a; task < e; ++task) {
        const int64_t b = task / (T * H), t = (task / H) % T, h = task % H;
        const scalar_t* xr = xp + b * x.stride(0) + h * x.stride(1) + t * x.stride(2);
        const scalar_t* cr = cp + b * cos.stride(0) + t * cos.stride(2);
        const scalar_t* sr = sp + b * sin.stride(0) + t * sin.stride(2);
        scalar_t* o = op + ((b * H + h) * T + t) * D;
        for (int64_t first : {int64_t{0}, half}) {  // each half: roll(x, D/2)[i] = x[i - D/2 mod D]
          const int64_t other = half - first;
          for (int64_t i = first; i < first + half; i += Vec::size()) {
            const int64_t n = chunk(i, first + half);
            const Vec a1 = round_to<scalar_t>(loadf(xr + i, n) * loadf(cr + i, n));
            const Vec a2 = round_to<scalar_t>(loadf(xr + i - first + other, n) * loadf(sr + i, n));
            storef(o + i, a1 + a2, n);
          }
        }
      }
    });
  });
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_mul");
  const int64_t two_i = gate_up.size(-1), I = two_i / 2, n = gate_up.numel() / two_i;
  TORCH_CHECK(two_i % 2 == 0, "silu_mul: gate and up side by side in the last dim");
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = I;
  at::Tensor out = at::empty(shape, gate_up.options());
  dispatch(gate_up.scalar_type(), "silu_mul", [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* gp = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const Vec one(1.0f);
    // exp is most of this op's cost: two threads from ~8k elements
    at::parallel_for(0, n, std::max<int64_t>(1, 8192 / I), [&](int64_t a, int64_t b) {
      for (int64_t row = a; row < b; ++row) {
        const scalar_t *g = gp + row * two_i, *u = g + I;
        for (int64_t i = 0; i < I; i += Vec::size()) {
          const int64_t k = chunk(i, I);
          const Vec gv = loadf(g + i, k);
          const Vec act = round_to<scalar_t>(gv / (one + gv.neg().exp()));  // ATen's silu, in fp32
          storef(op + row * I + i, act * loadf(u + i, k), k);
        }
      }
    });
  });
  return out;
}

void write_kv(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& k,
              const at::Tensor& v) {
  TORCH_CHECK(k_cache.device().is_cpu() && k_cache.dim() == 4 && k.dim() == 4 && slots.dim() == 2,
              "write_kv: caches [B, Hkv, L, D], k, v [B, Hkv, T, D], slots [B, T] on CPU");
  const int64_t B = k.size(0), Hkv = k.size(1), T = k.size(2), D = k.size(3), L = k_cache.size(2);
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v.sizes() == k.sizes() && k_cache.size(0) == B &&
                  k_cache.size(1) == Hkv && k_cache.size(3) == D && slots.size(0) == B && slots.size(1) == T &&
                  slots.scalar_type() == at::kLong,
              "write_kv: caches [B, Hkv, L, D], k, v [B, Hkv, T, D], slots [B, T] int64");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1 &&
                  k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type(),
              "write_kv: dense head dims, one dtype");
  const at::Tensor s = slots.contiguous();
  const int64_t* sp = s.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * T; ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < L, "write_kv: slot ", sp[i], " is outside the cache's ", L, " slots");
  const int64_t bytes = D * k.element_size();
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const auto* kp = static_cast<const char*>(k.data_ptr());
  const auto* vp = static_cast<const char*>(v.data_ptr());
  const int64_t es = k.element_size();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t t = 0; t < T; ++t) {
        const int64_t slot = sp[b * T + t];
        std::memcpy(kc + (b * k_cache.stride(0) + h * k_cache.stride(1) + slot * k_cache.stride(2)) * es,
                    kp + (b * k.stride(0) + h * k.stride(1) + t * k.stride(2)) * es, bytes);
        std::memcpy(vc + (b * v_cache.stride(0) + h * v_cache.stride(1) + slot * v_cache.stride(2)) * es,
                    vp + (b * v.stride(0) + h * v.stride(1) + t * v.stride(2)) * es, bytes);
      }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flexdraft, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("write_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, Tensor k, Tensor v) -> ()");
}

TORCH_LIBRARY_IMPL(flexdraft, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope", &rope);
  m.impl("silu_mul", &silu_mul);
  m.impl("write_kv", &write_kv);
}
