// Lesson 11 on the CPU: the engine on the bundled model. 64 concurrent greedy requests of mixed prompt and output
// lengths give exactly the ids each gives alone (lesson 10's Generator) - with a contiguous cache that refills its
// slots, and with chunked prefill under a small token budget; the token stream (tokens in order, one Finished
// with the usage); abort frees the KV cache at once; bad requests are refused at submit; an error inside a step
// fails that step's requests and returns their KV; a sink that throws aborts its request; submit and abort from
// other threads; and the throughput workload's generator equals hf_baseline.py's. After every test all KV is free.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <chrono>
#include <cstdio>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "common/errors.h"
#include "engine.h"
#include "engine_bench.h"
#include "engine_check.h"
#include "model_dir.h"
#include "model_weights.h"
#include "testing/engine_fixture.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

const testing::BundledModel<Device::CPU>& bundled() { return testing::bundled_model<Device::CPU>(); }

constexpr int64_t kMaxContext = 128;

EngineConfig config(int64_t budget, int64_t max_sequences, bool chunked = true) {
  return testing::engine_config(budget, max_sequences, kMaxContext, chunked);
}

// Ids the bundled model often produces after random prompts: the requests that do not ignore EOS stop at them
// (random prompts rarely lead the model to its EOS), so the stop path runs.
const std::vector<int32_t> kStopIds = {13};

std::vector<CheckRequest> mixed_requests(int n = 64, uint64_t seed = 11) {
  return make_check_requests(n, 2, 32, 1, 24, workload_id_high(bundled().w.config), seed, 0, kStopIds);
}

// Each workload's alone results, computed once.
const AloneResults& alone(const std::vector<CheckRequest>& requests) {
  static std::vector<std::pair<std::vector<CheckRequest>, AloneResults>> cache;
  for (const auto& [r, a] : cache)
    if (r.size() == requests.size() && std::equal(r.begin(), r.end(), requests.begin(), [](const auto& x, const auto& y) {
          return x.prompt == y.prompt && x.params.max_tokens == y.params.max_tokens &&
                 x.params.ignore_eos == y.params.ignore_eos && x.params.stop_ids == y.params.stop_ids;
        }))
      return a;
  cache.emplace_back(requests, run_alone(bundled().w, requests, kMaxContext));
  return cache.back().second;
}

AloneCheck check_alone(const std::vector<CheckRequest>& requests, const EngineRunResult& run) {
  return check_against_alone(bundled().w, requests, run, alone(requests), kMaxContext);
}

void expect_all_free(Engine& engine) {
  const KvUsage u = engine.kv().usage();
  EXPECT_EQ(u.free_blocks, u.total_blocks) << u.kind;
  EXPECT_FALSE(engine.has_work());
}

RequestParams greedy(int64_t max_tokens, bool ignore_eos = true) {
  RequestParams p;
  p.sampling = SamplingParams{0.0f, 0, 1.0f, 0};
  p.max_tokens = max_tokens;
  p.ignore_eos = ignore_eos;
  return p;
}

TEST(Engine11, ConcurrentEqualsAloneWithContiguousSlots) {
  // 64 requests, 24 slots: a slot is refilled as soon as its request finishes.
  const auto requests = mixed_requests();
  Engine engine(bundled().w, config(512, 24), contiguous_kv(24));
  const EngineRunResult run = run_requests(engine, requests);
  EXPECT_TRUE(run.events_ok) << run.events_error;
  const AloneCheck check = check_alone(requests, run);
  EXPECT_TRUE(check.pass()) << check.summary();
  EXPECT_EQ(check.exact, 64);
  const EngineStats s = engine.stats();
  EXPECT_EQ(s.peak_running, 24);
  EXPECT_EQ(s.finished_stop + s.finished_length, 64);
  EXPECT_GT(s.finished_stop, 0) << "some requests should stop at EOS or a stop id";
  EXPECT_EQ(s.kv.kind, "contiguous");
  std::printf("contiguous, 24 slots: %s, %lld steps\n", check.summary().c_str(), static_cast<long long>(run.steps));
  expect_all_free(engine);
}

TEST(Engine11, ChunkedPrefillUnderASmallBudgetEqualsAlone) {
  // A budget of 16 tokens: every prompt longer than what the decodes leave is cut into chunks.
  const auto requests = mixed_requests();
  Engine engine(bundled().w, config(16, 8), contiguous_kv(8));
  const EngineRunResult run = run_requests(engine, requests);
  EXPECT_TRUE(run.events_ok) << run.events_error;
  const AloneCheck check = check_alone(requests, run);
  EXPECT_TRUE(check.pass()) << check.summary();
  EXPECT_LE(engine.scheduler().stats().max_step_tokens, 16);
  EXPECT_EQ(engine.scheduler().stats().max_step_tokens, 16);  // the budget was used up by some steps
  expect_all_free(engine);
}

TEST(Engine11, WithoutChunkedPrefillEqualsAlone) {
  const auto requests = mixed_requests(16, 12);
  Engine engine(bundled().w, config(kMaxContext, 8, false), contiguous_kv(8));
  const EngineRunResult run = run_requests(engine, requests);
  const AloneCheck check = check_alone(requests, run);
  EXPECT_TRUE(check.pass()) << check.summary();
  expect_all_free(engine);
}

TEST(Engine11, BatchInvariantModeEqualsAlone) {
  // EngineConfig::batch_invariant: every attention through the prefill path, the Generator alone set the same
  // way; exact equality is then required on every device (AloneCheck::exact_required).
  const auto requests = mixed_requests(32, 13);
  const AloneResults invariant_alone = run_alone(bundled().w, requests, kMaxContext, /*batch_invariant=*/true);
  EngineConfig c = config(16, 8);
  c.batch_invariant = true;
  Engine engine(bundled().w, c, contiguous_kv(8));
  // Every projection through lesson 06's batch-invariant version (v8; the CPU path ignores the choice).
  EXPECT_EQ(engine.context().matmul_kernel(), kBatchInvariantMatmulKernel);
  const EngineRunResult run = run_requests(engine, requests);
  const AloneCheck check = check_against_alone(bundled().w, requests, run, invariant_alone, kMaxContext);
  EXPECT_TRUE(check.exact_required);
  EXPECT_TRUE(check.pass()) << check.summary();
  EXPECT_EQ(check.exact, 32);
  expect_all_free(engine);
  // The check refuses to compare an invariant engine with a Generator that was not.
  EXPECT_THROW(run_engine_case(bundled().w, c, contiguous_kv(8), requests, alone(requests)), InputError);
}

TEST(Engine11, TokensStreamInOrderThenOneFinishedWithUsage) {
  std::vector<int32_t> synchronous;
  for (const bool async : {false, true}) {  // lesson 14's async scheduling: the same stream, one step later
    SCOPED_TRACE(async ? "async scheduling" : "synchronous");
    EngineConfig c = config(256, 4);
    c.async_scheduling = async;
    Engine engine(bundled().w, c);
    EventQueue queue;
    const int64_t id = engine.submit({1, 2, 3, 4, 5}, greedy(6), queue.sink());
    engine.run_until_idle();
    std::vector<int32_t> tokens;
    std::optional<EngineEvent> e;
    while ((e = queue.try_pop())) {
      EXPECT_EQ(e->request_id, id);
      if (e->kind == EngineEvent::Kind::Token) {
        tokens.push_back(e->token);
        continue;
      }
      EXPECT_EQ(e->reason, FinishReason::Length);
      EXPECT_EQ(e->usage.prompt_tokens, 5);
      EXPECT_EQ(e->usage.completion_tokens, 6);
      EXPECT_EQ(e->usage.cached_tokens, 0);
      EXPECT_TRUE(e->error.empty());
      EXPECT_EQ(queue.size(), 0u) << "nothing after Finished";
    }
    EXPECT_EQ(tokens.size(), 6u);
    EXPECT_EQ(engine.stats().generated_tokens, 6);
    expect_all_free(engine);
    if (async) {
      EXPECT_EQ(tokens, synchronous);
    } else {
      synchronous = tokens;
    }
  }
}

TEST(Engine11, AbortFreesTheSlotAtOnce) {
  Engine engine(bundled().w, config(256, 2), contiguous_kv(2));
  EventQueue a, b, c;
  const int64_t ia = engine.submit({1, 2, 3}, greedy(50), a.sink());
  const int64_t ib = engine.submit({4, 5, 6}, greedy(50), b.sink());
  const int64_t ic = engine.submit({7, 8, 9}, greedy(5), c.sink());  // waits: two slots
  engine.step();
  engine.step();
  EXPECT_EQ(engine.stats().running, 2);
  EXPECT_EQ(engine.stats().waiting, 1);
  EXPECT_EQ(engine.kv().usage().free_blocks, 0);
  engine.abort(ia);
  engine.abort(ic);     // a waiting one
  engine.abort(12345);  // unknown: nothing
  engine.process_inbox();
  // Freed before any further step: one slot free again, one running, nothing waiting.
  EXPECT_EQ(engine.kv().usage().free_blocks, 1);
  EXPECT_EQ(engine.stats().running, 1);
  EXPECT_EQ(engine.stats().waiting, 0);
  EXPECT_EQ(engine.stats().aborted, 2);
  int tokens_a = 0;
  std::optional<EngineEvent> e;
  FinishReason ra = FinishReason::None, rc = FinishReason::None;
  while ((e = a.try_pop())) e->kind == EngineEvent::Kind::Token ? (void)++tokens_a : (void)(ra = e->reason);
  while ((e = c.try_pop())) rc = e->reason;
  EXPECT_EQ(tokens_a, 2);  // prefill + one decode
  EXPECT_EQ(ra, FinishReason::Abort);
  EXPECT_EQ(rc, FinishReason::Abort);
  engine.abort(ia);  // already finished: nothing
  engine.run_until_idle();
  int tokens_b = 0;
  while ((e = b.try_pop())) tokens_b += e->kind == EngineEvent::Kind::Token;
  EXPECT_EQ(tokens_b, 50);
  (void)ib;
  expect_all_free(engine);
}

TEST(Engine11, BadRequestsAreRefusedAtSubmit) {
  Engine engine(bundled().w, config(256, 4));
  const auto sink = [](const EngineEvent&) {};
  EXPECT_THROW(engine.submit({}, greedy(4), sink), InputError);
  EXPECT_THROW(engine.submit({1, 1000}, greedy(4), sink), InputError);  // vocab 1000
  EXPECT_THROW(engine.submit({-1}, greedy(4), sink), InputError);
  EXPECT_THROW(engine.submit(std::vector<int32_t>(kMaxContext, 1), greedy(4), sink), InputError);
  EXPECT_THROW(engine.submit({1}, greedy(0), sink), InputError);
  RequestParams bad = greedy(4);
  bad.sampling.temperature = -1.0f;
  EXPECT_THROW(engine.submit({1}, bad, sink), InputError);
  EXPECT_THROW(engine.submit({1}, greedy(4), TokenSink{}), InputError);
  EXPECT_FALSE(engine.has_work());
  EXPECT_EQ(engine.stats().requests_submitted, 0);
  // A config the step could not run.
  EXPECT_THROW(Engine(bundled().w, config(4, 8)), InputError);  // budget < max_sequences
}

// A KV side that fails prepare() when armed: an error in the middle of a step.
class FailingKv final : public EngineKv {
 public:
  FailingKv(std::unique_ptr<EngineKv> inner, std::atomic<bool>& armed) : inner_(std::move(inner)), armed_(armed) {}
  KvAllocator& allocator() override { return inner_->allocator(); }
  AttentionBackend& attention() override { return inner_->attention(); }
  void prepare(const ScheduledBatch& batch, cudaStream_t stream) override {
    if (armed_) throw std::runtime_error("injected failure");
    inner_->prepare(batch, stream);
  }
  void set_decode_attention(DecodeAttention decode) override { inner_->set_decode_attention(decode); }
  KvUsage usage() const override { return inner_->usage(); }
  std::string describe() const override { return inner_->describe(); }

 private:
  std::unique_ptr<EngineKv> inner_;
  std::atomic<bool>& armed_;
};

TEST(Engine11, AnErrorInAStepFailsItsRequestsAndReturnsTheirKv) {
  std::atomic<bool> armed{false};
  const KvFactory inner = contiguous_kv(4);
  Engine engine(bundled().w, config(256, 4), [&](const ModelWeights& w, const EngineLimits& l) {
    return std::make_unique<FailingKv>(inner(w, l), armed);
  });
  EventQueue q;
  for (int i = 0; i < 3; ++i) engine.submit({1, 2, static_cast<int32_t>(3 + i)}, greedy(20), q.sink());
  engine.step();
  armed = true;
  engine.step();
  armed = false;
  EXPECT_EQ(engine.stats().failed, 3);
  int finished = 0;
  std::optional<EngineEvent> e;
  while ((e = q.try_pop())) {
    if (e->kind == EngineEvent::Kind::Finished) {
      ++finished;
      EXPECT_EQ(e->reason, FinishReason::Error);
      EXPECT_NE(e->error.find("injected failure"), std::string::npos) << e->error;
      EXPECT_EQ(e->usage.completion_tokens, 1);  // the prefill's id came through before
    }
  }
  EXPECT_EQ(finished, 3);
  expect_all_free(engine);
  // The engine goes on.
  const auto requests = mixed_requests(4, 13);
  const EngineRunResult run = run_requests(engine, requests);
  EXPECT_TRUE(check_alone(requests, run).pass());
  expect_all_free(engine);
}

// A KV side whose allocator never takes a slot back (free() forgets it): the slot leak of a buggy step. With
// two slots, the third request waits forever; run_until_idle must say so in milliseconds, not spin for minutes.
class LeakingAllocator final : public KvAllocator {
 public:
  explicit LeakingAllocator(KvAllocator& inner) : inner_(inner) {}
  int64_t max_tokens_per_sequence() const override { return inner_.max_tokens_per_sequence(); }
  int64_t num_kv_slots() const override { return inner_.num_kv_slots(); }
  bool fits_alone(int64_t tokens) const override { return inner_.fits_alone(tokens); }
  bool can_allocate(const Sequence& seq, int64_t tokens) const override { return inner_.can_allocate(seq, tokens); }
  int64_t allocate(Sequence& seq, int64_t tokens) override { return inner_.allocate(seq, tokens); }
  bool can_append(const Sequence& seq, int64_t tokens) const override { return inner_.can_append(seq, tokens); }
  void append(Sequence& seq, int64_t tokens) override { inner_.append(seq, tokens); }
  void free(Sequence& seq) override { seq.kv_blocks.clear(); }  // the slot is lost
  int64_t kv_slot(const Sequence& seq, int64_t position) const override { return inner_.kv_slot(seq, position); }

 private:
  KvAllocator& inner_;
};

class LeakingKv final : public EngineKv {
 public:
  explicit LeakingKv(std::unique_ptr<EngineKv> inner) : inner_(std::move(inner)), leaking_(inner_->allocator()) {}
  KvAllocator& allocator() override { return leaking_; }
  AttentionBackend& attention() override { return inner_->attention(); }
  void prepare(const ScheduledBatch& batch, cudaStream_t stream) override { inner_->prepare(batch, stream); }
  void set_decode_attention(DecodeAttention decode) override { inner_->set_decode_attention(decode); }
  KvUsage usage() const override { return inner_->usage(); }
  std::string describe() const override { return inner_->describe(); }

 private:
  std::unique_ptr<EngineKv> inner_;
  LeakingAllocator leaking_;
};

TEST(Engine11, AStuckEngineFailsFastInsteadOfSpinning) {
  const KvFactory inner = contiguous_kv(2);
  Engine engine(bundled().w, config(256, 2),
                [&](const ModelWeights& w, const EngineLimits& l) { return std::make_unique<LeakingKv>(inner(w, l)); });
  for (int i = 0; i < 3; ++i) engine.submit({1, 2, static_cast<int32_t>(3 + i)}, greedy(2), [](const EngineEvent&) {});
  const auto start = std::chrono::steady_clock::now();
  std::string error;
  try {
    engine.run_until_idle();
  } catch (const std::logic_error& e) {
    error = e.what();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(error.find("stuck"), std::string::npos) << "got: '" << error << "'";
  EXPECT_NE(error.find("1 waiting, 0 running"), std::string::npos) << error;
  EXPECT_LT(seconds, 5.0);
}

TEST(Engine11, ASinkThatThrowsAbortsItsRequest) {
  for (const bool async : {false, true}) {  // and with lesson 14's async scheduling: ids delivered a step later
    SCOPED_TRACE(async ? "async scheduling" : "synchronous");
    EngineConfig c = config(256, 4);
    c.async_scheduling = async;
    Engine engine(bundled().w, c);
    int calls = 0;
    EventQueue other;
    engine.submit({1, 2, 3}, greedy(20), [&](const EngineEvent& e) {
      ++calls;
      if (e.kind == EngineEvent::Kind::Token && calls == 3) throw std::runtime_error("client went away");
    });
    engine.submit({4, 5, 6}, greedy(10), other.sink());
    engine.run_until_idle();
    EXPECT_EQ(calls, 4);  // three tokens, then its Finished(Abort)
    EXPECT_EQ(engine.stats().aborted, 1);
    EXPECT_EQ(engine.stats().finished_length, 1);
    expect_all_free(engine);
  }
}

// ---- async scheduling (lesson 14): the next step launched before the last one's ids are back ----------------

EngineConfig async_config(int64_t budget, int64_t max_sequences) {
  EngineConfig c = config(budget, max_sequences);
  c.async_scheduling = true;
  return c;
}

TEST(EngineAsync11, ConcurrentEqualsAlone) {
  // The same ids as alone, with slots refilled, under a small budget (chunks), and with requests that stop at a
  // stop id the host learns one step late (their extra decode is dropped).
  const auto requests = mixed_requests();
  for (const auto& [budget, slots] : {std::pair<int64_t, int64_t>{512, 24}, {16, 8}}) {
    SCOPED_TRACE("budget " + std::to_string(budget));
    Engine engine(bundled().w, async_config(budget, slots), contiguous_kv(slots));
    const EngineRunResult run = run_requests(engine, requests);
    EXPECT_TRUE(run.events_ok) << run.events_error;
    const AloneCheck check = check_alone(requests, run);
    EXPECT_TRUE(check.pass()) << check.summary();
    EXPECT_EQ(check.exact, 64);
    const EngineStats s = engine.stats();
    EXPECT_EQ(s.finished_stop + s.finished_length, 64);
    EXPECT_GT(s.finished_stop, 0) << "the stop-id path must run";
    int64_t delivered = 0;
    for (const auto& ids : run.ids) delivered += static_cast<int64_t>(ids.size());
    EXPECT_EQ(s.generated_tokens, delivered);
    expect_all_free(engine);
  }
}

TEST(EngineAsync11, AStepsIdsArriveWithTheNextStep) {
  Engine engine(bundled().w, async_config(256, 4));
  EventQueue queue;
  engine.submit({1, 2, 3, 4, 5}, greedy(6), queue.sink());
  engine.step();  // the prefill is launched; its id is not read yet
  EXPECT_TRUE(engine.has_step_in_flight());
  EXPECT_EQ(queue.size(), 0u);
  EXPECT_TRUE(engine.has_work());
  engine.step();  // the first decode is launched, then the prefill's id delivered
  EXPECT_EQ(queue.size(), 1u);
  engine.run_until_idle();
  EXPECT_FALSE(engine.has_step_in_flight());
  EXPECT_EQ(queue.size(), 7u);         // six tokens, one Finished (Engine11.TokensStreamInOrderThenOneFinishedWithUsage)
  EXPECT_EQ(engine.stats().steps, 6);  // the prefill and five decodes: the last id is not fed again
  expect_all_free(engine);
}

TEST(EngineAsync11, SeededSamplingGivesTheSameIds) {
  // Each row's random stream is keyed by the request's seed and its step (the ids it has so far, a pending one
  // included), so async scheduling draws exactly what the synchronous engine draws.
  const auto run = [](bool async) {
    EngineConfig c = config(64, 8);
    c.async_scheduling = async;
    Engine engine(bundled().w, c);
    std::vector<EventQueue> queues(8);
    for (int i = 0; i < 8; ++i) {
      RequestParams p = greedy(12 + i);
      p.sampling = SamplingParams{0.9f, 20, 0.95f, static_cast<uint64_t>(100 + i)};
      engine.submit({3, static_cast<int32_t>(10 + i), 7}, p, queues[static_cast<size_t>(i)].sink());
    }
    engine.run_until_idle();
    std::vector<std::vector<int32_t>> out(8);
    for (size_t i = 0; i < 8; ++i) {
      std::optional<EngineEvent> e;
      while ((e = queues[i].try_pop()))
        if (e->kind == EngineEvent::Kind::Token) out[i].push_back(e->token);
    }
    return out;
  };
  const auto sync = run(false), async = run(true);
  EXPECT_EQ(async, sync);
  EXPECT_EQ(sync[0].size(), 12u);
}

TEST(EngineAsync11, AbortWithAStepInFlightFreesAtOnceAndCountsOnlyDeliveredIds) {
  Engine engine(bundled().w, async_config(256, 2), contiguous_kv(2));
  EventQueue a, b;
  const int64_t ia = engine.submit({1, 2, 3}, greedy(50), a.sink());
  engine.submit({4, 5, 6}, greedy(50), b.sink());
  for (int i = 0; i < 3; ++i) engine.step();
  ASSERT_TRUE(engine.has_step_in_flight());
  engine.abort(ia);
  engine.process_inbox();
  EXPECT_EQ(engine.kv().usage().free_blocks, 1);  // at once, with its last step still in flight
  int tokens_a = 0;
  std::optional<EngineEvent> e;
  RequestUsage usage;
  while ((e = a.try_pop())) {
    if (e->kind == EngineEvent::Kind::Token) {
      ++tokens_a;
    } else {
      EXPECT_EQ(e->reason, FinishReason::Abort);
      usage = e->usage;
    }
  }
  EXPECT_EQ(tokens_a, 2);                   // three steps launched, two read back
  EXPECT_EQ(usage.completion_tokens, 2);    // the id in flight is not counted
  engine.run_until_idle();
  int tokens_b = 0;
  while ((e = b.try_pop())) tokens_b += e->kind == EngineEvent::Kind::Token;
  EXPECT_EQ(tokens_b, 50);
  expect_all_free(engine);
}

TEST(EngineAsync11, AnErrorInAStepFailsItsRequestsAndTheEngineGoesOn) {
  std::atomic<bool> armed{false};
  const KvFactory inner = contiguous_kv(4);
  Engine engine(bundled().w, async_config(256, 4), [&](const ModelWeights& w, const EngineLimits& l) {
    return std::make_unique<FailingKv>(inner(w, l), armed);
  });
  EventQueue q;
  for (int i = 0; i < 3; ++i) engine.submit({1, 2, static_cast<int32_t>(3 + i)}, greedy(20), q.sink());
  engine.step();  // the prefill, in flight
  armed = true;
  engine.step();  // the first decode fails in prepare: its three requests fail; the prefill's ids are dropped
  armed = false;
  EXPECT_EQ(engine.stats().failed, 3);
  EXPECT_FALSE(engine.has_step_in_flight());
  int finished = 0;
  std::optional<EngineEvent> e;
  while ((e = q.try_pop())) {
    ASSERT_EQ(e->kind, EngineEvent::Kind::Finished) << "no id of a failed request is delivered after its Finished";
    ++finished;
    EXPECT_EQ(e->reason, FinishReason::Error);
    EXPECT_NE(e->error.find("injected failure"), std::string::npos) << e->error;
    EXPECT_EQ(e->usage.completion_tokens, 0);
  }
  EXPECT_EQ(finished, 3);
  expect_all_free(engine);
  const auto requests = mixed_requests(4, 13);
  const EngineRunResult run = run_requests(engine, requests);
  EXPECT_TRUE(check_alone(requests, run).pass());
  expect_all_free(engine);
}

TEST(Engine11, SubmitAndAbortFromOtherThreads) {
  // The server's shape: one engine loop (here, this thread), clients on four others.
  const auto requests = mixed_requests(32, 14);
  Engine engine(bundled().w, config(256, 16), contiguous_kv(16));
  EngineRunResult run;
  run.ids.resize(requests.size());
  run.reasons.assign(requests.size(), FinishReason::None);
  std::vector<EventQueue> queues(requests.size());
  std::atomic<int> clients_done{0};
  std::vector<std::thread> clients;
  for (int t = 0; t < 4; ++t) {
    clients.emplace_back([&, t] {
      for (size_t i = static_cast<size_t>(t); i < requests.size(); i += 4) {
        engine.submit(requests[i].prompt, requests[i].params, queues[i].sink());
        // A fifth request per thread, aborted at once: it may or may not have started.
        const int64_t doomed = engine.submit({9, 9, 9}, greedy(30), [](const EngineEvent&) {});
        engine.abort(doomed);
      }
      ++clients_done;
    });
  }
  std::string failure;
  try {
    while (clients_done < 4 || engine.has_work()) {
      if (engine.wait_for_work(std::chrono::milliseconds(10))) engine.step();
    }
  } catch (const std::exception& e) {
    failure = e.what();  // the clients must still be joined
  }
  for (std::thread& t : clients) t.join();
  ASSERT_TRUE(failure.empty()) << failure;
  for (size_t i = 0; i < requests.size(); ++i) {
    std::optional<EngineEvent> e;
    while ((e = queues[i].try_pop()))
      e->kind == EngineEvent::Kind::Token ? run.ids[i].push_back(e->token) : (void)(run.reasons[i] = e->reason);
  }
  const AloneCheck check = check_alone(requests, run);
  EXPECT_TRUE(check.pass()) << check.summary();
  EXPECT_EQ(engine.stats().aborted, 32);
  EXPECT_EQ(engine.stats().requests_submitted, 64);
  expect_all_free(engine);
}

// ---- the throughput workload ------------------------------------------------------------------------------

TEST(ThroughputWorkload11, IsDeterministicAndInRange) {
  const auto a = make_throughput_workload(256, 100, 1024, 744, 0);
  const auto b = make_throughput_workload(256, 100, 1024, 744, 0);
  ASSERT_EQ(a.size(), 256u);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].prompt, b[i].prompt);
    EXPECT_GE(a[i].prompt.size(), 100u);
    EXPECT_LE(a[i].prompt.size(), 1024u);
    EXPECT_GE(a[i].output_len, 100);
    EXPECT_LE(a[i].output_len, 1024);
    for (int32_t id : a[i].prompt) ASSERT_TRUE(id >= 0 && id < 744);
  }
  EXPECT_NE(make_throughput_workload(4, 100, 1024, 744, 1)[0].prompt, a[0].prompt);
  EXPECT_EQ(workload_id_high(bundled().w.config), 744);  // bos 744 of 1000: the special ids are left out
  EXPECT_THROW(make_throughput_workload(4, 10, 5, 744, 0), InputError);
}

TEST(ThroughputWorkload11, EqualsHfBaselinePort) {
  // weights/tools/hf_baseline.py draws the same workload (its SplitMix64 port): the first 10 requests' lengths
  // and first ids must be these.
  const auto w = make_throughput_workload(10, 100, 1024, 744, 0);
  const std::string script = (testing::tiny_model_dir().parent_path() / "tools" / "hf_baseline.py").string();
  if (testing::run_command("python3 -c pass").exit_code != 0) GTEST_SKIP() << "no python3";
  const testing::CommandResult r =
      testing::run_command("python3 " + script + " --print-workload 10 --id-high 744 --seed 0 2>&1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::string want = "{\"prompt_lens\": [";
  for (size_t i = 0; i < w.size(); ++i) want += (i ? ", " : "") + std::to_string(w[i].prompt.size());
  want += "], \"output_lens\": [";
  for (size_t i = 0; i < w.size(); ++i) want += (i ? ", " : "") + std::to_string(w[i].output_len);
  want += "], \"first_ids\": [";
  for (size_t i = 0; i < w.size(); ++i) want += (i ? ", " : "") + std::to_string(w[i].prompt[0]);
  want += "]}";
  EXPECT_EQ(r.output.substr(0, r.output.find('\n')), want);
}

}  // namespace
}  // namespace tvllm
