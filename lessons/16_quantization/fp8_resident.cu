// Lesson 16: FP8 weights resident in the engine (fp8_resident.h): the dequantizer the composed forward's GEMMs
// use, and the choice between resident and dequantize-at-load.
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "common/cuda_utils.cuh"
#include "common/dtype.h"
#include "common/errors.h"
#include "fp8_gemm.h"  // quantize_activations: the per-row quantizer the lm_head reuses
#include "fp8_resident.h"
#include "model_weights.h"

namespace tvllm {

namespace {

constexpr int kThreads = 256;

// One thread per 4 codes (a 4-byte load, an 8-byte store) when K % 4 == 0, else one per code. A weight is
// dequantized right before its GEMM, which reads the result from L2 where it fits: a plain streaming kernel.
template <bool kFour>
__global__ void dequantize_fp8_kernel(__nv_bfloat16* dst, const uint8_t* q, const float* scale, bool per_row,
                                      int64_t rows, int64_t K) {
  constexpr int kPer = kFour ? 4 : 1;
  const int64_t n = rows * K / kPer;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int64_t first = i * kPer;
    const float s = scale[per_row ? first / K : 0];
    uint32_t codes = kFour ? reinterpret_cast<const uint32_t*>(q)[i] : q[first];
#pragma unroll
    for (int j = 0; j < kPer; ++j, codes >>= 8) {
      // Exact: every E4M3 value is a half; the product with a BF16-born scale is exact in fp32.
      const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(codes & 0xffu), __NV_E4M3);
      dst[first + j] = __float2bfloat16_rn(__fmul_rn(__half2float(__half(h)), s));
    }
  }
}

void check(const TensorView& dst, const TensorView& q, const TensorView& scale) {
  TVLLM_REQUIRE(q.rank() == 2 && q.dtype == DType::F8_E4M3 && q.is_contiguous() && q.data,
                "dequantize_fp8_weight: q must be a contiguous F8_E4M3 [R, K], got " + q.describe());
  TVLLM_REQUIRE(dst.dtype == DType::BF16 && dst.shape == q.shape && dst.is_contiguous() && dst.data,
                "dequantize_fp8_weight: dst must be a contiguous BF16 " + shape_str(q.shape) + ", got " +
                    dst.describe());
  const int64_t R = q.shape[0];
  TVLLM_REQUIRE(scale.dtype == DType::F32 && scale.is_contiguous() && scale.data &&
                    (scale.numel() == R || scale.numel() == 1),
                "dequantize_fp8_weight: scale must be F32 with one value per row (" + std::to_string(R) +
                    ") or one for the tensor, got " + scale.describe());
  TVLLM_REQUIRE(dst.device == q.device && scale.device == q.device,
                "dequantize_fp8_weight: dst, q and scale must be on one device");
}

}  // namespace

void dequantize_fp8_weight(const TensorView& dst, const TensorView& q, const TensorView& scale, cudaStream_t stream) {
  check(dst, q, scale);
  const int64_t R = q.shape[0], K = q.shape[1];
  const bool per_row = scale.numel() == R && R > 1;
  if (q.device == Device::CPU) {
    uint16_t* out = dst.ptr<uint16_t>();
    const uint8_t* codes = q.ptr<uint8_t>();
    for (int64_t r = 0; r < R; ++r) {
      const float s = scale.ptr<const float>()[per_row ? r : 0];
      for (int64_t k = 0; k < K; ++k) out[r * K + k] = f32_to_bf16(fp8_e4m3_to_f32(codes[r * K + k]) * s);
    }
    return;
  }
  if (R * K == 0) return;
  const bool four = K % 4 == 0 && pointer_alignment(q.data) >= 4;
  const int64_t items = four ? R * K / 4 : R * K;
  const int blocks = static_cast<int>(std::min<int64_t>(ceil_div(items, kThreads), 132 * 16));
  auto* out = dst.ptr<__nv_bfloat16>();
  if (four)
    dequantize_fp8_kernel<true><<<blocks, kThreads, 0, stream>>>(out, q.ptr<const uint8_t>(),
                                                                  scale.ptr<const float>(), per_row, R, K);
  else
    dequantize_fp8_kernel<false><<<blocks, kThreads, 0, stream>>>(out, q.ptr<const uint8_t>(),
                                                                   scale.ptr<const float>(), per_row, R, K);
  TVLLM_CHECK_LAUNCH();
}

void install_fp8_resident_weights() { install_fp8_weight_dequantizer(dequantize_fp8_weight); }

Fp8Load fp8_weights_mode(const std::string& choice, const ModelConfig& config, bool cuda, bool fused) {
  const bool quantized = config.quantization.has_value();
  if (choice == "dequantize") return Fp8Load::Dequantize;
  if (choice == "resident") {
    if (!quantized)
      throw InputError("--fp8-weights resident: the model is not an FP8 checkpoint (no quantization_config; make one "
                       "with tiny-vllm quantize)");
    if (!cuda) throw InputError("--fp8-weights resident: FP8 weights stay resident only on CUDA (use --device cuda)");
    if (!fused)
      throw InputError("--fp8-weights resident: needs the fused GEMV decode path, which reads them (drop --no-fused)");
    return Fp8Load::Resident;
  }
  if (choice != "auto")
    throw InputError("--fp8-weights: expected auto, resident or dequantize, got \"" + choice + "\"");
  return quantized && cuda && fused ? Fp8Load::Resident : Fp8Load::Dequantize;
}

std::string describe_fp8_weights(const ModelConfig& config, Fp8Load mode) {
  if (!config.quantization) return "";
  return mode == Fp8Load::Resident ? "FP8 weights resident (E4M3 decode GEMVs, per-row scales)"
                                   : "FP8 weights dequantized to bf16 at load";
}

void attach_fp8_lm_head(ModelWeights& w) {
  TVLLM_REQUIRE(w.device == Device::CUDA && w.lm_head.dtype == DType::BF16 && w.lm_head.rank() == 2,
                "--fp8-lm-head: the lm_head is quantized on the GPU from BF16, got " + w.lm_head.describe());
  w.allocate_fp8_lm_head();
  // A vocabulary entry is a row of lm_head as a token is a row of x: the same amax / 448 per row, the same codes.
  quantize_activations(w.lm_head_fp8, w.lm_head_scale, w.lm_head);
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());  // load time: ready before the first step
}

void require_fp8_lm_head(bool wanted, bool weights_resident) {
  if (wanted && !weights_resident)
    throw InputError("--fp8-lm-head: needs FP8 weights resident on the GPU (an FP8 checkpoint with --fp8-weights "
                     "resident, on CUDA, with the fused decode path): the FP8 lm_head is read by the FP8 decode GEMVs");
}

}  // namespace tvllm
