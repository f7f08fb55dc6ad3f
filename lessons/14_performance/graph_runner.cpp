// Lesson 14: the graph runner (graph_runner.h).
#include "graph_runner.h"

#include <algorithm>
#include <chrono>
#include <string>

#include "common/device.h"
#include "common/errors.h"
#include "common/exercise.h"
#include "kv_cache.h"

namespace tvllm {

bool is_decode_step(const StepInputs& step) {
  const int64_t B = step.num_sequences();
  if (B < 1 || step.num_tokens() != B || step.num_logits_rows() != B) return false;
  // B tokens for B sequences, each bringing at least one: exactly one each. Rows in token order.
  const int32_t* rows = step.host_logits_rows();
  for (int64_t i = 0; i < B; ++i)
    if (rows[i] != i) return false;
  return step.batch().max_q_len() == 1;
}

int64_t context_bucket(int64_t max_k_len) {
  int64_t bucket = 64;
  while (bucket < max_k_len) bucket *= 2;
  return bucket;
}

int graph_decode_splits(const AttentionShape& shape, int batch, int64_t max_k_len, int num_sms,
                        DecodeAttention decode) {
  return decode_splits_for(decode, shape, batch, context_bucket(max_k_len), num_sms);
}

namespace {
int sm_count() { return cuda_available() ? query_device().multiprocessors : 0; }
}  // namespace

int64_t GraphBuckets::padded(int64_t batch) const {
  if (batch <= exact || batch > max_batch) return batch;
  const int64_t up = (batch + step - 1) / step * step;
  return std::min(up, max_batch);
}

std::vector<int64_t> GraphBuckets::buckets() const {
  std::vector<int64_t> out;
  for (int64_t b = exact + 1; b <= max_batch; ++b)
    if (padded(b) == b) out.push_back(b);
  return out;
}

namespace {
GraphBuckets checked(const GraphBuckets& b, const char* who) {
  TVLLM_REQUIRE(b.max_batch >= 0, std::string(who) + ": max_batch must be >= 0, got " + std::to_string(b.max_batch));
  TVLLM_REQUIRE(b.exact >= 0, std::string(who) + ": exact must be >= 0, got " + std::to_string(b.exact));
  TVLLM_REQUIRE(b.step >= 1, std::string(who) + ": the bucket step must be >= 1, got " + std::to_string(b.step));
  return b;
}
}  // namespace

GraphRunner::GraphRunner(const AttentionShape& shape, int max_batch, DecodeAttention decode)
    : GraphRunner(shape, GraphBuckets{64, 16, max_batch}, decode) {}

GraphRunner::GraphRunner(const AttentionShape& shape, const GraphBuckets& buckets, DecodeAttention decode)
    : shape_(shape), buckets_(checked(buckets, "GraphRunner")), decode_(decode), num_sms_(sm_count()) {}

void GraphRunner::launch(ExecContext& ctx, const StepInputs& step, AttentionBackend& backend,
                         const std::function<void()>& work) {
  // --- exercise 14.3: the graph runner ---------------------------------------------------------------------
  // Task: replay decode steps of B <= buckets_.max_batch sequences from CUDA graphs; run everything else eagerly.
  //   Contract: the tokens are the same bits as an eager run with the same pinned splits; a graph is captured
  //   at most once per DecodeGraphKey; stats_ counts replays, captures and eager steps; the backend's pinned
  //   splits are back to 0 (its own choice) when launch() returns, also when the step throws.
  // Tests: GraphRunner14.OnTheCpuEveryStepRunsEagerly GraphRunner14Gpu.GeneratorGraphsEqualEager
  // Tests: GraphRunner14Gpu.EngineGraphsEqualEager GraphRunner14Gpu.OneGraphPerBatchSizeAndBucket
  // --- solution ---
  const bool graphable =
      ctx.device() == Device::CUDA && is_decode_step(step) && step.num_sequences() <= buckets_.max_batch;
  if (!graphable) {
    ++stats_.eager_steps;
    work();
    return;
  }
  const int B = step.num_sequences();
  const int splits = graph_decode_splits(shape_, B, step.batch().max_k_len(), num_sms_, decode_);
  const DecodeGraphKey key{B, splits, static_cast<int>(ctx.matmul_kernel()),
                           reinterpret_cast<const void*>(ctx.forward_fn()), &backend};
  backend.pin_decode_splits(splits);
  try {
    auto it = graphs_.find(key);
    if (it == graphs_.end()) {
      // Capture records the launches without running them; the replay below runs this step.
      const auto start = std::chrono::steady_clock::now();
      it = graphs_.emplace(key, CudaGraph::capture(ctx.stream(), work)).first;
      stats_.capture_ms +=
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
      ++stats_.captures;
    }
    it->second.launch(ctx.stream());
    ++stats_.replays;
    ++stats_.replays_by_batch[B];
  } catch (...) {
    backend.pin_decode_splits(0);
    throw;
  }
  backend.pin_decode_splits(0);
  // --- end of exercise 14.3 ---
}

PinnedEagerLauncher::PinnedEagerLauncher(const AttentionShape& shape, const GraphBuckets& buckets,
                                         DecodeAttention decode)
    : shape_(shape), buckets_(checked(buckets, "PinnedEagerLauncher")), decode_(decode), num_sms_(sm_count()) {}

void PinnedEagerLauncher::launch(ExecContext& /*ctx*/, const StepInputs& step, AttentionBackend& backend,
                                 const std::function<void()>& work) {
  if (!is_decode_step(step)) {
    work();
    return;
  }
  backend.pin_decode_splits(
      graph_decode_splits(shape_, step.num_sequences(), step.batch().max_k_len(), num_sms_, decode_));
  try {
    work();
  } catch (...) {
    backend.pin_decode_splits(0);
    throw;
  }
  backend.pin_decode_splits(0);
}

}  // namespace tvllm
