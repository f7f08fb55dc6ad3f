// Shared pieces of generate and chat (session.h).
#include "session.h"

#include <algorithm>
#include <cstdio>

#include "common/device.h"
#include "common/errors.h"
#ifdef TVLLM_CLI_ENGINE
#include "engine_paged.h"  // --kv-cache-dtype (lesson 16's FP8 pool)
#endif
#ifdef TVLLM_CLI_FAST
#include "engine.h"
#include "fast_path.h"
#endif
#ifdef TVLLM_CLI_HOPPER
#include "hopper.h"
#include "prefill_hook.h"
#endif
#ifdef TVLLM_CLI_QUANTIZE
#include "fp8_gemm.h"
#include "fp8_resident.h"
#endif

namespace tvllm::cli {

namespace fs = std::filesystem;

void SamplingFlags::add_to(CLI::App* cmd) {
  cmd->add_option("--temperature", temperature, "0: greedy (the default); otherwise > 0, e.g. 0.7");
  cmd->add_option("--top-p", top_p,
                  "keep the most likely tokens up to this probability mass, in (0, 1] (1: off)");
  cmd->add_option("--top-k", top_k, "keep the k most likely tokens (0: off)");
  cmd->add_option("--seed", seed, "the seed: with the step, it decides every draw (same seed, same tokens)");
}

SamplingParams SamplingFlags::params() const {
  const SamplingParams p{temperature, top_k, top_p, seed};
  try {
    validate_sampling_params(p);
  } catch (const InputError& e) {
    throw InputError(std::string("bad sampling flags (--temperature, --top-k, --top-p): ") + e.what());
  }
  return p;
}

namespace {

Fp8Load resolve_fp8_load(const std::string& choice, const fs::path& dir, Device device, bool fused,
                         bool one_sequence) {
  if (choice != "auto" && choice != "resident" && choice != "dequantize")
    throw InputError("--fp8-weights: expected auto, resident or dequantize, got \"" + choice + "\"");
  if (choice == "auto" && !one_sequence) return Fp8Load::Dequantize;  // batches: bf16 is faster (session.h)
  std::error_code ec;
  if (!fs::exists(dir / "config.json", ec)) return Fp8Load::Dequantize;  // ModelDir::open says what is missing
#ifdef TVLLM_CLI_QUANTIZE
  return fp8_weights_mode(choice, load_model_config(dir), device == Device::CUDA, fused);
#else
  (void)device, (void)fused;
  if (choice == "resident") throw InputError("--fp8-weights resident: needs lesson 16 (FP8), not built here");
  return Fp8Load::Dequantize;
#endif
}

}  // namespace

Fp8Load resolve_fp8_weights(const std::string& choice, const fs::path& dir, Device device, bool fused,
                            bool one_sequence, const std::string& gemm) {
  const Fp8Load mode = resolve_fp8_load(choice, dir, device, fused, one_sequence);
#ifdef TVLLM_CLI_QUANTIZE
  const Fp8GemmPath path = fp8_gemm_mode(gemm, mode == Fp8Load::Resident);  // validated whatever the load
  if (mode == Fp8Load::Resident) {
    install_fp8_resident_weights();      // the dequantizer: small steps, and what the FP8 GEMM declines
    install_fp8_tensor_core_gemm(path);  // steps of 17+ tokens (README 7.3)
  }
#else
  if (gemm != "auto" && gemm != "dequantize")
    throw InputError("--fp8-gemm " + gemm + ": needs lesson 16 (FP8), not built here");
#endif
  return mode;
}

nlohmann::json fp8_gemm_report() {
#ifdef TVLLM_CLI_QUANTIZE
  const Fp8GemmCounts c = fp8_gemm_counts();
  return {{"path", std::string(fp8_gemm_path_name(installed_fp8_gemm_path()))},
          {"calls", {{"scale_vectors", c.scale_vectors}, {"epilogue", c.epilogue}, {"dequantize", c.dequantize}}}};
#else
  return nullptr;
#endif
}

void add_fp8_lm_head_option(CLI::App* cmd, bool& on) {
  cmd->add_flag("--fp8-lm-head", on,
                "with resident FP8 weights: an FP8 copy of the lm_head (E4M3, a scale per vocabulary entry, quantized "
                "at load) for the decode GEMV; off by default (published FP8 checkpoints keep it bf16)");
}

void require_fp8_lm_head(bool on, Fp8Load weights) {
#ifdef TVLLM_CLI_QUANTIZE
  tvllm::require_fp8_lm_head(on, weights == Fp8Load::Resident);
#else
  (void)weights;
  if (on) throw InputError("--fp8-lm-head: needs lesson 16 (FP8), not built here");
#endif
}

void attach_fp8_lm_head_if(bool on, ModelWeights& weights) {
  if (!on) return;
#ifdef TVLLM_CLI_QUANTIZE
  tvllm::attach_fp8_lm_head(weights);
#else
  (void)weights;
  throw InputError("--fp8-lm-head: needs lesson 16 (FP8), not built here");
#endif
}

std::string describe_fp8_lm_head(bool on) { return on ? ", FP8 lm_head (E4M3, per-row scales)" : ""; }

std::string describe_fp8_load(const ModelConfig& config, Fp8Load mode) {
#ifdef TVLLM_CLI_QUANTIZE
  return describe_fp8_weights(config, mode);
#else
  (void)mode;
  return config.quantization ? "FP8 weights dequantized to bf16 at load" : "";
#endif
}

void add_fp8_weights_option(CLI::App* cmd, std::string& choice) {
  cmd->add_option("--fp8-weights", choice,
                  "an FP8 checkpoint's weights: auto (resident for generate/chat on CUDA with the fused decode, "
                  "else dequantized), "
                  "resident (E4M3 codes on the GPU, read by the decode GEMVs), dequantize (bf16 at load)")
      ->check(CLI::IsMember({"auto", "resident", "dequantize"}))
      ->type_name("auto|resident|dequantize");
}

void add_tensor_parallel_option(CLI::App* cmd, int& size) {
  cmd->add_option("--tensor-parallel-size", size,
                  "the GPUs the model is cut across (lesson 17); only 1 runs in this engine for now")
      ->type_name("N")
      ->capture_default_str();
}

void require_tensor_parallel_size(int size, const char* command) {
  TVLLM_REQUIRE(size >= 1, "--tensor-parallel-size must be at least 1, got " + std::to_string(size));
  if (size == 1) return;
  const int gpus = cuda_device_count();
  if (gpus < size) {
    throw InputError("--tensor-parallel-size " + std::to_string(size) + " needs " + std::to_string(size) +
                     " GPUs; this machine has " + std::to_string(gpus) + " (use --tensor-parallel-size 1)");
  }
  throw InputError(std::string("--tensor-parallel-size ") + std::to_string(size) + ": " + command +
                   " runs its engine on one GPU; lesson 17 builds the sharded forward and checks it "
                   "(lesson17_tensor_parallel), the engine over several ranks is not built yet (use 1)");
}

void add_fp8_gemm_option(CLI::App* cmd, std::string& choice) {
  cmd->add_option("--fp8-gemm", choice,
                  "with resident FP8 weights, the GEMM of steps of 17+ tokens: auto (FP8 tensor cores through "
                  "cuBLASLt: scale vectors, else an epilogue kernel, else dequantize), scale-vectors, epilogue, "
                  "dequantize (bf16 GEMM on the weight dequantized just before it)")
      ->check(CLI::IsMember({"auto", "scale-vectors", "epilogue", "dequantize"}))
      ->type_name("auto|scale-vectors|epilogue|dequantize");
}

void add_kv_cache_dtype_option(CLI::App* cmd, std::string& choice) {
  cmd->add_option("--kv-cache-dtype", choice,
                  "how k and v are stored: auto (the model's dtype), bf16, fp8 (E4M3, one scale per layer for k "
                  "and for v: half the bytes; the engine's paged pool only)")
      ->check(CLI::IsMember({"auto", "bf16", "fp8"}))
      ->type_name("auto|bf16|fp8");
}

void add_async_scheduling_flag(CLI::App* cmd, bool& on) {
  cmd->add_flag("--async-scheduling,!--no-async-scheduling", on,
                "schedule and launch each step before the last one's ids are back (vLLM's flag; lesson 14; the "
                "default: --no-async-scheduling waits for each step's ids first)");
}

void require_generator_kv_cache_dtype(const std::string& choice, const char* command) {
  if (choice == "fp8") {
    throw InputError(std::string("--kv-cache-dtype fp8: ") + command +
                     " runs lesson 10's contiguous KV cache, which stores the model's dtype; the FP8 KV cache is the "
                     "engine's paged pool (tiny-vllm serve, tiny-vllm bench throughput)");
  }
  TVLLM_REQUIRE(choice == "auto" || choice == "bf16",
                "--kv-cache-dtype: expected auto, bf16 or fp8, got \"" + choice + "\"");
}

std::string apply_kv_cache_dtype(const std::string& choice, const ModelDir& model, bool paged, bool batch_invariant,
                                 PagedKvOptions& options) {
#ifdef TVLLM_CLI_ENGINE
  options.kv_dtype = parse_kv_cache_dtype(choice);
  if (options.kv_dtype != KvCacheDtype::FP8) return "";
  if (!paged) {
    throw InputError("--kv-cache-dtype fp8 needs --kv paged: lesson 10's contiguous cache stores the model's dtype");
  }
  if (batch_invariant) {
    throw InputError("--kv-cache-dtype fp8 with --batch-invariant: the batch-invariant mode's guarantee (the same "
                     "bits whatever the other requests) is tested for the bf16 cache only; drop one of the two");
  }
  const bool scaled = load_kv_scales(model, options);
  return scaled ? "FP8 KV cache (E4M3, the checkpoint's k_scale / v_scale)" : "FP8 KV cache (E4M3, scales 1.0)";
#else
  (void)model, (void)paged, (void)batch_invariant, (void)options;
  if (choice == "fp8") throw InputError("--kv-cache-dtype fp8: needs lesson 12's paged pool, not built here");
  return "";
#endif
}

void FastPathFlags::add_to(CLI::App* cmd) {
#ifdef TVLLM_CLI_FAST
  add_fp8_weights_option(cmd, fp8_weights);
  add_fp8_gemm_option(cmd, fp8_gemm);
  add_fp8_lm_head_option(cmd, fp8_lm_head);
  cmd->add_flag("--enforce-eager", enforce_eager, "CUDA: launch every step eagerly, no CUDA graphs (vLLM's flag)");
  cmd->add_flag("--no-fused", no_fused, "CUDA: lesson 08's composed forward instead of lesson 14's fused decode");
  cmd->add_flag("--no-fast-sampler", no_fast_sampler, "CUDA: lesson 09's sampler instead of lesson 14's");
  cmd->add_flag("--no-pdl", no_pdl, "CUDA: launch the fused GEMVs plainly, without programmatic dependent launch");
  cmd->add_flag("--no-fast-attention", no_fast_attention,
                "CUDA: lesson 10's decode attention kernel instead of lesson 14's");
  cmd->add_flag("--megakernel", megakernel,
                "CUDA: batch-1 decode steps as lesson 14's one-kernel step (sm_90+; off by default: its first version is slower than the fused kernels)");
#ifdef TVLLM_CLI_HOPPER
  cmd->add_flag("--no-hopper-attention", no_hopper_attention,
                "CUDA: lesson 07/12's prefill attention instead of lesson 15's wgmma kernel (Hopper only)");
  cmd->add_flag("--no-hopper-mlp", no_hopper_mlp,
                "CUDA: the gate|up GEMM and SiLU·mul as two kernels instead of lesson 15's one for steps of 512+ tokens "
                "(Hopper only)");
  cmd->add_flag("--hopper-gemm", hopper_gemm,
                "CUDA: lesson 15's wgmma GEMM instead of cuBLAS for steps of 1024+ tokens (Hopper only; off by "
                "default: no faster than cuBLAS in the engine on the H200)");
#endif
  cmd->add_option("--max-graph-batch", max_graph_batch,
                  "CUDA: decode steps of more sequences run eagerly (default 0: none do; graphs of every size up "
                  "to 64, padded buckets of 16 above; 64: no padded buckets)")
      ->check(CLI::Range(0, 1 << 20));
#else
  (void)cmd;
#endif
}

#ifdef TVLLM_CLI_FAST
FastPathOptions FastPathFlags::options() const {
  FastPathOptions o;
  o.graphs = !enforce_eager;
  o.fused = !no_fused;
  o.fast_sampler = !no_fast_sampler;
  o.pdl = !no_pdl;
  o.fast_attention = !no_fast_attention;
  o.megakernel = megakernel;
  o.max_graph_batch = max_graph_batch;
  return o;
}
#endif

namespace {

// Lesson 15's prefill attention (fresh prefills, and steps over cached blocks), on a Hopper GPU unless
// --no-hopper-attention. Not with batch invariance: a block size or head_dim the paged wgmma kernel declines sends
// a prompt's prefix-cache hit to lesson 12's paged kernel while a miss takes lesson 15's, and whether the two
// wgmma paths give a prompt the same bits whatever its hits and chunks is not established, so the same prompt
// could get other bits.
bool hopper_prefill_applies(bool no_hopper_attention, Device device, bool batch_invariant) {
#ifdef TVLLM_CLI_HOPPER
  return !no_hopper_attention && !batch_invariant && device == Device::CUDA && hopper_available();
#else
  (void)no_hopper_attention, (void)device, (void)batch_invariant;
  return false;
#endif
}

void use_hopper_prefill(AttentionBackend& backend) {
#ifdef TVLLM_CLI_HOPPER
  backend.set_fast_prefill(install_hopper_prefill_attention());
#else
  (void)backend;
#endif
}

// Lesson 15's gated MLP in one kernel (step 8) for steps of kHopperGatedMlpMinTokens+ tokens, on a Hopper GPU unless
// --no-hopper-mlp. Not with batch invariance: its GEMM (v8) is pinned per weight shape for every T, and the seam
// (which only replaces lesson 06's default kernel) would never be asked anyway.
bool hopper_mlp_applies(bool no_hopper_mlp, Device device, bool batch_invariant) {
#ifdef TVLLM_CLI_HOPPER
  return !no_hopper_mlp && !batch_invariant && device == Device::CUDA && hopper_available();
#else
  (void)no_hopper_mlp, (void)device, (void)batch_invariant;
  return false;
#endif
}

void use_hopper_mlp() {
#ifdef TVLLM_CLI_HOPPER
  install_hopper_gated_mlp();
#endif
}

// Lesson 15's GEMM for the projections of large steps, when asked for (--hopper-gemm): lesson 06's default kernel
// only (batch invariance runs v8, which never asks it). Off by default: in the engine's prefill on the H200 it was
// no faster than cuBLAS (chapter 15, section 11).
bool hopper_gemm_applies(bool hopper_gemm, Device device) {
#ifdef TVLLM_CLI_HOPPER
  return hopper_gemm && device == Device::CUDA && hopper_available();
#else
  (void)hopper_gemm, (void)device;
  return false;
#endif
}

void use_hopper_gemm() {
#ifdef TVLLM_CLI_HOPPER
  install_hopper_large_gemm();
#endif
}

}  // namespace

void FastPathFlags::apply(Generator& gen) const {
#ifdef TVLLM_CLI_FAST
  use_fast_path(gen, options());
#endif
  // Generator::set_batch_invariant(true) chose the flash decode kernel: that is how the generator says it.
  const bool invariant = gen.attention().decode_kind() == DecodeAttention::Flash;
  if (hopper_prefill_applies(no_hopper_attention, gen.weights().device, invariant)) use_hopper_prefill(gen.attention());
  if (hopper_mlp_applies(no_hopper_mlp, gen.weights().device, invariant)) use_hopper_mlp();
  if (hopper_gemm_applies(hopper_gemm, gen.weights().device)) use_hopper_gemm();
}

void FastPathFlags::apply(Engine& engine) const {
#ifdef TVLLM_CLI_FAST
  use_fast_path(engine, options());
#endif
  if (hopper_prefill_applies(no_hopper_attention, engine.weights().device, engine.config().batch_invariant))
    use_hopper_prefill(engine.kv().attention());
  if (hopper_mlp_applies(no_hopper_mlp, engine.weights().device, engine.config().batch_invariant))
    use_hopper_mlp();
  if (hopper_gemm_applies(hopper_gemm, engine.weights().device)) use_hopper_gemm();
}

int64_t FastPathFlags::warm_up(Engine& engine) const {
#ifdef TVLLM_CLI_FAST
  return engine.warm_up(warm_up_batches(engine, options()), warm_up_prefills(engine));
#else
  (void)engine;
  return 0;
#endif
}

std::string FastPathFlags::describe(Device device, const ModelConfig* config, Fp8Load fp8,
                                    bool batch_invariant) const {
  const std::string weights = config ? describe_fp8_load(*config, fp8) : "";
#ifdef TVLLM_CLI_FAST
  std::string s = describe_fast_path(options(), device, config);
#else
  std::string s = device == Device::CUDA ? "lesson 10's decode loop" : "CPU reference path";
#endif
  if (hopper_prefill_applies(no_hopper_attention, device, batch_invariant)) {
    const bool fits = config == nullptr || config->head_dim == 64 || config->head_dim == 128;
    s += fits ? ", lesson 15 prefill attention (Hopper)"
              : ", lesson 12 prefill attention (lesson 15's takes head_dim 64 and 128)";
  }
#ifdef TVLLM_CLI_HOPPER
  if (hopper_mlp_applies(no_hopper_mlp, device, batch_invariant))
    s += ", lesson 15 gated MLP from " + std::to_string(kHopperGatedMlpMinTokens) + " tokens";
  if (hopper_gemm_applies(hopper_gemm, device) && !batch_invariant)
    s += ", lesson 15 GEMM from " + std::to_string(kHopperGemmMinTokens) + " tokens";
#endif
  return weights.empty() ? s : s + ", " + weights + describe_fp8_lm_head(fp8_lm_head && fp8 == Fp8Load::Resident);
}

std::unique_ptr<LoadedModel> LoadedModel::open(const std::string& dir, const std::string& device_text,
                                               const FastPathFlags* fast) {
  if (device_text == "cuda" && !cuda_available())
    throw InputError("--device cuda: no CUDA GPU is available (use --device cpu)");
  const Device device = resolve_device(device_text);  // InputError for anything but auto|cpu|cuda
  const Fp8Load fp8 = fast ? fast->fp8_load(dir, device) : Fp8Load::Dequantize;
  auto m = std::make_unique<LoadedModel>(ModelDir::open(dir, fp8));
  m->dir = dir;
  m->device = device;
  m->fp8 = m->model.fp8_resident ? Fp8Load::Resident : Fp8Load::Dequantize;
  m->fp8_lm_head = fast && fast->fp8_lm_head;
  require_fp8_lm_head(m->fp8_lm_head, m->fp8);  // before anything is uploaded
  const fs::path tok = m->dir / "tokenizer.json";
  if (fs::exists(tok)) m->tokenizer.emplace(Tokenizer::from_file(tok));
  return m;
}

void LoadedModel::bind_weights() {
  if (weights) return;
  weights.emplace(ModelWeights::bind(model, device));
  attach_fp8_lm_head_if(fp8_lm_head, *weights);
}

const Tokenizer& LoadedModel::require_tokenizer(const std::string& way_out) const {
  if (!tokenizer) throw InputError(dir.string() + " has no tokenizer.json: " + way_out);
  return *tokenizer;
}

ChatTemplate LoadedModel::require_chat_template() const {
  std::optional<ChatTemplate> t = ChatTemplate::from_model_dir(dir);
  if (!t)
    throw InputError(dir.string() +
                     " has no chat template (tokenizer_config.json \"chat_template\" or "
                     "chat_template.jinja): use a plain --prompt without --chat, or --prompt-ids");
  return std::move(*t);
}

void warm_up(Generator& gen, const std::vector<int32_t>& prompt) {
  if (gen.weights().device != Device::CUDA || prompt.empty()) return;
  GenerateOptions options;
  options.max_new_tokens = 2;
  options.ignore_eos = true;
  const int64_t n = std::min<int64_t>(static_cast<int64_t>(prompt.size()),
                                      std::min<int64_t>(16, gen.limits().max_context - 2));
  if (n >= 1) gen.generate(std::vector<int32_t>(prompt.begin(), prompt.begin() + n), options);
}

CLI::Option* add_enable_thinking_option(CLI::App* cmd, bool& enable_thinking) {
  return cmd
      ->add_option_function<std::string>(
          "--enable-thinking", [&enable_thinking](const std::string& v) { enable_thinking = v == "true"; },
          "Qwen3's chat template switch: false appends an empty <think></think> block, so the model answers "
          "without reasoning (default: true, the template's own default)")
      ->check(CLI::IsMember({"true", "false"}))
      ->type_name("true|false");
}

void note_thinking_switch(const ChatTemplate& tmpl, bool given, const char* command) {
  if (given && !tmpl.has_thinking_switch())
    std::fprintf(stderr,
                 "tiny-vllm %s: note: this model's chat template (%s) has no thinking switch; --enable-thinking "
                 "changes nothing\n",
                 command, std::string(chat_family_name(tmpl.family())).c_str());
}

std::string fixed(double value, int digits) {
  char text[64];
  std::snprintf(text, sizeof text, "%.*f", digits, value);
  return text;
}

}  // namespace tvllm::cli
