// Lesson 14: programmatic dependent launch, the device half and the launch helper (pdl.h has the story).
//
// A kernel that takes part is written in three parts:
//
//   __global__ void k(...) {
//     ...work that reads nothing an earlier kernel of the stream writes (weights, indices)...
//     pdl_wait_for_previous_kernel();      // griddepcontrol.wait
//     pdl_let_next_kernel_start();         // griddepcontrol.launch_dependents
//     ...everything else: reads of the previous kernel's outputs, and EVERY write...
//   }
//
// Why every write after the wait: the previous kernel may still be running and reading what we would
// overwrite (a write-after-read hazard: gemv_residual adds into h while the GEMV before it may still read h).
// Why it is enough: the wait returns when the previous grid has completed and its memory is visible, and
// that grid itself waited for the one before it, so by induction every earlier kernel of the stream is done.
// That induction needs every PDL kernel to call the wait in every block, also in blocks with nothing to do.
// Plain launches may sit anywhere in the chain (RoPE, attention, lesson 08's add_bias and head_rmsnorm between
// the fused GEMVs): a kernel launched without the attribute starts only after the previous kernel has completed,
// so it too completes only after every earlier kernel has; and since it never triggers early, the PDL kernel
// after it is scheduled when it exits. What the induction cannot survive is a kernel launched WITH the
// attribute that does not call the wait.
//
// Both instructions are harmless where PDL is not in use, so the same kernel serves both launches and gives
// the same bits: griddepcontrol.wait waits for the prerequisite grids "in flight" (PTX ISA, griddepcontrol),
// and a grid launched without the attribute has none: its predecessor completed before it started, so the
// wait returns at once; launch_dependents only schedules dependents that were launched with the attribute.
// Both exist from sm_90 (Hopper) on; for older targets the wrappers compile to nothing, and pdl_supported()
// is false there, so no launch asks for the overlap.
//
// Where to trigger. The dependents are scheduled once EVERY block of this grid has triggered (or exited), so
// a trigger at the very top lets the next kernel, and through its own early trigger the one after it, start
// and hold SM slots while this one waits. We trigger right after our own wait: at most one kernel ahead
// prefetches while this one streams its weights and drains (the overlap that hides the tail and the launch).
// Correctness does not depend on the place: the next kernel reads our outputs only after its own wait.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "common/errors.h"

namespace tvllm {

__device__ __forceinline__ void pdl_wait_for_previous_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaGridDependencySynchronize();  // griddepcontrol.wait, with a memory clobber: no load is hoisted above it
#endif
}

__device__ __forceinline__ void pdl_let_next_kernel_start() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaTriggerProgrammaticLaunchCompletion();  // griddepcontrol.launch_dependents
#endif
}

// Launches kernel<<<grid, block, 0, stream>>>(args...), as a programmatic dependent of the stream's previous
// kernel when `pdl` is true (cudaLaunchKernelEx with cudaLaunchAttributeProgrammaticStreamSerialization). Inside
// a stream capture the attribute becomes a programmatic edge of the graph (CUDA 12.3+), so replays overlap too.
// Only kernels written as above may be launched with pdl = true.
// launch_kernel_smem: the same with `smem` bytes of dynamic shared memory.
template <class... Params, class... Args>
void launch_kernel_smem(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, bool pdl,
                        Args&&... args) {
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = pdl ? 1 : 0;
  TVLLM_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

template <class... Params, class... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream, bool pdl,
                   Args&&... args) {
  launch_kernel_smem(kernel, grid, block, 0, stream, pdl, std::forward<Args>(args)...);
}

}  // namespace tvllm
