#include "common/validate.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ostream>

namespace tvllm {

void compare_element(CompareResult& r, int64_t index, double actual, double expected, double atol, double rtol,
                     double& diff_sq, double& ref_sq) {
  const double a = actual, b = expected;
  bool ok;
  double abs_err;
  if (std::isnan(b) || std::isnan(a)) {
    ok = std::isnan(a) && std::isnan(b);
    abs_err = ok ? 0.0 : INFINITY;
  } else if (std::isinf(b) || std::isinf(a)) {
    ok = a == b;
    abs_err = ok ? 0.0 : INFINITY;
  } else {
    abs_err = std::fabs(a - b);
    ok = abs_err <= atol + rtol * std::fabs(b);
    diff_sq += abs_err * abs_err;
    ref_sq += b * b;
    if (std::fabs(b) > atol && b != 0.0) r.max_rel = std::max(r.max_rel, abs_err / std::fabs(b));
  }
  r.max_abs = std::max(r.max_abs, abs_err);
  if (!ok) {
    if (r.first_mismatches.size() < 5) r.first_mismatches.push_back({index, a, b});
    ++r.bad;
  }
}

CompareResult compare(std::string name, std::span<const float> actual, std::span<const float> expected,
                      Tolerance tol) {
  CompareResult r;
  r.name = std::move(name);
  r.tol = tol;
  if (actual.size() != expected.size()) {
    r.error = "size " + std::to_string(actual.size()) + " != reference size " + std::to_string(expected.size());
    return r;
  }
  r.count = static_cast<int64_t>(actual.size());
  double diff_sq = 0.0, ref_sq = 0.0;
  for (size_t i = 0; i < actual.size(); ++i)
    compare_element(r, static_cast<int64_t>(i), actual[i], expected[i], tol.atol, tol.rtol, diff_sq, ref_sq);
  r.rel_l2 = ref_sq > 0 ? std::sqrt(diff_sq / ref_sq) : std::sqrt(diff_sq);
  return r;
}

CompareResult compare(std::string name, const TensorView& actual, const TensorView& expected, Tolerance tol) {
  if (actual.shape != expected.shape) {
    CompareResult r;
    r.name = std::move(name);
    r.tol = tol;
    r.error = "shape " + shape_str(actual.shape) + " != reference shape " + shape_str(expected.shape);
    return r;
  }
  std::vector<float> a = to_f32_vector(actual);
  std::vector<float> b = to_f32_vector(expected);
  return compare(std::move(name), a, b, tol);
}

const CompareResult& Report::add(CompareResult result) {
  results_.push_back(std::move(result));
  return results_.back();
}

void Report::add_check(std::string name, bool pass, std::string detail) {
  CompareResult r;
  r.name = std::move(name);
  r.count = 1;
  if (!pass) r.error = detail.empty() ? "check failed" : detail;
  results_.push_back(std::move(r));
}

bool Report::all_pass() const {
  return !results_.empty() &&
         std::all_of(results_.begin(), results_.end(), [](const CompareResult& r) { return r.pass(); });
}

void Report::print(std::ostream& out) const {
  char line[512];
  out << "\n== " << title_ << " ==\n";
  std::snprintf(line, sizeof line, "%-34s %10s %10s %10s %10s %16s %8s  %s\n", "tensor", "elements", "max_abs",
                "max_rel", "rel_l2", "atol / rtol", "bad", "result");
  out << line;
  for (const CompareResult& r : results_) {
    char tol[32];
    std::snprintf(tol, sizeof tol, "%.0e / %.0e", r.tol.atol, r.tol.rtol);
    std::snprintf(line, sizeof line, "%-34s %10lld %10.3e %10.3e %10.3e %16s %8lld  %s\n", r.name.c_str(),
                  static_cast<long long>(r.count), r.max_abs, r.max_rel, r.rel_l2, tol,
                  static_cast<long long>(r.bad), r.pass() ? "PASS" : "FAIL");
    out << line;
    if (!r.error.empty()) out << "    " << r.error << "\n";
    for (const Mismatch& m : r.first_mismatches) {
      std::snprintf(line, sizeof line, "    [%lld] got %.6g, expected %.6g (|diff| %.3g)\n",
                    static_cast<long long>(m.index), m.actual, m.expected, std::fabs(m.actual - m.expected));
      out << line;
    }
  }
  out << (all_pass() ? "PASS" : "FAIL") << ": " << title_ << "\n";
}

}  // namespace tvllm
