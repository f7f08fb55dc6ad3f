// Lesson 15: each step run on the GPU and compared with its CPU oracle, for the lesson executable and the GPU
// tests alike (one place states each comparison and its tolerance), and the oracles' own checks for the CPU.
//
// Tolerances (README.md, "What correct means"):
//   TMA copies           exact: a copy moves bits; zeros outside the matrix are exact zeros.
//   wgmma tile, integers exact: small integers (|a|, |b| <= 8, K <= 64) make every product and partial sum an
//                        integer below 2^12, which fp32 holds exactly in any order of addition.
//   wgmma tile, random   lesson 06's kF32OutVsCpu: 2^-12 of the row's RMS + 2^-12 relative; only the order
//   (and
//                        the tensor cores' internal rounding) of <= 64 fp32 additions differs from the
//                        oracle.
//   GEMM                 lesson 06's kBf16OutVsCpu: 2^-12 row RMS + 2^-8 relative (the final rounding to
//   bf16). cluster exchange     exact: again a copy.
// Host only (C++20).
#pragma once

#include <cstdint>
#include <vector>

#include "common/validate.h"
#include "hopper.h"
#include "matmul_check.h"  // LinearTolerance

namespace tvllm {

// Every check below needs hopper_available(); they throw InputError otherwise.
CompareResult check_tma_tile(int64_t rows, int64_t cols, int64_t row0, int64_t col0, int64_t box_rows,
                             int64_t box_cols, TmaSwizzle swizzle, uint64_t seed);
CompareResult check_wgmma_tile(int k_first, int k_steps, bool small_integers, uint64_t seed);
CompareResult check_cluster_exchange(int blocks, int cluster_blocks, int shift, int per_block, uint64_t seed);
// y = x W^T for [m, k] x [n, k]^T on random bf16-exact inputs. check_guards: y lives in a buffer one row
// longer, filled with NaN, and the extra row must come back untouched (no store past M x N).
// version 2: gemm_wgmma_v2 on the same inputs, the same oracle and tolerance.
CompareResult check_gemm_wgmma(int64_t m, int64_t n, int64_t k, uint64_t seed, bool check_guards = true,
                               int version = 1);
// gemm_wgmma (version 1) or gemm_wgmma_v2 (version 2); InputError for another version.
void run_gemm_wgmma(int version, const TensorView& y, const TensorView& x, const TensorView& w,
                    cudaStream_t stream = nullptr);

// Batch invariance, bit for bit: y = x W^T for x [m, k] (random), then for each row r of `rows` the 1-row
// product x[r] W^T on its own; returns how many of those rows differ from row r of the m-row result in any
// bit (0: the kernel's result for a row does not depend on the rest of the batch). Throws for r outside m.
int64_t gemm_batch_variant_rows(int version, int64_t m, int64_t n, int64_t k,
                                const std::vector<int64_t>& rows, uint64_t seed);

// Step 8: gated_mlp_wgmma on random x [m, k] and w_gate_up [2i, k], against
//   (a) the CPU oracle: the exact gate and up sums (lesson 06's double sums) each rounded to bf16, silu in double
//       rounded to fp32 then bf16, times up; tolerance kGatedMlpVsCpu (below), rows past M untouched;
//   (b) with unfused_bits: GEMM v2 into [m, 2i] then lesson 08's silu_mul kernel, which must give the SAME bits
//       (the same sums in the same order, rounded at the same points): r.error counts the elements that differ.
// cpu_oracle = false skips (a) (the 1B model's shapes: billions of double multiply-adds on the CPU).
CompareResult check_gated_mlp_wgmma(int64_t m, int64_t i, int64_t k, uint64_t seed, bool cpu_oracle = true);
// Against the CPU oracle act differs only where the GPU's fp32 sum of gate or up lands on the other side of a bf16
// rounding boundary than the exact sum: gate and up each off by one bf16 step (2^-8 relative), silu's slope at
// most 1.1, two more roundings of 2^-9: |error| <= (1.1 + 1) 2^-8 + 2 2^-9 < 2^-6 relative; plus lesson 06's 2^-12
// of the row's RMS for values near zero.
inline constexpr LinearTolerance kGatedMlpVsCpu{1.0 / 4096, 1.0 / 64};
// Batch invariance of step 8: act for m rows, then each row of `rows` alone; how many rows differ in any bit.
int64_t gated_mlp_batch_variant_rows(int64_t m, int64_t i, int64_t k, const std::vector<int64_t>& rows,
                                     uint64_t seed);

// The GEMM shapes the lesson executable and the GPU tests check: tile edges in M and N, odd N (the unpaired
// stores), K from one stage to several rounds of the ring. For v2 also: N % 8 != 0 but even (the register
// epilogue's pairs), N past one 256-wide tile by a partial 64-column chunk, more tiles than SMs (the
// persistent loop goes round several times, some blocks' stage counters wrapping mid-tile).
struct GemmShape {
  int64_t m, n, k;
};
const std::vector<GemmShape>& gemm_check_shapes();
const std::vector<GemmShape>& gemm_v2_check_shapes();  // gemm_check_shapes() and v2's own edges

// The CPU's own checks, no GPU: the swizzle is a permutation of each 1024-byte atom that keeps rows in place,
// the descriptor's fields land on their bits, the fragment layout covers the 64 x 128 tile once, the tile and
// exchange oracles agree with straightforward re-computations. One row each, for the lesson's CPU run.
void add_oracle_checks(Report& report);

}  // namespace tvllm
