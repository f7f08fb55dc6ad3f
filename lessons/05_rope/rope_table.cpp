// The frequencies theta_j (with Llama 3 scaling), the cos/sin table, and the Meta <-> Hugging Face
// layout permutation. Everything here runs once, at load time, on the host.
#include <cmath>
#include <cstring>
#include <numbers>
#include <string>

#include "common/errors.h"
#include "common/exercise.h"
#include "rope.h"

namespace tvllm {

namespace {

void check_head_dim(int64_t head_dim) {
  TVLLM_REQUIRE(head_dim >= 2 && head_dim % 2 == 0 && head_dim <= 4096,
                "RoPE needs an even head_dim in [2, 4096] (it rotates pairs of dimensions), got " +
                    std::to_string(head_dim));
}

}  // namespace

// Hugging Face computes theta_j with fp32 tensor operations. To get the very same fp32 numbers we do the
// same operations in the same order, each rounded to fp32 (transformers' modeling_rope_utils.py):
//
//   inv_freq = 1.0 / (base ** (arange(0, dim, 2).float() / dim))
//
// - `arange(...).float() / dim` is an fp32 division: exponent_j = fp32(2j / dim);
// - `base ** t` is torch's fp32 pow (accurate to ~1 ulp): we take pow in double and round once, which is
//   the correctly rounded value; torch agrees with it for every head_dim and base we tried;
// - `1.0 / t` is t.reciprocal() * 1.0: an fp32 reciprocal.
// A Python scalar meeting an fp32 tensor is converted to fp32 and the operation is done in fp32.
std::vector<float> rope_inv_freq(const ModelConfig& config) {
  check_head_dim(config.head_dim);
  TVLLM_REQUIRE(std::isfinite(config.rope_theta) && config.rope_theta > 1.0,
                "rope_theta must be a finite number > 1, got " + std::to_string(config.rope_theta));
  const int64_t half = config.head_dim / 2;
  const float base = static_cast<float>(config.rope_theta);
  const float dim = static_cast<float>(config.head_dim);

  std::vector<float> inv_freq(static_cast<size_t>(half));
  for (int64_t j = 0; j < half; ++j) {
    const float exponent = static_cast<float>(2 * j) / dim;
    const float power = static_cast<float>(std::pow(static_cast<double>(base), static_cast<double>(exponent)));
    inv_freq[j] = 1.0f / power;
  }

  const RopeScaling& rs = config.rope_scaling;
  if (rs.rope_type == "default") return inv_freq;
  TVLLM_REQUIRE(rs.rope_type == "llama3", "rope_scaling.rope_type \"" + rs.rope_type +
                                              "\" is not supported (tiny-vllm implements \"default\" and \"llama3\")");
  TVLLM_REQUIRE(rs.factor > 0 && rs.low_freq_factor > 0 && rs.high_freq_factor > rs.low_freq_factor &&
                    rs.original_max_position_embeddings > 0,
                "llama3 rope_scaling needs factor > 0, 0 < low_freq_factor < high_freq_factor and "
                "original_max_position_embeddings > 0");

  // Llama 3 keeps the fast-turning pairs (short wavelengths: they encode local order, which training saw
  // plenty of), slows the slow-turning pairs down by `factor` (so 8192 training positions stretch over
  // factor * 8192), and blends the two in the band between. Wavelength = positions per full turn = 2 pi / theta.
  //
  //   wavelen < old_len / high_freq_factor   keep theta
  //   wavelen > old_len / low_freq_factor    theta / factor
  //   otherwise                              (1 - s) * theta / factor + s * theta,
  //                                          s = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
  // --- exercise 05.1: Llama 3's frequency scaling ------------------------------------------------------
  // Task: rescale inv_freq[j] (theta_j, fp32) as Hugging Face's _compute_llama3_parameters does, with
  //   rs = config.rope_scaling: wavelen = 2 pi / theta; wavelen < old_len / high_freq_factor keeps
  //   theta, wavelen > old_len / low_freq_factor gives theta / factor, and in between blend
  //   (1 - s) * theta / factor + s * theta, s = (old_len / wavelen - low_freq_factor) / (high - low).
  //   Bit for bit: the same fp32 operations in the same order as the Python (the comment above).
  // Hint: torch computes `2 * math.pi / inv_freq` as (1 / theta) * 2pi, each rounded to fp32, and
  //   `old_len / wavelen` as (1 / wavelen) * old_len; the two wavelength limits are Python floats
  //   (double) rounded to fp32 when compared with the fp32 wavelengths.
  // Hint: Hugging Face computes the blend for every j and then selects; (1 - s) * theta_llama / factor
  //   + s * theta_llama, where theta_llama is already theta / factor for the long wavelengths.
  // Tests: RopeFrequencies.Llama32MatchesHuggingFaceBitForBit RopeTable.Llama32ValuesMatchHuggingFace
  // Tests: RopeFrequencies.Llama3ScalingKeepsHighDividesLowAndBlendsBetween lesson05_rope.cpu
  // Stub:
  //   throw NotWrittenYet("05.1", "Llama 3's frequency scaling");
  // --- solution ---
  const float factor = static_cast<float>(rs.factor);
  const float low_freq_factor = static_cast<float>(rs.low_freq_factor);
  const float old_len = static_cast<float>(rs.original_max_position_embeddings);
  // Python computes these two in double; torch compares them with the fp32 wavelengths in fp32.
  const float low_freq_wavelen =
      static_cast<float>(static_cast<double>(rs.original_max_position_embeddings) / rs.low_freq_factor);
  const float high_freq_wavelen =
      static_cast<float>(static_cast<double>(rs.original_max_position_embeddings) / rs.high_freq_factor);
  const float band = static_cast<float>(rs.high_freq_factor - rs.low_freq_factor);  // a Python float: double
  const float two_pi = static_cast<float>(2.0 * std::numbers::pi);

  for (int64_t j = 0; j < half; ++j) {
    const float theta = inv_freq[j];
    const float wavelen = (1.0f / theta) * two_pi;  // `2 * math.pi / inv_freq`: reciprocal, then multiply
    const float theta_llama = wavelen > low_freq_wavelen ? theta / factor : theta;
    const float s = ((1.0f / wavelen) * old_len - low_freq_factor) / band;  // `old_len / wavelen` likewise
    const float slow_part = ((1.0f - s) * theta_llama) / factor;
    const float fast_part = s * theta_llama;
    const float smoothed = slow_part + fast_part;
    const bool medium = !(wavelen < high_freq_wavelen) && !(wavelen > low_freq_wavelen);
    inv_freq[j] = medium ? smoothed : theta_llama;
  }
  // --- end of exercise 05.1 ---
  return inv_freq;
}

float rope_attention_scaling(const ModelConfig& config) {
  const std::string& type = config.rope_scaling.rope_type;
  TVLLM_REQUIRE(type == "default" || type == "llama3",
                "rope_scaling.rope_type \"" + type + "\" is not supported (tiny-vllm implements \"default\" and \"llama3\")");
  return 1.0f;  // neither variant rescales cos/sin (YaRN, for one, would)
}

RopeTable RopeTable::build(const ModelConfig& config, int64_t max_positions) {
  if (max_positions == 0) max_positions = config.max_position_embeddings;
  // (float)pos must be exact, as in Hugging Face's position_ids.float(): integers up to 2^24 are.
  TVLLM_REQUIRE(max_positions > 0 && max_positions <= (int64_t{1} << 24),
                "RoPE table size (max_positions) must be in [1, 2^24], got " + std::to_string(max_positions));
  RopeTable table;
  table.inv_freq_ = rope_inv_freq(config);
  table.attention_scaling_ = rope_attention_scaling(config);
  table.head_dim_ = config.head_dim;
  table.max_positions_ = max_positions;

  const int64_t half = config.head_dim / 2;
  table.cos_host_ = Tensor::empty({max_positions, half}, DType::F32, Device::CPU);
  table.sin_host_ = Tensor::empty({max_positions, half}, DType::F32, Device::CPU);
  float* cos_out = table.cos_host_.view().ptr<float>();  // [max_positions, half]
  float* sin_out = table.sin_host_.view().ptr<float>();  // [max_positions, half]
  for (int64_t pos = 0; pos < max_positions; ++pos) {
    for (int64_t j = 0; j < half; ++j) {
      // The fp32 angle Hugging Face forms (position_ids.float() * inv_freq), then cos/sin of exactly that
      // angle, evaluated in double and rounded once to fp32, then the attention scaling (an fp32 multiply).
      const float angle = static_cast<float>(pos) * table.inv_freq_[j];
      cos_out[pos * half + j] = static_cast<float>(std::cos(static_cast<double>(angle))) * table.attention_scaling_;
      sin_out[pos * half + j] = static_cast<float>(std::sin(static_cast<double>(angle))) * table.attention_scaling_;
    }
  }
  return table;
}

void RopeTable::upload_to_device() {
  if (on_device()) return;
  TVLLM_REQUIRE(head_dim_ > 0, "RopeTable::upload_to_device: the table is empty (use RopeTable::build)");
  cos_device_ = Tensor::copy_of(cos_host_.view(), Device::CUDA);
  sin_device_ = Tensor::copy_of(sin_host_.view(), Device::CUDA);
  TensorView inv = TensorView::contiguous(const_cast<float*>(inv_freq_.data()), DType::F32, Device::CPU,
                                          {static_cast<int64_t>(inv_freq_.size())});
  inv_freq_device_ = Tensor::copy_of(inv, Device::CUDA);
}

TensorView RopeTable::cos(Device where) const {
  if (where == Device::CPU) return cos_host_.view();
  TVLLM_REQUIRE(on_device(), "RopeTable: the GPU needs the table on the device: call upload_to_device() first");
  return cos_device_.view();
}

TensorView RopeTable::sin(Device where) const {
  if (where == Device::CPU) return sin_host_.view();
  TVLLM_REQUIRE(on_device(), "RopeTable: the GPU needs the table on the device: call upload_to_device() first");
  return sin_device_.view();
}

TensorView RopeTable::inv_freq_view(Device where) const {
  if (where == Device::CPU)
    return TensorView::contiguous(const_cast<float*>(inv_freq_.data()), DType::F32, Device::CPU,
                                  {static_cast<int64_t>(inv_freq_.size())});
  TVLLM_REQUIRE(on_device(), "RopeTable: the GPU needs theta_j on the device: call upload_to_device() first");
  return inv_freq_device_.view();
}

// ---- Meta's interleaved layout <-> Hugging Face's rotate-half layout ------------------------------

void permute_qk_rows(const TensorView& dst, const TensorView& src, int64_t head_dim, QkLayout from, QkLayout to) {
  check_head_dim(head_dim);
  TVLLM_REQUIRE(src.rank() >= 1, "permute_qk_rows: src must have rows, got " + src.describe());
  TVLLM_REQUIRE(dst.shape == src.shape && dst.dtype == src.dtype,
                "permute_qk_rows: dst " + dst.describe() + " must match src " + src.describe());
  TVLLM_REQUIRE(dst.device == Device::CPU && src.device == Device::CPU,
                "permute_qk_rows: host views only (it runs once, at load time)");
  TVLLM_REQUIRE(dst.is_contiguous() && src.is_contiguous(), "permute_qk_rows: views must be contiguous");
  const int64_t rows = src.dim(0);
  TVLLM_REQUIRE(rows % head_dim == 0, "permute_qk_rows: " + std::to_string(rows) +
                                          " rows are not a whole number of heads of head_dim " +
                                          std::to_string(head_dim));
  const size_t row_bytes = src.nbytes() / static_cast<size_t>(rows > 0 ? rows : 1);
  const char* s = static_cast<const char*>(src.data);
  char* d = static_cast<char*>(dst.data);
  TVLLM_REQUIRE(src.nbytes() == 0 || d + src.nbytes() <= s || s + src.nbytes() <= d,
                "permute_qk_rows: dst and src must not overlap");

  for (int64_t head = 0; head < rows / head_dim; ++head) {
    const int64_t base = head * head_dim;
    for (int64_t r = 0; r < head_dim; ++r) {
      // dst row r takes the src row that holds the same (pair, member) in the other layout.
      int64_t src_row = r;
      if (from == QkLayout::Interleaved && to == QkLayout::RotateHalf) src_row = interleaved_index(r, head_dim);
      if (from == QkLayout::RotateHalf && to == QkLayout::Interleaved) src_row = rotate_half_index(r, head_dim);
      std::memcpy(d + (base + r) * row_bytes, s + (base + src_row) * row_bytes, row_bytes);
    }
  }
}

}  // namespace tvllm
