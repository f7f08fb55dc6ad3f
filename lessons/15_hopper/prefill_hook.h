// Lesson 15: the engine's prefill attention on Hopper. flash_wgmma() takes the place of lesson 07's v2 kernel (in
// lesson 08's PrefillAttention) and of lesson 12's paged flash kernel (in the engine) for every prefill step with
// no cached prefix: there a step's keys are exactly its own new rows, so the kernel reads them from the step's
// q, k, v views (the rows just written to the KV cache) through TMA, with no block table in between. The steps
// with a cached prefix take flash_wgmma_paged() (below): the same kernel reading the pool through the tables.
//
// Through lesson 07's seam (attention.h: install_fresh_prefill / try_fresh_prefill): the earlier lessons cannot
// link this one. A backend asks for it with set_fast_prefill(true); tiny-vllm does that on sm_90 unless
// --no-hopper-attention or batch invariance is asked for (a prefix-cache hit could then take another kernel than a
// miss: the same sequence with other bits).
#pragma once

#include "attention.h"
#include "common/tensor.h"
#include "paged_kv.h"

namespace tvllm {

// Whether hopper_prefill_attention() takes these views: CUDA bf16, head_dim 64 or 128, every view's data
// 16-byte aligned with a row stride that is a multiple of 8 elements (TMA's rules), and a Hopper GPU.
bool hopper_prefill_accepts(const TensorView& out, const TensorView& q, const TensorView& k, const TensorView& v,
                            const AttentionShape& shape);

// The kernel behind the seam: flash_wgmma() when hopper_prefill_accepts(), else false (nothing launched).
bool hopper_prefill_attention(const TensorView& out, const TensorView& q, const TensorView& k, const TensorView& v,
                              const AttentionBatch& batch, const AttentionShape& shape, cudaStream_t stream);

// ---- prefill over cached blocks: flash_wgmma_paged() behind lesson 12's paged-prefill seam ----------------------
// Every other step with a sequence of several queries (a chunk after earlier chunks, a prompt whose first blocks
// were a prefix-cache hit, prefill chunks beside decode tokens) reads its keys from the pool through the block
// tables: flash_wgmma_paged() (flash_paged.h), through lesson 12's install_fast_paged_prefill, asked by
// PagedAttention after the fresh-prefill seam.
//
// Whether hopper_paged_prefill_attention() takes the step: CUDA bf16 views, flash_paged_refusal() == "" (head_dim
// 64 or 128, blocks of a power of two >= 8), q and out TMA-aligned, the pool's layers contiguous [num_blocks,
// block_size, kv_dim] and 16-byte aligned, a Hopper GPU.
bool hopper_paged_prefill_accepts(const TensorView& out, const TensorView& q, const TensorView& pool_k,
                                  const TensorView& pool_v, const PagedStepTables& tables,
                                  const AttentionShape& shape);
// The kernel behind the seam: flash_wgmma_paged() when hopper_paged_prefill_accepts(), else false (nothing launched).
bool hopper_paged_prefill_attention(const TensorView& out, const TensorView& q, const TensorView& pool_k,
                                    const TensorView& pool_v, const AttentionBatch& batch,
                                    const PagedStepTables& tables, const AttentionShape& shape, cudaStream_t stream);

// Installs hopper_prefill_attention() into lesson 07's seam and hopper_paged_prefill_attention() into lesson 12's
// when this machine has a Hopper GPU and the library was built for sm_90a. Returns whether it did (false: nothing
// installed, the lessons' kernels keep running).
bool install_hopper_prefill_attention();

// ---- the GEMM: gemm_wgmma_v2() behind lesson 06's large-GEMM seam (matmul.h: install_large_gemm) ------------
// linear() with the default kernel (cuBLAS) takes it, once installed (tiny-vllm --hopper-gemm; off by default),
// for steps of at least kHopperGemmMinTokens rows: below that a 128 x 256 tile grid leaves SMs idle (a 512-row
// o_proj is 4 x 8 = 32 tiles for 132 SMs). Measured in the engine's prefill on the H200 (chapter section 11) it
// was no faster than cuBLAS (1024 tokens: 18% slower; 4096: equal), hence opt-in: the lesson's GEMM, not the
// engine's.
inline constexpr int64_t kHopperGemmMinTokens = 1024;

// Whether gemm_wgmma_v2() takes y = x W^T: bf16 contiguous CUDA matrices, x and w TMA-ready (tma_matrix_ok), y
// 16-byte aligned, K a multiple of 64 (any M and N), and a Hopper GPU.
bool hopper_gemm_accepts(const TensorView& y, const TensorView& x, const TensorView& w);
// The function behind the seam: gemm_wgmma_v2() when hopper_gemm_accepts(), else false (nothing launched).
bool hopper_large_gemm(const TensorView& y, const TensorView& x, const TensorView& w, cudaStream_t stream);
// Installs it (min_tokens kHopperGemmMinTokens) when this machine has a Hopper GPU; returns whether it did.
bool install_hopper_large_gemm();

// ---- the gated MLP: gated_mlp_wgmma() behind lesson 08's gated-MLP seam (transformer.h: install_gated_mlp) ------
// The forward's step 7 (act = silu(x Wg^T) * (x Wu^T)) as ONE kernel for steps of at least kHopperGatedMlpMinTokens
// rows: below that its 128 x 128-column tiles leave SMs idle (512 rows of the 1B model's I = 8192: 4 x 64 = 256
// tiles, two waves on 132 SMs) and cuBLAS + silu_mul is as fast. On by default on Hopper with lesson 15's prefill
// attention (tiny-vllm --no-hopper-mlp turns it off; batch invariance never asks it).
inline constexpr int64_t kHopperGatedMlpMinTokens = 512;

// Whether gated_mlp_wgmma() takes these views (check_gated_mlp_args' rules, as a yes or no) on this GPU.
bool hopper_gated_mlp_accepts(const TensorView& act, const TensorView& x, const TensorView& w_gate_up);
// The function behind the seam: gated_mlp_wgmma() when hopper_gated_mlp_accepts(), else false (nothing launched).
bool hopper_gated_mlp(const TensorView& act, const TensorView& x, const TensorView& w_gate_up, cudaStream_t stream);
// Installs it (min_tokens kHopperGatedMlpMinTokens) when this machine has a Hopper GPU; returns whether it did.
bool install_hopper_gated_mlp();

}  // namespace tvllm
