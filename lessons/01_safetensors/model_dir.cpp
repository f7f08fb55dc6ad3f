// ModelDir (config + weights, checked against each other) and ReferenceSet (the Hugging Face outputs
// every lesson executable compares itself with).
#include "model_dir.h"

#include <algorithm>
#include <cstring>
#include <set>

#include "common/errors.h"

namespace tvllm {

namespace fs = std::filesystem;

namespace {

// The weights a Llama model must have, with the shapes its config implies. A checkpoint that disagrees
// with its own config.json is rejected here, once, instead of crashing a kernel later.
void check_weights_match_config(const WeightStore& w, const ModelConfig& c, const fs::path& dir) {
  auto expect = [&](const std::string& name, const Shape& shape) {
    if (!w.contains(name))
      throw InputError(dir.string() + ": the weights have no tensor \"" + name + "\" (config.json describes a " +
                       std::to_string(c.num_hidden_layers) + "-layer Llama model)");
    const SafetensorsEntry& e = w.entry(name);
    if (e.shape != shape)
      throw InputError(dir.string() + ": tensor \"" + name + "\" has shape " + shape_str(e.shape) +
                       ", but config.json implies " + shape_str(shape));
    if (e.dtype != DType::BF16 && e.dtype != DType::F16 && e.dtype != DType::F32)
      throw InputError(dir.string() + ": tensor \"" + name + "\" is " + std::string(dtype_name(e.dtype)) +
                       "; model weights must be BF16, F16 or F32");
  };
  const int64_t H = c.hidden_size, I = c.intermediate_size, V = c.vocab_size;
  expect("model.embed_tokens.weight", {V, H});
  expect("model.norm.weight", {H});
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    expect(p + "input_layernorm.weight", {H});
    expect(p + "post_attention_layernorm.weight", {H});
    expect(p + "self_attn.q_proj.weight", {c.q_dim(), H});   // [out, in]: y = x W^T
    expect(p + "self_attn.k_proj.weight", {c.kv_dim(), H});
    expect(p + "self_attn.v_proj.weight", {c.kv_dim(), H});
    expect(p + "self_attn.o_proj.weight", {H, c.q_dim()});
    expect(p + "mlp.gate_proj.weight", {I, H});
    expect(p + "mlp.up_proj.weight", {I, H});
    expect(p + "mlp.down_proj.weight", {H, I});
  }
  // Tied embeddings: the output projection reuses embed_tokens, and the file usually omits lm_head.
  if (!c.tie_word_embeddings || w.contains("lm_head.weight")) expect("lm_head.weight", {V, H});
}

}  // namespace

ModelDir ModelDir::open(const fs::path& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) throw InputError(path.string() + ": no such directory");
  if (!fs::is_directory(path, ec)) throw InputError(path.string() + ": not a directory (expected a model directory)");
  if (!fs::exists(path / "config.json", ec))
    throw InputError(path.string() + ": no config.json (is this a Hugging Face model directory?)");
  ModelConfig config = load_model_config(path);
  WeightStore weights = WeightStore::open(path);
  check_weights_match_config(weights, config, path);
  return ModelDir{path, std::move(config), std::move(weights)};
}

ReferenceSet ReferenceSet::open(const fs::path& model_dir) {
  const fs::path dir = model_dir / "reference";
  const fs::path act = dir / "activations.safetensors";
  std::error_code ec;
  if (!fs::exists(act, ec))
    throw InputError(act.string() + ": no such file (make it with weights/tools/make_reference.py " +
                     model_dir.string() + ")");
  ReferenceSet r;
  r.activations_ = SafetensorsFile::open(act);
  if (fs::exists(dir / "generate.safetensors", ec)) r.generations_ = SafetensorsFile::open(dir / "generate.safetensors");

  // Prompts are p0, p1, ...: count them by their input_ids.
  while (r.has("p" + std::to_string(r.num_prompts_) + ".input_ids")) ++r.num_prompts_;
  if (r.num_prompts_ == 0) throw InputError(act.string() + ": no prompts (expected a tensor \"p0.input_ids\")");
  for (int i = 0; i < r.num_prompts_; ++i) {
    const std::string name = "p" + std::to_string(i) + ".input_ids";
    const SafetensorsEntry* e = r.activations_->find(name);
    if (e->dtype != DType::I32 || e->shape.size() != 1 || e->shape[0] < 1)
      throw InputError(act.string() + ": \"" + name + "\" must be I32[T] with T >= 1, got " +
                       std::string(dtype_name(e->dtype)) + shape_str(e->shape));
  }

  // Captured layers: those with p0.layers.{l}.input_layernorm.
  const std::string prefix = "p0.layers.", suffix = ".input_layernorm";
  std::set<int> layers;
  for (const SafetensorsEntry& e : r.activations_->entries()) {
    const std::string& n = e.name;
    if (n.size() <= prefix.size() + suffix.size() || n.compare(0, prefix.size(), prefix) != 0 ||
        n.compare(n.size() - suffix.size(), suffix.size(), suffix) != 0)
      continue;
    const std::string digits = n.substr(prefix.size(), n.size() - prefix.size() - suffix.size());
    if (digits.empty() || digits.size() > 6 || !std::all_of(digits.begin(), digits.end(), ::isdigit)) continue;
    layers.insert(std::stoi(digits));
  }
  r.captured_layers_.assign(layers.begin(), layers.end());
  return r;
}

bool ReferenceSet::has(const std::string& name) const { return activations_ && activations_->find(name) != nullptr; }

TensorView ReferenceSet::get(const std::string& name) const {
  TVLLM_REQUIRE(activations_, "ReferenceSet::get(\"" + name + "\"): no reference set is open");
  if (!activations_->find(name))
    throw InputError(activations_->path().string() + ": no reference tensor \"" + name +
                     "\" (regenerate the references with weights/tools/make_reference.py)");
  return activations_->host_view(name);
}

TensorView ReferenceSet::prompt(int i, const std::string& name) const {
  TVLLM_REQUIRE(i >= 0 && i < num_prompts_, "ReferenceSet::prompt: prompt " + std::to_string(i) + " of " +
                                                std::to_string(num_prompts_));
  return get("p" + std::to_string(i) + "." + name);
}

std::vector<int32_t> ReferenceSet::prompt_ids(int i) const {
  TensorView v = prompt(i, "input_ids");  // checked I32[T] in open()
  std::vector<int32_t> ids(static_cast<size_t>(v.numel()));
  std::memcpy(ids.data(), v.data, ids.size() * sizeof(int32_t));
  return ids;
}

}  // namespace tvllm
