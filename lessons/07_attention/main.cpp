// lesson07_attention: causal grouped-query attention for every prompt at once, checked against Hugging Face.
//
//   build/bin/lesson07_attention [--model DIR] [--device auto|cpu|cuda] [--kernel v1|v2] [--bench] [--tokens N]
//
//   1. for each captured layer: the reference's q_rope, k_rope and v_proj of ALL prompts packed into one
//      prefill batch (prompts of different lengths, cu_seqlens_q = cu_seqlens_k = their prefix sums)
//   2. cpu: the fp32 reference; cuda: every kernel version (the chosen one first), bf16 in and out
//   3. each prompt's rows compared with the reference's p{i}.layers.{l}.attn; on cuda also the whole batch
//      against the CPU reference run on the same bf16-rounded inputs (a much tighter check)
//   4. --bench: one sequence of 512, 1k, 2k, ... up to --tokens tokens, and a batch of mixed lengths, with
//      the model's head shapes: time, TFLOP/s and the extra device memory of each version
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "attention.h"
#include "common/bench.h"
#include "common/cublas.h"
#include "common/errors.h"
#include "common/lesson.h"
#include "common/random.h"
#include "common/validate.h"
#include "model_dir.h"

namespace tvllm {
namespace {

// ---- tolerances (README.md, "What correct means", derives each number) -----------------------------
// CPU path vs Hugging Face: both compute in (at least) fp32 from the same fp32 inputs; HF's fp32 sums in
// another order. Scores carry ~1e-7 relative error, the softmax turns an absolute score error e into a
// relative weight error e: outputs agree to ~1e-6 of max|v|.
constexpr Tolerance kCpuVsHf{1e-5, 1e-4};
// GPU vs the CPU reference run on the SAME bf16-rounded inputs: only the kernel's own roundings remain,
// bounded in the worst case. One bf16 rounding (8 significant bits) moves a value by at most 2^-8 of
// itself. P rounded to bf16 before P V moves the output by <= 2^-8 * max|v| (a convex combination of v
// rows), and the bf16 output by <= 2^-8 * |out|. fp32 scores, exp2f and sums add ~1e-6: 1e-4 covers them.
constexpr double kGpuVsCpuAtolPerMaxV = 1.0 / 256 + 1e-4;
constexpr double kGpuVsCpuRtol = 1.0 / 256 + 1e-4;
// GPU vs Hugging Face's fp32 attention: on top of the above, q/k/v are rounded to bf16 once. v's
// rounding adds <= 2^-8 * max|v|. q's and k's move a score s = q.k*scale by about
// 2^-8 * scale * sqrt(sum_d (q_d k_d)^2) (independent roundings add like a random walk), the output by
// about twice that times max|v|. The worst case (all roundings aligned) is too loose to be useful for
// trained models with large scores, so this tolerance is statistical: measured on an H200 ~2^-6.7 *
// max|v| on the bundled tiny model and ~2^-7 on random HF models of both shapes; we allow 2^-5. The
// check that catches kernel bugs is the tight one above.
constexpr double kGpuVsHfAtolPerMaxV = 1.0 / 32;
constexpr double kGpuVsHfRtol = 1.0 / 128;

// v1 (cuBLAS) takes any head_dim that keeps rows 16-byte aligned; v2 any multiple of 8 up to 256.
bool kernel_fits_head_dim(AttentionKernel kernel, const AttentionShape& shape) {
  return kernel == AttentionKernel::V1Materialized || flash_supports_head_dim(shape.head_dim);
}

double max_abs(const TensorView& host_f32) {
  const float* x = host_f32.ptr<const float>();
  double m = 0.0;
  for (int64_t i = 0; i < host_f32.numel(); ++i) m = std::max(m, static_cast<double>(std::fabs(x[i])));
  return m;
}

// One captured layer's inputs and expected output, all prompts packed along the token axis (fp32, host).
struct PackedLayer {
  Tensor q, k, v;    // [T, q_dim], [T, kv_dim], [T, kv_dim]
  Tensor expected;   // [T, q_dim]  HF's attention output (o_proj's input)
};

PackedLayer pack_layer(const ReferenceSet& ref, int layer, const AttentionBatch& batch, const AttentionShape& shape) {
  const int64_t T = batch.total_q();
  PackedLayer packed{Tensor::empty({T, shape.q_dim()}, DType::F32, Device::CPU),
                     Tensor::empty({T, shape.kv_dim()}, DType::F32, Device::CPU),
                     Tensor::empty({T, shape.kv_dim()}, DType::F32, Device::CPU),
                     Tensor::empty({T, shape.q_dim()}, DType::F32, Device::CPU)};
  const std::string prefix = "layers." + std::to_string(layer) + ".";
  const std::pair<const char*, const Tensor*> parts[] = {
      {"q_rope", &packed.q}, {"k_rope", &packed.k}, {"v_proj", &packed.v}, {"attn", &packed.expected}};
  for (int i = 0; i < batch.batch_size(); ++i) {
    for (const auto& [name, dst] : parts) {
      const TensorView src = ref.prompt(i, prefix + name);
      const TensorView rows = dst->view().rows(batch.q_begin(i), batch.q_len(i));
      TVLLM_REQUIRE(src.shape == rows.shape, "reference p" + std::to_string(i) + "." + prefix + name + " is " +
                                                 src.describe() + ", expected " + shape_str(rows.shape));
      copy_view(rows, Tensor::copy_of(src, Device::CPU, DType::F32).view());
    }
  }
  return packed;
}

std::string row_name(const std::string& kernel, int prompt, int layer) {
  return kernel + "p" + std::to_string(prompt) + ".layers." + std::to_string(layer) + ".attn";
}

void check_cpu(const PackedLayer& layer_data, int layer, const AttentionBatch& batch, const AttentionShape& shape,
               Report& report) {
  Tensor out = Tensor::empty(layer_data.expected.shape(), DType::F32, Device::CPU);
  attention(out, layer_data.q, layer_data.k, layer_data.v, batch, shape);
  for (int i = 0; i < batch.batch_size(); ++i) {
    report.add(compare(row_name("", i, layer), out.view().rows(batch.q_begin(i), batch.q_len(i)),
                       layer_data.expected.view().rows(batch.q_begin(i), batch.q_len(i)), kCpuVsHf));
  }
}

void check_cuda(const PackedLayer& layer_data, int layer, const AttentionBatch& cpu_batch,
                const AttentionBatch& gpu_batch, const AttentionShape& shape,
                const std::vector<AttentionKernel>& kernels, AttentionWorkspace& ws, Report& report) {
  // bf16 on the device: HF's fp32 inputs rounded once.
  Tensor q = Tensor::copy_of(layer_data.q, Device::CUDA, DType::BF16);
  Tensor k = Tensor::copy_of(layer_data.k, Device::CUDA, DType::BF16);
  Tensor v = Tensor::copy_of(layer_data.v, Device::CUDA, DType::BF16);
  // The CPU reference on exactly those rounded values: what a perfect bf16-input kernel would produce.
  Tensor q_r = Tensor::copy_of(q, Device::CPU, DType::F32);
  Tensor k_r = Tensor::copy_of(k, Device::CPU, DType::F32);
  Tensor v_r = Tensor::copy_of(v, Device::CPU, DType::F32);
  Tensor ideal = Tensor::empty(layer_data.expected.shape(), DType::F32, Device::CPU);
  attention(ideal, q_r, k_r, v_r, cpu_batch, shape);
  const double max_v = max_abs(v_r);
  const Tolerance vs_cpu{kGpuVsCpuAtolPerMaxV * max_v, kGpuVsCpuRtol};
  const Tolerance vs_hf{kGpuVsHfAtolPerMaxV * max_v, kGpuVsHfRtol};

  Tensor out = Tensor::empty(layer_data.expected.shape(), DType::BF16, Device::CUDA);
  for (AttentionKernel kernel : kernels) {
    const std::string tag = std::string(attention_kernel_name(kernel)) + " ";
    // Poison: 0xFFFF is a bf16 NaN, so a row the kernel forgets to write fails the comparison.
    TVLLM_CUDA_CHECK(cudaMemset(out.data(), 0xFF, out.view().nbytes()));
    attention(out, q, k, v, gpu_batch, shape, kernel, &ws);
    TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
    for (int i = 0; i < gpu_batch.batch_size(); ++i) {
      const int64_t b = gpu_batch.q_begin(i), n = gpu_batch.q_len(i);
      report.add(compare(row_name(tag, i, layer), out.view().rows(b, n), layer_data.expected.view().rows(b, n), vs_hf));
    }
    report.add(compare(tag + "layers." + std::to_string(layer) + " vs CPU on bf16 inputs", out, ideal, vs_cpu));
  }
}

// ---- --bench -------------------------------------------------------------------------------------

std::string mib(size_t bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f MiB", static_cast<double>(bytes) / (1024.0 * 1024.0));
  return text;
}

// Useful FLOPs of causal attention: each of the n(n+1)/2 visible (query, key) pairs costs a head_dim
// dot product (2*D FLOPs) for the score and a head_dim axpy (2*D) for P V, in every head.
double causal_flops(const std::vector<int64_t>& lengths, const AttentionShape& shape) {
  double pairs = 0.0;
  for (int64_t n : lengths) pairs += 0.5 * static_cast<double>(n) * static_cast<double>(n + 1);
  return pairs * 4.0 * static_cast<double>(shape.head_dim) * static_cast<double>(shape.n_heads);
}

// Bytes each version moves through device memory (for the GB/s column).
//   both: q, k, v read once and out written once (the compulsory traffic; v2 moves little more, its K/V
//         re-reads across query tiles mostly hit L2)
//   v1:   plus its scores: the GEMM writes n^2 fp32, the softmax reads the causal half and writes n^2 bf16,
//         the P V GEMM reads n^2 bf16 (all per head)
double traffic_bytes(AttentionKernel kernel, const std::vector<int64_t>& lengths, const AttentionShape& shape) {
  double tokens = 0.0, n2 = 0.0;
  for (int64_t n : lengths) {
    tokens += static_cast<double>(n);
    n2 += static_cast<double>(n) * static_cast<double>(n);
  }
  double bytes = tokens * static_cast<double>(2 * shape.q_dim() + 2 * shape.kv_dim()) * 2.0;
  if (kernel == AttentionKernel::V1Materialized) bytes += n2 * static_cast<double>(shape.n_heads) * (4 + 2 + 2 + 2);
  return bytes;
}

struct BenchCase {
  std::string label;
  std::vector<int64_t> lengths;
};

void run_bench(const AttentionShape& shape, int64_t max_tokens) {
  std::vector<BenchCase> cases;
  for (int64_t n = 512; n <= std::max<int64_t>(512, max_tokens); n *= 2) cases.push_back({"n=" + std::to_string(n), {n}});
  // A prefill batch as a server sees it: prompts of many lengths (odd ones included), ~8k tokens.
  std::vector<int64_t> mixed = {3000, 2048, 1500, 777, 500, 129, 64, 1};
  int64_t mixed_total = 0;
  for (int64_t n : mixed) mixed_total += n;
  cases.push_back({"mixed 8 seqs (" + std::to_string(mixed_total) + " tok)", mixed});
  int64_t rows_needed = 0;
  for (const BenchCase& c : cases) {
    int64_t t = 0;
    for (int64_t n : c.lengths) t += n;
    rows_needed = std::max(rows_needed, t);
  }

  std::printf("\nbench shapes: %lld heads, %lld KV heads, head_dim %lld (the model's); random N(0,1) q/k/v\n",
              (long long)shape.n_heads, (long long)shape.n_kv_heads, (long long)shape.head_dim);
  // One random buffer of the largest size; every case uses its first rows.
  Tensor q = Tensor::from_f32(random_normal(static_cast<size_t>(rows_needed * shape.q_dim()), 1),
                              {rows_needed, shape.q_dim()}, DType::BF16, Device::CUDA);
  Tensor k = Tensor::from_f32(random_normal(static_cast<size_t>(rows_needed * shape.kv_dim()), 2),
                              {rows_needed, shape.kv_dim()}, DType::BF16, Device::CUDA);
  Tensor v = Tensor::from_f32(random_normal(static_cast<size_t>(rows_needed * shape.kv_dim()), 3),
                              {rows_needed, shape.kv_dim()}, DType::BF16, Device::CUDA);
  Tensor out = Tensor::empty({rows_needed, shape.q_dim()}, DType::BF16, Device::CUDA);

  const Ceilings ceilings = measure_ceilings(true);
  const AttentionKernel kernels[] = {AttentionKernel::V1Materialized, AttentionKernel::V2Flash};
  std::vector<BenchRow> rows;
  struct Summary {
    std::string label;
    double ms[2] = {NAN, NAN};
    size_t workspace[2] = {0, 0};
    std::string note;
  };
  std::vector<Summary> summary;
  CublasHandle cublas;  // v1's GEMMs; made once, outside every timed call
  for (const BenchCase& c : cases) {
    AttentionBatch batch = AttentionBatch::prefill(c.lengths, Device::CUDA);
    const AttentionLimits limits{batch.batch_size(), batch.max_q_len(), batch.max_k_len()};
    const int64_t T = batch.total_q();
    const TensorView qv = q.view().rows(0, T), kv = k.view().rows(0, T), vv = v.view().rows(0, T);
    const TensorView ov = out.view().rows(0, T);
    Summary s;
    s.label = c.label;
    for (int i = 0; i < 2; ++i) {
      const AttentionKernel kernel = kernels[i];
      s.workspace[i] = attention_workspace_bytes(kernel, shape, limits);
      if (!kernel_fits_head_dim(kernel, shape)) continue;
      try {
        // A fresh workspace per case, sized for exactly this batch: the memory each version needs.
        AttentionWorkspace ws(shape, limits, kernel, &cublas);
        BenchResult r = bench_gpu([&] { attention(ov, qv, kv, vv, batch, shape, kernel, &ws); });
        s.ms[i] = r.median_ms;
        rows.push_back({std::string(attention_kernel_name(kernel)) + (i == 0 ? " materialised " : " flash ") + c.label,
                        r, traffic_bytes(kernel, c.lengths, shape), causal_flops(c.lengths, shape)});
      } catch (const CudaError& e) {
        s.note += std::string(attention_kernel_name(kernel)) + " failed: " + e.what() + " ";
      }
    }
    summary.push_back(s);
  }
  print_bench_table(std::cout, "causal GQA attention, prefill (FLOPs: the causal half only, 4*D per pair per head)",
                    rows, ceilings);

  std::printf("\n%-28s %12s %12s %9s %18s %18s\n", "case", "v1 ms", "v2 ms", "v1/v2", "v1 extra memory",
              "v2 extra memory");
  for (const Summary& s : summary) {
    std::printf("%-28s %12.4f %12.4f %8.2fx %18s %18s\n", s.label.c_str(), s.ms[0], s.ms[1], s.ms[0] / s.ms[1],
                mib(s.workspace[0]).c_str(), mib(s.workspace[1]).c_str());
    if (!s.note.empty()) std::printf("    %s\n", s.note.c_str());
  }
  const char* v2_smem = shape.head_dim > 128 ? "none" : shape.head_dim > 64 ? "85 KiB" : "45 KiB";
  std::printf("(extra memory: beyond q, k, v and out. v1 holds n_heads x n^2 fp32 scores of the longest sequence;\n"
              " v2 (%s) keeps its tiles in shared memory: %s per block, nothing in device memory)\n",
              flash_path(shape.head_dim).c_str(), v2_smem);

  // The CPU reference, for scale (a short sequence: it is O(n^2) in double precision).
  const int64_t n_cpu = 256;
  Tensor qc = Tensor::copy_of(q.view().rows(0, n_cpu), Device::CPU, DType::F32);
  Tensor kc = Tensor::copy_of(k.view().rows(0, n_cpu), Device::CPU, DType::F32);
  Tensor vc = Tensor::copy_of(v.view().rows(0, n_cpu), Device::CPU, DType::F32);
  Tensor oc = Tensor::empty({n_cpu, shape.q_dim()}, DType::F32, Device::CPU);
  AttentionBatch cpu_batch = AttentionBatch::prefill({n_cpu}, Device::CPU);
  BenchResult cpu = bench_cpu([&] { attention(oc, qc, kc, vc, cpu_batch, shape); }, 0, 1);
  std::printf("CPU reference (double, one thread), n=%lld: %.1f ms = %.3f GFLOP/s\n", (long long)n_cpu,
              cpu.median_ms, causal_flops({n_cpu}, shape) / (cpu.median_ms * 1e-3) / 1e9);
}

int run(const LessonOptions& opt) {
  ModelDir model = ModelDir::open(opt.model_dir);
  ReferenceSet ref = ReferenceSet::open(opt.model_dir);
  const AttentionShape shape = AttentionShape::from_config(model.config);

  std::vector<int64_t> lengths;
  for (int i = 0; i < ref.num_prompts(); ++i) lengths.push_back(ref.prompt(i, "input_ids").shape[0]);
  // Every prompt is prefilled whole: q_len == k_len == its length. The host layout is used for packing.
  AttentionBatch batch = AttentionBatch::prefill(lengths, Device::CPU);
  std::string lengths_text;
  for (size_t i = 0; i < lengths.size(); ++i) {
    if (i) lengths_text += ", ";
    lengths_text += std::to_string(lengths[i]);
  }
  std::printf("model %s: %lld heads, %lld KV heads (group %lld), head_dim %lld, scale 1/sqrt(%lld)\n",
              model.path.string().c_str(), (long long)shape.n_heads, (long long)shape.n_kv_heads,
              (long long)shape.group_size(), (long long)shape.head_dim, (long long)shape.head_dim);
  std::printf("%d prompts packed into one varlen batch: lengths {%s}, %lld tokens\n", batch.batch_size(),
              lengths_text.c_str(), (long long)batch.total_q());

  Report report("lesson 07: attention -> " + std::string(device_name(opt.device)) +
                (opt.device == Device::CUDA ? " (kernel " + opt.kernel + " first, then the others)" : ""));
  std::vector<AttentionKernel> kernels{parse_attention_kernel(opt.kernel)};
  for (AttentionKernel k : {AttentionKernel::V1Materialized, AttentionKernel::V2Flash}) {
    if (k != kernels.front() && kernel_fits_head_dim(k, shape)) kernels.push_back(k);
  }
  // The GPU side, made once for every layer (as a model would): the batch's device arrays, one cuBLAS
  // handle, and a workspace sized for this batch that serves both kernels (made for v1).
  std::optional<AttentionBatch> gpu_batch;
  std::optional<CublasHandle> cublas;
  std::optional<AttentionWorkspace> workspace;
  if (opt.device == Device::CUDA) {
    std::printf("v2 runs on %s\n", flash_path(shape.head_dim).c_str());
    gpu_batch.emplace(AttentionBatch::prefill(lengths, Device::CUDA));
    cublas.emplace();
    workspace.emplace(shape, AttentionLimits{batch.batch_size(), batch.max_q_len(), batch.max_k_len()},
                      AttentionKernel::V1Materialized, &*cublas);
  }
  for (int layer : ref.captured_layers()) {
    const PackedLayer data = pack_layer(ref, layer, batch, shape);
    if (opt.device == Device::CPU) {
      check_cpu(data, layer, batch, shape, report);
    } else {
      check_cuda(data, layer, batch, *gpu_batch, shape, kernels, *workspace, report);
    }
  }
  report.print(std::cout);
  if (opt.bench && opt.device == Device::CUDA) run_bench(shape, opt.bench_tokens);
  return report.exit_code();
}

}  // namespace
}  // namespace tvllm

int main(int argc, char** argv) {
  tvllm::LessonCli cli("lesson07_attention", "causal grouped-query attention: materialised (v1) and flash-style (v2)");
  cli.kernels({"v1", "v2"}, "v2");
  return cli.run(argc, argv, tvllm::run);
}
