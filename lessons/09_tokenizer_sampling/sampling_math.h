// Lesson 09, sampling: the arithmetic the CPU reference and the GPU kernel share, written ONCE and
// compiled for both (__host__ __device__), so that both sides compute the same bits.
//
// Every step that decides which token comes out is either one IEEE-754 fp32 operation whose result is
// fixed by the standard (division, subtraction, multiplication, addition, round-to-integer; never an FMA
// contracted behind our back: the device side names the rounding intrinsics, the host is compiled with
// -ffp-contract=off), or integer arithmetic (exact, so the order of a sum does not matter). Library exp()
// is NOT used: expf on the GPU and exp in glibc may differ in the last bit, so sampling_exp is our own.
//
// C++17, included by sampling.cu and sampling_cpu.cpp.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define TVLLM_SAMPLING_HD __host__ __device__ __forceinline__
#else
#define TVLLM_SAMPLING_HD inline
#endif

namespace tvllm::sampling {

// ---- counter-based random numbers: Philox-4x32-10 -----------------------------------------------------
// Salmon et al., "Parallel random numbers: as easy as 1, 2, 3" (SC 2011); the generator cuRAND and
// PyTorch use. A pure function (counter, key) -> 128 random bits: no state to carry between calls, so the
// uniform of (seed, step) is the same whoever computes it, in whatever order, in whatever batch.

struct Philox4x32 {
  uint32_t v[4];
};

TVLLM_SAMPLING_HD Philox4x32 philox4x32_10(Philox4x32 ctr, uint32_t key0, uint32_t key1) {
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {  // the key schedule: add the Weyl constants (golden ratio, sqrt(3) - 1)
      key0 += 0x9E3779B9u;
      key1 += 0xBB67AE85u;
    }
    const uint64_t p0 = static_cast<uint64_t>(0xD2511F53u) * ctr.v[0];
    const uint64_t p1 = static_cast<uint64_t>(0xCD9E8D57u) * ctr.v[2];
    ctr = Philox4x32{{static_cast<uint32_t>(p1 >> 32) ^ ctr.v[1] ^ key0, static_cast<uint32_t>(p1),
                      static_cast<uint32_t>(p0 >> 32) ^ ctr.v[3] ^ key1, static_cast<uint32_t>(p0)}};
  }
  return ctr;
}

// 64 uniform random bits for token `step` of the request seeded with `seed`: key = seed, counter = step.
// The other two counter words are 0 (room for more draws per step, unused).
TVLLM_SAMPLING_HD uint64_t random_u64(uint64_t seed, uint64_t step) {
  const Philox4x32 r = philox4x32_10(
      Philox4x32{{static_cast<uint32_t>(step), static_cast<uint32_t>(step >> 32), 0u, 0u}},
      static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  return (static_cast<uint64_t>(r.v[1]) << 32) | r.v[0];
}

// floor(a * b / 2^64), exactly, from 32-bit halves (the same code on both sides; no __int128 needed).
TVLLM_SAMPLING_HD uint64_t mulhi_u64(uint64_t a, uint64_t b) {
  const uint64_t a_lo = a & 0xffffffffu, a_hi = a >> 32, b_lo = b & 0xffffffffu, b_hi = b >> 32;
  const uint64_t lo_lo = a_lo * b_lo, hi_lo = a_hi * b_lo, lo_hi = a_lo * b_hi, hi_hi = a_hi * b_hi;
  const uint64_t middle = (lo_lo >> 32) + (hi_lo & 0xffffffffu) + (lo_hi & 0xffffffffu);  // < 3 * 2^32
  return hi_hi + (hi_lo >> 32) + (lo_hi >> 32) + (middle >> 32);
}

// ---- fp32 steps, each one correctly rounded operation -------------------------------------------------

TVLLM_SAMPLING_HD float f_div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
TVLLM_SAMPLING_HD float f_mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);  // never fused into an FMA
#else
  return a * b;
#endif
}
TVLLM_SAMPLING_HD float f_add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
TVLLM_SAMPLING_HD float f_sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
TVLLM_SAMPLING_HD float f_rint(float a) {  // round to nearest, ties to even
#if defined(__CUDA_ARCH__)
  return rintf(a);
#else
  return std::nearbyint(a);
#endif
}
TVLLM_SAMPLING_HD uint32_t f_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
TVLLM_SAMPLING_HD float bits_f(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// A logit as the sampler reads it: NaN counts as -inf (a token that can never be chosen).
TVLLM_SAMPLING_HD float sanitize_logit(float x) { return x != x ? -INFINITY : x; }

// exp(d) for d <= 0, in fp32, to a few units in the last place. Cody-Waite range reduction
// d = n ln2 + r with |r| <= ln2/2, a degree-7 Taylor polynomial for exp(r) (truncation error < 6e-9),
// then the exact scaling by 2^n. exp(0) is exactly 1. Below -64 (a probability ratio under 1.6e-28) it
// returns 0: the mass quantum (kMassScale below) is far coarser than that anyway.
TVLLM_SAMPLING_HD float sampling_exp(float d) {
  if (!(d >= -64.0f)) return 0.0f;  // also -inf and NaN
  // The constants are hex literals (no decimal parsing involved): 1/ln2, ln2 in two parts, 1/k!.
  const float n = f_rint(f_mul(d, 0x1.715476p+0f));          // d / ln2, to the nearest integer
  const float r = f_sub(f_sub(d, f_mul(n, 0x1.62e4p-1f)),    // ln2's high 16 bits: n * it is exact
                        f_mul(n, 0x1.7f7d1cp-20f));          // the rest of ln2
  float p = 0x1.a01a02p-13f;                                 // 1/7!
  p = f_add(f_mul(p, r), 0x1.6c16c2p-10f);                   // 1/6!
  p = f_add(f_mul(p, r), 0x1.111112p-7f);                    // 1/5!
  p = f_add(f_mul(p, r), 0x1.555556p-5f);                    // 1/4!
  p = f_add(f_mul(p, r), 0x1.555556p-3f);                    // 1/3!
  p = f_add(f_mul(p, r), 0.5f);
  p = f_add(f_mul(p, r), 1.0f);
  p = f_add(f_mul(p, r), 1.0f);
  const int e = static_cast<int>(n);                         // in [-93, 0]
  return f_mul(p, bits_f(static_cast<uint32_t>(e + 127) << 23));  // * 2^n (a normal number, exact)
}

// ---- the integer view of one token --------------------------------------------------------------------

// Probabilities become integers: a token's MASS is trunc(exp(z - z_max) * 2^40), the most likely token has
// exactly 2^40. Sums of masses are exact (no rounding, any order), so the thresholds, the total and the
// inverse-CDF search come out the same on every device. The price: a token 2^-40 (~1e-12) or less as
// likely as the most likely one has mass 0 and is never drawn. With vocab < 2^23 a sum stays below 2^63.
inline constexpr float kMassScale = 1099511627776.0f;  // 2^40
inline constexpr int64_t kMaxVocab = int64_t{1} << 23;

// z / temperature: the scaled logit (Hugging Face's TemperatureLogitsWarper divides, in fp32).
TVLLM_SAMPLING_HD float scaled_logit(float logit, float temperature) {
  return f_div(sanitize_logit(logit), temperature);
}

// The mass of a token with scaled logit z, given the row's largest scaled logit z_max. z == z_max
// (also when both are +inf or both -inf) is exactly 2^40.
TVLLM_SAMPLING_HD uint64_t token_mass(float z, float z_max) {
  const float d = z == z_max ? 0.0f : f_sub(z, z_max);
  const float e = sampling_exp(d);
#if defined(__CUDA_ARCH__)
  return __float2ull_rz(f_mul(e, kMassScale));
#else
  return static_cast<uint64_t>(f_mul(e, kMassScale));  // truncates, as __float2ull_rz
#endif
}

// A 32-bit key that orders like the float: key(a) < key(b) exactly when a < b. Flip all bits of a
// negative number, set the sign bit of a positive one. -0 is folded into +0 so equal floats get equal keys.
// Top-k and top-p select on these keys, i.e. on the scaled logits, as Hugging Face sorts the logits.
TVLLM_SAMPLING_HD uint32_t order_key(float z) {
  const uint32_t u = z == 0.0f ? 0u : f_bits(z);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Top-p's target mass: ceil(p * W), computed in double (both sides: two correctly rounded operations and
// a ceil), clamped to [1, W] so at least one token is always kept.
TVLLM_SAMPLING_HD uint64_t top_p_target(float top_p, uint64_t total) {
#if defined(__CUDA_ARCH__)
  const double t = ::ceil(__dmul_rn(static_cast<double>(top_p), static_cast<double>(total)));
#else
  const double t = std::ceil(static_cast<double>(top_p) * static_cast<double>(total));
#endif
  if (!(t >= 1.0)) return 1;
  if (t >= static_cast<double>(total)) return total;
  return static_cast<uint64_t>(t);
}

}  // namespace tvllm::sampling
