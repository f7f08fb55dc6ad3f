// What lesson 14's GPU suites (the PDL check, the megakernel, and lesson 16's FP8 megakernel test) share:
// teacher-forced logits through a Generator's own launcher (so a GraphRunner captures and replays them), and a
// scope for the megakernel's process-wide consumer scheme. Header-only; the suites that include it link lesson 14.
#pragma once

#include <cstdint>
#include <vector>

#include "common/tensor.h"
#include "generate.h"
#include "megakernel.h"

namespace tvllm::testing {

// The logits of every position of prompt + forced ids, one step at a time through gen.context().launch (the
// launcher the fast path installed: graphs or eager), so the steps run exactly as generate() runs them, without
// a sampler. Row 0: the prompt's last position; row i: after forced[i - 1]. F32 [forced.size(), vocab] on the CPU.
inline Tensor forced_logits_launched(Generator& gen, const std::vector<int32_t>& prompt,
                                     const std::vector<int32_t>& forced) {
  const auto P = static_cast<int64_t>(prompt.size()), N = static_cast<int64_t>(forced.size());
  Tensor out = Tensor::empty({N, gen.weights().config.vocab_size}, DType::F32, Device::CPU);
  TensorView logits;  // the workspace's logits rows: set by the work when it runs (a replay does not call it)
  const auto run = [&](int64_t row) {
    gen.context().launch(gen.step(), gen.attention(), [&] { logits = gen.forward_step(); });
    gen.context().synchronize();
    copy_view(out.view().rows(row, 1), logits.rows(0, 1));
  };
  gen.set_step(prompt, {P}, {P}, {static_cast<int32_t>(P - 1)}, {0});
  run(0);
  for (int64_t i = 1; i < N; ++i) {
    gen.set_step({forced[static_cast<size_t>(i - 1)]}, {1}, {P + i}, {0}, {0});
    run(i);
  }
  return out;
}

// Sets the megakernel's process-wide consumer scheme (megakernel_prepare reads it) for a scope, then puts it back.
class MegakernelVariantScope {
 public:
  explicit MegakernelVariantScope(MegakernelVariant v) : saved_(megakernel_variant()) { set_megakernel_variant(v); }
  ~MegakernelVariantScope() { set_megakernel_variant(saved_); }
  MegakernelVariantScope(const MegakernelVariantScope&) = delete;
  MegakernelVariantScope& operator=(const MegakernelVariantScope&) = delete;

 private:
  MegakernelVariant saved_;
};

}  // namespace tvllm::testing
