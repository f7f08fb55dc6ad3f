#include "common/dtype.h"

#include <cmath>
#include <limits>
#include <stdexcept>

namespace tvllm {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::F64: case DType::I64: return 8;
    case DType::F32: case DType::I32: return 4;
    case DType::F16: case DType::BF16: case DType::I16: return 2;
    case DType::I8: case DType::U8: case DType::BOOL: case DType::F8_E4M3: case DType::F8_E5M2: return 1;
  }
  return 0;
}

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::F32: return "F32";
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
    case DType::F64: return "F64";
    case DType::I64: return "I64";
    case DType::I32: return "I32";
    case DType::I16: return "I16";
    case DType::I8: return "I8";
    case DType::U8: return "U8";
    case DType::BOOL: return "BOOL";
    case DType::F8_E4M3: return "F8_E4M3";
    case DType::F8_E5M2: return "F8_E5M2";
  }
  return "?";
}

std::optional<DType> parse_dtype(std::string_view name) {
  for (DType d : {DType::F32, DType::F16, DType::BF16, DType::F64, DType::I64, DType::I32, DType::I16,
                  DType::I8, DType::U8, DType::BOOL, DType::F8_E4M3, DType::F8_E5M2}) {
    if (dtype_name(d) == name) return d;
  }
  return std::nullopt;
}

bool is_floating(DType dtype) {
  return dtype == DType::F32 || dtype == DType::F16 || dtype == DType::BF16 || dtype == DType::F64;
}

bool is_fp8(DType dtype) { return dtype == DType::F8_E4M3 || dtype == DType::F8_E5M2; }

float fp8_e4m3_to_f32(uint8_t code) {
  const bool negative = (code & 0x80u) != 0;
  const int exponent = (code >> 3) & 0xf;
  const int mantissa = code & 0x7;
  if (exponent == 0xf && mantissa == 0x7) return std::numeric_limits<float>::quiet_NaN();  // the only NaN
  // subnormal: (m/8) 2^-6 = m 2^-9; normal: (8 + m) 2^(e-7-3). ldexp of a small integer is exact.
  const float magnitude = exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -9)
                                        : std::ldexp(static_cast<float>(8 + mantissa), exponent - 10);
  return negative ? -magnitude : magnitude;
}

float fp8_e5m2_to_f32(uint8_t code) {
  const bool negative = (code & 0x80u) != 0;
  const int exponent = (code >> 2) & 0x1f;
  const int mantissa = code & 0x3;
  float magnitude;
  if (exponent == 0x1f) {
    if (mantissa != 0) return std::numeric_limits<float>::quiet_NaN();
    magnitude = std::numeric_limits<float>::infinity();
  } else if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -16);  // (m/4) 2^-14
  } else {
    magnitude = std::ldexp(static_cast<float>(4 + mantissa), exponent - 17);  // (4 + m) 2^(e-15-2)
  }
  return negative ? -magnitude : magnitude;
}

float f16_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {
    // zero or subnormal: value = mantissa * 2^-24, exact in fp32
    float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return f32_from_bits(f32_bits(magnitude) | sign);
  }
  if (exponent == 31) return f32_from_bits(sign | 0x7f800000u | (mantissa << 13));  // inf or NaN
  // normal: move the exponent from bias 15 to bias 127 and widen the mantissa
  return f32_from_bits(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

uint16_t f32_to_f16(float f) {
  uint32_t u = f32_bits(f);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;       // NaN
  if (a >= 0x477ff000u) return sign | 0x7c00u;      // >= 65520 rounds past the largest half (65504)
  if (a < 0x38800000u) {
    // below 2^-14, the smallest normal half: the result is a subnormal, a count of 2^-24 steps.
    // Scaling by 2^24 is exact, and nearbyint rounds half to even in the default rounding mode.
    float steps = std::nearbyint(f32_from_bits(a) * 16777216.0f);
    return sign | static_cast<uint16_t>(steps);     // 1024 steps is 2^-14 itself: the encoding still fits
  }
  // normal: re-bias the exponent (127 -> 15), then drop 13 mantissa bits rounding to nearest even
  uint32_t rebased = a - (112u << 23);
  uint32_t lsb = (rebased >> 13) & 1u;
  return sign | static_cast<uint16_t>((rebased + 0xfffu + lsb) >> 13);
}

float load_as_f32(const void* data, DType dtype, size_t i) {
  switch (dtype) {
    case DType::F32: return static_cast<const float*>(data)[i];
    case DType::F64: return static_cast<float>(static_cast<const double*>(data)[i]);
    case DType::BF16: return bf16_to_f32(static_cast<const uint16_t*>(data)[i]);
    case DType::F16: return f16_to_f32(static_cast<const uint16_t*>(data)[i]);
    case DType::I32: return static_cast<float>(static_cast<const int32_t*>(data)[i]);
    case DType::I64: return static_cast<float>(static_cast<const int64_t*>(data)[i]);
    case DType::I16: return static_cast<float>(static_cast<const int16_t*>(data)[i]);
    case DType::I8: return static_cast<float>(static_cast<const int8_t*>(data)[i]);
    case DType::U8: case DType::BOOL: return static_cast<float>(static_cast<const uint8_t*>(data)[i]);
    case DType::F8_E4M3: return fp8_e4m3_to_f32(static_cast<const uint8_t*>(data)[i]);
    case DType::F8_E5M2: return fp8_e5m2_to_f32(static_cast<const uint8_t*>(data)[i]);
  }
  throw std::logic_error("load_as_f32: unknown dtype");
}

void store_from_f32(void* data, DType dtype, size_t i, float value) {
  switch (dtype) {
    case DType::F32: static_cast<float*>(data)[i] = value; return;
    case DType::F64: static_cast<double*>(data)[i] = value; return;
    case DType::BF16: static_cast<uint16_t*>(data)[i] = f32_to_bf16(value); return;
    case DType::F16: static_cast<uint16_t*>(data)[i] = f32_to_f16(value); return;
    case DType::I32: static_cast<int32_t*>(data)[i] = static_cast<int32_t>(value); return;
    case DType::I64: static_cast<int64_t*>(data)[i] = static_cast<int64_t>(value); return;
    default: break;
  }
  throw std::logic_error("store_from_f32: cannot store into " + std::string(dtype_name(dtype)));
}

}  // namespace tvllm
