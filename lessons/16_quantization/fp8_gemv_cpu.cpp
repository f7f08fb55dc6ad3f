// Lesson 16, the host side of the FP8 GEMV: argument checks, the double-precision reference, dispatch.
#include <cmath>
#include <cstdint>
#include <string>

#include "common/dtype.h"
#include "common/errors.h"
#include "fp8_gemv.h"

namespace tvllm {

namespace {

struct Dims {
  int64_t M, N, K;
  bool per_row;
};

Dims check(const TensorView* out, const TensorView& x, const TensorView& q, const TensorView& scale) {
  const std::string what = "fp8_gemv";
  TVLLM_REQUIRE(x.rank() == 2 && q.rank() == 2, what + ": x must be [M, K] and q [N, K], got x " + x.describe() +
                                                    " and q " + q.describe());
  const int64_t M = x.shape[0], K = x.shape[1], N = q.shape[0];
  TVLLM_REQUIRE(K >= 1 && N >= 1 && q.shape[1] == K,
                what + ": q " + q.describe() + " must have x's " + std::to_string(K) + " columns");
  TVLLM_REQUIRE(M <= kFp8GemvMaxRows, what + ": at most " + std::to_string(kFp8GemvMaxRows) + " rows, got " +
                                          x.describe());
  TVLLM_REQUIRE(q.dtype == DType::F8_E4M3, what + ": q must be F8_E4M3, got " + q.describe());
  TVLLM_REQUIRE(scale.dtype == DType::F32 && (scale.numel() == N || scale.numel() == 1),
                what + ": scale must be F32 with N = " + std::to_string(N) + " elements (per row) or 1, got " +
                    scale.describe());
  const bool gpu = q.device != Device::CPU;
  TVLLM_REQUIRE(x.dtype == DType::BF16 || (!gpu && x.dtype == DType::F32),
                what + (gpu ? ": the GPU kernel takes BF16 x, got " : ": x must be BF16 or F32, got ") + x.describe());
  TVLLM_REQUIRE(x.is_contiguous() && q.is_contiguous() && scale.is_contiguous(), what + ": operands must be contiguous");
  TVLLM_REQUIRE(x.device == q.device && scale.device == q.device, what + ": x, q and scale must be on one device");
  if (out) {
    TVLLM_REQUIRE(out->rank() == 2 && out->shape[0] == M && out->shape[1] == N,
                  what + ": out must be " + shape_str({M, N}) + ", got " + out->describe());
    TVLLM_REQUIRE(out->dtype == DType::BF16 || out->dtype == DType::F32, what + ": out must be BF16 or F32");
    TVLLM_REQUIRE(out->device == q.device && out->is_contiguous(), what + ": out must be contiguous, on q's device");
    TVLLM_REQUIRE(M == 0 || (out->data && x.data && q.data && scale.data), what + ": null data pointer");
  }
  return {M, N, K, scale.numel() == N && N > 1};
}

}  // namespace

Fp8GemvReference fp8_gemv_reference(const TensorView& x, const TensorView& q, const TensorView& scale) {
  const Dims d = check(nullptr, x, q, scale);
  TVLLM_REQUIRE(q.device == Device::CPU, "fp8_gemv_reference: host views only");
  Fp8GemvReference r;
  r.value.resize(static_cast<size_t>(d.M * d.N));
  r.abs_sum.resize(r.value.size());
  const uint8_t* codes = q.ptr<uint8_t>();
  for (int64_t n = 0; n < d.N; ++n) {
    const double s = scale.ptr<float>()[d.per_row ? n : 0];
    for (int64_t m = 0; m < d.M; ++m) {
      double sum = 0.0, abs_sum = 0.0;
      for (int64_t k = 0; k < d.K; ++k) {
        // an E4M3 value (4 significant bits) times a bf16 or fp32 value: exact in double
        const double p = static_cast<double>(load_as_f32(x.data, x.dtype, static_cast<size_t>(m * d.K + k))) *
                         fp8_e4m3_to_f32(codes[n * d.K + k]);
        sum += p;
        abs_sum += std::fabs(p);
      }
      r.value[static_cast<size_t>(m * d.N + n)] = sum * s;
      r.abs_sum[static_cast<size_t>(m * d.N + n)] = abs_sum * std::fabs(s);
    }
  }
  return r;
}

void fp8_gemv(const TensorView& out, const TensorView& x, const TensorView& q, const TensorView& scale,
              cudaStream_t stream) {
  const Dims d = check(&out, x, q, scale);
  if (d.M == 0) return;
  if (q.device == Device::CPU) {
    const Fp8GemvReference r = fp8_gemv_reference(x, q, scale);
    for (size_t i = 0; i < r.value.size(); ++i) store_from_f32(out.data, out.dtype, i, static_cast<float>(r.value[i]));
    return;
  }
  fp8_gemv_cuda(out.data, out.dtype == DType::F32, x.data, q.ptr<uint8_t>(), scale.ptr<float>(), d.per_row,
                static_cast<int>(d.M), d.N, d.K, stream);
}

int64_t fp8_gemv_bytes_moved(int64_t M, int64_t N, int64_t K, DType out_dtype) {
  return N * K + N * 4 + M * K * 2 + M * N * static_cast<int64_t>(dtype_size(out_dtype));
}

}  // namespace tvllm
