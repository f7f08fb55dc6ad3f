// tiny-vllm chat --model DIR [--system STR] [--enable-thinking true|false] [--device auto|cpu|cuda]
//                [sampling flags] [--max-tokens N] [--max-context N]
//
// An interactive chat in the terminal. Each line typed is a user message; the whole conversation is rendered
// with the model's chat template (lesson 09), encoded, and answered by lesson 10's Generator, the answer
// streaming to stdout token by token; then one line of statistics (tokens, tok/s) on stderr. The answer joins
// the conversation, so the next turn sees it. Every turn re-renders and re-prefills the whole history:
// simple, and prefill is the fast part (reusing the cache across turns is prefix caching, lesson 12).
//   /reset   start a new conversation (the --system message stays)
//   /quit    leave (so do /exit and end of input, Ctrl-D)
// A conversation that no longer fits in the context is not sent: the chat says so and offers /reset.
// Works on a pipe as well as on a terminal (the "> " prompt is only shown on a terminal).
#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "commands.h"
#include "common/errors.h"
#include "generate.h"
#include "session.h"

namespace tvllm::cli {
namespace {

struct ChatCliOptions {
  std::string model, system, device = "auto";
  bool enable_thinking = true;  // --enable-thinking, every turn (Qwen3's template switch)
  int64_t max_tokens = 256, max_context = 4096;
  SamplingFlags sampling;
  FastPathFlags fast;
  std::string kv_cache_dtype = "auto";  // lesson 16: fp8 is the engine's (refused here, with the way out)
};

std::string trim_ascii(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t\r\n"), e = s.find_last_not_of(" \t\r\n");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

void run_chat(const ChatCliOptions& o, bool have_system, bool have_thinking) {
  FastPathFlags one = o.fast;
  one.one_sequence = true;  // --fp8-weights auto may keep an FP8 checkpoint resident (session.h)
  std::unique_ptr<LoadedModel> m = LoadedModel::open(o.model, o.device, &one);
  const Tokenizer& tok = m->require_tokenizer("chat needs one (generate --prompt-ids works without)");
  const ChatTemplate tmpl = m->require_chat_template();
  note_thinking_switch(tmpl, have_thinking, "chat");
  const SamplingParams sampling = o.sampling.params();
  const ModelConfig& c = m->model.config;
  if (o.max_tokens < 1) throw InputError("--max-tokens must be >= 1, got " + std::to_string(o.max_tokens));
  if (o.max_context < 2) throw InputError("--max-context must be >= 2, got " + std::to_string(o.max_context));
  const int64_t max_context = std::min(o.max_context, c.max_position_embeddings);
  m->bind_weights();
  Generator gen(*m->weights, Generator::limits_for(c, max_context, 1, std::min<int64_t>(max_context, 2048)));
  o.fast.apply(gen);  // lesson 14 (CUDA): fused decode, CUDA graphs, the fast sampler

  // CUDA: the first answer's timings too
  warm_up(gen, tok.encode(tmpl.render({{"user", "Hello"}}, true, {}, o.enable_thinking), false));
  const bool tty = isatty(STDIN_FILENO) != 0;
  std::fprintf(stderr,
               "tiny-vllm chat: %s on %s, chat template %s, context %lld tokens, answers up to %lld tokens\n"
               "type a message; /reset starts over, /quit (or Ctrl-D) leaves\n",
               m->dir.string().c_str(), std::string(device_name(m->device)).c_str(), tmpl.describe().c_str(),
               static_cast<long long>(max_context), static_cast<long long>(o.max_tokens));

  std::vector<ChatMessage> history;
  const auto reset = [&] {
    history.clear();
    if (have_system) history.push_back({"system", o.system});
  };
  reset();
  const std::string today = today_date_string();  // one date for the whole session
  std::string line;
  for (uint64_t turn = 0;;) {
    if (tty) {
      std::fputs("> ", stdout);
      std::fflush(stdout);
    }
    if (!std::getline(std::cin, line)) {
      if (tty) std::fputc('\n', stdout);
      break;
    }
    const std::string typed = trim_ascii(line);
    if (typed.empty()) continue;
    if (typed == "/quit" || typed == "/exit") break;
    if (typed == "/reset") {
      reset();
      std::fprintf(stderr, "(new conversation)\n");
      continue;
    }
    if (typed[0] == '/') {
      std::fprintf(stderr, "unknown command %s: /reset starts over, /quit leaves\n", typed.c_str());
      continue;
    }
    try {
      std::vector<ChatMessage> next = history;
      if (!line.empty() && line.back() == '\r') line.pop_back();
      next.push_back({"user", line});
      const std::vector<int32_t> prompt =
          tok.encode(tmpl.render(next, true, today, o.enable_thinking), /*add_special_tokens=*/false);
      const auto P = static_cast<int64_t>(prompt.size());
      if (P >= max_context) {
        std::fprintf(
            stderr,
            "the conversation is now %lld tokens and the context holds %lld: nothing was sent. "
            "/reset starts a new conversation%s\n",
            static_cast<long long>(P), static_cast<long long>(max_context),
            max_context < c.max_position_embeddings ? " (or restart with a larger --max-context)" : "");
        continue;
      }
      GenerateOptions options;
      options.max_new_tokens = o.max_tokens;
      options.sampling = sampling;
      options.sampling.seed = sampling.seed + turn;  // a new draw each turn, reproducible from --seed
      IncrementalDecoder stream(tok, /*skip_special_tokens=*/true);
      const GenerateResult r = gen.generate(prompt, options, [&](size_t, int32_t id) {
        const std::string piece = stream.push(id);
        std::fwrite(piece.data(), 1, piece.size(), stdout);
        std::fflush(stdout);
      });
      const std::string rest = stream.finish();
      std::fwrite(rest.data(), 1, rest.size(), stdout);
      std::fputc('\n', stdout);
      std::fflush(stdout);
      const double decode_tok_s = r.decode_steps > 0 ? r.decode_steps / (r.decode_ms * 1e-3) : 0.0;
      std::fprintf(stderr, "[%zu tokens, %s tok/s; prompt %lld tokens, prefill %s ms%s]\n", r.ids.size(),
                   r.decode_steps > 0 ? fixed(decode_tok_s).c_str() : "-", static_cast<long long>(P),
                   fixed(r.prefill_ms, 1).c_str(),
                   r.stop == StopReason::MaxTokens ? ", cut at --max-tokens" : "");
      next.push_back({"assistant", tok.decode(r.ids, /*skip_special_tokens=*/true)});
      history.swap(next);
      ++turn;
      if (r.stop == StopReason::ContextFull)
        std::fprintf(stderr, "the context is full (%lld tokens): /reset starts a new conversation\n",
                     static_cast<long long>(max_context));
    } catch (const InputError& e) {  // this message (e.g. not UTF-8): say so and keep the conversation
      std::fprintf(stderr, "error: %s\n", e.what());
    }
  }
}

}  // namespace

void add_chat_command(CLI::App& app) {
  auto opt = std::make_shared<ChatCliOptions>();
  CLI::App* cmd = app.add_subcommand(
      "chat", "Chat with an instruct model in the terminal (streams, keeps the conversation)");
  cmd->add_option("--model", opt->model, "a model directory with tokenizer.json and a chat template")
      ->required();
  CLI::Option* system =
      cmd->add_option("--system", opt->system, "a system message for the whole conversation");
  CLI::Option* thinking = add_enable_thinking_option(cmd, opt->enable_thinking);
  cmd->add_option("--max-tokens", opt->max_tokens, "the most tokens per answer (default 256)");
  cmd->add_option("--max-context", opt->max_context,
                  "the KV cache's positions, at most the model's max_position_embeddings (default 4096)");
  opt->sampling.add_to(cmd);
  opt->fast.add_to(cmd);
  add_kv_cache_dtype_option(cmd, opt->kv_cache_dtype);
  cmd->add_option("--device", opt->device, "auto (cuda when a GPU is present), cpu or cuda")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  cmd->callback([opt, system, thinking] {
    require_generator_kv_cache_dtype(opt->kv_cache_dtype, "chat");
    run_chat(*opt, system->count() > 0, thinking->count() > 0);
    g_exit_code = 0;
  });
}

}  // namespace tvllm::cli
