// Lesson 07 on the GPU: v1 (materialised) and v2 (flash-style) against the CPU reference on random
// inputs, odd and tile-straddling lengths, large scores, empty sequences, and the error paths.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "attention.h"
#include "common/errors.h"
#include "common/random.h"
#include "common/validate.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

// GPU vs the CPU reference run on the SAME bf16-rounded inputs. What remains is the kernels' own
// rounding, bounded in the worst case:
//   - P is rounded to bf16 before P V. One bf16 rounding (8 significant bits, round to nearest) moves a
//     value by at most 2^-8 of itself, and the output is a convex combination of v rows, so this moves
//     the output by at most 2^-8 * max|v|;
//   - the output is rounded to bf16: at most 2^-8 of |out|.
// The fp32 scores, exp2f and sums in another order add ~1e-6 relative; kFp32Slack covers them with room.
// (Measured on an H200: v2 reaches ~0.75 of the atol, v1 ~1.2, passing through the rtol term: v1
// normalises P before rounding it, so its weights round at their largest; see README section 10.)
constexpr double kBf16Rounding = 1.0 / 256;
constexpr double kFp32Slack = 1e-4;
constexpr double kAtolPerMaxV = kBf16Rounding + kFp32Slack;
constexpr double kRtol = kBf16Rounding + kFp32Slack;

const AttentionShape kTiny{6, 2, 64};      // weights/tiny-llama3
const AttentionShape kLlama1B{32, 8, 64};  // Llama 3.2 1B
const AttentionKernel kKernels[] = {AttentionKernel::V1Materialized, AttentionKernel::V2Flash};

struct HostInputs {
  std::vector<float> q, k, v;
};

HostInputs random_inputs(int64_t T, const AttentionShape& s, uint64_t seed, float q_scale = 1.f) {
  HostInputs in{random_normal(static_cast<size_t>(T * s.q_dim()), seed),
                random_normal(static_cast<size_t>(T * s.kv_dim()), seed + 1),
                random_uniform(static_cast<size_t>(T * s.kv_dim()), seed + 2)};
  for (float& x : in.q) x *= q_scale;
  return in;
}

int64_t total(const std::vector<int64_t>& lengths) {
  int64_t t = 0;
  for (int64_t n : lengths) t += n;
  return t;
}

// Runs one kernel on bf16 copies of `in` (output poisoned with NaN first); returns the output as fp32.
std::vector<float> run_gpu(const HostInputs& in, const std::vector<int64_t>& lengths, const AttentionShape& s,
                           AttentionKernel kernel, AttentionWorkspace* ws = nullptr) {
  const int64_t T = total(lengths);
  VarlenBatch batch = VarlenBatch::from_lengths(lengths, Device::CUDA);
  Tensor q = Tensor::from_f32(in.q, {T, s.q_dim()}, DType::BF16, Device::CUDA);
  Tensor k = Tensor::from_f32(in.k, {T, s.kv_dim()}, DType::BF16, Device::CUDA);
  Tensor v = Tensor::from_f32(in.v, {T, s.kv_dim()}, DType::BF16, Device::CUDA);
  Tensor out = Tensor::empty({T, s.q_dim()}, DType::BF16, Device::CUDA);
  TVLLM_CUDA_CHECK(cudaMemset(out.data(), 0xFF, out.view().nbytes()));  // 0xFFFF: a bf16 NaN
  attention_prefill(out, q, k, v, batch, s, kernel, ws);
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
  return to_f32_vector(out);
}

// The CPU reference on the bf16-rounded inputs (what a perfect bf16-input kernel computes).
std::vector<float> run_cpu_on_bf16(const HostInputs& in, const std::vector<int64_t>& lengths, const AttentionShape& s) {
  const int64_t T = total(lengths);
  auto rounded = [](const std::vector<float>& x, Shape shape) {
    return Tensor::copy_of(Tensor::from_f32(x, shape, DType::BF16, Device::CPU), Device::CPU, DType::F32);
  };
  Tensor q = rounded(in.q, {T, s.q_dim()});
  Tensor k = rounded(in.k, {T, s.kv_dim()});
  Tensor v = rounded(in.v, {T, s.kv_dim()});
  Tensor out = Tensor::empty({T, s.q_dim()}, DType::F32, Device::CPU);
  attention_prefill(out, q, k, v, VarlenBatch::from_lengths(lengths, Device::CPU), s);
  return to_f32_vector(out);
}

std::string describe(const CompareResult& r) {
  std::ostringstream s;
  s << r.name << ": max_abs " << r.max_abs << ", max_rel " << r.max_rel << ", bad " << r.bad << " of " << r.count
    << " (atol " << r.tol.atol << ", rtol " << r.tol.rtol << ")";
  for (const Mismatch& m : r.first_mismatches) s << "\n  [" << m.index << "] got " << m.actual << ", expected " << m.expected;
  if (!r.error.empty()) s << "\n  " << r.error;
  return s.str();
}

void expect_matches_cpu(const std::vector<int64_t>& lengths, const AttentionShape& s, uint64_t seed,
                        float q_scale = 1.f) {
  const HostInputs in = random_inputs(total(lengths), s, seed, q_scale);
  const std::vector<float> expected = run_cpu_on_bf16(in, lengths, s);
  double max_v = 0.0;
  for (float x : in.v) max_v = std::max(max_v, static_cast<double>(std::fabs(x)));
  for (AttentionKernel kernel : kKernels) {
    if (kernel == AttentionKernel::V2Flash && !flash_supports_head_dim(s.head_dim)) continue;
    const std::vector<float> out = run_gpu(in, lengths, s, kernel);
    for (float x : out) ASSERT_TRUE(std::isfinite(x)) << attention_kernel_name(kernel) << ": NaN or inf in the output";
    CompareResult r = compare(std::string(attention_kernel_name(kernel)), out, expected, {kAtolPerMaxV * max_v, kRtol});
    EXPECT_TRUE(r.pass()) << describe(r);
    std::string text;
    for (int64_t n : lengths) {
      if (!text.empty()) text += ",";
      text += std::to_string(n);
    }
    std::printf("    %s heads %lld/%lld dim %lld, lengths {%s}, q x %g: max_abs %.3g (atol %.3g), rel_l2 %.3g\n",
                r.name.c_str(), (long long)s.n_heads, (long long)s.n_kv_heads, (long long)s.head_dim, text.c_str(),
                q_scale, r.max_abs, r.tol.atol, r.rel_l2);
  }
}

TEST(Attention07Gpu, MatchesCpuTinyShapes) {
  TVLLM_REQUIRE_GPU();
  expect_matches_cpu({1}, kTiny, 100);
  expect_matches_cpu({5, 1, 130}, kTiny, 200);
  expect_matches_cpu({64, 65, 127, 128, 129}, kTiny, 300);  // both sides of every 64-row tile edge
  expect_matches_cpu({1000}, kTiny, 400);
}

TEST(Attention07Gpu, Matches1BShapes) {
  TVLLM_REQUIRE_GPU();
  expect_matches_cpu({5, 1, 130}, kLlama1B, 500);
  expect_matches_cpu({64, 65, 127, 128, 129}, kLlama1B, 600);
  expect_matches_cpu({1000}, kLlama1B, 700);
}

TEST(Attention07Gpu, HeadDim128) {
  TVLLM_REQUIRE_GPU();
  expect_matches_cpu({3, 200, 64, 1}, AttentionShape{8, 2, 128}, 800);
}

TEST(Attention07Gpu, MultiHeadAttentionWithoutGrouping) {
  TVLLM_REQUIRE_GPU();
  expect_matches_cpu({77, 150}, AttentionShape{4, 4, 64}, 850);  // n_kv_heads == n_heads (Llama 2 7B style)
}

TEST(Attention07Gpu, LargeScoresStressTheMaxSubtraction) {
  TVLLM_REQUIRE_GPU();
  // q * 20: scores of +-100s; exp without the max subtraction overflows fp32 (exp(89) = inf).
  expect_matches_cpu({64, 65, 127, 128, 129}, kTiny, 900, 20.f);
  expect_matches_cpu({1000}, kTiny, 1000, 20.f);
}

TEST(Attention07Gpu, EmptySequencesInTheBatch) {
  TVLLM_REQUIRE_GPU();
  expect_matches_cpu({0, 37, 0, 64, 0}, kTiny, 1100);
}

TEST(Attention07Gpu, SequencesDoNotSeeEachOther) {
  TVLLM_REQUIRE_GPU();
  const std::vector<int64_t> lengths{100, 70, 129};
  const int64_t begin1 = 100, end1 = 170;
  for (AttentionKernel kernel : kKernels) {
    HostInputs in = random_inputs(total(lengths), kTiny, 1200);
    const std::vector<float> before = run_gpu(in, lengths, kTiny, kernel);
    // Replace everything of sequence 1.
    for (int64_t t = begin1; t < end1; ++t) {
      for (int64_t c = 0; c < kTiny.q_dim(); ++c) in.q[t * kTiny.q_dim() + c] = -in.q[t * kTiny.q_dim() + c];
      for (int64_t c = 0; c < kTiny.kv_dim(); ++c) {
        in.k[t * kTiny.kv_dim() + c] += 1.f;
        in.v[t * kTiny.kv_dim() + c] = 0.5f - in.v[t * kTiny.kv_dim() + c];
      }
    }
    const std::vector<float> after = run_gpu(in, lengths, kTiny, kernel);
    int64_t changed_outside = 0, changed_inside = 0;
    for (int64_t t = 0; t < total(lengths); ++t) {
      for (int64_t c = 0; c < kTiny.q_dim(); ++c) {
        const bool changed = before[t * kTiny.q_dim() + c] != after[t * kTiny.q_dim() + c];
        (t >= begin1 && t < end1 ? changed_inside : changed_outside) += changed;
      }
    }
    EXPECT_EQ(changed_outside, 0) << attention_kernel_name(kernel) << ": sequences 0 and 2 saw sequence 1";
    EXPECT_GT(changed_inside, 0) << attention_kernel_name(kernel);  // so the test can fail
  }
}

TEST(Attention07Gpu, V1WorkspaceThatDoesNotFitIsAClearError) {
  TVLLM_REQUIRE_GPU();
  // One sequence of 2^20 tokens, one head of 8 dims: q/k/v are 16 MiB each, but v1's scores would be
  // 2^40 * 4 bytes = 4 TiB. The call must throw a CudaError naming the size, not crash.
  const AttentionShape s{1, 1, 8};
  const int64_t T = int64_t{1} << 20;
  VarlenBatch batch = VarlenBatch::from_lengths({T}, Device::CUDA);
  Tensor q = Tensor::empty({T, 8}, DType::BF16, Device::CUDA);
  Tensor out = Tensor::empty({T, 8}, DType::BF16, Device::CUDA);
  AttentionWorkspace ws;
  try {
    attention_prefill(out, q, q, q, batch, s, AttentionKernel::V1Materialized, &ws);
    FAIL() << "expected a CudaError";
  } catch (const CudaError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("4096.00 GiB"), std::string::npos) << msg;
    EXPECT_NE(msg.find("v1"), std::string::npos) << msg;
  }
  // The failed allocation leaves the GPU usable.
  expect_matches_cpu({5, 1, 130}, kTiny, 1300);
}

TEST(Attention07Gpu, HeadDimsTheFlashKernelLacksAreAClearError) {
  TVLLM_REQUIRE_GPU();
  const AttentionShape s{4, 2, 96};
  VarlenBatch batch = VarlenBatch::from_lengths({10}, Device::CUDA);
  Tensor q = Tensor::empty({10, s.q_dim()}, DType::BF16, Device::CUDA);
  Tensor kv = Tensor::empty({10, s.kv_dim()}, DType::BF16, Device::CUDA);
  Tensor out = Tensor::empty({10, s.q_dim()}, DType::BF16, Device::CUDA);
  try {
    attention_prefill(out, q, kv, kv, batch, s, AttentionKernel::V2Flash);
    FAIL() << "expected an InputError";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("head_dim 64 and 128, got 96"), std::string::npos) << e.what();
  }
  // v1 (cuBLAS) takes any head_dim that is a multiple of 8.
  expect_matches_cpu({10, 33}, s, 1400);
}

TEST(Attention07Gpu, BatchOnTheWrongDeviceIsRejected) {
  TVLLM_REQUIRE_GPU();
  VarlenBatch cpu_batch = VarlenBatch::from_lengths({4}, Device::CPU);
  Tensor q = Tensor::empty({4, kTiny.q_dim()}, DType::BF16, Device::CUDA);
  Tensor kv = Tensor::empty({4, kTiny.kv_dim()}, DType::BF16, Device::CUDA);
  Tensor out = Tensor::empty({4, kTiny.q_dim()}, DType::BF16, Device::CUDA);
  EXPECT_THROW(attention_prefill(out, q, kv, kv, cpu_batch, kTiny), InputError);
  VarlenBatch gpu_batch = VarlenBatch::from_lengths({4}, Device::CUDA);
  EXPECT_NE(gpu_batch.cu_seqlens_device(), nullptr);
  Tensor q_f32 = Tensor::empty({4, kTiny.q_dim()}, DType::F32, Device::CUDA);
  EXPECT_THROW(attention_prefill(out, q_f32, kv, kv, gpu_batch, kTiny), InputError);  // cuda wants bf16
}

TEST(Attention07Gpu, WorkspaceIsReusedAcrossCalls) {
  TVLLM_REQUIRE_GPU();
  // A model keeps one workspace for all its layers: a second call of the same size allocates nothing.
  AttentionWorkspace ws;
  const std::vector<int64_t> lengths{300, 20};
  const HostInputs in = random_inputs(320, kTiny, 1500);
  const std::vector<float> first = run_gpu(in, lengths, kTiny, AttentionKernel::V1Materialized, &ws);
  const size_t bytes = ws.scratch_bytes();
  EXPECT_EQ(bytes, size_t{6} * 300 * 300 * 4);
  void* where = ws.scratch(bytes);
  const std::vector<float> second = run_gpu(in, lengths, kTiny, AttentionKernel::V1Materialized, &ws);
  EXPECT_EQ(ws.scratch(bytes), where);
  EXPECT_EQ(first, second);  // and the same inputs give the same bits
}

}  // namespace
}  // namespace tvllm
