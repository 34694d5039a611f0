// Every torch.ops.pagedserve operator: its schema, and the CPU function behind it (kernels.h).
// The Python side calls only these names; pagedserve/model/kernels.py builds and loads them.

#include <torch/library.h>

#include "kernels.h"

TORCH_LIBRARY(pagedserve, m) {
  // Attention (paged_decode.cpp) and the rotation with the cache write (rotary_cache.cpp)
  m.def(
      "paged_decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor context_lens, float scale, int sliding_window) -> Tensor");
  m.def(
      "rotary_and_cache(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
      "Tensor(b!) v_cache, Tensor slot_mapping, int num_heads, int num_kv_heads) -> Tensor");
  // Linear maps from packed weights (packed_linear.cpp, integer_linear.cpp, bf16_linear.cpp)
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("pack_q4_1(Tensor values, Tensor scales, Tensor minima) -> Tensor");
  m.def("pack_q4_1_q8(Tensor values, Tensor scales, Tensor minima) -> Tensor");
  m.def("pack_q8_0(Tensor values, Tensor scales) -> Tensor");
  m.def("pack_q8_0_q8(Tensor values, Tensor scales) -> Tensor");
  m.def("pack_q4_k_q8(Tensor values, Tensor d, Tensor dmin, Tensor sc, Tensor m) -> Tensor");
  m.def("pack_q6_k_q8(Tensor values, Tensor d, Tensor dmin, Tensor sc, Tensor m) -> Tensor");
  m.def("pack_q5_0_q8(Tensor values, Tensor scales) -> Tensor");
  m.def("pack_bfloat16_bf16(Tensor weight) -> Tensor");
  m.def("pack_q5_0(Tensor values, Tensor scales) -> Tensor");
  m.def("pack_q8_min(Tensor values, Tensor scales, Tensor minima) -> Tensor");
  m.def("pack_q5_1(Tensor values, Tensor scales, Tensor minima) -> Tensor");
  m.def("pack_q4_k(Tensor values, Tensor d, Tensor dmin, Tensor sc, Tensor m) -> Tensor");
  m.def("pack_q5_k(Tensor values, Tensor d, Tensor dmin, Tensor sc, Tensor m) -> Tensor");
  m.def("pack_q6_k(Tensor values, Tensor d, Tensor dmin, Tensor sc, Tensor m) -> Tensor");
  m.def("pack_k_quant_blocks(Tensor[] parts, str[] types, str format) -> Tensor");
  m.def(
      "packed_linear(Tensor input, Tensor packed_weight, int out_features, Tensor? bias, "
      "Tensor? scale=None) -> Tensor");
  // Norms and the SwiGLU activation (norm_activation.cpp)
  m.def("rms_norm(Tensor input, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  // A decode step's layers in one call (decode_layers.cpp)
  m.def(
      "decode_layers(Tensor(a!) embeddings, Tensor?[] weights, Tensor(b!)[] k_caches, "
      "Tensor(c!)[] v_caches, Tensor cos, Tensor sin, Tensor slot_mapping, Tensor block_tables, "
      "Tensor context_lens, int num_heads, int num_kv_heads, float eps, float scale, "
      "int sliding_window) -> (Tensor, Tensor)");
  // Greedy sampling (row_argmax.cpp)
  m.def("row_argmax(Tensor values) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("paged_decode_attention", &pagedserve::paged_decode_attention);
  m.impl("rotary_and_cache", &pagedserve::rotary_and_cache);
  m.impl("pack_linear_weight", &pagedserve::pack_linear_weight);
  m.impl("pack_q4_1", &pagedserve::pack_q4_1);
  m.impl("pack_q4_1_q8", &pagedserve::pack_q4_1_q8);
  m.impl("pack_q8_0", &pagedserve::pack_q8_0);
  m.impl("pack_q8_0_q8", &pagedserve::pack_q8_0_q8);
  m.impl("pack_q4_k_q8", &pagedserve::pack_q4_k_q8);
  m.impl("pack_q6_k_q8", &pagedserve::pack_q6_k_q8);
  m.impl("pack_q5_0_q8", &pagedserve::pack_q5_0_q8);
  m.impl("pack_bfloat16_bf16", &pagedserve::pack_bfloat16_bf16);
  m.impl("pack_q5_0", &pagedserve::pack_q5_0);
  m.impl("pack_q8_min", &pagedserve::pack_q8_min);
  m.impl("pack_q5_1", &pagedserve::pack_q5_1);
  m.impl("pack_q4_k", &pagedserve::pack_q4_k);
  m.impl("pack_q5_k", &pagedserve::pack_q5_k);
  m.impl("pack_q6_k", &pagedserve::pack_q6_k);
  m.impl("pack_k_quant_blocks", &pagedserve::pack_k_quant_blocks);
  m.impl("packed_linear", &pagedserve::packed_linear);
  m.impl("rms_norm", &pagedserve::rms_norm);
  m.impl("add_rms_norm_", &pagedserve::add_rms_norm_);
  m.impl("silu_and_mul", &pagedserve::silu_and_mul);
  m.impl("decode_layers", &pagedserve::decode_layers);
  m.impl("row_argmax", &pagedserve::row_argmax);
}
