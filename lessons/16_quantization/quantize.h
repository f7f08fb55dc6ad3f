// Lesson 16: making an FP8 checkpoint from a bf16 / f16 / f32 one, in the compressed-tensors
// "float-quantized" layout that llm-compressor's FP8-dynamic scheme writes and that lesson 01 loads.
//
// For each Linear weight W [out, in] (q/k/v/o and gate/up/down of every layer; not the embedding, the
// norms, the biases or lm_head):
//
//   scale  = absmax / 448            per output row ("channel") or for the whole tensor ("tensor"),
//                                    stored in the weight's own dtype (BF16 for a bf16 model, as
//                                    llm-compressor stores it), shape [out, 1] or [1]
//   code   = E4M3(W / scale)         fp32 division, then round to nearest even with saturation: the
//                                    stored scale was rounded, so W / scale may pass 448 by a hair
//   W'     = fp8(code) * scale       what a loader computes; |W' - W| <= half an E4M3 ulp of
//                                    |W| / scale, times the scale (fp8_error_bound below)
//
// A row of zeros gets scale 1 (any scale gives zero codes; 1 keeps the checkpoint free of 0 and inf).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "common/tensor.h"
#include "model_config.h"

namespace tvllm {

struct QuantizeOptions {
  std::string scheme = "fp8-dynamic";  // the only scheme: FP8 weights, dynamic per-token FP8 activations
  Fp8Quantization::Strategy strategy = Fp8Quantization::Strategy::Channel;
};

// One weight matrix quantized.
struct Fp8Weight {
  std::vector<uint8_t> codes;   // [out * in], E4M3
  std::vector<float> scales;    // [out] (channel) or [1] (tensor), the values as stored (already rounded)
};

// Quantizes W (F32, BF16 or F16, [out, in], on the CPU) with scales rounded to `scale_dtype`.
Fp8Weight quantize_weight_fp8(const TensorView& w, Fp8Quantization::Strategy strategy, DType scale_dtype);

// The largest |fp8(code) * scale - w| the rounding allows for a weight w under `scale`: half the E4M3
// spacing at |w| / scale (2^(e-4) in the binade [2^e, 2^(e+1)), 2^-10 among the subnormals), times the
// scale. Saturation adds nothing: |w| <= absmax, and absmax / scale is within a scale rounding of 448.
double fp8_error_bound(float w, float scale);

struct QuantizeSummary {
  int64_t quantized_tensors = 0;  // Linear weights written as F8_E4M3
  int64_t kept_tensors = 0;       // everything else, as it was
  uint64_t bytes_before = 0;      // tensor bytes of the source
  uint64_t bytes_after = 0;       // tensor bytes written (codes + scales + kept tensors)
  double max_error_over_bound = 0;  // max over all weights of |W' - W| / fp8_error_bound: <= 1
};

// Reads the model in `model_dir` (ModelDir::open: validated), writes `out_dir`/model.safetensors, its
// config.json with the quantization_config, and copies every other top-level file (tokenizer.json,
// tokenizer_config.json, generation_config.json, ...). Refuses (InputError) a model that is already
// quantized, an out_dir equal to model_dir, and an out_dir that exists and is not empty.
QuantizeSummary quantize_checkpoint(const std::filesystem::path& model_dir, const std::filesystem::path& out_dir,
                                    const QuantizeOptions& options);

// The quantization_config quantize_checkpoint writes (parse_quantization_config reads it back).
std::string fp8_quantization_config_json(const QuantizeOptions& options);

}  // namespace tvllm
