// Lesson 15: the steps against their oracles (hopper_check.h).
#include "hopper_check.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <set>
#include <string>

#include "common/dtype.h"
#include "common/errors.h"
#include "common/random.h"
#include "hopper_layout.h"
#include "matmul.h"
#include "matmul_check.h"
#include "silu_mul.h"  // lesson 08: the unfused kernel step 8 must equal, and silu_f32 for the oracle

namespace tvllm {
namespace {

// Random values that bf16 holds exactly, so the GPU (bf16) and the oracle (fp32) see the same numbers.
std::vector<float> bf16_exact(std::vector<float> v) {
  for (float& x : v) x = bf16_to_f32(f32_to_bf16(x));
  return v;
}

// Integers in [-8, 8]: exact in bf16, and every sum of 64 of their products is an exact fp32 integer.
std::vector<float> small_integers(size_t n, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(rng.below(17) - 8);
  return v;
}

// A GPU output filled with 0xFF bytes: NaN in bf16 and fp32, so an element the kernel forgets fails.
Tensor poisoned(Shape shape, DType dtype) {
  Tensor t = Tensor::empty(std::move(shape), dtype, Device::CUDA);
  TVLLM_CUDA_CHECK(cudaMemset(t.data(), 0xFF, t.view().nbytes()));
  return t;
}

std::string dims(int64_t a, int64_t b) { return std::to_string(a) + "x" + std::to_string(b); }

}  // namespace

CompareResult check_tma_tile(int64_t rows, int64_t cols, int64_t row0, int64_t col0, int64_t box_rows,
                             int64_t box_cols, TmaSwizzle swizzle, uint64_t seed) {
  const std::vector<float> values =
      bf16_exact(random_uniform(static_cast<size_t>(rows * cols), seed, -4.f, 4.f));
  const Tensor src = Tensor::from_f32(values, {rows, cols}, DType::BF16, Device::CUDA);
  const Tensor dst = poisoned({box_rows, box_cols}, DType::BF16);
  tma_tile_copy(dst, src, row0, col0, swizzle);
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());

  const Tensor src_cpu = Tensor::from_f32(values, {rows, cols}, DType::F32, Device::CPU);
  const Tensor expected = Tensor::empty({box_rows, box_cols}, DType::F32, Device::CPU);
  tma_tile_copy_cpu(expected, src_cpu, row0, col0);
  return compare("TMA " + std::string(tma_swizzle_name(swizzle)) + ": box " + dims(box_rows, box_cols) +
                     " at (" + std::to_string(row0) + ", " + std::to_string(col0) + ") of " +
                     dims(rows, cols),
                 dst, expected, Tolerance{0.0, 0.0});
}

CompareResult check_wgmma_tile(int k_first, int k_steps, bool integers, uint64_t seed) {
  const size_t na = kTileM * kTileK, nb = kTileN * kTileK;
  const std::vector<float> a = integers ? small_integers(na, seed) : bf16_exact(random_uniform(na, seed));
  const std::vector<float> b =
      integers ? small_integers(nb, seed + 1) : bf16_exact(random_uniform(nb, seed + 1));
  const Tensor a_dev = Tensor::from_f32(a, {kTileM, kTileK}, DType::BF16, Device::CUDA);
  const Tensor b_dev = Tensor::from_f32(b, {kTileN, kTileK}, DType::BF16, Device::CUDA);
  const Tensor d = poisoned({kTileM, kTileN}, DType::F32);
  wgmma_tile(d, a_dev, b_dev, k_first, k_steps);
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());

  const Tensor expected = Tensor::empty({kTileM, kTileN}, DType::F32, Device::CPU);
  wgmma_tile_cpu(expected, Tensor::from_f32(a, {kTileM, kTileK}, DType::F32, Device::CPU),
                 Tensor::from_f32(b, {kTileN, kTileK}, DType::F32, Device::CPU), k_first, k_steps);
  const std::string name = std::string("wgmma tile 64x128, K slices ") + std::to_string(k_first) + ".." +
                           std::to_string(k_first + k_steps - 1) +
                           (integers ? ", small integers" : ", random");
  if (integers) return compare(name, d, expected, Tolerance{0.0, 0.0});
  return compare_rows(name, d, expected, kF32OutVsCpu);
}

CompareResult check_cluster_exchange(int blocks, int cluster_blocks, int shift, int per_block,
                                     uint64_t seed) {
  const std::vector<float> values = random_uniform(static_cast<size_t>(blocks) * per_block, seed);
  const Tensor v = Tensor::from_f32(values, {blocks, per_block}, DType::F32, Device::CUDA);
  const Tensor out = poisoned({blocks, per_block}, DType::F32);
  cluster_exchange(out, v, blocks, cluster_blocks, shift);
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
  const Tensor expected = Tensor::empty({blocks, per_block}, DType::F32, Device::CPU);
  cluster_exchange_cpu(expected, Tensor::from_f32(values, {blocks, per_block}, DType::F32, Device::CPU),
                       blocks, cluster_blocks, shift);
  return compare("cluster of " + std::to_string(cluster_blocks) + ": " + std::to_string(blocks) +
                     " blocks read rank + " + std::to_string(shift),
                 out, expected, Tolerance{0.0, 0.0});
}

void run_gemm_wgmma(int version, const TensorView& y, const TensorView& x, const TensorView& w,
                    cudaStream_t stream) {
  TVLLM_REQUIRE(version == 1 || version == 2,
                "run_gemm_wgmma: version must be 1 or 2, got " + std::to_string(version));
  if (version == 1)
    gemm_wgmma(y, x, w, stream);
  else
    gemm_wgmma_v2(y, x, w, stream);
}

CompareResult check_gemm_wgmma(int64_t m, int64_t n, int64_t k, uint64_t seed, bool check_guards,
                               int version) {
  const std::vector<float> x = bf16_exact(random_uniform(static_cast<size_t>(m * k), seed));
  const std::vector<float> w = bf16_exact(
      random_normal(static_cast<size_t>(n * k), seed + 1, 1.0f / std::sqrt(static_cast<float>(k))));
  const Tensor x_dev = Tensor::from_f32(x, {m, k}, DType::BF16, Device::CUDA);
  const Tensor w_dev = Tensor::from_f32(w, {n, k}, DType::BF16, Device::CUDA);
  const Tensor y_buf = poisoned({m + 1, n}, DType::BF16);  // one row past the end: must stay NaN
  const TensorView y = y_buf.view().rows(0, m);
  run_gemm_wgmma(version, y, x_dev, w_dev);
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());

  const Tensor expected = Tensor::empty({m, n}, DType::F32, Device::CPU);
  linear(expected, Tensor::from_f32(x, {m, k}, DType::F32, Device::CPU),
         Tensor::from_f32(w, {n, k}, DType::F32, Device::CPU));  // lesson 06's oracle: double sums
  CompareResult r =
      compare_rows("wgmma GEMM v" + std::to_string(version) + " " + dims(m, k) + " . " + dims(k, n), y,
                   expected, kBf16OutVsCpu);
  if (check_guards) {
    std::vector<uint16_t> past(static_cast<size_t>(n));
    TVLLM_CUDA_CHECK(
        cudaMemcpy(past.data(), y_buf.view().rows(m, 1).data, past.size() * 2, cudaMemcpyDeviceToHost));
    int64_t written = 0;
    for (uint16_t bits : past) written += bits != 0xFFFF;
    if (written > 0 && r.error.empty())
      r.error = std::to_string(written) + " element(s) written past row M - 1 (the store guard)";
  }
  return r;
}

CompareResult check_gated_mlp_wgmma(int64_t m, int64_t i, int64_t k, uint64_t seed, bool cpu_oracle) {
  const std::vector<float> x = bf16_exact(random_uniform(static_cast<size_t>(m * k), seed));
  const std::vector<float> w = bf16_exact(
      random_normal(static_cast<size_t>(2 * i * k), seed + 1, 1.0f / std::sqrt(static_cast<float>(k))));
  const Tensor x_dev = Tensor::from_f32(x, {m, k}, DType::BF16, Device::CUDA);
  const Tensor w_dev = Tensor::from_f32(w, {2 * i, k}, DType::BF16, Device::CUDA);
  const Tensor act_buf = poisoned({m + 1, i}, DType::BF16);  // one row past the end: must stay NaN
  const TensorView act = act_buf.view().rows(0, m);
  gated_mlp_wgmma(act, x_dev, w_dev);
  // (b) the unfused path on the GPU: GEMM v2 into [m, 2i], then silu_mul over its two column halves.
  const Tensor gate_up = poisoned({m, 2 * i}, DType::BF16);
  const Tensor unfused = poisoned({m, i}, DType::BF16);
  gemm_wgmma_v2(gate_up, x_dev, w_dev);
  silu_mul(unfused, gate_up.view().columns(0, i), gate_up.view().columns(i, i));
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());

  const std::string name = "gated MLP " + dims(m, k) + " . " + dims(k, 2 * i) + " -> " + dims(m, i);
  CompareResult r;
  if (cpu_oracle) {  // (a)
    const Tensor exact = Tensor::empty({m, 2 * i}, DType::F32, Device::CPU);
    linear(exact, Tensor::from_f32(x, {m, k}, DType::F32, Device::CPU),
           Tensor::from_f32(w, {2 * i, k}, DType::F32, Device::CPU));
    std::vector<float> expected(static_cast<size_t>(m * i));
    const float* sums = exact.view().ptr<const float>();
    const auto bf16 = [](float v) { return bf16_to_f32(f32_to_bf16(v)); };
    for (int64_t t = 0; t < m; ++t)
      for (int64_t j = 0; j < i; ++j) {
        const float g = bf16(sums[t * 2 * i + j]), u = bf16(sums[t * 2 * i + i + j]);
        expected[static_cast<size_t>(t * i + j)] = bf16(silu_f32(g)) * u;
      }
    r = compare_rows(name, act, Tensor::from_f32(expected, {m, i}, DType::F32, Device::CPU), kGatedMlpVsCpu);
  } else {
    r.name = name;
    r.count = m * i;
  }
  std::vector<uint16_t> got(static_cast<size_t>(m * i)), want(got.size()), past(static_cast<size_t>(i));
  TVLLM_CUDA_CHECK(cudaMemcpy(got.data(), act.data, got.size() * 2, cudaMemcpyDeviceToHost));
  TVLLM_CUDA_CHECK(cudaMemcpy(want.data(), unfused.data(), want.size() * 2, cudaMemcpyDeviceToHost));
  TVLLM_CUDA_CHECK(cudaMemcpy(past.data(), act_buf.view().rows(m, 1).data, past.size() * 2, cudaMemcpyDeviceToHost));
  int64_t differ = 0, written = 0;
  for (size_t e = 0; e < got.size(); ++e) differ += got[e] != want[e];
  for (uint16_t bits : past) written += bits != 0xFFFF;
  if (differ > 0 && r.error.empty())
    r.error = std::to_string(differ) + " element(s) differ in their bits from GEMM v2 + silu_mul";
  if (written > 0 && r.error.empty())
    r.error = std::to_string(written) + " element(s) written past row M - 1 (the store guard)";
  return r;
}

int64_t gated_mlp_batch_variant_rows(int64_t m, int64_t i, int64_t k, const std::vector<int64_t>& rows,
                                     uint64_t seed) {
  const std::vector<float> x = bf16_exact(random_uniform(static_cast<size_t>(m * k), seed));
  const std::vector<float> w = bf16_exact(
      random_normal(static_cast<size_t>(2 * i * k), seed + 1, 1.0f / std::sqrt(static_cast<float>(k))));
  const Tensor x_dev = Tensor::from_f32(x, {m, k}, DType::BF16, Device::CUDA);
  const Tensor w_dev = Tensor::from_f32(w, {2 * i, k}, DType::BF16, Device::CUDA);
  const Tensor all_dev = poisoned({m, i}, DType::BF16);
  const Tensor one_dev = poisoned({1, i}, DType::BF16);
  gated_mlp_wgmma(all_dev, x_dev, w_dev);
  std::vector<uint16_t> all(static_cast<size_t>(m * i)), one(static_cast<size_t>(i));
  TVLLM_CUDA_CHECK(cudaMemcpy(all.data(), all_dev.data(), all.size() * 2, cudaMemcpyDeviceToHost));
  int64_t differing = 0;
  for (int64_t r : rows) {
    TVLLM_REQUIRE(r >= 0 && r < m, "gated_mlp_batch_variant_rows: row " + std::to_string(r) + " outside M = " +
                                       std::to_string(m));
    gated_mlp_wgmma(one_dev, x_dev.view().rows(r, 1), w_dev);  // the same row, alone in its batch
    TVLLM_CUDA_CHECK(cudaMemcpy(one.data(), one_dev.data(), one.size() * 2, cudaMemcpyDeviceToHost));
    differing += !std::equal(one.begin(), one.end(), all.begin() + r * i);
  }
  return differing;
}

const std::vector<GemmShape>& gemm_check_shapes() {
  static const std::vector<GemmShape> shapes = {
      {128, 128, 64},    // one tile, one stage
      {1, 128, 64},      // a single row: 127 rows of the box are TMA's zeros
      {256, 256, 512},   // 8 K steps: the ring of 4 stages goes round twice
      {100, 200, 320},   // M and N not multiples of the tile; 5 K steps (not a multiple of the stages)
      {333, 131, 1024},  // odd N: the unpaired stores
      {17, 1000, 2048},  // a prefill-chunk-like short M with a long K
      {1024, 768, 768},  // many tiles
  };
  return shapes;
}

const std::vector<GemmShape>& gemm_v2_check_shapes() {
  static const std::vector<GemmShape> shapes = [] {
    std::vector<GemmShape> v = gemm_check_shapes();
    v.push_back({129, 264, 192});    // N = 256 + 8: a second tile column with one partial 64-column chunk
    v.push_back({300, 1030, 128});   // N even, not a multiple of 8: the register epilogue, in pairs
    v.push_back({2, 8, 64});         // the smallest TMA-store N; M = 2 (warpgroup 1 has no rows)
    v.push_back({1, 4096, 512});     // M = 1 across 16 tile columns (decode-like)
    v.push_back({4100, 2304, 256});  // 33 x 9 = 297 tiles: > 2 rounds of the persistent loop on 132 SMs
    return v;
  }();
  return shapes;
}

int64_t gemm_batch_variant_rows(int version, int64_t m, int64_t n, int64_t k,
                                const std::vector<int64_t>& rows, uint64_t seed) {
  const std::vector<float> x = bf16_exact(random_uniform(static_cast<size_t>(m * k), seed));
  const std::vector<float> w = bf16_exact(
      random_normal(static_cast<size_t>(n * k), seed + 1, 1.0f / std::sqrt(static_cast<float>(k))));
  const Tensor x_dev = Tensor::from_f32(x, {m, k}, DType::BF16, Device::CUDA);
  const Tensor w_dev = Tensor::from_f32(w, {n, k}, DType::BF16, Device::CUDA);
  const Tensor y_all = poisoned({m, n}, DType::BF16);
  const Tensor y_one = poisoned({1, n}, DType::BF16);
  run_gemm_wgmma(version, y_all, x_dev, w_dev);
  std::vector<uint16_t> all(static_cast<size_t>(m * n)), one(static_cast<size_t>(n));
  TVLLM_CUDA_CHECK(cudaMemcpy(all.data(), y_all.data(), all.size() * 2, cudaMemcpyDeviceToHost));
  int64_t differing = 0;
  for (int64_t r : rows) {
    TVLLM_REQUIRE(r >= 0 && r < m,
                  "gemm_batch_variant_rows: row " + std::to_string(r) + " outside M = " + std::to_string(m));
    run_gemm_wgmma(version, y_one, x_dev.view().rows(r, 1), w_dev);  // the same row, alone in its batch
    TVLLM_CUDA_CHECK(cudaMemcpy(one.data(), y_one.data(), one.size() * 2, cudaMemcpyDeviceToHost));
    differing += !std::equal(one.begin(), one.end(), all.begin() + r * n);
  }
  return differing;
}

// ---- the CPU's own checks ---------------------------------------------------------------------------------

void add_oracle_checks(Report& report) {
  {  // The swizzle: within each 1024-byte atom, a permutation of the 16-byte chunks that keeps each 128-byte
     // row.
    bool ok = true;
    std::set<uint32_t> seen;
    for (uint32_t chunk = 0; chunk < 64; ++chunk) {
      const uint32_t to = swizzle128(chunk * 16);
      ok = ok && to % 16 == 0 && to / 128 == chunk / 8 &&
           swizzle128(to) == chunk * 16;  // it is its own inverse
      seen.insert(to);
    }
    ok = ok && seen.size() == 64 && swizzled_offset_bf16(0, 0) == 0 &&
         swizzled_offset_bf16(1, 0) == 128 + 16 &&
         swizzled_offset_bf16(7, 63) == 7 * 128 + (7 ^ 7) * 16 + 14 &&
         swizzled_offset_bf16(9, 8) == 9 * 128 + 0;
    report.add_check("128-byte swizzle: a permutation of each 1024-byte atom, row by row", ok);
  }
  {  // The descriptor's fields.
    const uint64_t d = encode_smem_descriptor(0x1230, 16, 1024, DescriptorSwizzle::B128);
    const bool ok = (d & 0x3FFF) == 0x123 && ((d >> 16) & 0x3FFF) == 1 && ((d >> 32) & 0x3FFF) == 64 &&
                    ((d >> 62) & 3) == 1 && ((d >> 14) & 3) == 0 && ((d >> 30) & 3) == 0 &&
                    ((d >> 46) & 0xFFFF) == 0 &&
                    sw128_kmajor_descriptor(0x400, 3) - sw128_kmajor_descriptor(0x400, 0) == 6;
    report.add_check("wgmma descriptor: address, LBO, SBO and swizzle on bits 0, 16, 32 and 62", ok);
  }
  {  // GEMM v2's grouped tile order: a permutation of the tiles, for bands that divide tiles_m and not.
    bool ok = true;
    for (const auto& [tm, tn, g] :
         std::vector<std::array<uint32_t, 3>>{{5, 3, 2}, {32, 32, 8}, {33, 9, 8}, {1, 16, 8}, {7, 1, 8}}) {
      std::vector<int> hits(tm * tn, 0);
      for (uint32_t tile = 0; tile < tm * tn; ++tile) {
        const GemmTile at = grouped_tile(tile, tm, tn, g);
        if (at.m < tm && at.n < tn) ++hits[at.m * tn + at.n];
      }
      for (int h : hits) ok = ok && h == 1;
    }
    // The picture in hopper_layout.h: tile 9 of 5 x 3 in bands of 2 is (row 3, column 1); 13 is (4, 1).
    ok = ok && grouped_tile(9, 5, 3, 2).m == 3 && grouped_tile(9, 5, 3, 2).n == 1 &&
         grouped_tile(13, 5, 3, 2).m == 4 && grouped_tile(13, 5, 3, 2).n == 1;
    report.add_check("GEMM v2 grouped tile order: every tile exactly once, the chapter's picture", ok);
  }
  {  // The fragment layout: 128 threads x 64 registers cover the 64 x 128 tile exactly once.
    std::vector<int> hits(kTileM * kTileN, 0);
    for (uint32_t t = 0; t < 128; ++t)
      for (uint32_t i = 0; i < 64; ++i) {
        const FragmentPosition p = accumulator_position(t, i);
        if (p.row < kTileM && p.col < kTileN) ++hits[p.row * kTileN + p.col];
      }
    bool ok = true;
    for (int h : hits) ok = ok && h == 1;
    report.add_check(
        "wgmma accumulator layout: every element of 64 x 128 held by exactly one (thread, register)", ok);
  }
  {  // v2's m64n256k16: 128 registers cover 64 x 256 once, and registers 32c .. 32c + 31 are exactly columns
     // 64c .. 64c + 63 (the epilogue's chunk c), each even register's pair the next column of the same row.
    std::vector<int> hits(64 * 256, 0);
    bool ok = true;
    for (uint32_t t = 0; t < 128; ++t)
      for (uint32_t i = 0; i < 128; ++i) {
        const FragmentPosition p = accumulator_position(t, i);
        ok = ok && p.row < 64 && p.col < 256 && p.col / 64 == i / 32;
        if (i % 2 == 1) {
          const FragmentPosition q = accumulator_position(t, i - 1);
          ok = ok && q.row == p.row && q.col + 1 == p.col && q.col % 2 == 0;
        }
        if (p.row < 64 && p.col < 256) ++hits[p.row * 256 + p.col];
      }
    for (int h : hits) ok = ok && h == 1;
    report.add_check("wgmma m64n256 layout: 64 x 256 once; registers 32c..32c+31 = columns 64c..64c+63", ok);
  }
  {  // The tile oracle against lesson 06's linear() on the same slice.
    const std::vector<float> a = bf16_exact(random_uniform(kTileM * kTileK, 7));
    const std::vector<float> b = bf16_exact(random_uniform(kTileN * kTileK, 8));
    const Tensor d = Tensor::empty({kTileM, kTileN}, DType::F32, Device::CPU);
    wgmma_tile_cpu(d, Tensor::from_f32(a, {kTileM, kTileK}, DType::F32, Device::CPU),
                   Tensor::from_f32(b, {kTileN, kTileK}, DType::F32, Device::CPU), 1, 2);
    std::vector<float> a_slice, b_slice;  // columns 16 .. 47
    for (int r = 0; r < kTileM; ++r) a_slice.insert(a_slice.end(), &a[r * kTileK + 16], &a[r * kTileK + 48]);
    for (int r = 0; r < kTileN; ++r) b_slice.insert(b_slice.end(), &b[r * kTileK + 16], &b[r * kTileK + 48]);
    const Tensor expected = Tensor::empty({kTileM, kTileN}, DType::F32, Device::CPU);
    linear(expected, Tensor::from_f32(a_slice, {kTileM, 32}, DType::F32, Device::CPU),
           Tensor::from_f32(b_slice, {kTileN, 32}, DType::F32, Device::CPU));
    report.add(compare("wgmma tile oracle (slices 1..2) vs lesson 06's linear() on columns 16..47", d,
                       expected, Tolerance{0.0, 0.0}));
  }
  {  // The TMA oracle: a box over the corner of a 5 x 8 matrix of 1..40, at (-1, 4), 4 x 8: zeros outside.
    std::vector<float> src(40);
    for (int i = 0; i < 40; ++i) src[i] = static_cast<float>(i + 1);
    const Tensor d = Tensor::empty({4, 8}, DType::F32, Device::CPU);
    tma_tile_copy_cpu(d, Tensor::from_f32(src, {5, 8}, DType::F32, Device::CPU), -1, 4);
    std::vector<float> want(32, 0.0f);
    for (int r = 1; r < 4; ++r)
      for (int c = 0; c < 4; ++c) want[r * 8 + c] = static_cast<float>((r - 1) * 8 + 4 + c + 1);
    report.add(compare("TMA oracle: a box over the top-right corner, zeros outside", d,
                       Tensor::from_f32(want, {4, 8}, DType::F32, Device::CPU), Tolerance{0.0, 0.0}));
  }
  {  // The exchange oracle: 2 clusters of 4 blocks, shift 1: block b reads block (b + 1) within its cluster.
    std::vector<float> v(8);
    for (int i = 0; i < 8; ++i) v[i] = static_cast<float>(i);
    const Tensor out = Tensor::empty({8, 1}, DType::F32, Device::CPU);
    cluster_exchange_cpu(out, Tensor::from_f32(v, {8, 1}, DType::F32, Device::CPU), 8, 4, 1);
    const std::vector<float> want = {1, 2, 3, 0, 5, 6, 7, 4};
    report.add(compare("cluster exchange oracle: rank r reads rank r + 1 of its cluster", out,
                       Tensor::from_f32(want, {8, 1}, DType::F32, Device::CPU), Tolerance{0.0, 0.0}));
  }
}

}  // namespace tvllm
