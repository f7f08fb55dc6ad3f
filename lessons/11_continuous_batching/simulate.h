// Lesson 11: the scheduler without a GPU. A fake model, its answer for a request run alone, and a driver loop.
//
// FakeModel stands in for forward() + sampling. What it "computes" for a token depends on EVERY token before it,
// through a simulated KV cache that it reads and writes at the addresses the scheduler and the allocator hand
// out, as a transformer's k and v do:
//
//   state(p) = mix(state(p - 1), token p, p)          state(p - 1) READ from the cache at kv_slot(seq, p - 1)
//   cache[slot_mapping[i]] = {token p, p, state(p)}    the KV write of this step's token i
//   next id  = state(last fed token) mod vocab        and, first, every position of the context is read back
//                                                      through the allocator and checked (token and position)
//
// So a wrong slot, a block table that points at someone else's block, a prefix hit on the wrong tokens, a
// chunk that skips or repeats a token, or a preempted sequence that resumes wrong all change the ids (or throw
// at once), and "every request gives the ids it gives alone" (reference_output) is a real test of the
// scheduler and the allocator. Host-only.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "kv_allocator.h"
#include "scheduler.h"

namespace tvllm {

class FakeModel {
 public:
  // A cache of num_kv_slots entries (the allocator's num_kv_slots()); ids in [0, vocab).
  FakeModel(int64_t num_kv_slots, int32_t vocab);

  // One step: writes the batch's new tokens and returns one id per logits row (batch.logits_rows order).
  // Throws std::logic_error naming the sequence and position when the cache does not hold what it should.
  std::vector<int32_t> step(const ScheduledBatch& batch, const KvAllocator& allocator);

  static uint64_t next_state(uint64_t prev, int32_t token, int64_t position);
  static int32_t pick(uint64_t state, int32_t vocab) {
    return static_cast<int32_t>(state % static_cast<uint64_t>(vocab));
  }
  int32_t vocab() const { return vocab_; }

  int64_t tokens_written() const { return written_; }

 private:
  struct Entry {
    int32_t token = -1;
    int64_t position = -1;
    uint64_t state = 0;
  };
  std::vector<Entry> cache_;
  int32_t vocab_;
  int64_t written_ = 0;
};

// The ids FakeModel gives a request run alone, with the scheduler's stop rules (stop ids, EOS unless
// ignore_eos, max_tokens, max_context).
std::vector<int32_t> reference_output(const std::vector<int32_t>& prompt, const RequestParams& params,
                                      const std::vector<int32_t>& eos_ids, int64_t max_context, int32_t vocab);

// A deterministic mixed workload: n requests with prompt lengths uniform in [min_prompt, max_prompt], max_tokens
// uniform in [min_output, max_output], ids uniform in [1, vocab); every other request ignores EOS (so some run
// to max_tokens and some stop early at the fake model's EOS). Same seed, same requests, on every machine.
struct SimRequest {
  std::vector<int32_t> prompt;
  RequestParams params;
};
std::vector<SimRequest> make_workload(int n, int64_t min_prompt, int64_t max_prompt, int64_t min_output,
                                      int64_t max_output, int32_t vocab, uint64_t seed);

// schedule -> model.step -> postprocess until the scheduler has no work, calling on_step(batch) after each
// schedule(). Returns the number of steps. Throws std::logic_error if a step comes back empty while work is
// left (the scheduler is stuck) or after max_steps steps.
int64_t run_until_idle(Scheduler& scheduler, FakeModel& model,
                       const std::function<void(const ScheduledBatch&)>& on_step = {}, int64_t max_steps = 1000000);

// The same with async scheduling (lesson 14), in the engine's order: advance(step N); schedule step N + 1 (its
// pending tokens filled from step N's ids) and run it; only then resolve(step N). Returns the steps run.
int64_t run_until_idle_async(Scheduler& scheduler, FakeModel& model,
                             const std::function<void(const ScheduledBatch&)>& on_step = {},
                             int64_t max_steps = 1000000);

}  // namespace tvllm
