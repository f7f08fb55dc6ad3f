// Lesson 16: the two 8-bit float formats of Hopper's tensor cores, and the conversions to them.
//
//   fp32      s eeeeeeee mmmmmmmmmmmmmmmmmmmmmmm   1 + 8 + 23 bits, bias 127
//   E4M3 fn   s eeee mmm                           1 + 4 + 3 bits,  bias 7:  ±448 largest, no infinity,
//                                                  s 1111 111 is NaN (the only NaN pattern per sign)
//   E5M2      s eeeee mm                           1 + 5 + 2 bits,  bias 15: ±57344 largest, ±inf, NaNs
//
// Decoding (code -> fp32) is exact and lives in common/dtype.h beside bf16's: the loader of lesson 01
// needs it. Encoding is this lesson's subject: round to nearest, ties to even, and SATURATION: a finite
// value beyond the largest one (and an infinity) becomes ±max, never NaN or inf. That is what a
// quantizer wants (a weight slightly above its scale's range must become 448, not NaN) and what PTX's
// cvt.rn.satfinite and cuda_fp8.h's __NV_SATFINITE do. PyTorch's plain cast `.to(torch.float8_e4m3fn)`
// does NOT saturate: it rounds as if the format went on past 448, and what lands on the NaN pattern is
// NaN (every |x| > 464). So quantizers clamp to ±448 before the cast; f32_to_fp8_e4m3_torch_cast below
// reproduces the plain cast so the chapter can show the difference.
//
// This header is included by fp8.cu, so it stays C++17.
#pragma once

#include <cuda_runtime.h>  // cudaStream_t

#include <cstdint>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/tensor.h"

namespace tvllm {

enum class Fp8Kind : uint8_t { E4M3, E5M2 };

// The parameters of a format, as the chapter's table lists them.
struct Fp8Format {
  const char* name;       // "E4M3" / "E5M2"
  DType dtype;            // F8_E4M3 / F8_E5M2 (the safetensors spelling)
  int exponent_bits;      // 4 / 5
  int mantissa_bits;      // 3 / 2 (stored; one more significant bit is implicit for normal numbers)
  int bias;               // 7 / 15
  float max_finite;       // 448 / 57344
  float min_normal;       // 2^-6 / 2^-14
  float min_subnormal;    // 2^-9 / 2^-16
  bool has_infinity;      // false / true
  uint8_t max_code;       // the code of +max_finite: 0x7e / 0x7b
};
const Fp8Format& fp8_format(Fp8Kind kind);
Fp8Kind fp8_kind_of(DType dtype);  // F8_E4M3 or F8_E5M2, else InputError

// Exact decoding (common/dtype.h's fp8_e4m3_to_f32 / fp8_e5m2_to_f32).
float fp8_to_f32(Fp8Kind kind, uint8_t code);

// fp32 -> 8 bits, round to nearest, ties to even, saturating: finite values and infinities beyond the
// range give ±max_finite; NaN gives NaN (E4M3: 0x7f / 0xff; E5M2: 0x7e / 0xfe, the sign kept).
// Subnormals are rounded on the fixed grid of the smallest binade; values below half the smallest
// subnormal give ±0 (the sign kept).
uint8_t f32_to_fp8_e4m3(float x);
uint8_t f32_to_fp8_e5m2(float x);
uint8_t f32_to_fp8(Fp8Kind kind, float x);

// What torch's `x.to(torch.float8_e4m3fn)` gives: the same rounding with no saturation, so a value that
// rounds past 448 lands on the NaN pattern (0x7f with the sign): NaN for every |x| > 464, and 448 for
// 448 <= |x| <= 464 (464 is the tie between 448 and 480, and 448's last bit is even). inf gives NaN too.
uint8_t f32_to_fp8_e4m3_torch_cast(float x);

// ---- the independent oracle (fp8_cpu.cpp) ---------------------------------------------------------------

// Every non-negative finite value of the format, ascending, each with its code, computed from the
// definition (powers of two in double), not from common/dtype.h: E4M3 has 127 (0 .. 448), E5M2 124.
struct Fp8TableEntry {
  double value;
  uint8_t code;
};
std::vector<Fp8TableEntry> fp8_value_table(Fp8Kind kind);
// The nearest entry of the table to |x| by brute force (distances in double; on a tie the even code),
// with the sign of x; |x| beyond the largest value (inf included) gives ±max; NaN the format's NaN.
uint8_t fp8_round_by_table(const std::vector<Fp8TableEntry>& table, Fp8Kind kind, float x);

// ---- conversions on tensor views (CPU or GPU; the device of the views picks the path) ----------------

// GPU versions of fp32 -> fp8 (saturating, round to nearest even):
//   v1  the bit arithmetic of f32_to_fp8_e4m3 / _e5m2, written out for the GPU
//   v2  cuda_fp8.h's __nv_cvt_float2_to_fp8x2 with __NV_SATFINITE: one cvt.rn.satfinite.e4m3x2.f32
//       instruction converts a pair on sm_89 and later (Hopper included)
const std::vector<std::string>& fp8_kernel_versions();
inline constexpr const char* kFp8DefaultKernel = "v2";

// out[i] = fp8(x[i]). x: F32, out: F8_E4M3 or F8_E5M2 (the format), same count, contiguous, same device.
void convert_f32_to_fp8(const TensorView& out, const TensorView& x, const std::string& kernel = kFp8DefaultKernel,
                        cudaStream_t stream = nullptr);
// out[i] = fp32(x[i]), exact. x: F8_E4M3 or F8_E5M2, out: F32.
void convert_fp8_to_f32(const TensorView& out, const TensorView& x, cudaStream_t stream = nullptr);

// GPU launchers (fp8.cu), on device pointers; n may be 0. Queued on `stream`, asynchronous.
void f32_to_fp8_cuda(uint8_t* out, const float* x, int64_t n, Fp8Kind kind, const std::string& kernel,
                     cudaStream_t stream = nullptr);
void fp8_to_f32_cuda(float* out, const uint8_t* x, int64_t n, Fp8Kind kind, cudaStream_t stream = nullptr);
// The exhaustive check on the GPU: converts the fp32 bit patterns first .. first + n - 1 (mod 2^32) with
// v1 and v2 and counts the patterns where they disagree (two NaNs agree: the hardware picks its NaN's
// sign). *count (device, zeroed by the caller) gets the count, *first_bad (device, set by the caller to
// 0xffffffff) the smallest disagreeing pattern seen.
void fp8_count_v1_v2_disagreements_cuda(Fp8Kind kind, uint32_t first, int64_t n, unsigned long long* count,
                                        uint32_t* first_bad, cudaStream_t stream = nullptr);

}  // namespace tvllm
