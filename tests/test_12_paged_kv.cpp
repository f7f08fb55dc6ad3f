// Lesson 12's paged KV cache on the CPU: the pool's layout and sizes, the step tables and their checks, the paged
// KV write, and the paged attention == lesson 10's contiguous cache for the same sequences, bit for bit: blocks
// shuffled over the pool, block sizes 16, 1 and 32, contexts that end mid-block, prefill, chunks and decode in
// one run, a prefix shared by two sequences through the same blocks, and the whole bundled model through
// PagedAttention vs CachedAttention.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "cached_attention.h"
#include "common/errors.h"
#include "common/random.h"
#include "common/validate.h"
#include "kv_cache.h"
#include "model_dir.h"
#include "paged_attention.h"
#include "paged_kv.h"
#include "testing/testing.h"
#include "transformer.h"

namespace tvllm {
namespace {

const AttentionShape kShape{6, 2, 16};  // a group of 3: GQA with a group that is not a power of two

std::string describe(const CompareResult& r) {
  std::ostringstream o;
  o << r.name << ": max_abs " << r.max_abs << ", bad " << r.bad << " of " << r.count;
  for (const Mismatch& m : r.first_mismatches) o << "\n  [" << m.index << "] got " << m.actual << ", expected " << m.expected;
  if (!r.error.empty()) o << "\n  " << r.error;
  return o.str();
}

// ---- the pool and the tables ----------------------------------------------------------------------------

TEST(PagedKv12, PoolSizesLayoutAndDescription) {
  const PagedKvPool pool(kShape, 2, 5, 16, Device::CPU);
  EXPECT_EQ(pool.bytes_per_block(), size_t{2} * 2 * 16 * 32 * 4);  // layers x (k, v) x positions x kv_dim x fp32
  EXPECT_EQ(pool.bytes(), 5 * pool.bytes_per_block());
  EXPECT_EQ(PagedKvPool::bytes_per_block(kShape, 2, 16, Device::CUDA), pool.bytes_per_block() / 2);  // bf16
  EXPECT_EQ(pool.num_slots(), 80);
  const TensorView k0 = pool.k(0), v0 = pool.v(0), k1 = pool.k(1);
  EXPECT_EQ(k0.shape, (Shape{5, 16, 32}));
  EXPECT_TRUE(k0.is_contiguous());
  EXPECT_EQ(static_cast<char*>(v0.data) - static_cast<char*>(k0.data), static_cast<ptrdiff_t>(pool.layer_bytes()));
  EXPECT_EQ(static_cast<char*>(k1.data) - static_cast<char*>(k0.data), static_cast<ptrdiff_t>(2 * pool.layer_bytes()));
  EXPECT_NE(pool.describe().find("2 layers x 2 (k, v) x 5 blocks x 16 positions x 32 (2 kv heads x 16) x F32"),
            std::string::npos)
      << pool.describe();
  EXPECT_THROW(pool.k(2), InputError);
  // Any block size on the CPU (the kernels want a power of two; the reference does not care).
  EXPECT_EQ(PagedKvPool(kShape, 1, 3, 12, Device::CPU).num_slots(), 36);
}

TEST(PagedKv12, BadSizesAreInputErrors) {
  EXPECT_THROW(PagedKvPool(kShape, 0, 5, 16, Device::CPU), InputError);
  EXPECT_THROW(PagedKvPool(kShape, 1, 0, 16, Device::CPU), InputError);
  EXPECT_THROW(PagedKvPool(kShape, 1, 5, 0, Device::CPU), InputError);
  EXPECT_THROW(PagedKvPool(kShape, 1, int64_t{1} << 28, 16, Device::CPU), InputError);  // 2^32 slots: not int32
  EXPECT_THROW(PagedKvPool(AttentionShape{6, 4, 16}, 1, 5, 16, Device::CPU), InputError);
  EXPECT_THROW(PagedStepTables(0, 1, 1, 1, 16, Device::CPU), InputError);
  EXPECT_THROW(PagedStepTables(8, 0, 1, 1, 16, Device::CPU), InputError);
  EXPECT_THROW(PagedStepTables(8, 1, 0, 1, 16, Device::CPU), InputError);
}

TEST(PagedKv12, TablesAreValidatedAndABadSetChangesNothing) {
  PagedStepTables t(4, 2, 3, 10, 16, Device::CPU);  // 160 slots
  t.set({5, -1, 159}, {{3, 9}, {0}});
  EXPECT_EQ(t.num_tokens(), 3);
  EXPECT_EQ(t.num_sequences(), 2);
  EXPECT_EQ(t.table_len(0), 2);
  EXPECT_EQ(t.host_block_table(0)[1], 9);
  EXPECT_EQ(t.host_slot_mapping()[2], 159);
  EXPECT_THROW(t.set({160}, {{0}}), InputError);                 // slot past the pool
  EXPECT_THROW(t.set({-2}, {{0}}), InputError);                  // only -1 means "skip"
  EXPECT_THROW(t.set({0}, {{10}}), InputError);                  // block past the pool
  EXPECT_THROW(t.set({0}, {{-1}}), InputError);
  EXPECT_THROW(t.set({0}, {{0, 1, 2, 3}}), InputError);          // more than max_blocks_per_seq
  EXPECT_THROW(t.set({0, 1, 2, 3, 4}, {{0}}), InputError);       // more than max_tokens
  EXPECT_THROW(t.set({0}, {{0}, {1}, {2}}), InputError);         // more than max_sequences
  EXPECT_THROW(t.set({0}, {}), InputError);                      // no sequence
  // Still the first step.
  EXPECT_EQ(t.num_tokens(), 3);
  EXPECT_EQ(t.host_slot_mapping()[0], 5);
  EXPECT_EQ(t.table_len(1), 1);
  EXPECT_EQ(t.host_block_table(0)[0], 3);
}

TEST(PagedKv12, StepChecksCatchTablesThatDoNotFitTheStep) {
  PagedStepTables t(8, 2, 4, 10, 4, Device::CPU);  // blocks of 4
  AttentionBatch batch(2, Device::CPU);
  batch.set_lengths({2, 1}, {6, 1});  // sequence 0: positions 4, 5 new; sequence 1: position 0
  t.set({9 * 4 + 0, 9 * 4 + 1, 2 * 4}, {{7, 9}, {2}});
  EXPECT_NO_THROW(check_paged_step(batch, t, "test"));
  t.set({-1, -1, -1}, {{7, 9}, {2}});  // padding: nothing stored, still consistent
  EXPECT_NO_THROW(check_paged_step(batch, t, "test"));
  t.set({9 * 4 + 0, 9 * 4 + 2, 2 * 4}, {{7, 9}, {2}});  // position 5 is slot 37, not 38
  EXPECT_THROW(check_paged_step(batch, t, "test"), InputError);
  t.set({9 * 4 + 0, 9 * 4 + 1, 2 * 4}, {{7}, {2}});  // 6 positions need 2 blocks of 4
  EXPECT_THROW(check_paged_step(batch, t, "test"), InputError);
  t.set({9 * 4 + 0, 9 * 4 + 1}, {{7, 9}, {2}});  // a slot for 2 tokens, the step has 3
  EXPECT_THROW(check_paged_step(batch, t, "test"), InputError);
  t.set({9 * 4 + 0, 9 * 4 + 1, 2 * 4}, {{7, 9}});  // one table, two sequences
  EXPECT_THROW(check_paged_step(batch, t, "test"), InputError);
}

// ---- the write --------------------------------------------------------------------------------------------

TEST(PagedKv12, WriteStoresRowsAtTheirSlots) {
  // k, v: column views of a fused [T, q | k | v] buffer. The pool starts as NaN: every row the step does not write
  // (a -1 slot included) must still be NaN, every one it writes must hold its token's row exactly.
  const int64_t T = 5, W = kShape.qkv_dim(), kv = kShape.kv_dim(), bs = 4, blocks = 6;
  PagedKvPool pool(kShape, 1, blocks, bs, Device::CPU);
  const auto rows = blocks * bs * kv;
  std::fill(pool.k(0).ptr<float>(), pool.k(0).ptr<float>() + rows, NAN);
  std::fill(pool.v(0).ptr<float>(), pool.v(0).ptr<float>() + rows, NAN);
  const std::vector<float> qkv = random_normal(static_cast<size_t>(T * W), 3);
  const Tensor fused = Tensor::from_f32(qkv, {T, W}, DType::F32, Device::CPU);
  const QkvViews views = split_qkv(fused.view(), kShape);
  PagedStepTables tables(T, 1, blocks, blocks, bs, Device::CPU);
  const std::vector<int32_t> slots{22, 3, -1, 4, 17};
  tables.set(slots, {{0}});
  paged_kv_write(pool.k(0), pool.v(0), views.k, views.v, tables, kShape);
  std::vector<int> written(static_cast<size_t>(blocks * bs), -1);  // slot -> token
  for (int t = 0; t < T; ++t)
    if (slots[t] >= 0) written[slots[t]] = t;
  for (int64_t s = 0; s < blocks * bs; ++s) {
    for (int64_t c = 0; c < kv; ++c) {
      const float k = pool.k(0).ptr<float>()[s * kv + c], v = pool.v(0).ptr<float>()[s * kv + c];
      if (written[s] < 0) {
        ASSERT_TRUE(std::isnan(k) && std::isnan(v)) << "slot " << s << " was written";
      } else {
        const int64_t t = written[s];
        ASSERT_EQ(k, qkv[t * W + kShape.q_dim() + c]) << "slot " << s << " col " << c;
        ASSERT_EQ(v, qkv[t * W + kShape.q_dim() + kv + c]) << "slot " << s << " col " << c;
      }
    }
  }
  // Rows that do not match the slot mapping: refused before anything is written.
  EXPECT_THROW(paged_kv_write(pool.k(0), pool.v(0), views.k.rows(0, 4), views.v.rows(0, 4), tables, kShape), InputError);
}

// ---- paged == contiguous ------------------------------------------------------------------------------------

// Sequences whose keys, values and queries are fixed per position, run step by step through lesson 10's cache
// (one slot each) and through a pool whose blocks are handed out in a shuffled order. Every step: both write the
// step's rows, both attend; the outputs must be equal bit for bit (the CPU paths do the same arithmetic in the
// same order; only the addresses differ).
class Twin {
 public:
  Twin(const AttentionShape& s, int64_t block_size, int64_t num_seqs, int64_t max_context, uint64_t seed)
      : s_(s),
        bs_(block_size),
        B_(num_seqs),
        C_(max_context),
        cache_(s, 1, num_seqs, max_context, Device::CPU),
        pool_(s, 1, num_seqs * ((max_context + block_size - 1) / block_size) + 3, block_size, Device::CPU),
        tables_(static_cast<size_t>(num_seqs)) {
    free_.resize(static_cast<size_t>(pool_.num_blocks()));
    std::iota(free_.begin(), free_.end(), 0);
    Rng rng(seed);
    for (size_t i = free_.size() - 1; i > 0; --i) std::swap(free_[i], free_[rng.below(static_cast<int64_t>(i) + 1)]);
    for (int64_t b = 0; b < B_; ++b) {
      k_.push_back(random_normal(static_cast<size_t>(C_ * s.kv_dim()), seed + 10 * b + 1));
      v_.push_back(random_uniform(static_cast<size_t>(C_ * s.kv_dim()), seed + 10 * b + 2));
      q_.push_back(random_normal(static_cast<size_t>(C_ * s.q_dim()), seed + 10 * b + 3, 2.f));
    }
    const size_t n = cache_.bytes() / 4 / 2;  // NaN everywhere: a key read before it was written shows
    std::fill(cache_.k(0).ptr<float>(), cache_.k(0).ptr<float>() + n, NAN);
    std::fill(cache_.v(0).ptr<float>(), cache_.v(0).ptr<float>() + n, NAN);
    const size_t m = pool_.bytes() / 4 / 2;
    std::fill(pool_.k(0).ptr<float>(), pool_.k(0).ptr<float>() + m, NAN);
    std::fill(pool_.v(0).ptr<float>(), pool_.v(0).ptr<float>() + m, NAN);
  }

  // Sequence `to` starts with the first `blocks` blocks of sequence `from` (a prefix-cache hit): the same
  // blocks in its table, the same keys and values at those positions (copied into its contiguous slot too).
  void share_prefix(int from, int to, int64_t blocks) {
    const int64_t n = blocks * bs_, kv = s_.kv_dim();
    ASSERT_GE(static_cast<int64_t>(tables_[from].size()), blocks);
    tables_[to].assign(tables_[from].begin(), tables_[from].begin() + blocks);
    std::copy(k_[from].begin(), k_[from].begin() + n * kv, k_[to].begin());
    std::copy(v_[from].begin(), v_[from].begin() + n * kv, v_[to].begin());
    std::memcpy(cache_.k(0).ptr<float>() + to * C_ * kv, k_[to].data(), n * kv * sizeof(float));
    std::memcpy(cache_.v(0).ptr<float>() + to * C_ * kv, v_[to].data(), n * kv * sizeof(float));
  }

  // One step: sequence b brings q_lens[b] new tokens, ending at k_lens[b]. Returns {paged, contiguous} outputs.
  std::pair<std::vector<float>, std::vector<float>> step(const std::vector<int64_t>& q_lens,
                                                         const std::vector<int64_t>& k_lens, int forced_splits = 0) {
    const int64_t T = std::accumulate(q_lens.begin(), q_lens.end(), int64_t{0});
    const int64_t W = s_.qkv_dim(), kv = s_.kv_dim();
    std::vector<float> qkv(static_cast<size_t>(T * W));
    std::vector<int32_t> slot_mapping;
    int64_t t = 0;
    for (int64_t b = 0; b < B_; ++b) {
      while (static_cast<int64_t>(tables_[b].size()) * bs_ < k_lens[b]) {  // room for the new positions
        tables_[b].push_back(free_.back());
        free_.pop_back();
      }
      for (int64_t pos = k_lens[b] - q_lens[b]; pos < k_lens[b]; ++pos, ++t) {
        std::copy_n(q_[b].begin() + pos * s_.q_dim(), s_.q_dim(), qkv.begin() + t * W);
        std::copy_n(k_[b].begin() + pos * kv, kv, qkv.begin() + t * W + s_.q_dim());
        std::copy_n(v_[b].begin() + pos * kv, kv, qkv.begin() + t * W + s_.q_dim() + kv);
        slot_mapping.push_back(static_cast<int32_t>(tables_[b][pos / bs_] * bs_ + pos % bs_));
      }
    }
    const Tensor fused = Tensor::from_f32(qkv, {T, W}, DType::F32, Device::CPU);
    const QkvViews views = split_qkv(fused.view(), s_);
    AttentionBatch batch(B_, Device::CPU);
    batch.set_lengths(q_lens, k_lens);
    DecodeWorkspace ws(s_, B_, Device::CPU);

    // Lesson 10: one slot per sequence.
    CacheSlots slots(B_, B_, Device::CPU);
    std::vector<int32_t> ids(static_cast<size_t>(B_));
    std::iota(ids.begin(), ids.end(), 0);
    slots.set(ids);
    Tensor out_c = Tensor::from_f32(std::vector<float>(static_cast<size_t>(T * s_.q_dim()), NAN), {T, s_.q_dim()},
                                    DType::F32, Device::CPU);
    kv_cache_write(cache_.k(0), cache_.v(0), views.k, views.v, batch, slots, s_);
    if (forced_splits > 0) decode_attention(out_c, views.q, cache_.k(0), cache_.v(0), batch, slots, s_, forced_splits, &ws);
    else cached_attention(out_c, views.q, cache_.k(0), cache_.v(0), batch, slots, s_, &ws);

    // Lesson 12: the slot mapping and the block tables.
    PagedStepTables tables(std::max<int64_t>(T, 1), B_, pool_.num_blocks(), pool_.num_blocks(), bs_, Device::CPU);
    tables.set(slot_mapping, tables_);
    Tensor out_p = Tensor::from_f32(std::vector<float>(static_cast<size_t>(T * s_.q_dim()), NAN), {T, s_.q_dim()},
                                    DType::F32, Device::CPU);
    paged_kv_write(pool_.k(0), pool_.v(0), views.k, views.v, tables, s_);
    if (forced_splits > 0)
      paged_decode_attention(out_p, views.q, pool_.k(0), pool_.v(0), batch, tables, s_, forced_splits, &ws);
    else paged_attention(out_p, views.q, pool_.k(0), pool_.v(0), batch, tables, s_, &ws);
    return {to_f32_vector(out_p), to_f32_vector(out_c)};
  }

  // Every position each sequence holds: the pool's row (through the table) == the cache's row.
  void expect_same_rows(const std::vector<int64_t>& lens) const {
    const int64_t kv = s_.kv_dim();
    for (int64_t b = 0; b < B_; ++b) {
      for (int64_t pos = 0; pos < lens[b]; ++pos) {
        const int64_t slot = tables_[b][pos / bs_] * bs_ + pos % bs_;
        for (int which = 0; which < 2; ++which) {
          const float* p = (which ? pool_.v(0) : pool_.k(0)).ptr<const float>() + slot * kv;
          const float* c = (which ? cache_.v(0) : cache_.k(0)).ptr<const float>() + (b * C_ + pos) * kv;
          ASSERT_EQ(std::memcmp(p, c, kv * sizeof(float)), 0) << "sequence " << b << " position " << pos;
        }
      }
    }
  }
  const std::vector<std::vector<int32_t>>& tables() const { return tables_; }

 private:
  AttentionShape s_;
  int64_t bs_, B_, C_;
  KvCache cache_;
  PagedKvPool pool_;
  std::vector<std::vector<int32_t>> tables_;
  std::vector<int32_t> free_;  // shuffled: blocks are handed out in no order
  std::vector<std::vector<float>> k_, v_, q_;  // per sequence, per position
};

void expect_equal(const std::pair<std::vector<float>, std::vector<float>>& r, const std::string& name) {
  const CompareResult c = compare(name, r.first, r.second, Tolerance{0, 0});
  EXPECT_TRUE(c.pass()) << describe(c);
  for (float x : r.first) ASSERT_FALSE(std::isnan(x)) << name << ": an output was not written";
}

// Prefill in chunks, a mixed step (a chunk beside decodes: the flash/prefill path), then decode steps; contexts
// end mid-block (37, 17, 6, 51 for blocks of 16).
void run_paged_equals_contiguous(int64_t block_size) {
  const std::string bs = "block_size " + std::to_string(block_size);
  Twin twin(kShape, block_size, 4, 64, 40 + block_size);
  expect_equal(twin.step({20, 16, 5, 50}, {20, 16, 5, 50}), bs + ", prefill");
  expect_equal(twin.step({17, 1, 1, 1}, {37, 17, 6, 51}), bs + ", a chunk beside decodes");
  std::vector<int64_t> lens{37, 17, 6, 51};
  for (int i = 0; i < 4; ++i) {
    for (int64_t& n : lens) ++n;
    expect_equal(twin.step({1, 1, 1, 1}, lens), bs + ", decode step " + std::to_string(i));
  }
  for (int64_t& n : lens) ++n;
  expect_equal(twin.step({1, 1, 0, 1}, lens, 3), bs + ", decode with 3 splits, one sequence idle");
  twin.expect_same_rows({42, 22, 10, 56});
  // The tables really are scattered: some sequence's blocks are not consecutive.
  bool scattered = false;
  for (const auto& t : twin.tables())
    for (size_t i = 1; i < t.size(); ++i) scattered |= t[i] != t[i - 1] + 1;
  EXPECT_TRUE(scattered) << bs;
}

TEST(PagedKv12, PagedEqualsContiguousBlocksOf16) { run_paged_equals_contiguous(16); }
TEST(PagedKv12, PagedEqualsContiguousBlocksOf1) { run_paged_equals_contiguous(1); }
TEST(PagedKv12, PagedEqualsContiguousBlocksOf32) { run_paged_equals_contiguous(32); }

TEST(PagedKv12, PrefixSharedThroughTheSameBlocks) {
  // Sequence 0: a 40-token prompt. Sequence 1: 45 tokens whose first 32 (two full blocks of 16) are sequence 0's:
  // its table starts with sequence 0's first two blocks, and its first step feeds only tokens 32..44, which
  // attend to the shared keys through those blocks (a prefix-cache hit), beside a decode step of sequence 0.
  Twin twin(kShape, 16, 2, 64, 7);
  expect_equal(twin.step({40, 0}, {40, 0}), "sequence 0's prompt");
  twin.share_prefix(0, 1, 2);
  expect_equal(twin.step({1, 13}, {41, 45}), "a prefix hit beside a decode");
  EXPECT_EQ(twin.tables()[1][0], twin.tables()[0][0]);
  EXPECT_EQ(twin.tables()[1][1], twin.tables()[0][1]);
  EXPECT_NE(twin.tables()[1][2], twin.tables()[0][2]);
  for (int64_t i = 0; i < 3; ++i) expect_equal(twin.step({1, 1}, {42 + i, 46 + i}), "decode " + std::to_string(i));
  twin.expect_same_rows({44, 48});  // the shared blocks still hold sequence 0's rows, read by both
}

TEST(PagedKv12, DecodeSplitsAgree) {
  // The split algorithm (fp32) against the double-precision reference, through shuffled tables: any split count,
  // even more splits than keys (empty splits), gives the same answer up to fp32 rounding.
  const int64_t bs = 8, B = 3;
  const std::vector<int64_t> lens{1, 29, 200};
  PagedKvPool pool(kShape, 1, 40, bs, Device::CPU);
  const std::vector<float> k = random_normal(static_cast<size_t>(40 * bs * kShape.kv_dim()), 1);
  const std::vector<float> v = random_uniform(k.size(), 2);
  std::copy(k.begin(), k.end(), pool.k(0).ptr<float>());
  std::copy(v.begin(), v.end(), pool.v(0).ptr<float>());
  std::vector<std::vector<int32_t>> tables{{33}, {5, 1, 20, 9}, {}};
  for (int32_t i = 39; static_cast<int64_t>(tables[2].size()) * bs < 200; --i) tables[2].push_back(i == 33 ? 0 : i);
  std::vector<int32_t> slots;
  for (int64_t b = 0; b < B; ++b) slots.push_back(static_cast<int32_t>(tables[b][(lens[b] - 1) / bs] * bs + (lens[b] - 1) % bs));
  PagedStepTables t(B, B, 40, 40, bs, Device::CPU);
  t.set(slots, tables);
  AttentionBatch batch(B, Device::CPU);
  batch.set_lengths({1, 1, 1}, lens);
  const Tensor q = Tensor::from_f32(random_normal(static_cast<size_t>(B * kShape.q_dim()), 3, 2.f), {B, kShape.q_dim()},
                                    DType::F32, Device::CPU);
  Tensor want = Tensor::empty({B, kShape.q_dim()}, DType::F32, Device::CPU);
  paged_prefill_attention_cpu(want, q, pool.k(0), pool.v(0), batch, t, kShape);  // double precision
  for (int splits : {1, 3, 64}) {
    Tensor got = Tensor::from_f32(std::vector<float>(static_cast<size_t>(B * kShape.q_dim()), NAN), {B, kShape.q_dim()},
                                  DType::F32, Device::CPU);
    paged_decode_attention(got, q, pool.k(0), pool.v(0), batch, t, kShape, splits, nullptr);
    const CompareResult r = compare("splits " + std::to_string(splits), got.view(), want.view(), Tolerance{1e-5, 1e-5});
    EXPECT_TRUE(r.pass()) << describe(r);
  }
}

// ---- the backend on the bundled model ----------------------------------------------------------------------

TEST(PagedKv12, BackendEqualsTheContiguousCacheOnTheBundledModel) {
  // Two sequences through the whole model, once with lesson 10's CachedAttention and once with PagedAttention over
  // shuffled blocks of 16: a 23-token prompt prefilled in two chunks (15, then 8 that attend to the first 15
  // through the pool) beside a 9-token prompt and its first decode, then three greedy decode steps of both. The
  // same logits, bit for bit.
  const ModelDir model = ModelDir::open(testing::tiny_model_dir());
  const ModelWeights w = ModelWeights::bind(model, Device::CPU);
  const EngineLimits limits{64, 2, 2, 128};
  ExecContext ctx(w.config, limits, Device::CPU);
  StepInputs step(w.config, limits, Device::CPU);
  KvCache cache = KvCache::for_model(w.config, 2, 128, Device::CPU);
  CachedAttention cached(cache, limits);
  cached.set_slots({0, 1});
  PagedKvPool pool = PagedKvPool::for_model(w.config, 12, 16, Device::CPU);
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
    step.set(ids, q_lens, k_lens, rows);
    const std::vector<float> want = to_f32_vector(forward(ctx, w, step, cached));
    paged.set_tables(slot_mapping, tables);
    const std::vector<float> got = to_f32_vector(forward(ctx, w, step, paged));
    const CompareResult r = compare("step " + std::to_string(s), got, want, Tolerance{0, 0});
    ASSERT_TRUE(r.pass()) << describe(r);
    // Greedy: each sequence's next token (sequence 0's first chunk has none yet: the rest of its prompt follows).
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
  EXPECT_EQ(tables[0].size(), 2u);  // 27 tokens in blocks of 16
  EXPECT_EQ(tables[1].size(), 1u);  // 14 tokens
  // A table that contradicts the step is refused before anything runs.
  step.set({1, 2}, {1, 1}, {28, 15}, {0, 1});
  paged.set_tables({tables[0][1] * 16 + 12, tables[1][0] * 16 + 14}, tables);
  EXPECT_THROW(forward(ctx, w, step, paged), InputError);  // sequence 0's position 27 is offset 11, not 12
}

}  // namespace
}  // namespace tvllm
