// config.json of a Llama-architecture Hugging Face model, validated field by field.
#pragma once

#include <filesystem>
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
// Reads DIR/config.json (or the file itself).
ModelConfig load_model_config(const std::filesystem::path& dir_or_file);

}  // namespace tvllm
