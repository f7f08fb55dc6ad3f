// The CPU reference: the oracle every GPU kernel is checked against.
//
// It is the formula, written as plainly as possible, for one (sequence, head, query) at a time:
//   scores_j = q . k_j * scale              for the keys j <= i of the same sequence (causal)
//   p_j      = exp(scores_j - max) / sum    (softmax, max-subtracted)
//   out      = sum_j p_j v_j
//
// Why double for the arithmetic: the inputs are fp32, but every dot product, exponential and sum below
// is done in double, so the reference's own rounding (~1e-16) is far below anything we measure: the
// error a test reports is the error of the code under test, not of the oracle. It costs nothing here
// (the reference runs on short prompts and small test batches).
//
// Why still subtract the max, even in double: exp(s - max) <= 1 for every key, so nothing overflows
// however large the scores are (exp(710) is already inf in double), and the largest term is exactly 1,
// so the sum is >= 1 and the division is safe. Mathematically softmax(s) == softmax(s - c) for any c.
#include <algorithm>
#include <cmath>
#include <vector>

#include "attention.h"

namespace tvllm {

void attention_prefill_cpu(const TensorView& out, const TensorView& q, const TensorView& k, const TensorView& v,
                           const VarlenBatch& batch, const AttentionShape& shape) {
  const int64_t D = shape.head_dim;
  const int64_t q_dim = shape.q_dim(), kv_dim = shape.kv_dim();
  const int64_t group = shape.group_size();
  const double scale = shape.scale();
  const float* Q = q.ptr<const float>();  // [T, n_heads*D]
  const float* K = k.ptr<const float>();  // [T, n_kv*D]
  const float* V = v.ptr<const float>();  // [T, n_kv*D]
  float* O = out.ptr<float>();            // [T, n_heads*D]

  std::vector<double> p;    // [n]  the scores, then the probabilities, of one query
  std::vector<double> acc;  // [D]  sum_j p_j v_j of one query
  for (int b = 0; b < batch.batch_size(); ++b) {
    const int64_t begin = batch.seq_begin(b), n = batch.seq_len(b);
    for (int64_t h = 0; h < shape.n_heads; ++h) {
      const int64_t kvh = h / group;  // grouped-query attention: `group` query heads share one kv head
      for (int64_t i = 0; i < n; ++i) {
        const float* qi = Q + (begin + i) * q_dim + h * D;
        // scores for the visible keys j = 0..i (the causal mask: the future does not exist yet)
        p.assign(static_cast<size_t>(i + 1), 0.0);
        double max_score = -INFINITY;
        for (int64_t j = 0; j <= i; ++j) {
          const float* kj = K + (begin + j) * kv_dim + kvh * D;
          double dot = 0.0;
          for (int64_t d = 0; d < D; ++d) dot += static_cast<double>(qi[d]) * kj[d];
          p[j] = dot * scale;
          max_score = std::max(max_score, p[j]);
        }
        double sum = 0.0;
        for (int64_t j = 0; j <= i; ++j) {
          p[j] = std::exp(p[j] - max_score);
          sum += p[j];
        }
        acc.assign(static_cast<size_t>(D), 0.0);
        for (int64_t j = 0; j <= i; ++j) {
          const float* vj = V + (begin + j) * kv_dim + kvh * D;
          for (int64_t d = 0; d < D; ++d) acc[d] += p[j] * vj[d];
        }
        float* oi = O + (begin + i) * q_dim + h * D;
        for (int64_t d = 0; d < D; ++d) oi[d] = static_cast<float>(acc[d] / sum);
      }
    }
  }
}

}  // namespace tvllm
