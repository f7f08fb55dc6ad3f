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

    // The same rule as common/validate.cpp's compare(), with this row's atol.
    for (int64_t c = 0; c < cols; ++c) {
      const double x = ar[c], y = br[c];
      bool ok;
      double abs_err;
      if (std::isnan(x) || std::isnan(y)) {
        ok = std::isnan(x) && std::isnan(y);
        abs_err = ok ? 0.0 : INFINITY;
      } else if (std::isinf(x) || std::isinf(y)) {
        ok = x == y;
        abs_err = ok ? 0.0 : INFINITY;
      } else {
        abs_err = std::fabs(x - y);
        ok = abs_err <= atol + tol_.rtol * std::fabs(y);
        diff_sq_ += abs_err * abs_err;
        ref_sq_ += y * y;
        if (std::fabs(y) > atol && y != 0.0) result_.max_rel = std::max(result_.max_rel, abs_err / std::fabs(y));
      }
      result_.max_abs = std::max(result_.max_abs, abs_err);
      if (!ok) {
        if (result_.first_mismatches.size() < 5) result_.first_mismatches.push_back({offset_ + r * cols + c, x, y});
        ++result_.bad;
      }
    }
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
