// Lesson 15, step 7 on the GPU: flash_wgmma_paged() (the wgmma kernel over lesson 12's paged pool) against
// lesson 12's CPU paged prefill reference (paged_prefill_attention_cpu) with lesson 07's tolerance
// (flash_check.h: (2^-8 + 1e-4) max|v| + the same relative; P is rounded to bf16 before P V), lesson 12's GPU
// paged flash kernel beside it on the same pool (it must pass the same bar). Every pool slot that no
// sequence's keys occupy (whole unused blocks, and the tail of each sequence's last block) holds NaN on the
// GPU: a kernel that reads a key it must not see, or lets an unwritten V row into P V (0 x NaN), fails.
// Outputs start as NaN too. Shapes: block sizes 8 .. 256 with shuffled tables, prefixes of 0 .. 300 keys,
// q_len 1 .. 200, several sequences per step, a prefix-cache hit (two tables sharing blocks), GQA groups 1 ..
// 8, head_dim 64 and 128, sliding windows, each compiled config; bit-equality with the contiguous kernel on
// the same keys, and of a chunk after a prefix with the whole prompt's fresh prefill; a created stream; the
// refusals. Then the engine: prefix caching on, chunked prefill in small
// steps, against each request alone, with a counting wrapper in lesson 12's seam proving the paged kernel
// ran. Skipped without an H100/H200 (sm_90a).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

#include "attention.h"
#include "common/cuda_stream.h"
#include "common/errors.h"
#include "common/random.h"
#include "engine.h"
#include "engine_bench.h"
#include "engine_check.h"
#include "engine_paged.h"
#include "flash_check.h"
#include "flash_paged.h"
#include "flash_wgmma.h"
#include "hopper.h"
#include "paged_kv.h"
#include "prefill_hook.h"
#include "testing/attention_check.h"
#include "testing/paged_tables.h"
#include "testing/engine_fixture.h"
#include "testing/hopper_testing.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

using testing::describe;

using testing::shuffled_tables;

int64_t blocks_needed(const std::vector<int64_t>& k_lens, int64_t bs) {
  int64_t n = 0;
  for (int64_t k : k_lens) n += (k + bs - 1) / bs;
  return n;
}

struct Step {
  std::vector<int64_t> q_lens, k_lens;
  int share_from = -1;
  int64_t share_keys =
      0;  // keys of sequence share_from's first blocks the last sequence shares (a multiple of bs)
};

// flash_check.h's check_flash_wgmma_paged: the pool holds NaN in every slot no key occupies; lesson 12's CPU
// reference is the oracle, lesson 12's GPU paged flash kernel must pass the same bar on the same pool.
void expect_step(const Step& st, const AttentionShape& s, int64_t bs, uint64_t seed,
                 const FlashConfig* config = nullptr, cudaStream_t stream = nullptr) {
  const FlashCheck r = check_flash_wgmma_paged(st.q_lens, st.k_lens, s, bs, seed, st.share_from,
                                               st.share_keys, config, stream);
  EXPECT_GT(r.ours.count, 0);
  EXPECT_EQ(r.non_finite, 0) << r.ours.name
                             << ": NaN or inf in the output (a row never written, or a NaN slot read)";
  EXPECT_EQ(r.written_outside, 0) << r.ours.name << ": wrote outside out's columns";
  EXPECT_TRUE(r.ours.pass()) << describe(r.ours, s);
  EXPECT_TRUE(r.lesson07.pass()) << "the bar itself moved: " << describe(r.lesson07, s);
}

// Prefill, a chunk after a prefix, a decode-sized sequence, a tiny one, and a prefix-cache hit: every block
// size.
TEST(FlashPaged15Gpu, EveryBlockSizeWithShuffledTables) {
  TVLLM_REQUIRE_HOPPER();
  for (int64_t bs : {8, 16, 32, 64, 128, 256})
    for (int64_t d : {64, 128}) {
      Step st{{77, 1, 200, 5, 40}, {77, 300, 300, 5, 556}, 2, 256};
      expect_step(st, AttentionShape{8, 2, d}, bs, 100 + bs + d);
    }
}

// Prefixes of 0 .. 300 keys (tile and block edges on both sides) under every query count 1 .. 200 (block-row
// edges of 64, 128 and 192), ten sequences per step.
TEST(FlashPaged15Gpu, PrefixesOf0To300KeysUnderQueryRuns1To200) {
  TVLLM_REQUIRE_HOPPER();
  const std::vector<int64_t> prefixes = {0, 1, 7, 8, 127, 128, 129, 255, 256, 300};
  for (int64_t d : {64, 128})
    for (int64_t q_len : {1, 2, 63, 64, 65, 127, 128, 129, 191, 192, 193, 200}) {
      Step st;
      for (int64_t p : prefixes) st.q_lens.push_back(q_len), st.k_lens.push_back(p + q_len);
      st.q_lens.push_back(std::max<int64_t>(2, q_len));  // at least one run of several queries
      st.k_lens.push_back(st.q_lens.back() + 33);
      expect_step(st, AttentionShape{4, 1, d}, 16, 200 + q_len + d);
    }
}

TEST(FlashPaged15Gpu, GqaGroups1To8) {
  TVLLM_REQUIRE_HOPPER();
  for (int64_t d : {64, 128})
    for (int64_t group : {1, 2, 4, 8})
      expect_step(Step{{150, 30}, {400, 30}}, AttentionShape{8, 8 / group, d}, 32, 300 + group + d);
}

TEST(FlashPaged15Gpu, SlidingWindows) {
  TVLLM_REQUIRE_HOPPER();
  for (int64_t d : {64, 128})
    for (int64_t window : {1, 100, 128, 129, 300})
      expect_step(Step{{50, 200, 3}, {700, 500, 260}}, AttentionShape{4, 1, d, window}, 16, 400 + window + d);
}

// Each compiled paged config, explicitly (the defaults pick them by max_q_len).
TEST(FlashPaged15Gpu, EveryCompiledConfig) {
  TVLLM_REQUIRE_HOPPER();
  for (int64_t d : {64, 128})
    for (const FlashConfig& c : flash_configs(d)) {
      if (!flash_wgmma_paged_has_config(d, c)) continue;
      expect_step(Step{{1, 130, 64, 257}, {129, 300, 64, 1000}}, AttentionShape{8, 2, d}, 16, 500 + d, &c);
      expect_step(Step{{10, 200}, {510, 300}}, AttentionShape{8, 8, d, 300}, 64, 510 + d, &c);
    }
}

// The same keys in shuffled blocks of 16 and packed contiguously: the paged kernel gives the contiguous
// kernel's bits (the same tiles, the same arithmetic in the same order; only the boxes differ), on the
// Llama-3.2-1B shape at 1000 + 1000 keys, per compiled config.
TEST(FlashPaged15Gpu, PagedGivesTheContiguousKernelsBits) {
  TVLLM_REQUIRE_HOPPER();
  const std::vector<int64_t> q_lens = {1000, 1, 77}, k_lens = {2000, 300, 77};
  const int64_t bs = 16, B = 3;
  for (int64_t d : {64, 128}) {
    const AttentionShape s{32, 8, d};
    const int64_t kv = s.kv_dim(), num_blocks = blocks_needed(k_lens, bs) + 3;
    const auto tables = shuffled_tables(k_lens, bs, num_blocks, 600 + d);
    const int64_t Tk = 2377, Tq = 1078;
    const std::vector<float> k = random_normal(static_cast<size_t>(Tk * kv), 601);
    const std::vector<float> v = random_uniform(static_cast<size_t>(Tk * kv), 602);
    std::vector<float> pk(static_cast<size_t>(num_blocks * bs * kv), 0.f), pv(pk.size(), 0.f);
    std::vector<int32_t> slots;
    int64_t row = 0;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t pos = 0; pos < k_lens[b]; ++pos, ++row) {
        const int64_t slot = tables[b][pos / bs] * bs + pos % bs;
        std::copy_n(k.begin() + row * kv, kv, pk.begin() + slot * kv);
        std::copy_n(v.begin() + row * kv, kv, pv.begin() + slot * kv);
        if (pos >= k_lens[b] - q_lens[b]) slots.push_back(static_cast<int32_t>(slot));
      }
    PagedKvPool pool(s, 1, num_blocks, bs, Device::CUDA);
    copy_view(pool.k(0), Tensor::from_f32(pk, pool.k(0).shape, DType::BF16, Device::CUDA).view());
    copy_view(pool.v(0), Tensor::from_f32(pv, pool.k(0).shape, DType::BF16, Device::CUDA).view());
    PagedStepTables t(Tq, B, 125, num_blocks, bs, Device::CUDA);
    t.set(slots, tables);
    AttentionBatch batch(B, Device::CUDA);
    batch.set_lengths(q_lens, k_lens);
    const Tensor q = Tensor::from_f32(random_normal(static_cast<size_t>(Tq * s.q_dim()), 603),
                                      {Tq, s.q_dim()}, DType::BF16, Device::CUDA);
    const Tensor kc = Tensor::from_f32(k, {Tk, kv}, DType::BF16, Device::CUDA);
    const Tensor vc = Tensor::from_f32(v, {Tk, kv}, DType::BF16, Device::CUDA);
    for (const FlashConfig& c : flash_configs(d)) {
      if (!flash_wgmma_paged_has_config(d, c)) continue;
      const Tensor a = Tensor::empty({Tq, s.q_dim()}, DType::BF16, Device::CUDA);
      const Tensor p = Tensor::empty({Tq, s.q_dim()}, DType::BF16, Device::CUDA);
      TVLLM_CUDA_CHECK(cudaMemset(p.data(), 0xFF, p.view().nbytes()));
      TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
      flash_wgmma(a, q, kc, vc, batch, s, nullptr, c);
      flash_wgmma_paged(p, q, pool.k(0), pool.v(0), batch, t, s, nullptr, c);
      TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
      EXPECT_EQ(to_f32_vector(p), to_f32_vector(a)) << c.name << " head_dim " << d;
    }
  }
}

// A prompt's rows do not depend on how it was split: the fresh kernel over the whole prompt of 700 tokens,
// and the paged kernel over a chunk of its last 700 - p tokens after a cached prefix of p (a prefix-cache
// hit, or a later chunk), give those rows the same bits, for every pair of compiled configs (block_m 64, 128
// or 192). Per row the same tiles in the same order: a tile wholly masked for a row adds exactly 0 with alpha
// exactly 1, as Flash15Gpu.EveryConfigGivesTheBaselineBits relies on. (What lesson 11's batch-invariant mode
// would need to use lesson 15's kernels; tiny-vllm does not yet.)
TEST(FlashPaged15Gpu, AChunkAfterAPrefixGivesTheWholePromptsBits) {
  TVLLM_REQUIRE_HOPPER();
  const int64_t n = 700, bs = 16;
  for (int64_t d : {64, 128}) {
    const AttentionShape s{8, 2, d};
    const int64_t kv = s.kv_dim(), num_blocks = n / bs + 4;
    const auto tables = shuffled_tables({n}, bs, num_blocks, 800 + d);
    const std::vector<float> k = random_normal(static_cast<size_t>(n * kv), 801);
    const std::vector<float> v = random_uniform(static_cast<size_t>(n * kv), 802);
    std::vector<float> pk(static_cast<size_t>(num_blocks * bs * kv), 0.f), pv(pk.size(), 0.f);
    for (int64_t pos = 0; pos < n; ++pos) {
      const int64_t slot = tables[0][pos / bs] * bs + pos % bs;
      std::copy_n(k.begin() + pos * kv, kv, pk.begin() + slot * kv);
      std::copy_n(v.begin() + pos * kv, kv, pv.begin() + slot * kv);
    }
    PagedKvPool pool(s, 1, num_blocks, bs, Device::CUDA);
    copy_view(pool.k(0), Tensor::from_f32(pk, pool.k(0).shape, DType::BF16, Device::CUDA).view());
    copy_view(pool.v(0), Tensor::from_f32(pv, pool.k(0).shape, DType::BF16, Device::CUDA).view());
    const Tensor q = Tensor::from_f32(random_normal(static_cast<size_t>(n * s.q_dim()), 803), {n, s.q_dim()},
                                      DType::BF16, Device::CUDA);
    const Tensor kc = Tensor::from_f32(k, {n, kv}, DType::BF16, Device::CUDA);
    const Tensor vc = Tensor::from_f32(v, {n, kv}, DType::BF16, Device::CUDA);
    const AttentionBatch fresh = AttentionBatch::prefill({n}, Device::CUDA);
    for (const FlashConfig& whole : flash_configs(d)) {
      if (!flash_wgmma_paged_has_config(d, whole)) continue;
      const Tensor want = Tensor::empty({n, s.q_dim()}, DType::BF16, Device::CUDA);
      TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
      flash_wgmma(want, q, kc, vc, fresh, s, nullptr, whole);
      TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
      const std::vector<float> all = to_f32_vector(want);
      for (int64_t prefix : {1, 100, 128, 300, 699}) {
        const int64_t rows = n - prefix;
        std::vector<int32_t> slots;
        for (int64_t pos = prefix; pos < n; ++pos)
          slots.push_back(static_cast<int32_t>(tables[0][pos / bs] * bs + pos % bs));
        PagedStepTables t(rows, 1, num_blocks, num_blocks, bs, Device::CUDA);
        t.set(slots, tables);
        AttentionBatch chunk(1, Device::CUDA);
        chunk.set_lengths({rows}, {n});
        const TensorView q_rows = q.view().rows(prefix, rows);
        for (const FlashConfig& part : flash_configs(d)) {
          if (!flash_wgmma_paged_has_config(d, part)) continue;
          const Tensor got = Tensor::empty({rows, s.q_dim()}, DType::BF16, Device::CUDA);
          TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
          flash_wgmma_paged(got, q_rows, pool.k(0), pool.v(0), chunk, t, s, nullptr, part);
          TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
          const std::vector<float> tail(all.begin() + prefix * s.q_dim(), all.end());
          EXPECT_EQ(to_f32_vector(got), tail) << "head_dim " << d << ", whole prompt " << whole.name
                                              << ", chunk after " << prefix << " keys " << part.name;
        }
      }
    }
  }
}

TEST(FlashPaged15Gpu, RunsOnTheCallersStream) {
  TVLLM_REQUIRE_HOPPER();
  CudaStream stream;
  expect_step(Step{{40, 3}, {600, 33}}, AttentionShape{8, 2, 64}, 16, 700, nullptr, stream.get());
}

TEST(FlashPaged15Gpu, RefusalsOnTheGpu) {
  TVLLM_REQUIRE_HOPPER();
  // Blocks of 4 and head_dim 96: flash_wgmma_paged throws, the hook declines (lesson 12's kernel runs).
  for (const auto& [bs, d] : std::vector<std::pair<int64_t, int64_t>>{{4, 64}, {16, 96}}) {
    const AttentionShape s{4, 2, d};
    PagedKvPool pool(s, 1, 10, bs, Device::CUDA);
    PagedStepTables t(8, 1, 10, 10, bs, Device::CUDA);
    t.set({0, 1, 2, 3, 4, 5, 6, 7}, {{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}});
    const AttentionBatch batch = AttentionBatch::with_lengths({8}, {8}, Device::CUDA);
    const Tensor q = Tensor::empty({8, s.q_dim()}, DType::BF16, Device::CUDA);
    const Tensor out = Tensor::empty({8, s.q_dim()}, DType::BF16, Device::CUDA);
    EXPECT_THROW(flash_wgmma_paged(out, q, pool.k(0), pool.v(0), batch, t, s), InputError) << bs << " " << d;
    EXPECT_FALSE(hopper_paged_prefill_attention(out, q, pool.k(0), pool.v(0), batch, t, s, nullptr));
  }
}

// ---- the engine
// -------------------------------------------------------------------------------------------------

std::atomic<int64_t> g_paged_ran{0}, g_paged_declined{0}, g_fresh_ran{0};

bool counting_paged(const TensorView& out, const TensorView& q, const TensorView& pool_k,
                    const TensorView& pool_v, const AttentionBatch& batch, const PagedStepTables& tables,
                    const AttentionShape& shape, cudaStream_t stream) {
  const bool ran = hopper_paged_prefill_attention(out, q, pool_k, pool_v, batch, tables, shape, stream);
  (ran ? g_paged_ran : g_paged_declined).fetch_add(1);
  return ran;
}
bool counting_fresh(const TensorView& out, const TensorView& q, const TensorView& k, const TensorView& v,
                    const AttentionBatch& batch, const AttentionShape& shape, cudaStream_t stream) {
  const bool ran = hopper_prefill_attention(out, q, k, v, batch, shape, stream);
  if (ran) g_fresh_ran.fetch_add(1);
  return ran;
}
struct CountingHooks {
  CountingHooks() {
    g_paged_ran = g_paged_declined = g_fresh_ran = 0;
    install_fresh_prefill(counting_fresh);
    install_fast_paged_prefill(counting_paged);
  }
  ~CountingHooks() {
    install_fresh_prefill(nullptr);
    install_fast_paged_prefill(nullptr);
  }
};

// Prefix caching on (a shared system prompt of 100 tokens), chunked prefill with a budget of 48 tokens per
// step: most prefill steps carry a cached prefix (a prefix-cache hit, or a chunk after earlier chunks) and go
// through the paged wgmma kernel. Lesson 11's rule (engine_check.h) against each request alone through lesson
// 10's Generator WITHOUT the hooks, every KV block back in the pool. Blocks of 16 and of 32.
void engine_case(int64_t block_size) {
  const ModelWeights& w = testing::bundled_model<Device::CUDA>().w;
  constexpr int64_t kMaxContext = 512;
  const std::vector<int32_t> stop = {13};
  const auto requests = make_check_requests(40, 2, 200, 1, 32, workload_id_high(w.config), 43, 100, stop);
  const AloneResults alone = run_alone(w, requests, kMaxContext);  // no hook installed yet
  CountingHooks hooks;
  PagedKvOptions o;
  o.num_blocks = 40 * 512 / block_size;
  o.block_size = block_size;
  o.prefix_caching = true;
  Engine engine(w, testing::engine_config(48, 16, kMaxContext), paged_kv(o));
  engine.kv().attention().set_fast_prefill(true);
  const EngineRunResult run = run_requests(engine, requests);
  EXPECT_TRUE(run.events_ok) << run.events_error;
  const AloneCheck check = check_against_alone(w, requests, run, alone, kMaxContext);
  EXPECT_TRUE(check.pass()) << check.summary();
  std::printf("block size %lld: %s; paged kernel ran %lld times (declined %lld), fresh kernel %lld\n",
              static_cast<long long>(block_size), check.summary().c_str(),
              static_cast<long long>(g_paged_ran.load()), static_cast<long long>(g_paged_declined.load()),
              static_cast<long long>(g_fresh_ran.load()));
  EXPECT_GT(g_paged_ran.load(), g_fresh_ran.load()) << "most prefill steps should carry a cached prefix";
  EXPECT_EQ(g_paged_declined.load(), 0);
  const KvUsage u = engine.kv().usage();
  EXPECT_EQ(u.free_blocks, u.total_blocks);
}

TEST(FlashPaged15Gpu, EngineWithPrefixCachingAndChunksAgreesWithEachRequestAlone) {
  TVLLM_REQUIRE_HOPPER();
  engine_case(16);
  engine_case(32);
}

}  // namespace
}  // namespace tvllm
