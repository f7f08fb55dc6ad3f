// config.json of a Llama-architecture Hugging Face model, validated field by field.
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace tvllm {

struct RopeScaling {
  std::string rope_type = "default";  // "default" (none) or "llama3"
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

// An FP8 checkpoint in the compressed-tensors "float-quantized" layout, as llm-compressor writes its
// FP8 and FP8-dynamic schemes (lesson 16 teaches it; `tiny-vllm quantize` writes it): every Linear layer
// but the ignored ones stores `<module>.weight` as F8_E4M3 and `<module>.weight_scale` (F32, BF16 or F16)
// with one scale per output row ("channel": shape [out, 1]) or one for the tensor ("tensor": [1] or []);
// the real weight is fp8 * scale. What the parser accepts is listed in quantization_config.cpp.
struct Fp8Quantization {
  enum class Strategy { Channel, Tensor };
  Strategy weight_strategy = Strategy::Channel;
  // input_activations {dynamic: true, strategy: "token"}: a runtime that multiplies in FP8 quantizes each
  // token's activations with its own absmax scale. Absent: weight-only FP8 ("W8A16").
  bool dynamic_token_activations = false;
  std::vector<std::string> ignore;  // module names left unquantized ("lm_head")

  bool ignores(const std::string& module) const;
};

struct ModelConfig {
  std::string model_type;               // "llama", "qwen2", "qwen3" or "mistral": the differences are the data below
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;              // the residual stream width
  int64_t intermediate_size = 0;        // the MLP width
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;      // < num_attention_heads: grouped-query attention
  int64_t head_dim = 0;                 // from the file, or hidden_size / num_attention_heads
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;           // Hugging Face LlamaConfig's default when absent
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  bool tie_word_embeddings = false;     // lm_head shares embed_tokens' matrix
  int64_t bos_token_id = -1;            // -1: none
  std::vector<int64_t> eos_token_ids;   // config.json may hold one id or a list
  std::string torch_dtype;              // "bfloat16", informative

  // Where the Llama-like families differ, as data (issue 18), never as a family switch in the forward:
  bool qkv_bias = false;                // q_proj/k_proj/v_proj carry a bias (Qwen2; Llama attention_bias)
  bool o_bias = false;                  // o_proj carries a bias (Llama / Qwen3 attention_bias only)
  bool mlp_bias = false;                // gate/up/down_proj carry a bias (Llama mlp_bias)
  bool qk_norm = false;                 // per-head RMSNorm of q and k before RoPE (Qwen3 q_norm / k_norm)
  int64_t sliding_window = 0;           // a position attends to the last W positions only; 0 = no window

  // config.json's quantization_config, when the checkpoint is a supported quantized one (lesson 16);
  // any other quantization_config is refused by parse_model_config.
  std::optional<Fp8Quantization> quantization;

  // True when the model needs something beyond plain Llama (bias, q/k norm, a window that can bite).
  bool has_family_extras() const {
    return qkv_bias || o_bias || mlp_bias || qk_norm || sliding_window > 0;
  }

  int64_t q_dim() const { return num_attention_heads * head_dim; }    // width of q_proj's output
  int64_t kv_dim() const { return num_key_value_heads * head_dim; }   // width of k_proj's / v_proj's
  int64_t group_size() const { return num_attention_heads / num_key_value_heads; }
};

// Throws InputError naming the field for anything missing, mistyped or inconsistent.
ModelConfig parse_model_config(const nlohmann::json& j);
// config.json's "quantization_config" object -> Fp8Quantization, or InputError naming the first field
// tiny-vllm does not support (quantization_config.cpp).
Fp8Quantization parse_quantization_config(const nlohmann::json& qc);
// Reads DIR/config.json (or the file itself).
ModelConfig load_model_config(const std::filesystem::path& dir_or_file);

}  // namespace tvllm
