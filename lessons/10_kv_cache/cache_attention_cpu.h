// Lesson 10's CPU attention over a cache (the fp32/double references), written once for any layout of the
// cache's rows. `row_of(b)` returns, for sequence b, a callable j -> the element offset of position j's row
// (kv_dim floats, every kv head) in k and v. Lesson 10 passes (slot * max_context + j) * kv_dim; lesson 12 asks
// its block table. So the paged references are the contiguous ones, bit for bit, by construction.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "attention.h"
#include "common/exercise.h"
#include "common/tensor.h"

namespace tvllm {

// Prefill and chunks (any q_len): lesson 07's attention_cpu, in double, with key j of sequence b read from the
// cache instead of a packed row.
template <class RowOf>
void prefill_attention_over_rows_cpu(const TensorView& out, const TensorView& q, const float* k, const float* v,
                                     const AttentionBatch& batch, const AttentionShape& shape, const RowOf& row_of) {
  const int64_t D = shape.head_dim, group = shape.group_size();
  const double scale = shape.scale();
  std::vector<double> p, acc;
  for (int b = 0; b < batch.batch_size(); ++b) {
    const int64_t q_len = batch.q_len(b), k_len = batch.k_len(b);
    const auto row = row_of(b);  // position j -> the element offset of its row
    for (int64_t h = 0; h < shape.n_heads; ++h) {
      const int64_t kvh = h / group;
      for (int64_t i = 0; i < q_len; ++i) {
        const int64_t pos = k_len - q_len + i;     // sees keys first..pos
        const int64_t first = shape.first_key(pos);  // 0, or the window's oldest key
        const float* qi = q.ptr<const float>() + (batch.q_begin(b) + i) * q.strides[0] + h * D;
        p.assign(static_cast<size_t>(pos + 1), 0.0);
        double max_score = -INFINITY;
        for (int64_t j = first; j <= pos; ++j) {
          const float* kj = k + row(j) + kvh * D;
          double dot = 0.0;
          for (int64_t d = 0; d < D; ++d) dot += static_cast<double>(qi[d]) * kj[d];
          p[j] = dot * scale;
          max_score = std::max(max_score, p[j]);
        }
        double sum = 0.0;
        for (int64_t j = first; j <= pos; ++j) sum += (p[j] = std::exp(p[j] - max_score));
        acc.assign(static_cast<size_t>(D), 0.0);
        for (int64_t j = first; j <= pos; ++j) {
          const float* vj = v + row(j) + kvh * D;
          for (int64_t d = 0; d < D; ++d) acc[d] += p[j] * vj[d];
        }
        float* oi = out.ptr<float>() + (batch.q_begin(b) + i) * out.strides[0] + h * D;
        for (int64_t d = 0; d < D; ++d) oi[d] = static_cast<float>(acc[d] / sum);
      }
    }
  }
}

// Decode (every q_len 0 or 1), split over the context in fp32: the same algorithm as the GPU kernels (per-split
// max, sum and unnormalised output, then the combine), so it is their twin.
template <class RowOf>
void decode_attention_over_rows_cpu(const TensorView& out, const TensorView& q, const float* k, const float* v,
                                    const AttentionBatch& batch, const AttentionShape& shape, int num_splits,
                                    const RowOf& row_of) {
  // --- exercise 10.2: decode attention, split over the context ---------------------------------------------
  // Task: for each sequence b with one query (q_len 1) and each head h: cut its visible keys [first, k_len)
  //   (first = shape.first_key(k_len - 1): 0, or k_len - window with a sliding window) into num_splits
  //   chunks of ceil((k_len - first) / num_splits); per chunk s compute, in fp32 and base-2 units (score = q.k *
  //   scale * log2(e)), the chunk's max m_s, its sum l_s = sum 2^(score - m_s) and its unnormalised output
  //   o_s = sum 2^(score - m_s) v. Then combine: M = max m_s, w_s = 2^(m_s - M),
  //   out = sum w_s o_s / sum w_s l_s. An empty chunk has m_s = -inf and adds nothing (w_s = 0).
  // Hint: GQA: head h reads kv head h / shape.group_size(). The key at position j of sequence b is at
  //   k + row(j) + kv_head * head_dim, with row = row_of(b) (lesson 10: row(j) = (slot * max_context + j) *
  //   kv_dim; lesson 12 asks the block table).
  // Hint: never compute -inf - -inf: skip empty chunks rather than weighting them.
  // Tests: KvCache.DecodeCpuMatchesNaiveLoop KvCache.GreedyEqualsReference* KvCache.CacheEqualsRecompute
  // Stub:
  //   (void)out;
  //   (void)q;
  //   (void)k;
  //   (void)v;
  //   (void)batch;
  //   (void)shape;
  //   (void)num_splits;
  //   (void)row_of;
  //   throw NotWrittenYet("10.2", "decode attention, split over the context");
  // --- solution ---
  const int64_t D = shape.head_dim, group = shape.group_size();
  const float scale_log2 = static_cast<float>(shape.scale() * 1.4426950408889634);  // as the kernels
  std::vector<float> m(static_cast<size_t>(num_splits)), l(static_cast<size_t>(num_splits));
  std::vector<float> o(static_cast<size_t>(num_splits * D)), scores;
  for (int b = 0; b < batch.batch_size(); ++b) {
    if (batch.q_len(b) == 0) continue;  // nothing to compute, nothing to write
    const int64_t k_len = batch.k_len(b);
    // The query sits at k_len - 1; a sliding window hides every key before `first`, so the splits share only
    // the window's keys: never read, never weighted (the point of the window: decode reads at most W keys).
    const int64_t first = shape.first_key(k_len - 1);
    const int64_t chunk = (k_len - first + num_splits - 1) / num_splits;
    const auto row = row_of(b);  // position j -> the element offset of its row
    for (int64_t h = 0; h < shape.n_heads; ++h) {
      const int64_t kvh = h / group;
      const float* qh = q.ptr<const float>() + batch.q_begin(b) * q.strides[0] + h * D;
      // 1. Each split: its max, its sum, its unnormalised output (what one GPU block writes).
      for (int s = 0; s < num_splits; ++s) {
        const int64_t begin = std::min(k_len, first + s * chunk), end = std::min(k_len, begin + chunk);
        float* os = o.data() + s * D;
        std::fill(os, os + D, 0.f);
        m[s] = -INFINITY;
        l[s] = 0.f;
        scores.assign(static_cast<size_t>(end - begin), 0.f);
        for (int64_t j = begin; j < end; ++j) {
          const float* kj = k + row(j) + kvh * D;
          float dot = 0.f;
          for (int64_t d = 0; d < D; ++d) dot += qh[d] * kj[d];
          scores[j - begin] = dot * scale_log2;
          m[s] = std::max(m[s], scores[j - begin]);
        }
        for (int64_t j = begin; j < end; ++j) {
          const float p = std::exp2(scores[j - begin] - m[s]);
          l[s] += p;
          const float* vj = v + row(j) + kvh * D;
          for (int64_t d = 0; d < D; ++d) os[d] += p * vj[d];
        }
      }
      // 2. The combine: rescale every split to the global max, add, normalise once.
      float M = -INFINITY;
      for (int s = 0; s < num_splits; ++s) M = std::max(M, m[s]);
      float L = 0.f;
      float* oh = out.ptr<float>() + batch.q_begin(b) * out.strides[0] + h * D;
      std::fill(oh, oh + D, 0.f);
      for (int s = 0; s < num_splits; ++s) {
        if (m[s] == -INFINITY) continue;  // an empty split
        const float w = std::exp2(m[s] - M);
        L += w * l[s];
        for (int64_t d = 0; d < D; ++d) oh[d] += w * o[s * D + d];
      }
      const float inv = L > 0.f ? 1.f / L : 0.f;
      for (int64_t d = 0; d < D; ++d) oh[d] *= inv;
    }
  }
  // --- end of exercise 10.2 ---
}

}  // namespace tvllm
