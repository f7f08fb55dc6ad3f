// Element types and host-side conversions between them.
//
// This header has no CUDA dependency on purpose: the safetensors parser (and its fuzz target) use it.
// Lesson 02 (lessons/02_bf16) is the chapter that explains the bit layouts and the rounding below.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>

namespace tvllm {

// F8_E4M3 and F8_E5M2 are the two 8-bit float formats of safetensors (torch.float8_e4m3fn and
// torch.float8_e5m2). They are storage formats for quantized weights, never something the forward computes
// with: is_floating() is false for them, and a model loads them only as part of a quantized checkpoint
// whose scales say what the bytes mean (lesson 16).
enum class DType : uint8_t { F32, F16, BF16, F64, I64, I32, I16, I8, U8, BOOL, F8_E4M3, F8_E5M2 };

// Bytes per element.
size_t dtype_size(DType dtype);
// The safetensors spelling: "F32", "BF16", ...
std::string_view dtype_name(DType dtype);
// Parses the safetensors spelling; nullopt for anything unknown (F8_E8M0, F4, C64, ...).
std::optional<DType> parse_dtype(std::string_view name);
// The dtypes a forward pass computes with (F32, F16, BF16, F64). Not the 8-bit floats: they mean
// nothing without their scales.
bool is_floating(DType dtype);
bool is_fp8(DType dtype);  // F8_E4M3 or F8_E5M2

// ---- bit-level conversions (lesson 02 explains each line) -----------------------------------------

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline float f32_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// bf16 is the top half of an fp32: widening is a shift, exact for every value.
inline float bf16_to_f32(uint16_t b) { return f32_from_bits(static_cast<uint32_t>(b) << 16); }

// fp32 -> bf16, round to nearest, ties to even. NaN stays NaN (quiet, sign kept).
inline uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  uint32_t lsb = (u >> 16) & 1u;        // the last bit we keep: ties go towards making it 0
  uint32_t rounding_bias = 0x7fffu + lsb;
  return static_cast<uint16_t>((u + rounding_bias) >> 16);
}

// fp16 -> fp32, exact for every value (subnormals included).
float f16_to_f32(uint16_t h);
// fp32 -> fp16, round to nearest, ties to even; overflow gives +-inf, NaN stays NaN.
uint16_t f32_to_f16(float f);

// ---- 8-bit floats: decoding (lesson 16 explains the formats; its fp8.h has the encoders) ---------------
//
//   E4M3 ("fn": finite, NaN only)  s eeee mmm   bias 7:  normal (1 + m/8) 2^(e-7), subnormal (m/8) 2^-6,
//                                               no infinities; s 1111 111 is NaN; largest 448
//   E5M2 (IEEE-like)               s eeeee mm   bias 15: normal (1 + m/4) 2^(e-15), subnormal (m/4) 2^-14,
//                                               e = 31: infinity (m = 0) or NaN; largest 57344
// Every 8-bit value is exactly an fp32 (at most 4 significant bits, exponents well inside fp32's range),
// so decoding never rounds.
float fp8_e4m3_to_f32(uint8_t code);
float fp8_e5m2_to_f32(uint8_t code);

// Reads element i of a buffer of the given floating dtype as fp32 (for comparisons and printing); the
// 8-bit floats are decoded exactly, without any scale.
float load_as_f32(const void* data, DType dtype, size_t i);
// Writes an fp32 value as element i of a buffer of the given floating dtype (rounding as above).
void store_from_f32(void* data, DType dtype, size_t i, float value);

}  // namespace tvllm
