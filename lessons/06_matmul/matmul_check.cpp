#include "matmul_check.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace tvllm {

RowScaledComparison::RowScaledComparison(std::string name, LinearTolerance tol) : tol_(tol) {
  result_.name = std::move(name);
  result_.tol = {0.0, tol.rtol};
}

void RowScaledComparison::add(const TensorView& actual, const TensorView& expected) {
  if (!result_.error.empty()) return;
  if (actual.shape != expected.shape || expected.rank() != 2) {
    result_.error = "shape " + shape_str(actual.shape) + " != reference shape " + shape_str(expected.shape) +
                    (expected.rank() == 2 ? "" : " (expected [rows, cols])");
    return;
  }
  const std::vector<float> a = to_f32_vector(actual);  // [rows, cols]
  const std::vector<float> b = to_f32_vector(expected);
  const int64_t rows = expected.shape[0], cols = expected.shape[1];

  for (int64_t r = 0; r < rows; ++r) {
    const float* ar = a.data() + r * cols;
    const float* br = b.data() + r * cols;
    // The row's size: RMS of the finite reference values.
    double sum_sq = 0.0;
    int64_t finite = 0;
    for (int64_t c = 0; c < cols; ++c)
      if (std::isfinite(br[c])) {
        sum_sq += static_cast<double>(br[c]) * br[c];
        ++finite;
      }
    const double row_rms = finite > 0 ? std::sqrt(sum_sq / static_cast<double>(finite)) : 0.0;
    const double atol = tol_.atol_row_rms * row_rms;
    result_.tol.atol = std::max(result_.tol.atol, atol);

    // compare()'s rule (common/validate.h), with this row's atol.
    for (int64_t c = 0; c < cols; ++c)
      compare_element(result_, offset_ + r * cols + c, ar[c], br[c], atol, tol_.rtol, diff_sq_, ref_sq_);
  }
  offset_ += rows * cols;
  result_.count += rows * cols;
  result_.rel_l2 = ref_sq_ > 0 ? std::sqrt(diff_sq_ / ref_sq_) : std::sqrt(diff_sq_);
}

CompareResult compare_rows(std::string name, const TensorView& actual, const TensorView& expected,
                           LinearTolerance tol) {
  RowScaledComparison comparison(std::move(name), tol);
  comparison.add(actual, expected);
  return comparison.result();
}

}  // namespace tvllm
