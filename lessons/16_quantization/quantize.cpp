// quantize_checkpoint: a bf16 checkpoint in, the compressed-tensors FP8 layout out (see quantize.h).
#include "quantize.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <thread>
#include <cmath>
#include <cstring>
#include <fstream>
#include <set>

#include <nlohmann/json.hpp>

#include "common/errors.h"
#include "fp8.h"
#include "json_strict.h"
#include "model_dir.h"
#include "safetensors_writer.h"

namespace tvllm {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// The value the stored scale will have: rounded to its dtype once, here, so the codes are computed
// with exactly the scale a loader multiplies by.
float round_to_dtype(float x, DType dt) {
  if (dt == DType::BF16) return bf16_to_f32(f32_to_bf16(x));
  if (dt == DType::F16) return f16_to_f32(f32_to_f16(x));
  return x;
}

float scale_for(float absmax, DType scale_dtype) {
  if (!(absmax > 0.0f)) return 1.0f;  // an all-zero row (or tensor)
  TVLLM_REQUIRE(std::isfinite(absmax), "quantize: a weight is inf or NaN");
  const float s = round_to_dtype(absmax / 448.0f, scale_dtype);
  // A scale so small it rounds to 0 in its dtype would turn every code into 0 * ...: keep it positive.
  return s > 0.0f ? s : round_to_dtype(absmax, scale_dtype);
}

std::vector<uint8_t> float_bytes(const std::vector<float>& values, DType dt) {
  std::vector<uint8_t> bytes(values.size() * dtype_size(dt));
  for (size_t i = 0; i < values.size(); ++i) store_from_f32(bytes.data(), dt, i, values[i]);
  return bytes;
}

std::vector<uint8_t> raw_bytes(const TensorView& v) {
  std::vector<uint8_t> bytes(static_cast<size_t>(v.nbytes()));
  if (!bytes.empty()) std::memcpy(bytes.data(), v.data, bytes.size());
  return bytes;
}

bool is_linear_weight(const std::string& name, const ModelConfig& c) {
  static const char* kProjections[] = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                       "mlp.gate_proj",    "mlp.up_proj",      "mlp.down_proj"};
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    for (const char* p : kProjections) {
      if (name == "model.layers." + std::to_string(l) + "." + p + ".weight") return true;
    }
  }
  return false;
}

}  // namespace

Fp8Weight quantize_weight_fp8(const TensorView& w, Fp8Quantization::Strategy strategy, DType scale_dtype) {
  TVLLM_REQUIRE(w.device == Device::CPU && w.is_contiguous() && w.shape.size() == 2 && is_floating(w.dtype),
                "quantize_weight_fp8: expects a contiguous 2-D floating weight on the CPU, got " + w.describe());
  TVLLM_REQUIRE(scale_dtype == DType::F32 || scale_dtype == DType::BF16 || scale_dtype == DType::F16,
                "quantize_weight_fp8: scales are F32, BF16 or F16");
  const int64_t rows = w.shape[0], cols = w.shape[1];
  const bool channel = strategy == Fp8Quantization::Strategy::Channel;
  auto at = [&](int64_t r, int64_t k) { return load_as_f32(w.data, w.dtype, static_cast<size_t>(r * cols + k)); };

  Fp8Weight q;
  q.codes.resize(static_cast<size_t>(rows * cols));
  // 1. absmax per row (or over the tensor) -> the scales, rounded to their stored dtype
  std::vector<float> absmax(static_cast<size_t>(rows), 0.0f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < cols; ++k) absmax[static_cast<size_t>(r)] = std::max(absmax[static_cast<size_t>(r)], std::fabs(at(r, k)));
  if (channel) {
    for (int64_t r = 0; r < rows; ++r) q.scales.push_back(scale_for(absmax[static_cast<size_t>(r)], scale_dtype));
  } else {
    q.scales.push_back(scale_for(*std::max_element(absmax.begin(), absmax.end()), scale_dtype));
  }
  // 2. codes: divide by the stored scale, round to nearest even, saturate
  for (int64_t r = 0; r < rows; ++r) {
    const float s = q.scales[channel ? static_cast<size_t>(r) : 0];
    for (int64_t k = 0; k < cols; ++k) q.codes[static_cast<size_t>(r * cols + k)] = f32_to_fp8_e4m3(at(r, k) / s);
  }
  return q;
}

double fp8_error_bound(float w, float scale) {
  const double x = std::fabs(static_cast<double>(w)) / scale;
  double half_ulp;
  if (x < 0x1p-6) {
    half_ulp = 0x1p-10;  // subnormals: spacing 2^-9
  } else {
    int e = 0;
    std::frexp(std::min(x, 448.0), &e);  // x in [2^(e-1), 2^e): spacing 2^(e-1-3)
    half_ulp = std::ldexp(1.0, e - 5);
  }
  // + a hair for the fp32 division, which may move a value sitting exactly on a tie
  return half_ulp * scale * (1.0 + 0x1p-20);
}

std::string fp8_quantization_config_json(const QuantizeOptions& options) {
  const bool channel = options.strategy == Fp8Quantization::Strategy::Channel;
  json weights = {{"num_bits", 8},          {"type", "float"},   {"symmetric", true},
                  {"group_size", nullptr},  {"strategy", channel ? "channel" : "tensor"},
                  {"block_structure", nullptr}, {"dynamic", false}, {"actorder", nullptr}};
  json activations = {{"num_bits", 8},         {"type", "float"},   {"symmetric", true},
                      {"group_size", nullptr}, {"strategy", "token"}, {"block_structure", nullptr},
                      {"dynamic", true},       {"actorder", nullptr}};
  json qc = {{"quant_method", "compressed-tensors"},
             {"format", "float-quantized"},
             {"quantization_status", "compressed"},
             {"config_groups",
              {{"group_0",
                {{"targets", {"Linear"}},
                 {"weights", weights},
                 {"input_activations", activations},
                 {"output_activations", nullptr}}}}},
             {"ignore", {"lm_head"}},
             {"kv_cache_scheme", nullptr},
             {"global_compression_ratio", nullptr}};
  return qc.dump();
}

QuantizeSummary quantize_checkpoint(const fs::path& model_dir, const fs::path& out_dir, const QuantizeOptions& options) {
  if (options.scheme != "fp8-dynamic")
    throw InputError("quantize: unknown scheme \"" + options.scheme + "\" (supported: fp8-dynamic)");
  std::error_code ec;
  if (fs::exists(out_dir, ec) && fs::equivalent(out_dir, model_dir, ec))
    throw InputError("quantize: --out " + out_dir.string() + " is the model directory itself");
  if (fs::exists(out_dir, ec) && !(fs::is_directory(out_dir, ec) && fs::is_empty(out_dir, ec)))
    throw InputError("quantize: --out " + out_dir.string() + " exists and is not an empty directory");

  const ModelDir model = ModelDir::open(model_dir);  // validated; an FP8 checkpoint comes back dequantized, so:
  if (model.config.quantization)
    throw InputError(model_dir.string() + ": config.json already has a quantization_config: the checkpoint is "
                     "quantized (quantize a bf16, f16 or f32 checkpoint)");

  // The Linear weights are independent: quantize them on every core (a 1B model has ~1e9 weights).
  const std::vector<std::string> names = model.weights.names();
  std::vector<std::string> linear;
  for (const std::string& name : names)
    if (is_linear_weight(name, model.config)) linear.push_back(name);
  std::vector<Fp8Weight> quantized(linear.size());
  std::vector<double> worst(linear.size(), 0.0);
  std::atomic<size_t> next{0};
  auto worker = [&] {
    for (size_t i = next++; i < linear.size(); i = next++) {
      const TensorView v = model.weights.host(linear[i]);
      quantized[i] = quantize_weight_fp8(v, options.strategy, v.dtype);  // the scale in the weight's dtype
      const Fp8Weight& q = quantized[i];
      const size_t cols = static_cast<size_t>(v.shape[1]);
      for (size_t k = 0; k < q.codes.size(); ++k) {
        const float s = q.scales[q.scales.size() == 1 ? 0 : k / cols];
        const float w = load_as_f32(v.data, v.dtype, k);
        const double err = std::fabs(static_cast<double>(fp8_e4m3_to_f32(q.codes[k])) * s - w);
        worst[i] = std::max(worst[i], err / fp8_error_bound(w, s));
      }
    }
  };
  const unsigned workers = std::max(1u, std::min(std::thread::hardware_concurrency(), 16u));
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(workers);
  for (unsigned t = 0; t < workers; ++t)
    threads.emplace_back([&, t] {
      try {
        worker();
      } catch (...) {
        errors[t] = std::current_exception();
        next = linear.size();  // the others stop at their next weight
      }
    });
  for (std::thread& t : threads) t.join();
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);

  QuantizeSummary summary;
  std::vector<TensorToWrite> tensors;
  size_t li = 0;
  for (const std::string& name : names) {
    const SafetensorsEntry& e = model.weights.entry(name);
    summary.bytes_before += e.end - e.begin;
    if (li >= linear.size() || linear[li] != name) {
      tensors.push_back({name, e.dtype, e.shape, raw_bytes(model.weights.host(name))});
      ++summary.kept_tensors;
      continue;
    }
    Fp8Weight& q = quantized[li];
    summary.max_error_over_bound = std::max(summary.max_error_over_bound, worst[li]);
    ++li;
    const std::string module = name.substr(0, name.size() - 7);  // drop ".weight"
    const std::vector<int64_t> scale_shape =
        options.strategy == Fp8Quantization::Strategy::Channel ? std::vector<int64_t>{e.shape[0], 1} : std::vector<int64_t>{1};
    tensors.push_back({name, DType::F8_E4M3, e.shape, std::move(q.codes)});
    tensors.push_back({module + ".weight_scale", e.dtype, scale_shape, float_bytes(q.scales, e.dtype)});
    ++summary.quantized_tensors;
  }
  for (const TensorToWrite& t : tensors) summary.bytes_after += t.bytes.size();

  fs::create_directories(out_dir, ec);
  if (ec) throw InputError(out_dir.string() + ": cannot create the directory: " + ec.message());
  write_safetensors(out_dir / "model.safetensors", tensors);

  // config.json: the source's, plus the quantization_config.
  std::ifstream in(model_dir / "config.json", std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  json config = parse_json_strict(text, (model_dir / "config.json").string());
  config["quantization_config"] = json::parse(fp8_quantization_config_json(options));
  std::ofstream(out_dir / "config.json", std::ios::binary) << config.dump(2) << "\n";

  // Every other top-level file (tokenizer, chat template, generation config) as it is; the weights and
  // their index are replaced by the one file written above; sub-directories (reference/) stay behind.
  for (const fs::directory_entry& f : fs::directory_iterator(model_dir)) {
    const std::string fname = f.path().filename().string();
    if (!f.is_regular_file() || fname == "config.json" || fname == "model.safetensors.index.json" ||
        f.path().extension() == ".safetensors")
      continue;
    fs::copy_file(f.path(), out_dir / fname, fs::copy_options::overwrite_existing, ec);
    if (ec) throw InputError((out_dir / fname).string() + ": cannot copy: " + ec.message());
  }
  return summary;
}

}  // namespace tvllm
