// Lesson 07: causal grouped-query attention for a batch of prompts of different lengths.
//
//   out[t, h] = sum_{j <= i} softmax_j( q[t,h] . k[j, h/group] * scale ) * v[j, h/group]
//
// for token t = position i of its sequence, head h, scale = 1/sqrt(head_dim). The sequences are packed
// one after another along the token axis ("varlen"), described by cu_seqlens:
//
//   lengths    {3, 1, 4}
//   cu_seqlens {0, 3, 4, 8}       sequence b owns rows [cu_seqlens[b], cu_seqlens[b+1])
//   q          [T_total = 8, n_heads * head_dim]      head h at columns [h*head_dim, (h+1)*head_dim)
//   k, v       [T_total,     n_kv_heads * head_dim]
//   out        [T_total,     n_heads * head_dim]      (o_proj's input)
//
// A token only sees earlier tokens of ITS OWN sequence. On the CPU everything is fp32 (the reference);
// on the GPU q/k/v/out are bf16 and every score, softmax and sum is fp32.
//
// Two GPU versions (README.md tells the whole story):
//   v1  materialised: S = Q K^T * scale in an fp32 workspace [n_heads, n, n] (cuBLAS), a causal row
//       softmax kernel, then P V (cuBLAS). Simple, but its workspace grows as n^2.
//   v2  flash-style: one block per (sequence, head, tile of 64 queries) streams K/V tiles through
//       shared memory with an online softmax, on tensor cores (mma.sync). No n x n buffer at all.
//
// This header is included by .cu files: C++17 only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/errors.h"
#include "common/tensor.h"

namespace tvllm {

struct ModelConfig;  // model_config.h (lesson 01)

enum class AttentionKernel { V1Materialized, V2Flash };
std::string_view attention_kernel_name(AttentionKernel kernel);     // "v1", "v2"
AttentionKernel parse_attention_kernel(std::string_view name);      // throws InputError

// The head layout of one attention layer.
struct AttentionShape {
  int64_t n_heads = 0;     // query heads
  int64_t n_kv_heads = 0;  // key/value heads; query head h reads kv head h / group_size()
  int64_t head_dim = 0;

  static AttentionShape from_config(const ModelConfig& config);
  int64_t q_dim() const { return n_heads * head_dim; }
  int64_t kv_dim() const { return n_kv_heads * head_dim; }
  int64_t group_size() const { return n_kv_heads > 0 ? n_heads / n_kv_heads : 0; }
  double scale() const;  // 1 / sqrt(head_dim)
  // Throws InputError unless every count is positive and n_heads is a multiple of n_kv_heads.
  void validate() const;
};

// A batch of sequences packed along the token axis. Keeps cu_seqlens on the host (for loops and
// checks) and, for Device::CUDA, a device copy the kernels read. Built once per batch and reused by
// every layer (lesson 08 runs 16 layers on the same batch). Move-only (it owns device memory).
class VarlenBatch {
 public:
  // The most sequences one batch may hold (the flash kernel puts them on the grid's z axis).
  static constexpr int64_t kMaxSequences = 65535;

  VarlenBatch() = default;
  // From the sequence lengths (each >= 0; an empty sequence is allowed and produces nothing).
  static VarlenBatch from_lengths(const std::vector<int64_t>& lengths, Device device);
  // From prefix sums: cu_seqlens[0] == 0, never decreasing, B+1 entries for B >= 1 sequences.
  // Throws InputError naming the first bad entry.
  static VarlenBatch from_cu_seqlens(const std::vector<int32_t>& cu_seqlens, Device device);

  Device device() const { return device_; }
  int batch_size() const { return static_cast<int>(cu_seqlens_.size()) - 1; }
  int64_t total_tokens() const { return cu_seqlens_.empty() ? 0 : cu_seqlens_.back(); }
  int32_t max_seqlen() const { return max_seqlen_; }
  int32_t seq_begin(int b) const { return cu_seqlens_.at(b); }
  int32_t seq_len(int b) const { return cu_seqlens_.at(b + 1) - cu_seqlens_.at(b); }
  const std::vector<int32_t>& cu_seqlens() const { return cu_seqlens_; }   // host, [B+1]
  const int32_t* cu_seqlens_device() const;                                // device, [B+1]; null on CPU

 private:
  std::vector<int32_t> cu_seqlens_;  // [B+1]
  Tensor device_copy_;               // I32 [B+1] on cuda
  Device device_ = Device::CPU;
  int32_t max_seqlen_ = 0;
};

// Scratch memory and the cuBLAS handle the GPU paths reuse from call to call (a model keeps one, so
// its 16 layers do not cudaMalloc 16 times). Only v1 needs scratch: v2 needs none.
class AttentionWorkspace {
 public:
  AttentionWorkspace() = default;
  ~AttentionWorkspace();
  AttentionWorkspace(const AttentionWorkspace&) = delete;
  AttentionWorkspace& operator=(const AttentionWorkspace&) = delete;

  // At least `bytes` of device memory; grows (never shrinks). Throws CudaError naming the size.
  void* scratch(size_t bytes);
  size_t scratch_bytes() const { return scratch_.bytes(); }
  cublasHandle_t cublas();  // created on first use

 private:
  DeviceBuffer scratch_;
  cublasHandle_t cublas_ = nullptr;
};

// The extra device memory (beyond q, k, v, out) the kernel needs for this batch:
//   v1: n_heads * max_seqlen^2 * 4 bytes (the fp32 scores of the longest sequence; sequences take
//       turns in it), v2: 0.
size_t attention_workspace_bytes(AttentionKernel kernel, const VarlenBatch& batch, const AttentionShape& shape);

// Causal GQA attention over a varlen batch, prefill style (every token of every sequence is a query).
//   out [T, n_heads*head_dim], q [T, n_heads*head_dim], k/v [T, n_kv_heads*head_dim], T = batch.total_tokens()
// CPU views: F32 (the reference; `kernel` and `workspace` are ignored). CUDA views: BF16, contiguous,
// 16-byte aligned rows; head_dim 64 or 128 for v2. `workspace` may be null (a temporary one is made).
// Throws InputError on a bad shape, dtype, device or batch; CudaError if the GPU fails (e.g. v1's
// workspace does not fit).
void attention_prefill(const TensorView& out, const TensorView& q, const TensorView& k, const TensorView& v,
                       const VarlenBatch& batch, const AttentionShape& shape,
                       AttentionKernel kernel = AttentionKernel::V2Flash, AttentionWorkspace* workspace = nullptr);

// The two paths behind attention_prefill (arguments already validated).
void attention_prefill_cpu(const TensorView& out, const TensorView& q, const TensorView& k, const TensorView& v,
                           const VarlenBatch& batch, const AttentionShape& shape);
void attention_prefill_cuda(const TensorView& out, const TensorView& q, const TensorView& k, const TensorView& v,
                            const VarlenBatch& batch, const AttentionShape& shape, AttentionKernel kernel,
                            AttentionWorkspace& workspace);

// head_dims the flash kernel is compiled for (a template per size).
bool flash_supports_head_dim(int64_t head_dim);

}  // namespace tvllm
