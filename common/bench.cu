#include "common/bench.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ostream>

#include "common/device.h"
#include "common/errors.h"

namespace tvllm {

namespace {

// RAII pair of CUDA events.
struct EventPair {
  cudaEvent_t start = nullptr, stop = nullptr;
  EventPair() {
    TVLLM_CUDA_CHECK(cudaEventCreate(&start));
    TVLLM_CUDA_CHECK(cudaEventCreate(&stop));
  }
  ~EventPair() {
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }
  EventPair(const EventPair&) = delete;
  EventPair& operator=(const EventPair&) = delete;
  float elapsed_ms() const {
    float ms = 0.f;
    TVLLM_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    return ms;
  }
};

BenchResult summarize(std::vector<double> times) {
  BenchResult r;
  if (times.empty()) return r;
  std::sort(times.begin(), times.end());
  r.iters = static_cast<int>(times.size());
  r.min_ms = times.front();
  r.max_ms = times.back();
  size_t n = times.size();
  r.median_ms = n % 2 ? times[n / 2] : 0.5 * (times[n / 2 - 1] + times[n / 2]);
  return r;
}

}  // namespace

L2Flusher::L2Flusher() {
  int device = 0;
  TVLLM_CUDA_CHECK(cudaGetDevice(&device));
  size_t l2 = query_device(device).l2_cache_bytes;
  scratch_ = DeviceBuffer(std::max<size_t>(2 * l2, size_t{64} << 20));
}

void L2Flusher::flush() { TVLLM_CUDA_CHECK(cudaMemsetAsync(scratch_.data(), 0, scratch_.bytes())); }

BenchResult bench_gpu(const std::function<void()>& launch, BenchOptions options) {
  L2Flusher flusher;
  EventPair events;
  for (int i = 0; i < options.warmup; ++i) launch();
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<double> times;
  for (int i = 0; i < options.iters; ++i) {
    if (options.flush_l2) flusher.flush();
    TVLLM_CUDA_CHECK(cudaEventRecord(events.start));
    launch();
    TVLLM_CUDA_CHECK(cudaEventRecord(events.stop));
    TVLLM_CUDA_CHECK(cudaEventSynchronize(events.stop));
    TVLLM_CHECK_LAUNCH();
    times.push_back(events.elapsed_ms());
  }
  return summarize(std::move(times));
}

BenchResult bench_cpu(const std::function<void()>& fn, int warmup, int iters) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> times;
  for (int i = 0; i < iters; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    fn();
    auto t1 = std::chrono::steady_clock::now();
    times.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  return summarize(std::move(times));
}

double measure_copy_bandwidth_gbs(size_t bytes, int iters) {
  DeviceBuffer src(bytes), dst(bytes);
  TVLLM_CUDA_CHECK(cudaMemset(src.data(), 1, bytes));  // never time untouched memory
  BenchOptions options;
  options.iters = iters;
  options.flush_l2 = false;  // 1 GiB is far larger than any L2
  BenchResult r = bench_gpu(
      [&] { TVLLM_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), bytes, cudaMemcpyDeviceToDevice)); },
      options);
  return 2.0 * static_cast<double>(bytes) / (r.median_ms * 1e-3) / 1e9;  // read + write
}

namespace {
__global__ void fill_pattern_bf16(__nv_bfloat16* x, size_t n) {
  size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  // small values in [-1, 1): not zeros, which run faster than real data on tensor cores
  if (i < n) x[i] = __float2bfloat16(static_cast<float>((i * 2654435761u) % 2048) / 1024.0f - 1.0f);
}
}  // namespace

double measure_bf16_gemm_tflops(int n, int iters) {
  size_t elems = static_cast<size_t>(n) * n;
  DeviceBuffer a(elems * 2), b(elems * 2), c(elems * 2);
  fill_pattern_bf16<<<(elems + 255) / 256, 256>>>(a.as<__nv_bfloat16>(), elems);
  TVLLM_CHECK_LAUNCH();
  fill_pattern_bf16<<<(elems + 255) / 256, 256>>>(b.as<__nv_bfloat16>(), elems);
  TVLLM_CHECK_LAUNCH();
  cublasHandle_t handle = nullptr;
  TVLLM_CUBLAS_CHECK(cublasCreate(&handle));
  float alpha = 1.f, beta = 0.f;
  auto gemm = [&] {
    TVLLM_CUBLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a.data(), CUDA_R_16BF, n,
                                    b.data(), CUDA_R_16BF, n, &beta, c.data(), CUDA_R_16BF, n,
                                    CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  };
  BenchOptions options;
  options.iters = iters;
  options.flush_l2 = false;
  BenchResult r;
  try {
    r = bench_gpu(gemm, options);
  } catch (...) {
    cublasDestroy(handle);
    throw;
  }
  cublasDestroy(handle);
  return 2.0 * n * static_cast<double>(n) * n / (r.median_ms * 1e-3) / 1e12;
}

Ceilings measure_ceilings(bool measure_gemm) {
  static Ceilings cached;
  if (cached.copy_gbs == 0.0) cached.copy_gbs = measure_copy_bandwidth_gbs();
  if (measure_gemm && cached.bf16_tflops == 0.0) cached.bf16_tflops = measure_bf16_gemm_tflops();
  return cached;
}

void print_bench_table(std::ostream& out, const std::string& title, const std::vector<BenchRow>& rows,
                       const Ceilings& ceilings) {
  char line[256];
  out << "\n== bench: " << title << " ==\n";
  std::snprintf(line, sizeof line, "ceilings: copy %.0f GB/s (measured)%s\n", ceilings.copy_gbs,
                ceilings.bf16_tflops > 0 ? "" : ", bf16 GEMM not measured");
  out << line;
  if (ceilings.bf16_tflops > 0) {
    std::snprintf(line, sizeof line, "          bf16 GEMM %.0f TFLOP/s (measured, cuBLAS 8192^3)\n",
                  ceilings.bf16_tflops);
    out << line;
  }
  std::snprintf(line, sizeof line, "%-32s %10s %10s %8s %10s %8s\n", "kernel", "median ms", "GB/s", "%copy",
                "TFLOP/s", "%gemm");
  out << line;
  for (const BenchRow& row : rows) {
    double s = row.result.median_ms * 1e-3;
    double gbs = row.bytes > 0 ? row.bytes / s / 1e9 : 0.0;
    double tflops = row.flops > 0 ? row.flops / s / 1e12 : 0.0;
    std::snprintf(line, sizeof line, "%-32s %10.4f %10.1f %7.1f%% %10.1f %7.1f%%\n", row.name.c_str(),
                  row.result.median_ms, gbs, ceilings.copy_gbs > 0 ? 100.0 * gbs / ceilings.copy_gbs : 0.0, tflops,
                  ceilings.bf16_tflops > 0 ? 100.0 * tflops / ceilings.bf16_tflops : 0.0);
    out << line;
  }
}

}  // namespace tvllm
