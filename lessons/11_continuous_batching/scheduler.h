// Lesson 11: the scheduler. Which tokens of which requests run in the next forward step.
//
//   add() ──> waiting ──admit──> running ──postprocess: a stop condition──> finished
//                ^                  │
//                └───preempt────────┘   (the KV cache ran out: the newest running one goes back)
//
// Each step, schedule() fills a token budget (max_tokens_per_step) with at most max_sequences sequences:
//
//   1. decodes: every running sequence with one token left to feed, oldest first, one token each. A decode is
//      never left out: if the cache cannot grow it, the NEWEST running sequence is preempted (its KV freed,
//      num_computed back to 0, back to the waiting queue in arrival order) until it can; when the newest is
//      the decode itself, it is the one that goes.
//   2. chunks: running sequences still in their prefill, oldest first, as many tokens as the budget leaves
//      (a long prompt is split over several steps, so it never stalls the decodes: chunked prefill).
//   3. admission: waiting sequences, oldest first, while the budget, max_sequences and the cache allow (the
//      first one that does not fit stops admission: no overtaking). None when this step preempted.
//
// The forward step runs the ScheduledBatch; postprocess() gets one id per logits row, appends them, checks
// the stop conditions and frees what finished. Host-only and single-threaded: the engine calls
// schedule -> forward -> postprocess in a loop (and add / abort between steps).
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <span>
#include <vector>

#include "kv_allocator.h"
#include "sequence.h"

namespace tvllm {

struct SchedulerConfig {
  int64_t max_tokens_per_step = 2048;  // the token budget (EngineLimits::max_tokens); >= max_sequences
  int64_t max_sequences = 64;          // sequences per step, and running at once (EngineLimits::max_sequences)
  int64_t max_context = 4096;          // tokens per sequence (prompt + output); a sequence stops at it
  bool chunked_prefill = true;         // false: a prefill runs whole in one step or waits (then every request
                                       // must fit in one step: max_context <= max_tokens_per_step)
  std::vector<int32_t> eos_ids;        // the model's EOS ids (a request stops at one unless ignore_eos)
};

// One sequence's part of a step: tokens [start, start + q_len) of it are fed.
struct ScheduledSequence {
  Sequence* seq = nullptr;    // valid until the sequence is released (Scheduler::release)
  int64_t start = 0;          // == seq->num_computed when scheduled: tokens before it are in the cache
  int64_t q_len = 0;          // new tokens this step
  int64_t k_len = 0;          // start + q_len: the context its queries attend over (cached + new)
  bool wants_logits = false;  // it feeds its last token: the step samples its next id
  bool is_decode = false;     // a decode (one token, everything before it cached), not a prefill chunk
  int64_t seq_id = -1;        // seq->id, for code that runs after the sequence may have been released
};

// Async scheduling (lesson 14): token row `token_row` of a step feeds the id that logits row `source_row` of the
// step before samples, not known when this step was scheduled (token_ids holds kPendingToken there).
struct PendingToken {
  int32_t token_row = 0;
  int32_t source_row = 0;
};

// What one forward step runs, in the layout lesson 08's StepInputs::set takes (sequences packed one after
// another: decodes first, then prefill chunks).
struct ScheduledBatch {
  std::vector<ScheduledSequence> seqs;
  std::vector<int32_t> token_ids;     // [T] the new tokens
  std::vector<int32_t> positions;     // [T] their positions in their sequences
  std::vector<int64_t> slot_mapping;  // [T] the KV slot each new token's k, v go to (KvAllocator::kv_slot)
  std::vector<int64_t> q_lens;        // [B]
  std::vector<int64_t> k_lens;        // [B]
  std::vector<int32_t> logits_rows;   // [R] rows of [0, T) whose logits are sampled, one per wants_logits
  std::vector<int64_t> preempted;     // ids preempted while building this step
  std::vector<PendingToken> pending_tokens;  // async scheduling only: rows the previous step's ids fill

  // token_ids with the pending rows filled from the previous step's sampled ids (one per logits row of that
  // step), on the host; std::logic_error for a row the previous step did not have. The engine does the same on
  // the device (fill_pending_tokens); its CPU path and the simulation call this.
  std::vector<int32_t> token_ids_filled(std::span<const int32_t> previous_ids) const;
  int64_t num_tokens() const { return static_cast<int64_t>(token_ids.size()); }
  int num_sequences() const { return static_cast<int>(seqs.size()); }
  bool empty() const { return seqs.empty(); }
  int num_decodes() const;
};

// A new id the step produced for a sequence (the engine's token stream).
struct TokenEvent {
  int64_t id = 0;  // the sequence
  int32_t token = 0;
  bool finished = false;
  FinishReason reason = FinishReason::None;
};

struct SchedulerStats {
  int64_t steps = 0;  // schedule() calls that returned work
  int64_t scheduled_tokens = 0;
  int64_t decode_tokens = 0;
  int64_t prefill_tokens = 0;  // prompt (and recomputed) tokens fed
  int64_t preemptions = 0;
  int64_t finished = 0;
  int64_t max_step_tokens = 0;  // the largest step
};

class Scheduler {
 public:
  // The allocator must outlive the scheduler. InputError for a bad config (naming the field).
  Scheduler(const SchedulerConfig& config, KvAllocator& allocator);
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // A new request; returns its id (arrival order). InputError, adding nothing, for: an empty prompt, a prompt
  // that leaves no room to generate (>= max_context), max_tokens < 1, bad sampling parameters, or a request
  // that could never fit in the KV cache even alone.
  int64_t add(std::vector<int32_t> prompt, const RequestParams& params);

  // The next step. Empty when there is nothing to run.
  ScheduledBatch schedule();

  // After the step: tokens[r] is the id sampled from logits row r of the batch (batch.logits_rows order).
  // Advances num_computed, appends the ids, applies the stop conditions, frees finished sequences. Sequences
  // aborted since schedule() are skipped. Returns one event per id appended, in batch order.
  std::vector<TokenEvent> postprocess(const ScheduledBatch& batch, const std::vector<int32_t>& tokens);

  // ---- async scheduling (lesson 14): postprocess() in two halves, so that the next step can be scheduled
  // while this one still runs on the GPU ----
  //   advance(batch)           what the step computes, known without its ids: num_computed, the allocator's
  //                            computed(); each sequence that samples gets pending_row and (unless this id is
  //                            certainly its last) a kPendingToken at the end of its output, so that schedule()
  //                            lets it decode in the next step, the token filled in from this step's ids.
  //   resolve(batch, tokens)   the ids, when they arrive: written over the placeholders, the stop conditions
  //                            applied, finished sequences freed. Returns the TokenEvents postprocess() would.
  // advance(b) then resolve(b, t) is postprocess(b, t). In between, schedule() may run (and the caller may
  // abort or release sequences: both look sequences up by id). A sequence whose last id is pending is not
  // scheduled again; one that stops at an EOS it has not seen yet decodes once more, and that row is dropped.
  void advance(const ScheduledBatch& batch);
  std::vector<TokenEvent> resolve(const ScheduledBatch& batch, const std::vector<int32_t>& tokens);

  // Stops a request now (waiting or running): its KV cache is freed at once, its state Finished with
  // `reason` (Abort, or Error for a failure the engine reports). False if it is unknown or already finished.
  bool abort(int64_t id, FinishReason reason = FinishReason::Abort);

  // The sequence with that id (any state), or nullptr. Finished sequences stay until release().
  Sequence* find(int64_t id);
  const Sequence* find(int64_t id) const;
  // Removes a finished sequence and hands it over (nullptr if it is unknown or not finished).
  std::unique_ptr<Sequence> release(int64_t id);

  bool has_work() const { return !waiting_.empty() || !running_.empty(); }
  int64_t num_waiting() const { return static_cast<int64_t>(waiting_.size()); }
  int64_t num_running() const { return static_cast<int64_t>(running_.size()); }
  const std::vector<Sequence*>& running() const { return running_; }  // oldest first
  const std::deque<Sequence*>& waiting() const { return waiting_; }   // next to admit first
  const SchedulerConfig& config() const { return config_; }
  const SchedulerStats& stats() const { return stats_; }
  KvAllocator& allocator() { return allocator_; }

 private:
  // The pieces schedule() is made of.
  void preempt(Sequence* seq, ScheduledBatch& batch);
  void add_to_batch(Sequence* seq, int64_t q_len, ScheduledBatch& batch);
  void insert_running(Sequence* seq);
  void insert_waiting(Sequence* seq);
  bool is_eos(const Sequence& seq, int32_t token) const;
  // Why a sequence that has just appended `token` stops (None: it goes on): the rule postprocess() applies.
  FinishReason stop_reason(const Sequence& seq, int32_t token) const;
  void finish(Sequence* seq, FinishReason reason);

  SchedulerConfig config_;
  KvAllocator& allocator_;
  std::map<int64_t, std::unique_ptr<Sequence>> sequences_;  // every sequence not yet released
  std::deque<Sequence*> waiting_;                           // by arrival: preempted ones come back in front
  std::vector<Sequence*> running_;                          // by arrival (oldest first)
  int64_t next_id_ = 0;
  SchedulerStats stats_;
};

}  // namespace tvllm
