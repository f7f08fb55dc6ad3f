// A model directory as the lessons use it: config.json, the weights, and (when present) the Hugging
// Face reference outputs under reference/ that every lesson executable checks itself against.
#pragma once

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "common/tensor.h"
#include "model_config.h"
#include "safetensors.h"

namespace tvllm {

// MODEL_DIR/reference/: activations.safetensors (per-prompt intermediate tensors, fp32), generate.safetensors
// (greedy continuations), manifest.json (what was run). weights/README.md documents every name.
class ReferenceSet {
 public:
  // Throws InputError if DIR/reference/activations.safetensors is missing or malformed.
  static ReferenceSet open(const std::filesystem::path& model_dir);

  int num_prompts() const { return num_prompts_; }   // prompts p0, p1, ... in activations.safetensors
  bool has(const std::string& name) const;
  // A host view of a stored tensor, e.g. get("p0.layers.0.input_layernorm"). Throws InputError if absent.
  TensorView get(const std::string& name) const;
  // The same, prefixed for prompt i: prompt(1, "embed_tokens") -> "p1.embed_tokens".
  TensorView prompt(int i, const std::string& name) const;
  // Token ids of prompt i (I32 on the host, copied out).
  std::vector<int32_t> prompt_ids(int i) const;
  // Layers whose per-stage tensors were captured (layer 0 and the last layer).
  const std::vector<int>& captured_layers() const { return captured_layers_; }
  const SafetensorsFile& activations() const { return *activations_; }
  // generate.safetensors, or nullptr when absent.
  const SafetensorsFile* generations() const { return generations_.get(); }

 private:
  std::unique_ptr<SafetensorsFile> activations_;
  std::unique_ptr<SafetensorsFile> generations_;
  int num_prompts_ = 0;
  std::vector<int> captured_layers_;
};

// What ModelDir::open does with an FP8 checkpoint's Linear weights (lesson 16).
//   Dequantize  bf16 in host memory, w = round_bf16(fp8 * scale), the scales consumed: every forward of
//               lessons 08-14 runs the checkpoint unchanged (the default)
//   Resident    left as stored, F8_E4M3 codes with their weight_scale beside them, for a GPU engine whose
//               decode GEMVs read the codes (lesson 16, "FP8 in the engine"); ModelWeights::bind packs them
//               on CUDA and refuses them on the CPU
enum class Fp8Load { Dequantize, Resident };

struct ModelDir {
  std::filesystem::path path;
  ModelConfig config;
  WeightStore weights;
  bool fp8_resident = false;  // opened with Fp8Load::Resident and the checkpoint is FP8
  // Opens config.json and the weights (mapped, not yet uploaded), checks them against each other, and
  // dequantizes an FP8 checkpoint's weights to bf16 in host memory unless `fp8` says Resident. Throws
  // InputError.
  static ModelDir open(const std::filesystem::path& path, Fp8Load fp8 = Fp8Load::Dequantize);
};

}  // namespace tvllm
