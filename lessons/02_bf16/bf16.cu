// Lesson 02, the GPU side: conversion kernels and their launchers.
//
// Every kernel here is a grid-stride loop (lesson 00): a grid sized to fill the GPU once, each thread
// walking the array in steps of the grid's width. A conversion reads 4 bytes and writes 2 per element
// (or the reverse): memory-bound, so its ceiling is the device copy bandwidth.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "bf16.h"
#include "common/cuda_utils.cuh"  // ceil_div, blocks_for_one_wave (lesson 00)
#include "common/errors.h"
#include "common/exercise.h"

namespace tvllm {

namespace {

constexpr int kThreadsPerBlock = 256;

// v1's rounding: common/dtype.h's f32_to_bf16, for the GPU, on the fp32 bits read as an integer;
// everything is the same integer arithmetic. (common/cuda_utils.cuh's f32_to_bf16_bits, which later
// kernels use, is the hardware instruction of v2 instead.)
__device__ __forceinline__ uint16_t round_bits_to_bf16(uint32_t u) {
  // --- exercise 02.2: v1, rounding on the bits ---------------------------------------------------------
  // Task: u holds the bits of an fp32 value; return the bits of the nearest bf16 (round to nearest,
  //   ties to even), exactly as common/dtype.h's f32_to_bf16 does, NaN included: a NaN stays a NaN with
  //   its sign and top payload bits, quieted (bit 0x0040 set). The v1 kernel below calls this for
  //   every element.
  // Hint: adding 0x7fff and then the last kept bit (bit 16) before dropping the low 16 bits rounds
  //   to nearest, ties to even; a carry into the exponent is the right answer (up to inf).
  // Hint: test for NaN first ((u & 0x7fffffff) > 0x7f800000): rounding would turn some NaNs into inf.
  // Tests: Bf16Gpu.V1MatchesTheCpu
  // Stub:
  //   (void)u;
  //   TVLLM_DEVICE_NOT_WRITTEN_YET("02.2", "v1, rounding on the bits");
  //   return 0xffffu;  // a NaN: wrong for every number
  // --- solution ---
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN: keep it NaN
  uint32_t lsb = (u >> 16) & 1u;  // the last bit we keep: on a tie we round towards making it 0
  return static_cast<uint16_t>((u + 0x7fffu + lsb) >> 16);
  // --- end of exercise 02.2 ---
}

// v1: the hand-written rounding. The input is read as integers: no float register ever holds it, so
// not even a signalling NaN's payload can be touched on the way.
__global__ void f32_to_bf16_v1_kernel(uint16_t* out, const uint32_t* x, int64_t n) {
  int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    out[i] = round_bits_to_bf16(x[i]);
  }
}

// v2: CUDA's intrinsic. On sm_80 and later it is one cvt.rn.bf16.f32 instruction.
__global__ void f32_to_bf16_v2_kernel(__nv_bfloat16* out, const float* x, int64_t n) {
  int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    out[i] = __float2bfloat16_rn(x[i]);
  }
}

// Four bf16 values, 8 bytes: stored with one 64-bit instruction.
struct alignas(8) Bf16x4 {
  __nv_bfloat162 lo, hi;
};

// v3: four elements per thread per step. __float22bfloat162_rn converts a float2 into a bf16 pair
// (.x to the lower address) in one cvt.rn.bf16x2.f32 instruction. x must be 16-byte aligned and out
// 8-byte aligned (the launcher checks). The n % 4 tail elements: one each for the first threads.
__global__ void f32_to_bf16_v3_kernel(__nv_bfloat16* out, const float* x, int64_t n) {
  // --- exercise 02.3: v3, four elements per thread -----------------------------------------------------
  // Task: the v2 conversion (__float2bfloat16_rn) four elements at a time: a grid-stride loop over the
  //   n / 4 whole groups of four, each one 16-byte float4 load, two pair conversions
  //   (__float22bfloat162_rn) and one 8-byte store of a Bf16x4; then the n % 4 tail elements, one each
  //   for the first threads of the grid. The launcher checked x (16 bytes) and out (8 bytes) alignment.
  // Hint: __float22bfloat162_rn(make_float2(a, b)) puts a at the lower address.
  // Tests: Bf16Gpu.V3MatchesTheCpu
  // Tests: Bf16Gpu.EveryNarrowingKernelMatchesTheCpu Bf16Gpu.OddSizesAndMisalignedViews
  // Tests: Bf16Gpu.ConversionsRunOnTheCallersStream lesson02_bf16.gpu
  // Needs: 02.1 02.2
  // Stub: device
  // --- solution ---
  int64_t n4 = n / 4;
  int64_t start = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const float4* x4 = reinterpret_cast<const float4*>(x);
  Bf16x4* out4 = reinterpret_cast<Bf16x4*>(out);
  for (int64_t i = start; i < n4; i += stride) {
    float4 v = x4[i];
    Bf16x4 r;
    r.lo = __float22bfloat162_rn(make_float2(v.x, v.y));
    r.hi = __float22bfloat162_rn(make_float2(v.z, v.w));
    out4[i] = r;
  }
  int64_t tail = 4 * n4 + start;
  if (tail < n) out[tail] = __float2bfloat16_rn(x[tail]);
  // --- end of exercise 02.3 ---
}

// bf16 -> fp32: the bf16 bits become the top half of the fp32 bits. Exact for every value.
__global__ void bf16_to_f32_kernel(uint32_t* out, const uint16_t* x, int64_t n) {
  // --- exercise 02.4: widening, bf16 to fp32 -----------------------------------------------------------
  // Task: out[i] = the fp32 bits of bf16 x[i], exactly, for every pattern (NaN payloads included), in
  //   a grid-stride loop (lesson 00's v2).
  // Hint: a bf16 is the top half of an fp32: no arithmetic, no float register, just the bits.
  // Tests: Bf16Gpu.WideningIsExactForAllPatterns
  // Stub: device
  // --- solution ---
  int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    out[i] = static_cast<uint32_t>(x[i]) << 16;
  }
  // --- end of exercise 02.4 ---
}

// fp32 -> fp16 with CUDA's intrinsic (cvt.rn.f16.f32): round to nearest even, overflow to inf.
__global__ void f32_to_f16_kernel(__half* out, const float* x, int64_t n) {
  int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    out[i] = __float2half_rn(x[i]);
  }
}

// x[i] = the bits first + i, wrapping at 2^32 (unsigned arithmetic), written as integers.
__global__ void fill_bit_patterns_kernel(uint32_t* x, int64_t n, uint32_t first) {
  int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    x[i] = first + static_cast<uint32_t>(i);
  }
}


// Blocks for `work` items: never more than one wave (the loop covers the rest), never zero.
unsigned grid_for(int64_t wave, int64_t work) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(wave, ceil_div(work, kThreadsPerBlock))));
}

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace

void f32_to_bf16_cuda(uint16_t* out, const float* x, int64_t n, const std::string& kernel, cudaStream_t stream) {
  if (n == 0) return;  // a grid of zero blocks is an invalid launch
  if (kernel == "v1") {
    static const int64_t wave = blocks_for_one_wave(f32_to_bf16_v1_kernel, kThreadsPerBlock);
    f32_to_bf16_v1_kernel<<<grid_for(wave, n), kThreadsPerBlock, 0, stream>>>(out, reinterpret_cast<const uint32_t*>(x), n);
    TVLLM_CHECK_LAUNCH();
    return;
  }
  auto* bout = reinterpret_cast<__nv_bfloat16*>(out);
  if (kernel == "v3" && aligned(x, 16) && aligned(out, 8)) {
    static const int64_t wave = blocks_for_one_wave(f32_to_bf16_v3_kernel, kThreadsPerBlock);
    f32_to_bf16_v3_kernel<<<grid_for(wave, n / 4 + 1), kThreadsPerBlock, 0, stream>>>(bout, x, n);  // +1: the tail
    TVLLM_CHECK_LAUNCH();
    return;
  }
  TVLLM_REQUIRE(kernel == "v2" || kernel == "v3", "f32_to_bf16: unknown kernel '" + kernel + "'");
  // v2, and v3 on pointers that are not aligned for its wide loads and stores
  static const int64_t wave = blocks_for_one_wave(f32_to_bf16_v2_kernel, kThreadsPerBlock);
  f32_to_bf16_v2_kernel<<<grid_for(wave, n), kThreadsPerBlock, 0, stream>>>(bout, x, n);
  TVLLM_CHECK_LAUNCH();
}

void bf16_to_f32_cuda(float* out, const uint16_t* x, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  static const int64_t wave = blocks_for_one_wave(bf16_to_f32_kernel, kThreadsPerBlock);
  bf16_to_f32_kernel<<<grid_for(wave, n), kThreadsPerBlock, 0, stream>>>(reinterpret_cast<uint32_t*>(out), x, n);
  TVLLM_CHECK_LAUNCH();
}

void f32_to_f16_cuda(uint16_t* out, const float* x, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  static const int64_t wave = blocks_for_one_wave(f32_to_f16_kernel, kThreadsPerBlock);
  f32_to_f16_kernel<<<grid_for(wave, n), kThreadsPerBlock, 0, stream>>>(reinterpret_cast<__half*>(out), x, n);
  TVLLM_CHECK_LAUNCH();
}

void fill_f32_bit_patterns_cuda(uint32_t* x, int64_t n, uint32_t first, cudaStream_t stream) {
  if (n == 0) return;
  static const int64_t wave = blocks_for_one_wave(fill_bit_patterns_kernel, kThreadsPerBlock);
  fill_bit_patterns_kernel<<<grid_for(wave, n), kThreadsPerBlock, 0, stream>>>(x, n, first);
  TVLLM_CHECK_LAUNCH();
}

}  // namespace tvllm
