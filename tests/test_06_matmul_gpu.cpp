// Lesson 06, GPU: every kernel version against the CPU reference on random inputs and edge cases; the
// tensor-core kernels (v3 WMMA, v4 mma.sync) on tile edges; streams, CUDA graph capture, and the cuBLAS
// handle's math mode.
//
// The inputs are random values rounded to bf16 once, and the CPU reference gets those SAME values in
// fp32, so there is no input rounding between the two: a bf16-output kernel may differ from the
// reference only by its final rounding (<= 2^-8 relative) and its fp32 summation order (tiny). That is
// kBf16OutVsCpu (matmul_check.h), far tighter than the check against Hugging Face.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include <cublas_v2.h>

#include "common/buffer.h"
#include "common/cublas.h"
#include "common/cuda_stream.h"
#include "common/device.h"
#include "common/dtype.h"
#include "common/errors.h"
#include "common/random.h"
#include "matmul.h"
#include "matmul_check.h"
#include "testing/gpu_buffers.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

using testing::bytes_of;
using testing::poisoned;

// Random values that bf16 holds exactly.
std::vector<float> bf16_exact(std::vector<float> v) {
  for (float& x : v) x = bf16_to_f32(f32_to_bf16(x));
  return v;
}

// One problem: the same values as fp32 on the host (for the reference) and bf16 on the device.
struct Problem {
  int64_t tokens, in, out;
  std::vector<float> x, w;  // [T, in], [out, in], bf16-exact
  Tensor x_dev, w_dev;      // bf16 on the GPU
  Tensor expected;          // [T, out] fp32, the CPU reference

  Problem(int64_t tokens_, int64_t in_, int64_t out_, uint64_t seed, float x_scale = 1.f)
      : tokens(tokens_), in(in_), out(out_) {
    x = bf16_exact(random_uniform(static_cast<size_t>(tokens * in), seed, -x_scale, x_scale));
    w = bf16_exact(random_normal(static_cast<size_t>(out * in), seed + 1, 1.0f / std::sqrt(float(in))));
    x_dev = Tensor::from_f32(x, {tokens, in}, DType::BF16, Device::CUDA);
    w_dev = Tensor::from_f32(w, {out, in}, DType::BF16, Device::CUDA);
    Tensor x_cpu = Tensor::from_f32(x, {tokens, in}, DType::F32, Device::CPU);
    Tensor w_cpu = Tensor::from_f32(w, {out, in}, DType::F32, Device::CPU);
    expected = Tensor::empty({tokens, out}, DType::F32, Device::CPU);
    linear(expected, x_cpu, w_cpu);
  }
  std::string describe() const {
    return "T=" + std::to_string(tokens) + " in=" + std::to_string(in) + " out=" + std::to_string(out);
  }
};


Tensor run(const Problem& p, MatmulKernel kernel, CublasHandle& handle, DType out_dtype = DType::BF16) {
  Tensor y = poisoned({p.tokens, p.out}, out_dtype);
  linear(y, p.x_dev, p.w_dev, kernel, &handle);
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
  return y;
}


std::string describe(const CompareResult& r) {
  std::string s = "bad " + std::to_string(r.bad) + " of " + std::to_string(r.count) + ", max_abs " +
                  std::to_string(r.max_abs) + ", rel_l2 " + std::to_string(r.rel_l2) + " " + r.error;
  for (const Mismatch& m : r.first_mismatches)
    s += "\n  [" + std::to_string(m.index) + "] got " + std::to_string(m.actual) + ", expected " +
         std::to_string(m.expected);
  return s;
}

class Matmul06Kernel : public ::testing::TestWithParam<MatmulKernel> {};

std::string kernel_name(const ::testing::TestParamInfo<MatmulKernel>& info) {
  return std::string(matmul_kernel_version(info.param));
}

INSTANTIATE_TEST_SUITE_P(AllVersions, Matmul06Kernel, ::testing::ValuesIn(all_matmul_kernels()), kernel_name);

TEST_P(Matmul06Kernel, MatchesTheCpuReferenceOnManyShapes) {
  TVLLM_REQUIRE_GPU();
  CublasHandle handle;
  // (in, out) pairs: size 1, odd sizes, not multiples of any tile (7, 600, 1000), projections
  // of a model shaped like the bundled one (hidden != heads * head_dim: 320 -> 384, 384 -> 320, 320 -> 128,
  // 320 -> 600, 600 -> 320; the bundled model itself, hidden 336, runs in lesson06_matmul) and hidden 2048.
  const std::vector<std::pair<int64_t, int64_t>> in_out = {
      {1, 1},     {1, 7},     {7, 1},     {7, 64},     {64, 7},      {320, 384},   {384, 320},
      {320, 128}, {320, 600}, {600, 320}, {2048, 1000}, {1000, 2048}, {2048, 2048}};
  uint64_t seed = 100;
  for (int64_t tokens : {1, 3, 17, 128}) {
    for (const auto& [in, out] : in_out) {
      const Problem p(tokens, in, out, seed += 2);
      SCOPED_TRACE(p.describe());
      const CompareResult r = compare_rows("y", run(p, GetParam(), handle), p.expected, kBf16OutVsCpu);
      EXPECT_TRUE(r.pass()) << describe(r);
    }
  }
}

TEST_P(Matmul06Kernel, Fp32OutputMatchesTheCpuReference) {
  TVLLM_REQUIRE_GPU();
  CublasHandle handle;
  for (const Problem& p : {Problem(1, 2048, 1000, 7), Problem(17, 600, 320, 8), Problem(128, 320, 7, 9)}) {
    SCOPED_TRACE(p.describe());
    const CompareResult r = compare_rows("y", run(p, GetParam(), handle, DType::F32), p.expected, kF32OutVsCpu);
    EXPECT_TRUE(r.pass()) << describe(r);
  }
}

TEST_P(Matmul06Kernel, UnalignedViews) {
  // Views that start 1 element (2 bytes) and 8 elements (16 bytes) into their buffers: the tiled
  // kernel must fall back from 16-byte loads, and cuBLASLt must not pick an algorithm that assumes
  // 256-byte alignment.
  TVLLM_REQUIRE_GPU();
  CublasHandle handle;
  const Problem p(17, 64, 40, 77);
  for (int64_t offset : {1, 8}) {
    SCOPED_TRACE("offset " + std::to_string(offset) + " elements");
    Tensor x_buf = Tensor::empty({offset + p.tokens * p.in}, DType::BF16, Device::CUDA);
    Tensor w_buf = Tensor::empty({offset + p.out * p.in}, DType::BF16, Device::CUDA);
    Tensor y_buf = poisoned({offset + p.tokens * p.out}, DType::BF16);
    const TensorView x = x_buf.view().rows(offset, p.tokens * p.in).reshape({p.tokens, p.in});
    const TensorView w = w_buf.view().rows(offset, p.out * p.in).reshape({p.out, p.in});
    const TensorView y = y_buf.view().rows(offset, p.tokens * p.out).reshape({p.tokens, p.out});
    copy_view(x, p.x_dev);
    copy_view(w, p.w_dev);
    linear(y, x, w, GetParam(), &handle);
    TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
    const CompareResult r = compare_rows("y", y, p.expected, kBf16OutVsCpu);
    EXPECT_TRUE(r.pass()) << describe(r);
  }
}

TEST_P(Matmul06Kernel, RowsOfVeryDifferentSizes) {
  // Rows of x scaled from 2^-30 to 2^30: every row must keep its own relative accuracy (a kernel that
  // summed in bf16, or mixed rows up, would fail the row-scaled check on the small rows).
  TVLLM_REQUIRE_GPU();
  CublasHandle handle;
  Problem p(21, 320, 96, 55);
  for (int64_t t = 0; t < p.tokens; ++t) {
    const float scale = std::ldexp(1.0f, static_cast<int>(3 * t) - 30);
    for (int64_t i = 0; i < p.in; ++i) p.x[t * p.in + i] *= scale;  // exact: a power of two
  }
  p.x_dev = Tensor::from_f32(p.x, {p.tokens, p.in}, DType::BF16, Device::CUDA);
  Tensor x_cpu = Tensor::from_f32(p.x, {p.tokens, p.in}, DType::F32, Device::CPU);
  Tensor w_cpu = Tensor::from_f32(p.w, {p.out, p.in}, DType::F32, Device::CPU);
  linear(p.expected, x_cpu, w_cpu);
  const CompareResult r = compare_rows("y", run(p, GetParam(), handle), p.expected, kBf16OutVsCpu);
  EXPECT_TRUE(r.pass()) << describe(r);
}

TEST_P(Matmul06Kernel, MoreTokensThanOneGridHolds) {
  // gridDim.y is at most 65535: with the tensor-core kernels' 128-token tiles that is 8,388,480 tokens,
  // with v2's 64-token tiles 4,194,240, and the naive kernel's 8-token rows cover only 524,280. Beyond
  // that the kernels stride over the grid.
  TVLLM_REQUIRE_GPU();
  CublasHandle handle;
  const Problem p(int64_t{65535} * 128 + 100, 3, 2, 91);
  const CompareResult r = compare_rows("y", run(p, GetParam(), handle), p.expected, kBf16OutVsCpu);
  EXPECT_TRUE(r.pass()) << describe(r);
}

TEST_P(Matmul06Kernel, SameInputsSameBits) {
  TVLLM_REQUIRE_GPU();
  CublasHandle handle;
  const Problem p(33, 600, 320, 61);
  Tensor y = run(p, GetParam(), handle);
  // right as well as repeatable (two untouched, poisoned outputs would be the same bits too)
  const CompareResult r = compare_rows("y", y, p.expected, kBf16OutVsCpu);
  EXPECT_TRUE(r.pass()) << describe(r);
  const std::vector<float> first = to_f32_vector(y);
  const std::vector<float> second = to_f32_vector(run(p, GetParam(), handle));
  ASSERT_EQ(first.size(), second.size());
  EXPECT_EQ(std::memcmp(first.data(), second.data(), first.size() * sizeof(float)), 0);
}

TEST_P(Matmul06Kernel, RunsOnTheHandlesStream) {
  TVLLM_REQUIRE_GPU();
  CudaStream stream;
  CublasHandle handle;
  handle.set_stream(stream);
  const Problem p(40, 2048, 512, 71);
  Tensor y = poisoned({p.tokens, p.out}, DType::BF16);
  linear(y, p.x_dev, p.w_dev, GetParam(), &handle);
  stream.synchronize();
  const CompareResult r = compare_rows("y", y, p.expected, kBf16OutVsCpu);
  EXPECT_TRUE(r.pass()) << describe(r);
}

TEST_P(Matmul06Kernel, GraphCaptureReplaysEqualToEager) {
  // What lesson 14's graph runner does with a whole decode step: capture the launches on a stream into a
  // CUDA graph, then replay it. A capture fails if the call allocates, synchronises or touches the legacy
  // default stream; the replay must write the same bits as the eager call.
  TVLLM_REQUIRE_GPU();
  CudaStream stream;
  CublasHandle handle(CublasHandle::kDefaultWorkspaceBytes, stream);
  const Problem p(129, 1032, 390, 301);
  Tensor eager = poisoned({p.tokens, p.out}, DType::BF16);
  linear(eager, p.x_dev, p.w_dev, GetParam(), &handle);  // also the warm-up: v6 makes its plan here
  stream.synchronize();
  const CompareResult r = compare_rows("y", eager, p.expected, kBf16OutVsCpu);
  EXPECT_TRUE(r.pass()) << describe(r);

  Tensor replayed = poisoned({p.tokens, p.out}, DType::BF16);
  const CudaGraph graph =
      CudaGraph::capture(stream, [&] { linear(replayed, p.x_dev, p.w_dev, GetParam(), &handle); });
  EXPECT_GE(graph.num_nodes(), 1u);  // the launches were recorded...
  EXPECT_EQ(bytes_of(replayed), std::vector<unsigned char>(replayed.view().nbytes(), 0xFF))
      << "...not run: the capture must record the work";
  for (int replay = 0; replay < 2; ++replay) {
    TVLLM_CUDA_CHECK(cudaMemsetAsync(replayed.data(), 0xFF, replayed.view().nbytes(), stream));
    graph.launch(stream);
    stream.synchronize();
    EXPECT_EQ(bytes_of(replayed), bytes_of(eager)) << "replay " << replay;
  }
}

// ---- the tensor-core kernels: tile edges ----------------------------------------------------------------

class Matmul06TensorCore : public ::testing::TestWithParam<MatmulKernel> {};

INSTANTIATE_TEST_SUITE_P(TensorCores, Matmul06TensorCore,
                         ::testing::Values(MatmulKernel::V3Wmma, MatmulKernel::V4MmaSync), kernel_name);

TEST_P(Matmul06TensorCore, EdgeShapesWithBf16AndFp32Outputs) {
  // Block tiles are 128 tokens x 128 outputs x 32 of K; a warp's mma tiles are 16 x 8 (x 16).
  // T = 1, 7, 129: one row, a part of one mma tile, one row into a second block tile.
  // out = 8, 100, 1000: one mma tile, not a multiple of 16 or 128, 7.8 block tiles.
  // in = 8, 24, 2048: one 16-byte chunk (the rest of the K slice zero-filled), part of one slice, 64 slices.
  TVLLM_REQUIRE_GPU();
  CublasHandle handle;
  uint64_t seed = 500;
  for (int64_t tokens : {1, 7, 129}) {
    for (int64_t out : {8, 100, 1000}) {
      for (int64_t in : {8, 24, 2048}) {
        const Problem p(tokens, in, out, seed += 2);
        SCOPED_TRACE(p.describe());
        const CompareResult bf16 = compare_rows("y bf16", run(p, GetParam(), handle), p.expected, kBf16OutVsCpu);
        EXPECT_TRUE(bf16.pass()) << describe(bf16);
        const CompareResult f32 =
            compare_rows("y fp32", run(p, GetParam(), handle, DType::F32), p.expected, kF32OutVsCpu);
        EXPECT_TRUE(f32.pass()) << describe(f32);
      }
    }
  }
}

TEST_P(Matmul06TensorCore, SeveralBlockTilesEachWay) {
  // 5 token tiles (the last one 8 rows), 4 output tiles (the last one 6 columns), and K = 1032 = 32
  // slices and one chunk: every pipeline stage is used many times, and the last slice is mostly zeros.
  TVLLM_REQUIRE_GPU();
  CublasHandle handle;
  const Problem p(520, 1032, 390, 401);
  for (DType dtype : {DType::BF16, DType::F32}) {
    SCOPED_TRACE(dtype_name(dtype));
    const CompareResult r = compare_rows("y", run(p, GetParam(), handle, dtype), p.expected,
                                         dtype == DType::F32 ? kF32OutVsCpu : kBf16OutVsCpu);
    EXPECT_TRUE(r.pass()) << describe(r);
  }
}

TEST_P(Matmul06TensorCore, ElementCopiesGiveTheSameBitsAsSixteenByteCopies) {
  // Views 1 element (2 bytes) into their buffers cannot use 16-byte copies: the kernel copies element by
  // element instead. The tile arithmetic is the same, so the result must be the same, bit for bit.
  TVLLM_REQUIRE_GPU();
  CublasHandle handle;
  const Problem p(129, 264, 100, 411);
  Tensor fast_y = run(p, GetParam(), handle);
  const CompareResult r = compare_rows("y", fast_y, p.expected, kBf16OutVsCpu);  // not two untouched outputs
  EXPECT_TRUE(r.pass()) << describe(r);
  const std::vector<unsigned char> fast = bytes_of(fast_y);
  Tensor x_buf = Tensor::empty({1 + p.tokens * p.in}, DType::BF16, Device::CUDA);
  Tensor w_buf = Tensor::empty({1 + p.out * p.in}, DType::BF16, Device::CUDA);
  const TensorView x = x_buf.view().rows(1, p.tokens * p.in).reshape({p.tokens, p.in});
  const TensorView w = w_buf.view().rows(1, p.out * p.in).reshape({p.out, p.in});
  copy_view(x, p.x_dev);
  copy_view(w, p.w_dev);
  Tensor y = poisoned({p.tokens, p.out}, DType::BF16);
  linear(y, x, w, GetParam(), &handle);
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(bytes_of(y), fast);
}

TEST_P(Matmul06TensorCore, WithoutAHandleRunsOnTheDefaultStream) {
  TVLLM_REQUIRE_GPU();
  const Problem p(33, 320, 600, 421);
  Tensor y = poisoned({p.tokens, p.out}, DType::BF16);
  linear(y, p.x_dev, p.w_dev, GetParam(), nullptr);
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
  const CompareResult r = compare_rows("y", y, p.expected, kBf16OutVsCpu);
  EXPECT_TRUE(r.pass()) << describe(r);
}

// ---- batch invariance (v4, v7 and v8) -----------------------------------------------------------------------

// The bits of y's rows [first, first + count) when x holds only those rows.
std::vector<unsigned char> rows_alone(const Problem& p, int64_t first, int64_t count, MatmulKernel kernel,
                                      CublasHandle& handle, DType dtype) {
  Tensor y = poisoned({count, p.out}, dtype);
  linear(y, p.x_dev.view().rows(first, count), p.w_dev, kernel, &handle);
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
  return bytes_of(y);
}

// Lesson 11's engine puts many requests in one step; a request's logits must not depend on who else is in
// it. v4, v7 and v8 promise that row t of y is the same bits whatever the other rows are and however many: here
// against the same rows computed among 300 (3 token tiles). Shapes: K cut in 8 and 16 pieces (o_proj- and
// down_proj-like), one piece, K not a multiple of the 32-column slice, out not a multiple of the tile.
// cuBLAS (v5) makes no such promise: how many elements differ is printed, not asserted.
TEST(Matmul06Gpu, BatchInvariantRowsDoNotDependOnTheOtherRows) {
  TVLLM_REQUIRE_GPU();
  CublasHandle handle;
  const std::pair<int64_t, int64_t> slices[] = {{0, 1}, {5, 1}, {17, 7}, {128, 64}, {299, 1}, {40, 200}};
  struct Shape { int64_t in, out; };
  for (const Shape s : {Shape{2048, 2048}, Shape{8192, 512}, Shape{1000, 100}, Shape{264, 8}, Shape{2048, 3000}}) {
    const Problem p(300, s.in, s.out, static_cast<uint64_t>(700 + s.in + s.out));
    SCOPED_TRACE(p.describe() + ", " + std::to_string(batch_invariant_split(s.in, s.out).splits) + " pieces");
    for (const DType dtype : {DType::BF16, DType::F32}) {
      const size_t row_bytes = static_cast<size_t>(p.out) * dtype_size(dtype);
      for (const MatmulKernel kernel : {MatmulKernel::V4MmaSync, MatmulKernel::V7BatchInvariant, MatmulKernel::V8PinnedLt,
                                        MatmulKernel::V5Cublas}) {
        SCOPED_TRACE(std::string(matmul_kernel_version(kernel)) + " " + std::string(dtype_name(dtype)));
        Tensor all = run(p, kernel, handle, dtype);
        const CompareResult r = compare_rows("y", all, p.expected, dtype == DType::F32 ? kF32OutVsCpu : kBf16OutVsCpu);
        EXPECT_TRUE(r.pass()) << describe(r);
        const std::vector<unsigned char> all_bytes = bytes_of(all);
        int64_t differing_rows = 0;
        for (const auto& [first, count] : slices) {
          const std::vector<unsigned char> expected(all_bytes.begin() + static_cast<std::ptrdiff_t>(first * row_bytes),
                                                    all_bytes.begin() + static_cast<std::ptrdiff_t>((first + count) * row_bytes));
          const std::vector<unsigned char> alone = rows_alone(p, first, count, kernel, handle, dtype);
          if (kernel != MatmulKernel::V5Cublas) {
            EXPECT_EQ(alone, expected) << "rows " << first << ".." << first + count - 1 << " alone";
          } else {
            for (int64_t r0 = 0; r0 < count; ++r0)
              differing_rows += std::memcmp(alone.data() + r0 * row_bytes, expected.data() + r0 * row_bytes, row_bytes) != 0;
          }
        }
        if (kernel == MatmulKernel::V5Cublas)
          std::printf("v5 (cuBLAS) %s %s: %lld of 274 rows differ alone vs among 300\n", p.describe().c_str(),
                      std::string(dtype_name(dtype)).c_str(), static_cast<long long>(differing_rows));
      }
    }
  }
}

// v7 with a workspace too small for all rows at once goes in chunks of rows: the same bits. With one too
// small for one row it refuses, saying why.
TEST(Matmul06Gpu, BatchInvariantChunksOfRowsGiveTheSameBits) {
  TVLLM_REQUIRE_GPU();
  const Problem p(300, 2048, 2048, 811);  // 8 pieces: 64 KiB of partial sums per row
  CublasHandle big;
  Tensor y_whole = run(p, MatmulKernel::V7BatchInvariant, big);
  const CompareResult r = compare_rows("y", y_whole, p.expected, kBf16OutVsCpu);  // right, not only repeatable
  EXPECT_TRUE(r.pass()) << describe(r);
  const std::vector<unsigned char> whole = bytes_of(y_whole);
  CublasHandle small(size_t{1} << 20);  // 16 rows per chunk: 19 chunks
  EXPECT_EQ(bytes_of(run(p, MatmulKernel::V7BatchInvariant, small)), whole);
  CublasHandle tiny(size_t{32} << 10);
  Tensor y = poisoned({p.tokens, p.out}, DType::BF16);
  EXPECT_THROW(linear(y, p.x_dev, p.w_dev, MatmulKernel::V7BatchInvariant, &tiny), InputError);
}

// v8 on the shapes the engine runs (Llama 3.2 1B, lesson 08's fused q|k|v and gate|up; the lm_head with the
// engine's fp32 logits). x holds 4096 random rows; y computed at T = 4096 is the reference, and every slice
// of T = 1, 2, 3, 7, 64 and 333 rows (at the start, the end, and across tile boundaries) must be the same bits
// computed alone. This is the proof that the pinned algorithm keeps one order of additions at every T (the
// argument in matmul_pinned.cu only holds for kernels that do not change their inner behaviour with T). One
// row per shape is also checked against the CPU reference: invariant and right. On compute capability 9.0
// (the H100/H200 the numbers of the chapter come from) the shape must be pinned, not left to v7.
TEST(Matmul06Gpu, PinnedLtRowsAreTheSameBitsAtEveryT) {
  TVLLM_REQUIRE_GPU();
  const DeviceProps props = query_device();
  const bool hopper = props.compute_major == 9;
  CublasHandle handle;
  constexpr int64_t kRows = 4096;
  struct Shape { const char* name; int64_t in, out; DType dtype; };
  const Shape shapes[] = {{"q|k|v", 2048, 3072, DType::BF16},   {"o_proj", 2048, 2048, DType::BF16},
                          {"gate|up", 2048, 16384, DType::BF16}, {"down_proj", 8192, 2048, DType::BF16},
                          {"lm_head", 2048, 128256, DType::F32}};
  const int64_t token_counts[] = {1, 2, 3, 7, 64, 333};
  Tensor x = Tensor::empty({kRows, 8192}, DType::BF16, Device::CUDA);
  fill_uniform_bf16(x, 21);
  for (const Shape& s : shapes) {
    const PinnedMatmulAlgo pin = pinned_matmul_algo(s.in, s.out, s.dtype, handle);
    std::printf("v8 %s [%lld -> %lld]: %s%s\n", s.name, static_cast<long long>(s.in), static_cast<long long>(s.out),
                pin.pinned ? "" : "not pinned, runs v7: ", pin.description.c_str());
    SCOPED_TRACE(std::string(s.name) + ": " + pin.description);
    if (hopper) {
      EXPECT_TRUE(pin.pinned);
    }
    const TensorView xs = TensorView::contiguous(x.data(), DType::BF16, Device::CUDA, {kRows, s.in});
    Tensor w = Tensor::empty({s.out, s.in}, DType::BF16, Device::CUDA);
    fill_uniform_bf16(w, 22 + static_cast<uint64_t>(s.out), -0.05f, 0.05f);
    Tensor all = poisoned({kRows, s.out}, s.dtype);
    linear(all, xs, w, MatmulKernel::V8PinnedLt, &handle);
    TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<unsigned char> all_bytes = bytes_of(all);
    const size_t row_bytes = static_cast<size_t>(s.out) * dtype_size(s.dtype);
    for (const int64_t tokens : token_counts) {
      for (const int64_t first : {int64_t{0}, int64_t{127}, kRows - tokens}) {
        Tensor y = poisoned({tokens, s.out}, s.dtype);
        linear(y, xs.rows(first, tokens), w, MatmulKernel::V8PinnedLt, &handle);
        TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
        const auto begin = all_bytes.begin() + static_cast<std::ptrdiff_t>(first * row_bytes);
        const std::vector<unsigned char> expected(begin, begin + static_cast<std::ptrdiff_t>(tokens * row_bytes));
        EXPECT_TRUE(bytes_of(y) == expected) << "rows " << first << ".." << first + tokens - 1 << " at T = " << tokens;
      }
    }
    // Row 4095 against the CPU reference (the same bf16 values, widened exactly).
    const Tensor x_row = Tensor::copy_of(xs.rows(kRows - 1, 1), Device::CPU, DType::F32);
    const Tensor w_host = Tensor::copy_of(w.view(), Device::CPU, DType::BF16);
    Tensor expected = Tensor::empty({1, s.out}, DType::F32, Device::CPU);
    linear(expected, x_row, w_host);
    const CompareResult r = compare_rows("last row", all.view().rows(kRows - 1, 1), expected,
                                         s.dtype == DType::F32 ? kF32OutVsCpu : kBf16OutVsCpu);
    EXPECT_TRUE(r.pass()) << describe(r);
  }
}

// Lesson 14's graph runner captures a decode step the first time its batch size occurs, so v8 may meet a new T
// inside a capture: the plan for that T (its descriptors, host work; the algorithm check is left to
// cublasLtMatmul while capturing) is made there, and the replay must give the bits an eager call gives.
TEST(Matmul06Gpu, PinnedLtMakesANewTsPlanInsideACapture) {
  TVLLM_REQUIRE_GPU();
  CudaStream stream;
  CublasHandle handle(CublasHandle::kDefaultWorkspaceBytes, stream);
  const Problem p(65, 1024, 512, 977);
  {  // the shape's pin, made eagerly at another T (as the engine's warm-up prefill does)
    Tensor y = poisoned({64, p.out}, DType::BF16);
    linear(y, p.x_dev.view().rows(0, 64), p.w_dev, MatmulKernel::V8PinnedLt, &handle);
    stream.synchronize();
  }
  EXPECT_TRUE(pinned_matmul_algo(p.in, p.out, DType::BF16, handle).pinned || query_device().compute_major != 9);
  Tensor replayed = poisoned({p.tokens, p.out}, DType::BF16);
  const CudaGraph graph =
      CudaGraph::capture(stream, [&] { linear(replayed, p.x_dev, p.w_dev, MatmulKernel::V8PinnedLt, &handle); });
  graph.launch(stream);
  stream.synchronize();
  const CompareResult r = compare_rows("y", replayed, p.expected, kBf16OutVsCpu);
  EXPECT_TRUE(r.pass()) << describe(r);
  Tensor eager = poisoned({p.tokens, p.out}, DType::BF16);
  linear(eager, p.x_dev, p.w_dev, MatmulKernel::V8PinnedLt, &handle);
  stream.synchronize();
  EXPECT_EQ(bytes_of(replayed), bytes_of(eager));
}

// A shape v8 cannot pin (out not a multiple of 8: rows of y are not 16-byte aligned) runs v7 instead, for every
// T alike: its bits are v7's.
TEST(Matmul06Gpu, PinnedLtRunsV7WhereItCannotPin) {
  TVLLM_REQUIRE_GPU();
  CublasHandle handle;
  const PinnedMatmulAlgo pin = pinned_matmul_algo(1000, 100, DType::BF16, handle);
  EXPECT_FALSE(pin.pinned);
  EXPECT_NE(pin.description.find("multiples of 8"), std::string::npos) << pin.description;
  const Problem p(37, 1000, 100, 923);
  EXPECT_EQ(bytes_of(run(p, MatmulKernel::V8PinnedLt, handle)), bytes_of(run(p, MatmulKernel::V7BatchInvariant, handle)));
  EXPECT_THROW(pinned_matmul_algo(0, 8, DType::BF16, handle), InputError);
  EXPECT_THROW(pinned_matmul_algo(8, 8, DType::F16, handle), InputError);
}

// ---- the cuBLAS handle ----------------------------------------------------------------------------------

TEST(Matmul06Gpu, TheHandleKeepsSplitKReductionsInFp32) {
  // The default math mode may add split-K partial sums in the output type (bf16); the project's handle
  // forbids it (common/cublas.h, README "v5"). Still so after a change of stream.
  TVLLM_REQUIRE_GPU();
  CudaStream stream;  // outlives the handle that runs on it
  CublasHandle handle;
  for (int step = 0; step < 2; ++step) {
    cublasMath_t mode{};
    TVLLM_CUBLAS_CHECK(cublasGetMathMode(handle.blas(), &mode));
    EXPECT_NE(static_cast<unsigned>(mode) & CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION, 0u) << "step " << step;
    EXPECT_EQ(static_cast<unsigned>(mode) & ~static_cast<unsigned>(CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION),
              static_cast<unsigned>(CUBLAS_DEFAULT_MATH))
        << "no other mode (TF32, pedantic) on top of the default";
    handle.set_stream(stream);
  }
}

TEST(Matmul06Gpu, CublasLtPlansOutliveTheHandleThatMadeThem) {
  // v6's plans are cached per (device, shape, dtype, alignment, workspace), not per handle: a plan made
  // through one handle serves another, and the same algorithm gives the same bits.
  TVLLM_REQUIRE_GPU();
  const Problem p(64, 512, 300, 431);
  std::vector<unsigned char> first;
  {
    CublasHandle handle;
    first = bytes_of(run(p, MatmulKernel::V6CublasLt, handle));
  }
  CublasHandle other;
  const Tensor again = run(p, MatmulKernel::V6CublasLt, other);
  EXPECT_EQ(bytes_of(again), first);
  const CompareResult r = compare_rows("y", again, p.expected, kBf16OutVsCpu);
  EXPECT_TRUE(r.pass()) << describe(r);
}

TEST(Matmul06Gpu, TensorCoresAgreeWithTheTiledKernel) {
  // Two independent implementations, each one bf16 rounding from the exact result: they may differ by
  // two roundings (2 * 2^-8 relative) and nothing more.
  TVLLM_REQUIRE_GPU();
  CublasHandle handle;
  const Problem p(128, 2048, 1000, 201);
  Tensor tiled = run(p, MatmulKernel::V2Tiled, handle);
  for (MatmulKernel k : {MatmulKernel::V3Wmma, MatmulKernel::V4MmaSync, MatmulKernel::V5Cublas,
                         MatmulKernel::V6CublasLt}) {
    SCOPED_TRACE(std::string(matmul_kernel_version(k)));
    const CompareResult r = compare_rows("y", run(p, k, handle), tiled, LinearTolerance{1.0 / 2048, 1.0 / 128});
    EXPECT_TRUE(r.pass()) << describe(r);
    EXPECT_LT(r.rel_l2, 2e-3);  // most elements agree exactly or by one bf16 step
  }
}

TEST(Matmul06Gpu, ZeroTokensLaunchesNothing) {
  TVLLM_REQUIRE_GPU();
  CublasHandle handle;
  Tensor x = Tensor::empty({0, 64}, DType::BF16, Device::CUDA);
  Tensor w = Tensor::from_f32(std::vector<float>(64 * 8, 1.f), {8, 64}, DType::BF16, Device::CUDA);
  Tensor y = Tensor::empty({0, 8}, DType::BF16, Device::CUDA);
  for (MatmulKernel k : all_matmul_kernels()) EXPECT_NO_THROW(linear(y, x, w, k, &handle));
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
}

TEST(Matmul06Gpu, RejectsWrongDtypesOnRealTensors) {
  TVLLM_REQUIRE_GPU();
  CublasHandle handle;
  Tensor x = Tensor::empty({4, 16}, DType::F32, Device::CUDA);
  Tensor w = Tensor::empty({8, 16}, DType::BF16, Device::CUDA);
  Tensor y = Tensor::empty({4, 8}, DType::BF16, Device::CUDA);
  for (MatmulKernel k : all_matmul_kernels()) EXPECT_THROW(linear(y, x, w, k, &handle), InputError);
}

TEST(Matmul06Gpu, FillUniformIsDeterministicAndInRange) {
  TVLLM_REQUIRE_GPU();
  Tensor a = Tensor::empty({100000}, DType::BF16, Device::CUDA);
  Tensor b = Tensor::empty({100000}, DType::BF16, Device::CUDA);
  CudaStream stream;
  fill_uniform_bf16(a, 5, -2.f, 2.f);
  fill_uniform_bf16(b, 5, -2.f, 2.f, stream);  // the same values, made on another stream
  stream.synchronize();
  const std::vector<float> va = to_f32_vector(a), vb = to_f32_vector(b);
  EXPECT_EQ(va, vb);
  double sum = 0.0;
  float lo = 10.f, hi = -10.f;
  for (float v : va) {
    sum += v;
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  EXPECT_GE(lo, -2.f);
  EXPECT_LE(hi, 2.f);  // bf16 rounding may reach the upper bound itself
  EXPECT_LT(lo, -1.9f);
  EXPECT_GT(hi, 1.9f);
  EXPECT_NEAR(sum / va.size(), 0.0, 0.02);
  fill_uniform_bf16(b, 6, -2.f, 2.f);
  EXPECT_NE(to_f32_vector(b), va);
}

}  // namespace
}  // namespace tvllm
