// Lesson 08, the GPU side of family_ops.h: the bias add and the per-head RMSNorm of q and k.
//
// Both are tiny next to the GEMMs around them (a bias is N values, a head is head_dim values), so they are
// written for clarity: one thread per element for the bias, one warp per (token, head) for the norm.
#include <cuda_bf16.h>

#include <algorithm>

#include "common/cuda_utils.cuh"
#include "common/errors.h"
#include "family_ops.h"

namespace tvllm {

namespace {

// y[t, n] = bf16(y[t, n] + b[n]): both widened to fp32, one rounding at the store. A grid-stride loop.
__global__ void add_bias_kernel(__nv_bfloat16* y, const __nv_bfloat16* b, int64_t rows, int64_t cols,
                                int64_t row_stride) {
  const int64_t n = rows * cols;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / cols, c = i - t * cols;
    __nv_bfloat16* p = y + t * row_stride + c;
    *p = __float2bfloat16_rn(__bfloat162float(*p) + __bfloat162float(b[c]));
  }
}

constexpr int kWarpsPerBlock = 4;

// Warp w of the grid normalises head (w % heads) of row (w / heads), in place, rounded like lesson 04's
// kernels (Qwen3RMSNorm is LlamaRMSNorm): normed = bf16(x * rsqrt(mean(x^2) + eps)), out = bf16(normed * w).
__global__ void head_rmsnorm_kernel(__nv_bfloat16* x, const __nv_bfloat16* weight, int64_t rows, int64_t heads,
                                    int64_t head_dim, int64_t row_stride, float eps) {
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize;
  const int lane = static_cast<int>(threadIdx.x % kWarpSize);
  if (warp >= rows * heads) return;  // the whole warp leaves together: warp_sum below needs all 32 lanes
  const int64_t t = warp / heads, h = warp - t * heads;
  __nv_bfloat16* slice = x + t * row_stride + h * head_dim;
  float sum_sq = 0.0f;
  for (int64_t d = lane; d < head_dim; d += kWarpSize) {
    const float v = __bfloat162float(slice[d]);
    sum_sq += v * v;
  }
  const float inv_rms = rsqrtf(warp_sum(sum_sq) / static_cast<float>(head_dim) + eps);
  for (int64_t d = lane; d < head_dim; d += kWarpSize) {  // each lane rewrites only what it read
    const float normed = __bfloat162float(__float2bfloat16_rn(__bfloat162float(slice[d]) * inv_rms));
    slice[d] = __float2bfloat16_rn(normed * __bfloat162float(weight[d]));
  }
}

}  // namespace

namespace detail {

void add_bias_cuda(const TensorView& y, const TensorView& bias, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const int64_t n = y.shape[0] * y.shape[1];
  const int64_t blocks = std::min<int64_t>(ceil_div(n, kThreads), 64 * 1024);
  add_bias_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      y.ptr<__nv_bfloat16>(), bias.ptr<const __nv_bfloat16>(), y.shape[0], y.shape[1], y.strides[0]);
  TVLLM_CHECK_LAUNCH();
}

void head_rmsnorm_cuda(const TensorView& x, const TensorView& weight, float eps, cudaStream_t stream) {
  const int64_t head_dim = weight.shape[0], heads = x.shape[1] / head_dim, rows = x.shape[0];
  const int64_t blocks = ceil_div(rows * heads, kWarpsPerBlock);
  TVLLM_REQUIRE(blocks <= 0x7fffffff, "head_rmsnorm: too many rows for one launch");
  head_rmsnorm_kernel<<<static_cast<unsigned>(blocks), kWarpsPerBlock * kWarpSize, 0, stream>>>(
      x.ptr<__nv_bfloat16>(), weight.ptr<const __nv_bfloat16>(), rows, heads, head_dim, x.strides[0], eps);
  TVLLM_CHECK_LAUNCH();
}

}  // namespace detail
}  // namespace tvllm
