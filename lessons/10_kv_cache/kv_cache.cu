// Lesson 10 on the GPU: the KV write, decode attention (flash-decoding) and prefill over the cache (lesson 07's
// flash kernel with the CacheKV policy).
//
//   kv_write_kernel           one block per new token: its k and v rows -> (slot, position) of the cache
//   decode_attention_kernel   one block per (sequence, kv head, <= 8 query heads of its group, split of the
//                             keys): scores, softmax and P V over its keys, fp32; writes a partial result
//   decode_combine_kernel     per (sequence, head): rescales the splits' partials to one max and adds them
//   CacheKV                   the KV policy of flash_attention.cuh for this cache
//
// README.md derives them; the comments here say why each line is as it is.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common/cuda_utils.cuh"
#include "common/errors.h"
#include "common/exercise.h"
#include "flash_attention.cuh"
#include "kv_cache.h"

namespace tvllm {

namespace {

using bf16 = __nv_bfloat16;

// =================================================================================================
// The KV write
// =================================================================================================

constexpr int kWriteThreads = 128;

// The sequence a packed token t belongs to: the largest b with cu_q[b] <= t (sequences with no new token
// share their cu_q value with the next one; the largest such b is the one whose range holds t).
[[maybe_unused]] __device__ __forceinline__ int sequence_of(const int32_t* cu_q, int batch_size, int t) {
  int lo = 0, hi = batch_size - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (cu_q[mid] <= t) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

struct KvWriteParams {
  bf16* k_cache;         // layer's k: [slots, max_context, kv_dim]
  bf16* v_cache;
  const bf16* k;         // the step's new rows [T, >= kv_dim], k_stride apart (views into the QKV buffer)
  const bf16* v;
  int64_t k_stride, v_stride;
  const int32_t* cu_q;   // [B+1] device
  const int32_t* cu_k;   // [B+1] device
  const int32_t* slots;  // [B] device
  int batch_size;
  int kv_dim;
  int max_context;
};

// grid: one block per new token (T = batch.total_q()). Everything that changes from step to step (which
// sequence, which slot, which position) is read from device arrays, so a captured graph stays right.
__global__ void __launch_bounds__(kWriteThreads) kv_write_kernel(const KvWriteParams p) {
  // --- exercise 10.3: the KV-write kernel -------------------------------------------------------------
  // Task: block t copies row t of k and of v (kv_dim bf16 each) into the cache, at row
  //   slots[b] * max_context + pos of the layer, where b is token t's sequence (sequence_of) and
  //   pos = k_len[b] - q_len[b] + (t - cu_q[b]) its position. 16 bytes (8 bf16) per thread per step.
  // Hint: load_pack<8> / store_pack<8> (common/cuda_utils.cuh) move 8 bf16 at once; kv_dim is a multiple of 8.
  // Hint: the cache offset needs 64 bits: slots * max_context * kv_dim exceeds 2^31 for a large cache.
  // Tests: KvCacheGpu.WriteMatchesCpu* KvCacheGpu.GenerationAgreesWithHuggingFaceTeacherForced
  // Stub: device
  // --- solution ---
  const int t = blockIdx.x;
  const int b = sequence_of(p.cu_q, p.batch_size, t);
  const int q_begin = p.cu_q[b];
  const int q_len = p.cu_q[b + 1] - q_begin;
  const int k_len = p.cu_k[b + 1] - p.cu_k[b];
  const int pos = k_len - q_len + (t - q_begin);  // the new tokens are the last q_len of the k_len
  const int64_t row = static_cast<int64_t>(p.slots[b]) * p.max_context + pos;
  bf16* k_dst = p.k_cache + row * p.kv_dim;
  bf16* v_dst = p.v_cache + row * p.kv_dim;
  const bf16* k_src = p.k + static_cast<int64_t>(t) * p.k_stride;
  const bf16* v_src = p.v + static_cast<int64_t>(t) * p.v_stride;
  for (int c = threadIdx.x * 8; c < p.kv_dim; c += kWriteThreads * 8) {
    store_pack<8>(k_dst + c, load_pack<8>(k_src + c));
    store_pack<8>(v_dst + c, load_pack<8>(v_src + c));
  }
  // --- end of exercise 10.3 ---
}

// =================================================================================================
// Decode attention: flash-decoding
// =================================================================================================

constexpr int kDecodeThreads = 128;
constexpr int kDecodeWarps = kDecodeThreads / 32;
constexpr int kKeysPerThread = 8;  // keys whose 16 bytes one thread has in flight at once (per k and v)
constexpr int kMaxSplits = DecodeWorkspace::kMaxDecodeSplits;

struct DecodeParams {
  const bf16* q;          // row 0 of q: packed rows (cu_seqlens_q), q_stride apart; head h at column h*head_dim
  bf16* out;              // same layout as q
  int64_t q_stride, out_stride;
  const bf16* k_cache;    // layer's k: [slots, max_context, kv_dim]
  const bf16* v_cache;
  const int32_t* cu_q;    // [B+1] device
  const int32_t* cu_k;    // [B+1] device
  const int32_t* slots;   // [B] device
  int max_context, kv_dim, head_dim, group, n_heads;
  float scale_log2;       // (1/sqrt(head_dim)) * log2(e): scores in base-2 units, exp becomes exp2
  float* partials;        // [B][n_heads][kMaxSplits][head_dim + 2]: unnormalised o, then m, then l
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
// sequence's keys: an equal share ceil(k_len / num_splits), read in tiles.
//   TPK  threads per key: the next power of two >= head_dim / 8, each thread holding 8 dims (16 bytes) of a
//        key. The block's 128 threads are 128 / TPK key groups, each on its own keys.
//   G    query heads per block: every K and V vector loaded is used by all G heads of the group (GQA).
// Per tile: (1) each key group computes q.k for its keys and all G heads (a dot product over its TPK
// threads: shuffles), into shared memory; (2) one warp per head: the tile's max, the running max, p =
// 2^(s - m), the sum; (3) every thread rescales its output accumulators by 2^(m_old - m_new) and adds p v
// for its keys. At the end the key groups' accumulators are added (shuffles, then shared memory in a
// fixed order) and written: normalised (one split) or as a partial for the combine kernel.
template <int TPK, int G>
__global__ void __launch_bounds__(kDecodeThreads) decode_attention_kernel(const DecodeParams p) {
  // --- exercise 10.4: the decode attention kernel ------------------------------------------------------
  // Task: the body described above: one query per sequence, the split's keys in tiles of
  //   decode_tile<TPK>(), an online softmax across tiles (running max and sum per head), fp32 throughout,
  //   and the output either normalised (gridDim.x == 1) or as a partial (o, m, l) for decode_combine_kernel.
  // Hint: keep every __shfl_xor_sync on all 32 lanes: loop over a compile-time number of keys per thread
  //   and mask the loads (j < n), not the loop.
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
  const int chunk = (k_len + static_cast<int>(gridDim.x) - 1) / static_cast<int>(gridDim.x);
  const int key_begin = min(k_len, static_cast<int>(blockIdx.x) * chunk);
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
  // Position 0 of this sequence's slot, this kv head, this thread's 8 dims.
  const int64_t base = static_cast<int64_t>(p.slots[b]) * p.max_context * p.kv_dim + static_cast<int64_t>(kv_head) * D + col;
  const bf16* K = p.k_cache + base;
  const bf16* V = p.v_cache + base;

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
        kp[u] = load_pack<8>(K + static_cast<int64_t>(t0 + j) * p.kv_dim);
        vp[u] = load_pack<8>(V + static_cast<int64_t>(t0 + j) * p.kv_dim);
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
  // --- end of exercise 10.4 ---
}

// grid: (n_heads, B); one thread per output dim. The splits' results are relative to their own maxima m_s:
// rescaled to the global max M by 2^(m_s - M), added, normalised once. An empty split (m = -inf) adds nothing.
__global__ void decode_combine_kernel(const DecodeParams p, int num_splits) {
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
void launch_decode(const DecodeParams& p, int n_kv_heads, int batch_size, int num_splits, cudaStream_t stream) {
  const int head_tiles = (p.group + G - 1) / G;
  const dim3 grid(static_cast<unsigned>(num_splits), static_cast<unsigned>(n_kv_heads * head_tiles),
                  static_cast<unsigned>(batch_size));
  // At most 32 KiB (head_dim 256, G 8): under the 48 KiB a block gets without opting in.
  decode_attention_kernel<TPK, G><<<grid, kDecodeThreads, decode_smem_bytes<TPK, G>(p.head_dim), stream>>>(p);
  TVLLM_CHECK_LAUNCH();
}

// The query heads per block: the group, rounded up to a power of two, at most 8 (registers: 16 floats per head
// per thread). A group of 3 runs as 4 with one zero query; a group of 16 as two blocks of 8.
template <int TPK>
void launch_decode_for_group(const DecodeParams& p, int n_kv_heads, int batch_size, int num_splits,
                             cudaStream_t stream) {
  if (p.group >= 5) launch_decode<TPK, 8>(p, n_kv_heads, batch_size, num_splits, stream);
  else if (p.group >= 3) launch_decode<TPK, 4>(p, n_kv_heads, batch_size, num_splits, stream);
  else if (p.group == 2) launch_decode<TPK, 2>(p, n_kv_heads, batch_size, num_splits, stream);
  else launch_decode<TPK, 1>(p, n_kv_heads, batch_size, num_splits, stream);
}

// =================================================================================================
// Prefill and chunks over the cache: lesson 07's flash kernel with this cache's KV policy
// =================================================================================================

// The contract is at the top of flash_attention.cuh: sequence() once per block, key()/value() in the hot loop.
struct CacheKV {
  const bf16* k;         // the layer's k: [slots, max_context, kv_dim]
  const bf16* v;
  const int32_t* slots;  // [B] device: sequence b's slot
  int64_t slot_stride;   // max_context * kv_dim: elements from one slot to the next
  int kv_dim;            // elements from one position to the next
  int head_dim;

  struct Sequence {
    const bf16* k;  // position 0 of this sequence's slot, this kv head
    const bf16* v;
    int stride;
    __device__ __forceinline__ const bf16* key(int pos) const { return k + static_cast<int64_t>(pos) * stride; }
    __device__ __forceinline__ const bf16* value(int pos) const { return v + static_cast<int64_t>(pos) * stride; }
  };
  // k_begin (where packed keys would start) means nothing here: a sequence's keys are its slot's positions.
  __device__ __forceinline__ Sequence sequence(int b, int /*k_begin*/, int kv_head) const {
    const int64_t at = static_cast<int64_t>(slots[b]) * slot_stride + static_cast<int64_t>(kv_head) * head_dim;
    return {k + at, v + at, kv_dim};
  }
};

}  // namespace

// ---- launchers -------------------------------------------------------------------------------------------

void kv_cache_write_cuda(const TensorView& cache_k, const TensorView& cache_v, const TensorView& k,
                         const TensorView& v, const AttentionBatch& batch, const CacheSlots& slots,
                         cudaStream_t stream) {
  KvWriteParams p;
  p.k_cache = cache_k.ptr<bf16>();
  p.v_cache = cache_v.ptr<bf16>();
  p.k = k.ptr<const bf16>();
  p.v = v.ptr<const bf16>();
  p.k_stride = k.strides[0];
  p.v_stride = v.strides[0];
  p.cu_q = batch.cu_seqlens_q_device();
  p.cu_k = batch.cu_seqlens_k_device();
  p.slots = slots.device_slots();
  p.batch_size = batch.batch_size();
  p.kv_dim = static_cast<int>(cache_k.shape[2]);
  p.max_context = static_cast<int>(cache_k.shape[1]);
  kv_write_kernel<<<static_cast<unsigned>(batch.total_q()), kWriteThreads, 0, stream>>>(p);
  TVLLM_CHECK_LAUNCH();
}

void decode_attention_cuda(const TensorView& out, const TensorView& q, const TensorView& cache_k,
                           const TensorView& cache_v, const AttentionBatch& batch, const CacheSlots& slots,
                           const AttentionShape& shape, int num_splits, const DecodeWorkspace& workspace,
                           cudaStream_t stream) {
  DecodeParams p;
  p.q = q.ptr<const bf16>();
  p.out = out.ptr<bf16>();
  p.q_stride = q.strides[0];
  p.out_stride = out.strides[0];
  p.k_cache = cache_k.ptr<const bf16>();
  p.v_cache = cache_v.ptr<const bf16>();
  p.cu_q = batch.cu_seqlens_q_device();
  p.cu_k = batch.cu_seqlens_k_device();
  p.slots = slots.device_slots();
  p.max_context = static_cast<int>(cache_k.shape[1]);
  p.kv_dim = static_cast<int>(shape.kv_dim());
  p.head_dim = static_cast<int>(shape.head_dim);
  p.group = static_cast<int>(shape.group_size());
  p.n_heads = static_cast<int>(shape.n_heads);
  p.scale_log2 = static_cast<float>(shape.scale() * 1.4426950408889634);  // log2(e), as lesson 07
  p.partials = workspace.partials();
  const int kv_heads = static_cast<int>(shape.n_kv_heads), B = batch.batch_size();
  // Threads per key: head_dim / 8 rounded up to a power of two (4 at least: a head_dim of 8..32 is rare
  // enough to run with idle lanes).
  if (shape.head_dim <= 32) launch_decode_for_group<4>(p, kv_heads, B, num_splits, stream);
  else if (shape.head_dim <= 64) launch_decode_for_group<8>(p, kv_heads, B, num_splits, stream);
  else if (shape.head_dim <= 128) launch_decode_for_group<16>(p, kv_heads, B, num_splits, stream);
  else launch_decode_for_group<32>(p, kv_heads, B, num_splits, stream);
  if (num_splits > 1) {
    const int threads = static_cast<int>(ceil_div(shape.head_dim, 32) * 32);
    decode_combine_kernel<<<dim3(static_cast<unsigned>(shape.n_heads), static_cast<unsigned>(B)), threads, 0,
                            stream>>>(p, num_splits);
    TVLLM_CHECK_LAUNCH();
  }
}

void cached_flash_attention_cuda(const TensorView& out, const TensorView& q, const TensorView& cache_k,
                                 const TensorView& cache_v, const AttentionBatch& batch, const CacheSlots& slots,
                                 const AttentionShape& shape, cudaStream_t stream) {
  const CacheKV kv{cache_k.ptr<const bf16>(), cache_v.ptr<const bf16>(), slots.device_slots(),
                   cache_k.shape[1] * cache_k.shape[2], static_cast<int>(cache_k.shape[2]),
                   static_cast<int>(shape.head_dim)};
  flash_attention(out, q, kv, batch, shape, stream);
}

}  // namespace tvllm
