// Lesson 14, the GPU side: three GEMV versions and the fused decode kernels built on the third.
//
// Why v3 has no split-K ACROSS blocks. Split-K exists to make blocks when the output alone is too small
// to fill the GPU. Every decode-time weight has N >= 2048 rows (QKV 3072, o_proj 2048, gate|up 16384,
// down 2048 with K = 8192, lm_head 128256): 4-row tiles give >= 512 blocks, ~4 per SM of an H200, with
// all of them resident at once. What a long K needs is bytes in flight, and the block gets them by
// splitting K among its own 256 threads (8 x 16-byte loads each in flight), reducing in shared memory in a
// fixed order. That costs no workspace, no second pass and no atomics, keeps every output's summation
// order a function of (N, K) alone, and lets the block that owns an output apply any epilogue to it
// (the residual add, silu·mul) with nobody else touching it.
//
// Why x is not staged in shared memory. Shared memory and L1 are the same SRAM on the SM: x (M*K*2 bytes,
// 4 KiB at batch 1) is read by every block and stays in L1 through ordinary loads, while the weights, read
// once, bypass it (ld.global.nc.L1::no_allocate). Staging would copy x into the same SRAM once per block and
// add a barrier. What cuts x traffic is reuse: each x value loaded serves the tile's 4 weight rows.
// Known cost at large M: a block reads all M rows of x (and with the fused norm, of h twice), so at M = 16
// the L1 traffic is ~4x (8x fused) the weight bytes; batch 1, the target, is unaffected.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>

#include "common/cuda_utils.cuh"
#include "common/mma.cuh"
#include "common/errors.h"
#include "common/exercise.h"
#include "gemv.h"
#include "pdl.cuh"
#include "rope.h"
#include "stream_load.cuh"

namespace tvllm {

namespace {

using bf16 = __nv_bfloat16;

constexpr int kWarp = kWarpSize;
constexpr int kMaxThreads = 256;  // v3: 8 warps

// What happens to a finished sum (the epilogue), chosen at run time: the branch is taken once per output.
enum class Store : int { Bf16, F32, AddResidual };

// ---- v1: one warp per output (m, n) --------------------------------------------------------------------

// kPair: lanes read 2 bf16 (4 bytes) at a time; else 1 (any K, any alignment).
template <bool kPair>
__global__ void gemv_v1_kernel(void* out, Store store, const bf16* x, const bf16* w, int M, int64_t N,
                               int64_t K) {
  const int lane = threadIdx.x % kWarp;
  const int64_t output = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  if (output >= M * N) return;  // a whole warp leaves together: the shuffles below see all 32 lanes
  const int64_t m = output / N, n = output % N;
  const bf16* xr = x + m * K;
  const bf16* wr = w + n * K;
  float acc = 0.f;
  if constexpr (kPair) {
    // Lane i reads words i, i + 32, ...: the warp's 32 loads cover 128 consecutive bytes of W (coalesced).
    const auto* x2 = reinterpret_cast<const __nv_bfloat162*>(xr);
    const auto* w2 = reinterpret_cast<const __nv_bfloat162*>(wr);
    for (int64_t k = lane; k < K / 2; k += kWarp) {
      const float2 xv = __bfloat1622float2(x2[k]), wv = __bfloat1622float2(w2[k]);
      acc = __fmaf_rn(xv.x, wv.x, acc);
      acc = __fmaf_rn(xv.y, wv.y, acc);
    }
  } else {
    for (int64_t k = lane; k < K; k += kWarp) acc = __fmaf_rn(__bfloat162float(xr[k]), __bfloat162float(wr[k]), acc);
  }
  acc = warp_sum(acc);
  if (lane == 0) {
    if (store == Store::F32)
      static_cast<float*>(out)[m * N + n] = acc;
    else
      static_cast<bf16*>(out)[m * N + n] = __float2bfloat16_rn(acc);
  }
}

// ---- v2: one warp per weight row, every input row, 16-byte loads ---------------------------------------

// kM: the rows the kernel is compiled for (1, 2, 4, 8 or 16); rows m >= M are skipped. The sums of a
// row do not depend on kM: each lane adds its packs in the same order whatever kM is.
template <int kM>
__global__ void gemv_v2_kernel(void* out, Store store, const bf16* x, const bf16* w, int M, int64_t N,
                               int64_t K) {
  // --- exercise 14.1: v2, one warp per weight row for every input row --------------------------------
  // Task: warp (blockIdx.x * warps per block + warp index) owns weight row n (return if n >= N). Its lanes
  //   read W's row in 16-byte packs (load_pack<8>: 8 bf16), lane l taking packs l, l + 32, l + 64, ...;
  //   each pack is multiplied into kM sums, one per input row m < M (x row m starts at x + m * K), so W
  //   is read once whatever M is. Then warp_sum each sum and let lane 0 store out[m, n]: fp32 when store
  //   is Store::F32, else rounded to bf16.
  // Hint: issue kUnroll (4) loads of W before using any: 64 bytes in flight per lane hide DRAM latency.
  // Hint: add in pack order with __fmaf_rn (an explicit fused multiply-add), so a row's bits do not
  //   depend on kM: the determinism test compares a row computed alone with the same row among 16.
  // Hint: warp_sum has shuffles over all 32 lanes: every lane of a live warp must reach it (no early
  //   return after the n >= N check, which a whole warp takes together).
  // Tests: Gemv14Gpu.EveryVersionMatchesTheReferenceAtDecodeShapes Gemv14Gpu.OddShapes
  // Tests: Gemv14Gpu.LmHeadWritesF32Logits Gemv14Gpu.RowsAreTheSameBitsWhateverTheBatch
  // Stub: device
  // --- solution ---
  constexpr int kUnroll = 4;  // 16-byte loads of W in flight per lane before the first is used
  const int lane = threadIdx.x % kWarp;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  if (n >= N) return;
  const int64_t packs = K / 8;
  const bf16* wr = w + n * K;
  float acc[kM] = {};
  for (int64_t p0 = lane; p0 < packs; p0 += kUnroll * kWarp) {
    Pack<8> wv[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t p = p0 + u * kWarp;
      wv[u] = p < packs ? load_pack<8>(wr + p * 8) : Pack<8>{};
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t p = p0 + u * kWarp;
      if (p >= packs) break;
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        if (m >= M) break;
        const Pack<8> xv = load_pack<8>(x + m * K + p * 8);  // x is small and read by every warp: L1 hits
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[m] = __fmaf_rn(xv.get(i), wv[u].get(i), acc[m]);
      }
    }
  }
#pragma unroll
  for (int m = 0; m < kM; ++m) {
    const float total = warp_sum(acc[m]);  // every lane takes part, also for m >= M (all zeros)
    if (lane == 0 && m < M) {
      if (store == Store::F32)
        static_cast<float*>(out)[m * N + n] = total;
      else
        static_cast<bf16*>(out)[m * N + n] = __float2bfloat16_rn(total);
    }
  }
  // --- end of exercise 14.1 ---
}

// ---- v3: a block per tile of weight rows, K split among its threads -----------------------------------

// Weights are read once per step: load_streaming (stream_load.cuh) reads them past L1, so L1 keeps x, which
// every block reads.
__device__ __forceinline__ Pack<8> load_weights(const void* p) {
  return load_streaming(static_cast<const bf16*>(p));
}

#include "gemv_weight_pack.cuh"  // WeightType, WeightPack, load_weight_pack, widen_weights, the Bits decoding

// Asks the memory system to bring [p, p + bytes) into L2 without waiting for it (Hopper's bulk prefetch: one
// instruction for a whole row; p and bytes multiples of 16). A hint: no register, no completion to wait for.
__device__ __forceinline__ void prefetch_l2(const void* p, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes));
#endif
}

enum class Prologue { None, RmsNorm };
// GateUp: a tile of outputs j owns rows j and I + j. Rope: a tile of pairs owns, for each pair (head, j), the
// rows of element j and j + head_dim / 2 of that head: the two values RoPE rotates together.
enum class Tile { Rows, GateUp, Rope };

#include "gemv_reduce.cuh"  // warp_sums_to: V sums per thread reduced across the warp, one total each

struct V3Args {
  const bf16* x;      // [M, K]: the input, or h (the norm's input) with Prologue::RmsNorm
  const void* w;      // [N, K]: BF16, or E4M3 codes (WeightType)
  const float* w_scale;  // [N]: E4M3 weights' per-row scales (nullptr for BF16)
  const bf16* g;      // [K]: the norm's weight (RmsNorm)
  void* out;          // [M, N] (or [M, I] for GateUp)
  Store store;        // Rows only
  float eps;
  int M;
  int64_t N, K;
  int64_t outputs;    // columns of out: N, or I = N / 2 for GateUp, or the N / 2 pairs for Rope
  // Rope: row m's position, lesson 05's cos / sin table [max_positions, half], half = head_dim / 2, and how many
  // heads of the row rotate (q's and k's; v's follow them unrotated).
  const int32_t* positions;
  const float* cos;
  const float* sin;
  int half, q_heads, rotated_heads, max_positions;
  // Rope: where the k and v heads are also stored (kv_store.h); kv.k == nullptr: nowhere.
  KvStore kv;
};

// The weight row behind tile row `second ? kOuts + i : i` of output column col (GateUp: its up row; Rope: the
// element half a head further on).
template <Tile kTile>
__device__ __forceinline__ int64_t weight_row(const V3Args& a, int64_t col, bool second) {
  if constexpr (kTile == Tile::GateUp) {
    return second ? a.outputs + col : col;
  } else if constexpr (kTile == Tile::Rope) {
    const int64_t head = col / a.half, j = col - head * a.half;
    return head * 2 * a.half + j + (second ? a.half : 0);
  } else {
    return col;
  }
}

// The epilogues of v3 and v4, one output element each (gemv.h, "Rounding").
// Rows: out[o] = the sum, stored as a.store says.
__device__ __forceinline__ void store_output(const V3Args& a, int64_t o, float s) {
  if (a.store == Store::F32) {
    static_cast<float*>(a.out)[o] = s;
  } else if (a.store == Store::AddResidual) {
    // linear() would have stored bf16(s); add_rmsnorm then adds it to h in fp32 and rounds.
    bf16* h = static_cast<bf16*>(a.out);
    const float product = bf16_bits_to_f32(f32_to_bf16_bits(s));
    h[o] = __float2bfloat16_rn(__bfloat162float(h[o]) + product);
  } else {
    static_cast<bf16*>(a.out)[o] = __float2bfloat16_rn(s);
  }
}

// GateUp: act[o] = silu(gate) * up. Lesson 08's rounding: gate and up are bf16, silu(gate) is rounded to bf16,
// then the product.
__device__ __forceinline__ void store_silu_mul(const V3Args& a, int64_t o, float gate_sum, float up_sum) {
  const float gate = bf16_bits_to_f32(f32_to_bf16_bits(gate_sum));
  const float up = bf16_bits_to_f32(f32_to_bf16_bits(up_sum));
  const float act = bf16_bits_to_f32(f32_to_bf16_bits(gate / (1.0f + expf(-gate))));
  static_cast<bf16*>(a.out)[o] = __float2bfloat16_rn(act * up);
}

// The KV store (kv_store.h): elements j and j + half of head `head` of token m, a k head (q_heads <= head <
// rotated_heads) or a v head (after them), as lesson 10's / 12's write would copy them from qkv: the bf16 values
// as stored there, or (an FP8 pool) their E4M3 codes, code = e4m3(x * inv_scale) as paged_kv_write_fp8 rounds.
__device__ __forceinline__ void store_kv_pair(const V3Args& a, int m, int64_t head, int64_t j, bf16 x1, bf16 x2) {
  const KvStore& s = a.kv;
  int64_t row;  // this token's row of the layer's cache
  if (s.rows != nullptr) {
    row = __ldg(s.rows + m);  // lesson 12's slot mapping; -1: a padding token, stored nowhere
  } else {
    const int32_t slot = __ldg(s.slots + m);  // lesson 10, a decode step: token m is sequence m, at its last key
    row = slot < 0 ? -1 : static_cast<int64_t>(slot) * s.max_context + (__ldg(s.cu_k + m + 1) - __ldg(s.cu_k + m) - 1);
  }
  if (row < 0) return;
  const bool is_v = head >= a.rotated_heads;
  const int64_t kv_head = head - (is_v ? a.rotated_heads : a.q_heads);
  const int64_t at = row * s.kv_dim + kv_head * 2 * a.half + j;
  void* base = is_v ? s.v : s.k;
  if (s.dtype == DType::F8_E4M3) {
    const float inv = is_v ? s.v_inv_scale : s.k_inv_scale;
    __nv_fp8_storage_t* dst = static_cast<__nv_fp8_storage_t*>(base) + at;
    dst[0] = __nv_cvt_float_to_fp8(__bfloat162float(x1) * inv, __NV_SATFINITE, __NV_E4M3);
    dst[a.half] = __nv_cvt_float_to_fp8(__bfloat162float(x2) * inv, __NV_SATFINITE, __NV_E4M3);
  } else {
    bf16* dst = static_cast<bf16*>(base) + at;
    dst[0] = x1;
    dst[a.half] = x2;
  }
}

// Rope: the pair (j, j + half) of head `head` of row m: each rounded to bf16 as linear() stores it, then rotated
// by lesson 05's rotate_pair arithmetic (each operation rounded on its own, no FMA) with the table's cos / sin of
// the row's position, and rounded again, as apply_rope() does in place: the same bits as the two launches.
// Heads past rotated_heads (v) are stored as they are.
__device__ __forceinline__ void store_rope(const V3Args& a, int m, int64_t col, float first_sum, float second_sum) {
  const float x1 = bf16_bits_to_f32(f32_to_bf16_bits(first_sum));
  const float x2 = bf16_bits_to_f32(f32_to_bf16_bits(second_sum));
  const int64_t head = col / a.half, j = col - head * a.half;
  bf16* row = static_cast<bf16*>(a.out) + m * a.N + head * 2 * a.half;
  bf16 y1, y2;
  if (head < a.rotated_heads) {
    const int pos = min(max(__ldg(a.positions + m), 0), a.max_positions - 1);  // PositionCheck::Trusted's clamp
    const float c = __ldg(a.cos + static_cast<int64_t>(pos) * a.half + j);
    const float s = __ldg(a.sin + static_cast<int64_t>(pos) * a.half + j);
    y1 = __float2bfloat16_rn(__fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s)));
    y2 = __float2bfloat16_rn(__fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s)));
  } else {
    y1 = __float2bfloat16_rn(x1);
    y2 = __float2bfloat16_rn(x2);
  }
  row[j] = y1;
  row[j + a.half] = y2;
  if (a.kv.k != nullptr && head >= a.q_heads) store_kv_pair(a, m, head, j, y1, y2);
}

// How E4M3 packs become floats (Fp8GemvVariant without the tile): BF16 weights ignore it.
enum class Fp8Decode { Cvt, Bits };

template <int kM, int kTileRows, Prologue kPrologue, Tile kTile, WeightType kW, Fp8Decode kDecode = Fp8Decode::Cvt>
__global__ void __launch_bounds__(kMaxThreads) gemv_v3_kernel(V3Args a) {
  constexpr int kCols = WeightPack<kW>::kCols;  // columns of K per 16-byte pack of W: 8 (BF16) or 16 (E4M3)
  // Tile r (0..kTileRows-1) -> a weight row. Rows: n0 + r. GateUp: kTileRows / 2 outputs j0 + i, whose
  // gate rows are j0 + i and up rows I + j0 + i. Rope: kTileRows / 2 pairs (weight_row).
  constexpr int kOuts = kTile == Tile::Rows ? kTileRows : kTileRows / 2;
  // 8 loads of W in flight per thread whatever the tile (8-row tiles, Fp8GemvVariant::BitsTile8: one per row)
  constexpr int kUnroll = kTileRows >= 8 ? 1 : kTileRows >= 4 ? 2 : 8;
  // Bits: each 8 columns decoded where they are used (a quarter of Cvt's live floats with 8-row tiles).
  constexpr bool kLateDecode = WeightPack<kW>::kFp8 && kDecode == Fp8Decode::Bits;
  const int warps = blockDim.x / kWarp, warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t packs = a.K / kCols;
  const int64_t tiles = (a.outputs + kOuts - 1) / kOuts;
  __shared__ float partial[kMaxThreads / kWarp][kTileRows * kM];
  __shared__ float inv_rms[kM];
  __shared__ float tile_scale[kTileRows];  // E4M3: row r's scale (the barrier after the sums publishes it)
  __shared__ float total[kTileRows * kM];

  // Tile streaming (gemv.h, set_gemv_tile_streaming): the grid may be smaller than the number of tiles; block b
  // then computes tiles b, b + gridDim.x, ... and loads each next tile's weights BEFORE reducing the current
  // one, so the reduction, the barriers and the epilogue of one tile run while the next tile's bytes are in
  // flight. With one block per tile (the grid of v3's first version) the loop below runs once. Either way each
  // output is summed by the same threads in the same order: the bits do not depend on the grid.
  int64_t tile = blockIdx.x;
  const uint8_t* rows[kTileRows];  // byte addresses: a row is K * kBytes bytes
  bool valid[kTileRows];
  const auto locate = [&](int64_t t) {  // tile t's rows: tile row r is output column t * kOuts + r % kOuts's
#pragma unroll                          // (its second row from r = kOuts on: weight_row)
    for (int r = 0; r < kTileRows; ++r) {
      const int64_t col = t * kOuts + r % kOuts;
      valid[r] = col < a.outputs;
      const int64_t n = valid[r] ? weight_row<kTile>(a, col, r >= kOuts) : 0;
      rows[r] = static_cast<const uint8_t*>(a.w) + n * a.K * WeightPack<kW>::kBytes;
    }
  };

  // The first kUnroll packs of each tile row this thread will use (with 256 threads and K = 2048: the whole
  // tile), loaded BEFORE waiting for the previous kernel: the weights are never written during a step, so
  // under programmatic dependent launch (pdl.cuh) these loads overlap the previous kernel's tail. Without PDL
  // the wait is a no-op and the loads simply start before the norm's prologue. Same values, same order of
  // additions: the bits do not depend on the launch.
  Pack<8> wv[kUnroll][kTileRows];
  const auto load_tile = [&](int64_t p0) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t p = p0 + static_cast<int64_t>(u) * blockDim.x;
#pragma unroll
      for (int r = 0; r < kTileRows; ++r)
        wv[u][r] = p < packs && valid[r] ? load_weight_pack<kW>(rows[r] + p * WeightPack<kW>::kLoadBytes)
                                         : Pack<8>{};
    }
  };
  const int64_t first_group = static_cast<int64_t>(kUnroll) * blockDim.x;  // packs held in registers
  float row_scale = 1.f;  // E4M3: tile row threadIdx.x's scale, for thread r < kTileRows
  // A tile's start: its rows located, its first group of packs loaded, the rest of its rows (K = 8192: the
  // second half) asked into L2 by one thread per row, and (E4M3) its scales fetched beside the weights:
  // scales are weights, never written during a step; fetched in the epilogue, their DRAM round trip would
  // lengthen the kernel's tail (~1 us at batch 1, where the small GEMVs are all latency).
  const auto start_tile = [&](int64_t t) {
    locate(t);
    load_tile(threadIdx.x);
#pragma unroll
    for (int r = 0; r < kTileRows; ++r)
      if (WeightPack<kW>::kLoadBytes == 16 && threadIdx.x == r && valid[r] && packs > first_group)  // 16-byte units
        prefetch_l2(rows[r] + first_group * WeightPack<kW>::kLoadBytes,
                    static_cast<uint32_t>((packs - first_group) * WeightPack<kW>::kLoadBytes));
    if constexpr (WeightPack<kW>::kFp8) {
      const int r = static_cast<int>(threadIdx.x);
      if (r < kTileRows) {
        const int64_t col = t * kOuts + r % kOuts;
        row_scale = col < a.outputs ? __ldg(a.w_scale + weight_row<kTile>(a, col, r >= kOuts)) : 1.f;
      }
    }
  };
  start_tile(tile);
  pdl_wait_for_previous_kernel();  // from here on: reads of x / h, and every write
  pdl_let_next_kernel_start();

  // The norm's prologue: each block sums the squares of its M rows of h itself (fixed order: thread t
  // adds packs t, t + blockDim, ...; then warps, then the warps' sums in order), as lesson 04 does. Once per
  // block, whatever number of tiles it streams.
  if constexpr (kPrologue == Prologue::RmsNorm) {
    float sum_sq[kM];
#pragma unroll
    for (int m = 0; m < kM; ++m) {
      sum_sq[m] = 0.f;
      if (m < a.M)
        for (int64_t p = threadIdx.x; p < a.K / 8; p += blockDim.x) {  // 8 bf16 of h per load, whatever W is
          const Pack<8> hv = load_pack<8>(a.x + m * a.K + p * 8);
#pragma unroll
          for (int i = 0; i < 8; ++i) sum_sq[m] = __fmaf_rn(hv.get(i), hv.get(i), sum_sq[m]);
        }
    }
    warp_sums_to<kM>(sum_sq, partial[warp], lane);
    __syncthreads();
    if (threadIdx.x < kM) {
      float total_sq = 0.f;
      for (int i = 0; i < warps; ++i) total_sq += partial[i][threadIdx.x];
      inv_rms[threadIdx.x] = rsqrtf(total_sq / static_cast<float>(a.K) + a.eps);
    }
    __syncthreads();  // inv_rms ready; partial free again
  }

  for (;;) {
    const int64_t first = tile * kOuts;  // this tile's first output column
    // The main loop: thread t reads packs t, t + blockDim, ... of each of the tile's rows, and adds each
    // W value times x into kTileRows x kM sums, in pack order (the unrolling only hoists the loads).
    float acc[kTileRows][kM] = {};
    for (int64_t p0 = threadIdx.x; p0 < packs; p0 += kUnroll * blockDim.x) {
      if (p0 != threadIdx.x) load_tile(p0);  // the first group was loaded when the tile started
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t p = p0 + static_cast<int64_t>(u) * blockDim.x;
        if (p >= packs) break;
        // The pack's weights widened once, used for every input row (E4M3: 8 cvt for 16 weights).
        float wf[kTileRows][kCols];
        if constexpr (!kLateDecode) {
#pragma unroll
          for (int r = 0; r < kTileRows; ++r) widen_weights<kW>(wv[u][r], wf[r]);
        }
        // x's columns p * kCols .. + kCols - 1: one or two 16-byte loads of 8 bf16 (h and g likewise).
#pragma unroll
        for (int half = 0; half < kCols / 8; ++half) {
          const int64_t col = p * kCols + 8 * half;
          if constexpr (kLateDecode) {  // this half's 8 codes of each row: words 2 half and 2 half + 1
#pragma unroll
            for (int r = 0; r < kTileRows; ++r) {
              e4m3x4_bits_to_float(wv[u][r].word[2 * half], &wf[r][8 * half]);
              e4m3x4_bits_to_float(wv[u][r].word[2 * half + 1], &wf[r][8 * half + 4]);
            }
          }
          Pack<8> gv{};
          if constexpr (kPrologue == Prologue::RmsNorm) gv = load_pack<8>(a.g + col);
#pragma unroll
          for (int m = 0; m < kM; ++m) {
            if (m >= a.M) break;
            const Pack<8> raw = load_pack<8>(a.x + m * a.K + col);
            float xv[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) {
              if constexpr (kPrologue == Prologue::RmsNorm) {
                // Lesson 04's rounding: bf16(h * inv_rms), times the weight, rounded to bf16 again.
                const float normed = bf16_bits_to_f32(f32_to_bf16_bits(raw.get(i) * inv_rms[m]));
                xv[i] = bf16_bits_to_f32(f32_to_bf16_bits(normed * gv.get(i)));
              } else {
                xv[i] = raw.get(i);
              }
            }
#pragma unroll
            for (int r = 0; r < kTileRows; ++r)
#pragma unroll
              for (int i = 0; i < 8; ++i) acc[r][m] = __fmaf_rn(xv[i], wf[r][8 * half + i], acc[r][m]);
          }
        }
      }
    }

    // Streaming: the next tile's weights are asked for now (wv is free: the loop above consumed it), and
    // arrive while this tile reduces and stores. Its scale replaces row_scale, so keep this tile's.
    const float this_scale = row_scale;
    const int64_t next = tile + gridDim.x;
    if (next < tiles) start_tile(next);

    // The block's reduction: a butterfly per warp (reduce-scatter), then the warps' sums in warp order.
    float flat[kTileRows * kM];
#pragma unroll
    for (int r = 0; r < kTileRows; ++r)
#pragma unroll
      for (int m = 0; m < kM; ++m) flat[r * kM + m] = acc[r][m];
    warp_sums_to<kTileRows * kM>(flat, partial[warp], lane);
    if (WeightPack<kW>::kFp8 && threadIdx.x < kTileRows) tile_scale[threadIdx.x] = this_scale;
    __syncthreads();
    for (int i = threadIdx.x; i < kTileRows * kM; i += blockDim.x) {
      float s = 0.f;
      for (int j = 0; j < warps; ++j) s += partial[j][i];
      total[i] = s;
    }
    __syncthreads();

    // The epilogue: one thread per output (m, column) of the tile. This block alone owns these outputs.
    for (int i = threadIdx.x; i < kOuts * kM; i += blockDim.x) {
      const int c = i / kM, m = i % kM;
      const int64_t col = first + c;
      if (m >= a.M || col >= a.outputs) continue;
      const int64_t o = m * a.outputs + col;
      // E4M3: each row's scale multiplies its finished sum (fp32), before the epilogue's roundings.
      float first_scale = 1.f, second_scale = 1.f;
      if constexpr (WeightPack<kW>::kFp8) {
        // Bits: the sums are 2^-8 of Cvt's; 256 x scale is exact, and so the product is Cvt's, bit for bit.
        constexpr float kUnit = kDecode == Fp8Decode::Bits ? kBitsScale : 1.f;
        first_scale = tile_scale[c] * kUnit;  // tile row c: output column `col` (GateUp: its gate row)
        if constexpr (kTile != Tile::Rows) second_scale = tile_scale[kOuts + c] * kUnit;  // its up / second row
      }
      const float first_sum = total[c * kM + m] * first_scale;
      if constexpr (kTile == Tile::GateUp)
        store_silu_mul(a, o, first_sum, total[(kOuts + c) * kM + m] * second_scale);
      else if constexpr (kTile == Tile::Rope)
        store_rope(a, m, col, first_sum, total[(kOuts + c) * kM + m] * second_scale);
      else
        store_output(a, o, first_sum);
    }
    if (next >= tiles) break;
    tile = next;
    // The next tile writes tile_scale before its first barrier, and another thread may still read it above.
    // (partial and total are safe: every thread has passed this tile's barriers before any writes them again.)
    if constexpr (WeightPack<kW>::kFp8) __syncthreads();
  }
}

// ---- launchers ----------------------------------------------------------------------------------------

// Calls f(std::integral_constant<int, kM>) with kM the smallest of 1, 2, 4, 8, 16 that holds M rows.
template <class F>
void with_rows(int M, F&& f) {
  if (M <= 1)
    f(std::integral_constant<int, 1>{});
  else if (M <= 2)
    f(std::integral_constant<int, 2>{});
  else if (M <= 4)
    f(std::integral_constant<int, 4>{});
  else if (M <= 8)
    f(std::integral_constant<int, 8>{});
  else
    f(std::integral_constant<int, 16>{});
}

// How many blocks of `kernel` (with `threads` threads) the current GPU holds at once: its SMs times the blocks
// per SM that registers, shared memory and threads allow. Asked of the runtime once per (kernel, threads,
// device) and remembered: the launch path stays cheap, and the query is allowed during a stream capture.
int64_t resident_blocks(const void* kernel, int threads) {
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int, int>, int64_t> known;
  int device = 0;
  TVLLM_CUDA_CHECK(cudaGetDevice(&device));
  const std::lock_guard<std::mutex> lock(mutex);
  auto [it, fresh] = known.try_emplace({kernel, threads, device}, 0);
  if (fresh) {
    int per_sm = 0, sms = 0;
    TVLLM_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0));
    TVLLM_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    it->second = std::max<int64_t>(1, static_cast<int64_t>(per_sm) * sms);
  }
  return it->second;
}
template <class... Params>
int64_t resident_blocks(void (*kernel)(Params...), int threads) {
  return resident_blocks(reinterpret_cast<const void*>(kernel), threads);
}

// pdl: launch as a programmatic dependent of the stream's previous kernel (pdl.cuh); the kernel is the same.
// Fp8GemvVariant::BitsTile8 takes 8-row tiles where that still leaves 2 blocks per SM of an H200.
constexpr int64_t kTile8MinRows = 8 * 264;

// eight: 8-row tiles (4 gate|up outputs) where N >= kTile8MinRows and v3's shape takes 4-row tiles.
template <Prologue kPrologue, Tile kTile, WeightType kW = WeightType::Bf16, Fp8Decode kDecode = Fp8Decode::Cvt>
void launch_v3(const V3Args& a, cudaStream_t stream, bool pdl, bool eight = false) {
  // The shape depends on (N, K) only: never on M, so neither does any output's summation order.
  // GateUp: a tile of 4 (or 2) weight rows is 2 (or 1) outputs, each with its gate row and its up row.
  // One thread per load of a row, as for bf16: 16 / kCols "bytes per column" in 16-byte loads.
  const GemvV3Shape s = gemv_v3_shape(a.N, a.K, 16 / WeightPack<kW>::kCols);
  const bool four = s.rows_per_block == 4;
  // Only the FP8 Bits path is compiled with 8-row tiles (the tile never changes a row's bits: see the kernel).
  constexpr bool kEightCompiled = kW == WeightType::E4m3 && kDecode == Fp8Decode::Bits;
  eight = kEightCompiled && eight && four && a.N >= kTile8MinRows;
  const int tile_rows = eight ? 8 : s.rows_per_block;
  const int64_t outs_per_block = kTile == Tile::Rows ? tile_rows : std::max(1, tile_rows / 2);
  const int64_t tiles = ceil_div(a.outputs, outs_per_block);
  TVLLM_REQUIRE(tiles < (int64_t{1} << 31), "gemv: too many rows for one launch");
  // One block per tile, or (tile streaming, the default) no more blocks than the GPU holds at once.
  const auto go = [&](auto kernel) {
    const auto grid = static_cast<unsigned>(gemv_tile_streaming() ? std::min(tiles, resident_blocks(kernel, s.threads))
                                                                  : tiles);
    launch_kernel(kernel, grid, s.threads, stream, pdl, a);
  };
  with_rows(a.M, [&](auto rows) {
    constexpr int kM = decltype(rows)::value;
    constexpr int kSmallTile = kTile == Tile::Rows ? 1 : 2;  // GateUp, Rope: one pair of rows
    if constexpr (kEightCompiled) {
      if (eight) {
        go(gemv_v3_kernel<kM, 8, kPrologue, kTile, kW, kDecode>);
        return;
      }
    }
    if (four)
      go(gemv_v3_kernel<kM, 4, kPrologue, kTile, kW, kDecode>);
    else
      go(gemv_v3_kernel<kM, kSmallTile, kPrologue, kTile, kW, kDecode>);
  });
}

V3Args v3_args(const TensorView& out, const TensorView& x, const TensorView& w, const TensorView& w_scale = {}) {
  V3Args a{};
  a.x = x.ptr<const bf16>();
  a.w = w.data;
  a.w_scale = w_scale.ptr<const float>();
  a.out = out.data;
  a.store = out.dtype == DType::F32 ? Store::F32 : Store::Bf16;
  a.M = static_cast<int>(x.shape[0]);
  a.N = w.shape[0];
  a.K = x.shape[1];
  a.outputs = out.shape[1];
  return a;
}

// The weight's dtype picks the instantiation: BF16, or F8_E4M3 (checked by the callers) in 16- or 8-byte loads,
// decoded as `fp8` says (Auto: the table of gemv.h for this batch).
template <Prologue kPrologue, Tile kTile>
void launch_v3_for(DType weight_dtype, Fp8GemvVariant fp8, const V3Args& a, cudaStream_t stream, bool pdl) {
  if (weight_dtype != DType::F8_E4M3) {
    launch_v3<kPrologue, kTile, WeightType::Bf16>(a, stream, pdl);
    return;
  }
  if (fp8 == Fp8GemvVariant::Auto) fp8 = fp8_gemv_variant_for_rows(a.M);
  const bool eight = fp8 == Fp8GemvVariant::BitsTile8;
  if (fp8 == Fp8GemvVariant::Cvt) {
    if (a.K % 16 == 0)
      launch_v3<kPrologue, kTile, WeightType::E4m3>(a, stream, pdl);
    else
      launch_v3<kPrologue, kTile, WeightType::E4m3x8>(a, stream, pdl);
  } else if (a.K % 16 == 0) {
    launch_v3<kPrologue, kTile, WeightType::E4m3, Fp8Decode::Bits>(a, stream, pdl, eight);
  } else {
    launch_v3<kPrologue, kTile, WeightType::E4m3x8, Fp8Decode::Bits>(a, stream, pdl);
  }
}

#include "gemv_v4.cuh"  // v4: tensor cores for 2..16 rows (inside this namespace: it uses the pieces above)


}  // namespace

namespace {
std::atomic<bool> g_tile_streaming{true};
}  // namespace

void set_gemv_tile_streaming(bool on) { g_tile_streaming.store(on); }
bool gemv_tile_streaming() { return g_tile_streaming.load(); }

namespace detail {

void gemv_cuda(const TensorView& out, const TensorView& x, const TensorView& w, GemvKernel kernel,
               cudaStream_t stream) {
  const V3Args a = v3_args(out, x, w);
  const bf16* wb = static_cast<const bf16*>(a.w);  // v1, v2: BF16 weights only
  if (kernel != GemvKernel::V1Warp && !gemv_supported(x, w)) kernel = GemvKernel::V1Warp;
  constexpr int kThreads = 128;  // v1, v2: 4 warps per block
  const int warps = kThreads / kWarp;
  if (kernel == GemvKernel::V1Warp) {
    const int64_t blocks = ceil_div(a.M * a.N, warps);
    TVLLM_REQUIRE(blocks < (int64_t{1} << 31), "gemv: too many outputs for one launch");
    const bool pair = a.K % 2 == 0 && pointer_alignment(a.x) >= 4 && pointer_alignment(a.w) >= 4;
    if (pair)
      gemv_v1_kernel<true><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a.out, a.store, a.x, wb, a.M,
                                                                                  a.N, a.K);
    else
      gemv_v1_kernel<false><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a.out, a.store, a.x, wb,
                                                                                   a.M, a.N, a.K);
    TVLLM_CHECK_LAUNCH();
  } else if (kernel == GemvKernel::V2Vector) {
    const int64_t blocks = ceil_div(a.N, warps);
    TVLLM_REQUIRE(blocks < (int64_t{1} << 31), "gemv: too many rows for one launch");
    with_rows(a.M, [&](auto rows) {
      constexpr int kM = decltype(rows)::value;
      gemv_v2_kernel<kM><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a.out, a.store, a.x, wb, a.M,
                                                                                 a.N, a.K);
    });
    TVLLM_CHECK_LAUNCH();
  } else if (kernel == GemvKernel::V4TensorCore) {
    launch_v4<Prologue::None, Tile::Rows>(a, stream, false);
  } else {
    launch_v3<Prologue::None, Tile::Rows>(a, stream, false);
  }
}

void rmsnorm_gemv_cuda(const TensorView& out, const TensorView& h, const TensorView& norm_weight, float eps,
                       const TensorView& w, const TensorView& w_scale, cudaStream_t stream, bool pdl,
                       Fp8GemvVariant fp8) {
  V3Args a = v3_args(out, h, w, w_scale);
  a.g = norm_weight.ptr<const bf16>();
  a.eps = eps;
  launch_v3_for<Prologue::RmsNorm, Tile::Rows>(w.dtype, fp8, a, stream, pdl);
}

void rmsnorm_gemv_silu_mul_cuda(const TensorView& act, const TensorView& h, const TensorView& norm_weight,
                                float eps, const TensorView& w_gate_up, const TensorView& w_scale,
                                cudaStream_t stream, bool pdl, Fp8GemvVariant fp8) {
  V3Args a = v3_args(act, h, w_gate_up, w_scale);
  a.g = norm_weight.ptr<const bf16>();
  a.eps = eps;
  launch_v3_for<Prologue::RmsNorm, Tile::GateUp>(w_gate_up.dtype, fp8, a, stream, pdl);
}

void rmsnorm_gemv_rope_cuda(const TensorView& qkv, const TensorView& h, const TensorView& norm_weight, float eps,
                            const TensorView& w, const TensorView& w_scale, const TensorView& positions,
                            const RopeTable& table, int64_t q_heads, int64_t k_heads, cudaStream_t stream, bool pdl,
                            Fp8GemvVariant fp8, const KvStore* kv) {
  V3Args a = v3_args(qkv, h, w, w_scale);
  a.g = norm_weight.ptr<const bf16>();
  a.eps = eps;
  a.half = static_cast<int>(table.half());
  a.outputs = a.N / 2;  // pairs
  a.q_heads = static_cast<int>(q_heads);
  a.rotated_heads = static_cast<int>(q_heads + k_heads);
  if (kv != nullptr) a.kv = *kv;
  a.max_positions = static_cast<int>(table.max_positions());
  a.positions = positions.ptr<const int32_t>();
  a.cos = table.cos(Device::CUDA).ptr<const float>();
  a.sin = table.sin(Device::CUDA).ptr<const float>();
  launch_v3_for<Prologue::RmsNorm, Tile::Rope>(w.dtype, fp8, a, stream, pdl);
}

void gemv_residual_cuda(const TensorView& h, const TensorView& x, const TensorView& w, const TensorView& w_scale,
                        cudaStream_t stream, bool pdl, Fp8GemvVariant fp8) {
  V3Args a = v3_args(h, x, w, w_scale);
  a.store = Store::AddResidual;
  launch_v3_for<Prologue::None, Tile::Rows>(w.dtype, fp8, a, stream, pdl);
}

void gemv_fp8_cuda(const TensorView& out, const TensorView& x, const TensorView& w, const TensorView& w_scale,
                   cudaStream_t stream, Fp8GemvVariant fp8) {
  launch_v3_for<Prologue::None, Tile::Rows>(DType::F8_E4M3, fp8, v3_args(out, x, w, w_scale), stream, false);
}

}  // namespace detail
}  // namespace tvllm
