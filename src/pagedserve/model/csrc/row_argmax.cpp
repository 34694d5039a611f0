// The index of each row's largest value on the CPU, as torch.argmax gives it (the first of equal
// maxima; NaN counts as the largest), for choosing tokens over the vocabulary.
//
// torch's CPU argmax compares one element at a time, which over a vocabulary of tens of
// thousands of tokens is a visible part of a step. Here a vectorized max is followed by a search
// for its first occurrence, while the row is still in cache.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>

#include "kernels.h"

namespace {

using Vec = at::vec::Vectorized<float>;

int64_t first_largest(const float* row, int64_t size) {
  // at::vec::maximum propagates NaN, as torch.argmax ranks it.
  const float largest = at::vec::reduce_all<float>(
      [](Vec a, Vec b) { return at::vec::maximum(a, b); }, row, size);
  if (std::isnan(largest)) {
    return std::find_if(row, row + size, [](float v) { return std::isnan(v); }) - row;
  }
  // Whole vectors first: a lane of the comparison is zero where it does not match.
  constexpr int no_match = (1 << Vec::size()) - 1;
  const Vec target(largest);
  int64_t start = 0;
  while (start + Vec::size() <= size &&
         (Vec::loadu(row + start) == target).zero_mask() == no_match) {
    start += Vec::size();
  }
  return std::find(row + start, row + size, largest) - row;
}

}  // namespace

namespace pagedserve {

at::Tensor row_argmax(const at::Tensor& values) {
  const at::Tensor x = values.contiguous();
  check_float_rows(x, "row_argmax", "values");
  const int64_t rows = x.size(0), size = x.size(1);
  TORCH_CHECK(size > 0, "row_argmax: rows must not be empty");
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* data = x.data_ptr<float>();
  int64_t* indices = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) indices[r] = first_largest(data + r * size, size);
  });
  return out;
}

}  // namespace pagedserve
