// Lesson 12's paged KV cache on the GPU: the paged KV-write kernel (slot -1 skipped), the paged decode kernel
// (head_dim 64/80/128, GQA groups 1/4/8, contexts 1 to 5000 in one batch, forced and automatic splits, blocks of
// 16, 1 and 32), lesson 07's flash kernel over the pool (prefill, chunks, a prefix shared through the same
// blocks), paged == lesson 10's contiguous cache bit for bit, a created stream, a decode step (write + attention)
// captured in a CUDA graph and replayed after its tables and lengths were updated in place, the whole bundled model
// through PagedAttention vs CachedAttention, and the pool planned from the free memory. Every comparison prints its
// first mismatches. DISABLED_BenchPagedDecode1BShape is the benchmark (run it by name, see lessons/12_paged_attention/README.md).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "cached_attention.h"
#include "common/cuda_stream.h"
#include "common/errors.h"
#include "common/random.h"
#include "common/validate.h"
#include "kv_cache.h"
#include "model_dir.h"
#include "paged_attention.h"
#include "paged_kv.h"
#include "testing/attention_check.h"
#include "testing/paged_tables.h"
#include "testing/testing.h"
#include "transformer.h"

namespace tvllm {
namespace {

using testing::describe;
using testing::expect_close;
using testing::flash_tol;
using testing::kDecodeTol;
using testing::round_to_bf16;

using testing::shuffled_tables;

// The KV slot of every new token (the last q_len positions of each sequence), in the step's token order.
std::vector<int32_t> slots_for(const std::vector<int64_t>& q_lens, const std::vector<int64_t>& k_lens,
                               const std::vector<std::vector<int32_t>>& tables, int64_t bs) {
  std::vector<int32_t> slots;
  for (size_t b = 0; b < q_lens.size(); ++b)
    for (int64_t pos = k_lens[b] - q_lens[b]; pos < k_lens[b]; ++pos)
      slots.push_back(static_cast<int32_t>(tables[b][pos / bs] * bs + pos % bs));
  return slots;
}

int64_t longest(const std::vector<std::vector<int32_t>>& tables) {
  size_t n = 1;
  for (const auto& t : tables) n = std::max(n, t.size());
  return static_cast<int64_t>(n);
}

// One layer of pool on each side, holding the same (bf16-rounded) random keys and values in every slot.
struct Pools {
  PagedKvPool cpu, gpu;
  double max_v = 0.0;
  Pools(const AttentionShape& s, int64_t num_blocks, int64_t bs, uint64_t seed)
      : cpu(s, 1, num_blocks, bs, Device::CPU), gpu(s, 1, num_blocks, bs, Device::CUDA) {
    const auto n = static_cast<size_t>(num_blocks * bs * s.kv_dim());
    const std::vector<float> k = round_to_bf16(random_normal(n, seed));
    const std::vector<float> v = round_to_bf16(random_uniform(n, seed + 1));
    for (float x : v) max_v = std::max(max_v, static_cast<double>(std::fabs(x)));
    std::copy(k.begin(), k.end(), cpu.k(0).ptr<float>());
    std::copy(v.begin(), v.end(), cpu.v(0).ptr<float>());
    const Shape shape = cpu.k(0).shape;
    copy_view(gpu.k(0), Tensor::from_f32(k, shape, DType::BF16, Device::CUDA).view());
    copy_view(gpu.v(0), Tensor::from_f32(v, shape, DType::BF16, Device::CUDA).view());
    TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
  }
};

struct Attended {
  std::vector<float> gpu, cpu;
};

// The same attention on both devices: q random (bf16-rounded), outputs poisoned with NaN first.
// splits: 0 = paged_attention's own choice (decode_splits or flash), n > 0 = paged_decode_attention with n splits.
Attended attend_both(Pools& p, const AttentionShape& s, const std::vector<int64_t>& q_lens,
                     const std::vector<int64_t>& k_lens, const std::vector<std::vector<int32_t>>& tables, int splits,
                     uint64_t seed, cudaStream_t stream = nullptr) {
  const int64_t Tq = std::accumulate(q_lens.begin(), q_lens.end(), int64_t{0});
  const std::vector<float> q = round_to_bf16(random_normal(static_cast<size_t>(Tq * s.q_dim()), seed, 2.f));
  const auto B = static_cast<int64_t>(q_lens.size());
  const int64_t bs = p.cpu.block_size();
  const std::vector<int32_t> slots = slots_for(q_lens, k_lens, tables, bs);
  Attended r;
  for (Device d : {Device::CPU, Device::CUDA}) {
    const bool gpu = d == Device::CUDA;
    const PagedKvPool& pool = gpu ? p.gpu : p.cpu;
    const DType dt = gpu ? DType::BF16 : DType::F32;
    AttentionBatch batch(B, d);
    batch.set_lengths(q_lens, k_lens, stream);
    PagedStepTables t(std::max<int64_t>(Tq, 1), B, longest(tables), pool.num_blocks(), bs, d);
    t.set(slots, tables, stream);
    DecodeWorkspace ws(s, B, d);
    const Tensor qt = Tensor::from_f32(q, {Tq, s.q_dim()}, dt, d);
    const Tensor out = Tensor::from_f32(std::vector<float>(q.size(), NAN), {Tq, s.q_dim()}, dt, d);
    if (gpu) TVLLM_CUDA_CHECK(cudaDeviceSynchronize());  // set-up copies ran on the legacy stream
    if (splits > 0) paged_decode_attention(out, qt, pool.k(0), pool.v(0), batch, t, s, splits, &ws, stream);
    else paged_attention(out, qt, pool.k(0), pool.v(0), batch, t, s, &ws, stream);
    if (gpu) TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
    (gpu ? r.gpu : r.cpu) = to_f32_vector(out);
  }
  return r;
}

std::string name_of(const char* what, const AttentionShape& s, int64_t bs, int splits = -1) {
  std::string n = std::string(what) + " D " + std::to_string(s.head_dim) + " group " + std::to_string(s.group_size()) +
                  " block_size " + std::to_string(bs);
  if (splits >= 0) n += " splits " + std::to_string(splits);
  return n;
}

// ---- the write -------------------------------------------------------------------------------------------

TEST(PagedKvGpu, WriteMatchesCpu) {
  TVLLM_REQUIRE_GPU();
  // k, v: column views of a fused [T, q | k | v] buffer. Both pools start as NaN: every row the step does not write
  // (a -1 slot among them) must still be NaN, every one it writes must hold the token's row bit for bit.
  for (const AttentionShape& s : {AttentionShape{6, 2, 64}, AttentionShape{10, 2, 80}, AttentionShape{32, 8, 128}}) {
    const int64_t T = 9, W = s.qkv_dim(), bs = 16, blocks = 5;
    const std::vector<int32_t> slots{77, 3, -1, 16, 15, 0, -1, 79, 40};
    PagedKvPool cpu(s, 1, blocks, bs, Device::CPU), gpu(s, 1, blocks, bs, Device::CUDA);
    const std::vector<float> nan(static_cast<size_t>(blocks * bs * s.kv_dim()), NAN);
    std::copy(nan.begin(), nan.end(), cpu.k(0).ptr<float>());
    std::copy(nan.begin(), nan.end(), cpu.v(0).ptr<float>());
    copy_view(gpu.k(0), Tensor::from_f32(nan, cpu.k(0).shape, DType::BF16, Device::CUDA).view());
    copy_view(gpu.v(0), Tensor::from_f32(nan, cpu.k(0).shape, DType::BF16, Device::CUDA).view());
    const std::vector<float> qkv = round_to_bf16(random_normal(static_cast<size_t>(T * W), 11));
    for (Device d : {Device::CPU, Device::CUDA}) {
      PagedKvPool& pool = d == Device::CUDA ? gpu : cpu;
      const Tensor fused = Tensor::from_f32(qkv, {T, W}, d == Device::CUDA ? DType::BF16 : DType::F32, d);
      const QkvViews v = split_qkv(fused.view(), s);
      PagedStepTables tables(T, 1, 1, blocks, bs, d);
      tables.set(slots, {{0}});
      if (d == Device::CUDA) TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
      paged_kv_write(pool.k(0), pool.v(0), v.k, v.v, tables, s);
      if (d == Device::CUDA) TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
    }
    for (int which = 0; which < 2; ++which) {
      const TensorView a = which ? gpu.v(0) : gpu.k(0), b = which ? cpu.v(0) : cpu.k(0);
      const CompareResult r = compare(which ? "v pool" : "k pool", a, b, Tolerance{0, 0});
      std::ostringstream o;
      for (const Mismatch& m : r.first_mismatches)
        o << "\n  slot " << m.index / s.kv_dim() << " col " << m.index % s.kv_dim() << ": got " << m.actual
          << ", expected " << m.expected;
      EXPECT_TRUE(r.pass()) << "kv_dim " << s.kv_dim() << " " << r.name << ": bad " << r.bad << " of " << r.count << o.str();
    }
  }
}

// ---- decode -----------------------------------------------------------------------------------------------

TEST(PagedKvGpu, DecodeMatchesCpuForHeadDimsGroupsAndContexts) {
  TVLLM_REQUIRE_GPU();
  // One batch of very different lengths (1 key, a partial block, 1000, 5000), blocks shuffled over the pool, with a
  // sequence that brings no query at all (q_len 0: nothing to compute or write). Splits 0 = decode_splits() for
  // this GPU (53 for the 5000-key batch on 132 SMs), 64 = more splits than some sequences have keys.
  const std::vector<int64_t> q_lens{1, 1, 1, 0, 1}, k_lens{1, 17, 1000, 3, 5000};
  const int64_t bs = 16, blocks = 400;
  for (int64_t D : {64, 80, 128}) {
    for (int64_t group : {1, 4, 8}) {
      const AttentionShape s{2 * group, 2, D};
      Pools p(s, blocks, bs, 100 + D + group);
      const auto tables = shuffled_tables(k_lens, bs, blocks, D + group);
      for (int splits : {0, 1, 7, 64}) {
        const Attended r = attend_both(p, s, q_lens, k_lens, tables, splits, 7 + D);
        expect_close(r.gpu, r.cpu, s, kDecodeTol, name_of("decode", s, bs, splits));
      }
    }
  }
}

TEST(PagedKvGpu, DecodeMatchesCpuForBlockSizes1And32) {
  TVLLM_REQUIRE_GPU();
  // Blocks of 1 (every key its own table entry) and of 32; Llama 3.2 1B's heads (group 4, head_dim 64).
  const std::vector<int64_t> q_lens{1, 1, 1, 1}, k_lens{1, 17, 1000, 5000};
  const AttentionShape s{32, 8, 64};
  for (int64_t bs : {1, 32}) {
    const int64_t blocks = 6100 / bs + 8;
    Pools p(s, blocks, bs, 30 + bs);
    const auto tables = shuffled_tables(k_lens, bs, blocks, bs);
    for (int splits : {0, 1, 13}) {
      const Attended r = attend_both(p, s, q_lens, k_lens, tables, splits, 8);
      expect_close(r.gpu, r.cpu, s, kDecodeTol, name_of("decode", s, bs, splits));
    }
  }
}

// ---- prefill, chunks and prefix hits: flash over the pool --------------------------------------------------

TEST(PagedKvGpu, FlashOverBlocksMatchesCpu) {
  TVLLM_REQUIRE_GPU();
  // Prefill (q_len == k_len), chunks after earlier keys (q_len < k_len), a single query in a batch that is not all
  // decode, and a last sequence whose table starts with sequence 2's first 10 blocks of 16 (160 positions, a
  // prefix-cache hit): its 40 new queries attend to the shared keys through those blocks.
  const std::vector<int64_t> q_lens{77, 1, 200, 5, 40}, k_lens{77, 300, 1000, 5, 200};
  for (int64_t bs : {16, 1, 32}) {
    const int64_t blocks = 1700 / bs + 12;
    for (int64_t D : {64, 80, 128}) {
      for (int64_t group : {1, 4}) {
        const AttentionShape s{2 * group, 2, D};
        Pools p(s, blocks, bs, 50 + D + bs);
        const auto tables = shuffled_tables(k_lens, bs, blocks, 9 + bs, 2, 160 / bs);
        ASSERT_EQ(tables[4][0], tables[2][0]);
        const Attended r = attend_both(p, s, q_lens, k_lens, tables, 0, 9);
        expect_close(r.gpu, r.cpu, s, flash_tol(p.max_v), name_of("flash over blocks", s, bs));
      }
    }
  }
}

// ---- paged == contiguous ------------------------------------------------------------------------------------

TEST(PagedKvGpu, PagedEqualsContiguousOnTheGpu) {
  TVLLM_REQUIRE_GPU();
  // The same keys in lesson 10's cache (one slot per sequence) and in shuffled blocks of the pool: the paged decode
  // kernel and flash with the PagedKV policy return the contiguous kernels' bits (the same arithmetic in the same
  // order; only the addresses differ).
  const std::vector<int64_t> k_lens{1, 17, 1000, 300};
  const int64_t B = 4, bs = 16, blocks = 100, C = 1000;
  for (const AttentionShape& s : {AttentionShape{32, 8, 64}, AttentionShape{16, 4, 128}}) {
    Pools p(s, blocks, bs, 3);
    const auto tables = shuffled_tables(k_lens, bs, blocks, 4);
    // The contiguous cache: sequence b's position pos holds the pool's row for it.
    const int64_t kv = s.kv_dim();
    std::vector<float> ck(static_cast<size_t>(B * C * kv), 0.f), cv(ck.size(), 0.f);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t pos = 0; pos < k_lens[b]; ++pos) {
        const int64_t slot = tables[b][pos / bs] * bs + pos % bs;
        std::copy_n(p.cpu.k(0).ptr<const float>() + slot * kv, kv, ck.begin() + (b * C + pos) * kv);
        std::copy_n(p.cpu.v(0).ptr<const float>() + slot * kv, kv, cv.begin() + (b * C + pos) * kv);
      }
    KvCache cache(s, 1, B, C, Device::CUDA);
    copy_view(cache.k(0), Tensor::from_f32(ck, cache.k(0).shape, DType::BF16, Device::CUDA).view());
    copy_view(cache.v(0), Tensor::from_f32(cv, cache.k(0).shape, DType::BF16, Device::CUDA).view());
    CacheSlots cslots(B, B, Device::CUDA);
    cslots.set({0, 1, 2, 3});
    DecodeWorkspace ws(s, B, Device::CUDA);
    for (const std::vector<int64_t>& q_lens : {std::vector<int64_t>{1, 1, 1, 1}, std::vector<int64_t>{1, 17, 200, 5}}) {
      const bool decode = q_lens[1] == 1;
      const int64_t T = std::accumulate(q_lens.begin(), q_lens.end(), int64_t{0});
      AttentionBatch batch(B, Device::CUDA);
      batch.set_lengths(q_lens, k_lens);
      PagedStepTables t(T, B, longest(tables), blocks, bs, Device::CUDA);
      t.set(slots_for(q_lens, k_lens, tables, bs), tables);
      const Tensor q = Tensor::from_f32(round_to_bf16(random_normal(static_cast<size_t>(T * s.q_dim()), 5, 2.f)),
                                        {T, s.q_dim()}, DType::BF16, Device::CUDA);
      const std::vector<float> nan(static_cast<size_t>(T * s.q_dim()), NAN);
      for (int splits : decode ? std::vector<int>{1, 5} : std::vector<int>{0}) {
        const Tensor out_c = Tensor::from_f32(nan, {T, s.q_dim()}, DType::BF16, Device::CUDA);
        const Tensor out_p = Tensor::from_f32(nan, {T, s.q_dim()}, DType::BF16, Device::CUDA);
        TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
        if (decode) {
          decode_attention(out_c, q, cache.k(0), cache.v(0), batch, cslots, s, splits, &ws);
          paged_decode_attention(out_p, q, p.gpu.k(0), p.gpu.v(0), batch, t, s, splits, &ws);
        } else {
          cached_attention(out_c, q, cache.k(0), cache.v(0), batch, cslots, s, &ws);
          paged_attention(out_p, q, p.gpu.k(0), p.gpu.v(0), batch, t, s, &ws);
        }
        TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
        const std::vector<float> c = to_f32_vector(out_c), pg = to_f32_vector(out_p);
        for (float x : c) ASSERT_FALSE(std::isnan(x)) << "the contiguous kernel left an output unwritten";
        expect_close(pg, c, s, Tolerance{0, 0},
                     name_of(decode ? "paged == contiguous, decode" : "paged == contiguous, flash", s, bs, splits));
      }
    }
  }
}

// ---- streams and graphs ----------------------------------------------------------------------------------------

TEST(PagedKvGpu, OpsRunOnTheCallersStream) {
  TVLLM_REQUIRE_GPU();
  CudaStream stream;
  const AttentionShape s{8, 2, 64};
  const int64_t bs = 16, blocks = 60;
  Pools p(s, blocks, bs, 8);
  const std::vector<int64_t> k_lens{600, 33};
  const auto tables = shuffled_tables(k_lens, bs, blocks, 2);
  const Attended d = attend_both(p, s, {1, 1}, k_lens, tables, 0, 3, stream);
  expect_close(d.gpu, d.cpu, s, kDecodeTol, "decode on a stream");
  const Attended f = attend_both(p, s, {40, 3}, k_lens, tables, 0, 4, stream);
  expect_close(f.gpu, f.cpu, s, flash_tol(p.max_v), "flash on a stream");
}

TEST(PagedKvGpu, GraphOfADecodeStepReplaysTheEagerStep) {
  // One decode step of three sequences (the paged KV write of their new rows, then the paged decode kernel with 3
  // splits and its combine), captured ONCE with cudaStreamCaptureModeGlobal (an allocation or a synchronisation
  // inside would fail the capture), replayed over a poisoned output: the eager step's bits. Then the next step's
  // inputs are put in the same buffers (new q, k, v rows, every context one longer, and sequence 0's table one
  // block longer: position 48 opens its 4th block) and the SAME graph replays it: the eager step's bits again, and
  // the CPU path's answer (its own pool, written by the CPU write).
  TVLLM_REQUIRE_GPU();
  const AttentionShape s{32, 8, 64};
  const int64_t B = 3, bs = 16, blocks = 64, W = s.qkv_dim();
  CudaStream st;
  Pools p(s, blocks, bs, 21);  // every row holds an "earlier token" already
  std::vector<int64_t> k_lens{48, 101, 8};
  auto tables = shuffled_tables({64, 101, 8}, bs, blocks, 5);  // sequence 0 gets 4 blocks; step 1 uses 3
  const int32_t fourth = tables[0].back();
  tables[0].pop_back();

  const Tensor fused = Tensor::from_f32(std::vector<float>(static_cast<size_t>(B * W), 0.f), {B, W}, DType::BF16,
                                        Device::CUDA);
  const QkvViews views = split_qkv(fused.view(), s);
  const Tensor out = Tensor::from_f32(std::vector<float>(static_cast<size_t>(B * s.q_dim()), NAN), {B, s.q_dim()},
                                      DType::BF16, Device::CUDA);
  AttentionBatch batch(B, Device::CUDA);
  PagedStepTables t(B, B, 8, blocks, bs, Device::CUDA);
  DecodeWorkspace ws(s, B, Device::CUDA);
  // The CPU twin: the same pool contents, written by the CPU path.
  AttentionBatch cpu_batch(B, Device::CPU);
  PagedStepTables cpu_t(B, B, 8, blocks, bs, Device::CPU);
  const std::vector<int64_t> ones(B, 1);

  std::vector<float> step_qkv;
  const auto load_step = [&](uint64_t seed) {
    step_qkv = round_to_bf16(random_normal(static_cast<size_t>(B * W), seed));
    st.synchronize();
    copy_view(fused, Tensor::from_f32(step_qkv, {B, W}, DType::BF16, Device::CUDA).view());
    TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<int32_t> slots = slots_for(ones, k_lens, tables, bs);
    batch.set_lengths(ones, k_lens, st);
    t.set(slots, tables, st);
    // CPU: the same rows into the CPU pool.
    cpu_batch.set_lengths(ones, k_lens);
    cpu_t.set(slots, tables);
    const Tensor cpu_fused = Tensor::from_f32(step_qkv, {B, W}, DType::F32, Device::CPU);
    const QkvViews cv = split_qkv(cpu_fused.view(), s);
    paged_kv_write(p.cpu.k(0), p.cpu.v(0), cv.k, cv.v, cpu_t, s);
  };
  const auto run = [&] {
    paged_kv_write(p.gpu.k(0), p.gpu.v(0), views.k, views.v, t, s, st);
    paged_decode_attention(out, views.q, p.gpu.k(0), p.gpu.v(0), batch, t, s, 3, &ws, st);
  };
  const auto read_out = [&] {
    st.synchronize();
    return to_f32_vector(out);
  };
  const auto poison_out = [&] {
    TVLLM_CUDA_CHECK(cudaMemsetAsync(out.data(), 0xFF, out.view().nbytes(), st));  // bf16 0xFFFF: NaN
  };
  const auto cpu_answer = [&] {
    const Tensor cpu_fused = Tensor::from_f32(step_qkv, {B, W}, DType::F32, Device::CPU);
    Tensor o = Tensor::empty({B, s.q_dim()}, DType::F32, Device::CPU);
    paged_decode_attention(o, split_qkv(cpu_fused.view(), s).q, p.cpu.k(0), p.cpu.v(0), cpu_batch, cpu_t, s, 3, nullptr);
    return to_f32_vector(o);
  };

  // Step 1, eagerly, then captured and replayed.
  load_step(31);
  run();
  const std::vector<float> eager1 = read_out();
  expect_close(eager1, cpu_answer(), s, kDecodeTol, "step 1, eager vs cpu");
  const CudaGraph graph = CudaGraph::capture(st, run);
  EXPECT_EQ(graph.num_nodes(), 3u);  // write, decode, combine
  poison_out();
  graph.launch(st);
  const std::vector<float> replay1 = read_out();
  expect_close(replay1, eager1, s, Tolerance{0, 0}, "step 1, replay == eager");

  // Step 2: new rows, lengths and tables in the same device buffers (outside any capture); the graph first...
  for (int64_t& n : k_lens) ++n;
  tables[0].push_back(fourth);
  load_step(32);
  poison_out();
  graph.launch(st);
  const std::vector<float> replay2 = read_out();
  // ...then the same step eagerly (it rewrites the same slots with the same rows).
  poison_out();
  run();
  const std::vector<float> eager2 = read_out();
  expect_close(replay2, eager2, s, Tolerance{0, 0}, "step 2, replay == eager");
  expect_close(eager2, cpu_answer(), s, kDecodeTol, "step 2, eager vs cpu");
  EXPECT_FALSE(compare("step 2 != step 1", replay2, replay1, Tolerance{0, 0}).pass())
      << "the replay did not see the new step's inputs";
  // The pools agree too: the GPU write stored what the CPU write stored, nothing else changed.
  for (int which = 0; which < 2; ++which) {
    const CompareResult r = compare(which ? "v pool" : "k pool", which ? p.gpu.v(0) : p.gpu.k(0),
                                    which ? p.cpu.v(0) : p.cpu.k(0), Tolerance{0, 0});
    EXPECT_TRUE(r.pass()) << r.name << ": bad " << r.bad << " of " << r.count;
  }
}

// ---- the backend on the bundled model ----------------------------------------------------------------------

TEST(PagedKvGpu, BackendEqualsTheContiguousCacheOnTheBundledModel) {
  // As the CPU test: a 23-token prompt in two chunks beside a 9-token prompt and its first decode, then three greedy
  // decode steps, through lesson 10's CachedAttention and through PagedAttention over shuffled blocks of 16, on the
  // engine's stream. The same kernels but for the addressing: the same logits, bit for bit.
  TVLLM_REQUIRE_GPU();
  const ModelDir model = ModelDir::open(testing::tiny_model_dir());
  const ModelWeights w = ModelWeights::bind(model, Device::CUDA);
  const EngineLimits limits{64, 2, 2, 128};
  ExecContext ctx(w.config, limits, Device::CUDA);
  const cudaStream_t stream = ctx.stream();
  StepInputs step(w.config, limits, Device::CUDA);
  KvCache cache = KvCache::for_model(w.config, 2, 128, Device::CUDA);
  CachedAttention cached(cache, limits);
  cached.set_slots({0, 1}, stream);
  PagedKvPool pool = PagedKvPool::for_model(w.config, 12, 16, Device::CUDA);
  PagedAttention paged(pool, limits);
  std::vector<std::vector<int32_t>> tables{{7}, {11}};
  std::vector<int32_t> spare{5, 0, 9, 2};

  Rng rng(12);
  std::vector<int32_t> p0, p1;
  for (int i = 0; i < 23; ++i) p0.push_back(static_cast<int32_t>(rng.below(w.config.vocab_size)));
  for (int i = 0; i < 9; ++i) p1.push_back(static_cast<int32_t>(rng.below(w.config.vocab_size)));
  std::vector<int32_t> ids(p0.begin(), p0.begin() + 15);
  ids.insert(ids.end(), p1.begin(), p1.end());
  std::vector<int64_t> q_lens{15, 9}, k_lens{15, 9};
  const auto vocab = static_cast<size_t>(w.config.vocab_size);
  for (int s = 0; s < 5; ++s) {
    std::vector<int32_t> slot_mapping;
    for (int b = 0; b < 2; ++b) {
      while (static_cast<int64_t>(tables[b].size()) * 16 < k_lens[b]) {
        tables[b].push_back(spare.back());
        spare.pop_back();
      }
      for (int64_t pos = k_lens[b] - q_lens[b]; pos < k_lens[b]; ++pos)
        slot_mapping.push_back(tables[b][pos / 16] * 16 + static_cast<int32_t>(pos % 16));
    }
    const std::vector<int32_t> rows{static_cast<int32_t>(q_lens[0] - 1), static_cast<int32_t>(q_lens[0] + q_lens[1] - 1)};
    step.set(ids, q_lens, k_lens, rows, stream);
    const TensorView logits = forward(ctx, w, step, cached);
    ctx.synchronize();
    const std::vector<float> want = to_f32_vector(logits);
    paged.set_tables(slot_mapping, tables, stream);
    forward(ctx, w, step, paged);
    ctx.synchronize();
    const std::vector<float> got = to_f32_vector(logits);
    const CompareResult r = compare("step " + std::to_string(s), got, want, Tolerance{0, 0});
    ASSERT_TRUE(r.pass()) << r.name << ": max_abs " << r.max_abs << ", bad " << r.bad << " of " << r.count;
    std::vector<int32_t> next(2);
    for (size_t b = 0; b < 2; ++b)
      next[b] = static_cast<int32_t>(std::max_element(want.begin() + b * vocab, want.begin() + (b + 1) * vocab) -
                                     (want.begin() + b * vocab));
    if (s == 0) {
      ids.assign(p0.begin() + 15, p0.end());
      ids.push_back(next[1]);
      q_lens = {8, 1};
      k_lens = {23, 10};
    } else {
      ids = next;
      q_lens = {1, 1};
      ++k_lens[0];
      ++k_lens[1];
    }
  }
}

// ---- the pool's size -------------------------------------------------------------------------------------------

TEST(PagedKvGpu, PoolPlannedFromTheFreeMemory) {
  TVLLM_REQUIRE_GPU();
  const AttentionShape s{32, 8, 64};  // Llama 3.2 1B: 16 layers, 32 KiB per position, 512 KiB per block of 16
  const KvPoolPlan plan = PagedKvPool::plan(s, 16, 16, KvPoolBudget{0.5, size_t{256} << 20});
  EXPECT_EQ(plan.bytes_per_block, size_t{512} << 10);
  EXPECT_GT(plan.num_blocks, 0);
  EXPECT_LE(plan.num_blocks * plan.bytes_per_block, plan.budget_bytes);
  EXPECT_GT((plan.num_blocks + 1) * plan.bytes_per_block, plan.budget_bytes);
  EXPECT_NEAR(static_cast<double>(plan.budget_bytes), 0.5 * plan.free_bytes - (256 << 20), 1.0);
  EXPECT_NE(plan.describe().find("blocks x 16 positions"), std::string::npos) << plan.describe();
  std::printf("%s\n", plan.describe().c_str());

  // The model's pool from a small fraction: allocated, and the free memory went down by its size.
  const ModelDir model = ModelDir::open(testing::tiny_model_dir());
  size_t free_before = 0, free_after = 0, total = 0;
  TVLLM_CUDA_CHECK(cudaMemGetInfo(&free_before, &total));
  std::ostringstream log;
  {
    const PagedKvPool pool = PagedKvPool::fill_free_memory(model.config, 16, KvPoolBudget{0.05, 0}, &log);
    TVLLM_CUDA_CHECK(cudaMemGetInfo(&free_after, &total));
    EXPECT_EQ(pool.bytes(), static_cast<size_t>(pool.num_blocks()) * pool.bytes_per_block());
    EXPECT_NEAR(static_cast<double>(pool.bytes()), 0.05 * free_before, static_cast<double>(pool.bytes_per_block()) + 1);
    EXPECT_GE(free_before - free_after, pool.bytes());
    EXPECT_NE(log.str().find("KV pool plan: 0.05 x"), std::string::npos) << log.str();
  }
  std::printf("%s", log.str().c_str());
  EXPECT_THROW(PagedKvPool::plan(s, 16, 16, KvPoolBudget{0.0, 0}), InputError);
  EXPECT_THROW(PagedKvPool::plan(s, 16, 16, KvPoolBudget{1e-9, size_t{1} << 30}), InputError);  // nothing left
  EXPECT_THROW(PagedKvPool::plan(s, 16, 12, KvPoolBudget{}), InputError);  // not a power of two
  EXPECT_THROW(PagedKvPool(s, 1, 4, 12, Device::CUDA), InputError);
}

// ---- the benchmark (run by name: --gtest_also_run_disabled_tests --gtest_filter='*Bench*') ---------------------

TEST(PagedKvGpu, DISABLED_BenchPagedDecode1BShape) {
  TVLLM_REQUIRE_GPU();
  // Llama 3.2 1B's attention (32 heads, 8 kv heads of 64, 16 layers), 64 sequences of 2048 keys, blocks of 16.
  const PagedDecodeBench r = bench_paged_decode(AttentionShape{32, 8, 64}, 16, 64, 2048, 16, std::cout);
  EXPECT_GT(r.paged_gbs, 0.0);
  std::printf("paged decode: %.0f GB/s = %.1f%% of copy (%.0f GB/s); contiguous: %.0f GB/s = %.1f%%\n", r.paged_gbs,
              100.0 * r.paged_gbs / r.copy_gbs, r.copy_gbs, r.contiguous_gbs, 100.0 * r.contiguous_gbs / r.copy_gbs);
}

}  // namespace
}  // namespace tvllm
