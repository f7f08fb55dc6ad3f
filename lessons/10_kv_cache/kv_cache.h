// Lesson 10: the contiguous KV cache and the attention that reads it.
//
// Prefill computes k and v for every token of a prompt; decode adds ONE token per step. Without a cache a
// decode step would recompute k and v of the whole prefix (lesson 08's PrefillAttention: O(n) work per token,
// O(n^2) per sequence). With one, each layer stores the k, v rows it computes once, and a step only reads
// them back:
//
//   cache of one layer, k (v the same)       [num_slots][max_context][n_kv_heads][head_dim]
//
//        slot 0  | pos 0 | pos 1 | pos 2 | ... | pos max_context-1 |     a slot is one sequence's row:
//        slot 1  | pos 0 | pos 1 |  ...                              |     position p of the sequence in
//        ...                                                               slot s sits at s*max_context + p
//   each "pos" box: n_kv_heads * head_dim values (bf16 on CUDA, fp32 on the CPU), kv head h at [h*D, (h+1)*D)
//
// Three ops, each on the device of its views (CPU = fp32, the reference; CUDA = bf16 with fp32 math):
//   kv_cache_write        this step's new k, v rows -> the cache, at their positions (k_len - q_len + i)
//   cached_attention      the step's queries over everything their sequences have in the cache:
//                           every q_len == 1 (decode)  decode_attention: one query per sequence, split over
//                                                      the context (flash-decoding) + a combine kernel
//                           otherwise (prefill, chunks) lesson 07's flash kernel with the CacheKV policy
//
// (Choosing the next token from the logits is lesson 09's sampler: generate.h uses it.)
//
// Which slot each sequence of a step uses comes from a CacheSlots (per-sequence slot ids, like
// AttentionBatch: allocated once, refilled with one async copy). The per-sequence lengths come from the
// step's AttentionBatch. No op allocates, synchronises or creates a handle; every GPU entry point takes its
// stream last, and every grid depends only on host values a CUDA graph can keep fixed (README "Graphs").
//
// This header is included by .cu files: C++17 only.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "attention.h"
#include "common/buffer.h"
#include "common/tensor.h"

namespace tvllm {

struct ModelConfig;  // model_config.h (lesson 01)

// ---- the cache -----------------------------------------------------------------------------------------

// k and v of every layer, for num_slots sequences of up to max_context positions each: ONE allocation,
// sized in the constructor and never again. Layer l's k is [num_slots, max_context, kv_dim] at
// layer_bytes() * 2l, its v right after. Move-only.
class KvCache {
 public:
  // What a cache of this size takes: layers * 2 * slots * max_context * kv_dim * (2 bytes on CUDA, 4 on the CPU).
  static size_t bytes_for(const AttentionShape& shape, int64_t num_layers, int64_t num_slots, int64_t max_context,
                          Device device);

  KvCache() = default;
  // Throws InputError for a bad size (naming it) and, on CUDA, when the cache would not fit in the GPU's
  // free memory (naming both sizes and the way out: fewer slots or a shorter context); CudaError if the
  // allocation itself fails. The memory is not initialised: a position is read only after it was written.
  KvCache(const AttentionShape& shape, int64_t num_layers, int64_t num_slots, int64_t max_context, Device device);
  // The shape and the number of layers from the config.
  static KvCache for_model(const ModelConfig& config, int64_t num_slots, int64_t max_context, Device device);

  const AttentionShape& shape() const { return shape_; }
  int64_t num_layers() const { return num_layers_; }
  int64_t num_slots() const { return num_slots_; }
  int64_t max_context() const { return max_context_; }
  Device device() const { return device_; }
  DType dtype() const { return device_ == Device::CUDA ? DType::BF16 : DType::F32; }
  size_t bytes() const { return bytes_; }
  size_t layer_bytes() const { return bytes_ / static_cast<size_t>(2 * num_layers_); }  // one of k or v of a layer
  // Bytes of k and v of ONE position of ONE sequence in all layers: what a decode step reads per token of context.
  size_t bytes_per_token() const;
  // [num_slots, max_context, kv_dim] views of layer `layer` (contiguous).
  TensorView k(int layer) const;
  TensorView v(int layer) const;
  // "KV cache: 2 layers x 2 (k, v) x 4 slots x 128 positions x 128 (2 kv heads x 64) x bf16 = 512.0 KiB"
  std::string describe() const;

 private:
  AttentionShape shape_;
  int64_t num_layers_ = 0, num_slots_ = 0, max_context_ = 0;
  Device device_ = Device::CPU;
  size_t bytes_ = 0;
  DeviceBuffer device_storage_;
  HostBuffer host_storage_;
};

// ---- which slot each sequence of a step uses ---------------------------------------------------------------

// Per-sequence slot ids of a step, on the host and (CUDA) in a device array of fixed address. Made once with
// a capacity; set() validates (every id in [0, num_slots), no slot twice), fills a pinned staging buffer and
// queues one async copy on `stream` (waiting first, if needed, for the previous copy to have read the
// staging buffer). Like StepInputs: never call set() while a CUDA graph is being captured. Move-only.
class CacheSlots {
 public:
  CacheSlots() = default;
  CacheSlots(int64_t max_sequences, int64_t num_slots, Device device);
  ~CacheSlots();
  CacheSlots(CacheSlots&& other) noexcept;
  CacheSlots& operator=(CacheSlots&& other) noexcept;
  CacheSlots(const CacheSlots&) = delete;
  CacheSlots& operator=(const CacheSlots&) = delete;

  // Throws InputError (naming the entry) and leaves the previous slots in place.
  void set(const std::vector<int32_t>& slots, cudaStream_t stream = nullptr);

  Device device() const { return device_; }
  int64_t num_slots() const { return num_slots_; }
  int size() const { return static_cast<int>(host_.size()); }
  int32_t slot(int b) const { return host_.at(static_cast<size_t>(b)); }
  const std::vector<int32_t>& host() const { return host_; }
  const int32_t* device_slots() const { return slots_device_.as<int32_t>(); }  // [size()] on CUDA; null on the CPU

 private:
  void release() noexcept;
  std::vector<int32_t> host_;
  int64_t capacity_ = 0, num_slots_ = 0;
  Device device_ = Device::CPU;
  DeviceBuffer slots_device_;     // I32 [capacity]
  HostBuffer staging_;            // pinned: the source of the async copy
  cudaEvent_t copied_ = nullptr;  // recorded after each copy
  bool copy_recorded_ = false;
};

// ---- the ops -------------------------------------------------------------------------------------------

// Stores this step's new keys and values in the cache. k, v: [batch.total_q(), kv_dim] (column views of the
// fused QKV buffer are fine: any row stride); token i of sequence b goes to slot slots.slot(b), position
// k_len[b] - q_len[b] + i, in cache_k / cache_v (one layer: KvCache::k(layer), v(layer)). CUDA: bf16, rows
// 16-byte aligned. Throws InputError on a bad shape, device, batch or a position past the cache.
void kv_cache_write(const TensorView& cache_k, const TensorView& cache_v, const TensorView& k, const TensorView& v,
                    const AttentionBatch& batch, const CacheSlots& slots, const AttentionShape& shape,
                    cudaStream_t stream = nullptr);
// kv_cache_write's checks of the cache and the step (not of k and v), without the write: for a kernel that stores
// the new rows itself (lesson 14's qkv GEMV, through CachedAttention::kv_store).
void check_kv_cache_write(const TensorView& cache_k, const TensorView& cache_v, const AttentionBatch& batch,
                          const CacheSlots& slots, const AttentionShape& shape);

// The split-K scratch of decode attention, sized once: for up to max_sequences sequences of n_heads heads, up
// to kMaxDecodeSplits partial results (max, sum, head_dim outputs) each, fp32. CPU: nothing. Move-only.
class DecodeWorkspace {
 public:
  static constexpr int kMaxDecodeSplits = 64;
  DecodeWorkspace() = default;
  DecodeWorkspace(const AttentionShape& shape, int64_t max_sequences, Device device);
  int64_t max_sequences() const { return max_sequences_; }
  size_t bytes() const { return partials_.bytes(); }
  int num_sms() const { return num_sms_; }
  float* partials() const { return partials_.as<float>(); }
  // One counter per (sequence, head), zero between launches: lesson 14's decode kernel counts the splits of a
  // head that have written their partials, and the last of them combines (and puts the counter back to zero).
  int* split_arrivals() const { return arrivals_.as<int>(); }

 private:
  int64_t max_sequences_ = 0;
  int num_sms_ = 0;
  DeviceBuffer partials_;  // [max_sequences][n_heads][kMaxDecodeSplits][head_dim + 2]: o[head_dim], m, l
  DeviceBuffer arrivals_;  // [max_sequences][n_heads] int32, zeroed once here
};

// How many splits decode attention cuts each sequence's keys into: 1 for short contexts, otherwise enough
// blocks to fill `num_sms` SMs a few times over, at least kMinKeysPerSplit keys each, at most
// kMaxDecodeSplits. (Any count is correct for any context: it only decides how the work is shared.)
inline constexpr int kMinKeysPerSplit = 64;
int decode_splits(const AttentionShape& shape, int batch_size, int64_t max_k_len, int num_sms);

// How a step whose every sequence brings at most one token (a decode step) is attended:
//   Split  the decode kernel below, each sequence's keys cut into decode_splits() pieces: the fastest. But the
//          split count depends on the step's batch size, and a prompt's tokens go through the flash kernel
//          instead: a token's attention output may differ in its last bits with the company it keeps.
//   Flash  lesson 07's flash kernel for every step, the one prefill uses. A query row's sum runs over the
//          same key tiles in the same order whatever else is in the step and however its token arrived
//          (prompt, decode, chunk, recomputation): batch-invariant (lesson 11), slower at decode.
//   Fast   lesson 14's decode kernel (decode_attention_fast.cuh): the same split arithmetic as Split, read at
//          the memory roofline, with lesson 14's split count. It lives in lesson 14, which this library cannot
//          link: lesson 14 installs it through install_fast_decode() below, and asking for Fast before that is
//          an InputError that says so. Lesson 14's use_fast_path makes it the default of decode steps.
// On the CPU, Flash means the prefill reference (double precision) for every row; Fast and Split both mean
// decode_attention_cpu (the split reference: the kernels differ in speed, not in arithmetic).
enum class DecodeAttention { Split, Flash, Fast };

// Attention of the step's queries over the cache (keys 0..k_len[b]-1 of sequence b, already written, this
// step's included). q, out: [batch.total_q(), q_dim] (q may be a column view of the fused QKV buffer).
// Every q_len <= 1 and decode == Split or Fast: decode_attention with that kernel and decode_splits_for()
// (workspace needed on CUDA); otherwise the flash kernel over the cache (CUDA) or the double-precision
// reference (CPU). Throws InputError on a bad shape, device, batch (k_len past max_context, more sequences than
// slots) or head_dim.
void cached_attention(const TensorView& out, const TensorView& q, const TensorView& cache_k,
                      const TensorView& cache_v, const AttentionBatch& batch, const CacheSlots& slots,
                      const AttentionShape& shape, DecodeWorkspace* workspace, cudaStream_t stream = nullptr,
                      DecodeAttention decode = DecodeAttention::Split);

// Decode only (every q_len is 0 or 1), with an explicit split count (1..kMaxDecodeSplits; tests and the
// chapter's exercises use it). CPU: fp32, the same algorithm as the kernels (per-split max, sum and
// unnormalised output, then the combine), so it is the kernels' twin; CUDA: the decode + combine kernels,
// lesson 10's (kernel Split) or lesson 14's (kernel Fast, once installed). Flash is not a split kernel: InputError.
void decode_attention(const TensorView& out, const TensorView& q, const TensorView& cache_k,
                      const TensorView& cache_v, const AttentionBatch& batch, const CacheSlots& slots,
                      const AttentionShape& shape, int num_splits, DecodeWorkspace* workspace,
                      cudaStream_t stream = nullptr, DecodeAttention kernel = DecodeAttention::Split);

// ---- lesson 14's decode kernel, plugged in at run time ---------------------------------------------------
// Lessons build on the ones before them, never the other way: tvllm_l10 cannot call a kernel that lesson 14
// compiles. So lesson 10 names the seam and lesson 14 fills it: install_fast_decode() stores two function
// pointers (lesson 12 has the same seam for its pool, paged_kv.h), and decode_attention(..., Fast) calls them after
// its own checks. A function pointer rather than a virtual interface: there is exactly one implementation,
// installed once per process, and the call is one indirect jump on the host per layer.
struct FastDecodeKernel {
  // The split count for a decode step (the role decode_splits() plays for lesson 10's kernel).
  int (*splits)(const AttentionShape& shape, int batch_size, int64_t max_k_len, int num_sms) = nullptr;
  // The kernels over the contiguous cache, arguments already checked by decode_attention(). window: 0 = every
  // key; W > 0 = only the last W keys of each sequence (a sliding window; decode_attention passes shape.window).
  void (*contiguous)(const TensorView& out, const TensorView& q, const TensorView& cache_k, const TensorView& cache_v,
                     const AttentionBatch& batch, const CacheSlots& slots, const AttentionShape& shape, int num_splits,
                     int window, const DecodeWorkspace& workspace, cudaStream_t stream) = nullptr;
};
// Idempotent; thread-safe against concurrent readers (the pointers are published atomically).
void install_fast_decode(const FastDecodeKernel& kernel);
// What is installed (both pointers null until lesson 14 installs them).
FastDecodeKernel installed_fast_decode();
// The split count `decode` uses for a decode step: lesson 14's choice for Fast on CUDA (once installed),
// decode_splits() otherwise.
int decode_splits_for(DecodeAttention decode, const AttentionShape& shape, int batch_size, int64_t max_k_len,
                      int num_sms);

// ---- the paths behind the ops (arguments already checked) ----------------------------------------------

void kv_cache_write_cpu(const TensorView& cache_k, const TensorView& cache_v, const TensorView& k,
                        const TensorView& v, const AttentionBatch& batch, const CacheSlots& slots);
void kv_cache_write_cuda(const TensorView& cache_k, const TensorView& cache_v, const TensorView& k,
                         const TensorView& v, const AttentionBatch& batch, const CacheSlots& slots,
                         cudaStream_t stream);
// Prefill/chunks over the cache on the CPU: lesson 07's reference formula, double precision.
void cached_prefill_attention_cpu(const TensorView& out, const TensorView& q, const TensorView& cache_k,
                                  const TensorView& cache_v, const AttentionBatch& batch, const CacheSlots& slots,
                                  const AttentionShape& shape);
void cached_flash_attention_cuda(const TensorView& out, const TensorView& q, const TensorView& cache_k,
                                 const TensorView& cache_v, const AttentionBatch& batch, const CacheSlots& slots,
                                 const AttentionShape& shape, cudaStream_t stream);
void decode_attention_cpu(const TensorView& out, const TensorView& q, const TensorView& cache_k,
                          const TensorView& cache_v, const AttentionBatch& batch, const CacheSlots& slots,
                          const AttentionShape& shape, int num_splits);
void decode_attention_cuda(const TensorView& out, const TensorView& q, const TensorView& cache_k,
                           const TensorView& cache_v, const AttentionBatch& batch, const CacheSlots& slots,
                           const AttentionShape& shape, int num_splits, const DecodeWorkspace& workspace,
                           cudaStream_t stream);

}  // namespace tvllm
