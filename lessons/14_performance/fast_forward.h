// Lesson 14: the fused decode forward pass.
//
// Lesson 08's forward_composed() runs one kernel per op: for a decode step of T <= 16 tokens, per layer,
//
//   rmsnorm ─> QKV GEMM ─> RoPE ─> attention ─> o GEMM ─> add_rmsnorm ─> gate|up GEMM ─> silu·mul ─> down GEMM
//
// and every arrow is a round trip of an activation through global memory plus a kernel launch. At batch 1 the
// activations are tiny (a few KiB); what costs is the weights (every byte read once per step) and the gaps.
// fast_forward() keeps the math and the rounding of forward_composed() and fuses what the small batch allows:
//
//   rmsnorm_gemv_rope(QKV) ─> attention ─> gemv_residual(o) ─> rmsnorm_gemv_silu_mul(gate|up) ─> gemv_residual(down)
//
//   rmsnorm_gemv_rope       the QKV GEMV with RoPE in its epilogue: each block owns the pairs of rows RoPE
//                           rotates together, so q and k leave the kernel rotated (no RoPE kernel); in a decode
//                           step it also stores k and v in the KV cache (no KV-write kernel: kv_store.h)
//   rmsnorm_gemv            the norm of the (few) input rows is recomputed by every block from h: it is 4 KiB
//                           per row, read from L2, instead of a kernel and a round trip of `normed`
//   gemv_residual           h += x W^T in the GEMV's epilogue: the residual add of add_rmsnorm, without `delta`
//   rmsnorm_gemv_silu_mul   the block that computes gate row j also computes up row j and writes silu(g)*u:
//                           no `gate_up` buffer, no silu_mul kernel
//
// and the final norm is fused into the lm_head GEMV when the step wants every row's logits (a decode step).
// Qwen2's q/k/v biases and Qwen3's q/k norm come between the projection and RoPE: for them the layer runs
// rmsnorm_gemv(QKV), lesson 08's own kernels (add_bias, head_rmsnorm) exactly where decoder_layer runs them, then
// apply_rope.
// Steps it does not handle (more tokens than fast_forward_max_tokens(), batch-invariant matmuls, the CPU, a
// model with an o_proj or MLP bias: fast_forward_declines) go to forward_composed(): a prefill's GEMMs are
// compute-bound, where cuBLAS is the right tool, and at a few rows the measurements say cuBLAS still wins
// (fast_forward.cpp).
#pragma once

#include <functional>
#include <string>

#include "model_weights.h"
#include "transformer.h"

namespace tvllm {

// Tokens per step up to which fast_forward() runs the fused GEMV path: where it was measured to beat cuBLAS.
int64_t fast_forward_max_tokens();
// For these weights: the above for BF16 weights; kGemvMaxRows (16) for FP8-resident ones (lesson 16), whose
// GEMVs read half the bytes and which cuBLAS could only multiply after dequantizing them.
int64_t fast_forward_max_tokens(const ModelWeights& weights);

// Whether fast_forward() can run the fused path for these weights at all (CUDA, packed, every matrix a shape
// and alignment the GEMV kernels take, and no bias after o_proj or in the MLP). Checked once when the path is
// installed.
bool fast_forward_supported(const ModelWeights& weights);

// Of the Llama-like families' extras (lesson 08's "Other Llama-like families"), the fused layer computes the
// q/k/v biases (Qwen2) and the q/k norm (Qwen3); the GEMV epilogues have no bias, so Llama's attention_bias
// (o_proj) and mlp_bias are not in them. For such a config, what the fused path declines, e.g. "o_proj bias,
// MLP biases"; "" for Llama, Qwen2, Qwen3 and Mistral. fast_forward() then runs forward_composed() for every
// step (CUDA graphs and the fast sampler still apply): slower decode, never a wrong answer.
std::string fast_forward_declines(const ModelConfig& config);

// RoPE in the QKV GEMV's epilogue (on by default; the chapter's progression measures the step without it). The
// same bits either way. Process-wide: use_fast_path() sets it from FastPathOptions::rope_in_gemv.
void set_fused_rope(bool on);
// With RoPE in the QKV GEMV: the GEMV also stores a decode step's k and v rows in the KV cache, where the attention
// backend says (AttentionBackend::kv_store), and the backend attends without its write kernel (attend_stored). On
// by default; the same bytes in the cache either way. Process-wide: use_fast_path() sets it from
// FastPathOptions::kv_write_in_gemv.
void set_kv_write_in_gemv(bool on);

// ForwardFn (lesson 08's seam): the fused path for small CUDA steps with lesson 06's default matmul, else
// forward_composed(). Same contract as forward().
TensorView fast_forward(ExecContext& ctx, const ModelWeights& weights, const StepInputs& step,
                        AttentionBackend& backend);

// The same forward, the same bits, with the fused GEMVs launched as programmatic dependents of the kernel before
// each (pdl.h): each one's weight loads overlap the previous kernel's tail. Install only where pdl_supported()
// (use_fast_path checks). A separate ForwardFn, so the graph runner keys its graphs apart.
TensorView fast_forward_pdl(ExecContext& ctx, const ModelWeights& weights, const StepInputs& step,
                            AttentionBackend& backend);

// The timeline of a step (lesson14_performance --bench): fast_forward with plain launches, calling after_op(name)
// on the host right after each op is queued, where the caller records a CUDA event. Per layer: "rmsnorm_gemv_rope
// (qkv)" (RoPE in the GEMV's epilogue), or "rmsnorm_gemv (qkv)", "add_bias (qkv)" (Qwen2), "head_rmsnorm (q, k)"
// (Qwen3) and "rope"; then "kv write + decode attention" (the backend's kernels; "rmsnorm_gemv_rope + kv write
// (qkv)" and "decode attention" where the GEMV stores k and v itself), "gemv_residual (o)",
// "rmsnorm_gemv_silu_mul (gate|up)", "gemv_residual (down)"; around them "embedding" and "rmsnorm_gemv (lm_head)".
// Eager steps only (an
// event between two kernels also stops them overlapping, so this is the step without PDL). A step the fused path
// does not take runs forward_composed() and marks nothing.
using OpMark = std::function<void(const char* op)>;
TensorView fast_forward_traced(ExecContext& ctx, const ModelWeights& weights, const StepInputs& step,
                               AttentionBackend& backend, const OpMark& after_op);

}  // namespace tvllm
