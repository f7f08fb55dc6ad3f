// Lessons 09-10 through the program a user runs: `tiny-vllm generate`, `tokenize`, `detokenize` and `chat` on
// the bundled model, CPU. The answers come from Hugging Face (weights/tiny-llama3/reference: greedy
// continuations, tokenizer cases, the chat prompt) or from the library itself (a chat's second turn == the
// Generator run on the re-rendered conversation). Exit codes are the contract: 0 success, 2 bad input and
// a message.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "chat_template.h"
#include "common/device.h"
#include "generate.h"
#include "generate_check.h"
#include "model_dir.h"
#include "testing/family_models.h"
#include "testing/cli.h"
#include "testing/testing.h"
#include "tokenizer.h"

namespace tvllm {
namespace {

std::string tiny_vllm() { return testing::tiny_vllm_bin(); }
const auto q = testing::shell_quote;
std::string model() { return testing::tiny_model_arg(); }
using testing::contains;

namespace fs = std::filesystem;
using testing::run_command;
using testing::TempDir;

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}
void write_file(const fs::path& p, const std::string& text) { std::ofstream(p, std::ios::binary) << text; }
nlohmann::json read_json(const fs::path& p) { return nlohmann::json::parse(read_file(p)); }
std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}
std::string ids_arg(const std::vector<int32_t>& ids) {
  std::string s;
  for (int32_t id : ids) s += (s.empty() ? "" : " ") + std::to_string(id);
  return s;
}

// Runs a command with stdout and stderr kept apart (run_command merges them).
struct Split {
  int exit_code = -1;
  std::string out, err;
};
Split run_split(const std::string& command) {
  TempDir dir;
  // The outer parentheses keep run_command's own "2>&1" from undoing the inner redirections.
  const auto r = run_command("((" + command + ") > " + q((dir / "out").string()) + " 2> " +
                             q((dir / "err").string()) + ")");
  return {r.exit_code, read_file(dir / "out"), read_file(dir / "err")};
}

// The bundled model without its tokenizer files (config + weights as symlinks): a directory in HF layout that
// only works with --prompt-ids. With `tokenizer_config`, tokenizer.json is linked and that config written.
void model_copy(const fs::path& dir, const std::string& tokenizer_config = "") {
  for (const char* f : {"config.json", "model.safetensors"})
    fs::create_symlink(testing::tiny_model_dir() / f, dir / f);
  if (!tokenizer_config.empty()) {
    fs::create_symlink(testing::tiny_model_dir() / "tokenizer.json", dir / "tokenizer.json");
    write_file(dir / "tokenizer_config.json", tokenizer_config);
  }
}

const nlohmann::json& manifest_prompt(const nlohmann::json& manifest, const std::string& kind) {
  for (const auto& p : manifest["prompts"])
    if (p["kind"] == kind) return p;
  throw std::runtime_error("no " + kind + " prompt in manifest.json");
}

// ---- generate ---------------------------------------------------------------------------------------------

TEST(GenerateCli, GreedyPromptIdsEqualHuggingFace) {
  const ReferenceGenerations ref = read_reference_generations(testing::tiny_model_dir());
  ASSERT_FALSE(ref.sequences.empty());
  for (const ReferenceGeneration& g : ref.sequences) {
    const Split r = run_split(tiny_vllm() + " generate --model " + model() + " --device cpu --prompt-ids " +
                              q(ids_arg(g.prompt_ids)) + " --max-tokens " +
                              std::to_string(ref.max_new_tokens) + " --output json");
    ASSERT_EQ(r.exit_code, 0) << g.name << ": " << r.err;
    const nlohmann::json j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["prompt_ids"].get<std::vector<int32_t>>(), g.prompt_ids) << g.name;
    EXPECT_EQ(j["ids"].get<std::vector<int32_t>>(), g.output_ids) << g.name;
    EXPECT_EQ(j["finish_reason"], g.stopped_at_eos ? "stop" : "length") << g.name;
  }
}

// Issue 18: the transformers-written Qwen2 / Qwen3 / biased-Llama models (tests/data/models, no tokenizer),
// through lesson 10's cached decode loop: exactly transformers' fp32 greedy ids (its generate ran without an
// EOS stop, hence --ignore-eos).
TEST(GenerateCli, FamilyModelsGreedyEqualsTransformers) {
  for (const std::string& family : testing::computed_families()) {
    const testing::FamilyReference ref = testing::read_family_reference(family);
    const Split r = run_split(tiny_vllm() + " generate --model " + q(testing::family_model_dir(family).string()) +
                              " --device cpu --prompt-ids " + q(ids_arg(ref.prompt_ids)) + " --max-tokens " +
                              std::to_string(ref.greedy_ids.size()) + " --ignore-eos --output json");
    ASSERT_EQ(r.exit_code, 0) << family << ": " << r.err;
    EXPECT_EQ(nlohmann::json::parse(r.out)["ids"].get<std::vector<int32_t>>(), ref.greedy_ids) << family;
  }
}

// --batch-invariant changes the kernels, not the answer: on the CPU the same ids as Hugging Face.
TEST(GenerateCli, BatchInvariantGivesTheSameIds) {
  const ReferenceGenerations ref = read_reference_generations(testing::tiny_model_dir());
  const ReferenceGeneration& g = ref.sequences.back();
  const Split r = run_split(tiny_vllm() + " generate --model " + model() + " --device cpu --prompt-ids " +
                            q(ids_arg(g.prompt_ids)) + " --max-tokens " + std::to_string(ref.max_new_tokens) +
                            " --output json --batch-invariant");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out)["ids"].get<std::vector<int32_t>>(), g.output_ids);
}

TEST(GenerateCli, JsonHasEveryFieldAndStreamedTextEqualsIt) {
  const ReferenceGenerations ref = read_reference_generations(testing::tiny_model_dir());
  const ReferenceGeneration& g = ref.sequences.back();  // the longest prompt, no EOS: max tokens
  const std::string base = tiny_vllm() + " generate --model " + model() + " --device cpu --prompt-ids " +
                           q(ids_arg(g.prompt_ids)) + " --max-tokens 20";
  const Split js = run_split(base + " --output json");
  ASSERT_EQ(js.exit_code, 0) << js.err;
  const nlohmann::json j = nlohmann::json::parse(js.out);
  for (const char* key : {"prompt_ids", "ids", "text", "finish_reason", "timing"})
    EXPECT_TRUE(j.contains(key)) << key;
  for (const char* key : {"prefill_ms", "decode_ms", "prefill_tok_s", "decode_tok_s"}) {
    ASSERT_TRUE(j["timing"].contains(key)) << key;
    EXPECT_TRUE(j["timing"][key].is_number()) << key;
    EXPECT_GT(j["timing"][key].get<double>(), 0.0) << key;
  }
  EXPECT_EQ(j["ids"].size(), 20u);
  EXPECT_EQ(j["finish_reason"], "length");
  const Tokenizer tok = Tokenizer::from_file(testing::tiny_model_dir() / "tokenizer.json");
  EXPECT_EQ(j["text"].get<std::string>(), tok.decode(j["ids"].get<std::vector<int32_t>>(), true));

  // Text mode: the same text on stdout (streamed, then one newline), the timing line on stderr.
  const Split text = run_split(base);
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_EQ(text.out, j["text"].get<std::string>() + "\n");
  EXPECT_TRUE(contains(text.err, "prefill: " + std::to_string(g.prompt_ids.size()) + " tokens")) << text.err;
  EXPECT_TRUE(contains(text.err, "decode: 19 tokens")) << text.err;
  EXPECT_TRUE(contains(text.err, "tok/s")) << text.err;
  EXPECT_TRUE(contains(text.err, "finish_reason: length")) << text.err;
}

TEST(GenerateCli, TextAndChatPromptsEncodeAsHuggingFace) {
  const nlohmann::json manifest = read_json(testing::tiny_model_dir() / "reference" / "manifest.json");
  // --prompt: tokenizer(prompt), BOS from the post-processor.
  const nlohmann::json& p0 = manifest_prompt(manifest, "text");
  Split r =
      run_split(tiny_vllm() + " generate --model " + model() + " --device cpu --max-tokens 4 --output json" +
                " --prompt " + q(p0["text"].get<std::string>()));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out)["prompt_ids"], p0["ids"]);
  // --chat --prompt: apply_chat_template(tokenize=True): the template's BOS, no second one.
  const nlohmann::json& p1 = manifest_prompt(manifest, "chat");
  ASSERT_EQ(p1["messages"].size(), 1u);
  r = run_split(tiny_vllm() + " generate --model " + model() +
                " --device cpu --max-tokens 4 --output json --chat" + " --prompt " +
                q(p1["messages"][0]["content"].get<std::string>()));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out)["prompt_ids"], p1["ids"]);
  // With --system the system message comes first.
  r = run_split(tiny_vllm() + " generate --model " + model() +
                " --device cpu --max-tokens 2 --output json --chat --system 'Be brief.' --prompt Hi");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const Tokenizer tok = Tokenizer::from_file(testing::tiny_model_dir() / "tokenizer.json");
  EXPECT_EQ(tok.decode(nlohmann::json::parse(r.out)["prompt_ids"].get<std::vector<int32_t>>()),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe "
            "brief.<|eot_id|><|start_header_id|>user"
            "<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n");
}

TEST(GenerateCli, SamplingIsSeededAndTopK1IsGreedy) {
  const std::string base =
      tiny_vllm() + " generate --model " + model() +
      " --device cpu --prompt 'The capital of Portugal is' --max-tokens 12 --ignore-eos --output json";
  const auto ids = [&](const std::string& flags) {
    const Split r = run_split(base + " " + flags);
    EXPECT_EQ(r.exit_code, 0) << flags << ": " << r.err;
    return nlohmann::json::parse(r.out)["ids"].get<std::vector<int32_t>>();
  };
  EXPECT_EQ(ids("--temperature 1.5 --seed 7"), ids("--temperature 1.5 --seed 7"));
  EXPECT_EQ(ids("--temperature 1.5 --top-k 1 --seed 3"), ids(""));  // one token kept: the argmax
  // --ignore-eos: exactly max tokens even though greedy stops at EOS after 6 ("Lisbon.")
  EXPECT_EQ(ids("").size(), 12u);
}

TEST(GenerateCli, DirectoryWithoutTokenizerWorksWithPromptIds) {
  TempDir dir;
  model_copy(dir.path());
  const ReferenceGenerations ref = read_reference_generations(testing::tiny_model_dir());
  const ReferenceGeneration& g = ref.sequences.front();
  const std::string base = tiny_vllm() + " generate --model " + q(dir.path().string()) + " --device cpu";
  Split r = run_split(base + " --prompt-ids " + q(ids_arg(g.prompt_ids)) + " --max-tokens " +
                      std::to_string(ref.max_new_tokens) + " --output json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["ids"].get<std::vector<int32_t>>(), g.output_ids);
  EXPECT_FALSE(j.contains("text"));
  // Text mode streams the ids.
  r = run_split(base + " --prompt-ids " + q(ids_arg(g.prompt_ids)) + " --max-tokens 3");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, ids_arg({g.output_ids.begin(), g.output_ids.begin() + 3}) + "\n");
  // --prompt says what to do instead.
  r = run_split(base + " --prompt hello --max-tokens 3");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.err, "no tokenizer.json")) << r.err;
  EXPECT_TRUE(contains(r.err, "--prompt-ids")) << r.err;
}

TEST(GenerateCli, BadRequestsExitTwoWithAMessage) {
  const std::string base = tiny_vllm() + " generate --model " + model() + " --device cpu ";
  const struct {
    std::string args, message;
  } cases[] = {
      {"--prompt-ids '744 474' --max-tokens 5000", "exceeds the model's context of 2048"},
      {"--prompt-ids '744 99999' --max-tokens 4", "outside the vocabulary [0, 1000)"},
      {"--prompt-ids '744 x'", "\"x\" is not a token id"},
      {"--prompt-ids '744 -3'", "\"-3\" is not a token id"},
      {"--prompt-ids ''", "empty"},
      {"--prompt hi --temperature -1", "temperature"},
      {"--prompt hi --top-p 1.5", "top_p"},
      {"--prompt hi --top-k -2", "top_k"},
      {"--prompt hi --max-tokens 0", "--max-tokens"},
      {"--prompt hi --prompt-ids 1", "one of them"},
      {"--max-tokens 3", "--prompt"},
      {"--prompt-ids 1 --chat", "--chat"},
      {"--prompt hi --system x", "add --chat"},
      {"--prompt hi --no-such-flag", "no-such-flag"},
      {"--prompt hi --output yaml", "yaml"},
      {"--prompt hi --device tpu", "tpu"},
  };
  for (const auto& c : cases) {
    const Split r = run_split(base + c.args);
    EXPECT_EQ(r.exit_code, 2) << c.args << "\n" << r.out << r.err;
    EXPECT_TRUE(contains(r.err, c.message)) << c.args << ": " << r.err;
  }
  if (!cuda_available()) {
    const Split r = run_split(tiny_vllm() + " generate --model " + model() + " --device cuda --prompt hi");
    EXPECT_EQ(r.exit_code, 2);
    EXPECT_TRUE(contains(r.err, "no CUDA GPU")) << r.err;
  }
}

TEST(GenerateCli, UnknownChatTemplateNamesTheWayOut) {
  TempDir dir;
  model_copy(dir.path(), R"({"bos_token": "<|begin_of_text|>", "chat_template":
      "{% for message in messages %}{{ '<|user|>\n' + message['content'] + eos_token }}{% endfor %}"})");
  const std::string base =
      tiny_vllm() + " generate --model " + q(dir.path().string()) + " --device cpu --max-tokens 2";
  Split r = run_split(base + " --chat --prompt hi");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.err, "--prompt-ids")) << r.err;
  EXPECT_TRUE(contains(r.err, "without --chat")) << r.err;
  r = run_split(base + " --prompt hi");  // without --chat the template is never read
  EXPECT_EQ(r.exit_code, 0) << r.err;
  r = run_split(tiny_vllm() + " chat --model " + q(dir.path().string()) + " --device cpu < /dev/null");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.err, "--prompt-ids")) << r.err;
}

// ---- tokenize / detokenize --------------------------------------------------------------------------------

TEST(TokenizeCli, EqualsTheReferenceCasesOneTextAndJsonLines) {
  const nlohmann::json cases =
      read_json(testing::tiny_model_dir() / "reference" / "tokenizer_cases.json")["cases"];
  ASSERT_GE(cases.size(), 10u);
  TempDir dir;
  std::string input;
  for (const auto& c : cases) input += c["text"].dump() + "\n";
  write_file(dir / "in.jsonl", input);
  const Split r =
      run_split(tiny_vllm() + " tokenize --model " + model() + " < " + q((dir / "in.jsonl").string()));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::vector<std::string> out = lines_of(r.out);
  ASSERT_EQ(out.size(), cases.size());
  for (size_t i = 0; i < cases.size(); ++i)
    EXPECT_EQ(nlohmann::json::parse(out[i]), cases[i]["ids"]) << cases[i]["name"];

  // --text: the same arrays (texts the shell can carry), and --tokenizer FILE is the same as --model DIR.
  int single = 0;
  for (const auto& c : cases) {
    const std::string text = c["text"];
    if (text.empty() || text.find('\0') != std::string::npos) continue;
    const Split t =
        run_split(tiny_vllm() + " tokenize --tokenizer " +
                  q((testing::tiny_model_dir() / "tokenizer.json").string()) + " --text " + q(text));
    ASSERT_EQ(t.exit_code, 0) << t.err;
    EXPECT_EQ(t.out, c["ids"].dump() + "\n") << c["name"];
    ++single;
  }
  EXPECT_GE(single, 5);
}

TEST(TokenizeCli, DetokenizeIsTheInverse) {
  const nlohmann::json cases =
      read_json(testing::tiny_model_dir() / "reference" / "tokenizer_cases.json")["cases"];
  TempDir dir;
  std::string input;
  for (const auto& c : cases) input += c["text"].dump() + "\n";
  write_file(dir / "in.jsonl", input);
  // tokenize | detokenize == the input, line by line (JSON strings out).
  const Split r =
      run_split(tiny_vllm() + " tokenize --model " + model() + " < " + q((dir / "in.jsonl").string()) +
                " | " + tiny_vllm() + " detokenize --model " + model());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::vector<std::string> out = lines_of(r.out);
  ASSERT_EQ(out.size(), cases.size());
  for (size_t i = 0; i < cases.size(); ++i) EXPECT_EQ(nlohmann::json::parse(out[i]), cases[i]["text"]) << i;
  // --ids prints the text itself; --skip-special-tokens drops <|begin_of_text|>.
  Split t = run_split(tiny_vllm() + " detokenize --model " + model() + " --ids '744 474 274 370'");
  EXPECT_EQ(t.exit_code, 0) << t.err;
  EXPECT_EQ(t.out, "<|begin_of_text|>The cap\n");
  t = run_split(tiny_vllm() + " detokenize --model " + model() +
                " --ids '[744, 474, 274, 370]' --skip-special-tokens");
  EXPECT_EQ(t.out, "The cap\n");
}

TEST(TokenizeCli, MalformedInputExitsTwoNamingTheLine) {
  const struct {
    std::string command, stdin_text, message;
  } cases[] = {
      {"tokenize", "\"fine\"\nnot json\n", "stdin line 2"},
      {"tokenize", "\"fine\"\n[1, 2]\n", "stdin line 2: expected a JSON string"},
      {"tokenize", "\"a\" \"b\"\n", "stdin line 1"},
      {"tokenize", "\"\\ud800\"\n", "stdin line 1"},  // a lone surrogate is not text
      {"detokenize", "[1, 2]\n\"text\"\n", "stdin line 2: expected a JSON array"},
      {"detokenize", "[1, -2]\n", "stdin line 1"},
      {"detokenize", "[1, 1.5]\n", "stdin line 1"},
      {"detokenize", "[5000]\n", "stdin line 1"},
  };
  TempDir dir;
  for (const auto& c : cases) {
    write_file(dir / "in", c.stdin_text);
    const Split r =
        run_split(tiny_vllm() + " " + c.command + " --model " + model() + " < " + q((dir / "in").string()));
    EXPECT_EQ(r.exit_code, 2) << c.stdin_text << r.err;
    EXPECT_TRUE(contains(r.err, c.message)) << c.stdin_text << ": " << r.err;
  }
  // The good lines before the bad one were answered.
  write_file(dir / "in", "\"The\"\nnot json\n");
  const Split r = run_split(tiny_vllm() + " tokenize --model " + model() + " < " + q((dir / "in").string()));
  EXPECT_EQ(r.out, "[474]\n");
  // Neither or both of --tokenizer / --model; a directory without tokenizer.json.
  EXPECT_EQ(run_command(tiny_vllm() + " tokenize --text hi").exit_code, 2);
  TempDir empty;
  const auto e = run_command(tiny_vllm() + " tokenize --model " + q(empty.path().string()) + " --text hi");
  EXPECT_EQ(e.exit_code, 2);
  EXPECT_TRUE(contains(e.output, "no tokenizer.json")) << e.output;
}

// --enable-thinking true|false: Qwen3's template switch, exactly what apply_chat_template renders for each (the
// qwen3 fixture's real template with the bundled weights and tokenizer: the prompt's text is what is checked).
fs::path qwen3_config() { return testing::test_data_dir() / "chat_templates" / "qwen3" / "tokenizer_config.json"; }

TEST(GenerateCli, EnableThinkingFollowsTheTemplate) {
  TempDir dir;
  model_copy(dir.path(), read_file(qwen3_config()));
  const Tokenizer tok = Tokenizer::from_file(testing::tiny_model_dir() / "tokenizer.json");
  const std::string base = tiny_vllm() + " generate --model " + q(dir.path().string()) +
                           " --device cpu --max-tokens 1 --output json --chat --prompt Hi";
  const auto prompt_text = [&](const std::string& flags) {
    const Split r = run_split(base + flags);
    EXPECT_EQ(r.exit_code, 0) << flags << ": " << r.err;
    EXPECT_FALSE(contains(r.err, "no thinking switch")) << r.err;
    return tok.decode(nlohmann::json::parse(r.out)["prompt_ids"].get<std::vector<int32_t>>());
  };
  const std::string thinking = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n";
  EXPECT_EQ(prompt_text(""), thinking);  // the template's default: true, nothing appended
  EXPECT_EQ(prompt_text(" --enable-thinking true"), thinking);
  EXPECT_EQ(prompt_text(" --enable-thinking false"), thinking + "<think>\n\n</think>\n\n");

  // A template without the switch (the bundled llama3 one): the same prompt, and a note saying so.
  const std::string llama = tiny_vllm() + " generate --model " + model() +
                            " --device cpu --max-tokens 1 --output json --chat --prompt Hi";
  const Split plain = run_split(llama);
  const Split off = run_split(llama + " --enable-thinking false");
  ASSERT_EQ(plain.exit_code, 0) << plain.err;
  ASSERT_EQ(off.exit_code, 0) << off.err;
  EXPECT_EQ(nlohmann::json::parse(off.out)["prompt_ids"], nlohmann::json::parse(plain.out)["prompt_ids"]);
  EXPECT_TRUE(contains(off.err, "chat template (llama3) has no thinking switch")) << off.err;

  // Bad usage: without --chat there is no template; only true and false are values.
  const std::string bare = tiny_vllm() + " generate --model " + model() + " --device cpu --max-tokens 1 ";
  Split r = run_split(bare + "--prompt hi --enable-thinking false");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.err, "--enable-thinking is a chat template switch: add --chat")) << r.err;
  for (const char* v : {"maybe", "0", "False", "''"}) {
    r = run_split(bare + "--chat --prompt hi --enable-thinking " + v);
    EXPECT_EQ(r.exit_code, 2) << v;
    EXPECT_TRUE(contains(r.err, "--enable-thinking")) << v << ": " << r.err;
  }
}

// ---- chat -------------------------------------------------------------------------------------------------

// What the chat must answer to `history` + `user`, from the library (template, tokenizer, Generator).
std::string expected_answer(std::vector<ChatMessage>& history, const std::string& user, int64_t max_tokens) {
  static const ModelDir dir = ModelDir::open(testing::tiny_model_dir());
  static const ModelWeights w = ModelWeights::bind(dir, Device::CPU);
  static const Tokenizer tok = Tokenizer::from_file(testing::tiny_model_dir() / "tokenizer.json");
  static const ChatTemplate tmpl = *ChatTemplate::from_model_dir(testing::tiny_model_dir());
  history.push_back({"user", user});
  const std::vector<int32_t> prompt = tok.encode(tmpl.render(history), false);
  Generator gen(w, Generator::limits_for(dir.config, 2048, 1));
  GenerateOptions options;
  options.max_new_tokens = max_tokens;
  const std::string answer = tok.decode(gen.generate(prompt, options).ids, true);
  history.push_back({"assistant", answer});
  return answer;
}

TEST(ChatCli, TwoTurnsResetAndEndOfInputThroughAPipe) {
  TempDir dir;
  write_file(dir / "in",
             "Give me one tip for baking bread.\n"
             "How do I know when bread is done?\n"
             "\n"  // an empty line is skipped
             "/reset\n"
             "Give me one tip for baking bread.\n");  // then end of input: a clean exit
  const Split r = run_split(tiny_vllm() + " chat --model " + model() + " --device cpu --max-tokens 40 < " +
                            q((dir / "in").string()));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::vector<std::string> answers = lines_of(r.out);
  ASSERT_EQ(answers.size(), 3u) << r.out;
  std::vector<ChatMessage> history;
  EXPECT_EQ(answers[0], expected_answer(history, "Give me one tip for baking bread.", 40));
  EXPECT_FALSE(answers[0].empty());
  // The second turn saw the first (the whole conversation re-rendered).
  EXPECT_EQ(answers[1], expected_answer(history, "How do I know when bread is done?", 40));
  // After /reset the conversation starts over: the first answer again.
  EXPECT_EQ(answers[2], answers[0]);
  size_t stats = 0;
  for (size_t at = r.err.find("tok/s"); at != std::string::npos; at = r.err.find("tok/s", at + 1)) ++stats;
  EXPECT_EQ(stats, 3u) << r.err;
  EXPECT_TRUE(contains(r.err, "(new conversation)")) << r.err;
}

TEST(ChatCli, QuitStopsAndSystemMessageIsUsed) {
  TempDir dir;
  write_file(dir / "in", "Hi\n/quit\nnever answered\n");
  const Split r =
      run_split(tiny_vllm() + " chat --model " + model() +
                " --device cpu --max-tokens 8 --system 'You are terse.' < " + q((dir / "in").string()));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  ASSERT_EQ(lines_of(r.out).size(), 1u) << r.out;
  std::vector<ChatMessage> history{{"system", "You are terse."}};
  EXPECT_EQ(lines_of(r.out)[0], expected_answer(history, "Hi", 8));
}

TEST(ChatCli, AFullContextIsReportedNotACrash) {
  TempDir dir;
  // 40 positions: the first turn (27 prompt tokens) fills the context while answering; the second turn no
  // longer fits and is not sent; after /reset the chat works again.
  write_file(dir / "in",
             "Give me one tip for baking bread.\nAnd another?\n/reset\nGive me one tip for baking bread.\n");
  const Split r = run_split(tiny_vllm() + " chat --model " + model() + " --device cpu --max-context 40 < " +
                            q((dir / "in").string()));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "the context is full")) << r.err;
  EXPECT_TRUE(contains(r.err, "nothing was sent")) << r.err;
  EXPECT_TRUE(contains(r.err, "/reset")) << r.err;
  const std::vector<std::string> answers = lines_of(r.out);
  ASSERT_EQ(answers.size(), 2u) << r.out;
  EXPECT_EQ(answers[0], answers[1]);
}

TEST(ChatCli, EnableThinkingAppliesToEveryTurn) {
  TempDir dir;
  model_copy(dir.path(), read_file(qwen3_config()));
  write_file(dir / "in", "Hi\nAgain\n");
  const Tokenizer tok = Tokenizer::from_file(testing::tiny_model_dir() / "tokenizer.json");
  const ChatTemplate tmpl = *ChatTemplate::from_model_dir(dir.path());
  const auto first_prompt = [&](bool thinking) {  // the chat's stderr line: "prompt N tokens"
    return "prompt " + std::to_string(tok.encode(tmpl.render({{"user", "Hi"}}, true, {}, thinking), false).size()) +
           " tokens";
  };
  ASSERT_NE(first_prompt(true), first_prompt(false));
  const std::string base =
      tiny_vllm() + " chat --model " + q(dir.path().string()) + " --device cpu --max-tokens 2";
  Split r = run_split(base + " --enable-thinking false < " + q((dir / "in").string()));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, first_prompt(false))) << r.err;
  EXPECT_EQ(lines_of(r.out).size(), 2u) << r.out;  // both turns answered
  r = run_split(base + " < " + q((dir / "in").string()));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, first_prompt(true))) << r.err;
  r = run_split(base + " --enable-thinking yes < /dev/null");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.err, "--enable-thinking")) << r.err;
}

TEST(ChatCli, BadUsageExitsTwo) {
  EXPECT_EQ(run_command(tiny_vllm() + " chat --model " + model() + " --temperature -1 < /dev/null").exit_code,
            2);
  EXPECT_EQ(run_command(tiny_vllm() + " chat < /dev/null").exit_code, 2);  // --model is required
  TempDir dir;
  model_copy(dir.path());  // no tokenizer
  const auto r = run_command(tiny_vllm() + " chat --model " + q(dir.path().string()) + " < /dev/null");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.output, "no tokenizer.json")) << r.output;
}

}  // namespace
}  // namespace tvllm
