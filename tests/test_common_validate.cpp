// common/validate.h: the comparison rule |a - b| <= atol + rtol * |b|, the statistics reported beside
// it, NaN/inf handling, and the Report table with its exit code.
#include <gtest/gtest.h>

#include <cmath>
#include <sstream>
#include <vector>

#include "common/validate.h"

namespace tvllm {
namespace {

CompareResult cmp(const std::vector<float>& actual, const std::vector<float>& expected, Tolerance tol) {
  return compare("t", std::span<const float>(actual), std::span<const float>(expected), tol);
}

TEST(Compare, IdenticalValuesPassWithZeroErrors) {
  std::vector<float> v = {1.0f, -2.5f, 0.0f, 1e30f};
  CompareResult r = cmp(v, v, {0.0, 0.0});
  EXPECT_TRUE(r.pass());
  EXPECT_EQ(r.name, "t");
  EXPECT_EQ(r.count, 4);
  EXPECT_EQ(r.bad, 0);
  EXPECT_EQ(r.max_abs, 0.0);
  EXPECT_EQ(r.max_rel, 0.0);
  EXPECT_EQ(r.rel_l2, 0.0);
  EXPECT_TRUE(r.first_mismatches.empty());
  EXPECT_TRUE(r.error.empty());
}

TEST(Compare, TheRuleIncludesItsBoundary) {
  // |4.5 - 4| = 0.5 = atol 0.25 + rtol 0.0625 * 4: on the boundary, which passes (<=); all exact in binary
  EXPECT_TRUE(cmp({4.5f}, {4.0f}, {0.25, 0.0625}).pass());
  EXPECT_FALSE(cmp({std::nextafter(4.5f, 5.0f)}, {4.0f}, {0.25, 0.0625}).pass());
  // the relative part scales with |expected|, not |actual|
  EXPECT_TRUE(cmp({-4.5f}, {-4.0f}, {0.0, 0.125}).pass());
  EXPECT_FALSE(cmp({4.0f}, {4.5f}, {0.0, 0.1}).pass());  // 0.5 > 0.1 * 4.5
}

TEST(Compare, CountsEveryBadElementAndKeepsTheFirstFive) {
  std::vector<float> expected(10, 1.0f), actual(10, 1.0f);
  for (int i : {1, 3, 4, 6, 7, 9}) actual[i] = 2.0f;
  CompareResult r = cmp(actual, expected, {0.1, 0.0});
  EXPECT_FALSE(r.pass());
  EXPECT_EQ(r.bad, 6);
  ASSERT_EQ(r.first_mismatches.size(), 5u);
  EXPECT_EQ(r.first_mismatches[0].index, 1);
  EXPECT_EQ(r.first_mismatches[4].index, 7);
  EXPECT_EQ(r.first_mismatches[0].actual, 2.0);
  EXPECT_EQ(r.first_mismatches[0].expected, 1.0);
  EXPECT_EQ(r.max_abs, 1.0);
}

TEST(Compare, MaxAbsMaxRelAndRelL2) {
  // errors 0.25 on 1 (rel 0.25), 0.5 on 4 (rel 0.125), 0 on 2
  CompareResult r = cmp({1.25f, 2.0f, 4.5f}, {1.0f, 2.0f, 4.0f}, {1.0, 0.0});
  EXPECT_TRUE(r.pass());
  EXPECT_EQ(r.max_abs, 0.5);
  // max_rel only counts |expected| > atol = 1: the element 1.0 is excluded, 4.0 gives 0.125
  EXPECT_EQ(r.max_rel, 0.125);
  // rel_l2 = sqrt(0.25^2 + 0.5^2) / sqrt(1 + 4 + 16)
  EXPECT_NEAR(r.rel_l2, std::sqrt(0.3125 / 21.0), 1e-12);

  CompareResult r0 = cmp({1.25f, 2.0f, 4.5f}, {1.0f, 2.0f, 4.0f}, {0.0, 0.25});
  EXPECT_EQ(r0.max_rel, 0.25);  // with atol 0 every non-zero expected counts

  // rel_l2 = |(3, 4.5) - (3, 4)| / |(3, 4)| = 0.5 / 5
  EXPECT_NEAR(cmp({3.0f, 4.5f}, {3.0f, 4.0f}, {1.0, 0.0}).rel_l2, 0.1, 1e-12);
}

TEST(Compare, MaxRelIgnoresExpectedValuesAtOrBelowAtol) {
  // a tiny reference value makes a huge relative error that means nothing: it is left out of max_rel
  CompareResult r = cmp({1e-6f, 1.0f}, {1e-9f, 1.0f}, {1e-5, 0.0});
  EXPECT_TRUE(r.pass());
  EXPECT_EQ(r.max_rel, 0.0);
  EXPECT_DOUBLE_EQ(r.max_abs, static_cast<double>(1e-6f) - static_cast<double>(1e-9f));
  // expected zero with atol 0: no division by zero, and an exact 0 passes
  CompareResult z = cmp({0.0f, 2.0f}, {0.0f, 1.0f}, {0.0, 1.0});
  EXPECT_TRUE(z.pass());
  EXPECT_EQ(z.max_rel, 1.0);
  EXPECT_FALSE(cmp({1e-30f}, {0.0f}, {0.0, 1.0}).pass());  // with no atol nothing is "close to zero"
}

TEST(Compare, RelL2OfAnAllZeroReferenceIsTheAbsoluteNorm) {
  CompareResult r = cmp({3.0f, 4.0f}, {0.0f, 0.0f}, {10.0, 0.0});
  EXPECT_TRUE(r.pass());
  EXPECT_EQ(r.rel_l2, 5.0);
}

TEST(Compare, NanPassesOnlyAgainstNan) {
  EXPECT_TRUE(cmp({NAN}, {NAN}, {0.0, 0.0}).pass());
  CompareResult got_nan = cmp({1.0f, NAN}, {1.0f, 2.0f}, {1e9, 1e9});  // no tolerance excuses a NaN
  EXPECT_FALSE(got_nan.pass());
  EXPECT_EQ(got_nan.bad, 1);
  EXPECT_TRUE(std::isinf(got_nan.max_abs));
  ASSERT_EQ(got_nan.first_mismatches.size(), 1u);
  EXPECT_EQ(got_nan.first_mismatches[0].index, 1);
  EXPECT_FALSE(cmp({2.0f}, {NAN}, {1e9, 1e9}).pass());
  EXPECT_FALSE(cmp({INFINITY}, {NAN}, {0.0, 0.0}).pass());
  // NaN elements do not poison the statistics of the others
  CompareResult mixed = cmp({NAN, 1.5f}, {NAN, 1.0f}, {1.0, 0.0});
  EXPECT_TRUE(mixed.pass());
  EXPECT_EQ(mixed.max_abs, 0.5);
  EXPECT_EQ(mixed.rel_l2, 0.5);
}

TEST(Compare, InfinitiesMustMatchExactly) {
  EXPECT_TRUE(cmp({INFINITY, -INFINITY}, {INFINITY, -INFINITY}, {0.0, 0.0}).pass());
  EXPECT_FALSE(cmp({-INFINITY}, {INFINITY}, {1e9, 1e9}).pass());
  EXPECT_FALSE(cmp({3e38f}, {INFINITY}, {1e9, 1e9}).pass());
  EXPECT_FALSE(cmp({INFINITY}, {3e38f}, {1e9, 1e9}).pass());
  CompareResult r = cmp({INFINITY, 1.0f}, {INFINITY, 1.0f}, {0.0, 0.0});
  EXPECT_EQ(r.max_abs, 0.0);  // inf - inf is not an error of NaN size
  EXPECT_EQ(r.rel_l2, 0.0);
}

TEST(Compare, SizeMismatchIsAnErrorNotACrash) {
  CompareResult r = cmp({1.0f, 2.0f}, {1.0f, 2.0f, 3.0f}, {0.0, 0.0});
  EXPECT_FALSE(r.pass());
  EXPECT_NE(r.error.find("2"), std::string::npos);
  EXPECT_NE(r.error.find("3"), std::string::npos);
}

TEST(Compare, ViewsOfDifferentShapesAreAnError) {
  std::vector<float> a(6, 1.0f), b(6, 1.0f);
  TensorView va = TensorView::contiguous(a.data(), DType::F32, Device::CPU, {2, 3});
  TensorView vb = TensorView::contiguous(b.data(), DType::F32, Device::CPU, {3, 2});
  CompareResult r = compare("q_proj", va, vb, {0.0, 0.0});
  EXPECT_FALSE(r.pass());
  EXPECT_EQ(r.name, "q_proj");
  EXPECT_NE(r.error.find("[2, 3]"), std::string::npos) << r.error;
  EXPECT_NE(r.error.find("[3, 2]"), std::string::npos) << r.error;
}

TEST(Compare, ViewsOfDifferentDtypesCompareAsFp32) {
  std::vector<uint16_t> bf16 = {0x3f80, 0x4049};  // 1, 3.140625
  std::vector<float> f32 = {1.0f, 3.14159265f};
  TensorView a = TensorView::contiguous(bf16.data(), DType::BF16, Device::CPU, {2});
  TensorView b = TensorView::contiguous(f32.data(), DType::F32, Device::CPU, {2});
  CompareResult r = compare("x", a, b, {0.0, 1.0 / 256});  // one bf16 rounding is at most 2^-8 relative
  EXPECT_TRUE(r.pass());
  EXPECT_NEAR(r.max_abs, 3.14159265 - 3.140625, 1e-6);
  EXPECT_FALSE(compare("x", a, b, {0.0, 1e-4}).pass());
}

TEST(CompareElement, OneElementWithItsOwnAtol) {
  // The rule of compare() with a per-element atol (lesson 06's row-scaled check builds on it).
  CompareResult r;
  double diff_sq = 0.0, ref_sq = 0.0;
  compare_element(r, 7, 10.5, 10.0, 0.5, 0.0, diff_sq, ref_sq);  // |err| = 0.5 <= 0.5: passes
  EXPECT_EQ(r.bad, 0);
  compare_element(r, 8, 10.5, 10.0, 0.25, 0.0, diff_sq, ref_sq);  // the same error, a tighter atol: fails
  ASSERT_EQ(r.bad, 1);
  EXPECT_EQ(r.first_mismatches[0].index, 8);
  EXPECT_EQ(r.first_mismatches[0].actual, 10.5);
  EXPECT_EQ(r.max_abs, 0.5);
  EXPECT_DOUBLE_EQ(r.max_rel, 0.05);
  EXPECT_EQ(diff_sq, 0.5);    // 0.25 twice
  EXPECT_EQ(ref_sq, 200.0);   // 100 twice
  compare_element(r, 9, NAN, 1.0, 1e9, 1e9, diff_sq, ref_sq);  // NaN fails whatever the tolerance
  EXPECT_EQ(r.bad, 2);
  EXPECT_TRUE(std::isinf(r.max_abs));
  EXPECT_EQ(diff_sq, 0.5);  // non-finite pairs stay out of rel_l2
  EXPECT_EQ(r.count, 0);    // counting is the caller's
}

TEST(Report, ExitCodeFollowsTheRows) {
  Report empty("nothing");
  EXPECT_FALSE(empty.all_pass());  // a report that checked nothing has not passed
  EXPECT_EQ(empty.exit_code(), 1);

  Report report("lesson");
  report.add(cmp({1.0f}, {1.0f}, {0.0, 0.0}));
  EXPECT_TRUE(report.all_pass());
  EXPECT_EQ(report.exit_code(), 0);
  report.add_check("ids equal", true);
  EXPECT_EQ(report.exit_code(), 0);
  report.add_check("greedy tokens", false, "token 3: 17 != 42");
  EXPECT_FALSE(report.all_pass());
  EXPECT_EQ(report.exit_code(), 1);
  EXPECT_EQ(report.size(), 3u);
}

TEST(Report, AFailingComparisonFailsTheReport) {
  Report report("r");
  const CompareResult& added = report.add(cmp({1.0f, 5.0f}, {1.0f, 2.0f}, {0.1, 0.0}));
  EXPECT_FALSE(added.pass());
  EXPECT_EQ(report.exit_code(), 1);
}

TEST(Report, PrintsATableWithPassAndFail) {
  Report report("lesson99_demo");
  report.add(compare("embed_tokens", std::vector<float>{1.0f, 2.0f}, std::vector<float>{1.0f, 2.0f}, {1e-5, 1e-5}));
  report.add(compare("logits", std::vector<float>{1.0f, 7.0f}, std::vector<float>{1.0f, 2.0f}, {1e-5, 1e-5}));
  report.add_check("tokens equal", false, "position 4 differs");
  std::ostringstream out;
  report.print(out);
  std::string text = out.str();
  EXPECT_NE(text.find("lesson99_demo"), std::string::npos) << text;
  EXPECT_NE(text.find("embed_tokens"), std::string::npos) << text;
  EXPECT_NE(text.find("PASS"), std::string::npos) << text;
  EXPECT_NE(text.find("logits"), std::string::npos) << text;
  EXPECT_NE(text.find("FAIL"), std::string::npos) << text;
  EXPECT_NE(text.find("position 4 differs"), std::string::npos) << text;
  EXPECT_NE(text.find("[1] got 7, expected 2"), std::string::npos) << text;  // the first mismatch
  // the verdict line comes last
  EXPECT_NE(text.rfind("FAIL: lesson99_demo"), std::string::npos) << text;

  Report ok("all_good");
  ok.add_check("one", true);
  std::ostringstream out2;
  ok.print(out2);
  EXPECT_NE(out2.str().find("PASS: all_good"), std::string::npos) << out2.str();
  EXPECT_EQ(out2.str().find("FAIL"), std::string::npos) << out2.str();
}

}  // namespace
}  // namespace tvllm
