// Lesson 14, the fast sampler: FastSampler must choose EXACTLY the id lesson 09's CPU reference (sample_cpu)
// chooses, on every row: both compute the same integer masses (sampling_math.h), and every decision after
// that is integer arithmetic, so there is no tolerance and no near-tie exception. The tests count
// mismatching rows and require none, over thousands of rows: vocab 1 to 151936, batch 1, 3, 7, 64 and 257,
// every knob, ties at the thresholds; on BOTH paths: the cluster path (one launch, a cluster of 1-16 blocks
// per row) and the multi-pass path (1 row gets ~100 blocks, 64 rows a few each).
//
// No chi-square test here: lesson 09's tests show that sample_cpu's draws follow the renormalised
// distribution; a sampler that returns sample_cpu's id for every (row, seed, step) draws from the same
// distribution by construction, so equality with the oracle is the stronger check.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "common/buffer.h"
#include "common/cuda_stream.h"
#include "common/dtype.h"
#include "common/errors.h"
#include "common/random.h"
#include "cluster_sampler.h"
#include "fast_sampler.h"
#include "sampling.h"
#include "testing/sampling_batch.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

using testing::describe;
using testing::DeviceBatch;
using testing::expect_same_ids;
using testing::row_of;
using testing::sample_on_cpu;

std::vector<int32_t> sample_fast(const FastSampler& sampler, const std::vector<float>& logits, int64_t stride,
                                 int64_t vocab, const std::vector<SamplingRow>& rows) {
  DeviceBatch d(logits, rows);
  sampler.sample(d.logits(), stride, vocab, d.batch, d.rows(), d.out());
  return d.ids();
}

std::vector<int32_t> sample_lesson09(const std::vector<float>& logits, int64_t stride, int64_t vocab,
                                     const std::vector<SamplingRow>& rows) {
  DeviceBatch d(logits, rows);
  GpuSampler sampler(std::max(1, d.batch), vocab);
  sampler.sample(d.logits(), stride, vocab, d.batch, d.rows(), d.out());
  return d.ids();
}

// Logits at several scales, tiny to huge (the spread of row `seed`).
std::vector<float> model_like_row(int64_t vocab, uint64_t seed) {
  static const float kScales[] = {1e-3f, 0.5f, 2.0f, 6.0f, 40.0f};
  return testing::model_like_row(vocab, seed, kScales[seed % 5] * (0.5f + Rng(seed).uniform()));
}

// The default (the cluster path on Hopper: version 3; 1 under TVLLM_TOPP_V=old, 4 under TVLLM_TOPK_V=new),
// every cluster kernel by name and the multi-pass path.
constexpr FastSampler::Path kBothPaths[] = {FastSampler::Path::kAuto,      FastSampler::Path::kClusterV1,
                                            FastSampler::Path::kClusterV2, FastSampler::Path::kClusterV3,
                                            FastSampler::Path::kClusterV4, FastSampler::Path::kMultiPass};
const char* path_name(FastSampler::Path p) {
  switch (p) {
    case FastSampler::Path::kAuto: return "default";
    case FastSampler::Path::kClusterV1: return "cluster v1";
    case FastSampler::Path::kClusterV2: return "cluster v2";
    case FastSampler::Path::kClusterV3: return "cluster v3";
    case FastSampler::Path::kClusterV4: return "cluster v4";
    default: return "multi-pass";
  }
}

TEST(FastSampler14Gpu, MatchesTheCpuOracleOnRandomRows) {
  TVLLM_REQUIRE_GPU();
  struct Case {
    int64_t vocab;
    int batch;
    int calls;  // calls of `batch` random rows each
  };
  // Multi-pass: 64 rows get a few blocks per row, 3 rows tens, 1 row a hundred. Cluster path: 1 row gets
  // 16 blocks, 7 rows 16 each, 64 rows 8, 257 rows 4 (vocab 128256). About 4000 rows per path.
  for (const Case& c :
       {Case{1, 64, 4}, Case{7, 64, 4}, Case{7, 3, 20}, Case{1000, 64, 8}, Case{1000, 1, 100},
        Case{4099, 3, 30}, Case{4099, 7, 10}, Case{32000, 64, 4}, Case{32000, 3, 20}, Case{32000, 1, 40},
        Case{128256, 64, 1}, Case{128256, 3, 6}, Case{128256, 7, 3}, Case{128256, 1, 20},
        Case{128256, 257, 1}, Case{151936, 64, 1}, Case{151936, 1, 10}}) {
    for (FastSampler::Path path : kBothPaths) {
      FastSampler sampler(c.batch, c.vocab, path);
      Rng rng(static_cast<uint64_t>(c.vocab) * 131 + static_cast<uint64_t>(c.batch));
      std::vector<int32_t> fast_all, cpu_all;
      std::vector<SamplingRow> rows_all;
      for (int call = 0; call < c.calls; ++call) {
        std::vector<float> logits;
        std::vector<SamplingRow> rows;
        testing::append_random_rows(
            rng, c.vocab, c.batch, [&](uint64_t seed) { return model_like_row(c.vocab, seed); }, &logits,
            &rows);
        const std::vector<int32_t> fast = sample_fast(sampler, logits, c.vocab, c.vocab, rows);
        const std::vector<int32_t> cpu = sample_on_cpu(logits, c.vocab, c.vocab, rows);
        fast_all.insert(fast_all.end(), fast.begin(), fast.end());
        cpu_all.insert(cpu_all.end(), cpu.begin(), cpu.end());
        rows_all.insert(rows_all.end(), rows.begin(), rows.end());
      }
      expect_same_ids(fast_all, cpu_all, rows_all,
                      std::string(path_name(path)) + " (cluster " +
                          std::to_string(sampler.cluster_per_row(c.batch, c.vocab)) + ") vocab " +
                          std::to_string(c.vocab) + " batch " + std::to_string(c.batch));
    }
  }
}

TEST(FastSampler14Gpu, TheClusterPathIsTakenOnHopperAndTooBigRowsFallBack) {
  TVLLM_REQUIRE_GPU();
  int device = 0, major = 0;
  TVLLM_CUDA_CHECK(cudaGetDevice(&device));
  TVLLM_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  FastSampler sampler(64, 128256);
  if (major >= 9) {  // the H100 / H200: 8 blocks per row at batch 64, 8 or 16 at batch 1, one launch
    EXPECT_EQ(sampler.cluster_per_row(64, 128256), 8);
    EXPECT_GE(sampler.cluster_per_row(1, 128256), 8);
    EXPECT_EQ(sampler.launches(64, 128256), 1);
  }
  EXPECT_EQ(FastSampler(64, 128256, FastSampler::Path::kClusterV2).cluster_per_row(64, 128256),
            sampler.cluster_per_row(64, 128256));  // the same plan, another kernel
  EXPECT_EQ(FastSampler(64, 128256, FastSampler::Path::kClusterV3).cluster_per_row(64, 128256),
            sampler.cluster_per_row(64, 128256));
  EXPECT_EQ(FastSampler(64, 128256, FastSampler::Path::kClusterV1).cluster_version(), 1);
  EXPECT_EQ(FastSampler(64, 128256, FastSampler::Path::kClusterV3).cluster_version(), 3);
  EXPECT_EQ(FastSampler(64, 128256, FastSampler::Path::kClusterV4).cluster_version(), 4);
  EXPECT_EQ(FastSampler(64, 128256, FastSampler::Path::kClusterV4).cluster_per_row(64, 128256),
            sampler.cluster_per_row(64, 128256));
  {  // the default reads the environment: version 3 unless TVLLM_TOPP_V / TVLLM_TOPK_V say otherwise
    const char* p = std::getenv("TVLLM_TOPP_V");
    const char* k = std::getenv("TVLLM_TOPK_V");
    const bool old_p = p != nullptr && std::string(p) == "old";
    const bool new_k = k != nullptr && std::string(k) == "new";
    EXPECT_EQ(sampler.cluster_version(), new_k ? 4 : (old_p ? 1 : 3));
  }
  EXPECT_EQ(FastSampler(64, 128256, FastSampler::Path::kMultiPass).cluster_per_row(64, 128256), 0);
  EXPECT_EQ(FastSampler(64, 128256, FastSampler::Path::kMultiPass).launches(64, 128256),
            FastSampler::kMultiPassLaunches);
  // A row too big for 16 blocks' shared memory takes the multi-pass path, and is still exact.
  const int64_t vocab = 16 * 40960 + 1000;
  FastSampler big(2, vocab);
  EXPECT_EQ(big.cluster_per_row(2, vocab), 0);
  std::vector<float> logits;
  std::vector<SamplingRow> rows;
  for (int b = 0; b < 2; ++b) {
    const std::vector<float> row = model_like_row(vocab, 70 + b);
    logits.insert(logits.end(), row.begin(), row.end());
  }
  for (const SamplingRow& r : {row_of(0.8f, 50, 1.0f, 1, 2), row_of(1.0f, 0, 0.9f, 3, 4)}) {
    std::vector<SamplingRow> pair = {r, row_of(0.0f, 0, 1.0f, 0, 0)};
    expect_same_ids(sample_fast(big, logits, vocab, vocab, pair), sample_on_cpu(logits, vocab, vocab, pair),
                    pair, "vocab " + std::to_string(vocab));
  }
}

TEST(FastSampler14Gpu, EveryKnobAtVocab128256MatchesTheOracleAndLesson09) {
  TVLLM_REQUIRE_GPU();
  // One bf16 row with favourites; every combination of the knobs, 2 steps each: 4 * 6 * 6 * 2 = 288 rows,
  // in batches of 64 (and the rest).
  const int64_t vocab = 128256;
  const std::vector<float> row = model_like_row(vocab, 6);
  std::vector<SamplingRow> rows;
  for (float t : {0.0f, 0.3f, 1.0f, 2.0f})
    for (int k : {0, 1, 40, 50, 5000, 128255})
      for (float p : {1.0f, 0.95f, 0.9f, 0.6f, 0.2f, 1e-6f})
        for (uint64_t step = 0; step < 2; ++step) rows.push_back(row_of(t, k, p, 42, step));
  for (FastSampler::Path path : kBothPaths) {
    FastSampler sampler(64, vocab, path);
    for (size_t start = 0; start < rows.size(); start += 64) {
      const std::vector<SamplingRow> part(
          rows.begin() + static_cast<int64_t>(start),
          rows.begin() + static_cast<int64_t>(std::min(rows.size(), start + 64)));
      std::vector<float> logits;
      for (size_t b = 0; b < part.size(); ++b) logits.insert(logits.end(), row.begin(), row.end());
      const std::vector<int32_t> fast = sample_fast(sampler, logits, vocab, vocab, part);
      expect_same_ids(fast, sample_on_cpu(logits, vocab, vocab, part), part, "every knob vs cpu");
      expect_same_ids(fast, sample_lesson09(logits, vocab, vocab, part), part, "every knob vs lesson 09");
    }
  }
}

TEST(FastSampler14Gpu, TiesAtTheThresholdsAndEdgeRows) {
  TVLLM_REQUIRE_GPU();
  // Rows built so that the top-k and top-p boundaries fall inside large groups of equal logits (kept
  // whole), plus masks, +inf, NaN, overflow at tiny temperatures and rows where top-p keeps one token.
  const int64_t vocab = 20000;  // ~19 blocks per row at batch 1, one or two at batch 64
  std::vector<std::vector<float>> edge;
  edge.emplace_back(vocab, 0.0f);  // flat: one tie group of the whole row
  {
    std::vector<float> steps(vocab);  // 10 distinct values: huge tie groups at every threshold
    for (int64_t i = 0; i < vocab; ++i) steps[static_cast<size_t>(i)] = static_cast<float>((i * 7) % 10);
    edge.push_back(steps);
    std::vector<float> plateau = random_normal(vocab, 9, 1.0f);  // 300 tokens tied at the top, spread out
    for (int64_t i = 0; i < vocab; i += vocab / 300) plateau[static_cast<size_t>(i)] = 5.0f;
    edge.push_back(plateau);
    std::vector<float> favourite = random_normal(vocab, 10, 1.0f);  // top-p keeps exactly one token
    favourite[13337] = 40.0f;
    edge.push_back(favourite);
    std::vector<float> masked(vocab, -INFINITY);  // masked but two
    masked[19999] = -3.0f;
    masked[7] = -3.5f;
    edge.push_back(masked);
    masked[5] = INFINITY;  // +inf tokens share the draw
    masked[17000] = INFINITY;
    edge.push_back(masked);
    edge.emplace_back(vocab, -INFINITY);  // all masked: id 0
    std::vector<float> nans = random_normal(vocab, 3, 2.0f);
    for (int64_t i = 0; i < vocab; i += 7) nans[static_cast<size_t>(i)] = std::nanf("");  // NaN: -inf
    edge.push_back(nans);
    edge.push_back(random_normal(vocab, 4, 1e38f));            // overflows to inf at temperature < 1
    edge.push_back(random_normal(vocab, 5, 1e-30f));           // all but equal
    std::vector<float> zeros = random_normal(vocab, 6, 1.0f);  // -0 and +0 must tie
    for (int64_t i = 0; i < vocab; i += 3) zeros[static_cast<size_t>(i)] = i % 2 ? -0.0f : 0.0f;
    edge.push_back(zeros);
  }
  std::vector<float> logits;
  std::vector<SamplingRow> rows;
  for (size_t e = 0; e < edge.size(); ++e)
    for (float t : {0.0f, 1e-30f, 0.01f, 0.7f, 1.0f, 3e4f})
      for (int k : {0, 1, 3, 301, 5001, 19999})
        for (float p : {1.0f, 0.9f, 0.3f, 1e-6f}) {
          logits.insert(logits.end(), edge[e].begin(), edge[e].end());
          rows.push_back(row_of(t, k, p, e * 1000 + static_cast<uint64_t>(k), static_cast<uint64_t>(t * 10)));
        }
  // Batches of 64 (a few blocks per row), then the same rows one at a time (many blocks per row).
  for (FastSampler::Path path : kBothPaths) {
    SCOPED_TRACE(path_name(path));
    FastSampler sampler(64, vocab, path);
    DeviceBatch d(logits, rows);
    for (int start = 0; start < d.batch; start += 64)
      sampler.sample(d.logits() + static_cast<int64_t>(start) * vocab, vocab, vocab,
                     std::min(64, d.batch - start), d.rows() + start, d.out() + start);
    const std::vector<int32_t> batched = d.ids();
    for (int32_t id : batched) ASSERT_TRUE(id >= 0 && id < vocab) << id;
    const std::vector<int32_t> cpu = sample_on_cpu(logits, vocab, vocab, rows);
    expect_same_ids(batched, cpu, rows, "edge rows, batch 64");
    d.poison();
    for (int b = 0; b < d.batch; b += 5)  // every 5th row alone (the run time stays short)
      sampler.sample(d.logits() + static_cast<int64_t>(b) * vocab, vocab, vocab, 1, d.rows() + b,
                     d.out() + b);
    const std::vector<int32_t> alone = d.ids();
    for (int b = 0; b < d.batch; b += 5)
      EXPECT_EQ(alone[static_cast<size_t>(b)], cpu[static_cast<size_t>(b)])
          << "alone, row " << b << " " << describe(rows[static_cast<size_t>(b)]);
    // The favourite row with top-p 1e-6 (and 0.3): only the favourite is kept.
    for (size_t b = 0; b < rows.size(); ++b) {
      if (logits[b * vocab + 13337] == 40.0f && rows[b].temperature >= 0.7f && rows[b].temperature <= 1.0f &&
          rows[b].top_p < 0.5f) {
        EXPECT_EQ(batched[b], 13337) << describe(rows[b]);
      }
    }
  }
}

// Batch 64 at the model's vocab (8 blocks of 512 threads per row on the H200, the plan the benchmark times)
// with the rows hardest on the thresholds and on version 2's block masses: a flat row (all zeros, and all
// 3.25: one tie group of 128256 tokens at every digit, every block holding kept mass), ten repeated values,
// bf16-rounded normal logits (the benchmark's rows: thousands of ties) with and without 500 tokens tied at
// the top, and a grammar-style mask (all but 40 tokens -inf). Every knob of the benchmark, on every path.
TEST(FastSampler14Gpu, FlatAndTiedRowsAtBatch64AndVocab128256) {
  TVLLM_REQUIRE_GPU();
  const int64_t vocab = 128256;
  const int batch = 64;
  std::vector<std::vector<float>> kinds;
  kinds.emplace_back(vocab, 0.0f);
  kinds.emplace_back(vocab, 3.25f);
  std::vector<float> steps(vocab);
  for (int64_t i = 0; i < vocab; ++i) steps[static_cast<size_t>(i)] = static_cast<float>((i * 7) % 10);
  kinds.push_back(steps);
  std::vector<float> bf16 = random_normal(vocab, 2024, 2.0f);
  for (float& v : bf16) v = bf16_to_f32(f32_to_bf16(v));
  kinds.push_back(bf16);
  for (int64_t i = 0; i < vocab; i += vocab / 500) bf16[static_cast<size_t>(i)] = 9.0f;
  kinds.push_back(bf16);
  std::vector<float> masked(vocab, -INFINITY);
  for (int64_t i = 0; i < 40; ++i) masked[static_cast<size_t>(i * 3203)] = static_cast<float>(i % 4);
  kinds.push_back(masked);
  const SamplingRow knobs[] = {row_of(0.0f, 0, 1.0f, 0, 0), row_of(1.0f, 0, 1.0f, 0, 0),
                               row_of(0.7f, 50, 1.0f, 0, 0), row_of(1.0f, 0, 0.9f, 0, 0),
                               row_of(0.7f, 50, 0.9f, 0, 0),  row_of(1.0f, 1000, 0.5f, 0, 0)};
  // Row b: kind b % 6, knobs (b / 6) % 6, its own seed and step: every (kind, knobs) pair in one batch.
  std::vector<float> logits;
  std::vector<SamplingRow> rows;
  for (int b = 0; b < batch; ++b) {
    const std::vector<float>& kind = kinds[static_cast<size_t>(b) % kinds.size()];
    logits.insert(logits.end(), kind.begin(), kind.end());
    SamplingRow r = knobs[static_cast<size_t>(b / 6) % 6];
    r.seed = 1000 + static_cast<uint64_t>(b);
    r.step = static_cast<uint64_t>(b) * 7;
    rows.push_back(r);
  }
  const std::vector<int32_t> cpu = sample_on_cpu(logits, vocab, vocab, rows);
  for (FastSampler::Path path : kBothPaths) {
    FastSampler sampler(batch, vocab, path);
    const std::vector<int32_t> fast = sample_fast(sampler, logits, vocab, vocab, rows);
    expect_same_ids(fast, cpu, rows,
                    std::string(path_name(path)) + " (cluster " +
                        std::to_string(sampler.cluster_per_row(batch, vocab)) +
                        ") flat and tied rows, batch 64");
  }
}

// Version 3's top-p (the fine pass, the list, the fallback when the list overflows) and version 4's top-k
// list (its fallback to the digits: top-k 5000's bucket holds thousands) on the kernel itself,
// called through cluster_sampler::launch so that the list's capacity can be lowered: 2048 (the kernel's),
// 40 (some rows fall back) and 1 (almost every top-p row falls back, a list of one key does not). Rows:
// random model-like rows at every spread, bf16-rounded normal rows (the benchmark's), ties at the top, a
// mask; knobs: p = 1, 0.999, 0.9, 0.5, 1e-6, with and without top-k, temperatures 0.3 to 2; batch 64 (8
// blocks of 512 threads) and batch 3 (16 blocks of 1024). Every id must be sample_cpu's.
TEST(FastSampler14Gpu, VersionsThreeAndFourMatchTheOracleWithEveryListCapacity) {
  TVLLM_REQUIRE_GPU();
  const int max_cluster = cluster_sampler::max_cluster_size();
  if (max_cluster < 8) GTEST_SKIP() << "needs thread-block clusters of 8 (Hopper)";
  int device = 0, sms = 0;
  TVLLM_CUDA_CHECK(cudaGetDevice(&device));
  TVLLM_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t vocab = 128256;
  std::vector<std::vector<float>> kinds;
  for (uint64_t seed : {11u, 12u, 13u, 14u, 15u}) kinds.push_back(model_like_row(vocab, seed));
  std::vector<float> bf16 = random_normal(vocab, 2024, 2.0f);
  for (float& v : bf16) v = bf16_to_f32(f32_to_bf16(v));
  kinds.push_back(bf16);
  for (int64_t i = 0; i < vocab; i += vocab / 300) bf16[static_cast<size_t>(i)] = 8.0f;  // ties on top
  kinds.push_back(bf16);
  std::vector<float> masked(vocab, -INFINITY);  // a grammar mask: 3000 tokens left
  Rng mask_rng(5);
  for (int i = 0; i < 3000; ++i)
    masked[static_cast<size_t>(mask_rng.below(vocab))] = mask_rng.normal();
  kinds.push_back(masked);
  const float ps[] = {1.0f, 0.999f, 0.9f, 0.5f, 1e-6f};
  const float ts[] = {0.3f, 0.8f, 1.0f, 2.0f};
  const int ks[] = {0, 0, 50, 5000};
  for (int batch : {64, 3}) {
    cluster_sampler::Plan plan = cluster_sampler::plan_call(batch, vocab, sms, max_cluster);
    ASSERT_GE(plan.cluster, 8);
    for (int version : {3, 4})
    for (int capacity : {cluster_sampler::kListCapacity, 40, 1}) {
      plan.version = version;
      plan.list_capacity = capacity;
      Rng rng(static_cast<uint64_t>(batch * 1000 + capacity + 7 * version));
      for (int call = 0; call < (batch == 64 ? 3 : 8); ++call) {
        std::vector<float> logits;
        std::vector<SamplingRow> rows;
        for (int b = 0; b < batch; ++b) {
          const std::vector<float>& kind = kinds[static_cast<size_t>(rng.below(static_cast<int64_t>(kinds.size())))];
          logits.insert(logits.end(), kind.begin(), kind.end());
          rows.push_back(row_of(ts[rng.below(4)], ks[rng.below(4)], ps[rng.below(5)], rng.next_u64(),
                                static_cast<uint64_t>(rng.below(1000))));
        }
        DeviceBatch d(logits, rows);
        cluster_sampler::launch(d.logits(), vocab, vocab, d.batch, d.rows(), d.out(), plan, nullptr);
        TVLLM_CUDA_CHECK(cudaGetLastError());
        expect_same_ids(d.ids(), sample_on_cpu(logits, vocab, vocab, rows), rows,
                        "version " + std::to_string(version) + ", batch " + std::to_string(batch) +
                            ", list capacity " +
                            std::to_string(capacity));
      }
    }
  }
}

TEST(FastSampler14Gpu, PaddedRowsAndRowsAlone) {
  TVLLM_REQUIRE_GPU();
  // Rows with a stride larger than vocab whose padding holds +inf and NaN (which would win if read); and
  // each row sampled alone at its own address equals the batch.
  const int64_t vocab = 32000, stride = 32003;
  const int batch = 3;
  Rng rng(12);
  std::vector<float> padded, packed;
  std::vector<SamplingRow> rows;
  for (int b = 0; b < batch; ++b) {
    const std::vector<float> row = model_like_row(vocab, 40 + b);
    packed.insert(packed.end(), row.begin(), row.end());
    padded.insert(padded.end(), row.begin(), row.end());
    for (int64_t j = vocab; j < stride; ++j) padded.push_back(j % 2 ? INFINITY : std::nanf(""));
    rows.push_back(row_of(0.9f, b == 1 ? 50 : 0, b == 2 ? 0.9f : 1.0f, 7, static_cast<uint64_t>(b)));
  }
  for (FastSampler::Path path : kBothPaths) {
    FastSampler sampler(batch, vocab, path);
    const std::vector<int32_t> fast = sample_fast(sampler, padded, stride, vocab, rows);
    expect_same_ids(fast, sample_on_cpu(packed, vocab, vocab, rows), rows,
                    std::string("padded ") + path_name(path));
    DeviceBatch d(padded, rows);
    for (int b = 0; b < batch; ++b)
      sampler.sample(d.logits() + b * stride, stride, vocab, 1, d.rows() + b, d.out() + b);
    EXPECT_EQ(d.ids(), fast) << path_name(path);
  }
}

TEST(FastSampler14Gpu, CapturedGraphReplaysEqualEagerCalls) {
  TVLLM_REQUIRE_GPU();
  // The engine's decode loop: capture sample() once, upload new steps into the same rows array before
  // each replay. The workspace must come back to zeros after every call, or a replay would go wrong.
  const int64_t vocab = 128256;
  const int batch = 8;
  std::vector<float> logits;
  std::vector<SamplingRow> rows;
  for (int b = 0; b < batch; ++b) {
    const std::vector<float> row = model_like_row(vocab, 300 + b);
    logits.insert(logits.end(), row.begin(), row.end());
    rows.push_back(row_of(b == 0 ? 0.0f : 0.9f, b % 3 == 1 ? 50 : 0, b % 2 ? 0.9f : 1.0f, 1000 + b, 0));
  }
  for (FastSampler::Path path : kBothPaths) {
    SCOPED_TRACE(path_name(path));
    DeviceBatch d(logits, rows);
    FastSampler sampler(batch, vocab, path);
    CudaStream stream;
    CudaGraph graph = CudaGraph::capture(
        stream, [&] { sampler.sample(d.logits(), vocab, vocab, batch, d.rows(), d.out(), stream); });
    EXPECT_EQ(graph.num_nodes(), static_cast<size_t>(sampler.launches(batch, vocab)));
    for (uint64_t step = 0; step < 6; ++step) {
      for (SamplingRow& r : rows) r.step = step;
      const std::vector<int32_t> replayed = testing::replay_sampler_graph(graph, d, rows, stream);
      d.poison();
      sampler.sample(d.logits(), vocab, vocab, batch, d.rows(), d.out(), stream);
      stream.synchronize();
      EXPECT_EQ(d.ids(), replayed) << "step " << step << ": eager on a stream";
      expect_same_ids(replayed, sample_on_cpu(logits, vocab, vocab, rows), rows,
                      "graph step " + std::to_string(step));
    }
  }
}

// Path::kAuto reads TVLLM_TOPP_V and TVLLM_TOPK_V in the constructor: each setting's version, and a clear
// error for a bad value or a contradiction. The caller's environment is put back afterwards (the lead runs
// this binary under each setting).
TEST(FastSampler14Gpu, TheEnvironmentPicksTheClusterKernel) {
  TVLLM_REQUIRE_GPU();
  auto saved = [](const char* name) {
    const char* v = std::getenv(name);
    return v ? std::optional<std::string>(v) : std::nullopt;
  };
  const std::optional<std::string> p0 = saved("TVLLM_TOPP_V"), k0 = saved("TVLLM_TOPK_V");
  auto set = [](const char* name, const char* v) {
    if (v) {
      ::setenv(name, v, 1);
    } else {
      ::unsetenv(name);
    }
  };
  struct Case {
    const char* p;
    const char* k;
    int version;  // 0: InputError
  };
  for (const Case& c : {Case{nullptr, nullptr, 3}, Case{"new", nullptr, 3}, Case{"old", nullptr, 1},
                        Case{"", "", 3}, Case{nullptr, "new", 4}, Case{"new", "new", 4}, Case{"old", "new", 0},
                        Case{nullptr, "old", 3}, Case{"old", "old", 1}, Case{"v2", nullptr, 0},
                        Case{nullptr, "yes", 0}}) {
    set("TVLLM_TOPP_V", c.p);
    set("TVLLM_TOPK_V", c.k);
    const std::string what = std::string("TVLLM_TOPP_V=") + (c.p ? c.p : "(unset)") +
                             " TVLLM_TOPK_V=" + (c.k ? c.k : "(unset)");
    if (c.version == 0) {
      EXPECT_THROW(FastSampler(2, 1000), InputError) << what;
    } else {
      EXPECT_EQ(FastSampler(2, 1000).cluster_version(), c.version) << what;
      EXPECT_EQ(FastSampler(2, 1000, FastSampler::Path::kClusterV1).cluster_version(), 1) << what;
    }
  }
  set("TVLLM_TOPP_V", p0 ? p0->c_str() : nullptr);
  set("TVLLM_TOPK_V", k0 ? k0->c_str() : nullptr);
}

TEST(FastSampler14Gpu, ArgumentErrors) {
  TVLLM_REQUIRE_GPU();
  EXPECT_THROW(FastSampler(0, 100), InputError);
  EXPECT_THROW(FastSampler(1, 0), InputError);
  EXPECT_THROW(FastSampler(1, (int64_t{1} << 23) + 1), InputError);
  FastSampler sampler(2, 1000);
  DeviceBatch d(std::vector<float>(3 * 1000, 0.0f), std::vector<SamplingRow>(3, row_of(1, 0, 1, 0, 0)));
  EXPECT_THROW(sampler.sample(d.logits(), 1000, 1000, 3, d.rows(), d.out()), InputError);  // batch > max
  EXPECT_THROW(sampler.sample(d.logits(), 1001, 1001, 1, d.rows(), d.out()), InputError);  // vocab > max
  EXPECT_THROW(sampler.sample(d.logits(), 999, 1000, 1, d.rows(), d.out()), InputError);   // stride < vocab
  EXPECT_THROW(sampler.sample(nullptr, 1000, 1000, 1, d.rows(), d.out()), InputError);
  EXPECT_NO_THROW(sampler.sample(d.logits(), 1000, 1000, 0, d.rows(), d.out()));  // empty batch: nothing
  // The multi-pass grid: one row spreads over many blocks, 64 rows over a few each, never below 1024 tokens
  // a block.
  FastSampler big(64, 128256, FastSampler::Path::kMultiPass);
  EXPECT_GE(big.chunks_per_row(1, 128256), 64);
  EXPECT_LE(big.chunks_per_row(1, 128256), 128256 / 1024);
  EXPECT_GE(big.chunks_per_row(64, 128256), 2);
  EXPECT_EQ(big.chunks_per_row(64, 7), 1);
}

// ---- timings (printed, not asserted: the lesson executable reports them beside the target) -------------

TEST(FastSampler14Gpu, PrintsTimings) {
  TVLLM_REQUIRE_GPU();
  struct Setting {
    const char* name;
    float t;
    int k;
    float p;
  };
  for (int batch : {1, 64})
    for (const Setting& s : {Setting{"greedy", 0, 0, 1}, Setting{"temperature 0.8", 0.8f, 0, 1},
                             Setting{"top-k 50", 0.8f, 50, 1}, Setting{"top-p 0.9", 0.8f, 0, 0.9f},
                             Setting{"top-k 50 + top-p 0.9", 0.8f, 50, 0.9f}}) {
      SamplingParams params;
      params.temperature = s.t;
      params.top_k = s.k;
      params.top_p = s.p;
      const SamplerTiming timing = bench_fast_sampler(batch, 128256, params, 20);
      std::printf(
          "sampler vocab 128256 batch %2d %-22s fast %8.1f us (cluster %2d)   v1 %8.1f us   "
          "v3 %8.1f us   v4 (top-k list) %8.1f us   cluster v2 %8.1f us   multi-pass %8.1f us   "
          "lesson 09 %8.1f us\n",
          batch, s.name, timing.fast_us, timing.cluster, timing.cluster_v1_us, timing.cluster_v3_us,
          timing.cluster_v4_us, timing.cluster_v2_us, timing.multipass_us, timing.lesson09_us);
      EXPECT_GT(timing.fast_us, 0.0);
    }
}

}  // namespace
}  // namespace tvllm
