// Lesson 11: the scheduler (scheduler.h) and the sequence's names.
#include "scheduler.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "common/exercise.h"
#include "common/input_error.h"

namespace tvllm {

std::string_view sequence_state_name(SequenceState state) {
  switch (state) {
    case SequenceState::Waiting:
      return "waiting";
    case SequenceState::Running:
      return "running";
    case SequenceState::Preempted:
      return "preempted";
    case SequenceState::Finished:
      return "finished";
  }
  return "?";
}

std::string_view finish_reason_name(FinishReason reason) {
  switch (reason) {
    case FinishReason::None:
      return "";
    case FinishReason::Stop:
      return "stop";
    case FinishReason::Length:
      return "length";
    case FinishReason::Abort:
      return "abort";
    case FinishReason::Error:
      return "error";
  }
  return "?";
}

int ScheduledBatch::num_decodes() const {
  return static_cast<int>(std::count_if(seqs.begin(), seqs.end(), [](const auto& s) { return s.is_decode; }));
}

std::vector<int32_t> ScheduledBatch::token_ids_filled(std::span<const int32_t> previous_ids) const {
  std::vector<int32_t> ids = token_ids;
  for (const PendingToken& p : pending_tokens) {
    if (p.source_row < 0 || static_cast<size_t>(p.source_row) >= previous_ids.size())
      throw std::logic_error("scheduler: a pending token reads row " + std::to_string(p.source_row) + " of " +
                             std::to_string(previous_ids.size()) + " ids");
    ids.at(static_cast<size_t>(p.token_row)) = previous_ids[static_cast<size_t>(p.source_row)];
  }
  return ids;
}

Scheduler::Scheduler(const SchedulerConfig& config, KvAllocator& allocator) : config_(config), allocator_(allocator) {
  TVLLM_REQUIRE(config.max_sequences >= 1,
                "scheduler: max_sequences must be >= 1, got " + std::to_string(config.max_sequences));
  // Every running decode must fit in one step, or a decode could be stalled by the budget alone.
  TVLLM_REQUIRE(config.max_tokens_per_step >= config.max_sequences,
                "scheduler: max_tokens_per_step (" + std::to_string(config.max_tokens_per_step) +
                    ") must be >= max_sequences (" + std::to_string(config.max_sequences) +
                    "): every running sequence decodes in every step");
  TVLLM_REQUIRE(config.max_context >= 2,
                "scheduler: max_context must be >= 2, got " + std::to_string(config.max_context));
  TVLLM_REQUIRE(config.max_context <= allocator.max_tokens_per_sequence(),
                "scheduler: max_context (" + std::to_string(config.max_context) +
                    ") exceeds what the KV cache holds per sequence (" +
                    std::to_string(allocator.max_tokens_per_sequence()) + ")");
  TVLLM_REQUIRE(config.chunked_prefill || config.max_context <= config.max_tokens_per_step,
                "scheduler: without chunked prefill a whole sequence must fit in one step: max_context (" +
                    std::to_string(config.max_context) + ") > max_tokens_per_step (" +
                    std::to_string(config.max_tokens_per_step) + ")");
}

int64_t Scheduler::add(std::vector<int32_t> prompt, const RequestParams& params) {
  TVLLM_REQUIRE(!prompt.empty(), "request: the prompt is empty");
  const auto n = static_cast<int64_t>(prompt.size());
  TVLLM_REQUIRE(n < config_.max_context, "request: the prompt has " + std::to_string(n) +
                                             " tokens, which leaves no room to generate within max_context " +
                                             std::to_string(config_.max_context));
  TVLLM_REQUIRE(params.max_tokens >= 1, "request: max_tokens must be >= 1, got " + std::to_string(params.max_tokens));
  validate_sampling_params(params.sampling);
  // The most tokens it will ever feed: all but the last id it generates, within the context.
  const int64_t longest = std::min(n + params.max_tokens, config_.max_context) - 1;
  TVLLM_REQUIRE(allocator_.fits_alone(longest),
                "request: " + std::to_string(longest) + " tokens would never fit in the KV cache, even alone");
  const int64_t id = next_id_++;
  auto seq = std::make_unique<Sequence>(id, std::move(prompt), params);
  waiting_.push_back(seq.get());  // the newest: the back of the queue
  sequences_.emplace(id, std::move(seq));
  return id;
}

void Scheduler::insert_running(Sequence* seq) {
  const auto at = std::lower_bound(running_.begin(), running_.end(), seq,
                                   [](const Sequence* a, const Sequence* b) { return a->id < b->id; });
  running_.insert(at, seq);
}

void Scheduler::insert_waiting(Sequence* seq) {
  const auto at = std::lower_bound(waiting_.begin(), waiting_.end(), seq,
                                   [](const Sequence* a, const Sequence* b) { return a->id < b->id; });
  waiting_.insert(at, seq);
}

// Preemption by recomputation: the cache is taken away and the tokens will be fed again. The ids generated so
// far are kept, so the request continues exactly where it was (greedy or seeded sampling gives the same ids).
void Scheduler::preempt(Sequence* seq, ScheduledBatch& batch) {
  allocator_.free(*seq);
  seq->num_computed = 0;
  seq->state = SequenceState::Preempted;
  ++seq->num_preemptions;
  ++stats_.preemptions;
  running_.erase(std::find(running_.begin(), running_.end(), seq));
  insert_waiting(seq);
  batch.preempted.push_back(seq->id);
}

void Scheduler::add_to_batch(Sequence* seq, int64_t q_len, ScheduledBatch& batch) {
  ScheduledSequence s;
  s.seq = seq;
  s.start = seq->num_computed;
  s.q_len = q_len;
  s.k_len = s.start + q_len;
  s.wants_logits = s.k_len == seq->num_tokens();
  s.is_decode = q_len == 1 && s.wants_logits && seq->num_computed >= seq->prompt_len();
  s.seq_id = seq->id;
  for (int64_t p = s.start; p < s.k_len; ++p) {
    // Async scheduling: the id the step in flight samples for it (only ever its last token, fed by a decode).
    if (seq->token(p) == kPendingToken)
      batch.pending_tokens.push_back({static_cast<int32_t>(batch.token_ids.size()), seq->pending_row});
    batch.token_ids.push_back(seq->token(p));
    batch.positions.push_back(static_cast<int32_t>(p));
    batch.slot_mapping.push_back(allocator_.kv_slot(*seq, p));
  }
  if (s.wants_logits) batch.logits_rows.push_back(static_cast<int32_t>(batch.token_ids.size() - 1));
  batch.q_lens.push_back(q_len);
  batch.k_lens.push_back(s.k_len);
  batch.seqs.push_back(s);
  (s.is_decode ? stats_.decode_tokens : stats_.prefill_tokens) += q_len;
}

ScheduledBatch Scheduler::schedule() {
  // --- exercise 11.1: the scheduler step --------------------------------------------------------------------
  // Task: return the next step (the contract; the design is yours, sections 4-6 of the chapter
  //   tells one way). The step holds at most config_.max_tokens_per_step tokens and config_.max_sequences
  //   sequences, each once. Every running sequence with exactly one uncomputed token decodes in it (one
  //   token), unless the step preempts it; decodes come before prefill chunks, and both go oldest first.
  //   A running sequence with more left gets as large a chunk as the budget and the cache allow. When the
  //   cache cannot grow, preempt(seq, batch) the NEWEST running sequence not already in this step (a decode
  //   that is itself the newest preempts itself); a chunk that still cannot get one token waits, keeping its
  //   cache. Only in a step that preempted nothing are waiting sequences admitted, in queue order while
  //   there is budget and a free place: each skips its cached prefix (allocator_.cached_tokens), wants the
  //   rest (without config_.chunked_prefill: all of it in this step), and needs allocator_.can_allocate.
  //   The first that does not fit ends admission: a later one never overtakes it. allocate() RETURNS the
  //   tokens already cached: set num_computed and num_cached_tokens to it; an admitted sequence becomes
  //   Running, leaves waiting_ and enters running_ (insert_running keeps arrival order). add_to_batch()
  //   appends a sequence's tokens (and counts them in the stats); a non-empty step also counts in
  //   stats_.steps, stats_.scheduled_tokens and stats_.max_step_tokens.
  // Hint: preempt() erases the victim from running_ and requeues it; a loop over running_ must allow for that.
  // Tests: Scheduler11.* SchedulerSim11.*
  // --- solution ---
  ScheduledBatch batch;
  int64_t budget = config_.max_tokens_per_step;
  std::vector<const Sequence*> scheduled;
  const auto is_scheduled = [&](const Sequence* s) {
    return std::find(scheduled.begin(), scheduled.end(), s) != scheduled.end();
  };

  // 1. Decodes, oldest first: one token each. max_tokens_per_step >= max_sequences, so the budget holds them all.
  for (size_t i = 0; i < running_.size();) {
    Sequence* seq = running_[i];
    if (seq->num_uncomputed() != 1) {
      ++i;
      continue;
    }
    bool preempted_self = false;
    while (!allocator_.can_append(*seq, seq->num_computed + 1)) {
      Sequence* victim = running_.back();  // the newest; never one scheduled already (those are older)
      preempt(victim, batch);
      if (victim == seq) {
        preempted_self = true;
        break;
      }
    }
    if (preempted_self) continue;  // running_[i] is now the next sequence
    allocator_.append(*seq, seq->num_computed + 1);
    add_to_batch(seq, 1, batch);
    scheduled.push_back(seq);
    --budget;
    ++i;
  }

  // 2. Prefill chunks of running sequences, oldest first.
  for (size_t i = 0; i < running_.size() && budget > 0; ++i) {
    Sequence* seq = running_[i];
    if (seq->num_uncomputed() <= 1 || is_scheduled(seq)) continue;
    int64_t n = std::min(seq->num_uncomputed(), budget);
    while (n > 0 && !allocator_.can_append(*seq, seq->num_computed + n)) {
      // The largest chunk that fits (can_append is monotonic in the token count).
      int64_t lo = 0, hi = n - 1;
      while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (allocator_.can_append(*seq, seq->num_computed + mid))
          lo = mid;
        else
          hi = mid - 1;
      }
      if (lo > 0) {
        n = lo;
        break;
      }
      // Not one token: take the cache of the newest sequence newer than this one that is not in the step.
      Sequence* victim = nullptr;
      for (size_t j = running_.size(); j-- > i + 1;) {
        if (!is_scheduled(running_[j])) {
          victim = running_[j];
          break;
        }
      }
      if (victim == nullptr) {
        n = 0;  // it waits for the decodes to finish or to be preempted
        break;
      }
      preempt(victim, batch);
    }
    if (n == 0) continue;
    allocator_.append(*seq, seq->num_computed + n);
    add_to_batch(seq, n, batch);
    scheduled.push_back(seq);
    budget -= n;
  }

  // 3. Admission, oldest first, no overtaking. Not after a preemption: the cache is short already.
  while (batch.preempted.empty() && !waiting_.empty() && budget > 0 && num_running() < config_.max_sequences) {
    Sequence* seq = waiting_.front();
    const int64_t cached = allocator_.cached_tokens(*seq);
    const int64_t uncached = seq->num_tokens() - cached;
    int64_t n = std::min(uncached, budget);
    if (!config_.chunked_prefill && n < uncached) break;
    if (!allocator_.can_allocate(*seq, cached + n)) break;
    seq->num_computed = allocator_.allocate(*seq, cached + n);
    seq->num_cached_tokens = seq->num_computed;
    n = std::min(n, seq->num_uncomputed());
    seq->state = SequenceState::Running;
    waiting_.pop_front();
    insert_running(seq);
    add_to_batch(seq, n, batch);
    scheduled.push_back(seq);
    budget -= n;
  }

  if (!batch.empty()) {
    ++stats_.steps;
    stats_.scheduled_tokens += batch.num_tokens();
    stats_.max_step_tokens = std::max(stats_.max_step_tokens, batch.num_tokens());
  }
  return batch;
  // --- end of exercise 11.1 ---
}

bool Scheduler::is_eos(const Sequence& seq, int32_t token) const {
  const auto& stop = seq.params.stop_ids;
  if (std::find(stop.begin(), stop.end(), token) != stop.end()) return true;
  if (seq.params.ignore_eos) return false;
  return std::find(config_.eos_ids.begin(), config_.eos_ids.end(), token) != config_.eos_ids.end();
}

FinishReason Scheduler::stop_reason(const Sequence& seq, int32_t token) const {
  if (is_eos(seq, token)) return FinishReason::Stop;
  if (static_cast<int64_t>(seq.output.size()) >= seq.params.max_tokens || seq.num_tokens() >= config_.max_context)
    return FinishReason::Length;
  return FinishReason::None;
}

void Scheduler::finish(Sequence* seq, FinishReason reason) {
  allocator_.free(*seq);
  // Async scheduling: an id still in flight is never delivered now; it is not part of the output.
  if (!seq->output.empty() && seq->output.back() == kPendingToken) seq->output.pop_back();
  seq->pending_row = -1;
  if (seq->state == SequenceState::Running) {
    running_.erase(std::find(running_.begin(), running_.end(), seq));
  } else {
    waiting_.erase(std::find(waiting_.begin(), waiting_.end(), seq));
  }
  seq->state = SequenceState::Finished;
  seq->finish_reason = reason;
  ++stats_.finished;
}

std::vector<TokenEvent> Scheduler::postprocess(const ScheduledBatch& batch, const std::vector<int32_t>& tokens) {
  if (tokens.size() != batch.logits_rows.size())
    throw std::logic_error("scheduler: postprocess got " + std::to_string(tokens.size()) + " ids for " +
                           std::to_string(batch.logits_rows.size()) + " logits rows");
  // --- exercise 11.2: after the step ------------------------------------------------------------------------
  // Task: for each entry of batch.seqs, in order (entry r of `tokens` belongs to the r-th entry that
  //   wants_logits): skip a sequence that is no longer running (aborted since schedule(); still count its
  //   row). Otherwise its tokens up to start + q_len are now computed: set num_computed and tell the allocator
  //   (allocator_.computed). If it wanted logits, append the new id to its output, return a TokenEvent, and
  //   finish it (finish(seq, reason), which frees its cache) at the first stop condition: a stop id or an EOS
  //   id (is_eos) -> FinishReason::Stop; params.max_tokens ids generated, or num_tokens() == max_context (the
  //   id could not be fed) -> FinishReason::Length. The finishing event says finished and why.
  // Tests: Scheduler11.PrefillThenDecodesInOneSlot Scheduler11.ChunkedPrefillNeverStallsADecode
  // Tests: Scheduler11.WithoutChunkedPrefillAPromptWaitsUntilItFitsWhole Scheduler11.StopConditions
  // Tests: Scheduler11.AdmitsInArrivalOrderAsSoonAsASlotFrees Scheduler11.AbortFreesAtOnceEvenMidStep
  // Tests: Scheduler11.PreemptsTheNewestAndRequeuesItInArrivalOrder Scheduler11.ADecodeThatIsTheNewestPreemptsItself
  // Tests: SchedulerSim11.*
  // --- solution ---
  std::vector<TokenEvent> events;
  size_t row = 0;
  for (const ScheduledSequence& s : batch.seqs) {
    Sequence* seq = s.seq;
    const size_t my_row = row;
    if (s.wants_logits) ++row;
    if (seq->state != SequenceState::Running) continue;  // aborted while the step ran
    seq->num_computed = s.k_len;
    allocator_.computed(*seq);
    if (!s.wants_logits) continue;
    const int32_t token = tokens[my_row];
    seq->output.push_back(token);
    TokenEvent event{seq->id, token, false, FinishReason::None};
    if (is_eos(*seq, token)) {
      event.reason = FinishReason::Stop;
    } else if (static_cast<int64_t>(seq->output.size()) >= seq->params.max_tokens ||
               seq->num_tokens() >= config_.max_context) {
      event.reason = FinishReason::Length;
    }
    if (event.reason != FinishReason::None) {
      event.finished = true;
      finish(seq, event.reason);
    }
    events.push_back(event);
  }
  return events;
  // --- end of exercise 11.2 ---
}

void Scheduler::advance(const ScheduledBatch& batch) {
  int32_t row = 0;
  for (const ScheduledSequence& s : batch.seqs) {
    const int32_t my_row = row;
    if (s.wants_logits) ++row;
    Sequence* seq = find(s.seq_id);
    if (seq == nullptr || seq->state != SequenceState::Running) continue;  // aborted since schedule()
    // One step in flight at a time: the caller resolves a step before it advances the next.
    if (seq->pending_row >= 0)
      throw std::logic_error("scheduler: advance() of a step while sequence " + std::to_string(seq->id) +
                             " still waits for the ids of the step before (resolve() it first)");
    seq->num_computed = s.k_len;
    allocator_.computed(*seq);
    if (!s.wants_logits) continue;
    seq->pending_row = my_row;
    // The id to come is certainly the last (stop_reason's Length rule holds whatever it is): nothing will feed
    // it, so no placeholder: the sequence has no uncomputed token and schedule() leaves it alone.
    const bool last = static_cast<int64_t>(seq->output.size()) + 1 >= seq->params.max_tokens ||
                      seq->num_tokens() + 1 >= config_.max_context;
    if (!last) seq->output.push_back(kPendingToken);
  }
}

std::vector<TokenEvent> Scheduler::resolve(const ScheduledBatch& batch, const std::vector<int32_t>& tokens) {
  if (tokens.size() != batch.logits_rows.size())
    throw std::logic_error("scheduler: resolve got " + std::to_string(tokens.size()) + " ids for " +
                           std::to_string(batch.logits_rows.size()) + " logits rows");
  std::vector<TokenEvent> events;
  int32_t row = 0;
  for (const ScheduledSequence& s : batch.seqs) {
    if (!s.wants_logits) continue;
    const int32_t my_row = row++;
    Sequence* seq = find(s.seq_id);
    // Released or finished since (an abort, an EOS seen one step late), or never advanced: nothing to write.
    if (seq == nullptr || seq->is_finished() || seq->pending_row != my_row) continue;
    const int32_t token = tokens[static_cast<size_t>(my_row)];
    // Running, or preempted by the schedule() in between (then it is waiting, and keeps the id for its rerun).
    if (!seq->output.empty() && seq->output.back() == kPendingToken)
      seq->output.back() = token;
    else
      seq->output.push_back(token);
    seq->pending_row = -1;
    TokenEvent event{seq->id, token, false, stop_reason(*seq, token)};
    if (event.reason != FinishReason::None) {
      event.finished = true;
      finish(seq, event.reason);
    }
    events.push_back(event);
  }
  return events;
}

bool Scheduler::abort(int64_t id, FinishReason reason) {
  Sequence* seq = find(id);
  if (seq == nullptr || seq->is_finished()) return false;
  finish(seq, reason);
  return true;
}

Sequence* Scheduler::find(int64_t id) {
  const auto it = sequences_.find(id);
  return it == sequences_.end() ? nullptr : it->second.get();
}

const Sequence* Scheduler::find(int64_t id) const {
  const auto it = sequences_.find(id);
  return it == sequences_.end() ? nullptr : it->second.get();
}

std::unique_ptr<Sequence> Scheduler::release(int64_t id) {
  const auto it = sequences_.find(id);
  if (it == sequences_.end() || !it->second->is_finished()) return nullptr;
  std::unique_ptr<Sequence> seq = std::move(it->second);
  sequences_.erase(it);
  return seq;
}

}  // namespace tvllm
