// Lesson 09, chat templates: a conversation -> the one string an instruct model was trained to continue.
//
//   [{system, "Be brief."}, {user, "Hi"}]
//     ──► "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
//         "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
//
// A Hugging Face checkpoint ships its template as Jinja code (tokenizer_config.json's "chat_template", or
// chat_template.jinja), and transformers' apply_chat_template runs it. We do not interpret Jinja: we
// recognise which FAMILY a template belongs to from fingerprints in its text, and render that family with
// plain code, byte for byte what apply_chat_template(messages, tokenize=False, add_generation_prompt=...)
// renders (tests/data/chat_templates: the real templates run through transformers). README.md, section 13,
// is the chapter.
//
//   llama3    "<|start_header_id|>" + "<|eot_id|>": Llama 3 Instruct, the bundled model's template.
//             bos_token, then each message as a header and its content trimmed (Python's str.strip).
//   llama3.1  the same + "Cutting Knowledge Date": Llama 3.1 / 3.2 / 3.3. A system block always comes first:
//             "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n" + the system message;
//             the date is the template's fixed one (3.1) or today's, strftime_now("%d %b %Y") (3.2).
//   llama2    "[INST]" + "<<SYS>>": Llama 2 chat.
//             "<s>[INST] <<SYS>>\nsys\n<</SYS>>\n\nuser [/INST] answer </s>"; roles must alternate
//             user/assistant; add_generation_prompt changes nothing.
//   chatml    "<|im_start|>": SmolLM2, Qwen2.5, Hermes. "<|im_start|>role\ncontent<|im_end|>\n", content
//             as is; a default system prompt when the template has one and the conversation has none.
//   qwen3     ChatML + "<think>" + "enable_thinking" + "last_query_index": Qwen3's hybrid thinking models.
//             No default system prompt; an answer after the last user query shows its reasoning as
//             "<think>\n...\n</think>\n\n", earlier answers lose theirs; enable_thinking=false appends an
//             empty think block to the generation prompt.
//   mistral   "[INST]" without "<<SYS>>": Mistral-7B-Instruct v0.1-v0.3. "<s>[INST] user [/INST] answer</s>";
//             the spaces around [INST]/[/INST], where a system message goes (the first user turn, the last,
//             or nowhere) and how an answer is printed are read from the template's literals.
// Anything else (Zephyr's <|user|>, Gemma, other reasoning templates with <think>) is refused with an
// InputError naming the ways out: token ids (--prompt-ids) or a plain prompt without --chat.
//
// BOS: the llama families render bos_token themselves, so the string is encoded WITHOUT the tokenizer's
// post-processor (Tokenizer::encode(text, add_special_tokens=false), as apply_chat_template(tokenize=True)
// does); adding it again would start the prompt with two BOS tokens.
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace tvllm {

struct ChatMessage {
  std::string role;     // "system", "user" or "assistant"
  std::string content;  // UTF-8
};

enum class ChatFamily { Llama3, Llama31, Llama2, ChatML, Qwen3, Mistral };
// "llama3", "llama3.1", "llama2", "chatml", "qwen3", "mistral"
std::string_view chat_family_name(ChatFamily family);

class ChatTemplate {
 public:
  // Recognises the family of a Jinja template. bos_token / eos_token: the special-token strings the template
  // may print (tokenizer_config.json's). `what` names the source in errors. InputError for a template of no
  // known family, naming the ways out.
  static ChatTemplate recognise(std::string_view jinja, std::string bos_token, std::string eos_token,
                                const std::string& what = "chat_template");
  // The template of tokenizer_config.json's text: "chat_template" as a string, or a list of {name, template}
  // (transformers takes the one named "default"); `jinja_override` (chat_template.jinja's text), when given,
  // wins over both, as in transformers. std::nullopt when there is no template. InputError for a malformed
  // file.
  static std::optional<ChatTemplate> from_tokenizer_config(std::string_view json_text,
                                                           const std::string& what,
                                                           std::optional<std::string> jinja_override = {});
  // MODEL_DIR/chat_template.jinja and MODEL_DIR/tokenizer_config.json, as transformers finds them.
  // std::nullopt when the directory has no template.
  static std::optional<ChatTemplate> from_model_dir(const std::filesystem::path& dir);

  // apply_chat_template(messages, tokenize=False, add_generation_prompt=...). `today` is what the template's
  // strftime_now("%d %b %Y") returns (llama3.1 templates that print today's date); empty:
  // today_date_string(). enable_thinking: the template variable of that name (qwen3; the others ignore it,
  // as their templates do). InputError for no message, a role other than system/user/assistant, content that
  // is not UTF-8, and what the template itself refuses (Llama 2, Mistral: roles that do not alternate).
  std::string render(const std::vector<ChatMessage>& messages, bool add_generation_prompt = true,
                     std::string_view today = {}, bool enable_thinking = true) const;

  ChatFamily family() const { return family_; }
  // Whether render's enable_thinking changes anything (qwen3). The other families' templates never read the
  // variable, so for them it is ignored, exactly as transformers' apply_chat_template ignores it.
  bool has_thinking_switch() const { return family_ == ChatFamily::Qwen3; }
  const std::string& bos_token() const { return bos_; }
  const std::string& eos_token() const { return eos_; }
  // chatml: the system prompt used when a conversation starts without one ("" when the template has none).
  const std::string& default_system_prompt() const { return default_system_; }
  // "llama3 (BOS <|begin_of_text|>)", "llama3.1 (Cutting Knowledge Date: December 2023, Today Date: today)".
  std::string describe() const;

 private:
  ChatFamily family_ = ChatFamily::Llama3;
  std::string bos_, eos_;
  bool prints_bos_ = true;      // llama3, mistral: the template prints bos_token
  bool trims_ = true;           // llama3: content | trim
  std::string knowledge_date_;  // llama3.1: "December 2023"
  std::string fixed_date_;   // llama3.1: the template's own date ("26 Jul 2024"), when it has no strftime_now
  bool uses_today_ = false;  // llama3.1: strftime_now
  std::string default_system_;  // chatml
  // mistral: "[INST] " or " [INST] ", "[/INST]" or " [/INST]"; where the system message goes; an answer is
  // answer_prefix + content (trimmed or not) + eos + answer_suffix.
  enum class SystemPlace { Nowhere, FirstTurn, LastTurn };
  std::string inst_open_, inst_close_, answer_prefix_, answer_suffix_;
  SystemPlace system_place_ = SystemPlace::Nowhere;
  bool trims_answer_ = false;
  void read_mistral(std::string_view jinja, const std::string& what);
  void render_mistral(const std::vector<ChatMessage>& messages, std::string& out) const;
  static void render_qwen3(const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                           bool enable_thinking, std::string& out);
};

// Today's local date as transformers' strftime_now("%d %b %Y") prints it: "05 Mar 2025".
std::string today_date_string();

// Python's str.strip() (Jinja's trim filter): removes the code points for which str.isspace() is true
// (ASCII whitespace, U+001C..U+001F, U+0085, U+00A0, U+2000..U+200A, U+2028/9, U+3000, ...) from both ends.
// `text` must be valid UTF-8.
std::string python_strip(std::string_view text);

}  // namespace tvllm
