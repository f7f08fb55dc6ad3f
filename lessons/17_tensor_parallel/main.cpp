// lesson17_tensor_parallel: one model cut across N ranks (Megatron-style tensor parallelism), checked against
// lesson 08's unsharded forward on every reference prompt of the bundled model.
//
//   build/bin/lesson17_tensor_parallel [--model DIR] [--device auto|cpu|cuda] [--tp N]
//
//   1. the shard plan for N = 1, 2, 4, 8: what each rank holds, or why the model cannot be cut that way
//   2. cpu:  N ranks simulated on the CPU (CpuSimComm), every size the model allows up to --tp (default 4):
//              N = 1 bit for bit the unsharded fp32 forward; N > 1 within kTpCpuLogitsTolPerMax x max|logit|
//              (only o_proj's and down_proj's sums change order) and the same argmax at clear margins
//   3. cuda: TP=1 through the same TpModel over a one-rank NCCL communicator, against the fp32 reference and
//            lesson 08's own GPU forward (lesson 08's bf16 bound); with 2+ GPUs also TP=2 (else: "needs 2 GPUs").
//            Built without NCCL: exit 77 (skipped) with a message.
//   The all-reduces one step makes and the bytes each moves are printed (README 17, "What an all-reduce moves").
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "common/errors.h"
#include "common/lesson.h"
#include "common/validate.h"
#include "communicator.h"
#include "logits_check.h"
#include "model_dir.h"
#include "shard_plan.h"
#include "tp_model.h"
#if TVLLM_HAVE_NCCL
#include "nccl_comm.h"
#endif

namespace tvllm {
namespace {

int g_max_tp = 4;  // --tp

std::string fmt(const char* format, double value) {
  char text[64];
  std::snprintf(text, sizeof text, format, value);
  return text;
}

// The sizes this model can be cut into, among 1, 2, 4, 8 up to `up_to`; the others' refusals printed.
std::vector<int> print_plans(const ModelConfig& c, int up_to) {
  std::vector<int> ok;
  for (int n : {1, 2, 4, 8}) {
    if (n > up_to) break;
    try {
      const ShardPlan p = ShardPlan::make(c, n);
      std::printf("N = %d: %lld heads, %lld KV heads, %lld MLP columns, %lld vocabulary rows per rank%s\n", n,
                  (long long)p.ranks[0].q_heads, (long long)p.ranks[0].kv_heads, (long long)p.ranks[0].intermediate,
                  (long long)p.ranks[0].vocab, p.padded_vocab != c.vocab_size ? " (padded)" : "");
      if (n == 2)
        for (const std::string& line : p.describe()) std::printf("    %s\n", line.c_str());
      ok.push_back(n);
    } catch (const InputError& e) {
      std::printf("N = %d: refused: %s\n", n, e.what());
    }
  }
  return ok;
}

// The collectives of one step of T tokens (R logits rows) and their sizes: what an all-reduce moves.
void print_traffic(const ModelConfig& c, int64_t T, int64_t R, int n, size_t activation_bytes) {
  const double S = static_cast<double>(T * c.hidden_size) * static_cast<double>(activation_bytes);
  const int64_t reduces = 1 + 2 * c.num_hidden_layers;
  std::printf("  N = %d: %lld all-reduces of %.1f KiB (T = %lld tokens x hidden %lld x %zu B) and one all-gather "
              "of %.1f KiB of logits;\n         a ring all-reduce sends 2(N-1)/N x S = %.1f KiB per rank each\n",
              n, (long long)reduces, S / 1024, (long long)T, (long long)c.hidden_size, activation_bytes,
              static_cast<double>(R * c.vocab_size * 4) / 1024, 2.0 * (n - 1) / n * S / 1024);
}

int run(const LessonOptions& opt) {
  const ModelDir model = ModelDir::open(opt.model_dir);
  const ReferenceSet ref = ReferenceSet::open(opt.model_dir);
  const ModelConfig& c = model.config;
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < ref.num_prompts(); ++i) prompts.push_back(ref.prompt_ids(i));
  const EngineLimits limits = limits_for_prompts(c, prompts);
  int64_t T = 0;
  for (const auto& p : prompts) T += static_cast<int64_t>(p.size());

  std::printf("model %s: %lld layers, hidden %lld, %lld heads / %lld KV heads, intermediate %lld, vocab %lld\n",
              model.path.string().c_str(), (long long)c.num_hidden_layers, (long long)c.hidden_size,
              (long long)c.num_attention_heads, (long long)c.num_key_value_heads, (long long)c.intermediate_size,
              (long long)c.vocab_size);
  std::printf("\nthe shard plans:\n");
  const std::vector<int> sizes = print_plans(c, std::max(g_max_tp, 8));
  const ModelWeights full = ModelWeights::bind(model, Device::CPU);  // every rank cuts its shard from the mapping
  std::printf("\nthe reference: lesson 08's unsharded fp32 forward of %d prompts (%lld tokens, every position)\n",
              ref.num_prompts(), (long long)T);
  const Tensor fp32 = unsharded_logits(full, limits, prompts, true);
  const double scale = max_abs_value(fp32);

  const bool gpu = opt.device == Device::CUDA;
  Report report(std::string("lesson 17: tensor parallelism -> ") +
                (gpu ? "cuda (NCCL; lesson 08's bf16 bound)" : "cpu (N ranks simulated, fp32)"));
  auto check = [&](const std::string& name, bool pass, const std::string& detail) {
    std::printf("  %-34s %s  %s\n", name.c_str(), pass ? "PASS" : "FAIL", detail.c_str());
    report.add_check(name, pass, detail);
  };

  if (!gpu) {
    std::printf("\nthe CPU simulation (ranks run one after another; all-reduce = sum in rank order):\n");
    for (int n : sizes) {
      if (n > g_max_tp) break;
      CpuSimComm comm(n);
      TpModel tp(full, ShardPlan::make(c, n), Device::CPU, limits, comm);
      const Tensor got = tp.forward_prompts(prompts, true);
      print_traffic(c, T, T, n, 4);
      const std::string name = "TP=" + std::to_string(n) + " == unsharded";
      if (n == 1) {
        report.add(compare(name + " (bit for bit)", got, fp32, Tolerance{0.0, 0.0}));
      } else {
        const double tol = kTpCpuLogitsTolPerMax * scale;
        report.add(compare(name + " (sum order)", got, fp32, Tolerance{tol, 0.0}));
        const Top1Agreement a = top1_agreement(got, fp32, 2 * tol);
        check("TP=" + std::to_string(n) + " top-1 at clear margins", a.pass(),
              a.summary() + ", max |err| = " + fmt("%.3g", a.max_abs_error / scale) + " x max|logit|");
      }
    }
    report.print(std::cout);
    return report.exit_code();
  }

#if !TVLLM_HAVE_NCCL
  std::printf("\n--device cuda: this build has no NCCL (cmake/TvllmNccl.cmake found none; configure with "
              "-DTVLLM_NCCL_ROOT=<dir with include/nccl.h and lib/libnccl.so*>): skipped\n");
  return kExitSkip;
#else
  const int gpus = cuda_device_count();
  std::printf("\nNCCL %s, %d GPU(s); NCCL_NVLS_ENABLE=0 (no multicast)\n", nccl_version_string().c_str(), gpus);
  const GpuLogitBound eps = gpu_bound_for_prompts(opt.model_dir, ref.num_prompts(), fp32);
  auto gpu_checks = [&](const std::string& what, const Tensor& got, const Tensor& want) {
    const Top1Agreement a = top1_agreement(got, want, eps.clear_margin());
    check(what + ": top-1", a.pass() && a.clear > 0, a.summary());
    check(what + ": max |err|", a.max_abs_error <= eps.epsilon,
          fmt("%.4g", a.max_abs_error) + " <= " + eps.describe());
  };
  Tensor one;
  {
    NcclComm comm({0});
    TpModel tp(full, ShardPlan::make(c, 1), Device::CUDA, limits, comm);
    one = tp.forward_prompts(prompts, true);
    print_traffic(c, T, T, 1, 2);
  }
  gpu_checks("TP=1 (NCCL) vs fp32", one, fp32);
  {
    const ModelWeights w08 = ModelWeights::bind(model, Device::CUDA);
    gpu_checks("TP=1 (NCCL) vs lesson 08 GPU", one, unsharded_logits(w08, limits, prompts, true));
  }
  const bool two_ok = std::find(sizes.begin(), sizes.end(), 2) != sizes.end() && g_max_tp >= 2;
  if (gpus >= 2 && two_ok) {
    NcclComm comm({0, 1});
    TpModel tp(full, ShardPlan::make(c, 2), Device::CUDA, limits, comm);
    const Tensor two = tp.forward_prompts(prompts, true);
    print_traffic(c, T, T, 2, 2);
    gpu_checks("TP=2 (NCCL) vs fp32", two, fp32);
    gpu_checks("TP=2 vs TP=1", two, one);
  } else {
    std::printf("  TP=2: not run (%s)\n", gpus < 2 ? ("needs 2 GPUs, " + std::to_string(gpus) + " here").c_str()
                                                   : "the model or --tp does not allow it");
  }
  report.print(std::cout);
  return report.exit_code();
#endif
}

}  // namespace
}  // namespace tvllm

int main(int argc, char** argv) {
  tvllm::LessonCli cli("lesson17_tensor_parallel",
                       "tensor parallelism: the model cut across N ranks, two all-reduces per layer");
  cli.app().add_option("--tp", tvllm::g_max_tp, "the largest tensor-parallel size to run (1, 2, 4 or 8)")
      ->check(CLI::IsMember({1, 2, 4, 8}))
      ->capture_default_str();
  return cli.run(argc, argv, tvllm::run);
}
