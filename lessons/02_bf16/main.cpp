// lesson02_bf16: the bf16 format measured, and every conversion checked bit for bit.
//
//   build/bin/lesson02_bf16                 experiments, CPU sweeps, (GPU: all 2^32 fp32 patterns), weights
//   build/bin/lesson02_bf16 --bench         + the conversion kernels timed against the copy bandwidth
//   build/bin/lesson02_bf16 --device cpu    the CPU path only
//
// 1. the formats and the range/precision/bias experiments the chapter quotes (printed on every run)
// 2. CPU: common/dtype.h's fast conversions against rounding by definition on every bf16 pattern, every
//    tie, 2^24 random fp32 patterns and the special values
// 3. GPU: every fp32 -> bf16 kernel and fp32 -> fp16 against the CPU on ALL 2^32 fp32 bit patterns, and
//    bf16 -> fp32 on all 65536 bf16 patterns
// 4. the model's bf16 weights: widened to fp32 and narrowed back, they must reproduce their bytes
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "bf16.h"
#include "common/bench.h"
#include "common/buffer.h"
#include "common/device.h"
#include "common/errors.h"
#include "common/lesson.h"
#include "common/random.h"
#include "common/tensor.h"
#include "common/validate.h"
#include "model_dir.h"

namespace {

using namespace tvllm;

// ---- small helpers ------------------------------------------------------------------------------------

std::string hex(uint32_t v, int digits) {
  char text[16];
  std::snprintf(text, sizeof text, "0x%0*x", digits, v);
  return text;
}

// Runs body(begin, end, worker) over [0, n) split into contiguous slices, one per hardware thread.
// An exception in a worker is rethrown here after every worker has joined (escaping a std::thread it
// would abort the program, e.g. a student workspace's "not written yet").
template <class Body>
void parallel_for(int64_t n, int workers, const Body& body) {
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(static_cast<size_t>(workers));
  for (int w = 0; w < workers; ++w) {
    int64_t begin = n * w / workers, end = n * (w + 1) / workers;
    threads.emplace_back([&body, &errors, begin, end, w] {
      try {
        body(begin, end, w);
      } catch (...) {
        errors[static_cast<size_t>(w)] = std::current_exception();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (const std::exception_ptr& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

int worker_count() { return static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 32u)); }

// Disagreements between a conversion and its oracle over a set of fp32 inputs.
struct Tally {
  int64_t checked = 0;
  int64_t mismatches = 0;      // non-NaN input, different bits
  int64_t nan_inputs = 0;
  int64_t nan_lost = 0;        // NaN input, non-NaN output
  int64_t nan_other_bits = 0;  // NaN input, NaN output, but not the oracle's NaN bits
  bool has_first = false;
  uint32_t first_input = 0;
  uint16_t first_got = 0, first_want = 0;

  // is_nan: whether `got` is a NaN of the narrow format
  void add(uint32_t input, uint16_t got, uint16_t want, bool input_is_nan, bool got_is_nan) {
    ++checked;
    if (input_is_nan) {
      ++nan_inputs;
      if (!got_is_nan) {
        ++nan_lost;
        note(input, got, want);
      } else if (got != want) {
        ++nan_other_bits;
      }
    } else if (got != want) {
      ++mismatches;
      note(input, got, want);
    }
  }
  void note(uint32_t input, uint16_t got, uint16_t want) {
    if (has_first) return;
    has_first = true;
    first_input = input;
    first_got = got;
    first_want = want;
  }
  void merge(const Tally& o) {  // o covers later inputs than this
    checked += o.checked;
    mismatches += o.mismatches;
    nan_inputs += o.nan_inputs;
    nan_lost += o.nan_lost;
    nan_other_bits += o.nan_other_bits;
    if (!has_first && o.has_first) {
      has_first = true;
      first_input = o.first_input;
      first_got = o.first_got;
      first_want = o.first_want;
    }
  }
  // NaN passes as "both NaN" unless exact_nan asks for the oracle's very bits.
  bool pass(bool exact_nan) const { return mismatches == 0 && nan_lost == 0 && (!exact_nan || nan_other_bits == 0); }
  std::string detail() const {
    std::string d = std::to_string(mismatches) + " of " + std::to_string(checked) + " differ, " +
                    std::to_string(nan_lost) + " NaNs lost, " + std::to_string(nan_other_bits) +
                    " NaNs with other bits";
    if (has_first)
      d += "; first: fp32 " + hex(first_input, 8) + " gave " + hex(first_got, 4) + ", expected " + hex(first_want, 4);
    return d;
  }
};

// ---- 1. the formats and the experiments ---------------------------------------------------------------

void print_formats() {
  std::printf("\n== the three formats ==\n");
  std::printf("%-6s %5s %9s %9s %5s %12s %12s %12s %10s\n", "format", "bits", "exponent", "mantissa", "bias",
              "largest", "min normal", "min subnorm", "ulp(1)");
  std::printf("%-6s %5d %9d %9d %5d %12.4g %12.4g %12.4g %10.3g\n", "fp32", 32, 8, 23, 127,
              f32_from_bits(0x7f7fffff), f32_from_bits(0x00800000), f32_from_bits(0x00000001), std::ldexp(1.0, -23));
  std::printf("%-6s %5d %9d %9d %5d %12.4g %12.4g %12.4g %10.3g\n", "fp16", 16, 5, 10, 15, f16_to_f32(0x7bff),
              f16_to_f32(0x0400), f16_to_f32(0x0001), std::ldexp(1.0, -10));
  std::printf("%-6s %5d %9d %9d %5d %12.4g %12.4g %12.4g %10.3g\n", "bf16", 16, 8, 7, 127, bf16_to_f32(0x7f7f),
              bf16_to_f32(0x0080), bf16_to_f32(0x0001), std::ldexp(1.0, -7));
}

void print_experiments() {
  std::printf("\n== range: a value through each format (fp32 -> format -> fp32) ==\n");
  std::printf("%-40s %14s %14s %14s %14s\n", "value", "exact", "fp32", "fp16", "bf16");
  for (const RangeRow& r : range_experiments()) {
    std::printf("%-40s %14.7g %14.7g %14.7g %14.7g\n", r.what.c_str(), r.exact, r.as_f32, r.as_f16, r.as_bf16);
  }

  std::printf("\n== precision: the largest relative rounding error, 10^6 values log-uniform in [2^-10, 2^10) ==\n");
  std::printf("%-6s %18s %14s %14s\n", "format", "significant bits", "bound 2^-p", "measured");
  for (const PrecisionRow& r : precision_experiments(1000000, 11)) {
    std::printf("%-6s %18d %14.4g %14.4g\n", r.format.c_str(), r.significant_bits, r.bound, r.measured_max_rel);
  }

  std::printf("\n== bias: truncation vs round-to-nearest-even into bf16, 10^6 values ==\n");
  std::printf("%-26s %16s %16s %18s %18s\n", "inputs", "trunc mean rel", "rne mean rel", "trunc sum err/|x|",
              "rne sum err/|x|");
  for (const BiasRow& r : bias_experiments(1000000, 5)) {
    std::printf("%-26s %16.3e %16.3e %18.3e %18.3e\n", r.inputs.c_str(), r.truncate_mean_rel, r.rne_mean_rel,
                r.truncate_sum_rel, r.rne_sum_rel);
  }

  std::printf("\n== counting: total = round(total + 1), 10000 times ==\n");
  std::printf("  fp16 total: %g   bf16 total: %g   (fp32 would say 10000)\n", count_in_f16(10000), count_in_bf16(10000));
}

// ---- 2. CPU: fast conversions vs rounding by definition ------------------------------------------------

// Checks both fast conversions against the oracles on the given fp32 patterns.
void check_patterns_cpu(Report& report, const std::string& name, const std::vector<uint32_t>& patterns) {
  int workers = worker_count();
  std::vector<Tally> bf(workers), hf(workers);
  parallel_for(static_cast<int64_t>(patterns.size()), workers, [&](int64_t begin, int64_t end, int w) {
    for (int64_t i = begin; i < end; ++i) {
      uint32_t u = patterns[i];
      float x = f32_from_bits(u);
      bool nan = std::isnan(x);
      uint16_t b = f32_to_bf16(x), h = f32_to_f16(x);
      bf[w].add(u, b, bf16_round_by_definition(x), nan, bf16_is_nan(b));
      hf[w].add(u, h, f16_round_by_definition(x), nan, f16_is_nan(h));
    }
  });
  for (int w = 1; w < workers; ++w) {
    bf[0].merge(bf[w]);
    hf[0].merge(hf[w]);
  }
  // NaN: common/dtype.h keeps the payload (bf16) or returns 0x7e00 (fp16); the oracle returns the
  // canonical NaN, so NaNs are compared as "both NaN"
  report.add_check("cpu bf16 == by-def: " + name, bf[0].pass(false), bf[0].detail());
  report.add_check("cpu fp16 == by-def: " + name, hf[0].pass(false), hf[0].detail());
}

void run_cpu_checks(Report& report) {
  std::printf("\n== CPU: common/dtype.h against rounding by definition ==\n");
  auto t0 = std::chrono::steady_clock::now();

  // every bf16 pattern: widening is the top half, narrowing gives it back (NaN: quieted, sign and payload kept)
  int64_t widen_bad = 0, round_trip_bad = 0;
  for (uint32_t b = 0; b < 65536; ++b) {
    uint16_t bits = static_cast<uint16_t>(b);
    if (f32_bits(bf16_to_f32(bits)) != b << 16) ++widen_bad;
    uint16_t want = bf16_is_nan(bits) ? static_cast<uint16_t>(bits | 0x0040u) : bits;
    if (f32_to_bf16(bf16_to_f32(bits)) != want) ++round_trip_bad;
  }
  report.add_check("cpu bf16->f32 == top half, 65536", widen_bad == 0, std::to_string(widen_bad) + " differ");
  report.add_check("cpu bf16->f32->bf16 == id, 65536", round_trip_bad == 0,
                   std::to_string(round_trip_bad) + " differ");

  // every rounding decision point of bf16: each top half with the low halves just below, at and above
  // the tie, plus the exact values and the ends
  std::vector<uint32_t> ties;
  for (uint32_t hi = 0; hi < 65536; ++hi) {
    for (uint32_t lo : {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu}) ties.push_back(hi << 16 | lo);
  }
  check_patterns_cpu(report, "bf16 ties", ties);

  // every fp16 tie: the midpoint of each pair of neighbours, and one fp32 ulp either side
  std::vector<uint32_t> f16_ties;
  for (uint32_t h = 0; h < 0x7c00; ++h) {
    double lo = f16_to_f32(static_cast<uint16_t>(h));
    double hi = h + 1 < 0x7c00 ? f16_to_f32(static_cast<uint16_t>(h + 1)) : 65536.0;
    uint32_t mid = f32_bits(static_cast<float>((lo + hi) / 2));  // exact: 12 significant bits at most
    for (uint32_t m : {mid - 1, mid, mid + 1}) {
      f16_ties.push_back(m);
      f16_ties.push_back(m | 0x80000000u);
    }
  }
  check_patterns_cpu(report, "fp16 ties", f16_ties);

  // random bit patterns: every exponent equally often, so NaNs, infinities and subnormals turn up too
  std::vector<uint32_t> random(size_t{1} << 24);
  Rng rng(2);
  for (uint32_t& u : random) u = static_cast<uint32_t>(rng.next_u64() >> 32);
  check_patterns_cpu(report, "2^24 random", random);

  std::vector<uint32_t> specials = {
      0x00000000, 0x80000000,              // +-0
      0x00000001, 0x80000001, 0x007fffff,  // fp32 subnormals
      0x00800000, 0x3f800000, 0xbf800000,  // smallest normal, +-1
      0x3f808000, 0x3f818000,              // the chapter's ties: 1 + 2^-8 (down), 1 + 3 * 2^-8 (up)
      0x477fe000, 0x477ff000, 0x477fefff,  // fp16: 65504, 65520 (to inf), just below
      0x7f7f7fff, 0x7f7f8000, 0x7f7fffff,  // bf16's overflow boundary, fp32's largest
      0x7f800000, 0xff800000,              // +-inf
      0x7fc00000, 0xffc00000, 0x7f800001, 0x7fffffff, 0xffbfffff,  // quiet and signalling NaNs
  };
  check_patterns_cpu(report, "specials", specials);
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("  %zu + %zu + %zu + %zu patterns checked in %.1f s\n", ties.size(), f16_ties.size(), random.size(),
              specials.size(), seconds);
}

// ---- 3. GPU: all 2^32 fp32 patterns ------------------------------------------------------------------

void run_gpu_sweep(Report& report) {
  std::printf("\n== GPU: every kernel against the CPU on all 2^32 fp32 bit patterns ==\n");
  auto t0 = std::chrono::steady_clock::now();
  const std::vector<std::string>& versions = bf16_kernel_versions();
  const int64_t chunk = int64_t{1} << 26;  // 256 MiB of fp32 inputs per step, 64 steps
  const size_t nv = versions.size();

  Tensor x = Tensor::empty({chunk}, DType::F32, Device::CUDA);  // [chunk] fp32 bit patterns
  std::vector<Tensor> out_bf16;                                  // per kernel: [chunk] bf16
  std::vector<HostBuffer> host_bf16;
  for (size_t k = 0; k < nv; ++k) {
    out_bf16.push_back(Tensor::empty({chunk}, DType::BF16, Device::CUDA));
    host_bf16.emplace_back(chunk * sizeof(uint16_t), HostBuffer::Kind::Pinned);
  }
  Tensor out_f16 = Tensor::empty({chunk}, DType::F16, Device::CUDA);  // [chunk] fp16
  HostBuffer host_f16(chunk * sizeof(uint16_t), HostBuffer::Kind::Pinned);

  const int workers = worker_count();
  std::vector<Tally> total_bf(nv);
  Tally total_hf;
  for (uint64_t first = 0; first < (uint64_t{1} << 32); first += chunk) {
    fill_f32_bit_patterns(x, static_cast<uint32_t>(first));
    for (size_t k = 0; k < nv; ++k) {
      // poison: 0xffff is a NaN; an element a kernel forgets stays NaN and fails for any non-NaN input
      TVLLM_CUDA_CHECK(cudaMemset(out_bf16[k].data(), 0xff, out_bf16[k].view().nbytes()));
      convert_f32_to_bf16(out_bf16[k], x, versions[k]);
      TVLLM_CUDA_CHECK(cudaMemcpy(host_bf16[k].data(), out_bf16[k].data(), host_bf16[k].bytes(), cudaMemcpyDeviceToHost));
    }
    TVLLM_CUDA_CHECK(cudaMemset(out_f16.data(), 0xff, out_f16.view().nbytes()));
    convert_f32_to_f16(out_f16, x);
    TVLLM_CUDA_CHECK(cudaMemcpy(host_f16.data(), out_f16.data(), host_f16.bytes(), cudaMemcpyDeviceToHost));

    // the CPU computes the oracle once per pattern and compares every kernel's answer with it
    std::vector<std::vector<Tally>> bf(workers, std::vector<Tally>(nv));
    std::vector<Tally> hf(workers);
    parallel_for(chunk, workers, [&](int64_t begin, int64_t end, int w) {
      for (int64_t i = begin; i < end; ++i) {
        uint32_t u = static_cast<uint32_t>(first + i);
        float f = f32_from_bits(u);
        bool nan = std::isnan(f);
        uint16_t want_b = f32_to_bf16(f);
        for (size_t k = 0; k < nv; ++k) {
          uint16_t got = host_bf16[k].as<uint16_t>()[i];
          bf[w][k].add(u, got, want_b, nan, bf16_is_nan(got));
        }
        uint16_t got_h = host_f16.as<uint16_t>()[i];
        hf[w].add(u, got_h, f32_to_f16(f), nan, f16_is_nan(got_h));
      }
    });
    for (int w = 0; w < workers; ++w) {
      for (size_t k = 0; k < nv; ++k) total_bf[k].merge(bf[w][k]);
      total_hf.merge(hf[w]);
    }
  }
  for (size_t k = 0; k < nv; ++k) {
    // v1 is the CPU's algorithm on the GPU: NaN bits must match too. The intrinsics may pick other NaN
    // bits (the hardware's canonical NaN), so for them NaN only has to stay NaN.
    bool exact_nan = versions[k] == "v1";
    report.add_check("gpu bf16 " + versions[k] + " == cpu, 2^32" + (exact_nan ? ", NaN bits" : ""),
                     total_bf[k].pass(exact_nan), total_bf[k].detail());
    std::printf("  fp32->bf16 %s: %lld NaN inputs, %lld came back as a NaN with other bits than the CPU's\n",
                versions[k].c_str(), static_cast<long long>(total_bf[k].nan_inputs),
                static_cast<long long>(total_bf[k].nan_other_bits));
  }
  report.add_check("gpu fp16 == cpu, 2^32", total_hf.pass(false), total_hf.detail());
  std::printf("  fp32->fp16: %lld NaN inputs, %lld came back as a NaN with other bits than the CPU's\n",
              static_cast<long long>(total_hf.nan_inputs), static_cast<long long>(total_hf.nan_other_bits));
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("  4 conversions x 2^32 patterns checked in %.1f s\n", seconds);
}

// What each GPU kernel makes of a few NaNs and the other special values, beside the CPU.
void print_specials_gpu() {
  const std::vector<uint32_t> inputs = {0x7fc00000, 0xffc00000, 0x7f800001, 0x7fa00000, 0xffffffff,
                                        0x7f800000, 0x7f7f8000, 0x00008000, 0x3f808000};
  const std::vector<std::string>& versions = bf16_kernel_versions();
  const int64_t n = static_cast<int64_t>(inputs.size());
  Tensor x = Tensor::empty({n}, DType::F32, Device::CUDA);
  TVLLM_CUDA_CHECK(cudaMemcpy(x.data(), inputs.data(), n * 4, cudaMemcpyHostToDevice));
  Tensor out = Tensor::empty({n}, DType::BF16, Device::CUDA);
  std::vector<std::vector<uint16_t>> got(versions.size(), std::vector<uint16_t>(n));
  for (size_t k = 0; k < versions.size(); ++k) {
    convert_f32_to_bf16(out, x, versions[k]);
    TVLLM_CUDA_CHECK(cudaMemcpy(got[k].data(), out.data(), n * 2, cudaMemcpyDeviceToHost));
  }
  Tensor h = Tensor::empty({n}, DType::F16, Device::CUDA);
  convert_f32_to_f16(h, x);
  std::vector<uint16_t> got_h(n);
  TVLLM_CUDA_CHECK(cudaMemcpy(got_h.data(), h.data(), n * 2, cudaMemcpyDeviceToHost));
  std::printf("\n== special inputs, GPU beside CPU ==\n%-12s %8s", "fp32 bits", "cpu bf16");
  for (const std::string& v : versions) std::printf(" %8s", ("gpu " + v).c_str());
  std::printf(" %9s %9s\n", "cpu fp16", "gpu fp16");
  for (int64_t i = 0; i < n; ++i) {
    float f = f32_from_bits(inputs[i]);
    std::printf("%-12s %8s", hex(inputs[i], 8).c_str(), hex(f32_to_bf16(f), 4).c_str());
    for (size_t k = 0; k < versions.size(); ++k) std::printf(" %8s", hex(got[k][i], 4).c_str());
    std::printf(" %9s %9s\n", hex(f32_to_f16(f), 4).c_str(), hex(got_h[i], 4).c_str());
  }
}

void run_gpu_widening(Report& report) {
  // all 65536 bf16 patterns through the bf16 -> fp32 kernel: bit for bit, NaN payloads included
  std::vector<uint16_t> all(65536);
  for (uint32_t b = 0; b < 65536; ++b) all[b] = static_cast<uint16_t>(b);
  Tensor x = Tensor::empty({65536}, DType::BF16, Device::CUDA);
  TVLLM_CUDA_CHECK(cudaMemcpy(x.data(), all.data(), 65536 * 2, cudaMemcpyHostToDevice));
  Tensor out = Tensor::empty({65536}, DType::F32, Device::CUDA);
  TVLLM_CUDA_CHECK(cudaMemset(out.data(), 0xff, out.view().nbytes()));
  convert_bf16_to_f32(out, x);
  std::vector<uint32_t> got(65536);
  TVLLM_CUDA_CHECK(cudaMemcpy(got.data(), out.data(), 65536 * 4, cudaMemcpyDeviceToHost));
  int64_t bad = 0;
  for (uint32_t b = 0; b < 65536; ++b) bad += got[b] != f32_bits(bf16_to_f32(static_cast<uint16_t>(b)));
  report.add_check("gpu bf16->f32 == cpu, 65536", bad == 0, std::to_string(bad) + " differ");
}

// ---- 4. the model's weights -----------------------------------------------------------------------------

void check_weights(Report& report, const ModelDir& model, bool gpu) {
  std::printf("\n== the model's weights: bf16 -> fp32 -> bf16 ==\n");
  const std::string name = "model.embed_tokens.weight";
  TensorView emb = model.weights.host(name);  // [vocab, hidden] as stored
  if (emb.dtype != DType::BF16) {
    std::printf("  %s is %s, not BF16: the round trip applies to bf16 weights only, skipped\n", name.c_str(),
                std::string(dtype_name(emb.dtype)).c_str());
    return;
  }
  const int64_t n = emb.numel();
  const uint16_t* bytes = emb.ptr<uint16_t>();
  std::printf("  %s %s, the first values of row 0:", name.c_str(), emb.describe().c_str());
  for (int64_t i = 0; i < std::min<int64_t>(4, n); ++i) std::printf(" %s=%.6g", hex(bytes[i], 4).c_str(), bf16_to_f32(bytes[i]));
  std::printf("\n");

  // CPU: widen, narrow, compare the bytes
  Tensor wide = Tensor::empty(emb.shape, DType::F32, Device::CPU);     // [vocab, hidden] fp32
  Tensor narrow = Tensor::empty(emb.shape, DType::BF16, Device::CPU);  // [vocab, hidden] bf16
  convert_bf16_to_f32(wide, emb);
  convert_f32_to_bf16(narrow, wide);
  bool same = std::memcmp(narrow.data(), emb.data, emb.nbytes()) == 0;
  report.add_check("cpu embed_tokens round trip", same, "the round trip changed some bytes");

  // every other bf16 tensor of the model, on the CPU
  int64_t tensors = 0, elements = 0, changed = 0;
  for (const std::string& w : model.weights.names()) {
    TensorView t = model.weights.host(w);
    if (t.dtype != DType::BF16) continue;
    ++tensors;
    elements += t.numel();
    const uint16_t* b = t.ptr<uint16_t>();
    for (int64_t i = 0; i < t.numel(); ++i) changed += f32_to_bf16(bf16_to_f32(b[i])) != b[i];
  }
  std::printf("  %lld bf16 tensors, %lld elements\n", static_cast<long long>(tensors), static_cast<long long>(elements));
  report.add_check("cpu all " + std::to_string(tensors) + " bf16 weights round trip", changed == 0,
                   std::to_string(changed) + " elements changed");

  if (!gpu) return;
  Tensor d_emb = Tensor::copy_of(emb, Device::CUDA);                   // [vocab, hidden] bf16
  Tensor d_wide = Tensor::empty(emb.shape, DType::F32, Device::CUDA);  // [vocab, hidden] fp32
  TVLLM_CUDA_CHECK(cudaMemset(d_wide.data(), 0xff, d_wide.view().nbytes()));
  convert_bf16_to_f32(d_wide, d_emb);
  std::vector<float> wide_back(static_cast<size_t>(n));
  TVLLM_CUDA_CHECK(cudaMemcpy(wide_back.data(), d_wide.data(), n * 4, cudaMemcpyDeviceToHost));
  report.add_check("gpu embed_tokens widen == cpu", std::memcmp(wide_back.data(), wide.data(), n * 4) == 0,
                   "the widened values differ from the CPU's");
  Tensor d_narrow = Tensor::empty(emb.shape, DType::BF16, Device::CUDA);
  std::vector<uint16_t> back(static_cast<size_t>(n));
  for (const std::string& v : bf16_kernel_versions()) {
    TVLLM_CUDA_CHECK(cudaMemset(d_narrow.data(), 0xff, d_narrow.view().nbytes()));
    convert_f32_to_bf16(d_narrow, d_wide, v);
    TVLLM_CUDA_CHECK(cudaMemcpy(back.data(), d_narrow.data(), n * 2, cudaMemcpyDeviceToHost));
    report.add_check("gpu embed_tokens " + v + " round trip", std::memcmp(back.data(), bytes, n * 2) == 0,
                     "the round trip changed some bytes");
  }
}

// ---- bench --------------------------------------------------------------------------------------------

void run_bench(const ModelDir& model, const LessonOptions& opt) {
  const int64_t hidden = model.config.hidden_size;
  const int64_t n = opt.bench_tokens * hidden;  // one activation tensor [tokens, hidden]
  std::vector<float> values = random_normal(static_cast<size_t>(n), 3);
  Tensor x = Tensor::from_f32(values, {opt.bench_tokens, hidden}, DType::F32, Device::CUDA);  // [T, hidden] fp32
  Tensor b = Tensor::empty({opt.bench_tokens, hidden}, DType::BF16, Device::CUDA);             // [T, hidden] bf16
  Tensor h = Tensor::empty({opt.bench_tokens, hidden}, DType::F16, Device::CUDA);              // [T, hidden] fp16
  Tensor w = Tensor::empty({opt.bench_tokens, hidden}, DType::F32, Device::CUDA);              // [T, hidden] fp32
  const double bytes = 6.0 * static_cast<double>(n);  // 4 read + 2 written, or 2 read + 4 written
  std::vector<BenchRow> rows;
  for (const std::string& v : bf16_kernel_versions()) {
    rows.push_back({"fp32->bf16 " + v, bench_gpu([&] { convert_f32_to_bf16(b, x, v); }), bytes, 0.0});
  }
  rows.push_back({"bf16->fp32", bench_gpu([&] { convert_bf16_to_f32(w, b); }), bytes, 0.0});
  rows.push_back({"fp32->fp16", bench_gpu([&] { convert_f32_to_f16(h, x); }), bytes, 0.0});
  print_bench_table(std::cout,
                    "conversions of [" + std::to_string(opt.bench_tokens) + ", " + std::to_string(hidden) +
                        "] (6 bytes per element)",
                    rows, measure_ceilings(false));
  std::vector<float> small(values.begin(), values.begin() + std::min<int64_t>(n, int64_t{1} << 22));
  std::vector<uint16_t> small_out(small.size());
  BenchResult cpu = bench_cpu([&] {
    for (size_t i = 0; i < small.size(); ++i) small_out[i] = f32_to_bf16(small[i]);
  });
  std::printf("  CPU f32_to_bf16 (one core), %zu elements: %.3f ms, %.2f GB/s\n", small.size(), cpu.median_ms,
              6.0 * small.size() / (cpu.median_ms * 1e-3) / 1e9);
}

int run(const LessonOptions& opt) {
  const bool gpu = opt.device == Device::CUDA;
  std::printf("== lesson 02: bf16 (%s) ==\n", gpu ? "cuda" : "cpu");
  print_formats();
  print_experiments();
  Report report(std::string("lesson02_bf16 (") + (gpu ? "cuda" : "cpu") + ")");
  run_cpu_checks(report);
  if (gpu) {
    run_gpu_sweep(report);
    run_gpu_widening(report);
    print_specials_gpu();
  }
  ModelDir model = ModelDir::open(opt.model_dir);
  check_weights(report, model, gpu);
  if (opt.bench && gpu) run_bench(model, opt);
  report.print(std::cout);
  return report.exit_code();
}

}  // namespace

int main(int argc, char** argv) {
  tvllm::LessonCli cli("lesson02_bf16", "bf16: bit layout, round-to-nearest-even, range vs fp16, conversion kernels");
  cli.kernels(tvllm::bf16_kernel_versions(), tvllm::kBf16DefaultKernel);
  return cli.run(argc, argv, [](const tvllm::LessonOptions& opt) { return run(opt); });
}
