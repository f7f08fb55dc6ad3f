// Lesson 12 on the GPU side: the paged KV pool and the attention that reads it.
//
// Lesson 10 gave every sequence a whole row of max_context positions. Here the cache is a POOL of small blocks
// of block_size positions, and a sequence holds a list of them, its block table (block_manager.h hands them
// out). Per layer, k (v the same):
//
//   pool_k [num_blocks][block_size][n_kv_heads][head_dim]          one row per KV slot: slot = block * block_size + offset
//
//     block 0 | s0 s1 ... s15 |   block 1 | s16 ... s31 |   block 2 | ...      (block_size 16)
//
//   sequence b, position p:  block_table[b][p / block_size] * block_size + p % block_size   (its KV slot)
//
// Three ops, each on the device of its views (CPU = fp32, the reference; CUDA = bf16 with fp32 math; lesson 16
// adds an FP8 pool, E4M3 bytes with per-layer scales: KvCacheDtype below):
//   paged_kv_write      this step's new k, v rows -> the pool, at slot_mapping[t] (slot -1: not stored)
//   paged_attention     the step's queries over everything their sequences have in the pool:
//                         every q_len <= 1 (decode)   paged_decode_attention: lesson 10's decode kernel
//                                                     (flash-decoding + its combine) with the PagedKV policy
//                         otherwise (prefill, chunks, prefix-cache hits)   lesson 07's flash kernel with the
//                                                     PagedKV policy: the keys before a chunk are read from blocks
//
// Where a step's tokens go (the slot mapping, one KV slot per new token) and where each sequence's keys are
// (its block table) come from a PagedStepTables, allocated once and refilled per step with one async copy, like
// StepInputs. The lengths (q_len, k_len = the context length) come from the step's AttentionBatch, as in lesson
// 10. No op allocates, synchronises or creates a handle; every grid depends only on host values a CUDA graph
// keeps fixed, so a decode step can be captured and replayed after its tables and lengths were updated in place.
//
// This header is included by .cu files: C++17 only.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include "attention.h"
#include "common/buffer.h"
#include "common/tensor.h"
#include "kv_cache.h"  // DecodeWorkspace, decode_splits: the decode split scratch and policy are lesson 10's

namespace tvllm {

struct ModelConfig;  // model_config.h (lesson 01)

// ---- lesson 16: what the pool stores ---------------------------------------------------------------------
// --kv-cache-dtype auto|bf16|fp8 (vLLM's flag). Auto and BF16: the model's dtype (bf16 on CUDA, fp32 on the CPU).
// FP8: every k and v element as one E4M3 byte, code = e4m3(x * (1 / scale)), read back as code * scale, with ONE
// fp32 scale per layer for k and one for v (per tensor, as vLLM's fp8 cache). Half the bytes of bf16: twice the
// positions in the same memory, and a decode step reads half as much. On the CPU (the reference) the pool stays
// fp32 and holds the decoded values code * scale: every CPU read path then sees exactly the GPU's rounding.
// lessons/16_quantization/README.md (section "FP8 KV cache") explains the scale and the accuracy cost.
enum class KvCacheDtype : uint8_t { Auto, BF16, FP8 };
KvCacheDtype parse_kv_cache_dtype(const std::string& text);  // "auto" | "bf16" | "fp8", else InputError
const char* kv_cache_dtype_name(KvCacheDtype dtype);          // "auto" | "bf16" | "fp8"

// How one layer's k and v are stored, for the ops below. Default: as the model computes them (no rounding).
struct KvQuant {
  bool fp8 = false;
  float k_scale = 1.0f, v_scale = 1.0f;  // fp8 only: stored code = e4m3(x / scale); finite and > 0
};
// The value an element x reads back as from an FP8 cache of scale `scale`: e4m3(x * (1 / scale)) * scale,
// round to nearest even, saturating at +-448 (cuda_fp8.h's __NV_SATFINITE conversion: the GPU kernel calls the
// same function, so the CPU reference rounds bit for bit as the GPU does on the same input).
float kv_fp8_round(float x, float scale);

// ---- the pool ------------------------------------------------------------------------------------------

// How much of the GPU a pool sized from the free memory takes.
struct KvPoolBudget {
  double fraction = 0.9;                    // of the memory free when the pool is planned, in (0, 1]
  size_t margin_bytes = size_t{256} << 20;  // left free besides: allocator slack, driver and library growth
};

// What plan() found: the memory, the budget and the blocks that fit.
struct KvPoolPlan {
  size_t free_bytes = 0, total_bytes = 0;  // cudaMemGetInfo when planned
  size_t budget_bytes = 0;                 // fraction * free - margin (0 if that is negative)
  size_t bytes_per_block = 0;              // all layers, k and v
  int64_t num_blocks = 0;                  // budget / bytes_per_block, rounded down
  int64_t block_size = 0;
  double fraction = 0.0;
  size_t margin_bytes = 0;
  // "KV pool plan: 0.90 x 137.20 GiB free (of 139.80 GiB) - 256.0 MiB margin = 123.23 GiB -> 252366 blocks x 16
  // positions x 512.0 KiB per block (all layers, k and v) = 123.23 GiB, 4037856 positions"
  std::string describe() const;
};

// k and v of every layer, as num_blocks blocks of block_size positions: ONE allocation, sized in the constructor
// and never again. Layer l's k is [num_blocks, block_size, kv_dim] at layer_bytes() * 2l, its v right after.
// On CUDA the block size must be a power of two (the kernels split a position into block and offset with a shift
// and a mask). Move-only.
class PagedKvPool {
 public:
  // One block of every layer, k and v: layers * 2 * block_size * kv_dim * (2 bytes on CUDA, 4 on the CPU).
  // FP8 on CUDA: 1 byte per element.
  static size_t bytes_per_block(const AttentionShape& shape, int64_t num_layers, int64_t block_size, Device device,
                                KvCacheDtype kv_dtype = KvCacheDtype::Auto);
  // CUDA: how many blocks fit in budget.fraction of the GPU memory free NOW, minus budget.margin_bytes. Call it
  // after the weights, the workspace and a warm-up step are in place: what they take is no longer free. Throws
  // InputError for a bad budget or when not one block fits (naming the numbers).
  static KvPoolPlan plan(const AttentionShape& shape, int64_t num_layers, int64_t block_size,
                         const KvPoolBudget& budget = {}, KvCacheDtype kv_dtype = KvCacheDtype::Auto);

  PagedKvPool() = default;
  // Throws InputError for a bad size (naming it) and, on CUDA, for a block size that is not a power of two or a
  // pool that does not fit in the free memory; CudaError if the allocation itself fails. Not initialised: a slot
  // is read only after it was written.
  // kv_dtype (lesson 16): FP8 stores one byte per element (bytes_per_block halves on CUDA); the scales start at 1.
  PagedKvPool(const AttentionShape& shape, int64_t num_layers, int64_t num_blocks, int64_t block_size, Device device,
              KvCacheDtype kv_dtype = KvCacheDtype::Auto);
  static PagedKvPool for_model(const ModelConfig& config, int64_t num_blocks, int64_t block_size, Device device,
                               KvCacheDtype kv_dtype = KvCacheDtype::Auto);
  // CUDA: as many blocks as plan() allows; prints plan.describe() to `log` (when not null) before allocating.
  static PagedKvPool fill_free_memory(const ModelConfig& config, int64_t block_size, const KvPoolBudget& budget = {},
                                      std::ostream* log = nullptr, KvCacheDtype kv_dtype = KvCacheDtype::Auto);

  const AttentionShape& shape() const { return shape_; }
  int64_t num_layers() const { return num_layers_; }
  int64_t num_blocks() const { return num_blocks_; }
  int64_t block_size() const { return block_size_; }
  int64_t num_slots() const { return num_blocks_ * block_size_; }  // KV slots (rows) per layer
  Device device() const { return device_; }
  // The views' dtype: F8_E4M3 for an FP8 pool on CUDA, else BF16 (CUDA) / F32 (CPU, FP8 or not).
  DType dtype() const;
  bool fp8() const { return kv_dtype_ == KvCacheDtype::FP8; }
  KvCacheDtype kv_dtype() const { return fp8() ? KvCacheDtype::FP8 : KvCacheDtype::BF16; }
  // FP8: one k scale and one v scale per layer (a checkpoint's k_scale / v_scale, else 1). InputError unless
  // num_layers() finite positive values each; ignored (but still checked) by a pool that is not FP8.
  void set_scales(const std::vector<float>& k_scales, const std::vector<float>& v_scales);
  KvQuant quant(int layer) const;  // what the ops need for layer `layer`
  size_t bytes() const { return bytes_; }
  size_t bytes_per_block() const { return bytes_per_block(shape_, num_layers_, block_size_, device_, kv_dtype_); }
  size_t layer_bytes() const { return bytes_ / static_cast<size_t>(2 * num_layers_); }  // one of k or v of a layer
  // [num_blocks, block_size, kv_dim] views of layer `layer` (contiguous).
  TensorView k(int layer) const;
  TensorView v(int layer) const;
  // "KV pool: 2 layers x 2 (k, v) x 40 blocks x 16 positions x 128 (2 kv heads x 64) x BF16 = 640.0 KiB"
  std::string describe() const;

 private:
  AttentionShape shape_;
  int64_t num_layers_ = 0, num_blocks_ = 0, block_size_ = 0;
  Device device_ = Device::CPU;
  KvCacheDtype kv_dtype_ = KvCacheDtype::BF16;
  std::vector<float> k_scales_, v_scales_;  // [num_layers]
  size_t bytes_ = 0;
  DeviceBuffer device_storage_;
  HostBuffer host_storage_;
};

// ---- the step's addressing: slot mapping and block tables -------------------------------------------------

// Per step: the KV slot of each new token (I32 [T]; -1 = do not store, e.g. a padding token) and the block
// table of each sequence (I32 [B][max_blocks_per_seq], row b's first entries are sequence b's blocks in position
// order; the rest of the row is never read). Host copies for the checks and the CPU path; on CUDA device arrays
// of fixed address (the table's row stride is max_blocks_per_seq, whatever the step), so a captured graph reads
// whatever the last set() put there.
//
// set() validates everything on the host (InputError naming the entry; the previous step stays in place), fills
// a pinned staging buffer and queues two async copies on `stream` (the slot mapping, and the B table rows as one
// 2-D copy of the used width). Before it overwrites the staging buffer it waits for the previous copies to have
// read it (an event). Never call set() while a CUDA graph is being captured. Move-only.
class PagedStepTables {
 public:
  PagedStepTables() = default;
  PagedStepTables(int64_t max_tokens, int64_t max_sequences, int64_t max_blocks_per_seq, int64_t num_blocks,
                  int64_t block_size, Device device);
  ~PagedStepTables();
  PagedStepTables(PagedStepTables&& other) noexcept;
  PagedStepTables& operator=(PagedStepTables&& other) noexcept;
  PagedStepTables(const PagedStepTables&) = delete;
  PagedStepTables& operator=(const PagedStepTables&) = delete;

  // slot_mapping: one entry per new token of the step, in [-1, num_blocks * block_size); block_tables: one per
  // sequence, each entry in [0, num_blocks), at most max_blocks_per_seq long.
  void set(const std::vector<int32_t>& slot_mapping, const std::vector<std::vector<int32_t>>& block_tables,
           cudaStream_t stream = nullptr);

  Device device() const { return device_; }
  int64_t num_blocks() const { return num_blocks_; }
  int64_t block_size() const { return block_size_; }
  int64_t max_blocks_per_seq() const { return max_blocks_; }  // the row stride of the device table
  int64_t num_tokens() const { return num_tokens_; }
  int num_sequences() const { return static_cast<int>(table_lens_.size()); }
  // Host values of the last set().
  const int32_t* host_slot_mapping() const;                  // [num_tokens()]
  const int32_t* host_block_table(int b) const;              // sequence b's row: table_len(b) entries
  int64_t table_len(int b) const { return table_lens_.at(static_cast<size_t>(b)); }
  // Device arrays (null on the CPU): slot mapping [max_tokens], tables [max_sequences][max_blocks_per_seq].
  const int32_t* device_slot_mapping() const;
  const int32_t* device_block_tables() const;

 private:
  void release() noexcept;
  int64_t max_tokens_ = 0, max_sequences_ = 0, max_blocks_ = 0, num_blocks_ = 0, block_size_ = 0;
  Device device_ = Device::CPU;
  int64_t num_tokens_ = 0;
  std::vector<int64_t> table_lens_;  // [B]; capacity max_sequences, reserved up front
  HostBuffer staging_;               // I32: slot mapping [max_tokens] | tables [max_sequences][max_blocks]
  DeviceBuffer device_arrays_;       // the same layout on the device (CUDA)
  cudaEvent_t copied_ = nullptr;     // recorded after each set's copies
  bool copy_recorded_ = false;
};

// The step against its tables (what a backend checks before it launches anything): as many tables as the batch
// has sequences, as many slots as it has new tokens, every sequence's context covered by its table, and every
// new token's slot the one its table gives for its position (or -1). InputError naming the first problem.
void check_paged_step(const AttentionBatch& batch, const PagedStepTables& tables, const char* op);

// ---- the ops ---------------------------------------------------------------------------------------------

// Stores this step's new keys and values in the pool: row t of k and v goes to KV slot slot_mapping[t] of pool_k /
// pool_v (one layer: PagedKvPool::k(layer), v(layer)); a slot of -1 is skipped. k, v: [tables.num_tokens(),
// kv_dim], any row stride (views into the fused QKV buffer). CUDA: bf16, rows 16-byte aligned.
// quant.fp8 (lesson 16): each element stored as kv_fp8_round would read it back (CUDA: the E4M3 code, pool views
// F8_E4M3; CPU: the decoded value in the fp32 pool). CUDA: the pool's dtype must match quant (InputError).
void paged_kv_write(const TensorView& pool_k, const TensorView& pool_v, const TensorView& k, const TensorView& v,
                    const PagedStepTables& tables, const AttentionShape& shape, cudaStream_t stream = nullptr,
                    const KvQuant& quant = {});
// paged_kv_write's checks of the pool and the quantization (not of k and v), without the write: for a kernel that
// stores the new rows itself (lesson 14's qkv GEMV, through PagedAttention::kv_store).
void check_paged_kv_write(const TensorView& pool_k, const TensorView& pool_v, const PagedStepTables& tables,
                          const AttentionShape& shape, const KvQuant& quant = {});

// Attention of the step's queries over the pool: sequence b's keys 0..k_len[b]-1 (already written, this step's
// included) through its block table. q, out: [batch.total_q(), q_dim] (q may be a column view of the fused QKV
// buffer). Every q_len <= 1 and decode == Split or Fast: paged_decode_attention with that kernel and
// decode_splits_for() (workspace needed on CUDA); otherwise the flash kernel with the PagedKV policy (CUDA) or
// the double-precision reference (CPU): lesson 10's DecodeAttention says when to choose Flash. Throws InputError
// on a bad shape, device, batch, table or head_dim (check_paged_step's checks included).
void paged_attention(const TensorView& out, const TensorView& q, const TensorView& pool_k, const TensorView& pool_v,
                     const AttentionBatch& batch, const PagedStepTables& tables, const AttentionShape& shape,
                     DecodeWorkspace* workspace, cudaStream_t stream = nullptr,
                     DecodeAttention decode = DecodeAttention::Split, const KvQuant& quant = {});

// Decode only (every q_len is 0 or 1), with an explicit split count (1..kMaxDecodeSplits). CPU: fp32, lesson
// 10's split algorithm (cache_attention_cpu.h) through the block table; CUDA: lesson 10's decode kernel and
// combine (decode_attention.cuh) with the PagedKV policy (kernel Split), or lesson 14's (kernel Fast, installed
// through install_fast_paged_decode below). Flash is not a split kernel: InputError.
void paged_decode_attention(const TensorView& out, const TensorView& q, const TensorView& pool_k,
                            const TensorView& pool_v, const AttentionBatch& batch, const PagedStepTables& tables,
                            const AttentionShape& shape, int num_splits, DecodeWorkspace* workspace,
                            cudaStream_t stream = nullptr, DecodeAttention kernel = DecodeAttention::Split,
                            const KvQuant& quant = {});
// An FP8 pool (quant.fp8) on CUDA: lesson 10's kernel reads the codes (8 per 8-byte load, converted to bf16
// exactly) and folds the scales into its arithmetic (k_scale into the score scale, v_scale into the output), the
// math in fp32; Fast runs lesson 14's kernel the same way once its FP8 seam is installed, else lesson 10's. Prefill and chunks over an FP8
// pool run lesson 07's CUDA-core flash kernel (the tensor-core one copies bf16 tiles with cp.async).

// Lesson 14's decode kernel over the pool: the same seam as lesson 10's install_fast_decode (kv_cache.h says why
// a seam), for the paged policy. Arguments already checked by paged_decode_attention(); window as there.
using FastPagedDecodeFn = void (*)(const TensorView& out, const TensorView& q, const TensorView& pool_k,
                                   const TensorView& pool_v, const AttentionBatch& batch,
                                   const PagedStepTables& tables, const AttentionShape& shape, int num_splits,
                                   int window, const DecodeWorkspace& workspace, cudaStream_t stream);
void install_fast_paged_decode(FastPagedDecodeFn fn);  // idempotent; published atomically
FastPagedDecodeFn installed_fast_paged_decode();         // null until lesson 14 installs it
// The same kernel over an FP8 pool (lesson 16): a seam of its own, so that the bf16 one keeps its signature. When it
// is not installed, Fast over an FP8 pool runs lesson 10's kernel (decode_kind_for says which kind runs).
using FastPagedDecodeFp8Fn = void (*)(const TensorView& out, const TensorView& q, const TensorView& pool_k,
                                      const TensorView& pool_v, const AttentionBatch& batch,
                                      const PagedStepTables& tables, const AttentionShape& shape, int num_splits,
                                      int window, const KvQuant& quant, const DecodeWorkspace& workspace,
                                      cudaStream_t stream);
void install_fast_paged_decode_fp8(FastPagedDecodeFp8Fn fn);  // idempotent; published atomically
FastPagedDecodeFp8Fn installed_fast_paged_decode_fp8();         // null until lesson 14 installs it
// The decode kernel that runs when `asked` is asked for over a pool stored as `quant` says: Fast over FP8 without
// the FP8 seam installed is Split; otherwise `asked`.
DecodeAttention decode_kind_for(DecodeAttention asked, const KvQuant& quant);

// A faster prefill over the pool (lesson 15's wgmma kernel on Hopper): the same seam again. PagedAttention asks it,
// when its set_fast_prefill(true) was called, for every step with a sequence of more than one query that lesson
// 07's fresh-prefill seam did not take (chunked prefill's later chunks, prefix-cache hits, prefill chunks beside
// decode tokens). The kernel returns false when it declines (a head_dim or block size it lacks, another GPU): the
// caller then runs paged_attention(). Arguments not checked yet: the kernel checks what it needs (InputError).
using FastPagedPrefillFn = bool (*)(const TensorView& out, const TensorView& q, const TensorView& pool_k,
                                    const TensorView& pool_v, const AttentionBatch& batch,
                                    const PagedStepTables& tables, const AttentionShape& shape, cudaStream_t stream);
void install_fast_paged_prefill(FastPagedPrefillFn fn);  // idempotent; published atomically; null uninstalls
FastPagedPrefillFn installed_fast_paged_prefill();         // null until someone installs one
// Runs the installed kernel when one is, the views are on the GPU and some sequence brings more than one query;
// false (nothing launched) otherwise or when the kernel declines.
bool try_fast_paged_prefill(const TensorView& out, const TensorView& q, const TensorView& pool_k,
                            const TensorView& pool_v, const AttentionBatch& batch, const PagedStepTables& tables,
                            const AttentionShape& shape, cudaStream_t stream);

// ---- the paths behind the ops (arguments already checked) ----------------------------------------------

void paged_kv_write_cpu(const TensorView& pool_k, const TensorView& pool_v, const TensorView& k, const TensorView& v,
                        const PagedStepTables& tables);
void paged_kv_write_cuda(const TensorView& pool_k, const TensorView& pool_v, const TensorView& k,
                         const TensorView& v, const PagedStepTables& tables, cudaStream_t stream,
                         const KvQuant& quant = {});
void paged_kv_write_fp8_cpu(const TensorView& pool_k, const TensorView& pool_v, const TensorView& k,
                            const TensorView& v, const PagedStepTables& tables, const KvQuant& quant);
// Prefill/chunks over the pool on the CPU: lesson 07's reference formula, double precision.
void paged_prefill_attention_cpu(const TensorView& out, const TensorView& q, const TensorView& pool_k,
                                 const TensorView& pool_v, const AttentionBatch& batch, const PagedStepTables& tables,
                                 const AttentionShape& shape);
void paged_flash_attention_cuda(const TensorView& out, const TensorView& q, const TensorView& pool_k,
                                const TensorView& pool_v, const AttentionBatch& batch, const PagedStepTables& tables,
                                const AttentionShape& shape, cudaStream_t stream, const KvQuant& quant = {});
void paged_decode_attention_cpu(const TensorView& out, const TensorView& q, const TensorView& pool_k,
                                const TensorView& pool_v, const AttentionBatch& batch, const PagedStepTables& tables,
                                const AttentionShape& shape, int num_splits);
void paged_decode_attention_cuda(const TensorView& out, const TensorView& q, const TensorView& pool_k,
                                 const TensorView& pool_v, const AttentionBatch& batch, const PagedStepTables& tables,
                                 const AttentionShape& shape, int num_splits, const DecodeWorkspace& workspace,
                                 cudaStream_t stream, const KvQuant& quant = {});

// ---- the benchmark ---------------------------------------------------------------------------------------

// The decode attention of one step over `num_layers` layers: `batch` sequences of `context` keys each, paged
// (blocks of `block_size`, block tables shuffled over the pool) beside lesson 10's contiguous cache on the same
// shapes and split count. Bytes = the K and V rows actually read (+ q and out), achieved GB/s as % of the
// measured device copy bandwidth (common/bench.h). Prints a table to `out`. CUDA only (CudaError without a GPU).
// When lesson 14's kernel is installed (install_fast_paged_decode and install_fast_decode), two more rows: it over
// the same pool and cache, with its own split count. Then (lesson 16) the paged rows again over an FP8 pool.
struct PagedDecodeBench {
  int splits = 0;
  double bytes = 0.0;  // per step (all layers)
  double paged_ms = 0.0, contiguous_ms = 0.0;
  double paged_gbs = 0.0, contiguous_gbs = 0.0, copy_gbs = 0.0;
  int fast_splits = 0;  // lesson 14's rows (0: not installed)
  double fast_paged_ms = 0.0, fast_contiguous_ms = 0.0, fast_paged_gbs = 0.0, fast_contiguous_gbs = 0.0;
  // Lesson 16: the same step over an FP8 pool (half the K and V bytes): lesson 10's kernel, and lesson 14's when its
  // FP8 seam is installed (fp8_fast_paged_ms 0 otherwise).
  double fp8_bytes = 0.0;
  double fp8_paged_ms = 0.0, fp8_fast_paged_ms = 0.0;
};
PagedDecodeBench bench_paged_decode(const AttentionShape& shape, int64_t num_layers, int64_t batch, int64_t context,
                                    int64_t block_size, std::ostream& out);

}  // namespace tvllm
