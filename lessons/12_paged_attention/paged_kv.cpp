// Lesson 12: the paged pool's memory (given or planned from the free GPU memory), the step's slot mapping and
// block tables, the argument checks and the CPU paths (the fp32 references).
#include "paged_kv.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <ostream>
#include <string>
#include <utility>

#include <cuda_fp8.h>  // __nv_cvt_float_to_fp8: host and device, the same rounding

#include "cache_attention_cpu.h"
#include "common/dtype.h"
#include "common/errors.h"
#include "common/exercise.h"
#include "model_config.h"

namespace tvllm {

namespace {

std::string human_bytes(double bytes) {
  char text[64];
  if (bytes >= 1024.0 * 1024 * 1024) std::snprintf(text, sizeof text, "%.2f GiB", bytes / (1024.0 * 1024 * 1024));
  else if (bytes >= 1024.0 * 1024) std::snprintf(text, sizeof text, "%.1f MiB", bytes / (1024.0 * 1024));
  else std::snprintf(text, sizeof text, "%.1f KiB", bytes / 1024.0);
  return text;
}

bool is_power_of_two(int64_t x) { return x > 0 && (x & (x - 1)) == 0; }

// Slots are int32 everywhere (the slot mapping, the kernels' positions), as vLLM's are.
constexpr int64_t kMaxSlots = std::numeric_limits<int32_t>::max();

void require_block_size(int64_t block_size, Device device, const char* who) {
  TVLLM_REQUIRE(block_size >= 1 && block_size <= (int64_t{1} << 20),
                std::string(who) + ": block_size must be in [1, 2^20], got " + std::to_string(block_size));
  if (device == Device::CUDA) {
    TVLLM_REQUIRE(is_power_of_two(block_size),
                  std::string(who) + ": on cuda the block size must be a power of two (the kernels split a position "
                                     "into block and offset with a shift and a mask), got " +
                      std::to_string(block_size));
  }
}

}  // namespace

// ---- lesson 16: the FP8 KV format ------------------------------------------------------------------------

KvCacheDtype parse_kv_cache_dtype(const std::string& text) {
  if (text == "auto") return KvCacheDtype::Auto;
  if (text == "bf16") return KvCacheDtype::BF16;
  if (text == "fp8") return KvCacheDtype::FP8;
  throw InputError("--kv-cache-dtype: expected auto, bf16 or fp8 (E4M3 with per-tensor scales), got \"" + text +
                   "\"");
}

const char* kv_cache_dtype_name(KvCacheDtype dtype) {
  switch (dtype) {
    case KvCacheDtype::Auto: return "auto";
    case KvCacheDtype::BF16: return "bf16";
    case KvCacheDtype::FP8: return "fp8";
  }
  return "?";
}

float kv_fp8_round(float x, float scale) {
  // The kernel multiplies by the reciprocal (one multiply per element, not a division); so does the reference.
  const float inv = 1.0f / scale;
  const __nv_fp8_storage_t code = __nv_cvt_float_to_fp8(x * inv, __NV_SATFINITE, __NV_E4M3);
  return fp8_e4m3_to_f32(static_cast<uint8_t>(code)) * scale;
}

// ---- PagedKvPool -------------------------------------------------------------------------------------

size_t PagedKvPool::bytes_per_block(const AttentionShape& shape, int64_t num_layers, int64_t block_size,
                                    Device device, KvCacheDtype kv_dtype) {
  const double elems = 2.0 * static_cast<double>(num_layers) * static_cast<double>(block_size) *
                       static_cast<double>(shape.kv_dim());
  // The CPU reference keeps fp32 whatever the format (it models FP8's rounding, not its bytes).
  const size_t elem = device == Device::CUDA ? (kv_dtype == KvCacheDtype::FP8 ? 1 : 2) : 4;
  TVLLM_REQUIRE(elems * static_cast<double>(elem) < 4.6e18, "PagedKvPool: the block size overflows 64 bits");
  return static_cast<size_t>(2 * num_layers * block_size * shape.kv_dim()) * elem;
}

std::string KvPoolPlan::describe() const {
  char text[320];
  std::snprintf(text, sizeof text,
                "KV pool plan: %.2f x %s free (of %s) - %s margin = %s -> %lld blocks x %lld positions x %s per block "
                "(all layers, k and v) = %s, %lld positions",
                fraction, human_bytes(static_cast<double>(free_bytes)).c_str(),
                human_bytes(static_cast<double>(total_bytes)).c_str(),
                human_bytes(static_cast<double>(margin_bytes)).c_str(),
                human_bytes(static_cast<double>(budget_bytes)).c_str(), static_cast<long long>(num_blocks),
                static_cast<long long>(block_size), human_bytes(static_cast<double>(bytes_per_block)).c_str(),
                human_bytes(static_cast<double>(bytes_per_block) * static_cast<double>(num_blocks)).c_str(),
                static_cast<long long>(num_blocks * block_size));
  return text;
}

KvPoolPlan PagedKvPool::plan(const AttentionShape& shape, int64_t num_layers, int64_t block_size,
                             const KvPoolBudget& budget, KvCacheDtype kv_dtype) {
  shape.validate();
  TVLLM_REQUIRE(num_layers >= 1, "PagedKvPool::plan: num_layers must be >= 1, got " + std::to_string(num_layers));
  require_block_size(block_size, Device::CUDA, "PagedKvPool::plan");
  TVLLM_REQUIRE(budget.fraction > 0.0 && budget.fraction <= 1.0,
                "PagedKvPool::plan: the fraction of free memory must be in (0, 1], got " +
                    std::to_string(budget.fraction));
  KvPoolPlan p;
  TVLLM_CUDA_CHECK(cudaMemGetInfo(&p.free_bytes, &p.total_bytes));
  p.fraction = budget.fraction;
  p.margin_bytes = budget.margin_bytes;
  p.block_size = block_size;
  const double budget_bytes = budget.fraction * static_cast<double>(p.free_bytes) - static_cast<double>(budget.margin_bytes);
  p.budget_bytes = budget_bytes > 0.0 ? static_cast<size_t>(budget_bytes) : 0;
  p.bytes_per_block = bytes_per_block(shape, num_layers, block_size, Device::CUDA, kv_dtype);
  p.num_blocks = std::min(static_cast<int64_t>(p.budget_bytes / p.bytes_per_block), kMaxSlots / block_size);
  TVLLM_REQUIRE(p.num_blocks >= 1, "PagedKvPool::plan: not one KV block (" +
                                       human_bytes(static_cast<double>(p.bytes_per_block)) + ") fits in " +
                                       p.describe() + ": free GPU memory, raise the fraction or lower the margin");
  return p;
}

PagedKvPool::PagedKvPool(const AttentionShape& shape, int64_t num_layers, int64_t num_blocks, int64_t block_size,
                         Device device, KvCacheDtype kv_dtype)
    : shape_(shape),
      num_layers_(num_layers),
      num_blocks_(num_blocks),
      block_size_(block_size),
      device_(device),
      kv_dtype_(kv_dtype == KvCacheDtype::FP8 ? KvCacheDtype::FP8 : KvCacheDtype::BF16) {
  shape.validate();
  TVLLM_REQUIRE(num_layers >= 1, "PagedKvPool: num_layers must be >= 1, got " + std::to_string(num_layers));
  require_block_size(block_size, device, "PagedKvPool");
  TVLLM_REQUIRE(num_blocks >= 1 && num_blocks <= kMaxSlots / block_size,
                "PagedKvPool: num_blocks must be in [1, 2^31 / block_size), got " + std::to_string(num_blocks));
  k_scales_.assign(static_cast<size_t>(num_layers), 1.0f);
  v_scales_.assign(static_cast<size_t>(num_layers), 1.0f);
  bytes_ = bytes_per_block(shape, num_layers, block_size, device, kv_dtype_);
  TVLLM_REQUIRE(static_cast<double>(bytes_) * static_cast<double>(num_blocks) < 4.6e18,
                "PagedKvPool: the pool size overflows 64 bits");
  bytes_ *= static_cast<size_t>(num_blocks);
  if (device == Device::CUDA) {
    size_t free_bytes = 0, total_bytes = 0;
    TVLLM_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    TVLLM_REQUIRE(bytes_ <= free_bytes, describe() + " does not fit in the GPU's free memory (" +
                                            human_bytes(static_cast<double>(free_bytes)) + " of " +
                                            human_bytes(static_cast<double>(total_bytes)) +
                                            "): use fewer blocks (PagedKvPool::plan sizes the pool from what is free)");
    device_storage_ = DeviceBuffer(bytes_);  // CudaError naming the size if it still fails
  } else {
    host_storage_ = HostBuffer(bytes_);
  }
}

PagedKvPool PagedKvPool::for_model(const ModelConfig& config, int64_t num_blocks, int64_t block_size, Device device,
                                   KvCacheDtype kv_dtype) {
  return PagedKvPool(AttentionShape::from_config(config), config.num_hidden_layers, num_blocks, block_size, device,
                     kv_dtype);
}

PagedKvPool PagedKvPool::fill_free_memory(const ModelConfig& config, int64_t block_size, const KvPoolBudget& budget,
                                          std::ostream* log, KvCacheDtype kv_dtype) {
  const AttentionShape shape = AttentionShape::from_config(config);
  const KvPoolPlan p = plan(shape, config.num_hidden_layers, block_size, budget, kv_dtype);
  if (log) *log << p.describe() << " (" << kv_cache_dtype_name(kv_dtype == KvCacheDtype::FP8 ? KvCacheDtype::FP8
                                                                                             : KvCacheDtype::BF16)
                << " KV)\n";
  return PagedKvPool(shape, config.num_hidden_layers, p.num_blocks, block_size, Device::CUDA, kv_dtype);
}

DType PagedKvPool::dtype() const {
  if (device_ != Device::CUDA) return DType::F32;
  return fp8() ? DType::F8_E4M3 : DType::BF16;
}

void PagedKvPool::set_scales(const std::vector<float>& k_scales, const std::vector<float>& v_scales) {
  for (const std::vector<float>* s : {&k_scales, &v_scales}) {
    const char* name = s == &k_scales ? "k" : "v";
    TVLLM_REQUIRE(static_cast<int64_t>(s->size()) == num_layers_,
                  std::string("PagedKvPool::set_scales: ") + std::to_string(s->size()) + " " + name + " scales for " +
                      std::to_string(num_layers_) + " layers (one per layer)");
    for (size_t l = 0; l < s->size(); ++l) {
      TVLLM_REQUIRE(std::isfinite((*s)[l]) && (*s)[l] > 0.0f,
                    std::string("PagedKvPool::set_scales: layer ") + std::to_string(l) + "'s " + name +
                        " scale must be finite and > 0, got " + std::to_string((*s)[l]));
    }
  }
  k_scales_ = k_scales;
  v_scales_ = v_scales;
}

KvQuant PagedKvPool::quant(int layer) const {
  TVLLM_REQUIRE(layer >= 0 && layer < num_layers_, "PagedKvPool::quant: layer " + std::to_string(layer) + " of " +
                                                       std::to_string(num_layers_));
  if (!fp8()) return {};
  return {true, k_scales_[static_cast<size_t>(layer)], v_scales_[static_cast<size_t>(layer)]};
}

TensorView PagedKvPool::k(int layer) const {
  TVLLM_REQUIRE(layer >= 0 && layer < num_layers_, "PagedKvPool: layer " + std::to_string(layer) + " of " +
                                                       std::to_string(num_layers_));
  char* base = static_cast<char*>(device_ == Device::CUDA ? device_storage_.data() : host_storage_.data());
  return TensorView::contiguous(base + layer_bytes() * static_cast<size_t>(2 * layer), dtype(), device_,
                                {num_blocks_, block_size_, shape_.kv_dim()});
}

TensorView PagedKvPool::v(int layer) const {
  TensorView t = k(layer);
  t.data = static_cast<char*>(t.data) + layer_bytes();
  return t;
}

std::string PagedKvPool::describe() const {
  return "KV pool: " + std::to_string(num_layers_) + " layers x 2 (k, v) x " + std::to_string(num_blocks_) +
         " blocks x " + std::to_string(block_size_) + " positions x " + std::to_string(shape_.kv_dim()) + " (" +
         std::to_string(shape_.n_kv_heads) + " kv heads x " + std::to_string(shape_.head_dim) + ") x " +
         std::string(dtype_name(dtype())) + (fp8() && device_ == Device::CPU ? " (holding E4M3-rounded values)" : "") +
         " = " + human_bytes(static_cast<double>(bytes_));
}

// ---- PagedStepTables ---------------------------------------------------------------------------------

PagedStepTables::PagedStepTables(int64_t max_tokens, int64_t max_sequences, int64_t max_blocks_per_seq,
                                 int64_t num_blocks, int64_t block_size, Device device)
    : max_tokens_(max_tokens),
      max_sequences_(max_sequences),
      max_blocks_(max_blocks_per_seq),
      num_blocks_(num_blocks),
      block_size_(block_size),
      device_(device) {
  TVLLM_REQUIRE(max_tokens >= 1 && max_tokens <= kMaxSlots,
                "PagedStepTables: max_tokens must be in [1, 2^31), got " + std::to_string(max_tokens));
  TVLLM_REQUIRE(max_sequences >= 1 && max_sequences <= AttentionBatch::kMaxSequences,
                "PagedStepTables: max_sequences must be in [1, " + std::to_string(AttentionBatch::kMaxSequences) +
                    "], got " + std::to_string(max_sequences));
  require_block_size(block_size, device, "PagedStepTables");
  TVLLM_REQUIRE(num_blocks >= 1 && num_blocks <= kMaxSlots / block_size,
                "PagedStepTables: num_blocks must be in [1, 2^31 / block_size), got " + std::to_string(num_blocks));
  TVLLM_REQUIRE(max_blocks_per_seq >= 1 && max_blocks_per_seq <= kMaxSlots / block_size,
                "PagedStepTables: max_blocks_per_seq must be in [1, 2^31 / block_size), got " +
                    std::to_string(max_blocks_per_seq));
  table_lens_.reserve(static_cast<size_t>(max_sequences));  // set() never reallocates
  const size_t bytes = static_cast<size_t>(max_tokens + max_sequences * max_blocks_per_seq) * sizeof(int32_t);
  staging_ = HostBuffer(bytes, device == Device::CUDA ? HostBuffer::Kind::Pinned : HostBuffer::Kind::Pageable);
  std::memset(staging_.data(), 0, bytes);
  if (device == Device::CUDA) {
    device_arrays_ = DeviceBuffer(bytes);
    device_arrays_.fill_zero();  // unused table entries name block 0: a stray read stays inside the pool
    TVLLM_CUDA_CHECK(cudaEventCreateWithFlags(&copied_, cudaEventDisableTiming));
  }
}

PagedStepTables::~PagedStepTables() { release(); }

void PagedStepTables::release() noexcept {
  if (copied_) {
    if (copy_recorded_) cudaEventSynchronize(copied_);  // the staging buffer outlives a copy reading it
    cudaEventDestroy(copied_);
  }
  copied_ = nullptr;
  copy_recorded_ = false;
}

PagedStepTables::PagedStepTables(PagedStepTables&& other) noexcept { *this = std::move(other); }

PagedStepTables& PagedStepTables::operator=(PagedStepTables&& other) noexcept {
  if (this != &other) {
    release();
    max_tokens_ = std::exchange(other.max_tokens_, 0);
    max_sequences_ = std::exchange(other.max_sequences_, 0);
    max_blocks_ = std::exchange(other.max_blocks_, 0);
    num_blocks_ = other.num_blocks_;
    block_size_ = other.block_size_;
    device_ = other.device_;
    num_tokens_ = std::exchange(other.num_tokens_, 0);
    table_lens_ = std::move(other.table_lens_);
    staging_ = std::move(other.staging_);
    device_arrays_ = std::move(other.device_arrays_);
    copied_ = std::exchange(other.copied_, nullptr);
    copy_recorded_ = std::exchange(other.copy_recorded_, false);
  }
  return *this;
}

void PagedStepTables::set(const std::vector<int32_t>& slot_mapping,
                          const std::vector<std::vector<int32_t>>& block_tables, cudaStream_t stream) {
  TVLLM_REQUIRE(max_sequences_ > 0, "PagedStepTables: made without a capacity (use the sizing constructor)");
  TVLLM_REQUIRE(!block_tables.empty(), "PagedStepTables: a step needs at least one sequence");
  TVLLM_REQUIRE(static_cast<int64_t>(block_tables.size()) <= max_sequences_,
                "PagedStepTables: " + std::to_string(block_tables.size()) + " sequences exceed the capacity of " +
                    std::to_string(max_sequences_) + " (max_sequences)");
  TVLLM_REQUIRE(static_cast<int64_t>(slot_mapping.size()) <= max_tokens_,
                "PagedStepTables: " + std::to_string(slot_mapping.size()) + " tokens exceed the capacity of " +
                    std::to_string(max_tokens_) + " (max_tokens)");
  const int64_t num_slots = num_blocks_ * block_size_;
  for (size_t t = 0; t < slot_mapping.size(); ++t)
    TVLLM_REQUIRE(slot_mapping[t] >= -1 && slot_mapping[t] < num_slots,
                  "PagedStepTables: token " + std::to_string(t) + " maps to KV slot " + std::to_string(slot_mapping[t]) +
                      ", outside [-1, " + std::to_string(num_slots) + ")");
  size_t width = 0;  // the longest table: the columns the 2-D copy moves
  for (size_t b = 0; b < block_tables.size(); ++b) {
    const std::vector<int32_t>& row = block_tables[b];
    TVLLM_REQUIRE(static_cast<int64_t>(row.size()) <= max_blocks_,
                  "PagedStepTables: sequence " + std::to_string(b) + " has " + std::to_string(row.size()) +
                      " blocks, more than max_blocks_per_seq " + std::to_string(max_blocks_));
    for (size_t i = 0; i < row.size(); ++i)
      TVLLM_REQUIRE(row[i] >= 0 && row[i] < num_blocks_, "PagedStepTables: block " + std::to_string(i) + " of sequence " +
                                                            std::to_string(b) + " is " + std::to_string(row[i]) +
                                                            ", outside the pool's " + std::to_string(num_blocks_) + " blocks");
    width = std::max(width, row.size());
  }
  // Valid: now the staging buffer may change (once the previous copies have read it).
  if (device_ == Device::CUDA && copy_recorded_) TVLLM_CUDA_CHECK(cudaEventSynchronize(copied_));
  int32_t* staging = staging_.as<int32_t>();
  std::copy(slot_mapping.begin(), slot_mapping.end(), staging);
  int32_t* tables = staging + max_tokens_;
  for (size_t b = 0; b < block_tables.size(); ++b)
    std::copy(block_tables[b].begin(), block_tables[b].end(), tables + static_cast<int64_t>(b) * max_blocks_);
  if (device_ == Device::CUDA) {
    int32_t* device = device_arrays_.as<int32_t>();
    if (!slot_mapping.empty())
      TVLLM_CUDA_CHECK(cudaMemcpyAsync(device, staging, slot_mapping.size() * sizeof(int32_t), cudaMemcpyHostToDevice,
                                       stream));
    if (width > 0) {
      // B rows of `width` entries, both sides max_blocks_per_seq apart: only the used columns cross the bus.
      const size_t pitch = static_cast<size_t>(max_blocks_) * sizeof(int32_t);
      TVLLM_CUDA_CHECK(cudaMemcpy2DAsync(device + max_tokens_, pitch, tables, pitch, width * sizeof(int32_t),
                                         block_tables.size(), cudaMemcpyHostToDevice, stream));
    }
    TVLLM_CUDA_CHECK(cudaEventRecord(copied_, stream));
    copy_recorded_ = true;
  }
  num_tokens_ = static_cast<int64_t>(slot_mapping.size());
  table_lens_.resize(block_tables.size());  // within the reserved capacity: no allocation
  for (size_t b = 0; b < block_tables.size(); ++b) table_lens_[b] = static_cast<int64_t>(block_tables[b].size());
}

const int32_t* PagedStepTables::host_slot_mapping() const { return staging_.as<const int32_t>(); }

const int32_t* PagedStepTables::host_block_table(int b) const {
  TVLLM_REQUIRE(b >= 0 && b < num_sequences(), "PagedStepTables: sequence " + std::to_string(b) + " of " +
                                                   std::to_string(num_sequences()));
  return staging_.as<const int32_t>() + max_tokens_ + static_cast<int64_t>(b) * max_blocks_;
}

const int32_t* PagedStepTables::device_slot_mapping() const { return device_arrays_.as<const int32_t>(); }

const int32_t* PagedStepTables::device_block_tables() const {
  return device_arrays_.empty() ? nullptr : device_arrays_.as<const int32_t>() + max_tokens_;
}

// ---- argument checks -------------------------------------------------------------------------------------

void check_paged_step(const AttentionBatch& batch, const PagedStepTables& tables, const char* op) {
  TVLLM_REQUIRE(batch.batch_size() >= 1, std::string(op) + ": the AttentionBatch is empty (set it first)");
  TVLLM_REQUIRE(batch.device() == tables.device(), std::string(op) + ": the AttentionBatch and the PagedStepTables "
                                                                     "must be made for the same device");
  TVLLM_REQUIRE(tables.num_sequences() == batch.batch_size(),
                std::string(op) + ": " + std::to_string(tables.num_sequences()) + " block tables for " +
                    std::to_string(batch.batch_size()) + " sequences (PagedStepTables::set: one per sequence)");
  TVLLM_REQUIRE(tables.num_tokens() == batch.total_q(),
                std::string(op) + ": a slot mapping of " + std::to_string(tables.num_tokens()) + " entries for " +
                    std::to_string(batch.total_q()) + " new tokens (one per token)");
  const int64_t bs = tables.block_size();
  const int32_t* slots = tables.host_slot_mapping();
  for (int b = 0; b < batch.batch_size(); ++b) {
    const int64_t k_len = batch.k_len(b), q_len = batch.q_len(b);
    TVLLM_REQUIRE(tables.table_len(b) * bs >= k_len,
                  std::string(op) + ": sequence " + std::to_string(b) + " has " + std::to_string(k_len) +
                      " positions but its block table only " + std::to_string(tables.table_len(b)) + " blocks of " +
                      std::to_string(bs));
    // A token's slot must be the one its table gives its position: attention reads the key back through the table.
    const int32_t* table = tables.host_block_table(b);
    for (int64_t i = 0; i < q_len; ++i) {
      const int64_t pos = k_len - q_len + i, t = batch.q_begin(b) + i;
      const int64_t want = static_cast<int64_t>(table[pos / bs]) * bs + pos % bs;
      TVLLM_REQUIRE(slots[t] == -1 || slots[t] == want,
                    std::string(op) + ": token " + std::to_string(t) + " (sequence " + std::to_string(b) +
                        ", position " + std::to_string(pos) + ") maps to KV slot " + std::to_string(slots[t]) +
                        " but its block table puts that position at slot " + std::to_string(want));
    }
  }
}

namespace {

DType dtype_on(Device device) { return device == Device::CUDA ? DType::BF16 : DType::F32; }
// The pool's dtype for a format: an FP8 pool on CUDA holds E4M3 codes.
DType pool_dtype_on(Device device, const KvQuant& quant) {
  return device == Device::CUDA && quant.fp8 ? DType::F8_E4M3 : dtype_on(device);
}

void check_quant(const KvQuant& quant, const char* op) {
  if (!quant.fp8) return;
  for (float s : {quant.k_scale, quant.v_scale}) {
    TVLLM_REQUIRE(std::isfinite(s) && s > 0.0f,
                  std::string(op) + ": an FP8 KV scale must be finite and > 0, got " + std::to_string(s));
  }
}

// One layer of the pool: [num_blocks, block_size, kv_dim] as the tables were made for, contiguous, k and v alike.
void check_pool(const TensorView& pool_k, const TensorView& pool_v, const AttentionShape& shape,
                const PagedStepTables& tables, Device device, const char* op, const KvQuant& quant = {}) {
  check_quant(quant, op);
  const DType want = pool_dtype_on(device, quant);
  for (const TensorView* t : {&pool_k, &pool_v}) {
    const char* name = t == &pool_k ? "pool_k" : "pool_v";
    TVLLM_REQUIRE(t->rank() == 3 && t->shape[0] == tables.num_blocks() && t->shape[1] == tables.block_size() &&
                      t->shape[2] == shape.kv_dim() && t->is_contiguous(),
                  std::string(op) + ": " + name + " must be a contiguous [" + std::to_string(tables.num_blocks()) +
                      ", " + std::to_string(tables.block_size()) + ", " + std::to_string(shape.kv_dim()) +
                      "] view (PagedKvPool::k/v, as the PagedStepTables were made), got " + t->describe());
    TVLLM_REQUIRE(t->device == device && t->dtype == want,
                  std::string(op) + ": " + name + " must be " + std::string(dtype_name(want)) + " on " +
                      std::string(device_name(device)) + (quant.fp8 ? " (an FP8 KV pool)" : "") + ", got " +
                      t->describe() + " (the KvQuant must describe the pool: PagedKvPool::quant)");
    TVLLM_REQUIRE(t->data != nullptr, std::string(op) + ": " + name + " has no data");
  }
  TVLLM_REQUIRE(tables.device() == device, std::string(op) + ": the PagedStepTables must be made for " +
                                               std::string(device_name(device)));
}

// New rows k or v [T, kv_dim]: unit column stride, any row stride (views into the fused QKV buffer).
void check_new_rows(const TensorView& t, const char* name, int64_t rows, const AttentionShape& shape, Device device) {
  const std::string what = std::string("paged_kv_write: ") + name;
  TVLLM_REQUIRE(t.rank() == 2 && t.shape[0] == rows && t.shape[1] == shape.kv_dim(),
                what + " must be [" + std::to_string(rows) + ", " + std::to_string(shape.kv_dim()) +
                    "] (one row per slot-mapping entry), got " + t.describe());
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

void check_paged_kv_write(const TensorView& pool_k, const TensorView& pool_v, const PagedStepTables& tables,
                          const AttentionShape& shape, const KvQuant& quant) {
  shape.validate();
  check_pool(pool_k, pool_v, shape, tables, pool_k.device, "paged_kv_write", quant);
}

void paged_kv_write(const TensorView& pool_k, const TensorView& pool_v, const TensorView& k, const TensorView& v,
                    const PagedStepTables& tables, const AttentionShape& shape, cudaStream_t stream,
                    const KvQuant& quant) {
  shape.validate();
  const Device device = k.device;
  check_pool(pool_k, pool_v, shape, tables, device, "paged_kv_write", quant);
  check_new_rows(k, "k", tables.num_tokens(), shape, device);
  check_new_rows(v, "v", tables.num_tokens(), shape, device);
  if (tables.num_tokens() == 0) return;
  if (device == Device::CPU) {
    if (quant.fp8) paged_kv_write_fp8_cpu(pool_k, pool_v, k, v, tables, quant);
    else paged_kv_write_cpu(pool_k, pool_v, k, v, tables);
  } else {
    require_cuda_head_dim(shape, "paged_kv_write");
    paged_kv_write_cuda(pool_k, pool_v, k, v, tables, stream, quant);
  }
}

void paged_decode_attention(const TensorView& out, const TensorView& q, const TensorView& pool_k,
                            const TensorView& pool_v, const AttentionBatch& batch, const PagedStepTables& tables,
                            const AttentionShape& shape, int num_splits, DecodeWorkspace* workspace,
                            cudaStream_t stream, DecodeAttention kernel, const KvQuant& quant) {
  TVLLM_REQUIRE(kernel != DecodeAttention::Flash, "paged_decode_attention runs a split decode kernel (Split or "
                                                  "Fast); Flash goes through paged_attention");
  check_attention_queries(out, q, batch, shape);
  const Device device = q.device;
  check_pool(pool_k, pool_v, shape, tables, device, "paged_decode_attention", quant);
  check_paged_step(batch, tables, "paged_decode_attention");
  TVLLM_REQUIRE(batch.max_q_len() <= 1, "paged_decode_attention: every sequence must bring at most one query "
                                        "(decode), but one brings " + std::to_string(batch.max_q_len()) +
                                            " (paged_attention runs those with the flash kernel)");
  TVLLM_REQUIRE(num_splits >= 1 && num_splits <= DecodeWorkspace::kMaxDecodeSplits,
                "paged_decode_attention: num_splits must be in [1, " +
                    std::to_string(DecodeWorkspace::kMaxDecodeSplits) + "], got " + std::to_string(num_splits));
  if (batch.total_q() == 0) return;
  if (device == Device::CPU) {
    paged_decode_attention_cpu(out, q, pool_k, pool_v, batch, tables, shape, num_splits);
    return;
  }
  require_cuda_head_dim(shape, "paged_decode_attention");
  TVLLM_REQUIRE(workspace != nullptr && workspace->partials() != nullptr,
                "paged_decode_attention on cuda needs a DecodeWorkspace made for cuda");
  TVLLM_REQUIRE(batch.batch_size() <= workspace->max_sequences(),
                "paged_decode_attention: " + std::to_string(batch.batch_size()) +
                    " sequences exceed the DecodeWorkspace's max_sequences of " +
                    std::to_string(workspace->max_sequences()));
  kernel = decode_kind_for(kernel, quant);  // Fast over FP8 without lesson 14's FP8 kernel: lesson 10's
  if (kernel == DecodeAttention::Fast && quant.fp8) {
    installed_fast_paged_decode_fp8()(out, q, pool_k, pool_v, batch, tables, shape, num_splits,
                                      static_cast<int>(shape.window), quant, *workspace, stream);
    return;
  }
  if (kernel == DecodeAttention::Fast) {
    const FastPagedDecodeFn fast = installed_fast_paged_decode();
    TVLLM_REQUIRE(fast != nullptr,
                  "paged_decode_attention: DecodeAttention::Fast is lesson 14's kernel, and it is not installed: call "
                  "install_fast_decode_attention() (lessons/14_performance/decode_attention_fast.h; use_fast_path "
                  "does) or ask for DecodeAttention::Split");
    // The shape's sliding window (Mistral), as lesson 10's kernel applies it (DecodeParams::window).
    fast(out, q, pool_k, pool_v, batch, tables, shape, num_splits, static_cast<int>(shape.window), *workspace,
         stream);
    return;
  }
  paged_decode_attention_cuda(out, q, pool_k, pool_v, batch, tables, shape, num_splits, *workspace, stream, quant);
}

namespace {
std::atomic<FastPagedDecodeFn> g_fast_paged{nullptr};  // lesson 14's kernel (kv_cache.cpp has the contiguous one)
std::atomic<FastPagedDecodeFp8Fn> g_fast_paged_fp8{nullptr};  // the same over an FP8 pool
}  // namespace

void install_fast_paged_decode_fp8(FastPagedDecodeFp8Fn fn) {
  TVLLM_REQUIRE(fn != nullptr, "install_fast_paged_decode_fp8: no kernel");
  g_fast_paged_fp8.store(fn);
}

FastPagedDecodeFp8Fn installed_fast_paged_decode_fp8() { return g_fast_paged_fp8.load(); }

DecodeAttention decode_kind_for(DecodeAttention asked, const KvQuant& quant) {
  if (asked == DecodeAttention::Fast && quant.fp8 && installed_fast_paged_decode_fp8() == nullptr)
    return DecodeAttention::Split;
  return asked;
}

void install_fast_paged_decode(FastPagedDecodeFn fn) {
  TVLLM_REQUIRE(fn != nullptr, "install_fast_paged_decode: no kernel");
  g_fast_paged.store(fn);
}

FastPagedDecodeFn installed_fast_paged_decode() { return g_fast_paged.load(); }

void paged_attention(const TensorView& out, const TensorView& q, const TensorView& pool_k, const TensorView& pool_v,
                     const AttentionBatch& batch, const PagedStepTables& tables, const AttentionShape& shape,
                     DecodeWorkspace* workspace, cudaStream_t stream, DecodeAttention decode, const KvQuant& quant) {
  if (batch.max_q_len() <= 1 && decode != DecodeAttention::Flash) {
    const int num_sms = q.device == Device::CUDA && workspace ? workspace->num_sms() : 0;
    // The kernel that will run picks the split count (Fast over FP8 may fall back to lesson 10's: decode_kind_for).
    const DecodeAttention kind = decode_kind_for(decode, quant);
    paged_decode_attention(out, q, pool_k, pool_v, batch, tables, shape,
                           decode_splits_for(kind, shape, batch.batch_size(), batch.max_k_len(), num_sms), workspace,
                           stream, kind, quant);
    return;
  }
  check_attention_queries(out, q, batch, shape);
  const Device device = q.device;
  check_pool(pool_k, pool_v, shape, tables, device, "paged_attention", quant);
  check_paged_step(batch, tables, "paged_attention");
  if (batch.total_q() == 0) return;  // nothing to attend (and a grid of zero blocks is a launch error)
  if (device == Device::CPU) {
    paged_prefill_attention_cpu(out, q, pool_k, pool_v, batch, tables, shape);
  } else {
    TVLLM_REQUIRE(flash_supports_head_dim(shape.head_dim),
                  "paged_attention: the flash kernel takes a head_dim that is a multiple of 8 from 8 to 256, got " +
                      std::to_string(shape.head_dim));
    paged_flash_attention_cuda(out, q, pool_k, pool_v, batch, tables, shape, stream, quant);
  }
}

namespace {
std::atomic<FastPagedPrefillFn> g_fast_paged_prefill{nullptr};  // lesson 15's kernel
}  // namespace

void install_fast_paged_prefill(FastPagedPrefillFn fn) { g_fast_paged_prefill.store(fn); }

FastPagedPrefillFn installed_fast_paged_prefill() { return g_fast_paged_prefill.load(); }

bool try_fast_paged_prefill(const TensorView& out, const TensorView& q, const TensorView& pool_k,
                            const TensorView& pool_v, const AttentionBatch& batch, const PagedStepTables& tables,
                            const AttentionShape& shape, cudaStream_t stream) {
  const FastPagedPrefillFn fn = installed_fast_paged_prefill();
  if (fn == nullptr || q.device != Device::CUDA || batch.max_q_len() <= 1) return false;
  return fn(out, q, pool_k, pool_v, batch, tables, shape, stream);
}

// ---- the CPU paths ---------------------------------------------------------------------------------------

void paged_kv_write_cpu(const TensorView& pool_k, const TensorView& pool_v, const TensorView& k, const TensorView& v,
                        const PagedStepTables& tables) {
  // --- exercise 12.6: the paged KV write ---------------------------------------------------------------------
  // Task: copy row t of k and of v (kv_dim floats each) into the pool at KV slot tables.host_slot_mapping()[t],
  //   for every token t of the step (tables.num_tokens() of them). A slot of -1 means "do not store" (a padding
  //   token): skip it.
  // Hint: the pool of one layer is [num_blocks, block_size, kv_dim] = num_blocks * block_size rows of kv_dim:
  //   slot s is row s (block s / block_size, offset s % block_size), at pool_k.ptr<float>() + s * kv_dim.
  // Hint: k.strides[0] is the row stride of k (a view into the fused QKV buffer has wider rows than kv_dim).
  // Tests: PagedKv12.WriteStoresRowsAtTheirSlots PagedKv12.PagedEqualsContiguous*
  // Tests: PagedKv12.PrefixSharedThroughTheSameBlocks PagedKv12.BackendEqualsTheContiguousCacheOnTheBundledModel
  // Stub:
  //   (void)pool_k;
  //   (void)pool_v;
  //   (void)k;
  //   (void)v;
  //   (void)tables;
  //   throw NotWrittenYet("12.6", "the paged KV write");
  // --- solution ---
  const int64_t kv_dim = pool_k.shape[2];
  const int32_t* slots = tables.host_slot_mapping();
  for (int64_t t = 0; t < tables.num_tokens(); ++t) {
    if (slots[t] < 0) continue;  // a padding token: nothing to store
    const int64_t at = static_cast<int64_t>(slots[t]) * kv_dim;
    std::memcpy(pool_k.ptr<float>() + at, k.ptr<const float>() + t * k.strides[0], kv_dim * sizeof(float));
    std::memcpy(pool_v.ptr<float>() + at, v.ptr<const float>() + t * v.strides[0], kv_dim * sizeof(float));
  }
  // --- end of exercise 12.6 ---
}

// The FP8 write on the CPU: what the GPU stores, decoded (kv_fp8_round), so every CPU reader sees the GPU's values.
void paged_kv_write_fp8_cpu(const TensorView& pool_k, const TensorView& pool_v, const TensorView& k,
                            const TensorView& v, const PagedStepTables& tables, const KvQuant& quant) {
  const int64_t kv_dim = pool_k.shape[2];
  const int32_t* slots = tables.host_slot_mapping();
  for (int64_t t = 0; t < tables.num_tokens(); ++t) {
    if (slots[t] < 0) continue;
    const int64_t at = static_cast<int64_t>(slots[t]) * kv_dim;
    const float* k_row = k.ptr<const float>() + t * k.strides[0];
    const float* v_row = v.ptr<const float>() + t * v.strides[0];
    for (int64_t c = 0; c < kv_dim; ++c) {
      pool_k.ptr<float>()[at + c] = kv_fp8_round(k_row[c], quant.k_scale);
      pool_v.ptr<float>()[at + c] = kv_fp8_round(v_row[c], quant.v_scale);
    }
  }
}

namespace {

// The pool row (KV slot) of position pos of a sequence whose block table row is `table`.
int64_t paged_row_cpu(const int32_t* table, int64_t pos, int64_t block_size) {
  // --- exercise 12.7: the block-table look-up ------------------------------------------------------------------
  // Task: position pos sits in block table[pos / block_size], at offset pos % block_size inside it: return that
  //   block's first row (block id times block_size) plus the offset. This is all that makes lesson 10's
  //   references (cache_attention_cpu.h: prefill and decode, written over a row function) read the pool.
  // Hint: the block id is an int32; widen it before the multiplication (a large pool passes 2^31 elements
  //   once the row is multiplied by kv_dim).
  // Tests: PagedKv12.PagedEqualsContiguous* PagedKv12.PrefixSharedThroughTheSameBlocks
  // Tests: PagedKv12.DecodeSplitsAgree PagedKv12.BackendEqualsTheContiguousCacheOnTheBundledModel
  // Stub:
  //   (void)table;
  //   (void)pos;
  //   (void)block_size;
  //   throw NotWrittenYet("12.7", "the block-table look-up");
  // --- solution ---
  return static_cast<int64_t>(table[pos / block_size]) * block_size + pos % block_size;
  // --- end of exercise 12.7 ---
}

// Sequence b's rows: wherever its block table says.
auto table_rows(const PagedStepTables& tables, const AttentionShape& shape) {
  const int64_t block_size = tables.block_size(), kv_dim = shape.kv_dim();
  return [&tables, block_size, kv_dim](int b) {
    const int32_t* table = tables.host_block_table(b);
    return [table, block_size, kv_dim](int64_t j) { return paged_row_cpu(table, j, block_size) * kv_dim; };
  };
}

}  // namespace

void paged_prefill_attention_cpu(const TensorView& out, const TensorView& q, const TensorView& pool_k,
                                 const TensorView& pool_v, const AttentionBatch& batch, const PagedStepTables& tables,
                                 const AttentionShape& shape) {
  prefill_attention_over_rows_cpu(out, q, pool_k.ptr<const float>(), pool_v.ptr<const float>(), batch, shape,
                                  table_rows(tables, shape));
}

void paged_decode_attention_cpu(const TensorView& out, const TensorView& q, const TensorView& pool_k,
                                const TensorView& pool_v, const AttentionBatch& batch, const PagedStepTables& tables,
                                const AttentionShape& shape, int num_splits) {
  decode_attention_over_rows_cpu(out, q, pool_k.ptr<const float>(), pool_v.ptr<const float>(), batch, shape,
                                 num_splits, table_rows(tables, shape));
}

}  // namespace tvllm
