// What the GPU sampler suites of lessons 09 and 14 share: a batch of logits rows and their sampling rows on the
// device, the CPU oracle over the same batch, and the row-by-row comparison. Header-only: it needs lesson 09's
// sampling.h, which only those suites link (tvllm_testing itself links common/ alone).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "common/buffer.h"
#include "common/cuda_stream.h"
#include "common/dtype.h"
#include "common/errors.h"
#include "common/random.h"
#include "sampling.h"

namespace tvllm::testing {

inline SamplingRow row_of(float temperature, int top_k, float top_p, uint64_t seed, uint64_t step) {
  SamplingParams p;
  p.temperature = temperature;
  p.top_k = top_k;
  p.top_p = top_p;
  p.seed = seed;
  return make_sampling_row(p, step);
}

inline std::string describe(const SamplingRow& r) {
  return "T=" + std::to_string(r.temperature) + " k=" + std::to_string(r.top_k) + " p=" + std::to_string(r.top_p) +
         " seed=" + std::to_string(r.seed) + " step=" + std::to_string(r.step);
}

// Logits shaped like a model's: normal with the given spread, rounded to bf16 for even seeds (as a bf16 lm_head
// gives them: many exact ties), with a few strong favourites for seeds divisible by 3.
inline std::vector<float> model_like_row(int64_t vocab, uint64_t seed, float spread) {
  Rng rng(seed);
  std::vector<float> row = random_normal(static_cast<size_t>(vocab), seed * 31 + 7, spread);
  if (seed % 2 == 0)
    for (float& x : row) x = bf16_to_f32(f32_to_bf16(x));
  if (seed % 3 == 0)
    for (int j = 0; j < 5; ++j) row[static_cast<size_t>(rng.below(vocab))] += 4.0f * spread;
  return row;
}

// A random mix of every knob: greedy, temperatures from 0.05 to 5, top-k from 1 to beyond the vocabulary, top-p
// from 1e-6 to 1, random seeds and steps.
inline SamplingRow random_row_params(Rng& rng, int64_t vocab) {
  static const float kTemps[] = {0.0f, 0.05f, 0.5f, 0.8f, 1.0f, 1.0f, 1.7f, 5.0f};
  static const float kTopP[] = {1.0f, 1.0f, 0.999f, 0.95f, 0.9f, 0.5f, 0.1f, 1e-6f};
  const int64_t ks[] = {0, 0, 1, 2, 7, 50, 1000, vocab - 1, vocab, vocab + 3};
  const float t = kTemps[rng.below(8)];
  const int k = static_cast<int>(std::max<int64_t>(0, ks[rng.below(10)]));
  const float p = kTopP[rng.below(8)];
  return row_of(t, k, p, rng.next_u64(), rng.next_u64());
}

// Appends `batch` random rows: logits from make_row(seed) with a random seed below 10^6, knobs from
// random_row_params.
template <class MakeRow>
void append_random_rows(Rng& rng, int64_t vocab, int batch, MakeRow&& make_row, std::vector<float>* logits,
                        std::vector<SamplingRow>* rows) {
  for (int b = 0; b < batch; ++b) {
    const std::vector<float> row = make_row(rng.next_u64() % 1000000);
    logits->insert(logits->end(), row.begin(), row.end());
    rows->push_back(random_row_params(rng, vocab));
  }
}

// A batch on the device: logits [batch, stride], rows [batch], ids [batch] (poisoned with -1).
struct DeviceBatch {
  DeviceBatch(const std::vector<float>& logits, const std::vector<SamplingRow>& rows)
      : logits_d(std::max<size_t>(1, logits.size()) * sizeof(float)),
        rows_d(std::max<size_t>(1, rows.size()) * sizeof(SamplingRow)),
        ids_d(std::max<size_t>(1, rows.size()) * sizeof(int32_t)),
        batch(static_cast<int>(rows.size())) {
    logits_d.copy_from_host(logits.data(), logits.size() * sizeof(float));
    rows_d.copy_from_host(rows.data(), rows.size() * sizeof(SamplingRow));
    poison();
  }
  void poison() {
    TVLLM_CUDA_CHECK(cudaMemset(ids_d.data(), 0xFF, ids_d.bytes()));
    TVLLM_CUDA_CHECK(cudaDeviceSynchronize());  // a kernel on a non-blocking stream must see the uploads
  }
  std::vector<int32_t> ids() const {
    TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<int32_t> out(static_cast<size_t>(batch));
    ids_d.copy_to_host(out.data(), out.size() * sizeof(int32_t));
    return out;
  }
  const float* logits() const { return logits_d.as<float>(); }
  const SamplingRow* rows() const { return rows_d.as<SamplingRow>(); }
  int32_t* out() const { return ids_d.as<int32_t>(); }

  DeviceBuffer logits_d, rows_d, ids_d;
  int batch;
};

// The engine's decode step for a captured sampler: `rows` (their new steps) uploaded into d's rows array
// through pinned memory, the graph replayed, the ids copied back; all on `stream`, then waited for.
inline std::vector<int32_t> replay_sampler_graph(const CudaGraph& graph, const DeviceBatch& d,
                                                 const std::vector<SamplingRow>& rows, const CudaStream& stream) {
  HostBuffer pinned_rows(sizeof(SamplingRow) * rows.size(), HostBuffer::Kind::Pinned);
  HostBuffer pinned_ids(sizeof(int32_t) * rows.size(), HostBuffer::Kind::Pinned);
  std::copy(rows.begin(), rows.end(), pinned_rows.as<SamplingRow>());
  TVLLM_CUDA_CHECK(cudaMemcpyAsync(d.rows_d.data(), pinned_rows.data(), pinned_rows.bytes(), cudaMemcpyHostToDevice,
                                   stream));
  graph.launch(stream);
  TVLLM_CUDA_CHECK(cudaMemcpyAsync(pinned_ids.data(), d.out(), pinned_ids.bytes(), cudaMemcpyDeviceToHost, stream));
  stream.synchronize();
  return std::vector<int32_t>(pinned_ids.as<int32_t>(), pinned_ids.as<int32_t>() + rows.size());
}

// The CPU oracle, row by row.
inline std::vector<int32_t> sample_on_cpu(const std::vector<float>& logits, int64_t stride, int64_t vocab,
                                          const std::vector<SamplingRow>& rows) {
  std::vector<int32_t> ids;
  for (size_t b = 0; b < rows.size(); ++b)
    ids.push_back(sample_cpu(logits.data() + b * static_cast<size_t>(stride), vocab, rows[b]));
  return ids;
}

// Counts the rows where `got` and the oracle differ and reports the first few.
inline void expect_same_ids(const std::vector<int32_t>& got, const std::vector<int32_t>& oracle,
                            const std::vector<SamplingRow>& rows, const std::string& what) {
  ASSERT_EQ(got.size(), oracle.size());
  int mismatches = 0;
  std::string first;
  for (size_t b = 0; b < got.size(); ++b) {
    if (got[b] == oracle[b]) continue;
    if (++mismatches <= 5)
      first += "\n  row " + std::to_string(b) + " (" + describe(rows[b]) + "): got " + std::to_string(got[b]) +
               " oracle " + std::to_string(oracle[b]);
  }
  EXPECT_EQ(mismatches, 0) << what << ": " << mismatches << " of " << got.size() << " rows differ" << first;
}

}  // namespace tvllm::testing
