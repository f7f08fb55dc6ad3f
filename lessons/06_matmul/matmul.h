// Lesson 06: the linear layer, y = x W^T.
//
// Every projection in a Llama block (q, k, v, o, gate, up, down) and the lm_head is one call of
//
//     linear(y /*[T, out]*/, x /*[T, in]*/, w /*[out, in]*/, kernel, &handle)
//
// with W exactly as Hugging Face stores it: row o of W holds the in weights of output feature o, so
// y[t][o] = sum_i x[t][i] * W[o][i], a dot product of two contiguous rows.
//
// The device of the views decides the path:
//   CPU   the fp32 reference (the oracle): x, y fp32; w fp32, bf16 or fp16 (widened exactly);
//         each output summed in double, then rounded once to fp32.
//   CUDA  x, w bf16; y bf16 (or fp32); products summed in fp32. Eight versions:
//           v1  naive: one thread per output element
//           v2  tiled: 64x64 output tiles staged through shared memory, a 4x4 register block per thread
//           v3  WMMA: 128x128 tiles, bf16 in shared memory, tensor cores through nvcuda::wmma fragments
//           v4  mma.sync: the same tiles with PTX mma.sync m16n8k16, ldmatrix, cp.async double buffering
//           v5  cuBLAS cublasGemmEx (tensor cores) with the row-major trick: y^T = W x^T, OP_T / OP_N
//           v6  cuBLASLt cublasLtMatmul: the same product, with an explicit heuristic query and workspace
//           v7  batch-invariant: v4's kernel with K split into pieces decided by W's shape alone, the
//               partial sums added in a fixed order. Row t of y is the same bits whatever T is and
//               whatever the other rows hold (v5/v6 choose their algorithm, and so their summation
//               order, from T). The readable batch-invariant version.
//           v8  batch-invariant through cuBLASLt: ONE algorithm pinned per weight shape (chosen once, split-K
//               forced to 1), used at every T: cuBLAS's kernels, the order of additions fixed by W's shape
//               (matmul_pinned.cu). Runs v7 where no algorithm can be pinned. Lesson 11's engine uses it
//               when outputs must not depend on the batch (kBatchInvariantMatmulKernel).
//
// Streams: every version runs on handle->stream() (common/cublas.h: set_stream). Without a handle
// (v1 to v4 only) it runs on the legacy default stream. Nothing here allocates device memory or
// synchronises with the host; v6 and v8 make a cuBLASLt plan (host work) the first time they see a shape and
// reuse it afterwards, so a warm-up call before a CUDA graph capture makes every plan.
//
// This header is included by matmul.cu, so it stays C++17.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "common/cublas.h"
#include "common/tensor.h"

namespace tvllm {

enum class MatmulKernel {
  V1Naive, V2Tiled, V3Wmma, V4MmaSync, V5Cublas, V6CublasLt, V7BatchInvariant, V8PinnedLt
};

// The fastest correct version on an H200 (see README "Measured on an H200"); later lessons use this.
inline constexpr MatmulKernel kDefaultMatmulKernel = MatmulKernel::V5Cublas;
// The version an engine uses when a request's bits must not depend on its batch (lesson 11's
// EngineConfig::batch_invariant): v8, which runs v7 for any shape it cannot pin.
inline constexpr MatmulKernel kBatchInvariantMatmulKernel = MatmulKernel::V8PinnedLt;

// "v1" .. "v8", as on the command line (--kernel).
std::string_view matmul_kernel_version(MatmulKernel kernel);
// "naive", "tiled", "WMMA", "mma.sync", "cuBLAS GemmEx", "cuBLASLt", "batch-invariant",
// "batch-invariant cuBLASLt"
std::string_view matmul_kernel_description(MatmulKernel kernel);
// Whether the version needs a CublasHandle: v5, v6 and v8 call cuBLAS; v7 keeps its partial sums in the
// handle's workspace.
bool matmul_kernel_needs_handle(MatmulKernel kernel);
// Whether the version promises that row t of y is the same bits whatever the other rows are: v4, v7, v8.
bool matmul_kernel_is_batch_invariant(MatmulKernel kernel);
// Parses "v1" .. "v8"; throws InputError for anything else.
MatmulKernel parse_matmul_kernel(std::string_view version);
// Every version, in order.
const std::vector<MatmulKernel>& all_matmul_kernels();

// y = x W^T.   y: [T, out]   x: [T, in]   w: [out, in]   (row-major, contiguous)
// T may be 0 (nothing to do); in and out must be >= 1. y must not overlap x or w.
// kernel and handle matter on the GPU only: v5 to v8 need a handle; every version runs on its stream
// (v1 to v4 without one: the legacy default stream). v3 and v4 need compute capability 8.0 or later.
// Throws InputError naming the problem for wrong shapes, dtypes, devices or layouts.
void linear(const TensorView& y, const TensorView& x, const TensorView& w,
            MatmulKernel kernel = kDefaultMatmulKernel, const CublasHandle* handle = nullptr);

// ---- the seam for a faster GEMM on prefill-sized steps (lesson 15 fills it on Hopper) ----------------------
// linear() with the default kernel (v5, cuBLAS) on the GPU asks the installed function first when x has at least
// `min_tokens` rows. It returns false when it declines (dtype, K, alignment, another GPU): cuBLAS then runs.
// Never asked for v1-v4 (the lesson's own steps) nor v7/v8 (their batch invariance is a promise about every T).
// Lesson 06 cannot link lesson 15, hence a function pointer (lesson 07's install_fresh_prefill is the same idea).
using LargeGemmFn = bool (*)(const TensorView& y, const TensorView& x, const TensorView& w, cudaStream_t stream);
void install_large_gemm(LargeGemmFn fn, int64_t min_tokens);  // null uninstalls; published atomically
LargeGemmFn installed_large_gemm();
int64_t installed_large_gemm_min_tokens();

// v7's split of K for a weight [out, in]: `splits` pieces of `split_len` columns (a multiple of v4's K slice,
// 32; the last piece may be shorter). A function of (in, out) ONLY, never of the number of tokens: that is
// what makes v7's summation order, and so its bits, the same for every T. Enough pieces that a decode step's
// few tokens still give the GPU ~2 blocks per SM (~264 blocks), none shorter than 256 columns, at most 16.
struct SplitK {
  int splits = 1;
  int64_t split_len = 0;
};
SplitK batch_invariant_split(int64_t in, int64_t out);

// v8's pinned algorithm for a weight [out, in] and an output dtype (BF16 or F32) on the current device:
// chosen the first time the shape is seen (by this call or by linear()), then the same for the process.
// pinned: false when none could be pinned (the shape then runs v7); description: the algorithm's
// configuration (id, tile, stages, split-K, reduction, swizzle, custom option, inner and cluster shape), or
// why none was pinned. Needs a GPU.
struct PinnedMatmulAlgo {
  bool pinned = false;
  std::string description;
};
PinnedMatmulAlgo pinned_matmul_algo(int64_t in, int64_t out, DType out_dtype, const CublasHandle& handle);

// Fills a contiguous bf16 CUDA tensor with uniform random values in [lo, hi), made on the device from a
// hash of (seed, index): for benchmarks, where the host would take seconds to make a 262M-element W.
void fill_uniform_bf16(const TensorView& t, uint64_t seed, float lo = -1.f, float hi = 1.f,
                       cudaStream_t stream = nullptr);

namespace detail {
// The two paths behind linear(), called after it has validated every argument.
void linear_cpu(const TensorView& y, const TensorView& x, const TensorView& w);
void linear_cuda(const TensorView& y, const TensorView& x, const TensorView& w, MatmulKernel kernel,
                 const CublasHandle* handle);
// v8 (matmul_pinned.cu): runs y = x W^T with the shape's pinned algorithm and returns true, or returns false
// (nothing launched) where there is none or a pointer is less aligned than it needs: linear_cuda runs v7.
bool linear_pinned_lt(const TensorView& y, const TensorView& x, const TensorView& w, const CublasHandle& handle);
}  // namespace detail

}  // namespace tvllm
