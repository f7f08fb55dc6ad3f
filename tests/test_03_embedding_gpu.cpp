// Lesson 03 on the GPU: every kernel version equals the CPU reference bit for bit (a gather copies
// values, so the tolerance is zero), on odd and large hidden sizes, misaligned views (the 16-byte kernels
// must fall back), bad ids checked by the kernel, the deferred check of embedding_async with one
// caller-owned flag, a stream of the test's own, and a CUDA graph capture (no allocation, no sync).
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "common/cuda_stream.h"
#include "common/errors.h"
#include "common/random.h"
#include "common/validate.h"
#include "embedding.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

// A gather does no arithmetic: the GPU's rows must equal the reference's exactly.
constexpr Tolerance kExact{0.0, 0.0};

TensorView host_ids(std::vector<int32_t>& ids) {
  return TensorView::contiguous(ids.data(), DType::I32, Device::CPU, {static_cast<int64_t>(ids.size())});
}

std::vector<int32_t> random_ids(int64_t count, int64_t vocab, uint64_t seed) {
  Rng rng(seed);
  std::vector<int32_t> ids(static_cast<size_t>(count));
  for (int32_t& id : ids) id = static_cast<int32_t>(rng.below(vocab));
  if (count >= 2) {  // both ends of the table
    ids[0] = static_cast<int32_t>(vocab - 1);
    ids[1] = 0;
  }
  return ids;
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

// 0xFF bytes: NaN in every float format, so a row the kernel never writes fails the comparison.
void poison(const TensorView& t) { TVLLM_CUDA_CHECK(cudaMemset(t.data, 0xFF, t.nbytes())); }

// One flag for the whole test program, allocated once, as an engine holds one.
BadTokenFlag& shared_flag() {
  static BadTokenFlag flag;
  return flag;
}

// Runs one kernel on the GPU and expects exactly the CPU reference's rows.
void expect_matches_cpu(const TensorView& table, std::vector<int32_t> ids, EmbeddingKernel kernel,
                        const TensorView* out_view = nullptr) {
  const int64_t T = static_cast<int64_t>(ids.size()), hidden = table.dim(1);
  Tensor own_out;
  TensorView out;
  if (out_view) {
    out = *out_view;
  } else {
    own_out = Tensor::empty({T, hidden}, table.dtype, Device::CUDA);
    out = own_out.view();
  }
  poison(out);
  Tensor device_ids = Tensor::from_i32(ids, {T}, Device::CUDA);
  embedding(out, device_ids, table, shared_flag(), kernel);

  Tensor host_table = Tensor::copy_of(table, Device::CPU);
  Tensor expected = Tensor::empty({T, hidden}, DType::F32, Device::CPU);
  embedding_cpu(expected, host_ids(ids), host_table);
  const std::string what = std::string(embedding_kernel_name(kernel)) + " T=" + std::to_string(T) +
                           " hidden=" + std::to_string(hidden) + " " + std::string(dtype_name(table.dtype));
  CompareResult r = compare(what, out, expected, kExact);
  EXPECT_TRUE(r.pass()) << what << ": " << r.bad << " of " << r.count << " elements differ" << r.error
                        << (r.first_mismatches.empty()
                                ? ""
                                : ", first at " + std::to_string(r.first_mismatches[0].index));
}

TEST(Embedding03Gpu, EveryKernelEqualsTheReference) {
  TVLLM_REQUIRE_GPU();
  const int64_t vocab = 29;
  for (int64_t hidden : {1, 7, 64, 320, 2048, 4096, 5000, 8200}) {
    Tensor table = Tensor::from_f32(random_normal(static_cast<size_t>(vocab * hidden), hidden),
                                    {vocab, hidden}, DType::BF16, Device::CUDA);
    for (int64_t T : {1, 3, 17}) {
      for (EmbeddingKernel k : all_embedding_kernels()) {
        expect_matches_cpu(table, random_ids(T, vocab, 100 + T), k);
        expect_matches_cpu(table, random_ids(T, vocab, 200 + T), k);
      }
    }
  }
}

// One kernel alone (student mode grades each kernel by its own test): row lengths that are a multiple of
// 16 bytes on aligned buffers, so v2 and v3 never fall back to v1, many tokens, and bad ids.
void check_one_kernel(EmbeddingKernel k) {
  const int64_t vocab = 1000;
  for (auto [T, hidden] : std::vector<std::pair<int64_t, int64_t>>{{1, 64}, {17, 320}, {5000, 320}, {333, 2048}}) {
    Tensor table = Tensor::from_f32(random_normal(static_cast<size_t>(vocab * hidden), T + hidden),
                                    {vocab, hidden}, DType::BF16, Device::CUDA);
    expect_matches_cpu(table, random_ids(T, vocab, 11 + T), k);
  }
  Tensor table = Tensor::from_f32(random_uniform(6 * 64, 8, 0.5f, 1.5f), {6, 64}, DType::BF16, Device::CUDA);
  Tensor out = Tensor::empty({3, 64}, DType::BF16, Device::CUDA);
  poison(out);
  Tensor ids = Tensor::from_i32({2, -1, 6}, {3}, Device::CUDA);
  expect_input_error([&] { embedding(out, ids, table, shared_flag(), k); }, {"token id -1 at position 1"});
  const std::vector<float> got = to_f32_vector(out);
  for (int64_t h = 64; h < 3 * 64; ++h) ASSERT_EQ(got[h], 0.0f) << "the row of a bad id must be zeros";
}

TEST(Embedding03Gpu, V1EqualsTheReference) {
  TVLLM_REQUIRE_GPU();
  check_one_kernel(EmbeddingKernel::V1);
}

TEST(Embedding03Gpu, V2EqualsTheReference) {
  TVLLM_REQUIRE_GPU();
  check_one_kernel(EmbeddingKernel::V2);
}

TEST(Embedding03Gpu, V3EqualsTheReference) {
  TVLLM_REQUIRE_GPU();
  check_one_kernel(EmbeddingKernel::V3);
}

TEST(Embedding03Gpu, ManyTokensCoverEveryBlockAndTheTail) {
  TVLLM_REQUIRE_GPU();
  // v3 covers T * chunks 16-byte chunks, 1024 per block: 5000 * 40 = 200000 is not a multiple of 1024.
  const int64_t vocab = 1000;
  for (auto [T, hidden] : std::vector<std::pair<int64_t, int64_t>>{{5000, 320}, {1000, 2048}, {333, 5000}}) {
    Tensor table = Tensor::from_f32(random_uniform(static_cast<size_t>(vocab * hidden), T), {vocab, hidden},
                                    DType::BF16, Device::CUDA);
    for (EmbeddingKernel k : all_embedding_kernels())
      expect_matches_cpu(table, random_ids(T, vocab, 7), k);
  }
}

TEST(Embedding03Gpu, F32AndF16TablesCopyToo) {
  TVLLM_REQUIRE_GPU();
  const int64_t vocab = 13;
  for (DType dtype : {DType::F32, DType::F16}) {
    for (int64_t hidden : {3, 64, 320, 1000}) {
      Tensor table = Tensor::from_f32(random_normal(static_cast<size_t>(vocab * hidden), 5), {vocab, hidden},
                                      dtype, Device::CUDA);
      for (EmbeddingKernel k : all_embedding_kernels())
        expect_matches_cpu(table, random_ids(17, vocab, 9), k);
    }
  }
}

TEST(Embedding03Gpu, MisalignedViewsFallBackAndStayCorrect) {
  TVLLM_REQUIRE_GPU();
  // Views that start 2 or 8 bytes into an allocation: rows are no longer 16-byte aligned, so v2 and v3
  // must take the element-by-element path instead of reading across a row boundary.
  const int64_t vocab = 11, hidden = 64, T = 9;
  for (int64_t offset_elems : {1, 4}) {
    Tensor table_storage = Tensor::from_f32(random_normal(static_cast<size_t>(vocab * hidden + 8), 3),
                                            {vocab * hidden + 8}, DType::BF16, Device::CUDA);
    Tensor out_storage = Tensor::empty({T * hidden + 8}, DType::BF16, Device::CUDA);
    TensorView table = TensorView::contiguous(static_cast<uint16_t*>(table_storage.data()) + offset_elems,
                                              DType::BF16, Device::CUDA, {vocab, hidden});
    TensorView out = TensorView::contiguous(static_cast<uint16_t*>(out_storage.data()) + offset_elems,
                                            DType::BF16, Device::CUDA, {T, hidden});
    for (EmbeddingKernel k : all_embedding_kernels())
      expect_matches_cpu(table, random_ids(T, vocab, 4), k, &out);
  }
}

TEST(Embedding03Gpu, BadDeviceIdsThrowAndTheirRowsAreZero) {
  TVLLM_REQUIRE_GPU();
  const int64_t vocab = 6;
  for (int64_t hidden : {7, 64, 320}) {  // 7: the element path; 64, 320: the 16-byte paths
    std::vector<float> values =
        random_uniform(static_cast<size_t>(vocab * hidden), 8, 0.5f, 1.5f);  // no zeros
    Tensor table = Tensor::from_f32(values, {vocab, hidden}, DType::BF16, Device::CUDA);
    std::vector<int32_t> ids{3, -1, 5, static_cast<int32_t>(vocab), 0};
    Tensor device_ids = Tensor::from_i32(ids, {5}, Device::CUDA);
    for (EmbeddingKernel k : all_embedding_kernels()) {
      Tensor out = Tensor::empty({5, hidden}, DType::BF16, Device::CUDA);
      poison(out);
      try {
        embedding(out, device_ids, table, shared_flag(), k);
        ADD_FAILURE() << "bad ids accepted by " << embedding_kernel_name(k);
      } catch (const InputError& e) {
        const std::string msg = e.what();
        // the lowest bad position is named, whatever order the blocks ran in
        EXPECT_NE(msg.find("token id -1 at position 1"), std::string::npos) << msg;
      }
      const std::vector<float> got = to_f32_vector(out);
      const std::vector<float> table_host = to_f32_vector(table);
      for (int64_t t = 0; t < 5; ++t) {
        const bool bad = ids[t] < 0 || ids[t] >= vocab;
        for (int64_t h = 0; h < hidden; ++h) {
          const float want = bad ? 0.0f : table_host[ids[t] * hidden + h];
          ASSERT_EQ(got[t * hidden + h], want)
              << embedding_kernel_name(k) << " hidden " << hidden << " token " << t;
        }
      }
    }
  }
}

TEST(Embedding03Gpu, HostIdsAreRefusedBeforeAnyLaunch) {
  TVLLM_REQUIRE_GPU();
  Tensor table = Tensor::from_f32(random_uniform(4 * 64, 1), {4, 64}, DType::BF16, Device::CUDA);
  std::vector<int32_t> ids{0, 1};
  Tensor out = Tensor::empty({2, 64}, DType::BF16, Device::CUDA);
  poison(out);
  expect_input_error([&] { embedding(out, host_ids(ids), table, shared_flag()); }, {"ids must be on the GPU"});
  expect_input_error([&] { embedding_async(out, host_ids(ids), table, shared_flag()); },
                     {"ids must be on the GPU"});
  std::vector<uint16_t> bits(2 * 64);
  TVLLM_CUDA_CHECK(cudaMemcpy(bits.data(), out.data(), bits.size() * 2, cudaMemcpyDeviceToHost));
  for (uint16_t b : bits) ASSERT_EQ(b, 0xFFFF) << "out was written although the call was refused";
}

TEST(Embedding03Gpu, AsyncCheckIsDeferredAndNamesTheLowestBadPosition) {
  TVLLM_REQUIRE_GPU();
  const int64_t vocab = 10, hidden = 320;
  Tensor table =
      Tensor::from_f32(random_uniform(vocab * hidden, 2), {vocab, hidden}, DType::BF16, Device::CUDA);
  Tensor out = Tensor::empty({6, hidden}, DType::BF16, Device::CUDA);
  BadTokenFlag flag;
  std::vector<int32_t> good{0, 1, 2, 3, 4, 9};
  Tensor good_ids = Tensor::from_i32(good, {6}, Device::CUDA);
  embedding_async(out, good_ids, table, flag);
  EXPECT_NO_THROW(flag.check());
  // Two launches with bad ids at positions 5 and 3 before one check: the check names position 3.
  Tensor bad5 = Tensor::from_i32({0, 1, 2, 3, 4, 100}, {6}, Device::CUDA);
  Tensor bad3 = Tensor::from_i32({0, 1, 2, -7, 4, 5}, {6}, Device::CUDA);
  EXPECT_NO_THROW(embedding_async(out, bad5, table, flag));  // no synchronisation, no throw yet
  EXPECT_NO_THROW(embedding_async(out, bad3, table, flag, EmbeddingKernel::V1));
  expect_input_error([&] { flag.check(); }, {"token id -7 at position 3", "[0, 10)"});
  EXPECT_NO_THROW(flag.check());  // check() cleared it
  // clear() forgets a bad id recorded since the last check (queued on the stream, like the gather).
  embedding_async(out, bad5, table, flag);
  flag.clear();
  EXPECT_NO_THROW(flag.check());
}

TEST(Embedding03Gpu, GpuArgumentChecks) {
  TVLLM_REQUIRE_GPU();
  Tensor table = Tensor::from_f32(random_uniform(4 * 8, 1), {4, 8}, DType::BF16, Device::CUDA);
  Tensor ids = Tensor::from_i32({0, 1}, {2}, Device::CUDA);
  Tensor f32_out = Tensor::empty({2, 8}, DType::F32, Device::CUDA);
  expect_input_error([&] { embedding(f32_out, ids, table, shared_flag()); }, {"table's dtype"});
  Tensor host_table = Tensor::copy_of(table, Device::CPU);
  Tensor out = Tensor::empty({2, 8}, DType::BF16, Device::CUDA);
  expect_input_error([&] { embedding(out, ids, host_table, shared_flag()); }, {"table must be too"});
  Tensor host_out = Tensor::empty({2, 8}, DType::F32, Device::CPU);
  expect_input_error([&] { embedding(host_out, ids, table, shared_flag()); }, {"embedding_cpu"});
}

// The gather of a [T, hidden] table on `stream`, from random ids, as fp32 bits for comparison.
struct StreamCase {
  static constexpr int64_t kVocab = 97, kHidden = 320, kTokens = 33;
  Tensor table = Tensor::from_f32(random_normal(static_cast<size_t>(kVocab * kHidden), 31), {kVocab, kHidden},
                                  DType::BF16, Device::CUDA);
  Tensor ids = Tensor::from_i32(random_ids(kTokens, kVocab, 32), {kTokens}, Device::CUDA);
  Tensor out = Tensor::empty({kTokens, kHidden}, DType::BF16, Device::CUDA);
};

TEST(Embedding03Gpu, OwnStreamEqualsDefaultStream) {
  TVLLM_REQUIRE_GPU();
  StreamCase c;
  for (EmbeddingKernel k : all_embedding_kernels()) {
    poison(c.out);
    embedding(c.out, c.ids, c.table, shared_flag(), k);  // the legacy default stream
    const std::vector<float> on_default = to_f32_vector(c.out);

    CudaStream stream;  // non-blocking: ordered only by what we synchronise
    BadTokenFlag flag;  // one flag per stream that embeds
    poison(c.out);
    TVLLM_CUDA_CHECK(cudaDeviceSynchronize());  // the poison (legacy stream) lands before the gather
    embedding_async(c.out, c.ids, c.table, flag, k, stream);
    flag.check(stream);  // waits for the stream
    EXPECT_EQ(to_f32_vector(c.out), on_default) << embedding_kernel_name(k);

    embedding(c.out, c.ids, c.table, flag, k, stream);  // the checked form on the stream too
    EXPECT_EQ(to_f32_vector(c.out), on_default) << embedding_kernel_name(k);
  }
}

TEST(Embedding03Gpu, GraphCaptureReplaysTheEagerResult) {
  TVLLM_REQUIRE_GPU();
  StreamCase c;
  CudaStream stream;
  BadTokenFlag flag;  // allocated before the capture: embedding_async allocates nothing
  for (EmbeddingKernel k : all_embedding_kernels()) {
    poison(c.out);
    TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
    embedding_async(c.out, c.ids, c.table, flag, k, stream);
    flag.check(stream);
    const std::vector<float> eager = to_f32_vector(c.out);

    // Recording fails if the call allocates or synchronises (capture mode global).
    CudaGraph graph = CudaGraph::capture(stream, [&] {
      flag.clear(stream);  // the async clear is capturable too
      embedding_async(c.out, c.ids, c.table, flag, k, stream);
    });
    EXPECT_GE(graph.num_nodes(), 2u);  // the memset and the gather
    poison(c.out);
    TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
    graph.launch(stream);
    graph.launch(stream);  // a second replay: the same bits
    flag.check(stream);
    EXPECT_EQ(to_f32_vector(c.out), eager) << embedding_kernel_name(k);
  }
}

}  // namespace
}  // namespace tvllm
