// Lesson 16: the decode GEMV with FP8 weights.
//
//     out[M, N] = (x[M, K] · q[N, K]^T) ⊙ scale[N]        q: E4M3 codes, scale: one per weight row
//
// Lesson 14's v3 GEMV reads 2 bytes per weight; this one reads 1. The structure is v3's: a block of 256
// threads owns a tile of 4 weight rows and splits K among its threads, 16-byte loads streamed past L1;
// what changes is the inner loop. A 16-byte load now brings 16 weights, not 8; each pair is widened in
// registers (cvt.rn.f16x2.e4m3x2 on Hopper: one instruction for two, exact: every E4M3 value is a half)
// and multiplied into the fp32 sums with x. The per-row scale multiplies the finished sum ONCE (the
// point of per-channel scales: scale[n] · Σ_k q[n,k] x[k] = Σ_k (scale[n] q[n,k]) x[k]). So at batch 1
// the bytes per output fall from 2K to K + 4, and a memory-bound kernel should run ~2x faster.
//
// Rounding: the sum in fp32 (fused multiply-adds in a fixed order: a function of N and K only, never of
// M), times the scale in fp32, rounded once to out's dtype (BF16, or F32 for logits).
//
// The device of the views picks the path:
//   CPU   the reference: x BF16 or F32, every product and sum in double, the scale applied in double,
//         then rounded to fp32 and (BF16 out) to bf16, as the GPU's fp32 result is.
//   CUDA  x BF16 [M, K], q F8_E4M3 [N, K], scale F32 [N] (or [1]: one for the tensor), out BF16 or F32.
//         16-byte loads when K % 16 == 0 and x, q are 16-byte aligned, else byte loads (any shape).
//         Launched on `stream`; no allocation, no synchronisation.
//
// C++17: this header is included by fp8_gemv.cu.
#pragma once

#include <cuda_runtime.h>  // cudaStream_t

#include <cstdint>
#include <vector>

#include "common/tensor.h"

namespace tvllm {

inline constexpr int kFp8GemvMaxRows = 16;

void fp8_gemv(const TensorView& out, const TensorView& x, const TensorView& q, const TensorView& scale,
              cudaStream_t stream = nullptr);

// The reference's sums before rounding, for tests that bound the GPU's error: value[m * N + n] is the exact
// result (double), abs_sum[m * N + n] = scale[n] · Σ_k |x[m,k] q[n,k]| (what an fp32 summation's error is
// proportional to). Host views only.
struct Fp8GemvReference {
  std::vector<double> value;
  std::vector<double> abs_sum;
};
Fp8GemvReference fp8_gemv_reference(const TensorView& x, const TensorView& q, const TensorView& scale);

// Bytes one call moves at least: q + scales + x + out.
int64_t fp8_gemv_bytes_moved(int64_t M, int64_t N, int64_t K, DType out_dtype);

// The GPU launcher (fp8_gemv.cu), after the checks.
void fp8_gemv_cuda(void* out, bool out_f32, const void* x, const uint8_t* q, const float* scale, bool per_row_scale,
                   int M, int64_t N, int64_t K, cudaStream_t stream);

}  // namespace tvllm
