// Lesson 14, CPU: the GEMV references against lesson 06's linear() and plain loops, their rounding rules
// on hand-made cases where the rule changes the answer, the launch shape's independence of M, and the
// argument checks.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/errors.h"
#include "common/random.h"
#include "gemv.h"
#include "matmul.h"
#include "model_config.h"
#include "rope.h"
#include "rmsnorm.h"
#include "silu_mul.h"

namespace tvllm {
namespace {

Tensor host(const std::vector<float>& v, Shape shape, DType dtype = DType::F32) {
  return Tensor::from_f32(v, std::move(shape), dtype, Device::CPU);
}

float bf16r(float v) { return bf16_to_f32(f32_to_bf16(v)); }

std::vector<float> bf16_exact(std::vector<float> v) {
  for (float& x : v) x = bf16r(x);
  return v;
}

TEST(Gemv14Cpu, KnownProductByHand) {
  // x = [[1, 2, 3]], W = [[1, 0, -1], [2, 1, 0]]: out = [1 - 3, 2 + 2] = [-2, 4].
  Tensor x = host({1, 2, 3}, {1, 3}, DType::BF16), w = host({1, 0, -1, 2, 1, 0}, {2, 3}, DType::BF16);
  Tensor out = Tensor::empty({1, 2}, DType::F32, Device::CPU);
  gemv(out, x, w);
  EXPECT_EQ(to_f32_vector(out), (std::vector<float>{-2, 4}));
}

TEST(Gemv14Cpu, EqualsLessonSixLinearBitForBit) {
  // Both sum in double and round once to fp32: the same value, every element.
  const int64_t M = 5, K = 72, N = 33;
  const auto xv = bf16_exact(random_uniform(M * K, 1)), wv = bf16_exact(random_normal(N * K, 2, 0.1f));
  Tensor y_lin = Tensor::empty({M, N}, DType::F32, Device::CPU), y = Tensor::empty({M, N}, DType::F32, Device::CPU);
  linear(y_lin, host(xv, {M, K}), host(wv, {N, K}));
  gemv(y, host(xv, {M, K}, DType::BF16), host(wv, {N, K}, DType::BF16));
  EXPECT_EQ(to_f32_vector(y), to_f32_vector(y_lin));
  // A BF16 out is the fp32 result rounded once more.
  Tensor yb = Tensor::empty({M, N}, DType::BF16, Device::CPU);
  gemv(yb, host(xv, {M, K}), host(wv, {N, K}));
  const auto f = to_f32_vector(y), b = to_f32_vector(yb);
  for (size_t i = 0; i < f.size(); ++i) EXPECT_EQ(b[i], bf16r(f[i])) << i;
}

TEST(Gemv14Cpu, RowsDoNotDependOnTheBatch) {
  const int64_t M = 7, K = 40, N = 9;
  const auto xv = random_uniform(M * K, 3), wv = random_normal(N * K, 4);
  Tensor all = Tensor::empty({M, N}, DType::F32, Device::CPU);
  gemv(all, host(xv, {M, K}), host(wv, {N, K}));
  const auto a = to_f32_vector(all);
  for (int64_t m = 0; m < M; ++m) {
    Tensor one = Tensor::empty({1, N}, DType::F32, Device::CPU);
    gemv(one, host(std::vector<float>(xv.begin() + m * K, xv.begin() + (m + 1) * K), {1, K}), host(wv, {N, K}));
    EXPECT_EQ(to_f32_vector(one), std::vector<float>(a.begin() + m * N, a.begin() + (m + 1) * N)) << m;
  }
}

TEST(Gemv14Cpu, RmsNormGemvEqualsLessonFourNormRoundedToBf16ThenGemv) {
  // The fused reference normalises as lesson 04's bf16 kernel rounds: bf16(bf16(h * inv_rms) * g). Build
  // that from lesson 04's fp32 reference with a weight of ones (which gives exactly float(h * inv_rms)).
  const int64_t M = 3, K = 48, N = 11;
  const float eps = 1e-5f;
  const auto hv = bf16_exact(random_uniform(M * K, 5, -2.f, 2.f));
  const auto gv = bf16_exact(random_uniform(K, 6, 0.5f, 1.5f));
  const auto wv = bf16_exact(random_normal(N * K, 7, 0.2f));
  Tensor normed = Tensor::empty({M, K}, DType::F32, Device::CPU);
  rmsnorm_cpu(normed, host(hv, {M, K}), host(std::vector<float>(K, 1.f), {K}), eps);
  std::vector<float> xv = to_f32_vector(normed);
  for (int64_t i = 0; i < M * K; ++i) xv[i] = bf16r(bf16r(xv[i]) * gv[i % K]);
  Tensor expected = Tensor::empty({M, N}, DType::F32, Device::CPU), got = Tensor::empty({M, N}, DType::F32, Device::CPU);
  gemv(expected, host(xv, {M, K}), host(wv, {N, K}));
  rmsnorm_gemv(got, host(hv, {M, K}, DType::BF16), host(gv, {K}, DType::BF16), eps, host(wv, {N, K}, DType::BF16));
  EXPECT_EQ(to_f32_vector(got), to_f32_vector(expected));
}

TEST(Gemv14Cpu, RmsNormGemvKnownAnswer) {
  // h = [3, 4, 0, 0] (K = 4): mean square = 25 / 4, rms = 2.5; h / rms = [1.2, 1.6, 0, 0], which bf16
  // rounds to [1.203125, 1.6015625] (7 fraction bits); g = 1. W = [[1, 1, 0, 0]]: out = 2.8046875.
  Tensor out = Tensor::empty({1, 1}, DType::F32, Device::CPU);
  rmsnorm_gemv(out, host({3, 4, 0, 0}, {1, 4}), host({1, 1, 1, 1}, {4}), 0.f, host({1, 1, 0, 0}, {1, 4}));
  EXPECT_EQ(to_f32_vector(out)[0], 1.203125f + 1.6015625f);
}

TEST(Gemv14Cpu, SiluMulKnownAnswerRoundsGateUpAndActToBf16) {
  // h = [1, 1, 1, 1]: rms = 1, x = h. Gate row sums to 1 + 2^-8 (not a bf16: rounds to 1, ties to even),
  // up row to 3. act = bf16(silu(1)) * 3; silu(1) = 0.7310586 -> bf16 0.73046875.
  const float tiny = 1.0f / 256;
  Tensor act = Tensor::empty({1, 1}, DType::F32, Device::CPU);
  rmsnorm_gemv_silu_mul(act, host({1, 1, 1, 1}, {1, 4}), host({1, 1, 1, 1}, {4}), 0.f,
                        host({1, tiny, 0, 0, 1, 1, 1, 0}, {2, 4}));
  EXPECT_EQ(to_f32_vector(act)[0], 0.73046875f * 3.f);
  EXPECT_EQ(bf16r(silu_f32(1.f)), 0.73046875f);
}

TEST(Gemv14Cpu, SiluMulEqualsGemvThenLessonEightRule) {
  const int64_t M = 2, K = 32, I = 13;
  const float eps = 1e-6f;
  const auto hv = bf16_exact(random_uniform(M * K, 8)), gv = bf16_exact(random_uniform(K, 9, 0.5f, 1.5f));
  const auto wv = bf16_exact(random_normal(2 * I * K, 10, 0.3f));
  Tensor gate_up = Tensor::empty({M, 2 * I}, DType::F32, Device::CPU);
  rmsnorm_gemv(gate_up, host(hv, {M, K}), host(gv, {K}), eps, host(wv, {2 * I, K}));
  const auto gu = to_f32_vector(gate_up);
  Tensor act = Tensor::empty({M, I}, DType::BF16, Device::CPU);
  rmsnorm_gemv_silu_mul(act, host(hv, {M, K}), host(gv, {K}), eps, host(wv, {2 * I, K}));
  const auto a = to_f32_vector(act);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < I; ++j) {
      const float gate = bf16r(gu[m * 2 * I + j]), up = bf16r(gu[m * 2 * I + I + j]);
      EXPECT_EQ(a[m * I + j], bf16r(bf16r(silu_f32(gate)) * up)) << m << "," << j;
    }
}

TEST(Gemv14Cpu, ResidualAddsTheProductRoundedToBf16First) {
  // x = [1, 1], W = [[1, 2^-8]]: the product 1 + 2^-8 is a bf16 tie and rounds to 1 (even). h = 0.5:
  // h + 1 = 1.5 exactly; adding the unrounded product would give 1.50390625.
  Tensor h = host({0.5f}, {1, 1});
  gemv_residual(h, host({1, 1}, {1, 2}), host({1, 1.0f / 256}, {1, 2}));
  EXPECT_EQ(to_f32_vector(h)[0], 1.5f);
  // BF16 h: the sum is rounded again: 256 + 1 = 257 is not a bf16 (8 significant bits): ties to 256.
  Tensor hb = host({256.f}, {1, 1}, DType::BF16);
  gemv_residual(hb, host({1, 1}, {1, 2}), host({1, 1.0f / 256}, {1, 2}));
  EXPECT_EQ(to_f32_vector(hb)[0], 256.f);
}

TEST(Gemv14Cpu, ResidualEqualsGemvPlusH) {
  const int64_t M = 4, K = 24, N = 10;
  const auto xv = random_uniform(M * K, 11), wv = random_normal(N * K, 12), hv = random_uniform(M * N, 13);
  Tensor p = Tensor::empty({M, N}, DType::F32, Device::CPU);
  gemv(p, host(xv, {M, K}), host(wv, {N, K}));
  Tensor h = host(hv, {M, N});
  gemv_residual(h, host(xv, {M, K}), host(wv, {N, K}));
  const auto pv = to_f32_vector(p), got = to_f32_vector(h);
  for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i], hv[i] + bf16r(pv[i])) << i;
}

TEST(Gemv14Cpu, V3ShapeDependsOnNAndKOnly) {
  const GemvV3Shape s = gemv_v3_shape(2048, 2048);
  EXPECT_EQ(s.threads, 256);  // 2048 / 8 = 256 packs: one per thread
  EXPECT_EQ(s.rows_per_block, 4);
  EXPECT_EQ(s.blocks, 512);
  const GemvV3Shape small = gemv_v3_shape(77, 640);
  EXPECT_EQ(small.threads, 96);  // 80 packs -> 3 warps
  EXPECT_EQ(small.rows_per_block, 1);
  EXPECT_EQ(small.blocks, 77);
  EXPECT_EQ(gemv_v3_shape(1, 8).threads, 32);
  EXPECT_EQ(gemv_v3_shape(128256, 2048).blocks, 128256 / 4);
}

TEST(Gemv14Cpu, SupportedNeedsKMultipleOfEightAndAlignedRows) {
  alignas(16) static uint16_t buf[64] = {};
  auto view = [&](int offset, Shape shape) {
    return TensorView::contiguous(buf + offset, DType::BF16, Device::CPU, std::move(shape));
  };
  EXPECT_TRUE(gemv_supported(view(0, {1, 16}), view(0, {2, 16})));
  EXPECT_FALSE(gemv_supported(view(0, {1, 12}), view(0, {2, 12})));  // K % 8 != 0
  EXPECT_FALSE(gemv_supported(view(1, {1, 16}), view(0, {2, 16})));  // x 2 bytes off
  EXPECT_FALSE(gemv_supported(view(0, {1, 16}), view(4, {2, 16})));  // w 8 bytes off
}

TEST(Gemv14Cpu, NamesAndBytes) {
  for (GemvKernel k : all_gemv_kernels()) EXPECT_EQ(parse_gemv_kernel(gemv_kernel_name(k)), k);
  EXPECT_EQ(parse_gemv_kernel("v4"), GemvKernel::V4TensorCore);
  EXPECT_THROW(parse_gemv_kernel("v5"), InputError);
  EXPECT_EQ(gemv_bytes_moved(1, 8192, 2048, DType::BF16), 2 * 8192 * 2048 + 2 * 2048 + 2 * 8192);
  EXPECT_EQ(gemv_bytes_moved(2, 10, 8, DType::F32), 2 * 10 * 8 + 2 * 2 * 8 + 4 * 2 * 10);
}

// rmsnorm_gemv_rope on the CPU: q and k heads rotated by each row's position, v's heads as rmsnorm_gemv leaves
// them; at position 0 (cos 1, sin 0) every head is rmsnorm_gemv's bf16 output. Head_dim 4, one q, one k and one v
// head (N = 12), K = 8.
TEST(Gemv14Cpu, RmsNormGemvRopeRotatesQAndKOnly) {
  const int64_t K = 8, N = 12, M = 2;
  const std::vector<float> hv = bf16_exact(random_uniform(M * K, 5));
  const std::vector<float> wv = bf16_exact(random_normal(N * K, 6, 0.5f));
  Tensor h = host(hv, {M, K}, DType::BF16), w = host(wv, {N, K}, DType::BF16);
  Tensor g = host(std::vector<float>(K, 1.f), {K}, DType::BF16);
  ModelConfig config;
  config.model_type = "llama";
  config.head_dim = 4;
  config.num_attention_heads = 1;
  config.num_key_value_heads = 1;
  config.rope_theta = 10000.0;
  config.max_position_embeddings = 64;
  const RopeTable table = RopeTable::build(config);
  Tensor plain = Tensor::empty({M, N}, DType::BF16, Device::CPU);
  rmsnorm_gemv(plain, h, g, 1e-5f, w);
  const std::vector<float> y = to_f32_vector(plain);
  Tensor positions = Tensor::from_i32({0, 7}, {M}, Device::CPU);
  Tensor qkv = Tensor::empty({M, N}, DType::BF16, Device::CPU);
  rmsnorm_gemv_rope(qkv, h, g, 1e-5f, w, {}, positions, table, 1, 1);
  const std::vector<float> got = to_f32_vector(qkv);
  for (int64_t n = 0; n < N; ++n) EXPECT_EQ(got[n], y[n]) << "row 0 (position 0), column " << n;
  for (int64_t n = 8; n < N; ++n) EXPECT_EQ(got[N + n], y[N + n]) << "row 1, v column " << n;
  // Row 1, position 7: pair (j, j + 2) of the q head (columns 0..3) and of the k head (4..7), lesson 05's rule.
  const std::vector<float> cos = to_f32_vector(table.cos(Device::CPU)), sin = to_f32_vector(table.sin(Device::CPU));
  for (int64_t head = 0; head < 2; ++head)
    for (int64_t j = 0; j < 2; ++j) {
      const float a = y[N + head * 4 + j], b = y[N + head * 4 + j + 2];
      const float c = cos[7 * 2 + j], s = sin[7 * 2 + j];
      const float a_mul_c = a * c, b_mul_s = b * s, b_mul_c = b * c, a_mul_s = a * s;  // no FMA: separate roundings
      EXPECT_EQ(got[N + head * 4 + j], bf16r(a_mul_c - b_mul_s)) << "head " << head << " j " << j;
      EXPECT_EQ(got[N + head * 4 + j + 2], bf16r(b_mul_c + a_mul_s)) << "head " << head << " j " << j;
    }
  // Refused: heads that do not fit, an N that is not whole heads, positions of the wrong type or length.
  EXPECT_THROW(rmsnorm_gemv_rope(qkv, h, g, 1e-5f, w, {}, positions, table, 2, 2), InputError);
  EXPECT_THROW(rmsnorm_gemv_rope(qkv, h, g, 1e-5f, w, {}, positions, table, 1, 0), InputError);
  Tensor w10 = host(std::vector<float>(10 * K, 1.f), {10, K}, DType::BF16);
  Tensor qkv10 = Tensor::empty({M, 10}, DType::BF16, Device::CPU);
  EXPECT_THROW(rmsnorm_gemv_rope(qkv10, h, g, 1e-5f, w10, {}, positions, table, 1, 1), InputError);
  Tensor positions3 = Tensor::from_i32({0, 1, 2}, {3}, Device::CPU);
  EXPECT_THROW(rmsnorm_gemv_rope(qkv, h, g, 1e-5f, w, {}, positions3, table, 1, 1), InputError);
  EXPECT_THROW(rmsnorm_gemv_rope(qkv, h, g, 1e-5f, w, {}, host({0, 7}, {M}), table, 1, 1), InputError);
}

TEST(Gemv14Cpu, BadArgumentsThrowInputError) {
  Tensor x = host(std::vector<float>(17 * 8, 1.f), {17, 8}), w = host(std::vector<float>(3 * 8, 1.f), {3, 8});
  Tensor out17 = Tensor::empty({17, 3}, DType::F32, Device::CPU);
  EXPECT_THROW(gemv(out17, x, w), InputError);  // M > kGemvMaxRows
  Tensor x2 = host(std::vector<float>(2 * 8, 1.f), {2, 8}), w7 = host(std::vector<float>(3 * 7, 1.f), {3, 7});
  Tensor out = Tensor::empty({2, 3}, DType::F32, Device::CPU);
  EXPECT_THROW(gemv(out, x2, w7), InputError);  // K differs
  Tensor out_wrong = Tensor::empty({2, 4}, DType::F32, Device::CPU);
  EXPECT_THROW(gemv(out_wrong, x2, w), InputError);
  EXPECT_THROW(gemv(x2.view().rows(0, 1).reshape({1, 8}), x2, w), InputError);  // shape, and overlaps x
  Tensor g = host(std::vector<float>(8, 1.f), {8});
  EXPECT_THROW(rmsnorm_gemv(out, x2, g, -1.f, w), InputError);                              // eps < 0
  EXPECT_THROW(rmsnorm_gemv(out, x2, host({1, 1}, {2}), 1e-5f, w), InputError);             // norm_weight
  Tensor act = Tensor::empty({2, 1}, DType::F32, Device::CPU);
  EXPECT_THROW(rmsnorm_gemv_silu_mul(act, x2, g, 1e-5f, w), InputError);  // 3 rows: not gate | up
  Tensor same = host(std::vector<float>(2 * 8, 0.f), {2, 8});
  EXPECT_THROW(gemv_residual(same, same, host(std::vector<float>(64, 1.f), {8, 8})), InputError);  // h is x
  Tensor i32 = Tensor::from_i32(std::vector<int32_t>(16, 1), {2, 8}, Device::CPU);
  EXPECT_THROW(gemv(out, i32, w), InputError);
  // M = 0 is nothing to do.
  Tensor x0 = Tensor::empty({0, 8}, DType::F32, Device::CPU), out0 = Tensor::empty({0, 3}, DType::F32, Device::CPU);
  EXPECT_NO_THROW(gemv(out0, x0, w));
}

}  // namespace
}  // namespace tvllm
