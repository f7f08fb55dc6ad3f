// Lesson 14: the latency benchmark (latency_bench.h).
#include "latency_bench.h"

#include <algorithm>
#include <vector>

#include "common/errors.h"
#include "common/random.h"
#include "generate.h"
#include "graph_runner.h"
#include "kv_cache.h"
#include "megakernel.h"  // megakernel_declines: which lm_head a batch-1 step reads

namespace tvllm {

namespace {

std::vector<int32_t> random_prompt(int64_t n, int64_t id_high, uint64_t seed) {
  Rng rng(seed);
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int32_t& id : ids) id = static_cast<int32_t>(rng.below(id_high));
  return ids;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

std::vector<LatencyVariant> progression_variants() {
  // Each row adds one step to the row above; the later steps' switches are off in the rows before them. (The
  // steps measured and not kept, FastPathOptions::pdl_attention and combine_in_decode, are off in every row.)
  const auto before_kv = [](FastPathOptions o) {
    o.kv_write_in_gemv = false;
    return o;
  };
  const auto before_streaming = [&](FastPathOptions o) {
    o = before_kv(o);
    o.stream_tiles = false;
    o.rope_in_gemv = false;
    return o;
  };
  const FastPathOptions all = fast_path_options(true, true, true, true, true);
  const auto with_pdl_attention = [](FastPathOptions o) {
    o.pdl_attention = true;
    return o;
  };
  return {{"lesson 10 (eager, cuBLAS, lesson 09 sampler)", std::nullopt},
          {"+ CUDA graphs", before_streaming(fast_path_options(false, true, false, false, false))},
          {"+ fused GEMV decode", before_streaming(fast_path_options(true, true, false, false, false))},
          {"+ fast sampler", before_streaming(fast_path_options(true, true, true, false, false))},
          {"+ programmatic dependent launch", before_streaming(fast_path_options(true, true, true, true, false))},
          {"+ fast decode attention", before_streaming(all)},
          {"+ streamed tiles, RoPE in the qkv GEMV", before_kv(all)},
          {"+ KV write in the qkv GEMV", all},
          {"(experiment) + attention as a programmatic dependent, old keys before its wait", with_pdl_attention(all)},
          {"+ megakernel (--megakernel)", fast_path_options(true, true, true, true, true, true)}};
}

namespace {

// Bytes of every weight a forward reads, from the bound views (device_bytes is the CUDA allocation only; on the
// CPU the views point into the mapped files, as stored).
double weight_bytes(const ModelWeights& w) {
  double bytes = static_cast<double>(w.final_norm.nbytes());
  for (const LayerWeights& L : w.layers) {
    bytes += static_cast<double>(L.input_norm.nbytes() + L.post_norm.nbytes() + L.wo.nbytes() + L.w_down.nbytes());
    bytes += L.packed() ? static_cast<double>(L.wqkv.nbytes() + L.w_gate_up.nbytes())
                        : static_cast<double>(L.wq.nbytes() + L.wk.nbytes() + L.wv.nbytes() + L.w_gate.nbytes() +
                                              L.w_up.nbytes());
    // FP8-resident weights (lesson 16): the codes above are 1 byte each, plus their per-row F32 scales.
    for (const TensorView* extra : {&L.bq, &L.bk, &L.bv, &L.bo, &L.b_gate, &L.b_up, &L.b_down, &L.q_norm, &L.k_norm,
                                    &L.wqkv_scale, &L.wo_scale, &L.w_gate_up_scale, &L.w_down_scale})
      if (extra->data) bytes += static_cast<double>(extra->nbytes());  // the families' biases and q/k norms
  }
  return bytes;
}

}  // namespace

double decode_bytes_per_step(const ModelWeights& w, int64_t batch, double mean_context, bool fp8_lm_head) {
  // The lm_head is read whole: its FP8 copy (codes + per-row scales, lesson 16) where the step reads that, else
  // the bf16 matrix; the embedding table only for the rows gathered, unless the step reads it whole as the
  // (tied, bf16) lm_head.
  const bool fp8_head = fp8_lm_head && w.lm_head_fp8.data != nullptr;
  const double row = static_cast<double>(w.embed.shape[1]) * static_cast<double>(dtype_size(w.embed.dtype));
  double weights = weight_bytes(w) + (fp8_head ? static_cast<double>(w.lm_head_fp8.nbytes() + w.lm_head_scale.nbytes())
                                               : static_cast<double>(w.lm_head.nbytes()));
  if (!w.tied || fp8_head) weights += static_cast<double>(batch) * row;
  const AttentionShape shape = AttentionShape::from_config(w.config);
  const double kv_per_token = static_cast<double>(KvCache::bytes_for(shape, w.config.num_hidden_layers, 1, 1, w.device));
  // A sliding window caps the keys a decode step reads at `window` (lesson 12, section 15).
  const double keys_read = shape.window > 0 ? std::min(mean_context, static_cast<double>(shape.window)) : mean_context;
  return weights + static_cast<double>(batch) * keys_read * kv_per_token;
}

DecodeLatency measure_decode_latency(const ModelWeights& w, const std::optional<FastPathOptions>& fast,
                                     int64_t batch, int64_t context, int64_t output_len, int iters, double copy_gbs) {
  const ModelConfig& c = w.config;
  TVLLM_REQUIRE(batch >= 1 && context >= 1 && output_len >= 2 && iters >= 1,
                "bench latency: batch, context >= 1, output_len >= 2, iters >= 1");
  const int64_t max_context = context + output_len;
  TVLLM_REQUIRE(max_context <= c.max_position_embeddings,
                "bench latency: context + output_len = " + std::to_string(max_context) +
                    " exceeds max_position_embeddings " + std::to_string(c.max_position_embeddings));
  Generator gen(w, Generator::limits_for(c, max_context, batch, std::min<int64_t>(max_context, 8192)));
  if (fast) use_fast_path(gen, *fast);
  std::vector<std::vector<int32_t>> prompts;
  // Ids below 1000 exist in every vocabulary worth benchmarking (and are ordinary tokens).
  const int64_t id_high = std::min<int64_t>(c.vocab_size, 1000);
  for (int64_t b = 0; b < batch; ++b) prompts.push_back(random_prompt(context, id_high, 100 + b));
  GenerateOptions options;
  options.max_new_tokens = output_len;
  options.ignore_eos = true;
  gen.generate(prompts, options);  // warm-up: module loading, cuBLAS heuristics, graph captures
  std::vector<double> ms;
  int64_t steps = 0;
  for (int i = 0; i < iters; ++i) {
    const std::vector<GenerateResult> r = gen.generate(prompts, options);
    steps = r.front().decode_steps;
    ms.push_back(r.front().decode_ms / static_cast<double>(steps));
  }
  DecodeLatency d;
  d.batch = batch;
  d.context = context;
  d.output_len = output_len;
  d.steps = steps;
  d.ms_per_step = median(ms);
  d.tok_s = static_cast<double>(batch) * 1e3 / d.ms_per_step;
  // Decode step i (1-based) attends over context + i positions: on average context + output_len / 2.
  // The megakernel (batch 1, --megakernel, where it does not decline) reads the bf16 lm_head, FP8 copy or not.
  const bool megakernel = fast && fast->fused && fast->megakernel && batch == 1 && megakernel_declines(w).empty();
  d.bytes_per_step = decode_bytes_per_step(w, batch, static_cast<double>(context) + static_cast<double>(output_len) / 2,
                                           !megakernel);
  d.gbs = d.bytes_per_step / (d.ms_per_step * 1e-3) / 1e9;
  d.pct_copy = copy_gbs > 0 ? 100.0 * d.gbs / copy_gbs : 0.0;
  if (auto* runner = dynamic_cast<const GraphRunner*>(gen.context().launcher()))
    d.graphs = static_cast<int64_t>(runner->num_graphs());
  return d;
}

PrefillLatency measure_prefill_latency(const ModelWeights& w, const std::optional<FastPathOptions>& fast,
                                       int64_t tokens, int iters, bool fast_prefill) {
  const ModelConfig& c = w.config;
  TVLLM_REQUIRE(tokens >= 1 && tokens + 1 <= c.max_position_embeddings,
                "bench latency: a prefill of " + std::to_string(tokens) + " tokens does not fit the context");
  Generator gen(w, Generator::limits_for(c, tokens + 1, 1, tokens));
  if (fast) use_fast_path(gen, *fast);
  gen.attention().set_fast_prefill(fast_prefill);
  const std::vector<int32_t> prompt = random_prompt(tokens, std::min<int64_t>(c.vocab_size, 1000), 7);
  GenerateOptions options;
  options.max_new_tokens = 1;
  options.ignore_eos = true;
  gen.generate(prompt, options);  // warm-up
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) ms.push_back(gen.generate(prompt, options).prefill_ms);
  PrefillLatency p;
  p.tokens = tokens;
  p.ms = median(ms);
  p.tok_s = static_cast<double>(tokens) * 1e3 / p.ms;
  p.tflops = forward_flops(c, {tokens}, {tokens}, 1) / (p.ms * 1e-3) / 1e12;
  return p;
}

}  // namespace tvllm
