// Lesson 11: the engine. Many requests, one model, one step at a time.
//
//   any thread                          the engine thread: step(), again and again
//   ──────────                          ───────────────────────────────────────────────────────────────────────
//   submit(prompt, params, sink) ─┐     1. inbox     submits -> Scheduler::add, aborts -> Scheduler::abort
//   abort(id) ────────────────────┼──>  2. schedule  which tokens of which sequences run (a ScheduledBatch)
//                (mutex) inbox ───┘     3. inputs    StepInputs::set + the KV addressing (slots or block tables)
//                                       4. forward   lesson 08's forward() over the KV backend's attention
//   sink(event) <── token, token, ...   5. sample    the logits rows on the device; only the ids come back
//               <── finished + usage    6. postprocess: ids appended, stop conditions, KV freed; events out
//
// The engine owns everything a step needs, sized once from EngineConfig: the execution context (stream, cuBLAS,
// workspace), the StepInputs, the sampler and its per-row parameters, the KV side (an EngineKv: the allocator
// the scheduler asks, the attention backend forward() calls, and the per-step addressing) and the Scheduler.
// Two KV sides exist: ContiguousKv here (lesson 10's KvCache, one slot of max_context positions per sequence)
// and PagedKv in lesson 12 (a pool of blocks, block tables, prefix caching).
//
// Threads: submit(), abort(), has_work(), wait_for_work() and stats() may be called from any thread (the HTTP
// threads of lesson 13); they only touch a mutex-protected inbox and a statistics snapshot. step() runs on ONE
// thread (the engine loop); sinks are called on it, outside the lock, so a sink may submit or abort.
// Every step queues its GPU work on the context's stream and synchronises once, to read the sampled ids. Per
// step nothing is allocated on the device: a decode step stays capturable in a CUDA graph (lesson 14).
#pragma once

#include <cuda_runtime.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "cached_attention.h"
#include "kv_allocator.h"
#include "kv_cache.h"
#include "model_weights.h"
#include "sampling.h"
#include "scheduler.h"
#include "sequence.h"
#include "transformer.h"

namespace tvllm {

// ---- configuration ---------------------------------------------------------------------------------------

struct EngineConfig {
  int64_t max_tokens_per_step = 2048;  // the token budget of one step (>= max_sequences)
  int64_t max_sequences = 64;          // sequences running at once (and per step)
  int64_t max_context = 0;             // tokens per sequence, prompt + output; 0: max_position_embeddings
  bool chunked_prefill = true;
  // Batch invariance: every projection through lesson 06's kBatchInvariantMatmulKernel (v8: one cuBLASLt
  // algorithm pinned per weight shape; v7 where none is) and every attention through the flash kernel
  // (lesson 10's DecodeAttention::Flash), so that a request's tokens are the same bits whatever else the
  // engine is running (README "Batch invariance"). Off: cuBLAS and the split decode kernel, faster.
  bool batch_invariant = false;
  // Async scheduling (lesson 14, vLLM's --async-scheduling): the host schedules, prepares and launches step N + 1
  // while the GPU still runs step N, and reads step N's ids afterwards, so the GPU does not idle while the host
  // works between steps. The tokens are the same (a step's pending ids are filled in on the device); a request
  // that stops at EOS runs one decode more, whose row is dropped; finished sequences free their KV one step later.
  bool async_scheduling = false;
  std::vector<int32_t> eos_ids;  // empty: the model config's eos_token_ids

  // The forward step's limits: max_tokens_per_step tokens, max_sequences sequences and logits rows.
  EngineLimits limits(const ModelConfig& config) const;
};

// ---- the KV side ------------------------------------------------------------------------------------------

// How full the KV memory is, in blocks. A contiguous cache counts a slot as one block of max_context positions.
struct KvUsage {
  std::string kind;  // "contiguous" or "paged"
  int64_t block_size = 0;    // positions per block
  int64_t total_blocks = 0;  // in the pool (contiguous: slots)
  int64_t free_blocks = 0;   // a new allocation could take (paged: cached but unused prefix blocks included)
  int64_t prefix_query_tokens = 0, prefix_hit_tokens = 0;  // prefix cache (paged with prefix caching)
  size_t bytes = 0;  // the KV memory, all layers
  int64_t used_blocks() const { return total_blocks - free_blocks; }
};

// Where the KV cache lives and how a step addresses it: the allocator the scheduler asks, the attention backend
// forward() calls, and prepare(), which hands the backend this step's addressing (slots, or slot mapping and
// block tables) with async copies into buffers allocated once.
class EngineKv {
 public:
  virtual ~EngineKv() = default;
  virtual KvAllocator& allocator() = 0;
  virtual AttentionBackend& attention() = 0;
  virtual void prepare(const ScheduledBatch& batch, cudaStream_t stream) = 0;
  // Padded decode steps (lesson 14's graph buckets): the batch's addressing, then pad_rows more sequences of one
  // token each (k_len 1, position 0) whose keys and values go nowhere a live sequence reads. pad_capacity() is
  // how many such rows the KV side can address now (0: it cannot pad, the engine then launches the step as it
  // is). The default pads nothing.
  virtual int64_t pad_capacity() const { return 0; }
  virtual void prepare_padded(const ScheduledBatch& batch, int64_t pad_rows, cudaStream_t stream) {
    if (pad_rows != 0) throw std::logic_error("EngineKv: this KV side cannot pad a step");
    prepare(batch, stream);
  }
  // Which kernel attends decode steps (lesson 10's DecodeAttention): the engine sets Flash for batch invariance.
  virtual void set_decode_attention(DecodeAttention decode) = 0;
  virtual KvUsage usage() const = 0;
  virtual std::string describe() const = 0;
};

// Lesson 10's contiguous cache: num_slots slots of limits.max_context positions, one per running sequence.
class ContiguousKv final : public EngineKv {
 public:
  // num_slots 0: limits.max_sequences. InputError when the cache does not fit.
  ContiguousKv(const ModelWeights& weights, const EngineLimits& limits, int64_t num_slots = 0);
  KvAllocator& allocator() override { return slots_; }
  AttentionBackend& attention() override { return attention_; }
  // Sequence b of the batch uses the slot its allocation holds (seq->kv_blocks[0]).
  void prepare(const ScheduledBatch& batch, cudaStream_t stream) override;
  // A padding row takes a FREE slot: a slot no sequence holds is read only after its next owner writes it.
  int64_t pad_capacity() const override { return slots_.free_slots(); }
  void prepare_padded(const ScheduledBatch& batch, int64_t pad_rows, cudaStream_t stream) override;
  void set_decode_attention(DecodeAttention decode) override { attention_.set_decode_attention(decode); }
  KvUsage usage() const override;
  std::string describe() const override { return cache_.describe(); }

 private:
  KvCache cache_;
  SlotAllocator slots_;
  CachedAttention attention_;
};

// Builds the KV side once the engine's own buffers are allocated (a pool sized from the free memory must come
// after them).
using KvFactory = std::function<std::unique_ptr<EngineKv>(const ModelWeights&, const EngineLimits&)>;
KvFactory contiguous_kv(int64_t num_slots = 0);

// ---- the token stream -------------------------------------------------------------------------------------

struct RequestUsage {
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;  // ids generated (an EOS that stopped it included)
  int64_t cached_tokens = 0;      // prompt tokens its last admission found in the prefix cache
};

// What a sink receives: a Token for each new id, in order, then exactly one Finished. Error and Abort may come
// without any Token.
struct EngineEvent {
  enum class Kind { Token, Finished };
  Kind kind = Kind::Token;
  int64_t request_id = 0;
  int32_t token = -1;                        // Token
  FinishReason reason = FinishReason::None;  // Finished: Stop, Length, Abort or Error
  RequestUsage usage;                        // Finished
  std::string error;                         // Finished with Error: what went wrong
};
// Called on the engine thread, outside the engine's lock: it must not call step(), and should be quick (push to
// a queue, write to a socket buffer). If it throws, the request is aborted.
using TokenSink = std::function<void(const EngineEvent&)>;

// A thread-safe queue of events: sink() pushes, pop() waits. One per request (a server's handler thread) or one
// for many (the benchmark).
class EventQueue {
 public:
  TokenSink sink();
  void push(const EngineEvent& event);
  // The next event, waiting up to `timeout`; nullopt on timeout.
  std::optional<EngineEvent> pop(std::chrono::milliseconds timeout);
  std::optional<EngineEvent> try_pop();
  size_t size() const;

 private:
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<EngineEvent> events_;
};

// ---- statistics -------------------------------------------------------------------------------------------

struct EngineStats {
  int64_t pending = 0;  // submitted, not yet seen by the engine thread (the inbox)
  int64_t waiting = 0;  // in the scheduler's waiting queue (preempted ones included)
  int64_t running = 0;
  int64_t peak_running = 0;
  KvUsage kv;
  int64_t preemptions = 0;
  int64_t steps = 0;             // forward steps run
  int64_t prefill_tokens = 0;    // prompt (and recomputed) tokens fed
  int64_t decode_tokens = 0;     // tokens fed by decode steps
  int64_t generated_tokens = 0;  // ids delivered
  int64_t requests_submitted = 0;
  int64_t finished_stop = 0, finished_length = 0, aborted = 0, failed = 0;  // requests by outcome
  // Where the engine thread's time went in run_batch, summed over steps (steady clock, host side): preparing the
  // step's inputs, queueing its device work (eager launches, or a graph replay), and waiting for the GPU at the
  // step's one synchronisation. What a step spends outside them (scheduling, delivering tokens) is the rest of
  // its wall time. The GPU idles while the host prepares and schedules: lesson 14 measures how much.
  double prepare_s = 0.0, launch_s = 0.0, wait_s = 0.0;
};

// ---- the engine -------------------------------------------------------------------------------------------

class Engine {
 public:
  // Sizes everything once, on the weights' device. `weights` must outlive the engine. InputError for a bad
  // config (naming the field).
  Engine(const ModelWeights& weights, const EngineConfig& config, const KvFactory& make_kv = contiguous_kv());
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // ---- any thread ----
  // Queues a request and returns its id (in submission order). The request is checked here, at once
  // (InputError, nothing queued): a non-empty prompt of ids inside the vocabulary, shorter than max_context,
  // max_tokens >= 1, valid sampling parameters, a request that could fit in the KV cache alone, a sink.
  int64_t submit(std::vector<int32_t> prompt, const RequestParams& params, TokenSink sink);
  // Asks to stop a request. The engine thread frees its KV cache at the start of the next step (before
  // anything is scheduled: it never runs again) and sends Finished(Abort). Unknown or finished ids: nothing.
  void abort(int64_t request_id);
  // Whether a step would do anything: requests in the inbox or in the scheduler.
  bool has_work() const;
  // Waits until has_work() or `timeout` (the engine loop's idle wait). Returns has_work().
  bool wait_for_work(std::chrono::milliseconds timeout) const;
  // A snapshot, updated at the end of every step.
  EngineStats stats() const;

  // ---- the engine thread ----
  // One step: the inbox, schedule, forward, sample, postprocess, events. An error inside the step (a CUDA
  // failure, a bad input the checks missed) fails the requests of that step with Finished(Error); their KV
  // cache returns to the pool and the engine goes on. With async_scheduling, step_async().
  void step();
  // Async scheduling (lesson 14; engine_async.cpp): advance the step in flight, the inbox, schedule and launch
  // the next step, THEN wait for the one in flight's ids, resolve them and send their events. A failure fails
  // the requests of the step it belongs to (both steps for a failure while waiting: the stream is shared).
  void step_async();
  // Whether a step launched by step_async() has ids still to read (has_work() is true meanwhile).
  bool has_step_in_flight() const { return in_flight_.has_value(); }
  // The inbox part of step() alone (tests: an abort's effect without running a step).
  void process_inbox();
  // step() until has_work() is false; returns the steps run. std::logic_error after max_steps, or at once
  // when 100 steps in a row change nothing (a stuck engine fails in milliseconds, not after max_steps).
  int64_t run_until_idle(int64_t max_steps = 10000000);
  // Before serving (vLLM does the same at start): two short dummy requests, one greedy and one sampled, through
  // prefill and decode, so that the first real request does not pay the one-time costs (lazy CUDA module
  // loading, cuBLAS heuristics and workspace, first touch of host pages: on the H200 the first request's TTFT
  // was ~70x the median). Afterwards every KV block is free and stats() reads as if nothing had run. Engine
  // thread, with nothing in flight (InputError otherwise). Returns the steps it ran.
  // decode_batches (lesson 14): for each B, B one-token requests decode together, so that a step launcher that
  // captures a CUDA graph per batch size (lesson 14's graph runner) has the graph of B before the first user.
  // prefill_lengths: one prompt of each length, alone (each range of T has cuBLAS kernels of its own to load on
  // the GPU; warm_up_prefill_lengths() gives the usual ones). Lengths a step cannot hold are skipped.
  int64_t warm_up(const std::vector<int64_t>& decode_batches = {}, const std::vector<int64_t>& prefill_lengths = {});
  // 16, 32, 64, ...: the powers of 2 from 16 that one step of this engine holds.
  std::vector<int64_t> warm_up_prefill_lengths() const;

  // The pieces of a step (lesson 14's graph runner captures launch_step() of decode steps):
  //   prepare_step   host: StepInputs, the KV addressing, the sampling rows (async copies; never during a
  //                  capture). Returns the number of logits rows R.
  //   launch_step    device: forward() + the sampler into the id buffer. Allocates nothing, never waits:
  //                  capturable (CUDA).
  //   fetch_ids      ids [0, n) back to the host; waits for the stream (the step's one synchronisation).
  //                  A pure decode step may be padded to the launcher's bucket (StepLauncher::padded_batch):
  //                  R stays the batch's own rows; the step holds more.
  int64_t prepare_step(const ScheduledBatch& batch);
  // How many padding rows prepare_step adds to `batch` (lesson 14): padded_batch(B) - B for a pure decode step
  // when the launcher asks for more, the engine's limits allow it and the KV side can address them; else 0.
  int64_t padding_for(const ScheduledBatch& batch) const;
  // The last step's inputs as the launcher saw them (padding rows included): tests read their host copies.
  const StepInputs& step_inputs() const { return step_; }
  void launch_step();
  std::vector<int32_t> fetch_ids(int64_t n);

  // The GPU sampler: lesson 09's GpuSampler unless replaced (lesson 14's faster one). CUDA only.
  void set_sampler(std::unique_ptr<TokenSampler> sampler);

  const EngineLimits& limits() const { return limits_; }
  const EngineConfig& config() const { return config_; }
  const ModelWeights& weights() const { return weights_; }
  Device device() const { return weights_.device; }
  ExecContext& context() { return ctx_; }
  EngineKv& kv() { return *kv_; }
  Scheduler& scheduler() { return scheduler_; }  // engine thread only

 private:
  struct InboxItem {
    bool is_abort = false;
    int64_t request_id = 0;
    std::vector<int32_t> prompt;
    RequestParams params;
    TokenSink sink;
  };
  struct Request {
    int64_t seq_id = 0;
    TokenSink sink;
  };

  // prepare_step + launch_step + fetch_ids: one id per logits row.
  std::vector<int32_t> run_batch(const ScheduledBatch& batch);
  // prepare_step, then launch_step through the context's launcher; their host time in host_time_. Returns R.
  int64_t prepare_and_launch(const ScheduledBatch& batch);
  void set_sampling(const std::vector<SamplingRow>& rows);
  // Sends an event to a request's sink; false if the sink threw (the caller aborts the request).
  bool deliver(Request& request, const EngineEvent& event);
  // A Token event per new id (the scheduler's TokenEvents, in order); a sink that throws aborts its request; a
  // finished sequence's request gets its Finished event (finish_request).
  void deliver_tokens(const std::vector<TokenEvent>& events);
  // The request's sequence is finished: its Finished event, then it is forgotten.
  void finish_request(int64_t request_id, const std::string& error = {});
  void update_stats();

  // ---- async scheduling (engine_async.cpp) ----
  struct InFlight {
    ScheduledBatch batch;
    int64_t rows = 0;  // its logits rows: the ids to read back
    int half = 0;      // which half of ids_host_ (and ids_copied_) its ids go to
  };
  // prepare_step + launch_step + the ids' copy to the host, queued behind the step (nothing waits). Takes the
  // batch (moves it into the InFlight) only when everything is queued; on a throw it is left as it was.
  InFlight launch_async(ScheduledBatch& batch, int half);
  // The step's ids on the host: waits for their copy only (CUDA: an event), or for the whole stream and checks the
  // embedding's bad-token flag when nothing was launched after it.
  std::vector<int32_t> wait_ids(const InFlight& step, bool last);
  // Token rows of `batch` that the step before samples: host ids before StepInputs::set (CPU: the real ids, already
  // in ids_device_; CUDA: 0), then the fill kernel on the device after it (CUDA).
  std::vector<int32_t> token_ids_for(const ScheduledBatch& batch) const;
  void fill_pending_on_device(const ScheduledBatch& batch);
  // Fails every sequence of `batch` still alive: Finished(Error) with `error`, its KV back in the pool.
  void fail_batch(const ScheduledBatch& batch, const std::string& error);

  const ModelWeights& weights_;
  EngineConfig config_;
  EngineLimits limits_;
  ExecContext ctx_;
  StepInputs step_;
  // The sampler: per-row parameters in, ids out, at fixed addresses.
  Tensor ids_device_;                   // I32 [max_logits_rows]
  HostBuffer ids_host_;                 // pinned on CUDA; two halves of max_logits_rows (async scheduling)
  std::unique_ptr<TokenSampler> sampler_;  // CUDA
  std::vector<SamplingRow> rows_host_;  // [max_logits_rows]: the CPU path reads these
  DeviceBuffer rows_device_;            // CUDA: SamplingRow [max_logits_rows]
  HostBuffer rows_staging_;             // pinned: the source of their async copy
  cudaEvent_t rows_copied_ = nullptr;
  bool rows_pending_ = false;
  std::unique_ptr<EngineKv> kv_;
  Scheduler scheduler_;
  // Async scheduling: the step whose ids are not read yet; two halves of ids_host_ (one per step in turn) and
  // the event after each half's copy; the pending-token pairs (PendingToken) and their async copy.
  std::optional<InFlight> in_flight_;
  cudaEvent_t ids_copied_[2] = {nullptr, nullptr};
  DeviceBuffer pending_device_;
  HostBuffer pending_staging_;
  cudaEvent_t pending_copied_ = nullptr;
  bool pending_copy_queued_ = false;

  // Engine thread only.
  std::unordered_map<int64_t, Request> requests_;  // by request id
  std::unordered_map<int64_t, int64_t> by_seq_;    // scheduler sequence id -> request id
  int64_t generated_ = 0, finished_stop_ = 0, finished_length_ = 0, aborted_ = 0, failed_ = 0, peak_running_ = 0;
  SchedulerStats stats_base_;  // the scheduler's counters when warm_up() ended: stats() counts from there
  struct HostTime {
    double prepare_s = 0.0, launch_s = 0.0, wait_s = 0.0;
  } host_time_;  // run_batch's host time since warm_up() (EngineStats::prepare_s, ...)
  int64_t prefix_query_base_ = 0, prefix_hit_base_ = 0;

  // Shared with the other threads.
  mutable std::mutex mutex_;
  mutable std::condition_variable work_cv_;
  std::vector<InboxItem> inbox_;
  int64_t next_request_id_ = 0;
  int64_t live_ = 0;  // requests in the scheduler, + 1 while a step's ids are in flight (engine thread writes,
                      // under the lock)
  EngineStats stats_;
};

}  // namespace tvllm
