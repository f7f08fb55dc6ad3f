// Benchmark helpers. A figure alone says little; every figure we print stands beside its ceiling:
//   memory-bound kernels: achieved GB/s  vs the measured device-to-device copy bandwidth
//   compute-bound kernels: achieved TFLOP/s vs the measured cuBLAS bf16 GEMM rate (and the datasheet)
//
// Method (see the README's "Performance method"): warm up first (module load, cuBLAS handles),
// flush the L2 cache between runs so we measure DRAM, not cache, time each run with CUDA events,
// and report the median.
#pragma once

#include <functional>
#include <iosfwd>
#include <string>
#include <vector>

#include "common/buffer.h"

namespace tvllm {

struct Ceilings {
  double copy_gbs = 0.0;     // measured: a large cudaMemcpy device->device, bytes read + bytes written
  double bf16_tflops = 0.0;  // measured: an 8192^3 bf16 cublasGemmEx with fp32 accumulation (0 = not measured)
};

// Both measured once per process and cached. measure_gemm=false skips the (slower) GEMM.
Ceilings measure_ceilings(bool measure_gemm);
double measure_copy_bandwidth_gbs(size_t bytes = size_t{1} << 30, int iters = 20);
double measure_bf16_gemm_tflops(int n = 8192, int iters = 10);

// Writes a buffer twice the size of the L2 cache, evicting whatever a previous run left there.
class L2Flusher {
 public:
  L2Flusher();
  void flush();

 private:
  DeviceBuffer scratch_;
};

struct BenchOptions {
  int warmup = 3;
  int iters = 20;
  bool flush_l2 = true;
};

struct BenchResult {
  double median_ms = 0.0;
  double min_ms = 0.0;
  double max_ms = 0.0;
  int iters = 0;
};

// Times launch() on the GPU (default stream) with CUDA events, one event pair per run.
BenchResult bench_gpu(const std::function<void()>& launch, BenchOptions options = {});
// Times fn() on the CPU with a steady clock (for the reference implementations).
BenchResult bench_cpu(const std::function<void()>& fn, int warmup = 1, int iters = 5);

// One row of a benchmark table: bytes moved and flops done by ONE run (0 when not meaningful).
struct BenchRow {
  std::string name;
  BenchResult result;
  double bytes = 0.0;
  double flops = 0.0;
};

// Prints: name | median ms | GB/s | % of copy bw | TFLOP/s | % of GEMM peak
void print_bench_table(std::ostream& out, const std::string& title, const std::vector<BenchRow>& rows,
                       const Ceilings& ceilings);

}  // namespace tvllm
