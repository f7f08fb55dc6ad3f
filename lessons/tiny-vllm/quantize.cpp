// tiny-vllm quantize --model DIR --out DIR [--scheme fp8-dynamic] [--strategy channel|tensor]
//
// A bf16 (or f16, f32) checkpoint in, an FP8 checkpoint out, in the compressed-tensors layout that
// llm-compressor's FP8-dynamic scheme writes (lesson 16): every Linear weight as F8_E4M3 with its
// weight_scale, everything else as it was. The result loads back in tiny-vllm (lesson 01 dequantizes it
// at load) and in Hugging Face transformers with compressed-tensors installed.
#include <cstdio>
#include <memory>
#include <string>

#include "commands.h"
#include "quantize.h"

namespace tvllm::cli {

void add_quantize_command(CLI::App& app) {
  struct Options {
    std::string model, out, scheme = "fp8-dynamic", strategy = "channel";
  };
  auto opt = std::make_shared<Options>();
  CLI::App* cmd = app.add_subcommand("quantize", "write an FP8 (compressed-tensors) copy of a bf16 checkpoint");
  cmd->add_option("--model", opt->model, "the bf16, f16 or f32 model directory")->required();
  cmd->add_option("--out", opt->out, "the directory to write (new or empty)")->required();
  cmd->add_option("--scheme", opt->scheme, "fp8-dynamic: FP8 weights, dynamic per-token FP8 activations")
      ->check(CLI::IsMember({"fp8-dynamic"}));
  cmd->add_option("--strategy", opt->strategy, "weight scales: one per output row (channel) or one per tensor")
      ->check(CLI::IsMember({"channel", "tensor"}));
  cmd->callback([opt] {
    QuantizeOptions o;
    o.scheme = opt->scheme;
    o.strategy = opt->strategy == "tensor" ? Fp8Quantization::Strategy::Tensor : Fp8Quantization::Strategy::Channel;
    const QuantizeSummary s = quantize_checkpoint(opt->model, opt->out, o);
    std::printf("quantized %lld Linear weights to F8_E4M3 (%s scales), kept %lld tensors as they were\n",
                static_cast<long long>(s.quantized_tensors), opt->strategy.c_str(),
                static_cast<long long>(s.kept_tensors));
    std::printf("tensor bytes: %.1f MB -> %.1f MB (%.2fx); worst weight error %.3f of its rounding bound\n",
                s.bytes_before / 1e6, s.bytes_after / 1e6,
                s.bytes_after ? static_cast<double>(s.bytes_before) / static_cast<double>(s.bytes_after) : 0.0,
                s.max_error_over_bound);
    std::printf("wrote %s\n", opt->out.c_str());
    g_exit_code = 0;
  });
}

}  // namespace tvllm::cli
