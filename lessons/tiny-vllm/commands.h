// The subcommands of `tiny-vllm`. Each lives in its own file and registers itself on the app;
// later lessons add theirs (tokenize, generate, serve, bench, make-model) the same way.
#pragma once

#include <CLI/CLI.hpp>

namespace tvllm::cli {

// Every command's callback throws InputError for bad input (exit 2) and returns its exit code
// through this variable (0 = success).
extern int g_exit_code;

void add_inspect_command(CLI::App& app);  // inspect.cpp: the tensor table of a safetensors file or model dir

}  // namespace tvllm::cli
