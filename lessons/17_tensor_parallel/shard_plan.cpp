// Lesson 17: the shard plan, and cutting one weight into its shards.
#include "shard_plan.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "common/errors.h"
#include "common/exercise.h"

namespace tvllm {

const char* linear_split_name(LinearSplit split) {
  return split == LinearSplit::Columns ? "by columns" : "by rows + all-reduce";
}

namespace {

void require_divides(int64_t count, const char* what, int world_size) {
  TVLLM_REQUIRE(count % world_size == 0,
                "tensor parallel: " + std::string(what) + " = " + std::to_string(count) +
                    " is not a multiple of the tensor-parallel size " + std::to_string(world_size) +
                    " (each rank must hold whole " + what + "); choose a size that divides it");
}

}  // namespace

ShardPlan ShardPlan::make(const ModelConfig& c, int world_size) {
  TVLLM_REQUIRE(world_size >= 1 && world_size <= 64,
                "tensor parallel: the size must be in [1, 64], got " + std::to_string(world_size));
  TVLLM_REQUIRE(!c.has_family_extras() && !c.quantization,
                "tensor parallel: lesson 17 shards plain Llama models; this one has extras (biases, q/k norm, a "
                "sliding window or FP8 weights) whose sharding is described in README 17 but not built");
  require_divides(c.num_attention_heads, "num_attention_heads", world_size);
  // GQA: with whole KV heads per rank, a rank's query heads read only its own KV heads (query head h reads
  // KV head h / group_size, and both ranges are cut at the same fraction). vLLM replicates KV heads when
  // there are fewer than ranks; that is not built here.
  require_divides(c.num_key_value_heads, "num_key_value_heads", world_size);
  require_divides(c.intermediate_size, "intermediate_size", world_size);

  ShardPlan p;
  p.full = c;
  p.world_size = world_size;
  p.padded_vocab = (c.vocab_size + world_size - 1) / world_size * world_size;
  const int64_t heads = c.num_attention_heads / world_size, kv = c.num_key_value_heads / world_size;
  const int64_t inter = c.intermediate_size / world_size, vocab = p.padded_vocab / world_size;
  for (int r = 0; r < world_size; ++r) {
    RankShard s;
    s.rank = r;
    s.q_heads = heads;
    s.head_begin = r * heads;
    s.kv_heads = kv;
    s.kv_head_begin = r * kv;
    s.intermediate = inter;
    s.intermediate_begin = r * inter;
    s.vocab = vocab;
    s.vocab_begin = r * vocab;
    const int64_t real_end = std::min(c.vocab_size, s.vocab_begin + vocab);
    s.vocab_real = std::max<int64_t>(0, real_end - s.vocab_begin);
    p.ranks.push_back(s);
  }
  return p;
}

ModelConfig ShardPlan::rank_config() const {
  ModelConfig c = full;
  c.num_attention_heads = full.num_attention_heads / world_size;
  c.num_key_value_heads = full.num_key_value_heads / world_size;
  c.intermediate_size = full.intermediate_size / world_size;
  c.vocab_size = padded_vocab / world_size;
  return c;
}

std::vector<std::string> ShardPlan::describe() const {
  const ModelConfig& c = full;
  const ModelConfig r = rank_config();
  const int64_t H = c.hidden_size;
  auto line = [&](const char* name, int64_t out, int64_t in, LinearSplit split, int64_t rout, int64_t rin,
                  const char* after) {
    return std::string(name) + " [" + std::to_string(out) + ", " + std::to_string(in) + "] " +
           linear_split_name(split) + " -> [" + std::to_string(rout) + ", " + std::to_string(rin) + "] per rank" +
           after;
  };
  std::vector<std::string> d;
  d.push_back(line("embed_tokens", c.vocab_size, H, LinearSplit::Columns, r.vocab_size, H,
                   padded_vocab != c.vocab_size ? " (vocab padded, masked lookup + all-reduce)"
                                                : " (masked lookup + all-reduce)"));
  d.push_back(line("q_proj", c.q_dim(), H, LinearSplit::Columns, r.q_dim(), H,
                   (" (" + std::to_string(r.num_attention_heads) + " heads)").c_str()));
  d.push_back(line("k_proj, v_proj", c.kv_dim(), H, LinearSplit::Columns, r.kv_dim(), H,
                   (" (" + std::to_string(r.num_key_value_heads) + " KV heads)").c_str()));
  d.push_back(line("o_proj", H, c.q_dim(), LinearSplit::Rows, H, r.q_dim(), ""));
  d.push_back(line("gate_proj, up_proj", c.intermediate_size, H, LinearSplit::Columns, r.intermediate_size, H, ""));
  d.push_back(line("down_proj", H, c.intermediate_size, LinearSplit::Rows, H, r.intermediate_size, ""));
  d.push_back(line("lm_head", c.vocab_size, H, LinearSplit::Columns, r.vocab_size, H, " (logits gathered)"));
  d.push_back("norms [" + std::to_string(H) + "] replicated on every rank");
  return d;
}

TensorView shard_linear(const TensorView& w, LinearSplit split, int rank, int world_size, Tensor& storage) {
  TVLLM_REQUIRE(w.rank() == 2 && w.is_contiguous() && w.device == Device::CPU,
                "shard_linear: a contiguous 2-D host weight is needed, got " + w.describe());
  TVLLM_REQUIRE(world_size >= 1 && rank >= 0 && rank < world_size,
                "shard_linear: rank " + std::to_string(rank) + " is outside a world of " + std::to_string(world_size));
  const int64_t out = w.shape[0], in = w.shape[1];
  // --- exercise 17.1: the sharding of one linear ----------------------------------------------------------
  // Task: return rank `rank`'s shard of W [out, in] (y = x W^T).
  //   Columns (of y): rows [rank*out/N, (rank+1)*out/N) of W, a view into W (W.rows): no copy.
  //   Rows (of W^T, the input): columns [rank*in/N, ...) of W: allocate storage as a host Tensor of W's dtype
  //   [out, in/N] and copy each row's slice into it, bytes unchanged (std::memcpy); return storage's view.
  //   The cut dimension must be a multiple of world_size: TVLLM_REQUIRE with a message naming it.
  // Hint: dtype_size(w.dtype) bytes per element; row o of W starts at byte o * in * dtype_size.
  // Tests: ShardPlan17.ColumnShardIsAViewOfTheRows ShardPlan17.RowShardsConcatenateBackToTheWeight
  // Tests: ShardPlan17.ANonDividingCutIsAnInputError TpSim17.OneRankIsTheReferenceBitForBit
  // Tests: TpSim17.TwoRanksEqualTheReferenceOnARandomModel
  // Stub:
  //   (void)out;
  //   (void)in;
  //   (void)split;
  //   (void)storage;
  //   throw NotWrittenYet("17.1", "the sharding of one linear");
  // --- solution ---
  if (split == LinearSplit::Columns) {
    TVLLM_REQUIRE(out % world_size == 0, "shard_linear: " + std::to_string(out) +
                                             " output columns do not divide into " + std::to_string(world_size) +
                                             " ranks");
    const int64_t n = out / world_size;
    return w.rows(rank * n, n);
  }
  TVLLM_REQUIRE(in % world_size == 0, "shard_linear: " + std::to_string(in) + " input rows do not divide into " +
                                          std::to_string(world_size) + " ranks");
  const int64_t n = in / world_size;
  const size_t elem = dtype_size(w.dtype);
  storage = Tensor::empty({out, n}, w.dtype, Device::CPU);
  const char* src = static_cast<const char*>(w.data);
  char* dst = static_cast<char*>(storage.data());
  for (int64_t o = 0; o < out; ++o)
    std::memcpy(dst + static_cast<size_t>(o * n) * elem, src + static_cast<size_t>(o * in + rank * n) * elem,
                static_cast<size_t>(n) * elem);
  return storage.view();
  // --- end of exercise 17.1 ---
}

TensorView shard_vocab_rows(const TensorView& table, int64_t begin, int64_t rows, Tensor& storage) {
  TVLLM_REQUIRE(table.rank() == 2 && table.is_contiguous() && table.device == Device::CPU,
                "shard_vocab_rows: a contiguous 2-D host table is needed, got " + table.describe());
  const int64_t vocab = table.shape[0], hidden = table.shape[1];
  TVLLM_REQUIRE(begin >= 0 && rows >= 1, "shard_vocab_rows: bad range");
  if (begin + rows <= vocab) return table.rows(begin, rows);
  const size_t elem = dtype_size(table.dtype);
  storage = Tensor::empty({rows, hidden}, table.dtype, Device::CPU);
  std::memset(storage.data(), 0, storage.view().nbytes());  // padding rows: zeros (all-zero bits = +0.0)
  const int64_t real = std::max<int64_t>(0, vocab - begin);
  if (real > 0)
    std::memcpy(storage.data(), static_cast<const char*>(table.data) + static_cast<size_t>(begin * hidden) * elem,
                static_cast<size_t>(real * hidden) * elem);
  return storage.view();
}

}  // namespace tvllm
