// Checking a linear layer's output: a tolerance that scales with each row.
//
// The rounding error of y[t][o] = sum_i x[t][i] W[o][i] grows with the size of the TERMS it sums, not
// with the size of the result: an output near zero because large terms cancel carries the same absolute
// error as its neighbours. So the absolute part of the tolerance is a multiple of that row's size,
// measured by the reference row's RMS:
//
//     |got - ref| <= atol_row_rms * rms(ref[t, :]) + rtol * |ref|
//
// A per-tensor atol would not do: rows differ in size (attention outputs shrink with position, the first
// token's activations are often much larger), and one atol would be too loose for the small rows or too
// tight for the large ones. README.md ("What correct means") derives each number below.
//
// Host-only (C++20): matmul.cu does not include it.
#pragma once

#include <string>

#include "common/tensor.h"
#include "common/validate.h"

namespace tvllm {

struct LinearTolerance {
  double atol_row_rms = 0.0;  // absolute part, in units of the reference row's RMS
  double rtol = 0.0;          // relative part
};

// bf16 kernel vs Hugging Face's fp32 output. x is the fp32 reference rounded once to bf16 (relative
// error <= u = 2^-8 per element, RMS ~0.43u), W is exactly what HF used, the sum is fp32, the output is
// rounded once to bf16 (<= u relative). The input rounding gives each output an error of RMS ~0.43u
// times the row's size: atol = 4u = 2^-6 row RMS is ~9 of those standard deviations. rtol = 2u = 2^-7
// covers the output rounding (u) twice over.
inline constexpr LinearTolerance kBf16VsReference{1.0 / 64, 1.0 / 128};

// fp32 CPU reference vs Hugging Face's fp32 output: same inputs and weights, both in fp32. Ours is exact
// to one fp32 rounding (double accumulation); HF's fp32 sum of K terms is off by ~0.6 sqrt(K) 2^-24 of
// the row's size (3e-6 at K = 8192, ~1.5e-5 at the worst of 1e5 elements). atol = 2^-14 (6e-5) row RMS
// leaves 4x headroom there and more at smaller K; rtol = 2^-16 (1.5e-5) is a few hundred fp32 ulps.
inline constexpr LinearTolerance kF32VsReference{1.0 / 16384, 1.0 / 65536};

// A bf16-output GPU kernel vs the CPU reference on the SAME bf16-exact inputs (the unit tests): no input
// rounding at all, so the only errors are the final rounding to bf16 (<= u = 2^-8 relative: rtol) and
// the fp32 summation order (~sqrt(K) * 2^-24 of the row's size, far under atol = 2^-12 row RMS).
inline constexpr LinearTolerance kBf16OutVsCpu{1.0 / 4096, 1.0 / 256};
// The same with an fp32 output: no final rounding, only the summation order.
inline constexpr LinearTolerance kF32OutVsCpu{1.0 / 4096, 1.0 / 4096};

// Accumulates comparisons of [rows, cols] tensors (any dtype, any device) into one CompareResult:
// counts, worst errors and rel_l2 over everything added. r.tol.atol reports the largest absolute
// tolerance that was applied (the largest row RMS times atol_row_rms).
class RowScaledComparison {
 public:
  RowScaledComparison(std::string name, LinearTolerance tol);
  // actual and expected must have one shape, of rank 2; a mismatch is recorded as an error.
  void add(const TensorView& actual, const TensorView& expected);
  const CompareResult& result() const { return result_; }

 private:
  CompareResult result_;
  LinearTolerance tol_;
  double diff_sq_ = 0.0, ref_sq_ = 0.0;
  int64_t offset_ = 0;  // elements added so far: mismatch indices count across additions
};

// One comparison: the same as RowScaledComparison with a single add().
CompareResult compare_rows(std::string name, const TensorView& actual, const TensorView& expected,
                           LinearTolerance tol);

}  // namespace tvllm
