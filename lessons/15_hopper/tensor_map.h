// Lesson 15: TMA tensor maps, made on the host.
//
// A tensor map (CUtensorMap, 128 opaque bytes) describes to the TMA unit one matrix in global memory: its
// base address, element type, sizes and row pitch, the box one copy moves, the swizzle applied in shared
// memory, and what to write for out-of-bounds elements (zeros). The kernel receives it as a `const
// __grid_constant__ CUtensorMap` parameter and names only box coordinates.
//
// The encoder, cuTensorMapEncodeTiled, is a DRIVER function (libcuda), and this project links only the
// runtime: CI has no driver, and a build must not need one. The runtime hands out any driver function by name
// at run time (cudaGetDriverEntryPointByVersion), from the driver the process is already using. So nothing
// links libcuda, and a machine without a GPU never gets here (the callers check hopper_available() first).
//
// C++17 (included by the .cu launchers). Host only.
#pragma once

#include <cuda.h>  // CUtensorMap and the enums; no driver symbol is linked

#include <cstdint>

#include "hopper.h"

namespace tvllm {

// A map of the row-major bf16 matrix at `base` ([rows, cols], row_pitch_bytes between rows), copied in boxes
// of [box_rows, box_cols], with the given swizzle; out-of-bounds elements read as zero. Checks TMA's rules
// (InputError naming the rule): base 16-byte aligned; row pitch a multiple of 16 bytes and at least cols * 2;
// rows, cols in [1, 2^32); box sides in [1, 256]; box_cols * 2 a multiple of 16 bytes; with the 128-byte
// swizzle box_cols * 2 <= 128. A failing encode (CudaError) names the call's result.
CUtensorMap make_tensor_map_bf16_2d(const void* base, uint64_t rows, uint64_t cols, uint64_t row_pitch_bytes,
                                    uint32_t box_rows, uint32_t box_cols, TmaSwizzle swizzle);

// Whether a bf16 matrix view can be described by a tensor map as it is: a CUDA matrix with contiguous columns,
// its base 16-byte aligned and its row pitch a multiple of 16 bytes (8 bf16). The one statement of that rule:
// the kernels' argument checks and lesson 15's engine hooks (prefill_hook.cpp) both ask it.
inline bool tma_matrix_ok(const TensorView& t) {
  return t.device == Device::CUDA && t.dtype == DType::BF16 && t.rank() == 2 && t.strides.size() == 2 &&
         t.strides[1] == 1 && reinterpret_cast<uintptr_t>(t.data) % 16 == 0 && t.strides[0] % 8 == 0;
}

}  // namespace tvllm
