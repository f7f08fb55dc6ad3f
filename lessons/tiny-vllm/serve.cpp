// tiny-vllm serve --model DIR [--host 127.0.0.1] [--port 8000] [--device auto|cpu|cuda] [--served-model-name NAME]
//                 [--api-key KEY] [--max-waiting N] [--kv paged|contiguous] [--max-model-len N] [--max-num-seqs N]
//                 [--max-num-batched-tokens N] [--kv-blocks N] [--gpu-memory-utilization F] [--shutdown-timeout S]
//                 [--read-timeout S] [--max-connections N] [--quiet] [--batch-invariant] [--no-async-scheduling]
//                 [--enforce-eager] [--no-fused] [--no-fast-sampler] [--no-pdl] [--no-fast-attention]
// tiny-vllm bench serve --url http://127.0.0.1:8000 --concurrency C --num-requests N [--max-tokens M]
//                       [--prompt-len P] [--duration-limit S] [--model NAME] [--api-key KEY] [--output text|json]
//
// serve: lesson 13's OpenAI-compatible server over the engine (lessons 11-12), with lesson 14's fast path on a
// GPU (--enforce-eager, --no-fused, --no-fast-sampler, --no-pdl, --no-fast-attention turn its parts off). It warms
// the engine up (a dummy request through each code path, and the decode graphs of batch sizes 1, 2, 4, ...), then
// prints "listening on http://HOST:PORT" once it accepts connections (--port 0: any free port, the line says
// which), one line per finished request on stderr (unless --quiet), and on SIGINT/SIGTERM stops accepting (503),
// lets in-flight requests finish for --shutdown-timeout seconds, aborts the rest, closes every connection and
// exits 0. A second signal exits at once (130).
// bench serve: lesson 13's load generator against a running server on this machine (loopback only).
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <string>
#include <thread>

#include "bench_serve.h"
#include "commands.h"
#include "common/errors.h"
#include "engine_paged.h"
#include "server.h"
#include "session.h"

namespace tvllm::cli {

void add_serve_commands(CLI::App& app);  // registered by main.cpp (commands.h)

namespace {

struct ServeCliOptions {
  std::string model, host = "127.0.0.1", device = "auto", served_name, api_key, kv = "paged";
  int port = 8000;
  int64_t max_waiting = 128, max_model_len = 2048, max_num_seqs = 64, max_batched_tokens = 2048,
          kv_blocks = 0;
  double gpu_memory_utilization = 0.9, shutdown_timeout_s = 30, read_timeout_s = 30;
  int64_t max_connections = 1000;
  bool quiet = false;
  bool batch_invariant = false;
  bool async_scheduling = true;  // lesson 14: the next step launched before the last one's ids are back
  std::string kv_cache_dtype = "auto";  // lesson 16
  int tensor_parallel_size = 1;          // lesson 17: only 1 runs
  FastPathFlags fast;  // lesson 14
};

// The directory's name, as vLLM serves a local model by its path's last part ("weights/tiny-llama3/" too).
std::string default_model_name(const std::filesystem::path& dir) {
  std::filesystem::path p = dir.lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  const std::string name = p.filename().string();
  return name.empty() || name == "." ? "model" : name;
}

std::atomic<int> g_signals{0};
extern "C" void on_stop_signal(int) {
  if (g_signals.fetch_add(1) >= 1) _exit(130);  // the second Ctrl-C: now (async-signal-safe)
}

void run_serve(const ServeCliOptions& o) {
  require_tensor_parallel_size(o.tensor_parallel_size, "serve");
  if (o.port < 0 || o.port > 65535) throw InputError("--port must be in [0, 65535] (0: any free port)");
  if (o.max_waiting < 0) throw InputError("--max-waiting must be >= 0");
  if (o.shutdown_timeout_s < 0) throw InputError("--shutdown-timeout must be >= 0");
  if (o.max_model_len < 2) throw InputError("--max-model-len must be >= 2");
  if (!(o.read_timeout_s > 0)) throw InputError("--read-timeout must be > 0 seconds");
  if (o.max_connections < 1) throw InputError("--max-connections must be >= 1");
  std::unique_ptr<LoadedModel> m = LoadedModel::open(o.model, o.device, &o.fast);
  // Without tokenizer.json (random weights for a benchmark) the server takes token ids and returns token ids.
  const Tokenizer* tok = m->tokenizer ? &*m->tokenizer : nullptr;
  std::optional<ChatTemplate> chat;
  if (!tok) {
    std::fprintf(stderr,
                 "tiny-vllm serve: %s has no tokenizer.json: prompts must be token ids, completions carry "
                 "token_ids and no text\n",
                 m->dir.string().c_str());
  } else {
    try {
      chat = ChatTemplate::from_model_dir(m->dir);
    } catch (const InputError& e) {
      std::fprintf(stderr, "tiny-vllm serve: warning: %s\n  /v1/chat/completions will answer 400\n",
                   e.what());
    }
  }
  if (tok && !chat)
    std::fprintf(stderr, "tiny-vllm serve: %s has no chat template: /v1/chat/completions will answer 400\n",
                 m->dir.string().c_str());

  // SIGINT/SIGTERM from here on only set a flag; the main thread turns it into a graceful shutdown.
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);

  m->bind_weights();
  EngineConfig ec;
  ec.max_sequences = o.max_num_seqs;
  ec.max_tokens_per_step = o.max_batched_tokens;
  ec.max_context = std::min<int64_t>(o.max_model_len, m->model.config.max_position_embeddings);
  ec.batch_invariant = o.batch_invariant;
  ec.async_scheduling = o.async_scheduling;
  KvFactory kv;
  PagedKvOptions kv_options;
  const std::string kv_note =
      apply_kv_cache_dtype(o.kv_cache_dtype, m->model, o.kv == "paged", o.batch_invariant, kv_options);  // lesson 16
  if (!kv_note.empty() && !o.quiet) std::fprintf(stderr, "tiny-vllm serve: %s\n", kv_note.c_str());
  if (o.kv == "paged") {
    PagedKvOptions po = kv_options;
    po.num_blocks = o.kv_blocks;
    po.budget.fraction = o.gpu_memory_utilization;
    po.log = &std::cerr;
    kv = paged_kv(po);
  } else {
    kv = contiguous_kv();
  }
  Engine engine(*m->weights, ec, kv);
  o.fast.apply(engine);  // lesson 14 (CUDA): fused decode, CUDA graphs, the fast sampler
  // Before the port opens (so /health never says ok for a cold engine): the first request's one-time costs,
  // paid here (measured on the H200: TTFT p99 141 ms at concurrency 1 without it, p50 2.1 ms).
  const auto warm_start = std::chrono::steady_clock::now();
  const int64_t warm_steps = o.fast.warm_up(engine);  // + the decode graphs of batch sizes 1, 2, 4, ... (lesson 14)
  if (!o.quiet)
    std::fprintf(stderr, "tiny-vllm serve: warmed up (%lld steps, %.0f ms)\n", static_cast<long long>(warm_steps),
                 std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - warm_start).count());

  server::ServerConfig sc;
  sc.host = o.host;
  sc.port = o.port;
  sc.model_name = o.served_name.empty() ? default_model_name(m->dir) : o.served_name;
  sc.api_key = o.api_key;
  sc.max_waiting = o.max_waiting;
  sc.read_timeout_s = o.read_timeout_s;
  sc.max_connections = o.max_connections;
  sc.log = o.quiet ? nullptr : &std::cerr;
  server::OpenAiServer srv(engine, tok, chat, sc);
  const int port = srv.start();
  std::printf("tiny-vllm serve: %s on %s; KV: %s; context %lld, up to %lld sequences, %lld waiting%s%s; %s\n",
              m->dir.string().c_str(), std::string(device_name(m->device)).c_str(),
              engine.kv().describe().c_str(), static_cast<long long>(engine.limits().max_context),
              static_cast<long long>(ec.max_sequences), static_cast<long long>(sc.max_waiting),
              ec.batch_invariant ? "; batch-invariant" : "", ec.async_scheduling ? "; async scheduling" : "",
              o.fast.describe(m->device, &m->model.config, m->fp8, ec.batch_invariant).c_str());
  std::printf("listening on http://%s:%d (model \"%s\"%s); Ctrl-C to stop\n", o.host.c_str(), port,
              sc.model_name.c_str(), o.api_key.empty() ? "" : ", API key required");
  std::fflush(stdout);

  while (g_signals.load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  std::fprintf(stderr,
               "tiny-vllm serve: stopping (new requests get 503; in-flight ones have %g s to finish)\n",
               o.shutdown_timeout_s);
  const int64_t aborted =
      srv.shutdown(std::chrono::milliseconds(static_cast<int64_t>(o.shutdown_timeout_s * 1000)));
  std::fprintf(stderr, "tiny-vllm serve: stopped (%lld request(s) aborted)\n",
               static_cast<long long>(aborted));
}

struct BenchServeCliOptions {
  server::BenchServeOptions bench;
  std::string output = "text";
};

void run_bench_serve_cli(const BenchServeCliOptions& o) {
  const server::BenchServeOptions& b = o.bench;
  server::parse_loopback_url(b.url);  // refused before anything is printed
  if (o.output == "text")
    std::fprintf(
        stderr,
        "bench serve: %lld requests at concurrency %d against %s: prompts of %lld ids, max_tokens %lld, "
        "EOS ignored, greedy (at most %g s)\n",
        static_cast<long long>(b.num_requests), b.concurrency, b.url.c_str(),
        static_cast<long long>(b.prompt_len), static_cast<long long>(b.max_tokens), b.duration_limit_s);
  const server::BenchServeResult r = server::run_bench_serve(b);
  if (o.output == "json") {
    std::printf("%s\n", r.to_json().dump().c_str());
  } else {
    std::printf("model \"%s\", concurrency %d\n%s", r.model.c_str(), r.concurrency, r.table().c_str());
  }
  std::fflush(stdout);
  g_exit_code =
      r.failed > 0 || r.completed == 0 ? 1 : 0;  // a benchmark with failed requests measured nothing
}

}  // namespace

void add_serve_commands(CLI::App& app) {
  auto opt = std::make_shared<ServeCliOptions>();
  CLI::App* cmd =
      app.add_subcommand("serve", "An OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)");
  cmd->add_option("--model", opt->model, "a model directory (config.json, model.safetensors, tokenizer.json)")
      ->required();
  cmd->add_option("--host", opt->host, "the address to listen on (default 127.0.0.1: this machine only)");
  cmd->add_option("--port", opt->port, "the port (default 8000; 0: any free port, printed)");
  cmd->add_option("--device", opt->device, "auto (cuda when a GPU is present), cpu or cuda")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  cmd->add_option("--served-model-name", opt->served_name,
                  "the name clients send as \"model\" (default: the directory's)");
  cmd->add_option("--api-key", opt->api_key,
                  "require 'Authorization: Bearer KEY' on /v1/* (default: $TVLLM_API_KEY)");
  cmd->add_option("--max-waiting", opt->max_waiting,
                  "requests admitted without a first token yet; one more is answered 429 (default 128)");
  cmd->add_option("--kv", opt->kv, "the KV cache: paged (lesson 12, default) or contiguous (lesson 10)")
      ->check(CLI::IsMember({"paged", "contiguous"}));
  cmd->add_option("--max-model-len", opt->max_model_len,
                  "tokens per sequence, prompt + completion (default 2048)");
  cmd->add_option("--max-num-seqs", opt->max_num_seqs, "sequences running at once (default 64)");
  cmd->add_option("--max-num-batched-tokens", opt->max_batched_tokens,
                  "tokens per engine step (default 2048)");
  cmd->add_option("--kv-blocks", opt->kv_blocks,
                  "paged: blocks of 16 positions in the pool (0: from free memory)");
  cmd->add_option("--gpu-memory-utilization", opt->gpu_memory_utilization,
                  "paged on CUDA: the fraction of free memory the pool may take (default 0.9)");
  add_kv_cache_dtype_option(cmd, opt->kv_cache_dtype);
  add_tensor_parallel_option(cmd, opt->tensor_parallel_size);
  cmd->add_option("--shutdown-timeout", opt->shutdown_timeout_s,
                  "seconds in-flight requests may take to finish after SIGINT/SIGTERM (default 30); then the "
                  "rest are aborted and every connection is closed");
  cmd->add_option("--read-timeout", opt->read_timeout_s,
                  "seconds a client has to send a whole request, headers and body (default 30; then 408)");
  cmd->add_option("--max-connections", opt->max_connections,
                  "open client connections; one more is answered 503 and closed (default 1000)");
  cmd->add_flag("--quiet", opt->quiet, "no line per request on stderr");
  opt->fast.add_to(cmd);
  cmd->add_flag("--batch-invariant", opt->batch_invariant,
                "a request's tokens do not depend on the other requests in flight (slower kernels; lesson 11)");
  add_async_scheduling_flag(cmd, opt->async_scheduling);
  cmd->callback([opt] {
    ServeCliOptions o = *opt;
    if (o.api_key.empty())
      if (const char* env = std::getenv("TVLLM_API_KEY")) o.api_key = env;
    run_serve(o);
    g_exit_code = 0;
  });

  // `bench` exists when the engine is built (main.cpp: `bench throughput`, lessons 11-12); serve joins it, and
  // lesson 14's `bench latency` comes after.
  CLI::App* bench = nullptr;
  try {
    bench = app.get_subcommand("bench");
  } catch (const CLI::OptionNotFound&) {
    bench = app.add_subcommand("bench", "Benchmarks");
    bench->require_subcommand(1);
  }
  auto b = std::make_shared<BenchServeCliOptions>();
  CLI::App* bs =
      bench->add_subcommand("serve", "Load a running server (loopback only): TTFT, TPOT, throughput");
  bs->add_option("--url", b->bench.url,
                 "the server (default http://127.0.0.1:8000; loopback addresses only)");
  bs->add_option("--concurrency", b->bench.concurrency, "requests in flight at once (default 1)");
  bs->add_option("--num-requests", b->bench.num_requests, "requests in all (default 64)");
  bs->add_option("--max-tokens", b->bench.max_tokens, "tokens per completion, EOS ignored (default 128)");
  bs->add_option("--prompt-len", b->bench.prompt_len, "prompt length in token ids (default 128)");
  bs->add_option("--duration-limit", b->bench.duration_limit_s, "stop after this many seconds (default 600)");
  bs->add_option("--model", b->bench.model, "the model name (default: the server's, from /v1/models)");
  bs->add_option("--api-key", b->bench.api_key, "sent as a Bearer token");
  bs->add_option("--seed", b->bench.seed, "seed of the random prompts (default 0)");
  bs->add_option("--output", b->output, "text (a table) or json (one object)")
      ->check(CLI::IsMember({"text", "json"}));
  bs->callback([b] { run_bench_serve_cli(*b); });
}

}  // namespace tvllm::cli
