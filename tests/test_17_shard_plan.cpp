// Lesson 17 on the CPU: the shard plan (counts per rank, padding, refusals), the shard of one linear (a view of
// the rows; a copy of the columns that concatenates back to the weight), the ranks' weights cut from the bundled
// model's mapped file, the CPU simulation's collectives and the vocabulary-parallel lookup.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "common/errors.h"
#include "communicator.h"
#include "model_dir.h"
#include "rank_weights.h"
#include "shard_plan.h"
#include "testing/testing.h"
#include "vocab_parallel.h"

namespace tvllm {
namespace {

ModelConfig config_with(int64_t heads, int64_t kv_heads, int64_t intermediate, int64_t vocab) {
  ModelConfig c;
  c.model_type = "llama";
  c.vocab_size = vocab;
  c.hidden_size = 64;
  c.intermediate_size = intermediate;
  c.num_hidden_layers = 2;
  c.num_attention_heads = heads;
  c.num_key_value_heads = kv_heads;
  c.head_dim = 16;
  c.max_position_embeddings = 64;
  return c;
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const InputError& e) {
    return e.what();
  }
  return "(no InputError)";
}

TEST(ShardPlan17, TheBundledModelSplitsInTwo) {
  const ModelConfig c = load_model_config(testing::tiny_model_dir());  // 6 heads, 2 KV heads, 600, vocab 1000
  const ShardPlan p = ShardPlan::make(c, 2);
  ASSERT_EQ(p.ranks.size(), 2u);
  EXPECT_EQ(p.padded_vocab, 1000);
  for (const RankShard& s : p.ranks) {
    EXPECT_EQ(s.q_heads, 3);
    EXPECT_EQ(s.kv_heads, 1);
    EXPECT_EQ(s.head_begin, 3 * s.rank);
    EXPECT_EQ(s.kv_head_begin, s.rank);
    EXPECT_EQ(s.intermediate, 300);
    EXPECT_EQ(s.intermediate_begin, 300 * s.rank);
    EXPECT_EQ(s.vocab, 500);
    EXPECT_EQ(s.vocab_real, 500);
  }
  const ModelConfig r = p.rank_config();
  EXPECT_EQ(r.num_attention_heads, 3);
  EXPECT_EQ(r.num_key_value_heads, 1);
  EXPECT_EQ(r.intermediate_size, 300);
  EXPECT_EQ(r.vocab_size, 500);
  EXPECT_EQ(r.hidden_size, c.hidden_size);
  EXPECT_EQ(r.head_dim, c.head_dim);
  EXPECT_EQ(p.describe().size(), 8u);
}

TEST(ShardPlan17, TheVocabularyIsPaddedToAMultipleOfTheRanks) {
  const ShardPlan p = ShardPlan::make(config_with(8, 4, 96, 1001), 4);
  EXPECT_EQ(p.padded_vocab, 1004);
  const int64_t real[] = {251, 251, 251, 248};
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(p.ranks[static_cast<size_t>(r)].vocab, 251);
    EXPECT_EQ(p.ranks[static_cast<size_t>(r)].vocab_begin, 251 * r);
    EXPECT_EQ(p.ranks[static_cast<size_t>(r)].vocab_real, real[r]);
  }
  // More padding than one rank's share: the last rank holds padding only.
  const ShardPlan q = ShardPlan::make(config_with(8, 8, 96, 5), 8);
  EXPECT_EQ(q.padded_vocab, 8);
  EXPECT_EQ(q.ranks[4].vocab_real, 1);
  EXPECT_EQ(q.ranks[7].vocab_real, 0);
}

TEST(ShardPlan17, CountsThatDoNotDivideAreRefusedByName) {
  const ModelConfig tiny = load_model_config(testing::tiny_model_dir());
  const std::string heads = message_of([&] { ShardPlan::make(tiny, 4); });
  EXPECT_NE(heads.find("num_attention_heads = 6"), std::string::npos) << heads;
  EXPECT_NE(heads.find("tensor-parallel size 4"), std::string::npos) << heads;
  const std::string kv = message_of([&] { ShardPlan::make(tiny, 3); });
  EXPECT_NE(kv.find("num_key_value_heads = 2"), std::string::npos) << kv;
  const std::string inter = message_of([&] { ShardPlan::make(config_with(8, 8, 100, 64), 8); });
  EXPECT_NE(inter.find("intermediate_size = 100"), std::string::npos) << inter;
  EXPECT_THROW(ShardPlan::make(tiny, 0), InputError);
  ModelConfig biased = tiny;
  biased.qkv_bias = true;
  EXPECT_THROW(ShardPlan::make(biased, 2), InputError);
}

// W [4, 6] F32 with W[o][i] = 10 o + i.
Tensor small_weight() {
  std::vector<float> v;
  for (int o = 0; o < 4; ++o)
    for (int i = 0; i < 6; ++i) v.push_back(static_cast<float>(10 * o + i));
  return Tensor::from_f32(v, {4, 6}, DType::F32, Device::CPU);
}

TEST(ShardPlan17, ColumnShardIsAViewOfTheRows) {
  const Tensor w = small_weight();
  Tensor storage;
  const TensorView s = shard_linear(w, LinearSplit::Columns, 1, 2, storage);
  EXPECT_EQ(s.shape, (Shape{2, 6}));
  EXPECT_EQ(s.data, static_cast<const void*>(w.view().ptr<float>() + 2 * 6));  // rows 2, 3: no copy
  EXPECT_EQ(storage.data(), nullptr);
}

TEST(ShardPlan17, RowShardsConcatenateBackToTheWeight) {
  // BF16 bytes: the copy must keep them unchanged (no rounding through fp32 and back).
  std::vector<uint16_t> bits(3 * 8);
  for (size_t i = 0; i < bits.size(); ++i) bits[i] = static_cast<uint16_t>(0x3f80 + 7 * i);
  const TensorView w = TensorView::contiguous(bits.data(), DType::BF16, Device::CPU, {3, 8});
  std::vector<uint16_t> back(bits.size());
  for (int r = 0; r < 4; ++r) {
    Tensor storage;
    const TensorView s = shard_linear(w, LinearSplit::Rows, r, 4, storage);
    ASSERT_EQ(s.shape, (Shape{3, 2}));
    ASSERT_EQ(s.data, storage.data());
    for (int o = 0; o < 3; ++o)
      for (int j = 0; j < 2; ++j) back[static_cast<size_t>(o * 8 + r * 2 + j)] = s.ptr<uint16_t>()[o * 2 + j];
  }
  EXPECT_EQ(back, bits);
  // And column shard r of W is W's element (o, i) at the same place: W[1][5] = 15 is rank 2's (1, 1) of 3.
  const Tensor f = small_weight();
  Tensor st;
  const TensorView s = shard_linear(f, LinearSplit::Rows, 2, 3, st);
  EXPECT_EQ(s.ptr<float>()[1 * 2 + 1], 15.0f);
}

TEST(ShardPlan17, ANonDividingCutIsAnInputError) {
  const Tensor w = small_weight();  // [4, 6]
  Tensor storage;
  EXPECT_THROW(shard_linear(w, LinearSplit::Columns, 0, 3, storage), InputError);  // 4 rows into 3
  EXPECT_THROW(shard_linear(w, LinearSplit::Rows, 0, 4, storage), InputError);     // 6 columns into 4
  EXPECT_THROW(shard_linear(w, LinearSplit::Rows, 2, 2, storage), InputError);     // rank outside the world
}

TEST(ShardPlan17, PaddedVocabRowsAreZeros) {
  const Tensor w = small_weight();  // a "vocabulary" of 4 rows
  Tensor storage;
  const TensorView s = shard_vocab_rows(w, 3, 2, storage);  // rows 3 and 4 (padding)
  ASSERT_EQ(s.shape, (Shape{2, 6}));
  EXPECT_EQ(s.ptr<float>()[0], 30.0f);
  for (int i = 6; i < 12; ++i) EXPECT_EQ(s.ptr<float>()[i], 0.0f);
  Tensor none;
  EXPECT_EQ(shard_vocab_rows(w, 2, 2, none).data, static_cast<const void*>(w.view().ptr<float>() + 12));
}

TEST(RankWeights17, TheBundledModelsRanksHoldTheirOwnRowsOfTheMappedFile) {
  const ModelDir model = ModelDir::open(testing::tiny_model_dir());
  const ModelWeights full = ModelWeights::bind(model, Device::CPU);
  const ShardPlan plan = ShardPlan::make(model.config, 2);
  const size_t e = dtype_size(full.layers[0].wq.dtype);
  size_t total = 0;
  for (int r = 0; r < 2; ++r) {
    const RankWeights w = RankWeights::cut(full, plan, r);
    const RankLayerWeights& L = w.layers[1];
    const LayerWeights& F = full.layers[1];
    // Column-parallel: views at the rank's rows of the mapped tensors.
    EXPECT_EQ(L.wq.shape, (Shape{192, 336}));
    EXPECT_EQ(L.wq.data, static_cast<const char*>(F.wq.data) + r * 192 * 336 * e);
    EXPECT_EQ(L.wk.data, static_cast<const char*>(F.wk.data) + r * 64 * 336 * e);
    EXPECT_EQ(L.w_up.data, static_cast<const char*>(F.w_up.data) + r * 300 * 336 * e);
    EXPECT_EQ(w.embed.data, static_cast<const char*>(full.embed.data) + r * 500 * 336 * e);
    EXPECT_EQ(w.lm_head.data, w.embed.data);  // tied
    // Row-parallel: copies of the rank's columns, bytes unchanged.
    ASSERT_EQ(L.wo.shape, (Shape{336, 192}));
    ASSERT_EQ(L.w_down.shape, (Shape{336, 300}));
    for (int64_t o : {int64_t{0}, int64_t{17}, int64_t{335}}) {
      EXPECT_EQ(0, std::memcmp(static_cast<const char*>(L.wo.data) + o * 192 * e,
                               static_cast<const char*>(F.wo.data) + (o * 384 + r * 192) * e, 192 * e));
      EXPECT_EQ(0, std::memcmp(static_cast<const char*>(L.w_down.data) + o * 300 * e,
                               static_cast<const char*>(F.w_down.data) + (o * 600 + r * 300) * e, 300 * e));
    }
    EXPECT_EQ(L.input_norm.data, F.input_norm.data);  // replicated
    total += w.bytes();
  }
  // Everything but the replicated norms is held exactly once.
  size_t full_bytes = full.embed.nbytes() + full.final_norm.nbytes(), norms = full.final_norm.nbytes();
  for (const LayerWeights& F : full.layers) {
    for (const TensorView* v : {&F.input_norm, &F.post_norm, &F.wq, &F.wk, &F.wv, &F.wo, &F.w_gate, &F.w_up, &F.w_down})
      full_bytes += v->nbytes();
    norms += F.input_norm.nbytes() + F.post_norm.nbytes();
  }
  EXPECT_EQ(total, full_bytes + norms);  // two ranks: the norms twice
}

TEST(CpuSimComm17, AllReduceSumsInRankOrderIntoEveryRank) {
  std::vector<std::vector<float>> v = {{1.0f, 1e8f, -2.0f}, {2.0f, 1.0f, 0.5f}, {4.0f, -1e8f, 0.25f}};
  std::vector<TensorView> bufs;
  for (auto& x : v) bufs.push_back(TensorView::contiguous(x.data(), DType::F32, Device::CPU, {3}));
  CpuSimComm comm(3);
  comm.all_reduce_sum(bufs, {nullptr, nullptr, nullptr});
  for (const auto& x : v) {
    EXPECT_EQ(x[0], 7.0f);
    EXPECT_EQ(x[1], 0.0f);  // (1e8 + 1) rounds to 1e8 in fp32, then - 1e8: the order is rank order
    EXPECT_EQ(x[2], -1.25f);
  }
  EXPECT_THROW(comm.all_reduce_sum({bufs[0], bufs[1]}, {}), InputError);
}

TEST(CpuSimComm17, AllGatherPutsRankZeroFirst) {
  std::vector<float> a = {1, 2}, b = {3, 4}, da(4, 0), db(4, 0);
  CpuSimComm comm(2);
  auto view = [](std::vector<float>& x) {
    return TensorView::contiguous(x.data(), DType::F32, Device::CPU, {static_cast<int64_t>(x.size())});
  };
  comm.all_gather({view(a), view(b)}, {view(da), view(db)}, {nullptr, nullptr});
  EXPECT_EQ(da, (std::vector<float>{1, 2, 3, 4}));
  EXPECT_EQ(db, da);
}

TEST(VocabParallel17, EachRankLooksUpItsOwnIdsAndZerosTheRest) {
  const Tensor table = small_weight();  // rows 4..7 of the vocabulary, hidden 6
  const Tensor ids = Tensor::from_i32({3, 4, 7, 8, 5}, {5}, Device::CPU);
  Tensor out = Tensor::empty({5, 6}, DType::F32, Device::CPU);
  embedding_shard(out, ids, table, 4);
  const float* o = out.view().ptr<float>();
  for (int h = 0; h < 6; ++h) {
    EXPECT_EQ(o[0 * 6 + h], 0.0f);        // id 3: another rank's
    EXPECT_EQ(o[1 * 6 + h], 0.0f + h);    // id 4: local row 0
    EXPECT_EQ(o[2 * 6 + h], 30.0f + h);   // id 7: local row 3
    EXPECT_EQ(o[3 * 6 + h], 0.0f);        // id 8: the next rank's
    EXPECT_EQ(o[4 * 6 + h], 10.0f + h);   // id 5: local row 1
  }
}

}  // namespace
}  // namespace tvllm
