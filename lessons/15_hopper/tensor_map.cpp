// Lesson 15: cuTensorMapEncodeTiled, reached through the runtime (tensor_map.h says why).
#include "tensor_map.h"

#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled_v12000: the function's type, from the toolkit

#include <string>

#include "common/errors.h"

namespace tvllm {
namespace {

// Looked up once per process. 12000: the ABI version of the function we call (introduced with CUDA 12.0), so
// a newer driver hands back that version's entry point, whose signature matches the type below.
PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    TVLLM_CUDA_CHECK(
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &found));
    if (found != cudaDriverEntryPointSuccess || p == nullptr)
      throw CudaError(
          "cuTensorMapEncodeTiled: the CUDA driver does not provide it (needs a CUDA 12.0+ driver); "
          "query result " +
          std::to_string(static_cast<int>(found)));
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

}  // namespace

CUtensorMap make_tensor_map_bf16_2d(const void* base, uint64_t rows, uint64_t cols, uint64_t row_pitch_bytes,
                                    uint32_t box_rows, uint32_t box_cols, TmaSwizzle swizzle) {
  const std::string where = "TMA tensor map: ";
  TVLLM_REQUIRE(reinterpret_cast<uintptr_t>(base) % 16 == 0,
                where + "the matrix must start on a 16-byte boundary");
  TVLLM_REQUIRE(rows >= 1 && cols >= 1 && rows < (uint64_t{1} << 32) && cols < (uint64_t{1} << 32),
                where + "rows and cols must be in [1, 2^32), got " + std::to_string(rows) + " x " +
                    std::to_string(cols));
  TVLLM_REQUIRE(row_pitch_bytes % 16 == 0 && row_pitch_bytes >= cols * 2,
                where + "the row pitch must be a multiple of 16 bytes and hold a row (" +
                    std::to_string(cols * 2) + " bytes), got " + std::to_string(row_pitch_bytes));
  TVLLM_REQUIRE(box_rows >= 1 && box_rows <= 256 && box_cols >= 1 && box_cols <= 256,
                where + "box sides must be in [1, 256], got " + std::to_string(box_rows) + " x " +
                    std::to_string(box_cols));
  TVLLM_REQUIRE(box_cols * 2 % 16 == 0, where + "a box row must be a multiple of 16 bytes (8 bf16), got " +
                                            std::to_string(box_cols) + " columns");
  TVLLM_REQUIRE(swizzle != TmaSwizzle::B128 || box_cols * 2 <= 128,
                where + "with the 128-byte swizzle a box row holds at most 128 bytes (64 bf16), got " +
                    std::to_string(box_cols) + " columns");

  // Dimension 0 is the innermost (contiguous) one: the column. Strides are given for dimensions 1.. only (the
  // innermost is the element size), in bytes.
  const cuuint64_t global_dim[2] = {cols, rows};
  const cuuint64_t global_stride[1] = {row_pitch_bytes};
  const cuuint32_t box_dim[2] = {box_cols, box_rows};
  const cuuint32_t element_stride[2] = {1, 1};  // copy every element of the box (no sub-sampling)
  CUtensorMap map{};
  const CUresult r =
      encode_tiled()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), global_dim,
                     global_stride, box_dim, element_stride, CU_TENSOR_MAP_INTERLEAVE_NONE,
                     swizzle == TmaSwizzle::B128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE,
                     CU_TENSOR_MAP_L2_PROMOTION_L2_128B,  // fetch 128-byte L2 lines: whole swizzle rows
                     CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);  // "NONE" = out-of-bounds elements are ZERO (the
                                                          // other choice is NaN)
  if (r != CUDA_SUCCESS)
    throw CudaError(where + "cuTensorMapEncodeTiled failed with CUresult " +
                    std::to_string(static_cast<int>(r)) + " for a " + std::to_string(rows) + " x " +
                    std::to_string(cols) + " matrix, box " + std::to_string(box_rows) + " x " +
                    std::to_string(box_cols));
  return map;
}

}  // namespace tvllm
