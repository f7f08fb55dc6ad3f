// Lesson 14: the megakernel's program, planned on the host (megakernel.h tells the whole story).
//
// The megakernel streams every weight byte of a decode step through a ring of shared-memory stages, one block
// per SM. Which bytes each block streams, in which order, is decided ONCE on the host and stored as a flat list
// of chunks per block: the "program". Both halves of a block read the same list: the producer warp issues one
// bulk copy per chunk (two for gate|up), the consumer warps multiply each chunk with the activation vector.
//
//   phase p (one weight matrix, N output rows of K columns)
//     outputs 0 ..................................................... N-1
//     block   |  0  |  1  |  2  | ... | G-1 |        contiguous, balanced: block b owns [N*b/G, N*(b+1)/G)
//     chunks  |c|c|c|                             each chunk: whole rows that fit a stage (at most max_rows),
//                                                 or, when ONE row is bigger than a stage, a slice of one row's
//                                                 columns [k0, k0+kc) (the consumer then sums the slices in order)
//
// Two consumer schemes read the program (README section 14, "Per-warp stages"):
//   shared stages (warps == 0, the first version)  every consumer warp works on every chunk, then they meet at a
//                                                   named barrier: one chunk at a time per block
//   per-warp stages (warps = W > 0)                 each chunk has ONE owner warp, which computes its rows
//                                                   alone and frees its stage itself: W chunks in flight. A
//                                                   "task" (one whole-row chunk, or all slices of one row) goes
//                                                   to warp task % W, the task counter running on across the
//                                                   block's phases; a row's slices stay with one warp, in order,
//                                                   so its partial sums meet in registers in a fixed order.
//   The warp lists (warp_chunks) are copies of the block's chunks, each warp's own in program order.
//
// The ring (S stages, each with a `full` and an `empty` mbarrier). Every chunk names its stage and which fill of
// that stage it is: (slot, round). An mbarrier remembers only the PARITY of its completed phases, so a waiter
// that asks for round r (parity r & 1) is answered correctly only if, when it starts waiting, the stage has been
// filled r or r + 1 times, never r - 1: one fill behind looks the same as one ahead. Hence the rule:
//   shared stages     slot = seq % S, round = seq / S: one consumer (all warps together) reads the stages in
//                     program order, so it never waits for a stage whose previous fill it has not read.
//   per-warp stages   each stage is OWNED by one warp (stage s by warp s % W, so S >= W): warp w's i-th chunk
//                     (counted across the block's phases) goes to its (i mod k_w)-th stage, round i div k_w, k_w
//                     its number of stages. A warp reads its stages' fills in order, so round r - 1 was read
//                     (and had landed) before it waits for round r. The first version used seq % S for both
//                     schemes: a stage's consecutive fills then belonged to different warps, and a warp running
//                     ahead could wait for round r while round r - 1 had not landed, and pass on the wrong
//                     parity (tests/test_14_megakernel_ring.cpp simulates the ring and shows it).
// The producer waits on `empty` with parity (round & 1) ^ 1 before fill `round` (each fill is freed by one
// arrival); the reader waits on `full` with parity round & 1.
//
// A "paired" matrix is gate|up: output j needs rows j and N + j of a [2N, K] weight (the stage holds the gate
// rows, then the up rows), so it counts 2 rows per output.
//
// Host-only, no CUDA: tested on the CPU (tests/test_14_megakernel.cpp; the ring: tests/test_14_megakernel_ring.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace tvllm {

// One weight phase: N outputs, each K elements of elem_bytes (2: bf16) per row, 1 or 2 (paired) rows.
struct MkMatrix {
  int64_t outputs = 0;
  int64_t K = 0;
  int64_t elem_bytes = 2;
  bool paired = false;
};

// One chunk of a block's program. Plain 32-bit fields: it is copied to the GPU as is (megakernel.cu reads it).
struct MkChunk {
  uint32_t phase = 0;  // index into the plan's matrices
  uint32_t row0 = 0;   // first output of the chunk
  uint32_t rows = 0;   // outputs in the chunk (>= 1)
  uint32_t k0 = 0;     // first column (elements)
  uint32_t kc = 0;     // columns (elements); == K unless a row is split
  uint32_t flags = 0;  // kMkFirstSlice | kMkLastSlice
  uint32_t seq = 0;    // position in the block's program (the producer's order)
  uint32_t warp = 0;   // the owner warp (per-warp stages); 0 for shared stages
  uint32_t slot = 0;   // the ring stage it is streamed into
  uint32_t round = 0;  // which fill of that stage it is (0, 1, ...): the mbarriers' parity is round & 1
};
inline constexpr uint32_t kMkFirstSlice = 1;  // k0 == 0: the consumer starts the row's sum
inline constexpr uint32_t kMkLastSlice = 2;   // k0 + kc == K: the row's sum is complete, run the epilogue

class MegakernelPlan {
 public:
  // blocks: one per SM (>= 1). stage_bytes: one ring stage (a multiple of 16, >= 16). stages: the ring's stages
  // (>= 1; per-warp stages: >= warps, one at least per owner). max_rows: outputs per chunk at most (the consumer
  // has one epilogue thread per stage row; per-warp stages: one lane per output, so at most 32). warps: 0 for
  // shared stages, else the consumer warps that own chunks. InputError for bad arguments: a K that is not a whole
  // number of 16-byte packs (K * elem_bytes % 16 != 0), a non-positive size, fewer stages than warps.
  MegakernelPlan(std::vector<MkMatrix> matrices, int blocks, int64_t stage_bytes, int stages, int max_rows,
                 int warps = 0);

  int blocks() const { return blocks_; }
  int phases() const { return static_cast<int>(matrices_.size()); }
  int64_t stage_bytes() const { return stage_bytes_; }
  int stages() const { return stages_; }
  const std::vector<MkMatrix>& matrices() const { return matrices_; }

  // Every chunk, block after block, each block's chunks in phase order.
  const std::vector<MkChunk>& chunks() const { return chunks_; }
  // [blocks * (phases + 1)]: block b's chunks of phase p are chunks()[begin(b, p) .. begin(b, p + 1)).
  const std::vector<uint32_t>& begins() const { return begins_; }
  uint32_t begin(int block, int phase) const { return begins_[static_cast<size_t>(block) * (phases() + 1) + phase]; }

  // Per-warp stages (warps() > 0): warp w of block b's chunks of phase p, in program order, are
  // warp_chunks()[warp_begin(b, w, p) .. warp_begin(b, w, p + 1)). Empty for shared stages.
  int warps() const { return warps_; }
  const std::vector<MkChunk>& warp_chunks() const { return warp_chunks_; }
  // [blocks * warps * (phases + 1)]
  const std::vector<uint32_t>& warp_begins() const { return warp_begins_; }
  uint32_t warp_begin(int block, int warp, int phase) const {
    return warp_begins_[(static_cast<size_t>(block) * warps_ + warp) * (phases() + 1) + phase];
  }

  // The outputs of phase p that block b owns: [first, last).
  static int64_t first_output(int64_t outputs, int blocks, int block) { return outputs * block / blocks; }

  // Bytes a chunk's stage holds (both halves for a paired matrix); always <= stage_bytes, a multiple of 16.
  int64_t chunk_bytes(const MkChunk& c) const;
  // Weight bytes block b streams in all (for the balance check and the chapter).
  int64_t block_bytes(int block) const;

 private:
  void assign_ring(size_t first);  // the (slot, round) of the block whose chunks start at chunks_[first]

  std::vector<MkMatrix> matrices_;
  int blocks_ = 0;
  int64_t stage_bytes_ = 0;
  int stages_ = 0;
  int warps_ = 0;
  std::vector<MkChunk> chunks_;
  std::vector<uint32_t> begins_;
  std::vector<MkChunk> warp_chunks_;
  std::vector<uint32_t> warp_begins_;
};

}  // namespace tvllm
