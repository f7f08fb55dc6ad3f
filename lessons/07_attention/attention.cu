// Lesson 07 on the GPU: two ways to compute causal grouped-query attention.
//
//   v1  materialised   S = Q K^T * scale  (cuBLAS, fp32 scores in a workspace [n_heads, n, n])
//                      P = causal_softmax(S)  (causal_softmax_inplace_kernel, bf16 P written over S)
//                      O = P V  (cuBLAS)
//   v2  flash-style    flash_attention_kernel<D>: one block per (sequence, head, 64 queries); K/V tiles of
//                      64 keys stream through shared memory; an online softmax keeps a running max and sum;
//                      Q K^T and P V run on tensor cores (mma.sync m16n8k16, bf16 in, fp32 accumulate).
//
// README.md derives both; the comments here say why each line is the way it is.
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>

#include "attention.h"

namespace tvllm {

namespace {

using bf16 = __nv_bfloat16;

std::string gib(size_t bytes) {
  char text[64];
  std::snprintf(text, sizeof text, "%.2f GiB", static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0));
  return text;
}

// =================================================================================================
// v1: materialise the scores
// =================================================================================================

constexpr int kSoftmaxThreads = 256;
constexpr int kSoftmaxItems = 4;  // values each thread has in flight per chunk (more loads in flight)

// Merges two partial softmax states (max m, sum l of exp(s - m)) into (m, l).
__device__ __forceinline__ void softmax_merge(float& m, float& l, float m2, float l2) {
  const float m_new = fmaxf(m, m2);
  if (m_new == -INFINITY) return;  // both sides saw no key: stay (-inf, 0); never compute -inf - -inf
  l = l * expf(m - m_new) + l2 * expf(m2 - m_new);  // an empty side has m = -inf: exp(-inf) = 0
  m = m_new;
}

// One block per (query row i, head h) of one sequence of length n. scores: [n_heads, n, n] fp32, row i of
// head h at (h*n + i)*n. Computes p_j = exp(s_j - max) / sum over the visible keys j <= i and writes it
// as bf16 OVER THE SAME ROW: the bf16 row occupies the first half of the fp32 row's bytes, so the P V
// GEMM reads P with a leading dimension of 2n bf16 elements. Masked keys (j > i) get p = 0.
__global__ void __launch_bounds__(kSoftmaxThreads) causal_softmax_inplace_kernel(float* scores, int n) {
  const int i = blockIdx.x;
  float* row = scores + (static_cast<size_t>(blockIdx.y) * n + i) * static_cast<size_t>(n);
  const int visible = i + 1;  // the causal mask: keys 0..i

  // Pass 1: each thread folds its keys into a running (max, sum), the online softmax of README.md.
  float m = -INFINITY, l = 0.f;
  for (int j = threadIdx.x; j < visible; j += blockDim.x) {
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
      p[it] = j < visible ? expf(row[j] - row_max) * inv_sum : 0.f;  // masked keys: not even read
    }
    __syncthreads();
#pragma unroll
    for (int it = 0; it < kSoftmaxItems; ++it) {
      const int j = c0 + it * kSoftmaxThreads + threadIdx.x;
      if (j < n) prow[j] = __float2bfloat16(p[it]);
    }
  }
}

void attention_v1_materialized(const TensorView& out, const TensorView& q, const TensorView& k,
                               const TensorView& v, const VarlenBatch& batch, const AttentionShape& shape,
                               AttentionWorkspace& workspace) {
  const size_t bytes = attention_workspace_bytes(AttentionKernel::V1Materialized, batch, shape);
  float* scores = nullptr;  // [n_heads, n, n] for the sequence being processed
  try {
    scores = static_cast<float*>(workspace.scratch(bytes));
  } catch (const CudaError& e) {
    throw CudaError("attention v1 (materialised) needs " + gib(bytes) + " of device memory for its scores (" +
                    std::to_string(shape.n_heads) + " heads x " + std::to_string(batch.max_seqlen()) + "^2 x 4 bytes), " +
                    "which does not fit; the flash kernel v2 needs none. (" + e.what() + ")");
  }
  cublasHandle_t handle = workspace.cublas();
  const int D = static_cast<int>(shape.head_dim);
  const int group = static_cast<int>(shape.group_size());
  const int q_dim = static_cast<int>(shape.q_dim()), kv_dim = static_cast<int>(shape.kv_dim());
  const float scale = static_cast<float>(shape.scale()), one = 1.f, zero = 0.f;
  const bf16* Q = q.ptr<const bf16>();  // [T, q_dim]
  const bf16* K = k.ptr<const bf16>();  // [T, kv_dim]
  const bf16* V = v.ptr<const bf16>();  // [T, kv_dim]
  bf16* O = out.ptr<bf16>();            // [T, q_dim]

  // The sequences take turns in the one scores buffer (the stream runs the calls in order).
  for (int b = 0; b < batch.batch_size(); ++b) {
    const int n = batch.seq_len(b);
    if (n == 0) continue;
    const int64_t begin = batch.seq_begin(b);
    const int64_t head_scores = static_cast<int64_t>(n) * n;  // fp32 elements of one head's scores
    // cuBLAS is column-major: a row-major [rows, cols] matrix with row stride ld IS a column-major
    // [cols, rows] matrix with leading dimension ld (lesson 06's trick). Row-major S = Q K^T is
    // column-major S^T = K Q^T = (K^T)^T Q^T: A = K^T (OP_T), B = Q^T (OP_N), m = keys, n = queries.
    // One batched call per kv head covers its `group` query heads: A's batch stride is 0 (the group
    // shares the same K), B's is head_dim (the next query head's columns), C's is one head's scores.
    for (int kvh = 0; kvh < shape.n_kv_heads; ++kvh) {
      TVLLM_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
          handle, CUBLAS_OP_T, CUBLAS_OP_N, n, n, D, &scale,
          K + begin * kv_dim + static_cast<int64_t>(kvh) * D, CUDA_R_16BF, kv_dim, 0,
          Q + begin * q_dim + static_cast<int64_t>(kvh) * group * D, CUDA_R_16BF, q_dim, D, &zero,
          scores + static_cast<int64_t>(kvh) * group * head_scores, CUDA_R_32F, n, head_scores, group,
          CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    }
    causal_softmax_inplace_kernel<<<dim3(n, static_cast<unsigned>(shape.n_heads)), kSoftmaxThreads>>>(scores, n);
    TVLLM_CHECK_LAUNCH();
    // Row-major O_h = P_h V is column-major O^T = V^T P^T: A = V^T (OP_N, m = head_dim), B = P^T (OP_N,
    // k = keys, n = queries) with leading dimension 2n (bf16 P sits in the first half of each fp32 row).
    const bf16* P = reinterpret_cast<const bf16*>(scores);
    for (int kvh = 0; kvh < shape.n_kv_heads; ++kvh) {
      TVLLM_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
          handle, CUBLAS_OP_N, CUBLAS_OP_N, D, n, n, &one,
          V + begin * kv_dim + static_cast<int64_t>(kvh) * D, CUDA_R_16BF, kv_dim, 0,
          P + static_cast<int64_t>(kvh) * group * 2 * head_scores, CUDA_R_16BF, 2 * n, 2 * head_scores, &zero,
          O + begin * q_dim + static_cast<int64_t>(kvh) * group * D, CUDA_R_16BF, q_dim, D, group,
          CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    }
  }
}

// =================================================================================================
// v2: flash-style, on tensor cores
// =================================================================================================

// ---- the few PTX instructions we use, each wrapped once --------------------------------------------

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared without passing through registers. valid == false reads nothing and fills
// the 16 bytes with zeros (rows past the end of a sequence: their V must be 0, not garbage, or 0 * NaN
// would poison the sum).
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(smem_dst)), "l"(gmem_src),
               "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Four 8x8 bf16 matrices from shared memory into mma fragments: lanes 8m..8m+7 give the row addresses
// of matrix m; register m of lane L receives row L/4, columns 2*(L%4) and 2*(L%4)+1 of matrix m.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(smem))
               : "memory");
}
// The same, each matrix transposed: register m of lane L receives rows 2*(L%4), 2*(L%4)+1 of column L/4.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(smem))
               : "memory");
}

// d[16x8] += a[16x16] * b[16x8], bf16 inputs, fp32 accumulators. With g = lane/4, c = lane%4:
//   a: a[0] = (row g, cols 2c..2c+1), a[1] = (row g+8, cols 2c..), a[2] = (row g, cols 2c+8..), a[3] = (row g+8, cols 2c+8..)
//   b: b0 = (rows 2c..2c+1, col g), b1 = (rows 2c+8..2c+9, col g)
//   d: d[0..1] = (row g, cols 2c..2c+1), d[2..3] = (row g+8, cols 2c..2c+1)
__device__ __forceinline__ void mma_bf16_16x8x16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats -> two bf16 in one register, `lo` in the low half (the lower column index in a fragment).
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return static_cast<uint32_t>(__bfloat16_as_ushort(v.x)) | (static_cast<uint32_t>(__bfloat16_as_ushort(v.y)) << 16);
}

// ---- the kernel ----------------------------------------------------------------------------------

constexpr int kFlashBr = 64;       // queries per block: 4 warps x 16 rows (one mma row block each)
constexpr int kFlashBc = 64;       // keys per K/V tile
constexpr int kFlashWarps = 4;
constexpr int kFlashThreads = kFlashWarps * 32;
static_assert(kFlashBr == kFlashWarps * 16, "each warp owns 16 query rows");
static_assert(kFlashBr == kFlashBc, "the causal tile skipping below assumes square tiles");

// Shared-memory rows are padded by 8 bf16 (16 bytes): with 128-byte rows, the 8 row addresses of one
// ldmatrix would all hit the same 4 banks (8-way conflict); 144-byte rows spread them over all 32.
template <int D>
constexpr int flash_smem_stride() { return D + 8; }
// Q tile + double-buffered K and V tiles.
template <int D>
constexpr size_t flash_smem_bytes() {
  return static_cast<size_t>(kFlashBr + 2 * kFlashBc + 2 * kFlashBc) * flash_smem_stride<D>() * sizeof(bf16);
}

struct FlashParams {
  const bf16* q;              // [T, n_heads*D]
  const bf16* k;              // [T, n_kv*D]
  const bf16* v;              // [T, n_kv*D]
  bf16* out;                  // [T, n_heads*D]
  const int32_t* cu_seqlens;  // [B+1]
  int64_t q_stride;           // elements per token row of q and out: n_heads*D
  int64_t kv_stride;          // elements per token row of k and v: n_kv*D
  int group;                  // query heads per kv head
  float scale_log2;           // (1/sqrt(D)) * log2(e): scores in base-2 units, so exp(x) becomes exp2(x')
};

// Starts the copy of rows [row0, row0 + ROWS) of one head (`src` points at row 0, column 0 of the head;
// rows are `stride` elements apart) into tile[ROWS][D + 8]. Rows >= len are zero-filled.
template <int D, int ROWS>
__device__ __forceinline__ void load_tile_async(bf16* tile, const bf16* src, int64_t stride, int row0, int len,
                                                int tid) {
  constexpr int kChunksPerRow = D / 8;  // 16-byte chunks of 8 bf16
  constexpr int kChunks = ROWS * kChunksPerRow;
  static_assert(kChunks % kFlashThreads == 0, "every thread copies the same number of chunks");
#pragma unroll
  for (int i = 0; i < kChunks / kFlashThreads; ++i) {
    const int c = i * kFlashThreads + tid;  // consecutive threads: consecutive 16 bytes of a row (coalesced)
    const int r = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
    const bool valid = row0 + r < len;
    const bf16* from = valid ? src + static_cast<int64_t>(row0 + r) * stride + col : src;  // src: any valid address
    cp_async_16(tile + r * flash_smem_stride<D>() + col, from, valid);
  }
}

// grid: (query tiles of the longest sequence, n_heads, batch). Block (x, h, b) computes the outputs of
// queries [q0, q0 + 64) of sequence b, head h. Warp w owns query rows [16w, 16w + 16) of the tile.
// __launch_bounds__: for D = 64, ask for 4 blocks per SM (128 registers per thread, a 12-byte spill)
// rather than the 136 registers the compiler would pick (3 blocks): measured ~13% faster at 8k tokens.
// D = 128 needs ~235 registers and 85 KiB of shared memory: 2 blocks per SM either way.
template <int D>
__global__ void __launch_bounds__(kFlashThreads, (D <= 64 ? 4 : 2)) flash_attention_kernel(const FlashParams p) {
  constexpr int Br = kFlashBr, Bc = kFlashBc, S = flash_smem_stride<D>();
  constexpr int kDimChunks = D / 16;  // k-steps of Q K^T (16 dims each)
  constexpr int kKeyTiles = Bc / 8;   // 8-key column tiles of the warp's score block [16, Bc]
  constexpr int kOutTiles = D / 8;    // 8-dim column tiles of the warp's output block [16, D]
  static_assert(D % 16 == 0, "head_dim must be a multiple of 16 for the mma tiles");

  extern __shared__ __align__(16) unsigned char smem[];
  bf16* sQ = reinterpret_cast<bf16*>(smem);  // [Br][S]     (reused for the output tile at the end)
  bf16* sK = sQ + Br * S;                     // [2][Bc][S]  double buffer
  bf16* sV = sK + 2 * Bc * S;                 // [2][Bc][S]

  const int b = blockIdx.z, h = blockIdx.y;
  // The last query tiles see the most keys: start them first so that no long block runs alone at the end.
  const int q_tile = static_cast<int>(gridDim.x) - 1 - static_cast<int>(blockIdx.x);
  const int seq_begin = p.cu_seqlens[b];
  const int len = p.cu_seqlens[b + 1] - seq_begin;
  const int q0 = q_tile * Br;
  if (q0 >= len) return;  // this sequence is shorter than the longest one; same for the whole block

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, c = lane % 4;  // mma fragment coordinates (see mma_bf16_16x8x16)
  const int kv_head = h / p.group;       // grouped-query attention
  const bf16* q_head = p.q + static_cast<int64_t>(seq_begin) * p.q_stride + static_cast<int64_t>(h) * D;
  const bf16* k_head = p.k + static_cast<int64_t>(seq_begin) * p.kv_stride + static_cast<int64_t>(kv_head) * D;
  const bf16* v_head = p.v + static_cast<int64_t>(seq_begin) * p.kv_stride + static_cast<int64_t>(kv_head) * D;

  // Causal: keys after the tile's last query are never needed. Tiles above the diagonal are skipped
  // entirely, not computed and masked.
  const int kv_end = min(len, q0 + Br);
  const int num_kv_tiles = (kv_end + Bc - 1) / Bc;

  load_tile_async<D, Br>(sQ, q_head, p.q_stride, q0, len, tid);
  load_tile_async<D, Bc>(sK, k_head, p.kv_stride, 0, len, tid);
  load_tile_async<D, Bc>(sV, v_head, p.kv_stride, 0, len, tid);
  cp_async_commit();

  uint32_t q_frag[kDimChunks][4];  // the warp's 16 query rows, as mma A fragments, for the whole loop
  float o_acc[kOutTiles][4];       // unnormalised output rows, fp32
#pragma unroll
  for (int j = 0; j < kOutTiles; ++j) o_acc[j][0] = o_acc[j][1] = o_acc[j][2] = o_acc[j][3] = 0.f;
  // This thread's two rows (g and g+8 of the warp's 16): running max (base-2 units) and partial sum.
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};

  for (int t = 0; t < num_kv_tiles; ++t) {
    const int buf = t & 1;
    const bf16* sKt = sK + buf * Bc * S;
    const bf16* sVt = sV + buf * Bc * S;
    // Prefetch tile t+1 into the other buffer while we compute on tile t. That buffer was last read in
    // iteration t-1, which ended with a barrier.
    if (t + 1 < num_kv_tiles) {
      load_tile_async<D, Bc>(sK + (buf ^ 1) * Bc * S, k_head, p.kv_stride, (t + 1) * Bc, len, tid);
      load_tile_async<D, Bc>(sV + (buf ^ 1) * Bc * S, v_head, p.kv_stride, (t + 1) * Bc, len, tid);
      cp_async_commit();
      cp_async_wait<1>();  // everything but the prefetch has landed (this thread's copies)...
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // ...and every other thread's too

    if (t == 0) {
      // A fragment of rows [16w, 16w+16), dims [16kc, 16kc+16): lanes 0-15 address rows 0-15 at dim
      // 16kc, lanes 16-31 the same rows at dim 16kc+8 -> matrices (rows 0-7, lo), (8-15, lo), (0-7, hi), (8-15, hi).
#pragma unroll
      for (int kc = 0; kc < kDimChunks; ++kc)
        ldmatrix_x4(q_frag[kc], sQ + (warp * 16 + (lane % 16)) * S + kc * 16 + (lane / 16) * 8);
    }

    // ---- scores: s[16 x Bc] = Q_w K_t^T -------------------------------------------------------------
    // B = K^T in "col" layout is K row-major (key rows, dims contiguous): no transpose. One ldmatrix.x4
    // gives the b0/b1 fragments of two 8-key tiles: matrices (keys 0-7, dims lo), (keys 0-7, dims hi),
    // (keys 8-15, dims lo), (keys 8-15, dims hi).
    float s[kKeyTiles][4];
#pragma unroll
    for (int j = 0; j < kKeyTiles; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
    for (int kc = 0; kc < kDimChunks; ++kc) {
#pragma unroll
      for (int kp = 0; kp < Bc / 16; ++kp) {
        uint32_t kb[4];
        ldmatrix_x4(kb, sKt + (kp * 16 + (lane % 8) + (lane / 16) * 8) * S + kc * 16 + ((lane / 8) % 2) * 8);
        mma_bf16_16x8x16(s[2 * kp], q_frag[kc], kb[0], kb[1]);
        mma_bf16_16x8x16(s[2 * kp + 1], q_frag[kc], kb[2], kb[3]);
      }
    }

    // ---- scale and mask -----------------------------------------------------------------------------
    // Element s[j][e] is query row (16w + g + 8*(e/2)), key (8j + 2c + e%2) of this tile.
    const int k0 = t * Bc;
    const bool needs_mask = (k0 + Bc - 1 > q0) || (k0 + Bc > len);  // the diagonal tile or the last one
#pragma unroll
    for (int j = 0; j < kKeyTiles; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[j][e] *= p.scale_log2;
        if (needs_mask) {
          const int key = k0 + j * 8 + 2 * c + (e & 1);
          const int query = q0 + warp * 16 + g + (e >> 1) * 8;
          if (key > query || key >= len) s[j][e] = -INFINITY;
        }
      }
    }

    // ---- online softmax -----------------------------------------------------------------------------
    // New max over the old max and this tile; the old sum and output were relative to the old max, so
    // they shrink by alpha = 2^(m_old - m_new). Guards: a row that has seen only masked keys keeps
    // m = -inf; we then subtract 0 instead (m_ref), so every exponent is -inf - finite = -inf -> 0,
    // and -inf - -inf (NaN) is never formed.
    float alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float tile_max = -INFINITY;
#pragma unroll
      for (int j = 0; j < kKeyTiles; ++j) tile_max = fmaxf(tile_max, fmaxf(s[j][2 * r], s[j][2 * r + 1]));
      // the 4 threads of a quad (same g) hold the row's other columns
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
      const float m_new = fmaxf(row_max[r], tile_max);
      const float m_ref = m_new == -INFINITY ? 0.f : m_new;
      alpha[r] = exp2f(row_max[r] - m_ref);  // first tile: exp2(-inf) = 0
      row_max[r] = m_new;
      float tile_sum = 0.f;
#pragma unroll
      for (int j = 0; j < kKeyTiles; ++j) {
        s[j][2 * r] = exp2f(s[j][2 * r] - m_ref);  // masked: exp2(-inf) = 0
        s[j][2 * r + 1] = exp2f(s[j][2 * r + 1] - m_ref);
        tile_sum += s[j][2 * r] + s[j][2 * r + 1];
      }
      row_sum[r] = row_sum[r] * alpha[r] + tile_sum;  // this thread's columns only; the quad adds up at the end
    }
#pragma unroll
    for (int j = 0; j < kOutTiles; ++j) {
      o_acc[j][0] *= alpha[0];
      o_acc[j][1] *= alpha[0];
      o_acc[j][2] *= alpha[1];
      o_acc[j][3] *= alpha[1];
    }

    // ---- o += P V -----------------------------------------------------------------------------------
    // The accumulator layout of two adjacent 8-key tiles IS the A fragment layout of one 16-key step,
    // so P goes from registers to the tensor cores without touching shared memory. V [keys, dims] is
    // B in "col" layout only after a transpose: ldmatrix .trans does it on the way. Matrices:
    // (keys 0-7, dims lo), (keys 8-15, dims lo), (keys 0-7, dims hi), (keys 8-15, dims hi).
#pragma unroll
    for (int kk = 0; kk < Bc / 16; ++kk) {
      uint32_t p_frag[4];
      p_frag[0] = pack_bf16x2(s[2 * kk][0], s[2 * kk][1]);
      p_frag[1] = pack_bf16x2(s[2 * kk][2], s[2 * kk][3]);
      p_frag[2] = pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      p_frag[3] = pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t vb[4];
        ldmatrix_x4_trans(vb, sVt + (kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8) * S + dp * 16 + (lane / 16) * 8);
        mma_bf16_16x8x16(o_acc[2 * dp], p_frag, vb[0], vb[1]);
        mma_bf16_16x8x16(o_acc[2 * dp + 1], p_frag, vb[2], vb[3]);
      }
    }
    __syncthreads();  // all warps are done with buffer `buf` before iteration t+1 prefetches into it
  }

  // ---- epilogue: out = o / sum, through shared memory for 16-byte stores ------------------------------
  float inv_sum[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 1);
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 2);
    inv_sum[r] = row_sum[r] > 0.f ? 1.f / row_sum[r] : 0.f;  // a row with no key at all writes 0
  }
  // Each warp writes only its own 16 rows of the (no longer needed) Q tile, so a warp barrier suffices.
  bf16* sO = sQ;
#pragma unroll
  for (int j = 0; j < kOutTiles; ++j) {
    const int col = j * 8 + 2 * c;
    *reinterpret_cast<__nv_bfloat162*>(sO + (warp * 16 + g) * S + col) =
        __floats2bfloat162_rn(o_acc[j][0] * inv_sum[0], o_acc[j][1] * inv_sum[0]);
    *reinterpret_cast<__nv_bfloat162*>(sO + (warp * 16 + g + 8) * S + col) =
        __floats2bfloat162_rn(o_acc[j][2] * inv_sum[1], o_acc[j][3] * inv_sum[1]);
  }
  __syncwarp();
  constexpr int kChunksPerRow = D / 8;
  static_assert((16 * kChunksPerRow) % 32 == 0, "a warp stores its 16 rows in whole rounds");
#pragma unroll
  for (int i = 0; i < 16 * kChunksPerRow / 32; ++i) {
    const int chunk = i * 32 + lane;
    const int row = warp * 16 + chunk / kChunksPerRow, col = (chunk % kChunksPerRow) * 8;
    const int query = q0 + row;
    if (query < len) {
      *reinterpret_cast<uint4*>(p.out + static_cast<int64_t>(seq_begin + query) * p.q_stride +
                                static_cast<int64_t>(h) * D + col) =
          *reinterpret_cast<const uint4*>(sO + row * S + col);
    }
  }
}

template <int D>
void launch_flash(const FlashParams& params, const VarlenBatch& batch, int n_heads) {
  constexpr size_t smem = flash_smem_bytes<D>();
  // Above 48 KiB a block must opt in to more dynamic shared memory (head_dim 128: 85 KiB).
  static const bool opted_in = [] {
    TVLLM_CUDA_CHECK(cudaFuncSetAttribute(flash_attention_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem)));
    return true;
  }();
  (void)opted_in;
  const unsigned q_tiles = static_cast<unsigned>((batch.max_seqlen() + kFlashBr - 1) / kFlashBr);
  if (q_tiles == 0) return;  // every sequence is empty
  const dim3 grid(q_tiles, static_cast<unsigned>(n_heads), static_cast<unsigned>(batch.batch_size()));
  flash_attention_kernel<D><<<grid, kFlashThreads, smem>>>(params);
  TVLLM_CHECK_LAUNCH();
}

void attention_v2_flash(const TensorView& out, const TensorView& q, const TensorView& k, const TensorView& v,
                        const VarlenBatch& batch, const AttentionShape& shape) {
  FlashParams params;
  params.q = q.ptr<const bf16>();
  params.k = k.ptr<const bf16>();
  params.v = v.ptr<const bf16>();
  params.out = out.ptr<bf16>();
  params.cu_seqlens = batch.cu_seqlens_device();
  params.q_stride = shape.q_dim();
  params.kv_stride = shape.kv_dim();
  params.group = static_cast<int>(shape.group_size());
  params.scale_log2 = static_cast<float>(shape.scale() * 1.4426950408889634);  // log2(e)
  const int n_heads = static_cast<int>(shape.n_heads);
  // head_dim is a run-time value; the kernel wants it at compile time (register arrays, unrolled loops).
  switch (shape.head_dim) {
    case 64: launch_flash<64>(params, batch, n_heads); break;
    case 128: launch_flash<128>(params, batch, n_heads); break;
    default:
      throw InputError("attention v2 (flash) is compiled for head_dim 64 and 128, got " +
                       std::to_string(shape.head_dim));
  }
}

}  // namespace

bool flash_supports_head_dim(int64_t head_dim) { return head_dim == 64 || head_dim == 128; }

void attention_prefill_cuda(const TensorView& out, const TensorView& q, const TensorView& k, const TensorView& v,
                            const VarlenBatch& batch, const AttentionShape& shape, AttentionKernel kernel,
                            AttentionWorkspace& workspace) {
  if (kernel == AttentionKernel::V1Materialized) {
    attention_v1_materialized(out, q, k, v, batch, shape, workspace);
  } else {
    attention_v2_flash(out, q, k, v, batch, shape);
  }
}

}  // namespace tvllm
