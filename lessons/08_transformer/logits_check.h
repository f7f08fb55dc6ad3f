// Lesson 08: how logits are judged against the Hugging Face reference (shared by the lesson executable and
// the tests). README "What correct means" derives every number.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>

#include "common/tensor.h"
#include "common/validate.h"

namespace tvllm {

// CPU (fp32 everywhere, double-accumulated GEMMs) vs Hugging Face's fp32 run of the same stored weights: the
// two differ by fp32 summation order and libm ulps (~1e-7 relative per op), amplified on the way through the
// layers (a norm divides by the rms, the residual stream grows to ~40, attention sharpens differences). The
// error is absolute-like: about the same on small and large logits, growing with the prompt. Stated per the
// largest |value| of the reference tensor: measured on the bundled model (lesson08_transformer --device cpu),
// max |err| = 6.4e-7 x max|logit| (2.3e-5 on logits up to 35) and 9.4e-7 x max|norm|; we allow about 80x
// and 50x that (first set at 10x the errors of an older, less exact run). A bug moves values by O(1).
inline constexpr double kCpuLogitsAtolPerMax = 5e-5;
inline constexpr double kCpuNormAtolPerMax = 5e-5;

// GPU (bf16 activations, fp32 accumulation) vs Hugging Face fp32. Every op rounds its output to bf16 (2^-9
// relative on average, 2^-8 at most), a dozen times per layer, and the residual stream, ~40 in size, is
// itself stored in bf16 (a rounding of up to 0.125 on every add). A logit is a sum of hidden-size products
// of both signs, so these relative errors become absolute errors of a fraction of the logits' spread.
// How large depends on the model: a trained model damps the roundings, a deep random one amplifies them
// chaotically (README "What correct means": Hugging Face's OWN bf16 run of a random 16-layer 1B-shaped
// model is 2 x rms(logits) off its fp32 run). So the bound ε has two parts, and the larger one holds:
//   1. kGpuLogitErrorPerRms x rms(reference logits): emulate_bf16.py (this folder) replays the GPU path's
//      roundings in numpy: on the bundled model the max |logit error| is 0.10-0.15 x rms over 141k logits.
inline constexpr double kGpuLogitErrorPerRms = 0.2;
//   2. kBf16FloorFactor x Hugging Face's own bf16 error on the same prompt (make_reference.py records it in
//      the manifest: "hf_bf16"): we must be as close to fp32 as Hugging Face's bf16 run is, within 50%.
inline constexpr double kBf16FloorFactor = 1.5;
// A top-1 decision is certain when the reference's top-1/top-2 margin exceeds TWICE the largest error (the
// two logits may move that much in opposite directions): those are the "clear-margin" positions, where the
// GPU's argmax must equal the reference's. (Below it, argmaxes do flip: the emulation flips 7 of 141
// positions, at margins up to 0.024 x rms.)
inline constexpr double kGpuClearMarginPerRms = 2 * kGpuLogitErrorPerRms;
// The final norm on the GPU, relative to its largest value (emulation: 0.017-0.039); or kBf16FloorFactor x
// Hugging Face's bf16 error on the norm, whichever is larger.
inline constexpr double kGpuNormAtolPerMax = 0.06;

// Hugging Face's bf16 run vs its fp32 reference, for one prompt ("p0") or generated sequence ("g0"): the
// manifest's "hf_bf16" object. norm_max_abs_error is < 0 where not recorded (sequences).
struct Bf16Floor {
  double logits_max_abs_error = 0.0;  // max |logits_bf16 - logits_fp32|
  double logits_rms_error = 0.0;      // sqrt(mean((logits_bf16 - logits_fp32)^2))
  double norm_max_abs_error = -1.0;   // the final norm's max |bf16 - fp32|
  int64_t top1_agree = 0, rows = 0;   // rows where HF bf16's argmax equals fp32's
};
// Every "hf_bf16" of MODEL_DIR/reference/manifest.json, by prompt and sequence name. Empty when the manifest
// predates the field or is absent (then the fixed rule applies, with a notice). InputError when the manifest
// is not valid JSON or a present field is malformed.
std::map<std::string, Bf16Floor> read_bf16_floors(const std::filesystem::path& model_dir);

// The GPU's bound ε on a logit's error: max(kGpuLogitErrorPerRms x reference_rms, kBf16FloorFactor x the HF
// bf16 error) when a floor is given, else the fixed rule alone.
struct GpuLogitBound {
  double epsilon = 0.0;
  double rms_part = 0.0;     // kGpuLogitErrorPerRms x rms
  double floor_part = -1.0;  // kBf16FloorFactor x HF bf16's max error; < 0 without a floor
  double hf_error = -1.0;    // HF bf16's max error itself
  double clear_margin() const { return 2 * epsilon; }
  std::string describe() const;  // "11.96 = max(0.20 x rms 10.04, 1.5 x HF bf16 7.97)"
  double reference_rms = 0.0;
};
GpuLogitBound gpu_logit_bound(double reference_rms, const Bf16Floor* floor);
// The floor of `name` in `floors`, or nullptr.
const Bf16Floor* find_floor(const std::map<std::string, Bf16Floor>& floors, const std::string& name);
// The notice printed when a manifest has no floors.
inline constexpr const char* kNoBf16FloorNotice =
    "notice: reference/manifest.json has no \"hf_bf16\" noise floor (made before it was recorded): the GPU bound "
    "is the fixed 0.2 x rms(logits) alone; rerun weights/tools/make_reference.py for the model's own floor";

// Teacher-forced top-1 agreement: at every position (row) of a prompt, whether argmax(actual) equals
// argmax(reference), counted over the rows where the reference's top-1/top-2 margin exceeds `margin`.
struct Top1Agreement {
  int64_t positions = 0;            // rows compared
  int64_t clear = 0;                // rows whose reference margin exceeds the threshold
  int64_t agree_clear = 0;          // of those, rows where the argmaxes agree
  int64_t agree_all = 0;            // rows where the argmaxes agree, whatever the margin
  int64_t first_disagreement = -1;  // the first clear row that disagrees, or -1
  double max_abs_error = 0.0;       // max |actual - reference| over every logit
  double reference_rms = 0.0;       // sqrt(mean(reference^2))
  bool pass() const { return agree_clear == clear; }
  std::string summary() const;  // "clear 138/141 agree 138, all 140/141, max |err| 0.0123"
};
// actual, reference: F32 [rows, vocab] on the host.
Top1Agreement top1_agreement(const TensorView& actual, const TensorView& reference, double margin);

// sqrt(mean(x^2)) of a host F32 view.
double rms(const TensorView& x);

}  // namespace tvllm
