// The CPU reference: the oracle every GPU kernel is checked against.
//
// It is the formula, written as plainly as possible, for one (sequence, head, query) at a time:
//   scores_j = q . k_j * scale              for the keys j <= pos of the same sequence (causal), where
//                                           pos = k_len - q_len + i is the position of query i, and
//                                           j > pos - W when the shape has a sliding window W
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
#include "common/exercise.h"

namespace tvllm {

void attention_cpu(const TensorView& out, const TensorView& q, const TensorView& k, const TensorView& v,
                   const AttentionBatch& batch, const AttentionShape& shape) {
  // --- exercise 07.1: the reference, one query at a time -----------------------------------------------
  // Task: for every sequence b of the batch, head h and query i < q_len(b): the query sits at
  //   position pos = k_len - q_len + i and sees keys j = 0..pos of its own sequence (causal); with a
  //   sliding window (shape.window > 0) only j = shape.first_key(pos)..pos, the last `window` of them.
  //   scores_j = (q . k_j) * shape.scale(), p = softmax(scores) with the max subtracted, and
  //   out = sum_j p_j v_j. Query head h reads kv head h / shape.group_size() (grouped-query attention).
  //   q, k, v, out are fp32 with rows strides[0] elements apart; head h is columns [h*D, (h+1)*D).
  // Hint: do every dot product, exponential and sum in double: the oracle's own error is then far
  //   below what any test measures.
  // Hint: batch.q_begin(b) / batch.k_begin(b) are the first rows of sequence b in q and in k, v.
  // Tests: Attention07Cpu.SingleTokenReturnsItsValueExactly Attention07Cpu.ZeroQueryGivesTheRunningMeanOfV
  // Tests: Attention07Cpu.TwoTokensByHand Attention07Cpu.TheFutureDoesNotChangeThePast
  // Tests: Attention07Cpu.GroupedQueryHeadsReadTheirGroupsKvHead Attention07Cpu.SequencesInABatchDoNotSeeEachOther
  // Tests: Attention07Cpu.HugeScoresStayFinite Attention07Cpu.QueriesAfterEarlierKeysMatchTheDefinition
  // Tests: Attention07Cpu.ChunkedPrefillEqualsOnePrefill Attention07Cpu.DecodeStepSeesEveryKey
  // Tests: Attention07Cpu.StridedViewsIntoAFusedQkvBuffer lesson07_attention.cpu
  // Stub:
  //   (void)out, (void)q, (void)k, (void)v, (void)batch, (void)shape;
  //   throw NotWrittenYet("07.1", "the reference, one query at a time");
  // --- solution ---
  const int64_t D = shape.head_dim;
  const int64_t group = shape.group_size();
  const double scale = shape.scale();
  // Rows are strides[0] elements apart (views into a fused QKV buffer have wider rows than they show).
  const int64_t q_ld = q.strides[0], k_ld = k.strides[0], v_ld = v.strides[0], o_ld = out.strides[0];
  const float* Q = q.ptr<const float>();  // [T_q, n_heads*D]
  const float* K = k.ptr<const float>();  // [T_k, n_kv*D]
  const float* V = v.ptr<const float>();  // [T_k, n_kv*D]
  float* O = out.ptr<float>();            // [T_q, n_heads*D]

  std::vector<double> p;    // the scores, then the probabilities, of one query
  std::vector<double> acc;  // [D]  sum_j p_j v_j of one query
  for (int b = 0; b < batch.batch_size(); ++b) {
    const int64_t q_begin = batch.q_begin(b), q_len = batch.q_len(b);
    const int64_t k_begin = batch.k_begin(b), k_len = batch.k_len(b);
    for (int64_t h = 0; h < shape.n_heads; ++h) {
      const int64_t kvh = h / group;  // grouped-query attention: `group` query heads share one kv head
      for (int64_t i = 0; i < q_len; ++i) {
        // The queries are the last q_len of the k_len tokens: query i sits at this position and sees
        // the keys j = first..pos (the causal mask: the future does not exist yet; a sliding window
        // also hides what lies `window` or more positions back).
        const int64_t pos = k_len - q_len + i;
        const int64_t first = shape.first_key(pos);
        const float* qi = Q + (q_begin + i) * q_ld + h * D;
        p.assign(static_cast<size_t>(pos + 1), 0.0);  // entries before `first` stay 0: never read
        double max_score = -INFINITY;
        for (int64_t j = first; j <= pos; ++j) {
          const float* kj = K + (k_begin + j) * k_ld + kvh * D;
          double dot = 0.0;
          for (int64_t d = 0; d < D; ++d) dot += static_cast<double>(qi[d]) * kj[d];
          p[j] = dot * scale;
          max_score = std::max(max_score, p[j]);
        }
        double sum = 0.0;
        for (int64_t j = first; j <= pos; ++j) {
          p[j] = std::exp(p[j] - max_score);
          sum += p[j];
        }
        acc.assign(static_cast<size_t>(D), 0.0);
        for (int64_t j = first; j <= pos; ++j) {
          const float* vj = V + (k_begin + j) * v_ld + kvh * D;
          for (int64_t d = 0; d < D; ++d) acc[d] += p[j] * vj[d];
        }
        float* oi = O + (q_begin + i) * o_ld + h * D;
        for (int64_t d = 0; d < D; ++d) oi[d] = static_cast<float>(acc[d] / sum);
      }
    }
  }
  // --- end of exercise 07.1 ---
}

}  // namespace tvllm
