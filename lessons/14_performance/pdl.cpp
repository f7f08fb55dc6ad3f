// Lesson 14: whether programmatic dependent launch is available (pdl.h).
#include "pdl.h"

#include <cuda_runtime.h>

#include "common/device.h"
#include "common/errors.h"

namespace tvllm {

bool pdl_supported() {
  if (!cuda_available()) return false;
  // 12030: CUDA 12.3, the first whose stream capture records the attribute as a programmatic graph edge. Both the
  // runtime we link and the driver must have it.
  constexpr int kFirstVersion = 12030;
  int device = 0, driver = 0, runtime = 0;
  TVLLM_CUDA_CHECK(cudaGetDevice(&device));
  TVLLM_CUDA_CHECK(cudaDriverGetVersion(&driver));
  TVLLM_CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
  return query_device(device).compute_major >= 9 && driver >= kFirstVersion && runtime >= kFirstVersion;
}

}  // namespace tvllm
