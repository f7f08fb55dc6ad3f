// Lesson 05, CPU: the frequencies (with Llama 3 scaling), the table, the fp32 reference rotation, the
// Meta <-> Hugging Face layout permutation, and argument checking.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <numbers>
#include <vector>

#include "common/errors.h"
#include "common/random.h"
#include "common/tensor.h"
#include "rope.h"

namespace tvllm {
namespace {

constexpr double kTwoPi = 2.0 * std::numbers::pi;

ModelConfig rope_config(int64_t head_dim, double theta, int64_t max_positions = 2048) {
  ModelConfig c;
  c.model_type = "llama";
  c.head_dim = head_dim;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.hidden_size = 4 * head_dim;
  c.rope_theta = theta;
  c.max_position_embeddings = max_positions;
  return c;
}

// Llama 3.2 1B's RoPE: head_dim 64, theta 500000, llama3 scaling (factor 32, 1, 4, 8192).
ModelConfig llama32_1b_config() {
  ModelConfig c = rope_config(64, 500000.0, 131072);
  c.num_attention_heads = 32;
  c.num_key_value_heads = 8;
  c.rope_scaling.rope_type = "llama3";
  c.rope_scaling.factor = 32.0;
  c.rope_scaling.low_freq_factor = 1.0;
  c.rope_scaling.high_freq_factor = 4.0;
  c.rope_scaling.original_max_position_embeddings = 8192;
  return c;
}

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// x in place, fp32 on the host: Tensor wrappers for a few lines of test code.
Tensor f32(const std::vector<float>& v, Shape shape) { return Tensor::from_f32(v, std::move(shape), DType::F32, Device::CPU); }
Tensor i32(const std::vector<int32_t>& v) {
  return Tensor::from_i32(v, {static_cast<int64_t>(v.size())}, Device::CPU);
}
std::vector<float> values(const Tensor& t) { return to_f32_vector(t.view()); }

// ---- frequencies ---------------------------------------------------------------------------------

TEST(RopeFrequencies, DefaultIsThePowerLaw) {
  // theta_j = base^(-2j/d): pair 0 turns one radian per position, the last pair almost not at all.
  const ModelConfig c = rope_config(64, 10000.0);
  const std::vector<float> inv = rope_inv_freq(c);
  ASSERT_EQ(inv.size(), 32u);
  EXPECT_EQ(inv[0], 1.0f);
  for (int j = 0; j < 32; ++j) {
    const double exact = std::pow(10000.0, -2.0 * j / 64.0);
    // three fp32 roundings (exponent, power, reciprocal): well under 2^-22 relative
    EXPECT_NEAR(inv[j], exact, exact * std::ldexp(1.0, -22)) << "j = " << j;
  }
}

TEST(RopeFrequencies, Llama32MatchesHuggingFaceBitForBit) {
  // LlamaRotaryEmbedding(config).inv_freq of transformers 5.x for Llama 3.2 1B's config, as fp32 bit
  // patterns. Bit-for-bit equality matters: at position 100,000 one ulp of theta_j moves the angle by
  // up to ~6e-3 radians, far more than any rounding in the rotation itself.
  const uint32_t hf[32] = {
      0x3f800000, 0x3f29e1c6, 0x3ee177bc, 0x3e959ee3, 0x3e4693b0, 0x3e03c6a0, 0x3daee4ad, 0x3d681e67,
      0x3d1a08c8, 0x3ccc6f49, 0x3c87a9c3, 0x3c340d6d, 0x3beef74f, 0x3b9e9402, 0x3b527720, 0x3aa9279b,
      0x39e13620, 0x38cb98f7, 0x37a3418d, 0x3758ac81, 0x370fc8f8, 0x36bed4f4, 0x367d45c3, 0x3628126b,
      0x35df10c4, 0x359406cb, 0x35447610, 0x35025f34, 0x34ad07a7, 0x3465a54d, 0x341864a7, 0x33ca41b0};
  const std::vector<float> inv = rope_inv_freq(llama32_1b_config());
  ASSERT_EQ(inv.size(), 32u);
  for (int j = 0; j < 32; ++j) EXPECT_EQ(bits(inv[j]), hf[j]) << "j = " << j << ": " << inv[j];
}

TEST(RopeFrequencies, Llama3ScalingKeepsHighDividesLowAndBlendsBetween) {
  const ModelConfig scaled_config = llama32_1b_config();
  ModelConfig plain_config = scaled_config;
  plain_config.rope_scaling = RopeScaling{};  // "default": no scaling
  const std::vector<float> plain = rope_inv_freq(plain_config);
  const std::vector<float> scaled = rope_inv_freq(scaled_config);
  ASSERT_EQ(plain.size(), scaled.size());

  const double factor = 32.0, low = 1.0, high = 4.0, old_len = 8192.0;
  int kept = 0, divided = 0, blended = 0;
  for (size_t j = 0; j < plain.size(); ++j) {
    const double theta = plain[j];
    const double wavelen = kTwoPi / theta;  // positions per full turn
    if (wavelen < old_len / high) {
      // fast pairs (short wavelength): untouched, bit for bit
      EXPECT_EQ(bits(scaled[j]), bits(plain[j])) << "j = " << j;
      ++kept;
    } else if (wavelen > old_len / low) {
      // slow pairs: turn `factor` times slower (one fp32 division)
      EXPECT_NEAR(scaled[j], theta / factor, theta / factor * std::ldexp(1.0, -23)) << "j = " << j;
      ++divided;
    } else {
      // the band between: s goes from 0 (at wavelen = old/low) to 1 (at wavelen = old/high)
      const double s = (old_len / wavelen - low) / (high - low);
      ASSERT_GE(s, 0.0);
      ASSERT_LE(s, 1.0);
      const double expected = (1.0 - s) * theta / factor + s * theta;
      // fp32 evaluation: s carries ~1e-7 absolute error, which near s = 0 is amplified by up to
      // factor - 1 relative to the small result: 2e-5 relative covers it.
      EXPECT_NEAR(scaled[j], expected, expected * 2e-5) << "j = " << j;
      EXPECT_LT(scaled[j], plain[j]);
      EXPECT_GT(scaled[j], plain[j] / factor);
      ++blended;
    }
  }
  // Llama 3.2 1B's head_dim 64 has pairs in all three bands; the test must exercise each.
  EXPECT_GT(kept, 0);
  EXPECT_GT(divided, 0);
  EXPECT_GT(blended, 0);
  for (size_t j = 1; j < scaled.size(); ++j) EXPECT_LT(scaled[j], scaled[j - 1]) << "frequencies must fall with j";
}

// ---- the table -----------------------------------------------------------------------------------

TEST(RopeTable, HoldsCosSinOfTheFp32Angle) {
  const ModelConfig c = rope_config(16, 10000.0);
  const RopeTable t = RopeTable::build(c, 100);
  EXPECT_EQ(t.head_dim(), 16);
  EXPECT_EQ(t.max_positions(), 100);
  EXPECT_EQ(t.attention_scaling(), 1.0f);
  ASSERT_EQ(t.cos(Device::CPU).shape, (Shape{100, 8}));
  ASSERT_EQ(t.sin(Device::CPU).shape, (Shape{100, 8}));
  const float* cs = t.cos(Device::CPU).ptr<float>();
  const float* sn = t.sin(Device::CPU).ptr<float>();
  for (int j = 0; j < 8; ++j) {
    EXPECT_EQ(cs[j], 1.0f);  // position 0: no rotation
    EXPECT_EQ(sn[j], 0.0f);
  }
  for (int p = 0; p < 100; ++p)
    for (int j = 0; j < 8; ++j) {
      const double angle = static_cast<float>(p) * t.inv_freq()[j];  // the fp32 product, then widened
      EXPECT_EQ(cs[p * 8 + j], static_cast<float>(std::cos(angle)));
      EXPECT_EQ(sn[p * 8 + j], static_cast<float>(std::sin(angle)));
    }
  // Without a GPU upload, asking for the device copy is a clear error, not a null pointer.
  EXPECT_THROW(t.cos(Device::CUDA), InputError);
}

TEST(RopeTable, Llama32ValuesMatchHuggingFace) {
  // cos/sin from LlamaRotaryEmbedding (transformers 5.x, CPU) at a few positions, up to the 128k context.
  // torch's fp32 cos/sin are within an ulp of the correctly rounded value we store: <= 2^-23 apart.
  struct Known { int pos, j; double cos, sin; };
  const Known known[] = {
      {1, 0, 0.540302336, 0.841470957},           {1, 31, 1.0, 9.41830649e-08},
      {1000, 5, -0.993055403, 0.117647767},       {1000, 17, 0.995291173, 0.0969304293},
      {100000, 0, -0.9993608, 0.0357487984},      {100000, 17, -0.960079968, -0.279725641},
      {131071, 5, -0.999625623, 0.0273599587},    {131071, 31, 0.999923825, 0.0123443548},
  };
  const RopeTable t = RopeTable::build(llama32_1b_config());  // 131072 positions
  ASSERT_EQ(t.max_positions(), 131072);
  const float* cs = t.cos(Device::CPU).ptr<float>();
  const float* sn = t.sin(Device::CPU).ptr<float>();
  for (const Known& k : known) {
    EXPECT_NEAR(cs[k.pos * 32 + k.j], k.cos, std::ldexp(1.0, -23)) << "pos " << k.pos << " j " << k.j;
    EXPECT_NEAR(sn[k.pos * 32 + k.j], k.sin, std::ldexp(1.0, -23)) << "pos " << k.pos << " j " << k.j;
  }
}

// ---- the rotation --------------------------------------------------------------------------------

TEST(RopeCpu, KnownValuesByHand) {
  // head_dim 4, theta 100: theta_0 = 1, theta_1 = 100^(-1/2) = 0.1. Pairs (x0, x2) and (x1, x3).
  // q = [1, 2, 3, 4] at position 1 (angles 1 and 0.1):
  //   q0' = 1 cos 1 - 3 sin 1 = 0.5403023 - 2.5244129 = -1.9841106
  //   q2' = 3 cos 1 + 1 sin 1 = 1.6209069 + 0.8414710 =  2.4623779
  //   q1' = 2 cos .1 - 4 sin .1 = 1.9900083 - 0.3993337 = 1.5906747
  //   q3' = 4 cos .1 + 2 sin .1 = 3.9800167 + 0.1996668 = 4.1796835
  // and at position 2 (angles 2 and 0.2) likewise. Hugging Face's apply_rotary_pos_emb gives the same.
  ModelConfig c = rope_config(4, 100.0, 16);
  const RopeTable table = RopeTable::build(c);
  Tensor q = f32({1, 2, 3, 4, 1, 2, 3, 4}, {2, 4});
  Tensor k = f32({0.5f, -1, 2, 0.25f, 0.5f, -1, 2, 0.25f}, {2, 4});
  apply_rope(q, k, i32({1, 2}), table);
  const std::vector<float> q_expected = {-1.9841106f, 1.5906746f, 2.4623780f, 4.1796837f,
                                         -3.1440389f, 1.1654558f, -0.3391431f, 4.3176050f};
  const std::vector<float> k_expected = {-1.4127908f, -1.0199625f, 1.5013402f, 0.1489176f,
                                         -2.0266683f, -1.0297339f, -0.3776450f, 0.0463473f};
  const std::vector<float> qv = values(q), kv = values(k);
  for (int i = 0; i < 8; ++i) {
    EXPECT_NEAR(qv[i], q_expected[i], 1e-6) << "q[" << i << "]";
    EXPECT_NEAR(kv[i], k_expected[i], 1e-6) << "k[" << i << "]";
  }
}

TEST(RopeCpu, PositionZeroIsTheIdentity) {
  const ModelConfig c = rope_config(64, 500000.0);
  const RopeTable table = RopeTable::build(c, 8);
  const std::vector<float> q0 = random_normal(5 * 6 * 64, 11), k0 = random_normal(5 * 2 * 64, 12);
  Tensor q = f32(q0, {5, 6 * 64}), k = f32(k0, {5, 2 * 64});
  apply_rope(q, k, i32({0, 0, 0, 0, 0}), table);
  EXPECT_EQ(values(q), q0);  // cos 0 = 1 and sin 0 = 0 exactly: a*1 - b*0 == a, bit for bit
  EXPECT_EQ(values(k), k0);
}

TEST(RopeCpu, RotationPreservesTheNormOfEveryPair) {
  const ModelConfig c = llama32_1b_config();
  const RopeTable table = RopeTable::build(c);
  const int T = 64, H = 3, D = 64, half = 32;
  const std::vector<float> q0 = random_normal(T * H * D, 21), k0 = random_normal(T * 1 * D, 22);
  std::vector<int32_t> pos(T);
  Rng rng(23);
  for (int t = 0; t < T; ++t) pos[t] = static_cast<int32_t>(rng.below(131072));
  pos[0] = 131071;  // the very last position of the table
  Tensor q = f32(q0, {T, H * D}), k = f32(k0, {T, D});
  apply_rope(q, k, i32(pos), table);
  const std::vector<float> q1 = values(q);
  bool any_moved = false;
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < H; ++h)
      for (int j = 0; j < half; ++j) {
        const size_t a = static_cast<size_t>((t * H + h) * D + j), b = a + half;
        const double before = std::hypot(q0[a], q0[b]), after = std::hypot(q1[a], q1[b]);
        // cos^2 + sin^2 = 1 to ~2^-23; four products and a sum each round by 2^-24
        EXPECT_NEAR(after, before, 1e-6 * before + 1e-30) << "t " << t << " h " << h << " j " << j;
        any_moved = any_moved || q1[a] != q0[a];
      }
  EXPECT_TRUE(any_moved);
}

// q at position m and k at position n: their dot product depends on m - n only.
TEST(RopeCpu, ScoresDependOnlyOnRelativePosition) {
  const ModelConfig c = llama32_1b_config();
  const RopeTable table = RopeTable::build(c, 4096);
  const int D = 64;
  const std::vector<float> q0 = random_normal(D, 31), k0 = random_normal(D, 32);
  auto score = [&](int m, int n) {
    Tensor q = f32(q0, {1, D}), k = f32(k0, {1, D});
    apply_rope(q.view(), k.view(), i32({m}).view(), table);  // q at m (k rotated too, ignored)
    Tensor q2 = f32(q0, {1, D}), k2 = f32(k0, {1, D});
    apply_rope(q2.view(), k2.view(), i32({n}).view(), table);  // k at n
    const std::vector<float> a = values(q), b = values(k2);
    double s = 0;
    for (int i = 0; i < D; ++i) s += static_cast<double>(a[i]) * b[i];
    return s;
  };
  double norm = 0;  // |q||k|: the scale of any score
  {
    double nq = 0, nk = 0;
    for (int i = 0; i < D; ++i) nq += q0[i] * q0[i], nk += k0[i] * k0[i];
    norm = std::sqrt(nq * nk);
  }
  const int offsets[][2] = {{5, 0}, {17, 3}, {100, 100}, {0, 9}, {250, 1}};
  for (const auto& mn : offsets) {
    const double s0 = score(mn[0], mn[1]);
    for (int shift : {1, 7, 300, 1000}) {
      // The fp32 angle m*theta is rounded: ~2^-24 * 1250 = 7e-5 rad at these positions, so scores agree
      // to ~1e-4 |q||k|; a wrong pairing or sign would be off by O(|q||k|).
      EXPECT_NEAR(score(mn[0] + shift, mn[1] + shift), s0, 1e-3 * norm)
          << "m " << mn[0] << " n " << mn[1] << " shift " << shift;
    }
  }
  // ...and it does depend on m - n (otherwise the test above proves nothing): a random score is
  // ~|q||k|/sqrt(D), and rotating k by 1000 positions more changes it by that much.
  EXPECT_GT(std::fabs(score(5, 0) - score(5, 1000)), 1e-2 * norm);
  EXPECT_GT(std::fabs(score(17, 3) - score(3, 17)), 1e-3 * norm);
}

TEST(RopeCpu, ArbitraryPositionsEqualOneTokenAtATime) {
  // Decode rotates one token at a time at its own position; a batch may hold any positions in any order.
  const ModelConfig c = rope_config(64, 500000.0, 4096);
  const RopeTable table = RopeTable::build(c);
  const std::vector<int32_t> pos = {7, 0, 4095, 3, 7};
  const int T = 5, QD = 6 * 64, KD = 2 * 64;
  const std::vector<float> q0 = random_normal(T * QD, 41), k0 = random_normal(T * KD, 42);
  Tensor q = f32(q0, {T, QD}), k = f32(k0, {T, KD});
  apply_rope(q, k, i32(pos), table);
  const std::vector<float> qb = values(q), kb = values(k);
  for (int t = 0; t < T; ++t) {
    Tensor q1 = f32(std::vector<float>(q0.begin() + t * QD, q0.begin() + (t + 1) * QD), {1, QD});
    Tensor k1 = f32(std::vector<float>(k0.begin() + t * KD, k0.begin() + (t + 1) * KD), {1, KD});
    apply_rope(q1, k1, i32({pos[t]}), table);
    EXPECT_EQ(values(q1), std::vector<float>(qb.begin() + t * QD, qb.begin() + (t + 1) * QD)) << "token " << t;
    EXPECT_EQ(values(k1), std::vector<float>(kb.begin() + t * KD, kb.begin() + (t + 1) * KD)) << "token " << t;
  }
}

TEST(RopeCpu, StridedRowsOfAFusedQkvBuffer) {
  // q and k as column ranges of one [T, q_dim + 2*kv_dim] buffer (a fused qkv projection): same result
  // as separate tensors, and v untouched.
  const ModelConfig c = rope_config(8, 10000.0, 64);
  const RopeTable table = RopeTable::build(c);
  const int T = 3, QD = 3 * 8, KD = 1 * 8, W = QD + 2 * KD;
  const std::vector<float> qkv0 = random_normal(T * W, 51);
  const std::vector<int32_t> pos = {2, 9, 63};
  Tensor qkv = f32(qkv0, {T, W});
  float* base = qkv.view().ptr<float>();
  TensorView qv{base, DType::F32, Device::CPU, {T, QD}, {W, 1}};
  TensorView kv{base + QD, DType::F32, Device::CPU, {T, KD}, {W, 1}};
  apply_rope(qv, kv, i32(pos), table);

  std::vector<float> q_sep, k_sep;
  for (int t = 0; t < T; ++t) {
    q_sep.insert(q_sep.end(), qkv0.begin() + t * W, qkv0.begin() + t * W + QD);
    k_sep.insert(k_sep.end(), qkv0.begin() + t * W + QD, qkv0.begin() + t * W + QD + KD);
  }
  Tensor q = f32(q_sep, {T, QD}), k = f32(k_sep, {T, KD});
  apply_rope(q, k, i32(pos), table);
  const std::vector<float> fused = values(qkv), qs = values(q), ks = values(k);
  for (int t = 0; t < T; ++t) {
    for (int i = 0; i < QD; ++i) EXPECT_EQ(fused[t * W + i], qs[t * QD + i]);
    for (int i = 0; i < KD; ++i) EXPECT_EQ(fused[t * W + QD + i], ks[t * KD + i]);
    for (int i = QD + KD; i < W; ++i) EXPECT_EQ(fused[t * W + i], qkv0[t * W + i]) << "v was touched";
  }
}

TEST(RopeCpu, NoTokensIsANoOp) {
  const RopeTable table = RopeTable::build(rope_config(8, 10000.0, 4));
  Tensor q = Tensor::empty({0, 16}, DType::F32, Device::CPU), k = Tensor::empty({0, 8}, DType::F32, Device::CPU);
  EXPECT_NO_THROW(apply_rope(q, k, Tensor::empty({0}, DType::I32, Device::CPU), table));
}

// ---- Meta's interleaved layout vs Hugging Face's rotate-half layout -------------------------------

TEST(RopeLayout, IndexMaps) {
  // head_dim 8: Meta's dimensions 0 2 4 6 are the first members of pairs 0..3 and land in HF's first
  // half; 1 3 5 7 in the second half.
  const int64_t hf_of_meta[8] = {0, 4, 1, 5, 2, 6, 3, 7};
  for (int64_t d = 0; d < 8; ++d) {
    EXPECT_EQ(rotate_half_index(d, 8), hf_of_meta[d]);
    EXPECT_EQ(interleaved_index(hf_of_meta[d], 8), d);
  }
}

TEST(RopeLayout, PermutingTheWeightsCommutesWithRope) {
  // W_meta: a q_proj weight in Meta's layout. W_hf = permute_qk_rows(W_meta). Then for any x:
  //   rope_rotate_half(x W_hf^T) == permute(rope_interleaved(x W_meta^T))
  // i.e. Hugging Face's checkpoint with rotate-half RoPE IS Meta's model with interleaved RoPE.
  const int H = 3, D = 8, hidden = 10, T = 4;
  const ModelConfig c = rope_config(D, 10000.0, 32);
  const RopeTable table = RopeTable::build(c);
  const std::vector<float> w_meta = random_normal(H * D * hidden, 61), x = random_normal(T * hidden, 62);
  Tensor wm = f32(w_meta, {H * D, hidden});
  Tensor wh = Tensor::empty({H * D, hidden}, DType::F32, Device::CPU);
  permute_qk_rows(wh, wm, D, QkLayout::Interleaved, QkLayout::RotateHalf);

  auto project = [&](const Tensor& w) {  // x W^T, [T, H*D]
    const float* wp = w.view().ptr<float>();
    std::vector<float> y(T * H * D);
    for (int t = 0; t < T; ++t)
      for (int o = 0; o < H * D; ++o) {
        float s = 0.f;
        for (int i = 0; i < hidden; ++i) s += x[t * hidden + i] * wp[o * hidden + i];
        y[t * H * D + o] = s;
      }
    return y;
  };
  const std::vector<int32_t> pos = {0, 5, 31, 2};
  Tensor q_meta = f32(project(wm), {T, H * D});
  Tensor q_hf = f32(project(wh), {T, H * D});
  apply_rope_interleaved_cpu(q_meta, i32(pos), table);
  Tensor unused = Tensor::from_f32(std::vector<float>(T * D, 0.f), {T, D}, DType::F32, Device::CPU);
  apply_rope(q_hf, unused, i32(pos), table);

  const std::vector<float> meta = values(q_meta), hf = values(q_hf);
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < H; ++h)
      for (int d = 0; d < D; ++d) {
        // Same dot products (same order), same angle, same arithmetic: equal bit for bit.
        EXPECT_EQ(hf[(t * H + h) * D + rotate_half_index(d, D)], meta[(t * H + h) * D + d])
            << "t " << t << " h " << h << " d " << d;
      }
}

TEST(RopeLayout, RoundTripRestoresTheBytesForAnyDtype) {
  const int rows = 2 * 6, cols = 5;  // 2 heads of head_dim 6
  Tensor w = Tensor::from_f32(random_normal(rows * cols, 71), {rows, cols}, DType::BF16, Device::CPU);
  Tensor hf = Tensor::empty({rows, cols}, DType::BF16, Device::CPU);
  Tensor back = Tensor::empty({rows, cols}, DType::BF16, Device::CPU);
  permute_qk_rows(hf, w, 6, QkLayout::Interleaved, QkLayout::RotateHalf);
  permute_qk_rows(back, hf, 6, QkLayout::RotateHalf, QkLayout::Interleaved);
  EXPECT_EQ(std::memcmp(back.data(), w.data(), w.view().nbytes()), 0);
  EXPECT_NE(std::memcmp(hf.data(), w.data(), w.view().nbytes()), 0);
  // Row 1 of Meta's head 0 (pair 0, second member) is row 3 (= half + 0) in Hugging Face's layout.
  EXPECT_EQ(std::memcmp(static_cast<char*>(hf.data()) + 3 * cols * 2, static_cast<char*>(w.data()) + 1 * cols * 2,
                        cols * 2),
            0);
  // A weight that is not a whole number of heads is rejected.
  Tensor odd = Tensor::empty({7, cols}, DType::BF16, Device::CPU), odd2 = Tensor::empty({7, cols}, DType::BF16, Device::CPU);
  EXPECT_THROW(permute_qk_rows(odd2, odd, 6, QkLayout::Interleaved, QkLayout::RotateHalf), InputError);
}

// ---- bad input -----------------------------------------------------------------------------------

TEST(RopeErrors, BadConfigsAreRejected) {
  ModelConfig odd = rope_config(63, 10000.0);
  EXPECT_THROW(rope_inv_freq(odd), InputError);
  ModelConfig yarn = llama32_1b_config();
  yarn.rope_scaling.rope_type = "yarn";
  EXPECT_THROW(rope_inv_freq(yarn), InputError);
  ModelConfig flat = llama32_1b_config();
  flat.rope_scaling.high_freq_factor = flat.rope_scaling.low_freq_factor;  // the blend would divide by 0
  EXPECT_THROW(rope_inv_freq(flat), InputError);
  ModelConfig no_theta = rope_config(64, 0.0);
  EXPECT_THROW(rope_inv_freq(no_theta), InputError);
  EXPECT_THROW(RopeTable::build(rope_config(64, 10000.0), -1), InputError);
  EXPECT_THROW(RopeTable::build(rope_config(64, 10000.0), (int64_t{1} << 24) + 1), InputError);
  EXPECT_THROW(parse_rope_kernel("v9"), InputError);
  EXPECT_EQ(parse_rope_kernel("v3"), RopeKernel::V3);
}

TEST(RopeErrors, BadArgumentsAreRejected) {
  const RopeTable table = RopeTable::build(rope_config(8, 10000.0, 16));
  auto q = [] { return Tensor::from_f32(std::vector<float>(2 * 16, 1.f), {2, 16}, DType::F32, Device::CPU); };
  auto k = [] { return Tensor::from_f32(std::vector<float>(2 * 8, 1.f), {2, 8}, DType::F32, Device::CPU); };
  const Tensor qq = q(), kk = k();
  EXPECT_NO_THROW(apply_rope(qq, kk, i32({0, 15}), table));

  EXPECT_THROW(apply_rope(q(), k(), i32({0, 16}), table), InputError);   // past the table
  EXPECT_THROW(apply_rope(q(), k(), i32({-1, 0}), table), InputError);   // negative
  // Trusted changes nothing on the CPU: the reference always checks (it costs nothing there).
  EXPECT_THROW(apply_rope(q(), k(), i32({0, 16}), table, kDefaultRopeKernel, PositionCheck::Trusted), InputError);
  EXPECT_THROW(apply_rope(q(), k(), i32({0}), table), InputError);       // 1 position, 2 tokens
  EXPECT_THROW(apply_rope(q(), k(), Tensor::from_f32({0, 1}, {2}, DType::F32, Device::CPU), table), InputError);
  Tensor bf16 = Tensor::from_f32(std::vector<float>(2 * 16, 1.f), {2, 16}, DType::BF16, Device::CPU);
  EXPECT_THROW(apply_rope(bf16, k(), i32({0, 1}), table), InputError);  // the CPU path is fp32
  Tensor ragged = Tensor::from_f32(std::vector<float>(2 * 12, 1.f), {2, 12}, DType::F32, Device::CPU);
  EXPECT_THROW(apply_rope(ragged, k(), i32({0, 1}), table), InputError);  // 12 is not heads * 8
  Tensor three = Tensor::from_f32(std::vector<float>(3 * 8, 1.f), {3, 8}, DType::F32, Device::CPU);
  EXPECT_THROW(apply_rope(q(), three, i32({0, 1}), table), InputError);   // k has 3 rows
  EXPECT_THROW(apply_rope(qq, qq, i32({0, 1}), table), InputError);       // q and k the same memory
  // A column-strided view (a transposed tensor) is not a row of contiguous heads.
  TensorView transposed{qq.data(), DType::F32, Device::CPU, {2, 16}, {1, 2}};
  EXPECT_THROW(apply_rope(transposed, kk, i32({0, 1}), table), InputError);
  EXPECT_THROW(apply_rope(qq, kk, i32({0, 1}), RopeTable{}), InputError);  // an empty table
}

}  // namespace
}  // namespace tvllm
