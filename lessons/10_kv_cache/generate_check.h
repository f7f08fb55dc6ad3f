// Lesson 10: the reference continuations and how a generation is judged against them (shared by the lesson
// executable and the tests). README "What correct means" derives every rule.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "common/tensor.h"

namespace tvllm {

// One greedy continuation of Hugging Face's model.generate (reference/generate.safetensors + manifest.json).
struct ReferenceGeneration {
  std::string name;                 // "g0"
  std::string prompt;               // the prompt it continues: "p0" (its logits are in activations.safetensors)
  std::vector<int32_t> prompt_ids;
  std::vector<int32_t> output_ids;  // the new ids; ends with an EOS id when stopped_at_eos
  bool stopped_at_eos = false;
  double min_top1_margin = 0.0;     // the smallest top-1/top-2 logit gap over its generation steps
};

struct ReferenceGenerations {
  int64_t max_new_tokens = 0;
  std::vector<int64_t> eos_ids;
  std::vector<ReferenceGeneration> sequences;
};

// Reads MODEL_DIR/reference/generate.safetensors and the "generate" part of manifest.json. InputError when
// either is missing or malformed.
ReferenceGenerations read_reference_generations(const std::filesystem::path& model_dir);

// Teacher-forced agreement of logits (host F32 [N, vocab], row i predicting reference[i]) with the reference ids.
// At a step where argmax(logits) != reference id, the reference's own top-1 margin must have been a near-tie:
// if our logits are within `error_bound` of the reference's, then
//     ours[argmax] - ours[reference id] <= (ref[argmax] - ref[reference id]) + 2 * error_bound <= 2 * error_bound,
// so a larger gap is a real error (README "What correct means").
struct ForcedAgreement {
  int64_t steps = 0;
  int64_t agree = 0;
  int64_t near_ties = 0;             // disagreements within 2 * error_bound: allowed
  int64_t unexplained = 0;           // disagreements beyond it: a bug
  int64_t first_disagreement = -1;   // step of the first disagreement of either kind
  double max_gap = 0.0;              // the largest ours[argmax] - ours[reference id]
  bool pass() const { return unexplained == 0; }
  std::string summary() const;       // "agree 23/24, 1 near-tie (first at step 7, gap 0.012 <= 0.084)"
  double bound = 0.0;                // 2 * error_bound, for the summary
};
ForcedAgreement forced_agreement(const TensorView& logits, const std::vector<int32_t>& reference_ids,
                                 double error_bound);

// The first index where a and b differ (or the shorter length if one is a prefix of the other); -1 if equal.
int64_t first_difference(const std::vector<int32_t>& a, const std::vector<int32_t>& b);

// "[517 70 70 ...]" (at most `max` ids).
std::string ids_text(const std::vector<int32_t>& ids, size_t max = 12);

}  // namespace tvllm
