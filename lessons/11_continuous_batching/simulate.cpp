// Lesson 11: the fake model and the driver loop (simulate.h).
#include "simulate.h"

#include <algorithm>
#include <optional>
#include <stdexcept>
#include <string>

#include "common/input_error.h"
#include "common/random.h"

namespace tvllm {
namespace {

constexpr uint64_t kStartState = 0x9e3779b97f4a7c15ull;  // state(-1): before the first token

std::string where(const Sequence& seq, int64_t position) {
  return "sequence " + std::to_string(seq.id) + " position " + std::to_string(position);
}

}  // namespace

uint64_t FakeModel::next_state(uint64_t prev, int32_t token, int64_t position) {
  // splitmix64's finaliser over the three inputs: every bit of the result depends on every input bit.
  uint64_t z = prev ^ (static_cast<uint64_t>(static_cast<uint32_t>(token)) * 0xbf58476d1ce4e5b9ull) ^
               (static_cast<uint64_t>(position) << 32);
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

FakeModel::FakeModel(int64_t num_kv_slots, int32_t vocab) : vocab_(vocab) {
  TVLLM_REQUIRE(num_kv_slots >= 1, "fake model: num_kv_slots must be >= 1");
  TVLLM_REQUIRE(vocab >= 2, "fake model: vocab must be >= 2");
  cache_.resize(static_cast<size_t>(num_kv_slots));
}

std::vector<int32_t> FakeModel::step(const ScheduledBatch& batch, const KvAllocator& allocator) {
  std::vector<int32_t> ids;
  size_t row = 0;  // the token row of the batch
  for (const ScheduledSequence& s : batch.seqs) {
    const Sequence& seq = *s.seq;
    // The context before this step must be in the cache already: read it back, as attention would.
    for (int64_t p = 0; p < s.k_len; ++p) {
      const int64_t slot = allocator.kv_slot(seq, p);
      if (slot < 0 || slot >= static_cast<int64_t>(cache_.size()))
        throw std::logic_error("fake model: KV slot " + std::to_string(slot) + " out of range at " + where(seq, p));
      const uint64_t prev = p == 0 ? kStartState : cache_[static_cast<size_t>(allocator.kv_slot(seq, p - 1))].state;
      // The token at p. A new token the host does not know yet (async scheduling: kPendingToken) is the one the
      // batch brings, filled in from the step before; the step after reads it back against the real id.
      int32_t token = seq.token(p);
      if (p >= s.start) {  // a new token: the KV write goes where the slot mapping says
        const int32_t fed = batch.token_ids.at(row);
        if (token == kPendingToken) token = fed;
        if (batch.slot_mapping.at(row) != slot || fed != token || fed < 0 || batch.positions.at(row) != p)
          throw std::logic_error("fake model: the batch's row " + std::to_string(row) + " does not describe " +
                                 where(seq, p));
        cache_[static_cast<size_t>(slot)] = Entry{token, p, next_state(prev, token, p)};
        ++written_;
        ++row;
      }
      const Entry& e = cache_[static_cast<size_t>(slot)];
      if (e.token != token || e.position != p || e.state != next_state(prev, token, p))
        throw std::logic_error("fake model: the cache at KV slot " + std::to_string(slot) + " does not hold " +
                               where(seq, p) + " (it holds token " + std::to_string(e.token) + " at position " +
                               std::to_string(e.position) + ")");
    }
    if (s.wants_logits)
      ids.push_back(pick(cache_[static_cast<size_t>(allocator.kv_slot(seq, s.k_len - 1))].state, vocab_));
  }
  if (row != batch.token_ids.size())
    throw std::logic_error("fake model: the batch has " + std::to_string(batch.token_ids.size()) +
                           " token rows, its sequences " + std::to_string(row));
  return ids;
}

std::vector<int32_t> reference_output(const std::vector<int32_t>& prompt, const RequestParams& params,
                                      const std::vector<int32_t>& eos_ids, int64_t max_context, int32_t vocab) {
  uint64_t state = kStartState;
  int64_t position = 0;
  for (int32_t t : prompt) state = FakeModel::next_state(state, t, position++);
  std::vector<int32_t> out;
  for (;;) {
    const int32_t t = FakeModel::pick(state, vocab);
    out.push_back(t);
    const auto has = [t](const std::vector<int32_t>& ids) { return std::find(ids.begin(), ids.end(), t) != ids.end(); };
    if (has(params.stop_ids) || (!params.ignore_eos && has(eos_ids))) break;
    if (static_cast<int64_t>(out.size()) >= params.max_tokens || position + 1 >= max_context) break;
    state = FakeModel::next_state(state, t, position++);
  }
  return out;
}

std::vector<SimRequest> make_workload(int n, int64_t min_prompt, int64_t max_prompt, int64_t min_output,
                                      int64_t max_output, int32_t vocab, uint64_t seed) {
  TVLLM_REQUIRE(n >= 0 && min_prompt >= 1 && max_prompt >= min_prompt && min_output >= 1 && max_output >= min_output &&
                    vocab >= 2,
                "make_workload: bad workload bounds");
  Rng rng(seed);
  std::vector<SimRequest> requests(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    SimRequest& r = requests[static_cast<size_t>(i)];
    r.prompt.resize(static_cast<size_t>(min_prompt + rng.below(max_prompt - min_prompt + 1)));
    for (int32_t& t : r.prompt) t = static_cast<int32_t>(1 + rng.below(vocab - 1));
    r.params.max_tokens = min_output + rng.below(max_output - min_output + 1);
    r.params.ignore_eos = i % 2 == 1;
    r.params.sampling.temperature = 0.0f;  // greedy
  }
  return requests;
}

int64_t run_until_idle(Scheduler& scheduler, FakeModel& model,
                       const std::function<void(const ScheduledBatch&)>& on_step, int64_t max_steps) {
  int64_t steps = 0;
  while (scheduler.has_work()) {
    if (steps >= max_steps)
      throw std::logic_error("run_until_idle: still busy after " + std::to_string(steps) + " steps");
    const ScheduledBatch batch = scheduler.schedule();
    if (batch.empty())
      throw std::logic_error("run_until_idle: the scheduler has work but scheduled nothing (stuck) at step " +
                             std::to_string(steps));
    if (on_step) on_step(batch);
    scheduler.postprocess(batch, model.step(batch, scheduler.allocator()));
    ++steps;
  }
  return steps;
}

int64_t run_until_idle_async(Scheduler& scheduler, FakeModel& model,
                             const std::function<void(const ScheduledBatch&)>& on_step, int64_t max_steps) {
  int64_t steps = 0;
  std::optional<ScheduledBatch> in_flight;  // the step "on the GPU": scheduled and run, its ids not read yet
  std::vector<int32_t> in_flight_ids;
  while (scheduler.has_work() || in_flight) {
    if (steps >= max_steps)
      throw std::logic_error("run_until_idle_async: still busy after " + std::to_string(steps) + " steps");
    if (in_flight) scheduler.advance(*in_flight);
    ScheduledBatch batch = scheduler.schedule();
    if (batch.empty() && !in_flight)
      throw std::logic_error("run_until_idle_async: the scheduler has work but scheduled nothing (stuck) at step " +
                             std::to_string(steps));
    std::vector<int32_t> ids;
    if (!batch.empty()) {
      if (on_step) on_step(batch);
      // "Launch": the model runs the step with the allocator as schedule() left it, BEFORE the ids of the step
      // in flight are resolved, as the GPU runs step N + 1 while the host has not seen step N's ids.
      if (!batch.pending_tokens.empty()) batch.token_ids = batch.token_ids_filled(in_flight_ids);
      ids = model.step(batch, scheduler.allocator());
      ++steps;
    }
    if (in_flight) scheduler.resolve(*in_flight, in_flight_ids);
    if (batch.empty()) {
      in_flight.reset();
    } else {
      in_flight = std::move(batch);
      in_flight_ids = std::move(ids);
    }
  }
  return steps;
}

}  // namespace tvllm
