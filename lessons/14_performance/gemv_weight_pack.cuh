// Lesson 14: the GEMV's weight element types (BF16, E4M3) and how a 16-byte pack of them becomes floats.
//
// Included by gemv.cu inside its anonymous namespace, before the v3 kernel: it uses that file's bf16, Pack and
// load_weights (stream_load.cuh), and lesson 16's E4M3 bit helpers (gemv.h's detail namespace).
#pragma once

// ---- the weight's element type: v3 and its fused variants read BF16 or FP8 weights -----------------------
// A 16-byte pack of W is 8 bf16 weights, or 16 E4M3 codes (lesson 16) whose row's fp32 scale multiplies the
// finished sum once: scale[n] * sum_k q[n,k] x[k] = sum_k (scale[n] q[n,k]) x[k]. Everything else of the kernel
// (the tiles, the split of K, the prologue, the reductions, the epilogues) is the same code for both.
// E4m3x8: K % 16 != 0 (the bundled model's down_proj has K = 600): 8 codes per 8-byte load, the same code else.
enum class WeightType { Bf16, E4m3, E4m3x8 };

template <WeightType kW>
struct WeightPack {
  static constexpr int kCols = kW == WeightType::E4m3 ? 16 : 8;      // weights (columns of K) per load
  static constexpr int kBytes = kW == WeightType::Bf16 ? 2 : 1;      // bytes per weight
  static constexpr int kLoadBytes = kCols * kBytes;                  // 16, or 8 for E4m3x8
  static constexpr bool kFp8 = kW != WeightType::Bf16;
};

// One pack of W: 16 bytes (word[0..3]) or 8 (word[0..1]), streamed past L1 (stream_load.cuh).
template <WeightType kW>
__device__ __forceinline__ Pack<8> load_weight_pack(const uint8_t* p) {
  if constexpr (WeightPack<kW>::kLoadBytes == 16) {
    return load_weights(p);
  } else {
    Pack<8> r{};
    asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(r.word[0]), "=r"(r.word[1]) : "l"(p));
    return r;
  }
}

// Two E4M3 codes (low byte first) as two floats, exactly: every E4M3 value is a half, so one
// cvt.rn.f16x2.e4m3x2 (sm_89+; cuda_fp8.h emulates it on older GPUs) and two exact half -> float widenings.
__device__ __forceinline__ float2 e4m3x2_to_float2(uint32_t two) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two & 0xffffu), __NV_E4M3);
  return __half22float2(__half2(h));
}

// The pack's kCols weights as fp32 (exact for both types; the E4M3 ones still without their row's scale).
template <WeightType kW>
__device__ __forceinline__ void widen_weights(const Pack<8>& p, float (&w)[WeightPack<kW>::kCols]) {
  if constexpr (kW == WeightType::Bf16) {
#pragma unroll
    for (int i = 0; i < 8; ++i) w[i] = p.get(i);
  } else {
#pragma unroll
    for (int j = 0; j < WeightPack<kW>::kCols / 4; ++j) {  // word j holds weights 4j .. 4j+3, little-endian
      const float2 lo = e4m3x2_to_float2(p.word[j]), hi = e4m3x2_to_float2(p.word[j] >> 16);
      w[4 * j] = lo.x, w[4 * j + 1] = lo.y, w[4 * j + 2] = hi.x, w[4 * j + 3] = hi.y;
    }
  }
}

// ---- Fp8GemvVariant::Bits: E4M3 decoded with integer instructions (lesson 16, §7.2) ------------------------
// An E4M3 code is s eeee mmm (bias 7); a half is s eeeee mmmmmmmmmm (bias 15). Put eeee mmm into the half's
// bits 13..7 (the top exponent bit stays 0): the half's value is 2^(e-15) 1.m for e > 0, and 2^-14 0.m for
// e = 0 (a half subnormal), i.e. EXACTLY 2^-8 times the code's 2^(e-7) 1.m and 2^-6 0.m, normals and
// subnormals alike. So the kernel multiplies by (code bits as a half), sums as Cvt does, and the epilogue
// multiplies by 256 x scale: every partial sum is exactly 2^-8 of Cvt's (a power of two, exact in fp32 far
// from underflow), so the result is the same bits. Per 4 codes (one 32-bit word of the pack):
//   2 PRMT   each code into the high byte of a 16-bit lane: t = code << 8 (s at bit 15, eeee mmm at 14..8)
//   2 x 2    shift right 1 and two masks (the compiler merges them into SHF + LOP3s): sign kept at bit 15,
//            magnitude at 13..7
//   4 HADD2.F32  half -> float, one per weight (what Cvt also pays after its cvt)
// against Cvt's 2 cvt (+ the byte selects feeding them) + 4 HADD2.F32: not fewer instructions. What it may gain
// is the pipe (a conversion may issue at a lower rate than integer ops) and, decoding each 8 columns where they
// are used, registers (lesson 16's §7.2 has ptxas's counts and the H200's timings).
constexpr float kBitsScale = 256.f;  // what the Bits decoding leaves out of every weight: 2^8

__device__ __forceinline__ float2 half2_bits_to_float2(uint32_t bits) {
  __half2 h;
  static_assert(sizeof(h) == sizeof(bits), "a half2 is 32 bits");
  memcpy(&h, &bits, sizeof(bits));
  return __half22float2(h);
}

// Four codes (byte j of `word` is code j) as four floats, each 2^-8 x its E4M3 value.
__device__ __forceinline__ void e4m3x4_bits_to_float(uint32_t word, float* w) {
  // PRMT selectors, one nibble per result byte (low first): 4 = a zero byte of the second operand.
  const uint32_t t01 = __byte_perm(word, 0u, 0x1404);  // bytes: 0, code0, 0, code1
  const uint32_t t23 = __byte_perm(word, 0u, 0x3424);  // bytes: 0, code2, 0, code3
  const float2 a = half2_bits_to_float2(detail::e4m3_lanes_to_half2_bits(t01));
  const float2 b = half2_bits_to_float2(detail::e4m3_lanes_to_half2_bits(t23));
  w[0] = a.x, w[1] = a.y, w[2] = b.x, w[3] = b.y;
}
