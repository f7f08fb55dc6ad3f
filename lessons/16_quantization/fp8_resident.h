// Lesson 16: FP8 weights resident in the engine (README "FP8 in the engine").
//
// Lesson 01 can dequantize an FP8 checkpoint at load (w = round_bf16(fp8 * scale)): every kernel of lessons 08-14
// then runs it unchanged, and gains nothing from it: the decode GEMVs still read 2 bytes per weight. Resident
// keeps the codes (1 byte) and their per-row scales on the GPU:
//
//   decode steps (up to 16 tokens)  lesson 14's fused GEMVs read the E4M3 codes (gemv.h: v3 is generic over the
//                                   weight type), half the bytes of bf16: the whole point at batch 1
//   prefill, larger batches         lesson 06's cuBLAS GEMM, on the layer's weight dequantized into one bf16
//                                   scratch buffer just before it (ModelWeights' fp8_scratch, weight_for_gemm):
//                                   the same bf16 values dequantize-at-load computes, so the same logits;
//                                   or, for steps of 17+ tokens, the FP8 tensor-core GEMM of fp8_gemm.h
//                                   (--fp8-gemm, README 7.3), which declines to this path where it cannot run
//
// What decides it (fp8_weights_mode): a quantized checkpoint, a CUDA device and lesson 14's fused decode path.
// Everything else (the CPU, --no-fused, lessons 08-13's executables) dequantizes at load as before.
#pragma once

#include <cuda_runtime.h>  // cudaStream_t

#include <string>

#include "common/tensor.h"
#include "model_config.h"
#include "model_dir.h"

namespace tvllm {

struct ModelWeights;  // lesson 08

// dst[r, k] = round_bf16(fp8_e4m3(q[r, k]) * scale[r]): dst BF16 [R, K], q F8_E4M3 [R, K], scale F32 [R] (or
// [R, 1]), all contiguous on one device. CPU: the loop lesson 01 runs at load; CUDA: a kernel on `stream`
// (asynchronous, no allocation: it runs inside captured decode graphs too). The product of a code (4
// significant bits) and a scale widened from BF16 (8) is exact in fp32, so both round the same value once.
void dequantize_fp8_weight(const TensorView& dst, const TensorView& q, const TensorView& scale,
                           cudaStream_t stream = nullptr);

// Installs dequantize_fp8_weight as lesson 08's FP8 dequantizer (install_fp8_weight_dequantizer): the composed
// forward's GEMMs can then read FP8-resident weights. Idempotent.
void install_fp8_resident_weights();

// How a command loads an FP8 checkpoint: "auto" (resident where the fused decode path runs on CUDA, else
// dequantized), "resident" or "dequantize". For "resident" the conditions are requirements: InputError naming
// what is missing (not an FP8 checkpoint, not CUDA, the fused path switched off). Non-FP8 checkpoints: always
// Dequantize (nothing to do), except that "resident" is refused.
Fp8Load fp8_weights_mode(const std::string& choice, const ModelConfig& config, bool cuda, bool fused);

// For the startup notice: "FP8 weights resident (E4M3 GEMVs, per-row scales)", "FP8 weights dequantized to
// bf16 at load", or "" for a checkpoint that is not FP8.
std::string describe_fp8_weights(const ModelConfig& config, Fp8Load mode);

// ---- an FP8 lm_head (opt-in: --fp8-lm-head, README 7.4) ---------------------------------------------------------
// Published FP8 checkpoints keep the lm_head in bf16 (quantize.h's "ignore": ["lm_head"]); at batch 1 it is a
// third of what a 1B model's decode step reads. attach_fp8_lm_head quantizes it at load, on the GPU, with the
// activation quantizer of fp8_gemm.h (quantize_activations: per row, i.e. per vocabulary entry, scale = amax / 448,
// 1 for an all-zero row; codes E4M3 round-to-nearest-even, saturating), into w.lm_head_fp8 / w.lm_head_scale
// (ModelWeights::allocate_fp8_lm_head). Lesson 14's fused decode GEMV then reads the codes; w.lm_head stays bf16.
// Synchronous (load time). InputError unless w is on CUDA with a BF16 lm_head.
void attach_fp8_lm_head(ModelWeights& w);

// --fp8-lm-head: valid only with FP8-resident weights (the decode path that reads codes). InputError otherwise.
void require_fp8_lm_head(bool wanted, bool weights_resident);

}  // namespace tvllm
