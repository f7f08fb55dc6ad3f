// ModelDir (config + weights, checked against each other) and ReferenceSet (the Hugging Face outputs
// every lesson executable compares itself with).
#include "model_dir.h"

#include <algorithm>
#include <cstring>
#include <set>

#include "common/buffer.h"
#include "common/errors.h"

namespace tvllm {

namespace fs = std::filesystem;

namespace {

// The weights a Llama model must have, with the shapes its config implies. A checkpoint that disagrees
// with its own config.json is rejected here, once, instead of crashing a kernel later. In an FP8
// checkpoint (config.quantization, lesson 16) every Linear weight that the config does not ignore is
// F8_E4M3 with its weight_scale beside it; an 8-bit float anywhere else is refused.
void check_weights_match_config(const WeightStore& w, const ModelConfig& c, const fs::path& dir) {
  auto require = [&](const std::string& name, const Shape& shape) -> const SafetensorsEntry& {
    if (!w.contains(name))
      throw InputError(dir.string() + ": the weights have no tensor \"" + name + "\" (config.json describes a " +
                       std::to_string(c.num_hidden_layers) + "-layer Llama model)");
    const SafetensorsEntry& e = w.entry(name);
    if (e.shape != shape)
      throw InputError(dir.string() + ": tensor \"" + name + "\" has shape " + shape_str(e.shape) +
                       ", but config.json implies " + shape_str(shape));
    return e;
  };
  auto expect = [&](const std::string& name, const Shape& shape) {
    const SafetensorsEntry& e = require(name, shape);
    if (is_fp8(e.dtype))
      throw InputError(dir.string() + ": tensor \"" + name + "\" is " + std::string(dtype_name(e.dtype)) +
                       ", an 8-bit float: FP8 weights load only as the Linear weights of a quantized checkpoint "
                       "(config.json quantization_config, compressed-tensors \"float-quantized\"; lesson 16)" +
                       (c.quantization ? std::string(" and this tensor is not one") : std::string()));
    if (e.dtype != DType::BF16 && e.dtype != DType::F16 && e.dtype != DType::F32)
      throw InputError(dir.string() + ": tensor \"" + name + "\" is " + std::string(dtype_name(e.dtype)) +
                       "; model weights must be BF16, F16 or F32");
  };
  // A Linear layer's weight [out, in]: plain, or FP8 with its scale when the checkpoint quantizes it.
  auto linear = [&](const std::string& module, const Shape& shape) {
    if (!c.quantization || c.quantization->ignores(module)) return expect(module + ".weight", shape);
    const SafetensorsEntry& e = require(module + ".weight", shape);
    if (e.dtype != DType::F8_E4M3)
      throw InputError(dir.string() + ": tensor \"" + module + ".weight\" is " + std::string(dtype_name(e.dtype)) +
                       ", but config.json's quantization_config quantizes every Linear layer it does not ignore: "
                       "expected F8_E4M3");
    const std::string scale = module + ".weight_scale";
    if (!w.contains(scale))
      throw InputError(dir.string() + ": tensor \"" + scale + "\" is missing (the scales of the FP8 weight \"" +
                       module + ".weight\")");
    const SafetensorsEntry& s = w.entry(scale);
    const bool channel = c.quantization->weight_strategy == Fp8Quantization::Strategy::Channel;
    const bool shape_ok = channel ? s.shape == Shape{shape[0], 1}
                                  : (s.shape == Shape{1} || s.shape.empty() || s.shape == Shape{1, 1});
    if (!shape_ok)
      throw InputError(dir.string() + ": tensor \"" + scale + "\" has shape " + shape_str(s.shape) + ", but strategy \"" +
                       (channel ? "channel\" needs one scale per output row: [" + std::to_string(shape[0]) + ", 1]"
                                : "tensor\" needs one scale: [1] or []"));
    if (s.dtype != DType::F32 && s.dtype != DType::BF16 && s.dtype != DType::F16)
      throw InputError(dir.string() + ": tensor \"" + scale + "\" is " + std::string(dtype_name(s.dtype)) +
                       "; scales must be F32, BF16 or F16");
    for (const char* extra : {".input_scale", ".weight_zero_point", ".input_zero_point"}) {
      if (w.contains(module + extra))
        throw InputError(dir.string() + ": tensor \"" + module + extra + "\" is present, but the quantization_config "
                         "has no static activation scales or zero points");
    }
  };
  const int64_t H = c.hidden_size, I = c.intermediate_size, V = c.vocab_size;
  expect("model.embed_tokens.weight", {V, H});
  expect("model.norm.weight", {H});
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    expect(p + "input_layernorm.weight", {H});
    expect(p + "post_attention_layernorm.weight", {H});
    linear(p + "self_attn.q_proj", {c.q_dim(), H});   // [out, in]: y = x W^T
    linear(p + "self_attn.k_proj", {c.kv_dim(), H});
    linear(p + "self_attn.v_proj", {c.kv_dim(), H});
    linear(p + "self_attn.o_proj", {H, c.q_dim()});
    linear(p + "mlp.gate_proj", {I, H});
    linear(p + "mlp.up_proj", {I, H});
    linear(p + "mlp.down_proj", {H, I});
  }
  // Tied embeddings: the output projection reuses embed_tokens, and the file usually omits lm_head.
  if (!c.tie_word_embeddings || w.contains("lm_head.weight")) expect("lm_head.weight", {V, H});
  // No 8-bit float may hide anywhere else (biases, norms of other families, stray tensors).
  for (const std::string& name : w.names()) {
    const DType dt = w.entry(name).dtype;
    const bool scale = name.size() > 13 && name.compare(name.size() - 13, 13, ".weight_scale") == 0;
    if (!is_fp8(dt) || scale) continue;
    const std::string module = name.size() > 7 ? name.substr(0, name.size() - 7) : name;
    if (!c.quantization || c.quantization->ignores(module) || !w.contains(module + ".weight_scale"))
      expect(name, w.entry(name).shape);  // throws the 8-bit float message
  }
}

// Dequantization at load: every FP8 Linear weight becomes bf16, w = round_bf16(fp8 * scale), so every
// forward of lessons 08-14 runs the checkpoint unchanged. The product of an fp8 value (4 significant
// bits) and a scale (at most 24) is exact in fp32 when the scale is BF16 or F16 and off by at most one
// fp32 rounding for an F32 scale; the one rounding that matters is the final one to bf16. The scales are
// consumed (erased). Lesson 16's FP8 GEMV reads the FP8 bytes directly instead.
void dequantize_fp8_weights(WeightStore& w, const ModelConfig& c) {
  if (!c.quantization) return;
  std::vector<std::string> modules;
  for (const std::string& name : w.names()) {
    const size_t n = name.size();
    if (n > 13 && name.compare(n - 13, 13, ".weight_scale") == 0) modules.push_back(name.substr(0, n - 13));
  }
  float decoded[256];  // every E4M3 code's value: a table lookup instead of a decode per weight
  for (int c = 0; c < 256; ++c) decoded[c] = fp8_e4m3_to_f32(static_cast<uint8_t>(c));
  for (const std::string& module : modules) {
    const std::string weight = module + ".weight", scale = module + ".weight_scale";
    if (!w.contains(weight) || w.entry(weight).dtype != DType::F8_E4M3) continue;  // checked above
    const TensorView q = w.host(weight);
    const TensorView s = w.host(scale);
    const int64_t rows = q.shape[0], cols = q.shape[1];
    const bool per_row = s.numel() == rows && rows > 1;
    HostBuffer out(static_cast<size_t>(rows * cols) * sizeof(uint16_t));
    uint16_t* o = out.as<uint16_t>();
    const uint8_t* codes = q.ptr<uint8_t>();
    for (int64_t r = 0; r < rows; ++r) {
      const float row_scale = load_as_f32(s.data, s.dtype, per_row ? static_cast<size_t>(r) : 0);
      for (int64_t k = 0; k < cols; ++k) {
        const size_t i = static_cast<size_t>(r * cols + k);
        o[i] = f32_to_bf16(decoded[codes[i]] * row_scale);
      }
    }
    w.replace_in_memory(weight, DType::BF16, q.shape, std::move(out));
    w.erase(scale);
  }
}

}  // namespace

ModelDir ModelDir::open(const fs::path& path, Fp8Load fp8) {
  std::error_code ec;
  if (!fs::exists(path, ec)) throw InputError(path.string() + ": no such directory");
  if (!fs::is_directory(path, ec)) throw InputError(path.string() + ": not a directory (expected a model directory)");
  if (!fs::exists(path / "config.json", ec))
    throw InputError(path.string() + ": no config.json (is this a Hugging Face model directory?)");
  ModelConfig config = load_model_config(path);
  WeightStore weights = WeightStore::open(path);
  check_weights_match_config(weights, config, path);
  const bool resident = fp8 == Fp8Load::Resident && config.quantization.has_value();
  if (!resident) dequantize_fp8_weights(weights, config);
  return ModelDir{path, std::move(config), std::move(weights), resident};
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
