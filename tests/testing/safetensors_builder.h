// Writing safetensors files byte by byte in tests, valid or deliberately broken.
//
//   auto bytes = SafetensorsBuilder().add("w", "F32", {2}, f32_bytes({1.f, 2.f})).build();
//   auto bad   = raw_safetensors(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", zeros(4));
//
// Header-only, no dependency on the loader under test: a bug in the loader cannot hide in the writer.
#pragma once

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "common/dtype.h"
#include "common/random.h"

namespace tvllm::testing {

using Bytes = std::vector<uint8_t>;

// The 8-byte little-endian length, the header text as given, then the data: N = header.size() unless
// `length` overrides it (to write a lying header length).
inline Bytes raw_safetensors(const std::string& header, const Bytes& data = {}, int64_t length = -1) {
  uint64_t n = length < 0 ? header.size() : static_cast<uint64_t>(length);
  Bytes out;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(n >> (8 * i)));
  out.insert(out.end(), header.begin(), header.end());
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

inline Bytes zeros(size_t n) { return Bytes(n, 0); }

template <class T>
Bytes as_bytes(const std::vector<T>& values) {
  Bytes b(values.size() * sizeof(T));
  if (!b.empty()) std::memcpy(b.data(), values.data(), b.size());
  return b;
}
inline Bytes f32_bytes(const std::vector<float>& v) { return as_bytes(v); }
inline Bytes u16_bytes(const std::vector<uint16_t>& v) { return as_bytes(v); }  // BF16 / F16 bit patterns
inline Bytes i32_bytes(const std::vector<int32_t>& v) { return as_bytes(v); }

inline std::string json_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}

// A valid file: tensors laid out back to back in the order added, header padded with spaces to a
// multiple of 8 bytes (as the Hugging Face writer does).
class SafetensorsBuilder {
 public:
  SafetensorsBuilder& add(const std::string& name, const std::string& dtype, const std::vector<int64_t>& shape,
                          const Bytes& data) {
    tensors_.push_back({name, dtype, shape, data});
    return *this;
  }
  SafetensorsBuilder& metadata(const std::string& key, const std::string& value) {
    metadata_[key] = value;
    return *this;
  }
  std::string header() const {
    std::string h = "{";
    bool first = true;
    if (!metadata_.empty()) {
      h += "\"__metadata__\":{";
      bool mfirst = true;
      for (const auto& [k, v] : metadata_) {
        h += (mfirst ? "" : ",") + std::string("\"") + json_escape(k) + "\":\"" + json_escape(v) + "\"";
        mfirst = false;
      }
      h += "}";
      first = false;
    }
    uint64_t offset = 0;
    for (const Tensor& t : tensors_) {
      std::string shape;
      for (size_t i = 0; i < t.shape.size(); ++i) shape += (i ? "," : "") + std::to_string(t.shape[i]);
      h += (first ? "" : ",") + std::string("\"") + json_escape(t.name) + "\":{\"dtype\":\"" + t.dtype +
           "\",\"shape\":[" + shape + "],\"data_offsets\":[" + std::to_string(offset) + "," +
           std::to_string(offset + t.data.size()) + "]}";
      offset += t.data.size();
      first = false;
    }
    h += "}";
    while (h.size() % 8) h += ' ';
    return h;
  }
  Bytes data() const {
    Bytes d;
    for (const Tensor& t : tensors_) d.insert(d.end(), t.data.begin(), t.data.end());
    return d;
  }
  Bytes build() const { return raw_safetensors(header(), data()); }

 private:
  struct Tensor {
    std::string name, dtype;
    std::vector<int64_t> shape;
    Bytes data;
  };
  std::vector<Tensor> tensors_;
  std::map<std::string, std::string> metadata_;
};

inline void write_file(const std::filesystem::path& path, const Bytes& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) throw std::runtime_error("cannot write " + path.string());
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}
inline void write_file(const std::filesystem::path& path, const std::string& text) {
  write_file(path, Bytes(text.begin(), text.end()));
}

// A complete, tiny, valid Llama model directory: config.json + model.safetensors with the tensor names and
// shapes a Llama checkpoint has, filled with deterministic bytes. For loader tests that need a model.
struct SyntheticLlama {
  int64_t vocab = 16, hidden = 8, intermediate = 12, layers = 2, heads = 2, kv_heads = 1, head_dim = 6;
  bool tied = true;
  std::string dtype = "BF16";  // BF16, F16 or F32
  size_t dtype_bytes() const { return dtype == "F32" ? 4 : 2; }
  std::string config_json() const {
    return "{\"architectures\": [\"LlamaForCausalLM\"], \"model_type\": \"llama\", \"vocab_size\": " +
           std::to_string(vocab) + ", \"hidden_size\": " + std::to_string(hidden) +
           ", \"intermediate_size\": " + std::to_string(intermediate) + ", \"num_hidden_layers\": " +
           std::to_string(layers) + ", \"num_attention_heads\": " + std::to_string(heads) +
           ", \"num_key_value_heads\": " + std::to_string(kv_heads) + ", \"head_dim\": " + std::to_string(head_dim) +
           ", \"max_position_embeddings\": 64, \"rms_norm_eps\": 1e-05, \"rope_theta\": 10000.0" +
           ", \"tie_word_embeddings\": " + (tied ? "true" : "false") + ", \"torch_dtype\": \"bfloat16\"}";
  }
  // (name, shape) of every weight, in Hugging Face's names.
  std::vector<std::pair<std::string, std::vector<int64_t>>> weights() const {
    std::vector<std::pair<std::string, std::vector<int64_t>>> w;
    w.push_back({"model.embed_tokens.weight", {vocab, hidden}});
    for (int64_t l = 0; l < layers; ++l) {
      std::string p = "model.layers." + std::to_string(l) + ".";
      w.push_back({p + "input_layernorm.weight", {hidden}});
      w.push_back({p + "self_attn.q_proj.weight", {heads * head_dim, hidden}});
      w.push_back({p + "self_attn.k_proj.weight", {kv_heads * head_dim, hidden}});
      w.push_back({p + "self_attn.v_proj.weight", {kv_heads * head_dim, hidden}});
      w.push_back({p + "self_attn.o_proj.weight", {hidden, heads * head_dim}});
      w.push_back({p + "post_attention_layernorm.weight", {hidden}});
      w.push_back({p + "mlp.gate_proj.weight", {intermediate, hidden}});
      w.push_back({p + "mlp.up_proj.weight", {intermediate, hidden}});
      w.push_back({p + "mlp.down_proj.weight", {hidden, intermediate}});
    }
    w.push_back({"model.norm.weight", {hidden}});
    if (!tied) w.push_back({"lm_head.weight", {vocab, hidden}});
    return w;
  }
  // Deterministic bytes for tensor number i (never all zero, different per tensor).
  Bytes tensor_bytes(size_t i, const std::vector<int64_t>& shape) const {
    size_t n = dtype_bytes();
    for (int64_t d : shape) n *= static_cast<size_t>(d);
    Bytes b(n);
    uint32_t x = 2166136261u ^ static_cast<uint32_t>(i * 7919);
    for (size_t k = 0; k < n; ++k) {
      x = x * 1664525u + 1013904223u;
      b[k] = static_cast<uint8_t>(x >> 24) & 0x3F;  // & 0x3F keeps values finite in every float format
    }
    return b;
  }
  SafetensorsBuilder builder() const {
    SafetensorsBuilder sb;
    auto w = weights();
    for (size_t i = 0; i < w.size(); ++i) sb.add(w[i].first, dtype, w[i].second, tensor_bytes(i, w[i].second));
    return sb;
  }
  void write(const std::filesystem::path& dir) const {
    std::filesystem::create_directories(dir);
    write_file(dir / "config.json", config_json());
    write_file(dir / "model.safetensors", builder().build());
  }
};

// A model with the synthetic model's names and shapes but weights like a freshly initialised Hugging Face Llama
// (normal, std 0.05 of both signs; norm weights near 1), stored as F32. write_random_llama_as: another std, or
// stored as BF16 (half the bytes, for the big shapes; each value rounded to bf16 once, here). (SyntheticLlama's
// own bytes are all positive: fine for loaders, but attention over such weights has scores in the thousands and
// degenerates into an argmax that bf16 flips.)
inline void write_random_llama_as(const SyntheticLlama& s, const std::filesystem::path& dir, uint64_t seed,
                                  const std::string& dtype, float stddev) {
  if (dtype != "F32" && dtype != "BF16") throw std::invalid_argument("write_random_llama: F32 or BF16, not " + dtype);
  std::filesystem::create_directories(dir);
  write_file(dir / "config.json", s.config_json());
  SafetensorsBuilder b;
  for (const auto& [name, shape] : s.weights()) {
    size_t numel = 1;
    for (int64_t d : shape) numel *= static_cast<size_t>(d);
    std::vector<float> v = random_normal(numel, seed++, stddev);
    if (name.find("norm.weight") != std::string::npos)
      for (float& x : v) x = 1.0f + x;
    if (dtype == "F32") {
      b.add(name, "F32", shape, f32_bytes(v));
    } else {
      std::vector<uint16_t> bits(v.size());
      for (size_t i = 0; i < v.size(); ++i) bits[i] = f32_to_bf16(v[i]);
      b.add(name, "BF16", shape, u16_bytes(bits));
    }
  }
  write_file(dir / "model.safetensors", b.build());
}
inline void write_random_llama(const SyntheticLlama& s, const std::filesystem::path& dir, uint64_t seed) {
  write_random_llama_as(s, dir, seed, "F32", 0.05f);
}

}  // namespace tvllm::testing
