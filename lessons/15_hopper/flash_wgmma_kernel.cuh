// Lesson 15, steps 5 and 6: the flash attention kernel on wgmma + TMA, one template for every variant of
// FlashConfig (flash_wgmma.h). README.md, "Step 5: flash attention on wgmma" and "Step 6: making it fast";
// flash_wgmma.cu launches it. Include from that .cu only. C++17.
//
// Block (query tile, head, sequence): block_m = 64 * kConsumers query rows, 128 * (1 + kConsumers) threads:
//
//   warpgroup 0, PRODUCER: one thread loads the Q tile once (TMA), then walks the block's K/V tiles and,
//     per tile, waits for a free stage of the ring (empty[s]) and has TMA copy the K tile (signalling
//     k_full[s]) and the V tile (v_full[s]). K and V have barriers of their own so that S = Q K^T can
//     start while V is still on its way.
//   warpgroups 1 .. kConsumers, CONSUMERS: 64 query rows each, the same K/V tiles. Per tile:
//       wait k_full[s]  S[64 x 128] = Q K^T          wgmma m64n128k16, head_dim/16 of them, both from smem
//                       scale, mask (diagonal and window tiles only), online softmax, all in registers on
//                       the accumulator layout (hopper_layout.h): a row's 128 scores are spread over the
//                       4 threads of a quad, 32 each, so a row max or sum is 2 shuffles
//                       P = exp2(S - m) rounded to bf16 and packed: the A fragment of P V, no data moved
//       wait v_full[s]  O[64 x D] += P V             wgmma m64nDk16 with A = P from REGISTERS and B = V
//                                                    from smem read MN-major ("transposed")
//       arrive empty[s] (the stage may be refilled)
//   and at the end O / l, rounded to bf16, stored straight from the registers (rows past q_len skipped).
//
// kOverlap (intra-warpgroup overlap) reorders a consumer's loop so that its tensor-core work and its softmax
// run at the same time: in iteration j it issues S_j = Q K_j^T AND O += P_{j-1} V_{j-1} as two groups, then
// waits only for the first (wait_group 1) and does softmax j while P V j-1 still runs:
//
//   prologue   S_0; wait; softmax 0 -> P_0
//   j = 1..    issue S_j, issue P_{j-1} V_{j-1}  |  wait S_j; softmax j  |  wait P V; release stage j-1;
//              rescale O by alpha_j; P_j -> bf16
//   epilogue   issue P_last V_last; wait; release
//
// It costs registers: S_j (64 floats) and P_{j-1} (32 packed) are alive together with O.
//
// kPingPong: the consumers take strict turns at ISSUING their wgmma groups, passing a token round a ring
// of named barriers (consumer c waits on barrier 1 + c and hands to 1 + (c + 1) % kConsumers): while one
// consumer's GEMMs run, the others do softmax. Consumer 0 goes first (the last consumer hands it the token
// at the start); the last consumer's very last hand-over is skipped, as nobody waits for it. Every consumer
// of a block has the same number of turns (the same tiles): 2 per tile, or tiles + 1 with kOverlap.
//
// Shared memory, every piece on a 1024-byte boundary (the 128-byte swizzle's period): a tile of R rows and
// head_dim columns is head_dim / 64 "sub-tiles" of [R rows][64 columns], one TMA box each, because a
// 128-byte swizzled row holds 64 bf16.
//   Q            D/64 sub-tiles of block_m rows        16 / 32 KB (head_dim 64 / 128) at 128 rows, 24 / 48 at
//   192 K, V stages  stages x D/64 sub-tiles of 128 rows   4 x 16 KB / 2 x 32 KB, each
#pragma once

#include <cuda_bf16.h>

#include "flash_paged.h"
#include "flash_wgmma.h"
#include "hopper.cuh"
#include "hopper_layout.h"

namespace tvllm {
namespace flash_detail {

constexpr uint32_t kKvSubTileBytes = kFlashBlockN * kSwizzleBytes;  // [128 keys][64 bf16]: 16 KB

// Registers per thread after setmaxnreg, per number of consumer warpgroups. The SM has 65536; the block's
// warpgroups must fit: 128 x producer + 128 x consumers x consumer <= 65536. BUT ptxas compiles the whole
// kernel for the launch's count (65536 / threads: 168 at 384 threads, 128 at 512): the consumers' code never
// uses more, whatever setmaxnreg says (ptxas -v: spills and "wgmma serialized" where a variant needs more;
// README.md, "Step 6"). setmaxnreg stays: it is what the hardware needs if ptxas ever uses the room.
//   2 consumers (384 threads, launched at 168): 40 + 2 x 232  -> 64512
//   3 consumers (512 threads, launched at 128): 32 + 3 x 160  -> 65536
//   1 consumer (256 threads, TWO blocks per SM, launched at 128): no setmaxnreg; 2 x 256 x 128 -> 65536
template <int kConsumers>
struct FlashRegisters {
  static constexpr int blocks_per_sm = kConsumers == 1 ? 2 : 1;  // __launch_bounds__'s minimum
  static constexpr bool shift = kConsumers > 1;                  // whether setmaxnreg moves registers
  static constexpr int launched = 65536 / (blocks_per_sm * 128 * (1 + kConsumers)) / 8 * 8;
  static constexpr int producer = kConsumers == 2 ? 40 : kConsumers == 3 ? 32 : launched;
  static constexpr int consumer = kConsumers == 2 ? 232 : kConsumers == 3 ? 160 : launched;
  static_assert(kConsumers >= 1 && kConsumers <= 3, "1, 2 or 3 consumer warpgroups");
  static_assert(blocks_per_sm * 128 * (producer + kConsumers * consumer) <= 65536,
                "the warpgroups' registers must fit in the SM's register file");
  // setmaxnreg may only move registers the block was launched with: each warpgroup starts at the launch's
  // per-thread count (65536 / threads, rounded down to 8), dec lowers it, inc raises it.
  static_assert(producer <= launched && consumer >= launched,
                "the producer gives registers back, the consumers take them");
};

struct FlashWgmmaParams {
  __nv_bfloat16* out;
  int64_t out_stride;           // elements between rows of out
  const int32_t* cu_seqlens_q;  // [B+1] device
  const int32_t* cu_seqlens_k;
  int group;         // query heads per kv head
  int window;        // 0 = none
  float scale_log2;  // 1/sqrt(D) * log2(e): scores in base-2 units, exp becomes exp2
  int heads_inner;   // FlashOrder::HeadsInner: blockIdx.x = head, blockIdx.y = query tile
  // The paged KV policy only (kPaged; flash_paged.h): keys and values come from lesson 12's pool through the
  // sequences' block tables, and map_k / map_v describe one layer's pool as [num_blocks * block_size rows,
  // kv_dim] with boxes of flash_paged_box_rows(block_size) rows.
  const int32_t* block_tables = nullptr;  // [B][table_stride] device
  int64_t table_stride = 0;
  int block_shift = 0;  // log2(block_size)
};

#if TVLLM_HOPPER_DEVICE
// P V with BOTH operands from shared memory (kPSmem): A = P [64 rows][128 keys] K-major (swizzled like Q),
// B = V MN-major ("transposed", the last immediate 1) as in the register form. D[64 x N] += A B; N = 64 or
// 128. The immediates after the predicate (scale D: always accumulate here): scale A, scale B, transpose A
// (no: P is K-major), transpose B (yes). (hopper.cuh's wgmma_m64n128k16 is the same instruction with B
// K-major; these live here, flash's own.)
#define TVLLM_FLASH_D8(d, i)                                                                  \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7])
#define TVLLM_FLASH_D32(d) \
  TVLLM_FLASH_D8(d, 0), TVLLM_FLASH_D8(d, 8), TVLLM_FLASH_D8(d, 16), TVLLM_FLASH_D8(d, 24)
__device__ __forceinline__ void wgmma_m64n64k16_ss_tb(float (&d)[32], uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "{\n"
      "  .reg .pred p;\n"
      "  setp.ne.b32 p, %34, 0;\n"
      "  wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16\n"
      "  {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,\n"
      "   %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31},\n"
      "  %32, %33, p, 1, 1, 0, 1;\n"
      "}\n"
      : TVLLM_FLASH_D32(d)
      : "l"(desc_a), "l"(desc_b), "r"(1));
}
__device__ __forceinline__ void wgmma_m64n128k16_ss_tb(float (&d)[64], uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "{\n"
      "  .reg .pred p;\n"
      "  setp.ne.b32 p, %66, 0;\n"
      "  wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16\n"
      "  {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,\n"
      "   %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,\n"
      "   %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,\n"
      "   %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63},\n"
      "  %64, %65, p, 1, 1, 0, 1;\n"
      "}\n"
      : TVLLM_FLASH_D32(d), TVLLM_FLASH_D8(d, 32), TVLLM_FLASH_D8(d, 40), TVLLM_FLASH_D8(d, 48),
        TVLLM_FLASH_D8(d, 56)
      : "l"(desc_a), "l"(desc_b), "r"(1));
}
#undef TVLLM_FLASH_D32
#undef TVLLM_FLASH_D8

// 2^x in one instruction (MUFU.EX2): relative error ~2^-22, results below 2^-126 flushed to 0, 2^-inf = 0.
// exp2f() adds range handling for denormal results around it, which P (rounded to bf16 next) does not need.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
#endif

// kPSmem (with kOverlap only): P goes through shared memory (one [64 x 128] bf16 tile per consumer, 16 KB,
// swizzled like Q) and P V reads both operands from there, so P's 32 registers are not alive beside S and O
// while the next S and this P V run: the overlap fits in fewer registers, for 32 stores per thread per tile.
// kPaged (flash_paged.h): K and V tiles are gathered from lesson 12's paged pool, one TMA box per cache block
// (the producer), and the rows of a sequence's last tile past its last key are zeroed before P V reads them
// (the consumers). Everything else is the same code: the contiguous instantiations compile exactly as before.
template <int D, int kConsumers, bool kOverlap, bool kPingPong, bool kPSmem, bool kPaged = false>
__global__ void __launch_bounds__(128 * (1 + kConsumers), FlashRegisters<kConsumers>::blocks_per_sm)
    flash_wgmma_kernel(const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_k,
                       const __grid_constant__ CUtensorMap map_v, const FlashWgmmaParams p) {
#if TVLLM_HOPPER_DEVICE
  using Registers = FlashRegisters<kConsumers>;
  constexpr int kBlockM = 64 * kConsumers;
  constexpr int kStages = flash_wgmma_stages(D, kBlockM);
  constexpr int kSub = D / 64;                                  // sub-tiles per tile
  constexpr uint32_t kQSubTileBytes = kBlockM * kSwizzleBytes;  // [block_m rows][64 bf16]
  constexpr uint32_t kQTileBytes = kSub * kQSubTileBytes;
  constexpr uint32_t kKvTileBytes = kSub * kKvSubTileBytes;  // one K or V tile
  static_assert(kQSubTileBytes % kSwizzleAtomBytes == 0, "every sub-tile starts on the swizzle's period");
  static_assert(kOverlap || !kPSmem, "P in shared memory is a variant of the overlapped loop");
  constexpr uint32_t kPSubTileBytes = 64 * kSwizzleBytes;  // [64 rows][64 keys] bf16: 8 KB
  constexpr uint32_t kPTileBytes = kFlashBlockN / 64 * kPSubTileBytes;
  extern __shared__ unsigned char smem_raw[];
  __shared__ uint64_t q_full, k_full[kStages], v_full[kStages], empty[kStages];
  unsigned char* smem = align_to_swizzle_atom(smem_raw);
  unsigned char* tile_q = smem;
  unsigned char* tiles_k = smem + kQTileBytes;  // stage s at + s * kKvTileBytes
  unsigned char* tiles_v = tiles_k + kStages * kKvTileBytes;
  unsigned char* tiles_p = tiles_v + kStages * kKvTileBytes;  // kPSmem: consumer c's P at + c * kPTileBytes

  // ---- which queries, which keys: the same for every thread of the block ----------------------------------
  const int b = blockIdx.z;
  const int h = static_cast<int>(p.heads_inner ? blockIdx.x : blockIdx.y);
  const int tile = static_cast<int>(p.heads_inner ? blockIdx.y : blockIdx.x);
  const int n_q_tiles = static_cast<int>(p.heads_inner ? gridDim.y : gridDim.x);
  const int q0 = (n_q_tiles - 1 - tile) * kBlockM;  // the last query tiles first: they see the most keys
  const int q_begin = p.cu_seqlens_q[b], q_len = p.cu_seqlens_q[b + 1] - q_begin;
  if (q0 >= q_len) return;  // a shorter sequence than the longest: the whole block leaves, before any barrier
  const int k_begin = p.cu_seqlens_k[b], k_len = p.cu_seqlens_k[b + 1] - k_begin;
  const FlashTileRange tiles = flash_kv_tiles(q_len, k_len, q0, p.window, kBlockM);
  const int n_tiles = tiles.end - tiles.first;  // >= 1: every real row sees at least itself
  const int warpgroup = threadIdx.x / 128;
  const int consumer = warpgroup - 1;  // the consumers' tile rows 64 * consumer .. + 63

  if (threadIdx.x == 0) {
    prefetch_tensor_map(&map_q);
    prefetch_tensor_map(&map_k);
    prefetch_tensor_map(&map_v);
    mbarrier_init(&q_full, 1);
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(&k_full[s], 1);
      mbarrier_init(&v_full[s], 1);
      mbarrier_init(&empty[s], 128 * kConsumers);
    }
    fence_barrier_init();
  }
  __syncthreads();  // the only block-wide barrier: from here on the warpgroups meet through the mbarriers

  if (warpgroup == 0) {
    // ---- the producer -------------------------------------------------------------------------------------
    if constexpr (Registers::shift) setmaxnreg_dec<Registers::producer>();
    if constexpr (kPaged) {
      // The whole first warp: its lanes read the block table, lane 0 issues the copies.
      if (threadIdx.x < 32) {
        const int kv_col = (h / p.group) * D;
        const int lane = threadIdx.x;
        if (lane == 0) {
          mbarrier_arrive_expect_tx(&q_full, kQTileBytes);
          for (int sub = 0; sub < kSub; ++sub)
            tma_load_2d(tile_q + sub * kQSubTileBytes, &map_q, h * D + 64 * sub, q_begin + q0, &q_full);
        }
        const int32_t* table = p.block_tables + static_cast<int64_t>(b) * p.table_stride;
        const int block_size = 1 << p.block_shift;
        const int box_rows = flash_paged_box_rows(block_size);
        const uint32_t box_bytes = static_cast<uint32_t>(box_rows) * kSwizzleBytes;  // one 64-column box
        for (int i = 0; i < n_tiles; ++i) {
          const RingSlot slot = ring_slot(i, kStages);
          const uint32_t s = slot.stage;
          const int k0 = (tiles.first + i) * kFlashBlockN;
          // Lane j holds the table entry of box j (keys k0 + j * box_rows ..), one coalesced read per tile,
          // done before the wait so that its latency hides behind it. Boxes wholly past the last key are
          // never loaded, and their entries never read (a table row is only table_len long).
          const int boxes = flash_paged_boxes_loaded(k0, k_len, block_size);  // the same in every lane
          const int32_t entry = lane < boxes ? table[(k0 + lane * box_rows) >> p.block_shift] : 0;
          const uint32_t bytes = flash_paged_tile_bytes(k0, k_len, block_size, D);  // what the boxes deliver
          mbarrier_wait(&empty[s], slot.empty_parity);
          if (lane == 0) mbarrier_arrive_expect_tx(&k_full[s], bytes);
          for (int j = 0; j < boxes; ++j) {
            const int32_t e = __shfl_sync(0xffffffffu, entry, j);
            if (lane != 0) continue;
            const auto row = static_cast<int32_t>(flash_paged_box_row(e, k0 + j * box_rows, p.block_shift));
            // The box lands at tile row j * box_rows: a multiple of 8 rows, so of the swizzle's 1024-byte
            // period, and TMA writes it exactly as one 128-row box would have.
            for (int sub = 0; sub < kSub; ++sub)
              tma_load_2d(tiles_k + s * kKvTileBytes + sub * kKvSubTileBytes + j * box_bytes, &map_k,
                          kv_col + 64 * sub, row, &k_full[s]);
          }
          if (lane == 0) mbarrier_arrive_expect_tx(&v_full[s], bytes);
          for (int j = 0; j < boxes; ++j) {
            const int32_t e = __shfl_sync(0xffffffffu, entry, j);
            if (lane != 0) continue;
            const auto row = static_cast<int32_t>(flash_paged_box_row(e, k0 + j * box_rows, p.block_shift));
            for (int sub = 0; sub < kSub; ++sub)
              tma_load_2d(tiles_v + s * kKvTileBytes + sub * kKvSubTileBytes + j * box_bytes, &map_v,
                          kv_col + 64 * sub, row, &v_full[s]);
          }
        }
      }
      return;
    }
    if (threadIdx.x == 0) {
      const int kv_col = (h / p.group) * D;  // grouped-query attention: this head's kv head
      mbarrier_arrive_expect_tx(&q_full, kQTileBytes);
      for (int sub = 0; sub < kSub; ++sub)
        tma_load_2d(tile_q + sub * kQSubTileBytes, &map_q, h * D + 64 * sub, q_begin + q0, &q_full);
      for (int i = 0; i < n_tiles; ++i) {
        const RingSlot slot = ring_slot(i, kStages);
        const uint32_t s = slot.stage;
        const int key_row = k_begin + (tiles.first + i) * kFlashBlockN;
        mbarrier_wait(&empty[s], slot.empty_parity);  // every consumer is done with the stage's last use
        mbarrier_arrive_expect_tx(&k_full[s], kKvTileBytes);
        for (int sub = 0; sub < kSub; ++sub)
          tma_load_2d(tiles_k + s * kKvTileBytes + sub * kKvSubTileBytes, &map_k, kv_col + 64 * sub, key_row,
                      &k_full[s]);
        mbarrier_arrive_expect_tx(&v_full[s], kKvTileBytes);
        for (int sub = 0; sub < kSub; ++sub)
          tma_load_2d(tiles_v + s * kKvTileBytes + sub * kKvSubTileBytes, &map_v, kv_col + 64 * sub, key_row,
                      &v_full[s]);
      }
    }
    return;
  }

  // ---- the consumers --------------------------------------------------------------------------------------
  if constexpr (Registers::shift) setmaxnreg_inc<Registers::consumer>();
  const int t = threadIdx.x % 128;   // this thread in its warpgroup
  const int quad_col = 2 * (t % 4);  // the first of this thread's 2 columns in every 8-column slice
  // This thread's two rows (accumulator registers with (i / 2) % 2 == 0, resp. 1) and their positions.
  const int row0 = 64 * consumer + static_cast<int>(accumulator_position(t, 0).row);
  const int pos0 = k_len - q_len + q0 + row0, pos1 = pos0 + 8;
  const int wg_first_pos = k_len - q_len + q0 + 64 * consumer, wg_last_pos = wg_first_pos + 63;

  float o[D / 2];                     // O [64 x D] of this warpgroup, unnormalised, fp32
  float sc[kFlashBlockN / 2];         // S [64 x 128], then P
  uint32_t pa[kFlashBlockN / 16][4];  // P as bf16 pairs: the A fragments of P V (hopper_layout.h)
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
#pragma unroll
  for (int i = 0; i < kFlashBlockN / 2; ++i) sc[i] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};

  const uint32_t q_addr = smem_address(tile_q) + consumer * 64 * kSwizzleBytes;  // this warpgroup's 64 rows
  mbarrier_wait(&q_full, 0);

  // Ping-pong's token: wait for my turn before issuing, hand over once the groups are committed. A named
  // barrier counts 256 threads: the 128 that wait and the 128 of the previous consumer that arrive.
  int turns_left = kOverlap ? n_tiles + 1 : 2 * n_tiles;
  const auto begin_turn = [&] {
    if constexpr (kPingPong) named_barrier_sync(1 + consumer, 256);
  };
  const auto end_turn = [&] {
    if constexpr (kPingPong) {
      if (--turns_left > 0 || consumer != kConsumers - 1)
        named_barrier_arrive(1 + (consumer + 1) % kConsumers, 256);
    }
  };
  if constexpr (kPingPong) {
    if (consumer == kConsumers - 1) named_barrier_arrive(1, 256);  // consumer 0 starts
  }
  (void)turns_left;

  // S = Q K^T: D/16 steps of K = 16, the first overwriting S (accumulate = false); one committed group.
  const auto issue_qk = [&](uint32_t k_addr) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)  // dims 64.. live in the next sub-tile
      wgmma_m64n128k16(sc, sw128_kmajor_descriptor(q_addr + kk / 4 * kQSubTileBytes, kk % 4),
                       sw128_kmajor_descriptor(k_addr + kk / 4 * kKvSubTileBytes, kk % 4), kk > 0);
    wgmma_commit_group();
  };
  // O += P V: B = V [keys][dims] read as [dims][keys], MN-major; LBO = the next 64 dims' sub-tile. A = P from
  // registers, or (kPSmem) from this consumer's P tile, K-major like Q (keys 64.. in the next sub-tile).
  const uint32_t p_addr = smem_address(tiles_p + consumer * kPTileBytes);
  const auto issue_pv = [&](uint32_t v_addr) {
#pragma unroll
    for (int kk = 0; kk < kFlashBlockN / 16; ++kk) {
      const uint64_t desc_v = sw128_mnmajor_descriptor(v_addr, kKvSubTileBytes, kk);
      if constexpr (kPSmem) {
        const uint64_t desc_p = sw128_kmajor_descriptor(p_addr + kk / 4 * kPSubTileBytes, kk % 4);
        if constexpr (D == 64)
          wgmma_m64n64k16_ss_tb(o, desc_p, desc_v);
        else
          wgmma_m64n128k16_ss_tb(o, desc_p, desc_v);
      } else {
        if constexpr (D == 64)
          wgmma_m64n64k16_rs(o, pa[kk], desc_v);
        else
          wgmma_m64n128k16_rs(o, pa[kk], desc_v);
      }
    }
    wgmma_commit_group();
  };
  // The mask and the online softmax of the tile at key k0 on S's registers: S becomes P (fp32), row_max and
  // row_sum move on, alpha = 2^(m_old - m_new) is what O must be multiplied by before this tile's P V.
  //   mask: register r holds key k0 + 8(r/4) + quad_col + r%2 of row pos0 (r/2 even) or pos1.
  //   As lesson 07: the new max, alpha for what was summed before, and a reference of 0 while a row has
  //   seen only masked keys (so -inf - -inf is never formed). The max is kept in raw score units and the
  //   scale folded into the exponent: p = 2^(s * scale - m * scale), one fused multiply-add per score.
  //   A row's 128 scores sit in one quad of 4 threads: its max is 2 shuffles; its sum stays per thread
  //   (32 columns) until the epilogue.
  const auto softmax = [&](int k0, float(&alpha)[2]) {
    if (flash_tile_needs_mask(k0, wg_first_pos, wg_last_pos, p.window)) {
#pragma unroll
      for (int r = 0; r < kFlashBlockN / 2; ++r) {
        const int key = k0 + 8 * (r / 4) + quad_col + (r % 2);
        const int pos = (r / 2) % 2 == 0 ? pos0 : pos1;
        // A key past k_len belongs to the next sequence (or is TMA's zero fill): never visible.
        if (key >= k_len || !flash_key_visible(key, pos, p.window)) sc[r] = -INFINITY;
      }
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float tile_max = -INFINITY;
#pragma unroll
      for (int j = 0; j < kFlashBlockN / 8; ++j)
        tile_max = fmaxf(tile_max, fmaxf(sc[4 * j + 2 * half], sc[4 * j + 2 * half + 1]));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
      const float m_new = fmaxf(row_max[half], tile_max);
      const float m_ref = m_new == -INFINITY ? 0.0f : m_new * p.scale_log2;  // scaled: base-2 units
      // __fmul_rn: never contracted into an FMA with the subtraction. When the max did not move, old * scale
      // rounds to m_ref exactly and alpha is exactly 2^0 = 1; an FMA would leave the product's rounding error
      // (a few 1e-7) and multiply O by 1 + ulp on every tile that brings no new max, so the bits would depend
      // on how many wholly masked tiles a row's block sweeps (a chunk after a prefix vs the whole prompt).
      alpha[half] = fast_exp2(__fmul_rn(row_max[half], p.scale_log2) - m_ref);  // first tile: 2^-inf = 0
      row_max[half] = m_new;
      float tile_sum = 0.0f;
#pragma unroll
      for (int j = 0; j < kFlashBlockN / 8; ++j) {
        sc[4 * j + 2 * half] = fast_exp2(fmaf(sc[4 * j + 2 * half], p.scale_log2, -m_ref));  // masked: 0
        sc[4 * j + 2 * half + 1] = fast_exp2(fmaf(sc[4 * j + 2 * half + 1], p.scale_log2, -m_ref));
        tile_sum += sc[4 * j + 2 * half] + sc[4 * j + 2 * half + 1];
      }
      row_sum[half] = row_sum[half] * alpha[half] + tile_sum;
    }
  };
  // O *= alpha, row by row. Once a row's max has settled (after the first few tiles, for most rows) alpha is
  // exactly 1 and the D/2 multiplies change nothing: skipped when the whole warp agrees (a vote, so that the
  // warp does not run both paths). x * 1 == x exactly: the same bits either way.
  const auto rescale_o = [&](const float(&alpha)[2]) {
    if (__all_sync(0xffffffffu, alpha[0] == 1.0f && alpha[1] == 1.0f)) return;
#pragma unroll
    for (int r = 0; r < D / 2; ++r) o[r] *= alpha[(r / 2) % 2];
  };
  // P in registers: the A fragment of K step kk is S's registers 8kk .. 8kk + 7 (hopper_layout.h). Or
  // (kPSmem) P as bf16 pairs into the swizzled P tile: registers r, r + 1 are columns c, c + 1 of one row, 4
  // bytes at swizzled_offset_bf16; a warp's 32 stores of one r hit 8 rows x 4 lanes = 8 distinct 16-byte
  // chunks (the swizzle), all 32 banks. Then the async-proxy fence (wgmma reads through it) and a barrier of
  // the warpgroup's 128 threads (named barrier 4 + consumer: 1 .. 3 are ping-pong's), as every thread's
  // stores must land before any warp issues the MMA.
  const auto pack_p = [&] {
    if constexpr (kPSmem) {
      unsigned char* p_tile = tiles_p + consumer * kPTileBytes;
#pragma unroll
      for (int r = 0; r < kFlashBlockN / 2; r += 2) {
        const FragmentPosition f = accumulator_position(t, r);
        *reinterpret_cast<uint32_t*>(p_tile + f.col / 64 * kPSubTileBytes +
                                     swizzled_offset_bf16(f.row, f.col % 64)) = pack_bf16x2(sc[r], sc[r + 1]);
      }
      fence_proxy_async_shared();
      named_barrier_sync(4 + consumer, 128);
    } else {
#pragma unroll
      for (int kk = 0; kk < kFlashBlockN / 16; ++kk)
#pragma unroll
        for (int j = 0; j < 4; ++j)
          pa[kk][j] = pack_bf16x2(sc[accumulator_register_for_a(kk, 2 * j)],
                                  sc[accumulator_register_for_a(kk, 2 * j + 1)]);
    }
  };
  const auto wait_pv = [&](uint32_t s) {  // P V done: O is final for the tile, P and the stage are free
    wgmma_wait_group<0>();
    fence_accumulators(o);
    if constexpr (!kPSmem) {
#pragma unroll
      for (int kk = 0; kk < kFlashBlockN / 16; ++kk) fence_operands(pa[kk]);
    }
    // Every MMA that read stage s has finished: hand it back. (Always AFTER waiting for this round's full
    // barriers: an arrival before the producer has refilled the stage would count towards the previous
    // round's phase, which another warpgroup may not have completed yet.)
    mbarrier_arrive(&empty[s]);
  };
  // kPaged: the rows of a tile past the sequence's last key (keys >= k_len) were never loaded, or loaded from
  // slots of its last block that no step has written: whatever they hold, possibly NaN. P is exactly 0 there
  // (masked), but 0 x NaN is NaN, so before P V reads such a tile (a sequence's last one only) the consumers
  // zero those rows of V, each thread a share of the 16-byte chunks; a whole 128-byte row is zero whatever
  // the swizzle. Then the async-proxy fence (wgmma reads through it) and a barrier of all consumers: every
  // store lands before any warpgroup's P V. Named barrier 1 (ptxas then reserves 2 barriers, not 8), unless
  // ping-pong or P in shared memory use 1 .. 6; then 7. K's rows there need nothing: the mask overwrites S.
  const auto clean_v = [&](uint32_t s, int k0) {
    if constexpr (kPaged) {
      const int valid = k_len - k0;
      if (valid >= kFlashBlockN) return;  // the same for every consumer: all reach the barrier, or none
      const int chunks = (kFlashBlockN - valid) * (kSwizzleBytes / 16);
      for (int sub = 0; sub < kSub; ++sub) {
        unsigned char* rows = tiles_v + s * kKvTileBytes + sub * kKvSubTileBytes + valid * kSwizzleBytes;
        for (int c = 128 * consumer + t; c < chunks; c += 128 * kConsumers)
          *reinterpret_cast<uint4*>(rows + 16 * c) = make_uint4(0u, 0u, 0u, 0u);
      }
      fence_proxy_async_shared();
      named_barrier_sync(kPingPong || kPSmem ? 7 : 1, 128 * kConsumers);
    } else {
      (void)s, (void)k0;
    }
  };
  const auto k_address = [&](uint32_t s) { return smem_address(tiles_k + s * kKvTileBytes); };
  const auto v_address = [&](uint32_t s) { return smem_address(tiles_v + s * kKvTileBytes); };
  const auto first_key = [&](int i) { return (tiles.first + i) * kFlashBlockN; };
  float alpha[2];

  if constexpr (!kOverlap) {
    for (int i = 0; i < n_tiles; ++i) {
      const RingSlot slot = ring_slot(i, kStages);
      const uint32_t s = slot.stage;
      mbarrier_wait(&k_full[s], slot.full_parity);
      begin_turn();
      wgmma_fence();
      issue_qk(k_address(s));
      end_turn();
      wgmma_wait_group<0>();
      fence_accumulators(sc);
      softmax(first_key(i), alpha);
      rescale_o(alpha);
      pack_p();
      mbarrier_wait(&v_full[s], slot.full_parity);
      clean_v(s, first_key(i));
      begin_turn();
      wgmma_fence();  // the rescaled O and the fresh P are written before the tensor cores read them
      issue_pv(v_address(s));
      end_turn();
      wait_pv(s);
    }
  } else {
    // Prologue: S_0 alone, its softmax (O is still 0: no rescale), P_0.
    RingSlot prev = ring_slot(0, kStages);
    mbarrier_wait(&k_full[prev.stage], prev.full_parity);
    begin_turn();
    wgmma_fence();
    issue_qk(k_address(prev.stage));
    end_turn();
    wgmma_wait_group<0>();
    fence_accumulators(sc);
    softmax(first_key(0), alpha);
    pack_p();
    for (int i = 1; i < n_tiles; ++i) {
      const RingSlot slot = ring_slot(i, kStages);
      mbarrier_wait(&k_full[slot.stage], slot.full_parity);
      mbarrier_wait(&v_full[prev.stage], prev.full_parity);
      clean_v(prev.stage, first_key(i - 1));
      begin_turn();
      wgmma_fence();  // S's registers were read by pack_p, O rescaled, P written: all before the MMAs
      issue_qk(k_address(slot.stage));  // group 1: S_i
      issue_pv(v_address(prev.stage));  // group 2: O += P_{i-1} V_{i-1}
      end_turn();
      wgmma_wait_group<1>();  // S_i has landed (groups complete in order); P V may still run
      fence_accumulators(sc);
      softmax(first_key(i), alpha);  // the exponentials overlap P_{i-1} V_{i-1} on the tensor cores
      wait_pv(prev.stage);
      rescale_o(alpha);
      pack_p();
      prev = slot;
    }
    // Epilogue: the last tile's P V.
    mbarrier_wait(&v_full[prev.stage], prev.full_parity);
    clean_v(prev.stage, first_key(n_tiles - 1));
    begin_turn();
    wgmma_fence();
    issue_pv(v_address(prev.stage));
    end_turn();
    wait_pv(prev.stage);
  }

  // ---- the epilogue: O / l as bf16, straight from the registers -------------------------------------------
  float inv[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    row_sum[half] += __shfl_xor_sync(0xffffffffu, row_sum[half], 1);
    row_sum[half] += __shfl_xor_sync(0xffffffffu, row_sum[half], 2);
    inv[half] = row_sum[half] > 0.0f ? 1.0f / row_sum[half] : 0.0f;
  }
  __nv_bfloat16* out =
      p.out + static_cast<int64_t>(q_begin + q0) * p.out_stride + static_cast<int64_t>(h) * D;
#pragma unroll
  for (int r = 0; r < D / 2; r += 2) {
    const FragmentPosition f = accumulator_position(t, r);  // o[r + 1] is the next column
    const int row = 64 * consumer + static_cast<int>(f.row);
    if (q0 + row >= q_len) continue;  // a row of the next sequence (or past the end): not ours
    const float scale = inv[(r / 2) % 2];
    *reinterpret_cast<__nv_bfloat162*>(out + static_cast<int64_t>(row) * p.out_stride + f.col) =
        __floats2bfloat162_rn(o[r] * scale, o[r + 1] * scale);
  }
#else
  (void)map_q, (void)map_k, (void)map_v, (void)p;
#endif
}

// ---- the host side both launchers share (flash_wgmma.cu: contiguous, flash_wgmma_paged.cu: paged) --------
// Once per kernel instantiation (not a stream operation, so fine under graph capture): opt in to the dynamic
// shared memory it needs and take all of the SM's unified L1 / shared memory as shared memory (the 64-row
// variant needs room for two blocks). The kernel is a template argument, not a parameter: every instantiation
// has the same function type, and the static below must be one per kernel.
template <auto kernel>
void flash_opt_in_once(int smem) {
  static const bool opted_in = [&] {
    TVLLM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    TVLLM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                          cudaSharedmemCarveoutMaxShared));
    return true;
  }();
  (void)opted_in;
}

// The parameters that do not depend on where K and V live.
inline FlashWgmmaParams flash_common_params(const TensorView& out, const AttentionBatch& batch,
                                            const AttentionShape& shape, bool heads_inner) {
  FlashWgmmaParams p;
  p.out = out.ptr<__nv_bfloat16>();
  p.out_stride = out.strides[0];
  p.cu_seqlens_q = batch.cu_seqlens_q_device();
  p.cu_seqlens_k = batch.cu_seqlens_k_device();
  p.group = static_cast<int>(shape.group_size());
  p.window = static_cast<int>(shape.window);
  p.scale_log2 = static_cast<float>(shape.scale() * 1.4426950408889634);  // log2(e)
  p.heads_inner = heads_inner ? 1 : 0;
  return p;
}

// One block per (head, query tile of block_m rows, sequence); FlashOrder::HeadsInner puts the heads on x.
inline dim3 flash_grid(const AttentionBatch& batch, const AttentionShape& shape, int block_m, bool heads_inner) {
  const auto q_tiles = static_cast<unsigned>(ceil_div(static_cast<int64_t>(batch.max_q_len()), int64_t{block_m}));
  const auto heads = static_cast<unsigned>(shape.n_heads);
  return dim3(heads_inner ? heads : q_tiles, heads_inner ? q_tiles : heads, static_cast<unsigned>(batch.batch_size()));
}

}  // namespace flash_detail
}  // namespace tvllm
