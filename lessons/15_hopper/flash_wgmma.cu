// Lesson 15, steps 5 and 6: flash attention on wgmma + TMA, the host side. README.md, "Step 5: flash
// attention on wgmma" and "Step 6: making it fast"; flash_wgmma.h has the contract, the tiling and the
// variants (FlashConfig); flash_wgmma_kernel.cuh the kernel. Here: the launch of each compiled variant, the
// checks, the engine hook, and a diagnostic kernel for the second product alone.
#include <cuda_bf16.h>

#include <iterator>
#include <string>

#include "common/cuda_utils.cuh"  // pack_bf16x2, ceil_div
#include "common/errors.h"
#include "flash_wgmma.h"
#include "flash_wgmma_kernel.cuh"
#include "hopper.cuh"
#include "hopper.h"
#include "tensor_map.h"

namespace tvllm {
namespace {

using flash_detail::flash_wgmma_kernel;
using flash_detail::FlashWgmmaParams;
using flash_detail::flash_common_params;
using flash_detail::flash_grid;
using flash_detail::flash_opt_in_once;
using flash_detail::kKvSubTileBytes;  // [128 rows][64 bf16]: 16 KB
static_assert(flash_smem_bytes(128, 192, true) <= 227 * 1024,
              "Hopper gives a block at most 227 KB of shared memory");

// ---- the second product alone: D [64 x N] = P [64 x 128] V [128 x N], P from registers -------------------
// A diagnostic for step 5's two riskiest layouts, each on its own: the register A fragment (read here
// straight from global memory by a_fragment_position(), not converted from an accumulator) and V's MN-major
// descriptor (V loaded by TMA exactly as the attention kernel loads it).
template <int N>
__global__ void __launch_bounds__(128)
    wgmma_pv_tile_kernel(const __grid_constant__ CUtensorMap map_v, const __nv_bfloat16* p, float* d) {
#if TVLLM_HOPPER_DEVICE
  __shared__ __align__(1024) unsigned char v_tile[N / 64 * kKvSubTileBytes];  // [128 keys][64 dims] x N/64
  __shared__ uint64_t arrived;
  const int t = threadIdx.x;
  if (t == 0) {
    mbarrier_init(&arrived, 1);
    fence_barrier_init();
  }
  __syncthreads();
  if (t == 0) {
    mbarrier_arrive_expect_tx(&arrived, sizeof(v_tile));
    for (int sub = 0; sub < N / 64; ++sub)
      tma_load_2d(v_tile + sub * kKvSubTileBytes, &map_v, 64 * sub, 0, &arrived);
  }
  uint32_t pa[kFlashBlockN / 16][4];  // value j of step kk: P [row, 16 kk + col], two bf16 per register
#pragma unroll
  for (int kk = 0; kk < kFlashBlockN / 16; ++kk)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const FragmentPosition f = a_fragment_position(t, 2 * j);  // value 2j + 1 is the next column
      pa[kk][j] = *reinterpret_cast<const uint32_t*>(p + f.row * kFlashBlockN + 16 * kk + f.col);
    }
  float acc[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = 0.0f;
  mbarrier_wait(&arrived, 0);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kFlashBlockN / 16; ++kk) {
    if constexpr (N == 64)
      wgmma_m64n64k16_rs(acc, pa[kk], sw128_mnmajor_descriptor(smem_address(v_tile), kKvSubTileBytes, kk));
    else
      wgmma_m64n128k16_rs(acc, pa[kk], sw128_mnmajor_descriptor(smem_address(v_tile), kKvSubTileBytes, kk));
  }
  wgmma_commit_group();
  wgmma_wait_group<0>();
  fence_accumulators(acc);
#pragma unroll
  for (int kk = 0; kk < kFlashBlockN / 16; ++kk) fence_operands(pa[kk]);
#pragma unroll
  for (int i = 0; i < N / 2; ++i) {
    const FragmentPosition f = accumulator_position(t, i);
    d[f.row * N + f.col] = acc[i];
  }
#else
  (void)map_v, (void)p, (void)d;
#endif
}

template <int D, int kConsumers, bool kOverlap, bool kPingPong, bool kPSmem = false>
void launch_flash_wgmma(const TensorView& out, const TensorView& q, const TensorView& k, const TensorView& v,
                        const AttentionBatch& batch, const AttentionShape& shape, bool heads_inner,
                        cudaStream_t stream) {
  constexpr int kBlockM = 64 * kConsumers;
  constexpr int smem = flash_smem_bytes(D, kBlockM, kPSmem);
  const auto kernel = flash_wgmma_kernel<D, kConsumers, kOverlap, kPingPong, kPSmem>;
  flash_opt_in_once<flash_wgmma_kernel<D, kConsumers, kOverlap, kPingPong, kPSmem>>(smem);
  // One map per operand over its whole packed matrix: the kernel names (column of the head, first row).
  const CUtensorMap map_q = make_tensor_map_bf16_2d(q.data, batch.total_q(), shape.q_dim(), q.strides[0] * 2,
                                                    kBlockM, 64, TmaSwizzle::B128);
  const CUtensorMap map_k = make_tensor_map_bf16_2d(k.data, batch.total_k(), shape.kv_dim(), k.strides[0] * 2,
                                                    kFlashBlockN, 64, TmaSwizzle::B128);
  const CUtensorMap map_v = make_tensor_map_bf16_2d(v.data, batch.total_k(), shape.kv_dim(), v.strides[0] * 2,
                                                    kFlashBlockN, 64, TmaSwizzle::B128);
  FlashWgmmaParams p = flash_common_params(out, batch, shape, heads_inner);
  const dim3 grid = flash_grid(batch, shape, kBlockM, heads_inner);
  kernel<<<grid, 128 * (1 + kConsumers), smem, stream>>>(map_q, map_k, map_v, p);
  TVLLM_CHECK_LAUNCH();
}

// Blocks of this variant the GPU keeps resident per SM (registers and shared memory decide; the sweep prints
// it: 2 for the 64-row variants, 1 for the others, is what step 6 counts on).
template <int D, int kConsumers, bool kOverlap, bool kPingPong, bool kPSmem = false>
int resident_blocks_per_sm() {
  const auto kernel = flash_wgmma_kernel<D, kConsumers, kOverlap, kPingPong, kPSmem>;
  constexpr int smem = flash_smem_bytes(D, 64 * kConsumers, kPSmem);
  TVLLM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  TVLLM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                        cudaSharedmemCarveoutMaxShared));
  int blocks = 0;
  TVLLM_CUDA_CHECK(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, 128 * (1 + kConsumers), smem));
  return blocks;
}

// The compiled variants: one line each, (head_dim, consumer warpgroups, overlap, ping-pong, P in shared
// memory). Every config of kFlashConfigs64 / kFlashConfigs128 must be among them (test_15_flash checks it).
struct Variant {
  int d, consumers;
  bool overlap, ping_pong, p_smem;
  void (*launch)(const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                 const AttentionBatch&, const AttentionShape&, bool, cudaStream_t);
  int (*blocks_per_sm)();
};
constexpr Variant kVariants[] = {
    {64, 2, false, false, false, launch_flash_wgmma<64, 2, false, false>,
     resident_blocks_per_sm<64, 2, false, false>},
    {64, 2, false, true, false, launch_flash_wgmma<64, 2, false, true>,
     resident_blocks_per_sm<64, 2, false, true>},
    {64, 2, true, false, false, launch_flash_wgmma<64, 2, true, false>,
     resident_blocks_per_sm<64, 2, true, false>},
    {64, 2, true, true, false, launch_flash_wgmma<64, 2, true, true>,
     resident_blocks_per_sm<64, 2, true, true>},
    {64, 3, false, false, false, launch_flash_wgmma<64, 3, false, false>,
     resident_blocks_per_sm<64, 3, false, false>},
    {64, 3, false, true, false, launch_flash_wgmma<64, 3, false, true>,
     resident_blocks_per_sm<64, 3, false, true>},
    {64, 3, true, false, true, launch_flash_wgmma<64, 3, true, false, true>,
     resident_blocks_per_sm<64, 3, true, false, true>},
    {64, 1, false, false, false, launch_flash_wgmma<64, 1, false, false>,
     resident_blocks_per_sm<64, 1, false, false>},
    {64, 1, true, false, true, launch_flash_wgmma<64, 1, true, false, true>,
     resident_blocks_per_sm<64, 1, true, false, true>},
    {128, 2, false, false, false, launch_flash_wgmma<128, 2, false, false>,
     resident_blocks_per_sm<128, 2, false, false>},
    {128, 2, false, true, false, launch_flash_wgmma<128, 2, false, true>,
     resident_blocks_per_sm<128, 2, false, true>},
    {128, 2, true, false, false, launch_flash_wgmma<128, 2, true, false>,
     resident_blocks_per_sm<128, 2, true, false>},
    {128, 2, true, false, true, launch_flash_wgmma<128, 2, true, false, true>,
     resident_blocks_per_sm<128, 2, true, false, true>},
    {128, 2, true, true, true, launch_flash_wgmma<128, 2, true, true, true>,
     resident_blocks_per_sm<128, 2, true, true, true>},
};

const Variant* find_variant(int64_t head_dim, const FlashConfig& c) {
  for (const Variant& v : kVariants)
    if (v.d == head_dim && 64 * v.consumers == c.block_m && v.overlap == c.overlap &&
        v.ping_pong == (c.schedule == FlashSchedule::PingPong) && v.p_smem == c.p_smem)
      return &v;
  return nullptr;
}

}  // namespace

bool flash_wgmma_supports(const AttentionShape& shape) {
  return shape.head_dim == 64 || shape.head_dim == 128;
}

void check_flash_wgmma_args(const TensorView& out, const TensorView& q, const TensorView& k,
                            const TensorView& v, int64_t total_q, int64_t total_k,
                            const AttentionShape& shape) {
  shape.validate();
  TVLLM_REQUIRE(flash_wgmma_supports(shape),
                "flash_wgmma: head_dim must be 64 or 128, got " + std::to_string(shape.head_dim) +
                    " (lesson 07's attention() runs the others; attention_hopper() picks it for you)");
  const auto check = [](const TensorView& t, const char* name, int64_t rows, int64_t cols) {
    const std::string what = std::string("flash_wgmma: ") + name;
    TVLLM_REQUIRE(
        t.rank() == 2 && t.shape[0] == rows && t.shape[1] == cols,
        what + " must be [" + std::to_string(rows) + ", " + std::to_string(cols) + "], got " + t.describe());
    TVLLM_REQUIRE(t.dtype == DType::BF16 && t.device == Device::CUDA,
                  what + " must be bf16 on cuda, got " + t.describe());
    TVLLM_REQUIRE(t.strides.size() == 2 && t.strides[1] == 1, what + " must have contiguous columns");
    TVLLM_REQUIRE(rows <= 1 || t.strides[0] >= cols, what + " rows overlap (row stride below its width)");
    TVLLM_REQUIRE(rows == 0 || t.data != nullptr, what + " has no data");
    // TMA's rules for a tensor map: the base and the row pitch are multiples of 16 bytes.
    TVLLM_REQUIRE(
        tma_matrix_ok(t),
        what + " must start 16-byte aligned with rows a multiple of 8 elements apart (TMA), got stride " +
            std::to_string(t.strides[0]));
  };
  check(q, "q", total_q, shape.q_dim());
  check(out, "out", total_q, shape.q_dim());
  check(k, "k", total_k, shape.kv_dim());
  check(v, "v", total_k, shape.kv_dim());
}

FlashConfigList flash_configs(int64_t head_dim) {
  if (head_dim == 64) return {kFlashConfigs64, static_cast<int>(std::size(kFlashConfigs64))};
  if (head_dim == 128) return {kFlashConfigs128, static_cast<int>(std::size(kFlashConfigs128))};
  throw InputError("flash_configs: head_dim must be 64 or 128, got " + std::to_string(head_dim));
}

const FlashConfig& flash_default_config(int64_t head_dim, int64_t max_q_len) {
  const FlashConfigList list = flash_configs(head_dim);
  const auto pick = [&](const auto& defaults) -> const FlashConfig& {
    for (const FlashDefault& d : defaults)
      if (max_q_len <= d.max_q_len) return list[d.config];
    return list[std::end(defaults)[-1].config];
  };
  return head_dim == 64 ? pick(kFlashDefaults64) : pick(kFlashDefaults128);
}

bool flash_wgmma_has_config(int64_t head_dim, const FlashConfig& config) {
  return find_variant(head_dim, config) != nullptr;
}

int flash_wgmma_blocks_per_sm(int64_t head_dim, const FlashConfig& config) {
  const Variant* variant = find_variant(head_dim, config);
  TVLLM_REQUIRE(variant != nullptr, std::string("flash_wgmma_blocks_per_sm: config ") + config.name +
                                        " is not compiled for head_dim " + std::to_string(head_dim));
  require_hopper("flash_wgmma_blocks_per_sm");
  return variant->blocks_per_sm();
}

void flash_wgmma(const TensorView& out, const TensorView& q, const TensorView& k, const TensorView& v,
                 const AttentionBatch& batch, const AttentionShape& shape, cudaStream_t stream,
                 const FlashConfig& config) {
  check_attention_queries(out, q, batch, shape);  // lesson 07's checks of the batch and the query side
  check_flash_wgmma_args(out, q, k, v, batch.total_q(), batch.total_k(), shape);
  const Variant* variant = find_variant(shape.head_dim, config);
  TVLLM_REQUIRE(variant != nullptr, std::string("flash_wgmma: config ") + config.name +
                                        " is not compiled for head_dim " + std::to_string(shape.head_dim) +
                                        " (flash_wgmma.cu's kVariants)");
  require_hopper("flash_wgmma");
  if (batch.total_q() == 0) return;  // no query anywhere (and a tensor map needs at least one row)
  variant->launch(out, q, k, v, batch, shape, config.order == FlashOrder::HeadsInner, stream);
}

void flash_wgmma(const TensorView& out, const TensorView& q, const TensorView& k, const TensorView& v,
                 const AttentionBatch& batch, const AttentionShape& shape, cudaStream_t stream) {
  TVLLM_REQUIRE(flash_wgmma_supports(shape),
                "flash_wgmma: head_dim must be 64 or 128, got " + std::to_string(shape.head_dim) +
                    " (lesson 07's attention() runs the others; attention_hopper() picks it for you)");
  flash_wgmma(out, q, k, v, batch, shape, stream, flash_default_config(shape.head_dim, batch.max_q_len()));
}

const char* flash_schedule_name(FlashSchedule schedule) {
  return schedule == FlashSchedule::PingPong ? "ping-pong" : "plain";
}

void attention_hopper(const TensorView& out, const TensorView& q, const TensorView& k, const TensorView& v,
                      const AttentionBatch& batch, const AttentionShape& shape, AttentionKernel kernel,
                      AttentionWorkspace* workspace, cudaStream_t stream) {
  const bool ours = q.device == Device::CUDA && kernel == AttentionKernel::V2Flash &&
                    flash_wgmma_supports(shape) && hopper_available();
  if (!ours) {
    attention(out, q, k, v, batch, shape, kernel, workspace, stream);
    return;
  }
  if (workspace) workspace->check(batch, shape, kernel);
  flash_wgmma(out, q, k, v, batch, shape, stream);
}

void wgmma_pv_tile(const TensorView& d, const TensorView& p, const TensorView& v, cudaStream_t stream) {
  const int64_t n = v.rank() == 2 ? v.dim(1) : 0;
  const auto is = [](const TensorView& t, DType dtype, int64_t rows, int64_t cols) {
    return t.rank() == 2 && t.dtype == dtype && t.device == Device::CUDA && t.is_contiguous() &&
           t.dim(0) == rows && t.dim(1) == cols;
  };
  TVLLM_REQUIRE(n == 64 || n == 128, "wgmma_pv_tile: v must be [128, 64] or [128, 128], got " + v.describe());
  TVLLM_REQUIRE(is(v, DType::BF16, kFlashBlockN, n),
                "wgmma_pv_tile: v must be bf16 on the GPU, got " + v.describe());
  TVLLM_REQUIRE(is(p, DType::BF16, 64, kFlashBlockN),
                "wgmma_pv_tile: p must be bf16 [64, 128] on the GPU, got " + p.describe());
  TVLLM_REQUIRE(is(d, DType::F32, 64, n), "wgmma_pv_tile: d must be fp32 [64, " + std::to_string(n) +
                                              "] on the GPU, got " + d.describe());
  require_hopper("wgmma_pv_tile");
  const CUtensorMap map_v =
      make_tensor_map_bf16_2d(v.data, kFlashBlockN, n, n * 2, kFlashBlockN, 64, TmaSwizzle::B128);
  if (n == 64)
    wgmma_pv_tile_kernel<64><<<1, 128, 0, stream>>>(map_v, p.ptr<const __nv_bfloat16>(), d.ptr<float>());
  else
    wgmma_pv_tile_kernel<128><<<1, 128, 0, stream>>>(map_v, p.ptr<const __nv_bfloat16>(), d.ptr<float>());
  TVLLM_CHECK_LAUNCH();
}

}  // namespace tvllm
