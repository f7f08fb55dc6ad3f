// Lesson 03 on the CPU: the reference gather, its argument checks, and the refusal of bad token ids.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "common/errors.h"
#include "common/random.h"
#include "embedding.h"

namespace tvllm {
namespace {

TensorView host_ids(std::vector<int32_t>& ids) {
  return TensorView::contiguous(ids.data(), DType::I32, Device::CPU, {static_cast<int64_t>(ids.size())});
}

// Runs f, expects an InputError whose message contains every one of `parts`.
template <class F>
void expect_input_error(F f, const std::vector<std::string>& parts) {
  try {
    f();
    FAIL() << "expected an InputError";
  } catch (const InputError& e) {
    const std::string msg = e.what();
    for (const std::string& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "message: " << msg;
  }
}

TEST(Embedding03, KnownAnswerF32Table) {
  // vocab 4, hidden 3: row r holds r*10 + {1, 2, 3}
  std::vector<float> table_values{1, 2, 3, 11, 12, 13, 21, 22, 23, 31, 32, 33};
  Tensor table = Tensor::from_f32(table_values, {4, 3}, DType::F32, Device::CPU);
  std::vector<int32_t> ids{2, 0, 2, 3};
  Tensor out = Tensor::empty({4, 3}, DType::F32, Device::CPU);
  embedding_cpu(out, host_ids(ids), table);
  const std::vector<float> expected{21, 22, 23, 1, 2, 3, 21, 22, 23, 31, 32, 33};
  EXPECT_EQ(to_f32_vector(out), expected);
}

TEST(Embedding03, Bf16AndF16TablesWidenExactly) {
  const int64_t vocab = 37, hidden = 19;
  std::vector<float> values = random_normal(static_cast<size_t>(vocab * hidden), 7, 0.5f);
  Rng rng(11);
  std::vector<int32_t> ids(23);
  for (int32_t& id : ids) id = static_cast<int32_t>(rng.below(vocab));
  ids[0] = 0;
  ids[1] = static_cast<int32_t>(vocab - 1);  // both ends of the table
  for (DType dtype : {DType::BF16, DType::F16}) {
    Tensor table = Tensor::from_f32(values, {vocab, hidden}, dtype, Device::CPU);
    Tensor out = Tensor::empty({static_cast<int64_t>(ids.size()), hidden}, DType::F32, Device::CPU);
    embedding_cpu(out, host_ids(ids), table);
    std::vector<float> got = to_f32_vector(out);
    for (size_t t = 0; t < ids.size(); ++t) {
      for (int64_t h = 0; h < hidden; ++h) {
        const float stored = load_as_f32(table.data(), dtype, static_cast<size_t>(ids[t] * hidden + h));
        ASSERT_EQ(got[t * hidden + h], stored) << dtype_name(dtype) << " token " << t << " element " << h;
      }
    }
  }
}

TEST(Embedding03, Bf16WideningIsTheTopHalfOfFp32) {
  // 0x3f80 is 1.0, 0xc040 is -3.0, 0x0001 the smallest subnormal: the fp32 bits are the bf16 bits << 16.
  std::vector<uint16_t> raw{0x3f80, 0xc040, 0x0001};
  TensorView table = TensorView::contiguous(raw.data(), DType::BF16, Device::CPU, {3, 1});
  std::vector<int32_t> ids{1, 2, 0};
  Tensor out = Tensor::empty({3, 1}, DType::F32, Device::CPU);
  embedding_cpu(out, host_ids(ids), table);
  const float* y = static_cast<const float*>(out.data());
  EXPECT_EQ(f32_bits(y[0]), 0xc0400000u);
  EXPECT_EQ(f32_bits(y[1]), 0x00010000u);
  EXPECT_EQ(y[2], 1.0f);
}

TEST(Embedding03, OutOfRangeIdsAreRefusedAndOutIsUntouched) {
  const int64_t vocab = 5, hidden = 4;
  Tensor table =
      Tensor::from_f32(random_uniform(vocab * hidden, 3), {vocab, hidden}, DType::BF16, Device::CPU);
  for (int32_t bad : {-1, static_cast<int32_t>(vocab), INT32_MIN, INT32_MAX}) {
    std::vector<int32_t> ids{0, 4, bad, 1};
    Tensor out = Tensor::empty({4, hidden}, DType::F32, Device::CPU);
    std::memset(out.data(), 0x7f, out.view().nbytes());
    expect_input_error([&] { embedding_cpu(out, host_ids(ids), table); },
                       {"token id " + std::to_string(bad), "position 2", "[0, 5)"});
    // The ids are checked before anything is written.
    const auto* bytes = static_cast<const unsigned char*>(out.data());
    for (size_t i = 0; i < out.view().nbytes(); ++i)
      ASSERT_EQ(bytes[i], 0x7f) << "byte " << i << " was written";
  }
}

TEST(Embedding03, FirstBadIdIsNamed) {
  std::vector<int32_t> ids{0, 9, -3};
  expect_input_error([&] { check_token_ids(ids.data(), 3, 5); }, {"token id 9", "position 1"});
}

TEST(Embedding03, ZeroTokensIsANoOp) {
  Tensor table = Tensor::from_f32({1, 2, 3, 4}, {2, 2}, DType::F32, Device::CPU);
  std::vector<int32_t> ids;
  Tensor out = Tensor::empty({0, 2}, DType::F32, Device::CPU);
  EXPECT_NO_THROW(embedding_cpu(out, host_ids(ids), table));
}

TEST(Embedding03, ShapeDtypeAndDeviceChecks) {
  Tensor table = Tensor::from_f32(random_uniform(12, 1), {4, 3}, DType::BF16, Device::CPU);
  std::vector<int32_t> ids{1, 2};
  Tensor out = Tensor::empty({2, 3}, DType::F32, Device::CPU);
  // out with the wrong hidden size, the wrong token count, or the wrong dtype on the CPU
  Tensor wide = Tensor::empty({2, 4}, DType::F32, Device::CPU);
  expect_input_error([&] { embedding_cpu(wide, host_ids(ids), table); }, {"out must be [2, 3]"});
  Tensor long_out = Tensor::empty({3, 3}, DType::F32, Device::CPU);
  expect_input_error([&] { embedding_cpu(long_out, host_ids(ids), table); }, {"out must be [2, 3]"});
  Tensor bf16_out = Tensor::empty({2, 3}, DType::BF16, Device::CPU);
  expect_input_error([&] { embedding_cpu(bf16_out, host_ids(ids), table); }, {"F32"});
  // ids that are not I32
  std::vector<float> float_ids{1.f, 2.f};
  TensorView f_ids = TensorView::contiguous(float_ids.data(), DType::F32, Device::CPU, {2});
  expect_input_error([&] { embedding_cpu(out, f_ids, table); }, {"ids must be I32"});
  // a table of rank 1 or of integers
  expect_input_error([&] { embedding_cpu(out, host_ids(ids), table.view().reshape({12})); }, {"[vocab, hidden]"});
  std::vector<int32_t> int_table(12, 0);
  TensorView itab = TensorView::contiguous(int_table.data(), DType::I32, Device::CPU, {4, 3});
  expect_input_error([&] { embedding_cpu(out, host_ids(ids), itab); }, {"floating point"});
  // Mixed devices are caught before any CUDA call, so this runs without a GPU.
  TensorView gpu_out = TensorView::contiguous(nullptr, DType::BF16, Device::CUDA, {2, 3});
  expect_input_error([&] { check_embedding_args(gpu_out, host_ids(ids), table); }, {"table must be too"});
  expect_input_error([&] { embedding_cpu(gpu_out, host_ids(ids), table); }, {"out must be on the CPU"});
  TensorView gpu_table = TensorView::contiguous(nullptr, DType::BF16, Device::CUDA, {4, 3});
  expect_input_error([&] { embedding_cpu(out, host_ids(ids), gpu_table); }, {"must be too"});
}

TEST(Embedding03, KernelNames) {
  EXPECT_EQ(parse_embedding_kernel("v1"), EmbeddingKernel::V1);
  EXPECT_EQ(parse_embedding_kernel("v3"), EmbeddingKernel::V3);
  EXPECT_EQ(embedding_kernel_name(EmbeddingKernel::V2), "v2");
  EXPECT_EQ(all_embedding_kernels().size(), 3u);
  EXPECT_THROW(parse_embedding_kernel("v4"), InputError);
  EXPECT_THROW(parse_embedding_kernel(""), InputError);
}

}  // namespace
}  // namespace tvllm
