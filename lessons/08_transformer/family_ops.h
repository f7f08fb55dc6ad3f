// Lesson 08: the two small steps by which the Llama-like families differ from Llama (README "Other Llama-like
// families"). Each is a step the ONE forward runs or skips, according to what the checkpoint holds.
//
// add_bias, a projection's bias (Qwen2's q/k/v, Llama's attention_bias and mlp_bias):
//
//   y[t, n] += b[n]          y [T, N] (unit column stride, any row stride >= N), b [N]
//
// head_rmsnorm, Qwen3's q_norm / k_norm: every head's slice of a q or k row normalised on its own, before RoPE,
//
//   x[t, h*D : (h+1)*D] = rmsnorm(x[t, h*D : (h+1)*D]) * weight       weight [D] (D = head_dim), in place
//
//   x [T, heads * D]: q or k, e.g. a column view of the packed QKV buffer (unit column stride, any row stride).
//
// The device of the views picks the path:
//   CPU   the fp32 reference: y / x F32, b / weight any floating dtype (widened exactly). add_bias is one
//         fp32 addition per element; head_rmsnorm is lesson 04's reference applied to each head's slice.
//   CUDA  bf16 in and out, fp32 math, rounded at the store like the other kernels of the bf16 path. add_bias:
//         y = bf16(y + b) (Hugging Face's bf16 Linear adds the bias inside the GEMM before its one rounding;
//         we round the GEMM's output and then the sum: at most one more bf16 rounding, README says more).
//         head_rmsnorm rounds exactly as lesson 04's kernels (and Qwen3RMSNorm) do: normalise in fp32, round
//         to bf16, multiply by the weight, round again. Queued on `stream`; no allocation, no
//         synchronisation (capturable in a CUDA graph).
//
// C++17: this header is included by family_ops.cu.
#pragma once

#include <cuda_runtime.h>  // cudaStream_t

#include <cstdint>

#include "common/tensor.h"

namespace tvllm {

// y += bias over every row. InputError naming the problem for wrong shapes, dtypes, devices or strides.
void add_bias(const TensorView& y, const TensorView& bias, cudaStream_t stream = nullptr);

// Each head_dim slice of every row of x normalised in place with weight [head_dim]; eps = rms_norm_eps.
// x's width must be a multiple of head_dim. InputError otherwise.
void head_rmsnorm(const TensorView& x, const TensorView& weight, float eps, cudaStream_t stream = nullptr);

namespace detail {
void add_bias_cuda(const TensorView& y, const TensorView& bias, cudaStream_t stream);
void head_rmsnorm_cuda(const TensorView& x, const TensorView& weight, float eps, cudaStream_t stream);
}  // namespace detail

}  // namespace tvllm
