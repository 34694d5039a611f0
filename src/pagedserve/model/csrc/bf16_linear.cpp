// bfloat16 weights against inputs rounded to bfloat16: AVX-512 BF16's vdpbf16ps, which makes two
// multiply-adds in each float32 lane per instruction, twice the rate of float32's.
//
// packed_linear's bfloat16 panels widen every weight to float32 and multiply it by float32 inputs.
// Here each input row is first rounded to bfloat16 (to nearest, ties to even), and a feature's
// weights for inputs 2k and 2k + 1 share one 32-bit lane, as the two rounded inputs share one
// broadcast 32-bit value: vdpbf16ps multiplies both pairs and adds the products to the lane's
// float32 sum. A product of two bfloat16 values is exact in float32 (two 8-bit significands), and
// the instruction adds the odd input's product first, then the even input's, rounding after each
// (measured on Zen 4 against the other orders). The AVX2 path makes the same two multiply-adds in
// that order, so the two builds give the same bits (vdpbf16ps also reads subnormal inputs and
// writes subnormal sums as zero, which a model's weights and activations practically never are).
//
// So each output is, per feature f, for every tile shape and batch size:
//   out[f] = (chain over k = 0, 1, ... of: s += w[f][2k+1] * x[2k+1]; s += w[f][2k] * x[2k],
//             from s = 0) + bias[f]
// with w the bfloat16 weights and x the row's inputs rounded to bfloat16.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "work_sharing.h"

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#define PAGEDSERVE_HAS_AVX2 1
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define PAGEDSERVE_HAS_AVX512_BF16 1
#endif

namespace {

constexpr int64_t kPanel = 16;  // output features of one panel: one 512-bit vector of float32
// Panels are stored in strips of kStrip, a strip's panels interleaved pair by pair of inputs:
// [strip][in / 2][kStrip * kPanel features][2 inputs]. A thread computes a strip at a time,
// reading it once in order for a tile of rows.
constexpr int64_t kStrip = 4;
constexpr int64_t kStripFeatures = kStrip * kPanel;
constexpr int64_t kTileRows = 4;

#ifdef PAGEDSERVE_HAS_AVX2

// Input rows rounded to bfloat16, [rows][in]: kept as bfloat16 for vdpbf16ps, which reads a pair
// as one 32-bit value; widened back to float32 for AVX2's multiply-adds.
#ifdef PAGEDSERVE_HAS_AVX512_BF16
using Input = c10::BFloat16;
#else
using Input = float;
#endif

std::vector<Input> rounded_rows(const float* x, int64_t count) {
  std::vector<Input> rounded(count);
  for (int64_t i = 0; i < count; ++i) rounded[i] = static_cast<Input>(c10::BFloat16(x[i]));
  return rounded;
}

#ifdef PAGEDSERVE_HAS_AVX512_BF16

// Rows [0, rows) of `inputs` (each `in` values) against a strip's kStrip panels: sums[m][p] holds
// row m's 16 sums for panel p.
template <int64_t rows>
[[gnu::noinline]] void tile(const c10::BFloat16* inputs, int64_t in, const c10::BFloat16* strip,
                            float* sums) {
  __m512 acc[rows][kStrip];
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t p = 0; p < kStrip; ++p) acc[m][p] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < in / 2; ++k) {
    const c10::BFloat16* pairs = strip + k * 2 * kStripFeatures;
    __m512bh weights[kStrip];
    for (int64_t p = 0; p < kStrip; ++p) {
      weights[p] = (__m512bh)_mm512_loadu_si512(pairs + p * 2 * kPanel);
    }
#pragma GCC unroll 4
    for (int64_t m = 0; m < rows; ++m) {
      int32_t pair;
      std::memcpy(&pair, inputs + m * in + 2 * k, 4);
      const __m512bh both = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
      for (int64_t p = 0; p < kStrip; ++p) {
        acc[m][p] = _mm512_dpbf16_ps(acc[m][p], weights[p], both);
      }
    }
  }
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t p = 0; p < kStrip; ++p) {
      _mm512_storeu_ps(sums + (m * kStrip + p) * kPanel, acc[m][p]);
    }
  }
}

#else  // AVX2: a panel's 16 lanes as two 8-lane halves, each lane's pair widened to float32

template <int64_t rows>
[[gnu::always_inline]] inline void panel_tile(const float* inputs, int64_t in,
                                              const c10::BFloat16* strip, int64_t panel,
                                              float* sums) {
  const __m256i upper = _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u));
  __m256 acc[rows][2];
  for (int64_t m = 0; m < rows; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < in / 2; ++k) {
    const c10::BFloat16* pairs = strip + k * 2 * kStripFeatures + panel * 2 * kPanel;
    __m256 odd[2], even[2];
    for (int64_t h = 0; h < 2; ++h) {
      const __m256i both =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs + h * kPanel));
      odd[h] = _mm256_castsi256_ps(_mm256_and_si256(both, upper));
      even[h] = _mm256_castsi256_ps(_mm256_slli_epi32(both, 16));
    }
#pragma GCC unroll 4
    for (int64_t m = 0; m < rows; ++m) {
      const __m256 x_odd = _mm256_broadcast_ss(inputs + m * in + 2 * k + 1);
      const __m256 x_even = _mm256_broadcast_ss(inputs + m * in + 2 * k);
      for (int64_t h = 0; h < 2; ++h) {
        acc[m][h] = _mm256_fmadd_ps(odd[h], x_odd, acc[m][h]);
        acc[m][h] = _mm256_fmadd_ps(even[h], x_even, acc[m][h]);
      }
    }
  }
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t h = 0; h < 2; ++h) {
      _mm256_storeu_ps(sums + (m * kStrip + panel) * kPanel + 8 * h, acc[m][h]);
    }
  }
}

template <int64_t rows>
[[gnu::noinline]] void tile(const float* inputs, int64_t in, const c10::BFloat16* strip,
                            float* sums) {
  for (int64_t p = 0; p < kStrip; ++p) panel_tile<rows>(inputs, in, strip, p, sums);
}

#endif  // PAGEDSERVE_HAS_AVX512_BF16

// Every row against one strip, whose first `cols` features are written to out (the rest are
// padding): tiles of kTileRows rows, then the rows left over.
void rows_against_strip(const Input* inputs, int64_t num_rows, int64_t in,
                        const c10::BFloat16* strip, const float* bias, float* out,
                        int64_t out_stride, int64_t cols) {
  float sums[kTileRows * kStripFeatures];
  for (int64_t row = 0; row < num_rows; row += kTileRows) {
    const int64_t rows = std::min(kTileRows, num_rows - row);
    const Input* first = inputs + row * in;
    switch (rows) {
      case 4: tile<4>(first, in, strip, sums); break;
      case 3: tile<3>(first, in, strip, sums); break;
      case 2: tile<2>(first, in, strip, sums); break;
      default: tile<1>(first, in, strip, sums);
    }
    for (int64_t m = 0; m < rows; ++m) {
      float* row_out = out + (row + m) * out_stride;
      for (int64_t j = 0; j < cols; ++j) {
        row_out[j] = sums[m * kStripFeatures + j] + (bias == nullptr ? 0.0f : bias[j]);
      }
    }
  }
}

at::Tensor product(const at::Tensor& x, const at::Tensor& packed_weight, int64_t out_features,
                   const float* bias) {
  const int64_t num_rows = x.size(0), in = x.size(1);
  const std::vector<Input> rounded = rounded_rows(x.const_data_ptr<float>(), x.numel());
  const Input* inputs = rounded.data();
  at::Tensor out = at::empty({num_rows, out_features}, x.options());
  const c10::BFloat16* strips = packed_weight.const_data_ptr<c10::BFloat16>();
  pagedserve::share_strips(
      packed_weight.size(0), kStripFeatures, out_features,
      [&](int64_t s, int64_t feature, int64_t cols) {
        rows_against_strip(inputs, num_rows, in, strips + s * in * kStripFeatures,
                           bias == nullptr ? nullptr : bias + feature,
                           out.data_ptr<float>() + feature, out_features, cols);
      });
  return out;
}

#endif  // PAGEDSERVE_HAS_AVX2

void check_avx2(const char* op) {
  pagedserve::require_avx2(
      op,
      "the bfloat16_bf16 product needs a CPU with AVX2 (packed weight dtype "
      "bfloat16 keeps the same weights with float32 inputs anywhere)");
}

}  // namespace

namespace pagedserve {

// weight: [out, in] float32 or bfloat16 (rounded to bfloat16), in even. Returns bfloat16
// [strips][in / 2][kStripFeatures][2]: each strip's 64 features (padded with zeros), input pair by
// input pair.
at::Tensor pack_bfloat16_bf16(const at::Tensor& weight) {
  check_avx2("pack_bfloat16_bf16");
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kFloat ||
                                    weight.scalar_type() == at::kBFloat16),
              "pack_bfloat16_bf16: weight must be a 2-D float32 or bfloat16 tensor, got ",
              weight.sizes(), " ", weight.scalar_type());
  const int64_t out = weight.size(0), in = weight.size(1);
  TORCH_CHECK(in % 2 == 0 && in > 0 && out > 0,
              "pack_bfloat16_bf16: in_features must be even and both sizes positive, got ",
              weight.sizes());
  const int64_t strips = (out + kStripFeatures - 1) / kStripFeatures;
  at::Tensor padded =
      at::zeros({strips * kStripFeatures, in}, weight.options().dtype(at::kBFloat16));
  padded.narrow(0, 0, out).copy_(weight);
  // [strip][feature][pair][2] -> [strip][pair][feature][2]
  return padded.view({strips, kStripFeatures, in / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

bool is_bfloat16_pairs(const at::Tensor& packed_weight) {
  return packed_weight.dim() == 4 && packed_weight.scalar_type() == at::kBFloat16 &&
         packed_weight.size(2) == kStripFeatures && packed_weight.size(3) == 2;
}

at::Tensor bfloat16_pairs_linear(const at::Tensor& input, const at::Tensor& packed_weight,
                                 int64_t out_features, const float* bias) {
  check_avx2("packed_linear");
  const int64_t in = input.size(1), strips = packed_weight.size(0);
  TORCH_CHECK(packed_weight.is_contiguous() && packed_weight.size(1) * 2 == in,
              "packed_linear: packed_weight ", packed_weight.sizes(),
              " is not a pack_bfloat16_bf16 result for ", in, " input features");
  pagedserve::check_out_features(out_features, strips, kStripFeatures, "strips");
#ifdef PAGEDSERVE_HAS_AVX2
  return product(input.contiguous(), packed_weight, out_features, bias);
#else
  return {};
#endif
}

}  // namespace pagedserve
