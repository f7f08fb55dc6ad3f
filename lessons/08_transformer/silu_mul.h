// Lesson 08: the two small kernels the decoder needs beyond lessons 03-07.
//
// SiLU·mul, the gated activation of Llama's MLP ("SwiGLU"):
//
//   out[t, i] = silu(gate[t, i]) * up[t, i]        silu(x) = x * sigmoid(x) = x / (1 + e^-x)
//
//   gate, up, out  [T, I]  (I = config.intermediate_size). gate and up may be column slices of ONE
//                          [T, 2I] buffer (the output of the packed gate|up GEMM): every view is 2-D with
//                          unit column stride and any row stride >= I.
//
// gather_rows, which picks the rows whose logits are wanted before the final norm and lm_head:
//
//   out[r, :] = x[rows[r], :]      out [R, H], x [T, H], rows I32 [R] (every entry in [0, T))
//
// The device of the views picks the path:
//   CPU   fp32 (the reference). silu in double, rounded once to fp32 (the activation tensor Hugging Face
//         keeps), then multiplied by up in fp32.
//   CUDA  bf16 in and out, fp32 math, rounded like Hugging Face's bf16 run (README "SiLU·mul, rounded like
//         Hugging Face"): act = bf16(silu(gate)), out = bf16(act * up). Queued on `stream`; no allocation,
//         no synchronisation (capturable in a CUDA graph).
//
// gather_rows trusts `rows` on the GPU (the caller validated them on the host: StepInputs does); the CPU
// path checks every entry.
//
// C++17: this header is included by silu_mul.cu.
#pragma once

#include <cuda_runtime.h>  // cudaStream_t

#include <cstdint>

#include "common/tensor.h"

namespace tvllm {

// out = silu(gate) * up. Throws InputError naming the problem for wrong shapes, dtypes, devices or strides.
// out may not overlap gate or up.
void silu_mul(const TensorView& out, const TensorView& gate, const TensorView& up,
              cudaStream_t stream = nullptr);

// out[r] = x[rows[r]]. x, out: contiguous [T, H] / [R, H], same dtype and device; rows: I32 [R] on that
// device. R may be 0 (nothing to do).
void gather_rows(const TensorView& out, const TensorView& x, const TensorView& rows,
                 cudaStream_t stream = nullptr);

// The fp32 silu in double, rounded once: the CPU reference's activation (exposed for the tests).
float silu_f32(float x);

// Checks shared by both paths; returns {rows, cols}.
struct SiluMulShape {
  int64_t rows = 0;
  int64_t cols = 0;
};
SiluMulShape check_silu_mul_args(const TensorView& out, const TensorView& gate, const TensorView& up);

namespace detail {
void silu_mul_cpu(const TensorView& out, const TensorView& gate, const TensorView& up);
void silu_mul_cuda(const TensorView& out, const TensorView& gate, const TensorView& up, cudaStream_t stream);
void gather_rows_cuda(const TensorView& out, const TensorView& x, const TensorView& rows,
                      cudaStream_t stream);
}  // namespace detail

}  // namespace tvllm
