// tiny-vllm: the engine's command line. Each lesson that adds a user-facing feature adds a subcommand.
//
//   tiny-vllm inspect FILE_OR_DIR       tensor table of a .safetensors file or a model directory
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
