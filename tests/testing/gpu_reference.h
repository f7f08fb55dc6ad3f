// The bundled model's Hugging Face references and each generation's GPU logit bound (lesson 08's
// gpu_logit_bound: the bf16 floor of that prompt), loaded once per test program. Header-only: it needs lessons
// 08 and 10's headers, which only the suites that link them include.
#pragma once

#include <map>
#include <string>

#include "generate_check.h"
#include "logits_check.h"
#include "model_dir.h"
#include "testing/testing.h"

namespace tvllm::testing {

struct BundledReferences {
  ReferenceSet set = ReferenceSet::open(tiny_model_dir());
  ReferenceGenerations gens = read_reference_generations(tiny_model_dir());
  std::map<std::string, Bf16Floor> floors = read_bf16_floors(tiny_model_dir());
  // The GPU bound ε on a logit of generation g's prompt.
  double eps(const ReferenceGeneration& g) const {
    const Tensor logits = Tensor::copy_of(set.get(g.prompt + ".logits"), Device::CPU, DType::F32);
    return gpu_logit_bound(rms(logits.view()), find_floor(floors, g.name)).epsilon;
  }
};

inline const BundledReferences& bundled_references() {
  static const BundledReferences r;
  return r;
}

}  // namespace tvllm::testing
