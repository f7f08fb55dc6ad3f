// Lesson 14, the host side of the GEMVs: argument checks, dispatch, and the references.
//
// The references sum in double and round once, so their own error is far below anything a kernel's fp32
// sum can show; every bf16 rounding the GPU makes on purpose (the normalised x, gate and up, silu, the
// residual's product) they make too, with the host's round-to-nearest-even (common/dtype.h).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/errors.h"
#include "gemv.h"
#include "rope.h"
#include "silu_mul.h"  // silu_f32: lesson 08's reference silu

namespace tvllm {

namespace {

float round_bf16(float v) { return bf16_to_f32(f32_to_bf16(v)); }

// [begin, end) bytes of a contiguous view.
bool overlaps(const TensorView& a, const TensorView& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  const auto a0 = reinterpret_cast<uintptr_t>(a.data), b0 = reinterpret_cast<uintptr_t>(b.data);
  return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

bool activation_dtype_ok(const TensorView& t) {
  return t.device == Device::CPU ? (t.dtype == DType::BF16 || t.dtype == DType::F32) : t.dtype == DType::BF16;
}

// w_scale beside w: F32 [N] (or [N, 1], as checkpoints store it) on w's device when w is F8_E4M3, else empty.
void check_weight_scale(const std::string& what, const TensorView& w, const TensorView& w_scale) {
  if (w.dtype != DType::F8_E4M3) {
    TVLLM_REQUIRE(w_scale.data == nullptr,
                  what + ": w_scale " + w_scale.describe() + " given for " + w.describe() +
                      " weights (scales belong to F8_E4M3 weights only)");
    return;
  }
  const int64_t N = w.shape[0];
  const bool shape_ok = (w_scale.rank() == 1 && w_scale.shape[0] == N) ||
                        (w_scale.rank() == 2 && w_scale.shape[0] == N && w_scale.shape[1] == 1);
  TVLLM_REQUIRE(shape_ok && w_scale.dtype == DType::F32 && w_scale.is_contiguous() && w_scale.device == w.device &&
                    w_scale.data != nullptr,
                what + ": F8_E4M3 weights " + w.describe() + " need w_scale F32 [" + std::to_string(N) +
                    "] (one scale per row) on their device, got " + w_scale.describe());
}

// The checks every entry point shares. halve_n: out has I = N / 2 columns (the gate|up product), else N.
// out_f32_ok: whether out may be F32 on the GPU (gemv, rmsnorm_gemv: the logits).
GemvDims check_operands(const std::string& what, const TensorView& out, const TensorView& x,
                        const TensorView& w, bool halve_n, bool out_f32_ok, const TensorView& w_scale = {}) {
  TVLLM_REQUIRE(x.rank() == 2, what + ": x must be [M, K], got " + x.describe());
  TVLLM_REQUIRE(w.rank() == 2, what + ": w must be [N, K], got " + w.describe());
  const int64_t M = x.shape[0], K = x.shape[1], N = w.shape[0];
  TVLLM_REQUIRE(K >= 1 && N >= 1, what + ": empty x " + x.describe() + " or w " + w.describe());
  TVLLM_REQUIRE(w.shape[1] == K,
                what + ": w " + w.describe() + " must have x's " + std::to_string(K) + " columns");
  TVLLM_REQUIRE(M <= kGemvMaxRows, what + ": at most " + std::to_string(kGemvMaxRows) + " rows, got x " +
                                       x.describe() + " (use lesson 06's linear() for more)");
  if (halve_n) TVLLM_REQUIRE(N % 2 == 0, what + ": w " + w.describe() + " must have 2I rows (gate | up)");
  const int64_t cols = halve_n ? N / 2 : N;
  TVLLM_REQUIRE(out.rank() == 2 && out.shape[0] == M && out.shape[1] == cols,
                what + ": out must be " + shape_str({M, cols}) + ", got " + out.describe());
  TVLLM_REQUIRE(x.is_contiguous() && w.is_contiguous() && out.is_contiguous(),
                what + ": x, w and out must be contiguous");
  TVLLM_REQUIRE(x.device == w.device && out.device == w.device,
                what + ": x " + x.describe() + ", w " + w.describe() + " and out " + out.describe() +
                    " must be on one device");
  const bool gpu = w.device != Device::CPU;
  TVLLM_REQUIRE(activation_dtype_ok(x) && (activation_dtype_ok(w) || w.dtype == DType::F8_E4M3),
                what + (gpu ? ": the GPU kernels take BF16 x and BF16 or F8_E4M3 w, got x "
                            : ": x must be BF16 or F32 and w BF16, F32 or F8_E4M3, got x ") +
                    x.describe() + ", w " + w.describe());
  check_weight_scale(what, w, w_scale);
  const bool out_ok = out.dtype == DType::BF16 || (out.dtype == DType::F32 && (out_f32_ok || !gpu));
  TVLLM_REQUIRE(out_ok, what + ": out must be BF16" + std::string(out_f32_ok || !gpu ? " or F32" : "") +
                            ", got " + out.describe());
  if (M > 0) {
    TVLLM_REQUIRE(x.data && w.data && out.data, what + ": null data pointer");
    TVLLM_REQUIRE(!overlaps(out, x) && !overlaps(out, w), what + ": out must not overlap x or w");
  }
  return {M, N, K};
}

// Element (r, c) of a contiguous [rows, cols] view of any floating dtype, as fp32.
float at(const TensorView& t, int64_t r, int64_t c) {
  return load_as_f32(t.data, t.dtype, static_cast<size_t>(r * t.shape[1] + c));
}

// sum_k a[k] * b[k] in double (every product of two fp32 values is exact in double).
double dot(const std::vector<float>& a, const std::vector<float>& b) {
  double acc = 0.0;
  for (size_t k = 0; k < a.size(); ++k) acc += static_cast<double>(a[k]) * b[k];
  return acc;
}

std::vector<float> row_of(const TensorView& x, int64_t m) {
  std::vector<float> r(static_cast<size_t>(x.shape[1]));
  for (size_t k = 0; k < r.size(); ++k) r[k] = at(x, m, static_cast<int64_t>(k));
  return r;
}

// sums[m][n] = x_rows[m] . w[n] in double, each W row widened once and used for every input row.
std::vector<std::vector<double>> products(const std::vector<std::vector<float>>& x_rows, const TensorView& w) {
  const int64_t N = w.shape[0];
  std::vector<std::vector<double>> sums(x_rows.size(), std::vector<double>(static_cast<size_t>(N)));
  for (int64_t n = 0; n < N; ++n) {
    const std::vector<float> wr = row_of(w, n);
    for (size_t m = 0; m < x_rows.size(); ++m) sums[m][static_cast<size_t>(n)] = dot(x_rows[m], wr);
  }
  return sums;
}

// FP8 weights: each row's sums times its scale, in double (the sums are of the E4M3 values themselves).
void apply_scales(std::vector<std::vector<double>>& sums, const TensorView& w_scale) {
  if (w_scale.data == nullptr) return;
  for (auto& row : sums)
    for (size_t n = 0; n < row.size(); ++n) row[n] *= static_cast<double>(w_scale.ptr<const float>()[n]);
}

std::vector<std::vector<float>> rows_of(const TensorView& x) {
  std::vector<std::vector<float>> r;
  for (int64_t m = 0; m < x.shape[0]; ++m) r.push_back(row_of(x, m));
  return r;
}

// Row m of h normalised as lesson 04's bf16 rmsnorm writes it: bf16(bf16(h * inv_rms) * g). The GPU
// computes inv_rms in fp32 (rsqrtf of an fp32 sum); here it is exact to double, so a normalised value
// sitting on a bf16 rounding boundary may round the other way (one bf16 step of ONE element of x).
std::vector<float> normalised_row(const TensorView& h, const TensorView& g, float eps, int64_t m) {
  std::vector<float> r = row_of(h, m);
  double sum_sq = 0.0;
  for (float v : r) sum_sq += static_cast<double>(v) * v;
  const double inv_rms = 1.0 / std::sqrt(sum_sq / static_cast<double>(r.size()) + static_cast<double>(eps));
  for (size_t k = 0; k < r.size(); ++k) {
    const float normed = round_bf16(static_cast<float>(r[k] * inv_rms));
    r[k] = round_bf16(normed * load_as_f32(g.data, g.dtype, k));  // 8-bit x 8-bit significands: exact in fp32
  }
  return r;
}

void store(const TensorView& out, int64_t m, int64_t n, float v) {
  store_from_f32(out.data, out.dtype, static_cast<size_t>(m * out.shape[1] + n), v);
}

}  // namespace

std::string_view gemv_kernel_name(GemvKernel kernel) {
  switch (kernel) {
    case GemvKernel::V1Warp:
      return "v1";
    case GemvKernel::V2Vector:
      return "v2";
    case GemvKernel::V3Blocked:
      return "v3";
    case GemvKernel::V4TensorCore:
      return "v4";
  }
  return "?";
}

GemvKernel parse_gemv_kernel(std::string_view name) {
  for (GemvKernel k : all_gemv_kernels())
    if (gemv_kernel_name(k) == name) return k;
  throw InputError("unknown gemv kernel '" + std::string(name) + "' (expected v1, v2, v3 or v4)");
}

const std::vector<GemvKernel>& all_gemv_kernels() {
  static const std::vector<GemvKernel> kernels{GemvKernel::V1Warp, GemvKernel::V2Vector, GemvKernel::V3Blocked,
                                                GemvKernel::V4TensorCore};
  return kernels;
}

std::string_view fp8_gemv_variant_name(Fp8GemvVariant variant) {
  switch (variant) {
    case Fp8GemvVariant::Auto:
      return "auto";
    case Fp8GemvVariant::Cvt:
      return "cvt";
    case Fp8GemvVariant::Bits:
      return "bits";
    case Fp8GemvVariant::BitsTile8:
      return "bits-tile8";
  }
  return "?";
}

Fp8GemvVariant parse_fp8_gemv_variant(std::string_view name) {
  if (name == "auto") return Fp8GemvVariant::Auto;
  for (Fp8GemvVariant v : all_fp8_gemv_variants())
    if (fp8_gemv_variant_name(v) == name) return v;
  throw InputError("unknown FP8 GEMV variant '" + std::string(name) + "' (expected auto, cvt, bits or bits-tile8)");
}

const std::vector<Fp8GemvVariant>& all_fp8_gemv_variants() {
  static const std::vector<Fp8GemvVariant> variants{Fp8GemvVariant::Cvt, Fp8GemvVariant::Bits,
                                                    Fp8GemvVariant::BitsTile8};
  return variants;
}

Fp8GemvVariant fp8_gemv_variant_for_rows(int64_t M) {
  TVLLM_REQUIRE(M >= 1 && M <= kGemvMaxRows,
                "fp8_gemv_variant_for_rows: M must be 1.." + std::to_string(kGemvMaxRows) + ", got " + std::to_string(M));
  // The kernels are compiled for 1, 2, 4, 8 or 16 rows (gemv.cu's with_rows): the table has one entry each.
  const int slot = M <= 1 ? 0 : M <= 2 ? 1 : M <= 4 ? 2 : M <= 8 ? 3 : 4;
  return kFp8GemvVariantByRows[slot];
}

bool gemv_supported(const TensorView& x, const TensorView& w) {
  auto aligned16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  // 8 columns per load: 16 bytes of bf16, or 8 (K % 16 != 0) or 16 codes of F8_E4M3; x's loads are 16 bytes.
  return x.rank() == 2 && x.shape[1] % 8 == 0 && aligned16(x.data) && aligned16(w.data);
}

int64_t gemv_bytes_moved(int64_t M, int64_t N, int64_t K, DType out_dtype) {
  return 2 * N * K + 2 * M * K + M * N * static_cast<int64_t>(dtype_size(out_dtype));
}

int64_t gemv_fp8_bytes_moved(int64_t M, int64_t N, int64_t K, DType out_dtype) {
  return N * K + 4 * N + 2 * M * K + M * N * static_cast<int64_t>(dtype_size(out_dtype));
}

GemvV3Shape gemv_v3_shape(int64_t N, int64_t K, int weight_bytes) {
  // Threads: one 16-byte pack (8 bf16 or 16 E4M3 columns) of K each, in whole warps, at most 256 (8 warps):
  // K = 2048 bf16 is exactly 256 packs; K = 8192 gives each thread 4 packs of every row.
  constexpr int64_t kMaxThreads = 256, kWarp = 32;
  const int64_t packs = (K * weight_bytes + 15) / 16;
  GemvV3Shape s;
  s.threads = static_cast<int>(std::min(kMaxThreads, std::max<int64_t>(kWarp, (packs + kWarp - 1) / kWarp * kWarp)));
  // Rows: 4 per block (each x value loaded is used 4 times; 4 rows' loads in flight) as long as that still
  // gives >= 2 blocks per SM of an H200 (2 * 132 = 264 blocks), else 1 row per block.
  constexpr int64_t kFillBlocks = 264;
  s.rows_per_block = N >= 4 * kFillBlocks ? 4 : 1;
  s.blocks = (N + s.rows_per_block - 1) / s.rows_per_block;
  return s;
}

GemvDims check_gemv_args(const char* what, const TensorView& out, const TensorView& x, const TensorView& w) {
  return check_operands(what, out, x, w, false, std::string_view(what) == "gemv");
}

bool gemv_shape_supported(const TensorView& w, DType out_dtype) {
  const bool fp8 = w.dtype == DType::F8_E4M3;
  return w.rank() == 2 && (w.dtype == DType::BF16 || fp8) && w.is_contiguous() && w.shape[0] >= 1 &&
         w.shape[1] >= 1 && w.shape[1] % 8 == 0 && reinterpret_cast<uintptr_t>(w.data) % 16 == 0 &&
         (out_dtype == DType::BF16 || out_dtype == DType::F32);
}

void check_norm_args(const char* what, const TensorView& h, const TensorView& norm_weight, float eps) {
  const std::string w = what;
  TVLLM_REQUIRE(norm_weight.rank() == 1 && norm_weight.dim(0) == h.shape[1],
                w + ": norm_weight must be [" + std::to_string(h.shape[1]) + "], got " + norm_weight.describe());
  TVLLM_REQUIRE(norm_weight.device == h.device && norm_weight.is_contiguous() && activation_dtype_ok(norm_weight),
                w + ": norm_weight " + norm_weight.describe() + " must be contiguous, on h's device, " +
                    (h.device == Device::CPU ? "BF16 or F32" : "BF16"));
  TVLLM_REQUIRE(norm_weight.data != nullptr, w + ": null norm_weight");
  TVLLM_REQUIRE(std::isfinite(eps) && eps >= 0.0f, w + ": eps must be finite and >= 0, got " + std::to_string(eps));
}

// ---- the references ------------------------------------------------------------------------------------
// w BF16 or F32, or F8_E4M3 with w_scale: the sums are of the decoded E4M3 values, times the row's scale.

void gemv_cpu(const TensorView& out, const TensorView& x, const TensorView& w, const TensorView& w_scale) {
  const GemvDims d = check_operands("gemv", out, x, w, false, true, w_scale);
  auto sums = products(rows_of(x), w);
  apply_scales(sums, w_scale);
  for (int64_t m = 0; m < d.M; ++m)
    for (int64_t n = 0; n < d.N; ++n) store(out, m, n, static_cast<float>(sums[m][n]));
}

void rmsnorm_gemv_cpu(const TensorView& out, const TensorView& h, const TensorView& norm_weight, float eps,
                      const TensorView& w, const TensorView& w_scale) {
  const GemvDims d = check_operands("rmsnorm_gemv", out, h, w, false, true, w_scale);
  check_norm_args("rmsnorm_gemv", h, norm_weight, eps);
  std::vector<std::vector<float>> x_rows;
  for (int64_t m = 0; m < d.M; ++m) x_rows.push_back(normalised_row(h, norm_weight, eps, m));
  auto sums = products(x_rows, w);
  apply_scales(sums, w_scale);
  for (int64_t m = 0; m < d.M; ++m)
    for (int64_t n = 0; n < d.N; ++n) store(out, m, n, static_cast<float>(sums[m][n]));
}

void rmsnorm_gemv_silu_mul_cpu(const TensorView& act, const TensorView& h, const TensorView& norm_weight,
                               float eps, const TensorView& w_gate_up, const TensorView& w_scale) {
  const GemvDims d = check_operands("rmsnorm_gemv_silu_mul", act, h, w_gate_up, true, false, w_scale);
  check_norm_args("rmsnorm_gemv_silu_mul", h, norm_weight, eps);
  const int64_t I = d.N / 2;
  std::vector<std::vector<float>> x_rows;
  for (int64_t m = 0; m < d.M; ++m) x_rows.push_back(normalised_row(h, norm_weight, eps, m));
  auto sums = products(x_rows, w_gate_up);
  apply_scales(sums, w_scale);
  for (int64_t m = 0; m < d.M; ++m)
    for (int64_t j = 0; j < I; ++j) {
      // Lesson 08's bf16 rule: gate and up are bf16 tensors, act_fn(gate) is one more, then the product.
      const float gate = round_bf16(static_cast<float>(sums[m][j]));
      const float up = round_bf16(static_cast<float>(sums[m][I + j]));
      const float a = round_bf16(silu_f32(gate));
      store(act, m, j, a * up);  // two bf16 values: the product is exact in fp32, rounded by store if BF16
    }
}

void gemv_residual_cpu(const TensorView& h, const TensorView& x, const TensorView& w, const TensorView& w_scale) {
  const GemvDims d = check_operands("gemv_residual", h, x, w, false, false, w_scale);
  auto sums = products(rows_of(x), w);
  apply_scales(sums, w_scale);
  for (int64_t m = 0; m < d.M; ++m)
    for (int64_t n = 0; n < d.N; ++n) {
      // The product is a bf16 tensor first (linear()'s output), then added in fp32 and stored.
      const float product = round_bf16(static_cast<float>(sums[m][n]));
      store(h, m, n, at(h, m, n) + product);
    }
}

// ---- dispatch ------------------------------------------------------------------------------------------

void gemv(const TensorView& out, const TensorView& x, const TensorView& w, GemvKernel kernel,
          cudaStream_t stream) {
  const GemvDims d = check_gemv_args("gemv", out, x, w);
  if (d.M == 0) return;
  if (w.device == Device::CPU)
    gemv_cpu(out, x, w);
  else
    detail::gemv_cuda(out, x, w, kernel, stream);
}

namespace {
void require_vector_path(const std::string& what, const TensorView& x, const TensorView& w,
                         const TensorView& extra) {
  TVLLM_REQUIRE(gemv_supported(x, w) && reinterpret_cast<uintptr_t>(extra.data) % 16 == 0,
                what + ": the fused kernels need K % 8 == 0 and 16-byte aligned operands (gemv_supported); got x " +
                    x.describe() + ", w " + w.describe());
}
}  // namespace

void gemv(const TensorView& out, const TensorView& x, const TensorView& w, const TensorView& w_scale,
          cudaStream_t stream, Fp8GemvVariant fp8) {
  const GemvDims d = check_operands("gemv", out, x, w, false, true, w_scale);
  if (d.M == 0) return;
  if (w.device == Device::CPU) {
    gemv_cpu(out, x, w, w_scale);
  } else if (w.dtype == DType::F8_E4M3) {
    require_vector_path("gemv", x, w, x);
    detail::gemv_fp8_cuda(out, x, w, w_scale, stream, fp8);
  } else {
    detail::gemv_cuda(out, x, w, kDefaultGemvKernel, stream);
  }
}

void rmsnorm_gemv(const TensorView& out, const TensorView& h, const TensorView& norm_weight, float eps,
                  const TensorView& w, const TensorView& w_scale, cudaStream_t stream, bool pdl,
                  Fp8GemvVariant fp8) {
  const GemvDims d = check_operands("rmsnorm_gemv", out, h, w, false, true, w_scale);
  check_norm_args("rmsnorm_gemv", h, norm_weight, eps);
  if (d.M == 0) return;
  if (w.device == Device::CPU) {
    rmsnorm_gemv_cpu(out, h, norm_weight, eps, w, w_scale);
    return;
  }
  require_vector_path("rmsnorm_gemv", h, w, norm_weight);
  detail::rmsnorm_gemv_cuda(out, h, norm_weight, eps, w, w_scale, stream, pdl, fp8);
}

void rmsnorm_gemv(const TensorView& out, const TensorView& h, const TensorView& norm_weight, float eps,
                  const TensorView& w, cudaStream_t stream, bool pdl) {
  rmsnorm_gemv(out, h, norm_weight, eps, w, TensorView{}, stream, pdl);
}

namespace {

// rmsnorm_gemv_rope's KV store (kv_store.h): what it may describe for these heads on this device.
void check_kv_store(const KvStore& kv, int64_t n_heads, int64_t q_heads, int64_t k_heads, int64_t head_dim,
                    Device device) {
  const std::string what = "rmsnorm_gemv_rope: the KV store ";
  TVLLM_REQUIRE(kv.v != nullptr, what + "has k rows but no v rows");
  TVLLM_REQUIRE(kv.device == device, what + "is on " + std::string(device_name(kv.device)) + ", the weights on " +
                                         std::string(device_name(device)));
  TVLLM_REQUIRE(n_heads - q_heads - k_heads == k_heads && kv.kv_dim == k_heads * head_dim,
                what + "needs as many v heads as k heads and rows of kv_dim = k_heads * head_dim = " +
                    std::to_string(k_heads * head_dim) + ", got " + std::to_string(n_heads - q_heads - k_heads) +
                    " v heads and kv_dim " + std::to_string(kv.kv_dim));
  const bool dtype_ok = device == Device::CUDA ? (kv.dtype == DType::BF16 || kv.dtype == DType::F8_E4M3)
                                               : (kv.dtype == DType::BF16 || kv.dtype == DType::F32);
  TVLLM_REQUIRE(dtype_ok, what + "stores " + std::string(dtype_name(kv.dtype)) + " rows, which " +
                              std::string(device_name(device)) + " does not take (CUDA: BF16, F8_E4M3; CPU: F32, BF16)");
  TVLLM_REQUIRE(kv.rows != nullptr || (kv.slots != nullptr && kv.cu_k != nullptr && kv.max_context > 0),
                what + "names neither a slot mapping (rows) nor slots, cu_k and max_context");
  if (kv.dtype == DType::F8_E4M3)
    TVLLM_REQUIRE(std::isfinite(kv.k_inv_scale) && kv.k_inv_scale > 0.f && std::isfinite(kv.v_inv_scale) &&
                      kv.v_inv_scale > 0.f,
                  what + "needs finite positive inverse scales for its E4M3 codes");
}

// The store on the host: token m's k and v heads (as qkv holds them, bf16) copied to its row, widened for F32.
void store_kv_rows_cpu(const KvStore& kv, const TensorView& qkv, int64_t M, int64_t q_heads, int64_t head_dim) {
  const int64_t N = qkv.shape[1], q_cols = q_heads * head_dim;
  const uint16_t* y = static_cast<const uint16_t*>(qkv.data);
  for (int64_t m = 0; m < M; ++m) {
    const int64_t row = kv.rows != nullptr
                            ? kv.rows[m]
                            : (kv.slots[m] < 0 ? -1
                                               : static_cast<int64_t>(kv.slots[m]) * kv.max_context +
                                                     (kv.cu_k[m + 1] - kv.cu_k[m] - 1));
    if (row < 0) continue;  // a padding token
    const uint16_t* k_src = y + m * N + q_cols;
    const uint16_t* v_src = k_src + kv.kv_dim;
    for (int64_t c = 0; c < kv.kv_dim; ++c) {
      const int64_t at = row * kv.kv_dim + c;
      if (kv.dtype == DType::F32) {
        static_cast<float*>(kv.k)[at] = bf16_to_f32(k_src[c]);
        static_cast<float*>(kv.v)[at] = bf16_to_f32(v_src[c]);
      } else {
        static_cast<uint16_t*>(kv.k)[at] = k_src[c];
        static_cast<uint16_t*>(kv.v)[at] = v_src[c];
      }
    }
  }
}

}  // namespace

void rmsnorm_gemv_rope(const TensorView& qkv, const TensorView& h, const TensorView& norm_weight, float eps,
                       const TensorView& w, const TensorView& w_scale, const TensorView& positions,
                       const RopeTable& table, int64_t q_heads, int64_t k_heads, cudaStream_t stream, bool pdl,
                       Fp8GemvVariant fp8, const KvStore* kv) {
  const GemvDims d = check_operands("rmsnorm_gemv_rope", qkv, h, w, false, false, w_scale);
  check_norm_args("rmsnorm_gemv_rope", h, norm_weight, eps);
  const int64_t head_dim = table.head_dim();
  TVLLM_REQUIRE(head_dim >= 2 && head_dim % 2 == 0 && d.N % head_dim == 0,
                "rmsnorm_gemv_rope: " + std::to_string(d.N) + " outputs are not whole heads of " +
                    std::to_string(head_dim));
  TVLLM_REQUIRE(q_heads >= 1 && k_heads >= 1 && (q_heads + k_heads) * head_dim <= d.N,
                "rmsnorm_gemv_rope: " + std::to_string(q_heads) + " q heads and " + std::to_string(k_heads) +
                    " k heads do not fit in " + std::to_string(d.N / head_dim) + " heads");
  TVLLM_REQUIRE(positions.dtype == DType::I32 && positions.rank() == 1 && positions.shape[0] == d.M &&
                    positions.device == w.device && positions.is_contiguous(),
                "rmsnorm_gemv_rope: positions must be I32 [" + std::to_string(d.M) + "] on the weights' device");
  TVLLM_REQUIRE(qkv.dtype == DType::BF16 && qkv.is_contiguous(), "rmsnorm_gemv_rope: qkv must be contiguous BF16");
  if (kv != nullptr && kv->empty()) kv = nullptr;
  if (kv != nullptr) check_kv_store(*kv, d.N / head_dim, q_heads, k_heads, head_dim, w.device);
  if (d.M == 0) return;
  if (w.device == Device::CPU) {  // the two references in turn: the norm and the GEMV, then RoPE on q and k
    rmsnorm_gemv_cpu(qkv, h, norm_weight, eps, w, w_scale);  // rounded to bf16, as the GPU stores it
    // Lesson 05's CPU reference works on F32 views: q and k widened (exactly), rotated, rounded back.
    const int64_t q_cols = q_heads * head_dim, k_cols = k_heads * head_dim;
    const std::vector<float> y = to_f32_vector(qkv);
    std::vector<float> q(static_cast<size_t>(d.M * q_cols)), k(static_cast<size_t>(d.M * k_cols));
    for (int64_t m = 0; m < d.M; ++m) {
      std::copy_n(y.begin() + m * d.N, q_cols, q.begin() + m * q_cols);
      std::copy_n(y.begin() + m * d.N + q_cols, k_cols, k.begin() + m * k_cols);
    }
    Tensor qt = Tensor::from_f32(q, {d.M, q_cols}, DType::F32, Device::CPU);
    Tensor kt = Tensor::from_f32(k, {d.M, k_cols}, DType::F32, Device::CPU);
    apply_rope(qt, kt, positions, table, kDefaultRopeKernel, PositionCheck::Trusted);
    const std::vector<float> qr = to_f32_vector(qt), kr = to_f32_vector(kt);
    for (int64_t m = 0; m < d.M; ++m) {
      uint16_t* row = static_cast<uint16_t*>(qkv.data) + m * d.N;
      for (int64_t i = 0; i < q_cols; ++i) row[i] = f32_to_bf16(qr[m * q_cols + i]);
      for (int64_t i = 0; i < k_cols; ++i) row[q_cols + i] = f32_to_bf16(kr[m * k_cols + i]);
    }
    if (kv != nullptr) store_kv_rows_cpu(*kv, qkv, d.M, q_heads, head_dim);
    return;
  }
  require_vector_path("rmsnorm_gemv_rope", h, w, norm_weight);
  TVLLM_REQUIRE(table.on_device(), "rmsnorm_gemv_rope: the RoPE table is not on the GPU (upload_to_device)");
  detail::rmsnorm_gemv_rope_cuda(qkv, h, norm_weight, eps, w, w_scale, positions, table, q_heads, k_heads, stream,
                                 pdl, fp8, kv);
}

void rmsnorm_gemv_silu_mul(const TensorView& act, const TensorView& h, const TensorView& norm_weight, float eps,
                           const TensorView& w_gate_up, const TensorView& w_scale, cudaStream_t stream, bool pdl,
                           Fp8GemvVariant fp8) {
  const GemvDims d = check_operands("rmsnorm_gemv_silu_mul", act, h, w_gate_up, true, false, w_scale);
  check_norm_args("rmsnorm_gemv_silu_mul", h, norm_weight, eps);
  if (d.M == 0) return;
  if (w_gate_up.device == Device::CPU) {
    rmsnorm_gemv_silu_mul_cpu(act, h, norm_weight, eps, w_gate_up, w_scale);
    return;
  }
  require_vector_path("rmsnorm_gemv_silu_mul", h, w_gate_up, norm_weight);
  detail::rmsnorm_gemv_silu_mul_cuda(act, h, norm_weight, eps, w_gate_up, w_scale, stream, pdl, fp8);
}

void rmsnorm_gemv_silu_mul(const TensorView& act, const TensorView& h, const TensorView& norm_weight, float eps,
                           const TensorView& w_gate_up, cudaStream_t stream, bool pdl) {
  rmsnorm_gemv_silu_mul(act, h, norm_weight, eps, w_gate_up, TensorView{}, stream, pdl);
}

void gemv_residual(const TensorView& h, const TensorView& x, const TensorView& w, const TensorView& w_scale,
                   cudaStream_t stream, bool pdl, Fp8GemvVariant fp8) {
  const GemvDims d = check_operands("gemv_residual", h, x, w, false, false, w_scale);
  if (d.M == 0) return;
  if (w.device == Device::CPU) {
    gemv_residual_cpu(h, x, w, w_scale);
    return;
  }
  require_vector_path("gemv_residual", x, w, x);
  detail::gemv_residual_cuda(h, x, w, w_scale, stream, pdl, fp8);
}

void gemv_residual(const TensorView& h, const TensorView& x, const TensorView& w, cudaStream_t stream, bool pdl) {
  gemv_residual(h, x, w, TensorView{}, stream, pdl);
}

}  // namespace tvllm
