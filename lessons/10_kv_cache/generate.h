// Lesson 10: the generation loop.
//
//   prompt ids ──prefill──> first new id ──decode──> next id ──decode──> ... until a stop condition
//
// Prefill runs the whole prompt through forward() in one step (chunks of EngineLimits::max_tokens if it is
// longer), asking for the logits of its last token only; every layer stores the prompt's k, v in the cache.
// Each decode step then feeds ONE token per sequence (the one just chosen) at the next position: its k, v
// join the cache and its query attends over the whole row. The next id is chosen by lesson 09's sampler
// (greedy by default; temperature, top-k, top-p with a seed) on the logits' device: only the ids (4 bytes per
// sequence) come back to the host, never a logits row.
//
// A sequence stops at the first of: an EOS id (the config's eos list, unless ignore_eos), max_new_tokens new
// ids, or a full context (prompt + new ids == max_context: the last id could not be fed). Several independent
// prompts may be generated together, each in its own cache slot; a finished sequence leaves the batch.
// (Refilling its slot with a new request while the others run is continuous batching: lesson 11.)
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

#include "cached_attention.h"
#include "kv_cache.h"
#include "model_weights.h"
#include "sampling.h"
#include "transformer.h"

namespace tvllm {

struct GenerateOptions {
  int64_t max_new_tokens = 64;    // >= 1
  SamplingParams sampling{0.0f, 0, 1.0f, 0};  // lesson 09's knobs; temperature 0 (the default here): greedy
  std::vector<int64_t> eos_ids;   // empty: the config's eos_token_ids
  bool ignore_eos = false;        // generate through EOS ids (benchmarks)
};

enum class StopReason { Eos, MaxTokens, ContextFull };
std::string_view stop_reason_name(StopReason reason);  // "eos", "max_tokens", "context_full"

struct GenerateResult {
  std::vector<int32_t> ids;  // the new ids (an EOS that stopped it included, as Hugging Face does)
  StopReason stop = StopReason::MaxTokens;
  double prefill_ms = 0.0;   // from the call to the first new id on the host (time to first token)
  double decode_ms = 0.0;    // from then to the last id
  int64_t decode_steps = 0;  // forward() calls after the prefill (the batch's, shared by its sequences)
};

// Called with (sequence index in the batch, new id) as each id arrives on the host, in order.
using TokenCallback = std::function<void(size_t sequence, int32_t id)>;

class Generator {
 public:
  // EngineLimits for generation: contexts of up to max_context positions, up to max_sequences prompts at once
  // (one cache slot each), prefill steps of up to max_prefill_tokens (0: max_context) tokens.
  static EngineLimits limits_for(const ModelConfig& config, int64_t max_context, int64_t max_sequences = 1,
                                 int64_t max_prefill_tokens = 0);

  // Sizes everything once, on the weights' device: the execution context and step inputs for `limits`, and a
  // KV cache of limits.max_sequences slots x limits.max_context positions (InputError when it does not fit).
  Generator(const ModelWeights& weights, const EngineLimits& limits);
  ~Generator();
  Generator(const Generator&) = delete;
  Generator& operator=(const Generator&) = delete;

  // Generation for each prompt (every prompt with options.sampling; the draw of a sequence's i-th new id
  // depends only on (seed, i): a prompt gets the same ids alone or in a batch). InputError before anything
  // runs for: no prompt, more prompts than slots, an empty prompt, an id outside the vocabulary, a prompt that
  // leaves no room in the context (>= max_context tokens), max_new_tokens < 1, bad sampling parameters.
  std::vector<GenerateResult> generate(const std::vector<std::vector<int32_t>>& prompts, const GenerateOptions& options,
                                       const TokenCallback& on_token = {});
  GenerateResult generate(const std::vector<int32_t>& prompt, const GenerateOptions& options,
                          const TokenCallback& on_token = {});

  // Teacher forcing through the cache: prefill `prompt`, then feed forced[0], forced[1], ... one decode step
  // each. Row i of the result is the logits that predict forced[i] (from prompt + forced[0..i-1]): host F32
  // [forced.size(), vocab]. The last forced id is never fed.
  Tensor forced_logits(const std::vector<int32_t>& prompt, const std::vector<int32_t>& forced);

  // Batch invariance (lesson 11): lesson 06's kBatchInvariantMatmulKernel (v8, a cuBLASLt algorithm pinned per
  // weight shape; v7 where none is) for every projection and the flash kernel for every attention,
  // so that a prompt's ids are the same bits alone or beside others, here or in lesson 11's engine with
  // EngineConfig::batch_invariant. Off by default (cuBLAS and the split decode kernel: faster).
  void set_batch_invariant(bool on);

  // ---- the pieces the loop is made of (tests, benchmarks, graph capture) ----------------------------------
  // Host side of a step: StepInputs::set and CachedAttention::set_slots (async copies; not during a capture).
  void set_step(const std::vector<int32_t>& token_ids, const std::vector<int64_t>& q_lens,
                const std::vector<int64_t>& k_lens, const std::vector<int32_t>& logits_rows,
                const std::vector<int32_t>& slots);
  // The device side: forward() over the step just set. Queued on the stream; capturable.
  TensorView forward_step();
  // The sampling parameters of ids [0, rows.size()) (lesson 09's SamplingRow: params + the request's step):
  // one async copy (not during a capture).
  void set_sampling(const std::vector<SamplingRow>& rows);
  // Chooses an id for each logits row [0, R) into the device ids [first, first + R), with the sampling rows
  // [first, first + R). Queued on the stream (CUDA: lesson 09's GpuSampler); capturable.
  void sample_async(const TensorView& logits, int64_t first = 0);
  // One step's device work: forward_step() + sample_async() of its logits rows into ids [0, R), through the
  // context's step launcher (ExecContext::launch: eager by default; lesson 14 replays decode steps as CUDA
  // graphs). Queued on the stream.
  void launch_step();
  // Device ids I32 [max_sequences] (fixed address).
  TensorView device_ids() const { return ids_device_.view(); }
  // Copies device ids [0, n) to the host and waits for the stream: the step's one synchronisation.
  std::vector<int32_t> fetch_ids(int64_t n);

  // The GPU sampler the loop uses: lesson 09's GpuSampler unless replaced (lesson 14's faster one). CUDA only.
  void set_sampler(std::unique_ptr<TokenSampler> sampler);

  ExecContext& context() { return ctx_; }
  StepInputs& step() { return step_; }
  CachedAttention& attention() { return attention_; }
  const KvCache& cache() const { return cache_; }
  const ModelWeights& weights() const { return weights_; }
  const EngineLimits& limits() const { return limits_; }

 private:
  // Prefills prompts[b] into slot slots[b] and leaves each one's greedy next id in device ids [b].
  void prefill(const std::vector<std::vector<int32_t>>& prompts, const std::vector<int32_t>& slots);

  const ModelWeights& weights_;
  EngineLimits limits_;
  ExecContext ctx_;
  StepInputs step_;
  KvCache cache_;
  CachedAttention attention_;
  Tensor ids_device_;    // I32 [max_sequences] on the device: the chosen ids
  HostBuffer ids_host_;  // pinned on CUDA: where they come back
  std::unique_ptr<TokenSampler> sampler_;  // CUDA
  std::vector<SamplingRow> rows_host_;  // [max_sequences]: the CPU path reads these
  DeviceBuffer rows_device_;            // CUDA: SamplingRow [max_sequences]
  HostBuffer rows_staging_;             // pinned: the source of their async copy
  cudaEvent_t rows_copied_ = nullptr;   // recorded after each copy
  bool rows_pending_ = false;
};

}  // namespace tvllm
