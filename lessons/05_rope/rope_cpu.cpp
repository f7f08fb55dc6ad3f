// apply_rope: argument checks, the device dispatch, and the fp32 CPU reference (the oracle every GPU
// kernel is checked against). Also Meta's interleaved variant, for the layout comparison.
#include <algorithm>
#include <string>
#include <vector>

#include "common/errors.h"
#include "common/exercise.h"
#include "rope.h"

namespace tvllm {

std::string_view rope_kernel_name(RopeKernel kernel) {
  switch (kernel) {
    case RopeKernel::V1: return "v1";
    case RopeKernel::V2: return "v2";
    case RopeKernel::V3: return "v3";
  }
  return "?";
}

RopeKernel parse_rope_kernel(std::string_view name) {
  for (RopeKernel k : all_rope_kernels())
    if (rope_kernel_name(k) == name) return k;
  throw InputError("unknown RoPE kernel \"" + std::string(name) + "\" (expected v1, v2 or v3)");
}

std::vector<RopeKernel> all_rope_kernels() { return {RopeKernel::V1, RopeKernel::V2, RopeKernel::V3}; }

namespace rope_detail {

int64_t check_rotated(const TensorView& x, const char* what, int64_t tokens, int64_t head_dim, Device device,
                      DType dtype) {
  const std::string name = std::string("apply_rope: ") + what;
  TVLLM_REQUIRE(x.rank() == 2, name + " must be [T, heads * head_dim], got " + x.describe());
  TVLLM_REQUIRE(x.device == device, name + " is on " + std::string(device_name(x.device)) + " but q is on " +
                                        std::string(device_name(device)));
  TVLLM_REQUIRE(x.dtype == dtype, name + " must be " + std::string(dtype_name(dtype)) + " on " +
                                      std::string(device_name(device)) + ", got " + x.describe());
  TVLLM_REQUIRE(x.dim(0) == tokens, name + " has " + std::to_string(x.dim(0)) + " rows but there are " +
                                        std::to_string(tokens) + " positions");
  TVLLM_REQUIRE(x.dim(1) > 0 && x.dim(1) % head_dim == 0,
                name + " width " + std::to_string(x.dim(1)) + " is not a whole number of heads of head_dim " +
                    std::to_string(head_dim));
  TVLLM_REQUIRE(x.strides.size() == 2 && x.strides[1] == 1,
                name + ": the elements of a row must be contiguous (column stride 1)");
  TVLLM_REQUIRE(tokens <= 1 || x.strides[0] >= x.dim(1), name + ": rows overlap (row stride " +
                                                             std::to_string(x.strides[0]) + " < width)");
  TVLLM_REQUIRE(tokens == 0 || x.data != nullptr, name + " has no data");
  return x.dim(1) / head_dim;
}

void check_positions(const TensorView& positions, int64_t tokens, int64_t max_positions, Device device,
                     bool validate, cudaStream_t stream) {
  TVLLM_REQUIRE(positions.rank() == 1 && positions.dtype == DType::I32,
                "apply_rope: positions must be I32 [T], got " + positions.describe());
  TVLLM_REQUIRE(positions.device == device, "apply_rope: positions must be on the same device as q and k");
  TVLLM_REQUIRE(positions.dim(0) == tokens, "apply_rope: " + std::to_string(positions.dim(0)) +
                                                " positions for " + std::to_string(tokens) + " tokens");
  TVLLM_REQUIRE(positions.is_contiguous(), "apply_rope: positions must be contiguous");
  if (!validate || tokens == 0) return;
  std::vector<int32_t> host(static_cast<size_t>(tokens));
  if (positions.device == Device::CPU) {
    std::copy_n(positions.ptr<const int32_t>(), tokens, host.data());
  } else {
    // On the caller's stream, after whatever wrote the positions there; then wait for it.
    TVLLM_CUDA_CHECK(cudaMemcpyAsync(host.data(), positions.data, static_cast<size_t>(tokens) * sizeof(int32_t),
                                     cudaMemcpyDeviceToHost, stream));
    TVLLM_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  for (int64_t t = 0; t < tokens; ++t) {
    TVLLM_REQUIRE(host[t] >= 0 && host[t] < max_positions,
                  "apply_rope: positions[" + std::to_string(t) + "] = " + std::to_string(host[t]) +
                      " is outside the RoPE table [0, " + std::to_string(max_positions) + ")");
  }
}

namespace {

// One head in the rotate-half layout: pair j is (x[j], x[j + half]). The expression is Hugging Face's
//   q * cos + rotate_half(q) * sin,   rotate_half(q) = cat(-q[half:], q[:half])
// rounding for rounding: each product is rounded to fp32, then the sum (negating is exact).
void rotate_head(float* x, const float* cos_row, const float* sin_row, int64_t half) {
  // --- exercise 05.2: the fp32 reference rotation ------------------------------------------------------
  // Task: rotate one head of 2 * half floats in place, rotate-half layout: pair j is (a, b) =
  //   (x[j], x[j + half]), and becomes (a cos - b sin, b cos + a sin) with cos_row[j], sin_row[j].
  //   Round like Hugging Face's q * cos + rotate_half(q) * sin: each product rounded to fp32, then the
  //   sum (the GPU kernels v1 and v2 must equal this bit for bit).
  // Hint: read both members of a pair before writing either.
  // Hint: a_cos - b_sin written as two named float products; the project compiles host code with
  //   -ffp-contract=off, so nothing is fused into an FMA behind your back.
  // Tests: RopeCpu.KnownValuesByHand RopeCpu.RotationPreservesTheNormOfEveryPair
  // Tests: RopeCpu.ScoresDependOnlyOnRelativePosition RopeCpu.StridedRowsOfAFusedQkvBuffer
  // Tests: RopeCpu.ArbitraryPositionsEqualOneTokenAtATime RopeLayout.PermutingTheWeightsCommutesWithRope
  // Tests: lesson05_rope.cpu
  // Stub:
  //   (void)x, (void)cos_row, (void)sin_row, (void)half;
  //   throw NotWrittenYet("05.2", "the fp32 reference rotation");
  // --- solution ---
  for (int64_t j = 0; j < half; ++j) {
    const float a = x[j];         // first member of pair j
    const float b = x[j + half];  // second member
    const float a_cos = a * cos_row[j], b_sin = b * sin_row[j];
    const float b_cos = b * cos_row[j], a_sin = a * sin_row[j];
    x[j] = a_cos - b_sin;
    x[j + half] = b_cos + a_sin;
  }
  // --- end of exercise 05.2 ---
}

void rotate_rows(const TensorView& x, int64_t heads, const int32_t* positions, const RopeTable& table) {
  const int64_t half = table.half();
  const float* cos_table = table.cos(Device::CPU).ptr<float>();  // [max_positions, half]
  const float* sin_table = table.sin(Device::CPU).ptr<float>();
  for (int64_t t = 0; t < x.dim(0); ++t) {
    float* row = x.ptr<float>() + t * x.strides[0];  // [heads * head_dim]
    const int64_t pos = positions[t];
    for (int64_t h = 0; h < heads; ++h)
      rotate_head(row + h * 2 * half, cos_table + pos * half, sin_table + pos * half, half);
  }
}

}  // namespace

void apply_rope_cpu(const TensorView& q, const TensorView& k, const TensorView& positions, const RopeTable& table,
                    const RopeShape& shape) {
  rotate_rows(q, shape.q_heads, positions.ptr<int32_t>(), table);
  rotate_rows(k, shape.k_heads, positions.ptr<int32_t>(), table);
}

}  // namespace rope_detail

void apply_rope(const TensorView& q, const TensorView& k, const TensorView& positions, const RopeTable& table,
                RopeKernel kernel, PositionCheck check, cudaStream_t stream) {
  TVLLM_REQUIRE(table.head_dim() > 0, "apply_rope: the RopeTable is empty (build it with RopeTable::build)");
  TVLLM_REQUIRE(q.rank() == 2, "apply_rope: q must be [T, n_heads * head_dim], got " + q.describe());
  const Device device = q.device;
  // On the CPU we compute the fp32 reference; the GPU path is bf16 storage with fp32 math.
  const DType dtype = device == Device::CPU ? DType::F32 : DType::BF16;

  rope_detail::RopeShape shape;
  shape.tokens = q.dim(0);
  shape.head_dim = table.head_dim();
  shape.q_heads = rope_detail::check_rotated(q, "q", shape.tokens, shape.head_dim, device, dtype);
  shape.k_heads = rope_detail::check_rotated(k, "k", shape.tokens, shape.head_dim, device, dtype);
  shape.q_row_stride = q.strides[0];
  shape.k_row_stride = k.strides[0];
  TVLLM_REQUIRE(shape.tokens == 0 || q.data != k.data, "apply_rope: q and k are the same memory");
  // On the CPU the check is free, so it always runs: the reference must never read outside the table.
  const bool validate = check == PositionCheck::Validate || device == Device::CPU;
  rope_detail::check_positions(positions, shape.tokens, table.max_positions(), device, validate, stream);
  if (shape.tokens == 0) return;

  if (device == Device::CPU) {
    rope_detail::apply_rope_cpu(q, k, positions, table, shape);
  } else {
    TVLLM_REQUIRE(table.on_device(), "apply_rope: the RopeTable is not on the GPU: call upload_to_device() first");
    rope_detail::apply_rope_cuda(q, k, positions, table, shape, kernel, stream);
  }
}

void apply_rope_interleaved_cpu(const TensorView& x, const TensorView& positions, const RopeTable& table) {
  TVLLM_REQUIRE(table.head_dim() > 0, "apply_rope_interleaved_cpu: the RopeTable is empty");
  TVLLM_REQUIRE(x.rank() == 2, "apply_rope_interleaved_cpu: x must be [T, heads * head_dim], got " + x.describe());
  const int64_t tokens = x.dim(0);
  const int64_t heads = rope_detail::check_rotated(x, "x", tokens, table.head_dim(), Device::CPU, DType::F32);
  rope_detail::check_positions(positions, tokens, table.max_positions(), Device::CPU, /*validate=*/true);
  const int64_t half = table.half();
  const float* cos_table = table.cos(Device::CPU).ptr<float>();  // [max_positions, half]
  const float* sin_table = table.sin(Device::CPU).ptr<float>();
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t pos = positions.ptr<int32_t>()[t];
    for (int64_t h = 0; h < heads; ++h) {
      float* head = x.ptr<float>() + t * x.strides[0] + h * 2 * half;  // [head_dim]
      for (int64_t j = 0; j < half; ++j) {
        // Meta pairs neighbours: (x[2j], x[2j+1]), same angle pos * theta_j, same arithmetic.
        const float a = head[2 * j], b = head[2 * j + 1];
        const float c = cos_table[pos * half + j], s = sin_table[pos * half + j];
        const float a_cos = a * c, b_sin = b * s;
        const float b_cos = b * c, a_sin = a * s;
        head[2 * j] = a_cos - b_sin;
        head[2 * j + 1] = b_cos + a_sin;
      }
    }
  }
}

}  // namespace tvllm
