// tiny-vllm generate --model DIR [--prompt STR | --prompt-ids "1 2 3"] [--chat [--system STR]
//                    [--enable-thinking true|false]] [--max-tokens N] [--temperature T --top-p P --top-k K
//                    --seed S] [--ignore-eos] [--device auto|cpu|cuda] [--output text|json]
//
// One prompt in, one continuation out, through lesson 10's Generator (prefill, then a decode step a token).
//   text  the new text streams to stdout as the ids arrive (lesson 09's IncrementalDecoder: never half a
//         UTF-8 character), then a newline; timings on stderr. Without a tokenizer the ids stream instead.
//   json  one object: prompt_ids, ids (the new ones, a stopping EOS included), text (with a tokenizer;
//         special tokens left out, as text mode prints it), finish_reason (stop | length), timing.
// The prompt: --prompt is encoded as Hugging Face's tokenizer(prompt) does (the post-processor adds BOS);
// --chat renders [--system, --prompt] with the model's chat template, which prints BOS itself, so that string
// is encoded without the post-processor; --prompt-ids is used as given. --enable-thinking false: the template
// variable of that name (Qwen3's switch: an empty <think></think> block after the generation prompt, so the
// model answers without reasoning); templates without the switch ignore it, as under transformers.
// Everything is checked before the weights are loaded: a bad request costs nothing. On CUDA a short untimed
// warm-up runs first (session.h), so the timings are the steady state.
#include "generate.h"

#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "commands.h"
#include "common/errors.h"
#include "session.h"

namespace tvllm::cli {
namespace {

struct GenerateCliOptions {
  std::string model, prompt, prompt_ids, system, device = "auto", output = "text";
  bool chat = false, ignore_eos = false, batch_invariant = false;
  bool enable_thinking = true;  // --enable-thinking (the template's default: true)
  bool have_thinking = false;   // given on the command line
  int64_t max_tokens = 128;
  SamplingFlags sampling;
  FastPathFlags fast;
  std::string kv_cache_dtype = "auto";  // lesson 16: fp8 is the engine's (refused here, with the way out)
  int tensor_parallel_size = 1;          // lesson 17: only 1 runs
};

std::vector<int32_t> prompt_ids_of(const LoadedModel& m, const GenerateCliOptions& o, bool have_prompt,
                                   bool have_ids, bool have_system) {
  if (have_prompt == have_ids)
    throw InputError("give the prompt as --prompt TEXT or --prompt-ids \"1 2 3\" (one of them)");
  if (have_system && !o.chat) throw InputError("--system is part of a chat: add --chat");
  if (o.have_thinking && !o.chat) throw InputError("--enable-thinking is a chat template switch: add --chat");
  if (have_ids) {
    if (o.chat)
      throw InputError("--chat renders a text conversation: use it with --prompt, not --prompt-ids");
    return parse_ids(o.prompt_ids, "--prompt-ids");
  }
  const Tokenizer& tok = m.require_tokenizer("--prompt needs one; give token ids with --prompt-ids instead");
  if (!o.chat) return tok.encode(o.prompt, /*add_special_tokens=*/true);  // HF tokenizer(prompt): BOS first
  const ChatTemplate tmpl = m.require_chat_template();
  std::vector<ChatMessage> messages;
  if (have_system) messages.push_back({"system", o.system});
  messages.push_back({"user", o.prompt});
  note_thinking_switch(tmpl, o.have_thinking, "generate");
  // The template printed BOS: no second one from the post-processor.
  return tok.encode(tmpl.render(messages, /*add_generation_prompt=*/true, {}, o.enable_thinking),
                    /*add_special_tokens=*/false);
}

void run_generate(const GenerateCliOptions& o, bool have_prompt, bool have_ids, bool have_system) {
  const bool json = o.output == "json";
  FastPathFlags one = o.fast;
  one.one_sequence = true;  // --fp8-weights auto may keep an FP8 checkpoint resident (session.h)
  std::unique_ptr<LoadedModel> m = LoadedModel::open(o.model, o.device, &one);
  const ModelConfig& c = m->model.config;
  const std::vector<int32_t> prompt = prompt_ids_of(*m, o, have_prompt, have_ids, have_system);
  const SamplingParams sampling = o.sampling.params();

  // Validate the request against the model before loading anything onto the device.
  const auto P = static_cast<int64_t>(prompt.size());
  if (P == 0) throw InputError("the prompt is empty (no token ids)");
  for (size_t i = 0; i < prompt.size(); ++i)
    if (prompt[i] >= c.vocab_size)
      throw InputError("prompt token " + std::to_string(i) + " is id " + std::to_string(prompt[i]) +
                       ", outside the vocabulary [0, " + std::to_string(c.vocab_size) + ")");
  if (o.max_tokens < 1) throw InputError("--max-tokens must be >= 1, got " + std::to_string(o.max_tokens));
  if (P + o.max_tokens > c.max_position_embeddings)
    throw InputError("the prompt (" + std::to_string(P) + " tokens) + --max-tokens " +
                     std::to_string(o.max_tokens) + " = " + std::to_string(P + o.max_tokens) +
                     " exceeds the model's context of " + std::to_string(c.max_position_embeddings) +
                     " positions (max_position_embeddings): shorten the prompt or ask for fewer tokens");

  m->bind_weights();
  // A cache of exactly prompt + max_tokens positions; prefill in steps of at most 2048 tokens.
  const int64_t max_context = P + o.max_tokens;
  Generator gen(*m->weights, Generator::limits_for(c, max_context, 1, std::min<int64_t>(max_context, 2048)));
  gen.set_batch_invariant(o.batch_invariant);
  o.fast.apply(gen);  // lesson 14 (CUDA): fused decode, CUDA graphs, the fast sampler
  GenerateOptions options;
  options.max_new_tokens = o.max_tokens;
  options.sampling = sampling;
  options.ignore_eos = o.ignore_eos;

  const Tokenizer* tok = m->tokenizer ? &*m->tokenizer : nullptr;
  std::optional<IncrementalDecoder> stream;
  if (tok) stream.emplace(*tok, /*skip_special_tokens=*/true);
  bool first_id = true;
  const auto on_token = [&](size_t, int32_t id) {
    if (json) return;
    const std::string piece = stream ? stream->push(id) : (first_id ? "" : " ") + std::to_string(id);
    first_id = false;
    std::fwrite(piece.data(), 1, piece.size(), stdout);
    std::fflush(stdout);
  };
  warm_up(gen, prompt);
  const GenerateResult r = gen.generate(prompt, options, on_token);

  const double prefill_tok_s = static_cast<double>(P) / (r.prefill_ms * 1e-3);
  const double decode_tok_s =
      r.decode_steps > 0 ? static_cast<double>(r.decode_steps) / (r.decode_ms * 1e-3) : 0.0;
  const char* finish = r.stop == StopReason::Eos ? "stop" : "length";
  if (json) {
    nlohmann::ordered_json j;  // keys in this order
    j["prompt_ids"] = prompt;
    j["ids"] = r.ids;
    if (tok) j["text"] = tok->decode(r.ids, /*skip_special_tokens=*/true);
    j["finish_reason"] = finish;
    j["stop_reason"] = stop_reason_name(r.stop);  // eos | max_tokens | context_full
    j["timing"] = {{"prefill_ms", r.prefill_ms},
                   {"decode_ms", r.decode_ms},
                   {"prefill_tok_s", prefill_tok_s},
                   {"decode_tok_s", r.decode_steps > 0 ? nlohmann::ordered_json(decode_tok_s)
                                                       : nlohmann::ordered_json(nullptr)}};
    j["device"] = std::string(device_name(m->device));
    j["path"] = o.fast.describe(m->device, &m->model.config, m->fp8, o.batch_invariant);
    std::printf("%s\n", j.dump().c_str());
  } else {
    const std::string rest = stream ? stream->finish() : "";
    std::fwrite(rest.data(), 1, rest.size(), stdout);
    std::fputc('\n', stdout);
    std::fflush(stdout);
    std::fprintf(stderr,
                 "[%s] prefill: %lld tokens in %s ms (%s tok/s); decode: %lld tokens in %s ms (%s tok/s); "
                 "finish_reason: %s (%s); %s\n",
                 std::string(device_name(m->device)).c_str(), static_cast<long long>(P),
                 fixed(r.prefill_ms, 2).c_str(), fixed(prefill_tok_s).c_str(),
                 static_cast<long long>(r.decode_steps), fixed(r.decode_ms, 2).c_str(),
                 r.decode_steps > 0 ? fixed(decode_tok_s).c_str() : "-", finish,
                 std::string(stop_reason_name(r.stop)).c_str(), o.fast.describe(m->device, &m->model.config, m->fp8, o.batch_invariant).c_str());
  }
}

}  // namespace

void add_generate_command(CLI::App& app) {
  auto opt = std::make_shared<GenerateCliOptions>();
  CLI::App* cmd = app.add_subcommand("generate", "Continue a prompt (or answer one chat turn with --chat)");
  cmd->add_option("--model", opt->model,
                  "a model directory (config.json, model.safetensors[, tokenizer.json])")
      ->required();
  CLI::Option* prompt = cmd->add_option("--prompt", opt->prompt, "the prompt text (needs tokenizer.json)");
  CLI::Option* ids = cmd->add_option("--prompt-ids", opt->prompt_ids, "the prompt as token ids: \"1 2 3\"");
  cmd->add_flag("--chat", opt->chat, "render --prompt as a user message with the model's chat template");
  CLI::Option* system = cmd->add_option("--system", opt->system, "a system message (with --chat)");
  CLI::Option* thinking = add_enable_thinking_option(cmd, opt->enable_thinking);
  cmd->add_option("--max-tokens", opt->max_tokens, "the most new tokens (default 128)");
  opt->sampling.add_to(cmd);
  opt->fast.add_to(cmd);
  cmd->add_flag("--ignore-eos", opt->ignore_eos, "do not stop at an EOS id (benchmarks)");
  add_kv_cache_dtype_option(cmd, opt->kv_cache_dtype);
  add_tensor_parallel_option(cmd, opt->tensor_parallel_size);
  cmd->add_flag("--batch-invariant", opt->batch_invariant,
                "the kernels of `serve --batch-invariant`: the same ids as a server in that mode gives this prompt");
  cmd->add_option("--device", opt->device, "auto (cuda when a GPU is present), cpu or cuda")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  cmd->add_option("--output", opt->output, "text (streamed) or json (one object)")
      ->check(CLI::IsMember({"text", "json"}));
  cmd->callback([opt, prompt, ids, system, thinking] {
    require_generator_kv_cache_dtype(opt->kv_cache_dtype, "generate");
    require_tensor_parallel_size(opt->tensor_parallel_size, "generate");
    opt->have_thinking = thinking->count() > 0;
    run_generate(*opt, prompt->count() > 0, ids->count() > 0, system->count() > 0);
    g_exit_code = 0;
  });
}

}  // namespace tvllm::cli
