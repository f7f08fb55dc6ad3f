// Lesson 16: the FP8 tensor-core GEMM's host side (fp8_gemm.h): the path names, the checks, the activation
// quantizer's CPU oracle and the double-precision reference of the whole product.
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/errors.h"
#include "common/exercise.h"  // NotWrittenYet (the stub of exercise 16.4)
#include "fp8.h"
#include "fp8_gemm.h"
#include "transformer.h"  // lesson 08's CPU activation transform

namespace tvllm {

std::string_view fp8_gemm_path_name(Fp8GemmPath path) {
  switch (path) {
    case Fp8GemmPath::Auto: return "auto";
    case Fp8GemmPath::ScaleVectors: return "scale-vectors";
    case Fp8GemmPath::Epilogue: return "epilogue";
    case Fp8GemmPath::Dequantize: return "dequantize";
  }
  return "?";
}

Fp8GemmPath parse_fp8_gemm_path(std::string_view name) {
  for (Fp8GemmPath p : {Fp8GemmPath::Auto, Fp8GemmPath::ScaleVectors, Fp8GemmPath::Epilogue, Fp8GemmPath::Dequantize})
    if (name == fp8_gemm_path_name(p)) return p;
  throw InputError("--fp8-gemm: expected auto, scale-vectors, epilogue or dequantize, got \"" + std::string(name) +
                   "\"");
}

Fp8GemmPath fp8_gemm_mode(const std::string& choice, bool weights_resident) {
  const Fp8GemmPath path = parse_fp8_gemm_path(choice);
  if (!weights_resident && (path == Fp8GemmPath::ScaleVectors || path == Fp8GemmPath::Epilogue))
    throw InputError("--fp8-gemm " + choice + ": the FP8 GEMM multiplies FP8-resident weights, and these are not "
                     "(add --fp8-weights resident, with an FP8 checkpoint on CUDA)");
  return path;
}

namespace {

void check_quantizer(const TensorView& codes, const TensorView& scale, const TensorView& x) {
  TVLLM_REQUIRE(x.rank() == 2 && x.dtype == DType::BF16 && x.data && x.strides[1] == 1,
                "quantize_activations: x must be BF16 [T, K] with contiguous rows, got " + x.describe());
  const int64_t T = x.shape[0];
  TVLLM_REQUIRE(codes.dtype == DType::F8_E4M3 && codes.shape == x.shape && codes.is_contiguous() && codes.data,
                "quantize_activations: codes must be a contiguous F8_E4M3 " + shape_str(x.shape) + ", got " +
                    codes.describe());
  TVLLM_REQUIRE(scale.dtype == DType::F32 && scale.numel() == T && scale.is_contiguous() && scale.data,
                "quantize_activations: scale must be F32 [" + std::to_string(T) + "], got " + scale.describe());
  TVLLM_REQUIRE(codes.device == x.device && scale.device == x.device,
                "quantize_activations: codes, scale and x must be on one device");
}

}  // namespace

// The CUDA launcher (fp8_gemm.cu), after the checks.
void quantize_activations_cuda(uint8_t* codes, float* scale, const void* x, int64_t x_row_stride, int64_t T,
                               int64_t K, cudaStream_t stream);

void quantize_activations(const TensorView& codes, const TensorView& scale, const TensorView& x,
                          cudaStream_t stream) {
  check_quantizer(codes, scale, x);
  const int64_t T = x.shape[0], K = x.shape[1];
  if (x.device == Device::CUDA) {
    if (T * K > 0)
      quantize_activations_cuda(codes.ptr<uint8_t>(), scale.ptr<float>(), x.data, x.strides[0], T, K, stream);
    return;
  }
  // --- exercise 16.4: the per-token activation quantizer ---------------------------------------------------
  // Task: for each row t of x (BF16, row stride x.strides[0] elements): amax = max_k |x[t, k]|; the row's scale
  //   s = amax / 448 in fp32 (1 where amax is 0: an all-zero row gets codes 0, and nothing divides by 0);
  //   codes[t, k] = f32_to_fp8_e4m3(x[t, k] / s) (round to nearest even, saturating at 448: fp8.h).
  // Hint: bf16_to_f32 widens a stored value exactly; the division is fp32 (the GPU kernel divides the same way,
  //   so the two agree bit for bit).
  // Tests: Fp8Gemm16.QuantizerRowsHitTheTopCode Fp8Gemm16.QuantizerZeroRowAndSaturation
  // Tests: Fp8Gemm16Gpu.QuantizerEqualsTheCpuBitForBit
  // Needs: 16.1
  // Stub:
  //   (void)T, (void)K;
  //   throw NotWrittenYet("16.4", "the per-token activation quantizer");
  // --- solution ---
  const auto* xs = x.ptr<const uint16_t>();
  auto* out = codes.ptr<uint8_t>();
  auto* s = scale.ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const uint16_t* row = xs + t * x.strides[0];
    float amax = 0.0f;
    for (int64_t k = 0; k < K; ++k) amax = std::fmax(amax, std::fabs(bf16_to_f32(row[k])));
    const float st = amax > 0.0f ? amax / kE4m3Max : 1.0f;
    s[t] = st;
    for (int64_t k = 0; k < K; ++k) out[t * K + k] = f32_to_fp8_e4m3(bf16_to_f32(row[k]) / st);
  }
  // --- end of exercise 16.4 ---
}

void fake_quantize_activations(const TensorView& out, const TensorView& x) {
  TVLLM_REQUIRE(x.rank() == 2 && (x.dtype == DType::F32 || x.dtype == DType::BF16) && x.device == Device::CPU &&
                    x.strides[1] == 1,
                "fake_quantize_activations: x must be host F32 or BF16 [T, K] with contiguous rows, got " +
                    x.describe());
  TVLLM_REQUIRE(out.dtype == DType::F32 && out.shape == x.shape && out.is_contiguous() && out.device == Device::CPU,
                "fake_quantize_activations: out must be a contiguous host F32 " + shape_str(x.shape));
  const int64_t T = x.shape[0], K = x.shape[1];
  auto value = [&](int64_t t, int64_t k) {
    const int64_t i = t * x.strides[0] + k;
    return x.dtype == DType::F32 ? x.ptr<const float>()[i] : bf16_to_f32(x.ptr<const uint16_t>()[i]);
  };
  float* o = out.ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    float amax = 0.0f;
    for (int64_t k = 0; k < K; ++k) amax = std::fmax(amax, std::fabs(value(t, k)));
    const float s = amax > 0.0f ? amax / kE4m3Max : 1.0f;
    for (int64_t k = 0; k < K; ++k)
      o[t * K + k] = fp8_to_f32(Fp8Kind::E4M3, f32_to_fp8_e4m3(value(t, k) / s)) * s;
  }
}

void simulate_fp8_activations_on_cpu(bool on) {
  install_cpu_activation_transform(on ? fake_quantize_activations : nullptr);
}

Fp8GemmReference fp8_gemm_reference(const TensorView& xq, const TensorView& sx, const TensorView& wq,
                                    const TensorView& sw) {
  TVLLM_REQUIRE(xq.rank() == 2 && wq.rank() == 2 && xq.shape[1] == wq.shape[1] && xq.dtype == DType::F8_E4M3 &&
                    wq.dtype == DType::F8_E4M3 && xq.is_contiguous() && wq.is_contiguous(),
                "fp8_gemm_reference: xq [T, K] and wq [N, K] must be contiguous F8_E4M3, got " + xq.describe() +
                    " and " + wq.describe());
  const int64_t T = xq.shape[0], N = wq.shape[0], K = xq.shape[1];
  TVLLM_REQUIRE(sx.dtype == DType::F32 && sx.numel() == T && sw.dtype == DType::F32 &&
                    (sw.numel() == N || sw.numel() == 1),
                "fp8_gemm_reference: sx must be F32 [T], sw F32 [N] or [1]");
  TVLLM_REQUIRE(xq.device == Device::CPU && wq.device == Device::CPU && sx.device == Device::CPU &&
                    sw.device == Device::CPU,
                "fp8_gemm_reference: host views only");
  // Decode every code once: E4M3 values are exact in double, and so is each product (4 x 4 significant bits).
  std::vector<double> a(static_cast<size_t>(T * K)), b(static_cast<size_t>(N * K));
  for (size_t i = 0; i < a.size(); ++i) a[i] = fp8_to_f32(Fp8Kind::E4M3, xq.ptr<const uint8_t>()[i]);
  for (size_t i = 0; i < b.size(); ++i) b[i] = fp8_to_f32(Fp8Kind::E4M3, wq.ptr<const uint8_t>()[i]);
  Fp8GemmReference ref{std::vector<double>(static_cast<size_t>(T * N)), std::vector<double>(static_cast<size_t>(T * N))};
  for (int64_t t = 0; t < T; ++t)
    for (int64_t n = 0; n < N; ++n) {
      double sum = 0.0, abs_sum = 0.0;
      for (int64_t k = 0; k < K; ++k) {
        const double p = a[static_cast<size_t>(t * K + k)] * b[static_cast<size_t>(n * K + k)];
        sum += p;
        abs_sum += std::fabs(p);
      }
      const double s = static_cast<double>(sx.ptr<const float>()[t]) *
                       static_cast<double>(sw.ptr<const float>()[sw.numel() == 1 ? 0 : n]);
      ref.value[static_cast<size_t>(t * N + n)] = s * sum;
      ref.abs_sum[static_cast<size_t>(t * N + n)] = s * abs_sum;
    }
  return ref;
}

std::string fp8_gemm_layout_problem(int64_t T, int64_t N, int64_t K, const void* xq, const void* wq, const void* y) {
  if (T < 1 || N < 1 || K < 1) return "an empty product";
  if (K % 16 != 0) return "K = " + std::to_string(K) + " is not a multiple of 16";
  if (N % 8 != 0) return "N = " + std::to_string(N) + ": the bf16 output's rows are not a multiple of 16 bytes";
  for (const void* p : {xq, wq, y})
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return "an operand is not 16-byte aligned";
  // cuBLASLt takes int32 dimensions; lesson 08's steps are far below.
  if (T > INT32_MAX || N > INT32_MAX || K > INT32_MAX) return "a dimension beyond int32";
  return "";
}

}  // namespace tvllm
