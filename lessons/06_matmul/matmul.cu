// Lesson 06 on the GPU: y = x W^T in four versions, from one thread per output to the tensor cores.
//
// Shapes throughout: x [T, in], w [out, in], y [T, out], all row-major. In GEMM letters:
// M = T (tokens), N = out, K = in. All four versions below read x and w along K, their contiguous
// dimension, which is why y = x W^T needs no transpose anywhere: both operands are "K-major".
#include <cublasLt.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <tuple>

#include "common/buffer.h"
#include "common/errors.h"
#include "matmul.h"

namespace tvllm {

namespace {

using bf16 = __nv_bfloat16;

// Writes one fp32 accumulator to the output: rounded to nearest-even bf16, or kept as fp32.
__device__ __forceinline__ void store_output(bf16* p, float v) { *p = __float2bfloat16(v); }
__device__ __forceinline__ void store_output(float* p, float v) { *p = v; }

// ---- v1: naive -----------------------------------------------------------------------------------
//
// One thread per output y[t][o]: a dot product of row t of x and row o of w, K multiply-adds.
// Threads along x of the block take neighbouring outputs o, threads along y take tokens t. A warp
// thus reads 32 different rows of w at the same column i (32 separate memory sectors per load) and
// one element of x (a broadcast). Every output re-reads its whole rows: 2*T*out*in element loads for
// 2*T*out*in flops, an arithmetic intensity of about 1 flop per 2 bytes, which no cache can rescue
// at prefill sizes.
constexpr int kNaiveBlockX = 32;  // outputs per block
constexpr int kNaiveBlockY = 8;   // tokens per block (per pass of the grid-stride loop)
constexpr int kMaxGridY = 65535;  // CUDA's limit on gridDim.y

template <typename OutT>
__global__ void linear_naive_kernel(OutT* __restrict__ y,         // [T, out]
                                    const bf16* __restrict__ x,   // [T, in]
                                    const bf16* __restrict__ w,   // [out, in]
                                    int tokens, int in, int out) {
  const int o = blockIdx.x * blockDim.x + threadIdx.x;
  if (o >= out) return;  // no __syncthreads below, so an early return is safe
  const bf16* w_row = w + static_cast<size_t>(o) * in;
  // gridDim.y is capped at 65535, so the grid strides over tokens when T is larger.
  for (int64_t t = blockIdx.y * blockDim.y + threadIdx.y; t < tokens; t += gridDim.y * blockDim.y) {
    const bf16* x_row = x + static_cast<size_t>(t) * in;
    float acc = 0.f;
    for (int i = 0; i < in; ++i) acc += __bfloat162float(x_row[i]) * __bfloat162float(w_row[i]);
    store_output(y + static_cast<size_t>(t) * out + o, acc);
  }
}

// ---- v2: shared-memory tiles and register blocking ------------------------------------------------
//
// A block computes a 64x64 tile of y: 64 tokens x 64 outputs. It walks K in slices of 32: the block
// copies the 64x32 slice of x and the 64x32 slice of w into shared memory once (each element read
// from global memory ONCE per tile instead of 64 times), then every thread reads what it needs from
// shared memory. Each of the 256 threads owns a 4x4 block of outputs, kept in registers: per K step it
// loads 4 values of x and 4 of w and does 16 multiply-adds, so shared-memory traffic is 8 loads per 16
// FMAs instead of 2 per 1.
//
//                 K slice k0..k0+32                      thread (ty, tx) owns rows ty, ty+16, ty+32,
//               +------------------+                     ty+48 and columns tx, tx+16, tx+32, tx+48
//   x tile      |  xs [64][32+1]   |  rows m0..m0+64     of the 64x64 tile (strided, so that the 16
//   (tokens)    +------------------+                     threads of a half-warp read 16 different
//   w tile      |  ws [64][32+1]   |  rows n0..n0+64     rows of ws: 16 different banks)
//   (outputs)   +------------------+
//
// The +1 column of padding shifts each row by one bank, so the 16 rows read together land in 16
// different banks (without it, all 64 rows start in bank 0: a 16-way conflict).
// Sizes that are not multiples of the tile: loads outside x or w fill zeros (they add nothing to the
// sums), and stores outside y are skipped.
constexpr int kTileM = 64;       // tokens per block tile
constexpr int kTileN = 64;       // outputs per block tile
constexpr int kTileK = 32;       // K slice staged per step
constexpr int kThreadsSide = 16; // 16 x 16 threads
constexpr int kTiledThreads = kThreadsSide * kThreadsSide;
constexpr int kRegM = kTileM / kThreadsSide;  // 4 rows of outputs per thread
constexpr int kRegN = kTileN / kThreadsSide;  // 4 columns of outputs per thread
constexpr int kLoadVec = 8;      // bf16 elements per 16-byte load
static_assert(kTileM * kTileK == kTiledThreads * kLoadVec, "each thread loads one 16-byte chunk of x per step");
static_assert(kTileN * kTileK == kTiledThreads * kLoadVec, "each thread loads one 16-byte chunk of w per step");

// Copies rows [row0, row0 + 64) x columns [k0, k0 + 32) of a row-major [rows, cols] bf16 matrix into
// tile (as fp32), zero-filling outside the matrix. Thread `tid` copies 8 consecutive elements: row
// tid / 4, columns (tid % 4) * 8 ... + 8. `vec_ok` says 16-byte loads are safe: cols % 8 == 0 and
// the base pointer is 16-byte aligned.
__device__ __forceinline__ void load_tile(float (*tile)[kTileK + 1], const bf16* __restrict__ src, int rows,
                                          int cols, int row0, int k0, bool vec_ok) {
  const int tid = threadIdx.y * kThreadsSide + threadIdx.x;
  const int r = tid / (kTileK / kLoadVec);
  const int c = (tid % (kTileK / kLoadVec)) * kLoadVec;
  const int g_row = row0 + r, g_col = k0 + c;
  float v[kLoadVec];
  if (vec_ok && g_row < rows && g_col + kLoadVec <= cols) {
    // One 16-byte load: 8 bf16 values.
    const uint4 raw = *reinterpret_cast<const uint4*>(src + static_cast<size_t>(g_row) * cols + g_col);
    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int j = 0; j < kLoadVec / 2; ++j) {
      const float2 f = __bfloat1622float2(pairs[j]);
      v[2 * j] = f.x;
      v[2 * j + 1] = f.y;
    }
  } else {
    // Edges (and unaligned or odd-K inputs): one guarded element at a time.
#pragma unroll
    for (int j = 0; j < kLoadVec; ++j) {
      const bool inside = g_row < rows && g_col + j < cols;
      v[j] = inside ? __bfloat162float(src[static_cast<size_t>(g_row) * cols + g_col + j]) : 0.f;
    }
  }
#pragma unroll
  for (int j = 0; j < kLoadVec; ++j) tile[r][c + j] = v[j];
}

template <typename OutT>
__global__ void __launch_bounds__(kTiledThreads)
    linear_tiled_kernel(OutT* __restrict__ y,        // [T, out]
                        const bf16* __restrict__ x,  // [T, in]
                        const bf16* __restrict__ w,  // [out, in]
                        int tokens, int in, int out, bool vec_x, bool vec_w) {
  __shared__ float xs[kTileM][kTileK + 1];  // [64 tokens][32 K + 1 pad]
  __shared__ float ws[kTileN][kTileK + 1];  // [64 outputs][32 K + 1 pad]
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int n0 = blockIdx.x * kTileN;
  const int m_tiles = (tokens - 1) / kTileM + 1;  // ceil(tokens / 64) without overflow (tokens >= 1)

  // gridDim.y is capped at 65535: a block strides over token tiles. The loop bound is the same for
  // every thread of the block, so the __syncthreads() inside are reached by all of them.
  for (int m_tile = blockIdx.y; m_tile < m_tiles; m_tile += gridDim.y) {
    const int m0 = m_tile * kTileM;
    float acc[kRegM][kRegN] = {};  // this thread's 4x4 outputs, in registers

    for (int k0 = 0; k0 < in; k0 += kTileK) {
      load_tile(xs, x, tokens, in, m0, k0, vec_x);
      load_tile(ws, w, out, in, n0, k0, vec_w);
      __syncthreads();  // the tiles are complete before anyone reads them

#pragma unroll
      for (int kk = 0; kk < kTileK; ++kk) {
        float a[kRegM], b[kRegN];
#pragma unroll
        for (int i = 0; i < kRegM; ++i) a[i] = xs[ty + i * kThreadsSide][kk];
#pragma unroll
        for (int j = 0; j < kRegN; ++j) b[j] = ws[tx + j * kThreadsSide][kk];
#pragma unroll
        for (int i = 0; i < kRegM; ++i)
#pragma unroll
          for (int j = 0; j < kRegN; ++j) acc[i][j] += a[i] * b[j];
      }
      __syncthreads();  // everyone is done reading before the next slice overwrites the tiles
    }

#pragma unroll
    for (int i = 0; i < kRegM; ++i) {
      const int t = m0 + ty + i * kThreadsSide;
      if (t >= tokens) continue;
#pragma unroll
      for (int j = 0; j < kRegN; ++j) {
        const int o = n0 + tx + j * kThreadsSide;
        if (o < out) store_output(y + static_cast<size_t>(t) * out + o, acc[i][j]);
      }
    }
  }
}

int ceil_div(int a, int b) { return (a - 1) / b + 1; }  // a >= 1; no overflow near INT_MAX

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The largest power of two (up to 256) that divides the address: what cuBLASLt may assume.
uint32_t pointer_alignment(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  uint32_t alignment = 256;
  while (alignment > 1 && a % alignment != 0) alignment /= 2;
  return alignment;
}

cudaDataType_t cuda_type(DType dtype) { return dtype == DType::F32 ? CUDA_R_32F : CUDA_R_16BF; }

template <typename OutT>
void launch_naive(OutT* y, const TensorView& x, const TensorView& w, cudaStream_t stream) {
  const int tokens = static_cast<int>(x.shape[0]), in = static_cast<int>(x.shape[1]);
  const int out = static_cast<int>(w.shape[0]);
  const dim3 block(kNaiveBlockX, kNaiveBlockY);
  const dim3 grid(ceil_div(out, kNaiveBlockX), std::min(ceil_div(tokens, kNaiveBlockY), kMaxGridY));
  linear_naive_kernel<<<grid, block, 0, stream>>>(y, x.ptr<const bf16>(), w.ptr<const bf16>(), tokens, in, out);
  TVLLM_CHECK_LAUNCH();
}

template <typename OutT>
void launch_tiled(OutT* y, const TensorView& x, const TensorView& w, cudaStream_t stream) {
  const int tokens = static_cast<int>(x.shape[0]), in = static_cast<int>(x.shape[1]);
  const int out = static_cast<int>(w.shape[0]);
  const bool vec_x = in % kLoadVec == 0 && aligned16(x.data);
  const bool vec_w = in % kLoadVec == 0 && aligned16(w.data);
  const dim3 block(kThreadsSide, kThreadsSide);
  const dim3 grid(ceil_div(out, kTileN), std::min(ceil_div(tokens, kTileM), kMaxGridY));
  linear_tiled_kernel<<<grid, block, 0, stream>>>(y, x.ptr<const bf16>(), w.ptr<const bf16>(), tokens, in, out,
                                                  vec_x, vec_w);
  TVLLM_CHECK_LAUNCH();
}

// ---- v3: cuBLAS, and the row-major trick -----------------------------------------------------------
//
// cuBLAS is column-major (Fortran's convention): it reads an r x c matrix with leading dimension ld as
// element (i, j) at i + j*ld. Our buffers are row-major. The same bytes read the other way are the
// transpose: a row-major [R, C] buffer IS a column-major [C, R] matrix with ld = C. So, in cuBLAS's
// eyes:
//     y (row-major [T, out])  is  Y' = y^T, column-major [out, T], ld = out
//     x (row-major [T, in])   is  X' = x^T, column-major [in, T],  ld = in
//     w (row-major [out, in]) is  W' = W^T, column-major [in, out], ld = in
// We want y = x W^T; transposing both sides, y^T = W x^T, i.e.
//     Y' = (W')^T * X'       (W' transposed: OP_T; X' as it is: OP_N)
// which is C = op(A) op(B) with A = w (OP_T, lda = in), B = x (OP_N, ldb = in), C = y (ldc = out),
// m = out, n = T, k = in. No data moves: the "transposes" are only how cuBLAS is told to read.
void gemm_cublas(const TensorView& y, const TensorView& x, const TensorView& w, cublasHandle_t handle) {
  const int tokens = static_cast<int>(x.shape[0]), in = static_cast<int>(x.shape[1]);
  const int out = static_cast<int>(w.shape[0]);
  const float alpha = 1.f, beta = 0.f;  // C = 1 * op(A) op(B) + 0 * C
  TVLLM_CUBLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N,
                                  /*m=*/out, /*n=*/tokens, /*k=*/in, &alpha,
                                  /*A=*/w.data, CUDA_R_16BF, /*lda=*/in,
                                  /*B=*/x.data, CUDA_R_16BF, /*ldb=*/in, &beta,
                                  /*C=*/y.data, cuda_type(y.dtype), /*ldc=*/out,
                                  CUBLAS_COMPUTE_32F,  // fp32 accumulation (bf16 tensor cores)
                                  CUBLAS_GEMM_DEFAULT));
}

// ---- v4: cuBLASLt ---------------------------------------------------------------------------------
//
// The same product through cuBLASLt, the library cublasGemmEx itself calls into. Here we do by hand
// what GemmEx does inside: describe the operation and the three layouts, ask the heuristic for the
// best algorithm given the shapes, the pointer alignments and the workspace we allow, and run it.
// The answer depends only on those, so we ask once per (shape, dtype, alignment) and cache the plan.

// RAII wrappers for the three cuBLASLt descriptor kinds.
struct LtMatmulDesc {
  cublasLtMatmulDesc_t desc = nullptr;
  LtMatmulDesc() { TVLLM_CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F)); }
  ~LtMatmulDesc() { if (desc) cublasLtMatmulDescDestroy(desc); }
  LtMatmulDesc(const LtMatmulDesc&) = delete;
  LtMatmulDesc& operator=(const LtMatmulDesc&) = delete;
};
struct LtLayout {
  cublasLtMatrixLayout_t layout = nullptr;
  LtLayout(cudaDataType_t type, uint64_t rows, uint64_t cols, int64_t ld) {
    TVLLM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&layout, type, rows, cols, ld));
  }
  ~LtLayout() { if (layout) cublasLtMatrixLayoutDestroy(layout); }
  LtLayout(const LtLayout&) = delete;
  LtLayout& operator=(const LtLayout&) = delete;
};
struct LtPreference {
  cublasLtMatmulPreference_t pref = nullptr;
  LtPreference() { TVLLM_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref)); }
  ~LtPreference() { if (pref) cublasLtMatmulPreferenceDestroy(pref); }
  LtPreference(const LtPreference&) = delete;
  LtPreference& operator=(const LtPreference&) = delete;
};

// Everything cuBLASLt needs for one (shape, dtype, alignment): descriptors and the chosen algorithm.
struct LtPlan {
  LtMatmulDesc op;
  LtLayout a, b, c;
  cublasLtMatmulAlgo_t algo{};
  LtPlan(int tokens, int in, int out, cudaDataType_t out_type)
      : a(CUDA_R_16BF, in, out, in),       // w as stored: column-major [in, out] (OP_T makes it [out, in])
        b(CUDA_R_16BF, in, tokens, in),    // x as stored: column-major [in, T]
        c(out_type, out, tokens, out) {}   // y: column-major [out, T]
};

// (T, in, out, output dtype, alignment of w, x, y)
using LtKey = std::tuple<int, int, int, int, uint32_t, uint32_t, uint32_t>;

}  // namespace

// ---- the handle ----------------------------------------------------------------------------------

struct CublasHandle::Impl {
  cublasHandle_t blas = nullptr;
  cublasLtHandle_t lt = nullptr;
  cudaStream_t stream = nullptr;  // the legacy default stream
  DeviceBuffer workspace;
  std::map<LtKey, std::unique_ptr<LtPlan>> plans;

  ~Impl() {
    if (blas) cublasDestroy(blas);
    if (lt) cublasLtDestroy(lt);
  }

  const LtPlan& plan_for(const TensorView& y, const TensorView& x, const TensorView& w) {
    const int tokens = static_cast<int>(x.shape[0]), in = static_cast<int>(x.shape[1]);
    const int out = static_cast<int>(w.shape[0]);
    const uint32_t align_w = pointer_alignment(w.data), align_x = pointer_alignment(x.data);
    const uint32_t align_y = pointer_alignment(y.data);
    const LtKey key{tokens, in, out, static_cast<int>(y.dtype), align_w, align_x, align_y};
    auto found = plans.find(key);
    if (found != plans.end()) return *found->second;
    if (plans.size() >= 4096) plans.clear();  // a serving loop sees many T: keep the cache bounded

    auto plan = std::make_unique<LtPlan>(tokens, in, out, cuda_type(y.dtype));
    const cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;  // the row-major trick, as in v3
    TVLLM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof op_t));
    TVLLM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof op_n));

    LtPreference pref;
    const uint64_t workspace_bytes = workspace.bytes();
    TVLLM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                            &workspace_bytes, sizeof workspace_bytes));
    // cuBLASLt assumes 256-byte aligned pointers unless told otherwise; a view that starts mid-buffer
    // (rows(), a slice) may be aligned to as little as 2 bytes, and an algorithm that needs more
    // would read garbage or fault. Say what the pointers really are.
    const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> alignments[] = {
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_w},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_x},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_y},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_y}};
    for (const auto& [attribute, value] : alignments)
      TVLLM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.pref, attribute, &value, sizeof value));
    // Split-K algorithms cut K into pieces and add the partial sums afterwards. "In place" and
    // "output type" reductions keep those partial sums in the OUTPUT type: bf16 here, one extra bf16
    // rounding per piece, which breaks our promise of fp32 accumulation. Allow only fp32 partial sums
    // (or, for an fp32 output, any scheme: they are all fp32 then).
    const uint32_t reductions =
        y.dtype == DType::F32 ? CUBLASLT_REDUCTION_SCHEME_MASK : CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    TVLLM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                                            &reductions, sizeof reductions));

    cublasLtMatmulHeuristicResult_t result{};
    int found_count = 0;
    TVLLM_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(lt, plan->op.desc, plan->a.layout, plan->b.layout,
                                                      plan->c.layout, plan->c.layout, pref.pref, 1, &result,
                                                      &found_count));
    if (found_count == 0 || result.state != CUBLAS_STATUS_SUCCESS)
      throw CudaError("cuBLASLt found no algorithm for y[" + std::to_string(tokens) + ", " + std::to_string(out) +
                      "] = x[" + std::to_string(tokens) + ", " + std::to_string(in) + "] W^T");
    plan->algo = result.algo;
    return *plans.emplace(key, std::move(plan)).first->second;
  }
};

CublasHandle::CublasHandle(size_t workspace_bytes) : impl_(std::make_unique<Impl>()) {
  TVLLM_CUBLAS_CHECK(cublasCreate(&impl_->blas));
  TVLLM_CUBLAS_CHECK(cublasLtCreate(&impl_->lt));
  if (workspace_bytes > 0) {
    impl_->workspace = DeviceBuffer(workspace_bytes);
    TVLLM_CUBLAS_CHECK(cublasSetWorkspace(impl_->blas, impl_->workspace.data(), workspace_bytes));
  }
  // CUBLAS_DEFAULT_MATH: with bf16 inputs and CUBLAS_COMPUTE_32F, cuBLAS uses the tensor cores and
  // accumulates in fp32; no reduced-precision mode needs to be allowed.
  TVLLM_CUBLAS_CHECK(cublasSetMathMode(impl_->blas, CUBLAS_DEFAULT_MATH));
}

CublasHandle::~CublasHandle() = default;
CublasHandle::CublasHandle(CublasHandle&&) noexcept = default;
CublasHandle& CublasHandle::operator=(CublasHandle&&) noexcept = default;

cublasHandle_t CublasHandle::blas() const { return impl_->blas; }
cudaStream_t CublasHandle::stream() const { return impl_->stream; }
size_t CublasHandle::workspace_bytes() const { return impl_->workspace.bytes(); }

void CublasHandle::set_stream(cudaStream_t stream) {
  TVLLM_CUBLAS_CHECK(cublasSetStream(impl_->blas, stream));
  // cublasSetStream resets the workspace to cuBLAS's own default: give it ours back.
  if (!impl_->workspace.empty())
    TVLLM_CUBLAS_CHECK(cublasSetWorkspace(impl_->blas, impl_->workspace.data(), impl_->workspace.bytes()));
  impl_->stream = stream;
}

namespace {

void gemm_cublaslt(const TensorView& y, const TensorView& x, const TensorView& w, CublasHandle::Impl& h) {
  const LtPlan& plan = h.plan_for(y, x, w);
  const float alpha = 1.f, beta = 0.f;
  TVLLM_CUBLAS_CHECK(cublasLtMatmul(h.lt, plan.op.desc, &alpha,
                                    /*A=*/w.data, plan.a.layout,
                                    /*B=*/x.data, plan.b.layout, &beta,
                                    /*C=*/y.data, plan.c.layout,
                                    /*D=*/y.data, plan.c.layout, &plan.algo,
                                    h.workspace.data(), h.workspace.bytes(), h.stream));
}

template <typename OutT>
void run_kernel(OutT* y_ptr, const TensorView& y, const TensorView& x, const TensorView& w, MatmulKernel kernel,
                CublasHandle* handle) {
  const cudaStream_t stream = handle ? handle->stream() : nullptr;
  switch (kernel) {
    case MatmulKernel::V1Naive: launch_naive(y_ptr, x, w, stream); break;
    case MatmulKernel::V2Tiled: launch_tiled(y_ptr, x, w, stream); break;
    case MatmulKernel::V3Cublas: gemm_cublas(y, x, w, handle->blas()); break;
    case MatmulKernel::V4CublasLt: gemm_cublaslt(y, x, w, handle->impl()); break;
  }
}

// ---- random fill for benchmarks ------------------------------------------------------------------

__global__ void fill_uniform_bf16_kernel(bf16* p, size_t n, uint64_t seed, float lo, float hi) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    // SplitMix64 of (seed, i): the same values for the same seed on every run and every GPU.
    uint64_t z = seed + (i + 1) * 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    const float u = static_cast<float>(z >> 40) * (1.0f / 16777216.0f);  // [0, 1), 24 bits
    p[i] = __float2bfloat16(lo + (hi - lo) * u);
  }
}

}  // namespace

void detail::linear_cuda(const TensorView& y, const TensorView& x, const TensorView& w, MatmulKernel kernel,
                         CublasHandle* handle) {
  if (y.dtype == DType::F32) {
    run_kernel(y.ptr<float>(), y, x, w, kernel, handle);
  } else {
    run_kernel(y.ptr<bf16>(), y, x, w, kernel, handle);
  }
}

void fill_uniform_bf16(const TensorView& t, uint64_t seed, float lo, float hi) {
  TVLLM_REQUIRE(t.device == Device::CUDA && t.dtype == DType::BF16 && t.is_contiguous(),
                "fill_uniform_bf16: needs a contiguous BF16 CUDA tensor, got " + t.describe());
  const size_t n = static_cast<size_t>(t.numel());
  if (n == 0) return;
  const unsigned blocks = static_cast<unsigned>(std::min<size_t>((n + 255) / 256, size_t{1} << 16));
  fill_uniform_bf16_kernel<<<blocks, 256>>>(t.ptr<bf16>(), n, seed, lo, hi);
  TVLLM_CHECK_LAUNCH();
}

}  // namespace tvllm
