// lesson16_quantization: FP8 formats, an FP8 checkpoint of the model, and what it costs in accuracy.
//
//   build/bin/lesson16_quantization                  formats, rounding table, checks, FP8 model vs bf16
//   build/bin/lesson16_quantization --device cpu     the CPU path only
//   build/bin/lesson16_quantization --bench          + conversion kernels, bf16 vs FP8 GEMV, and the prefill GEMM:
//                                                      FP8 cuBLASLt vs bf16 cuBLAS at T = 512 and 4096 (GPU)
//
// 1. the two formats side by side and the rounding table of the chapter (E4M3, saturating)
// 2. CPU: every code round-trips; the encoders against the table oracle on every midpoint between
//    adjacent values, its neighbours and 2^22 random fp32 patterns (tests/test_16_fp8.cpp does all 2^32)
// 3. GPU: v1 and v2 against the CPU on the same inputs, v1 against v2 on ALL 2^32 fp32 patterns, and the
//    FP8 GEMV against its reference
// 4. the model (default: the bundled one) quantized with `tiny-vllm quantize`'s code into a temporary
//    directory, loaded back (lesson 01 dequantizes at load), and measured against the original with
//    teacher forcing over the corpus: top-1 agreement, perplexity of each, logit error; and (small models, on the
//    CPU) with the FP8 GEMM's per-token activation quantization simulated in every projection (README 7.3)
// 5. GPU: the FP8 tensor-core GEMM (fp8_gemm.h) on each of its paths against its double-precision reference
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "accuracy.h"
#include "common/bench.h"
#include "common/cublas.h"
#include "common/errors.h"
#include "common/lesson.h"
#include "common/random.h"
#include "common/validate.h"
#include "fp8.h"
#include "fp8_gemm.h"
#include "fp8_gemv.h"
#include "gemv.h"
#include "matmul.h"
#include "model_dir.h"
#include "quantize.h"

namespace {

using namespace tvllm;
namespace fs = std::filesystem;

// The targets for the bundled model (README.md, "What correct means").
constexpr double kMinTop1Agreement = 0.98;
constexpr double kMaxPerplexityIncrease = 0.01;

void print_formats() {
  std::printf("the 8-bit formats (and bf16 for scale)\n");
  std::printf("  %-5s %4s %4s %5s %12s %12s %12s %s\n", "", "exp", "man", "bias", "largest", "min normal",
              "min subnorm", "specials");
  for (Fp8Kind k : {Fp8Kind::E4M3, Fp8Kind::E5M2}) {
    const Fp8Format& f = fp8_format(k);
    std::printf("  %-5s %4d %4d %5d %12g %12g %12g %s\n", f.name, f.exponent_bits, f.mantissa_bits, f.bias,
                f.max_finite, f.min_normal, f.min_subnormal,
                f.has_infinity ? "+-inf, NaN (e=31, m!=0)" : "NaN only (s.1111.111), no inf");
  }
  std::printf("  %-5s %4d %4d %5d %12g %12g %12g %s\n\n", "bf16", 8, 7, 127, 3.3895e38, 1.1755e-38, 9.1835e-41,
              "+-inf, NaN");
}

// The chapter's rounding table: x, the code, its value, the error, and what happened.
void print_rounding_table() {
  struct Row {
    float x;
    const char* what;
  };
  const Row rows[] = {{1.0f, "exact"},
                      {1.0625f, "tie between 1 and 1.125: to the even code (1)"},
                      {1.1875f, "tie between 1.125 and 1.25: to the even code (1.25)"},
                      {1.1f, "nearest: spacing 0.125 in [1, 2)"},
                      {0.1f, "spacing 2^-7 in [2^-4, 2^-3)"},
                      {300.0f, "spacing 32 in [256, 448]"},
                      {448.0f, "the largest"},
                      {460.0f, "rounds down to 448 (past it: saturation)"},
                      {500.0f, "saturates to 448 (torch's plain cast: NaN)"},
                      {INFINITY, "saturates (torch: NaN)"},
                      {0.003f, "subnormal: multiples of 2^-9 = 0.00195"},
                      {0.0009765625f, "2^-10, a tie between 0 and 2^-9: to 0"},
                      {NAN, "NaN stays NaN"}};
  std::printf("E4M3 rounding (round to nearest even, saturating), and torch's .to(float8_e4m3fn)\n");
  std::printf("  %12s  %6s %12s %12s  %9s  %s\n", "x", "code", "value", "error", "torch", "");
  for (const Row& r : rows) {
    const uint8_t c = f32_to_fp8_e4m3(r.x), t = f32_to_fp8_e4m3_torch_cast(r.x);
    const float v = fp8_e4m3_to_f32(c), tv = fp8_e4m3_to_f32(t);
    std::printf("  %12g  0x%02x %12g %12g  %9g  %s\n", r.x, c, v, std::isfinite(r.x) ? v - r.x : NAN, tv, r.what);
  }
  std::printf("\n");
}

// CPU: every code, every midpoint (and its neighbours), random patterns: encoder == table oracle.
void check_cpu(Report& report) {
  for (Fp8Kind kind : {Fp8Kind::E4M3, Fp8Kind::E5M2}) {
    const Fp8Format& f = fp8_format(kind);
    const std::vector<Fp8TableEntry> table = fp8_value_table(kind);
    int64_t codes_bad = 0;
    for (int c = 0; c < 256; ++c) {
      const float v = fp8_to_f32(kind, static_cast<uint8_t>(c));
      if (std::isfinite(v) && f32_to_fp8(kind, v) != c) ++codes_bad;
    }
    report.add_check(std::string(f.name) + ": every finite code round-trips", codes_bad == 0,
                     std::to_string(codes_bad) + " bad");
    std::vector<float> xs;
    for (size_t i = 0; i + 1 < table.size(); ++i) {
      const float mid = static_cast<float>(0.5 * (table[i].value + table[i + 1].value));
      xs.insert(xs.end(), {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY), -mid});
    }
    Rng rng(16);
    for (int i = 0; i < (1 << 22); ++i) {
      const float x = f32_from_bits(static_cast<uint32_t>(rng.next_u64() >> 32));
      if (!std::isnan(x)) xs.push_back(x);
    }
    int64_t bad = 0;
    for (float x : xs) bad += f32_to_fp8(kind, x) != fp8_round_by_table(table, kind, x);
    report.add_check(std::string(f.name) + ": encoder == table oracle (" + std::to_string(xs.size()) + " values)",
                     bad == 0, std::to_string(bad) + " differ");
  }
}

// The FP8 GEMV on the GPU against its double reference at one decode shape (tests/test_16_fp8_gemv_gpu.cpp
// derives the bound: 2 K 2^-24 sum|x q| scale, plus 2^-8 of the value for the bf16 output).
void check_fp8_gemv(Report& report) {
  const int64_t N = 2048, K = 2048;
  Rng rng(23);
  std::vector<uint16_t> w(static_cast<size_t>(N * K)), x(static_cast<size_t>(K));
  for (auto& v : w) v = f32_to_bf16(static_cast<float>(rng.normal() * 0.02));
  for (auto& v : x) v = f32_to_bf16(static_cast<float>(rng.normal()));
  Fp8Weight q8 = quantize_weight_fp8(TensorView::contiguous(w.data(), DType::BF16, Device::CPU, {N, K}),
                                     Fp8Quantization::Strategy::Channel, DType::F32);
  const Fp8GemvReference ref = fp8_gemv_reference(
      TensorView::contiguous(x.data(), DType::BF16, Device::CPU, {1, K}),
      TensorView::contiguous(q8.codes.data(), DType::F8_E4M3, Device::CPU, {N, K}),
      TensorView::contiguous(q8.scales.data(), DType::F32, Device::CPU, {N}));
  Tensor xd = Tensor::empty({1, K}, DType::BF16, Device::CUDA), q = Tensor::empty({N, K}, DType::F8_E4M3, Device::CUDA);
  Tensor s = Tensor::from_f32(q8.scales, {N}, DType::F32, Device::CUDA), out = Tensor::empty({1, N}, DType::F32, Device::CUDA);
  TVLLM_CUDA_CHECK(cudaMemcpy(xd.data(), x.data(), x.size() * 2, cudaMemcpyHostToDevice));
  TVLLM_CUDA_CHECK(cudaMemcpy(q.data(), q8.codes.data(), q8.codes.size(), cudaMemcpyHostToDevice));
  fp8_gemv(out.view(), xd.view(), q.view(), s.view());
  std::vector<float> got(static_cast<size_t>(N));
  TVLLM_CUDA_CHECK(cudaMemcpy(got.data(), out.data(), got.size() * 4, cudaMemcpyDeviceToHost));
  int64_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double tol = 2.0 * K * std::ldexp(1.0, -24) * ref.abs_sum[i] + std::ldexp(std::fabs(ref.value[i]), -23);
    bad += !(std::fabs(got[i] - ref.value[i]) <= tol);
  }
  report.add_check("FP8 GEMV 1x2048 . 2048x2048 == reference", bad == 0, std::to_string(bad) + " outside the bound");
}

// GPU: both kernels against the CPU on a sample, then v1 against v2 on every fp32 pattern.
void check_gpu(Report& report) {
  std::vector<float> xs;
  Rng rng(61);
  for (int i = 0; i < (1 << 22); ++i) xs.push_back(f32_from_bits(static_cast<uint32_t>(rng.next_u64() >> 32)));
  const int64_t n = static_cast<int64_t>(xs.size());
  Tensor x = Tensor::from_f32(xs, {n}, DType::F32, Device::CUDA);
  for (Fp8Kind kind : {Fp8Kind::E4M3, Fp8Kind::E5M2}) {
    const Fp8Format& f = fp8_format(kind);
    Tensor q = Tensor::empty({n}, f.dtype, Device::CUDA);
    for (const std::string& v : fp8_kernel_versions()) {
      convert_f32_to_fp8(q.view(), x.view(), v);
      std::vector<uint8_t> got(static_cast<size_t>(n));
      TVLLM_CUDA_CHECK(cudaMemcpy(got.data(), q.data(), got.size(), cudaMemcpyDeviceToHost));
      int64_t bad = 0;
      for (size_t i = 0; i < got.size(); ++i) {
        const uint8_t want = f32_to_fp8(kind, xs[i]);
        const bool nan = std::isnan(xs[i]);
        bad += nan ? std::isnan(fp8_to_f32(kind, got[i])) == 0 : got[i] != want;
      }
      report.add_check(std::string(f.name) + " GPU " + v + " == CPU (2^22 random patterns)", bad == 0,
                       std::to_string(bad) + " differ");
    }
    Tensor counters = Tensor::empty({2}, DType::I64, Device::CUDA);
    auto* count = static_cast<unsigned long long*>(counters.data());
    auto* first_bad = reinterpret_cast<uint32_t*>(count + 1);
    TVLLM_CUDA_CHECK(cudaMemset(count, 0, 8));
    TVLLM_CUDA_CHECK(cudaMemset(first_bad, 0xff, 4));
    for (int64_t first = 0; first < (int64_t{1} << 32); first += int64_t{1} << 30)
      fp8_count_v1_v2_disagreements_cuda(kind, static_cast<uint32_t>(first), int64_t{1} << 30, count, first_bad);
    unsigned long long host = 0;
    TVLLM_CUDA_CHECK(cudaMemcpy(&host, count, 8, cudaMemcpyDeviceToHost));
    report.add_check(std::string(f.name) + " GPU v1 == v2 on all 2^32 fp32 patterns", host == 0,
                     std::to_string(host) + " differ");
  }
}

void check_model(const LessonOptions& opt, const fs::path& corpus, Report& report) {
  const fs::path tmp = fs::temp_directory_path() / ("lesson16_fp8_" + std::to_string(std::random_device{}()));
  struct Cleanup {
    fs::path p;
    ~Cleanup() {
      std::error_code ec;
      fs::remove_all(p, ec);
    }
  } cleanup{tmp};
  const QuantizeSummary s = quantize_checkpoint(opt.model_dir, tmp, QuantizeOptions{});
  std::printf("quantized %lld Linear weights (per-channel scales): %.2f MB -> %.2f MB of tensors; worst weight "
              "error %.3f of its bound\n",
              static_cast<long long>(s.quantized_tensors), s.bytes_before / 1e6, s.bytes_after / 1e6,
              s.max_error_over_bound);
  report.add_check("every weight within its FP8 rounding bound", s.max_error_over_bound <= 1.0 + 1e-6,
                   "worst " + std::to_string(s.max_error_over_bound));

  const ModelDir bf16 = ModelDir::open(opt.model_dir);
  const ModelDir fp8 = ModelDir::open(tmp);
  LogitsComparison total, kv8, both8;  // FP8 weights; bf16 weights + FP8 KV; FP8 weights + FP8 KV (all vs bf16)
  TeacherForcing run_bf16(bf16, opt.device, 256), run_fp8(fp8, opt.device, 256);
  TeacherForcing run_kv8(bf16, opt.device, 256, KvCacheDtype::FP8), run_both8(fp8, opt.device, 256, KvCacheDtype::FP8);
  for (const std::vector<int32_t>& ids : corpus_windows(opt.model_dir, corpus, 256, 8)) {
    const Tensor ref = run_bf16.logits(ids);
    const Tensor cand = run_fp8.logits(ids);
    accumulate(total, compare_logits(cand.view(), ref.view(), ids));
    accumulate(kv8, compare_logits(run_kv8.logits(ids).view(), ref.view(), ids));
    accumulate(both8, compare_logits(run_both8.logits(ids).view(), ref.view(), ids));
  }
  const bool text = has_tokenizer(opt.model_dir);
  // README 7.3: the FP8 GEMM's per-token activation quantization, simulated on the CPU in every projection of
  // every step (the engine quantizes steps of 17+ tokens only: an upper bound). Small models only: the CPU runs it.
  // README 7.4: --fp8-lm-head, simulated the same way: the FP8 weights with the lm_head rounded through E4M3, one
  // scale per vocabulary entry (TeacherForcing::simulate_fp8_lm_head).
  std::optional<LogitsComparison> act8, head8;
  if (bf16.config.hidden_size * bf16.config.num_hidden_layers <= 8192) {
    act8.emplace();
    head8.emplace();
    TeacherForcing cpu_bf16(bf16, Device::CPU, 256), cpu_fp8(fp8, Device::CPU, 256), cpu_head8(fp8, Device::CPU, 256);
    cpu_head8.simulate_fp8_lm_head();
    for (const std::vector<int32_t>& ids : corpus_windows(opt.model_dir, corpus, 256, 8)) {
      const Tensor ref = cpu_bf16.logits(ids);
      simulate_fp8_activations_on_cpu(true);
      const Tensor cand = cpu_fp8.logits(ids);
      simulate_fp8_activations_on_cpu(false);
      accumulate(*act8, compare_logits(cand.view(), ref.view(), ids));
      accumulate(*head8, compare_logits(cpu_head8.logits(ids).view(), ref.view(), ids));
    }
  }
  std::printf("\nteacher-forced over %lld positions of %s (%s):\n", static_cast<long long>(total.positions),
              text ? corpus.string().c_str() : "seeded random ids (the model has no tokenizer)",
              std::string(device_name(opt.device)).c_str());
  std::printf("  %-22s %12s %12s\n", "", "bf16 weights", "FP8 weights");
  std::printf("  %-22s %12.5f %12.5f\n", "perplexity", total.reference_perplexity, total.candidate_perplexity);
  std::printf("  %-22s %12s %11.2f%%\n", "top-1 agreement", "-", 100.0 * total.top1_agreement());
  std::printf("  %-22s %12s %12.4f   (rms of the logits %.3f; max |err| %.4f)\n\n", "rms logit error", "-",
              total.rms_error, total.reference_rms, total.max_abs_error);
  // Lesson 16 section 8: the FP8 KV cache (E4M3, per-layer scales: the checkpoint's, else 1.0), each row against
  // the bf16 run above.
  std::printf("  %-22s %12s %12s %12s\n", "", "bf16 weights", "bf16 w + ", "FP8 w + ");
  std::printf("  %-22s %12s %12s %12s\n", "", "bf16 KV", "FP8 KV", "FP8 KV");
  std::printf("  %-22s %12.5f %12.5f %12.5f\n", "perplexity", total.reference_perplexity, kv8.candidate_perplexity,
              both8.candidate_perplexity);
  std::printf("  %-22s %12s %11.2f%% %11.2f%%\n", "top-1 agreement", "-", 100.0 * kv8.top1_agreement(),
              100.0 * both8.top1_agreement());
  std::printf("  %-22s %12s %12.4f %12.4f\n", "rms logit error", "-", kv8.rms_error, both8.rms_error);
  std::printf("  %-22s %12s %12.4f %12.4f\n\n", "max |logit error|", "-", kv8.max_abs_error, both8.max_abs_error);
  // E4M3 keys and values move each score by ~2^-4 relative at worst (README section 8): the logits move by a few
  // percent of their rms, as FP8 weights do; a wrong scale or a kernel reading the wrong bytes moves them by more
  // than their own size. The same 25% separates the two.
  report.add_check("FP8 KV: rms logit error < 25% of rms logits", kv8.rms_error < 0.25 * kv8.reference_rms,
                   std::to_string(kv8.rms_error) + " vs " + std::to_string(kv8.reference_rms));
  report.add_check("FP8 weights + FP8 KV: rms logit error < 25% of rms logits",
                   both8.rms_error < 0.25 * both8.reference_rms,
                   std::to_string(both8.rms_error) + " vs " + std::to_string(both8.reference_rms));
  // Every model: per-weight errors of at most 2^-4 (relative, ~2% rms) with independent signs move the logits
  // by a few percent of their rms (4.7% on the bundled model; more layers compound it somewhat). A scale
  // ignored, transposed or applied twice moves them by more than their own size: 25% separates the two.
  report.add_check("rms logit error < 25% of rms logits", total.rms_error < 0.25 * total.reference_rms,
                   std::to_string(total.rms_error) + " vs " + std::to_string(total.reference_rms));
  if (act8) {
    std::printf("  FP8 weights + FP8 activations per token (CPU simulation, every projection): perplexity %.5f vs "
                "%.5f bf16, top-1 agreement %.2f%%, rms logit error %.4f\n\n",
                act8->candidate_perplexity, act8->reference_perplexity, 100.0 * act8->top1_agreement(),
                act8->rms_error);
    report.add_check("FP8 activations (simulated): rms logit error < 25% of rms logits",
                     act8->rms_error < 0.25 * act8->reference_rms,
                     std::to_string(act8->rms_error) + " vs " + std::to_string(act8->reference_rms));
    if (text) {
      const double up = act8->candidate_perplexity / act8->reference_perplexity - 1.0;
      report.add_check("FP8 activations (simulated): top-1 >= 98%, perplexity within 1%",
                       act8->top1_agreement() >= kMinTop1Agreement && std::fabs(up) <= kMaxPerplexityIncrease,
                       std::to_string(100.0 * act8->top1_agreement()) + "%, " + std::to_string(100.0 * up) + "%");
    }
  }
  if (head8) {
    std::printf("  FP8 weights + FP8 lm_head (CPU simulation, --fp8-lm-head): perplexity %.5f vs %.5f bf16, top-1 "
                "agreement %.2f%%, rms logit error %.4f (max %.4f)\n\n",
                head8->candidate_perplexity, head8->reference_perplexity, 100.0 * head8->top1_agreement(),
                head8->rms_error, head8->max_abs_error);
    report.add_check("FP8 lm_head (simulated): rms logit error < 25% of rms logits",
                     head8->rms_error < 0.25 * head8->reference_rms,
                     std::to_string(head8->rms_error) + " vs " + std::to_string(head8->reference_rms));
    if (text) {
      const double up = head8->candidate_perplexity / head8->reference_perplexity - 1.0;
      report.add_check("FP8 lm_head (simulated): top-1 >= 98%, perplexity within 1%",
                       head8->top1_agreement() >= kMinTop1Agreement && std::fabs(up) <= kMaxPerplexityIncrease,
                       std::to_string(100.0 * head8->top1_agreement()) + "%, " + std::to_string(100.0 * up) + "%");
    }
  }
  if (!text) return;  // the targets below are about text the model knows (a random model has none)
  const double increase = total.candidate_perplexity / total.reference_perplexity - 1.0;
  report.add_check("top-1 agreement >= 98%", total.top1_agreement() >= kMinTop1Agreement,
                   std::to_string(100.0 * total.top1_agreement()) + "%");
  report.add_check("perplexity within 1% of bf16", std::fabs(increase) <= kMaxPerplexityIncrease,
                   std::to_string(100.0 * increase) + "%");
}

// The decode GEMV at Llama-3.2-1B's shapes (QKV, o_proj, gate|up, down_proj) and batches 1..16: lesson 14's bf16
// v3, this lesson's first FP8 kernel (fp8_gemv.cu), and lesson 14's v3 reading the E4M3 codes in each of its
// decodings (gemv.h's Fp8GemvVariant: the engine's decode steps with resident FP8 weights run the one that
// kFp8GemvVariantByRows names). All read every weight once; the FP8 ones read half the bytes. The last table
// sums each variant's times over the four shapes per batch: what to write into kFp8GemvVariantByRows.
void bench_gemv(const Ceilings& ceilings) {
  struct Shape {
    int64_t N, K;
    Tensor wb, q, s;
  };
  std::vector<Shape> shapes;
  Rng rng(5);
  for (auto [N, K] : {std::pair<int64_t, int64_t>{3072, 2048}, {2048, 2048}, {16384, 2048}, {2048, 8192}}) {
    std::vector<float> w(static_cast<size_t>(N * K));
    for (float& v : w) v = static_cast<float>(rng.normal() * 0.02);
    std::vector<uint16_t> host_w(w.size());
    for (size_t i = 0; i < w.size(); ++i) host_w[i] = f32_to_bf16(w[i]);
    const Fp8Weight q8 = quantize_weight_fp8(TensorView::contiguous(host_w.data(), DType::BF16, Device::CPU, {N, K}),
                                             Fp8Quantization::Strategy::Channel, DType::F32);
    Shape sh{N, K, Tensor::from_f32(w, {N, K}, DType::BF16, Device::CUDA),
             Tensor::empty({N, K}, DType::F8_E4M3, Device::CUDA),
             Tensor::from_f32(q8.scales, {N}, DType::F32, Device::CUDA)};
    TVLLM_CUDA_CHECK(cudaMemcpy(sh.q.data(), q8.codes.data(), q8.codes.size(), cudaMemcpyHostToDevice));
    shapes.push_back(std::move(sh));
  }
  const std::vector<Fp8GemvVariant>& variants = all_fp8_gemv_variants();
  const int64_t batches[] = {1, 2, 4, 8, 16};
  // total_ms[b][v]: variant v's median times summed over the shapes at batch b; [b][variants.size()]: bf16 v3.
  std::vector<std::vector<double>> total_ms(std::size(batches), std::vector<double>(variants.size() + 1, 0.0));
  for (size_t b = 0; b < std::size(batches); ++b) {
    const int64_t M = batches[b];
    std::vector<BenchRow> rows;
    for (const Shape& sh : shapes) {
      const int64_t N = sh.N, K = sh.K;
      std::vector<float> xs(static_cast<size_t>(M * K));
      for (float& v : xs) v = static_cast<float>(rng.normal());
      Tensor x = Tensor::from_f32(xs, {M, K}, DType::BF16, Device::CUDA);
      Tensor out = Tensor::empty({M, N}, DType::BF16, Device::CUDA);
      const std::string shape = std::to_string(N) + "x" + std::to_string(K);
      const double flops = 2.0 * M * N * K;
      const auto fp8_bytes = static_cast<double>(gemv_fp8_bytes_moved(M, N, K, DType::BF16));
      rows.push_back({"bf16 gemv v3        " + shape, bench_gpu([&] { gemv(out.view(), x.view(), sh.wb.view()); }),
                      static_cast<double>(gemv_bytes_moved(M, N, K, DType::BF16)), flops});
      total_ms[b][variants.size()] += rows.back().result.median_ms;
      rows.push_back({"fp8 gemv (16)       " + shape,
                      bench_gpu([&] { fp8_gemv(out.view(), x.view(), sh.q.view(), sh.s.view()); }),
                      static_cast<double>(fp8_gemv_bytes_moved(M, N, K, DType::BF16)), flops});
      for (size_t v = 0; v < variants.size(); ++v) {
        std::string name = "fp8 v3 " + std::string(fp8_gemv_variant_name(variants[v]));
        name.resize(20, ' ');
        rows.push_back({name + shape, bench_gpu([&] {
                          gemv(out.view(), x.view(), sh.q.view(), sh.s.view(), nullptr, variants[v]);
                        }),
                        fp8_bytes, flops});
        total_ms[b][v] += rows.back().result.median_ms;
      }
    }
    print_bench_table(std::cout,
                      "decode GEMV, batch " + std::to_string(M) +
                          ": bf16 v3, FP8 (this lesson's first kernel), FP8 through lesson 14's v3 per decoding "
                          "(bytes = weights + scales + x + out)",
                      rows, ceilings);
  }
  std::printf("\nFP8 v3 per batch, median times summed over the four shapes (ms), and the fastest:\n");
  std::printf("  %-6s", "batch");
  for (Fp8GemvVariant v : variants) std::printf(" %12s", std::string(fp8_gemv_variant_name(v)).c_str());
  std::printf(" %12s   fastest (kFp8GemvVariantByRows)\n", "bf16 v3");
  std::string table;
  for (size_t b = 0; b < std::size(batches); ++b) {
    std::printf("  %-6lld", static_cast<long long>(batches[b]));
    size_t best = 0;
    for (size_t v = 0; v < variants.size(); ++v) {
      std::printf(" %12.4f", total_ms[b][v]);
      if (total_ms[b][v] < total_ms[b][best]) best = v;
    }
    std::printf(" %12.4f   %s (%.2fx bf16)\n", total_ms[b][variants.size()],
                std::string(fp8_gemv_variant_name(variants[best])).c_str(),
                total_ms[b][variants.size()] / total_ms[b][best]);
    table += std::string(b ? ", " : "") + "Fp8GemvVariant::" +
             (variants[best] == Fp8GemvVariant::Cvt ? "Cvt" : variants[best] == Fp8GemvVariant::Bits ? "Bits"
                                                                                                      : "BitsTile8");
  }
  std::printf("  gemv.h: kFp8GemvVariantByRows[5] = {%s};\n\n", table.c_str());
}

// Random x [T, K] (bf16) and a per-channel FP8 weight [N, K], on the GPU, with x quantized per token.
struct GemmProblem {
  int64_t T, N, K;
  Tensor x, w_bf16, wq, sw, xq, sx, y;
};
GemmProblem make_gemm_problem(int64_t T, int64_t N, int64_t K, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> xs(static_cast<size_t>(T * K)), ws(static_cast<size_t>(N * K));
  for (float& v : xs) v = static_cast<float>(rng.normal());
  for (float& v : ws) v = static_cast<float>(0.02 * rng.normal());
  std::vector<uint16_t> wb(ws.size());
  for (size_t i = 0; i < ws.size(); ++i) wb[i] = f32_to_bf16(ws[i]);
  const Fp8Weight q8 = quantize_weight_fp8(TensorView::contiguous(wb.data(), DType::BF16, Device::CPU, {N, K}),
                                           Fp8Quantization::Strategy::Channel, DType::F32);
  GemmProblem p{T, N, K, Tensor::from_f32(xs, {T, K}, DType::BF16, Device::CUDA),
                Tensor::from_f32(ws, {N, K}, DType::BF16, Device::CUDA),
                Tensor::empty({N, K}, DType::F8_E4M3, Device::CUDA), Tensor::from_f32(q8.scales, {N}, DType::F32, Device::CUDA),
                Tensor::empty({T, K}, DType::F8_E4M3, Device::CUDA), Tensor::empty({T}, DType::F32, Device::CUDA),
                Tensor::empty({T, N}, DType::BF16, Device::CUDA)};
  TVLLM_CUDA_CHECK(cudaMemcpy(p.wq.data(), q8.codes.data(), q8.codes.size(), cudaMemcpyHostToDevice));
  quantize_activations(p.xq.view(), p.sx.view(), p.x.view());
  return p;
}

// Each FP8 path at one prefill shape against the double-precision reference (tests/test_16_fp8_gemm_gpu.cpp has
// the full set and the tolerance's derivation: 2K 2^-24 sum|terms| + 2^-8 |value|, twice that for the epilogue).
void check_fp8_gemm(Report& report) {
  const int64_t T = 64, N = 512, K = 1024;
  GemmProblem p = make_gemm_problem(T, N, K, 21);
  const Tensor xq = Tensor::copy_of(p.xq.view(), Device::CPU), sx = Tensor::copy_of(p.sx.view(), Device::CPU),
               wq = Tensor::copy_of(p.wq.view(), Device::CPU), sw = Tensor::copy_of(p.sw.view(), Device::CPU);
  const Fp8GemmReference ref = fp8_gemm_reference(xq.view(), sx.view(), wq.view(), sw.view());
  CublasHandle handle;
  const Fp8GemmContext ctx{handle.lt(), handle.workspace(), handle.workspace_bytes(), nullptr, false};
  for (Fp8GemmPath path : {Fp8GemmPath::ScaleVectors, Fp8GemmPath::Epilogue}) {
    const Fp8GemmPath ran = fp8_gemm(p.y.view(), p.xq.view(), p.sx.view(), p.wq.view(), p.sw.view(), path, ctx);
    const std::string name = "FP8 GEMM " + std::string(fp8_gemm_path_name(path)) + " " + std::to_string(T) + "x" +
                             std::to_string(N) + "x" + std::to_string(K);
    if (ran == Fp8GemmPath::Dequantize) {
      std::printf("%s: cuBLASLt has no algorithm here (auto falls back)\n", name.c_str());
      if (path == Fp8GemmPath::Epilogue) report.add_check(name + " runs", false, "declined");
      continue;
    }
    const std::vector<float> got = to_f32_vector(p.y.view());
    const double rel = path == Fp8GemmPath::Epilogue ? std::ldexp(1.0, -7) : std::ldexp(1.0, -8);
    int64_t bad = 0;
    for (size_t i = 0; i < got.size(); ++i)
      bad += !(std::fabs(got[i] - ref.value[i]) <=
               2.0 * K * std::ldexp(1.0, -24) * ref.abs_sum[i] + rel * std::fabs(ref.value[i]));
    report.add_check(name + " == reference", bad == 0, std::to_string(bad) + " outside the bound");
  }
}

// The prefill GEMM at Llama-3.2-1B's projections, T = 512 and 4096: lesson 06's bf16 cuBLAS (v5) against the FP8
// GEMM's paths (the GEMM alone, the activations already quantized), fast accumulation off and on, and the
// quantizer alone. TFLOP/s beside the bf16 peak measured here: the FP8 tensor cores' peak is twice it.
void bench_gemm(const Ceilings& ceilings) {
  CublasHandle handle;
  for (int64_t T : {512, 4096}) {
    std::vector<BenchRow> rows;
    for (auto [N, K] : {std::pair<int64_t, int64_t>{3072, 2048}, {2048, 2048}, {16384, 2048}, {2048, 8192}}) {
      GemmProblem p = make_gemm_problem(T, N, K, static_cast<uint64_t>(N + K));
      const std::string shape = std::to_string(N) + "x" + std::to_string(K);
      const double flops = 2.0 * T * N * K;
      rows.push_back({"bf16 cuBLAS          " + shape,
                      bench_gpu([&] { linear(p.y.view(), p.x.view(), p.w_bf16.view(), MatmulKernel::V5Cublas, &handle); }),
                      2.0 * (T * K + N * K + T * N), flops});
      for (const bool fast : {false, true})
        for (Fp8GemmPath path : {Fp8GemmPath::ScaleVectors, Fp8GemmPath::Epilogue}) {
          const Fp8GemmContext ctx{handle.lt(), handle.workspace(), handle.workspace_bytes(), nullptr, fast};
          if (fp8_gemm(p.y.view(), p.xq.view(), p.sx.view(), p.wq.view(), p.sw.view(), path, ctx) != path) continue;
          std::string name = "fp8 " + std::string(fp8_gemm_path_name(path)) + (fast ? " fast" : "");
          name.resize(21, ' ');
          rows.push_back({name + shape, bench_gpu([&] {
                            fp8_gemm(p.y.view(), p.xq.view(), p.sx.view(), p.wq.view(), p.sw.view(), path, ctx);
                          }),
                          static_cast<double>(T * K + N * K + 2 * T * N), flops});
        }
      std::string name = "quantize x (T x K)";
      name.resize(21, ' ');
      rows.push_back({name + shape, bench_gpu([&] { quantize_activations(p.xq.view(), p.sx.view(), p.x.view()); }),
                      3.0 * T * K, 0.0});
    }
    print_bench_table(std::cout,
                      "prefill GEMM, T = " + std::to_string(T) +
                          ": bf16 cuBLAS vs FP8 cuBLASLt (E4M3 x E4M3 -> bf16, fp32 compute; FP8 peak = 2x the bf16 "
                          "peak column)",
                      rows, ceilings);
  }
}

void run_bench(const LessonOptions& opt) {
  const int64_t n = opt.bench_tokens * 2048;  // an activation tensor [tokens, 2048]
  std::vector<float> values(static_cast<size_t>(n));
  Rng rng(3);
  for (float& v : values) v = static_cast<float>(3.0 * rng.normal());
  Tensor x = Tensor::from_f32(values, {n}, DType::F32, Device::CUDA);
  Tensor q = Tensor::empty({n}, DType::F8_E4M3, Device::CUDA);
  Tensor back = Tensor::empty({n}, DType::F32, Device::CUDA);
  const double bytes = 5.0 * static_cast<double>(n);  // 4 read + 1 written, or the reverse
  std::vector<BenchRow> rows;
  for (const std::string& v : fp8_kernel_versions())
    rows.push_back({"fp32->e4m3 " + v, bench_gpu([&] { convert_f32_to_fp8(q.view(), x.view(), v); }), bytes, 0.0});
  rows.push_back({"e4m3->fp32", bench_gpu([&] { convert_fp8_to_f32(back.view(), q.view()); }), bytes, 0.0});
  const Ceilings ceilings = measure_ceilings(true);  // the GEMM peak too: the prefill GEMM's table reads it
  print_bench_table(std::cout, "conversions of " + std::to_string(n) + " elements (5 bytes each)", rows, ceilings);
  bench_gemv(ceilings);
  bench_gemm(ceilings);
}

int run(const LessonOptions& opt, const fs::path& corpus) {
  print_formats();
  print_rounding_table();
  Report report("lesson 16: FP8");
  check_cpu(report);
  if (opt.device == Device::CUDA) {
    check_gpu(report);
    check_fp8_gemv(report);
    check_fp8_gemm(report);
  }
  check_model(opt, corpus, report);
  report.print(std::cout);
  if (opt.bench && opt.device == Device::CUDA) run_bench(opt);
  return report.exit_code();
}

}  // namespace

int main(int argc, char** argv) {
  tvllm::LessonCli cli("lesson16_quantization",
                       "FP8: E4M3/E5M2 rounding and saturation, FP8 checkpoints, accuracy vs bf16");
  cli.kernels(tvllm::fp8_kernel_versions(), tvllm::kFp8DefaultKernel);
  std::string corpus = (tvllm::default_model_dir().parent_path() / "corpus").string();
  cli.app().add_option("--corpus", corpus, "a folder of .txt files for the accuracy measurement");
  return cli.run(argc, argv, [&](const tvllm::LessonOptions& opt) { return run(opt, corpus); });
}
