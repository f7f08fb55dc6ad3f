// Lesson 11: the engine (engine.h): the inbox, the step loop, the token stream, the contiguous KV side.
#include "engine.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

#include "common/errors.h"
#include "common/exercise.h"

namespace tvllm {

// ---- configuration ---------------------------------------------------------------------------------------

EngineLimits EngineConfig::limits(const ModelConfig& config) const {
  TVLLM_REQUIRE(max_sequences >= 1, "engine: max_sequences must be >= 1, got " + std::to_string(max_sequences));
  TVLLM_REQUIRE(max_tokens_per_step >= max_sequences,
                "engine: max_tokens_per_step (" + std::to_string(max_tokens_per_step) + ") must be >= max_sequences (" +
                    std::to_string(max_sequences) + "): every running sequence decodes in every step");
  EngineLimits l;
  l.max_tokens = max_tokens_per_step;
  l.max_sequences = max_sequences;
  l.max_logits_rows = max_sequences;  // at most one sampled id per sequence per step
  l.max_context = max_context;
  return l.resolved(config);
}

// ---- the contiguous KV side -------------------------------------------------------------------------------

ContiguousKv::ContiguousKv(const ModelWeights& weights, const EngineLimits& limits, int64_t num_slots)
    : cache_(KvCache::for_model(weights.config, num_slots > 0 ? num_slots : limits.max_sequences, limits.max_context,
                                weights.device)),
      slots_(cache_.num_slots(), cache_.max_context()),
      attention_(cache_, limits) {}

void ContiguousKv::prepare(const ScheduledBatch& batch, cudaStream_t stream) { prepare_padded(batch, 0, stream); }

void ContiguousKv::prepare_padded(const ScheduledBatch& batch, int64_t pad_rows, cudaStream_t stream) {
  TVLLM_REQUIRE(pad_rows >= 0 && pad_rows <= slots_.free_slots(),
                "ContiguousKv: " + std::to_string(pad_rows) + " padding rows but " +
                    std::to_string(slots_.free_slots()) + " free slots");
  std::vector<int32_t> slots;
  slots.reserve(batch.seqs.size() + static_cast<size_t>(pad_rows));
  for (const ScheduledSequence& s : batch.seqs) slots.push_back(s.seq->kv_blocks.at(0));
  // Distinct free slots (CacheSlots refuses a slot twice): the padding row writes its position 0 there, a
  // position the slot's next owner writes (its prompt's first token) before anything reads it.
  for (int64_t i = 0; i < pad_rows; ++i) slots.push_back(slots_.free_slot(i));
  attention_.set_slots(slots, stream);
}

KvUsage ContiguousKv::usage() const {
  KvUsage u;
  u.kind = "contiguous";
  u.block_size = cache_.max_context();
  u.total_blocks = slots_.num_slots();
  u.free_blocks = slots_.free_slots();
  u.bytes = cache_.bytes();
  return u;
}

KvFactory contiguous_kv(int64_t num_slots) {
  return [num_slots](const ModelWeights& w, const EngineLimits& l) {
    return std::make_unique<ContiguousKv>(w, l, num_slots);
  };
}

// ---- the event queue --------------------------------------------------------------------------------------

TokenSink EventQueue::sink() {
  return [this](const EngineEvent& e) { push(e); };
}

void EventQueue::push(const EngineEvent& event) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    events_.push_back(event);
  }
  cv_.notify_all();
}

std::optional<EngineEvent> EventQueue::pop(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!cv_.wait_for(lock, timeout, [&] { return !events_.empty(); })) return std::nullopt;
  EngineEvent e = std::move(events_.front());
  events_.pop_front();
  return e;
}

std::optional<EngineEvent> EventQueue::try_pop() { return pop(std::chrono::milliseconds(0)); }

size_t EventQueue::size() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return events_.size();
}

// ---- the engine -------------------------------------------------------------------------------------------

namespace {

SchedulerConfig scheduler_config(const EngineConfig& config, const EngineLimits& limits, const ModelConfig& model) {
  SchedulerConfig s;
  s.max_tokens_per_step = limits.max_tokens;
  s.max_sequences = limits.max_sequences;
  s.max_context = limits.max_context;
  s.chunked_prefill = config.chunked_prefill;
  s.eos_ids = config.eos_ids;
  if (s.eos_ids.empty())
    for (int64_t id : model.eos_token_ids) s.eos_ids.push_back(static_cast<int32_t>(id));
  return s;
}

}  // namespace

Engine::Engine(const ModelWeights& weights, const EngineConfig& config, const KvFactory& make_kv)
    : weights_(weights),
      config_(config),
      limits_(config.limits(weights.config)),
      ctx_(weights.config, limits_, weights.device),
      step_(weights.config, limits_, weights.device),
      // The activation buffers first, the KV side last: a pool sized from the free memory sees them allocated.
      ids_device_(Tensor::empty({limits_.max_logits_rows}, DType::I32, weights.device)),
      ids_host_(static_cast<size_t>(2 * limits_.max_logits_rows) * sizeof(int32_t),
                weights.device == Device::CUDA ? HostBuffer::Kind::Pinned : HostBuffer::Kind::Pageable),
      rows_host_(static_cast<size_t>(limits_.max_logits_rows), make_sampling_row(SamplingParams{}, 0)),
      kv_(make_kv(weights, limits_)),
      scheduler_(scheduler_config(config, limits_, weights.config), kv_->allocator()) {
  if (weights.device == Device::CUDA) {  // a few KiB: the pool's margin covers them
    sampler_ = std::make_unique<GpuSampler>(static_cast<int>(limits_.max_logits_rows), weights.config.vocab_size);
    rows_device_ = DeviceBuffer(rows_host_.size() * sizeof(SamplingRow));
    rows_staging_ = HostBuffer(rows_host_.size() * sizeof(SamplingRow), HostBuffer::Kind::Pinned);
    TVLLM_CUDA_CHECK(cudaEventCreateWithFlags(&rows_copied_, cudaEventDisableTiming));
    if (config.async_scheduling) {  // lesson 14: the ids' copies and the pending-token pairs
      for (cudaEvent_t& e : ids_copied_) TVLLM_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      const size_t pairs = static_cast<size_t>(limits_.max_sequences) * sizeof(PendingToken);
      pending_device_ = DeviceBuffer(pairs);
      pending_staging_ = HostBuffer(pairs, HostBuffer::Kind::Pinned);
      TVLLM_CUDA_CHECK(cudaEventCreateWithFlags(&pending_copied_, cudaEventDisableTiming));
    }
  }
  if (config.batch_invariant) {
    ctx_.set_matmul_kernel(kBatchInvariantMatmulKernel);  // lesson 06: v8 (v7 where unpinned)
    kv_->set_decode_attention(DecodeAttention::Flash);
  }
  update_stats();
}

void Engine::set_sampler(std::unique_ptr<TokenSampler> sampler) {
  TVLLM_REQUIRE(weights_.device == Device::CUDA && sampler, "Engine::set_sampler: a GPU sampler, on CUDA");
  sampler_ = std::move(sampler);
}

Engine::~Engine() {
  if (weights_.device == Device::CUDA) cudaStreamSynchronize(ctx_.stream());  // nothing in flight reads our buffers
  if (rows_copied_) cudaEventDestroy(rows_copied_);
  for (cudaEvent_t e : ids_copied_)
    if (e) cudaEventDestroy(e);
  if (pending_copied_) cudaEventDestroy(pending_copied_);
}

// ---- any thread -------------------------------------------------------------------------------------------

int64_t Engine::submit(std::vector<int32_t> prompt, const RequestParams& params, TokenSink sink) {
  // Everything the scheduler would refuse, checked here on the caller's thread: a server answers 400 at once.
  // (Reads only what never changes after construction.)
  TVLLM_REQUIRE(static_cast<bool>(sink), "request: no token sink");
  TVLLM_REQUIRE(!prompt.empty(), "request: the prompt is empty");
  const int64_t vocab = weights_.config.vocab_size;
  for (size_t i = 0; i < prompt.size(); ++i)
    TVLLM_REQUIRE(prompt[i] >= 0 && prompt[i] < vocab, "request: prompt token " + std::to_string(i) + " is " +
                                                           std::to_string(prompt[i]) +
                                                           ", outside the vocabulary [0, " + std::to_string(vocab) +
                                                           ")");
  const auto n = static_cast<int64_t>(prompt.size());
  TVLLM_REQUIRE(n < limits_.max_context, "request: the prompt has " + std::to_string(n) +
                                             " tokens, which leaves no room to generate within max_context " +
                                             std::to_string(limits_.max_context));
  TVLLM_REQUIRE(params.max_tokens >= 1, "request: max_tokens must be >= 1, got " + std::to_string(params.max_tokens));
  validate_sampling_params(params.sampling);
  const int64_t longest = std::min(n + params.max_tokens, limits_.max_context) - 1;
  TVLLM_REQUIRE(kv_->allocator().fits_alone(longest),
                "request: " + std::to_string(longest) + " tokens would never fit in the KV cache, even alone");
  int64_t id = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    id = next_request_id_++;
    inbox_.push_back(InboxItem{false, id, std::move(prompt), params, std::move(sink)});
    ++stats_.pending;
    ++stats_.requests_submitted;
  }
  work_cv_.notify_all();
  return id;
}

void Engine::abort(int64_t request_id) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    InboxItem item;
    item.is_abort = true;
    item.request_id = request_id;
    inbox_.push_back(std::move(item));
  }
  work_cv_.notify_all();
}

bool Engine::has_work() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return !inbox_.empty() || live_ > 0;
}

bool Engine::wait_for_work(std::chrono::milliseconds timeout) const {
  std::unique_lock<std::mutex> lock(mutex_);
  return work_cv_.wait_for(lock, timeout, [&] { return !inbox_.empty() || live_ > 0; });
}

EngineStats Engine::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

// ---- the engine thread ------------------------------------------------------------------------------------

bool Engine::deliver(Request& request, const EngineEvent& event) {
  try {
    request.sink(event);
    return true;
  } catch (...) {
    return false;  // the consumer is gone (a closed connection): the caller aborts the request
  }
}

void Engine::finish_request(int64_t request_id, const std::string& error) {
  const auto it = requests_.find(request_id);
  if (it == requests_.end()) return;
  std::unique_ptr<Sequence> seq = scheduler_.release(it->second.seq_id);
  EngineEvent e;
  e.kind = EngineEvent::Kind::Finished;
  e.request_id = request_id;
  if (seq) {
    e.reason = seq->finish_reason;
    e.usage = RequestUsage{seq->prompt_len(), static_cast<int64_t>(seq->output.size()), seq->num_cached_tokens};
  } else {
    e.reason = FinishReason::Error;
  }
  e.error = error;
  switch (e.reason) {
    case FinishReason::Stop: ++finished_stop_; break;
    case FinishReason::Length: ++finished_length_; break;
    case FinishReason::Abort: ++aborted_; break;
    default: ++failed_; break;
  }
  Request request = std::move(it->second);
  by_seq_.erase(request.seq_id);
  requests_.erase(it);
  deliver(request, e);  // the last event: a throwing sink changes nothing now
}

void Engine::deliver_tokens(const std::vector<TokenEvent>& events) {
  for (const TokenEvent& t : events) {
    const int64_t request_id = by_seq_.at(t.id);  // the sequence's request
    EngineEvent e;
    e.kind = EngineEvent::Kind::Token;
    e.request_id = request_id;
    e.token = t.token;
    ++generated_;
    if (!deliver(requests_.at(request_id), e)) {
      scheduler_.abort(t.id, FinishReason::Abort);  // the sink threw; a no-op if the step finished it already
      finish_request(request_id);
    } else if (t.finished) {
      finish_request(request_id);  // its Finished event (reason, usage); the sequence is released
    }
  }
}

void Engine::process_inbox() {
  std::vector<InboxItem> items;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    items.swap(inbox_);
    stats_.pending = 0;
  }
  for (InboxItem& item : items) {
    if (item.is_abort) {
      const auto it = requests_.find(item.request_id);
      if (it == requests_.end()) continue;  // unknown or already finished
      scheduler_.abort(it->second.seq_id, FinishReason::Abort);  // its KV cache is free from here on
      finish_request(item.request_id);
      continue;
    }
    Request request{-1, std::move(item.sink)};
    try {
      request.seq_id = scheduler_.add(std::move(item.prompt), item.params);
    } catch (const std::exception& e) {  // submit() checked everything the scheduler checks: not expected
      EngineEvent ev;
      ev.kind = EngineEvent::Kind::Finished;
      ev.request_id = item.request_id;
      ev.reason = FinishReason::Error;
      ev.error = e.what();
      ++failed_;
      deliver(request, ev);
      continue;
    }
    by_seq_[request.seq_id] = item.request_id;
    requests_.emplace(item.request_id, std::move(request));
  }
  update_stats();
}

void Engine::set_sampling(const std::vector<SamplingRow>& rows) {
  std::copy(rows.begin(), rows.end(), rows_host_.begin());
  if (weights_.device == Device::CUDA) {
    if (rows_pending_) TVLLM_CUDA_CHECK(cudaEventSynchronize(rows_copied_));  // the last copy has read staging
    std::copy(rows.begin(), rows.end(), rows_staging_.as<SamplingRow>());
    TVLLM_CUDA_CHECK(cudaMemcpyAsync(rows_device_.data(), rows_staging_.data(), rows.size() * sizeof(SamplingRow),
                                     cudaMemcpyHostToDevice, ctx_.stream()));
    TVLLM_CUDA_CHECK(cudaEventRecord(rows_copied_, ctx_.stream()));
    rows_pending_ = true;
  }
}

int64_t Engine::padding_for(const ScheduledBatch& batch) const {
  const StepLauncher* launcher = ctx_.launcher();
  const auto B = static_cast<int64_t>(batch.seqs.size());
  if (launcher == nullptr || B == 0) return 0;
  // A pure decode step: one token and one logits row per sequence, rows in token order (is_decode_step's shape).
  if (static_cast<int64_t>(batch.token_ids.size()) != B || static_cast<int64_t>(batch.logits_rows.size()) != B)
    return 0;
  for (int64_t i = 0; i < B; ++i)
    if (batch.q_lens[static_cast<size_t>(i)] != 1 || batch.logits_rows[static_cast<size_t>(i)] != i) return 0;
  const int64_t padded = std::min(launcher->padded_batch(B), limits_.max_sequences);
  const int64_t pad = padded - B;
  // The same answer for the graph runner and the pinned eager launcher (it depends on the batch and the KV
  // side's state only), so both run the same shapes.
  return pad > 0 && pad <= kv_->pad_capacity() ? pad : 0;
}

int64_t Engine::prepare_step(const ScheduledBatch& batch) {
  const cudaStream_t stream = ctx_.stream();
  // This step's tokens and lengths, the KV addressing, the sampling parameters: async copies into buffers
  // allocated once.
  const int64_t pad = padding_for(batch);
  std::vector<SamplingRow> rows;
  rows.reserve(batch.logits_rows.size() + static_cast<size_t>(pad));
  for (const ScheduledSequence& s : batch.seqs)
    if (s.wants_logits)  // the request's step = ids it has so far: a recomputed sequence draws the same ids
      rows.push_back(make_sampling_row(s.seq->params.sampling, s.seq->output.size()));
  const auto real_rows = static_cast<int64_t>(rows.size());
  // Async scheduling (lesson 14): ids the step in flight samples are filled in (on the device, after the copies).
  std::vector<int32_t> filled;
  if (!batch.pending_tokens.empty()) filled = token_ids_for(batch);
  const std::vector<int32_t>& token_ids = batch.pending_tokens.empty() ? batch.token_ids : filled;
  if (pad == 0) {
    step_.set(token_ids, batch.q_lens, batch.k_lens, batch.logits_rows, stream);
    kv_->prepare(batch, stream);
  } else {
    // Padding rows (lesson 14's graph buckets) after the real ones: token 0 at position 0 (k_len 1), a logits row
    // each (the graph's shape has B rows for B sequences), sampled greedily (the cheapest row) and never fetched:
    // fetch_ids reads the first real_rows ids only. Each real row's attention reads its own KV only, and each
    // GEMM row its own input, so the real rows do not see the padding.
    std::vector<int32_t> ids = token_ids, logits_rows = batch.logits_rows;
    std::vector<int64_t> q_lens = batch.q_lens, k_lens = batch.k_lens;
    const SamplingRow greedy = make_sampling_row(SamplingParams{0.0f, 0, 1.0f, 0}, 0);
    for (int64_t i = 0; i < pad; ++i) {
      ids.push_back(0);
      q_lens.push_back(1);
      k_lens.push_back(1);
      logits_rows.push_back(static_cast<int32_t>(logits_rows.size()));
      rows.push_back(greedy);
    }
    step_.set(ids, q_lens, k_lens, logits_rows, stream);
    kv_->prepare_padded(batch, pad, stream);
  }
  if (!rows.empty()) set_sampling(rows);
  if (!batch.pending_tokens.empty()) fill_pending_on_device(batch);
  return real_rows;
}

void Engine::launch_step() {
  const TensorView logits = forward(ctx_, weights_, step_, kv_->attention());
  const int64_t R = step_.num_logits_rows();
  if (R == 0) return;
  const int64_t V = logits.shape[1];
  int32_t* ids = ids_device_.view().ptr<int32_t>();
  if (weights_.device == Device::CUDA) {
    sampler_->sample(logits.ptr<const float>(), V, V, static_cast<int>(R), rows_device_.as<SamplingRow>(), ids,
                     ctx_.stream());
  } else {
    for (int64_t r = 0; r < R; ++r)
      ids[r] = sample_cpu(logits.ptr<const float>() + r * V, V, rows_host_[static_cast<size_t>(r)]);
  }
}

std::vector<int32_t> Engine::fetch_ids(int64_t n) {
  if (n == 0) return {};
  int32_t* host = ids_host_.as<int32_t>();
  if (weights_.device == Device::CUDA) {
    TVLLM_CUDA_CHECK(cudaMemcpyAsync(host, ids_device_.data(), static_cast<size_t>(n) * sizeof(int32_t),
                                     cudaMemcpyDeviceToHost, ctx_.stream()));
    ctx_.synchronize();   // the step's one synchronisation
    ctx_.check_tokens();  // we waited anyway: the embedding's out-of-vocabulary flag costs nothing more
  } else {
    std::memcpy(host, ids_device_.data(), static_cast<size_t>(n) * sizeof(int32_t));
  }
  return std::vector<int32_t>(host, host + n);
}

namespace {
double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}
}  // namespace

int64_t Engine::prepare_and_launch(const ScheduledBatch& batch) {
  auto t = std::chrono::steady_clock::now();
  const int64_t rows = prepare_step(batch);
  host_time_.prepare_s += seconds_since(t);
  t = std::chrono::steady_clock::now();
  ctx_.launch(step_, kv_->attention(), [this] { launch_step(); });  // eager, or a graph replay (lesson 14)
  host_time_.launch_s += seconds_since(t);
  return rows;
}

std::vector<int32_t> Engine::run_batch(const ScheduledBatch& batch) {
  const int64_t rows = prepare_and_launch(batch);
  const auto t = std::chrono::steady_clock::now();
  std::vector<int32_t> ids = fetch_ids(rows);  // prefill chunks only (no rows): nothing to wait for
  host_time_.wait_s += seconds_since(t);
  return ids;
}

void Engine::step() {
  if (config_.async_scheduling) return step_async();  // lesson 14: engine_async.cpp
  // --- exercise 11.3: the engine step -----------------------------------------------------------------------
  // Task: one step of the engine loop.
  //   1. process_inbox(): new requests join the scheduler, aborted ones leave it (their KV freed).
  //   2. scheduler_.schedule(); an empty batch: update_stats() and return.
  //   3. run_batch(batch) gives one id per logits row. If it throws (std::exception), every sequence of the
  //      batch that is not finished yet is aborted with FinishReason::Error (scheduler_.abort(seq id,
  //      FinishReason::Error): its KV returns to the pool) and its request finished with the error's message
  //      (finish_request(request id, e.what())); then update_stats() and return: the engine goes on.
  //   4. scheduler_.postprocess(batch, ids) gives one TokenEvent per new id; deliver_tokens() sends them (read
  //      it: each becomes a Token event for its request; a sink that throws aborts its request; a finished
  //      sequence's request gets its Finished event and is released).
  //   5. update_stats().
  // Hint: a sequence finished by postprocess has already given its KV back; finish_request only reports it.
  // Tests: Engine11.ConcurrentEqualsAloneWithContiguousSlots Engine11.ChunkedPrefillUnderASmallBudgetEqualsAlone
  // Tests: Engine11.WithoutChunkedPrefillEqualsAlone Engine11.TokensStreamInOrderThenOneFinishedWithUsage
  // Tests: Engine11.AbortFreesTheSlotAtOnce Engine11.AnErrorInAStepFailsItsRequestsAndReturnsTheirKv
  // Tests: Engine11.ASinkThatThrowsAbortsItsRequest Engine11.SubmitAndAbortFromOtherThreads Engine11Gpu.*
  // Tests: lesson11_continuous_batching.cpu
  // Needs: 11.1 11.2
  // --- solution ---
  process_inbox();
  const ScheduledBatch batch = scheduler_.schedule();
  if (batch.empty()) {
    update_stats();
    return;
  }
  std::vector<int32_t> ids;
  try {
    ids = run_batch(batch);
  } catch (const std::exception& e) {
    // Fail what this step was running; everything it held goes back to the pool.
    for (const ScheduledSequence& s : batch.seqs) {
      if (s.seq->is_finished()) continue;
      const int64_t seq_id = s.seq->id;
      scheduler_.abort(seq_id, FinishReason::Error);
      finish_request(by_seq_.at(seq_id), e.what());
    }
    update_stats();
    return;
  }
  deliver_tokens(scheduler_.postprocess(batch, ids));
  update_stats();
  // --- end of exercise 11.3 ---
}

int64_t Engine::run_until_idle(int64_t max_steps) {
  // What a step that did anything changes: the queues, or the tokens computed and generated. Here no other
  // thread submits or aborts, so after a step that changed none of them the next one will not either: the
  // engine is stuck (a KV slot that never came back, a sequence whose num_computed never advances). Fail
  // after a few such steps, in milliseconds, rather than spinning to max_steps.
  constexpr int64_t kStuckSteps = 100;
  const auto progress = [this] {
    int64_t tokens = 0;
    for (const Sequence* s : scheduler_.running()) tokens += s->num_computed + static_cast<int64_t>(s->output.size());
    for (const Sequence* s : scheduler_.waiting()) tokens += s->num_computed + static_cast<int64_t>(s->output.size());
    return std::array<int64_t, 3>{scheduler_.num_waiting(), scheduler_.num_running(), tokens};
  };
  int64_t steps = 0, idle = 0;
  while (has_work()) {
    if (steps == max_steps)
      throw std::logic_error("engine: still busy after " + std::to_string(max_steps) + " steps");
    const auto before = progress();
    step();
    ++steps;
    idle = progress() == before ? idle + 1 : 0;
    if (idle == kStuckSteps)
      throw std::logic_error("engine: stuck: " + std::to_string(kStuckSteps) + " steps in a row changed nothing (" +
                             std::to_string(scheduler_.num_waiting()) + " waiting, " +
                             std::to_string(scheduler_.num_running()) +
                             " running): a KV slot that was never freed, or a sequence that never advances?");
  }
  return steps;
}

std::vector<int64_t> Engine::warm_up_prefill_lengths() const {
  std::vector<int64_t> lengths;
  // Every power of two from 16: cuBLAS's heuristics may pick a different kernel between neighbouring powers, and
  // each is loaded lazily on its first call (lesson 14 measures what the first request of a new length pays).
  for (int64_t n = 16; n <= std::min(limits_.max_tokens, limits_.max_context - 2); n *= 2) lengths.push_back(n);
  return lengths;
}

int64_t Engine::warm_up(const std::vector<int64_t>& decode_batches, const std::vector<int64_t>& prefill_lengths) {
  if (has_work()) throw InputError("engine: warm_up() needs an idle engine (requests are in flight)");
  // Prompts shorter than a KV block (nothing stays in the prefix cache), their ids spread over the vocabulary.
  const int64_t vocab = weights_.config.vocab_size;
  const int64_t len = std::max<int64_t>(1, std::min<int64_t>({7, limits_.max_context - 2, limits_.max_tokens / 2}));
  std::vector<int32_t> prompt(static_cast<size_t>(len));
  for (size_t i = 0; i < prompt.size(); ++i)
    prompt[i] = static_cast<int32_t>((vocab / 2 + 7 * static_cast<int64_t>(i)) % vocab);
  RequestParams greedy;
  greedy.sampling.temperature = 0.0f;
  greedy.max_tokens = std::min<int64_t>(3, limits_.max_context - len);  // a prefill, then decode steps
  greedy.ignore_eos = true;
  RequestParams sampled = greedy;  // the sampler's other path: temperature, top-k and top-p
  sampled.sampling = SamplingParams{0.8f, 40, 0.9f, 1};
  const TokenSink ignore = [](const EngineEvent&) {};
  submit(prompt, greedy, ignore);
  if (limits_.max_sequences > 1) {
    std::reverse(prompt.begin(), prompt.end());
    submit(prompt, sampled, ignore);
  }
  int64_t steps = run_until_idle(1000);
  // Prefills of the given lengths, one at a time: cuBLAS picks a different kernel for each range of T, and on the GPU
  // each is loaded lazily on its first call (milliseconds, in the first real request's TTFT otherwise). Their ids
  // avoid the short prompts' (a prefix-cache hit would skip the work); their blocks may stay in the prefix cache:
  // cached blocks are free (KvUsage::free_blocks).
  const int64_t longest = std::min(limits_.max_tokens, limits_.max_context - 2);
  for (int64_t n : prefill_lengths) {
    if (n < 1 || n > longest) continue;
    std::vector<int32_t> long_prompt(static_cast<size_t>(n));
    for (size_t i = 0; i < long_prompt.size(); ++i)
      long_prompt[i] = static_cast<int32_t>((vocab / 5 + 13 * static_cast<int64_t>(i) + n) % vocab);
    RequestParams one = greedy;
    one.max_tokens = 1;
    submit(long_prompt, one, ignore);
    steps += run_until_idle(1000);
  }
  // B requests of one token each: the prefill step is itself decode-shaped (one new token per sequence), and the
  // next step decodes the B of them together.
  for (int64_t B : decode_batches) {
    if (B < 1 || B > limits_.max_sequences || limits_.max_context < 3) continue;
    RequestParams two = greedy;
    two.max_tokens = 2;
    for (int64_t b = 0; b < B; ++b) submit({static_cast<int32_t>((vocab / 3 + 11 * b) % vocab)}, two, ignore);
    steps += run_until_idle(1000);
  }
  // As if nothing had run: the counters start from here (the KV blocks are all back in the pool already).
  stats_base_ = scheduler_.stats();
  const KvUsage kv = kv_->usage();
  prefix_query_base_ = kv.prefix_query_tokens;
  prefix_hit_base_ = kv.prefix_hit_tokens;
  generated_ = finished_stop_ = finished_length_ = aborted_ = failed_ = peak_running_ = 0;
  host_time_ = {};
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.requests_submitted = 0;
  }
  update_stats();
  return steps;
}

void Engine::update_stats() {
  peak_running_ = std::max(peak_running_, scheduler_.num_running());
  const SchedulerStats& s = scheduler_.stats();
  KvUsage kv = kv_->usage();  // engine thread: the allocator is ours
  kv.prefix_query_tokens -= prefix_query_base_;
  kv.prefix_hit_tokens -= prefix_hit_base_;
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.waiting = scheduler_.num_waiting();
  stats_.running = scheduler_.num_running();
  stats_.peak_running = peak_running_;
  stats_.kv = kv;
  stats_.preemptions = s.preemptions - stats_base_.preemptions;
  stats_.steps = s.steps - stats_base_.steps;
  stats_.prepare_s = host_time_.prepare_s;
  stats_.launch_s = host_time_.launch_s;
  stats_.wait_s = host_time_.wait_s;
  stats_.prefill_tokens = s.prefill_tokens - stats_base_.prefill_tokens;
  stats_.decode_tokens = s.decode_tokens - stats_base_.decode_tokens;
  stats_.generated_tokens = generated_;
  stats_.finished_stop = finished_stop_;
  stats_.finished_length = finished_length_;
  stats_.aborted = aborted_;
  stats_.failed = failed_;
  live_ = scheduler_.num_waiting() + scheduler_.num_running() + (in_flight_ ? 1 : 0);
}

}  // namespace tvllm
