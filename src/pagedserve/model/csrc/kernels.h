// The C++ CPU kernels' entry points, shared by the files that define them, by decode_layers.cpp,
// which chains them without a dispatch per call, and by ops.cpp, which registers each as a
// torch.ops.pagedserve operator.

#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace pagedserve {

// norm_activation.cpp
at::Tensor rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps);
void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& gate_up);

// packed_linear.cpp
at::Tensor pack_linear_weight(const at::Tensor& weight);
at::Tensor pack_q4_1(const at::Tensor& values, const at::Tensor& scales, const at::Tensor& minima);
at::Tensor pack_q8_0(const at::Tensor& values, const at::Tensor& scales);
at::Tensor pack_q5_0(const at::Tensor& values, const at::Tensor& scales);
at::Tensor pack_q8_min(const at::Tensor& values, const at::Tensor& scales,
                       const at::Tensor& minima);
at::Tensor pack_q5_1(const at::Tensor& values, const at::Tensor& scales, const at::Tensor& minima);
at::Tensor pack_q4_k(const at::Tensor& values, const at::Tensor& d, const at::Tensor& dmin,
                     const at::Tensor& sc, const at::Tensor& m);
at::Tensor pack_q5_k(const at::Tensor& values, const at::Tensor& d, const at::Tensor& dmin,
                     const at::Tensor& sc, const at::Tensor& m);
at::Tensor pack_q6_k(const at::Tensor& values, const at::Tensor& d, const at::Tensor& dmin,
                     const at::Tensor& sc, const at::Tensor& m);
// pack_q4_k's, pack_q6_k's, pack_q4_k_q8's or pack_q6_k_q8's panels straight from a GGUF file's
// Q4_K or Q6_K rows, part after part (a fused map's).
at::Tensor pack_k_quant_blocks(at::TensorList parts, const std::vector<std::string>& types,
                               c10::string_view format);
int64_t packed_in_features(const at::Tensor& packed_weight);  // what its product takes
// Part i of a map packed from a GGUF file's rows: contiguous uint8 [out, blocks * gguf_bytes],
// with the first part's blocks a row (num_blocks, set by part 0).
void check_gguf_part(const char* op, size_t i, const at::Tensor& rows, int64_t gguf_bytes,
                     int64_t& num_blocks);
// A block packer's inputs: values [out, in] of values_type, each header part (scales, minima)
// float16 [out, in / 32]; check_q4_1_inputs adds that the values are 0-15.
void check_block_inputs(const char* op, const at::Tensor& values, at::ScalarType values_type,
                        at::TensorList header_parts);
void check_q4_1_inputs(const char* op, const at::Tensor& values, const at::Tensor& scales,
                       const at::Tensor& minima);
// pack_q4_k's inputs (values 0-15 [out, in], d and dmin float16 [out, in / 256], sc and m uint8
// [out, in / 256, 8]).
void check_q4_k_inputs(const char* op, const at::Tensor& values, const at::Tensor& d,
                       const at::Tensor& dmin, const at::Tensor& sc, const at::Tensor& m);
// pack_q6_k's inputs (values 0-63 [out, in], d and dmin float16 [out, in / 256], sc and m int8
// [out, in / 256, 16]).
void check_q6_k_inputs(const char* op, const at::Tensor& values, const at::Tensor& d,
                       const at::Tensor& dmin, const at::Tensor& sc, const at::Tensor& m);
// One GGUF super-block's header as the packed formats hold it: d and dmin as float16 bits, each
// group's sc and m. A reader writes the block's 256 values apart from it, to `values`, which
// aliases neither the header nor the file's bytes (so that its loops vectorise).
struct SuperBlock {
  uint16_t d, dmin;
  int8_t sc[16], m[16];
};
// A GGUF type's block bytes and its reader into q6_k's groups of 16 (Q6_K, or Q4_K's groups of
// 32 as two each).
using ReadSuperBlock = void (*)(const uint8_t*, SuperBlock&, uint8_t*);
at::Tensor packed_linear(const at::Tensor& input, const at::Tensor& packed_weight,
                         int64_t out_features, const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& scale);

// integer_linear.cpp: packed_linear's product for pack_q4_1_q8, pack_q8_0_q8, pack_q5_0_q8,
// pack_q4_k_q8 and pack_q6_k_q8 results (its input, scale and bias checked by packed_linear;
// bias nullptr or out_features floats)
at::Tensor pack_q4_1_q8(const at::Tensor& values, const at::Tensor& scales,
                        const at::Tensor& minima);
at::Tensor pack_q8_0_q8(const at::Tensor& values, const at::Tensor& scales);
at::Tensor pack_q4_k_q8(const at::Tensor& values, const at::Tensor& d, const at::Tensor& dmin,
                        const at::Tensor& sc, const at::Tensor& m);
// values 0-63, d, dmin, sc and m as pack_q6_k takes them (weight = d * sc * value - dmin * m over
// each group of 16).
at::Tensor pack_q6_k_q8(const at::Tensor& values, const at::Tensor& d, const at::Tensor& dmin,
                        const at::Tensor& sc, const at::Tensor& m);
// values 0-31 and float16 scales as pack_q5_0 takes them (weight = scale * (value - 16)).
at::Tensor pack_q5_0_q8(const at::Tensor& values, const at::Tensor& scales);
// pack_q4_k_q8's or pack_q6_k_q8's blocks straight from a GGUF file's rows ([out][blocks * block
// bytes] uint8), part after part, part i's blocks of readers[i].first bytes read by
// readers[i].second.
at::Tensor pack_q4_k_q8_rows(at::TensorList parts,
                             const std::vector<std::pair<int64_t, ReadSuperBlock>>& readers);
at::Tensor pack_q6_k_q8_rows(at::TensorList parts,
                             const std::vector<std::pair<int64_t, ReadSuperBlock>>& readers);
bool is_integer_blocks(const at::Tensor& packed_weight);  // any one's result, by its shape
int64_t integer_block_inputs(const at::Tensor& packed_weight);  // inputs a block covers
at::Tensor integer_linear(const at::Tensor& input, const at::Tensor& packed_weight,
                          int64_t out_features, const float* bias);

// bf16_linear.cpp: packed_linear's product for pack_bfloat16_bf16 results (its input and bias
// checked by packed_linear; bias nullptr or out_features floats)
at::Tensor pack_bfloat16_bf16(const at::Tensor& weight);
bool is_bfloat16_pairs(const at::Tensor& packed_weight);  // its result, by its shape
at::Tensor bfloat16_pairs_linear(const at::Tensor& input, const at::Tensor& packed_weight,
                                 int64_t out_features, const float* bias);

// rotary_cache.cpp
at::Tensor rotary_and_cache(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                            at::Tensor& k_cache, at::Tensor& v_cache,
                            const at::Tensor& slot_mapping, int64_t num_heads,
                            int64_t num_kv_heads);

// paged_decode.cpp
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale,
                                  int64_t sliding_window);

// row_argmax.cpp
at::Tensor row_argmax(const at::Tensor& values);

// decode_layers.cpp
std::tuple<at::Tensor, at::Tensor> decode_layers(
    at::Tensor& embeddings, const c10::List<std::optional<at::Tensor>>& weights,
    at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& context_lens, int64_t num_heads, int64_t num_kv_heads, double eps,
    double scale, int64_t sliding_window);

// The kernels read rows through raw pointers: each such input must be a dense float32 matrix.
inline void check_float_rows(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kFloat && t.is_contiguous(), op, ": ", name,
              " must be a contiguous 2-D float32 tensor, got ", t.sizes(), " ", t.scalar_type());
}

// packed_linear's check that `count` panels or strips (`units`) of `width` output features each
// hold out_features: more than count - 1 of them, at most count.
inline void check_out_features(int64_t out_features, int64_t count, int64_t width,
                               const char* units) {
  TORCH_CHECK(out_features > (count - 1) * width && out_features <= count * width,
              "packed_linear: out_features ", out_features, " does not fit ", count, " ", units,
              " of ", width);
}

// The integer and bfloat16_bf16 products are written for AVX2 and up: elsewhere they refuse, naming
// what to use instead.
inline void require_avx2([[maybe_unused]] const char* op, [[maybe_unused]] const char* instead) {
#if !defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)
  TORCH_CHECK(false, op, ": ", instead);
#endif
}

}  // namespace pagedserve
