// Lesson 09, sampling on the GPU: the kernel against the CPU reference on many random rows at vocab 1000,
// 32000 and 128256 (and odd sizes), with every knob and ties as bf16 logits have them. The CPU and GPU
// compute the same integers, so they must agree on EVERY row: the tests count mismatches and require none
// (SAMPLING.md says why there is no near-tie exception). Also: greedy bit-exact, a batch equals each row
// alone and any order of the rows, padded rows, edge rows (masks, infinities, NaN), a captured CUDA graph
// replayed with new steps equals eager calls, a stream of our own, argument errors, and a chi-square test
// of 32768 draws made in ONE batch. One test prints timings (not asserted).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

#include "common/buffer.h"
#include "common/cuda_stream.h"
#include "common/dtype.h"
#include "common/errors.h"
#include "common/random.h"
#include "sampling.h"
#include "sampling_math.h"
#include "testing/sampling_batch.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

using testing::describe;
using testing::DeviceBatch;
using testing::expect_same_ids;
using testing::row_of;
using testing::sample_on_cpu;

std::vector<int32_t> sample_on_gpu(const std::vector<float>& logits, int64_t stride, int64_t vocab,
                                   const std::vector<SamplingRow>& rows, cudaStream_t stream = nullptr) {
  DeviceBatch d(logits, rows);
  GpuSampler sampler(std::max<int>(1, d.batch), vocab);
  sampler.sample(d.logits(), stride, vocab, d.batch, d.rows(), d.out(), stream);
  return d.ids();
}

std::vector<float> model_like_row(int64_t vocab, uint64_t seed) {
  return testing::model_like_row(vocab, seed, 0.5f + 6.0f * Rng(seed).uniform());
}
using testing::random_row_params;

TEST(Sampling09Gpu, MatchesTheCpuOnRandomRows) {
  TVLLM_REQUIRE_GPU();
  struct Size {
    int64_t vocab;
    int batch;
  };
  for (const Size& s : {Size{1, 8}, Size{2, 16}, Size{7, 32}, Size{513, 64}, Size{1000, 96}, Size{32000, 64},
                        Size{128256, 24}, Size{151936, 6}}) {
    Rng rng(static_cast<uint64_t>(s.vocab) * 13 + 1);
    std::vector<float> logits;
    std::vector<SamplingRow> rows;
    for (int b = 0; b < s.batch; ++b) {
      const std::vector<float> row = model_like_row(s.vocab, rng.next_u64() % 1000000);
      logits.insert(logits.end(), row.begin(), row.end());
      rows.push_back(random_row_params(rng, s.vocab));
    }
    expect_same_ids(sample_on_gpu(logits, s.vocab, s.vocab, rows), sample_on_cpu(logits, s.vocab, s.vocab, rows),
                    rows, "vocab " + std::to_string(s.vocab));
  }
}

TEST(Sampling09Gpu, EveryKnobAtVocab128256) {
  TVLLM_REQUIRE_GPU();
  // One bf16-rounded row, every combination of the knobs, 2 steps each: 4 * 5 * 5 * 2 = 200 rows.
  const int64_t vocab = 128256;
  const std::vector<float> row = model_like_row(vocab, 6);  // bf16 ties and a few favourites
  std::vector<float> logits;
  std::vector<SamplingRow> rows;
  for (float t : {0.0f, 0.3f, 1.0f, 2.0f})
    for (int k : {0, 1, 40, 5000, 128255})
      for (float p : {1.0f, 0.95f, 0.6f, 0.2f, 1e-6f})
        for (uint64_t step = 0; step < 2; ++step) {
          logits.insert(logits.end(), row.begin(), row.end());
          rows.push_back(row_of(t, k, p, 42, step));
        }
  expect_same_ids(sample_on_gpu(logits, vocab, vocab, rows), sample_on_cpu(logits, vocab, vocab, rows), rows,
                  "every knob");
}

TEST(Sampling09Gpu, GreedyIsBitExact) {
  TVLLM_REQUIRE_GPU();
  // Ties for the maximum placed in different threads and warps; the lowest id must win.
  for (int64_t vocab : {5, 1000, 32000, 128256}) {
    std::vector<float> logits;
    std::vector<SamplingRow> rows;
    Rng rng(static_cast<uint64_t>(vocab));
    for (int b = 0; b < 20; ++b) {
      std::vector<float> row = model_like_row(vocab, 500 + b);
      const float best = *std::max_element(row.begin(), row.end()) + 1.0f;
      for (int j = 0; j < b % 4; ++j) row[static_cast<size_t>(rng.below(vocab))] = best;
      if (b == 7) row[static_cast<size_t>(vocab - 1)] = best;  // the last id
      if (b == 8) row[0] = best;
      if (b == 9) std::fill(row.begin(), row.end(), -INFINITY);  // all masked: id 0
      if (b == 10) row[static_cast<size_t>(rng.below(vocab))] = std::nanf("");  // NaN: never the argmax
      logits.insert(logits.end(), row.begin(), row.end());
      rows.push_back(row_of(0.0f, b % 3, 0.5f, 1, b));  // top-k, top-p and seed do not matter
    }
    const std::vector<int32_t> gpu = sample_on_gpu(logits, vocab, vocab, rows);
    for (size_t b = 0; b < rows.size(); ++b)
      EXPECT_EQ(gpu[b], argmax_cpu(logits.data() + b * vocab, vocab)) << "vocab " << vocab << " row " << b;
  }
}

TEST(Sampling09Gpu, EdgeRows) {
  TVLLM_REQUIRE_GPU();
  const int64_t vocab = 3001;
  std::vector<std::vector<float>> edge;
  edge.emplace_back(vocab, 0.0f);  // flat: every token equally likely, ties everywhere
  {
    std::vector<float> r(vocab, -INFINITY);  // masked but one
    r[2999] = -3.0f;
    edge.push_back(r);
    r[5] = INFINITY;  // +inf tokens share the draw
    r[1700] = INFINITY;
    edge.push_back(r);
    edge.emplace_back(vocab, -INFINITY);  // all masked
  }
  {
    std::vector<float> r = random_normal(vocab, 3, 2.0f);
    for (int64_t i = 0; i < vocab; i += 7) r[static_cast<size_t>(i)] = std::nanf("");  // NaN: -inf
    edge.push_back(r);
    std::vector<float> huge = random_normal(vocab, 4, 1e38f);  // overflows to inf at temperature < 1
    edge.push_back(huge);
    std::vector<float> tiny = random_normal(vocab, 5, 1e-30f);  // all but equal
    edge.push_back(tiny);
    std::vector<float> steps(vocab);  // 10 distinct values: large tie groups at every threshold
    for (int64_t i = 0; i < vocab; ++i) steps[static_cast<size_t>(i)] = static_cast<float>((i * 7) % 10);
    edge.push_back(steps);
  }
  std::vector<float> logits;
  std::vector<SamplingRow> rows;
  for (size_t e = 0; e < edge.size(); ++e)
    for (float t : {1e-30f, 0.01f, 0.7f, 1.0f, 3e4f})
      for (int k : {0, 1, 3, 400, 3000})
        for (float p : {1.0f, 0.9f, 0.3f, 1e-6f}) {
          logits.insert(logits.end(), edge[e].begin(), edge[e].end());
          rows.push_back(row_of(t, k, p, e * 1000 + static_cast<uint64_t>(k), static_cast<uint64_t>(t * 10)));
        }
  const std::vector<int32_t> gpu = sample_on_gpu(logits, vocab, vocab, rows);
  for (int32_t id : gpu) ASSERT_TRUE(id >= 0 && id < vocab) << id;
  expect_same_ids(gpu, sample_on_cpu(logits, vocab, vocab, rows), rows, "edge rows");
}

TEST(Sampling09Gpu, ABatchEqualsEachRowAloneInAnyOrder) {
  TVLLM_REQUIRE_GPU();
  const int64_t vocab = 32000;
  const int batch = 37;
  Rng rng(8);
  std::vector<float> logits;
  std::vector<SamplingRow> rows;
  for (int b = 0; b < batch; ++b) {
    const std::vector<float> row = model_like_row(vocab, 900 + b);
    logits.insert(logits.end(), row.begin(), row.end());
    rows.push_back(random_row_params(rng, vocab));
  }
  DeviceBatch d(logits, rows);
  GpuSampler sampler(batch, vocab);
  sampler.sample(d.logits(), vocab, vocab, batch, d.rows(), d.out());
  const std::vector<int32_t> together = d.ids();
  d.poison();
  for (int b = 0; b < batch; ++b)  // each row alone: a batch of one at the row's own addresses
    sampler.sample(d.logits() + b * vocab, vocab, vocab, 1, d.rows() + b, d.out() + b);
  EXPECT_EQ(d.ids(), together);

  // The same requests in reverse order in the batch: each gets its own token.
  std::vector<float> reversed_logits;
  std::vector<SamplingRow> reversed_rows(rows.rbegin(), rows.rend());
  for (int b = batch - 1; b >= 0; --b)
    reversed_logits.insert(reversed_logits.end(), logits.begin() + b * vocab, logits.begin() + (b + 1) * vocab);
  std::vector<int32_t> reversed = sample_on_gpu(reversed_logits, vocab, vocab, reversed_rows);
  std::reverse(reversed.begin(), reversed.end());
  EXPECT_EQ(reversed, together);
  expect_same_ids(together, sample_on_cpu(logits, vocab, vocab, rows), rows, "batch");
}

TEST(Sampling09Gpu, PaddedRowsAreNotReadPastVocab) {
  TVLLM_REQUIRE_GPU();
  // Rows with a stride larger than vocab; the padding holds +inf and NaN, which would win if read.
  const int64_t vocab = 1000, stride = 1040;
  const int batch = 12;
  Rng rng(12);
  std::vector<float> padded, packed;
  std::vector<SamplingRow> rows;
  for (int b = 0; b < batch; ++b) {
    const std::vector<float> row = model_like_row(vocab, 40 + b);
    packed.insert(packed.end(), row.begin(), row.end());
    padded.insert(padded.end(), row.begin(), row.end());
    for (int64_t j = vocab; j < stride; ++j) padded.push_back(j % 2 ? INFINITY : std::nanf(""));
    rows.push_back(b % 4 == 0 ? row_of(0, 0, 1, 0, 0) : random_row_params(rng, vocab));
  }
  EXPECT_EQ(sample_on_gpu(padded, stride, vocab, rows), sample_on_gpu(packed, vocab, vocab, rows));
  expect_same_ids(sample_on_gpu(padded, stride, vocab, rows), sample_on_cpu(packed, vocab, vocab, rows), rows,
                  "padded");
}

TEST(Sampling09Gpu, CapturedGraphReplaysWithNewStepsAndOwnStream) {
  TVLLM_REQUIRE_GPU();
  // The engine's decode loop: the sampler's launch is captured once; before each replay the caller
  // uploads the rows' new steps into the same device array (an async copy outside the graph).
  const int64_t vocab = 128256;
  const int batch = 8;
  Rng rng(21);
  std::vector<float> logits;
  std::vector<SamplingRow> rows;
  for (int b = 0; b < batch; ++b) {
    const std::vector<float> row = model_like_row(vocab, 300 + b);
    logits.insert(logits.end(), row.begin(), row.end());
    rows.push_back(row_of(b == 0 ? 0.0f : 0.9f, b % 3 == 1 ? 50 : 0, b % 2 ? 0.9f : 1.0f, 1000 + b, 0));
  }
  DeviceBatch d(logits, rows);
  GpuSampler sampler(batch, vocab);
  CudaStream stream;
  HostBuffer pinned_rows(sizeof(SamplingRow) * batch, HostBuffer::Kind::Pinned);
  HostBuffer pinned_ids(sizeof(int32_t) * batch, HostBuffer::Kind::Pinned);
  CudaGraph graph = CudaGraph::capture(
      stream, [&] { sampler.sample(d.logits(), vocab, vocab, batch, d.rows(), d.out(), stream); });
  EXPECT_EQ(graph.num_nodes(), 1u);
  for (uint64_t step = 0; step < 6; ++step) {
    for (SamplingRow& r : rows) r.step = step;
    std::copy(rows.begin(), rows.end(), pinned_rows.as<SamplingRow>());
    TVLLM_CUDA_CHECK(cudaMemcpyAsync(d.rows_d.data(), pinned_rows.data(), pinned_rows.bytes(),
                                     cudaMemcpyHostToDevice, stream));
    graph.launch(stream);
    TVLLM_CUDA_CHECK(cudaMemcpyAsync(pinned_ids.data(), d.out(), pinned_ids.bytes(), cudaMemcpyDeviceToHost, stream));
    stream.synchronize();
    const std::vector<int32_t> replayed(pinned_ids.as<int32_t>(), pinned_ids.as<int32_t>() + batch);
    // Eager, on our stream and on the legacy default stream.
    d.poison();
    sampler.sample(d.logits(), vocab, vocab, batch, d.rows(), d.out(), stream);
    stream.synchronize();
    EXPECT_EQ(d.ids(), replayed) << "step " << step << ": eager on a stream";
    d.poison();
    sampler.sample(d.logits(), vocab, vocab, batch, d.rows(), d.out());
    EXPECT_EQ(d.ids(), replayed) << "step " << step << ": eager on the default stream";
    expect_same_ids(replayed, sample_on_cpu(logits, vocab, vocab, rows), rows, "graph step " + std::to_string(step));
  }
}

TEST(Sampling09Gpu, ArgumentErrors) {
  TVLLM_REQUIRE_GPU();
  EXPECT_THROW(GpuSampler(0, 100), InputError);
  EXPECT_THROW(GpuSampler(1, 0), InputError);
  EXPECT_THROW(GpuSampler(1, (int64_t{1} << 23) + 1), InputError);
  GpuSampler sampler(2, 1000);
  DeviceBatch d(std::vector<float>(3 * 1000, 0.0f), std::vector<SamplingRow>(3, row_of(1, 0, 1, 0, 0)));
  EXPECT_THROW(sampler.sample(d.logits(), 1000, 1000, 3, d.rows(), d.out()), InputError);   // batch > max
  EXPECT_THROW(sampler.sample(d.logits(), 1001, 1001, 1, d.rows(), d.out()), InputError);   // vocab > max
  EXPECT_THROW(sampler.sample(d.logits(), 999, 1000, 1, d.rows(), d.out()), InputError);    // stride < vocab
  EXPECT_THROW(sampler.sample(nullptr, 1000, 1000, 1, d.rows(), d.out()), InputError);
  EXPECT_NO_THROW(sampler.sample(d.logits(), 1000, 1000, 0, d.rows(), d.out()));  // an empty batch: nothing
}

// ---- statistics, with all draws in one batch ----------------------------------------------------------

double chi2_sf(double x, int df) {  // Q(df/2, x/2), as in test_09_sampling.cpp
  const double a = df / 2.0, y = x / 2.0;
  if (y <= 0) return 1.0;
  const double log_prefix = a * std::log(y) - y - std::lgamma(a);
  if (y < a + 1) {
    double term = 1.0 / a, sum = term;
    for (int n = 1; n < 1000 && term > sum * 1e-16; ++n) sum += term *= y / (a + n);
    return 1.0 - sum * std::exp(log_prefix);
  }
  double b = y + 1 - a, c = 1e300, d = 1 / b, h = d;
  for (int i = 1; i < 1000; ++i) {
    const double an = -i * (i - a);
    b += 2;
    d = an * d + b;
    if (std::abs(d) < 1e-300) d = 1e-300;
    c = b + an / c;
    if (std::abs(c) < 1e-300) c = 1e-300;
    d = 1 / d;
    h *= d * c;
    if (std::abs(d * c - 1) < 1e-16) break;
  }
  return std::exp(log_prefix) * h;
}

TEST(Sampling09Gpu, DrawsInOneBatchFollowTheDistribution) {
  TVLLM_REQUIRE_GPU();
  // The same 12 logits in 32768 rows, steps 0..32767: one GPU call makes all the draws. Expected: the
  // exact renormalised distribution of temperature 1.3, top-k 8, top-p 0.9, in double (Hugging Face's
  // order). Significance 1e-4, fixed seed: deterministic.
  const std::vector<float> base{2.0f, 1.6f, -0.3f, 1.1f, 0.7f, 0.2f, -1.0f, 0.9f, -2.5f, 1.4f, -0.8f, 0.0f};
  const int64_t vocab = 12;
  const int n = 32768;
  const float t = 1.3f, p = 0.9f;
  const int k = 8;
  std::vector<float> logits;
  std::vector<SamplingRow> rows;
  for (int i = 0; i < n; ++i) {
    logits.insert(logits.end(), base.begin(), base.end());
    rows.push_back(row_of(t, k, p, 777, static_cast<uint64_t>(i)));
  }
  const std::vector<int32_t> ids = sample_on_gpu(logits, vocab, vocab, rows);
  expect_same_ids(ids, sample_on_cpu(logits, vocab, vocab, rows), rows, "statistics batch");

  // Expected probabilities: z = logits / T; keep the 8 largest; softmax; top-p keeps the most likely
  // tokens until their sum reaches 0.9 (the boundary is far from 0.9 for these logits).
  std::vector<double> z(12);
  for (int i = 0; i < 12; ++i) z[i] = base[i] / t;
  std::vector<int> order(12);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int a, int b) { return z[a] > z[b]; });
  std::vector<double> prob(12, 0.0);
  double sum = 0;
  for (int j = 0; j < k; ++j) sum += prob[order[j]] = std::exp(z[order[j]] - z[order[0]]);
  double cumulative = 0;
  int kept = 0;
  while (cumulative < p) cumulative += prob[order[kept++]] / sum;
  double kept_sum = 0;
  for (int j = 0; j < 12; ++j) {
    if (j >= kept) prob[order[j]] = 0;
    kept_sum += prob[order[j]];
  }
  std::vector<int64_t> counts(12, 0);
  for (int32_t id : ids) ++counts[static_cast<size_t>(id)];
  double chi2 = 0;
  for (int i = 0; i < 12; ++i) {
    if (prob[i] == 0) {
      EXPECT_EQ(counts[i], 0) << "token " << i << " was removed but drawn";
      continue;
    }
    const double e = n * prob[i] / kept_sum;
    chi2 += (counts[i] - e) * (counts[i] - e) / e;
  }
  EXPECT_GT(chi2_sf(chi2, kept - 1), 1e-4) << "chi2 " << chi2 << " with " << kept - 1 << " df, kept " << kept;
}

// ---- timings (printed, not asserted) ------------------------------------------------------------------

TEST(Sampling09Gpu, PrintsTimings) {
  TVLLM_REQUIRE_GPU();
  const int64_t vocab = 128256;
  for (int batch : {1, 64}) {
    std::vector<float> logits;
    for (int b = 0; b < batch; ++b) {
      const std::vector<float> row = model_like_row(vocab, 2000 + b);
      logits.insert(logits.end(), row.begin(), row.end());
    }
    struct Setting {
      const char* name;
      SamplingRow row;
    };
    for (const Setting& s : {Setting{"greedy", row_of(0, 0, 1, 0, 0)}, Setting{"temperature", row_of(0.8f, 0, 1, 0, 0)},
                             Setting{"top-k 50", row_of(0.8f, 50, 1, 0, 0)},
                             Setting{"top-p 0.9", row_of(0.8f, 0, 0.9f, 0, 0)},
                             Setting{"top-k 50 + top-p 0.9", row_of(0.8f, 50, 0.9f, 0, 0)}}) {
      DeviceBatch d(logits, std::vector<SamplingRow>(static_cast<size_t>(batch), s.row));
      GpuSampler sampler(batch, vocab);
      CudaStream stream;
      cudaEvent_t start, stop;
      TVLLM_CUDA_CHECK(cudaEventCreate(&start));
      TVLLM_CUDA_CHECK(cudaEventCreate(&stop));
      for (int i = 0; i < 3; ++i) sampler.sample(d.logits(), vocab, vocab, batch, d.rows(), d.out(), stream);
      const int reps = 20;
      TVLLM_CUDA_CHECK(cudaEventRecord(start, stream));
      for (int i = 0; i < reps; ++i) sampler.sample(d.logits(), vocab, vocab, batch, d.rows(), d.out(), stream);
      TVLLM_CUDA_CHECK(cudaEventRecord(stop, stream));
      TVLLM_CUDA_CHECK(cudaEventSynchronize(stop));
      float ms = 0;
      TVLLM_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
      std::printf("sampler vocab %lld batch %2d %-22s %8.1f us per call\n", static_cast<long long>(vocab), batch,
                  s.name, 1000.0 * ms / reps);
      TVLLM_CUDA_CHECK(cudaEventDestroy(start));
      TVLLM_CUDA_CHECK(cudaEventDestroy(stop));
    }
  }
}

}  // namespace
}  // namespace tvllm
