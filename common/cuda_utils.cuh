// Device helpers every kernel lesson uses: launch shapes, warp and block reductions, 16-byte packs of
// bf16, and bf16 bit tricks. Lesson 00 introduces launch shapes, lesson 04 the reductions and packs; they
// live here once so that every later kernel uses the same, tested code.
//
// Include from .cu files only (it has __device__ code). C++17.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/errors.h"

namespace tvllm {

// ---- launch shapes ------------------------------------------------------------------------------------

inline constexpr int kWarpSize = 32;

// Blocks needed to give each of n work items its own thread: round up, so the last block may have
// threads with nothing to do (the kernel's bounds check sends them home).
__host__ __device__ constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Blocks that fill the GPU once: how many of this kernel's blocks fit on one SM at the same time (the
// occupancy calculator knows its registers and the SM's limits) times the number of SMs. A grid-stride
// kernel launched with one wave keeps every SM busy without paying for blocks that only start late.
// Asks the runtime each time (cheap, no allocation, no synchronisation).
template <class Kernel>
int64_t blocks_for_one_wave(Kernel kernel, int threads_per_block, size_t dynamic_smem_bytes = 0) {
  int device = 0, sms = 0, per_sm = 0;
  TVLLM_CUDA_CHECK(cudaGetDevice(&device));
  TVLLM_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  TVLLM_CUDA_CHECK(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads_per_block, dynamic_smem_bytes));
  return static_cast<int64_t>(sms) * std::max(per_sm, 1);
}

// ---- reductions ---------------------------------------------------------------------------------------
// Butterfly: at each step lane i combines its value with lane i ^ m. After 5 steps every lane holds the
// result over all 32 lanes (the same bits in every lane: partners combine the same two numbers, and fp32
// addition and max are commutative). All 32 lanes must take part.

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int m = kWarpSize / 2; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int m = kWarpSize / 2; m > 0; m >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, m));
  return v;
}

// The sum over the block, returned to every thread. blockDim.x: a multiple of 32 (full warps: the shuffles
// name all 32 lanes). warp_sums: shared memory for one float per warp (at most 32). Every thread must
// call it (it has a barrier). Calling it twice with the same warp_sums needs a __syncthreads() between.
__device__ __forceinline__ float block_sum(float v, float* warp_sums) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int warps = blockDim.x / kWarpSize;
  v = warp_sum(v);
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();  // every warp's slot written
  // Every warp adds the (at most 32) slots itself, so all threads get the total without a second barrier.
  v = lane < warps ? warp_sums[lane] : 0.f;
  return warp_sum(v);
}

// ---- bf16 bits ----------------------------------------------------------------------------------------
// bf16 is the top half of an fp32: widening is a shift, and rounding is __float2bfloat16_rn.

__device__ __forceinline__ float bf16_bits_to_f32(uint16_t bits) {
  return __uint_as_float(static_cast<uint32_t>(bits) << 16);
}
__device__ __forceinline__ uint16_t f32_to_bf16_bits(float f) { return __bfloat16_as_ushort(__float2bfloat16_rn(f)); }

// Two floats -> two bf16 in one 32-bit register, `lo` in the low half (the lower index in memory).
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  return static_cast<uint32_t>(f32_to_bf16_bits(lo)) | (static_cast<uint32_t>(f32_to_bf16_bits(hi)) << 16);
}

// ---- packs: kVec consecutive bf16 moved by ONE load or store instruction -------------------------------
// kVec = 8 is 16 bytes (a uint4), the widest load a thread can issue. Kept as raw 32-bit words: element i
// is the low (even i) or high (odd i) half of word i / 2 (little-endian). The pointer must be aligned to
// 2 * kVec bytes.
template <int kVec>
struct Pack {
  static_assert(kVec == 1 || kVec == 2 || kVec == 4 || kVec == 8, "a pack is 1, 2, 4 or 8 bf16");
  uint32_t word[(kVec + 1) / 2];  // kVec = 1 uses the low half of word[0]

  // Element i as fp32 (i is a compile-time constant after unrolling: one shift or one AND).
  __device__ __forceinline__ float get(int i) const {
    const uint32_t w = word[i / 2];
    return __uint_as_float(i % 2 == 0 ? w << 16 : w & 0xffff0000u);
  }
  // Element i := bf16(f), rounded to nearest even.
  __device__ __forceinline__ void set(int i, float f) {
    const uint32_t bits = f32_to_bf16_bits(f);
    uint32_t& w = word[i / 2];
    w = i % 2 == 0 ? (w & 0xffff0000u) | bits : (w & 0x0000ffffu) | (bits << 16);
  }
};

template <int kVec>
__device__ __forceinline__ Pack<kVec> load_pack(const __nv_bfloat16* p) {
  Pack<kVec> r;
  if constexpr (kVec == 8) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    r.word[0] = v.x, r.word[1] = v.y, r.word[2] = v.z, r.word[3] = v.w;
  } else if constexpr (kVec == 4) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    r.word[0] = v.x, r.word[1] = v.y;
  } else if constexpr (kVec == 2) {
    r.word[0] = *reinterpret_cast<const uint32_t*>(p);
  } else {
    r.word[0] = *reinterpret_cast<const uint16_t*>(p);
  }
  return r;
}

template <int kVec>
__device__ __forceinline__ void store_pack(__nv_bfloat16* p, const Pack<kVec>& v) {
  if constexpr (kVec == 8) {
    *reinterpret_cast<uint4*>(p) = make_uint4(v.word[0], v.word[1], v.word[2], v.word[3]);
  } else if constexpr (kVec == 4) {
    *reinterpret_cast<uint2*>(p) = make_uint2(v.word[0], v.word[1]);
  } else if constexpr (kVec == 2) {
    *reinterpret_cast<uint32_t*>(p) = v.word[0];
  } else {
    *reinterpret_cast<uint16_t*>(p) = static_cast<uint16_t>(v.word[0]);
  }
}

// Lesson 16's FP8 KV cache: 8 E4M3 codes (8 bytes, 8-byte aligned) as a pack of 8 bf16, so that a kernel written
// for bf16 rows reads FP8 rows through the same load_pack<8>(row + col). Exact: an E4M3 value has 4 significant
// bits and an exponent in [-9, 8], and bf16 (8 bits, exponent down to -133) holds every one. Two codes per
// conversion (fp8x2 -> f16x2, one cvt on sm_89 and later), then f16 -> f32 -> the f32's upper 16 bits (exact too).
// The 8 codes of two 32-bit words (as loaded: code 0 in lo's low byte) as 8 bf16.
__device__ __forceinline__ Pack<8> e4m3x8_to_bf16(uint32_t lo, uint32_t hi) {
  const uint32_t quads[2] = {lo, hi};
  Pack<8> r;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const auto pair = static_cast<__nv_fp8x2_storage_t>((quads[i / 2] >> (16 * (i % 2))) & 0xffffu);
    const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3)));
    r.word[i] = (__float_as_uint(f.x) >> 16) | (__float_as_uint(f.y) & 0xffff0000u);
  }
  return r;
}

template <int kVec>
__device__ __forceinline__ Pack<kVec> load_pack(const __nv_fp8_e4m3* p) {
  static_assert(kVec == 8, "FP8 rows are read 8 codes (8 bytes) at a time");
  const uint2 raw = *reinterpret_cast<const uint2*>(p);
  return e4m3x8_to_bf16(raw.x, raw.y);
}

// The largest power of two up to `max_align` bytes that divides the address: how wide a vector load from
// it may be (16 for a thread's loads; cuBLASLt asks about up to 256).
inline uint32_t pointer_alignment(const void* p, uint32_t max_align = 16) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  uint32_t align = max_align;
  while (align > 1 && address % align != 0) align /= 2;
  return align;
}

}  // namespace tvllm
