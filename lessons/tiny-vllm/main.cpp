// tiny-vllm: the engine's command line. Each lesson that adds a user-facing feature adds a subcommand.
//
//   tiny-vllm inspect FILE_OR_DIR       tensor table of a .safetensors file or a model directory
//   tiny-vllm tokenize / detokenize     text <-> token ids (lesson 09)
//   tiny-vllm generate --model DIR      continue a prompt, streaming (lesson 10)
//   tiny-vllm chat --model DIR          an interactive chat in the terminal (lessons 09 + 10)
//   tiny-vllm serve --model DIR         the OpenAI-compatible server (lesson 13)
//   tiny-vllm bench throughput|serve|latency   the benchmarks (lessons 11-14)
//   tiny-vllm quantize --model DIR --out DIR   an FP8 copy of a bf16 checkpoint (lesson 16)
//
// Exit codes: 0 success, 1 runtime failure (CUDA error, out of memory), 2 bad usage or bad input.
#include <cstdio>
#include <exception>

#include "commands.h"
#include "common/errors.h"

namespace tvllm::cli {
int g_exit_code = 0;
}

int main(int argc, char** argv) {
  CLI::App app{"tiny-vllm: a small, fast LLM inference engine built lesson by lesson", "tiny-vllm"};
  app.require_subcommand(1);
  tvllm::cli::add_inspect_command(app);
#ifdef TVLLM_CLI_TOKENIZE  // a student workspace without lesson 09 has no tokenizer yet (CMakeLists.txt)
  tvllm::cli::add_tokenize_commands(app);
#endif
#ifdef TVLLM_CLI_GENERATE
  tvllm::cli::add_generate_command(app);
  tvllm::cli::add_chat_command(app);
#endif
  CLI::App* bench = nullptr;  // `tiny-vllm bench`, once the engine exists
#ifdef TVLLM_CLI_ENGINE  // lessons 11-12: the engine (continuous batching, paged KV)
  bench = app.add_subcommand("bench", "benchmarks of the engine");
  bench->require_subcommand(1);
  tvllm::cli::add_bench_throughput_command(*bench);
#endif
#ifdef TVLLM_CLI_SERVE  // lesson 13: serve, and bench serve (under the bench command above)
  tvllm::cli::add_serve_commands(app);
#endif
#ifdef TVLLM_CLI_FAST  // lesson 14: bench latency (the fast path itself is installed by generate, chat, serve)
  tvllm::cli::add_bench_latency_command(*bench);
#endif
#ifdef TVLLM_CLI_QUANTIZE  // lesson 16
  tvllm::cli::add_quantize_command(app);
#endif
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  } catch (const tvllm::InputError& e) {
    std::fprintf(stderr, "tiny-vllm: error: %s\n", e.what());
    return 2;
  } catch (const tvllm::CudaError& e) {
    std::fprintf(stderr, "tiny-vllm: CUDA failure: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tiny-vllm: failure: %s\n", e.what());
    return 1;
  }
  return tvllm::cli::g_exit_code;
}
