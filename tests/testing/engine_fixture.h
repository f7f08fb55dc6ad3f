// What the engine suites of lessons 11 and 12 (CPU and GPU) share: the bundled model, bound once per test
// program and device, and an EngineConfig in one line. Header-only: it needs lesson 11's headers, which only
// those suites link (tvllm_testing itself links common/ alone).
#pragma once

#include <cstdint>

#include "engine.h"
#include "model_dir.h"
#include "model_weights.h"
#include "testing/testing.h"

namespace tvllm::testing {

// The weights borrow the mapped files (CPU) or are uploaded (GPU) once: every test of the program reuses them.
template <Device kDevice>
struct BundledModel {
  ModelDir model = ModelDir::open(tiny_model_dir());
  ModelWeights w = ModelWeights::bind(model, kDevice);
};
template <Device kDevice>
const BundledModel<kDevice>& bundled_model() {
  static const BundledModel<kDevice> b;
  return b;
}

inline EngineConfig engine_config(int64_t budget, int64_t max_sequences, int64_t max_context, bool chunked = true) {
  EngineConfig c;
  c.max_tokens_per_step = budget;
  c.max_sequences = max_sequences;
  c.max_context = max_context;
  c.chunked_prefill = chunked;
  return c;
}

}  // namespace tvllm::testing
