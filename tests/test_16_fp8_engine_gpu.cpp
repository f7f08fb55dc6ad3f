// Lesson 16 on the GPU: FP8 weights resident in the engine (fp8_resident.h). The bundled model is quantized
// with lesson 16's quantize_checkpoint into a temporary directory and opened twice: dequantized at load (lesson
// 01, bf16 on the GPU: the engine before this lesson) and resident (E4M3 codes + F32 per-row scales).
//
// What must hold, and how exactly:
//   - the dequantizer (what the prefill GEMMs read) equals dequantize-at-load bit for bit: both round the same
//     exact fp32 product fp8 * scale once to bf16 (the scales are BF16-born, 8 significant bits);
//   - so without the fused decode path every step is the same GEMM on the same bf16 values: resident and
//     dequantized logits are the SAME BITS;
//   - with the fused path, decode steps read the codes and apply the scale to the fp32 sum: the weights are then
//     q * scale exactly instead of round_bf16(q * scale), a relative difference <= 2^-9 per weight, noise of the
//     same kind and size as the bf16 roundings the GPU's logit bound e (lesson 08's gpu_logit_bound, as lesson
//     14's tests use it) already covers. We allow 2e on every logit, and the greedy ids must be equal up to the
//     first step where the dequantized engine's top-1 margin is within 2e (a near-tie may flip: lesson 10's rule).
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/errors.h"
#include "engine.h"
#include "engine_bench.h"
#include "engine_check.h"
#include "engine_paged.h"
#include "fast_forward.h"
#include "fast_path.h"
#include "fp8_resident.h"
#include "gemv.h"
#include "generate.h"
#include "generate_check.h"
#include "logits_check.h"
#include "model_dir.h"
#include "model_weights.h"
#include "quantize.h"
#include "graph_runner.h"
#include "testing/engine_fixture.h"
#include "testing/gpu_reference.h"
#include "testing/testing.h"
#include "testing/fp8_testing.h"

namespace tvllm {
namespace {

// The bundled model quantized once per process, opened both ways, bound on the GPU.
struct Fp8Models {
  testing::TempDir tmp;
  ModelDir dequantized_dir, resident_dir;
  ModelWeights dequantized, resident;
  static ModelDir quantized(const testing::TempDir& t, Fp8Load how) {
    if (!std::filesystem::exists(t / "fp8"))
      quantize_checkpoint(testing::tiny_model_dir(), t / "fp8", QuantizeOptions{});
    return ModelDir::open(t / "fp8", how);
  }
  Fp8Models()
      : dequantized_dir(quantized(tmp, Fp8Load::Dequantize)),
        resident_dir(quantized(tmp, Fp8Load::Resident)),
        dequantized(ModelWeights::bind(dequantized_dir, Device::CUDA)),
        resident(ModelWeights::bind(resident_dir, Device::CUDA)) {
    install_fp8_resident_weights();
  }
};
const Fp8Models& models() {
  static const Fp8Models m;
  return m;
}

const testing::BundledReferences& refs() { return testing::bundled_references(); }

EngineLimits limits(const ModelWeights& w) { return Generator::limits_for(w.config, 256, 1, 256); }

TEST(Fp8Engine16Gpu, ResidentWeightsAreCodesWithScalesAndTakeTheFusedPath) {
  TVLLM_REQUIRE_GPU();
  const ModelWeights& r = models().resident;
  const ModelWeights& d = models().dequantized;
  EXPECT_TRUE(models().resident_dir.fp8_resident);
  EXPECT_FALSE(models().dequantized_dir.fp8_resident);
  EXPECT_TRUE(r.fp8_resident);
  EXPECT_FALSE(d.fp8_resident);
  for (const LayerWeights& L : r.layers) {
    EXPECT_TRUE(L.fp8());
    for (const auto* pair : {&L.wqkv, &L.wo, &L.w_gate_up, &L.w_down}) EXPECT_EQ(pair->dtype, DType::F8_E4M3);
    EXPECT_EQ(L.wqkv_scale.dtype, DType::F32);
    EXPECT_EQ(L.wqkv_scale.numel(), L.wqkv.shape[0]);
    EXPECT_EQ(L.w_gate_up_scale.numel(), L.w_gate_up.shape[0]);
    EXPECT_EQ(L.wq.dtype, DType::F8_E4M3);  // the row slices too
  }
  EXPECT_EQ(r.lm_head.dtype, DType::BF16);  // lm_head and the embeddings stay as the checkpoint has them
  EXPECT_EQ(r.embed.dtype, DType::BF16);
  EXPECT_LT(r.device_bytes, d.device_bytes);  // half the Linear bytes, plus one bf16 scratch
  EXPECT_TRUE(fast_forward_supported(r));
  EXPECT_EQ(fast_forward_max_tokens(r), kGemvMaxRows);
  EXPECT_EQ(fast_forward_max_tokens(d), fast_forward_max_tokens());
}

TEST(Fp8Engine16Gpu, TheDequantizerEqualsDequantizeAtLoadBitForBit) {
  TVLLM_REQUIRE_GPU();
  const ModelWeights& r = models().resident;
  const ModelWeights& d = models().dequantized;
  for (size_t l = 0; l < r.layers.size(); ++l) {
    const LayerWeights& R = r.layers[l];
    const LayerWeights& D = d.layers[l];
    const std::pair<std::pair<const TensorView*, const TensorView*>, const TensorView*> mats[] = {
        {{&R.wqkv, &R.wqkv_scale}, &D.wqkv},
        {{&R.wo, &R.wo_scale}, &D.wo},
        {{&R.w_gate_up, &R.w_gate_up_scale}, &D.w_gate_up},
        {{&R.w_down, &R.w_down_scale}, &D.w_down}};
    for (const auto& [codes, want] : mats) {
      Tensor got = Tensor::empty(want->shape, DType::BF16, Device::CUDA);
      dequantize_fp8_weight(got, *codes.first, *codes.second);
      const std::vector<float> a = to_f32_vector(got), b = to_f32_vector(*want);
      EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)))
          << "layer " << l << " " << want->describe();
    }
  }
}

TEST(Fp8Engine16Gpu, WithoutTheFusedPathResidentLogitsAreTheSameBits) {
  TVLLM_REQUIRE_GPU();
  Generator resident(models().resident, limits(models().resident));
  Generator dequantized(models().dequantized, limits(models().dequantized));
  for (const ReferenceGeneration& g : refs().gens.sequences) {
    const Tensor a = resident.forced_logits(g.prompt_ids, g.output_ids);
    const Tensor b = dequantized.forced_logits(g.prompt_ids, g.output_ids);
    ASSERT_EQ(a.view().nbytes(), b.view().nbytes());
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.view().nbytes())) << g.name;
  }
}

TEST(Fp8Engine16Gpu, FusedResidentLogitsAreWithinTheGpuBound) {
  TVLLM_REQUIRE_GPU();
  Generator resident(models().resident, limits(models().resident));
  Generator dequantized(models().dequantized, limits(models().dequantized));
  use_fast_path(resident);
  use_fast_path(dequantized);
  for (const ReferenceGeneration& g : refs().gens.sequences) {
    const double e = refs().eps(g);
    const Tensor a = resident.forced_logits(g.prompt_ids, g.output_ids);
    const Tensor b = dequantized.forced_logits(g.prompt_ids, g.output_ids);
    const Top1Agreement t = top1_agreement(a.view(), b.view(), 2 * e);
    EXPECT_TRUE(t.pass()) << g.name << ": " << t.summary();
    EXPECT_LE(t.max_abs_error, 2 * e) << g.name << ": " << t.summary();
    EXPECT_GT(t.max_abs_error, 0.0) << g.name << ": the decode steps did not read the codes";
  }
}

TEST(Fp8Engine16Gpu, GreedyIdsEqualTheDequantizedEngineUpToANearTie) {
  TVLLM_REQUIRE_GPU();
  Generator resident(models().resident, limits(models().resident));
  Generator dequantized(models().dequantized, limits(models().dequantized));
  Generator probe(models().dequantized, limits(models().dequantized));  // margins of the dequantized run
  use_fast_path(resident);
  use_fast_path(dequantized);
  GenerateOptions opt;
  opt.max_new_tokens = 48;
  opt.ignore_eos = true;
  int64_t compared = 0;
  for (const ReferenceGeneration& g : refs().gens.sequences) {
    const double e = refs().eps(g);
    const std::vector<int32_t> want = dequantized.generate(g.prompt_ids, opt).ids;
    const std::vector<int32_t> got = resident.generate(g.prompt_ids, opt).ids;
    // The first step whose top-1 margin (dequantized engine, teacher-forced on its own ids) is within 2e.
    const Tensor logits = probe.forced_logits(g.prompt_ids, want);
    const ForcedAgreement f = forced_agreement(logits.view(), want, e);
    ASSERT_TRUE(f.pass()) << g.name << ": " << f.summary();
    const int64_t V = logits.view().shape[1];
    const int64_t clear = testing::rows_before_near_tie(logits.view().ptr<const float>(),
                                                        static_cast<int64_t>(want.size()), V, 2 * e);
    const std::vector<int32_t> a(got.begin(), got.begin() + clear), b(want.begin(), want.begin() + clear);
    EXPECT_EQ(a, b) << g.name << ": first difference at " << first_difference(got, want) << ", clear up to "
                    << clear;
    // Past the first near-tie the two runs may follow different texts; every id the resident engine chose must
    // still be the dequantized model's top-1 within 2e on the resident's own text (teacher-forced).
    const Tensor on_got = probe.forced_logits(g.prompt_ids, got);
    const ForcedAgreement r = forced_agreement(on_got.view(), got, 2 * e);
    EXPECT_TRUE(r.pass()) << g.name << ": " << r.summary();
    compared += static_cast<int64_t>(got.size());
  }
  // (The bundled model's texts have near-ties early: on the H200 only 7 steps came before the first one. The
  // teacher-forced check above covers every step.)
  EXPECT_GE(compared, 48);
}

// Lesson 11's engine with the fast path on resident weights: decode batches of up to 16 sequences take the fused
// FP8 GEMVs (fast_forward_max_tokens), larger steps the composed forward through the dequantizing scratch, both
// under CUDA graphs. Every request against the readable Generator alone on the same weights (whose composed
// forward is the dequantized model's, bit for bit): lesson 11's rule, equal ids or a teacher-forced near-tie.
TEST(Fp8Engine16Gpu, TheEngineOnResidentWeightsAgreesWithEachRequestAlone) {
  TVLLM_REQUIRE_GPU();
  const ModelWeights& w = models().resident;
  const auto requests = make_check_requests(24, 2, 150, 1, 60, workload_id_high(w.config), 23, 0, {13});
  const AloneResults alone = run_alone(w, requests, 512);
  for (const bool paged : {false, true}) {
    Engine engine(w, testing::engine_config(64, 16, 512), paged ? paged_kv() : contiguous_kv());
    use_fast_path(engine);
    const EngineRunResult run = run_requests(engine, requests);
    EXPECT_TRUE(run.events_ok) << run.events_error;
    const AloneCheck check = check_against_alone(w, requests, run, alone, 512);
    EXPECT_TRUE(check.pass()) << (paged ? "paged: " : "contiguous: ") << check.summary();
    EXPECT_EQ(engine.stats().kv.used_blocks(), 0);
    auto* runner = dynamic_cast<const GraphRunner*>(engine.context().launcher());
    ASSERT_NE(runner, nullptr);
    EXPECT_GT(runner->stats().replays, 0);
  }
}

// The dequantizer kernel on its own: 4 codes per thread (K % 4 == 0) and one (K = 13), per-row and one scale,
// against its CPU loop bit for bit. Codes: every one of the 256 but the two NaNs, in turn.
TEST(Fp8Engine16Gpu, TheDequantizerKernelEqualsItsCpuLoop) {
  TVLLM_REQUIRE_GPU();
  for (const auto& [R, K] : {std::pair<int64_t, int64_t>{7, 64}, {5, 13}, {1, 600}}) {
    SCOPED_TRACE(std::to_string(R) + "x" + std::to_string(K));
    std::vector<uint8_t> codes(static_cast<size_t>(R * K));
    for (size_t i = 0; i < codes.size(); ++i) {
      const auto c = static_cast<uint8_t>(i % 254);
      codes[i] = c >= 0x7f ? static_cast<uint8_t>(c + 1) : c;  // skip 0x7f; 0xff is never reached
    }
    std::vector<float> scales(static_cast<size_t>(R));
    for (int64_t r = 0; r < R; ++r) scales[r] = bf16_to_f32(f32_to_bf16(0.0123f * static_cast<float>(r + 1)));
    for (const bool per_row : {true, false}) {
      Tensor q_cpu = Tensor::empty({R, K}, DType::F8_E4M3, Device::CPU);
      std::memcpy(q_cpu.data(), codes.data(), codes.size());
      const Tensor q_gpu = Tensor::copy_of(q_cpu.view(), Device::CUDA);
      const std::vector<float> s(scales.begin(), scales.begin() + (per_row ? R : 1));
      const Tensor s_cpu = Tensor::from_f32(s, {static_cast<int64_t>(s.size())}, DType::F32, Device::CPU);
      const Tensor s_gpu = Tensor::copy_of(s_cpu.view(), Device::CUDA);
      Tensor want = Tensor::empty({R, K}, DType::BF16, Device::CPU);
      Tensor got = Tensor::empty({R, K}, DType::BF16, Device::CUDA);
      dequantize_fp8_weight(want, q_cpu, s_cpu);
      dequantize_fp8_weight(got, q_gpu, s_gpu);
      TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
      const Tensor back = Tensor::copy_of(got.view(), Device::CPU);
      EXPECT_EQ(0, std::memcmp(back.data(), want.data(), want.view().nbytes())) << (per_row ? "per row" : "one scale");
    }
  }
}

}  // namespace
}  // namespace tvllm
