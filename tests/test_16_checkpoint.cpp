// Lesson 16 on the CPU: FP8 checkpoints. quantize_checkpoint on the bundled model, loaded back by
// lesson 01's ModelDir::open (which dequantizes to bf16), weight by weight against the originals; the
// quantization_config parser's refusals, each naming its field; F8 tensors refused outside a quantized
// checkpoint; the safetensors writer read back by lesson 01's parser.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "common/errors.h"
#include "fp8.h"
#include "model_dir.h"
#include "quantize.h"
#include "safetensors_writer.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

const fs::path kModel = TVLLM_TINY_MODEL_DIR;

// What a message must contain, or the test prints the message it got.
template <class Fn>
void expect_input_error(const Fn& fn, const std::string& fragment) {
  try {
    fn();
    ADD_FAILURE() << "no InputError; expected one containing: " << fragment;
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

json read_json(const fs::path& p) {
  std::ifstream in(p);
  return json::parse(in);
}
void write_json(const fs::path& p, const json& j) { std::ofstream(p) << j.dump(2); }

// ---- quantize -> load ------------------------------------------------------------------------------------

// Every quantized weight, loaded back: (1) exactly round_bf16(fp8 * scale) from the file's own bytes,
// the one rounding the loader promises; (2) within the FP8 bound of the original plus that bf16 rounding:
//   |W'' - W| <= half an E4M3 ulp of |W| / scale, times the scale  +  2^-8 |W'|   (W'' = bf16(W'))
// (half a bf16 ulp is 2^-8 of the value at the bottom of a binade, 8 significant bits).
// Everything not quantized loads bit for bit as it was.
void expect_round_trip(Fp8Quantization::Strategy strategy) {
  testing::TempDir tmp;
  QuantizeOptions o;
  o.strategy = strategy;
  const QuantizeSummary s = quantize_checkpoint(kModel, tmp / "fp8", o);
  EXPECT_EQ(s.quantized_tensors, 14);  // 2 layers x 7 projections
  EXPECT_GT(s.kept_tensors, 0);
  EXPECT_LE(s.max_error_over_bound, 1.0);
  EXPECT_LT(s.bytes_after, s.bytes_before);

  const ModelDir original = ModelDir::open(kModel);
  const ModelDir fp8 = ModelDir::open(tmp / "fp8");
  ASSERT_TRUE(fp8.config.quantization.has_value());
  EXPECT_EQ(fp8.config.quantization->weight_strategy, strategy);
  EXPECT_TRUE(fp8.config.quantization->dynamic_token_activations);
  const WeightStore raw = WeightStore::open(tmp / "fp8");  // the file as written: codes and scales
  int checked = 0;
  for (const std::string& name : original.weights.names()) {
    ASSERT_TRUE(fp8.weights.contains(name)) << name;
    const TensorView a = original.weights.host(name), b = fp8.weights.host(name);
    ASSERT_EQ(a.shape, b.shape) << name;
    const std::string module = name.substr(0, name.size() - 7);
    if (!raw.contains(module + ".weight_scale")) {
      ASSERT_EQ(a.dtype, b.dtype) << name;
      EXPECT_EQ(std::memcmp(a.data, b.data, static_cast<size_t>(a.nbytes())), 0) << name << " changed";
      continue;
    }
    ++checked;
    EXPECT_FALSE(fp8.weights.contains(module + ".weight_scale")) << "the loader consumes the scales";
    ASSERT_EQ(b.dtype, DType::BF16);
    const TensorView codes = raw.host(name), scales = raw.host(module + ".weight_scale");
    ASSERT_EQ(codes.dtype, DType::F8_E4M3);
    ASSERT_EQ(scales.dtype, DType::BF16);  // the weight's dtype, as llm-compressor stores it
    const int64_t cols = a.shape[1];
    for (int64_t i = 0; i < a.numel(); ++i) {
      const size_t k = static_cast<size_t>(i);
      const float scale = load_as_f32(scales.data, scales.dtype, scales.numel() == 1 ? 0 : static_cast<size_t>(i / cols));
      const float exact = fp8_e4m3_to_f32(codes.ptr<uint8_t>()[k]) * scale;
      const float loaded = load_as_f32(b.data, b.dtype, k), w = load_as_f32(a.data, a.dtype, k);
      ASSERT_EQ(f32_bits(loaded), f32_bits(bf16_to_f32(f32_to_bf16(exact)))) << name << "[" << i << "]";
      const double bound = fp8_error_bound(w, scale) + std::ldexp(std::fabs(static_cast<double>(exact)), -8);
      ASSERT_LE(std::fabs(static_cast<double>(loaded) - w), bound) << name << "[" << i << "] w " << w << " scale " << scale;
    }
  }
  EXPECT_EQ(checked, 14);
  // The copied files.
  for (const char* f : {"tokenizer.json", "tokenizer_config.json"}) EXPECT_TRUE(fs::exists(tmp / "fp8" / f)) << f;
  EXPECT_FALSE(fs::exists(tmp / "fp8" / "reference"));
}

TEST(Quantize16, PerChannelRoundTripWithinTheFp8Bound) { expect_round_trip(Fp8Quantization::Strategy::Channel); }
TEST(Quantize16, PerTensorRoundTripWithinTheFp8Bound) { expect_round_trip(Fp8Quantization::Strategy::Tensor); }

TEST(Quantize16, ScalesAreAbsmaxOver448AndSaturationHolds) {
  // Row 0's absmax is 3.0: scale bf16(3/448). Row 1 is all zeros: scale 1, codes 0. The -3.0 lands on
  // -448 (0xfe) or saturates onto it: the bf16 scale may round below 3/448.
  std::vector<uint16_t> w = {f32_to_bf16(3.0f), f32_to_bf16(-3.0f), f32_to_bf16(0.01f), 0, 0, 0};
  const TensorView v = TensorView::contiguous(w.data(), DType::BF16, Device::CPU, {2, 3});
  const Fp8Weight q = quantize_weight_fp8(v, Fp8Quantization::Strategy::Channel, DType::BF16);
  ASSERT_EQ(q.scales.size(), 2u);
  EXPECT_EQ(q.scales[0], bf16_to_f32(f32_to_bf16(3.0f / 448.0f)));
  EXPECT_EQ(q.scales[1], 1.0f);
  EXPECT_EQ(q.codes[0], 0x7e);
  EXPECT_EQ(q.codes[1], 0xfe);
  EXPECT_EQ(q.codes[3], 0x00);
  const Fp8Weight t = quantize_weight_fp8(v, Fp8Quantization::Strategy::Tensor, DType::F32);
  ASSERT_EQ(t.scales.size(), 1u);
  EXPECT_EQ(t.scales[0], 3.0f / 448.0f);
}

TEST(Quantize16, RefusesAQuantizedModelAndAnOccupiedOutput) {
  testing::TempDir tmp;
  quantize_checkpoint(kModel, tmp / "fp8", QuantizeOptions{});
  expect_input_error([&] { quantize_checkpoint(tmp / "fp8", tmp / "again", QuantizeOptions{}); },
                     "already has a quantization_config");
  expect_input_error([&] { quantize_checkpoint(kModel, tmp / "fp8", QuantizeOptions{}); },
                     "exists and is not an empty directory");
  QuantizeOptions bad;
  bad.scheme = "int4";
  expect_input_error([&] { quantize_checkpoint(kModel, tmp / "x", bad); }, "unknown scheme \"int4\"");
}

// ---- what the loader refuses -----------------------------------------------------------------------------

TEST(Fp8Checkpoint16, RefusesF8TensorsOutsideAQuantizedCheckpoint) {
  testing::TempDir tmp;
  quantize_checkpoint(kModel, tmp / "fp8", QuantizeOptions{});
  json config = read_json(tmp / "fp8" / "config.json");
  config.erase("quantization_config");
  write_json(tmp / "fp8" / "config.json", config);
  expect_input_error([&] { ModelDir::open(tmp / "fp8"); }, "is F8_E4M3, an 8-bit float: FP8 weights load only");
}

TEST(Fp8Checkpoint16, RefusesAMissingOrMisshapenScale) {
  testing::TempDir tmp;
  quantize_checkpoint(kModel, tmp / "fp8", QuantizeOptions{});
  // per-channel scales read as per-tensor: the shape no longer fits
  json config = read_json(tmp / "fp8" / "config.json");
  config["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = "tensor";
  write_json(tmp / "fp8" / "config.json", config);
  expect_input_error([&] { ModelDir::open(tmp / "fp8"); }, "strategy \"tensor\" needs one scale");
  // a checkpoint whose scale tensor is gone
  const WeightStore w = WeightStore::open(tmp / "fp8" / "model.safetensors");
  std::vector<TensorToWrite> tensors;
  for (const std::string& n : w.names()) {
    if (n == "model.layers.1.mlp.up_proj.weight_scale") continue;
    const TensorView v = w.host(n);
    const uint8_t* p = static_cast<const uint8_t*>(v.data);
    tensors.push_back({n, v.dtype, v.shape, std::vector<uint8_t>(p, p + v.nbytes())});
  }
  write_safetensors(tmp / "fp8" / "model.safetensors", tensors);
  config["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = "channel";
  write_json(tmp / "fp8" / "config.json", config);
  expect_input_error([&] { ModelDir::open(tmp / "fp8"); },
                     "\"model.layers.1.mlp.up_proj.weight_scale\" is missing");
}

// Each unsupported field of a published-shaped config is refused with its path in the message.
TEST(Fp8Checkpoint16, QuantizationConfigRefusalsNameTheField) {
  const json good = json::parse(fp8_quantization_config_json(QuantizeOptions{}));
  EXPECT_NO_THROW(parse_quantization_config(good));
  auto refused = [&](const std::function<void(json&)>& change, const std::string& fragment) {
    json j = good;
    change(j);
    SCOPED_TRACE(fragment);
    expect_input_error([&] { parse_quantization_config(j); }, fragment);
  };
  auto w = [](json& j) -> json& { return j["config_groups"]["group_0"]["weights"]; };
  auto a = [](json& j) -> json& { return j["config_groups"]["group_0"]["input_activations"]; };
  refused([](json& j) { j["quant_method"] = "gptq"; }, "quantization_config.quant_method is \"gptq\"");
  refused([](json& j) { j["quant_method"] = "fp8"; }, "quantization_config.quant_method is \"fp8\"");
  refused([](json& j) { j["format"] = "pack-quantized"; }, "quantization_config.format is \"pack-quantized\"");
  refused([](json& j) { j["format"] = "naive-quantized"; }, "quantization_config.format is");
  refused([&](json& j) { w(j)["num_bits"] = 4; }, "config_groups.group_0.weights.num_bits is 4");
  refused([&](json& j) { w(j)["type"] = "int"; }, "config_groups.group_0.weights.type is \"int\"");
  refused([&](json& j) { w(j)["strategy"] = "group"; }, "config_groups.group_0.weights.strategy is \"group\"");
  refused([&](json& j) { w(j)["strategy"] = "block"; }, "config_groups.group_0.weights.strategy is \"block\"");
  refused([&](json& j) { w(j)["group_size"] = 128; }, "config_groups.group_0.weights.group_size is 128");
  refused([&](json& j) { w(j)["block_structure"] = {128, 128}; }, "config_groups.group_0.weights.block_structure");
  refused([&](json& j) { w(j)["symmetric"] = false; }, "config_groups.group_0.weights.symmetric is false");
  refused([&](json& j) { w(j)["dynamic"] = true; }, "config_groups.group_0.weights.dynamic is true");
  refused([&](json& j) { a(j)["dynamic"] = false; }, "input_activations.dynamic is false: static activation scales");
  refused([&](json& j) { a(j)["strategy"] = "tensor"; }, "input_activations.strategy is \"tensor\"");
  refused([](json& j) { j["config_groups"]["group_0"]["targets"] = {"re:.*q_proj"}; }, "group_0.targets is");
  refused([](json& j) { j["config_groups"]["group_1"] = j["config_groups"]["group_0"]; }, "exactly one group");
  refused([](json& j) { j["ignore"] = json::array(); }, "ignore does not list \"lm_head\"");
  refused([](json& j) { j["ignore"] = {"lm_head", "re:.*gate"}; }, "regular-expression module names");
  refused([](json& j) { j["kv_cache_scheme"] = {{"num_bits", 8}}; }, "quantization_config.kv_cache_scheme.type is");
  refused([](json& j) { j["kv_cache_scheme"] = {{"num_bits", 8}, {"type", "float"}, {"symmetric", true},
                                                {"dynamic", true}, {"strategy", "tensor"}}; },
          "kv_cache_scheme.dynamic is true");
  refused([](json& j) { j["kv_cache_scheme"] = {{"num_bits", 8}, {"type", "float"}, {"symmetric", true},
                                                {"dynamic", false}, {"strategy", "channel"}}; },
          "kv_cache_scheme.strategy is \"channel\"");
  {  // llm-compressor's static per-tensor FP8 KV scheme is accepted (lesson 16 section 8 uses its k_scale / v_scale)
    json kv = good;
    kv["kv_cache_scheme"] = {{"num_bits", 8}, {"type", "float"}, {"symmetric", true}, {"dynamic", false},
                             {"strategy", "tensor"}, {"group_size", nullptr}, {"observer", "minmax"}};
    EXPECT_NO_THROW(parse_quantization_config(kv));
  }
  refused([](json& j) { j["quantization_status"] = "frozen"; }, "quantization_status is \"frozen\"");
  refused([](json& j) { j["config_groups"]["group_0"]["output_activations"] = {{"num_bits", 8}}; }, "output_activations");
  // Weight-only FP8 (no input_activations) is accepted: the weights mean the same.
  json weight_only = good;
  weight_only["config_groups"]["group_0"].erase("input_activations");
  EXPECT_FALSE(parse_quantization_config(weight_only).dynamic_token_activations);
}

// ---- the writer ------------------------------------------------------------------------------------------

TEST(SafetensorsWriter16, ReadsBackThroughLesson01) {
  testing::TempDir tmp;
  std::vector<TensorToWrite> t = {{"b", DType::F8_E4M3, {3}, {0x38, 0xc0, 0x7e}},
                                  {"a", DType::F32, {2}, std::vector<uint8_t>(8, 0)}};
  float two[2] = {1.5f, -2.0f};
  std::memcpy(t[1].bytes.data(), two, 8);
  write_safetensors(tmp / "x.safetensors", t);
  const auto f = SafetensorsFile::open(tmp / "x.safetensors");
  ASSERT_EQ(f->entries().size(), 2u);
  EXPECT_EQ(f->header().metadata.at("format"), "pt");
  EXPECT_EQ(f->header().data_offset % 8, 0u);
  const TensorView b = f->host_view("b"), a = f->host_view("a");
  EXPECT_EQ(load_as_f32(b.data, b.dtype, 1), -2.0f);
  EXPECT_EQ(load_as_f32(b.data, b.dtype, 2), 448.0f);
  EXPECT_EQ(load_as_f32(a.data, a.dtype, 0), 1.5f);
  expect_input_error([&] { write_safetensors(tmp / "y.safetensors", {{"a", DType::F32, {3}, {1, 2}}}); },
                     "needs 12 bytes, got 2");
  expect_input_error([&] { write_safetensors(tmp / "y.safetensors", {t[0], t[0]}); }, "duplicate");
}

}  // namespace
}  // namespace tvllm
