// What the GPU attention suites of lessons 10 and 12 share: the tolerances of a bf16 kernel against the CPU
// reference run on the same bf16-rounded inputs, and a report that names (row, head, dim) of the first
// mismatches. Header-only: it needs lesson 07's AttentionShape, which only those suites link.
//
// The bounds (tests/test_07_attention_gpu.cpp derives them):
//   decode  P stays fp32; the only bf16 rounding is the output's (at most 2^-8 of it). Scores, exp2f and
//           sums in another order add ~1e-6 relative: kFp32Slack covers them with room.
//   flash   (and v1) P is rounded to bf16 before P V: up to 2^-8 * max|v| more, since the output is a convex
//           combination of v rows.
#pragma once

#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <vector>

#include "attention.h"
#include "common/tensor.h"
#include "common/validate.h"

namespace tvllm::testing {

inline constexpr double kBf16Rounding = 1.0 / 256;
inline constexpr double kFp32Slack = 1e-4;
inline const Tolerance kDecodeTol{kFp32Slack, kBf16Rounding + kFp32Slack};
inline Tolerance flash_tol(double max_v) {
  return {(kBf16Rounding + kFp32Slack) * max_v, kBf16Rounding + kFp32Slack};
}

inline std::vector<float> round_to_bf16(const std::vector<float>& x) {
  return to_f32_vector(Tensor::from_f32(x, {static_cast<int64_t>(x.size())}, DType::BF16, Device::CPU));
}

// "name: max_abs .., max_rel .., bad n of m" and the first mismatches as (row, head, dim) of [T, q_dim] outputs.
inline std::string describe(const CompareResult& r, const AttentionShape& s) {
  std::ostringstream o;
  o << r.name << ": max_abs " << r.max_abs << ", max_rel " << r.max_rel << ", bad " << r.bad << " of " << r.count;
  for (const Mismatch& m : r.first_mismatches)
    o << "\n  row " << m.index / s.q_dim() << " head " << (m.index % s.q_dim()) / s.head_dim << " dim "
      << m.index % s.head_dim << ": got " << m.actual << ", expected " << m.expected;
  if (!r.error.empty()) o << "\n  " << r.error;
  return o.str();
}

inline void expect_close(const std::vector<float>& got, const std::vector<float>& want, const AttentionShape& s,
                         const Tolerance& tol, const std::string& name) {
  const CompareResult c = compare(name, got, want, tol);
  EXPECT_TRUE(c.pass()) << describe(c, s);
}

}  // namespace tvllm::testing
