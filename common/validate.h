// The validation harness: compare what we computed with a reference, element by element.
//
// An element passes when |actual - expected| <= atol + rtol * |expected|   (numpy.allclose's rule).
// atol covers values near zero, where a relative error means nothing; rtol covers the rest.
// Each lesson states its atol/rtol and why (bf16 keeps 8 significant bits: one rounding to nearest is a
// relative error of up to 2^-8 = 0.39%, half the spacing 2^-7 between bf16 values in [1, 2); lesson 02
// measures it).
//
// Reported beside the verdict:
//   max_abs  the largest |a - b|
//   max_rel  the largest |a - b| / |b| over elements with |b| > atol (below that, rel error is noise)
//   rel_l2   ||a - b|| / ||b||, one number for the whole tensor
//   bad      how many elements failed the rule, and the first few of them
#pragma once

#include <cstdint>
#include <iosfwd>
#include <span>
#include <string>
#include <vector>

#include "common/tensor.h"

namespace tvllm {

struct Tolerance {
  double atol = 0.0;
  double rtol = 0.0;
};

struct Mismatch {
  int64_t index;
  double actual;
  double expected;
};

struct CompareResult {
  std::string name;
  int64_t count = 0;
  double max_abs = 0.0;
  double max_rel = 0.0;
  double rel_l2 = 0.0;
  int64_t bad = 0;
  std::vector<Mismatch> first_mismatches;  // up to 5
  Tolerance tol;
  std::string error;  // non-empty when the comparison could not even be made (shape mismatch)
  bool pass() const { return error.empty() && bad == 0; }
};

// NaN in actual fails unless expected is NaN at the same place; infinities must match exactly.
CompareResult compare(std::string name, std::span<const float> actual, std::span<const float> expected,
                      Tolerance tol);
// Same, for views of any dtype on any device; the shapes must be equal.
CompareResult compare(std::string name, const TensorView& actual, const TensorView& expected, Tolerance tol);

// compare()'s rule for one element, for harnesses that pick atol per element (lesson 06 scales it by each
// row's size): passes if |actual - expected| <= atol + rtol * |expected| (NaN only against NaN, an infinity
// only against the same infinity). Folds the element into r: max_abs, max_rel (over |expected| > atol),
// bad and first_mismatches (index: the element's flat index); count and rel_l2 stay the caller's. A finite
// pair adds its squared error to diff_sq and its squared reference to ref_sq: rel_l2 = sqrt(diff_sq / ref_sq).
void compare_element(CompareResult& r, int64_t index, double actual, double expected, double atol, double rtol,
                     double& diff_sq, double& ref_sq);

// Collects results and prints the PASS/FAIL table that every lesson executable ends with.
class Report {
 public:
  explicit Report(std::string title) : title_(std::move(title)) {}
  const CompareResult& add(CompareResult result);
  // A check that is not a tensor comparison (e.g. "ids equal"): one row, pass or fail.
  void add_check(std::string name, bool pass, std::string detail = "");
  void print(std::ostream& out) const;
  bool all_pass() const;
  int exit_code() const { return all_pass() ? 0 : 1; }
  size_t size() const { return results_.size(); }

 private:
  std::string title_;
  std::vector<CompareResult> results_;
};

}  // namespace tvllm
