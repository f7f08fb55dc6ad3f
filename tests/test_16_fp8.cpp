// Lesson 16 on the CPU: the 8-bit formats. Every code decodes to the value its definition gives and
// round-trips; the encoders agree with a brute-force oracle (the nearest entry of a table of the
// format's values, built from powers of two, ties to the even code) on EVERY fp32 bit pattern; the
// saturating encoder and torch's plain cast differ exactly where the chapter says.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <thread>
#include <vector>

#include "common/errors.h"
#include "fp8.h"

namespace tvllm {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

bool is_nan_code(Fp8Kind kind, uint8_t c) {
  return kind == Fp8Kind::E4M3 ? (c & 0x7fu) == 0x7fu : (c & 0x7fu) > 0x7cu;
}

// The table is what the oracle uses; check it against the decoder of common/dtype.h first, code by code.
void expect_table_matches_decoder(Fp8Kind kind, size_t expected_entries) {
  const std::vector<Fp8TableEntry> table = fp8_value_table(kind);
  ASSERT_EQ(table.size(), expected_entries);
  EXPECT_EQ(table.front().value, 0.0);
  EXPECT_EQ(table.back().value, static_cast<double>(fp8_format(kind).max_finite));
  EXPECT_EQ(table.back().code, fp8_format(kind).max_code);
  EXPECT_EQ(table[1].value, static_cast<double>(fp8_format(kind).min_subnormal));
  for (const Fp8TableEntry& e : table) {
    EXPECT_EQ(static_cast<double>(fp8_to_f32(kind, e.code)), e.value) << std::hex << int(e.code);
    EXPECT_EQ(static_cast<double>(fp8_to_f32(kind, e.code | 0x80u)), -e.value) << std::hex << int(e.code);
  }
  for (size_t i = 1; i < table.size(); ++i) EXPECT_LT(table[i - 1].value, table[i].value);  // strictly ascending
}

TEST(Fp8Formats16, TablesMatchTheDecoders) {
  expect_table_matches_decoder(Fp8Kind::E4M3, 127);  // codes 0x00..0x7e (0x7f is NaN)
  expect_table_matches_decoder(Fp8Kind::E5M2, 124);  // codes 0x00..0x7b (0x7c inf, 0x7d..0x7f NaN)
}

TEST(Fp8Formats16, SpecialCodes) {
  int e4m3_nans = 0, e5m2_nans = 0, e5m2_infs = 0;
  for (int c = 0; c < 256; ++c) {
    const float a = fp8_to_f32(Fp8Kind::E4M3, static_cast<uint8_t>(c));
    const float b = fp8_to_f32(Fp8Kind::E5M2, static_cast<uint8_t>(c));
    e4m3_nans += std::isnan(a);
    EXPECT_FALSE(std::isinf(a)) << "E4M3 has no infinity, code " << c;
    e5m2_nans += std::isnan(b);
    e5m2_infs += std::isinf(b);
  }
  EXPECT_EQ(e4m3_nans, 2);  // 0x7f, 0xff
  EXPECT_EQ(e5m2_nans, 6);  // 0x7d..0x7f and their negatives
  EXPECT_EQ(e5m2_infs, 2);
}

// ---- encoding --------------------------------------------------------------------------------------------

TEST(Fp8Encode16, E4M3KnownAnswers) {
  EXPECT_EQ(f32_to_fp8_e4m3(1.0f), 0x38);
  EXPECT_EQ(f32_to_fp8_e4m3(-2.0f), 0xc0);
  EXPECT_EQ(f32_to_fp8_e4m3(448.0f), 0x7e);
  EXPECT_EQ(f32_to_fp8_e4m3(0.0f), 0x00);
  EXPECT_EQ(f32_to_fp8_e4m3(-0.0f), 0x80);
  // 1.0625 is halfway between 1 (0x38, even) and 1.125 (0x39): to the even one. 1.1875 is halfway between
  // 1.125 (odd) and 1.25 (0x3a, even): up.
  EXPECT_EQ(f32_to_fp8_e4m3(1.0625f), 0x38);
  EXPECT_EQ(f32_to_fp8_e4m3(1.1875f), 0x3a);
  EXPECT_EQ(f32_to_fp8_e4m3(std::nextafter(1.0625f, 2.0f)), 0x39);
  // subnormals: steps of 2^-9. 1.5 steps is a tie between 1 (odd) and 2: up; 2.5 between 2 and 3: down.
  EXPECT_EQ(f32_to_fp8_e4m3(0x1p-9f), 0x01);
  EXPECT_EQ(f32_to_fp8_e4m3(1.5f * 0x1p-9f), 0x02);
  EXPECT_EQ(f32_to_fp8_e4m3(2.5f * 0x1p-9f), 0x02);
  EXPECT_EQ(f32_to_fp8_e4m3(0x1p-10f), 0x00);                 // half the smallest: a tie, to zero (even)
  EXPECT_EQ(f32_to_fp8_e4m3(std::nextafter(0x1p-10f, 1.0f)), 0x01);
  EXPECT_EQ(f32_to_fp8_e4m3(7.5f * 0x1p-9f), 0x08);           // rounds up into the smallest normal, 2^-6
  EXPECT_EQ(f32_to_fp8_e4m3(0.1f), 0x1d);                     // 0.1 -> 0.1015625 = 1.625 * 2^-4
}

TEST(Fp8Encode16, E4M3SaturatesAndKeepsNaN) {
  for (float big : {449.0f, 464.0f, 465.0f, 480.0f, 1e6f, 3.4e38f, kInf}) {
    EXPECT_EQ(f32_to_fp8_e4m3(big), 0x7e) << big;
    EXPECT_EQ(f32_to_fp8_e4m3(-big), 0xfe) << big;
  }
  EXPECT_EQ(f32_to_fp8_e4m3(kNaN), 0x7f);
  EXPECT_EQ(f32_to_fp8_e4m3(-kNaN), 0xff);
}

TEST(Fp8Encode16, E5M2KnownAnswers) {
  EXPECT_EQ(f32_to_fp8_e5m2(1.0f), 0x3c);
  EXPECT_EQ(f32_to_fp8_e5m2(57344.0f), 0x7b);
  EXPECT_EQ(f32_to_fp8_e5m2(kInf), 0x7b);        // saturating: inf becomes the largest finite value
  EXPECT_EQ(f32_to_fp8_e5m2(-1e9f), 0xfb);
  EXPECT_EQ(f32_to_fp8_e5m2(1.125f), 0x3c);       // tie between 1 (even) and 1.25
  EXPECT_EQ(f32_to_fp8_e5m2(1.375f), 0x3e);       // tie between 1.25 (odd) and 1.5: up
  EXPECT_EQ(f32_to_fp8_e5m2(0x1p-16f), 0x01);
  EXPECT_TRUE(is_nan_code(Fp8Kind::E5M2, f32_to_fp8_e5m2(kNaN)));
}

// torch's `.to(torch.float8_e4m3fn)`: no saturation. 448..464 still round to 448; past 464 is NaN.
TEST(Fp8Encode16, TorchCastDoesNotSaturate) {
  EXPECT_EQ(f32_to_fp8_e4m3_torch_cast(448.0f), 0x7e);
  EXPECT_EQ(f32_to_fp8_e4m3_torch_cast(464.0f), 0x7e);         // the tie goes to 448 (even)
  EXPECT_EQ(f32_to_fp8_e4m3_torch_cast(std::nextafter(464.0f, 1e9f)), 0x7f);  // NaN
  EXPECT_EQ(f32_to_fp8_e4m3_torch_cast(-500.0f), 0xff);
  EXPECT_EQ(f32_to_fp8_e4m3_torch_cast(kInf), 0x7f);
  EXPECT_EQ(f32_to_fp8_e4m3_torch_cast(-kNaN), 0xff);
  EXPECT_EQ(f32_to_fp8_e4m3_torch_cast(300.0f), 0x79);  // inside the range nothing differs
}

TEST(Fp8Encode16, E4M3EveryCodeRoundTrips) {
  for (int c = 0; c < 256; ++c) {
    const uint8_t code = static_cast<uint8_t>(c);
    const float v = fp8_to_f32(Fp8Kind::E4M3, code);
    if (std::isnan(v)) {
      EXPECT_EQ(f32_to_fp8_e4m3(v) & 0x7f, 0x7f);
    } else {
      EXPECT_EQ(f32_to_fp8_e4m3(v), code) << "code " << c;
    }
  }
}

TEST(Fp8Encode16, E5M2EveryCodeRoundTrips) {
  for (int c = 0; c < 256; ++c) {
    const uint8_t code = static_cast<uint8_t>(c);
    const float v = fp8_to_f32(Fp8Kind::E5M2, code);
    if (std::isnan(v)) EXPECT_TRUE(is_nan_code(Fp8Kind::E5M2, f32_to_fp8_e5m2(v)));
    else if (std::isinf(v)) EXPECT_EQ(f32_to_fp8_e5m2(v), (code & 0x80u) | 0x7bu);  // saturates
    else EXPECT_EQ(f32_to_fp8_e5m2(v), code) << "code " << c;
  }
}

// The exhaustive check: all 2^32 fp32 patterns, the fast encoder against the table oracle. The oracle's
// binary search per float would take minutes, so the sweep walks the positive floats in increasing
// order (their bit patterns sort like their values) with a pointer into the table: each float is compared
// with the midpoint between the current entry and the next, computed in double. This is the same rule
// as fp8_round_by_table (nearest; a tie to the even code; beyond the last entry the last one), which a
// random sample also checks directly. The negative half must be the positive half with the sign bit set.
// Two threads, one per half of the positive range; about 2 x 2^30 floats each, a few seconds.
void expect_every_float_matches_table(Fp8Kind kind) {
  const std::vector<Fp8TableEntry> table = fp8_value_table(kind);
  const uint32_t positive_finite_end = 0x7f800000u;  // +inf's pattern
  auto sweep = [&](uint32_t begin, uint32_t end, uint64_t* mismatches, uint32_t* first_bad) {
    // the entry at or below the first float of the slice
    const double first = static_cast<double>(f32_from_bits(begin));
    size_t k = 0;
    while (k + 1 < table.size() && table[k + 1].value <= first) ++k;
    for (uint32_t u = begin; u < end; ++u) {
      const float x = f32_from_bits(u);
      const double a = static_cast<double>(x);
      while (k + 1 < table.size() && table[k + 1].value <= a) ++k;
      uint8_t want;
      if (k + 1 == table.size()) {
        want = table[k].code;  // at or beyond the largest value: saturation
      } else {
        const double mid = 0.5 * (table[k].value + table[k + 1].value);  // exact in double
        want = a < mid ? table[k].code : a > mid ? table[k + 1].code
                                                 : ((table[k].code & 1u) == 0 ? table[k].code : table[k + 1].code);
      }
      const uint8_t pos = f32_to_fp8(kind, x), neg = f32_to_fp8(kind, -x);
      if (pos != want || neg != (want | 0x80u)) {
        if ((*mismatches)++ == 0) *first_bad = u;
      }
    }
  };
  uint64_t bad[2] = {0, 0};
  uint32_t first_bad[2] = {0, 0};
  const uint32_t half = positive_finite_end / 2;
  std::thread t([&] { sweep(half, positive_finite_end, &bad[1], &first_bad[1]); });
  sweep(0, half, &bad[0], &first_bad[0]);
  t.join();
  EXPECT_EQ(bad[0], 0u) << "first mismatch at fp32 pattern 0x" << std::hex << first_bad[0];
  EXPECT_EQ(bad[1], 0u) << "first mismatch at fp32 pattern 0x" << std::hex << first_bad[1];
  // The specials, against the oracle function itself.
  for (float x : {kInf, -kInf, kNaN, -kNaN}) {
    const uint8_t want = fp8_round_by_table(table, kind, x), got = f32_to_fp8(kind, x);
    if (std::isnan(x)) EXPECT_TRUE(is_nan_code(kind, got) && (got & 0x80u) == (want & 0x80u));
    else EXPECT_EQ(got, want) << x;
  }
}

TEST(Fp8Encode16, E4M3EveryFloatMatchesTheTable) { expect_every_float_matches_table(Fp8Kind::E4M3); }
TEST(Fp8Encode16, E5M2EveryFloatMatchesTheTable) { expect_every_float_matches_table(Fp8Kind::E5M2); }

// The oracle function itself (binary search, distances) against the encoders on random patterns and on
// every midpoint between adjacent values and its two neighbouring floats.
TEST(Fp8Encode16, TableOracleAgreesOnMidpointsAndRandomPatterns) {
  for (Fp8Kind kind : {Fp8Kind::E4M3, Fp8Kind::E5M2}) {
    const std::vector<Fp8TableEntry> table = fp8_value_table(kind);
    std::vector<float> xs;
    for (size_t i = 0; i + 1 < table.size(); ++i) {
      const float mid = static_cast<float>(0.5 * (table[i].value + table[i + 1].value));  // exact in fp32
      xs.insert(xs.end(), {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, kInf), -mid});
    }
    uint64_t state = 12345;
    for (int i = 0; i < (1 << 20); ++i) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      const float x = f32_from_bits(static_cast<uint32_t>(state >> 32));
      if (!std::isnan(x)) xs.push_back(x);
    }
    for (float x : xs) ASSERT_EQ(f32_to_fp8(kind, x), fp8_round_by_table(table, kind, x)) << x;
  }
}

TEST(Fp8Convert16, ViewsOnTheCpu) {
  std::vector<float> x = {1.0f, -0.1f, 500.0f, 0x1p-12f};
  std::vector<uint8_t> q(4);
  std::vector<float> back(4);
  convert_f32_to_fp8(TensorView::contiguous(q.data(), DType::F8_E4M3, Device::CPU, {4}),
                     TensorView::contiguous(x.data(), DType::F32, Device::CPU, {4}));
  EXPECT_EQ(q, (std::vector<uint8_t>{0x38, 0x9d, 0x7e, 0x00}));
  convert_fp8_to_f32(TensorView::contiguous(back.data(), DType::F32, Device::CPU, {4}),
                     TensorView::contiguous(q.data(), DType::F8_E4M3, Device::CPU, {4}));
  EXPECT_EQ(back, (std::vector<float>{1.0f, -0.1015625f, 448.0f, 0.0f}));
  EXPECT_THROW(convert_f32_to_fp8(TensorView::contiguous(q.data(), DType::U8, Device::CPU, {4}),
                                  TensorView::contiguous(x.data(), DType::F32, Device::CPU, {4})),
               InputError);
  EXPECT_THROW(convert_f32_to_fp8(TensorView::contiguous(q.data(), DType::F8_E4M3, Device::CPU, {4}),
                                  TensorView::contiguous(x.data(), DType::F32, Device::CPU, {4}), "v9"),
               InputError);
}

}  // namespace
}  // namespace tvllm
