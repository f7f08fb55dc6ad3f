// Lesson 16: what FP8 weights cost in accuracy, measured on the bundled model's own text.
//
// Teacher forcing: feed a text's ids, one position at a time, and keep the logits that predict each next
// id. Then, for a candidate model (FP8 weights) against a reference (the bf16 original):
//   top-1 agreement   the fraction of positions where both models' argmax agree
//   perplexity        exp(mean over positions of -log p(actual next id)), for each model
//   logit error       max and rms of |candidate - reference| over every logit, beside rms(reference)
// The bundled model memorised weights/corpus (weights/README.md): there is no held-out text, so its
// perplexity is near 1 and measures how well each model recites, not how well it generalises. The
// comparison between the two models is what counts.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "common/device.h"
#include "common/tensor.h"
#include "model_dir.h"
#include "paged_kv.h"  // KvCacheDtype (the FP8 KV rows of the table)

namespace tvllm {

class Generator;  // lesson 10
struct ModelWeights;

// Teacher forcing with one model on one device: the weights are bound (uploaded) once, then logits() runs
// lesson 10's Generator for each text (prefill of ids[0], then one decode step per id). kv FP8: the same steps
// through lesson 12's PagedAttention over an FP8 pool (the Generator's contiguous cache has no FP8), with the
// checkpoint's k_scale / v_scale when it has them, else 1.0. kv BF16: the paged steps over a pool of the model's
// dtype, which give the Generator's logits bit for bit (tests/test_16_fp8_kv.cpp checks it: the FP8 rows differ
// from the bf16 one by the KV format only).
struct PagedKvRun;
class TeacherForcing {
 public:
  TeacherForcing(const ModelDir& model, Device device, int64_t max_ids, KvCacheDtype kv = KvCacheDtype::Auto);
  ~TeacherForcing();
  TeacherForcing(const TeacherForcing&) = delete;
  TeacherForcing& operator=(const TeacherForcing&) = delete;
  // Logits F32 [ids.size() - 1, vocab] on the host: row i predicts ids[i + 1] from ids[0..i].
  // 2 <= ids.size() <= max_ids.
  Tensor logits(const std::vector<int32_t>& ids);
  // CPU: from now on the logits come from the lm_head rounded through E4M3 with one scale per row (vocabulary
  // entry), decoded back to F32 (fp8_gemm.h's fake_quantize_activations: amax / 448 per row, round to nearest
  // even, saturating): what --fp8-lm-head's GEMV multiplies, up to the fp32 rounding of code x scale. The
  // embedding gather keeps the bf16 table (tied or not), as in the engine. InputError on CUDA.
  void simulate_fp8_lm_head();

 private:
  std::unique_ptr<ModelWeights> weights_;
  Tensor lm_head_fp8_;  // simulate_fp8_lm_head: the dequantized values, F32 [vocab, hidden]
  std::unique_ptr<Generator> generator_;
  std::unique_ptr<PagedKvRun> paged_;  // kv FP8
  int64_t max_ids_;
};

struct LogitsComparison {
  int64_t positions = 0;
  int64_t top1_agree = 0;          // positions where the argmaxes agree
  double reference_perplexity = 0;
  double candidate_perplexity = 0;
  double max_abs_error = 0;        // over every logit
  double rms_error = 0;
  double reference_rms = 0;
  double top1_agreement() const { return positions ? static_cast<double>(top1_agree) / positions : 0.0; }
};
// candidate, reference: host F32 [rows, vocab], rows predicting ids[1..rows].
LogitsComparison compare_logits(const TensorView& candidate, const TensorView& reference, const std::vector<int32_t>& ids);
// Adds b's counts and sums into a (perplexities recombined as geometric means weighted by positions).
void accumulate(LogitsComparison& a, const LogitsComparison& b);

// The texts of the measurement: the first `window` ids of each weights/corpus/*.txt, tokenized with the
// model's tokenizer.json (BOS first when the config has one), at most `max_windows` of them, in file order.
// A model without a tokenizer.json (the random real-shaped models of the GPU pass) gets `max_windows`
// windows of seeded random ids instead: no text, but the bf16-vs-FP8 comparison still means something.
std::vector<std::vector<int32_t>> corpus_windows(const std::filesystem::path& model_dir,
                                                 const std::filesystem::path& corpus_dir, int64_t window,
                                                 int64_t max_windows);
bool has_tokenizer(const std::filesystem::path& model_dir);

}  // namespace tvllm
