// Lesson 16, the CPU side of the 8-bit formats: the encoders (bit arithmetic, the lesson's exercise),
// the independent table oracle they are checked against, and the conversions on views.
#include <algorithm>
#include <cmath>
#include <limits>

#include "common/errors.h"
#include "common/exercise.h"
#include "fp8.h"

namespace tvllm {

namespace {

constexpr Fp8Format kE4M3{"E4M3", DType::F8_E4M3, 4, 3, 7, 448.0f, 0x1p-6f, 0x1p-9f, false, 0x7e};
constexpr Fp8Format kE5M2{"E5M2", DType::F8_E5M2, 5, 2, 15, 57344.0f, 0x1p-14f, 0x1p-16f, true, 0x7b};

}  // namespace

const Fp8Format& fp8_format(Fp8Kind kind) { return kind == Fp8Kind::E4M3 ? kE4M3 : kE5M2; }

Fp8Kind fp8_kind_of(DType dtype) {
  if (dtype == DType::F8_E4M3) return Fp8Kind::E4M3;
  if (dtype == DType::F8_E5M2) return Fp8Kind::E5M2;
  throw InputError("expected an 8-bit float dtype (F8_E4M3 or F8_E5M2), got " + std::string(dtype_name(dtype)));
}

float fp8_to_f32(Fp8Kind kind, uint8_t code) {
  return kind == Fp8Kind::E4M3 ? fp8_e4m3_to_f32(code) : fp8_e5m2_to_f32(code);
}

// ---- the encoders --------------------------------------------------------------------------------------
//
// Both follow common/dtype.h's f32_to_f16 (lesson 02): deal with NaN and the top of the range first, then
// the subnormals (a count of fixed steps, rounded by nearbyint), then the normal numbers (move the
// exponent to the new bias and drop the low mantissa bits, rounding to nearest even on the bits).

uint8_t f32_to_fp8_e4m3(float x) {
  // --- exercise 16.1: E4M3, rounding and saturation on the bits -------------------------------------
  // Task: return the E4M3 code nearest to x (round to nearest, ties to even) with the sign of x.
  //   Saturate: every |x| >= 448 (infinity included) gives ±448 (0x7e with the sign bit 0x80); NaN gives
  //   0x7f with the sign of x. Below 2^-6 (the smallest normal) the values are subnormal: multiples of
  //   2^-9, code = the multiple. Above, re-bias the exponent from 127 to 7 and keep 3 of the 23 mantissa
  //   bits, rounding on the bits as lesson 02 does for bf16.
  // Hint: x * 512 counts steps of 2^-9 exactly; std::nearbyint rounds it half to even. A count of 8 is
  //   2^-6 itself, whose code is 0x08: it still encodes right.
  // Hint: subtracting (127 - 7) << 23 from the bits re-biases the exponent; then add 0x7ffff plus the
  //   last kept bit (bit 20) and shift right by 20. Below 448 the carry can never reach the NaN code.
  // Tests: Fp8Encode16.E4M3KnownAnswers Fp8Encode16.E4M3EveryFloatMatchesTheTable
  // Tests: Fp8Encode16.E4M3EveryCodeRoundTrips Fp8Encode16.E4M3SaturatesAndKeepsNaN lesson16_quantization.cpu
  // Stub:
  //   (void)x;
  //   throw NotWrittenYet("16.1", "E4M3, rounding and saturation on the bits");
  // --- solution ---
  const uint32_t u = f32_bits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7fu;                 // NaN stays NaN
  if (a >= 0x43e00000u) return sign | 0x7eu;                // |x| >= 448 (inf too): saturate to ±448
  if (a < 0x3c800000u) {                                    // |x| < 2^-6: a subnormal, m * 2^-9
    const float steps = std::nearbyint(f32_from_bits(a) * 512.0f);
    return sign | static_cast<uint8_t>(steps);
  }
  const uint32_t rebased = a - (120u << 23);                // exponent bias 127 -> 7
  const uint32_t lsb = (rebased >> 20) & 1u;                // the last mantissa bit we keep
  return sign | static_cast<uint8_t>((rebased + 0x7ffffu + lsb) >> 20);
  // --- end of exercise 16.1 ---
}

uint8_t f32_to_fp8_e5m2(float x) {
  const uint32_t u = f32_bits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7eu;                 // NaN: all-ones exponent, top mantissa bit
  if (a >= 0x47600000u) return sign | 0x7bu;                // |x| >= 57344 (inf too): saturate
  if (a < 0x38800000u) {                                    // |x| < 2^-14: a subnormal, m * 2^-16
    const float steps = std::nearbyint(f32_from_bits(a) * 65536.0f);
    return sign | static_cast<uint8_t>(steps);
  }
  const uint32_t rebased = a - (112u << 23);                // exponent bias 127 -> 15
  const uint32_t lsb = (rebased >> 21) & 1u;
  return sign | static_cast<uint8_t>((rebased + 0xfffffu + lsb) >> 21);
}

uint8_t f32_to_fp8(Fp8Kind kind, float x) {
  return kind == Fp8Kind::E4M3 ? f32_to_fp8_e4m3(x) : f32_to_fp8_e5m2(x);
}

uint8_t f32_to_fp8_e4m3_torch_cast(float x) {
  // The same rounding without the clamp. Below 448 nothing differs; from 448 to 464 the nearest value is
  // still 448 (464 is the tie with the would-be 480, and 448's code is even); past 464 the rounding would
  // carry onto 0x7f, which E4M3fn spends on NaN. Infinity and NaN: NaN.
  const uint32_t a = f32_bits(x) & 0x7fffffffu;
  if (a > 0x43e80000u) return static_cast<uint8_t>(((f32_bits(x) >> 24) & 0x80u) | 0x7fu);  // |x| > 464
  return f32_to_fp8_e4m3(x);
}

// ---- the oracle: the format's values by definition, the nearest one by brute force -------------------

std::vector<Fp8TableEntry> fp8_value_table(Fp8Kind kind) {
  const Fp8Format& f = fp8_format(kind);
  const int mantissa_count = 1 << f.mantissa_bits;
  std::vector<Fp8TableEntry> table;
  for (int e = 0; e < (1 << f.exponent_bits); ++e) {
    for (int m = 0; m < mantissa_count; ++m) {
      const int code = (e << f.mantissa_bits) | m;
      const bool top_binade = e == (1 << f.exponent_bits) - 1;
      if (f.has_infinity && top_binade) continue;              // E5M2: inf and NaN
      if (!f.has_infinity && top_binade && m == mantissa_count - 1) continue;  // E4M3: the NaN
      // subnormal: 0.m * 2^(1 - bias); normal: 1.m * 2^(e - bias)
      const double fraction = static_cast<double>(m) / mantissa_count;
      const double value = e == 0 ? fraction * std::pow(2.0, 1 - f.bias) : (1.0 + fraction) * std::pow(2.0, e - f.bias);
      table.push_back({value, static_cast<uint8_t>(code)});
    }
  }
  std::sort(table.begin(), table.end(), [](const Fp8TableEntry& a, const Fp8TableEntry& b) { return a.value < b.value; });
  return table;
}

uint8_t fp8_round_by_table(const std::vector<Fp8TableEntry>& table, Fp8Kind kind, float x) {
  const uint8_t sign = std::signbit(x) ? 0x80u : 0x00u;
  if (std::isnan(x)) return sign | (kind == Fp8Kind::E4M3 ? 0x7fu : 0x7eu);
  const double a = std::fabs(static_cast<double>(x));
  if (a >= table.back().value) return sign | table.back().code;  // saturation (inf included)
  // The first entry >= a and the one before it are the two candidates.
  auto above = std::lower_bound(table.begin(), table.end(), a,
                                [](const Fp8TableEntry& e, double v) { return e.value < v; });
  if (above->value == a || above == table.begin()) return sign | above->code;
  auto below = above - 1;
  const double d_below = a - below->value, d_above = above->value - a;  // exact: both are short binary numbers
  if (d_below < d_above) return sign | below->code;
  if (d_above < d_below) return sign | above->code;
  return sign | ((below->code & 1u) == 0 ? below->code : above->code);  // a tie: the even code
}

// ---- conversions on views -----------------------------------------------------------------------------

const std::vector<std::string>& fp8_kernel_versions() {
  static const std::vector<std::string> versions = {"v1", "v2"};
  return versions;
}

namespace {

void require_pair(const char* what, const TensorView& out, const TensorView& x) {
  const std::string name = what;
  TVLLM_REQUIRE(x.numel() == out.numel(), name + ": x " + x.describe() + " and out " + out.describe() +
                                              " have different element counts");
  TVLLM_REQUIRE(x.device == out.device, name + ": x and out are on different devices");
  TVLLM_REQUIRE(x.is_contiguous() && out.is_contiguous(), name + ": x and out must be contiguous");
  TVLLM_REQUIRE(x.numel() == 0 || (x.data && out.data), name + ": null data pointer");
}

}  // namespace

void convert_f32_to_fp8(const TensorView& out, const TensorView& x, const std::string& kernel, cudaStream_t stream) {
  TVLLM_REQUIRE(x.dtype == DType::F32 && is_fp8(out.dtype),
                "convert_f32_to_fp8: expects x F32 and out F8_E4M3 or F8_E5M2, got x " + x.describe() + " and out " +
                    out.describe());
  require_pair("convert_f32_to_fp8", out, x);
  const std::vector<std::string>& versions = fp8_kernel_versions();
  TVLLM_REQUIRE(std::find(versions.begin(), versions.end(), kernel) != versions.end(),
                "convert_f32_to_fp8: unknown kernel '" + kernel + "' (expected v1 or v2)");
  const Fp8Kind kind = fp8_kind_of(out.dtype);
  const int64_t n = x.numel();
  if (x.device == Device::CPU) {
    const float* in = x.ptr<float>();
    uint8_t* o = out.ptr<uint8_t>();
    for (int64_t i = 0; i < n; ++i) o[i] = f32_to_fp8(kind, in[i]);
  } else {
    f32_to_fp8_cuda(out.ptr<uint8_t>(), x.ptr<float>(), n, kind, kernel, stream);
  }
}

void convert_fp8_to_f32(const TensorView& out, const TensorView& x, cudaStream_t stream) {
  TVLLM_REQUIRE(is_fp8(x.dtype) && out.dtype == DType::F32,
                "convert_fp8_to_f32: expects x F8_E4M3 or F8_E5M2 and out F32, got x " + x.describe() + " and out " +
                    out.describe());
  require_pair("convert_fp8_to_f32", out, x);
  const Fp8Kind kind = fp8_kind_of(x.dtype);
  const int64_t n = x.numel();
  if (x.device == Device::CPU) {
    const uint8_t* in = x.ptr<uint8_t>();
    float* o = out.ptr<float>();
    for (int64_t i = 0; i < n; ++i) o[i] = fp8_to_f32(kind, in[i]);
  } else {
    fp8_to_f32_cuda(out.ptr<float>(), x.ptr<uint8_t>(), n, kind, stream);
  }
}

}  // namespace tvllm
