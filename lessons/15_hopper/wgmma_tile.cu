// Lesson 15, step 2: one wgmma tile. A warpgroup (128 threads) multiplies a 64 x 16 slice of A by a 128 x 16
// slice of B (transposed) straight out of shared memory, the operands named by descriptors; the 64 x 128 fp32
// result lives in registers, 64 per thread, in the accumulator fragment layout. README.md, "Step 2: wgmma".
#include <cuda_bf16.h>

#include <string>

#include "common/errors.h"
#include "common/exercise.h"
#include "hopper.cuh"
#include "hopper.h"
#include "tensor_map.h"

namespace tvllm {
namespace {

constexpr int kWarpgroupThreads = 128;

// A [64, 64] and B [128, 64] arrive by TMA with the 128-byte swizzle (each row: 64 K values = 128 bytes, the
// layout wgmma's swizzled K-major descriptor describes); then k_steps wgmma instructions, slices k_first...
__global__ void __launch_bounds__(kWarpgroupThreads)
    wgmma_tile_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                      float* d, int k_first, int k_steps) {
#if TVLLM_HOPPER_DEVICE
  // --- exercise 15.2: one wgmma tile ----------------------------------------------------------------------
  // Task: declare shared arrays for A (64 x 64 bf16) and B (128 x 64 bf16), each __align__(1024) (the
  //   swizzle's period), and an mbarrier; load A and B with TMA (both boxes at (0, 0), one mbarrier for both
  //   copies: expect the bytes of both), then, as one warpgroup: wgmma_fence(), one wgmma_m64n128k16 per K
  //   slice s = k_first .. k_first + k_steps - 1 with the descriptors of slice s of a and of b,
  //   wgmma_commit_group(), wgmma_wait_group<0>(), fence_accumulators(). Start from an accumulator of zeros.
  //   Finally each thread stores its 64 floats to d [64 x 128] (row-major) where
  //   accumulator_position(threadIdx.x, i) says.
  // Hint: sw128_kmajor_descriptor(smem_address(a), s) is the descriptor of slice s of a (hopper_layout.h).
  // Hint: the whole warpgroup must execute every wgmma instruction (they are .sync.aligned): no thread may
  //   skip one, so no per-thread conditions around them.
  // Tests: Hopper15Gpu.WgmmaTileIsExactOnSmallIntegers Hopper15Gpu.WgmmaTileMatchesTheOracleOnEverySlice
  // Tests: lesson15_hopper.gpu
  // Needs: 15.1
  // Stub: device
  // --- solution ---
  __shared__ __align__(1024) __nv_bfloat16 a[kTileM * kTileK];  //  8 KB, 8 swizzle atoms
  __shared__ __align__(1024) __nv_bfloat16 b[kTileN * kTileK];  // 16 KB, 16 swizzle atoms
  __shared__ uint64_t arrived;
  if (threadIdx.x == 0) {
    mbarrier_init(&arrived, 1);
    fence_barrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    mbarrier_arrive_expect_tx(&arrived, sizeof(a) + sizeof(b));
    tma_load_2d(a, &map_a, 0, 0, &arrived);
    tma_load_2d(b, &map_b, 0, 0, &arrived);
  }
  mbarrier_wait(&arrived, 0);

  float acc[kTileN / 2];
#pragma unroll
  for (int i = 0; i < kTileN / 2; ++i) acc[i] = 0.0f;
  wgmma_fence();  // the zeros above are written before the tensor cores read the accumulator
  // (A loop whose trip count is known only at run time: ptxas notes that it adds its own fences here and
  // serialises the MMAs, C7515/C7519. Harmless for one tile; the GEMM's inner loop is unrolled.)
  for (int s = k_first; s < k_first + k_steps; ++s)
    wgmma_m64n128k16(acc, sw128_kmajor_descriptor(smem_address(a), s),
                     sw128_kmajor_descriptor(smem_address(b), s));
  wgmma_commit_group();
  wgmma_wait_group<0>();
  fence_accumulators(acc);
#pragma unroll
  for (int i = 0; i < kTileN / 2; ++i) {
    const FragmentPosition p = accumulator_position(threadIdx.x, i);
    d[p.row * kTileN + p.col] = acc[i];
  }
  // --- end of exercise 15.2 ---
#else
  (void)map_a, (void)map_b, (void)d, (void)k_first, (void)k_steps;
#endif
}

}  // namespace

void wgmma_tile(const TensorView& d, const TensorView& a, const TensorView& b, int k_first, int k_steps,
                cudaStream_t stream) {
  const std::string what = "wgmma_tile: ";
  const auto is = [](const TensorView& t, DType dtype, int64_t rows, int64_t cols) {
    return t.rank() == 2 && t.dtype == dtype && t.device == Device::CUDA && t.is_contiguous() &&
           t.dim(0) == rows && t.dim(1) == cols;
  };
  TVLLM_REQUIRE(is(a, DType::BF16, kTileM, kTileK),
                what + "a must be bf16 [64, 64] on the GPU, got " + a.describe());
  TVLLM_REQUIRE(is(b, DType::BF16, kTileN, kTileK),
                what + "b must be bf16 [128, 64] on the GPU, got " + b.describe());
  TVLLM_REQUIRE(is(d, DType::F32, kTileM, kTileN),
                what + "d must be fp32 [64, 128] on the GPU, got " + d.describe());
  TVLLM_REQUIRE(k_first >= 0 && k_steps >= 1 && k_first + k_steps <= kTileK / 16,
                what + "the K slices [k_first, k_first + k_steps) must lie in [0, 4), got k_first " +
                    std::to_string(k_first) + ", k_steps " + std::to_string(k_steps));
  require_hopper("wgmma_tile");
  const CUtensorMap map_a =
      make_tensor_map_bf16_2d(a.data, kTileM, kTileK, kTileK * 2, kTileM, kTileK, TmaSwizzle::B128);
  const CUtensorMap map_b =
      make_tensor_map_bf16_2d(b.data, kTileN, kTileK, kTileK * 2, kTileN, kTileK, TmaSwizzle::B128);
  wgmma_tile_kernel<<<1, kWarpgroupThreads, 0, stream>>>(map_a, map_b, d.ptr<float>(), k_first, k_steps);
  TVLLM_CHECK_LAUNCH();
}

}  // namespace tvllm
