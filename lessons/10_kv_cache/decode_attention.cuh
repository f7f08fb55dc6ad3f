// Lesson 10's decode attention (flash-decoding), as templates over lesson 07's KV addressing policy, so that
// lesson 12 runs the same kernel over its paged pool without a copy of it (as flash_attention.cuh does for
// prefill):
//
//   lesson 10  CacheKV (cache_kv.cuh): position pos of sequence b at row slot[b] * max_context + pos
//   lesson 12  PagedKV (paged_kv_policy.cuh): position pos at row block_table[b][pos / bs] * bs + pos % bs
//
//   decode_attention_kernel   one block per (sequence, kv head, <= 8 query heads of its group, split of the
//                             keys): scores, softmax and P V over its keys, fp32; writes a partial result
//   decode_combine_kernel     per (sequence, head): rescales the splits' partials to one max and adds them
//
// Include it from a .cu file and call decode::launch(decode::make_params(...), MyKV{...}, ...). The policy
// contract is at the top of flash_attention.cuh. README.md (section 5) derives the kernel.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "attention.h"
#include "common/cuda_utils.cuh"
#include "common/errors.h"
#include "common/exercise.h"
#include "kv_cache.h"

namespace tvllm {
namespace decode {

using bf16 = __nv_bfloat16;

constexpr int kDecodeThreads = 128;
constexpr int kDecodeWarps = kDecodeThreads / 32;
constexpr int kKeysPerThread = 8;  // keys whose 16 bytes one thread has in flight at once (per k and v)
constexpr int kMaxSplits = DecodeWorkspace::kMaxDecodeSplits;

// The query side of a launch and the split scratch; the keys and values come through the KV policy.
struct DecodeParams {
  const bf16* q;          // row 0 of q: packed rows (cu_seqlens_q), q_stride apart; head h at column h*head_dim
  bf16* out;              // same layout as q
  int64_t q_stride, out_stride;
  const int32_t* cu_q;    // [B+1] device
  const int32_t* cu_k;    // [B+1] device: k_len[b] = cu_k[b+1] - cu_k[b]
  int head_dim, group, n_heads;
  float scale_log2;       // (1/sqrt(head_dim)) * log2(e): scores in base-2 units, exp becomes exp2
  int window;             // sliding window W: the query at k_len - 1 sees keys k_len - W.. only; 0 = none
  float* partials;        // [B][n_heads][kMaxSplits][head_dim + 2]: unnormalised o, then m, then l
  // Lesson 16's FP8 KV cache: a value reads back as code * v_scale; the scale is common to every value of the
  // layer, so it multiplies the normalised output once (1 for bf16: x * 1 is x, the same bits). Its k_scale is
  // folded into scale_log2 by the launcher.
  float v_scale = 1.0f;
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

// grid: (num_splits, n_kv_heads * ceil(group / G), B). Block (s, y, b) handles sequence b, kv head
// y / head_tiles and its query heads [h0, h0 + G) (fewer in the group's last tile), over split s of the
// sequence's keys: an equal share ceil(keys / num_splits), read in tiles. keys = k_len, or with a sliding
// window W only the last min(k_len, W): the splits share the window and nothing before it is read.
//   TPK  threads per key: the next power of two >= head_dim / 8, each thread holding 8 dims (16 bytes) of a
//        key. The block's 128 threads are 128 / TPK key groups, each on its own keys.
//   G    query heads per block: every K and V vector loaded is used by all G heads of the group (GQA).
// Per tile: (1) each key group computes q.k for its keys and all G heads (a dot product over its TPK
// threads: shuffles), into shared memory; (2) one warp per head: the tile's max, the running max, p =
// 2^(s - m), the sum; (3) every thread rescales its output accumulators by 2^(m_old - m_new) and adds p v
// for its keys. At the end the key groups' accumulators are added (shuffles, then shared memory in a
// fixed order) and written: normalised (one split) or as a partial for the combine kernel.
template <int TPK, int G, class KV>
__global__ void __launch_bounds__(kDecodeThreads) decode_attention_kernel(const DecodeParams p, const KV kv) {
  // --- exercise 10.4: the decode attention kernel ------------------------------------------------------
  // Task: the body described above: one query per sequence, the split's keys in tiles of
  //   decode_tile<TPK>(), an online softmax across tiles (running max and sum per head), fp32 throughout,
  //   and the output either normalised (gridDim.x == 1) or as a partial (o, m, l) for decode_combine_kernel.
  //   Keys and values come through the KV policy (lesson 07's contract): kv.sequence(b, cu_k[b], kv_head)
  //   once, then key(pos) / value(pos), the address of that position's head_dim values of the kv head.
  // Hint: keep every __shfl_xor_sync on all 32 lanes: loop over a compile-time number of keys per thread
  //   and mask the loads (j < n), not the loop.
  // Hint: a sliding window (p.window > 0): the query at k_len - 1 sees keys [max(0, k_len - window), k_len)
  //   only; share those among the splits (the CPU twin, decode_attention_over_rows_cpu, does the same).
  // Hint: the partial of (b, h, split s) starts at p.partials + ((b * n_heads + h) * kMaxSplits + s) *
  //   (head_dim + 2); the combine skips a split whose m is -inf (it had no keys).
  // Tests: KvCacheGpu.Decode* KvCacheGpu.GenerationAgreesWithHuggingFaceTeacherForced
  // Stub: device
  // --- solution ---
  constexpr int kGroups = kDecodeThreads / TPK;  // key groups: keys in flight per block, per load round
  constexpr int kTile = decode_tile<TPK>();
  extern __shared__ __align__(16) float decode_smem[];
  float* sS = decode_smem;    // [G][kTile]: the tile's scores, then its probabilities
  float* sRed = decode_smem;  // [kDecodeWarps][G][head_dim]: after the loop, the warps' sums (aliases sS)
  __shared__ float sM[G], sL[G], sAlpha[G];  // per head: running max (base 2), running sum, this tile's rescale

  const int b = blockIdx.z;
  const int q_row = p.cu_q[b];
  if (p.cu_q[b + 1] - q_row != 1) return;  // no query for this sequence (the whole block leaves together)
  const int head_tiles = (p.group + G - 1) / G;
  const int kv_head = static_cast<int>(blockIdx.y) / head_tiles;
  const int h0 = kv_head * p.group + (static_cast<int>(blockIdx.y) % head_tiles) * G;
  const int heads = min(G, (kv_head + 1) * p.group - h0);  // real heads of this block (the rest: zero queries)
  const int k_len = p.cu_k[b + 1] - p.cu_k[b];
  // This split's keys. The share is computed here, from the k_len of THIS step, so a graph captured at one
  // context length stays correct at another (only the number of splits is fixed by the launch).
  // A sliding window hides the keys before k_len - window from the query (at k_len - 1): they are not
  // shared out at all, so a long context costs a decode step only the window's bytes.
  const int first = p.window > 0 ? max(0, k_len - p.window) : 0;
  const int chunk = (k_len - first + static_cast<int>(gridDim.x) - 1) / static_cast<int>(gridDim.x);
  const int key_begin = min(k_len, first + static_cast<int>(blockIdx.x) * chunk);
  const int key_end = min(k_len, key_begin + chunk);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int grp = tid / TPK, c = tid % TPK;  // this thread's key group, and its 16-byte chunk of a key
  const int D = p.head_dim;
  const bool active = c * 8 < D;            // TPK * 8 may exceed head_dim (e.g. 80 -> 16 threads, 10 active)
  const int col = active ? c * 8 : 0;

  // The block's query heads, scaled so that q.k comes out in base-2 units. Missing heads are zeros.
  float qr[G][8];
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
  // This sequence's keys and values, this kv head (a slot of the contiguous cache, or blocks of the pool).
  const auto seq = kv.sequence(b, p.cu_k[b], kv_head);

  for (int t0 = key_begin; t0 < key_end; t0 += kTile) {
    const int n = min(kTile, key_end - t0);
    // Issue every load of the tile first, K and V: 2 x kKeysPerThread 16-byte loads in flight per thread
    // (decode is memory-bound: the more bytes in flight, the closer to the bandwidth). Key group grp takes
    // keys grp, grp + kGroups, ...: consecutive groups read consecutive keys.
    Pack<8> kp[kKeysPerThread], vp[kKeysPerThread];
#pragma unroll
    for (int u = 0; u < kKeysPerThread; ++u) {
      const int j = u * kGroups + grp;
      kp[u] = Pack<8>{};
      vp[u] = Pack<8>{};
      if (active && j < n) {
        kp[u] = load_pack<8>(seq.key(t0 + j) + col);
        vp[u] = load_pack<8>(seq.value(t0 + j) + col);
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
      p.out[static_cast<int64_t>(q_row) * p.out_stride + h * D + d] =
          __float2bfloat16_rn(l > 0.f ? o / l * p.v_scale : 0.f);
    } else {
      float* part = p.partials + ((static_cast<int64_t>(b) * p.n_heads + h) * kMaxSplits + blockIdx.x) * (D + 2);
      part[d] = o;
      if (d == 0) {
        part[D] = sM[g];
        part[D + 1] = sL[g];
      }
    }
  }
  // --- end of exercise 10.4 ---
}

// grid: (n_heads, B); one thread per output dim. The splits' results are relative to their own maxima m_s:
// rescaled to the global max M by 2^(m_s - M), added, normalised once. An empty split (m = -inf) adds nothing.
// (static: a kernel defined in a header that two lessons' .cu files include.)
static __global__ void decode_combine_kernel(const DecodeParams p, int num_splits) {
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
  p.out[static_cast<int64_t>(q_row) * p.out_stride + h * D + d] = __float2bfloat16_rn(L > 0.f ? o / L * p.v_scale : 0.f);
}

template <int TPK, int G, class KV>
void launch_decode(const DecodeParams& p, const KV& kv, int n_kv_heads, int batch_size, int num_splits,
                   cudaStream_t stream) {
  const int head_tiles = (p.group + G - 1) / G;
  const dim3 grid(static_cast<unsigned>(num_splits), static_cast<unsigned>(n_kv_heads * head_tiles),
                  static_cast<unsigned>(batch_size));
  // At most 32 KiB (head_dim 256, G 8): under the 48 KiB a block gets without opting in.
  decode_attention_kernel<TPK, G, KV><<<grid, kDecodeThreads, decode_smem_bytes<TPK, G>(p.head_dim), stream>>>(p, kv);
  TVLLM_CHECK_LAUNCH();
}

// The query heads per block: the group, rounded up to a power of two, at most 8 (registers: 16 floats per head
// per thread). A group of 3 runs as 4 with one zero query; a group of 16 as two blocks of 8.
template <int TPK, class KV>
void launch_decode_for_group(const DecodeParams& p, const KV& kv, int n_kv_heads, int batch_size, int num_splits,
                             cudaStream_t stream) {
  if (p.group >= 5) launch_decode<TPK, 8>(p, kv, n_kv_heads, batch_size, num_splits, stream);
  else if (p.group >= 3) launch_decode<TPK, 4>(p, kv, n_kv_heads, batch_size, num_splits, stream);
  else if (p.group == 2) launch_decode<TPK, 2>(p, kv, n_kv_heads, batch_size, num_splits, stream);
  else launch_decode<TPK, 1>(p, kv, n_kv_heads, batch_size, num_splits, stream);
}

// The decode kernel for p.head_dim, then (num_splits > 1) the combine, on `stream`.
template <class KV>
void launch(const DecodeParams& p, const KV& kv, int n_kv_heads, int batch_size, int num_splits, cudaStream_t stream) {
  // Threads per key: head_dim / 8 rounded up to a power of two (4 at least: a head_dim of 8..32 is rare
  // enough to run with idle lanes).
  if (p.head_dim <= 32) launch_decode_for_group<4>(p, kv, n_kv_heads, batch_size, num_splits, stream);
  else if (p.head_dim <= 64) launch_decode_for_group<8>(p, kv, n_kv_heads, batch_size, num_splits, stream);
  else if (p.head_dim <= 128) launch_decode_for_group<16>(p, kv, n_kv_heads, batch_size, num_splits, stream);
  else launch_decode_for_group<32>(p, kv, n_kv_heads, batch_size, num_splits, stream);
  if (num_splits > 1) {
    const int threads = static_cast<int>(ceil_div(p.head_dim, 32) * 32);
    decode_combine_kernel<<<dim3(static_cast<unsigned>(p.n_heads), static_cast<unsigned>(batch_size)), threads, 0,
                            stream>>>(p, num_splits);
    TVLLM_CHECK_LAUNCH();
  }
}

// The query side of a launch, from checked views (the split scratch from the workspace).
inline DecodeParams make_params(const TensorView& out, const TensorView& q, const AttentionBatch& batch,
                                const AttentionShape& shape, const DecodeWorkspace& workspace) {
  DecodeParams p;
  p.q = q.ptr<const bf16>();
  p.out = out.ptr<bf16>();
  p.q_stride = q.strides[0];
  p.out_stride = out.strides[0];
  p.cu_q = batch.cu_seqlens_q_device();
  p.cu_k = batch.cu_seqlens_k_device();
  p.head_dim = static_cast<int>(shape.head_dim);
  p.group = static_cast<int>(shape.group_size());
  p.n_heads = static_cast<int>(shape.n_heads);
  p.scale_log2 = static_cast<float>(shape.scale() * 1.4426950408889634);  // log2(e), as lesson 07
  p.window = static_cast<int>(shape.window);
  p.partials = workspace.partials();
  return p;
}

}  // namespace decode
}  // namespace tvllm
