// Lesson 00: the first kernel and the numbers every later lesson is measured against.
//
//   saxpy: out[i] = a * x[i] + y[i]   (BLAS's "single-precision a times x plus y")
//
// It reads 8 bytes and writes 4 per element and does one multiply-add: pure memory traffic, so its
// speed is a bandwidth and the device-to-device copy is its ceiling.
//
// This header is included by gpu_basics.cu, so it stays C++17.
#pragma once

#include <cuda_runtime.h>  // cudaStream_t

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/tensor.h"

namespace tvllm {

// The GPU versions, naive to fast (lesson00_gpu_basics checks and times each):
//   v1  one thread per element; the grid covers n, the last block sticks out and is bounds-checked
//   v2  grid-stride loop: a grid sized to fill the GPU once, each thread walks the array in steps
//       of the whole grid's width (any n, no giant grids)
//   v3  v2 on float4: one 16-byte load of x, one of y, one 16-byte store per step; the n % 4 tail
//       elements one by one (falls back to v2 when a pointer is not 16-byte aligned)
const std::vector<std::string>& saxpy_kernel_versions();
inline constexpr const char* kSaxpyDefaultKernel = "v3";

// out[i] = fma(a, x[i], y[i]): the product and the sum with ONE rounding, on the CPU and on the GPU,
// so both give the same bits. x, y, out: contiguous F32 views with the same number of elements (any
// shape: SAXPY is element-wise), all on the same device; out may be y itself (in place, as BLAS does
// it). The device of the views picks the path; `kernel` picks the GPU version and is ignored on the CPU.
// On the GPU the kernel is queued on `stream` (nullptr: the legacy default stream, README section 5) and
// saxpy returns without waiting. Throws InputError naming the problem for anything else.
void saxpy(const TensorView& out, float a, const TensorView& x, const TensorView& y,
           const std::string& kernel = kSaxpyDefaultKernel, cudaStream_t stream = nullptr);

// ---- the pieces behind saxpy(), on raw pointers -------------------------------------------------------

// CPU reference (gpu_basics_cpu.cpp): std::fma per element, the same single rounding as the GPU's FFMA.
void saxpy_cpu(float* out, float a, const float* x, const float* y, int64_t n);
// The same written the obvious way, `a * x[i] + y[i]`, with the product rounded to fp32 before the
// add: two roundings. That holds because the project compiles host code with -ffp-contract=off (top-level
// CMakeLists.txt); otherwise GCC may fuse it on an FMA target. main.cpp counts how often it differs from
// the fused result (the chapter explains).
void saxpy_cpu_unfused(float* out, float a, const float* x, const float* y, int64_t n);
// GPU launcher (gpu_basics.cu): device pointers, kernel "v1" | "v2" | "v3", queued on `stream`. Returns
// after the launch (asynchronously), having checked that the launch itself was accepted.
void saxpy_cuda(float* out, float a, const float* x, const float* y, int64_t n, const std::string& kernel,
                cudaStream_t stream = nullptr);

// ---- the closed-form check --------------------------------------------------------------------------

// Inputs whose SAXPY result is known exactly without running anything:
//   x[i] = (i mod 1000) / 4, y[i] = i mod 7, a = 3   =>   out[i] = 3 (i mod 1000) / 4 + (i mod 7)
// Every value is a multiple of 1/4 below 1024: at most 12 significant bits, exact in fp32 (24 bits),
// so any correct implementation, fused or not, must produce exactly these numbers.
inline constexpr float kClosedFormA = 3.0f;
void fill_closed_form_inputs(float* x, float* y, int64_t n);
float closed_form_expected(int64_t i);
// How many of out[0..n) differ from closed_form_expected(i); *first_bad is the first such index (or -1).
int64_t count_closed_form_mismatches(const float* out, int64_t n, int64_t* first_bad);

// ---- measurements -------------------------------------------------------------------------------------

struct CopyBandwidths {
  double h2d_pageable_gbs = 0.0;  // host (malloc'd) -> device: staged by the driver through a pinned buffer
  double h2d_pinned_gbs = 0.0;    // host (cudaMallocHost) -> device: DMA straight from our memory
  double d2h_pinned_gbs = 0.0;    // device -> pinned host
  double d2d_gbs = 0.0;           // device -> device, bytes read + bytes written: the ceiling of every kernel
};
// Times cudaMemcpy of host_bytes across the bus each way, and a device copy of device_bytes.
// Bus figures count the bytes once (they cross once); the device copy counts them twice (read + write).
CopyBandwidths measure_copy_bandwidths(size_t host_bytes, size_t device_bytes);

}  // namespace tvllm
