// Lesson 04: RMSNorm, Llama's normalisation. For each row x of length H (one token's hidden vector):
//
//   rms  = sqrt( (x_0^2 + x_1^2 + ... + x_{H-1}^2) / H + eps )
//   y_i  = (x_i / rms) * w_i                          w: the learned weight [H], eps: config.rms_norm_eps
//
// and the fused form used between the decoder's sublayers (lesson 08):
//
//   residual += x;   out = rmsnorm(residual) * w      (one pass over memory instead of two)
//
// The device of the views decides the path:
//   CPU   the fp32 reference (the oracle): x, out, residual F32; the weight any floating dtype
//   CUDA  bf16 x, out, residual and weight; fp32 accumulation. Rounding follows Hugging Face's
//         LlamaRMSNorm exactly: normalise in fp32, round to bf16, THEN multiply by the weight and round
//         again (`weight * hidden.to(input_dtype)`). README "Rounding like Hugging Face" says why.
//
// Views are [..., H] (any rank >= 1, contiguous); every leading index is one row. out may be x itself
// (in place); in add_rmsnorm, out must not be the residual.
//
// C++17: this header is included by rmsnorm.cu.
#pragma once

#include <cuda_runtime.h>  // cudaStream_t

#include <cstdint>
#include <string_view>
#include <vector>

#include "common/tensor.h"

namespace tvllm {

enum class RmsNormKernel {
  V1,  // one block per row, shared-memory tree reduction with __syncthreads()
  V2,  // one block per row, warp-shuffle reduction (__shfl_xor_sync) + one shared slot per warp
  V3,  // v2's reduction, 16-byte vector loads, the row held in registers: x is read from memory once
};
inline constexpr RmsNormKernel kDefaultRmsNormKernel = RmsNormKernel::V3;

std::string_view rmsnorm_kernel_name(RmsNormKernel kernel);  // "v1", "v2", "v3"
RmsNormKernel parse_rmsnorm_kernel(std::string_view name);   // throws InputError for anything else
const std::vector<RmsNormKernel>& all_rmsnorm_kernels();     // v1, v2, v3

// Which kernel, and (v3 only) how many vectors each thread holds. Converts from a plain RmsNormKernel, so
// rmsnorm(out, x, w, eps, RmsNormKernel::V1) reads naturally.
struct RmsNormOptions {
  RmsNormOptions(RmsNormKernel k = kDefaultRmsNormKernel,
                 int vectors_per_thread = 0)  // NOLINT: implicit on purpose
      : kernel(k), v3_vectors_per_thread(vectors_per_thread) {}
  RmsNormKernel kernel;
  // v3: each thread keeps this many vectors (of up to 8 bf16) of the row in registers: 1, 2, 4 or 8, or 0 to
  // let the launcher choose from H. The benchmark sweeps it; everyone else leaves it at 0.
  int v3_vectors_per_thread;
};

// How the GPU launcher shapes a v3 launch for a given row (exposed for the benchmark and the tests).
struct RmsNormV3Shape {
  bool fits = false;           // false: the row is too long to hold in registers; v3 runs v2 instead
  int vector_elems = 0;        // bf16 per load: 8 (16 bytes), 4, 2 or 1, from H and the pointers' alignment
  int vectors_per_thread = 0;  // 1, 2, 4 or 8
  int threads = 0;             // per block: a multiple of 32, at most 1024
};
// vector_elems: the widest of 8, 4, 2, 1 that divides H and every pointer's alignment allows.
RmsNormV3Shape rmsnorm_v3_shape(int64_t hidden, int vector_elems, int vectors_per_thread_request);

// out = rmsnorm(x) * weight. x, out [..., H]; weight [H]; eps >= 0 (config.rms_norm_eps).
// GPU: launched on `stream` (nullptr: the legacy default stream) and returns without waiting; it
// allocates nothing and never synchronises, so it may be captured in a CUDA graph. (CPU: stream ignored.)
void rmsnorm(const TensorView& out, const TensorView& x, const TensorView& weight, float eps,
             RmsNormOptions options = {}, cudaStream_t stream = nullptr);

// residual += x (stored in residual's dtype), then out = rmsnorm(residual) * weight, normalising the
// residual exactly as stored (bf16 on the GPU), so the fused form equals the two steps done apart.
// GPU: on `stream`, asynchronous, like rmsnorm().
void add_rmsnorm(const TensorView& residual, const TensorView& x, const TensorView& weight,
                 const TensorView& out, float eps, RmsNormOptions options = {}, cudaStream_t stream = nullptr);

// The fp32 references on the host (what the functions above run when the views are on the CPU).
void rmsnorm_cpu(const TensorView& out, const TensorView& x, const TensorView& weight, float eps);
void add_rmsnorm_cpu(const TensorView& residual, const TensorView& x, const TensorView& weight,
                     const TensorView& out, float eps);

// Checks shared by both paths (InputError naming the problem); returns {rows, H}.
struct RmsNormShape {
  int64_t rows = 0;
  int64_t hidden = 0;
};
// residual may be null (plain rmsnorm).
RmsNormShape check_rmsnorm_args(const TensorView& out, const TensorView& x, const TensorView& weight,
                                const TensorView* residual, float eps);

}  // namespace tvllm
