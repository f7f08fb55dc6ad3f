// Lesson 17 on the GPU. One GPU: NCCL with one rank (the all-reduce of one buffer is the buffer, the all-gather a
// copy; multicast off; bad device lists refused), the vocabulary-parallel kernel against its CPU reference, and
// TP=1 through the same code as TP=N (TpModel over a one-rank NcclComm) against the fp32 reference and lesson 08's
// own GPU forward. Two GPUs or more: the collectives' sums and TP=2 against TP=1 (skipped with "needs 2 GPUs"
// otherwise). Built without NCCL (cmake/TvllmNccl.cmake found none), the NCCL tests report themselves skipped.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/cuda_stream.h"
#include "common/device.h"
#include "common/errors.h"
#include "common/random.h"
#include "logits_check.h"
#include "model_dir.h"
#include "shard_plan.h"
#include "testing/testing.h"
#include "tp_model.h"
#include "vocab_parallel.h"
#if TVLLM_HAVE_NCCL
#include "nccl_comm.h"
#endif

namespace tvllm {
namespace {

int gpu_count() { return cuda_device_count(); }

#if TVLLM_HAVE_NCCL
#define TVLLM_REQUIRE_NCCL() (void)0
#else
#define TVLLM_REQUIRE_NCCL() GTEST_SKIP() << "built without NCCL (cmake/TvllmNccl.cmake found none: -DTVLLM_NCCL_ROOT=...)"
#endif
#define TVLLM_REQUIRE_GPUS(n) \
  if (gpu_count() < (n)) GTEST_SKIP() << "needs " << (n) << " GPUs (" << gpu_count() << " here)"

std::vector<std::vector<int32_t>> reference_prompts() {
  const ReferenceSet ref = ReferenceSet::open(testing::tiny_model_dir());
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < ref.num_prompts(); ++i) prompts.push_back(ref.prompt_ids(i));
  return prompts;
}

TEST(VocabParallelGpu17, KernelEqualsTheCpuLookup) {
  TVLLM_REQUIRE_GPU();
  const int64_t rows = 37, hidden = 200, T = 9;
  std::vector<float> values = random_normal(static_cast<size_t>(rows * hidden), 17);
  const Tensor host = Tensor::from_f32(values, {rows, hidden}, DType::BF16, Device::CPU);
  const Tensor table = Tensor::copy_of(host, Device::CUDA);
  const std::vector<int32_t> id_values = {0, 99, 100, 136, 137, 5, 120, 1000, 101};  // rows 100..136 are ours
  const Tensor ids_host = Tensor::from_i32(id_values, {T}, Device::CPU);
  const Tensor ids = Tensor::copy_of(ids_host, Device::CUDA);
  Tensor out = Tensor::empty({T, hidden}, DType::BF16, Device::CUDA);
  embedding_shard(out, ids, table, 100);
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
  Tensor want = Tensor::empty({T, hidden}, DType::F32, Device::CPU);
  embedding_shard_cpu(want, ids_host, host, 100);
  const std::vector<float> got = to_f32_vector(out);
  for (int64_t i = 0; i < T * hidden; ++i) ASSERT_EQ(got[static_cast<size_t>(i)], want.view().ptr<float>()[i]) << i;
  EXPECT_NE(got[static_cast<size_t>(2 * hidden)], 0.0f);  // id 100 is a real row
}

#if TVLLM_HAVE_NCCL
// A device buffer of n values of `dtype` holding `values` (rounded to the dtype).
Tensor device_values(const std::vector<float>& values, DType dtype) {
  return Tensor::from_f32(values, {static_cast<int64_t>(values.size())}, dtype, Device::CUDA);
}
#endif

TEST(NcclGpu17, OneRankAllReduceLeavesTheBufferUnchanged) {
  TVLLM_REQUIRE_GPU();
  TVLLM_REQUIRE_NCCL();
#if TVLLM_HAVE_NCCL
  NcclComm comm({0});
  std::printf("NCCL %s\n", nccl_version_string().c_str());
  CudaStream stream;
  for (DType dtype : {DType::F32, DType::BF16}) {
    const std::vector<float> v = random_normal(4099, 3);
    const Tensor buf = device_values(v, dtype);
    const std::vector<float> before = to_f32_vector(buf);
    comm.all_reduce_sum({buf.view()}, {stream.get()});
    stream.synchronize();
    EXPECT_EQ(to_f32_vector(buf), before) << dtype_name(dtype);
  }
#endif
}

TEST(NcclGpu17, OneRankAllGatherCopies) {
  TVLLM_REQUIRE_GPU();
  TVLLM_REQUIRE_NCCL();
#if TVLLM_HAVE_NCCL
  NcclComm comm({0});
  CudaStream stream;
  const std::vector<float> v = random_normal(1000, 4);
  const Tensor src = device_values(v, DType::F32);
  const Tensor dst = device_values(std::vector<float>(1000, -1.0f), DType::F32);
  comm.all_gather({src.view()}, {dst.view()}, {stream.get()});
  stream.synchronize();
  EXPECT_EQ(to_f32_vector(dst), v);
#endif
}

TEST(NcclGpu17, MulticastIsOffAndBadDeviceListsAreRefused) {
  TVLLM_REQUIRE_GPU();
  TVLLM_REQUIRE_NCCL();
#if TVLLM_HAVE_NCCL
  setenv("NCCL_NVLS_ENABLE", "1", 1);  // whatever the caller set, the communicator turns NVLS off
  {
    NcclComm comm({0});
    const char* nvls = std::getenv("NCCL_NVLS_ENABLE");
    ASSERT_NE(nvls, nullptr);
    EXPECT_STREQ(nvls, "0");
  }
  EXPECT_THROW(NcclComm({}), InputError);
  EXPECT_THROW(NcclComm({0, 0}), InputError);            // NCCL puts one rank per GPU
  EXPECT_THROW(NcclComm({gpu_count()}), InputError);     // no such device
#endif
}

TEST(NcclGpu17, TwoRanksAllReduceAndAllGather) {
  TVLLM_REQUIRE_GPU();
  TVLLM_REQUIRE_NCCL();
  TVLLM_REQUIRE_GPUS(2);
#if TVLLM_HAVE_NCCL
  NcclComm comm({0, 1});
  std::vector<Tensor> bufs, gathered;
  std::vector<std::unique_ptr<CudaStream>> streams;
  std::vector<TensorView> views, gviews;
  std::vector<cudaStream_t> s;
  for (int r = 0; r < 2; ++r) {
    CurrentDevice on(r);
    bufs.push_back(device_values(std::vector<float>(513, 1.0f + static_cast<float>(r)), DType::F32));  // 1, 2
    gathered.push_back(device_values(std::vector<float>(2 * 513, 0.0f), DType::F32));
    streams.push_back(std::make_unique<CudaStream>());
    views.push_back(bufs.back().view());
    gviews.push_back(gathered.back().view());
    s.push_back(streams.back()->get());
  }
  comm.all_gather(views, gviews, s);
  comm.all_reduce_sum(views, s);
  for (int r = 0; r < 2; ++r) {
    CurrentDevice on(r);
    streams[static_cast<size_t>(r)]->synchronize();
    EXPECT_EQ(to_f32_vector(bufs[static_cast<size_t>(r)]), std::vector<float>(513, 3.0f));
    const std::vector<float> g = to_f32_vector(gathered[static_cast<size_t>(r)]);
    EXPECT_EQ(g[0], 1.0f);
    EXPECT_EQ(g[513], 2.0f);
  }
  for (int r = 0; r < 2; ++r) {  // each stream destroyed with its own GPU current
    CurrentDevice on(r);
    streams[static_cast<size_t>(r)].reset();
  }
#endif
}

#if TVLLM_HAVE_NCCL
// The GPU bound of lesson 08 (logits_check.h): max |error| <= max(0.2 x rms(reference), 1.5 x HF's own bf16 error)
// and the same argmax wherever the reference's margin exceeds twice that.
void expect_within_gpu_bound(const Tensor& got, const Tensor& reference, const char* what) {
  const GpuLogitBound eps =
      gpu_bound_for_prompts(testing::tiny_model_dir(), static_cast<int>(reference_prompts().size()), reference);
  const Top1Agreement a = top1_agreement(got, reference, eps.clear_margin());
  std::printf("%s: %s (bound %.4g)\n", what, a.summary().c_str(), eps.epsilon);
  EXPECT_LE(a.max_abs_error, eps.epsilon) << what;
  EXPECT_TRUE(a.pass()) << what << ": " << a.summary();
  EXPECT_GT(a.clear, 0) << what;
}

// The bundled model, its reference prompts and the fp32 logits every TP run is checked against.
struct BundledCase {
  ModelDir model = ModelDir::open(testing::tiny_model_dir());
  std::vector<std::vector<int32_t>> prompts = reference_prompts();
  EngineLimits limits = limits_for_prompts(model.config, prompts);
  ModelWeights cpu = ModelWeights::bind(model, Device::CPU);
  Tensor fp32 = unsharded_logits(cpu, limits, prompts, true);
};
#endif

TEST(TpGpu17, OneRankOverNcclMatchesTheReferenceAndLesson08) {
  TVLLM_REQUIRE_GPU();
  TVLLM_REQUIRE_NCCL();
#if TVLLM_HAVE_NCCL
  const BundledCase c;
  NcclComm comm({0});
  TpModel tp(c.cpu, ShardPlan::make(c.model.config, 1), Device::CUDA, c.limits, comm);
  const Tensor got = tp.forward_prompts(c.prompts, true);
  expect_within_gpu_bound(got, c.fp32, "TP=1 over NCCL vs the fp32 reference");
  const ModelWeights gpu = ModelWeights::bind(c.model, Device::CUDA);
  expect_within_gpu_bound(got, unsharded_logits(gpu, c.limits, c.prompts, true), "TP=1 over NCCL vs lesson 08 (GPU)");
#endif
}

TEST(TpGpu17, TwoRanksOnTwoGpusMatchOneRank) {
  TVLLM_REQUIRE_GPU();
  TVLLM_REQUIRE_NCCL();
  TVLLM_REQUIRE_GPUS(2);
#if TVLLM_HAVE_NCCL
  const BundledCase c;
  Tensor one, two;
  {
    NcclComm comm({0});
    TpModel tp(c.cpu, ShardPlan::make(c.model.config, 1), Device::CUDA, c.limits, comm);
    one = tp.forward_prompts(c.prompts, true);
  }
  {
    NcclComm comm({0, 1});
    TpModel tp(c.cpu, ShardPlan::make(c.model.config, 2), Device::CUDA, c.limits, comm);
    two = tp.forward_prompts(c.prompts, true);
  }
  expect_within_gpu_bound(two, c.fp32, "TP=2 vs the fp32 reference");
  expect_within_gpu_bound(two, one, "TP=2 vs TP=1");
#endif
}

}  // namespace
}  // namespace tvllm
