// Lesson 08: the Llama decoder, the first lesson of the engine layer.
//
//   logits = forward(ctx, weights, step, backend)
//
// Lessons 03-07 each computed one op. Here they compose into the whole model, in the shape the rest of the
// course keeps (lessons 10-14 plug into it; they do not edit it):
//
//   ModelWeights     (model_weights.h) the checkpoint, checked and bound once: typed views per layer
//   EngineLimits     the most one step may hold: tokens, sequences, logits rows, context length
//   Workspace        every activation buffer a step needs, allocated ONCE from the config and the limits
//   ExecContext      the stream, the one cuBLAS handle, the workspace: what a step runs with
//   StepInputs       this step's token ids, positions, per-sequence lengths and wanted logits rows, in
//                    buffers allocated once and refilled each step (nano-vllm's per-step context, explicit)
//   AttentionBackend the seam: how a layer's new q, k, v become its attention output. Lesson 08 has
//                    PrefillAttention (each sequence attends to its own new tokens); lesson 10 adds a
//                    contiguous KV cache, lesson 12 a paged one, each as a class of its own.
//
// The device of the context picks the path: CPU = the fp32 reference (the lessons' CPU references, reading
// the weights as stored), CUDA = bf16 activations with fp32 accumulation. On CUDA, forward() only queues
// work on ctx.stream(): it allocates nothing, creates nothing and never waits, so one step can be captured
// in a CUDA graph and replayed (lesson 14 does; a test here proves it).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "attention.h"
#include "common/buffer.h"
#include "common/cublas.h"
#include "common/cuda_stream.h"
#include "common/tensor.h"
#include "embedding.h"
#include "kv_store.h"
#include "matmul.h"
#include "model_config.h"
#include "model_weights.h"
#include "rope.h"

namespace tvllm {

// ---- limits -------------------------------------------------------------------------------------------

// What one forward step may hold at most. Every buffer is sized from these once; a step beyond them is an
// InputError naming the limit (never a reallocation).
struct EngineLimits {
  int64_t max_tokens = 2048;     // new tokens per step, all sequences together (the token budget)
  int64_t max_sequences = 64;    // sequences per step
  int64_t max_logits_rows = 64;  // rows whose logits a step returns (generation: one per sequence)
  int64_t max_context = 0;       // positions per sequence; 0: the config's max_position_embeddings

  // These limits checked against the config (InputError naming the field), max_context filled in.
  EngineLimits resolved(const ModelConfig& config) const;
};

// ---- the activation workspace ----------------------------------------------------------------------

// Every buffer one step writes, allocated in the constructor and never again. A step of T tokens uses the
// first T rows. CUDA: BF16 activations (logits F32); CPU: everything F32.
class Workspace {
 public:
  Workspace(const ModelConfig& config, const EngineLimits& limits, Device device);
  Workspace(Workspace&&) noexcept = default;
  Workspace& operator=(Workspace&&) noexcept = default;

  Device device() const { return device_; }
  const EngineLimits& limits() const { return limits_; }
  size_t activation_bytes() const;  // the activation buffers below, all together

  // The residual stream and the sublayers' inputs and outputs, capacity max_tokens rows.
  Tensor hidden;   // [max_tokens, hidden]              h: the residual stream, updated in place
  Tensor normed;   // [max_tokens, hidden]              rmsnorm(h) * w: the input of each sublayer
  Tensor qkv;      // [max_tokens * (q_dim + 2*kv_dim)] q, k, v of this step's tokens. CUDA: rows
                   //                                   [q | k | v] (the packed GEMM's output); CPU:
                   //                                   three planes q [T, q_dim], k, v [T, kv_dim]
  Tensor attn;     // [max_tokens, q_dim]               attention output, o_proj's input
  Tensor delta;    // [max_tokens, hidden]              a sublayer's output (o_proj, then down_proj):
                   //                                   what it adds to the residual stream
  Tensor gate_up;  // [max_tokens * 2 * intermediate]   CUDA rows [gate | up]; CPU planes gate, up
  Tensor act;      // [max_tokens, intermediate]        silu(gate) * up, down_proj's input
  // The last stage runs only on the rows whose logits are wanted: capacity max_logits_rows.
  Tensor out_hidden;  // [max_logits_rows, hidden]         h of those rows
  Tensor out_delta;   // [max_logits_rows, hidden]         the last layer's MLP output of those rows
  Tensor out_normed;  // [max_logits_rows, hidden]         rmsnorm(h + delta) * final_norm
  Tensor logits;      // F32 [max_logits_rows, vocab]
  // FP8 checkpoints on CUDA only (config.quantization): the activations of a projection quantized per token for
  // lesson 16's FP8 tensor-core GEMM (install_fp8_gemm). Empty otherwise.
  Tensor fp8_codes;   // F8_E4M3 [max_tokens, max(hidden, q_dim, intermediate)]   a GEMM input's codes
  Tensor fp8_scales;  // F32 [max_tokens]                                           one scale per token
  // Constant per engine, sized by the same limits.
  RopeTable rope;                           // cos/sin for positions < max_context (on the GPU for CUDA)
  std::unique_ptr<BadTokenFlag> bad_token;  // CUDA: where the embedding records an id outside the vocabulary

 private:
  Device device_ = Device::CPU;
  EngineLimits limits_;
};

// ---- the per-step inputs ------------------------------------------------------------------------------

// One step: B sequences, sequence b bringing q_len[b] new tokens on top of k_len[b] - q_len[b] tokens it
// already has (0 for a prompt's first step). Tokens are packed sequence after sequence (varlen):
//
//   q_lens {3, 1}  k_lens {3, 7}   token_ids/positions: [a0 a1 a2 | b6]   positions 0 1 2 | 6
//
// positions are derived here (query i of sequence b sits at k_len[b] - q_len[b] + i), never taken from
// the caller, so they always agree with what attention assumes. logits_rows names the rows (in [0, T)) whose
// logits forward() returns, in that order: one per sequence when generating, all of them when checking a
// prompt token by token.
//
// Device buffers (fixed addresses) and a pinned staging buffer are allocated once in the constructor.
// set() validates on the host (InputError, leaving the previous step intact), fills the staging buffer and
// queues ONE set of async copies on the caller's stream. Before it overwrites the staging buffer it waits
// for the previous step's copies to have read it (an event): the host may run ahead of the GPU by one step
// but never scribbles over bytes a copy is still reading. Do not call set() during a graph capture.
class StepInputs {
 public:
  StepInputs(const ModelConfig& config, const EngineLimits& limits, Device device);
  ~StepInputs();
  StepInputs(const StepInputs&) = delete;
  StepInputs& operator=(const StepInputs&) = delete;

  void set(const std::vector<int32_t>& token_ids, const std::vector<int64_t>& q_lens,
           const std::vector<int64_t>& k_lens, const std::vector<int32_t>& logits_rows,
           cudaStream_t stream = nullptr);
  // Whole prompts, each starting at position 0; logits for every token (all_rows) or each prompt's last.
  void set_prompts(const std::vector<std::vector<int32_t>>& prompts, bool all_rows,
                   cudaStream_t stream = nullptr);

  Device device() const { return device_; }
  const EngineLimits& limits() const { return limits_; }
  int64_t num_tokens() const { return tokens_; }     // T
  int64_t num_logits_rows() const { return rows_; }  // R
  int num_sequences() const { return batch_.batch_size(); }
  // Views on the step's device (host views on the CPU), valid until the next set().
  TensorView token_ids() const;    // I32 [T]
  TensorView positions() const;    // I32 [T]
  TensorView logits_rows() const;  // I32 [R]
  // The same values on the host (the staging buffer), for checks and for the CPU path.
  const int32_t* host_token_ids() const;
  const int32_t* host_positions() const;
  const int32_t* host_logits_rows() const;
  // Per-sequence layout (cu_seqlens_q/k on host and device): what the attention kernels read.
  const AttentionBatch& batch() const { return batch_; }

 private:
  int32_t* staging(int64_t offset) const;
  int64_t vocab_ = 0;
  EngineLimits limits_;
  Device device_ = Device::CPU;
  AttentionBatch batch_;
  // Both buffers, I32: token ids [max_tokens] | positions [max_tokens] | logits rows [max_logits_rows]
  HostBuffer staging_;  // pinned on CUDA (async copies need it), pageable on the CPU
  DeviceBuffer device_buffer_;
  cudaEvent_t copied_ = nullptr;  // recorded after each step's copies
  bool copy_pending_ = false;
  int64_t tokens_ = 0, rows_ = 0;
};

// ---- the execution context ------------------------------------------------------------------------

class ExecContext;
class AttentionBackend;

// The forward pass a context runs (same contract as forward() below). Lesson 08's is forward_composed(); a
// later lesson may install a faster one (lesson 14's fused decode path) without editing the loops that call
// forward().
using ForwardFn = TensorView (*)(ExecContext& ctx, const ModelWeights& weights, const StepInputs& step,
                                 AttentionBackend& backend);

// How the owner of a generation loop (lesson 10's Generator, lesson 11's Engine) launches one step's device
// work once the step's inputs are set: `work` queues forward() and the sampler on ctx.stream(). Without a
// launcher the work simply runs (eagerly). Lesson 14's graph runner is one: it replays decode steps as CUDA
// graphs captured from `work`.
class StepLauncher {
 public:
  virtual ~StepLauncher() = default;
  virtual void launch(ExecContext& ctx, const StepInputs& step, AttentionBackend& backend,
                      const std::function<void()>& work) = 0;
  // How many sequences a pure decode step of num_sequences should be launched with: more than num_sequences when
  // the launcher replays padded buckets (lesson 14); the loop then adds harmless rows whose results it ignores
  // (lesson 11's Engine does). A loop that does not pad may ignore it: the launcher copes with any B.
  virtual int64_t padded_batch(int64_t num_sequences) const { return num_sequences; }
};

// What a step runs with. CUDA: a non-blocking stream of its own, the ONE cuBLAS handle (common/cublas.h)
// bound to that stream, and the workspace. CPU: the workspace only.
class ExecContext {
 public:
  ExecContext(const ModelConfig& config, const EngineLimits& limits, Device device);

  Device device() const { return device_; }
  cudaStream_t stream() const { return stream_ ? stream_->get() : nullptr; }
  CublasHandle* cublas() { return cublas_ ? &*cublas_ : nullptr; }
  // Which of lesson 06's versions runs every projection and the lm_head on CUDA: v5 (cuBLAS) unless set.
  // v7 makes each token's results independent of the rest of its step (lesson 11's batch invariance).
  MatmulKernel matmul_kernel() const { return matmul_kernel_; }
  void set_matmul_kernel(MatmulKernel kernel);
  Workspace& workspace() { return workspace_; }
  const EngineLimits& limits() const { return workspace_.limits(); }
  // Waits for everything queued on the stream (CPU: nothing to wait for).
  void synchronize() const;
  // CUDA: reads the embedding's bad-token flag (waiting for the stream) and throws InputError naming the
  // first token id outside the vocabulary since the last check. StepInputs already refuses such ids on the
  // host, so this is the second line of defence; call it where you synchronise anyway.
  void check_tokens();

  // ---- the seams later lessons plug into (lesson 14) ----
  // The forward pass forward() runs: nullptr (the default) is lesson 08's forward_composed().
  void set_forward(ForwardFn fn) { forward_ = fn; }
  ForwardFn forward_fn() const { return forward_; }
  // The step launcher: nullptr (the default) runs each step's work eagerly.
  void set_launcher(std::unique_ptr<StepLauncher> launcher);
  StepLauncher* launcher() const { return launcher_.get(); }
  // Launches one step's device work through the launcher, or runs it now.
  void launch(const StepInputs& step, AttentionBackend& backend, const std::function<void()>& work);

 private:
  Device device_;
  std::optional<CudaStream> stream_;
  std::optional<CublasHandle> cublas_;
  Workspace workspace_;
  MatmulKernel matmul_kernel_ = kDefaultMatmulKernel;
  ForwardFn forward_ = nullptr;
  std::unique_ptr<StepLauncher> launcher_;
};

// ---- FP8 tensor-core GEMMs: the seam lesson 16 plugs into ----------------------------------------------
// y = x W^T for an FP8-resident weight (w F8_E4M3 codes [N, K], scale F32 [N]) read as it is, activations
// quantized on the fly (ctx.workspace().fp8_codes / fp8_scales). Returns false when it declines (a layout rule,
// no algorithm, --fp8-gemm dequantize): the forward then dequantizes the weight (weight_for_gemm) and runs
// lesson 06's bf16 GEMM, as it does for steps of fewer than min_tokens tokens. Queued on ctx.stream(), no
// allocation, no synchronisation. Nothing installed (the default): always the dequantize path.
using Fp8GemmFn = bool (*)(ExecContext& ctx, const TensorView& y, const TensorView& x, const TensorView& w,
                           const TensorView& scale);
void install_fp8_gemm(Fp8GemmFn fn, int64_t min_tokens);  // null uninstalls; published atomically
Fp8GemmFn installed_fp8_gemm();
int64_t installed_fp8_gemm_min_tokens();

// ---- the gated MLP in one kernel: the seam lesson 15 plugs into -----------------------------------------
// act [T, I] = silu(x Wg^T) * (x Wu^T) from the packed w_gate_up [2I, K] in ONE kernel: a GEMM whose epilogue
// applies the SiLU·mul, so the [T, 2I] product is never written and read back (lesson 15, step 8). The forward
// asks it (decoder_layer, step 7) for CUDA steps of at least min_tokens tokens with lesson 06's default kernel
// (never in batch-invariant mode: v8's promise is about every T), packed BF16 gate|up weights and no MLP bias. It
// rounds as project_gate_up + silu_mul do and returns false when it declines (a layout rule, another GPU): the
// two ops then run. Queued on `stream`, no allocation, no synchronisation. Nothing installed: always the two ops.
using GatedMlpFn = bool (*)(const TensorView& act, const TensorView& x, const TensorView& w_gate_up,
                            cudaStream_t stream);
void install_gated_mlp(GatedMlpFn fn, int64_t min_tokens);  // null uninstalls; published atomically
GatedMlpFn installed_gated_mlp();
int64_t installed_gated_mlp_min_tokens();

// CPU only: a transform every projection's input goes through before its GEMM (out: x's shape, contiguous F32),
// for lesson 16's accuracy measurement, which simulates the FP8 GEMM's per-token activation quantization with it
// (quantize, then decode). Nothing installed (the default): the inputs as they are. Not for CUDA steps.
using CpuActivationTransform = void (*)(const TensorView& out, const TensorView& x);
void install_cpu_activation_transform(CpuActivationTransform fn);  // null uninstalls
CpuActivationTransform installed_cpu_activation_transform();

// ---- attention: the seam -------------------------------------------------------------------------

class AttentionBackend {
 public:
  virtual ~AttentionBackend() = default;
  // Layer `layer` of the current step: q [T, q_dim] and this step's NEW keys and values k, v [T, kv_dim]
  // (after RoPE; on CUDA column views of the fused QKV buffer, with its row stride) -> out [T, q_dim],
  // causal over each sequence's context as step.batch() describes it. A cache backend stores k, v first and
  // attends over everything the sequence has. Queued on `stream`; no allocation, no synchronisation.
  virtual void attend(int layer, const TensorView& q, const TensorView& k, const TensorView& v,
                      const TensorView& out, const StepInputs& step, cudaStream_t stream) = 0;
  // Decode steps (one query per sequence): split every sequence's keys into exactly num_splits parts (0, the
  // default: the backend picks from this step's context lengths). A CUDA graph keeps the launch shapes it was
  // captured with, so lesson 14's graph runner pins the split count for a graph's whole life. Backends
  // without a split decode kernel (prefill only) ignore it.
  virtual void pin_decode_splits(int /*num_splits*/) {}
  // Decode steps whose new keys and values the kernel that computes them stores itself (lesson 14: the qkv GEMV's
  // epilogue, kv_store.h). kv_store() says where this layer's rows go and runs the checks attend()'s write would
  // run; false when this backend or this step has no such store (not a decode step, a backend without a cache):
  // then call attend() as usual. After `true`, the caller stores k and v as described and calls attend_stored(),
  // which is attend() without the write. Prefill-only backends keep the defaults.
  virtual bool kv_store(int /*layer*/, const StepInputs& /*step*/, KvStore* /*store*/) { return false; }
  virtual void attend_stored(int layer, const TensorView& q, const TensorView& out, const StepInputs& step,
                             cudaStream_t stream);
  // Prefill steps with no cached prefix: ask the installed fresh-prefill kernel first (lesson 07's
  // try_fresh_prefill; lesson 15 installs one on Hopper). Off by default; the backend's own kernel runs when
  // it is off, when none is installed or when the kernel declines the step.
  void set_fast_prefill(bool on) { fast_prefill_ = on; }
  bool fast_prefill() const { return fast_prefill_; }

 protected:
  bool fast_prefill_ = false;
};

// Prefill only: each sequence attends to its own new tokens, nothing before them (k_len == q_len for every
// sequence, else InputError: that step needs a KV cache, lesson 10). Lesson 07's attention() on the views.
class PrefillAttention final : public AttentionBackend {
 public:
  // CUDA: kernel V2Flash (no workspace memory) or V1Materialized (scores sized for the limits; needs the
  // context's CublasHandle).
  PrefillAttention(const ModelConfig& config, const EngineLimits& limits, Device device,
                   AttentionKernel kernel = AttentionKernel::V2Flash, CublasHandle* cublas = nullptr);
  void attend(int layer, const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
              const StepInputs& step, cudaStream_t stream) override;

 private:
  AttentionShape shape_;
  AttentionKernel kernel_;
  std::optional<AttentionWorkspace> workspace_;  // CUDA only
};

// ---- the forward pass -------------------------------------------------------------------------------

// logits of the step's logits_rows: F32 [step.num_logits_rows(), vocab] on ctx's device, a view into the
// workspace valid until the next forward(). ctx, weights and step must be on one device, step within the
// context's limits (InputError). CUDA: queued on ctx.stream(); ctx.synchronize() before reading the logits.
// Runs the context's forward function (ctx.set_forward), lesson 08's forward_composed() unless one is set.
TensorView forward(ExecContext& ctx, const ModelWeights& weights, const StepInputs& step,
                   AttentionBackend& backend);

// Lesson 08's forward pass: the model composed of lessons 03-07's ops, one kernel (or GEMM) per op. Faster
// forward functions fall back to it for the steps they do not handle.
TensorView forward_composed(ExecContext& ctx, const ModelWeights& weights, const StepInputs& step,
                            AttentionBackend& backend);

// The checks every forward function makes before it queues anything: one device, the step within the
// workspace's limits, a non-empty step (InputError).
void check_forward_args(ExecContext& ctx, const ModelWeights& weights, const StepInputs& step);

// Matmul FLOPs of one forward step (2 per multiply-add): the projections of every token, attention's
// causal score and value products, and the lm_head of the logits rows. For the benchmark's TFLOP/s.
double forward_flops(const ModelConfig& config, const std::vector<int64_t>& q_lens,
                     const std::vector<int64_t>& k_lens, int64_t logits_rows);

}  // namespace tvllm
