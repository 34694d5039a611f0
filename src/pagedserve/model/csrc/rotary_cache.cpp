// Rotary embedding and the KV-cache write of a step's tokens on the CPU, in one pass.
//
// In torch this is about ten small operators per layer (split, chunk, negate, concatenate, two
// products and a sum for the rotation; a copy of the queries; an index_copy_ each for keys and
// values). Here each token's row of the fused qkv product is read once: its query heads are
// rotated into a new tensor, and its key heads, rotated, and value heads go straight to the
// token's cache slot.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "kernels.h"

namespace {

using Vec = at::vec::Vectorized<float>;

// The "rotate half" layout of Llama: x * cos + cat(-second half, first half) * sin.
void rotate(const float* x, const float* cos, const float* sin, int64_t head_dim, float* out) {
  const int64_t half = head_dim / 2;
  int64_t i = 0;
  for (; i + Vec::size() <= half; i += Vec::size()) {
    const Vec first = Vec::loadu(x + i), second = Vec::loadu(x + half + i);
    (first * Vec::loadu(cos + i) - second * Vec::loadu(sin + i)).store(out + i);
    (second * Vec::loadu(cos + half + i) + first * Vec::loadu(sin + half + i)).store(out + half + i);
  }
  for (; i < half; ++i) {
    const float first = x[i], second = x[half + i];
    out[i] = first * cos[i] - second * sin[i];
    out[half + i] = second * cos[half + i] + first * sin[half + i];
  }
}

// n values, rounded to cache_t.
template <typename cache_t>
void store(const float* values, int64_t n, cache_t* out) {
  std::transform(values, values + n, out, [](float x) { return static_cast<cache_t>(x); });
}

// Rotates each token's query heads into `query`, and writes its rotated key heads and its value
// heads to its cache slot, as cache_t (rounded once, from the float32 results, for a narrower
// cache).
template <typename cache_t>
void rotate_and_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                      at::Tensor& k_cache, at::Tensor& v_cache, const int64_t* slots,
                      int64_t num_heads, int64_t num_kv_heads, at::Tensor& query) {
  const int64_t num_tokens = qkv.size(0), head_dim = cos.size(1);
  const int64_t width = qkv.size(1), kv_row = num_kv_heads * head_dim;
  const float* rows = qkv.const_data_ptr<float>();
  const float* cos_data = cos.const_data_ptr<float>();
  const float* sin_data = sin.const_data_ptr<float>();
  float* q_data = query.data_ptr<float>();
  cache_t* k_data = k_cache.data_ptr<cache_t>();
  cache_t* v_data = v_cache.data_ptr<cache_t>();
  const int64_t grain = std::max<int64_t>(1, 4096 / width);
  at::parallel_for(0, num_tokens, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> rotated_keys(std::is_same_v<cache_t, float> ? 0 : kv_row);
    for (int64_t t = begin; t < end; ++t) {
      const float* row = rows + t * width;
      const float* c = cos_data + t * head_dim;
      const float* s = sin_data + t * head_dim;
      for (int64_t h = 0; h < num_heads; ++h)
        rotate(row + h * head_dim, c, s, head_dim, q_data + (t * num_heads + h) * head_dim);
      const float* keys = row + num_heads * head_dim;
      cache_t* key_slot = k_data + slots[t] * kv_row;
      float* rotated = rotated_keys.data();
      if constexpr (std::is_same_v<cache_t, float>) rotated = key_slot;
      for (int64_t h = 0; h < num_kv_heads; ++h)
        rotate(keys + h * head_dim, c, s, head_dim, rotated + h * head_dim);
      if constexpr (!std::is_same_v<cache_t, float>) store(rotated, kv_row, key_slot);
      store(keys + kv_row, kv_row, v_data + slots[t] * kv_row);
    }
  });
}

}  // namespace

namespace pagedserve {

at::Tensor rotary_and_cache(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                            at::Tensor& k_cache, at::Tensor& v_cache,
                            const at::Tensor& slot_mapping, int64_t num_heads,
                            int64_t num_kv_heads) {
  check_float_rows(qkv, "rotary_and_cache", "qkv");
  check_float_rows(cos, "rotary_and_cache", "cos");
  check_float_rows(sin, "rotary_and_cache", "sin");
  const int64_t num_tokens = qkv.size(0), head_dim = cos.size(1);
  TORCH_CHECK(head_dim % 2 == 0 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim,
              "rotary_and_cache: qkv width ", qkv.size(1), " is not ", num_heads, " query and 2 x ",
              num_kv_heads, " KV heads of ", head_dim);
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == num_tokens,
              "rotary_and_cache: cos and sin must be [", num_tokens, ", ", head_dim, "], got ",
              cos.sizes(), " and ", sin.sizes());
  const at::ScalarType cache_type = k_cache.scalar_type();
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.dim() == 4 &&
                  v_cache.scalar_type() == cache_type &&
                  (cache_type == at::kFloat || cache_type == at::kBFloat16 ||
                   cache_type == at::kHalf) &&
                  k_cache.size(2) == num_kv_heads && k_cache.size(3) == head_dim,
              "rotary_and_cache: caches must be contiguous float32, bfloat16 or float16 [blocks, "
              "block_size, ", num_kv_heads, ", ", head_dim, "], got ", k_cache.sizes(), " ",
              cache_type, " and ", v_cache.sizes(), " ", v_cache.scalar_type());
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == num_tokens &&
                  slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "rotary_and_cache: slot_mapping must be int64 of ", num_tokens, " tokens");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "rotary_and_cache: slot ", slots[t],
                " is not in the cache of ", num_slots, " slots");
  }

  at::Tensor query = at::empty({num_tokens, num_heads, head_dim}, qkv.options());
  const auto run = [&](auto cache_value) {
    rotate_and_write<decltype(cache_value)>(qkv, cos, sin, k_cache, v_cache, slots, num_heads,
                                            num_kv_heads, query);
  };
  switch (cache_type) {
    case at::kBFloat16: run(at::BFloat16()); break;
    case at::kHalf: run(at::Half()); break;
    default: run(0.0f);
  }
  return query;
}

}  // namespace pagedserve
