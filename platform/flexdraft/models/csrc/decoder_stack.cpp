// Every decoder layer of a forward in one call, for decode steps and small verifies on CPU:
//   torch.ops.flexdraft.decoder_stack(x, cos, sin, mask, slots, span, k_cache, v_cache, params, eps, n_heads,
//                                     n_kv_heads, head_dim) -> x after the last layer
// x [B, T, d] bf16 (the embedded tokens); cos, sin, mask, slots and span as `Transformer.forward` makes them;
// k_cache / v_cache: the cache's per-layer [B, Hkv, max_len, D] tensors (written at `slots`); params: 10 per layer,
// input norm, qkv tiles, qkv bias, o tiles, o bias, post-attention norm, gate/up tiles, gate/up bias, down tiles,
// down bias (tiles from amx_pack, biases None where the layer has none).
//
// The body is `DecoderLayer.forward` on the kernels it takes at these sizes, op for op (rms_norm, amx_linear, rope,
// write_kv, decode_attention, add_rms_norm, silu_mul, then the residual add), called through the dispatcher as
// Python calls them, so the result is bitwise the Python loop's. Why: at decode sizes the interpreter's per-op and
// per-module cost was a fifth of a forward (a batch-1 step: 18.2 ms in Python, 14.1 ms here). Built with the AMX
// GEMM; `Transformer.forward` says when it applies (`kernels.use_decoder_stack`).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;
constexpr int64_t PER_LAYER = 10, NB = 32;  // params per layer; outputs per amx_pack block

template <typename Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

Tensor decoder_stack(const Tensor& embedded, const Tensor& cos, const Tensor& sin, const Tensor& mask,
                     const Tensor& slots, int64_t span, const std::vector<Tensor>& k_cache,
                     const std::vector<Tensor>& v_cache, const c10::List<OptTensor>& params, double eps,
                     int64_t H, int64_t Hkv, int64_t D) {
  static const auto rms_norm = op<Tensor(const Tensor&, const Tensor&, double)>("flexdraft::rms_norm");
  static const auto add_rms_norm =
      op<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double)>("flexdraft::add_rms_norm");
  static const auto rope = op<Tensor(const Tensor&, const Tensor&, const Tensor&)>("flexdraft::rope");
  static const auto silu_mul = op<Tensor(const Tensor&)>("flexdraft::silu_mul");
  static const auto write_kv =
      op<void(Tensor&, Tensor&, const Tensor&, const Tensor&, const Tensor&)>("flexdraft::write_kv");
  static const auto attention =
      op<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&)>("flexdraft::decode_attention");
  static const auto linear = op<Tensor(const Tensor&, const Tensor&, const OptTensor&, int64_t)>("flexdraft::amx_linear");

  const int64_t L = static_cast<int64_t>(k_cache.size());
  TORCH_CHECK(embedded.dim() == 3 && embedded.is_contiguous() && static_cast<int64_t>(v_cache.size()) == L &&
                  static_cast<int64_t>(params.size()) == PER_LAYER * L,
              "decoder_stack: x [B, T, d] contiguous, a k and v cache per layer and ", PER_LAYER,
              " params per layer; got x ", embedded.sizes(), ", ", L, " k, ", v_cache.size(), " v, ", params.size(),
              " params");
  const int64_t B = embedded.size(0), T = embedded.size(1), d = embedded.size(2);
  const auto at_ = [&](int64_t l, int64_t i) -> OptTensor { return params.get(l * PER_LAYER + i); };
  Tensor x = embedded;
  for (int64_t l = 0; l < L; ++l) {
    const Tensor down = *at_(l, 8);
    const int64_t intermediate = down.size(1) / NB;  // down's tiles: [blocks of d, I * 32]
    // attention: Attention.project (q, k, v in one GEMM, rope over q's and k's heads at once), the cache write, the
    // decode attention (its output laid out [B, T, H, D]) and o_proj
    const Tensor heads = linear.call(rms_norm.call(x, *at_(l, 0), eps), *at_(l, 1), at_(l, 2), (H + 2 * Hkv) * D)
                             .view({B, T, H + 2 * Hkv, D})
                             .transpose(1, 2);
    const Tensor qk = rope.call(heads.narrow(1, 0, H + Hkv), cos, sin);
    Tensor k_layer = k_cache[l], v_layer = v_cache[l];
    write_kv.call(k_layer, v_layer, slots, qk.narrow(1, H, Hkv), heads.narrow(1, H + Hkv, Hkv));
    const Tensor y = attention.call(qk.narrow(1, 0, H), k_layer.narrow(2, 0, span), v_layer.narrow(2, 0, span), mask);
    const Tensor o = linear.call(y.transpose(1, 2).reshape({B, T, H * D}), *at_(l, 3), at_(l, 4), d);
    // the residual and the norm after it, then the MLP and its residual
    auto [residual, h] = add_rms_norm.call(x, o, *at_(l, 5), eps);
    const Tensor up = linear.call(h, *at_(l, 6), at_(l, 7), 2 * intermediate);
    x = residual + linear.call(silu_mul.call(up), down, at_(l, 9), d);
  }
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flexdraft, m) {
  m.def("decoder_stack(Tensor x, Tensor cos, Tensor sin, Tensor mask, Tensor slots, int span, Tensor[] k_cache, "
        "Tensor[] v_cache, Tensor?[] params, float eps, int n_heads, int n_kv_heads, int head_dim) -> Tensor");
}

TORCH_LIBRARY_IMPL(flexdraft, CPU, m) { m.impl("decoder_stack", &decoder_stack); }
