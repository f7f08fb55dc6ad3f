// Lesson 02: bf16, the number format of the whole course, and the conversions to and from it.
//
//   fp32  s eeeeeeee mmmmmmmmmmmmmmmmmmmmmmm   1 + 8 + 23 bits
//   bf16  s eeeeeeee mmmmmmm                   1 + 8 + 7 bits: the top half of an fp32
//   fp16  s eeeee mmmmmmmmmm                   1 + 5 + 10 bits
//
// The host conversions live in common/dtype.h (every lesson needs them); the chapter explains them line
// by line. This lesson adds their GPU versions, checks them bit for bit, and measures what the formats
// can and cannot hold.
//
// This header is included by bf16.cu, so it stays C++17.
#pragma once

#include <cuda_runtime.h>  // cudaStream_t

#include <cstdint>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/tensor.h"

namespace tvllm {

// ---- conversions on tensor views (the device of the views picks the path) --------------------------

// GPU versions of fp32 -> bf16, naive to fast (lesson02_bf16 checks each on all 2^32 fp32 patterns):
//   v1  round to nearest even by hand, on the bits: common/dtype.h's f32_to_bf16, line for line
//   v2  CUDA's __float2bfloat16_rn: one hardware conversion instruction (cvt.rn.bf16.f32)
//   v3  four elements per thread: one 16-byte float4 load, two __float22bfloat162_rn (each converts a
//       pair in one instruction), one 8-byte store (falls back to v2 on misaligned pointers)
const std::vector<std::string>& bf16_kernel_versions();
inline constexpr const char* kBf16DefaultKernel = "v3";

// out[i] = bf16(x[i]), round to nearest, ties to even; overflow gives inf; NaN gives NaN.
// x: F32, out: BF16, same element count (any shapes), contiguous, same device.
// `kernel` picks the GPU version (ignored on the CPU). On the GPU every function here is queued on
// `stream` (nullptr: the legacy default stream) and returns without waiting. Throws InputError naming
// any problem.
void convert_f32_to_bf16(const TensorView& out, const TensorView& x, const std::string& kernel = kBf16DefaultKernel,
                         cudaStream_t stream = nullptr);
// out[i] = fp32(x[i]), exact for every value. x: BF16, out: F32.
void convert_bf16_to_f32(const TensorView& out, const TensorView& x, cudaStream_t stream = nullptr);
// out[i] = fp16(x[i]), round to nearest even; overflow (|x| >= 65520) gives inf. x: F32, out: F16.
void convert_f32_to_f16(const TensorView& out, const TensorView& x, cudaStream_t stream = nullptr);

// Fills x (F32, contiguous, on the GPU) with consecutive bit patterns: x[i] has the bits first + i
// (mod 2^32). Every NaN payload and denormal arrives as written: the kernel stores integers.
void fill_f32_bit_patterns(const TensorView& x, uint32_t first, cudaStream_t stream = nullptr);

// GPU launchers behind the functions above (bf16.cu), on device pointers; n may be 0. They queue the
// kernel on `stream` and return (asynchronously), having checked that the launch was accepted.
void f32_to_bf16_cuda(uint16_t* out, const float* x, int64_t n, const std::string& kernel,
                      cudaStream_t stream = nullptr);
void bf16_to_f32_cuda(float* out, const uint16_t* x, int64_t n, cudaStream_t stream = nullptr);
void f32_to_f16_cuda(uint16_t* out, const float* x, int64_t n, cudaStream_t stream = nullptr);
void fill_f32_bit_patterns_cuda(uint32_t* x, int64_t n, uint32_t first, cudaStream_t stream = nullptr);

// ---- rounding by definition (bf16_cpu.cpp) -----------------------------------------------------------

// The nearest value of the format, found the slow and obvious way: take the two neighbours of |x| in
// the format, measure both distances in double arithmetic, keep the nearer (on a tie, the one with an
// even last mantissa bit), and encode it. It shares no line with the bit tricks in common/dtype.h, so
// agreement between the two means something. NaN gives the canonical quiet NaN (0x7fc0 / 0x7e00 with
// the sign of x).
uint16_t bf16_round_by_definition(float x);
uint16_t f16_round_by_definition(float x);
// Dropping the low 16 bits: what "just take the top half" gives. Always rounds towards zero, so it is
// biased: the chapter's experiment measures the bias.
inline uint16_t f32_to_bf16_truncate(float x) { return static_cast<uint16_t>(f32_bits(x) >> 16); }

inline bool bf16_is_nan(uint16_t b) { return (b & 0x7fffu) > 0x7f80u; }
inline bool f16_is_nan(uint16_t h) { return (h & 0x7fffu) > 0x7c00u; }

// ---- the experiments of the chapter (bf16_cpu.cpp; printed by lesson02_bf16) ---------------------------

// One value through the three formats: what comes back after fp32 -> format -> fp32.
struct RangeRow {
  std::string what;
  double exact;     // the value as computed in double
  float as_f32;
  float as_f16;     // inf where fp16 overflows, 0 where it underflows
  float as_bf16;
};
// Values an LLM meets: big activations, a sum of squares (RMSNorm), exp() of a logit, tiny values.
std::vector<RangeRow> range_experiments();

// The largest relative rounding error of the format, measured over n values spread log-uniformly
// across [2^-10, 2^10) (seeded; inside fp16's normal range), next to the bound 2^-p of a format with p significant bits.
struct PrecisionRow {
  std::string format;
  int significant_bits;
  double bound;             // 2^-p: half an ulp, relative to the smallest value of a binade
  double measured_max_rel;  // the worst |round(x) - x| / |x| seen
};
std::vector<PrecisionRow> precision_experiments(int64_t n, uint64_t seed);

// Truncation vs round-to-nearest-even on n values ~ N(0, 1) (seeded) and on their absolute values.
// Truncation always shrinks the magnitude, so its errors never cancel in the mean; in a sum they cancel
// only when the data is symmetric around zero, not for positive data (squares, probabilities).
struct BiasRow {
  std::string inputs;
  double truncate_mean_rel;  // mean of (|trunc(x)| - |x|) / |x|: the average pull towards zero
  double rne_mean_rel;       // mean of (|rne(x)| - |x|) / |x|
  double truncate_sum_rel;   // (sum of trunc(x) - sum of x) / sum of |x|
  double rne_sum_rel;        // (sum of rne(x) - sum of x) / sum of |x|
};
std::vector<BiasRow> bias_experiments(int64_t n, uint64_t seed);

// Adds 1 to a running total n times, keeping the total in the format after every addition (as a
// bf16 accumulator would). bf16 stops counting at 256: 256 + 1 rounds back to 256.
float count_in_bf16(int64_t n);
float count_in_f16(int64_t n);

}  // namespace tvllm
