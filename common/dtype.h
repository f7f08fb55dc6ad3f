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

enum class DType : uint8_t { F32, F16, BF16, F64, I64, I32, I16, I8, U8, BOOL };

// Bytes per element.
size_t dtype_size(DType dtype);
// The safetensors spelling: "F32", "BF16", ...
std::string_view dtype_name(DType dtype);
// Parses the safetensors spelling; nullopt for anything unknown (including F8 types we do not load).
std::optional<DType> parse_dtype(std::string_view name);
bool is_floating(DType dtype);

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

// Reads element i of a buffer of the given floating dtype as fp32 (for comparisons and printing).
float load_as_f32(const void* data, DType dtype, size_t i);
// Writes an fp32 value as element i of a buffer of the given floating dtype (rounding as above).
void store_from_f32(void* data, DType dtype, size_t i, float value);

}  // namespace tvllm
