// Lesson 10 on the GPU: the KV-write kernel, the decode kernel (head_dim 64/80/128, GQA groups 1/4/8, contexts
// 1 to 5000 in one batch, forced and automatic splits), lesson 07's flash kernel over the cache (prefill and
// chunks), a cache too large for the GPU, generation on the bundled model (teacher-forced against
// Hugging Face, cache vs recompute, a 1000-token prompt against the CPU) and the engine-ready-base test: ONE real
// decode step captured in a CUDA graph, replayed bit for bit, and replayed at the next position after the
// step's inputs were updated in place.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "cached_attention.h"
#include "common/cuda_stream.h"
#include "common/errors.h"
#include "common/random.h"
#include "common/validate.h"
#include "generate.h"
#include "generate_check.h"
#include "kv_cache.h"
#include "logits_check.h"
#include "model_dir.h"
#include "testing/attention_check.h"
#include "testing/testing.h"
#include "transformer.h"

namespace tvllm {
namespace {

// The tolerances (decode: the output's bf16 rounding; flash: P rounded to bf16 too) and the mismatch report:
// testing/attention_check.h.
using testing::describe;
using testing::flash_tol;
using testing::kDecodeTol;
using testing::round_to_bf16;

// One layer of cache on each side, holding the same (bf16-rounded) random keys and values.
struct Caches {
  KvCache cpu, gpu;
  double max_v = 0.0;
  Caches(const AttentionShape& s, int64_t slots, int64_t context, uint64_t seed)
      : cpu(s, 1, slots, context, Device::CPU), gpu(s, 1, slots, context, Device::CUDA) {
    const auto n = static_cast<size_t>(slots * context * s.kv_dim());
    const std::vector<float> k = round_to_bf16(random_normal(n, seed));
    const std::vector<float> v = round_to_bf16(random_uniform(n, seed + 1));
    for (float x : v) max_v = std::max(max_v, static_cast<double>(std::fabs(x)));
    std::copy(k.begin(), k.end(), cpu.k(0).ptr<float>());
    std::copy(v.begin(), v.end(), cpu.v(0).ptr<float>());
    const Shape shape = cpu.k(0).shape;
    copy_view(gpu.k(0), Tensor::from_f32(k, shape, DType::BF16, Device::CUDA).view());
    copy_view(gpu.v(0), Tensor::from_f32(v, shape, DType::BF16, Device::CUDA).view());
  }
};

struct Attended {
  std::vector<float> gpu, cpu;
};

// The same attention on both devices: q random (bf16-rounded), GPU output poisoned with NaN first.
// splits: 0 = cached_attention's own choice (decode_splits or flash), n > 0 = decode_attention with n splits.
Attended attend_both(Caches& c, const AttentionShape& s, const std::vector<int64_t>& q_lens,
                     const std::vector<int64_t>& k_lens, const std::vector<int32_t>& slots, int splits, uint64_t seed,
                     cudaStream_t stream = nullptr) {
  int64_t Tq = 0;
  for (int64_t n : q_lens) Tq += n;
  const std::vector<float> q = round_to_bf16(random_normal(static_cast<size_t>(Tq * s.q_dim()), seed, 2.f));
  const auto B = static_cast<int64_t>(q_lens.size());
  Attended r;
  for (Device d : {Device::CPU, Device::CUDA}) {
    const bool gpu = d == Device::CUDA;
    const KvCache& cache = gpu ? c.gpu : c.cpu;
    AttentionBatch batch(B, d);
    batch.set_lengths(q_lens, k_lens, stream);
    CacheSlots cs(B, cache.num_slots(), d);
    cs.set(slots, stream);
    DecodeWorkspace ws(s, B, d);
    const Tensor qt = Tensor::from_f32(q, {Tq, s.q_dim()}, gpu ? DType::BF16 : DType::F32, d);
    Tensor out = Tensor::from_f32(std::vector<float>(q.size(), NAN), {Tq, s.q_dim()}, gpu ? DType::BF16 : DType::F32, d);
    if (gpu) TVLLM_CUDA_CHECK(cudaDeviceSynchronize());  // set-up copies ran on the legacy stream
    if (splits > 0) decode_attention(out, qt, cache.k(0), cache.v(0), batch, cs, s, splits, &ws, stream);
    else cached_attention(out, qt, cache.k(0), cache.v(0), batch, cs, s, &ws, stream);
    if (gpu) TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
    (gpu ? r.gpu : r.cpu) = to_f32_vector(out);
  }
  return r;
}

void expect_close(const Attended& r, const AttentionShape& s, const Tolerance& tol, const std::string& name) {
  const CompareResult c = compare(name, r.gpu, r.cpu, tol);
  EXPECT_TRUE(c.pass()) << describe(c, s);
}

// ---- the kernels -----------------------------------------------------------------------------------------

TEST(KvCacheGpu, WriteMatchesCpu) {
  TVLLM_REQUIRE_GPU();
  // k, v: column views of a fused [T, q | k | v] buffer. The cache starts as NaN on both sides: every position
  // the step does not write must still be NaN, every one it writes must hold the row bit for bit.
  for (const AttentionShape& s : {AttentionShape{6, 2, 64}, AttentionShape{32, 16, 128}}) {
    const std::vector<int64_t> q_lens{2, 1, 0, 5}, k_lens{9, 1, 3, 5};
    const std::vector<int32_t> slots{3, 0, 1, 2};
    const int64_t C = 12, T = 8, W = s.qkv_dim();
    KvCache cpu(s, 1, 4, C, Device::CPU), gpu(s, 1, 4, C, Device::CUDA);
    const std::vector<float> nan(cpu.bytes() / 4 / 2, NAN);
    std::copy(nan.begin(), nan.end(), cpu.k(0).ptr<float>());
    std::copy(nan.begin(), nan.end(), cpu.v(0).ptr<float>());
    copy_view(gpu.k(0), Tensor::from_f32(nan, cpu.k(0).shape, DType::BF16, Device::CUDA).view());
    copy_view(gpu.v(0), Tensor::from_f32(nan, cpu.k(0).shape, DType::BF16, Device::CUDA).view());
    const std::vector<float> qkv = round_to_bf16(random_normal(static_cast<size_t>(T * W), 11));
    for (Device d : {Device::CPU, Device::CUDA}) {
      KvCache& cache = d == Device::CUDA ? gpu : cpu;
      const Tensor fused = Tensor::from_f32(qkv, {T, W}, d == Device::CUDA ? DType::BF16 : DType::F32, d);
      const QkvViews v = split_qkv(fused.view(), s);
      AttentionBatch batch(4, d);
      batch.set_lengths(q_lens, k_lens);
      CacheSlots cs(4, 4, d);
      cs.set(slots);
      if (d == Device::CUDA) TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
      kv_cache_write(cache.k(0), cache.v(0), v.k, v.v, batch, cs, s);
      if (d == Device::CUDA) TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
    }
    for (int which = 0; which < 2; ++which) {
      const TensorView a = which ? gpu.v(0) : gpu.k(0), b = which ? cpu.v(0) : cpu.k(0);
      const CompareResult r = compare(which ? "v cache" : "k cache", a, b, Tolerance{0, 0});
      EXPECT_TRUE(r.pass()) << "kv_dim " << s.kv_dim() << " " << r.name << ": bad " << r.bad << " of " << r.count;
    }
  }
}

TEST(KvCacheGpu, DecodeMatchesCpuForHeadDimsGroupsAndContexts) {
  TVLLM_REQUIRE_GPU();
  // One batch of sequences of very different lengths (1 key, a partial tile, 1000, 5000), in shuffled slots,
  // with a sequence that brings no query at all (q_len 0: nothing to compute or write).
  const std::vector<int64_t> q_lens{1, 1, 1, 0, 1}, k_lens{1, 17, 1000, 3, 5000};
  const std::vector<int32_t> slots{4, 0, 2, 1, 3};
  for (int64_t D : {64, 80, 128}) {
    for (int64_t group : {1, 4, 8}) {
      const AttentionShape s{2 * group, 2, D};
      Caches c(s, 5, 5000, 100 + D + group);
      for (int splits : {0, 1, 7, 64}) {  // 0: decode_splits() for this GPU
        const Attended r = attend_both(c, s, q_lens, k_lens, slots, splits, 7 + D);
        expect_close(r, s, kDecodeTol,
                     "decode D " + std::to_string(D) + " group " + std::to_string(group) + " splits " + std::to_string(splits));
      }
    }
  }
}

TEST(KvCacheGpu, DecodeOfOneLongSequenceSplitsAcrossTheGpu) {
  TVLLM_REQUIRE_GPU();
  // Llama 3.2 1B's heads: one sequence of 4096 keys must run as many blocks (flash-decoding), and stay right.
  const AttentionShape s{32, 8, 64};
  EXPECT_GE(decode_splits(s, 1, 4096, query_device().multiprocessors), 16);
  Caches c(s, 1, 4096, 3);
  expect_close(attend_both(c, s, {1}, {4096}, {0}, 0, 5), s, kDecodeTol, "1B-shaped, 4096 keys");
  const AttentionShape odd{24, 8, 128};  // Llama 3.2 3B: a group of 3 runs in blocks of 4 heads
  Caches c3(odd, 2, 700, 4);
  expect_close(attend_both(c3, odd, {1, 1}, {700, 64}, {1, 0}, 0, 6), odd, kDecodeTol, "3B-shaped");
  const AttentionShape wide{16, 1, 256};  // group of 16: two blocks of 8 heads; head_dim 256
  Caches cw(wide, 1, 300, 5);
  expect_close(attend_both(cw, wide, {1}, {300}, {0}, 3, 7), wide, kDecodeTol, "group 16, head_dim 256");
}

TEST(KvCacheGpu, FlashOverTheCacheMatchesCpu) {
  TVLLM_REQUIRE_GPU();
  // Prefill (q_len == k_len) and chunks after earlier keys (q_len < k_len), one of them a single query in a
  // batch that is not all decode: lesson 07's flash kernel with the CacheKV policy.
  const std::vector<int64_t> q_lens{77, 1, 200, 5}, k_lens{77, 300, 1000, 5};
  const std::vector<int32_t> slots{2, 3, 0, 1};
  for (int64_t D : {64, 80, 128}) {
    for (int64_t group : {1, 4}) {
      const AttentionShape s{2 * group, 2, D};
      Caches c(s, 4, 1000, 50 + D);
      const Attended r = attend_both(c, s, q_lens, k_lens, slots, 0, 9);
      expect_close(r, s, flash_tol(c.max_v), "flash over cache D " + std::to_string(D) + " group " + std::to_string(group));
    }
  }
}

TEST(KvCacheGpu, OpsRunOnTheCallersStream) {
  TVLLM_REQUIRE_GPU();
  CudaStream stream;
  const AttentionShape s{8, 2, 64};
  Caches c(s, 2, 600, 8);
  expect_close(attend_both(c, s, {1, 1}, {600, 33}, {1, 0}, 0, 3, stream), s, kDecodeTol, "decode on a stream");
  expect_close(attend_both(c, s, {40, 3}, {600, 33}, {1, 0}, 0, 4, stream), s, flash_tol(c.max_v), "flash on a stream");
}

TEST(KvCacheGpu, CacheLargerThanTheGpuIsAnInputError) {
  TVLLM_REQUIRE_GPU();
  try {
    KvCache too_big(AttentionShape{32, 8, 128}, 1000, 1000, 131072, Device::CUDA);  // ~490 TiB
    ADD_FAILURE() << "a cache of " << too_big.bytes() << " bytes was allocated";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("does not fit in the GPU's free memory"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("GiB"), std::string::npos) << e.what();
  }
}

// ---- generation on the bundled model ---------------------------------------------------------------------

struct BundledGpu {
  ModelDir model = ModelDir::open(testing::tiny_model_dir());
  ReferenceSet ref = ReferenceSet::open(testing::tiny_model_dir());
  ModelWeights w = ModelWeights::bind(model, Device::CUDA);
  ReferenceGenerations gens = read_reference_generations(testing::tiny_model_dir());
  GenerateOptions options() const {
    GenerateOptions o;
    o.max_new_tokens = gens.max_new_tokens;
    o.eos_ids = gens.eos_ids;
    return o;
  }
  std::map<std::string, Bf16Floor> floors = read_bf16_floors(testing::tiny_model_dir());
  // Lesson 08's bound on a bf16 logit's error: max(0.2 x rms of the prompt's logits, 1.5 x Hugging Face's own
  // bf16 error over the sequence's rows).
  double error(const ReferenceGeneration& g) const {
    const double r = rms(Tensor::copy_of(ref.get(g.prompt + ".logits"), Device::CPU, DType::F32));
    return gpu_logit_bound(r, find_floor(floors, g.name)).epsilon;
  }
};

TEST(KvCacheGpu, GenerationAgreesWithHuggingFaceTeacherForced) {
  TVLLM_REQUIRE_GPU();
  const BundledGpu m;
  Generator gen(m.w, Generator::limits_for(m.w.config, 256, 1, 64));  // prompts over 64 tokens: chunked prefill
  for (const ReferenceGeneration& g : m.gens.sequences) {
    const double e = m.error(g);
    // Teacher-forced through the cache: a disagreement only where the reference itself was a near-tie.
    const Tensor forced = gen.forced_logits(g.prompt_ids, g.output_ids);
    const ForcedAgreement a = forced_agreement(forced, g.output_ids, e);
    EXPECT_TRUE(a.pass()) << g.name << ": " << a.summary();
    // The cache vs ONE prefill over prompt + ids without one: two bf16 runs, each within e of the exact logits.
    std::vector<int32_t> tokens = g.prompt_ids;
    tokens.insert(tokens.end(), g.output_ids.begin(), g.output_ids.end() - 1);
    const auto T = static_cast<int64_t>(tokens.size()), P = static_cast<int64_t>(g.prompt_ids.size());
    const EngineLimits limits{T, 1, T, 256};
    ExecContext ctx(m.w.config, limits, Device::CUDA);
    StepInputs step(m.w.config, limits, Device::CUDA);
    PrefillAttention no_cache(m.w.config, limits, Device::CUDA, AttentionKernel::V2Flash, ctx.cublas());
    step.set_prompts({tokens}, true, ctx.stream());
    const TensorView all = forward(ctx, m.w, step, no_cache);
    ctx.synchronize();
    const Tensor recomputed = Tensor::copy_of(all.rows(P - 1, T - P + 1), Device::CPU, DType::F32);
    const Top1Agreement t = top1_agreement(forced, recomputed, 2 * e);
    EXPECT_TRUE(t.pass()) << g.name << " cache vs recompute: " << t.summary();
    EXPECT_LE(t.max_abs_error, 2 * e) << g.name << " cache vs recompute: " << t.summary();
    // Free-running greedy: equal to Hugging Face wherever every step's margin is clear.
    const GenerateResult r = gen.generate(g.prompt_ids, m.options());
    if (g.min_top1_margin > 2 * e) {
      EXPECT_EQ(r.ids, g.output_ids) << g.name;
    } else {
      std::printf("%s: min margin %.3f <= %.3f (near-ties may flip): first difference at %lld\n", g.name.c_str(),
                  g.min_top1_margin, 2 * e, static_cast<long long>(first_difference(r.ids, g.output_ids)));
    }
  }
}

TEST(KvCacheGpu, GenerationOfALongPromptAgreesWithTheCpu) {
  // A 1000-token prompt (random ids), prefilled in chunks of 256 through the cache, then 8 greedy ids: the GPU's
  // logits at each step, teacher-forced with the CPU's ids, must pick them or be near-ties.
  TVLLM_REQUIRE_GPU();
  const BundledGpu m;
  const ModelWeights cpu_w = ModelWeights::bind(m.model, Device::CPU);
  Rng rng(3);
  std::vector<int32_t> prompt(1000);
  for (int32_t& id : prompt) id = static_cast<int32_t>(rng.below(m.w.config.vocab_size));
  GenerateOptions o;
  o.max_new_tokens = 8;
  o.ignore_eos = true;
  Generator cpu_gen(cpu_w, Generator::limits_for(cpu_w.config, 1024, 1, 256));
  const GenerateResult want = cpu_gen.generate(prompt, o);
  ASSERT_EQ(want.ids.size(), 8u);
  const Tensor cpu_logits = cpu_gen.forced_logits(prompt, want.ids);
  Generator gpu_gen(m.w, Generator::limits_for(m.w.config, 1024, 1, 256));
  const Tensor gpu_logits = gpu_gen.forced_logits(prompt, want.ids);
  const double e = kGpuLogitErrorPerRms * rms(cpu_logits);
  const ForcedAgreement a = forced_agreement(gpu_logits, want.ids, e);
  EXPECT_TRUE(a.pass()) << a.summary();
  EXPECT_EQ(gpu_gen.generate(prompt, o).ids.size(), 8u);
}

// ---- the engine-ready base: one decode step in a CUDA graph -----------------------------------------------

struct HostStep {
  std::vector<float> logits;  // [B, vocab]
  std::vector<int32_t> ids;   // [B]
};

HostStep read_step(Generator& gen, const TensorView& logits, int64_t B) {
  gen.context().synchronize();
  HostStep s{to_f32_vector(logits.rows(0, B)), gen.fetch_ids(B)};
  return s;
}

TEST(KvCacheGpu, GraphOfADecodeStepReplaysTheEagerStep) {
  // Embedding -> every layer with CachedAttention (KV write + decode kernel) -> final norm -> lm_head -> greedy
  // choice (lesson 09's sampler at temperature 0), for a batch of two sequences of different lengths, captured ONCE with cudaStreamCaptureModeGlobal
  // (any allocation or synchronisation inside would fail the capture). Replayed: the same bits as the eager
  // step. Then the step's inputs are refilled in place for the next position (new token, k_len + 1) and the
  // SAME graph replays that step, again bit for bit with its eager run.
  TVLLM_REQUIRE_GPU();
  const BundledGpu m;
  const std::vector<int32_t>& p0 = m.gens.sequences[0].prompt_ids;
  const std::vector<int32_t>& p1 = m.gens.sequences.back().prompt_ids;
  const auto L0 = static_cast<int64_t>(p0.size()), L1 = static_cast<int64_t>(p1.size());
  Generator gen(m.w, Generator::limits_for(m.w.config, 256, 2));
  const cudaStream_t stream = gen.context().stream();
  // A graph keeps its launch shapes, the decode split count among them; decode_splits() may pick another count
  // when a context crosses a multiple of kMinKeysPerSplit, and the eager step would then sum in another order.
  // So every decode step here (generate's too) uses the same 3 splits (lesson 14's graph runner pins the count
  // per context bucket, a power of two, through AttentionBackend::pin_decode_splits).
  gen.attention().force_decode_splits(3);
  // What plain generation produces for these two prompts: the ids the steps below must reproduce.
  const std::vector<GenerateResult> greedy = gen.generate({p0, p1}, [] {
    GenerateOptions o;
    o.max_new_tokens = 3;
    o.ignore_eos = true;
    return o;
  }());

  // Prefill both (slots 0 and 1), eagerly.
  std::vector<int32_t> ids = p0;
  ids.insert(ids.end(), p1.begin(), p1.end());
  gen.set_step(ids, {L0, L1}, {L0, L1}, {static_cast<int32_t>(L0 - 1), static_cast<int32_t>(L0 + L1 - 1)}, {0, 1});
  gen.sample_async(gen.forward_step(), 0);
  const std::vector<int32_t> first = gen.fetch_ids(2);
  EXPECT_EQ(first, (std::vector<int32_t>{greedy[0].ids[0], greedy[1].ids[0]}));

  // Decode step 1, eagerly.
  gen.set_step(first, {1, 1}, {L0 + 1, L1 + 1}, {0, 1}, {0, 1});
  const TensorView logits = gen.forward_step();
  gen.sample_async(logits, 0);
  const HostStep eager1 = read_step(gen, logits, 2);
  EXPECT_EQ(eager1.ids, (std::vector<int32_t>{greedy[0].ids[1], greedy[1].ids[1]}));

  // The same step, captured (nothing runs during a capture) and replayed over poisoned outputs.
  const CudaGraph graph = CudaGraph::capture(stream, [&] { gen.sample_async(gen.forward_step(), 0); });
  EXPECT_GT(graph.num_nodes(), 10u);
  TVLLM_CUDA_CHECK(cudaMemsetAsync(logits.data, 0xFF, static_cast<size_t>(logits.rows(0, 2).nbytes()), stream));
  TVLLM_CUDA_CHECK(cudaMemsetAsync(gen.device_ids().data, 0xFF, gen.device_ids().nbytes(), stream));
  graph.launch(stream);
  const HostStep replay1 = read_step(gen, logits, 2);
  EXPECT_EQ(replay1.ids, eager1.ids);
  EXPECT_TRUE(compare("replay == eager, step 1", replay1.logits, eager1.logits, Tolerance{0, 0}).pass());

  // Step 2: new inputs in the same device buffers (outside any capture), the graph replayed first...
  gen.set_step(eager1.ids, {1, 1}, {L0 + 2, L1 + 2}, {0, 1}, {0, 1});
  graph.launch(stream);
  const HostStep replay2 = read_step(gen, logits, 2);
  // ...then the same step eagerly (it rewrites the same cache positions with the same values).
  gen.sample_async(gen.forward_step(), 0);
  const HostStep eager2 = read_step(gen, logits, 2);
  EXPECT_EQ(eager2.ids, (std::vector<int32_t>{greedy[0].ids[2], greedy[1].ids[2]}));
  EXPECT_EQ(replay2.ids, eager2.ids);
  EXPECT_TRUE(compare("replay == eager, step 2", replay2.logits, eager2.logits, Tolerance{0, 0}).pass());
  EXPECT_FALSE(compare("step 2 != step 1", replay2.logits, replay1.logits, Tolerance{0, 0}).pass())
      << "the replay did not see the new step's inputs";
}

}  // namespace
}  // namespace tvllm
