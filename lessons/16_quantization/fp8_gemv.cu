// Lesson 16, the FP8-weight decode GEMV (see fp8_gemv.h): lesson 14's v3 structure with 1-byte weights.
//
// A block of 256 threads owns kTileRows = 4 weight rows. Thread t reads packs t, t + 256, ... of each row:
// a pack is 16 bytes = 16 E4M3 weights (K % 16 == 0 and 16-byte aligned operands), or one byte in the
// fallback (any K). Every weight is widened in registers and multiplied into kTileRows x kM fp32 sums with
// __fmaf_rn in pack order. Then each warp sums its values with shuffles, the warps' sums meet in shared
// memory in warp order, and the thread that owns an output multiplies by the row's scale and stores it.
// The summation order depends on N and K only: a row of out is the same bits alone or in a batch of 16.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "common/cuda_utils.cuh"
#include "common/errors.h"
#include "common/exercise.h"
#include "fp8_gemv.h"

namespace tvllm {

namespace {

using bf16 = __nv_bfloat16;

constexpr int kThreads = 256;
constexpr int kTileRows = 4;

// 16 bytes of weights, read once: past L1 (ld.global.nc.L1::no_allocate), which keeps x for every block.
__device__ __forceinline__ uint4 load_weights16(const uint8_t* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}

// Two E4M3 codes (the low and high byte of `two`) as two floats, exactly: through a half pair, one
// cvt.rn.f16x2.e4m3x2 on sm_89+.
__device__ __forceinline__ float2 widen_pair(uint16_t two) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two), __NV_E4M3);
  return __half22float2(__half2(h));
}

// acc + Σ_{i<16} x[i] · w[i]: 16 weights in `w` (byte i = weight i, little-endian), their 16 activations in
// x0 (0..7) and x1 (8..15).
__device__ __forceinline__ float dot16(uint4 w, const Pack<8>& x0, const Pack<8>& x1, float acc) {
  // --- exercise 16.3: the FP8 GEMV's inner product, dequantized in registers -----------------------
  // Task: return acc plus the dot product of 16 E4M3 weights (w.x holds weights 0..3, w.y 4..7, ...,
  //   byte j of a word is weight 4 * word + j) with 16 activations (x0.get(i) is activation i, x1.get(i)
  //   activation 8 + i), adding the products into acc IN ORDER 0, 1, ..., 15 with __fmaf_rn, so the sum
  //   is a function of the data alone (the tests compare a batch of 16 with a batch of 1, bit for bit).
  // Hint: widen_pair(two bytes) converts two codes at once: the low byte of its argument is the first.
  // Hint: the scale is NOT applied here: the caller multiplies the finished sum once per output row.
  // Tests: Fp8Gemv16Gpu.MatchesTheReferenceAtDecodeShapes Fp8Gemv16Gpu.OddShapesTakeTheByteLoads
  // Tests: Fp8Gemv16Gpu.RowsAreTheSameBitsWhateverTheBatch lesson16_quantization.gpu
  // Needs: 16.1 16.2
  // Stub:
  //   (void)w, (void)x0, (void)x1, (void)acc;
  //   TVLLM_DEVICE_NOT_WRITTEN_YET("16.3", "the FP8 GEMV's inner product, dequantized in registers");
  //   return __int_as_float(0x7fc00000);  // NaN
  // --- solution ---
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 lo = widen_pair(static_cast<uint16_t>(words[j] & 0xffffu));
    const float2 hi = widen_pair(static_cast<uint16_t>(words[j] >> 16));
    const Pack<8>& xs = j < 2 ? x0 : x1;
    const int base = (j % 2) * 4;
    acc = __fmaf_rn(xs.get(base + 0), lo.x, acc);
    acc = __fmaf_rn(xs.get(base + 1), lo.y, acc);
    acc = __fmaf_rn(xs.get(base + 2), hi.x, acc);
    acc = __fmaf_rn(xs.get(base + 3), hi.y, acc);
  }
  return acc;
  // --- end of exercise 16.3 ---
}

struct Args {
  void* out;
  bool out_f32;
  const bf16* x;        // [M, K]
  const uint8_t* q;     // [N, K]
  const float* scale;   // [N] or [1]
  bool per_row_scale;
  int M;
  int64_t N, K;
};

template <int kM, bool kVector>
__global__ void __launch_bounds__(kThreads) fp8_gemv_kernel(Args a) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kTileRows;
  __shared__ float partial[kThreads / kWarpSize][kTileRows * kM];

  float acc[kTileRows][kM] = {};
  if constexpr (kVector) {
    const int64_t packs = a.K / 16;
    for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
      uint4 wv[kTileRows];
#pragma unroll
      for (int r = 0; r < kTileRows; ++r)  // the tile's 4 loads issued before any is used
        wv[r] = n0 + r < a.N ? load_weights16(a.q + (n0 + r) * a.K + p * 16) : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        if (m >= a.M) break;
        const Pack<8> x0 = load_pack<8>(a.x + m * a.K + p * 16), x1 = load_pack<8>(a.x + m * a.K + p * 16 + 8);
#pragma unroll
        for (int r = 0; r < kTileRows; ++r) acc[r][m] = dot16(wv[r], x0, x1, acc[r][m]);
      }
    }
  } else {
    for (int64_t k = threadIdx.x; k < a.K; k += blockDim.x) {
#pragma unroll
      for (int r = 0; r < kTileRows; ++r) {
        if (n0 + r >= a.N) break;
        const float wk = widen_pair(a.q[(n0 + r) * a.K + k]).x;
#pragma unroll
        for (int m = 0; m < kM; ++m) {
          if (m >= a.M) break;
          acc[r][m] = __fmaf_rn(__bfloat162float(a.x[m * a.K + k]), wk, acc[r][m]);
        }
      }
    }
  }

  // Each warp's sums, then the warps' sums in warp order.
#pragma unroll
  for (int r = 0; r < kTileRows; ++r)
#pragma unroll
    for (int m = 0; m < kM; ++m) {
      const float s = warp_sum(acc[r][m]);
      if (lane == 0) partial[warp][r * kM + m] = s;
    }
  __syncthreads();
  if (threadIdx.x < kTileRows * kM) {
    const int r = threadIdx.x / kM, m = threadIdx.x % kM;
    const int64_t n = n0 + r;
    if (n < a.N && m < a.M) {
      float total = 0.f;
      for (int w = 0; w < kThreads / kWarpSize; ++w) total += partial[w][r * kM + m];
      const float y = total * a.scale[a.per_row_scale ? n : 0];
      if (a.out_f32)
        static_cast<float*>(a.out)[m * a.N + n] = y;
      else
        static_cast<bf16*>(a.out)[m * a.N + n] = __float2bfloat16_rn(y);
    }
  }
}

template <int kM>
void launch(const Args& a, bool vector, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>(ceil_div(a.N, kTileRows));
  if (vector) fp8_gemv_kernel<kM, true><<<blocks, kThreads, 0, stream>>>(a);
  else fp8_gemv_kernel<kM, false><<<blocks, kThreads, 0, stream>>>(a);
}

}  // namespace

void fp8_gemv_cuda(void* out, bool out_f32, const void* x, const uint8_t* q, const float* scale, bool per_row_scale,
                   int M, int64_t N, int64_t K, cudaStream_t stream) {
  if (M == 0) return;
  const Args a{out, out_f32, static_cast<const bf16*>(x), q, scale, per_row_scale, M, N, K};
  const bool vector = K % 16 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(q) % 16 == 0;
  // The sums of a row do not depend on kM (each output's additions are the same whatever the batch).
  if (M <= 1) launch<1>(a, vector, stream);
  else if (M <= 2) launch<2>(a, vector, stream);
  else if (M <= 4) launch<4>(a, vector, stream);
  else if (M <= 8) launch<8>(a, vector, stream);
  else launch<16>(a, vector, stream);
  TVLLM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace tvllm
