// RMSNorm, alone or with the residual add before it, and the SwiGLU activation on the CPU, one
// pass over each row.
//
// In torch each is a chain of small operators (RMSNorm: pow, mean, add, rsqrt and two products;
// SwiGLU: silu and a product over strided halves), each a dispatch and a pass over memory. Here
// each is one call and one pass. SwiGLU computes silu with torch's own vector formula; RMSNorm
// sums the squares in another order. Either can differ from torch in the last bit.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <cmath>

#include "kernels.h"

namespace {

using Vec = at::vec::Vectorized<float>;

// Rows per task: enough work to be worth waking a thread for.
int64_t rows_per_task(int64_t row_length) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_length));
}

void check_weight(const at::Tensor& weight, int64_t size, const char* op) {
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == size && weight.scalar_type() == at::kFloat &&
                  weight.is_contiguous(),
              op, ": weight must be float32 of ", size, " elements, got ", weight.sizes(), " ",
              weight.scalar_type());
}

// out = weight * (in * rsqrt(mean(in^2) + eps)) for one row, the products in the order of the
// reference models.
void normalize_row(const float* in, const float* weight, int64_t size, float eps, float* out) {
  const float squares = at::vec::map_reduce_all<float>(
      [](Vec v) { return v * v; }, [](Vec a, Vec b) { return a + b; }, in, size);
  const float scale = 1.f / std::sqrt(squares / static_cast<float>(size) + eps);
  at::vec::map2<float>([scale](Vec v, Vec w) { return w * (v * Vec(scale)); }, out, in, weight,
                       size);
}

}  // namespace

namespace pagedserve {

at::Tensor rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps) {
  const at::Tensor x = input.contiguous();
  check_float_rows(x, "rms_norm", "input");
  const int64_t rows = x.size(0), size = x.size(1);
  check_weight(weight, size, "rms_norm");
  at::Tensor out = at::empty_like(x);
  const float* x_data = x.data_ptr<float>();
  const float* w_data = weight.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  at::parallel_for(0, rows, rows_per_task(size), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      normalize_row(x_data + row * size, w_data, size, static_cast<float>(eps),
                    out_data + row * size);
    }
  });
  return out;
}

// residual += x, then x = rms_norm(residual), both in place: a decoder layer's residual add and
// the norm after it in one pass, with no new tensor (at one decode row, the add alone was a
// dispatch and an allocation, twice per layer).
void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_float_rows(x, "add_rms_norm_", "x");
  check_float_rows(residual, "add_rms_norm_", "residual");
  TORCH_CHECK(x.sizes() == residual.sizes(), "add_rms_norm_: x ", x.sizes(), " and residual ",
              residual.sizes(), " differ in shape");
  const int64_t rows = x.size(0), size = x.size(1);
  check_weight(weight, size, "add_rms_norm_");
  float* x_data = x.data_ptr<float>();
  float* residual_data = residual.data_ptr<float>();
  const float* w_data = weight.data_ptr<float>();
  at::parallel_for(0, rows, rows_per_task(size), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      float* sum = residual_data + row * size;
      float* normed = x_data + row * size;
      at::vec::map2<float>([](Vec r, Vec v) { return r + v; }, sum, sum, normed, size);
      normalize_row(sum, w_data, size, static_cast<float>(eps), normed);
    }
  });
}

// silu(gate) * up for gate_up = [gate | up] along the last dimension.
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_float_rows(gate_up, "silu_and_mul", "gate_up");
  const int64_t rows = gate_up.size(0), size = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_and_mul: gate_up must have an even width, got ",
              gate_up.size(1));
  at::Tensor out = at::empty({rows, size}, gate_up.options());
  const float* in_data = gate_up.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  const Vec one(1.f);
  at::parallel_for(0, rows, rows_per_task(size), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* gate = in_data + row * 2 * size;
      at::vec::map2<float>([one](Vec g, Vec u) { return g / (one + g.neg().exp()) * u; },
                           out_data + row * size, gate, gate + size, size);
    }
  });
  return out;
}

}  // namespace pagedserve
