// The front door, linear(): validate every argument, then dispatch on the device of the views.
// And the CPU reference: the fp32 oracle every GPU kernel is checked against.
#include <algorithm>
#include <atomic>
#include <climits>
#include <cstring>
#include <exception>
#include <thread>
#include <vector>

#include "common/errors.h"
#include "common/exercise.h"
#include "matmul.h"

namespace tvllm {

std::string_view matmul_kernel_version(MatmulKernel kernel) {
  switch (kernel) {
    case MatmulKernel::V1Naive: return "v1";
    case MatmulKernel::V2Tiled: return "v2";
    case MatmulKernel::V3Wmma: return "v3";
    case MatmulKernel::V4MmaSync: return "v4";
    case MatmulKernel::V5Cublas: return "v5";
    case MatmulKernel::V6CublasLt: return "v6";
    case MatmulKernel::V7BatchInvariant: return "v7";
    case MatmulKernel::V8PinnedLt: return "v8";
  }
  return "?";
}

std::string_view matmul_kernel_description(MatmulKernel kernel) {
  switch (kernel) {
    case MatmulKernel::V1Naive: return "naive";
    case MatmulKernel::V2Tiled: return "tiled";
    case MatmulKernel::V3Wmma: return "WMMA";
    case MatmulKernel::V4MmaSync: return "mma.sync";
    case MatmulKernel::V5Cublas: return "cuBLAS GemmEx";
    case MatmulKernel::V6CublasLt: return "cuBLASLt";
    case MatmulKernel::V7BatchInvariant: return "batch-invariant";
    case MatmulKernel::V8PinnedLt: return "batch-invariant cuBLASLt";
  }
  return "?";
}

bool matmul_kernel_needs_handle(MatmulKernel kernel) {
  return kernel == MatmulKernel::V5Cublas || kernel == MatmulKernel::V6CublasLt ||
         kernel == MatmulKernel::V7BatchInvariant || kernel == MatmulKernel::V8PinnedLt;
}

bool matmul_kernel_is_batch_invariant(MatmulKernel kernel) {
  return kernel == MatmulKernel::V4MmaSync || kernel == MatmulKernel::V7BatchInvariant ||
         kernel == MatmulKernel::V8PinnedLt;
}

const std::vector<MatmulKernel>& all_matmul_kernels() {
  static const std::vector<MatmulKernel> all = {MatmulKernel::V1Naive,   MatmulKernel::V2Tiled,
                                                MatmulKernel::V3Wmma,    MatmulKernel::V4MmaSync,
                                                MatmulKernel::V5Cublas,  MatmulKernel::V6CublasLt,
                                                MatmulKernel::V7BatchInvariant, MatmulKernel::V8PinnedLt};
  return all;
}

MatmulKernel parse_matmul_kernel(std::string_view version) {
  for (MatmulKernel k : all_matmul_kernels())
    if (matmul_kernel_version(k) == version) return k;
  throw InputError("unknown matmul kernel '" + std::string(version) + "' (expected v1, v2, v3, v4, v5, v6, v7 or v8)");
}

SplitK batch_invariant_split(int64_t in, int64_t out) {
  constexpr int64_t kTileN = 128;         // v4's block tile along out
  constexpr int64_t kSliceK = 32;         // v4's K slice: every piece but the last is a whole number of them
  constexpr int64_t kTargetBlocks = 264;  // ~2 blocks per SM on an H100/H200 (132 SMs) at T <= 128
  constexpr int64_t kMinSplitLen = 256;
  constexpr int64_t kMaxSplits = 16;
  TVLLM_REQUIRE(in >= 1 && out >= 1, "batch_invariant_split: in and out must be >= 1");
  const int64_t out_tiles = (out + kTileN - 1) / kTileN;
  const int64_t wanted = std::min((kTargetBlocks + out_tiles - 1) / out_tiles, in / kMinSplitLen);
  const int64_t splits = std::clamp<int64_t>(wanted, 1, kMaxSplits);
  SplitK s;
  s.split_len = ((in + splits - 1) / splits + kSliceK - 1) / kSliceK * kSliceK;
  s.splits = static_cast<int>((in + s.split_len - 1) / s.split_len);
  return s;
}

// ---- validation --------------------------------------------------------------------------------

namespace {

bool overlaps(const TensorView& a, const TensorView& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  auto a0 = reinterpret_cast<uintptr_t>(a.data), b0 = reinterpret_cast<uintptr_t>(b.data);
  return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

void validate(const TensorView& y, const TensorView& x, const TensorView& w, MatmulKernel kernel,
              const CublasHandle* handle) {
  TVLLM_REQUIRE(x.rank() == 2, "linear: x must be [tokens, in], got " + x.describe());
  TVLLM_REQUIRE(w.rank() == 2, "linear: w must be [out, in] (as Hugging Face stores it), got " + w.describe());
  TVLLM_REQUIRE(y.rank() == 2, "linear: y must be [tokens, out], got " + y.describe());
  const int64_t tokens = x.shape[0], in = x.shape[1], out = w.shape[0];
  TVLLM_REQUIRE(w.shape[1] == in, "linear: x " + x.describe() + " has " + std::to_string(in) +
                                      " input features but w " + w.describe() + " expects " +
                                      std::to_string(w.shape[1]));
  TVLLM_REQUIRE(y.shape[0] == tokens && y.shape[1] == out,
                "linear: y must be " + shape_str({tokens, out}) + " for x " + x.describe() + " and w " +
                    w.describe() + ", got " + y.describe());
  TVLLM_REQUIRE(in >= 1 && out >= 1, "linear: in and out features must be >= 1, got w " + w.describe());
  TVLLM_REQUIRE(x.device == w.device && y.device == w.device,
                "linear: x, w and y must be on one device, got x " + x.describe() + ", w " + w.describe() +
                    ", y " + y.describe());
  TVLLM_REQUIRE(x.is_contiguous() && w.is_contiguous() && y.is_contiguous(),
                "linear: x, w and y must be contiguous row-major views");
  TVLLM_REQUIRE((x.data || x.numel() == 0) && w.data && (y.data || y.numel() == 0),
                "linear: null data pointer");
  TVLLM_REQUIRE(!overlaps(y, x) && !overlaps(y, w), "linear: y must not overlap x or w (no in-place matmul)");

  if (y.device == Device::CPU) {
    TVLLM_REQUIRE(x.dtype == DType::F32 && y.dtype == DType::F32,
                  "linear on the CPU is the fp32 reference: x and y must be F32, got x " + x.describe() +
                      ", y " + y.describe());
    TVLLM_REQUIRE(w.dtype == DType::F32 || w.dtype == DType::BF16 || w.dtype == DType::F16,
                  "linear on the CPU: w must be F32, BF16 or F16, got " + w.describe());
    return;
  }
  TVLLM_REQUIRE(x.dtype == DType::BF16 && w.dtype == DType::BF16,
                "linear on CUDA: x and w must be BF16, got x " + x.describe() + ", w " + w.describe());
  TVLLM_REQUIRE(y.dtype == DType::BF16 || y.dtype == DType::F32,
                "linear on CUDA: y must be BF16 or F32, got " + y.describe());
  // cuBLAS takes int sizes and leading dimensions; our kernels use the same limits.
  TVLLM_REQUIRE(tokens <= INT_MAX && in <= INT_MAX && out <= INT_MAX,
                "linear on CUDA: dimensions must fit in 32-bit ints, got x " + x.describe() + ", w " +
                    w.describe());
  TVLLM_REQUIRE(handle != nullptr || !matmul_kernel_needs_handle(kernel),
                "linear: kernel " + std::string(matmul_kernel_version(kernel)) + " (" +
                    std::string(matmul_kernel_description(kernel)) + ") needs a CublasHandle");
}

}  // namespace

namespace {
std::atomic<LargeGemmFn> g_large_gemm{nullptr};
std::atomic<int64_t> g_large_gemm_min_tokens{0};
}  // namespace

void install_large_gemm(LargeGemmFn fn, int64_t min_tokens) {
  TVLLM_REQUIRE(min_tokens >= 1, "install_large_gemm: min_tokens must be >= 1, got " + std::to_string(min_tokens));
  g_large_gemm_min_tokens.store(min_tokens);
  g_large_gemm.store(fn);
}

LargeGemmFn installed_large_gemm() { return g_large_gemm.load(); }

int64_t installed_large_gemm_min_tokens() { return g_large_gemm_min_tokens.load(); }

void linear(const TensorView& y, const TensorView& x, const TensorView& w, MatmulKernel kernel,
            const CublasHandle* handle) {
  validate(y, x, w, kernel, handle);
  if (x.shape[0] == 0) return;  // no tokens: nothing to compute (and a zero-sized grid is an error)
  if (y.device == Device::CUDA && kernel == MatmulKernel::V5Cublas) {
    const LargeGemmFn fn = installed_large_gemm();
    if (fn != nullptr && x.shape[0] >= installed_large_gemm_min_tokens() && fn(y, x, w, handle->stream())) return;
  }
  if (y.device == Device::CPU) {
    detail::linear_cpu(y, x, w);
  } else {
    detail::linear_cuda(y, x, w, kernel, handle);
  }
}

// ---- the CPU reference ---------------------------------------------------------------------------
//
// y[t][o] = sum_i x[t][i] * w[o][i]
//
// Why double accumulation: x and w are fp32 (bf16 and fp16 widen to fp32 exactly), so each product
// x*w has at most 48 significant bits and is EXACT in double (53 bits). Summing K of them in double
// loses about K * 2^-53 relative: nothing, next to the single rounding to fp32 at the end (2^-24).
// The oracle is then as good as fp32 can hold, and any disagreement with Hugging Face's fp32 result
// is Hugging Face's own fp32 summation error (about sqrt(K) * 2^-24 of the terms' size).
//
// And because every output is the same sequence of operations whatever the blocking and threading,
// the result does not depend on T or on which rows are computed together (a test checks it).
//
// Speed: outputs are computed in 4x4 blocks (4 rows of x against 4 rows of w: 8 loads feed 16
// multiply-adds, 16 independent sums in flight), and the out dimension is split across threads.

namespace {

constexpr int64_t kBlock = 4;          // rows of x and of w per register block
constexpr int64_t kRowChunk = 64;      // rows of x kept hot in cache while the weights stream by
constexpr int64_t kMacsPerThread = int64_t{1} << 22;  // below ~4M multiply-adds one thread is enough

// Rows [o0, o0 + count) of w, widened to fp32 into dst [count, in].
void widen_weight_rows(float* dst, const TensorView& w, int64_t o0, int64_t count, int64_t in) {
  const size_t begin = static_cast<size_t>(o0 * in), n = static_cast<size_t>(count * in);
  switch (w.dtype) {
    case DType::F32:
      std::memcpy(dst, w.ptr<const float>() + begin, n * sizeof(float));
      break;
    case DType::BF16: {
      const uint16_t* src = w.ptr<const uint16_t>() + begin;
      for (size_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
      break;
    }
    case DType::F16: {
      const uint16_t* src = w.ptr<const uint16_t>() + begin;
      for (size_t i = 0; i < n; ++i) dst[i] = f16_to_f32(src[i]);
      break;
    }
    default:
      break;  // validate() admits no other dtype
  }
}

// y[t0..t0+R)[o0..o0+C) from x rows t0.. and the C widened weight rows in w_rows [C, in].
template <int R, int C>
void dot_block(float* y, const float* x, const float* w_rows, int64_t t0, int64_t o0, int64_t in, int64_t out) {
  // --- exercise 06.1: the fp32 reference ---------------------------------------------------------------
  // Task: the R x C outputs y[t0 + r][o0 + c] = sum over i < in of x[t0 + r][i] * w_rows[c][i], for
  //   r < R, c < C: x is [T, in] and y [T, out], row-major; w_rows holds C weight rows, already widened
  //   to fp32, one after the other ([C, in]). Sum in double and round each output once to fp32.
  // Hint: the product of two floats is exact in double (24 + 24 bits < 53): only the sum rounds, and
  //   in double that error is far below the GPU's.
  // Hint: keep the R x C sums in a local array and walk i once: each x[.][i] and w_rows[.][i] is then
  //   loaded once for R * C multiply-adds (the register block the GPU's v2 uses too).
  // Tests: Matmul06Cpu.KnownProductByHand Matmul06Cpu.WIsUsedAsStoredNotTransposed
  // Tests: Matmul06Cpu.IdentityWeightReturnsTheInput Matmul06Cpu.OneHotInputSelectsAColumnOfW
  // Tests: Matmul06Cpu.MatchesTheDefinitionOnOddShapes Matmul06Cpu.Bf16WeightsAreWidenedExactly
  // Tests: Matmul06Cpu.RowsDoNotDependOnTheBatch lesson06_matmul.cpu
  // Stub:
  //   (void)y, (void)x, (void)w_rows, (void)t0, (void)o0, (void)in, (void)out;
  //   throw NotWrittenYet("06.1", "the fp32 reference");
  // --- solution ---
  double acc[R][C] = {};
  const float* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = x + (t0 + r) * in;
  for (int64_t i = 0; i < in; ++i) {
    double xv[R], wv[C];
    for (int r = 0; r < R; ++r) xv[r] = xr[r][i];
    for (int c = 0; c < C; ++c) wv[c] = w_rows[c * in + i];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] += xv[r] * wv[c];  // the product is exact in double
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[(t0 + r) * out + o0 + c] = static_cast<float>(acc[r][c]);
  // --- end of exercise 06.1 ---
}

// All T rows against weight rows [o0, o0 + C).
template <int C>
void rows_against(float* y, const float* x, const float* w_rows, int64_t t_begin, int64_t t_end, int64_t o0,
                  int64_t in, int64_t out) {
  int64_t t = t_begin;
  for (; t + kBlock <= t_end; t += kBlock) dot_block<kBlock, C>(y, x, w_rows, t, o0, in, out);
  for (; t < t_end; ++t) dot_block<1, C>(y, x, w_rows, t, o0, in, out);
}

// Output columns [o_begin, o_end) for every row: one thread's share.
void linear_cpu_columns(const TensorView& y, const TensorView& x, const TensorView& w, int64_t o_begin,
                        int64_t o_end) {
  const int64_t tokens = x.shape[0], in = x.shape[1], out = w.shape[0];
  const float* xp = x.ptr<const float>();  // [T, in]
  float* yp = y.ptr<float>();              // [T, out]
  std::vector<float> w_rows(static_cast<size_t>(kBlock * in));  // [4, in] fp32 copy of 4 weight rows
  for (int64_t t0 = 0; t0 < tokens; t0 += kRowChunk) {
    const int64_t t1 = std::min(tokens, t0 + kRowChunk);
    int64_t o = o_begin;
    for (; o + kBlock <= o_end; o += kBlock) {
      widen_weight_rows(w_rows.data(), w, o, kBlock, in);
      rows_against<kBlock>(yp, xp, w_rows.data(), t0, t1, o, in, out);
    }
    for (; o < o_end; ++o) {
      widen_weight_rows(w_rows.data(), w, o, 1, in);
      rows_against<1>(yp, xp, w_rows.data(), t0, t1, o, in, out);
    }
  }
}

}  // namespace

void detail::linear_cpu(const TensorView& y, const TensorView& x, const TensorView& w) {
  const int64_t tokens = x.shape[0], in = x.shape[1], out = w.shape[0];
  const int64_t macs = tokens * in * out;
  const int64_t blocks = (out + kBlock - 1) / kBlock;
  const int64_t hw = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t threads = std::clamp<int64_t>(macs / kMacsPerThread, 1, std::min<int64_t>({hw, 64, blocks}));
  if (threads == 1) {
    linear_cpu_columns(y, x, w, 0, out);
    return;
  }
  // Thread j takes whole 4-column blocks [j*blocks/threads, (j+1)*blocks/threads): no two threads
  // write the same output, so no synchronisation is needed beyond join().
  // An exception in a worker is rethrown here after the join (escaping a std::thread it would abort the
  // program, e.g. a student workspace's "not written yet").
  std::vector<std::thread> pool;
  std::vector<std::exception_ptr> errors(static_cast<size_t>(threads));
  pool.reserve(static_cast<size_t>(threads));
  for (int64_t j = 0; j < threads; ++j) {
    const int64_t o_begin = std::min(out, j * blocks / threads * kBlock);
    const int64_t o_end = std::min(out, (j + 1) * blocks / threads * kBlock);
    pool.emplace_back([&y, &x, &w, &errors, j, o_begin, o_end] {
      try {
        linear_cpu_columns(y, x, w, o_begin, o_end);
      } catch (...) {
        errors[static_cast<size_t>(j)] = std::current_exception();
      }
    });
  }
  for (std::thread& t : pool) t.join();
  for (const std::exception_ptr& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

}  // namespace tvllm
