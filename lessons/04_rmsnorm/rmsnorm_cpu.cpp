// Lesson 04, the reference: argument checks shared by both paths, and RMSNorm in plain C++ on the host.
#include <cmath>
#include <string>
#include <vector>

#include "common/errors.h"
#include "common/exercise.h"
#include "rmsnorm.h"

namespace tvllm {

std::string_view rmsnorm_kernel_name(RmsNormKernel kernel) {
  switch (kernel) {
    case RmsNormKernel::V1:
      return "v1";
    case RmsNormKernel::V2:
      return "v2";
    case RmsNormKernel::V3:
      return "v3";
  }
  return "?";
}

RmsNormKernel parse_rmsnorm_kernel(std::string_view name) {
  for (RmsNormKernel k : all_rmsnorm_kernels())
    if (rmsnorm_kernel_name(k) == name) return k;
  throw InputError("unknown rmsnorm kernel '" + std::string(name) + "' (expected v1, v2 or v3)");
}

const std::vector<RmsNormKernel>& all_rmsnorm_kernels() {
  static const std::vector<RmsNormKernel> kernels{RmsNormKernel::V1, RmsNormKernel::V2, RmsNormKernel::V3};
  return kernels;
}

RmsNormShape check_rmsnorm_args(const TensorView& out, const TensorView& x, const TensorView& weight,
                                const TensorView* residual, float eps) {
  const std::string what = residual ? "add_rmsnorm" : "rmsnorm";
  // Shapes first, then devices and dtypes, then pointers: the message names the most basic problem.
  TVLLM_REQUIRE(x.rank() >= 1, what + ": x must be [..., hidden], got " + x.describe());
  const int64_t H = x.dim(-1);
  TVLLM_REQUIRE(H > 0, what + ": empty rows in " + x.describe());
  TVLLM_REQUIRE(out.shape == x.shape,
                what + ": out " + out.describe() + " must have x's shape " + x.describe());
  TVLLM_REQUIRE(weight.rank() == 1 && weight.dim(0) == H,
                what + ": weight must be [" + std::to_string(H) + "], got " + weight.describe());
  TVLLM_REQUIRE(is_floating(weight.dtype),
                what + ": weight must be floating point, got " + weight.describe());
  TVLLM_REQUIRE(x.is_contiguous() && out.is_contiguous() && weight.is_contiguous(),
                what + ": x, out and weight must be contiguous");
  TVLLM_REQUIRE(std::isfinite(eps) && eps >= 0.0f,
                what + ": eps must be finite and >= 0, got " + std::to_string(eps));
  if (residual) {
    TVLLM_REQUIRE(residual->shape == x.shape,
                  what + ": residual " + residual->describe() + " must have x's shape " + x.describe());
    TVLLM_REQUIRE(residual->is_contiguous(), what + ": residual must be contiguous");
  }
  const Device device = x.device;
  const bool same_device =
      out.device == device && weight.device == device && (!residual || residual->device == device);
  TVLLM_REQUIRE(same_device, what + ": x " + x.describe() + ", out " + out.describe() + ", weight " +
                                 weight.describe() + (residual ? ", residual " + residual->describe() : "") +
                                 " must all be on one device");
  if (device == Device::CPU) {
    TVLLM_REQUIRE(
        x.dtype == DType::F32 && out.dtype == DType::F32 && (!residual || residual->dtype == DType::F32),
        what + ": the CPU reference works on F32 activations, got x " + x.describe() + ", out " +
            out.describe() + (residual ? ", residual " + residual->describe() : ""));
  } else {
    TVLLM_REQUIRE(x.dtype == DType::BF16 && out.dtype == DType::BF16 && weight.dtype == DType::BF16 &&
                      (!residual || residual->dtype == DType::BF16),
                  what + ": the GPU kernels take BF16 x, out, weight (and residual), got x " + x.describe() +
                      ", out " + out.describe() + ", weight " + weight.describe());
  }
  if (x.numel() > 0) {
    TVLLM_REQUIRE(x.data && out.data && weight.data && (!residual || residual->data),
                  what + ": null data pointer");
    // out == residual would overwrite the residual stream with its normalised copy: always a bug.
    TVLLM_REQUIRE(!residual || (residual->data != out.data && residual->data != x.data),
                  what + ": residual must be separate memory from out and x");
  }
  return {x.numel() / H, H};
}

namespace {

// One row. The oracle accumulates the sum of squares in double: its rounding error is then ~1e-16
// relative whatever H is, so the reference's only visible roundings are the two final fp32 ones, and
// any disagreement with a kernel or with Hugging Face is theirs. (HF sums in fp32: for H = 2048 that
// differs from the exact sum by ~1e-7 relative, far inside the 1e-5 we allow.)
void normalize_row(float* out, const float* row, const std::vector<float>& w, int64_t H, float eps) {
  // --- exercise 04.1: the fp32 reference ---------------------------------------------------------------
  // Task: one row of RMSNorm: out[h] = (row[h] / rms) * w[h] for h < H, where
  //   rms = sqrt((row[0]^2 + ... + row[H-1]^2) / H + eps). Round like Hugging Face: normalise first and
  //   round that to fp32, then multiply by the weight. out may be row itself (in place).
  // Hint: accumulate the sum of squares in double: the oracle's own rounding error then stays ~1e-16
  //   relative whatever H is.
  // Hint: compute 1 / rms once per row, then one multiply per element; read row[h] before writing out[h].
  // Tests: RmsNorm04.KnownAnswerOneToFour RmsNorm04.KnownAnswerEpsAndWeight RmsNorm04.ZeroRowGivesZeros
  // Tests: RmsNorm04.RowsAreIndependentAndScaleInvariant RmsNorm04.HugeAndTinyMagnitudes
  // Tests: RmsNorm04.AllOnesNeedsMoreThanBf16Accumulation RmsNorm04.Bf16WeightIsWidenedExactly
  // Tests: RmsNorm04.InPlaceEqualsOutOfPlace RmsNorm04.FusedKnownAnswer RmsNorm04.FusedEqualsAddThenNorm
  // Tests: RmsNorm04.AnyLeadingShape lesson04_rmsnorm.cpu
  // Stub:
  //   (void)out, (void)row, (void)w, (void)H, (void)eps;
  //   throw NotWrittenYet("04.1", "the fp32 reference");
  // --- solution ---
  double sum_sq = 0.0;
  for (int64_t h = 0; h < H; ++h) sum_sq += static_cast<double>(row[h]) * row[h];
  const double inv_rms = 1.0 / std::sqrt(sum_sq / static_cast<double>(H) + static_cast<double>(eps));
  for (int64_t h = 0; h < H; ++h) {
    // HF's order: normalise, round to the activation dtype (fp32 here), then multiply by the weight.
    const float normed = static_cast<float>(row[h] * inv_rms);
    out[h] = normed * w[h];  // row[h] was read above before out[h] is written: out may be x
  }
  // --- end of exercise 04.1 ---
}

std::vector<float> widen(const TensorView& weight) {
  std::vector<float> w(static_cast<size_t>(weight.numel()));  // [H]
  for (size_t h = 0; h < w.size(); ++h) w[h] = load_as_f32(weight.data, weight.dtype, h);
  return w;
}

}  // namespace

void rmsnorm_cpu(const TensorView& out, const TensorView& x, const TensorView& weight, float eps) {
  TVLLM_REQUIRE(x.device == Device::CPU, "rmsnorm_cpu: x must be on the CPU, got " + x.describe());
  const RmsNormShape s = check_rmsnorm_args(out, x, weight, nullptr, eps);
  const std::vector<float> w = widen(weight);
  for (int64_t r = 0; r < s.rows; ++r)
    normalize_row(out.ptr<float>() + r * s.hidden, x.ptr<const float>() + r * s.hidden, w, s.hidden, eps);
}

void add_rmsnorm_cpu(const TensorView& residual, const TensorView& x, const TensorView& weight,
                     const TensorView& out, float eps) {
  TVLLM_REQUIRE(x.device == Device::CPU, "add_rmsnorm_cpu: x must be on the CPU, got " + x.describe());
  const RmsNormShape s = check_rmsnorm_args(out, x, weight, &residual, eps);
  const std::vector<float> w = widen(weight);
  for (int64_t r = 0; r < s.rows; ++r) {
    float* res = residual.ptr<float>() + r * s.hidden;  // [H], updated in place
    const float* add = x.ptr<const float>() + r * s.hidden;
    for (int64_t h = 0; h < s.hidden; ++h) res[h] += add[h];  // one fp32 add: exactly what HF does
    normalize_row(out.ptr<float>() + r * s.hidden, res, w, s.hidden, eps);
  }
}

}  // namespace tvllm
