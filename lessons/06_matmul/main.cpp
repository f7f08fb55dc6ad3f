// lesson06_matmul: every linear layer of the captured layers, and the lm_head, against Hugging Face.
//
//   build/bin/lesson06_matmul [--model DIR] [--device auto|cpu|cuda] [--kernel v1|...|v8] [--bench]
//                             [--tokens N]
//
// For every prompt of the reference and every captured layer l it feeds the reference's own input of
// each projection to linear() and compares with the reference's output of that projection:
//   layers.l.input_layernorm          -> q_proj, k_proj, v_proj
//   layers.l.attn                     -> o_proj
//   layers.l.post_attention_layernorm -> gate_proj, up_proj
//   layers.l.mlp_act                  -> down_proj
//   norm                              -> logits (lm_head; tied: model.embed_tokens.weight)
// On the CPU it runs the fp32 reference; on CUDA the chosen kernel (one row per projection) and every
// other version (one row each, over all projections). A projection with a bias (Qwen2's q/k/v, a Llama with
// attention_bias or mlp_bias) is compared with the reference's output minus that bias: this lesson computes
// x W^T, and adding the bias is one step of lesson 08's forward.
//
// --bench (CUDA): each version on the model's projection shapes at prefill size (T = 4096 tokens
// unless --tokens is given; 4096 is the usual prefill chunk, and 16384 tokens through the lm_head would
// be a 4 GB output) and at decode size (T = 1), beside the measured copy bandwidth and cuBLAS's rate,
// then every version's TFLOP/s on the gate/up prefill shape against that measured GEMM ceiling.
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "common/bench.h"
#include "common/errors.h"
#include "common/lesson.h"
#include "common/random.h"
#include "common/validate.h"
#include "matmul.h"
#include "matmul_check.h"
#include "model_dir.h"

namespace {

using namespace tvllm;

// One linear layer to check: its input and output as the reference names them, and its weight.
struct Projection {
  std::string output;  // "layers.0.q_proj" (also the row's name in the report)
  std::string input;   // "layers.0.input_layernorm"
  std::string weight;  // "model.layers.0.self_attn.q_proj.weight"
  std::string bias;    // "model.layers.0.self_attn.q_proj.bias", or "" when the checkpoint has none
};

std::vector<Projection> projections_to_check(const ModelConfig& config, const std::vector<int>& layers,
                                             const WeightStore& weights) {
  std::vector<Projection> list;
  for (int l : layers) {
    const std::string ref = "layers." + std::to_string(l) + ".";
    const std::string w = "model.layers." + std::to_string(l) + ".";
    for (const char* p : {"q_proj", "k_proj", "v_proj"})
      list.push_back({ref + p, ref + "input_layernorm", w + "self_attn." + p + ".weight", ""});
    list.push_back({ref + "o_proj", ref + "attn", w + "self_attn.o_proj.weight", ""});
    for (const char* p : {"gate_proj", "up_proj"})
      list.push_back({ref + p, ref + "post_attention_layernorm", w + "mlp." + p + ".weight", ""});
    list.push_back({ref + "down_proj", ref + "mlp_act", w + "mlp.down_proj.weight", ""});
  }
  for (Projection& p : list) {
    const std::string bias = p.weight.substr(0, p.weight.size() - std::string("weight").size()) + "bias";
    if (weights.contains(bias)) p.bias = bias;
  }
  // Tied embeddings: the lm_head is the embedding matrix itself, [vocab, hidden], used as W.
  const bool tied = config.tie_word_embeddings && !weights.contains("lm_head.weight");
  list.push_back({"logits", "norm", tied ? "model.embed_tokens.weight" : "lm_head.weight", ""});
  return list;
}

std::string tolerance_line(const LinearTolerance& tol) {
  char line[256];
  std::snprintf(line, sizeof line,
                "tolerance: |got - ref| <= %.3g * rms(reference row) + %.3g * |ref|   (README: What correct means)\n",
                tol.atol_row_rms, tol.rtol);
  return line;
}

// ---- the check -----------------------------------------------------------------------------------

// The reference's output of p for prompt i, without p's bias when it has one: what x W^T alone must give
// (then copied into `storage`, which the view points into; fp32 subtraction of the stored bias, an error of
// about one ulp of the output, far inside the tolerance). Without a bias: the reference's own view, no copy.
TensorView expected_output(const ReferenceSet& ref, int i, const Projection& p, const WeightStore& weights,
                           Tensor& storage) {
  const TensorView out = ref.prompt(i, p.output);
  if (p.bias.empty()) return out;
  std::vector<float> y = to_f32_vector(out);
  const std::vector<float> b = to_f32_vector(weights.host(p.bias));
  TVLLM_REQUIRE(out.rank() == 2 && static_cast<int64_t>(b.size()) == out.dim(1),
                p.bias + " has " + std::to_string(b.size()) + " values for " + out.describe());
  for (size_t r = 0; r < y.size(); r += b.size())
    for (size_t o = 0; o < b.size(); ++o) y[r + o] -= b[o];
  storage = Tensor::from_f32(y, out.shape, DType::F32, Device::CPU);
  return storage.view();
}

int check_cpu(const ModelDir& model, const ReferenceSet& ref, const std::vector<Projection>& projections) {
  Report report("lesson06_matmul: y = x W^T, fp32 CPU reference vs Hugging Face fp32");
  for (const Projection& p : projections) {
    RowScaledComparison comparison(p.output, kF32VsReference);
    const TensorView w = model.weights.host(p.weight);  // [out, in] as stored (bf16), widened by linear()
    for (int i = 0; i < ref.num_prompts(); ++i) {
      const TensorView x = ref.prompt(i, p.input);  // [T, in] fp32
      Tensor storage;
      const TensorView expected = expected_output(ref, i, p, model.weights, storage);  // [T, out] fp32
      Tensor y = Tensor::empty({x.dim(0), w.dim(0)}, DType::F32, Device::CPU);
      linear(y, x, w);
      comparison.add(y, expected);
    }
    report.add(comparison.result());
  }
  std::cout << tolerance_line(kF32VsReference);
  report.print(std::cout);
  return report.exit_code();
}

int check_cuda(ModelDir& model, const ReferenceSet& ref, const std::vector<Projection>& projections,
               MatmulKernel chosen) {
  model.weights.upload_to_device(DType::BF16);  // one allocation; F16/F32 checkpoints become bf16
  CublasHandle handle;
  const std::string chosen_name =
      std::string(matmul_kernel_version(chosen)) + " (" + std::string(matmul_kernel_description(chosen)) + ")";
  Report report("lesson06_matmul: y = x W^T on CUDA, kernel " + chosen_name +
                ", bf16 in/out, fp32 accumulation, vs Hugging Face fp32");

  std::vector<RowScaledComparison> per_projection;  // the chosen kernel: one row per projection
  for (const Projection& p : projections) per_projection.emplace_back(p.output, kBf16VsReference);
  std::map<MatmulKernel, RowScaledComparison> others;  // every other version: one row over everything
  for (MatmulKernel k : all_matmul_kernels())
    if (k != chosen)
      others.emplace(k, RowScaledComparison("all projections, " + std::string(matmul_kernel_version(k)) + " " +
                                                std::string(matmul_kernel_description(k)),
                                            kBf16VsReference));

  for (int i = 0; i < ref.num_prompts(); ++i) {
    std::map<std::string, Tensor> inputs;  // q, k and v share one input: round it to bf16 once
    for (size_t j = 0; j < projections.size(); ++j) {
      const Projection& p = projections[j];
      auto found = inputs.find(p.input);
      if (found == inputs.end())
        // The fp32 reference input, rounded once to bf16 (round to nearest even) and uploaded.
        found = inputs.emplace(p.input, Tensor::copy_of(ref.prompt(i, p.input), Device::CUDA, DType::BF16)).first;
      const TensorView& x = found->second.view();  // [T, in] bf16
      const TensorView w = model.weights.device(p.weight);  // [out, in] bf16
      Tensor storage;
      const TensorView expected = expected_output(ref, i, p, model.weights, storage);  // [T, out] fp32
      for (MatmulKernel k : all_matmul_kernels()) {
        Tensor y = Tensor::empty({x.dim(0), w.dim(0)}, DType::BF16, Device::CUDA);
        // Poison: 0xFFFF is a bf16 NaN, so an element the kernel forgets to write fails the check.
        TVLLM_CUDA_CHECK(cudaMemset(y.data(), 0xFF, y.view().nbytes()));
        linear(y, x, w, k, &handle);
        if (k == chosen) {
          per_projection[j].add(y, expected);
        } else {
          others.at(k).add(y, expected);
        }
      }
    }
  }
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
  for (const RowScaledComparison& c : per_projection) report.add(c.result());
  for (const auto& [k, c] : others) report.add(c.result());
  std::cout << tolerance_line(kBf16VsReference);
  report.print(std::cout);
  return report.exit_code();
}

// ---- the benchmark -------------------------------------------------------------------------------

struct BenchShape {
  std::string name;
  int64_t in, out;
};

// The CPU reference, timed on one projection at a small T (it is an oracle, not a contender).
void bench_cpu_reference(const ModelConfig& c) {
  const int64_t tokens = 16, in = c.hidden_size, out = c.q_dim();
  Tensor x = Tensor::from_f32(random_uniform(static_cast<size_t>(tokens * in), 1), {tokens, in}, DType::F32,
                              Device::CPU);
  Tensor w = Tensor::from_f32(random_uniform(static_cast<size_t>(out * in), 2), {out, in}, DType::BF16,
                              Device::CPU);
  Tensor y = Tensor::empty({tokens, out}, DType::F32, Device::CPU);
  BenchResult r = bench_cpu([&] { linear(y, x, w); }, 1, 3);
  std::printf("\nCPU reference (double accumulation, up to %u threads): q_proj shape, T = %lld: %.2f ms, "
              "%.2f GFLOP/s\n",
              std::thread::hardware_concurrency(), static_cast<long long>(tokens), r.median_ms,
              2.0 * tokens * in * out / (r.median_ms * 1e-3) / 1e9);
}

void run_bench(const ModelConfig& c, int64_t prefill_tokens) {
  const Ceilings ceilings = measure_ceilings(true);
  const std::vector<BenchShape> shapes = {
      {"q_proj", c.hidden_size, c.q_dim()},          {"k_proj/v_proj", c.hidden_size, c.kv_dim()},
      {"o_proj", c.q_dim(), c.hidden_size},           {"gate_proj/up_proj", c.hidden_size, c.intermediate_size},
      {"down_proj", c.intermediate_size, c.hidden_size}, {"lm_head", c.hidden_size, c.vocab_size}};
  int64_t max_in = 0, max_out = 0, max_w = 0;
  for (const BenchShape& s : shapes) {
    max_in = std::max(max_in, s.in);
    max_out = std::max(max_out, s.out);
    max_w = std::max(max_w, s.in * s.out);
  }
  // One buffer per operand, viewed with each shape: random values (never zeros, which run faster).
  Tensor x_buf = Tensor::empty({prefill_tokens * max_in}, DType::BF16, Device::CUDA);
  Tensor w_buf = Tensor::empty({max_w}, DType::BF16, Device::CUDA);
  Tensor y_buf = Tensor::empty({prefill_tokens * max_out}, DType::BF16, Device::CUDA);
  fill_uniform_bf16(x_buf, 11);
  fill_uniform_bf16(w_buf, 12);
  CublasHandle handle;
  // v8 runs one cuBLASLt algorithm per weight shape at every T: which one (or why none, then v7 runs).
  for (const BenchShape& s : shapes) {
    const PinnedMatmulAlgo pin = pinned_matmul_algo(s.in, s.out, DType::BF16, handle);
    std::printf("v8 %s [%lld -> %lld]: %s%s\n", s.name.c_str(), static_cast<long long>(s.in),
                static_cast<long long>(s.out), pin.pinned ? "" : "not pinned, runs v7: ", pin.description.c_str());
  }

  const double naive_flop_limit = 5e11;  // v1 beyond this takes seconds per run: skipped
  std::vector<std::string> notes;
  std::map<MatmulKernel, double> target_tflops;  // each version on the gate/up prefill shape
  for (int64_t tokens : {prefill_tokens, int64_t{1}}) {
    std::vector<BenchRow> rows;
    for (const BenchShape& s : shapes) {
      const TensorView x = TensorView::contiguous(x_buf.data(), DType::BF16, Device::CUDA, {tokens, s.in});
      const TensorView w = TensorView::contiguous(w_buf.data(), DType::BF16, Device::CUDA, {s.out, s.in});
      const TensorView y = TensorView::contiguous(y_buf.data(), DType::BF16, Device::CUDA, {tokens, s.out});
      const double flops = 2.0 * tokens * s.in * s.out;
      const double bytes = 2.0 * (tokens * s.in + s.out * s.in + tokens * s.out);  // each operand once
      for (MatmulKernel k : all_matmul_kernels()) {
        const std::string name = s.name + " " + std::string(matmul_kernel_version(k)) + " " +
                                 std::string(matmul_kernel_description(k));
        if (k == MatmulKernel::V1Naive && flops > naive_flop_limit) {
          char note[200];
          std::snprintf(note, sizeof note, "%s at T = %lld: skipped (%.2f TFLOP per run)", name.c_str(),
                        static_cast<long long>(tokens), flops / 1e12);
          notes.push_back(note);
          continue;
        }
        BenchOptions options;  // tensor-core versions: 3 warm-ups, 20 timed runs
        if (k == MatmulKernel::V1Naive) options = {1, 5, true};
        if (k == MatmulKernel::V2Tiled) options = {2, 10, true};
        BenchRow row{name, bench_gpu([&] { linear(y, x, w, k, &handle); }, options), bytes, flops};
        if (tokens == prefill_tokens && s.name == "gate_proj/up_proj")
          target_tflops[k] = flops / (row.result.median_ms * 1e-3) / 1e12;
        rows.push_back(row);
      }
    }
    const double intensity = 2.0 * tokens * c.hidden_size * c.intermediate_size /
                             (2.0 * (tokens * c.hidden_size + c.hidden_size * c.intermediate_size +
                                     tokens * c.intermediate_size));
    char title[200];
    std::snprintf(title, sizeof title, "%s, T = %lld tokens (gate_proj: %.0f FLOP per byte)",
                  tokens == 1 ? "decode" : "prefill", static_cast<long long>(tokens), intensity);
    print_bench_table(std::cout, title, rows, ceilings);
  }
  for (const std::string& n : notes) std::cout << "note: " << n << "\n";
  if (ceilings.copy_gbs > 0 && ceilings.bf16_tflops > 0)
    std::printf("roofline ridge point: %.0f TFLOP/s / %.0f GB/s = %.0f FLOP per byte: below it a matmul is "
                "memory-bound (decode), above it compute-bound (prefill)\n",
                ceilings.bf16_tflops, ceilings.copy_gbs, ceilings.bf16_tflops * 1e12 / (ceilings.copy_gbs * 1e9));
  std::printf("x[%lld, %lld] W^T, W [%lld, %lld], TFLOP/s (%% of the measured %.0f TFLOP/s GEMM ceiling):\n",
              static_cast<long long>(prefill_tokens), static_cast<long long>(c.hidden_size),
              static_cast<long long>(c.intermediate_size), static_cast<long long>(c.hidden_size),
              ceilings.bf16_tflops);
  for (const auto& [k, tflops] : target_tflops)
    std::printf("  %s %-14s %6.1f  (%5.1f%%)\n", std::string(matmul_kernel_version(k)).c_str(),
                std::string(matmul_kernel_description(k)).c_str(), tflops,
                ceilings.bf16_tflops > 0 ? 100.0 * tflops / ceilings.bf16_tflops : 0.0);
  std::printf("cuBLAS target: v5 >= 700 TFLOP/s "
              "(for PyTorch on the same GPU run weights/tools/torch_kernel_baseline.py)\n");
  bench_cpu_reference(c);
}

}  // namespace

int main(int argc, char** argv) {
  LessonCli cli("lesson06_matmul",
                "Linear layers y = x W^T: naive, tiled, WMMA, mma.sync, cuBLAS (row-major trick) and cuBLASLt "
                "vs Hugging Face");
  cli.kernels({"v1", "v2", "v3", "v4", "v5", "v6", "v7", "v8"}, std::string(matmul_kernel_version(kDefaultMatmulKernel)));
  return cli.run(argc, argv, [&](const LessonOptions& opt) {
    ModelDir model = ModelDir::open(opt.model_dir);
    const ReferenceSet ref = ReferenceSet::open(opt.model_dir);
    const std::vector<Projection> projections =
        projections_to_check(model.config, ref.captured_layers(), model.weights);
    std::printf("model %s: hidden %lld, q_dim %lld, kv_dim %lld, intermediate %lld, vocab %lld; "
                "%d prompts, captured layers:",
                opt.model_dir.string().c_str(), static_cast<long long>(model.config.hidden_size),
                static_cast<long long>(model.config.q_dim()), static_cast<long long>(model.config.kv_dim()),
                static_cast<long long>(model.config.intermediate_size),
                static_cast<long long>(model.config.vocab_size), ref.num_prompts());
    for (int l : ref.captured_layers()) std::printf(" %d", l);
    std::printf("\n");

    const int rc = opt.device == Device::CPU
                       ? check_cpu(model, ref, projections)
                       : check_cuda(model, ref, projections, parse_matmul_kernel(opt.kernel));
    if (opt.bench && opt.device == Device::CUDA) {
      // 4096 tokens unless --tokens says otherwise (see the top of this file).
      run_bench(model.config, opt.bench_tokens_given ? opt.bench_tokens : 4096);
    }
    return rc;
  });
}
