// Lesson 14, the fast sampler's cluster path on the CPU (no GPU needed): the plan that spreads rows over
// thread-block clusters, and the CPU model of the kernel's algorithm (cluster_sampler_cpu.cpp), which must
// give sample_cpu's id on every row. The model runs the kernel's steps in the kernel's order (the same
// chunks and pieces, the same 11-bit digits, picks and state machine from cluster_sampler.h), so a row where
// it disagrees with the oracle is a flaw of the algorithm itself, found without a GPU. The GPU suite
// (test_14_sampler_gpu.cpp) then checks the kernel against the same oracle.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cluster_sampler.h"
#include "common/dtype.h"
#include "common/errors.h"
#include "common/random.h"
#include "sampling.h"
#include "sampling_math.h"
#include "testing/sampling_batch.h"

namespace tvllm {
namespace {

namespace cs = cluster_sampler;
using testing::describe;
using testing::row_of;

// Counts the rows where the model and the oracle disagree, printing the first few.
int mismatches(const std::vector<float>& row, const std::vector<SamplingRow>& params, const cs::Plan& plan,
               const std::string& what) {
  const int64_t vocab = static_cast<int64_t>(row.size());
  int bad = 0;
  for (const SamplingRow& r : params) {
    const int32_t want = sample_cpu(row.data(), vocab, r);
    const int32_t got = cs::sample_model(row.data(), vocab, r, plan);
    if (got != want && ++bad <= 5)
      ADD_FAILURE() << what << " cluster " << plan.cluster << ": model " << got << ", sample_cpu " << want
                    << " for " << describe(r);
  }
  return bad;
}

TEST(ClusterSampler14, PlanCoversTheRowAndFillsTheGpu) {
  // The H200's 132 SMs, clusters up to 16.
  const cs::Plan b64 = cs::plan_call(64, 128256, 132, 16);
  EXPECT_EQ(b64.cluster, 8);  // 512 blocks: two per SM, about two waves
  EXPECT_EQ(b64.chunk, 16032);
  EXPECT_EQ(b64.threads, cs::kThreadsShared);
  // Two blocks of 512 threads fit on an SM (228 KiB of shared memory, 1 KiB of it reserved per block).
  EXPECT_LE(cs::shared_bytes(b64), (228u * 1024 - 2 * 1024) / 2);
  const cs::Plan b1 = cs::plan_call(1, 128256, 132, 16);
  EXPECT_EQ(b1.cluster, 16);  // one row: as many blocks as a cluster holds
  EXPECT_EQ(b1.chunk, 8016);
  EXPECT_EQ(b1.threads, cs::kThreadsAlone);  // 16 blocks on 132 SMs: each alone on its SM
  EXPECT_EQ(cs::plan_call(8, 128256, 132, 16).threads, cs::kThreadsAlone);   // 128 blocks
  EXPECT_EQ(cs::plan_call(9, 128256, 132, 16).threads, cs::kThreadsShared);  // 144 blocks
  EXPECT_EQ(cs::plan_call(1, 128256, 132, 8).cluster, 8);     // a device without the non-portable opt-in
  EXPECT_EQ(cs::plan_call(1, 7, 132, 16).cluster, 1);         // a tiny row: one block, no barriers to pay for
  EXPECT_EQ(cs::plan_call(257, 151936, 132, 16).cluster, 4);  // 151936 needs 4 blocks of <= 40960 keys
  EXPECT_EQ(cs::plan_call(1, 16 * 40960, 132, 16).cluster, 16);
  EXPECT_EQ(cs::plan_call(1, 16 * 40960 + 1, 132, 16).cluster, 0);  // too big: the multi-pass path
  EXPECT_EQ(cs::plan_call(1, 200000, 132, 4).cluster, 0);
  EXPECT_EQ(cs::plan_call(1, 1000, 132, 0).cluster, 0);  // no clusters on this device
  EXPECT_THROW(cs::plan_call(0, 1000, 132, 16), InputError);
  // Invariants over many shapes: a power of two within the device's limit, chunks that fit shared memory
  // and cover the row, odd pieces that cover the chunk.
  for (int max_cluster : {1, 2, 8, 16})
    for (int batch : {1, 2, 3, 7, 64, 257, 4096})
      for (int64_t vocab : {int64_t{1}, int64_t{7}, int64_t{2047}, int64_t{4099}, int64_t{32000},
                            int64_t{128256}, int64_t{151936}, int64_t{262144}, int64_t{655360}}) {
        const cs::Plan p = cs::plan_call(batch, vocab, 132, max_cluster);
        const std::string at = "batch " + std::to_string(batch) + " vocab " + std::to_string(vocab) +
                               " max " + std::to_string(max_cluster);
        if (p.cluster == 0) {
          EXPECT_GT(vocab, int64_t{max_cluster} * cs::kMaxTokensPerBlock) << at;
          continue;
        }
        EXPECT_LE(p.cluster, max_cluster) << at;
        EXPECT_EQ(p.cluster & (p.cluster - 1), 0) << at;
        EXPECT_LE(p.chunk, cs::kMaxTokensPerBlock) << at;
        EXPECT_LE(cs::shared_bytes(p), 227u * 1024) << at;  // a Hopper block's limit
        EXPECT_GE(int64_t{p.cluster} * p.chunk, vocab) << at;
        EXPECT_LT(int64_t{p.cluster - 1} * p.chunk, vocab) << at;  // no block without tokens
        EXPECT_EQ(p.piece % 2, 1) << at;
        EXPECT_GE(int64_t{p.piece} * p.threads, p.chunk) << at;
        EXPECT_EQ(p.threads == cs::kThreadsAlone, int64_t{p.cluster} * batch <= 132) << at;
        if (vocab >= 2 * cs::kMinTokensPerBlock * int64_t{p.cluster} && p.cluster < max_cluster) {
          EXPECT_GE(int64_t{p.cluster} * batch, 264) << at;  // the grid fills the GPU when the row allows it
        }
      }
}

TEST(ClusterSampler14, DigitsAndStateMachineFollowLesson09) {
  // The three digits split the key exactly: prefix | digit << shift rebuilds it, level by level.
  Rng rng(5);
  for (int n = 0; n < 1000; ++n) {
    const uint32_t key = static_cast<uint32_t>(rng.next_u64());
    cs::RowState st{};
    st.mode = cs::kModeTopK;
    for (int level = 0; level < 3; ++level) {
      st.level = level;
      ASSERT_TRUE(cs::is_candidate(st, key));
      st.prefix |= cs::digit_of(st, key) << cs::digit_shift(level);
    }
    EXPECT_EQ(st.prefix, key);
  }
  // initial_state: top-k when on and < vocab, else top-p when on, else straight to the draw.
  EXPECT_EQ(cs::initial_state(row_of(1, 50, 0.9f, 0, 0), 1000).mode, cs::kModeTopK);
  EXPECT_EQ(cs::initial_state(row_of(1, 50, 0.9f, 0, 0), 1000).target, 50u);
  EXPECT_EQ(cs::initial_state(row_of(1, 1000, 0.9f, 0, 0), 1000).mode, cs::kModeTopP);
  EXPECT_EQ(cs::initial_state(row_of(1, 0, 1.0f, 0, 0), 1000).mode, cs::kModeDraw);
  // advance: top-k's count reaching k exactly at a bucket ends the search with that bucket's lowest key, then
  // top-p starts among the survivors; top-p never takes that shortcut.
  const SamplingRow both = row_of(1, 50, 0.9f, 0, 0);
  cs::RowState st = cs::initial_state(both, 1000);
  st = cs::advance(st, both, cs::Pick{0x5a1, 20, 30, 50});
  EXPECT_EQ(st.mode, cs::kModeTopP);
  EXPECT_EQ(st.lower, 0x5a1u << 21);
  EXPECT_EQ(st.level, 0);
  st = cs::advance(st, both, cs::Pick{0x7, 0, 10, 10});  // measure == target, but top-p: next digit
  EXPECT_EQ(st.mode, cs::kModeTopP);
  EXPECT_EQ(st.level, 1);
  EXPECT_EQ(st.target, 10u);
  st = cs::advance(st, both, cs::Pick{0x3, 4, 9, 10});
  st = cs::advance(st, both, cs::Pick{0x2, 5, 9, 10});
  EXPECT_EQ(st.mode, cs::kModeDraw);
  EXPECT_EQ(st.threshold, (0x7u << 21) | (0x3u << 10) | 0x2u);
}

TEST(ClusterSampler14, ModelMatchesTheOracleOnRandomRows) {
  struct Case {
    int64_t vocab;
    int rows;
  };
  Rng rng(2026);
  for (const Case& c :
       {Case{1, 40}, Case{7, 80}, Case{1000, 80}, Case{4099, 60}, Case{32000, 30}, Case{128256, 12}}) {
    for (int cluster : {1, 2, 4, 8, 16}) {
      if (c.vocab >= 32000 && cluster < 4) continue;  // the run time: fewer sizes for the big rows
      std::vector<SamplingRow> params;
      for (int i = 0; i < c.rows; ++i) params.push_back(testing::random_row_params(rng, c.vocab));
      const std::vector<float> row = testing::model_like_row(c.vocab, rng.next_u64() % 1000,
                                                             0.5f + 4.0f * static_cast<float>(rng.uniform()));
      const int threads = cluster % 2 ? cs::kThreadsAlone : cs::kThreadsShared;  // both block sizes
      EXPECT_EQ(mismatches(row, params, cs::plan_with(c.vocab, cluster, threads),
                           "vocab " + std::to_string(c.vocab)),
                0);
      // Versions 3 and 4, with the lists as the kernel has them, and with room for 3 keys (the fallbacks,
      // often).
      for (int version : {3, 4})
        for (int capacity : {cs::kListCapacity, 3}) {
          cs::Plan v = cs::plan_with(c.vocab, cluster, threads, version);
          v.list_capacity = capacity;
          EXPECT_EQ(mismatches(row, params, v,
                               "version " + std::to_string(version) + ", list " + std::to_string(capacity) +
                                   ", vocab " + std::to_string(c.vocab)),
                    0);
        }
    }
  }
}

TEST(ClusterSampler14, ModelMatchesTheOracleOnEdgeRows) {
  // Ties at the thresholds (kept whole), flat rows, masks, +inf, NaN, -0 and +0, overflow at tiny
  // temperatures.
  const int64_t vocab = 5003;  // odd: the last block and the last pieces are short
  std::vector<std::vector<float>> edge;
  edge.emplace_back(vocab, 0.0f);
  std::vector<float> steps(vocab);
  for (int64_t i = 0; i < vocab; ++i) steps[static_cast<size_t>(i)] = static_cast<float>((i * 7) % 10);
  edge.push_back(steps);
  std::vector<float> plateau = random_normal(vocab, 9, 1.0f);
  for (int64_t i = 0; i < vocab; i += 17) plateau[static_cast<size_t>(i)] = 5.0f;
  edge.push_back(plateau);
  std::vector<float> masked(vocab, -INFINITY);
  masked[5002] = -3.0f;
  masked[7] = -3.5f;
  edge.push_back(masked);
  masked[5] = INFINITY;
  masked[4000] = INFINITY;
  edge.push_back(masked);
  edge.emplace_back(vocab, -INFINITY);
  std::vector<float> nans = random_normal(vocab, 3, 2.0f);
  for (int64_t i = 0; i < vocab; i += 7) nans[static_cast<size_t>(i)] = std::nanf("");
  edge.push_back(nans);
  edge.push_back(random_normal(vocab, 4, 1e38f));
  edge.push_back(random_normal(vocab, 5, 1e-30f));
  std::vector<float> zeros = random_normal(vocab, 6, 1.0f);
  for (int64_t i = 0; i < vocab; i += 3) zeros[static_cast<size_t>(i)] = i % 2 ? -0.0f : 0.0f;
  edge.push_back(zeros);
  for (size_t e = 0; e < edge.size(); ++e) {
    std::vector<SamplingRow> params;
    for (float t : {0.0f, 1e-30f, 0.01f, 0.7f, 1.0f, 3e4f})
      for (int k : {0, 1, 3, 18, 301, 5002})
        for (float p : {1.0f, 0.9f, 0.3f, 1e-6f})
          params.push_back(
              row_of(t, k, p, e * 1000 + static_cast<uint64_t>(k), static_cast<uint64_t>(t * 10)));
    for (int cluster :
         {1, 3, 16})  // 3: not a power of two, but the model does not care (a plan never gives it)
      for (int threads : {cs::kThreadsShared, cs::kThreadsAlone})
        for (int version : {2, 3, 4}) {
          EXPECT_EQ(mismatches(edge[e], params, cs::plan_with(vocab, cluster, threads, version),
                               "edge row " + std::to_string(e) + " version " + std::to_string(version)),
                    0);
        }
  }
}

// The rows a batch of 64 at the model's vocab should be hardest on: the batch-64 plan (8 blocks of 512
// threads, 16032 tokens a block), with the whole row one tie group (flat: every block holds a share of the
// kept mass at every digit), ten values repeated, bf16-rounded logits (the benchmark's: thousands of ties)
// and a plateau at the top. Version 2 takes each block's kept mass from its top-p histograms: sample_model
// throws if that ever differs from the sum of the block's pieces, so this also checks the rule, block by
// block.
TEST(ClusterSampler14, ModelMatchesTheOracleOnFlatAndTiedRowsWithTheBatch64Plan) {
  const int64_t vocab = 128256;
  const cs::Plan plan = cs::plan_call(64, vocab, 132, 16);
  ASSERT_EQ(plan.cluster, 8);
  ASSERT_EQ(plan.version, 2);
  std::vector<std::vector<float>> rows;
  rows.emplace_back(vocab, 0.0f);  // flat
  rows.emplace_back(vocab, 3.25f);  // flat, not zero
  std::vector<float> steps(vocab);
  for (int64_t i = 0; i < vocab; ++i) steps[static_cast<size_t>(i)] = static_cast<float>((i * 7) % 10);
  rows.push_back(steps);
  std::vector<float> bf16 = random_normal(vocab, 2024, 2.0f);
  for (float& v : bf16) v = bf16_to_f32(f32_to_bf16(v));
  rows.push_back(bf16);
  for (int64_t i = 0; i < vocab; i += vocab / 500) bf16[static_cast<size_t>(i)] = 9.0f;  // 500 tied on top
  rows.push_back(bf16);
  std::vector<SamplingRow> params;
  for (uint64_t step = 0; step < 3; ++step)
    for (const SamplingRow& r : {row_of(0.0f, 0, 1.0f, 7, step), row_of(1.0f, 0, 1.0f, 7, step),
                                 row_of(0.7f, 50, 1.0f, 7, step), row_of(1.0f, 0, 0.9f, 7, step),
                                 row_of(0.7f, 50, 0.9f, 7, step), row_of(1.0f, 1000, 0.5f, 7, step)})
      params.push_back(r);
  for (size_t e = 0; e < rows.size(); ++e)
    for (int version : {1, 2, 3, 4, 5, 6}) {  // 5, 6: versions 3, 4 with lists of at most 16 keys (fallbacks)
      cs::Plan p = plan;
      p.version = version > 4 ? version - 2 : version;
      if (version > 4) p.list_capacity = 16;
      EXPECT_EQ(mismatches(rows[e], params, p,
                           "row " + std::to_string(e) + " version " + std::to_string(version)),
                0);
    }
}

// Version 3's fine buckets: never decreasing as the key grows (the radix rule needs only that), the top
// bucket for z == z_max (also at +-inf), 1/64 of z per bucket, bucket 0 from z - z_max <= -32 on (every mass
// there is 0: below -27.7, exp(d) * 2^40 < 1).
TEST(ClusterSampler14, FineBucketsFollowTheKeysOrder) {
  const uint32_t top = static_cast<uint32_t>(cs::kBuckets - 1);
  EXPECT_EQ(cs::fine_bucket(sampling::order_key(5.0f), 5.0f), top);
  EXPECT_EQ(cs::fine_bucket(sampling::order_key(5.0f - 1.0f / 64), 5.0f), top - 1);
  EXPECT_EQ(cs::fine_bucket(sampling::order_key(5.0f - 1.0f / 128), 5.0f), top);  // within the top step
  EXPECT_EQ(cs::fine_bucket(sampling::order_key(5.0f - 1.0f), 5.0f), top - 64);
  EXPECT_EQ(cs::fine_bucket(sampling::order_key(5.0f - 31.9f), 5.0f), top - 2041);  // 31.9 * 64 = 2041.6
  EXPECT_EQ(cs::fine_bucket(sampling::order_key(5.0f - 32.0f), 5.0f), 0u);
  EXPECT_EQ(cs::fine_bucket(sampling::order_key(-INFINITY), 5.0f), 0u);
  EXPECT_EQ(cs::fine_bucket(sampling::order_key(INFINITY), INFINITY), top);
  EXPECT_EQ(cs::fine_bucket(sampling::order_key(1e30f), INFINITY), 0u);  // its mass is 0
  EXPECT_EQ(cs::fine_bucket(sampling::order_key(-INFINITY), -INFINITY), top);  // all masked: all tied
  EXPECT_EQ(sampling::token_mass(5.0f - 27.8f, 5.0f), 0u);  // the masses bucket 0 can hold
  // Monotone on sorted random keys, for several maxima (the largest key of the sample, as the kernel's).
  Rng rng(17);
  for (float spread : {1e-3f, 1.0f, 30.0f, 1e6f}) {
    std::vector<uint32_t> keys;
    for (int i = 0; i < 20000; ++i)
      keys.push_back(sampling::order_key(spread * static_cast<float>(rng.normal())));
    keys.push_back(sampling::order_key(0.0f));
    keys.push_back(sampling::order_key(-0.0f));
    std::sort(keys.begin(), keys.end());
    const float z_max = cs::z_of_key(keys.back());
    for (size_t i = 1; i < keys.size(); ++i)
      ASSERT_LE(cs::fine_bucket(keys[i - 1], z_max), cs::fine_bucket(keys[i], z_max)) << spread;
    EXPECT_EQ(cs::fine_bucket(keys.back(), z_max), top);
  }
  // The state machine: top-p starts with the fine pass in version 3 (alone, and after top-k), whose pick
  // becomes the list state.
  const SamplingRow p_only = row_of(1, 0, 0.9f, 0, 0), both = row_of(1, 50, 0.9f, 0, 0);
  EXPECT_EQ(cs::initial_state(p_only, 1000, true).mode, cs::kModeTopPFine);
  cs::RowState st = cs::initial_state(both, 1000, true);
  EXPECT_EQ(st.mode, cs::kModeTopK);
  st = cs::advance(st, both, cs::Pick{0x5a1, 20, 30, 50}, true);
  EXPECT_EQ(st.mode, cs::kModeTopPFine);
  EXPECT_EQ(st.lower, 0x5a1u << 21);
  EXPECT_TRUE(cs::sets_target(st));
  st = cs::advance(st, both, cs::Pick{1900, 123, 45, 150}, true);
  EXPECT_EQ(st.mode, cs::kModeTopPList);
  EXPECT_EQ(st.prefix, 1900u);
  EXPECT_EQ(st.above, 123u);
  EXPECT_EQ(st.target, 150u);
  EXPECT_EQ(st.lower, 0x5a1u << 21);
  // Version 4: top-k's first digit leads to the top-k list (top-k's level-1 state), unless it settles the
  // threshold exactly (then straight to top-p's fine pass); the list's threshold leads to top-p or the draw.
  st = cs::advance(cs::initial_state(both, 1000, true), both, cs::Pick{0x5a1, 20, 40, 50}, true, true);
  EXPECT_EQ(st.mode, cs::kModeTopKList);
  EXPECT_EQ(st.level, 1);
  EXPECT_EQ(st.prefix, 0x5a1u << 21);
  EXPECT_EQ(st.above, 20u);
  EXPECT_EQ(st.target, 50u);
  EXPECT_TRUE(cs::is_listed(st, (0x5a1u << 21) | 0x1234u, 0.0f));
  EXPECT_TRUE(cs::is_listed(st, (0x5a2u << 21) | 0x1234u, 0.0f));   // above the bucket: listed too
  EXPECT_FALSE(cs::is_listed(st, (0x5a0u << 21) | 0x1fffffu, 0.0f));  // below it: never kept
  EXPECT_EQ(cs::advance(cs::initial_state(both, 1000, true), both, cs::Pick{0x5a1, 20, 30, 50}, true, true).mode,
            cs::kModeTopPFine);  // 20 + 30 == 50: the bucket's lowest key
  st = cs::after_top_k(st, both, 0xabcdef12u, true);
  EXPECT_EQ(st.mode, cs::kModeTopPFine);
  EXPECT_EQ(st.lower, 0xabcdef12u);
  EXPECT_EQ(st.level, 0);
  EXPECT_EQ(st.above, 0u);
  const SamplingRow k_only = row_of(1, 50, 1.0f, 0, 0);
  st = cs::after_top_k(cs::initial_state(k_only, 1000, true), k_only, 0x1234u, true);
  EXPECT_EQ(st.mode, cs::kModeDraw);
  EXPECT_EQ(st.threshold, 0x1234u);
}

// Version 4's top-k on the benchmark's rows (bf16-rounded normal logits, spread 2, T 0.8, top-k 50): one
// counting pass and a list of a few hundred keys (the chapter's count), never the fallback; with top-p
// after it, both lists. Top-k 20000 overflows the list and falls back to the digits. The oracle's ids.
TEST(ClusterSampler14, VersionFourListsTopKsFirstBucket) {
  const int64_t vocab = 128256;
  cs::Plan plan = cs::plan_call(64, vocab, 132, 16);
  plan.version = 4;
  for (uint64_t seed : {2024u, 7u, 99u}) {
    std::vector<float> row = random_normal(vocab, seed, 2.0f);
    for (float& v : row) v = bf16_to_f32(f32_to_bf16(v));
    for (float t : {0.8f, 1.0f})
      for (float p : {1.0f, 0.9f}) {
        const SamplingRow r = row_of(t, 50, p, seed, 3);
        cs::ModelTrace trace;
        EXPECT_EQ(cs::sample_model(row.data(), vocab, r, plan, &trace), sample_cpu(row.data(), vocab, r));
        EXPECT_FALSE(trace.k_fell_back) << describe(r);
        EXPECT_GT(trace.k_list_size, 0) << describe(r);
        EXPECT_LE(trace.k_list_size, 1000) << describe(r);
        // top-k's first digit (+ the fine pass when top-p follows); the lists are not passes
        EXPECT_EQ(trace.passes, p < 1.0f ? 2 : 1) << describe(r);
        if (p < 1.0f) {
          EXPECT_FALSE(trace.fell_back) << describe(r);
        }
        cs::Plan v3 = plan;
        v3.version = 3;
        cs::ModelTrace digits;
        EXPECT_EQ(cs::sample_model(row.data(), vocab, r, v3, &digits), sample_cpu(row.data(), vocab, r));
        EXPECT_GE(digits.passes, trace.passes + 1) << describe(r);  // the list replaced 1 or 2 digits
        if (seed == 2024 && t == 0.8f && p == 1.0f)
          std::printf("benchmark row, T 0.8, top-k 50: %lld keys listed (version 3: %d digit passes)\n",
                      static_cast<long long>(trace.k_list_size), digits.passes);
      }
    const SamplingRow big_k = row_of(1.0f, 20000, 1.0f, seed, 1);
    cs::ModelTrace trace;
    EXPECT_EQ(cs::sample_model(row.data(), vocab, big_k, plan, &trace), sample_cpu(row.data(), vocab, big_k));
    EXPECT_TRUE(trace.k_fell_back);
    EXPECT_GT(trace.k_list_size, cs::kListCapacity);
    EXPECT_GE(trace.passes, 2);  // the first digit, then the second (and maybe the third)
  }
}

// The figure the design rests on: on the benchmark's rows (bf16-rounded normal logits, spread 2, the
// timing's temperature 0.8, top-p 0.9; and lesson 14's bench rows at temperature 1) version 3's top-p is
// one fine pass and a list of a few hundred keys, never the fallback; flat and step rows, whose threshold
// sits in a tie group of thousands, fall back. The same ids as the oracle in every case.
TEST(ClusterSampler14, VersionThreeListsFewCandidatesOnTheBenchmarkRows) {
  const int64_t vocab = 128256;
  cs::Plan plan = cs::plan_call(64, vocab, 132, 16);
  plan.version = 3;
  for (uint64_t seed : {2024u, 7u, 99u}) {
    std::vector<float> row = random_normal(vocab, seed, 2.0f);
    for (float& v : row) v = bf16_to_f32(f32_to_bf16(v));
    for (float t : {0.8f, 1.0f})
      for (float p : {0.9f, 0.5f, 0.99f}) {
        const SamplingRow r = row_of(t, 0, p, seed, 3);
        cs::ModelTrace trace;
        EXPECT_EQ(cs::sample_model(row.data(), vocab, r, plan, &trace), sample_cpu(row.data(), vocab, r));
        EXPECT_FALSE(trace.fell_back) << describe(r);
        EXPECT_EQ(trace.passes, 1) << describe(r);  // the fine pass, then the list
        EXPECT_GT(trace.list_size, 0);
        EXPECT_LE(trace.list_size, 1000) << describe(r);
        if (seed == 2024 && t == 0.8f && p == 0.9f)
          std::printf("benchmark row, T 0.8, top-p 0.9: %lld keys listed\n",
                      static_cast<long long>(trace.list_size));
      }
  }
  const std::vector<float> flat(vocab, 3.25f);
  cs::ModelTrace trace;
  const SamplingRow r = row_of(1.0f, 0, 0.9f, 1, 2);
  EXPECT_EQ(cs::sample_model(flat.data(), vocab, r, plan, &trace), sample_cpu(flat.data(), vocab, r));
  EXPECT_TRUE(trace.fell_back);
  EXPECT_EQ(trace.list_size, vocab);
  EXPECT_EQ(trace.passes, 1 + 3);  // the fine pass, then version 1's three top-p digits
}

// Version 2 skips the load's division at temperature 1: x / 1 must be x, bit for bit, for every float the
// sampler can see (the key is made from these bits). IEEE division is correctly rounded and x is exact.
TEST(ClusterSampler14, DividingByTemperatureOneChangesNoBit) {
  std::vector<float> xs = {0.0f, -0.0f, 1.0f, -1.0f, INFINITY, -INFINITY, std::nanf(""), 1e-45f, -1e-45f,
                           1.17549435e-38f, 3.4028235e38f, -3.4028235e38f, 0.1f, -7.25f};
  Rng rng(11);
  for (int i = 0; i < 100000; ++i) {  // random bit patterns: every exponent, denormals included
    const uint32_t bits = static_cast<uint32_t>(rng.next_u64());
    float f;
    std::memcpy(&f, &bits, sizeof f);
    xs.push_back(f);
  }
  for (float x : xs)
    ASSERT_EQ(sampling::f_bits(sampling::scaled_logit(x, 1.0f)),
              sampling::f_bits(sampling::sanitize_logit(x)))
        << x;
}

TEST(ClusterSampler14, ModelRejectsAPlanThatDoesNotCoverTheRow) {
  const std::vector<float> row(100, 0.0f);
  cs::Plan p = cs::plan_with(100, 1, cs::kThreadsShared);
  p.chunk = 50;  // one block of 50 tokens cannot hold a row of 100
  EXPECT_THROW(cs::sample_model(row.data(), 100, row_of(1, 0, 1, 0, 0), p), InputError);
  EXPECT_THROW(
      cs::sample_model(nullptr, 100, row_of(1, 0, 1, 0, 0), cs::plan_with(100, 1, cs::kThreadsShared)),
      InputError);
  EXPECT_THROW(cs::plan_with(100, 1, 256), InputError);  // only the two block sizes the kernel is built for
  EXPECT_THROW(cs::plan_with(100, 1, cs::kThreadsShared, 5), InputError);  // versions 1 to 4 only
  EXPECT_THROW(cs::plan_with(100, 1, cs::kThreadsShared, 0), InputError);
  p = cs::plan_with(100, 1, cs::kThreadsShared, 3);
  p.list_capacity = cs::kListCapacity + 1;  // more than the kernel's shared memory holds
  EXPECT_THROW(cs::sample_model(row.data(), 100, row_of(1, 0, 0.9f, 0, 0), p), InputError);
}

}  // namespace
}  // namespace tvllm
