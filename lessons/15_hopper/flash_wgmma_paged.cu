// Lesson 15, step 7: the paged wgmma flash attention, launched (flash_paged.h has the contract and the box
// arithmetic; flash_wgmma_kernel.cuh's kPaged the kernel's two changes). In a file of its own so that the
// paged instantiations compile beside, not inside, flash_wgmma.cu's fourteen.
#include <cuda_bf16.h>

#include <string>

#include "common/cuda_utils.cuh"  // ceil_div
#include "common/errors.h"
#include "flash_paged.h"
#include "flash_wgmma_kernel.cuh"
#include "hopper.h"
#include "paged_kv_policy.cuh"  // block_shift_of
#include "tensor_map.h"

namespace tvllm {
namespace {

using flash_detail::flash_wgmma_kernel;
using flash_detail::FlashWgmmaParams;
using flash_detail::flash_common_params;
using flash_detail::flash_grid;
using flash_detail::flash_opt_in_once;

template <int D, int kConsumers>
void launch_flash_wgmma_paged(const TensorView& out, const TensorView& q, const TensorView& pool_k,
                              const TensorView& pool_v, const AttentionBatch& batch,
                              const PagedStepTables& tables, const AttentionShape& shape, bool heads_inner,
                              cudaStream_t stream) {
  constexpr int kBlockM = 64 * kConsumers;
  constexpr int smem = flash_smem_bytes(D, kBlockM, false);
  const auto kernel = flash_wgmma_kernel<D, kConsumers, false, false, false, true>;
  flash_opt_in_once<flash_wgmma_kernel<D, kConsumers, false, false, false, true>>(smem);
  // Q as in flash_wgmma(); K and V: the whole layer of the pool as one matrix [num_blocks * block_size,
  // kv_dim], copied in boxes of one cache block (or one tile, for blocks of 128 keys and more).
  const int64_t bs = tables.block_size(), slots = tables.num_blocks() * bs;
  const auto box_rows = static_cast<uint32_t>(flash_paged_box_rows(static_cast<int>(bs)));
  const CUtensorMap map_q = make_tensor_map_bf16_2d(q.data, batch.total_q(), shape.q_dim(), q.strides[0] * 2,
                                                    kBlockM, 64, TmaSwizzle::B128);
  const CUtensorMap map_k = make_tensor_map_bf16_2d(pool_k.data, slots, shape.kv_dim(), shape.kv_dim() * 2,
                                                    box_rows, 64, TmaSwizzle::B128);
  const CUtensorMap map_v = make_tensor_map_bf16_2d(pool_v.data, slots, shape.kv_dim(), shape.kv_dim() * 2,
                                                    box_rows, 64, TmaSwizzle::B128);
  FlashWgmmaParams p = flash_common_params(out, batch, shape, heads_inner);
  p.block_tables = tables.device_block_tables();
  p.table_stride = tables.max_blocks_per_seq();
  p.block_shift = block_shift_of(bs);
  const dim3 grid = flash_grid(batch, shape, kBlockM, heads_inner);
  kernel<<<grid, 128 * (1 + kConsumers), smem, stream>>>(map_q, map_k, map_v, p);
  TVLLM_CHECK_LAUNCH();
}

// The compiled paged variants: the configs flash_default_config() picks (no overlap, plain schedule, P in
// registers), per (head_dim, consumer warpgroups). Another config is refused (InputError).
struct PagedVariant {
  int d, consumers;
  void (*launch)(const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                 const AttentionBatch&, const PagedStepTables&, const AttentionShape&, bool, cudaStream_t);
};
constexpr PagedVariant kPagedVariants[] = {
    {64, 1, launch_flash_wgmma_paged<64, 1>},    // m64x2
    {64, 3, launch_flash_wgmma_paged<64, 3>},    // m192
    {128, 2, launch_flash_wgmma_paged<128, 2>},  // m128, m128-heads
};

const PagedVariant* find_paged_variant(int64_t head_dim, const FlashConfig& c) {
  if (c.overlap || c.p_smem || c.schedule != FlashSchedule::Plain) return nullptr;
  for (const PagedVariant& v : kPagedVariants)
    if (v.d == head_dim && 64 * v.consumers == c.block_m) return &v;
  return nullptr;
}

}  // namespace

bool flash_wgmma_paged_has_config(int64_t head_dim, const FlashConfig& config) {
  return find_paged_variant(head_dim, config) != nullptr;
}

void flash_wgmma_paged(const TensorView& out, const TensorView& q, const TensorView& pool_k,
                       const TensorView& pool_v, const AttentionBatch& batch, const PagedStepTables& tables,
                       const AttentionShape& shape, cudaStream_t stream, const FlashConfig& config) {
  check_flash_paged_args(out, q, pool_k, pool_v, batch, tables, shape);
  const PagedVariant* variant = find_paged_variant(shape.head_dim, config);
  TVLLM_REQUIRE(variant != nullptr, std::string("flash_wgmma_paged: config ") + config.name +
                                        " is not compiled for the paged pool at head_dim " +
                                        std::to_string(shape.head_dim) +
                                        " (flash_wgmma_paged.cu's kPagedVariants)");
  require_hopper("flash_wgmma_paged");
  if (batch.total_q() == 0) return;  // no query anywhere
  variant->launch(out, q, pool_k, pool_v, batch, tables, shape, config.order == FlashOrder::HeadsInner,
                  stream);
}

void flash_wgmma_paged(const TensorView& out, const TensorView& q, const TensorView& pool_k,
                       const TensorView& pool_v, const AttentionBatch& batch, const PagedStepTables& tables,
                       const AttentionShape& shape, cudaStream_t stream) {
  TVLLM_REQUIRE(flash_wgmma_supports(shape), "flash_wgmma_paged: head_dim must be 64 or 128, got " +
                                                 std::to_string(shape.head_dim) +
                                                 " (lesson 12's paged_attention() runs the others)");
  flash_wgmma_paged(out, q, pool_k, pool_v, batch, tables, shape, stream,
                    flash_default_config(shape.head_dim, batch.max_q_len()));
}

}  // namespace tvllm
