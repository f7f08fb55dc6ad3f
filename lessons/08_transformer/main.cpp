// lesson08_transformer: the whole Llama decoder, from config.json and the weights alone, checked against
// Hugging Face's logits for every reference prompt.
//
//   build/bin/lesson08_transformer [--model DIR] [--device auto|cpu|cuda] [--bench] [--tokens N]
//
//   1. config.json -> the model's shape; the checkpoint checked against it and bound (ModelWeights::bind)
//   2. each prompt alone, one prefill step with logits for every position (teacher forcing)
//        cpu:  logits and final norm vs the reference, elementwise (fp32 vs fp32)
//        cuda: max |logit error| within ε = max(0.2 x rms(logits), 1.5 x Hugging Face's own bf16 error,
//              from the manifest), top-1 agreement at the positions whose margin exceeds 2ε
//   3. all prompts as ONE varlen step: every prompt's logits equal its logits alone
//   4. --bench (cuda): prefill of one --tokens-token prompt (default 1000): tok/s and TFLOP/s beside the
//      measured bf16 GEMM ceiling; (cpu): the reference's speed on a short prompt
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "common/bench.h"
#include "common/errors.h"
#include "common/lesson.h"
#include "common/random.h"
#include "common/validate.h"
#include "logits_check.h"
#include "model_dir.h"
#include "transformer.h"

namespace tvllm {
namespace {

// Host copies of what one prompt produced in a step.
struct PromptOutput {
  Tensor logits;  // F32 [n, vocab]
  Tensor norm;    // F32 [n, hidden]: the final norm's output (HF's model.norm)
};

// Runs `prompts` as ONE prefill step asking for every position's logits; returns each prompt's rows.
std::vector<PromptOutput> run_prompts(ExecContext& ctx, const ModelWeights& w, StepInputs& step,
                                      AttentionBackend& backend,
                                      const std::vector<std::vector<int32_t>>& prompts) {
  step.set_prompts(prompts, /*all_rows=*/true, ctx.stream());
  const TensorView logits = forward(ctx, w, step, backend);
  ctx.synchronize();
  ctx.check_tokens();
  std::vector<PromptOutput> out;
  int64_t row = 0;
  for (const std::vector<int32_t>& p : prompts) {
    const auto n = static_cast<int64_t>(p.size());
    out.push_back({Tensor::copy_of(logits.rows(row, n), Device::CPU, DType::F32),
                   Tensor::copy_of(ctx.workspace().out_normed.view().rows(row, n), Device::CPU, DType::F32)});
    row += n;
  }
  return out;
}

double max_abs(const TensorView& host_f32) {
  double m = 0.0;
  for (int64_t i = 0; i < host_f32.numel(); ++i)
    m = std::max(m, static_cast<double>(std::fabs(host_f32.ptr<const float>()[i])));
  return m;
}

std::string fmt(const char* format, double value) {
  char text[64];
  std::snprintf(text, sizeof text, format, value);
  return text;
}

void print_model(const ModelDir& model, const ModelWeights& w, const Workspace& ws) {
  const ModelConfig& c = model.config;
  std::printf(
      "model %s: %lld layers, hidden %lld, intermediate %lld, %lld heads / %lld KV heads of head_dim %lld,\n",
      model.path.string().c_str(), (long long)c.num_hidden_layers, (long long)c.hidden_size,
      (long long)c.intermediate_size, (long long)c.num_attention_heads, (long long)c.num_key_value_heads,
      (long long)c.head_dim);
  std::string eos;
  for (int64_t id : c.eos_token_ids) eos += (eos.empty() ? "" : " ") + std::to_string(id);
  std::printf("  vocab %lld (lm_head %s), rms_norm_eps %g, rope_theta %g (%s), bos %lld, eos {%s}\n",
              (long long)c.vocab_size, w.tied ? "tied to embed_tokens" : "its own matrix", c.rms_norm_eps,
              c.rope_theta, c.rope_scaling.rope_type.c_str(), (long long)c.bos_token_id, eos.c_str());
  if (w.device == Device::CUDA)
    std::printf("  weights: one %.1f MiB bf16 allocation (q|k|v and gate|up packed); activations %.1f MiB\n",
                static_cast<double>(w.device_bytes) / (1 << 20),
                static_cast<double>(ws.activation_bytes()) / (1 << 20));
  else
    std::printf("  weights: read in place from the mapped files (%s); activations %.1f MiB (fp32)\n",
                std::string(dtype_name(w.embed.dtype)).c_str(),
                static_cast<double>(ws.activation_bytes()) / (1 << 20));
}

// ---- --bench -----------------------------------------------------------------------------------------

void bench_cuda(const ModelDir& model, const ModelWeights& w, int64_t tokens) {
  const ModelConfig& c = model.config;
  tokens = std::min(tokens, c.max_position_embeddings);
  EngineLimits limits;
  limits.max_tokens = tokens;
  limits.max_sequences = 1;
  limits.max_logits_rows = 1;
  limits.max_context = tokens;
  ExecContext ctx(c, limits, Device::CUDA);
  StepInputs step(c, limits, Device::CUDA);
  PrefillAttention attn(c, limits, Device::CUDA);
  Rng rng(8);
  std::vector<int32_t> prompt(static_cast<size_t>(tokens));
  for (int32_t& id : prompt) id = static_cast<int32_t>(rng.below(c.vocab_size));
  step.set_prompts({prompt}, /*all_rows=*/false, ctx.stream());  // prefill: logits of the last token only

  const Ceilings ceilings = measure_ceilings(true);
  cudaEvent_t start, stop;
  TVLLM_CUDA_CHECK(cudaEventCreate(&start));
  TVLLM_CUDA_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < 3; ++i) forward(ctx, w, step, attn);  // warm-up: module loads, cuBLAS heuristics
  std::vector<float> ms;
  for (int i = 0; i < 10; ++i) {
    TVLLM_CUDA_CHECK(cudaEventRecord(start, ctx.stream()));
    forward(ctx, w, step, attn);
    TVLLM_CUDA_CHECK(cudaEventRecord(stop, ctx.stream()));
    TVLLM_CUDA_CHECK(cudaEventSynchronize(stop));
    float t = 0;
    TVLLM_CUDA_CHECK(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  ctx.check_tokens();
  std::sort(ms.begin(), ms.end());
  const double median = ms[ms.size() / 2];
  const double flops = forward_flops(c, {tokens}, {tokens}, 1);
  const double tflops = flops / (median * 1e-3) / 1e12;
  std::printf(
      "\nbench: prefill of one %lld-token prompt (random ids), logits of the last token, bf16 on the GPU\n",
      (long long)tokens);
  std::printf("  median %.3f ms (min %.3f, max %.3f over %zu runs; weights not flushed from L2)\n", median,
              ms.front(), ms.back(), ms.size());
  std::printf(
      "  %.0f tok/s, %.1f GFLOP per step, %.1f TFLOP/s = %.1f%% of the measured bf16 GEMM ceiling (%.1f "
      "TFLOP/s)\n",
      static_cast<double>(tokens) / (median * 1e-3), flops / 1e9, tflops,
      ceilings.bf16_tflops > 0 ? 100.0 * tflops / ceilings.bf16_tflops : 0.0, ceilings.bf16_tflops);
}

void bench_reference(const ModelDir& model, const ModelWeights& w) {
  const ModelConfig& c = model.config;
  const int64_t tokens = std::min<int64_t>(128, c.max_position_embeddings);
  EngineLimits limits{tokens, 1, 1, tokens};
  ExecContext ctx(c, limits, Device::CPU);
  StepInputs step(c, limits, Device::CPU);
  PrefillAttention attn(c, limits, Device::CPU);
  std::vector<int32_t> prompt(static_cast<size_t>(tokens));
  Rng rng(8);
  for (int32_t& id : prompt) id = static_cast<int32_t>(rng.below(c.vocab_size));
  step.set_prompts({prompt}, false);
  const BenchResult r = tvllm::bench_cpu([&] { forward(ctx, w, step, attn); }, 1, 3);
  const double flops = forward_flops(c, {tokens}, {tokens}, 1);
  std::printf("\nbench: CPU reference prefill of %lld tokens: %.1f ms, %.0f tok/s, %.2f GFLOP/s\n",
              (long long)tokens, r.median_ms, static_cast<double>(tokens) / (r.median_ms * 1e-3),
              flops / (r.median_ms * 1e-3) / 1e9);
}

// ---- the checks ------------------------------------------------------------------------------------

int run(const LessonOptions& opt) {
  const ModelDir model = ModelDir::open(opt.model_dir);
  const ReferenceSet ref = ReferenceSet::open(opt.model_dir);
  const ModelConfig& c = model.config;
  const ModelWeights w = ModelWeights::bind(model, opt.device);

  std::vector<std::vector<int32_t>> prompts;
  int64_t total = 0, longest = 0;
  for (int i = 0; i < ref.num_prompts(); ++i) {
    prompts.push_back(ref.prompt_ids(i));
    total += static_cast<int64_t>(prompts.back().size());
    longest = std::max<int64_t>(longest, static_cast<int64_t>(prompts.back().size()));
  }
  // One engine sized for the whole batch of prompts, every position's logits.
  EngineLimits limits;
  limits.max_tokens = total;
  limits.max_sequences = static_cast<int64_t>(prompts.size());
  limits.max_logits_rows = total;
  limits.max_context = std::min(c.max_position_embeddings, std::max<int64_t>(longest, 1));
  ExecContext ctx(c, limits, opt.device);
  StepInputs step(c, limits, opt.device);
  PrefillAttention attn(c, limits, opt.device, AttentionKernel::V2Flash, ctx.cublas());
  print_model(model, w, ctx.workspace());

  const bool gpu = opt.device == Device::CUDA;
  // Hugging Face's own bf16 error per prompt: the noise floor the GPU bound scales with (logits_check.h).
  const std::map<std::string, Bf16Floor> floors = read_bf16_floors(opt.model_dir);
  if (gpu && floors.empty()) std::printf("%s\n", kNoBf16FloorNotice);
  Report report(std::string("lesson 08: the decoder -> ") + std::string(device_name(opt.device)) +
                (gpu ? " (bf16; eps = max(" + fmt("%.2f", kGpuLogitErrorPerRms) + " x rms(logits), " +
                           fmt("%.1f", kBf16FloorFactor) + " x HF bf16 error); top-1 at margins > 2 eps)"
                     : " (fp32 reference)"));
  // A check that is not an elementwise comparison: its numbers printed now, its verdict in the table.
  auto check = [&](const std::string& name, bool pass, const std::string& detail) {
    std::printf("  %-26s %s  %s\n", name.c_str(), pass ? "PASS" : "FAIL", detail.c_str());
    report.add_check(name, pass, detail);
  };
  std::vector<PromptOutput> alone;
  std::vector<GpuLogitBound> bounds;  // per prompt, on the GPU
  for (size_t i = 0; i < prompts.size(); ++i) {
    alone.push_back(std::move(run_prompts(ctx, w, step, attn, {prompts[i]}).front()));
    const std::string p = "p" + std::to_string(i);
    const TensorView want_logits = ref.prompt(static_cast<int>(i), "logits");
    const TensorView want_norm = ref.prompt(static_cast<int>(i), "norm");
    const Tensor want = Tensor::copy_of(want_logits, Device::CPU, DType::F32);
    const double rms_logits = rms(want);
    const Tensor norm = Tensor::copy_of(want_norm, Device::CPU, DType::F32);
    if (!gpu) {
      const double cpu_error = kCpuLogitsAtolPerMax * max_abs(want);
      report.add(compare(p + ".logits", alone.back().logits, want, {cpu_error, 0.0}));
      report.add(compare(p + ".norm", alone.back().norm, norm, {kCpuNormAtolPerMax * max_abs(norm), 0.0}));
      // Teacher-forced: the CPU's argmax at every position whose margin exceeds twice the logits' tolerance.
      const Top1Agreement a = top1_agreement(alone.back().logits, want, 2 * cpu_error);
      check(p + " top-1 (teacher-forced)", a.pass(), a.summary());
    } else {
      const Bf16Floor* floor = find_floor(floors, p);
      bounds.push_back(gpu_logit_bound(rms_logits, floor));
      const GpuLogitBound& eps = bounds.back();
      const Top1Agreement a = top1_agreement(alone.back().logits, want, eps.clear_margin());
      // A random-weight model may have few clear-margin positions or none: then the bound below is the check.
      std::string hf_top1;
      if (floor != nullptr) hf_top1 = "; HF bf16 all agree " + std::to_string(floor->top1_agree) + "/" +
                                      std::to_string(floor->rows);
      check(p + " top-1 at clear margins", a.pass(),
            a.summary() + hf_top1 + (a.clear == 0 ? " (no clear-margin position)" : ""));
      // Ours beside Hugging Face's own bf16 run: both vs the same fp32 reference.
      std::string detail = "ours " + fmt("%.4g", a.max_abs_error) + " (" + fmt("%.3f", a.max_abs_error / rms_logits) +
                           " x rms)";
      if (floor != nullptr)
        detail += ", HF bf16 " + fmt("%.4g", floor->logits_max_abs_error) + " (" +
                  fmt("%.3f", floor->logits_max_abs_error / rms_logits) + " x rms)";
      check(p + " max |logit error|", a.max_abs_error <= eps.epsilon, detail + " <= " + eps.describe());
      double norm_tol = kGpuNormAtolPerMax * max_abs(norm);
      if (floor != nullptr && floor->norm_max_abs_error >= 0)
        norm_tol = std::max(norm_tol, kBf16FloorFactor * floor->norm_max_abs_error);
      report.add(compare(p + ".norm", alone.back().norm, norm, {norm_tol, 0.0}));
    }
  }

  // All prompts in ONE step: each sequence attends only to itself, every op is row-wise, so every prompt's
  // logits must be its logits alone. CPU: bit for bit (the reference's sums do not depend on the batch).
  // GPU: cuBLAS may pick another algorithm for another number of rows (another summation order), so
  // within the bf16 bound, and the same argmax wherever the margin is clear.
  const std::vector<PromptOutput> batch = run_prompts(ctx, w, step, attn, prompts);
  for (size_t i = 0; i < prompts.size(); ++i) {
    const std::string name = "batch == alone p" + std::to_string(i);
    if (!gpu) {
      report.add(compare(name, batch[i].logits, alone[i].logits, Tolerance{0.0, 0.0}));
    } else {
      // The prompt's own bound (each run is within it of the exact logits; they differ far less in practice).
      const GpuLogitBound& eps = bounds[i];
      const Top1Agreement a = top1_agreement(batch[i].logits, alone[i].logits, eps.clear_margin());
      check(name, a.pass() && a.max_abs_error <= eps.epsilon, a.summary() + " <= " + fmt("%.4g", eps.epsilon));
    }
  }
  report.print(std::cout);

  if (opt.bench) {
    if (gpu)
      bench_cuda(model, w, opt.bench_tokens_given ? opt.bench_tokens : 1000);
    else
      bench_reference(model, w);
  }
  return report.exit_code();
}

}  // namespace
}  // namespace tvllm

int main(int argc, char** argv) {
  tvllm::LessonCli cli("lesson08_transformer",
                       "the Llama decoder: every layer, the final norm and the logits");
  return cli.run(argc, argv, tvllm::run);
}
