// Lesson 15, step 7: the host side of the paged wgmma flash attention that needs no GPU (flash_paged.h): the
// boxes of a tile, and the checks. The launch is in flash_wgmma_paged.cu.
#include "flash_paged.h"

#include <string>

#include "common/errors.h"

namespace tvllm {

std::string flash_paged_refusal(const AttentionShape& shape, int64_t block_size, int64_t num_slots) {
  if (!flash_wgmma_supports(shape))
    return "head_dim must be 64 or 128, got " + std::to_string(shape.head_dim);
  if (block_size < kFlashPagedMinBlockSize || (block_size & (block_size - 1)) != 0)
    return "the block size must be a power of two of at least " + std::to_string(kFlashPagedMinBlockSize) +
           " (a TMA box per block must start on the 128-byte swizzle's 8-row period), got " +
           std::to_string(block_size);
  if (num_slots < 1 || num_slots > INT32_MAX)
    return "the pool must have 1 .. 2^31 - 1 rows (TMA's row coordinate is 32-bit), got " +
           std::to_string(num_slots);
  return "";
}

std::vector<FlashPagedBox> flash_paged_tile_boxes(int k0, int k_len, int64_t block_size, const int32_t* table,
                                                  int64_t table_len) {
  const std::string refusal = flash_paged_refusal(AttentionShape{1, 1, 64}, block_size, 1);
  TVLLM_REQUIRE(refusal.empty(), "flash_paged_tile_boxes: " + refusal);
  TVLLM_REQUIRE(k0 >= 0 && k0 % kFlashBlockN == 0 && k0 < k_len,
                "flash_paged_tile_boxes: the tile must start at a multiple of 128 before k_len, got k0 " +
                    std::to_string(k0) + ", k_len " + std::to_string(k_len));
  TVLLM_REQUIRE(table_len * block_size >= k_len,
                "flash_paged_tile_boxes: a table of " + std::to_string(table_len) + " blocks of " +
                    std::to_string(block_size) + " does not cover " + std::to_string(k_len) + " keys");
  int shift = 0;
  while ((int64_t{1} << shift) < block_size) ++shift;
  const int bs = static_cast<int>(block_size);
  const int rows = flash_paged_box_rows(bs);
  std::vector<FlashPagedBox> boxes;
  for (int j = 0; j < flash_paged_boxes_loaded(k0, k_len, bs); ++j) {
    const int pos = k0 + j * rows;
    boxes.push_back({j * rows, pos, rows, flash_paged_box_row(table[pos >> shift], pos, shift)});
  }
  return boxes;
}

void check_flash_paged_args(const TensorView& out, const TensorView& q, const TensorView& pool_k,
                            const TensorView& pool_v, const AttentionBatch& batch,
                            const PagedStepTables& tables, const AttentionShape& shape) {
  shape.validate();
  const std::string refusal =
      flash_paged_refusal(shape, tables.block_size(), tables.num_blocks() * tables.block_size());
  TVLLM_REQUIRE(refusal.empty(),
                "flash_wgmma_paged: " + refusal + " (lesson 12's paged_attention() runs the others)");
  for (const TensorView* t : {&q, &out}) {
    const std::string what = std::string("flash_wgmma_paged: ") + (t == &q ? "q" : "out");
    TVLLM_REQUIRE(
        t->dtype == DType::BF16 && t->device == Device::CUDA && t->rank() == 2 && t->strides[1] == 1,
        what + " must be bf16 on cuda with contiguous columns, got " + t->describe());
    TVLLM_REQUIRE(reinterpret_cast<uintptr_t>(t->data) % 16 == 0 && t->strides[0] % 8 == 0,
                  what + " must start 16-byte aligned with rows a multiple of 8 elements apart (TMA), got " +
                      t->describe());
  }
  for (const TensorView* t : {&pool_k, &pool_v}) {
    const std::string what = std::string("flash_wgmma_paged: ") + (t == &pool_k ? "pool_k" : "pool_v");
    TVLLM_REQUIRE(t->rank() == 3 && t->shape[0] == tables.num_blocks() &&
                      t->shape[1] == tables.block_size() && t->shape[2] == shape.kv_dim(),
                  what + " must be one layer of the pool the tables were made for, [" +
                      std::to_string(tables.num_blocks()) + ", " + std::to_string(tables.block_size()) +
                      ", " + std::to_string(shape.kv_dim()) + "], got " + t->describe());
    TVLLM_REQUIRE(t->dtype == DType::BF16 && t->device == Device::CUDA && t->is_contiguous(),
                  what + " must be contiguous bf16 on cuda, got " + t->describe());
    TVLLM_REQUIRE(reinterpret_cast<uintptr_t>(t->data) % 16 == 0, what + " must start 16-byte aligned (TMA)");
  }
  TVLLM_REQUIRE(
      tables.device() == Device::CUDA,
      "flash_wgmma_paged: the PagedStepTables must be made for cuda (the kernel reads the block tables "
      "from the device)");
  check_attention_queries(out, q, batch, shape);  // lesson 07's checks of the batch and the query side
  check_paged_step(batch, tables, "flash_wgmma_paged");
}

}  // namespace tvllm
