// Lesson 12 on the GPU: the paged KV write, paged decode attention (flash-decoding through block tables) and
// prefill over the pool (lesson 07's flash kernel with the PagedKV policy).
//
//   paged_kv_write_kernel           one block per new token: its k and v rows -> KV slot slot_mapping[t]
//   paged_decode_attention_kernel   lesson 10's decode kernel (one block per sequence, kv head, <= 8 query heads
//                                   of its group, split of the keys), each key found through the block table
//   paged_decode_combine_kernel     per (sequence, head): the splits' partials rescaled to one max and added
//   PagedKV                         the KV policy of flash_attention.cuh for the pool
//
// Lesson 10's kernels are written over a contiguous row (base + pos * kv_dim); here position pos of sequence b
// lives at row (block_table[b][pos >> shift] << shift) + (pos & mask) of the pool, shift = log2(block_size).
// Everything else (the tiling, the GQA sharing, the online softmax, the split and its combine) is lesson 10's, so
// the paged kernel returns the contiguous one's bits when the same keys sit in both caches (a test checks it).
// README.md walks through them.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common/cuda_utils.cuh"
#include "common/errors.h"
#include "common/exercise.h"
#include "flash_attention.cuh"
#include "paged_kv.h"

namespace tvllm {

namespace {

using bf16 = __nv_bfloat16;

// The pool row (KV slot) of position pos of a sequence whose block table row is `table`: the block that holds
// the position, times the block size, plus the offset inside the block. 64-bit: a row times kv_dim is an
// element offset, and a large pool passes 2^31 elements.
__device__ __forceinline__ int64_t paged_row(const int32_t* table, int pos, int shift) {
  return (static_cast<int64_t>(table[pos >> shift]) << shift) + (pos & ((1 << shift) - 1));
}

int log2_of(int64_t power_of_two) {
  int shift = 0;
  while ((int64_t{1} << shift) < power_of_two) ++shift;
  return shift;
}

// =================================================================================================
// The KV write
// =================================================================================================

constexpr int kWriteThreads = 128;

struct PagedWriteParams {
  bf16* k_pool;                 // the layer's k: [num_blocks * block_size rows, kv_dim]
  bf16* v_pool;
  const bf16* k;                // the step's new rows [T, >= kv_dim], k_stride apart (views into the QKV buffer)
  const bf16* v;
  int64_t k_stride, v_stride;
  const int32_t* slot_mapping;  // [T] device: KV slot of token t, -1 = not stored
  int kv_dim;
};

// grid: one block per new token (T = the slot mapping's length). The slot comes from a device array, so a
// captured graph writes wherever the latest slot mapping says.
__global__ void __launch_bounds__(kWriteThreads) paged_kv_write_kernel(const PagedWriteParams p) {
  // --- exercise 12.8: the paged KV-write kernel ---------------------------------------------------------------
  // Task: block t copies row t of k and of v (kv_dim bf16 each) into row slot_mapping[t] of the pool (k_pool,
  //   v_pool: one row of kv_dim per KV slot). A slot of -1 is a token not to store: the block does nothing.
  //   16 bytes (8 bf16) per thread per step.
  // Hint: load_pack<8> / store_pack<8> (common/cuda_utils.cuh) move 8 bf16 at once; kv_dim is a multiple of 8.
  // Hint: slot * kv_dim needs 64 bits: a pool of a few million slots times kv_dim passes 2^31.
  // Tests: PagedKvGpu.WriteMatchesCpu PagedKvGpu.GraphOfADecodeStepReplaysTheEagerStep
  // Tests: PagedKvGpu.BackendEqualsTheContiguousCacheOnTheBundledModel
  // Stub: device
  // --- solution ---
  const int t = blockIdx.x;
  const int32_t slot = p.slot_mapping[t];
  if (slot < 0) return;  // a padding token: the whole block leaves
  bf16* k_dst = p.k_pool + static_cast<int64_t>(slot) * p.kv_dim;
  bf16* v_dst = p.v_pool + static_cast<int64_t>(slot) * p.kv_dim;
  const bf16* k_src = p.k + static_cast<int64_t>(t) * p.k_stride;
  const bf16* v_src = p.v + static_cast<int64_t>(t) * p.v_stride;
  for (int c = threadIdx.x * 8; c < p.kv_dim; c += kWriteThreads * 8) {
    store_pack<8>(k_dst + c, load_pack<8>(k_src + c));
    store_pack<8>(v_dst + c, load_pack<8>(v_src + c));
  }
  // --- end of exercise 12.8 ---
}

// =================================================================================================
// Decode attention through the block tables: lesson 10's flash-decoding, paged
// =================================================================================================

constexpr int kDecodeThreads = 128;
constexpr int kDecodeWarps = kDecodeThreads / 32;
constexpr int kKeysPerThread = 8;  // keys whose 16 bytes one thread has in flight at once (per k and v)
constexpr int kMaxSplits = DecodeWorkspace::kMaxDecodeSplits;

struct PagedDecodeParams {
  const bf16* q;               // row 0 of q: packed rows (cu_seqlens_q), q_stride apart; head h at column h*head_dim
  bf16* out;                   // same layout as q
  int64_t q_stride, out_stride;
  const bf16* k_pool;          // the layer's k: [num_blocks * block_size rows, kv_dim]
  const bf16* v_pool;
  const int32_t* cu_q;         // [B+1] device
  const int32_t* cu_k;         // [B+1] device: k_len[b] is sequence b's context length
  const int32_t* block_tables; // [B][table_stride] device
  int64_t table_stride;        // max_blocks_per_seq: entries from one sequence's row to the next
  int block_shift;             // log2(block_size)
  int kv_dim, head_dim, group, n_heads;
  float scale_log2;            // (1/sqrt(head_dim)) * log2(e): scores in base-2 units, exp becomes exp2
  float* partials;             // [B][n_heads][kMaxSplits][head_dim + 2]: unnormalised o, then m, then l
};

// Keys per tile: every key group (TPK threads) takes kKeysPerThread keys of it.
template <int TPK>
constexpr int decode_tile() {
  return (kDecodeThreads / TPK) * kKeysPerThread;
}

// Shared memory: the tile's scores [G][tile], later reused for the cross-warp sum [warps][G][head_dim].
template <int TPK, int G>
size_t decode_smem_bytes(int head_dim) {
  return static_cast<size_t>(std::max(G * decode_tile<TPK>(), kDecodeWarps * G * head_dim)) * sizeof(float);
}

// grid: (num_splits, n_kv_heads * ceil(group / G), B), as lesson 10's decode_attention_kernel (its comment
// explains TPK, G and the three phases of a tile). The one difference: key t0 + j of sequence b is row
// paged_row(table_b, t0 + j) of the pool instead of row t0 + j of the sequence's slot. Consecutive key groups
// still read consecutive positions, which are consecutive rows inside a block: with block_size 16 a tile's 16
// key groups read one whole block (16 rows x 128 bytes for head_dim 64) per load round.
template <int TPK, int G>
__global__ void __launch_bounds__(kDecodeThreads) paged_decode_attention_kernel(const PagedDecodeParams p) {
  // --- exercise 12.9: the paged decode kernel ------------------------------------------------------------------
  // Task: lesson 10's decode_attention_kernel (exercise 10.4: one query per sequence, the split's keys in tiles
  //   of decode_tile<TPK>(), an online softmax across tiles, fp32 throughout, the output normalised (one split)
  //   or as a partial (o, m, l) for the combine kernel), with every K and V load addressed through the block
  //   table: position pos of sequence b is pool row paged_row(p.block_tables + b * p.table_stride, pos,
  //   p.block_shift).
  // Hint: the thread's column (kv_head * head_dim + its 8 dims) is the same in every row: add it to the pool
  //   pointers once, then add row * kv_dim per key.
  // Hint: look the rows up only for keys that exist (j < n): past the context the table holds nothing valid.
  // Tests: PagedKvGpu.DecodeMatchesCpu* PagedKvGpu.PagedEqualsContiguousOnTheGpu
  // Tests: PagedKvGpu.GraphOfADecodeStepReplaysTheEagerStep PagedKvGpu.OpsRunOnTheCallersStream
  // Tests: PagedKvGpu.BackendEqualsTheContiguousCacheOnTheBundledModel
  // Stub: device
  // --- solution ---
  constexpr int kGroups = kDecodeThreads / TPK;  // key groups: keys in flight per block, per load round
  constexpr int kTile = decode_tile<TPK>();
  extern __shared__ __align__(16) float paged_decode_smem[];
  float* sS = paged_decode_smem;    // [G][kTile]: the tile's scores, then its probabilities
  float* sRed = paged_decode_smem;  // [kDecodeWarps][G][head_dim]: after the loop, the warps' sums (aliases sS)
  __shared__ float sM[G], sL[G], sAlpha[G];  // per head: running max (base 2), running sum, this tile's rescale

  const int b = blockIdx.z;
  const int q_row = p.cu_q[b];
  if (p.cu_q[b + 1] - q_row != 1) return;  // no query for this sequence (the whole block leaves together)
  const int head_tiles = (p.group + G - 1) / G;
  const int kv_head = static_cast<int>(blockIdx.y) / head_tiles;
  const int h0 = kv_head * p.group + (static_cast<int>(blockIdx.y) % head_tiles) * G;
  const int heads = min(G, (kv_head + 1) * p.group - h0);  // real heads of this block (the rest: zero queries)
  const int k_len = p.cu_k[b + 1] - p.cu_k[b];
  // This split's keys, from the k_len of THIS step (a graph captured at one length stays right at another).
  const int chunk = (k_len + static_cast<int>(gridDim.x) - 1) / static_cast<int>(gridDim.x);
  const int key_begin = min(k_len, static_cast<int>(blockIdx.x) * chunk);
  const int key_end = min(k_len, key_begin + chunk);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int grp = tid / TPK, c = tid % TPK;  // this thread's key group, and its 16-byte chunk of a key
  const int D = p.head_dim;
  const bool active = c * 8 < D;            // TPK * 8 may exceed head_dim (e.g. 80 -> 16 threads, 10 active)
  const int col = active ? c * 8 : 0;

  float qr[G][8];  // the block's query heads, scaled so that q.k comes out in base-2 units; missing heads: zeros
#pragma unroll
  for (int g = 0; g < G; ++g) {
    Pack<8> qp{};
    if (active && g < heads) qp = load_pack<8>(p.q + static_cast<int64_t>(q_row) * p.q_stride + (h0 + g) * D + col);
#pragma unroll
    for (int e = 0; e < 8; ++e) qr[g][e] = qp.get(e) * p.scale_log2;
  }
  float acc[G][8];  // unnormalised output of this thread's keys, its 8 dims, every head
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[g][e] = 0.f;
  if (tid < G) {
    sM[tid] = -INFINITY;
    sL[tid] = 0.f;
  }
  // This kv head's column, this thread's 8 dims, in every row of the pool; the row comes from the table.
  const int64_t column = static_cast<int64_t>(kv_head) * D + col;
  const bf16* K = p.k_pool + column;
  const bf16* V = p.v_pool + column;
  const int32_t* table = p.block_tables + static_cast<int64_t>(b) * p.table_stride;

  for (int t0 = key_begin; t0 < key_end; t0 += kTile) {
    const int n = min(kTile, key_end - t0);
    // Every load of the tile first: the table entries (L1-resident: a tile spans a few blocks), then K and V,
    // 2 x kKeysPerThread 16-byte loads in flight per thread.
    Pack<8> kp[kKeysPerThread], vp[kKeysPerThread];
#pragma unroll
    for (int u = 0; u < kKeysPerThread; ++u) {
      const int j = u * kGroups + grp;
      kp[u] = Pack<8>{};
      vp[u] = Pack<8>{};
      if (active && j < n) {
        const int64_t at = paged_row(table, t0 + j, p.block_shift) * p.kv_dim;
        kp[u] = load_pack<8>(K + at);
        vp[u] = load_pack<8>(V + at);
      }
    }
    // (1) Scores: each thread's 8-dim partial dot product, added over the key group's TPK lanes.
#pragma unroll
    for (int u = 0; u < kKeysPerThread; ++u) {
      const int j = u * kGroups + grp;
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float dot = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) dot = fmaf(qr[g][e], kp[u].get(e), dot);
#pragma unroll
        for (int off = TPK / 2; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
        if (c == 0 && j < n) sS[g * kTile + j] = dot;
      }
    }
    __syncthreads();
    // (2) One warp per head: the tile's max, the new running max, probabilities in place, their sum.
    for (int g = warp; g < G; g += kDecodeWarps) {
      float* s = sS + g * kTile;
      float tile_max = -INFINITY;
      for (int j = lane; j < n; j += 32) tile_max = fmaxf(tile_max, s[j]);
      tile_max = warp_max(tile_max);
      const float m_old = sM[g];
      const float m_new = fmaxf(m_old, tile_max);
      const float m_ref = m_new == -INFINITY ? 0.f : m_new;  // never -inf - -inf (lesson 07 section 6)
      float sum = 0.f;
      for (int j = lane; j < n; j += 32) {
        const float e = exp2f(s[j] - m_ref);
        s[j] = e;
        sum += e;
      }
      sum = warp_sum(sum);
      if (lane == 0) {
        const float alpha = exp2f(m_old - m_ref);  // first tile: 2^-inf = 0
        sAlpha[g] = alpha;
        sL[g] = sL[g] * alpha + sum;
        sM[g] = m_new;
      }
    }
    __syncthreads();
    // (3) acc = acc * alpha + sum_j p_j v_j over this thread's keys of the tile.
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float alpha = sAlpha[g];
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[g][e] *= alpha;
    }
#pragma unroll
    for (int u = 0; u < kKeysPerThread; ++u) {
      const int j = u * kGroups + grp;
      if (j < n) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
          const float pj = sS[g * kTile + j];
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[g][e] = fmaf(pj, vp[u].get(e), acc[g][e]);
        }
      }
    }
    __syncthreads();  // the next tile overwrites sS
  }

  // Add the key groups' accumulators: within a warp, lanes c, c + TPK, c + 2 TPK, ... hold the same dims...
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int e = 0; e < 8; ++e)
#pragma unroll
      for (int off = TPK; off < 32; off <<= 1) acc[g][e] += __shfl_xor_sync(0xffffffffu, acc[g][e], off);
  // ...then across warps through shared memory, always in the same order (replays give the same bits).
  if (lane < TPK && active) {
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int e = 0; e < 8; ++e) sRed[(warp * G + g) * D + col + e] = acc[g][e];
  }
  __syncthreads();
  const bool direct = gridDim.x == 1;  // one split: this block has the whole answer
  for (int i = tid; i < heads * D; i += kDecodeThreads) {
    const int g = i / D, d = i % D, h = h0 + g;
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) o += sRed[(w * G + g) * D + d];
    if (direct) {
      const float l = sL[g];
      p.out[static_cast<int64_t>(q_row) * p.out_stride + h * D + d] = __float2bfloat16_rn(l > 0.f ? o / l : 0.f);
    } else {
      float* part = p.partials + ((static_cast<int64_t>(b) * p.n_heads + h) * kMaxSplits + blockIdx.x) * (D + 2);
      part[d] = o;
      if (d == 0) {
        part[D] = sM[g];
        part[D + 1] = sL[g];
      }
    }
  }
  // --- end of exercise 12.9 ---
}

// grid: (n_heads, B); one thread per output dim. Lesson 10's combine (the partials do not know about blocks).
__global__ void paged_decode_combine_kernel(const PagedDecodeParams p, int num_splits) {
  const int h = blockIdx.x, b = blockIdx.y, d = threadIdx.x;
  const int q_row = p.cu_q[b];
  const int D = p.head_dim;
  if (p.cu_q[b + 1] - q_row != 1 || d >= D) return;
  const float* part = p.partials + (static_cast<int64_t>(b) * p.n_heads + h) * kMaxSplits * (D + 2);
  float M = -INFINITY;
  for (int s = 0; s < num_splits; ++s) M = fmaxf(M, part[s * (D + 2) + D]);
  float L = 0.f, o = 0.f;
  for (int s = 0; s < num_splits; ++s) {
    const float m = part[s * (D + 2) + D];
    if (m == -INFINITY) continue;
    const float w = exp2f(m - M);
    L += w * part[s * (D + 2) + D + 1];
    o += w * part[s * (D + 2) + d];
  }
  p.out[static_cast<int64_t>(q_row) * p.out_stride + h * D + d] = __float2bfloat16_rn(L > 0.f ? o / L : 0.f);
}

template <int TPK, int G>
void launch_decode(const PagedDecodeParams& p, int n_kv_heads, int batch_size, int num_splits, cudaStream_t stream) {
  const int head_tiles = (p.group + G - 1) / G;
  const dim3 grid(static_cast<unsigned>(num_splits), static_cast<unsigned>(n_kv_heads * head_tiles),
                  static_cast<unsigned>(batch_size));
  // At most 32 KiB (head_dim 256, G 8): under the 48 KiB a block gets without opting in.
  paged_decode_attention_kernel<TPK, G><<<grid, kDecodeThreads, decode_smem_bytes<TPK, G>(p.head_dim), stream>>>(p);
  TVLLM_CHECK_LAUNCH();
}

// The query heads per block, as lesson 10: the group rounded up to a power of two, at most 8.
template <int TPK>
void launch_decode_for_group(const PagedDecodeParams& p, int n_kv_heads, int batch_size, int num_splits,
                             cudaStream_t stream) {
  if (p.group >= 5) launch_decode<TPK, 8>(p, n_kv_heads, batch_size, num_splits, stream);
  else if (p.group >= 3) launch_decode<TPK, 4>(p, n_kv_heads, batch_size, num_splits, stream);
  else if (p.group == 2) launch_decode<TPK, 2>(p, n_kv_heads, batch_size, num_splits, stream);
  else launch_decode<TPK, 1>(p, n_kv_heads, batch_size, num_splits, stream);
}

// =================================================================================================
// Prefill, chunks and prefix hits over the pool: lesson 07's flash kernel with the PagedKV policy
// =================================================================================================

// The contract is at the top of flash_attention.cuh: sequence() once per block, key()/value() in the hot loop
// (a table look-up, a shift, a mask). A chunk of new queries sees every key before it, whichever step wrote it
// and whichever sequence's blocks they are (a prefix-cache hit is a table that starts with another's blocks).
struct PagedKV {
  const bf16* k;                // the layer's k pool: [num_blocks * block_size rows, kv_dim]
  const bf16* v;
  const int32_t* block_tables;  // [B][table_stride] device
  int64_t table_stride;
  int block_shift;              // log2(block_size)
  int kv_dim;                   // elements from one row (KV slot) to the next
  int head_dim;

  struct Sequence {
    const bf16* k;         // row 0 of the pool, this kv head's column
    const bf16* v;
    const int32_t* table;  // this sequence's block table
    int shift, kv_dim;
    __device__ __forceinline__ const bf16* key(int pos) const { return k + paged_row(table, pos, shift) * kv_dim; }
    __device__ __forceinline__ const bf16* value(int pos) const { return v + paged_row(table, pos, shift) * kv_dim; }
  };
  // k_begin (where packed keys would start) means nothing here: a sequence's keys are wherever its table says.
  __device__ __forceinline__ Sequence sequence(int b, int /*k_begin*/, int kv_head) const {
    const int64_t column = static_cast<int64_t>(kv_head) * head_dim;
    return {k + column, v + column, block_tables + static_cast<int64_t>(b) * table_stride, block_shift, kv_dim};
  }
};

}  // namespace

// ---- launchers -------------------------------------------------------------------------------------------

void paged_kv_write_cuda(const TensorView& pool_k, const TensorView& pool_v, const TensorView& k,
                         const TensorView& v, const PagedStepTables& tables, cudaStream_t stream) {
  PagedWriteParams p;
  p.k_pool = pool_k.ptr<bf16>();
  p.v_pool = pool_v.ptr<bf16>();
  p.k = k.ptr<const bf16>();
  p.v = v.ptr<const bf16>();
  p.k_stride = k.strides[0];
  p.v_stride = v.strides[0];
  p.slot_mapping = tables.device_slot_mapping();
  p.kv_dim = static_cast<int>(pool_k.shape[2]);
  paged_kv_write_kernel<<<static_cast<unsigned>(tables.num_tokens()), kWriteThreads, 0, stream>>>(p);
  TVLLM_CHECK_LAUNCH();
}

void paged_decode_attention_cuda(const TensorView& out, const TensorView& q, const TensorView& pool_k,
                                 const TensorView& pool_v, const AttentionBatch& batch, const PagedStepTables& tables,
                                 const AttentionShape& shape, int num_splits, const DecodeWorkspace& workspace,
                                 cudaStream_t stream) {
  PagedDecodeParams p;
  p.q = q.ptr<const bf16>();
  p.out = out.ptr<bf16>();
  p.q_stride = q.strides[0];
  p.out_stride = out.strides[0];
  p.k_pool = pool_k.ptr<const bf16>();
  p.v_pool = pool_v.ptr<const bf16>();
  p.cu_q = batch.cu_seqlens_q_device();
  p.cu_k = batch.cu_seqlens_k_device();
  p.block_tables = tables.device_block_tables();
  p.table_stride = tables.max_blocks_per_seq();
  p.block_shift = log2_of(tables.block_size());
  p.kv_dim = static_cast<int>(shape.kv_dim());
  p.head_dim = static_cast<int>(shape.head_dim);
  p.group = static_cast<int>(shape.group_size());
  p.n_heads = static_cast<int>(shape.n_heads);
  p.scale_log2 = static_cast<float>(shape.scale() * 1.4426950408889634);  // log2(e), as lessons 07 and 10
  p.partials = workspace.partials();
  const int kv_heads = static_cast<int>(shape.n_kv_heads), B = batch.batch_size();
  // Threads per key: head_dim / 8 rounded up to a power of two (4 at least), as lesson 10.
  if (shape.head_dim <= 32) launch_decode_for_group<4>(p, kv_heads, B, num_splits, stream);
  else if (shape.head_dim <= 64) launch_decode_for_group<8>(p, kv_heads, B, num_splits, stream);
  else if (shape.head_dim <= 128) launch_decode_for_group<16>(p, kv_heads, B, num_splits, stream);
  else launch_decode_for_group<32>(p, kv_heads, B, num_splits, stream);
  if (num_splits > 1) {
    const int threads = static_cast<int>(ceil_div(shape.head_dim, 32) * 32);
    paged_decode_combine_kernel<<<dim3(static_cast<unsigned>(shape.n_heads), static_cast<unsigned>(B)), threads, 0,
                                  stream>>>(p, num_splits);
    TVLLM_CHECK_LAUNCH();
  }
}

void paged_flash_attention_cuda(const TensorView& out, const TensorView& q, const TensorView& pool_k,
                                const TensorView& pool_v, const AttentionBatch& batch, const PagedStepTables& tables,
                                const AttentionShape& shape, cudaStream_t stream) {
  const PagedKV kv{pool_k.ptr<const bf16>(),  pool_v.ptr<const bf16>(),          tables.device_block_tables(),
                   tables.max_blocks_per_seq(), log2_of(tables.block_size()), static_cast<int>(shape.kv_dim()),
                   static_cast<int>(shape.head_dim)};
  flash_attention(out, q, kv, batch, shape, stream);
}

}  // namespace tvllm
