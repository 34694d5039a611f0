// Linear maps on the CPU, from weights packed once at load time.
//
// The weight [out, in] is cut into panels of kPanel output features, each stored input-major
// ([in][kPanel]), so that a tile of the product streams its panel sequentially and broadcasts
// each input value against two vectors of it: the register-blocked outer product that BLAS
// kernels use, with no horizontal sums. On the default model's shapes on a 2-core AVX2 machine
// this reads the weights at the memory bandwidth for one row and beats oneDNN's packed product
// (1.4-1.6x at 1-32 rows, 1.1-1.4x at 64-512, as fast at 2048).
//
// Panels hold float32 or bfloat16 weights. The arithmetic is float32 either way, so bfloat16
// halves the bytes a decode step reads on CPUs that have no bfloat16 arithmetic.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

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

// One input position of a panel, its kPanel weights, as two float vectors.
template <typename weight_t>
std::pair<Vec, Vec> load_weights(const weight_t* weights) {
  if constexpr (std::is_same_v<weight_t, float>) {
    return {Vec::loadu(weights), Vec::loadu(weights + Vec::size())};
  } else {
    using Stored = at::vec::Vectorized<weight_t>;
    static_assert(Stored::size() == kPanel);
    auto [low, high] = at::vec::convert_to_float<weight_t>(Stored::loadu(weights));
    return {low, high};
  }
}

// out[m][j] = bias[j] + x[m] . panel[:, j] for `rows` input rows and `cols` <= kPanel features.
// Every loop over the accumulators is unrolled, for the same reason.
template <int64_t rows, typename weight_t>
void tile(const float* x, int64_t in_features, const weight_t* panel, const float* bias,
          float* out, int64_t out_stride, int64_t cols) {
  const Vec bias_low = Vec::loadu(bias), bias_high = Vec::loadu(bias + Vec::size());
  Register low[rows], high[rows];
#pragma GCC unroll 8
  for (int64_t m = 0; m < rows; ++m) {
    low[m] = bias_low;
    high[m] = bias_high;
  }
  for (int64_t k = 0; k < in_features; ++k) {
    const auto [w_low, w_high] = load_weights(panel + k * kPanel);
#pragma GCC unroll 8
    for (int64_t m = 0; m < rows; ++m) {
      const Vec value(x[m * in_features + k]);
      low[m] = at::vec::fmadd(value, w_low, Vec(low[m]));
      high[m] = at::vec::fmadd(value, w_high, Vec(high[m]));
    }
  }
  float buffer[kPanel];
#pragma GCC unroll 8
  for (int64_t m = 0; m < rows; ++m) {
    Vec(low[m]).store(buffer);
    Vec(high[m]).store(buffer + Vec::size());
    std::copy(buffer, buffer + cols, out + m * out_stride);
  }
}

template <typename weight_t>
void rows_against_panel(const float* x, int64_t num_rows, int64_t in_features,
                        const weight_t* panel, const float* bias, float* out, int64_t out_stride,
                        int64_t cols) {
  int64_t m = 0;
  for (; m + kRows <= num_rows; m += kRows)
    tile<kRows>(x + m * in_features, in_features, panel, bias, out + m * out_stride, out_stride,
                cols);
  x += m * in_features;
  out += m * out_stride;
  switch (num_rows - m) {
    case 5: return tile<5>(x, in_features, panel, bias, out, out_stride, cols);
    case 4: return tile<4>(x, in_features, panel, bias, out, out_stride, cols);
    case 3: return tile<3>(x, in_features, panel, bias, out, out_stride, cols);
    case 2: return tile<2>(x, in_features, panel, bias, out, out_stride, cols);
    case 1: return tile<1>(x, in_features, panel, bias, out, out_stride, cols);
    default: return;
  }
}

bool is_weight_type(at::ScalarType type) {
  return type == at::kFloat || type == at::kBFloat16;
}

// The panels keep the weight's dtype: float32 or bfloat16.
at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && is_weight_type(weight.scalar_type()),
              "pack_linear_weight: weight must be a 2-D float32 or bfloat16 tensor, got ",
              weight.sizes(), " ", weight.scalar_type());
  const int64_t out_features = weight.size(0), in_features = weight.size(1);
  const int64_t panels = (out_features + kPanel - 1) / kPanel;
  at::Tensor padded = at::zeros({panels * kPanel, in_features}, weight.options());
  padded.narrow(0, 0, out_features).copy_(weight);
  return padded.view({panels, kPanel, in_features}).transpose(1, 2).contiguous();
}

at::Tensor packed_linear(const at::Tensor& input, const at::Tensor& packed_weight,
                         int64_t out_features, const std::optional<at::Tensor>& bias) {
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
  at::Tensor bias_values;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features &&
                    bias->scalar_type() == at::kFloat,
                "packed_linear: bias must be float32 of ", out_features, " features, got ",
                bias->sizes(), " ", bias->scalar_type());
    bias_values = bias->contiguous();
  }
  const at::Tensor x = input.contiguous();
  at::Tensor out = at::empty({num_rows, out_features}, input.options());
  const float* x_data = x.data_ptr<float>();
  const float* b_data = bias_values.defined() ? bias_values.data_ptr<float>() : nullptr;
  float* out_data = out.data_ptr<float>();
  const auto product = [&](const auto* w_data) {
    using weight_t = std::remove_cv_t<std::remove_pointer_t<decltype(w_data)>>;
    // Beyond two tiles of rows, a bfloat16 panel is widened once into float32 for all of them,
    // instead of by each tile again: measured here, widening pays from 16 rows on, and without it
    // 64 rows ran 1.3x slower than from float32 weights.
    const bool widen = !std::is_same_v<weight_t, float> && num_rows > 2 * kRows;
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> widened(widen ? in_features * kPanel : 0);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t cols = std::min(kPanel, out_features - p * kPanel);
        float panel_bias[kPanel] = {};
        if (b_data != nullptr) {
          std::copy(b_data + p * kPanel, b_data + p * kPanel + cols, panel_bias);
        }
        const weight_t* panel = w_data + p * in_features * kPanel;
        if (widen) {
          at::vec::convert(panel, widened.data(), in_features * kPanel);
          rows_against_panel(x_data, num_rows, in_features, widened.data(), panel_bias,
                             out_data + p * kPanel, out_features, cols);
        } else {
          rows_against_panel(x_data, num_rows, in_features, panel, panel_bias,
                             out_data + p * kPanel, out_features, cols);
        }
      }
    });
  };
  if (packed_weight.scalar_type() == at::kBFloat16) {
    product(packed_weight.data_ptr<at::BFloat16>());
  } else {
    product(packed_weight.data_ptr<float>());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def(
      "packed_linear(Tensor input, Tensor packed_weight, int out_features, Tensor? bias) -> "
      "Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("pack_linear_weight", &pack_linear_weight);
  m.impl("packed_linear", &packed_linear);
}
