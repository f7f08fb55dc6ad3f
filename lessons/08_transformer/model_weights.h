// Lesson 08: a Llama checkpoint's weights, checked once and bound into typed structs.
//
// Hugging Face names every tensor (model.layers.3.self_attn.q_proj.weight, ...). A forward pass that looked
// them up by name in every step would pay string hashing per layer per step, and would find a missing or
// misshapen tensor only when it got there. So the names are resolved ONCE, at load: every tensor the
// config implies must exist with exactly the shape the config implies, in a floating dtype, and nothing
// else may be in the checkpoint (a q_proj.bias the config does not promise, or a quantisation scale, would
// mean a model we would silently compute wrong). What comes out is a struct of views that the forward pass
// reads by field.
//
//   CPU   every view points into the memory-mapped safetensors files, as stored (BF16, F16 or F32; the
//         CPU ops widen them exactly): no copy at all. q/k/v and gate/up stay separate tensors.
//   CUDA  ONE device allocation, bf16 (F32 and F16 checkpoints are converted on the way, rounding to
//         nearest even), in which q|k|v are packed into one [q_dim + 2*kv_dim, hidden] matrix and
//         gate|up into one [2*intermediate, hidden] matrix (README "Packing": one GEMM instead of three,
//         and of two), and their biases, when the model has them, likewise into bqkv and b_gate_up. The
//         bytes go from the mapped files to the GPU through a small staging buffer: no second full host
//         copy of the weights is ever made.
//
// The views borrow memory: the CPU binding must not outlive the ModelDir it was made from.
#pragma once

#include <cuda_runtime.h>  // cudaStream_t

#include <cstdint>
#include <string>
#include <vector>

#include "common/buffer.h"
#include "common/tensor.h"
#include "model_dir.h"

namespace tvllm {

struct LayerWeights {
  TensorView input_norm;  // [hidden]                       input_layernorm.weight
  TensorView post_norm;   // [hidden]                       post_attention_layernorm.weight
  // Attention projections, y = x W^T, W as Hugging Face stores it ([out, in]).
  TensorView wq;    // [q_dim, hidden]                self_attn.q_proj.weight
  TensorView wk;    // [kv_dim, hidden]               self_attn.k_proj.weight
  TensorView wv;    // [kv_dim, hidden]               self_attn.v_proj.weight
  TensorView wqkv;  // [q_dim + 2*kv_dim, hidden]     rows wq | wk | wv   (CUDA only; empty on the CPU)
  TensorView wo;    // [hidden, q_dim]                self_attn.o_proj.weight
  // MLP projections.
  TensorView w_gate;     // [intermediate, hidden]         mlp.gate_proj.weight
  TensorView w_up;       // [intermediate, hidden]         mlp.up_proj.weight
  TensorView w_gate_up;  // [2*intermediate, hidden]       rows w_gate | w_up  (CUDA only; empty on the CPU)
  TensorView w_down;     // [hidden, intermediate]         mlp.down_proj.weight

  // The Llama-like families' extras (README "Other Llama-like families"): empty views unless the config
  // asks for them. CPU: as stored; CUDA: bf16, the q/k/v and gate/up biases packed like their weights
  // (bq, bk, bv, b_gate, b_up are then slices of bqkv and b_gate_up).
  TensorView bq, bk, bv;  // [q_dim], [kv_dim], [kv_dim]   self_attn.{q,k,v}_proj.bias  (qkv_bias)
  TensorView bqkv;        // [q_dim + 2*kv_dim]             bq | bk | bv  (CUDA only)
  TensorView bo;          // [hidden]                       self_attn.o_proj.bias        (o_bias)
  TensorView b_gate, b_up;  // [intermediate] each          mlp.{gate,up}_proj.bias      (mlp_bias)
  TensorView b_gate_up;   // [2*intermediate]               b_gate | b_up  (CUDA only)
  TensorView b_down;      // [hidden]                       mlp.down_proj.bias           (mlp_bias)
  TensorView q_norm, k_norm;  // [head_dim] each            self_attn.{q,k}_norm.weight  (qk_norm, Qwen3)

  // FP8-resident weights (lesson 16: a quantized checkpoint opened with Fp8Load::Resident, CUDA only): wqkv, wo,
  // w_gate_up and w_down (and so their row slices) are F8_E4M3 codes, and these are their per-row scales, F32
  // [rows] (q | k | v and gate | up packed like the rows). Empty views for BF16 weights. fp8_scratch: one BF16
  // buffer as large as the largest of the four, shared by every layer, into which the composed forward
  // dequantizes a weight just before its GEMM (weight_for_gemm); the fused decode GEMVs read the codes.
  TensorView wqkv_scale, wo_scale, w_gate_up_scale, w_down_scale;
  TensorView fp8_scratch;

  bool packed() const { return wqkv.data != nullptr; }
  bool fp8() const { return wqkv.dtype == DType::F8_E4M3; }
  bool has_qkv_bias() const { return bq.data != nullptr; }
  bool has_qk_norm() const { return q_norm.data != nullptr; }
  // Whether this layer is plain Llama (no bias, no q/k norm): what a path that knows only Llama may run.
  bool llama_only() const {
    return !has_qkv_bias() && bo.data == nullptr && b_gate.data == nullptr && b_down.data == nullptr &&
           !has_qk_norm();
  }
};

struct ModelWeights {
  ModelConfig config;  // what the weights were bound for (the forward pass reads its sizes and eps)
  Device device = Device::CPU;
  TensorView embed;  // [vocab, hidden]   model.embed_tokens.weight
  std::vector<LayerWeights> layers;
  TensorView final_norm;    // [hidden]          model.norm.weight
  TensorView lm_head;       // [vocab, hidden]   lm_head.weight, or embed itself when tie_word_embeddings
  bool tied = false;        // lm_head is embed_tokens
  size_t device_bytes = 0;  // CUDA: the size of the one allocation (0 on the CPU)
  bool fp8_resident = false;  // the decoder layers' Linear weights are F8_E4M3 + scales (LayerWeights::fp8)
  // Opt-in FP8 copy of the lm_head (lesson 16, --fp8-lm-head; CUDA only): E4M3 codes [vocab, hidden] and F32
  // [vocab] per-row scales, which lesson 14's fused decode GEMV reads instead of lm_head. lm_head itself stays
  // (the embedding gather, the composed forward's logits and the megakernel read it). Empty views unless
  // lesson 16's attach_fp8_lm_head filled them.
  TensorView lm_head_fp8, lm_head_scale;

  // Checks the checkpoint against the config (check_llama_weights) and binds it for `device`.
  // CUDA: allocates and uploads (synchronously: this is load time, not a step). Throws InputError.
  static ModelWeights bind(const ModelDir& model, Device device);

  // CUDA: allocates lm_head_fp8 and lm_head_scale (uninitialised, owned by these weights) for lm_head's shape;
  // the caller fills them (lesson 16's attach_fp8_lm_head). InputError on the CPU.
  void allocate_fp8_lm_head();

 private:
  DeviceBuffer storage_;  // CUDA: every tensor above, 256-byte aligned, packed ones included
  DeviceBuffer lm_head_fp8_storage_;  // lm_head_fp8, then lm_head_scale (allocate_fp8_lm_head)
};

// ---- FP8-resident weights in the composed forward (lesson 16 installs the kernel) -------------------------
// dst (BF16, q's shape) = round_bf16(fp8(q) * scale[row]) on the GPU, queued on `stream`: the same values lesson
// 01's dequantize-at-load computes on the host.
using Fp8WeightDequantizer = void (*)(const TensorView& dst, const TensorView& q, const TensorView& scale,
                                      cudaStream_t stream);
void install_fp8_weight_dequantizer(Fp8WeightDequantizer fn);
bool fp8_weight_dequantizer_installed();
// The weight as lesson 06's GEMMs take it: w itself unless it is F8_E4M3; then w dequantized into the first rows
// of `scratch` (its scale beside it), which is returned. InputError if no dequantizer is installed.
TensorView weight_for_gemm(const TensorView& w, const TensorView& scale, const TensorView& scratch,
                           cudaStream_t stream);

// What the config adds to Llama's layer, for messages: e.g. "q/k/v biases, q/k norm"; "" for a plain Llama.
std::string family_extras(const ModelConfig& config);

// The Hugging Face name and shape of every tensor a Llama model of this config needs, in load order
// (lm_head.weight last, and only when the embeddings are not tied).
struct ExpectedTensor {
  std::string name;
  Shape shape;
};
std::vector<ExpectedTensor> expected_llama_tensors(const ModelConfig& config);

// With the config's extras (qkv_bias, o_bias, mlp_bias, qk_norm) their biases and norm weights are expected
// too, each right after the weight it belongs to.
// InputError naming the tensor for any tensor the model would NOT use (a bias the config does not promise, a
// quantisation scale, a layer beyond num_hidden_layers) - except an FP8 Linear weight with its weight_scale in a
// quantized checkpoint opened with Fp8Load::Resident, the rotary inv_freq buffers old checkpoints carry, and
// lm_head.weight beside tied embeddings (Hugging Face ignores it too). Also for a missing tensor, a wrong shape, or a dtype
// the forward pass cannot compute with (only F32, F16 and BF16), which lesson 01's ModelDir::open already
// refuses with its own message when it opens a model directory.
void check_llama_weights(const ModelConfig& config, const WeightStore& weights);

// Packing: the rows of `parts` stacked, one after another, into dst, each element rounded to bf16 (nearest
// even; BF16 parts are copied bit for bit). dst: contiguous BF16 [sum of the parts' rows, ...] on the CPU or
// the GPU; parts: contiguous host views of F32, F16 or BF16 whose other dimensions equal dst's. A GPU
// destination is filled through a bounded staging buffer (synchronous copies: load time).
void pack_rows_bf16(const TensorView& dst, const std::vector<TensorView>& parts);

}  // namespace tvllm
