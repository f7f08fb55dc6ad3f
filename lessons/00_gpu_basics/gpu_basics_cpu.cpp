// Lesson 00, the CPU side: the reference SAXPY and the closed-form inputs.
#include <algorithm>
#include <cmath>

#include "common/errors.h"
#include "common/exercise.h"
#include "gpu_basics.h"

namespace tvllm {

const std::vector<std::string>& saxpy_kernel_versions() {
  static const std::vector<std::string> versions = {"v1", "v2", "v3"};
  return versions;
}

void saxpy_cpu(float* out, float a, const float* x, const float* y, int64_t n) {
  // --- exercise 00.1: the CPU reference ---------------------------------------------------------------
  // Task: out[i] = a * x[i] + y[i] for i in [0, n), with ONE rounding (the exact a * x[i] + y[i], rounded
  //   to fp32 once), as the GPU's fused multiply-add computes it: the GPU kernels are checked against
  //   this function bit for bit.
  // Hint: `a * x[i] + y[i]` rounds twice here (the project compiles host code with -ffp-contract=off);
  //   <cmath> has the one-rounding operation.
  // Hint: out may be y itself (in place), and n may be 0.
  // Tests: SaxpyCpu.KnownValues SaxpyCpu.RoundsOnceLikeAFusedMultiplyAdd ClosedForm.KnownValues
  // Tests: Saxpy.ViewsOnTheCpuRunTheReference lesson00_gpu_basics.cpu
  // Stub:
  //   (void)out, (void)a, (void)x, (void)y, (void)n;
  //   throw NotWrittenYet("00.1", "the CPU reference");
  // --- solution ---
  // std::fma computes a * x + y exactly and rounds once, like the GPU's fused multiply-add instruction.
  // That is what makes the GPU result reproducible bit for bit on the CPU.
  for (int64_t i = 0; i < n; ++i) out[i] = std::fma(a, x[i], y[i]);
  // --- end of exercise 00.1 ---
}

void saxpy_cpu_unfused(float* out, float a, const float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    // Two roundings: the product is rounded to fp32, then the sum. Only because the project compiles host
    // code with -ffp-contract=off: GCC otherwise contracts a * x + y into one FMA whenever the target has
    // one (-march=native, haswell), also under -std=c++20, and this would silently equal saxpy_cpu.
    float product = a * x[i];
    out[i] = product + y[i];
  }
}

void saxpy(const TensorView& out, float a, const TensorView& x, const TensorView& y, const std::string& kernel,
           cudaStream_t stream) {
  TVLLM_REQUIRE(x.dtype == DType::F32 && y.dtype == DType::F32 && out.dtype == DType::F32,
                "saxpy: x, y and out must be F32, got x " + x.describe() + ", y " + y.describe() + ", out " +
                    out.describe());
  TVLLM_REQUIRE(x.numel() == y.numel() && x.numel() == out.numel(),
                "saxpy: x, y and out must have the same number of elements, got x " + x.describe() + ", y " +
                    y.describe() + ", out " + out.describe());
  TVLLM_REQUIRE(x.device == out.device && y.device == out.device,
                "saxpy: x, y and out must be on the same device, got x " + x.describe() + ", y " + y.describe() +
                    ", out " + out.describe());
  TVLLM_REQUIRE(x.is_contiguous() && y.is_contiguous() && out.is_contiguous(),
                "saxpy: x, y and out must be contiguous");
  const std::vector<std::string>& versions = saxpy_kernel_versions();
  TVLLM_REQUIRE(std::find(versions.begin(), versions.end(), kernel) != versions.end(),
                "saxpy: unknown kernel '" + kernel + "' (expected v1, v2 or v3)");
  TVLLM_REQUIRE(out.numel() == 0 || (x.data && y.data && out.data), "saxpy: null data pointer");
  if (out.device == Device::CPU) {
    saxpy_cpu(out.ptr<float>(), a, x.ptr<float>(), y.ptr<float>(), out.numel());
  } else {
    saxpy_cuda(out.ptr<float>(), a, x.ptr<float>(), y.ptr<float>(), out.numel(), kernel, stream);
  }
}

void fill_closed_form_inputs(float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    x[i] = static_cast<float>(i % 1000) * 0.25f;
    y[i] = static_cast<float>(i % 7);
  }
}

float closed_form_expected(int64_t i) {
  // 3 * (i mod 1000) / 4 + (i mod 7), computed in integers (quarters) and converted once, exactly
  int64_t quarters = 3 * (i % 1000) + 4 * (i % 7);
  return static_cast<float>(quarters) * 0.25f;
}

int64_t count_closed_form_mismatches(const float* out, int64_t n, int64_t* first_bad) {
  int64_t bad = 0;
  if (first_bad) *first_bad = -1;
  for (int64_t i = 0; i < n; ++i) {
    if (out[i] != closed_form_expected(i)) {  // NaN also counts: NaN != anything
      if (bad == 0 && first_bad) *first_bad = i;
      ++bad;
    }
  }
  return bad;
}

}  // namespace tvllm
