// Lesson 03: the embedding gather. A token id picks one row of the embedding table.
//
//   out[t, :] = table[ids[t], :]      out [T, hidden], ids I32 [T], table [vocab, hidden]
//
// Two paths:
//   embedding_cpu               the fp32 reference (the oracle): out is F32, the table any floating dtype
//                               (BF16 widens exactly)
//   embedding, embedding_async  the GPU: a copy kernel; out has the table's dtype (BF16 in the course;
//                               F16 and F32 work too, since a gather only moves bytes)
//
// A token id outside [0, vocab) is an InputError, never an out-of-bounds read. The CPU reference checks
// host ids before anything runs. On the GPU the ids are on the GPU and the kernel checks them itself: it
// writes zeros for a bad token and records the first bad position in a BadTokenFlag, device memory that
// the CALLER allocates once and passes to every call (README "Checking ids"). embedding() reads the flag
// back at once (one host-device synchronisation per call); embedding_async() leaves it to the caller,
// who checks once per step when it synchronises anyway. Neither allocates anything per call.
//
// C++17: this header is included by embedding.cu.
#pragma once

#include <cuda_runtime.h>  // cudaStream_t

#include <cstdint>
#include <string_view>
#include <vector>

#include "common/buffer.h"
#include "common/tensor.h"

namespace tvllm {

enum class EmbeddingKernel {
  V1,  // one block per token, a loop over hidden: several elements per thread
  V2,  // one block per token, 16-byte vector copies (8 bf16 per load and store)
  V3,  // a flat grid over all (token, 16-byte chunk) pairs, 4 independent loads in flight per thread
};
inline constexpr EmbeddingKernel kDefaultEmbeddingKernel = EmbeddingKernel::V3;

std::string_view embedding_kernel_name(EmbeddingKernel kernel);  // "v1", "v2", "v3"
EmbeddingKernel parse_embedding_kernel(std::string_view name);   // throws InputError for anything else
const std::vector<EmbeddingKernel>& all_embedding_kernels();     // v1, v2, v3

// The sizes both paths agree on, after checking ranks, shapes, dtypes and contiguity (InputError).
struct EmbeddingShape {
  int64_t tokens = 0;  // T
  int64_t vocab = 0;
  int64_t hidden = 0;
};
EmbeddingShape check_embedding_args(const TensorView& out, const TensorView& ids, const TensorView& table);

// Throws InputError naming the first id outside [0, vocab) and its position. ids: I32 on the host.
void check_token_ids(const int32_t* ids, int64_t count, int64_t vocab);

// The fp32 reference on the host: out F32 on the CPU, ids and table on the CPU (any float dtype).
void embedding_cpu(const TensorView& out, const TensorView& ids, const TensorView& table);

class BadTokenFlag;

// The GPU stage, checked: out, ids and table on the GPU. Gathers on `stream`, then flag.check(stream):
// waits for the stream and throws InputError naming the first bad id (whose rows are zeros in out).
// One synchronisation per call and nothing else: no allocation.
void embedding(const TensorView& out, const TensorView& ids, const TensorView& table, BadTokenFlag& flag,
               EmbeddingKernel kernel = kDefaultEmbeddingKernel, cudaStream_t stream = nullptr);

// The engine's path: the same gather queued on `stream`, returning without waiting. Bad ids never cause
// an out-of-bounds read (their rows become zeros); the first one is recorded in `flag`, which the caller
// checks later with flag.check(stream) - e.g. once per decode step, beside the synchronisation it needs
// anyway. No allocation and no synchronisation: it can be captured in a CUDA graph.
void embedding_async(const TensorView& out, const TensorView& ids, const TensorView& table, BadTokenFlag& flag,
                     EmbeddingKernel kernel = kDefaultEmbeddingKernel, cudaStream_t stream = nullptr);

// 8 bytes of device memory holding (position << 32 | id) of the lowest-position bad token seen since the
// last clear, or all ones when there was none. The kernel updates it with atomicMin, so the error names
// the first bad token whatever order the blocks ran in. Allocate one per stream that embeds (an engine:
// one, at start-up) and reuse it for every call.
class BadTokenFlag {
 public:
  BadTokenFlag();  // allocates (cudaMalloc, once) and clears, waiting for the clear: set-up, not a step
  unsigned long long* device_ptr() const { return flag_.as<unsigned long long>(); }
  // Queues a reset to "nothing recorded" on `stream` (cudaMemsetAsync); returns without waiting.
  void clear(cudaStream_t stream = nullptr);
  // Copies the flag to the host on `stream` and waits for the stream (the kernels queued before it
  // included). If a launch since the last clear met a bad id: queues clear(stream) and throws InputError
  // naming the id and its position.
  void check(cudaStream_t stream = nullptr);

 private:
  friend void embedding_async(const TensorView&, const TensorView&, const TensorView&, BadTokenFlag&,
                              EmbeddingKernel, cudaStream_t);
  DeviceBuffer flag_;  // [1] unsigned long long
  HostBuffer host_;    // [1] unsigned long long, pinned: the read-back lands here
  int64_t vocab_ = 0;  // of the last launch, for the message
};

}  // namespace tvllm
