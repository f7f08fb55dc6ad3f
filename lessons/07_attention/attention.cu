// Lesson 07 on the GPU: two ways to compute causal grouped-query attention.
//
//   v1  materialised   S = Q K^T * scale  (cuBLAS, fp32 scores in a workspace [n_heads, q_len, k_len])
//                      P = causal_softmax(S)  (causal_softmax_inplace_kernel, bf16 P written over S)
//                      O = P V  (cuBLAS)
//   v2  flash-style    flash_attention.cuh, instantiated here with the contiguous KV policy: one block per
//                      (sequence, head, 64 queries); K/V tiles of 64 keys stream through shared memory; an
//                      online softmax keeps a running max and sum; Q K^T and P V run on tensor cores.
//
// README.md derives both; the comments here say why each line is the way it is.
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>

#include "attention.h"
#include "common/cublas.h"
#include "common/exercise.h"
#include "flash_attention.cuh"

namespace tvllm {

namespace {

using bf16 = __nv_bfloat16;

// =================================================================================================
// v1: materialise the scores
// =================================================================================================

constexpr int kSoftmaxThreads = 256;
[[maybe_unused]]
constexpr int kSoftmaxItems = 4;  // values each thread has in flight per chunk (more loads in flight)

// Merges two partial softmax states (max m, sum l of exp(s - m)) into (m, l).
[[maybe_unused]] __device__ __forceinline__ void softmax_merge(float& m, float& l, float m2, float l2) {
  const float m_new = fmaxf(m, m2);
  if (m_new == -INFINITY) return;  // both sides saw no key: stay (-inf, 0); never compute -inf - -inf
  l = l * expf(m - m_new) + l2 * expf(m2 - m_new);  // an empty side has m = -inf: exp(-inf) = 0
  m = m_new;
}

// One block per (query row i, head h) of one sequence with q_len queries and k_len keys. scores:
// [n_heads, q_len, k_len] fp32, row i of head h at (h*q_len + i)*k_len. Query i sits at position
// k_len - q_len + i (the queries are the last q_len tokens) and sees keys j <= that position (and, with a
// sliding window W > 0, only j > position - W: the first `lo` keys of its row are masked too). Computes
// p_j = exp(s_j - max) / sum over the visible keys and writes it as bf16 OVER THE SAME ROW: the bf16 row
// occupies the first half of the fp32 row's bytes, so the P V GEMM reads P with a leading dimension of
// 2*k_len bf16 elements. Masked keys get p = 0.
__global__ void __launch_bounds__(kSoftmaxThreads) causal_softmax_inplace_kernel(float* scores, int q_len, int k_len,
                                                                                        int window) {
  // --- exercise 07.2: v1's causal softmax, in place ----------------------------------------------------
  // Task: block (i, h) turns row i of head h of the fp32 scores [n_heads, q_len, k_len] into
  //   probabilities: over the visible keys j < k_len - q_len + i + 1, p_j = exp(s_j - max) / sum;
  //   masked keys get 0. With a sliding window (window > 0) the keys j < k_len - q_len + i + 1 - window
  //   are masked as well. Write p as bf16 OVER the same row (the bf16 row fills the first half of the
  //   fp32 row's bytes: the P V GEMM reads it with leading dimension 2 * k_len). A row with no visible
  //   key writes zeros, never NaN.
  // Hint: one pass for (max, sum) per thread (online: when the max grows, rescale the sum), merge the
  //   pairs across the block with softmax_merge (shuffles, then shared memory), then a second pass.
  // Hint: writing in place: read a chunk of the row into registers, __syncthreads(), then write it;
  //   the bf16 writes of a chunk only land on fp32 elements this chunk or an earlier one has read.
  // Tests: Attention07Gpu.V1MatchesCpu
  // Needs: 07.1
  // Stub: device
  // --- solution ---
  const int i = blockIdx.x;
  const int n = k_len;  // the row length
  float* row = scores + (static_cast<size_t>(blockIdx.y) * q_len + i) * static_cast<size_t>(n);
  const int visible = k_len - q_len + i + 1;  // the causal mask: keys 0..position(i)
  const int lo = window > 0 ? max(0, visible - window) : 0;  // the sliding window: keys lo..position(i)

  // Pass 1: each thread folds its keys into a running (max, sum), the online softmax of README.md.
  float m = -INFINITY, l = 0.f;
  for (int j = lo + static_cast<int>(threadIdx.x); j < visible; j += blockDim.x) {
    const float s = row[j];
    if (s > m) {
      l = l * expf(m - s) + 1.f;  // the first key: m = -inf, exp(-inf) = 0
      m = s;
    } else if (s != -INFINITY) {
      l += expf(s - m);  // here m >= s > -inf: no -inf - -inf. (A NaN score lands here and stays NaN.)
    }
  }
  // Block reduction of the (max, sum) pairs: warp shuffles, then one warp over the warps' results.
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, offset);
    const float l2 = __shfl_xor_sync(0xffffffffu, l, offset);
    softmax_merge(m, l, m2, l2);
  }
  __shared__ float warp_m[kSoftmaxThreads / 32], warp_l[kSoftmaxThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    warp_m[warp] = m;
    warp_l[warp] = l;
  }
  __syncthreads();
  if (warp == 0) {
    const int num_warps = blockDim.x / 32;
    m = lane < num_warps ? warp_m[lane] : -INFINITY;
    l = lane < num_warps ? warp_l[lane] : 0.f;
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float m2 = __shfl_xor_sync(0xffffffffu, m, offset);
      const float l2 = __shfl_xor_sync(0xffffffffu, l, offset);
      softmax_merge(m, l, m2, l2);
    }
    if (lane == 0) {
      warp_m[0] = m;
      warp_l[0] = l;
    }
  }
  __syncthreads();
  const float row_max = warp_m[0] == -INFINITY ? 0.f : warp_m[0];  // a row with no key writes zeros, not NaN
  const float inv_sum = warp_l[0] > 0.f ? 1.f / warp_l[0] : 0.f;

  // Pass 2, in place. Chunk c covers fp32 elements [c0, c0 + C); its bf16 results land in bytes
  // [2*c0, 2*c0 + 2C), i.e. fp32 elements [c0/2, c0/2 + C/2), all of which were read in this chunk or an
  // earlier one. So: read the chunk, barrier, write it. Later chunks read elements >= c0 + C, which no
  // write has touched yet.
  bf16* prow = reinterpret_cast<bf16*>(row);
  constexpr int kChunk = kSoftmaxThreads * kSoftmaxItems;
  for (int c0 = 0; c0 < n; c0 += kChunk) {
    float p[kSoftmaxItems];
#pragma unroll
    for (int it = 0; it < kSoftmaxItems; ++it) {
      const int j = c0 + it * kSoftmaxThreads + threadIdx.x;
      p[it] = j >= lo && j < visible ? expf(row[j] - row_max) * inv_sum : 0.f;  // masked keys: not even read
    }
    __syncthreads();
#pragma unroll
    for (int it = 0; it < kSoftmaxItems; ++it) {
      const int j = c0 + it * kSoftmaxThreads + threadIdx.x;
      if (j < n) prow[j] = __float2bfloat16(p[it]);
    }
  }
  // --- end of exercise 07.2 ---
}

// Rows of a 2-D view are strides[0] elements apart (q, k, v may be column slices of one fused buffer).
int row_stride(const TensorView& t) { return static_cast<int>(t.strides[0]); }

void attention_v1_materialized(const TensorView& out, const TensorView& q, const TensorView& k,
                               const TensorView& v, const AttentionBatch& batch, const AttentionShape& shape,
                               AttentionWorkspace& workspace, cudaStream_t stream) {
  float* scores = static_cast<float*>(workspace.scratch());  // [n_heads, q_len, k_len] of one sequence
  CublasHandle& cublas = *workspace.cublas();
  if (cublas.stream() != stream) cublas.set_stream(stream);  // every cuBLAS call below runs on `stream`
  const cublasHandle_t handle = cublas.blas();
  const int D = static_cast<int>(shape.head_dim);
  const int group = static_cast<int>(shape.group_size());
  const int q_ld = row_stride(q), k_ld = row_stride(k), v_ld = row_stride(v), o_ld = row_stride(out);
  const float scale = static_cast<float>(shape.scale()), one = 1.f, zero = 0.f;
  const bf16* Q = q.ptr<const bf16>();  // [T_q rows, q_ld apart]
  const bf16* K = k.ptr<const bf16>();  // [T_k rows, k_ld apart]
  const bf16* V = v.ptr<const bf16>();  // [T_k rows, v_ld apart]
  bf16* O = out.ptr<bf16>();            // [T_q rows, o_ld apart]

  // The sequences take turns in the one scores buffer (the stream runs the calls in order).
  for (int b = 0; b < batch.batch_size(); ++b) {
    const int nq = batch.q_len(b), nk = batch.k_len(b);
    if (nq == 0) continue;
    const int64_t qb = batch.q_begin(b), kb = batch.k_begin(b);
    const int64_t head_scores = static_cast<int64_t>(nq) * nk;  // fp32 elements of one head's scores
    // cuBLAS is column-major: a row-major [rows, cols] matrix with row stride ld IS a column-major
    // [cols, rows] matrix with leading dimension ld (lesson 06's trick). Row-major S = Q K^T is
    // column-major S^T = K Q^T = (K^T)^T Q^T: A = K^T (OP_T), B = Q^T (OP_N), m = keys, n = queries.
    // One batched call per kv head covers its `group` query heads: A's batch stride is 0 (the group
    // shares the same K), B's is head_dim (the next query head's columns), C's is one head's scores.
    for (int kvh = 0; kvh < shape.n_kv_heads; ++kvh) {
      TVLLM_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
          handle, CUBLAS_OP_T, CUBLAS_OP_N, nk, nq, D, &scale,
          K + kb * k_ld + static_cast<int64_t>(kvh) * D, CUDA_R_16BF, k_ld, 0,
          Q + qb * q_ld + static_cast<int64_t>(kvh) * group * D, CUDA_R_16BF, q_ld, D, &zero,
          scores + static_cast<int64_t>(kvh) * group * head_scores, CUDA_R_32F, nk, head_scores, group,
          CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    }
    causal_softmax_inplace_kernel<<<dim3(nq, static_cast<unsigned>(shape.n_heads)), kSoftmaxThreads, 0, stream>>>(
        scores, nq, nk, static_cast<int>(shape.window));
    TVLLM_CHECK_LAUNCH();
    // Row-major O_h = P_h V is column-major O^T = V^T P^T: A = V^T (OP_N, m = head_dim, k = keys), B = P^T
    // (OP_N, n = queries) with leading dimension 2*nk (bf16 P sits in the first half of each fp32 row).
    const bf16* P = reinterpret_cast<const bf16*>(scores);
    for (int kvh = 0; kvh < shape.n_kv_heads; ++kvh) {
      TVLLM_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
          handle, CUBLAS_OP_N, CUBLAS_OP_N, D, nq, nk, &one,
          V + kb * v_ld + static_cast<int64_t>(kvh) * D, CUDA_R_16BF, v_ld, 0,
          P + static_cast<int64_t>(kvh) * group * 2 * head_scores, CUDA_R_16BF, 2 * nk, 2 * head_scores, &zero,
          O + qb * o_ld + static_cast<int64_t>(kvh) * group * D, CUDA_R_16BF, o_ld, D, group,
          CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    }
  }
}

void attention_v2_flash(const TensorView& out, const TensorView& q, const TensorView& k, const TensorView& v,
                        const AttentionBatch& batch, const AttentionShape& shape, cudaStream_t stream) {
  const flash::ContiguousKV kv{k.ptr<const bf16>(), v.ptr<const bf16>(), row_stride(k), row_stride(v),
                               static_cast<int>(shape.head_dim)};
  flash::launch(flash::make_params(out, q, batch, shape), kv, static_cast<int>(shape.n_heads), batch.batch_size(),
                batch.max_q_len(), stream);
}

}  // namespace

bool flash_supports_head_dim(int64_t head_dim) { return flash::path_for(head_dim) != flash::Path::Unsupported; }

std::string flash_path(int64_t head_dim) {
  const std::string d = std::to_string(head_dim);
  switch (flash::path_for(head_dim)) {
    case flash::Path::Mma64: return "tensor cores, 64-wide tiles";
    case flash::Path::Mma128: return "tensor cores, 128-wide tiles";
    case flash::Path::Mma64Padded: return "tensor cores, 64-wide tiles (head_dim " + d + " zero-padded)";
    case flash::Path::Mma128Padded: return "tensor cores, 128-wide tiles (head_dim " + d + " zero-padded)";
    case flash::Path::Simt: return "CUDA cores, one warp per query (head_dim " + d + " > 128)";
    case flash::Path::Unsupported: break;
  }
  return "unsupported (head_dim " + d + ")";
}

void attention_cuda(const TensorView& out, const TensorView& q, const TensorView& k, const TensorView& v,
                    const AttentionBatch& batch, const AttentionShape& shape, AttentionKernel kernel,
                    AttentionWorkspace* workspace, cudaStream_t stream) {
  if (kernel == AttentionKernel::V1Materialized) {
    attention_v1_materialized(out, q, k, v, batch, shape, *workspace, stream);
  } else {
    attention_v2_flash(out, q, k, v, batch, shape, stream);
  }
}

}  // namespace tvllm
