// config.json -> ModelConfig, one field at a time. Every error names the field and shows what was there:
//   config.json: num_key_value_heads must be a positive integer, got "8"
#include "model_config.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include <nlohmann/json.hpp>

#include "common/input_error.h"
#include "json_strict.h"
#include "safetensors.h"  // MappedFile

namespace tvllm {

using nlohmann::json;

namespace {

const std::string kWhere = "config.json: ";

// Sizes beyond int32 make no sense for a model and would overflow the int indexing of kernels.
constexpr int64_t kMaxDim = std::numeric_limits<int32_t>::max();

bool is_integer(const json& v) { return v.is_number_integer(); }  // signed or unsigned, never 2.0

int64_t positive_int(const json& v, const std::string& field) {
  int64_t x = 0;
  if (v.is_number_unsigned()) {
    uint64_t u = v.get<uint64_t>();
    x = u > uint64_t(kMaxDim) ? kMaxDim + 1 : static_cast<int64_t>(u);
  } else if (v.is_number_integer()) {
    x = v.get<int64_t>();
  } else {
    throw InputError(kWhere + field + " must be a positive integer, got " + json_snippet(v));
  }
  if (x <= 0) throw InputError(kWhere + field + " must be a positive integer, got " + json_snippet(v));
  if (x > kMaxDim)
    throw InputError(kWhere + field + " must be at most " + std::to_string(kMaxDim) + ", got " + json_snippet(v));
  return x;
}

int64_t required_positive_int(const json& j, const std::string& field) {
  if (!j.contains(field) || j[field].is_null()) throw InputError(kWhere + "missing required field \"" + field + "\"");
  return positive_int(j[field], field);
}

double positive_number(const json& v, const std::string& field) {
  if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() <= 0)
    throw InputError(kWhere + field + " must be a positive number, got " + json_snippet(v));
  return v.get<double>();
}

// A token id: a non-negative integer (it indexes the vocabulary; checked against vocab_size below).
int64_t token_id(const json& v, const std::string& field) {
  if (!is_integer(v) || (!v.is_number_unsigned() && v.get<int64_t>() < 0) ||
      (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(kMaxDim)))
    throw InputError(kWhere + field + " must be a non-negative integer token id, got " + json_snippet(v));
  return v.get<int64_t>();
}

const json* optional_field(const json& j, const char* field) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return nullptr;
  return &*it;
}

RopeScaling parse_rope_scaling(const json& rs, const std::string& name) {
  RopeScaling r;
  if (!rs.is_object()) throw InputError(kWhere + name + " must be null or an object, got " + json_snippet(rs));
  // "rope_type" is the current spelling; older configs say "type".
  const json* type = optional_field(rs, "rope_type");
  if (!type) type = optional_field(rs, "type");
  if (!type) throw InputError(kWhere + name + " has no \"rope_type\"");
  if (!type->is_string()) throw InputError(kWhere + name + ".rope_type must be a string, got " + json_snippet(*type));
  r.rope_type = type->get<std::string>();
  if (r.rope_type == "default") return r;
  if (r.rope_type != "llama3")
    throw InputError(kWhere + name + ".rope_type \"" + r.rope_type +
                     "\" is not supported (tiny-vllm implements \"default\" and \"llama3\")");
  auto need = [&](const char* f) -> const json& {
    const json* v = optional_field(rs, f);
    if (!v) throw InputError(kWhere + name + " (llama3) is missing \"" + f + "\"");
    return *v;
  };
  r.factor = positive_number(need("factor"), name + ".factor");
  r.low_freq_factor = positive_number(need("low_freq_factor"), name + ".low_freq_factor");
  r.high_freq_factor = positive_number(need("high_freq_factor"), name + ".high_freq_factor");
  r.original_max_position_embeddings =
      positive_int(need("original_max_position_embeddings"), name + ".original_max_position_embeddings");
  // The llama3 rule interpolates between the two wavelengths low/high; equal factors divide by zero.
  if (!(r.high_freq_factor > r.low_freq_factor))
    throw InputError(kWhere + name + ".high_freq_factor (" + json_snippet(need("high_freq_factor")) +
                     ") must be greater than low_freq_factor (" + json_snippet(need("low_freq_factor")) + ")");
  return r;
}

}  // namespace

ModelConfig parse_model_config(const json& j) {
  if (!j.is_object()) throw InputError(kWhere + "must be a JSON object, got " + json_snippet(j));
  ModelConfig c;

  // What kind of model: the Llama architecture and the families that differ from it only in a few places
  // recorded as data below (biases, q/k norms, a sliding window). Gemma, Phi, MoE models... differ in ways
  // that would silently give wrong answers, so they are refused by name.
  const json* mt = optional_field(j, "model_type");
  if (!mt) throw InputError(kWhere + "missing required field \"model_type\" (expected \"llama\")");
  if (!mt->is_string()) throw InputError(kWhere + "model_type must be a string, got " + json_snippet(*mt));
  c.model_type = mt->get<std::string>();
  const char* want_arch = c.model_type == "llama"     ? "LlamaForCausalLM"
                          : c.model_type == "qwen2"   ? "Qwen2ForCausalLM"
                          : c.model_type == "qwen3"   ? "Qwen3ForCausalLM"
                          : c.model_type == "mistral" ? "MistralForCausalLM"
                                                      : nullptr;
  if (!want_arch)
    throw InputError(kWhere + "model_type is \"" + c.model_type +
                     "\": tiny-vllm runs model_type \"llama\", \"qwen2\", \"qwen3\" and \"mistral\" only");
  if (const json* arch = optional_field(j, "architectures")) {
    bool ok = arch->is_array();
    bool causal_lm = false;
    if (ok)
      for (const json& a : *arch) {
        if (!a.is_string()) ok = false;
        else if (a.get_ref<const std::string&>() == want_arch) causal_lm = true;
      }
    if (!ok) throw InputError(kWhere + "architectures must be an array of strings, got " + json_snippet(*arch));
    if (!causal_lm)
      throw InputError(kWhere + "architectures is " + json_snippet(*arch) + ": expected \"" + want_arch +
                       "\" for model_type \"" + c.model_type + "\"");
  }
  // Mixture-of-experts configs (Qwen2-MoE, Mixtral, Qwen3-MoE) route each token through chosen experts.
  for (const char* moe : {"num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size"}) {
    if (const json* m = optional_field(j, moe)) {
      if (!(m->is_number_integer() && m->get<int64_t>() == 0))
        throw InputError(kWhere + moe + " is " + json_snippet(*m) +
                         ": mixture-of-experts models are not supported (dense models only)");
    }
  }

  // Quantized checkpoints: the compressed-tensors FP8 layout is read (lesson 16); every other method
  // (AWQ, GPTQ, bitsandbytes, ...) stores packed weights the forward cannot use and is refused by name.
  if (const json* qc = optional_field(j, "quantization_config")) c.quantization = parse_quantization_config(*qc);

  c.vocab_size = required_positive_int(j, "vocab_size");
  c.hidden_size = required_positive_int(j, "hidden_size");
  c.intermediate_size = required_positive_int(j, "intermediate_size");
  c.num_hidden_layers = required_positive_int(j, "num_hidden_layers");
  c.num_attention_heads = required_positive_int(j, "num_attention_heads");
  c.max_position_embeddings = required_positive_int(j, "max_position_embeddings");

  // Grouped-query attention: each KV head serves num_attention_heads / num_key_value_heads query heads.
  // Absent means one KV head per query head (plain multi-head attention), as in Hugging Face.
  if (const json* kv = optional_field(j, "num_key_value_heads")) c.num_key_value_heads = positive_int(*kv, "num_key_value_heads");
  else c.num_key_value_heads = c.num_attention_heads;
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    throw InputError(kWhere + "num_attention_heads (" + std::to_string(c.num_attention_heads) +
                     ") must be a multiple of num_key_value_heads (" + std::to_string(c.num_key_value_heads) + ")");

  // head_dim: given explicitly (then q_dim = heads * head_dim may differ from hidden_size), or derived.
  if (const json* hd = optional_field(j, "head_dim")) {
    c.head_dim = positive_int(*hd, "head_dim");
  } else {
    if (c.hidden_size % c.num_attention_heads != 0)
      throw InputError(kWhere + "head_dim is absent, so hidden_size (" + std::to_string(c.hidden_size) +
                       ") must be a multiple of num_attention_heads (" + std::to_string(c.num_attention_heads) + ")");
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  // RoPE rotates pairs of dimensions: an odd head_dim has a dimension without a partner.
  if (c.head_dim % 2 != 0)
    throw InputError(kWhere + "head_dim must be even (RoPE rotates pairs), got " + std::to_string(c.head_dim));
  if (c.q_dim() > kMaxDim)
    throw InputError(kWhere + "num_attention_heads * head_dim = " + std::to_string(c.q_dim()) + " is too large");

  // Activation and biases: Llama uses SiLU and no biases; anything else would compute a different model.
  if (const json* act = optional_field(j, "hidden_act")) {
    if (!act->is_string() || act->get<std::string>() != "silu")
      throw InputError(kWhere + "hidden_act must be \"silu\" for a Llama model, got " + json_snippet(*act));
  }
  auto flag = [&](const char* name) {
    const json* b = optional_field(j, name);
    if (!b) return false;
    if (!b->is_boolean()) throw InputError(kWhere + name + " must be true or false, got " + json_snippet(*b));
    return b->get<bool>();
  };
  // Biases. Llama: attention_bias puts a bias on q, k, v and o (LlamaAttention: bias=config.attention_bias on
  // all four projections), mlp_bias on gate, up and down. Qwen2 has q/k/v biases always and none on o
  // (Qwen2Attention: bias=True for q/k/v, bias=False for o_proj). Qwen3 follows Llama's attention_bias.
  if (c.model_type == "qwen2") {
    c.qkv_bias = true;
  } else if (c.model_type != "mistral") {
    c.qkv_bias = c.o_bias = flag("attention_bias");
  }
  if (c.model_type == "llama") c.mlp_bias = flag("mlp_bias");
  // Qwen3: RMSNorm over each head's head_dim of q and k, before RoPE (Qwen3Attention.q_norm / k_norm).
  c.qk_norm = c.model_type == "qwen3";
  // Sliding window. Qwen2/Qwen3 carry sliding_window but use it only with use_sliding_window true (false in
  // every released checkpoint); Mistral uses sliding_window whenever it is a number.
  if (c.model_type == "qwen2" || c.model_type == "qwen3") {
    if (flag("use_sliding_window"))
      throw InputError(kWhere + "use_sliding_window is true: tiny-vllm does not implement Qwen's per-layer "
                       "sliding window (every released checkpoint sets it false)");
  } else if (c.model_type == "mistral") {
    if (const json* sw = optional_field(j, "sliding_window")) c.sliding_window = positive_int(*sw, "sliding_window");
  }

  // HF LlamaConfig's default when absent.
  c.rms_norm_eps = 1e-6;
  if (const json* eps = optional_field(j, "rms_norm_eps")) c.rms_norm_eps = positive_number(*eps, "rms_norm_eps");

  // RoPE: transformers < 5 writes rope_theta + rope_scaling; transformers 5 writes one "rope_parameters"
  // object holding rope_theta and rope_type (+ the llama3 fields). Accept both spellings.
  if (const json* rp = optional_field(j, "rope_parameters")) {
    if (!rp->is_object()) throw InputError(kWhere + "rope_parameters must be an object, got " + json_snippet(*rp));
    c.rope_scaling = parse_rope_scaling(*rp, "rope_parameters");
    if (const json* th = optional_field(*rp, "rope_theta")) c.rope_theta = positive_number(*th, "rope_parameters.rope_theta");
  } else {
    if (const json* rs = optional_field(j, "rope_scaling")) c.rope_scaling = parse_rope_scaling(*rs, "rope_scaling");
  }
  if (const json* th = optional_field(j, "rope_theta")) c.rope_theta = positive_number(*th, "rope_theta");

  if (const json* tie = optional_field(j, "tie_word_embeddings")) {
    if (!tie->is_boolean()) throw InputError(kWhere + "tie_word_embeddings must be true or false, got " + json_snippet(*tie));
    c.tie_word_embeddings = tie->get<bool>();
  }

  if (const json* bos = optional_field(j, "bos_token_id")) c.bos_token_id = token_id(*bos, "bos_token_id");
  if (const json* eos = optional_field(j, "eos_token_id")) {
    if (eos->is_array()) {
      for (size_t i = 0; i < eos->size(); ++i)
        c.eos_token_ids.push_back(token_id((*eos)[i], "eos_token_id[" + std::to_string(i) + "]"));
    } else {
      c.eos_token_ids.push_back(token_id(*eos, "eos_token_id"));
    }
  }
  if (c.bos_token_id >= c.vocab_size)
    throw InputError(kWhere + "bos_token_id " + std::to_string(c.bos_token_id) + " is outside the vocabulary (vocab_size " +
                     std::to_string(c.vocab_size) + ")");
  for (int64_t id : c.eos_token_ids)
    if (id >= c.vocab_size)
      throw InputError(kWhere + "eos_token_id " + std::to_string(id) + " is outside the vocabulary (vocab_size " +
                       std::to_string(c.vocab_size) + ")");

  // Informative only ("torch_dtype" before transformers 5, "dtype" after).
  for (const char* f : {"torch_dtype", "dtype"}) {
    if (const json* td = optional_field(j, f)) {
      if (!td->is_string()) throw InputError(kWhere + f + " must be a string, got " + json_snippet(*td));
      if (c.torch_dtype.empty()) c.torch_dtype = td->get<std::string>();
    }
  }
  return c;
}

namespace {

json read_json_file(const std::filesystem::path& file) {
  MappedFile mapped(file);
  std::string_view text(reinterpret_cast<const char*>(mapped.data()), mapped.size());
  return parse_json_strict(text, file.string());
}

// generation_config.json's eos_token_id (one id or a list) joins config.json's: transformers' generate() stops
// at the generation config's ids (Qwen2.5's config.json names <|endoftext|> only, its generation_config.json
// adds <|im_end|>, the end of an assistant turn), so an engine that read config.json alone would run past it.
void add_generation_eos(ModelConfig& c, const std::filesystem::path& file) {
  const json j = read_json_file(file);
  const std::string where = file.string() + ": ";
  if (!j.is_object()) throw InputError(where + "expected a JSON object");
  const json* eos = optional_field(j, "eos_token_id");
  if (eos == nullptr) return;
  std::vector<int64_t> ids;
  try {
    if (eos->is_array()) {
      for (size_t i = 0; i < eos->size(); ++i) ids.push_back(token_id((*eos)[i], "eos_token_id[" + std::to_string(i) + "]"));
    } else {
      ids.push_back(token_id(*eos, "eos_token_id"));
    }
  } catch (const InputError& e) {
    std::string message = e.what();  // token_id names config.json: this is the other file
    if (message.rfind(kWhere, 0) == 0) message.erase(0, kWhere.size());
    throw InputError(where + message);
  }
  for (int64_t id : ids) {
    if (id >= c.vocab_size)
      throw InputError(where + "eos_token_id " + std::to_string(id) + " is outside the vocabulary (vocab_size " +
                       std::to_string(c.vocab_size) + ")");
    if (std::find(c.eos_token_ids.begin(), c.eos_token_ids.end(), id) == c.eos_token_ids.end())
      c.eos_token_ids.push_back(id);
  }
}

}  // namespace

ModelConfig load_model_config(const std::filesystem::path& dir_or_file) {
  std::error_code ec;
  const bool dir = std::filesystem::is_directory(dir_or_file, ec);
  std::filesystem::path file = dir ? dir_or_file / "config.json" : dir_or_file;
  if (!std::filesystem::exists(file, ec)) throw InputError(file.string() + ": no such file");
  const json j = read_json_file(file);
  ModelConfig c;
  try {
    c = parse_model_config(j);
  } catch (const InputError& e) {
    // Keep "config.json: field ..." and say which file it was when it is not literally config.json.
    if (file.filename() == "config.json") throw InputError(file.parent_path().string() + "/" + e.what());
    throw InputError(file.string() + ": " + e.what());
  }
  const std::filesystem::path generation = file.parent_path() / "generation_config.json";
  if (std::filesystem::exists(generation, ec)) add_generation_eos(c, generation);
  return c;
}

}  // namespace tvllm
