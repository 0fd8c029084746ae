// Every decoder layer of a forward in one call, for decode steps, small verifies and drafter passes on CPU:
//   torch.ops.flexdraft.decoder_stack(x, cos, sin, mask, slots, span, k_cache, v_cache, params, paths, eps,
//                                     n_heads, n_kv_heads, head_dim, first_tuned, tuned_mask, clean, tuned_params,
//                                     tuned_paths) -> x after the last layer
// x [B, T, d] (the embedded tokens); cos, sin, mask, slots and span as `Transformer.forward` makes them; k_cache /
// v_cache: the cache's per-layer [B, Hkv, max_len, D] tensors (written at `slots`); params: 18 per layer, the input
// and post-attention norms' weights, then for the fused q/k/v, o, the fused gate/up and down each: weight, its
// oneDNN-packed copy, its AMX tiles, bias (None where absent); paths: how each of those four GEMMs runs at these
// rows (`Linear.path`: 0 AMX tiles, 1 the packed copy, 2 F.linear on the weight, 3 the bf16 GEMV, 4 one row as
// two through the packed copy). Layers from first_tuned on (-1: none) (`TunedLayers`: a drafter's) read their q/k/v and o
// through paired GEMMs (tuned_params: 8 per layer, q/k/v then o, each weight, packed copy, tiles, bias; tuned_paths
// their 2 paths), keep the target's half at `clean` slots [B, T] and the other's elsewhere, and attend under
// tuned_mask.
//
// The body is `DecoderLayer.forward` on the kernels it takes at these sizes, op for op (rms_norm, the GEMM, rope,
// write_kv, decode_attention, add_rms_norm, silu_mul, then the residual add), called through the dispatcher as
// Python calls them, so the result is bitwise the Python loop's. Why: at decode sizes the interpreter's per-op and
// per-module cost was a fifth of a forward (a batch-1 bf16 step: 18.2 ms in Python, 14.1 ms here).
// `Transformer.forward` says when it applies (`kernels.use_decoder_stack`, `Transformer.stack_paths`).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;
constexpr int64_t PER_LAYER = 18;
constexpr int64_t PER_TUNED = 8;  // a tuned layer's paired q/k/v, then o: weight, packed copy, tiles, bias
enum Path : int64_t { AMX = 0, PACKED = 1, LINEAR = 2, GEMV = 3, PAIR = 4 };

template <typename Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// x [..., K] through one linear layer (p: weight, packed, tiles, bias) the way `Linear.forward` takes `path`; the
// ops are looked up on first use (the AMX and GEMV ones exist only in builds for CPUs that have them)
Tensor linear(const Tensor& x, const OptTensor* p, int64_t path) {
  const Tensor& weight = *p[0];
  const int64_t N = weight.size(0);
  switch (path) {
    case AMX: {
      static const auto amx = op<Tensor(const Tensor&, const Tensor&, const OptTensor&, int64_t)>("flexdraft::amx_linear");
      return amx.call(x, *p[2], p[3], N);
    }
    case PACKED:
    case PAIR: {
      static const auto packed =
          op<Tensor(const Tensor&, const Tensor&, const OptTensor&, c10::string_view, c10::List<std::optional<c10::Scalar>>,
                    std::optional<c10::string_view>)>("mkldnn::_linear_pointwise");
      const auto run = [&](const Tensor& rows) {
        return packed.call(rows, *p[1], p[3], "none", c10::List<std::optional<c10::Scalar>>(), "");
      };
      if (path == PACKED) return run(x);
      const Tensor row = x.reshape({1, x.size(-1)});  // one row as two, then the first (`packed_linear`'s "pair")
      std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
      shape.back() = N;
      return run(at::cat({row, row})).narrow(0, 0, 1).view(shape);
    }
    case LINEAR:
      return at::linear(x, weight, p[3]);
    case GEMV: {
      static const auto gemv = op<Tensor(const Tensor&, const Tensor&, const OptTensor&)>("flexdraft::gemv_bf16");
      return gemv.call(x, weight, p[3]);
    }
    default:
      TORCH_CHECK(false, "decoder_stack: unknown GEMM path ", path);
  }
}

Tensor decoder_stack(const Tensor& embedded, const Tensor& cos, const Tensor& sin, const Tensor& mask,
                     const Tensor& slots, int64_t span, const std::vector<Tensor>& k_cache,
                     const std::vector<Tensor>& v_cache, const c10::List<OptTensor>& params,
                     c10::IntArrayRef paths, double eps, int64_t H, int64_t Hkv, int64_t D, int64_t first_tuned,
                     const OptTensor& tuned_mask, const OptTensor& clean, const c10::List<OptTensor>& tuned_params,
                     c10::IntArrayRef tuned_paths) {
  static const auto rms_norm = op<Tensor(const Tensor&, const Tensor&, double)>("flexdraft::rms_norm");
  static const auto add_rms_norm =
      op<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double)>("flexdraft::add_rms_norm");
  static const auto rope = op<Tensor(const Tensor&, const Tensor&, const Tensor&)>("flexdraft::rope");
  static const auto silu_mul = op<Tensor(const Tensor&)>("flexdraft::silu_mul");
  static const auto write_kv =
      op<void(Tensor&, Tensor&, const Tensor&, const Tensor&, const Tensor&)>("flexdraft::write_kv");
  static const auto attention =
      op<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&)>("flexdraft::decode_attention");

  const int64_t L = static_cast<int64_t>(k_cache.size());
  TORCH_CHECK(embedded.dim() == 3 && embedded.is_contiguous() && static_cast<int64_t>(v_cache.size()) == L &&
                  static_cast<int64_t>(params.size()) == PER_LAYER * L && paths.size() == 4,
              "decoder_stack: x [B, T, d] contiguous, a k and v cache per layer and ", PER_LAYER,
              " params per layer and 4 paths; got x ", embedded.sizes(), ", ", L, " k, ", v_cache.size(), " v, ",
              params.size(), " params");
  const int64_t tuned_layers = first_tuned < 0 ? 0 : L - first_tuned;
  TORCH_CHECK(tuned_layers == 0 || (tuned_mask.has_value() && clean.has_value() && tuned_paths.size() == 2 &&
                                    static_cast<int64_t>(tuned_params.size()) == PER_TUNED * tuned_layers),
              "decoder_stack: tuned layers from ", first_tuned, " need their mask, the clean slots, 2 paths and ",
              PER_TUNED, " params per layer");
  const int64_t B = embedded.size(0), T = embedded.size(1);
  // a paired GEMM's outputs [..., 2n]: the target's half at clean slots, the other set's elsewhere
  const Tensor keep = tuned_layers ? clean->unsqueeze(-1) : Tensor();
  const auto pick = [&](const Tensor& both) {
    const auto halves = both.chunk(2, -1);
    return at::where(keep, halves[0], halves[1]);
  };
  Tensor x = embedded;
  std::vector<OptTensor> p(PER_LAYER), t(PER_TUNED);
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t i = 0; i < PER_LAYER; ++i) p[i] = params.get(l * PER_LAYER + i);
    const OptTensor *qkv = &p[2], *o = &p[6], *gate_up = &p[10], *down = &p[14];
    const bool tuned = tuned_layers && l >= first_tuned;
    if (tuned)
      for (int64_t i = 0; i < PER_TUNED; ++i) t[i] = tuned_params.get((l - first_tuned) * PER_TUNED + i);
    // attention: Attention.project (q, k, v in one GEMM, rope over q's and k's heads at once; a tuned layer's
    // PairedAttention picks each slot's half first), the cache write, the decode attention (its output laid out
    // [B, T, H, D]) and o_proj (a tuned layer's paired, picked after)
    const Tensor normed = rms_norm.call(x, *p[0], eps);
    const Tensor fused = tuned ? pick(linear(normed, &t[0], tuned_paths[0])) : linear(normed, qkv, paths[0]);
    const Tensor heads = fused.view({B, T, H + 2 * Hkv, D}).transpose(1, 2);
    const Tensor qk = rope.call(heads.narrow(1, 0, H + Hkv), cos, sin);
    Tensor k_layer = k_cache[l], v_layer = v_cache[l];
    write_kv.call(k_layer, v_layer, slots, qk.narrow(1, H, Hkv), heads.narrow(1, H + Hkv, Hkv));
    const Tensor y = attention.call(qk.narrow(1, 0, H), k_layer.narrow(2, 0, span), v_layer.narrow(2, 0, span),
                                    tuned ? *tuned_mask : mask);
    const Tensor flat = y.transpose(1, 2).reshape({B, T, H * D});
    const Tensor out = tuned ? pick(linear(flat, &t[4], tuned_paths[1])) : linear(flat, o, paths[1]);
    // the residual and the norm after it, then the MLP and its residual
    auto [residual, h] = add_rms_norm.call(x, out, *p[1], eps);
    x = residual + linear(silu_mul.call(linear(h, gate_up, paths[2])), down, paths[3]);
  }
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flexdraft, m) {
  m.def("decoder_stack(Tensor x, Tensor cos, Tensor sin, Tensor mask, Tensor slots, int span, Tensor[] k_cache, "
        "Tensor[] v_cache, Tensor?[] params, int[] paths, float eps, int n_heads, int n_kv_heads, int head_dim, "
        "int first_tuned, Tensor? tuned_mask, Tensor? clean, Tensor?[] tuned_params, int[] tuned_paths) -> Tensor");
}

TORCH_LIBRARY_IMPL(flexdraft, CPU, m) { m.impl("decoder_stack", &decoder_stack); }

// the oneDNN-packed weights among the params are MkldnnCPU tensors, which dispatch the call here
TORCH_LIBRARY_IMPL(flexdraft, MkldnnCPU, m) { m.impl("decoder_stack", &decoder_stack); }
