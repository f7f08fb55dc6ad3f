// Lesson 14, the host side of the fast decode attention (no GPU needed): its split policy, the seams it is
// installed through (lessons 10 and 12 cannot link lesson 14), and what DecodeAttention::Fast means on the CPU
// (lesson 10's split reference, the same bits as Split) and for a bad request (Flash is no split kernel).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "common/errors.h"
#include "common/random.h"
#include "decode_attention_fast.h"
#include "graph_runner.h"
#include "kv_cache.h"
#include "paged_kv.h"

namespace tvllm {
namespace {

const AttentionShape kLlama1B{32, 8, 64};

TEST(FastDecode14, SplitPolicyCoversTheSmsAndDropsTheCombineWhenTheBatchDoes) {
  // 132 SMs (an H200). 64 sequences x 8 kv heads = 512 blocks >= 2 per SM: one split, no combine pass.
  EXPECT_EQ(fast_decode_splits(kLlama1B, 64, 2048, 132), 1);
  EXPECT_EQ(fast_decode_splits(kLlama1B, 256, 8192, 132), 1);
  EXPECT_EQ(fast_decode_splits(kLlama1B, 33, 4096, 132), 1);  // 264 blocks: exactly 2 per SM
  // 32 sequences: 256 blocks, under 2 per SM: enough splits for ~4 blocks per SM (528 / 256 -> 3).
  EXPECT_EQ(fast_decode_splits(kLlama1B, 32, 2048, 132), 3);
  // One sequence: 8 blocks; 66 splits would fill the GPU, but a split gets at least kMinKeysPerFastSplit keys...
  static_assert(kMinKeysPerFastSplit == 256, "the expectations below assume 256 keys per split");
  EXPECT_EQ(fast_decode_splits(kLlama1B, 1, 8192, 132), 32);
  EXPECT_EQ(fast_decode_splits(kLlama1B, 1, 4096, 132), 16);
  EXPECT_EQ(fast_decode_splits(kLlama1B, 1, 1000, 132), 4);
  EXPECT_EQ(fast_decode_splits(kLlama1B, 1, 256, 132), 1);
  EXPECT_EQ(fast_decode_splits(kLlama1B, 1, 1, 132), 1);
  // ...and there are at most kMaxDecodeSplits.
  EXPECT_EQ(fast_decode_splits(kLlama1B, 1, 100000, 132), DecodeWorkspace::kMaxDecodeSplits);
  // A sliding window: only min(context, window) keys are read, so only those are split (as decode_splits does).
  EXPECT_EQ(fast_decode_splits(AttentionShape{32, 8, 64, 1000}, 1, 8192, 132), 4);
  EXPECT_EQ(fast_decode_splits(AttentionShape{32, 8, 64, 200}, 1, 8192, 132), 1);
  EXPECT_EQ(fast_decode_splits(AttentionShape{32, 8, 64, 100000}, 1, 1000, 132), 4);
  EXPECT_EQ(fast_decode_splits(AttentionShape{32, 8, 64, 200}, 1, 8192, 0),
            decode_splits(AttentionShape{32, 8, 64, 200}, 1, 8192, 0));
  // A group of 16 needs two blocks of 8 heads per kv head: twice the blocks.
  EXPECT_EQ(fast_decode_splits(AttentionShape{32, 2, 64}, 33, 4096, 132), 4);  // 132 blocks: 528 / 132 -> 4
  EXPECT_EQ(fast_decode_splits(AttentionShape{32, 2, 64}, 66, 4096, 132), 1);  // 264 blocks
  EXPECT_EQ(fast_decode_splits(AttentionShape{16, 2, 64}, 66, 4096, 132), 4);  // a group of 8: 132 blocks
  // No SMs (the CPU): lesson 10's choice.
  EXPECT_EQ(fast_decode_splits(kLlama1B, 1, 4096, 0), decode_splits(kLlama1B, 1, 4096, 0));
}

TEST(FastDecode14, InstallingFillsBothSeamsAndTheGraphSplitsFollowTheKernel) {
  install_fast_decode_attention();
  install_fast_decode_attention();  // idempotent
  const FastDecodeKernel k = installed_fast_decode();
  EXPECT_EQ(k.contiguous, &fast_decode_attention_cuda);
  EXPECT_EQ(k.splits, &fast_decode_splits);
  EXPECT_EQ(installed_fast_paged_decode(), &fast_paged_decode_attention_cuda);
  // The split policy each kernel gets: Fast -> lesson 14's (on a GPU), anything else (and the CPU) -> lesson 10's.
  EXPECT_EQ(decode_splits_for(DecodeAttention::Fast, kLlama1B, 64, 2048, 132), 1);
  EXPECT_EQ(decode_splits_for(DecodeAttention::Split, kLlama1B, 64, 2048, 132), decode_splits(kLlama1B, 64, 2048, 132));
  EXPECT_EQ(decode_splits_for(DecodeAttention::Fast, kLlama1B, 1, 4096, 0), decode_splits(kLlama1B, 1, 4096, 0));
  // A graph pins the split count of its context bucket (the next power of two), by the kernel's policy.
  EXPECT_EQ(graph_decode_splits(kLlama1B, 32, 1500, 132, DecodeAttention::Fast),
            fast_decode_splits(kLlama1B, 32, 2048, 132));
  EXPECT_EQ(graph_decode_splits(kLlama1B, 32, 1500, 132), decode_splits(kLlama1B, 32, 2048, 132));
}

// A small contiguous cache on the CPU with random keys and values, and a decode step over it.
struct CpuStep {
  AttentionShape s{8, 2, 16};
  std::vector<int64_t> q_lens{1, 1, 0, 1}, k_lens{1, 37, 5, 90};
  KvCache cache{s, 1, 4, 96, Device::CPU};
  AttentionBatch batch{4, Device::CPU};
  CacheSlots slots{4, 4, Device::CPU};
  Tensor q = Tensor::from_f32(random_normal(static_cast<size_t>(3 * s.q_dim()), 4), {3, s.q_dim()}, DType::F32,
                              Device::CPU);
  CpuStep() {
    const std::vector<float> k = random_normal(static_cast<size_t>(4 * 96 * s.kv_dim()), 5);
    const std::vector<float> v = random_uniform(static_cast<size_t>(4 * 96 * s.kv_dim()), 6);
    std::copy(k.begin(), k.end(), cache.k(0).ptr<float>());
    std::copy(v.begin(), v.end(), cache.v(0).ptr<float>());
    batch.set_lengths(q_lens, k_lens);
    slots.set({2, 0, 3, 1});
  }
  std::vector<float> run(DecodeAttention kernel, int splits) {
    Tensor out = Tensor::from_f32(std::vector<float>(static_cast<size_t>(3 * s.q_dim()), NAN), {3, s.q_dim()},
                                  DType::F32, Device::CPU);
    if (splits > 0) decode_attention(out, q, cache.k(0), cache.v(0), batch, slots, s, splits, nullptr, nullptr, kernel);
    else cached_attention(out, q, cache.k(0), cache.v(0), batch, slots, s, nullptr, nullptr, kernel);
    return to_f32_vector(out);
  }
};

TEST(FastDecode14, OnTheCpuFastIsLesson10sSplitReference) {
  CpuStep step;
  for (int splits : {0, 1, 3, 64}) {
    const std::vector<float> fast = step.run(DecodeAttention::Fast, splits);
    const std::vector<float> split = step.run(DecodeAttention::Split, splits);
    EXPECT_EQ(fast, split) << "splits " << splits;
    for (float x : fast) EXPECT_TRUE(std::isfinite(x)) << "splits " << splits;
  }
}

TEST(FastDecode14, FlashIsNoSplitKernel) {
  CpuStep step;
  EXPECT_THROW(step.run(DecodeAttention::Flash, 2), InputError);
  const AttentionShape s{4, 2, 16};
  PagedKvPool pool(s, 1, 4, 16, Device::CPU);
  AttentionBatch batch(1, Device::CPU);
  batch.set_lengths({1}, {3});
  PagedStepTables tables(1, 1, 1, 4, 16, Device::CPU);
  tables.set({2}, {{0}});
  const std::vector<float> zeros(static_cast<size_t>(s.q_dim()), 0.f);
  const Tensor q = Tensor::from_f32(zeros, {1, s.q_dim()}, DType::F32, Device::CPU);
  Tensor out = Tensor::from_f32(zeros, {1, s.q_dim()}, DType::F32, Device::CPU);
  EXPECT_THROW(paged_decode_attention(out, q, pool.k(0), pool.v(0), batch, tables, s, 1, nullptr, nullptr,
                                      DecodeAttention::Flash),
               InputError);
}

}  // namespace
}  // namespace tvllm
