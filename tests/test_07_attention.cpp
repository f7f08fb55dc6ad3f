// Lesson 07 on the CPU: the reference attention against answers worked out by hand, an element-by-element
// loop of the definition (queries after earlier keys, decode, empty sequences), strided views into a fused
// QKV buffer, properties any correct causal GQA attention has; the batch layout, the workspace limits and
// the argument checks at the API boundary.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "attention.h"
#include "common/errors.h"
#include "common/random.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

// The reference computes in double and rounds once to fp32: 1e-6 is a few fp32 ulps of values ~1.
constexpr double kExactish = 1e-6;

struct Inputs {
  std::vector<float> q, k, v;  // [T, q_dim], [T, kv_dim], [T, kv_dim]
};

Inputs random_inputs(int64_t T, const AttentionShape& s, uint64_t seed) {
  return {random_normal(static_cast<size_t>(T * s.q_dim()), seed),
          random_normal(static_cast<size_t>(T * s.kv_dim()), seed + 1),
          random_uniform(static_cast<size_t>(T * s.kv_dim()), seed + 2)};
}

// Runs the CPU reference on host vectors (q [sum q_lens, q_dim], k/v [sum k_lens, kv_dim]); returns out.
std::vector<float> run_cpu(const Inputs& in, const std::vector<int64_t>& q_lens, const std::vector<int64_t>& k_lens,
                           const AttentionShape& s) {
  AttentionBatch batch = AttentionBatch::with_lengths(q_lens, k_lens, Device::CPU);
  const int64_t Tq = batch.total_q(), Tk = batch.total_k();
  Tensor q = Tensor::from_f32(in.q, {Tq, s.q_dim()}, DType::F32, Device::CPU);
  Tensor k = Tensor::from_f32(in.k, {Tk, s.kv_dim()}, DType::F32, Device::CPU);
  Tensor v = Tensor::from_f32(in.v, {Tk, s.kv_dim()}, DType::F32, Device::CPU);
  Tensor out = Tensor::empty({Tq, s.q_dim()}, DType::F32, Device::CPU);
  std::fill(out.view().ptr<float>(), out.view().ptr<float>() + Tq * s.q_dim(), NAN);  // poison
  attention(out, q, k, v, batch, s);
  return to_f32_vector(out);
}
// Prefill: every token is a query.
std::vector<float> run_cpu(const Inputs& in, const std::vector<int64_t>& lengths, const AttentionShape& s) {
  return run_cpu(in, lengths, lengths, s);
}

int64_t total(const std::vector<int64_t>& lengths) {
  int64_t t = 0;
  for (int64_t n : lengths) t += n;
  return t;
}

// The definition, element by element, written independently of attention_cpu.cpp: for every query
// (sequence b, index i, head h) the full row of scores over ALL k_len keys of its sequence, the keys
// after its position pos = k_len - q_len + i set to -inf, a softmax over the row, the weighted sum.
std::vector<float> naive_attention(const Inputs& in, const std::vector<int64_t>& q_lens,
                                   const std::vector<int64_t>& k_lens, const AttentionShape& s) {
  std::vector<float> out(static_cast<size_t>(total(q_lens) * s.q_dim()), NAN);
  int64_t q_row = 0, k_row = 0;
  for (size_t b = 0; b < q_lens.size(); ++b) {
    const int64_t nq = q_lens[b], nk = k_lens[b];
    for (int64_t i = 0; i < nq; ++i) {
      for (int64_t h = 0; h < s.n_heads; ++h) {
        const int64_t kvh = h / (s.n_heads / s.n_kv_heads);
        std::vector<double> w(static_cast<size_t>(nk));
        for (int64_t j = 0; j < nk; ++j) {
          double dot = 0.0;
          for (int64_t d = 0; d < s.head_dim; ++d)
            dot += static_cast<double>(in.q[(q_row + i) * s.q_dim() + h * s.head_dim + d]) *
                   in.k[(k_row + j) * s.kv_dim() + kvh * s.head_dim + d];
          const bool visible = j <= nk - nq + i;
          w[j] = visible ? dot / std::sqrt(static_cast<double>(s.head_dim)) : -INFINITY;
        }
        const double m = *std::max_element(w.begin(), w.end());
        double sum = 0.0;
        for (double& x : w) sum += (x = std::exp(x - m));
        for (int64_t d = 0; d < s.head_dim; ++d) {
          double acc = 0.0;
          for (int64_t j = 0; j < nk; ++j) acc += w[j] / sum * in.v[(k_row + j) * s.kv_dim() + kvh * s.head_dim + d];
          out[(q_row + i) * s.q_dim() + h * s.head_dim + d] = static_cast<float>(acc);
        }
      }
    }
    q_row += nq;
    k_row += nk;
  }
  return out;
}

// Random q for the queries and k, v for the keys of a batch with the given lengths.
Inputs random_batch(const std::vector<int64_t>& q_lens, const std::vector<int64_t>& k_lens, const AttentionShape& s,
                    uint64_t seed) {
  return {random_normal(static_cast<size_t>(total(q_lens) * s.q_dim()), seed),
          random_normal(static_cast<size_t>(total(k_lens) * s.kv_dim()), seed + 1),
          random_uniform(static_cast<size_t>(total(k_lens) * s.kv_dim()), seed + 2)};
}

// Expects an InputError whose message contains `needle`.
void expect_input_error(const std::function<void()>& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "expected InputError containing \"" << needle << "\"";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "message: " << e.what();
  }
}

TEST(Attention07Cpu, SingleTokenReturnsItsValueExactly) {
  // One visible key: softmax = [1], the output is that key's value row, bit for bit.
  const AttentionShape s{4, 2, 8};
  const std::vector<int64_t> lengths{1, 1, 1};  // three sequences of one token each
  Inputs in = random_inputs(3, s, 11);
  std::vector<float> out = run_cpu(in, lengths, s);
  for (int64_t t = 0; t < 3; ++t)
    for (int64_t h = 0; h < s.n_heads; ++h)
      for (int64_t d = 0; d < s.head_dim; ++d)
        EXPECT_EQ(out[t * s.q_dim() + h * s.head_dim + d], in.v[t * s.kv_dim() + (h / 2) * s.head_dim + d])
            << "token " << t << " head " << h << " dim " << d;
}

TEST(Attention07Cpu, ZeroQueryGivesTheRunningMeanOfV) {
  // q = 0: every score is 0, the softmax is uniform over the visible keys, out_i = mean(v_0..v_i).
  const AttentionShape s{2, 1, 4};
  const int64_t T = 7;
  Inputs in = random_inputs(T, s, 21);
  std::fill(in.q.begin(), in.q.end(), 0.f);
  std::vector<float> out = run_cpu(in, {T}, s);
  for (int64_t i = 0; i < T; ++i) {
    for (int64_t d = 0; d < s.head_dim; ++d) {
      double mean = 0.0;
      for (int64_t j = 0; j <= i; ++j) mean += in.v[j * s.kv_dim() + d];
      mean /= static_cast<double>(i + 1);
      for (int64_t h = 0; h < s.n_heads; ++h) EXPECT_NEAR(out[i * s.q_dim() + h * s.head_dim + d], mean, kExactish);
    }
  }
}

TEST(Attention07Cpu, TwoTokensByHand) {
  // head_dim 2, one head, scale 1/sqrt(2).
  //   q0 = (1, 0)  k0 = (1, 0)  v0 = (1,  2)
  //   q1 = (0, 2)  k1 = (1, 1)  v1 = (3, -1)
  // token 0 sees only itself:                  out0 = v0 = (1, 2)
  // token 1: s0 = q1.k0/sqrt2 = 0, s1 = q1.k1/sqrt2 = 2/sqrt2 = sqrt2
  //   p1 = e^sqrt2 / (1 + e^sqrt2) = 1 / (1 + e^-sqrt2) = 1 / 1.2431167 = 0.8044297, p0 = 0.1955703
  //   out1 = p0 v0 + p1 v1 = (0.1955703 + 2.4132890, 0.3911406 - 0.8044297) = (2.6088594, -0.4132890)
  const AttentionShape s{1, 1, 2};
  Inputs in{{1, 0, 0, 2}, {1, 0, 1, 1}, {1, 2, 3, -1}};
  std::vector<float> out = run_cpu(in, {2}, s);
  EXPECT_NEAR(out[0], 1.0, kExactish);
  EXPECT_NEAR(out[1], 2.0, kExactish);
  EXPECT_NEAR(out[2], 2.6088594, 1e-6);
  EXPECT_NEAR(out[3], -0.4132890, 1e-6);
}

TEST(Attention07Cpu, TheFutureDoesNotChangeThePast) {
  const AttentionShape s{4, 2, 8};
  const int64_t T = 9, changed = 5;
  Inputs in = random_inputs(T, s, 31);
  std::vector<float> before = run_cpu(in, {T}, s);
  // Change everything about token 5: its query, key and value.
  for (int64_t c = 0; c < s.q_dim(); ++c) in.q[changed * s.q_dim() + c] += 3.f;
  for (int64_t c = 0; c < s.kv_dim(); ++c) {
    in.k[changed * s.kv_dim() + c] -= 2.f;
    in.v[changed * s.kv_dim() + c] += 5.f;
  }
  std::vector<float> after = run_cpu(in, {T}, s);
  for (int64_t i = 0; i < T; ++i) {
    bool same = true;
    for (int64_t c = 0; c < s.q_dim(); ++c) same = same && before[i * s.q_dim() + c] == after[i * s.q_dim() + c];
    if (i < changed) EXPECT_TRUE(same) << "token " << i << " saw the future token " << changed;
    else EXPECT_FALSE(same) << "token " << i << " should see token " << changed;  // so the test can fail
  }
}

TEST(Attention07Cpu, GroupedQueryHeadsReadTheirGroupsKvHead) {
  // 6 query heads, 2 kv heads (the tiny model's ratio): heads 0-2 read kv head 0, heads 3-5 kv head 1.
  // Keys are built so that kv head 0 attends (almost only) to token 0 and kv head 1 to the newest token:
  // with q = 1 everywhere, score = scale * sum(k) = 0.5 * 4 * 10 = 20 against 0, weight ratio e^-20.
  const AttentionShape s{6, 2, 4};
  const int64_t T = 3;
  Inputs in = random_inputs(T, s, 41);
  std::fill(in.q.begin(), in.q.end(), 1.f);
  for (int64_t j = 0; j < T; ++j) {
    for (int64_t d = 0; d < s.head_dim; ++d) {
      in.k[j * s.kv_dim() + 0 * s.head_dim + d] = j == 0 ? 10.f : 0.f;  // kv head 0: token 0 stands out
      in.k[j * s.kv_dim() + 1 * s.head_dim + d] = j == T - 1 ? 10.f : 0.f;  // kv head 1: the last token
    }
  }
  std::vector<float> out = run_cpu(in, {T}, s);
  const int64_t i = T - 1;  // the last query sees all three tokens
  for (int64_t h = 0; h < s.n_heads; ++h) {
    const int64_t kvh = h / 3;
    const int64_t source = kvh == 0 ? 0 : T - 1;
    for (int64_t d = 0; d < s.head_dim; ++d)
      EXPECT_NEAR(out[i * s.q_dim() + h * s.head_dim + d], in.v[source * s.kv_dim() + kvh * s.head_dim + d], 1e-7)
          << "head " << h << " should read kv head " << kvh;
  }
}

TEST(Attention07Cpu, SequencesInABatchDoNotSeeEachOther) {
  const AttentionShape s{4, 2, 8};
  const std::vector<int64_t> lengths{3, 5, 1};
  Inputs in = random_inputs(9, s, 51);
  std::vector<float> batched = run_cpu(in, lengths, s);
  int64_t begin = 0;
  for (int64_t n : lengths) {
    Inputs alone{{in.q.begin() + begin * s.q_dim(), in.q.begin() + (begin + n) * s.q_dim()},
                 {in.k.begin() + begin * s.kv_dim(), in.k.begin() + (begin + n) * s.kv_dim()},
                 {in.v.begin() + begin * s.kv_dim(), in.v.begin() + (begin + n) * s.kv_dim()}};
    std::vector<float> single = run_cpu(alone, {n}, s);
    for (int64_t c = 0; c < n * s.q_dim(); ++c) ASSERT_EQ(batched[begin * s.q_dim() + c], single[c]) << c;
    begin += n;
  }
  // And one batch is not the same as one long sequence (token 3 starts sequence 1: it sees only itself).
  std::vector<float> joined = run_cpu(in, {9}, s);
  bool differs = false;
  for (int64_t c = 3 * s.q_dim(); c < 9 * s.q_dim(); ++c) differs = differs || joined[c] != batched[c];
  EXPECT_TRUE(differs);
}

TEST(Attention07Cpu, EmptySequencesAreAllowed) {
  const AttentionShape s{2, 1, 8};
  Inputs in = random_inputs(4, s, 61);
  std::vector<float> with_empty = run_cpu(in, {0, 4, 0}, s);
  std::vector<float> plain = run_cpu(in, {4}, s);
  EXPECT_EQ(with_empty, plain);
}

TEST(Attention07Cpu, HugeScoresStayFinite) {
  // Scores in the thousands: exp() of them overflows even in double without the max subtraction.
  const AttentionShape s{2, 1, 16};
  const int64_t T = 6;
  Inputs in = random_inputs(T, s, 71);
  for (float& x : in.q) x *= 1000.f;
  std::vector<float> out = run_cpu(in, {T}, s);
  for (float x : out) ASSERT_TRUE(std::isfinite(x));
  // Each output is (to fp32 precision) the value row of the single best key.
  for (int64_t i = 0; i < T; ++i) {
    for (int64_t h = 0; h < s.n_heads; ++h) {
      int64_t best = 0;
      double best_score = -INFINITY;
      for (int64_t j = 0; j <= i; ++j) {
        double dot = 0.0;
        for (int64_t d = 0; d < s.head_dim; ++d)
          dot += static_cast<double>(in.q[i * s.q_dim() + h * s.head_dim + d]) * in.k[j * s.kv_dim() + d];
        if (dot > best_score) best_score = dot, best = j;
      }
      for (int64_t d = 0; d < s.head_dim; ++d)
        EXPECT_NEAR(out[i * s.q_dim() + h * s.head_dim + d], in.v[best * s.kv_dim() + d], 1e-5);
    }
  }
}

TEST(Attention07Cpu, ShapeFromConfigAndScale) {
  const AttentionShape s{32, 8, 64};
  EXPECT_EQ(s.q_dim(), 2048);
  EXPECT_EQ(s.kv_dim(), 512);
  EXPECT_EQ(s.group_size(), 4);
  EXPECT_DOUBLE_EQ(s.scale(), 0.125);
}

// ---- queries after earlier keys: q_len < k_len ------------------------------------------------------

TEST(Attention07Cpu, QueriesAfterEarlierKeysMatchTheDefinition) {
  // A chunk of 3 new queries after 5 earlier tokens, one decode step (1 query after 7), a prefill, an
  // empty sequence with keys but no queries, and a fully empty one: all against the element-wise loop.
  const AttentionShape s{4, 2, 8};
  const std::vector<int64_t> q_lens{3, 1, 4, 0, 0}, k_lens{8, 8, 4, 6, 0};
  const Inputs in = random_batch(q_lens, k_lens, s, 81);
  const std::vector<float> got = run_cpu(in, q_lens, k_lens, s);
  const std::vector<float> want = naive_attention(in, q_lens, k_lens, s);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], kExactish) << "element " << i;
}

TEST(Attention07Cpu, ChunkedPrefillEqualsOnePrefill) {
  // The last 6 queries of a 10-token prompt, attending to all 10 keys, are exactly the last 6 rows of
  // the prefill of the whole prompt (the same arithmetic in the same order: equal bits).
  const AttentionShape s{6, 2, 16};
  const int64_t n = 10, chunk = 6;
  const Inputs whole = random_inputs(n, s, 91);
  const std::vector<float> prefill = run_cpu(whole, {n}, s);
  Inputs tail = whole;
  tail.q.assign(whole.q.begin() + (n - chunk) * s.q_dim(), whole.q.end());
  const std::vector<float> chunked = run_cpu(tail, {chunk}, {n}, s);
  for (int64_t c = 0; c < chunk * s.q_dim(); ++c)
    ASSERT_EQ(chunked[c], prefill[(n - chunk) * s.q_dim() + c]) << "element " << c;
}

TEST(Attention07Cpu, DecodeStepSeesEveryKey) {
  // q_len == 1: the one query sits at position k_len - 1 and sees all keys. With q = 0 every score is
  // 0: the output is the mean of all k_len values (not of the first one, as a top-left mask would give).
  const AttentionShape s{2, 1, 4};
  const std::vector<int64_t> q_lens{1, 1}, k_lens{5, 3};
  Inputs in = random_batch(q_lens, k_lens, s, 101);
  std::fill(in.q.begin(), in.q.end(), 0.f);
  const std::vector<float> out = run_cpu(in, q_lens, k_lens, s);
  int64_t k_row = 0;
  for (size_t b = 0; b < q_lens.size(); ++b) {
    for (int64_t d = 0; d < s.head_dim; ++d) {
      double mean = 0.0;
      for (int64_t j = 0; j < k_lens[b]; ++j) mean += in.v[(k_row + j) * s.kv_dim() + d];
      mean /= static_cast<double>(k_lens[b]);
      for (int64_t h = 0; h < s.n_heads; ++h) EXPECT_NEAR(out[b * s.q_dim() + h * s.head_dim + d], mean, kExactish);
    }
    k_row += k_lens[b];
  }
}

// ---- strided views: q, k, v inside one fused QKV buffer ----------------------------------------------

TEST(Attention07Cpu, StridedViewsIntoAFusedQkvBuffer) {
  // Prefill: q, k, v as column slices of qkv [T, q_dim + 2*kv_dim], out as a slice of a wider buffer.
  // The reference must read and write through the row strides: the same bits as on packed copies.
  const AttentionShape s{4, 2, 8};
  const std::vector<int64_t> lengths{3, 6};
  const int64_t T = 9, W = s.qkv_dim();
  std::vector<float> fused = random_normal(static_cast<size_t>(T * W), 111);
  Tensor qkv = Tensor::from_f32(fused, {T, W}, DType::F32, Device::CPU);
  const QkvViews views = split_qkv(qkv, s);
  EXPECT_EQ(views.q.strides, (Shape{W, 1}));
  EXPECT_EQ(views.k.shape, (Shape{T, s.kv_dim()}));
  EXPECT_EQ(views.v.data, static_cast<float*>(qkv.data()) + s.q_dim() + s.kv_dim());
  Inputs packed;
  for (int64_t t = 0; t < T; ++t) {
    const float* row = fused.data() + t * W;
    packed.q.insert(packed.q.end(), row, row + s.q_dim());
    packed.k.insert(packed.k.end(), row + s.q_dim(), row + s.q_dim() + s.kv_dim());
    packed.v.insert(packed.v.end(), row + s.q_dim() + s.kv_dim(), row + W);
  }
  const std::vector<float> want = run_cpu(packed, lengths, s);

  const int64_t out_width = s.q_dim() + 24;  // out is columns [8, 8 + q_dim) of a wider buffer
  std::vector<float> wide(static_cast<size_t>(T * out_width), -7.f);
  TensorView wide_view = TensorView::contiguous(wide.data(), DType::F32, Device::CPU, {T, out_width});
  const TensorView out = wide_view.columns(8, s.q_dim());
  attention(out, views.q, views.k, views.v, AttentionBatch::prefill(lengths, Device::CPU), s);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t c = 0; c < out_width; ++c) {
      const float got = wide[t * out_width + c];
      if (c < 8 || c >= 8 + s.q_dim()) ASSERT_EQ(got, -7.f) << "row " << t << " col " << c << " written outside out";
      else ASSERT_EQ(got, want[t * s.q_dim() + c - 8]) << "row " << t << " col " << c;
    }
  }
}

TEST(Attention07Cpu, SplitQkvChecks) {
  // (TensorView::columns, underneath, has its own tests in test_common_tensor.cpp.)
  const AttentionShape s{4, 2, 8};
  Tensor qkv = Tensor::empty({3, s.qkv_dim()}, DType::F32, Device::CPU);
  expect_input_error([&] { split_qkv(Tensor::empty({3, 48}, DType::F32, Device::CPU), s); }, "qkv must be [T, 64]");
  const TensorView k = split_qkv(qkv, s).k;
  EXPECT_EQ(k.data, static_cast<float*>(qkv.data()) + 32);
  EXPECT_FALSE(k.is_contiguous());
}

// ---- the batch layout ------------------------------------------------------------------------------

TEST(Attention07Cpu, AttentionBatchLayout) {
  AttentionBatch b = AttentionBatch::with_lengths({3, 0, 1}, {3, 2, 6}, Device::CPU);
  EXPECT_EQ(b.cu_seqlens_q(), (std::vector<int32_t>{0, 3, 3, 4}));
  EXPECT_EQ(b.cu_seqlens_k(), (std::vector<int32_t>{0, 3, 5, 11}));
  EXPECT_EQ(b.batch_size(), 3);
  EXPECT_EQ(b.total_q(), 4);
  EXPECT_EQ(b.total_k(), 11);
  EXPECT_EQ(b.max_q_len(), 3);
  EXPECT_EQ(b.max_k_len(), 6);
  EXPECT_EQ(b.q_begin(2), 3);
  EXPECT_EQ(b.k_begin(2), 5);
  EXPECT_EQ(b.q_len(1), 0);
  EXPECT_EQ(b.k_len(1), 2);
  EXPECT_EQ(b.cu_seqlens_q_device(), nullptr);
  EXPECT_EQ(b.cu_seqlens_k_device(), nullptr);
  // Prefill: the two arrays are equal.
  AttentionBatch p = AttentionBatch::prefill({3, 0, 5}, Device::CPU);
  EXPECT_EQ(p.cu_seqlens_q(), (std::vector<int32_t>{0, 3, 3, 8}));
  EXPECT_EQ(p.cu_seqlens_k(), p.cu_seqlens_q());
}

TEST(Attention07Cpu, AttentionBatchIsRefilledWithinItsCapacity) {
  AttentionBatch b(4, Device::CPU);
  EXPECT_EQ(b.capacity(), 4);
  EXPECT_EQ(b.batch_size(), 0);
  b.set_prefill({5, 7});
  const int32_t* where = b.cu_seqlens_q().data();
  b.set_lengths({1, 1, 1, 1}, {9, 3, 4, 1});  // a decode step of 4 sequences: no reallocation
  EXPECT_EQ(b.cu_seqlens_q().data(), where);
  EXPECT_EQ(b.total_q(), 4);
  EXPECT_EQ(b.max_k_len(), 9);
  // Beyond the capacity: an error naming it, and the batch is unchanged.
  expect_input_error([&] { b.set_prefill({1, 2, 3, 4, 5}); }, "5 sequences exceed this batch's capacity of 4");
  EXPECT_EQ(b.batch_size(), 4);
  EXPECT_EQ(b.cu_seqlens_k(), (std::vector<int32_t>{0, 9, 12, 16, 17}));
  expect_input_error([] { AttentionBatch(0, Device::CPU); }, "max_sequences must be in [1, 65535]");
  expect_input_error([] { AttentionBatch(65536, Device::CPU); }, "max_sequences must be in [1, 65535]");
  expect_input_error([] { AttentionBatch().set_prefill({1}); }, "capacity of 0");
}

TEST(Attention07Cpu, CuSeqlensValidation) {
  AttentionBatch b(8, Device::CPU);
  expect_input_error([&] { b.set_cu_seqlens({}, {}); }, "cu_seqlens_q needs B+1 >= 2");
  expect_input_error([&] { b.set_cu_seqlens({0}, {0}); }, "cu_seqlens_q needs B+1 >= 2");
  expect_input_error([&] { b.set_cu_seqlens({1, 4}, {0, 4}); }, "cu_seqlens_q[0] must be 0");
  expect_input_error([&] { b.set_cu_seqlens({0, 4}, {2, 4}); }, "cu_seqlens_k[0] must be 0");
  expect_input_error([&] { b.set_cu_seqlens({0, 4, 3}, {0, 4, 5}); },
                     "cu_seqlens_q[2] = 3 < cu_seqlens_q[1] = 4");
  expect_input_error([&] { b.set_cu_seqlens({0, 4}, {0, 4, 5}); }, "cu_seqlens_q has 2 entries but cu_seqlens_k has 3");
  expect_input_error([&] { b.set_cu_seqlens({0, 2, 5}, {0, 2, 4}); }, "sequence 1 has 3 queries but only 2 keys");
  expect_input_error([&] { b.set_lengths({}, {}); }, "at least one sequence");
  expect_input_error([&] { b.set_lengths({1, 2}, {1}); }, "2 query lengths but 1 key lengths");
  expect_input_error([&] { b.set_prefill({2, -1}); }, "sequence 1 has negative query length -1");
  expect_input_error([&] { b.set_prefill({int64_t{1} << 31}); }, "2^31-1");
}

TEST(Attention07Cpu, ArgumentValidation) {
  const AttentionShape s{4, 2, 8};
  AttentionBatch batch = AttentionBatch::with_lengths({2, 3}, {2, 4}, Device::CPU);  // 5 queries, 6 keys
  Tensor q = Tensor::empty({5, 32}, DType::F32, Device::CPU);
  Tensor kv = Tensor::empty({6, 16}, DType::F32, Device::CPU);
  Tensor out = Tensor::empty({5, 32}, DType::F32, Device::CPU);
  // the happy path first, so the failures below are about the one thing each changes
  EXPECT_NO_THROW(attention(out, q, kv, kv, batch, s));

  AttentionBatch short_batch = AttentionBatch::prefill({2, 2}, Device::CPU);
  expect_input_error([&] { attention(out, q, kv, kv, short_batch, s); }, "cu_seqlens_q covers 4 queries");
  AttentionBatch prefill = AttentionBatch::prefill({2, 3}, Device::CPU);
  expect_input_error([&] { attention(out, q, kv, kv, prefill, s); }, "k has 6 rows but cu_seqlens_k covers 5 keys");
  Tensor kv5 = Tensor::empty({5, 16}, DType::F32, Device::CPU);
  expect_input_error([&] { attention(out, q, kv5, kv, batch, s); }, "k has 5 rows but cu_seqlens_k covers 6 keys");
  expect_input_error([&] { attention(out, q, q, kv, batch, s); }, "k has 5 rows");
  expect_input_error([&] { attention(kv, q, kv, kv, batch, s); }, "out must be [5, 32]");
  expect_input_error([&] { attention(out, q, kv, kv, batch, AttentionShape{4, 3, 8}); },
                     "must be a multiple of n_kv_heads");
  expect_input_error([&] { attention(out, q, kv, kv, batch, AttentionShape{4, 0, 8}); }, "must be positive");
  Tensor q_bf16 = Tensor::empty({5, 32}, DType::BF16, Device::CPU);
  expect_input_error([&] { attention(out, q_bf16, kv, kv, batch, s); }, "q must be F32 on cpu");
  Tensor q_3d = Tensor::empty({5, 4, 8}, DType::F32, Device::CPU);
  expect_input_error([&] { attention(out, q_3d, kv, kv, batch, s); }, "q must be [5, 32]");
  // Strides: columns must be contiguous, rows may not overlap.
  TensorView q_cols = q.view();
  q_cols.strides = {32, 2};
  expect_input_error([&] { attention(out, q_cols, kv, kv, batch, s); }, "column stride 1");
  TensorView k_overlap = kv.view();
  k_overlap.strides = {8, 1};
  expect_input_error([&] { attention(out, q, k_overlap, kv, batch, s); }, "rows must be at least 16");
  expect_input_error([] { parse_attention_kernel("v3"); }, "unknown attention kernel 'v3'");
  EXPECT_EQ(parse_attention_kernel("v1"), AttentionKernel::V1Materialized);
  EXPECT_EQ(parse_attention_kernel("v2"), AttentionKernel::V2Flash);
}

// ---- the workspace: sized once from limits ---------------------------------------------------------

TEST(Attention07Cpu, WorkspaceBytesGrowAsQueriesTimesKeys) {
  const AttentionShape s{32, 8, 64};
  // v1 holds the largest sequence's scores: 32 heads x 8192 x 8192 x 4 bytes = 8 GiB
  EXPECT_EQ(attention_workspace_bytes(AttentionKernel::V1Materialized, s, {2, 8192, 8192}), size_t{8} << 30);
  // decode (one query per sequence) needs q_len x k_len, not k_len^2: 32 x 1 x 8192 x 4 = 1 MiB
  EXPECT_EQ(attention_workspace_bytes(AttentionKernel::V1Materialized, s, {64, 1, 8192}), size_t{1} << 20);
  EXPECT_EQ(attention_workspace_bytes(AttentionKernel::V2Flash, s, {2, 8192, 8192}), 0u);
}

TEST(Attention07Cpu, WorkspaceLimitsAreNamedWhenExceeded) {
  // A v2 workspace allocates nothing, so it can be made without a GPU; check() is what attention() runs.
  const AttentionShape s{4, 2, 8};
  AttentionWorkspace ws(s, AttentionLimits{2, 4, 16}, AttentionKernel::V2Flash);
  EXPECT_EQ(ws.scratch_bytes(), 0u);
  EXPECT_NO_THROW(ws.check(AttentionBatch::with_lengths({4, 1}, {16, 9}, Device::CPU), s, AttentionKernel::V2Flash));
  expect_input_error([&] { ws.check(AttentionBatch::prefill({1, 1, 1}, Device::CPU), s, AttentionKernel::V2Flash); },
                     "max_sequences = 2");
  expect_input_error([&] { ws.check(AttentionBatch::prefill({5}, Device::CPU), s, AttentionKernel::V2Flash); },
                     "max_q_len = 4");
  expect_input_error(
      [&] { ws.check(AttentionBatch::with_lengths({1}, {17}, Device::CPU), s, AttentionKernel::V2Flash); },
      "max_k_len = 16");
  expect_input_error([&] { ws.check(AttentionBatch::prefill({1}, Device::CPU), AttentionShape{4, 1, 8},
                                    AttentionKernel::V2Flash); },
                     "made for 4/2 heads of 8 dims");
  expect_input_error(
      [&] { ws.check(AttentionBatch::prefill({1}, Device::CPU), s, AttentionKernel::V1Materialized); },
      "made for v2");
  expect_input_error([&] { AttentionWorkspace(s, AttentionLimits{1, 8, 4}, AttentionKernel::V2Flash); },
                     "max_q_len <= max_k_len");
  expect_input_error([&] { AttentionWorkspace(s, AttentionLimits{1, 4, 8}, AttentionKernel::V1Materialized); },
                     "needs a CublasHandle");
}

TEST(Attention07Cpu, FlashHeadDims) {
  for (int64_t d : {8, 40, 64, 72, 80, 96, 112, 128, 136, 160, 192, 256}) EXPECT_TRUE(flash_supports_head_dim(d)) << d;
  for (int64_t d : {0, 4, 60, 100, 264, 512}) EXPECT_FALSE(flash_supports_head_dim(d)) << d;
  EXPECT_EQ(flash_path(64), "tensor cores, 64-wide tiles");
  EXPECT_EQ(flash_path(96), "tensor cores, 128-wide tiles (head_dim 96 zero-padded)");
  EXPECT_EQ(flash_path(40), "tensor cores, 64-wide tiles (head_dim 40 zero-padded)");
  EXPECT_NE(flash_path(192).find("CUDA cores"), std::string::npos);
}

// The fresh-prefill seam (attention.h): which batches count as fresh, and that CPU views never reach a kernel.
TEST(Attention07Cpu, FreshPrefillIsEveryKeyANewQuery) {
  EXPECT_TRUE(is_fresh_prefill(AttentionBatch::prefill({5, 1, 3}, Device::CPU)));
  EXPECT_FALSE(is_fresh_prefill(AttentionBatch::prefill({1, 1}, Device::CPU)));  // decode-sized: never
  EXPECT_FALSE(is_fresh_prefill(AttentionBatch::with_lengths({4, 2}, {4, 9}, Device::CPU)));  // a cached prefix
  EXPECT_FALSE(is_fresh_prefill(AttentionBatch::with_lengths({4}, {5}, Device::CPU)));
  EXPECT_TRUE(is_fresh_prefill(AttentionBatch::with_lengths({4, 0}, {4, 0}, Device::CPU)));
}

int g_fresh_calls = 0;
bool counting_fresh_prefill(const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                            const AttentionBatch&, const AttentionShape&, cudaStream_t) {
  ++g_fresh_calls;
  return true;
}

TEST(Attention07Cpu, TheFreshPrefillSeamTakesOnlyGpuSteps) {
  const AttentionShape s{2, 1, 8};
  const AttentionBatch batch = AttentionBatch::prefill({3}, Device::CPU);
  Tensor q = Tensor::empty({3, 16}, DType::F32, Device::CPU), k = Tensor::empty({3, 8}, DType::F32, Device::CPU);
  Tensor v = Tensor::empty({3, 8}, DType::F32, Device::CPU), out = Tensor::empty({3, 16}, DType::F32, Device::CPU);
  EXPECT_EQ(installed_fresh_prefill(), nullptr);
  EXPECT_FALSE(try_fresh_prefill(out, q, k, v, batch, s, nullptr));  // nothing installed
  install_fresh_prefill(counting_fresh_prefill);
  EXPECT_EQ(installed_fresh_prefill(), &counting_fresh_prefill);
  EXPECT_FALSE(try_fresh_prefill(out, q, k, v, batch, s, nullptr));  // CPU views: the backend's own reference
  EXPECT_EQ(g_fresh_calls, 0);
  install_fresh_prefill(nullptr);
  EXPECT_EQ(installed_fresh_prefill(), nullptr);
}

}  // namespace
}  // namespace tvllm
