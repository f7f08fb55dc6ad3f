// Lesson 14, CPU: the fast path's switches as data. The progression the chapter measures adds one technique per
// row (graphs, fused GEMVs, the fast sampler, programmatic dependent launch, the fast decode attention), the
// default options are its last row, and on the CPU nothing of it is installed (the CPU path is the fp32
// reference) and PDL is never claimed.
// What the fast path says it installs: the fused GEMV decode computes Llama's layer with Qwen2's q/k/v biases and
// Qwen3's q/k norm, but no bias after o_proj or in the MLP, so a model with one (issue 18; tests/data/models) is
// declined by name, and the notice says the composed kernels run; and the fp32 fact that lets the GPU test tell a
// fused layer that skipped a Qwen extra (the GPU side: tests/test_14_fast_path_gpu.cpp).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cached_attention.h"
#include "common/device.h"
#include "common/random.h"
#include "decode_attention_fast.h"
#include "fast_forward.h"
#include "fast_path.h"
#include "gemv.h"
#include "generate.h"
#include "latency_bench.h"
#include "logits_check.h"
#include "model_dir.h"
#include "paged_attention.h"
#include "pdl.h"
#include "testing/engine_fixture.h"
#include "testing/family_models.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

TEST(FastPath14, TheProgressionAddsOneTechniquePerRow) {
  const std::vector<LatencyVariant> v = progression_variants();
  ASSERT_EQ(v.size(), 10u);
  EXPECT_FALSE(v[0].fast.has_value());  // lesson 10 as it is
  // Each row turns exactly one switch on over the row before it, in the chapter's order (streamed tiles and RoPE
  // in the qkv GEMV are one row: the GEMV's last step). Row 8 is an experiment measured beside the default (row
  // 7's switches plus the attention as a programmatic dependent): not a step of the progression.
  const auto on = [](const FastPathOptions& o) {
    return std::vector<bool>{o.graphs,         o.fused,        o.fast_sampler,     o.pdl,
                             o.fast_attention, o.stream_tiles, o.kv_write_in_gemv, o.megakernel};
  };
  constexpr size_t kExperiment = 8;
  for (size_t i = 1; i < v.size(); ++i) {
    ASSERT_TRUE(v[i].fast.has_value()) << v[i].name;
    const std::vector<bool> now = on(*v[i].fast);
    const size_t step = i > kExperiment ? i - 1 : i;  // the experiment row is not a step
    if (i == kExperiment) {
      EXPECT_EQ(now, on(*v[i - 1].fast)) << v[i].name;
      EXPECT_TRUE(v[i].fast->pdl_attention) << v[i].name;
      EXPECT_NE(v[i].name.find("experiment"), std::string::npos);
      continue;
    }
    for (size_t k = 0; k < now.size(); ++k) EXPECT_EQ(now[k], k < step) << v[i].name << ", switch " << k;
    EXPECT_EQ(v[i].fast->rope_in_gemv, v[i].fast->stream_tiles) << v[i].name;
    // The steps measured and not kept (the chapter's ledger) are in no other row.
    EXPECT_FALSE(v[i].fast->pdl_attention) << v[i].name;
    EXPECT_FALSE(v[i].fast->combine_in_decode) << v[i].name;
  }
  EXPECT_NE(v[4].name.find("programmatic dependent launch"), std::string::npos);
  EXPECT_NE(v[5].name.find("fast decode attention"), std::string::npos);
  EXPECT_NE(v[6].name.find("streamed tiles"), std::string::npos);
  EXPECT_NE(v[7].name.find("KV write"), std::string::npos);
  EXPECT_NE(v.back().name.find("megakernel"), std::string::npos);
  // Row 7 is what the product runs by default; the last adds the opt-in megakernel.
  const FastPathOptions defaults;
  EXPECT_EQ(on(*v[7].fast), on(defaults));
  EXPECT_EQ(v[7].fast->pdl_attention, defaults.pdl_attention);
  EXPECT_TRUE(defaults.rope_in_gemv);
  EXPECT_EQ(v[7].fast->max_graph_batch, defaults.max_graph_batch);
  EXPECT_FALSE(defaults.megakernel) << "opt-in (--megakernel): slower than the fused path in its first version";
  EXPECT_FALSE(defaults.pdl_attention) << "measured no faster (ledger)";
  EXPECT_FALSE(defaults.combine_in_decode) << "measured slower at context 4096 (ledger)";
}

TEST(FastPath14, PdlIsNeverClaimedWhereItCannotRun) {
  // Without a GPU there is no PDL; with one, only from compute capability 9.0 on.
  if (!cuda_available() || query_device().compute_major < 9) {
    EXPECT_FALSE(pdl_supported());
  }
  EXPECT_FALSE(fast_path_uses_pdl({}, Device::CPU));
  EXPECT_FALSE(fast_path_uses_pdl(fast_path_options(false, true, true, true, true), Device::CUDA));  // needs fused
  EXPECT_FALSE(fast_path_uses_pdl(fast_path_options(true, true, true, false, true), Device::CUDA));  // --no-pdl
  EXPECT_EQ(fast_path_uses_pdl(fast_path_options(true, false, false, true, true), Device::CUDA), pdl_supported());
  // What the banner says follows the same rule.
  const std::string fused_pdl = describe_fast_path(fast_path_options(true, true, true, true, true), Device::CUDA);
  EXPECT_EQ(fused_pdl.find("with PDL") != std::string::npos, pdl_supported()) << fused_pdl;
  EXPECT_NE(describe_fast_path(fast_path_options(true, true, true, false, true), Device::CUDA).find("--no-pdl"),
            std::string::npos);
  EXPECT_EQ(describe_fast_path({}, Device::CPU), "CPU reference path (the fast path is for CUDA)");
  // The notice names the decode attention kernel too (--no-fast-attention: lesson 10's).
  EXPECT_NE(describe_fast_path({}, Device::CUDA).find(", fast decode attention"), std::string::npos);
  EXPECT_NE(describe_fast_path(fast_path_options(true, true, true, true, false), Device::CUDA)
                .find(", lesson 10 decode attention"),
            std::string::npos);
}

bool contains(const std::string& s, const std::string& needle) { return s.find(needle) != std::string::npos; }

TEST(FastPath14, TheFastDecodeAttentionIsTheDefaultWhereItWasMeasuredToPay) {
  // head_dim 64 (Llama 3.2 1B, the bundled model): faster at every measured batch; head_dim 128 (Qwen3-0.6B,
  // Llama 3.2 3B, Mistral 7B): slower at batches 1 and 8 on the H200, so lesson 10's kernel stays (chapter 8).
  EXPECT_TRUE(fast_decode_attention_pays(AttentionShape{32, 8, 64}));
  EXPECT_TRUE(fast_decode_attention_pays(AttentionShape{4, 2, 16}));
  EXPECT_FALSE(fast_decode_attention_pays(AttentionShape{16, 8, 128}));
  ModelConfig c = testing::bundled_model<Device::CPU>().w.config;
  EXPECT_TRUE(contains(describe_fast_path({}, Device::CUDA, &c), ", fast decode attention"));
  c.head_dim = 128;
  const std::string n = describe_fast_path({}, Device::CUDA, &c);
  EXPECT_TRUE(contains(n, ", lesson 10 decode attention (head_dim 128: lesson 14's kernel is slower there)")) << n;
}

TEST(FastPath14, OnTheCpuNothingIsInstalled) {
  const auto& m = testing::bundled_model<Device::CPU>();
  Generator gen(m.w, Generator::limits_for(m.w.config, 64, 1, 64));
  use_fast_path(gen);
  EXPECT_EQ(gen.context().forward_fn(), nullptr);  // lesson 08's forward_composed, the reference
  EXPECT_EQ(gen.context().launcher(), nullptr);
}

TEST(FastPath14, TheFamiliesExtrasAreDeclinedByName) {
  // The fused layer computes Qwen2's q/k/v biases and Qwen3's q/k norm (lesson 08's kernels, before RoPE); it
  // has no bias after o_proj or in the MLP, so the biased Llama is declined by those two names alone.
  const ModelDir llama_bias = ModelDir::open(testing::family_model_dir("llama_bias"));
  ASSERT_TRUE(llama_bias.config.qkv_bias) << "the fixture has q/k/v biases too: the name must leave them out";
  const std::string declined = "o_proj bias, MLP biases";
  EXPECT_EQ(fast_forward_declines(llama_bias.config), declined);
  const std::string notice = describe_fast_path({}, Device::CUDA, &llama_bias.config);
  EXPECT_TRUE(contains(notice, "composed kernels (the fused GEMV decode does not compute this model's " + declined +
                                   ")"))
      << notice;
  EXPECT_TRUE(contains(notice, "CUDA graphs")) << "graphs still apply: " << notice;
  // Each of the two alone is declined by its own name.
  ModelConfig o_only = llama_bias.config, mlp_only = llama_bias.config;
  o_only.mlp_bias = false;
  mlp_only.o_bias = false;
  EXPECT_EQ(fast_forward_declines(o_only), "o_proj bias");
  EXPECT_EQ(fast_forward_declines(mlp_only), "MLP biases");

  for (const std::string family : {"qwen2", "qwen3", "mistral"}) {
    SCOPED_TRACE(family);
    const ModelDir model = ModelDir::open(testing::family_model_dir(family));
    EXPECT_EQ(fast_forward_declines(model.config), "");
    const std::string n = describe_fast_path({}, Device::CUDA, &model.config);
    EXPECT_TRUE(contains(n, "fused GEMV decode") && !contains(n, "composed")) << n;
  }
  for (const std::string family : {"qwen2", "qwen3", "llama_bias"}) {
    // CPU weights never take the fused path, whatever the model.
    const ModelDir model = ModelDir::open(testing::family_model_dir(family));
    EXPECT_FALSE(fast_forward_supported(ModelWeights::bind(model, Device::CPU))) << family;
  }
  const ModelDir llama = ModelDir::open(testing::tiny_model_dir());
  EXPECT_EQ(fast_forward_declines(llama.config), "");
  const std::string plain = describe_fast_path({}, Device::CUDA, &llama.config);
  EXPECT_TRUE(contains(plain, "fused GEMV decode") && !contains(plain, "composed")) << plain;
  EXPECT_EQ(describe_fast_path({}, Device::CUDA), plain) << "without a config: the options alone";
  // The megakernel (section 14): off by default and then not named; --megakernel names it; declined by name for
  // a model it does not take (Mistral's sliding window).
  EXPECT_FALSE(contains(plain, "megakernel")) << plain;
  const FastPathOptions mega = fast_path_options(true, true, true, true, true, true);
  EXPECT_TRUE(contains(describe_fast_path(mega, Device::CUDA, &llama.config), ", megakernel for batch-1 decode"));
  const ModelDir mistral = ModelDir::open(testing::family_model_dir("mistral"));
  EXPECT_TRUE(contains(describe_fast_path(mega, Device::CUDA, &mistral.config), ", no megakernel (it does not take"))
      << describe_fast_path(mega, Device::CUDA, &mistral.config);
}

// What FastPath14Gpu.QwenFamiliesTakeTheFusedPath can tell: it holds the fused path's teacher-forced logits within
// eps (lesson 08's GPU bound, 0.2 x rms) of the fp32 CPU generator's. A fused layer that skipped Qwen2's biases
// or Qwen3's q/k norm would compute the model without them, whose fp32 logits are the distance below away, and
// its own bf16 error is again within eps: past 3 eps, such a layer is more than eps off, and the GPU test fails.
// Measured: without the biases 13.8 eps, without the q/k norm 8.6 eps, k normalised with q's weight 5.8 eps.
TEST(FastPath14, DroppingAQwenExtraMovesTheLogitsPastTheGpuBound) {
  struct Drop {
    const char* family;
    void (*drop)(LayerWeights&);
  };
  const Drop drops[] = {
      {"qwen2", [](LayerWeights& L) { L.bq = L.bk = L.bv = {}; }},
      {"qwen3", [](LayerWeights& L) { L.q_norm = L.k_norm = {}; }},
      {"qwen3", [](LayerWeights& L) { L.k_norm = L.q_norm; }},  // k normalised with q's weight
  };
  for (const Drop& d : drops) {
    SCOPED_TRACE(d.family);
    const testing::FamilyReference ref = testing::read_family_reference(d.family);
    const ModelDir model = ModelDir::open(testing::family_model_dir(d.family));
    const ModelWeights full = ModelWeights::bind(model, Device::CPU);
    ModelWeights wrong = ModelWeights::bind(model, Device::CPU);
    for (LayerWeights& L : wrong.layers) d.drop(L);
    const EngineLimits lim = Generator::limits_for(model.config, 64, 1, 64);
    Generator a(full, lim), b(wrong, lim);
    const Tensor la = a.forced_logits(ref.prompt_ids, ref.greedy_ids);
    const Tensor lb = b.forced_logits(ref.prompt_ids, ref.greedy_ids);
    const double eps = gpu_logit_bound(rms(la.view()), nullptr).epsilon;
    const Top1Agreement t = top1_agreement(lb.view(), la.view(), 2 * eps);
    EXPECT_GT(t.max_abs_error, 3 * eps) << "eps " << eps << ": " << t.summary();
  }
}

// The KV store on the CPU, through both cache backends (kv_store.h): in a decode step of two sequences,
// rmsnorm_gemv_rope storing k and v where kv_store() says, then attend_stored(), leaves the same cache and the same
// attention output, bit for bit, as attend() with the same k and v (what the fused path did before the store).
// kv_store() declines any step that is not a decode, and attend_stored() refuses one.
TEST(FastPath14, TheBackendsKvStoreHoldsWhatTheirWriteWould) {
  const ModelDir model = ModelDir::open(testing::tiny_model_dir());
  const ModelConfig& c = model.config;
  const AttentionShape shape = AttentionShape::from_config(c);
  const int64_t T = 2, K = c.hidden_size, N = shape.qkv_dim(), q_cols = shape.n_heads * shape.head_dim;
  const int64_t kv_dim = shape.kv_dim();
  const EngineLimits limits{64, 2, 2, 128};
  StepInputs step(c, limits, Device::CPU);
  step.set({3, 4}, {1, 1}, {5, 20}, {0, 1});  // new tokens at positions 4 and 19
  const Tensor x = Tensor::from_f32(random_uniform(static_cast<size_t>(T * K), 71), {T, K}, DType::BF16, Device::CPU);
  const Tensor wqkv = Tensor::from_f32(random_normal(static_cast<size_t>(N * K), 72, 1.0f / std::sqrt(float(K))),
                                       {N, K}, DType::BF16, Device::CPU);
  const Tensor g = Tensor::from_f32(random_uniform(static_cast<size_t>(K), 73, 0.5f, 1.5f), {K}, DType::BF16,
                                    Device::CPU);
  const RopeTable rope = RopeTable::build(c);
  // qkv as the fused path computes it (bf16), widened to the F32 the CPU backends take.
  const auto project = [&](const KvStore* store) {
    Tensor qkv = Tensor::empty({T, N}, DType::BF16, Device::CPU);
    rmsnorm_gemv_rope(qkv, x, g, 1e-5f, wqkv, {}, step.positions(), rope, shape.n_heads, shape.n_kv_heads, nullptr,
                      false, Fp8GemvVariant::Auto, store);
    return Tensor::from_f32(to_f32_vector(qkv), {T, N}, DType::F32, Device::CPU);
  };
  // Every row of layer 0 filled alike first: the attention reads the earlier positions too.
  const auto fill = [](const TensorView& t, uint64_t seed) {
    const std::vector<float> v = random_uniform(static_cast<size_t>(t.numel()), seed);
    std::copy(v.begin(), v.end(), t.ptr<float>());
  };
  const auto run = [&](AttentionBackend& written, AttentionBackend& stored, const TensorView& cache_written,
                       const TensorView& cache_stored) {
    const Tensor qkv = project(nullptr);
    Tensor out_written = Tensor::empty({T, q_cols}, DType::F32, Device::CPU);
    written.attend(0, qkv.view().columns(0, q_cols), qkv.view().columns(q_cols, kv_dim),
                   qkv.view().columns(q_cols + kv_dim, kv_dim), out_written, step, nullptr);
    KvStore store;
    ASSERT_TRUE(stored.kv_store(0, step, &store));
    EXPECT_EQ(store.dtype, DType::F32);
    const Tensor qkv_stored = project(&store);
    Tensor out_stored = Tensor::empty({T, q_cols}, DType::F32, Device::CPU);
    stored.attend_stored(0, qkv_stored.view().columns(0, q_cols), out_stored, step, nullptr);
    EXPECT_EQ(to_f32_vector(out_stored), to_f32_vector(out_written));
    EXPECT_EQ(to_f32_vector(cache_stored), to_f32_vector(cache_written));
  };

  KvCache cache_a = KvCache::for_model(c, 2, 128, Device::CPU), cache_b = KvCache::for_model(c, 2, 128, Device::CPU);
  for (KvCache* cache : {&cache_a, &cache_b}) {
    fill(cache->k(0), 81);
    fill(cache->v(0), 82);
  }
  CachedAttention cached_a(cache_a, limits), cached_b(cache_b, limits);
  cached_a.set_slots({1, 0});
  cached_b.set_slots({1, 0});
  {
    SCOPED_TRACE("lesson 10's cache");
    run(cached_a, cached_b, cache_a.k(0), cache_b.k(0));
    EXPECT_EQ(to_f32_vector(cache_b.v(0)), to_f32_vector(cache_a.v(0)));
  }

  PagedKvPool pool_a = PagedKvPool::for_model(c, 8, 16, Device::CPU), pool_b = PagedKvPool::for_model(c, 8, 16, Device::CPU);
  for (PagedKvPool* pool : {&pool_a, &pool_b}) {
    fill(pool->k(0), 83);
    fill(pool->v(0), 84);
  }
  PagedAttention paged_a(pool_a, limits), paged_b(pool_b, limits);
  const std::vector<std::vector<int32_t>> tables{{3}, {1, 6}};
  const std::vector<int32_t> slot_mapping{3 * 16 + 4, 6 * 16 + 3};
  paged_a.set_tables(slot_mapping, tables);
  paged_b.set_tables(slot_mapping, tables);
  {
    SCOPED_TRACE("lesson 12's pool");
    run(paged_a, paged_b, pool_a.k(0), pool_b.k(0));
    EXPECT_EQ(to_f32_vector(pool_b.v(0)), to_f32_vector(pool_a.v(0)));
  }

  // Not a decode step: no store, and attend_stored() refuses it.
  step.set({1, 2, 3}, {3}, {3}, {2});
  cached_a.set_slots({0});
  paged_a.set_tables({16, 17, 18}, {{1}});
  KvStore store;
  EXPECT_FALSE(cached_a.kv_store(0, step, &store));
  EXPECT_FALSE(paged_a.kv_store(0, step, &store));
  Tensor out = Tensor::empty({3, q_cols}, DType::F32, Device::CPU);
  EXPECT_THROW(cached_a.attend_stored(0, out.view(), out.view(), step, nullptr), InputError);
  EXPECT_THROW(paged_a.attend_stored(0, out.view(), out.view(), step, nullptr), InputError);
  // Prefill-only backends store nothing.
  PrefillAttention prefill(c, limits, Device::CPU);
  EXPECT_FALSE(prefill.kv_store(0, step, &store));
}

}  // namespace
}  // namespace tvllm
