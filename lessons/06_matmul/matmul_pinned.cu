// Lesson 06, v8: batch-invariant at cuBLAS speed. One cuBLASLt algorithm PINNED per weight shape.
//
// v7 (matmul.cu) made the order of additions a function of W's shape by running our own kernel. v8 gets the
// same property from cuBLASLt, whose kernels reach ~3x v4's tensor-core throughput on Hopper. What made v5
// and v6 depend on T was never the kernels themselves: it was the CHOICE. For every call the heuristic picks
// an algorithm from the whole shape (T included): another T, maybe another tile, another split of K, another
// order of additions. v8 takes that choice away from T:
//
//   1. once per (device, in, out, output dtype), ask the heuristic for its best algorithms at a reference
//      T (kPinTokens, a busy decode step: see below), those that need no workspace first;
//   2. take the first that sums each output in ONE fp32 accumulator: split-K forced to 1 and reduction
//      scheme NONE (a split of K is a second order of additions, and cuBLASLt's own may come from T),
//      fp32 accumulation (CUBLASLT_ALGO_CAP_NUMERICAL_IMPL_FLAGS), at most 16-byte alignment needed,
//      and accepted by cublasLtMatmulAlgoCheck at every T of kCheckTokens (1 to 4096);
//   3. run every call of that shape, whatever its T, with exactly that algorithm (every field of its
//      configuration: id, tile, stages, swizzle, custom option, cluster shape).
//
// Why the bits then do not depend on T: with one piece of K, output element (t, o) is one accumulator that
// the kernel's main loop walks along K, tile after tile from column 0, each tile through the same tensor-core
// instructions, then rounds once. The tile grid changes with T (more or fewer tiles along the tokens), and a
// partial tile is padded with zeros that never meet row t: a tensor-core product's element (t, o) reads row
// t of x and row o of W only. So T changes how many tiles there are and where row t sits in one, never the
// sequence of operations that makes y[t][o]. That argument holds for the kernel a configuration names; it
// would break for a kernel that changes its inner behaviour with T (stream-K, which shares K between blocks
// according to the grid; an internal split-K heuristic; a different kernel below some M). Nothing in the
// API promises such a kernel is absent, so the argument is checked, not trusted: the GPU tests compare rows
// computed at T = 1, 2, 3, 7, 64, 333 and 4096 bit for bit, on the Llama 3.2 1B shapes
// (Matmul06Gpu.PinnedLtRowsAreTheSameBitsAtEveryT).
//
// Where v8 cannot pin (no candidate passes, in or out not a multiple of 8 so rows are not 16-byte aligned, or
// a view less aligned than the algorithm needs) it runs v7 for that call: batch-invariant too, slower. The
// shape-level reasons are printed once per shape; a shape runs one or the other for every T, never both.
//
// Host work (heuristic, checks, descriptors) happens the first time a (shape, T) is seen, as for v6, and is
// cached; nothing here allocates device memory or synchronises, so a warm-up step before a CUDA graph
// capture makes every plan.
#include <cublasLt.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "common/cuda_utils.cuh"
#include "common/errors.h"
#include "lt_plan.h"
#include "matmul.h"

namespace tvllm {

namespace {

using lt::cuda_type;
using lt::LtPlan;
using lt::LtPreference;

// The T the heuristic is asked at. One algorithm serves every T, so this decides where it is at its best. A
// busy server's steps are mostly decode steps of a few hundred sequences (bench throughput: ~35 prefill steps
// of 4096 tokens, ~1000 decode steps of up to 256), and a decode step is where a large tile hurts: 2048
// outputs in tiles of 128 are 16 blocks for 132 SMs, whatever T. A prefill step has blocks enough for any
// tile. (The lm_head only ever sees the logits rows: at most one per sequence.)
constexpr int kPinTokens = 256;
constexpr uint32_t kPinAlignment = 16;    // what every pointer of the engine has (rows of in % 8 == 0 bf16)
constexpr int kCandidates = 16;           // heuristic answers considered, best first
constexpr int kCheckTokens[] = {1, 2, 3, 7, 64, 256, 333, 4096};  // cublasLtMatmulAlgoCheck at each

// The pinned algorithm of one (device, in, out, output dtype), or why there is none.
struct Pin {
  bool ok = false;
  cublasLtMatmulAlgo_t algo{};
  uint32_t alignment = kPinAlignment;  // the largest pointer alignment the algorithm needs
  size_t workspace = 0;                // bytes of workspace it needs
  std::string description;             // its configuration, or why no algorithm was pinned
};

template <typename T>
T config_get(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attribute) {
  T value{};
  size_t written = 0;
  TVLLM_CUBLAS_CHECK(cublasLtMatmulAlgoConfigGetAttribute(&algo, attribute, &value, sizeof value, &written));
  return value;
}

template <typename T>
void config_set(cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attribute, T value) {
  TVLLM_CUBLAS_CHECK(cublasLtMatmulAlgoConfigSetAttribute(&algo, attribute, &value, sizeof value));
}

// A capability, or `fallback` when this cuBLASLt version does not report it.
template <typename T>
T capability(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoCapAttributes_t attribute, T fallback) {
  T value{};
  size_t written = 0;
  if (cublasLtMatmulAlgoCapGetAttribute(&algo, attribute, &value, sizeof value, &written) != CUBLAS_STATUS_SUCCESS)
    return fallback;
  return value;
}

std::string describe_config(const cublasLtMatmulAlgo_t& a) {
  return "cuBLASLt algo " + std::to_string(config_get<int32_t>(a, CUBLASLT_ALGO_CONFIG_ID)) +
         ", tile id " + std::to_string(config_get<uint32_t>(a, CUBLASLT_ALGO_CONFIG_TILE_ID)) +
         ", stages id " + std::to_string(config_get<uint32_t>(a, CUBLASLT_ALGO_CONFIG_STAGES_ID)) +
         ", split-K " + std::to_string(config_get<int32_t>(a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM)) +
         ", reduction " + std::to_string(config_get<uint32_t>(a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME)) +
         ", swizzle " + std::to_string(config_get<uint32_t>(a, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING)) +
         ", custom " + std::to_string(config_get<uint32_t>(a, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION)) +
         ", inner shape " + std::to_string(config_get<uint16_t>(a, CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID)) +
         ", cluster " + std::to_string(config_get<uint16_t>(a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID));
}

// cublasLtMatmulAlgoCheck for this algorithm at `tokens` tokens: true when it runs there within `workspace`
// bytes of workspace; *needed (if given) grows to the workspace it asks for.
bool runs_at(cublasLtHandle_t handle, const cublasLtMatmulAlgo_t& algo, int tokens, int in, int out, DType out_dtype,
             size_t workspace, size_t* needed = nullptr) {
  const LtPlan plan(tokens, in, out, cuda_type(out_dtype));
  cublasLtMatmulHeuristicResult_t result{};
  const cublasStatus_t status = cublasLtMatmulAlgoCheck(handle, plan.op.desc, plan.a.layout, plan.b.layout,
                                                        plan.c.layout, plan.c.layout, &algo, &result);
  if (status != CUBLAS_STATUS_SUCCESS) return false;
  if (needed) *needed = std::max(*needed, result.workspaceSize);
  return result.workspaceSize <= workspace;
}

// The heuristic's best algorithms for y = x W^T at kPinTokens tokens, within `workspace` bytes of workspace
// and 16-byte alignment. Empty when it has none.
std::vector<cublasLtMatmulHeuristicResult_t> candidates(const CublasHandle& handle, int in, int out, DType out_dtype,
                                                        uint64_t workspace) {
  const LtPlan reference(kPinTokens, in, out, cuda_type(out_dtype));
  LtPreference pref;
  TVLLM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                          &workspace, sizeof workspace));
  for (const cublasLtMatmulPreferenceAttributes_t attribute :
       {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
    TVLLM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.pref, attribute, &kPinAlignment, sizeof kPinAlignment));
  std::vector<cublasLtMatmulHeuristicResult_t> results(kCandidates);
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
      handle.lt(), reference.op.desc, reference.a.layout, reference.b.layout, reference.c.layout, reference.c.layout,
      pref.pref, kCandidates, results.data(), &found);
  results.resize(status == CUBLAS_STATUS_SUCCESS ? static_cast<size_t>(found) : 0);
  return results;
}

// Step 2 for one candidate: one piece of K, fp32, 16-byte alignment, every T of kCheckTokens within
// `workspace`. Fills *pin and returns true when it qualifies.
bool try_pin(const CublasHandle& handle, cublasLtMatmulAlgo_t algo, int in, int out, DType out_dtype,
             uint64_t workspace, Pin* pin) {
  const bool forced = config_get<int32_t>(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM) > 1;
  config_set<int32_t>(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, 1);
  config_set<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, CUBLASLT_REDUCTION_SCHEME_NONE);
  // fp32 accumulation, the promise of every version (an unreported accumulator type is not refused).
  const uint64_t flags = capability<uint64_t>(algo, CUBLASLT_ALGO_CAP_NUMERICAL_IMPL_FLAGS, 0);
  const uint64_t accumulator = flags & CUBLASLT_NUMERICAL_IMPL_FLAGS_ACCUMULATOR_TYPE_MASK;
  if (accumulator != 0 && accumulator != CUBLASLT_NUMERICAL_IMPL_FLAGS_ACCUMULATOR_32F) return false;
  uint32_t alignment = 1;
  for (const cublasLtMatmulAlgoCapAttributes_t attribute :
       {CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_A_BYTES, CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_C_BYTES, CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_D_BYTES})
    alignment = std::max(alignment, capability<uint32_t>(algo, attribute, kPinAlignment));
  if (alignment > kPinAlignment) return false;
  size_t needed = 0;
  for (const int tokens : kCheckTokens)
    if (!runs_at(handle.lt(), algo, tokens, in, out, out_dtype, workspace, &needed)) return false;
  pin->ok = true;
  pin->algo = algo;
  pin->alignment = alignment;
  pin->workspace = needed;
  pin->description = describe_config(algo) + (forced ? " (its split of K forced to 1)" : "") +
                     (needed == 0 ? ", no workspace" : ", " + std::to_string(needed) + " bytes of workspace");
  return true;
}

// Steps 1 and 2 of the header comment. First among the algorithms that need NO workspace: a kernel with nowhere
// to keep another block's partial sums cannot share K between blocks (split-K, stream-K), the strongest sign
// that each output is one accumulator. Only if none qualifies, among those that may use the handle's workspace.
// Within each, the candidates that already sum K in one piece before the split ones forced to one piece (their
// tile was chosen for a split: slower, but still one order).
Pin choose_pin(const CublasHandle& handle, int in, int out, DType out_dtype) {
  Pin pin;
  if (in % 8 != 0 || out % 8 != 0) {
    pin.description = "in and out must be multiples of 8 (16-byte rows)";
    return pin;
  }
  size_t considered = 0;
  for (const uint64_t workspace : {uint64_t{0}, static_cast<uint64_t>(handle.workspace_bytes())}) {
    const std::vector<cublasLtMatmulHeuristicResult_t> found = candidates(handle, in, out, out_dtype, workspace);
    considered += found.size();
    for (const bool split : {false, true})
      for (const cublasLtMatmulHeuristicResult_t& r : found)
        if (r.state == CUBLAS_STATUS_SUCCESS &&
            (config_get<int32_t>(r.algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM) > 1) == split &&
            try_pin(handle, r.algo, in, out, out_dtype, workspace, &pin))
          return pin;
  }
  pin.description = "none of the heuristic's " + std::to_string(considered) +
                    " answers runs in one piece of K, fp32, 16-byte aligned, at every T of 1, 2, 3, 7, 64, 256, 333, "
                    "4096";
  return pin;
}

// The pins (one per weight shape) and the plans (one per shape and T, each carrying a copy of its shape's
// pinned algorithm), shared by every CublasHandle of the process, like v6's LtPlanCache. Handed out as
// shared_ptr so that clearing the bounded plan map never pulls a plan from under a caller.
class PinnedLtCache {
 public:
  using PinKey = std::tuple<int, int, int, int>;          // device, in, out, output dtype
  using PlanKey = std::tuple<int, int, int, int, int>;    // + tokens

  std::shared_ptr<const Pin> pin(const CublasHandle& handle, int in, int out, DType out_dtype) {
    const PinKey key{current_device(), in, out, static_cast<int>(out_dtype)};
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = pins_.find(key);
    if (found != pins_.end()) return found->second;
    auto made = std::make_shared<const Pin>(choose_pin(handle, in, out, out_dtype));
    if (!made->ok)  // once per shape: a notice, not an error (v7 is batch-invariant too)
      std::fprintf(stderr, "linear v8: no pinned cuBLASLt algorithm for W [%d, %d] with %s output: %s; this shape "
                           "runs v7 (batch-invariant too, slower)\n",
                   out, in, std::string(dtype_name(out_dtype)).c_str(), made->description.c_str());
    pins_.emplace(key, made);
    return made;
  }

  std::shared_ptr<const LtPlan> plan(const CublasHandle& handle, const Pin& pin, int tokens, int in, int out,
                                     DType out_dtype) {
    const PlanKey key{current_device(), tokens, in, out, static_cast<int>(out_dtype)};
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = plans_.find(key);
    if (found != plans_.end()) return found->second;
    // kCheckTokens covered the typical T; any other is checked here, once. A T the pinned algorithm refuses
    // is an error rather than a quiet switch to another algorithm, which would change the bits. (Inside a
    // stream capture the check is left to cublasLtMatmul itself, which refuses the same way: a capture is no
    // place for calls we do not need.)
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;  // the legacy stream is never captured
    if (handle.stream() != nullptr) TVLLM_CUDA_CHECK(cudaStreamIsCapturing(handle.stream(), &capturing));
    if (capturing == cudaStreamCaptureStatusNone &&
        !runs_at(handle.lt(), pin.algo, tokens, in, out, out_dtype, handle.workspace_bytes()))
      throw CudaError("linear v8: the algorithm pinned for W [" + std::to_string(out) + ", " + std::to_string(in) +
                      "] (" + pin.description + ") does not run at T = " + std::to_string(tokens) +
                      " with a workspace of " + std::to_string(handle.workspace_bytes()) + " bytes");
    if (plans_.size() >= kMaxPlans) plans_.clear();
    auto made = std::make_shared<LtPlan>(tokens, in, out, cuda_type(out_dtype));
    made->algo = pin.algo;
    plans_.emplace(key, made);
    return made;
  }

 private:
  static constexpr size_t kMaxPlans = 4096;
  static int current_device() {
    int device = 0;
    TVLLM_CUDA_CHECK(cudaGetDevice(&device));
    return device;
  }
  std::mutex mutex_;
  std::map<PinKey, std::shared_ptr<const Pin>> pins_;
  std::map<PlanKey, std::shared_ptr<const LtPlan>> plans_;
};

PinnedLtCache& pinned_lt() {
  static PinnedLtCache cache;
  return cache;
}

}  // namespace

PinnedMatmulAlgo pinned_matmul_algo(int64_t in, int64_t out, DType out_dtype, const CublasHandle& handle) {
  TVLLM_REQUIRE(in >= 1 && out >= 1 && in <= INT32_MAX && out <= INT32_MAX,
                "pinned_matmul_algo: in and out must be in [1, 2^31), got " + std::to_string(in) + " and " +
                    std::to_string(out));
  TVLLM_REQUIRE(out_dtype == DType::BF16 || out_dtype == DType::F32,
                "pinned_matmul_algo: the output is BF16 or F32, got " + std::string(dtype_name(out_dtype)));
  const std::shared_ptr<const Pin> pin =
      pinned_lt().pin(handle, static_cast<int>(in), static_cast<int>(out), out_dtype);
  return PinnedMatmulAlgo{pin->ok, pin->description};
}

bool detail::linear_pinned_lt(const TensorView& y, const TensorView& x, const TensorView& w,
                              const CublasHandle& handle) {
  const int tokens = static_cast<int>(x.shape[0]), in = static_cast<int>(x.shape[1]);
  const int out = static_cast<int>(w.shape[0]);
  const std::shared_ptr<const Pin> pin = pinned_lt().pin(handle, in, out, y.dtype);
  if (!pin->ok) return false;
  // A view less aligned than the algorithm needs cannot use it (the engine's never are: its buffers start
  // 256-byte aligned and rows are 16-byte multiples). Its rows then come from v7, for every T alike.
  for (const void* p : {x.data, w.data, y.data})
    if (pointer_alignment(p, 256) < pin->alignment) return false;
  TVLLM_REQUIRE(pin->workspace <= handle.workspace_bytes(),
                "linear v8: the algorithm pinned for W [" + std::to_string(out) + ", " + std::to_string(in) +
                    "] needs " + std::to_string(pin->workspace) + " bytes of workspace, the CublasHandle has " +
                    std::to_string(handle.workspace_bytes()));
  const std::shared_ptr<const LtPlan> plan = pinned_lt().plan(handle, *pin, tokens, in, out, y.dtype);
  const float alpha = 1.f, beta = 0.f;
  TVLLM_CUBLAS_CHECK(cublasLtMatmul(handle.lt(), plan->op.desc, &alpha,
                                    /*A=*/w.data, plan->a.layout,
                                    /*B=*/x.data, plan->b.layout, &beta,
                                    /*C=*/y.data, plan->c.layout,
                                    /*D=*/y.data, plan->c.layout, &plan->algo,
                                    handle.workspace(), handle.workspace_bytes(), handle.stream()));
  return true;
}

}  // namespace tvllm
