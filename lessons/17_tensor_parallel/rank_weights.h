// Lesson 17: the weights one rank holds, cut from the full model by the shard plan.
//
//   RankWeights w = RankWeights::cut(full, plan, rank);     // host: views into the mapped file where possible
//   RankWeights g = w.to_device(Device::CUDA);              // bf16 on the CURRENT device (cudaSetDevice first)
//
// On the host, column-parallel shards (q, k, v, gate, up, and the embedding and lm_head rows) are views into
// the memory-mapped safetensors bytes of the rank's own rows: a rank never touches another rank's rows, so a
// real N-process loader would page in only 1/N of those tensors. Row-parallel shards (o_proj, down_proj) are
// columns of the stored matrix, strided in the file, so they are copied row slice by row slice (bytes
// unchanged). The norms are replicated.
#pragma once

#include <vector>

#include "common/tensor.h"
#include "model_weights.h"
#include "shard_plan.h"

namespace tvllm {

struct RankLayerWeights {
  TensorView input_norm, post_norm;  // [hidden] replicated
  TensorView wq;                     // [q_heads*head_dim, hidden]      columns of q
  TensorView wk, wv;                 // [kv_heads*head_dim, hidden]     columns of k, v
  TensorView wo;                     // [hidden, q_heads*head_dim]      rows: a partial sum, all-reduced
  TensorView w_gate, w_up;           // [intermediate/N, hidden]        columns
  TensorView w_down;                 // [hidden, intermediate/N]        rows: a partial sum, all-reduced
};

class RankWeights {
 public:
  // Rank `rank`'s shards of `full` (bound on the CPU: views into the mapped checkpoint, as stored).
  static RankWeights cut(const ModelWeights& full, const ShardPlan& plan, int rank);
  // Every tensor converted to bf16 (round to nearest even, as lesson 08's upload) on the current CUDA device.
  RankWeights to_device(Device device) const;

  int rank = 0;
  Device device = Device::CPU;
  RankShard shard;
  TensorView embed;    // [vocab/N (padded), hidden]: rows [vocab_begin, vocab_begin + vocab)
  TensorView lm_head;  // [vocab/N (padded), hidden]: the same rows of lm_head (of embed when tied)
  TensorView final_norm;
  std::vector<RankLayerWeights> layers;
  // Bytes this rank's tensors hold (a tied lm_head counted once).
  size_t bytes() const;

 private:
  TensorView keep(Tensor t);        // takes ownership of t, returns its view
  std::vector<Tensor> storage_;     // the copies: row-parallel shards, padded vocab shards, device tensors
};

}  // namespace tvllm
