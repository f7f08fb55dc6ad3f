// Lesson 14: the megakernel itself (megakernel.h: the picture; megakernel.cu: the host side that launches it).
//
// Why it cannot deadlock (the brief's question, answered once here):
//   - Blocks are co-resident: a cooperative launch of one block per SM either starts all of them or fails.
//   - The producer thread waits for one thing only: a stage's `empty` barrier, which its own block's consumers
//     arrive on after consuming the chunk that stage held. It never waits for a grid barrier.
//   - The producer issues the block's chunks in exactly the order the consumers consume them (one list, walked
//     by both), so when the consumers want chunk n, every chunk before it was consumed and freed its stage: the
//     producer has issued chunk n or is about to (it waits at most for chunk n - S, already consumed).
//   - A grid barrier waits for every block's consumers to finish the phase. Each needs only its own block's
//     chunks of that phase, which (previous point) its producer issues without waiting for anything outside
//     the block. So every block reaches every barrier: no cycle.
//   - Per-warp stages: each warp consumes its own chunks in program order, and each stage belongs to one warp
//     (megakernel_plan.h, "The ring"). Let m be the block's earliest unconsumed chunk: its owner has consumed
//     all its earlier chunks (all < m), so it waits for m's bytes only. If the producer has issued m, they
//     arrive. If not, the producer is at some n <= m and waits for the previous fill of n's stage to be freed:
//     an earlier chunk of the same owner, < n <= m, so consumed: it issues on. Either way something moves.
//     Warps with no chunk left in a phase wait at the grid barrier's named barrier, which needs nothing from
//     the producer.
//   - The producer may finish early (all chunks issued) and exit its loop; it then waits only at the kernel's
//     end, where nothing waits for it. Consumers of a block with no chunks in a phase go straight to the barrier.
#pragma once

#include "megakernel.cuh"
#include "megakernel_gemv.cuh"  // Params, the producer, the GEMV phases
#include "megakernel_plan.h"

namespace tvllm {
namespace mk {

// ---- the consumers: attention --------------------------------------------------------------------------------
// The context (position + 1 keys) is cut into `splits` ranges per kv head; item (g, sp) attends kv head g's
// group of query heads over range sp and writes each head's unnormalised partial (o, m, l). Same split for the
// combine in the o phase (split_count below is the one formula both use).
__device__ __forceinline__ void split_count(int ctx, int max_splits, int& splits, int& chunk) {
  int want = (ctx + kMinKeysPerSplit - 1) / kMinKeysPerSplit;
  want = max(1, min(want, max_splits));
  chunk = (ctx + want - 1) / want;
  splits = (ctx + chunk - 1) / chunk;
}

// RoPE of one pair, lesson 05's expression with each operation rounded on its own (no FMA), then bf16.
__device__ __forceinline__ void rope_pair(float a, float b, float c, float s, float& ao, float& bo) {
  ao = round_bf16(__fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s)));
  bo = round_bf16(__fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s)));
}

// E consecutive bf16 of a value row (4 or 8 bytes, aligned: a lane's E dims) as floats.
template <int E>
__device__ __forceinline__ void load_values(const bf16* src, float* out) {
  if constexpr (E == 2) {
    const uint32_t w = __ldg(reinterpret_cast<const unsigned int*>(src));
    out[0] = __uint_as_float(w << 16), out[1] = __uint_as_float(w & 0xffff0000u);
  } else {
    const uint2 w = __ldg(reinterpret_cast<const uint2*>(src));
    out[0] = __uint_as_float(w.x << 16), out[1] = __uint_as_float(w.x & 0xffff0000u);
    out[2] = __uint_as_float(w.y << 16), out[3] = __uint_as_float(w.y & 0xffff0000u);
  }
}

template <int D, int W>
__device__ void attention_item(const Params& p, int layer, int g, int j0, int j1, int sp, int pos, float* att) {
  constexpr int E = D / 32;  // value dims per lane
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int G = p.n_heads / p.n_kv, half = D / 2;
  float* qs = att;                   // [G][D] roped q, bf16 values
  float* kn = qs + kMaxGroup * D;    // [D] the new key, roped
  float* vn = kn + D;                // [D] the new value
  float* wpart = vn + D;             // [warps][G][D + 2]
  const int rpos = min(max(pos, 0), p.rope_positions - 1);
  const float* cosr = p.rope_cos + static_cast<int64_t>(rpos) * half;
  const float* sinr = p.rope_sin + static_cast<int64_t>(rpos) * half;
  // The group's G query heads and the new key (head G here) into shared memory, then (Qwen3) each head's RMS
  // norm, then RoPE: lesson 08's order and roundings (head_rmsnorm, apply_rope), each step in place.
  const auto head = [&](int hh) { return hh < G ? qs + hh * D : kn; };
  // This thread's RoPE table entries (pairs i = t, t + W * 32, ...), loaded first: their round trip overlaps
  // the q/k/v loads' instead of following the barriers (a short context's attention is a chain of latencies).
  // Per-warp stages only: the shared-stages kernel (8 warps: 3 entries each) is at its register cap with them
  // and keeps the first version's loads, after the barrier.
  constexpr bool kEarlyRope = W > kConsumerWarps;
  constexpr int kRopePer = (kMaxGroup + 1) * (D / 2) / (W * 32) + 1;
  float rc[kRopePer], rs[kRopePer];
#pragma unroll
  for (int k = 0; k < kRopePer; ++k) {
    const int i = t + k * W * 32;
    const bool load = kEarlyRope && i < (G + 1) * half;
    rc[k] = load ? __ldg(cosr + i % half) : 0.f;
    rs[k] = load ? __ldg(sinr + i % half) : 0.f;
  }
  for (int i = t; i < (G + 1) * D; i += W * 32) {
    const int hh = i / D, d = i % D;
    const bf16* src = hh < G ? p.qkv + static_cast<int64_t>(g * G + hh) * D : p.qkv + p.q_dim + g * D;
    head(hh)[d] = __bfloat162float(__ldcg(src + d));
  }
  for (int d = t; d < D; d += W * 32) vn[d] = __bfloat162float(__ldcg(p.qkv + p.q_dim + p.kv_dim + g * D + d));
  consumers_sync<W>();
  const LayerNorms& nl = p.norms[layer];
  if (nl.q_norm) {
    for (int hh = warp; hh < G + 1; hh += W) {  // a warp per head
      float* x = head(hh);
      const bf16* w = hh < G ? nl.q_norm : nl.k_norm;
      float ss = 0.f;
      for (int d = lane; d < D; d += 32) ss += x[d] * x[d];
      const float inv = rsqrtf(warp_sum(ss) / static_cast<float>(D) + p.eps);
      for (int d = lane; d < D; d += 32) x[d] = round_bf16(round_bf16(x[d] * inv) * __bfloat162float(w[d]));
    }
    consumers_sync<W>();
  }
#pragma unroll
  for (int k = 0; k < kRopePer; ++k) {
    const int i = t + k * W * 32;
    if (i >= (G + 1) * half) continue;
    const int hh = i / half, j = i % half;
    float* x = head(hh);
    float a, b;
    rope_pair(x[j], x[j + half], kEarlyRope ? rc[k] : cosr[j], kEarlyRope ? rs[k] : sinr[j], a, b);
    x[j] = a;
    x[j + half] = b;
  }
  consumers_sync<W>();
  const bool paged = p.block_table != nullptr;
  const int64_t row0 = paged ? 0 : static_cast<int64_t>(__ldg(p.slot)) * p.max_context;
  const auto row_of = [&](int j) -> int64_t {
    return paged ? static_cast<int64_t>(__ldg(p.block_table + j / p.block_size)) * p.block_size + j % p.block_size
                 : row0 + j;
  };
  bf16* kl = p.cache_k + layer * p.layer_stride;
  bf16* vl = kl + p.v_offset;
  // The new token's k and v into the cache, for the steps after this one (this step reads them from kn, vn).
  const int64_t new_row = paged ? static_cast<int64_t>(__ldg(p.new_row)) : row0 + pos;
  if (pos >= j0 && pos < j1 && new_row >= 0)
    for (int d = t; d < D; d += W * 32) {
      kl[new_row * p.kv_dim + g * D + d] = __float2bfloat16_rn(kn[d]);
      vl[new_row * p.kv_dim + g * D + d] = __float2bfloat16_rn(vn[d]);
    }

  float m[kMaxGroup], l[kMaxGroup], o[kMaxGroup][E];
#pragma unroll
  for (int i = 0; i < kMaxGroup; ++i) {
    m[i] = -INFINITY;
    l[i] = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) o[i][e] = 0.f;
  }
  for (int base = j0 + warp * 32; base < j1; base += W * 32) {
    const int j = base + lane;
    float sc[kMaxGroup];
#pragma unroll
    for (int i = 0; i < kMaxGroup; ++i) sc[i] = 0.f;
    // The lane's key: its D/8 packs loaded 8 at a time before any is used (bytes in flight, not one round trip
    // per pack); the new token's key comes from shared memory.
    const auto add_pack = [&](int q, const float* kf) {
#pragma unroll
      for (int i = 0; i < kMaxGroup; ++i)
        if (i < G)
#pragma unroll
          for (int e = 0; e < 8; ++e) sc[i] = fmaf(qs[i * D + q * 8 + e], kf[e], sc[i]);
    };
    if (j < j1 && j == pos) {
#pragma unroll
      for (int q = 0; q < D / 8; ++q) add_pack(q, kn + q * 8);
    } else if (j < j1) {
      const uint4* krow = reinterpret_cast<const uint4*>(kl + row_of(j) * p.kv_dim + g * D);
#pragma unroll
      for (int q0 = 0; q0 < D / 8; q0 += 8) {
        uint4 kp[8];
#pragma unroll
        for (int b = 0; b < 8; ++b) kp[b] = __ldg(krow + q0 + b);
#pragma unroll
        for (int b = 0; b < 8; ++b) {
          float kf[8];
          unpack8(kp[b], kf);
          add_pack(q0 + b, kf);
        }
      }
    }
    float pr[kMaxGroup];
#pragma unroll
    for (int i = 0; i < kMaxGroup; ++i) {
      if (i >= G) continue;  // not break: a fully unrolled loop keeps the arrays in registers
      const float s = j < j1 ? sc[i] * p.scale_log2 : -INFINITY;
      const float mnew = fmaxf(m[i], warp_max(s));  // lane 0's key is always valid: finite
      const float alpha = exp2f(m[i] - mnew);
      pr[i] = exp2f(s - mnew);
      l[i] = l[i] * alpha + warp_sum(pr[i]);
#pragma unroll
      for (int e = 0; e < E; ++e) o[i][e] *= alpha;
      m[i] = mnew;
    }
    // Values: lane-per-dimension (E dims each), the round's keys U at a time with all U rows' loads issued
    // before the first is used; each key's weight p comes from its lane by a shuffle.
    constexpr int U = E == 2 ? 16 : 8;
    const int keys = min(32, j1 - base);
    for (int u0 = 0; u0 < keys; u0 += U) {
      float vf[U][E];
#pragma unroll
      for (int b = 0; b < U; ++b) {
        const int ju = base + u0 + b;
        if (u0 + b < keys && ju != pos) {
          load_values<E>(vl + row_of(ju) * p.kv_dim + g * D + lane * E, vf[b]);
        } else {
#pragma unroll
          for (int e = 0; e < E; ++e) vf[b][e] = u0 + b < keys ? vn[lane * E + e] : 0.f;
        }
      }
#pragma unroll
      for (int b = 0; b < U; ++b) {
        if (u0 + b >= keys) continue;  // uniform across the warp: every lane shuffles or none
#pragma unroll
        for (int i = 0; i < kMaxGroup; ++i) {
          if (i >= G) continue;
          const float pu = __shfl_sync(0xffffffffu, pr[i], u0 + b);
#pragma unroll
          for (int e = 0; e < E; ++e) o[i][e] = fmaf(pu, vf[b][e], o[i][e]);
        }
      }
    }
  }
  // The warps' states into shared memory, then combined (fixed warp order) into the item's partials.
#pragma unroll
  for (int i = 0; i < kMaxGroup; ++i) {
    if (i >= G) continue;
    float* wp = wpart + (warp * kMaxGroup + i) * (D + 2);
#pragma unroll
    for (int e = 0; e < E; ++e) wp[lane * E + e] = o[i][e];
    if (lane == 0) {
      wp[D] = m[i];
      wp[D + 1] = l[i];
    }
  }
  consumers_sync<W>();
  for (int idx = t; idx < G * (D + 2); idx += W * 32) {
    const int i = idx / (D + 2), d = idx % (D + 2);
    float M = -INFINITY;
    for (int w = 0; w < W; ++w) M = fmaxf(M, wpart[(w * kMaxGroup + i) * (D + 2) + D]);
    float acc = 0.f;
    for (int w = 0; w < W; ++w) {
      const float* wp = wpart + (w * kMaxGroup + i) * (D + 2);
      if (wp[D] == -INFINITY) continue;  // a warp that had no keys
      const float f = exp2f(wp[D] - M);
      acc += d == D ? 0.f : (d == D + 1 ? f * wp[D + 1] : f * wp[d]);
    }
    float* out = p.partials + (static_cast<int64_t>(g * G + i) * p.max_splits + sp) * (D + 2);
    out[d] = d == D ? M : acc;
  }
  consumers_sync<W>();  // shared memory free for the next item
}

// The o phase's prologue: every block combines the partials of every head into xs (the attention output,
// bf16(o / l) as the decode kernels round it).
template <int D, int W>
__device__ void combine_into_xs(const Params& p, int splits, bf16* xs) {
  // kPer of this thread's elements at a time, split by split: each split's loads of all kPer elements are
  // independent, so they are in flight together — a round trip per split, not two per element (the loop
  // element by element was a chain of ~12 L2 round trips at q_dim 2048). Per element the arithmetic is
  // unchanged: M = the max over the splits, then L and acc summed split by split in order.
  constexpr int kPer = 4;
  for (int base = threadIdx.x; base < p.q_dim; base += W * 32 * kPer) {
    const float* part[kPer];
    int d[kPer];
    bool live[kPer];
    float M[kPer], L[kPer], acc[kPer];
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int idx = base + k * W * 32;
      live[k] = idx < p.q_dim;
      const int hh = live[k] ? idx / D : 0;
      d[k] = live[k] ? idx % D : 0;
      part[k] = p.partials + static_cast<int64_t>(hh) * p.max_splits * (D + 2);
      M[k] = -INFINITY, L[k] = 0.f, acc[k] = 0.f;
    }
    for (int s = 0; s < splits; ++s)
#pragma unroll
      for (int k = 0; k < kPer; ++k) M[k] = fmaxf(M[k], __ldcg(part[k] + s * (D + 2) + D));
    for (int s = 0; s < splits; ++s)
#pragma unroll
      for (int k = 0; k < kPer; ++k) {
        const float* ps = part[k] + s * (D + 2);
        const float f = exp2f(__ldcg(ps + D) - M[k]);
        L[k] += f * __ldcg(ps + D + 1);
        acc[k] += f * __ldcg(ps + d[k]);
      }
#pragma unroll
    for (int k = 0; k < kPer; ++k)
      if (live[k]) xs[base + k * W * 32] = __float2bfloat16_rn(acc[k] / L[k]);
  }
  consumers_sync<W>();
}

// ---- the kernel ----------------------------------------------------------------------------------------------
// W consumer warps + the producer warp. kPerWarp: per-warp stages (gemv_phase_warp), else shared stages
// (gemv_phase, W == kConsumerWarps).
template <int D, int W, bool kPerWarp>
__global__ void __launch_bounds__(threads_of<W>, 1) megakernel(const Params p) {
  static_assert(kPerWarp || W == kConsumerWarps, "shared stages: the first version's 8 consumer warps");
  extern __shared__ __align__(128) char smem[];
  Ring ring;
  ring.stages = smem;
  ring.S = p.stages;
  ring.stage_bytes = p.stage_bytes;
  ring.full = reinterpret_cast<uint64_t*>(smem + p.bar_offset);
  ring.empty = ring.full + p.stages;
  bf16* xs = reinterpret_cast<bf16*>(smem + p.xs_offset);
  float* red = reinterpret_cast<float*>(smem + p.red_offset);  // [W * 32] + 2 (slice_acc)
  float* slice_acc = red + W * 32;
  float* att = reinterpret_cast<float*>(smem + p.att_offset);
  if (threadIdx.x == 0) {
    for (int s = 0; s < p.stages; ++s) {
      mbar_init(&ring.full[s], 1);
      mbar_init(&ring.empty[s], 1);  // one arrival frees a stage: thread 0 (shared) or the owner's lane 0
    }
    mbar_fence_init();
  }
  __syncthreads();  // the only block-wide barrier: the barriers exist before anyone uses them

  if (threadIdx.x >= W * 32) {
    if constexpr (kPerWarp) {
      produce_warp(p, ring);
    } else {
      if (threadIdx.x == W * 32) produce(p, ring);
    }
    return;  // the producer warp has nothing else to do; its issued copies complete on the mbarriers
  }

  unsigned expected = 0;          // shared stages: the generation barrier (grid_barrier)
  unsigned long long target = 0;  // per-warp stages: the counter barrier (grid_barrier_counter)
  auto* counter = reinterpret_cast<unsigned long long*>(p.bar);
  if (threadIdx.x == 0) {
    if constexpr (kPerWarp) {
      asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(target) : "l"(counter) : "memory");
      target -= target % gridDim.x;
    } else {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(expected) : "l"(&p.bar[1]) : "memory");
    }
  }
  const auto grid_sync = [&] {
    if constexpr (kPerWarp) {
      grid_barrier_counter<W>(counter, target, p.error);
    } else {
      grid_barrier<W>(p.bar, expected, p.error);
    }
  };
  const int pos = __ldg(p.position);
  const int ctx = pos + 1;
  int splits, chunk;
  split_count(ctx, p.max_splits, splits, chunk);
  const bf16* embed_row = p.embed + static_cast<int64_t>(__ldg(p.token)) * p.hidden;
  uint32_t n = 0;  // shared stages: the consumers' position in the ring (the producer's twin)
  // Per-warp stages: a phase's op and chunk range are loaded before its prologue (warp_phase).
  const auto prefetch = [&](int phase) {
    WarpPhase ph{};
    if constexpr (kPerWarp) ph = warp_phase<W>(p, phase);
    return ph;
  };
  const auto gemv = [&](int phase, const WarpPhase& ph, const bf16* residual_base) {
    if constexpr (kPerWarp) {
      gemv_phase_warp<W>(p, ring, ph, xs, residual_base);
    } else {
      gemv_phase(p, ring, phase, n, xs, red, slice_acc, residual_base);
    }
  };

  for (int layer = 0; layer < p.layers; ++layer) {
    // Layer 0 reads the embedding row directly: its o phase writes h = embedding + o, no embedding pass.
    const bf16* resid = layer == 0 ? embed_row : p.h;
    WarpPhase ph = prefetch(4 * layer + 0);
    norm_into_xs<W>(resid, p.norms[layer].input_norm, p.hidden, p.eps, xs, red);
    gemv(4 * layer + 0, ph, nullptr);
    grid_sync();  // qkv complete

    for (int item = blockIdx.x; item < p.n_kv * splits; item += gridDim.x) {
      const int g = item / splits, sp = item % splits;
      attention_item<D, W>(p, layer, g, sp * chunk, min(ctx, (sp + 1) * chunk), sp, pos, att);
    }
    grid_sync();  // every partial written

    ph = prefetch(4 * layer + 1);
    combine_into_xs<D, W>(p, splits, xs);
    gemv(4 * layer + 1, ph, resid);
    grid_sync();  // h += o complete

    ph = prefetch(4 * layer + 2);
    norm_into_xs<W>(p.h, p.norms[layer].post_norm, p.hidden, p.eps, xs, red);
    gemv(4 * layer + 2, ph, nullptr);
    grid_sync();  // act complete

    ph = prefetch(4 * layer + 3);
    copy_into_xs<W>(p.act, p.inter, xs);
    gemv(4 * layer + 3, ph, p.h);
    grid_sync();  // h += down complete
  }
  const WarpPhase last = prefetch(4 * p.layers);
  norm_into_xs<W>(p.h, p.final_norm, p.hidden, p.eps, xs, red);
  gemv(4 * p.layers, last, nullptr);
}

}  // namespace mk
}  // namespace tvllm
