// Lesson 17: the tensor-parallel forward pass: lesson 08's ops on each rank's shard, two all-reduces per layer.
#include "tp_model.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <string>

#include "common/errors.h"
#include "common/exercise.h"
#include "matmul.h"
#include "rmsnorm.h"
#include "rope.h"
#include "silu_mul.h"
#include "vocab_parallel.h"

namespace tvllm {

namespace {

TensorView plane(const Tensor& buffer, int64_t offset, Shape shape) {
  char* p = static_cast<char*>(buffer.data()) + offset * static_cast<int64_t>(dtype_size(buffer.dtype()));
  return TensorView::contiguous(p, buffer.dtype(), buffer.device(), std::move(shape));
}

// y = x W^T with the context's matmul version (lesson 06): on the CPU the fp32 reference, on CUDA cuBLAS.
void project(TpRank& r, const TensorView& y, const TensorView& x, const TensorView& w) {
  linear(y, x, w, r.ctx->matmul_kernel(), r.ctx->cublas());
}

// Every rank's first `rows` rows of one workspace buffer, and every rank's stream: a collective's arguments.
std::vector<TensorView> rows_of(TpModel& m, Tensor Workspace::*buffer, int64_t rows) {
  std::vector<TensorView> v;
  for (TpRank& r : m.ranks()) v.push_back((r.ctx->workspace().*buffer).view().rows(0, rows));
  return v;
}
std::vector<cudaStream_t> streams_of(TpModel& m) {
  std::vector<cudaStream_t> s;
  for (TpRank& r : m.ranks()) s.push_back(r.ctx->stream());
  return s;
}

// Attention's half of a layer on one rank, lesson 08's steps 1-5 on this rank's heads:
//   normed = rmsnorm(h) * w_in (layer > 0: h += delta first, delta being the previous layer's all-reduced MLP
//   output); q, k, v of this rank's heads (column-parallel: whole heads); RoPE; attention over those heads;
//   delta = attn_r Wo_r^T: this rank's PARTIAL o_proj output (its heads' contribution to every element).
[[maybe_unused]] void attention_partial(TpRank& r, int layer, float eps) {
  Workspace& ws = r.ctx->workspace();
  const RankLayerWeights& L = r.weights.layers[static_cast<size_t>(layer)];
  const cudaStream_t stream = r.ctx->stream();
  const int64_t T = r.step->num_tokens(), q_dim = L.wq.shape[0], kv_dim = L.wk.shape[0];
  const TensorView h = ws.hidden.view().rows(0, T), normed = ws.normed.view().rows(0, T);
  const TensorView delta = ws.delta.view().rows(0, T), attn = ws.attn.view().rows(0, T);
  if (layer == 0)
    rmsnorm(normed, h, L.input_norm, eps, {}, stream);
  else
    add_rmsnorm(h, delta, L.input_norm, normed, eps, {}, stream);
  // Three planes of the qkv buffer, as lesson 08's CPU path lays them out.
  const TensorView q = plane(ws.qkv, 0, {T, q_dim}), k = plane(ws.qkv, T * q_dim, {T, kv_dim}),
                   v = plane(ws.qkv, T * (q_dim + kv_dim), {T, kv_dim});
  project(r, q, normed, L.wq);
  project(r, k, normed, L.wk);
  project(r, v, normed, L.wv);
  apply_rope(q, k, r.step->positions(), ws.rope, kDefaultRopeKernel, PositionCheck::Trusted, stream);
  r.attn->attend(layer, q, k, v, attn, *r.step, stream);
  project(r, delta, attn, L.wo);
}

// The MLP's half on one rank: h += delta (all-reduced o_proj output); normed = rmsnorm(h) * w_post; gate and up
// of this rank's intermediate columns; act = silu(gate) * up; delta = act_r Wd_r^T, a PARTIAL down_proj output.
[[maybe_unused]] void mlp_partial(TpRank& r, int layer, float eps) {
  Workspace& ws = r.ctx->workspace();
  const RankLayerWeights& L = r.weights.layers[static_cast<size_t>(layer)];
  const cudaStream_t stream = r.ctx->stream();
  const int64_t T = r.step->num_tokens(), I = L.w_gate.shape[0];
  const TensorView h = ws.hidden.view().rows(0, T), normed = ws.normed.view().rows(0, T);
  const TensorView delta = ws.delta.view().rows(0, T), act = ws.act.view().rows(0, T);
  add_rmsnorm(h, delta, L.post_norm, normed, eps, {}, stream);
  const TensorView gate = plane(ws.gate_up, 0, {T, I}), up = plane(ws.gate_up, T * I, {T, I});
  project(r, gate, normed, L.w_gate);
  project(r, up, normed, L.w_up);
  silu_mul(act, gate, up, stream);
  project(r, delta, act, L.w_down);
}

}  // namespace

void tp_decoder_layer(TpModel& m, int layer) {
  const float eps = static_cast<float>(m.plan().full.rms_norm_eps);
  const int64_t T = m.ranks().front().step->num_tokens();
  // --- exercise 17.2: the all-reduce placement ------------------------------------------------------------
  // Task: one decoder layer over every rank. attention_partial(r, layer, eps) and mlp_partial(r, layer, eps)
  //   run one half of the block on rank r and leave a PARTIAL sum in r's workspace delta (rows 0..T): o_proj's
  //   and down_proj's inputs are split across the ranks (row parallel). Run each half on every rank
  //   (m.for_each_rank) and put an all-reduce (m.comm().all_reduce_sum) exactly where the next step needs the
  //   full sum; no other communication is needed (README 17: "Column, then row").
  // Hint: rows_of(m, &Workspace::delta, T) and streams_of(m) are the collective's arguments.
  // Tests: TpSim17.OneRankIsTheReferenceBitForBit TpSim17.TwoRanksEqualTheReferenceOnTheBundledModel
  // Tests: TpSim17.FourRanksEqualTheReferenceOnARandomModel lesson17_tensor_parallel.cpu
  // Needs: 17.1
  // Stub:
  //   (void)eps;
  //   (void)T;
  //   (void)m;
  //   throw NotWrittenYet("17.2", "the all-reduce placement");
  // --- solution ---
  m.for_each_rank([&](TpRank& r) { attention_partial(r, layer, eps); });
  m.comm().all_reduce_sum(rows_of(m, &Workspace::delta, T), streams_of(m));  // o_proj: partial -> full
  m.for_each_rank([&](TpRank& r) { mlp_partial(r, layer, eps); });
  m.comm().all_reduce_sum(rows_of(m, &Workspace::delta, T), streams_of(m));  // down_proj: partial -> full
  // --- end of exercise 17.2 ---
}

TpModel::TpModel(const ModelWeights& full, const ShardPlan& plan, Device device, const EngineLimits& limits,
                 Communicator& comm, std::vector<int> devices)
    : plan_(plan), device_(device), comm_(comm) {
  const int N = plan.world_size;
  TVLLM_REQUIRE(comm.world_size() == N, "TpModel: the communicator has " + std::to_string(comm.world_size()) +
                                            " ranks, the plan " + std::to_string(N));
  TVLLM_REQUIRE(full.device == Device::CPU, "TpModel: bind the full weights on the CPU; each rank cuts its shard");
  if (devices.empty())
    for (int r = 0; r < N; ++r) devices.push_back(r);
  TVLLM_REQUIRE(static_cast<int>(devices.size()) == N, "TpModel: one CUDA device per rank is needed");
  const ModelConfig rc = plan.rank_config();
  const EngineLimits lim = limits.resolved(plan.full);
  ranks_.resize(static_cast<size_t>(N));
  for (int r = 0; r < N; ++r) {
    ranks_[static_cast<size_t>(r)].rank = r;
    ranks_[static_cast<size_t>(r)].cuda_device = device == Device::CUDA ? devices[static_cast<size_t>(r)] : -1;
  }
  for_each_rank([&](TpRank& r) {
    RankWeights host = RankWeights::cut(full, plan, r.rank);
    r.weights = device == Device::CUDA ? host.to_device(Device::CUDA) : std::move(host);
    r.ctx = std::make_unique<ExecContext>(rc, lim, device);
    r.step = std::make_unique<StepInputs>(plan.full, lim, device);
    r.attn = std::make_unique<PrefillAttention>(rc, lim, device, AttentionKernel::V2Flash, r.ctx->cublas());
    r.gathered = Tensor::empty({N * lim.max_logits_rows * rc.vocab_size}, DType::F32, device);
  });
}

TpModel::~TpModel() {
  // Each rank's CUDA objects are released with its own device current.
  try {
    for_each_rank([](TpRank& r) {
      r.attn.reset();
      r.step.reset();
      r.ctx.reset();
      r.weights = RankWeights();
      r.gathered = Tensor();
    });
  } catch (...) {
    // (a destructor must not throw; whatever is left is released by the members' own destructors)
  }
}

Tensor TpModel::forward_prompts(const std::vector<std::vector<int32_t>>& prompts, bool all_rows) {
  const int N = plan_.world_size;
  for_each_rank([&](TpRank& r) { r.step->set_prompts(prompts, all_rows, r.ctx->stream()); });
  const StepInputs& s0 = *ranks_.front().step;
  const int64_t T = s0.num_tokens(), R = s0.num_logits_rows();
  const float eps = static_cast<float>(plan_.full.rms_norm_eps);

  // 1. Vocabulary-parallel embedding: each rank looks up the ids it holds (zeros for the others), summed.
  for_each_rank([&](TpRank& r) {
    embedding_shard(r.ctx->workspace().hidden.view().rows(0, T), r.step->token_ids(), r.weights.embed,
                    r.weights.shard.vocab_begin, r.ctx->stream());
  });
  comm_.all_reduce_sum(rows_of(*this, &Workspace::hidden, T), streams_of(*this));
  // 2. The layers: two all-reduces each.
  for (int layer = 0; layer < static_cast<int>(plan_.full.num_hidden_layers); ++layer) tp_decoder_layer(*this, layer);
  // 3. Every rank holds the whole residual stream: the final norm is replicated, the lm_head is column-parallel
  //    over the vocabulary (each rank's logits of its own vocabulary rows), and the slices are all-gathered.
  for_each_rank([&](TpRank& r) {
    Workspace& ws = r.ctx->workspace();
    const cudaStream_t stream = r.ctx->stream();
    const TensorView rows = r.step->logits_rows();
    const TensorView out_h = ws.out_hidden.view().rows(0, R), out_d = ws.out_delta.view().rows(0, R);
    const TensorView out_n = ws.out_normed.view().rows(0, R);
    gather_rows(out_h, ws.hidden.view().rows(0, T), rows, stream);
    gather_rows(out_d, ws.delta.view().rows(0, T), rows, stream);
    add_rmsnorm(out_h, out_d, r.weights.final_norm, out_n, eps, {}, stream);
    project(r, ws.logits.view().rows(0, R), out_n, r.weights.lm_head);
  });
  const int64_t Vs = plan_.padded_vocab / N, V = plan_.full.vocab_size;
  std::vector<TensorView> gathered;
  for (TpRank& r : ranks_)
    gathered.push_back(TensorView::contiguous(r.gathered.data(), DType::F32, device_, {N * R * Vs}));
  comm_.all_gather(rows_of(*this, &Workspace::logits, R), gathered, streams_of(*this));
  for_each_rank([](TpRank& r) {
    r.ctx->synchronize();
    r.ctx->check_tokens();
  });
  // Rank 0's gathered buffer is [rank][row][Vs]: interleave it into [row][vocab], dropping the padding.
  const Tensor g = Tensor::copy_of(gathered.front(), Device::CPU);
  Tensor logits = Tensor::empty({R, V}, DType::F32, Device::CPU);
  for (int64_t row = 0; row < R; ++row)
    for (const RankShard& sh : plan_.ranks)
      for (int64_t j = 0; j < sh.vocab_real; ++j)
        logits.view().ptr<float>()[row * V + sh.vocab_begin + j] =
            g.view().ptr<const float>()[(sh.rank * R + row) * Vs + j];
  return logits;
}

EngineLimits limits_for_prompts(const ModelConfig& config, const std::vector<std::vector<int32_t>>& prompts) {
  TVLLM_REQUIRE(!prompts.empty(), "limits_for_prompts: no prompt");
  int64_t total = 0, longest = 0;
  for (const std::vector<int32_t>& p : prompts) {
    total += static_cast<int64_t>(p.size());
    longest = std::max<int64_t>(longest, static_cast<int64_t>(p.size()));
  }
  EngineLimits l;
  l.max_tokens = std::max<int64_t>(total, 1);
  l.max_sequences = static_cast<int64_t>(prompts.size());
  l.max_logits_rows = l.max_tokens;
  l.max_context = std::min(config.max_position_embeddings, std::max<int64_t>(longest, 1));
  return l;
}

Tensor unsharded_logits(const ModelWeights& w, const EngineLimits& limits,
                        const std::vector<std::vector<int32_t>>& prompts, bool all_rows) {
  ExecContext ctx(w.config, limits, w.device);
  StepInputs step(w.config, limits, w.device);
  PrefillAttention attn(w.config, limits, w.device, AttentionKernel::V2Flash, ctx.cublas());
  step.set_prompts(prompts, all_rows, ctx.stream());
  const TensorView logits = forward_composed(ctx, w, step, attn);
  ctx.synchronize();
  ctx.check_tokens();
  return Tensor::copy_of(logits, Device::CPU, DType::F32);
}

GpuLogitBound gpu_bound_for_prompts(const std::filesystem::path& model_dir, int num_prompts,
                                    const TensorView& reference) {
  const std::map<std::string, Bf16Floor> floors = read_bf16_floors(model_dir);
  std::optional<Bf16Floor> worst;
  for (int i = 0; i < num_prompts; ++i) {
    const Bf16Floor* f = find_floor(floors, "p" + std::to_string(i));
    if (f != nullptr && (!worst || f->logits_max_abs_error > worst->logits_max_abs_error)) worst = *f;
  }
  return gpu_logit_bound(rms(reference), worst ? &*worst : nullptr);
}

double max_abs_difference(const TensorView& a, const TensorView& b) {
  TVLLM_REQUIRE(a.shape == b.shape && a.dtype == DType::F32 && b.dtype == DType::F32 && a.device == Device::CPU &&
                    b.device == Device::CPU && a.is_contiguous() && b.is_contiguous(),
                "max_abs_difference: two host F32 views of one shape, got " + a.describe() + ", " + b.describe());
  double m = 0.0;
  for (int64_t i = 0; i < a.numel(); ++i)
    m = std::max(m, std::fabs(static_cast<double>(a.ptr<const float>()[i]) - b.ptr<const float>()[i]));
  return m;
}

double max_abs_value(const TensorView& a) {
  double m = 0.0;
  for (int64_t i = 0; i < a.numel(); ++i) m = std::max(m, std::fabs(static_cast<double>(a.ptr<const float>()[i])));
  return m;
}

}  // namespace tvllm
