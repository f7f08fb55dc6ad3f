// lesson09_tokenizer_sampling: load the model's tokenizer.json and check it against Hugging Face on the
// reference cases (reference/tokenizer_cases.json, written by weights/tools/make_reference.py):
//   - encode(text) == HF's ids (add_special_tokens false: special-token strings in the text still match)
//   - decode(ids) == text (every plain case round-trips; a case may give HF's "decoded" when it differs, as a
//     SentencePiece tokenizer's chat prompt does)
//   - the incremental decoder, fed one id at a time, writes exactly decode(ids)
//   - encode(text, add_special_tokens=true) == the template's BOS + ids
// --bench: encode throughput on the project's corpus (MB/s, tokens/s), a long single word, decode speeds.
//
//   build/bin/lesson09_tokenizer_sampling [--model DIR] [--device auto|cpu|cuda] [--bench]
//
// The tokenizer is host code: --device is accepted (the course skeleton) but changes nothing here.
// (Sampling, the GPU half of the lesson, comes next.)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "common/bench.h"
#include "common/errors.h"
#include "common/lesson.h"
#include "common/validate.h"
#include "json_strict.h"
#include "tokenizer.h"

namespace tvllm {
namespace {

std::string read_text(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(path.string() + ": cannot read it");
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// "[1, 2, 3]" (at most `max` ids, then "...").
std::string show_ids(const std::vector<int32_t>& ids, size_t max = 12) {
  std::string s = "[";
  for (size_t i = 0; i < ids.size() && i < max; ++i) s += (i ? ", " : "") + std::to_string(ids[i]);
  return s + (ids.size() > max ? ", ...]" : "]");
}

// Where two id lists first differ, for the report.
std::string first_difference(const std::vector<int32_t>& got, const std::vector<int32_t>& want) {
  size_t i = 0;
  while (i < got.size() && i < want.size() && got[i] == want[i]) ++i;
  const auto tail = [&](const std::vector<int32_t>& v) {
    return show_ids(std::vector<int32_t>(v.begin() + static_cast<std::ptrdiff_t>(std::min(i, v.size())), v.end()), 6);
  };
  return "ids differ at position " + std::to_string(i) + ": got " + tail(got) + ", HF " + tail(want) + " (" +
         std::to_string(got.size()) + " vs " + std::to_string(want.size()) + " ids)";
}

std::string stream_decode(const Tokenizer& tok, const std::vector<int32_t>& ids) {
  IncrementalDecoder stream(tok);
  std::string out;
  for (int32_t id : ids) out += stream.push(id);
  return out + stream.finish();
}

void check_cases(const Tokenizer& tok, const std::filesystem::path& path, Report& report) {
  const nlohmann::json doc = parse_json_strict(read_text(path), path.string());
  if (!doc.is_object() || !doc.contains("cases") || !doc["cases"].is_array())
    throw InputError(path.string() + ": expected an object with a \"cases\" array");
  // null (Qwen: no BOS) or absent: nothing for the post-processor check.
  const auto bos_field = doc.find("bos_token_id");
  const int64_t bos = bos_field != doc.end() && bos_field->is_number_integer() ? bos_field->get<int64_t>() : -1;
  bool bos_checked = false;
  for (const auto& c : doc["cases"]) {
    if (!c.is_object() || !c.contains("text") || !c["text"].is_string() || !c.contains("ids") || !c["ids"].is_array())
      throw InputError(path.string() + ": each case needs \"text\" (a string) and \"ids\" (an array)");
    const std::string name = c.value("name", std::string("case"));
    const std::string text = c["text"].get<std::string>();
    const std::vector<int32_t> want = c["ids"].get<std::vector<int32_t>>();
    // "decoded": Hugging Face's decode(ids) where it is not the text (a SentencePiece chat prompt).
    const std::string decoded =
        c.contains("decoded") && c["decoded"].is_string() ? c["decoded"].get<std::string>() : text;
    const std::vector<int32_t> got = tok.encode(text);
    std::string problem;
    if (got != want) {
      problem = first_difference(got, want);
    } else if (tok.decode(want) != decoded) {
      problem = decoded == text ? "decode(ids) != text" : "decode(ids) != Hugging Face's decode";
    } else if (stream_decode(tok, want) != decoded) {
      problem = "the incremental decoder's text != decode(ids)";
    }
    report.add_check(name, problem.empty(), problem);
    if (!bos_checked && bos >= 0 && !text.empty()) {  // the post-processor, once
      bos_checked = true;
      std::vector<int32_t> with_bos = want;
      with_bos.insert(with_bos.begin(), static_cast<int32_t>(bos));
      const std::vector<int32_t> got_bos = tok.encode(text, /*add_special_tokens=*/true);
      report.add_check("add_special_tokens adds BOS", got_bos == with_bos,
                       got_bos == with_bos ? "" : first_difference(got_bos, with_bos));
    }
  }
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void run_bench(const std::filesystem::path& tokenizer_path) {
  const std::filesystem::path corpus_dir = default_model_dir().parent_path() / "corpus";
  std::vector<std::filesystem::path> files;
  for (const auto& e : std::filesystem::directory_iterator(corpus_dir))
    if (e.path().extension() == ".txt") files.push_back(e.path());
  std::sort(files.begin(), files.end());
  std::string corpus;
  for (const auto& f : files) corpus += read_text(f) + "\n\n";
  if (corpus.empty()) throw InputError(corpus_dir.string() + ": no *.txt files to benchmark on");
  std::string big;  // ~1 MB: the corpus again and again
  while (big.size() < (1u << 20)) big += corpus;

  const auto t_load = std::chrono::steady_clock::now();
  Tokenizer tok = Tokenizer::from_file(tokenizer_path);  // a fresh tokenizer: its word cache is empty
  const double load_s = seconds_since(t_load);
  const auto t_cold = std::chrono::steady_clock::now();
  const std::vector<int32_t> ids = tok.encode(big);
  const double cold_s = seconds_since(t_cold);
  const BenchResult warm = bench_cpu([&] { (void)tok.encode(big); }, 1, 5);
  const double mb = static_cast<double>(big.size()) / 1e6;

  std::printf("\n== tokenizer benchmark (host, one thread) ==\n");
  std::printf("load %s: %.1f ms\n", tokenizer_path.string().c_str(), load_s * 1e3);
  std::printf("encode %.2f MB of corpus text -> %zu tokens (%.2f bytes/token)\n", mb, ids.size(),
              static_cast<double>(big.size()) / static_cast<double>(ids.size()));
  std::printf("  first pass (word cache cold) %8.1f ms  %7.1f MB/s  %6.2f M tokens/s\n", cold_s * 1e3, mb / cold_s,
              static_cast<double>(ids.size()) / cold_s / 1e6);
  const double w = warm.median_ms / 1e3;
  std::printf("  cache warm (median of %d)    %8.1f ms  %7.1f MB/s  %6.2f M tokens/s\n", warm.iters,
              warm.median_ms, mb / w, static_cast<double>(ids.size()) / w / 1e6);

  // One pre-token of 100 KB and of 200 KB (no cache, no regex split helps): the merge loop alone. With a
  // priority queue the time doubles with the length; a rescan-after-every-merge loop would quadruple.
  for (size_t n : {100000u, 200000u}) {
    std::string word;
    while (word.size() < n) word += "abcdefghij";
    word.resize(n);
    const BenchResult r = bench_cpu([&] { (void)tok.encode(word); }, 0, 3);
    std::printf("one %zu-byte word (letters only: a single pre-token): %8.1f ms\n", n, r.median_ms);
  }

  const BenchResult dec = bench_cpu([&] { (void)tok.decode(ids); }, 1, 5);
  const BenchResult inc = bench_cpu([&] { (void)stream_decode(tok, ids); }, 1, 5);
  std::printf("decode %zu tokens: %.1f ms (%.1f M tokens/s); one at a time (IncrementalDecoder): %.1f ms "
              "(%.1f M tokens/s)\n",
              ids.size(), dec.median_ms, static_cast<double>(ids.size()) / dec.median_ms / 1e3, inc.median_ms,
              static_cast<double>(ids.size()) / inc.median_ms / 1e3);
}

int run(const LessonOptions& opt) {
  const std::filesystem::path tokenizer_path = opt.model_dir / "tokenizer.json";
  if (!std::filesystem::exists(tokenizer_path))
    throw InputError(opt.model_dir.string() + " has no tokenizer.json: lesson 09 checks a tokenizer (a model "
                                              "without one takes token ids, --prompt-ids)");
  const Tokenizer tok = Tokenizer::from_file(tokenizer_path);
  std::printf("tokenizer %s: %s\n", tokenizer_path.string().c_str(), tok.describe().c_str());
  if (opt.device == Device::CUDA) std::printf("note: the tokenizer runs on the host whatever --device says\n");

  const std::filesystem::path cases = opt.model_dir / "reference" / "tokenizer_cases.json";
  if (!std::filesystem::exists(cases))
    throw InputError(cases.string() + " is missing: make it with weights/tools/make_reference.py " +
                     opt.model_dir.string());
  Report report("lesson 09 tokenizer vs Hugging Face (" + cases.filename().string() + ")");
  check_cases(tok, cases, report);
  report.print(std::cout);
  if (opt.bench) run_bench(tokenizer_path);
  return report.exit_code();
}

}  // namespace
}  // namespace tvllm

int main(int argc, char** argv) {
  tvllm::LessonCli cli("lesson09_tokenizer_sampling",
                       "the tokenizer: Hugging Face tokenizer.json, byte-level and SentencePiece BPE");
  return cli.run(argc, argv, [](const tvllm::LessonOptions& opt) { return tvllm::run(opt); });
}
