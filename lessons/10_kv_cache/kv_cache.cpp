// Lesson 10: the cache's memory, the slot table, the argument checks and the CPU paths (the fp32 references).
#include "kv_cache.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <utility>

#include "common/errors.h"
#include "cache_attention_cpu.h"
#include "common/exercise.h"
#include "model_config.h"

namespace tvllm {

namespace {

int64_t ceil_div_i64(int64_t a, int64_t b) { return (a + b - 1) / b; }

std::string human_bytes(double bytes) {
  char text[64];
  if (bytes >= 1024.0 * 1024 * 1024) std::snprintf(text, sizeof text, "%.2f GiB", bytes / (1024.0 * 1024 * 1024));
  else if (bytes >= 1024.0 * 1024) std::snprintf(text, sizeof text, "%.1f MiB", bytes / (1024.0 * 1024));
  else std::snprintf(text, sizeof text, "%.1f KiB", bytes / 1024.0);
  return text;
}

}  // namespace

// ---- KvCache -----------------------------------------------------------------------------------------

size_t KvCache::bytes_for(const AttentionShape& shape, int64_t num_layers, int64_t num_slots, int64_t max_context,
                          Device device) {
  const double elems = 2.0 * static_cast<double>(num_layers) * static_cast<double>(num_slots) *
                       static_cast<double>(max_context) * static_cast<double>(shape.kv_dim());
  const size_t elem = device == Device::CUDA ? 2 : 4;
  // Beyond 2^62 bytes nothing fits anywhere; say so rather than overflow.
  TVLLM_REQUIRE(elems * static_cast<double>(elem) < 4.6e18, "KvCache: the cache size overflows 64 bits");
  return static_cast<size_t>(2 * num_layers * num_slots * max_context * shape.kv_dim()) * elem;
}

KvCache::KvCache(const AttentionShape& shape, int64_t num_layers, int64_t num_slots, int64_t max_context,
                 Device device)
    : shape_(shape), num_layers_(num_layers), num_slots_(num_slots), max_context_(max_context), device_(device) {
  shape.validate();
  TVLLM_REQUIRE(num_layers >= 1, "KvCache: num_layers must be >= 1, got " + std::to_string(num_layers));
  TVLLM_REQUIRE(num_slots >= 1 && num_slots <= std::numeric_limits<int32_t>::max(),
                "KvCache: num_slots must be in [1, 2^31), got " + std::to_string(num_slots));
  // Positions are int32 in the kernels (as in cu_seqlens).
  TVLLM_REQUIRE(max_context >= 1 && max_context <= std::numeric_limits<int32_t>::max(),
                "KvCache: max_context must be in [1, 2^31), got " + std::to_string(max_context));
  bytes_ = bytes_for(shape, num_layers, num_slots, max_context, device);
  if (device == Device::CUDA) {
    // Ask before allocating, so that the message can say what was asked for and what there is.
    size_t free_bytes = 0, total_bytes = 0;
    TVLLM_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    TVLLM_REQUIRE(bytes_ <= free_bytes,
                  describe() + " does not fit in the GPU's free memory (" + human_bytes(static_cast<double>(free_bytes)) +
                      " of " + human_bytes(static_cast<double>(total_bytes)) +
                      "): use fewer sequence slots or a shorter context (max_context)");
    device_storage_ = DeviceBuffer(bytes_);  // CudaError naming the size if it still fails
  } else {
    host_storage_ = HostBuffer(bytes_);
  }
}

KvCache KvCache::for_model(const ModelConfig& config, int64_t num_slots, int64_t max_context, Device device) {
  return KvCache(AttentionShape::from_config(config), config.num_hidden_layers, num_slots, max_context, device);
}

size_t KvCache::bytes_per_token() const {
  return static_cast<size_t>(2 * num_layers_ * shape_.kv_dim()) * dtype_size(dtype());
}

TensorView KvCache::k(int layer) const {
  TVLLM_REQUIRE(layer >= 0 && layer < num_layers_, "KvCache: layer " + std::to_string(layer) + " of " +
                                                       std::to_string(num_layers_));
  char* base = static_cast<char*>(device_ == Device::CUDA ? device_storage_.data() : host_storage_.data());
  return TensorView::contiguous(base + layer_bytes() * static_cast<size_t>(2 * layer), dtype(), device_,
                                {num_slots_, max_context_, shape_.kv_dim()});
}

TensorView KvCache::v(int layer) const {
  TensorView t = k(layer);
  t.data = static_cast<char*>(t.data) + layer_bytes();
  return t;
}

std::string KvCache::describe() const {
  return "KV cache: " + std::to_string(num_layers_) + " layers x 2 (k, v) x " + std::to_string(num_slots_) +
         " slots x " + std::to_string(max_context_) + " positions x " + std::to_string(shape_.kv_dim()) + " (" +
         std::to_string(shape_.n_kv_heads) + " kv heads x " + std::to_string(shape_.head_dim) + ") x " +
         std::string(dtype_name(dtype())) + " = " + human_bytes(static_cast<double>(bytes_));
}

// ---- CacheSlots --------------------------------------------------------------------------------------

CacheSlots::CacheSlots(int64_t max_sequences, int64_t num_slots, Device device)
    : capacity_(max_sequences), num_slots_(num_slots), device_(device) {
  TVLLM_REQUIRE(max_sequences >= 1 && max_sequences <= AttentionBatch::kMaxSequences,
                "CacheSlots: max_sequences must be in [1, " + std::to_string(AttentionBatch::kMaxSequences) +
                    "], got " + std::to_string(max_sequences));
  TVLLM_REQUIRE(num_slots >= 1, "CacheSlots: num_slots must be >= 1, got " + std::to_string(num_slots));
  host_.reserve(static_cast<size_t>(max_sequences));  // set() never reallocates
  if (device == Device::CUDA) {
    slots_device_ = DeviceBuffer(static_cast<size_t>(max_sequences) * sizeof(int32_t));
    staging_ = HostBuffer(static_cast<size_t>(max_sequences) * sizeof(int32_t), HostBuffer::Kind::Pinned);
    TVLLM_CUDA_CHECK(cudaEventCreateWithFlags(&copied_, cudaEventDisableTiming));
  }
}

CacheSlots::~CacheSlots() { release(); }

void CacheSlots::release() noexcept {
  if (copied_) {
    if (copy_recorded_) cudaEventSynchronize(copied_);  // the staging buffer outlives a copy reading it
    cudaEventDestroy(copied_);
  }
  copied_ = nullptr;
  copy_recorded_ = false;
}

CacheSlots::CacheSlots(CacheSlots&& other) noexcept { *this = std::move(other); }

CacheSlots& CacheSlots::operator=(CacheSlots&& other) noexcept {
  if (this != &other) {
    release();
    host_ = std::move(other.host_);
    capacity_ = std::exchange(other.capacity_, 0);
    num_slots_ = other.num_slots_;
    device_ = other.device_;
    slots_device_ = std::move(other.slots_device_);
    staging_ = std::move(other.staging_);
    copied_ = std::exchange(other.copied_, nullptr);
    copy_recorded_ = std::exchange(other.copy_recorded_, false);
  }
  return *this;
}

void CacheSlots::set(const std::vector<int32_t>& slots, cudaStream_t stream) {
  TVLLM_REQUIRE(!slots.empty(), "CacheSlots: a step needs at least one sequence");
  TVLLM_REQUIRE(static_cast<int64_t>(slots.size()) <= capacity_,
                "CacheSlots: " + std::to_string(slots.size()) + " sequences exceed the capacity of " +
                    std::to_string(capacity_) + " (max_sequences)");
  for (size_t b = 0; b < slots.size(); ++b) {
    TVLLM_REQUIRE(slots[b] >= 0 && slots[b] < num_slots_,
                  "CacheSlots: sequence " + std::to_string(b) + " names slot " + std::to_string(slots[b]) +
                      ", outside the cache's " + std::to_string(num_slots_) + " slots");
    // Two sequences in one slot would write each other's keys.
    for (size_t a = 0; a < b; ++a)
      TVLLM_REQUIRE(slots[a] != slots[b], "CacheSlots: sequences " + std::to_string(a) + " and " + std::to_string(b) +
                                              " both name slot " + std::to_string(slots[b]));
  }
  if (device_ == Device::CUDA) {
    if (copy_recorded_) TVLLM_CUDA_CHECK(cudaEventSynchronize(copied_));  // the last copy has read staging_
    std::copy(slots.begin(), slots.end(), staging_.as<int32_t>());
    TVLLM_CUDA_CHECK(cudaMemcpyAsync(slots_device_.data(), staging_.data(), slots.size() * sizeof(int32_t),
                                     cudaMemcpyHostToDevice, stream));
    TVLLM_CUDA_CHECK(cudaEventRecord(copied_, stream));
    copy_recorded_ = true;
  }
  host_.assign(slots.begin(), slots.end());  // within the reserved capacity: no allocation
}

// ---- DecodeWorkspace and the split count ---------------------------------------------------------------

DecodeWorkspace::DecodeWorkspace(const AttentionShape& shape, int64_t max_sequences, Device device)
    : max_sequences_(max_sequences) {
  shape.validate();
  TVLLM_REQUIRE(max_sequences >= 1, "DecodeWorkspace: max_sequences must be >= 1");
  if (device == Device::CUDA) {
    int dev = 0;
    TVLLM_CUDA_CHECK(cudaGetDevice(&dev));
    TVLLM_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms_, cudaDevAttrMultiProcessorCount, dev));
    partials_ = DeviceBuffer(static_cast<size_t>(max_sequences * shape.n_heads * kMaxDecodeSplits *
                                                 (shape.head_dim + 2)) *
                             sizeof(float));
    arrivals_ = DeviceBuffer(static_cast<size_t>(max_sequences * shape.n_heads) * sizeof(int));
    arrivals_.fill_zero();
  }
}

int decode_splits(const AttentionShape& shape, int batch_size, int64_t max_k_len, int num_sms) {
  // A sliding window caps the keys a decode query reads at `window`, however long the context: split those.
  if (shape.window > 0) max_k_len = std::min(max_k_len, shape.window);
  if (max_k_len <= kMinKeysPerSplit) return 1;
  const int64_t by_keys = ceil_div_i64(max_k_len, kMinKeysPerSplit);
  int64_t splits = by_keys;  // CPU (num_sms == 0): as fine as the keys allow, so generation exercises the combine
  if (num_sms > 0) {
    // One block per (sequence, kv head, <= 8 query heads of its group, split). Aim for ~4 blocks per SM:
    // a decode step of one sequence has only n_kv_heads blocks without splitting (8 on Llama 3.2 1B, for
    // 132 SMs).
    const int64_t head_tiles = ceil_div_i64(shape.group_size(), 8);
    const int64_t blocks = static_cast<int64_t>(batch_size) * shape.n_kv_heads * head_tiles;
    splits = std::min(by_keys, ceil_div_i64(4 * static_cast<int64_t>(num_sms), blocks));
  }
  return static_cast<int>(std::clamp<int64_t>(splits, 1, DecodeWorkspace::kMaxDecodeSplits));
}

// ---- lesson 14's seam ------------------------------------------------------------------------------------

namespace {
// Two atomics rather than one struct behind a mutex: a reader on the decode path pays one atomic load each.
std::atomic<decltype(FastDecodeKernel::splits)> g_fast_splits{nullptr};
std::atomic<decltype(FastDecodeKernel::contiguous)> g_fast_contiguous{nullptr};
}  // namespace

void install_fast_decode(const FastDecodeKernel& kernel) {
  TVLLM_REQUIRE(kernel.splits != nullptr && kernel.contiguous != nullptr,
                "install_fast_decode: both the split policy and the kernel are needed");
  g_fast_splits.store(kernel.splits);
  g_fast_contiguous.store(kernel.contiguous);
}

FastDecodeKernel installed_fast_decode() {
  FastDecodeKernel k;
  k.splits = g_fast_splits.load();
  k.contiguous = g_fast_contiguous.load();
  return k;
}

int decode_splits_for(DecodeAttention decode, const AttentionShape& shape, int batch_size, int64_t max_k_len,
                      int num_sms) {
  const auto fast = g_fast_splits.load();
  if (decode == DecodeAttention::Fast && num_sms > 0 && fast != nullptr)
    return fast(shape, batch_size, max_k_len, num_sms);
  return decode_splits(shape, batch_size, max_k_len, num_sms);
}

// ---- argument checks -------------------------------------------------------------------------------------

namespace {

DType dtype_on(Device device) { return device == Device::CUDA ? DType::BF16 : DType::F32; }

// One layer of the cache: [slots, max_context, kv_dim], contiguous, on `device`, both k and v alike.
void check_cache(const TensorView& cache_k, const TensorView& cache_v, const AttentionShape& shape, Device device,
                 const char* op) {
  for (const TensorView* t : {&cache_k, &cache_v}) {
    const char* name = t == &cache_k ? "cache_k" : "cache_v";
    TVLLM_REQUIRE(t->rank() == 3 && t->shape[2] == shape.kv_dim() && t->is_contiguous(),
                  std::string(op) + ": " + name + " must be a contiguous [slots, max_context, " +
                      std::to_string(shape.kv_dim()) + "] view (KvCache::k/v), got " + t->describe());
    TVLLM_REQUIRE(t->device == device && t->dtype == dtype_on(device),
                  std::string(op) + ": " + name + " must be " + std::string(dtype_name(dtype_on(device))) + " on " +
                      std::string(device_name(device)) + ", got " + t->describe());
    TVLLM_REQUIRE(t->data != nullptr, std::string(op) + ": " + name + " has no data");
  }
  TVLLM_REQUIRE(cache_k.shape == cache_v.shape, std::string(op) + ": cache_k " + cache_k.describe() +
                                                    " and cache_v " + cache_v.describe() + " differ");
}

// The step against the cache: one slot per sequence, each inside the cache, every position inside the context.
void check_step(const AttentionBatch& batch, const CacheSlots& slots, const TensorView& cache_k, Device device,
                const char* op) {
  TVLLM_REQUIRE(batch.batch_size() >= 1, std::string(op) + ": the AttentionBatch is empty (set it first)");
  TVLLM_REQUIRE(batch.device() == device && slots.device() == device,
                std::string(op) + ": the AttentionBatch and the CacheSlots must be made for " +
                    std::string(device_name(device)));
  TVLLM_REQUIRE(slots.size() == batch.batch_size(),
                std::string(op) + ": " + std::to_string(slots.size()) + " cache slots for " +
                    std::to_string(batch.batch_size()) + " sequences (CacheSlots::set: one per sequence)");
  for (int b = 0; b < slots.size(); ++b)
    TVLLM_REQUIRE(slots.slot(b) < cache_k.shape[0], std::string(op) + ": sequence " + std::to_string(b) +
                                                        " names slot " + std::to_string(slots.slot(b)) +
                                                        " of a cache with " + std::to_string(cache_k.shape[0]));
  TVLLM_REQUIRE(batch.max_k_len() <= cache_k.shape[1],
                std::string(op) + ": a sequence reaches " + std::to_string(batch.max_k_len()) +
                    " positions, beyond the cache's max_context of " + std::to_string(cache_k.shape[1]));
}

// New rows k or v [T, kv_dim]: unit column stride, any row stride (views into the fused QKV buffer).
void check_new_rows(const TensorView& t, const char* name, int64_t rows, const AttentionShape& shape, Device device) {
  const std::string what = std::string("kv_cache_write: ") + name;
  TVLLM_REQUIRE(t.rank() == 2 && t.shape[0] == rows && t.shape[1] == shape.kv_dim(),
                what + " must be [" + std::to_string(rows) + ", " + std::to_string(shape.kv_dim()) + "], got " +
                    t.describe());
  TVLLM_REQUIRE(t.device == device && t.dtype == dtype_on(device),
                what + " must be " + std::string(dtype_name(dtype_on(device))) + " on " +
                    std::string(device_name(device)) + ", got " + t.describe());
  TVLLM_REQUIRE(t.strides.size() == 2 && t.strides[1] == 1 && (rows <= 1 || t.strides[0] >= shape.kv_dim()),
                what + " must have contiguous columns and rows at least kv_dim apart");
  TVLLM_REQUIRE(rows == 0 || t.data != nullptr, what + " has no data");
  if (device == Device::CUDA && rows > 0) {
    TVLLM_REQUIRE(reinterpret_cast<uintptr_t>(t.data) % 16 == 0 && (rows <= 1 || t.strides[0] % 8 == 0),
                  what + " rows must start 16-byte aligned (data and row stride)");
  }
}

void require_cuda_head_dim(const AttentionShape& shape, const char* op) {
  TVLLM_REQUIRE(shape.head_dim % 8 == 0 && shape.head_dim <= 256,
                std::string(op) + " on cuda takes a head_dim that is a multiple of 8 up to 256, got " +
                    std::to_string(shape.head_dim));
}

}  // namespace

// ---- the ops: check, then dispatch ------------------------------------------------------------------------

void check_kv_cache_write(const TensorView& cache_k, const TensorView& cache_v, const AttentionBatch& batch,
                          const CacheSlots& slots, const AttentionShape& shape) {
  shape.validate();
  check_cache(cache_k, cache_v, shape, cache_k.device, "kv_cache_write");
  check_step(batch, slots, cache_k, cache_k.device, "kv_cache_write");
}

void kv_cache_write(const TensorView& cache_k, const TensorView& cache_v, const TensorView& k, const TensorView& v,
                    const AttentionBatch& batch, const CacheSlots& slots, const AttentionShape& shape,
                    cudaStream_t stream) {
  shape.validate();
  const Device device = k.device;
  check_cache(cache_k, cache_v, shape, device, "kv_cache_write");
  check_step(batch, slots, cache_k, device, "kv_cache_write");
  check_new_rows(k, "k", batch.total_q(), shape, device);
  check_new_rows(v, "v", batch.total_q(), shape, device);
  if (batch.total_q() == 0) return;
  if (device == Device::CPU) {
    kv_cache_write_cpu(cache_k, cache_v, k, v, batch, slots);
  } else {
    require_cuda_head_dim(shape, "kv_cache_write");
    kv_cache_write_cuda(cache_k, cache_v, k, v, batch, slots, stream);
  }
}

void decode_attention(const TensorView& out, const TensorView& q, const TensorView& cache_k,
                      const TensorView& cache_v, const AttentionBatch& batch, const CacheSlots& slots,
                      const AttentionShape& shape, int num_splits, DecodeWorkspace* workspace, cudaStream_t stream,
                      DecodeAttention kernel) {
  TVLLM_REQUIRE(kernel != DecodeAttention::Flash,
                "decode_attention runs a split decode kernel (Split or Fast); Flash goes through cached_attention");
  check_attention_queries(out, q, batch, shape);
  const Device device = q.device;
  check_cache(cache_k, cache_v, shape, device, "decode_attention");
  check_step(batch, slots, cache_k, device, "decode_attention");
  TVLLM_REQUIRE(batch.max_q_len() <= 1, "decode_attention: every sequence must bring at most one query (decode), "
                                        "but one brings " + std::to_string(batch.max_q_len()) +
                                            " (cached_attention runs those with the flash kernel)");
  TVLLM_REQUIRE(num_splits >= 1 && num_splits <= DecodeWorkspace::kMaxDecodeSplits,
                "decode_attention: num_splits must be in [1, " + std::to_string(DecodeWorkspace::kMaxDecodeSplits) +
                    "], got " + std::to_string(num_splits));
  if (batch.total_q() == 0) return;
  if (device == Device::CPU) {
    decode_attention_cpu(out, q, cache_k, cache_v, batch, slots, shape, num_splits);
    return;
  }
  require_cuda_head_dim(shape, "decode_attention");
  TVLLM_REQUIRE(workspace != nullptr && workspace->partials() != nullptr,
                "decode_attention on cuda needs a DecodeWorkspace made for cuda");
  TVLLM_REQUIRE(batch.batch_size() <= workspace->max_sequences(),
                "decode_attention: " + std::to_string(batch.batch_size()) +
                    " sequences exceed the DecodeWorkspace's max_sequences of " +
                    std::to_string(workspace->max_sequences()));
  if (kernel == DecodeAttention::Fast) {
    const FastDecodeKernel fast = installed_fast_decode();
    TVLLM_REQUIRE(fast.contiguous != nullptr,
                  "decode_attention: DecodeAttention::Fast is lesson 14's kernel, and it is not installed: call "
                  "install_fast_decode_attention() (lessons/14_performance/decode_attention_fast.h; use_fast_path "
                  "does) or ask for DecodeAttention::Split");
    // The shape's sliding window (Mistral), as lesson 10's kernel applies it (DecodeParams::window).
    fast.contiguous(out, q, cache_k, cache_v, batch, slots, shape, num_splits, static_cast<int>(shape.window),
                    *workspace, stream);
    return;
  }
  decode_attention_cuda(out, q, cache_k, cache_v, batch, slots, shape, num_splits, *workspace, stream);
}

void cached_attention(const TensorView& out, const TensorView& q, const TensorView& cache_k,
                      const TensorView& cache_v, const AttentionBatch& batch, const CacheSlots& slots,
                      const AttentionShape& shape, DecodeWorkspace* workspace, cudaStream_t stream,
                      DecodeAttention decode) {
  if (batch.max_q_len() <= 1 && decode != DecodeAttention::Flash) {
    const int num_sms = q.device == Device::CUDA && workspace ? workspace->num_sms() : 0;
    decode_attention(out, q, cache_k, cache_v, batch, slots, shape,
                     decode_splits_for(decode, shape, batch.batch_size(), batch.max_k_len(), num_sms), workspace,
                     stream, decode);
    return;
  }
  check_attention_queries(out, q, batch, shape);
  const Device device = q.device;
  check_cache(cache_k, cache_v, shape, device, "cached_attention");
  check_step(batch, slots, cache_k, device, "cached_attention");
  if (batch.total_q() == 0) return;  // nothing to attend (and a grid of zero blocks is a launch error)
  if (device == Device::CPU) {
    cached_prefill_attention_cpu(out, q, cache_k, cache_v, batch, slots, shape);
  } else {
    TVLLM_REQUIRE(flash_supports_head_dim(shape.head_dim),
                  "cached_attention: the flash kernel takes a head_dim that is a multiple of 8 from 8 to 256, got " +
                      std::to_string(shape.head_dim));
    cached_flash_attention_cuda(out, q, cache_k, cache_v, batch, slots, shape, stream);
  }
}

// ---- the CPU paths ---------------------------------------------------------------------------------------

void kv_cache_write_cpu(const TensorView& cache_k, const TensorView& cache_v, const TensorView& k,
                        const TensorView& v, const AttentionBatch& batch, const CacheSlots& slots) {
  // --- exercise 10.1: the KV write ---------------------------------------------------------------------
  // Task: copy the step's new key and value rows into the cache. Token i of sequence b (row
  //   batch.q_begin(b) + i of k and v) sits at position k_len - q_len + i of its sequence, which lives in
  //   slot slots.slot(b): its row of the cache is slot * max_context + position.
  // Hint: cache_k.shape is [slots, max_context, kv_dim]; k.strides[0] is the row stride of k (a view into
  //   the fused QKV buffer has wider rows than kv_dim).
  // Tests: KvCache.WritePlacesRowsAtTheirPositions KvCache.GreedyEqualsReference*
  // Stub:
  //   (void)cache_k;
  //   (void)cache_v;
  //   (void)k;
  //   (void)v;
  //   (void)batch;
  //   (void)slots;
  //   throw NotWrittenYet("10.1", "the KV write");
  // --- solution ---
  const int64_t max_context = cache_k.shape[1], kv_dim = cache_k.shape[2];
  for (int b = 0; b < batch.batch_size(); ++b) {
    const int64_t first_pos = batch.k_len(b) - batch.q_len(b);  // the new tokens are the last q_len
    const int64_t slot = slots.slot(b);
    for (int64_t i = 0; i < batch.q_len(b); ++i) {
      const int64_t row = batch.q_begin(b) + i;
      const int64_t at = (slot * max_context + first_pos + i) * kv_dim;
      std::memcpy(cache_k.ptr<float>() + at, k.ptr<const float>() + row * k.strides[0], kv_dim * sizeof(float));
      std::memcpy(cache_v.ptr<float>() + at, v.ptr<const float>() + row * v.strides[0], kv_dim * sizeof(float));
    }
  }
  // --- end of exercise 10.1 ---
}

namespace {

// Sequence b's rows: its slot's positions, max_context rows from one slot to the next.
auto slot_rows(const TensorView& cache_k, const CacheSlots& slots) {
  const int64_t max_context = cache_k.shape[1], kv_dim = cache_k.shape[2];
  return [&slots, max_context, kv_dim](int b) {
    const int64_t first = slots.slot(b) * max_context;
    return [first, kv_dim](int64_t j) { return (first + j) * kv_dim; };
  };
}

}  // namespace

void cached_prefill_attention_cpu(const TensorView& out, const TensorView& q, const TensorView& cache_k,
                                  const TensorView& cache_v, const AttentionBatch& batch, const CacheSlots& slots,
                                  const AttentionShape& shape) {
  prefill_attention_over_rows_cpu(out, q, cache_k.ptr<const float>(), cache_v.ptr<const float>(), batch, shape,
                                  slot_rows(cache_k, slots));
}

void decode_attention_cpu(const TensorView& out, const TensorView& q, const TensorView& cache_k,
                          const TensorView& cache_v, const AttentionBatch& batch, const CacheSlots& slots,
                          const AttentionShape& shape, int num_splits) {
  decode_attention_over_rows_cpu(out, q, cache_k.ptr<const float>(), cache_v.ptr<const float>(), batch, shape,
                                 num_splits, slot_rows(cache_k, slots));
}

}  // namespace tvllm
