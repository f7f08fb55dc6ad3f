// Lesson 15: Hopper's tensor cores. The stage's API, in the order of the chapter:
//
//   step 1  tma_tile_copy     one TMA load of a 2-D tile into shared memory, waited for with an mbarrier,
//   written
//                             back to global memory (read through the swizzle formula when the 128-byte
//                             swizzle is on). Out-of-bounds parts of the tile come back as zeros.
//   step 2  wgmma_tile        one warpgroup, one tile: D[64 x 128] = A[:, k-range] B[:, k-range]^T with wgmma
//                             from shared-memory descriptors.
//   step 3  cluster_exchange  a cluster of blocks, each reading its neighbour's shared memory (DSMEM).
//   step 4  gemm_wgmma        y = x W^T, the engine's linear layer, on wgmma + TMA with warp specialisation;
//           gemm_wgmma_v2     the same, a 128 x 256 tile, persistent, with a TMA-store epilogue.
//   step 5  flash_wgmma       prefill attention on wgmma + TMA: flash_wgmma.h (it needs lesson 07's types).
//
// Every GPU function needs compute capability 9.0 exactly (H100, H200) and a build that includes sm_90a
// (hopper_available() says whether both hold); elsewhere it throws InputError before launching anything.
// Each has a CPU oracle (*_cpu) that computes the same result in double precision (or bit for bit for
// copies).
//
// This header is included by .cu files, so it stays C++17.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common/tensor.h"

namespace tvllm {

// True when this process can run the lesson's Hopper kernels: a GPU of compute capability 9.0 and a library
// built with sm_90a. hopper_unavailable_reason() says why not ("" when available).
bool hopper_available();
std::string hopper_unavailable_reason();
// Throws InputError with hopper_unavailable_reason() unless hopper_available().
void require_hopper(const char* what);

// ---- step 1: TMA ----------------------------------------------------------------------------------------
enum class TmaSwizzle { None, B128 };
const char* tma_swizzle_name(TmaSwizzle swizzle);

// dst [box_rows, box_cols] = the box of src [rows, cols] whose top-left element is (row0, col0); elements of
// the box outside src (row or column < 0 or past the end) are 0. bf16, contiguous, on the GPU.
// Limits (TMA's): 1 <= box_rows <= 256; box_cols * 2 bytes a multiple of 16 and <= 256 elements; with B128
// the box is exactly 64 columns (one 128-byte swizzle row); src's row pitch (cols * 2 bytes) a multiple
// of 16. row0, col0 within [-2^31, 2^31). Throws InputError otherwise.
void tma_tile_copy(const TensorView& dst, const TensorView& src, int64_t row0, int64_t col0,
                   TmaSwizzle swizzle, cudaStream_t stream = nullptr);
// The oracle: dst and src fp32 on the CPU, the same box, the same zeros.
void tma_tile_copy_cpu(const TensorView& dst, const TensorView& src, int64_t row0, int64_t col0);

// ---- step 2: one wgmma tile -------------------------------------------------------------------------------
// The tile's fixed shape: A [64, 64], B [128, 64] (64 K values: one 128-byte swizzle row), D [64, 128] fp32.
inline constexpr int kTileM = 64, kTileN = 128, kTileK = 64;

// d = sum over k in [16 k_first, 16 (k_first + k_steps)) of a[:, k] b[:, k]^T: k_steps wgmma instructions of
// K = 16 each, starting at slice k_first (0 <= k_first, k_steps >= 1, k_first + k_steps <= 4).
// a bf16 [64, 64], b bf16 [128, 64], d fp32 [64, 128], contiguous, on the GPU.
void wgmma_tile(const TensorView& d, const TensorView& a, const TensorView& b, int k_first, int k_steps,
                cudaStream_t stream = nullptr);
// The oracle: the same sum in double, rounded once to fp32. a, b, d fp32 on the CPU.
void wgmma_tile_cpu(const TensorView& d, const TensorView& a, const TensorView& b, int k_first, int k_steps);

// ---- step 3: a cluster reads its neighbours' shared memory ------------------------------------------------
// Block b of the grid (clusters of cluster_blocks consecutive blocks) fills its shared memory with
// values[b * n .. b * n + n) (n = values.size / blocks), then writes to out[b * n + i] the element i of the
// block `shift` ranks further in ITS cluster (rank (r + shift) mod cluster_blocks). fp32, contiguous, on the
// GPU. cluster_blocks in 1..8 and divides the number of blocks; n in 1..1024. Throws InputError otherwise.
void cluster_exchange(const TensorView& out, const TensorView& values, int blocks, int cluster_blocks,
                      int shift, cudaStream_t stream = nullptr);
void cluster_exchange_cpu(const TensorView& out, const TensorView& values, int blocks, int cluster_blocks,
                          int shift);

// ---- step 4: the GEMM -------------------------------------------------------------------------------------
// y [M, N] = x [M, K] W [N, K]^T: bf16 in, fp32 accumulation, bf16 out (round to nearest even), like lesson
// 06's linear(). M, N >= 1 (any: the edges are zero-filled on load and guarded on store); K a positive
// multiple of 64; contiguous, 16-byte aligned, on the GPU; y must not overlap x or w. The kernel's tile: 128
// x 128 outputs per block, K in steps of 64 through a ring of 4 shared-memory stages filled by TMA; one
// producer warp, two consumer warpgroups (64 rows each).
inline constexpr int kGemmBlockM = 128, kGemmBlockN = 128, kGemmBlockK = 64, kGemmStages = 4;
void gemm_wgmma(const TensorView& y, const TensorView& x, const TensorView& w, cudaStream_t stream = nullptr);
// Step 4, v2: the same contract as gemm_wgmma (same arguments, same refusals), faster: 128 x 256 outputs per
// tile (two consumer warpgroups of 64 x 256, wgmma m64n256k16), 4 stages of 48 KB, a PERSISTENT grid (one
// block per SM, each looping over tiles in grouped order, hopper_layout.h: grouped_tile) whose producer
// loads the next tile while the consumers store the last one, and a TMA-store epilogue through shared
// memory (when N % 8 == 0; other N use guarded register stores). Each output's K sum runs in one fixed order
// whatever M is: a row's result does not depend on the other rows (batch-invariant, README).
inline constexpr int kGemm2BlockM = 128, kGemm2BlockN = 256, kGemm2BlockK = 64, kGemm2Stages = 4,
                     kGemm2GroupM = 8;
void gemm_wgmma_v2(const TensorView& y, const TensorView& x, const TensorView& w,
                   cudaStream_t stream = nullptr);
// Checks gemm_wgmma's arguments (shapes, dtypes, K % 64) without a GPU: the CPU tests call it.
void check_gemm_wgmma_args(const TensorView& y, const TensorView& x, const TensorView& w);

// ---- step 8: the gated MLP in the GEMM's epilogue ----------------------------------------------------------
// act [M, I] = silu(x Wg^T) * (x Wu^T) for the packed w_gate_up [2I, K] (gate rows, then up rows, as lesson 08
// packs them): GEMM v2 whose tiles hold 128 gate columns beside the same 128 up columns, so the epilogue writes
// act and the [M, 2I] product never reaches memory. Rounds as lesson 08's unfused path does (gate and up to
// bf16, silu(gate) to bf16, the product to bf16), and each sum runs in GEMM v2's order: the same bits as
// gemm_wgmma_v2 into [M, 2I] followed by silu_mul, and batch-invariant like it. Rules: GEMM v2's (bf16 CUDA
// matrices, contiguous, 16-byte aligned, K a positive multiple of 64), and I a positive multiple of 8 (act's rows
// are stored by TMA); act must not overlap x or w_gate_up.
void gated_mlp_wgmma(const TensorView& act, const TensorView& x, const TensorView& w_gate_up,
                     cudaStream_t stream = nullptr);
// Checks gated_mlp_wgmma's arguments without a GPU (InputError naming the rule).
void check_gated_mlp_args(const TensorView& act, const TensorView& x, const TensorView& w_gate_up);

}  // namespace tvllm
