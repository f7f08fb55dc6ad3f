// Lesson 14: the fast path, installed into the loops of lessons 10 and 11 through their seams.
//
//   use_fast_path(generator)   lesson 10's Generator: `tiny-vllm generate` and `chat`
//   use_fast_path(engine)      lesson 11's Engine: `tiny-vllm serve`, `bench throughput`, `bench latency`
//
// Independent parts, each a switch (the chapter measures each one's gain alone):
//   fused        ExecContext::set_forward(fast_forward): the fused GEMV decode path (fast_forward.h)
//   pdl          with fused: fast_forward_pdl instead, the fused GEMVs launched as programmatic dependents of the
//                kernel before each (pdl.h), where the GPU can (sm_90+, pdl_supported()); the same bits
//   graphs       ExecContext::set_launcher(GraphRunner): decode steps replayed as CUDA graphs; with
//                enforce_eager (vLLM's --enforce-eager) a PinnedEagerLauncher instead, which launches the same
//                kernels with the same splits eagerly: the same tokens, only slower
//   fast_sampler set_sampler(FastSampler): top-k / top-p without a sort, the same ids as lesson 09's
//   megakernel   with fused: megakernel_forward, the whole batch-1 decode step as one persistent kernel
//                (megakernel.h), where megakernel_declines() is empty; other steps run the fused path
//   fast_attention  install_fast_decode_attention() and DecodeAttention::Fast on the attention backend: decode
//                steps read the KV cache with decode_attention_fast.cuh where it pays (fast_decode_attention_pays:
//                head_dim <= 64, measured), and never in batch-invariant mode, whose Flash kernel is the point of
//                that mode
// On the CPU nothing is installed: the CPU path is the fp32 reference and stays as it is.
#pragma once

#include <string>
#include <vector>

#include "engine.h"
#include "generate.h"
#include "graph_runner.h"

namespace tvllm {

struct FastPathOptions {
  bool fused = true;
  bool graphs = true;          // false: --enforce-eager
  bool fast_sampler = true;
  // Decode steps of up to max_graph_batch sequences replay CUDA graphs (0: the loop's max_sequences, i.e. every
  // decode step); more run eagerly. Up to exact_graph_batch each batch size has its own graph; above, steps are
  // padded up to buckets of graph_bucket_step sequences (graph_runner.h, chapter section 3).
  int max_graph_batch = 0;
  int exact_graph_batch = 64;
  int graph_bucket_step = 16;
  bool pdl = true;             // false: --no-pdl. Only where pdl_supported(); needs fused
  bool fast_attention = true;  // false: --no-fast-attention. Lesson 14's decode attention kernel
  // true: --megakernel. With fused, batch-1 decode steps run the megakernel (megakernel.h) where it takes the
  // model and the GPU (sm_90+); every other step keeps the fused path. Off by default: its first version was
  // measured slower than the fused path on the H200 (chapter, section 14).
  bool megakernel = false;
  // The fused GEMVs' last two steps (chapter sections 4 and 5), on by default; the progression measures the step
  // without them. Both give the same bits. stream_tiles: each block streams tiles, loading the next one's weights
  // while it reduces the current one (gemv.h, set_gemv_tile_streaming); rope_in_gemv: RoPE in the QKV GEMV's
  // epilogue (fast_forward.h, set_fused_rope). Process-wide settings: the last use_fast_path() sets them.
  bool stream_tiles = true;
  bool rope_in_gemv = true;
  // kv_write_in_gemv (chapter section 5), on by default, the same bits: with rope_in_gemv, a decode step's k and
  // v are stored into the KV cache by the QKV GEMV (set_kv_write_in_gemv), and the backend attends without its
  // write kernel.
  bool kv_write_in_gemv = true;
  // Two steps measured and not kept (chapter section 11's ledger), off by default, here to be measured again.
  // pdl_attention (section 7): with pdl, lesson 14's decode attention is launched as a programmatic dependent too
  // (set_fast_decode_pdl); the same bits. combine_in_decode (section 8): the last split block of each head
  // combines the splits in the decode kernel instead of a second kernel (set_fast_decode_combine_in_kernel);
  // within one bf16 rounding of the combine kernel, deterministic either way.
  bool pdl_attention = false;
  bool combine_in_decode = false;
};

// The switches of the fast path as one value (each on or off), for the progression and the tests. The megakernel
// is off unless asked for: the rows before it in the progression measure the fused path alone.
FastPathOptions fast_path_options(bool fused, bool graphs, bool fast_sampler, bool pdl, bool fast_attention,
                                  bool megakernel = false);

// Whether `options` launch the fused GEMVs as programmatic dependents on this machine: fused and pdl asked for,
// a CUDA device, and pdl_supported().
bool fast_path_uses_pdl(const FastPathOptions& options, Device device);

// The graph batch sizes `options` give a loop of max_sequences (max_graph_batch 0 resolved to max_sequences).
GraphBuckets graph_buckets(const FastPathOptions& options, int64_t max_sequences);

// What was installed, for the command line's one-line notice ("fused GEMV decode with PDL, CUDA graphs for every
// decode batch (exact <= 64, padded to multiples of 16 above), fast sampler, fast decode attention").
// With the model's config, says when the fused GEMV path declines the model (an o_proj or MLP bias:
// fast_forward_declines) and the composed kernels run instead.
std::string describe_fast_path(const FastPathOptions& options, Device device, const ModelConfig* config = nullptr);

void use_fast_path(Generator& generator, const FastPathOptions& options = {});
void use_fast_path(Engine& engine, const FastPathOptions& options = {});

// The decode batch sizes whose graphs Engine::warm_up should capture before a server takes requests: 1, 2, 4, 8,
// ... up to exact_graph_batch, then every padded bucket up to the engine's max_sequences and max_graph_batch
// (80, 96, ..., 256 for 256 sequences; none without graphs, or on the CPU). The exact sizes between powers of two
// are captured the first time they decode (a few milliseconds each).
std::vector<int64_t> warm_up_batches(const Engine& engine, const FastPathOptions& options = {});
// The prompt lengths Engine::warm_up should prefill once on the GPU (Engine::warm_up_prefill_lengths); none on the
// CPU, where nothing is loaded lazily and a long prefill would only slow the start.
std::vector<int64_t> warm_up_prefills(const Engine& engine);

}  // namespace tvllm
