// Lesson 00, the GPU side: three SAXPY kernels, their launcher, and the copy-bandwidth measurements.
//
// A kernel is a function that runs once per thread. Threads come in blocks (up to 1024 threads, here
// 256), blocks in a grid; each thread finds its element from its coordinates:
//
//   i = blockIdx.x * blockDim.x + threadIdx.x
//
// and the launch `kernel<<<blocks, threads>>>(args)` says how many of each.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common/bench.h"
#include "common/buffer.h"
#include "common/cuda_utils.cuh"  // ceil_div, blocks_for_one_wave (README section 4)
#include "common/errors.h"
#include "common/exercise.h"
#include "gpu_basics.h"

namespace tvllm {

namespace {

constexpr int kThreadsPerBlock = 256;  // a multiple of the warp size (32); 256 is a good default

// v1: one element per thread. The grid has ceil(n / 256) blocks, so its last block may reach past the
// end of the arrays: the `if` keeps those threads from reading and writing memory that is not ours.
__global__ void saxpy_v1_kernel(float* out, float a, const float* x, const float* y, int64_t n) {
  // --- exercise 00.2: v1, one thread per element ---------------------------------------------------------
  // Task: thread i of the grid (i = blockIdx.x * blockDim.x + threadIdx.x) computes out[i] = fmaf(a, x[i],
  //   y[i]). The launcher starts ceil(n / 256) blocks of 256 threads, so the last block may stick out.
  // Hint: compute i in 64 bits (n may pass 2^31) and let only the threads with i < n touch memory.
  // Tests: SaxpyGpu.V1MatchesTheCpu
  // Needs: 00.1
  // Stub: device
  // --- solution ---
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;  // 64-bit: n may pass 2^31
  if (i < n) out[i] = fmaf(a, x[i], y[i]);
  // --- end of exercise 00.2 ---
}

// v2: grid-stride loop. The grid is sized to the GPU (enough blocks to fill every SM once), and each
// thread handles elements i, i + stride, i + 2*stride, ... where stride is the number of threads in
// the grid. Consecutive threads still touch consecutive addresses in every step (coalesced).
__global__ void saxpy_v2_kernel(float* out, float a, const float* x, const float* y, int64_t n) {
  // --- exercise 00.3: v2, the grid-stride loop -----------------------------------------------------------
  // Task: the same SAXPY, but the grid is only as large as one wave of the GPU (far fewer threads than
  //   n): each thread handles i, i + stride, i + 2 * stride, ... while i < n, stride being the number of
  //   threads in the whole grid.
  // Hint: stride = gridDim.x * blockDim.x, in 64 bits; consecutive threads still touch consecutive
  //   addresses in each step, so the accesses stay coalesced.
  // Hint: v3 falls back to this kernel on misaligned views: MisalignedViewsStillWork grades both.
  // Tests: SaxpyGpu.V2MatchesTheCpu SaxpyGpu.MisalignedViewsStillWork
  // Needs: 00.1
  // Stub: device
  // --- solution ---
  int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    out[i] = fmaf(a, x[i], y[i]);
  }
  // --- end of exercise 00.3 ---
}

// v3: v2 on float4. Each step moves 16 bytes per thread per array in one instruction (LDG.128/STG.128),
// a quarter of the memory instructions of v2. The pointers must be 16-byte aligned (the launcher checks).
__global__ void saxpy_v3_kernel(float* out, float a, const float* x, const float* y, int64_t n) {
  // --- exercise 00.4: v3, float4 loads and stores --------------------------------------------------------
  // Task: v2 on float4: a grid-stride loop over the n / 4 whole float4s of x, y and out (one 16-byte
  //   load of each input, four fmaf, one 16-byte store), then the n % 4 elements after the last whole
  //   float4, one each for the first (at most 3) threads of the grid. The launcher checked that the
  //   pointers are 16-byte aligned and sized the grid with room for the tail.
  // Hint: reinterpret_cast<const float4*>(x)[i] is element 4i..4i+3 of x.
  // Hint: the tail element of thread t is 4 * (n / 4) + t; only t < n % 4 has one.
  // Tests: SaxpyGpu.V3MatchesTheCpu
  // Tests: SaxpyGpu.EveryKernelMatchesTheCpuBitForBit SaxpyGpu.InPlace
  // Tests: SaxpyGpu.ClosedFormOnTheFullLessonSize SaxpyGpu.RunsOnTheCallersStream lesson00_gpu_basics.gpu
  // Needs: 00.1 00.2 00.3
  // Stub: device
  // --- solution ---
  int64_t n4 = n / 4;  // whole float4s
  int64_t start = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const float4* x4 = reinterpret_cast<const float4*>(x);
  const float4* y4 = reinterpret_cast<const float4*>(y);
  float4* out4 = reinterpret_cast<float4*>(out);
  for (int64_t i = start; i < n4; i += stride) {
    float4 xv = x4[i];
    float4 yv = y4[i];
    float4 r;
    r.x = fmaf(a, xv.x, yv.x);
    r.y = fmaf(a, xv.y, yv.y);
    r.z = fmaf(a, xv.z, yv.z);
    r.w = fmaf(a, xv.w, yv.w);
    out4[i] = r;
  }
  // the n % 4 elements after the last whole float4: one each for the first (at most 3) threads
  int64_t tail = 4 * n4 + start;
  if (tail < n) out[tail] = fmaf(a, x[tail], y[tail]);
  // --- end of exercise 00.4 ---
}


bool aligned16(const void* p) { return pointer_alignment(p) == 16; }

}  // namespace

void saxpy_cuda(float* out, float a, const float* x, const float* y, int64_t n, const std::string& kernel,
                cudaStream_t stream) {
  if (n == 0) return;  // a grid of zero blocks is an invalid launch, not a no-op
  if (kernel == "v1") {
    int64_t blocks = ceil_div(n, kThreadsPerBlock);
    TVLLM_REQUIRE(blocks <= 0x7fffffff, "saxpy v1: n = " + std::to_string(n) + " needs more than 2^31-1 blocks");
    saxpy_v1_kernel<<<static_cast<unsigned>(blocks), kThreadsPerBlock, 0, stream>>>(out, a, x, y, n);
    TVLLM_CHECK_LAUNCH();
    return;
  }
  bool vectorised = kernel == "v3" && aligned16(out) && aligned16(x) && aligned16(y);
  if (vectorised) {
    static const int64_t wave = blocks_for_one_wave(saxpy_v3_kernel, kThreadsPerBlock);
    int64_t blocks = std::min(wave, ceil_div(n / 4 + 1, kThreadsPerBlock));  // +1: room for the tail
    saxpy_v3_kernel<<<static_cast<unsigned>(blocks), kThreadsPerBlock, 0, stream>>>(out, a, x, y, n);
    TVLLM_CHECK_LAUNCH();
    return;
  }
  TVLLM_REQUIRE(kernel == "v2" || kernel == "v3", "saxpy: unknown kernel '" + kernel + "'");
  // v2, and v3 on pointers that are not 16-byte aligned (a view that starts mid-buffer, say)
  static const int64_t wave = blocks_for_one_wave(saxpy_v2_kernel, kThreadsPerBlock);
  int64_t blocks = std::min(wave, ceil_div(n, kThreadsPerBlock));
  saxpy_v2_kernel<<<static_cast<unsigned>(blocks), kThreadsPerBlock, 0, stream>>>(out, a, x, y, n);
  TVLLM_CHECK_LAUNCH();
}

CopyBandwidths measure_copy_bandwidths(size_t host_bytes, size_t device_bytes) {
  CopyBandwidths r;
  HostBuffer pageable(host_bytes, HostBuffer::Kind::Pageable);
  HostBuffer pinned(host_bytes, HostBuffer::Kind::Pinned);
  DeviceBuffer device(host_bytes);
  // touch every page first: a fresh malloc is only reserved, and the first write would be timed too
  std::memset(pageable.data(), 1, host_bytes);
  std::memset(pinned.data(), 1, host_bytes);

  BenchOptions options;
  options.warmup = 1;
  options.iters = 10;
  options.flush_l2 = false;  // transfers over the bus: the L2 is not what limits them
  auto gbs = [&](const BenchResult& b) { return static_cast<double>(host_bytes) / (b.median_ms * 1e-3) / 1e9; };

  r.h2d_pageable_gbs = gbs(bench_gpu(
      [&] { TVLLM_CUDA_CHECK(cudaMemcpy(device.data(), pageable.data(), host_bytes, cudaMemcpyHostToDevice)); },
      options));
  r.h2d_pinned_gbs = gbs(bench_gpu(
      [&] { TVLLM_CUDA_CHECK(cudaMemcpy(device.data(), pinned.data(), host_bytes, cudaMemcpyHostToDevice)); },
      options));
  r.d2h_pinned_gbs = gbs(bench_gpu(
      [&] { TVLLM_CUDA_CHECK(cudaMemcpy(pinned.data(), device.data(), host_bytes, cudaMemcpyDeviceToHost)); },
      options));
  r.d2d_gbs = measure_copy_bandwidth_gbs(device_bytes, 20);
  return r;
}

}  // namespace tvllm
