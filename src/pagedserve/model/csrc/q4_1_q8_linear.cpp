// Q4_1 weights against 8-bit activations, in integer arithmetic: llama.cpp's way of computing
// its Q4_1 products (against Q8_1 activations) on CPUs without int8 dot-product instructions.
//
// packed_linear's Q4_1 tiles widen every 4-bit value to float32 and spend a multiply-add on it:
// at one row that is 7 instructions per 16 weights, and the product is limited by them as much as
// by the memory it reads. Here each input row is first quantized, group by group (32 inputs), to
// int8 values q with a float32 scale d (x ~ d * q, the group's largest magnitude mapped to 127).
// A group's dot product with a feature's 4-bit values is then exact in integers: vpmaddubsw
// multiplies 32 unsigned values by 32 signed ones and adds adjacent pairs into int16 (at most
// 2 * 15 * 127 each, so eight of them sum without overflow), and vpmaddwd adds those into one
// int32 per feature. That takes about a third of the instructions per weight.
//
// So the product is that of the dequantized weights (scale * value + minimum) with the
// dequantized inputs (d * q). Each output is, per feature f and in this order for every tile
// shape and batch size, so that a row's outputs do not depend on its batch:
//   out[f] = (sum over groups g of (scale[f][g] * d[g]) * dot[f][g])
//          + (sum over groups g of minimum[f][g] * (d[g] * sum of q over g)) + bias[f]
// with each sum a chain of float32 multiply-adds over g in order.
//
// With a third of the instructions, one row is held by the memory more than by arithmetic: see
// prefetch_ahead and work_sharing.h.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "work_sharing.h"

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#define PAGEDSERVE_HAS_AVX2 1
#endif



namespace {

constexpr int64_t kGroup = 32;    // inputs per group, as in Q4_1
constexpr int64_t kFeatures = 8;  // output features per panel: one vector of eight int32 sums
constexpr int64_t kHeaderBytes = 2 * kFeatures * sizeof(at::Half);  // scales, then minima
constexpr int64_t kValueBytes = kFeatures * kGroup / 2;
constexpr int64_t kBlockBytes = kHeaderBytes + kValueBytes;
// Panels are stored in strips of kStrip, the blocks of a strip ordered by group, then panel: a
// thread computes a strip at a time, one row against all of its panels, reading it in order.
constexpr int64_t kStrip = 4;
constexpr int64_t kStripFeatures = kStrip * kFeatures;
// The values of a block (one panel's eight features over one group) are four 32-byte vectors.
// Byte 4 * f + i of vector v holds feature f's value for input 4 * v + i in its low half and for
// input 16 + 4 * v + i in its high half, so that vpmaddubsw meets each feature's four
// consecutive values beside one broadcast of four inputs.
constexpr int64_t kVectors = 4;

#ifdef PAGEDSERVE_HAS_AVX2

// A tile is kTileRows rows against kTilePanels panels: with AVX-512's 32 vector registers, two
// rows against a whole strip hold every sum in registers and unpack each block once for two rows;
// with AVX2's 16, four rows against one panel.
#ifdef __AVX512VL__
constexpr int64_t kTileRows = 2, kTilePanels = kStrip;
#else
constexpr int64_t kTileRows = 4, kTilePanels = 1;
#endif

// Input rows quantized group by group: values, and each group's d and d * (sum of its values).
struct QuantizedRows {
  std::vector<int8_t> values;  // [rows][in]
  std::vector<float> scales;   // [rows][in / kGroup]
  std::vector<float> sums;     // [rows][in / kGroup]
  int64_t groups_per_row;

  const int8_t* group_values(int64_t row, int64_t g) const {
    return values.data() + (row * groups_per_row + g) * kGroup;
  }
};

// d = max |x| / 127 and q = round-half-even(x * (127 / max |x|)), both divisions in float32, as
// the reference in tests/test_kernels.py computes them (the conversion rounds half to even, as the
// CPU's default rounding mode does).
void quantize_group(const float* x, int8_t* values, float& scale, float& sum) {
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  __m256 inputs[4], largest = _mm256_setzero_ps();
  for (int64_t i = 0; i < 4; ++i) {
    inputs[i] = _mm256_loadu_ps(x + 8 * i);
    largest = _mm256_max_ps(largest, _mm256_andnot_ps(sign_bit, inputs[i]));
  }
  __m128 half = _mm_max_ps(_mm256_castps256_ps128(largest), _mm256_extractf128_ps(largest, 1));
  half = _mm_max_ps(half, _mm_movehl_ps(half, half));
  const float group_largest = _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
  scale = group_largest / 127.0f;
  const __m256 inverse = _mm256_set1_ps(group_largest > 0.0f ? 127.0f / group_largest : 0.0f);
  __m256i rounded[4], total = _mm256_setzero_si256();
  for (int64_t i = 0; i < 4; ++i) {
    rounded[i] = _mm256_cvtps_epi32(_mm256_mul_ps(inputs[i], inverse));
    total = _mm256_add_epi32(total, rounded[i]);
  }
  // Packing works within each 128-bit half: the last permutation puts the values back in order.
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(rounded[0], rounded[1]),
                                           _mm256_packs_epi32(rounded[2], rounded[3]));
  const __m256i in_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(values),
                      _mm256_permutevar8x32_epi32(bytes, in_order));
  __m128i sums = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  sums = _mm_hadd_epi32(sums, sums);
  sums = _mm_hadd_epi32(sums, sums);
  sum = scale * static_cast<float>(_mm_cvtsi128_si32(sums));
}

QuantizedRows quantize_rows(const float* x, int64_t rows, int64_t in_features) {
  const int64_t groups = rows * in_features / kGroup;
  QuantizedRows quantized{std::vector<int8_t>(rows * in_features), std::vector<float>(groups),
                          std::vector<float>(groups), in_features / kGroup};
  for (int64_t g = 0; g < groups; ++g) {
    quantize_group(x + g * kGroup, quantized.values.data() + g * kGroup, quantized.scales[g],
                   quantized.sums[g]);
  }
  return quantized;
}

// The int32 dot products of each row's group of inputs with each panel's block (eight features
// a vector): each block's values are unpacked once for all the rows, each row's inputs
// broadcast once for all the panels. The sums are exact in integers, so both ways below give
// the same bits: with AVX-512 VNNI (the build enables it where the CPU has it), vpdpbusd adds
// each feature's four products straight into its int32 lane, low and high halves in separate
// sums so that two chains of them run at once; without it, vpmaddubsw makes int16 pair sums and
// vpmaddwd adds pairs of those.
template <int64_t rows, int64_t panels>
[[gnu::always_inline]] inline void group_dots(const uint8_t* const (&values)[panels],
                                              const int8_t* const (&inputs)[rows],
                                              __m256i (&dots)[rows][panels]) {
  const __m256i low_bits = _mm256_set1_epi8(15);
  __m256i low_sums[rows][panels], high_sums[rows][panels];
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t p = 0; p < panels; ++p) low_sums[m][p] = high_sums[m][p] = _mm256_setzero_si256();
  }
#pragma GCC unroll 4
  for (int64_t v = 0; v < kVectors; ++v) {
    __m256i first[rows], second[rows];
    for (int64_t m = 0; m < rows; ++m) {
      int32_t four;
      std::memcpy(&four, inputs[m] + 4 * v, 4);
      first[m] = _mm256_set1_epi32(four);
      std::memcpy(&four, inputs[m] + 16 + 4 * v, 4);
      second[m] = _mm256_set1_epi32(four);
    }
#pragma GCC unroll 4
    for (int64_t p = 0; p < panels; ++p) {
      const __m256i bytes =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values[p] + 32 * v));
      const __m256i low = _mm256_and_si256(bytes, low_bits);
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low_bits);
#pragma GCC unroll 4
      for (int64_t m = 0; m < rows; ++m) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
        low_sums[m][p] = _mm256_dpbusd_epi32(low_sums[m][p], low, first[m]);
        high_sums[m][p] = _mm256_dpbusd_epi32(high_sums[m][p], high, second[m]);
#else
        low_sums[m][p] = _mm256_add_epi16(low_sums[m][p], _mm256_maddubs_epi16(low, first[m]));
        high_sums[m][p] = _mm256_add_epi16(high_sums[m][p], _mm256_maddubs_epi16(high, second[m]));
#endif
      }
    }
  }
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t p = 0; p < panels; ++p) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
      dots[m][p] = _mm256_add_epi32(low_sums[m][p], high_sums[m][p]);
#else
      dots[m][p] = _mm256_madd_epi16(_mm256_add_epi16(low_sums[m][p], high_sums[m][p]),
                                     _mm256_set1_epi16(1));
#endif
    }
  }
}

__m256 widen_halves(const uint8_t* halves) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(halves)));
}

// One row computes a group's blocks faster than they arrive from memory, and the hardware
// prefetcher alone fell behind: asking for the blocks kPrefetchBytes ahead of those being read
// made the default model's maps at one row 6-8% faster here (640 bytes ahead as fast; reading
// runs on into the next strip of the thread's share, or past the tensor's end, where a prefetch
// reads nothing and cannot fault).
constexpr int64_t kPrefetchBytes = 1024;

[[gnu::always_inline]] inline void prefetch_ahead(const uint8_t* group_blocks) {
  const char* ahead = reinterpret_cast<const char*>(group_blocks) + kPrefetchBytes;
  for (int64_t offset = 0; offset < kStrip * kBlockBytes; offset += 64) {
    _mm_prefetch(ahead + offset, _MM_HINT_T0);
  }
}

// Rows [first_row, first_row + rows) against `panels` consecutive panels of a strip from its
// panel `first`, writing `cols` features of `out` from the first of them. Each block comes from
// memory once for all the rows of the tile.
template <int64_t rows, int64_t panels>
[[gnu::noinline]] void tile(const QuantizedRows& x, int64_t first_row, const uint8_t* strip,
                            int64_t first, int64_t num_groups, const float* bias, float* out,
                            int64_t out_stride, int64_t cols) {
  __m256 dots[rows][panels], minima[rows][panels];
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t p = 0; p < panels; ++p) dots[m][p] = minima[m][p] = _mm256_setzero_ps();
  }
  for (int64_t g = 0; g < num_groups; ++g) {
    if constexpr (rows == 1) prefetch_ahead(strip + g * kStrip * kBlockBytes);
    const uint8_t* blocks[panels];
    const uint8_t* values[panels];
    const int8_t* inputs[rows];
    for (int64_t p = 0; p < panels; ++p) {
      blocks[p] = strip + (g * kStrip + first + p) * kBlockBytes;
      values[p] = blocks[p] + kHeaderBytes;
    }
    for (int64_t m = 0; m < rows; ++m) inputs[m] = x.group_values(first_row + m, g);
    __m256i integer_dots[rows][panels];
    group_dots<rows, panels>(values, inputs, integer_dots);
#pragma GCC unroll 4
    for (int64_t p = 0; p < panels; ++p) {
      const __m256 scale = widen_halves(blocks[p]);
      const __m256 minimum = widen_halves(blocks[p] + kHeaderBytes / 2);
#pragma GCC unroll 4
      for (int64_t m = 0; m < rows; ++m) {
        const int64_t at = (first_row + m) * x.groups_per_row + g;
        const __m256 group_scale = _mm256_mul_ps(scale, _mm256_set1_ps(x.scales[at]));
        dots[m][p] =
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(integer_dots[m][p]), group_scale, dots[m][p]);
        minima[m][p] = _mm256_fmadd_ps(minimum, _mm256_set1_ps(x.sums[at]), minima[m][p]);
      }
    }
  }
  float buffer[panels * kFeatures];
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t p = 0; p < panels; ++p) {
      _mm256_storeu_ps(buffer + p * kFeatures, _mm256_add_ps(dots[m][p], minima[m][p]));
    }
    float* row_out = out + (first_row + m) * out_stride;
    for (int64_t j = 0; j < cols; ++j) row_out[j] = buffer[j] + (bias == nullptr ? 0.0f : bias[j]);
  }
}

// Every row against a strip whose first `cols` features are written (the rest are padding):
// whole tiles, then the rows left over against as many panels at once as make four chains of
// multiply-adds, which hide each other's latency.
void rows_against_strip(const QuantizedRows& x, int64_t num_rows, const uint8_t* strip,
                        int64_t num_groups, const float* bias, float* out, int64_t out_stride,
                        int64_t cols) {
  const auto run = [&](auto tile_function, int64_t tile_panels, int64_t row) {
    for (int64_t p = 0; p < kStrip && p * kFeatures < cols; p += tile_panels) {
      const int64_t feature = p * kFeatures;
      tile_function(x, row, strip, p, num_groups, bias == nullptr ? nullptr : bias + feature,
                    out + feature, out_stride, std::min(tile_panels * kFeatures, cols - feature));
    }
  };
  const int64_t whole_rows = num_rows - num_rows % kTileRows;
  for (int64_t row = 0; row < whole_rows; row += kTileRows) {
    run(tile<kTileRows, kTilePanels>, kTilePanels, row);
  }
  switch (num_rows - whole_rows) {
    case 3: return run(tile<3, 1>, 1, whole_rows);
    case 2: return run(tile<2, 2>, 2, whole_rows);
    case 1: return run(tile<1, kStrip>, kStrip, whole_rows);
    default: return;
  }
}

at::Tensor product(const at::Tensor& x, const at::Tensor& packed_weight, int64_t out_features,
                   const float* bias) {
  const int64_t num_rows = x.size(0), in_features = x.size(1);
  const QuantizedRows quantized = quantize_rows(x.const_data_ptr<float>(), num_rows, in_features);
  at::Tensor out = at::empty({num_rows, out_features}, x.options());
  const uint8_t* blocks = packed_weight.const_data_ptr<uint8_t>();
  const int64_t num_strips = packed_weight.size(0), num_groups = in_features / kGroup;
  pagedserve::share_items(num_strips, [&](pagedserve::SharedItems& strips) {
    for (int64_t s = strips.next(); s >= 0; s = strips.next()) {
      const int64_t feature = s * kStripFeatures;
      rows_against_strip(quantized, num_rows, blocks + s * num_groups * kStrip * kBlockBytes,
                         num_groups, bias == nullptr ? nullptr : bias + feature,
                         out.data_ptr<float>() + feature, out_features,
                         std::min(kStripFeatures, out_features - feature));
    }
  });
  return out;
}

#endif  // PAGEDSERVE_HAS_AVX2

void check_avx2(const char* op) {
#ifndef PAGEDSERVE_HAS_AVX2
  TORCH_CHECK(false, op, ": the q4_1_q8 product needs a CPU with AVX2 (packed weight dtype q4_1 ",
              "computes the same weights in float32 anywhere)");
#endif
}

void check_packed(const at::Tensor& packed, int64_t in_features, int64_t out_features) {
  TORCH_CHECK(packed.is_contiguous() && in_features % kGroup == 0 &&
                  packed.size(1) == in_features / kGroup,
              "packed_linear: packed_weight ", packed.sizes(), " is not a pack_q4_1_q8 result for ",
              in_features, " input features");
  const int64_t strips = packed.size(0);
  TORCH_CHECK(out_features > (strips - 1) * kStripFeatures &&
                  out_features <= strips * kStripFeatures,
              "packed_linear: out_features ", out_features, " does not fit ", strips,
              " strips of ", kStripFeatures);
}

}  // namespace

namespace pagedserve {

// values: [out, in] uint8, 0-15; scales and minima: [out, in / 32] float16 (weight = scale *
// value + minimum), as pagedserve.model.quantization.quantize_q4_1 returns them. Returns uint8
// blocks [strips][in / 32][kStrip][block bytes], each a panel's scales, minima and values over a
// group.
at::Tensor pack_q4_1_q8(const at::Tensor& values, const at::Tensor& scales,
                        const at::Tensor& minima) {
  check_avx2("pack_q4_1_q8");
  check_q4_1_inputs("pack_q4_1_q8", values, scales, minima);
  const int64_t out_features = values.size(0), groups = values.size(1) / kGroup;
  const int64_t strips = (out_features + kStripFeatures - 1) / kStripFeatures;
  const auto padded = [&](const at::Tensor& t) {
    at::Tensor result = at::zeros({strips * kStripFeatures, t.size(1)}, t.options());
    result.narrow(0, 0, out_features).copy_(t);
    return result;
  };
  // [strip][panel][feature][group][half][vector][input]
  //   -> [strip][group][panel][vector][feature][input][half]
  const at::Tensor split = padded(values)
                               .view({strips, kStrip, kFeatures, groups, 2, kVectors, 4})
                               .permute({0, 3, 1, 5, 2, 6, 4});
  const at::Tensor bytes = split.select(6, 0).bitwise_or(split.select(6, 1).mul(16));
  // [strip][panel][feature][group][part] -> [strip][group][panel][part][feature]
  const at::Tensor headers = at::stack({padded(scales), padded(minima)}, 2)
                                 .view({strips, kStrip, kFeatures, groups, 2})
                                 .permute({0, 3, 1, 4, 2})
                                 .contiguous();
  return at::cat({headers.view({strips, groups, kStrip, kHeaderBytes / 2}).view(at::kByte),
                  bytes.reshape({strips, groups, kStrip, kValueBytes})},
                 3);
}

bool is_q4_1_q8(const at::Tensor& packed_weight) {
  return packed_weight.dim() == 4 && packed_weight.scalar_type() == at::kByte &&
         packed_weight.size(2) == kStrip && packed_weight.size(3) == kBlockBytes;
}

at::Tensor q4_1_q8_linear(const at::Tensor& input, const at::Tensor& packed_weight,
                          int64_t out_features, const float* bias) {
  check_avx2("q4_1_q8_linear");
  check_packed(packed_weight, input.size(1), out_features);
#ifdef PAGEDSERVE_HAS_AVX2
  return product(input.contiguous(), packed_weight, out_features, bias);
#else
  return {};
#endif
}

}  // namespace pagedserve
