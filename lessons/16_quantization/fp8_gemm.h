// Lesson 16: the prefill GEMM on FP8 tensor cores (README "7.3 The prefill GEMM on FP8 tensor cores").
//
// With FP8-resident weights the decode GEMVs read E4M3 codes, but a step of many tokens (a prefill, a decode
// batch of more than kFp8GemvMaxRows sequences) used to dequantize each weight to bf16 and run cuBLAS's bf16
// GEMM. Hopper's tensor cores multiply E4M3 x E4M3 at twice the bf16 rate, so this GEMM quantizes the
// activations too, one scale per token, and lets cuBLASLt multiply the codes:
//
//   x [T, K] bf16 --quantize_activations--> xq [T, K] E4M3, sx [T] F32     (sx[t] = amax(x[t, :]) / 448)
//   y[t, n] = sx[t] * sw[n] * Σ_k fp8(xq[t, k]) * fp8(wq[n, k])            (fp32 accumulate, bf16 out)
//
// The two scales are applied by cuBLASLt itself where it can (scale vectors: CUBLASLT_MATMUL_MATRIX_SCALE_
// OUTER_VEC_32F, CUDA 12.9+), else by a small kernel after a GEMM of the bare codes (epilogue). Whatever the
// GEMM cannot take (the layout rules of fp8_gemm_layout_ok, no algorithm from the heuristic) falls back to the
// dequantize path of fp8_resident.h, which computes the bf16 product of lesson 08.
#pragma once

#include <cuda_runtime.h>  // cudaStream_t

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/tensor.h"

namespace tvllm {

// The largest |value| of E4M3 (S.1111.110 = 1.75 * 2^8); no infinities: beyond it the encoders saturate.
inline constexpr float kE4m3Max = 448.0f;

// Steps of at most this many tokens keep the dequantize path (their decode steps run the FP8 GEMV of lesson
// 14 anyway): the FP8 GEMM starts at kFp8GemmMinTokens = 17 rows.
inline constexpr int64_t kFp8GemmMinTokens = 17;

// --fp8-gemm: which product a step of kFp8GemmMinTokens+ tokens runs on FP8-resident weights.
//   Auto          scale vectors where cuBLASLt has an algorithm for them, else epilogue, else dequantize
//   ScaleVectors  cuBLASLt applies sx and sw (outer-vector scale mode); declined: dequantize
//   Epilogue      cuBLASLt multiplies the codes (scales 1), a kernel multiplies by sx[t] sw[n]; declined: dequantize
//   Dequantize    the weight dequantized to bf16, lesson 06's bf16 GEMM (what ran before this section)
enum class Fp8GemmPath { Auto, ScaleVectors, Epilogue, Dequantize };
std::string_view fp8_gemm_path_name(Fp8GemmPath path);  // "auto", "scale-vectors", "epilogue", "dequantize"
Fp8GemmPath parse_fp8_gemm_path(std::string_view name);  // InputError naming the choices

// ---- the activation quantizer ---------------------------------------------------------------------------
// Per token (row), dynamic: scale[t] = amax_k |x[t, k]| / 448 (1 where the row is all zeros, so its codes are
// zeros and nothing divides by 0), codes[t, k] = e4m3_rn_satfinite(x[t, k] / scale[t]). x BF16 [T, K] (rows may
// be strided), codes F8_E4M3 [T, K] contiguous, scale F32 [T]. CPU: the oracle (a plain loop); CUDA: one block
// per row on `stream`, no allocation (it may run inside a captured graph). Both divide in fp32 with IEEE
// rounding and encode with the same round-to-nearest-even, so they agree bit for bit.
void quantize_activations(const TensorView& codes, const TensorView& scale, const TensorView& x,
                          cudaStream_t stream = nullptr);

// ---- the accuracy measurement's simulation (CPU) ---------------------------------------------------------
// out = what the FP8 GEMM multiplies instead of x: each row quantized as above (x F32 or BF16 [T, K], host; the
// row's scale amax/448 in fp32, the codes round-to-nearest-even, saturating) and decoded back, code * scale, F32.
void fake_quantize_activations(const TensorView& out, const TensorView& x);
// Installs it as lesson 08's CPU activation transform (on = true) or removes it: every projection of the CPU
// forward then sees per-token FP8 activations. The accuracy code's "FP8 weights + FP8 activations" row runs so;
// it quantizes every step's activations, decode steps included, where the engine quantizes only steps of
// kFp8GemmMinTokens+ tokens: an upper bound on what the GEMM costs in accuracy.
void simulate_fp8_activations_on_cpu(bool on);

// ---- the CPU oracle of the whole product ----------------------------------------------------------------
// value[t * N + n] = sx[t] * sw[n] * Σ_k fp8(xq[t, k]) fp8(wq[n, k]) in double (each term exact); abs_sum the
// same with |terms| (what an fp32 summation's error is proportional to). sw: [N] or [1]. Host views only.
struct Fp8GemmReference {
  std::vector<double> value;
  std::vector<double> abs_sum;
};
Fp8GemmReference fp8_gemm_reference(const TensorView& xq, const TensorView& sx, const TensorView& wq,
                                    const TensorView& sw);

// ---- the GPU GEMM ----------------------------------------------------------------------------------------
// cuBLASLt's rules for FP8 operands, checked before asking it (a product that breaks one is declined):
// A (the weight) transposed and B (the activations) not ("TN": both K-major, which is how y = x W^T lays out
// in row-major memory anyway), K a multiple of 16, every leading dimension a multiple of 16 bytes (K for the
// codes, N * 2 for the bf16 output: N a multiple of 8), and 16-byte aligned pointers. "" when they hold, else
// the rule broken (for messages and the chapter's table).
std::string fp8_gemm_layout_problem(int64_t T, int64_t N, int64_t K, const void* xq, const void* wq, const void* y);

// What a GEMM needs from its caller: lesson 06's cuBLASLt handle and workspace, and the stream.
struct Fp8GemmContext {
  void* lt = nullptr;  // cublasLtHandle_t
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  cudaStream_t stream = nullptr;
  // CUBLASLT_MATMUL_DESC_FAST_ACCUM. Off (the default): cuBLASLt promotes the tensor cores' partial sums into
  // fp32 registers every few k-blocks, a true fp32 accumulation. On: it keeps them in the MMA's accumulator,
  // which on Hopper carries fewer mantissa bits for FP8 (README 7.3): a few percent faster, an error that grows
  // with K. The engine keeps it off; the lesson's --bench measures both.
  bool fast_accum = false;
};

// y [T, N] bf16 (contiguous) = the product above, from xq [T, K] E4M3 + sx [T] F32 and wq [N, K] E4M3 + sw [N]
// F32 (per-output-channel; [1] per-tensor is broadcast), all on the GPU. `path` is ScaleVectors or Epilogue
// (Auto tries them in that order). Returns the path that ran, or Dequantize when it declined (layout rules,
// no algorithm): then nothing was queued and the caller runs its own product. No allocation; plans (layouts,
// the heuristic's algorithm) are cached per shape, so a capture replays no host query.
Fp8GemmPath fp8_gemm(const TensorView& y, const TensorView& xq, const TensorView& sx, const TensorView& wq,
                     const TensorView& sw, Fp8GemmPath path, const Fp8GemmContext& ctx);

// Whether this machine's cuBLASLt returns an algorithm for the outer-vector scale mode at (T, N, K): the
// runtime probe behind Auto (cached). False without CUDA 12.9+ headers, or where the library declines.
bool fp8_scale_vectors_supported(int64_t T, int64_t N, int64_t K);

// ---- the engine ------------------------------------------------------------------------------------------
// --fp8-gemm CHOICE for a model loaded as `weights` (weights_resident: loaded with Fp8Load::Resident): the path,
// or InputError for an unknown choice, or for scale-vectors / epilogue asked of weights that are not resident
// (there are no codes to multiply: the GEMMs read bf16). auto and dequantize pass for any load.
Fp8GemmPath fp8_gemm_mode(const std::string& choice, bool weights_resident);

// Installs the FP8 GEMM as lesson 08's seam (install_fp8_gemm) for steps of kFp8GemmMinTokens+ tokens, on
// `path`; Dequantize uninstalls it (weight_for_gemm's dequantizer runs every step, as before). Idempotent.
void install_fp8_tensor_core_gemm(Fp8GemmPath path);
Fp8GemmPath installed_fp8_gemm_path();  // Dequantize when none is installed

// How many projections each path ran since the last reset, counted on the host when queued (a CUDA graph
// counts once, at its capture): for bench throughput's JSON, which says what actually ran.
struct Fp8GemmCounts {
  int64_t scale_vectors = 0, epilogue = 0, dequantize = 0;
};
Fp8GemmCounts fp8_gemm_counts();
void reset_fp8_gemm_counts();

}  // namespace tvllm
