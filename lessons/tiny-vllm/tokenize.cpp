// tiny-vllm tokenize   --tokenizer FILE | --model DIR [--text STR] [--add-special-tokens]
// tiny-vllm detokenize --tokenizer FILE | --model DIR [--ids "1 2 3"] [--skip-special-tokens]
//
// Lesson 09's tokenizer from the command line. One text: --text / --ids. Many: JSON Lines on stdin, one JSON
// string (tokenize) or one JSON array of ids (detokenize) per line, answered line by line on stdout (flushed
// after each, so a program can talk to it through a pipe). A malformed line stops with exit 2 and its
// number.
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "commands.h"
#include "common/input_error.h"
#include "json_strict.h"
#include "token_args.h"
#include "tokenizer.h"

namespace tvllm::cli {

namespace fs = std::filesystem;

Tokenizer load_tokenizer(const std::string& tokenizer_file, const std::string& model_dir) {
  if (tokenizer_file.empty() == model_dir.empty())
    throw InputError(
        "give the tokenizer as --tokenizer FILE (a tokenizer.json) or --model DIR, exactly one of them");
  if (!tokenizer_file.empty()) return Tokenizer::from_file(tokenizer_file);
  const fs::path path = fs::path(model_dir) / "tokenizer.json";
  if (!fs::exists(path))
    throw InputError(model_dir + " has no tokenizer.json (give one with --tokenizer FILE)");
  return Tokenizer::from_file(path);
}

std::vector<int32_t> parse_ids(std::string_view text, const std::string& what) {
  std::vector<int32_t> ids;
  size_t i = 0;
  const auto separator = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == ','; };
  // Brackets are allowed around the whole list: "[1, 2, 3]".
  std::string body(text);
  const size_t first = body.find_first_not_of(" \t\r\n"), last = body.find_last_not_of(" \t\r\n");
  if (first != std::string::npos && body[first] == '[' && body[last] == ']')
    body = body.substr(first + 1, last - first - 1);
  while (i < body.size()) {
    if (separator(body[i])) {
      ++i;
      continue;
    }
    size_t end = i;
    while (end < body.size() && !separator(body[end])) ++end;
    const std::string item = body.substr(i, end - i);
    char* stop = nullptr;
    errno = 0;
    const long long v = std::strtoll(item.c_str(), &stop, 10);
    if (stop != item.c_str() + item.size() || errno == ERANGE || v < 0 || v > INT32_MAX)
      throw InputError(what + ": \"" + item +
                       "\" is not a token id (expected non-negative integers, e.g. \"1 2 3\")");
    ids.push_back(static_cast<int32_t>(v));
    i = end;
  }
  return ids;
}

namespace {

struct TokenizeOptions {
  std::string tokenizer, model, text, ids;
  bool add_special = false, skip_special = false;
};

void print_line(const std::string& s) {
  std::fwrite(s.data(), 1, s.size(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
}

// Each line of stdin, numbered from 1, parsed as strict JSON; `fn` answers it. A line that ends in "\r"
// (CRLF) is fine: JSON allows the whitespace.
template <class Fn>
void for_each_json_line(Fn fn) {
  std::string line;
  for (size_t number = 1; std::getline(std::cin, line); ++number) {
    const std::string what = "stdin line " + std::to_string(number);
    nlohmann::json value;
    try {
      value = parse_json_strict(line, what);
    } catch (const InputError& e) {
      throw InputError(std::string(e.what()) + " (each line must be one JSON value)");
    }
    try {
      fn(value, what);
    } catch (const InputError& e) {
      const std::string msg = e.what();
      throw InputError(msg.rfind(what, 0) == 0 ? msg : what + ": " + msg);
    }
  }
}

void run_tokenize(const TokenizeOptions& o, bool text_given) {
  const Tokenizer tok = load_tokenizer(o.tokenizer, o.model);
  const auto ids_json = [&](const std::string& text) {
    return nlohmann::json(tok.encode(text, o.add_special)).dump();
  };
  if (text_given) {
    print_line(ids_json(o.text));
    return;
  }
  for_each_json_line([&](const nlohmann::json& value, const std::string& what) {
    if (!value.is_string())
      throw InputError(what + ": expected a JSON string (one text per line), got " + json_snippet(value));
    print_line(ids_json(value.get<std::string>()));
  });
}

void run_detokenize(const TokenizeOptions& o, bool ids_given) {
  const Tokenizer tok = load_tokenizer(o.tokenizer, o.model);
  if (ids_given) {
    const std::vector<int32_t> ids = parse_ids(o.ids, "--ids");
    print_line(tok.decode(ids, o.skip_special));  // the text as is, then a newline
    return;
  }
  for_each_json_line([&](const nlohmann::json& value, const std::string& what) {
    if (!value.is_array())
      throw InputError(what + ": expected a JSON array of token ids, got " + json_snippet(value));
    std::vector<int32_t> ids;
    for (const nlohmann::json& v : value) {
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > INT32_MAX)
        throw InputError(what + ": " + json_snippet(v) + " is not a token id");
      ids.push_back(static_cast<int32_t>(v.get<int64_t>()));
    }
    // One JSON string per line: the exact inverse of tokenize's JSON Lines mode (newlines stay escaped).
    print_line(nlohmann::json(tok.decode(ids, o.skip_special)).dump());
  });
}

}  // namespace

void add_tokenize_commands(CLI::App& app) {
  auto opt = std::make_shared<TokenizeOptions>();
  CLI::App* tok = app.add_subcommand(
      "tokenize", "Text to token ids (a JSON array, no BOS); without --text, JSON Lines of strings on stdin");
  tok->add_option("--tokenizer", opt->tokenizer, "a tokenizer.json");
  tok->add_option("--model", opt->model, "a model directory (its tokenizer.json)");
  CLI::Option* text =
      tok->add_option("--text", opt->text, "the text; without it, read one JSON string per line");
  tok->add_flag("--add-special-tokens", opt->add_special,
                "apply the tokenizer's post-processor (Llama: prepend BOS), as HF's add_special_tokens=True");
  tok->callback([opt, text] {
    run_tokenize(*opt, text->count() > 0);
    g_exit_code = 0;
  });

  CLI::App* detok = app.add_subcommand(
      "detokenize",
      "Token ids to text; without --ids, JSON Lines of id arrays on stdin (one JSON string out per line)");
  detok->add_option("--tokenizer", opt->tokenizer, "a tokenizer.json");
  detok->add_option("--model", opt->model, "a model directory (its tokenizer.json)");
  CLI::Option* ids =
      detok->add_option("--ids", opt->ids, "the ids: \"1 2 3\" (or 1,2,3 or [1,2,3]); prints the text");
  detok->add_flag("--skip-special-tokens", opt->skip_special, "leave special tokens (<|eot_id|>, ...) out");
  detok->callback([opt, ids] {
    run_detokenize(*opt, ids->count() > 0);
    g_exit_code = 0;
  });
}

}  // namespace tvllm::cli
