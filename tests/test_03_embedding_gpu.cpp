// Lesson 03 on the GPU: every kernel version equals the CPU reference bit for bit (a gather copies
// values, so the tolerance is zero), on odd and large hidden sizes, misaligned views (the 16-byte kernels
// must fall back), bad ids checked by the kernel, and the deferred check of embedding_async.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

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

// 0xFF bytes: NaN in every float format, so a row the kernel never writes fails the comparison.
void poison(const TensorView& t) { TVLLM_CUDA_CHECK(cudaMemset(t.data, 0xFF, t.nbytes())); }

// Runs one kernel on the GPU and expects exactly the CPU reference's rows.
void expect_matches_cpu(const TensorView& table, std::vector<int32_t> ids, EmbeddingKernel kernel,
                        bool ids_on_device, const TensorView* out_view = nullptr) {
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
  Tensor device_ids;
  if (ids_on_device) device_ids = Tensor::from_i32(ids, {T}, Device::CUDA);
  embedding(out, ids_on_device ? device_ids.view() : host_ids(ids), table, kernel);

  Tensor host_table = Tensor::copy_of(table, Device::CPU);
  Tensor expected = Tensor::empty({T, hidden}, DType::F32, Device::CPU);
  embedding_cpu(expected, host_ids(ids), host_table);
  const std::string what = std::string(embedding_kernel_name(kernel)) + " T=" + std::to_string(T) +
                           " hidden=" + std::to_string(hidden) + " " + std::string(dtype_name(table.dtype)) +
                           (ids_on_device ? " device ids" : " host ids");
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
        expect_matches_cpu(table, random_ids(T, vocab, 100 + T), k, /*ids_on_device=*/true);
        expect_matches_cpu(table, random_ids(T, vocab, 200 + T), k, /*ids_on_device=*/false);
      }
    }
  }
}

TEST(Embedding03Gpu, ManyTokensCoverEveryBlockAndTheTail) {
  TVLLM_REQUIRE_GPU();
  // v3 covers T * chunks 16-byte chunks, 1024 per block: 5000 * 40 = 200000 is not a multiple of 1024.
  const int64_t vocab = 1000;
  for (auto [T, hidden] : std::vector<std::pair<int64_t, int64_t>>{{5000, 320}, {1000, 2048}, {333, 5000}}) {
    Tensor table = Tensor::from_f32(random_uniform(static_cast<size_t>(vocab * hidden), T), {vocab, hidden},
                                    DType::BF16, Device::CUDA);
    for (EmbeddingKernel k : all_embedding_kernels())
      expect_matches_cpu(table, random_ids(T, vocab, 7), k, true);
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
        expect_matches_cpu(table, random_ids(17, vocab, 9), k, true);
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
      expect_matches_cpu(table, random_ids(T, vocab, 4), k, true, &out);
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
        embedding(out, device_ids, table, k);
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

TEST(Embedding03Gpu, BadHostIdsAreRefusedBeforeAnyLaunch) {
  TVLLM_REQUIRE_GPU();
  Tensor table = Tensor::from_f32(random_uniform(4 * 64, 1), {4, 64}, DType::BF16, Device::CUDA);
  std::vector<int32_t> ids{0, 4};
  Tensor out = Tensor::empty({2, 64}, DType::BF16, Device::CUDA);
  poison(out);
  EXPECT_THROW(embedding(out, host_ids(ids), table), InputError);
  std::vector<uint16_t> bits(2 * 64);
  TVLLM_CUDA_CHECK(cudaMemcpy(bits.data(), out.data(), bits.size() * 2, cudaMemcpyDeviceToHost));
  for (uint16_t b : bits) ASSERT_EQ(b, 0xFFFF) << "out was written although the ids were refused";
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
  try {
    flag.check();
    ADD_FAILURE() << "the flag missed the bad ids";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("token id -7 at position 3"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(flag.check());  // check() cleared it
  // embedding_async wants device ids: host ids go through embedding(), which checks them first.
  EXPECT_THROW(embedding_async(out, host_ids(good), table, flag), InputError);
}

TEST(Embedding03Gpu, GpuArgumentChecks) {
  TVLLM_REQUIRE_GPU();
  Tensor table = Tensor::from_f32(random_uniform(4 * 8, 1), {4, 8}, DType::BF16, Device::CUDA);
  std::vector<int32_t> ids{0, 1};
  Tensor f32_out = Tensor::empty({2, 8}, DType::F32, Device::CUDA);
  EXPECT_THROW(embedding(f32_out, host_ids(ids), table), InputError);  // GPU out has the table's dtype
  Tensor host_table = Tensor::copy_of(table, Device::CPU);
  Tensor out = Tensor::empty({2, 8}, DType::BF16, Device::CUDA);
  EXPECT_THROW(embedding(out, host_ids(ids), host_table), InputError);  // the table must be on the GPU
}

}  // namespace
}  // namespace tvllm
