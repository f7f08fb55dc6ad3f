// Lesson 05: rotary position embedding (RoPE), with Llama 3's frequency scaling.
//
// Attention compares a query with keys by dot products, which know nothing about word order. RoPE
// rotates the query and key vectors by an angle proportional to the token's position, so that the dot
// product of a query at position m with a key at position n depends only on the offset m - n.
//
// Each head vector of head_dim numbers is split into head_dim/2 pairs; pair j turns by the angle
// pos * theta_j. Hugging Face's Llama checkpoints store q/k in the "rotate-half" layout: pair j is
// (x[j], x[j + half]), half = head_dim / 2:
//
//   x'[j]        = x[j] * cos(pos*theta_j) - x[j+half] * sin(pos*theta_j)
//   x'[j + half] = x[j+half] * cos(pos*theta_j) + x[j] * sin(pos*theta_j)
//
//   theta_j = rope_theta^(-2j / head_dim), then rescaled by the config's rope_scaling ("llama3").
//
// Meta's original checkpoints pair neighbours instead, (x[2j], x[2j+1]) ("interleaved"); the two are the
// same model after permuting the rows of the q_proj and k_proj weights (see permute_qk_rows below and
// README.md).
//
// Shapes (every view is row-major; the rows of q and k may be strided, e.g. views into one fused
// [T, q_dim + 2*kv_dim] qkv buffer, but the elements of one row must be contiguous):
//   q          [T, n_heads * head_dim]      head h at columns [h*head_dim, (h+1)*head_dim)  (in place)
//   k          [T, n_kv_heads * head_dim]                                                  (in place)
//   positions  I32 [T]                       any order: prefill passes 0..T-1, decode one token at p
//   table      cos/sin F32 [max_positions, head_dim/2]
// On the CPU q/k are F32 (the fp32 reference, the oracle); on the GPU they are BF16 with fp32 math.
//
// This header is included by .cu files: C++17 only.
#pragma once

#include <cuda_runtime.h>  // cudaStream_t

#include <cstdint>
#include <string_view>
#include <vector>

#include "common/tensor.h"
#include "model_config.h"

namespace tvllm {

// ---- frequencies --------------------------------------------------------------------------------

// theta_j for the pairs j = 0 .. head_dim/2 - 1 (radians per position), after the config's rope scaling,
// rounded to fp32 exactly as Hugging Face's _compute_default_rope_parameters / _compute_llama3_parameters
// compute them (the same fp32 operations in the same order), so that pos * theta_j is the same fp32
// angle here and in the reference. Throws InputError for an odd head_dim or a bad rope_scaling.
std::vector<float> rope_inv_freq(const ModelConfig& config);

// The factor Hugging Face multiplies cos and sin by: 1.0 for "default" and "llama3" (other RoPE
// variants such as YaRN use it; we keep it so the table code says where it would go).
float rope_attention_scaling(const ModelConfig& config);

// ---- the precomputed table -----------------------------------------------------------------------

// cos(pos * theta_j) and sin(pos * theta_j) for every position below max_positions, in fp32.
// The angle is the fp32 product (float)pos * theta_j, as Hugging Face computes it; cos and sin of that
// angle are evaluated in double and rounded once (so each entry is within half an fp32 ulp of the true
// value of the fp32 angle). Move-only: it may own device memory.
class RopeTable {
 public:
  // max_positions = 0 takes config.max_position_embeddings. Throws InputError for a bad config or size.
  static RopeTable build(const ModelConfig& config, int64_t max_positions = 0);

  // Copies the table (and theta_j) to the GPU, for the CUDA kernels. Idempotent.
  void upload_to_device();
  bool on_device() const { return !cos_device_.shape().empty(); }

  int64_t head_dim() const { return head_dim_; }
  int64_t half() const { return head_dim_ / 2; }
  int64_t max_positions() const { return max_positions_; }
  float attention_scaling() const { return attention_scaling_; }
  const std::vector<float>& inv_freq() const { return inv_freq_; }  // [half]

  // F32 [max_positions, half]. Device::CUDA needs upload_to_device() first (else InputError).
  TensorView cos(Device where) const;
  TensorView sin(Device where) const;
  // F32 [half]: theta_j, for kernels that compute sin and cos themselves.
  TensorView inv_freq_view(Device where) const;

 private:
  int64_t head_dim_ = 0;
  int64_t max_positions_ = 0;
  float attention_scaling_ = 1.0f;
  std::vector<float> inv_freq_;
  Tensor cos_host_, sin_host_;                          // [max_positions, half]
  Tensor cos_device_, sin_device_, inv_freq_device_;    // empty until upload_to_device()
};

// ---- applying RoPE -------------------------------------------------------------------------------

// The GPU versions (README.md compares them):
//   V1  one thread per (token, head, pair), q and k in two launches, cos/sin read from the table
//   V2  one thread per 8 consecutive pairs: 16-byte loads of x[j..j+8) and x[j+half..j+half+8),
//       q and k in one launch, cos/sin from the table (L2/L1-resident: every head of a token reuses it)
//   V3  as V2, but each block computes cos/sin of its tokens itself with sincosf (accurate, full range
//       reduction; NOT the __sinf fast-math intrinsic) into shared memory: no table at all
enum class RopeKernel { V1, V2, V3 };
inline constexpr RopeKernel kDefaultRopeKernel = RopeKernel::V2;
std::string_view rope_kernel_name(RopeKernel kernel);   // "v1", "v2", "v3"
RopeKernel parse_rope_kernel(std::string_view name);    // throws InputError
std::vector<RopeKernel> all_rope_kernels();

// Whether apply_rope checks that every position is in [0, table.max_positions()).
//   Validate: yes; an out-of-range position throws InputError. For device positions this copies them to
//             the host on the stream and waits for it (a synchronisation, 4*T bytes): fine for the lesson,
//             not for a decode loop, and not allowed inside a CUDA graph capture.
//   Trusted:  the caller guarantees the range (the engine generates positions itself). Nothing is copied
//             and nothing waits, so the call can be captured in a graph; the kernels still clamp the table
//             index into range, so a bad position can give a wrong rotation but never reads outside the table.
enum class PositionCheck { Validate, Trusted };

// Rotates q and k in place. The device of the views picks the path: CPU (F32, the fp32 reference) or
// CUDA (BF16, `kernel` picks the version; the table must have been uploaded once, at load time, with
// RopeTable::upload_to_device). On the GPU the kernels run on `stream` (nullptr: the legacy default
// stream) and the call returns without waiting; with PositionCheck::Trusted it allocates nothing and never
// synchronises. Throws InputError naming the problem for wrong shapes, dtypes, devices, strides or positions.
void apply_rope(const TensorView& q, const TensorView& k, const TensorView& positions, const RopeTable& table,
                RopeKernel kernel = kDefaultRopeKernel, PositionCheck check = PositionCheck::Validate,
                cudaStream_t stream = nullptr);

// ---- Meta's interleaved layout --------------------------------------------------------------------

// Within one head, the rotate-half (Hugging Face) index of interleaved (Meta) dimension d:
// pair j = d / 2, member c = d % 2  ->  c * half + j.      e.g. head_dim 8: 0 2 4 6 1 3 5 7 -> 0..7
inline int64_t rotate_half_index(int64_t interleaved_index, int64_t head_dim) {
  return (interleaved_index % 2) * (head_dim / 2) + interleaved_index / 2;
}
// The inverse: the interleaved index of rotate-half dimension r: r < half -> 2r, else 2(r - half) + 1.
inline int64_t interleaved_index(int64_t rotate_half_index, int64_t head_dim) {
  int64_t half = head_dim / 2;
  return rotate_half_index < half ? 2 * rotate_half_index : 2 * (rotate_half_index - half) + 1;
}

enum class QkLayout { Interleaved /* Meta's original checkpoints */, RotateHalf /* Hugging Face */ };

// Reorders the rows of a q_proj or k_proj weight ([n_heads * head_dim, in], or a bias [n_heads * head_dim])
// from one layout to the other: host views of any dtype, dst and src of the same shape, not overlapping.
// This is the permutation Hugging Face's conversion script applies to Meta's checkpoints; because
// y = x W^T, permuting W's rows permutes q's (and k's) columns the same way within every head.
void permute_qk_rows(const TensorView& dst, const TensorView& src, int64_t head_dim, QkLayout from, QkLayout to);

// RoPE in Meta's interleaved layout (pair j = (x[2j], x[2j+1])), CPU, F32, in place on x [T, heads*head_dim].
// Only for showing that both layouts give the same model (tests/test_05_rope.cpp, README.md).
void apply_rope_interleaved_cpu(const TensorView& x, const TensorView& positions, const RopeTable& table);

// ---- internals shared by the CPU and CUDA paths ---------------------------------------------------
namespace rope_detail {

// The validated geometry of one apply_rope call.
struct RopeShape {
  int64_t tokens = 0;
  int64_t q_heads = 0, k_heads = 0;
  int64_t head_dim = 0;
  int64_t q_row_stride = 0, k_row_stride = 0;  // elements between consecutive rows
};

// Checks one tensor to rotate ([T, heads*head_dim], rows contiguous) and returns its head count.
int64_t check_rotated(const TensorView& x, const char* what, int64_t tokens, int64_t head_dim, Device device,
                      DType dtype);
// Checks positions (I32 [T], contiguous) and, when `validate`, the range of every value (device positions
// are copied to the host on `stream`, which is then synchronised).
void check_positions(const TensorView& positions, int64_t tokens, int64_t max_positions, Device device,
                     bool validate, cudaStream_t stream = nullptr);

void apply_rope_cpu(const TensorView& q, const TensorView& k, const TensorView& positions, const RopeTable& table,
                    const RopeShape& shape);
void apply_rope_cuda(const TensorView& q, const TensorView& k, const TensorView& positions, const RopeTable& table,
                     const RopeShape& shape, RopeKernel kernel, cudaStream_t stream);

}  // namespace rope_detail
}  // namespace tvllm
