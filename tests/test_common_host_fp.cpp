// Host floating point does not depend on the compiler's target: `a * x + y` in host code rounds twice
// (the product, then the sum), never once as a fused multiply-add. GCC contracts it into an FMA whenever
// the target has one (-march=native, -march=haswell), also under -std=c++20, unless told
// -ffp-contract=off, which the top-level CMakeLists.txt passes for all host code. Every CPU reference of
// the course (lesson 00's unfused SAXPY, lesson 05's rotation, lesson 05's Llama 3 frequencies) relies on
// it. These tests fail if the flag is lost and the build targets a CPU with FMA.
#include <gtest/gtest.h>

#include <cmath>

namespace {

// The inputs come through volatile reads so the compiler cannot fold the arithmetic at compile time
// (constant folding rounds every operation and would hide a contraction).
struct Inputs {
  float a, x, y;
};
Inputs lesson00_example() {
  // a = x = 1 + 2^-12: the exact product 1 + 2^-11 + 2^-24 needs 25 bits; rounded to fp32 it loses the
  // 2^-24 (a tie, to even), so adding y = -(1 + 2^-11) gives 0. Fused, the result is 2^-24.
  volatile float a = 1.0f + 0x1p-12f, x = 1.0f + 0x1p-12f, y = -(1.0f + 0x1p-11f);
  return {a, x, y};
}

TEST(HostFloatingPoint, MultiplyThenAddRoundsTwiceInOneExpression) {
  const Inputs in = lesson00_example();
  const float separate = in.a * in.x + in.y;
  EXPECT_EQ(std::fma(in.a, in.x, in.y), 0x1p-24f);  // the one-rounding result differs...
  EXPECT_EQ(separate, 0.0f) << "a * x + y was contracted into an FMA: build host code with -ffp-contract=off";
}

TEST(HostFloatingPoint, MultiplyThenAddRoundsTwiceAcrossStatements) {
  // GCC contracts across statements too (it works on the data flow, not on the source expression).
  const Inputs in = lesson00_example();
  const float product = in.a * in.x;
  const float sum = product + in.y;
  EXPECT_EQ(sum, 0.0f) << "product + y was contracted into an FMA";
  const float difference = product - (-in.y);  // the form of a*cos - b*sin (lesson 05)
  EXPECT_EQ(difference, 0.0f) << "product - z was contracted into an FMA";
}

TEST(HostFloatingPoint, DoubleArithmeticIsNotContractedEither) {
  // The same example one precision up: a = x = 1 + 2^-27 (the exact product needs 55 bits).
  volatile double a = 1.0 + 0x1p-27, x = 1.0 + 0x1p-27, y = -(1.0 + 0x1p-26);
  const double separate = a * x + y;
  EXPECT_EQ(std::fma(static_cast<double>(a), static_cast<double>(x), static_cast<double>(y)), 0x1p-54);
  EXPECT_EQ(separate, 0.0);
}

}  // namespace
