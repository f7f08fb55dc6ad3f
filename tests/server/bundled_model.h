// The bundled model as the server suites of lesson 13 load it, once per test program: its weights on the CPU,
// its tokenizer and chat template. Header-only (it needs lessons 01-09, which those suites link).
#pragma once

#include <optional>
#include <string>

#include "chat_template.h"
#include "model_dir.h"
#include "model_weights.h"
#include "tokenizer.h"

namespace tvllm::testing_http {

struct BundledServerModel {
  ModelDir dir = ModelDir::open(TVLLM_TINY_MODEL_DIR);
  Tokenizer tok = Tokenizer::from_file(std::string(TVLLM_TINY_MODEL_DIR) + "/tokenizer.json");
  std::optional<ChatTemplate> chat = ChatTemplate::from_model_dir(TVLLM_TINY_MODEL_DIR);
  ModelWeights weights = ModelWeights::bind(dir, Device::CPU);
};

inline BundledServerModel& model() {
  static BundledServerModel m;
  return m;
}

}  // namespace tvllm::testing_http
