// Lesson 14: the fast sampler's multi-pass path (the cluster path is cluster_sampler.cu; sample() below
// picks one per call). The same distribution and the same draw as lesson 09 (sampling_math.h does every step
// that decides a token: scaled_logit, order_key, token_mass, top_p_target, random_u64, mulhi_u64),
// computed by many blocks per row.
//
//   grid (chunks, rows): block (c, r) reads tokens [c * chunk_len, (c + 1) * chunk_len) of row r.
//
//   first pass   every token: key = order_key(z), stored in the workspace (the later passes read the
//                keys: no logits, no division; z_of_key gives z back for the masses); block max of
//                (key, -id) -> one 64-bit atomicMax per warp; top-k rows also count their keys by the
//                top 11 bits (digit 0).
//   select pass  one digit of the radix select (bits 31..21, 20..10, 9..0): the block histograms the
//                candidates (the tokens whose key agrees with the bits decided so far, and >= the top-k
//                threshold for top-p) into 2048 buckets in shared memory, counting 1 (top-k) or the
//                token's mass (top-p), then adds its nonzero buckets to the row's global histogram.
//   draw pass    each warp adds the kept masses of one contiguous segment of the chunk.
//
// After its atomics, every block bumps its row's counter; the block that brings it to `chunks` is the
// last of its row, sees every other block's contribution, and decides for the row alone: the argmax, the
// bucket where the count / mass from the top reaches its target, or the token the draw lands on. So the
// decisions need no extra launches, and rows never wait for each other. The last block also puts the
// histogram and the counter back to zero, so the workspace is all zeros between passes and calls.
//
// Why it is exact: counts and masses are integers, so a histogram's buckets are the same whatever order the
// atomics land in; the max of (key, -id) pairs is order-free too. Each decision is then lesson 09's rule
// on the same numbers: the largest key t whose measure(key >= t) reaches the target (lesson 09 takes 4
// bits a pass, we take 11: the rule does not depend on the digit width), and the token whose interval
// [mass before it, mass before it + its mass) in index order holds U.
// One shortcut, also exact: when the count from the top reaches k exactly at a bucket, every key of that
// bucket is among the k largest, so the bucket's lowest possible key keeps the same set as the k-th key.
#include "fast_sampler.h"

#include "cluster_sampler.h"
#include "sampler_block.cuh"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/cuda_utils.cuh"  // kWarpSize, ceil_div
#include "common/dtype.h"       // bf16 rounding for the benchmark rows
#include "common/errors.h"
#include "common/random.h"
#include "sampling_math.h"

namespace tvllm {

namespace {

using namespace sampling;
using sampler_block::u64;  // the type CUDA's 64-bit atomics take

constexpr int kThreads = FastSampler::kThreads;  // 256
constexpr int kWarps = kThreads / kWarpSize;     // 8
constexpr int kBuckets = 2048;                   // 11 bits a digit: 3 digits cover the 32-bit key
constexpr int kMinChunk = 1024;                  // tokens per block, at least (4 per thread)

// The three digits of a key, from the top.
__device__ __forceinline__ int digit_shift(int level) { return level == 0 ? 21 : (level == 1 ? 10 : 0); }
__device__ __forceinline__ int digit_bits(int level) { return level == 2 ? 10 : 11; }

enum Mode : int {
  kModeTopK = 1,  // the next select pass decides a digit of the top-k threshold
  kModeTopP = 2,  // ... of the top-p threshold
  kModeDraw = 3,  // thresholds known: the draw pass picks the token
  kModeDone = 4,  // the id is written (greedy rows after the first pass, every row after the draw)
};

// One row's state between passes. Written only by the row's last block of a pass, read by every block
// of the row in the next pass (a kernel boundary orders the two).
struct RowState {
  u64 best;                   // first pass: max of (key << 32 | ~id); 0 between calls
  unsigned int done_blocks;   // blocks of this row that finished the current pass; 0 between passes
  int mode;                   // Mode
  int level;                  // the digit the next select pass decides (0, 1, 2)
  uint32_t prefix;            // the key bits decided so far (digits above `level`)
  uint32_t lower;             // candidates have key >= lower (top-p: the top-k threshold)
  uint32_t threshold;         // the final threshold: keys >= threshold are kept
  float z_max;                // the row's largest scaled logit
  uint32_t pad;
  u64 above;                  // the measure of the candidates whose key is above every key with this prefix
  u64 target;                 // top-k: k; top-p: ceil(p * W), set by its first digit
};

struct Workspace {
  uint32_t* keys;    // [max_batch][key_stride]: the first pass's order_key of every scaled logit
  int64_t key_stride;
  RowState* states;  // [max_batch]
  u64* hist;         // [max_batch][kBuckets], zeros between passes
  u64* segments;     // [max_batch][max_chunks * kWarps]: the draw pass's segment masses
  int segment_stride;
};

struct Shared {
  // This block's histogram of one digit, as two 32-bit halves: shared-memory atomics are native for 32-bit
  // words (a 64-bit add would be a compare-and-swap loop). Bucket b holds words[1][b] * 2^32 + words[0][b].
  // The last block then reuses the space for the row's histogram, read back (`picked`).
  union {
    uint32_t words[2][kBuckets];  // [0]: low halves, [1]: high halves
    u64 picked[kBuckets];
  } hist;  // 16 KiB
  u64 warp_u64[kWarps];
  u64 pick_above, pick_in_bucket, pick_target, pick_base;
  int pick_bucket, pick_index;
  bool last;
};

// ---- block helpers ------------------------------------------------------------------------------------

using sampler_block::add_to_bucket;
using sampler_block::warp_max_u64;

__device__ u64 block_inclusive_scan(u64 v, u64* total, Shared& s) {
  return sampler_block::block_inclusive_scan<kThreads>(v, total, s.warp_u64);
}

__device__ void zero_shared_hist(Shared& s) {
  for (int b = threadIdx.x; b < kBuckets; b += kThreads) s.hist.words[0][b] = s.hist.words[1][b] = 0;
}

// Adds the block's nonzero buckets to the row's global histogram (integers: any order gives the same sums).
__device__ void flush_hist(Shared& s, u64* global_hist) {
  __syncthreads();  // every token counted
  for (int b = threadIdx.x; b < kBuckets; b += kThreads) {
    const u64 v = (static_cast<u64>(s.hist.words[1][b]) << 32) + s.hist.words[0][b];
    if (v != 0) atomicAdd(global_hist + b, v);
  }
}

// Calls fn(i, x[i]) for this thread's tokens of [begin, end): first, first + stride, ... Loads kUnroll
// values before using any, so that every thread has kUnroll loads in flight (one at a time would leave
// the memory system mostly idle: the row would stream at a fraction of the bandwidth).
template <int kStride, class T, class Fn>
__device__ __forceinline__ void for_each_token(const T* __restrict__ x, int first, int end, Fn&& fn) {
  constexpr int kUnroll = 8;
  for (int base = first; base < end; base += kUnroll * kStride) {
    T v[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) v[j] = base + j * kStride < end ? __ldg(x + base + j * kStride) : T{};
#pragma unroll
    for (int j = 0; j < kUnroll; ++j)
      if (base + j * kStride < end) fn(base + j * kStride, v[j]);
  }
}

// True in the row's last block to finish this pass (the same answer in all its threads). Every thread
// fences its own global writes and atomics before the block counts itself done, so the last block sees
// all of them; the last block then resets the counter for the next pass.
__device__ bool is_last_block(RowState* st, int chunks, Shared& s) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned int finished = atomicAdd(&st->done_blocks, 1u);
    s.last = finished == static_cast<unsigned int>(chunks - 1);
    if (s.last) st->done_blocks = 0;  // every other block has counted itself: safe to reset
  }
  __syncthreads();
  if (s.last) __threadfence();
  return s.last;
}

// The decision of one radix digit, by the row's last block over the row's global histogram of `buckets`
// buckets: the highest bucket b at which above + measure(buckets >= b) reaches the target. When
// target_p > 0 (top-p's first digit) the target is top_p_target(p, the histogram's total) instead.
// Zeroes the global histogram. Result in s.pick_*; every thread may read it after the call.
__device__ void pick_bucket(u64* global_hist, int buckets, u64 target, float target_p, u64 above, Shared& s) {
  const int per = buckets / kThreads;  // 8 or 4 buckets per thread, contiguous
  const int first = threadIdx.x * per;
  u64 mine = 0;
  for (int j = 0; j < per; ++j) {
    const u64 h = __ldcg(global_hist + first + j);  // from L2, where the atomics landed
    s.hist.picked[first + j] = h;
    global_hist[first + j] = 0;
    mine += h;
  }
  if (threadIdx.x == 0) {  // unreachable fallback, as lesson 09's: bucket 0
    s.pick_bucket = 0;
    s.pick_above = above;
    s.pick_in_bucket = 0;
  }
  u64 total = 0;
  const u64 incl = block_inclusive_scan(mine, &total, s);  // (its barrier also orders the stores above)
  if (target_p > 0.0f) target = top_p_target(target_p, total);
  u64 acc = above + (total - incl);  // the measure of every bucket above this thread's
  if (acc < target && acc + mine >= target) {  // the crossing is in this thread's buckets: exactly one
    for (int b = first + per - 1; b >= first; --b) {
      const u64 h = s.hist.picked[b];
      if (acc + h >= target) {
        s.pick_bucket = b;
        s.pick_above = acc;
        s.pick_in_bucket = h;
        break;
      }
      acc += h;
    }
  }
  if (threadIdx.x == 0) s.pick_target = target;
  __syncthreads();
}

// order_key inverted (cluster_sampler.h): the later passes need neither the logits nor the division.
using cluster_sampler::z_of_key;

// ---- the passes ---------------------------------------------------------------------------------------

struct Launch {
  const float* logits;
  int64_t row_stride;
  int vocab;
  int chunk_len;
  int chunks;
  const SamplingRow* rows;
  int32_t* out_ids;
  Workspace ws;
};

// Applies a decided digit (s.pick_*) to the row's state: the next digit, the next selection, or the draw.
__device__ void advance_row(RowState* st, const SamplingRow& row, int mode, int level, uint32_t prefix,
                            const Shared& s) {
  const int shift = digit_shift(level);
  prefix |= static_cast<uint32_t>(s.pick_bucket) << shift;
  const u64 measured = s.pick_above + s.pick_in_bucket;
  bool threshold_known = level == 2;
  if (mode == kModeTopK && measured == s.pick_target) threshold_known = true;
  if (!threshold_known) {
    st->mode = mode;
    st->level = level + 1;
    st->prefix = prefix;
    st->above = s.pick_above;
    st->target = s.pick_target;
    return;
  }
  st->threshold = prefix;  // the low digits not decided are 0: the lowest key of the bucket
  if (mode == kModeTopK && row.top_p < 1.0f) {  // top-p next, among the top-k survivors
    st->mode = kModeTopP;
    st->level = 0;
    st->prefix = 0;
    st->lower = prefix;
    st->above = 0;
    st->target = 0;
  } else {
    st->mode = kModeDraw;
  }
}

__global__ void __launch_bounds__(kThreads) first_pass(Launch a) {
  __shared__ Shared s;
  const int r = blockIdx.y, c = blockIdx.x;
  const SamplingRow row = a.rows[r];
  const float* x = a.logits + static_cast<int64_t>(r) * a.row_stride;
  RowState* st = a.ws.states + r;
  uint32_t* keys = a.ws.keys + static_cast<int64_t>(r) * a.ws.key_stride;
  const bool greedy = !(row.temperature > 0.0f);  // 0 (and, defensively, anything not positive)
  const bool top_k = !greedy && row.top_k > 0 && row.top_k < a.vocab;
  const int begin = c * a.chunk_len, end = min(a.vocab, begin + a.chunk_len);

  if (top_k) zero_shared_hist(s);
  __syncthreads();
  u64 best = 0;  // below every real pair: the smallest key, -inf's, is 0x007fffff
  for_each_token<kThreads>(x, begin + static_cast<int>(threadIdx.x), end, [&](int i, float logit) {
    const float v = greedy ? sanitize_logit(logit) : scaled_logit(logit, row.temperature);
    const uint32_t key = order_key(v);
    // The larger key wins; on equal keys the lower id (its complement is larger): argmax_cpu's rule.
    best = max(best, (static_cast<u64>(key) << 32) | (0xffffffffu - static_cast<uint32_t>(i)));
    if (!greedy) keys[i] = key;  // the one division per token: later passes read the key
    if (top_k) atomicAdd(&s.hist.words[0][key >> 21], 1u);
  });
  best = warp_max_u64(best);
  if (threadIdx.x % kWarpSize == 0) atomicMax(&st->best, best);
  if (top_k) flush_hist(s, a.ws.hist + static_cast<int64_t>(r) * kBuckets);
  if (!is_last_block(st, a.chunks, s)) return;

  // The row's last block: the argmax / z_max, and top-k's first digit.
  if (threadIdx.x == 0) {
    s.pick_base = __ldcg(&st->best);
    st->best = 0;
  }
  __syncthreads();
  const u64 row_best = s.pick_base;
  if (greedy) {
    if (threadIdx.x == 0) {
      a.out_ids[r] = static_cast<int32_t>(0xffffffffu - static_cast<uint32_t>(row_best));
      st->mode = kModeDone;
    }
    return;
  }
  const float z_max = z_of_key(static_cast<uint32_t>(row_best >> 32));  // the largest scaled logit
  if (top_k) {
    pick_bucket(a.ws.hist + static_cast<int64_t>(r) * kBuckets, kBuckets, static_cast<u64>(row.top_k), 0.0f, 0,
                s);
    if (threadIdx.x == 0) {
      st->z_max = z_max;
      st->lower = 0;
      advance_row(st, row, kModeTopK, 0, 0u, s);
    }
    return;
  }
  if (threadIdx.x == 0) {
    st->z_max = z_max;
    st->threshold = 0;  // no top-k: every key survives it
    st->lower = 0;
    st->prefix = 0;
    st->level = 0;
    st->above = 0;
    st->target = 0;
    st->mode = row.top_p < 1.0f ? kModeTopP : kModeDraw;
  }
}

__global__ void __launch_bounds__(kThreads) select_pass(Launch a) {
  __shared__ Shared s;
  const int r = blockIdx.y, c = blockIdx.x;
  RowState* st = a.ws.states + r;
  const int mode = st->mode;
  if (mode != kModeTopK && mode != kModeTopP) return;  // the whole row's blocks return: no counting
  const SamplingRow row = a.rows[r];
  const uint32_t* keys = a.ws.keys + static_cast<int64_t>(r) * a.ws.key_stride;
  const int level = st->level;
  const uint32_t prefix = st->prefix, lower = st->lower;
  const float z_max = st->z_max;
  const bool top_p = mode == kModeTopP;
  const int shift = digit_shift(level), bits = digit_bits(level);
  const uint32_t decided = level == 0 ? 0u : 0xffffffffu << (shift + bits);  // the bits already fixed
  const uint32_t digit_mask = (1u << bits) - 1u;
  const int begin = c * a.chunk_len, end = min(a.vocab, begin + a.chunk_len);

  zero_shared_hist(s);
  __syncthreads();
  for_each_token<kThreads>(keys, begin + static_cast<int>(threadIdx.x), end, [&](int, uint32_t key) {
    if (key >= lower && (key & decided) == prefix) {
      if (!top_p) {
        atomicAdd(&s.hist.words[0][(key >> shift) & digit_mask], 1u);
      } else {
        const u64 mass = token_mass(z_of_key(key), z_max);
        if (mass != 0) add_to_bucket(s.hist.words[0], s.hist.words[1], (key >> shift) & digit_mask, mass);
      }
    }
  });
  u64* global_hist = a.ws.hist + static_cast<int64_t>(r) * kBuckets;
  flush_hist(s, global_hist);
  if (!is_last_block(st, a.chunks, s)) return;

  const bool first_p_digit = top_p && level == 0;
  pick_bucket(global_hist, 1 << bits, st->target, first_p_digit ? row.top_p : 0.0f, st->above, s);
  if (threadIdx.x == 0) advance_row(st, row, mode, level, prefix, s);
}

// The kept mass of a token (0 if a threshold removed it), as lesson 09's draw computes it.
__device__ __forceinline__ u64 kept_mass_of(uint32_t key, float z_max, uint32_t threshold) {
  return key >= threshold ? token_mass(z_of_key(key), z_max) : 0;
}

__global__ void __launch_bounds__(kThreads) draw_pass(Launch a) {
  __shared__ Shared s;
  const int r = blockIdx.y, c = blockIdx.x;
  RowState* st = a.ws.states + r;
  if (st->mode != kModeDraw) return;
  const SamplingRow row = a.rows[r];
  const uint32_t* keys = a.ws.keys + static_cast<int64_t>(r) * a.ws.key_stride;
  const uint32_t threshold = st->threshold;
  const float z_max = st->z_max;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int segment_len = static_cast<int>(ceil_div(a.chunk_len, kWarps));
  u64* segments = a.ws.segments + static_cast<int64_t>(r) * a.ws.segment_stride;
  // Segment (c, w): the index range the lambda below gives; warp w reads it 32 tokens at a time.
  auto segment_range = [&](int chunk, int w, int* lo, int* hi) {
    const int chunk_end = min(a.vocab, (chunk + 1) * a.chunk_len);
    *lo = min(chunk_end, chunk * a.chunk_len + w * segment_len);
    *hi = min(chunk_end, *lo + segment_len);
  };
  {
    int lo, hi;
    segment_range(c, warp, &lo, &hi);
    u64 sum = 0;
    for_each_token<kWarpSize>(keys, lo + lane, hi,
                              [&](int, uint32_t key) { sum += kept_mass_of(key, z_max, threshold); });
    sum = sampler_block::warp_sum_u64(sum);
    if (lane == 0) segments[c * kWarps + warp] = sum;
  }
  if (!is_last_block(st, a.chunks, s)) return;

  // The row's last block. 1: the kept mass W, U in [0, W), and the segment whose mass interval holds U.
  const int num_segments = a.chunks * kWarps;
  const int per = static_cast<int>(ceil_div(num_segments, kThreads));  // contiguous segments per thread
  const int first = threadIdx.x * per, last = min(num_segments, first + per);
  u64 mine = 0;
  for (int j = first; j < last; ++j) mine += __ldcg(segments + j);
  if (threadIdx.x == 0) s.pick_index = -1;
  u64 kept_mass = 0;
  const u64 incl = block_inclusive_scan(mine, &kept_mass, s);
  const u64 u = mulhi_u64(random_u64(row.seed, row.step), kept_mass);
  u64 base = incl - mine;
  if (base <= u && u < incl) {  // exactly one thread (its mass is > 0)
    for (int j = first; j < last; ++j) {
      const u64 m = __ldcg(segments + j);
      if (u < base + m) {
        s.pick_index = j;
        s.pick_base = base;
        break;
      }
      base += m;
    }
  }
  __syncthreads();
  const int segment = s.pick_index;
  if (segment < 0) {  // only if U >= the kept mass, which a valid row never gives: lesson 09's id 0
    if (threadIdx.x == 0) {
      a.out_ids[r] = 0;
      st->mode = kModeDone;
    }
    return;
  }
  // 2. Inside the segment: each thread a contiguous piece, a block scan, one thread walks its piece.
  int lo, hi;
  segment_range(segment / kWarps, segment % kWarps, &lo, &hi);
  const u64 segment_base = s.pick_base;
  const int piece = static_cast<int>(ceil_div(hi - lo, kThreads));
  const int p_lo = min(hi, lo + static_cast<int>(threadIdx.x) * piece), p_hi = min(hi, p_lo + piece);
  mine = 0;
  for (int i = p_lo; i < p_hi; ++i) mine += kept_mass_of(keys[i], z_max, threshold);
  __syncthreads();  // s.pick_* read above by every thread before it is rewritten
  if (threadIdx.x == 0) s.pick_index = -1;
  u64 segment_mass = 0;
  const u64 piece_incl = segment_base + block_inclusive_scan(mine, &segment_mass, s);
  u64 cumulative = piece_incl - mine;
  if (cumulative <= u && u < piece_incl) {
    for (int i = p_lo; i < p_hi; ++i) {
      cumulative += kept_mass_of(keys[i], z_max, threshold);
      if (cumulative > u) {
        s.pick_index = i;
        break;
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    a.out_ids[r] = s.pick_index >= 0 ? s.pick_index : 0;
    st->mode = kModeDone;
  }
}

}  // namespace

// ---- the host side ------------------------------------------------------------------------------------

namespace {
// The keys come first in the workspace; rounded up to 256 bytes so that what follows stays aligned.
size_t keys_bytes(int max_batch, int64_t max_vocab) {
  const size_t bytes = sizeof(uint32_t) * static_cast<size_t>(max_vocab) * static_cast<size_t>(max_batch);
  return (bytes + 255) / 256 * 256;
}
// Path::kAuto's cluster kernel: TVLLM_TOPP_V=new / unset (version 3) or old (version 1); TVLLM_TOPK_V=new
// takes version 4 (version 3's top-p and top-k's list; with TVLLM_TOPP_V=old: InputError), old / unset
// leaves the choice to TVLLM_TOPP_V. Read once per sampler, in its constructor (never in sample(), which a
// CUDA graph may capture).
int env_choice(const char* name) {  // 0 unset or empty, 1 "old", 2 "new"
  const char* v = std::getenv(name);
  if (v == nullptr || v[0] == '\0') return 0;
  if (std::strcmp(v, "old") == 0) return 1;
  TVLLM_REQUIRE(std::strcmp(v, "new") == 0,
                std::string("FastSampler: ") + name + " must be 'old' or 'new', got '" + v + "'");
  return 2;
}
int cluster_version_from_env() {
  const int top_p = env_choice("TVLLM_TOPP_V"), top_k = env_choice("TVLLM_TOPK_V");
  if (top_k == 2) {
    TVLLM_REQUIRE(top_p != 1, "FastSampler: TVLLM_TOPK_V=new (version 4) includes version 3's top-p: "
                              "TVLLM_TOPP_V=old contradicts it");
    return 4;
  }
  return top_p == 1 ? 1 : 3;
}

}  // namespace

FastSampler::FastSampler(int max_batch, int64_t max_vocab, Path path)
    : max_batch_(max_batch), max_vocab_(max_vocab) {
  TVLLM_REQUIRE(max_batch >= 1, "FastSampler: max_batch must be >= 1, got " + std::to_string(max_batch));
  TVLLM_REQUIRE(max_vocab >= 1 && max_vocab <= kMaxVocab,
                "FastSampler: max_vocab must be in [1, 2^23], got " + std::to_string(max_vocab));
  int device = 0, sms = 0, per_sm = 0;
  TVLLM_CUDA_CHECK(cudaGetDevice(&device));
  TVLLM_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  sms_ = std::max(1, sms);
  if (path != Path::kMultiPass) max_cluster_ = cluster_sampler::max_cluster_size();
  if (path == Path::kClusterV2) cluster_version_ = 2;
  if (path == Path::kClusterV3) cluster_version_ = 3;
  if (path == Path::kClusterV4) cluster_version_ = 4;
  if (path == Path::kAuto) cluster_version_ = cluster_version_from_env();
  TVLLM_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, select_pass, kThreads, 0));
  wave_blocks_ = std::max(1, sms * std::max(per_sm, 1));
  max_chunks_ = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(wave_blocks_, max_vocab / kMinChunk)));
  // Whether a row fits a cluster depends on the vocab alone (not the batch), and fitting max_vocab means
  // fitting every smaller vocab: then no call takes the multi-pass path, which needs no workspace.
  if (cluster_per_row(1, max_vocab) > 0) return;
  const size_t keys = keys_bytes(max_batch, max_vocab);
  const size_t states = sizeof(RowState) * static_cast<size_t>(max_batch);
  const size_t hist = sizeof(u64) * kBuckets * static_cast<size_t>(max_batch);
  const size_t segments = sizeof(u64) * static_cast<size_t>(max_chunks_) * kWarps * static_cast<size_t>(max_batch);
  workspace_ = DeviceBuffer(keys + states + hist + segments);
  workspace_.fill_zero();  // the passes keep it zero between calls (counters, argmax slots, histograms)
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
}

int FastSampler::cluster_per_row(int batch, int64_t vocab) const {
  return cluster_sampler::plan_call(std::max(batch, 1), vocab, sms_, max_cluster_).cluster;
}

int FastSampler::chunks_per_row(int batch, int64_t vocab) const {
  // Rounded down: one more block per row than fits would add a second, almost empty wave to every pass.
  const int64_t wanted = wave_blocks_ / std::max(batch, 1);
  const int64_t chunks = std::min<int64_t>({wanted, std::max<int64_t>(1, vocab / kMinChunk), max_chunks_});
  return static_cast<int>(std::max<int64_t>(1, chunks));
}

void FastSampler::sample(const float* logits, int64_t row_stride, int64_t vocab, int batch,
                         const SamplingRow* rows, int32_t* out_ids, cudaStream_t stream) const {
  TVLLM_REQUIRE(batch >= 0 && batch <= max_batch_, "FastSampler::sample: batch " + std::to_string(batch) +
                                                       " outside [0, " + std::to_string(max_batch_) + "]");
  TVLLM_REQUIRE(vocab >= 1 && vocab <= max_vocab_, "FastSampler::sample: vocab " + std::to_string(vocab) +
                                                       " outside [1, " + std::to_string(max_vocab_) + "]");
  TVLLM_REQUIRE(row_stride >= vocab, "FastSampler::sample: row_stride " + std::to_string(row_stride) +
                                         " < vocab " + std::to_string(vocab));
  if (batch == 0) return;
  TVLLM_REQUIRE(logits && rows && out_ids, "FastSampler::sample: null pointer");
  cluster_sampler::Plan plan = cluster_sampler::plan_call(batch, vocab, sms_, max_cluster_);
  plan.version = cluster_version_;
  if (plan.cluster > 0) {
    cluster_sampler::launch(logits, row_stride, vocab, batch, rows, out_ids, plan, stream);
    return;
  }
  int chunks = chunks_per_row(batch, vocab);
  const int chunk_len = static_cast<int>(ceil_div(vocab, chunks));
  chunks = static_cast<int>(ceil_div(vocab, chunk_len));  // no empty chunk
  char* base = workspace_.as<char>();
  Workspace ws;
  ws.keys = reinterpret_cast<uint32_t*>(base);
  ws.key_stride = max_vocab_;
  base += keys_bytes(max_batch_, max_vocab_);
  ws.states = reinterpret_cast<RowState*>(base);
  ws.hist = reinterpret_cast<u64*>(base + sizeof(RowState) * static_cast<size_t>(max_batch_));
  ws.segments = ws.hist + static_cast<size_t>(kBuckets) * static_cast<size_t>(max_batch_);
  ws.segment_stride = max_chunks_ * kWarps;
  const Launch launch{logits, row_stride, static_cast<int>(vocab), chunk_len, chunks, rows, out_ids, ws};
  const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(batch));
  first_pass<<<grid, kThreads, 0, stream>>>(launch);
  TVLLM_CHECK_LAUNCH();
  // Top-k takes at most 2 more digits, top-p at most 3: five select passes cover every row.
  for (int pass = 0; pass < kMultiPassLaunches - 2; ++pass) {
    select_pass<<<grid, kThreads, 0, stream>>>(launch);
    TVLLM_CHECK_LAUNCH();
  }
  draw_pass<<<grid, kThreads, 0, stream>>>(launch);
  TVLLM_CHECK_LAUNCH();
}

// ---- benchmark helper ---------------------------------------------------------------------------------

SamplerTiming bench_fast_sampler(int batch, int64_t vocab, const SamplingParams& params, int iters) {
  TVLLM_REQUIRE(batch >= 1 && iters >= 1, "bench_fast_sampler: batch and iters must be >= 1");
  std::vector<float> logits = random_normal(static_cast<size_t>(batch) * static_cast<size_t>(vocab), 2024, 2.0f);
  for (float& v : logits) v = bf16_to_f32(f32_to_bf16(v));  // as a bf16 lm_head gives them: many ties
  std::vector<SamplingRow> rows;
  for (int b = 0; b < batch; ++b) rows.push_back(make_sampling_row(params, static_cast<uint64_t>(b)));
  DeviceBuffer logits_d(logits.size() * sizeof(float)), rows_d(rows.size() * sizeof(SamplingRow));
  DeviceBuffer fast_ids(sizeof(int32_t) * static_cast<size_t>(batch));
  DeviceBuffer ref_ids(sizeof(int32_t) * static_cast<size_t>(batch));
  logits_d.copy_from_host(logits.data(), logits_d.bytes());
  rows_d.copy_from_host(rows.data(), rows_d.bytes());
  FastSampler fast(batch, vocab);
  FastSampler multipass(batch, vocab, FastSampler::Path::kMultiPass);
  FastSampler cluster_v2(batch, vocab, FastSampler::Path::kClusterV2);
  FastSampler cluster_v1(batch, vocab, FastSampler::Path::kClusterV1);
  FastSampler cluster_v3(batch, vocab, FastSampler::Path::kClusterV3);
  FastSampler cluster_v4(batch, vocab, FastSampler::Path::kClusterV4);
  DeviceBuffer v2_ids(sizeof(int32_t) * static_cast<size_t>(batch));
  DeviceBuffer v1_ids(sizeof(int32_t) * static_cast<size_t>(batch));
  DeviceBuffer v3_ids(sizeof(int32_t) * static_cast<size_t>(batch));
  DeviceBuffer v4_ids(sizeof(int32_t) * static_cast<size_t>(batch));
  GpuSampler reference(batch, vocab);
  DeviceBuffer multipass_ids(sizeof(int32_t) * static_cast<size_t>(batch));
  cudaStream_t stream = nullptr;
  TVLLM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t start = nullptr, stop = nullptr;
  TVLLM_CUDA_CHECK(cudaEventCreate(&start));
  TVLLM_CUDA_CHECK(cudaEventCreate(&stop));
  auto time_us = [&](auto&& call) {
    for (int i = 0; i < 3; ++i) call();
    TVLLM_CUDA_CHECK(cudaEventRecord(start, stream));
    for (int i = 0; i < iters; ++i) call();
    TVLLM_CUDA_CHECK(cudaEventRecord(stop, stream));
    TVLLM_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0.0f;
    TVLLM_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    return 1000.0 * static_cast<double>(ms) / iters;
  };
  SamplerTiming timing;
  timing.fast_us = time_us([&] {
    fast.sample(logits_d.as<float>(), vocab, vocab, batch, rows_d.as<SamplingRow>(), fast_ids.as<int32_t>(), stream);
  });
  timing.cluster = fast.cluster_per_row(batch, vocab);
  timing.cluster_v2_us = time_us([&] {
    cluster_v2.sample(logits_d.as<float>(), vocab, vocab, batch, rows_d.as<SamplingRow>(),
                      v2_ids.as<int32_t>(), stream);
  });
  timing.cluster_v1_us = time_us([&] {
    cluster_v1.sample(logits_d.as<float>(), vocab, vocab, batch, rows_d.as<SamplingRow>(),
                      v1_ids.as<int32_t>(), stream);
  });
  timing.cluster_v3_us = time_us([&] {
    cluster_v3.sample(logits_d.as<float>(), vocab, vocab, batch, rows_d.as<SamplingRow>(),
                      v3_ids.as<int32_t>(), stream);
  });
  timing.cluster_v4_us = time_us([&] {
    cluster_v4.sample(logits_d.as<float>(), vocab, vocab, batch, rows_d.as<SamplingRow>(),
                      v4_ids.as<int32_t>(), stream);
  });
  timing.multipass_us = time_us([&] {
    multipass.sample(logits_d.as<float>(), vocab, vocab, batch, rows_d.as<SamplingRow>(), multipass_ids.as<int32_t>(),
                     stream);
  });
  timing.lesson09_us = time_us([&] {
    reference.sample(logits_d.as<float>(), vocab, vocab, batch, rows_d.as<SamplingRow>(), ref_ids.as<int32_t>(),
                     stream);
  });
  TVLLM_CUDA_CHECK(cudaStreamSynchronize(stream));
  TVLLM_CUDA_CHECK(cudaEventDestroy(start));
  TVLLM_CUDA_CHECK(cudaEventDestroy(stop));
  TVLLM_CUDA_CHECK(cudaStreamDestroy(stream));
  std::vector<int32_t> a(static_cast<size_t>(batch)), b(static_cast<size_t>(batch)), m(static_cast<size_t>(batch));
  fast_ids.copy_to_host(a.data(), fast_ids.bytes());
  ref_ids.copy_to_host(b.data(), ref_ids.bytes());
  multipass_ids.copy_to_host(m.data(), multipass_ids.bytes());
  std::vector<int32_t> v1(static_cast<size_t>(batch));
  v2_ids.copy_to_host(v1.data(), v2_ids.bytes());
  TVLLM_REQUIRE(v1 == b, "bench_fast_sampler: FastSampler's second cluster kernel and GpuSampler disagree");
  v1_ids.copy_to_host(v1.data(), v1_ids.bytes());
  TVLLM_REQUIRE(v1 == b, "bench_fast_sampler: FastSampler's first cluster kernel and GpuSampler disagree");
  v3_ids.copy_to_host(v1.data(), v3_ids.bytes());
  TVLLM_REQUIRE(v1 == b, "bench_fast_sampler: FastSampler's third cluster kernel and GpuSampler disagree");
  v4_ids.copy_to_host(v1.data(), v4_ids.bytes());
  TVLLM_REQUIRE(v1 == b, "bench_fast_sampler: FastSampler's fourth cluster kernel and GpuSampler disagree");
  TVLLM_REQUIRE(a == b, "bench_fast_sampler: FastSampler and GpuSampler disagree");
  TVLLM_REQUIRE(m == b, "bench_fast_sampler: FastSampler's multi-pass path and GpuSampler disagree");
  return timing;
}

}  // namespace tvllm
