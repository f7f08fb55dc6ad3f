// lesson14_performance: the fast path checked against the readable one, and timed against the roofline.
//
//   build/bin/lesson14_performance [--model DIR] [--device auto|cpu|cuda] [--kernel v1|v2|v3] [--bench]
//
//   1. the GEMVs on the model's own weight matrices (every distinct [N, K], M = 1, 5 and 16 rows):
//        cuda  --kernel's version and the three fused kernels vs their fp32 CPU references (gemv_cpu.cpp)
//        cpu   the references themselves: rmsnorm_gemv_cpu vs lesson 04's rmsnorm + lesson 06's linear, and
//              gemv_cpu vs linear on every decode matrix, each within a bound derived per output
//   2. (cuda) the fast path against lesson 10's readable loop on the reference sequences:
//        greedy == Hugging Face generate (where the reference margins are clear, lesson 10's rule)
//        teacher-forced top-1 through the fast path (lesson 10's forced_agreement)
//        fast == readable: the teacher-forced logits of both within 2 eps of each other, same argmax
//        graphs == --enforce-eager: every reference sequence, id for id (sampled, so the sampler runs too)
//        PDL on == off: the teacher-forced logits, bit for bit (the same kernels, launched differently)
//   3. (cuda) FastSampler == lesson 09's CPU oracle, id for id, on rows of random logits at the model's vocab
//   4. (cuda) the fast decode attention vs lesson 10's CPU reference and lesson 10's kernel, the model's heads
//   5. --bench (cuda): each GEMV version and cuBLAS per shape (GB/s against the copy bandwidth); the step's
//      GEMVs alone, chained and replayed as a graph, with and without programmatic dependent launch; the
//      timeline of one eager decode step (a CUDA event after each op: where the step's time goes); FastSampler
//      (cluster path and multi-pass path) vs lesson 09's sampler at batch 1 and 64; decode attention, lesson
//      10's kernel and lesson 14's over the paged pool and the contiguous cache; the decode progression (lesson
//      10 -> graphs -> fused -> fast sampler -> programmatic dependent launch -> fast decode attention) at batch
//      1 and 8, contexts 128 and 4096.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "common/bench.h"
#include "common/cublas.h"
#include "common/cuda_stream.h"
#include "common/dtype.h"
#include "common/errors.h"
#include "common/lesson.h"
#include "common/random.h"
#include "common/validate.h"
#include "decode_attention_fast.h"
#include "fast_forward.h"
#include "fast_path.h"
#include "fast_sampler.h"
#include "gemv.h"
#include "generate.h"
#include "generate_check.h"
#include "kv_cache.h"
#include "latency_bench.h"
#include "megakernel.h"
#include "logits_check.h"
#include "matmul.h"
#include "model_dir.h"
#include "paged_kv.h"
#include "pdl.h"
#include "rmsnorm.h"
#include "silu_mul.h"

namespace tvllm {
namespace {

std::string fmt(const char* format, double value) {
  char text[64];
  std::snprintf(text, sizeof text, format, value);
  return text;
}

float to_bf16_value(float f) { return bf16_to_f32(f32_to_bf16(f)); }

// Random bf16-exact values, normal with spread `scale`, as a host F32 tensor (so CPU and GPU see equal inputs).
Tensor random_rows(int64_t rows, int64_t cols, double scale, uint64_t seed) {
  Tensor t = Tensor::empty({rows, cols}, DType::F32, Device::CPU);
  Rng rng(seed);
  float* p = t.view().ptr<float>();
  for (int64_t i = 0; i < rows * cols; ++i) p[i] = to_bf16_value(static_cast<float>(rng.normal() * scale));
  return t;
}
Tensor on(const Tensor& t, Device d, DType dtype) { return Tensor::copy_of(t.view(), d, dtype); }

// The distinct weight matrices of a decode step: name, [N, K] view on the weights' device.
std::vector<std::pair<std::string, TensorView>> decode_matrices(const ModelWeights& w) {
  const LayerWeights& L = w.layers.front();
  if (w.device == Device::CUDA)
    return {{"qkv", L.wqkv}, {"o", L.wo}, {"gate|up", L.w_gate_up}, {"down", L.w_down}, {"lm_head", w.lm_head}};
  return {{"q", L.wq}, {"o", L.wo}, {"gate", L.w_gate}, {"down", L.w_down}, {"lm_head", w.lm_head}};
}

// GPU vs the fp32 CPU reference of the same bf16 inputs: the GPU rounds its fp32 sum to bf16 once (half an ulp,
// 2^-9 relative) and adds in another order than the reference's double sum (each fp32 addition off by at most
// 2^-24 of the running sum: with K <= 2^14 terms far below 2^-10 of the largest output). Two ulps of bf16
// relative plus 2^-10 of the largest |output| covers both with margin; a wrong column or row is off by O(1).
Tolerance gemv_tolerance(const Tensor& reference) {
  double m = 0.0;
  const TensorView v = reference.view();
  for (int64_t i = 0; i < v.numel(); ++i) m = std::max(m, std::fabs(static_cast<double>(v.ptr<const float>()[i])));
  return Tolerance{std::ldexp(m, -10), std::ldexp(1.0, -7)};
}

// ---- 1. the GEMVs on the model's matrices --------------------------------------------------------------

void check_gemvs_cuda(Report& report, const ModelWeights& w, GemvKernel kernel) {
  const float eps = static_cast<float>(w.config.rms_norm_eps);
  const LayerWeights& L = w.layers.front();
  const Tensor gamma = Tensor::copy_of(L.input_norm, Device::CPU, DType::F32);
  for (const auto& [name, weight] : decode_matrices(w)) {
    const int64_t N = weight.shape[0], K = weight.shape[1];
    const Tensor w_host = Tensor::copy_of(weight, Device::CPU, DType::F32);
    const DType out_dtype = name == "lm_head" ? DType::F32 : DType::BF16;
    for (int64_t M : {int64_t{1}, int64_t{5}, int64_t{16}}) {
      if (name == "lm_head" && M > 1 && N * K > (int64_t{1} << 26)) continue;  // a 1B lm_head: M = 1 is enough
      const Tensor x = random_rows(M, K, 1.0, 100 + M);
      const Tensor x_dev = on(x, Device::CUDA, DType::BF16);
      Tensor out = Tensor::empty({M, N}, out_dtype, Device::CUDA), ref = Tensor::empty({M, N}, DType::F32, Device::CPU);
      gemv(out.view(), x_dev.view(), weight, kernel);
      gemv_cpu(ref.view(), x.view(), w_host.view());
      report.add(compare(name + " gemv " + std::string(gemv_kernel_name(kernel)) + " M=" + std::to_string(M),
                         Tensor::copy_of(out.view(), Device::CPU, DType::F32).view(), ref.view(), gemv_tolerance(ref)));
      if (name == "lm_head") continue;
      // The fused kernels on the same inputs, x taken as the residual stream h.
      if (name == "qkv") {
        rmsnorm_gemv(out.view(), x_dev.view(), L.input_norm, eps, weight);
        rmsnorm_gemv_cpu(ref.view(), x.view(), gamma.view(), eps, w_host.view());
        report.add(compare(name + " rmsnorm_gemv M=" + std::to_string(M),
                           Tensor::copy_of(out.view(), Device::CPU, DType::F32).view(), ref.view(), gemv_tolerance(ref)));
      } else if (name == "gate|up") {
        const int64_t I = N / 2;
        Tensor act = Tensor::empty({M, I}, DType::BF16, Device::CUDA), act_ref = Tensor::empty({M, I}, DType::F32, Device::CPU);
        rmsnorm_gemv_silu_mul(act.view(), x_dev.view(), L.input_norm, eps, weight);
        rmsnorm_gemv_silu_mul_cpu(act_ref.view(), x.view(), gamma.view(), eps, w_host.view());
        report.add(compare(name + " rmsnorm_gemv_silu_mul M=" + std::to_string(M),
                           Tensor::copy_of(act.view(), Device::CPU, DType::F32).view(), act_ref.view(),
                           gemv_tolerance(act_ref)));
      } else {  // o, down: h += x W^T
        const Tensor h = random_rows(M, N, 1.0, 200 + M);
        Tensor h_dev = on(h, Device::CUDA, DType::BF16), h_ref = on(h, Device::CPU, DType::F32);
        gemv_residual(h_dev.view(), x_dev.view(), weight);
        gemv_residual_cpu(h_ref.view(), x.view(), w_host.view());
        report.add(compare(name + " gemv_residual M=" + std::to_string(M),
                           Tensor::copy_of(h_dev.view(), Device::CPU, DType::F32).view(), h_ref.view(),
                           gemv_tolerance(h_ref)));
      }
    }
  }
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
}

// CPU: each fused reference equals the lessons' own CPU ops composed. The fused references round the normalised
// input to bf16 (then times the gain, rounded again: lesson 04's GPU rule and Hugging Face's), while lesson 04's
// rmsnorm_cpu keeps fp32 throughout, so the two inputs differ by bf16 rounding, at most 2^-8 of each element
// (two roundings of 2^-9). Output n then differs by at most 2^-8 * sum_k |x_k w_nk|: that bound, per element,
// computed here in double. A wrong weight row, gain or eps is off by O(|y|), far outside it.
void check_fused_references_cpu(Report& report, const ModelWeights& w) {
  const float eps = static_cast<float>(w.config.rms_norm_eps);
  const LayerWeights& L = w.layers.front();
  const Tensor gamma = Tensor::copy_of(L.input_norm, Device::CPU, DType::F32);
  const int64_t M = 3, H = w.config.hidden_size;
  const Tensor h = random_rows(M, H, 1.0, 7);
  Tensor normed = Tensor::empty({M, H}, DType::F32, Device::CPU);
  rmsnorm(normed.view(), h.view(), gamma.view(), eps);
  for (const auto& [name, weight] : decode_matrices(w)) {
    if (name != "q" && name != "gate") continue;
    const Tensor w_f32 = Tensor::copy_of(weight, Device::CPU, DType::F32);
    const int64_t N = weight.shape[0];
    Tensor composed = Tensor::empty({M, N}, DType::F32, Device::CPU), fused = Tensor::empty({M, N}, DType::F32, Device::CPU);
    linear(composed.view(), normed.view(), w_f32.view());
    rmsnorm_gemv_cpu(fused.view(), h.view(), gamma.view(), eps, w_f32.view());
    const float* x = normed.view().ptr<const float>();
    const float* wp = w_f32.view().ptr<const float>();
    int64_t bad = 0;
    double worst = 0.0;  // the largest |diff| / bound
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        double abs_sum = 0.0;
        for (int64_t k = 0; k < H; ++k) abs_sum += std::fabs(static_cast<double>(x[m * H + k]) * wp[n * H + k]);
        const double bound = std::ldexp(abs_sum, -8) + 1e-6;
        const double diff = std::fabs(static_cast<double>(fused.view().ptr<const float>()[m * N + n]) -
                                      composed.view().ptr<const float>()[m * N + n]);
        worst = std::max(worst, diff / bound);
        bad += diff > bound;
      }
    const std::string detail = std::to_string(M * N) + " outputs, largest |diff| = " + fmt("%.2f", worst) +
                               " x its bound 2^-8 sum|x w|" + (bad ? ", " + std::to_string(bad) + " over" : "");
    std::printf("rmsnorm_gemv_cpu vs rmsnorm_cpu + linear (%s): %s\n", name.c_str(), detail.c_str());
    report.add_check("cpu: rmsnorm_gemv == rmsnorm + linear (" + name + ")", bad == 0, detail);
  }
  // gemv_cpu (double sums) against lesson 06's linear (fp32 sums) on every decode matrix: the same products in
  // another precision, so within K * 2^-24 * sum|x w| (each fp32 addition rounds by at most 2^-24 of a partial
  // sum no larger than sum|x w|).
  for (const auto& [name, weight] : decode_matrices(w)) {
    const int64_t N = weight.shape[0], K = weight.shape[1];
    const Tensor x = random_rows(2, K, 1.0, 11);
    const Tensor w_f32 = Tensor::copy_of(weight, Device::CPU, DType::F32);
    Tensor a = Tensor::empty({2, N}, DType::F32, Device::CPU), b = Tensor::empty({2, N}, DType::F32, Device::CPU);
    gemv_cpu(a.view(), x.view(), w_f32.view());
    linear(b.view(), x.view(), w_f32.view());
    int64_t bad = 0;
    for (int64_t m = 0; m < 2; ++m)
      for (int64_t n = 0; n < N; ++n) {
        double abs_sum = 0.0;
        for (int64_t k = 0; k < K; ++k)
          abs_sum += std::fabs(static_cast<double>(x.view().ptr<const float>()[m * K + k]) *
                               w_f32.view().ptr<const float>()[n * K + k]);
        const double diff = std::fabs(static_cast<double>(a.view().ptr<const float>()[m * N + n]) -
                                      b.view().ptr<const float>()[m * N + n]);
        bad += diff > static_cast<double>(K) * std::ldexp(abs_sum, -24) + 1e-30;
      }
    report.add_check("cpu: gemv_cpu == linear (" + name + ")", bad == 0,
                     std::to_string(bad) + " of " + std::to_string(2 * N) + " outputs outside K 2^-24 sum|x w|");
  }
}

// ---- 2. the fast path against the readable loop ----------------------------------------------------------

void check_fast_path(Report& report, const std::filesystem::path& dir, const ModelWeights& w) {
  const ModelConfig& c = w.config;
  const ReferenceSet ref = ReferenceSet::open(dir);
  const ReferenceGenerations gens = read_reference_generations(dir);
  const std::map<std::string, Bf16Floor> floors = read_bf16_floors(dir);
  int64_t longest = 0;
  for (const ReferenceGeneration& g : gens.sequences)
    longest = std::max<int64_t>(longest, static_cast<int64_t>(g.prompt_ids.size()) + gens.max_new_tokens);
  const int64_t max_context = std::min(c.max_position_embeddings, longest);
  const EngineLimits limits = Generator::limits_for(c, max_context, 1, max_context);
  Generator readable(w, limits), fast(w, limits), eager(w, limits), no_pdl(w, limits), pdl(w, limits);
  FastPathOptions with_megakernel;  // --megakernel: at batch 1 where it runs (section 14); not the default
  with_megakernel.megakernel = true;
  use_fast_path(fast, with_megakernel);
  FastPathOptions no_graphs = with_megakernel;
  no_graphs.graphs = false;
  use_fast_path(eager, no_graphs);
  // PDL is the fused path's (section 7): compared with the megakernel off on both sides.
  FastPathOptions plain_launches, fused_pdl;
  plain_launches.pdl = false;
  plain_launches.megakernel = fused_pdl.megakernel = false;
  use_fast_path(no_pdl, plain_launches);
  use_fast_path(pdl, fused_pdl);
  const bool mega = fast.context().forward_fn() == &megakernel_forward;
  if (mega) {
    const MegakernelGeometry g = megakernel_geometry(fast.context(), w);
    std::printf("megakernel: %s (%d consumer warps; TVLLM_MEGAKERNEL_PER_WARP=1 selects the experimental "
                "per-warp stages), %d blocks (one per SM), %d stages of %lld KiB, %lld chunks per step, %lld KiB of shared "
                "memory per block\n",
                megakernel_variant_name(g.variant), g.consumer_warps, g.blocks, g.stages,
                (long long)(g.stage_bytes / 1024), (long long)g.chunks, (long long)(g.smem_bytes / 1024));
  } else {
    std::printf("megakernel: not taken (%s)\n", megakernel_declines(w).empty() ? "no sm_90"
                                                                            : megakernel_declines(w).c_str());
  }
  std::printf("fast path: %s\n", describe_fast_path(with_megakernel, Device::CUDA, &c).c_str());
  const auto check = [&](const std::string& name, bool pass, const std::string& detail) {
    std::printf("%-34s %s\n", name.c_str(), detail.c_str());
    report.add_check(name, pass, detail);
  };

  GenerateOptions greedy;
  greedy.max_new_tokens = gens.max_new_tokens;
  greedy.eos_ids = gens.eos_ids;
  for (const ReferenceGeneration& g : gens.sequences) {
    const Tensor prompt_logits = Tensor::copy_of(ref.get(g.prompt + ".logits"), Device::CPU, DType::F32);
    const double e = gpu_logit_bound(rms(prompt_logits), find_floor(floors, g.name)).epsilon;
    const bool clear = g.min_top1_margin > 2 * e;
    // Greedy, free-running, through graphs + fused + the fast sampler.
    const GenerateResult r = fast.generate(g.prompt_ids, greedy);
    const int64_t diff = first_difference(r.ids, g.output_ids);
    check(g.name + " fast greedy == HF generate", diff < 0 || !clear,
                     diff < 0 ? std::to_string(r.ids.size()) + " ids, equal"
                              : "first difference at step " + std::to_string(diff) +
                                    (clear ? "" : " (near-tie margins: not required)"));
    // Teacher-forced through the fused forward (forced_logits runs forward_step: the fused path, eagerly).
    const Tensor forced = fast.forced_logits(g.prompt_ids, g.output_ids);
    const ForcedAgreement a = forced_agreement(forced, g.output_ids, e);
    check(g.name + " fast teacher-forced top-1", a.pass(), a.summary());
    // PDL changes when the GEMVs start, not what they compute: the same bits (section 7).
    const Tensor forced_pdl = pdl.forced_logits(g.prompt_ids, g.output_ids);
    const Tensor forced_plain = no_pdl.forced_logits(g.prompt_ids, g.output_ids);
    const bool same = forced_pdl.view().nbytes() == forced_plain.view().nbytes() &&
                      std::memcmp(forced_pdl.view().data, forced_plain.view().data, forced_pdl.view().nbytes()) == 0;
    check(g.name + " PDL on == off (logits)", same,
          same ? std::string(fast_path_uses_pdl({}, Device::CUDA) ? "bit for bit" : "bit for bit (no PDL here)")
               : "the logits differ");
    // The megakernel (section 14) sums in another order than the fused path: within 2e of it, not the same bits.
    if (mega) {
      const Top1Agreement m = top1_agreement(forced, forced_pdl, 2 * e);
      check(g.name + " megakernel == fused (logits)", m.pass() && m.max_abs_error <= 2 * e,
            m.summary() + " (bound " + fmt("%.4f", 2 * e) + ")");
    }
    // The readable loop's logits on the same ids: both within e of the exact ones, so within 2e of each other.
    const Tensor base = readable.forced_logits(g.prompt_ids, g.output_ids);
    const Top1Agreement t = top1_agreement(forced, base, 2 * e);
    check(g.name + " fast == readable (logits)", t.pass() && t.max_abs_error <= 2 * e,
                     t.summary() + " (bound " + fmt("%.4f", 2 * e) + ")");
    // Graphs change the launches, never the tokens: sampled (the sampler is in the graph too), id for id.
    GenerateOptions sampled = greedy;
    sampled.sampling = SamplingParams{0.8f, 40, 0.95f, 1234};
    sampled.ignore_eos = true;
    const GenerateResult with_graphs = fast.generate(g.prompt_ids, sampled);
    const GenerateResult without = eager.generate(g.prompt_ids, sampled);
    const int64_t d2 = first_difference(with_graphs.ids, without.ids);
    check(g.name + " graphs == --enforce-eager", d2 < 0 && with_graphs.ids.size() == without.ids.size(),
                     d2 < 0 ? std::to_string(with_graphs.ids.size()) + " sampled ids, equal"
                            : "first difference at step " + std::to_string(d2));
  }
}

// ---- 3. the fast sampler ---------------------------------------------------------------------------------

void check_sampler(Report& report, int64_t vocab) {
  const int B = 64;
  for (FastSampler::Path path : {FastSampler::Path::kAuto, FastSampler::Path::kMultiPass}) {
    FastSampler sampler(B, vocab, path);
    const std::string name = path == FastSampler::Path::kAuto
                                 ? "FastSampler (cluster " + std::to_string(sampler.cluster_per_row(B, vocab)) + ")"
                                 : "FastSampler (multi-pass)";
    const std::vector<SamplingParams> knobs = {{0.0f, 0, 1.0f, 1}, {1.0f, 0, 1.0f, 2}, {0.7f, 50, 1.0f, 3},
                                               {1.0f, 0, 0.9f, 4}, {0.8f, 40, 0.95f, 5}, {1.3f, 1, 0.5f, 6}};
    int64_t rows = 0, equal = 0;
    for (size_t k = 0; k < knobs.size(); ++k) {
      const Tensor logits = random_rows(B, vocab, 2.0 + static_cast<double>(k), 300 + k);
      const Tensor logits_dev = on(logits, Device::CUDA, DType::F32);
      std::vector<SamplingRow> host_rows;
      for (int b = 0; b < B; ++b) host_rows.push_back(make_sampling_row(knobs[k], static_cast<uint64_t>(b)));
      DeviceBuffer rows_dev(host_rows.size() * sizeof(SamplingRow));
      TVLLM_CUDA_CHECK(cudaMemcpy(rows_dev.data(), host_rows.data(), rows_dev.bytes(), cudaMemcpyHostToDevice));
      Tensor ids = Tensor::empty({B}, DType::I32, Device::CUDA);
      sampler.sample(logits_dev.view().ptr<const float>(), vocab, vocab, B, rows_dev.as<SamplingRow>(),
                     ids.view().ptr<int32_t>());
      const Tensor got = Tensor::copy_of(ids.view(), Device::CPU);
      for (int b = 0; b < B; ++b) {
        ++rows;
        equal += got.view().ptr<const int32_t>()[b] ==
                 sample_cpu(logits.view().ptr<const float>() + b * vocab, vocab, host_rows[static_cast<size_t>(b)]);
      }
    }
    const std::string detail =
        std::to_string(equal) + "/" + std::to_string(rows) + " rows: greedy, temperature, top-k, top-p, both";
    std::printf("%s vs sample_cpu: %s\n", name.c_str(), detail.c_str());
    report.add_check(name + " == sample_cpu (vocab " + std::to_string(vocab) + ")", equal == rows, detail);
  }
}

// ---- 4. the fast decode attention -------------------------------------------------------------------------

// One decode step of 5 sequences (1 to 3000 keys, shuffled slots) with the model's attention heads: lesson 14's
// kernel against lesson 10's CPU reference (within lesson 10's decode tolerance) and lesson 10's kernel (one bf16
// step apart at most), at the op's own split count and at 1 and 7 pinned splits.
void check_decode_attention(Report& report, const ModelConfig& c) {
  install_fast_decode_attention();
  const AttentionShape s = AttentionShape::from_config(c);
  const std::vector<int64_t> q_lens{1, 1, 1, 1, 1}, k_lens{1, 17, 3000, 200, 64};
  const std::vector<int32_t> slot_ids{3, 1, 4, 0, 2};
  const int64_t B = 5, ctx = 3000;
  const std::vector<float> k = random_normal(static_cast<size_t>(B * ctx * s.kv_dim()), 71);
  const std::vector<float> v = random_uniform(static_cast<size_t>(B * ctx * s.kv_dim()), 72);
  const std::vector<float> q = random_normal(static_cast<size_t>(B * s.q_dim()), 73);
  // The step on device d with `kernel` and `splits` (0: the op's own count); the CPU computes lesson 10's reference.
  const auto run = [&](Device d, DecodeAttention kernel, int splits) {
    const DType dt = d == Device::CPU ? DType::F32 : DType::BF16;
    KvCache cache(s, 1, B, ctx, d);
    const Shape shape = cache.k(0).shape;
    copy_view(cache.k(0), on(Tensor::from_f32(k, shape, DType::BF16, Device::CPU), d, dt).view());
    copy_view(cache.v(0), on(Tensor::from_f32(v, shape, DType::BF16, Device::CPU), d, dt).view());
    AttentionBatch batch(B, d);
    batch.set_lengths(q_lens, k_lens);
    CacheSlots slots(B, B, d);
    slots.set(slot_ids);
    DecodeWorkspace ws(s, B, d);
    const Tensor qt = on(Tensor::from_f32(q, {B, s.q_dim()}, DType::BF16, Device::CPU), d, dt);
    Tensor o = Tensor::empty({B, s.q_dim()}, dt, d);
    if (splits == 0) cached_attention(o, qt, cache.k(0), cache.v(0), batch, slots, s, &ws, nullptr, kernel);
    else decode_attention(o, qt, cache.k(0), cache.v(0), batch, slots, s, splits, &ws, nullptr, kernel);
    return to_f32_vector(o);  // waits for the device
  };
  const std::vector<float> cpu = run(Device::CPU, DecodeAttention::Split, 0);
  const std::vector<float> lesson10 = run(Device::CUDA, DecodeAttention::Split, 0);
  for (int splits : {0, 1, 7}) {
    // Both pipelines (decode_attention_fast.h): v1 at 7 splits, v2 (the default) otherwise.
    set_fast_decode_pipeline(splits == 7 ? FastDecodePipeline::Registers : FastDecodePipeline::Ring);
    const std::vector<float> got = run(Device::CUDA, DecodeAttention::Fast, splits);
    const std::string name = std::string("fast decode attention ") + fast_decode_pipeline_name(fast_decode_pipeline()) +
                             ", " + std::to_string(s.n_heads) + "/" + std::to_string(s.n_kv_heads) + " heads of " +
                             std::to_string(s.head_dim) +
                             (splits == 0 ? ", its own splits" : ", " + std::to_string(splits) + " splits");
    const CompareResult vs_cpu = compare(name + " vs cpu", got, cpu, Tolerance{1e-4, 1.0 / 256 + 1e-4});
    const CompareResult vs_l10 = compare(name + " vs lesson 10", got, lesson10, Tolerance{1e-4, 2.0 / 256 + 1e-4});
    report.add_check(name, vs_cpu.pass() && vs_l10.pass(),
                     "max_rel vs cpu " + fmt("%.2e", vs_cpu.max_rel) + ", vs lesson 10's kernel " +
                         fmt("%.2e", vs_l10.max_rel));
  }
  set_fast_decode_pipeline(FastDecodePipeline::Ring);
}

// ---- 5. --bench ------------------------------------------------------------------------------------------

void bench_gemvs(const ModelWeights& w, const Ceilings& ceilings) {
  CublasHandle cublas(CublasHandle::kDefaultWorkspaceBytes, nullptr);
  for (int64_t M : {int64_t{1}, int64_t{2}, int64_t{4}, int64_t{8}, int64_t{16}}) {
    std::vector<BenchRow> rows;
    for (const auto& [name, weight] : decode_matrices(w)) {
      const int64_t N = weight.shape[0], K = weight.shape[1];
      const DType out_dtype = name == "lm_head" ? DType::F32 : DType::BF16;
      const Tensor x = on(random_rows(M, K, 1.0, 9), Device::CUDA, DType::BF16);
      Tensor out = Tensor::empty({M, N}, out_dtype, Device::CUDA);
      const double bytes = static_cast<double>(gemv_bytes_moved(M, N, K, out_dtype));
      const std::string shape = " [" + std::to_string(M) + "x" + std::to_string(K) + " . " + std::to_string(K) +
                                "x" + std::to_string(N) + "]";
      for (GemvKernel k : all_gemv_kernels())
        rows.push_back({name + " gemv " + std::string(gemv_kernel_name(k)) + shape,
                        bench_gpu([&] { gemv(out.view(), x.view(), weight, k); }), bytes, 2.0 * M * N * K});
      rows.push_back({name + " cuBLAS (lesson 06 v5)" + shape,
                      bench_gpu([&] { linear(out.view(), x.view(), weight, MatmulKernel::V5Cublas, &cublas); }),
                      bytes, 2.0 * M * N * K});
    }
    print_bench_table(std::cout, "decode GEMVs, M = " + std::to_string(M) + " (L2 flushed before each run)", rows,
                      ceilings);
  }
}

// The step's GEMVs alone, chained as fast_forward chains them (every layer's qkv, o, gate|up and down, then the
// lm_head with the final norm: each reads what an earlier one wrote, and the residual adds write h, which the one
// before read), captured as one CUDA graph and replayed: plain launches, then programmatic dependents (section
// 7). No RoPE or attention between them, so every boundary can overlap: PDL's best case, and the GEMVs' share
// of a step without the kernels PDL does not reach.
void bench_gemv_chain(const ModelWeights& w, const Ceilings& ceilings) {
  const ModelConfig& c = w.config;
  const float eps = static_cast<float>(c.rms_norm_eps);
  const LayerWeights& first = w.layers.front();
  Tensor h = on(random_rows(1, c.hidden_size, 1.0, 21), Device::CUDA, DType::BF16);
  const Tensor attn = on(random_rows(1, first.wo.shape[1], 1.0, 22), Device::CUDA, DType::BF16);
  Tensor qkv = Tensor::empty({1, first.wqkv.shape[0]}, DType::BF16, Device::CUDA);
  Tensor act = Tensor::empty({1, first.w_gate_up.shape[0] / 2}, DType::BF16, Device::CUDA);
  Tensor logits = Tensor::empty({1, w.lm_head.shape[0]}, DType::F32, Device::CUDA);
  double bytes = static_cast<double>(w.lm_head.nbytes());
  for (const LayerWeights& L : w.layers)
    bytes += static_cast<double>(L.wqkv.nbytes() + L.wo.nbytes() + L.w_gate_up.nbytes() + L.w_down.nbytes());
  const int64_t kernels = 4 * static_cast<int64_t>(w.layers.size()) + 1;
  CudaStream stream;
  std::vector<BenchRow> rows;
  for (const bool pdl : {false, true}) {
    if (pdl && !pdl_supported()) {
      std::printf("\n(no programmatic dependent launch on this GPU: the chain runs with plain launches only)\n");
      break;
    }
    const CudaGraph graph = CudaGraph::capture(stream.get(), [&] {
      for (const LayerWeights& L : w.layers) {
        rmsnorm_gemv(qkv.view(), h.view(), L.input_norm, eps, L.wqkv, stream.get(), pdl);
        gemv_residual(h.view(), attn.view(), L.wo, stream.get(), pdl);
        rmsnorm_gemv_silu_mul(act.view(), h.view(), L.post_norm, eps, L.w_gate_up, stream.get(), pdl);
        gemv_residual(h.view(), act.view(), L.w_down, stream.get(), pdl);
      }
      rmsnorm_gemv(logits.view(), h.view(), w.final_norm, eps, w.lm_head, stream.get(), pdl);
    });
    // bench_gpu times the default stream: the graph is launched there (a replay may go to any stream).
    rows.push_back({std::to_string(kernels) + " GEMVs of a step, one graph, " +
                        (pdl ? "programmatic dependent launch" : "plain launches"),
                    bench_gpu([&] { graph.launch(nullptr); }), bytes, 0.0});
  }
  print_bench_table(std::cout, "the decode step's GEMVs chained (M = 1, L2 flushed before each run)", rows,
                    ceilings);
  if (rows.size() == 2)
    std::printf("PDL saves %.2f us per GEMV boundary (%lld boundaries)\n",
                (rows[0].result.median_ms - rows[1].result.median_ms) * 1e3 / static_cast<double>(kernels - 1),
                (long long)(kernels - 1));
}

// The timeline of one eager decode step at context 128 (fast_forward_traced): a CUDA event after each op, so the
// time between two events is the op's kernels plus the gap before them. Summed per op over the layers: where the
// step's time goes, and what a kernel costs in the step beside its time alone (the GEMV table above). Events
// between kernels stop programmatic dependent launch from overlapping them: this is the step without PDL.
void bench_step_timeline(const ModelWeights& w) {
  const ModelConfig& c = w.config;
  const int64_t P = 128, steps = 8;
  Generator gen(w, Generator::limits_for(c, P + steps + 1, 1, P));
  std::vector<int32_t> prompt;
  for (int64_t i = 0; i < P; ++i) prompt.push_back(static_cast<int32_t>((7 * i + 3) % std::min<int64_t>(c.vocab_size, 1000)));
  gen.set_step(prompt, {P}, {P}, {static_cast<int32_t>(P - 1)}, {0});
  gen.forward_step();
  const cudaStream_t stream = gen.context().stream();
  std::vector<cudaEvent_t> events(static_cast<size_t>(8 * c.num_hidden_layers + 4));
  for (cudaEvent_t& e : events) TVLLM_CUDA_CHECK(cudaEventCreate(&e));
  std::vector<std::string> names;
  std::map<std::string, std::pair<int64_t, double>> per_op;  // op -> (count, ms), over the timed steps
  std::vector<std::string> order;                            // ops in the order of the first step
  double step_ms = 0.0;
  for (int64_t s = 0; s <= steps; ++s) {  // step 0 warms up and is not counted
    gen.set_step({static_cast<int32_t>(s % 7 + 1)}, {1}, {P + s + 1}, {0}, {0});
    names.clear();
    TVLLM_CUDA_CHECK(cudaEventRecord(events[0], stream));
    const OpMark mark = [&](const char* op) {
      TVLLM_REQUIRE(names.size() + 1 < events.size(), "step timeline: more ops than events");
      names.emplace_back(op);
      TVLLM_CUDA_CHECK(cudaEventRecord(events[names.size()], stream));
    };
    fast_forward_traced(gen.context(), w, gen.step(), gen.attention(), mark);
    gen.context().synchronize();
    if (s == 0) continue;
    for (size_t i = 0; i < names.size(); ++i) {
      float ms = 0.f;
      TVLLM_CUDA_CHECK(cudaEventElapsedTime(&ms, events[i], events[i + 1]));
      auto& [count, total] = per_op[names[i]];
      if (count == 0 && s == 1) order.push_back(names[i]);
      ++count;
      total += ms;
    }
    float total_ms = 0.f;
    if (!names.empty()) TVLLM_CUDA_CHECK(cudaEventElapsedTime(&total_ms, events[0], events[names.size()]));
    step_ms += total_ms;
  }
  for (cudaEvent_t e : events) cudaEventDestroy(e);
  if (order.empty()) {
    std::printf("\n(step timeline: the fused path did not run this step)\n");
    return;
  }
  std::printf("\none eager decode step at context %lld, plain launches, a CUDA event after each op (mean of %lld "
              "steps): %.1f us\n  %-36s %8s %12s %10s %8s\n",
              (long long)P, (long long)steps, step_ms * 1e3 / steps, "op", "per step", "us per step", "us each",
              "% step");
  for (const std::string& op : order) {
    const auto& [count, ms] = per_op[op];
    const double per_step_us = ms * 1e3 / steps;
    std::printf("  %-36s %8lld %12.1f %10.2f %7.1f%%\n", op.c_str(), (long long)(count / steps), per_step_us,
                per_step_us * steps / static_cast<double>(count), 100.0 * ms / step_ms);
  }
}

void bench_sampler(int64_t vocab) {
  std::printf("\nsampler, vocab %lld: FastSampler (default: the cluster path, one launch; v3 unless\n"
              "TVLLM_TOPP_V=old picks v1 or TVLLM_TOPK_V=new v4), each cluster kernel (v1, v2, v3: top-p by\n"
              "fine buckets and a list, v4: v3 plus top-k by a list),\n"
              "the multi-pass path (seven launches) vs lesson 09's GpuSampler (us per call, the same ids)\n",
              (long long)vocab);
  std::printf("  %6s  %-22s %10s %11s %9s %9s %9s %9s %11s %8s %8s\n", "batch", "knobs", "lesson 09",
              "multi-pass", "v1", "v2", "v3", "v4", "FastSampler", "cluster", "speed-up");
  const std::vector<std::pair<std::string, SamplingParams>> knobs = {{"greedy", {0.0f, 0, 1.0f, 1}},
                                                                      {"temperature 1", {1.0f, 0, 1.0f, 5}},
                                                                      {"top-k 50", {0.7f, 50, 1.0f, 2}},
                                                                      {"top-p 0.9", {1.0f, 0, 0.9f, 3}},
                                                                      {"top-k 50 + top-p 0.9", {0.7f, 50, 0.9f, 4}}};
  for (int B : {1, 64})
    for (const auto& [name, p] : knobs) {
      const SamplerTiming t = bench_fast_sampler(B, vocab, p);
      std::printf("  %6d  %-22s %10.1f %11.1f %9.1f %9.1f %9.1f %9.1f %11.1f %8d %7.1fx\n", B, name.c_str(),
                  t.lesson09_us, t.multipass_us, t.cluster_v1_us, t.cluster_v2_us, t.cluster_v3_us,
                  t.cluster_v4_us, t.fast_us, t.cluster, t.lesson09_us / t.fast_us);
    }
}

// Decode attention alone, the model's heads and layers: lesson 10's kernel and lesson 14's, each over lesson 12's
// pool (shuffled blocks of 16) and lesson 10's contiguous cache (paged_bench.cpp measures them).
void bench_decode_attention(const ModelConfig& c) {
  install_fast_decode_attention();
  const AttentionShape s = AttentionShape::from_config(c);
  const std::vector<std::pair<int64_t, int64_t>> shapes{{1, 4096}, {8, 4096}, {64, 2048}, {256, 1024}};
  for (const auto& [B, ctx] : shapes) {
    const int64_t context = std::min<int64_t>(ctx, c.max_position_embeddings);
    for (FastDecodePipeline pipeline : {FastDecodePipeline::Registers, FastDecodePipeline::Ring}) {
      set_fast_decode_pipeline(pipeline);
      std::printf("\nlesson 14 kernel: %s\n", fast_decode_pipeline_name(pipeline));
      bench_paged_decode(s, c.num_hidden_layers, B, context, 16, std::cout);
    }
  }
  set_fast_decode_pipeline(FastDecodePipeline::Ring);
}

void bench_progression(const ModelWeights& w, const Ceilings& ceilings) {
  const ModelConfig& c = w.config;
  std::printf("\ndecode through lesson 10's Generator (what `tiny-vllm generate` does), 64 new tokens per run;\n"
              "bytes = weights + KV read per step; copy bandwidth %.0f GB/s -> batch 1 at most %.0f tok/s\n",
              ceilings.copy_gbs, ceilings.copy_gbs * 1e9 / decode_bytes_per_step(w, 1, 0.0));
  std::printf("  %-44s %6s %8s %10s %10s %8s\n", "variant", "batch", "context", "ms/step", "tok/s", "% copy");
  for (int64_t B : {int64_t{1}, int64_t{8}})
    for (int64_t ctx : {int64_t{128}, std::min<int64_t>(4096, c.max_position_embeddings - 65)})
      for (const LatencyVariant& v : progression_variants()) {
        const DecodeLatency d = measure_decode_latency(w, v.fast, B, ctx, 64, 3, ceilings.copy_gbs);
        std::printf("  %-44s %6lld %8lld %10.3f %10.1f %7.1f%%\n", v.name.c_str(), (long long)B, (long long)ctx,
                    d.ms_per_step, d.tok_s, d.pct_copy);
      }
}

// ---- the run -----------------------------------------------------------------------------------------------

int run(const LessonOptions& opt) {
  const ModelDir model = ModelDir::open(opt.model_dir);
  const ModelWeights w = ModelWeights::bind(model, opt.device);
  const ModelConfig& c = model.config;
  const bool gpu = opt.device == Device::CUDA;
  const GemvKernel kernel = opt.kernel.empty() ? kDefaultGemvKernel : parse_gemv_kernel(opt.kernel);
  std::printf("model %s: %lld layers, hidden %lld, intermediate %lld, vocab %lld\n", model.path.string().c_str(),
              (long long)c.num_hidden_layers, (long long)c.hidden_size, (long long)c.intermediate_size,
              (long long)c.vocab_size);
  Report report(std::string("lesson 14: the fast path -> ") + std::string(device_name(opt.device)) +
                (gpu ? " (GEMVs within 2 bf16 ulps + 2^-10 max|out| of fp32; the model within lesson 10's rules)"
                     : " (the fused references vs the lessons' composed CPU ops)"));
  if (!gpu) {
    std::printf("the fast path is CUDA code: on the CPU this checks its references (--device cuda runs it)\n");
    check_fused_references_cpu(report, w);
    report.print(std::cout);
    return report.exit_code();
  }
  const std::string declined = fast_forward_declines(c);
  TVLLM_REQUIRE(declined.empty(), "lesson 14's fused decode path does not compute this model's " + declined +
                                      " (tiny-vllm generate/serve run it with the composed kernels and CUDA graphs)");
  TVLLM_REQUIRE(fast_forward_supported(w), "this model's shapes are not ones the fused GEMVs take (K % 8 != 0?)");
  check_gemvs_cuda(report, w, kernel);
  check_fast_path(report, opt.model_dir, w);
  check_sampler(report, c.vocab_size);
  check_decode_attention(report, c);
  report.print(std::cout);
  if (opt.bench) {
    const Ceilings ceilings = measure_ceilings(false);
    bench_gemvs(w, ceilings);
    bench_gemv_chain(w, ceilings);
    bench_step_timeline(w);
    bench_sampler(c.vocab_size);
    bench_decode_attention(c);
    bench_progression(w, ceilings);
  }
  return report.exit_code();
}

}  // namespace
}  // namespace tvllm

int main(int argc, char** argv) {
  tvllm::LessonCli cli("lesson14_performance", "decode at the memory roofline: graphs, fused GEMVs, a fast sampler");
  cli.kernels({"v1", "v2", "v3"}, "v3");
  return cli.run(argc, argv, tvllm::run);
}
