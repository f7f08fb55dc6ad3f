// Lesson 09, chat templates: every case of tests/data/chat_templates/cases.json (what transformers'
// apply_chat_template rendered, made by weights/tools/make_chat_template_cases.py) byte for byte, the
// families recognised from the real templates, and the templates we refuse.
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "chat_template.h"
#include "common/input_error.h"
#include "testing/testing.h"
#include "tokenizer.h"

namespace tvllm {
namespace {

namespace fs = std::filesystem;

fs::path repo_root() { return testing::test_data_dir().parent_path().parent_path(); }
fs::path cases_dir() { return testing::test_data_dir() / "chat_templates"; }

nlohmann::json read_json(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path.string());
  return nlohmann::json::parse(in);
}

std::vector<ChatMessage> messages_of(const nlohmann::json& conversation) {
  std::vector<ChatMessage> out;
  for (const auto& m : conversation)
    out.push_back({m["role"].get<std::string>(), m["content"].get<std::string>()});
  return out;
}

// Shows control characters, so a failing comparison says where.
std::string visible(const std::string& s) { return nlohmann::json(s).dump(); }

TEST(ChatTemplate, EveryFixtureCaseRendersExactlyAsTransformers) {
  const nlohmann::json data = read_json(cases_dir() / "cases.json");
  std::map<std::string, ChatTemplate> templates;
  for (const auto& t : data["templates"]) {
    const std::string name = t["name"];
    std::optional<ChatTemplate> tmpl =
        ChatTemplate::from_model_dir(repo_root() / t["dir"].get<std::string>());
    ASSERT_TRUE(tmpl.has_value()) << name;
    EXPECT_EQ(chat_family_name(tmpl->family()), t["family"].get<std::string>())
        << name << ": " << tmpl->describe();
    templates.emplace(name, std::move(*tmpl));
  }
  int checked = 0, errors = 0;
  for (const auto& c : data["cases"]) {
    const ChatTemplate& tmpl = templates.at(c["template"].get<std::string>());
    const std::vector<ChatMessage> messages =
        messages_of(data["conversations"][c["conversation"].get<std::string>()]);
    const std::string today = c["today"].is_null() ? "" : c["today"].get<std::string>();
    const bool agp = c["add_generation_prompt"].get<bool>();
    const bool thinking = c.value("enable_thinking", true);  // absent: the template's default
    const std::string label = c["template"].get<std::string>() + " / " +
                              c["conversation"].get<std::string>() + (agp ? "" : " (no generation prompt)") +
                              (thinking ? "" : " (enable_thinking false)");
    if (c.contains("error")) {  // the template itself raised
      EXPECT_THROW(tmpl.render(messages, agp, today, thinking), InputError) << label;
      ++errors;
    } else {
      EXPECT_EQ(visible(tmpl.render(messages, agp, today, thinking)),
                visible(c["rendered"].get<std::string>()))
          << label;
    }
    ++checked;
  }
  EXPECT_GE(checked, 250);
  EXPECT_GE(errors,
            10);  // Llama 2's and Mistral's "roles must alternate", Mistral's "only user and assistant"
}

TEST(ChatTemplate, BundledTemplateMatchesTheReferenceChatPrompt) {
  // reference/manifest.json's chat prompt p1: its text and ids came from apply_chat_template(tokenize=True).
  const nlohmann::json manifest = read_json(testing::tiny_model_dir() / "reference" / "manifest.json");
  const nlohmann::json* chat = nullptr;
  for (const auto& p : manifest["prompts"])
    if (p["kind"] == "chat") chat = &p;
  ASSERT_NE(chat, nullptr);
  const std::optional<ChatTemplate> tmpl = ChatTemplate::from_model_dir(testing::tiny_model_dir());
  ASSERT_TRUE(tmpl.has_value());
  const std::string text = tmpl->render(messages_of((*chat)["messages"]));
  EXPECT_EQ(text, (*chat)["text"].get<std::string>());
  // The template prints BOS itself: encode WITHOUT the post-processor, or the prompt starts with two.
  const Tokenizer tok = Tokenizer::from_file(testing::tiny_model_dir() / "tokenizer.json");
  EXPECT_EQ(tok.encode(text, false), (*chat)["ids"].get<std::vector<int32_t>>());
  const std::vector<int32_t> twice = tok.encode(text, true);
  ASSERT_GE(twice.size(), 2u);
  EXPECT_EQ(twice[0], twice[1]) << "add_special_tokens=true would prepend a second BOS";
  // reference/tokenizer_cases.json's chat case (multi-turn, an answer with spaces at its ends).
  int chats = 0;
  const nlohmann::json cases = read_json(testing::tiny_model_dir() / "reference" / "tokenizer_cases.json");
  for (const auto& c : cases["cases"]) {
    if (!c.contains("messages")) continue;
    EXPECT_EQ(visible(tmpl->render(messages_of(c["messages"]), c["add_generation_prompt"].get<bool>())),
              visible(c["text"].get<std::string>()))
        << c["name"];
    EXPECT_EQ(tok.encode(c["text"].get<std::string>(), false), c["ids"].get<std::vector<int32_t>>())
        << c["name"];
    ++chats;
  }
  EXPECT_GE(chats, 1);
}

TEST(ChatTemplate, Llama31DateIsAnInput) {
  const ChatTemplate t = *ChatTemplate::from_model_dir(cases_dir() / "llama3_2");
  EXPECT_EQ(t.family(), ChatFamily::Llama31);
  const std::string s = t.render({{"user", "Hi"}}, true, "05 Mar 2025");
  EXPECT_NE(s.find("Cutting Knowledge Date: December 2023\nToday Date: 05 Mar 2025\n\n<|eot_id|>"),
            std::string::npos)
      << visible(s);
  // Without one: today, as strftime_now("%d %b %Y") prints it.
  const std::string today = today_date_string();
  ASSERT_EQ(today.size(), 11u) << today;  // "05 Mar 2025"
  EXPECT_NE(t.render({{"user", "Hi"}}).find("Today Date: " + today + "\n"), std::string::npos);
  // Llama 3.1's template has its own fixed date and ignores today.
  const ChatTemplate fixed = *ChatTemplate::from_model_dir(cases_dir() / "llama3_1");
  EXPECT_NE(fixed.render({{"user", "Hi"}}, true, "05 Mar 2025").find("Today Date: 26 Jul 2024\n"),
            std::string::npos);
}

TEST(ChatTemplate, ChatMLDefaultSystemPrompt) {
  EXPECT_EQ(ChatTemplate::from_model_dir(cases_dir() / "smollm2")->default_system_prompt(),
            "You are a helpful AI assistant named SmolLM, trained by Hugging Face");
  EXPECT_EQ(ChatTemplate::from_model_dir(cases_dir() / "qwen2_5")->default_system_prompt(),
            "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.");
  EXPECT_EQ(ChatTemplate::from_model_dir(cases_dir() / "chatml")->default_system_prompt(), "");
}

TEST(ChatTemplate, Qwen3ThinkingAndHistory) {
  const ChatTemplate t = *ChatTemplate::from_model_dir(cases_dir() / "qwen3");
  EXPECT_EQ(t.family(), ChatFamily::Qwen3);
  EXPECT_EQ(t.default_system_prompt(), "");  // unlike Qwen2.5, no default system prompt
  const std::vector<ChatMessage> one = {{"user", "Hi"}};
  EXPECT_EQ(t.render(one), "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(t.render(one, true, {}, /*enable_thinking=*/false),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
  EXPECT_EQ(t.render(one, false, {}, false), "<|im_start|>user\nHi<|im_end|>\n");  // no prompt, no block
  // Reasoning before the last user query is dropped; after it, kept (and trimmed of newlines).
  const std::vector<ChatMessage> history = {{"user", "a"},
                                            {"assistant", "<think>\nr1\n</think>\n\nA1"},
                                            {"user", "b"},
                                            {"assistant", "<think>\n\nr2\n</think>\nA2"}};
  EXPECT_EQ(
      t.render(history, false),
      "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nb<|im_end|>\n"
      "<|im_start|>assistant\n<think>\nr2\n</think>\n\nA2<|im_end|>\n");
}

// enable_thinking is Qwen3's template variable; every other family's template never reads it, so under
// transformers apply_chat_template(..., enable_thinking=False) renders the same bytes, and so must we.
TEST(ChatTemplate, OnlyQwen3HasAThinkingSwitch) {
  const nlohmann::json data = read_json(cases_dir() / "cases.json");
  int others = 0;
  for (const auto& t : data["templates"]) {
    const ChatTemplate tmpl = *ChatTemplate::from_model_dir(repo_root() / t["dir"].get<std::string>());
    const bool qwen3 = tmpl.family() == ChatFamily::Qwen3;
    EXPECT_EQ(tmpl.has_thinking_switch(), qwen3) << t["name"];
    if (qwen3) continue;
    for (const auto& [name, conversation] : data["conversations"].items()) {
      const std::vector<ChatMessage> messages = messages_of(conversation);
      std::string on;
      try {
        on = tmpl.render(messages, true, "26 Jul 2024", true);
      } catch (const InputError&) {  // the template refuses this conversation: with either setting
        EXPECT_THROW(tmpl.render(messages, true, "26 Jul 2024", false), InputError) << t["name"] << " / " << name;
        continue;
      }
      EXPECT_EQ(tmpl.render(messages, true, "26 Jul 2024", false), on) << t["name"] << " / " << name;
      ++others;
    }
  }
  EXPECT_GE(others, 50);
}

TEST(ChatTemplate, MistralVariantsReadFromTheTemplate) {
  const std::vector<ChatMessage> conv = {
      {"system", "S"}, {"user", "u1"}, {"assistant", " a1 "}, {"user", "u2"}};
  const ChatTemplate v2 = *ChatTemplate::from_model_dir(cases_dir() / "mistral_v0_2");
  EXPECT_EQ(v2.family(), ChatFamily::Mistral);
  EXPECT_EQ(v2.render(conv), "<s> [INST] S\n\nu1 [/INST]  a1 </s> [INST] u2 [/INST]");
  const ChatTemplate v3 = *ChatTemplate::from_model_dir(cases_dir() / "mistral_v0_3");
  EXPECT_EQ(v3.render(conv), "<s>[INST] u1[/INST] a1</s>[INST] S\n\nu2[/INST]");
  EXPECT_NE(v3.describe().find("last user turn"), std::string::npos) << v3.describe();
  const ChatTemplate v1 = *ChatTemplate::from_model_dir(cases_dir() / "mistral_v0_1_release");
  EXPECT_EQ(v1.render({{"user", "u1"}, {"assistant", "a1"}}), "<s>[INST] u1 [/INST]a1</s> ");
  EXPECT_THROW(v1.render(conv), InputError);  // that template has no system message
  EXPECT_THROW(v3.render({{"user", "a"}, {"user", "b"}}), InputError);
  EXPECT_THROW(v2.render({{"assistant", "a"}}), InputError);
}

TEST(ChatTemplate, PythonStripRemovesWhatStrIsspaceAccepts) {
  EXPECT_EQ(python_strip(" \t\n\r\v\f x \x1c\x1d\x1e\x1f"), "x");
  EXPECT_EQ(python_strip("\u3000\u00a0\u0085\u2028\u2029\u202f\u205f\u1680\u2000\u200ax y\u3000"), "x y");
  EXPECT_EQ(python_strip("\u200bx\u200b"), "\u200bx\u200b");  // zero width space: not whitespace
  EXPECT_EQ(python_strip("\u180ex"), "\u180ex");              // Mongolian vowel separator: no longer Zs
  EXPECT_EQ(python_strip("   "), "");
  EXPECT_EQ(python_strip(""), "");
  EXPECT_EQ(python_strip("é "), "é");
}

TEST(ChatTemplate, UnknownTemplatesAreRefusedNamingTheWayOut) {
  const char* unknown[] = {
      // Zephyr / TinyLlama
      "{% for message in messages %}{% if message['role'] == 'user' %}{{ '<|user|>\n' + message['content'] + "
      "eos_token }}{% endif %}{% endfor %}",
      // [INST] without <<SYS>> but none of Mistral's forms (no role check, no space before the answer)
      "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' + "
      "message['content'] + ' [/INST]' }}{% else %}{{ message['content'] + eos_token}}{% endif %}{% endfor "
      "%}",
      // Gemma
      "{{ bos_token }}{% for message in messages %}{{ '<start_of_turn>' + message['role'] + '\n' + "
      "message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}",
      // Qwen3-style reasoning template (ChatML with <think>)
      "{% for message in messages %}{{ '<|im_start|>' + message.role + '\n' + message.content + "
      "'<|im_end|>\n' }}"
      "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>\n\n</think>\n\n' }}{% "
      "endif %}",
      // Mistral-like, with a role check, but [INST] in an unknown spelling
      "{{ bos_token }}{% if x %}{{ raise_exception('roles must alternate') }}{% endif %}{{ '[INST]' + "
      "message['content'] + '[/INST]' }}{{ ' ' + message['content'] + eos_token }}",
      "",
  };
  for (const char* t : unknown) {
    try {
      ChatTemplate::recognise(t, "<s>", "</s>", "test template");
      ADD_FAILURE() << "accepted: " << t;
    } catch (const InputError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("test template"), std::string::npos) << msg;
      EXPECT_NE(msg.find("--prompt-ids"), std::string::npos) << msg;
      EXPECT_NE(msg.find("without --chat"), std::string::npos) << msg;
    }
  }
}

// From a model directory, the refusal names the file the template came from.
TEST(ChatTemplate, UnknownTemplateErrorNamesTheFile) {
  testing::TempDir dir;
  {
    std::ofstream out(dir / "tokenizer_config.json");
    out << R"({"eos_token": "</s>", "chat_template": )"
        << R"("{% for m in messages %}<|user|>\n{{ m.content }}{% endfor %}"})";
  }
  try {
    (void)ChatTemplate::from_model_dir(dir.path());
    ADD_FAILURE() << "a Zephyr template was accepted";
  } catch (const InputError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find((dir / "tokenizer_config.json").string()), std::string::npos) << msg;
    EXPECT_NE(msg.find("--prompt-ids"), std::string::npos) << msg;
  }
}

TEST(ChatTemplate, TokenizerConfigForms) {
  // No template at all: nullopt (generation without --chat still works).
  EXPECT_FALSE(ChatTemplate::from_tokenizer_config(R"({"bos_token": "<s>"})", "t").has_value());
  EXPECT_FALSE(ChatTemplate::from_tokenizer_config(R"({"chat_template": null})", "t").has_value());
  // A list of named templates: "default" is taken; bos/eos as AddedToken objects.
  const auto t = ChatTemplate::from_tokenizer_config(
      R"({"bos_token": {"content": "<s>", "lstrip": false}, "eos_token": "</s>",
          "chat_template": [{"name": "tool_use", "template": "<|im_start|>x<|im_end|>"},
                            {"name": "default", "template": "[INST] <<SYS>> {{ bos_token }}"}]})",
      "t");
  ASSERT_TRUE(t.has_value());
  EXPECT_EQ(t->family(), ChatFamily::Llama2);
  EXPECT_EQ(t->bos_token(), "<s>");
  EXPECT_EQ(t->render({{"user", " hi "}}), "<s>[INST] hi [/INST]");
  // chat_template.jinja wins over tokenizer_config.json's template, as in transformers.
  const auto o = ChatTemplate::from_tokenizer_config(R"({"chat_template": "[INST] <<SYS>>"})", "t",
                                                     std::string("<|im_start|>{{ m }}<|im_end|>"));
  EXPECT_EQ(o->family(), ChatFamily::ChatML);
  // Malformed: a clear InputError naming the field.
  EXPECT_THROW(ChatTemplate::from_tokenizer_config(R"({"chat_template": 3})", "t"), InputError);
  EXPECT_THROW(
      ChatTemplate::from_tokenizer_config(R"({"chat_template": [{"name": "x", "template": "y"}]})", "t"),
      InputError);
  EXPECT_THROW(ChatTemplate::from_tokenizer_config(
                   R"({"bos_token": 7, "chat_template": "<|im_start|><|im_end|>"})", "t"),
               InputError);
  EXPECT_THROW(ChatTemplate::from_tokenizer_config("{not json", "t"), InputError);
  // A directory without any template.
  testing::TempDir dir;
  EXPECT_FALSE(ChatTemplate::from_model_dir(dir.path()).has_value());
}

TEST(ChatTemplate, BadConversationsAreInputErrors) {
  const ChatTemplate t = *ChatTemplate::from_model_dir(testing::tiny_model_dir());
  EXPECT_THROW(t.render({}), InputError);
  EXPECT_THROW(t.render({{"tool", "x"}}), InputError);
  EXPECT_THROW(t.render({{"user", std::string("bad \xff byte")}}), InputError);
  const ChatTemplate l2 = *ChatTemplate::from_model_dir(cases_dir() / "llama2");
  EXPECT_THROW(l2.render({{"assistant", "first"}}), InputError);
  EXPECT_THROW(l2.render({{"user", "a"}, {"user", "b"}}), InputError);
}

}  // namespace
}  // namespace tvllm
