// The API boundary of lesson 07: the batch layout, the workspace, argument checks, and the dispatch
// to the CPU reference (attention_cpu.cpp) or the GPU kernels (attention.cu).
#include "attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <utility>

#include "model_config.h"

namespace tvllm {

std::string_view attention_kernel_name(AttentionKernel kernel) {
  return kernel == AttentionKernel::V1Materialized ? "v1" : "v2";
}

AttentionKernel parse_attention_kernel(std::string_view name) {
  if (name == "v1") return AttentionKernel::V1Materialized;
  if (name == "v2") return AttentionKernel::V2Flash;
  throw InputError("unknown attention kernel '" + std::string(name) + "' (expected v1 or v2)");
}

// ---- AttentionShape ------------------------------------------------------------------------------

AttentionShape AttentionShape::from_config(const ModelConfig& config) {
  AttentionShape s;
  s.n_heads = config.num_attention_heads;
  s.n_kv_heads = config.num_key_value_heads;
  s.head_dim = config.head_dim;
  s.window = config.sliding_window;  // 0 when config.json has none (or null)
  s.validate();
  return s;
}

double AttentionShape::scale() const { return 1.0 / std::sqrt(static_cast<double>(head_dim)); }

void AttentionShape::validate() const {
  TVLLM_REQUIRE(n_heads > 0 && n_kv_heads > 0 && head_dim > 0,
                "attention: n_heads, n_kv_heads and head_dim must be positive, got " + std::to_string(n_heads) +
                    ", " + std::to_string(n_kv_heads) + ", " + std::to_string(head_dim));
  TVLLM_REQUIRE(n_heads % n_kv_heads == 0, "attention: n_heads (" + std::to_string(n_heads) +
                                               ") must be a multiple of n_kv_heads (" +
                                               std::to_string(n_kv_heads) + ")");
  TVLLM_REQUIRE(n_heads <= 65535, "attention: at most 65535 heads, got " + std::to_string(n_heads));
  TVLLM_REQUIRE(window >= 0 && window <= std::numeric_limits<int32_t>::max(),
                "attention: window must be 0 (none) or a positive position count below 2^31, got " +
                    std::to_string(window));
}

// ---- views into a fused QKV buffer -----------------------------------------------------------------

QkvViews split_qkv(const TensorView& qkv, const AttentionShape& shape) {
  shape.validate();
  TVLLM_REQUIRE(qkv.rank() == 2 && qkv.shape[1] == shape.qkv_dim(),
                "split_qkv: qkv must be [T, " + std::to_string(shape.qkv_dim()) + "] (q | k | v), got " +
                    qkv.describe());
  return {qkv.columns(0, shape.q_dim()), qkv.columns(shape.q_dim(), shape.kv_dim()),
          qkv.columns(shape.q_dim() + shape.kv_dim(), shape.kv_dim())};
}

// ---- AttentionBatch ------------------------------------------------------------------------------

AttentionBatch::AttentionBatch(int64_t max_sequences, Device device) : capacity_(max_sequences), device_(device) {
  TVLLM_REQUIRE(max_sequences >= 1 && max_sequences <= kMaxSequences,
                "AttentionBatch: max_sequences must be in [1, " + std::to_string(kMaxSequences) + "], got " +
                    std::to_string(max_sequences));
  const size_t entries = static_cast<size_t>(max_sequences) + 1;
  cu_q_.reserve(entries);  // set_*() never reallocates
  cu_k_.reserve(entries);
  if (device == Device::CUDA) {
    device_arrays_ = DeviceBuffer(2 * entries * sizeof(int32_t));
    staging_ = HostBuffer(2 * entries * sizeof(int32_t), HostBuffer::Kind::Pinned);
    TVLLM_CUDA_CHECK(cudaEventCreateWithFlags(&copied_, cudaEventDisableTiming));
  }
}

AttentionBatch::~AttentionBatch() { release(); }

void AttentionBatch::release() noexcept {
  if (copied_) {
    // The pinned staging buffer is freed right after this: let a copy still reading it finish first.
    if (copy_recorded_) cudaEventSynchronize(copied_);
    cudaEventDestroy(copied_);  // a destructor must not throw: errors ignored
  }
  copied_ = nullptr;
  copy_recorded_ = false;
}

AttentionBatch::AttentionBatch(AttentionBatch&& other) noexcept { *this = std::move(other); }

AttentionBatch& AttentionBatch::operator=(AttentionBatch&& other) noexcept {
  if (this != &other) {
    release();
    cu_q_ = std::move(other.cu_q_);
    cu_k_ = std::move(other.cu_k_);
    capacity_ = std::exchange(other.capacity_, 0);
    device_ = other.device_;
    max_q_len_ = other.max_q_len_;
    max_k_len_ = other.max_k_len_;
    device_arrays_ = std::move(other.device_arrays_);
    staging_ = std::move(other.staging_);
    copied_ = std::exchange(other.copied_, nullptr);
    copy_recorded_ = std::exchange(other.copy_recorded_, false);
  }
  return *this;
}

namespace {

// Prefix sums of per-sequence counts, with the checks of set_lengths.
std::vector<int32_t> prefix_sums(const std::vector<int64_t>& lengths, const char* what) {
  std::vector<int32_t> cu{0};
  int64_t total = 0;
  for (size_t b = 0; b < lengths.size(); ++b) {
    TVLLM_REQUIRE(lengths[b] >= 0, std::string("AttentionBatch: sequence ") + std::to_string(b) + " has negative " +
                                       what + " length " + std::to_string(lengths[b]));
    total += lengths[b];
    TVLLM_REQUIRE(total <= std::numeric_limits<int32_t>::max(),
                  std::string("AttentionBatch: more than 2^31-1 ") + what + " tokens in one batch");
    cu.push_back(static_cast<int32_t>(total));
  }
  return cu;
}

void check_cu_seqlens(const std::vector<int32_t>& cu, const char* name) {
  TVLLM_REQUIRE(cu.size() >= 2, std::string("AttentionBatch: ") + name + " needs B+1 >= 2 entries, got " +
                                    std::to_string(cu.size()));
  TVLLM_REQUIRE(cu[0] == 0, std::string("AttentionBatch: ") + name + "[0] must be 0, got " + std::to_string(cu[0]));
  for (size_t b = 1; b < cu.size(); ++b) {
    TVLLM_REQUIRE(cu[b] >= cu[b - 1], std::string("AttentionBatch: ") + name + " must never decrease, but " + name +
                                          "[" + std::to_string(b) + "] = " + std::to_string(cu[b]) + " < " + name +
                                          "[" + std::to_string(b - 1) + "] = " + std::to_string(cu[b - 1]));
  }
}

}  // namespace

void AttentionBatch::set_lengths(const std::vector<int64_t>& q_lens, const std::vector<int64_t>& k_lens,
                                 cudaStream_t stream) {
  TVLLM_REQUIRE(!q_lens.empty(), "AttentionBatch: a batch needs at least one sequence");
  TVLLM_REQUIRE(q_lens.size() == k_lens.size(), "AttentionBatch: " + std::to_string(q_lens.size()) +
                                                    " query lengths but " + std::to_string(k_lens.size()) +
                                                    " key lengths");
  const std::vector<int32_t> cu_q = prefix_sums(q_lens, "query");  // checked first: the error names queries
  set_cu_seqlens(cu_q, prefix_sums(k_lens, "key"), stream);
}

void AttentionBatch::set_prefill(const std::vector<int64_t>& lengths, cudaStream_t stream) {
  set_lengths(lengths, lengths, stream);
}

void AttentionBatch::set_cu_seqlens(const std::vector<int32_t>& cu_seqlens_q, const std::vector<int32_t>& cu_seqlens_k,
                                    cudaStream_t stream) {
  // Everything is checked before anything changes: a bad batch leaves the previous one intact.
  check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q");
  check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k");
  TVLLM_REQUIRE(cu_seqlens_q.size() == cu_seqlens_k.size(),
                "AttentionBatch: cu_seqlens_q has " + std::to_string(cu_seqlens_q.size()) +
                    " entries but cu_seqlens_k has " + std::to_string(cu_seqlens_k.size()));
  const int64_t B = static_cast<int64_t>(cu_seqlens_q.size()) - 1;
  TVLLM_REQUIRE(B <= capacity_, "AttentionBatch: " + std::to_string(B) + " sequences exceed this batch's capacity of " +
                                    std::to_string(capacity_) + " (max_sequences)");
  int32_t max_q = 0, max_k = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int32_t nq = cu_seqlens_q[b + 1] - cu_seqlens_q[b], nk = cu_seqlens_k[b + 1] - cu_seqlens_k[b];
    TVLLM_REQUIRE(nq <= nk, "AttentionBatch: sequence " + std::to_string(b) + " has " + std::to_string(nq) +
                                " queries but only " + std::to_string(nk) +
                                " keys (its queries are the last q_len of its k_len tokens: q_len <= k_len)");
    max_q = std::max(max_q, nq);
    max_k = std::max(max_k, nk);
  }

  if (device_ == Device::CUDA) {
    const size_t entries = static_cast<size_t>(B) + 1, row = static_cast<size_t>(capacity_) + 1;
    // The previous set_*() queued an asynchronous copy FROM staging_; the host must not overwrite it
    // until that copy has run. The event recorded after it says so. In a step loop the copy finished
    // long ago (the previous step's kernels ran after it) and this returns at once.
    if (copy_recorded_) TVLLM_CUDA_CHECK(cudaEventSynchronize(copied_));
    int32_t* staging = staging_.as<int32_t>();
    std::copy(cu_seqlens_q.begin(), cu_seqlens_q.end(), staging);
    std::copy(cu_seqlens_k.begin(), cu_seqlens_k.end(), staging + row);
    // Pinned memory: the copies are truly asynchronous, ordered on `stream` before the kernels that read
    // the arrays. The device arrays keep their addresses (a captured graph may point at them).
    int32_t* device = device_arrays_.as<int32_t>();
    TVLLM_CUDA_CHECK(cudaMemcpyAsync(device, staging, entries * sizeof(int32_t), cudaMemcpyHostToDevice, stream));
    TVLLM_CUDA_CHECK(
        cudaMemcpyAsync(device + row, staging + row, entries * sizeof(int32_t), cudaMemcpyHostToDevice, stream));
    TVLLM_CUDA_CHECK(cudaEventRecord(copied_, stream));
    copy_recorded_ = true;
  }
  cu_q_.assign(cu_seqlens_q.begin(), cu_seqlens_q.end());  // within the reserved capacity: no allocation
  cu_k_.assign(cu_seqlens_k.begin(), cu_seqlens_k.end());
  max_q_len_ = max_q;
  max_k_len_ = max_k;
}

AttentionBatch AttentionBatch::prefill(const std::vector<int64_t>& lengths, Device device) {
  AttentionBatch batch(std::max<int64_t>(1, static_cast<int64_t>(lengths.size())), device);
  batch.set_prefill(lengths);
  return batch;
}

AttentionBatch AttentionBatch::with_lengths(const std::vector<int64_t>& q_lens, const std::vector<int64_t>& k_lens,
                                            Device device) {
  AttentionBatch batch(std::max<int64_t>(1, static_cast<int64_t>(q_lens.size())), device);
  batch.set_lengths(q_lens, k_lens);
  return batch;
}

const int32_t* AttentionBatch::cu_seqlens_q_device() const {
  return device_ == Device::CUDA ? device_arrays_.as<const int32_t>() : nullptr;
}

const int32_t* AttentionBatch::cu_seqlens_k_device() const {
  return device_ == Device::CUDA ? device_arrays_.as<const int32_t>() + capacity_ + 1 : nullptr;
}

// ---- AttentionWorkspace --------------------------------------------------------------------------

namespace {

std::string gib(double bytes) {
  char text[64];
  std::snprintf(text, sizeof text, "%.2f GiB", bytes / (1024.0 * 1024.0 * 1024.0));
  return text;
}

}  // namespace

size_t attention_workspace_bytes(AttentionKernel kernel, const AttentionShape& shape, const AttentionLimits& limits) {
  if (kernel == AttentionKernel::V2Flash) return 0;
  return static_cast<size_t>(shape.n_heads) * static_cast<size_t>(limits.max_q_len) *
         static_cast<size_t>(limits.max_k_len) * sizeof(float);
}

AttentionWorkspace::AttentionWorkspace(const AttentionShape& shape, const AttentionLimits& limits,
                                       AttentionKernel kernel, CublasHandle* cublas)
    : shape_(shape), limits_(limits), kernel_(kernel), cublas_(cublas) {
  shape.validate();
  TVLLM_REQUIRE(limits.max_sequences >= 1 && limits.max_sequences <= AttentionBatch::kMaxSequences,
                "AttentionWorkspace: max_sequences must be in [1, " + std::to_string(AttentionBatch::kMaxSequences) +
                    "], got " + std::to_string(limits.max_sequences));
  TVLLM_REQUIRE(limits.max_q_len >= 0 && limits.max_k_len >= limits.max_q_len &&
                    limits.max_k_len <= std::numeric_limits<int32_t>::max(),
                "AttentionWorkspace: need 0 <= max_q_len <= max_k_len < 2^31, got max_q_len " +
                    std::to_string(limits.max_q_len) + ", max_k_len " + std::to_string(limits.max_k_len));
  if (kernel != AttentionKernel::V1Materialized) return;
  TVLLM_REQUIRE(cublas != nullptr, "AttentionWorkspace for v1 needs a CublasHandle (v1 runs its GEMMs in cuBLAS)");
  const double bytes = static_cast<double>(shape.n_heads) * static_cast<double>(limits.max_q_len) *
                       static_cast<double>(limits.max_k_len) * sizeof(float);
  const std::string what = "attention v1 (materialised) needs " + gib(bytes) + " of device memory for its scores (" +
                           std::to_string(shape.n_heads) + " heads x " + std::to_string(limits.max_q_len) +
                           " queries x " + std::to_string(limits.max_k_len) + " keys x 4 bytes)";
  if (bytes > 0x1p62) throw CudaError(what + ", which does not fit; the flash kernel v2 needs none.");
  try {
    scratch_ = DeviceBuffer(attention_workspace_bytes(kernel, shape, limits));
  } catch (const CudaError& e) {
    throw CudaError(what + ", which does not fit; the flash kernel v2 needs none. (" + e.what() + ")");
  }
}

void AttentionWorkspace::check(const AttentionBatch& batch, const AttentionShape& shape, AttentionKernel kernel) const {
  TVLLM_REQUIRE(shape == shape_, "attention: the workspace was made for " + std::to_string(shape_.n_heads) + "/" +
                                     std::to_string(shape_.n_kv_heads) + " heads of " +
                                     std::to_string(shape_.head_dim) + " dims, not " +
                                     std::to_string(shape.n_heads) + "/" + std::to_string(shape.n_kv_heads) +
                                     " of " + std::to_string(shape.head_dim));
  TVLLM_REQUIRE(kernel != AttentionKernel::V1Materialized || kernel_ == AttentionKernel::V1Materialized,
                "attention v1: this AttentionWorkspace was made for v2 and holds no scores (make it for v1)");
  TVLLM_REQUIRE(batch.batch_size() <= limits_.max_sequences,
                "attention: the batch has " + std::to_string(batch.batch_size()) +
                    " sequences, more than the workspace's limit max_sequences = " +
                    std::to_string(limits_.max_sequences));
  TVLLM_REQUIRE(batch.max_q_len() <= limits_.max_q_len,
                "attention: a sequence has " + std::to_string(batch.max_q_len()) +
                    " queries, more than the workspace's limit max_q_len = " + std::to_string(limits_.max_q_len));
  TVLLM_REQUIRE(batch.max_k_len() <= limits_.max_k_len,
                "attention: a sequence has " + std::to_string(batch.max_k_len()) +
                    " keys, more than the workspace's limit max_k_len = " + std::to_string(limits_.max_k_len));
}

// ---- the API boundary ----------------------------------------------------------------------------

namespace {

// A 2-D view [rows, cols] with unit column stride and rows at least `cols` apart.
void require_rows(const TensorView& t, const char* name, int64_t rows, int64_t cols, DType dtype, Device device) {
  const std::string what = std::string("attention: ") + name;
  TVLLM_REQUIRE(t.rank() == 2 && t.shape[0] == rows && t.shape[1] == cols,
                what + " must be [" + std::to_string(rows) + ", " + std::to_string(cols) + "], got " + t.describe());
  TVLLM_REQUIRE(t.device == device, what + " is on " + std::string(device_name(t.device)) + " but q is on " +
                                        std::string(device_name(device)));
  TVLLM_REQUIRE(t.dtype == dtype, what + " must be " + std::string(dtype_name(dtype)) + " on " +
                                      std::string(device_name(device)) + ", got " + t.describe());
  TVLLM_REQUIRE(t.strides.size() == 2 && (cols <= 1 || t.strides[1] == 1),
                what + " must have contiguous columns (column stride 1)");
  TVLLM_REQUIRE(rows <= 1 || (t.strides[0] >= cols && t.strides[0] <= std::numeric_limits<int32_t>::max()),
                what + " rows must be at least " + std::to_string(cols) + " and less than 2^31 elements apart, got " +
                    std::to_string(t.strides[0]));
  TVLLM_REQUIRE(rows == 0 || t.data != nullptr, what + " has no data");
  // The GPU kernels read and write rows with 16-byte vectors: every row start must be 16-byte aligned.
  if (device == Device::CUDA && rows > 0) {
    TVLLM_REQUIRE(reinterpret_cast<uintptr_t>(t.data) % 16 == 0, what + " must start at a 16-byte aligned address");
    TVLLM_REQUIRE(rows <= 1 || t.strides[0] % 8 == 0,
                  what + " rows must be a multiple of 8 elements (16 bytes) apart, got " +
                      std::to_string(t.strides[0]));
  }
}

}  // namespace

void check_attention_queries(const TensorView& out, const TensorView& q, const AttentionBatch& batch,
                             const AttentionShape& shape) {
  shape.validate();
  const Device device = q.device;
  const DType dtype = device == Device::CUDA ? DType::BF16 : DType::F32;
  TVLLM_REQUIRE(batch.batch_size() >= 1, "attention: the AttentionBatch is empty (set it first)");
  TVLLM_REQUIRE(batch.device() == device, "attention: the AttentionBatch was made for " +
                                              std::string(device_name(batch.device())) + " but q is on " +
                                              std::string(device_name(device)));
  const int64_t T = batch.total_q();
  TVLLM_REQUIRE(q.rank() != 2 || q.shape[0] == T, "attention: q has " + std::to_string(q.shape[0]) +
                                                      " rows but cu_seqlens_q covers " + std::to_string(T) +
                                                      " queries");
  require_rows(q, "q", T, shape.q_dim(), dtype, device);
  require_rows(out, "out", T, shape.q_dim(), dtype, device);
  if (device == Device::CUDA) {
    // Rows are read as 16-byte vectors: every head must start 16-byte aligned.
    TVLLM_REQUIRE(shape.head_dim % 8 == 0, "attention on cuda: head_dim must be a multiple of 8, got " +
                                               std::to_string(shape.head_dim));
  }
}

void attention(const TensorView& out, const TensorView& q, const TensorView& k, const TensorView& v,
               const AttentionBatch& batch, const AttentionShape& shape, AttentionKernel kernel,
               AttentionWorkspace* workspace, cudaStream_t stream) {
  check_attention_queries(out, q, batch, shape);
  const Device device = q.device;
  const DType dtype = device == Device::CUDA ? DType::BF16 : DType::F32;
  const int64_t Tk = batch.total_k();
  TVLLM_REQUIRE(k.rank() != 2 || k.shape[0] == Tk, "attention: k has " + std::to_string(k.shape[0]) +
                                                       " rows but cu_seqlens_k covers " + std::to_string(Tk) + " keys");
  require_rows(k, "k", Tk, shape.kv_dim(), dtype, device);
  require_rows(v, "v", Tk, shape.kv_dim(), dtype, device);
  if (device == Device::CPU) {
    attention_cpu(out, q, k, v, batch, shape);
    return;
  }
  if (kernel == AttentionKernel::V2Flash) {
    TVLLM_REQUIRE(flash_supports_head_dim(shape.head_dim),
                  "attention v2 (flash) takes a head_dim that is a multiple of 8 from 8 to 256, got " +
                      std::to_string(shape.head_dim) + " (use --kernel v1)");
  } else {
    TVLLM_REQUIRE(workspace != nullptr,
                  "attention v1 needs an AttentionWorkspace made for v1 (its scores and a CublasHandle)");
  }
  if (workspace) workspace->check(batch, shape, kernel);
  if (batch.total_q() == 0) return;
  attention_cuda(out, q, k, v, batch, shape, kernel, workspace, stream);
}

// ---- the fresh-prefill seam (attention.h) ---------------------------------------------------------------------

namespace {
std::atomic<FreshPrefillFn> g_fresh_prefill{nullptr};
}  // namespace

void install_fresh_prefill(FreshPrefillFn fn) { g_fresh_prefill.store(fn); }

FreshPrefillFn installed_fresh_prefill() { return g_fresh_prefill.load(); }

bool is_fresh_prefill(const AttentionBatch& batch) {
  return batch.max_q_len() > 1 && batch.cu_seqlens_q() == batch.cu_seqlens_k();
}

bool try_fresh_prefill(const TensorView& out, const TensorView& q, const TensorView& k, const TensorView& v,
                       const AttentionBatch& batch, const AttentionShape& shape, cudaStream_t stream) {
  const FreshPrefillFn fn = installed_fresh_prefill();
  if (fn == nullptr || q.device != Device::CUDA || !is_fresh_prefill(batch)) return false;
  return fn(out, q, k, v, batch, shape, stream);
}

}  // namespace tvllm
