// tiny-vllm bench latency --model DIR [--batch-size 1 8 ...] [--context 128 4096] [--output-len 128]
//                         [--prefill-len 512 4096] [--iters 3] [--enforce-eager] [--no-fused] [--no-fast-sampler]
//                         [--no-pdl] [--no-fast-attention] [--megakernel] [--no-hopper] [--compare]
//                         [--device auto|cpu|cuda] [--output table|json] [--fp8-weights auto|resident|dequantize]
//                         [--fp8-gemm auto|scale-vectors|epilogue|dequantize] [--fp8-lm-head]
//
// The latency a user of `tiny-vllm generate` sees (lesson 14, latency_bench.h): decode tok/s at each batch size
// and context, with the bytes a step reads per second beside the measured copy bandwidth (the roofline of
// decode), and prefill tok/s. --compare runs the lesson's progression in one process, so that every row is
// measured on the same GPU in the same minute: lesson 10 as it is, then + CUDA graphs, + the fused GEMV forward,
// + the fast sampler, + programmatic dependent launch, + the fast decode attention (the default fast path), + the
// megakernel (--megakernel: measured, not the default).
// On Hopper each prefill length is measured three times: lessons 10 + 06 (flash over the cache, cuBLAS), + lesson
// 15's attention, + lesson 15's GEMM (--no-hopper: the first only).
#include <cstdio>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "commands.h"
#include "session.h"  // --fp8-weights
#include "common/bench.h"
#include "common/device.h"
#include "common/input_error.h"
#include "latency_bench.h"
#include "model_dir.h"
#include "model_weights.h"
#ifdef TVLLM_CLI_HOPPER
#include "matmul.h"
#include "prefill_hook.h"
#include "transformer.h"  // install_gated_mlp
#endif

namespace tvllm::cli {
namespace {

struct BenchLatencyOptions {
  std::string model, device = "auto", output = "table";
  std::vector<int64_t> batch_sizes{1}, contexts{128, 4096}, prefill_lens{512, 4096};
  int64_t output_len = 128;
  int iters = 3;
  std::string fp8_weights = "auto";  // lesson 16: how an FP8 checkpoint loads
  std::string fp8_gemm = "auto";     // lesson 16: the GEMM of steps of 17+ tokens on resident FP8 weights
  bool fp8_lm_head = false;          // lesson 16: an FP8 copy of the lm_head for the decode GEMV
  std::string kv_cache_dtype = "auto";  // lesson 16: fp8 is the engine's (refused here, with the way out)
  int tensor_parallel_size = 1;          // lesson 17: only 1 runs
  bool enforce_eager = false, no_fused = false, no_fast_sampler = false, no_pdl = false, no_fast_attention = false,
       megakernel = false, no_hopper = false, compare = false;
};

// Which prefill kernels a prefill row runs with (lesson 15's, on Hopper).
struct PrefillKernels {
  const char* name;
  bool attention;  // lesson 15's attention through the fresh-prefill seam (AttentionBackend::set_fast_prefill)
  bool gemm;       // lesson 15's GEMM v2 through lesson 06's large-GEMM seam
  bool mlp;        // lesson 15's gated MLP in one kernel through lesson 08's seam (what the product runs)
};

void use_hopper_gemm(bool on) {
#ifdef TVLLM_CLI_HOPPER
  if (on) {
    install_hopper_large_gemm();
  } else {
    install_large_gemm(nullptr, 1);
  }
#else
  (void)on;
#endif
}

void use_hopper_mlp(bool on) {
#ifdef TVLLM_CLI_HOPPER
  if (on) {
    install_hopper_gated_mlp();
  } else {
    install_gated_mlp(nullptr, 1);
  }
#else
  (void)on;
#endif
}

std::vector<LatencyVariant> variants(const BenchLatencyOptions& o, Device device, const ModelConfig& config) {
  FastPathOptions chosen;
  chosen.graphs = !o.enforce_eager;
  chosen.fused = !o.no_fused;
  chosen.fast_sampler = !o.no_fast_sampler;
  chosen.pdl = !o.no_pdl;
  chosen.fast_attention = !o.no_fast_attention;
  chosen.megakernel = o.megakernel;
  if (!o.compare || device != Device::CUDA) return {{describe_fast_path(chosen, device, &config), chosen}};
  return progression_variants();
}

void run(const BenchLatencyOptions& o) {
  require_generator_kv_cache_dtype(o.kv_cache_dtype, "bench latency");
  require_tensor_parallel_size(o.tensor_parallel_size, "bench latency");
  TVLLM_REQUIRE(o.output == "table" || o.output == "json", "--output must be table or json, got " + o.output);
  const Device device = resolve_device(o.device);
  TVLLM_REQUIRE(device == Device::CPU || cuda_available(), "--device cuda, but no CUDA GPU is available");
  const ModelDir model =
      ModelDir::open(o.model, resolve_fp8_weights(o.fp8_weights, o.model, device, !o.no_fused, false, o.fp8_gemm));
  const ModelConfig& c = model.config;
  const std::string fp8_note = describe_fp8_load(c, model.fp8_resident ? Fp8Load::Resident : Fp8Load::Dequantize) +
                               describe_fp8_lm_head(o.fp8_lm_head);
  require_fp8_lm_head(o.fp8_lm_head, model.fp8_resident ? Fp8Load::Resident : Fp8Load::Dequantize);
  for (int64_t ctx : o.contexts)
    TVLLM_REQUIRE(ctx + o.output_len <= c.max_position_embeddings,
                  "--context " + std::to_string(ctx) + " + --output-len " + std::to_string(o.output_len) +
                      " exceeds the model's max_position_embeddings " + std::to_string(c.max_position_embeddings));
  for (int64_t p : o.prefill_lens)
    TVLLM_REQUIRE(p + 1 <= c.max_position_embeddings,
                  "--prefill-len " + std::to_string(p) + " exceeds the model's max_position_embeddings");
  ModelWeights weights = ModelWeights::bind(model, device);
  attach_fp8_lm_head_if(o.fp8_lm_head, weights);  // the bytes per step then count its codes and scales
  const double copy_gbs = device == Device::CUDA ? measure_ceilings(false).copy_gbs : 0.0;

  nlohmann::json out;
  out["model"] = o.model;
  out["device"] = std::string(device_name(device));
  out["copy_gbs"] = copy_gbs;
  out["weight_bytes"] = decode_bytes_per_step(weights, 1, 0.0);
  out["fp8_weights"] = !c.quantization ? "none" : model.fp8_resident ? "resident" : "dequantize";
  out["fp8_lm_head"] = o.fp8_lm_head;
  out["runs"] = nlohmann::json::array();
  if (o.output == "table") {
    std::printf("tiny-vllm bench latency: %s on %s%s%s; %d timed runs per row (median), %lld new tokens per decode "
                "run\n",
                o.model.c_str(), std::string(device_name(device)).c_str(), fp8_note.empty() ? "" : ", ",
                fp8_note.c_str(), o.iters, (long long)o.output_len);
    if (copy_gbs > 0)
      std::printf("ceiling: copy bandwidth %.0f GB/s measured; weights %.1f MiB read per step -> batch 1 at most "
                  "%.0f tok/s\n",
                  copy_gbs, decode_bytes_per_step(weights, 1, 0.0) / (1 << 20),
                  copy_gbs * 1e9 / decode_bytes_per_step(weights, 1, 0.0));
  }
  std::vector<PrefillKernels> prefill_kernels{{"lessons 10 + 06", false, false, false}};
#ifdef TVLLM_CLI_HOPPER
  if (device == Device::CUDA && !o.no_hopper && install_hopper_prefill_attention()) {
    prefill_kernels.push_back({"lesson 15 attention", true, false, false});
    prefill_kernels.push_back({"lesson 15 attention+MLP", true, false, true});  // the product's prefill
    prefill_kernels.push_back({"lesson 15 attn+MLP+GEMM", true, true, true});
  }
#endif
  for (const LatencyVariant& v : variants(o, device, c)) {
    nlohmann::json run;
    run["variant"] = v.name;
    run["decode"] = nlohmann::json::array();
    run["prefill"] = nlohmann::json::array();
    if (o.output == "table") {
      std::printf("\n%s\n  %6s %8s %10s %10s %10s %9s %7s\n", v.name.c_str(), "batch", "context", "ms/step",
                  "tok/s", "GB/s", "% copy", "graphs");
    }
    for (int64_t b : o.batch_sizes)
      for (int64_t ctx : o.contexts) {
        const DecodeLatency d = measure_decode_latency(weights, v.fast, b, ctx, o.output_len, o.iters, copy_gbs);
        run["decode"].push_back({{"batch", d.batch}, {"context", d.context}, {"output_len", d.output_len},
                                 {"ms_per_step", d.ms_per_step}, {"tok_s", d.tok_s}, {"gbs", d.gbs},
                                 {"pct_copy", d.pct_copy}, {"graphs", d.graphs}});
        if (o.output == "table")
          std::printf("  %6lld %8lld %10.3f %10.1f %10.1f %8.1f%% %7lld\n", (long long)d.batch, (long long)d.context,
                      d.ms_per_step, d.tok_s, d.gbs, d.pct_copy, (long long)d.graphs);
      }
    // Prefill rows: lessons 10 and 06 (flash over the cache, cuBLAS), and on Hopper + lesson 15's attention over
    // the step's rows, + its gated MLP in one kernel from kHopperGatedMlpMinTokens rows (the product's default),
    // + its GEMM for the other projections from kHopperGemmMinTokens rows: all in this process, so they compare.
    for (int64_t p : o.prefill_lens)
      for (const PrefillKernels& k : prefill_kernels) {
        use_hopper_gemm(k.gemm);
        use_hopper_mlp(k.mlp);
        const PrefillLatency r = measure_prefill_latency(weights, v.fast, p, o.iters, k.attention);
        use_hopper_gemm(false);
        use_hopper_mlp(false);
        run["prefill"].push_back({{"tokens", r.tokens}, {"kernels", k.name}, {"ms", r.ms}, {"tok_s", r.tok_s},
                                  {"tflops", r.tflops}});
        if (o.output == "table")
          std::printf("  prefill %6lld tokens, %-24s %9.3f ms  %10.0f tok/s  %7.1f TFLOP/s\n", (long long)r.tokens,
                      (std::string(k.name) + ":").c_str(), r.ms, r.tok_s, r.tflops);
      }
    out["runs"].push_back(run);
  }
  out["fp8_gemm"] = fp8_gemm_report();  // which product the steps of 17+ tokens ran (lesson 16)
  if (o.output == "json") std::cout << out.dump() << "\n";
}

}  // namespace

void add_bench_latency_command(CLI::App& bench) {
  auto opt = std::make_shared<BenchLatencyOptions>();
  CLI::App* cmd = bench.add_subcommand(
      "latency", "decode tok/s per batch size and context against the memory roofline; prefill tok/s");
  cmd->add_option("--model", opt->model, "model directory (config.json + safetensors)")->required();
  cmd->add_option("--batch-size", opt->batch_sizes, "decode batch sizes (default 1)")->check(CLI::Range(1, 1024));
  cmd->add_option("--context", opt->contexts, "prompt lengths the decode starts from (default 128 4096)")
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--output-len", opt->output_len, "new tokens per decode run (default 128)")
      ->check(CLI::Range(2, 1 << 20));
  cmd->add_option("--prefill-len", opt->prefill_lens, "prompt lengths of the prefill rows (default 512 4096)")
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--iters", opt->iters, "timed runs per row, after one warm-up (default 3)")->check(CLI::Range(1, 1000));
  cmd->add_flag("--enforce-eager", opt->enforce_eager, "no CUDA graphs (vLLM's flag)");
  cmd->add_flag("--no-fused", opt->no_fused, "lesson 08's composed forward instead of the fused GEMV decode");
  cmd->add_flag("--no-fast-sampler", opt->no_fast_sampler, "lesson 09's sampler instead of lesson 14's");
  cmd->add_flag("--no-pdl", opt->no_pdl, "the fused GEMVs without programmatic dependent launch");
  cmd->add_flag("--no-fast-attention", opt->no_fast_attention,
                "lesson 10's decode attention kernel instead of lesson 14's");
  cmd->add_flag("--megakernel", opt->megakernel,
                "batch-1 decode as lesson 14's one-kernel step (sm_90+; off by default; shared stages, or the "
                "experimental per-warp stages with TVLLM_MEGAKERNEL_PER_WARP=1 in the environment)");
#ifdef TVLLM_CLI_HOPPER
  cmd->add_flag("--no-hopper", opt->no_hopper,
                "prefill rows: only lessons 10 + 06 (without it, on Hopper, lesson 15's attention and GEMM too)");
#endif
  add_fp8_weights_option(cmd, opt->fp8_weights);
  add_fp8_gemm_option(cmd, opt->fp8_gemm);
  add_fp8_lm_head_option(cmd, opt->fp8_lm_head);
  add_kv_cache_dtype_option(cmd, opt->kv_cache_dtype);
  add_tensor_parallel_option(cmd, opt->tensor_parallel_size);
  cmd->add_flag("--compare", opt->compare, "CUDA: the lesson's progression, each step measured in this process");
  cmd->add_option("--device", opt->device, "auto (cuda when a GPU is present), cpu or cuda");
  cmd->add_option("--output", opt->output, "table (default) or json");
  cmd->callback([opt] { run(*opt); });
}

}  // namespace tvllm::cli
