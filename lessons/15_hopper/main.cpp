// lesson15_hopper: Hopper's tensor cores, step by step, each step against its CPU oracle.
//
//   build/bin/lesson15_hopper [--device auto|cpu|cuda] [--bench] [--sweep] [--tokens N]
//
// CUDA (an H100/H200: compute capability 9.0, and a build with sm_90a):
//   step 1  TMA tile loads, no swizzle and 128-byte swizzle, boxes inside, across the edges and before the
//   start step 2  one wgmma tile on every K slice, exact on small integers, within fp32 reordering on random
//   values step 3  clusters of 2, 4 and 8 blocks reading each other's shared memory step 4  the wgmma GEMM on
//   shapes with ragged edges, against lesson 06's CPU linear(), v1 and v2 (and v2's batch invariance, bits)
//   step 5  flash attention on wgmma against lesson 07's CPU reference (and lesson 07's v2 beside it)
//   step 7  the same over lesson 12's paged pool against lesson 12's CPU paged reference
// On another GPU it says why and exits 77 (CTest: skipped). On the CPU it checks the oracles themselves: the
// swizzle formula, the descriptor's bits, the accumulator layout, the tile and copy oracles.
//
// --bench (CUDA): the wgmma GEMM (v1 and v2) beside cuBLAS (lesson 06's v5) and the measured GEMM ceiling on
// 4096 x 2048 . 2048 x 8192 and on the projections of a Llama-3.2-1B-shaped layer at T tokens (default 4096);
// then causal GQA attention (32 / 8 heads, head_dim 64 and 128, n = 512 .. 16k) beside lesson 07's v2; then step
// 7, a chunk after a cached prefix of half the context: paged (blocks of 16), contiguous and lesson 12's kernel.
// --sweep (CUDA): every variant of step 6 (flash_configs) on the attention shapes of --bench, the best per
// (head_dim, n), and the FlashDefault tables the measurement suggests.
// The model takes no part otherwise (--model is accepted and ignored): the checks make their own inputs.
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "attention.h"
#include "common/bench.h"
#include "common/cublas.h"
#include "common/errors.h"
#include "common/lesson.h"
#include "common/random.h"
#include "common/validate.h"
#include "flash_check.h"
#include "flash_paged.h"
#include "flash_wgmma.h"
#include "hopper.h"
#include "hopper_check.h"
#include "hopper_layout.h"
#include "matmul.h"
#include "paged_kv.h"
#include "silu_mul.h"

namespace {

using namespace tvllm;

int check_cpu() {
  Report report(
      "lesson15_hopper: the CPU oracles (swizzle, descriptor, fragment layout, tile and copy oracles)");
  add_oracle_checks(report);
  {  // Step 5's register identity: S's accumulator registers 8kk .. 8kk + 7 are P V's A fragment of step kk.
    bool ok = true;
    for (uint32_t t = 0; t < 128; ++t)
      for (uint32_t kk = 0; kk < 8; ++kk)
        for (uint32_t j = 0; j < 8; ++j) {
          const FragmentPosition acc = accumulator_position(t, accumulator_register_for_a(kk, j));
          const FragmentPosition a = a_fragment_position(t, j);
          ok = ok && acc.row == a.row && acc.col == 16 * kk + a.col;
        }
    report.add_check("flash: P's A fragment of step kk is S's registers 8kk..8kk+7 (no data moves)", ok);
  }
  report.print(std::cout);
  return report.exit_code();
}

int check_cuda() {
  Report report("lesson15_hopper: TMA, wgmma, clusters and the wgmma GEMM on the GPU vs their CPU oracles");
  uint64_t seed = 1500;
  // Step 1: inside; across the bottom-right edges; starting before row/column 0; the swizzled 64-wide box.
  struct Box {
    int64_t rows, cols, row0, col0, box_rows, box_cols;
  };
  for (TmaSwizzle sw : {TmaSwizzle::None, TmaSwizzle::B128})
    for (const Box& b : std::vector<Box>{{200, 136, 64, 64, 64, 64},
                                         {200, 136, 150, 96, 64, 64},
                                         {200, 136, -5, -24, 64, 64},
                                         {37, 72, 0, 0, 128, 64}})
      report.add(check_tma_tile(b.rows, b.cols, b.row0, b.col0, b.box_rows, b.box_cols, sw, seed++));
  report.add(check_tma_tile(300, 520, 17, 8, 256, 256, TmaSwizzle::None, seed++));  // the largest box
  // Step 2.
  for (int first = 0; first < 4; ++first) report.add(check_wgmma_tile(first, 1, true, seed++));
  report.add(check_wgmma_tile(0, 4, true, seed++));
  report.add(check_wgmma_tile(0, 4, false, seed++));
  // Step 3.
  for (int cluster : {2, 4, 8}) report.add(check_cluster_exchange(4 * cluster, cluster, 1, 1000, seed++));
  // Step 4.
  for (const GemmShape& s : gemm_check_shapes()) report.add(check_gemm_wgmma(s.m, s.n, s.k, seed++));
  for (const GemmShape& s : gemm_v2_check_shapes())
    report.add(check_gemm_wgmma(s.m, s.n, s.k, seed++, true, 2));
  // Step 8: the gated MLP, against the CPU oracle and bit for bit against GEMM v2 + silu_mul (n is I here).
  for (const GemmShape& s : std::vector<GemmShape>{{100, 200, 320}, {333, 136, 1024}, {130, 8192, 2048}})
    report.add(check_gated_mlp_wgmma(s.m, s.n, s.k, seed++));
  // v2 is batch-invariant by construction: rows of a 1-row call equal the same rows of a 300-row call.
  report.add_check("wgmma GEMM v2: rows 0, 1, 127, 128, 299 alone == the same rows in a 300-row batch (bits)",
                   gemm_batch_variant_rows(2, 300, 1000, 2048, {0, 1, 127, 128, 299}, seed++) == 0);
  // Step 5: P V from registers alone (the layouts step 5 adds), then attention against lesson 07's CPU
  // reference (its GPU v2 on the same inputs must pass too).
  for (int64_t n : {64, 128}) {
    report.add(check_wgmma_pv_tile(n, true, seed++));
    report.add(check_wgmma_pv_tile(n, false, seed++));
  }
  struct Case {
    std::vector<int64_t> q_lens, k_lens;
    AttentionShape shape;
  };
  for (int64_t d : {64, 128})
    for (const Case& c : std::vector<Case>{{{1}, {1}, {8, 2, d}},
                                           {{65}, {65}, {8, 2, d}},
                                           {{1000}, {1000}, {32, 8, d}},
                                           {{5, 1, 130, 257}, {5, 1, 130, 257}, {8, 1, d}},
                                           {{10, 200}, {510, 300}, {8, 8, d}},
                                           {{1000}, {1000}, {8, 2, d, 300}}}) {
      // Every variant of step 6 (flash_configs), except on the large case (32 heads x 1000 tokens: the CPU
      // reference is the slow part), where the default and the baseline run.
      const FlashConfigList configs = flash_configs(d);
      const bool large = c.shape.n_heads >= 32;
      for (int i = 0; i < configs.size; ++i) {
        const FlashConfig& config = configs[i];
        if (large && i != 0 && &config != &flash_default_config(d, c.q_lens[0])) continue;
        const FlashCheck r = check_flash_wgmma(c.q_lens, c.k_lens, c.shape, seed, false, &config);
        report.add(r.ours);
        if (i == 0) report.add(r.lesson07);
        report.add_check(r.ours.name + ": every row written, nothing outside",
                         r.non_finite == 0 && r.written_outside == 0);
      }
      ++seed;
    }
  // Step 7: the same kernel over a paged pool (shuffled blocks of 8, 16 and 128; chunks after a prefix, a decode-
  // sized sequence, a prefix-cache hit), against lesson 12's CPU paged reference; lesson 12's GPU kernel beside it.
  for (int64_t d : {64, 128})
    for (int64_t bs : {8, 16, 128}) {
      const FlashCheck r = check_flash_wgmma_paged({77, 1, 200, 40}, {77, 300, 300, 556}, AttentionShape{8, 2, d},
                                                   bs, seed++, 2, 256);
      report.add(r.ours);
      report.add(r.lesson07);
      report.add_check(r.ours.name + ": every row written, nothing outside",
                       r.non_finite == 0 && r.written_outside == 0);
    }
  std::cout
      << "tolerances: copies and small-integer tiles exact; random tile 2^-12 row RMS + 2^-12 relative; "
         "GEMM 2^-12 row RMS + 2^-8 relative; flash attention lesson 07's (2^-8 + 1e-4) max|v| + the same "
         "relative (README: What correct means)\n";
  report.print(std::cout);
  return report.exit_code();
}

void run_bench(int64_t tokens) {
  const Ceilings ceilings = measure_ceilings(true);
  struct Shape {
    std::string name;
    int64_t m, n, k;
  };
  // Llama-3.2-1B's projections (hidden 2048, 32 q heads and 8 kv heads of 64, intermediate 8192), as the
  // engine packs them (q|k|v, gate|up), at `tokens` rows: sizes of the benchmark, not of the kernel.
  const std::vector<Shape> shapes = {{"4096x2048 . 2048x8192", 4096, 8192, 2048},
                                     {"1B qkv_proj", tokens, 3072, 2048},
                                     {"1B o_proj", tokens, 2048, 2048},
                                     {"1B gate|up_proj", tokens, 16384, 2048},
                                     {"1B down_proj", tokens, 2048, 8192}};
  CublasHandle handle;
  std::vector<BenchRow> rows;
  std::vector<std::string> summary;
  for (const Shape& s : shapes) {
    Tensor x = Tensor::empty({s.m, s.k}, DType::BF16, Device::CUDA);
    Tensor w = Tensor::empty({s.n, s.k}, DType::BF16, Device::CUDA);
    Tensor y = Tensor::empty({s.m, s.n}, DType::BF16, Device::CUDA);
    fill_uniform_bf16(x, 21);  // random values, never zeros (which run faster)
    fill_uniform_bf16(w, 22);
    const double flops = 2.0 * s.m * s.n * s.k;
    const double bytes = 2.0 * (s.m * s.k + s.n * s.k + s.m * s.n);
    BenchRow v1{s.name + " wgmma v1", bench_gpu([&] { gemm_wgmma(y, x, w); }), bytes, flops};
    BenchRow v2{s.name + " wgmma v2", bench_gpu([&] { gemm_wgmma_v2(y, x, w); }), bytes, flops};
    BenchRow cublas{s.name + " cuBLAS (06 v5)",
                    bench_gpu([&] { linear(y, x, w, MatmulKernel::V5Cublas, &handle); }), bytes, flops};
    const auto tflops = [&](const BenchRow& r) { return flops / (r.result.median_ms * 1e-3) / 1e12; };
    const auto percent = [&](const BenchRow& r) {
      return 100.0 * cublas.result.median_ms / r.result.median_ms;
    };
    char line[200];
    std::snprintf(line, sizeof line,
                  "%-24s wgmma v1 %6.1f TFLOP/s = %5.1f%% of cuBLAS, v2 %6.1f TFLOP/s = %5.1f%%",
                  s.name.c_str(), tflops(v1), percent(v1), tflops(v2), percent(v2));
    summary.push_back(line);
    rows.push_back(v1);
    rows.push_back(v2);
    rows.push_back(cublas);
  }
  print_bench_table(std::cout,
                    "y = x W^T, bf16 in/out, fp32 accumulation (T = " + std::to_string(tokens) + ")", rows,
                    ceilings);
  for (const std::string& s : summary) std::cout << s << "\n";
  std::printf(
      "target (issue 19): wgmma (v2) >= 90%% of cuBLAS on every shape; measured GEMM ceiling %.0f TFLOP/s\n",
      ceilings.bf16_tflops);

  // Step 8: the MLP's first half as the forward runs it, act = silu(x Wg^T) * (x Wu^T): cuBLAS (or v2) into
  // [T, 2I] then lesson 08's silu_mul, against the one kernel. Bytes: x, W and act, plus [T, 2I] written and
  // read back for the two-kernel rows.
  const int64_t i = 8192, k = 2048;
  Tensor x = Tensor::empty({tokens, k}, DType::BF16, Device::CUDA);
  Tensor w = Tensor::empty({2 * i, k}, DType::BF16, Device::CUDA);
  Tensor gate_up = Tensor::empty({tokens, 2 * i}, DType::BF16, Device::CUDA);
  Tensor act = Tensor::empty({tokens, i}, DType::BF16, Device::CUDA);
  fill_uniform_bf16(x, 23);
  fill_uniform_bf16(w, 24);
  const TensorView gate = gate_up.view().columns(0, i), up = gate_up.view().columns(i, i);
  const double flops = 2.0 * tokens * 2 * i * k;
  const double fused_bytes = 2.0 * (tokens * k + 2 * i * k + tokens * i);
  const double two_kernel_bytes = fused_bytes + 2.0 * 2 * (tokens * 2 * i);
  const std::vector<BenchRow> mlp{
      {"gate|up cuBLAS + silu_mul", bench_gpu([&] {
         linear(gate_up, x, w, MatmulKernel::V5Cublas, &handle);
         silu_mul(act, gate, up, handle.stream());
       }),
       two_kernel_bytes, flops},
      {"gate|up wgmma v2 + silu_mul", bench_gpu([&] {
         gemm_wgmma_v2(gate_up, x, w);
         silu_mul(act, gate, up);
       }),
       two_kernel_bytes, flops},
      {"gated MLP, one kernel (step 8)", bench_gpu([&] { gated_mlp_wgmma(act, x, w); }), fused_bytes, flops}};
  print_bench_table(std::cout, "act = silu(x Wg^T) * (x Wu^T), the 1B MLP at T = " + std::to_string(tokens), mlp,
                    ceilings);
  std::printf("gated MLP: one kernel %.1f us vs cuBLAS + silu_mul %.1f us (%.2fx)\n",
              mlp[2].result.median_ms * 1e3, mlp[0].result.median_ms * 1e3,
              mlp[0].result.median_ms / mlp[2].result.median_ms);
}

// One sequence of n tokens for the attention benchmarks: random bf16 q, k, v on the GPU, an output, the batch,
// and what a run moves and computes (lesson 07's FLOP count: causal pairs x 4 D x heads).
struct AttentionBenchCase {
  AttentionBenchCase(const AttentionShape& shape, int64_t n)
      : q(Tensor::empty({n, shape.q_dim()}, DType::BF16, Device::CUDA)),
        k(Tensor::empty({n, shape.kv_dim()}, DType::BF16, Device::CUDA)),
        v(Tensor::empty({n, shape.kv_dim()}, DType::BF16, Device::CUDA)),
        out(Tensor::empty({n, shape.q_dim()}, DType::BF16, Device::CUDA)),
        batch(AttentionBatch::prefill({n}, Device::CUDA)),
        flops(causal_attention_flops({n}, shape)),
        bytes(2.0 * n * (2.0 * shape.q_dim() + 2.0 * shape.kv_dim())) {  // q, k, v read, out written
    fill_uniform_bf16(q, 31);
    fill_uniform_bf16(k, 32);
    fill_uniform_bf16(v, 33);
    TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
  }
  Tensor q, k, v, out;
  AttentionBatch batch;
  double flops, bytes;
};

// Flash attention: causal GQA prefill of one sequence, 32 heads / 8 kv heads (Llama-3.2-1B's), head_dim 64
// and 128, n = 512 .. 16k; ours beside lesson 07's v2; FLOPs as lesson 07 counts them (causal pairs, 4 D
// each).
void run_attention_bench() {
  const Ceilings ceilings = measure_ceilings(true);
  std::vector<BenchRow> rows;
  std::vector<std::string> summary;
  for (int64_t d : {64, 128}) {
    const AttentionShape shape{32, 8, d};
    for (int64_t n = 512; n <= 16384; n *= 2) {
      const AttentionBenchCase in(shape, n);
      const Tensor &q = in.q, &k = in.k, &v = in.v, &out = in.out;
      const AttentionBatch& batch = in.batch;
      const double flops = in.flops, bytes = in.bytes;
      const std::string name = "d=" + std::to_string(d) + " n=" + std::to_string(n);
      const FlashConfig& def = flash_default_config(d, n);
      BenchRow ours{name + " wgmma " + def.name, bench_gpu([&] { flash_wgmma(out, q, k, v, batch, shape); }),
                    bytes, flops};
      const FlashConfig& base = flash_configs(d)[0];
      BenchRow pp{name + " wgmma " + base.name,
                  bench_gpu([&] { flash_wgmma(out, q, k, v, batch, shape, nullptr, base); }), bytes, flops};
      BenchRow v2{name + " lesson 07 v2",
                  bench_gpu([&] { attention(out, q, k, v, batch, shape, AttentionKernel::V2Flash); }), bytes,
                  flops};
      char line[200];
      const auto tflops = [&](const BenchRow& r) { return flops / (r.result.median_ms * 1e-3) / 1e12; };
      std::snprintf(line, sizeof line,
                    "attention %-14s wgmma default (%s) %6.1f TFLOP/s, baseline %6.1f, lesson 07 v2 %6.1f "
                    "(best x%.2f)",
                    name.c_str(), def.name, tflops(ours), tflops(pp), tflops(v2),
                    v2.result.median_ms / std::min(ours.result.median_ms, pp.result.median_ms));
      summary.push_back(line);
      rows.push_back(ours);
      rows.push_back(pp);
      rows.push_back(v2);
    }
  }
  print_bench_table(std::cout,
                    "causal GQA attention prefill, 32 / 8 heads (FLOPs: causal pairs x 4 D x heads)", rows,
                    ceilings);
  for (const std::string& s : summary) std::cout << s << "\n";
  std::printf(
      "target (issue 19): >= PyTorch SDPA from 1k to 16k, >= 545 TFLOP/s at 8k (head_dim 64); SDPA's "
      "figures: "
      "weights/tools/torch_kernel_baseline.py on the same GPU\n");
}

// Step 7: a chunk of n/2 queries after a cached prefix of n/2 keys (k_len = n), 32 / 8 heads, head_dim 64 and 128,
// n = 1k .. 16k: the paged wgmma kernel over shuffled blocks of 16, the contiguous wgmma kernel on the same shapes
// (packed k and v: what paging costs), and lesson 12's paged flash kernel (what the engine ran before). FLOPs as
// lesson 07 counts them: query i of the chunk sees n/2 + i + 1 keys.
void run_paged_attention_bench() {
  const Ceilings ceilings = measure_ceilings(true);
  std::vector<BenchRow> rows;
  std::vector<std::string> summary;
  constexpr int64_t kBlock = 16;
  for (int64_t d : {64, 128}) {
    const AttentionShape shape{32, 8, d};
    for (int64_t n = 1024; n <= 16384; n *= 2) {
      const int64_t q_len = n / 2, blocks = n / kBlock + 8;
      const Tensor q = Tensor::empty({q_len, shape.q_dim()}, DType::BF16, Device::CUDA);
      const Tensor out = Tensor::empty({q_len, shape.q_dim()}, DType::BF16, Device::CUDA);
      const Tensor k = Tensor::empty({n, shape.kv_dim()}, DType::BF16, Device::CUDA);
      const Tensor v = Tensor::empty({n, shape.kv_dim()}, DType::BF16, Device::CUDA);
      PagedKvPool pool(shape, 1, blocks, kBlock, Device::CUDA);
      fill_uniform_bf16(q, 41);
      fill_uniform_bf16(k, 42);
      fill_uniform_bf16(v, 43);
      fill_uniform_bf16(pool.k(0), 44);
      fill_uniform_bf16(pool.v(0), 45);
      // The sequence's blocks: a shuffled permutation of the pool (a long-running server's free list).
      std::vector<int32_t> order(static_cast<size_t>(blocks));
      for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
      Rng rng(46);
      for (size_t i = order.size() - 1; i > 0; --i)
        std::swap(order[i], order[rng.below(static_cast<int64_t>(i) + 1)]);
      order.resize(static_cast<size_t>(n / kBlock));
      std::vector<int32_t> slots;
      for (int64_t pos = n - q_len; pos < n; ++pos)
        slots.push_back(static_cast<int32_t>(order[static_cast<size_t>(pos / kBlock)] * kBlock + pos % kBlock));
      PagedStepTables tables(q_len, 1, n / kBlock, blocks, kBlock, Device::CUDA);
      tables.set(slots, {order});
      AttentionBatch batch(1, Device::CUDA);
      batch.set_lengths({q_len}, {n});
      TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
      const double pairs =
          static_cast<double>(q_len) * static_cast<double>(n - q_len) + 0.5 * q_len * (q_len + 1.0);
      const double flops = pairs * 4.0 * static_cast<double>(d) * static_cast<double>(shape.n_heads);
      const double bytes = 2.0 * (2.0 * q_len * shape.q_dim() + 2.0 * n * shape.kv_dim());
      const std::string name = "d=" + std::to_string(d) + " n=" + std::to_string(n) + " prefix " +
                               std::to_string(n - q_len);
      BenchRow paged{name + " wgmma paged (blocks of 16)",
                     bench_gpu([&] { flash_wgmma_paged(out, q, pool.k(0), pool.v(0), batch, tables, shape); }),
                     bytes, flops};
      BenchRow contiguous{name + " wgmma contiguous",
                          bench_gpu([&] { flash_wgmma(out, q, k, v, batch, shape); }), bytes, flops};
      BenchRow l12{name + " lesson 12 paged flash",
                   bench_gpu([&] {
                     paged_flash_attention_cuda(out, q, pool.k(0), pool.v(0), batch, tables, shape, nullptr);
                   }),
                   bytes, flops};
      const auto tflops = [&](const BenchRow& r) { return flops / (r.result.median_ms * 1e-3) / 1e12; };
      char line[240];
      std::snprintf(line, sizeof line,
                    "paged prefill %-22s wgmma paged %6.1f TFLOP/s, contiguous %6.1f (paged/contiguous %.2f), "
                    "lesson 12 %6.1f (x%.2f)",
                    name.c_str(), tflops(paged), tflops(contiguous),
                    contiguous.result.median_ms / paged.result.median_ms, tflops(l12),
                    l12.result.median_ms / paged.result.median_ms);
      summary.push_back(line);
      rows.push_back(paged);
      rows.push_back(contiguous);
      rows.push_back(l12);
    }
  }
  print_bench_table(std::cout,
                    "prefill over a cached prefix (q_len = n/2, k_len = n), 32 / 8 heads: paged vs contiguous vs "
                    "lesson 12",
                    rows, ceilings);
  for (const std::string& s : summary) std::cout << s << "\n";
}

// --sweep: every variant of step 6 (flash_configs) at n = 512 .. 16k, head_dim 64 and 128, the shape of the
// bench above; one row per (config, n), then per (d, n) the best config, and the FlashDefault tables that
// the measurement suggests (flash_wgmma.h: paste them there).
void run_attention_sweep() {
  const Ceilings ceilings = measure_ceilings(true);
  std::vector<BenchRow> rows;
  struct Best {
    int64_t d, n;
    int config;
    double tflops, baseline;
  };
  std::vector<Best> best;
  for (int64_t d : {64, 128}) {
    const AttentionShape shape{32, 8, d};
    const FlashConfigList configs = flash_configs(d);
    for (int64_t n = 512; n <= 16384; n *= 2) {
      const AttentionBenchCase in(shape, n);
      const Tensor &q = in.q, &k = in.k, &v = in.v, &out = in.out;
      const AttentionBatch& batch = in.batch;
      const double flops = in.flops, bytes = in.bytes;
      Best b{d, n, 0, 0.0, 0.0};
      for (int i = 0; i < configs.size; ++i) {
        const FlashConfig& c = configs[i];
        const std::string name = "d=" + std::to_string(d) + " n=" + std::to_string(n) + " " + c.name + " (" +
                                 std::to_string(flash_wgmma_blocks_per_sm(d, c)) + "/SM)";
        BenchRow row{name, bench_gpu([&] { flash_wgmma(out, q, k, v, batch, shape, nullptr, c); }), bytes,
                     flops};
        const double tflops = flops / (row.result.median_ms * 1e-3) / 1e12;
        if (i == 0) b.baseline = tflops;
        if (tflops > b.tflops) b.tflops = tflops, b.config = i;
        rows.push_back(row);
      }
      best.push_back(b);
    }
  }
  print_bench_table(std::cout,
                    "sweep: causal GQA attention prefill, 32 / 8 heads, every flash_configs() variant", rows,
                    ceilings);
  std::printf("sweep summary: the best variant per (head_dim, n), TFLOP/s, and x over the baseline (m128)\n");
  for (const Best& b : best)
    std::printf("  d=%-3lld n=%-6lld best %-14s %6.1f TFLOP/s  (baseline %6.1f, x%.2f)\n",
                static_cast<long long>(b.d), static_cast<long long>(b.n), flash_configs(b.d)[b.config].name,
                b.tflops, b.baseline, b.tflops / b.baseline);
  // The defaults this suggests: consecutive lengths with the same winner become one range.
  for (int64_t d : {64, 128}) {
    std::string table;
    for (size_t i = 0; i < best.size(); ++i) {
      if (best[i].d != d) continue;
      const bool last = i + 1 == best.size() || best[i + 1].d != d;
      if (!last && best[i + 1].config == best[i].config) continue;
      table += "{" + (last ? std::string("INT64_MAX") : std::to_string(best[i].n)) + ", " +
               std::to_string(best[i].config) + "}" + (last ? "" : ", ");
    }
    std::printf("suggested: inline constexpr FlashDefault kFlashDefaults%lld[] = {%s};\n",
                static_cast<long long>(d), table.c_str());
  }
}

}  // namespace

int main(int argc, char** argv) {
  LessonCli cli("lesson15_hopper",
                "Hopper's tensor cores: TMA, mbarriers, wgmma, clusters and a warp-specialised wgmma GEMM");
  bool sweep = false;
  cli.app().add_flag(
      "--sweep", sweep,
      "(CUDA) time every flash attention variant (flash_configs) at n = 512 .. 16k, head_dim 64 "
      "and 128, and name the best per length");
  return cli.run(argc, argv, [&](const LessonOptions& opt) {
    if (opt.device == Device::CPU) return check_cpu();
    if (!hopper_available()) {
      std::cout << "lesson15_hopper: skipped: " << hopper_unavailable_reason() << "\n";
      return kExitSkip;
    }
    const int rc = check_cuda();
    if (opt.bench) {
      run_bench(opt.bench_tokens_given ? opt.bench_tokens : 4096);
      run_attention_bench();
      run_paged_attention_bench();
    }
    if (sweep) run_attention_sweep();
    return rc;
  });
}
