// Lesson 15, step 4, v2: y = x W^T, the next version of gemm_wgmma.cu. README.md, "GEMM v2".
//
// v1 (gemm_wgmma.cu) is the readable step; v2 keeps its pipeline (producer warpgroup, ring of stages, full
// and empty mbarriers, two consumer warpgroups, wait_group<1>) and changes four things:
//
//   1. The tile is 128 x 256 (each consumer: 64 x 256 with wgmma m64n256k16, 128 fp32 accumulators per
//      thread). A 64-deep stage (16 KB of x, 32 KB of W) feeds 4.2 MFLOP where v1's (16 + 16 KB) fed 2.1:
//      25 % fewer bytes from L2 per FLOP, and 17 % fewer bytes read by wgmma from shared memory per FLOP.
//   2. The grid is PERSISTENT: one block per SM, each walking tiles blockIdx.x, + gridDim.x, ... in grouped
//      order (hopper_layout.h: grouped_tile). The stage counter runs on across tiles, so the producer starts
//      the next tile's loads while the consumers are still busy with the last tile's epilogue, and the
//      launch's tail is at most one tile per SM.
//   3. The epilogue goes registers -> shared memory (128-byte swizzled, conflict-free) -> TMA store, in
//      64 x 64 chunks through two buffers per consumer: 128-byte rows written by the TMA unit, clipped at the
//      matrix's edges by the hardware (no guards). It needs N % 8 == 0 (a row pitch of 16-byte multiples, as
//      any TMA map does); other N take v1's guarded register stores.
//   4. Shared memory: 4 stages x (16 KB of x + 32 KB of W) + 2 consumers x 2 x 8 KB of output = 224 KB
//      (+ 1 KB for alignment) of the 227 KB a block may have.
//
// The phases are v1's, with `step` (every K step this block has consumed, over all its tiles) in place of k:
// stage step % 4, round step / 4, full waited with parity round & 1, empty with (round & 1) ^ 1.
//
// Step 8, the gated MLP (gated_mlp_wgmma, README "The gated MLP in the GEMM's epilogue"): the same kernel with
// kGated. The MLP's act = silu(x Wg^T) * (x Wu^T) needs, for each output column j, gate column j and up column j,
// which the packed weight [gate; up] keeps I rows apart. So a gated tile's 256 W rows are TWO TMA boxes of 128
// rows: gate rows j0 .. j0 + 127 (map_w) into the stage's first half, the same rows of the up half (map_w2) into
// its second. The MMAs do not change; wgmma's accumulator layout then puts column c and column c + 128 of the
// tile in the same thread (registers r and r + 64, accumulator_position), so each thread turns its gate and up
// sums into act in registers, and the tile stores 128 columns of act: the [T, 2I] product is never written.
#include <cuda_bf16.h>

#include <algorithm>
#include <string>

#include "common/cuda_utils.cuh"  // bf16_bits_to_f32, f32_to_bf16_bits
#include "common/errors.h"
#include "hopper.cuh"
#include "hopper.h"
#include "tensor_map.h"

namespace tvllm {
namespace {

constexpr int kConsumers = 2;                     // consumer warpgroups, 64 rows of the tile each
constexpr int kThreads = 128 * (1 + kConsumers);  // + the producer warpgroup
constexpr uint32_t kStageBytesX = kGemm2BlockM * kGemm2BlockK * 2;  // 16 KB: 128 rows of 128 bytes
constexpr uint32_t kStageBytesW = kGemm2BlockN * kGemm2BlockK * 2;  // 32 KB: 256 rows of 128 bytes
constexpr int kOutCols = 64;                                        // one chunk of the epilogue: 64 x 64
constexpr uint32_t kOutChunkBytes = 64 * kOutCols * 2;              // 8 KB, 128-byte swizzled
constexpr int kOutBuffers = 2;                                      // per consumer: fill one, store the other
constexpr int kSmemBytes = kGemm2Stages * (kStageBytesX + kStageBytesW) +
                           kConsumers * kOutBuffers * kOutChunkBytes + kSwizzleAtomBytes;  // + alignment
static_assert(kSmemBytes <= 227 * 1024, "a block may use at most 227 KB of shared memory");
constexpr int kProducerRegisters = 40, kConsumerRegisters = 232;
static_assert(128 * kProducerRegisters + 128 * kConsumers * kConsumerRegisters <= 65536,
              "the warpgroups' registers must fit in the SM's register file");
static_assert(kGemm2BlockM == 64 * kConsumers && kGemm2BlockN == 256 && kGemm2BlockK == 64,
              "the kernel is written for 2 x m64n256k16 per K slice of 16, four slices per stage");
constexpr int kAccumulators = kGemm2BlockN / 2;  // 128 floats per consumer thread: 64 x 256 over 128 threads
constexpr int kChunkRegisters = kOutCols / 2;    // 32 of them per 64-column chunk (8 slices of 4)
constexpr int kGatedCols = kGemm2BlockN / 2;     // a gated tile's act columns: 128 gate + their 128 up rows
constexpr int kUpRegisters = kAccumulators / 2;  // register r's up partner: r + 64 (column + 128)

// act = silu(gate) * up from the two fp32 sums, rounded where lesson 08's unfused path rounds: the GEMM stores
// gate and up as bf16, silu_mul (silu_mul.cu) rounds silu(gate) to bf16 and the caller rounds the product.
__device__ __forceinline__ float silu_times_up(float gate_sum, float up_sum) {
  const float g = bf16_bits_to_f32(f32_to_bf16_bits(gate_sum));
  const float u = bf16_bits_to_f32(f32_to_bf16_bits(up_sum));
  return bf16_bits_to_f32(f32_to_bf16_bits(g / (1.0f + expf(-g)))) * u;
}

// kGated = false: y [m, n] = x W^T (map_w: W [n, k] in boxes of 256 rows; map_w2 unused).
// kGated = true:  y [m, n] = act, n = I (map_w: W's gate half [I, k], map_w2: its up half, boxes of 128 rows).
template <bool kGated>
__global__ void __launch_bounds__(kThreads, 1)
    gemm_wgmma_v2_kernel(const __grid_constant__ CUtensorMap map_x, const __grid_constant__ CUtensorMap map_w,
                         const __grid_constant__ CUtensorMap map_w2, const __grid_constant__ CUtensorMap map_y,
                         bool tma_store, __nv_bfloat16* y, int m, int n, int k) {
#if TVLLM_HOPPER_DEVICE
  constexpr int kTileCols = kGated ? kGatedCols : kGemm2BlockN;  // output columns per tile
  extern __shared__ unsigned char smem_raw[];
  __shared__ uint64_t full[kGemm2Stages], empty[kGemm2Stages];
  // Every region starts on a 1024-byte boundary (the 128-byte swizzle's period): each size is a multiple.
  unsigned char* smem = align_to_swizzle_atom(smem_raw);
  unsigned char* stage_x = smem;                                   // kGemm2Stages x [128 rows][64 K] bf16
  unsigned char* stage_w = stage_x + kGemm2Stages * kStageBytesX;  // kGemm2Stages x [256 rows][64 K] bf16
  unsigned char* out = stage_w + kGemm2Stages * kStageBytesW;      // [consumer][buffer] x [64][64] bf16

  const int warpgroup = threadIdx.x / 128;
  const int k_tiles = k / kGemm2BlockK;
  const uint32_t tiles_m = (static_cast<uint32_t>(m) + kGemm2BlockM - 1) / kGemm2BlockM;  // m < 2^31: no
  const uint32_t tiles_n = (static_cast<uint32_t>(n) + kTileCols - 1) / kTileCols;  // overflow
  const uint32_t tiles = tiles_m * tiles_n;  // < 2^31: the host checks

  if (threadIdx.x == 0) {
    prefetch_tensor_map(&map_x);
    prefetch_tensor_map(&map_w);
    if (kGated) prefetch_tensor_map(&map_w2);
    if (tma_store) prefetch_tensor_map(&map_y);
    for (int s = 0; s < kGemm2Stages; ++s) {
      mbarrier_init(&full[s], 1);
      mbarrier_init(&empty[s], 128 * kConsumers);
    }
    fence_barrier_init();
  }
  __syncthreads();  // the last block-wide barrier; from here on: mbarriers, and named barriers per consumer

  if (warpgroup == 0) {
    // ---- the producer: every K step of every tile of this block, into the ring ---------------------------
    setmaxnreg_dec<kProducerRegisters>();
    if (threadIdx.x == 0) {
      uint32_t step = 0;
      for (uint32_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const GemmTile at = grouped_tile(tile, tiles_m, tiles_n, kGemm2GroupM);
        const int m0 = static_cast<int>(at.m) * kGemm2BlockM, n0 = static_cast<int>(at.n) * kTileCols;
        for (int kt = 0; kt < k_tiles; ++kt, ++step) {
          const RingSlot slot = ring_slot(step, kGemm2Stages);
          const uint32_t s = slot.stage;
          mbarrier_wait(&empty[s], slot.empty_parity);
          // The FULL boxes' bytes, even where a box hangs past M or N: TMA counts the zeros it writes too.
          mbarrier_arrive_expect_tx(&full[s], kStageBytesX + kStageBytesW);
          tma_load_2d(stage_x + s * kStageBytesX, &map_x, kt * kGemm2BlockK, m0, &full[s]);
          if constexpr (kGated) {  // gate rows n0.. into rows 0-127, the same up rows into rows 128-255
            tma_load_2d(stage_w + s * kStageBytesW, &map_w, kt * kGemm2BlockK, n0, &full[s]);
            tma_load_2d(stage_w + s * kStageBytesW + kStageBytesW / 2, &map_w2, kt * kGemm2BlockK, n0, &full[s]);
          } else {
            tma_load_2d(stage_w + s * kStageBytesW, &map_w, kt * kGemm2BlockK, n0, &full[s]);
          }
        }
      }
    }
    return;
  }

  // ---- the consumers --------------------------------------------------------------------------------------
  setmaxnreg_inc<kConsumerRegisters>();
  const int consumer = warpgroup - 1;   // rows consumer * 64 .. + 63 of each tile
  const int t = threadIdx.x % 128;      // this thread in its warpgroup
  const int barrier_id = 1 + consumer;  // this warpgroup's named barrier (0 is __syncthreads')
  unsigned char* my_out = out + consumer * kOutBuffers * kOutChunkBytes;
  float acc[kAccumulators];
#pragma unroll
  for (int i = 0; i < kAccumulators; ++i) acc[i] = 0.0f;  // defined values; each tile's first MMA overwrites
  uint32_t step = 0;
  uint32_t stores = 0;  // TMA stores this warpgroup has issued: chunk buffer stores % 2

  for (uint32_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const GemmTile at = grouped_tile(tile, tiles_m, tiles_n, kGemm2GroupM);
    const int m0 = static_cast<int>(at.m) * kGemm2BlockM + consumer * 64;  // this warpgroup's first row
    const int n0 = static_cast<int>(at.n) * kTileCols;

    for (int kt = 0; kt < k_tiles; ++kt, ++step) {
      const RingSlot slot = ring_slot(step, kGemm2Stages);
      const uint32_t s = slot.stage;
      mbarrier_wait(&full[s], slot.full_parity);
      const uint32_t a = smem_address(stage_x + s * kStageBytesX + consumer * 64 * kSwizzleBytes);
      const uint32_t b = smem_address(stage_w + s * kStageBytesW);
      wgmma_fence();  // also orders the last tile's epilogue reads of acc before these MMAs overwrite it
#pragma unroll
      for (int k16 = 0; k16 < kGemm2BlockK / 16; ++k16)
        // The tile's very first MMA has "scale D" off: D = A B^T, the previous tile's sums are dropped.
        wgmma_m64n256k16(acc, sw128_kmajor_descriptor(a, k16), sw128_kmajor_descriptor(b, k16),
                         kt > 0 || k16 > 0);
      wgmma_commit_group();
      wgmma_wait_group<1>();  // the previous step's MMAs are done: hand its stage back
      if (kt > 0) mbarrier_arrive(&empty[(step - 1) % kGemm2Stages]);
    }
    wgmma_wait_group<0>();
    fence_accumulators(acc);
    mbarrier_arrive(&empty[(step - 1) % kGemm2Stages]);  // the tile's last stage; the producer is already
                                                         // loading the next tile into the free ones

    if (m0 >= m) continue;  // this warpgroup's 64 rows are all past M (e.g. M = 1): nothing to store

    if (tma_store) {
      // ---- epilogue: registers -> swizzled shared chunk -> TMA store, 64 columns at a time ---------------
#pragma unroll
      for (int c = 0; c < kTileCols / kOutCols; ++c) {
        if (n0 + c * kOutCols < n) {  // the same for the whole warpgroup: chunks past N are skipped
          unsigned char* chunk = my_out + (stores % kOutBuffers) * kOutChunkBytes;
          // The store issued two chunks ago read this buffer: wait until it has (only its issuer can ask),
          // then let the warpgroup write.
          if (t == 0) bulk_wait_group_read<kOutBuffers - 1>();
          named_barrier_sync(barrier_id, 128);
#pragma unroll
          for (int i = 0; i < kChunkRegisters; i += 2) {
            const int r = c * kChunkRegisters + i;  // registers r, r + 1: columns col, col + 1 of one row
            const FragmentPosition p = accumulator_position(t, r);
            // Gated: registers r, r + 1 are gate columns, r + 64, r + 65 the same columns' up sums.
            const float v0 = kGated ? silu_times_up(acc[r], acc[r + kUpRegisters]) : acc[r];
            const float v1 = kGated ? silu_times_up(acc[r + 1], acc[r + 1 + kUpRegisters]) : acc[r + 1];
            // A warp's 32 stores of one i: 8 rows x 4 column pairs of one 16-byte chunk; the swizzle sends
            // the 8 rows to 8 different chunks of the 128-byte bank row: all 32 banks, no conflict.
            *reinterpret_cast<__nv_bfloat162*>(chunk + swizzled_offset_bf16(p.row, p.col - c * kOutCols)) =
                __floats2bfloat162_rn(v0, v1);
          }
          fence_proxy_async_shared();           // my writes, visible to the TMA unit ...
          named_barrier_sync(barrier_id, 128);  // ... once all 128 threads have written theirs
          if (t == 0) {
            tma_store_2d(&map_y, chunk, n0 + c * kOutCols, m0);  // rows past M, columns past N: clipped
            bulk_commit_group();
          }
          ++stores;
        }
      }
    } else if constexpr (!kGated) {  // (gated_mlp_wgmma requires I % 8 == 0: always the TMA store)
      // ---- epilogue for N % 8 != 0: v1's guarded stores straight from the registers ---------------------
      const bool pairs = n % 2 == 0;
#pragma unroll
      for (int i = 0; i < kAccumulators; i += 2) {
        const FragmentPosition p = accumulator_position(t, i);
        const int row = m0 + static_cast<int>(p.row);
        const int col = n0 + static_cast<int>(p.col);
        if (row >= m || col >= n) continue;
        __nv_bfloat16* o = y + static_cast<int64_t>(row) * n + col;
        if (pairs) {
          *reinterpret_cast<__nv_bfloat162*>(o) = __floats2bfloat162_rn(acc[i], acc[i + 1]);
        } else {
          o[0] = __float2bfloat16_rn(acc[i]);
          if (col + 1 < n) o[1] = __float2bfloat16_rn(acc[i + 1]);
        }
      }
    }
  }
  // The block's shared memory lives until its last thread exits: the issuer stays until its stores are done.
  if (tma_store && t == 0) bulk_wait_group<0>();
#else
  (void)map_x, (void)map_w, (void)map_w2, (void)map_y, (void)tma_store, (void)y, (void)m, (void)n, (void)k;
#endif
}

// The current device's SM count (a cheap, cached attribute query; any value would be correct, only the
// grid's size depends on it).
int multiprocessors() {
  int device = 0, sms = 0;
  TVLLM_CUDA_CHECK(cudaGetDevice(&device));
  TVLLM_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return std::max(sms, 1);
}

// The launch both entry points share: a persistent grid (one block per SM: the shared memory allows no second),
// never more blocks than tiles.
template <bool kGated>
void launch_v2(const CUtensorMap& map_x, const CUtensorMap& map_w, const CUtensorMap& map_w2, const CUtensorMap& map_y,
               bool tma_store, const TensorView& y, int64_t m, int64_t n, int64_t k, int64_t tiles,
               cudaStream_t stream) {
  TVLLM_CUDA_CHECK(cudaFuncSetAttribute(gemm_wgmma_v2_kernel<kGated>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        kSmemBytes));
  const int64_t grid = std::min<int64_t>(tiles, multiprocessors());
  gemm_wgmma_v2_kernel<kGated><<<static_cast<unsigned>(grid), kThreads, kSmemBytes, stream>>>(
      map_x, map_w, map_w2, map_y, tma_store, y.ptr<__nv_bfloat16>(), static_cast<int>(m), static_cast<int>(n),
      static_cast<int>(k));
  TVLLM_CHECK_LAUNCH();
}

}  // namespace

void gemm_wgmma_v2(const TensorView& y, const TensorView& x, const TensorView& w, cudaStream_t stream) {
  check_gemm_wgmma_args(y, x, w);
  require_hopper("gemm_wgmma_v2");
  const int64_t m = x.dim(0), k = x.dim(1), n = w.dim(0);
  const int64_t tiles = ((m + kGemm2BlockM - 1) / kGemm2BlockM) * ((n + kGemm2BlockN - 1) / kGemm2BlockN);
  TVLLM_REQUIRE(tiles < (int64_t{1} << 31),
                "gemm_wgmma_v2: " + std::to_string(tiles) + " output tiles, more than 2^31 - 1");
  const CUtensorMap map_x =
      make_tensor_map_bf16_2d(x.data, m, k, k * 2, kGemm2BlockM, kGemm2BlockK, TmaSwizzle::B128);
  const CUtensorMap map_w =
      make_tensor_map_bf16_2d(w.data, n, k, k * 2, kGemm2BlockN, kGemm2BlockK, TmaSwizzle::B128);
  // The output map: 64 x 64 boxes (one epilogue chunk: 128-byte rows, the swizzle the chunk is written in).
  // TMA needs a row pitch of a multiple of 16 bytes: N % 8 == 0. Otherwise the kernel stores from registers
  // and never reads the (empty) map.
  const bool tma_store = n % 8 == 0;
  const CUtensorMap map_y = tma_store
                                ? make_tensor_map_bf16_2d(y.data, m, n, n * 2, 64, kOutCols, TmaSwizzle::B128)
                                : CUtensorMap{};
  launch_v2<false>(map_x, map_w, CUtensorMap{}, map_y, tma_store, y, m, n, k, tiles, stream);
}

void gated_mlp_wgmma(const TensorView& act, const TensorView& x, const TensorView& w_gate_up, cudaStream_t stream) {
  check_gated_mlp_args(act, x, w_gate_up);
  require_hopper("gated_mlp_wgmma");
  const int64_t m = x.dim(0), k = x.dim(1), i = act.dim(1);
  const int64_t tiles = ((m + kGemm2BlockM - 1) / kGemm2BlockM) * ((i + kGatedCols - 1) / kGatedCols);
  TVLLM_REQUIRE(tiles < (int64_t{1} << 31),
                "gated_mlp_wgmma: " + std::to_string(tiles) + " output tiles, more than 2^31 - 1");
  const CUtensorMap map_x =
      make_tensor_map_bf16_2d(x.data, m, k, k * 2, kGemm2BlockM, kGemm2BlockK, TmaSwizzle::B128);
  // Two views of the packed weight, each [I, K]: its gate rows and its up rows (I * K * 2 bytes further on, a
  // multiple of 16 since K is). A box that hangs past row I reads TMA's zeros, never the other half.
  const auto* gate = static_cast<const unsigned char*>(w_gate_up.data);
  const CUtensorMap map_gate =
      make_tensor_map_bf16_2d(gate, i, k, k * 2, kGatedCols, kGemm2BlockK, TmaSwizzle::B128);
  const CUtensorMap map_up =
      make_tensor_map_bf16_2d(gate + i * k * 2, i, k, k * 2, kGatedCols, kGemm2BlockK, TmaSwizzle::B128);
  const CUtensorMap map_act = make_tensor_map_bf16_2d(act.data, m, i, i * 2, 64, kOutCols, TmaSwizzle::B128);
  launch_v2<true>(map_x, map_gate, map_up, map_act, true, act, m, i, k, tiles, stream);
}

}  // namespace tvllm
