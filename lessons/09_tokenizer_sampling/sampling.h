// Lesson 09, sampling: from a row of logits to the next token id.
//
//   temperature 0      greedy: the argmax (ties: the LOWEST id wins)
//   otherwise, in Hugging Face's order (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper):
//     z = logits / temperature
//     top-k  (k > 0)   keep the tokens whose z is >= the k-th largest z (ties with it are all kept)
//     top-p  (p < 1)   of those, keep the smallest set of most likely tokens whose probability sum
//                      reaches p (renormalised over the top-k survivors; the most likely token always stays;
//                      ties with the last kept token are all kept)
//     draw one of the kept tokens with probability proportional to exp(z - z_max)
//
// Reproducible: the draw for the token at position `step` of a request is decided by (seed, step) alone,
// through a counter-based generator (Philox-4x32-10, sampling_math.h). A request gets the same tokens
// alone or in any batch, on the CPU or the GPU: the CPU reference and the GPU kernel compute the same
// integers (sampling_math.h and SAMPLING.md say how), so they agree on every row, not just "usually".
//
// C++17: this header is included by sampling.cu.
#pragma once

#include <cuda_runtime.h>  // cudaStream_t

#include <cstdint>
#include <string>
#include <vector>

namespace tvllm {

// What a request asks for (the knobs of `tiny-vllm generate` and of the OpenAI API).
struct SamplingParams {
  float temperature = 1.0f;  // 0: greedy; otherwise > 0 and finite
  int top_k = 0;             // 0 or -1: off; otherwise keep the k most likely tokens (k >= vocab: off)
  float top_p = 1.0f;        // 1: off; otherwise in (0, 1)
  uint64_t seed = 0;         // the request's seed: with the step, it decides every draw
};

// InputError naming the field for: temperature < 0, NaN or inf; top_k < -1; top_p NaN or outside (0, 1].
void validate_sampling_params(const SamplingParams& params);
inline bool is_greedy(const SamplingParams& params) { return params.temperature == 0.0f; }

// One row's parameters as the GPU kernel reads them, from a device array [batch] the caller fills
// (make_sampling_row) and uploads with an async copy before each step: the kernel's arguments stay the
// same from step to step, so a captured CUDA graph replays it with new parameters. Plain data, 32 bytes.
struct SamplingRow {
  float temperature;  // 0: greedy
  int32_t top_k;      // <= 0: off
  float top_p;        // >= 1: off
  uint32_t reserved;  // 0
  uint64_t seed;
  uint64_t step;  // which token of the request this is (0 for the first generated token)
};
static_assert(sizeof(SamplingRow) == 32, "SamplingRow is uploaded as raw bytes");

// Validates params (InputError) and packs them with the step; top_k -1 becomes 0 (off).
SamplingRow make_sampling_row(const SamplingParams& params, uint64_t step);

// ---- the CPU reference (the oracle) -------------------------------------------------------------------

// The id of the largest logit; NaN counts as -inf; ties: the lowest id. vocab >= 1.
int32_t argmax_cpu(const float* logits, int64_t vocab);

// One token from one fp32 row of `vocab` logits (1 <= vocab <= 2^23). Greedy when row.temperature == 0.
int32_t sample_cpu(const float* logits, int64_t vocab, const SamplingRow& row);
inline int32_t sample_cpu(const std::vector<float>& logits, const SamplingParams& params, uint64_t step) {
  return sample_cpu(logits.data(), static_cast<int64_t>(logits.size()), make_sampling_row(params, step));
}

// What the sampler does to one row, for tests and the chapter: the integer mass of every token
// (0 for a token top-k or top-p removed), their sum, and the thresholds. Token i is drawn with probability
// mass[i] / kept_mass. (Greedy rows: not meaningful; the function requires temperature > 0.)
struct SamplingDistribution {
  std::vector<uint64_t> mass;  // [vocab]
  uint64_t kept_mass = 0;      // the sum of mass
  uint32_t top_k_key = 0;      // order_key of the k-th largest z (0 when top-k is off)
  uint32_t top_p_key = 0;      // order_key of the last kept z (0 when top-p is off)
  int64_t kept = 0;            // tokens with nonzero mass
};
SamplingDistribution sampling_distribution_cpu(const float* logits, int64_t vocab, const SamplingRow& row);

// ---- the GPU sampler ----------------------------------------------------------------------------------

// Samples a batch of rows on the GPU: one block per row; only the B ids are written (to device memory).
// The constructor does the one-time setup (limits, the kernel's shared-memory opt-in); sample() allocates
// nothing and never synchronises, so it may be captured in a CUDA graph. The kernel needs no global
// workspace: each row's state lives in its block's shared memory (64 KiB).
// What a generation loop needs of a GPU sampler (lessons 10 and 11 hold one): logits rows in, ids out, on a
// stream. Lesson 09's GpuSampler below is one; lesson 14 adds a faster one that picks the same ids.
class TokenSampler {
 public:
  virtual ~TokenSampler() = default;
  // logits: device fp32, row b at logits + b * row_stride, vocab <= row_stride; rows: device [batch]
  // SamplingRow; out_ids: device int32 [batch]. Queued on `stream`; returns without waiting (the caller
  // copies the ids back with cudaMemcpyAsync and waits on the stream when it needs them). Allocates nothing:
  // capturable in a CUDA graph.
  virtual void sample(const float* logits, int64_t row_stride, int64_t vocab, int batch, const SamplingRow* rows,
                      int32_t* out_ids, cudaStream_t stream = nullptr) const = 0;
};

class GpuSampler final : public TokenSampler {
 public:
  // max_batch >= 1 rows per call, 1 <= max_vocab <= 2^23 logits per row. InputError otherwise.
  GpuSampler(int max_batch, int64_t max_vocab);

  void sample(const float* logits, int64_t row_stride, int64_t vocab, int batch, const SamplingRow* rows,
              int32_t* out_ids, cudaStream_t stream = nullptr) const override;

  int max_batch() const { return max_batch_; }
  int64_t max_vocab() const { return max_vocab_; }

  static constexpr int kThreads = 512;  // per block (one row)

 private:
  int max_batch_;
  int64_t max_vocab_;
};

}  // namespace tvllm
