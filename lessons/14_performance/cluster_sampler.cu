// Lesson 14, the fast sampler's one-launch path: one thread-block cluster per row (cluster_sampler.h has the
// phases). Every decision is lesson 09's (sampling_math.h) and the multi-pass path's, on the same integers:
//
//   argmax / z_max    max over the blocks of (key << 32 | ~id): the larger key, on equal keys the lower id
//   digit decisions   the rows' histograms are sums of integers (counts, masses): the blocks add theirs into
//                     rank 0's in any order and get the same buckets; rank 0 picks with lesson 09's rule
//                     (version 2: into slices owned by every block, and every block picks, by the same rule
//                     from the same integers, so all make the same pick)
//   draw              kept masses summed by contiguous pieces in index order: block b's chunk lies before
//                     block b+1's, thread t's piece before thread t+1's, so "the first token whose
//                     cumulative mass exceeds U" is found by narrowing down block, piece, token
//
// Cluster rules this kernel keeps: every block of a cluster takes the same branches (the row and the
// decisions rank 0 broadcasts are the same for all), so all reach the same cluster barriers; a block reads
// or writes another's shared memory only between two barriers both take part in; and the last barrier comes
// after the last remote access, so no block's shared memory goes away while another still reads it.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cluster_sampler.h"
#include "common/cuda_utils.cuh"  // kWarpSize, ceil_div
#include "common/errors.h"
#include "sampler_block.cuh"

namespace tvllm::cluster_sampler {

namespace {

namespace cg = cooperative_groups;
using namespace sampling;
using sampler_block::u64;

constexpr int kMaxWarps = kThreadsAlone / kWarpSize;  // 32
constexpr int kMaxPer = kBuckets / kThreadsShared;    // 4 buckets per thread in a decision, at most

struct alignas(16) Shared {
  // This block's histogram of one digit as two 32-bit halves (shared-memory atomics are native for 32-bit
  // words): bucket b holds hi[b] * 2^32 + lo[b]. Counts need only lo.
  uint32_t lo[kBuckets];
  uint32_t hi[kBuckets];
  u64 row_hist[kBuckets];  // used in rank 0 only: the sum of the blocks' histograms
  u64 warp_u64[kMaxWarps];
  u64 best;               // this block's max (key, ~id) pair: the other blocks read it
  u64 draw_sum;           // this block's kept mass: the other blocks read it
  u64 row_value, before;  // broadcast inside the block: the row's max pair / kept mass, mass before the block
  u64 pick_base;
  RowState state;  // rank 0 writes the row's new state here, in every block, after each decision
  Pick pick;       // rank 0's decision, shared by its threads
  int pick_thread;
  int picked;  // rank 0 writes the decided bucket here too, in every block
  // Version 3's list (the keys themselves live in row_hist's words, see list_of): how many this block
  // appended, and every block's size and offset in the sorted copy (read from the others by warp 0).
  uint32_t list_count;
  uint32_t list_size[kMaxClusterSize], list_offset[kMaxClusterSize];
  uint32_t list_total, list_threshold;
  uint32_t list_min, list_max;  // the smallest and largest listed key of the row
};
static_assert(sizeof(Shared) % 16 == 0, "the keys follow the fixed part, aligned");
static_assert(kBuckets % kThreadsAlone == 0 && kMaxPer <= 4, "a decision gives each thread whole buckets");
static_assert(3 * (kBuckets / 4) <= kBuckets, "version 2: three copies of a quarter of the buckets fit");
static_assert(2 * kListCapacity * sizeof(uint32_t) <= sizeof(Shared::row_hist),
              "version 3: a block's list and the sorted copy of all lists fit in row_hist's words");
static_assert(kListCapacity <= 4 * kThreadsShared, "version 3: a thread sums at most 4 sorted keys");

// Version 3: this block's list of candidate keys (the first kListCapacity words of row_hist: rank 0's row
// histogram is zero and unused between the fine pass's decision and the draw, the others' always) and the
// sorted copy of every block's list (the next kListCapacity words).
__device__ __forceinline__ uint32_t* list_of(Shared& s) { return reinterpret_cast<uint32_t*>(s.row_hist); }

// ---- block helpers (sampler_block.cuh) ----------------------------------------------------------------

using sampler_block::warp_inclusive_scan_u64;
using sampler_block::warp_max_u64;
using sampler_block::warp_sum_u64;

template <int kThreads>
__device__ u64 block_inclusive_scan(u64 v, u64* total, Shared& s) {
  return sampler_block::block_inclusive_scan<kThreads>(v, total, s.warp_u64);
}

// One block's decision of one digit over the row's histogram (`buckets` of them, bucket b's measure given
// by read(b)): the highest bucket at which st.above plus the measure from the top reaches the target. Each
// thread owns `per` contiguous buckets; a block scan gives every thread the measure above its buckets, and
// the one thread whose buckets hold the crossing finds it. The same rule as lesson 09's serial loop, in
// parallel. Version 1: rank 0 decides, read() zeroes rank 0's histogram on the way; version 2 (clusters of
// 4 or more): every block decides, read() fetches the buckets from the blocks that own them.
template <int kThreads, class Read>
__device__ Pick decide(Read read, int buckets, const RowState& st, const SamplingRow& row, Shared& s) {
  const int per = buckets / kThreads;
  const int first = static_cast<int>(threadIdx.x) * per;
  u64 h[kMaxPer] = {0, 0, 0, 0};
  u64 mine = 0;
#pragma unroll
  for (int j = 0; j < kMaxPer; ++j)
    if (j < per) {
      h[j] = read(first + j);
      mine += h[j];
    }
  if (threadIdx.x == 0) s.pick = Pick{0, st.above, 0, 0};  // unreachable fallback, as lesson 09's: bucket 0
  u64 total = 0;
  const u64 incl =
      block_inclusive_scan<kThreads>(mine, &total, s);  // its barriers also order the write above
  // Every thread computes the same target from the same total.
  const u64 target = sets_target(st) ? top_p_target(row.top_p, total) : st.target;
  u64 acc = st.above + (total - incl);         // the measure of every bucket above this thread's
  if (acc < target && acc + mine >= target) {  // the crossing is in this thread's buckets: exactly one thread
    for (int j = per - 1; j >= 0; --j) {
      if (acc + h[j] >= target) {
        s.pick = Pick{first + j, acc, h[j], 0};
        break;
      }
      acc += h[j];
    }
  }
  __syncthreads();
  Pick pick = s.pick;
  pick.target = target;
  return pick;
}

// Counts one token per lane of a warp (those with `counted`) into bucket `digit` of the 32-bit histogram
// `lo`. Every lane of the warp must call it. A warp whose counted tokens all fall into one bucket adds them
// with ONE atomic (32 atomics on one shared-memory word would run one after another).
__device__ __forceinline__ void count_warp(bool counted, uint32_t digit, uint32_t* lo) {
  const unsigned counted_lanes = __ballot_sync(0xffffffffu, counted);
  if (counted_lanes == 0) return;
  const int lane = threadIdx.x % kWarpSize;
  const int first = __ffs(static_cast<int>(counted_lanes)) - 1;
  const uint32_t first_digit = __shfl_sync(0xffffffffu, digit, first);
  if (__all_sync(0xffffffffu, !counted || digit == first_digit)) {
    if (lane == first) atomicAdd(lo + first_digit, static_cast<uint32_t>(__popc(counted_lanes)));
  } else if (counted) {
    atomicAdd(lo + digit, 1u);
  }
}

// ---- version 3: top-p's list --------------------------------------------------------------------------

// The list's end. Top-p's: this block's listed keys at or above the threshold join its kept mass (the draw
// from the digits), and the row goes to the draw. Version 4's top-k list: top-p or the draw (after_top_k).
template <int kThreads>
__device__ RowState list_done(RowState st, uint32_t threshold, float z_max, const SamplingRow& row,
                              cg::cluster_group& cluster, Shared& s, u64* my_kept) {
  const bool top_k = st.mode == kModeTopKList;
  if (top_k) {
    st = after_top_k(st, row, threshold, true);
    if (st.mode != kModeDraw) return st;  // top-p follows: its own passes give the kept masses
  }
  const uint32_t* list = list_of(s);
  const uint32_t own = s.list_size[cluster.block_rank()];
  for (uint32_t i = threadIdx.x; i < own; i += kThreads)
    if (list[i] >= threshold) *my_kept += token_mass(z_of_key(list[i]), z_max);
  if (!top_k) {
    st.mode = kModeDraw;
    st.threshold = threshold;
  }
  return st;
}

// Version 3's list step (cluster_sampler.h; the CPU model's resolve_list), called by every thread of every
// block of the cluster with the state kModeTopPList: prefix is the picked fine bucket, above the mass of the
// candidates above it, target top-p's. Returns the draw's state, or top-p's first digit when the list
// overflows (every block reads the same counts, so every block returns the same). Adds this thread's share of
// the block's listed kept mass to *my_kept. Version 4's top-k list (kModeTopKList, top-k's level-1 state):
// every key counts 1, the result is top-p's fine pass or the draw, an overflow goes back to top-k's second
// digit; the list holds the keys above the bucket too (is_listed), so its count starts from 0; when the draw
// follows (top-k alone), the listed keys at or above the threshold are the block's kept mass, as top-p's.
template <int kThreads>
__device__ RowState resolve_list(RowState st, float z_max, const uint32_t* keys, int n, int list_capacity,
                                 const SamplingRow& row, cg::cluster_group& cluster, Shared& s, u64* my_kept,
                                 bool* fell_back) {
  const bool top_k = st.mode == kModeTopKList;  // uniform: the state is the cluster's
  const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int blocks = static_cast<int>(cluster.num_blocks());
  const uint32_t capacity = static_cast<uint32_t>(min(list_capacity, kListCapacity));
  uint32_t* list = list_of(s);
  uint32_t* sorted = list + kListCapacity;
  // 1. Append this block's candidates of the picked bucket: one atomic per warp for the warp's slots. A
  // block never writes past the capacity; counting on tells every block that the row overflowed.
  for (int i0 = tid - lane; i0 < n; i0 += kThreads) {
    const int i = i0 + lane;
    const uint32_t key = i < n ? keys[i] : 0u;
    const bool listed = i < n && is_listed(st, key, z_max);
    const unsigned ballot = __ballot_sync(0xffffffffu, listed);
    if (ballot == 0) continue;
    const int leader = __ffs(static_cast<int>(ballot)) - 1;
    uint32_t base = 0;
    if (lane == leader) base = atomicAdd(&s.list_count, static_cast<uint32_t>(__popc(ballot)));
    base = __shfl_sync(0xffffffffu, base, leader);
    if (listed) {
      const uint32_t slot = base + static_cast<uint32_t>(__popc(ballot & ((1u << lane) - 1u)));
      if (slot < capacity) list[slot] = key;
    }
  }
  cluster.sync();  // every block's list and count are complete
  // 2. Every block's size and offset, and the row's total (warp 0: lane q reads block q's count).
  if (warp == 0) {
    const uint32_t size = lane < blocks ? *cluster.map_shared_rank(&s.list_count, lane) : 0u;
    uint32_t incl = size;
#pragma unroll
    for (int d = 1; d < kWarpSize; d <<= 1) {
      const uint32_t other = __shfl_up_sync(0xffffffffu, incl, d);
      if (lane >= d) incl += other;
    }
    if (lane < blocks) {
      s.list_size[lane] = size;
      s.list_offset[lane] = incl - size;
    }
    if (lane == kWarpSize - 1) s.list_total = incl;  // at most 16 x 40960: no overflow
  }
  if (tid == 0) {
    s.list_threshold = 0;  // the unreachable fallback (the pick guarantees a crossing): keep all
    s.list_min = 0xffffffffu;
    s.list_max = 0u;
  }
  __syncthreads();
  const uint32_t total = s.list_total;
  // Version 4: after top-k's list, top-p's fine pass adds into rank 0's row histogram (which holds rank 0's
  // list and the sorted copy) and appends to fresh lists: a barrier once every block is done with the lists,
  // the reset, a barrier before anyone adds or appends. (Top-k alone goes to the draw: no reset needed.)
  auto finish = [&](uint32_t threshold) {
    const RowState next = list_done<kThreads>(st, threshold, z_max, row, cluster, s, my_kept);
    if (top_k && next.mode != kModeDraw) {
      cluster.sync();
      if (cluster.block_rank() == 0)
        for (int b = tid; b < kBuckets; b += kThreads) s.row_hist[b] = 0;
      if (tid == 0) s.list_count = 0;
      cluster.sync();
    }
    return next;
  };
  if (total == 0 || total > capacity) {  // the same counts in every block: the same branch
    if (cluster.block_rank() == 0)  // its row histogram held its list: zero before the next digit's adds
      for (int b = tid; b < kBuckets; b += kThreads) s.row_hist[b] = 0;
    cluster.sync();  // ... which the other blocks make only after this barrier
    if (tid == 0) s.list_count = 0;  // version 4: top-p's list may follow (every block has read it: step 2)
    if (top_k) {
      st.mode = kModeTopK;  // level 1, prefix, above, target: top-k's second digit
      return st;
    }
    *fell_back = true;
    RowState top_p{};
    top_p.mode = kModeTopP;  // level 0, prefix 0, above 0, target 0: top-p's digits from the start
    top_p.lower = st.lower;
    return top_p;
  }
  // 3. Copy every block's list into the sorted buffer (the blocks' offsets in rank order), pad with key 0
  // (below every real key: -inf's is 0x007fffff) to a power of two, and sort from the largest key down
  // (bitonic: log2(m) * (log2(m) + 1) / 2 steps, each a compare-exchange per pair and a block barrier).
  uint32_t m = kWarpSize;
  while (m < total) m <<= 1;
  uint32_t key_min = 0xffffffffu, key_max = 0u;
  for (int q = 0; q < blocks; ++q) {
    const uint32_t* remote = cluster.map_shared_rank(list, q);
    const uint32_t size = s.list_size[q], offset = s.list_offset[q];
    for (uint32_t i = tid; i < size; i += kThreads) {
      const uint32_t key = remote[i];
      sorted[offset + i] = key;
      key_min = min(key_min, key);
      key_max = max(key_max, key);
    }
  }
  for (uint32_t i = total + tid; i < m; i += kThreads) sorted[i] = 0u;
  key_min = __reduce_min_sync(0xffffffffu, key_min);
  key_max = __reduce_max_sync(0xffffffffu, key_max);
  if (lane == 0) {
    atomicMin(&s.list_min, key_min);
    atomicMax(&s.list_max, key_max);
  }
  __syncthreads();
  // One key, many tokens (bf16 logits: within 1/64 of a logit there are one or two bf16 values): the
  // threshold is that key, whatever the sort and the sums would say. The same in every block.
  if (s.list_min == s.list_max) return finish(s.list_max);
  for (uint32_t k = 2; k <= m; k <<= 1)
    for (uint32_t j = k >> 1; j > 0; j >>= 1) {
      for (uint32_t i = tid; i < m; i += kThreads) {
        const uint32_t partner = i ^ j;
        if (partner > i) {
          const uint32_t a = sorted[i], b = sorted[partner];
          if ((i & k) == 0 ? a < b : a > b) {  // runs with (i & k) == 0 go down, the others up
            sorted[i] = b;
            sorted[partner] = a;
          }
        }
      }
      __syncthreads();
    }
  // 4. The masses from the top: thread t sums positions [t * per, (t + 1) * per); a block scan; the thread
  // whose positions hold the first crossing of the target finds it (thread 0 also when above alone reaches
  // it, which the pick rules out: then position 0, as the CPU model).
  const int per = static_cast<int>((m + kThreads - 1) / kThreads);  // at most 4 (static_assert above)
  const int first = tid * per;
  u64 h[4] = {0, 0, 0, 0};
  u64 mine = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j)
    if (j < per && first + j < static_cast<int>(total)) {
      h[j] = top_k ? 1u : token_mass(z_of_key(sorted[first + j]), z_max);
      mine += h[j];
    }
  u64 block_total = 0;
  const u64 incl = block_inclusive_scan<kThreads>(mine, &block_total, s);
  u64 acc = (top_k ? 0 : st.above) + (incl - mine);
  if ((acc < st.target || tid == 0) && acc + mine >= st.target) {
    for (int j = 0; j < per; ++j) {
      acc += h[j];
      if (acc >= st.target) {
        s.list_threshold = sorted[first + j];
        break;
      }
    }
  }
  __syncthreads();
  return finish(s.list_threshold);
}

// ---- the kernel ---------------------------------------------------------------------------------------

// grid (cluster, batch), cluster (cluster, 1, 1): the blocks of cluster r sample row r; block rank q owns
// tokens [q * chunk, (q + 1) * chunk) of it, and keeps their keys in shared memory after the fixed part.
// kVersion 2 adds the changes cluster_sampler.h describes (marked "version 2" below).
template <int kThreads, int kVersion>
__global__ void __launch_bounds__(kThreads, kThreads == kThreadsShared ? 2 : 1)
    sample_rows(const float* __restrict__ logits, int64_t row_stride, int vocab, int chunk, int piece,
                int list_capacity, const SamplingRow* __restrict__ rows, int32_t* __restrict__ out_ids) {
  extern __shared__ __align__(16) unsigned char shared_raw[];
  Shared& s = *reinterpret_cast<Shared*>(shared_raw);
  uint32_t* keys = reinterpret_cast<uint32_t*>(shared_raw + sizeof(Shared));
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int blocks = static_cast<int>(cluster.num_blocks());
  constexpr int kWarps = kThreads / kWarpSize;
  const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int r = blockIdx.y;
  const SamplingRow row = rows[r];  // the same for the whole cluster: every branch below is uniform
  const float* x = logits + static_cast<int64_t>(r) * row_stride;
  const int begin = rank * chunk;
  const int n = max(0, min(vocab, begin + chunk) - begin);  // this block's tokens
  const bool greedy = !(row.temperature > 0.0f);            // 0 (and, defensively, anything not positive)
  // Version 2's draw from the digits' masses saves exponentials, i.e. issue slots: it pays where blocks share
  // an SM (512 threads: many rows), not where each block has an SM of its own and only the latency counts
  // (1024 threads: batch 1 to 8 at vocab 128256, whose top-p draw then stays version 1's, step for step).
  constexpr bool kDrawFromDigits = kVersion >= 2 && kThreads == kThreadsShared;
  constexpr bool kFine = kVersion >= 3;   // top-p: the fine pass and the list (cluster_sampler.h)
  constexpr bool kListK = kVersion == 4;  // top-k: the list after its first digit (cluster_sampler.h)

  for (int b = tid; b < kBuckets; b += kThreads) {
    s.lo[b] = s.hi[b] = 0;
    s.row_hist[b] = 0;
  }
  if (tid == 0) s.list_count = 0;
  // Version 2: top-k's first digit is a count of every token by its top 11 bits (initial_state: level 0,
  // no lower bound, so every token is a candidate): counted here, while the loads are in flight.
  const RowState first_state = initial_state(row, vocab, kFine);
  const bool count_in_load = kVersion == 2 && !greedy && first_state.mode == kModeTopK;
  // Version 2: at temperature 1 the division is skipped. x / 1 is x exactly for every float (IEEE division is
  // correctly rounded and x is representable), so the key is the same bits; scaled_logit sanitizes first.
  const bool unit_temperature = kVersion >= 2 && row.temperature == 1.0f;
  if (count_in_load) __syncthreads();  // the zeroed buckets, before any thread counts into them

  // 1. Load: every key once from global memory (8 loads in flight per thread), the block's max pair. Token
  // i = w0 + lane + j * kThreads: every lane of a warp runs the loop as often as the others (w0 is the warp's
  // first token), so the warp may vote in count_warp.
  u64 best = 0;  // below every real pair: the smallest key, -inf's, is 0x007fffff
  constexpr int kUnroll = 8;
  for (int w0 = tid - lane; w0 < n; w0 += kUnroll * kThreads) {
    const int base = w0 + lane;
    float v[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j)
      v[j] = base + j * kThreads < n ? __ldg(x + begin + base + j * kThreads) : 0.0f;
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int i = base + j * kThreads;
      uint32_t key = 0;
      if (i < n) {
        key = order_key(greedy || unit_temperature ? sanitize_logit(v[j])
                                                   : scaled_logit(v[j], row.temperature));
        best = max(best, (static_cast<u64>(key) << 32) | (0xffffffffu - static_cast<uint32_t>(begin + i)));
        keys[i] = key;  // the one division per token: later passes read the key
      }
      if (count_in_load) count_warp(i < n, digit_of(first_state, key), s.lo);
    }
  }
  best = warp_max_u64(best);
  if (lane == 0) s.warp_u64[warp] = best;
  __syncthreads();
  if (tid == 0) {
    u64 m = 0;
    for (int w = 0; w < kWarps; ++w) m = max(m, s.warp_u64[w]);
    s.best = m;
  }
  cluster.sync();  // every block's s.best, and rank 0's zeroed row_hist, are ready

  // 2. The row's max pair: warp 0 reads one block's each.
  if (warp == 0) {
    u64 m = lane < blocks ? *cluster.map_shared_rank(&s.best, lane) : 0;
    m = warp_max_u64(m);
    if (lane == 0) s.row_value = m;
  }
  __syncthreads();
  const u64 row_best = s.row_value;
  if (greedy) {  // argmax_cpu's id: the complement in the low half
    if (rank == 0 && tid == 0)
      out_ids[r] = static_cast<int32_t>(0xffffffffu - static_cast<uint32_t>(row_best));
    cluster.sync();  // nobody leaves while another block may still read its s.best
    return;
  }
  const float z_max = z_of_key(static_cast<uint32_t>(row_best >> 32));  // the largest scaled logit

  // 3. The radix select: top-k's digits, then top-p's (among the top-k survivors), as the state says.
  // Version 1 (and version 2 in clusters of 1 or 2): the blocks add their histograms into rank 0's; barrier;
  // rank 0 decides and writes the row's next state into every block; barrier. Two barriers a digit.
  // Version 2 in clusters of 4 or more: ONE barrier a digit. Block q owns the row histogram's buckets
  // [q * range, (q + 1) * range), in three copies used in turn by the digits (s.row_hist holds 3 * range
  // words): the blocks add into the owners' copy `pass % 3`; barrier; EVERY block reads the whole row
  // histogram from the owners and makes the same decision (the same integers, the same rule). Three copies
  // because nothing orders one block's reading of digit d's copy against another block's adding digit d+1:
  // d+1 adds into the next copy, and each owner zeroes copy (pass + 2) % 3, last read at digit d-1 (before
  // this barrier) and next added into at digit d+2 (after the next one).
  RowState st = first_state;
  u64* rank0_hist = cluster.map_shared_rank(s.row_hist, 0);
  const bool one_barrier = kVersion == 2 && blocks >= 4 && kBuckets % blocks == 0;  // cluster-uniform
  const int range = kBuckets / blocks;  // buckets per owner (one_barrier: 3 * range <= kBuckets)
  auto owned = [&](int copy, int b) {   // the address of bucket b of the row histogram's copy `copy`
    return cluster.map_shared_rank(s.row_hist, b / range) + copy * range + b % range;
  };
  bool counted = count_in_load;  // version 2: the first digit's histogram is already complete
  u64 my_kept = 0;  // version 2, top-p rows: this thread's buckets' share of the block's kept mass
  bool fell_back = false;  // version 3: the list overflowed and top-p ran version 1's digits (uniform)
  bool k_kept_from_list = false;  // version 4, top-k alone: my_kept holds the block's listed kept mass
  for (int pass = 0; st.mode != kModeDraw; ++pass) {
    const bool top_p = measures_mass(st);
    const bool fine_pass = kFine && st.mode == kModeTopPFine;
    // Token i = tid + j * kThreads, as a loop every lane of a warp runs the same number of times (i0 is the
    // warp's first token): the warp votes below.
    for (int i0 = counted ? n : tid - lane; i0 < n; i0 += kThreads) {
      const int i = i0 + lane;
      const uint32_t key = i < n ? keys[i] : 0u;
      u64 measure = 0;  // 1 (top-k) or the token's mass (top-p); 0 for a token that is not a candidate
      if (i < n && is_candidate(st, key)) measure = top_p ? token_mass(z_of_key(key), z_max) : 1u;
      const uint32_t digit = fine_pass ? fine_bucket(key, z_max) : digit_of(st, key);
      const unsigned measured = __ballot_sync(0xffffffffu, measure != 0);
      if (measured == 0) continue;
      // A warp whose measured tokens all fall into one bucket (a flat row; a masked row's -inf tokens under
      // top-k; a plateau of tied logits) adds them with ONE atomic: 32 atomics on one shared-memory word
      // would run one after another. Rare otherwise, and the vote costs three instructions per 32 tokens.
      const int first = __ffs(static_cast<int>(measured)) - 1;
      const uint32_t first_digit = __shfl_sync(0xffffffffu, digit, first);
      if (__all_sync(0xffffffffu, measure == 0 || digit == first_digit)) {
        const u64 total = top_p ? warp_sum_u64(measure) : static_cast<u64>(__popc(measured));
        if (lane == first) sampler_block::add_to_bucket(s.lo, s.hi, first_digit, total);
      } else if (measure != 0) {
        if (!top_p)
          atomicAdd(&s.lo[digit], 1u);
        else
          sampler_block::add_to_bucket(s.lo, s.hi, digit, measure);
      }
    }
    counted = false;
    __syncthreads();
    // Nonzero buckets into rank 0's row histogram (integers: the order of the adds cannot matter); our own
    // buckets back to zero for the next digit (version 2 keeps top-p's until the pick is known).
    const int buckets = fine_pass ? kBuckets : 1 << digit_bits(st.level);
    const bool keep_local = kDrawFromDigits && top_p;
    const int copy = pass % 3;
    for (int b = tid; b < buckets; b += kThreads) {
      const u64 v = (static_cast<u64>(s.hi[b]) << 32) + s.lo[b];
      if (v != 0) {
        atomicAdd(one_barrier ? owned(copy, b) : rank0_hist + b, v);
        if (!keep_local) s.lo[b] = s.hi[b] = 0;
      }
    }
    cluster.sync();  // the row's histogram is complete
    RowState next;
    int picked_bucket;
    if (one_barrier) {
      for (int i = tid; i < range; i += kThreads) s.row_hist[((pass + 2) % 3) * range + i] = 0;
      const Pick pick = decide<kThreads>([&](int b) { return *owned(copy, b); }, buckets, st, row, s);
      next = advance(st, row, pick, kFine, kListK);
      picked_bucket = pick.bucket;
    } else {
      if (rank == 0) {
        auto take = [&](int b) {  // rank 0's row histogram, zeroed on the way for the next digit
          const u64 v = s.row_hist[b];
          s.row_hist[b] = 0;
          return v;
        };
        const Pick pick = decide<kThreads>(take, buckets, st, row, s);
        if (tid < blocks) {
          *cluster.map_shared_rank(&s.state, tid) = advance(st, row, pick, kFine, kListK);
          *cluster.map_shared_rank(&s.picked, tid) = pick.bucket;
        }
      }
      cluster.sync();  // every block has the new state
      next = s.state;
      picked_bucket = s.picked;
    }
    if (keep_local) {  // version 2: this block's tokens that the pick keeps for sure (bucket_is_kept)
      const uint32_t picked = static_cast<uint32_t>(picked_bucket);
      for (int b = tid; b < buckets; b += kThreads) {
        const u64 v = (static_cast<u64>(s.hi[b]) << 32) + s.lo[b];
        // (the fine pass: the buckets above the pick; the list decides the picked one's keys)
        if (fine_pass ? static_cast<uint32_t>(b) > picked
                      : bucket_is_kept(st.level, static_cast<uint32_t>(b), picked))
          my_kept += v;
        s.lo[b] = s.hi[b] = 0;  // the next digit's atomics come after the next barrier (its pass's end)
      }
      __syncthreads();  // zeroed before any thread of the block counts the next digit
    }
    st = next;
    if (kListK && st.mode == kModeTopKList) {
      st = resolve_list<kThreads>(st, z_max, keys, n, list_capacity, row, cluster, s, &my_kept, &fell_back);
      k_kept_from_list = st.mode == kModeDraw;  // top-k alone, and the list did not overflow (uniform)
    }
    if (kFine && st.mode == kModeTopPList)
      st = resolve_list<kThreads>(st, z_max, keys, n, list_capacity, row, cluster, s, &my_kept, &fell_back);
  }

  // 4. The draw. Thread t's piece [t * piece, (t + 1) * piece) of the chunk: its kept mass, a block scan.
  // Version 2, rows with top-p: the block's kept mass is the sum of the threads' my_kept (the same integer
  // the pieces would give), and only the block that holds U scans its pieces, below.
  // top-p ran (initial_state / advance) and, in version 3, its list did not overflow
  // (version 4: or top-k alone found its threshold by the list, which holds every kept key)
  const bool mass_from_digits = kDrawFromDigits && (row.top_p < 1.0f || k_kept_from_list) && !fell_back;
  const int p_lo = min(n, tid * piece), p_hi = min(n, p_lo + piece);
  auto scan_pieces = [&](u64* piece_mass, u64* block_total) {
    u64 m = 0;
    for (int i = p_lo; i < p_hi; ++i) m += kept_mass(keys[i], z_max, st.threshold);
    *piece_mass = m;
    return block_inclusive_scan<kThreads>(m, block_total, s);
  };
  if (tid == 0) s.pick_thread = -1;
  u64 mine = 0, incl = 0, block_mass = 0;
  if (mass_from_digits)
    (void)block_inclusive_scan<kThreads>(my_kept, &block_mass, s);  // only the total is used
  else
    incl = scan_pieces(&mine, &block_mass);
  if (tid == 0) s.draw_sum = block_mass;
  cluster.sync();   // every block's kept mass is ready
  if (warp == 0) {  // the row's kept mass W and the mass of the blocks before this one
    const u64 m = lane < blocks ? *cluster.map_shared_rank(&s.draw_sum, lane) : 0;
    const u64 all = warp_sum_u64(m);
    const u64 before = warp_sum_u64(lane < rank ? m : 0);
    if (lane == 0) {
      s.row_value = all;
      s.before = before;
    }
  }
  __syncthreads();
  const u64 kept = s.row_value, before = s.before;
  // U uniform in [0, W) from (seed, step); the token whose interval [mass before it, + its mass) holds U.
  const u64 u = mulhi_u64(random_u64(row.seed, row.step), kept);
  if (mass_from_digits && before <= u && u < before + block_mass) {  // the same for the whole block
    u64 total = 0;
    incl = scan_pieces(&mine, &total);  // total == block_mass: the same tokens' masses, summed otherwise
  }
  const u64 piece_base = before + incl - mine;
  if (piece_base <= u && u < piece_base + mine) {  // exactly one thread of the row (its mass is > 0)
    s.pick_thread = tid;
    s.pick_base = piece_base;
  }
  __syncthreads();
  if (s.pick_thread >= 0 && warp == 0) {  // warp 0 walks the piece, 32 tokens at a time
    const int lo = min(n, s.pick_thread * piece), hi = min(n, lo + piece);
    u64 base = s.pick_base;
    int picked = lo;
    for (int start = lo; start < hi; start += kWarpSize) {
      const int i = start + lane;
      const u64 run = warp_inclusive_scan_u64(i < hi ? kept_mass(keys[i], z_max, st.threshold) : 0);
      const unsigned hit = __ballot_sync(0xffffffffu, base + run > u);
      if (hit) {
        picked = start + __ffs(static_cast<int>(hit)) - 1;
        break;
      }
      base += __shfl_sync(0xffffffffu, run, kWarpSize - 1);
    }
    if (lane == 0) out_ids[r] = begin + picked;
  }
  if (!(u < kept) && rank == 0 && tid == 0) out_ids[r] = 0;  // only for W == 0, which a valid row never has
  cluster.sync();  // nobody leaves while another block may still read its s.draw_sum
}

size_t max_shared_bytes() {
  return sizeof(Shared) + sizeof(uint32_t) * static_cast<size_t>(kMaxTokensPerBlock);
}

cudaLaunchConfig_t launch_config(dim3 grid, int threads, int cluster, size_t smem, cudaStream_t stream,
                                 cudaLaunchAttribute* attribute) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(static_cast<unsigned>(threads), 1, 1);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  *attribute = {};
  attribute->id = cudaLaunchAttributeClusterDimension;
  attribute->val.clusterDim.x = static_cast<unsigned>(cluster);
  attribute->val.clusterDim.y = 1;
  attribute->val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  return config;
}

// The largest cluster one instantiation of the kernel can launch at full shared memory (0: none).
template <int kThreads, int kVersion>
int max_cluster_of() {
  const auto kernel = sample_rows<kThreads, kVersion>;
  TVLLM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(max_shared_bytes())));
  // All of the SM's unified L1/shared storage as shared memory, so that two blocks of ~96 KiB fit (the
  // kernel streams its logits once: it has little use for an L1 cache).
  TVLLM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                        static_cast<int>(cudaSharedmemCarveoutMaxShared)));
  // Clusters above 8 blocks are "non-portable": allowed on the H100/H200 after this opt-in. If the device
  // refuses it, the query below simply finds 8 the largest.
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess)
    (void)cudaGetLastError();  // clear the (non-sticky) error
  for (int c = kMaxClusterSize; c >= 1; c /= 2) {
    cudaLaunchAttribute attribute;
    const cudaLaunchConfig_t config = launch_config(dim3(static_cast<unsigned>(c), 1, 1), kThreads, c,
                                                    max_shared_bytes(), nullptr, &attribute);
    int clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) == cudaSuccess && clusters > 0)
      return c;
    (void)cudaGetLastError();
  }
  return 0;
}

}  // namespace

size_t shared_bytes(const Plan& plan) {
  return sizeof(Shared) + sizeof(uint32_t) * static_cast<size_t>(plan.chunk);
}

int max_cluster_size() {
  int device = 0, major = 0;
  TVLLM_CUDA_CHECK(cudaGetDevice(&device));
  TVLLM_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  if (major < 9) return 0;  // thread-block clusters are Hopper's
  // Both versions use the same shared memory, so they reach the same sizes; each needs its attributes set.
  return std::min({max_cluster_of<kThreadsShared, 1>(), max_cluster_of<kThreadsAlone, 1>(),
                   max_cluster_of<kThreadsShared, 2>(), max_cluster_of<kThreadsAlone, 2>(),
                   max_cluster_of<kThreadsShared, 3>(), max_cluster_of<kThreadsAlone, 3>(),
                   max_cluster_of<kThreadsShared, 4>(), max_cluster_of<kThreadsAlone, 4>()});
}

void launch(const float* logits, int64_t row_stride, int64_t vocab, int batch, const SamplingRow* rows,
            int32_t* out_ids, const Plan& plan, cudaStream_t stream) {
  TVLLM_REQUIRE(
      plan.cluster >= 1 && (plan.threads == kThreadsShared || plan.threads == kThreadsAlone) &&
          plan.chunk >= 1 && plan.piece >= 1 && static_cast<int64_t>(plan.cluster) * plan.chunk >= vocab &&
          plan.chunk <= kMaxTokensPerBlock && static_cast<int64_t>(plan.piece) * plan.threads >= plan.chunk &&
          plan.version >= 1 && plan.version <= 4 && plan.list_capacity >= 0 &&
          plan.list_capacity <= kListCapacity,
      "cluster_sampler::launch: the plan does not cover the row");
  cudaLaunchAttribute attribute;
  const cudaLaunchConfig_t config =
      launch_config(dim3(static_cast<unsigned>(plan.cluster), static_cast<unsigned>(batch), 1), plan.threads,
                    plan.cluster, shared_bytes(plan), stream, &attribute);
  auto go = [&](auto kernel) {
    TVLLM_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, logits, row_stride, static_cast<int>(vocab),
                                        plan.chunk, plan.piece, plan.list_capacity, rows, out_ids));
  };
  const bool alone = plan.threads == kThreadsAlone;
  if (plan.version == 1)
    alone ? go(sample_rows<kThreadsAlone, 1>) : go(sample_rows<kThreadsShared, 1>);
  else if (plan.version == 2)
    alone ? go(sample_rows<kThreadsAlone, 2>) : go(sample_rows<kThreadsShared, 2>);
  else if (plan.version == 3)
    alone ? go(sample_rows<kThreadsAlone, 3>) : go(sample_rows<kThreadsShared, 3>);
  else
    alone ? go(sample_rows<kThreadsAlone, 4>) : go(sample_rows<kThreadsShared, 4>);
}

}  // namespace tvllm::cluster_sampler
