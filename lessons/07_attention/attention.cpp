// The API boundary of lesson 07: the varlen batch, the workspace, argument checks, and the dispatch
// to the CPU reference (attention_cpu.cpp) or the GPU kernels (attention.cu).
#include "attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

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
}

// ---- VarlenBatch ---------------------------------------------------------------------------------

VarlenBatch VarlenBatch::from_lengths(const std::vector<int64_t>& lengths, Device device) {
  TVLLM_REQUIRE(!lengths.empty(), "VarlenBatch: a batch needs at least one sequence");
  std::vector<int32_t> cu{0};
  int64_t total = 0;
  for (size_t b = 0; b < lengths.size(); ++b) {
    TVLLM_REQUIRE(lengths[b] >= 0, "VarlenBatch: sequence " + std::to_string(b) + " has negative length " +
                                       std::to_string(lengths[b]));
    total += lengths[b];
    TVLLM_REQUIRE(total <= std::numeric_limits<int32_t>::max(),
                  "VarlenBatch: more than 2^31-1 tokens in one batch");
    cu.push_back(static_cast<int32_t>(total));
  }
  return from_cu_seqlens(cu, device);
}

VarlenBatch VarlenBatch::from_cu_seqlens(const std::vector<int32_t>& cu_seqlens, Device device) {
  TVLLM_REQUIRE(cu_seqlens.size() >= 2, "VarlenBatch: cu_seqlens needs B+1 >= 2 entries, got " +
                                            std::to_string(cu_seqlens.size()));
  TVLLM_REQUIRE(static_cast<int64_t>(cu_seqlens.size()) - 1 <= kMaxSequences,
                "VarlenBatch: at most " + std::to_string(kMaxSequences) + " sequences per batch, got " +
                    std::to_string(cu_seqlens.size() - 1));
  TVLLM_REQUIRE(cu_seqlens[0] == 0, "VarlenBatch: cu_seqlens[0] must be 0, got " + std::to_string(cu_seqlens[0]));
  VarlenBatch batch;
  for (size_t b = 1; b < cu_seqlens.size(); ++b) {
    TVLLM_REQUIRE(cu_seqlens[b] >= cu_seqlens[b - 1],
                  "VarlenBatch: cu_seqlens must never decrease, but cu_seqlens[" + std::to_string(b) + "] = " +
                      std::to_string(cu_seqlens[b]) + " < cu_seqlens[" + std::to_string(b - 1) +
                      "] = " + std::to_string(cu_seqlens[b - 1]));
    batch.max_seqlen_ = std::max(batch.max_seqlen_, cu_seqlens[b] - cu_seqlens[b - 1]);
  }
  batch.cu_seqlens_ = cu_seqlens;
  batch.device_ = device;
  if (device == Device::CUDA) {
    batch.device_copy_ =
        Tensor::from_i32(cu_seqlens, {static_cast<int64_t>(cu_seqlens.size())}, Device::CUDA);
  }
  return batch;
}

const int32_t* VarlenBatch::cu_seqlens_device() const {
  return device_ == Device::CUDA ? static_cast<const int32_t*>(device_copy_.data()) : nullptr;
}

// ---- AttentionWorkspace --------------------------------------------------------------------------

AttentionWorkspace::~AttentionWorkspace() {
  if (cublas_) cublasDestroy(cublas_);  // a destructor must not throw
}

void* AttentionWorkspace::scratch(size_t bytes) {
  if (scratch_.bytes() < bytes) {
    scratch_ = DeviceBuffer();          // free the old buffer first: old + new may not fit together
    scratch_ = DeviceBuffer(bytes);     // throws CudaError naming the size
  }
  return scratch_.data();
}

cublasHandle_t AttentionWorkspace::cublas() {
  if (!cublas_) {
    TVLLM_CUBLAS_CHECK(cublasCreate(&cublas_));
    // By default cuBLAS may add up split-K partial sums in the OUTPUT type (bf16 for P V), which costs
    // an extra rounding per partial sum; keep every reduction in fp32, as the flash kernel does.
    TVLLM_CUBLAS_CHECK(cublasSetMathMode(cublas_, CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION));
  }
  return cublas_;
}

size_t attention_workspace_bytes(AttentionKernel kernel, const VarlenBatch& batch, const AttentionShape& shape) {
  if (kernel == AttentionKernel::V2Flash) return 0;
  const size_t n = static_cast<size_t>(batch.max_seqlen());
  return static_cast<size_t>(shape.n_heads) * n * n * sizeof(float);
}

// ---- the API boundary ----------------------------------------------------------------------------

namespace {

void require_matrix(const TensorView& t, const char* name, int64_t rows, int64_t cols, DType dtype, Device device) {
  TVLLM_REQUIRE(t.rank() == 2 && t.shape[0] == rows && t.shape[1] == cols,
                std::string("attention: ") + name + " must be [" + std::to_string(rows) + ", " +
                    std::to_string(cols) + "], got " + t.describe());
  TVLLM_REQUIRE(t.device == device, std::string("attention: ") + name + " is on " +
                                        std::string(device_name(t.device)) + " but q is on " +
                                        std::string(device_name(device)));
  TVLLM_REQUIRE(t.dtype == dtype, std::string("attention: ") + name + " must be " +
                                      std::string(dtype_name(dtype)) + " on " + std::string(device_name(device)) +
                                      ", got " + t.describe());
  TVLLM_REQUIRE(t.is_contiguous(), std::string("attention: ") + name + " must be contiguous");
  TVLLM_REQUIRE(rows == 0 || t.data != nullptr, std::string("attention: ") + name + " has no data");
  // The GPU kernels read and write rows with 16-byte vectors.
  if (device == Device::CUDA && rows > 0) {
    TVLLM_REQUIRE(reinterpret_cast<uintptr_t>(t.data) % 16 == 0,
                  std::string("attention: ") + name + " must start at a 16-byte aligned address");
  }
}

}  // namespace

void attention_prefill(const TensorView& out, const TensorView& q, const TensorView& k, const TensorView& v,
                       const VarlenBatch& batch, const AttentionShape& shape, AttentionKernel kernel,
                       AttentionWorkspace* workspace) {
  shape.validate();
  const Device device = q.device;
  const DType dtype = device == Device::CUDA ? DType::BF16 : DType::F32;
  TVLLM_REQUIRE(batch.batch_size() >= 1, "attention: the VarlenBatch is empty (build it with from_lengths)");
  TVLLM_REQUIRE(batch.device() == device, "attention: the VarlenBatch was built for " +
                                              std::string(device_name(batch.device())) + " but q is on " +
                                              std::string(device_name(device)));
  const int64_t T = batch.total_tokens();
  TVLLM_REQUIRE(q.rank() != 2 || q.shape[0] == T, "attention: q has " + std::to_string(q.rank() == 2 ? q.shape[0] : 0) +
                                                      " rows but cu_seqlens covers " + std::to_string(T) + " tokens");
  require_matrix(q, "q", T, shape.q_dim(), dtype, device);
  require_matrix(k, "k", T, shape.kv_dim(), dtype, device);
  require_matrix(v, "v", T, shape.kv_dim(), dtype, device);
  require_matrix(out, "out", T, shape.q_dim(), dtype, device);
  if (device == Device::CUDA) {
    // Rows are read as 16-byte vectors: every row start must stay 16-byte aligned.
    TVLLM_REQUIRE(shape.head_dim % 8 == 0, "attention on cuda: head_dim must be a multiple of 8, got " +
                                               std::to_string(shape.head_dim));
    if (kernel == AttentionKernel::V2Flash) {
      TVLLM_REQUIRE(flash_supports_head_dim(shape.head_dim),
                    "attention v2 (flash) is compiled for head_dim 64 and 128, got " +
                        std::to_string(shape.head_dim) + " (add a case in attention.cu, or use --kernel v1)");
    }
  }
  if (T == 0) return;
  if (device == Device::CPU) {
    attention_prefill_cpu(out, q, k, v, batch, shape);
    return;
  }
  if (workspace) {
    attention_prefill_cuda(out, q, k, v, batch, shape, kernel, *workspace);
  } else {
    AttentionWorkspace temporary;
    attention_prefill_cuda(out, q, k, v, batch, shape, kernel, temporary);
  }
}

}  // namespace tvllm
