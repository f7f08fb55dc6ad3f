// Lesson 14, the fast sampler's one-launch path on the CPU: the plan (how many blocks share a row) and a
// model of the kernel's algorithm, step for step, in plain loops. The model is what a reader checks the
// kernel against when reading it, and what the CPU tests check against sample_cpu where no GPU exists: the
// digits, the picks, the state machine between digits (cluster_sampler.h, shared with the kernel) and the
// block / piece / token narrowing of the draw.
#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "cluster_sampler.h"
#include "common/errors.h"

namespace tvllm::cluster_sampler {

namespace {
int64_t ceil_div64(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Version 3's list step, as every block of the kernel runs it: the candidates of the picked fine bucket, in
// block order (each block's list; the kernel appends in any order, the sort below makes it canonical); too
// many (or, defensively, none): back to version 1's top-p digits. Else the threshold is the first key, from
// the largest down, at which above + the masses so far reach the target, and every block's listed keys at or
// above it join its kept mass.
// Version 4's top-k list (st.mode == kModeTopKList) is the same step with every key counting 1: the
// threshold is the k-th largest key; too many candidates: back to top-k's second digit (the state is
// already its, level 1); the listed keys join no kept mass (the top-k draw sums its pieces), and top-p
// follows when the row asks (after_top_k).
// (The top-k list holds the keys above the bucket too, so its count starts from 0, not from above; when the
// draw follows, every block's listed keys at or above the threshold are its kept mass, as top-p's.)
RowState resolve_list(const std::vector<uint32_t>& keys, float z_max, const SamplingRow& row, const Plan& plan,
                      RowState st, std::vector<uint64_t>* block_kept, bool* fell_back, int64_t* list_size) {
  const bool top_k = st.mode == kModeTopKList;
  std::vector<uint32_t> list;
  std::vector<size_t> owner;  // the block of each listed key
  for (size_t i = 0; i < keys.size(); ++i)
    if (is_listed(st, keys[i], z_max)) {
      list.push_back(keys[i]);
      owner.push_back(i / static_cast<size_t>(plan.chunk));
    }
  *list_size = static_cast<int64_t>(list.size());
  if (list.empty() || list.size() > static_cast<size_t>(plan.list_capacity)) {
    if (top_k) {
      st.mode = kModeTopK;  // level 1, prefix, above, target: the second digit
      return st;
    }
    *fell_back = true;
    RowState top_p{};
    top_p.mode = kModeTopP;  // level 0, prefix 0, above 0, target 0: top-p's digits from the start
    top_p.lower = st.lower;
    return top_p;
  }
  // (The kernel skips the sort when every listed key is the same: that key is then what the loop finds.)
  std::vector<uint32_t> sorted = list;
  std::sort(sorted.begin(), sorted.end(), [](uint32_t a, uint32_t b) { return a > b; });
  uint32_t threshold = 0;  // unreachable fallback (the pick guarantees a crossing): keep every key
  uint64_t acc = top_k ? 0 : st.above;
  for (uint32_t key : sorted) {
    acc += top_k ? 1 : sampling::token_mass(z_of_key(key), z_max);
    if (acc >= st.target) {
      threshold = key;
      break;
    }
  }
  if (top_k) {
    st = after_top_k(st, row, threshold, true);
    if (st.mode != kModeDraw) return st;  // top-p follows: its own passes give the kept masses
  }
  for (size_t j = 0; j < list.size(); ++j)
    if (list[j] >= threshold) (*block_kept)[owner[j]] += sampling::token_mass(z_of_key(list[j]), z_max);
  st.mode = kModeDraw;
  st.threshold = threshold;
  return st;
}
}  // namespace

Plan plan_call(int batch, int64_t vocab, int sms, int max_cluster) {
  TVLLM_REQUIRE(batch >= 1 && vocab >= 1 && sms >= 1,
                "cluster_sampler::plan_call: batch, vocab, sms must be >= 1");
  Plan plan;
  int need = 1;  // blocks the row needs: each holds at most kMaxTokensPerBlock keys
  while (static_cast<int64_t>(need) * kMaxTokensPerBlock < vocab) need *= 2;
  if (max_cluster < 1 || need > max_cluster) return plan;  // cluster 0: the multi-pass path takes the call
  int fill = 1;  // enough blocks for two on every SM (one block per row would leave most SMs idle at batch 1)
  while (static_cast<int64_t>(fill) * batch < 2 * static_cast<int64_t>(sms) && fill < max_cluster) fill *= 2;
  int small = 1;  // but at least kMinTokensPerBlock tokens a block: a tiny chunk is all barriers
  while (static_cast<int64_t>(small) * 2 * kMinTokensPerBlock <= vocab && small < max_cluster) small *= 2;
  const int cluster = std::max(need, std::min(fill, small));
  const bool alone = static_cast<int64_t>(cluster) * batch <= sms;
  return plan_with(vocab, cluster, alone ? kThreadsAlone : kThreadsShared);
}

Plan plan_with(int64_t vocab, int cluster, int threads, int version) {
  TVLLM_REQUIRE(vocab >= 1 && cluster >= 1 && (threads == kThreadsShared || threads == kThreadsAlone) &&
                    version >= 1 && version <= 4,
                "cluster_sampler::plan_with: bad shape");
  Plan plan;
  plan.cluster = cluster;
  plan.threads = threads;
  plan.version = version;
  plan.chunk = static_cast<int>(ceil_div64(vocab, cluster));
  plan.piece = static_cast<int>(ceil_div64(plan.chunk, threads)) | 1;  // odd: see Plan
  return plan;
}

int32_t sample_model(const float* logits, int64_t vocab, const SamplingRow& row, const Plan& plan,
                     ModelTrace* trace) {
  ModelTrace unused;
  if (trace == nullptr) trace = &unused;
  *trace = ModelTrace{};
  TVLLM_REQUIRE(logits != nullptr && vocab >= 1 && vocab <= sampling::kMaxVocab,
                "cluster_sampler::sample_model: bad row");
  TVLLM_REQUIRE(plan.cluster >= 1 && plan.threads >= 1 &&
                    static_cast<int64_t>(plan.cluster) * plan.chunk >= vocab &&
                    static_cast<int64_t>(plan.piece) * plan.threads >= plan.chunk &&
                    plan.list_capacity >= 0 && plan.list_capacity <= kListCapacity,
                "cluster_sampler::sample_model: the plan does not cover the row");
  const bool fine = plan.version >= 3, list_k = plan.version == 4;
  const size_t n = static_cast<size_t>(vocab);
  const bool greedy = !(row.temperature > 0.0f);

  // 1. Load: the keys and the max of (key << 32 | ~id) (the blocks' maxima, then the cluster's: one max).
  std::vector<uint32_t> keys(n);
  uint64_t best = 0;
  for (size_t i = 0; i < n; ++i) {
    const float z =
        greedy ? sampling::sanitize_logit(logits[i]) : sampling::scaled_logit(logits[i], row.temperature);
    keys[i] = sampling::order_key(z);
    best = std::max(best, (static_cast<uint64_t>(keys[i]) << 32) | (0xffffffffu - static_cast<uint32_t>(i)));
  }
  if (greedy) return static_cast<int32_t>(0xffffffffu - static_cast<uint32_t>(best));
  const float z_max = z_of_key(static_cast<uint32_t>(best >> 32));

  // 2. The digits: the row's histogram (the kernel: per block, added into rank 0's), the pick, the state.
  // Versions 2 and 3 also keep each block's own top-p histograms (block_hist) to take the blocks' kept
  // masses from them (block_kept, used by the draw). Version 3's top-p: the fine pass, then the list (below).
  RowState st = initial_state(row, vocab, fine);
  bool fell_back = false;  // version 3: the list overflowed, top-p ran version 1's digits
  bool k_kept_from_list = false;  // version 4, top-k alone: the blocks' kept masses came from the list
  std::vector<uint64_t> hist(kBuckets);
  const size_t blocks = static_cast<size_t>(plan.cluster);
  std::vector<uint64_t> block_hist(blocks * kBuckets), block_kept(blocks, 0);
  while (st.mode != kModeDraw) {
    std::fill(hist.begin(), hist.end(), 0);
    std::fill(block_hist.begin(), block_hist.end(), 0);
    for (size_t i = 0; i < n; ++i) {
      if (!is_candidate(st, keys[i])) continue;
      const uint64_t measure = measures_mass(st) ? sampling::token_mass(z_of_key(keys[i]), z_max) : 1;
      const uint32_t digit = st.mode == kModeTopPFine ? fine_bucket(keys[i], z_max) : digit_of(st, keys[i]);
      hist[digit] += measure;
      block_hist[i / static_cast<size_t>(plan.chunk) * kBuckets + digit] += measure;
    }
    const int buckets = st.mode == kModeTopPFine ? kBuckets : 1 << digit_bits(st.level);
    uint64_t total = 0;
    for (int b = 0; b < buckets; ++b) total += hist[static_cast<size_t>(b)];
    const uint64_t target = sets_target(st) ? sampling::top_p_target(row.top_p, total) : st.target;
    Pick pick{0, st.above, 0, target};  // the kernel's unreachable fallback
    uint64_t acc = st.above;
    for (int b = buckets - 1; b >= 0; --b) {
      const uint64_t h = hist[static_cast<size_t>(b)];
      if (acc + h >= target) {
        pick = Pick{b, acc, h, target};
        break;
      }
      acc += h;
    }
    if ((plan.version == 2 && st.mode == kModeTopP) || st.mode == kModeTopPFine)
      for (size_t q = 0; q < blocks; ++q)
        for (int b = 0; b < buckets; ++b) {
          // The fine pass: only the buckets above the pick are kept for sure; the list decides the rest.
          const bool kept_bucket = st.mode == kModeTopPFine
                                       ? b > pick.bucket
                                       : bucket_is_kept(st.level, static_cast<uint32_t>(b),
                                                        static_cast<uint32_t>(pick.bucket));
          if (kept_bucket) block_kept[q] += block_hist[q * kBuckets + static_cast<size_t>(b)];
        }
    st = advance(st, row, pick, fine, list_k);
    ++trace->passes;
    if (st.mode == kModeTopKList) {
      bool unused = false;
      st = resolve_list(keys, z_max, row, plan, st, &block_kept, &unused, &trace->k_list_size);
      trace->k_fell_back = st.mode == kModeTopK;
      k_kept_from_list = st.mode == kModeDraw;
    }
    if (st.mode == kModeTopPList) {
      st = resolve_list(keys, z_max, row, plan, st, &block_kept, &fell_back, &trace->list_size);
      trace->fell_back = fell_back;
    }
  }

  // 3. The draw: the kept mass of every (block, thread piece), in index order; W; U; then narrow down.
  auto piece_range = [&](int64_t block, int64_t thread, int64_t* lo, int64_t* hi) {
    const int64_t chunk_begin = block * plan.chunk, chunk_end = std::min(vocab, chunk_begin + plan.chunk);
    *lo = std::min(chunk_end, chunk_begin + thread * plan.piece);
    *hi = std::min(chunk_end, *lo + plan.piece);
  };
  auto mass_of = [&](int64_t i) { return kept_mass(keys[static_cast<size_t>(i)], z_max, st.threshold); };
  const int64_t threads = plan.threads;
  std::vector<uint64_t> piece_mass(static_cast<size_t>(plan.cluster * threads));
  uint64_t kept = 0;
  for (int64_t b = 0; b < plan.cluster; ++b)
    for (int64_t t = 0; t < threads; ++t) {
      int64_t lo = 0, hi = 0;
      piece_range(b, t, &lo, &hi);
      uint64_t m = 0;
      for (int64_t i = lo; i < hi; ++i) m += mass_of(i);
      piece_mass[static_cast<size_t>(b * threads + t)] = m;
      kept += m;
    }
  if (kept == 0) return 0;  // the kernel's answer for an impossible row
  const uint64_t u = sampling::mulhi_u64(sampling::random_u64(row.seed, row.step), kept);
  if (plan.version >= 2 && (row.top_p < 1.0f || k_kept_from_list) && !fell_back) {
    // Versions 2 and 3 find U's block by the masses the digits gave (block_kept), and only that block sums
    // its pieces: the rule holds only if every block's digit masses equal its pieces' sums. Checked.
    for (size_t q = 0; q < blocks; ++q) {
      uint64_t pieces = 0;
      for (int64_t t = 0; t < threads; ++t) pieces += piece_mass[q * static_cast<size_t>(threads) + t];
      if (pieces != block_kept[q])
        throw std::logic_error("cluster_sampler::sample_model: block " + std::to_string(q) +
                               "'s kept mass from the digits differs from its pieces");
    }
  }
  uint64_t base = 0;
  for (size_t p = 0; p < piece_mass.size(); ++p) {
    if (u < base + piece_mass[p]) {  // the piece holding U: walk it token by token
      int64_t lo = 0, hi = 0;
      piece_range(static_cast<int64_t>(p) / threads, static_cast<int64_t>(p) % threads, &lo, &hi);
      uint64_t cumulative = base;
      for (int64_t i = lo; i < hi; ++i) {
        cumulative += mass_of(i);
        if (cumulative > u) return static_cast<int32_t>(i);
      }
    }
    base += piece_mass[p];
  }
  throw std::logic_error("cluster_sampler::sample_model: U fell past the last piece");  // unreachable
}

}  // namespace tvllm::cluster_sampler
