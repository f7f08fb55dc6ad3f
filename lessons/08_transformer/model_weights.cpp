// Lesson 08: checking a checkpoint against its config, and binding it into LayerWeights / ModelWeights.
#include "model_weights.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <set>

#include "common/errors.h"
#include "common/exercise.h"

namespace tvllm {

namespace {

const std::string kWhere = "weights: ";

bool is_compute_dtype(DType d) { return d == DType::BF16 || d == DType::F16 || d == DType::F32; }

std::string layer_prefix(int64_t layer) { return "model.layers." + std::to_string(layer) + "."; }

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// A Linear weight left as F8_E4M3 codes by ModelDir::open(Fp8Load::Resident): a quantized config, one of the
// seven projections, its weight_scale beside it (lesson 01 checked the scale's shape and dtype).
bool resident_fp8_linear(const ModelConfig& c, const WeightStore& weights, const std::string& name) {
  const std::string suffix = "_proj.weight";
  return c.quantization && ends_with(name, suffix) && weights.contains(name) &&
         weights.entry(name).dtype == DType::F8_E4M3 && weights.contains(name + "_scale");
}

}  // namespace

std::string family_extras(const ModelConfig& c) {
  std::string s;
  auto add = [&](bool on, const char* what) {
    if (on) s += (s.empty() ? "" : ", ") + std::string(what);
  };
  add(c.qkv_bias, "q/k/v biases");
  add(c.o_bias, "o_proj bias");
  add(c.mlp_bias, "MLP biases");
  add(c.qk_norm, "q/k norm");
  return s;
}

std::vector<ExpectedTensor> expected_llama_tensors(const ModelConfig& c) {
  const int64_t H = c.hidden_size, I = c.intermediate_size;
  std::vector<ExpectedTensor> t;
  // A projection's weight [out, in], then its bias [out] when the config promises one.
  auto proj = [&](const std::string& name, int64_t out, int64_t in, bool bias) {
    t.push_back({name + ".weight", {out, in}});
    if (bias) t.push_back({name + ".bias", {out}});
  };
  t.push_back({"model.embed_tokens.weight", {c.vocab_size, H}});
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = layer_prefix(l);
    t.push_back({p + "input_layernorm.weight", {H}});
    proj(p + "self_attn.q_proj", c.q_dim(), H, c.qkv_bias);
    proj(p + "self_attn.k_proj", c.kv_dim(), H, c.qkv_bias);
    proj(p + "self_attn.v_proj", c.kv_dim(), H, c.qkv_bias);
    proj(p + "self_attn.o_proj", H, c.q_dim(), c.o_bias);
    if (c.qk_norm) {  // Qwen3: one RMSNorm weight over head_dim, shared by every q head (k heads)
      t.push_back({p + "self_attn.q_norm.weight", {c.head_dim}});
      t.push_back({p + "self_attn.k_norm.weight", {c.head_dim}});
    }
    t.push_back({p + "post_attention_layernorm.weight", {H}});
    proj(p + "mlp.gate_proj", I, H, c.mlp_bias);
    proj(p + "mlp.up_proj", I, H, c.mlp_bias);
    proj(p + "mlp.down_proj", H, I, c.mlp_bias);
  }
  t.push_back({"model.norm.weight", {H}});
  if (!c.tie_word_embeddings) t.push_back({"lm_head.weight", {c.vocab_size, H}});
  return t;
}

void check_llama_weights(const ModelConfig& c, const WeightStore& weights) {
  // Lesson 01 reads what a Qwen2/Qwen3/Mistral/biased-Llama config asks for (issue 18), and the forward computes
  // all of it: the biases and the q/k norm are tensors (expected below), the sliding window is a property of the
  // attention shape that every attention path applies. Anything else ModelConfig refuses when it reads it.
  // Presence, shapes and dtypes of the tensors the config implies: lesson 01 checks them when it opens the
  // model directory (ModelDir::open), and so does this, for a WeightStore opened any other way.
  std::set<std::string> wanted;
  for (const ExpectedTensor& e : expected_llama_tensors(c)) {
    wanted.insert(e.name);
    if (!weights.contains(e.name))
      throw InputError(kWhere + "tensor \"" + e.name +
                       "\" is missing (a Llama model with this config.json needs it" +
                       (e.name == "lm_head.weight" ? ": tie_word_embeddings is false)" : ")"));
    const SafetensorsEntry& entry = weights.entry(e.name);
    if (entry.shape != e.shape)
      throw InputError(kWhere + "tensor \"" + e.name + "\" has shape " + shape_str(entry.shape) +
                       ", expected " + shape_str(e.shape) + " from config.json");
    if (!is_compute_dtype(entry.dtype) && !resident_fp8_linear(c, weights, e.name))
      throw InputError(kWhere + "tensor \"" + e.name + "\" is " + std::string(dtype_name(entry.dtype)) +
                       ": the forward pass computes with F32, F16 or BF16 weights");
  }
  // What only the forward pass knows: it reads exactly these tensors, so anything else in the checkpoint (a bias
  // the config does not promise, a quantisation scale, a layer beyond num_hidden_layers) is a model it would
  // compute wrong.
  for (const std::string& name : weights.names()) {
    if (wanted.count(name)) continue;
    // Checkpoints written by old transformers versions carry RoPE's inv_freq as a buffer; we compute it.
    if (ends_with(name, ".rotary_emb.inv_freq")) continue;
    // Tied embeddings: Hugging Face uses embed_tokens for the output and ignores a stored lm_head copy.
    if (name == "lm_head.weight" && c.tie_word_embeddings) continue;
    // A compressed-tensors kv_cache_scheme (lesson 01 validated it): the FP8 KV cache's per-layer scales, read by
    // lesson 12's load_kv_scales, not by the forward pass.
    if (c.quantization && (ends_with(name, ".self_attn.k_scale") || ends_with(name, ".self_attn.v_scale"))) continue;
    // FP8-resident: the scales of the codes the forward reads.
    if (ends_with(name, ".weight_scale") && wanted.count(name.substr(0, name.size() - 6)) &&
        resident_fp8_linear(c, weights, name.substr(0, name.size() - 6)))
      continue;
    const SafetensorsEntry& entry = weights.entry(name);
    throw InputError(
        kWhere + "unexpected tensor \"" + name + "\" " + std::string(dtype_name(entry.dtype)) +
        shape_str(entry.shape) + ": a Llama model with this config.json (" +
        std::to_string(c.num_hidden_layers) + " layers, " +
        (family_extras(c).empty() ? std::string("no biases") : family_extras(c)) +
        ") has no such weight; refusing rather than computing a different model");
  }
}

namespace {

// The elements of every part, one part after another, written as bf16 at dst (host or device memory).
void stack_as_bf16(void* dst, Device dst_device, const std::vector<TensorView>& parts) {
  // --- exercise 08.3: packing the weights --------------------------------------------------------------
  // Task: write the elements of parts[0], then of parts[1], ... (each a contiguous host view of F32, F16
  //   or BF16, e.g. the mapped q_proj, k_proj and v_proj weights) one after another at dst as bf16 bit
  //   patterns (uint16_t), rounded to nearest even. Stacking row-major [rows, cols] matrices one after
  //   another IS stacking their rows: that is the whole packing. dst is host memory when dst_device is
  //   Device::CPU, else device memory: convert into a bounded host staging buffer and copy each chunk
  //   with cudaMemcpy (no second full host copy of the weights); BF16 parts need no conversion at all.
  // Hint: load_as_f32(part.data, part.dtype, i) and f32_to_bf16(x) (common/dtype.h) read and round one
  //   element of any floating dtype; F16 widens to fp32 exactly, so F16 -> bf16 is ONE rounding.
  // Hint: wrap every CUDA call in TVLLM_CUDA_CHECK.
  // Tests: PackRows.StacksAndRoundsToBf16 TransformerGpu.PackedWeightsEqualUnpacked
  // Stub:
  //   (void)dst;
  //   (void)dst_device;
  //   (void)parts;
  //   throw NotWrittenYet("08.3", "packing the weights");
  // --- solution ---
  constexpr size_t kChunk = size_t{1} << 22;  // elements converted per staging round: 8 MiB of bf16
  std::vector<uint16_t> staging;              // only for converting to the GPU; at most kChunk elements
  auto* out = static_cast<uint16_t*>(dst);
  for (const TensorView& part : parts) {
    const size_t n = static_cast<size_t>(part.numel());
    if (part.dtype == DType::BF16) {  // already bf16: the bytes as stored
      if (dst_device == Device::CPU)
        std::memcpy(out, part.data, n * 2);
      else
        TVLLM_CUDA_CHECK(cudaMemcpy(out, part.data, n * 2, cudaMemcpyHostToDevice));
    } else {
      for (size_t begin = 0; begin < n; begin += kChunk) {
        const size_t count = std::min(kChunk, n - begin);
        uint16_t* converted = out + begin;
        if (dst_device == Device::CUDA) {
          staging.resize(kChunk);
          converted = staging.data();
        }
        for (size_t i = 0; i < count; ++i)
          converted[i] = f32_to_bf16(load_as_f32(part.data, part.dtype, begin + i));
        if (dst_device == Device::CUDA)
          TVLLM_CUDA_CHECK(cudaMemcpy(out + begin, converted, count * 2, cudaMemcpyHostToDevice));
      }
    }
    out += n;
  }
  // --- end of exercise 08.3 ---
}

}  // namespace

void pack_rows_bf16(const TensorView& dst, const std::vector<TensorView>& parts) {
  TVLLM_REQUIRE(dst.rank() >= 1 && dst.dtype == DType::BF16 && dst.is_contiguous() && dst.data,
                "pack_rows_bf16: dst must be a contiguous BF16 view, got " + dst.describe());
  TVLLM_REQUIRE(!parts.empty(), "pack_rows_bf16: nothing to pack");
  int64_t rows = 0;
  for (const TensorView& part : parts) {
    TVLLM_REQUIRE(
        part.device == Device::CPU && part.is_contiguous() && is_compute_dtype(part.dtype) &&
            (part.data || part.numel() == 0),
        "pack_rows_bf16: a part must be a contiguous host view of F32, F16 or BF16, got " + part.describe());
    TVLLM_REQUIRE(part.rank() == dst.rank() &&
                      std::equal(part.shape.begin() + 1, part.shape.end(), dst.shape.begin() + 1),
                  "pack_rows_bf16: part " + part.describe() + " does not stack into " + dst.describe());
    rows += part.shape[0];
  }
  TVLLM_REQUIRE(rows == dst.shape[0], "pack_rows_bf16: the parts have " + std::to_string(rows) +
                                          " rows, dst " + dst.describe() + " has " +
                                          std::to_string(dst.shape[0]));
  stack_as_bf16(dst.data, dst.device, parts);
}

ModelWeights ModelWeights::bind(const ModelDir& model, Device device) {
  const ModelConfig& c = model.config;
  const WeightStore& store = model.weights;
  check_llama_weights(c, store);

  ModelWeights w;
  w.config = c;
  w.device = device;
  w.tied = c.tie_word_embeddings;
  w.layers.resize(static_cast<size_t>(c.num_hidden_layers));

  bool fp8 = false;
  for (const ExpectedTensor& e : expected_llama_tensors(c)) fp8 = fp8 || resident_fp8_linear(c, store, e.name);
  if (fp8 && device == Device::CPU)
    throw InputError(kWhere + "FP8-resident weights (Fp8Load::Resident) are bound only on CUDA, where the decode "
                     "GEMVs read them; open the model with Fp8Load::Dequantize for the CPU");
  if (device == Device::CPU) {
    // Views into the mapped files, as stored: nothing is copied.
    w.embed = store.host("model.embed_tokens.weight");
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      const std::string p = layer_prefix(l);
      LayerWeights& L = w.layers[static_cast<size_t>(l)];
      L.input_norm = store.host(p + "input_layernorm.weight");
      L.post_norm = store.host(p + "post_attention_layernorm.weight");
      L.wq = store.host(p + "self_attn.q_proj.weight");
      L.wk = store.host(p + "self_attn.k_proj.weight");
      L.wv = store.host(p + "self_attn.v_proj.weight");
      L.wo = store.host(p + "self_attn.o_proj.weight");
      L.w_gate = store.host(p + "mlp.gate_proj.weight");
      L.w_up = store.host(p + "mlp.up_proj.weight");
      L.w_down = store.host(p + "mlp.down_proj.weight");
      // The extras, where the config promises them (check_llama_weights made sure they are there).
      if (c.qkv_bias) {
        L.bq = store.host(p + "self_attn.q_proj.bias");
        L.bk = store.host(p + "self_attn.k_proj.bias");
        L.bv = store.host(p + "self_attn.v_proj.bias");
      }
      if (c.o_bias) L.bo = store.host(p + "self_attn.o_proj.bias");
      if (c.mlp_bias) {
        L.b_gate = store.host(p + "mlp.gate_proj.bias");
        L.b_up = store.host(p + "mlp.up_proj.bias");
        L.b_down = store.host(p + "mlp.down_proj.bias");
      }
      if (c.qk_norm) {
        L.q_norm = store.host(p + "self_attn.q_norm.weight");
        L.k_norm = store.host(p + "self_attn.k_norm.weight");
      }
    }
    w.final_norm = store.host("model.norm.weight");
    w.lm_head = w.tied ? w.embed : store.host("lm_head.weight");
    return w;
  }

  // CUDA: plan the one allocation (every tensor 256-byte aligned, as cudaMalloc aligns its own), then fill
  // it.
  // FP8-resident (lesson 16): a Linear slot keeps its codes (1 byte each) and gets a scale slot beside it, F32
  // [rows]; the scratch slot has no parts.
  enum class Fill { Bf16, Codes, Scales, Nothing };
  struct Slot {
    std::vector<std::string> parts;  // source tensors whose rows are stacked, in order
    Shape shape;                     // of the packed result
    TensorView* view;                // where the bound view goes
    size_t offset = 0;
    Fill fill = Fill::Bf16;
  };
  std::vector<Slot> slots;
  int64_t scratch_elements = 0;  // the largest FP8 weight
  auto add = [&](std::vector<std::string> parts, TensorView* view) {
    Shape shape = store.entry(parts[0]).shape;
    for (size_t i = 1; i < parts.size(); ++i) shape[0] += store.entry(parts[i]).shape[0];
    slots.push_back({std::move(parts), std::move(shape), view});
  };
  // A Linear weight: as add(), or, resident FP8, its codes and its scales.
  auto add_linear = [&](std::vector<std::string> parts, TensorView* view, TensorView* scale) {
    add(parts, view);
    size_t fp8_parts = 0;
    for (const std::string& part : parts) fp8_parts += resident_fp8_linear(c, store, part) ? 1 : 0;
    if (fp8_parts != 0 && fp8_parts != parts.size())  // one packed matrix holds one dtype
      throw InputError(kWhere + "\"" + parts[0] + "\" and the weights packed with it are partly FP8 and partly not "
                       "(a quantization_config that ignores some of q/k/v or gate/up): open the model with "
                       "Fp8Load::Dequantize");
    if (fp8_parts == 0) return;
    slots.back().fill = Fill::Codes;
    scratch_elements = std::max(scratch_elements, shape_numel(slots.back().shape));
    slots.push_back({parts, Shape{slots.back().shape[0]}, scale, 0, Fill::Scales});
  };
  add({"model.embed_tokens.weight"}, &w.embed);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = layer_prefix(l);
    LayerWeights& L = w.layers[static_cast<size_t>(l)];
    add({p + "input_layernorm.weight"}, &L.input_norm);
    add({p + "post_attention_layernorm.weight"}, &L.post_norm);
    add_linear({p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"},
               &L.wqkv, &L.wqkv_scale);
    add_linear({p + "self_attn.o_proj.weight"}, &L.wo, &L.wo_scale);
    add_linear({p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"}, &L.w_gate_up, &L.w_gate_up_scale);
    add_linear({p + "mlp.down_proj.weight"}, &L.w_down, &L.w_down_scale);
    // The extras: biases packed like their weights (one add over q | k | v after the one GEMM).
    if (c.qkv_bias)
      add({p + "self_attn.q_proj.bias", p + "self_attn.k_proj.bias", p + "self_attn.v_proj.bias"}, &L.bqkv);
    if (c.o_bias) add({p + "self_attn.o_proj.bias"}, &L.bo);
    if (c.mlp_bias) {
      add({p + "mlp.gate_proj.bias", p + "mlp.up_proj.bias"}, &L.b_gate_up);
      add({p + "mlp.down_proj.bias"}, &L.b_down);
    }
    if (c.qk_norm) {
      add({p + "self_attn.q_norm.weight"}, &L.q_norm);
      add({p + "self_attn.k_norm.weight"}, &L.k_norm);
    }
  }
  add({"model.norm.weight"}, &w.final_norm);
  if (!w.tied) add({"lm_head.weight"}, &w.lm_head);
  TensorView scratch;
  if (scratch_elements > 0) slots.push_back({{}, Shape{scratch_elements}, &scratch, 0, Fill::Nothing});

  const auto dtype_of = [](Fill f) {
    return f == Fill::Codes ? DType::F8_E4M3 : f == Fill::Scales ? DType::F32 : DType::BF16;
  };
  size_t total = 0;
  for (Slot& s : slots) {
    s.offset = total;
    total += (static_cast<size_t>(shape_numel(s.shape)) * dtype_size(dtype_of(s.fill)) + 255) / 256 * 256;
  }
  w.storage_ = DeviceBuffer(total);
  w.device_bytes = total;
  for (Slot& s : slots) {
    *s.view = TensorView::contiguous(static_cast<char*>(w.storage_.data()) + s.offset, dtype_of(s.fill),
                                     Device::CUDA, s.shape);
    std::vector<TensorView> parts;
    for (const std::string& name : s.parts) parts.push_back(store.host(name));
    if (s.fill == Fill::Bf16) {
      pack_rows_bf16(*s.view, parts);
    } else if (s.fill == Fill::Codes) {  // the codes as stored, the parts' rows one after another
      char* out = static_cast<char*>(s.view->data);
      for (const TensorView& part : parts) {
        TVLLM_CUDA_CHECK(cudaMemcpy(out, part.data, part.nbytes(), cudaMemcpyHostToDevice));
        out += part.nbytes();
      }
    } else if (s.fill == Fill::Scales) {  // each row's scale as F32 (exact from BF16/F16); a tensor scale repeated
      std::vector<float> scales;
      for (size_t i = 0; i < parts.size(); ++i) {
        const TensorView sc = store.host(s.parts[i] + "_scale");
        const int64_t rows = parts[i].shape[0];
        const bool per_row = sc.numel() == rows;
        for (int64_t r = 0; r < rows; ++r)
          scales.push_back(load_as_f32(sc.data, sc.dtype, static_cast<size_t>(per_row ? r : 0)));
      }
      TVLLM_CUDA_CHECK(cudaMemcpy(s.view->data, scales.data(), scales.size() * sizeof(float), cudaMemcpyHostToDevice));
    }
  }
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());  // load time: every upload done before the first step

  // The unpacked matrices are row ranges of the packed ones (no copy): wq | wk | wv and w_gate | w_up.
  w.fp8_resident = scratch_elements > 0;
  for (LayerWeights& L : w.layers) {
    L.fp8_scratch = scratch;
    L.wq = L.wqkv.rows(0, c.q_dim());
    L.wk = L.wqkv.rows(c.q_dim(), c.kv_dim());
    L.wv = L.wqkv.rows(c.q_dim() + c.kv_dim(), c.kv_dim());
    L.w_gate = L.w_gate_up.rows(0, c.intermediate_size);
    L.w_up = L.w_gate_up.rows(c.intermediate_size, c.intermediate_size);
    if (L.bqkv.data) {
      L.bq = L.bqkv.rows(0, c.q_dim());
      L.bk = L.bqkv.rows(c.q_dim(), c.kv_dim());
      L.bv = L.bqkv.rows(c.q_dim() + c.kv_dim(), c.kv_dim());
    }
    if (L.b_gate_up.data) {
      L.b_gate = L.b_gate_up.rows(0, c.intermediate_size);
      L.b_up = L.b_gate_up.rows(c.intermediate_size, c.intermediate_size);
    }
  }
  if (w.tied) w.lm_head = w.embed;
  return w;
}

void ModelWeights::allocate_fp8_lm_head() {
  TVLLM_REQUIRE(device == Device::CUDA && lm_head.rank() == 2,
                kWhere + "an FP8 lm_head is kept on CUDA only (the fused decode GEMV reads it)");
  const int64_t vocab = lm_head.shape[0], hidden = lm_head.shape[1];
  const size_t codes = (static_cast<size_t>(vocab * hidden) + 255) / 256 * 256;  // the scales 256-byte aligned
  lm_head_fp8_storage_ = DeviceBuffer(codes + static_cast<size_t>(vocab) * sizeof(float));
  char* base = static_cast<char*>(lm_head_fp8_storage_.data());
  lm_head_fp8 = TensorView::contiguous(base, DType::F8_E4M3, Device::CUDA, {vocab, hidden});
  lm_head_scale = TensorView::contiguous(base + codes, DType::F32, Device::CUDA, {vocab});
}

namespace {
std::atomic<Fp8WeightDequantizer> g_fp8_dequantizer{nullptr};  // published atomically, like the other seams
}  // namespace

void install_fp8_weight_dequantizer(Fp8WeightDequantizer fn) { g_fp8_dequantizer.store(fn); }
bool fp8_weight_dequantizer_installed() { return g_fp8_dequantizer.load() != nullptr; }

TensorView weight_for_gemm(const TensorView& w, const TensorView& scale, const TensorView& scratch,
                           cudaStream_t stream) {
  if (w.dtype != DType::F8_E4M3) return w;
  const Fp8WeightDequantizer dequantize = g_fp8_dequantizer.load();
  if (!dequantize)
    throw InputError(kWhere + "an F8_E4M3 weight " + w.describe() + " reached a GEMM, but no FP8 dequantizer is "
                     "installed (lesson 16's install_fp8_resident_weights, or open the model with "
                     "Fp8Load::Dequantize)");
  TVLLM_REQUIRE(scratch.data && scratch.dtype == DType::BF16 && scratch.numel() >= w.numel(),
                "weight_for_gemm: the FP8 scratch " + scratch.describe() + " cannot hold " + w.describe());
  const TensorView dst = TensorView::contiguous(scratch.data, DType::BF16, w.device, w.shape);
  dequantize(dst, w, scale, stream);
  return dst;
}

}  // namespace tvllm
