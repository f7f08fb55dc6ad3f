// Lesson 17: how a Llama model is cut across N GPUs (Megatron-style tensor parallelism), as data.
//
//   ShardPlan plan = ShardPlan::make(config, world_size);   // InputError when a count does not divide
//   plan.ranks[r].q_heads, .kv_heads, .intermediate, .vocab_begin ...
//
// Every linear layer y = x W^T (W stored [out, in], as Hugging Face does) is cut one of two ways:
//   by COLUMNS of y (Megatron's "column parallel"): rank r keeps rows [r*out/N, (r+1)*out/N) of W, and
//     computes its own slice of y in full. q/k/v (whole heads), gate and up (whole intermediate columns),
//     and the lm_head (whole vocabulary entries) are cut this way. No communication: every output element
//     is the same dot product as before, so it is bit for bit the unsharded one.
//   by ROWS of W^T, i.e. the INPUT dimension ("row parallel"): rank r keeps columns [r*in/N, ...) of W and
//     multiplies its slice of x by them: a PARTIAL sum of every output element. o_proj and down_proj are cut
//     this way, right after a column-parallel layer whose output slice is exactly their input slice; an
//     all-reduce (sum) then gives every rank the full y. Only here does the summation order change.
// So each decoder block needs exactly two all-reduces: after o_proj and after down_proj (README 17).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/tensor.h"
#include "model_config.h"

namespace tvllm {

// How one linear layer's weight [out, in] is cut.
enum class LinearSplit {
  Columns,  // of the output: rank r keeps W's rows [r*out/N, (r+1)*out/N)           (q, k, v, gate, up, lm_head)
  Rows,     // of the input:  rank r keeps W's columns [r*in/N, (r+1)*in/N) + all-reduce (o_proj, down_proj)
};
const char* linear_split_name(LinearSplit split);

// What one rank holds.
struct RankShard {
  int rank = 0;
  int64_t q_heads = 0, kv_heads = 0;  // attention heads of this rank (whole heads, GQA groups kept together)
  int64_t head_begin = 0, kv_head_begin = 0;
  int64_t intermediate = 0, intermediate_begin = 0;  // the MLP's columns of this rank
  int64_t vocab = 0, vocab_begin = 0;  // vocabulary rows of the embedding and lm_head: padded count per rank,
  int64_t vocab_real = 0;              // and how many of them are real (the last ranks may hold padding only)
};

struct ShardPlan {
  ModelConfig full;           // the unsharded model
  int world_size = 1;
  int64_t padded_vocab = 0;   // vocab_size rounded up to a multiple of world_size
  std::vector<RankShard> ranks;

  // InputError (naming the count and the world size) unless world_size >= 1 and it divides the attention
  // heads, the KV heads and intermediate_size; the vocabulary is padded instead. Plain Llama only: biases, q/k
  // norm and sliding windows are refused (their sharding is written down in README 17, not built).
  static ShardPlan make(const ModelConfig& config, int world_size);

  // The config a rank's engine pieces are sized with: heads, KV heads, intermediate and vocab of one rank
  // (hidden, head_dim, rope, eps unchanged). What lesson 08's Workspace and AttentionShape are built from.
  ModelConfig rank_config() const;

  // One line per tensor kind: "q_proj [384, 336] by columns -> [192, 336] per rank", for the lesson's printout.
  std::vector<std::string> describe() const;
};

// The shard of one weight W [out, in] (host, any floating dtype) that rank `rank` of `world_size` holds:
//   Columns: W's rows [rank*out/N, ...): a view into W itself (its bytes, no copy: for a mapped checkpoint
//            the rank reads only its own rows of the file);
//   Rows:    W's columns [rank*in/N, ...): not contiguous in W, so copied row by row, bytes unchanged
//            (no rounding), into `storage`, which the returned view points into.
// InputError when the dimension cut is not a multiple of world_size.
TensorView shard_linear(const TensorView& w, LinearSplit split, int rank, int world_size, Tensor& storage);

// A vocabulary-parallel table (embedding, lm_head) [vocab, hidden]: rows [begin, begin + rows) with rows
// beyond the real vocabulary filled with zeros (the padding). A view into `table` when no padding is needed,
// else a copy in `storage`.
TensorView shard_vocab_rows(const TensorView& table, int64_t begin, int64_t rows, Tensor& storage);

}  // namespace tvllm
