// lesson00_gpu_basics: what GPU is this, how fast does memory move, and does our first kernel compute
// exactly what the CPU computes?
//
//   build/bin/lesson00_gpu_basics                 device query, bandwidths, every SAXPY kernel vs the CPU
//   build/bin/lesson00_gpu_basics --bench         + the kernels timed against the device copy bandwidth
//   build/bin/lesson00_gpu_basics --device cpu    the CPU path only (also what runs without a GPU)
//
// This lesson needs no model: --model is accepted (every lesson takes it) and ignored.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "common/bench.h"
#include "common/device.h"
#include "common/errors.h"
#include "common/lesson.h"
#include "common/random.h"
#include "common/tensor.h"
#include "common/validate.h"
#include "gpu_basics.h"

namespace {

using namespace tvllm;

// The random-data check multiplies by a value that is not a power of two, so the product a*x really
// rounds and the fused/unfused difference shows.
constexpr float kRandomA = 1.1f;
// SAXPY moves 12 bytes per element: read x (4), read y (4), write out (4).
constexpr double kBytesPerElement = 12.0;

void print_device_query(const DeviceProps& p) {
  std::printf("\n== device query ==\n");
  std::printf("  name                         %s\n", p.name.c_str());
  std::printf("  compute capability           %d.%d\n", p.compute_major, p.compute_minor);
  std::printf("  multiprocessors (SMs)        %d\n", p.multiprocessors);
  std::printf("  global memory                %.1f GiB\n", p.global_memory_bytes / 1073741824.0);
  std::printf("  L2 cache                     %.1f MiB\n", p.l2_cache_bytes / 1048576.0);
  std::printf("  shared memory per block      %zu KiB (opt-in maximum)\n", p.shared_memory_per_block_optin / 1024);
  std::printf("  max threads per block        %d\n", p.max_threads_per_block);
  std::printf("  warp size                    %d\n", p.warp_size);
  std::printf("  memory bus width             %d bits\n", p.memory_bus_width_bits);
  if (p.memory_clock_khz > 0) {
    std::printf("  memory clock                 %.0f MHz\n", p.memory_clock_khz / 1000.0);
    std::printf("  theoretical bandwidth        %.0f GB/s (2 x clock x bus width)\n", p.theoretical_bandwidth_gbs());
  } else {
    std::printf("  theoretical bandwidth        unknown (this runtime does not report the memory clock)\n");
  }
}

void print_bandwidths(const CopyBandwidths& bw) {
  std::printf("\n== copy bandwidth (cudaMemcpy, median of 10 runs; device -> device of 20) ==\n");
  std::printf("  host -> device, pageable     %8.1f GB/s   (the driver stages it through a pinned buffer)\n",
              bw.h2d_pageable_gbs);
  std::printf("  host -> device, pinned       %8.1f GB/s   (DMA straight from our memory)\n", bw.h2d_pinned_gbs);
  std::printf("  device -> host, pinned       %8.1f GB/s\n", bw.d2h_pinned_gbs);
  std::printf("  device -> device             %8.1f GB/s   (read + write: the ceiling for every kernel)\n",
              bw.d2d_gbs);
}

// How many elements differ between two arrays (bit patterns), and the largest absolute difference.
struct Differences {
  int64_t count = 0;
  double max_abs = 0.0;
};
Differences count_differences(const std::vector<float>& a, const std::vector<float>& b) {
  Differences d;
  for (size_t i = 0; i < a.size(); ++i) {
    if (f32_bits(a[i]) == f32_bits(b[i])) continue;
    ++d.count;
    d.max_abs = std::max(d.max_abs, std::fabs(static_cast<double>(a[i]) - b[i]));
  }
  return d;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

std::vector<float> download(const Tensor& t) {
  std::vector<float> host(static_cast<size_t>(t.numel()));
  copy_view(TensorView::contiguous(host.data(), DType::F32, Device::CPU, t.shape()), t.view());
  return host;
}

Tensor upload(const std::vector<float>& host) {
  return Tensor::from_f32(host, {static_cast<int64_t>(host.size())}, DType::F32, Device::CUDA);
}

// Random data: the CPU's fused and unfused SAXPY, and how often they disagree.
struct RandomCase {
  std::vector<float> x, y, fused, unfused;
};
RandomCase make_random_case(int64_t n) {
  RandomCase c;
  c.x = random_uniform(static_cast<size_t>(n), 1);
  c.y = random_uniform(static_cast<size_t>(n), 2);
  c.fused.resize(c.x.size());
  c.unfused.resize(c.x.size());
  saxpy_cpu(c.fused.data(), kRandomA, c.x.data(), c.y.data(), n);
  saxpy_cpu_unfused(c.unfused.data(), kRandomA, c.x.data(), c.y.data(), n);
  Differences d = count_differences(c.fused, c.unfused);
  std::printf("  a = %.9g, x and y uniform in [-1, 1)\n", kRandomA);
  std::printf("  fused (std::fma) vs unfused (a*x, then +y): %lld of %lld elements differ (%.2f%%), "
              "the largest difference %.3g\n",
              static_cast<long long>(d.count), static_cast<long long>(n), 100.0 * d.count / n, d.max_abs);
  return c;
}

int run_cpu(const LessonOptions& opt, int64_t n) {
  std::printf("== lesson 00: GPU basics, CPU path ==\n");
  std::printf("no GPU work on this path: no device query, no bandwidths; SAXPY runs on the CPU, N = %lld\n",
              static_cast<long long>(n));
  Report report("lesson00_gpu_basics (cpu)");

  Tensor x = Tensor::empty({n}, DType::F32, Device::CPU);  // [n]
  Tensor y = Tensor::empty({n}, DType::F32, Device::CPU);  // [n]
  Tensor out = Tensor::empty({n}, DType::F32, Device::CPU);  // [n]
  fill_closed_form_inputs(x.view().ptr<float>(), y.view().ptr<float>(), n);
  std::fill_n(out.view().ptr<float>(), n, NAN);  // poison: an element we forget to write fails the check
  saxpy(out, kClosedFormA, x, y);
  int64_t first_bad = -1;
  int64_t bad = count_closed_form_mismatches(out.view().ptr<float>(), n, &first_bad);
  report.add_check("saxpy cpu == closed form", bad == 0,
                   std::to_string(bad) + " elements differ, the first at " + std::to_string(first_bad));

  saxpy(y, kClosedFormA, x, y);  // in place: y = a*x + y
  bad = count_closed_form_mismatches(y.view().ptr<float>(), n, &first_bad);
  report.add_check("saxpy cpu in place == closed form", bad == 0,
                   std::to_string(bad) + " elements differ, the first at " + std::to_string(first_bad));

  std::printf("\n== one rounding or two ==\n");
  RandomCase c = make_random_case(n);
  // std::fma must give the exact a*x+y rounded once. Here the exact value is known: x and y are
  // multiples of 2^-23 below 1 in magnitude and a = 1.1f has 24 significant bits, so a*x+y is a whole
  // number of 2^-46 below 2^48 of them, which a double (53 bits) holds exactly.
  int64_t not_nearest = 0;
  for (int64_t i = 0; i < n; ++i) {
    double exact = static_cast<double>(kRandomA) * c.x[i] + c.y[i];
    if (c.fused[i] != static_cast<float>(exact)) ++not_nearest;
  }
  report.add_check("std::fma == exact, rounded once", not_nearest == 0,
                   std::to_string(not_nearest) + " elements are not the nearest float to a*x+y");
  // And the unfused loop must really round twice: the chapter's example (section 4), a = x = 1 + 2^-12,
  // y = -(1 + 2^-11), gives 0 with two roundings and 2^-24 with one. A compiler that contracted
  // a * x + y into an FMA (no -ffp-contract=off, an FMA target) would make it 2^-24.
  const float e = 1.0f + 0x1p-12f, minus_y = -(1.0f + 0x1p-11f);
  float two_roundings = -1.0f;
  saxpy_cpu_unfused(&two_roundings, e, &e, &minus_y, 1);
  report.add_check("a*x, then +y: two roundings", two_roundings == 0.0f,
                   "got " + std::to_string(two_roundings) + ": the compiler fused a*x + y into an FMA");

  if (opt.bench) {
    BenchResult r = bench_cpu([&] { saxpy(out, kClosedFormA, x, y); }, 1, 5);
    std::printf("\n== bench (CPU) ==\n  saxpy_cpu, N = %lld: %.3f ms, %.1f GB/s (12 bytes per element)\n",
                static_cast<long long>(n), r.median_ms, kBytesPerElement * n / (r.median_ms * 1e-3) / 1e9);
  }
  report.print(std::cout);
  return report.exit_code();
}

int run_gpu(const LessonOptions& opt, int64_t n) {
  std::printf("== lesson 00: GPU basics ==\n");
  print_device_query(query_device(0));
  print_bandwidths(measure_copy_bandwidths(size_t{256} << 20, size_t{1} << 30));

  Report report("lesson00_gpu_basics (cuda)");
  std::printf("\n== SAXPY, N = %lld (not a multiple of the block size) ==\n", static_cast<long long>(n));
  RandomCase c = make_random_case(n);
  Tensor x = upload(c.x);                                    // [n] on the GPU
  Tensor y = upload(c.y);                                    // [n]
  Tensor out = Tensor::empty({n}, DType::F32, Device::CUDA);  // [n]
  const std::vector<std::string>& versions = saxpy_kernel_versions();
  for (const std::string& v : versions) {
    // poison the output: 0xff bytes are a NaN, so an element the kernel forgets shows up as a mismatch
    TVLLM_CUDA_CHECK(cudaMemset(out.data(), 0xff, out.view().nbytes()));
    saxpy(out, kRandomA, x, y, v);
    TVLLM_CUDA_CHECK(cudaDeviceSynchronize());  // a fault inside the kernel is reported here
    std::vector<float> got = download(out);
    std::string tag = v + (v == opt.kernel ? " (default)" : "");
    report.add(compare("saxpy " + tag + " vs CPU std::fma", got, c.fused, Tolerance{0.0, 0.0}));
    report.add_check("saxpy " + v + " bit-exact", same_bits(got, c.fused), "bit patterns differ from std::fma");
    if (v == opt.kernel) {
      Differences d = count_differences(got, c.unfused);
      std::printf("  GPU %s vs the unfused CPU loop: %lld elements differ (the GPU fuses, as std::fma does)\n",
                  v.c_str(), static_cast<long long>(d.count));
    }
  }

  // the closed form, on the GPU, in place (y = a*x + y) with the chosen kernel
  std::vector<float> cx(static_cast<size_t>(n)), cy(static_cast<size_t>(n));
  fill_closed_form_inputs(cx.data(), cy.data(), n);
  Tensor gx = upload(cx);
  Tensor gy = upload(cy);
  saxpy(gy, kClosedFormA, gx, gy, opt.kernel);
  std::vector<float> closed = download(gy);
  int64_t first_bad = -1;
  int64_t bad = count_closed_form_mismatches(closed.data(), n, &first_bad);
  report.add_check("saxpy " + opt.kernel + " in place == closed form", bad == 0,
                   std::to_string(bad) + " elements differ, the first at " + std::to_string(first_bad));

  if (opt.bench) {
    std::vector<BenchRow> rows;
    for (const std::string& v : versions) {
      rows.push_back({"saxpy " + v, bench_gpu([&] { saxpy(out, kRandomA, x, y, v); }), kBytesPerElement * n, 2.0 * n});
    }
    print_bench_table(std::cout, "saxpy, N = " + std::to_string(n) + " (12 bytes per element)", rows,
                      measure_ceilings(false));
    std::vector<float> scratch(c.x.size());
    BenchResult cpu = bench_cpu([&] { saxpy_cpu(scratch.data(), kRandomA, c.x.data(), c.y.data(), n); }, 1, 3);
    std::printf("  CPU saxpy_cpu (one core): %.3f ms, %.1f GB/s\n", cpu.median_ms,
                kBytesPerElement * n / (cpu.median_ms * 1e-3) / 1e9);
  }
  report.print(std::cout);
  return report.exit_code();
}

}  // namespace

int main(int argc, char** argv) {
  tvllm::LessonCli cli("lesson00_gpu_basics", "GPU basics: device query, copy bandwidth, the first kernel (SAXPY)");
  cli.kernels(tvllm::saxpy_kernel_versions(), tvllm::kSaxpyDefaultKernel);
  int64_t n = 10'000'019;  // a prime: not a multiple of any block size
  cli.app()
      .add_option("--n", n, "elements in the SAXPY check")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30))
      ->capture_default_str();
  return cli.run(argc, argv, [&](const tvllm::LessonOptions& opt) {
    return opt.device == tvllm::Device::CPU ? run_cpu(opt, n) : run_gpu(opt, n);
  });
}
