// What generate and chat share: loading a model for generation (lessons 08-10) with its tokenizer and chat
// template, and the sampling flags.
#pragma once

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "chat_template.h"
#include "generate.h"
#include "model_dir.h"
#include "model_weights.h"
#include "sampling.h"
#include "token_args.h"  // load_tokenizer, parse_ids
#include "tokenizer.h"
#ifdef TVLLM_CLI_FAST
#include "fast_path.h"
#endif

namespace tvllm {
class Engine;            // lesson 11 (serve and bench throughput install the fast path on one)
struct PagedKvOptions;   // lesson 12 (serve and bench throughput: --kv-cache-dtype)
}

namespace tvllm::cli {

// The sampling knobs of generate and chat. Defaults: greedy (temperature 0), top-k and top-p off, seed 0.
struct SamplingFlags {
  float temperature = 0.0f;
  float top_p = 1.0f;
  int top_k = 0;
  uint64_t seed = 0;
  void add_to(CLI::App* cmd);
  SamplingParams params() const;  // validated: InputError naming the flag
};

// Lesson 14's fast path on CUDA (fused GEMV decode, CUDA graphs, the fast sampler, the fast decode attention), on
// by default.
// --fp8-weights auto|resident|dequantize (lesson 16): how an FP8 checkpoint's Linear weights are loaded. auto:
// resident (the fused decode GEMVs read the E4M3 codes) where the fused path runs on CUDA, else dequantized to
// bf16 at load. resident: required (InputError when the model is not FP8, the device not CUDA, --no-fused, or
// lesson 16 is not built); installs lesson 16's dequantizer for the prefill GEMMs. For a model directory
// without config.json: Dequantize (ModelDir::open then says what is wrong).
// auto keeps them resident only for one sequence at a time (one_sequence: generate, chat): measured on the H200,
// FP8 resident decodes batch 1 1.29x faster than bf16 but batch 8 2.7x slower (the FP8 GEMV is compute-bound
// there, lesson 16 section 7.2), so serve and the benches load bf16 unless resident is asked for.
// gemm: --fp8-gemm auto|scale-vectors|epilogue|dequantize (lesson 16, README 7.3): with resident weights, which
// product steps of 17+ tokens run (auto: cuBLASLt's FP8 tensor cores with scale vectors where it has them, else
// with an epilogue kernel, else the bf16 GEMM on dequantized weights); installed here. InputError for an unknown
// choice, or scale-vectors / epilogue with weights that end up not resident.
Fp8Load resolve_fp8_weights(const std::string& choice, const std::filesystem::path& dir, Device device, bool fused,
                            bool one_sequence = false, const std::string& gemm = "auto");
// The startup notice's words for it ("" for a checkpoint that is not FP8).
std::string describe_fp8_load(const ModelConfig& config, Fp8Load mode);
void add_fp8_weights_option(CLI::App* cmd, std::string& choice);
void add_fp8_gemm_option(CLI::App* cmd, std::string& choice);
// --fp8-lm-head (lesson 16, README 7.4): an FP8 copy of the lm_head (E4M3, one scale per vocabulary entry,
// quantized at load) for the fused decode GEMV; off by default (published FP8 checkpoints keep it bf16). Valid only
// with FP8-resident weights: require_fp8_lm_head throws InputError otherwise (also without lesson 16). Then, after
// binding, attach_fp8_lm_head_if quantizes it into the weights (nothing when off).
void add_fp8_lm_head_option(CLI::App* cmd, bool& on);
void require_fp8_lm_head(bool on, Fp8Load weights);
void attach_fp8_lm_head_if(bool on, ModelWeights& weights);
// For the banners: ", FP8 lm_head (E4M3, per-row scales)" when on, else "".
std::string describe_fp8_lm_head(bool on);
// For the bench JSON: {"path": the installed --fp8-gemm, "calls": {"scale_vectors": n, "epilogue": n,
// "dequantize": n}} (projections of steps of 17+ tokens since the start; a CUDA graph counts once). Null without
// lesson 16.
nlohmann::json fp8_gemm_report();

// --kv-cache-dtype auto|bf16|fp8 (lesson 16, vLLM's flag and spelling): how k and v are stored. auto: the model's
// dtype. fp8: E4M3 codes with one scale per layer for k and one for v (the checkpoint's k_scale / v_scale, else
// 1.0), in the engine's paged pool only.
void add_kv_cache_dtype_option(CLI::App* cmd, std::string& choice);
// --async-scheduling / --no-async-scheduling (lesson 14, vLLM's flag; on by default for serve and bench throughput):
// EngineConfig::async_scheduling, the next step launched before the last one's ids are back.
void add_async_scheduling_flag(CLI::App* cmd, bool& on);
// generate, chat, bench latency run lesson 10's contiguous cache, which stores the model's dtype: fp8 is an
// InputError that names the commands that have it (serve, bench throughput); auto and bf16 pass.
void require_generator_kv_cache_dtype(const std::string& choice, const char* command);
// serve and bench throughput: sets options.kv_dtype and, for fp8, the checkpoint's scales. InputError for fp8 with
// --kv contiguous (lesson 10's cache stores bf16) or --batch-invariant (its guarantee is tested for bf16 only).
// Returns the banner's words: "" for bf16, else e.g. "FP8 KV cache (E4M3, scales 1.0)".
std::string apply_kv_cache_dtype(const std::string& choice, const ModelDir& model, bool paged, bool batch_invariant,
                                 PagedKvOptions& options);

// --tensor-parallel-size N (vLLM's name; lesson 17): the GPUs one model is cut across. 1, the default, is what every
// command runs. N > 1 is an InputError that says why: fewer than N GPUs here, or (with enough of them) that the
// engine does not run over several ranks yet (lesson 17 builds and checks the sharded forward,
// lesson17_tensor_parallel; the engine over N ranks is its next step). N < 1: an InputError too.
void add_tensor_parallel_option(CLI::App* cmd, int& size);
void require_tensor_parallel_size(int size, const char* command);

struct FastPathFlags {
  bool enforce_eager = false, no_fused = false, no_fast_sampler = false, no_pdl = false, no_fast_attention = false,
       megakernel = false;
  bool no_hopper_attention = false;  // --no-hopper-attention: lesson 15's prefill attention off (sm_90 only)
  bool hopper_gemm = false;          // --hopper-gemm: lesson 15's GEMM for large steps (sm_90; off: no faster)
  bool no_hopper_mlp = false;        // --no-hopper-mlp: lesson 15's one-kernel gated MLP off (sm_90 only)
  int max_graph_batch = 0;  // --max-graph-batch: 0 every decode batch; 64 the behaviour before padded buckets
  std::string fp8_weights = "auto";  // --fp8-weights (lesson 16)
  std::string fp8_gemm = "auto";     // --fp8-gemm (lesson 16)
  bool fp8_lm_head = false;          // --fp8-lm-head (lesson 16)
  bool one_sequence = false;         // generate and chat: one sequence at a time (auto may keep FP8 resident)
  Fp8Load fp8_load(const std::filesystem::path& dir, Device device) const {
    return resolve_fp8_weights(fp8_weights, dir, device, !no_fused, one_sequence, fp8_gemm);
  }
  void add_to(CLI::App* cmd);
  // Installs it on the generator or the engine (nothing on the CPU, nor in a student workspace without lesson 14).
  void apply(Generator& gen) const;
  void apply(Engine& engine) const;
  // The engine's warm-up including the decode graphs of batch sizes 1, 2, 4, ... (Engine::warm_up). Returns its
  // steps.
  int64_t warm_up(Engine& engine) const;
  // One line for the command's banner: what runs (with the config: whether the fused decode path declines it,
  // and how an FP8 checkpoint's weights were loaded; with batch invariance: lesson 15's kernels stay off).
  std::string describe(Device device, const ModelConfig* config = nullptr, Fp8Load fp8 = Fp8Load::Dequantize,
                       bool batch_invariant = false) const;
#ifdef TVLLM_CLI_FAST
  FastPathOptions options() const;
#endif
};

// A model opened for generation: config and weights mapped (ModelDir), the weights bound for the device
// (lesson 08: on the CPU views into the mapping, on CUDA one upload through a small staging buffer; neither
// keeps a second host copy), and the tokenizer when the directory has tokenizer.json.
struct LoadedModel {
  explicit LoadedModel(ModelDir opened) : model(std::move(opened)) {}
  std::filesystem::path dir;
  Device device = Device::CPU;
  ModelDir model;
  std::optional<Tokenizer> tokenizer;
  std::optional<ModelWeights> weights;  // bind_weights()
  Fp8Load fp8 = Fp8Load::Dequantize;     // how an FP8 checkpoint was opened (--fp8-weights)
  bool fp8_lm_head = false;              // --fp8-lm-head: bind_weights() attaches the FP8 copy

  // Opens DIR (config.json, weights, tokenizer.json if present) without touching the device yet, so that
  // the request can be validated first. device_text: auto|cpu|cuda (cuda without a GPU: InputError).
  // fast: the command's fast-path flags, which decide how an FP8 checkpoint loads (nullptr: dequantized) and
  // whether its lm_head gets an FP8 copy (--fp8-lm-head: InputError here unless the weights load resident).
  static std::unique_ptr<LoadedModel> open(const std::string& dir, const std::string& device_text,
                                           const FastPathFlags* fast = nullptr);
  void bind_weights();

  // The tokenizer, or an InputError saying the directory has none and what to do instead.
  const Tokenizer& require_tokenizer(const std::string& way_out) const;
  // DIR's chat template (InputError when it has none, or one of no family we render).
  ChatTemplate require_chat_template() const;
};

// CUDA: one short untimed generation (the first tokens of `prompt`, two new tokens) so that the timings a
// command prints are the steady state, not CUDA's lazy module loading and cuBLAS's first-call setup.
// Nothing on the CPU.
void warm_up(Generator& gen, const std::vector<int32_t>& prompt);

// "12.3" with a sensible number of digits for timings.
std::string fixed(double value, int digits = 1);

// --enable-thinking true|false for generate --chat and chat: the chat template variable of that name, spelled as
// transformers' apply_chat_template(enable_thinking=...) and vLLM's chat_template_kwargs spell it (one name in
// the CLI, the library and the server). Only "true" and "false" are accepted (exit 2 otherwise).
CLI::Option* add_enable_thinking_option(CLI::App* cmd, bool& enable_thinking);
// When --enable-thinking was given for a template without that switch: one note on stderr (it changes nothing,
// as with transformers, whose templates simply never read the variable).
void note_thinking_switch(const ChatTemplate& tmpl, bool given, const char* command);

}  // namespace tvllm::cli
