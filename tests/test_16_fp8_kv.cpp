// Lesson 16's FP8 KV cache on the CPU (the reference the GPU is checked against): the rounding of a write against
// lesson 16's own E4M3 encoder (an oracle independent of cuda_fp8.h), the pool's bytes and dtype, attention over
// an FP8 pool against attention over the fp32 pool within a derived bound, the engine with --kv-cache-dtype fp8
// against each request alone, and the CLI's refusals.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/errors.h"
#include "common/random.h"
#include "engine.h"
#include "engine_bench.h"
#include "engine_check.h"
#include "engine_paged.h"
#include "accuracy.h"
#include "fp8.h"
#include "model_dir.h"
#include "model_weights.h"
#include "paged_kv.h"
#include "testing/engine_fixture.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

const AttentionShape kShape{6, 2, 16};

// What an element reads back as, from lesson 16's encoder: e4m3(x * (1 / s)) decoded, times s.
float oracle_round(float x, float scale) { return fp8_e4m3_to_f32(f32_to_fp8_e4m3(x * (1.0f / scale))) * scale; }

TEST(Fp8Kv16, RoundingMatchesTheLessonsEncoderOnEveryKindOfValue) {
  // Normal values, ties, subnormals, values past 448 (saturate), zeros of both signs, at scales 1, 0.37 and 8.
  std::vector<float> xs = random_normal(4000, 7, 3.0f);
  for (float x : {0.0f, -0.0f, 448.0f, 449.0f, 464.0f, 465.0f, 1e6f, -1e6f, 0.001953125f, 0.0009765625f,
                  0.00146484375f, 1.0625f, 1.1875f, -2.3e-4f, 17.0f, 300.0f})
    xs.push_back(x);
  for (float scale : {1.0f, 0.37f, 8.0f}) {
    for (float x : xs) {
      const float got = kv_fp8_round(x, scale), want = oracle_round(x, scale);
      ASSERT_EQ(got, want) << "x " << x << " scale " << scale;
      ASSERT_LE(std::fabs(got), 448.0f * scale * 1.0000001f) << "saturates at 448 * scale";
      // The relative error of a normal E4M3 value is at most 2^-4 (3 stored mantissa bits, round to nearest).
      if (std::fabs(x / scale) >= 0.015625f && std::fabs(x / scale) <= 448.0f) {
        ASSERT_LE(std::fabs(got - x), std::fabs(x) * 0.0625f) << x;
      }
    }
  }
}

TEST(Fp8Kv16, PoolBytesHalveOnCudaAndTheCpuPoolNamesWhatItHolds) {
  EXPECT_EQ(PagedKvPool::bytes_per_block(kShape, 2, 16, Device::CUDA, KvCacheDtype::FP8) * 2,
            PagedKvPool::bytes_per_block(kShape, 2, 16, Device::CUDA, KvCacheDtype::BF16));
  EXPECT_EQ(PagedKvPool::bytes_per_block(kShape, 2, 16, Device::CUDA, KvCacheDtype::Auto),
            PagedKvPool::bytes_per_block(kShape, 2, 16, Device::CUDA, KvCacheDtype::BF16));
  PagedKvPool pool(kShape, 2, 5, 16, Device::CPU, KvCacheDtype::FP8);
  EXPECT_TRUE(pool.fp8());
  EXPECT_EQ(pool.dtype(), DType::F32);  // the reference keeps fp32 values (rounded)
  EXPECT_NE(pool.describe().find("E4M3-rounded"), std::string::npos) << pool.describe();
  EXPECT_EQ(pool.quant(1).k_scale, 1.0f);
  pool.set_scales({0.5f, 2.0f}, {1.5f, 0.25f});
  EXPECT_TRUE(pool.quant(1).fp8);
  EXPECT_EQ(pool.quant(1).k_scale, 2.0f);
  EXPECT_EQ(pool.quant(1).v_scale, 0.25f);
  EXPECT_THROW(pool.set_scales({1.0f}, {1.0f}), InputError);                  // one per layer
  EXPECT_THROW(pool.set_scales({1.0f, 0.0f}, {1.0f, 1.0f}), InputError);      // > 0
  EXPECT_THROW(pool.set_scales({1.0f, NAN}, {1.0f, 1.0f}), InputError);       // finite
  EXPECT_FALSE(PagedKvPool(kShape, 1, 2, 16, Device::CPU).quant(0).fp8);
  EXPECT_EQ(parse_kv_cache_dtype("fp8"), KvCacheDtype::FP8);
  EXPECT_EQ(parse_kv_cache_dtype("auto"), KvCacheDtype::Auto);
  EXPECT_THROW(parse_kv_cache_dtype("fp8_e5m2"), InputError);
}

// One layer's pool written by a step of T tokens of one sequence (blocks shuffled), read back.
struct OneSequence {
  int64_t bs = 4, blocks = 12, T = 37;
  std::vector<int32_t> table{7, 2, 11, 0, 5, 9, 3, 1, 10, 4};
  PagedStepTables tables{64, 1, 12, 12, 4, Device::CPU};
  std::vector<int32_t> slots;
  OneSequence() {
    for (int64_t p = 0; p < T; ++p) slots.push_back(static_cast<int32_t>(table[p / bs] * bs + p % bs));
    tables.set(slots, {table});
  }
};

TEST(Fp8Kv16, WriteStoresEveryElementAsTheOracleRoundsIt) {
  OneSequence s;
  const int64_t kv = kShape.kv_dim();
  PagedKvPool pool(kShape, 1, s.blocks, s.bs, Device::CPU, KvCacheDtype::FP8);
  pool.set_scales({0.8f}, {0.05f});
  const std::vector<float> k = random_normal(static_cast<size_t>(s.T * kv), 3, 4.0f);
  const std::vector<float> v = random_normal(k.size(), 4, 0.5f);
  const Tensor kt = Tensor::from_f32(k, {s.T, kv}, DType::F32, Device::CPU);
  const Tensor vt = Tensor::from_f32(v, {s.T, kv}, DType::F32, Device::CPU);
  paged_kv_write(pool.k(0), pool.v(0), kt, vt, s.tables, kShape, nullptr, pool.quant(0));
  for (int64_t t = 0; t < s.T; ++t) {
    for (int64_t c = 0; c < kv; ++c) {
      ASSERT_EQ(pool.k(0).ptr<float>()[s.slots[t] * kv + c], oracle_round(k[t * kv + c], 0.8f)) << t << "," << c;
      ASSERT_EQ(pool.v(0).ptr<float>()[s.slots[t] * kv + c], oracle_round(v[t * kv + c], 0.05f)) << t << "," << c;
    }
  }
  // A quant that does not describe the pool is refused on the device where it would matter (CUDA checks the dtype);
  // a bad scale is refused everywhere.
  EXPECT_THROW(paged_kv_write(pool.k(0), pool.v(0), kt, vt, s.tables, kShape, nullptr, KvQuant{true, 0.0f, 1.0f}),
               InputError);
}

// The bound of the attention test. Each key and value element carries a relative error of at most u = 2^-4
// (E4M3's 3 mantissa bits; the keys here stay in E4M3's normal range at scale 1 or are tiny enough that the
// absolute error 2^-10 of a subnormal is negligible). A score s = q.k / sqrt(d) then moves by at most
// u * sum|q_i k_i| / sqrt(d) =: e_s; softmax weights move by a factor within exp(+-2 e_s), so sum p_j v_j moves by at
// most (exp(2 e_s) - 1) max|v| from the weights plus u max|v| from the values. The test evaluates that bound per
// query from the data (not a guessed constant) and checks the observed difference is below it, and also that the
// typical difference is far below (the errors are not all one-sided: a bound met with equality would mean a bug).
TEST(Fp8Kv16, AttentionOverAnFp8PoolStaysWithinTheDerivedBound) {
  OneSequence s;
  const int64_t kv = kShape.kv_dim(), D = kShape.head_dim;
  PagedKvPool exact(kShape, 1, s.blocks, s.bs, Device::CPU), fp8(kShape, 1, s.blocks, s.bs, Device::CPU,
                                                                   KvCacheDtype::FP8);
  const std::vector<float> k = random_normal(static_cast<size_t>(s.T * kv), 5, 1.5f);
  const std::vector<float> v = random_normal(k.size(), 6, 1.0f);
  const Tensor kt = Tensor::from_f32(k, {s.T, kv}, DType::F32, Device::CPU);
  const Tensor vt = Tensor::from_f32(v, {s.T, kv}, DType::F32, Device::CPU);
  paged_kv_write(exact.k(0), exact.v(0), kt, vt, s.tables, kShape, nullptr, exact.quant(0));
  paged_kv_write(fp8.k(0), fp8.v(0), kt, vt, s.tables, kShape, nullptr, fp8.quant(0));
  const std::vector<float> q = random_normal(static_cast<size_t>(s.T * kShape.q_dim()), 8, 1.0f);
  const Tensor qt = Tensor::from_f32(q, {s.T, kShape.q_dim()}, DType::F32, Device::CPU);
  AttentionBatch batch(1, Device::CPU);
  batch.set_lengths({s.T}, {s.T});  // a whole prompt: every query attends over the pool (prefill reference)
  Tensor want = Tensor::empty({s.T, kShape.q_dim()}, DType::F32, Device::CPU);
  Tensor got = Tensor::empty({s.T, kShape.q_dim()}, DType::F32, Device::CPU);
  paged_attention(want, qt, exact.k(0), exact.v(0), batch, s.tables, kShape, nullptr);
  paged_attention(got, qt, fp8.k(0), fp8.v(0), batch, s.tables, kShape, nullptr, nullptr, DecodeAttention::Split,
                  fp8.quant(0));
  const double u = 0.0625;
  double max_v = 0;
  for (float x : v) max_v = std::max(max_v, static_cast<double>(std::fabs(x)));
  double sum_diff = 0;
  int64_t n = 0;
  for (int64_t i = 0; i < s.T; ++i) {
    for (int64_t h = 0; h < kShape.n_heads; ++h) {
      const int64_t kvh = h / kShape.group_size();
      double e_s = 0;  // the largest score error over the keys this query sees
      for (int64_t j = 0; j <= i; ++j) {
        double a = 0;
        for (int64_t d = 0; d < D; ++d)
          a += std::fabs(static_cast<double>(q[i * kShape.q_dim() + h * D + d]) * k[j * kv + kvh * D + d]);
        e_s = std::max(e_s, u * a / std::sqrt(static_cast<double>(D)));
      }
      const double bound = (std::exp(2 * e_s) - 1) * max_v + u * max_v + 1e-5;
      for (int64_t d = 0; d < D; ++d) {
        const int64_t at = i * kShape.q_dim() + h * D + d;
        const double diff = std::fabs(static_cast<double>(got.view().ptr<float>()[at]) - want.view().ptr<float>()[at]);
        ASSERT_LE(diff, bound) << "query " << i << " head " << h << " dim " << d;
        sum_diff += diff;
        ++n;
      }
    }
  }
  const double mean = sum_diff / static_cast<double>(n);
  EXPECT_GT(mean, 0.0) << "FP8 changed nothing: the pool was not rounded";
  EXPECT_LT(mean, 0.02) << "the typical error of E4M3 keys and values (2^-4 relative, averaging out)";
  // Decode (one query, split reference) over the same FP8 pool agrees with the prefill reference on its last row.
  AttentionBatch one(1, Device::CPU);
  one.set_lengths({1}, {s.T});
  PagedStepTables last(1, 1, 12, 12, 4, Device::CPU);
  last.set({s.slots.back()}, {s.table});
  const Tensor q_last = Tensor::from_f32(std::vector<float>(q.end() - kShape.q_dim(), q.end()), {1, kShape.q_dim()},
                                         DType::F32, Device::CPU);
  Tensor dec = Tensor::empty({1, kShape.q_dim()}, DType::F32, Device::CPU);
  paged_decode_attention(dec, q_last, fp8.k(0), fp8.v(0), one, last, kShape, 3, nullptr, nullptr,
                         DecodeAttention::Split, fp8.quant(0));
  for (int64_t c = 0; c < kShape.q_dim(); ++c)
    EXPECT_NEAR(dec.view().ptr<float>()[c], got.view().ptr<float>()[(s.T - 1) * kShape.q_dim() + c], 1e-5) << c;
}

// ---- the engine on the bundled model ----------------------------------------------------------------------------

const testing::BundledModel<Device::CPU>& bundled() { return testing::bundled_model<Device::CPU>(); }
constexpr int64_t kMaxContext = 128;

KvFactory fp8_paged(int64_t num_blocks, bool prefix_caching) {
  PagedKvOptions o;
  o.num_blocks = num_blocks;
  o.prefix_caching = prefix_caching;
  o.kv_dtype = KvCacheDtype::FP8;
  return paged_kv(o);
}

TEST(Fp8Kv16, EngineWithFp8KvEqualsEachRequestAloneAndReturnsEveryBlock) {
  // Lesson 11's rule with the FP8 pool: 24 requests at once (chunked prefill, prefill beside decode, a shared
  // prefix for the prefix cache) give every request the ids it gets alone in an engine of one sequence.
  const std::vector<CheckRequest> requests =
      make_check_requests(24, 2, 40, 1, 20, workload_id_high(bundled().w.config), 31, 16, {13});
  Engine engine(bundled().w, testing::engine_config(48, 12, kMaxContext), fp8_paged(12 * 8, true));
  EXPECT_NE(engine.kv().describe().find("E4M3"), std::string::npos) << engine.kv().describe();
  const EngineRunResult all = run_requests(engine, requests);
  ASSERT_TRUE(all.events_ok) << all.events_error;
  EXPECT_GT(engine.stats().kv.prefix_hit_tokens, 0);
  const KvUsage u = engine.kv().usage();
  EXPECT_EQ(u.free_blocks, u.total_blocks);
  int differs_from_bf16 = 0;
  Engine bf16(bundled().w, testing::engine_config(48, 12, kMaxContext), paged_kv());
  const EngineRunResult plain = run_requests(bf16, requests);
  for (size_t i = 0; i < requests.size(); ++i) {
    Engine alone(bundled().w, testing::engine_config(48, 1, kMaxContext), fp8_paged(8, false));
    const EngineRunResult one = run_requests(alone, {requests[i]});
    ASSERT_TRUE(one.events_ok) << one.events_error;
    EXPECT_EQ(all.ids[i], one.ids[0]) << "request " << i;
    differs_from_bf16 += all.ids[i] != plain.ids[i];
  }
  // FP8 KV is not bf16 KV: some greedy continuation of a random prompt may change. Print it, do not assert it
  // (the accuracy table of the chapter measures how much).
  std::printf("FP8 KV engine: %d of %zu requests continue differently from bf16 KV\n", differs_from_bf16,
              requests.size());
}

}  // namespace
}  // namespace tvllm

namespace tvllm {
namespace {

TEST(Fp8Kv16, TeacherForcingThroughThePagedPoolEqualsTheGeneratorAndFp8MovesTheLogitsALittle) {
  // The accuracy table's FP8 KV rows run through PagedAttention (accuracy.h): with a bf16 pool that path must give
  // the Generator's logits bit for bit, so the FP8 rows differ from the reference by the KV format alone.
  const ModelDir model = ModelDir::open(testing::tiny_model_dir());
  TeacherForcing gen(model, Device::CPU, 64), paged(model, Device::CPU, 64, KvCacheDtype::BF16),
      fp8(model, Device::CPU, 64, KvCacheDtype::FP8);
  std::vector<int32_t> ids;
  Rng rng(3);
  for (int i = 0; i < 40; ++i) ids.push_back(static_cast<int32_t>(rng.below(model.config.vocab_size)));
  const std::vector<float> a = to_f32_vector(gen.logits(ids)), b = to_f32_vector(paged.logits(ids));
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], b[i]) << i;
  const Tensor c = fp8.logits(ids);
  const LogitsComparison cmp = compare_logits(c.view(), Tensor::from_f32(a, c.view().shape, DType::F32, Device::CPU).view(), ids);
  EXPECT_GT(cmp.rms_error, 0.0) << "the FP8 pool changed nothing";
  EXPECT_LT(cmp.rms_error, 0.25 * cmp.reference_rms);
}

}  // namespace
}  // namespace tvllm

#include <fstream>
#include <nlohmann/json.hpp>

#include "quantize.h"
#include "safetensors_writer.h"

namespace tvllm {
namespace {

// An FP8 checkpoint of the bundled model with a compressed-tensors kv_cache_scheme: config.json names the static
// per-tensor scheme, and model.layers.N.self_attn.k_scale / v_scale sit in a second file of the index.
void add_kv_scales(const std::filesystem::path& dir, const std::vector<float>& k, const std::vector<float>& v) {
  nlohmann::json config;
  std::ifstream(dir / "config.json") >> config;
  config["quantization_config"]["kv_cache_scheme"] = {{"num_bits", 8}, {"type", "float"}, {"symmetric", true},
                                                      {"dynamic", false}, {"strategy", "tensor"}};
  std::ofstream(dir / "config.json") << config.dump(2);
  nlohmann::json map;
  for (const std::string& name : WeightStore::open(dir / "model.safetensors").names()) map[name] = "model.safetensors";
  std::vector<TensorToWrite> scales;
  auto add = [&](const std::string& name, float value) {
    TensorToWrite t{name, DType::F32, {1}, std::vector<uint8_t>(4)};
    std::memcpy(t.bytes.data(), &value, 4);
    scales.push_back(std::move(t));
    map[name] = "kv_scales.safetensors";
  };
  for (size_t l = 0; l < k.size(); ++l) add("model.layers." + std::to_string(l) + ".self_attn.k_scale", k[l]);
  for (size_t l = 0; l < v.size(); ++l) add("model.layers." + std::to_string(l) + ".self_attn.v_scale", v[l]);
  write_safetensors(dir / "kv_scales.safetensors", scales, {{"format", "pt"}});
  std::ofstream(dir / "model.safetensors.index.json") << nlohmann::json{{"metadata", nlohmann::json::object()},
                                                                         {"weight_map", map}}
                                                             .dump(2);
}

TEST(Fp8Kv16, ACheckpointsKvScalesAreLoadedIntoThePool) {
  testing::TempDir tmp;
  const std::filesystem::path dir = tmp.path() / "fp8";
  quantize_checkpoint(testing::tiny_model_dir(), dir, QuantizeOptions{});
  {
    const ModelDir plain = ModelDir::open(dir);
    PagedKvOptions none;
    EXPECT_FALSE(load_kv_scales(plain, none));  // no scales: 1.0, as vLLM
    EXPECT_TRUE(none.k_scales.empty());
  }
  add_kv_scales(dir, {0.25f, 0.5f}, {0.125f, 2.0f});
  const ModelDir model = ModelDir::open(dir);  // the scheme is accepted, and bind() skips the scale tensors
  const ModelWeights w = ModelWeights::bind(model, Device::CPU);
  PagedKvOptions o;
  o.num_blocks = 32;
  o.kv_dtype = KvCacheDtype::FP8;
  ASSERT_TRUE(load_kv_scales(model, o));
  EXPECT_EQ(o.k_scales, (std::vector<float>{0.25f, 0.5f}));
  EXPECT_EQ(o.v_scales, (std::vector<float>{0.125f, 2.0f}));
  Engine engine(w, testing::engine_config(64, 4, 64), paged_kv(o));
  auto& paged = dynamic_cast<PagedKv&>(engine.kv());
  EXPECT_EQ(paged.pool().quant(1).k_scale, 0.5f);
  EXPECT_EQ(paged.pool().quant(1).v_scale, 2.0f);
  const std::vector<CheckRequest> requests =
      make_check_requests(4, 3, 12, 2, 6, workload_id_high(w.config), 5, 0, {});
  const EngineRunResult r = run_requests(engine, requests);
  EXPECT_TRUE(r.events_ok) << r.events_error;
  EXPECT_EQ(engine.kv().usage().free_blocks, engine.kv().usage().total_blocks);

  // Half a set (k scales only) is refused, naming the count.
  const std::filesystem::path half = tmp.path() / "half";
  quantize_checkpoint(testing::tiny_model_dir(), half, QuantizeOptions{});
  add_kv_scales(half, {1.0f, 1.0f}, {});
  PagedKvOptions h;
  try {
    load_kv_scales(ModelDir::open(half), h);
    ADD_FAILURE() << "a partial set of KV scales was accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("2 of its k_scale / v_scale tensors"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tvllm
