// Issue 18, the sliding window (Mistral) on the GPU. Every kernel with a window against lesson 07's CPU reference
// (double, run on the same bf16-rounded inputs, test_12_sliding_window.cpp checks it against the mask itself):
//
//   lesson 07  v1 (materialised: the window in the softmax kernel) and v2 (flash: tiles before the window
//              skipped, its edge masked), head_dim 64 / 80 (padded tiles) / 128 / 256 (the CUDA-core kernel),
//              prefill across many 64-key tiles, chunks, decode rows packed per KV head (GQA)
//   lesson 10  the split decode kernel over the contiguous cache: the splits share only the window's keys (1, 2,
//              7, 64 splits and the automatic choice; windows of 1, shorter than a split, longer than the context)
//              and flash over the cache for chunks
//   lesson 12  the same kernels over shuffled blocks of the pool: the contiguous cache's bits exactly
//
// Windows: 1 (a query sees itself only), 5, 63/64/65 (around the 64-key tile), 100, 300 and 6000 (>= every
// context: the causal mask alone). GQA groups 1, 4 and 8. Skipped without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "attention.h"
#include "common/cublas.h"
#include "common/errors.h"
#include "common/random.h"
#include "common/validate.h"
#include "kv_cache.h"
#include "paged_kv.h"
#include "testing/attention_check.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

// The tolerances of lessons 07, 10 and 12 (testing/attention_check.h; test_07_attention_gpu.cpp derives them):
// decode rounds only the output to bf16, flash and v1 round P as well (up to 2^-8 * max|v| more). The window
// changes which keys are summed, not how: the bounds stand.
using testing::expect_close;
using testing::flash_tol;
using testing::kDecodeTol;
using testing::round_to_bf16;

int64_t total(const std::vector<int64_t>& x) { return std::accumulate(x.begin(), x.end(), int64_t{0}); }

AttentionShape with_window(AttentionShape s, int64_t window) {
  s.window = window;
  return s;
}

// One batch: q [Tq, q_dim] and packed k, v [Tk, kv_dim], bf16-rounded, and the CPU reference's answer.
struct Problem {
  AttentionShape shape;
  std::vector<int64_t> q_lens, k_lens;
  std::vector<float> q, k, v, expected;
  double max_v = 0.0;

  Problem(const AttentionShape& s, std::vector<int64_t> ql, std::vector<int64_t> kl, uint64_t seed)
      : shape(s), q_lens(std::move(ql)), k_lens(std::move(kl)) {
    q = round_to_bf16(random_normal(static_cast<size_t>(total(q_lens) * s.q_dim()), seed, 2.f));
    k = round_to_bf16(random_normal(static_cast<size_t>(total(k_lens) * s.kv_dim()), seed + 1));
    v = round_to_bf16(random_uniform(static_cast<size_t>(total(k_lens) * s.kv_dim()), seed + 2));
    for (float x : v) max_v = std::max(max_v, static_cast<double>(std::fabs(x)));
    const Tensor out = Tensor::from_f32(std::vector<float>(q.size(), NAN), {total(q_lens), s.q_dim()}, DType::F32,
                                        Device::CPU);
    attention(out, cpu(q, s.q_dim()), cpu(k, s.kv_dim()), cpu(v, s.kv_dim()),
              AttentionBatch::with_lengths(q_lens, k_lens, Device::CPU), s);
    expected = to_f32_vector(out);
  }
  Tensor cpu(const std::vector<float>& x, int64_t cols) const {
    return Tensor::from_f32(x, {static_cast<int64_t>(x.size()) / cols, cols}, DType::F32, Device::CPU);
  }
  Tensor gpu(const std::vector<float>& x, int64_t cols) const {
    return Tensor::from_f32(x, {static_cast<int64_t>(x.size()) / cols, cols}, DType::BF16, Device::CUDA);
  }
  Tensor nan_out() const {
    return Tensor::from_f32(std::vector<float>(q.size(), NAN), {total(q_lens), shape.q_dim()}, DType::BF16,
                            Device::CUDA);
  }
};

std::string name_of(const std::string& what, const AttentionShape& s, int splits = -1) {
  std::string n = what + " window " + std::to_string(s.window) + " D " + std::to_string(s.head_dim) + " group " +
                  std::to_string(s.group_size());
  if (splits >= 0) n += " splits " + std::to_string(splits);
  return n;
}

// ---- lesson 07: packed k and v --------------------------------------------------------------------------------

std::vector<float> run_lesson07(const Problem& p, AttentionKernel kernel) {
  const AttentionShape& s = p.shape;
  AttentionBatch batch(static_cast<int64_t>(p.q_lens.size()), Device::CUDA);
  batch.set_lengths(p.q_lens, p.k_lens);
  const Tensor q = p.gpu(p.q, s.q_dim()), k = p.gpu(p.k, s.kv_dim()), v = p.gpu(p.v, s.kv_dim());
  const Tensor out = p.nan_out();
  std::unique_ptr<CublasHandle> cublas;
  std::unique_ptr<AttentionWorkspace> ws;
  if (kernel == AttentionKernel::V1Materialized) {
    cublas = std::make_unique<CublasHandle>();
    ws = std::make_unique<AttentionWorkspace>(
        s, AttentionLimits{batch.batch_size(), batch.max_q_len(), batch.max_k_len()}, kernel, cublas.get());
  }
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
  attention(out, q, k, v, batch, s, kernel, ws.get());
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
  return to_f32_vector(out);
}

TEST(SlidingWindow12Gpu, Lesson07KernelsMatchCpu) {
  TVLLM_REQUIRE_GPU();
  // A 300-token prefill (5 query tiles of 64; a narrow window skips most key tiles), a decode row at 700, a
  // 40-query chunk after 160 keys, an empty sequence, a 77-token prefill.
  const std::vector<int64_t> q_lens{300, 1, 40, 0, 77}, k_lens{300, 700, 200, 3, 77};
  for (const AttentionShape& base : {AttentionShape{8, 2, 64}, AttentionShape{8, 8, 128}, AttentionShape{8, 1, 80},
                                     AttentionShape{4, 2, 256}}) {
    for (int64_t window : {1, 5, 63, 64, 65, 100, 6000}) {
      const Problem p(with_window(base, window), q_lens, k_lens, 7 + window + base.head_dim);
      for (AttentionKernel kernel : {AttentionKernel::V1Materialized, AttentionKernel::V2Flash}) {
        const std::string what = std::string("lesson 07 ") + std::string(attention_kernel_name(kernel));
        expect_close(run_lesson07(p, kernel), p.expected, p.shape, flash_tol(p.max_v), name_of(what, p.shape));
      }
    }
  }
}

TEST(SlidingWindow12Gpu, Lesson07DecodeRowsPackedPerKvHeadMatchCpu) {
  TVLLM_REQUIRE_GPU();
  // Every q_len 1 with GQA: v2 takes the group's query heads as the rows of one tile (rows_per_query).
  for (int64_t group : {4, 8}) {
    for (int64_t window : {1, 5, 64, 100, 6000}) {
      const Problem p(with_window(AttentionShape{2 * group, 2, 64}, window), {1, 1, 1, 1}, {1, 63, 130, 2000},
                      11 + group + window);
      expect_close(run_lesson07(p, AttentionKernel::V2Flash), p.expected, p.shape, flash_tol(p.max_v),
                   name_of("lesson 07 v2 decode", p.shape));
    }
  }
}

// ---- lesson 10: the contiguous cache, lesson 12: the pool ----------------------------------------------------

// The cache with sequence b in slot b, and a pool holding the same rows in shuffled blocks of 16.
struct Caches {
  KvCache cache;
  CacheSlots slots;
  PagedKvPool pool;
  PagedStepTables tables;
  DecodeWorkspace ws;
  AttentionBatch batch;

  static constexpr int64_t kBlock = 16;
  static int64_t context(const Problem& p) { return *std::max_element(p.k_lens.begin(), p.k_lens.end()); }
  static int64_t blocks_for(const Problem& p) {
    int64_t n = 0;
    for (int64_t k : p.k_lens) n += (k + kBlock - 1) / kBlock;
    return n;
  }

  explicit Caches(const Problem& p)
      : cache(p.shape, 1, static_cast<int64_t>(p.k_lens.size()), context(p), Device::CUDA),
        slots(static_cast<int64_t>(p.k_lens.size()), static_cast<int64_t>(p.k_lens.size()), Device::CUDA),
        pool(p.shape, 1, blocks_for(p), kBlock, Device::CUDA),
        tables(std::max<int64_t>(total(p.q_lens), 1), static_cast<int64_t>(p.k_lens.size()),
               (context(p) + kBlock - 1) / kBlock, blocks_for(p), kBlock, Device::CUDA),
        ws(p.shape, static_cast<int64_t>(p.k_lens.size()), Device::CUDA),
        batch(static_cast<int64_t>(p.k_lens.size()), Device::CUDA) {
    const AttentionShape& s = p.shape;
    const auto B = static_cast<int64_t>(p.k_lens.size());
    const int64_t C = context(p), kv = s.kv_dim(), num_blocks = blocks_for(p);
    // Blocks handed out in a shuffled order, so that no sequence's blocks are in order.
    std::vector<int32_t> order(static_cast<size_t>(num_blocks));
    std::iota(order.begin(), order.end(), 0);
    Rng rng(static_cast<uint64_t>(num_blocks) + 3);
    for (size_t i = order.size() - 1; i > 0; --i) std::swap(order[i], order[rng.below(static_cast<int64_t>(i) + 1)]);
    std::vector<float> ck(static_cast<size_t>(B * C * kv), 0.f), cv(ck.size(), 0.f);
    std::vector<float> pk(static_cast<size_t>(num_blocks * kBlock * kv), 0.f), pv(pk.size(), 0.f);
    std::vector<std::vector<int32_t>> block_tables(static_cast<size_t>(B));
    std::vector<int32_t> slot_mapping;
    size_t next = 0;
    int64_t k_row = 0;
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t pos = 0; pos < p.k_lens[b]; ++pos) {
        if (pos % kBlock == 0) block_tables[b].push_back(order.at(next++));
        const int64_t slot = block_tables[b].back() * kBlock + pos % kBlock;
        std::copy_n(p.k.begin() + (k_row + pos) * kv, kv, ck.begin() + (b * C + pos) * kv);
        std::copy_n(p.v.begin() + (k_row + pos) * kv, kv, cv.begin() + (b * C + pos) * kv);
        std::copy_n(p.k.begin() + (k_row + pos) * kv, kv, pk.begin() + slot * kv);
        std::copy_n(p.v.begin() + (k_row + pos) * kv, kv, pv.begin() + slot * kv);
        if (pos >= p.k_lens[b] - p.q_lens[b]) slot_mapping.push_back(static_cast<int32_t>(slot));
      }
      k_row += p.k_lens[b];
    }
    copy_view(cache.k(0), Tensor::from_f32(ck, cache.k(0).shape, DType::BF16, Device::CUDA).view());
    copy_view(cache.v(0), Tensor::from_f32(cv, cache.k(0).shape, DType::BF16, Device::CUDA).view());
    copy_view(pool.k(0), Tensor::from_f32(pk, pool.k(0).shape, DType::BF16, Device::CUDA).view());
    copy_view(pool.v(0), Tensor::from_f32(pv, pool.k(0).shape, DType::BF16, Device::CUDA).view());
    std::vector<int32_t> ids(static_cast<size_t>(B));
    std::iota(ids.begin(), ids.end(), 0);
    slots.set(ids);
    tables.set(slot_mapping, block_tables);
    batch.set_lengths(p.q_lens, p.k_lens);
    TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
  }
};

struct Both {
  std::vector<float> contiguous, paged;
};

// splits > 0: the split decode kernel with that many splits; 0: cached_attention / paged_attention's own choice
// (decode_splits() for a decode step, flash otherwise).
Both run_caches(const Problem& p, Caches& c, int splits) {
  const AttentionShape& s = p.shape;
  const Tensor q = p.gpu(p.q, s.q_dim());
  const Tensor out_c = p.nan_out(), out_p = p.nan_out();
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
  if (splits > 0) {
    decode_attention(out_c, q, c.cache.k(0), c.cache.v(0), c.batch, c.slots, s, splits, &c.ws);
    paged_decode_attention(out_p, q, c.pool.k(0), c.pool.v(0), c.batch, c.tables, s, splits, &c.ws);
  } else {
    cached_attention(out_c, q, c.cache.k(0), c.cache.v(0), c.batch, c.slots, s, &c.ws);
    paged_attention(out_p, q, c.pool.k(0), c.pool.v(0), c.batch, c.tables, s, &c.ws);
  }
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
  return {to_f32_vector(out_c), to_f32_vector(out_p)};
}

TEST(SlidingWindow12Gpu, SplitDecodeOverTheWindowMatchesCpuAndPagedEqualsContiguous) {
  TVLLM_REQUIRE_GPU();
  // Contexts 1, 17, 1000 and 5000 in one decode batch. 7 splits of a 5000-key context without a window are 715
  // keys each; with a window of 100 the splits share those 100 keys (15 each), with a window of 5 most splits
  // are empty, with a window of 1 the query reads its own key only. 64 splits: more than the window has keys.
  // Split decode returns the same fp32 arithmetic whichever cache it reads: paged == contiguous bit for bit.
  const std::vector<int64_t> q_lens{1, 1, 1, 1}, k_lens{1, 17, 1000, 5000};
  for (int64_t D : {64, 128}) {
    for (int64_t group : {1, 4, 8}) {
      for (int64_t window : {1, 5, 64, 100, 300, 6000}) {
        const Problem p(with_window(AttentionShape{2 * group, 2, D}, window), q_lens, k_lens, D + group + window);
        Caches c(p);
        for (int splits : {0, 1, 2, 7, 64}) {
          const Both r = run_caches(p, c, splits);
          expect_close(r.contiguous, p.expected, p.shape, kDecodeTol, name_of("lesson 10 decode", p.shape, splits));
          expect_close(r.paged, r.contiguous, p.shape, Tolerance{0, 0},
                       name_of("lesson 12 paged == contiguous, decode", p.shape, splits));
        }
      }
    }
  }
}

TEST(SlidingWindow12Gpu, FlashOverTheCachesMatchesCpuAndPagedEqualsContiguous) {
  TVLLM_REQUIRE_GPU();
  // Chunks through the cache (a prefix-cache hit looks the same to the kernel: the earlier keys are already
  // there), a prefill, and a decode row in a batch that is not all decode (so flash runs it).
  const std::vector<int64_t> q_lens{40, 77, 1, 200}, k_lens{200, 77, 300, 1000};
  for (int64_t D : {64, 128}) {
    for (int64_t group : {1, 4}) {
      for (int64_t window : {1, 5, 63, 65, 100, 6000}) {
        const Problem p(with_window(AttentionShape{2 * group, 2, D}, window), q_lens, k_lens, 3 * D + group + window);
        Caches c(p);
        const Both r = run_caches(p, c, 0);
        expect_close(r.contiguous, p.expected, p.shape, flash_tol(p.max_v), name_of("lesson 10 flash", p.shape));
        expect_close(r.paged, r.contiguous, p.shape, Tolerance{0, 0},
                     name_of("lesson 12 paged == contiguous, flash", p.shape));
      }
    }
  }
}

}  // namespace
}  // namespace tvllm
