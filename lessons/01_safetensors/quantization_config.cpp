// config.json's quantization_config: the one quantized layout tiny-vllm reads, the compressed-tensors
// "float-quantized" FP8 checkpoint (lesson 16), and a clear refusal, naming the field, for everything else.
//
// The layout, as llm-compressor writes its FP8 / FP8_DYNAMIC schemes (field names checked against
// published llm-compressor recipes and configs, e.g. neuralmagic/*-FP8-dynamic recipe.yaml: weights
// {num_bits: 8, type: float, strategy: channel, symmetric: true, dynamic: false}, input_activations
// {num_bits: 8, type: float, strategy: token, dynamic: true, symmetric: true}, targets [Linear],
// ignore [lm_head]; and compressed-tensors configs with "quant_method": "compressed-tensors",
// "format": "float-quantized", "quantization_status": "compressed", "config_groups": {"group_0": ...}):
//
//   "quantization_config": {
//     "quant_method": "compressed-tensors",
//     "format": "float-quantized",
//     "quantization_status": "compressed",
//     "config_groups": { "group_0": {
//        "targets": ["Linear"],
//        "weights": {"num_bits": 8, "type": "float", "strategy": "channel" | "tensor",
//                    "symmetric": true, "dynamic": false, "group_size": null, "block_structure": null, ...},
//        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
//                              "symmetric": true, "dynamic": true, ...} | null,
//        "output_activations": null } },
//     "ignore": ["lm_head"],
//     "kv_cache_scheme": null
//   }
//
// Informative fields (observer, observer_kwargs, global_compression_ratio, version, provider, ...) are
// not read. Everything that changes what the stored numbers mean is checked.
#include <nlohmann/json.hpp>

#include "common/input_error.h"
#include "json_strict.h"
#include "model_config.h"

namespace tvllm {

using nlohmann::json;

namespace {

const std::string kWhere = "config.json: quantization_config";

const json* field(const json& j, const char* name) {
  auto it = j.find(name);
  if (it == j.end() || it->is_null()) return nullptr;
  return &*it;
}

[[noreturn]] void refuse(const std::string& path, const json& got, const std::string& why) {
  throw InputError(kWhere + path + " is " + json_snippet(got) + ": " + why);
}

void expect_string(const json& j, const std::string& path, const char* name, const std::string& want,
                   const std::string& why) {
  const json* v = field(j, name);
  if (!v) throw InputError(kWhere + path + "." + name + " is missing (expected \"" + want + "\")");
  if (!v->is_string() || v->get_ref<const std::string&>() != want) refuse(path + "." + name, *v, why);
}

void expect_bool(const json& j, const std::string& path, const char* name, bool want, const std::string& why) {
  const json* v = field(j, name);
  if (!v) throw InputError(kWhere + path + "." + name + " is missing (expected " + (want ? "true" : "false") + ")");
  if (!v->is_boolean() || v->get<bool>() != want) refuse(path + "." + name, *v, why);
}

void expect_null(const json& j, const std::string& path, const char* name, const std::string& why) {
  if (const json* v = field(j, name)) refuse(path + "." + name, *v, why);
}

// The common part of "weights" and "input_activations": 8-bit floats, symmetric (no zero point).
void expect_fp8_args(const json& a, const std::string& path) {
  if (!a.is_object()) refuse(path, a, "expected an object");
  const json* bits = field(a, "num_bits");
  if (!bits || !bits->is_number_integer() || bits->get<int64_t>() != 8)
    refuse(path + ".num_bits", bits ? *bits : json(), "tiny-vllm reads 8-bit quantization only");
  expect_string(a, path, "type", "float", "tiny-vllm reads float (FP8 E4M3) quantization only, not int");
  expect_bool(a, path, "symmetric", true, "asymmetric quantization (a zero point) is not supported");
  expect_null(a, path, "group_size", "group-wise scales are not supported (channel or tensor only)");
  expect_null(a, path, "block_structure", "block-wise scales are not supported (channel or tensor only)");
  expect_null(a, path, "actorder", "activation reordering (actorder) is not supported");
  // Newer compressed-tensors may name the scales' dtype; the loader reads F32, BF16 and F16 scales.
  if (const json* sd = field(a, "scale_dtype")) {
    if (!sd->is_string() || (*sd != "torch.float32" && *sd != "torch.bfloat16" && *sd != "torch.float16"))
      refuse(path + ".scale_dtype", *sd, "scales must be float32, bfloat16 or float16");
  }
}

}  // namespace

bool Fp8Quantization::ignores(const std::string& module) const {
  for (const std::string& m : ignore) {
    if (m == module) return true;
  }
  return false;
}

Fp8Quantization parse_quantization_config(const json& qc) {
  if (!qc.is_object()) refuse("", qc, "expected an object");
  Fp8Quantization q;

  const json* method = field(qc, "quant_method");
  if (!method) throw InputError(kWhere + ".quant_method is missing (tiny-vllm reads \"compressed-tensors\" FP8)");
  if (!method->is_string() || *method != "compressed-tensors")
    refuse(".quant_method", *method,
           "quantized checkpoints are supported only as compressed-tensors FP8 (format \"float-quantized\", "
           "as llm-compressor's FP8 schemes write them; make one with `tiny-vllm quantize`)");
  expect_string(qc, "", "format", "float-quantized",
                "tiny-vllm reads the compressed-tensors \"float-quantized\" (FP8) format only");
  if (const json* status = field(qc, "quantization_status")) {
    if (!status->is_string() || *status != "compressed")
      refuse(".quantization_status", *status, "expected \"compressed\" (FP8 bytes stored with their scales)");
  }
  // kv_cache_scheme (lesson 16 section 8): static per-tensor FP8 scales of k and v, stored as
  // model.layers.N.self_attn.k_scale / v_scale. `--kv-cache-dtype fp8` uses them; a bf16 cache ignores them (as
  // vLLM's does). Anything else (dynamic, per channel, int) is refused.
  if (const json* kv = field(qc, "kv_cache_scheme")) {
    expect_fp8_args(*kv, ".kv_cache_scheme");
    expect_bool(*kv, ".kv_cache_scheme", "dynamic", false,
                "dynamic KV scales are not supported: static per-tensor k_scale / v_scale only");
    expect_string(*kv, ".kv_cache_scheme", "strategy", "tensor",
                  "KV scales must be per tensor (one k_scale and one v_scale per layer)");
  }
  if (const json* sparsity = field(qc, "sparsity_config")) {
    if (!(sparsity->is_object() && sparsity->empty())) refuse(".sparsity_config", *sparsity, "sparse weights are not supported");
  }
  expect_null(qc, "", "transform_config", "transformed (rotated) weights are not supported");

  // ignore: exact module names stay in their original dtype. Regular expressions ("re:...") are not read.
  if (const json* ignore = field(qc, "ignore")) {
    if (!ignore->is_array()) refuse(".ignore", *ignore, "expected an array of module names");
    for (const json& m : *ignore) {
      if (!m.is_string()) refuse(".ignore", *ignore, "expected an array of module names");
      const std::string& name = m.get_ref<const std::string&>();
      if (name.rfind("re:", 0) == 0)
        refuse(".ignore", m, "regular-expression module names are not supported (list the modules by name)");
      q.ignore.push_back(name);
    }
  }
  // A quantized lm_head changes the tied embedding too: tiny-vllm keeps lm_head in its own dtype.
  if (!q.ignores("lm_head"))
    throw InputError(kWhere + ".ignore does not list \"lm_head\": a quantized lm_head is not supported "
                     "(llm-compressor's FP8 schemes leave it unquantized)");

  const json* groups = field(qc, "config_groups");
  if (!groups || !groups->is_object() || groups->size() != 1)
    refuse(".config_groups", groups ? *groups : json(), "expected an object with exactly one group");
  const std::string g = ".config_groups." + groups->begin().key();
  const json& group = groups->begin().value();
  if (!group.is_object()) refuse(g, group, "expected an object");
  const json* targets = field(group, "targets");
  if (!targets || *targets != json::array({"Linear"}))
    refuse(g + ".targets", targets ? *targets : json(), "expected [\"Linear\"] (every Linear layer)");
  if (const json* fmt = field(group, "format")) {
    if (!fmt->is_string() || *fmt != "float-quantized")
      refuse(g + ".format", *fmt, "tiny-vllm reads the \"float-quantized\" (FP8) format only");
  }

  const json* weights = field(group, "weights");
  if (!weights) throw InputError(kWhere + g + ".weights is missing");
  expect_fp8_args(*weights, g + ".weights");
  expect_bool(*weights, g + ".weights", "dynamic", false, "weights must have stored scales (dynamic false)");
  const json* strategy = field(*weights, "strategy");
  if (strategy && *strategy == "channel") q.weight_strategy = Fp8Quantization::Strategy::Channel;
  else if (strategy && *strategy == "tensor") q.weight_strategy = Fp8Quantization::Strategy::Tensor;
  else refuse(g + ".weights.strategy", strategy ? *strategy : json(), "expected \"channel\" or \"tensor\"");

  if (const json* act = field(group, "input_activations")) {
    expect_fp8_args(*act, g + ".input_activations");
    expect_bool(*act, g + ".input_activations", "dynamic", true,
                "static activation scales (input_scale tensors) are not supported: use a dynamic (per-token) scheme");
    expect_string(*act, g + ".input_activations", "strategy", "token",
                  "dynamic activation scales must be per token");
    q.dynamic_token_activations = true;
  }
  expect_null(group, g, "output_activations", "output activation quantization is not supported");
  return q;
}

}  // namespace tvllm
