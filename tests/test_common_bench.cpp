// common/bench.h without a GPU: the CPU timer and the benchmark table's arithmetic.
#include <gtest/gtest.h>

#include <chrono>
#include <sstream>
#include <thread>

#include "common/bench.h"

namespace tvllm {
namespace {

TEST(BenchCpu, MeasuresWallTimeAndCountsRuns) {
  int calls = 0;
  BenchResult r = bench_cpu(
      [&] {
        ++calls;
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      },
      /*warmup=*/2, /*iters=*/5);
  EXPECT_EQ(calls, 7);  // warm-up runs are run but not timed
  EXPECT_EQ(r.iters, 5);
  EXPECT_GE(r.min_ms, 2.0);
  EXPECT_LE(r.min_ms, r.median_ms);
  EXPECT_LE(r.median_ms, r.max_ms);
  EXPECT_LT(r.median_ms, 1000.0);
}

TEST(BenchTable, PrintsGbPerSecondAgainstTheCeiling) {
  BenchRow row;
  row.name = "saxpy v3";
  row.result.median_ms = 1.0;
  row.bytes = 2e9;    // 2 GB in 1 ms = 2000 GB/s
  row.flops = 5e11;   // 0.5 TFLOP in 1 ms = 500 TFLOP/s
  Ceilings ceilings;
  ceilings.copy_gbs = 4000.0;
  ceilings.bf16_tflops = 1000.0;
  std::ostringstream out;
  print_bench_table(out, "demo", {row}, ceilings);
  std::string text = out.str();
  EXPECT_NE(text.find("demo"), std::string::npos) << text;
  EXPECT_NE(text.find("saxpy v3"), std::string::npos) << text;
  EXPECT_NE(text.find("2000.0"), std::string::npos) << text;  // GB/s
  EXPECT_NE(text.find("50.0%"), std::string::npos) << text;   // of the copy ceiling, and of the GEMM peak
  EXPECT_NE(text.find("500.0"), std::string::npos) << text;   // TFLOP/s
  EXPECT_NE(text.find("copy 4000 GB/s"), std::string::npos) << text;
}

TEST(BenchTable, WithoutAGemmCeilingSaysSo) {
  Ceilings ceilings;
  ceilings.copy_gbs = 1000.0;
  std::ostringstream out;
  print_bench_table(out, "memory only", {}, ceilings);
  EXPECT_NE(out.str().find("bf16 GEMM not measured"), std::string::npos) << out.str();
}

}  // namespace
}  // namespace tvllm
