// Lesson 15, GPU: flash_wgmma() as the engine's prefill attention, gated_mlp_wgmma() as the forward's gated MLP and
// gemm_wgmma_v2() as linear()'s GEMM for large steps (prefill_hook.h). The attention on the bundled model (head_dim 64). A counting wrapper stands in the seam, so each test also proves the kernel ran (a hook that declined every
// step would pass the comparisons with lesson 10/12's own kernels). The tolerances are the engine suites':
//   - the Generator's teacher-forced logits with and without the hook: both bf16 pipelines that differ only in
//     the attention kernel's summation order (lesson 07's tolerance per kernel call, about 2^-8 relative), carried
//     through 2 layers: relative L2 of the logits <= 2^-6 and the argmax equal on >= 98% of the rows (the other
//     rows must be near-ties, within 2^-6 of the row's largest logit);
//   - the engine (paged, with and without prefix caching): lesson 11's rule (engine_check.h) against each request
//     alone through lesson 10's Generator WITHOUT the hook, and every KV block back in the pool.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <vector>

#include "engine.h"
#include "engine_bench.h"
#include "engine_check.h"
#include "engine_paged.h"
#include "generate.h"
#include "common/cublas.h"
#include "hopper.h"
#include "matmul.h"
#include "model_dir.h"
#include "model_weights.h"
#include "prefill_hook.h"
#include "testing/engine_fixture.h"
#include "testing/hopper_testing.h"
#include "testing/safetensors_builder.h"
#include "testing/testing.h"
#include "transformer.h"

namespace tvllm {
namespace {

const testing::BundledModel<Device::CUDA>& bundled() { return testing::bundled_model<Device::CUDA>(); }

std::atomic<int64_t> g_ran{0}, g_declined{0};

bool counting_hook(const TensorView& out, const TensorView& q, const TensorView& k, const TensorView& v,
                   const AttentionBatch& batch, const AttentionShape& shape, cudaStream_t stream) {
  const bool ran = hopper_prefill_attention(out, q, k, v, batch, shape, stream);
  (ran ? g_ran : g_declined).fetch_add(1);
  return ran;
}

// Installs the counting hook for one test and takes it out again.
struct CountingHook {
  CountingHook() {
    g_ran = 0;
    g_declined = 0;
    install_fresh_prefill(counting_hook);
  }
  ~CountingHook() { install_fresh_prefill(nullptr); }
};

std::vector<int32_t> ids(int64_t n, int64_t vocab, uint32_t seed) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  uint32_t x = seed;
  for (auto& id : v) {
    x = x * 1664525u + 1013904223u;
    id = static_cast<int32_t>((x >> 8) % static_cast<uint32_t>(vocab));
  }
  return v;
}

TEST(HopperPrefill15Gpu, GeneratorLogitsMatchLesson10sKernel) {
  TVLLM_REQUIRE_HOPPER();
  const ModelWeights& w = bundled().w;
  const int64_t vocab = w.config.vocab_size;
  const std::vector<int32_t> prompt = ids(300, vocab, 1), forced = ids(200, vocab, 2);  // 500 rows, 4 query tiles
  Generator plain(w, Generator::limits_for(w.config, 512, 1, 512));
  const Tensor want = plain.forced_logits(prompt, forced);
  CountingHook hook;
  Generator hopper(w, Generator::limits_for(w.config, 512, 1, 512));
  hopper.attention().set_fast_prefill(true);
  const Tensor got = hopper.forced_logits(prompt, forced);
  EXPECT_EQ(g_ran.load(), w.config.num_hidden_layers) << "one prefill step: the hook runs once per layer";
  EXPECT_EQ(g_declined.load(), 0);
  ASSERT_EQ(got.shape(), want.shape());
  const int64_t rows = want.shape()[0], cols = want.shape()[1];
  const std::vector<float> got_f32 = to_f32_vector(got), want_f32 = to_f32_vector(want);
  const float* a = got_f32.data();
  const float* b = want_f32.data();
  double diff2 = 0.0, ref2 = 0.0;
  int64_t same = 0, near_ties = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = a + r * cols;
    const float* y = b + r * cols;
    for (int64_t c = 0; c < cols; ++c) {
      diff2 += (static_cast<double>(x[c]) - y[c]) * (static_cast<double>(x[c]) - y[c]);
      ref2 += static_cast<double>(y[c]) * y[c];
    }
    const int64_t ax = std::max_element(x, x + cols) - x, ay = std::max_element(y, y + cols) - y;
    if (ax == ay) {
      ++same;
    } else if (std::fabs(y[ax] - y[ay]) <= std::ldexp(std::fabs(y[ay]), -6)) {
      ++near_ties;
    }
  }
  const double rel_l2 = std::sqrt(diff2 / ref2);
  std::printf("hopper prefill vs lesson 10: rel L2 %.3e, argmax equal %lld/%lld (+%lld near-ties)\n", rel_l2,
              static_cast<long long>(same), static_cast<long long>(rows), static_cast<long long>(near_ties));
  EXPECT_LE(rel_l2, std::ldexp(1.0, -6));
  EXPECT_GE(same * 100, rows * 98);
  EXPECT_EQ(same + near_ties, rows);
}

// The engine over the paged pool: prefix caching off (every prefill is fresh) and on with a shared system prompt
// (the hits take lesson 12's paged kernel, the misses this one).
void engine_case(bool prefix_caching, int64_t shared_prefix) {
  const ModelWeights& w = bundled().w;
  constexpr int64_t kMaxContext = 512;
  const std::vector<int32_t> stop = {13};
  const auto requests =
      make_check_requests(48, 2, 200, 1, 48, workload_id_high(w.config), 41, shared_prefix, stop);
  const AloneResults alone = run_alone(w, requests, kMaxContext);  // the hook is not installed yet
  CountingHook hook;
  PagedKvOptions o;
  o.num_blocks = 48 * 32;
  o.block_size = 16;
  o.prefix_caching = prefix_caching;
  Engine engine(w, testing::engine_config(1024, 32, kMaxContext), paged_kv(o));
  engine.kv().attention().set_fast_prefill(true);
  const EngineRunResult run = run_requests(engine, requests);
  EXPECT_TRUE(run.events_ok) << run.events_error;
  const AloneCheck check = check_against_alone(w, requests, run, alone, kMaxContext);
  EXPECT_TRUE(check.pass()) << check.summary();
  std::printf("prefix caching %s: %s; hook ran %lld times, declined %lld\n", prefix_caching ? "on" : "off",
              check.summary().c_str(), static_cast<long long>(g_ran.load()),
              static_cast<long long>(g_declined.load()));
  EXPECT_GT(g_ran.load(), 0);
  EXPECT_EQ(g_declined.load(), 0);
  const KvUsage u = engine.kv().usage();
  EXPECT_EQ(u.free_blocks, u.total_blocks);
}

TEST(HopperPrefill15Gpu, PagedEngineAgreesWithEachRequestAlone) {
  TVLLM_REQUIRE_HOPPER();
  engine_case(false, 0);
}

TEST(HopperPrefill15Gpu, PagedEngineWithPrefixCachingAgreesWithEachRequestAlone) {
  TVLLM_REQUIRE_HOPPER();
  engine_case(true, 100);
}

// ---- the GEMM seam (lesson 06's install_large_gemm) ----------------------------------------------------------

std::atomic<int64_t> g_gemm_ran{0}, g_gemm_declined{0};

bool counting_gemm(const TensorView& y, const TensorView& x, const TensorView& w, cudaStream_t stream) {
  const bool ran = hopper_large_gemm(y, x, w, stream);
  (ran ? g_gemm_ran : g_gemm_declined).fetch_add(1);
  return ran;
}

struct CountingGemm {
  explicit CountingGemm(int64_t min_tokens) {
    g_gemm_ran = 0;
    g_gemm_declined = 0;
    install_large_gemm(counting_gemm, min_tokens);
  }
  ~CountingGemm() { install_large_gemm(nullptr, 1); }
};

std::vector<uint16_t> bits_of(const TensorView& t) {
  std::vector<uint16_t> h(static_cast<size_t>(t.numel()));
  TVLLM_CUDA_CHECK(cudaMemcpy(h.data(), t.data, h.size() * 2, cudaMemcpyDeviceToHost));
  return h;
}

// linear() with the default kernel takes gemm_wgmma_v2 from min_tokens rows (the same bits as calling it), keeps
// cuBLAS below them, for shapes the kernel declines, and for the batch-invariant v8 (never asked).
TEST(HopperGemm15Gpu, LinearTakesTheWgmmaGemmFromMinTokens) {
  TVLLM_REQUIRE_HOPPER();
  CublasHandle handle;
  const auto make = [](int64_t rows, int64_t cols, uint64_t seed) {
    Tensor t = Tensor::empty({rows, cols}, DType::BF16, Device::CUDA);
    fill_uniform_bf16(t, seed);
    return t;
  };
  const Tensor x = make(1024, 512, 1), w = make(776, 512, 2);  // N = 776: a multiple of 8, not of the tile
  const Tensor want_v2 = Tensor::empty({1024, 776}, DType::BF16, Device::CUDA);
  gemm_wgmma_v2(want_v2, x, w, handle.stream());
  // (cuBLAS gave these very bits too on the H200, K = 512: the counter, not the bits, says which GEMM ran.)

  CountingGemm seam(1000);
  const Tensor y = Tensor::empty({1024, 776}, DType::BF16, Device::CUDA);
  linear(y, x, w, MatmulKernel::V5Cublas, &handle);
  TVLLM_CUDA_CHECK(cudaStreamSynchronize(handle.stream()));
  EXPECT_EQ(g_gemm_ran.load(), 1);
  EXPECT_EQ(bits_of(y), bits_of(want_v2));

  // 999 rows: below the threshold, cuBLAS (the seam is not even asked).
  const TensorView x999 = TensorView::contiguous(x.data(), DType::BF16, Device::CUDA, {999, 512});
  const Tensor y999 = Tensor::empty({999, 776}, DType::BF16, Device::CUDA);
  const Tensor want999 = Tensor::empty({999, 776}, DType::BF16, Device::CUDA);
  linear(y999, x999, w, MatmulKernel::V5Cublas, &handle);
  EXPECT_EQ(g_gemm_ran.load() + g_gemm_declined.load(), 1);
  install_large_gemm(nullptr, 1);
  linear(want999, x999, w, MatmulKernel::V5Cublas, &handle);
  TVLLM_CUDA_CHECK(cudaStreamSynchronize(handle.stream()));
  EXPECT_EQ(bits_of(y999), bits_of(want999));

  // K = 100 (not a multiple of 64): declined, cuBLAS runs; v8 (batch-invariant): never asked.
  install_large_gemm(counting_gemm, 1000);
  const Tensor xk = make(1024, 100, 3), wk = make(256, 100, 4);
  const Tensor yk = Tensor::empty({1024, 256}, DType::BF16, Device::CUDA);
  linear(yk, xk, wk, MatmulKernel::V5Cublas, &handle);
  EXPECT_EQ(g_gemm_declined.load(), 1);
  const Tensor y8 = Tensor::empty({1024, 776}, DType::BF16, Device::CUDA);
  linear(y8, x, w, MatmulKernel::V8PinnedLt, &handle);
  TVLLM_CUDA_CHECK(cudaStreamSynchronize(handle.stream()));
  EXPECT_EQ(g_gemm_ran.load(), 1);
  EXPECT_EQ(g_gemm_declined.load(), 1);
}

// ---- the gated-MLP seam (lesson 08's install_gated_mlp) ------------------------------------------------------

std::atomic<int64_t> g_mlp_ran{0}, g_mlp_declined{0};

bool counting_mlp(const TensorView& act, const TensorView& x, const TensorView& w, cudaStream_t stream) {
  const bool ran = hopper_gated_mlp(act, x, w, stream);
  (ran ? g_mlp_ran : g_mlp_declined).fetch_add(1);
  return ran;
}

struct CountingMlp {
  explicit CountingMlp(int64_t min_tokens) {
    g_mlp_ran = 0;
    g_mlp_declined = 0;
    install_gated_mlp(counting_mlp, min_tokens);
  }
  ~CountingMlp() { install_gated_mlp(nullptr, 1); }
};

// The engine with the one-kernel MLP (installed from 64 tokens, so that prefill steps and the larger decode steps
// take it) against each request alone through the Generator without it: lesson 11's rule, as the attention hook
// above. A random model the kernel takes (the bundled one's hidden, 336, is not a multiple of 64: declined there):
// hidden 256, intermediate 520 (a multiple of 8, not of 128: the last tile is partial). Then a batch-invariant
// engine on the same requests: its GEMM (v8) is never replaced, so the seam is never asked.
TEST(HopperGatedMlp15Gpu, TheEngineWithTheOneKernelMlpAgreesWithEachRequestAlone) {
  TVLLM_REQUIRE_HOPPER();
  testing::SyntheticLlama s;
  s.vocab = 512, s.hidden = 256, s.intermediate = 520, s.layers = 2, s.heads = 4, s.kv_heads = 2, s.head_dim = 64;
  testing::TempDir tmp;
  testing::write_random_llama_as(s, tmp.path(), 77, "BF16", 0.05f);
  const ModelDir model = ModelDir::open(tmp.path());
  const ModelWeights w = ModelWeights::bind(model, Device::CUDA);
  constexpr int64_t kMaxContext = 64;  // SyntheticLlama's max_position_embeddings
  const auto requests = make_check_requests(64, 8, 40, 1, 16, workload_id_high(w.config), 51);
  const AloneResults alone = run_alone(w, requests, kMaxContext);  // the seam is not installed yet
  CountingMlp seam(64);
  PagedKvOptions o;
  o.num_blocks = 64 * 4;
  o.block_size = 16;
  Engine engine(w, testing::engine_config(1024, 64, kMaxContext), paged_kv(o));
  const EngineRunResult run = run_requests(engine, requests);
  EXPECT_TRUE(run.events_ok) << run.events_error;
  const AloneCheck check = check_against_alone(w, requests, run, alone, kMaxContext);
  EXPECT_TRUE(check.pass()) << check.summary();
  std::printf("one-kernel gated MLP: %s; ran %lld times, declined %lld\n", check.summary().c_str(),
              static_cast<long long>(g_mlp_ran.load()), static_cast<long long>(g_mlp_declined.load()));
  EXPECT_GT(g_mlp_ran.load(), 0);
  EXPECT_EQ(g_mlp_declined.load(), 0);
  const KvUsage u = engine.kv().usage();
  EXPECT_EQ(u.free_blocks, u.total_blocks);

  const int64_t ran_before = g_mlp_ran.load();
  EngineConfig invariant = testing::engine_config(1024, 64, kMaxContext);
  invariant.batch_invariant = true;
  Engine engine_bi(w, invariant, paged_kv(o));
  const EngineRunResult run_bi = run_requests(engine_bi, requests);
  EXPECT_TRUE(run_bi.events_ok) << run_bi.events_error;
  EXPECT_EQ(g_mlp_ran.load() + g_mlp_declined.load(), ran_before) << "batch invariance never asks the seam";
}

}  // namespace
}  // namespace tvllm
