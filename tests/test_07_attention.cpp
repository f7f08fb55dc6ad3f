// Lesson 07 on the CPU: the reference attention against answers worked out by hand and properties that
// any correct causal GQA attention has; and the argument checks at the API boundary.
#include <gtest/gtest.h>

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

// Runs the CPU reference on host vectors; returns out [T, q_dim].
std::vector<float> run_cpu(const Inputs& in, const std::vector<int64_t>& lengths, const AttentionShape& s) {
  VarlenBatch batch = VarlenBatch::from_lengths(lengths, Device::CPU);
  const int64_t T = batch.total_tokens();
  Tensor q = Tensor::from_f32(in.q, {T, s.q_dim()}, DType::F32, Device::CPU);
  Tensor k = Tensor::from_f32(in.k, {T, s.kv_dim()}, DType::F32, Device::CPU);
  Tensor v = Tensor::from_f32(in.v, {T, s.kv_dim()}, DType::F32, Device::CPU);
  Tensor out = Tensor::empty({T, s.q_dim()}, DType::F32, Device::CPU);
  std::vector<float> nan(static_cast<size_t>(T * s.q_dim()), NAN);  // poison
  std::copy(nan.begin(), nan.end(), out.view().ptr<float>());
  attention_prefill(out, q, k, v, batch, s);
  return to_f32_vector(out);
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

TEST(Attention07Cpu, VarlenBatchFromLengths) {
  VarlenBatch b = VarlenBatch::from_lengths({3, 0, 5}, Device::CPU);
  EXPECT_EQ(b.cu_seqlens(), (std::vector<int32_t>{0, 3, 3, 8}));
  EXPECT_EQ(b.batch_size(), 3);
  EXPECT_EQ(b.total_tokens(), 8);
  EXPECT_EQ(b.max_seqlen(), 5);
  EXPECT_EQ(b.seq_begin(2), 3);
  EXPECT_EQ(b.seq_len(1), 0);
  EXPECT_EQ(b.cu_seqlens_device(), nullptr);
}

TEST(Attention07Cpu, CuSeqlensValidation) {
  expect_input_error([] { VarlenBatch::from_cu_seqlens({}, Device::CPU); }, "B+1 >= 2");
  expect_input_error([] { VarlenBatch::from_cu_seqlens({0}, Device::CPU); }, "B+1 >= 2");
  expect_input_error([] { VarlenBatch::from_cu_seqlens({1, 4}, Device::CPU); }, "cu_seqlens[0] must be 0");
  expect_input_error([] { VarlenBatch::from_cu_seqlens({0, 4, 3}, Device::CPU); }, "cu_seqlens[2] = 3 < cu_seqlens[1] = 4");
  expect_input_error([] { VarlenBatch::from_lengths({}, Device::CPU); }, "at least one sequence");
  expect_input_error([] { VarlenBatch::from_lengths({2, -1}, Device::CPU); }, "sequence 1 has negative length");
  expect_input_error([] { VarlenBatch::from_lengths({int64_t{1} << 31}, Device::CPU); }, "2^31-1");
  std::vector<int32_t> too_many(static_cast<size_t>(VarlenBatch::kMaxSequences) + 2, 0);
  expect_input_error([&] { VarlenBatch::from_cu_seqlens(too_many, Device::CPU); }, "at most 65535 sequences");
}

TEST(Attention07Cpu, ArgumentValidation) {
  const AttentionShape s{4, 2, 8};
  VarlenBatch batch = VarlenBatch::from_lengths({2, 3}, Device::CPU);
  Tensor q = Tensor::empty({5, 32}, DType::F32, Device::CPU);
  Tensor kv = Tensor::empty({5, 16}, DType::F32, Device::CPU);
  Tensor out = Tensor::empty({5, 32}, DType::F32, Device::CPU);
  // the happy path first, so the failures below are about the one thing each changes
  EXPECT_NO_THROW(attention_prefill(out, q, kv, kv, batch, s));

  VarlenBatch short_batch = VarlenBatch::from_lengths({2, 2}, Device::CPU);
  expect_input_error([&] { attention_prefill(out, q, kv, kv, short_batch, s); }, "cu_seqlens covers 4 tokens");
  expect_input_error([&] { attention_prefill(out, q, q, kv, batch, s); }, "k must be [5, 16]");
  expect_input_error([&] { attention_prefill(kv, q, kv, kv, batch, s); }, "out must be [5, 32]");
  expect_input_error([&] { attention_prefill(out, q, kv, kv, batch, AttentionShape{4, 3, 8}); },
                     "must be a multiple of n_kv_heads");
  expect_input_error([&] { attention_prefill(out, q, kv, kv, batch, AttentionShape{4, 0, 8}); }, "must be positive");
  Tensor q_bf16 = Tensor::empty({5, 32}, DType::BF16, Device::CPU);
  expect_input_error([&] { attention_prefill(out, q_bf16, kv, kv, batch, s); }, "q must be F32 on cpu");
  Tensor q_3d = Tensor::empty({5, 4, 8}, DType::F32, Device::CPU);
  expect_input_error([&] { attention_prefill(out, q_3d, kv, kv, batch, s); }, "q must be [5, 32]");
  expect_input_error([] { parse_attention_kernel("v3"); }, "unknown attention kernel 'v3'");
  EXPECT_EQ(parse_attention_kernel("v1"), AttentionKernel::V1Materialized);
  EXPECT_EQ(parse_attention_kernel("v2"), AttentionKernel::V2Flash);
}

TEST(Attention07Cpu, WorkspaceBytesGrowAsNSquared) {
  const AttentionShape s{32, 8, 64};
  VarlenBatch b = VarlenBatch::from_lengths({8192, 100}, Device::CPU);
  // v1 holds the longest sequence's scores: 32 heads x 8192^2 x 4 bytes = 8 GiB
  EXPECT_EQ(attention_workspace_bytes(AttentionKernel::V1Materialized, b, s), size_t{8} << 30);
  EXPECT_EQ(attention_workspace_bytes(AttentionKernel::V2Flash, b, s), 0u);
}

}  // namespace
}  // namespace tvllm
