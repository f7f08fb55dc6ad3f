// Lesson 10: reading the reference continuations, and judging ours against them.
#include "generate_check.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>

#include "common/errors.h"
#include "json_strict.h"
#include "safetensors.h"

namespace tvllm {

namespace {

std::vector<int32_t> ids_of(const SafetensorsFile& file, const std::string& name) {
  const TensorView t = file.host_view(name);
  TVLLM_REQUIRE(t.dtype == DType::I32 && t.rank() == 1, file.path().string() + ": " + name + " must be I32 [n], got " +
                                                            t.describe());
  return std::vector<int32_t>(t.ptr<const int32_t>(), t.ptr<const int32_t>() + t.numel());
}

}  // namespace

ReferenceGenerations read_reference_generations(const std::filesystem::path& model_dir) {
  const std::filesystem::path dir = model_dir / "reference";
  const std::filesystem::path manifest_path = dir / "manifest.json";
  std::ifstream in(manifest_path, std::ios::binary);
  TVLLM_REQUIRE(in.good(), manifest_path.string() + ": cannot open (make it with weights/tools/make_reference.py)");
  std::stringstream text;
  text << in.rdbuf();
  const nlohmann::json manifest = parse_json_strict(text.str(), manifest_path.string());
  const std::string where = manifest_path.string() + ": ";
  TVLLM_REQUIRE(manifest.is_object() && manifest.contains("generate") && manifest["generate"].is_object(),
                where + "no \"generate\" object");
  const nlohmann::json& g = manifest["generate"];

  ReferenceGenerations out;
  try {
    out.max_new_tokens = g.at("max_new_tokens").get<int64_t>();
    for (const auto& id : g.at("eos_token_ids")) out.eos_ids.push_back(id.get<int64_t>());
    const std::unique_ptr<SafetensorsFile> file = SafetensorsFile::open(dir / "generate.safetensors");
    for (const auto& s : g.at("sequences")) {
      ReferenceGeneration r;
      r.name = s.at("name").get<std::string>();
      r.prompt = s.at("prompt").get<std::string>();
      r.stopped_at_eos = s.at("stopped_at_eos").get<bool>();
      r.min_top1_margin = s.at("min_top1_margin").get<double>();
      r.prompt_ids = ids_of(*file, r.name + ".prompt_ids");
      r.output_ids = ids_of(*file, r.name + ".output_ids");
      TVLLM_REQUIRE(!r.prompt_ids.empty() && !r.output_ids.empty(), where + r.name + " has no prompt or output ids");
      out.sequences.push_back(std::move(r));
    }
  } catch (const nlohmann::json::exception& e) {
    throw InputError(where + "malformed \"generate\": " + e.what());
  }
  TVLLM_REQUIRE(!out.sequences.empty(), where + "\"generate\" lists no sequence");
  return out;
}

std::string ForcedAgreement::summary() const {
  char text[200];
  std::snprintf(text, sizeof text, "agree %lld/%lld", static_cast<long long>(agree), static_cast<long long>(steps));
  std::string s = text;
  if (near_ties > 0 || unexplained > 0) {
    std::snprintf(text, sizeof text, ", %lld near-tie%s, %lld beyond (first at step %lld, largest gap %.4g vs %.4g)",
                  static_cast<long long>(near_ties), near_ties == 1 ? "" : "s", static_cast<long long>(unexplained),
                  static_cast<long long>(first_disagreement), max_gap, bound);
    s += text;
  }
  return s;
}

ForcedAgreement forced_agreement(const TensorView& logits, const std::vector<int32_t>& reference_ids,
                                 double error_bound) {
  TVLLM_REQUIRE(logits.device == Device::CPU && logits.dtype == DType::F32 && logits.rank() == 2 &&
                    logits.is_contiguous() && logits.shape[0] == static_cast<int64_t>(reference_ids.size()),
                "forced_agreement: logits must be host F32 [" + std::to_string(reference_ids.size()) + ", vocab], got " +
                    logits.describe());
  ForcedAgreement a;
  a.bound = 2 * error_bound;
  const int64_t V = logits.shape[1];
  for (int64_t i = 0; i < logits.shape[0]; ++i) {
    const float* row = logits.ptr<const float>() + i * V;
    int64_t best = 0;
    for (int64_t j = 1; j < V; ++j)
      if (row[j] > row[best]) best = j;
    ++a.steps;
    const int32_t want = reference_ids[static_cast<size_t>(i)];
    if (best == want) {
      ++a.agree;
      continue;
    }
    const double gap = static_cast<double>(row[best]) - static_cast<double>(row[want]);
    a.max_gap = std::max(a.max_gap, gap);
    if (a.first_disagreement < 0) a.first_disagreement = i;
    if (gap <= a.bound) ++a.near_ties;
    else ++a.unexplained;
  }
  return a;
}

int64_t first_difference(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  const size_t n = std::min(a.size(), b.size());
  for (size_t i = 0; i < n; ++i)
    if (a[i] != b[i]) return static_cast<int64_t>(i);
  return a.size() == b.size() ? -1 : static_cast<int64_t>(n);
}

std::string ids_text(const std::vector<int32_t>& ids, size_t max) {
  std::string s = "[";
  for (size_t i = 0; i < ids.size() && i < max; ++i) s += (i ? " " : "") + std::to_string(ids[i]);
  if (ids.size() > max) s += " ...";
  return s + "]";
}

}  // namespace tvllm
