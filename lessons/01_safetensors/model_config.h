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
  std::string model_type;               // "llama"
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

  int64_t q_dim() const { return num_attention_heads * head_dim; }    // width of q_proj's output
  int64_t kv_dim() const { return num_key_value_heads * head_dim; }   // width of k_proj's / v_proj's
  int64_t group_size() const { return num_attention_heads / num_key_value_heads; }
};

// Throws InputError naming the field for anything missing, mistyped or inconsistent.
ModelConfig parse_model_config(const nlohmann::json& j);
// Reads DIR/config.json (or the file itself).
ModelConfig load_model_config(const std::filesystem::path& dir_or_file);

}  // namespace tvllm
