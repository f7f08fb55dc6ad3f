// Lesson 06 on the GPU: y = x W^T in seven versions, from one thread per output to the tensor cores, and
// one whose rows do not depend on the batch (v8, the same promise through cuBLASLt: matmul_pinned.cu).
//
// Shapes throughout: x [T, in], w [out, in], y [T, out], all row-major. In GEMM letters:
// M = T (tokens), N = out, K = in. All seven versions below read x and w along K, their contiguous
// dimension, which is why y = x W^T needs no transpose anywhere: both operands are "K-major".
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <mma.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <type_traits>

#include "common/cuda_utils.cuh"
#include "common/errors.h"
#include "common/exercise.h"
#include "common/mma.cuh"
#include "lt_plan.h"
#include "matmul.h"

namespace tvllm {

namespace {

using bf16 = __nv_bfloat16;
using lt::cuda_type;
using lt::LtPlan;
using lt::LtPreference;

// Writes one fp32 accumulator to the output: rounded to nearest-even bf16, or kept as fp32.
[[maybe_unused]] __device__ __forceinline__ void store_output(bf16* p, float v) { *p = __float2bfloat16(v); }
[[maybe_unused]] __device__ __forceinline__ void store_output(float* p, float v) { *p = v; }

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
  // --- exercise 06.2: v1, one thread per output --------------------------------------------------------
  // Task: thread (x, y) of the grid computes y[t][o] = sum over i of x[t][i] * w[o][i] (bf16 inputs
  //   widened to fp32, fp32 sum, store_output rounds), o = blockIdx.x * blockDim.x + threadIdx.x, for
  //   t = blockIdx.y * blockDim.y + threadIdx.y and then every gridDim.y * blockDim.y tokens further:
  //   gridDim.y is capped at 65535, so the grid strides over T.
  // Hint: threads with o >= out have nothing to do (there is no barrier here: they may return).
  // Hint: index rows with size_t: T * in passes 2^31 in MoreTokensThanOneGridHolds.
  // Tests: AllVersions/Matmul06Kernel.*/v1
  // Needs: 06.1
  // Stub: device
  // --- solution ---
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
  // --- end of exercise 06.2 ---
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
[[maybe_unused]] constexpr int kRegM = kTileM / kThreadsSide;  // 4 rows of outputs per thread
[[maybe_unused]] constexpr int kRegN = kTileN / kThreadsSide;  // 4 columns of outputs per thread
constexpr int kLoadVec = 8;      // bf16 elements per 16-byte load
static_assert(kTileM * kTileK == kTiledThreads * kLoadVec, "each thread loads one 16-byte chunk of x per step");
static_assert(kTileN * kTileK == kTiledThreads * kLoadVec, "each thread loads one 16-byte chunk of w per step");

// Copies rows [row0, row0 + 64) x columns [k0, k0 + 32) of a row-major [rows, cols] bf16 matrix into
// tile (as fp32), zero-filling outside the matrix. Thread `tid` copies 8 consecutive elements: row
// tid / 4, columns (tid % 4) * 8 ... + 8. `vec_ok` says 16-byte loads are safe: cols % 8 == 0 and
// the base pointer is 16-byte aligned.
[[maybe_unused]]
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
  // --- exercise 06.3: v2, shared-memory tiles and a register block -------------------------------------
  // Task: block (blockIdx.x, blockIdx.y) computes the 64 x 64 tile of y at outputs n0 = blockIdx.x * 64
  //   and tokens m0 = m_tile * 64 (m_tile from blockIdx.y, striding by gridDim.y). Per 32-wide slice of
  //   K: load_tile the x and w slices into shared memory (xs, ws: [64][32 + 1] floats), barrier, each of
  //   the 16 x 16 threads adds its 4 x 4 register block (rows ty + 16i, columns tx + 16j), barrier.
  //   Then store the outputs inside y.
  // Hint: the number of token tiles is the same for every thread of the block, so every thread
  //   reaches both __syncthreads() of every slice; load_tile fills zeros outside x and w.
  // Hint: per K step load 4 values of xs and 4 of ws into registers, then do the 16 multiply-adds.
  // Tests: AllVersions/Matmul06Kernel.*/v2
  // Needs: 06.1
  // Stub: device
  // --- solution ---
  __shared__ float xs[kTileM][kTileK + 1];  // [64 tokens][32 K + 1 pad]
  __shared__ float ws[kTileN][kTileK + 1];  // [64 outputs][32 K + 1 pad]
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int n0 = blockIdx.x * kTileN;
  // ceil(tokens / 64) in 32-bit arithmetic, without overflow (tokens >= 1); common's ceil_div is int64.
  const int m_tiles = (tokens - 1) / kTileM + 1;

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
  // --- end of exercise 06.3 ---
}

// ---- v3 and v4: the tensor cores -------------------------------------------------------------------
//
// v2 is stuck on the fp32 FMA units, which do one multiply-add per lane per instruction. A tensor core
// instruction is issued by a whole warp and multiplies whole tiles: mma.sync m16n8k16 does
// D[16x8] += A[16x16] * B[16x8] (bf16 in, fp32 accumulate), 2048 multiply-adds in one instruction.
// Both kernels below use the same block tiling, so that only the way the warps compute differs:
//
//   block tile: 128 tokens x 128 outputs, K walked in slices of 32; 8 warps, 2 (tokens) x 4 (outputs),
//   each owning a 64 x 32 piece of the tile:
//
//                  outputs n0 .. n0+128
//              ┌───────┬───────┬───────┬───────┐
//   tokens     │ warp0 │ warp1 │ warp2 │ warp3 │  64 rows   (warp_m = 0)
//   m0..m0+128 ├───────┼───────┼───────┼───────┤
//              │ warp4 │ warp5 │ warp6 │ warp7 │  64 rows   (warp_m = 1)
//              └───────┴───────┴───────┴───────┘
//                 32      32      32      32 columns each (warp_n = 0..3)
//
// Shared memory holds the two K slices as bf16 (not fp32 as in v2: the tensor cores read bf16), one
// row of 32 elements per token or output, padded to 40 elements (80 bytes): see "Why pad" below.
//
// B = W^T, and W is stored [out, in]: column o of B is row o of W, contiguous along K. The mma
// instruction's "col" B operand wants exactly that (B read down its columns), so W's tile is used as
// stored, no transpose, just as cuBLAS's "TN" layout in v5.
constexpr int kTcTileM = 128;  // tokens per block tile
constexpr int kTcTileN = 128;  // outputs per block tile
constexpr int kTcTileK = 32;   // K slice per step
constexpr int kTcWarpsM = 2, kTcWarpsN = 4;
constexpr int kTcThreads = kTcWarpsM * kTcWarpsN * kWarpSize;  // 256
[[maybe_unused]] constexpr int kTcWarpM = kTcTileM / kTcWarpsM;  // 64 token rows per warp
[[maybe_unused]] constexpr int kTcWarpN = kTcTileN / kTcWarpsN;  // 32 output columns per warp
// Why pad: ldmatrix (v4) reads 8 rows of 16 bytes at a time, and shared memory serves 128 bytes (32
// banks of 4 bytes) per cycle. With 64-byte rows, rows r and r + 2 start in the same bank: 8 rows land
// on 2 distinct 16-byte bank groups, a 4-way conflict. With 80-byte rows the 8 rows start at byte
// 0, 80, 160, ... = 0, 80, 32, 112, 64, 16, 96, 48 modulo 128: all different, no conflict.
constexpr int kTcStride = kTcTileK + 8;  // 40 bf16 = 80 bytes per shared-memory row
constexpr int kTcChunksPerRow = kTcTileK / kLoadVec;  // 4 chunks of 16 bytes per row of a K slice
static_assert(kTcTileM * kTcChunksPerRow % kTcThreads == 0, "every thread copies the same number of chunks");
static_assert(kTcStride * 2 % 16 == 0, "ldmatrix and cp.async need 16-byte aligned rows");

// How a K slice gets from global to shared memory.
enum class TileCopy {
  kElement,  // one guarded bf16 at a time: any `in`, any pointer alignment (the slow, general path)
  kVector,   // 16-byte loads through registers, then 16-byte stores (v3)
  kAsync,    // cp.async, 16 bytes global -> shared without registers, overlapped with the math (v4)
};
// kVector and kAsync need in % 8 == 0 (each 16-byte chunk is inside a row or entirely outside) and
// 16-byte aligned x and w; the launchers pick kElement otherwise.

// Copies rows [row0, row0 + 128) x columns [k0, k0 + 32) of a row-major [rows, cols] bf16 matrix whose
// rows are ld elements apart (ld == cols for a whole matrix; more for a slice of K, v7) into a padded
// shared tile [128][40]; what lies outside the matrix becomes zero (it adds nothing to the sums). Thread
// t copies chunks t and t + 256 (a chunk = 8 bf16 = 16 bytes): row chunk / 4, columns (chunk % 4) * 8
// ... + 8, so a warp reads 8 rows x 64 contiguous bytes.
template <TileCopy kCopy>
__device__ __forceinline__ void load_tc_tile(bf16* tile, const bf16* __restrict__ src, int rows, int cols,
                                             int ld, int row0, int k0) {
  constexpr int kChunksPerThread = kTcTileM * kTcChunksPerRow / kTcThreads;  // 2
#pragma unroll
  for (int i = 0; i < kChunksPerThread; ++i) {
    const int chunk = threadIdx.x + i * kTcThreads;
    const int r = chunk / kTcChunksPerRow, c = (chunk % kTcChunksPerRow) * kLoadVec;
    const int g_row = row0 + r, g_col = k0 + c;
    bf16* dst = tile + r * kTcStride + c;
    const bf16* from = src + static_cast<size_t>(g_row) * ld + g_col;
    if constexpr (kCopy == TileCopy::kAsync) {
      const bool valid = g_row < rows && g_col < cols;  // cols % 8 == 0: the whole chunk is in or out
      cp_async_16(dst, valid ? from : src, valid);      // invalid: reads nothing, writes 16 zero bytes
    } else if constexpr (kCopy == TileCopy::kVector) {
      const bool valid = g_row < rows && g_col < cols;
      *reinterpret_cast<uint4*>(dst) = valid ? *reinterpret_cast<const uint4*>(from) : make_uint4(0, 0, 0, 0);
    } else {
#pragma unroll
      for (int j = 0; j < kLoadVec; ++j)
        dst[j] = g_row < rows && g_col + j < cols ? from[j] : __float2bfloat16(0.f);
    }
  }
}

// ---- v3: WMMA -----------------------------------------------------------------------------------
//
// nvcuda::wmma is CUDA C++'s portable door to the tensor cores. A fragment is a 16x16 tile spread over
// the registers of the warp's 32 lanes in an order the compiler knows and we do not (it is opaque):
// load_matrix_sync fills one from memory, mma_sync multiplies, store_matrix_sync writes one back.
// Per 16-wide step of K, warp (warp_m, warp_n) loads 4 A fragments (its 64 token rows) and 2 B
// fragments (its 32 output columns) from shared memory and does 4 x 2 fragment products into 8
// accumulator fragments (64 x 32 fp32 values, 64 per thread).
//
// The loads are plain and synchronous (copy the slice, __syncthreads, compute, __syncthreads): while a
// warp waits for global memory, its tensor cores idle unless another block on the SM has work. v4
// fixes that. The accumulators' layout is opaque too, so the edge of the output goes through shared
// memory: each 16x16 accumulator is stored to a per-warp staging tile, and the 32 lanes copy its 256
// values out, skipping those outside y.
template <typename OutT, TileCopy kCopy>
__global__ void __launch_bounds__(kTcThreads)
    linear_wmma_kernel(OutT* __restrict__ y,        // [T, out]
                       const bf16* __restrict__ x,  // [T, in]
                       const bf16* __restrict__ w,  // [out, in]
                       int tokens, int in, int out) {
#ifdef TVLLM_MMA_PTX
  // --- exercise 06.4: v3, the tensor cores through WMMA ------------------------------------------------
  // Task: the 128 x 128 tile of y at n0 = blockIdx.x * 128 and token tiles from blockIdx.y (striding
  //   by gridDim.y), 8 warps as 2 x 4, each warp 64 tokens x 32 outputs = 4 x 2 accumulator fragments
  //   (16 x 16 x 16, bf16 in, fp32 accumulate). Per 32-wide slice of K: load_tc_tile<kCopy> both slices
  //   into shared memory (bf16, rows of kTcStride), barrier, two 16-wide steps of load_matrix_sync and
  //   mma_sync, barrier. Epilogue: store_matrix_sync each accumulator to the warp's staging tile and
  //   let the 32 lanes copy the values that fall inside y out with store_output.
  // Hint: x's tile is row-major A (row_major, leading dimension kTcStride); W's tile is B = W^T,
  //   which is W row-major read as col_major with the same leading dimension.
  // Hint: __syncwarp() between storing to the staging tile and reading it back.
  // Tests: AllVersions/Matmul06Kernel.*/v3 TensorCores/Matmul06TensorCore.*/v3
  // Needs: 06.1
  // Stub: device
  // --- solution ---
  namespace wmma = nvcuda::wmma;
  constexpr int kFrag = 16;                          // WMMA's bf16 shape: 16 x 16 x 16
  constexpr int kFragsM = kTcWarpM / kFrag;          // 4 A fragments per warp
  constexpr int kFragsN = kTcWarpN / kFrag;          // 2 B fragments per warp
  __shared__ __align__(128) bf16 xs[kTcTileM * kTcStride];            // [128 tokens][32 K + 8 pad]
  __shared__ __align__(128) bf16 ws[kTcTileN * kTcStride];            // [128 outputs][32 K + 8 pad]
  __shared__ __align__(128) float staging[kTcThreads / kWarpSize][kFrag * kFrag];  // one 16x16 per warp
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int warp_m = warp / kTcWarpsN, warp_n = warp % kTcWarpsN;
  const int n0 = blockIdx.x * kTcTileN;
  const int m_tiles = (tokens - 1) / kTcTileM + 1;

  // gridDim.y is capped at 65535: a block strides over token tiles (a block-uniform loop: every
  // thread reaches the same __syncthreads()).
  for (int m_tile = blockIdx.y; m_tile < m_tiles; m_tile += gridDim.y) {
    const int m0 = m_tile * kTcTileM;
    wmma::fragment<wmma::accumulator, kFrag, kFrag, kFrag, float> acc[kFragsM][kFragsN];
#pragma unroll
    for (int i = 0; i < kFragsM; ++i)
#pragma unroll
      for (int j = 0; j < kFragsN; ++j) wmma::fill_fragment(acc[i][j], 0.f);

    for (int k0 = 0; k0 < in; k0 += kTcTileK) {
      load_tc_tile<kCopy>(xs, x, tokens, in, in, m0, k0);
      load_tc_tile<kCopy>(ws, w, out, in, in, n0, k0);
      __syncthreads();  // the slices are complete before anyone reads them
#pragma unroll
      for (int kk = 0; kk < kTcTileK; kk += kFrag) {
        // A = x, row-major: element (m, k) at xs[m * 40 + k]. B = W^T, K x N, "col-major": element
        // (k, n) at ws[n * 40 + k], i.e. W's tile as stored. The leading dimension is the padded row.
        wmma::fragment<wmma::matrix_a, kFrag, kFrag, kFrag, bf16, wmma::row_major> a[kFragsM];
        wmma::fragment<wmma::matrix_b, kFrag, kFrag, kFrag, bf16, wmma::col_major> b[kFragsN];
#pragma unroll
        for (int i = 0; i < kFragsM; ++i)
          wmma::load_matrix_sync(a[i], xs + (warp_m * kTcWarpM + i * kFrag) * kTcStride + kk, kTcStride);
#pragma unroll
        for (int j = 0; j < kFragsN; ++j)
          wmma::load_matrix_sync(b[j], ws + (warp_n * kTcWarpN + j * kFrag) * kTcStride + kk, kTcStride);
#pragma unroll
        for (int i = 0; i < kFragsM; ++i)
#pragma unroll
          for (int j = 0; j < kFragsN; ++j) wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
      }
      __syncthreads();  // everyone is done reading before the next slice overwrites the tiles
    }

    // The epilogue: through the warp's staging tile, guarded, rounded to the output type.
    float* stage = staging[warp];
#pragma unroll
    for (int i = 0; i < kFragsM; ++i) {
#pragma unroll
      for (int j = 0; j < kFragsN; ++j) {
        wmma::store_matrix_sync(stage, acc[i][j], kFrag, wmma::mem_row_major);
        __syncwarp();  // the whole fragment is in shared memory before the lanes read it
        for (int e = lane; e < kFrag * kFrag; e += kWarpSize) {
          const int t = m0 + warp_m * kTcWarpM + i * kFrag + e / kFrag;
          const int o = n0 + warp_n * kTcWarpN + j * kFrag + e % kFrag;
          if (t < tokens && o < out) store_output(y + static_cast<size_t>(t) * out + o, stage[e]);
        }
        __syncwarp();  // read before the next fragment overwrites the staging tile
      }
    }
  }
  // --- end of exercise 06.4 ---
#else
  __trap();  // bf16 WMMA needs sm_80 or later; the launcher checks the device first
#endif
}

// ---- v4: mma.sync, ldmatrix, cp.async ------------------------------------------------------------
//
// The same tiling, with the instructions WMMA hides made explicit (common/mma.cuh wraps each one):
//
// 1. mma.sync.m16n8k16: a warp tile of 64 x 32 is 4 x 4 mma tiles of 16 x 8; per 16-wide step of K,
//    16 mma instructions. Every register's meaning is documented (README "The fragment layouts"):
//    with g = lane / 4 and c = lane % 4, lane holds A rows g and g + 8, B column g, and accumulator
//    rows g and g + 8 at columns 2c, 2c + 1. So the epilogue needs no staging: each lane knows which
//    outputs its 4 x 4 x 4 = 64 accumulators are.
// 2. ldmatrix.x4: one instruction loads four 8x8 bf16 matrices from shared memory straight into that
//    fragment layout. Lanes 8m .. 8m + 7 supply the row addresses of matrix m. For A (16 x 16 at rows
//    r0, K offset kk) the four matrices are (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15),
//    (rows 8-15, k 8-15) = a[0..3], so lane L points at row r0 + L % 16, column kk + (L / 16) * 8.
//    For B, one ldmatrix.x4 covers two 8-column mma tiles: (n 0-7, k 0-7), (n 0-7, k 8-15) = b0, b1
//    of the first, (n 8-15, k 0-7), (n 8-15, k 8-15) = b0, b1 of the second: lane L points at W's
//    row n0 + L % 8 + (L / 16) * 8, column kk + ((L / 8) % 2) * 8.
// 3. cp.async double buffering: two copies of each shared tile (stages). While the warps multiply
//    slice k from one stage, the copies of slice k + 1 into the other stage are in flight: the
//    memory latency hides behind the math instead of adding to it.
//
// The block's work is a device function so that v7 (below) can run it on a slice of K: x and w are
// [tokens, in] and [out, in] matrices whose rows are ld elements apart (ld == in for v4).
template <typename OutT, TileCopy kCopy>
__device__ __forceinline__ void linear_mma_tiles(OutT* __restrict__ y,        // [T, out]
                                                 const bf16* __restrict__ x,  // [T, in], row stride ld
                                                 const bf16* __restrict__ w,  // [out, in], row stride ld
                                                 int tokens, int in, int ld, int out) {
  // --- exercise 06.5: v4, mma.sync, ldmatrix and cp.async ----------------------------------------------
  // Task: v3's tiling with the instructions made explicit (common/mma.cuh): per warp 4 x 4 mma tiles
  //   of 16 x 8 (m16n8k16), A and B fragments loaded with ldmatrix.x4 from shared memory, and two
  //   shared stages filled with cp.async so that slice k + 1 loads while slice k multiplies. The
  //   epilogue needs no staging: lane (g = lane / 4, c = lane % 4) holds accumulator rows g and g + 8
  //   at columns 2c and 2c + 1 of each mma tile; store those inside y with store_output.
  // Hint: the comment above gives each lane's ldmatrix row address for A and for B; load_tc_tile
  //   takes the row stride ld apart from the K extent in.
  // Hint: wait for the stage you are about to read (cp.async wait + __syncthreads) and issue the next
  //   stage's copies only after every warp is done reading the buffer they overwrite.
  // Tests: AllVersions/Matmul06Kernel.*/v4 TensorCores/Matmul06TensorCore.*/v4
  // Tests: AllVersions/Matmul06Kernel.*/v7 AllVersions/Matmul06Kernel.*/v8 Matmul06Gpu.PinnedLt*
  // Tests: Matmul06Gpu.TensorCoresAgreeWithTheTiledKernel Matmul06Gpu.BatchInvariant* lesson06_matmul.gpu
  // Needs: 06.1 06.3
  // Stub: device
  // --- solution ---
  constexpr int kStages = 2;
  constexpr int kMmaM = 16, kMmaN = 8, kMmaK = 16;
  constexpr int kTilesM = kTcWarpM / kMmaM;  // 4 mma tiles down a warp's 64 rows
  constexpr int kTilesN = kTcWarpN / kMmaN;  // 4 mma tiles across its 32 columns
  __shared__ __align__(128) bf16 xs[kStages][kTcTileM * kTcStride];  // 2 x [128 tokens][40]: 20 KiB
  __shared__ __align__(128) bf16 ws[kStages][kTcTileN * kTcStride];  // 2 x [128 outputs][40]: 20 KiB
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int warp_m = warp / kTcWarpsN, warp_n = warp % kTcWarpsN;
  const int g = lane / 4, c = lane % 4;  // the fragment coordinates (see mma_bf16_16x8x16)
  const int n0 = blockIdx.x * kTcTileN;
  const int m_tiles = (tokens - 1) / kTcTileM + 1;
  const int k_tiles = (in - 1) / kTcTileK + 1;

  for (int m_tile = blockIdx.y; m_tile < m_tiles; m_tile += gridDim.y) {  // block-uniform
    const int m0 = m_tile * kTcTileM;
    float acc[kTilesM][kTilesN][4] = {};  // 64 fp32 accumulators per thread

    // Prologue: start the copies of slice 0 into stage 0.
    load_tc_tile<kCopy>(xs[0], x, tokens, in, ld, m0, 0);
    load_tc_tile<kCopy>(ws[0], w, out, in, ld, n0, 0);
    cp_async_commit();

    for (int kt = 0; kt < k_tiles; ++kt) {
      const int stage = kt % kStages;
      // Start the copies of the NEXT slice into the other stage (its readers finished at the
      // __syncthreads() that ended the previous iteration), then wait for THIS slice only.
      if (kt + 1 < k_tiles) {
        load_tc_tile<kCopy>(xs[1 - stage], x, tokens, in, ld, m0, (kt + 1) * kTcTileK);
        load_tc_tile<kCopy>(ws[1 - stage], w, out, in, ld, n0, (kt + 1) * kTcTileK);
      }
      cp_async_commit();     // one group per slice (empty at the end: keeps the count below right)
      cp_async_wait<1>();    // all but the newest group have landed: this thread's part of slice kt
      __syncthreads();       // ... and every other thread's part

      const bf16* xt = xs[stage];
      const bf16* wt = ws[stage];
#pragma unroll
      for (int kk = 0; kk < kTcTileK; kk += kMmaK) {
        uint32_t a[kTilesM][4];     // A fragments: 4 tiles of 16 rows x 16 k
        uint32_t b[kTilesN][2];     // B fragments: 4 tiles of 16 k x 8 columns
#pragma unroll
        for (int i = 0; i < kTilesM; ++i)
          ldmatrix_x4(a[i], xt + (warp_m * kTcWarpM + i * kMmaM + lane % 16) * kTcStride + kk + (lane / 16) * 8);
#pragma unroll
        for (int j = 0; j < kTilesN; j += 2) {
          uint32_t r[4];
          ldmatrix_x4(r, wt + (warp_n * kTcWarpN + j * kMmaN + lane % 8 + (lane / 16) * 8) * kTcStride + kk +
                             ((lane / 8) % 2) * 8);
          b[j][0] = r[0], b[j][1] = r[1], b[j + 1][0] = r[2], b[j + 1][1] = r[3];
        }
#pragma unroll
        for (int i = 0; i < kTilesM; ++i)
#pragma unroll
          for (int j = 0; j < kTilesN; ++j) mma_bf16_16x8x16(acc[i][j], a[i], b[j][0], b[j][1]);
      }
      __syncthreads();  // everyone is done with this stage before the next iteration refills it
    }

    // The epilogue, straight from the registers: acc[i][j][h * 2 + e] is row g + 8h, column 2c + e of
    // mma tile (i, j).
#pragma unroll
    for (int i = 0; i < kTilesM; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int t = m0 + warp_m * kTcWarpM + i * kMmaM + g + 8 * h;
        if (t >= tokens) continue;
#pragma unroll
        for (int j = 0; j < kTilesN; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int o = n0 + warp_n * kTcWarpN + j * kMmaN + 2 * c + e;
            if (o < out) store_output(y + static_cast<size_t>(t) * out + o, acc[i][j][h * 2 + e]);
          }
        }
      }
    }
  }
  // --- end of exercise 06.5 ---
}

// v4 is one piece of K (gridDim.z == 1, split_len >= in). v7: block z sums K columns [z * split_len,
// z * split_len + split_len) into plane z of y, [tokens, out] fp32 each: the partial sums that
// add_partials_kernel adds up.
template <typename OutT, TileCopy kCopy>
__global__ void __launch_bounds__(kTcThreads)
    linear_mma_kernel(OutT* __restrict__ y,        // v4: [T, out]; v7: [splits, T, out]
                      const bf16* __restrict__ x,  // [T, in]
                      const bf16* __restrict__ w,  // [out, in]
                      int tokens, int in, int out, int split_len) {
  const int k0 = static_cast<int>(blockIdx.z) * split_len;
  linear_mma_tiles<OutT, kCopy>(y + static_cast<size_t>(blockIdx.z) * tokens * out, x + k0, w + k0, tokens,
                                min(split_len, in - k0), in, out);
}

// Grid rows: one per token tile, at most 65535 (the kernels stride over the rest).
unsigned token_blocks(int tokens, int tile) {
  return static_cast<unsigned>(std::min<int64_t>(ceil_div(tokens, tile), kMaxGridY));
}

template <typename OutT>
void launch_naive(OutT* y, const TensorView& x, const TensorView& w, cudaStream_t stream) {
  const int tokens = static_cast<int>(x.shape[0]), in = static_cast<int>(x.shape[1]);
  const int out = static_cast<int>(w.shape[0]);
  const dim3 block(kNaiveBlockX, kNaiveBlockY);
  const dim3 grid(static_cast<unsigned>(ceil_div(out, kNaiveBlockX)), token_blocks(tokens, kNaiveBlockY));
  linear_naive_kernel<<<grid, block, 0, stream>>>(y, x.ptr<const bf16>(), w.ptr<const bf16>(), tokens, in, out);
  TVLLM_CHECK_LAUNCH();
}

template <typename OutT>
void launch_tiled(OutT* y, const TensorView& x, const TensorView& w, cudaStream_t stream) {
  const int tokens = static_cast<int>(x.shape[0]), in = static_cast<int>(x.shape[1]);
  const int out = static_cast<int>(w.shape[0]);
  const bool vec_x = in % kLoadVec == 0 && pointer_alignment(x.data) == 16;
  const bool vec_w = in % kLoadVec == 0 && pointer_alignment(w.data) == 16;
  const dim3 block(kThreadsSide, kThreadsSide);
  const dim3 grid(static_cast<unsigned>(ceil_div(out, kTileN)), token_blocks(tokens, kTileM));
  linear_tiled_kernel<<<grid, block, 0, stream>>>(y, x.ptr<const bf16>(), w.ptr<const bf16>(), tokens, in, out,
                                                  vec_x, vec_w);
  TVLLM_CHECK_LAUNCH();
}

// v3 and v4: 16-byte copies when every row of x and w starts 16-byte aligned (in % 8 == 0 and aligned
// base pointers), one element at a time otherwise.
template <typename OutT>
void launch_tensor_core(OutT* y, const TensorView& x, const TensorView& w, MatmulKernel version,
                        cudaStream_t stream) {
  const bool wmma = version == MatmulKernel::V3Wmma;
  require_tensor_core_device(wmma ? "linear v3 (WMMA)" : "linear v4 (mma.sync)");
  const int tokens = static_cast<int>(x.shape[0]), in = static_cast<int>(x.shape[1]);
  const int out = static_cast<int>(w.shape[0]);
  const bool fast = in % kLoadVec == 0 && pointer_alignment(x.data) == 16 && pointer_alignment(w.data) == 16;
  const dim3 grid(static_cast<unsigned>(ceil_div(out, kTcTileN)), token_blocks(tokens, kTcTileM));
  if (wmma) {
    const auto kernel =
        fast ? linear_wmma_kernel<OutT, TileCopy::kVector> : linear_wmma_kernel<OutT, TileCopy::kElement>;
    kernel<<<grid, kTcThreads, 0, stream>>>(y, x.ptr<const bf16>(), w.ptr<const bf16>(), tokens, in, out);
  } else {
    const auto kernel =
        fast ? linear_mma_kernel<OutT, TileCopy::kAsync> : linear_mma_kernel<OutT, TileCopy::kElement>;
    kernel<<<grid, kTcThreads, 0, stream>>>(y, x.ptr<const bf16>(), w.ptr<const bf16>(), tokens, in, out, in);
  }
  TVLLM_CHECK_LAUNCH();
}

// ---- v7: batch-invariant ---------------------------------------------------------------------------
//
// A server runs many requests in one forward step (lesson 11): T is the sum of everyone's new tokens
// and changes every step. Row t of y = x W^T depends mathematically on row t of x only, but the BITS
// depend on the order in which the K products are added, and cuBLAS (v5, v6) picks its algorithm (tile
// sizes, split-K, stream-K) from the shape, T included. So a request's logits can change in the last
// bits when other requests join its step, and a greedy near-tie can flip: the same prompt, a different
// answer, depending on the traffic.
//
// v4 does not have the problem: element (t, o) is the fp32 sum over K slices 0, 32, 64, ... in order,
// each by the same two mma instructions, whatever T is and wherever row t sits in its tile (an mma
// element depends on its own row of A and column of B only). What v4 lacks is speed at small T: a decode
// step of a few tokens gives it out / 128 blocks (16 for Llama 3.2 1B's o_proj), too few to keep the
// memory system busy. v7 adds parallelism the invariant way: K is cut into pieces decided by W's shape
// alone (batch_invariant_split), block (x, y, z) computes piece z of its tile into an fp32 plane of the
// workspace, and add_partials_kernel adds the planes in the order 0, 1, 2, ... and rounds once. The
// pieces never change with T, so neither do the bits. (Many tokens: the rows go in chunks that fit the
// workspace; a chunk boundary changes nothing either, rows being independent.)
template <typename OutT>
__global__ void add_partials_kernel(OutT* __restrict__ y,               // [rows, out]
                                    const float* __restrict__ partials,  // [splits, rows, out]
                                    size_t n, int splits) {               // n = rows * out
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    float sum = partials[i];
    for (int z = 1; z < splits; ++z) sum += partials[z * n + i];  // always this order, then one rounding
    store_output(y + i, sum);
  }
}

template <typename OutT>
void launch_batch_invariant(OutT* y, const TensorView& x, const TensorView& w, const CublasHandle& handle) {
  require_tensor_core_device("linear v7 (batch-invariant)");
  const int tokens = static_cast<int>(x.shape[0]), in = static_cast<int>(x.shape[1]);
  const int out = static_cast<int>(w.shape[0]);
  const SplitK split = batch_invariant_split(in, out);
  const cudaStream_t stream = handle.stream();
  const bool fast = in % kLoadVec == 0 && pointer_alignment(x.data) == 16 && pointer_alignment(w.data) == 16;
  const auto kernel_to = [&](auto* dst) {
    using T = std::remove_pointer_t<decltype(dst)>;
    return fast ? linear_mma_kernel<T, TileCopy::kAsync> : linear_mma_kernel<T, TileCopy::kElement>;
  };
  const unsigned out_tiles = static_cast<unsigned>(ceil_div(out, kTcTileN));
  if (split.splits == 1) {  // one piece: v4 exactly, straight into y
    kernel_to(y)<<<dim3(out_tiles, token_blocks(tokens, kTcTileM)), kTcThreads, 0, stream>>>(
        y, x.ptr<const bf16>(), w.ptr<const bf16>(), tokens, in, out, in);
    TVLLM_CHECK_LAUNCH();
    return;
  }
  // The partial sums live in the handle's workspace (the same stream orders them after any cuBLAS call
  // that used it): [splits, chunk, out] fp32.
  const size_t bytes_per_token = static_cast<size_t>(split.splits) * out * sizeof(float);
  // (Measured on the H200: rounding a chunk down to whole 128-token tiles made the gate|up prefill slower,
  // 1.61 vs 1.39 ms at T = 4096: more launches of fewer blocks cost more than a part-empty tile.)
  const int64_t chunk = static_cast<int64_t>(handle.workspace_bytes() / bytes_per_token);
  TVLLM_REQUIRE(chunk >= 1, "linear v7: the CublasHandle's workspace (" + std::to_string(handle.workspace_bytes()) +
                                " bytes) holds less than one token's partial sums (" + std::to_string(split.splits) +
                                " pieces x " + std::to_string(out) + " outputs x 4 bytes)");
  float* partials = static_cast<float*>(handle.workspace());
  for (int64_t t0 = 0; t0 < tokens; t0 += chunk) {
    const int rows = static_cast<int>(std::min<int64_t>(chunk, tokens - t0));
    const dim3 grid(out_tiles, token_blocks(rows, kTcTileM), static_cast<unsigned>(split.splits));
    kernel_to(partials)<<<grid, kTcThreads, 0, stream>>>(partials, x.ptr<const bf16>() + t0 * in,
                                                         w.ptr<const bf16>(), rows, in, out,
                                                         static_cast<int>(split.split_len));
    TVLLM_CHECK_LAUNCH();
    const size_t n = static_cast<size_t>(rows) * out;
    const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(ceil_div(static_cast<int64_t>(n), 256), 4096));
    add_partials_kernel<<<blocks, 256, 0, stream>>>(y + t0 * out, partials, n, split.splits);
    TVLLM_CHECK_LAUNCH();
  }
}

// ---- v5: cuBLAS, and the row-major trick -----------------------------------------------------------
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
//
// CUBLAS_COMPUTE_32F: every product and sum in fp32. But a split-K algorithm (K cut into pieces, each
// summed by a different block, the pieces added at the end) may, in cuBLAS's default math mode, add
// the pieces in the OUTPUT type, bf16: the documentation of CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_
// REDUCTION says the flag "forces any reductions during matrix multiplications to use the accumulator
// type". The project's one handle (common/cublas.h) sets it, so v5 keeps the fp32 promise too.
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

// ---- v6: cuBLASLt ---------------------------------------------------------------------------------
//
// The same product through cuBLASLt, the library cublasGemmEx itself calls into. Here we do by hand
// what GemmEx does inside: describe the operation and the three layouts, ask the heuristic for the
// best algorithm given the shapes, the pointer alignments and the workspace we allow, and run it.
// The answer depends only on those, so we ask once per (device, shape, dtype, alignment, workspace)
// and cache the plan (LtPlanCache below).

// The descriptors (LtMatmulDesc, LtLayout, LtPreference) and LtPlan live in lt_plan.h: v8 uses them too.

// (device, T, in, out, output dtype, alignment of w, x, y, workspace bytes): everything the choice
// of algorithm depends on.
using LtKey = std::tuple<int, int, int, int, int, uint32_t, uint32_t, uint32_t, size_t>;

// The cuBLASLt plans made so far, one per LtKey, shared by every CublasHandle of the process. A plan
// holds no handle and no device memory (descriptors are host structures; the algorithm is a value), so
// it is a pure function of its key: a plan made through one handle is valid through any other on the
// same device. Made on the first call with a new key (descriptor creation and the heuristic query are
// host work: no device allocation, no synchronisation, nothing on the stream), then reused: a warm-up
// step, made before a CUDA graph is captured, creates every plan a forward step needs. Bounded: a
// serving loop sees many T. Plans are handed out as shared_ptr, so clearing the map never pulls a plan
// from under a caller; a mutex makes it safe to call linear() from several host threads.
class LtPlanCache {
 public:
  std::shared_ptr<const LtPlan> get(const CublasHandle& handle, const TensorView& y, const TensorView& x,
                                    const TensorView& w) {
    const int tokens = static_cast<int>(x.shape[0]), in = static_cast<int>(x.shape[1]);
    const int out = static_cast<int>(w.shape[0]);
    const uint32_t align_w = pointer_alignment(w.data, 256), align_x = pointer_alignment(x.data, 256);
    const uint32_t align_y = pointer_alignment(y.data, 256);
    int device = 0;
    TVLLM_CUDA_CHECK(cudaGetDevice(&device));
    const LtKey key{device, tokens, in, out, static_cast<int>(y.dtype), align_w, align_x, align_y,
                    handle.workspace_bytes()};
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = plans_.find(key);
    if (found != plans_.end()) return found->second;
    if (plans_.size() >= kMaxPlans) plans_.clear();
    auto plan = make_plan(handle, tokens, in, out, y.dtype, align_w, align_x, align_y);
    plans_.emplace(key, plan);
    return plan;
  }

 private:
  static constexpr size_t kMaxPlans = 4096;

  static std::shared_ptr<const LtPlan> make_plan(const CublasHandle& handle, int tokens, int in, int out,
                                                 DType out_dtype, uint32_t align_w, uint32_t align_x,
                                                 uint32_t align_y) {
    auto plan = std::make_shared<LtPlan>(tokens, in, out, cuda_type(out_dtype));  // transposes set (lt_plan.h)

    LtPreference pref;
    const uint64_t workspace_bytes = handle.workspace_bytes();
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
    // (or, for an fp32 output, any scheme: they are all fp32 then). cuBLASLt has no math mode: this mask
    // is its per-call equivalent of the DISALLOW_REDUCED_PRECISION_REDUCTION flag that common/cublas.h
    // sets on the cuBLAS handle.
    const uint32_t reductions =
        out_dtype == DType::F32 ? CUBLASLT_REDUCTION_SCHEME_MASK : CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    TVLLM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                                            &reductions, sizeof reductions));

    cublasLtMatmulHeuristicResult_t result{};
    int found_count = 0;
    TVLLM_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(handle.lt(), plan->op.desc, plan->a.layout, plan->b.layout,
                                                      plan->c.layout, plan->c.layout, pref.pref, 1, &result,
                                                      &found_count));
    if (found_count == 0 || result.state != CUBLAS_STATUS_SUCCESS)
      throw CudaError("cuBLASLt found no algorithm for y[" + std::to_string(tokens) + ", " + std::to_string(out) +
                      "] = x[" + std::to_string(tokens) + ", " + std::to_string(in) + "] W^T");
    plan->algo = result.algo;
    return plan;
  }

  std::mutex mutex_;
  std::map<LtKey, std::shared_ptr<const LtPlan>> plans_;
};

LtPlanCache& lt_plans() {
  static LtPlanCache cache;  // made on first use, thread-safe (C++11 magic statics)
  return cache;
}

void gemm_cublaslt(const TensorView& y, const TensorView& x, const TensorView& w, const CublasHandle& handle) {
  const std::shared_ptr<const LtPlan> plan = lt_plans().get(handle, y, x, w);
  const float alpha = 1.f, beta = 0.f;
  TVLLM_CUBLAS_CHECK(cublasLtMatmul(handle.lt(), plan->op.desc, &alpha,
                                    /*A=*/w.data, plan->a.layout,
                                    /*B=*/x.data, plan->b.layout, &beta,
                                    /*C=*/y.data, plan->c.layout,
                                    /*D=*/y.data, plan->c.layout, &plan->algo,
                                    handle.workspace(), handle.workspace_bytes(), handle.stream()));
}

// Every version runs on the handle's stream (the legacy default stream without a handle: v1 to v4 only).
template <typename OutT>
void run_kernel(OutT* y_ptr, const TensorView& y, const TensorView& x, const TensorView& w, MatmulKernel kernel,
                const CublasHandle* handle) {
  const cudaStream_t stream = handle ? handle->stream() : nullptr;
  switch (kernel) {
    case MatmulKernel::V1Naive: launch_naive(y_ptr, x, w, stream); break;
    case MatmulKernel::V2Tiled: launch_tiled(y_ptr, x, w, stream); break;
    case MatmulKernel::V3Wmma:
    case MatmulKernel::V4MmaSync: launch_tensor_core(y_ptr, x, w, kernel, stream); break;
    case MatmulKernel::V5Cublas: gemm_cublas(y, x, w, handle->blas()); break;  // blas() runs on stream()
    case MatmulKernel::V6CublasLt: gemm_cublaslt(y, x, w, *handle); break;
    case MatmulKernel::V7BatchInvariant: launch_batch_invariant(y_ptr, x, w, *handle); break;
    case MatmulKernel::V8PinnedLt:  // matmul_pinned.cu; v7 where no algorithm is pinned for this shape
      if (!detail::linear_pinned_lt(y, x, w, *handle)) launch_batch_invariant(y_ptr, x, w, *handle);
      break;
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
                         const CublasHandle* handle) {
  if (y.dtype == DType::F32) {
    run_kernel(y.ptr<float>(), y, x, w, kernel, handle);
  } else {
    run_kernel(y.ptr<bf16>(), y, x, w, kernel, handle);
  }
}

void fill_uniform_bf16(const TensorView& t, uint64_t seed, float lo, float hi, cudaStream_t stream) {
  TVLLM_REQUIRE(t.device == Device::CUDA && t.dtype == DType::BF16 && t.is_contiguous(),
                "fill_uniform_bf16: needs a contiguous BF16 CUDA tensor, got " + t.describe());
  const size_t n = static_cast<size_t>(t.numel());
  if (n == 0) return;
  const unsigned blocks = static_cast<unsigned>(std::min<size_t>((n + 255) / 256, size_t{1} << 16));
  fill_uniform_bf16_kernel<<<blocks, 256, 0, stream>>>(t.ptr<bf16>(), n, seed, lo, hi);
  TVLLM_CHECK_LAUNCH();
}

}  // namespace tvllm
