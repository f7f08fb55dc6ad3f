// Lesson 11 on the CPU: the scheduler. Its step layout (positions, slot mapping, logits rows), chunked prefill,
// decodes before chunks, admission order, the stop conditions, abort, preemption by recomputation, and the
// simulation: 64 requests of mixed lengths through the scheduler give exactly the ids each gives alone (the fake
// model of simulate.h reads its context back through the allocator, so a wrong slot or a wrong token fails),
// with every step checked against the budget and the "no decode left behind" rule.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/input_error.h"
#include "kv_allocator.h"
#include "scheduler.h"
#include "sequence.h"
#include "simulate.h"

namespace tvllm {
namespace {

constexpr int32_t kVocab = 50;

// A paged allocator with blocks of ONE token, capacity `tokens` in all: the smallest allocator that can run
// out while sequences grow, so lesson 11's tests can preempt without lesson 12.
class TokenPool final : public KvAllocator {
 public:
  TokenPool(int64_t tokens, int64_t max_context) : max_context_(max_context), capacity_(tokens) {
    for (int64_t s = tokens; s-- > 0;) free_.push_back(static_cast<int32_t>(s));
  }
  int64_t max_tokens_per_sequence() const override { return max_context_; }
  int64_t num_kv_slots() const override { return capacity_; }
  bool fits_alone(int64_t tokens) const override { return tokens <= capacity_ && tokens <= max_context_; }
  bool can_allocate(const Sequence& seq, int64_t tokens) const override {
    return seq.kv_blocks.empty() && tokens <= max_context_ && tokens <= static_cast<int64_t>(free_.size());
  }
  int64_t allocate(Sequence& seq, int64_t tokens) override {
    if (!can_allocate(seq, tokens)) throw std::logic_error("TokenPool: allocate refused");
    take(seq, tokens);
    return 0;
  }
  bool can_append(const Sequence& seq, int64_t tokens) const override {
    return !seq.kv_blocks.empty() && tokens <= max_context_ &&
           tokens - static_cast<int64_t>(seq.kv_blocks.size()) <= static_cast<int64_t>(free_.size());
  }
  void append(Sequence& seq, int64_t tokens) override {
    if (!can_append(seq, tokens)) throw std::logic_error("TokenPool: append refused");
    take(seq, tokens);
  }
  void free(Sequence& seq) override {
    for (auto it = seq.kv_blocks.rbegin(); it != seq.kv_blocks.rend(); ++it) free_.push_back(*it);
    seq.kv_blocks.clear();
  }
  int64_t kv_slot(const Sequence& seq, int64_t position) const override {
    return seq.kv_blocks.at(static_cast<size_t>(position));
  }
  int64_t free_tokens() const { return static_cast<int64_t>(free_.size()); }

 private:
  void take(Sequence& seq, int64_t tokens) {
    while (static_cast<int64_t>(seq.kv_blocks.size()) < tokens) {
      seq.kv_blocks.push_back(free_.back());
      free_.pop_back();
    }
  }
  int64_t max_context_, capacity_;
  std::vector<int32_t> free_;
};

SchedulerConfig config_for(int64_t budget, int64_t max_sequences, int64_t max_context) {
  SchedulerConfig c;
  c.max_tokens_per_step = budget;
  c.max_sequences = max_sequences;
  c.max_context = max_context;
  c.eos_ids = {0};
  return c;
}

RequestParams greedy(int64_t max_tokens, bool ignore_eos = true) {
  RequestParams p;
  p.sampling.temperature = 0.0f;
  p.max_tokens = max_tokens;
  p.ignore_eos = ignore_eos;
  return p;
}

std::vector<int32_t> iota_prompt(int64_t n, int32_t first = 1) {
  std::vector<int32_t> p(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) p[static_cast<size_t>(i)] = 1 + (first + static_cast<int32_t>(i)) % (kVocab - 1);
  return p;
}

// Runs the scheduler to the end with the fake model, checking every step:
//   the budget and max_sequences hold; every running sequence that was ready to decode is in the step (or was
//   preempted by it); decodes come before prefill chunks; no sequence appears twice; one logits row per
//   sequence that feeds its last token, pointing at that token's row.
struct Driver {
  Driver(Scheduler& s, FakeModel& m) : scheduler(s), model(m) {}
  Scheduler& scheduler;
  FakeModel& model;
  int64_t steps = 0, chunks = 0, preempted = 0, max_tokens = 0;
  int64_t pending = 0;  // async: tokens filled in from the step before
  std::function<void(int64_t step)> before_step;  // e.g. submit or abort
  // Async scheduling (lesson 14), in the engine's order: advance(N); [before_step]; schedule N + 1 and run it;
  // resolve(N). Every check below holds the same way.
  bool async = false;

  void run(int64_t max_steps = 100000) {
    std::optional<ScheduledBatch> in_flight;
    std::vector<int32_t> in_flight_ids;
    for (;;) {
      if (async && in_flight) scheduler.advance(*in_flight);
      if (before_step) before_step(steps);
      if (!scheduler.has_work() && !in_flight) break;
      ASSERT_LT(steps, max_steps) << "the scheduler does not finish";
      std::set<int64_t> ready;
      for (const Sequence* s : scheduler.running())
        if (s->num_uncomputed() == 1) ready.insert(s->id);
      ScheduledBatch batch = scheduler.schedule();
      ASSERT_TRUE(!batch.empty() || in_flight) << "work left but nothing scheduled at step " << steps;
      std::vector<int32_t> ids;
      if (!batch.empty()) {
        check(batch, ready);
        if (::testing::Test::HasFatalFailure()) return;
        pending += static_cast<int64_t>(batch.pending_tokens.size());
        if (!async) {
          ASSERT_TRUE(batch.pending_tokens.empty());
          scheduler.postprocess(batch, model.step(batch, scheduler.allocator()));
          ++steps;
          continue;
        }
        batch.token_ids = batch.token_ids_filled(in_flight_ids);
        ids = model.step(batch, scheduler.allocator());
        ++steps;
      }
      if (in_flight) scheduler.resolve(*in_flight, in_flight_ids);
      in_flight.reset();
      if (!batch.empty()) {
        in_flight = std::move(batch);
        in_flight_ids = std::move(ids);
      }
    }
  }

  void check(const ScheduledBatch& batch, const std::set<int64_t>& ready) {
    const SchedulerConfig& c = scheduler.config();
    ASSERT_LE(batch.num_tokens(), c.max_tokens_per_step);
    ASSERT_LE(batch.num_sequences(), c.max_sequences);
    ASSERT_EQ(batch.q_lens.size(), batch.seqs.size());
    ASSERT_EQ(batch.positions.size(), batch.token_ids.size());
    ASSERT_EQ(batch.slot_mapping.size(), batch.token_ids.size());
    max_tokens = std::max(max_tokens, batch.num_tokens());
    preempted += static_cast<int64_t>(batch.preempted.size());
    std::set<int64_t> in_batch;
    bool seen_chunk = false;
    int64_t row = 0;
    size_t logits = 0;
    for (size_t i = 0; i < batch.seqs.size(); ++i) {
      const ScheduledSequence& s = batch.seqs[i];
      ASSERT_TRUE(in_batch.insert(s.seq->id).second) << "sequence " << s.seq->id << " twice in one step";
      ASSERT_GE(s.q_len, 1);
      ASSERT_EQ(s.k_len, s.start + s.q_len);
      ASSERT_EQ(batch.q_lens[i], s.q_len);
      ASSERT_EQ(batch.k_lens[i], s.k_len);
      ASSERT_EQ(s.wants_logits, s.k_len == s.seq->num_tokens());
      const bool decode_like = ready.count(s.seq->id) > 0;
      if (!decode_like) seen_chunk = true;
      if (decode_like) {
        ASSERT_FALSE(seen_chunk) << "decode of " << s.seq->id << " after a prefill chunk";
      }
      if (!s.wants_logits) ++chunks;
      for (int64_t p = s.start; p < s.k_len; ++p, ++row) ASSERT_EQ(batch.positions[static_cast<size_t>(row)], p);
      if (s.wants_logits) {
        ASSERT_LT(logits, batch.logits_rows.size());
        ASSERT_EQ(batch.logits_rows[logits++], row - 1);
      }
    }
    ASSERT_EQ(logits, batch.logits_rows.size());
    for (const int64_t id : ready) {
      const bool preempted_now = std::find(batch.preempted.begin(), batch.preempted.end(), id) != batch.preempted.end();
      ASSERT_TRUE(in_batch.count(id) || preempted_now) << "decode of sequence " << id << " stalled";
    }
  }
};

// ---- one request, step by step ---------------------------------------------------------------------------

TEST(Scheduler11, PrefillThenDecodesInOneSlot) {
  SlotAllocator slots(2, 16);
  Scheduler s(config_for(64, 2, 16), slots);
  const int64_t id = s.add({5, 6, 7, 8, 9}, greedy(3));
  EXPECT_EQ(s.num_waiting(), 1);

  ScheduledBatch b = s.schedule();
  ASSERT_EQ(b.num_sequences(), 1);
  EXPECT_EQ(b.token_ids, (std::vector<int32_t>{5, 6, 7, 8, 9}));
  EXPECT_EQ(b.positions, (std::vector<int32_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(b.slot_mapping, (std::vector<int64_t>{0, 1, 2, 3, 4}));  // slot 0: positions 0..15
  EXPECT_EQ(b.q_lens, (std::vector<int64_t>{5}));
  EXPECT_EQ(b.k_lens, (std::vector<int64_t>{5}));
  EXPECT_EQ(b.logits_rows, (std::vector<int32_t>{4}));
  EXPECT_FALSE(b.seqs[0].is_decode);
  EXPECT_EQ(slots.free_slots(), 1);
  std::vector<TokenEvent> ev = s.postprocess(b, {11});
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].id, id);
  EXPECT_EQ(ev[0].token, 11);
  EXPECT_FALSE(ev[0].finished);
  EXPECT_EQ(s.find(id)->num_computed, 5);

  b = s.schedule();  // decode: the id just sampled, at position 5
  EXPECT_EQ(b.token_ids, (std::vector<int32_t>{11}));
  EXPECT_EQ(b.positions, (std::vector<int32_t>{5}));
  EXPECT_EQ(b.k_lens, (std::vector<int64_t>{6}));
  EXPECT_EQ(b.logits_rows, (std::vector<int32_t>{0}));
  EXPECT_TRUE(b.seqs[0].is_decode);
  s.postprocess(b, {12});
  b = s.schedule();
  ev = s.postprocess(b, {13});
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_TRUE(ev[0].finished);
  EXPECT_EQ(ev[0].reason, FinishReason::Length);
  const Sequence* seq = s.find(id);
  EXPECT_EQ(seq->output, (std::vector<int32_t>{11, 12, 13}));
  EXPECT_EQ(seq->state, SequenceState::Finished);
  EXPECT_TRUE(seq->kv_blocks.empty());
  EXPECT_EQ(slots.free_slots(), 2);
  EXPECT_FALSE(s.has_work());
  EXPECT_TRUE(s.schedule().empty());
  EXPECT_NE(s.release(id), nullptr);
  EXPECT_EQ(s.find(id), nullptr);
}

TEST(Scheduler11, SecondSlotAddressesStartAtMaxContext) {
  SlotAllocator slots(2, 16);
  Scheduler s(config_for(64, 2, 16), slots);
  s.add({1, 2}, greedy(4));
  s.add({3, 4, 5}, greedy(4));
  const ScheduledBatch b = s.schedule();
  EXPECT_EQ(b.slot_mapping, (std::vector<int64_t>{0, 1, 16, 17, 18}));
  EXPECT_EQ(b.logits_rows, (std::vector<int32_t>{1, 4}));
  EXPECT_EQ(b.seqs[1].seq->kv_blocks, (std::vector<int32_t>{1}));
}

TEST(Scheduler11, ChunkedPrefillNeverStallsADecode) {
  SlotAllocator slots(2, 64);
  Scheduler s(config_for(8, 2, 64), slots);
  const int64_t a = s.add({1, 2, 3}, greedy(10));
  s.postprocess(s.schedule(), {7});  // a is decoding now
  const int64_t b = s.add(iota_prompt(20), greedy(2));
  // b's 20 tokens go in chunks of 7 (8 minus a's decode), 7, 6; a decodes in every one of those steps.
  const std::vector<int64_t> chunks{7, 7, 6};
  for (size_t k = 0; k < chunks.size(); ++k) {
    const ScheduledBatch batch = s.schedule();
    ASSERT_EQ(batch.num_sequences(), 2) << "step " << k;
    EXPECT_EQ(batch.seqs[0].seq->id, a);
    EXPECT_TRUE(batch.seqs[0].is_decode);
    EXPECT_EQ(batch.seqs[1].seq->id, b);
    EXPECT_EQ(batch.seqs[1].q_len, chunks[k]);
    EXPECT_EQ(batch.seqs[1].wants_logits, k + 1 == chunks.size());
    EXPECT_EQ(batch.num_tokens(), 1 + chunks[k]);
    EXPECT_EQ(batch.logits_rows.size(), k + 1 == chunks.size() ? 2u : 1u);
    s.postprocess(batch, k + 1 == chunks.size() ? std::vector<int32_t>{7, 8} : std::vector<int32_t>{7});
  }
  EXPECT_EQ(s.find(b)->num_computed, 20);
  EXPECT_EQ(s.find(b)->output.size(), 1u);
}

TEST(Scheduler11, WithoutChunkedPrefillAPromptWaitsUntilItFitsWhole) {
  SlotAllocator slots(2, 16);
  SchedulerConfig c = config_for(16, 2, 16);
  c.chunked_prefill = false;
  Scheduler s(c, slots);
  s.add(iota_prompt(10), greedy(5));
  s.add(iota_prompt(10, 3), greedy(5));
  ScheduledBatch b = s.schedule();  // 10 + 10 > 16: only the first
  ASSERT_EQ(b.num_sequences(), 1);
  s.postprocess(b, {1});
  b = s.schedule();  // 1 decode + 10 <= 16
  ASSERT_EQ(b.num_sequences(), 2);
  EXPECT_EQ(b.seqs[1].q_len, 10);
  // And the config must let every request fit in one step.
  SchedulerConfig bad = config_for(8, 2, 16);
  bad.chunked_prefill = false;
  EXPECT_THROW(Scheduler(bad, slots), InputError);
}

TEST(Scheduler11, AdmitsInArrivalOrderAsSoonAsASlotFrees) {
  SlotAllocator slots(1, 32);
  Scheduler s(config_for(32, 1, 32), slots);
  const int64_t a = s.add({1, 2}, greedy(2));
  const int64_t b = s.add({3}, greedy(1));
  const int64_t c = s.add({4}, greedy(1));
  EXPECT_LT(a, b);
  EXPECT_LT(b, c);
  ScheduledBatch batch = s.schedule();
  ASSERT_EQ(batch.num_sequences(), 1);
  EXPECT_EQ(batch.seqs[0].seq->id, a);
  s.postprocess(batch, {5});
  batch = s.schedule();
  EXPECT_EQ(batch.seqs.at(0).seq->id, a);
  s.postprocess(batch, {6});  // a finishes: its slot is free for the NEXT step
  batch = s.schedule();
  ASSERT_EQ(batch.num_sequences(), 1);
  EXPECT_EQ(batch.seqs[0].seq->id, b);
  s.postprocess(batch, {7});
  EXPECT_EQ(s.schedule().seqs.at(0).seq->id, c);
}

// The chapter's rule: admission takes the waiting queue in arrival order and stops at the first request that
// does not fit; it never admits a later, shorter one past it (that would starve long prompts). Without chunked
// prefill a prompt must fit in the budget whole, so prompts of different lengths test it.
TEST(Scheduler11, AdmissionStopsAtTheFirstRequestThatDoesNotFit) {
  SlotAllocator slots(3, 16);
  SchedulerConfig c = config_for(16, 3, 16);
  c.chunked_prefill = false;
  Scheduler s(c, slots);
  const int64_t a = s.add(iota_prompt(10), greedy(4));
  const int64_t b = s.add(iota_prompt(12, 5), greedy(4));  // 10 + 12 > 16: b waits
  const int64_t c3 = s.add(iota_prompt(3, 9), greedy(4));  // 10 + 3 <= 16, but b is first in line
  ScheduledBatch batch = s.schedule();
  ASSERT_EQ(batch.num_sequences(), 1);
  EXPECT_EQ(batch.seqs[0].seq->id, a);
  EXPECT_EQ(batch.num_tokens(), 10);
  EXPECT_EQ(s.num_waiting(), 2);
  EXPECT_EQ(s.waiting().front()->id, b);
  EXPECT_EQ(slots.free_slots(), 2);  // c3 took no slot either
  s.postprocess(batch, {1});
  // Next step: a's decode (1) + b (12) + c3 (3) = 16 tokens: both join, b first.
  batch = s.schedule();
  ASSERT_EQ(batch.num_sequences(), 3);
  EXPECT_EQ(batch.seqs[0].seq->id, a);
  EXPECT_EQ(batch.seqs[1].seq->id, b);
  EXPECT_EQ(batch.seqs[1].q_len, 12);
  EXPECT_EQ(batch.seqs[2].seq->id, c3);
  EXPECT_EQ(batch.seqs[2].q_len, 3);
  EXPECT_EQ(batch.num_tokens(), 16);
}

// The same rule when the KV cache, not the budget, is what is short (chunked prefill on: a prompt could go in
// pieces, but admission still needs room for its first chunk).
TEST(Scheduler11, AdmissionDoesNotOvertakeWhenTheCacheIsShort) {
  TokenPool pool(12, 16);
  Scheduler s(config_for(64, 4, 16), pool);
  const int64_t a = s.add(iota_prompt(8), greedy(2));
  const int64_t b = s.add(iota_prompt(8, 4), greedy(2));  // 8 > the 4 tokens left
  s.add(iota_prompt(2, 7), greedy(2));                    // 2 would fit
  const ScheduledBatch batch = s.schedule();
  ASSERT_EQ(batch.num_sequences(), 1);
  EXPECT_EQ(batch.seqs[0].seq->id, a);
  EXPECT_EQ(pool.free_tokens(), 4);
  EXPECT_EQ(s.waiting().front()->id, b);
  EXPECT_EQ(s.num_waiting(), 2);
}

TEST(Scheduler11, MaxSequencesCapsTheRunningSet) {
  SlotAllocator slots(8, 32);
  Scheduler s(config_for(64, 3, 32), slots);
  for (int i = 0; i < 5; ++i) s.add({1, 2, 3}, greedy(4));
  const ScheduledBatch b = s.schedule();
  EXPECT_EQ(b.num_sequences(), 3);
  EXPECT_EQ(s.num_running(), 3);
  EXPECT_EQ(s.num_waiting(), 2);
}

TEST(Scheduler11, StopConditions) {
  SlotAllocator slots(4, 8);
  SchedulerConfig c = config_for(64, 4, 8);
  c.eos_ids = {0, 2};
  Scheduler s(c, slots);
  const int64_t eos = s.add({1}, greedy(10, false));
  const int64_t ignore = s.add({1}, greedy(10, true));
  RequestParams stop = greedy(10, true);
  stop.stop_ids = {2};
  const int64_t stop_id = s.add({1}, stop);
  const int64_t context = s.add({1, 1, 1, 1, 1, 1}, greedy(10, true));  // 6 of 8: room for 2 ids
  std::vector<TokenEvent> ev = s.postprocess(s.schedule(), {2, 2, 2, 5});
  ASSERT_EQ(ev.size(), 4u);
  EXPECT_TRUE(ev[0].finished);
  EXPECT_EQ(ev[0].reason, FinishReason::Stop);  // EOS id 2
  EXPECT_FALSE(ev[1].finished);                 // ignore_eos
  EXPECT_TRUE(ev[2].finished);
  EXPECT_EQ(ev[2].reason, FinishReason::Stop);  // a stop id stops even with ignore_eos
  EXPECT_FALSE(ev[3].finished);
  ev = s.postprocess(s.schedule(), {0, 5});
  ASSERT_EQ(ev.size(), 2u);
  EXPECT_FALSE(ev[0].finished);  // ignore_eos: 0 is just an id
  EXPECT_TRUE(ev[1].finished);
  EXPECT_EQ(ev[1].reason, FinishReason::Length);  // 8 tokens: the context is full
  EXPECT_EQ(s.find(context)->output, (std::vector<int32_t>{5, 5}));
  EXPECT_EQ(s.find(eos)->output, (std::vector<int32_t>{2}));
  EXPECT_EQ(s.find(stop_id)->finish_reason, FinishReason::Stop);
  EXPECT_EQ(s.find(ignore)->state, SequenceState::Running);
  EXPECT_EQ(slots.free_slots(), 3);
  EXPECT_EQ(finish_reason_name(FinishReason::Length), "length");
  EXPECT_EQ(sequence_state_name(SequenceState::Preempted), "preempted");
}

TEST(Scheduler11, AbortFreesAtOnceEvenMidStep) {
  SlotAllocator slots(2, 32);
  Scheduler s(config_for(64, 2, 32), slots);
  const int64_t a = s.add({1, 2, 3}, greedy(5));
  const int64_t b = s.add({4, 5}, greedy(5));
  const int64_t c = s.add({6}, greedy(5));
  s.postprocess(s.schedule(), {7, 8});
  EXPECT_EQ(slots.free_slots(), 0);
  EXPECT_TRUE(s.abort(c));  // waiting: just gone
  EXPECT_EQ(s.find(c)->finish_reason, FinishReason::Abort);
  const ScheduledBatch batch = s.schedule();
  ASSERT_EQ(batch.num_sequences(), 2);
  EXPECT_TRUE(s.abort(a, FinishReason::Error));  // running, with a step in flight
  EXPECT_EQ(slots.free_slots(), 1);              // at once
  EXPECT_TRUE(s.find(a)->kv_blocks.empty());
  const std::vector<TokenEvent> ev = s.postprocess(batch, {9, 10});
  ASSERT_EQ(ev.size(), 1u);  // a's id is dropped
  EXPECT_EQ(ev[0].id, b);
  EXPECT_EQ(ev[0].token, 10);
  EXPECT_EQ(s.find(a)->output.size(), 1u);
  EXPECT_EQ(s.find(a)->finish_reason, FinishReason::Error);
  EXPECT_FALSE(s.abort(a));    // already finished
  EXPECT_FALSE(s.abort(999));  // unknown
  EXPECT_EQ(s.num_running(), 1);
}

TEST(SchedulerConfig11, BadRequestsAndConfigsAreInputErrors) {
  SlotAllocator slots(2, 16);
  EXPECT_THROW(SlotAllocator(0, 16), InputError);
  EXPECT_THROW(Scheduler(config_for(64, 0, 16), slots), InputError);
  EXPECT_THROW(Scheduler(config_for(4, 8, 16), slots), InputError);   // budget < max_sequences
  EXPECT_THROW(Scheduler(config_for(64, 2, 32), slots), InputError);  // context > a slot
  Scheduler s(config_for(64, 2, 16), slots);
  EXPECT_THROW(s.add({}, greedy(4)), InputError);
  EXPECT_THROW(s.add(iota_prompt(16), greedy(4)), InputError);  // no room to generate
  EXPECT_THROW(s.add({1}, greedy(0)), InputError);
  RequestParams bad = greedy(4);
  bad.sampling.temperature = -1.0f;
  EXPECT_THROW(s.add({1}, bad), InputError);
  EXPECT_FALSE(s.has_work());
  // A request that can never fit the cache, even alone.
  TokenPool pool(10, 64);
  Scheduler small(config_for(64, 2, 64), pool);
  EXPECT_THROW(small.add(iota_prompt(8), greedy(4)), InputError);  // needs 11 tokens of KV
  EXPECT_NO_THROW(small.add(iota_prompt(8), greedy(3)));           // needs 10
}

// ---- preemption -------------------------------------------------------------------------------------------

TEST(Scheduler11, PreemptsTheNewestAndRequeuesItInArrivalOrder) {
  TokenPool pool(12, 64);
  Scheduler s(config_for(64, 4, 64), pool);
  const int64_t a = s.add({1, 2, 3, 4}, greedy(8));
  const int64_t b = s.add({5, 6, 7, 8}, greedy(8));
  const int64_t c = s.add({9, 10, 11, 12}, greedy(8));
  ScheduledBatch batch = s.schedule();  // 12 tokens: the pool is full
  ASSERT_EQ(batch.num_sequences(), 3);
  EXPECT_EQ(pool.free_tokens(), 0);
  s.postprocess(batch, {1, 1, 1});
  const int64_t d = s.add({13}, greedy(2));
  batch = s.schedule();  // a needs one more token: c, the newest, goes; then b needs one: c's room suffices
  EXPECT_EQ(batch.preempted, (std::vector<int64_t>{c}));
  ASSERT_EQ(batch.num_sequences(), 2);
  EXPECT_EQ(batch.seqs[0].seq->id, a);
  EXPECT_EQ(batch.seqs[1].seq->id, b);
  const Sequence* cs = s.find(c);
  EXPECT_EQ(cs->state, SequenceState::Preempted);
  EXPECT_EQ(cs->num_computed, 0);
  EXPECT_EQ(cs->output, (std::vector<int32_t>{1}));  // kept: it resumes, it does not restart
  EXPECT_EQ(cs->num_preemptions, 1);
  ASSERT_EQ(s.waiting().size(), 2u);
  EXPECT_EQ(s.waiting()[0]->id, c);  // in front of d, which arrived later
  EXPECT_EQ(s.waiting()[1]->id, d);
  EXPECT_EQ(s.stats().preemptions, 1);
}

TEST(Scheduler11, ADecodeThatIsTheNewestPreemptsItself) {
  TokenPool pool(9, 64);
  Scheduler s(config_for(64, 4, 64), pool);
  const int64_t a = s.add({1, 2, 3, 4}, greedy(5));
  const int64_t b = s.add({5, 6, 7, 8}, greedy(5));
  s.postprocess(s.schedule(), {1, 1});        // 8 of 9 tokens used
  const ScheduledBatch batch = s.schedule();  // a takes the last one; b is the newest: it preempts itself
  EXPECT_EQ(batch.preempted, (std::vector<int64_t>{b}));
  ASSERT_EQ(batch.num_sequences(), 1);
  EXPECT_EQ(batch.seqs[0].seq->id, a);
  EXPECT_EQ(s.num_waiting(), 1);  // not re-admitted in the step that preempted it
}

// ---- the simulation ---------------------------------------------------------------------------------------

struct Workload {
  std::vector<SimRequest> requests;
  std::vector<int64_t> ids;
};

void expect_outputs_equal_alone(const Scheduler& s, const Workload& w, int64_t max_context,
                                const std::set<int64_t>& aborted = {}) {
  for (size_t i = 0; i < w.requests.size(); ++i) {
    const Sequence* seq = s.find(w.ids[i]);
    ASSERT_NE(seq, nullptr);
    ASSERT_TRUE(seq->is_finished()) << "request " << i;
    if (aborted.count(w.ids[i])) continue;
    EXPECT_EQ(seq->output,
              reference_output(w.requests[i].prompt, w.requests[i].params, s.config().eos_ids, max_context, kVocab))
        << "request " << i << " (prompt " << w.requests[i].prompt.size() << ", " << seq->num_preemptions
        << " preemptions)";
    EXPECT_NE(seq->finish_reason, FinishReason::Abort);
  }
}

TEST(SchedulerSim11, SixtyFourRequestsInSlotsEqualAlone) {
  SlotAllocator slots(8, 512);
  Scheduler s(config_for(64, 8, 512), slots);
  FakeModel model(slots.num_kv_slots(), kVocab);
  Workload w{make_workload(64, 1, 300, 1, 80, kVocab, 7), {}};
  for (const SimRequest& r : w.requests) w.ids.push_back(s.add(r.prompt, r.params));
  Driver d{s, model};
  d.run();
  ASSERT_FALSE(HasFatalFailure());
  expect_outputs_equal_alone(s, w, 512);
  EXPECT_GT(d.chunks, 0) << "prompts up to 300 tokens with a budget of 64 must be chunked";
  EXPECT_EQ(d.max_tokens, 64);
  EXPECT_EQ(d.preempted, 0);  // a slot always has max_context positions
  EXPECT_EQ(slots.free_slots(), 8);
  EXPECT_EQ(s.stats().finished, 64);
  // Some stopped at EOS, some ran to max_tokens: the mix the workload promises.
  int stopped = 0;
  for (int64_t id : w.ids) stopped += s.find(id)->finish_reason == FinishReason::Stop;
  EXPECT_GT(stopped, 0);
  EXPECT_LT(stopped, 64);
}

TEST(SchedulerSim11, SmallPoolPreemptsAndOutputsStayEqual) {
  TokenPool pool(600, 512);
  Scheduler s(config_for(96, 16, 512), pool);
  FakeModel model(pool.num_kv_slots(), kVocab);
  Workload w{make_workload(64, 1, 200, 1, 150, kVocab, 11), {}};
  for (const SimRequest& r : w.requests) w.ids.push_back(s.add(r.prompt, r.params));
  Driver d{s, model};
  d.run();
  ASSERT_FALSE(HasFatalFailure());
  expect_outputs_equal_alone(s, w, 512);
  EXPECT_GT(d.preempted, 0) << "the pool was meant to run out";
  EXPECT_EQ(s.stats().preemptions, d.preempted);
  EXPECT_EQ(pool.free_tokens(), 600);
}

TEST(SchedulerSim11, StaggeredArrivalsAndAbortsMidRun) {
  for (const bool async : {false, true}) {  // async (lesson 14): the aborts land while a step is in flight
    SCOPED_TRACE(async ? "async scheduling" : "synchronous");
    TokenPool pool(800, 256);
    Scheduler s(config_for(48, 12, 256), pool);
    FakeModel model(pool.num_kv_slots(), kVocab);
    Workload w{make_workload(64, 1, 120, 1, 100, kVocab, 3), {}};
    std::set<int64_t> aborted;
    Driver d{s, model};
    d.async = async;
    size_t next = 0;
    d.before_step = [&](int64_t step) {
      for (int k = 0; k < 3 && next < w.requests.size(); ++k, ++next)  // three new requests per step
        w.ids.push_back(s.add(w.requests[next].prompt, w.requests[next].params));
      if (step % 9 == 5 && !s.running().empty()) {  // abort the oldest running request now and then
        Sequence* victim = s.running().front();
        const int64_t before = pool.free_tokens();
        const auto held = static_cast<int64_t>(victim->kv_blocks.size());
        ASSERT_TRUE(s.abort(victim->id));
        EXPECT_EQ(pool.free_tokens(), before + held) << "abort must free at once";
        aborted.insert(victim->id);
      }
    };
    d.run();
    ASSERT_FALSE(HasFatalFailure());
    ASSERT_EQ(next, w.requests.size());
    EXPECT_GT(aborted.size(), 2u);
    expect_outputs_equal_alone(s, w, 256, aborted);
    for (const int64_t id : aborted)
      for (const int32_t t : s.find(id)->output) EXPECT_NE(t, kPendingToken) << "sequence " << id;
    EXPECT_EQ(pool.free_tokens(), 800);
  }
}

TEST(SchedulerSim11, WithoutChunkedPrefillOutputsStayEqual) {
  SlotAllocator slots(6, 128);
  SchedulerConfig c = config_for(160, 6, 128);
  c.chunked_prefill = false;
  Scheduler s(c, slots);
  FakeModel model(slots.num_kv_slots(), kVocab);
  Workload w{make_workload(40, 1, 100, 1, 60, kVocab, 5), {}};
  for (const SimRequest& r : w.requests) w.ids.push_back(s.add(r.prompt, r.params));
  Driver d{s, model};
  d.run();
  ASSERT_FALSE(HasFatalFailure());
  expect_outputs_equal_alone(s, w, 128);
  EXPECT_EQ(d.chunks, 0);
  EXPECT_EQ(slots.free_slots(), 6);
}

TEST(SchedulerSim11, RunUntilIdleAndTheFakeModelCatchAWrongCache) {
  SlotAllocator slots(2, 32);
  Scheduler s(config_for(32, 2, 32), slots);
  FakeModel model(slots.num_kv_slots(), kVocab);
  const RequestParams p = greedy(6);
  const int64_t id = s.add({3, 4, 5}, p);
  EXPECT_GT(run_until_idle(s, model), 0);
  EXPECT_EQ(s.find(id)->output, reference_output({3, 4, 5}, p, {0}, 32, kVocab));
  // A batch whose sequence claims a context the cache does not hold: the fake model notices.
  Sequence fake(99, {3, 4, 5, 6}, p);
  fake.kv_blocks = {1};  // slot 1 was never written
  fake.num_computed = 3;
  ScheduledBatch b;
  b.seqs.push_back({&fake, 3, 1, 4, true, true});
  b.token_ids = {6};
  b.positions = {3};
  b.slot_mapping = {slots.kv_slot(fake, 3)};
  b.q_lens = {1};
  b.k_lens = {4};
  b.logits_rows = {0};
  EXPECT_THROW(model.step(b, slots), std::logic_error);
}


// ---- async scheduling (lesson 14): advance the step in flight, schedule the next, then resolve ---------------

TEST(AsyncScheduling11, TheNextDecodeIsScheduledBeforeItsTokenIsKnown) {
  SlotAllocator slots(2, 32);
  Scheduler s(config_for(64, 2, 32), slots);
  const int64_t a = s.add({1, 2, 3}, greedy(5));
  const int64_t b = s.add({4, 5}, greedy(5));
  const ScheduledBatch prefill = s.schedule();
  s.advance(prefill);  // the GPU runs the prefill; its ids are not back
  const Sequence* as = s.find(a);
  EXPECT_EQ(as->num_computed, 3);
  EXPECT_EQ(as->output, (std::vector<int32_t>{kPendingToken}));
  EXPECT_EQ(as->pending_row, 0);
  EXPECT_EQ(s.find(b)->pending_row, 1);
  ScheduledBatch decode = s.schedule();  // both decode the ids they do not know yet
  ASSERT_EQ(decode.num_sequences(), 2);
  EXPECT_EQ(decode.num_decodes(), 2);
  EXPECT_EQ(decode.token_ids, (std::vector<int32_t>{kPendingToken, kPendingToken}));
  EXPECT_EQ(decode.positions, (std::vector<int32_t>{3, 2}));
  ASSERT_EQ(decode.pending_tokens.size(), 2u);
  EXPECT_EQ(decode.pending_tokens[0].token_row, 0);
  EXPECT_EQ(decode.pending_tokens[0].source_row, 0);
  EXPECT_EQ(decode.pending_tokens[1].token_row, 1);
  EXPECT_EQ(decode.pending_tokens[1].source_row, 1);
  // The prefill's ids arrive: written over the placeholders, one event each.
  const std::vector<TokenEvent> ev = s.resolve(prefill, {7, 8});
  ASSERT_EQ(ev.size(), 2u);
  EXPECT_EQ(ev[0].id, a);
  EXPECT_EQ(ev[0].token, 7);
  EXPECT_FALSE(ev[0].finished);
  EXPECT_EQ(ev[1].token, 8);
  EXPECT_EQ(as->output, (std::vector<int32_t>{7}));
  EXPECT_EQ(as->pending_row, -1);
  const std::vector<int32_t> ids = {7, 8}, short_ids = {7};
  EXPECT_EQ(decode.token_ids_filled(ids), (std::vector<int32_t>{7, 8}));  // what the engine does on the device
  EXPECT_THROW(decode.token_ids_filled(short_ids), std::logic_error);    // a row the step before did not have
}

TEST(AsyncScheduling11, ALastIdStillInFlightIsNotScheduledAgain) {
  SlotAllocator slots(2, 32);
  Scheduler s(config_for(64, 2, 32), slots);
  const int64_t a = s.add({1, 2, 3}, greedy(2));  // two ids: the second is certainly the last
  const ScheduledBatch prefill = s.schedule();
  s.advance(prefill);
  const ScheduledBatch decode = s.schedule();
  ASSERT_EQ(decode.num_sequences(), 1);
  EXPECT_THROW(s.advance(decode), std::logic_error) << "the prefill's id is not resolved yet";
  s.resolve(prefill, {9});
  s.advance(decode);
  // No placeholder for the last id: nothing would feed it, so nothing is left to schedule.
  EXPECT_EQ(s.find(a)->output, (std::vector<int32_t>{9}));
  EXPECT_EQ(s.find(a)->pending_row, 0);
  EXPECT_EQ(s.find(a)->num_uncomputed(), 0);
  EXPECT_TRUE(s.schedule().empty());
  EXPECT_TRUE(s.has_work());  // it waits for its last id
  const std::vector<TokenEvent> ev = s.resolve(decode, {4});
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_TRUE(ev[0].finished);
  EXPECT_EQ(ev[0].reason, FinishReason::Length);
  EXPECT_EQ(s.find(a)->output, (std::vector<int32_t>{9, 4}));
  EXPECT_EQ(slots.free_slots(), 2);
  EXPECT_FALSE(s.has_work());
}

TEST(AsyncScheduling11, AnEosSeenOneStepLateDropsTheExtraRow) {
  SlotAllocator slots(2, 32);
  Scheduler s(config_for(64, 2, 32), slots);  // EOS id 0
  const int64_t a = s.add({1, 2, 3}, greedy(5, /*ignore_eos=*/false));
  const ScheduledBatch prefill = s.schedule();
  s.advance(prefill);
  const ScheduledBatch decode = s.schedule();  // runs on the GPU while the host learns the prefill's id is EOS
  ASSERT_EQ(decode.num_sequences(), 1);
  const std::vector<TokenEvent> ev = s.resolve(prefill, {0});
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].reason, FinishReason::Stop);
  EXPECT_EQ(slots.free_slots(), 2);  // freed at once; the step in flight writes only its own old slot
  s.advance(decode);                 // nothing: finished
  EXPECT_TRUE(s.resolve(decode, {6}).empty());
  EXPECT_EQ(s.find(a)->output, (std::vector<int32_t>{0}));
  EXPECT_EQ(s.find(a)->num_computed, 3);
}

TEST(AsyncScheduling11, AbortAndPreemptionWithAnIdInFlight) {
  TokenPool pool(9, 64);
  Scheduler s(config_for(64, 4, 64), pool);
  const int64_t a = s.add({1, 2, 3, 4}, greedy(5));
  const int64_t b = s.add({5, 6, 7, 8}, greedy(5));
  const int64_t c = s.add({9, 9}, greedy(5));
  const ScheduledBatch prefill = s.schedule();  // a and b: 8 of 9 tokens; c does not fit
  ASSERT_EQ(prefill.num_sequences(), 2);
  s.advance(prefill);
  const ScheduledBatch decode = s.schedule();  // a takes the last token; b, the newest, preempts itself
  EXPECT_EQ(decode.preempted, (std::vector<int64_t>{b}));
  const Sequence* bs = s.find(b);
  EXPECT_EQ(bs->state, SequenceState::Preempted);
  EXPECT_EQ(bs->output, (std::vector<int32_t>{kPendingToken}));  // its id is still to come
  EXPECT_TRUE(s.abort(a));  // with two steps in flight
  EXPECT_TRUE(s.find(a)->output.empty()) << "the placeholder is not an id";
  EXPECT_EQ(pool.free_tokens(), 9);
  const std::vector<TokenEvent> ev = s.resolve(prefill, {3, 4});
  ASSERT_EQ(ev.size(), 1u);  // a's id is dropped; b keeps its id for the rerun
  EXPECT_EQ(ev[0].id, b);
  EXPECT_EQ(bs->output, (std::vector<int32_t>{4}));
  EXPECT_EQ(bs->num_computed, 0);
  s.advance(decode);
  EXPECT_TRUE(s.resolve(decode, {5}).empty());
  // b is re-admitted (prompt and its id recomputed), then c.
  const ScheduledBatch rerun = s.schedule();
  ASSERT_GE(rerun.num_sequences(), 1);
  EXPECT_EQ(rerun.seqs[0].seq->id, b);
  EXPECT_EQ(rerun.seqs[0].q_len, 5);
  EXPECT_TRUE(rerun.pending_tokens.empty());
  (void)c;
}

// One workload through a scheduler over `alloc`, with the async Driver; every request must equal alone.
template <class Allocator>
Driver run_async(Allocator& alloc, const SchedulerConfig& c, Workload& w, FakeModel& model) {
  Scheduler s(c, alloc);
  for (const SimRequest& r : w.requests) w.ids.push_back(s.add(r.prompt, r.params));
  Driver d{s, model};
  d.async = true;
  d.run();
  expect_outputs_equal_alone(s, w, c.max_context);
  return d;
}

TEST(AsyncScheduling11, EveryWorkloadEqualsAlone) {
  // The simulation's workloads with async scheduling: the same ids as alone, every step checked as before.
  {
    SCOPED_TRACE("slots, chunked prefill");
    SlotAllocator slots(8, 512);
    FakeModel model(slots.num_kv_slots(), kVocab);
    Workload w{make_workload(64, 1, 300, 1, 80, kVocab, 7), {}};
    const Driver d = run_async(slots, config_for(64, 8, 512), w, model);
    EXPECT_GT(d.pending, 1000) << "decodes should feed ids that were still in flight";
    EXPECT_EQ(slots.free_slots(), 8);
  }
  {
    SCOPED_TRACE("a small pool: preemption");
    TokenPool pool(600, 512);
    FakeModel model(pool.num_kv_slots(), kVocab);
    Workload w{make_workload(64, 1, 200, 1, 150, kVocab, 11), {}};
    EXPECT_GT(run_async(pool, config_for(96, 16, 512), w, model).preempted, 0) << "the pool was meant to run out";
    EXPECT_EQ(pool.free_tokens(), 600);
  }
  {
    SCOPED_TRACE("without chunked prefill");
    SlotAllocator slots(6, 128);
    SchedulerConfig c = config_for(160, 6, 128);
    c.chunked_prefill = false;
    FakeModel model(slots.num_kv_slots(), kVocab);
    Workload w{make_workload(40, 1, 100, 1, 60, kVocab, 5), {}};
    EXPECT_EQ(run_async(slots, c, w, model).chunks, 0);
    EXPECT_EQ(slots.free_slots(), 6);
  }
  {
    SCOPED_TRACE("run_until_idle_async");
    SlotAllocator slots(8, 256);
    Scheduler s(config_for(64, 8, 256), slots);
    FakeModel model(slots.num_kv_slots(), kVocab);
    Workload w{make_workload(32, 1, 100, 1, 60, kVocab, 9), {}};
    for (const SimRequest& r : w.requests) w.ids.push_back(s.add(r.prompt, r.params));
    EXPECT_GT(run_until_idle_async(s, model), 0);
    expect_outputs_equal_alone(s, w, 256);
    EXPECT_EQ(slots.free_slots(), 8);
  }
}

}  // namespace
}  // namespace tvllm
