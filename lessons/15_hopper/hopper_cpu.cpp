// Lesson 15: who may run the Hopper kernels, the arguments' checks, and the CPU oracles.
#include <cuda_runtime.h>

#include <cstdio>
#include <string>

#include "common/device.h"
#include "common/errors.h"
#include "hopper.h"

namespace tvllm {

// ---- availability -----------------------------------------------------------------------------------------

std::string hopper_unavailable_reason() {
#ifndef TVLLM_HOPPER_SM90A
  return "this build has no sm_90a code (CMAKE_CUDA_ARCHITECTURES does not include 90: configure with "
         "-DCMAKE_CUDA_ARCHITECTURES=90 or native on an H100/H200)";
#else
  if (!cuda_available()) return "no CUDA GPU";
  int device = 0;
  TVLLM_CUDA_CHECK(cudaGetDevice(&device));
  const DeviceProps p = query_device(device);
  if (p.compute_major != 9 || p.compute_minor != 0)
    return "lesson 15's kernels use sm_90a instructions (wgmma, setmaxnreg), which only a GPU of compute "
           "capability 9.0 runs (H100, H200); this one, " +
           p.name + ", is " + std::to_string(p.compute_major) + "." + std::to_string(p.compute_minor);
  return "";
#endif
}

bool hopper_available() {
  static const bool available = hopper_unavailable_reason().empty();
  return available;
}

void require_hopper(const char* what) {
  if (!hopper_available()) throw InputError(std::string(what) + ": " + hopper_unavailable_reason());
}

const char* tma_swizzle_name(TmaSwizzle swizzle) {
  return swizzle == TmaSwizzle::B128 ? "128-byte swizzle" : "no swizzle";
}

// ---- helpers ----------------------------------------------------------------------------------------------

namespace {

void require_matrix(const TensorView& t, const char* name, DType dtype, Device device, int64_t rows = -1,
                    int64_t cols = -1) {
  const std::string n = name;
  TVLLM_REQUIRE(t.rank() == 2, n + " must be a matrix, got " + t.describe());
  TVLLM_REQUIRE(t.dtype == dtype && t.device == device, n + " must be " + std::string(dtype_name(dtype)) +
                                                            " on " + std::string(device_name(device)) +
                                                            ", got " + t.describe());
  TVLLM_REQUIRE(t.is_contiguous(), n + " must be contiguous, got " + t.describe());
  TVLLM_REQUIRE(rows < 0 || t.dim(0) == rows,
                n + " must have " + std::to_string(rows) + " rows, got " + t.describe());
  TVLLM_REQUIRE(cols < 0 || t.dim(1) == cols,
                n + " must have " + std::to_string(cols) + " columns, got " + t.describe());
  TVLLM_REQUIRE(t.data != nullptr || t.numel() == 0, n + " has no data");
}

}  // namespace

// ---- step 1's oracle: the box, zeros outside the matrix ---------------------------------------------------

void tma_tile_copy_cpu(const TensorView& dst, const TensorView& src, int64_t row0, int64_t col0) {
  require_matrix(src, "src", DType::F32, Device::CPU);
  require_matrix(dst, "dst", DType::F32, Device::CPU);
  const int64_t rows = src.dim(0), cols = src.dim(1);
  const float* s = src.ptr<float>();
  float* d = dst.ptr<float>();
  for (int64_t r = 0; r < dst.dim(0); ++r)
    for (int64_t c = 0; c < dst.dim(1); ++c) {
      const int64_t sr = row0 + r, sc = col0 + c;
      const bool inside = sr >= 0 && sr < rows && sc >= 0 && sc < cols;
      d[r * dst.dim(1) + c] = inside ? s[sr * cols + sc] : 0.0f;
    }
}

// ---- step 2's oracle: one tile, double accumulation -------------------------------------------------------

void wgmma_tile_cpu(const TensorView& d, const TensorView& a, const TensorView& b, int k_first, int k_steps) {
  require_matrix(a, "a", DType::F32, Device::CPU, kTileM, kTileK);
  require_matrix(b, "b", DType::F32, Device::CPU, kTileN, kTileK);
  require_matrix(d, "d", DType::F32, Device::CPU, kTileM, kTileN);
  TVLLM_REQUIRE(k_first >= 0 && k_steps >= 1 && k_first + k_steps <= kTileK / 16,
                "wgmma_tile: the K slices [k_first, k_first + k_steps) must lie in [0, 4), got k_first " +
                    std::to_string(k_first) + ", k_steps " + std::to_string(k_steps));
  const float* pa = a.ptr<float>();
  const float* pb = b.ptr<float>();
  float* pd = d.ptr<float>();
  for (int m = 0; m < kTileM; ++m)
    for (int n = 0; n < kTileN; ++n) {
      double sum = 0.0;
      for (int k = 16 * k_first; k < 16 * (k_first + k_steps); ++k)
        sum += static_cast<double>(pa[m * kTileK + k]) * static_cast<double>(pb[n * kTileK + k]);
      pd[m * kTileN + n] = static_cast<float>(sum);
    }
}

// ---- step 3's oracle --------------------------------------------------------------------------------------

void cluster_exchange_cpu(const TensorView& out, const TensorView& values, int blocks, int cluster_blocks,
                          int shift) {
  TVLLM_REQUIRE(values.dtype == DType::F32 && values.device == Device::CPU && values.is_contiguous(),
                "cluster_exchange_cpu: values must be contiguous fp32 on the CPU, got " + values.describe());
  TVLLM_REQUIRE(out.dtype == DType::F32 && out.device == Device::CPU && out.is_contiguous() &&
                    out.numel() == values.numel(),
                "cluster_exchange_cpu: out must be contiguous fp32 on the CPU, shaped like values, got " +
                    out.describe());
  TVLLM_REQUIRE(
      blocks >= 1 && cluster_blocks >= 1 && blocks % cluster_blocks == 0 && values.numel() % blocks == 0,
      "cluster_exchange_cpu: blocks must be a multiple of cluster_blocks and divide the values");
  const int64_t n = values.numel() / blocks;
  const float* v = values.ptr<float>();
  float* o = out.ptr<float>();
  for (int b = 0; b < blocks; ++b) {
    const int first = b / cluster_blocks * cluster_blocks;  // the first block of b's cluster
    const int rank = b - first;
    const int source = first + ((rank + shift) % cluster_blocks + cluster_blocks) % cluster_blocks;
    for (int64_t i = 0; i < n; ++i) o[b * n + i] = v[source * n + i];
  }
}

// ---- step 4's checks (the oracle is lesson 06's linear() on the CPU) --------------------------------------

void check_gemm_wgmma_args(const TensorView& y, const TensorView& x, const TensorView& w) {
  require_matrix(x, "gemm_wgmma: x", DType::BF16, Device::CUDA);
  require_matrix(w, "gemm_wgmma: w", DType::BF16, Device::CUDA);
  const int64_t m = x.dim(0), k = x.dim(1), n = w.dim(0);
  require_matrix(y, "gemm_wgmma: y", DType::BF16, Device::CUDA, m, n);
  TVLLM_REQUIRE(m >= 1 && n >= 1,
                "gemm_wgmma: M and N must be at least 1, got " + x.describe() + " and " + w.describe());
  TVLLM_REQUIRE(w.dim(1) == k, "gemm_wgmma: x and w must have the same K (columns), got " + x.describe() +
                                   " and " + w.describe());
  TVLLM_REQUIRE(k >= kGemmBlockK && k % kGemmBlockK == 0,
                "gemm_wgmma: K must be a positive multiple of " + std::to_string(kGemmBlockK) +
                    " (one TMA box of 128 bytes per row and stage), got K = " + std::to_string(k) +
                    "; lesson 06's linear() takes any K");
  TVLLM_REQUIRE(m < (int64_t{1} << 31) && n < (int64_t{1} << 31), "gemm_wgmma: M and N must be below 2^31");
  for (const TensorView* t : {&y, &x, &w})
    TVLLM_REQUIRE(reinterpret_cast<uintptr_t>(t->data) % 16 == 0,
                  "gemm_wgmma: every matrix must start on a 16-byte boundary, got " + t->describe());
  const auto* y0 = static_cast<const char*>(y.data);
  const auto* y1 = y0 + y.nbytes();
  for (const TensorView* t : {&x, &w}) {
    const auto* t0 = static_cast<const char*>(t->data);
    TVLLM_REQUIRE(y1 <= t0 || t0 + t->nbytes() <= y0, "gemm_wgmma: y must not overlap x or w");
  }
}

void check_gated_mlp_args(const TensorView& act, const TensorView& x, const TensorView& w_gate_up) {
  require_matrix(x, "gated_mlp_wgmma: x", DType::BF16, Device::CUDA);
  require_matrix(w_gate_up, "gated_mlp_wgmma: w_gate_up", DType::BF16, Device::CUDA);
  const int64_t m = x.dim(0), k = x.dim(1), two_i = w_gate_up.dim(0);
  TVLLM_REQUIRE(two_i % 2 == 0, "gated_mlp_wgmma: w_gate_up must hold gate rows then as many up rows (2I rows), got " +
                                    w_gate_up.describe());
  const int64_t i = two_i / 2;
  require_matrix(act, "gated_mlp_wgmma: act", DType::BF16, Device::CUDA, m, i);
  // GEMM v2's rules (M, K, alignment, overlap), then act's own: I % 8 for its TMA store.
  TVLLM_REQUIRE(m >= 1 && i >= 1, "gated_mlp_wgmma: M and I must be at least 1, got " + x.describe() + " and " +
                                      w_gate_up.describe());
  TVLLM_REQUIRE(w_gate_up.dim(1) == k, "gated_mlp_wgmma: x and w_gate_up must have the same K (columns), got " +
                                           x.describe() + " and " + w_gate_up.describe());
  TVLLM_REQUIRE(k >= kGemmBlockK && k % kGemmBlockK == 0,
                "gated_mlp_wgmma: K must be a positive multiple of " + std::to_string(kGemmBlockK) + ", got K = " +
                    std::to_string(k) + "; project_gate_up + silu_mul take any K");
  TVLLM_REQUIRE(i % 8 == 0, "gated_mlp_wgmma: I (act's columns) must be a multiple of 8 (TMA stores act's rows, "
                            "16-byte pitches), got I = " + std::to_string(i));
  TVLLM_REQUIRE(m < (int64_t{1} << 31) && i < (int64_t{1} << 31), "gated_mlp_wgmma: M and I must be below 2^31");
  for (const TensorView* t : {&act, &x, &w_gate_up})
    TVLLM_REQUIRE(reinterpret_cast<uintptr_t>(t->data) % 16 == 0,
                  "gated_mlp_wgmma: every matrix must start on a 16-byte boundary, got " + t->describe());
  const auto* a0 = static_cast<const char*>(act.data);
  const auto* a1 = a0 + act.nbytes();
  for (const TensorView* t : {&x, &w_gate_up}) {
    const auto* t0 = static_cast<const char*>(t->data);
    TVLLM_REQUIRE(a1 <= t0 || t0 + t->nbytes() <= a0, "gated_mlp_wgmma: act must not overlap x or w_gate_up");
  }
}

}  // namespace tvllm
