// Lesson 17: the vocabulary-parallel lookup: checks, dispatch and the fp32 reference.
#include "vocab_parallel.h"

#include <string>

#include "common/errors.h"

namespace tvllm {

namespace {
void check_args(const TensorView& out, const TensorView& ids, const TensorView& table) {
  TVLLM_REQUIRE(out.rank() == 2 && ids.rank() == 1 && table.rank() == 2 && out.is_contiguous() &&
                    ids.is_contiguous() && table.is_contiguous(),
                "embedding_shard: out [T, hidden], ids [T] and table [rows, hidden], contiguous, got " +
                    out.describe() + ", " + ids.describe() + ", " + table.describe());
  TVLLM_REQUIRE(out.shape[0] == ids.shape[0] && out.shape[1] == table.shape[1] && ids.dtype == DType::I32 &&
                    out.device == ids.device && out.device == table.device,
                "embedding_shard: shapes, dtypes or devices disagree: " + out.describe() + ", " + ids.describe() +
                    ", " + table.describe());
}
}  // namespace

void embedding_shard(const TensorView& out, const TensorView& ids, const TensorView& table, int64_t vocab_begin,
                     cudaStream_t stream) {
  check_args(out, ids, table);
  if (out.device == Device::CPU)
    embedding_shard_cpu(out, ids, table, vocab_begin);
  else
    embedding_shard_cuda(out, ids, table, vocab_begin, stream);
}

void embedding_shard_cpu(const TensorView& out, const TensorView& ids, const TensorView& table, int64_t vocab_begin) {
  check_args(out, ids, table);
  TVLLM_REQUIRE(out.dtype == DType::F32, "embedding_shard_cpu: out must be F32, got " + out.describe());
  const int64_t T = out.shape[0], hidden = out.shape[1], rows = table.shape[0];
  float* dst = out.ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t local = static_cast<int64_t>(ids.ptr<const int32_t>()[t]) - vocab_begin;
    const bool mine = local >= 0 && local < rows;
    for (int64_t h = 0; h < hidden; ++h)
      dst[t * hidden + h] = mine ? load_as_f32(table.data, table.dtype, static_cast<size_t>(local * hidden + h)) : 0.0f;
  }
}

}  // namespace tvllm
