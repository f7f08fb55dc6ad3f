// Lesson 14: whether programmatic dependent launch is available (pdl.h).
#include "pdl.h"

#include <cuda_runtime.h>

#include "common/device.h"
#include "common/errors.h"

namespace tvllm {

bool pdl_supported() {
  if (!cuda_available()) return false;
  int device = 0, driver = 0;
  TVLLM_CUDA_CHECK(cudaGetDevice(&device));
  TVLLM_CUDA_CHECK(cudaDriverGetVersion(&driver));
  return query_device(device).compute_major >= 9 && driver >= 12030;
}

}  // namespace tvllm
