// Lesson 01: config.json, field by field. Real configs parse to the right numbers; every malformed field is
// an InputError whose message names the field and shows what was there.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "common/errors.h"
#include "model_config.h"
#include "testing/safetensors_builder.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

using nlohmann::json;

// Llama 3.2 1B Instruct's config.json (the fields that matter; as published by Meta on Hugging Face).
json llama_3_2_1b() {
  return json::parse(R"({
    "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "head_dim": 64,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
    "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0", "use_cache": true, "vocab_size": 128256})");
}

// The bundled tiny model's shapes (conventions.md): q_dim 384 != hidden 320.
json tiny() {
  return json::parse(R"({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 320,
    "intermediate_size": 600, "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2,
    "head_dim": 64, "vocab_size": 1000, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "tie_word_embeddings": true, "bos_token_id": 1, "eos_token_id": 2,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 64}})");
}

void expect_rejected(const json& j, const std::string& needle) {
  try {
    parse_model_config(j);
    ADD_FAILURE() << "accepted: " << j.dump() << "\nexpected an error mentioning: " << needle;
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "message: " << e.what() << "\nexpected it to mention: " << needle;
  }
}

TEST(ModelConfig, ParsesLlama32_1B) {
  ModelConfig c = parse_model_config(llama_3_2_1b());
  EXPECT_EQ(c.model_type, "llama");
  EXPECT_EQ(c.vocab_size, 128256);
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(c.intermediate_size, 8192);
  EXPECT_EQ(c.num_hidden_layers, 16);
  EXPECT_EQ(c.num_attention_heads, 32);
  EXPECT_EQ(c.num_key_value_heads, 8);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.q_dim(), 2048);
  EXPECT_EQ(c.kv_dim(), 512);
  EXPECT_EQ(c.group_size(), 4);
  EXPECT_EQ(c.max_position_embeddings, 131072);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_DOUBLE_EQ(c.rope_theta, 500000.0);
  EXPECT_EQ(c.rope_scaling.rope_type, "llama3");
  EXPECT_DOUBLE_EQ(c.rope_scaling.factor, 32.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling.low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.bos_token_id, 128000);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{128001, 128008, 128009}));
  EXPECT_EQ(c.torch_dtype, "bfloat16");
}

TEST(ModelConfig, ParsesTinyModelWhereQDimDiffersFromHidden) {
  ModelConfig c = parse_model_config(tiny());
  EXPECT_EQ(c.hidden_size, 320);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.q_dim(), 384);
  EXPECT_EQ(c.kv_dim(), 128);
  EXPECT_EQ(c.group_size(), 3);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{2}));  // a single id becomes a list of one
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 64);
}

TEST(ModelConfig, DefaultsFollowHuggingFace) {
  json j = tiny();
  for (const char* f : {"num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
                        "tie_word_embeddings", "bos_token_id", "eos_token_id"})
    j.erase(f);
  j["hidden_size"] = 384;  // head_dim absent: derived as hidden / heads = 64
  ModelConfig c = parse_model_config(j);
  EXPECT_EQ(c.num_key_value_heads, 6);  // absent: one KV head per query head
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_EQ(c.rope_scaling.rope_type, "default");
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.bos_token_id, -1);
  EXPECT_TRUE(c.eos_token_ids.empty());
  // null means absent too
  j["head_dim"] = nullptr;
  j["rope_scaling"] = nullptr;
  EXPECT_EQ(parse_model_config(j).head_dim, 64);
}

TEST(ModelConfig, AcceptsTransformers5RopeParameters) {
  json j = tiny();
  j.erase("rope_scaling");
  j.erase("rope_theta");
  j["rope_parameters"] = json::parse(R"({"rope_type": "llama3", "rope_theta": 250000.0, "factor": 8.0,
      "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64})");
  ModelConfig c = parse_model_config(j);
  EXPECT_DOUBLE_EQ(c.rope_theta, 250000.0);
  EXPECT_EQ(c.rope_scaling.rope_type, "llama3");
  EXPECT_DOUBLE_EQ(c.rope_scaling.factor, 8.0);
  j["rope_parameters"] = json::parse(R"({"rope_type": "default", "rope_theta": 10000.0})");
  EXPECT_EQ(parse_model_config(j).rope_scaling.rope_type, "default");
}

TEST(ModelConfig, TypeErrorsNameTheFieldAndTheValue) {
  json j = tiny();
  j["num_key_value_heads"] = "8";
  expect_rejected(j, "config.json: num_key_value_heads must be a positive integer, got \"8\"");
  j = tiny();
  j["hidden_size"] = 320.5;
  expect_rejected(j, "hidden_size must be a positive integer, got 320.5");
  j = tiny();
  j["vocab_size"] = true;
  expect_rejected(j, "vocab_size must be a positive integer, got true");
  j = tiny();
  j["num_hidden_layers"] = json::array({2});
  expect_rejected(j, "num_hidden_layers must be a positive integer, got [2]");
  j = tiny();
  j["rms_norm_eps"] = "1e-5";
  expect_rejected(j, "rms_norm_eps must be a positive number, got \"1e-5\"");
  j = tiny();
  j["tie_word_embeddings"] = 1;
  expect_rejected(j, "tie_word_embeddings must be true or false, got 1");
  j = tiny();
  j["rope_theta"] = -1;
  expect_rejected(j, "rope_theta must be a positive number, got -1");
}

TEST(ModelConfig, RejectsMissingRequiredFields) {
  for (const char* f : {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                        "max_position_embeddings"}) {
    json j = tiny();
    j.erase(f);
    expect_rejected(j, std::string("missing required field \"") + f + "\"");
  }
  json j = tiny();
  j.erase("model_type");
  expect_rejected(j, "missing required field \"model_type\"");
}

TEST(ModelConfig, RejectsZeroNegativeAndHugeSizes) {
  for (const char* f : {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                        "num_key_value_heads", "head_dim", "max_position_embeddings"}) {
    for (json bad : {json(0), json(-3)}) {
      json j = tiny();
      j[f] = bad;
      expect_rejected(j, std::string(f) + " must be a positive integer, got " + bad.dump());
    }
    json j = tiny();
    j[f] = uint64_t{1} << 40;
    expect_rejected(j, std::string(f) + " must be at most 2147483647");
  }
}

TEST(ModelConfig, RejectsInconsistentHeads) {
  json j = tiny();
  j["num_key_value_heads"] = 4;  // 6 % 4 != 0
  expect_rejected(j, "num_attention_heads (6) must be a multiple of num_key_value_heads (4)");
  j = tiny();
  j.erase("head_dim");  // 320 / 6 is not whole
  expect_rejected(j, "hidden_size (320) must be a multiple of num_attention_heads (6)");
  j = tiny();
  j["head_dim"] = 63;
  expect_rejected(j, "head_dim must be even");
  j = tiny();
  j["num_attention_heads"] = 65536;
  j["num_key_value_heads"] = 65536;
  j["head_dim"] = 65536;  // q_dim 2^32
  expect_rejected(j, "is too large");
}

TEST(ModelConfig, RejectsUnsupportedRope) {
  json j = tiny();
  j["rope_scaling"] = json::parse(R"({"rope_type": "yarn", "factor": 4.0})");
  expect_rejected(j, "rope_scaling.rope_type \"yarn\" is not supported");
  j["rope_scaling"] = json::parse(R"({"type": "linear", "factor": 4.0})");  // the older spelling
  expect_rejected(j, "rope_type \"linear\" is not supported");
  j["rope_scaling"] = "llama3";
  expect_rejected(j, "rope_scaling must be null or an object");
  j["rope_scaling"] = json::object({{"factor", 8.0}});
  expect_rejected(j, "has no \"rope_type\"");
  for (const char* f : {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}) {
    json k = tiny();
    k["rope_scaling"].erase(f);
    expect_rejected(k, std::string("is missing \"") + f + "\"");
  }
  j = tiny();
  j["rope_scaling"]["high_freq_factor"] = 1.0;  // equal to low: the interpolation divides by zero
  expect_rejected(j, "high_freq_factor (1.0) must be greater than low_freq_factor (1.0)");
  j = tiny();
  j["rope_scaling"]["factor"] = 0;
  expect_rejected(j, "rope_scaling.factor must be a positive number, got 0");
}

TEST(ModelConfig, RejectsOtherArchitectures) {
  json j = tiny();
  j["model_type"] = "gemma2";
  expect_rejected(j, "model_type is \"gemma2\"");
  j = tiny();
  j["architectures"] = json::array({"MistralForCausalLM"});
  expect_rejected(j, "expected \"LlamaForCausalLM\" for model_type \"llama\"");
  j["architectures"] = "LlamaForCausalLM";
  expect_rejected(j, "architectures must be an array of strings");
  j = tiny();
  j["hidden_act"] = "gelu";
  expect_rejected(j, "hidden_act must be \"silu\"");
  j = tiny();
  j["attention_bias"] = "yes";
  expect_rejected(j, "attention_bias must be true or false");
  j = tiny();
  j["mlp_bias"] = "no";
  expect_rejected(j, "mlp_bias must be true or false");
  j = tiny();
  j["num_local_experts"] = 8;  // Mixtral
  expect_rejected(j, "num_local_experts is 8: mixture-of-experts");
  j = tiny();
  j["num_experts"] = 60;  // Qwen2-MoE
  expect_rejected(j, "num_experts is 60");
  j = tiny();
  j["rope_scaling"] = json::parse(R"({"rope_type": "yarn", "factor": 4.0})");
  expect_rejected(j, "rope_scaling.rope_type \"yarn\"");
}

// Qwen2.5-0.5B-Instruct's config.json (as published by Qwen on Hugging Face).
json qwen2_5_0_5b() {
  return json::parse(R"({
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
    "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 21, "model_type": "qwen2",
    "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1", "use_cache": true, "use_sliding_window": false, "vocab_size": 151936})");
}

// Qwen3-0.6B's config.json.
json qwen3_0_6b() {
  return json::parse(R"({
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
    "initializer_range": 0.02, "intermediate_size": 3072, "max_position_embeddings": 40960,
    "max_window_layers": 28, "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000,
    "sliding_window": null, "tie_word_embeddings": true, "torch_dtype": "bfloat16", "use_cache": true,
    "use_sliding_window": false, "vocab_size": 151936})");
}

// Mistral-7B-v0.1's config.json (the release with a 4096-position sliding window).
json mistral_7b_v0_1() {
  return json::parse(R"({
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
    "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": false,
    "torch_dtype": "bfloat16", "transformers_version": "4.34.0.dev0", "use_cache": true, "vocab_size": 32000})");
}

TEST(ModelConfig, ParsesQwen2AsBiasedQkv) {
  ModelConfig c = parse_model_config(qwen2_5_0_5b());
  EXPECT_EQ(c.model_type, "qwen2");
  EXPECT_EQ(c.head_dim, 64);  // 896 / 14
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e6);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_TRUE(c.qkv_bias);
  EXPECT_FALSE(c.o_bias);  // Qwen2Attention: o_proj has bias=False
  EXPECT_FALSE(c.mlp_bias);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_EQ(c.sliding_window, 0);  // sliding_window is there, but use_sliding_window is false
  EXPECT_TRUE(c.has_family_extras());
  json j = qwen2_5_0_5b();
  j["use_sliding_window"] = true;
  expect_rejected(j, "use_sliding_window is true");
  j["architectures"] = json::array({"LlamaForCausalLM"});
  expect_rejected(j, "expected \"Qwen2ForCausalLM\" for model_type \"qwen2\"");
}

TEST(ModelConfig, ParsesQwen3AsQkNormWithExplicitHeadDim) {
  ModelConfig c = parse_model_config(qwen3_0_6b());
  EXPECT_EQ(c.model_type, "qwen3");
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.q_dim(), 2048);  // q is wider than the residual stream (1024)
  EXPECT_EQ(c.kv_dim(), 1024);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e6);
  EXPECT_EQ(c.rope_scaling.rope_type, "default");
  EXPECT_TRUE(c.qk_norm);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_FALSE(c.o_bias);
  EXPECT_EQ(c.sliding_window, 0);
  json j = qwen3_0_6b();
  j["attention_bias"] = true;  // Qwen3Attention: bias=config.attention_bias on q, k, v and o
  c = parse_model_config(j);
  EXPECT_TRUE(c.qkv_bias);
  EXPECT_TRUE(c.o_bias);
  j = qwen3_0_6b();
  j["use_sliding_window"] = true;
  expect_rejected(j, "use_sliding_window is true");
}

TEST(ModelConfig, ParsesMistralSlidingWindow) {
  ModelConfig c = parse_model_config(mistral_7b_v0_1());
  EXPECT_EQ(c.model_type, "mistral");
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.sliding_window, 4096);
  EXPECT_FALSE(c.qkv_bias || c.o_bias || c.mlp_bias || c.qk_norm);
  EXPECT_TRUE(c.has_family_extras());
  json j = mistral_7b_v0_1();
  j["sliding_window"] = nullptr;  // Mistral 7B v0.2 / v0.3: no window
  c = parse_model_config(j);
  EXPECT_EQ(c.sliding_window, 0);
  EXPECT_FALSE(c.has_family_extras());  // then it is exactly a Llama
  j["head_dim"] = 160;  // Mistral NeMo: explicit head_dim, q_dim 5120 != hidden 4096
  EXPECT_EQ(parse_model_config(j).q_dim(), 5120);
  j["sliding_window"] = 0;
  expect_rejected(j, "sliding_window must be a positive integer");
  j["sliding_window"] = "4096";
  expect_rejected(j, "sliding_window must be a positive integer");
}

// Issue 18: what none of the families computes is refused with ONE message (one line) that names the field, for
// the configs users actually download, in both rope spellings (transformers < 5 and 5).
void expect_one_line_refusal(const json& j, const std::string& needle) {
  try {
    parse_model_config(j);
    ADD_FAILURE() << "accepted: " << j.dump() << "\nexpected an error mentioning: " << needle;
  } catch (const InputError& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind("config.json: ", 0), 0u) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    EXPECT_NE(msg.find(needle), std::string::npos) << "message: " << msg << "\nexpected it to mention: " << needle;
  }
}

TEST(ModelConfig, RefusesUnsupportedFamiliesNamingTheField) {
  // google/gemma-2-2b-it (abridged to the fields that matter): another model type, with soft-capping and GELU.
  expect_one_line_refusal(json::parse(R"({
    "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 2304, "intermediate_size": 9216, "max_position_embeddings": 8192, "num_attention_heads": 8,
    "num_hidden_layers": 26, "num_key_value_heads": 4, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0, "sliding_window": 4096, "vocab_size": 256000})"),
                          "model_type is \"gemma2\": tiny-vllm runs model_type \"llama\", \"qwen2\", \"qwen3\" "
                          "and \"mistral\" only");
  // mistralai/Mixtral-8x7B-v0.1 and Qwen/Qwen3-30B-A3B: MoE families of their own model_type.
  json mixtral = mistral_7b_v0_1();
  mixtral["model_type"] = "mixtral";
  mixtral["architectures"] = json::array({"MixtralForCausalLM"});
  mixtral["num_local_experts"] = 8;
  mixtral["num_experts_per_tok"] = 2;
  expect_one_line_refusal(mixtral, "model_type is \"mixtral\"");
  json qwen3_moe = qwen3_0_6b();
  qwen3_moe["model_type"] = "qwen3_moe";
  qwen3_moe["num_experts"] = 128;
  expect_one_line_refusal(qwen3_moe, "model_type is \"qwen3_moe\"");
  // Expert fields under a model_type we do run: refused by the field, never run as a dense model.
  json j = qwen3_0_6b();
  j["num_experts"] = 128;
  j["num_experts_per_tok"] = 8;
  j["moe_intermediate_size"] = 768;
  expect_one_line_refusal(j, "num_experts is 128: mixture-of-experts models are not supported");
  j = mistral_7b_v0_1();
  j["num_local_experts"] = 8;
  expect_one_line_refusal(j, "num_local_experts is 8");
  // Qwen2.5's documented long-context setting (YaRN), in both spellings, and other rope types.
  j = qwen2_5_0_5b();
  j["rope_scaling"] = json::parse(R"({"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"})");
  expect_one_line_refusal(
      j, "rope_scaling.rope_type \"yarn\" is not supported (tiny-vllm implements \"default\" and \"llama3\")");
  j = qwen3_0_6b();
  j.erase("rope_scaling");
  j.erase("rope_theta");
  j["rope_parameters"] = json::parse(R"({"rope_type": "yarn", "rope_theta": 1000000, "factor": 4.0})");
  expect_one_line_refusal(j, "rope_parameters.rope_type \"yarn\" is not supported");
  for (const char* type : {"linear", "dynamic", "longrope"}) {
    j = mistral_7b_v0_1();
    j["rope_scaling"] = {{"rope_type", type}, {"factor", 2.0}};
    expect_one_line_refusal(j, std::string("rope_scaling.rope_type \"") + type + "\" is not supported");
  }
  // A quantized checkpoint of a supported family (Qwen/Qwen2.5-0.5B-Instruct-AWQ).
  j = qwen2_5_0_5b();
  j["quantization_config"] = json::parse(R"({"bits": 4, "group_size": 128, "quant_method": "awq", "version": "gemm"})");
  expect_one_line_refusal(j, "quantization_config.quant_method is \"awq\": quantized checkpoints are supported only as "
                             "compressed-tensors FP8");
}

TEST(ModelConfig, ParsesLlamaBiases) {
  json j = tiny();
  EXPECT_FALSE(parse_model_config(j).has_family_extras());
  j["attention_bias"] = true;  // LlamaAttention: bias=config.attention_bias on q, k, v and o
  ModelConfig c = parse_model_config(j);
  EXPECT_TRUE(c.qkv_bias);
  EXPECT_TRUE(c.o_bias);
  EXPECT_FALSE(c.mlp_bias);
  j["attention_bias"] = false;
  j["mlp_bias"] = true;  // LlamaMLP: bias=config.mlp_bias on gate, up and down
  c = parse_model_config(j);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_TRUE(c.mlp_bias);
  EXPECT_TRUE(c.has_family_extras());
}

TEST(ModelConfig, RejectsBadTokenIds) {
  json j = tiny();
  j["eos_token_id"] = json::array({2, "3"});
  expect_rejected(j, "eos_token_id[1] must be a non-negative integer token id, got \"3\"");
  j["eos_token_id"] = -1;
  expect_rejected(j, "eos_token_id must be a non-negative integer token id, got -1");
  j["eos_token_id"] = 1000;  // vocab_size 1000: ids are 0..999
  expect_rejected(j, "eos_token_id 1000 is outside the vocabulary");
  j = tiny();
  j["bos_token_id"] = 5000;
  expect_rejected(j, "bos_token_id 5000 is outside the vocabulary");
}

TEST(ModelConfig, RejectsNonObject) {
  expect_rejected(json::array(), "must be a JSON object");
  expect_rejected(json("config"), "must be a JSON object");
}

// generation_config.json's eos ids join config.json's (transformers' generate stops at them: Qwen2.5's
// <|im_end|> is only there); a bad one is refused naming that file.
TEST(ModelConfig, GenerationConfigAddsItsEosIds) {
  testing::TempDir dir;
  testing::write_file(dir / "config.json", tiny().dump(2));
  EXPECT_EQ(load_model_config(dir.path()).eos_token_ids, (std::vector<int64_t>{2}));
  testing::write_file(dir / "generation_config.json", std::string(R"({"eos_token_id": [7, 2], "do_sample": true})"));
  EXPECT_EQ(load_model_config(dir.path()).eos_token_ids, (std::vector<int64_t>{2, 7}));
  testing::write_file(dir / "generation_config.json", std::string(R"({"eos_token_id": 9})"));
  EXPECT_EQ(load_model_config(dir.path()).eos_token_ids, (std::vector<int64_t>{2, 9}));
  testing::write_file(dir / "generation_config.json", std::string(R"({"temperature": 0.6})"));
  EXPECT_EQ(load_model_config(dir.path()).eos_token_ids, (std::vector<int64_t>{2}));
  for (const auto& [text, needle] : std::vector<std::pair<std::string, std::string>>{
           {R"({"eos_token_id": 5000})", "generation_config.json: eos_token_id 5000 is outside the vocabulary"},
           {R"({"eos_token_id": ["2"]})", "generation_config.json: eos_token_id[0] must be a non-negative integer"},
           {R"({"eos_token_id": -1})", "generation_config.json: eos_token_id must be a non-negative integer"},
           {R"({"eos_token_id": 2,)", "generation_config.json"},
           {R"([2])", "generation_config.json: expected a JSON object"}}) {
    testing::write_file(dir / "generation_config.json", text);
    try {
      load_model_config(dir.path());
      ADD_FAILURE() << "loaded with generation_config.json " << text;
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what() << "\nexpected: " << needle;
    }
  }
}

TEST(ModelConfig, LoadFromDirectoryAndFile) {
  testing::TempDir dir;
  testing::write_file(dir / "config.json", tiny().dump(2));
  EXPECT_EQ(load_model_config(dir.path()).hidden_size, 320);
  EXPECT_EQ(load_model_config(dir / "config.json").q_dim(), 384);

  auto expect_load_error = [](const std::filesystem::path& p, const std::string& needle) {
    try {
      load_model_config(p);
      ADD_FAILURE() << "loaded " << p;
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what() << "\nexpected: " << needle;
    }
  };
  testing::TempDir empty;
  expect_load_error(empty.path(), "config.json: no such file");
  testing::write_file(dir / "config.json", std::string("{\"hidden_size\": 320,"));
  expect_load_error(dir.path(), "not valid JSON");
  testing::write_file(dir / "config.json", std::string(R"({"hidden_size": 320, "hidden_size": 640})"));
  expect_load_error(dir.path(), "duplicate key \"hidden_size\"");
  json j = tiny();
  j["num_key_value_heads"] = "8";
  testing::write_file(dir / "config.json", j.dump());
  // the message keeps "config.json: field ..." and says which directory it came from
  expect_load_error(dir.path(), dir.path().string() + "/config.json: num_key_value_heads must be a positive integer");
}

}  // namespace
}  // namespace tvllm
