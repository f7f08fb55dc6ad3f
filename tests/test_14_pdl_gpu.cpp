// Lesson 14 on the GPU: programmatic dependent launch (pdl.h) changes when the fused GEMVs start, never what they
// compute. The kernel is the same with and without it (the wait and the trigger are no-ops for a plain launch),
// so everything is checked BIT FOR BIT:
//   - the fused ops chained as a decode step chains them (each reading the one before's output, gemv_residual
//     overwriting h that the kernel before read): PDL on == PDL off. A wait placed after a read of the previous
//     kernel's output, or a write before it, would let a kernel read stale or half-written values and break it;
//   - each fused op launched with the attribute agrees with its CPU reference (so the equality is not two equal
//     wrongs);
//   - the decode logits of the bundled model, teacher-forced, PDL on == off: eagerly, through the graph runner
//     (every decode step replayed from a captured graph, whose programmatic edges come from the capture) and
//     through PinnedEagerLauncher (--enforce-eager);
//   - greedy and sampled ids through the Generator, graphs on, PDL on == off.
// On a GPU older than sm_90 pdl_supported() is false, use_fast_path installs the plain path, and the comparisons
// run the same launches twice (still true, and said so).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/cuda_stream.h"
#include "common/device.h"
#include "common/dtype.h"
#include "common/random.h"
#include "fast_forward.h"
#include "fast_path.h"
#include "gemv.h"
#include "generate.h"
#include "graph_runner.h"
#include "pdl.h"
#include "testing/engine_fixture.h"
#include "testing/fast_path_testing.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

const testing::BundledModel<Device::CUDA>& bundled() { return testing::bundled_model<Device::CUDA>(); }

// Random bf16-exact values as a host F32 tensor (the CPU references and the GPU see the same inputs).
Tensor random_rows(int64_t rows, int64_t cols, double scale, uint64_t seed) {
  Tensor t = Tensor::empty({rows, cols}, DType::F32, Device::CPU);
  Rng rng(seed);
  float* p = t.view().ptr<float>();
  for (int64_t i = 0; i < rows * cols; ++i) p[i] = bf16_to_f32(f32_to_bf16(static_cast<float>(rng.normal() * scale)));
  return t;
}
Tensor on_gpu(const Tensor& t) { return Tensor::copy_of(t.view(), Device::CUDA, DType::BF16); }
Tensor to_host(const TensorView& v) { return Tensor::copy_of(v, Device::CPU, DType::F32); }

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.view().shape == b.view().shape && a.view().nbytes() == b.view().nbytes() &&
         std::memcmp(a.view().data, b.view().data, a.view().nbytes()) == 0;
}

// |a - b| <= atol + rtol |b| everywhere: the GEMV tests' bound (two bf16 ulps relative, 2^-10 of the largest output
// absolute: the kernel rounds its fp32 sum once and adds in another order than the double reference).
bool within_gemv_bound(const Tensor& got, const Tensor& ref) {
  const float* a = got.view().ptr<const float>();
  const float* b = ref.view().ptr<const float>();
  const int64_t n = ref.view().numel();
  double largest = 0.0;
  for (int64_t i = 0; i < n; ++i) largest = std::max(largest, std::fabs(static_cast<double>(b[i])));
  for (int64_t i = 0; i < n; ++i)
    if (std::fabs(static_cast<double>(a[i]) - b[i]) > std::ldexp(largest, -10) + std::ldexp(std::fabs(b[i]), -7))
      return false;
  return true;
}

// One "layer" of weights at the 1B model's width (hidden 2048, intermediate 2048 to keep the test quick).
struct Layer {
  static constexpr int64_t H = 2048, I = 2048, Q = 3072;
  Tensor g1 = random_rows(1, H, 0.5, 1), g2 = random_rows(1, H, 0.5, 2);
  Tensor wqkv = random_rows(Q, H, 0.02, 3), wo = random_rows(H, Q, 0.02, 4);
  Tensor wgu = random_rows(2 * I, H, 0.02, 5), wd = random_rows(H, I, 0.02, 6);
  Tensor g1_d = on_gpu(g1), g2_d = on_gpu(g2), wqkv_d = on_gpu(wqkv), wo_d = on_gpu(wo), wgu_d = on_gpu(wgu),
         wd_d = on_gpu(wd);
};
const Layer& layer() {
  static const Layer l;
  return l;
}

// The fused chain of fast_forward, `layers` times over the same weights, on h (M = 1): every kernel reads what the
// one before wrote, and gemv_residual overwrites h, which the kernel before it read. Returns h.
Tensor run_chain(bool pdl, int layers) {
  const Layer& L = layer();
  const float eps = 1e-5f;
  Tensor h = on_gpu(random_rows(1, Layer::H, 1.0, 7));
  Tensor qkv = Tensor::empty({1, Layer::Q}, DType::BF16, Device::CUDA);
  Tensor act = Tensor::empty({1, Layer::I}, DType::BF16, Device::CUDA);
  CudaStream stream;
  for (int l = 0; l < layers; ++l) {
    rmsnorm_gemv(qkv.view(), h.view(), L.g1_d.view().reshape({Layer::H}), eps, L.wqkv_d.view(), stream.get(), pdl);
    gemv_residual(h.view(), qkv.view(), L.wo_d.view(), stream.get(), pdl);  // wo: [H, Q], reads what qkv wrote
    rmsnorm_gemv_silu_mul(act.view(), h.view(), L.g2_d.view().reshape({Layer::H}), eps, L.wgu_d.view(), stream.get(), pdl);
    gemv_residual(h.view(), act.view(), L.wd_d.view(), stream.get(), pdl);
  }
  stream.synchronize();
  return to_host(h.view());
}

TEST(Pdl14Gpu, AvailableOnHopperAndInstalledByTheFastPath) {
  TVLLM_REQUIRE_GPU();
  const DeviceProps props = query_device();
  int driver = 0, runtime = 0;
  ASSERT_EQ(cudaDriverGetVersion(&driver), cudaSuccess);
  ASSERT_EQ(cudaRuntimeGetVersion(&runtime), cudaSuccess);
  // The course needs CUDA 12.3+ anyway (graphs of lesson 14), so on Hopper or newer PDL must be on, and off below.
  if (props.compute_major >= 9)
    EXPECT_TRUE(pdl_supported()) << "sm_" << props.compute_major << props.compute_minor << ", driver " << driver
                                 << ", runtime " << runtime << ": both must be >= 12030";
  else
    EXPECT_FALSE(pdl_supported()) << "sm_" << props.compute_major << props.compute_minor;
  const EngineLimits limits = Generator::limits_for(bundled().w.config, 256, 1, 256);
  Generator with(bundled().w, limits), without(bundled().w, limits);
  // PDL is the fused path's: the megakernel (one launch per step) would take these steps otherwise.
  FastPathOptions fused_only;
  fused_only.megakernel = false;
  use_fast_path(with, fused_only);
  FastPathOptions no_pdl;
  no_pdl.pdl = false;
  no_pdl.megakernel = false;
  use_fast_path(without, no_pdl);
  EXPECT_EQ(with.context().forward_fn(), pdl_supported() ? &fast_forward_pdl : &fast_forward);
  EXPECT_EQ(without.context().forward_fn(), &fast_forward);
  EXPECT_EQ(fast_path_uses_pdl(fused_only, Device::CUDA), pdl_supported());
  EXPECT_FALSE(fast_path_uses_pdl(no_pdl, Device::CUDA));
}

TEST(Pdl14Gpu, EachFusedOpLaunchedWithTheAttributeMatchesItsReference) {
  TVLLM_REQUIRE_GPU();
  const Layer& L = layer();
  const float eps = 1e-5f;
  const Tensor h = random_rows(1, Layer::H, 1.0, 11), x = random_rows(1, Layer::Q, 1.0, 12);
  const Tensor h_d = on_gpu(h), x_d = on_gpu(x);
  CudaStream stream;
  const bool pdl = pdl_supported();
  // rmsnorm_gemv
  Tensor out = Tensor::empty({1, Layer::Q}, DType::BF16, Device::CUDA), ref = Tensor::empty({1, Layer::Q}, DType::F32, Device::CPU);
  rmsnorm_gemv(out.view(), h_d.view(), L.g1_d.view().reshape({Layer::H}), eps, L.wqkv_d.view(), stream.get(), pdl);
  stream.synchronize();
  rmsnorm_gemv_cpu(ref.view(), h.view(), L.g1.view().reshape({Layer::H}), eps, L.wqkv.view());
  EXPECT_TRUE(within_gemv_bound(to_host(out.view()), ref)) << "rmsnorm_gemv";
  // rmsnorm_gemv_silu_mul
  Tensor act = Tensor::empty({1, Layer::I}, DType::BF16, Device::CUDA), act_ref = Tensor::empty({1, Layer::I}, DType::F32, Device::CPU);
  rmsnorm_gemv_silu_mul(act.view(), h_d.view(), L.g2_d.view().reshape({Layer::H}), eps, L.wgu_d.view(), stream.get(), pdl);
  stream.synchronize();
  rmsnorm_gemv_silu_mul_cpu(act_ref.view(), h.view(), L.g2.view().reshape({Layer::H}), eps, L.wgu.view());
  EXPECT_TRUE(within_gemv_bound(to_host(act.view()), act_ref)) << "rmsnorm_gemv_silu_mul";
  // gemv_residual: h += x wo^T
  Tensor h2 = on_gpu(h), h2_ref = Tensor::copy_of(h.view(), Device::CPU, DType::F32);
  gemv_residual(h2.view(), x_d.view(), L.wo_d.view(), stream.get(), pdl);
  stream.synchronize();
  gemv_residual_cpu(h2_ref.view(), x.view(), L.wo.view());
  EXPECT_TRUE(within_gemv_bound(to_host(h2.view()), h2_ref)) << "gemv_residual";
}

TEST(Pdl14Gpu, AChainOfFusedOpsIsTheSameBitsWithAndWithoutPdl) {
  TVLLM_REQUIRE_GPU();
  if (!pdl_supported()) std::printf("note: no PDL on this GPU: both runs launch plainly\n");
  const Tensor start = to_host(on_gpu(random_rows(1, Layer::H, 1.0, 7)).view());
  const Tensor plain = run_chain(false, 16);
  EXPECT_FALSE(same_bits(plain, start)) << "the chain did nothing: the comparison below would prove nothing";
  for (int repeat = 0; repeat < 5; ++repeat)  // a race would show up as a difference in some run
    EXPECT_TRUE(same_bits(run_chain(true, 16), plain)) << "run " << repeat;
}

// Teacher forcing as Generator::forced_logits does it, but every step through the context's step launcher: the
// graph runner replays decode steps from graphs, PinnedEagerLauncher launches them with the same pinned splits.
using testing::forced_logits_launched;

std::vector<int32_t> forced_ids(int64_t n) {
  std::vector<int32_t> ids;
  for (int64_t i = 0; i < n; ++i) ids.push_back(static_cast<int32_t>((37 * i + 11) % 997));
  return ids;
}

TEST(Pdl14Gpu, DecodeLogitsAreTheSameBitsWithAndWithoutPdl) {
  TVLLM_REQUIRE_GPU();
  const EngineLimits limits = Generator::limits_for(bundled().w.config, 256, 1, 256);
  const std::vector<int32_t> prompt = {5, 6, 7, 8, 9, 10, 11};
  const std::vector<int32_t> forced = forced_ids(140);  // contexts cross the 64 and 128 buckets: 3 graphs
  Tensor unlaunched[2];  // lesson 10's forced_logits: forward_step() eagerly, without any launcher
  for (const bool graphs : {false, true}) {
    Tensor logits[2];
    for (const bool pdl : {false, true}) {
      Generator gen(bundled().w, limits);
      FastPathOptions o;
      o.graphs = graphs;
      o.pdl = pdl;
      o.megakernel = false;
      use_fast_path(gen, o);
      logits[pdl] = forced_logits_launched(gen, prompt, forced);
      if (graphs) {
        auto* runner = dynamic_cast<const GraphRunner*>(gen.context().launcher());
        ASSERT_NE(runner, nullptr);
        EXPECT_EQ(runner->stats().replays, static_cast<int64_t>(forced.size()) - 1);  // every decode step
      }
      if (!graphs) unlaunched[pdl] = gen.forced_logits(prompt, forced);
    }
    const std::string mode = graphs ? "graphs" : "--enforce-eager";
    EXPECT_TRUE(same_bits(logits[1], logits[0])) << mode;
    // Not two equal wrongs: the rows are finite, differ from step to step, and are not all zero.
    const float* p = logits[0].view().ptr<const float>();
    const int64_t V = bundled().w.config.vocab_size;
    double largest = 0.0;
    bool finite = true;
    for (int64_t i = 0; i < logits[0].view().numel(); ++i) {
      finite = finite && std::isfinite(p[i]);
      largest = std::max(largest, std::fabs(static_cast<double>(p[i])));
    }
    EXPECT_TRUE(finite) << mode;
    EXPECT_GT(largest, 0.1) << mode;
    EXPECT_NE(std::memcmp(p, p + V, static_cast<size_t>(V) * sizeof(float)), 0) << mode;
  }
  EXPECT_TRUE(same_bits(unlaunched[1], unlaunched[0])) << "Generator::forced_logits";
}

TEST(Pdl14Gpu, GeneratedIdsAreTheSameWithAndWithoutPdl) {
  TVLLM_REQUIRE_GPU();
  const EngineLimits limits = Generator::limits_for(bundled().w.config, 256, 1, 256);
  Generator with(bundled().w, limits), without(bundled().w, limits);
  // PDL is the fused path's: the megakernel (one launch per step) would take these steps otherwise.
  FastPathOptions fused_only;
  fused_only.megakernel = false;
  use_fast_path(with, fused_only);
  FastPathOptions no_pdl;
  no_pdl.pdl = false;
  no_pdl.megakernel = false;
  use_fast_path(without, no_pdl);
  for (const SamplingParams& sampling : {SamplingParams{0.0f, 0, 1.0f, 0}, SamplingParams{0.9f, 50, 0.9f, 42}}) {
    GenerateOptions opt;
    opt.max_new_tokens = 150;
    opt.ignore_eos = true;
    opt.sampling = sampling;
    for (const std::vector<int32_t>& prompt : {std::vector<int32_t>{744, 474, 274, 370}, std::vector<int32_t>{3, 1, 4}}) {
      const GenerateResult a = with.generate(prompt, opt), b = without.generate(prompt, opt);
      EXPECT_EQ(a.ids.size(), 150u);
      EXPECT_EQ(a.ids, b.ids) << "temperature " << sampling.temperature;
    }
  }
}

}  // namespace
}  // namespace tvllm
