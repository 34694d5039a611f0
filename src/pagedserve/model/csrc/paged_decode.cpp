// Decode attention read straight from the paged KV cache on the CPU.
//
// Each sequence has one query token. Its keys and values are read in place through its block
// table, so no padded copy of the context is made: with a float32 cache the gather that SDPA needs
// costs as much memory traffic as the attention itself. Each task reads whole cache rows (every KV
// head of a token), which lie contiguously inside a block, for a chunk of one sequence's context:
// a long context is split so that a lone sequence keeps every thread reading, and the partial
// results are merged by their softmax maxima and sums (as in flash-decoding). The cache may be
// narrower than float32 queries (--kv-cache-dtype): its rows are widened to float32 as they are
// read, and the arithmetic stays float32.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels.h"

namespace {

using Vec = at::vec::Vectorized<float>;

// Query heads of one KV head whose dot products run interleaved: independent accumulators hide
// the latency of the fused multiply-adds, and each key vector is loaded once for all of them.
constexpr int64_t kHeadsAtOnce = 8;
constexpr int64_t kCacheLine = 64;  // bytes
// The values' sums held in registers at once: heads x vectors of dims, at most 4 x 4 of the 32
// AVX-512 registers or 4 x 2 of AVX2's 16, beside a row's vectors and a weight.
constexpr int64_t kSliceHeads = 4;
constexpr int64_t kSliceVectors = Vec::size() >= 16 ? 4 : 2;
// Rows are prefetched this many tokens ahead: far enough for memory's latency, near enough to
// stay in cache.
constexpr int64_t kAhead = 8;
// Tokens per task. The split depends on the context length alone, so a sequence's result does
// not depend on the rest of the batch or on the number of threads.
constexpr int64_t kChunkTokens = 512;

struct Shape {
  int64_t num_heads, num_kv_heads, head_dim, block_size, table_width;
  int64_t group() const { return num_heads / num_kv_heads; }
  int64_t row() const { return num_kv_heads * head_dim; }  // one token's keys or values
};

// Vec::size() cache values widened to float32 in registers, as the dot products and sums read
// them, rather than each row widened into a buffer first, which would cost a narrower cache the
// time its halved bytes save.
template <typename scalar_t>
Vec load_floats(const scalar_t* source) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return Vec::loadu(source);
  } else if constexpr (at::vec::is_reduced_floating_point_v<scalar_t>) {
    Vec out;
    at::vec::load_to_float(source, out);
    return out;
  } else {
    __at_align__ float values[Vec::size()];
    for (int64_t i = 0; i < Vec::size(); ++i) values[i] = static_cast<float>(source[i]);
    return Vec::loadu(values);
  }
}

// scores[h * stride] = query_h . key for N query heads. N is a template argument so that the
// N accumulators live in registers, which a runtime count would not allow.
template <int64_t N, typename scalar_t>
void dot_heads(const float* query, const scalar_t* key, int64_t head_dim, float* scores,
               int64_t stride) {
  Vec sums[N];
  for (int64_t h = 0; h < N; ++h) sums[h] = Vec(0.f);
  int64_t d = 0;
  for (; d + Vec::size() <= head_dim; d += Vec::size()) {
    const Vec k = load_floats(key + d);
    for (int64_t h = 0; h < N; ++h)
      sums[h] = at::vec::fmadd(Vec::loadu(query + h * head_dim + d), k, sums[h]);
  }
  for (int64_t h = 0; h < N; ++h) {
    float dot = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, sums[h]);
    for (int64_t r = d; r < head_dim; ++r)
      dot += query[h * head_dim + r] * static_cast<float>(key[r]);
    scores[h * stride] = dot;
  }
}

// Kept out of line: inlined into the loop over a chunk's keys, it left a float32 cache 1.15x
// slower to attend over (64 sequences of 300 tokens).
template <typename scalar_t, int64_t... Ns>
[[gnu::noinline]] void dot_heads(int64_t n, std::integer_sequence<int64_t, Ns...>,
                                 const float* query, const scalar_t* key, int64_t head_dim,
                                 float* scores, int64_t stride) {
  ((n == Ns + 1 ? dot_heads<Ns + 1>(query, key, head_dim, scores, stride) : void()), ...);
}

// The same for 1 <= n <= kHeadsAtOnce query heads.
template <typename scalar_t>
void dot_heads(int64_t n, const float* query, const scalar_t* key, int64_t head_dim,
               float* scores, int64_t stride) {
  dot_heads(n, std::make_integer_sequence<int64_t, kHeadsAtOnce>(), query, key, head_dim, scores,
            stride);
}

template <typename scalar_t>
const scalar_t* cache_row(const scalar_t* cache, const int64_t* table, int64_t position,
                          const Shape& shape) {
  const int64_t block = table[position / shape.block_size];
  return cache + (block * shape.block_size + position % shape.block_size) * shape.row();
}

// Asks for the cache lines of `bytes` bytes from `start` ahead of their use.
inline void prefetch_bytes(const char* start, int64_t bytes) {
  for (int64_t offset = 0; offset < bytes; offset += kCacheLine) __builtin_prefetch(start + offset);
}

// out_h[d] += weights[h * stride + i] * value_i[d] for H query heads and V vectors of dims, over
// `count` rows `row` apart from `value` (one block's, at a KV head's dims), in order: the H x V
// sums stay in registers through the block. Heads of one KV head (!own) share each value vector,
// widened once for all H; heads with a KV head each (own: no grouping) read theirs, head_dim
// apart. Row i also prefetches row i of `ahead` (`ahead_rows` rows of `ahead_bytes`; none: null).
template <int64_t H, int64_t V, bool own, typename scalar_t>
void accumulate_rows(const float* weights, int64_t stride, const scalar_t* value, int64_t row,
                     int64_t count, int64_t head_dim, float* out, const char* ahead,
                     int64_t ahead_rows, int64_t ahead_bytes) {
  Vec sums[H][V];
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t v = 0; v < V; ++v) sums[h][v] = Vec::loadu(out + h * head_dim + v * Vec::size());
  }
  for (int64_t i = 0; i < count; ++i, value += row) {
    if (i < ahead_rows) prefetch_bytes(ahead + i * ahead_bytes, ahead_bytes);
    if constexpr (own) {
      for (int64_t h = 0; h < H; ++h) {
        const Vec weight(weights[h * stride + i]);
        for (int64_t v = 0; v < V; ++v) {
          const Vec x = load_floats(value + h * head_dim + v * Vec::size());
          sums[h][v] = at::vec::fmadd(weight, x, sums[h][v]);
        }
      }
    } else {
      Vec x[V];
      for (int64_t v = 0; v < V; ++v) x[v] = load_floats(value + v * Vec::size());
      for (int64_t h = 0; h < H; ++h) {
        const Vec weight(weights[h * stride + i]);
        for (int64_t v = 0; v < V; ++v) sums[h][v] = at::vec::fmadd(weight, x[v], sums[h][v]);
      }
    }
  }
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t v = 0; v < V; ++v) sums[h][v].store(out + h * head_dim + v * Vec::size());
  }
}

template <int64_t V, bool own, typename scalar_t, int64_t... Hs>
void accumulate_rows(int64_t n, std::integer_sequence<int64_t, Hs...>, const float* weights,
                     int64_t stride, const scalar_t* value, int64_t row, int64_t count,
                     int64_t head_dim, float* out, const char* ahead, int64_t ahead_rows,
                     int64_t ahead_bytes) {
  ((n == Hs + 1 ? accumulate_rows<Hs + 1, V, own>(weights, stride, value, row, count, head_dim,
                                                    out, ahead, ahead_rows, ahead_bytes)
                : void()),
   ...);
}

// out ([heads][head_dim]) += the scores' weighted sum of the values from `first` to `end`
// (scores [heads][stride], from `first`), a block at a time: within a block, kSliceHeads query
// heads and up to kSliceVectors vectors of dims at a time, then the dims past the last whole
// vector one by one. Each sum adds the tokens in order, as a head at a time would.
template <typename scalar_t>
void accumulate_values(const float* scores, int64_t stride, const scalar_t* v_cache,
                       const int64_t* table, const Shape& shape, int64_t first, int64_t end,
                       float* out) {
  const int64_t head_dim = shape.head_dim, group = shape.group(), row = shape.row();
  const int64_t whole = head_dim / Vec::size() * Vec::size();
  const int64_t row_bytes = row * static_cast<int64_t>(sizeof(scalar_t));
  const auto heads_at_once = std::make_integer_sequence<int64_t, kSliceHeads>();
  for (int64_t position = first; position < end;) {
    const int64_t count = std::min(shape.block_size - position % shape.block_size, end - position);
    const scalar_t* rows = cache_row(v_cache, table, position, shape);
    // The next block's rows, anywhere in the cache, are fetched while the first slice reads
    // this one's.
    int64_t ahead_rows = std::min(shape.block_size, end - position - count);
    const char* ahead = ahead_rows > 0 ? reinterpret_cast<const char*>(
                                             cache_row(v_cache, table, position + count, shape))
                                       : nullptr;
    const float* weights = scores + position - first;
    // A set of heads: up to kSliceHeads of one KV head's group, or of consecutive KV heads when
    // each head has its own.
    const bool own = group == 1;
    for (int64_t h = 0; h < shape.num_heads;) {
      const int64_t kv = h / group;
      const int64_t heads = std::min(kSliceHeads, (own ? shape.num_heads : (kv + 1) * group) - h);
      for (int64_t d = 0; d < whole;) {
        const int64_t vectors = std::min(kSliceVectors, (whole - d) / Vec::size());
        const int64_t taken = vectors >= 4 ? 4 : vectors >= 2 ? 2 : 1;
        const auto slice = [&](auto v_tag, auto own_tag) {
          accumulate_rows<decltype(v_tag)::value, decltype(own_tag)::value>(
              heads, heads_at_once, weights + h * stride, stride, rows + kv * head_dim + d, row,
              count, head_dim, out + h * head_dim + d, ahead, ahead_rows, row_bytes);
        };
        const auto of_width = [&](auto own_tag) {
          if (taken == 4) {
            slice(std::integral_constant<int64_t, 4>(), own_tag);
          } else if (taken == 2) {
            slice(std::integral_constant<int64_t, 2>(), own_tag);
          } else {
            slice(std::integral_constant<int64_t, 1>(), own_tag);
          }
        };
        own ? of_width(std::true_type()) : of_width(std::false_type());
        ahead_rows = 0;  // one pass prefetches
        d += taken * Vec::size();
      }
      for (int64_t i = 0; i < count; ++i) {
        for (int64_t j = h; j < h + heads; ++j) {
          const scalar_t* value = rows + i * row + (own ? j : kv) * head_dim;
          const float weight = weights[j * stride + i];
          for (int64_t d = whole; d < head_dim; ++d)
            out[j * head_dim + d] += weight * static_cast<float>(value[d]);
        }
      }
      h += heads;
    }
    position += count;
  }
}

// The softmax of n scores before its division: scores become exp(score - max). Returns the max
// and the sum of the exponentials, which merge the chunks of one context.
std::pair<float, float> exponentiate(float* scores, int64_t n) {
  const float max = at::vec::reduce_all<float>(
      [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, scores, n);
  at::vec::map([max](Vec x) { return (x - Vec(max)).exp_u20(); }, scores, scores, n);
  const float sum =
      at::vec::reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, scores, n);
  return {max, sum};
}

void scale_in_place(float* x, float factor, int64_t n) {
  at::vec::map([factor](Vec v) { return v * Vec(factor); }, x, x, n);
}

// Asks for the cache row of `position` ahead of its use. Within a block rows are contiguous and
// the hardware prefetcher follows them, but the next block can be anywhere in the cache.
template <typename scalar_t>
void prefetch_row(const scalar_t* cache, const int64_t* table, int64_t position,
                  const Shape& shape) {
  prefetch_bytes(reinterpret_cast<const char*>(cache_row(cache, table, position, shape)),
                 shape.row() * static_cast<int64_t>(sizeof(scalar_t)));
}

// Buffers of one thread, reused across its tasks.
struct Workspace {
  std::vector<float> query, out, scores;
  std::vector<float> maxima, sums;  // of each head's scores, for a chunk to be merged
};

// One sequence's keys from `first` to `end`, a chunk of its context.
struct Chunk {
  int64_t seq, first, end;
  bool whole;  // the chunk is the whole context: normalised and written to the output directly
};

// Softmax attention over the chunk's keys into work.out, [heads, head_dim]. A whole context is
// normalised; a part keeps its weights unnormalised, with each head's max and sum in
// work.maxima and work.sums for the merge.
template <typename query_t, typename scalar_t>
void attend_chunk(const query_t* query, const scalar_t* k_cache, const scalar_t* v_cache,
                  const int64_t* table, const Chunk& chunk, const Shape& shape, float scale,
                  Workspace& work) {
  const int64_t group = shape.group(), head_dim = shape.head_dim;
  const int64_t first = chunk.first, context_len = chunk.end, count = context_len - first;
  for (int64_t i = 0; i < shape.num_heads * head_dim; ++i)
    work.query[i] = static_cast<float>(query[i]) * scale;
  work.scores.resize(shape.num_heads * count);  // [head][token]
  for (int64_t position = first; position < context_len; ++position) {
    // The value rows are asked for with the keys, so that the value pass finds the chunk in
    // cache: its slices each read one part of every row, which the hardware prefetcher does not
    // follow.
    if (position + kAhead < context_len) {
      prefetch_row(k_cache, table, position + kAhead, shape);
      prefetch_row(v_cache, table, position + kAhead, shape);
    }
    const scalar_t* row = cache_row(k_cache, table, position, shape);
    for (int64_t kv = 0; kv < shape.num_kv_heads; ++kv) {
      const scalar_t* key = row + kv * head_dim;
      for (int64_t h = kv * group; h < (kv + 1) * group; h += kHeadsAtOnce) {
        dot_heads(std::min(kHeadsAtOnce, (kv + 1) * group - h), work.query.data() + h * head_dim,
                  key, head_dim, work.scores.data() + h * count + position - first, count);
      }
    }
  }
  for (int64_t h = 0; h < shape.num_heads; ++h) {
    float* scores = work.scores.data() + h * count;
    const auto [max, sum] = exponentiate(scores, count);
    if (chunk.whole) {
      scale_in_place(scores, 1.f / sum, count);
    } else {
      work.maxima[h] = max;
      work.sums[h] = sum;
    }
  }
  std::fill(work.out.begin(), work.out.end(), 0.f);
  accumulate_values(work.scores.data(), count, v_cache, table, shape, first, context_len,
                    work.out.data());
}

// Splits each sequence's context (its last sliding_window tokens, if above 0) into chunks of
// kChunkTokens.
std::vector<Chunk> split_contexts(const int64_t* lens, int64_t num_seqs, int64_t sliding_window) {
  std::vector<Chunk> chunks;
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t len = lens[seq];
    const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
    const int64_t count = len - first;
    const int64_t num_chunks = (count + kChunkTokens - 1) / kChunkTokens;
    const int64_t size = (count + num_chunks - 1) / num_chunks;  // the chunks as even as can be
    for (int64_t start = first; start < len; start += size)
      chunks.push_back({seq, start, std::min(len, start + size), num_chunks == 1});
  }
  return chunks;
}

// out = the softmax-weighted sum over all of a context's chunks, from each chunk's unnormalised
// output [heads, head_dim] and its heads' maxima and sums.
template <typename scalar_t>
void merge_chunks(const float* outs, const float* maxima, const float* sums, int64_t num_chunks,
                  const Shape& shape, scalar_t* out) {
  const int64_t head_dim = shape.head_dim;
  std::vector<float> merged(head_dim);
  for (int64_t h = 0; h < shape.num_heads; ++h) {
    float max = maxima[h];
    for (int64_t c = 1; c < num_chunks; ++c) max = std::max(max, maxima[c * shape.num_heads + h]);
    float total = 0.f;
    std::fill(merged.begin(), merged.end(), 0.f);
    for (int64_t c = 0; c < num_chunks; ++c) {
      const float weight = std::exp(maxima[c * shape.num_heads + h] - max);
      total += weight * sums[c * shape.num_heads + h];
      const float* part = outs + (c * shape.num_heads + h) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) merged[d] += weight * part[d];
    }
    for (int64_t d = 0; d < head_dim; ++d)
      out[h * head_dim + d] = static_cast<scalar_t>(merged[d] / total);
  }
}

// Every chunk's attention into out (query_t: the query's and the output's dtype; scalar_t: the
// cache's, the same or narrower than float32 queries).
template <typename query_t, typename scalar_t>
void attend_all(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const int64_t* tables, const std::vector<Chunk>& chunks, const Shape& shape,
                double scale, at::Tensor& out) {
  const int64_t num_chunks = static_cast<int64_t>(chunks.size());
  const query_t* q = query.const_data_ptr<query_t>();
  const scalar_t* keys = k_cache.const_data_ptr<scalar_t>();
  const scalar_t* values = v_cache.const_data_ptr<scalar_t>();
  query_t* o = out.data_ptr<query_t>();
  const int64_t per_seq = shape.num_heads * shape.head_dim;
  // Chunks of split contexts: [chunk][head][dim] outputs and [chunk][head] maxima and sums.
  const bool any_split = std::any_of(chunks.begin(), chunks.end(),
                                     [](const Chunk& chunk) { return !chunk.whole; });
  const size_t parts = any_split ? chunks.size() : 0;
  std::vector<float> part_outs(parts * per_seq), part_maxima(parts * shape.num_heads),
      part_sums(parts * shape.num_heads);
  at::parallel_for(0, num_chunks, 1, [&](int64_t begin, int64_t end) {
    Workspace work{std::vector<float>(per_seq), std::vector<float>(per_seq), {},
                   std::vector<float>(shape.num_heads), std::vector<float>(shape.num_heads)};
    for (int64_t i = begin; i < end; ++i) {
      const Chunk& chunk = chunks[i];
      attend_chunk(q + chunk.seq * per_seq, keys, values,
                   tables + chunk.seq * shape.table_width, chunk, shape,
                   static_cast<float>(scale), work);
      if (chunk.whole) {
        std::transform(work.out.begin(), work.out.end(), o + chunk.seq * per_seq,
                       [](float x) { return static_cast<query_t>(x); });
      } else {
        std::copy(work.out.begin(), work.out.end(), part_outs.begin() + i * per_seq);
        std::copy(work.maxima.begin(), work.maxima.end(),
                  part_maxima.begin() + i * shape.num_heads);
        std::copy(work.sums.begin(), work.sums.end(), part_sums.begin() + i * shape.num_heads);
      }
    }
  });
  for (int64_t i = 0; i < num_chunks;) {
    int64_t next = i + 1;
    while (next < num_chunks && chunks[next].seq == chunks[i].seq) ++next;
    if (!chunks[i].whole) {
      merge_chunks(part_outs.data() + i * per_seq, part_maxima.data() + i * shape.num_heads,
                   part_sums.data() + i * shape.num_heads, next - i, shape,
                   o + chunks[i].seq * per_seq);
    }
    i = next;
  }
}

}  // namespace

namespace pagedserve {

// query: [sequences, heads, head_dim]; caches: [blocks, block_size, kv_heads, head_dim];
// block_tables: [sequences, width] int64; context_lens: [sequences] int64, the new token included.
// A sliding_window above 0 keeps each query's last sliding_window keys.
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale,
                                  int64_t sliding_window) {
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4, "query must be 3-d and the caches 4-d");
  TORCH_CHECK(query.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  block_tables.is_contiguous() && context_lens.is_contiguous(),
              "paged_decode_attention needs contiguous tensors");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block_tables and context_lens must be int64");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() &&
                  (query.scalar_type() == k_cache.scalar_type() ||
                   query.scalar_type() == at::kFloat),
              "paged_decode_attention: the caches must share a dtype, and the query must have "
              "it or be float32; got ", query.scalar_type(), " query, ", k_cache.scalar_type(),
              " and ", v_cache.scalar_type(), " caches");
  const Shape shape{query.size(1), k_cache.size(2), query.size(2), k_cache.size(1),
                    block_tables.size(1)};
  TORCH_CHECK(shape.num_heads % shape.num_kv_heads == 0, "heads must divide into KV heads");
  TORCH_CHECK(k_cache.size(3) == shape.head_dim && v_cache.sizes() == k_cache.sizes(),
              "the caches' shape does not match the query's head_dim");
  TORCH_CHECK(block_tables.size(0) == query.size(0) && context_lens.size(0) == query.size(0),
              "block_tables and context_lens need one row per query");
  // The kernel reads wherever the tables point, so every block it will read is checked first.
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  for (int64_t seq = 0; seq < query.size(0); ++seq) {
    TORCH_CHECK(lens[seq] >= 1 && lens[seq] <= shape.table_width * shape.block_size,
                "context length ", lens[seq], " is outside its block table");
    const int64_t* table = tables + seq * shape.table_width;
    for (int64_t i = 0; i < (lens[seq] + shape.block_size - 1) / shape.block_size; ++i)
      TORCH_CHECK(table[i] >= 0 && table[i] < k_cache.size(0), "block ", table[i],
                  " is not in the cache");
  }
  at::Tensor out = at::empty_like(query);
  const std::vector<Chunk> chunks = split_contexts(lens, query.size(0), sliding_window);
  const at::ScalarType cache_type = k_cache.scalar_type();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, cache_type, "paged_decode", [&] {
    if (query.scalar_type() == at::kFloat) {
      attend_all<float, scalar_t>(query, k_cache, v_cache, tables, chunks, shape, scale, out);
    } else {
      attend_all<scalar_t, scalar_t>(query, k_cache, v_cache, tables, chunks, shape, scale, out);
    }
  });
  return out;
}

}  // namespace pagedserve
