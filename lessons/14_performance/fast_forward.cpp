// Lesson 14: the fused decode forward pass (fast_forward.h).
#include "fast_forward.h"

#include <atomic>
#include <string>

#include "common/errors.h"
#include "common/exercise.h"
#include "embedding.h"
#include "family_ops.h"
#include "gemv.h"
#include "rmsnorm.h"
#include "rope.h"
#include "silu_mul.h"

namespace tvllm {

// Measured on the H200 (lesson14_performance --bench, 1B shapes, L2 flushed): at M = 1 gemv v3 beats cuBLAS on
// every decode matrix (qkv 33% vs 32% of the copy bandwidth, gate|up 73% vs 61%, down 49% vs 46%); from M = 2
// cuBLAS wins on every one, against v3 (each block re-reads all M rows of x, and the per-row register sums cut
// the loads in flight) and against v4's tensor cores too (gate|up at M = 8: v3 33%, v4 42%, cuBLAS 61%). So the
// fused path runs single-token steps, and larger decode batches keep cuBLAS (README sections 4 and 11).
int64_t fast_forward_max_tokens() { return 1; }

// FP8-resident weights (lesson 16) change the comparison: cuBLAS would first need each weight dequantized to a
// bf16 scratch (1 byte read, 2 written, 2 read again per weight), while the FP8 GEMVs read 1 byte per weight at
// any M. So with FP8 weights every step the GEMVs take (kGemvMaxRows tokens) runs fused.
int64_t fast_forward_max_tokens(const ModelWeights& w) { return w.fp8_resident ? kGemvMaxRows : 1; }

// The fused kernels have no bias in their epilogues: o_proj's and the MLP's biases (Llama's attention_bias and
// mlp_bias) would need one in gemv_residual and rmsnorm_gemv_silu_mul, so those models stay declined. What the
// layer adds before RoPE (the q/k/v biases, the q/k norm) runs as lesson 08's own kernels between the fused ones.
std::string fast_forward_declines(const ModelConfig& c) {
  std::string s;
  if (c.o_bias) s = "o_proj bias";
  if (c.mlp_bias) s += (s.empty() ? "" : ", ") + std::string("MLP biases");
  return s;
}

namespace {

// Whether the fused layer computes this layer: anything but a bias after o_proj or in the MLP, and a q/k/v bias
// only packed like wqkv (bqkv, as ModelWeights::bind packs it on CUDA).
bool fused_computes(const LayerWeights& L) {
  return L.bo.data == nullptr && L.b_gate.data == nullptr && L.b_up.data == nullptr && L.b_down.data == nullptr &&
         (!L.has_qkv_bias() || L.bqkv.data != nullptr);
}

bool fused_computes_every_layer(const ModelWeights& w) {
  for (const LayerWeights& L : w.layers)
    if (!fused_computes(L)) return false;
  return true;
}

// Whether RoPE runs in the qkv GEMV's epilogue (rmsnorm_gemv_rope): only when nothing comes between the
// projection and RoPE, and the table-reading RoPE is the one the composed forward runs (the same bits).
std::atomic<bool> g_fused_rope{true};

bool rope_in_gemv(const LayerWeights& L) {
  return g_fused_rope.load() && !L.has_qkv_bias() && !L.has_qk_norm() && kDefaultRopeKernel == RopeKernel::V2;
}

}  // namespace

void set_fused_rope(bool on) { g_fused_rope.store(on); }

namespace {
std::atomic<bool> g_kv_in_gemv{true};
}  // namespace

void set_kv_write_in_gemv(bool on) { g_kv_in_gemv.store(on); }

bool fast_forward_supported(const ModelWeights& w) {
  if (w.device != Device::CUDA || w.layers.empty() || !fused_computes_every_layer(w)) return false;
  // One token's views, for the shape checks: x [1, in] -> y [1, out] for every matrix.
  // FP8 weights (lesson 16): also their per-row scales, F32, one per row.
  const auto ok = [](const TensorView& weight, DType out_dtype, const TensorView& scale = {}) {
    const bool scale_ok = weight.dtype != DType::F8_E4M3 ||
                          (scale.data && scale.dtype == DType::F32 && scale.numel() == weight.shape[0]);
    return weight.rank() == 2 && gemv_shape_supported(weight, out_dtype) && scale_ok;
  };
  for (const LayerWeights& L : w.layers)
    if (!L.packed() || !ok(L.wqkv, DType::BF16, L.wqkv_scale) || !ok(L.wo, DType::BF16, L.wo_scale) ||
        !ok(L.w_gate_up, DType::BF16, L.w_gate_up_scale) || !ok(L.w_down, DType::BF16, L.w_down_scale))
      return false;
  // An FP8 copy of the lm_head (lesson 16, --fp8-lm-head), when attached, is what the decode steps read.
  return ok(w.lm_head, DType::F32) && (!w.lm_head_fp8.data || ok(w.lm_head_fp8, DType::F32, w.lm_head_scale));
}

namespace {

TensorView first_rows(const Tensor& buffer, Shape shape) {
  return TensorView::contiguous(buffer.data(), buffer.dtype(), buffer.device(), std::move(shape));
}

// Whether logits row i is token i for every token: a decode step (the final norm can then be fused into the
// lm_head GEMV over h itself, with no gather).
bool rows_are_tokens(const StepInputs& step) {
  if (step.num_logits_rows() != step.num_tokens()) return false;
  const int32_t* rows = step.host_logits_rows();
  for (int64_t i = 0; i < step.num_logits_rows(); ++i)
    if (rows[i] != i) return false;
  return true;
}

}  // namespace

namespace {

// Both ForwardFns: pdl launches the fused GEMVs as programmatic dependents of the kernel before each (pdl.h).
// Everything else of the step (embedding, add_bias, head_rmsnorm, RoPE, the attention backend's kernels) is a
// plain launch, which starts only once the kernel before it has completed: that keeps pdl.cuh's induction
// ("a kernel completed => every earlier kernel of the stream completed") true across them, so a PDL GEMV after
// them still reads everything they wrote, and they never overwrite what a GEMV before them still reads.
// after_op (the timeline, fast_forward_traced): called after each op is queued; nullptr for the real steps.
TensorView fused_forward(ExecContext& ctx, const ModelWeights& w, const StepInputs& step, AttentionBackend& backend,
                         bool pdl, const OpMark* after_op = nullptr) {
  const int64_t T = step.num_tokens(), R = step.num_logits_rows();
  // fused_computes_every_layer: also when installed by hand, past fast_forward_supported (a few pointer tests).
  if (ctx.device() != Device::CUDA || T > fast_forward_max_tokens(w) || ctx.matmul_kernel() != kDefaultMatmulKernel ||
      !fused_computes_every_layer(w))
    return forward_composed(ctx, w, step, backend);
  check_forward_args(ctx, w, step);
  const ModelConfig& c = w.config;
  Workspace& ws = ctx.workspace();
  const cudaStream_t stream = ctx.stream();
  const float eps = static_cast<float>(c.rms_norm_eps);
  const AttentionShape shape = AttentionShape::from_config(c);
  const TensorView h = ws.hidden.view().rows(0, T);                  // [T, hidden], the residual stream
  const TensorView qkv = first_rows(ws.qkv, {T, shape.qkv_dim()});   // [T, q | k | v]
  const TensorView attn = ws.attn.view().rows(0, T);                 // [T, q_dim]
  const TensorView act = ws.act.view().rows(0, T);                   // [T, intermediate]
  const auto mark = [after_op](const char* op) {
    if (after_op) (*after_op)(op);
  };

  // --- exercise 14.2: the fused decode layer -------------------------------------------------------------
  // Task: the decoder layers of forward_composed() with the fused kernels of gemv.h, leaving h (the residual
  //   stream, bf16) holding each layer's full output. Contract: the same math and the same bf16 roundings as
  //   forward_composed(); nothing allocated, nothing synchronised (the step is captured in a CUDA graph); the
  //   fused GEMVs get `pdl` (their launch, not their math: see pdl.h); after each op, mark(its name) with the
  //   names fast_forward.h lists for fast_forward_traced (optional: only the timeline reads them).
  //   Where the backend gives a KvStore for the step (backend.kv_store, and the switch g_kv_in_gemv), the same
  //   GEMV stores k and v into the cache too, and backend.attend_stored() replaces backend.attend().
  //   RoPE: in the qkv GEMV's epilogue (rmsnorm_gemv_rope) where rope_in_gemv(L); else Qwen2's q/k/v biases
  //   and Qwen3's q/k norm run as lesson 08's add_bias and head_rmsnorm, where decoder_layer runs them (after the
  //   qkv projection, before RoPE), then apply_rope, all plain launches.
  // Tests: FastPath14Gpu.GreedyEqualsHuggingFaceWhereTheMarginsAreClear
  // Tests: FastPath14Gpu.TeacherForcedLogitsMatchTheComposedForward
  // Tests: FastPath14Gpu.QwenFamiliesTakeTheFusedPath
  // --- solution ---
  embedding_async(h, step.token_ids(), w.embed, *ws.bad_token, kDefaultEmbeddingKernel, stream);
  mark("embedding");
  for (const LayerWeights& L : w.layers) {
    const int layer = static_cast<int>(&L - w.layers.data());
    // Attention: qkv = rmsnorm(h) Wqkv^T; RoPE; attention; h += attn Wo^T.
    // FP8-resident weights: the same calls with the scales (empty views for BF16 weights): gemv.h.
    const QkvViews v = split_qkv(qkv, shape);
    // A decode step's k and v rows stored into the KV cache by the qkv GEMV's epilogue, where the backend says
    // where (AttentionBackend::kv_store): then its attention runs without a write kernel of its own.
    KvStore store;
    bool stored = false;
    // Nothing between the projection and RoPE (no Qwen2 bias, no Qwen3 q/k norm): RoPE in the GEMV's epilogue.
    if (rope_in_gemv(L)) {
      stored = g_kv_in_gemv.load() && backend.kv_store(layer, step, &store);
      rmsnorm_gemv_rope(qkv, h, L.input_norm, eps, L.wqkv, L.wqkv_scale, step.positions(), ws.rope, shape.n_heads,
                        shape.n_kv_heads, stream, pdl, Fp8GemvVariant::Auto, stored ? &store : nullptr);
      mark(stored ? "rmsnorm_gemv_rope + kv write (qkv)" : "rmsnorm_gemv_rope (qkv)");
    } else {
      rmsnorm_gemv(qkv, h, L.input_norm, eps, L.wqkv, L.wqkv_scale, stream, pdl);
      mark("rmsnorm_gemv (qkv)");
      // Qwen2: + the q/k/v biases on the bf16 product, rounded again, as lesson 08's project() adds them.
      if (L.bqkv.data) {
        add_bias(qkv, L.bqkv, stream);
        mark("add_bias (qkv)");
      }
      // Qwen3: each head of q and of k RMS-normalised over head_dim, before RoPE rotates them.
      if (L.has_qk_norm()) {
        head_rmsnorm(v.q, L.q_norm, eps, stream);
        head_rmsnorm(v.k, L.k_norm, eps, stream);
        mark("head_rmsnorm (q, k)");
      }
      apply_rope(v.q, v.k, step.positions(), ws.rope, kDefaultRopeKernel, PositionCheck::Trusted, stream);
      mark("rope");
    }
    if (stored) {
      backend.attend_stored(layer, v.q, attn, step, stream);
      mark("decode attention");
    } else {
      backend.attend(layer, v.q, v.k, v.v, attn, step, stream);
      mark("kv write + decode attention");
    }
    gemv_residual(h, attn, L.wo, L.wo_scale, stream, pdl);
    mark("gemv_residual (o)");
    // MLP: act = silu(rmsnorm(h) Wg^T) * (rmsnorm(h) Wu^T); h += act Wd^T.
    rmsnorm_gemv_silu_mul(act, h, L.post_norm, eps, L.w_gate_up, L.w_gate_up_scale, stream, pdl);
    mark("rmsnorm_gemv_silu_mul (gate|up)");
    gemv_residual(h, act, L.w_down, L.w_down_scale, stream, pdl);
    mark("gemv_residual (down)");
  }
  // --- end of exercise 14.2 ---

  // Logits of the wanted rows: final norm + lm_head, fused when the rows are the tokens themselves.
  const TensorView logits = ws.logits.view().rows(0, R);  // [R, vocab] F32
  if (R == 0) return logits;
  // The lm_head's FP8 copy (lesson 16, --fp8-lm-head) when the weights carry one: E4M3 codes + a scale per
  // vocabulary entry, half the bytes of the bf16 matrix; else the bf16 lm_head (w.lm_head_scale is then empty).
  const bool fp8_head = w.lm_head_fp8.data != nullptr;
  const TensorView& head = fp8_head ? w.lm_head_fp8 : w.lm_head;
  if (rows_are_tokens(step)) {
    rmsnorm_gemv(logits, h, w.final_norm, eps, head, w.lm_head_scale, stream, pdl);
    mark("rmsnorm_gemv (lm_head)");
  } else {
    const TensorView out_h = ws.out_hidden.view().rows(0, R), out_n = ws.out_normed.view().rows(0, R);
    gather_rows(out_h, h, step.logits_rows(), stream);
    rmsnorm(out_n, out_h, w.final_norm, eps, {}, stream);
    if (fp8_head)
      gemv(logits, out_n, head, w.lm_head_scale, stream);
    else
      gemv(logits, out_n, head, kDefaultGemvKernel, stream);
  }
  return logits;
}

}  // namespace

TensorView fast_forward(ExecContext& ctx, const ModelWeights& w, const StepInputs& step, AttentionBackend& backend) {
  return fused_forward(ctx, w, step, backend, false);
}

TensorView fast_forward_pdl(ExecContext& ctx, const ModelWeights& w, const StepInputs& step,
                            AttentionBackend& backend) {
  return fused_forward(ctx, w, step, backend, true);
}

TensorView fast_forward_traced(ExecContext& ctx, const ModelWeights& w, const StepInputs& step,
                               AttentionBackend& backend, const OpMark& after_op) {
  return fused_forward(ctx, w, step, backend, false, &after_op);
}

}  // namespace tvllm
