// Lesson 14: the graph runner. Decode steps replayed as CUDA graphs.
//
// A decode step of the 1B model at batch 1 is ~130 small kernels. Launched one by one from the host, each costs
// a few microseconds of CPU time and leaves a gap on the GPU while the next launch is prepared; at ~0.6 ms of
// real work per token those gaps are a large share of the step. A CUDA graph records the step's launches once
// (stream capture) and replays all of them with ONE launch: the GPU walks the recorded list without waiting
// for the host.
//
//   step k:   host: set inputs (async copies into FIXED buffers) ─> launch(graph for B=4, splits=1) ─> fetch ids
//   step k+1: host: set inputs ────────────────────────────────────> launch(the same graph) ────────> fetch ids
//
// A replay re-runs every kernel with the arguments it was captured with: the same pointers, the same grid, the
// same sizes. That is why the course's forward() reads everything that changes from step to step (token ids,
// positions, lengths, KV addressing, sampling parameters) from device buffers allocated once and refilled by
// async copies before each step, and why what is left on the host must be a key of the graph:
//
//   B         sequences in the step (= tokens = logits rows in a decode step): every kernel's grid and every
//             GEMM's M. One graph per batch size it is launched with, captured the first time that size decodes
//             (a padded step is launched with its bucket's size: see below).
//   splits    how many parts the split decode-attention kernel cuts each sequence's keys into: its grid. Chosen
//             from the step's longest context ROUNDED UP to a power of two, and pinned on the attention backend
//             (AttentionBackend::pin_decode_splits) for the capture and every replay, so one graph serves every
//             context length of its bucket; the kernel computes each split's share from the k_len it reads on
//             the device, so the answer is right at any length.
//   the rest  the matmul kernel, the forward function and the attention backend: a change of any of them
//             (Generator::set_batch_invariant, say) makes new graphs.
//
// Prefill and mixed steps (a sequence with more than one new token) run eagerly: their shapes change every step
// and their kernels are long enough that launch gaps do not matter.
//
// Batch sizes: exact up to 64, padded buckets above. Up to GraphBuckets::exact (64) every batch size B has its own
// graph, captured lazily the first time it decodes (a few milliseconds each, measured in the chapter) and no row
// is ever computed for nothing. Above it, exact graphs would mean up to 192 more captures for a 256-sequence
// engine, during the very run they should speed up; so a step of B sequences replays the graph of the smallest
// bucket Bp >= B (multiples of GraphBuckets::step = 16, and max_batch itself), and the Bp - B extra rows are
// padding. The loop that prepares the step asks the launcher (StepLauncher::padded_batch) and fills those rows
// with harmless work: token 0 at position 0 (k_len 1), KV addressing that writes nowhere a live sequence reads,
// logits rows sampled greedily and never read. PinnedEagerLauncher pads the same way, so that the graphs and
// --enforce-eager run the very same shapes (cuBLAS chooses its kernel by M: a padded M may change a real row's
// bits, exactly like another batch composition would) and give the same ids. Chapter section 3: the cost model.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <tuple>
#include <vector>

#include "attention.h"
#include "common/cuda_stream.h"
#include "kv_cache.h"  // DecodeAttention
#include "transformer.h"

namespace tvllm {

// The host-side decision, separate from CUDA so that it is testable anywhere.
struct DecodeGraphKey {
  int batch = 0;        // B
  int splits = 0;       // pinned decode splits
  int matmul = 0;       // MatmulKernel, as an int
  const void* forward = nullptr;
  const void* backend = nullptr;
  bool operator<(const DecodeGraphKey& o) const {
    return std::tie(batch, splits, matmul, forward, backend) <
           std::tie(o.batch, o.splits, o.matmul, o.forward, o.backend);
  }
};

// Whether a step is a pure decode step: every sequence brings exactly one new token and wants its logits, in
// order (token i of the step is sequence i, logits row i is token i). Reads the step's host copies.
bool is_decode_step(const StepInputs& step);

// The context length a graph is captured for: the next power of two >= max_k_len (at least 64).
int64_t context_bucket(int64_t max_k_len);

// The split count of decode steps with B sequences whose longest context is in max_k_len's bucket, by the split
// policy of the decode kernel the backend runs (lesson 10's decode_splits_for: Fast has lesson 14's policy).
int graph_decode_splits(const AttentionShape& shape, int batch, int64_t max_k_len, int num_sms,
                        DecodeAttention decode = DecodeAttention::Split);

// Which batch size a decode step of B sequences runs at (B itself, or a padded bucket): B <= exact keeps B; up to
// max_batch, B rounds up to a multiple of step, at most max_batch; above max_batch (eager steps) B stays.
struct GraphBuckets {
  int64_t exact = 64;     // batch sizes with a graph of their own
  int64_t step = 16;      // bucket spacing above exact
  int64_t max_batch = 0;  // the largest batch a graph serves; 0: none (no padding at all)
  int64_t padded(int64_t batch) const;
  // Every bucket above exact, ascending (the last is max_batch): what a warm-up captures besides small sizes.
  std::vector<int64_t> buckets() const;
};

struct GraphRunnerStats {
  int64_t replays = 0;      // decode steps replayed from a graph
  int64_t captures = 0;     // graphs captured (= graphs held)
  int64_t eager_steps = 0;  // steps run eagerly (prefill, mixed, batches above max_batch)
  double capture_ms = 0.0;  // host time spent capturing and instantiating, all graphs together
  std::map<int, int64_t> replays_by_batch;  // replays per graph batch size (padded buckets included)
};

class GraphRunner final : public StepLauncher {
 public:
  // shape: the model's attention layout and decode: the backend's decode kernel (for the split choice); decode
  // steps of up to max_batch sequences are replayed from graphs, exact sizes up to 64 and padded buckets of 16
  // above (GraphBuckets). CUDA only.
  GraphRunner(const AttentionShape& shape, int max_batch, DecodeAttention decode = DecodeAttention::Split);
  GraphRunner(const AttentionShape& shape, const GraphBuckets& buckets,
              DecodeAttention decode = DecodeAttention::Split);
  GraphRunner(const GraphRunner&) = delete;
  GraphRunner& operator=(const GraphRunner&) = delete;

  // StepLauncher: a decode step of B <= max_batch sequences replays (capturing first if needed) the graph of its
  // key; anything else runs `work` eagerly. Both pin the decode splits the same way, so a step gives the same
  // bits replayed or eager (--enforce-eager changes the speed, not the tokens).
  void launch(ExecContext& ctx, const StepInputs& step, AttentionBackend& backend,
              const std::function<void()>& work) override;
  // StepLauncher: buckets_.padded(B).
  int64_t padded_batch(int64_t num_sequences) const override { return buckets_.padded(num_sequences); }

  const GraphRunnerStats& stats() const { return stats_; }
  size_t num_graphs() const { return graphs_.size(); }
  int max_batch() const { return static_cast<int>(buckets_.max_batch); }
  const GraphBuckets& buckets() const { return buckets_; }

 private:
  AttentionShape shape_;
  GraphBuckets buckets_;
  DecodeAttention decode_ = DecodeAttention::Split;
  int num_sms_ = 0;
  std::map<DecodeGraphKey, CudaGraph> graphs_;
  GraphRunnerStats stats_;
};

// An eager launcher that pins the decode splits exactly as GraphRunner does: `--enforce-eager` with the same
// tokens as the graphs, and the "before" of the chapter's graph measurement. Given the GraphRunner's buckets it
// asks for the same padding (same shapes, same bits); without, it pads nothing.
class PinnedEagerLauncher final : public StepLauncher {
 public:
  explicit PinnedEagerLauncher(const AttentionShape& shape, const GraphBuckets& buckets = {},
                               DecodeAttention decode = DecodeAttention::Split);
  void launch(ExecContext& ctx, const StepInputs& step, AttentionBackend& backend,
              const std::function<void()>& work) override;
  int64_t padded_batch(int64_t num_sequences) const override { return buckets_.padded(num_sequences); }

 private:
  AttentionShape shape_;
  GraphBuckets buckets_;
  DecodeAttention decode_ = DecodeAttention::Split;
  int num_sms_ = 0;
};

}  // namespace tvllm
