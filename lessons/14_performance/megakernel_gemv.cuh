// Lesson 14: the megakernel's weight phases (megakernel.h: the picture; megakernel_kernel.cuh: the kernel).
//
//   Params, OpDesc, MkCopy   what the kernel is told: the program, the op table, the buffers, the layout
//   produce, produce_warp    the producer: bulk copies of the block's chunks into the ring, in program order
//   norm_into_xs, ...        the phases' prologues: the activation vector into shared memory
//   gemv_phase               the consumers, shared stages (the first version): all warps on every stage
//   gemv_phase_warp          the consumers, per-warp stages: each stage computed and freed by its owner warp
#pragma once

#include "megakernel.cuh"
#include "megakernel_plan.h"

namespace tvllm {
namespace mk {

// One weight phase of the step, in the order of the plan's matrices: 4 per layer, then the lm_head.
enum class Op : uint32_t { Qkv = 0, O = 1, GateUp = 2, Down = 3, LmHead = 4 };

struct OpDesc {
  const void* w;       // [rows, K]: for GateUp [2 * outputs, K] (gate rows, then up rows). BF16 or E4M3 codes
  const float* scale;  // E4M3: F32 [rows], one per weight row (lesson 16); nullptr for BF16
  const bf16* bias;    // Qkv of Qwen2: bq | bk | bv, added to the bf16 product (lesson 08's add_bias); else nullptr
  uint32_t K;
  uint32_t outputs;
  uint32_t kind;        // Op
  uint32_t elem_bytes;  // 2 (BF16) or 1 (E4M3)
};

struct LayerNorms {
  const bf16* input_norm;
  const bf16* post_norm;
  const bf16* q_norm;  // Qwen3: [head_dim] each, or nullptr
  const bf16* k_norm;
};

// Per-warp stages: one bulk copy job per chunk, its source addresses resolved on the host (megakernel.cu), so
// the producer needs no op-table look-up at a phase change. 32 bytes: one per lane, two 16-byte loads.
struct MkCopy {
  const char* src0;  // the chunk's (gate) rows
  const char* src1;  // gate|up: the up rows (copied after the gate rows' bytes); nullptr otherwise
  uint32_t bytes;    // per source
  uint32_t slot;     // the chunk's stage and fill of it (MkChunk::slot, round: megakernel_plan.h, "The ring")
  uint32_t round;
  uint32_t pad;
};

struct Params {
  const MkChunk* chunks;
  const uint32_t* begins;  // [blocks * (phases + 1)]
  const MkChunk* warp_chunks;    // per-warp stages: each warp's own chunks (megakernel_plan.h), else nullptr
  const uint32_t* warp_begins;   // [blocks * warps * (phases + 1)]
  const MkCopy* copies;          // per-warp stages: parallel to chunks
  const OpDesc* ops;       // [phases]
  const LayerNorms* norms; // [layers]
  int phases, layers;
  int hidden, q_dim, kv_dim, inter, n_heads, n_kv, head_dim;
  const bf16* embed;
  const bf16* final_norm;
  bf16* h;          // [hidden] the residual stream (written from layer 0's o phase on)
  bf16* qkv;        // [q_dim + 2 kv_dim]
  bf16* act;        // [inter]
  float* logits;    // [vocab]
  float* partials;  // [n_heads][max_splits][head_dim + 2]: o, m, l of each attention item
  int max_splits;
  const int32_t* token;     // [1] device: the step's token
  const int32_t* position;  // [1] device: its position (the context is position + 1 keys)
  // Where position j's k and v rows are (row r: r * kv_dim elements into a layer's k or v):
  //   contiguous (lesson 10)  r = slot * max_context + j
  //   paged (lesson 12)       r = block_table[j / block_size] * block_size + j % block_size; the new token's row
  //                           is new_row[0] (the step's slot mapping; < 0: a padding row, written nowhere)
  const int32_t* slot;         // [1] device: the sequence's cache slot (contiguous)
  const int32_t* block_table;  // device: sequence 0's block table (paged), nullptr for the contiguous cache
  const int32_t* new_row;      // [1] device: the new token's row (paged)
  int block_size;
  bf16* cache_k;            // layer 0's k [rows, kv_dim]; v at + v_offset; layer l at + l * layer_stride
  int64_t layer_stride, v_offset;
  int max_context;
  const float* rope_cos;    // [rope_positions, head_dim / 2]
  const float* rope_sin;
  int rope_positions;
  float eps;
  float scale_log2;         // 1/sqrt(head_dim) * log2(e): scores in base 2
  unsigned* bar;            // [2] the grid barrier
  int* error;               // the watchdog's flag
  int stages;
  uint32_t stage_bytes;
  uint32_t xs_offset, red_offset, att_offset, bar_offset;  // shared memory layout (bytes)
};

// The ring. Shared stages: chunk n of the block sits in stage n % S and is the (n / S)-th fill of that stage,
// whose full phase has parity (n / S) & 1 — the producer and the consumers count n alike (the plan's slot and
// round are the same numbers). Per-warp stages: each chunk carries its (slot, round) from the plan, every stage
// owned by one warp (megakernel_plan.h, "The ring": a stage shared by several warps let a warp wait on a parity
// that an older fill still showed).
struct Ring {
  char* stages;
  uint64_t* full;
  uint64_t* empty;
  int S;
  uint32_t stage_bytes;
};

// ---- the producer ------------------------------------------------------------------------------------------
__device__ void produce(const Params& p, const Ring& ring) {
  const uint32_t first = p.begins[blockIdx.x * (p.phases + 1)];
  const uint32_t last = p.begins[blockIdx.x * (p.phases + 1) + p.phases];
  // A descriptor is an L2 round trip (~0.5 us): the next one is loaded while this one's stage is awaited and
  // issued, and the op (the matrix) is reloaded only when the phase changes.
  MkChunk c = first < last ? p.chunks[first] : MkChunk{};
  OpDesc op = p.ops[c.phase];
  for (uint32_t ci = first; ci < last; ++ci) {
    const MkChunk next = ci + 1 < last ? p.chunks[ci + 1] : c;
    const uint32_t n = ci - first;
    const int s = static_cast<int>(n % ring.S);
    const uint32_t use = n / ring.S;
    mbar_wait(&ring.empty[s], (use & 1u) ^ 1u, p.error, kErrRingFull);
    const uint32_t half_bytes = c.rows * c.kc * op.elem_bytes;
    const bool paired = op.kind == static_cast<uint32_t>(Op::GateUp);
    const char* w = static_cast<const char*>(op.w);
    char* dst = ring.stages + static_cast<size_t>(s) * ring.stage_bytes;
    mbar_arrive_expect_tx(&ring.full[s], paired ? 2u * half_bytes : half_bytes);
    bulk_copy(dst, w + (static_cast<int64_t>(c.row0) * op.K + c.k0) * op.elem_bytes, half_bytes, &ring.full[s]);
    if (paired)
      bulk_copy(dst + half_bytes, w + ((static_cast<int64_t>(c.row0) + op.outputs) * op.K + c.k0) * op.elem_bytes,
                half_bytes, &ring.full[s]);
    if (next.phase != c.phase) op = p.ops[next.phase];
    c = next;
  }
}

// Per-warp stages: the whole producer warp. Its 32 lanes load 32 copy jobs at once (the next 32 in flight while
// these are issued), and lane 0 issues them one by one, each job's fields broadcast by shuffles. The first
// version's single thread loads one descriptor ahead, then the op table at each phase change: a chain of L2
// round trips (~0.7 us each) that caps it near one chunk per round trip, 23 KB per us with 16 KiB stages: less
// than an SM's share of DRAM (32 KB per us).
__device__ __forceinline__ MkCopy load_copy(const MkCopy* copies, uint32_t i, uint32_t last) {
  MkCopy c{};
  if (i < last) {
    const uint4* src = reinterpret_cast<const uint4*>(copies + i);
    const uint4 a = __ldg(src), b = __ldg(src + 1);
    c.src0 = reinterpret_cast<const char*>((static_cast<uint64_t>(a.y) << 32) | a.x);
    c.src1 = reinterpret_cast<const char*>((static_cast<uint64_t>(a.w) << 32) | a.z);
    c.bytes = b.x;
    c.slot = b.y;
    c.round = b.z;
  }
  return c;
}

__device__ void produce_warp(const Params& p, const Ring& ring) {
  const int lane = threadIdx.x & 31;
  const uint32_t first = p.begins[blockIdx.x * (p.phases + 1)];
  const uint32_t last = p.begins[blockIdx.x * (p.phases + 1) + p.phases];
  MkCopy cur = load_copy(p.copies, first + lane, last);
  for (uint32_t base = first; base < last; base += 32) {
    const MkCopy nxt = load_copy(p.copies, base + 32 + lane, last);  // in flight while this batch is issued
    const int count = static_cast<int>(min(32u, last - base));
    for (int j = 0; j < count; ++j) {
      const char* src0 = reinterpret_cast<const char*>(
          __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(cur.src0), j));
      const char* src1 = reinterpret_cast<const char*>(
          __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(cur.src1), j));
      const uint32_t bytes = __shfl_sync(0xffffffffu, cur.bytes, j);
      const uint32_t slot = __shfl_sync(0xffffffffu, cur.slot, j);
      const uint32_t fill = __shfl_sync(0xffffffffu, cur.round, j);  // this stage's fill number (its round)
      if (lane == 0) {
        const int s = static_cast<int>(slot);
        mbar_wait(&ring.empty[s], (fill & 1u) ^ 1u, p.error, kErrRingFull);  // fill - 1 of the stage was read
        char* dst = ring.stages + static_cast<size_t>(s) * ring.stage_bytes;
        mbar_arrive_expect_tx(&ring.full[s], src1 ? 2u * bytes : bytes);
        bulk_copy(dst, src0, bytes, &ring.full[s]);
        if (src1) bulk_copy(dst + bytes, src1, bytes, &ring.full[s]);
      }
      __syncwarp();
    }
    cur = nxt;
  }
}

// ---- the consumers: activations into shared memory ---------------------------------------------------------
// xs = bf16(bf16(src * inv_rms) * g), inv_rms = rsqrt(mean(src^2) + eps): lesson 04's rounding, as rmsnorm_gemv.
template <int W>
__device__ void norm_into_xs(const bf16* src, const bf16* g, int K, float eps, bf16* xs, float* red) {
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const uint4* s4 = reinterpret_cast<const uint4*>(src);
  const uint4* g4 = reinterpret_cast<const uint4*>(g);
  // The thread's first kKeep packs of src (and of g) stay in registers between the two passes: one L2 round
  // trip per norm, not two, where hidden <= kKeep * W * 256 elements (2,048 with 8 warps, 2,816 with 11: the
  // 1B's hidden); a wider row reloads the rest. Same sums, in the same order. (kKeep = 2 spills at head_dim
  // 128: the kernel is at its register cap.)
  constexpr int kKeep = 1;
  uint4 sv[kKeep], gv[kKeep];
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < kKeep; ++k) {
    const int q = t + k * W * 32;
    if (q < K / 8) {
      sv[k] = __ldcg(s4 + q);
      gv[k] = __ldg(g4 + q);
    }
  }
#pragma unroll
  for (int k = 0; k < kKeep; ++k) {
    if (t + k * W * 32 >= K / 8) continue;
    float f[8];
    unpack8(sv[k], f);
#pragma unroll
    for (int i = 0; i < 8; ++i) ss = fmaf(f[i], f[i], ss);
  }
  for (int q = t + kKeep * W * 32; q < K / 8; q += W * 32) {
    float f[8];
    unpack8(__ldcg(s4 + q), f);
#pragma unroll
    for (int i = 0; i < 8; ++i) ss = fmaf(f[i], f[i], ss);
  }
  ss = warp_sum(ss);
  if (lane == 0) red[warp] = ss;
  consumers_sync<W>();
  float total = 0.f;
  for (int w = 0; w < W; ++w) total += red[w];
  const float inv = rsqrtf(total / static_cast<float>(K) + eps);
  for (int q = t, k = 0; q < K / 8; q += W * 32, ++k) {
    float f[8], gw[8];
    const int kk = k < kKeep ? k : 0;  // an index in range whichever branch is taken
    unpack8(k < kKeep ? sv[kk] : __ldcg(s4 + q), f);
    unpack8(k < kKeep ? gv[kk] : __ldg(g4 + q), gw);
#pragma unroll
    for (int i = 0; i < 8; ++i) xs[q * 8 + i] = __float2bfloat16_rn(round_bf16(f[i] * inv) * gw[i]);
  }
  consumers_sync<W>();  // xs complete; red free again
}

template <int W>
__device__ void copy_into_xs(const bf16* src, int K, bf16* xs) {
  const uint4* s4 = reinterpret_cast<const uint4*>(src);
  for (int q = threadIdx.x; q < K / 8; q += W * 32) reinterpret_cast<uint4*>(xs)[q] = __ldcg(s4 + q);
  consumers_sync<W>();
}

// ---- the consumers, shared stages (the first version): one weight phase from the ring ----------------------
// Each chunk's stage rows are shared among the 8 warps: a warp per row, or, with fewer rows than warps, several
// warps per row splitting its columns; partial sums meet in `red` in a fixed order (deterministic: the order is
// the plan's, a function of the shapes only). Then one thread per output runs the epilogue.
__device__ void gemv_phase(const Params& p, const Ring& ring, int phase, uint32_t& n, const bf16* xs, float* red,
                           float* slice_acc, const bf16* residual_base) {
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const uint32_t begin = p.begins[blockIdx.x * (p.phases + 1) + phase];
  const uint32_t end = p.begins[blockIdx.x * (p.phases + 1) + phase + 1];
  const OpDesc op = p.ops[phase];
  const Op kind = static_cast<Op>(op.kind);
  const int halves = kind == Op::GateUp ? 2 : 1;
  MkChunk c = begin < end ? p.chunks[begin] : MkChunk{};
  for (uint32_t ci = begin; ci < end; ++ci, ++n) {
    const MkChunk next = ci + 1 < end ? p.chunks[ci + 1] : c;  // loaded while this chunk is computed
    const int s = static_cast<int>(n % ring.S);
    mbar_wait(&ring.full[s], (n / ring.S) & 1u, p.error, kErrRingEmpty);
    const char* stage = ring.stages + static_cast<size_t>(s) * ring.stage_bytes;
    const int srows = static_cast<int>(c.rows) * halves;
    const int kc = static_cast<int>(c.kc);
    const int per_row = srows >= kConsumerWarps ? 1 : kConsumerWarps / srows;
    const int groups = kConsumerWarps / per_row;
    const uint4* x4 = reinterpret_cast<const uint4*>(xs + c.k0);
    for (int r = warp / per_row; r < srows && warp < groups * per_row; r += groups) {
      const int sub = warp % per_row;
      const uint4* w4 = reinterpret_cast<const uint4*>(stage + static_cast<size_t>(r) * kc * op.elem_bytes);
      float acc = 0.f;
      if (op.elem_bytes == 2) {
        for (int q = sub * 32 + lane; q < kc / 8; q += per_row * 32) acc = dot8(w4[q], x4[q], acc);
      } else {  // E4M3: 16 codes per pack against two packs of x; the row's scale comes in the epilogue
        for (int q = sub * 32 + lane; q < kc / 16; q += per_row * 32) acc = dot16_e4m3(w4[q], x4[2 * q], x4[2 * q + 1], acc);
      }
      acc = warp_sum(acc);
      if (lane == 0) red[r * per_row + sub] = acc;
    }
    consumers_sync<kConsumerWarps>();                        // every warp is done with the stage and has written red
    if (t == 0) mbar_arrive(&ring.empty[s]);  // the stage is free: the producer may refill it
    if (t < static_cast<int>(c.rows)) {
      float total[2] = {0.f, 0.f};
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        if (hh >= halves) break;
        const int r = hh * static_cast<int>(c.rows) + t;
        for (int sub = 0; sub < per_row; ++sub) total[hh] += red[r * per_row + sub];
      }
      // A row cut into column slices: sum the slices in order (rows == 1, so thread 0 alone).
      if (!(c.flags & kMkFirstSlice)) {
        total[0] += slice_acc[0];
        total[1] += slice_acc[1];
      }
      if (!(c.flags & kMkLastSlice)) {
        slice_acc[0] = total[0];
        slice_acc[1] = total[1];
      } else {
        const int64_t o = static_cast<int64_t>(c.row0) + t;
        // E4M3: each row's scale multiplies its finished sum once, in fp32, before the roundings (gemv.h).
        if (op.scale) {
          total[0] *= __ldg(op.scale + o);
          if (halves == 2) total[1] *= __ldg(op.scale + op.outputs + o);
        }
        // The epilogues: gemv.h's "Rounding", element by element.
        switch (kind) {
          case Op::Qkv:
            // Qwen2: the bias on the bf16 product, rounded again (add_bias after the projection).
            p.qkv[o] = op.bias ? __float2bfloat16_rn(round_bf16(total[0]) + __bfloat162float(op.bias[o]))
                               : __float2bfloat16_rn(total[0]);
            break;
          case Op::O:
          case Op::Down:
            p.h[o] = __float2bfloat16_rn(__bfloat162float(__ldcg(residual_base + o)) + round_bf16(total[0]));
            break;
          case Op::GateUp: {
            const float gate = round_bf16(total[0]), up = round_bf16(total[1]);
            const float a = round_bf16(gate / (1.0f + expf(-gate)));
            p.act[o] = __float2bfloat16_rn(a * up);
            break;
          }
          case Op::LmHead:
            p.logits[o] = total[0];
            break;
        }
      }
    }
    consumers_sync<kConsumerWarps>();  // red and slice_acc free for the next chunk
    c = next;
  }
}

// ---- the consumers, per-warp stages: one weight phase from the ring ----------------------------------------
// Each warp walks its own chunks (the plan deals them out: task % W) and does everything for a chunk alone:
// waits for its stage, computes every row of it (lanes over 16-byte packs, a warp-shuffle sum per row), frees
// the stage itself (the empty barrier's count is 1: its lane 0), and runs the epilogue, lane i for output
// row0 + i. No barrier among the warps inside a phase: W chunks are in flight at once, and a slow one holds up
// only its own warp. The one block-level barrier of a phase is the grid barrier's named barrier.
//
// A row's dot product: lane l takes packs l, l + 32, ..., U of them loaded before the first is used (bytes in
// flight from shared memory), summed in pack order; then the warp's butterfly sum. The order is fixed by the
// shapes: deterministic, as the first version, though not the same bits as it.
template <int U>
__device__ __forceinline__ float row_dot(const uint4* w4, const uint4* x4, int packs, int lane, bool e4m3) {
  float acc = 0.f;
  for (int q0 = lane; q0 < packs; q0 += 32 * U) {
    uint4 wv[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (q0 + 32 * u < packs) wv[u] = w4[q0 + 32 * u];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int q = q0 + 32 * u;
      if (q >= packs) continue;
      acc = e4m3 ? dot16_e4m3(wv[u], x4[2 * q], x4[2 * q + 1], acc) : dot8(wv[u], x4[q], acc);
    }
  }
  return warp_sum(acc);
}

// A warp's view of a phase: the matrix and its own chunk range. Loaded (warp_phase) before the phase's prologue
// (the norm, the combine), so these L2 round trips overlap it instead of following it.
struct WarpPhase {
  OpDesc op;
  uint32_t begin, end;
};
template <int W>
__device__ __forceinline__ WarpPhase warp_phase(const Params& p, int phase) {
  const uint32_t* wb = p.warp_begins + (static_cast<size_t>(blockIdx.x) * W + (threadIdx.x >> 5)) * (p.phases + 1);
  return WarpPhase{p.ops[phase], wb[phase], wb[phase + 1]};
}

template <int W>
__device__ void gemv_phase_warp(const Params& p, const Ring& ring, const WarpPhase& ph, const bf16* xs,
                                const bf16* residual_base) {
  const int lane = threadIdx.x & 31;
  const uint32_t begin = ph.begin, end = ph.end;
  if (begin == end) return;  // no chunk of this phase for this warp: straight to the grid barrier
  const OpDesc& op = ph.op;
  const Op kind = static_cast<Op>(op.kind);
  const int halves = kind == Op::GateUp ? 2 : 1;
  const bool e4m3 = op.elem_bytes == 1;
  float run0 = 0.f, run1 = 0.f;  // a sliced row's sums so far (its slices are this warp's consecutive chunks)
  MkChunk c = p.warp_chunks[begin];
  for (uint32_t ci = begin; ci < end; ++ci) {
    const MkChunk next = ci + 1 < end ? p.warp_chunks[ci + 1] : c;  // loaded while this chunk is computed
    const int rows = static_cast<int>(c.rows);
    const bool last = (c.flags & kMkLastSlice) != 0;
    // The epilogue's operands of lane i (output row0 + i), loaded before the wait: their L2 latency hides
    // behind it.
    const int64_t o = static_cast<int64_t>(c.row0) + lane;
    const bool mine = last && lane < rows;
    float resid = 0.f, scale0 = 1.f, scale1 = 1.f, bias = 0.f;
    if (mine) {
      if (kind == Op::O || kind == Op::Down) resid = __bfloat162float(__ldcg(residual_base + o));
      if (op.scale) {
        scale0 = __ldg(op.scale + o);
        if (halves == 2) scale1 = __ldg(op.scale + op.outputs + o);
      }
      if (op.bias) bias = __bfloat162float(op.bias[o]);
    }
    // The warp's own stage: its previous fill was this warp's earlier chunk, read already, so the parity names
    // this fill and no other.
    const int s = static_cast<int>(c.slot);
    mbar_wait(&ring.full[s], c.round & 1u, p.error, kErrRingEmpty);
    const char* stage = ring.stages + static_cast<size_t>(s) * ring.stage_bytes;
    const int kc = static_cast<int>(c.kc);
    const int packs = e4m3 ? kc / 16 : kc / 8;
    const uint4* x4 = reinterpret_cast<const uint4*>(xs + c.k0);
    float total0 = 0.f, total1 = 0.f;  // lane i: output i's gate (or only) and up sums
    for (int r = 0; r < rows * halves; ++r) {
      const uint4* w4 = reinterpret_cast<const uint4*>(stage + static_cast<size_t>(r) * kc * op.elem_bytes);
      const float acc = row_dot<4>(w4, x4, packs, lane, e4m3);
      if (r < rows) {
        if (lane == r) total0 = acc;
      } else if (lane == r - rows) {
        total1 = acc;
      }
    }
    __syncwarp();                                // every lane's reads of the stage are done
    if (lane == 0) mbar_arrive(&ring.empty[s]);  // the stage is free: the producer may refill it
    // A row cut into column slices: one row per chunk (lane 0), summed slice after slice in order.
    if (!(c.flags & kMkFirstSlice)) {
      total0 += run0;
      total1 += run1;
    }
    if (!last) {
      run0 = total0;
      run1 = total1;
    } else if (mine) {
      // E4M3: each row's scale multiplies its finished sum once, in fp32, before the roundings (gemv.h).
      if (op.scale) {
        total0 *= scale0;
        total1 *= scale1;
      }
      // The epilogues: gemv.h's "Rounding", element by element (as the shared-stages version).
      switch (kind) {
        case Op::Qkv:
          p.qkv[o] = op.bias ? __float2bfloat16_rn(round_bf16(total0) + bias) : __float2bfloat16_rn(total0);
          break;
        case Op::O:
        case Op::Down:
          p.h[o] = __float2bfloat16_rn(resid + round_bf16(total0));
          break;
        case Op::GateUp: {
          const float gate = round_bf16(total0), up = round_bf16(total1);
          const float a = round_bf16(gate / (1.0f + expf(-gate)));
          p.act[o] = __float2bfloat16_rn(a * up);
          break;
        }
        case Op::LmHead:
          p.logits[o] = total0;
          break;
      }
    }
    c = next;
  }
}

}  // namespace mk
}  // namespace tvllm
