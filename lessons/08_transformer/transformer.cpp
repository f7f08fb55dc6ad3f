// Lesson 08: the limits, the workspace, the execution context, prefill attention and the forward pass.
#include "transformer.h"

#include <algorithm>
#include <atomic>
#include <string>
#include <vector>

#include "common/errors.h"
#include "common/exercise.h"
#include "family_ops.h"
#include "matmul.h"
#include "rmsnorm.h"
#include "silu_mul.h"

namespace tvllm {

// ---- limits -------------------------------------------------------------------------------------------

EngineLimits EngineLimits::resolved(const ModelConfig& config) const {
  EngineLimits l = *this;
  TVLLM_REQUIRE(l.max_tokens >= 1 && l.max_tokens <= (int64_t{1} << 24),
                "EngineLimits: max_tokens must be in [1, 2^24], got " + std::to_string(l.max_tokens));
  TVLLM_REQUIRE(l.max_sequences >= 1 && l.max_sequences <= AttentionBatch::kMaxSequences,
                "EngineLimits: max_sequences must be in [1, " +
                    std::to_string(AttentionBatch::kMaxSequences) + "], got " +
                    std::to_string(l.max_sequences));
  TVLLM_REQUIRE(l.max_logits_rows >= 1 && l.max_logits_rows <= l.max_tokens,
                "EngineLimits: max_logits_rows must be in [1, max_tokens = " + std::to_string(l.max_tokens) +
                    "], got " + std::to_string(l.max_logits_rows));
  if (l.max_context == 0) l.max_context = config.max_position_embeddings;
  TVLLM_REQUIRE(l.max_context >= 1 && l.max_context <= config.max_position_embeddings,
                "EngineLimits: max_context must be in [1, max_position_embeddings = " +
                    std::to_string(config.max_position_embeddings) + "], got " +
                    std::to_string(l.max_context));
  return l;
}

// ---- the workspace --------------------------------------------------------------------------------------

Workspace::Workspace(const ModelConfig& c, const EngineLimits& limits, Device device)
    : device_(device), limits_(limits.resolved(c)) {
  const DType act = device == Device::CUDA ? DType::BF16 : DType::F32;
  const int64_t T = limits_.max_tokens, R = limits_.max_logits_rows, H = c.hidden_size,
                I = c.intermediate_size;
  hidden = Tensor::empty({T, H}, act, device);
  normed = Tensor::empty({T, H}, act, device);
  qkv = Tensor::empty({T * (c.q_dim() + 2 * c.kv_dim())}, act, device);
  attn = Tensor::empty({T, c.q_dim()}, act, device);
  delta = Tensor::empty({T, H}, act, device);
  gate_up = Tensor::empty({T * 2 * I}, act, device);
  this->act = Tensor::empty({T, I}, act, device);
  out_hidden = Tensor::empty({R, H}, act, device);
  out_delta = Tensor::empty({R, H}, act, device);
  out_normed = Tensor::empty({R, H}, act, device);
  logits = Tensor::empty({R, c.vocab_size}, DType::F32, device);
  rope = RopeTable::build(c, limits_.max_context);
  if (device == Device::CUDA && c.quantization) {  // an FP8 checkpoint: lesson 16's GEMM may quantize activations
    const int64_t widest = std::max({H, c.q_dim(), I});
    fp8_codes = Tensor::empty({T, widest}, DType::F8_E4M3, device);
    fp8_scales = Tensor::empty({T}, DType::F32, device);
  }
  if (device == Device::CUDA) {
    rope.upload_to_device();
    bad_token = std::make_unique<BadTokenFlag>();
  }
}

size_t Workspace::activation_bytes() const {
  size_t n = 0;
  for (const Tensor* t : {&hidden, &normed, &qkv, &attn, &delta, &gate_up, &act, &out_hidden, &out_delta,
                          &out_normed, &logits, &fp8_codes, &fp8_scales})
    n += t->view().nbytes();
  return n;
}

// ---- the execution context ----------------------------------------------------------------------------

ExecContext::ExecContext(const ModelConfig& config, const EngineLimits& limits, Device device)
    : device_(device), workspace_(config, limits, device) {
  if (device == Device::CUDA) {
    stream_.emplace();
    cublas_.emplace(CublasHandle::kDefaultWorkspaceBytes, stream_->get());
  }
}

void ExecContext::set_matmul_kernel(MatmulKernel kernel) {
  TVLLM_REQUIRE(!matmul_kernel_needs_handle(kernel) || device_ == Device::CPU || cublas_,
                "ExecContext: matmul kernel " + std::string(matmul_kernel_version(kernel)) + " needs a CublasHandle");
  matmul_kernel_ = kernel;
}

void ExecContext::synchronize() const {
  if (stream_) stream_->synchronize();
}

// ---- the FP8 GEMM seam (lesson 16) ----------------------------------------------------------------------

namespace {
std::atomic<Fp8GemmFn> g_fp8_gemm{nullptr};  // published atomically, like the other seams
std::atomic<int64_t> g_fp8_gemm_min_tokens{0};
}  // namespace

void install_fp8_gemm(Fp8GemmFn fn, int64_t min_tokens) {
  TVLLM_REQUIRE(min_tokens >= 1, "install_fp8_gemm: min_tokens must be >= 1, got " + std::to_string(min_tokens));
  g_fp8_gemm_min_tokens.store(min_tokens);
  g_fp8_gemm.store(fn);
}
Fp8GemmFn installed_fp8_gemm() { return g_fp8_gemm.load(); }

// ---- the gated-MLP seam (lesson 15) ----------------------------------------------------------------------

namespace {
std::atomic<GatedMlpFn> g_gated_mlp{nullptr};
std::atomic<int64_t> g_gated_mlp_min_tokens{0};
}  // namespace

void install_gated_mlp(GatedMlpFn fn, int64_t min_tokens) {
  TVLLM_REQUIRE(min_tokens >= 1, "install_gated_mlp: min_tokens must be >= 1, got " + std::to_string(min_tokens));
  g_gated_mlp_min_tokens.store(min_tokens);
  g_gated_mlp.store(fn);
}
GatedMlpFn installed_gated_mlp() { return g_gated_mlp.load(); }
int64_t installed_gated_mlp_min_tokens() { return g_gated_mlp_min_tokens.load(); }

namespace {
std::atomic<CpuActivationTransform> g_cpu_activation_transform{nullptr};
}  // namespace
void install_cpu_activation_transform(CpuActivationTransform fn) { g_cpu_activation_transform.store(fn); }
CpuActivationTransform installed_cpu_activation_transform() { return g_cpu_activation_transform.load(); }
int64_t installed_fp8_gemm_min_tokens() { return g_fp8_gemm_min_tokens.load(); }

void ExecContext::check_tokens() {
  if (workspace_.bad_token) workspace_.bad_token->check(stream());
}

void ExecContext::set_launcher(std::unique_ptr<StepLauncher> launcher) { launcher_ = std::move(launcher); }

void ExecContext::launch(const StepInputs& step, AttentionBackend& backend, const std::function<void()>& work) {
  if (launcher_) {
    launcher_->launch(*this, step, backend, work);
  } else {
    work();
  }
}

// ---- prefill attention ----------------------------------------------------------------------------

PrefillAttention::PrefillAttention(const ModelConfig& config, const EngineLimits& limits, Device device,
                                   AttentionKernel kernel, CublasHandle* cublas)
    : shape_(AttentionShape::from_config(config)), kernel_(kernel) {
  const EngineLimits l = limits.resolved(config);
  // Prefill: a sequence's keys are its new tokens, so no sequence has more than max_tokens of either.
  if (device == Device::CUDA)
    workspace_.emplace(shape_, AttentionLimits{l.max_sequences, l.max_tokens, l.max_tokens}, kernel, cublas);
}

void AttentionBackend::attend_stored(int /*layer*/, const TensorView& /*q*/, const TensorView& /*out*/,
                                     const StepInputs& /*step*/, cudaStream_t /*stream*/) {
  TVLLM_REQUIRE(false, "attend_stored: this attention backend stores no keys itself (its kv_store() said false: "
                       "call attend() with the step's k and v)");
}

void PrefillAttention::attend(int /*layer*/, const TensorView& q, const TensorView& k, const TensorView& v,
                              const TensorView& out, const StepInputs& step, cudaStream_t stream) {
  const AttentionBatch& batch = step.batch();
  // k_len >= q_len for every sequence, so equal totals mean equal lengths.
  TVLLM_REQUIRE(
      batch.total_k() == batch.total_q(),
      "PrefillAttention: a sequence of this step continues earlier tokens (k_len > q_len); attending to "
      "them needs their keys and values from a KV cache (lesson 10)");
  if (fast_prefill_ && try_fresh_prefill(out, q, k, v, batch, shape_, stream)) return;
  attention(out, q, k, v, batch, shape_, kernel_, workspace_ ? &*workspace_ : nullptr, stream);
}

// ---- the forward pass -----------------------------------------------------------------------------

namespace {

TensorView first(const Tensor& buffer, Shape shape) {
  return TensorView::contiguous(buffer.data(), buffer.dtype(), buffer.device(), std::move(shape));
}
TensorView at_element(const Tensor& buffer, int64_t offset, Shape shape) {
  char* p = static_cast<char*>(buffer.data()) + offset * static_cast<int64_t>(dtype_size(buffer.dtype()));
  return TensorView::contiguous(p, buffer.dtype(), buffer.device(), std::move(shape));
}

// One projection: y = x W^T, plus the bias b where the model has one (an empty view: none). The bias is its
// own small step after the GEMM (family_ops.h), so every matmul version of lesson 06 serves every family.
// FP8-resident weights (lesson 16): the GEMM reads the weight dequantized into the layers' scratch just before
// it (weight_for_gemm); for BF16 weights scale and scratch are empty and the weight is used as it is.
// Steps of installed_fp8_gemm_min_tokens()+ tokens ask lesson 16's FP8 tensor-core GEMM first (install_fp8_gemm):
// it reads the codes as they are and quantizes x per token; where it declines, the dequantize path runs.
[[maybe_unused]] void project(ExecContext& ctx, const TensorView& y, const TensorView& x,
                              const TensorView& weight, const TensorView& bias, const TensorView& scale = {},
                              const TensorView& scratch = {}) {
  if (ctx.device() == Device::CPU) {
    if (const CpuActivationTransform transform = installed_cpu_activation_transform()) {
      thread_local std::vector<float> changed;  // the CPU path allocates freely; one buffer per thread, reused
      changed.resize(static_cast<size_t>(x.numel()));
      const TensorView x2 = TensorView::contiguous(changed.data(), DType::F32, Device::CPU, x.shape);
      transform(x2, x);
      linear(y, x2, weight, ctx.matmul_kernel(), ctx.cublas());
      if (bias.data) add_bias(y, bias, ctx.stream());
      return;
    }
  }
  const Fp8GemmFn fp8_gemm = installed_fp8_gemm();
  const bool fp8_done = fp8_gemm && weight.dtype == DType::F8_E4M3 &&
                        x.shape[0] >= installed_fp8_gemm_min_tokens() && fp8_gemm(ctx, y, x, weight, scale);
  if (!fp8_done)
    linear(y, x, weight_for_gemm(weight, scale, scratch, ctx.stream()), ctx.matmul_kernel(), ctx.cublas());
  if (bias.data) add_bias(y, bias, ctx.stream());
}

// q, k, v of the step's T tokens from the normalised hidden states x [T, hidden], biases included.
//   packed (CUDA): ONE GEMM with wqkv writes rows [q | k | v] (and ONE add of bqkv); q, k, v are column views.
//   unpacked (CPU, the weights as stored): three GEMMs into three planes of the same buffer.
[[maybe_unused]] QkvViews project_qkv(ExecContext& ctx, const LayerWeights& L, const TensorView& x,
                                      const AttentionShape& shape) {
  const Tensor& buf = ctx.workspace().qkv;
  const int64_t T = x.shape[0];
  if (L.packed()) {
    const TensorView qkv = first(buf, {T, shape.qkv_dim()});
    TVLLM_REQUIRE(!L.has_qkv_bias() || L.bqkv.data, "forward: packed q/k/v weights need a packed q/k/v bias");
    project(ctx, qkv, x, L.wqkv, L.bqkv, L.wqkv_scale, L.fp8_scratch);
    return split_qkv(qkv, shape);
  }
  QkvViews out{at_element(buf, 0, {T, shape.q_dim()}),
               at_element(buf, T * shape.q_dim(), {T, shape.kv_dim()}),
               at_element(buf, T * (shape.q_dim() + shape.kv_dim()), {T, shape.kv_dim()})};
  project(ctx, out.q, x, L.wq, L.bq);
  project(ctx, out.k, x, L.wk, L.bk);
  project(ctx, out.v, x, L.wv, L.bv);
  return out;
}

// gate and up [T, intermediate] from x [T, hidden], the same way: one GEMM into rows [gate | up] (CUDA), or
// two into two planes (CPU); with mlp_bias, their biases.
[[maybe_unused]] std::pair<TensorView, TensorView> project_gate_up(ExecContext& ctx, const LayerWeights& L,
                                                                   const TensorView& x) {
  const Tensor& buf = ctx.workspace().gate_up;
  const int64_t T = x.shape[0], I = L.w_gate.shape[0];
  if (L.packed()) {
    const TensorView gate_up = first(buf, {T, 2 * I});
    TVLLM_REQUIRE(!L.b_gate.data || L.b_gate_up.data, "forward: packed gate/up weights need a packed bias");
    project(ctx, gate_up, x, L.w_gate_up, L.b_gate_up, L.w_gate_up_scale, L.fp8_scratch);
    return {column_slice(gate_up, 0, I), column_slice(gate_up, I, I)};
  }
  const TensorView gate = at_element(buf, 0, {T, I}), up = at_element(buf, T * I, {T, I});
  project(ctx, gate, x, L.w_gate, L.b_gate);
  project(ctx, up, x, L.w_up, L.b_up);
  return {gate, up};
}

// act = silu(x Wg^T) * (x Wu^T) in one kernel, when lesson 15 installed one (install_gated_mlp) and the step
// qualifies (transformer.h says when); false: nothing ran, the caller runs project_gate_up and silu_mul.
[[maybe_unused]] bool gated_mlp_in_one_kernel(ExecContext& ctx, const LayerWeights& L, const TensorView& x,
                                              const TensorView& act) {
  const GatedMlpFn fn = installed_gated_mlp();
  return fn != nullptr && ctx.device() == Device::CUDA && x.shape[0] >= installed_gated_mlp_min_tokens() &&
         ctx.matmul_kernel() == MatmulKernel::V5Cublas && L.packed() && L.b_gate_up.data == nullptr &&
         L.w_gate_up.dtype == DType::BF16 && fn(act, x, L.w_gate_up, ctx.stream());
}

// One decoder layer over the step's T tokens.
//   On entry: h (workspace.hidden) holds the residual stream WITHOUT the previous layer's MLP output, which
//   is still in delta (layer > 0): adding it is fused into this layer's first norm (add_rmsnorm).
//   On exit: h + delta is this layer's output (the next layer, or the final norm, does the addition).
void decoder_layer(ExecContext& ctx, const ModelWeights& w, int layer, const StepInputs& step,
                   AttentionBackend& backend) {
  // --- exercise 08.4: one decoder layer --------------------------------------------------------------
  // Task: the Llama block, in the lessons' ops, on the first T rows of the workspace buffers:
  //   normed = rmsnorm(h) * input_norm (layer > 0: h += delta first, fused: add_rmsnorm); q, k, v =
  //   project_qkv(normed); Qwen3 only (L.has_qk_norm()): head_rmsnorm of q and k; RoPE on q and k at
  //   step.positions(); attn = backend.attend(...); delta = o_proj(attn); h += delta and normed =
  //   rmsnorm(h) * post_norm (add_rmsnorm); gate, up = project_gate_up(normed); act = silu(gate) * up;
  //   delta = down_proj(act), left in delta for the next layer to add. project() runs o_proj and down_proj
  //   with their biases where the model has them (project_qkv and project_gate_up add theirs).
  // Hint: every GPU call takes ctx.stream() last (linear uses the handle's stream: pass ctx.cublas()).
  //   RoPE runs with PositionCheck::Trusted: StepInputs validated the positions, and a check would
  //   synchronise (forbidden in a step).
  // Hint: TensorView::rows(0, T) gives a buffer's first T rows; w.config has eps and the head layout
  //   (AttentionShape::from_config).
  // Tests: Transformer.CpuForwardMatchesHuggingFace Transformer.BatchEqualsAlone lesson08_transformer.cpu
  // Tests: TransformerGpu.ForwardTop1AgreesWithHuggingFace TransformerGpu.GraphReplayEqualsEager
  // Tests: lesson08_transformer.gpu
  // Tests: Families.CpuLastRowLogitsMatchTransformers Families.CpuGreedyIdsEqualTransformers
  // Needs: 08.1
  // Stub:
  //   (void)ctx;
  //   (void)w;
  //   (void)layer;
  //   (void)step;
  //   (void)backend;
  //   throw NotWrittenYet("08.4", "one decoder layer");
  // --- solution ---
  const ModelConfig& c = w.config;
  const LayerWeights& L = w.layers[static_cast<size_t>(layer)];
  Workspace& ws = ctx.workspace();
  const cudaStream_t stream = ctx.stream();
  const float eps = static_cast<float>(c.rms_norm_eps);
  const int64_t T = step.num_tokens();
  const TensorView h = ws.hidden.view().rows(0, T);       // [T, hidden]
  const TensorView normed = ws.normed.view().rows(0, T);  // [T, hidden]
  const TensorView attn = ws.attn.view().rows(0, T);      // [T, q_dim]
  const TensorView delta = ws.delta.view().rows(0, T);    // [T, hidden]
  const TensorView act = ws.act.view().rows(0, T);        // [T, intermediate]

  // 1. Attention's input: normed = rmsnorm(h) * w_in (after h += the previous layer's MLP output).
  if (layer == 0)
    rmsnorm(normed, h, L.input_norm, eps, {}, stream);
  else
    add_rmsnorm(h, delta, L.input_norm, normed, eps, {}, stream);
  // 2. Queries, keys, values.
  const QkvViews qkv = project_qkv(ctx, L, normed, AttentionShape::from_config(c));
  // 2b. Qwen3: each head's q and k normalised over head_dim (q_norm, k_norm), before RoPE rotates them.
  if (L.has_qk_norm()) {
    head_rmsnorm(qkv.q, L.q_norm, eps, stream);
    head_rmsnorm(qkv.k, L.k_norm, eps, stream);
  }
  // 3. Rotate q and k by their positions.
  apply_rope(qkv.q, qkv.k, step.positions(), ws.rope, kDefaultRopeKernel, PositionCheck::Trusted, stream);
  // 4. Causal attention over each sequence's context.
  backend.attend(layer, qkv.q, qkv.k, qkv.v, attn, step, stream);
  // 5. Back to the residual width: delta = attn Wo^T (+ bo: Llama attention_bias).
  project(ctx, delta, attn, L.wo, L.bo, L.wo_scale, L.fp8_scratch);
  // 6. h += delta; the MLP's input normed = rmsnorm(h) * w_post.
  add_rmsnorm(h, delta, L.post_norm, normed, eps, {}, stream);
  // 7. The gated MLP: act = silu(normed Wg^T) * (normed Wu^T) (in one kernel where lesson 15 installed one).
  if (!gated_mlp_in_one_kernel(ctx, L, normed, act)) {
    const auto [gate, up] = project_gate_up(ctx, L, normed);
    silu_mul(act, gate, up, stream);
  }
  // 8. delta = act Wd^T (+ b_down: mlp_bias), added to h by the next layer's first norm (or the final norm).
  project(ctx, delta, act, L.w_down, L.b_down, L.w_down_scale, L.fp8_scratch);
  // --- end of exercise 08.4 ---
}

}  // namespace

void check_forward_args(ExecContext& ctx, const ModelWeights& w, const StepInputs& step) {
  const Workspace& ws = ctx.workspace();
  TVLLM_REQUIRE(w.device == ctx.device() && step.device() == ctx.device(),
                "forward: the context (" + std::string(device_name(ctx.device())) + "), the weights (" +
                    std::string(device_name(w.device)) + ") and the step (" +
                    std::string(device_name(step.device())) + ") must be on one device");
  const int64_t T = step.num_tokens(), R = step.num_logits_rows();
  TVLLM_REQUIRE(T >= 1, "forward: the step is empty (StepInputs::set first)");
  TVLLM_REQUIRE(T <= ws.limits().max_tokens && R <= ws.limits().max_logits_rows &&
                    step.limits().max_context <= ws.limits().max_context,
                "forward: the step's limits exceed the workspace's (make both from the same EngineLimits)");
}

TensorView forward(ExecContext& ctx, const ModelWeights& w, const StepInputs& step, AttentionBackend& backend) {
  const ForwardFn fn = ctx.forward_fn();
  return fn ? fn(ctx, w, step, backend) : forward_composed(ctx, w, step, backend);
}

TensorView forward_composed(ExecContext& ctx, const ModelWeights& w, const StepInputs& step,
                            AttentionBackend& backend) {
  check_forward_args(ctx, w, step);
  Workspace& ws = ctx.workspace();
  const int64_t T = step.num_tokens(), R = step.num_logits_rows();
  const cudaStream_t stream = ctx.stream();
  const TensorView h = ws.hidden.view().rows(0, T);  // [T, hidden]

  // 1. Token ids -> vectors: h = embed_tokens[ids].
  if (ctx.device() == Device::CUDA) {
    embedding_async(h, step.token_ids(), w.embed, *ws.bad_token, kDefaultEmbeddingKernel, stream);
  } else {
    embedding_cpu(h, step.token_ids(), w.embed);
  }
  // 2. The decoder layers, each reading and updating the residual stream h.
  for (int layer = 0; layer < static_cast<int>(w.layers.size()); ++layer)
    decoder_layer(ctx, w, layer, step, backend);

  // 3. Logits, only for the rows asked for: gather them, add the last MLP output, final norm, lm_head.
  const TensorView logits = ws.logits.view().rows(0, R);  // [R, vocab] F32
  if (R == 0) return logits;
  const TensorView rows = step.logits_rows();
  const TensorView out_h = ws.out_hidden.view().rows(0, R), out_d = ws.out_delta.view().rows(0, R);
  const TensorView out_n = ws.out_normed.view().rows(0, R);
  gather_rows(out_h, h, rows, stream);
  gather_rows(out_d, ws.delta.view().rows(0, T), rows, stream);
  add_rmsnorm(out_h, out_d, w.final_norm, out_n, static_cast<float>(w.config.rms_norm_eps), {}, stream);
  linear(logits, out_n, w.lm_head, ctx.matmul_kernel(), ctx.cublas());
  return logits;
}

double forward_flops(const ModelConfig& c, const std::vector<int64_t>& q_lens,
                     const std::vector<int64_t>& k_lens, int64_t logits_rows) {
  const double H = static_cast<double>(c.hidden_size), I = static_cast<double>(c.intermediate_size);
  const double qkv = static_cast<double>(c.q_dim() + 2 * c.kv_dim()), q_dim = static_cast<double>(c.q_dim());
  // Per token and layer: the QKV, o, gate|up and down projections.
  const double per_token_layer = 2.0 * (H * qkv + q_dim * H + 2.0 * I * H + I * H);
  double tokens = 0.0, pairs = 0.0;
  for (size_t b = 0; b < q_lens.size(); ++b) {
    const double q = static_cast<double>(q_lens[b]), k = static_cast<double>(k_lens[b]);
    tokens += q;
    pairs += q * (k - q) + q * (q + 1) / 2;  // query i sees (k - q) earlier keys and i + 1 of its own
  }
  const double layers = static_cast<double>(c.num_hidden_layers);
  // Attention: a head_dim dot product (score) and a head_dim axpy (P V) per visible pair, per head.
  const double attention =
      pairs * 4.0 * static_cast<double>(c.head_dim) * static_cast<double>(c.num_attention_heads);
  const double lm_head = 2.0 * H * static_cast<double>(c.vocab_size) * static_cast<double>(logits_rows);
  return layers * (tokens * per_token_layer + attention) + lm_head;
}

}  // namespace tvllm
