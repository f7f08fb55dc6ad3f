// Lesson 10: the generation loop (prefill, then one decode step per token) and teacher forcing.
#include "generate.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <numeric>
#include <string>

#include "common/errors.h"
#include "common/exercise.h"

namespace tvllm {

std::string_view stop_reason_name(StopReason reason) {
  switch (reason) {
    case StopReason::Eos: return "eos";
    case StopReason::MaxTokens: return "max_tokens";
    case StopReason::ContextFull: return "context_full";
  }
  return "?";
}

EngineLimits Generator::limits_for(const ModelConfig& config, int64_t max_context, int64_t max_sequences,
                                   int64_t max_prefill_tokens) {
  EngineLimits l;
  l.max_context = max_context;
  l.max_sequences = max_sequences;
  // A prefill step holds up to max_prefill_tokens tokens (all prompts together, or chunks of one); a decode
  // step one per sequence. Logits: one row per sequence.
  l.max_tokens = std::max(max_prefill_tokens > 0 ? max_prefill_tokens : max_context, max_sequences);
  l.max_logits_rows = max_sequences;
  return l.resolved(config);
}

Generator::Generator(const ModelWeights& weights, const EngineLimits& limits)
    : weights_(weights),
      limits_(limits.resolved(weights.config)),
      ctx_(weights.config, limits_, weights.device),
      step_(weights.config, limits_, weights.device),
      cache_(KvCache::for_model(weights.config, limits_.max_sequences, limits_.max_context, weights.device)),
      attention_(cache_, limits_) {
  TVLLM_REQUIRE(limits_.max_logits_rows >= limits_.max_sequences && limits_.max_tokens >= limits_.max_sequences,
                "Generator: a decode step needs a token and a logits row per sequence: max_tokens and "
                "max_logits_rows must be >= max_sequences (Generator::limits_for sets them)");
  const int64_t S = limits_.max_sequences;
  const HostBuffer::Kind host = weights.device == Device::CUDA ? HostBuffer::Kind::Pinned : HostBuffer::Kind::Pageable;
  ids_device_ = Tensor::empty({S}, DType::I32, weights.device);
  ids_host_ = HostBuffer(static_cast<size_t>(S) * sizeof(int32_t), host);
  rows_host_.assign(static_cast<size_t>(S), make_sampling_row(GenerateOptions{}.sampling, 0));
  if (weights.device == Device::CUDA) {
    sampler_ = std::make_unique<GpuSampler>(static_cast<int>(S), weights.config.vocab_size);
    rows_device_ = DeviceBuffer(static_cast<size_t>(S) * sizeof(SamplingRow));
    rows_staging_ = HostBuffer(static_cast<size_t>(S) * sizeof(SamplingRow), HostBuffer::Kind::Pinned);
    TVLLM_CUDA_CHECK(cudaEventCreateWithFlags(&rows_copied_, cudaEventDisableTiming));
    set_sampling(rows_host_);
  }
}

Generator::~Generator() {
  if (rows_copied_) {
    if (rows_pending_) cudaEventSynchronize(rows_copied_);  // the staging buffer outlives a copy reading it
    cudaEventDestroy(rows_copied_);
  }
}

// ---- the pieces ------------------------------------------------------------------------------------------

void Generator::set_batch_invariant(bool on) {
  ctx_.set_matmul_kernel(on ? kBatchInvariantMatmulKernel : kDefaultMatmulKernel);
  attention_.set_decode_attention(on ? DecodeAttention::Flash : DecodeAttention::Split);
}

void Generator::set_step(const std::vector<int32_t>& token_ids, const std::vector<int64_t>& q_lens,
                         const std::vector<int64_t>& k_lens, const std::vector<int32_t>& logits_rows,
                         const std::vector<int32_t>& slots) {
  step_.set(token_ids, q_lens, k_lens, logits_rows, ctx_.stream());
  attention_.set_slots(slots, ctx_.stream());
}

TensorView Generator::forward_step() { return forward(ctx_, weights_, step_, attention_); }

void Generator::set_sampler(std::unique_ptr<TokenSampler> sampler) {
  TVLLM_REQUIRE(ctx_.device() == Device::CUDA && sampler, "Generator::set_sampler: a GPU sampler, on CUDA");
  sampler_ = std::move(sampler);
}

void Generator::set_sampling(const std::vector<SamplingRow>& rows) {
  TVLLM_REQUIRE(!rows.empty() && static_cast<int64_t>(rows.size()) <= limits_.max_sequences,
                "Generator: " + std::to_string(rows.size()) + " sampling rows for " +
                    std::to_string(limits_.max_sequences) + " sequences");
  std::copy(rows.begin(), rows.end(), rows_host_.begin());
  if (ctx_.device() == Device::CUDA) {
    if (rows_pending_) TVLLM_CUDA_CHECK(cudaEventSynchronize(rows_copied_));  // the last copy has read staging
    std::copy(rows.begin(), rows.end(), rows_staging_.as<SamplingRow>());
    TVLLM_CUDA_CHECK(cudaMemcpyAsync(rows_device_.data(), rows_staging_.data(), rows.size() * sizeof(SamplingRow),
                                     cudaMemcpyHostToDevice, ctx_.stream()));
    TVLLM_CUDA_CHECK(cudaEventRecord(rows_copied_, ctx_.stream()));
    rows_pending_ = true;
  }
}

void Generator::sample_async(const TensorView& logits, int64_t first) {
  const int64_t R = logits.shape[0], V = logits.shape[1];
  TVLLM_REQUIRE(logits.rank() == 2 && logits.dtype == DType::F32 && logits.is_contiguous(),
                "Generator: logits must be a contiguous F32 [rows, vocab] view, got " + logits.describe());
  TVLLM_REQUIRE(first >= 0 && first + R <= limits_.max_sequences, "Generator: sampling rows beyond the id buffer");
  int32_t* ids = ids_device_.view().ptr<int32_t>() + first;
  if (ctx_.device() == Device::CUDA) {
    sampler_->sample(logits.ptr<const float>(), V, V, static_cast<int>(R), rows_device_.as<SamplingRow>() + first,
                     ids, ctx_.stream());
  } else {
    for (int64_t r = 0; r < R; ++r)
      ids[r] = sample_cpu(logits.ptr<const float>() + r * V, V, rows_host_[static_cast<size_t>(first + r)]);
  }
}

void Generator::launch_step() {
  ctx_.launch(step_, attention_, [this] { sample_async(forward_step(), 0); });
}

std::vector<int32_t> Generator::fetch_ids(int64_t n) {
  int32_t* host = ids_host_.as<int32_t>();
  if (ctx_.device() == Device::CUDA) {
    TVLLM_CUDA_CHECK(cudaMemcpyAsync(host, ids_device_.data(), static_cast<size_t>(n) * sizeof(int32_t),
                                     cudaMemcpyDeviceToHost, ctx_.stream()));
    ctx_.synchronize();
    ctx_.check_tokens();  // we waited anyway: the embedding's out-of-vocabulary flag costs nothing more
  } else {
    std::memcpy(host, ids_device_.data(), static_cast<size_t>(n) * sizeof(int32_t));
  }
  return std::vector<int32_t>(host, host + n);
}

void Generator::prefill(const std::vector<std::vector<int32_t>>& prompts, const std::vector<int32_t>& slots) {
  int64_t total = 0;
  for (const auto& p : prompts) total += static_cast<int64_t>(p.size());
  if (total <= limits_.max_tokens) {
    // Every prompt in ONE step (varlen), the logits of each one's last token only.
    std::vector<int32_t> ids, rows;
    std::vector<int64_t> lengths;
    for (const auto& p : prompts) {
      ids.insert(ids.end(), p.begin(), p.end());
      lengths.push_back(static_cast<int64_t>(p.size()));
      rows.push_back(static_cast<int32_t>(ids.size()) - 1);
    }
    set_step(ids, lengths, lengths, rows, slots);
    launch_step();  // forward + the sampler into ids [0, B): sequence b's first new id in ids[b]
    return;
  }
  // Longer than one step holds: each prompt in chunks of max_tokens. A chunk's queries attend to the earlier
  // chunks through the cache (q_len < k_len: the flash kernel over the cache), and only the last chunk asks
  // for logits.
  for (size_t b = 0; b < prompts.size(); ++b) {
    const auto& p = prompts[b];
    const auto P = static_cast<int64_t>(p.size());
    for (int64_t done = 0; done < P; done += limits_.max_tokens) {
      const int64_t n = std::min(limits_.max_tokens, P - done);
      const bool last = done + n == P;
      set_step(std::vector<int32_t>(p.begin() + done, p.begin() + done + n), {n}, {done + n},
               last ? std::vector<int32_t>{static_cast<int32_t>(n - 1)} : std::vector<int32_t>{}, {slots[b]});
      const TensorView logits = forward_step();
      if (last) sample_async(logits, static_cast<int64_t>(b));
    }
  }
}

// ---- generation ------------------------------------------------------------------------------------------

std::vector<GenerateResult> Generator::generate(const std::vector<std::vector<int32_t>>& prompts,
                                                const GenerateOptions& options, const TokenCallback& on_token) {
  // Everything is checked before anything runs.
  const ModelConfig& c = weights_.config;
  const auto B = static_cast<int64_t>(prompts.size());
  TVLLM_REQUIRE(B >= 1, "generate: no prompt");
  TVLLM_REQUIRE(B <= limits_.max_sequences, "generate: " + std::to_string(B) + " prompts but the generator has " +
                                                std::to_string(limits_.max_sequences) + " cache slots (max_sequences)");
  TVLLM_REQUIRE(options.max_new_tokens >= 1,
                "generate: max_new_tokens must be >= 1, got " + std::to_string(options.max_new_tokens));
  for (int64_t b = 0; b < B; ++b) {
    const auto P = static_cast<int64_t>(prompts[b].size());
    TVLLM_REQUIRE(P >= 1, "generate: prompt " + std::to_string(b) + " is empty");
    TVLLM_REQUIRE(P < limits_.max_context,
                  "generate: prompt " + std::to_string(b) + " has " + std::to_string(P) +
                      " tokens, but the context holds " + std::to_string(limits_.max_context) +
                      " (prompt + new tokens <= max_context, and at least one new token)");
    for (int32_t id : prompts[b])
      TVLLM_REQUIRE(id >= 0 && id < c.vocab_size, "generate: prompt " + std::to_string(b) + " has token id " +
                                                      std::to_string(id) + ", outside the vocabulary [0, " +
                                                      std::to_string(c.vocab_size) + ")");
  }
  const std::vector<int64_t>& eos = options.eos_ids.empty() ? c.eos_token_ids : options.eos_ids;
  validate_sampling_params(options.sampling);  // InputError naming the field

  // --- exercise 10.5: the generation loop ---------------------------------------------------------------
  // Task: generate for the B prompts at once, sequence b in cache slot b (the contract; the loop is yours).
  //   results[b].ids are the ids sequence b gets alone (the tests compare with the bundled model's reference
  //   generations and with b run by itself): each sampled from its logits row with
  //   make_sampling_row(options.sampling, the ids b has so far). Every id reaches on_token(b, id) as soon as
  //   it is on the host, in order. Sequence b stops at the first of: an id in `eos` (unless
  //   options.ignore_eos; the id is kept), options.max_new_tokens ids, prompt + ids == max_context; a stopped
  //   sequence costs no more work. Fill results[b].ids, .stop, .prefill_ms (until the first ids are on the
  //   host), .decode_ms, .decode_steps (steps after the prefill).
  // Hint: one prefill for all prompts: set_sampling, prefill(prompts, slots), fetch_ids(B). One decode step:
  //   set_step(ids, q_lens, k_lens, logits_rows, slots) + set_sampling(rows) + launch_step() (forward +
  //   sampling, through the context's step launcher) + fetch_ids(n); a decode feeds one id at the next
  //   position (q_len 1).
  // Tests: KvCache.GreedyEqualsReference* KvCache.BatchEqualsAlone KvCache.StopsAt* KvCacheGpu.Generat*
  //   lesson10_kv_cache.cpu
  // Stub:
  //   (void)on_token;
  //   (void)eos;
  //   throw NotWrittenYet("10.5", "the generation loop");
  // --- solution ---
  using Clock = std::chrono::steady_clock;
  const auto ms_since = [](Clock::time_point t) {
    return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
  };
  const auto start = Clock::now();
  std::vector<GenerateResult> results(static_cast<size_t>(B));
  std::vector<int32_t> slots(static_cast<size_t>(B));
  std::iota(slots.begin(), slots.end(), 0);
  std::vector<int64_t> length(static_cast<size_t>(B));  // tokens of sequence b in the cache
  for (int64_t b = 0; b < B; ++b) length[b] = static_cast<int64_t>(prompts[b].size());

  // One new id for sequence b: keep it, stream it, and say whether the sequence goes on.
  const auto accept = [&](int64_t b, int32_t id) {
    GenerateResult& r = results[b];
    r.ids.push_back(id);
    if (on_token) on_token(static_cast<size_t>(b), id);
    const auto generated = static_cast<int64_t>(r.ids.size());
    if (!options.ignore_eos && std::find(eos.begin(), eos.end(), static_cast<int64_t>(id)) != eos.end()) {
      r.stop = StopReason::Eos;
    } else if (generated >= options.max_new_tokens) {
      r.stop = StopReason::MaxTokens;
    } else if (static_cast<int64_t>(prompts[b].size()) + generated >= limits_.max_context) {
      r.stop = StopReason::ContextFull;  // feeding this id would need position max_context
    } else {
      return true;
    }
    return false;
  };

  // Prefill: the whole prompts, one new id each (the request's step 0).
  set_sampling(std::vector<SamplingRow>(static_cast<size_t>(B), make_sampling_row(options.sampling, 0)));
  prefill(prompts, slots);
  const std::vector<int32_t> first = fetch_ids(B);
  const double prefill_ms = ms_since(start);
  std::vector<int64_t> running;  // sequences still generating, in batch order
  for (int64_t b = 0; b < B; ++b)
    if (accept(b, first[b])) running.push_back(b);

  // Decode: one token per running sequence per step.
  const auto decode_start = Clock::now();
  int64_t steps = 0;
  while (!running.empty()) {
    const auto n = static_cast<int64_t>(running.size());
    std::vector<int32_t> ids, rows, step_slots;
    std::vector<SamplingRow> sampling;
    std::vector<int64_t> q_lens(static_cast<size_t>(n), 1), k_lens;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t b = running[i];
      ids.push_back(results[b].ids.back());  // fed at position length[b]
      k_lens.push_back(length[b] + 1);
      rows.push_back(static_cast<int32_t>(i));
      step_slots.push_back(slots[b]);
      sampling.push_back(make_sampling_row(options.sampling, results[b].ids.size()));  // its step: ids so far
    }
    set_step(ids, q_lens, k_lens, rows, step_slots);
    set_sampling(sampling);
    launch_step();
    const std::vector<int32_t> next = fetch_ids(n);
    ++steps;
    std::vector<int64_t> still;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t b = running[i];
      ++length[b];
      if (accept(b, next[i])) still.push_back(b);
    }
    running.swap(still);
  }
  const double decode_ms = ms_since(decode_start);
  for (GenerateResult& r : results) {
    r.prefill_ms = prefill_ms;
    r.decode_ms = decode_ms;
    r.decode_steps = steps;
  }
  return results;
  // --- end of exercise 10.5 ---
}

GenerateResult Generator::generate(const std::vector<int32_t>& prompt, const GenerateOptions& options,
                                   const TokenCallback& on_token) {
  return std::move(generate(std::vector<std::vector<int32_t>>{prompt}, options, on_token).front());
}

// ---- teacher forcing -------------------------------------------------------------------------------------

Tensor Generator::forced_logits(const std::vector<int32_t>& prompt, const std::vector<int32_t>& forced) {
  const auto P = static_cast<int64_t>(prompt.size()), N = static_cast<int64_t>(forced.size());
  const int64_t V = weights_.config.vocab_size;
  TVLLM_REQUIRE(P >= 1 && N >= 1, "forced_logits: the prompt and the forced ids must not be empty");
  TVLLM_REQUIRE(P + N - 1 <= limits_.max_context,
                "forced_logits: prompt + forced ids (" + std::to_string(P + N - 1) + " fed) exceed max_context " +
                    std::to_string(limits_.max_context));
  Tensor out = Tensor::empty({N, V}, DType::F32, Device::CPU);
  const auto keep = [&](const TensorView& logits, int64_t i) {
    ctx_.synchronize();
    copy_view(out.view().rows(i, 1), logits.rows(0, 1));
  };
  // Prefill (chunked like prefill()): the logits of the prompt's last token predict forced[0].
  for (int64_t done = 0; done < P; done += limits_.max_tokens) {
    const int64_t n = std::min(limits_.max_tokens, P - done);
    const bool last = done + n == P;
    set_step(std::vector<int32_t>(prompt.begin() + done, prompt.begin() + done + n), {n}, {done + n},
             last ? std::vector<int32_t>{static_cast<int32_t>(n - 1)} : std::vector<int32_t>{}, {0});
    const TensorView logits = forward_step();
    if (last) keep(logits, 0);
  }
  // Decode: feed forced[i-1] at position P + i - 1; its logits predict forced[i].
  for (int64_t i = 1; i < N; ++i) {
    set_step({forced[i - 1]}, {1}, {P + i}, {0}, {0});
    keep(forward_step(), i);
  }
  ctx_.check_tokens();
  return out;
}

}  // namespace tvllm
