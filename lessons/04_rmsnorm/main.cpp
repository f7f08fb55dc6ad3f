// lesson04_rmsnorm: run RMSNorm on the reference inputs of every prompt and compare with Hugging Face:
//   - input_layernorm of each captured layer (input: embed_tokens for layer 0, else the previous layer's output)
//   - post_attention_layernorm of each captured layer (input: attn_residual)
//   - the final norm (input: the last layer's output)
// and the fused add_rmsnorm the decoder will use between sublayers:
//   residual = layer input, x = o_proj     -> residual == attn_residual, out == post_attention_layernorm
//   residual = attn_residual, x = down_proj (last layer) -> residual == that layer's output, out == norm
//
//   build/bin/lesson04_rmsnorm [--model DIR] [--device auto|cpu|cuda] [--kernel v1|v2|v3] [--bench]
//                              [--tokens N]
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "common/bench.h"
#include "common/errors.h"
#include "common/lesson.h"
#include "common/random.h"
#include "common/validate.h"
#include "model_dir.h"
#include "rmsnorm.h"

namespace tvllm {
namespace {

// CPU (fp32, double sum) vs HF (fp32, float sum): the sums differ by ~1e-7 relative, the outputs by a few
// fp32 ulps. y_i = x_i * inv_rms * w_i has no cancellation, so a relative bound holds for every element;
// atol only covers exact zeros.
constexpr Tolerance kCpuTol{1e-6, 1e-5};
// CPU residual: the same fp32 addition of the same two fp32 numbers that HF did: identical bits.
constexpr Tolerance kExact{0.0, 0.0};
// One rounding to bf16 (8 significant bits, round to nearest) is off by at most half a unit in the last
// place: 2^-8 = 0.39% of the value.
constexpr double kBf16Rounding = 1.0 / 256;
// GPU (bf16) vs HF (fp32), per element and relative: the input stored as bf16 (2^-8); inv_rms from those
// rounded inputs (their squares 2^-7, the square root halves it: 2^-8); HF's two bf16 roundings of the
// output (2 x 2^-8). At most 4 x 2^-8 = 1.56%, plus ~1e-6 of fp32 sum order and rsqrtf. A worst case, not a
// typical one (see max_rel in the table), but elements near it exist among tens of thousands.
constexpr Tolerance kGpuTol{1e-6, 4 * kBf16Rounding + 1e-4};
// The same when the checkpoint stores the norm weight in F32 or F16: the reference used that weight, the
// GPU uses it rounded once to bf16 at load (upload_to_device(BF16)), one more relative 2^-8.
constexpr Tolerance kGpuTolRoundedWeight{1e-6, 5 * kBf16Rounding + 1e-4};
// GPU fused output vs the CPU oracle run on the residual exactly as the GPU stored it (bf16) and on the
// weight exactly as the GPU holds it (bf16): only the kernel's two output roundings remain, 2 x 2^-8 = 0.78%.
constexpr Tolerance kGpuFusedTol{1e-6, 2 * kBf16Rounding + 1e-4};

// Row names are short (the report's column is 34 wide): "L0" is layer 0, input_norm / post_attn_norm /
// final_norm the reference's input_layernorm / post_attention_layernorm / norm.
struct NormCase {
  std::string name, input, weight, expected;
};
struct FusedCase {
  std::string name, residual_in, x, weight, expected_residual, expected_out;
};

std::string layer_weight(int l, const std::string& which) {
  return "model.layers." + std::to_string(l) + "." + which + ".weight";
}

void make_cases(const ReferenceSet& refs, const ModelConfig& cfg, std::vector<NormCase>& norms,
                std::vector<FusedCase>& fused) {
  const int L = static_cast<int>(cfg.num_hidden_layers);
  for (int i = 0; i < refs.num_prompts(); ++i) {
    const std::string p = "p" + std::to_string(i) + ".";
    auto layer = [&](int l, const std::string& what) {
      return p + "layers." + std::to_string(l) + "." + what;
    };
    auto short_name = [&](int l) { return p + "L" + std::to_string(l); };
    // What enters layer l: the embeddings for layer 0, else the residual stream after layer l - 1.
    auto layer_input = [&](int l) { return l == 0 ? p + "embed_tokens" : layer(l - 1, "output"); };
    for (int l : refs.captured_layers()) {
      norms.push_back({short_name(l) + ".input_norm", layer_input(l), layer_weight(l, "input_layernorm"),
                       layer(l, "input_layernorm")});
      norms.push_back({short_name(l) + ".post_attn_norm", layer(l, "attn_residual"),
                       layer_weight(l, "post_attention_layernorm"), layer(l, "post_attention_layernorm")});
      // residual = layer input, x = o_proj: residual becomes attn_residual, out post_attention_layernorm
      fused.push_back({short_name(l) + " fused post_attn", layer_input(l), layer(l, "o_proj"),
                       layer_weight(l, "post_attention_layernorm"), layer(l, "attn_residual"),
                       layer(l, "post_attention_layernorm")});
    }
    norms.push_back({p + "final_norm", layer(L - 1, "output"), "model.norm.weight", p + "norm"});
    // residual = attn_residual, x = down_proj of the last layer: residual becomes its output, out the norm
    fused.push_back({short_name(L - 1) + " fused final", layer(L - 1, "attn_residual"),
                     layer(L - 1, "down_proj"), "model.norm.weight", layer(L - 1, "output"), p + "norm"});
  }
}

// Fill with 0xFF bytes (NaN in every float format): an element the kernel forgets fails the comparison.
void poison(const TensorView& t) {
  if (t.device == Device::CUDA)
    TVLLM_CUDA_CHECK(cudaMemset(t.data, 0xFF, t.nbytes()));
  else
    std::memset(t.data, 0xFF, t.nbytes());
}

// residual + x as the GPU computes it: both rounded to bf16 (that is how they are stored), added in fp32,
// the sum rounded to bf16. The kernel must reproduce these bits exactly.
Tensor bf16_residual_sum(const TensorView& residual, const TensorView& x) {
  std::vector<float> r = to_f32_vector(residual), a = to_f32_vector(x);
  for (size_t k = 0; k < r.size(); ++k)
    r[k] = bf16_to_f32(f32_to_bf16(bf16_to_f32(f32_to_bf16(r[k])) + bf16_to_f32(f32_to_bf16(a[k]))));
  return Tensor::from_f32(r, residual.shape, DType::F32, Device::CPU);
}

// Runs every case with one kernel (GPU) or the reference (CPU). Adds rows to `report` when `rows` is set;
// returns the number of failed comparisons and the first failure's description.
struct CaseRun {
  int checked = 0, failed = 0;
  std::string first_failure;
  void note(Report* report, CompareResult r) {
    ++checked;
    if (!r.pass() && failed++ == 0)
      first_failure =
          r.name + ": " + (r.error.empty() ? std::to_string(r.bad) + " elements outside tolerance" : r.error);
    if (report) report->add(std::move(r));
  }
};

CaseRun run_cases(const ModelDir& model, const ReferenceSet& refs, const std::vector<NormCase>& norms,
                  const std::vector<FusedCase>& fused, Device device, RmsNormKernel kernel, Report* report) {
  const float eps = static_cast<float>(model.config.rms_norm_eps);
  const std::string tag = device == Device::CUDA ? " [" + std::string(rmsnorm_kernel_name(kernel)) + "]" : "";
  CaseRun run;
  for (const NormCase& c : norms) {
    const TensorView input = refs.get(c.input);  // [T, hidden] fp32
    const TensorView weight = model.weights.get(c.weight, device);
    if (device == Device::CPU) {
      Tensor out = Tensor::empty(input.shape, DType::F32, Device::CPU);
      poison(out);
      rmsnorm(out, input, weight, eps);
      run.note(report, compare(c.name, out, refs.get(c.expected), kCpuTol));
    } else {
      Tensor x = Tensor::copy_of(input, Device::CUDA, DType::BF16);
      Tensor out = Tensor::empty(input.shape, DType::BF16, Device::CUDA);
      poison(out);
      rmsnorm(out, x, weight, eps, kernel);
      const bool weight_rounded = model.weights.host(c.weight).dtype != DType::BF16;
      run.note(report,
               compare(c.name + tag, out, refs.get(c.expected), weight_rounded ? kGpuTolRoundedWeight : kGpuTol));
    }
  }
  for (const FusedCase& c : fused) {
    const TensorView residual_in = refs.get(c.residual_in), x_in = refs.get(c.x);
    if (device == Device::CPU) {
      Tensor residual = Tensor::copy_of(residual_in, Device::CPU);
      Tensor out = Tensor::empty(x_in.shape, DType::F32, Device::CPU);
      poison(out);
      add_rmsnorm(residual, x_in, model.weights.host(c.weight), out, eps);
      run.note(report, compare(c.name + ": residual", residual, refs.get(c.expected_residual), kExact));
      run.note(report, compare(c.name + ": out", out, refs.get(c.expected_out), kCpuTol));
    } else {
      Tensor residual = Tensor::copy_of(residual_in, Device::CUDA, DType::BF16);
      Tensor x = Tensor::copy_of(x_in, Device::CUDA, DType::BF16);
      Tensor out = Tensor::empty(x_in.shape, DType::BF16, Device::CUDA);
      poison(out);
      add_rmsnorm(residual, x, model.weights.device(c.weight), out, eps, kernel);
      // The residual: bit-exact against the bf16 sum. The output: against the oracle on that same residual.
      Tensor expected_residual = bf16_residual_sum(residual_in, x_in);
      Tensor oracle = Tensor::empty(x_in.shape, DType::F32, Device::CPU);
      const Tensor gpu_weight = Tensor::copy_of(model.weights.device(c.weight), Device::CPU);  // bf16 [H]
      rmsnorm_cpu(oracle, expected_residual, gpu_weight, eps);
      run.note(report, compare(c.name + ": res" + tag, residual, expected_residual, kExact));
      run.note(report, compare(c.name + ": out" + tag, out, oracle, kGpuFusedTol));
    }
  }
  return run;
}

Tensor random_bf16(int64_t rows, int64_t hidden, uint64_t seed) {
  return Tensor::from_f32(random_uniform(static_cast<size_t>(rows * hidden), seed, -2.f, 2.f), {rows, hidden},
                          DType::BF16, Device::CUDA);
}

void run_bench(const ModelDir& model, const LessonOptions& opt) {
  const int64_t T = opt.bench_tokens, H = model.config.hidden_size;
  const float eps = static_cast<float>(model.config.rms_norm_eps);
  Tensor x = random_bf16(T, H, 1), residual = random_bf16(T, H, 2);  // [T, H]
  Tensor out = Tensor::empty({T, H}, DType::BF16, Device::CUDA);
  const TensorView weight = model.weights.device("model.norm.weight");  // [H] bf16 (converted at load)
  const double act =
      static_cast<double>(T) * static_cast<double>(H) * 2.0;  // bytes of one [T, H] bf16 tensor
  const double norm_bytes = 2.0 * act + 2.0 * H;              // read x, write out, weight once
  const double fused_bytes = 4.0 * act + 2.0 * H;             // residual r+w, x, out
  std::vector<BenchRow> rows;
  for (RmsNormKernel k : all_rmsnorm_kernels())
    rows.push_back({"rmsnorm " + std::string(rmsnorm_kernel_name(k)),
                    bench_gpu([&] { rmsnorm(out, x, weight, eps, k); }), norm_bytes});
  // v3's trade-off: vectors per thread (registers, loads in flight) vs threads per block.
  const int vec = H % 8 == 0 ? 8 : H % 4 == 0 ? 4 : H % 2 == 0 ? 2 : 1;
  for (int per_thread : {1, 2, 4, 8}) {
    const RmsNormV3Shape shape = rmsnorm_v3_shape(H, vec, per_thread);
    if (!shape.fits) continue;
    rows.push_back(
        {"rmsnorm v3 " + std::to_string(per_thread) + "x" + std::to_string(vec) + " bf16, " +
             std::to_string(shape.threads) + " thr",
         bench_gpu([&] { rmsnorm(out, x, weight, eps, RmsNormOptions(RmsNormKernel::V3, per_thread)); }),
         norm_bytes});
  }
  // The fused form keeps adding x into the residual run after run; the values stay small (|x| <= 2).
  for (RmsNormKernel k : all_rmsnorm_kernels())
    rows.push_back({"add_rmsnorm " + std::string(rmsnorm_kernel_name(k)),
                    bench_gpu([&] { add_rmsnorm(residual, x, weight, out, eps, k); }), fused_bytes});
  const RmsNormV3Shape chosen = rmsnorm_v3_shape(H, vec, 0);
  print_bench_table(std::cout,
                    "rmsnorm: " + std::to_string(T) + " tokens x hidden " + std::to_string(H) +
                        " bf16, L2 flushed (v3 default: " + std::to_string(chosen.vectors_per_thread) +
                        " vectors of " + std::to_string(vec) + ", " + std::to_string(chosen.threads) +
                        " threads)",
                    rows, measure_ceilings(false));

  // The CPU reference, for scale, on at most 256 rows.
  const int64_t cpu_rows = std::min<int64_t>(T, 256);
  Tensor cpu_x = Tensor::from_f32(random_uniform(static_cast<size_t>(cpu_rows * H), 3), {cpu_rows, H},
                                  DType::F32, Device::CPU);
  Tensor cpu_out = Tensor::empty({cpu_rows, H}, DType::F32, Device::CPU);
  const TensorView cpu_w = model.weights.host("model.norm.weight");
  BenchResult cpu = bench_cpu([&] { rmsnorm_cpu(cpu_out, cpu_x, cpu_w, eps); });
  std::printf("cpu reference: %lld rows in %.3f ms\n", static_cast<long long>(cpu_rows), cpu.median_ms);
}

int run(const LessonOptions& opt) {
  ModelDir model = ModelDir::open(opt.model_dir);
  ReferenceSet refs = ReferenceSet::open(opt.model_dir);
  // The kernels take bf16: an F32 or F16 checkpoint is converted once, here, at load.
  if (opt.device == Device::CUDA) model.weights.upload_to_device(DType::BF16);
  const RmsNormKernel chosen = parse_rmsnorm_kernel(opt.kernel);
  std::printf("model %s: hidden %lld, eps %g, %lld layers (captured:", opt.model_dir.string().c_str(),
              static_cast<long long>(model.config.hidden_size), model.config.rms_norm_eps,
              static_cast<long long>(model.config.num_hidden_layers));
  for (int l : refs.captured_layers()) std::printf(" %d", l);
  std::printf("); %d prompts; device %s%s\n", refs.num_prompts(),
              std::string(device_name(opt.device)).c_str(),
              opt.device == Device::CUDA ? (", kernel " + opt.kernel).c_str() : "");

  std::vector<NormCase> norms;
  std::vector<FusedCase> fused;
  make_cases(refs, model.config, norms, fused);
  Report report("lesson 04 rmsnorm (" + std::string(device_name(opt.device)) + ")");
  run_cases(model, refs, norms, fused, opt.device, chosen, &report);
  if (opt.device == Device::CUDA) {
    // Every other kernel version too: one summary row each.
    for (RmsNormKernel k : all_rmsnorm_kernels()) {
      if (k == chosen) continue;
      CaseRun r = run_cases(model, refs, norms, fused, opt.device, k, nullptr);
      report.add_check(
          "all " + std::to_string(r.checked) + " comparisons [" + std::string(rmsnorm_kernel_name(k)) + "]",
          r.failed == 0, r.first_failure);
    }
  }
  report.print(std::cout);
  if (opt.bench && opt.device == Device::CUDA) run_bench(model, opt);
  return report.exit_code();
}

}  // namespace
}  // namespace tvllm

int main(int argc, char** argv) {
  tvllm::LessonCli cli("lesson04_rmsnorm", "RMSNorm: a shared-memory tree reduction, then warp shuffles");
  cli.kernels({"v1", "v2", "v3"}, std::string(tvllm::rmsnorm_kernel_name(tvllm::kDefaultRmsNormKernel)));
  return cli.run(argc, argv, [](const tvllm::LessonOptions& opt) { return tvllm::run(opt); });
}
