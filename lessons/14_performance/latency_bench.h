// Lesson 14: the latency benchmark (`tiny-vllm bench latency`, and the lesson executable's --bench).
//
// What a user of `tiny-vllm generate` feels, measured through lesson 10's Generator exactly as the command runs
// it (host work, the one synchronisation per step and the sampler included), with or without the fast path:
//   decode   B prompts of `context` random tokens, then `output_len` new tokens each (EOS ignored); the decode
//            steps' time, per step and per token, and the bytes a step must read from HBM (every weight once,
//            and each sequence's cached k and v) per second, as a share of the measured copy bandwidth: the
//            memory roofline of decode
//   prefill  one prompt of `tokens` tokens to its first new token: tokens/s and TFLOP/s
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "fast_path.h"
#include "model_weights.h"

namespace tvllm {

// Bytes one decode step of `batch` sequences must read: every weight once (the embedding table only for the
// rows it gathers, unless it is also the lm_head) plus each sequence's cached k and v over `mean_context`
// positions. The lm_head counts as its FP8 copy (codes + scales) where the weights carry one (lesson 16's
// --fp8-lm-head) and fp8_lm_head says the step reads it (false: the megakernel, which reads the bf16 lm_head).
double decode_bytes_per_step(const ModelWeights& weights, int64_t batch, double mean_context,
                             bool fp8_lm_head = true);

struct DecodeLatency {
  int64_t batch = 0, context = 0, output_len = 0, steps = 0;
  double ms_per_step = 0.0;     // median over the timed runs
  double tok_s = 0.0;           // batch / ms_per_step
  double bytes_per_step = 0.0;  // decode_bytes_per_step at the run's mean context
  double gbs = 0.0;             // bytes_per_step / ms_per_step
  double pct_copy = 0.0;        // gbs as a share of the measured copy bandwidth (0 when not measured)
  int64_t graphs = 0;           // CUDA graphs captured (fast path with graphs)
};

struct PrefillLatency {
  int64_t tokens = 0;
  double ms = 0.0, tok_s = 0.0, tflops = 0.0;
};

// The chapter's progression, one technique at a time: lesson 10 as it is (nullopt), then + CUDA graphs, + the
// fused GEMV decode, + the fast sampler, + programmatic dependent launch (on a GPU without it, that row runs the
// same kernels as the one before), + the fast decode attention, + streamed GEMV tiles and RoPE in the qkv GEMV
// (the default fast path), + the opt-in megakernel. Used by `bench latency --compare` and the lesson executable's
// --bench.
struct LatencyVariant {
  std::string name;
  std::optional<FastPathOptions> fast;
};
std::vector<LatencyVariant> progression_variants();

// `fast`: the fast path to install (nullopt: lesson 10's Generator as it is). iters >= 1 timed runs after one
// warm-up run (which captures the graphs the timed runs replay). copy_gbs: the ceiling (0: no percentage).
DecodeLatency measure_decode_latency(const ModelWeights& weights, const std::optional<FastPathOptions>& fast,
                                     int64_t batch, int64_t context, int64_t output_len, int iters, double copy_gbs);
// fast_prefill: the generator's attention asks lesson 07's fresh-prefill seam first (AttentionBackend::
// set_fast_prefill): lesson 15's kernel when the caller installed it, lesson 10's flash kernel otherwise.
PrefillLatency measure_prefill_latency(const ModelWeights& weights, const std::optional<FastPathOptions>& fast,
                                       int64_t tokens, int iters, bool fast_prefill = false);

}  // namespace tvllm
