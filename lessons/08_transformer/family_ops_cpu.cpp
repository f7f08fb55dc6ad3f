// Lesson 08: add_bias and head_rmsnorm (family_ops.h): argument checks, dispatch, the fp32 references.
#include <cmath>
#include <string>

#include "common/errors.h"
#include "family_ops.h"
#include "rmsnorm.h"

namespace tvllm {

namespace {

// The activation of both ops: 2-D, contiguous columns, rows at any stride >= the width (a column view of the
// packed QKV buffer qualifies), F32 on the CPU and BF16 on the GPU.
void check_rows(const char* op, const TensorView& x) {
  const std::string what = std::string(op) + ": " + x.describe();
  TVLLM_REQUIRE(x.rank() == 2, what + " must be [tokens, width]");
  TVLLM_REQUIRE(x.shape[1] >= 1, what + " has no columns");
  TVLLM_REQUIRE(x.shape[1] <= 1 || x.strides[1] == 1, what + " must have contiguous columns");
  TVLLM_REQUIRE(x.shape[0] <= 1 || x.strides[0] >= x.shape[1], what + " has a row stride below its width");
  TVLLM_REQUIRE(x.numel() == 0 || x.data != nullptr, what + " has no data");
  const DType want = x.device == Device::CPU ? DType::F32 : DType::BF16;
  TVLLM_REQUIRE(x.dtype == want, what + ": on " + std::string(device_name(x.device)) + " it must be " +
                                     std::string(dtype_name(want)));
}

// The parameter of both ops: 1-D, contiguous, on x's device; any floating dtype on the CPU, BF16 on the GPU
// (the CUDA binding converts every weight to bf16).
void check_param(const char* op, const char* name, const TensorView& p, const TensorView& x, int64_t n) {
  const std::string what = std::string(op) + ": " + name + " " + p.describe();
  TVLLM_REQUIRE(p.rank() == 1 && p.shape[0] == n, what + " must be [" + std::to_string(n) + "]");
  TVLLM_REQUIRE(p.is_contiguous() && p.data != nullptr, what + " must be contiguous, with data");
  TVLLM_REQUIRE(p.device == x.device, what + " must be on the device of " + x.describe());
  TVLLM_REQUIRE(x.device == Device::CPU ? is_floating(p.dtype) : p.dtype == DType::BF16,
                what + ": the CPU widens any floating dtype, the GPU takes BF16");
}

}  // namespace

void add_bias(const TensorView& y, const TensorView& bias, cudaStream_t stream) {
  check_rows("add_bias", y);
  const int64_t T = y.shape[0], N = y.shape[1];
  check_param("add_bias", "bias", bias, y, N);
  if (T == 0) return;
  if (y.device == Device::CUDA) {
    detail::add_bias_cuda(y, bias, stream);
    return;
  }
  // fp32 reference: the bias widened exactly, one fp32 addition per element (what an fp32 nn.Linear adds).
  std::vector<float> b(static_cast<size_t>(N));
  for (int64_t n = 0; n < N; ++n) b[static_cast<size_t>(n)] = load_as_f32(bias.data, bias.dtype, static_cast<size_t>(n));
  for (int64_t t = 0; t < T; ++t) {
    float* row = y.ptr<float>() + t * y.strides[0];
    for (int64_t n = 0; n < N; ++n) row[n] += b[static_cast<size_t>(n)];
  }
}

void head_rmsnorm(const TensorView& x, const TensorView& weight, float eps, cudaStream_t stream) {
  check_rows("head_rmsnorm", x);
  TVLLM_REQUIRE(weight.rank() == 1 && weight.shape[0] >= 1,
                "head_rmsnorm: weight must be [head_dim], got " + weight.describe());
  const int64_t T = x.shape[0], D = weight.shape[0];
  TVLLM_REQUIRE(x.shape[1] % D == 0, "head_rmsnorm: the width of " + x.describe() +
                                         " is not a whole number of heads of head_dim " + std::to_string(D));
  check_param("head_rmsnorm", "weight", weight, x, D);
  TVLLM_REQUIRE(std::isfinite(eps) && eps >= 0.0f, "head_rmsnorm: eps must be finite and >= 0");
  if (T == 0) return;
  if (x.device == Device::CUDA) {
    detail::head_rmsnorm_cuda(x, weight, eps, stream);
    return;
  }
  // A row's heads are contiguous [heads, head_dim]: lesson 04's fp32 reference normalises each as a row.
  const int64_t heads = x.shape[1] / D;
  for (int64_t t = 0; t < T; ++t) {
    const TensorView row =
        TensorView::contiguous(x.ptr<float>() + t * x.strides[0], DType::F32, Device::CPU, {heads, D});
    rmsnorm_cpu(row, row, weight, eps);
  }
}

}  // namespace tvllm
