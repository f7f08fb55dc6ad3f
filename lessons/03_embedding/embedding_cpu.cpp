// Lesson 03, the reference: argument checks shared by both paths, and the fp32 gather on the host.
#include <string>

#include "common/errors.h"
#include "common/exercise.h"
#include "embedding.h"

namespace tvllm {

std::string_view embedding_kernel_name(EmbeddingKernel kernel) {
  switch (kernel) {
    case EmbeddingKernel::V1:
      return "v1";
    case EmbeddingKernel::V2:
      return "v2";
    case EmbeddingKernel::V3:
      return "v3";
  }
  return "?";
}

EmbeddingKernel parse_embedding_kernel(std::string_view name) {
  for (EmbeddingKernel k : all_embedding_kernels())
    if (embedding_kernel_name(k) == name) return k;
  throw InputError("unknown embedding kernel '" + std::string(name) + "' (expected v1, v2 or v3)");
}

const std::vector<EmbeddingKernel>& all_embedding_kernels() {
  static const std::vector<EmbeddingKernel> kernels{EmbeddingKernel::V1, EmbeddingKernel::V2,
                                                    EmbeddingKernel::V3};
  return kernels;
}

EmbeddingShape check_embedding_args(const TensorView& out, const TensorView& ids, const TensorView& table) {
  TVLLM_REQUIRE(table.rank() == 2, "embedding: the table must be [vocab, hidden], got " + table.describe());
  TVLLM_REQUIRE(is_floating(table.dtype),
                "embedding: the table must be floating point, got " + table.describe());
  TVLLM_REQUIRE(table.is_contiguous(), "embedding: the table must be contiguous");
  TVLLM_REQUIRE(ids.rank() == 1 && ids.dtype == DType::I32,
                "embedding: ids must be I32 [T], got " + ids.describe());
  TVLLM_REQUIRE(ids.is_contiguous(), "embedding: ids must be contiguous");
  EmbeddingShape s{ids.dim(0), table.dim(0), table.dim(1)};
  TVLLM_REQUIRE(s.vocab > 0 && s.hidden > 0, "embedding: empty table " + table.describe());
  TVLLM_REQUIRE(out.rank() == 2 && out.dim(0) == s.tokens && out.dim(1) == s.hidden,
                "embedding: out must be [" + std::to_string(s.tokens) + ", " + std::to_string(s.hidden) +
                    "] (tokens, hidden), got " + out.describe());
  TVLLM_REQUIRE(out.is_contiguous(), "embedding: out must be contiguous");
  if (out.device == Device::CPU) {
    TVLLM_REQUIRE(table.device == Device::CPU && ids.device == Device::CPU,
                  "embedding: out is on the CPU, so the table and ids must be too (table " +
                      table.describe() + ", ids " + ids.describe() + ")");
    TVLLM_REQUIRE(out.dtype == DType::F32, "embedding: the CPU reference writes F32, got " + out.describe());
  } else {
    TVLLM_REQUIRE(table.device == Device::CUDA,
                  "embedding: out is on the GPU, so the table must be too, got " + table.describe());
    TVLLM_REQUIRE(out.dtype == table.dtype,
                  "embedding: on the GPU out has the table's dtype (a gather copies "
                  "bytes): out " +
                      out.describe() + ", table " + table.describe());
    TVLLM_REQUIRE(
        dtype_size(table.dtype) == 2 || dtype_size(table.dtype) == 4,
        "embedding: the GPU gather handles 2- and 4-byte dtypes (BF16, F16, F32), got " + table.describe());
  }
  TVLLM_REQUIRE(s.tokens == 0 || (out.data && ids.data), "embedding: null out or ids");
  TVLLM_REQUIRE(table.data, "embedding: null table");
  return s;
}

void check_token_ids(const int32_t* ids, int64_t count, int64_t vocab) {
  // --- exercise 03.2: refuse ids outside the table -----------------------------------------------------
  // Task: throw InputError for the first position t whose id is outside [0, vocab), with a message
  //   that names the id, its position and the range: "embedding: token id 9 at position 1 is outside
  //   the vocabulary [0, 5)". The reference calls this before it writes anything.
  // Hint: two comparisons: a negative id passes `id < vocab` alone.
  // Tests: Embedding03.OutOfRangeIdsAreRefusedAndOutIsUntouched Embedding03.FirstBadIdIsNamed
  // Stub:
  //   (void)ids, (void)count, (void)vocab;
  //   throw NotWrittenYet("03.2", "refuse ids outside the table");
  // --- solution ---
  for (int64_t t = 0; t < count; ++t) {
    // One comparison per bound: a negative id would pass `id < vocab` alone.
    if (ids[t] < 0 || ids[t] >= vocab)
      throw InputError("embedding: token id " + std::to_string(ids[t]) + " at position " + std::to_string(t) +
                       " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
  }
  // --- end of exercise 03.2 ---
}

void embedding_cpu(const TensorView& out, const TensorView& ids, const TensorView& table) {
  TVLLM_REQUIRE(out.device == Device::CPU, "embedding_cpu: out must be on the CPU, got " + out.describe());
  const EmbeddingShape s = check_embedding_args(out, ids, table);
  const int32_t* id = ids.ptr<int32_t>();  // [T]
  // Check every id before writing anything: a failed call leaves out untouched.
  check_token_ids(id, s.tokens, s.vocab);
  // --- exercise 03.1: the fp32 gather ------------------------------------------------------------------
  // Task: out[t, :] = table[ids[t], :] widened to fp32, for every token t < s.tokens (the ids are
  //   checked already). out is F32 [T, hidden] on the CPU; the table is [vocab, hidden] in any floating
  //   dtype (BF16 in the course).
  // Hint: load_as_f32(table.data, table.dtype, index) (common/dtype.h) reads element `index` of a raw
  //   buffer of that dtype as fp32; bf16 and fp16 widen exactly, so this is a copy.
  // Hint: compute the row offset id * hidden in size_t (or int64_t): vocab * hidden may pass 2^31.
  // Tests: Embedding03.KnownAnswerF32Table Embedding03.Bf16AndF16TablesWidenExactly
  // Tests: Embedding03.Bf16WideningIsTheTopHalfOfFp32 lesson03_embedding.cpu
  // Stub:
  //   throw NotWrittenYet("03.1", "the fp32 gather");
  // --- solution ---
  float* dst = out.ptr<float>();  // [T, hidden]
  for (int64_t t = 0; t < s.tokens; ++t) {
    const size_t row = static_cast<size_t>(id[t]) * static_cast<size_t>(s.hidden);
    float* out_row = dst + t * s.hidden;
    // bf16 and fp16 widen to fp32 exactly, so this is a copy: the result equals HF's fp32 embed_tokens.
    for (int64_t h = 0; h < s.hidden; ++h) out_row[h] = load_as_f32(table.data, table.dtype, row + h);
  }
  // --- end of exercise 03.1 ---
}

}  // namespace tvllm
