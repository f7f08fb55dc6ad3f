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
  // Version 3's top-p (see "Version 3" below): one pass of masses into 2048 FINE buckets of z - z_max...
  kModeTopPFine = 4,
  // ... then the candidates of the picked fine bucket (prefix holds it) listed and the threshold found
  // among them exactly (sorted, summed from the top); too many candidates: back to kModeTopP's digits.
  kModeTopPList = 5,
  // Version 4's top-k: after its first digit, the candidates of the picked bucket listed and the k-th
  // largest found among them exactly (the state is top-k's level-1 state: prefix, above, target); too many
  // candidates: back to kModeTopK at level 1, the digits version 1 would run next.
  kModeTopKList = 6,
};

// ---- version 3: top-p by fine buckets of mass, then a short list ------------------------------------
// Top-p's threshold is the largest key t whose candidates at or above t reach the target mass. Any
// function of the key that never decreases as the key grows cuts the candidates into buckets in key order,
// so the radix rule (the highest bucket where the measure from the top reaches the target) finds the bucket
// holding t with ANY such function; only the number of passes depends on it. The key's top 11 bits (sign,
// exponent, 2 mantissa bits) put a row of normal logits into ~40 crowded buckets, and the picked one still
// holds thousands of tokens: two more digits follow. fine_bucket cuts d = z - z_max (the difference
// token_mass computes anyway) into 1/64 steps over (-32, 0] (below -27.7 every mass is 0): on the benchmark's
// rows the picked bucket holds ~150 tokens, few enough to list, sort and sum exactly in every block.
inline constexpr int kFineStepsPerUnit = 64;  // fine buckets per unit of z: 2048 of them cover (-32, 0]
inline constexpr int kListCapacity = 2048;   // the most candidates a row's list may hold (else: digits)

// The fine bucket of a key: kBuckets - 1 for z == z_max, one less per 1/64 below it, 0 for z - z_max <= -32
// (and for every finite z when z_max is +inf: their masses are 0). Never decreases as the key grows: z_of_key
// and the correctly rounded subtraction keep the order, and * 64 is exact.
TVLLM_CLUSTER_HD uint32_t fine_bucket(uint32_t key, float z_max) {
  const float z = z_of_key(key);
  const float d = z == z_max ? 0.0f : sampling::f_sub(z, z_max);  // token_mass's d: <= 0
  if (!(d > -32.0f)) return 0;
  return static_cast<uint32_t>(kBuckets - 1) -
         static_cast<uint32_t>(sampling::f_mul(d, -static_cast<float>(kFineStepsPerUnit)));
}

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

// The state before the first digit pass: top-k if it is on, else top-p if it is on, else the draw. `fine`:
// version 3, whose top-p starts with the fine pass.
TVLLM_CLUSTER_HD RowState initial_state(const SamplingRow& row, int64_t vocab, bool fine = false) {
  RowState st{};
  const bool top_k = row.top_k > 0 && row.top_k < vocab;
  st.mode = top_k ? kModeTopK : (row.top_p < 1.0f ? (fine ? kModeTopPFine : kModeTopP) : kModeDraw);
  st.target = top_k ? static_cast<uint64_t>(row.top_k) : 0;  // top-p's is set by its first digit
  return st;  // level 0, prefix 0, lower 0, threshold 0 (everything kept), above 0
}

// Is this key a candidate of the digit pass `st` describes? (The fine pass: every key >= lower.)
TVLLM_CLUSTER_HD bool is_candidate(const RowState& st, uint32_t key) {
  return key >= st.lower && (st.mode == kModeTopPFine || (key & decided_mask(st.level)) == st.prefix);
}
// Does this pass measure masses (top-p), and does its decision fix top-p's target (its first pass)?
TVLLM_CLUSTER_HD bool measures_mass(const RowState& st) {
  return st.mode == kModeTopP || st.mode == kModeTopPFine;
}
TVLLM_CLUSTER_HD bool sets_target(const RowState& st) { return measures_mass(st) && st.level == 0; }
// Versions 3 and 4's list: is this key a candidate of the picked fine bucket (st.prefix) above st.lower?
// Version 4's top-k list: every key whose top 11 bits are the picked bucket's (st.prefix) or above: the
// bucket's keys and the `above` keys over it (fewer than k), so that the list holds every key the top-k
// draw keeps and each block's kept mass comes from its listed keys.
TVLLM_CLUSTER_HD bool is_listed(const RowState& st, uint32_t key, float z_max) {
  if (st.mode == kModeTopKList) return key >= st.lower && key >= st.prefix;
  return key >= st.lower && fine_bucket(key, z_max) == st.prefix;
}
// Once top-k's threshold is known: top-p among the survivors (keys >= it) if the row asks, else the draw.
TVLLM_CLUSTER_HD RowState after_top_k(RowState st, const SamplingRow& row, uint32_t threshold, bool fine) {
  st.threshold = threshold;
  if (row.top_p < 1.0f) {
    st.mode = fine ? kModeTopPFine : kModeTopP;
    st.level = 0;
    st.prefix = 0;
    st.lower = threshold;
    st.above = 0;
    st.target = 0;
  } else {
    st.mode = kModeDraw;
  }
  return st;
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
// Version 3 (`fine`): top-p after top-k starts with the fine pass; the fine pass's pick becomes the list
// state (prefix: the picked fine bucket; above, target as usual).
// Version 4 (`list_k`): top-k's first digit, when it does not settle the threshold, leads to the top-k list
// (kModeTopKList with top-k's level-1 state) instead of the second digit.
TVLLM_CLUSTER_HD RowState advance(RowState st, const SamplingRow& row, const Pick& pick, bool fine = false,
                                  bool list_k = false) {
  if (st.mode == kModeTopPFine) {
    st.mode = kModeTopPList;
    st.prefix = static_cast<uint32_t>(pick.bucket);
    st.above = pick.above;
    st.target = pick.target;
    return st;
  }
  const uint32_t prefix = st.prefix | (static_cast<uint32_t>(pick.bucket) << digit_shift(st.level));
  const bool known = st.level == 2 || (st.mode == kModeTopK && pick.above + pick.in_bucket == pick.target);
  if (!known) {
    if (list_k && st.mode == kModeTopK && st.level == 0) st.mode = kModeTopKList;
    st.level += 1;
    st.prefix = prefix;
    st.above = pick.above;
    st.target = pick.target;
    return st;
  }
  // the low digits not decided are 0: the lowest key of the bucket
  if (st.mode == kModeTopK) return after_top_k(st, row, prefix, fine);
  st.threshold = prefix;
  st.mode = kModeDraw;
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
  int version = 2;  // the kernel: 1 the first cluster kernel, 2, 3 (FastSampler's default) and 4 below
  // Version 3: the most candidates a row's list may hold before top-p falls back to the digits (at most
  // kListCapacity; tests lower it to exercise the fallback).
  int list_capacity = kListCapacity;
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
//
// Version 3 is version 1 (two cluster barriers per digit, rank 0 decides, nothing counted in the load) with a
// different top-p (top-k is version 1's, step for step):
//   * fine pass: every candidate's mass into fine_bucket(key); rank 0 picks the bucket where the mass from
//     the top reaches ceil(p * W), as a digit; two barriers, as a digit;
//   * list: every block appends its candidates of that bucket (is_listed) to a list in its shared memory;
//     one barrier; every block copies all the lists (distributed shared memory: ~150 keys on the benchmark's
//     rows), sorts them from the largest key down and finds the first position where `above` plus the masses
//     summed from the top reach the target: that key is the threshold (equal keys sit next to each other,
//     so the tokens tied with it, kept whole, change nothing; a list of one key skips the sort: that key is
//     the threshold). The same integers and the same sort in every block: the same threshold, without a
//     barrier. More than list_capacity candidates (a flat row, a huge
//     tie group at the threshold): every block sees the same counts and goes back to version 1's top-p
//     digits (kModeTopP, level 0), a slow but exact path for rows that rare;
//   * the draw takes each block's kept mass from its own fine histogram (the buckets above the pick) plus
//     its listed keys at or above the threshold, so only U's block computes exponentials (version 2's idea,
//     512-thread blocks only). After a fallback every block sums its pieces, as version 1.
// Top-p then costs one pass with exponentials, one pass of compares and the list, instead of three digit
// passes (the second with thousands of exponentials a row) and four more cluster barriers.
//
// Version 4 is version 3 with top-k's digits 2 and 3 replaced by the same list (kModeTopKList): after
// top-k's first digit (unless it settles the threshold exactly), every block lists its keys whose top 11
// bits are the picked bucket's OR ABOVE (the bucket's keys and the fewer than k keys over it), the blocks
// copy and sort all lists, and the k-th largest key is the list's key at position k - 1 from the top (each
// key counts 1 where top-p's list sums masses). On the benchmark's row (T 0.8) the list holds 150 keys.
// Top-k then costs one counting pass, one pass of compares and the list (one cluster barrier) instead of up
// to three counting passes and six barriers; a list over list_capacity goes back to version 1's second digit
// (the state is already its). Top-k followed by top-p runs both lists, one after the other. Top-k alone: the
// list holds every kept key, so a block's kept mass is its listed keys' at or above the threshold, and only
// U's block sums its pieces in the draw (512-thread blocks, as version 3's top-p).

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
// trace (optional): what version 3's top-p did on this row, for the tests and the chapter's figures.
struct ModelTrace {
  int64_t list_size = -1;  // the candidates of the picked fine bucket (-1: no list step ran)
  bool fell_back = false;  // more than plan.list_capacity: top-p ran version 1's digits instead
  int passes = 0;          // digit passes (fine pass included), list step excluded
  int64_t k_list_size = -1;  // version 4: the candidates of top-k's first bucket (-1: no top-k list ran)
  bool k_fell_back = false;  // ... more than plan.list_capacity: top-k ran its second (and third) digit
};
int32_t sample_model(const float* logits, int64_t vocab, const SamplingRow& row, const Plan& plan,
                     ModelTrace* trace = nullptr);

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
