// Lesson 15, step 4: y = x W^T on Hopper's tensor cores. README.md, "Step 4: the GEMM".
//
// One block computes a 128 x 128 tile of y. Its 384 threads are three warpgroups with different jobs:
//
//   warpgroup 0, the PRODUCER: one thread walks K in steps of 64 and, for each step, has TMA copy the 128 x
//   64
//     slice of x and the 128 x 64 slice of W into the next stage of a ring of 4 shared-memory stages.
//   warpgroups 1 and 2, the CONSUMERS: each owns 64 rows of the tile and, for each stage, issues 4 wgmma
//     m64n128k16 (K = 64) into its 64 fp32 accumulators per thread.
//
// Two mbarriers per stage pass the stage back and forth:
//
//     producer                                   consumers
//     wait empty[s] --> TMA x, W --> full[s] --> wait full[s] --> wgmma x4 --> (done reading) --> empty[s]
//          ^                                                                                        |
//          +----------------------------------------------------------------------------------------+
//
// full[s]: 1 arrival (the producer's arrive_expect_tx) + the stage's bytes from TMA.
// empty[s]: 256 arrivals (every consumer thread, once its wgmma reading stage s has finished).
// Stage s is used by K steps s, s + 4, s + 8, ...: round r = k / 4 waits for parity r & 1 of full[s]; the
// producer waits for parity (r & 1) ^ 1 of empty[s], which a fresh barrier passes at once in round 0.
//
// The producer needs few registers and the consumers many: setmaxnreg moves them (40 and 232 per thread;
// 128 x 40 + 256 x 232 = 64512 of the SM's 65536). TMA zero-fills the rows of x and W past M and N, so edge
// tiles compute zeros there; the stores skip them.
#include <cuda_bf16.h>

#include <string>

#include "common/errors.h"
#include "hopper.cuh"
#include "hopper.h"
#include "tensor_map.h"

namespace tvllm {
namespace {

constexpr int kConsumers = 2;                         // consumer warpgroups, 64 rows of the tile each
constexpr int kGemmThreads = 128 * (1 + kConsumers);  // + the producer warpgroup
constexpr uint32_t kStageBytesX = kGemmBlockM * kGemmBlockK * 2;  // 16 KB: 128 rows of 128 bytes
constexpr uint32_t kStageBytesW = kGemmBlockN * kGemmBlockK * 2;  // 16 KB
constexpr int kGemmSmemBytes =
    kGemmStages * (kStageBytesX + kStageBytesW) + kSwizzleAtomBytes;  // + alignment
constexpr int kProducerRegisters = 40, kConsumerRegisters = 232;
static_assert(128 * kProducerRegisters + 128 * kConsumers * kConsumerRegisters <= 65536,
              "the warpgroups' registers must fit in the SM's register file");
static_assert(kGemmBlockM == 64 * kConsumers && kGemmBlockN == 128 && kGemmBlockK == 64,
              "the kernel is written for 2 x m64n128k16 per K slice of 16, four slices per stage");

__global__ void __launch_bounds__(kGemmThreads, 1)
    gemm_wgmma_kernel(const __grid_constant__ CUtensorMap map_x, const __grid_constant__ CUtensorMap map_w,
                      __nv_bfloat16* y, int m, int n, int k) {
#if TVLLM_HOPPER_DEVICE
  extern __shared__ unsigned char smem_raw[];
  __shared__ uint64_t full[kGemmStages], empty[kGemmStages];
  // The stages start on a 1024-byte boundary (the 128-byte swizzle's period) and every stage is a multiple of
  // it.
  unsigned char* smem = align_to_swizzle_atom(smem_raw);
  unsigned char* stage_x = smem;                               // kGemmStages x [128 rows][64 K] bf16
  unsigned char* stage_w = smem + kGemmStages * kStageBytesX;  // kGemmStages x [128 rows][64 K] bf16

  const int warpgroup = threadIdx.x / 128;
  const int k_tiles = k / kGemmBlockK;
  const int m0 = blockIdx.y * kGemmBlockM, n0 = blockIdx.x * kGemmBlockN;

  if (threadIdx.x == 0) {
    prefetch_tensor_map(&map_x);
    prefetch_tensor_map(&map_w);
    for (int s = 0; s < kGemmStages; ++s) {
      mbarrier_init(&full[s], 1);
      mbarrier_init(&empty[s], 128 * kConsumers);
    }
    fence_barrier_init();
  }
  __syncthreads();  // the last block-wide barrier: from here on the warpgroups only meet through the
                    // mbarriers

  if (warpgroup == 0) {
    // ---- the producer -------------------------------------------------------------------------------------
    setmaxnreg_dec<kProducerRegisters>();
    if (threadIdx.x == 0) {
      for (int kt = 0; kt < k_tiles; ++kt) {
        const RingSlot slot = ring_slot(kt, kGemmStages);
        const uint32_t s = slot.stage;
        mbarrier_wait(&empty[s],
                      slot.empty_parity);  // the consumers have finished with this stage's last use
        mbarrier_arrive_expect_tx(&full[s], kStageBytesX + kStageBytesW);
        tma_load_2d(stage_x + s * kStageBytesX, &map_x, kt * kGemmBlockK, m0, &full[s]);
        tma_load_2d(stage_w + s * kStageBytesW, &map_w, kt * kGemmBlockK, n0, &full[s]);
      }
    }
    return;  // the other 127 threads have nothing to do; the block lives on in its consumers
  }

  // ---- the consumers --------------------------------------------------------------------------------------
  setmaxnreg_inc<kConsumerRegisters>();
  const int consumer = warpgroup - 1;  // rows consumer * 64 .. + 63 of the tile
  const int t = threadIdx.x % 128;     // this thread in its warpgroup
  float acc[kGemmBlockN / 2];
#pragma unroll
  for (int i = 0; i < kGemmBlockN / 2; ++i) acc[i] = 0.0f;

  for (int kt = 0; kt < k_tiles; ++kt) {
    const RingSlot slot = ring_slot(kt, kGemmStages);
    const uint32_t s = slot.stage;
    mbarrier_wait(&full[s], slot.full_parity);  // x and W of step kt have landed
    const uint32_t a = smem_address(stage_x + s * kStageBytesX + consumer * 64 * kSwizzleBytes);
    const uint32_t b = smem_address(stage_w + s * kStageBytesW);
    wgmma_fence();
#pragma unroll
    for (int k16 = 0; k16 < kGemmBlockK / 16; ++k16)
      wgmma_m64n128k16(acc, sw128_kmajor_descriptor(a, k16), sw128_kmajor_descriptor(b, k16));
    wgmma_commit_group();
    // Let this step's MMAs run on; wait only for the PREVIOUS step's group, whose stage we then hand back.
    wgmma_wait_group<1>();
    if (kt > 0) mbarrier_arrive(&empty[(kt - 1) % kGemmStages]);
  }
  wgmma_wait_group<0>();
  fence_accumulators(acc);

  // ---- the epilogue: fp32 -> bf16, guarded stores ---------------------------------------------------------
  const bool pairs = n % 2 == 0;  // two neighbours at once (4 bytes) when every row starts 4-byte aligned
#pragma unroll
  for (int i = 0; i < kGemmBlockN / 2; i += 2) {
    const FragmentPosition p = accumulator_position(t, i);  // acc[i + 1] is the next column
    const int row = m0 + consumer * 64 + static_cast<int>(p.row);
    const int col = n0 + static_cast<int>(p.col);
    if (row >= m || col >= n) continue;
    __nv_bfloat16* out = y + static_cast<int64_t>(row) * n + col;
    if (pairs) {  // col is even and n is even, so col + 1 < n too
      *reinterpret_cast<__nv_bfloat162*>(out) = __floats2bfloat162_rn(acc[i], acc[i + 1]);
    } else {
      out[0] = __float2bfloat16_rn(acc[i]);
      if (col + 1 < n) out[1] = __float2bfloat16_rn(acc[i + 1]);
    }
  }
#else
  (void)map_x, (void)map_w, (void)y, (void)m, (void)n, (void)k;
#endif
}

}  // namespace

void gemm_wgmma(const TensorView& y, const TensorView& x, const TensorView& w, cudaStream_t stream) {
  check_gemm_wgmma_args(y, x, w);
  require_hopper("gemm_wgmma");
  const int64_t m = x.dim(0), k = x.dim(1), n = w.dim(0);
  const int64_t grid_m = (m + kGemmBlockM - 1) / kGemmBlockM, grid_n = (n + kGemmBlockN - 1) / kGemmBlockN;
  TVLLM_REQUIRE(grid_m <= 65535, "gemm_wgmma: M = " + std::to_string(m) + " needs more than 65535 row tiles");
  const CUtensorMap map_x =
      make_tensor_map_bf16_2d(x.data, m, k, k * 2, kGemmBlockM, kGemmBlockK, TmaSwizzle::B128);
  const CUtensorMap map_w =
      make_tensor_map_bf16_2d(w.data, n, k, k * 2, kGemmBlockN, kGemmBlockK, TmaSwizzle::B128);
  TVLLM_CUDA_CHECK(
      cudaFuncSetAttribute(gemm_wgmma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kGemmSmemBytes));
  const dim3 grid(static_cast<unsigned>(grid_n), static_cast<unsigned>(grid_m));
  gemm_wgmma_kernel<<<grid, kGemmThreads, kGemmSmemBytes, stream>>>(
      map_x, map_w, y.ptr<__nv_bfloat16>(), static_cast<int>(m), static_cast<int>(n), static_cast<int>(k));
  TVLLM_CHECK_LAUNCH();
}

}  // namespace tvllm
