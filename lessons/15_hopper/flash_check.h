// Lesson 15, step 5: flash_wgmma() against lesson 07, for the lesson executable and the GPU tests alike.
//
// The oracle is lesson 07's CPU reference (attention() on fp32 views) run on the SAME bf16-rounded inputs,
// and the tolerance is lesson 07's (tests/test_07_attention_gpu.cpp states the derivation): P is rounded to
// bf16 before P V (at most 2^-8 of max|v| on a convex combination) and the output is rounded to bf16 (2^-8
// relative), plus 1e-4 for fp32 sums in another order:
//     atol = (2^-8 + 1e-4) * max|v|,   rtol = 2^-8 + 1e-4.
// Lesson 07's own GPU kernel (v2) runs on the same inputs beside ours, so a failure shows whether the bar
// or our kernel moved. Host only (C++20).
#pragma once

#include <cstdint>
#include <vector>

#include "attention.h"
#include "common/validate.h"
#include "flash_wgmma.h"

namespace tvllm {

inline constexpr double kFlashRounding = 1.0 / 256 + 1e-4;  // lesson 07's kAtolPerMaxV and kRtol

struct FlashCheck {
  CompareResult ours;           // flash_wgmma vs the CPU reference
  CompareResult lesson07;       // lesson 07's v2 on the GPU vs the same reference
  int64_t non_finite = 0;       // NaN or inf in our output: a row never written stays NaN
  int64_t written_outside = 0;  // elements of out's wider buffer, outside out, that changed
  bool pass() const { return ours.pass() && non_finite == 0 && written_outside == 0; }
};

// Random q (normal), k (normal), v (uniform in [-1, 1]) for the batch (q_lens[b] <= k_lens[b]); q, k, v as
// column slices of one fused QKV buffer when fused_qkv (strided tensor maps), else packed; out a column slice
// of a wider buffer pre-filled with NaN. Runs `config` (a variant of flash_configs(head_dim)), or the default
// when null. Needs hopper_available() (InputError otherwise).
FlashCheck check_flash_wgmma(const std::vector<int64_t>& q_lens, const std::vector<int64_t>& k_lens,
                             const AttentionShape& shape, uint64_t seed, bool fused_qkv = false,
                             const FlashConfig* config = nullptr);

// Step 7: flash_wgmma_paged() over one layer of a paged pool against lesson 12's CPU paged prefill reference
// (paged_prefill_attention_cpu) on the same bf16-exact keys, values and queries, with the tolerance above;
// lesson 12's GPU paged flash kernel runs beside it on the same pool (FlashCheck::lesson07 holds its
// comparison). The sequences' blocks are a shuffled permutation of a pool with 7 blocks to spare; with
// share_from >= 0 the last sequence's table starts with sequence share_from's first share_keys / block_size
// blocks (a prefix-cache hit). Every slot that no sequence's key occupies (the unused blocks, the tail of
// each last block) holds NaN: a kernel that lets one into a P V fails. config null: the default. Needs
// hopper_available().
FlashCheck check_flash_wgmma_paged(const std::vector<int64_t>& q_lens, const std::vector<int64_t>& k_lens,
                                   const AttentionShape& shape, int64_t block_size, uint64_t seed,
                                   int share_from = -1, int64_t share_keys = 0,
                                   const FlashConfig* config = nullptr, cudaStream_t stream = nullptr);

// wgmma_pv_tile() against a double-precision P V on the CPU: exact on small integers (|p|, |v| <= 8: every
// partial sum of 128 products is an integer below 2^14, exact in fp32 in any order), else lesson 06's
// kF32OutVsCpu (2^-12 row RMS + 2^-12 relative). Needs hopper_available().
CompareResult check_wgmma_pv_tile(int64_t n, bool small_integers, uint64_t seed);

// Useful FLOPs of causal attention as lesson 07 counts them: each visible (query, key) pair costs a head_dim
// dot product (2 D) and a head_dim axpy (2 D) in every head; a prefill of n tokens has n (n + 1) / 2 pairs.
double causal_attention_flops(const std::vector<int64_t>& lengths, const AttentionShape& shape);

}  // namespace tvllm
