// Lesson 14's decode attention: lesson 10's flash-decoding, rebuilt to keep the memory bus busy. Templates over
// lesson 07's KV policy contract (flash_attention.cuh), like lesson 10's kernel, so it reads lesson 10's
// contiguous cache (CacheKV, cache_kv.cuh) and lesson 12's paged pool (PagedKV, paged_kv_policy.cuh) alike.
//
//   fast_decode_kernel     one block per (sequence, kv head, <= 8 query heads of its group, split of the keys);
//                          its 4 warps work INDEPENDENTLY, each on its own tiles of keys, with its own running
//                          max, sum and output in registers; ONE barrier at the end merges the 4 warps
//   fast_combine_kernel    one block per (sequence, head): the splits' partials rescaled to one max and added
//                          (only when the grid has more than one split), every load of it in flight at once
//   last_split_combine     (opt-in, measured slower: README section 8) the combine inside the decode kernel
//                          instead: the last split block of each (sequence, head tile) to finish, found with one
//                          atomic counter, combines; no second kernel
//
// Why not lesson 10's kernel (README "Decode attention at the memory roofline" has the long story): there, every
// tile of keys goes load -> scores -> __syncthreads -> softmax by one warp per head -> __syncthreads -> P V ->
// __syncthreads. While a block computes, it has NO load in flight, and every warp of it waits at the barriers for
// the slowest. Here a warp, while it computes tile t, already has its next tiles in flight (software pipelining),
// and nothing but the end of the block waits for another warp. Two ways to hold the tiles in flight:
//
//   Pipeline::Registers  v1: two stages in registers (A, B): the loads of the next tile are issued before the
//                        current one is computed. Simple, but every byte in flight is a register (64 per lane
//                        at 4 rounds), which limits the blocks per SM.
//   Pipeline::Ring       v2 (default): kRingStages stages per warp in shared memory, filled by cp.async (16
//                        bytes global -> shared without registers); a lane reads back only the 16-byte pieces it
//                        copied itself, so a cp.async.wait_group of its own is all the synchronisation it needs.
//                        Two tiles ahead in flight per warp at no register cost.
//
// A warp's tile: U rounds of 32 / TPK keys, each key read by TPK lanes of 8 dims (16 bytes) each, K and V
// together. With head_dim 64 (TPK 8) and U 4 that is 16 keys: one block of lesson 12's pool, whose block-table
// entry every lane reads from the same address (one transaction, an L1 hit after the first lane group).
//
// Arithmetic (what the CPU reference computes; README section 8, "What correct means here"): scores in base-2 units, fp32
// throughout, P never rounded; per split a max m, a sum l and an unnormalised output o relative to m; the
// combine rescales by 2^(m_s - M). The order of the additions differs from lesson 10's kernel (per warp, then
// the 4 warps in a fixed order), so the bits may differ from it by fp32 rounding; for a given split count the
// result is the same on every run and in a CUDA graph (fixed orders; the one atomic only elects the block that
// combines, never an order of additions).
//
// Include it from a .cu file (C++17); decode_attention_fast.cu instantiates it and installs it into lessons 10
// and 12 (decode_attention_fast.h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "common/cuda_utils.cuh"
#include "common/errors.h"
#include "common/mma.cuh"  // cp.async (lesson 06)
#include "kv_cache.h"
#include "pdl.cuh"
#include "stream_load.cuh"

namespace tvllm {
namespace fast_decode {

using bf16 = __nv_bfloat16;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kMaxSplits = DecodeWorkspace::kMaxDecodeSplits;
// A split's share of the keys is rounded up to a multiple of this: with blocks of 16 positions (lesson 12's
// default) and no window, every warp tile of 16 (or 8, 4) keys then lies inside one block of the pool. (With a
// window a tile may straddle two blocks: correct all the same, each key's address comes from its own entry.)
constexpr int kSplitAlign = 16;
// Stages of a warp's shared-memory ring (Pipeline::Ring): the tile being computed and kRingStages - 1 in flight.
constexpr int kRingStages = 3;

enum class Pipeline { Registers, Ring };

// The query side of a launch and the split scratch (the keys and values come through the KV policy).
struct Params {
  const bf16* q;          // row 0 of q: packed rows (cu_seqlens_q), q_stride apart; head h at column h*head_dim
  bf16* out;              // same layout as q
  int64_t q_stride, out_stride;
  const int32_t* cu_q;    // [B+1] device
  const int32_t* cu_k;    // [B+1] device: k_len[b] = cu_k[b+1] - cu_k[b]
  int head_dim, group, n_heads;
  int window;             // 0: every key; W > 0: only keys [max(0, k_len - W), k_len) (a sliding window)
  float scale_log2;       // (1/sqrt(head_dim)) * log2(e): scores in base-2 units, exp becomes exp2
  float* partials;        // [B][n_heads][kMaxSplits][head_dim + 2]: unnormalised o, then m, then l (lesson 10's)
  // The combine in the decode kernel (last_split_combine below): [B][n_heads] counters, zero between launches
  // (DecodeWorkspace::split_arrivals). nullptr: the splits' partials are left to fast_combine_kernel.
  int* arrivals = nullptr;
  // Lesson 16's FP8 KV pool: values read back as code * v_scale, applied once to the normalised output (1 for bf16:
  // the same bits); the launcher folds k_scale into scale_log2.
  float v_scale = 1.0f;
};

// Rounds a lane keeps per stage: U keys' K and V, 8 registers each. With 8 query heads a lane already holds
// 64 fp32 of q and 64 of output; 2 rounds keep it clear of spills.
template <int G>
constexpr int rounds_per_stage() {
  return G >= 8 ? 2 : 4;
}

// Shared memory: the ring (Pipeline::Ring: [kWarps][kRingStages][U rounds][K, V][32 lanes] x 16 bytes), which the
// final merge reuses for the 4 warps' outputs [kWarps][G][head_dim] and their m and l [kWarps][G], and the last
// block's combine after it for the splits' weights [2][G][kMaxSplits]. At most 48 KiB
// (U 4; head_dim 256 with G 8: 33 KiB of merge), the most a block gets without opting in.
template <int G>
size_t smem_bytes(Pipeline pipeline, int head_dim) {
  const size_t merge = static_cast<size_t>(kWarps * G * (head_dim + 2)) * sizeof(float);
  const size_t ring_bytes = size_t{kWarps} * kRingStages * rounds_per_stage<G>() * 2 * 32 * 16;
  const size_t ring = pipeline == Pipeline::Ring ? ring_bytes : 0;
  const size_t combine = static_cast<size_t>(2 * G * kMaxSplits) * sizeof(float);  // last_split_combine
  return std::max({merge, ring, combine});
}

// One stage of a warp's pipeline: this lane's 16 bytes of U keys and of their U values.
template <int U>
struct Stage {
  Pack<8> k[U], v[U];
};

// The combine without a kernel of its own ("the last block combines"): every split block of a (sequence, head
// tile) has written its partials; it makes them visible to the whole GPU (__threadfence), then counts itself in
// with one atomicAdd on the tile's counter. The block that counts last knows every partial is written: it
// combines them, for its heads, and sets the counter back to zero for the next launch (a CUDA graph replays the
// same counters). Which block is last changes from run to run; the arithmetic does not: every output adds the
// splits in split order (s = 0, 1, ...), so the bits are the same on every run and in a graph. (They are not
// fast_combine_kernel's bits, whose sums run in another order: the two agree within one bf16 rounding.)
// One fewer kernel per decode step and layer: no launch, no drain-and-refill between two kernels, no second read
// of q_row and cu_q. The price is one atomic per block and the fence.
__device__ __forceinline__ void last_split_combine(const Params& p, int b, int q_row, int h0, int heads,
                                                   float* smem) {
  __threadfence();  // this thread's partials are visible device-wide before the block counts itself in
  __syncthreads();  // ... every thread's, and the merge's shared memory is free again
  int is_last = 0;
  if (threadIdx.x == 0) {
    int* counter = p.arrivals + static_cast<int64_t>(b) * p.n_heads + h0;
    is_last = atomicAdd(counter, 1) == static_cast<int>(gridDim.x) - 1;
    if (is_last) *counter = 0;  // every split has counted: nobody else touches it in this launch
  }
  // A barrier that also tells every thread what thread 0 found (no __shared__ flag: the ring's 48 KiB of
  // dynamic shared memory is already the most a block may have without opting in).
  if (!__syncthreads_or(is_last)) return;
  __threadfence();  // the other blocks' partials, fenced before their atomics, are read after ours
  const int D = p.head_dim, S = static_cast<int>(gridDim.x);
  // Phase 1: each (head, split)'s weight w_s = 2^(m_s - M) and weighted sum w_s l_s into shared memory (the
  // merge's space, free now; smem_bytes makes room for [2][G][kMaxSplits]). Every m_s and l_s is loaded at
  // once (one thread each), then each thread finds its head's max M among them in shared memory.
  float* sW = smem;               // [heads][S]: m_s, then w_s
  float* sWL = smem + heads * S;  // [heads][S]: l_s, then w_s * l_s
  for (int i = threadIdx.x; i < heads * S; i += kThreads) {
    const int g = i / S, s = i % S;
    const float* part = p.partials + ((static_cast<int64_t>(b) * p.n_heads + h0 + g) * kMaxSplits + s) * (D + 2);
    sW[i] = __ldcg(part + D);
    sWL[i] = __ldcg(part + D + 1);
  }
  __syncthreads();
  constexpr int kPerThread = (8 * kMaxSplits + kThreads - 1) / kThreads;  // heads * S <= 8 * kMaxSplits
  float w[kPerThread], wl[kPerThread];
#pragma unroll
  for (int r = 0; r < kPerThread; ++r) {
    const int i = threadIdx.x + r * kThreads;
    if (i >= heads * S) break;
    const int g = i / S;
    float M = -INFINITY;
    for (int s = 0; s < S; ++s) M = fmaxf(M, sW[g * S + s]);
    const float ms = sW[i];
    w[r] = ms == -INFINITY ? 0.f : exp2f(ms - M);  // an empty split (m = -inf) weighs nothing
    wl[r] = w[r] * sWL[i];
  }
  __syncthreads();  // every m_s and l_s read: overwrite them with the weights
#pragma unroll
  for (int r = 0; r < kPerThread; ++r) {
    const int i = threadIdx.x + r * kThreads;
    if (i >= heads * S) break;
    sW[i] = w[r];
    sWL[i] = wl[r];
  }
  __syncthreads();
  // Phase 2: every output element adds its splits in split order, 8 loads in flight at a time.
  for (int i = threadIdx.x; i < heads * D; i += kThreads) {
    const int g = i / D, d = i % D, h = h0 + g;
    const float* part = p.partials + (static_cast<int64_t>(b) * p.n_heads + h) * kMaxSplits * (D + 2) + d;
    float o = 0.f, L = 0.f;
    constexpr int kInFlight = 8;
    for (int s0 = 0; s0 < S; s0 += kInFlight) {
      float v[kInFlight];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) v[u] = s0 + u < S ? __ldcg(part + (s0 + u) * (D + 2)) : 0.f;
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        if (s0 + u >= S) break;
        o = fmaf(sW[g * S + s0 + u], v[u], o);
        L += sWL[g * S + s0 + u];
      }
    }
    p.out[static_cast<int64_t>(q_row) * p.out_stride + h * D + d] =
        __float2bfloat16_rn(L > 0.f ? o / L * p.v_scale : 0.f);
  }
}

// grid: (num_splits, n_kv_heads * ceil(group / G), B); kThreads threads. TPK: threads per key (head_dim / 8
// rounded up to a power of two); G: query heads per block; U: rounds per stage; P: where the stages live.
template <int TPK, int G, int U, Pipeline P, class KV>
__global__ void __launch_bounds__(kThreads) fast_decode_kernel(const Params p, const KV kv) {
  constexpr int kKeysPerRound = 32 / TPK;        // keys a warp reads per load instruction
  constexpr int kTile = U * kKeysPerRound;       // keys per warp tile (one pipeline stage)
  extern __shared__ __align__(16) float fast_smem[];
  // Launched as a programmatic dependent (pdl.cuh; launch's `pdl`), this kernel may start while the kernels
  // before it still run. What they write this step: q, and the new token's k and v (the qkv GEMV's KV write, or
  // lesson 10/12's write kernel), i.e. key k_len - 1 of each sequence. What they do not: the step's metadata
  // (cu_q, cu_k, the slots and block tables: copied in before the step) and every OLDER key and value, written by
  // earlier steps. So the ring pipeline reads the metadata and starts its first tiles of old keys BEFORE the wait
  // (kEarlyKeys: they load while the qkv GEMV drains), and everything this step writes after it: q, and the new
  // key, which the lanes holding it load into registers and put in place of the zeros their early copy left
  // (new_k, new_v below). The trigger right after the wait lets the o GEMV behind us be scheduled. Without PDL the
  // wait returns at once and the early loads simply come first: the same values, the same bits.
  constexpr bool kEarlyKeys = P == Pipeline::Ring;
  if constexpr (!kEarlyKeys) {
    pdl_wait_for_previous_kernel();
    pdl_let_next_kernel_start();
  }

  const int b = blockIdx.z;
  const int q_row = p.cu_q[b];
  if (p.cu_q[b + 1] - q_row != 1) {  // no query for this sequence: the whole block leaves
    if constexpr (kEarlyKeys) pdl_wait_for_previous_kernel();  // every block of a PDL kernel waits (pdl.cuh)
    return;
  }
  const int head_tiles = (p.group + G - 1) / G;
  const int kv_head = static_cast<int>(blockIdx.y) / head_tiles;
  const int h0 = kv_head * p.group + (static_cast<int>(blockIdx.y) % head_tiles) * G;
  const int heads = min(G, (kv_head + 1) * p.group - h0);  // real heads of this block (the rest: zero queries)

  // This split's keys, from THIS step's k_len (a CUDA graph keeps the number of splits, not the lengths): the
  // window's keys [first, k_len) cut into num_splits shares, each rounded up to kSplitAlign keys.
  const int k_len = p.cu_k[b + 1] - p.cu_k[b];
  const int first = p.window > 0 ? max(0, k_len - p.window) : 0;
  const int splits = static_cast<int>(gridDim.x);
  const int share = ((k_len - first + splits - 1) / splits + kSplitAlign - 1) / kSplitAlign * kSplitAlign;
  const int key_begin = min(k_len, first + static_cast<int>(blockIdx.x) * share);
  const int key_end = min(k_len, key_begin + share);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int kg = lane / TPK, c = lane % TPK;  // this lane's key within a round, and its 8 dims of that key
  const int D = p.head_dim;
  const bool active = c * 8 < D;              // TPK * 8 may exceed head_dim (80 -> 16 lanes, 10 active)
  const int col = active ? c * 8 : 0;

  const auto seq = kv.sequence(b, p.cu_k[b], kv_head);
  const int n_tiles = (key_end - key_begin + kTile - 1) / kTile;
  // The ring (Pipeline::Ring): this lane's 16-byte pieces of stage s, round u, K (0) or V (1). Lane-private slots,
  // consecutive lanes at consecutive 16 bytes: no bank conflicts, and no other lane ever reads them.
  uint4* ring = reinterpret_cast<uint4*>(fast_smem) + warp * (kRingStages * U * 2 * 32);
  const auto slot = [&](int stage, int u, int kv_half) { return ring + ((stage * U + u) * 2 + kv_half) * 32 + lane; };
  // cp.async tile t into `stage`, keys below `end` only; a key past it (or a lane past head_dim) reads nothing and
  // gets zeros (cp.async's src-size 0, from an address that is valid anyway: cu_q).
  const auto issue = [&](int stage, int t, int end) {
    const int base = key_begin + t * kTile + kg;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = base + u * kKeysPerRound;
      const bool valid = active && j < end;
      cp_async_16(slot(stage, u, 0), valid ? static_cast<const void*>(seq.key(j) + col) : p.cu_q, valid);
      cp_async_16(slot(stage, u, 1), valid ? static_cast<const void*>(seq.value(j) + col) : p.cu_q, valid);
    }
  };
  // The ring's first kRingStages - 1 tiles of this warp, before the wait: old keys only (below k_len - 1). One
  // commit group per tile, empty ones included, so that "the group of the tile now computed" is always
  // kRingStages - 1 groups behind the newest.
  const int new_key = k_len - 1;  // the key this step's kernels write
  if constexpr (kEarlyKeys) {
#pragma unroll
    for (int i = 0; i < kRingStages - 1; ++i) {
      if (warp + i * kWarps < n_tiles) issue(i, warp + i * kWarps, min(key_end, new_key));
      cp_async_commit();
    }
    pdl_wait_for_previous_kernel();  // from here on: q, the new key, and every write
    pdl_let_next_kernel_start();
  }
  // The new key, where an early copy left zeros in its place: tile new_tile, round new_round; the lanes of its
  // key group in warp new_tile % kWarps load it into registers now, after the wait, and swap it in below.
  const int new_offset = new_key - key_begin;
  const int new_tile = new_offset >= 0 && new_key < key_end ? new_offset / kTile : -1;
  const bool new_was_early =
      kEarlyKeys && new_tile >= 0 && new_tile % kWarps == warp && new_tile / kWarps < kRingStages - 1;
  const int new_round = new_tile >= 0 ? (new_offset % kTile) / kKeysPerRound : 0;
  const bool holds_new = new_was_early && active && kg == (new_offset % kTile) % kKeysPerRound;
  Pack<8> new_k{}, new_v{};
  if (holds_new) {
    new_k = load_pack<8>(seq.key(new_key) + col);
    new_v = load_pack<8>(seq.value(new_key) + col);
  }

  // The block's query heads, scaled so that q.k comes out in base-2 units. Missing heads are zeros.
  float qr[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    Pack<8> qp{};
    if (active && g < heads) qp = load_pack<8>(p.q + static_cast<int64_t>(q_row) * p.q_stride + (h0 + g) * D + col);
#pragma unroll
    for (int e = 0; e < 8; ++e) qr[g][e] = qp.get(e) * p.scale_log2;
  }
  // This warp's running softmax state per head: m is the same in every lane; l and acc are this lane's keys'
  // share (each key group adds its own keys), added across the warp's key groups at the end.
  float m[G], l[G], acc[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[g][e] = 0.f;
  }

  // Registers: issue the loads of tile t (its K and V rows together); keys past the split's end are zeros.
  const auto fetch = [&](Stage<U>& s, int t) {
    const int base = key_begin + t * kTile + kg;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = base + u * kKeysPerRound;
      s.k[u] = Pack<8>{};
      s.v[u] = Pack<8>{};
      if (active && j < key_end) {
        s.k[u] = load_streaming(seq.key(j) + col);
        s.v[u] = load_streaming(seq.value(j) + col);
      }
    }
  };
  // Fold tile t into the warp's state: scores, the tile's max, rescale, p = 2^(s - m), l += p, acc += p v.
  const auto consume = [&](const Stage<U>& s, int t) {
    const int base = key_begin + t * kTile + kg;
    float sc[U][G];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const bool valid = base + u * kKeysPerRound < key_end;
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float dot = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) dot = fmaf(qr[g][e], s.k[u].get(e), dot);
        // The key's TPK lanes add their 8-dim parts (all of them end with the whole dot product).
#pragma unroll
        for (int off = TPK / 2; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
        sc[u][g] = valid ? dot : -INFINITY;
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float tile_max = sc[0][g];
#pragma unroll
      for (int u = 1; u < U; ++u) tile_max = fmaxf(tile_max, sc[u][g]);
      // Across the warp's key groups: lanes c, c + TPK, c + 2 TPK, ... hold different keys.
#pragma unroll
      for (int off = TPK; off < 32; off <<= 1) tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, off));
      const float m_new = fmaxf(m[g], tile_max);
      const float m_ref = m_new == -INFINITY ? 0.f : m_new;  // never -inf - -inf (lesson 07 section 6)
      const float alpha = exp2f(m[g] - m_ref);              // the first tile: 2^-inf = 0
      m[g] = m_new;
      l[g] *= alpha;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[g][e] *= alpha;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const float pr = exp2f(sc[u][g] - m_ref);  // a key past the end: 2^-inf = 0
        l[g] += pr;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[g][e] = fmaf(pr, s.v[u].get(e), acc[g][e]);
      }
    }
  };

  // The warp's tiles: t = warp, warp + kWarps, ... (neighbouring warps read neighbouring keys). Every branch
  // below is the same for the whole warp.
  if constexpr (P == Pipeline::Registers) {
    // Two stages in registers, A and B: the loads of the next tile are issued before the current one is
    // computed. (Unrolled by two so that A and B stay in registers without copies.)
    Stage<U> A, B;
    int t = warp;
    if (t < n_tiles) fetch(A, t);
    for (; t < n_tiles; t += 2 * kWarps) {
      const int t1 = t + kWarps;
      if (t1 < n_tiles) fetch(B, t1);
      consume(A, t);
      if (t1 >= n_tiles) break;
      const int t2 = t1 + kWarps;
      if (t2 < n_tiles) fetch(A, t2);
      consume(B, t1);
    }
  } else {
    // The ring's first tiles were issued before the wait (above); the later ones now, the new key included.
    int stage = 0;
    for (int t = warp; t < n_tiles; t += kWarps) {
      // The stage this lane computed last iteration is free again (its reads were used before this point).
      const int ahead = t + (kRingStages - 1) * kWarps;
      if (ahead < n_tiles) issue((stage + kRingStages - 1) % kRingStages, ahead, key_end);
      cp_async_commit();
      cp_async_wait<kRingStages - 1>();  // this lane's copies of tile t have landed
      Stage<U> cur;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const uint4 kw = *slot(stage, u, 0), vw = *slot(stage, u, 1);
        cur.k[u].word[0] = kw.x, cur.k[u].word[1] = kw.y, cur.k[u].word[2] = kw.z, cur.k[u].word[3] = kw.w;
        cur.v[u].word[0] = vw.x, cur.v[u].word[1] = vw.y, cur.v[u].word[2] = vw.z, cur.v[u].word[3] = vw.w;
        if (holds_new && t == new_tile && u == new_round) {  // the early copy's zeros: the new key instead
          cur.k[u] = new_k;
          cur.v[u] = new_v;
        }
      }
      consume(cur, t);
      stage = (stage + 1) % kRingStages;
    }
    cp_async_wait<0>();  // nothing of this lane's left in flight (the groups past the end were empty)
    __syncthreads();     // every warp is done with its ring: the merge below reuses the memory
  }

  // The warp's sum and output: add the key groups' shares (after the butterfly every lane holds the total).
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int off = TPK; off < 32; off <<= 1) {
      l[g] += __shfl_xor_sync(0xffffffffu, l[g], off);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[g][e] += __shfl_xor_sync(0xffffffffu, acc[g][e], off);
    }
  }
  // The block's one barrier: the 4 warps' (m, l, o) meet in shared memory and are merged in a fixed order.
  float* sO = fast_smem;                    // [kWarps][G][D]
  float* sM = fast_smem + kWarps * G * D;   // [kWarps][G]
  float* sL = sM + kWarps * G;              // [kWarps][G]
  if (lane == 0) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      sM[warp * G + g] = m[g];
      sL[warp * G + g] = l[g];
    }
  }
  if (lane < TPK && active) {
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int e = 0; e < 8; ++e) sO[(warp * G + g) * D + col + e] = acc[g][e];
  }
  __syncthreads();
  const bool direct = gridDim.x == 1;  // one split: this block has the whole answer
  for (int i = threadIdx.x; i < heads * D; i += kThreads) {
    const int g = i / D, d = i % D, h = h0 + g;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, sM[w * G + g]);
    float o = 0.f, L = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float mw = sM[w * G + g];
      if (mw == -INFINITY) continue;  // a warp that had no keys adds nothing
      const float weight = exp2f(mw - M);
      o = fmaf(weight, sO[(w * G + g) * D + d], o);
      L = fmaf(weight, sL[w * G + g], L);
    }
    if (direct) {
      p.out[static_cast<int64_t>(q_row) * p.out_stride + h * D + d] =
          __float2bfloat16_rn(L > 0.f ? o / L * p.v_scale : 0.f);
    } else {
      // Lesson 10's partial layout; an empty split (no keys) writes m = -inf, which the combine skips.
      float* part = p.partials + ((static_cast<int64_t>(b) * p.n_heads + h) * kMaxSplits + blockIdx.x) * (D + 2);
      part[d] = o;
      if (d == 0) {
        part[D] = M;
        part[D + 1] = L;
      }
    }
  }
  if (!direct && p.arrivals) last_split_combine(p, b, q_row, h0, heads, fast_smem);
}

// The combine: one block of kCombineThreads per (sequence, head), grid (n_heads, B). It is pure latency (at
// batch 1 and 64 splits it reads 17 KB per head, from L2), so it is written to have every load in flight at once
// rather than one after another:
//   1. thread s < num_splits reads split s's max m_s and sum l_s (two loads, together); the block's max M
//      (shuffles, then the warps' maxima); w_s = 2^(m_s - M) into shared memory (0 for an empty split, m = -inf);
//      L = sum of w_s l_s (shuffles, then the warps' sums in warp order).
//   2. thread t takes dim d = t % D of the splits j, j + J, j + 2J, ... (j = t / D, J = kCombineThreads / D
//      groups), 8 splits' loads issued before their 8 FMAs; the J groups' sums are then added in group order.
// Every order is fixed by (D, num_splits): the same bits on every run and in a graph.
constexpr int kCombineThreads = 256;
static_assert(kMaxSplits <= kCombineThreads, "phase 1 gives every split a thread");
static __global__ void __launch_bounds__(kCombineThreads) fast_combine_kernel(const Params p, int num_splits) {
  constexpr int kCombineWarps = kCombineThreads / 32;
  __shared__ float weight[kMaxSplits];
  __shared__ float warp_max_of[kCombineWarps], warp_sum_of[kCombineWarps];
  __shared__ float group_sum[kCombineThreads];
  pdl_wait_for_previous_kernel();  // as the decode kernel: the partials come from it
  pdl_let_next_kernel_start();
  const int t = threadIdx.x, warp = t / 32, lane = t % 32;
  const int h = blockIdx.x, b = blockIdx.y;
  const int q_row = p.cu_q[b];
  if (p.cu_q[b + 1] - q_row != 1) return;  // the whole block leaves: no barrier is left waiting
  const int D = p.head_dim;
  const float* part = p.partials + (static_cast<int64_t>(b) * p.n_heads + h) * kMaxSplits * (D + 2);

  const float ms = t < num_splits ? part[t * (D + 2) + D] : -INFINITY;
  const float ls = t < num_splits ? part[t * (D + 2) + D + 1] : 0.f;
  float M = warp_max(ms);
  if (lane == 0) warp_max_of[warp] = M;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kCombineWarps; ++w) M = fmaxf(M, warp_max_of[w]);
  const float ws = ms == -INFINITY ? 0.f : exp2f(ms - M);
  if (t < kMaxSplits) weight[t] = ws;
  const float L_warp = warp_sum(ws * ls);
  if (lane == 0) warp_sum_of[warp] = L_warp;

  const int groups = kCombineThreads / D, j = t / D, d = t % D;  // D <= 256 (the ops check it): groups >= 1
  __syncthreads();  // weight[] and warp_sum_of[] written
  float o = 0.f;
  if (j < groups) {
    constexpr int kInFlight = 8;
    for (int s0 = j; s0 < num_splits; s0 += kInFlight * groups) {
      float v[kInFlight];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        const int s = s0 + u * groups;
        v[u] = s < num_splits ? part[s * (D + 2) + d] : 0.f;
      }
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        const int s = s0 + u * groups;
        if (s < num_splits) o = fmaf(weight[s], v[u], o);
      }
    }
  }
  group_sum[t] = o;
  __syncthreads();
  if (t < D) {
    float L = 0.f;
#pragma unroll
    for (int w = 0; w < kCombineWarps; ++w) L += warp_sum_of[w];
    float sum = 0.f;
    for (int g = 0; g < groups; ++g) sum += group_sum[g * D + t];
    const float inv = L > 0.f ? 1.f / L : 0.f;
    p.out[static_cast<int64_t>(q_row) * p.out_stride + h * D + t] = __float2bfloat16_rn(sum * inv * p.v_scale);
  }
}

template <int TPK, int G, class KV>
void launch_for(Pipeline pipeline, const Params& p, const KV& kv, int n_kv_heads, int batch_size, int num_splits,
                bool pdl, cudaStream_t stream) {
  const int head_tiles = (p.group + G - 1) / G;
  const dim3 grid(static_cast<unsigned>(num_splits), static_cast<unsigned>(n_kv_heads * head_tiles),
                  static_cast<unsigned>(batch_size));
  constexpr int U = rounds_per_stage<G>();
  // The ring copies 16 bytes per lane with cp.async: 8 bf16. A policy over FP8 rows (8 bytes per lane: lesson 16)
  // runs the register pipeline, whose load_streaming has an FP8 overload.
  constexpr bool kBf16Rows = std::is_same_v<std::remove_cv_t<std::remove_pointer_t<decltype(kv.k)>>, bf16>;
  if constexpr (!kBf16Rows) pipeline = Pipeline::Registers;
  const size_t smem = smem_bytes<G>(pipeline, p.head_dim);
  if (kBf16Rows && pipeline == Pipeline::Ring)
    launch_kernel_smem(fast_decode_kernel<TPK, G, U, Pipeline::Ring, KV>, grid, kThreads, smem, stream, pdl, p, kv);
  else
    launch_kernel_smem(fast_decode_kernel<TPK, G, U, Pipeline::Registers, KV>, grid, kThreads, smem, stream, pdl, p,
                       kv);
}

// Query heads per block: the group rounded up to a power of two, at most 8 (as lesson 10's kernel).
template <int TPK, class KV>
void launch_for_group(Pipeline pipeline, const Params& p, const KV& kv, int n_kv_heads, int batch_size,
                      int num_splits, bool pdl, cudaStream_t stream) {
  if (p.group >= 5) launch_for<TPK, 8>(pipeline, p, kv, n_kv_heads, batch_size, num_splits, pdl, stream);
  else if (p.group >= 3) launch_for<TPK, 4>(pipeline, p, kv, n_kv_heads, batch_size, num_splits, pdl, stream);
  else if (p.group == 2) launch_for<TPK, 2>(pipeline, p, kv, n_kv_heads, batch_size, num_splits, pdl, stream);
  else launch_for<TPK, 1>(pipeline, p, kv, n_kv_heads, batch_size, num_splits, pdl, stream);
}

// The decode kernel for p.head_dim (a multiple of 8 up to 256), then (num_splits > 1, and no p.arrivals: the
// combine is not in the decode kernel) the combine kernel, on `stream`.
// pdl: both launched as programmatic dependents of the kernel before each (pdl.cuh; only where pdl_supported()).
template <class KV>
void launch(Pipeline pipeline, const Params& p, const KV& kv, int n_kv_heads, int batch_size, int num_splits,
            bool pdl, cudaStream_t stream) {
  const int B = batch_size, S = num_splits;
  if (p.head_dim <= 32) launch_for_group<4>(pipeline, p, kv, n_kv_heads, B, S, pdl, stream);
  else if (p.head_dim <= 64) launch_for_group<8>(pipeline, p, kv, n_kv_heads, B, S, pdl, stream);
  else if (p.head_dim <= 128) launch_for_group<16>(pipeline, p, kv, n_kv_heads, B, S, pdl, stream);
  else launch_for_group<32>(pipeline, p, kv, n_kv_heads, B, S, pdl, stream);
  if (num_splits > 1 && !p.arrivals) {
    const dim3 grid(static_cast<unsigned>(p.n_heads), static_cast<unsigned>(batch_size));
    launch_kernel(fast_combine_kernel, grid, kCombineThreads, stream, pdl, p, num_splits);
  }
}

}  // namespace fast_decode
}  // namespace tvllm
