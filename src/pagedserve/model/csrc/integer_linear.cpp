// Q4_1 or Q8_0 weights against 8-bit activations, in integer arithmetic: llama.cpp's way of
// computing its Q4_1 and Q8_0 products (against Q8_1 and Q8_0 activations).
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
// Q8_0's signed 8-bit values meet the signed inputs the same way: as unsigned magnitudes against
// inputs carrying the weights' signs (vpsignb), whose pair sums (at most 2 * 128 * 127) fit int16
// one at a time, or, with VNNI, stored offset by 128 (unsigned) and the offset's share,
// 128 * (sum of q over g), taken off the int32 sum. Both give the exact integer dot product.
//
// Q5_0's values (pack_q5_0_q8, weight = scale * (value - 16), value 0-31) meet the inputs as
// Q8_0's offset ones do: the int32 sum less 16 * (sum of q over g).
//
// So the product is that of the dequantized weights (scale * value, + minimum for Q4_1) with the
// dequantized inputs (d * q). Each output is, per feature f and in this order for every tile
// shape and batch size, so that a row's outputs do not depend on its batch:
//   out[f] = (sum over groups g of (scale[f][g] * d[g]) * dot[f][g])
//          + (sum over groups g of minimum[f][g] * (d[g] * sum of q over g))  [Q4_1 only]
//          + bias[f]
// with each sum a chain of float32 multiply-adds over g in order.
//
// Q4_K's super-blocks (pack_q4_k_q8) are Q4_1's groups with scale = d * sc and minimum =
// -(dmin * m), both exact in float32, read from a header per 256 inputs: the same sums.
//
// Q6_K's (pack_q6_k_q8) hold values 0-63 in 6 bits, with an int8 sc and m for each half of a
// group (16 inputs): weight = d * sc * value - dmin * m, GGUF's Q6_K d * sc * (q - 32) with
// dmin = 32 * d and m = sc (Q4_K's groups of 32 as two halves alike, a fused map's parts beside
// Q6_K ones). A group's values, put together from their low four and high two bits, meet its
// inputs as Q8_0's offset ones do, a half at a time; the halves' dot products and input sums are
// weighted by their sc and m in integers:
//   out[f] = (sum over g of (d[f] * d[g]) * (sc_a * dot_a + sc_b * dot_b)[f][g])
//          - (sum over g of (dmin[f] * d[g]) * (m_a * sum_a + m_b * sum_b)[f][g]) + bias[f]
// (a, b: the group's halves; sum: of q over the half), each integer converted to float32 once.
//
// With a third of the instructions, one row is held by the memory more than by arithmetic: see
// prefetch_ahead and work_sharing.h.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "work_sharing.h"

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#define PAGEDSERVE_HAS_AVX2 1
#endif



namespace {

constexpr int64_t kGroup = 32;    // inputs per group, as in Q4_1 and Q8_0
constexpr int64_t kFeatures = 8;  // output features per panel: one vector of eight int32 sums
// Panels are stored in strips of kStrip, the blocks of a strip ordered by group, then panel: a
// thread computes a strip at a time, one row against all of its panels, reading it in order.
constexpr int64_t kStrip = 4;
constexpr int64_t kStripFeatures = kStrip * kFeatures;

// A block is one panel's eight features over one group: their float16 scales (then minima, for
// Q4_1), then their values in 32-byte vectors. Byte 4 * f + i of vector v holds feature f's value
// for input 4 * v + i (Q8_0: offset by 128; Q4_1: in its low half, and for input 16 + 4 * v + i
// in its high half), so that each feature's four consecutive values meet one broadcast of four
// inputs. A Q4_K block is the eight features over a super-block of eight groups: their float16 d,
// then dmin, each group's sc for the eight features, then each group's m (a byte each), and the
// groups' values, each as a Q4_1 block's. A strip's Q4_K blocks over a super-block are stored as
// their four headers, then the values group by group, panel by panel, in the order one row reads
// them.
// A Q6_K block is a panel's eight features over a super-block: their float16 d, then dmin, each
// half-group's sc for the eight features, then each half-group's m (an int8 each), and the groups'
// values: their low four bits as a Q4_1 block's, then two vectors of their high two bits, the
// first for the group's first half, the second for its second: bits 2k and 2k + 1 of byte
// 4 * f + i hold those of feature f's value for input 4 * (4 * half + k) + i. Its strip is laid
// out as Q4_K's. That is 7.1 bits a weight: a byte a value (9.1) is multiplied faster from cache,
// but from memory, where maps this large are read, the fewer bytes are faster.
// kPrefetch: whether a one-row tile asks for blocks ahead (see prefetch_ahead).
struct Q4_1 {
  static constexpr int64_t kHeaderBytes = 2 * kFeatures * sizeof(at::Half), kVectors = 4;
  static constexpr int64_t kGroupsPerBlock = 1;
  static constexpr bool kPrefetch = true;
};
struct Q8_0 {
  static constexpr int64_t kHeaderBytes = kFeatures * sizeof(at::Half), kVectors = 8;
  static constexpr int64_t kGroupsPerBlock = 1;
  static constexpr bool kPrefetch = false;
};
struct Q5_0 {  // the values' low four bits as Q4_1's, then a vector of their fifth bits
  static constexpr int64_t kHeaderBytes = kFeatures * sizeof(at::Half), kVectors = 5;
  static constexpr int64_t kGroupsPerBlock = 1;
  static constexpr bool kPrefetch = true;
};
struct Q4_K {
  static constexpr int64_t kGroupsPerBlock = 8, kVectors = 4;
  static constexpr int64_t kHeaderBytes = 2 * kFeatures * sizeof(at::Half) + 2 * 8 * kFeatures;
  static constexpr bool kPrefetch = true;
};
struct Q6_K {
  static constexpr int64_t kGroupsPerBlock = 8, kVectors = 6;  // stored
  static constexpr int64_t kHeaderBytes = 2 * kFeatures * sizeof(at::Half) + 2 * 16 * kFeatures;
  static constexpr bool kPrefetch = true;
};
template <class Format>
constexpr int64_t kHeaderBytes = Format::kHeaderBytes;
template <class Format>
constexpr int64_t kBlockBytes =
    kHeaderBytes<Format> + Format::kGroupsPerBlock * 32 * Format::kVectors;
// A strip's bytes for one group of inputs (Q4_K: an eighth of its super-block's).
template <class Format>
constexpr int64_t kGroupStripBytes = kStrip * kBlockBytes<Format> / Format::kGroupsPerBlock;

// The header and the values of group g of a strip's panel p (byte_t: uint8_t where they are
// written, const uint8_t where they are read).
template <class Format, typename byte_t>
byte_t* header_of(byte_t* strip, int64_t g, int64_t p) {
  byte_t* blocks = strip + g / Format::kGroupsPerBlock * kStrip * kBlockBytes<Format>;
  if constexpr (Format::kGroupsPerBlock == 1) {
    return blocks + p * kBlockBytes<Format>;
  } else {
    return blocks + p * kHeaderBytes<Format>;
  }
}
template <class Format, typename byte_t>
byte_t* values_of(byte_t* strip, int64_t g, int64_t p) {
  if constexpr (Format::kGroupsPerBlock == 1) {
    return header_of<Format>(strip, g, p) + kHeaderBytes<Format>;
  } else {
    const int64_t within = g % Format::kGroupsPerBlock;
    return strip + g / Format::kGroupsPerBlock * kStrip * kBlockBytes<Format> +
           kStrip * kHeaderBytes<Format> + (within * kStrip + p) * 32 * Format::kVectors;
  }
}
// Each format is told from its blocks' size.
template <class Format, class... Others>
constexpr bool kSizeOfItsOwn = ((kBlockBytes<Format> != kBlockBytes<Others>) && ...);
static_assert(kSizeOfItsOwn<Q4_1, Q8_0, Q5_0, Q4_K, Q6_K> &&
              kSizeOfItsOwn<Q8_0, Q5_0, Q4_K, Q6_K> && kSizeOfItsOwn<Q5_0, Q4_K, Q6_K> &&
              kSizeOfItsOwn<Q4_K, Q6_K>);

#ifdef PAGEDSERVE_HAS_AVX2

// A tile is kTileRows rows against kTilePanels panels: with AVX-512's 32 vector registers, two
// rows against a whole strip hold every sum in registers and unpack each block once for two rows;
// with AVX2's 16, four rows against one panel.
#ifdef __AVX512VL__
constexpr int64_t kTileRows = 2, kTilePanels = kStrip;
#else
constexpr int64_t kTileRows = 4, kTilePanels = 1;
#endif

// Input rows quantized group by group: values, and each group's d, d * (sum of its values),
// that sum and the sum of its first half's values.
struct QuantizedRows {
  std::vector<int8_t> values;  // [rows][in]
  std::vector<float> scales;   // [rows][in / kGroup]
  std::vector<float> sums;     // [rows][in / kGroup]
  std::vector<int32_t> totals;  // [rows][in / kGroup]
  std::vector<int32_t> first_totals;  // [rows][in / kGroup]
  int64_t groups_per_row;

  const int8_t* group_values(int64_t row, int64_t g) const {
    return values.data() + (row * groups_per_row + g) * kGroup;
  }
};

// d = max |x| / 127 and q = round-half-even(x * (127 / max |x|)), both divisions in float32, as
// the reference in tests/test_kernels.py computes them (the conversion rounds half to even, as the
// CPU's default rounding mode does).
int32_t sum_of_lanes(__m256i lanes) {
  __m128i sums = _mm_add_epi32(_mm256_castsi256_si128(lanes), _mm256_extracti128_si256(lanes, 1));
  sums = _mm_hadd_epi32(sums, sums);
  sums = _mm_hadd_epi32(sums, sums);
  return _mm_cvtsi128_si32(sums);
}

void quantize_group(const float* x, int8_t* values, float& scale, float& sum, int32_t& total,
                    int32_t& first_total) {
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
  __m256i rounded[4];
  for (int64_t i = 0; i < 4; ++i) {
    rounded[i] = _mm256_cvtps_epi32(_mm256_mul_ps(inputs[i], inverse));
  }
  // Packing works within each 128-bit half: the last permutation puts the values back in order.
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(rounded[0], rounded[1]),
                                           _mm256_packs_epi32(rounded[2], rounded[3]));
  const __m256i in_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(values),
                      _mm256_permutevar8x32_epi32(bytes, in_order));
  first_total = sum_of_lanes(_mm256_add_epi32(rounded[0], rounded[1]));
  total = first_total + sum_of_lanes(_mm256_add_epi32(rounded[2], rounded[3]));
  sum = scale * static_cast<float>(total);
}

QuantizedRows quantize_rows(const float* x, int64_t rows, int64_t in_features) {
  const int64_t groups = rows * in_features / kGroup;
  QuantizedRows quantized{std::vector<int8_t>(rows * in_features), std::vector<float>(groups),
                          std::vector<float>(groups), std::vector<int32_t>(groups),
                          std::vector<int32_t>(groups), in_features / kGroup};
  for (int64_t g = 0; g < groups; ++g) {
    quantize_group(x + g * kGroup, quantized.values.data() + g * kGroup, quantized.scales[g],
                   quantized.sums[g], quantized.totals[g], quantized.first_totals[g]);
  }
  return quantized;
}

// The int32 dot products of each row's group of inputs with each panel's block (eight features
// a vector): each block's values are unpacked once for all the rows, each row's inputs
// broadcast once for all the panels. The sums are exact in integers, so both ways below give
// the same bits: with AVX-512 VNNI (the build enables it where the CPU has it), vpdpbusd adds
// each feature's four products straight into its int32 lane, in two sums (Q4_1: the low and
// high halves; Q8_0: even and odd vectors) so that two chains of them run at once; without it,
// vpmaddubsw makes int16 pair sums and vpmaddwd adds pairs of those.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define PAGEDSERVE_HAS_VNNI 1
#endif

// Each row's four inputs from `at` of its group, in every int32 lane of a vector.
template <int64_t rows>
[[gnu::always_inline]] inline void broadcast_four(const int8_t* const (&inputs)[rows], int64_t at,
                                                  __m256i (&four_inputs)[rows]) {
  for (int64_t m = 0; m < rows; ++m) {
    int32_t four;
    std::memcpy(&four, inputs[m] + at, 4);
    four_inputs[m] = _mm256_set1_epi32(four);
  }
}

template <int64_t rows, int64_t panels>
[[gnu::always_inline]] inline void group_dots(Q4_1, const uint8_t* const (&values)[panels],
                                              const int8_t* const (&inputs)[rows],
                                              const int32_t* const (&)[rows],
                                              __m256i (&dots)[rows][panels]) {
  const __m256i low_bits = _mm256_set1_epi8(15);
  __m256i low_sums[rows][panels], high_sums[rows][panels];
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t p = 0; p < panels; ++p) low_sums[m][p] = high_sums[m][p] = _mm256_setzero_si256();
  }
#pragma GCC unroll 4
  for (int64_t v = 0; v < Q4_1::kVectors; ++v) {
    __m256i first[rows], second[rows];
    broadcast_four<rows>(inputs, 4 * v, first);
    broadcast_four<rows>(inputs, 16 + 4 * v, second);
#pragma GCC unroll 4
    for (int64_t p = 0; p < panels; ++p) {
      const __m256i bytes =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values[p] + 32 * v));
      const __m256i low = _mm256_and_si256(bytes, low_bits);
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low_bits);
#pragma GCC unroll 4
      for (int64_t m = 0; m < rows; ++m) {
#ifdef PAGEDSERVE_HAS_VNNI
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
#ifdef PAGEDSERVE_HAS_VNNI
      dots[m][p] = _mm256_add_epi32(low_sums[m][p], high_sums[m][p]);
#else
      dots[m][p] = _mm256_madd_epi16(_mm256_add_epi16(low_sums[m][p], high_sums[m][p]),
                                     _mm256_set1_epi16(1));
#endif
    }
  }
}

template <int64_t rows, int64_t panels>
[[gnu::always_inline]] inline void group_dots(Q4_K, const uint8_t* const (&values)[panels],
                                              const int8_t* const (&inputs)[rows],
                                              const int32_t* const (&totals)[rows],
                                              __m256i (&dots)[rows][panels]) {
  group_dots<rows, panels>(Q4_1{}, values, inputs, totals, dots);  // a group's values as Q4_1's
}

template <int64_t rows, int64_t panels>
[[gnu::always_inline]] inline void group_dots(Q8_0, const uint8_t* const (&values)[panels],
                                              const int8_t* const (&inputs)[rows],
                                              const int32_t* const (&totals)[rows],
                                              __m256i (&dots)[rows][panels]) {
  __m256i sums[2][rows][panels];
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t p = 0; p < panels; ++p) sums[0][m][p] = sums[1][m][p] = _mm256_setzero_si256();
  }
#pragma GCC unroll 8
  for (int64_t v = 0; v < Q8_0::kVectors; ++v) {
    __m256i four_inputs[rows];
    broadcast_four<rows>(inputs, 4 * v, four_inputs);
#pragma GCC unroll 4
    for (int64_t p = 0; p < panels; ++p) {
      const __m256i offset =  // value + 128
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values[p] + 32 * v));
#ifdef PAGEDSERVE_HAS_VNNI
#pragma GCC unroll 4
      for (int64_t m = 0; m < rows; ++m) {
        sums[v % 2][m][p] = _mm256_dpbusd_epi32(sums[v % 2][m][p], offset, four_inputs[m]);
      }
#else
      const __m256i signed_values = _mm256_xor_si256(offset, _mm256_set1_epi8(-128));
      const __m256i magnitudes = _mm256_abs_epi8(signed_values);
#pragma GCC unroll 4
      for (int64_t m = 0; m < rows; ++m) {
        const __m256i signed_inputs = _mm256_sign_epi8(four_inputs[m], signed_values);
        const __m256i pairs = _mm256_maddubs_epi16(magnitudes, signed_inputs);
        sums[v % 2][m][p] =
            _mm256_add_epi32(sums[v % 2][m][p], _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
      }
#endif
    }
  }
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t p = 0; p < panels; ++p) {
      dots[m][p] = _mm256_add_epi32(sums[0][m][p], sums[1][m][p]);
#ifdef PAGEDSERVE_HAS_VNNI
      dots[m][p] = _mm256_sub_epi32(dots[m][p], _mm256_set1_epi32(128 * *totals[m]));
#endif
    }
  }
}

// Vector v (0-7) of a group's values (inputs 4 * v to 4 * v + 3 for each feature) from a block's
// stored vectors: their low four bits in Q4_1's nibbles (vector v % 4, the low half for v < 4),
// then their `width` high bits, 8 / width values a byte: vector 4 + v / (8 / width), from bit
// width * (v % (8 / width)), shifted to bit 4. The 16-bit shifts carry bits across bytes only
// into bits the masks clear.
template <int64_t width>
[[gnu::always_inline]] inline __m256i wide_values(const uint8_t* stored, int64_t v) {
  const auto vector = [&](int64_t i) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(stored + 32 * i));
  };
  constexpr int64_t per_byte = 8 / width;
  const __m256i nibbles = v < 4 ? vector(v) : _mm256_srli_epi16(vector(v - 4), 4);
  const __m256i high_bytes = vector(4 + v / per_byte);
  const int64_t shift = 4 - width * (v % per_byte);  // to the left
  const __m256i high = shift > 0   ? _mm256_slli_epi16(high_bytes, shift)
                       : shift < 0 ? _mm256_srli_epi16(high_bytes, -shift)
                                   : high_bytes;
  const __m256i low_bits = _mm256_set1_epi8(15);
  const __m256i high_bits = _mm256_and_si256(high, _mm256_set1_epi8(((1 << width) - 1) << 4));
#ifdef __AVX512VL__  // A & C | B: A the nibbles, B the high bits, C low_bits
  return _mm256_ternarylogic_epi32(nibbles, high_bits, low_bits, (0xF0 & 0xAA) | 0xCC);
#else
  return _mm256_or_si256(_mm256_and_si256(nibbles, low_bits), high_bits);
#endif
}

// Q5_0 and Q6_K: the int32 dot products of each half of a row's group with each panel's values
// of 4 + `width` bits (vectors 0-3: the first half's inputs, 4-7: the second's), one chain of
// sums a half.
template <int64_t width, int64_t rows, int64_t panels>
[[gnu::always_inline]] inline void half_dots(const uint8_t* const (&values)[panels],
                                             const int8_t* const (&inputs)[rows],
                                             __m256i (&halves)[2][rows][panels]) {
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t p = 0; p < panels; ++p) halves[0][m][p] = halves[1][m][p] = _mm256_setzero_si256();
  }
#pragma GCC unroll 8
  for (int64_t v = 0; v < 8; ++v) {
    __m256i four_inputs[rows];
    broadcast_four<rows>(inputs, 4 * v, four_inputs);
#pragma GCC unroll 4
    for (int64_t p = 0; p < panels; ++p) {
      const __m256i bytes = wide_values<width>(values[p], v);
#pragma GCC unroll 4
      for (int64_t m = 0; m < rows; ++m) {
        __m256i& sum = halves[v / 4][m][p];
#ifdef PAGEDSERVE_HAS_VNNI
        sum = _mm256_dpbusd_epi32(sum, bytes, four_inputs[m]);
#else  // pair sums of at most 2 * 63 * 128
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(bytes, four_inputs[m]),
                                                      _mm256_set1_epi16(1)));
#endif
      }
    }
  }
}

template <int64_t rows, int64_t panels>
[[gnu::always_inline]] inline void group_dots(Q5_0, const uint8_t* const (&values)[panels],
                                              const int8_t* const (&inputs)[rows],
                                              const int32_t* const (&totals)[rows],
                                              __m256i (&dots)[rows][panels]) {
  __m256i halves[2][rows][panels];
  half_dots<1, rows, panels>(values, inputs, halves);
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t p = 0; p < panels; ++p) {
      dots[m][p] = _mm256_sub_epi32(_mm256_add_epi32(halves[0][m][p], halves[1][m][p]),
                                    _mm256_set1_epi32(16 * *totals[m]));
    }
  }
}

__m256 widen_halves(const uint8_t* halves) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(halves)));
}

// One row computes a group's blocks faster than they arrive from memory, and the hardware
// prefetcher alone fell behind on Q4_1: asking for the blocks kPrefetchBytes ahead of those being
// read made the default model's maps at one row 6-8% faster (640 bytes ahead as fast; reading
// runs on into the next strip of the thread's share, or past the tensor's end, where a prefetch
// reads nothing and cannot fault). Q8_0's larger blocks read faster without it, at any distance
// from 512 to 8192 bytes. Q4_K reads a super-block's headers, then its groups, so a group's place
// in the strip is near, not at, g * kGroupStripBytes: it asks further ahead.
template <class Format>
constexpr int64_t kPrefetchBytes = Format::kGroupsPerBlock == 1 ? 1024 : 2048;

template <class Format>
[[gnu::always_inline]] inline void prefetch_ahead(const uint8_t* strip, int64_t g) {
  const char* ahead =
      reinterpret_cast<const char*>(strip) + g * kGroupStripBytes<Format> + kPrefetchBytes<Format>;
  for (int64_t offset = 0; offset < kGroupStripBytes<Format>; offset += 64) {
    _mm_prefetch(ahead + offset, _MM_HINT_T0);
  }
}

// Eight features' scales (part 0) or minima (part 1) of group `within` of a block, whose
// header's d (part 0) or dmin (part 1) are `widened` (Q4_K; unused for the others).
template <class Format>
__m256 group_vector(const uint8_t* header, int64_t within, int64_t part, __m256 widened) {
  if constexpr (std::is_same_v<Format, Q4_K>) {  // d * sc, -(dmin * m)
    const uint8_t* bytes =
        header + 2 * kFeatures * sizeof(at::Half) + (part * 8 + within) * kFeatures;
    const __m256 factor = _mm256_cvtepi32_ps(
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes))));
    const __m256 product = _mm256_mul_ps(widened, factor);
    return part == 0 ? product : _mm256_sub_ps(_mm256_setzero_ps(), product);
  } else {
    return widen_halves(header + part * kFeatures * sizeof(at::Half));
  }
}

// Rows [first_row, first_row + rows) against `panels` consecutive panels of a strip from its
// panel `first`, writing `cols` features of `out` from the first of them. Each block comes from
// memory once for all the rows of the tile.
template <class Format, int64_t rows, int64_t panels>
[[gnu::noinline]] void tile(const QuantizedRows& x, int64_t first_row, const uint8_t* strip,
                            int64_t first, int64_t num_groups, const float* bias, float* out,
                            int64_t out_stride, int64_t cols) {
  constexpr bool with_minima = !std::is_same_v<Format, Q8_0> && !std::is_same_v<Format, Q5_0>;
  __m256 dots[rows][panels], minima[rows][panels];
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t p = 0; p < panels; ++p) dots[m][p] = minima[m][p] = _mm256_setzero_ps();
  }
  constexpr int64_t per_block = Format::kGroupsPerBlock;
  // Q4_K: each panel's d and dmin, widened once a super-block. Widened every group, they held
  // 1.1B's gate and up maps at one row to 21 GB/s from memory, against 28 GB/s so (2 threads, Zen
  // 4; Q4_1's 28.7 GB/s).
  __m256 widened[2][panels] = {};
  for (int64_t g = 0; g < num_groups; ++g) {
    if constexpr (rows == 1 && Format::kPrefetch) prefetch_ahead<Format>(strip, g);
    const int64_t within = g % per_block;
    if (per_block > 1 && within == 0) {
      for (int64_t p = 0; p < panels; ++p) {
        const uint8_t* header = header_of<Format>(strip, g, first + p);
        widened[0][p] = widen_halves(header);
        widened[1][p] = widen_halves(header + kFeatures * sizeof(at::Half));
      }
    }
    const uint8_t* blocks[panels];
    const uint8_t* values[panels];
    const int8_t* inputs[rows];
    const int32_t* totals[rows];
    for (int64_t p = 0; p < panels; ++p) {
      blocks[p] = header_of<Format>(strip, g, first + p);
      values[p] = values_of<Format>(strip, g, first + p);
    }
    for (int64_t m = 0; m < rows; ++m) {
      inputs[m] = x.group_values(first_row + m, g);
      totals[m] = &x.totals[(first_row + m) * x.groups_per_row + g];
    }
    if constexpr (std::is_same_v<Format, Q6_K>) {
      __m256i halves[2][rows][panels];
      half_dots<2, rows, panels>(values, inputs, halves);
#pragma GCC unroll 4
      for (int64_t p = 0; p < panels; ++p) {
        // The halves' sc (and m): int8 for the eight features, half-groups 2 * within and 2 *
        // within + 1.
        const uint8_t* sc = blocks[p] + 2 * kFeatures * sizeof(at::Half) + 2 * within * kFeatures;
        const auto widened_bytes = [](const uint8_t* bytes) {
          return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
        };
        const __m256i sc_a = widened_bytes(sc), sc_b = widened_bytes(sc + kFeatures);
        const __m256i m_a = widened_bytes(sc + 16 * kFeatures);
        const __m256i m_b = widened_bytes(sc + 17 * kFeatures);
#pragma GCC unroll 4
        for (int64_t m = 0; m < rows; ++m) {
          const int64_t at = (first_row + m) * x.groups_per_row + g;
          const int32_t first = x.first_totals[at], second = x.totals[at] - first;
          const __m256i weighted = _mm256_add_epi32(_mm256_mullo_epi32(halves[0][m][p], sc_a),
                                                    _mm256_mullo_epi32(halves[1][m][p], sc_b));
          const __m256i offsets =
              _mm256_add_epi32(_mm256_mullo_epi32(m_a, _mm256_set1_epi32(first)),
                               _mm256_mullo_epi32(m_b, _mm256_set1_epi32(second)));
          const __m256 d = _mm256_set1_ps(x.scales[at]);
          dots[m][p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(weighted),
                                       _mm256_mul_ps(widened[0][p], d), dots[m][p]);
          minima[m][p] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(offsets),
                                          _mm256_mul_ps(widened[1][p], d), minima[m][p]);
        }
      }
    } else {
      __m256i integer_dots[rows][panels];
      group_dots<rows, panels>(Format{}, values, inputs, totals, integer_dots);
#pragma GCC unroll 4
      for (int64_t p = 0; p < panels; ++p) {
        const __m256 scale = group_vector<Format>(blocks[p], within, 0, widened[0][p]);
        const __m256 minimum = with_minima
                                   ? group_vector<Format>(blocks[p], within, 1, widened[1][p])
                                   : _mm256_setzero_ps();
#pragma GCC unroll 4
        for (int64_t m = 0; m < rows; ++m) {
          const int64_t at = (first_row + m) * x.groups_per_row + g;
          const __m256 group_scale = _mm256_mul_ps(scale, _mm256_set1_ps(x.scales[at]));
          dots[m][p] =
              _mm256_fmadd_ps(_mm256_cvtepi32_ps(integer_dots[m][p]), group_scale, dots[m][p]);
          if constexpr (with_minima) {
            minima[m][p] = _mm256_fmadd_ps(minimum, _mm256_set1_ps(x.sums[at]), minima[m][p]);
          }
        }
      }
    }
  }
  float buffer[panels * kFeatures];
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t p = 0; p < panels; ++p) {
      _mm256_storeu_ps(buffer + p * kFeatures,
                       with_minima ? _mm256_add_ps(dots[m][p], minima[m][p]) : dots[m][p]);
    }
    float* row_out = out + (first_row + m) * out_stride;
    for (int64_t j = 0; j < cols; ++j) row_out[j] = buffer[j] + (bias == nullptr ? 0.0f : bias[j]);
  }
}

// Every row against a strip whose first `cols` features are written (the rest are padding):
// whole tiles, then the rows left over against as many panels at once as make four chains of
// multiply-adds, which hide each other's latency.
template <class Format>
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
    run(tile<Format, kTileRows, kTilePanels>, kTilePanels, row);
  }
  switch (num_rows - whole_rows) {
    case 3: return run(tile<Format, 3, 1>, 1, whole_rows);
    case 2: return run(tile<Format, 2, 2>, 2, whole_rows);
    case 1: return run(tile<Format, 1, kStrip>, kStrip, whole_rows);
    default: return;
  }
}

template <class Format>
at::Tensor product(const at::Tensor& x, const at::Tensor& packed_weight, int64_t out_features,
                   const float* bias) {
  const int64_t num_rows = x.size(0), in_features = x.size(1);
  const QuantizedRows quantized = quantize_rows(x.const_data_ptr<float>(), num_rows, in_features);
  at::Tensor out = at::empty({num_rows, out_features}, x.options());
  const uint8_t* blocks = packed_weight.const_data_ptr<uint8_t>();
  const int64_t num_strips = packed_weight.size(0), num_groups = in_features / kGroup;
  const int64_t strip_bytes = num_groups * kGroupStripBytes<Format>;
  pagedserve::share_strips(
      num_strips, kStripFeatures, out_features, [&](int64_t s, int64_t feature, int64_t cols) {
        rows_against_strip<Format>(quantized, num_rows, blocks + s * strip_bytes, num_groups,
                                   bias == nullptr ? nullptr : bias + feature,
                                   out.data_ptr<float>() + feature, out_features, cols);
      });
  return out;
}

#endif  // PAGEDSERVE_HAS_AVX2

void check_avx2(const char* op) {
  pagedserve::require_avx2(
      op,
      "the integer products need a CPU with AVX2 (packed weight dtypes q4_1 "
      "and q8_0 compute the same weights in float32 anywhere)");
}

const char* packer_name(const at::Tensor& packed) {
  if (packed.size(3) == kBlockBytes<Q8_0>) return "pack_q8_0_q8";
  if (packed.size(3) == kBlockBytes<Q6_K>) return "pack_q6_k_q8";
  if (packed.size(3) == kBlockBytes<Q5_0>) return "pack_q5_0_q8";
  return packed.size(3) == kBlockBytes<Q4_K> ? "pack_q4_k_q8" : "pack_q4_1_q8";
}

void check_packed(const at::Tensor& packed, int64_t in_features, int64_t out_features) {
  const int64_t block_inputs = pagedserve::integer_block_inputs(packed);
  TORCH_CHECK(packed.is_contiguous() && in_features % block_inputs == 0 &&
                  packed.size(1) == in_features / block_inputs,
              "packed_linear: packed_weight ", packed.sizes(), " is not a ", packer_name(packed),
              " result for ", in_features, " input features");
  pagedserve::check_out_features(out_features, packed.size(0), kStripFeatures, "strips");
}

// [out][...] padded with zeros to whole strips.
at::Tensor padded_to_strips(const at::Tensor& t) {
  const int64_t strips = (t.size(0) + kStripFeatures - 1) / kStripFeatures;
  std::vector<int64_t> shape = t.sizes().vec();
  shape[0] = strips * kStripFeatures;
  at::Tensor result = at::zeros(shape, t.options());
  result.narrow(0, 0, t.size(0)).copy_(t);
  return result;
}

// Blocks [strips][groups][kStrip][block bytes] from each group's header parts ([out][groups]
// float16 each) and the value bytes, [strips][groups][kStrip][value bytes].
at::Tensor strip_blocks(at::TensorList header_parts, const at::Tensor& value_bytes) {
  const int64_t strips = value_bytes.size(0), groups = value_bytes.size(1);
  const int64_t parts = static_cast<int64_t>(header_parts.size());
  std::vector<at::Tensor> padded;
  for (const at::Tensor& part : header_parts) padded.push_back(padded_to_strips(part));
  // [strip][panel][feature][group][part] -> [strip][group][panel][part][feature]
  const at::Tensor headers = at::stack(padded, 2)
                                 .view({strips, kStrip, kFeatures, groups, parts})
                                 .permute({0, 3, 1, 4, 2})
                                 .contiguous();
  return at::cat({headers.view({strips, groups, kStrip, parts * kFeatures}).view(at::kByte),
                  value_bytes.reshape({strips, groups, kStrip, -1})},
                 3);
}


// A format's values [out][in], padded to whole strips, as
// [strip][panel][feature][block][group][half][k][input] (input 16 * half + 4 * k + input of the
// group), `groups` groups a block.
at::Tensor in_groups(const at::Tensor& values, int64_t groups) {
  const int64_t strips = (values.size(0) + kStripFeatures - 1) / kStripFeatures;
  return padded_to_strips(values).view(
      {strips, kStrip, kFeatures, values.size(1) / (kGroup * groups), groups, 2, 4, 4});
}

// Their low four bits as Q4_1's, [strip][block][group][panel][k][feature][input]: a group's
// first half in the low nibbles, its second in the high ones.
at::Tensor low_nibbles(const at::Tensor& grouped) {
  const at::Tensor split = grouped.permute({0, 3, 4, 1, 6, 2, 7, 5}).bitwise_and(15);
  return split.select(7, 0).bitwise_or(split.select(7, 1).mul(16));
}

// Their bits from the fifth up, `width` of them, as wide_values reads them:
// [strip][block][group][panel][vector][feature][input], vector j holding vectors
// j * (8 / width) + i of the values from bit width * i.
at::Tensor high_bits(const at::Tensor& grouped, int64_t width) {
  const int64_t per_byte = 8 / width;
  // -> [strip][block][group][panel][vector][i][feature][input]
  const at::Tensor high = grouped.permute({0, 3, 4, 1, 5, 6, 2, 7})
                              .bitwise_right_shift(4)
                              .reshape({grouped.size(0), grouped.size(3), grouped.size(4), kStrip,
                                        width, per_byte, kFeatures, 4});
  at::Tensor bytes = at::zeros_like(high.select(5, 0));
  for (int64_t i = 0; i < per_byte; ++i) {
    bytes.bitwise_or_(high.select(5, i).bitwise_left_shift(width * i));
  }
  return bytes;
}

// Values of 4 + width bits from grouped ones: each group's low nibbles, then its high bits,
// [strip][block][group][panel][bytes].
at::Tensor wide_value_bytes(const at::Tensor& grouped, int64_t width) {
  const std::vector<int64_t> vectors{grouped.size(0), grouped.size(3), grouped.size(4), kStrip,
                                     -1, 32};
  return at::cat(
      {low_nibbles(grouped).reshape(vectors), high_bits(grouped, width).reshape(vectors)}, 4);
}

// A super-block format's blocks [strips][blocks][kStrip][block bytes] from its header parts
// (d, dmin: [out][blocks]; sc, m: [out][blocks][groups]) and its value bytes, ordered
// [strip][block][group][panel][...]: each super-block's four headers, then its values.
template <class Format>
at::Tensor super_blocks(at::TensorList header_parts, const at::Tensor& value_bytes) {
  const int64_t strips = value_bytes.size(0), blocks = value_bytes.size(1);
  std::vector<at::Tensor> headers;
  for (const at::Tensor& part : header_parts) {
    // [strip][panel][feature][block][n] -> [strip][block][panel][n][feature], as bytes
    const at::Tensor padded = padded_to_strips(part.reshape({part.size(0), blocks, -1}));
    headers.push_back(padded.view({strips, kStrip, kFeatures, blocks, padded.size(2)})
                          .permute({0, 3, 1, 4, 2})
                          .contiguous()
                          .view(at::kByte)
                          .view({strips, blocks, kStrip, -1}));
  }
  return at::cat({at::cat(headers, 3).view({strips, blocks, -1}),
                  value_bytes.reshape({strips, blocks, -1})},
                 2)
      .view({strips, blocks, kStrip, kBlockBytes<Format>});
}

// Feature `lane` of panel p over super-block b of a strip (strip_start), from its header and
// values as a reader gives them: Q4_K's groups of 32 as nibble pairs, Q6_K's as nibble pairs and
// then their high bits.
template <class Format>
void place_super_block(uint8_t* strip_start, int64_t b, int64_t p, int64_t lane,
                       const pagedserve::SuperBlock& block, const uint8_t* values) {
  constexpr bool six_bits = std::is_same_v<Format, Q6_K>;
  constexpr int64_t header_groups = six_bits ? 16 : 8;
  uint8_t* header = header_of<Format>(strip_start, 8 * b, p);
  std::memcpy(header + 2 * lane, &block.d, 2);
  std::memcpy(header + 2 * (kFeatures + lane), &block.dmin, 2);
  for (int64_t g = 0; g < header_groups; ++g) {
    header[4 * kFeatures + g * kFeatures + lane] = static_cast<uint8_t>(block.sc[g]);
    header[4 * kFeatures + (header_groups + g) * kFeatures + lane] =
        static_cast<uint8_t>(block.m[g]);
  }
  for (int64_t g = 0; g < 8; ++g) {
    // Byte 32 * v + 4 * lane + i of group g's block: input 4 * v + i of the group in its low half
    // (Q6_K: low four bits) and input 16 + 4 * v + i in its high half, for v < 4; Q6_K's high two
    // bits of input 16 * (v - 4) + 4 * k + i in bits 2k, 2k + 1, for v = 4, 5.
    uint8_t* group = values_of<Format>(strip_start, 8 * b + g, p);
    const uint8_t* group_values = values + 32 * g;
    for (int64_t v = 0; v < 4; ++v) {
      for (int64_t i = 0; i < 4; ++i) {
        const uint8_t* value = group_values + 4 * v + i;
        group[32 * v + 4 * lane + i] = (value[0] & 15) | (value[16] & 15) << 4;
      }
    }
    for (int64_t half = 0; six_bits && half < 2; ++half) {
      for (int64_t i = 0; i < 4; ++i) {
        uint8_t pairs = 0;
        for (int64_t k = 0; k < 4; ++k) {
          pairs |= (group_values[16 * half + 4 * k + i] >> 4) << 2 * k;
        }
        group[32 * (4 + half) + 4 * lane + i] = pairs;
      }
    }
  }
}

// A super-block format's blocks straight from a GGUF file's rows, written in place: each strip's
// super-block is decoded and laid out by one thread, with no integer arrays in between. The
// parts' rows (readers[i]: part i's block bytes and reader) fill the strips one after another.
template <class Format>
at::Tensor super_blocks_from_rows(
    at::TensorList parts,
    const std::vector<std::pair<int64_t, pagedserve::ReadSuperBlock>>& readers) {
  const char* op = "pack_k_quant_blocks";
  check_avx2(op);
  constexpr int64_t kSuperBlockBytes = kStrip * kBlockBytes<Format>;
  struct Row {
    const uint8_t* bytes;
    int64_t block_bytes;
    pagedserve::ReadSuperBlock read;
  };
  int64_t blocks = -1;
  std::vector<Row> row_of;  // each output feature's row of blocks
  for (size_t i = 0; i < parts.size(); ++i) {
    const at::Tensor& rows = parts[i];
    const auto [block_bytes, read] = readers[i];
    pagedserve::check_gguf_part(op, i, rows, block_bytes, blocks);
    for (int64_t r = 0; r < rows.size(0); ++r) {
      row_of.push_back({rows.const_data_ptr<uint8_t>() + r * rows.size(1), block_bytes, read});
    }
  }
  const int64_t out = static_cast<int64_t>(row_of.size());
  const int64_t strips = (out + kStripFeatures - 1) / kStripFeatures;
  at::Tensor packed = at::empty({strips, blocks, kStrip, kBlockBytes<Format>}, at::kByte);
  uint8_t* target = packed.data_ptr<uint8_t>();
  at::parallel_for(0, strips * blocks, 1, [&](int64_t begin, int64_t end) {
    pagedserve::SuperBlock block;
    uint8_t values[256];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t strip = item / blocks, b = item % blocks;
      // The strip's super-block b, as header_of and values_of find it in the strip.
      uint8_t* strip_start = target + (item - b) * kSuperBlockBytes;
      std::memset(strip_start + b * kSuperBlockBytes, 0, kSuperBlockBytes);
      for (int64_t f = 0; f < kStripFeatures && strip * kStripFeatures + f < out; ++f) {
        const Row& row = row_of[strip * kStripFeatures + f];
        row.read(row.bytes + b * row.block_bytes, block, values);
        place_super_block<Format>(strip_start, b, f / kFeatures, f % kFeatures, block, values);
      }
    }
  });
  return packed;
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
  return strip_blocks({scales, minima}, low_nibbles(in_groups(values, 1)));
}

// values: [out, in] int8; scales: [out, in / 32] float16 (weight = scale * value), as
// pagedserve.model.quantization.quantize_q8_0 returns them. Returns uint8 blocks as pack_q4_1_q8
// does, each a panel's scales and values + 128 over a group.
at::Tensor pack_q8_0_q8(const at::Tensor& values, const at::Tensor& scales) {
  check_avx2("pack_q8_0_q8");
  check_block_inputs("pack_q8_0_q8", values, at::kChar, {scales});
  const int64_t strips = (values.size(0) + kStripFeatures - 1) / kStripFeatures;
  const int64_t groups = values.size(1) / kGroup;
  // [strip][panel][feature][group][vector][input] -> [strip][group][panel][vector][feature][input]
  const at::Tensor offset = padded_to_strips(values).view(at::kByte).bitwise_xor(128);
  return strip_blocks({scales}, offset.view({strips, kStrip, kFeatures, groups, Q8_0::kVectors, 4})
                                    .permute({0, 3, 1, 4, 2, 5}));
}

// values: [out, in] uint8, 0-15; d and dmin: [out, in / 256] float16; sc and m: [out, in / 256,
// 8] uint8, 0-63 (weight = d * sc * value - dmin * m over each group of 32), as pack_q4_k takes
// them. Returns uint8 blocks [strips][in / 256][kStrip][block bytes], each a panel's d, dmin,
// sc, m and values over a super-block, a super-block's four stored as their headers, then their
// values group by group (header_of, values_of).
at::Tensor pack_q4_k_q8(const at::Tensor& values, const at::Tensor& d, const at::Tensor& dmin,
                        const at::Tensor& sc, const at::Tensor& m) {
  check_avx2("pack_q4_k_q8");
  check_q4_k_inputs("pack_q4_k_q8", values, d, dmin, sc, m);
  return super_blocks<Q4_K>({d, dmin, sc, m}, low_nibbles(in_groups(values, 8)));
}

// values: [out, in] uint8, 0-63; d and dmin: [out, in / 256] float16; sc and m: [out, in / 256,
// 16] int8 (weight = d * sc * value - dmin * m over each group of 16), as pack_q6_k takes them.
// Returns blocks as pack_q4_k_q8 does, each group's values' low bits as Q4_1's, then their high
// bits.
at::Tensor pack_q6_k_q8(const at::Tensor& values, const at::Tensor& d, const at::Tensor& dmin,
                        const at::Tensor& sc, const at::Tensor& m) {
  check_avx2("pack_q6_k_q8");
  check_q6_k_inputs("pack_q6_k_q8", values, d, dmin, sc, m);
  return super_blocks<Q6_K>({d, dmin, sc, m}, wide_value_bytes(in_groups(values, 8), 2));
}

// values: [out, in] uint8, 0-31; scales: [out, in / 32] float16 (weight = scale * (value - 16)),
// as pack_q5_0 takes them. Returns uint8 blocks as pack_q8_0_q8 does, each a panel's scales and
// its values' low bits as Q4_1's, then their fifth bits.
at::Tensor pack_q5_0_q8(const at::Tensor& values, const at::Tensor& scales) {
  check_avx2("pack_q5_0_q8");
  check_block_inputs("pack_q5_0_q8", values, at::kByte, {scales});
  TORCH_CHECK(values.numel() == 0 || values.max().item<uint8_t>() < 32,
              "pack_q5_0_q8: values must be 0-31");
  return strip_blocks({scales}, wide_value_bytes(in_groups(values, 1), 1));
}

at::Tensor pack_q4_k_q8_rows(at::TensorList parts,
                             const std::vector<std::pair<int64_t, ReadSuperBlock>>& readers) {
  return super_blocks_from_rows<Q4_K>(parts, readers);
}

at::Tensor pack_q6_k_q8_rows(at::TensorList parts,
                             const std::vector<std::pair<int64_t, ReadSuperBlock>>& readers) {
  return super_blocks_from_rows<Q6_K>(parts, readers);
}

bool is_integer_blocks(const at::Tensor& packed_weight) {
  if (packed_weight.dim() != 4 || packed_weight.scalar_type() != at::kByte ||
      packed_weight.size(2) != kStrip) {
    return false;
  }
  const int64_t block_bytes = packed_weight.size(3);
  return block_bytes == kBlockBytes<Q4_1> || block_bytes == kBlockBytes<Q8_0> ||
         block_bytes == kBlockBytes<Q5_0> || block_bytes == kBlockBytes<Q4_K> ||
         block_bytes == kBlockBytes<Q6_K>;
}

int64_t integer_block_inputs(const at::Tensor& packed_weight) {
  const int64_t block_bytes = packed_weight.size(3);
  return block_bytes == kBlockBytes<Q4_K> || block_bytes == kBlockBytes<Q6_K> ? 256 : kGroup;
}

at::Tensor integer_linear(const at::Tensor& input, const at::Tensor& packed_weight,
                          int64_t out_features, const float* bias) {
  check_avx2("packed_linear");
  check_packed(packed_weight, input.size(1), out_features);
#ifdef PAGEDSERVE_HAS_AVX2
  if (packed_weight.size(3) == kBlockBytes<Q8_0>) {
    return product<Q8_0>(input.contiguous(), packed_weight, out_features, bias);
  }
  if (packed_weight.size(3) == kBlockBytes<Q4_K>) {
    return product<Q4_K>(input.contiguous(), packed_weight, out_features, bias);
  }
  if (packed_weight.size(3) == kBlockBytes<Q6_K>) {
    return product<Q6_K>(input.contiguous(), packed_weight, out_features, bias);
  }
  if (packed_weight.size(3) == kBlockBytes<Q5_0>) {
    return product<Q5_0>(input.contiguous(), packed_weight, out_features, bias);
  }
  return product<Q4_1>(input.contiguous(), packed_weight, out_features, bias);
#else
  return {};
#endif
}

}  // namespace pagedserve
