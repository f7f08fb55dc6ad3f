// tiny-vllm bench throughput --model DIR [--num-requests 256] [--min-len 100 --max-len 1024] [--seed 0]
//                            [--device auto|cpu|cuda] [--kv paged|contiguous] [--output table|json]
//                            [--batch-invariant] [--no-async-scheduling] [lesson 14's and 16's flags]
//
// The throughput workload of COURSE.md "Performance method": --num-requests requests whose prompt and output
// lengths are uniform in [--min-len, --max-len], random prompt ids, EOS ignored, all submitted at once to lesson
// 11's Engine (continuous batching) over the paged KV pool of lesson 12 (or the contiguous cache), run to
// completion. The requests come from make_throughput_workload (lessons/11_continuous_batching/engine_bench.h:
// SplitMix64 seeded with --seed), which weights/tools/hf_baseline.py --workload throughput ports exactly, so the
// two run the same requests. Progress on stderr every second; at the end a table (or one JSON object) on stdout.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "commands.h"
#include "common/device.h"
#include "common/input_error.h"
#include "engine.h"
#include "engine_bench.h"
#include "engine_paged.h"
#include "session.h"
#include "model_dir.h"
#include "model_weights.h"

namespace tvllm::cli {
namespace {

struct BenchThroughputOptions {
  std::string model, device = "auto", kv = "paged", output = "table";
  int64_t num_requests = 256, min_len = 100, max_len = 1024;
  uint64_t seed = 0;
  int64_t max_sequences = 256, max_tokens_per_step = 4096, block_size = 16, static_batch = 0;
  double kv_fraction = 0.9;
  bool prefix_caching = true;
  bool batch_invariant = false;
  bool async_scheduling = true;  // lesson 14 (measured: +6% bench throughput, H200)
  std::string kv_cache_dtype = "auto";  // lesson 16
  int tensor_parallel_size = 1;          // lesson 17: only 1 runs
  FastPathFlags fast;  // lesson 14
};

std::string gib(size_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0));
  return buf;
}

void run(const BenchThroughputOptions& o) {
  require_tensor_parallel_size(o.tensor_parallel_size, "bench throughput");
  TVLLM_REQUIRE(o.kv == "paged" || o.kv == "contiguous", "--kv must be paged or contiguous, got " + o.kv);
  TVLLM_REQUIRE(o.output == "table" || o.output == "json", "--output must be table or json, got " + o.output);
  const Device device = resolve_device(o.device);
  TVLLM_REQUIRE(device == Device::CPU || cuda_available(), "--device cuda, but no CUDA GPU is available");
  const ModelDir model = ModelDir::open(o.model, o.fast.fp8_load(o.model, device));  // --fp8-weights (lesson 16)
  const ModelConfig& mc = model.config;
  const std::string fp8_note = describe_fp8_load(mc, model.fp8_resident ? Fp8Load::Resident : Fp8Load::Dequantize) +
                               describe_fp8_lm_head(o.fast.fp8_lm_head);
  require_fp8_lm_head(o.fast.fp8_lm_head, model.fp8_resident ? Fp8Load::Resident : Fp8Load::Dequantize);
  // Every request fits: prompt <= max_len, output <= max_len.
  TVLLM_REQUIRE(2 * o.max_len <= mc.max_position_embeddings,
                "--max-len " + std::to_string(o.max_len) + ": a prompt and an output of that length need " +
                    std::to_string(2 * o.max_len) + " positions, the model has max_position_embeddings " +
                    std::to_string(mc.max_position_embeddings));
  const std::vector<ThroughputRequest> requests =
      make_throughput_workload(o.num_requests, o.min_len, o.max_len, workload_id_high(mc), o.seed);

  ModelWeights weights = ModelWeights::bind(model, device);
  attach_fp8_lm_head_if(o.fast.fp8_lm_head, weights);  // --fp8-lm-head (lesson 16)
  EngineConfig config;
  config.max_sequences = o.max_sequences;
  config.max_tokens_per_step = o.max_tokens_per_step;
  config.max_context = 2 * o.max_len;
  config.batch_invariant = o.batch_invariant;
  config.async_scheduling = o.async_scheduling;
  KvFactory kv;
  PagedKvOptions kv_options;
  const std::string kv_note =
      apply_kv_cache_dtype(o.kv_cache_dtype, model, o.kv == "paged", o.batch_invariant, kv_options);  // lesson 16
  if (o.kv == "paged") {
    PagedKvOptions p = kv_options;
    p.block_size = o.block_size;
    p.prefix_caching = o.prefix_caching;
    p.budget.fraction = o.kv_fraction;
    p.log = &std::cerr;
    kv = paged_kv(p);
  } else {
    kv = contiguous_kv();
  }
  Engine engine(weights, config, kv);
  o.fast.apply(engine);  // lesson 14 (CUDA): fused decode, CUDA graphs, the fast sampler
  const auto warm_start = std::chrono::steady_clock::now();
  o.fast.warm_up(engine);  // + the decode graphs of batch sizes 1, 2, 4, ..., before the timed run
  const double warm_up_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - warm_start).count();
  std::fprintf(stderr, "bench throughput: %s on %s, %s%s%s%s%s; %lld requests, lengths [%lld, %lld], seed %llu\n",
               o.model.c_str(), std::string(device_name(device)).c_str(), engine.kv().describe().c_str(),
               fp8_note.empty() ? "" : ", ", fp8_note.c_str(), kv_note.empty() ? "" : ", ", kv_note.c_str(),
               static_cast<long long>(o.num_requests), static_cast<long long>(o.min_len),
               static_cast<long long>(o.max_len), static_cast<unsigned long long>(o.seed));

  const ThroughputResult r = run_throughput(engine, requests, o.static_batch, [](const ThroughputProgress& p) {
    std::fprintf(stderr, "[%6.1f s] %lld/%lld requests done, %lld output tokens, %.0f output tok/s\n", p.seconds,
                 static_cast<long long>(p.done), static_cast<long long>(p.total),
                 static_cast<long long>(p.output_tokens), static_cast<double>(p.output_tokens) / p.seconds);
  });

  if (o.output == "json") {
    nlohmann::json j;
    j["model"] = o.model;
    j["device"] = std::string(device_name(device));
    j["kv"] = o.kv;
    j["batching"] = o.static_batch > 0 ? "static" : "continuous";
    j["batch_invariant"] = o.batch_invariant;
    j["async_scheduling"] = o.async_scheduling;
    j["kv_cache_dtype"] = std::string(kv_cache_dtype_name(kv_options.kv_dtype));
    j["seed"] = o.seed;
    j["min_len"] = o.min_len;
    j["max_len"] = o.max_len;
    j["requests"] = r.requests;
    j["prompt_tokens"] = r.prompt_tokens;
    j["output_tokens"] = r.output_tokens;
    j["seconds"] = r.seconds;
    j["output_tok_s"] = r.output_tok_s;
    j["total_tok_s"] = r.total_tok_s;
    j["steps"] = r.steps;
    j["peak_running"] = r.peak_running;
    j["preemptions"] = r.preemptions;
    j["failed"] = r.failed;
    j["kv_blocks"] = r.kv.total_blocks;
    j["kv_block_size"] = r.kv.block_size;
    j["kv_bytes"] = r.kv.bytes;
    j["warm_up_seconds"] = warm_up_s;
    j["fp8_weights"] = !mc.quantization ? "none" : model.fp8_resident ? "resident" : "dequantize";
    j["fp8_gemm"] = fp8_gemm_report();  // lesson 16: which product the steps of 17+ tokens ran, and how often
    j["step_seconds"] = {{"total", r.step_s}, {"prepare", r.prepare_s}, {"launch", r.launch_s}, {"wait", r.wait_s},
                         {"other", r.other_s}};
    std::cout << j.dump() << "\n";
  } else {
    std::printf("tiny-vllm bench throughput: %s on %s, %s batching%s%s; %s\n", o.model.c_str(),
                std::string(device_name(device)).c_str(), o.static_batch > 0 ? "static" : "continuous",
                o.batch_invariant ? " (batch-invariant)" : "", o.async_scheduling ? " (async scheduling)" : "",
                engine.kv().describe().c_str());
    std::printf("  %-16s %14lld\n", "requests", static_cast<long long>(r.requests));
    std::printf("  %-16s %14lld\n", "prompt tokens", static_cast<long long>(r.prompt_tokens));
    std::printf("  %-16s %14lld\n", "output tokens", static_cast<long long>(r.output_tokens));
    std::printf("  %-16s %14.2f\n", "seconds", r.seconds);
    std::printf("  %-16s %14.1f\n", "output tok/s", r.output_tok_s);
    std::printf("  %-16s %14.1f\n", "total tok/s", r.total_tok_s);
    std::printf("  %-16s %14lld\n", "steps", static_cast<long long>(r.steps));
    std::printf("  %-16s %14lld\n", "peak running", static_cast<long long>(r.peak_running));
    std::printf("  %-16s %14lld\n", "preemptions", static_cast<long long>(r.preemptions));
    std::printf("  %-16s %14s\n", "KV blocks",
                (std::to_string(r.kv.total_blocks) + " x " + std::to_string(r.kv.block_size)).c_str());
    std::printf("  %-16s %14s\n", "KV memory", gib(r.kv.bytes).c_str());
    // Before the timed run (not in "seconds"): graph captures of the warm-up batches, the first prefills.
    std::printf("  %-16s %11.1f ms\n", "warm-up", warm_up_s * 1e3);
    // The engine thread's time per step: only `wait` overlaps the GPU's work; the rest is time the GPU idles
    // (with --async-scheduling, prepare and launch overlap the step before as well).
    const double per_step_ms = r.steps > 0 ? 1e3 / static_cast<double>(r.steps) : 0.0;
    std::printf("  %-16s %11.3f ms  (prepare %.3f, launch %.3f, wait for the GPU %.3f, schedule + deliver %.3f)\n",
                "host per step", r.step_s * per_step_ms, r.prepare_s * per_step_ms, r.launch_s * per_step_ms,
                r.wait_s * per_step_ms, r.other_s * per_step_ms);
    if (r.failed > 0) std::printf("  FAILED: %lld requests did not get all their tokens\n", static_cast<long long>(r.failed));
  }
  g_exit_code = r.failed == 0 ? 0 : 1;
}

}  // namespace

// `bench` is the `tiny-vllm bench` subcommand: this adds `throughput` under it.
void add_bench_throughput_command(CLI::App& bench) {
  auto opt = std::make_shared<BenchThroughputOptions>();
  CLI::App* cmd = bench.add_subcommand(
      "throughput", "many requests at once through the engine (continuous batching): output and total tok/s");
  cmd->add_option("--model", opt->model, "model directory (config.json + safetensors)")->required();
  cmd->add_option("--num-requests", opt->num_requests, "requests (default 256)")->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--min-len", opt->min_len, "shortest prompt and output (default 100)")->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--max-len", opt->max_len, "longest prompt and output (default 1024)")->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--seed", opt->seed, "the workload's seed (SplitMix64; default 0)");
  cmd->add_option("--device", opt->device, "auto (cuda when a GPU is present), cpu or cuda");
  cmd->add_option("--kv", opt->kv, "paged (default) or contiguous");
  cmd->add_option("--output", opt->output, "table (default) or json");
  // vLLM's flag names, as `serve` has them; the names of earlier versions stay as hidden aliases.
  cmd->add_option("--max-num-seqs", opt->max_sequences, "sequences running at once (default 256)")
      ->check(CLI::Range(1, 65535));
  cmd->add_option("--max-sequences", opt->max_sequences)->check(CLI::Range(1, 65535))->group("");
  cmd->add_option("--max-num-batched-tokens", opt->max_tokens_per_step, "the token budget of a step (default 4096)")
      ->check(CLI::Range(1, 1 << 24));
  cmd->add_option("--max-tokens-per-step", opt->max_tokens_per_step)->check(CLI::Range(1, 1 << 24))->group("");
  cmd->add_option("--block-size", opt->block_size, "paged: positions per block (default 16)")->check(CLI::Range(1, 4096));
  cmd->add_option("--gpu-memory-utilization", opt->kv_fraction,
                  "paged, CUDA: fraction of the free memory for the pool (0.9)")
      ->check(CLI::Range(0.01, 1.0));
  cmd->add_option("--kv-fraction", opt->kv_fraction)->check(CLI::Range(0.01, 1.0))->group("");
  cmd->add_flag("!--no-prefix-caching", opt->prefix_caching, "paged: turn the prefix cache off");
  add_kv_cache_dtype_option(cmd, opt->kv_cache_dtype);
  add_tensor_parallel_option(cmd, opt->tensor_parallel_size);
  opt->fast.add_to(cmd);
  cmd->add_flag("--batch-invariant", opt->batch_invariant,
                "the engine's batch-invariant kernels (lesson 06 v8, flash decode): what exactness costs");
  add_async_scheduling_flag(cmd, opt->async_scheduling);
  cmd->add_option("--static-batch", opt->static_batch,
                  "0 (default): continuous batching; B: static batches of B (the next starts when all have finished)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 20));
  cmd->callback([opt] { run(*opt); });
}

}  // namespace tvllm::cli
