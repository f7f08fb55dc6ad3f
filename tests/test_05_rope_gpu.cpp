// Lesson 05, GPU: every kernel version against the fp32 CPU reference, on random inputs of many shapes,
// at arbitrary positions, with guard values around q and k (the kernels work in place, so instead of
// poisoning the output we check that nothing outside q and k changes); on a stream of the test's own and
// captured in a CUDA graph (no allocation, no synchronisation), equal to the default-stream result.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "common/buffer.h"
#include "common/dtype.h"
#include "common/cuda_stream.h"
#include "common/errors.h"
#include "common/random.h"
#include "common/tensor.h"
#include "rope.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

// bf16 keeps 8 significant bits: the final rounding of each output is off by at most 2^-8 of it.
constexpr double kBf16Unit = 1.0 / 256;
// fp32 differences from the CPU reference scale with the pair's size, not with the output element
// (a cos - b sin may cancel): v1/v2 compute the reference's fp32 numbers exactly; v3's sincosf is within
// 2 ulp of the table, <= 2^-22 |pair|. Allow 2^-18 of the largest input.
constexpr double kAtolPerMaxAbs = 1.0 / (1 << 18);
// Written around every q/k view; a kernel that writes outside its tensor changes one.
constexpr uint16_t kGuard = 0x7FA1;  // a NaN with a payload no computation produces

ModelConfig llama3_config(int64_t head_dim, int64_t max_positions) {
  ModelConfig c;
  c.model_type = "llama";
  c.head_dim = head_dim;
  c.num_attention_heads = 1;
  c.num_key_value_heads = 1;
  c.rope_theta = 500000.0;
  c.max_position_embeddings = max_positions;
  c.rope_scaling.rope_type = "llama3";
  c.rope_scaling.factor = 32.0;
  c.rope_scaling.low_freq_factor = 1.0;
  c.rope_scaling.high_freq_factor = 4.0;
  c.rope_scaling.original_max_position_embeddings = 8192;
  return c;
}

std::vector<float> random_bf16_values(size_t n, uint64_t seed) {
  std::vector<float> v = random_normal(n, seed, 3.0f);
  for (float& x : v) x = bf16_to_f32(f32_to_bf16(x));  // exactly representable: both sides start equal
  return v;
}

// Where a view sits inside its guarded buffer: the buffer has a guard row above and below, col_offset
// guard columns on the left (col_offset = 1 misaligns the view: 2 bytes past a 16-byte boundary) and
// pad on the right (row stride = col_offset + width + pad).
struct Placement {
  int64_t col_offset = 0;
  int64_t pad = 0;
};

class GuardedBf16 {
 public:
  GuardedBf16(const std::vector<float>& values, int64_t tokens, int64_t width, Placement place)
      : tokens_(tokens), width_(width), stride_(place.col_offset + width + place.pad),
        offset_(stride_ + place.col_offset), host_(static_cast<size_t>((tokens + 2) * stride_), kGuard) {
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t i = 0; i < width; ++i) host_[offset_ + t * stride_ + i] = f32_to_bf16(values[t * width + i]);
    buffer_ = DeviceBuffer(host_.size() * sizeof(uint16_t));
    buffer_.copy_from_host(host_.data(), buffer_.bytes());
  }
  TensorView view() const {
    return TensorView{buffer_.as<uint16_t>() + offset_, DType::BF16, Device::CUDA, {tokens_, width_}, {stride_, 1}};
  }
  // Copies the buffer back; returns the view's values (bit patterns) and counts changed guards.
  std::vector<uint16_t> read(int64_t& guards_changed) const {
    std::vector<uint16_t> now(host_.size());
    buffer_.copy_to_host(now.data(), buffer_.bytes());
    std::vector<uint16_t> inside;
    guards_changed = 0;
    for (int64_t idx = 0; idx < static_cast<int64_t>(now.size()); ++idx) {
      const int64_t row = idx / stride_ - 1, col = idx % stride_ - (offset_ - stride_);
      const bool in_view = row >= 0 && row < tokens_ && col >= 0 && col < width_;
      if (in_view) inside.push_back(now[idx]);
      else if (now[idx] != kGuard) ++guards_changed;
    }
    return inside;
  }

 private:
  int64_t tokens_, width_, stride_, offset_;
  std::vector<uint16_t> host_;
  DeviceBuffer buffer_;
};

struct Heads {
  int64_t q_heads, k_heads, head_dim;
};

std::string describe(RopeKernel kernel, const Heads& h, int64_t tokens, const Placement& p) {
  return std::string(rope_kernel_name(kernel)) + " q_heads " + std::to_string(h.q_heads) + " k_heads " +
         std::to_string(h.k_heads) + " head_dim " + std::to_string(h.head_dim) + " T " + std::to_string(tokens) +
         " col_offset " + std::to_string(p.col_offset) + " pad " + std::to_string(p.pad);
}

// Runs one kernel on guarded bf16 copies of q/k and checks it against the CPU reference.
void check_against_cpu(RopeKernel kernel, const Heads& h, const std::vector<int32_t>& positions,
                       const RopeTable& table, const Placement& place, uint64_t seed) {
  const int64_t T = static_cast<int64_t>(positions.size());
  const int64_t qw = h.q_heads * h.head_dim, kw = h.k_heads * h.head_dim;
  const std::vector<float> q0 = random_bf16_values(static_cast<size_t>(T * qw), seed);
  const std::vector<float> k0 = random_bf16_values(static_cast<size_t>(T * kw), seed + 1);
  const std::string what = describe(kernel, h, T, place);

  // The reference: fp32 on the CPU, from the same (bf16-exact) inputs.
  Tensor q_cpu = Tensor::from_f32(q0, {T, qw}, DType::F32, Device::CPU);
  Tensor k_cpu = Tensor::from_f32(k0, {T, kw}, DType::F32, Device::CPU);
  apply_rope(q_cpu, k_cpu, Tensor::from_i32(positions, {T}, Device::CPU), table);
  std::vector<float> expected = to_f32_vector(q_cpu.view());
  const std::vector<float> k_expected = to_f32_vector(k_cpu.view());
  expected.insert(expected.end(), k_expected.begin(), k_expected.end());

  GuardedBf16 q(q0, T, qw, place), k(k0, T, kw, place);
  Tensor pos = Tensor::from_i32(positions, {T}, Device::CUDA);
  apply_rope(q.view(), k.view(), pos, table, kernel);
  int64_t q_guards = 0, k_guards = 0;
  std::vector<uint16_t> got = q.read(q_guards);
  const std::vector<uint16_t> got_k = k.read(k_guards);
  got.insert(got.end(), got_k.begin(), got_k.end());
  EXPECT_EQ(q_guards, 0) << what << ": wrote outside q";
  EXPECT_EQ(k_guards, 0) << what << ": wrote outside k";
  ASSERT_EQ(got.size(), expected.size()) << what;

  double max_in = 0.0;
  for (float x : q0) max_in = std::max(max_in, static_cast<double>(std::fabs(x)));
  for (float x : k0) max_in = std::max(max_in, static_cast<double>(std::fabs(x)));
  const double atol = kAtolPerMaxAbs * max_in;
  int64_t bad = 0, not_bitwise = 0, first_bad = -1;
  for (size_t i = 0; i < got.size(); ++i) {
    const double a = bf16_to_f32(got[i]), b = expected[i];
    if (!(std::fabs(a - b) <= atol + kBf16Unit * std::fabs(b))) {
      if (first_bad < 0) first_bad = static_cast<int64_t>(i);
      ++bad;
    }
    if (got[i] != f32_to_bf16(expected[i])) ++not_bitwise;
  }
  EXPECT_EQ(bad, 0) << what << ": first bad element " << first_bad << " of " << got.size();
  // v1 and v2 use the same table and spell out the reference's fp32 operations (__fmul_rn, __fsub_rn):
  // their output is the reference's fp32 result rounded to bf16, bit for bit.
  if (kernel != RopeKernel::V3) {
    EXPECT_EQ(not_bitwise, 0) << what << ": not bitwise equal to bf16(CPU reference)";
  }
}

std::vector<int32_t> test_positions(int64_t tokens, int64_t max_positions, uint64_t seed) {
  // Decode-style and shuffled positions first (non-monotonic, including the table's last entry), then random.
  std::vector<int32_t> pos = {7, 0, static_cast<int32_t>(max_positions - 1), 3};
  pos.resize(static_cast<size_t>(std::max<int64_t>(tokens, 4)));
  Rng rng(seed);
  for (size_t t = 4; t < pos.size(); ++t) pos[t] = static_cast<int32_t>(rng.below(max_positions));
  pos.resize(static_cast<size_t>(tokens));
  return pos;
}

TEST(RopeGpu, EveryVersionMatchesTheCpuReference) {
  TVLLM_REQUIRE_GPU();
  // Head counts 1..32, GQA and not; head_dim 64 and 128 (8 pairs per 16-byte load), 80 (half = 40),
  // 12 (half = 6: 2 pairs per load), 6 and 2 (odd half: 1 pair per load).
  const Heads shapes[] = {{1, 1, 64}, {6, 2, 64}, {32, 8, 64}, {4, 2, 128}, {3, 1, 80}, {2, 1, 12}, {5, 5, 6}, {2, 1, 2}};
  const Placement placements[] = {{0, 0}, {1, 3}};  // aligned rows; misaligned start with padded rows
  uint64_t seed = 100;
  for (const Heads& h : shapes) {
    RopeTable table = RopeTable::build(llama3_config(h.head_dim, 4096));
    table.upload_to_device();
    for (int64_t T : {1, 3, 1000})
      for (const Placement& place : placements)
        for (RopeKernel kernel : all_rope_kernels()) {
          check_against_cpu(kernel, h, test_positions(T, 4096, seed), table, place, seed);
          seed += 2;
        }
  }
}

// One kernel alone (student mode grades each kernel by its own test), on a few of the shapes above.
void check_one_kernel(RopeKernel kernel) {
  const Heads shapes[] = {{1, 1, 64}, {32, 8, 64}, {4, 2, 128}, {3, 1, 80}, {5, 5, 6}};
  uint64_t seed = 500 + 100 * static_cast<uint64_t>(kernel);
  for (const Heads& h : shapes) {
    RopeTable table = RopeTable::build(llama3_config(h.head_dim, 4096));
    table.upload_to_device();
    for (int64_t T : {1, 1000}) {
      check_against_cpu(kernel, h, test_positions(T, 4096, seed), table, {0, 0}, seed);
      check_against_cpu(kernel, h, test_positions(T, 4096, seed + 1), table, {1, 3}, seed + 1);
      seed += 2;
    }
  }
}

TEST(RopeGpu, V1MatchesTheCpuReference) {
  TVLLM_REQUIRE_GPU();
  check_one_kernel(RopeKernel::V1);
}

TEST(RopeGpu, V2MatchesTheCpuReference) {
  TVLLM_REQUIRE_GPU();
  check_one_kernel(RopeKernel::V2);
}

TEST(RopeGpu, V3MatchesTheCpuReference) {
  TVLLM_REQUIRE_GPU();
  check_one_kernel(RopeKernel::V3);
}

TEST(RopeGpu, LargePositionsNeedAccurateSinCos) {
  TVLLM_REQUIRE_GPU();
  // Llama 3.2's 128k context: pair 0 turns one radian per position, so the angle reaches 131071 rad.
  // v3's sincosf reduces such angles exactly (its slow path starts near 1e5); the fast-math __sincosf
  // would be off by ~1e-2 here and fail this test.
  RopeTable table = RopeTable::build(llama3_config(64, 131072));
  table.upload_to_device();
  std::vector<int32_t> pos = {131071, 105616, 120000, 65536, 99999, 131000, 8191, 8192};
  Rng rng(5);
  for (int i = 0; i < 120; ++i) pos.push_back(static_cast<int32_t>(100000 + rng.below(31072)));
  for (RopeKernel kernel : all_rope_kernels())
    check_against_cpu(kernel, {32, 8, 64}, pos, table, {0, 0}, 900 + static_cast<uint64_t>(kernel));
}

TEST(RopeGpu, PositionsAreValidatedOrClamped) {
  TVLLM_REQUIRE_GPU();
  RopeTable table = RopeTable::build(llama3_config(64, 4096));
  table.upload_to_device();
  const std::vector<float> q0 = random_bf16_values(2 * 128, 1), k0 = random_bf16_values(2 * 64, 2);
  auto q = [&] { return Tensor::from_f32(q0, {2, 128}, DType::BF16, Device::CUDA); };
  auto k = [&] { return Tensor::from_f32(k0, {2, 64}, DType::BF16, Device::CUDA); };
  for (RopeKernel kernel : all_rope_kernels()) {
    // Validate (the default): an out-of-range position is an input error naming it.
    EXPECT_THROW(apply_rope(q(), k(), Tensor::from_i32({3, 4096}, {2}, Device::CUDA), table, kernel), InputError);
    EXPECT_THROW(apply_rope(q(), k(), Tensor::from_i32({-5, 0}, {2}, Device::CUDA), table, kernel), InputError);
    // Trusted: no check, but the kernels clamp into the table: position 9999 rotates like 4095, -5 like 0.
    Tensor qa = q(), ka = k(), qb = q(), kb = k();
    apply_rope(qa, ka, Tensor::from_i32({9999, -5}, {2}, Device::CUDA), table, kernel, PositionCheck::Trusted);
    apply_rope(qb, kb, Tensor::from_i32({4095, 0}, {2}, Device::CUDA), table, kernel);
    EXPECT_EQ(to_f32_vector(qa.view()), to_f32_vector(qb.view())) << rope_kernel_name(kernel);
    EXPECT_EQ(to_f32_vector(ka.view()), to_f32_vector(kb.view())) << rope_kernel_name(kernel);
  }
}

TEST(RopeGpu, BadArgumentsAreRejected) {
  TVLLM_REQUIRE_GPU();
  RopeTable table = RopeTable::build(llama3_config(64, 16));
  Tensor q = Tensor::from_f32(random_bf16_values(128, 1), {1, 128}, DType::BF16, Device::CUDA);
  Tensor k = Tensor::from_f32(random_bf16_values(64, 2), {1, 64}, DType::BF16, Device::CUDA);
  Tensor pos = Tensor::from_i32({1}, {1}, Device::CUDA);
  EXPECT_THROW(apply_rope(q, k, pos, table), InputError);  // the table is not on the GPU yet
  table.upload_to_device();
  EXPECT_NO_THROW(apply_rope(q, k, pos, table));
  Tensor q32 = Tensor::from_f32(random_bf16_values(128, 1), {1, 128}, DType::F32, Device::CUDA);
  EXPECT_THROW(apply_rope(q32, k, pos, table), InputError);  // the GPU path stores bf16
  EXPECT_THROW(apply_rope(q, k, Tensor::from_i32({1}, {1}, Device::CPU), table), InputError);  // host positions
  Tensor k_host = Tensor::from_f32(random_bf16_values(64, 2), {1, 64}, DType::BF16, Device::CPU);
  EXPECT_THROW(apply_rope(q, k_host, pos, table), InputError);  // k on the wrong device
  // No tokens: nothing to do, and no launch with an empty grid.
  Tensor q0 = Tensor::empty({0, 128}, DType::BF16, Device::CUDA), k0 = Tensor::empty({0, 64}, DType::BF16, Device::CUDA);
  for (RopeKernel kernel : all_rope_kernels())
    EXPECT_NO_THROW(apply_rope(q0, k0, Tensor::empty({0}, DType::I32, Device::CUDA), table, kernel));
}

// q and k of a Llama-3.2-1B-like token batch (GQA: 8 q heads, 2 kv heads of 64), positions 5..5+T.
struct RopeOnStream {
  static constexpr int64_t kTokens = 23, kHeadDim = 64, kQHeads = 8, kKHeads = 2;
  RopeTable table = [] {
    RopeTable t = RopeTable::build(llama3_config(kHeadDim, 4096));
    t.upload_to_device();  // once, at load: apply_rope never uploads
    return t;
  }();
  std::vector<float> q_in = random_bf16_values(kTokens * kQHeads * kHeadDim, 51);
  std::vector<float> k_in = random_bf16_values(kTokens * kKHeads * kHeadDim, 52);
  Tensor q = Tensor::empty({kTokens, kQHeads * kHeadDim}, DType::BF16, Device::CUDA);
  Tensor k = Tensor::empty({kTokens, kKHeads * kHeadDim}, DType::BF16, Device::CUDA);
  Tensor positions = [] {
    std::vector<int32_t> p(kTokens);
    for (int64_t t = 0; t < kTokens; ++t) p[t] = static_cast<int32_t>(5 + 97 * t);
    return Tensor::from_i32(p, {kTokens}, Device::CUDA);
  }();

  // The unrotated inputs again (RoPE works in place), copied into the same buffers (a captured graph
  // keeps the pointers it recorded) and waited for.
  void reset() {
    for (auto [dst, src] : {std::pair<Tensor*, const std::vector<float>*>{&q, &q_in}, {&k, &k_in}}) {
      const Tensor fresh = Tensor::from_f32(*src, dst->view().shape, DType::BF16, Device::CPU);
      TVLLM_CUDA_CHECK(cudaMemcpy(dst->data(), fresh.data(), fresh.view().nbytes(), cudaMemcpyHostToDevice));
    }
    TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
  }
  // Trusted: the engine's mode; Validate would copy the positions back and wait.
  void run(RopeKernel kernel, cudaStream_t stream) {
    apply_rope(q, k, positions, table, kernel, PositionCheck::Trusted, stream);
  }
  std::vector<std::vector<float>> results() const { return {to_f32_vector(q), to_f32_vector(k)}; }
};

TEST(RopeGpu, OwnStreamEqualsDefaultStream) {
  TVLLM_REQUIRE_GPU();
  RopeOnStream c;
  CudaStream stream;
  for (RopeKernel kernel : all_rope_kernels()) {
    c.reset();
    c.run(kernel, nullptr);
    const auto on_default = c.results();
    c.reset();
    c.run(kernel, stream);
    stream.synchronize();
    EXPECT_EQ(c.results(), on_default) << rope_kernel_name(kernel);
    // Validate on the stream: the positions are read back on it (a synchronisation, allowed here).
    c.reset();
    apply_rope(c.q, c.k, c.positions, c.table, kernel, PositionCheck::Validate, stream);
    stream.synchronize();
    EXPECT_EQ(c.results(), on_default) << rope_kernel_name(kernel) << " (validated)";
  }
}

TEST(RopeGpu, GraphCaptureReplaysTheEagerResult) {
  TVLLM_REQUIRE_GPU();
  RopeOnStream c;
  CudaStream stream;
  for (RopeKernel kernel : all_rope_kernels()) {
    c.reset();
    c.run(kernel, stream);
    stream.synchronize();
    const auto eager = c.results();
    c.reset();
    // Recording fails if apply_rope allocates or synchronises (capture mode global).
    CudaGraph graph = CudaGraph::capture(stream, [&] { c.run(kernel, stream); });
    EXPECT_GE(graph.num_nodes(), 1u);  // v1: two kernels (q, k); v2, v3: one
    EXPECT_EQ(c.results(), std::vector<std::vector<float>>({c.q_in, c.k_in}))
        << "capturing must not run anything";
    graph.launch(stream);
    stream.synchronize();
    EXPECT_EQ(c.results(), eager) << rope_kernel_name(kernel);
  }
}

TEST(RopeGpu, ValidatedPositionsCannotBeCaptured) {
  TVLLM_REQUIRE_GPU();
  // The Validate mode reads the positions back and waits: exactly what a capture forbids. The error
  // surfaces as an exception, and the stream leaves capture mode (CudaGraph::capture ends it).
  RopeOnStream c;
  c.reset();
  CudaStream stream;
  EXPECT_ANY_THROW(CudaGraph::capture(stream, [&] {
    apply_rope(c.q, c.k, c.positions, c.table, RopeKernel::V2, PositionCheck::Validate, stream);
  }));
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusActive;
  TVLLM_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  EXPECT_EQ(status, cudaStreamCaptureStatusNone);
}

}  // namespace
}  // namespace tvllm
