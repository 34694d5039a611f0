// A whole decoder layer of a decode-only step on the CPU, in one call.
//
// At a few decode rows each of a layer's ten kernels takes microseconds, and reaching them from
// Python (eight module calls and ten dispatches per layer) cost as much again: about 2.4 ms of an
// 8.4 ms int8 step at batch 1. This op runs the same kernels in the same order, called directly,
// so its result has the same bits as the layer run op by op.

#include <ATen/core/List.h>
#include <torch/library.h>

#include "kernels.h"

namespace {

using WeightList = c10::List<std::optional<at::Tensor>>;

// The order of decode_layer's weights.
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
  TORCH_CHECK(weight.has_value(), "decode_layer: weights[", index, "] must be a tensor");
  return *weight;
}

struct LinearWeights {
  at::Tensor panels;
  std::optional<at::Tensor> bias, scale;

  static LinearWeights at(const WeightList& weights, int64_t first) {
    return {required(weights, first), weights.get(first + 1), weights.get(first + 2)};
  }

  at::Tensor operator()(const at::Tensor& x, int64_t out_features) const {
    return pagedserve::packed_linear(x, panels, out_features, bias, scale);
  }
};

}  // namespace

namespace pagedserve {

// hidden: the previous layer's output, [sequences, hidden size], not yet added to residual, the
// residual stream; both are updated in place (hidden becomes the input norm's output). Returns
// this layer's output. weights: the two norms' weights, then qkv_proj, o_proj, gate_up_proj and
// down_proj as (panels, bias, scale). The other arguments are paged_decode_attention's and
// rotary_and_cache's: every sequence decodes one token.
at::Tensor decode_layer(at::Tensor& hidden, at::Tensor& residual, const WeightList& weights,
                        const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                        at::Tensor& v_cache, const at::Tensor& slot_mapping,
                        const at::Tensor& block_tables, const at::Tensor& context_lens,
                        int64_t num_heads, int64_t num_kv_heads, double eps, double scale,
                        int64_t sliding_window) {
  TORCH_CHECK(weights.size() == kNumWeights, "decode_layer: weights must hold ", kNumWeights,
              " entries, got ", weights.size());
  check_float_rows(hidden, "decode_layer", "hidden");
  check_float_rows(cos, "decode_layer", "cos");
  const int64_t num_rows = hidden.size(0), hidden_size = hidden.size(1), head_dim = cos.size(1);
  add_rms_norm_(hidden, residual, required(weights, kInputNorm), eps);
  const at::Tensor qkv =
      LinearWeights::at(weights, kQkv)(hidden, (num_heads + 2 * num_kv_heads) * head_dim);
  const at::Tensor query = rotary_and_cache(qkv, cos, sin, k_cache, v_cache, slot_mapping,
                                            num_heads, num_kv_heads);
  const at::Tensor attention = paged_decode_attention(query, k_cache, v_cache, block_tables,
                                                      context_lens, scale, sliding_window);
  at::Tensor out = LinearWeights::at(weights, kOutput)(
      attention.view({num_rows, num_heads * head_dim}), hidden_size);
  add_rms_norm_(out, residual, required(weights, kPostAttentionNorm), eps);
  const LinearWeights down = LinearWeights::at(weights, kDown);
  const at::Tensor gate_up = LinearWeights::at(weights, kGateUp)(out, 2 * down.panels.size(1));
  return down(silu_and_mul(gate_up), hidden_size);
}

}  // namespace pagedserve

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def(
      "decode_layer(Tensor(a!) hidden, Tensor(b!) residual, Tensor?[] weights, Tensor cos, "
      "Tensor sin, Tensor(c!) k_cache, Tensor(d!) v_cache, Tensor slot_mapping, "
      "Tensor block_tables, Tensor context_lens, int num_heads, int num_kv_heads, float eps, "
      "float scale, int sliding_window) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) { m.impl("decode_layer", &pagedserve::decode_layer); }
