// `tiny-vllm generate` and `chat` with --device cuda on the bundled model: the program gives exactly what
// lesson 10's Generator gives on the GPU (same kernels, deterministic), and Hugging Face's greedy ids where
// the reference's margins are large (g0's smallest top-1/top-2 gap is ~2 logits, far above bf16's error).
// Skipped without a GPU.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "chat_template.h"
#include "generate.h"
#include "generate_check.h"
#include "model_dir.h"
#include "testing/cli.h"
#include "testing/testing.h"
#include "tokenizer.h"

namespace tvllm {
namespace {

std::string tiny_vllm() { return testing::tiny_vllm_bin(); }
const auto q = testing::shell_quote;
std::string model() { return testing::tiny_model_arg(); }

namespace fs = std::filesystem;
using testing::run_command;
using testing::TempDir;

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}
std::string ids_arg(const std::vector<int32_t>& ids) {
  std::string s;
  for (int32_t id : ids) s += (s.empty() ? "" : " ") + std::to_string(id);
  return s;
}
struct Split {
  int exit_code = -1;
  std::string out, err;
};
Split run_split(const std::string& command) {
  TempDir dir;
  const auto r = run_command("((" + command + ") > " + q((dir / "out").string()) + " 2> " +
                             q((dir / "err").string()) + ")");
  return {r.exit_code, read_file(dir / "out"), read_file(dir / "err")};
}

struct GpuModel {
  ModelDir dir = ModelDir::open(testing::tiny_model_dir());
  ModelWeights weights = ModelWeights::bind(dir, Device::CUDA);
  Tokenizer tok = Tokenizer::from_file(testing::tiny_model_dir() / "tokenizer.json");
};
GpuModel& gpu_model() {
  static GpuModel m;
  return m;
}
std::vector<int32_t> library_ids(const std::vector<int32_t>& prompt, int64_t max_tokens) {
  Generator gen(gpu_model().weights, Generator::limits_for(gpu_model().dir.config, 2048, 1));
  GenerateOptions options;
  options.max_new_tokens = max_tokens;
  return gen.generate(prompt, options).ids;
}

TEST(GenerateCliGpu, EqualsTheLibraryAndHuggingFaceWhereMarginsAreLarge) {
  TVLLM_REQUIRE_GPU();
  const ReferenceGenerations ref = read_reference_generations(testing::tiny_model_dir());
  for (const ReferenceGeneration& g : ref.sequences) {
    const Split r = run_split(tiny_vllm() + " generate --model " + model() + " --device cuda --prompt-ids " +
                              q(ids_arg(g.prompt_ids)) + " --max-tokens " +
                              std::to_string(ref.max_new_tokens) + " --output json");
    ASSERT_EQ(r.exit_code, 0) << g.name << ": " << r.err;
    const nlohmann::json j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["device"], "cuda");
    const auto ids = j["ids"].get<std::vector<int32_t>>();
    EXPECT_EQ(ids, library_ids(g.prompt_ids, ref.max_new_tokens)) << g.name;
    if (g.min_top1_margin > 1.5) {
      EXPECT_EQ(ids, g.output_ids) << g.name << " (margin " << g.min_top1_margin << ")";
    }
    EXPECT_EQ(j["text"].get<std::string>(), gpu_model().tok.decode(ids, true)) << g.name;
  }
}

TEST(GenerateCliGpu, StreamedTextEqualsJsonAndSamplingIsSeeded) {
  TVLLM_REQUIRE_GPU();
  const std::string base =
      tiny_vllm() + " generate --model " + model() +
      " --device cuda --chat --prompt 'Give me one tip for baking bread.' --max-tokens 40";
  const Split text = run_split(base);
  const Split json = run_split(base + " --output json");
  ASSERT_EQ(text.exit_code, 0) << text.err;
  ASSERT_EQ(json.exit_code, 0) << json.err;
  EXPECT_EQ(text.out, nlohmann::json::parse(json.out)["text"].get<std::string>() + "\n");
  EXPECT_NE(text.err.find("[cuda] prefill:"), std::string::npos) << text.err;
  const auto sampled = [&] {
    const Split r = run_split(base + " --temperature 0.8 --top-p 0.9 --seed 5 --output json");
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return nlohmann::json::parse(r.out)["ids"];
  };
  EXPECT_EQ(sampled(), sampled());
}

TEST(ChatCliGpu, TwoTurnsThroughAPipeEqualTheLibrary) {
  TVLLM_REQUIRE_GPU();
  TempDir dir;
  std::ofstream(dir / "in")
      << "Give me one tip for baking bread.\nHow do I know when bread is done?\n/quit\n";
  const Split r = run_split(tiny_vllm() + " chat --model " + model() + " --device cuda --max-tokens 40 < " +
                            q((dir / "in").string()));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::vector<std::string> answers;
  std::istringstream lines(r.out);
  for (std::string line; std::getline(lines, line);) answers.push_back(line);
  ASSERT_EQ(answers.size(), 2u) << r.out;
  const ChatTemplate tmpl = *ChatTemplate::from_model_dir(testing::tiny_model_dir());
  std::vector<ChatMessage> history;
  for (size_t turn = 0; turn < 2; ++turn) {
    history.push_back(
        {"user", turn == 0 ? "Give me one tip for baking bread." : "How do I know when bread is done?"});
    const std::string expected =
        gpu_model().tok.decode(library_ids(gpu_model().tok.encode(tmpl.render(history), false), 40), true);
    EXPECT_EQ(answers[turn], expected) << "turn " << turn;
    history.push_back({"assistant", expected});
  }
}

}  // namespace
}  // namespace tvllm
