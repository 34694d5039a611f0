// Every decoder layer of a decode-only step on the CPU, in one call.
//
// At a few decode rows each of a layer's ten kernels takes microseconds, and reaching them from
// Python (eight module calls and ten dispatches per layer) costs about as much again. This op
// runs the same kernels in the same order, called directly, so its result has the same bits as
// the layers run op by op.

#include <ATen/core/List.h>
#include <ATen/ops/zeros_like.h>
#include <ATen/record_function.h>

#include <utility>

#include "kernels.h"

namespace {

using WeightList = c10::List<std::optional<at::Tensor>>;

// Runs a kernel under its operator's name in torch.profiler, as if it had been called op by op,
// so that a step's profile still shows where the time goes.
template <typename Kernel, typename... Args>
auto profiled(const char* name, Kernel&& kernel, Args&&... args) {
  RECORD_FUNCTION(name, c10::ArrayRef<const c10::IValue>{});
  return kernel(std::forward<Args>(args)...);
}

// The order of each layer's weights in decode_layers' list.
enum WeightIndex : int64_t {
  kInputNorm,
  kPostAttentionNorm,
  kQkv,  // each linear map: panels, bias, scale (as packed_linear takes them)
  kOutput = kQkv + 3,
  kGateUp = kOutput + 3,
  kDown = kGateUp + 3,
  kNumWeights = kDown + 3,
};

at::Tensor required(const WeightList& weights, int64_t index) {
  const std::optional<at::Tensor> weight = weights.get(index);
  TORCH_CHECK(weight.has_value(), "decode_layers: weights[", index, "] must be a tensor");
  return *weight;
}

struct LinearWeights {
  at::Tensor panels;
  std::optional<at::Tensor> bias, scale;

  static LinearWeights at(const WeightList& weights, int64_t first) {
    return {required(weights, first), weights.get(first + 1), weights.get(first + 2)};
  }

  at::Tensor operator()(const at::Tensor& x, int64_t out_features) const {
    return profiled("pagedserve::packed_linear", pagedserve::packed_linear, x, panels,
                    out_features, bias, scale);
  }
};

// hidden: the previous layer's output, [sequences, hidden size], not yet added to residual, the
// residual stream; both are updated in place (hidden becomes the input norm's output). Returns
// this layer's output. The layer's weights start at weights[first].
at::Tensor decode_layer(at::Tensor& hidden, at::Tensor& residual, const WeightList& weights,
                        int64_t first, const at::Tensor& cos, const at::Tensor& sin,
                        at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping,
                        const at::Tensor& block_tables, const at::Tensor& context_lens,
                        int64_t num_heads, int64_t num_kv_heads, double eps, double scale,
                        int64_t sliding_window) {
  using namespace pagedserve;
  const int64_t num_rows = hidden.size(0), hidden_size = hidden.size(1), head_dim = cos.size(1);
  profiled("pagedserve::add_rms_norm_", add_rms_norm_, hidden, residual,
           required(weights, first + kInputNorm), eps);
  const at::Tensor qkv = LinearWeights::at(weights, first + kQkv)(
      hidden, (num_heads + 2 * num_kv_heads) * head_dim);
  const at::Tensor query = profiled("pagedserve::rotary_and_cache", rotary_and_cache, qkv, cos,
                                     sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads);
  const at::Tensor attention =
      profiled("pagedserve::paged_decode_attention", paged_decode_attention, query, k_cache,
               v_cache, block_tables, context_lens, scale, sliding_window);
  at::Tensor out = LinearWeights::at(weights, first + kOutput)(
      attention.view({num_rows, num_heads * head_dim}), hidden_size);
  profiled("pagedserve::add_rms_norm_", add_rms_norm_, out, residual,
           required(weights, first + kPostAttentionNorm), eps);
  const LinearWeights down = LinearWeights::at(weights, first + kDown);
  const at::Tensor gate_up =
      LinearWeights::at(weights, first + kGateUp)(out, 2 * packed_in_features(down.panels));
  return down(profiled("pagedserve::silu_and_mul", silu_and_mul, gate_up), hidden_size);
}

}  // namespace

namespace pagedserve {

// embeddings: [sequences, hidden size], each sequence's new token; overwritten, as on the module
// path, where it becomes the residual stream. weights: each layer's two norm weights, then its
// qkv_proj, o_proj, gate_up_proj and down_proj as (panels, bias, scale), layer after layer;
// k_caches and v_caches: each layer's. The other arguments are those of rotary_and_cache and
// paged_decode_attention. Returns (hidden, residual) after the last layer, for the final norm.
std::tuple<at::Tensor, at::Tensor> decode_layers(
    at::Tensor& embeddings, const WeightList& weights, at::TensorList k_caches,
    at::TensorList v_caches, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& context_lens, int64_t num_heads, int64_t num_kv_heads, double eps,
    double scale, int64_t sliding_window) {
  const int64_t num_layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(v_caches.size() == k_caches.size() && weights.size() == num_layers * kNumWeights,
              "decode_layers: ", num_layers, " layers need ", num_layers, " value caches and ",
              num_layers * kNumWeights, " weights, got ", v_caches.size(), " and ",
              weights.size());
  check_float_rows(embeddings, "decode_layers", "embeddings");
  check_float_rows(cos, "decode_layers", "cos");
  at::Tensor hidden = embeddings;
  at::Tensor residual = at::zeros_like(embeddings);  // 0 + hidden is hidden, bit for bit
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    at::Tensor k_cache = k_caches[layer], v_cache = v_caches[layer];
    hidden = decode_layer(hidden, residual, weights, layer * kNumWeights, cos, sin, k_cache,
                          v_cache, slot_mapping, block_tables, context_lens, num_heads,
                          num_kv_heads, eps, scale, sliding_window);
  }
  return {hidden, residual};
}

}  // namespace pagedserve
