// Lesson 08: how logits are judged against the Hugging Face reference (shared by the lesson executable and
// the tests). README "What correct means" derives every number.
#pragma once

#include <cstdint>
#include <string>

#include "common/tensor.h"
#include "common/validate.h"

namespace tvllm {

// CPU (fp32 everywhere, double-accumulated GEMMs) vs Hugging Face's fp32 run of the same stored weights: the
// two differ by fp32 summation order and libm ulps (~1e-7 relative per op), amplified on the way through the
// layers (a norm divides by the rms, the residual stream grows to ~40, attention sharpens differences). The
// error is absolute-like: about the same on small and large logits, growing with the prompt. Stated per the
// largest |value| of the reference tensor: measured on the bundled model, max |err| = 5.1e-6 x max|logit|
// (2.1e-4 on logits up to 42) and 4.8e-6 x max|norm|; we allow 10x that. A bug moves values by O(1).
inline constexpr double kCpuLogitsAtolPerMax = 5e-5;
inline constexpr double kCpuNormAtolPerMax = 5e-5;

// GPU (bf16 activations, fp32 accumulation) vs Hugging Face fp32. Every op rounds its output to bf16 (2^-9
// relative on average, 2^-8 at most), a dozen times per layer, and the residual stream, ~40 in size, is
// itself stored in bf16 (a rounding of up to 0.125 on every add). A logit is a sum of hidden-size products
// of both signs, so these relative errors become absolute errors of a fraction of the logits' spread. Stated
// per rms(reference logits) (their root mean square over the prompt) so that it scales with the model.
// emulate_bf16.py (this folder) replays the GPU path's roundings in numpy: on the bundled model the max
// |logit error| is 0.10-0.15 x rms over 141k logits (std 0.015-0.023 x rms). We allow:
inline constexpr double kGpuLogitErrorPerRms = 0.2;
// A top-1 decision is certain when the reference's top-1/top-2 margin exceeds TWICE the largest error (the
// two logits may move that much in opposite directions): those are the "clear-margin" positions, where the
// GPU's argmax must equal the reference's. (Below it, argmaxes do flip: the emulation flips 7 of 141
// positions, at margins up to 0.024 x rms.)
inline constexpr double kGpuClearMarginPerRms = 2 * kGpuLogitErrorPerRms;
// The final norm on the GPU, relative to its largest value (emulation: 0.017-0.039).
inline constexpr double kGpuNormAtolPerMax = 0.06;

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
