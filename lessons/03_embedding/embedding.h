// Lesson 03: the embedding gather. A token id picks one row of the embedding table.
//
//   out[t, :] = table[ids[t], :]      out [T, hidden], ids I32 [T], table [vocab, hidden]
//
// The device of `out` decides the path:
//   CPU   the fp32 reference (the oracle): out is F32, the table any floating dtype (BF16 widens exactly)
//   CUDA  a copy kernel: out has the table's dtype (BF16 in the course; F16 and F32 work too, since a
//         gather only moves bytes)
//
// A token id outside [0, vocab) is an InputError, never an out-of-bounds read. Ids on the host are checked
// before anything runs. Ids already on the GPU are checked by the kernel itself: it writes zeros for a
// bad token, records the first bad position in a BadTokenFlag, and the caller reads the flag back.
// embedding() does that read-back for you (one host-device synchronisation per call); embedding_async()
// leaves it to the caller, who checks once per step when it synchronises anyway (README: "checking ids").
//
// C++17: this header is included by embedding.cu.
#pragma once

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

// The whole stage. Writes every row of out, or throws InputError (bad id, bad shapes) - on the GPU with
// device ids, out holds zeros in the rows of bad tokens after the throw.
void embedding(const TensorView& out, const TensorView& ids, const TensorView& table,
               EmbeddingKernel kernel = kDefaultEmbeddingKernel);

// The fp32 reference on the host (what embedding() runs when out is on the CPU).
void embedding_cpu(const TensorView& out, const TensorView& ids, const TensorView& table);

class BadTokenFlag;

// GPU only, ids on the GPU: launches the gather and returns without waiting. Bad ids never cause an
// out-of-bounds read (their rows become zeros); the first one is recorded in `flag`, which the caller
// checks later with flag.check() - e.g. once per decode step, beside the synchronisation it needs anyway.
void embedding_async(const TensorView& out, const TensorView& ids, const TensorView& table,
                     BadTokenFlag& flag, EmbeddingKernel kernel = kDefaultEmbeddingKernel);

// 8 bytes of device memory holding (position << 32 | id) of the lowest-position bad token seen since the
// last check, or all ones when there was none. The kernel updates it with atomicMin, so the error names
// the first bad token whatever order the blocks ran in.
class BadTokenFlag {
 public:
  BadTokenFlag();  // allocates and clears (cudaMalloc + cudaMemset)
  unsigned long long* device_ptr() const { return flag_.as<unsigned long long>(); }
  // Copies the flag to the host (waiting for the GPU work before it), clears it, and throws InputError
  // naming the bad id and its position if a launch since the last check met one.
  void check();
  void clear();

 private:
  friend void embedding_async(const TensorView&, const TensorView&, const TensorView&, BadTokenFlag&,
                              EmbeddingKernel);
  DeviceBuffer flag_;
  int64_t vocab_ = 0;  // of the last launch, for the message
};

}  // namespace tvllm
