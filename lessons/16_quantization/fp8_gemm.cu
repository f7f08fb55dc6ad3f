// Lesson 16: the prefill GEMM on FP8 tensor cores (fp8_gemm.h): the per-token activation quantizer, cuBLASLt's
// E4M3 x E4M3 product with its two ways of applying the scales, and the seam that puts it in lesson 08's forward.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>

#include "common/cublas.h"
#include "common/cuda_utils.cuh"
#include "common/errors.h"
#include "fp8_gemm.h"
#include "transformer.h"

namespace tvllm {

// ---- the activation quantizer ---------------------------------------------------------------------------

namespace {

constexpr int kQuantThreads = 256;

__device__ float block_max(float v) {
  __shared__ float warp_max[kQuantThreads / 32];
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = v;
  __syncthreads();
  v = warp_max[0];
  for (int w = 1; w < kQuantThreads / 32; ++w) v = fmaxf(v, warp_max[w]);
  return v;
}

__device__ uint8_t encode(float v, float s) {
  // IEEE division, as the CPU oracle divides; the hardware's round-to-nearest-even, saturating encoder.
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(__fdiv_rn(v, s), __NV_SATFINITE, __NV_E4M3));
}

// One block per token: the row's amax (a block reduction), then its codes. kVec = 8: 16-byte loads of 8 bf16,
// 8-byte stores of 8 codes (K % 8 == 0, aligned rows); kVec = 1: one element at a time. The row is read twice;
// the second read comes from L1/L2 (a row is at most a few tens of KB).
template <int kVec>
__global__ void quantize_rows_kernel(uint8_t* codes, float* scale, const __nv_bfloat16* x, int64_t x_stride,
                                     int64_t K) {
  const int64_t t = blockIdx.x;
  const __nv_bfloat16* row = x + t * x_stride;
  uint8_t* out = codes + t * K;
  float amax = 0.0f;
  for (int64_t k = static_cast<int64_t>(threadIdx.x) * kVec; k < K; k += kQuantThreads * kVec) {
    if constexpr (kVec == 8) {
      const uint4 raw = *reinterpret_cast<const uint4*>(row + k);
      const auto* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 f = __bfloat1622float2(h[j]);
        amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
      }
    } else {
      amax = fmaxf(amax, fabsf(__bfloat162float(row[k])));
    }
  }
  amax = block_max(amax);
  const float s = amax > 0.0f ? __fdiv_rn(amax, kE4m3Max) : 1.0f;  // an all-zero row: codes 0, scale 1
  if (threadIdx.x == 0) scale[t] = s;
  for (int64_t k = static_cast<int64_t>(threadIdx.x) * kVec; k < K; k += kQuantThreads * kVec) {
    if constexpr (kVec == 8) {
      const uint4 raw = *reinterpret_cast<const uint4*>(row + k);
      const auto* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
      uint2 packed;
      auto* bytes = reinterpret_cast<uint8_t*>(&packed);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 f = __bfloat1622float2(h[j]);
        bytes[2 * j] = encode(f.x, s);
        bytes[2 * j + 1] = encode(f.y, s);
      }
      *reinterpret_cast<uint2*>(out + k) = packed;
    } else {
      out[k] = encode(__bfloat162float(row[k]), s);
    }
  }
}

// y[t, n] = bf16(float(y[t, n]) * sx[t] * sw[n]) in place: the epilogue path's scales, after a GEMM of the bare
// codes. Two bf16 roundings instead of one (README 7.3 says what that costs).
__global__ void scale_rows_cols_kernel(__nv_bfloat16* y, const float* sx, const float* sw, bool per_channel,
                                       int64_t T, int64_t N) {
  const int64_t n_total = T * N;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n_total; i += stride) {
    const int64_t t = i / N, n = i % N;
    const float v = __fmul_rn(__fmul_rn(__bfloat162float(y[i]), sx[t]), sw[per_channel ? n : 0]);
    y[i] = __float2bfloat16_rn(v);
  }
}

}  // namespace

void quantize_activations_cuda(uint8_t* codes, float* scale, const void* x, int64_t x_row_stride, int64_t T,
                               int64_t K, cudaStream_t stream) {
  TVLLM_REQUIRE(T <= INT32_MAX, "quantize_activations: too many rows for one grid");
  const auto* xb = static_cast<const __nv_bfloat16*>(x);
  const bool vec = K % 8 == 0 && x_row_stride % 8 == 0 && pointer_alignment(x) >= 16 &&
                   pointer_alignment(codes) >= 8;
  if (vec)
    quantize_rows_kernel<8><<<static_cast<unsigned>(T), kQuantThreads, 0, stream>>>(codes, scale, xb, x_row_stride, K);
  else
    quantize_rows_kernel<1><<<static_cast<unsigned>(T), kQuantThreads, 0, stream>>>(codes, scale, xb, x_row_stride, K);
  TVLLM_CHECK_LAUNCH();
}

// ---- cuBLASLt plans -------------------------------------------------------------------------------------

namespace {

// CUDA 12.9 brought per-row / per-column scale vectors (CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F).
#if defined(CUBLAS_VERSION) && CUBLAS_VERSION >= 120900
constexpr bool kHeadersHaveScaleVectors = true;
#else
constexpr bool kHeadersHaveScaleVectors = false;
#endif

// The descriptors of one product shape and scale mode, and the heuristic's algorithm (valid = false: cuBLASLt
// returned none; the product is declined). The scale pointers change per call (per layer): set under `mutex`
// right before the matmul, so two streams sharing a plan never race on the descriptor.
struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool valid = false;
  std::mutex mutex;
  ~Plan() {
    if (desc) cublasLtMatmulDescDestroy(desc);
    for (cublasLtMatrixLayout_t l : {a, b, c})
      if (l) cublasLtMatrixLayoutDestroy(l);
  }
};

using PlanKey = std::tuple<int, int64_t, int64_t, int64_t, bool, bool, size_t>;  // device, T, N, K, vectors, fast, ws

std::mutex g_plans_mutex;
std::map<PlanKey, std::unique_ptr<Plan>> g_plans;

// Row-major y [T, N] = x [T, K] W^T [K, N] read column-major (lesson 06's trick): D [N, T] = op(A) B with
// A = W as stored (column-major [K, N], op T), B = x (column-major [K, T], op N). That is cuBLASLt's "TN", the
// one layout its FP8 kernels take. The outer-vector scales then are: A's per row of op(A) (N: the weight's
// channels), B's per column (T: the tokens).
std::unique_ptr<Plan> make_plan(cublasLtHandle_t lt, int64_t T, int64_t N, int64_t K, bool vectors, bool fast,
                                size_t workspace_bytes) {
  auto p = std::make_unique<Plan>();
  TVLLM_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
  TVLLM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof op_t));
  TVLLM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof op_n));
  const int8_t fast_accum = fast ? 1 : 0;
  TVLLM_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast_accum, sizeof fast_accum));
  if (vectors) {
#if defined(CUBLAS_VERSION) && CUBLAS_VERSION >= 120900
    const int32_t mode = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
    // An older library refuses the attribute: the plan is invalid, the caller falls back.
    if (cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode, sizeof mode) !=
            CUBLAS_STATUS_SUCCESS ||
        cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode, sizeof mode) !=
            CUBLAS_STATUS_SUCCESS)
      return p;
#else
    return p;
#endif
  }
  TVLLM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->a, CUDA_R_8F_E4M3, K, N, K));
  TVLLM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->b, CUDA_R_8F_E4M3, K, T, K));
  TVLLM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->c, CUDA_R_16BF, N, T, N));
  cublasLtMatmulPreference_t pref = nullptr;
  TVLLM_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t attr = cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes, sizeof workspace_bytes);
  const cublasStatus_t status =
      attr == CUBLAS_STATUS_SUCCESS
          ? cublasLtMatmulAlgoGetHeuristic(lt, p->desc, p->a, p->b, p->c, p->c, pref, 1, &result, &found)
          : attr;
  cublasLtMatmulPreferenceDestroy(pref);
  // NOT_SUPPORTED (or no result) is an answer, not an error: this library has no kernel for the mode.
  if (status == CUBLAS_STATUS_SUCCESS && found > 0 && result.state == CUBLAS_STATUS_SUCCESS) {
    p->algo = result.algo;
    p->valid = true;
  } else if (status != CUBLAS_STATUS_SUCCESS && status != CUBLAS_STATUS_NOT_SUPPORTED &&
             status != CUBLAS_STATUS_INVALID_VALUE) {
    TVLLM_CUBLAS_CHECK(status);
  }
  return p;
}

Plan* find_plan(cublasLtHandle_t lt, int64_t T, int64_t N, int64_t K, bool vectors, bool fast, size_t ws) {
  int device = 0;
  TVLLM_CUDA_CHECK(cudaGetDevice(&device));
  const PlanKey key{device, T, N, K, vectors, fast, ws};
  std::lock_guard<std::mutex> lock(g_plans_mutex);
  auto it = g_plans.find(key);
  if (it == g_plans.end()) it = g_plans.emplace(key, make_plan(lt, T, N, K, vectors, fast, ws)).first;
  return it->second->valid ? it->second.get() : nullptr;
}

void run_plan(Plan& p, const Fp8GemmContext& ctx, void* y, const void* xq, const float* sx, const void* wq,
              const float* sw, bool vectors) {
  const float alpha = 1.0f, beta = 0.0f;
  std::lock_guard<std::mutex> lock(p.mutex);
  if (vectors) {
    // A is the weight (its scale vector: one per output channel), B the activations (one per token).
    TVLLM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sw, sizeof sw));
    TVLLM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sx, sizeof sx));
  }
  TVLLM_CUBLAS_CHECK(cublasLtMatmul(static_cast<cublasLtHandle_t>(ctx.lt), p.desc, &alpha, wq, p.a, xq, p.b, &beta,
                                    y, p.c, y, p.c, &p.algo, ctx.workspace, ctx.workspace_bytes, ctx.stream));
}

// The path a product takes, decided before anything is queued (nullptr plan: declined).
struct Decision {
  Fp8GemmPath path = Fp8GemmPath::Dequantize;
  Plan* plan = nullptr;
};

Decision decide(Fp8GemmPath wanted, const Fp8GemmContext& ctx, int64_t T, int64_t N, int64_t K, bool per_channel) {
  auto* lt = static_cast<cublasLtHandle_t>(ctx.lt);
  if (lt == nullptr) return {};
  if ((wanted == Fp8GemmPath::Auto || wanted == Fp8GemmPath::ScaleVectors) && per_channel && kHeadersHaveScaleVectors)
    if (Plan* p = find_plan(lt, T, N, K, true, ctx.fast_accum, ctx.workspace_bytes)) return {Fp8GemmPath::ScaleVectors, p};
  if (wanted == Fp8GemmPath::Auto || wanted == Fp8GemmPath::Epilogue)
    if (Plan* p = find_plan(lt, T, N, K, false, ctx.fast_accum, ctx.workspace_bytes)) return {Fp8GemmPath::Epilogue, p};
  return {};
}

void execute(const Decision& d, const Fp8GemmContext& ctx, void* y, const void* xq, const float* sx, const void* wq,
             const float* sw, bool per_channel, int64_t T, int64_t N) {
  const bool vectors = d.path == Fp8GemmPath::ScaleVectors;
  run_plan(*d.plan, ctx, y, xq, sx, wq, sw, vectors);
  if (!vectors) {
    const int blocks = static_cast<int>(std::min<int64_t>(ceil_div(T * N, 256), 132 * 8));
    scale_rows_cols_kernel<<<blocks, 256, 0, ctx.stream>>>(static_cast<__nv_bfloat16*>(y), sx, sw, per_channel, T, N);
    TVLLM_CHECK_LAUNCH();
  }
}

void check_gemm(const TensorView& y, const TensorView& xq, const TensorView& sx, const TensorView& wq,
                const TensorView& sw) {
  TVLLM_REQUIRE(xq.rank() == 2 && xq.dtype == DType::F8_E4M3 && xq.is_contiguous() && xq.device == Device::CUDA,
                "fp8_gemm: xq must be a contiguous F8_E4M3 [T, K] on CUDA, got " + xq.describe());
  TVLLM_REQUIRE(wq.rank() == 2 && wq.dtype == DType::F8_E4M3 && wq.is_contiguous() && wq.device == Device::CUDA &&
                    wq.shape[1] == xq.shape[1],
                "fp8_gemm: wq must be a contiguous F8_E4M3 [N, " + std::to_string(xq.shape[1]) + "] on CUDA, got " +
                    wq.describe());
  const int64_t T = xq.shape[0], N = wq.shape[0];
  TVLLM_REQUIRE(y.dtype == DType::BF16 && y.is_contiguous() && y.shape == Shape({T, N}) && y.device == Device::CUDA,
                "fp8_gemm: y must be a contiguous BF16 [" + std::to_string(T) + ", " + std::to_string(N) +
                    "] on CUDA, got " + y.describe());
  TVLLM_REQUIRE(sx.dtype == DType::F32 && sx.numel() == T && sx.device == Device::CUDA,
                "fp8_gemm: sx must be F32 [T] on CUDA, got " + sx.describe());
  TVLLM_REQUIRE(sw.dtype == DType::F32 && (sw.numel() == N || sw.numel() == 1) && sw.device == Device::CUDA,
                "fp8_gemm: sw must be F32 [N] or [1] on CUDA, got " + sw.describe());
}

std::atomic<int64_t> g_count_vectors{0}, g_count_epilogue{0}, g_count_dequantize{0};
std::atomic<Fp8GemmPath> g_path{Fp8GemmPath::Dequantize};

void count(Fp8GemmPath path) {
  if (path == Fp8GemmPath::ScaleVectors) g_count_vectors.fetch_add(1, std::memory_order_relaxed);
  else if (path == Fp8GemmPath::Epilogue) g_count_epilogue.fetch_add(1, std::memory_order_relaxed);
  else g_count_dequantize.fetch_add(1, std::memory_order_relaxed);
}

// Lesson 08's seam (install_fp8_gemm): quantize x into the workspace, multiply, or decline before queueing anything.
bool engine_fp8_gemm(ExecContext& ctx, const TensorView& y, const TensorView& x, const TensorView& w,
                     const TensorView& scale) {
  const Fp8GemmPath wanted = g_path.load();
  Workspace& ws = ctx.workspace();
  const int64_t T = x.shape[0], K = x.shape[1], N = w.shape[0];
  const bool fits = ctx.cublas() != nullptr && ws.fp8_codes.data() != nullptr && x.dtype == DType::BF16 &&
                    x.strides[1] == 1 && y.dtype == DType::BF16 && y.is_contiguous() && w.is_contiguous() &&
                    T * K <= ws.fp8_codes.view().numel() && T <= ws.fp8_scales.view().numel() &&
                    (scale.numel() == N || scale.numel() == 1) &&
                    fp8_gemm_layout_problem(T, N, K, ws.fp8_codes.data(), w.data, y.data).empty();
  if (wanted == Fp8GemmPath::Dequantize || !fits) {
    count(Fp8GemmPath::Dequantize);
    return false;
  }
  const Fp8GemmContext gctx{ctx.cublas()->lt(), ctx.cublas()->workspace(), ctx.cublas()->workspace_bytes(),
                            ctx.stream(), false};
  const bool per_channel = scale.numel() == N;
  const Decision d = decide(wanted, gctx, T, N, K, per_channel);
  count(d.path);
  if (d.plan == nullptr) return false;
  const TensorView codes = TensorView::contiguous(ws.fp8_codes.data(), DType::F8_E4M3, Device::CUDA, {T, K});
  const TensorView sx = TensorView::contiguous(ws.fp8_scales.data(), DType::F32, Device::CUDA, {T});
  quantize_activations(codes, sx, x, ctx.stream());
  execute(d, gctx, y.data, codes.data, sx.ptr<const float>(), w.data, scale.ptr<const float>(), per_channel, T, N);
  return true;
}

}  // namespace

Fp8GemmPath fp8_gemm(const TensorView& y, const TensorView& xq, const TensorView& sx, const TensorView& wq,
                     const TensorView& sw, Fp8GemmPath path, const Fp8GemmContext& ctx) {
  check_gemm(y, xq, sx, wq, sw);
  TVLLM_REQUIRE(path != Fp8GemmPath::Dequantize, "fp8_gemm: Dequantize is the caller's own product");
  const int64_t T = xq.shape[0], N = wq.shape[0], K = xq.shape[1];
  if (!fp8_gemm_layout_problem(T, N, K, xq.data, wq.data, y.data).empty()) return Fp8GemmPath::Dequantize;
  const bool per_channel = sw.numel() == N;
  const Decision d = decide(path, ctx, T, N, K, per_channel);
  if (d.plan == nullptr) return Fp8GemmPath::Dequantize;
  execute(d, ctx, y.data, xq.data, sx.ptr<const float>(), wq.data, sw.ptr<const float>(), per_channel, T, N);
  return d.path;
}

bool fp8_scale_vectors_supported(int64_t T, int64_t N, int64_t K) {
  if (!kHeadersHaveScaleVectors) return false;
  static cublasLtHandle_t probe = [] {
    cublasLtHandle_t h = nullptr;
    TVLLM_CUBLAS_CHECK(cublasLtCreate(&h));
    return h;  // one per process, for the probe only (the heuristic query runs on the host)
  }();
  return find_plan(probe, T, N, K, true, false, CublasHandle::kDefaultWorkspaceBytes) != nullptr;
}

void install_fp8_tensor_core_gemm(Fp8GemmPath path) {
  g_path.store(path);
  install_fp8_gemm(engine_fp8_gemm, kFp8GemmMinTokens);  // Dequantize too: it declines, and counts
}

Fp8GemmPath installed_fp8_gemm_path() {
  return installed_fp8_gemm() == engine_fp8_gemm ? g_path.load() : Fp8GemmPath::Dequantize;
}

Fp8GemmCounts fp8_gemm_counts() {
  return {g_count_vectors.load(), g_count_epilogue.load(), g_count_dequantize.load()};
}

void reset_fp8_gemm_counts() {
  g_count_vectors.store(0);
  g_count_epilogue.store(0);
  g_count_dequantize.store(0);
}

}  // namespace tvllm
