// Lesson 15, step 5: flash attention on wgmma + TMA. README.md, "Step 5: flash attention on wgmma";
// flash_wgmma.h has the contract and the tiling.
//
// Block (x, h, b): query rows q0 .. q0 + 127 of sequence b, head h (the last query tiles first: they see
// the most keys). 384 threads, three warpgroups, the GEMM's (step 4) division of labour:
//
//   warpgroup 0, PRODUCER: one thread loads the Q tile once (TMA), then walks the block's K/V tiles and,
//     per tile, waits for a free stage of the ring (empty[s]) and has TMA copy the K tile (signalling
//     k_full[s]) and the V tile (v_full[s]). K and V have barriers of their own so that S = Q K^T can
//     start while V is still on its way.
//   warpgroups 1 and 2, CONSUMERS: 64 query rows each, the same K/V tiles. Per tile:
//       wait k_full[s]  S[64 x 128] = Q K^T          wgmma m64n128k16, head_dim/16 of them, both from smem
//                       scale, mask (diagonal and window tiles only), online softmax, all in registers on
//                       the accumulator layout (hopper_layout.h): a row's 128 scores are spread over the
//                       4 threads of a quad, 32 each, so a row max or sum is 2 shuffles
//                       P = exp2(S - m) rounded to bf16 and packed: the A fragment of P V, no data moved
//       wait v_full[s]  O[64 x D] += P V             wgmma m64nDk16 with A = P from REGISTERS and B = V
//                                                    from smem read MN-major ("transposed")
//       arrive empty[s] (the stage may be refilled)
//   and at the end O / l, rounded to bf16, stored straight from the registers (rows past q_len skipped).
// Two schedules (FlashSchedule): the consumers issue their wgmma groups whenever ready (plain), or take
// strict turns (ping-pong, named barriers) so that one's softmax overlaps the other's GEMMs. Further down,
// wgmma_pv_tile_kernel checks the second product's layouts on their own.
//
// Shared memory, every piece on a 1024-byte boundary (the 128-byte swizzle's period): a tile of 128 rows
// and head_dim columns is head_dim / 64 "sub-tiles" of [128 rows][64 columns], one TMA box each, because a
// 128-byte swizzled row holds 64 bf16.
//   Q            D/64 sub-tiles                       16 / 32 KB (head_dim 64 / 128)
//   K, V stages  stages x D/64 sub-tiles, each        4 x 16 KB / 2 x 32 KB, each
#include <cuda_bf16.h>

#include <string>

#include "common/cuda_utils.cuh"  // pack_bf16x2, ceil_div
#include "common/errors.h"
#include "flash_wgmma.h"
#include "hopper.cuh"
#include "hopper.h"
#include "tensor_map.h"

namespace tvllm {
namespace {

constexpr int kFlashThreads = 128 * (1 + kFlashConsumers);
constexpr uint32_t kSubTileBytes = kFlashBlockN * kSwizzleBytes;  // [128 rows][64 bf16]: 16 KB
static_assert(kFlashBlockM == kFlashBlockN, "Q tiles and K/V tiles share the sub-tile size");
static_assert(kFlashBlockM == 64 * kFlashConsumers, "each consumer warpgroup owns 64 query rows");
constexpr int kProducerRegisters = 40, kConsumerRegisters = 232;  // as the GEMM: 64512 of 65536
static_assert(128 * kProducerRegisters + 128 * kFlashConsumers * kConsumerRegisters <= 65536,
              "the warpgroups' registers must fit in the SM's register file");

template <int D>
constexpr int flash_smem_bytes() {
  constexpr int sub = D / 64;
  return static_cast<int>(kSubTileBytes) * sub * (1 + 2 * flash_wgmma_stages(D)) + kSwizzleAtomBytes;
}
static_assert(flash_smem_bytes<128>() <= 227 * 1024, "Hopper gives a block at most 227 KB of shared memory");

struct FlashWgmmaParams {
  __nv_bfloat16* out;
  int64_t out_stride;           // elements between rows of out
  const int32_t* cu_seqlens_q;  // [B+1] device
  const int32_t* cu_seqlens_k;
  int group;         // query heads per kv head
  int window;        // 0 = none
  float scale_log2;  // 1/sqrt(D) * log2(e): scores in base-2 units, exp becomes exp2
};

#if TVLLM_HOPPER_DEVICE
// 2^x in one instruction (MUFU.EX2): relative error ~2^-22, results below 2^-126 flushed to 0, 2^-inf = 0.
// exp2f() adds range handling for denormal results around it, which P (rounded to bf16 next) does not need.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
#endif

// kPingPong (FlashSchedule::PingPong): the two consumers take strict turns at ISSUING their wgmma groups,
// passing a token through two named barriers (ids 1 and 2): consumer 0 issues S = Q K^T, hands over, and
// runs its softmax while consumer 1's S runs on the tensor cores; then consumer 1 hands back, and so on, P V
// likewise. Two turns per tile each; consumer 0 goes first (consumer 1 hands it the token at the start);
// consumer 1's very last hand-over is skipped, as nobody waits for it.
template <int D, bool kPingPong>
__global__ void __launch_bounds__(kFlashThreads, 1)
    flash_wgmma_kernel(const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_k,
                       const __grid_constant__ CUtensorMap map_v, const FlashWgmmaParams p) {
#if TVLLM_HOPPER_DEVICE
  constexpr int kStages = flash_wgmma_stages(D);
  constexpr int kSub = D / 64;                           // sub-tiles per tile
  constexpr uint32_t kTileBytes = kSub * kSubTileBytes;  // one Q, K or V tile
  extern __shared__ unsigned char smem_raw[];
  __shared__ uint64_t q_full, k_full[kStages], v_full[kStages], empty[kStages];
  unsigned char* smem = align_to_swizzle_atom(smem_raw);
  unsigned char* tile_q = smem;
  unsigned char* tiles_k = smem + kTileBytes;  // stage s at + s * kTileBytes
  unsigned char* tiles_v = tiles_k + kStages * kTileBytes;

  // ---- which queries, which keys: the same for every thread of the block ----------------------------------
  const int b = blockIdx.z, h = blockIdx.y;
  const int q0 = (static_cast<int>(gridDim.x) - 1 - static_cast<int>(blockIdx.x)) * kFlashBlockM;
  const int q_begin = p.cu_seqlens_q[b], q_len = p.cu_seqlens_q[b + 1] - q_begin;
  if (q0 >= q_len) return;  // a shorter sequence than the longest: the whole block leaves, before any barrier
  const int k_begin = p.cu_seqlens_k[b], k_len = p.cu_seqlens_k[b + 1] - k_begin;
  const FlashTileRange tiles = flash_kv_tiles(q_len, k_len, q0, p.window);
  const int n_tiles = tiles.end - tiles.first;  // >= 1: every real row sees at least itself
  const int warpgroup = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    prefetch_tensor_map(&map_q);
    prefetch_tensor_map(&map_k);
    prefetch_tensor_map(&map_v);
    mbarrier_init(&q_full, 1);
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(&k_full[s], 1);
      mbarrier_init(&v_full[s], 1);
      mbarrier_init(&empty[s], 128 * kFlashConsumers);
    }
    fence_barrier_init();
  }
  __syncthreads();  // the only block-wide barrier: from here on the warpgroups meet through the mbarriers

  if (warpgroup == 0) {
    // ---- the producer -------------------------------------------------------------------------------------
    setmaxnreg_dec<kProducerRegisters>();
    if (threadIdx.x == 0) {
      const int kv_col = (h / p.group) * D;  // grouped-query attention: this head's kv head
      mbarrier_arrive_expect_tx(&q_full, kTileBytes);
      for (int sub = 0; sub < kSub; ++sub)
        tma_load_2d(tile_q + sub * kSubTileBytes, &map_q, h * D + 64 * sub, q_begin + q0, &q_full);
      for (int i = 0; i < n_tiles; ++i) {
        const RingSlot slot = ring_slot(i, kStages);
        const uint32_t s = slot.stage;
        const int key_row = k_begin + (tiles.first + i) * kFlashBlockN;
        mbarrier_wait(&empty[s], slot.empty_parity);  // both consumers are done with the stage's last use
        mbarrier_arrive_expect_tx(&k_full[s], kTileBytes);
        for (int sub = 0; sub < kSub; ++sub)
          tma_load_2d(tiles_k + s * kTileBytes + sub * kSubTileBytes, &map_k, kv_col + 64 * sub, key_row,
                      &k_full[s]);
        mbarrier_arrive_expect_tx(&v_full[s], kTileBytes);
        for (int sub = 0; sub < kSub; ++sub)
          tma_load_2d(tiles_v + s * kTileBytes + sub * kSubTileBytes, &map_v, kv_col + 64 * sub, key_row,
                      &v_full[s]);
      }
    }
    return;
  }

  // ---- the consumers --------------------------------------------------------------------------------------
  setmaxnreg_inc<kConsumerRegisters>();
  const int consumer = warpgroup - 1;  // tile rows 64 * consumer .. + 63
  const int t = threadIdx.x % 128;     // this thread in its warpgroup
  const int quad_col = 2 * (t % 4);    // the first of this thread's 2 columns in every 8-column slice
  // This thread's two rows (accumulator registers with (i / 2) % 2 == 0, resp. 1) and their positions.
  const int row0 = 64 * consumer + static_cast<int>(accumulator_position(t, 0).row);
  const int pos0 = k_len - q_len + q0 + row0, pos1 = pos0 + 8;
  const int wg_first_pos = k_len - q_len + q0 + 64 * consumer, wg_last_pos = wg_first_pos + 63;

  float o[D / 2];              // O [64 x D] of this warpgroup, unnormalised, fp32
  float sc[kFlashBlockN / 2];  // S [64 x 128], then P
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
#pragma unroll
  for (int i = 0; i < kFlashBlockN / 2; ++i) sc[i] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};

  const uint32_t q_addr = smem_address(tile_q) + consumer * 64 * kSwizzleBytes;  // this warpgroup's 64 rows
  mbarrier_wait(&q_full, 0);

  // Ping-pong's token: wait for my turn before issuing, hand over once the group is committed.
  constexpr int kConsumerThreads = 128 * kFlashConsumers;
  int turns_left = 2 * n_tiles;
  const auto begin_turn = [&] {
    if constexpr (kPingPong) named_barrier_sync(1 + consumer, kConsumerThreads);
  };
  const auto end_turn = [&] {
    if constexpr (kPingPong) {
      if (--turns_left > 0 || consumer == 0) named_barrier_arrive(2 - consumer, kConsumerThreads);
    }
  };
  if constexpr (kPingPong) {
    if (consumer == 1) named_barrier_arrive(1, kConsumerThreads);  // consumer 0 starts
  }

  for (int i = 0; i < n_tiles; ++i) {
    const RingSlot slot = ring_slot(i, kStages);
    const uint32_t s = slot.stage, parity = slot.full_parity;
    const int k0 = (tiles.first + i) * kFlashBlockN;  // the tile's first key, within the sequence
    const uint32_t k_addr = smem_address(tiles_k + s * kTileBytes);
    const uint32_t v_addr = smem_address(tiles_v + s * kTileBytes);

    // ---- S = Q K^T: D/16 steps of K = 16, the first overwriting S (accumulate = false) --------------------
    mbarrier_wait(&k_full[s], parity);
    begin_turn();
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint32_t sub = kk / 4 * kSubTileBytes;  // dims 64.. live in the next sub-tile
      wgmma_m64n128k16(sc, sw128_kmajor_descriptor(q_addr + sub, kk % 4),
                       sw128_kmajor_descriptor(k_addr + sub, kk % 4), kk > 0);
    }
    wgmma_commit_group();
    end_turn();
    wgmma_wait_group<0>();
    fence_accumulators(sc);

    // ---- mask: register r holds key k0 + 8(r/4) + quad_col + r%2 of row pos0 (r/2 even) or pos1 ----------
    const bool needs_mask = flash_tile_needs_mask(k0, wg_first_pos, wg_last_pos, p.window);
    if (needs_mask) {
#pragma unroll
      for (int r = 0; r < kFlashBlockN / 2; ++r) {
        const int key = k0 + 8 * (r / 4) + quad_col + (r % 2);
        const int pos = (r / 2) % 2 == 0 ? pos0 : pos1;
        // A key past k_len belongs to the next sequence (or is TMA's zero fill): never visible.
        if (key >= k_len || !flash_key_visible(key, pos, p.window)) sc[r] = -INFINITY;
      }
    }

    // ---- online softmax on the fragment: a row's 128 scores sit in one quad of 4 threads ---------------
    // As lesson 07: the new max, the factor alpha = 2^(m_old - m_new) for what was summed before, and a
    // reference of 0 while a row has seen only masked keys (so -inf - -inf is never formed). The max is kept
    // in raw score units and the scale folded into the exponent: p = 2^(s * scale - m * scale), one fused
    // multiply-add per score instead of a multiply and a subtraction.
    float alpha[2];
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
      alpha[half] = fast_exp2(row_max[half] * p.scale_log2 - m_ref);         // first tile: 2^-inf = 0
      row_max[half] = m_new;
      float tile_sum = 0.0f;
#pragma unroll
      for (int j = 0; j < kFlashBlockN / 8; ++j) {
        sc[4 * j + 2 * half] = fast_exp2(fmaf(sc[4 * j + 2 * half], p.scale_log2, -m_ref));  // masked: 0
        sc[4 * j + 2 * half + 1] = fast_exp2(fmaf(sc[4 * j + 2 * half + 1], p.scale_log2, -m_ref));
        tile_sum += sc[4 * j + 2 * half] + sc[4 * j + 2 * half + 1];
      }
      // This thread's 32 columns only; the quad adds its four partial sums at the end.
      row_sum[half] = row_sum[half] * alpha[half] + tile_sum;
    }
#pragma unroll
    for (int r = 0; r < D / 2; ++r) o[r] *= alpha[(r / 2) % 2];

    // ---- P in registers: the A fragment of K step kk is S's registers 8kk .. 8kk + 7 (hopper_layout.h) -
    uint32_t pa[kFlashBlockN / 16][4];
#pragma unroll
    for (int kk = 0; kk < kFlashBlockN / 16; ++kk)
#pragma unroll
      for (int j = 0; j < 4; ++j)
        pa[kk][j] = pack_bf16x2(sc[accumulator_register_for_a(kk, 2 * j)],
                                sc[accumulator_register_for_a(kk, 2 * j + 1)]);

    // ---- O += P V: B = V [keys][dims] read as [dims][keys], MN-major; LBO = the next 64 dims' sub-tile
    mbarrier_wait(&v_full[s], parity);
    begin_turn();
    wgmma_fence();  // the rescaled O and the fresh P registers are written before the tensor cores read them
#pragma unroll
    for (int kk = 0; kk < kFlashBlockN / 16; ++kk) {
      if constexpr (D == 64)
        wgmma_m64n64k16_rs(o, pa[kk], sw128_mnmajor_descriptor(v_addr, kSubTileBytes, kk));
      else
        wgmma_m64n128k16_rs(o, pa[kk], sw128_mnmajor_descriptor(v_addr, kSubTileBytes, kk));
    }
    wgmma_commit_group();
    end_turn();
    wgmma_wait_group<0>();
    fence_accumulators(o);
#pragma unroll
    for (int kk = 0; kk < kFlashBlockN / 16; ++kk) fence_operands(pa[kk]);
    // Both MMAs that read stage s have finished: hand it back. (Always AFTER waiting for this round's full
    // barriers: an arrival before the producer has refilled the stage would count towards the previous
    // round's phase, which the other warpgroup may not have completed yet.)
    mbarrier_arrive(&empty[s]);
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

// ---- the second product alone: D [64 x N] = P [64 x 128] V [128 x N], P from registers -------------------
// A diagnostic for step 5's two riskiest layouts, each on its own: the register A fragment (read here
// straight from global memory by a_fragment_position(), not converted from an accumulator) and V's MN-major
// descriptor (V loaded by TMA exactly as the attention kernel loads it).
template <int N>
__global__ void __launch_bounds__(128)
    wgmma_pv_tile_kernel(const __grid_constant__ CUtensorMap map_v, const __nv_bfloat16* p, float* d) {
#if TVLLM_HOPPER_DEVICE
  __shared__ __align__(1024) unsigned char v_tile[N / 64 * kSubTileBytes];  // [128 keys][64 dims] x N/64
  __shared__ uint64_t arrived;
  const int t = threadIdx.x;
  if (t == 0) {
    mbarrier_init(&arrived, 1);
    fence_barrier_init();
  }
  __syncthreads();
  if (t == 0) {
    mbarrier_arrive_expect_tx(&arrived, sizeof(v_tile));
    for (int sub = 0; sub < N / 64; ++sub)
      tma_load_2d(v_tile + sub * kSubTileBytes, &map_v, 64 * sub, 0, &arrived);
  }
  uint32_t pa[kFlashBlockN / 16][4];  // value j of step kk: P [row, 16 kk + col], two bf16 per register
#pragma unroll
  for (int kk = 0; kk < kFlashBlockN / 16; ++kk)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const FragmentPosition f = a_fragment_position(t, 2 * j);  // value 2j + 1 is the next column
      pa[kk][j] = *reinterpret_cast<const uint32_t*>(p + f.row * kFlashBlockN + 16 * kk + f.col);
    }
  float acc[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = 0.0f;
  mbarrier_wait(&arrived, 0);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kFlashBlockN / 16; ++kk) {
    if constexpr (N == 64)
      wgmma_m64n64k16_rs(acc, pa[kk], sw128_mnmajor_descriptor(smem_address(v_tile), kSubTileBytes, kk));
    else
      wgmma_m64n128k16_rs(acc, pa[kk], sw128_mnmajor_descriptor(smem_address(v_tile), kSubTileBytes, kk));
  }
  wgmma_commit_group();
  wgmma_wait_group<0>();
  fence_accumulators(acc);
#pragma unroll
  for (int kk = 0; kk < kFlashBlockN / 16; ++kk) fence_operands(pa[kk]);
#pragma unroll
  for (int i = 0; i < N / 2; ++i) {
    const FragmentPosition f = accumulator_position(t, i);
    d[f.row * N + f.col] = acc[i];
  }
#else
  (void)map_v, (void)p, (void)d;
#endif
}

template <int D, bool kPingPong>
void launch_flash_wgmma(const TensorView& out, const TensorView& q, const TensorView& k, const TensorView& v,
                        const AttentionBatch& batch, const AttentionShape& shape, cudaStream_t stream) {
  constexpr int smem = flash_smem_bytes<D>();
  static const bool opted_in = [] {  // once per instantiation; not a stream operation (fine under capture)
    TVLLM_CUDA_CHECK(cudaFuncSetAttribute(flash_wgmma_kernel<D, kPingPong>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    return true;
  }();
  (void)opted_in;
  // One map per operand over its whole packed matrix: the kernel names (column of the head, first row).
  const CUtensorMap map_q = make_tensor_map_bf16_2d(q.data, batch.total_q(), shape.q_dim(), q.strides[0] * 2,
                                                    kFlashBlockM, 64, TmaSwizzle::B128);
  const CUtensorMap map_k = make_tensor_map_bf16_2d(k.data, batch.total_k(), shape.kv_dim(), k.strides[0] * 2,
                                                    kFlashBlockN, 64, TmaSwizzle::B128);
  const CUtensorMap map_v = make_tensor_map_bf16_2d(v.data, batch.total_k(), shape.kv_dim(), v.strides[0] * 2,
                                                    kFlashBlockN, 64, TmaSwizzle::B128);
  FlashWgmmaParams p;
  p.out = out.ptr<__nv_bfloat16>();
  p.out_stride = out.strides[0];
  p.cu_seqlens_q = batch.cu_seqlens_q_device();
  p.cu_seqlens_k = batch.cu_seqlens_k_device();
  p.group = static_cast<int>(shape.group_size());
  p.window = static_cast<int>(shape.window);
  p.scale_log2 = static_cast<float>(shape.scale() * 1.4426950408889634);  // log2(e)
  const dim3 grid(
      static_cast<unsigned>(ceil_div(static_cast<int64_t>(batch.max_q_len()), int64_t{kFlashBlockM})),
      static_cast<unsigned>(shape.n_heads), static_cast<unsigned>(batch.batch_size()));
  flash_wgmma_kernel<D, kPingPong><<<grid, kFlashThreads, smem, stream>>>(map_q, map_k, map_v, p);
  TVLLM_CHECK_LAUNCH();
}

}  // namespace

bool flash_wgmma_supports(const AttentionShape& shape) {
  return shape.head_dim == 64 || shape.head_dim == 128;
}

void check_flash_wgmma_args(const TensorView& out, const TensorView& q, const TensorView& k,
                            const TensorView& v, int64_t total_q, int64_t total_k,
                            const AttentionShape& shape) {
  shape.validate();
  TVLLM_REQUIRE(flash_wgmma_supports(shape),
                "flash_wgmma: head_dim must be 64 or 128, got " + std::to_string(shape.head_dim) +
                    " (lesson 07's attention() runs the others; attention_hopper() picks it for you)");
  const auto check = [](const TensorView& t, const char* name, int64_t rows, int64_t cols) {
    const std::string what = std::string("flash_wgmma: ") + name;
    TVLLM_REQUIRE(
        t.rank() == 2 && t.shape[0] == rows && t.shape[1] == cols,
        what + " must be [" + std::to_string(rows) + ", " + std::to_string(cols) + "], got " + t.describe());
    TVLLM_REQUIRE(t.dtype == DType::BF16 && t.device == Device::CUDA,
                  what + " must be bf16 on cuda, got " + t.describe());
    TVLLM_REQUIRE(t.strides.size() == 2 && t.strides[1] == 1, what + " must have contiguous columns");
    TVLLM_REQUIRE(rows <= 1 || t.strides[0] >= cols, what + " rows overlap (row stride below its width)");
    TVLLM_REQUIRE(rows == 0 || t.data != nullptr, what + " has no data");
    // TMA's rules for a tensor map: the base and the row pitch are multiples of 16 bytes.
    TVLLM_REQUIRE(
        reinterpret_cast<uintptr_t>(t.data) % 16 == 0 && t.strides[0] % 8 == 0,
        what + " must start 16-byte aligned with rows a multiple of 8 elements apart (TMA), got stride " +
            std::to_string(t.strides[0]));
  };
  check(q, "q", total_q, shape.q_dim());
  check(out, "out", total_q, shape.q_dim());
  check(k, "k", total_k, shape.kv_dim());
  check(v, "v", total_k, shape.kv_dim());
}

void flash_wgmma(const TensorView& out, const TensorView& q, const TensorView& k, const TensorView& v,
                 const AttentionBatch& batch, const AttentionShape& shape, cudaStream_t stream,
                 FlashSchedule schedule) {
  check_attention_queries(out, q, batch, shape);  // lesson 07's checks of the batch and the query side
  check_flash_wgmma_args(out, q, k, v, batch.total_q(), batch.total_k(), shape);
  require_hopper("flash_wgmma");
  if (batch.total_q() == 0) return;  // no query anywhere (and a tensor map needs at least one row)
  const bool ping_pong = schedule == FlashSchedule::PingPong;
  if (shape.head_dim == 64 && !ping_pong) launch_flash_wgmma<64, false>(out, q, k, v, batch, shape, stream);
  if (shape.head_dim == 64 && ping_pong) launch_flash_wgmma<64, true>(out, q, k, v, batch, shape, stream);
  if (shape.head_dim == 128 && !ping_pong) launch_flash_wgmma<128, false>(out, q, k, v, batch, shape, stream);
  if (shape.head_dim == 128 && ping_pong) launch_flash_wgmma<128, true>(out, q, k, v, batch, shape, stream);
}

const char* flash_schedule_name(FlashSchedule schedule) {
  return schedule == FlashSchedule::PingPong ? "ping-pong" : "plain";
}

void attention_hopper(const TensorView& out, const TensorView& q, const TensorView& k, const TensorView& v,
                      const AttentionBatch& batch, const AttentionShape& shape, AttentionKernel kernel,
                      AttentionWorkspace* workspace, cudaStream_t stream) {
  const bool ours = q.device == Device::CUDA && kernel == AttentionKernel::V2Flash &&
                    flash_wgmma_supports(shape) && hopper_available();
  if (!ours) {
    attention(out, q, k, v, batch, shape, kernel, workspace, stream);
    return;
  }
  if (workspace) workspace->check(batch, shape, kernel);
  flash_wgmma(out, q, k, v, batch, shape, stream);
}

void wgmma_pv_tile(const TensorView& d, const TensorView& p, const TensorView& v, cudaStream_t stream) {
  const int64_t n = v.rank() == 2 ? v.dim(1) : 0;
  const auto is = [](const TensorView& t, DType dtype, int64_t rows, int64_t cols) {
    return t.rank() == 2 && t.dtype == dtype && t.device == Device::CUDA && t.is_contiguous() &&
           t.dim(0) == rows && t.dim(1) == cols;
  };
  TVLLM_REQUIRE(n == 64 || n == 128, "wgmma_pv_tile: v must be [128, 64] or [128, 128], got " + v.describe());
  TVLLM_REQUIRE(is(v, DType::BF16, kFlashBlockN, n),
                "wgmma_pv_tile: v must be bf16 on the GPU, got " + v.describe());
  TVLLM_REQUIRE(is(p, DType::BF16, 64, kFlashBlockN),
                "wgmma_pv_tile: p must be bf16 [64, 128] on the GPU, got " + p.describe());
  TVLLM_REQUIRE(is(d, DType::F32, 64, n), "wgmma_pv_tile: d must be fp32 [64, " + std::to_string(n) +
                                              "] on the GPU, got " + d.describe());
  require_hopper("wgmma_pv_tile");
  const CUtensorMap map_v =
      make_tensor_map_bf16_2d(v.data, kFlashBlockN, n, n * 2, kFlashBlockN, 64, TmaSwizzle::B128);
  if (n == 64)
    wgmma_pv_tile_kernel<64><<<1, 128, 0, stream>>>(map_v, p.ptr<const __nv_bfloat16>(), d.ptr<float>());
  else
    wgmma_pv_tile_kernel<128><<<1, 128, 0, stream>>>(map_v, p.ptr<const __nv_bfloat16>(), d.ptr<float>());
  TVLLM_CHECK_LAUNCH();
}

}  // namespace tvllm
