// Lesson 09: chat templates recognised by family and rendered with code (chat_template.h; the chapter:
// README.md, section 13).
#include "chat_template.h"

#include <ctime>
#include <fstream>
#include <sstream>

#include "common/input_error.h"
#include "json_strict.h"
#include "tokenizer_internal.h"

namespace tvllm {
namespace {

bool has(std::string_view text, std::string_view needle) {
  return text.find(needle) != std::string_view::npos;
}

// What every refusal says: the two ways to generate without a chat template.
constexpr const char* kWayOut =
    "tiny-vllm renders the llama3, llama3.1, llama2, chatml, qwen3 and mistral families "
    "(lessons/09_tokenizer_sampling/README.md, section 13); for this model, render the conversation yourself "
    "and pass token ids (--prompt-ids), or use a plain --prompt without --chat";

// A Jinja string literal's body starting at text[i] (just after its opening quote), unescaped, and whether it
// ended at an unescaped `quote` (false: the text ran out first).
bool read_literal(std::string_view text, size_t i, char quote, std::string* out) {
  out->clear();
  for (; i < text.size(); ++i) {
    const char c = text[i];
    if (c == quote) return true;
    if (c == '\\' && i + 1 < text.size()) {
      const char e = text[++i];
      switch (e) {
        case 'n':
          out->push_back('\n');
          break;
        case 't':
          out->push_back('\t');
          break;
        case 'r':
          out->push_back('\r');
          break;
        default:
          out->push_back(e);
          break;  // \\ \' \"
      }
    } else {
      out->push_back(c);
    }
  }
  return false;
}

// llama3.1: "Cutting Knowledge Date: December 2023\n" -> "December 2023" (up to the escaped newline or the
// quote).
std::string knowledge_date(std::string_view jinja) {
  constexpr std::string_view kKey = "Cutting Knowledge Date: ";
  const size_t at = jinja.find(kKey);
  size_t end = at + kKey.size();
  while (end < jinja.size() && jinja[end] != '\\' && jinja[end] != '"' && jinja[end] != '\'' &&
         jinja[end] != '\n')
    ++end;
  return std::string(jinja.substr(at + kKey.size(), end - at - kKey.size()));
}

// llama3.1: the literal of `set date_string = "26 Jul 2024"` ("" when the template sets none).
std::string fixed_date(std::string_view jinja) {
  for (size_t at = jinja.find("date_string"); at != std::string_view::npos;
       at = jinja.find("date_string", at + 1)) {
    size_t i = at + std::string_view("date_string").size();
    while (i < jinja.size() && jinja[i] == ' ') ++i;
    if (i >= jinja.size() || jinja[i] != '=') continue;
    ++i;
    while (i < jinja.size() && jinja[i] == ' ') ++i;
    if (i >= jinja.size() || (jinja[i] != '"' && jinja[i] != '\'')) continue;  // = strftime_now(...)
    std::string date;
    if (read_literal(jinja, i + 1, jinja[i], &date)) return date;
  }
  return "";
}

// chatml: the default system prompt, the first "<|im_start|>system\n...<|im_end|>" whose body is plain
// literal text (SmolLM2: "...system\nYou are a helpful AI assistant named SmolLM..."). A body that closes
// its string ("system\n' + messages[0]['content'] + '<|im_end|>") is the conversation's own system message,
// not a default.
std::string find_default_system_prompt(std::string_view jinja) {
  constexpr std::string_view kOpen = "<|im_start|>system";
  for (size_t at = jinja.find(kOpen); at != std::string_view::npos; at = jinja.find(kOpen, at + 1)) {
    size_t i = at + kOpen.size();
    if (jinja.substr(i, 1) == "\n") {
      i += 1;  // a newline typed into the literal
    } else if (jinja.substr(i, 2) == "\\n") {
      i += 2;  // or escaped
    } else {
      continue;
    }
    const size_t end = jinja.find("<|im_end|>", i);
    if (end == std::string_view::npos) continue;
    const std::string_view body = jinja.substr(i, end - i);
    bool literal = !body.empty();
    for (size_t k = 0; k < body.size() && literal; ++k) {
      if (body[k] == '\\')
        ++k;
      else if (body[k] == '\'' || body[k] == '"' || body[k] == '{' || body[k] == '}')
        literal = false;
    }
    if (!literal) continue;
    std::string text;
    read_literal(body, 0, '\0', &text);
    return text;
  }
  return "";
}

// Python's str.isspace() for one code point.
bool python_isspace(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 ||
         cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

// Python's str.strip('\n') family, which Qwen3's template applies to reasoning and answers.
std::string_view lstrip_newlines(std::string_view s) {
  while (!s.empty() && s.front() == '\n') s.remove_prefix(1);
  return s;
}
std::string_view rstrip_newlines(std::string_view s) {
  while (!s.empty() && s.back() == '\n') s.remove_suffix(1);
  return s;
}

std::string token_string(const nlohmann::json& value, const std::string& what, const char* key) {
  if (value.is_null()) return "";
  if (value.is_string()) return value.get<std::string>();
  if (value.is_object() && value.contains("content") && value["content"].is_string())
    return value["content"].get<std::string>();
  throw InputError(what + ": \"" + key + "\" must be a string or an object with a \"content\" string, got " +
                   json_snippet(value));
}

std::string read_text_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(path.string() + ": cannot open the file");
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

std::string_view chat_family_name(ChatFamily family) {
  switch (family) {
    case ChatFamily::Llama3:
      return "llama3";
    case ChatFamily::Llama31:
      return "llama3.1";
    case ChatFamily::Llama2:
      return "llama2";
    case ChatFamily::ChatML:
      return "chatml";
    case ChatFamily::Qwen3:
      return "qwen3";
    case ChatFamily::Mistral:
      return "mistral";
  }
  return "?";
}

std::string today_date_string() {
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  char text[32];
  std::strftime(text, sizeof text, "%d %b %Y", &local);  // the C locale's month names, as Python's strftime
  return text;
}

std::string python_strip(std::string_view text) {
  size_t begin = 0, end = text.size();
  while (begin < end) {
    int len = 1;
    if (!python_isspace(tok::utf8_decode_at(text, begin, &len))) break;
    begin += static_cast<size_t>(len);
  }
  while (end > begin) {
    size_t start = end - 1;  // back to the lead byte of the last character
    while (start > begin && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) --start;
    int len = 1;
    if (!python_isspace(tok::utf8_decode_at(text, start, &len))) break;
    end = start;
  }
  return std::string(text.substr(begin, end - begin));
}

// ---- recognising a template ---------------------------------------------------------------------------

ChatTemplate ChatTemplate::recognise(std::string_view jinja, std::string bos_token, std::string eos_token,
                                     const std::string& what) {
  ChatTemplate t;
  t.bos_ = std::move(bos_token);
  t.eos_ = std::move(eos_token);
  // Qwen3's hybrid-thinking template: ChatML that rewrites the <think> blocks of the history and reads
  // enable_thinking. Other reasoning templates (QwQ, DeepSeek-R1 distills, Qwen3-2507) rewrite differently:
  // no family of ours renders them exactly.
  if (has(jinja, "<|im_start|>") && has(jinja, "<think>") && has(jinja, "last_query_index") &&
      has(jinja, "reasoning_content") &&
      has(jinja, "enable_thinking is defined and enable_thinking is false")) {
    t.family_ = ChatFamily::Qwen3;
    return t;
  }
  if (has(jinja, "<think>"))
    throw InputError(what + ": a reasoning chat template (it handles <think> blocks) is not supported; " +
                     kWayOut);
  if (has(jinja, "<|start_header_id|>") && has(jinja, "<|end_header_id|>") && has(jinja, "<|eot_id|>")) {
    if (has(jinja, "Cutting Knowledge Date: ")) {
      t.family_ = ChatFamily::Llama31;
      t.knowledge_date_ = knowledge_date(jinja);
      t.uses_today_ = has(jinja, "strftime_now");
      t.fixed_date_ = fixed_date(jinja);
      if (!has(jinja, "date_string") || (!t.uses_today_ && t.fixed_date_.empty()))
        throw InputError(what +
                         ": a Llama 3.1-style template (\"Cutting Knowledge Date\") without a date_string "
                         "we can read; " +
                         kWayOut);
    } else {
      t.family_ = ChatFamily::Llama3;
      t.prints_bos_ = has(jinja, "bos_token");
      t.trims_ = has(jinja, "trim");
    }
  } else if (has(jinja, "[INST]") && has(jinja, "<<SYS>>")) {
    t.family_ = ChatFamily::Llama2;
  } else if (has(jinja, "[INST]") && has(jinja, "[/INST]")) {
    t.family_ = ChatFamily::Mistral;
    t.read_mistral(jinja, what);
  } else if (has(jinja, "<|im_start|>") && has(jinja, "<|im_end|>")) {
    t.family_ = ChatFamily::ChatML;
    t.default_system_ = find_default_system_prompt(jinja);
  } else {
    throw InputError(what + ": this chat template is of no family tiny-vllm knows; " + kWayOut);
  }
  return t;
}

std::optional<ChatTemplate> ChatTemplate::from_tokenizer_config(std::string_view json_text,
                                                                const std::string& what,
                                                                std::optional<std::string> jinja_override) {
  const nlohmann::json j = parse_json_strict(json_text, what);
  if (!j.is_object()) throw InputError(what + ": expected a JSON object, got " + json_snippet(j));
  const std::string bos = j.contains("bos_token") ? token_string(j["bos_token"], what, "bos_token") : "";
  const std::string eos = j.contains("eos_token") ? token_string(j["eos_token"], what, "eos_token") : "";
  if (jinja_override) return recognise(*jinja_override, bos, eos, "chat_template.jinja");
  if (!j.contains("chat_template") || j["chat_template"].is_null()) return std::nullopt;
  const nlohmann::json& ct = j["chat_template"];
  if (ct.is_string()) return recognise(ct.get<std::string>(), bos, eos, what + " chat_template");
  if (ct.is_array()) {  // [{"name": "default", "template": "..."}, {"name": "tool_use", ...}]
    for (const nlohmann::json& entry : ct) {
      if (!entry.is_object() || !entry.contains("name") || !entry.contains("template") ||
          !entry["name"].is_string() || !entry["template"].is_string())
        throw InputError(
            what + ": \"chat_template\" entries must be {\"name\": string, \"template\": string}, got " +
            json_snippet(entry));
      if (entry["name"] == "default")
        return recognise(entry["template"].get<std::string>(), bos, eos, what + " chat_template \"default\"");
    }
    throw InputError(
        what + ": \"chat_template\" is a list of named templates without one named \"default\"; " + kWayOut);
  }
  throw InputError(what + ": \"chat_template\" must be a string or a list, got " + json_snippet(ct));
}

std::optional<ChatTemplate> ChatTemplate::from_model_dir(const std::filesystem::path& dir) {
  const std::filesystem::path config = dir / "tokenizer_config.json", jinja = dir / "chat_template.jinja";
  std::optional<std::string> override_text;
  if (std::filesystem::exists(jinja)) {
    override_text = read_text_file(jinja);
    if (!is_valid_utf8(*override_text)) throw InputError(jinja.string() + ": not valid UTF-8");
  }
  if (!std::filesystem::exists(config)) {
    if (!override_text) return std::nullopt;
    return recognise(*override_text, "", "", jinja.string());
  }
  return from_tokenizer_config(read_text_file(config), config.string(), std::move(override_text));
}

std::string ChatTemplate::describe() const {
  std::string s(chat_family_name(family_));
  switch (family_) {
    case ChatFamily::Llama3:
      s += prints_bos_ ? " (BOS " + bos_ + ")" : " (no BOS)";
      if (!trims_) s += ", content not trimmed";
      break;
    case ChatFamily::Llama31:
      s += " (Cutting Knowledge Date: " + knowledge_date_ +
           ", Today Date: " + (uses_today_ ? std::string("today") : fixed_date_) + ")";
      break;
    case ChatFamily::Llama2:
      s += " (BOS " + bos_ + ", EOS " + eos_ + ")";
      break;
    case ChatFamily::ChatML:
      if (!default_system_.empty()) s += " (default system prompt: \"" + default_system_ + "\")";
      break;
    case ChatFamily::Qwen3:
      s += " (ChatML, <think> blocks, enable_thinking)";
      break;
    case ChatFamily::Mistral:
      s += " (\"" + inst_open_ + "..." + inst_close_ + "\", system message " +
           (system_place_ == SystemPlace::FirstTurn  ? "in the first user turn"
            : system_place_ == SystemPlace::LastTurn ? "in the last user turn"
                                                     : "refused") +
           (trims_answer_ ? ", answers trimmed" : "") + ")";
      break;
  }
  return s;
}

// Mistral's [INST] templates differ in a few literals; each is read from the template, with quotes made
// alike ("[INST] " and '[INST] ' are one literal). A template whose literals are none of the known forms is
// refused: a guess would render a prompt the model was never trained on.
void ChatTemplate::read_mistral(std::string_view jinja, const std::string& what) {
  std::string j(jinja);
  for (char& c : j)
    if (c == '"') c = '\'';
  const auto refuse = [&](const std::string& part) {
    throw InputError(what + ": a Mistral-style [INST] template whose " + part +
                     " is none of the forms of Mistral-7B-Instruct v0.1-v0.3; " + kWayOut);
  };
  const auto one_of = [&](const char* a, const char* b, const std::string& part) -> std::string {
    const bool ha = has(j, a), hb = has(j, b);
    if (ha == hb) refuse(part);
    std::string lit(ha ? a : b);
    return lit.substr(1, lit.size() - 2);  // without the quotes
  };
  inst_open_ = one_of("' [INST] '", "'[INST] '", "[INST] literal");
  inst_close_ = one_of("' [/INST]'", "'[/INST]'", "[/INST] literal");
  if (!has(j, "must alternate")) refuse("role check (\"roles must alternate\")");
  prints_bos_ = has(j, "bos_token");
  if (has(j, "loop.last and system_message is defined"))
    system_place_ = SystemPlace::LastTurn;  // v0.3
  else if (has(j, "loop.first and system_message is defined"))
    system_place_ = SystemPlace::FirstTurn;  // v0.1 / v0.2 since 2024
  else if (!has(j, "system"))
    system_place_ = SystemPlace::Nowhere;  // v0.1 as released: a system message is refused
  else
    refuse("system message handling");
  if (has(j, "' ' + message['content']|trim + eos_token")) {
    answer_prefix_ = " ";
    trims_answer_ = true;  // v0.3
  } else if (has(j, "message['content'] + eos_token + ' '")) {
    answer_suffix_ = " ";  // v0.1 as released
    if (has(j, "' ' + message['content'] + eos_token + ' '")) refuse("answer");
  } else if (has(j, "' ' + message['content'] + eos_token")) {
    answer_prefix_ = " ";  // v0.1 / v0.2 since 2024
  } else {
    refuse("answer");
  }
}

// ---- rendering ---------------------------------------------------------------------------------------------

// Mistral: "<s>[INST] user[/INST] answer</s>" with the literals read_mistral() found. Roles must alternate
// user/assistant after an optional first system message; add_generation_prompt changes nothing (the
// [/INST] already asks for the answer).
void ChatTemplate::render_mistral(const std::vector<ChatMessage>& messages, std::string& out) const {
  size_t first = 0;
  const bool has_system = system_place_ != SystemPlace::Nowhere && messages[0].role == "system";
  if (has_system) first = 1;
  for (size_t i = first; i < messages.size(); ++i) {
    const std::string& role = messages[i].role;
    if ((role == "user") != ((i - first) % 2 == 0) || role == "system")
      throw InputError(
          "chat template: after the optional system message, conversation roles must alternate "
          "user/assistant/user/assistant/... (the Mistral template refuses message " +
          std::to_string(i) + ", role " + role + ")");
  }
  if (prints_bos_) out += bos_;
  for (size_t i = first; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if (m.role == "user") {
      // v0.3 folds the system message into the conversation's LAST message only when that is a user turn
      // (a conversation that ends with an answer loses it); v0.1/v0.2 into the first user turn.
      const bool with_system =
          has_system && (system_place_ == SystemPlace::FirstTurn ? i == first : i + 1 == messages.size());
      out += inst_open_ + (with_system ? messages[0].content + "\n\n" : "") + m.content + inst_close_;
    } else {
      out += answer_prefix_ + (trims_answer_ ? python_strip(m.content) : m.content) + eos_ + answer_suffix_;
    }
  }
}

// Qwen3: ChatML, where an assistant turn's "<think>reasoning</think>answer" is taken apart (the template's
// content.split('</think>')) and printed back only after the last user query.
void ChatTemplate::render_qwen3(const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                                bool enable_thinking, std::string& out) {
  const auto chatml = [&](const std::string& role, std::string_view content) {
    out.append("<|im_start|>").append(role).append("\n").append(content).append("<|im_end|>\n");
  };
  if (messages[0].role == "system") chatml("system", messages[0].content);
  // The last user message that is not a tool response wrapped as one (none: the last message).
  size_t last_query = messages.size() - 1;
  for (size_t k = messages.size(); k-- > 0;) {
    const std::string& c = messages[k].content;
    const bool tool_response = c.rfind("<tool_response>", 0) == 0 && c.size() >= 16 &&
                               c.compare(c.size() - 16, 16, "</tool_response>") == 0;
    if (messages[k].role == "user" && !tool_response) {
      last_query = k;
      break;
    }
  }
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if (m.role == "user" || (m.role == "system" && i > 0)) {
      chatml(m.role, m.content);
      continue;
    }
    if (m.role != "assistant") continue;  // the first system message: printed above
    std::string_view content = m.content, reasoning;
    constexpr std::string_view kEnd = "</think>", kStart = "<think>";
    if (const size_t end = content.find(kEnd); end != std::string_view::npos) {
      reasoning = rstrip_newlines(content.substr(0, end));  // before the first </think>
      if (const size_t start = reasoning.rfind(kStart); start != std::string_view::npos)
        reasoning = reasoning.substr(start + kStart.size());  // after the last <think>
      reasoning = lstrip_newlines(reasoning);
      content =
          lstrip_newlines(content.substr(content.rfind(kEnd) + kEnd.size()));  // after the last </think>
    }
    out += "<|im_start|>assistant\n";
    if (i > last_query && (i + 1 == messages.size() || !reasoning.empty())) {
      out.append("<think>\n").append(lstrip_newlines(rstrip_newlines(reasoning))).append("\n</think>\n\n");
      content = lstrip_newlines(content);
    }
    out.append(content).append("<|im_end|>\n");
  }
  if (add_generation_prompt) {
    out += "<|im_start|>assistant\n";
    if (!enable_thinking) out += "<think>\n\n</think>\n\n";
  }
}

std::string ChatTemplate::render(const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                                 std::string_view today, bool enable_thinking) const {
  if (messages.empty()) throw InputError("chat template: the conversation has no message");
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if (m.role != "system" && m.role != "user" && m.role != "assistant")
      throw InputError("chat template: message " + std::to_string(i) + " has role \"" + m.role +
                       "\" (expected system, user or assistant)");
    size_t bad = 0;
    if (!is_valid_utf8(m.content, &bad))
      throw InputError("chat template: message " + std::to_string(i) + " is not valid UTF-8 (byte " +
                       std::to_string(bad) + ")");
  }
  const auto header = [](const std::string& role) {
    return "<|start_header_id|>" + role + "<|end_header_id|>\n\n";
  };
  std::string out;
  switch (family_) {
    case ChatFamily::Llama3:
      // {% if loop.index0 == 0 %}bos_token{% endif %} + header + content|trim + <|eot_id|>, per message
      if (prints_bos_) out += bos_;
      for (const ChatMessage& m : messages)
        out += header(m.role) + (trims_ ? python_strip(m.content) : m.content) + "<|eot_id|>";
      if (add_generation_prompt) out += header("assistant");
      break;

    case ChatFamily::Llama31: {
      // The system block always comes first; a leading system message goes inside it, trimmed.
      size_t first = 0;
      std::string system;
      if (messages[0].role == "system") {
        system = python_strip(messages[0].content);
        first = 1;
      }
      const std::string date =
          uses_today_ ? (today.empty() ? today_date_string() : std::string(today)) : fixed_date_;
      out += bos_ + header("system") + "Cutting Knowledge Date: " + knowledge_date_ +
             "\nToday Date: " + date + "\n\n" + system + "<|eot_id|>";
      for (size_t i = first; i < messages.size(); ++i)
        out += header(messages[i].role) + python_strip(messages[i].content) + "<|eot_id|>";
      if (add_generation_prompt) out += header("assistant");
      break;
    }

    case ChatFamily::Llama2: {
      // A leading system message joins the first turn inside <<SYS>>; each user turn is
      // "<s>[INST] content [/INST]", each answer " content </s>" (content = the whole turn, stripped).
      size_t first = 0;
      bool has_system = false;
      std::string system;
      if (messages[0].role == "system") {
        has_system = true;
        system = messages[0].content;
        first = 1;
      }
      for (size_t i = first; i < messages.size(); ++i) {
        const size_t turn = i - first;
        const ChatMessage& m = messages[i];
        if ((m.role == "user") != (turn % 2 == 0))
          throw InputError(
              "chat template: Conversation roles must alternate user/assistant/user/assistant/... "
              "(the Llama 2 template refuses message " +
              std::to_string(i) + ", role " + m.role + ")");
        const std::string content =
            turn == 0 && has_system ? "<<SYS>>\n" + system + "\n<</SYS>>\n\n" + m.content : m.content;
        if (m.role == "user")
          out += bos_ + "[INST] " + python_strip(content) + " [/INST]";
        else if (m.role == "assistant")
          out += " " + python_strip(content) + " " + eos_;
        // a system message at an odd turn passes the check and prints nothing, as in the template
      }
      break;  // the template ignores add_generation_prompt: "[/INST]" already asks for the answer
    }

    case ChatFamily::ChatML:
      if (!default_system_.empty() && messages[0].role != "system")
        out += "<|im_start|>system\n" + default_system_ + "<|im_end|>\n";
      for (const ChatMessage& m : messages)
        out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
      if (add_generation_prompt) out += "<|im_start|>assistant\n";
      break;

    case ChatFamily::Qwen3:
      render_qwen3(messages, add_generation_prompt, enable_thinking, out);
      break;

    case ChatFamily::Mistral:
      render_mistral(messages, out);
      break;
  }
  return out;
}

}  // namespace tvllm
