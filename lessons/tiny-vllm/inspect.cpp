// tiny-vllm inspect FILE_OR_DIR [--json]
//
// The tensor table of a .safetensors file, a sharded model.safetensors.index.json, or a model directory
// (plus its config.json summary). Everything is validated first (lesson 01): a malformed file is an
// InputError, which main() turns into exit code 2 and a message naming the file and the problem.
#include <algorithm>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "commands.h"
#include "common/input_error.h"
#include "common/tensor.h"
#include "model_config.h"
#include "safetensors.h"

namespace tvllm::cli {
namespace {

namespace fs = std::filesystem;

struct InspectOptions {
  std::string path;
  bool json = false;
};

// "layers.2" before "layers.10": digit runs compare as numbers.
bool natural_less(const std::string& a, const std::string& b) {
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    if (std::isdigit(static_cast<unsigned char>(a[i])) && std::isdigit(static_cast<unsigned char>(b[j]))) {
      size_t i2 = i, j2 = j;
      while (i2 < a.size() && std::isdigit(static_cast<unsigned char>(a[i2]))) ++i2;
      while (j2 < b.size() && std::isdigit(static_cast<unsigned char>(b[j2]))) ++j2;
      std::string_view da(a.data() + i, i2 - i), db(b.data() + j, j2 - j);
      while (da.size() > 1 && da[0] == '0') da.remove_prefix(1);
      while (db.size() > 1 && db[0] == '0') db.remove_prefix(1);
      if (da.size() != db.size()) return da.size() < db.size();
      if (da != db) return da < db;
      i = i2;
      j = j2;
    } else {
      if (a[i] != b[j]) return a[i] < b[j];
      ++i;
      ++j;
    }
  }
  return a.size() - i < b.size() - j;
}

std::string human_bytes(uint64_t b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", v, units[u]);
  return buf;
}

nlohmann::json config_json(const ModelConfig& c) {
  nlohmann::json j;
  j["model_type"] = c.model_type;
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_key_value_heads;
  j["head_dim"] = c.head_dim;
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["rope_theta"] = c.rope_theta;
  j["rope_type"] = c.rope_scaling.rope_type;
  if (c.rope_scaling.rope_type == "llama3") {
    j["rope_factor"] = c.rope_scaling.factor;
    j["rope_low_freq_factor"] = c.rope_scaling.low_freq_factor;
    j["rope_high_freq_factor"] = c.rope_scaling.high_freq_factor;
    j["rope_original_max_position_embeddings"] = c.rope_scaling.original_max_position_embeddings;
  }
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["bos_token_id"] = c.bos_token_id;
  j["eos_token_ids"] = c.eos_token_ids;
  j["torch_dtype"] = c.torch_dtype;
  if (c.quantization) {
    j["quantization"] = {
        {"method", "compressed-tensors"},
        {"weights", "F8_E4M3"},
        {"strategy", c.quantization->weight_strategy == Fp8Quantization::Strategy::Channel ? "channel" : "tensor"},
        {"dynamic_token_activations", c.quantization->dynamic_token_activations}};
  }
  return j;
}

void print_config(const ModelConfig& c) {
  std::printf("config.json: %s, %lld layers, hidden %lld, intermediate %lld, vocab %lld\n", c.model_type.c_str(),
              (long long)c.num_hidden_layers, (long long)c.hidden_size, (long long)c.intermediate_size,
              (long long)c.vocab_size);
  std::printf("  attention: %lld heads, %lld KV heads (groups of %lld), head_dim %lld (q_dim %lld, kv_dim %lld)\n",
              (long long)c.num_attention_heads, (long long)c.num_key_value_heads, (long long)c.group_size(),
              (long long)c.head_dim, (long long)c.q_dim(), (long long)c.kv_dim());
  std::printf("  rope: theta %g, %s", c.rope_theta, c.rope_scaling.rope_type.c_str());
  if (c.rope_scaling.rope_type == "llama3")
    std::printf(" (factor %g, low %g, high %g, original max %lld)", c.rope_scaling.factor,
                c.rope_scaling.low_freq_factor, c.rope_scaling.high_freq_factor,
                (long long)c.rope_scaling.original_max_position_embeddings);
  std::printf("; max positions %lld; rms_norm_eps %g\n", (long long)c.max_position_embeddings, c.rms_norm_eps);
  std::string eos;
  for (int64_t id : c.eos_token_ids) eos += (eos.empty() ? "" : ",") + std::to_string(id);
  std::printf("  tied embeddings: %s; bos %lld; eos [%s]; dtype %s\n", c.tie_word_embeddings ? "yes" : "no",
              (long long)c.bos_token_id, eos.c_str(), c.torch_dtype.empty() ? "?" : c.torch_dtype.c_str());
  if (c.quantization)  // lesson 16
    std::printf("  quantization: compressed-tensors FP8 (E4M3) weights, %s scales, %s\n",
                c.quantization->weight_strategy == Fp8Quantization::Strategy::Channel ? "per-channel" : "per-tensor",
                c.quantization->dynamic_token_activations ? "dynamic per-token FP8 activations" : "weight-only");
}

void run_inspect(const InspectOptions& opt) {
  const fs::path path = opt.path;
  std::error_code ec;
  if (!fs::exists(path, ec)) throw InputError(path.string() + ": no such file or directory");

  // A directory may carry a config.json: validate it and show its summary.
  std::optional<ModelConfig> config;
  if (fs::is_directory(path, ec) && fs::exists(path / "config.json", ec)) config = load_model_config(path);
  WeightStore w = WeightStore::open(path);

  std::vector<std::string> names = w.names();
  std::sort(names.begin(), names.end(), natural_less);
  const bool sharded = w.files().size() > 1;
  uint64_t params = 0;
  for (const std::string& n : names) params += static_cast<uint64_t>(shape_numel(w.entry(n).shape));

  if (opt.json) {
    nlohmann::json out;
    out["path"] = path.string();
    out["files"] = nlohmann::json::array();
    for (const fs::path& f : w.files()) out["files"].push_back(f.string());
    out["tensors"] = nlohmann::json::array();
    for (const std::string& n : names) {
      const SafetensorsEntry& e = w.entry(n);
      nlohmann::json t = {{"name", n}, {"dtype", std::string(dtype_name(e.dtype))}, {"shape", e.shape},
                          {"bytes", e.end - e.begin}};
      if (sharded) t["file"] = w.file_of(n).path().filename().string();
      out["tensors"].push_back(std::move(t));
    }
    out["total"] = {{"tensors", names.size()}, {"parameters", params}, {"bytes", w.total_tensor_bytes()}};
    if (w.files().size() == 1) out["metadata"] = w.shard(0).header().metadata;
    if (config) out["config"] = config_json(*config);
    // Names come from the file: dump with replacement so odd bytes never break the JSON we print.
    std::cout << out.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    return;
  }

  size_t name_w = 6;
  for (const std::string& n : names) name_w = std::max(name_w, n.size());
  name_w = std::min<size_t>(name_w, 64);
  std::printf("%-*s  %-7s  %-20s  %14s%s\n", (int)name_w, "tensor", "dtype", "shape", "bytes", sharded ? "  file" : "");
  for (const std::string& n : names) {
    const SafetensorsEntry& e = w.entry(n);
    std::printf("%-*s  %-7s  %-20s  %14llu%s%s\n", (int)name_w, n.c_str(), std::string(dtype_name(e.dtype)).c_str(),
                shape_str(e.shape).c_str(), static_cast<unsigned long long>(e.end - e.begin), sharded ? "  " : "",
                sharded ? w.file_of(n).path().filename().string().c_str() : "");
  }
  std::printf("\n%zu tensors, %llu parameters, %llu bytes (%s) in %zu file%s\n", names.size(),
              static_cast<unsigned long long>(params), static_cast<unsigned long long>(w.total_tensor_bytes()),
              human_bytes(w.total_tensor_bytes()).c_str(), w.files().size(), w.files().size() == 1 ? "" : "s");
  if (w.files().size() == 1) {
    for (const auto& [k, v] : w.shard(0).header().metadata) std::printf("metadata: %s = %s\n", k.c_str(), v.c_str());
  }
  if (config) print_config(*config);
}

}  // namespace

void add_inspect_command(CLI::App& app) {
  auto opt = std::make_shared<InspectOptions>();
  CLI::App* cmd = app.add_subcommand(
      "inspect", "Validate a .safetensors file, a model.safetensors.index.json or a model directory, and print its tensor table");
  cmd->add_option("path", opt->path, "FILE_OR_DIR: a .safetensors file, an index .json, or a model directory")
      ->required();
  cmd->add_flag("--json", opt->json, "print one JSON object instead of the table");
  cmd->callback([opt] {
    run_inspect(*opt);
    g_exit_code = 0;
  });
}

}  // namespace tvllm::cli
