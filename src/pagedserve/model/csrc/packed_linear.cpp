// Linear maps on the CPU, from weights packed once at load time.
//
// The weight [out, in] is cut into panels of kPanel output features, each stored input-major
// ([in][kPanel]), so that a tile of the product streams its panel sequentially and broadcasts
// each input value against two vectors of it: the register-blocked outer product that BLAS
// kernels use, with no horizontal sums. On the default model's shapes on a 2-core AVX2 machine
// this reads the weights at the memory bandwidth for one row and beats oneDNN's packed product
// (1.4-1.6x at 1-32 rows, 1.1-1.4x at 64-512, as fast at 2048).
//
// Panels hold float32 or bfloat16 weights, int8 values with a float32 scale per output feature
// (weight = scale * value), or llama.cpp's Q4_1 or Q8_0 blocks (see BlockPanels). The arithmetic
// is float32 whatever they hold, so bfloat16 halves, int8 quarters and Q4_1 cuts to 5/32 the
// bytes a decode step reads, on CPUs with no bfloat16 or int8 arithmetic too.
// pack_q4_1_q8's and pack_q8_0_q8's blocks are computed in integers instead, by
// integer_linear.cpp, and pack_bfloat16_bf16's panels against bfloat16 inputs by bf16_linear.cpp.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <type_traits>
#include <utility>
#include <string>
#include <vector>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "kernels.h"
#include "work_sharing.h"

namespace {

using Vec = at::vec::Vectorized<float>;

// The accumulators are kept as the raw vector type: as arrays of Vec, GCC keeps them in memory and
// stores every one of them on each step of the input dimension.
#if defined(CPU_CAPABILITY_AVX512)
using Register = __m512;
#elif defined(CPU_CAPABILITY_AVX2)
using Register = __m256;
#else
using Register = Vec;
#endif

constexpr int64_t kPanel = 2 * Vec::size();  // output features of one panel
// Input rows of one tile: 2 * kRows accumulators plus the two panel vectors and a broadcast fill
// the 16 vector registers of AVX2.
constexpr int64_t kRows = 6;

// Panels of one tile of `rows` input rows. Each accumulator is a chain of dependent multiply-adds,
// so a tile needs about as many of them as fit (2 * kRows) to keep the FMA units busy: with one
// row and one panel (a decode step alone) the product ran at half speed, waiting on latency.
// Panels are independent, so every output is still summed in the same order whatever the tile,
// and a sequence's outputs do not depend on what else is in its batch.
constexpr int64_t panels_per_tile(int64_t rows) {
  return rows == 0 ? 1 : std::max<int64_t>(1, kRows / rows);
}

// Vec::size() consecutive stored weights (or block headers' parts) as floats. Each
// conversion reads its values straight from memory, rather than through at::vec's bfloat16
// conversion, which loads a whole panel row and splits it.
template <typename weight_t>
Vec widen(const weight_t* weights) {
  if constexpr (std::is_same_v<weight_t, float>) {
    return Vec::loadu(weights);
  } else {
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (std::is_same_v<weight_t, int8_t>) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(weights));
      return Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)));
    } else if constexpr (std::is_same_v<weight_t, uint8_t>) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(weights));
      return Vec(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)));
    } else if constexpr (std::is_same_v<weight_t, at::Half>) {
      return Vec(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(weights))));
    } else {  // bfloat16: the upper 16 bits of a float32
      const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(weights));
      return Vec(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16)));
    }
#elif defined(CPU_CAPABILITY_AVX2)
    if constexpr (std::is_same_v<weight_t, int8_t>) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(weights));
      return Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
    } else if constexpr (std::is_same_v<weight_t, uint8_t>) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(weights));
      return Vec(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)));
    } else if constexpr (std::is_same_v<weight_t, at::Half>) {
      return Vec(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(weights))));
    } else {  // bfloat16: the upper 16 bits of a float32
      const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(weights));
      return Vec(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16)));
    }
#else
    float values[Vec::size()];
    for (int64_t i = 0; i < Vec::size(); ++i) values[i] = static_cast<float>(weights[i]);
    return Vec::loadu(values);
#endif
  }
}

// Block panels, in llama.cpp's formats: each output feature's weights are cut into groups of
// inputs, each with a scale, and for some formats a minimum (weight = scale * value + minimum):
// Q4_1: groups of 32, float16 scales and minima, values 0-15 (5 bits a weight against int8's 8);
// Q8_0: groups of 32, float16 scales, values -127 to 127 (8.5 bits a weight);
// Q5_0: groups of 32, float16 scales, values 0-31, minimum -16 * scale (5.5 bits);
// Q5_1: as Q4_1 with values 0-31 (6 bits);
// Q8_min: groups of 32, float16 scales and minima, values -128 to 127 (9 bits): holds every
//   type above, so that a fused map whose parts mix them (Q5_1 queries beside a Q8_0 value
//   projection) stays exact;
// Q4_K and Q5_K: super-blocks of 256 inputs with a float16 d and dmin, and each group of 32 a
//   6-bit sc and m: scale = d * sc, minimum = -(dmin * m), values 0-15 or 0-31 (4.6 and 5.6 bits);
// Q6_K: super-blocks of 256 with a float16 d and dmin, and each group of 16 an int8 sc and m,
//   values 0-63 (7.1 bits): GGUF's Q6_K weight d * sc * (q - 32) with
//   dmin = 32 * d and m = sc, and its Q4_K and Q5_K, so that a fused map whose parts mix them
//   stays exact.
// So a GGUF checkpoint's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K weights are held
// exactly (pagedserve/model/gguf_blocks.py maps each onto these), where int8 panels with one scale
// per output feature round them again. Every product of d and sc, or dmin and m, is exact in
// float32 (11 and 8 significant bits), as GGUF's own dequantization computes it.
//
// A tile sums x[k] * value over each group from zero, then adds scale * that sum (and minimum *
// the group's sum of x) to the output: the weights are never formed, so no multiply-add is spent
// on them, and every tile shape does the same arithmetic in the same order.

#if defined(CPU_CAPABILITY_AVX512)
Vec to_float(__m512i values) { return Vec(_mm512_cvtepi32_ps(values)); }
#elif defined(CPU_CAPABILITY_AVX2)
Vec to_float(__m256i values) { return Vec(_mm256_cvtepi32_ps(values)); }
#endif

// 32-bit words of a vector's lanes, for values packed as bit fields.
#if defined(CPU_CAPABILITY_AVX512)
using Words = __m512i;
Words load_words(const uint8_t* bytes) { return _mm512_loadu_si512(bytes); }
Words and_words(Words words, int32_t mask) {
  return _mm512_and_si512(words, _mm512_set1_epi32(mask));
}
template <int shift>
Words shift_down(Words words) { return _mm512_srli_epi32(words, shift); }
#elif defined(CPU_CAPABILITY_AVX2)
using Words = __m256i;
Words load_words(const uint8_t* bytes) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
}
Words and_words(Words words, int32_t mask) {
  return _mm256_and_si256(words, _mm256_set1_epi32(mask));
}
template <int shift>
Words shift_down(Words words) { return _mm256_srli_epi32(words, shift); }
#else
struct Words {
  uint32_t lanes[Vec::size()];
};
Words load_words(const uint8_t* bytes) {
  Words words;
  std::memcpy(words.lanes, bytes, sizeof(words.lanes));
  return words;
}
template <typename F>
Words each_word(Words words, F f) {
  for (uint32_t& lane : words.lanes) lane = f(lane);
  return words;
}
Words and_words(Words words, int32_t mask) {
  return each_word(words, [&](uint32_t lane) { return lane & static_cast<uint32_t>(mask); });
}
template <int shift>
Words shift_down(Words words) {
  return each_word(words, [](uint32_t lane) { return lane >> shift; });
}
Vec to_float(Words words) {
  float values[Vec::size()];
  for (int64_t i = 0; i < Vec::size(); ++i) values[i] = static_cast<float>(words.lanes[i]);
  return Vec::loadu(values);
}
#endif

// How a panel holds its values. BitFields<4>, <5> and <6> (Q4_1 and Q4_K's; Q5_0, Q5_1 and Q5_K's;
// Q6_K's): a group's 32 rows as 32 * bits bits a feature, row r's value in bits r * bits to r *
// bits + bits - 1, held in `bits` 32-bit words stored [word][half][Vec::size()] (a half's word is
// one vector load). A tile reads row r in place: the word masked to the field and converted is
// value * 2^s (s = r * bits % 32), multiplied by an input pre-scaled by 2^-s once a call, which
// gives the product x * value exactly, so the arithmetic is that of the value itself, in one mask
// and one conversion a vector (nibbles a byte apart took a widening load, a mask and a shift for
// two vectors, and a fifth bit beside them two more instructions). The field that ends its word is
// shifted down, and those that cross into the next word (four of 32 for 5 and 6 bits) are joined
// from their two parts: both meet the unscaled input. Inputs are scaled by at most 2^-26, exactly
// unless below 2^-100 in magnitude.
// SignedBytes: a byte a feature, a row's kPanel bytes after the other's.
template <int64_t bits>
struct BitFields {
  static constexpr bool kFields = true;
  static constexpr int64_t kBits = bits;
  static constexpr int64_t kRowBytes = kPanel * bits / 8;
  static constexpr int64_t kGroupRows = 32;
  static constexpr int64_t kHalfBytes = Vec::size() * sizeof(uint32_t);
  static constexpr int64_t word_of(int64_t r) { return r * bits / 32; }
  static constexpr int64_t shift_of(int64_t r) { return r * bits % 32; }
  // Row r's fields are read in place (times 2^shift_of(r)) unless they end or cross their word.
  static constexpr bool in_place(int64_t r) { return shift_of(r) + bits < 32; }
  static constexpr float input_scale(int64_t r) {
    return in_place(r) ? 1.0f / static_cast<float>(int64_t{1} << shift_of(r)) : 1.0f;
  }
  static Words word(const uint8_t* group, int64_t index, int64_t half) {
    return load_words(group + (2 * index + half) * kHalfBytes);
  }
  // Half `half` of row r of the group at `group`, times 2^shift_of(r) where in_place(r).
  template <int64_t r>
  static Vec field(const uint8_t* group, int64_t half) {
    constexpr int64_t index = word_of(r), shift = shift_of(r), top = 32 - bits;
    constexpr int32_t mask = (1 << bits) - 1;
    const Words words = word(group, index, half);
    if constexpr (shift < top) {
      return to_float(and_words(words, mask << shift));
    } else if constexpr (shift == top) {
      return to_float(shift_down<top>(words));
    } else {  // the low 32 - shift bits here, the rest at the bottom of the next word
      const Words rest = and_words(word(group, index + 1, half), (1 << (shift - top)) - 1);
      return at::vec::fmadd(to_float(rest), Vec(static_cast<float>(1 << (32 - shift))),
                            to_float(shift_down<shift>(words)));
    }
  }
  // Writes a group's words ([bits][kPanel] uint32, at `out`) from the kGroupRows values (bytes
  // below 2^bits) of each of its first `features` features, feature f's at values + f * stride;
  // the features past them hold zeros. A feature's words are its values as one bit stream, value
  // r at bit r * bits: each 8 values, a uint64 of bytes, close up to 8 * bits bits in three steps
  // that halve the lanes, then take their place in the stream, so no value is shifted alone.
  static void write_group(const uint8_t* values, int64_t stride, int64_t features, uint8_t* out) {
    static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "a group's bytes are its values");
    constexpr int64_t chunk_bits = 8 * bits;
    uint32_t words[bits][kPanel] = {};
    for (int64_t f = 0; f < features; ++f) {
      uint64_t stream[(bits + 1) / 2] = {};
      for (int64_t chunk = 0; chunk < kGroupRows / 8; ++chunk) {
        uint64_t x;
        std::memcpy(&x, values + f * stride + 8 * chunk, 8);
        x = (x & 0x00FF00FF00FF00FFull) | (x & 0xFF00FF00FF00FF00ull) >> (8 - bits);
        x = (x & 0x0000FFFF0000FFFFull) | (x & 0xFFFF0000FFFF0000ull) >> (16 - 2 * bits);
        x = (x & 0x00000000FFFFFFFFull) | (x & 0xFFFFFFFF00000000ull) >> (32 - 4 * bits);
        const int64_t at = chunk * chunk_bits / 64, shift = chunk * chunk_bits % 64;
        stream[at] |= x << shift;
        if (shift + chunk_bits > 64) stream[at + 1] |= x >> (64 - shift);
      }
      for (int64_t w = 0; w < bits; ++w) {
        words[w][f] = static_cast<uint32_t>(stream[w / 2] >> (32 * (w % 2)));
      }
    }
    std::memcpy(out, words, sizeof(words));
  }
  // The group's kGroupRows rows of values as they are, [kGroupRows][kPanel] float32 at `out`,
  // for widening: field<r> times input_scale(r), which is exact.
  static void widen_group(const uint8_t* group, float* out) {
    [&]<int64_t... r>(std::integer_sequence<int64_t, r...>) {
      (widen_field<r>(group, out + r * kPanel), ...);
    }(std::make_integer_sequence<int64_t, kGroupRows>{});
  }
  template <int64_t r>
  static void widen_field(const uint8_t* group, float* out) {
    const Vec unscale(input_scale(r));
    (field<r>(group, 0) * unscale).store(out);
    (field<r>(group, 1) * unscale).store(out + Vec::size());
  }
};
using Nibbles = BitFields<4>;
using FiveBits = BitFields<5>;
struct SignedBytes {
  static constexpr bool kFields = false;
  static constexpr int64_t kRowBytes = kPanel;
  static std::pair<Vec, Vec> widen_row(const uint8_t* values, int64_t index) {
    const auto* row = reinterpret_cast<const int8_t*>(values + index * kRowBytes);
    return {widen(row), widen(row + Vec::size())};
  }
};

// How a block's header gives each group's scale and minimum, as two vectors (half 0 and 1) of
// the panel's features. Group headers: a block is one group of 32, its header kPanel float16
// scales, then (kMinima) kPanel float16 minima. Super-block headers: a block is kGroups groups of
// kGroup (256 inputs), its header kPanel float16 d, kPanel float16 dmin, then kGroups x kPanel
// sc (sc_t) and kGroups x kPanel m (uint8).
// Minima: kNone, kStored (the header's), or kHalfRange (-16 * scale: 5-bit values centred on 16,
// as Q5_0's weight = scale * (value - 16)).
enum class Minima { kNone, kStored, kHalfRange };
template <Minima minima>
struct GroupHeader {
  static constexpr bool kMinima = minima != Minima::kNone;
  static constexpr int64_t kGroup = 32, kGroupsPerBlock = 1;
  static constexpr int64_t kHeaderBytes =
      (minima == Minima::kStored ? 2 : 1) * kPanel * sizeof(at::Half);
  static Vec scale(const uint8_t* header, int64_t, int64_t half) {
    return widen(reinterpret_cast<const at::Half*>(header) + half * Vec::size());
  }
  static Vec minimum(const uint8_t* header, int64_t, int64_t half) {
    if constexpr (minima == Minima::kHalfRange) return scale(header, 0, half) * Vec(-16.0f);
    return widen(reinterpret_cast<const at::Half*>(header) + kPanel + half * Vec::size());
  }
};
template <int64_t groups, typename sc_t, typename m_t>
struct SuperBlockHeader {
  static constexpr bool kMinima = true;
  static constexpr int64_t kGroup = 256 / groups, kGroupsPerBlock = groups;
  static constexpr int64_t kHeaderBytes = 2 * kPanel * sizeof(at::Half) + 2 * groups * kPanel;
  static Vec scale(const uint8_t* header, int64_t group, int64_t half) {
    const auto* d = reinterpret_cast<const at::Half*>(header);
    const auto* sc = reinterpret_cast<const sc_t*>(header + 2 * kPanel * sizeof(at::Half));
    return widen(d + half * Vec::size()) * widen(sc + group * kPanel + half * Vec::size());
  }
  static Vec minimum(const uint8_t* header, int64_t group, int64_t half) {
    const auto* dmin = reinterpret_cast<const at::Half*>(header) + kPanel;
    const auto* m =
        reinterpret_cast<const m_t*>(header + 2 * kPanel * sizeof(at::Half) + groups * kPanel);
    return (widen(dmin + half * Vec::size()) * widen(m + group * kPanel + half * Vec::size()))
        .neg();
  }
};

struct Q4_1 : Nibbles, GroupHeader<Minima::kStored> {};
struct Q8_0 : SignedBytes, GroupHeader<Minima::kNone> {};
struct Q5_0 : FiveBits, GroupHeader<Minima::kHalfRange> {};
struct Q5_1 : FiveBits, GroupHeader<Minima::kStored> {};
struct Q8_Min : SignedBytes, GroupHeader<Minima::kStored> {};
struct Q4_K : Nibbles, SuperBlockHeader<8, uint8_t, uint8_t> {};
struct Q5_K : FiveBits, SuperBlockHeader<8, uint8_t, uint8_t> {};
struct Q6_K : BitFields<6>, SuperBlockHeader<16, int8_t, int8_t> {};

// A panel is stored as blocks: the block's header, then its values, so that a tile reads each
// panel as one stream, as for int8, rather than scales, minima and values from three places.
template <typename Format>
constexpr int64_t kBlockInputs = Format::kGroup * Format::kGroupsPerBlock;
template <typename Format>
constexpr int64_t kBlockBytes = Format::kHeaderBytes + kBlockInputs<Format> * Format::kRowBytes;

// packed_linear tells the formats apart by their block sizes.
template <typename... Formats>
struct FormatList {};
using BlockFormats = FormatList<Q4_1, Q8_0, Q5_0, Q5_1, Q8_Min, Q4_K, Q5_K, Q6_K>;
template <typename... Formats>
constexpr bool distinct_block_bytes(FormatList<Formats...>) {
  const int64_t sizes[] = {kBlockBytes<Formats>...};
  for (const int64_t a : sizes) {
    int64_t same = 0;
    for (const int64_t b : sizes) same += a == b;
    if (same != 1) return false;
  }
  return true;
}
static_assert(distinct_block_bytes(BlockFormats{}));

// Block panels as stored (value_t uint8_t), or with their values widened once into float32
// (value_t float, [panels][in_features][kPanel]) for products of many rows.
template <typename Format, typename value_t>
struct BlockPanels {
  const uint8_t* blocks;  // [panels][in_features / kBlockInputs<Format>][kBlockBytes<Format>]
  const float* widened;   // nullptr for uint8_t
  int64_t in_features;
  // Formats with minima: the product's input rows, and each row's sum over each group,
  // [rows][in_features / Format::kGroup].
  const float* inputs;
  const float* input_sums;
  // BitFields: the input rows, each value times its row's input_scale.
  const float* scaled_inputs = nullptr;

  BlockPanels at_panel(int64_t p) const {
    return {blocks + p * in_features / kBlockInputs<Format> * kBlockBytes<Format>,
            widened == nullptr ? nullptr : widened + p * in_features * kPanel, in_features, inputs,
            input_sums, scaled_inputs};
  }
  // The fields that hold group g's values (BitFields).
  const uint8_t* group_values(int64_t g) const {
    const int64_t first_row = g % Format::kGroupsPerBlock * Format::kGroup;
    return block_of(g) + Format::kHeaderBytes +
           first_row / Format::kGroupRows * Format::kGroupRows * Format::kRowBytes;
  }
  // The block that holds group g.
  const uint8_t* block_of(int64_t g) const {
    return blocks + g / Format::kGroupsPerBlock * kBlockBytes<Format>;
  }
  // Row k of the panel, in group g: widened, or SignedBytes as stored (BitFields panels are read
  // a group at a time, see accumulate_fields and widen_panels).
  std::pair<Vec, Vec> row(int64_t g, int64_t k) const {
    if constexpr (std::is_same_v<value_t, float>) {
      return {Vec::loadu(widened + k * kPanel), Vec::loadu(widened + k * kPanel + Vec::size())};
    } else {
      return Format::widen_row(block_of(g) + Format::kHeaderBytes, k % kBlockInputs<Format>);
    }
  }
  // Half (0: low, 1: high) of group g's scales (part 0) or minima (part 1).
  Vec group_vector(int64_t g, int64_t part, int64_t half) const {
    const int64_t within = g % Format::kGroupsPerBlock;
    return part == 0 ? Format::scale(block_of(g), within, half)
                     : Format::minimum(block_of(g), within, half);
  }
  // The group sums of the input row that x points to.
  const float* sums_of(const float* x) const {
    return input_sums + (x - inputs) / in_features * (in_features / Format::kGroup);
  }
};

// Panel p of a product's panels, and `count` panels widened into float32 in `out` for tiles that
// read them many times: one overload for each kind of panel.
template <typename weight_t>
const weight_t* panel_at(const weight_t* panels, int64_t p, int64_t in_features) {
  return panels + p * in_features * kPanel;
}
template <typename Format, typename value_t>
BlockPanels<Format, value_t> panel_at(BlockPanels<Format, value_t> panels, int64_t p, int64_t) {
  return panels.at_panel(p);
}

template <typename weight_t>
const float* widen_panels(const weight_t* panels, int64_t count, int64_t in_features, float* out) {
  at::vec::convert(panels, out, count * in_features * kPanel);
  return out;
}
template <typename Format>
BlockPanels<Format, float> widen_panels(BlockPanels<Format, uint8_t> panels, int64_t count,
                                        int64_t in_features, float* out) {
  for (int64_t p = 0; p < count; ++p) {
    const BlockPanels<Format, uint8_t> panel = panels.at_panel(p);
    float* panel_out = out + p * in_features * kPanel;
    if constexpr (Format::kFields) {
      for (int64_t k = 0; k < in_features; k += Format::kGroupRows) {
        Format::widen_group(panel.group_values(k / Format::kGroup), panel_out + k * kPanel);
      }
    } else {
      for (int64_t k = 0; k < in_features; ++k) {
        const auto [low, high] = panel.row(k / Format::kGroup, k);
        low.store(panel_out + k * kPanel);
        high.store(panel_out + k * kPanel + Vec::size());
      }
    }
  }
  return {panels.blocks, out, in_features, panels.inputs, panels.input_sums};
}

// What a tile makes of its sums: for int8 panels, the scale of each output feature, then the
// bias. Each covers whole panels; nullptr when absent.
struct Epilogue {
  const float* bias;
  const float* scale;  // absent: the panels hold the weights themselves

  Epilogue at_feature(int64_t feature) const {
    return {bias == nullptr ? nullptr : bias + feature,
            scale == nullptr ? nullptr : scale + feature};
  }
  Vec bias_at(int64_t feature) const {
    return bias == nullptr ? Vec(0.0f) : Vec::loadu(bias + feature);
  }
};

// The sums of a tile start from the bias for unscaled weights, so that float32 panels round as
// the plain product does; scaled ones start from zero.
template <int64_t rows, int64_t kSums>
[[gnu::always_inline]] inline void start_sums(Register (&sums)[rows][kSums], Epilogue epilogue) {
#pragma GCC unroll 12
  for (int64_t j = 0; j < kSums; ++j) {
    const Vec start = epilogue.scale == nullptr ? epilogue.bias_at(j * Vec::size()) : Vec(0.0f);
#pragma GCC unroll 6
    for (int64_t m = 0; m < rows; ++m) sums[m][j] = start;
  }
}

// sums[m] += x[m][k] * panel[k] for k < steps, over `panels` panels `panel_size` weights apart;
// x's rows are x_stride apart.
template <int64_t rows, int64_t panels, typename weight_t>
[[gnu::always_inline]] inline void accumulate(Register (&sums)[rows][2 * panels], const float* x,
                                              int64_t x_stride, const weight_t* panel,
                                              int64_t panel_size, int64_t steps) {
  for (int64_t k = 0; k < steps; ++k) {
    // The sums take 2 * rows * panels of AVX2's 16 vector registers; what a step of k keeps beside
    // them must fit in the rest, or a sum is kept on the stack.
    if constexpr (panels == 1) {
      // Both weight vectors stay in registers while each row's value is loaded in turn: the
      // other order would keep up to 6 row values beside 12 sums, and 6 rows spilled.
      const Vec w_low = widen(panel + k * kPanel), w_high = widen(panel + k * kPanel + Vec::size());
#pragma GCC unroll 6
      for (int64_t m = 0; m < rows; ++m) {
        const Vec value(x[m * x_stride + k]);
        sums[m][0] = at::vec::fmadd(value, w_low, Vec(sums[m][0]));
        sums[m][1] = at::vec::fmadd(value, w_high, Vec(sums[m][1]));
      }
    } else {
      // GCC keeps every row's value in a register across the panels, so the weights are widened
      // one vector at a time: widening a panel's two vectors at once would leave 3 rows one
      // register short, and a sum on the stack.
#pragma GCC unroll 12
      for (int64_t j = 0; j < 2 * panels; ++j) {
        const Vec weights = widen(panel + j / 2 * panel_size + k * kPanel + j % 2 * Vec::size());
#pragma GCC unroll 6
        for (int64_t m = 0; m < rows; ++m) {
          sums[m][j] = at::vec::fmadd(Vec(x[m * x_stride + k]), weights, Vec(sums[m][j]));
        }
      }
    }
  }
}

// out[m][j] = bias[j] + scale[j] * sums[m][j] (the scale for int8 panels), for the first `cols`
// features.
template <int64_t rows, int64_t kSums>
[[gnu::always_inline]] inline void finish_sums(Register (&sums)[rows][kSums], Epilogue epilogue,
                                               float* out, int64_t out_stride, int64_t cols) {
  float buffer[kSums * Vec::size()];
#pragma GCC unroll 6
  for (int64_t m = 0; m < rows; ++m) {
#pragma GCC unroll 12
    for (int64_t j = 0; j < kSums; ++j) {
      Vec sum(sums[m][j]);
      if (epilogue.scale != nullptr) {
        sum = at::vec::fmadd(sum, Vec::loadu(epilogue.scale + j * Vec::size()),
                             epilogue.bias_at(j * Vec::size()));
      }
      sum.store(buffer + j * Vec::size());
    }
    std::copy(buffer, buffer + cols, out + m * out_stride);
  }
}

// out[m][j] = bias[j] + scale[j] * (x[m] . panel[:, j]) for `rows` input rows against `panels`
// consecutive panels, of which the first `cols` <= panels * kPanel features are written.
// Every loop over the accumulators is unrolled: see Register. Kept out of line: inlined into its
// callers, GCC no longer keeps the accumulators in registers.
template <int64_t rows, int64_t panels, typename weight_t>
[[gnu::noinline]] void tile(const float* x, int64_t in_features, const weight_t* panel,
                            Epilogue epilogue, float* out, int64_t out_stride, int64_t cols) {
  Register sums[rows][2 * panels];
  start_sums(sums, epilogue);
  accumulate<rows, panels>(sums, x, in_features, panel, in_features * kPanel, in_features);
  finish_sums(sums, epilogue, out, out_stride, cols);
}

// sums[m] += scaled[m][i] * field first + i of group g's fields, for its Format::kGroup rows
// of BitFields panels (all 32, or Q6_K's 16 from `first`): the rows unrolled, so that each
// field's mask, shift and kind are constants.
template <int64_t first, int64_t rows, int64_t kSums, typename Format>
[[gnu::always_inline]] inline void accumulate_fields(Register (&sums)[rows][kSums],
                                                     const float* scaled, int64_t in_features,
                                                     const BlockPanels<Format, uint8_t>& panel,
                                                     int64_t g) {
  constexpr int64_t panels = kSums / 2;
  const uint8_t* groups[panels];
#pragma GCC unroll 6
  for (int64_t p = 0; p < panels; ++p) groups[p] = panel.at_panel(p).group_values(g);
  const auto row = [&]<int64_t r>(std::integral_constant<int64_t, r>) {
#pragma GCC unroll 6
    for (int64_t p = 0; p < panels; ++p) {
      const Vec low = Format::template field<r>(groups[p], 0);
      const Vec high = Format::template field<r>(groups[p], 1);
#pragma GCC unroll 6
      for (int64_t m = 0; m < rows; ++m) {
        const Vec value(scaled[m * in_features + r - first]);
        sums[m][2 * p] = at::vec::fmadd(value, low, Vec(sums[m][2 * p]));
        sums[m][2 * p + 1] = at::vec::fmadd(value, high, Vec(sums[m][2 * p + 1]));
      }
    }
  };
  [&]<int64_t... i>(std::integer_sequence<int64_t, i...>) {
    (row(std::integral_constant<int64_t, first + i>{}), ...);
  }(std::make_integer_sequence<int64_t, Format::kGroup>{});
}

// The same for block panels: each group's sums start from zero in registers and are added, times
// the group's scales, to totals kept in L1, as are Q4_1's minima times the group's input sums.
template <int64_t rows, int64_t panels, typename Format, typename value_t>
[[gnu::noinline]] void tile(const float* x, int64_t in_features, BlockPanels<Format, value_t> panel,
                            Epilogue epilogue, float* out, int64_t out_stride, int64_t cols) {
  constexpr int64_t kSums = 2 * panels;
  const float* group_sums = Format::kMinima ? panel.sums_of(x) : nullptr;
  const int64_t num_groups = in_features / Format::kGroup;
  float totals[rows][kSums * Vec::size()];
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t j = 0; j < kSums; ++j) {
      epilogue.bias_at(j * Vec::size()).store(totals[m] + j * Vec::size());
    }
  }
  for (int64_t g = 0; g < num_groups; ++g) {
    Register sums[rows][kSums];
#pragma GCC unroll 12
    for (int64_t j = 0; j < kSums; ++j) {
#pragma GCC unroll 6
      for (int64_t m = 0; m < rows; ++m) sums[m][j] = Vec(0.0f);
    }
    if constexpr (Format::kFields && std::is_same_v<value_t, uint8_t>) {
      const float* scaled = panel.scaled_inputs + (x - panel.inputs) + g * Format::kGroup;
      if constexpr (Format::kGroup == Format::kGroupRows) {
        accumulate_fields<0>(sums, scaled, in_features, panel, g);
      } else {  // Q6_K: two groups of 16 a group of fields
        static_assert(2 * Format::kGroup == Format::kGroupRows);
        if (g % 2 == 0) {
          accumulate_fields<0>(sums, scaled, in_features, panel, g);
        } else {
          accumulate_fields<Format::kGroup>(sums, scaled, in_features, panel, g);
        }
      }
    } else {
      for (int64_t k = g * Format::kGroup; k < (g + 1) * Format::kGroup; ++k) {
#pragma GCC unroll 6
        for (int64_t p = 0; p < panels; ++p) {
          const auto [low, high] = panel.at_panel(p).row(g, k);
#pragma GCC unroll 6
          for (int64_t m = 0; m < rows; ++m) {
            const Vec value(x[m * in_features + k]);
            sums[m][2 * p] = at::vec::fmadd(value, low, Vec(sums[m][2 * p]));
            sums[m][2 * p + 1] = at::vec::fmadd(value, high, Vec(sums[m][2 * p + 1]));
          }
        }
      }
    }
#pragma GCC unroll 12
    for (int64_t j = 0; j < kSums; ++j) {
      const BlockPanels<Format, value_t> of = panel.at_panel(j / 2);
      const Vec scale = of.group_vector(g, 0, j % 2);
      const Vec minimum = Format::kMinima ? of.group_vector(g, 1, j % 2) : Vec(0.0f);
#pragma GCC unroll 6
      for (int64_t m = 0; m < rows; ++m) {
        float* total = totals[m] + j * Vec::size();
        Vec sum = at::vec::fmadd(Vec(sums[m][j]), scale, Vec::loadu(total));
        if constexpr (Format::kMinima) {
          sum = at::vec::fmadd(Vec(group_sums[m * num_groups + g]), minimum, sum);
        }
        sum.store(total);
      }
    }
  }
  for (int64_t m = 0; m < rows; ++m) std::copy(totals[m], totals[m] + cols, out + m * out_stride);
}

// `rows` (< kRows) rows against `count` panels, panels_per_tile(rows) panels at a time; `cols`
// features of `out` in all.
template <int64_t rows, typename Panels>
void few_rows_against_panels(const float* x, int64_t in_features, Panels panels, int64_t count,
                             Epilogue epilogue, float* out, int64_t out_stride, int64_t cols) {
  constexpr int64_t group = panels_per_tile(rows);
  for (int64_t p = 0; p < count;) {
    const int64_t first = p * kPanel;
    const Epilogue at_panel = epilogue.at_feature(first);
    if (p + group <= count) {
      tile<rows, group>(x, in_features, panel_at(panels, p, in_features), at_panel, out + first,
                        out_stride, std::min(group * kPanel, cols - first));
      p += group;
    } else {
      tile<rows, 1>(x, in_features, panel_at(panels, p, in_features), at_panel, out + first,
                    out_stride, std::min(kPanel, cols - first));
      p += 1;
    }
  }
}

template <typename Panels>
void few_rows_against_panels(int64_t rows, const float* x, int64_t in_features, Panels panels,
                             int64_t count, Epilogue epilogue, float* out, int64_t out_stride,
                             int64_t cols) {
  const auto run = [&](auto rows_constant) {
    few_rows_against_panels<decltype(rows_constant)::value>(x, in_features, panels, count,
                                                            epilogue, out, out_stride, cols);
  };
  switch (rows) {
    case 5: return run(std::integral_constant<int64_t, 5>{});
    case 4: return run(std::integral_constant<int64_t, 4>{});
    case 3: return run(std::integral_constant<int64_t, 3>{});
    case 2: return run(std::integral_constant<int64_t, 2>{});
    case 1: return run(std::integral_constant<int64_t, 1>{});
    default: return;
  }
}

// All `num_rows` rows against `count` consecutive panels (`cols` features of `out`): whole tiles
// of kRows rows one panel at a time, then the rows left over against all the panels at once,
// while they are still in cache, so that the weights are read from memory once.
template <typename Panels>
void rows_against_panels(const float* x, int64_t num_rows, int64_t in_features, Panels panels,
                         int64_t count, Epilogue epilogue, float* out, int64_t out_stride,
                         int64_t cols) {
  const int64_t whole_rows = num_rows - num_rows % kRows;
  for (int64_t p = 0; p < count; ++p) {
    const int64_t first = p * kPanel;
    for (int64_t m = 0; m < whole_rows; m += kRows) {
      tile<kRows, 1>(x + m * in_features, in_features, panel_at(panels, p, in_features),
                     epilogue.at_feature(first), out + m * out_stride + first, out_stride,
                     std::min(kPanel, cols - first));
    }
  }
  few_rows_against_panels(num_rows - whole_rows, x + whole_rows * in_features, in_features, panels,
                          count, epilogue, out + whole_rows * out_stride, out_stride, cols);
}

// `count` panels from panel `first`: widened into `widened` first unless it is nullptr.
template <typename Panels>
void product_group(const float* x, int64_t num_rows, int64_t in_features, Panels weights,
                   Epilogue epilogue, float* out, int64_t out_features, int64_t first,
                   int64_t count, float* widened) {
  const int64_t feature = first * kPanel;
  const int64_t cols = std::min(count * kPanel, out_features - feature);
  const Panels panels = panel_at(weights, first, in_features);
  if (widened != nullptr) {
    rows_against_panels(x, num_rows, in_features,
                        widen_panels(panels, count, in_features, widened), count,
                        epilogue.at_feature(feature), out + feature, out_features, cols);
  } else {
    rows_against_panels(x, num_rows, in_features, panels, count, epilogue.at_feature(feature),
                        out + feature, out_features, cols);
  }
}

// Whether a product of that many rows widens narrow panels into float32 once (see product).
constexpr bool widens_once(int64_t num_rows) { return num_rows > 2 * kRows; }

// The product, in groups of as many panels as the rows left over from whole tiles take at once,
// shared between the threads as work_sharing.h describes. Which thread computes a group does not
// change its arithmetic.
// Float32 panels, and any panels for up to 2 * kRows rows, are read as stored. Beyond that,
// bfloat16, int8 or 4-bit panels are widened once into float32 for all the tiles instead of by
// each tile again, which pays once enough rows share each widened weight.
template <typename Panels>
void product(const float* x, int64_t num_rows, int64_t in_features, Panels weights,
             Epilogue epilogue, float* out, int64_t out_features, int64_t num_panels) {
  const int64_t group = panels_per_tile(num_rows % kRows);
  const bool widen_once = !std::is_same_v<Panels, const float*> && widens_once(num_rows);
  const int64_t num_groups = (num_panels + group - 1) / group;
  pagedserve::share_items(num_groups, [&](pagedserve::SharedItems& groups) {
    std::vector<float> widened(widen_once ? group * in_features * kPanel : 0);
    for (int64_t g = groups.next(); g >= 0; g = groups.next()) {
      product_group(x, num_rows, in_features, weights, epilogue, out, out_features,
                    g * group, std::min(group, num_panels - g * group),
                    widen_once ? widened.data() : nullptr);
    }
  });
}

bool is_weight_type(at::ScalarType type) {
  return type == at::kFloat || type == at::kBFloat16 || type == at::kHalf || type == at::kChar;
}

// A float32 value per output feature, readable for `readable` features (whole panels for the
// float tiles): the tensor's own data when it has that many (no copy per call), else a copy padded
// with zeros, kept in `padded`.
const float* per_feature(const std::optional<at::Tensor>& values, int64_t features,
                         int64_t readable, const char* name, at::Tensor& padded) {
  if (!values.has_value()) return nullptr;
  TORCH_CHECK(values->dim() == 1 && values->size(0) == features &&
                  values->scalar_type() == at::kFloat,
              "packed_linear: ", name, " must be float32 of ", features, " features, got ",
              values->sizes(), " ", values->scalar_type());
  if (features == readable && values->is_contiguous()) return values->data_ptr<float>();
  padded = at::zeros({readable}, at::kFloat);
  padded.narrow(0, 0, features).copy_(*values);
  return padded.data_ptr<float>();
}

// Block panels from the header parts of each block ([out][blocks] or [out][blocks][n], any
// dtype), each stored as [n][kPanel] in turn, and the values' panel rows ([panels][in][row bytes],
// uint8).
at::Tensor pack_blocks(at::TensorList header_parts, const at::Tensor& value_rows) {
  const int64_t num_panels = value_rows.size(0), num_blocks = header_parts[0].size(1);
  std::vector<at::Tensor> pieces;
  for (const at::Tensor& given : header_parts) {
    const at::Tensor part = given.dim() == 2 ? given.unsqueeze(2) : given;
    at::Tensor padded = at::zeros({num_panels * kPanel, num_blocks, part.size(2)}, part.options());
    padded.narrow(0, 0, part.size(0)).copy_(part);
    // [panel][feature][block][n] -> [panel][block][n][feature]
    padded = padded.view({num_panels, kPanel, num_blocks, part.size(2)}).permute({0, 2, 3, 1});
    pieces.push_back(padded.contiguous().view({num_panels, num_blocks, -1}).view(at::kByte));
  }
  pieces.push_back(value_rows.reshape({num_panels, num_blocks, -1}));
  return at::cat(pieces, 2);
}

// BitFields<bits>' words for values [out][in] (uint8, below 2^bits), as bytes [panels][in][row
// bytes] (each group of 32 inputs [bits words][kPanel features]; features past out: zeros).
template <int64_t bits>
at::Tensor field_rows(const at::Tensor& values) {
  using Fields = BitFields<bits>;
  constexpr int64_t kRows = Fields::kGroupRows;
  const at::Tensor given = values.contiguous();
  const uint8_t* data = given.const_data_ptr<uint8_t>();
  const int64_t out = given.size(0), in = given.size(1), groups = in / kRows;
  const int64_t num_panels = (out + kPanel - 1) / kPanel;
  at::Tensor rows = at::empty({num_panels, in, Fields::kRowBytes}, at::kByte);
  uint8_t* target = rows.data_ptr<uint8_t>();
  at::parallel_for(0, num_panels * groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t first = item / groups * kPanel, g = item % groups;
      Fields::write_group(data + first * in + g * kRows, in, std::min(kPanel, out - first),
                          target + item * kRows * Fields::kRowBytes);
    }
  });
  return rows;
}

// values (uint8) at most max_value.
void check_values_at_most(const char* op, const at::Tensor& values, int64_t max_value) {
  if (values.numel() > 0) {
    TORCH_CHECK(values.max().item<uint8_t>() <= max_value, op, ": values must be 0-", max_value);
  }
}

// A super-block format's values: uint8 [out][in], in whole blocks, at most max_value.
template <typename Format>
void check_format_inputs(const char* op, const at::Tensor& values, int64_t max_value) {
  TORCH_CHECK(values.dim() == 2 && values.scalar_type() == at::kByte, op, ": values must be a ",
              "2-D ", at::kByte, " tensor, got ", values.sizes(), " ", values.scalar_type());
  TORCH_CHECK(values.size(1) % kBlockInputs<Format> == 0, op, ": ", values.size(1),
              " input features are not whole blocks of ", kBlockInputs<Format>);
  check_values_at_most(op, values, max_value);
}

// A super-block format's header: d and dmin float16 [out][in / 256], sc (sc_type) and m
// (m_type) [out][in / 256][groups].
template <typename Format>
void check_super_block_header(const char* op, const at::Tensor& values, const at::Tensor& d,
                              const at::Tensor& dmin, const at::Tensor& sc, const at::Tensor& m,
                              at::ScalarType sc_type, at::ScalarType m_type) {
  const int64_t out = values.size(0), blocks = values.size(1) / 256;
  const std::vector<int64_t> block_shape{out, blocks}, group_shape{out, blocks,
                                                                   Format::kGroupsPerBlock};
  for (const at::Tensor* part : {&d, &dmin}) {
    TORCH_CHECK(part->sizes() == block_shape && part->scalar_type() == at::kHalf, op,
                ": d and dmin must be float16 of shape ", c10::IntArrayRef(block_shape), ", got ",
                part->sizes(), " ", part->scalar_type());
  }
  TORCH_CHECK(sc.sizes() == group_shape && sc.scalar_type() == sc_type &&
                  m.sizes() == group_shape && m.scalar_type() == m_type,
              op, ": sc and m must be ", sc_type, " and ", m_type, " of shape ",
              c10::IntArrayRef(group_shape), ", got ", sc.sizes(), " ", sc.scalar_type(), " and ",
              m.sizes(), " ", m.scalar_type());
}

// The block format of packed panels of that many bytes a block: f(Format{}) for it, or false
// when no format's blocks have that size.
template <typename F, typename First, typename... Rest>
bool with_block_format(int64_t block_bytes, F&& f, FormatList<First, Rest...>) {
  if (block_bytes == kBlockBytes<First>) {
    f(First{});
    return true;
  }
  if constexpr (sizeof...(Rest) > 0) {
    return with_block_format(block_bytes, std::forward<F>(f), FormatList<Rest...>{});
  }
  return false;
}

}  // namespace

namespace pagedserve {

void check_block_inputs(const char* op, const at::Tensor& values, at::ScalarType values_type,
                        at::TensorList header_parts) {
  constexpr int64_t kGroup = Q4_1::kGroup;  // as Q8_0's
  TORCH_CHECK(values.dim() == 2 && values.scalar_type() == values_type, op, ": values must be a ",
              "2-D ", values_type, " tensor, got ", values.sizes(), " ", values.scalar_type());
  TORCH_CHECK(values.size(1) % kGroup == 0, op, ": ", values.size(1),
              " input features are not whole groups of ", kGroup);
  const std::vector<int64_t> group_shape{values.size(0), values.size(1) / kGroup};
  for (const at::Tensor& part : header_parts) {
    TORCH_CHECK(part.sizes() == group_shape && part.scalar_type() == at::kHalf, op,
                ": scales (and minima) must be float16 of shape ", c10::IntArrayRef(group_shape),
                ", got ",
                part.sizes(), " ", part.scalar_type());
  }
}

void check_q4_1_inputs(const char* op, const at::Tensor& values, const at::Tensor& scales,
                       const at::Tensor& minima) {
  check_block_inputs(op, values, at::kByte, {scales, minima});
  TORCH_CHECK(values.max().item<uint8_t>() < 16, op, ": values must be 0-15");
}

void check_q4_k_inputs(const char* op, const at::Tensor& values, const at::Tensor& d,
                       const at::Tensor& dmin, const at::Tensor& sc, const at::Tensor& m) {
  check_format_inputs<Q4_K>(op, values, 15);
  check_super_block_header<Q4_K>(op, values, d, dmin, sc, m, at::kByte, at::kByte);
}

void check_q6_k_inputs(const char* op, const at::Tensor& values, const at::Tensor& d,
                       const at::Tensor& dmin, const at::Tensor& sc, const at::Tensor& m) {
  check_format_inputs<Q6_K>(op, values, 63);
  check_super_block_header<Q6_K>(op, values, d, dmin, sc, m, at::kChar, at::kChar);
}

// The panels keep the weight's dtype: float32, bfloat16, float16, or int8 (quantized values,
// whose per-feature scales packed_linear takes apart).
at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && is_weight_type(weight.scalar_type()),
              "pack_linear_weight: weight must be a 2-D float32, bfloat16, float16 or int8 "
              "tensor, got ",
              weight.sizes(), " ", weight.scalar_type());
  const int64_t out_features = weight.size(0), in_features = weight.size(1);
  const int64_t panels = (out_features + kPanel - 1) / kPanel;
  at::Tensor padded = at::zeros({panels * kPanel, in_features}, weight.options());
  padded.narrow(0, 0, out_features).copy_(weight);
  return padded.view({panels, kPanel, in_features}).transpose(1, 2).contiguous();
}

// values: [out, in] uint8, 0-15; scales and minima: [out, in / 32] float16, each group's
// (weight = scale * value + minimum). Returns Q4_1 block panels as packed_linear takes them:
// uint8, [panels][in / 32][block bytes].
at::Tensor pack_q4_1(const at::Tensor& values, const at::Tensor& scales, const at::Tensor& minima) {
  check_q4_1_inputs("pack_q4_1", values, scales, minima);
  return pack_blocks({scales, minima}, field_rows<4>(values));
}

// values: [out, in] int8, -127 to 127; scales: [out, in / 32] float16 (weight = scale *
// value). Returns Q8_0 block panels, as pack_q4_1 does.
at::Tensor pack_q8_0(const at::Tensor& values, const at::Tensor& scales) {
  check_block_inputs("pack_q8_0", values, at::kChar, {scales});
  return pack_blocks({scales}, pack_linear_weight(values).view(at::kByte));
}

// values: [out, in] uint8, 0-31; scales: [out, in / 32] float16 (weight = scale * (value - 16)).
at::Tensor pack_q5_0(const at::Tensor& values, const at::Tensor& scales) {
  check_block_inputs("pack_q5_0", values, at::kByte, {scales});
  check_values_at_most("pack_q5_0", values, 31);
  return pack_blocks({scales}, field_rows<5>(values));
}

// values: [out, in] int8; scales and minima: [out, in / 32] float16 (weight = scale * value +
// minimum).
at::Tensor pack_q8_min(const at::Tensor& values, const at::Tensor& scales,
                       const at::Tensor& minima) {
  check_block_inputs("pack_q8_min", values, at::kChar, {scales, minima});
  return pack_blocks({scales, minima}, pack_linear_weight(values).view(at::kByte));
}

// As pack_q4_1, with values 0-31.
at::Tensor pack_q5_1(const at::Tensor& values, const at::Tensor& scales, const at::Tensor& minima) {
  check_block_inputs("pack_q5_1", values, at::kByte, {scales, minima});
  check_values_at_most("pack_q5_1", values, 31);
  return pack_blocks({scales, minima}, field_rows<5>(values));
}

// values: [out, in] uint8, 0-15 (Q4_K) or 0-31 (Q5_K); d and dmin: [out, in / 256] float16;
// sc and m: [out, in / 256, 8] uint8, 0-63 (weight = d * sc * value - dmin * m over each group
// of 32). Returns super-block panels, [panels][in / 256][block bytes].
at::Tensor pack_q4_k(const at::Tensor& values, const at::Tensor& d, const at::Tensor& dmin,
                     const at::Tensor& sc, const at::Tensor& m) {
  check_q4_k_inputs("pack_q4_k", values, d, dmin, sc, m);
  return pack_blocks({d, dmin, sc, m}, field_rows<4>(values));
}
at::Tensor pack_q5_k(const at::Tensor& values, const at::Tensor& d, const at::Tensor& dmin,
                     const at::Tensor& sc, const at::Tensor& m) {
  check_format_inputs<Q5_K>("pack_q5_k", values, 31);
  check_super_block_header<Q5_K>("pack_q5_k", values, d, dmin, sc, m, at::kByte, at::kByte);
  return pack_blocks({d, dmin, sc, m}, field_rows<5>(values));
}

// values: [out, in] uint8, 0-63; d and dmin: [out, in / 256] float16; sc and m:
// [out, in / 256, 16] int8 (weight = d * sc * value - dmin * m over each group of 16).
at::Tensor pack_q6_k(const at::Tensor& values, const at::Tensor& d, const at::Tensor& dmin,
                     const at::Tensor& sc, const at::Tensor& m) {
  check_q6_k_inputs("pack_q6_k", values, d, dmin, sc, m);
  return pack_blocks({d, dmin, sc, m}, field_rows<6>(values));
}

// GGUF's Q4_K block (144 bytes): d, dmin, 12 bytes of 6-bit sc and m for 8 groups of 32, then
// 128 bytes: chunk c's 32 bytes hold inputs 64c to 64c + 31 in their low halves, 64c + 32 to
// 64c + 63 in their high halves.
void read_q4_k(const uint8_t* __restrict raw, SuperBlock& block, uint8_t* __restrict values) {
  std::memcpy(&block.d, raw, 2);
  std::memcpy(&block.dmin, raw + 2, 2);
  const uint8_t* scales = raw + 4;
  for (int64_t g = 0; g < 4; ++g) {
    block.sc[g] = scales[g] & 63;
    block.m[g] = scales[g + 4] & 63;
    block.sc[g + 4] = (scales[g + 8] & 15) | ((scales[g] >> 6) << 4);
    block.m[g + 4] = (scales[g + 8] >> 4) | ((scales[g + 4] >> 6) << 4);
  }
  const uint8_t* qs = raw + 16;
  for (int64_t c = 0; c < 4; ++c) {
    for (int64_t i = 0; i < 32; ++i) {
      values[64 * c + i] = qs[32 * c + i] & 15;
      values[64 * c + 32 + i] = qs[32 * c + i] >> 4;
    }
  }
}

// GGUF's Q6_K block (210 bytes): 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales (one
// per group of 16), d. Held as pack_q6_k takes it: d * sc * (q - 32) with dmin = 32 * d, m = sc.
void read_q6_k(const uint8_t* __restrict raw, SuperBlock& block, uint8_t* __restrict values) {
  const uint8_t *ql = raw, *qh = raw + 128;
  std::memcpy(block.sc, raw + 192, 16);
  std::memcpy(block.m, raw + 192, 16);
  std::memcpy(&block.d, raw + 208, 2);
  const float dmin = 32.0f * static_cast<float>(c10::Half(block.d, c10::Half::from_bits()));
  const c10::Half dmin_half(dmin);
  TORCH_CHECK(std::isfinite(static_cast<float>(dmin_half)),
              "a GGUF scale is too large to hold as q6_k's minimum");
  block.dmin = dmin_half.x;
  // Value 32 * quarter + i of a half: its low 4 bits from byte i (quarters 0, 2) or 32 + i
  // (1, 3) of the half's ql, the bottom nibble first; its high 2 bits from bits 2 * quarter of
  // byte i of its qh.
  for (int64_t half = 0; half < 2; ++half) {
    const uint8_t *low = ql + 64 * half, *high = qh + 32 * half;
    uint8_t* to = values + 128 * half;
    for (int64_t i = 0; i < 32; ++i) {
      to[i] = static_cast<uint8_t>((low[i] & 15) | (high[i] & 3) << 4);
      to[32 + i] = static_cast<uint8_t>((low[32 + i] & 15) | (high[i] >> 2 & 3) << 4);
      to[64 + i] = static_cast<uint8_t>(low[i] >> 4 | (high[i] >> 4 & 3) << 4);
      to[96 + i] = static_cast<uint8_t>(low[32 + i] >> 4 | (high[i] >> 6) << 4);
    }
  }
}

// The panels that pack_q4_k or pack_q6_k make of a GGUF file's Q4_K or Q6_K rows ([out][in /
// 256 * block bytes] uint8, as the file stores them), written to target ([ceil(out / kPanel)]
// [blocks][block bytes]) from the blocks in one pass, the panels' blocks shared between threads,
// with no integer arrays in between: a panel's block decodes its kPanel features' blocks one by
// one, then writes their values as BitFields' words. Every byte of the packed block is written
// (features past out: zeros).
template <typename Format>
void pack_gguf_super_blocks(const at::Tensor& rows, int64_t gguf_bytes, ReadSuperBlock read,
                            uint8_t* target) {
  constexpr int64_t groups = Format::kGroupsPerBlock, header = Format::kHeaderBytes;
  static_assert(kBlockBytes<Format> == header + 256 * Format::kRowBytes);
  const int64_t out = rows.size(0), num_blocks = rows.size(1) / gguf_bytes;
  const int64_t num_panels = (out + kPanel - 1) / kPanel;
  const uint8_t* source = rows.data_ptr<uint8_t>();
  at::parallel_for(0, num_panels * num_blocks, 1, [&](int64_t begin, int64_t end) {
    SuperBlock block;
    alignas(64) uint8_t by_feature[kPanel][256];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t panel = item / num_blocks, b = item % num_blocks;
      const int64_t features = std::min(kPanel, out - panel * kPanel);
      uint8_t* to = target + item * kBlockBytes<Format>;
      std::memset(to, 0, header);
      for (int64_t f = 0; f < features; ++f) {
        read(source + (panel * kPanel + f) * rows.size(1) + b * gguf_bytes, block, by_feature[f]);
        std::memcpy(to + 2 * f, &block.d, 2);
        std::memcpy(to + 2 * (kPanel + f), &block.dmin, 2);
        for (int64_t g = 0; g < groups; ++g) {
          to[4 * kPanel + g * kPanel + f] = static_cast<uint8_t>(block.sc[g]);
          to[4 * kPanel + (groups + g) * kPanel + f] = static_cast<uint8_t>(block.m[g]);
        }
      }
      using Fields = BitFields<Format::kBits>;
      constexpr int64_t rows_a_group = Fields::kGroupRows;
      for (int64_t g = 0; g < 256 / rows_a_group; ++g) {
        Fields::write_group(&by_feature[0][g * rows_a_group], 256, features,
                            to + header + g * rows_a_group * Format::kRowBytes);
      }
    }
  });
}

// Q4_K's groups of 32 as q6_k's groups of 16: each group's sc and m twice.
void read_q4_k_as_16_groups(const uint8_t* raw, SuperBlock& block, uint8_t* values) {
  read_q4_k(raw, block, values);
  for (int64_t g = 15; g >= 0; --g) block.sc[g] = block.sc[g / 2], block.m[g] = block.m[g / 2];
}

void check_gguf_part(const char* op, size_t i, const at::Tensor& rows, int64_t gguf_bytes,
                     int64_t& num_blocks) {
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == at::kByte && rows.is_contiguous() &&
                  rows.size(1) % gguf_bytes == 0,
              op, ": part ", i, " must be contiguous uint8 [out, blocks * ", gguf_bytes, "], got ",
              rows.sizes(), " ", rows.scalar_type());
  if (i == 0) num_blocks = rows.size(1) / gguf_bytes;
  TORCH_CHECK(rows.size(1) / gguf_bytes == num_blocks, op, ": part ", i, " has ",
              rows.size(1) / gguf_bytes, " blocks a row, the first part ", num_blocks);
}

// format "q4_k" of type "Q4_K"; format "q6_k" or "q6_k_q8" of type "Q6_K" or "Q4_K" (a fused
// map's Q4_K parts beside a Q6_K one); format "q4_k_q8" of type "Q4_K". Each part's panels follow
// the previous part's in one tensor, so that a fused map's parts are packed in place, with no copy
// to join them.
at::Tensor pack_k_quant_blocks(at::TensorList parts, const std::vector<std::string>& types,
                               c10::string_view format) {
  const char* op = "pack_k_quant_blocks";
  TORCH_CHECK(!parts.empty() && parts.size() == types.size(), op,
              ": one type a part, for at least one part; got ", parts.size(), " parts and ",
              types.size(), " types");
  const auto refuse = [&](const std::string& type) {
    TORCH_CHECK(false, op, ": no packing of GGUF ", type, " blocks as ", format);
    return std::pair<int64_t, ReadSuperBlock>{};
  };
  const auto readers = [&](auto&& reader_of) {
    std::vector<std::pair<int64_t, ReadSuperBlock>> result;
    for (const std::string& type : types) result.push_back(reader_of(type));
    return result;
  };
  const auto as_16_groups = [&](const std::string& type) {
    if (type == "Q6_K") return std::pair<int64_t, ReadSuperBlock>{210, read_q6_k};
    if (type == "Q4_K") return std::pair<int64_t, ReadSuperBlock>{144, read_q4_k_as_16_groups};
    return refuse(type);
  };
  if (format == "q4_k_q8") {
    for (const std::string& type : types) {
      if (type != "Q4_K") refuse(type);
    }
    return pack_q4_k_q8_rows(parts, readers([](const std::string&) {  // integer_linear.cpp
                               return std::pair<int64_t, ReadSuperBlock>{144, read_q4_k};
                             }));
  }
  if (format == "q6_k_q8") return pack_q6_k_q8_rows(parts, readers(as_16_groups));
  const auto pack = [&](auto format_tag,
                        const std::vector<std::pair<int64_t, ReadSuperBlock>>& part_readers) {
    using Format = decltype(format_tag);
    int64_t num_panels = 0, num_blocks = -1;
    for (size_t i = 0; i < parts.size(); ++i) {
      const at::Tensor& rows = parts[i];
      check_gguf_part(op, i, rows, part_readers[i].first, num_blocks);
      TORCH_CHECK(i + 1 == parts.size() || rows.size(0) % kPanel == 0, op, ": part ", i, " has ",
                  rows.size(0), " rows, not whole panels of ", kPanel, " (only the last may)");
      num_panels += (rows.size(0) + kPanel - 1) / kPanel;
    }
    at::Tensor packed = at::empty({num_panels, num_blocks, kBlockBytes<Format>}, at::kByte);
    uint8_t* target = packed.data_ptr<uint8_t>();
    for (size_t i = 0; i < parts.size(); ++i) {
      pack_gguf_super_blocks<Format>(parts[i], part_readers[i].first, part_readers[i].second,
                                     target);
      target += (parts[i].size(0) + kPanel - 1) / kPanel * num_blocks * kBlockBytes<Format>;
    }
    return packed;
  };
  if (format == "q4_k") {
    return pack(Q4_K{}, readers([&](const std::string& type) {
                  return type == "Q4_K" ? std::pair<int64_t, ReadSuperBlock>{144, read_q4_k}
                                        : refuse(type);
                }));
  }
  if (format == "q6_k") return pack(Q6_K{}, readers(as_16_groups));
  TORCH_CHECK(false, op, ": no packing of GGUF ", types.front(), " blocks as ", format);
}

int64_t packed_in_features(const at::Tensor& packed_weight) {
  int64_t in_features = packed_weight.size(1);
  if (is_integer_blocks(packed_weight)) return in_features * integer_block_inputs(packed_weight);
  if (is_bfloat16_pairs(packed_weight)) return in_features * 2;
  if (packed_weight.scalar_type() == at::kByte) {
    with_block_format(
        packed_weight.size(2),
        [&](auto format) { in_features *= kBlockInputs<decltype(format)>; }, BlockFormats{});
  }
  return in_features;
}

at::Tensor packed_linear(const at::Tensor& input, const at::Tensor& packed_weight,
                         int64_t out_features, const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& scale) {
  TORCH_CHECK(input.dim() == 2 && input.scalar_type() == at::kFloat,
              "packed_linear: input must be a 2-D float32 tensor, got ", input.sizes(), " ",
              input.scalar_type());
  const at::ScalarType type = packed_weight.scalar_type();
  TORCH_CHECK((type == at::kChar) == scale.has_value(),
              "packed_linear: scale is required for int8 panels and only for them");
  at::Tensor padded_bias;
  if (is_integer_blocks(packed_weight)) {  // its tiles read only the real features
    return integer_linear(input, packed_weight, out_features,
                          per_feature(bias, out_features, out_features, "bias", padded_bias));
  }
  if (is_bfloat16_pairs(packed_weight)) {
    return bfloat16_pairs_linear(
        input, packed_weight, out_features,
        per_feature(bias, out_features, out_features, "bias", padded_bias));
  }
  const int64_t num_rows = input.size(0), in_features = input.size(1);
  const bool blocks = type == at::kByte;  // the block formats, told apart by their block size
  const bool three_d = packed_weight.dim() == 3;
  const int64_t panel_rows = three_d ? packed_weight.size(1) : 0;  // inputs, or blocks of them
  const int64_t block_bytes = three_d ? packed_weight.size(2) : 0;
  bool shaped = !blocks && panel_rows == in_features && block_bytes == kPanel;
  if (blocks) {
    with_block_format(
        block_bytes,
        [&](auto format) {
          constexpr int64_t kInputs = kBlockInputs<decltype(format)>;
          shaped = in_features % kInputs == 0 && panel_rows == in_features / kInputs;
        },
        BlockFormats{});
  }
  TORCH_CHECK(three_d && (is_weight_type(type) || blocks) &&
                  packed_weight.is_contiguous() && shaped,
              "packed_linear: packed_weight ", packed_weight.sizes(), " ", type,
              " is not a pack_linear_weight or block packer's result for ", in_features,
              " input features");
  const int64_t panels = packed_weight.size(0);
  check_out_features(out_features, panels, kPanel, "panels");
  at::Tensor padded_scale;
  const float* bias_data = per_feature(bias, out_features, panels * kPanel, "bias", padded_bias);
  const at::Tensor x = input.contiguous();
  at::Tensor out = at::empty({num_rows, out_features}, input.options());
  const auto run = [&](auto weights, Epilogue epilogue) {
    product(x.const_data_ptr<float>(), num_rows, in_features, weights, epilogue,
            out.data_ptr<float>(), out_features, panels);
  };
  const Epilogue unscaled{bias_data, nullptr};
  switch (type) {
    case at::kByte: {
      const uint8_t* block_data = packed_weight.const_data_ptr<uint8_t>();
      const float* rows = x.const_data_ptr<float>();
      with_block_format(
          block_bytes,
          [&](auto format) {
            using Format = decltype(format);
            std::vector<float> input_sums;
            if constexpr (Format::kMinima) {
              input_sums.resize(num_rows * in_features / Format::kGroup);
              for (int64_t i = 0; i < static_cast<int64_t>(input_sums.size()); ++i) {
                input_sums[i] = at::vec::reduce_all<float>(
                    [](const Vec& a, const Vec& b) { return a + b; }, rows + i * Format::kGroup,
                    Format::kGroup);
              }
            }
            // Read by the tiles of stored fields only: widened panels meet the inputs as they are.
            std::vector<float> scaled;
            if constexpr (Format::kFields) {
              if (!widens_once(num_rows)) {
                float scales[Format::kGroupRows];
                for (int64_t r = 0; r < Format::kGroupRows; ++r) {
                  scales[r] = Format::input_scale(r);
                }
                scaled.resize(num_rows * in_features);
                for (int64_t i = 0; i < static_cast<int64_t>(scaled.size()); ++i) {
                  scaled[i] = rows[i] * scales[i % Format::kGroupRows];
                }
              }
            }
            run(BlockPanels<Format, uint8_t>{block_data, nullptr, in_features, rows,
                                             input_sums.data(), scaled.data()},
                unscaled);
          },
          BlockFormats{});
      break;
    }
    case at::kChar:
      run(packed_weight.const_data_ptr<int8_t>(),
          {bias_data, per_feature(scale, out_features, panels * kPanel, "scale", padded_scale)});
      break;
    case at::kBFloat16: run(packed_weight.const_data_ptr<at::BFloat16>(), unscaled); break;
    case at::kHalf: run(packed_weight.const_data_ptr<at::Half>(), unscaled); break;
    default: run(packed_weight.const_data_ptr<float>(), unscaled);
  }
  return out;
}

}  // namespace pagedserve
