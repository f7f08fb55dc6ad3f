// Lesson 04, the GPU path: RMSNorm kernels from a textbook reduction to one that reads x exactly once.
//
// Every version gives one block to one row (a token's hidden vector) and does the same three things:
//   1. each thread squares and sums a few elements of the row            (fp32 accumulation)
//   2. the block adds the threads' partial sums into one total            (the reduction: the lesson)
//   3. each thread scales its elements by rsqrt(total / H + eps) and the weight
// They differ in step 2 and in how they touch memory:
//   v1  step 2 in shared memory, a tree of halving strides with __syncthreads() between levels
//   v2  step 2 with warp shuffles: 32 lanes add through registers, one shared slot per warp, one barrier
//   v3  v2's reduction; the row travels in 16-byte vectors and stays in registers between steps 1 and 3,
//       so x is read from memory once (v1 and v2 read it twice: the second read usually hits L2)
// Each kernel has a fused twin (kFused): residual += x first, then the norm of the updated residual.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "common/cuda_utils.cuh"  // warp_sum, block_sum, Pack, load_pack, store_pack
#include "common/errors.h"
#include "common/exercise.h"
#include "rmsnorm.h"

namespace tvllm {

namespace {

constexpr int kWarp = kWarpSize;  // 32
constexpr int kMaxBlock = 1024;        // CUDA's limit on threads per block
constexpr int kV1V2MaxThreads = 256;   // v1/v2: 8 warps per row, each thread loops over H / 256 elements
constexpr int kV3TargetThreads = 128;  // v3: give each thread more of the row before adding threads

struct RowArgs {
  __nv_bfloat16* out;           // [rows, H]   may be x itself
  const __nv_bfloat16* x;       // [rows, H]
  const __nv_bfloat16* weight;  // [H]
  __nv_bfloat16* residual;      // [rows, H]   fused kernels only, updated in place
  int64_t hidden;               // H
  float eps;
};

// ---- rounding, exactly as Hugging Face's LlamaRMSNorm does in bf16 -------------------------------------
//   hidden = x.float() * rsqrt(mean(x^2) + eps)      fp32
//   return weight * hidden.to(bfloat16)              round to bf16, multiply, round again
[[maybe_unused]] __device__ __forceinline__ float scaled(float v, float inv_rms, float w) {
  const float normed = __bfloat162float(__float2bfloat16_rn(v * inv_rms));  // the first rounding
  return normed * w;  // exact in fp32 (8-bit x 8-bit significands); the caller rounds it to bf16
}

// Pass 1 of the scalar kernels: element `offset` of the row as fp32. Fused: residual += x, rounded to bf16
// and stored, and the STORED value is what gets normalised (the unfused pair would read it back as bf16).
template <bool kFused>
__device__ __forceinline__ float load_input(const RowArgs& a, int64_t offset) {
  float v = __bfloat162float(a.x[offset]);
  if constexpr (kFused) {
    const __nv_bfloat16 sum = __float2bfloat16_rn(__bfloat162float(a.residual[offset]) + v);
    a.residual[offset] = sum;
    v = __bfloat162float(sum);
  }
  return v;
}

// Pass 2 of the scalar kernels: read the element again (the same thread wrote the residual in pass 1).
template <bool kFused>
__device__ __forceinline__ float reload_input(const RowArgs& a, int64_t offset) {
  return __bfloat162float(kFused ? a.residual[offset] : a.x[offset]);
}

// ---- v1: shared-memory tree reduction ----------------------------------------------------------------
// blockDim.x: a power of two in [32, kV1V2MaxThreads].
template <bool kFused>
__global__ void rmsnorm_v1_kernel(RowArgs a) {
  // --- exercise 04.2: v1, the shared-memory tree -------------------------------------------------------
  // Task: block blockIdx.x normalises row blockIdx.x (H = a.hidden elements from a.x + row * H; write
  //   a.out): each thread sums the squares of its strided elements (load_input), the block adds the
  //   partial sums with a tree in shared memory (partial[], halving strides), then every thread writes
  //   its elements scaled by inv_rms = rsqrtf(total / H + eps) and the weight (scaled(), rounded to bf16).
  // Hint: blockDim.x is a power of two in [32, 256]. Sequential addressing: at stride s, threads
  //   i < s add partial[i + s] into partial[i]; __syncthreads() after the slots are written and after
  //   every level, and never inside a branch some threads skip.
  // Hint: load_input<kFused> does the fused residual add for you; reload_input<kFused> reads the value
  //   again in the second pass.
  // Tests: RmsNorm04Gpu.V1MatchesTheReference
  // Needs: 04.1
  // Stub: device
  // --- solution ---
  __shared__ float partial[kV1V2MaxThreads];   // one slot per thread
  const int64_t base = blockIdx.x * a.hidden;  // this block's row
  float sum_sq = 0.f;
  for (int64_t h = threadIdx.x; h < a.hidden; h += blockDim.x) {
    const float v = load_input<kFused>(a, base + h);
    sum_sq += v * v;
  }
  partial[threadIdx.x] = sum_sq;
  __syncthreads();  // all slots written before anyone reads a neighbour's (README: "the race")
  // Sequential addressing: at each level threads 0..s-1 add slot i + s into slot i. The active threads are
  // contiguous, so whole warps retire together (no divergence inside a warp while s >= 32), and a warp
  // touches 32 consecutive floats: 32 different banks, no conflicts.
  for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
    __syncthreads();  // level k finished before level k + 1 reads its results
  }
  const float inv_rms = rsqrtf(partial[0] / static_cast<float>(a.hidden) + a.eps);
  for (int64_t h = threadIdx.x; h < a.hidden; h += blockDim.x) {
    const float v = reload_input<kFused>(a, base + h);
    a.out[base + h] = __float2bfloat16_rn(scaled(v, inv_rms, __bfloat162float(a.weight[h])));
  }
  // --- end of exercise 04.2 ---
}

// ---- v2: warp shuffles -------------------------------------------------------------------------------
// warp_sum (the butterfly: lane i adds lane i ^ m, 5 steps) and block_sum (one shared slot per warp, one
// barrier) are taught here and live in common/cuda_utils.cuh, where every later kernel finds them.

template <bool kFused>
__global__ void rmsnorm_v2_kernel(RowArgs a) {
  // --- exercise 04.3: v2, warp shuffles ----------------------------------------------------------------
  // Task: v1 with the reduction done by block_sum (common/cuda_utils.cuh): warp_sum adds the 32 lanes
  //   of a warp through registers, one shared slot per warp, one barrier. Same three steps, same
  //   rounding. v3 also runs this kernel when a row is too long to hold in registers.
  // Hint: every thread of the block must reach block_sum (no early return): it has a barrier inside.
  // Tests: RmsNorm04Gpu.V2MatchesTheReference
  // Needs: 04.1
  // Stub: device
  // --- solution ---
  __shared__ float warp_sums[kMaxBlock / kWarp];
  const int64_t base = blockIdx.x * a.hidden;
  float sum_sq = 0.f;
  for (int64_t h = threadIdx.x; h < a.hidden; h += blockDim.x) {
    const float v = load_input<kFused>(a, base + h);
    sum_sq += v * v;
  }
  // No early return above: every thread must reach the shuffles and the barrier in block_sum.
  const float inv_rms = rsqrtf(block_sum(sum_sq, warp_sums) / static_cast<float>(a.hidden) + a.eps);
  for (int64_t h = threadIdx.x; h < a.hidden; h += blockDim.x) {
    const float v = reload_input<kFused>(a, base + h);
    a.out[base + h] = __float2bfloat16_rn(scaled(v, inv_rms, __bfloat162float(a.weight[h])));
  }
  // --- end of exercise 04.3 ---
}

// ---- v3: 16-byte vectors, the row in registers ---------------------------------------------------------
// Pack<kVec> (kVec consecutive bf16 moved by ONE load or store instruction, kept as raw 32-bit words),
// load_pack / store_pack, and Pack::get / Pack::set (bf16 bits <-> fp32: widening is a shift) are taught
// here and live in common/cuda_utils.cuh.

// Thread i of the block holds vectors i, i + blockDim, ..., i + (kPerThread-1)*blockDim of the row: at each
// step the warp reads 32 consecutive vectors (512 contiguous bytes for kVec = 8), fully coalesced.
template <int kVec, int kPerThread, bool kFused>
__global__ void rmsnorm_v3_kernel(RowArgs a) {
  // --- exercise 04.4: v3, the row in registers ---------------------------------------------------------
  // Task: thread i holds vectors i, i + blockDim.x, ..., i + (kPerThread - 1) * blockDim.x of the row,
  //   each a Pack<kVec> of kVec bf16 moved by one load_pack/store_pack; the row has a.hidden / kVec
  //   vectors (zeros past the end). Load them all first; fused: residual += x, rounded to bf16, stored,
  //   and that stored value normalised. Then block_sum of the squares, then scale and store: x is read
  //   from memory once.
  // Hint: Pack::get(i) widens element i to fp32; Pack::set(i, v) rounds v to bf16. The weight is
  //   read with load_pack too (an L1/L2 hit).
  // Hint: out may be x: every load of x must happen before the barrier inside block_sum.
  // Tests: RmsNorm04Gpu.V3MatchesTheReference RmsNorm04Gpu.EveryV3ShapeMatchesTheReference
  // Tests: RmsNorm04Gpu.EveryKernelMatchesTheReference RmsNorm04Gpu.ManyRows RmsNorm04Gpu.InPlace
  // Tests: RmsNorm04Gpu.MisalignedViewsNarrowTheVectors RmsNorm04Gpu.ExtremeMagnitudes
  // Tests: RmsNorm04Gpu.AllOnesAndZerosExactly lesson04_rmsnorm.gpu
  // Needs: 04.1 04.2 04.3
  // Stub: device
  // --- solution ---
  __shared__ float warp_sums[kMaxBlock / kWarp];
  const int64_t base = blockIdx.x * a.hidden;
  const int vectors = static_cast<int>(a.hidden / kVec);  // the launcher made H % kVec == 0
  Pack<kVec> row[kPerThread];                             // this thread's slice of the row (registers)
  Pack<kVec> res[kFused ? kPerThread : 1];                // fused: the residual's slice
  // All loads first, so kPerThread (x2 when fused) independent 16-byte requests are in flight at once.
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const int v = threadIdx.x + k * blockDim.x;
    row[k] = Pack<kVec>{};  // zeros past the end: they add nothing to the sum of squares
    if (v < vectors) row[k] = load_pack<kVec>(a.x + base + static_cast<int64_t>(v) * kVec);
    if constexpr (kFused) {
      res[k] = Pack<kVec>{};
      if (v < vectors) res[k] = load_pack<kVec>(a.residual + base + static_cast<int64_t>(v) * kVec);
    }
  }
  if constexpr (kFused) {
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      const int v = threadIdx.x + k * blockDim.x;
      Pack<kVec> sum{};
#pragma unroll
      for (int i = 0; i < kVec; ++i) sum.set(i, res[k].get(i) + row[k].get(i));
      if (v < vectors) store_pack<kVec>(a.residual + base + static_cast<int64_t>(v) * kVec, sum);
      row[k] = sum;  // normalise the residual as stored (bf16)
    }
  }
  float sum_sq = 0.f;
#pragma unroll
  for (int k = 0; k < kPerThread; ++k)
#pragma unroll
    for (int i = 0; i < kVec; ++i) sum_sq += row[k].get(i) * row[k].get(i);
  const float inv_rms = rsqrtf(block_sum(sum_sq, warp_sums) / static_cast<float>(a.hidden) + a.eps);
  // Every load of x happened before the barrier inside block_sum, so writing out (which may be x) is safe.
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const int v = threadIdx.x + k * blockDim.x;
    if (v >= vectors) continue;
    const Pack<kVec> w = load_pack<kVec>(a.weight + static_cast<int64_t>(v) * kVec);  // [H]: an L1/L2 hit
    Pack<kVec> y{};
#pragma unroll
    for (int i = 0; i < kVec; ++i) y.set(i, scaled(row[k].get(i), inv_rms, w.get(i)));
    store_pack<kVec>(a.out + base + static_cast<int64_t>(v) * kVec, y);
  }
  // --- end of exercise 04.4 ---
}

// ---- launchers -----------------------------------------------------------------------------------------

int v1_threads(int64_t hidden) {  // the tree halves blockDim: a power of two
  int t = kWarp;
  while (t < hidden && t < kV1V2MaxThreads) t *= 2;
  return t;
}

int v2_threads(int64_t hidden) {  // whole warps
  return static_cast<int>(std::min<int64_t>((hidden + kWarp - 1) / kWarp * kWarp, kV1V2MaxThreads));
}

bool aligned(const void* p, int bytes) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// The widest vector (8, 4, 2 or 1 bf16) such that every row of every tensor starts on its boundary.
int vector_elems_for(const RowArgs& a) {
  for (int vec : {8, 4, 2}) {
    const int bytes = vec * 2;
    if (a.hidden % vec == 0 && aligned(a.out, bytes) && aligned(a.x, bytes) && aligned(a.weight, bytes) &&
        aligned(a.residual, bytes))
      return vec;
  }
  return 1;
}

template <int kVec, bool kFused>
void launch_v3_vec(const RowArgs& a, unsigned rows, const RmsNormV3Shape& shape, cudaStream_t stream) {
  switch (shape.vectors_per_thread) {
    case 1:
      rmsnorm_v3_kernel<kVec, 1, kFused><<<rows, shape.threads, 0, stream>>>(a);
      break;
    case 2:
      rmsnorm_v3_kernel<kVec, 2, kFused><<<rows, shape.threads, 0, stream>>>(a);
      break;
    case 4:
      rmsnorm_v3_kernel<kVec, 4, kFused><<<rows, shape.threads, 0, stream>>>(a);
      break;
    default:
      rmsnorm_v3_kernel<kVec, 8, kFused><<<rows, shape.threads, 0, stream>>>(a);
      break;
  }
  TVLLM_CHECK_LAUNCH();
}

template <bool kFused>
void launch_v3(const RowArgs& a, unsigned rows, const RmsNormV3Shape& shape, cudaStream_t stream) {
  switch (shape.vector_elems) {
    case 8:
      launch_v3_vec<8, kFused>(a, rows, shape, stream);
      break;
    case 4:
      launch_v3_vec<4, kFused>(a, rows, shape, stream);
      break;
    case 2:
      launch_v3_vec<2, kFused>(a, rows, shape, stream);
      break;
    default:
      launch_v3_vec<1, kFused>(a, rows, shape, stream);
      break;
  }
}

template <bool kFused>
void launch(const RowArgs& a, unsigned rows, RmsNormOptions options, cudaStream_t stream) {
  if (options.kernel == RmsNormKernel::V3) {
    const RmsNormV3Shape shape =
        rmsnorm_v3_shape(a.hidden, vector_elems_for(a), options.v3_vectors_per_thread);
    if (shape.fits) {
      launch_v3<kFused>(a, rows, shape, stream);
      return;
    }
    options.kernel = RmsNormKernel::V2;  // a row too long for registers: v2 loops over it instead
  }
  if (options.kernel == RmsNormKernel::V1) {
    rmsnorm_v1_kernel<kFused><<<rows, v1_threads(a.hidden), 0, stream>>>(a);
  } else {
    rmsnorm_v2_kernel<kFused><<<rows, v2_threads(a.hidden), 0, stream>>>(a);
  }
  TVLLM_CHECK_LAUNCH();
}

void run_gpu(const TensorView& out, const TensorView& x, const TensorView& weight, const TensorView* residual,
             const RmsNormShape& s, float eps, const RmsNormOptions& options, cudaStream_t stream) {
  const int vpt = options.v3_vectors_per_thread;
  TVLLM_REQUIRE(vpt == 0 || vpt == 1 || vpt == 2 || vpt == 4 || vpt == 8,
                "rmsnorm: v3_vectors_per_thread must be 0 (auto), 1, 2, 4 or 8, got " + std::to_string(vpt));
  TVLLM_REQUIRE(s.rows < (int64_t{1} << 31),
                "rmsnorm: too many rows for one launch: " + std::to_string(s.rows));
  if (s.rows == 0) return;  // a grid of zero blocks is a launch error
  const RowArgs a{out.ptr<__nv_bfloat16>(),
                  x.ptr<const __nv_bfloat16>(),
                  weight.ptr<const __nv_bfloat16>(),
                  residual ? residual->ptr<__nv_bfloat16>() : nullptr,
                  s.hidden,
                  eps};
  const unsigned rows = static_cast<unsigned>(s.rows);
  if (residual)
    launch<true>(a, rows, options, stream);
  else
    launch<false>(a, rows, options, stream);
}

}  // namespace

RmsNormV3Shape rmsnorm_v3_shape(int64_t hidden, int vector_elems, int vectors_per_thread_request) {
  TVLLM_REQUIRE(vector_elems == 1 || vector_elems == 2 || vector_elems == 4 || vector_elems == 8,
                "rmsnorm_v3_shape: vector_elems must be 1, 2, 4 or 8, got " + std::to_string(vector_elems));
  TVLLM_REQUIRE(vectors_per_thread_request == 0 || vectors_per_thread_request == 1 ||
                    vectors_per_thread_request == 2 || vectors_per_thread_request == 4 ||
                    vectors_per_thread_request == 8,
                "rmsnorm: v3_vectors_per_thread must be 0 (auto), 1, 2, 4 or 8, got " +
                    std::to_string(vectors_per_thread_request));
  RmsNormV3Shape shape;
  shape.vector_elems = vector_elems;
  const int64_t vectors = (hidden + vector_elems - 1) / vector_elems;
  auto threads_for = [&](int per_thread) {
    const int64_t needed = (vectors + per_thread - 1) / per_thread;
    return (needed + kWarp - 1) / kWarp * kWarp;  // whole warps
  };
  int per_thread = vectors_per_thread_request;
  if (per_thread == 0) {
    // The fewest vectors per thread that keep the block at <= 128 threads (H = 2048: 2 vectors of 8,
    // 128 threads); past that, 8 per thread and as many threads as it takes.
    per_thread = 8;
    for (int p : {1, 2, 4}) {
      if ((vectors + p - 1) / p <= kV3TargetThreads) {
        per_thread = p;
        break;
      }
    }
  }
  const int64_t threads = threads_for(per_thread);
  shape.vectors_per_thread = per_thread;
  shape.fits = threads <= kMaxBlock;
  shape.threads = static_cast<int>(std::min<int64_t>(threads, kMaxBlock));
  return shape;
}

void rmsnorm(const TensorView& out, const TensorView& x, const TensorView& weight, float eps,
             RmsNormOptions options, cudaStream_t stream) {
  if (x.device == Device::CPU) {
    rmsnorm_cpu(out, x, weight, eps);
    return;
  }
  const RmsNormShape s = check_rmsnorm_args(out, x, weight, nullptr, eps);
  run_gpu(out, x, weight, nullptr, s, eps, options, stream);
}

void add_rmsnorm(const TensorView& residual, const TensorView& x, const TensorView& weight,
                 const TensorView& out, float eps, RmsNormOptions options, cudaStream_t stream) {
  if (x.device == Device::CPU) {
    add_rmsnorm_cpu(residual, x, weight, out, eps);
    return;
  }
  const RmsNormShape s = check_rmsnorm_args(out, x, weight, &residual, eps);
  run_gpu(out, x, weight, &residual, s, eps, options, stream);
}

}  // namespace tvllm
