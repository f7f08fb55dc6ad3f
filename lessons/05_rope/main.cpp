// lesson05_rope: rotary position embedding, checked against Hugging Face's q and k after RoPE.
//
//   build/bin/lesson05_rope [--model DIR] [--device auto|cpu|cuda] [--kernel v1|v2|v3] [--bench] [--tokens N]
//
// 1. the cos/sin table against the reference's rope.cos / rope.sin (Hugging Face's, after Llama 3 scaling)
// 2. for every prompt and captured layer: q_proj, k_proj and positions in, q_rope and k_rope out
// 3. the same prompts again one token at a time (as decode calls it): must equal the whole-prompt result
// 4. on the GPU, every kernel version against the CPU reference on the same bf16 inputs
// 5. --bench: every version at the model's shapes on --tokens tokens, GB/s against the copy bandwidth
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "common/bench.h"
#include "common/errors.h"
#include "common/lesson.h"
#include "common/random.h"
#include "common/tensor.h"
#include "common/validate.h"
#include "model_dir.h"
#include "rope.h"

using namespace tvllm;

namespace {

// ---- tolerances (README.md, "What correct means") -------------------------------------------------
// RoPE's rounding errors scale with the size of the PAIR it rotates, r = |(x[j], x[j+half])|, not with
// the output element: a' = a cos - b sin can be tiny while a and b are not. So the absolute tolerances
// below are multiples of max|x| over the input tensor.

// bf16 keeps 8 significant bits: rounding to nearest is off by at most 2^-8 of the value.
constexpr double kBf16Unit = 1.0 / 256;
// Table vs Hugging Face: the same fp32 angle; our cos/sin are correctly rounded, torch's are within
// ~1 ulp. |cos|, |sin| <= 1, where an fp32 ulp is at most 2^-23: allow 2^-22.
constexpr double kTableAtol = 1.0 / (1 << 22);
// fp32 path vs Hugging Face: identical expression and rounding order, so outputs differ only through
// the ~1 ulp (<= 2^-23 absolute) cos/sin differences: |err| <= 2^-23 (|a| + |b|) <= 2^-22 max|x|. 4x margin.
constexpr double kF32AtolPerMaxAbs = 1.0 / (1 << 20);
// GPU vs the CPU reference on the SAME bf16 inputs: the output rounding (rtol 2^-8) plus fp32 differences
// (v3's sincosf is within 2 ulp of our table: <= 2^-22 r). 2^-18 leaves a wide margin and is still
// hundreds of times smaller than any wrong angle or swapped pair.
constexpr double kKernelAtolPerMaxAbs = 1.0 / (1 << 18);
// GPU vs Hugging Face's fp32 result: rounding the inputs a, b to bf16 moves a' by at most
// 2^-8 (|a cos| + |b sin|) <= 2^-8 sqrt(2) max|x| (< 2^-7 max|x|); the output rounding adds 2^-8 |a'|.
constexpr double kBf16InputAtolPerMaxAbs = 1.0 / 128;

double max_abs(const std::vector<float>& v) {
  double m = 0.0;
  for (float x : v) m = std::max(m, static_cast<double>(std::fabs(x)));
  return m;
}

std::vector<float> round_to_bf16(std::vector<float> v) {
  for (float& x : v) x = bf16_to_f32(f32_to_bf16(x));
  return v;
}

// One (prompt, layer) of the reference: RoPE's inputs and Hugging Face's outputs.
struct Case {
  std::string label;  // "p0.layers.0"
  int64_t tokens = 0;
  std::vector<int32_t> positions;   // [T]
  std::vector<float> q_in, k_in;    // [T, q_dim], [T, kv_dim]   (q_proj, k_proj; Qwen3: q_norm, k_norm)
  std::vector<float> q_ref, k_ref;  // the same after RoPE       (q_rope, k_rope)
};

std::vector<float> load_reference(const ReferenceSet& ref, const std::string& name, const Shape& shape) {
  TensorView v = ref.get(name);
  TVLLM_REQUIRE(v.shape == shape && is_floating(v.dtype),
                "reference \"" + name + "\" is " + v.describe() + ", expected a float tensor of shape " + shape_str(shape));
  return to_f32_vector(v);
}

std::vector<Case> load_cases(const ReferenceSet& ref, const ModelConfig& cfg) {
  std::vector<Case> cases;
  for (int i = 0; i < ref.num_prompts(); ++i) {
    TensorView pos = ref.prompt(i, "positions");
    TVLLM_REQUIRE(pos.dtype == DType::I32 && pos.rank() == 1 && pos.dim(0) >= 1,
                  "reference p" + std::to_string(i) + ".positions must be I32 [T], got " + pos.describe());
    const int64_t T = pos.dim(0);
    std::vector<int32_t> positions(static_cast<size_t>(T));
    std::memcpy(positions.data(), pos.data, positions.size() * sizeof(int32_t));
    for (int l : ref.captured_layers()) {
      Case c;
      c.label = "p" + std::to_string(i) + ".layers." + std::to_string(l);
      c.tokens = T;
      c.positions = positions;
      // RoPE rotates what reaches it: q_proj / k_proj, or in Qwen3 their per-head RMSNorm (q_norm / k_norm,
      // which the reference captures for such models).
      const bool normed = ref.has(c.label + ".q_norm");
      c.q_in = load_reference(ref, c.label + (normed ? ".q_norm" : ".q_proj"), {T, cfg.q_dim()});
      c.k_in = load_reference(ref, c.label + (normed ? ".k_norm" : ".k_proj"), {T, cfg.kv_dim()});
      c.q_ref = load_reference(ref, c.label + ".q_rope", {T, cfg.q_dim()});
      c.k_ref = load_reference(ref, c.label + ".k_rope", {T, cfg.kv_dim()});
      cases.push_back(std::move(c));
    }
  }
  TVLLM_REQUIRE(!cases.empty(), "the reference has no captured layers (expected p0.layers.0.q_proj, ...)");
  return cases;
}

// Our table as Hugging Face stores it: [rows, head_dim], the half-width table written twice side by side.
std::vector<float> duplicated_halves(const TensorView& half_table, int64_t rows) {
  const int64_t half = half_table.dim(1);
  const float* src = half_table.ptr<float>();
  std::vector<float> out(static_cast<size_t>(rows * 2 * half));
  for (int64_t p = 0; p < rows; ++p)
    for (int64_t j = 0; j < half; ++j) {
      out[p * 2 * half + j] = src[p * half + j];
      out[p * 2 * half + half + j] = src[p * half + j];
    }
  return out;
}

void check_table(Report& report, const RopeTable& table, const ReferenceSet& ref) {
  for (const char* which : {"cos", "sin"}) {
    const std::string name = std::string("rope.") + which;
    TensorView r = ref.get(name);
    TVLLM_REQUIRE(r.rank() == 2 && r.dim(1) == table.head_dim() && r.dim(0) <= table.max_positions(),
                  "reference " + name + " is " + r.describe() + ", expected [max_T, head_dim " +
                      std::to_string(table.head_dim()) + "]");
    const TensorView ours = std::string(which) == "cos" ? table.cos(Device::CPU) : table.sin(Device::CPU);
    std::vector<float> actual = duplicated_halves(ours, r.dim(0));
    report.add(compare(name + " table", actual, to_f32_vector(r), Tolerance{kTableAtol, 0.0}));
  }
}

int64_t positions_needed(const std::vector<Case>& cases, const ReferenceSet& ref) {
  int64_t needed = ref.get("rope.cos").dim(0);
  for (const Case& c : cases)
    for (int32_t p : c.positions) {
      TVLLM_REQUIRE(p >= 0, c.label + ": negative position " + std::to_string(p) + " in the reference");
      needed = std::max<int64_t>(needed, int64_t{p} + 1);
    }
  return needed;
}

// Runs RoPE on (q, k) on `device` in the given storage dtype; returns the results as fp32.
struct Rotated {
  std::vector<float> q, k;
};
Rotated run_rope(const Case& c, const std::vector<float>& q_in, const std::vector<float>& k_in, const RopeTable& table,
                 Device device, RopeKernel kernel, bool token_by_token) {
  const DType dtype = device == Device::CPU ? DType::F32 : DType::BF16;
  const int64_t T = c.tokens;
  Tensor q = Tensor::from_f32(q_in, {T, static_cast<int64_t>(q_in.size()) / T}, dtype, device);
  Tensor k = Tensor::from_f32(k_in, {T, static_cast<int64_t>(k_in.size()) / T}, dtype, device);
  Tensor positions = Tensor::from_i32(c.positions, {T}, device);
  if (!token_by_token) {
    apply_rope(q, k, positions, table, kernel);
  } else {
    // Decode's view of the same work: one token at a time, each with its own position.
    for (int64_t t = 0; t < T; ++t)
      apply_rope(q.view().rows(t, 1), k.view().rows(t, 1), positions.view().rows(t, 1), table, kernel);
  }
  return {to_f32_vector(q), to_f32_vector(k)};
}

void append(std::vector<float>& dst, const std::vector<float>& src) { dst.insert(dst.end(), src.begin(), src.end()); }

void check_cpu(Report& report, const std::vector<Case>& cases, const RopeTable& table) {
  bool decode_equal = true;
  for (const Case& c : cases) {
    Rotated out = run_rope(c, c.q_in, c.k_in, table, Device::CPU, kDefaultRopeKernel, false);
    report.add(compare(c.label + ".q_rope", out.q, c.q_ref, Tolerance{kF32AtolPerMaxAbs * max_abs(c.q_in), 0.0}));
    report.add(compare(c.label + ".k_rope", out.k, c.k_ref, Tolerance{kF32AtolPerMaxAbs * max_abs(c.k_in), 0.0}));
    Rotated one_by_one = run_rope(c, c.q_in, c.k_in, table, Device::CPU, kDefaultRopeKernel, true);
    decode_equal = decode_equal && one_by_one.q == out.q && one_by_one.k == out.k;
  }
  report.add_check("token by token == whole prompt", decode_equal, "rotating one token at a time changed the result");
}

void check_cuda(Report& report, const std::vector<Case>& cases, const RopeTable& table, RopeKernel chosen) {
  // The chosen kernel against Hugging Face, tensor by tensor.
  bool decode_equal = true;
  for (const Case& c : cases) {
    Rotated out = run_rope(c, c.q_in, c.k_in, table, Device::CUDA, chosen, false);
    report.add(compare(c.label + ".q_rope", out.q, c.q_ref,
                       Tolerance{kBf16InputAtolPerMaxAbs * max_abs(c.q_in), kBf16Unit}));
    report.add(compare(c.label + ".k_rope", out.k, c.k_ref,
                       Tolerance{kBf16InputAtolPerMaxAbs * max_abs(c.k_in), kBf16Unit}));
    Rotated one_by_one = run_rope(c, c.q_in, c.k_in, table, Device::CUDA, chosen, true);
    decode_equal = decode_equal && one_by_one.q == out.q && one_by_one.k == out.k;
  }
  report.add_check("token by token == whole prompt (" + std::string(rope_kernel_name(chosen)) + ")", decode_equal,
                   "rotating one token at a time changed the result");

  // Every version against the CPU reference on the same bf16-rounded inputs: this isolates the kernel
  // (the inputs' rounding is common to both sides), so the tolerance is only the output rounding.
  std::vector<float> expected;
  double scale = 0.0;
  std::vector<std::vector<float>> q_bf16, k_bf16;
  for (const Case& c : cases) {
    q_bf16.push_back(round_to_bf16(c.q_in));
    k_bf16.push_back(round_to_bf16(c.k_in));
    Rotated cpu = run_rope(c, q_bf16.back(), k_bf16.back(), table, Device::CPU, kDefaultRopeKernel, false);
    append(expected, cpu.q);
    append(expected, cpu.k);
    scale = std::max({scale, max_abs(q_bf16.back()), max_abs(k_bf16.back())});
  }
  for (RopeKernel kernel : all_rope_kernels()) {
    std::vector<float> actual;
    for (size_t i = 0; i < cases.size(); ++i) {
      Rotated gpu = run_rope(cases[i], q_bf16[i], k_bf16[i], table, Device::CUDA, kernel, false);
      append(actual, gpu.q);
      append(actual, gpu.k);
    }
    report.add(compare("kernel " + std::string(rope_kernel_name(kernel)) + " vs CPU (bf16 in)", actual, expected,
                       Tolerance{kKernelAtolPerMaxAbs * scale, kBf16Unit}));
  }
}

void run_bench(const ModelConfig& cfg, int64_t tokens) {
  const int64_t T = tokens;
  const int64_t q_dim = cfg.q_dim(), kv_dim = cfg.kv_dim();
  std::printf("\nbench: T = %lld tokens, q [T, %lld] + k [T, %lld] bf16, positions 0..T-1\n",
              static_cast<long long>(T), static_cast<long long>(q_dim), static_cast<long long>(kv_dim));
  RopeTable table = RopeTable::build(cfg, T);
  table.upload_to_device();
  Tensor q = Tensor::from_f32(random_uniform(static_cast<size_t>(T * q_dim), 1), {T, q_dim}, DType::BF16, Device::CUDA);
  Tensor k = Tensor::from_f32(random_uniform(static_cast<size_t>(T * kv_dim), 2), {T, kv_dim}, DType::BF16, Device::CUDA);
  std::vector<int32_t> pos(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) pos[t] = static_cast<int32_t>(t);
  Tensor positions = Tensor::from_i32(pos, {T}, Device::CUDA);

  // Bytes any RoPE must move: q and k read and written once (bf16), positions read once. The table rows
  // that v1/v2 read (T * head_dim * 4 bytes, ~2.5% more at Llama 3.2 1B shapes) are NOT counted: they are
  // a cost of that design, so v3 (no table) can be compared on the same scale: less time = more GB/s.
  const double bytes = 2.0 * static_cast<double>(T) * static_cast<double>(q_dim + kv_dim) * 2.0 + 4.0 * T;
  std::vector<BenchRow> rows;
  for (RopeKernel kernel : all_rope_kernels()) {
    // Trusted: Validate would copy the positions to the host inside the timed region.
    BenchResult r = bench_gpu([&] { apply_rope(q, k, positions, table, kernel, PositionCheck::Trusted); });
    rows.push_back({"rope " + std::string(rope_kernel_name(kernel)), r, bytes, 0.0});
  }
  print_bench_table(std::cout, "RoPE, q and k in place (bytes: q,k read + written, positions)", rows,
                    measure_ceilings(false));

  // The fp32 CPU reference, for scale (a smaller batch: it is slow).
  const int64_t T_cpu = std::min<int64_t>(T, 1024);
  Tensor qc = Tensor::from_f32(random_uniform(static_cast<size_t>(T_cpu * q_dim), 3), {T_cpu, q_dim}, DType::F32, Device::CPU);
  Tensor kc = Tensor::from_f32(random_uniform(static_cast<size_t>(T_cpu * kv_dim), 4), {T_cpu, kv_dim}, DType::F32, Device::CPU);
  Tensor pc = Tensor::from_i32(std::vector<int32_t>(pos.begin(), pos.begin() + T_cpu), {T_cpu}, Device::CPU);
  BenchResult cpu = bench_cpu([&] { apply_rope(qc, kc, pc, table); });
  std::printf("CPU fp32 reference: %.3f ms for %lld tokens (%.1f GB/s of fp32 q,k traffic)\n", cpu.median_ms,
              static_cast<long long>(T_cpu), 2.0 * T_cpu * (q_dim + kv_dim) * 4.0 / (cpu.median_ms * 1e-3) / 1e9);
}

}  // namespace

int main(int argc, char** argv) {
  LessonCli cli("lesson05_rope", "RoPE: rotary position embedding with Llama 3 frequency scaling, vs Hugging Face");
  cli.kernels({"v1", "v2", "v3"}, std::string(rope_kernel_name(kDefaultRopeKernel)));
  return cli.run(argc, argv, [](const LessonOptions& opt) {
    ModelDir model = ModelDir::open(opt.model_dir);
    ReferenceSet ref = ReferenceSet::open(opt.model_dir);
    const ModelConfig& cfg = model.config;
    const RopeScaling& rs = cfg.rope_scaling;
    std::printf("RoPE: head_dim %lld, %lld q heads, %lld kv heads, rope_theta %g, rope_type %s", static_cast<long long>(cfg.head_dim),
                static_cast<long long>(cfg.num_attention_heads), static_cast<long long>(cfg.num_key_value_heads),
                cfg.rope_theta, rs.rope_type.c_str());
    if (rs.rope_type == "llama3")
      std::printf(" (factor %g, low_freq_factor %g, high_freq_factor %g, original_max_position_embeddings %lld)",
                  rs.factor, rs.low_freq_factor, rs.high_freq_factor,
                  static_cast<long long>(rs.original_max_position_embeddings));
    std::printf("\n");

    std::vector<Case> cases = load_cases(ref, cfg);
    RopeTable table = RopeTable::build(cfg, positions_needed(cases, ref));
    const std::vector<float>& theta = table.inv_freq();
    std::printf("theta_j: %.6g (j = 0) ... %.6g (j = %zu); table for positions [0, %lld)\n", theta.front(), theta.back(),
                theta.size() - 1, static_cast<long long>(table.max_positions()));

    const RopeKernel chosen = parse_rope_kernel(opt.kernel.empty() ? "v2" : opt.kernel);
    Report report(std::string("lesson05_rope on ") + std::string(device_name(opt.device)) +
                  (opt.device == Device::CUDA ? " (kernel " + opt.kernel + ")" : std::string(" (fp32 reference)")));
    check_table(report, table, ref);
    if (opt.device == Device::CPU) {
      check_cpu(report, cases, table);
    } else {
      table.upload_to_device();
      check_cuda(report, cases, table, chosen);
    }
    report.print(std::cout);

    if (opt.bench && opt.device == Device::CUDA) run_bench(cfg, opt.bench_tokens);
    return report.exit_code();
  });
}
