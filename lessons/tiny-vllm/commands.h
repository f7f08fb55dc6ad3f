// The subcommands of `tiny-vllm`. Each lives in its own file and registers itself on the app;
// the lessons add theirs (tokenize and detokenize, generate, chat, bench, serve) the same way.
#pragma once

#include <CLI/CLI.hpp>

namespace tvllm::cli {

// Every command's callback throws InputError for bad input (exit 2) and returns its exit code
// through this variable (0 = success).
extern int g_exit_code;

void add_inspect_command(CLI::App& app);  // inspect.cpp: the tensor table of a safetensors file or model dir
void add_tokenize_commands(CLI::App& app);  // tokenize.cpp: tokenize and detokenize (lesson 09)
void add_generate_command(CLI::App& app);   // generate.cpp: one prompt, one continuation (lesson 10)
void add_chat_command(CLI::App& app);       // chat.cpp: the interactive chat (lessons 09 + 10)
void add_bench_throughput_command(CLI::App& bench);  // bench_throughput.cpp: `bench throughput` (lessons 11 + 12)
void add_serve_commands(CLI::App& app);  // serve.cpp: serve, bench serve (lesson 13)
void add_bench_latency_command(CLI::App& bench);  // bench_latency.cpp: `bench latency` (lesson 14)
void add_quantize_command(CLI::App& app);  // quantize.cpp: an FP8 copy of a bf16 checkpoint (lesson 16)

}  // namespace tvllm::cli
