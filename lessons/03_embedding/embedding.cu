// Lesson 03, the GPU gather: three kernels from plain to fast, and the launcher that picks one.
//
// A gather does no arithmetic: it reads T rows of the table and writes them out, so the only question
// is how close it gets to the memory system's copy bandwidth. Each version fixes what limited the last:
//   v1  one block per token, each thread copies one element per loop trip (2-byte accesses)
//   v2  the same, but each access moves 16 bytes (one uint4 = 8 bf16): 8x fewer memory instructions
//   v3  one flat grid over every 16-byte chunk of the output, 4 chunks per thread, all 4 loads issued
//       before the first store: more bytes in flight per thread, and no block idles on a short row
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "common/cuda_utils.cuh"  // ceil_div, kWarpSize, pointer_alignment
#include "common/errors.h"
#include "common/exercise.h"
#include "embedding.h"

namespace tvllm {

namespace {

constexpr unsigned long long kNoBadToken = ~0ull;  // the flag's "nothing recorded" value (bytes 0xFF)
constexpr int kMaxThreads = 256;                   // per block for v1/v2: enough warps to hide latency
constexpr int kV3Threads = 256;
constexpr int kV3ChunksPerThread = 4;

[[maybe_unused]]
__device__ __forceinline__ bool id_in_range(int32_t id, int64_t vocab) { return id >= 0 && id < vocab; }

// Keeps the lowest (position, id) pair: position in the high half, so atomicMin orders by position.
[[maybe_unused]]
__device__ __forceinline__ void record_bad_token(unsigned long long* flag, int64_t position, int32_t id) {
  if (flag != nullptr)
    atomicMin(flag, (static_cast<unsigned long long>(position) << 32) | static_cast<uint32_t>(id));
}

// v1: block t copies row ids[t]; thread i copies elements i, i + blockDim, i + 2*blockDim, ...
// Elem is the raw bits of one element (uint16_t for bf16/fp16, uint32_t for fp32): a copy needs no math.
template <class Elem>
__global__ void embedding_v1_kernel(Elem* out,           // [T, hidden]
                                    const int32_t* ids,  // [T]
                                    const Elem* table,   // [vocab, hidden]
                                    int64_t vocab, int64_t hidden, unsigned long long* bad) {
  // --- exercise 03.3: v1, one block per token ----------------------------------------------------------
  // Task: block t copies row ids[t] of the table to row t of out, thread i taking elements i,
  //   i + blockDim.x, ... of the row. An id outside [0, vocab) must not be read: its row of out becomes
  //   zeros, and one thread of the block records it with record_bad_token(bad, t, id).
  // Hint: id_in_range(id, vocab); for a bad id, point src at row 0 (never form a pointer outside the
  //   table) and write Elem(0).
  // Hint: v2 and v3 fall back to this kernel on misaligned views or rows that are not a multiple of 16
  //   bytes (MisalignedViewsFallBackAndStayCorrect, F32AndF16TablesCopyToo).
  // Tests: Embedding03Gpu.V1EqualsTheReference Embedding03Gpu.MisalignedViewsFallBackAndStayCorrect
  // Needs: 03.1
  // Stub: device
  // --- solution ---
  const int64_t t = blockIdx.x;
  const int32_t id = ids[t];
  const bool ok = id_in_range(id, vocab);
  if (!ok && threadIdx.x == 0) record_bad_token(bad, t, id);
  const Elem* src = table + (ok ? id : 0) * hidden;  // a bad id never even forms a pointer outside the table
  Elem* dst = out + t * hidden;
  for (int64_t h = threadIdx.x; h < hidden; h += blockDim.x) dst[h] = ok ? src[h] : Elem(0);
  // --- end of exercise 03.3 ---
}

// v2: as v1, in 16-byte chunks. Needs every row to start on a 16-byte boundary (the launcher checks).
__global__ void embedding_v2_kernel(uint4* out,          // [T, chunks]
                                    const int32_t* ids,  // [T]
                                    const uint4* table,  // [vocab, chunks]
                                    int64_t vocab, int64_t chunks, unsigned long long* bad) {
  // --- exercise 03.4: v2, 16-byte copies ---------------------------------------------------------------
  // Task: v1 on uint4: each access moves one 16-byte chunk (8 bf16). The row has `chunks` chunks; a
  //   bad id's row becomes zero chunks and is recorded, as in v1. The launcher checked that every row
  //   starts on a 16-byte boundary.
  // Hint: make_uint4(0, 0, 0, 0) is +0.0 in every float format.
  // Tests: Embedding03Gpu.V2EqualsTheReference
  // Needs: 03.1
  // Stub: device
  // --- solution ---
  const int64_t t = blockIdx.x;
  const int32_t id = ids[t];
  const bool ok = id_in_range(id, vocab);
  if (!ok && threadIdx.x == 0) record_bad_token(bad, t, id);
  const uint4* src = table + (ok ? id : 0) * chunks;
  uint4* dst = out + t * chunks;
  const uint4 zero = make_uint4(0, 0, 0, 0);  // all-zero bits are +0.0 in every float format
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) dst[c] = ok ? src[c] : zero;
  // --- end of exercise 03.4 ---
}

// v3: the output as one flat array of T * chunks 16-byte chunks; chunk c belongs to token c / chunks.
// Block b covers chunks [b * 1024, (b + 1) * 1024): thread i takes i, i + 256, i + 512, i + 768, so
// each of the 4 steps is one coalesced 4 KB sweep by the block. All 4 loads go out before any store.
// 32-bit indices (the launcher guarantees T * chunks < 2^31): 64-bit division is several times slower.
__global__ void embedding_v3_kernel(uint4* out,          // [T * chunks]
                                    const int32_t* ids,  // [T]
                                    const uint4* table,  // [vocab, chunks]
                                    int64_t vocab, uint32_t chunks, uint32_t total_chunks,
                                    unsigned long long* bad) {
  // --- exercise 03.5: v3, one flat grid, four loads in flight ------------------------------------------
  // Task: out is one flat array of total_chunks 16-byte chunks; chunk c belongs to token c / chunks.
  //   Thread i of block b handles chunks first + k * blockDim.x for k < kV3ChunksPerThread, with
  //   first = b * blockDim.x * kV3ChunksPerThread + i: issue all of its loads into registers, then
  //   all of its stores. Bad ids: zeros, recorded once per token (by the thread of the row's chunk 0).
  // Hint: keep the indices in 32 bits (the launcher guarantees total_chunks < 2^31): 64-bit division
  //   is several times slower. #pragma unroll on both loops keeps data[k] in registers.
  // Tests: Embedding03Gpu.V3EqualsTheReference
  // Tests: Embedding03Gpu.EveryKernelEqualsTheReference Embedding03Gpu.ManyTokensCoverEveryBlockAndTheTail
  // Tests: Embedding03Gpu.F32AndF16TablesCopyToo Embedding03Gpu.BadDeviceIdsThrowAndTheirRowsAreZero
  // Tests: lesson03_embedding.gpu
  // Needs: 03.1 03.3 03.4
  // Stub: device
  // --- solution ---
  const uint32_t first = blockIdx.x * (blockDim.x * kV3ChunksPerThread) + threadIdx.x;
  uint4 data[kV3ChunksPerThread];
#pragma unroll
  for (int k = 0; k < kV3ChunksPerThread; ++k) {  // unrolled: data[k] stays in registers
    const uint32_t c = first + k * blockDim.x;
    data[k] = make_uint4(0, 0, 0, 0);
    if (c < total_chunks) {
      const uint32_t t = c / chunks;
      const uint32_t j = c - t * chunks;  // chunk within the row
      const int32_t id = ids[t];          // neighbours read the same id: one L1 line serves the warp
      if (id_in_range(id, vocab))
        data[k] = table[static_cast<int64_t>(id) * chunks + j];
      else if (j == 0)
        record_bad_token(bad, t, id);  // once per bad token, not once per chunk
    }
  }
#pragma unroll
  for (int k = 0; k < kV3ChunksPerThread; ++k) {
    const uint32_t c = first + k * blockDim.x;
    if (c < total_chunks) out[c] = data[k];
  }
  // --- end of exercise 03.5 ---
}

int threads_for(int64_t work_items) {
  // a whole number of warps, at least one, at most kMaxThreads
  return static_cast<int>(std::min<int64_t>(ceil_div(work_items, kWarpSize) * kWarpSize, kMaxThreads));
}

bool aligned16(const void* p) { return pointer_alignment(p) == 16; }

// Runs the chosen kernel on validated arguments, on `stream`. ids point to device memory.
void launch_embedding(const TensorView& out, const int32_t* ids, const TensorView& table,
                      const EmbeddingShape& s, EmbeddingKernel kernel, unsigned long long* bad,
                      cudaStream_t stream) {
  if (s.tokens == 0) return;  // a grid of zero blocks is a launch error
  const size_t elem = dtype_size(table.dtype);
  const size_t row_bytes = static_cast<size_t>(s.hidden) * elem;
  // 16-byte chunks need every row of both tensors to start on a 16-byte boundary: the row length must be
  // a multiple of 16 bytes and both base pointers aligned. Otherwise v2/v3 fall back to v1.
  const bool chunked = row_bytes % 16 == 0 && aligned16(out.data) && aligned16(table.data);
  const int64_t chunks = static_cast<int64_t>(row_bytes / 16);
  if (kernel == EmbeddingKernel::V3 && chunked && s.tokens * chunks < (int64_t{1} << 31)) {
    const uint32_t total = static_cast<uint32_t>(s.tokens * chunks);
    const uint32_t per_block = kV3Threads * kV3ChunksPerThread;
    const auto blocks = static_cast<uint32_t>(ceil_div(total, per_block));
    embedding_v3_kernel<<<blocks, kV3Threads, 0, stream>>>(out.ptr<uint4>(), ids, table.ptr<const uint4>(), s.vocab,
                                                          static_cast<uint32_t>(chunks), total, bad);
    TVLLM_CHECK_LAUNCH();
  } else if ((kernel == EmbeddingKernel::V2 || kernel == EmbeddingKernel::V3) && chunked) {
    embedding_v2_kernel<<<static_cast<unsigned>(s.tokens), threads_for(chunks), 0, stream>>>(
        out.ptr<uint4>(), ids, table.ptr<const uint4>(), s.vocab, chunks, bad);
    TVLLM_CHECK_LAUNCH();
  } else if (elem == 2) {
    embedding_v1_kernel<uint16_t><<<static_cast<unsigned>(s.tokens), threads_for(s.hidden), 0, stream>>>(
        out.ptr<uint16_t>(), ids, table.ptr<const uint16_t>(), s.vocab, s.hidden, bad);
    TVLLM_CHECK_LAUNCH();
  } else {
    embedding_v1_kernel<uint32_t><<<static_cast<unsigned>(s.tokens), threads_for(s.hidden), 0, stream>>>(
        out.ptr<uint32_t>(), ids, table.ptr<const uint32_t>(), s.vocab, s.hidden, bad);
    TVLLM_CHECK_LAUNCH();
  }
}

void require_grid_fits(const EmbeddingShape& s) {
  // v1/v2 launch one block per token; gridDim.x allows 2^31 - 1.
  TVLLM_REQUIRE(s.tokens < (int64_t{1} << 31),
                "embedding: too many tokens in one call: " + std::to_string(s.tokens));
}

}  // namespace

BadTokenFlag::BadTokenFlag()
    : flag_(sizeof(unsigned long long)), host_(sizeof(unsigned long long), HostBuffer::Kind::Pinned) {
  // Cleared and waited for here, once: whatever stream the flag is used on later finds it clear.
  TVLLM_CUDA_CHECK(cudaMemset(flag_.data(), 0xFF, sizeof(unsigned long long)));
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
}

void BadTokenFlag::clear(cudaStream_t stream) {
  TVLLM_CUDA_CHECK(cudaMemsetAsync(flag_.data(), 0xFF, sizeof(unsigned long long), stream));
}

void BadTokenFlag::check(cudaStream_t stream) {
  // The copy is queued behind the gathers on the stream; waiting for the stream is the synchronisation
  // that embedding() pays on every call and embedding_async() lets the caller place.
  auto* value = host_.as<unsigned long long>();
  TVLLM_CUDA_CHECK(cudaMemcpyAsync(value, flag_.data(), sizeof(unsigned long long), cudaMemcpyDeviceToHost, stream));
  TVLLM_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (*value == kNoBadToken) return;
  const unsigned long long bad = *value;
  clear(stream);
  const int64_t position = static_cast<int64_t>(bad >> 32);
  const int32_t id = static_cast<int32_t>(static_cast<uint32_t>(bad & 0xffffffffu));
  throw InputError("embedding: token id " + std::to_string(id) + " at position " + std::to_string(position) +
                   " is outside the vocabulary [0, " + std::to_string(vocab_) +
                   ") (checked on the GPU; the rows of bad tokens were written as zeros)");
}

void embedding_async(const TensorView& out, const TensorView& ids, const TensorView& table, BadTokenFlag& flag,
                     EmbeddingKernel kernel, cudaStream_t stream) {
  TVLLM_REQUIRE(out.device == Device::CUDA,
                "embedding: out must be on the GPU (the CPU reference is embedding_cpu), got " + out.describe());
  TVLLM_REQUIRE(ids.device == Device::CUDA,
                "embedding: ids must be on the GPU (upload them: Tensor::from_i32(ids, {T}, Device::CUDA)), got " +
                    ids.describe());
  const EmbeddingShape s = check_embedding_args(out, ids, table);
  require_grid_fits(s);
  flag.vocab_ = s.vocab;
  launch_embedding(out, ids.ptr<const int32_t>(), table, s, kernel, flag.device_ptr(), stream);
}

void embedding(const TensorView& out, const TensorView& ids, const TensorView& table, BadTokenFlag& flag,
               EmbeddingKernel kernel, cudaStream_t stream) {
  embedding_async(out, ids, table, flag, kernel, stream);
  flag.check(stream);  // one read-back, one wait: did any id miss the table?
}

}  // namespace tvllm
