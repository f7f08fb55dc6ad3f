// lesson10_kv_cache: the model generates. Greedy continuations with a KV cache, checked against Hugging Face's
// model.generate for every reference sequence.
//
//   build/bin/lesson10_kv_cache [--model DIR] [--device auto|cpu|cuda] [--bench]
//
//   1. the model, its weights bound (lesson 08) and a Generator: a KV cache with one slot per reference
//      sequence, sized for the longest prompt + max_new_tokens
//   2. per reference sequence:
//        greedy           generate until EOS or max_new_tokens; the ids vs Hugging Face's
//                         (cpu: equal; cuda: equal where the sequence's smallest reference margin is clear)
//        teacher-forced   the reference's ids fed one decode step at a time: our argmax at each step must be
//                         the reference's id, or a near-tie of the reference (README "What correct means")
//        cache==recompute the same logits from ONE prefill over prompt + ids (lesson 08's PrefillAttention,
//                         no cache): the real test of the cache
//   3. every sequence in ONE batch (a slot each, different lengths) == each alone
//   4. --bench (cuda): time per token without a cache (the whole prefix again) vs with it at several lengths;
//      decode tok/s at batch 1 at ~128 and ~4096 context with GB/s as % of the measured copy bandwidth, eager
//      and as a CUDA graph; prefill tok/s of a 1000-token prompt. (cpu): the first table on the bundled model.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "cached_attention.h"
#include "common/bench.h"
#include "common/cuda_stream.h"
#include "common/errors.h"
#include "common/lesson.h"
#include "common/random.h"
#include "common/validate.h"
#include "generate.h"
#include "generate_check.h"
#include "logits_check.h"
#include "model_dir.h"
#include "transformer.h"

namespace tvllm {
namespace {

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

// Bytes one decode step reads from the weights: every matrix and norm once, but only ONE row of the embedding
// (unless it is also the lm_head, which reads all of it).
double weight_bytes_per_token(const ModelWeights& w) {
  double bytes = static_cast<double>(w.device_bytes);
  if (!w.tied) bytes -= static_cast<double>(w.embed.nbytes()) - static_cast<double>(w.embed.shape[1]) * 2.0;
  return bytes;
}

std::vector<int32_t> random_ids(int64_t n, int64_t vocab, uint64_t seed) {
  Rng rng(seed);
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int32_t& id : ids) id = static_cast<int32_t>(rng.below(vocab));
  return ids;
}

// ---- --bench -------------------------------------------------------------------------------------------

// Median milliseconds of fn() queued on `stream`, timed with events (warm-up first).
double time_gpu_ms(cudaStream_t stream, const std::function<void()>& fn, int iters = 10) {
  cudaEvent_t start, stop;
  TVLLM_CUDA_CHECK(cudaEventCreate(&start));
  TVLLM_CUDA_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < 2; ++i) fn();
  std::vector<float> ms;
  for (int i = 0; i < iters; ++i) {
    TVLLM_CUDA_CHECK(cudaEventRecord(start, stream));
    fn();
    TVLLM_CUDA_CHECK(cudaEventRecord(stop, stream));
    TVLLM_CUDA_CHECK(cudaEventSynchronize(stop));
    float t = 0;
    TVLLM_CUDA_CHECK(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// Fills slot 0 of the cache with `context - 1` random tokens, then sets up ONE decode step at position
// context - 1 (k_len = context). Running forward_step() again rewrites that position: the same step each time.
void set_decode_at(Generator& gen, int64_t context, uint64_t seed) {
  const int64_t V = gen.weights().config.vocab_size;
  const std::vector<int32_t> prompt = random_ids(context - 1, V, seed);
  for (int64_t done = 0; done < context - 1; done += gen.limits().max_tokens) {
    const int64_t n = std::min(gen.limits().max_tokens, context - 1 - done);
    gen.set_step(std::vector<int32_t>(prompt.begin() + done, prompt.begin() + done + n), {n}, {done + n}, {}, {0});
    gen.forward_step();
  }
  gen.set_step({static_cast<int32_t>(seed % V)}, {1}, {context}, {0}, {0});
}

void bench_cuda(const ModelDir& model, const ModelWeights& w) {
  const ModelConfig& c = model.config;
  const int64_t long_context = std::min<int64_t>(4096, c.max_position_embeddings - 1);
  Generator gen(w, Generator::limits_for(c, long_context + 1, 1, long_context));
  ExecContext& ctx = gen.context();
  const cudaStream_t stream = ctx.stream();
  PrefillAttention no_cache(c, gen.limits(), Device::CUDA, AttentionKernel::V2Flash, ctx.cublas());
  const Ceilings ceilings = measure_ceilings(false);
  std::printf("\nbench: %s\n", gen.cache().describe().c_str());

  // (a) One new token at context n: without a cache the whole prefix runs again (prefill of n tokens, logits of
  //     the last); with one, a single decode step reads the n cached positions.
  std::printf("\n(a) time per generated token at context n: recompute the prefix (no cache) vs one decode step\n");
  std::printf("  %8s  %16s  %16s  %8s\n", "n", "no cache ms", "KV cache ms", "ratio");
  for (int64_t n : {128, 512, 1024, 2048, 4096}) {
    if (n > long_context) break;
    gen.step().set_prompts({random_ids(n, c.vocab_size, 10 + n)}, /*all_rows=*/false, stream);
    const double full = time_gpu_ms(stream, [&] { forward(ctx, w, gen.step(), no_cache); }, 5);
    set_decode_at(gen, n, 20 + n);
    const double step = time_gpu_ms(stream, [&] { gen.forward_step(); });
    std::printf("  %8lld  %16.3f  %16.3f  %7.1fx\n", (long long)n, full, step, full / step);
  }

  // (b) Decode at batch 1: tok/s, and the bytes a step must read (weights + the cached k, v) per second.
  std::printf("\n(b) decode, batch 1, greedy (forward + lesson 09 sampler); bytes = weights read + KV cache read\n");
  std::printf("  %8s  %7s  %10s  %9s  %10s  %9s\n", "context", "mode", "ms/token", "tok/s", "GB/s", "% copy bw");
  const double wbytes = weight_bytes_per_token(w);
  for (int64_t n : {int64_t{128}, long_context}) {
    set_decode_at(gen, n, 30 + n);
    const double bytes = wbytes + static_cast<double>(gen.cache().bytes_per_token()) * static_cast<double>(n);
    const auto row = [&](const char* mode, double ms) {
      const double gbs = bytes / (ms * 1e-3) / 1e9;
      std::printf("  %8lld  %7s  %10.3f  %9.1f  %10.1f  %8.1f%%\n", (long long)n, mode, ms, 1e3 / ms, gbs,
                  100.0 * gbs / ceilings.copy_gbs);
    };
    row("eager", time_gpu_ms(stream, [&] { gen.sample_async(gen.forward_step(), 0); }, 20));
    // The same step as ONE graph launch (lesson 14's topic): what the GPU needs without the host's launch cost.
    const CudaGraph graph = CudaGraph::capture(stream, [&] { gen.sample_async(gen.forward_step(), 0); });
    row("graph", time_gpu_ms(stream, [&] { graph.launch(stream); }, 20));
  }
  std::printf("  (weights %.1f MiB per token; KV %.1f KiB per token of context; copy bandwidth %.0f GB/s measured)\n",
              wbytes / (1 << 20), static_cast<double>(gen.cache().bytes_per_token()) / 1024, ceilings.copy_gbs);

  // (c) Prefill of a 1000-token prompt through the cache (flash over the cache), logits of the last token.
  const int64_t P = std::min<int64_t>(1000, long_context);
  gen.set_step(random_ids(P, c.vocab_size, 40), {P}, {P}, {static_cast<int32_t>(P - 1)}, {0});
  const double ms = time_gpu_ms(stream, [&] { gen.forward_step(); });
  std::printf("\n(c) prefill of a %lld-token prompt: %.3f ms, %.0f tok/s (%.1f TFLOP/s)\n", (long long)P, ms,
              static_cast<double>(P) / (ms * 1e-3), forward_flops(c, {P}, {P}, 1) / (ms * 1e-3) / 1e12);
  ctx.check_tokens();
}

void bench_cpu_reference(const ModelDir& model, const ModelWeights& w) {
  const ModelConfig& c = model.config;
  const int64_t longest = std::min<int64_t>(512, c.max_position_embeddings - 1);
  Generator gen(w, Generator::limits_for(c, longest + 1, 1, longest));
  PrefillAttention no_cache(c, gen.limits(), Device::CPU);
  std::printf("\nbench (CPU reference, fp32): time per generated token at context n\n");
  std::printf("  %8s  %16s  %16s  %8s\n", "n", "no cache ms", "KV cache ms", "ratio");
  for (int64_t n : {32, 64, 128, 256, 512}) {
    if (n > longest) break;
    gen.step().set_prompts({random_ids(n, c.vocab_size, 10 + n)}, false);
    const BenchResult full = bench_cpu([&] { forward(gen.context(), w, gen.step(), no_cache); }, 1, 3);
    set_decode_at(gen, n, 20 + n);
    const BenchResult step = bench_cpu([&] { gen.forward_step(); }, 1, 5);
    std::printf("  %8lld  %16.3f  %16.3f  %7.1fx\n", (long long)n, full.median_ms, step.median_ms,
                full.median_ms / step.median_ms);
  }
}

// ---- the checks ------------------------------------------------------------------------------------

int run(const LessonOptions& opt) {
  const ModelDir model = ModelDir::open(opt.model_dir);
  const ReferenceSet ref = ReferenceSet::open(opt.model_dir);
  const ReferenceGenerations gens = read_reference_generations(opt.model_dir);
  const ModelConfig& c = model.config;
  const ModelWeights w = ModelWeights::bind(model, opt.device);
  const bool gpu = opt.device == Device::CUDA;

  // One slot per reference sequence; room for the longest prompt + max_new_tokens.
  int64_t longest = 0, prompt_tokens = 0;
  for (const ReferenceGeneration& g : gens.sequences) {
    longest = std::max<int64_t>(longest, static_cast<int64_t>(g.prompt_ids.size()) + gens.max_new_tokens);
    prompt_tokens += static_cast<int64_t>(g.prompt_ids.size());
  }
  const int64_t max_context = std::min(c.max_position_embeddings, longest);
  const auto B = static_cast<int64_t>(gens.sequences.size());
  // Prefill steps big enough for every prompt at once: the batch run prefills them in one varlen step.
  Generator gen(w, Generator::limits_for(c, max_context, B, std::max(prompt_tokens, max_context)));
  // The recompute: lesson 08's prefill over prompt + ids, no cache, every row's logits.
  const EngineLimits recompute_limits{longest, 1, longest, max_context};
  ExecContext rctx(c, recompute_limits, opt.device);
  StepInputs rstep(c, recompute_limits, opt.device);
  PrefillAttention no_cache(c, recompute_limits, opt.device, AttentionKernel::V2Flash, rctx.cublas());
  std::printf("model %s: %lld layers, %lld heads / %lld KV heads of head_dim %lld, vocab %lld\n",
              model.path.string().c_str(), (long long)c.num_hidden_layers, (long long)c.num_attention_heads,
              (long long)c.num_key_value_heads, (long long)c.head_dim, (long long)c.vocab_size);
  std::printf("%s\n", gen.cache().describe().c_str());
  std::printf("reference: %lld greedy sequences of up to %lld new tokens, eos {", (long long)B,
              (long long)gens.max_new_tokens);
  for (size_t i = 0; i < gens.eos_ids.size(); ++i) std::printf("%s%lld", i ? " " : "", (long long)gens.eos_ids[i]);
  std::printf("}\n");

  // Hugging Face's own bf16 error per sequence (over its teacher-forced rows): lesson 08's noise floor.
  const std::map<std::string, Bf16Floor> floors = read_bf16_floors(opt.model_dir);
  if (gpu && floors.empty()) std::printf("%s\n", kNoBf16FloorNotice);
  Report report(std::string("lesson 10: generation with a KV cache -> ") + std::string(device_name(opt.device)) +
                (gpu ? " (bf16; eps = max(" + fmt("%.2f", kGpuLogitErrorPerRms) + " x rms(logits), " +
                           fmt("%.1f", kBf16FloorFactor) + " x HF bf16 error); near-ties within 2 eps)"
                     : " (fp32 reference: greedy must equal Hugging Face exactly)"));
  GenerateOptions options;
  options.max_new_tokens = gens.max_new_tokens;
  options.eos_ids = gens.eos_ids;
  std::vector<GenerateResult> alone;
  std::vector<bool> clear;  // whether the sequence's every greedy step has a clear reference margin
  for (const ReferenceGeneration& g : gens.sequences) {
    const Tensor prompt_logits = Tensor::copy_of(ref.get(g.prompt + ".logits"), Device::CPU, DType::F32);
    // How far our logits may be from the reference's (lesson 08's bounds): cpu fp32; cuda bf16, the larger of
    // 0.2 x rms(logits) and 1.5 x Hugging Face's own bf16 error on this sequence's rows.
    const GpuLogitBound bound = gpu_logit_bound(rms(prompt_logits), find_floor(floors, g.name));
    const double error = gpu ? bound.epsilon : kCpuLogitsAtolPerMax * max_abs(prompt_logits);
    clear.push_back(!gpu || g.min_top1_margin > 2 * error);
    if (gpu) {
      const Bf16Floor* floor = find_floor(floors, g.name);
      std::printf("%s eps %s%s\n", g.name.c_str(), bound.describe().c_str(),
                  floor ? (": HF bf16 top-1 agrees with fp32 at " + std::to_string(floor->top1_agree) + "/" +
                           std::to_string(floor->rows) + " steps").c_str()
                        : "");
    }

    // 1. Greedy, free-running.
    alone.push_back(gen.generate(g.prompt_ids, options));
    const GenerateResult& r = alone.back();
    const int64_t diff = first_difference(r.ids, g.output_ids);
    std::string detail = std::to_string(r.ids.size()) + " ids, stop " + std::string(stop_reason_name(r.stop));
    if (diff < 0) {
      detail += ", equal";
    } else {
      detail += ", first difference at step " + std::to_string(diff) + " (ours " +
                ids_text({r.ids.begin() + diff, r.ids.end()}, 4) + ", reference " +
                ids_text({g.output_ids.begin() + std::min<int64_t>(diff, g.output_ids.size()), g.output_ids.end()}, 4) + ")";
    }
    if (!clear.back()) detail += "; min margin " + fmt("%.3f", g.min_top1_margin) + " < " + fmt("%.3f", 2 * error) +
                                 ": a near-tie may flip, not required";
    report.add_check(g.name + " greedy == HF generate", diff < 0 || !clear.back(), detail);
    std::printf("%s greedy: %s\n  ours %s\n", g.name.c_str(), detail.c_str(), ids_text(r.ids, 24).c_str());

    // 2. Teacher-forced through the cache: the reference's ids fed one decode step at a time.
    const Tensor forced = gen.forced_logits(g.prompt_ids, g.output_ids);
    const ForcedAgreement a = forced_agreement(forced, g.output_ids, error);
    report.add_check(g.name + " teacher-forced top-1", a.pass(), a.summary());
    std::printf("%s teacher-forced through the cache: %s\n", g.name.c_str(), a.summary().c_str());

    // 3. The same logits without a cache: one prefill over prompt + ids[:-1], every row.
    std::vector<int32_t> tokens = g.prompt_ids;
    tokens.insert(tokens.end(), g.output_ids.begin(), g.output_ids.end() - 1);
    rstep.set_prompts({tokens}, /*all_rows=*/true, rctx.stream());
    const TensorView all = forward(rctx, w, rstep, no_cache);
    rctx.synchronize();
    const auto P = static_cast<int64_t>(g.prompt_ids.size()), N = static_cast<int64_t>(g.output_ids.size());
    const Tensor recomputed = Tensor::copy_of(all.rows(P - 1, N), Device::CPU, DType::F32);
    if (!gpu) {
      report.add(compare(g.name + " cache == recompute", forced, recomputed, Tolerance{error, 0.0}));
    } else {
      // Both are bf16 runs, each within `error` of the exact logits: within 2 x error of each other, and the
      // same argmax wherever the margin exceeds that.
      const Top1Agreement t = top1_agreement(forced, recomputed, 2 * error);
      report.add_check(g.name + " cache == recompute", t.pass() && t.max_abs_error <= 2 * error,
                       t.summary() + " (bound " + fmt("%.4f", 2 * error) + ")");
      std::printf("%s cache vs recompute: %s (bound %.4f)\n", g.name.c_str(), t.summary().c_str(), 2 * error);
    }
  }

  // 4. Every sequence in one batch, a slot each: each must come out as it did alone.
  std::vector<std::vector<int32_t>> prompts;
  for (const ReferenceGeneration& g : gens.sequences) prompts.push_back(g.prompt_ids);
  const std::vector<GenerateResult> batch = gen.generate(prompts, options);
  for (size_t i = 0; i < batch.size(); ++i) {
    const int64_t diff = first_difference(batch[i].ids, alone[i].ids);
    report.add_check(gens.sequences[i].name + " batch == alone", diff < 0 || !clear[i],
                     diff < 0 ? "equal (" + std::to_string(batch[i].ids.size()) + " ids, batch of " +
                                    std::to_string(batch.size()) + ")"
                              : "first difference at step " + std::to_string(diff) +
                                    (clear[i] ? "" : " (near-tie margins: not required)"));
  }
  const GenerateResult& last = batch.back();
  std::printf("batch of %zu: prefill %.2f ms, %lld decode steps in %.2f ms\n", batch.size(), last.prefill_ms,
              (long long)last.decode_steps, last.decode_ms);
  report.print(std::cout);

  if (opt.bench) {
    if (gpu) bench_cuda(model, w);
    else bench_cpu_reference(model, w);
  }
  return report.exit_code();
}

}  // namespace
}  // namespace tvllm

int main(int argc, char** argv) {
  tvllm::LessonCli cli("lesson10_kv_cache", "generation with a KV cache: prefill, decode, the generation loop");
  return cli.run(argc, argv, tvllm::run);
}
