// Lesson 15, step 7: the wgmma flash attention over lesson 12's paged KV pool (README.md, "Step 7: prefill
// over cached blocks"). The kernel is flash_wgmma_kernel.cuh with kPaged; this header holds its host side:
// the box arithmetic (constexpr, shared with the kernel and tested on the CPU), the checks, and the API.
//
// flash_wgmma() reads a sequence's keys as consecutive rows of one matrix: a K/V tile of 128 keys is one TMA
// box. In lesson 12's pool, position pos of sequence b lives at row table[b][pos / block_size] * block_size +
// pos % block_size of [num_blocks * block_size, kv_dim]: consecutive only inside a block. A TMA box cannot
// follow a block table, so the producer loads a tile as several boxes, one per cache block:
//
//   tile of 128 keys (block_size 32)          the pool (one layer, [num_blocks * 32 rows, kv_dim])
//   tile rows   0 .. 31  <- box at row table[k0/32 + 0] * 32      block 7  | .. 32 rows .. |
//   tile rows  32 .. 63  <- box at row table[k0/32 + 1] * 32      block 2  | .. 32 rows .. |
//   tile rows  64 .. 95  <- box at row table[k0/32 + 2] * 32      ...
//   tile rows  96 .. 127 <- box at row table[k0/32 + 3] * 32
//
// all completing on the stage's one mbarrier (its expected bytes: every box's). A block of 128 keys or more
// is one box per tile (at row table[pos / block_size] * block_size + pos % block_size). Each box lands at a
// tile row that is a multiple of 8, i.e. of the 128-byte swizzle's period (8 rows = 1024 bytes): TMA swizzles
// by shared-memory address bits, so the boxes together lay the tile out exactly as one 128-row box would, and
// the consumers' wgmma descriptors do not change. That is why block sizes below 8 are refused (they keep
// lesson 12's kernel).
//
// The semantics are lesson 12's paged_attention(): the queries are the last q_len of each sequence's k_len
// positions, query i at k_len - q_len + i sees keys 0 .. its position (only the last `window` with a window).
//
// C++17 (the kernel's .cuh includes it).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "attention.h"
#include "common/tensor.h"
#include "flash_wgmma.h"
#include "hopper_layout.h"  // TVLLM_HOST_DEVICE, kSwizzleBytes
#include "paged_kv.h"

namespace tvllm {

// ---- the boxes of a tile
// ------------------------------------------------------------------------------------
inline constexpr int kFlashPagedMinBlockSize =
    8;  // one swizzle period: smaller blocks keep lesson 12's kernel

// Rows of one box: a whole cache block, or a whole tile when blocks hold a tile or more.
TVLLM_HOST_DEVICE constexpr int flash_paged_box_rows(int block_size) {
  return block_size < kFlashBlockN ? block_size : kFlashBlockN;
}
// Boxes of the tile at key k0 that hold at least one of the sequence's keys (k0 < k_len). The tile's other
// boxes (past the last key) are never loaded: their table entries may not exist.
TVLLM_HOST_DEVICE constexpr int flash_paged_boxes_loaded(int k0, int k_len, int block_size) {
  const int rows = flash_paged_box_rows(block_size);
  const int needed = (k_len - k0 + rows - 1) / rows;
  const int per_tile = kFlashBlockN / rows;
  return needed < per_tile ? needed : per_tile;
}
// The bytes those boxes deliver for one of K or V (what the stage's mbarrier expects): rows x 128 bytes per
// box for each 64-column sub-tile of head_dim.
TVLLM_HOST_DEVICE constexpr uint32_t flash_paged_tile_bytes(int k0, int k_len, int block_size, int head_dim) {
  return static_cast<uint32_t>(flash_paged_boxes_loaded(k0, k_len, block_size)) *
         static_cast<uint32_t>(flash_paged_box_rows(block_size)) * kSwizzleBytes *
         static_cast<uint32_t>(head_dim / 64);
}
// The pool row of the box whose first key is at position pos, given its block's table entry: lesson 12's
// paged_row (block * block_size + offset in the block; the offset is 0 unless blocks are larger than a tile).
TVLLM_HOST_DEVICE constexpr int64_t flash_paged_box_row(int32_t entry, int pos, int block_shift) {
  return (static_cast<int64_t>(entry) << block_shift) + (pos & ((1 << block_shift) - 1));
}

// One box of a tile, as the producer issues it (for the CPU tests and the chapter).
struct FlashPagedBox {
  int tile_row;      // first row of the tile it fills (a multiple of 8)
  int pos;           // position of its first key
  int rows;          // rows it copies
  int64_t pool_row;  // the pool row it starts at
};
// The boxes of the tile at key k0 (a multiple of 128, k0 < k_len) of a sequence with k_len keys and block
// table `table` (table_len entries), in the order the producer issues them. InputError for a block size the
// paged kernel refuses, or when the table does not cover k_len.
std::vector<FlashPagedBox> flash_paged_tile_boxes(int k0, int k_len, int64_t block_size, const int32_t* table,
                                                  int64_t table_len);

// ---- the checks
// --------------------------------------------------------------------------------------------- Why
// flash_wgmma_paged() refuses this shape and pool geometry ("" when it takes it): head_dim 64 or 128; a block
// size that is a power of two (lesson 12's pools are) of at least 8; a pool of fewer than 2^31 rows (TMA's
// row coordinate is a signed 32-bit number).
std::string flash_paged_refusal(const AttentionShape& shape, int64_t block_size, int64_t num_slots);

// Every check that needs no GPU: the shape and geometry above, q and out as flash_wgmma() wants them
// ([total_q, q_dim] bf16 CUDA, rows 16-byte aligned), pool_k and pool_v as one layer of a CUDA PagedKvPool
// made for the tables
// ([num_blocks, block_size, kv_dim] bf16, contiguous, 16-byte aligned), tables on CUDA, and lesson 12's
// check_paged_step (a table per sequence covering its keys, every new token's slot where its table says).
// InputError naming the problem.
void check_flash_paged_args(const TensorView& out, const TensorView& q, const TensorView& pool_k,
                            const TensorView& pool_v, const AttentionBatch& batch,
                            const PagedStepTables& tables, const AttentionShape& shape);

// ---- the API
// ------------------------------------------------------------------------------------------------ Whether
// flash_wgmma_paged.cu compiled the paged kernel for this variant (the defaults of flash_default_config are:
// m64x2 and m192 for head_dim 64, m128 and m128-heads for 128).
bool flash_wgmma_paged_has_config(int64_t head_dim, const FlashConfig& config);

// paged_attention()'s prefill (lesson 12) on the wgmma kernel: out [total_q, q_dim] from q and one layer's
// pool (PagedKvPool::k(layer), v(layer)) through tables, for every sequence of the batch (decode-sized ones
// included: a single query row is a tile too). The new tokens' keys must already be in the pool
// (paged_kv_write). Needs hopper_available() and flash_paged_refusal() == ""; InputError otherwise, before
// any launch. Runs on `stream`, allocates nothing. As flash_wgmma(): the tensor maps hold the views'
// addresses, so a captured graph must replay with the same q, out and pool; the tables and lengths are read
// from the device (they may change in place). The first form runs flash_default_config(head_dim,
// batch.max_q_len()).
void flash_wgmma_paged(const TensorView& out, const TensorView& q, const TensorView& pool_k,
                       const TensorView& pool_v, const AttentionBatch& batch, const PagedStepTables& tables,
                       const AttentionShape& shape, cudaStream_t stream = nullptr);
void flash_wgmma_paged(const TensorView& out, const TensorView& q, const TensorView& pool_k,
                       const TensorView& pool_v, const AttentionBatch& batch, const PagedStepTables& tables,
                       const AttentionShape& shape, cudaStream_t stream, const FlashConfig& config);

}  // namespace tvllm
