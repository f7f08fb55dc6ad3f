// Lesson 07: causal grouped-query attention for a batch of sequences, each with its own number of new
// queries and of keys.
//
//   out[t, h] = sum_{j <= pos(t)} softmax_j( q[t,h] . k[j, h/group] * scale ) * v[j, h/group]
//
// for head h, scale = 1/sqrt(head_dim). With a sliding window W > 0 (Mistral; AttentionShape::window) the
// sum runs over pos(t) - W < j <= pos(t) only: a query sees at most the last W positions, itself included. Sequence b has q_len[b] new queries and k_len[b] >= q_len[b]
// keys. Its queries are the LAST q_len[b] tokens of its context: query i (0-based within the sequence)
// sits at position pos = k_len[b] - q_len[b] + i and sees keys 0..pos (causal, "bottom-right aligned",
// as FlashAttention's varlen API). Prefill is q_len == k_len; a chunk of a long prompt after earlier
// chunks, or a decode step (q_len == 1), has q_len < k_len.
//
// Queries and outputs are packed one sequence after another along the token axis ("varlen"), and so
// are keys and values on this lesson's contiguous path:
//
//   q_len {3, 1, 4}   cu_seqlens_q {0, 3, 4, 8}     q, out rows [cu_seqlens_q[b], cu_seqlens_q[b+1])
//   k_len {3, 6, 4}   cu_seqlens_k {0, 3, 9, 13}    k, v   rows [cu_seqlens_k[b], cu_seqlens_k[b+1])
//   q, out [T_q, n_heads * head_dim]     head h at columns [h*head_dim, (h+1)*head_dim)
//   k, v   [T_k, n_kv_heads * head_dim]
//
// Every view is 2-D with unit column stride and any row stride >= its width: q, k and v may be column
// slices of one fused QKV buffer (split_qkv). On the CPU everything is fp32 (the reference); on the GPU
// q/k/v/out are bf16 and every score, softmax and sum is fp32.
//
// Two GPU versions (README.md tells the whole story):
//   v1  materialised: S = Q K^T * scale in an fp32 workspace [n_heads, q_len, k_len] (cuBLAS), a causal
//       row softmax kernel, then P V (cuBLAS). Simple, but its workspace grows as q_len * k_len.
//   v2  flash-style (flash_attention.cuh): one block per (sequence, head, tile of 64 queries) streams K/V
//       tiles through shared memory with an online softmax, on tensor cores. No score buffer at all. It
//       reaches keys and values through an addressing policy, so the KV caches of lessons 10 and 12 reuse
//       the same kernel with a policy of their own.
//
// No call allocates, synchronises or creates a handle: AttentionBatch and AttentionWorkspace allocate
// once, in their constructors. Every GPU entry point takes the stream it runs on, last.
//
// This header is included by .cu files: C++17 only.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/buffer.h"
#include "common/errors.h"
#include "common/tensor.h"

namespace tvllm {

struct ModelConfig;  // model_config.h (lesson 01)
class CublasHandle;  // common/cublas.h

enum class AttentionKernel { V1Materialized, V2Flash };
std::string_view attention_kernel_name(AttentionKernel kernel);     // "v1", "v2"
AttentionKernel parse_attention_kernel(std::string_view name);      // throws InputError

// The head layout of one attention layer.
struct AttentionShape {
  int64_t n_heads = 0;     // query heads
  int64_t n_kv_heads = 0;  // key/value heads; query head h reads kv head h / group_size()
  int64_t head_dim = 0;
  // Sliding window (Mistral's sliding_window): a query at position pos sees keys pos - window < j <= pos, at
  // most `window` of them, itself included. 0 = no window (every key 0..pos).
  int64_t window = 0;

  static AttentionShape from_config(const ModelConfig& config);
  int64_t q_dim() const { return n_heads * head_dim; }
  int64_t kv_dim() const { return n_kv_heads * head_dim; }
  int64_t qkv_dim() const { return q_dim() + 2 * kv_dim(); }  // width of a fused QKV row
  int64_t group_size() const { return n_kv_heads > 0 ? n_heads / n_kv_heads : 0; }
  double scale() const;  // 1 / sqrt(head_dim)
  // The first key a query at position `pos` sees: 0 without a window, else max(0, pos - window + 1).
  int64_t first_key(int64_t pos) const { return window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0; }
  // Throws InputError unless every count is positive, n_heads is a multiple of n_kv_heads and window >= 0.
  void validate() const;
  bool operator==(const AttentionShape& o) const {
    return n_heads == o.n_heads && n_kv_heads == o.n_kv_heads && head_dim == o.head_dim && window == o.window;
  }
};

// q, k and v as views into one fused projection output qkv [T, qkv_dim()] (columns: q | k | v, the
// layout of lesson 08's packed QKV weight). No copy: each view has qkv's row stride.
struct QkvViews {
  TensorView q, k, v;
};
QkvViews split_qkv(const TensorView& qkv, const AttentionShape& shape);

// Kept while lesson 08 still calls it: the same as t.columns(begin, count) (common/tensor.h).
inline TensorView column_slice(const TensorView& t, int64_t begin, int64_t count) { return t.columns(begin, count); }

// The layout of a batch: per sequence, its new queries and its keys, as prefix sums. Keeps them on the
// host (for loops, checks and launch shapes) and, for Device::CUDA, in device arrays the kernels read.
//
// Made once with a capacity, then refilled for every batch (every step of an engine): the device arrays
// and a pinned staging buffer are allocated in the constructor; set_*() validates on the host and starts
// one asynchronous copy on the caller's stream. Every layer of a step reuses the same batch. Set it on
// the stream that runs the attention (the copy is ordered before the kernels that read it), and never
// while a CUDA graph is being captured (a graph replays the kernels over the arrays as they are).
// Move-only (it owns device memory).
class AttentionBatch {
 public:
  // The most sequences one batch may hold (the kernels put them on the grid's z axis).
  static constexpr int64_t kMaxSequences = 65535;

  AttentionBatch() = default;  // capacity 0: set_*() throws. Use the constructor below.
  // Room for up to `max_sequences` sequences. Throws InputError for a bad capacity, CudaError if the
  // device or pinned memory cannot be had.
  AttentionBatch(int64_t max_sequences, Device device);
  ~AttentionBatch();
  AttentionBatch(AttentionBatch&& other) noexcept;
  AttentionBatch& operator=(AttentionBatch&& other) noexcept;
  AttentionBatch(const AttentionBatch&) = delete;
  AttentionBatch& operator=(const AttentionBatch&) = delete;

  // From per-sequence counts: q_lens[b] >= 0 new queries, k_lens[b] >= q_lens[b] keys.
  void set_lengths(const std::vector<int64_t>& q_lens, const std::vector<int64_t>& k_lens,
                   cudaStream_t stream = nullptr);
  // Prefill: every token of every sequence is a query (q_len == k_len == lengths[b]).
  void set_prefill(const std::vector<int64_t>& lengths, cudaStream_t stream = nullptr);
  // From prefix sums: B+1 entries each, starting at 0, never decreasing, k_len[b] >= q_len[b].
  void set_cu_seqlens(const std::vector<int32_t>& cu_seqlens_q, const std::vector<int32_t>& cu_seqlens_k,
                      cudaStream_t stream = nullptr);
  // Every set_*() throws InputError naming the first bad entry (or the capacity) and leaves the batch as
  // it was.

  // One-shot helpers for tests and the lesson executable (they allocate: not for a step loop).
  static AttentionBatch prefill(const std::vector<int64_t>& lengths, Device device);
  static AttentionBatch with_lengths(const std::vector<int64_t>& q_lens, const std::vector<int64_t>& k_lens,
                                     Device device);

  Device device() const { return device_; }
  int64_t capacity() const { return capacity_; }
  int batch_size() const { return cu_q_.empty() ? 0 : static_cast<int>(cu_q_.size()) - 1; }
  int64_t total_q() const { return cu_q_.empty() ? 0 : cu_q_.back(); }    // rows of q and out
  int64_t total_k() const { return cu_k_.empty() ? 0 : cu_k_.back(); }    // rows of packed k and v
  int32_t max_q_len() const { return max_q_len_; }
  int32_t max_k_len() const { return max_k_len_; }
  int32_t q_begin(int b) const { return cu_q_.at(b); }
  int32_t q_len(int b) const { return cu_q_.at(b + 1) - cu_q_.at(b); }
  int32_t k_begin(int b) const { return cu_k_.at(b); }
  int32_t k_len(int b) const { return cu_k_.at(b + 1) - cu_k_.at(b); }
  const std::vector<int32_t>& cu_seqlens_q() const { return cu_q_; }  // host, [B+1]
  const std::vector<int32_t>& cu_seqlens_k() const { return cu_k_; }  // host, [B+1]
  // Device arrays [B+1] (fixed addresses for the batch's lifetime); null on the CPU.
  const int32_t* cu_seqlens_q_device() const;
  const int32_t* cu_seqlens_k_device() const;

 private:
  void release() noexcept;
  std::vector<int32_t> cu_q_, cu_k_;  // [B+1] each; capacity reserved up front
  int64_t capacity_ = 0;
  Device device_ = Device::CPU;
  int32_t max_q_len_ = 0, max_k_len_ = 0;
  DeviceBuffer device_arrays_;  // I32 [2, capacity+1]: cu_seqlens_q, then cu_seqlens_k
  HostBuffer staging_;          // pinned, same layout: the source of the async copy
  cudaEvent_t copied_ = nullptr;  // recorded after each copy: staging_ may be refilled once it fired
  bool copy_recorded_ = false;
};

// The most an engine will ever ask of one attention call; a workspace is sized from them, once.
struct AttentionLimits {
  int64_t max_sequences = 1;  // sequences per batch
  int64_t max_q_len = 0;      // new queries of one sequence
  int64_t max_k_len = 0;      // keys of one sequence (its whole context)
};

// Extra device memory (beyond q, k, v, out) a kernel needs for any batch within `limits`:
//   v1: n_heads * max_q_len * max_k_len * 4 bytes (the fp32 scores of the largest sequence; sequences
//       take turns in it), v2: 0.
size_t attention_workspace_bytes(AttentionKernel kernel, const AttentionShape& shape, const AttentionLimits& limits);

// What the GPU paths reuse from call to call, sized once from the shape and the limits: v1's scores and
// the cuBLAS handle v1 runs on (caller-owned: one CublasHandle for the whole engine, common/cublas.h).
// A workspace made for v1 also serves v2 (which uses none of it). Never grows: a batch beyond the
// limits is an InputError naming the limit. Move-only.
class AttentionWorkspace {
 public:
  // kernel V1Materialized: allocates the scores now (CudaError naming the size if they do not fit) and
  // needs `cublas`. V2Flash: allocates nothing; `cublas` may be null.
  AttentionWorkspace(const AttentionShape& shape, const AttentionLimits& limits, AttentionKernel kernel,
                     CublasHandle* cublas = nullptr);
  AttentionWorkspace(AttentionWorkspace&&) noexcept = default;
  AttentionWorkspace& operator=(AttentionWorkspace&&) noexcept = default;

  const AttentionShape& shape() const { return shape_; }
  const AttentionLimits& limits() const { return limits_; }
  AttentionKernel kernel() const { return kernel_; }
  void* scratch() const { return scratch_.data(); }
  size_t scratch_bytes() const { return scratch_.bytes(); }
  CublasHandle* cublas() const { return cublas_; }
  // InputError unless `kernel` may run `batch` of `shape` in this workspace (names the limit exceeded).
  void check(const AttentionBatch& batch, const AttentionShape& shape, AttentionKernel kernel) const;

 private:
  AttentionShape shape_;
  AttentionLimits limits_;
  AttentionKernel kernel_ = AttentionKernel::V2Flash;
  DeviceBuffer scratch_;
  CublasHandle* cublas_ = nullptr;
};

// Causal GQA attention over a batch.
//   q, out [batch.total_q(), n_heads*head_dim]; k, v [batch.total_k(), n_kv_heads*head_dim]
// CPU views: F32 (the reference; `kernel`, `workspace` and `stream` are ignored). CUDA views: BF16, rows
// 16-byte aligned (data and row stride), head_dim a multiple of 8 (v2: up to 256). v1 needs a workspace
// made for v1; v2 needs none (when one is given, the batch is checked against its limits).
// Runs on `stream`; returns without waiting. Throws InputError on a bad shape, dtype, device, stride or
// batch (before anything is launched); CudaError if the GPU fails.
void attention(const TensorView& out, const TensorView& q, const TensorView& k, const TensorView& v,
               const AttentionBatch& batch, const AttentionShape& shape,
               AttentionKernel kernel = AttentionKernel::V2Flash, AttentionWorkspace* workspace = nullptr,
               cudaStream_t stream = nullptr);

// ---- the seam for a faster prefill kernel (lesson 15 fills it on Hopper) ---------------------------------------
// A prefill step with no cached prefix (every sequence's keys are exactly its new tokens: cu_seqlens_k ==
// cu_seqlens_q) can attend over the step's own q, k and v rows, as attention() above does, instead of reading the
// rows back from a KV cache. Lessons 08, 10 and 12 ask try_fresh_prefill() first when their backend's
// set_fast_prefill(true) was called; lesson 15 installs a kernel through install_fresh_prefill(). Lesson 07 cannot
// link lesson 15, hence a function pointer (the same kind of seam as lesson 10's install_fast_decode).
// The kernel returns false when it declines (a head_dim it lacks, another GPU): the caller then runs its own.
using FreshPrefillFn = bool (*)(const TensorView& out, const TensorView& q, const TensorView& k,
                                const TensorView& v, const AttentionBatch& batch, const AttentionShape& shape,
                                cudaStream_t stream);
void install_fresh_prefill(FreshPrefillFn fn);  // idempotent; published atomically; null uninstalls
FreshPrefillFn installed_fresh_prefill();        // null until someone installs one
// Whether a batch is a fresh prefill: at least one sequence of more than one query, and every sequence's keys are
// exactly its queries.
bool is_fresh_prefill(const AttentionBatch& batch);
// Runs the installed kernel when the batch is a fresh prefill on the GPU and the kernel accepts it; false
// (nothing launched) otherwise.
bool try_fresh_prefill(const TensorView& out, const TensorView& q, const TensorView& k, const TensorView& v,
                       const AttentionBatch& batch, const AttentionShape& shape, cudaStream_t stream);

// The two paths behind attention() (arguments already validated).
void attention_cpu(const TensorView& out, const TensorView& q, const TensorView& k, const TensorView& v,
                   const AttentionBatch& batch, const AttentionShape& shape);
void attention_cuda(const TensorView& out, const TensorView& q, const TensorView& k, const TensorView& v,
                    const AttentionBatch& batch, const AttentionShape& shape, AttentionKernel kernel,
                    AttentionWorkspace* workspace, cudaStream_t stream);

// The query side of every path, checked once (also by lessons 10 and 12 before they launch the flash
// kernel with a KV policy of their own): shape, batch, q and out. InputError naming the problem.
void check_attention_queries(const TensorView& out, const TensorView& q, const AttentionBatch& batch,
                             const AttentionShape& shape);

// Whether v2 runs this head_dim (any multiple of 8 from 8 to 256), and how (for printing): "tensor
// cores, 64-wide tiles", "tensor cores, 128-wide tiles (head_dim 96 zero-padded)", "CUDA cores (head_dim
// > 128)".
bool flash_supports_head_dim(int64_t head_dim);
std::string flash_path(int64_t head_dim);

}  // namespace tvllm
