// Lesson 14: installing the fast path (fast_path.h).
#include "fast_path.h"

#include <algorithm>
#include <memory>
#include <string>

#include "decode_attention_fast.h"
#include "fast_forward.h"
#include "common/errors.h"
#include "fast_sampler.h"
#include "gemv.h"
#include "graph_runner.h"
#include "megakernel.h"
#include "pdl.h"

namespace tvllm {

namespace {

// max_sequences: the loop's sequences (graph buckets); max_rows: its logits rows (the sampler).
// use_fast_attention: makes DecodeAttention::Fast the backend's decode kernel unless it attends with Flash (batch
// invariance); returns the kernel decode steps will use, whose split policy the launchers pin.
void install(ExecContext& ctx, const ModelWeights& w, int max_sequences, int max_rows, const FastPathOptions& o,
             const std::function<void(std::unique_ptr<TokenSampler>)>& set_sampler,
             const std::function<DecodeAttention()>& use_fast_attention) {
  if (w.device != Device::CUDA) return;
  set_gemv_tile_streaming(o.stream_tiles);
  set_fused_rope(o.rope_in_gemv);
  set_kv_write_in_gemv(o.kv_write_in_gemv);
  set_fast_decode_pdl(o.pdl_attention && fast_path_uses_pdl(o, w.device));
  set_fast_decode_combine_in_kernel(o.combine_in_decode);
  if (o.fused && fast_forward_supported(w))
    ctx.set_forward(fast_path_uses_pdl(o, w.device) ? fast_forward_pdl : fast_forward);
  // Batch-1 decode steps as one kernel (megakernel.h); it reads lesson 10's contiguous cache and lesson 12's pool.
  if (o.fused && o.megakernel && fast_forward_supported(w) && megakernel_prepare(ctx, w))
    ctx.set_forward(megakernel_forward);
  const AttentionShape shape = AttentionShape::from_config(w.config);
  DecodeAttention decode = DecodeAttention::Split;
  if (o.fast_attention && fast_decode_attention_pays(shape)) {
    install_fast_decode_attention();
    decode = use_fast_attention();
  }
  // Both launchers get the same buckets: --enforce-eager pads the steps the graphs pad, for the same ids.
  const GraphBuckets buckets = graph_buckets(o, max_sequences);
  if (o.graphs) {
    ctx.set_launcher(std::make_unique<GraphRunner>(shape, buckets, decode));
  } else {
    ctx.set_launcher(std::make_unique<PinnedEagerLauncher>(shape, buckets, decode));
  }
  if (o.fast_sampler) set_sampler(std::make_unique<FastSampler>(max_rows, w.config.vocab_size));
}

}  // namespace

GraphBuckets graph_buckets(const FastPathOptions& o, int64_t max_sequences) {
  TVLLM_REQUIRE(o.max_graph_batch >= 0, "max_graph_batch must be >= 0 (0: every decode batch), got " +
                                            std::to_string(o.max_graph_batch));
  GraphBuckets b;
  b.exact = o.exact_graph_batch;
  b.step = o.graph_bucket_step;
  b.max_batch = o.max_graph_batch == 0 ? max_sequences : std::min<int64_t>(o.max_graph_batch, max_sequences);
  return b;
}

FastPathOptions fast_path_options(bool fused, bool graphs, bool fast_sampler, bool pdl, bool fast_attention,
                                  bool megakernel) {
  FastPathOptions o;
  o.fused = fused;
  o.graphs = graphs;
  o.fast_sampler = fast_sampler;
  o.pdl = pdl;
  o.fast_attention = fast_attention;
  o.megakernel = megakernel;
  return o;
}

bool fast_path_uses_pdl(const FastPathOptions& o, Device device) {
  return o.fused && o.pdl && device == Device::CUDA && pdl_supported();
}

std::string describe_fast_path(const FastPathOptions& o, Device device, const ModelConfig* config) {
  if (device != Device::CUDA) return "CPU reference path (the fast path is for CUDA)";
  const std::string declined = config ? fast_forward_declines(*config) : "";
  std::string s = !o.fused ? "composed kernels"
                  : declined.empty()
                      ? "fused GEMV decode"
                      : "composed kernels (the fused GEMV decode does not compute this model's " + declined + ")";
  if (o.fused && declined.empty())
    s += fast_path_uses_pdl(o, device) ? " with PDL" : o.pdl ? " (no PDL: needs sm_90+)" : " (--no-pdl)";
  const std::string padded = " (exact <= " + std::to_string(o.exact_graph_batch) + ", padded to multiples of " +
                             std::to_string(o.graph_bucket_step) + " above)";
  s += !o.graphs                 ? ", eager (--enforce-eager)"
       : o.max_graph_batch == 0 ? ", CUDA graphs for every decode batch" + padded
                                : ", CUDA graphs for decode batches <= " + std::to_string(o.max_graph_batch) + padded;
  if (o.fused && declined.empty()) {
    const std::string mk = config ? megakernel_declines(*config) : "";
    s += !o.megakernel  ? ""
         : mk.empty()   ? ", megakernel for batch-1 decode (--megakernel, sm_90+)"
                        : ", no megakernel (it does not take this model's " + mk + ")";
  }
  s += o.fast_sampler ? ", fast sampler" : ", lesson 09 sampler";
  if (!o.fast_attention) {
    s += ", lesson 10 decode attention";
  } else if (config && !fast_decode_attention_pays(AttentionShape::from_config(*config))) {
    s += ", lesson 10 decode attention (head_dim " + std::to_string(config->head_dim) +
         ": lesson 14's kernel is slower there)";
  } else {
    s += ", fast decode attention";
  }
  return s;
}

void use_fast_path(Generator& gen, const FastPathOptions& o) {
  install(
      gen.context(), gen.weights(), static_cast<int>(gen.limits().max_sequences),
      static_cast<int>(gen.limits().max_sequences), o,
      [&](std::unique_ptr<TokenSampler> s) { gen.set_sampler(std::move(s)); },
      [&] {
        // Generator::set_batch_invariant(true) chose Flash: keep it. (Turning batch invariance off afterwards
        // goes back to lesson 10's Split kernel: correct, only slower; call use_fast_path again to come back.)
        if (gen.attention().decode_kind() != DecodeAttention::Flash)
          gen.attention().set_decode_attention(DecodeAttention::Fast);
        return gen.attention().decode_kind();
      });
}

void use_fast_path(Engine& engine, const FastPathOptions& o) {
  install(
      engine.context(), engine.weights(), static_cast<int>(engine.limits().max_sequences),
      static_cast<int>(engine.limits().max_logits_rows), o,
      [&](std::unique_ptr<TokenSampler> s) { engine.set_sampler(std::move(s)); },
      [&] {
        if (engine.config().batch_invariant) return DecodeAttention::Flash;  // the engine chose Flash: keep it
        engine.kv().set_decode_attention(DecodeAttention::Fast);
        return DecodeAttention::Fast;
      });
}

std::vector<int64_t> warm_up_prefills(const Engine& engine) {
  return engine.device() == Device::CUDA ? engine.warm_up_prefill_lengths() : std::vector<int64_t>{};
}

std::vector<int64_t> warm_up_batches(const Engine& engine, const FastPathOptions& o) {
  std::vector<int64_t> sizes;
  if (engine.device() != Device::CUDA || !o.graphs) return sizes;
  const GraphBuckets buckets = graph_buckets(o, engine.limits().max_sequences);
  const int64_t small = std::min(buckets.max_batch, buckets.exact);
  for (int64_t b = 1; b <= small; b *= 2) sizes.push_back(b);
  for (int64_t b : buckets.buckets()) sizes.push_back(b);  // every padded bucket: a step of any size above lands on one
  return sizes;
}

}  // namespace tvllm
