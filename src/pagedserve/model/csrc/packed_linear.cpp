// Linear maps on the CPU, from weights packed once at load time.
//
// The weight [out, in] is cut into panels of kPanel output features, each stored input-major
// ([in][kPanel]), so that a tile of the product streams its panel sequentially and broadcasts
// each input value against two vectors of it: the register-blocked outer product that BLAS
// kernels use, with no horizontal sums. On the default model's shapes on a 2-core AVX2 machine
// this reads the weights at the memory bandwidth for one row and beats oneDNN's packed product
// (1.4-1.6x at 1-32 rows, 1.1-1.4x at 64-512, as fast at 2048).
//
// Panels hold float32 or bfloat16 weights, or int8 values with a float32 scale per output
// feature (weight = scale * value). The arithmetic is float32 whatever they hold, so bfloat16
// halves and int8 quarters the bytes a decode step reads, on CPUs with no bfloat16 or int8
// arithmetic too.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <type_traits>
#include <vector>

#include "kernels.h"

namespace {

using Vec = at::vec::Vectorized<float>;

// The accumulators are kept as the raw vector type: as arrays of Vec, GCC keeps them in memory and
// stores every one of them on each step of the input dimension (about 2x slower).
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

// Vec::size() consecutive stored weights as floats. Each conversion reads its weights straight
// from memory: through at::vec's bfloat16 conversion, which loads a whole panel row and splits it,
// a bfloat16 panel was read 1.5x slower than an int8 one.
template <typename weight_t>
Vec widen(const weight_t* weights) {
  if constexpr (std::is_same_v<weight_t, float>) {
    return Vec::loadu(weights);
  } else {
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (std::is_same_v<weight_t, int8_t>) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(weights));
      return Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)));
    } else {  // bfloat16: the upper 16 bits of a float32
      const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(weights));
      return Vec(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16)));
    }
#elif defined(CPU_CAPABILITY_AVX2)
    if constexpr (std::is_same_v<weight_t, int8_t>) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(weights));
      return Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
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

// out[m][j] = bias[j] + scale[j] * (x[m] . panel[:, j]) for `rows` input rows against `panels`
// consecutive panels, of which the first `cols` <= panels * kPanel features are written.
// Every loop over the accumulators is unrolled: see Register. Kept out of line: inlined into its
// callers, five int8 rows ran 1.6x slower.
template <int64_t rows, int64_t panels, typename weight_t>
[[gnu::noinline]] void tile(const float* x, int64_t in_features, const weight_t* panel,
                            Epilogue epilogue, float* out, int64_t out_stride, int64_t cols) {
  constexpr int64_t kSums = 2 * panels;  // accumulators per row
  const int64_t panel_size = in_features * kPanel;
  Register sums[rows][kSums];
#pragma GCC unroll 12
  for (int64_t j = 0; j < kSums; ++j) {
    // Unscaled weights start from the bias, so float32 panels round as the plain product does.
    const Vec start = epilogue.scale == nullptr ? epilogue.bias_at(j * Vec::size()) : Vec(0.0f);
#pragma GCC unroll 6
    for (int64_t m = 0; m < rows; ++m) sums[m][j] = start;
  }
  for (int64_t k = 0; k < in_features; ++k) {
    // The sums take 2 * rows * panels of AVX2's 16 vector registers; what a step of k keeps beside
    // them must fit in the rest, or a sum is kept on the stack.
    if constexpr (panels == 1) {
      // Both weight vectors stay in registers while each row's value is loaded in turn: the
      // other order would keep up to 6 row values beside 12 sums, and 6 rows spilled.
      const Vec w_low = widen(panel + k * kPanel), w_high = widen(panel + k * kPanel + Vec::size());
#pragma GCC unroll 6
      for (int64_t m = 0; m < rows; ++m) {
        const Vec value(x[m * in_features + k]);
        sums[m][0] = at::vec::fmadd(value, w_low, Vec(sums[m][0]));
        sums[m][1] = at::vec::fmadd(value, w_high, Vec(sums[m][1]));
      }
    } else {
      // GCC keeps every row's value in a register across the panels, so the weights are widened
      // one vector at a time. Widening a panel's two vectors at once left 3 rows one register
      // short: with a sum on the stack, 3 int8 rows took 1.4x as long as 4.
#pragma GCC unroll 12
      for (int64_t j = 0; j < kSums; ++j) {
        const Vec weights = widen(panel + j / 2 * panel_size + k * kPanel + j % 2 * Vec::size());
#pragma GCC unroll 6
        for (int64_t m = 0; m < rows; ++m) {
          sums[m][j] = at::vec::fmadd(Vec(x[m * in_features + k]), weights, Vec(sums[m][j]));
        }
      }
    }
  }
  float buffer[panels * kPanel];
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

// `rows` (< kRows) rows against `count` panels, panels_per_tile(rows) panels at a time; `cols`
// features of `out` in all.
template <int64_t rows, typename weight_t>
void few_rows_against_panels(const float* x, int64_t in_features, const weight_t* panels,
                             int64_t count, Epilogue epilogue, float* out, int64_t out_stride,
                             int64_t cols) {
  constexpr int64_t group = panels_per_tile(rows);
  const int64_t panel_size = in_features * kPanel;
  for (int64_t p = 0; p < count;) {
    const int64_t first = p * kPanel;
    const Epilogue at_panel = epilogue.at_feature(first);
    if (p + group <= count) {
      tile<rows, group>(x, in_features, panels + p * panel_size, at_panel, out + first,
                        out_stride, std::min(group * kPanel, cols - first));
      p += group;
    } else {
      tile<rows, 1>(x, in_features, panels + p * panel_size, at_panel, out + first, out_stride,
                    std::min(kPanel, cols - first));
      p += 1;
    }
  }
}

template <typename weight_t>
void few_rows_against_panels(int64_t rows, const float* x, int64_t in_features,
                             const weight_t* panels, int64_t count, Epilogue epilogue, float* out,
                             int64_t out_stride, int64_t cols) {
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
// while they are still in cache (a second sweep over every panel read the weights twice: 16 rows
// ran 1.1x slower).
template <typename weight_t>
void rows_against_panels(const float* x, int64_t num_rows, int64_t in_features,
                         const weight_t* panels, int64_t count, Epilogue epilogue, float* out,
                         int64_t out_stride, int64_t cols) {
  const int64_t whole_rows = num_rows - num_rows % kRows, panel_size = in_features * kPanel;
  for (int64_t p = 0; p < count; ++p) {
    const int64_t first = p * kPanel;
    for (int64_t m = 0; m < whole_rows; m += kRows) {
      tile<kRows, 1>(x + m * in_features, in_features, panels + p * panel_size,
                     epilogue.at_feature(first), out + m * out_stride + first, out_stride,
                     std::min(kPanel, cols - first));
    }
  }
  few_rows_against_panels(num_rows - whole_rows, x + whole_rows * in_features, in_features, panels,
                          count, epilogue, out + whole_rows * out_stride, out_stride, cols);
}

// Panels [begin, end) of the product, in groups of as many as the rows left over from whole tiles
// take at once. Float32 panels, and any panels for up to 2 * kRows rows, are read as stored.
// Beyond that, bfloat16 or int8 panels are widened once into float32 for all the tiles instead of
// by each tile again: measured here, widening pays from 16 rows on, and without it 64 rows ran
// 1.3x slower than from float32 weights.
template <typename weight_t>
void product(const float* x, int64_t num_rows, int64_t in_features, const weight_t* weights,
             Epilogue epilogue, float* out, int64_t out_features, int64_t begin, int64_t end) {
  const int64_t panel_size = in_features * kPanel;
  const int64_t group = panels_per_tile(num_rows % kRows);
  const bool widen_once = !std::is_same_v<weight_t, float> && num_rows > 2 * kRows;
  std::vector<float> widened(widen_once ? group * panel_size : 0);
  for (int64_t first = begin; first < end; first += group) {
    const int64_t count = std::min(group, end - first), feature = first * kPanel;
    const int64_t cols = std::min(count * kPanel, out_features - feature);
    const weight_t* panels = weights + first * panel_size;
    if (widen_once) {
      at::vec::convert(panels, widened.data(), count * panel_size);
      rows_against_panels(x, num_rows, in_features, widened.data(), count,
                          epilogue.at_feature(feature), out + feature, out_features, cols);
    } else {
      rows_against_panels(x, num_rows, in_features, panels, count, epilogue.at_feature(feature),
                          out + feature, out_features, cols);
    }
  }
}

bool is_weight_type(at::ScalarType type) {
  return type == at::kFloat || type == at::kBFloat16 || type == at::kChar;
}

// A float32 value per output feature, readable for whole panels: the tensor's own data when the
// features fill their panels (no copy per call), else a copy padded with zeros, kept in `padded`.
const float* per_feature(const std::optional<at::Tensor>& values, int64_t features,
                         int64_t panels, const char* name, at::Tensor& padded) {
  if (!values.has_value()) return nullptr;
  TORCH_CHECK(values->dim() == 1 && values->size(0) == features &&
                  values->scalar_type() == at::kFloat,
              "packed_linear: ", name, " must be float32 of ", features, " features, got ",
              values->sizes(), " ", values->scalar_type());
  if (features == panels * kPanel && values->is_contiguous()) return values->data_ptr<float>();
  padded = at::zeros({panels * kPanel}, at::kFloat);
  padded.narrow(0, 0, features).copy_(*values);
  return padded.data_ptr<float>();
}

}  // namespace

namespace pagedserve {

// The panels keep the weight's dtype: float32, bfloat16, or int8 (quantized values, whose
// per-feature scales packed_linear takes apart).
at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && is_weight_type(weight.scalar_type()),
              "pack_linear_weight: weight must be a 2-D float32, bfloat16 or int8 tensor, got ",
              weight.sizes(), " ", weight.scalar_type());
  const int64_t out_features = weight.size(0), in_features = weight.size(1);
  const int64_t panels = (out_features + kPanel - 1) / kPanel;
  at::Tensor padded = at::zeros({panels * kPanel, in_features}, weight.options());
  padded.narrow(0, 0, out_features).copy_(weight);
  return padded.view({panels, kPanel, in_features}).transpose(1, 2).contiguous();
}

at::Tensor packed_linear(const at::Tensor& input, const at::Tensor& packed_weight,
                         int64_t out_features, const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& scale) {
  TORCH_CHECK(input.dim() == 2 && input.scalar_type() == at::kFloat,
              "packed_linear: input must be a 2-D float32 tensor, got ", input.sizes(), " ",
              input.scalar_type());
  const int64_t num_rows = input.size(0), in_features = input.size(1);
  TORCH_CHECK(packed_weight.dim() == 3 && is_weight_type(packed_weight.scalar_type()) &&
                  packed_weight.is_contiguous() && packed_weight.size(1) == in_features &&
                  packed_weight.size(2) == kPanel,
              "packed_linear: packed_weight ", packed_weight.sizes(),
              " is not a pack_linear_weight result for ", in_features, " input features");
  const int64_t panels = packed_weight.size(0);
  TORCH_CHECK(out_features > (panels - 1) * kPanel && out_features <= panels * kPanel,
              "packed_linear: out_features ", out_features, " does not fit ", panels, " panels of ",
              kPanel);
  const bool quantized = packed_weight.scalar_type() == at::kChar;
  TORCH_CHECK(quantized == scale.has_value(),
              "packed_linear: scale is required for int8 panels and only for them");
  at::Tensor padded_bias, padded_scale;
  const Epilogue epilogue{per_feature(bias, out_features, panels, "bias", padded_bias),
                          per_feature(scale, out_features, panels, "scale", padded_scale)};
  const at::Tensor x = input.contiguous();
  at::Tensor out = at::empty({num_rows, out_features}, input.options());
  const auto run = [&](const auto* weights) {
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      product(x.data_ptr<float>(), num_rows, in_features, weights, epilogue,
              out.data_ptr<float>(), out_features, begin, end);
    });
  };
  switch (packed_weight.scalar_type()) {
    case at::kBFloat16: run(packed_weight.data_ptr<at::BFloat16>()); break;
    case at::kChar: run(packed_weight.data_ptr<int8_t>()); break;
    default: run(packed_weight.data_ptr<float>());
  }
  return out;
}

}  // namespace pagedserve

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def(
      "packed_linear(Tensor input, Tensor packed_weight, int out_features, Tensor? bias, "
      "Tensor? scale=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("pack_linear_weight", &pagedserve::pack_linear_weight);
  m.impl("packed_linear", &pagedserve::packed_linear);
}
