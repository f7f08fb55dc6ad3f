// Lesson 08: teacher-forced top-1 agreement of two logits matrices.
#include "logits_check.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "common/errors.h"
#include "json_strict.h"

namespace tvllm {

namespace {
struct Top2 {
  int64_t arg = 0;
  float first = -INFINITY, second = -INFINITY;
};
Top2 top2(const float* row, int64_t n) {
  Top2 t;
  for (int64_t i = 0; i < n; ++i) {
    if (row[i] > t.first) {
      t.second = t.first;
      t.first = row[i];
      t.arg = i;
    } else if (row[i] > t.second) {
      t.second = row[i];
    }
  }
  return t;
}
}  // namespace

double rms(const TensorView& x) {
  TVLLM_REQUIRE(x.device == Device::CPU && x.dtype == DType::F32 && x.is_contiguous(),
                "rms: a contiguous F32 host view is needed, got " + x.describe());
  double sum = 0.0;
  const float* p = x.ptr<const float>();
  for (int64_t i = 0; i < x.numel(); ++i) sum += static_cast<double>(p[i]) * p[i];
  return x.numel() ? std::sqrt(sum / static_cast<double>(x.numel())) : 0.0;
}

Top1Agreement top1_agreement(const TensorView& actual, const TensorView& reference, double margin) {
  for (const TensorView* v : {&actual, &reference})
    TVLLM_REQUIRE(v->device == Device::CPU && v->dtype == DType::F32 && v->rank() == 2 && v->is_contiguous(),
                  "top1_agreement: contiguous F32 [rows, vocab] host views are needed, got " + v->describe());
  TVLLM_REQUIRE(actual.shape == reference.shape,
                "top1_agreement: shapes differ: " + actual.describe() + " vs " + reference.describe());
  Top1Agreement r;
  r.positions = actual.shape[0];
  r.reference_rms = rms(reference);
  const int64_t V = actual.shape[1];
  for (int64_t t = 0; t < r.positions; ++t) {
    const float* a = actual.ptr<const float>() + t * V;
    const float* e = reference.ptr<const float>() + t * V;
    for (int64_t i = 0; i < V; ++i)
      r.max_abs_error = std::fmax(r.max_abs_error, std::fabs(static_cast<double>(a[i]) - e[i]));
    const Top2 want = top2(e, V);
    const bool agree = top2(a, V).arg == want.arg;
    r.agree_all += agree;
    if (static_cast<double>(want.first) - want.second > margin) {
      ++r.clear;
      r.agree_clear += agree;
      if (!agree && r.first_disagreement < 0) r.first_disagreement = t;
    }
  }
  return r;
}

std::map<std::string, Bf16Floor> read_bf16_floors(const std::filesystem::path& model_dir) {
  const std::filesystem::path path = model_dir / "reference" / "manifest.json";
  std::map<std::string, Bf16Floor> out;
  if (!std::filesystem::exists(path)) return out;  // references without a manifest: the fixed rule
  std::ifstream in(path, std::ios::binary);
  TVLLM_REQUIRE(in.good(), path.string() + ": cannot open");
  std::stringstream text;
  text << in.rdbuf();
  const nlohmann::json manifest = parse_json_strict(text.str(), path.string());
  auto add = [&](const nlohmann::json& entry) {
    if (!entry.is_object() || !entry.contains("hf_bf16")) return;
    const nlohmann::json& f = entry["hf_bf16"];
    Bf16Floor b;
    b.logits_max_abs_error = f.at("logits_max_abs_error").get<double>();
    b.logits_rms_error = f.at("logits_rms_error").get<double>();
    b.top1_agree = f.at("top1_agree").get<int64_t>();
    b.rows = f.at("rows").get<int64_t>();
    if (f.contains("norm_max_abs_error")) b.norm_max_abs_error = f["norm_max_abs_error"].get<double>();
    TVLLM_REQUIRE(std::isfinite(b.logits_max_abs_error) && b.logits_max_abs_error >= 0,
                  path.string() + ": " + entry.at("name").get<std::string>() + ": bad hf_bf16.logits_max_abs_error");
    out[entry.at("name").get<std::string>()] = b;
  };
  try {
    if (manifest.contains("prompts"))
      for (const auto& p : manifest["prompts"]) add(p);
    if (manifest.contains("generate") && manifest["generate"].contains("sequences"))
      for (const auto& s : manifest["generate"]["sequences"]) add(s);
  } catch (const nlohmann::json::exception& e) {
    throw InputError(path.string() + ": malformed \"hf_bf16\": " + e.what());
  }
  return out;
}

const Bf16Floor* find_floor(const std::map<std::string, Bf16Floor>& floors, const std::string& name) {
  const auto it = floors.find(name);
  return it == floors.end() ? nullptr : &it->second;
}

GpuLogitBound gpu_logit_bound(double reference_rms, const Bf16Floor* floor) {
  GpuLogitBound b;
  b.reference_rms = reference_rms;
  b.rms_part = kGpuLogitErrorPerRms * reference_rms;
  b.epsilon = b.rms_part;
  if (floor != nullptr) {
    b.hf_error = floor->logits_max_abs_error;
    b.floor_part = kBf16FloorFactor * floor->logits_max_abs_error;
    b.epsilon = std::max(b.epsilon, b.floor_part);
  }
  return b;
}

std::string GpuLogitBound::describe() const {
  char text[200];
  if (floor_part < 0)
    std::snprintf(text, sizeof text, "%.4g = %.2f x rms %.4g (no HF bf16 floor)", epsilon, kGpuLogitErrorPerRms,
                  reference_rms);
  else
    std::snprintf(text, sizeof text, "%.4g = max(%.2f x rms %.4g, %.1f x HF bf16 %.4g)", epsilon,
                  kGpuLogitErrorPerRms, reference_rms, kBf16FloorFactor, hf_error);
  return text;
}

std::string Top1Agreement::summary() const {
  char text[160];
  std::snprintf(text, sizeof text,
                "clear %lld/%lld agree %lld; all agree %lld/%lld; max |err| %.3g (rms %.3g)",
                (long long)clear, (long long)positions, (long long)agree_clear, (long long)agree_all,
                (long long)positions, max_abs_error, reference_rms);
  return text;
}

}  // namespace tvllm
