// Lesson 15, step 1: one TMA copy. A 2-D box of a bf16 matrix lands in shared memory in one instruction; an
// mbarrier tells the block when its bytes have arrived; the block writes the box back to global memory,
// reading each element where the swizzle put it. README.md, "Step 1: TMA".
#include <cuda_bf16.h>

#include <string>

#include "common/errors.h"
#include "common/exercise.h"
#include "hopper.cuh"
#include "hopper.h"
#include "tensor_map.h"

namespace tvllm {
namespace {

constexpr int kTmaThreads = 128;

// One block: thread 0 starts the copy, everyone waits on the barrier, everyone copies the box out.
// tile_bytes = box_rows * box_cols * 2; the dynamic shared memory holds the box plus 1024 bytes of slack, so
// that the box can start on a 1024-byte boundary (the 128-byte swizzle's period; see hopper_layout.h).
__global__ void __launch_bounds__(kTmaThreads)
    tma_tile_kernel(const __grid_constant__ CUtensorMap map, __nv_bfloat16* dst, int box_rows, int box_cols,
                    int row0, int col0, bool swizzled) {
#if TVLLM_HOPPER_DEVICE
  // --- exercise 15.1: a TMA load and its mbarrier ----------------------------------------------------------
  // Task: bring the box whose top-left element is (row0, col0) into shared memory with ONE TMA copy, and
  //   write it to dst (box_rows x box_cols, row-major) with all 128 threads. Declare the dynamic shared
  //   memory (`extern __shared__ unsigned char smem[];`, the launcher gives it the box's bytes + 1024) and
  //   the mbarrier (`__shared__ uint64_t arrived;`). Thread 0 initialises the mbarrier for one arrival and
  //   fences the init (fence_barrier_init); after a __syncthreads it announces the box's bytes
  //   (mbarrier_arrive_expect_tx: that is its one arrival) and issues tma_load_2d (x = the column col0, y =
  //   the row row0). Every thread waits for phase 0 (mbarrier_wait(&arrived, 0)), then copies elements i =
  //   threadIdx.x, + 128, ... of the box: row i / box_cols, column i % box_cols.
  // Hint: the box starts at the first 1024-byte aligned byte of `smem`: compare smem_address(smem) & 1023.
  // Hint: without the swizzle element (r, c) is at byte (r * box_cols + c) * 2 of the box; with it (swizzled:
  //   64 columns, 128-byte rows) at swizzled_offset_bf16(r, c) (hopper_layout.h).
  // Hint: the byte count is the WHOLE box, also when part of it lies outside the matrix: TMA writes those
  //   zeros into shared memory and counts them.
  // Tests: Hopper15Gpu.TmaTileCopyMatchesTheOracle Hopper15Gpu.TmaTileOffTheEdgeIsZeroFilled
  // Tests: Hopper15Gpu.TmaTileWiderThanTheMatrixIsZeroFilled Hopper15Gpu.TmaTileThatBarelyOverlaps
  // Tests: Hopper15Gpu.TmaSwizzledTileIsReadBackThroughTheFormula
  // Stub: device
  // --- solution ---
  extern __shared__ unsigned char smem[];
  __shared__ uint64_t arrived;  // the mbarrier: "the box is in shared memory"
  const uint32_t misalignment = smem_address(smem) & (kSwizzleAtomBytes - 1);
  unsigned char* box = smem + (misalignment == 0 ? 0 : kSwizzleAtomBytes - misalignment);
  const int elements = box_rows * box_cols;
  if (threadIdx.x == 0) {
    mbarrier_init(&arrived, 1);
    fence_barrier_init();
  }
  __syncthreads();  // nobody waits on the barrier before it exists
  if (threadIdx.x == 0) {
    mbarrier_arrive_expect_tx(&arrived, static_cast<uint32_t>(elements) * 2u);
    tma_load_2d(box, &map, col0, row0, &arrived);
  }
  mbarrier_wait(&arrived, 0);  // phase 0 completes when the one arrival and all the bytes are in
  for (int i = threadIdx.x; i < elements; i += blockDim.x) {
    const int r = i / box_cols, c = i % box_cols;
    const uint32_t offset = swizzled ? swizzled_offset_bf16(r, c) : static_cast<uint32_t>(i) * 2u;
    dst[i] = *reinterpret_cast<const __nv_bfloat16*>(box + offset);
  }
  // --- end of exercise 15.1 ---
#else
  (void)map, (void)dst, (void)box_rows, (void)box_cols, (void)row0, (void)col0, (void)swizzled;
#endif
}

}  // namespace

void tma_tile_copy(const TensorView& dst, const TensorView& src, int64_t row0, int64_t col0,
                   TmaSwizzle swizzle, cudaStream_t stream) {
  const std::string what = "tma_tile_copy: ";
  TVLLM_REQUIRE(
      src.rank() == 2 && src.dtype == DType::BF16 && src.device == Device::CUDA && src.is_contiguous(),
      what + "src must be a contiguous bf16 matrix on the GPU, got " + src.describe());
  TVLLM_REQUIRE(
      dst.rank() == 2 && dst.dtype == DType::BF16 && dst.device == Device::CUDA && dst.is_contiguous(),
      what + "dst must be a contiguous bf16 matrix on the GPU, got " + dst.describe());
  const int64_t box_rows = dst.dim(0), box_cols = dst.dim(1);
  TVLLM_REQUIRE(
      box_rows >= 1 && box_rows <= 256 && box_cols >= 8 && box_cols <= 256 && box_cols % 8 == 0,
      what + "the box (dst) must be 1..256 rows of 8..256 columns, a multiple of 8, got " + dst.describe());
  TVLLM_REQUIRE(swizzle != TmaSwizzle::B128 || box_cols == 64,
                what + "with the 128-byte swizzle the box must be 64 columns wide (128 bytes), got " +
                    std::to_string(box_cols));
  TVLLM_REQUIRE(src.dim(1) % 8 == 0,
                what + "src's rows must be a multiple of 16 bytes (8 bf16) long, got " + src.describe());
  TVLLM_REQUIRE(row0 >= INT32_MIN && row0 <= INT32_MAX && col0 >= INT32_MIN && col0 <= INT32_MAX,
                what + "the box's corner must fit in 32-bit coordinates");
  // The box's first column must sit on a 16-byte boundary of its row (col0 a multiple of 8 bf16), even when it is
  // off the edge: on the H200 corners at columns -63 and 500 died with cudaErrorIllegalInstruction, every corner
  // at a multiple of 8 (-24, 8, 96, 512, ...) copied correctly. A box that misses the matrix entirely is refused
  // too: the lesson's kernels never need one, and we have not shown it safe. Tests: Hopper15Args.TmaBox*.
  TVLLM_REQUIRE(col0 % 8 == 0, what + "the box's first column must be a multiple of 8 (16 bytes, TMA's rule), got " +
                                   std::to_string(col0));
  TVLLM_REQUIRE(row0 < src.dim(0) && row0 + box_rows > 0 && col0 < src.dim(1) && col0 + box_cols > 0,
                what + "the box (" + std::to_string(box_rows) + " x " + std::to_string(box_cols) + " at row " +
                    std::to_string(row0) + ", column " + std::to_string(col0) +
                    ") must overlap the matrix " + src.describe());
  require_hopper("tma_tile_copy");

  const CUtensorMap map =
      make_tensor_map_bf16_2d(src.data, src.dim(0), src.dim(1), src.dim(1) * 2, box_rows, box_cols, swizzle);
  const int smem = static_cast<int>(box_rows * box_cols * 2) + static_cast<int>(kSwizzleAtomBytes);
  TVLLM_CUDA_CHECK(cudaFuncSetAttribute(tma_tile_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  tma_tile_kernel<<<1, kTmaThreads, smem, stream>>>(map, dst.ptr<__nv_bfloat16>(), static_cast<int>(box_rows),
                                                    static_cast<int>(box_cols), static_cast<int>(row0),
                                                    static_cast<int>(col0), swizzle == TmaSwizzle::B128);
  TVLLM_CHECK_LAUNCH();
}

}  // namespace tvllm
