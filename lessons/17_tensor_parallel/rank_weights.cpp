// Lesson 17: cutting the full weights into one rank's shards.
#include "rank_weights.h"

#include "common/errors.h"

namespace tvllm {

TensorView RankWeights::keep(Tensor t) {
  storage_.push_back(std::move(t));
  return storage_.back().view();
}

RankWeights RankWeights::cut(const ModelWeights& full, const ShardPlan& plan, int rank) {
  TVLLM_REQUIRE(full.device == Device::CPU, "RankWeights::cut: bind the full weights on the CPU (they are cut "
                                            "from the mapped checkpoint), then to_device()");
  TVLLM_REQUIRE(rank >= 0 && rank < plan.world_size, "RankWeights::cut: rank " + std::to_string(rank) +
                                                         " outside a world of " + std::to_string(plan.world_size));
  TVLLM_REQUIRE(full.config.hidden_size == plan.full.hidden_size &&
                    full.config.vocab_size == plan.full.vocab_size &&
                    full.layers.size() == static_cast<size_t>(plan.full.num_hidden_layers),
                "RankWeights::cut: the plan was made for another model");
  RankWeights w;
  w.rank = rank;
  w.shard = plan.ranks[static_cast<size_t>(rank)];
  const int N = plan.world_size;
  // shard_linear / shard_vocab_rows fill `t` only when they must copy; an empty one is not kept.
  auto linear_shard = [&](const TensorView& m, LinearSplit split) {
    Tensor t;
    const TensorView v = shard_linear(m, split, rank, N, t);
    if (t.data() != nullptr) w.storage_.push_back(std::move(t));
    return v;
  };
  auto vocab_shard = [&](const TensorView& table) {
    Tensor t;
    const TensorView v = shard_vocab_rows(table, w.shard.vocab_begin, w.shard.vocab, t);
    if (t.data() != nullptr) w.storage_.push_back(std::move(t));
    return v;
  };
  // (storage_ is a vector of Tensors: their buffers do not move when the vector grows, so views stay valid.)
  w.embed = vocab_shard(full.embed);
  w.lm_head = full.tied ? w.embed : vocab_shard(full.lm_head);
  w.final_norm = full.final_norm;
  for (const LayerWeights& L : full.layers) {
    RankLayerWeights r;
    r.input_norm = L.input_norm;
    r.post_norm = L.post_norm;
    r.wq = linear_shard(L.wq, LinearSplit::Columns);
    r.wk = linear_shard(L.wk, LinearSplit::Columns);
    r.wv = linear_shard(L.wv, LinearSplit::Columns);
    r.wo = linear_shard(L.wo, LinearSplit::Rows);
    r.w_gate = linear_shard(L.w_gate, LinearSplit::Columns);
    r.w_up = linear_shard(L.w_up, LinearSplit::Columns);
    r.w_down = linear_shard(L.w_down, LinearSplit::Rows);
    w.layers.push_back(r);
  }
  return w;
}

RankWeights RankWeights::to_device(Device device) const {
  RankWeights d;
  d.rank = rank;
  d.shard = shard;
  d.device = device;
  const DType dtype = device == Device::CUDA ? DType::BF16 : DType::F32;
  auto put = [&](const TensorView& v) {
    return d.keep(Tensor::copy_of(v.is_contiguous() ? v : Tensor::copy_of(v, Device::CPU).view(), device, dtype));
  };
  d.embed = put(embed);
  d.lm_head = lm_head.data == embed.data ? d.embed : put(lm_head);
  d.final_norm = put(final_norm);
  for (const RankLayerWeights& L : layers) {
    RankLayerWeights r;
    r.input_norm = put(L.input_norm);
    r.post_norm = put(L.post_norm);
    r.wq = put(L.wq);
    r.wk = put(L.wk);
    r.wv = put(L.wv);
    r.wo = put(L.wo);
    r.w_gate = put(L.w_gate);
    r.w_up = put(L.w_up);
    r.w_down = put(L.w_down);
    d.layers.push_back(r);
  }
  return d;
}

size_t RankWeights::bytes() const {
  size_t n = embed.nbytes() + final_norm.nbytes() + (lm_head.data == embed.data ? 0 : lm_head.nbytes());
  for (const RankLayerWeights& L : layers)
    for (const TensorView* v : {&L.input_norm, &L.post_norm, &L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up,
                                &L.w_down})
      n += v->nbytes();
  return n;
}

}  // namespace tvllm
