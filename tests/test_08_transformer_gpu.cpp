// Lesson 08 on the GPU: the SiLU·mul kernel against Hugging Face's bf16 rounding (odd sizes, strided and
// misaligned views), the row gather, the packed weights bit for bit against the checkpoint, the bf16
// forward against Hugging Face (teacher-forced top-1 at clear margins), batch == alone, one forward step
// captured in a CUDA graph and replayed (also over a new step's inputs), steps queued back to back, an F32
// checkpoint, and a head_dim that is neither 64 nor 128.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "common/cuda_stream.h"
#include "common/errors.h"
#include "common/random.h"
#include "common/validate.h"
#include "logits_check.h"
#include "model_dir.h"
#include "silu_mul.h"
#include "testing/safetensors_builder.h"
#include "testing/testing.h"
#include "transformer.h"

namespace tvllm {
namespace {

using testing::SyntheticLlama;
using testing::TempDir;

std::vector<std::vector<int32_t>> reference_prompts(const ReferenceSet& ref) {
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < ref.num_prompts(); ++i) prompts.push_back(ref.prompt_ids(i));
  return prompts;
}

int64_t total_tokens(const std::vector<std::vector<int32_t>>& prompts) {
  int64_t n = 0;
  for (const auto& p : prompts) n += static_cast<int64_t>(p.size());
  return n;
}

// An engine on `device` for `model`, every row's logits.
struct Engine {
  Engine(const ModelDir& model, int64_t max_tokens, int64_t max_sequences, Device device,
         AttentionKernel kernel = AttentionKernel::V2Flash)
      : limits{max_tokens, max_sequences, max_tokens, 0},
        weights(ModelWeights::bind(model, device)),
        ctx(model.config, limits, device),
        step(model.config, limits, device),
        attn(model.config, limits, device, kernel, ctx.cublas()) {}
  // Logits of every row of the prompts run as one step, on the host.
  Tensor run(const std::vector<std::vector<int32_t>>& prompts) {
    step.set_prompts(prompts, /*all_rows=*/true, ctx.stream());
    const TensorView logits = forward(ctx, weights, step, attn);
    ctx.synchronize();
    ctx.check_tokens();
    return Tensor::copy_of(logits, Device::CPU);
  }
  EngineLimits limits;
  ModelWeights weights;
  ExecContext ctx;
  StepInputs step;
  PrefillAttention attn;
};

std::vector<uint16_t> bits_of(const TensorView& bf16) {
  const Tensor host = Tensor::copy_of(bf16, Device::CPU);
  const auto* p = host.view().ptr<const uint16_t>();
  return std::vector<uint16_t>(p, p + host.numel());
}

std::vector<uint16_t> host_bits(const TensorView& host_view) {  // any float dtype, as bf16 bits
  std::vector<uint16_t> b(static_cast<size_t>(host_view.numel()));
  for (size_t i = 0; i < b.size(); ++i) b[i] = f32_to_bf16(load_as_f32(host_view.data, host_view.dtype, i));
  return b;
}

// ---- SiLU·mul ------------------------------------------------------------------------------------

float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

// How gate, up and out are laid out in device memory.
enum class Layout {
  Separate,    // three contiguous [T, I] buffers
  Fused,       // gate | up as column slices of one [T, 2I] buffer (the packed GEMM's output)
  Misaligned,  // the same, one column further: rows start at odd bf16 offsets; out a slice too
};

void check_silu_mul(int64_t T, int64_t I, Layout layout, uint64_t seed) {
  SCOPED_TRACE("T " + std::to_string(T) + " I " + std::to_string(I) + " layout " +
               std::to_string(int(layout)));
  // Values to +-12: silu's curved part, its tails, and products that round both ways.
  std::vector<float> g = random_normal(static_cast<size_t>(T * I), seed, 4.0f);
  std::vector<float> u = random_normal(static_cast<size_t>(T * I), seed + 1, 2.0f);
  for (float& x : g) x = round_bf16(x);
  for (float& x : u) x = round_bf16(x);

  const int64_t offset = layout == Layout::Misaligned ? 1 : 0;
  const int64_t width = layout == Layout::Separate ? I : 2 * I + offset;  // of the gate|up buffer
  std::vector<float> gu(static_cast<size_t>(T * width), 0.0f), ups(static_cast<size_t>(T * I));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < I; ++i) {
      gu[t * width + offset + i] = g[t * I + i];
      if (layout == Layout::Separate)
        ups[t * I + i] = u[t * I + i];
      else
        gu[t * width + offset + I + i] = u[t * I + i];
    }
  const Tensor gate_up = Tensor::from_f32(gu, {T, width}, DType::BF16, Device::CUDA);
  const Tensor up_alone = Tensor::from_f32(ups, {T, I}, DType::BF16, Device::CUDA);
  const int64_t out_width = layout == Layout::Misaligned ? I + 3 : I;
  Tensor out_buf = Tensor::empty({T, out_width}, DType::BF16, Device::CUDA);
  TVLLM_CUDA_CHECK(cudaMemset(out_buf.data(), 0xFF, out_buf.view().nbytes()));  // NaN: unwritten shows

  auto columns = [](const TensorView& t, int64_t begin, int64_t count) {
    TensorView v = t;
    v.data = static_cast<uint16_t*>(t.data) + begin;
    v.shape = {t.shape[0], count};
    return v;
  };
  const TensorView gate = columns(gate_up, offset, I);
  const TensorView up = layout == Layout::Separate ? up_alone.view() : columns(gate_up, offset + I, I);
  const TensorView out = columns(out_buf, layout == Layout::Misaligned ? 1 : 0, I);
  silu_mul(out, gate, up);
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());

  const std::vector<uint16_t> got_all = bits_of(out_buf);
  int64_t one_ulp = 0;
  std::vector<float> got(static_cast<size_t>(T * I));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < I; ++i) {
      const uint16_t b = got_all[t * out_width + (layout == Layout::Misaligned ? 1 : 0) + i];
      got[t * I + i] = bf16_to_f32(b);
      // Hugging Face's bf16 run: act_fn(gate) rounded to bf16, then the product rounded again.
      const float x = g[t * I + i];
      const float act = round_bf16(x / (1.0f + std::exp(-x)));
      const uint16_t want = f32_to_bf16(act * u[t * I + i]);
      const int diff = std::abs(static_cast<int>(b) - static_cast<int>(want));
      // expf on the GPU and on the host may differ by an ulp, which can move a rounding: one bf16 ulp at
      // most.
      ASSERT_LE(diff, 1) << "t " << t << " i " << i << ": got " << bf16_to_f32(b) << " want "
                         << bf16_to_f32(want);
      one_ulp += diff;
    }
  EXPECT_LE(one_ulp, std::max<int64_t>(2, T * I / 100)) << "one-ulp differences should be rare";
  // Nothing outside the view was written.
  if (layout == Layout::Misaligned)
    for (int64_t t = 0; t < T; ++t) {
      EXPECT_EQ(got_all[t * out_width], 0xFFFF);
      EXPECT_EQ(got_all[t * out_width + 1 + I], 0xFFFF);
    }
  // And against the fp32 reference: two bf16 roundings, 2^-7 relative at most.
  const Tensor gf = Tensor::from_f32(g, {T, I}, DType::F32, Device::CPU);
  const Tensor uf = Tensor::from_f32(u, {T, I}, DType::F32, Device::CPU);
  Tensor ref = Tensor::empty({T, I}, DType::F32, Device::CPU);
  silu_mul(ref, gf, uf);
  const CompareResult r = compare("silu_mul", got, to_f32_vector(ref), {1e-30, 1.0 / 128 + 1e-6});
  EXPECT_TRUE(r.pass()) << "max_rel " << r.max_rel << " bad " << r.bad;
}

TEST(SiluMulGpu, MatchesHuggingFaceRoundingOnOddSizes) {
  TVLLM_REQUIRE_GPU();
  const std::pair<int64_t, int64_t> sizes[] = {{1, 1},    {3, 7},  {5, 600}, {2, 601},
                                               {4, 8200}, {7, 13}, {300, 8}, {1, 8192}};
  uint64_t seed = 1;
  for (auto [T, I] : sizes)
    for (Layout layout : {Layout::Separate, Layout::Fused, Layout::Misaligned})
      check_silu_mul(T, I, layout, seed++);
}

TEST(SiluMulGpu, RejectsHostOrF32Views) {
  TVLLM_REQUIRE_GPU();
  const Tensor a = Tensor::from_f32(std::vector<float>(8, 1.0f), {2, 4}, DType::F32, Device::CUDA);
  const Tensor b = Tensor::from_f32(std::vector<float>(8, 1.0f), {2, 4}, DType::BF16, Device::CUDA);
  const Tensor h = Tensor::from_f32(std::vector<float>(8, 1.0f), {2, 4}, DType::BF16, Device::CPU);
  Tensor out = Tensor::empty({2, 4}, DType::BF16, Device::CUDA);
  EXPECT_THROW(silu_mul(out, a, b), InputError);
  EXPECT_THROW(silu_mul(out, h, b), InputError);
}

TEST(GatherRowsGpu, MatchesTheHostGather) {
  TVLLM_REQUIRE_GPU();
  for (int64_t H : {336, 7, 8, 2048}) {
    SCOPED_TRACE("H " + std::to_string(H));
    const int64_t T = 37;
    const std::vector<float> x = random_normal(static_cast<size_t>(T * H), 5);
    const Tensor xd = Tensor::from_f32(x, {T, H}, DType::BF16, Device::CUDA);
    const std::vector<int32_t> rows = {36, 0, 5, 5, 17, 36};
    const Tensor rd = Tensor::from_i32(rows, {6}, Device::CUDA);
    Tensor out = Tensor::empty({6, H}, DType::BF16, Device::CUDA);
    TVLLM_CUDA_CHECK(cudaMemset(out.data(), 0xFF, out.view().nbytes()));
    gather_rows(out, xd, rd);
    TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<uint16_t> all = bits_of(xd), got = bits_of(out);
    for (size_t r = 0; r < rows.size(); ++r)
      for (int64_t j = 0; j < H; ++j) ASSERT_EQ(got[r * H + j], all[rows[r] * H + j]) << r << "," << j;
  }
}

// ---- the weights on the GPU -----------------------------------------------------------------------

void expect_packed_equal(const ModelDir& model, const ModelWeights& w) {
  const WeightStore& s = model.weights;
  const ModelConfig& c = model.config;
  EXPECT_EQ(w.device, Device::CUDA);
  EXPECT_EQ(bits_of(w.embed), host_bits(s.host("model.embed_tokens.weight")));
  EXPECT_EQ(bits_of(w.final_norm), host_bits(s.host("model.norm.weight")));
  if (w.tied)
    EXPECT_EQ(w.lm_head.data, w.embed.data) << "tied: one matrix, not a copy";
  else
    EXPECT_EQ(bits_of(w.lm_head), host_bits(s.host("lm_head.weight")));
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    SCOPED_TRACE("layer " + std::to_string(l));
    const std::string p = "model.layers." + std::to_string(l) + ".";
    const LayerWeights& L = w.layers[static_cast<size_t>(l)];
    ASSERT_TRUE(L.packed());
    EXPECT_EQ(L.wqkv.shape, (Shape{c.q_dim() + 2 * c.kv_dim(), c.hidden_size}));
    EXPECT_EQ(L.w_gate_up.shape, (Shape{2 * c.intermediate_size, c.hidden_size}));
    // The packed matrix is the three stacked, and the unpacked views are its row ranges.
    std::vector<uint16_t> qkv = host_bits(s.host(p + "self_attn.q_proj.weight"));
    for (const char* part : {"self_attn.k_proj.weight", "self_attn.v_proj.weight"}) {
      const std::vector<uint16_t> b = host_bits(s.host(p + part));
      qkv.insert(qkv.end(), b.begin(), b.end());
    }
    EXPECT_EQ(bits_of(L.wqkv), qkv);
    EXPECT_EQ(bits_of(L.wk), host_bits(s.host(p + "self_attn.k_proj.weight")));
    std::vector<uint16_t> gate_up = host_bits(s.host(p + "mlp.gate_proj.weight"));
    const std::vector<uint16_t> up = host_bits(s.host(p + "mlp.up_proj.weight"));
    gate_up.insert(gate_up.end(), up.begin(), up.end());
    EXPECT_EQ(bits_of(L.w_gate_up), gate_up);
    EXPECT_EQ(bits_of(L.w_up), up);
    EXPECT_EQ(bits_of(L.wo), host_bits(s.host(p + "self_attn.o_proj.weight")));
    EXPECT_EQ(bits_of(L.w_down), host_bits(s.host(p + "mlp.down_proj.weight")));
    EXPECT_EQ(bits_of(L.input_norm), host_bits(s.host(p + "input_layernorm.weight")));
    EXPECT_EQ(bits_of(L.post_norm), host_bits(s.host(p + "post_attention_layernorm.weight")));
  }
}

TEST(TransformerGpu, PackedWeightsEqualUnpacked) {
  TVLLM_REQUIRE_GPU();
  const ModelDir model = ModelDir::open(testing::tiny_model_dir());
  const ModelWeights w = ModelWeights::bind(model, Device::CUDA);
  expect_packed_equal(model, w);
  EXPECT_GT(w.device_bytes, 0u);
  // An untied F32 and an F16 checkpoint: converted to bf16 on the way (nearest even), lm_head its own.
  for (const char* dtype : {"F32", "F16"}) {
    SyntheticLlama s;
    s.dtype = dtype;
    s.tied = false;
    s.hidden = 64, s.heads = 4, s.kv_heads = 2, s.head_dim = 16, s.intermediate = 40, s.vocab = 50;
    TempDir tmp;
    s.write(tmp.path());
    const ModelDir synthetic = ModelDir::open(tmp.path());
    expect_packed_equal(synthetic, ModelWeights::bind(synthetic, Device::CUDA));
  }
}

// ---- the forward pass ------------------------------------------------------------------------------

TEST(TransformerGpu, ForwardTop1AgreesWithHuggingFace) {
  TVLLM_REQUIRE_GPU();
  const ModelDir model = ModelDir::open(testing::tiny_model_dir());
  const ReferenceSet ref = ReferenceSet::open(testing::tiny_model_dir());
  const std::map<std::string, Bf16Floor> floors = read_bf16_floors(testing::tiny_model_dir());
  Engine e(model, 256, 4, Device::CUDA);
  int64_t clear = 0;
  for (int i = 0; i < ref.num_prompts(); ++i) {
    const Tensor logits = e.run({ref.prompt_ids(i)});
    const Tensor want = Tensor::copy_of(ref.prompt(i, "logits"), Device::CPU, DType::F32);
    // ε = max(0.2 x rms, 1.5 x Hugging Face's own bf16 error) (lesson 08's rule; the manifest has the floor).
    const GpuLogitBound eps = gpu_logit_bound(rms(want), find_floor(floors, "p" + std::to_string(i)));
    const Top1Agreement a = top1_agreement(logits, want, eps.clear_margin());
    std::printf("    p%d: %s, eps %s\n", i, a.summary().c_str(), eps.describe().c_str());
    EXPECT_TRUE(a.pass()) << "p" << i << ": first disagreement at position " << a.first_disagreement;
    EXPECT_LE(a.max_abs_error, eps.epsilon) << "p" << i;
    clear += a.clear;
  }
  EXPECT_GT(clear, 0) << "no position with a clear margin: the check checked nothing";
}

TEST(TransformerGpu, BatchEqualsAlone) {
  TVLLM_REQUIRE_GPU();
  const ModelDir model = ModelDir::open(testing::tiny_model_dir());
  const auto prompts = reference_prompts(ReferenceSet::open(testing::tiny_model_dir()));
  const std::vector<std::vector<int32_t>> batch = {prompts[2], prompts[0], prompts[1], prompts[0]};
  Engine e(model, 512, 8, Device::CUDA);
  const Tensor together = e.run(batch);
  int64_t row = 0;
  for (const auto& p : batch) {
    const auto n = static_cast<int64_t>(p.size());
    const Tensor alone = e.run({p});
    const Tensor part = Tensor::copy_of(together.view().rows(row, n), Device::CPU);
    const Top1Agreement a = top1_agreement(part, alone, kGpuClearMarginPerRms * rms(alone));
    EXPECT_TRUE(a.pass()) << a.summary();
    // cuBLAS may sum in another order for another number of rows: the bf16 bound, not bit equality.
    EXPECT_LE(a.max_abs_error, kGpuLogitErrorPerRms * a.reference_rms) << a.summary();
    row += n;
  }
}

// One step captured in a CUDA graph (global mode: a cudaMalloc, a synchronisation or a handle creation
// anywhere in forward() fails the capture) and replayed equal to the eager step; then the SAME graph replayed
// after StepInputs::set() refilled the inputs with another step of the same shape gives that step's logits.
TEST(TransformerGpu, GraphReplayEqualsEager) {
  TVLLM_REQUIRE_GPU();
  const ModelDir model = ModelDir::open(testing::tiny_model_dir());
  const auto prompts = reference_prompts(ReferenceSet::open(testing::tiny_model_dir()));
  const int64_t T = total_tokens(prompts);
  Engine e(model, T, 4, Device::CUDA);
  const cudaStream_t stream = e.ctx.stream();

  const Tensor eager = e.run(prompts);  // also the warm-up: modules loaded, cuBLAS heuristics cached
  const TensorView logits = e.ctx.workspace().logits.view().rows(0, T);
  const CudaGraph graph = CudaGraph::capture(stream, [&] { forward(e.ctx, e.weights, e.step, e.attn); });
  EXPECT_GE(graph.num_nodes(), 2 + 8 * static_cast<size_t>(model.config.num_hidden_layers))
      << "embedding, ~9 ops per layer, gathers, norm, lm_head";
  auto replay = [&] {
    TVLLM_CUDA_CHECK(cudaMemsetAsync(logits.data, 0xFF, logits.nbytes(), stream));  // NaN
    TVLLM_CUDA_CHECK(cudaMemsetAsync(e.ctx.workspace().hidden.data(), 0xFF,
                                     e.ctx.workspace().hidden.view().nbytes(), stream));
    graph.launch(stream);
    e.ctx.synchronize();
    return Tensor::copy_of(logits, Device::CPU);
  };
  for (int i = 0; i < 2; ++i)
    EXPECT_EQ(to_f32_vector(replay()), to_f32_vector(eager)) << "replay " << i << " differs from eager";

  // Another step of the same shape: every prompt reversed. The graph reads the static StepInputs buffers.
  std::vector<std::vector<int32_t>> reversed = prompts;
  for (auto& p : reversed) std::reverse(p.begin(), p.end());
  const Tensor eager2 = e.run(reversed);
  EXPECT_NE(to_f32_vector(eager2), to_f32_vector(eager));
  e.step.set_prompts(prompts, true, stream);   // back to the first step ...
  e.step.set_prompts(reversed, true, stream);  // ... and to the second: the last set() wins
  EXPECT_EQ(to_f32_vector(replay()), to_f32_vector(eager2)) << "the replay must read the new step's inputs";
}

// Steps queued back to back without waiting: set() may run ahead of the GPU, but must not overwrite the
// pinned bytes the previous step's copies are still reading.
TEST(TransformerGpu, StepsQueuedBackToBack) {
  TVLLM_REQUIRE_GPU();
  const ModelDir model = ModelDir::open(testing::tiny_model_dir());
  const auto prompts = reference_prompts(ReferenceSet::open(testing::tiny_model_dir()));
  Engine e(model, 256, 4, Device::CUDA);
  const int64_t V = model.config.vocab_size;
  std::vector<Tensor> alone;
  for (const auto& p : prompts) alone.push_back(e.run({p}));
  // Every step's logits, copied on the stream into one buffer as they come: 3 rounds of every prompt.
  constexpr int kRounds = 3;
  const int64_t per_round = total_tokens(prompts);
  Tensor all = Tensor::empty({kRounds * per_round, V}, DType::F32, Device::CUDA);
  int64_t row = 0;
  for (int round = 0; round < kRounds; ++round) {
    for (const auto& p : prompts) {
      e.step.set_prompts({p}, true, e.ctx.stream());
      const TensorView logits = forward(e.ctx, e.weights, e.step, e.attn);
      TVLLM_CUDA_CHECK(cudaMemcpyAsync(all.view().rows(row, logits.shape[0]).data, logits.data,
                                       logits.nbytes(), cudaMemcpyDeviceToDevice, e.ctx.stream()));
      row += logits.shape[0];
    }
  }
  e.ctx.synchronize();
  row = 0;
  for (int round = 0; round < kRounds; ++round)
    for (size_t i = 0; i < prompts.size(); ++i) {
      const auto n = static_cast<int64_t>(prompts[i].size());
      EXPECT_EQ(to_f32_vector(all.view().rows(row, n)), to_f32_vector(alone[i]))
          << "round " << round << ", prompt " << i;
      row += n;
    }
}

// Writes `model` again with every tensor widened to F32 (exact).
void write_f32_copy(const ModelDir& model, const std::filesystem::path& dir) {
  std::filesystem::create_directories(dir);
  std::filesystem::copy_file(model.path / "config.json", dir / "config.json");
  testing::SafetensorsBuilder b;
  for (const std::string& name : model.weights.names())
    b.add(name, "F32", model.weights.entry(name).shape,
          testing::f32_bytes(to_f32_vector(model.weights.host(name))));
  testing::write_file(dir / "model.safetensors", b.build());
}

TEST(TransformerGpu, F32CheckpointRunsAsBf16) {
  TVLLM_REQUIRE_GPU();
  const ModelDir model = ModelDir::open(testing::tiny_model_dir());
  const auto prompts = reference_prompts(ReferenceSet::open(testing::tiny_model_dir()));
  TempDir tmp;
  write_f32_copy(model, tmp.path());
  const ModelDir f32 = ModelDir::open(tmp.path());
  Engine a(model, 256, 4, Device::CUDA), b(f32, 256, 4, Device::CUDA);
  EXPECT_EQ(bits_of(b.weights.layers[1].wqkv), bits_of(a.weights.layers[1].wqkv))
      << "bf16 -> F32 -> bf16 is exact";
  EXPECT_EQ(to_f32_vector(b.run({prompts[1]})), to_f32_vector(a.run({prompts[1]})));
}

using testing::write_random_llama;

// A model whose head_dim is neither 64 nor 128 (24: the flash kernel's zero-padded tile), untied, F32: the
// GPU against the CPU reference on the same model.
TEST(TransformerGpu, HeadDim24MatchesTheCpuReference) {
  TVLLM_REQUIRE_GPU();
  SyntheticLlama s;
  s.dtype = "F32";
  s.tied = false;
  s.hidden = 96, s.heads = 4, s.kv_heads = 2, s.head_dim = 24, s.intermediate = 136, s.vocab = 300,
  s.layers = 3;
  TempDir tmp;
  write_random_llama(s, tmp.path(), 24);
  const ModelDir model = ModelDir::open(tmp.path());
  Rng rng(24);
  std::vector<std::vector<int32_t>> prompts(3);
  for (size_t i = 0; i < prompts.size(); ++i)
    for (size_t t = 0; t < 20 + 17 * i; ++t) prompts[i].push_back(static_cast<int32_t>(rng.below(s.vocab)));
  Engine gpu(model, 128, 4, Device::CUDA), cpu(model, 128, 4, Device::CPU);
  const Tensor want = cpu.run(prompts), got = gpu.run(prompts);
  const Top1Agreement a = top1_agreement(got, want, kGpuClearMarginPerRms * rms(want));
  std::printf("    head_dim 24: %s\n", a.summary().c_str());
  EXPECT_TRUE(a.pass()) << a.summary();
  EXPECT_LE(a.max_abs_error, kGpuLogitErrorPerRms * a.reference_rms) << a.summary();
  // The same prompts on the CPU path of the engine give the same numbers whether run together or apart.
  EXPECT_EQ(to_f32_vector(cpu.run({prompts[1]})),
            to_f32_vector(Tensor::copy_of(want.view().rows(20, 37), Device::CPU)));
}

TEST(TransformerGpu, MaterialisedAttentionBackendAgrees) {
  TVLLM_REQUIRE_GPU();
  const ModelDir model = ModelDir::open(testing::tiny_model_dir());
  const auto prompts = reference_prompts(ReferenceSet::open(testing::tiny_model_dir()));
  Engine v1(model, 256, 4, Device::CUDA, AttentionKernel::V1Materialized), v2(model, 256, 4, Device::CUDA);
  const Tensor a = v1.run(prompts), b = v2.run(prompts);
  const Top1Agreement t = top1_agreement(a, b, kGpuClearMarginPerRms * rms(b));
  EXPECT_TRUE(t.pass()) << t.summary();
  EXPECT_LE(t.max_abs_error, kGpuLogitErrorPerRms * t.reference_rms) << t.summary();
}

TEST(TransformerGpu, WrongDeviceOrBeyondTheLimitsIsAClearError) {
  TVLLM_REQUIRE_GPU();
  const ModelDir model = ModelDir::open(testing::tiny_model_dir());
  Engine e(model, 16, 2, Device::CUDA);
  const ModelWeights cpu_weights = ModelWeights::bind(model, Device::CPU);
  e.step.set_prompts({{1, 2, 3}}, true, e.ctx.stream());
  EXPECT_THROW(forward(e.ctx, cpu_weights, e.step, e.attn), InputError);
  EXPECT_THROW(e.step.set_prompts({std::vector<int32_t>(17, 1)}, true, e.ctx.stream()), InputError);
}

}  // namespace
}  // namespace tvllm
