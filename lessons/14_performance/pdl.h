// Lesson 14: programmatic dependent launch (PDL), the host's half. README section 7 tells the story.
//
// Kernels queued on one stream run one after another: kernel B starts only when kernel A has finished and its
// writes are visible. At batch 1 a decode step is ~100 such kernels of a few microseconds each, and every
// boundary costs a ramp-down (A's last blocks finish while most SMs idle), B's launch, and B's ramp-up (its
// first loads wait a full DRAM latency before anything is computed). Hopper (sm_90) lets B be launched as a
// *programmatic dependent* of A: B's blocks may start while A still runs, do the work that does not depend on
// A (here: load their weight tiles), and then wait in the kernel for A's completion:
//
//   host     cudaLaunchKernelEx(B) with cudaLaunchAttributeProgrammaticStreamSerialization = 1
//   kernel A cudaTriggerProgrammaticLaunchCompletion()   "my dependents may be scheduled now" (a hint: without
//                                                          it, the launch happens as A's blocks exit)
//   kernel B ...loads of the weights (never written during a step)...
//            cudaGridDependencySynchronize()             waits until A has COMPLETED and its writes are
//                                                          visible: every read of A's outputs, and every
//                                                          write at all, comes after it
//
// pdl.cuh has the device half and the launch helper; this header only says whether the machine can do it.
#pragma once

namespace tvllm {

// Whether the current CUDA device and driver can launch kernels as programmatic dependents, including inside
// captured CUDA graphs: compute capability 9.0 or newer, and a driver and runtime of CUDA 12.3 or newer (the first
// whose stream capture turns the launch attribute into a programmatic graph edge). False without a GPU.
bool pdl_supported();

}  // namespace tvllm
