// The tiny transformers-written models of the Llama-like families (tests/data/models/<family>/, made by
// weights/tools/make_family_models.py in fp32) and their reference.json: the prompt, transformers' greedy ids
// (model.generate, do_sample=False, no EOS stop) and the prompt's last-row logits (printed to 6 significant
// digits).
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "testing/testing.h"

namespace tvllm::testing {

// The families whose forward lesson 08 computes: all four (mistral's window is the attention shape's).
inline const std::vector<std::string>& computed_families() {
  static const std::vector<std::string> f{"qwen2", "qwen3", "mistral", "llama_bias"};
  return f;
}

inline std::filesystem::path family_model_dir(const std::string& family) {
  return test_data_dir() / "models" / family;
}

struct FamilyReference {
  std::vector<int32_t> prompt_ids;
  std::vector<int32_t> greedy_ids;
  std::vector<float> last_logits;  // [vocab]
};

inline FamilyReference read_family_reference(const std::string& family) {
  const std::filesystem::path p = family_model_dir(family) / "reference.json";
  std::ifstream in(p);
  if (!in) throw std::runtime_error(p.string() + ": cannot read");
  const nlohmann::json j = nlohmann::json::parse(in);
  return {j.at("prompt_ids").get<std::vector<int32_t>>(), j.at("greedy_ids").get<std::vector<int32_t>>(),
          j.at("last_logits").get<std::vector<float>>()};
}

}  // namespace tvllm::testing
