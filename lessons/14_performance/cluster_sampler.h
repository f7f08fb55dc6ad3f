// Lesson 14, the fast sampler's one-launch path: each row is sampled by one THREAD-BLOCK CLUSTER (Hopper:
// up to 16 blocks that run at the same time, can wait for each other with a hardware barrier and read and
// write each other's shared memory, "distributed shared memory"). The row is cut into one chunk per block;
// every block reads its chunk of logits from global memory ONCE and keeps the keys (order_key of z) in its
// own shared memory; every later pass reads shared memory. The cluster's blocks meet at cluster barriers
// between the passes, so one kernel launch does what the multi-pass path needs seven launches for.
//
//   phase     every block, over its chunk                          then
//   load      z = logit / T, key = order_key(z) into shared memory, block max of (key, -id); barrier: every
//             the argmax pair                                       block reads the others' maxima
//   digit xN  histogram of one 11-bit digit of the candidates'      blocks add their nonzero buckets into
//             keys: counts (top-k) or integer masses (top-p)        rank 0's histogram; barrier; rank 0
//                                                                   decides the digit, tells every block;
//                                                                   barrier
//   draw      each thread: the kept mass of a contiguous piece;     block sums exchanged; the block whose
//             a block scan                                          mass interval holds U finds the token
//
// This header holds what the kernel and its CPU model (cluster_sampler_cpu.cpp, tested without a GPU)
// share: the digits, the per-row state machine that turns one decided digit into the next step, and the
// plan (cluster size, chunk and piece lengths). C++17, included by .cu and .cpp files.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "sampling.h"
#include "sampling_math.h"

namespace tvllm::cluster_sampler {

#if defined(__CUDACC__)
#define TVLLM_CLUSTER_HD __host__ __device__ __forceinline__
#else
#define TVLLM_CLUSTER_HD inline
#endif

inline constexpr int kThreadsShared = 512;  // per block when blocks share SMs (big batches): two fit on an SM
inline constexpr int kThreadsAlone = 1024;  // per block when every block has an SM to itself (small batches)
inline constexpr int kBuckets = 2048;       // 11 bits a digit: 3 digits cover the 32-bit key
inline constexpr int kMaxTokensPerBlock = 40960;  // 160 KiB of keys: the shared memory one block may hold
inline constexpr int kMinTokensPerBlock = 2048;   // fewer and the barriers cost more than the work saved
inline constexpr int kMaxClusterSize = 16;        // Hopper's largest cluster (above 8 it needs an opt-in)

// The three digits of a key, from the top: bits 31..21, 20..10, 9..0.
TVLLM_CLUSTER_HD int digit_shift(int level) { return level == 0 ? 21 : (level == 1 ? 10 : 0); }
TVLLM_CLUSTER_HD int digit_bits(int level) { return level == 2 ? 10 : 11; }
// The key bits already decided before digit `level`.
TVLLM_CLUSTER_HD uint32_t decided_mask(int level) {
  return level == 0 ? 0u : 0xffffffffu << (digit_shift(level) + digit_bits(level));
}

// order_key inverted: the scaled logit a key was made from (-0 comes back as +0; token_mass treats the two
// alike, and they have the same key). The passes after the load need neither the logits nor the division.
TVLLM_CLUSTER_HD float z_of_key(uint32_t key) {
  return sampling::bits_f(key & 0x80000000u ? key & 0x7fffffffu : ~key);
}

// A token's kept mass in the draw: 0 if a threshold removed it (lesson 09's kept_mass_of).
TVLLM_CLUSTER_HD uint64_t kept_mass(uint32_t key, float z_max, uint32_t threshold) {
  return key >= threshold ? sampling::token_mass(z_of_key(key), z_max) : 0;
}

enum Mode : int {
  kModeTopK = 1,  // the next digit pass decides a digit of the top-k threshold (measure: count)
  kModeTopP = 2,  // ... of the top-p threshold among the candidates key >= lower (measure: mass)
  kModeDraw = 3,  // thresholds known
};

// One row's radix select between digit passes: the same in every block of the cluster (rank 0 decides, the
// others receive a copy), so every branch on it is uniform across the cluster.
struct RowState {
  int mode;            // Mode
  int level;           // the digit the next pass decides (0, 1, 2)
  uint32_t prefix;     // the key bits decided so far
  uint32_t lower;      // candidates have key >= lower (top-p after top-k: the top-k threshold)
  uint32_t threshold;  // when mode == kModeDraw: keys >= threshold are kept
  uint32_t pad;
  uint64_t above;   // the measure of the candidates above every key with this prefix
  uint64_t target;  // top-k: k; top-p: ceil(p * W), fixed by its first digit
};

// The state before the first digit pass: top-k if it is on, else top-p if it is on, else the draw.
TVLLM_CLUSTER_HD RowState initial_state(const SamplingRow& row, int64_t vocab) {
  RowState st{};
  const bool top_k = row.top_k > 0 && row.top_k < vocab;
  st.mode = top_k ? kModeTopK : (row.top_p < 1.0f ? kModeTopP : kModeDraw);
  st.target = top_k ? static_cast<uint64_t>(row.top_k) : 0;  // top-p's is set by its first digit
  return st;  // level 0, prefix 0, lower 0, threshold 0 (everything kept), above 0
}

// Is this key a candidate of the digit pass `st` describes?
TVLLM_CLUSTER_HD bool is_candidate(const RowState& st, uint32_t key) {
  return key >= st.lower && (key & decided_mask(st.level)) == st.prefix;
}
TVLLM_CLUSTER_HD uint32_t digit_of(const RowState& st, uint32_t key) {
  return (key >> digit_shift(st.level)) & ((1u << digit_bits(st.level)) - 1u);
}

// The decision of one digit pass, given the row's histogram of the candidates by digit: the highest bucket
// at which `above` plus the measure of the buckets from the top reaches the target (lesson 09's radix rule).
struct Pick {
  int bucket;          // the chosen digit
  uint64_t above;      // st.above plus the measure of the buckets above it
  uint64_t in_bucket;  // the measure in the chosen bucket
  uint64_t target;     // the target used (top-p's first digit computes it from the histogram's total)
};

// Applies a pick to the state (what lesson 09 and the multi-pass path do between passes): the next digit;
// or, when the threshold is known, top-p among the top-k survivors, or the draw.
// Top-k's shortcut (exact): when the count from the top reaches k exactly at a bucket, every key of the
// bucket is among the k largest, so the bucket's lowest possible key keeps the same set as the k-th key.
TVLLM_CLUSTER_HD RowState advance(RowState st, const SamplingRow& row, const Pick& pick) {
  const uint32_t prefix = st.prefix | (static_cast<uint32_t>(pick.bucket) << digit_shift(st.level));
  const bool known = st.level == 2 || (st.mode == kModeTopK && pick.above + pick.in_bucket == pick.target);
  if (!known) {
    st.level += 1;
    st.prefix = prefix;
    st.above = pick.above;
    st.target = pick.target;
    return st;
  }
  st.threshold = prefix;  // the low digits not decided are 0: the lowest key of the bucket
  if (st.mode == kModeTopK && row.top_p < 1.0f) {
    st.mode = kModeTopP;
    st.level = 0;
    st.prefix = 0;
    st.lower = prefix;
    st.above = 0;
    st.target = 0;
  } else {
    st.mode = kModeDraw;
  }
  return st;
}

// How one call spreads its rows: `cluster` blocks of `threads` threads per row, each block owning `chunk`
// consecutive tokens (the last may own fewer), each thread a contiguous `piece` of its block's chunk in the
// draw. piece is odd so that the 32 threads of a warp reading element j of their pieces hit 32 different
// shared-memory banks.
struct Plan {
  int cluster = 0;  // 0: this call cannot take the cluster path (the vocab does not fit)
  int threads = 0;  // kThreadsShared or kThreadsAlone
  int chunk = 0;
  int piece = 0;
  int version = 2;  // the kernel: 1 the first cluster kernel (FastSampler's default), 2 with the changes below
};

// Version 2 changes WHERE sums are computed and who decides, never WHAT is summed (the same integers, so the
// same ids):
//   * one cluster barrier per digit instead of two (clusters of 4 or more blocks): every block decides the
//     digit itself from the row histogram, which the blocks own in slices, three copies used in turn
//     (cluster_sampler.cu says why three); version 1 has rank 0 decide and broadcast, a second barrier;
//   * top-k's first digit is counted during the load (a count needs the key only, not z_max): the atomics run
//     in the shadow of the global loads, and one pass over the keys in shared memory disappears;
//   * rows with top-p take each block's kept mass from the block's own top-p histograms (the mass above the
//     picked bucket at every digit, plus the picked bucket at the last digit: exactly the block's tokens with
//     key >= threshold), so only the block whose mass interval holds U computes exponentials in the draw
//     (version 1: every block, for every token, although top-p's first digit had just computed them all).
//     Only in the 512-thread kernel (blocks sharing SMs, big batches): exponentials cost issue slots there;
//     a block alone on its SM (1024 threads, small batches) is bound by latency, which this does not shorten.
// (And at temperature 1 the load skips the division: x / 1 == x exactly, the same key.)
// bucket_is_kept below is that rule, shared by the kernel and the CPU model (top-p always ends at digit 2:
// advance() takes no shortcut for it).

// cluster: a power of two, at least enough blocks to hold the row (kMaxTokensPerBlock each), at most
// max_cluster (what the device can launch); within that, enough blocks per row for the batch to give every
// SM two blocks, but no block below kMinTokensPerBlock tokens unless the row needs it. threads: 1024 when
// the grid has at most one block per SM (batch 1 to 8 at vocab 128256: a lone block is the SM's only
// source of loads in flight and of warps to hide latency), else 512 (two blocks share an SM).
Plan plan_call(int batch, int64_t vocab, int sms, int max_cluster);

// A plan with exactly `cluster` blocks of `threads` threads per row (tests try every size).
Plan plan_with(int64_t vocab, int cluster, int threads, int version = 2);

// Version 2's draw: does a block's histogram bucket `b` of a top-p digit at `level`, whose picked bucket is
// `picked`, hold only kept tokens (key >= the final threshold)? Buckets above the pick do; the picked bucket
// does only at the last digit (its keys are then the threshold itself); the buckets below never do.
TVLLM_CLUSTER_HD bool bucket_is_kept(int level, uint32_t b, uint32_t picked) {
  return b > picked || (level == 2 && b == picked);
}

// The dynamic shared memory a block of the plan uses (the keys of its chunk plus the fixed part).
size_t shared_bytes(const Plan& plan);

// ---- the CPU model (cluster_sampler_cpu.cpp) ----------------------------------------------------------

// The cluster path's algorithm, step by step, on the CPU: the same chunks, the same digit passes (serial
// histograms, the same picks, the same state machine), the same draw by (block, thread piece). It must
// give sample_cpu's id on every row: tests/test_14_sampler.cpp checks that without a GPU.
int32_t sample_model(const float* logits, int64_t vocab, const SamplingRow& row, const Plan& plan);

// ---- the GPU side (cluster_sampler.cu) ----------------------------------------------------------------

// The largest cluster size (1, 2, 4, 8 or 16) this device can launch with a full chunk of shared memory, for
// both block sizes; 0 if it cannot launch clusters at all (before Hopper). Also does the kernels' one-time
// attribute setup.
int max_cluster_size();

// Samples `batch` rows with one launch (grid: plan.cluster x batch blocks). Same arguments as
// TokenSampler::sample; plan from plan_call with plan.cluster >= 1.
void launch(const float* logits, int64_t row_stride, int64_t vocab, int batch, const SamplingRow* rows,
            int32_t* out_ids, const Plan& plan, cudaStream_t stream);

}  // namespace tvllm::cluster_sampler
