// Lesson 17: a Llama model run tensor-parallel over N ranks, through lesson 08's pieces.
//
//   CpuSimComm comm(2);
//   TpModel model(full_cpu_weights, plan, Device::CPU, limits, comm);       // 2 ranks simulated on the CPU
//   Tensor logits = model.forward_prompts({ids}, /*all_rows=*/true);        // F32 [R, vocab] on the host
//
//   NcclComm nccl({0, 1});
//   TpModel gpu(full_cpu_weights, plan, Device::CUDA, limits, nccl);        // rank r on GPU nccl.devices()[r]
//
// Each rank is lesson 08's machinery sized by the plan's rank config (ExecContext: stream, cuBLAS handle,
// Workspace; PrefillAttention over its own heads; StepInputs with the step's ids on its device) and its own
// RankWeights. One host thread drives all ranks phase by phase: every rank queues its part of a phase, then the
// communicator's collective joins them. On the CPU the ranks run one after another (a simulation); on N GPUs the
// queued kernels run concurrently.
//
// Prefill steps only (each sequence attends to its own new tokens): a per-rank KV cache is lesson 17's next step
// (README 17, "What is not built yet").
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "common/errors.h"
#include "communicator.h"
#include "logits_check.h"
#include "rank_weights.h"
#include "shard_plan.h"
#include "transformer.h"

namespace tvllm {

struct TpRank {
  int rank = 0;
  int cuda_device = -1;  // CUDA: the GPU this rank's buffers and work live on
  RankWeights weights;
  std::unique_ptr<ExecContext> ctx;        // sized by the rank config
  std::unique_ptr<StepInputs> step;        // sized by the FULL config (ids checked against the whole vocab)
  std::unique_ptr<PrefillAttention> attn;  // this rank's heads
  Tensor gathered;                         // F32 [N * max_logits_rows * vocab/N]: the all-gathered logits
};

class TpModel {
 public:
  // devices: the CUDA device of each rank (default 0, 1, ..., N-1); ignored on the CPU. The communicator's world
  // size must equal the plan's.
  TpModel(const ModelWeights& full, const ShardPlan& plan, Device device, const EngineLimits& limits,
          Communicator& comm, std::vector<int> devices = {});
  ~TpModel();
  TpModel(const TpModel&) = delete;
  TpModel& operator=(const TpModel&) = delete;

  // One prefill step of these prompts; logits of every token (all_rows) or of each prompt's last token:
  // F32 [R, vocab] on the host, the vocabulary padding dropped.
  Tensor forward_prompts(const std::vector<std::vector<int32_t>>& prompts, bool all_rows);

  const ShardPlan& plan() const { return plan_; }
  Device device() const { return device_; }
  std::vector<TpRank>& ranks() { return ranks_; }
  Communicator& comm() { return comm_; }
  // All-reduces one forward step queues, and the bytes each moves per rank's buffer (for the README's counts).
  int64_t all_reduces_per_step() const { return 1 + 2 * plan_.full.num_hidden_layers; }

  // Runs f(rank) for every rank with that rank's CUDA device current (the device guard restores the caller's).
  template <class F>
  void for_each_rank(F&& f);

 private:
  ShardPlan plan_;
  Device device_;
  Communicator& comm_;
  std::vector<TpRank> ranks_;
};

// One decoder layer over every rank (exposed for the tests of the all-reduce placement): on entry each rank's h
// holds the residual stream and (layer > 0) delta the previous layer's MLP output, all-reduced; on exit the same
// for this layer.
void tp_decoder_layer(TpModel& model, int layer);

// The CPU simulation's bound, N > 1 against the unsharded fp32 reference: max |logit difference| <=
// kTpCpuLogitsTolPerMax x max |reference logit|. Only o_proj's and down_proj's sums change order (N partial sums
// of in/N products each, then added); every other op computes the same fp32 operations on the same values. One
// reordered fp32 sum of K terms moves by at most about K x 2^-24 x sum|terms| (README 17, "The CPU
// simulation"), and a layer's change is carried to the logits like any other rounding. Measured (test_17_tp_sim):
// 1.1e-7 x max|logit| on the bundled model at N = 2, 0.8e-7 and 1.0e-7 on the random 8-head model at N = 2 and 4,
// i.e. a few ulps of the largest logit. The bound is ~10x the largest and 50x below the distance
// (kCpuLogitsAtolPerMax = 5e-5) at which lesson 08's fp32 reference is held to Hugging Face's. A wrong shard or
// a missing all-reduce moves logits by O(max|logit|).
inline constexpr double kTpCpuLogitsTolPerMax = 1e-6;

// Limits that hold these prompts as one prefill step with every token's logits.
EngineLimits limits_for_prompts(const ModelConfig& config, const std::vector<std::vector<int32_t>>& prompts);

// The same step through lesson 08's unsharded forward (forward_composed) on the weights' device: what the
// tensor-parallel logits are compared with. F32 [R, vocab] on the host.
Tensor unsharded_logits(const ModelWeights& weights, const EngineLimits& limits,
                        const std::vector<std::vector<int32_t>>& prompts, bool all_rows);

// Lesson 08's GPU bound (logits_check.h) for the reference prompts p0..p{n-1} of model_dir run as one step:
// max(0.2 x rms(reference), 1.5 x the largest of Hugging Face's own bf16 errors on those prompts, where the
// manifest records them).
GpuLogitBound gpu_bound_for_prompts(const std::filesystem::path& model_dir, int num_prompts,
                                    const TensorView& reference);

// max |a - b| over two host F32 views of one shape, and max |a|.
double max_abs_difference(const TensorView& a, const TensorView& b);
double max_abs_value(const TensorView& a);

// ---- inline ----------------------------------------------------------------------------------------------

// Makes `device` current for its lifetime and restores the previous one (CUDA); nothing on the CPU.
class CurrentDevice {
 public:
  explicit CurrentDevice(int device) {
    if (device < 0) return;
    TVLLM_CUDA_CHECK(cudaGetDevice(&previous_));
    TVLLM_CUDA_CHECK(cudaSetDevice(device));
  }
  ~CurrentDevice() {
    if (previous_ >= 0) cudaSetDevice(previous_);  // (restoring cannot fail after a successful get)
  }
  CurrentDevice(const CurrentDevice&) = delete;
  CurrentDevice& operator=(const CurrentDevice&) = delete;

 private:
  int previous_ = -1;
};

template <class F>
void TpModel::for_each_rank(F&& f) {
  for (TpRank& r : ranks_) {
    CurrentDevice on(device_ == Device::CUDA ? r.cuda_device : -1);
    f(r);
  }
}

}  // namespace tvllm
