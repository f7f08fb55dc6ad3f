// common/dtype.h: the dtype table and the host bf16/fp16 conversions.
//
// The conversions are checked against an independent oracle, round_by_definition() below: it finds the
// two neighbouring values of the narrow format in double arithmetic and picks the nearer one (ties to the
// even mantissa). It shares no line with the bit tricks in common/dtype.cpp, so an agreement means
// something. Where the compiler offers _Float16 (GCC >= 12 on x86-64), its conversion is a second oracle.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/random.h"

namespace tvllm {
namespace {

// ---- the dtype table --------------------------------------------------------------------------------

const DType kAllDtypes[] = {DType::F32, DType::F16, DType::BF16, DType::F64, DType::I64,
                            DType::I32, DType::I16, DType::I8,   DType::U8,  DType::BOOL};

TEST(DtypeTable, SizesAreTheSafetensorsElementSizes) {
  EXPECT_EQ(dtype_size(DType::F64), 8u);
  EXPECT_EQ(dtype_size(DType::I64), 8u);
  EXPECT_EQ(dtype_size(DType::F32), 4u);
  EXPECT_EQ(dtype_size(DType::I32), 4u);
  EXPECT_EQ(dtype_size(DType::F16), 2u);
  EXPECT_EQ(dtype_size(DType::BF16), 2u);
  EXPECT_EQ(dtype_size(DType::I16), 2u);
  EXPECT_EQ(dtype_size(DType::I8), 1u);
  EXPECT_EQ(dtype_size(DType::U8), 1u);
  EXPECT_EQ(dtype_size(DType::BOOL), 1u);
}

TEST(DtypeTable, NamesAreTheSafetensorsSpellings) {
  EXPECT_EQ(dtype_name(DType::F32), "F32");
  EXPECT_EQ(dtype_name(DType::F16), "F16");
  EXPECT_EQ(dtype_name(DType::BF16), "BF16");
  EXPECT_EQ(dtype_name(DType::F64), "F64");
  EXPECT_EQ(dtype_name(DType::I64), "I64");
  EXPECT_EQ(dtype_name(DType::I32), "I32");
  EXPECT_EQ(dtype_name(DType::I16), "I16");
  EXPECT_EQ(dtype_name(DType::I8), "I8");
  EXPECT_EQ(dtype_name(DType::U8), "U8");
  EXPECT_EQ(dtype_name(DType::BOOL), "BOOL");
}

TEST(DtypeTable, EveryNameParsesBackToItsDtype) {
  for (DType d : kAllDtypes) {
    std::optional<DType> parsed = parse_dtype(dtype_name(d));
    ASSERT_TRUE(parsed.has_value()) << dtype_name(d);
    EXPECT_EQ(*parsed, d) << dtype_name(d);
  }
}

TEST(DtypeTable, ParseRejectsUnknownSpellings) {
  // safetensors spells dtypes in upper case. F8_E4M3 and F8_E5M2 parse (lesson 16 loads them); the newer
  // 8-bit and 4-bit kinds (F8_E8M0, F8_E4M3FNUZ, F4) do not.
  for (const char* bad : {"", "f32", "bf16", "f8_e4m3", "F8_E8M0", "F8_E4M3FNUZ", "F4", "U16", "FLOAT", "BF16 ",
                          " F32", "F3"}) {
    EXPECT_FALSE(parse_dtype(bad).has_value()) << "'" << bad << "'";
  }
}

TEST(DtypeTable, IsFloating) {
  EXPECT_TRUE(is_floating(DType::F32));
  EXPECT_TRUE(is_floating(DType::F16));
  EXPECT_TRUE(is_floating(DType::BF16));
  EXPECT_TRUE(is_floating(DType::F64));
  // the 8-bit floats are storage only: without their scales they are not the model's numbers
  for (DType d : {DType::I64, DType::I32, DType::I16, DType::I8, DType::U8, DType::BOOL, DType::F8_E4M3,
                  DType::F8_E5M2}) {
    EXPECT_FALSE(is_floating(d)) << dtype_name(d);
  }
  EXPECT_TRUE(is_fp8(DType::F8_E4M3));
  EXPECT_TRUE(is_fp8(DType::F8_E5M2));
  EXPECT_FALSE(is_fp8(DType::U8));
  EXPECT_EQ(dtype_size(DType::F8_E4M3), 1u);
  EXPECT_EQ(dtype_size(DType::F8_E5M2), 1u);
}

// A few codes by hand (the exhaustive checks against an independent table are lesson 16's tests).
TEST(DtypeFp8, DecodesKnownCodes) {
  EXPECT_EQ(fp8_e4m3_to_f32(0x38), 1.0f);       // 0 0111 000: 2^(7-7)
  EXPECT_EQ(fp8_e4m3_to_f32(0x7e), 448.0f);     // 0 1111 110: the largest, 1.75 * 2^8
  EXPECT_EQ(fp8_e4m3_to_f32(0x01), 0x1p-9f);    // the smallest subnormal
  EXPECT_EQ(fp8_e4m3_to_f32(0x08), 0x1p-6f);    // the smallest normal
  EXPECT_EQ(fp8_e4m3_to_f32(0xc0), -2.0f);
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_f32(0x7f)));
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_f32(0xff)));
  EXPECT_EQ(fp8_e4m3_to_f32(0x78), 256.0f);     // 0 1111 000 is a number in E4M3fn, not infinity
  EXPECT_TRUE(std::signbit(fp8_e4m3_to_f32(0x80)));
  EXPECT_EQ(fp8_e5m2_to_f32(0x3c), 1.0f);       // 0 01111 00
  EXPECT_EQ(fp8_e5m2_to_f32(0x7b), 57344.0f);   // 0 11110 11: 1.75 * 2^15
  EXPECT_EQ(fp8_e5m2_to_f32(0x7c), std::numeric_limits<float>::infinity());
  EXPECT_EQ(fp8_e5m2_to_f32(0xfc), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(fp8_e5m2_to_f32(0x7d)));
  EXPECT_EQ(fp8_e5m2_to_f32(0x01), 0x1p-16f);
  const uint8_t codes[] = {0x38, 0xc0};
  EXPECT_EQ(load_as_f32(codes, DType::F8_E4M3, 1), -2.0f);
  EXPECT_EQ(load_as_f32(codes, DType::F8_E5M2, 0), 0.5f);  // 0 01110 00
}

// ---- the oracle -------------------------------------------------------------------------------------

struct Format {
  int significant_bits;  // p, the implicit leading bit included: bf16 8, fp16 11
  int exponent_bits;     // bf16 8, fp16 5
  int min_exponent;      // of the smallest normal: bf16 -126, fp16 -14 (subnormals share its quantum)
  int max_exponent;      // of the largest finite: bf16 127, fp16 15 (also the exponent bias)
};
constexpr Format kBf16{8, 8, -126, 127};
constexpr Format kF16{11, 5, -14, 15};

// The bits of the format's value nearest to x (ties to even), found by measuring distances. NaN is
// returned as the canonical quiet NaN; callers compare NaNs as "both NaN".
uint16_t round_by_definition(float x, Format f) {
  const int mbits = f.significant_bits - 1;
  const uint32_t sign = std::signbit(x) ? 0x8000u : 0u;
  const uint32_t exp_ones = ((1u << f.exponent_bits) - 1u) << mbits;
  if (std::isnan(x)) return static_cast<uint16_t>(sign | exp_ones | (1u << (mbits - 1)));
  if (std::isinf(x)) return static_cast<uint16_t>(sign | exp_ones);
  double a = std::fabs(static_cast<double>(x));
  if (a == 0.0) return static_cast<uint16_t>(sign);
  int e = 0;
  std::frexp(a, &e);                               // a = m * 2^e with m in [0.5, 1): leading bit 2^(e-1)
  int lead = std::max(e - 1, f.min_exponent);      // below the normal range the spacing stays fixed
  double quantum = std::ldexp(1.0, lead - mbits);  // the distance between neighbours around a
  double steps = a / quantum;                      // exact: a has 24 bits, quantum is a power of two
  double below = std::floor(steps);
  double frac = steps - below;
  double n = frac < 0.5 ? below : frac > 0.5 ? below + 1 : (std::fmod(below, 2.0) == 0.0 ? below : below + 1);
  double value = n * quantum;
  if (value >= std::ldexp(1.0, f.max_exponent + 1)) return static_cast<uint16_t>(sign | exp_ones);  // overflow
  if (value < std::ldexp(1.0, f.min_exponent)) {
    // subnormal: exponent field 0, mantissa counts quanta of 2^(emin - mbits)
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(value / std::ldexp(1.0, f.min_exponent - mbits)));
  }
  int ve = 0;
  std::frexp(value, &ve);  // rounding may have carried into the next binade: read the exponent again
  int vlead = ve - 1;
  uint32_t biased = static_cast<uint32_t>(vlead + f.max_exponent);
  uint32_t mantissa = static_cast<uint32_t>(value / std::ldexp(1.0, vlead - mbits)) - (1u << mbits);
  return static_cast<uint16_t>(sign | (biased << mbits) | mantissa);
}

bool bf16_is_nan(uint16_t b) { return (b & 0x7fffu) > 0x7f80u; }
bool f16_is_nan(uint16_t h) { return (h & 0x7fffu) > 0x7c00u; }

// The exact value of an fp16 pattern, decoded from the definition (in double).
double f16_value_by_definition(uint16_t h) {
  int sign = (h & 0x8000u) ? -1 : 1;
  int exponent = (h >> 10) & 0x1f;
  int mantissa = h & 0x3ff;
  if (exponent == 0) return sign * std::ldexp(static_cast<double>(mantissa), -24);
  if (exponent == 31) return mantissa ? std::numeric_limits<double>::quiet_NaN() : sign * INFINITY;
  return sign * std::ldexp(1.0 + mantissa / 1024.0, exponent - 15);
}

// The fp32 bit patterns every conversion test runs: every 16-bit top half combined with the low halves
// that decide rounding (exact, just below / at / just above the half-way point, and the ends), plus a
// strided sweep over all 2^32 patterns and random ones.
std::vector<uint32_t> interesting_f32_patterns() {
  std::vector<uint32_t> patterns;
  for (uint32_t hi = 0; hi < 65536; ++hi) {
    for (uint32_t lo : {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu}) patterns.push_back(hi << 16 | lo);
  }
  for (uint64_t u = 0; u < (uint64_t{1} << 32); u += 4099) patterns.push_back(static_cast<uint32_t>(u));
  Rng rng(2024);
  for (int i = 0; i < (1 << 20); ++i) patterns.push_back(static_cast<uint32_t>(rng.next_u64()));
  return patterns;
}

// ---- bf16 -------------------------------------------------------------------------------------------

TEST(Bf16, WideningIsTheTopHalfOfAnFp32) {
  EXPECT_EQ(bf16_to_f32(0x3f80), 1.0f);
  EXPECT_EQ(bf16_to_f32(0xc000), -2.0f);
  EXPECT_EQ(bf16_to_f32(0x4049), 3.140625f);
  EXPECT_EQ(bf16_to_f32(0x7f7f), 0x1.fep127f);  // the largest finite bf16, ~3.39e38
  EXPECT_EQ(bf16_to_f32(0x0080), 0x1p-126f);    // the smallest normal
  EXPECT_EQ(bf16_to_f32(0x0001), 0x1p-133f);    // the smallest subnormal
  EXPECT_TRUE(std::isinf(bf16_to_f32(0x7f80)) && bf16_to_f32(0x7f80) > 0);
  EXPECT_TRUE(std::isinf(bf16_to_f32(0xff80)) && bf16_to_f32(0xff80) < 0);
  EXPECT_TRUE(std::isnan(bf16_to_f32(0x7fc0)));
  EXPECT_TRUE(std::signbit(bf16_to_f32(0x8000)) && bf16_to_f32(0x8000) == 0.0f);
  for (uint32_t b = 0; b < 65536; ++b) {
    ASSERT_EQ(f32_bits(bf16_to_f32(static_cast<uint16_t>(b))), b << 16) << std::hex << b;
  }
}

TEST(Bf16, EveryPatternRoundTripsThroughFp32) {
  int nans = 0;
  for (uint32_t b = 0; b < 65536; ++b) {
    uint16_t bits = static_cast<uint16_t>(b);
    uint16_t back = f32_to_bf16(bf16_to_f32(bits));
    if (bf16_is_nan(bits)) {
      // a NaN comes back as a NaN of the same sign with the quiet bit set, the payload kept
      ++nans;
      ASSERT_EQ(back, bits | 0x0040u) << std::hex << b;
    } else {
      ASSERT_EQ(back, bits) << std::hex << b;
    }
  }
  EXPECT_EQ(nans, 2 * 127);  // 7 mantissa bits, not all zero, two signs
}

TEST(Bf16, NarrowingAgreesWithRoundingByDefinition) {
  for (uint32_t u : interesting_f32_patterns()) {
    float x = f32_from_bits(u);
    uint16_t got = f32_to_bf16(x);
    if (std::isnan(x)) {
      ASSERT_TRUE(bf16_is_nan(got)) << std::hex << u;
      ASSERT_EQ(got & 0x8000u, (u >> 16) & 0x8000u) << "NaN sign lost for " << std::hex << u;
    } else {
      ASSERT_EQ(got, round_by_definition(x, kBf16)) << "fp32 bits " << std::hex << u;
    }
  }
}

TEST(Bf16, TiesGoToTheEvenMantissa) {
  // 1 + 2^-8 lies half-way between 1 (mantissa ...0, even) and 1 + 2^-7 (odd): it goes down
  EXPECT_EQ(f32_to_bf16(0x1.01p0f), 0x3f80);
  // 1 + 3*2^-8 lies half-way between 1 + 2^-7 (odd) and 1 + 2^-6 (even): it goes up
  EXPECT_EQ(f32_to_bf16(0x1.03p0f), 0x3f82);
  // the same on the negative side
  EXPECT_EQ(f32_to_bf16(-0x1.01p0f), 0xbf80);
  EXPECT_EQ(f32_to_bf16(-0x1.03p0f), 0xbf82);
  // one fp32 ulp either side of a tie is no longer a tie
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0x3f808001)), 0x3f81);
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0x3f807fff)), 0x3f80);
  // every tie of the whole range, both parities: the result's last bit is 0
  for (uint32_t hi = 0; hi < 65536; ++hi) {
    float x = f32_from_bits(hi << 16 | 0x8000u);
    if (std::isnan(x) || std::isinf(x)) continue;
    uint16_t got = f32_to_bf16(x);
    uint16_t magnitude = static_cast<uint16_t>(hi & 0x7fffu);
    uint16_t want_magnitude = (magnitude & 1u) ? magnitude + 1 : magnitude;
    ASSERT_EQ(got, (hi & 0x8000u) | want_magnitude) << std::hex << hi;
    if (got != 0x7f80 && got != 0xff80) {
      ASSERT_EQ(got & 1u, 0u);
    }
  }
}

TEST(Bf16, KnownValues) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(f32_to_bf16(3.14159265f), 0x4049);  // 0x40490fdb: the dropped half 0x0fdb < 0x8000
  EXPECT_EQ(f32_to_bf16(0.1f), 0x3dcd);          // 0x3dcccccd: the dropped half 0xcccd > 0x8000
  EXPECT_EQ(f32_to_bf16(65504.0f), 0x4780);      // fp16's largest is 65536 in bf16
  EXPECT_EQ(f32_to_bf16(0.0f), 0x0000);
  EXPECT_EQ(f32_to_bf16(-0.0f), 0x8000);
}

TEST(Bf16, OverflowGoesToInfinity) {
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::max()), 0x7f80);   // past bf16 max + half an ulp
  EXPECT_EQ(f32_to_bf16(-std::numeric_limits<float>::max()), 0xff80);
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0x7f7f7fff)), 0x7f7f);  // just under the half-way point: stays finite
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0x7f7f8000)), 0x7f80);  // the tie: 0x7f7f is odd, so it rounds up to inf
  EXPECT_EQ(f32_to_bf16(INFINITY), 0x7f80);
  EXPECT_EQ(f32_to_bf16(-INFINITY), 0xff80);
}

TEST(Bf16, SubnormalsRoundLikeEverythingElse) {
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0x00000001)), 0x0000);  // the smallest fp32 subnormal: to zero
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0x80000001)), 0x8000);  // to negative zero
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0x00008000)), 0x0000);  // tie between 0 and the smallest bf16: even
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0x00008001)), 0x0001);
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0x00018000)), 0x0002);  // tie between 1 and 2 quanta: even
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0x007fffff)), 0x0080);  // the largest subnormal rounds up to normal
  EXPECT_EQ(f32_to_bf16(0x1p-126f), 0x0080);
}

TEST(Bf16, NanStaysNanWithItsSign) {
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0x7fc00000)), 0x7fc0);
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0xffc00000)), 0xffc0);
  // a signalling NaN whose payload sits only in the dropped half would become inf if merely rounded
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0x7f800001)), 0x7fc0);
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0xff800001)), 0xffc0);
  // the top payload bits survive, quieted
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0x7fa00000)), 0x7fe0);
  // a NaN whose low half is all ones must not carry into the sign bit
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0x7fffffff)), 0x7fff);
}

// ---- fp16 -------------------------------------------------------------------------------------------

TEST(F16, WideningKnownValues) {
  EXPECT_EQ(f16_to_f32(0x3c00), 1.0f);
  EXPECT_EQ(f16_to_f32(0xc000), -2.0f);
  EXPECT_EQ(f16_to_f32(0x7bff), 65504.0f);     // the largest finite fp16
  EXPECT_EQ(f16_to_f32(0x0400), 0x1p-14f);     // the smallest normal
  EXPECT_EQ(f16_to_f32(0x0001), 0x1p-24f);     // the smallest subnormal
  EXPECT_EQ(f16_to_f32(0x03ff), 1023 * 0x1p-24f);
  EXPECT_EQ(f16_to_f32(0x3555), 0x1.554p-2f);  // 0.333251953125
  EXPECT_TRUE(std::signbit(f16_to_f32(0x8000)) && f16_to_f32(0x8000) == 0.0f);
  EXPECT_EQ(f16_to_f32(0x7c00), INFINITY);
  EXPECT_EQ(f16_to_f32(0xfc00), -INFINITY);
  EXPECT_TRUE(std::isnan(f16_to_f32(0x7e00)));
  EXPECT_TRUE(std::isnan(f16_to_f32(0x7c01)));  // a signalling NaN must not turn into inf
}

TEST(F16, WideningIsExactForEveryPattern) {
  for (uint32_t h = 0; h < 65536; ++h) {
    uint16_t bits = static_cast<uint16_t>(h);
    float got = f16_to_f32(bits);
    double want = f16_value_by_definition(bits);
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << std::hex << h;
      ASSERT_EQ(std::signbit(got), (h & 0x8000u) != 0) << std::hex << h;
    } else {
      ASSERT_EQ(static_cast<double>(got), want) << std::hex << h;
      ASSERT_EQ(std::signbit(got), (h & 0x8000u) != 0) << std::hex << h;  // -0 stays -0
    }
  }
}

TEST(F16, EveryPatternRoundTripsThroughFp32) {
  for (uint32_t h = 0; h < 65536; ++h) {
    uint16_t bits = static_cast<uint16_t>(h);
    uint16_t back = f32_to_f16(f16_to_f32(bits));
    if (f16_is_nan(bits)) {
      ASSERT_TRUE(f16_is_nan(back)) << std::hex << h;
      ASSERT_EQ(back & 0x8000u, bits & 0x8000u) << std::hex << h;
    } else {
      ASSERT_EQ(back, bits) << std::hex << h;
    }
  }
}

TEST(F16, NarrowingAgreesWithRoundingByDefinition) {
  for (uint32_t u : interesting_f32_patterns()) {
    float x = f32_from_bits(u);
    uint16_t got = f32_to_f16(x);
    if (std::isnan(x)) {
      ASSERT_TRUE(f16_is_nan(got)) << std::hex << u;
      ASSERT_EQ(got & 0x8000u, (u >> 16) & 0x8000u) << std::hex << u;
    } else {
      ASSERT_EQ(got, round_by_definition(x, kF16)) << "fp32 bits " << std::hex << u;
    }
  }
}

TEST(F16, EveryTieBetweenNeighboursGoesToEven) {
  // fp16 has 11 significant bits, so the midpoint of two neighbours (12 bits) is exact in fp32
  for (uint32_t h = 0; h < 0x7c00; ++h) {  // every finite non-negative fp16, and its successor
    double lo = f16_value_by_definition(static_cast<uint16_t>(h));
    double hi = h + 1 < 0x7c00 ? f16_value_by_definition(static_cast<uint16_t>(h + 1)) : 65536.0;
    float mid = static_cast<float>((lo + hi) / 2);
    ASSERT_EQ(static_cast<double>(mid), (lo + hi) / 2) << "midpoint not exact in fp32 at " << std::hex << h;
    uint16_t even = (h & 1u) ? static_cast<uint16_t>(h + 1) : static_cast<uint16_t>(h);
    ASSERT_EQ(f32_to_f16(mid), even) << std::hex << h;
    ASSERT_EQ(f32_to_f16(-mid), even | 0x8000u) << std::hex << h;
    ASSERT_EQ(f32_to_f16(std::nextafter(mid, 0.0f)), h) << std::hex << h;
    ASSERT_EQ(f32_to_f16(std::nextafter(mid, INFINITY)), h + 1) << std::hex << h;
  }
}

TEST(F16, OverflowAndUnderflow) {
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(65519.99f), 0x7bff);  // below the half-way point to 65536
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);   // the tie: 0x7bff is odd, so it rounds up, to inf
  EXPECT_EQ(f32_to_f16(70000.0f), 0x7c00);
  EXPECT_EQ(f32_to_f16(-1e9f), 0xfc00);
  EXPECT_EQ(f32_to_f16(std::numeric_limits<float>::max()), 0x7c00);
  EXPECT_EQ(f32_to_f16(0x1p-25f), 0x0000);         // half the smallest subnormal: tie, to even (zero)
  EXPECT_EQ(f32_to_f16(-0x1p-25f), 0x8000);
  EXPECT_EQ(f32_to_f16(0x1.000002p-25f), 0x0001);  // just above the tie
  EXPECT_EQ(f32_to_f16(0x1.8p-24f), 0x0002);       // 1.5 quanta: tie between 1 and 2, to even
  EXPECT_EQ(f32_to_f16(0x1p-26f), 0x0000);
  EXPECT_EQ(f32_to_f16(0x1.ffcp-15f), 0x0400);     // half-way from the largest subnormal to 2^-14: up
  EXPECT_EQ(f32_to_f16(f32_from_bits(0x00000001)), 0x0000);
  EXPECT_EQ(f32_to_f16(1e-8f), 0x0000);            // below 2^-25: fp16 loses it entirely
}

TEST(F16, NanStaysNan) {
  EXPECT_TRUE(f16_is_nan(f32_to_f16(NAN)));
  EXPECT_TRUE(f16_is_nan(f32_to_f16(f32_from_bits(0x7f800001))));  // payload only in the low bits
  EXPECT_EQ(f32_to_f16(f32_from_bits(0xffc00000)) & 0x8000u, 0x8000u);
  EXPECT_EQ(f32_to_f16(INFINITY), 0x7c00);
  EXPECT_EQ(f32_to_f16(-INFINITY), 0xfc00);
}

#if defined(__FLT16_MANT_DIG__) && defined(__x86_64__)
// GCC's _Float16 conversion (libgcc or F16C) is a second, independent implementation of the same rounding.
TEST(F16, AgreesWithTheCompilersFloat16) {
  for (uint32_t u : interesting_f32_patterns()) {
    float x = f32_from_bits(u);
    if (std::isnan(x)) continue;
    _Float16 h = static_cast<_Float16>(x);
    uint16_t want;
    std::memcpy(&want, &h, sizeof want);
    ASSERT_EQ(f32_to_f16(x), want) << "fp32 bits " << std::hex << u;
  }
}
#endif

// ---- load_as_f32 / store_from_f32 ---------------------------------------------------------------------

TEST(LoadStore, LoadsEveryDtypeAsFp32) {
  const float f32[] = {1.5f, -2.0f};
  const double f64[] = {0.25, -1e10};
  const uint16_t bf16[] = {0x3f80, 0xc040};  // 1, -3
  const uint16_t f16[] = {0x3c00, 0xc200};   // 1, -3
  const int32_t i32[] = {7, -100000};
  const int64_t i64[] = {-5, int64_t{1} << 40};
  const int16_t i16[] = {-32768, 12};
  const int8_t i8[] = {-128, 127};
  const uint8_t u8[] = {255, 0};
  const uint8_t b[] = {1, 0};
  EXPECT_EQ(load_as_f32(f32, DType::F32, 1), -2.0f);
  EXPECT_EQ(load_as_f32(f64, DType::F64, 0), 0.25f);
  EXPECT_EQ(load_as_f32(f64, DType::F64, 1), -1e10f);
  EXPECT_EQ(load_as_f32(bf16, DType::BF16, 1), -3.0f);
  EXPECT_EQ(load_as_f32(f16, DType::F16, 1), -3.0f);
  EXPECT_EQ(load_as_f32(i32, DType::I32, 1), -100000.0f);
  EXPECT_EQ(load_as_f32(i64, DType::I64, 1), 0x1p40f);
  EXPECT_EQ(load_as_f32(i16, DType::I16, 0), -32768.0f);
  EXPECT_EQ(load_as_f32(i8, DType::I8, 0), -128.0f);
  EXPECT_EQ(load_as_f32(u8, DType::U8, 0), 255.0f);
  EXPECT_EQ(load_as_f32(b, DType::BOOL, 0), 1.0f);
}

TEST(LoadStore, StoresRoundTheSameWayAsTheConversions) {
  uint16_t h[2] = {0, 0};
  store_from_f32(h, DType::BF16, 1, 0x1.03p0f);  // a tie: to even
  EXPECT_EQ(h[1], 0x3f82);
  store_from_f32(h, DType::F16, 0, 65520.0f);  // overflows fp16
  EXPECT_EQ(h[0], 0x7c00);
  float f[1];
  store_from_f32(f, DType::F32, 0, -0.5f);
  EXPECT_EQ(f[0], -0.5f);
  double d[1];
  store_from_f32(d, DType::F64, 0, 0.1f);
  EXPECT_EQ(d[0], static_cast<double>(0.1f));
  int32_t i[1];
  store_from_f32(i, DType::I32, 0, 42.0f);
  EXPECT_EQ(i[0], 42);
  int64_t l[1];
  store_from_f32(l, DType::I64, 0, -7.0f);
  EXPECT_EQ(l[0], -7);
}

TEST(LoadStore, StoringIntoASmallIntegerTypeThrows) {
  uint8_t u[1] = {0};
  EXPECT_THROW(store_from_f32(u, DType::U8, 0, 1.0f), std::logic_error);
  EXPECT_THROW(store_from_f32(u, DType::BOOL, 0, 1.0f), std::logic_error);
  EXPECT_THROW(store_from_f32(u, DType::I8, 0, 1.0f), std::logic_error);
}

}  // namespace
}  // namespace tvllm
